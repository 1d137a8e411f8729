"""Moving a leaving store node's values to the other nodes (pure, no Ray).

When Ray drains a node (an operator's ``ray drain-node``, the autoscaler's idle
termination, a preemption notice with a deadline), its store node asks the master to
drain it (``begin``): the node takes no new values (placement and put slabs skip it), and
its values are moved, most recently used first, in batches:

- ``plan``: for the next values with a readable copy on the node (in its arena, else on
  its disk) and none elsewhere, reserve an extent on another node (where one fits without
  evicting; else where eviction, or an offload to that node's spill tier, makes room), as
  a replica that is not readable yet (as a promotion from disk reserves one,
  ``tiering.py``).
- the store node writes the bytes into the reserved extents (one batched transfer: from
  its arena, or, for a value only on its disk, first read through its spill tier into a
  buffer of its own; ``FROM_DISK`` as the source offset says which) and reports each move
  (``done``): a moved value's new replica becomes readable and its copy on the leaving
  node is dropped. A failed move frees the extent.
- ``end``: what was not moved (no room left anywhere, the deadline came first) is counted
  by keys and bytes; the actor then unmounts the node, and those values become misses.

Reads keep being served from the leaving node's copy until its value is moved (then from
the new one), so a drain never fails a read. ``MasterState`` holds one ``Drains``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from mooncake_ray._private.master.types import NodeInfo, Policy, Tier

if TYPE_CHECKING:
    from mooncake_ray._private.master.replicas import ReplicaTable
    from mooncake_ray._private.master.table import ObjectTable


FROM_DISK = -1  # a move's source offset when the value is read from the node's spill tier
NO_ROOM_WAIT_S = 5.0  # how long a drain asks again for room that is not there


def _source(obj, node_id: str):
    """The copy of ``obj`` on ``node_id`` a move reads: a readable one in the arena, else a
    readable one on disk; None if neither."""
    disk = None
    for r in obj.replicas:
        if r.node_id != node_id or not r.ready:
            continue
        if r.tier is Tier.DRAM and not r.offloading:
            return r
        if r.tier is Tier.DISK:
            disk = r
    return disk


@dataclass
class _Drain:
    order: list[str]  # keys with a copy on the node, most recently used first
    cursor: int = 0
    settled: bool = False  # the last rescan found nothing new
    transient: bool = False  # this pass skipped a value only here that was between tiers
    no_room_since: float = 0.0  # when a value last found no room anywhere (0: it did)
    moving: dict = field(default_factory=dict)  # (key, dst node, dst offset) -> (obj, replica, lease)
    moving_keys: set = field(default_factory=set)
    failed_keys: set = field(default_factory=set)  # a move failed: not tried again
    moved: int = 0
    moved_bytes: int = 0
    failed: int = 0


class Drains:
    """The drains in progress, by node id (see the module docstring)."""

    def __init__(self, policy: Policy, clock: Callable[[], float], nodes: dict[str, NodeInfo], alloc: dict,
                 objects: ObjectTable, reps: ReplicaTable, counters: dict, mirror,
                 busy: Callable[[str], bool]) -> None:
        self.policy = policy
        self._clock = clock
        self._nodes = nodes
        self._alloc = alloc
        self._objects = objects
        self._reps = reps
        self._counters = counters
        self._mirror = mirror
        self._busy = busy  # node id -> whether writes into it are still in flight (puts, slabs)
        self.active: dict[str, _Drain] = {}
        counters.update(drains=0, drain_moved_keys=0, drain_moved_bytes=0, drain_lost_keys=0,
                        drain_lost_bytes=0)

    def _on_node(self, node_id: str) -> list[str]:
        """Keys with a replica on ``node_id``, most recently used first."""
        out = []
        for key in reversed(self._objects.keys_with_prefix("")):
            obj = self._objects.peek(key)
            if obj is not None and any(r.node_id == node_id for r in obj.replicas):
                out.append(key)
        return out

    def begin(self, node_id: str) -> bool:
        """Start draining ``node_id`` (idempotent). False: the node is not mounted."""
        node = self._nodes.get(node_id)
        if node is None:
            return False
        if node_id not in self.active:
            node.draining = True
            self.active[node_id] = _Drain(self._on_node(node_id))
            self._counters["drains"] += 1
        return True

    def _targets(self, node_id: str) -> list[NodeInfo]:
        """The nodes a drained value may go to, most free first (at the start of a batch)."""
        usable = [n for n in self._nodes.values() if n.node_id != node_id and not n.suspect and not n.draining]
        return sorted(usable, key=lambda n: -self._alloc[n.node_id].free)

    def plan(self, node_id: str, max_bytes: int) -> tuple[list[list], bool]:
        """The next moves of a drain: ``[key, gen, size, src_offset, dst_node, dst_offset]``
        each, about ``max_bytes`` in all (at least one move when one is possible), and
        whether to ask again later with none now (puts into the node still in flight,
        values here between tiers, or no room on the targets yet: their offloads to disk
        in flight, or for ``NO_ROOM_WAIT_S``). No moves and no wait: nothing left to move,
        or no room for the next value for that long."""
        d = self.active.get(node_id)
        if d is None:
            return [], False
        now = self._clock()
        out, total = [], 0
        targets = self._targets(node_id)
        while total < max_bytes and targets:
            if d.cursor >= len(d.order):
                if self._busy(node_id):  # puts started before the drain: moved once done
                    return out, True
                if d.settled:
                    if d.transient:  # values between tiers here: looked at again shortly
                        d.settled = False
                        return out, True
                    break
                # Values the node took after the drain began (put slabs granted before it).
                d.order = [k for k in self._on_node(node_id) if k not in d.moving_keys]
                d.cursor, d.settled, d.transient = 0, True, False
                continue
            key = d.order[d.cursor]
            obj = self._objects.get(key)
            src = None if obj is None else _source(obj, node_id)
            if src is None or key in d.moving_keys or key in d.failed_keys or any(
                    r.node_id != node_id and r.tier is Tier.DRAM and r.ready for r in obj.replicas):
                # gone, not readable here, being moved, failed, or readable elsewhere; a value
                # only here that is between tiers (being offloaded to disk, or promoted from
                # it) is readable again once that ends, and is then moved
                if src is None and obj is not None and any(
                        r.node_id == node_id and (r.offloading or not r.ready) for r in obj.replicas) and \
                        not any(r.node_id != node_id and r.ready for r in obj.replicas):
                    d.transient = True
                d.cursor += 1
                continue
            dst, gone = self._reps.reserve_copy(obj, targets, now)
            if gone:  # the eviction that made its room took it (an orphan)
                d.cursor += 1
                continue
            if dst is None:
                # No room for it now. Room comes when the targets' offloads to disk finish,
                # or readers' leases on their values end: asked again, for a while; then
                # what is left is counted at the end.
                if out:
                    break
                if not d.no_room_since:
                    d.no_room_since = now
                if any(n.offload_inflight for n in targets) or now - d.no_room_since < NO_ROOM_WAIT_S:
                    return out, True
                break
            d.no_room_since = 0.0
            d.cursor += 1
            d.settled = False
            obj.replicas.append(dst)
            lease = self._reps.hold_for_copy(obj, dst.deadline, now)  # both extents stay put meanwhile
            d.moving[(key, dst.node_id, dst.offset)] = (obj, dst, lease)
            d.moving_keys.add(key)
            out.append([key, obj.gen, obj.size, src.offset if src.tier is Tier.DRAM else FROM_DISK,
                        dst.node_id, dst.offset])
            total += obj.size
        return out, False

    def done(self, node_id: str, items) -> None:
        """Moves the store node made: ``[key, gen, dst_node, dst_offset, ok]`` each."""
        d = self.active.get(node_id)
        if d is None:
            return
        now = self._clock()
        for key, gen, dst_node, dst_offset, ok in items:
            got = d.moving.pop((key, dst_node, dst_offset), None)
            if got is None:
                continue
            d.moving_keys.discard(key)
            obj, rep, lease = got
            self._reps.release_copy(key, obj.gen, obj, lease, now)  # the copy is over, whatever came of it
            outcome = self._reps.settle_copy(key, gen, obj, rep, ok, now)
            if outcome == "left":  # try another target
                d.order.append(key)
                d.settled = False
            elif outcome == "failed":
                d.failed += 1
                d.failed_keys.add(key)
            if outcome != "done":
                continue
            # the copy moved from: a readable one in the arena, else the one on disk (never
            # a DRAM copy a promotion is still writing: its reader reads that extent next)
            src = next((r for r in obj.replicas if r.node_id == node_id and r.tier is Tier.DRAM and r.ready),
                       None) or next((r for r in obj.replicas if r.node_id == node_id and r.tier is Tier.DISK), None)
            if src is not None and src.tier is Tier.DISK and any(
                    r.node_id == node_id and r.tier is Tier.DRAM and not r.ready for r in obj.replicas):
                src = None  # a promotion reads it now (its reader would miss): it goes with the node
            if src is not None:
                self._reps.drop_replica(obj, src, now)
            else:
                self._mirror.key(key)
            d.moved += 1
            d.moved_bytes += obj.size
            self._counters["drain_moved_keys"] += 1
            self._counters["drain_moved_bytes"] += obj.size

    def expire(self, now: float) -> None:
        """Drop the reserved extents of moves not reported by their deadline."""
        for d in self.active.values():
            for k, (obj, rep, lease) in list(d.moving.items()):
                if rep.deadline <= now:
                    del d.moving[k]
                    d.moving_keys.discard(k[0])
                    self._reps.release_copy(obj.key, obj.gen, obj, lease, now)
                    if self._objects.get(obj.key) is obj and any(r is rep for r in obj.replicas):
                        self._reps.drop_replica(obj, rep, now)

    def end(self, node_id: str) -> dict:
        """Finish a drain: what was moved, and what is left only on the node (lost when it
        unmounts), by keys and bytes. The caller unmounts the node."""
        d = self.active.pop(node_id, None)
        now = self._clock()
        if d is not None:
            for obj, rep, lease in d.moving.values():
                self._reps.release_copy(obj.key, obj.gen, obj, lease, now)
                if self._objects.get(obj.key) is obj and any(r is rep for r in obj.replicas):
                    self._reps.drop_replica(obj, rep, now)
        lost = lost_bytes = 0
        for key in self._on_node(node_id):
            obj = self._objects.peek(key)
            if obj is not None and all(r.node_id == node_id for r in obj.replicas):
                lost += 1
                lost_bytes += obj.size
        self._counters["drain_lost_keys"] += lost
        self._counters["drain_lost_bytes"] += lost_bytes
        return {"node_id": node_id, "moved_keys": d.moved if d else 0, "moved_bytes": d.moved_bytes if d else 0,
                "failed_moves": d.failed if d else 0, "lost_keys": lost, "lost_bytes": lost_bytes}

    def forget(self, node_id: str) -> None:
        """A node unmounted (or a target of moves gone): its drain, if any, ends."""
        self.active.pop(node_id, None)
