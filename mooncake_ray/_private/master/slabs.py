"""Put slabs: one master round trip per put instead of two (pure, no Ray).

A plain put costs the client two calls to the master: ``put_start`` (reserve extents),
the write, ``put_end`` (publish). With a slab, a client asks once for a run of DRAM on
one node (``slab_grant``), carves extents out of it itself, writes, and publishes each
value with one ``put_commit(key, slab, offset, size)``. The master checks that the
extent lies in a part of the slab nobody committed yet, then publishes exactly as
``put_end`` does. A failed commit (the key exists, another put of it is in flight) frees
its extent: the client wrote bytes nobody will read, nothing else is lost.

Safety rules (what makes a slab's bytes never land on someone else's value):

- Uncommitted slab space is allocated in the node's allocator for as long as the slab
  lives, so nothing else is placed there.
- The client writes into a slab only within ``put_slab_ttl_s`` of the moment it *sent*
  the grant request (so its window ends before the master's does). The master reclaims
  the uncommitted rest ``put_slab_ttl_s + put_timeout_s`` after granting it (a dead
  client's slab, like a dead client's pending put), or at once when the client returns it.
- A restarted master knows nothing of the previous incarnation's slabs; their space is
  free in its rebuilt index. It therefore allocates nothing (``put_start`` and
  ``slab_grant`` answer "rebuilding, retry") until ``put_slab_ttl_s`` after it started,
  by which time no client may begin a write into an old slab. A commit into a slab it
  does not know fails with ``LeaseExpiredError``; the client puts that value again the
  two-call way.
- A slab lives on one node incarnation: unmounting the node drops it.

Only single-replica puts use slabs (a slab is one node); values larger than half a slab
take the two-call path, where the extra round trip is small next to the copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mooncake_ray.errors import (
    InvalidArgumentError,
    LeaseExpiredError,
    MasterUnavailableError,
    NoCapacityError,
    ObjectExistsError,
    ObjectPendingError,
)
from mooncake_ray._private.master.allocator import ALIGN, align_up
from mooncake_ray._private.master.placement import order_nodes
from mooncake_ray._private.master.types import Obj, Replica, Tier


@dataclass(slots=True)
class Slab:
    slab_id: int
    node_id: str
    offset: int
    length: int
    owner: str
    expires: float  # the master reclaims the uncommitted rest at this time
    free: dict = field(default_factory=dict)  # uncommitted pieces: offset -> length


class SlabMixin:
    # ------------------------------------------------------------------ grant ----
    def slab_grant(self, owner: str, client_node: str | None = None, need: int = 0) -> tuple:
        """Reserve a slab for ``owner``: ``(slab_id, node_id, offset, length, incarnation,
        ttl_s)``. Its length is ``put_slab_bytes`` (at most 1/16 of the node's arena), or
        ``need`` if larger.

        Raises:
            MasterUnavailableError: rebuilding, or within ``put_slab_ttl_s`` of a restart.
            NoCapacityError: no node has the room (the client puts the two-call way).
        """
        self._ready()
        if self.policy.put_slab_bytes <= 0:
            raise InvalidArgumentError("put slabs are disabled (master.put_slab_bytes is 0)")
        now = self._clock()
        self._allocation_gate(now)
        self._release_deferred(now)
        usable = [n for n in self._nodes.values() if not n.suspect]
        if not usable:
            raise NoCapacityError("no usable store node for a put slab")
        for node in order_nodes(self.policy.allocation_strategy, usable, self._alloc, client_node, self._rng):
            cap = self._alloc[node.node_id].capacity
            length = max(align_up(need), min(self.policy.put_slab_bytes, cap // 16) // ALIGN * ALIGN)
            if length > cap // 4:
                continue  # a slab must not take a large share of any arena
            got = self._allocate_on(node.node_id, length, now)
            if got is None:
                continue
            # Unique across master incarnations (like generations), so a commit into a
            # previous master's slab can never match one of ours.
            self._next_slab = max(self._next_slab + 1, self._wall_ns())
            slab = Slab(self._next_slab, node.node_id, got[0], got[1], owner,
                        now + self.policy.put_slab_ttl_s + self.policy.put_timeout_s, {got[0]: got[1]})
            self._slabs[slab.slab_id] = slab
            self._mirror_slab(slab.slab_id)
            return (slab.slab_id, node.node_id, slab.offset, slab.length, node.incarnation,
                    self.policy.put_slab_ttl_s)
        raise NoCapacityError(f"no store node has room for a put slab of {need} bytes or more")

    def slab_return(self, slab_id: int) -> int:
        """Free a slab's uncommitted space; returns the bytes freed. Idempotent."""
        slab = self._slabs.pop(slab_id, None)
        if slab is None:
            return 0
        self._mirror_slab(slab_id)
        alloc = self._alloc.get(slab.node_id)
        freed = 0
        for off, ln in slab.free.items():
            if alloc is not None:
                alloc.release(off, ln)
            freed += ln
        return freed

    def _allocation_gate(self, now: float) -> None:
        if now < self._alloc_gate_until:
            raise MasterUnavailableError(
                f"master restarted {now - self._restarted_at:.1f}s ago; allocations resume after "
                f"put_slab_ttl_s={self.policy.put_slab_ttl_s}s (writes into old slabs must end first)")

    # ----------------------------------------------------------------- commit ----
    def put_commit(self, key: str, slab_id: int, offset: int, size: int, upsert: bool = False,
                   owner: str = "") -> int:
        """Publish ``size`` bytes the caller wrote at ``offset`` of slab ``slab_id`` as
        ``key``. Returns the value's generation. Idempotent: a retry of a commit that
        went through answers with the same generation.

        Raises:
            LeaseExpiredError: the slab is unknown (expired, returned, its node gone,
                granted by a previous master incarnation, or to another owner): put the
                value again.
            InvalidArgumentError: bad key or size, or the extent is not an uncommitted
                part of the slab.
            ObjectExistsError / ObjectPendingError: as ``put_start`` (the extent is freed).
        """
        self._ready()
        self._check_key(key)
        if not isinstance(size, int) or size < 0:
            raise InvalidArgumentError(f"size must be a non-negative int, got {size!r}")
        slab = self._slabs.get(slab_id)
        if slab is None or slab.node_id not in self._nodes or slab.owner != owner:
            raise LeaseExpiredError(f"put slab {slab_id} is gone (expired, returned or its node left); "
                                    f"put {key!r} again")
        length = align_up(size)
        piece = self._carve(slab, offset, length)
        if piece is not None:
            self._mirror_slab(slab_id)
        else:
            done = self._objects.get(key)
            if done is not None and any(r.node_id == slab.node_id and r.tier is Tier.DRAM and r.offset == offset
                                        and r.length == length for r in done.replicas):
                return done.gen  # a retry after a lost reply: already committed
            raise InvalidArgumentError(
                f"extent ({offset}, {length}) of {key!r} is not an uncommitted part of put slab {slab_id}")
        now = self._clock()
        conflict = (ObjectPendingError(f"a put of {key!r} is already in flight") if key in self._pending
                    else ObjectExistsError(f"{key!r} is already stored; use upsert to replace it")
                    if key in self._objects and not upsert else None)
        if conflict is not None:
            self._alloc[slab.node_id].release(offset, length)
            raise conflict
        self._next_gen = max(self._next_gen + 1, self._wall_ns())
        obj = Obj(key, size, self._next_gen, [Replica(slab.node_id, Tier.DRAM, offset, length)])
        self._nodes[slab.node_id].keys.add(key)
        # Evict before publishing (as put_start does): a node applies a delta's drops
        # before its adds, so the new value must not be a victim of this same delta.
        self._watermark(slab.node_id, now)
        self._publish(obj, now)
        return obj.gen

    @staticmethod
    def _carve(slab: Slab, offset: int, length: int) -> tuple[int, int] | None:
        """Take [offset, offset+length) out of the slab's uncommitted pieces."""
        if not isinstance(offset, int) or offset % ALIGN:
            return None
        for start, ln in slab.free.items():
            if start <= offset and offset + length <= start + ln:
                del slab.free[start]
                if offset > start:
                    slab.free[start] = offset - start
                if offset + length < start + ln:
                    slab.free[offset + length] = start + ln - offset - length
                return offset, length
        return None

    # ------------------------------------------------------------- life cycle ----
    def _expire_slabs(self, now: float) -> int:
        gone = [s.slab_id for s in self._slabs.values() if s.expires <= now]
        for slab_id in gone:
            self.slab_return(slab_id)
        return len(gone)

    def _drop_node_slabs(self, node_id: str) -> None:
        for slab_id in [s.slab_id for s in self._slabs.values() if s.node_id == node_id]:
            del self._slabs[slab_id]  # the node's allocator is gone with it
            self._mirror_slab(slab_id)

    def slab_bytes(self) -> int:
        return sum(ln for s in self._slabs.values() for ln in s.free.values())
