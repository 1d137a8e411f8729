"""Eviction order (pure, no Ray).

The master keeps every complete object in one recency list, held by its object table's
index (``table.py``; a doubly linked list through the records in C++, O(1) touch and
removal, no per-key Python object). Publishing an object (``put_end``, a commit) and
every get hit move it to the most-recent end. The list is exact LRU; what makes the
policy "approximate" is that a replica is chosen per node and some objects are skipped.

Victims for one node are picked oldest first in two passes:

1. objects with a replica on that node in the tier being freed that are complete, not
   leased (a reader may be copying their bytes), not being offloaded, and not pinned (a
   soft pin whose TTL passed counts as unpinned);
2. only if pass 1 did not free what the allocation needs (never for a round that only
   frees ahead, such as the one past the high watermark): soft-pinned objects, oldest first.

With chain-aware eviction (``chains.py``), orphans go first and a value whose children are
stored waits for them: a parent goes right after its last child. The index does the same
for its cold records (it keeps the chain links between them), and lists those it holds.

Pending objects are never in the list; hard-pinned objects are never chosen. The index
judges its cold records itself (a cold record is never pinned or being offloaded: see
``table.py``) and skips those not on the node or leased; the hot ones it lists for the
state machine to judge here. Eviction frees whole extents, so the bytes freed may exceed
the target by less than one object.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mooncake_ray._private.master.chains import Chains, Picker
from mooncake_ray._private.master.types import Pin, Tier

if TYPE_CHECKING:
    from mooncake_ray._private.master.table import ObjectTable


EVICT, SOFT = 1, 2


def judge(obj, node_id: str, now: float, tier: Tier = Tier.DRAM):
    """Whether a hot object's replica on ``node_id`` in ``tier`` may go: ``(EVICT, rep)``,
    ``(SOFT, rep)`` (only if nothing unpinned is left), or None (leased, pending, being
    offloaded, being written (a promotion, a drain's move or a repair copies into it: its
    extent freed now would be handed out while those bytes are still on their way),
    hard-pinned, or no such replica)."""
    if obj is None or not obj.complete or obj.leased(now):
        return None
    rep = next((r for r in obj.replicas if r.node_id == node_id and r.tier is tier), None)
    if rep is None or rep.offloading or not rep.ready:
        return None
    pin = obj.effective_pin(now)
    if pin is Pin.HARD:
        return None
    return (SOFT if pin is Pin.SOFT else EVICT), rep


def pick_victims(table: ObjectTable, node_id: str, need_bytes: int, now: float, tier: Tier = Tier.DRAM,
                 chains: Chains | None = None, must: int | None = None) -> list:
    """Replicas on ``node_id`` (in ``tier``) to evict, in eviction order, until at least
    ``need_bytes`` are freed or nothing evictable is left. Each is ``(obj, rep)`` for a
    hot object, or ``(key, gen, size, offset, length)`` for a cold record. Soft-pinned
    values go only while less than ``must`` (default ``need_bytes``) is freed: the bytes
    the allocation cannot do without, not what the round frees in advance.

    With ``chains`` (chain-aware eviction, chains.py), orphans go first, then leaves: a
    value whose children are stored waits for them, and a pass that frees nothing else
    takes such values (least recent first)."""
    pick = Picker(chains, need_bytes, must)
    soft: list = []
    if chains is not None:
        take_orphans(table, chains, node_id, now, tier, pick)
    taken = {obj.key for obj, _rep in pick.chosen}  # orphans (hydrated: the scan lists them hot)
    for key, cold in table.scan(node_id, tier, now):
        if pick.done():
            return pick.chosen
        if cold is not None:
            if key not in taken:
                if pick.blocks(key, True):  # one copy; its children are stored
                    pick.hold(key, (key, *cold), cold[3])
                else:
                    pick.take(key, (key, *cold), cold[3])
            continue
        obj = table.hot(key)
        verdict = judge(obj, node_id, now, tier)
        if verdict is None or key in taken:
            continue
        if verdict[0] is SOFT:
            soft.append((obj, verdict[1]))
        else:
            pick.offer(obj, verdict[1])
    forced = pick.close(soft, pinned_tail(table, chains, now))
    if forced:
        chains.counters["chain_tail_evictions"] += forced
    return pick.chosen


def pinned_tail(table: ObjectTable, chains: Chains | None, now: float):
    """Whether a value's chain tail holds a pinned value (a forced eviction passes such a
    value over while it can: the pin holds the whole chain)."""
    if chains is None:
        return None

    def pinned(key: str) -> bool:
        for k in chains.tail(key):
            obj = table.hot(k)  # a pinned value is always hot
            if obj is not None and obj.effective_pin(now) is not Pin.NONE:
                return True
        return False
    return pinned


def take_orphans(table: ObjectTable, chains: Chains, node_id: str, now: float, tier: Tier, pick: Picker) -> None:
    """Orphans on ``node_id`` (no prefix lookup reaches them) go before anything else,
    except soft-pinned ones (a reader asked for them by key): they go as soft-pinned values do."""
    for key in list(chains.orphans):
        if pick.done():
            return
        obj = table.get(key)
        verdict = judge(obj, node_id, now, tier)
        if verdict is not None and verdict[0] == EVICT:
            pick.take(key, (obj, verdict[1]), verdict[1].length)
            chains.counters["chain_tail_evictions"] += 1
