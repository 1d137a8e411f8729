"""Copies that come back: values with fewer live copies than they had, copied node to
node until they have them again (pure, no Ray).

A value falls short of its copies in two ways: a node holding one of them is lost
(unmounted: its process died, it went silent, it restarted as a new incarnation), or a
put is placed on fewer nodes than it asked for (fewer usable nodes at that moment). A
put acknowledged while one of its nodes died is the first kind: the fence answers once
the surviving node has recorded it (fence.py), and the lost copy is noted here.

``short`` keeps, per key, the generation and the copies wanted; it is checked lazily
(a value removed, replaced, or whose node came back and re-adopted it, simply drops out
when it is next looked at). Repairs wait ``repair_delay_s`` after the loss: a store node
that Ray restarts re-adopts its arena within seconds (store/arena.py), and copying all
it held meanwhile would only double the work. They wait no longer than that: once every
node lost in the last ``repair_delay_s`` has mounted again (with its arena re-adopted,
or empty: a new process without it, a replaced host), nothing more can come back, and
what is still short is due at once. (The copies then start after the restarted node's
own start-up, not on top of it.)

The copy itself is the drain's (drain.py): ``plan`` reserves an extent on a node without
a copy (where it fits, else evicting there) as a replica that is not readable yet, the
store node holding a readable DRAM copy writes the bytes into it (a memcpy into the
peer's mapped arena on one host, a UCX put across hosts) and reports each copy
(``done``): the new replica becomes readable and is recorded in its node's inventory.
Never two copies on one node. Each store node asks for the repairs it is the source of,
in bounded batches (``StoreNodeActor``'s repair loop paces them, so puts and gets keep
their rate); oldest loss first, and within one loss the most recently used values first.

A value never keeps more copies than it had: a lost node that comes back (Ray restarted it,
it re-adopts its arena) after its values were copied again has its returning copy dropped
(``MasterState.mount``), and a copy finished after the node came back is dropped (``done``).

What is not repaired: a value whose only copies are on disk (it is read back through a
promotion first), and, after a master restart, values that were short before it (the
nodes' inventories do not say how many copies a value had).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from mooncake_ray._private.master.types import NodeInfo, Obj, Policy, Replica, Tier

if TYPE_CHECKING:
    from mooncake_ray._private.master.replicas import ReplicaTable
    from mooncake_ray._private.master.table import ObjectTable


PRUNE_PER_TICK = 8192  # records checked per tick (a lost node can leave millions short)
PLAN_SCAN = 65536  # records one plan looks at, at most


@dataclass
class _Short:
    gen: int
    want: int
    size: int
    since: float  # when it fell short (repairs wait repair_delay_s from here)


def copies(obj: Obj) -> int:
    """Distinct nodes holding a readable copy of ``obj``."""
    return len({r.node_id for r in obj.replicas if r.ready})


class Repairs:
    """The values short of copies and the copies in flight (see the module docstring)."""

    def __init__(self, policy: Policy, clock: Callable[[], float], nodes: dict[str, NodeInfo], alloc: dict,
                 objects: ObjectTable, reps: ReplicaTable, counters: dict, mirror) -> None:
        self.policy = policy
        self._clock = clock
        self._nodes = nodes
        self._alloc = alloc
        self._objects = objects
        self._reps = reps
        self._counters = counters
        self._mirror = mirror
        self.short: dict[str, _Short] = {}  # oldest loss first
        # (key, dst, offset) -> (obj, the replica written, the copy's lease on obj)
        self.copying: dict[tuple[str, str, int], tuple[Obj, Replica, int]] = {}
        self._copying_keys: set[str] = set()
        self.short_bytes = 0  # value bytes of the records in ``short``
        self._to_prune: list[str] = []
        self.awaited: dict[str, float] = {}  # lost nodes that may come back with copies: when lost
        counters.update(repairs=0, repair_bytes=0, repair_failures=0, surplus_copies_dropped=0)

    # ------------------------------------------------------------------ noting ----
    def note(self, key: str, gen: int, want: int, size: int) -> None:
        """``key`` (generation ``gen``, ``size`` bytes) wants ``want`` copies and may have fewer."""
        if want > 1 and key not in self.short:
            self.short[key] = _Short(gen, want, size, self._clock())
            self.short_bytes += size

    def recent_first(self, start: int) -> None:
        """Order the records noted since ``short`` had ``start`` of them (one loss's) most
        recently used first, as the read index orders the values (they are hot objects):
        the values being read are whole again first."""
        if len(self.short) - start < 2:
            return
        fresh = set(itertools.islice(self.short, start, None))
        for key in self._objects.index.hot_keys_recent_first():
            if key in fresh:
                self.short[key] = self.short.pop(key)  # to the end, in this order

    def lost(self, node_id: str) -> None:
        """``node_id`` was unmounted; it may come back with its copies (re-adopting its arena)."""
        now = self._clock()
        for n in [n for n, t in self.awaited.items() if t <= now - self.policy.repair_delay_s]:
            del self.awaited[n]  # waited for long enough
        self.awaited[node_id] = now

    def back(self, node_id: str) -> None:
        """``node_id`` mounted: what it re-adopted is restored, the rest is not coming back."""
        self.awaited.pop(node_id, None)

    def _horizon(self, now: float) -> float:
        """Losses up to this time may be repaired: ``repair_delay_s`` ago, or now when
        every node lost since then has mounted again. Reads ``awaited`` only (``due`` runs
        without the actor's lock)."""
        horizon = now - self.policy.repair_delay_s
        return horizon if any(t > horizon for t in tuple(self.awaited.values())) else now

    def _drop(self, key: str) -> None:
        self.short_bytes -= self.short.pop(key).size

    def _still_short(self, key: str) -> bool:
        """Whether ``key``'s record still stands; drops it otherwise (removed, replaced, or
        whole again: repaired, or its node came back and re-adopted it)."""
        s = self.short.get(key)
        if s is None:
            return False
        obj = self._objects.peek(key)
        if obj is None or obj.gen != s.gen or (copies(obj) >= s.want and key not in self._copying_keys):
            self._drop(key)
            return False
        return True

    def prune(self, limit: int = PRUNE_PER_TICK) -> int:
        """Check up to ``limit`` records (the next ones of a pass over all of them); returns
        how many are left."""
        if not self._to_prune:
            self._to_prune = list(self.short)
        chunk, self._to_prune = self._to_prune[-limit:], self._to_prune[:-limit]
        for key in chunk:
            self._still_short(key)
        return len(self.short)

    # ------------------------------------------------------------------- copies ----
    def due(self) -> bool:
        """Whether a repair may be planned now: the oldest loss is ``repair_delay_s`` old, or
        every node lost since then is back (``_horizon``)."""
        first = next(iter(self.short.values()), None)
        return first is not None and first.since <= self._horizon(self._clock())

    def plan(self, node_id: str, max_bytes: int) -> list[list]:
        """The next copies ``node_id`` is to make: ``[key, gen, size, src_offset, dst_node,
        dst_offset]`` each, about ``max_bytes`` in all (at least one when one is due)."""
        now = self._clock()
        horizon = self._horizon(now)
        out, total = [], 0
        for key in list(itertools.islice(self.short, PLAN_SCAN)):
            if total >= max_bytes:
                break
            if self.short[key].since > horizon:
                break  # the rest are younger still
            if key in self._copying_keys or not self._still_short(key):
                continue
            obj = self._objects.get(key)
            src = next((r for r in obj.replicas if r.node_id == node_id and r.tier is Tier.DRAM and r.ready
                        and not r.offloading), None)
            if src is None:
                continue  # another node's copy is the source (or only disk holds it)
            held = {r.node_id for r in obj.replicas}
            targets = sorted((n for n in self._nodes.values()
                              if n.node_id not in held and not n.suspect and not n.draining),
                             key=lambda n: -self._alloc[n.node_id].free)
            dst, _gone = self._reps.reserve_copy(obj, targets, now)
            if dst is None:
                continue  # no room on a node without a copy (tried again at the next plan), or gone
            obj.replicas.append(dst)
            lease = self._reps.hold_for_copy(obj, dst.deadline, now)  # both extents stay put meanwhile
            self.copying[(key, dst.node_id, dst.offset)] = (obj, dst, lease)
            self._copying_keys.add(key)
            out.append([key, obj.gen, obj.size, src.offset, dst.node_id, dst.offset])
            total += obj.size
        return out

    def done(self, items) -> None:
        """Copies a store node made: ``[key, gen, dst_node, dst_offset, ok]`` each."""
        now = self._clock()
        for key, gen, dst_node, dst_offset, ok in items:
            got = self.copying.pop((key, dst_node, dst_offset), None)
            if got is None:
                continue
            self._copying_keys.discard(key)
            obj, rep, lease = got
            self._reps.release_copy(key, obj.gen, obj, lease, now)
            outcome = self._reps.settle_copy(key, gen, obj, rep, ok, now)  # "left": still short, planned again
            if outcome == "failed":
                self._counters["repair_failures"] += 1
            if outcome != "done":
                continue
            self._mirror.key(key)
            self._counters["repairs"] += 1
            self._counters["repair_bytes"] += obj.size
            s = self.short.get(key)
            if s is not None and s.gen == obj.gen and copies(obj) > s.want and rep in obj.replicas:
                # the lost node came back with its copy while this one was made: one too many
                self._reps.drop_replica(obj, rep, now)
                self._counters["surplus_copies_dropped"] += 1

    def expire(self, now: float) -> None:
        """Drop the reserved extents of copies not reported by their deadline."""
        for k, (obj, rep, lease) in list(self.copying.items()):
            if rep.deadline <= now:
                del self.copying[k]
                self._copying_keys.discard(k[0])
                self._reps.release_copy(obj.key, obj.gen, obj, lease, now)
                if self._objects.get(obj.key) is obj and any(r is rep for r in obj.replicas):
                    self._reps.drop_replica(obj, rep, now)
