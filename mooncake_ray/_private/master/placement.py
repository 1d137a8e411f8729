"""Where a new object's replicas go (pure, no Ray).

A strategy orders the candidate store nodes; the master then takes nodes in that order,
first those that fit the value without evicting anything, then (second pass, same order)
those where eviction can make room. Replicas always land on distinct nodes.

- ``random``: uniformly shuffled (seeded RNG, so simulations replay).
- ``free_ratio_first``: most free fraction first; ties by node id.
- ``local_first``: the caller's own Ray node first (its reads are then shared-memory
  copies), the rest as ``free_ratio_first``.
"""

from __future__ import annotations

import random
from typing import Sequence

from mooncake_ray._private.master.allocator import ExtentAllocator
from mooncake_ray._private.master.types import NodeInfo

STRATEGIES = ("random", "free_ratio_first", "local_first")


def order_nodes(
    strategy: str,
    nodes: Sequence[NodeInfo],
    allocators: dict[str, ExtentAllocator],
    client_node: str | None,
    rng: random.Random,
) -> list[NodeInfo]:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown allocation strategy {strategy!r}; allowed: {STRATEGIES}")
    if strategy == "random":
        out = list(nodes)
        rng.shuffle(out)
        return out

    def free_ratio(n: NodeInfo) -> tuple[float, str]:
        a = allocators[n.node_id]
        return (-(a.free / a.capacity), n.node_id)

    out = sorted(nodes, key=free_ratio)
    if strategy == "local_first" and client_node:
        local = [n for n in out if client_node in (n.node_id, n.ray_node_id)]
        out = local + [n for n in out if n not in local]
    return out
