"""The master's shards (pure, no Ray): which shard owns a key, which part of each store
node's arena a shard allocates from, and the store's statistics summed over shards.

With ``master.shards = N`` the store runs N master actors. Each owns the keys whose hash
falls on it: their index, leases, pins, eviction order, put slabs, and a disjoint,
page-aligned part of every store node's arena (and 1/N of its spill capacity), so shards
never allocate the same bytes and talk to each other only about KV chains whose links
cross shards (``master/chainlinks.py``). Every process routes
a key the same way (``shard_of``: CRC-32 of its UTF-8 bytes, not Python's salted
``hash``), and a store node keeps one inventory per shard, mounted on and heartbeating to
that shard alone: a shard that restarts rebuilds from those inventories while the others
go on serving.

What sharding costs: a value must fit in one shard's part of an arena (1/N of
``segment_size_bytes``), and each shard evicts within its own part, so LRU order holds per
shard, not across the store (keys spread evenly by hash, so the parts fill evenly).
"""

from __future__ import annotations

import zlib

from mooncake_ray._private.master.allocator import ALIGN

MAX_SHARDS = 64


def shard_of(key: str, shards: int) -> int:
    """The shard that owns ``key``: the same in every process and every run."""
    if shards == 1:
        return 0
    return zlib.crc32(key.encode("utf-8", "surrogatepass")) % shards


def split(keys, shards: int) -> list[list[int]]:
    """The indices of ``keys`` owned by each shard, in order (a list per shard)."""
    out: list[list[int]] = [[] for _ in range(shards)]
    crc = zlib.crc32
    for i, k in enumerate(keys):
        out[crc(k.encode("utf-8", "surrogatepass")) % shards].append(i)
    return out


def arena_part(arena_length: int, shards: int, shard: int) -> tuple[int, int]:
    """``(offset, length)`` of the part of an arena of ``arena_length`` bytes that
    ``shard`` allocates from: equal, page-aligned, disjoint parts (the few bytes left
    over at the end are not used).

    Raises:
        ValueError: a shard out of range, or parts smaller than a page.
    """
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} is outside 0..{shards - 1}")
    length = arena_length // shards // ALIGN * ALIGN
    if length <= 0:
        raise ValueError(f"an arena of {arena_length} bytes cannot be split into {shards} parts of a page or more")
    return shard * length, length


def merge_stats(parts: list[dict]) -> dict:
    """The store's statistics from each shard's ``stats()``: counters and sizes summed,
    each node's DRAM and disk summed over its parts, ``recovering`` if any shard is (or
    did not answer), ``master_shards`` the count; with several shards, their own answers
    under ``shards`` (a shard that did not answer is an ``{"error": ...}`` entry there
    and adds nothing)."""
    if len(parts) == 1 and "error" not in parts[0]:
        return {**parts[0], "master_shards": 1}
    answered = [p for p in parts if "error" not in p]
    out: dict = {}
    for p in answered:
        for k, v in p.items():
            if k == "nodes":
                continue
            if isinstance(v, bool):
                out[k] = out.get(k, False) or v
            elif isinstance(v, (int, float)):
                out[k] = out.get(k, 0) + v
    nodes: dict = {}
    for p in answered:
        for node_id, n in p.get("nodes", {}).items():
            cur = nodes.get(node_id)
            if cur is None:
                nodes[node_id] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in n.items()}
                continue
            cur["suspect"] = cur.get("suspect", False) or n.get("suspect", False)
            for tier in ("dram", "disk"):
                for k, v in n.get(tier, {}).items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        cur[tier][k] = cur[tier].get(k, 0) + v
                    elif v and not cur[tier].get(k):
                        cur[tier][k] = v  # a degraded disk's reason
    out["nodes"] = nodes
    out["recovering"] = any(p.get("recovering") for p in answered) or len(answered) < len(parts)
    out["master_shards"] = len(parts)
    out["shards"] = [{k: v for k, v in p.items() if k != "nodes"} for p in parts]
    return out
