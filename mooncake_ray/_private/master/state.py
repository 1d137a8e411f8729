"""The master's state machine: object index, allocation, leases, pins, eviction, replicas
and node liveness. Pure Python, no Ray: the clock is injected, so tests run in
microseconds and simulations replay from a seed. ``actor.py`` adapts it to Ray and the RPC.

Life of an object::

    put_start ──► PENDING (extents reserved, invisible to readers)
        │  client writes the bytes with the transport
        ├─ put_end ──► COMPLETE (visible; replaces an older value on upsert)
        └─ put_revoke / put_timeout_s passes / a replica's node dies ──► gone, extents freed

    put_commit (into a client's put slab, see slabs.py) ──► COMPLETE in one call

A get of a COMPLETE object grants a read lease (``lease_ttl_s``): until it ends the
object is not evicted and its extents are not reused, even if it is removed or
replaced meanwhile (the extents wait in ``_deferred``).

Existing keys: ``put`` of a key that is already stored raises ``ObjectExistsError``
(Mooncake silently keeps the old value; we never drop either value silently), and
``upsert`` replaces it; both raise ``ObjectPendingError`` while another put of the key
is in flight.

The store nodes keep an inventory of what they hold so a restarted master can rebuild
this index. The master is its only writer: each change a node must know is queued in
``_effects`` and the actor delivers it before it replies to the caller.

Every public method is idempotent where the docstring says so; the RPC layer relies on
that to retry after a lost reply.
"""

from __future__ import annotations

import heapq
import random
import time
from dataclasses import dataclass
from typing import Callable

from mooncake_ray.errors import (
    InvalidArgumentError,
    MasterUnavailableError,
    NoCapacityError,
    NodeUnavailableError,
    ObjectExistsError,
    ObjectLeasedError,
    ObjectNotFoundError,
    ObjectPendingError,
    OffloadPendingError,
)
from mooncake_ray._private.master.allocator import ExtentAllocator
from mooncake_ray._private.master.eviction import RecencyIndex, pick_victims
from mooncake_ray._private.master.fastpath import ReadIndexMixin
from mooncake_ray._private.master.placement import order_nodes
from mooncake_ray._private.master.slabs import SlabMixin
from mooncake_ray._private.master.tiering import PROMOTE, TieringMixin
from mooncake_ray._private.master.types import (
    InventoryEntry,
    NodeDelta,
    NodeInfo,
    Obj,
    Pin,
    Replica,
    Tier,
)


@dataclass
class Policy:
    """The subset of MasterConfig the state machine needs (plain values)."""

    lease_ttl_s: float = 10.0
    soft_pin_ttl_s: float = 1800.0
    high_watermark: float = 0.9
    evict_ratio: float = 0.05
    node_ttl_s: float = 5.0
    put_timeout_s: float = 60.0
    allocation_strategy: str = "local_first"
    replicas: int = 1
    max_key_bytes: int = 4096
    recovery_timeout_s: float = 15.0
    put_slab_bytes: int = 32 << 20
    put_slab_ttl_s: float = 2.0

    @classmethod
    def from_config(cls, cfg) -> "Policy":
        return cls(**{k: getattr(cfg, k) for k in cls.__dataclass_fields__})


