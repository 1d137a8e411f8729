"""Eviction order (pure, no Ray).

The master keeps every complete object in one recency list: a plain ``dict`` in insertion
order, where a touch removes the key and inserts it again at the end (O(1) touch and
removal; the holes removals leave are compacted when the dict next grows, amortized O(1)).
It costs about 60 bytes a key less than an ``OrderedDict``, whose linked-list node each key
also needs; at millions of keys that is a tenth of the master's memory. Publishing an object (``put_end``) and every get hit move it to the
most-recent end. The list is exact LRU; what makes the policy "approximate" is that a
replica is chosen per node and some objects are skipped.

Victims for one node are picked oldest first in two passes:

1. objects with a DRAM replica on that node that are complete, not leased (a reader may
   be copying their bytes), not being offloaded, and not pinned (a soft pin whose TTL
   passed counts as unpinned);
2. only if pass 1 did not free enough: soft-pinned objects, oldest first.

Pending objects are never in the list; hard-pinned objects are never chosen. Eviction
frees whole extents, so the bytes freed may exceed the target by less than one object.
"""

from __future__ import annotations

from typing import Iterable

from mooncake_ray._private.master.types import Obj, Pin, Replica, Tier


class RecencyIndex:
    """Keys of complete objects, least recently used first."""

    def __init__(self) -> None:
        self._order: dict[str, None] = {}

    def touch(self, key: str) -> None:
        order = self._order
        order.pop(key, None)
        order[key] = None

    def discard(self, key: str) -> None:
        self._order.pop(key, None)

    def __iter__(self):
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def keys(self) -> list[str]:
        return list(self._order)


def pick_victims(
    order: Iterable[str],
    objects: dict[str, Obj],
    node_id: str,
    need_bytes: int,
    now: float,
    tier: Tier = Tier.DRAM,
) -> list[tuple[Obj, Replica]]:
    """Replicas on ``node_id`` (in ``tier``) to evict, in eviction order, until at least
    ``need_bytes`` are freed or nothing evictable is left."""
    chosen: list[tuple[Obj, Replica]] = []
    freed = 0
    soft: list[tuple[Obj, Replica]] = []
    for key in order:
        obj = objects.get(key)
        if obj is None or not obj.complete or obj.leased(now):
            continue
        rep = next((r for r in obj.replicas if r.node_id == node_id and r.tier is tier), None)
        if rep is None or rep.offloading:
            continue
        pin = obj.effective_pin(now)
        if pin is Pin.HARD:
            continue
        if pin is Pin.SOFT:
            soft.append((obj, rep))
            continue
        chosen.append((obj, rep))
        freed += rep.length
        if freed >= need_bytes:
            return chosen
    for obj, rep in soft:
        chosen.append((obj, rep))
        freed += rep.length
        if freed >= need_bytes:
            break
    return chosen