class MasterState(TieringMixin, SlabMixin, ReadIndexMixin):
    """See the module docstring (``tiering.py`` for the disk tier, ``slabs.py`` for
    one-call puts, ``fastpath.py`` for the mirror that answers reads natively). Not thread-safe:
    the actor serialises calls."""

    def __init__(self, policy: Policy | None = None, clock: Callable[[], float] = time.monotonic,
                 wall_ns: Callable[[], int] = time.time_ns, seed: int | None = None):
        self.policy = policy or Policy()
        self._clock = clock
        self._wall_ns = wall_ns
        self._rng = random.Random(seed)
        self._nodes: dict[str, NodeInfo] = {}
        self._alloc: dict[str, ExtentAllocator] = {}
        self._objects: dict[str, Obj] = {}  # complete, visible
        self._pending: dict[str, Obj] = {}  # puts in flight
        self._lru = RecencyIndex()
        self._deferred: list[tuple[float, str, str, int, int]] = []  # (until, incarnation, node, off, len)
        self._effects: dict[str, NodeDelta] = {}
        self._next_gen = 0
        self._last_placed = 0
        self._next_lease = 0
        self._expected: set[str] = set()
        self._recovery_deadline = 0.0
        self._slabs: dict = {}  # slab_id -> Slab (see slabs.py)
        self._next_slab = 0
        self._restarted_at = 0.0
        self._alloc_gate_until = 0.0
        self._watermark_due: set[str] = set()  # see fastpath.apply_index_log
        self.counters = {"hits": 0, "misses": 0, "disk_hits": 0, "evictions": 0, "evicted_bytes": 0,
                         "puts": 0, "put_bytes": 0, "revoked": 0, "removed": 0, "offloads": 0,
                         "promotions": 0, "disk_evictions": 0,
                         "node_unmounts": 0, "unmount_lost_keys": 0}

    # ------------------------------------------------------------------ nodes --
    def mount(self, node: NodeInfo, inventory: list[InventoryEntry] = ()) -> None:
        """Add a store node with what it already holds. Idempotent for the same
        incarnation; a new incarnation replaces the old one (its replicas are gone)."""
        now = self._clock()
        old = self._nodes.get(node.node_id)
        if old is not None and old.incarnation == node.incarnation:
            old.last_heartbeat, old.suspect = now, False
            return
        if old is not None:
            self.unmount(node.node_id, "remounted with a new incarnation")
        node.last_heartbeat, node.keys = now, set()
        self._nodes[node.node_id] = node
        self._alloc[node.node_id] = ExtentAllocator(node.capacity)
        # Newest allocation first: if two entries overlap (a drop that never reached the
        # node before a crash, then the extent reused), the newer one wins.
        for e in sorted((InventoryEntry(*e) for e in inventory), key=lambda e: -e.gen):
            self._restore(node, e, now)
        self._expected.discard(node.node_id)

    def _restore(self, node: NodeInfo, e: InventoryEntry, now: float) -> None:
        tier = Tier(e.tier)
        self._next_gen = max(self._next_gen, e.gen + 1)
        obj = self._objects.get(e.key)
        if obj is not None and obj.gen != e.gen:
            if obj.gen > e.gen:  # a stale replica of a replaced value
                self._delta(node.node_id).drop(e.key, e.gen, e.tier)
                return
            self._drop_object(obj, now)  # ours is the newer value
            obj = None
        if tier is Tier.DRAM:
            try:
                self._alloc[node.node_id].reserve(e.offset, e.length)
            except ValueError:  # overlaps another entry: trust neither copy of these bytes
                self._delta(node.node_id).drop(e.key, e.gen, e.tier)
                return
        elif obj is not None and any(r.node_id == node.node_id and r.tier is tier for r in obj.replicas):
            return  # the same disk copy listed twice
        else:
            node.disk_used += e.length
        if obj is None:
            # Readers may still hold leases granted by the previous master: honour them.
            obj = Obj(e.key, e.size, e.gen, [], complete=True, lease_until=now + self.policy.lease_ttl_s,
                      pin=Pin(e.pin), pin_until=now + self.policy.soft_pin_ttl_s)
            self._objects[e.key] = obj
            self._lru.touch(e.key)
        # Not the put's placement as far as this master knows: a new id (see Replica.placed).
        obj.replicas.append(Replica(node.node_id, tier, e.offset, e.length, placed=self._new_placement()))
        node.keys.add(e.key)
        node.tier_keys[tier.value] += 1
        self._mirror_key(e.key)

    def heartbeat(self, node_id: str, incarnation: str, spill_used: int | None = None,
                  spill_degraded: str | None = None) -> bool:
        """Record liveness. Returns False if the node must (re)mount with its inventory.
        Writes only the node's liveness fields: the actor calls it without its lock."""
        node = self._nodes.get(node_id)
        if node is None or node.incarnation != incarnation:
            return False
        node.last_heartbeat, node.suspect = self._clock(), False
        if spill_used is not None:
            node.spill_used = spill_used
        node.spill_degraded = spill_degraded
        return True

    def report_unreachable(self, node_id: str) -> None:
        """A client could not reach the node: stop placing new objects there until it
        heartbeats again (or is unmounted after node_ttl_s)."""
        if node_id in self._nodes:
            self._nodes[node_id].suspect = True

    def unmount(self, node_id: str, reason: str = "unmounted") -> int:
        """Drop a node and every replica on it; keys with no replica left become misses.
        Returns the number of objects lost. Idempotent."""
        node = self._nodes.pop(node_id, None)
        self._alloc.pop(node_id, None)
        self._effects.pop(node_id, None)
        self._drop_node_slabs(node_id)
        if node is None:
            return 0
        self._deferred = [d for d in self._deferred if d[2] != node_id]
        heapq.heapify(self._deferred)
        lost = 0
        for key in node.keys:
            for table in (self._objects, self._pending):
                obj = table.get(key)
                if obj is None:
                    continue
                obj.replicas = [r for r in obj.replicas if r.node_id != node_id]
                if table is self._pending:
                    obj.failed = f"store node {node_id} {reason}"
                else:
                    if not obj.replicas:
                        del self._objects[key]
                        self._lru.discard(key)
                        lost += 1
                    self._mirror_key(key)
        return lost

    def nodes(self) -> list[dict]:
        return [n.public() for n in self._nodes.values()]

    # --------------------------------------------------------------- recovery --
    def begin_recovery(self, expected_nodes: set[str]) -> None:
        """A restarted master: refuse calls until these nodes remount or the timeout."""
        self._expected = set(expected_nodes) - set(self._nodes)
        self._restarted_at = self._clock()
        self._recovery_deadline = self._restarted_at + self.policy.recovery_timeout_s
        self._alloc_gate_until = self._restarted_at + self.policy.put_slab_ttl_s

    @property
    def recovering(self) -> bool:
        if self._expected and self._clock() >= self._recovery_deadline:
            self._expected.clear()
        return bool(self._expected)

    def _ready(self) -> None:
        if self._expected and self.recovering:
            raise MasterUnavailableError(
                f"master is rebuilding its index; waiting for store nodes {sorted(self._expected)}")

    # ------------------------------------------------------------------- puts --
    def _check_key(self, key) -> None:
        if not isinstance(key, str):
            raise InvalidArgumentError(f"key must be a str, got {type(key).__name__}")
        if not key:
            raise InvalidArgumentError("key must not be empty")
        n = len(key.encode("utf-8", "surrogatepass"))
        if n > self.policy.max_key_bytes:
            raise InvalidArgumentError(
                f"key of {n} bytes is longer than max_key_bytes={self.policy.max_key_bytes}: {key[:64]!r}...")

    def put_start(self, key: str, size: int, replicas: int | None = None, client_node: str | None = None,
                  owner: str = "", upsert: bool = False) -> tuple[int, list[tuple[str, int, int]]]:
        """Reserve extents for a new value on up to ``replicas`` distinct nodes.

        Returns ``(gen, [(node_id, offset, length, incarnation), ...])``; the client writes ``size``
        bytes at each extent, then calls ``put_end(key, gen)``.

        Raises:
            InvalidArgumentError: bad key or size, or a value larger than every arena.
            ObjectExistsError: ``key`` is stored and ``upsert`` is false.
            ObjectPendingError: another put of ``key`` is in flight (retryable).
            NoCapacityError: no node has room even after eviction (retryable).
            MasterUnavailableError: the master is rebuilding (retryable).
        """
        self._ready()
        self._check_key(key)
        if not isinstance(size, int) or size < 0:
            raise InvalidArgumentError(f"size must be a non-negative int, got {size!r}")
        now = self._clock()
        self._allocation_gate(now)
        self._release_deferred(now)
        pending = self._pending.get(key)
        if pending is not None:
            if owner and pending.owner == owner and pending.size == size and not pending.failed:
                # The same client retrying after a lost reply: hand back its allocation.
                return pending.gen, self._extents(pending.replicas)
            raise ObjectPendingError(f"a put of {key!r} is already in flight")
        if key in self._objects and not upsert:
            raise ObjectExistsError(f"{key!r} is already stored; use upsert to replace it")
        want = replicas or self.policy.replicas
        usable = [n for n in self._nodes.values() if not n.suspect]
        if not usable:
            raise NoCapacityError("no store node is mounted" if not self._nodes
                                  else "every store node is unreachable")
        biggest = max(self._alloc[n.node_id].capacity for n in usable)
        if size > biggest:
            raise InvalidArgumentError(
                f"value of {size} bytes is larger than any store node's arena (largest: {biggest} bytes)")
        ordered = order_nodes(self.policy.allocation_strategy, usable, self._alloc, client_node, self._rng)
        placed: list[Replica] = []
        for evict in (False, True):
            for node in ordered:
                if len(placed) == want:
                    break
                if any(r.node_id == node.node_id for r in placed):
                    continue
                alloc = self._alloc[node.node_id]
                while evict and not alloc.can_fit(size) and self._evict(node.node_id, size, now):
                    pass  # eviction frees bytes, not always a contiguous run: repeat
                got = alloc.allocate(size)
                if got is not None:
                    placed.append(Replica(node.node_id, Tier.DRAM, got[0], got[1]))
        if not placed:
            if any(n.offload_inflight for n in usable):
                raise OffloadPendingError(
                    f"no room for {size} bytes of {key!r} until offloads to disk finish; retry")
            if self._pending or self._deferred:
                raise OffloadPendingError(
                    f"no room for {size} bytes of {key!r} while other puts are in flight or "
                    "replaced values wait for their readers; retry")
            raise NoCapacityError(
                f"no room for {size} bytes of {key!r}: every store node is full of pinned, leased or pending objects")
        self._next_gen = max(self._next_gen + 1, self._wall_ns())
        obj = Obj(key, size, self._next_gen, placed, put_deadline=now + self.policy.put_timeout_s, owner=owner)
        self._pending[key] = obj
        self._mirror_pending(key)
        for r in placed:
            self._nodes[r.node_id].keys.add(key)
            self._watermark(r.node_id, now)
        return obj.gen, self._extents(placed)

    def _extents(self, reps) -> list[tuple[str, int, int, str]]:
        """``(node_id, offset, length, incarnation)``: the incarnation pins the extent to
        the arena it was allocated in (a restarted node has a new one)."""
        return [(r.node_id, r.offset, r.length, self._nodes[r.node_id].incarnation) for r in reps]

    def put_end(self, key: str, gen: int) -> None:
        """Publish a pending put. Idempotent: ending an already published ``gen`` is a no-op.

        Raises:
            ObjectNotFoundError: no put of ``key``/``gen`` is pending (revoked or timed out).
            NodeUnavailableError: a replica's node died before the put ended; the put is
                revoked, retry the whole put (retryable).
        """
        obj = self._pending.get(key)
        if obj is None or obj.gen != gen:
            done = self._objects.get(key)
            if done is not None and done.gen == gen:
                return
            raise ObjectNotFoundError(f"no pending put of {key!r} (gen {gen}): it was revoked or timed out")
        if obj.failed or not obj.replicas:
            self.put_revoke(key, gen)
            raise NodeUnavailableError(f"put of {key!r} failed: {obj.failed or 'no replica left'}")
        del self._pending[key]
        self._mirror_pending(key)
        self._publish(obj, self._clock())

    def _publish(self, obj: Obj, now: float) -> None:
        """Make a written value visible, replacing the key's old value if any."""
        key = obj.key
        old = self._objects.get(key)
        if old is not None:
            self._drop_object(old, now)
        obj.complete = True
        self._objects[key] = obj
        self._lru.touch(key)
        self.counters["puts"] += 1
        self.counters["put_bytes"] += obj.size
        for r in obj.replicas:
            node = self._nodes[r.node_id]
            node.keys.add(key)  # dropping the old value may have unindexed it
            node.tier_keys[r.tier.value] += 1
            self._delta(r.node_id).add(self._entry(obj, r))
        self._mirror_key(key)

    def put_revoke(self, key: str, gen: int) -> bool:
        """Abandon a pending put and free its extents. Idempotent (False if nothing to do)."""
        obj = self._pending.get(key)
        if obj is None or obj.gen != gen:
            return False
        del self._pending[key]
        self._mirror_pending(key)
        for r in obj.replicas:
            self._free_extent(r, 0.0)
            self._unindex(r.node_id, key)
        self.counters["revoked"] += 1
        return True

    # ------------------------------------------------------------------- reads --
    def get(self, key: str, client_node: str | None = None):
        """Descriptors of a stored value, with a read lease.

        Returns ``(size, gen, lease_ttl_s, [(node_id, tier, offset, length, incarnation, placed), ...],
        lease)``
        with the caller's local replica first, or ``None`` on a miss (a miss is a value).
        Release the lease with ``release(key, gen, lease)`` once the bytes are copied.
        """
        self._ready()
        obj = self._objects.get(key)
        if obj is None:
            self.counters["misses"] += 1
            return None
        now = self._clock()
        ttl = self.policy.lease_ttl_s
        # Lease first: a promotion below may evict, and must not evict this object.
        until = obj.lease_until
        if until <= now or obj.leases is None:
            obj.leases = set()  # earlier leases expired, released or not
        self._next_lease += 1
        lease = self._next_lease
        obj.leases.add(lease)
        obj.lease_until = max(until, now + ttl)
        self._lru.touch(key)
        reps = [r for r in obj.replicas if r.tier is Tier.DRAM and r.ready]
        if reps:
            self.counters["hits"] += 1
            tier = Tier.DRAM.value
        else:  # only on disk: promote it into DRAM (may raise OffloadPendingError: retryable)
            try:
                reps = [self._promotion(obj, client_node, now)]
            except OffloadPendingError:
                obj.leases.discard(lease)
                if not obj.leases:
                    obj.lease_until = until
                raise
            self.counters["disk_hits"] += 1
            tier = PROMOTE
        if client_node and len(reps) > 1:
            reps = sorted(reps, key=lambda r: (r.node_id != client_node and
                                               self._nodes[r.node_id].ray_node_id != client_node))
        return (obj.size, obj.gen, ttl,
                [(r.node_id, tier, r.offset, r.length, self._nodes[r.node_id].incarnation, r.placed)
                 for r in reps], lease)

    def _new_placement(self) -> int:
        """A ``Replica.placed`` id no replica of this master (or an earlier one) has had."""
        self._last_placed = max(self._last_placed + 1, self._wall_ns())
        return self._last_placed

    def release(self, key: str, gen: int, lease: int, now: float | None = None) -> None:
        """A reader is done with lease ``lease`` on ``key``/``gen``. When the last one is
        released the lease ends at once instead of at its expiry, so a scan over a
        working set larger than DRAM never waits for leases. Idempotent (a lease id is
        released once; retrying after a lost reply is safe)."""
        obj = self._objects.get(key)
        if obj is None or obj.gen != gen or not obj.leases:
            return
        obj.leases.discard(lease)
        if not obj.leases:
            obj.lease_until = min(obj.lease_until, self._clock() if now is None else now)

    def exists(self, key: str) -> bool:
        self._ready()
        return key in self._objects

    def where(self, key: str) -> list[tuple[str, str, bool]]:
        """``(node_id, tier, ready)`` of each replica of a stored key (for tests/tools)."""
        obj = self._objects.get(key)
        return [] if obj is None else [(r.node_id, r.tier.value, r.ready) for r in obj.replicas]

    def node_entries(self, node_id: str) -> list[InventoryEntry]:
        """The inventory this master believes ``node_id`` holds (complete, readable
        replicas): what the node's own inventory must equal once it has applied every
        message it is owed (tests and tools)."""
        node = self._nodes.get(node_id)
        if node is None:
            return []
        out = []
        for key in node.keys:
            obj = self._objects.get(key)
            if obj is None:
                continue
            out.extend(self._entry(obj, r) for r in obj.replicas if r.node_id == node_id and r.ready)
        return out

    # ----------------------------------------------------------------- removal --
    def remove(self, key: str, force: bool = False) -> bool:
        """Remove a stored value. Returns False if it was not stored (idempotent).

        Raises:
            ObjectLeasedError: a reader holds a lease and ``force`` is false (retryable).
        """
        self._ready()
        obj = self._objects.get(key)
        if obj is None:
            return False
        now = self._clock()
        if obj.leased(now) and not force:
            raise ObjectLeasedError(
                f"{key!r} is leased to a reader for {obj.lease_until - now:.1f}s more; retry or force=True")
        self._drop_object(obj, now)
        self.counters["removed"] += 1
        return True

    def remove_prefix(self, prefix: str, force: bool = False) -> int:
        """Remove every stored key starting with ``prefix``; leased ones are skipped
        unless ``force``. Returns how many were removed."""
        self._ready()
        now, n = self._clock(), 0
        for key in [k for k in self._objects if k.startswith(prefix)]:
            obj = self._objects[key]
            if force or not obj.leased(now):
                self._drop_object(obj, now)
                n += 1
        self.counters["removed"] += n
        return n

    def remove_all(self, force: bool = False) -> int:
        return self.remove_prefix("", force)

    # -------------------------------------------------------------------- pins --
    def pin(self, key: str, hard: bool = False, ttl_s: float | None = None) -> None:
        """Soft pin (evicted last, expires after ``ttl_s`` or soft_pin_ttl_s) or hard pin
        (never evicted). Idempotent.

        Raises:
            ObjectNotFoundError: ``key`` is not stored.
        """
        self._ready()
        obj = self._objects.get(key)
        if obj is None:
            raise ObjectNotFoundError(f"cannot pin {key!r}: not stored")
        obj.pin = Pin.HARD if hard else Pin.SOFT
        obj.pin_until = self._clock() + (ttl_s if ttl_s is not None else self.policy.soft_pin_ttl_s)
        self._publish_pin(obj)

    def unpin(self, key: str) -> None:
        self._ready()
        obj = self._objects.get(key)
        if obj is None:
            raise ObjectNotFoundError(f"cannot unpin {key!r}: not stored")
        obj.pin = Pin.NONE
        self._publish_pin(obj)

    def _publish_pin(self, obj: Obj) -> None:
        for r in obj.replicas:
            if r.tier is Tier.DRAM and r.ready:
                self._delta(r.node_id).add(self._entry(obj, r))

    @staticmethod
    def _entry(obj: Obj, r: Replica) -> InventoryEntry:
        return InventoryEntry(obj.key, obj.gen, obj.size, r.tier.value, r.offset, r.length, int(obj.pin))

    # ---------------------------------------------------------------- eviction --
    def _evict(self, node_id: str, need: int, now: float) -> int:
        """Make room on one node's DRAM; returns the bytes freed now (offloads started
        free their bytes later and count toward ``need`` meanwhile)."""
        node, alloc = self._nodes[node_id], self._alloc[node_id]
        if need and node.spill_usable():
            # Offloads free their room only when the disk write is done: start enough for
            # the next few allocations of this size, so a batch of puts does not wait once
            # per object (at most a quarter of the arena).
            need = max(need, min(8 * need, alloc.capacity // 4))
        need = max(need, int(self.policy.evict_ratio * alloc.capacity)) - node.offload_inflight
        freed = 0
        if need <= 0:
            return 0
        for obj, rep in pick_victims(self._lru, self._objects, node_id, need, now):
            if self._try_offload(node, obj, rep, now):
                continue
            self._drop_replica(obj, rep, now)
            freed += rep.length
            self.counters["evictions"] += 1
            self.counters["evicted_bytes"] += rep.length
        return freed

    def _allocate_on(self, node_id: str, size: int, now: float) -> tuple[int, int] | None:
        alloc = self._alloc[node_id]
        got = alloc.allocate(size)
        while got is None and self._evict(node_id, size, now):
            got = alloc.allocate(size)  # eviction frees bytes, not always a contiguous run
        if got is not None:
            self._watermark(node_id, now)
        return got

    def _watermark(self, node_id: str, now: float) -> None:
        """Past the high watermark, evict (or start offloading) one batch, so the next
        allocations find room without waiting."""
        alloc = self._alloc[node_id]
        if alloc.used > self.policy.high_watermark * alloc.capacity:
            self._evict(node_id, 0, now)  # one batch of evict_ratio * capacity

    # ---------------------------------------------------------------- internals --
    def _drop_object(self, obj: Obj, now: float) -> None:
        """Forget a complete object; its extents wait for its lease to end."""
        del self._objects[obj.key]
        self._lru.discard(obj.key)
        self._mirror_key(obj.key)
        for r in obj.replicas:
            self._release_replica(obj, r)

    def _drop_replica(self, obj: Obj, rep: Replica, now: float) -> None:
        """Drop one replica; an object left with none is gone (a miss from now on)."""
        obj.replicas.remove(rep)
        self._release_replica(obj, rep)
        if self._objects.get(obj.key) is obj:
            if not obj.replicas:
                del self._objects[obj.key]
                self._lru.discard(obj.key)
            self._mirror_key(obj.key)

    def _release_replica(self, obj: Obj, r: Replica) -> None:
        node = self._nodes.get(r.node_id)
        if node is None:
            return
        # An add of this replica still in the delta (published, then evicted before
        # delivery) is cancelled there, in O(1).
        self._delta(r.node_id).drop(obj.key, obj.gen, r.tier.value)
        if obj.complete and r.ready:
            node.tier_keys[r.tier.value] -= 1
        if r.tier is Tier.DISK:
            node.disk_used -= r.length
        else:
            if r.offloading:  # the offload's disk reservation ends with offload_done
                node.offload_inflight -= r.length
            self._free_extent(r, obj.lease_until)
        self._unindex(r.node_id, obj.key)

    def _unindex(self, node_id: str, key: str) -> None:
        """Drop ``key`` from a node's index unless some version of it still lives there."""
        node = self._nodes.get(node_id)
        if node is None:
            return
        for table in (self._objects, self._pending):
            obj = table.get(key)
            if obj is not None and any(r.node_id == node_id for r in obj.replicas):
                return
        node.keys.discard(key)

    def _free_extent(self, rep: Replica, until: float) -> None:
        if rep.tier is not Tier.DRAM or rep.node_id not in self._alloc:
            return
        if until > self._clock():
            node = self._nodes[rep.node_id]
            heapq.heappush(self._deferred, (until, node.incarnation, rep.node_id, rep.offset, rep.length))
        else:
            self._alloc[rep.node_id].release(rep.offset, rep.length)

    def _release_deferred(self, now: float) -> None:
        while self._deferred and self._deferred[0][0] <= now:
            _, inc, node_id, off, length = heapq.heappop(self._deferred)
            node = self._nodes.get(node_id)
            if node is not None and node.incarnation == inc:
                self._alloc[node_id].release(off, length)

    def _delta(self, node_id: str) -> NodeDelta:
        d = self._effects.get(node_id)
        if d is None:
            d = self._effects[node_id] = NodeDelta()
        return d

    def drain_effects(self) -> dict[str, NodeDelta]:
        """Inventory changes to deliver to store nodes (and forget here)."""
        out, self._effects = self._effects, {}
        return {k: v for k, v in out.items() if k in self._nodes and not v.empty()}

    def excuse_silence(self, window_s: float) -> None:
        """The master itself was not listening (its tick ran late: the process stalled or
        starved): give every node at least ``window_s`` from now to be heard, so the
        master's own pause is never taken for the nodes' silence."""
        floor = self._clock() - self.policy.node_ttl_s + window_s
        for node in self._nodes.values():
            if node.last_heartbeat < floor:
                node.last_heartbeat = floor

    def tick(self) -> dict:
        """Periodic work: revoke timed-out puts, unmount silent nodes, free extents whose
        leases ended. Returns what it did."""
        now = self._clock()
        self._release_deferred(now)
        self._expire_promotions(now)
        slabs = self._expire_slabs(now)
        expired = [(k, o.gen) for k, o in self._pending.items() if o.put_deadline <= now]
        for key, gen in expired:
            self.put_revoke(key, gen)
        silent = [n for n in self._nodes.values() if now - n.last_heartbeat > self.policy.node_ttl_s]
        lost = sum(self.unmount(n.node_id, f"silent for {now - n.last_heartbeat:.1f}s") for n in silent)
        self.counters["node_unmounts"] += len(silent)
        self.counters["unmount_lost_keys"] += lost
        return {"revoked": len(expired), "unmounted": [n.node_id for n in silent], "lost": lost,
                "slabs_expired": slabs}

    # ------------------------------------------------------------------- stats --
    def stats(self) -> dict:
        now = self._clock()
        nodes = {}
        for node_id, node in self._nodes.items():
            a = self._alloc[node_id]
            keys = node.tier_keys
            nodes[node_id] = {
                "ray_node_id": node.ray_node_id,
                "suspect": node.suspect,
                "dram": {"capacity": a.capacity, "used": a.used, "keys": keys["dram"],
                         "offloading_bytes": node.offload_inflight},
                "disk": {"capacity": node.spill_capacity, "used": node.disk_used, "keys": keys["disk"],
                         "reported_used": node.spill_used, "degraded": node.spill_degraded},
            }
        pinned = sum(1 for o in self._objects.values() if o.effective_pin(now) is not Pin.NONE)
        soft = sum(1 for o in self._objects.values() if o.effective_pin(now) is Pin.SOFT)
        return {
            "capacity": sum(a.capacity for a in self._alloc.values()),
            "used": sum(a.used for a in self._alloc.values()),
            "disk_capacity": sum(n.spill_capacity for n in self._nodes.values()),
            "disk_used": sum(n.disk_used for n in self._nodes.values()),
            "keys": len(self._objects),
            "pending": len(self._pending),
            "slabs": len(self._slabs),
            "slab_bytes": self.slab_bytes(),
            "pinned": pinned,
            "soft_pinned": soft,
            "recovering": self.recovering,
            "native_calls": self.index.served() if self.index is not None else 0,
            "nodes": nodes,
            **self.counters,
        }

    def gauges(self) -> dict:
        """What the metrics need, in O(nodes): no scan of the objects (the master holds its
        lock meanwhile; a scan of a million keys every second would stall every client)."""
        nodes = {}
        for node_id, node in self._nodes.items():
            a = self._alloc[node_id]
            nodes[node_id] = {"dram": {"capacity": a.capacity, "used": a.used, "keys": node.tier_keys["dram"]},
                              "disk": {"capacity": node.spill_capacity, "used": node.disk_used,
                                       "keys": node.tier_keys["disk"]}}
        return {"nodes": nodes, "pending": len(self._pending), "keys": len(self._objects), **self.counters}

    # --------------------------------------------------------------- checking --
    def check_invariants(self) -> None:
        """Raise AssertionError if the index is inconsistent (simulation tests)."""
        live: dict[str, list[tuple[int, int]]] = {n: [] for n in self._nodes}
        disk = {n: 0 for n in self._nodes}
        inflight = {n: 0 for n in self._nodes}
        for table in (self._objects, self._pending):
            for key, obj in table.items():
                assert obj.key == key
                assert obj.complete == (table is self._objects), key
                ids = [(r.node_id, r.tier) for r in obj.replicas]
                assert len(ids) == len(set(ids)), f"{key}: two replicas in one node's tier"
                for r in obj.replicas:
                    assert r.node_id in self._nodes, f"{key}: replica on unmounted {r.node_id}"
                    assert key in self._nodes[r.node_id].keys, f"{key} missing from node index"
                    if r.tier is Tier.DRAM:
                        live[r.node_id].append((r.offset, r.length))
                    else:
                        disk[r.node_id] += r.length
                    if r.offloading:
                        inflight[r.node_id] += r.length
                if table is self._objects:
                    assert obj.replicas, f"{key}: complete object without replicas"
        for _, inc, node_id, off, length in self._deferred:
            if self._nodes[node_id].incarnation == inc:
                live[node_id].append((off, length))
        for slab in self._slabs.values():
            assert slab.node_id in self._nodes, f"slab {slab.slab_id} on unmounted {slab.node_id}"
            for off, length in slab.free.items():
                assert slab.offset <= off and off + length <= slab.offset + slab.length, \
                    f"slab {slab.slab_id}: piece {off} outside the slab"
                live[slab.node_id].append((off, length))
        for node_id, node in self._nodes.items():
            counted = {"dram": 0, "disk": 0}
            for key in node.keys:
                obj = self._objects.get(key)
                for r in obj.replicas if obj else ():
                    if r.node_id == node_id and r.ready:
                        counted[r.tier.value] += 1
            assert node.tier_keys == counted, f"{node_id}: key counters {node.tier_keys} != {counted}"
            want = disk[node_id] + sum(node.disk_pending.values())
            assert node.disk_used == want, f"{node_id}: disk_used {node.disk_used} != {want}"
            assert node.offload_inflight == inflight[node_id], f"{node_id}: offload bytes out of sync"
        for node_id, extents in live.items():
            a = self._alloc[node_id]
            assert a.used == sum(ln for _, ln in extents), f"{node_id}: used {a.used} != live extents"
            extents.sort()
            for (o1, l1), (o2, _) in zip(extents, extents[1:]):
                assert o1 + l1 <= o2, f"{node_id}: extents overlap at {o2}"
            for off, ln in extents:
                assert not a._overlaps_free(off, ln), f"{node_id}: live extent {off} is free"
        assert set(self._lru.keys()) == set(self._objects), "recency index out of sync"
        self._check_index()
