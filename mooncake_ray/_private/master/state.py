"""The master's state machine: object index, allocation, leases, pins, eviction, replicas
and node liveness (mounts, unmounts, drains, repairs and recovery in ``membership.py``,
a part of the same class). Pure Python, no Ray: the clock is injected, so tests run in
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
``_effects``; before it replies to the caller the actor moves them into that node's outbox,
and a delivery thread sends each outbox on (``MasterActor._delivery_loop``), so a reply
does not wait for the node. A master lost between its reply and that delivery (about a
millisecond) loses what the reply acknowledged.

Every public method is idempotent where the docstring says so; the RPC layer relies on
that to retry after a lost reply.
"""

from __future__ import annotations

import contextlib
import random
import time
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
from mooncake_ray._private.checks import check_records, check_replicas, check_ttl
from mooncake_ray._private.master.allocator import ExtentAllocator
from mooncake_ray._private.master.drain import Drains
from mooncake_ray._private.master.membership import Membership
from mooncake_ray._private.master.fastpath import COMMIT, COMMIT_RINGED, GRANT, HELD, RETURN, ReadMirror
from mooncake_ray._private.master.placement import order_nodes
from mooncake_ray._private.master.replicas import ReplicaTable
from mooncake_ray._private.master.adaptive import InsertionPolicy
from mooncake_ray._private.master.pyindex import REF_GET, PyIndex
from mooncake_ray._private.master.repairs import Repairs
from mooncake_ray._private.master.slabs import SlabTable, put_key
from mooncake_ray._private.master.chains import BACK, LINK, UNLINK
from mooncake_ray._private.master.table import ObjectTable
from mooncake_ray._private.master.tiering import PROMOTE, DiskTier
from mooncake_ray._private.master.types import (
    NodeDelta,
    NodeInfo,
    Obj,
    Pin,
    Replica,
    Generations,
    Policy,
    Tier,
    inventory_entry,
)
from mooncake_ray._private.wire import Extent, PutAlloc, ReadGrant, ReplicaLoc, SlabGrant

GONE_TTL_S = 120.0
"""How long the master remembers what an unmounted node held in DRAM, for the node's
restarted process to re-adopt (``mount``), and holds the chain tails its loss cut off
(``Chains.lost``)."""


class MasterState(Membership):
    """See the module docstring. The complete objects live in an ``ObjectTable`` kept in
    the read index ``index`` (``table.py``: a ``MasterIndex`` in the actor, by default a
    ``PyIndex``). Three parts are each handed what they use: the put slabs
    (``slabs.SlabTable``), the disk tier (``tiering.DiskTier``) and the mirror of what the
    index answers natively (``fastpath.ReadMirror``). Not thread-safe: the actor
    serialises calls, and calls ``flush`` at the end of each of its sections."""

    def __init__(self, policy: Policy | None = None, clock: Callable[[], float] = time.monotonic,
                 wall_ns: Callable[[], int] = time.time_ns, seed: int | None = None, index=None):
        self.policy = policy or Policy()
        self._clock = clock
        self._wall_ns = wall_ns
        self._rng = random.Random(seed)
        self._nodes: dict[str, NodeInfo] = {}
        self._alloc: dict[str, ExtentAllocator] = {}
        if index is None:
            index = PyIndex()
            index.clock, index.wall_ns = clock, wall_ns
            index.set_lease_ttl(self.policy.lease_ttl_s)
        self._objects = ObjectTable(index, self._nodes)  # complete, visible; in recency order
        self._pending: dict[str, Obj] = {}  # puts in flight
        self._gens = Generations(wall_ns)
        self._next_lease = 0
        self._expected: set[str] = set()
        self._short_scan_due = False  # a restarted master looks for values short of copies once
        self._recovery_deadline = 0.0
        self._restarted_at = 0.0
        self._alloc_gate_until = 0.0
        self._watermark_due: set[str] = set()  # see fastpath.apply_index_log
        # node id -> (when, incarnation, {key: gen}) of the DRAM values an unmounted node's
        # process held (mount).
        self._gone: dict[str, tuple[float, str, dict[str, int], dict[str, int]]] = {}
        self._held: dict[str, set[str]] = {}  # node id -> keys lost with it, held (chains.py: lost)
        # Replies the read index logged (held until durable, fence.py): (token, reply bytes,
        # the key of each item, [(key, gen, nodes), ...]); the actor takes them.
        self.held: list = []
        self.counters = {"hits": 0, "misses": 0, "disk_hits": 0, "evictions": 0, "evicted_bytes": 0,
                         "puts": 0, "put_bytes": 0, "revoked": 0, "removed": 0, "offloads": 0,
                         "promotions": 0, "disk_evictions": 0,
                         "node_unmounts": 0, "unmount_lost_keys": 0, "readopt_refused": 0}
        chains = self._objects.chains
        chains.counters, chains.shard, chains.shards = self.counters, self.policy.shard, self.policy.shards
        self.counters.update(chain_tail_evictions=0, lookups=0, chain_messages=0)
        self._objects.set_chain_eviction(self.policy.chain_eviction)
        # Chained values adapt their insertion (adaptive.py); plain LRU inserts at the recent end.
        self.insertion = InsertionPolicy(self.policy.chain_insert if self.policy.chain_eviction else "recent", index)
        self._objects.insertion = self.insertion
        self._adapted_at = 0.0
        self._mirror = ReadMirror(self._objects, self._pending, self._nodes)
        self._replicas = ReplicaTable(self.policy, clock, wall_ns, self._nodes, self._alloc, self._objects, self._pending,
                                      self.counters, self._mirror, offload=self._offload)
        reps = self._replicas
        self._slab_table = SlabTable(self.policy, self._nodes, self._alloc, self._objects, self._pending, reps,
                                     self._mirror, self._gens, self._rng, wall_ns)
        reps.slab_room = self._slab_table.room
        reps.before_evict = self.adapt
        self._tier = DiskTier(self.policy, self._nodes, self._objects, self.counters, self._mirror,
                              delta=reps.delta, drop_replica=reps.drop_replica, allocate=reps.allocate,
                              new_placement=reps.new_placement)
        self._drains = Drains(self.policy, clock, self._nodes, self._alloc, self._objects, reps, self.counters,
                              self._mirror, self._writes_into)
        self.repairs = Repairs(self.policy, clock, self._nodes, self._alloc, self._objects, reps, self.counters,
                               self._mirror)
        self._had: dict[str, int] | None = None  # unmount's copies-had record while it runs
        reps.on_short = self._on_short

    @property
    def _next_gen(self) -> int:
        """The last generation handed out (the read index's next commits go above it)."""
        return self._gens.last

    @property
    def index(self):
        """The read index holding the object table (a ``MasterIndex`` or ``PyIndex``)."""
        return self._objects.index

    @index.setter
    def index(self, index) -> None:
        """Move the table, the slabs and the keys in flight to another index."""
        self._objects.rebind(index)
        self.insertion.rebind(index)
        for key in self._pending:
            self._mirror.pending(key)
        for slab_id, slab in self._slab_table.slabs.items():
            self._mirror.slab(slab_id, slab)

    def flush(self) -> int:
        """End of a section: plain objects go back to being only records (``table.py``)."""
        return self._objects.flush()

    def adapt(self, now: float, every_s: float = 0.01) -> None:
        """Run the insertion policy's miniature caches over the references sampled since
        the last call and follow their choice (adaptive.py): at every tick, and before an
        eviction round (at most every ``every_s``), where the order starts to matter."""
        if now - self._adapted_at >= every_s:
            self._adapted_at = now
            self.insertion.update(sum(a.capacity for a in self._alloc.values()))
            chains = self._objects.chains
            if chains.remote_holds != self.insertion.old:
                chains.remote_holds = self.insertion.old
                self.index.set_remote_holds(chains.remote_holds)

    def _allocation_gate(self, now: float) -> None:
        """Without durable reservations, a restarted master allocates nothing until no
        client can still start a write into a previous master's slab (slabs.py)."""
        if now < self._alloc_gate_until and not self.policy.durable_acks:
            raise MasterUnavailableError(
                f"master restarted {now - self._restarted_at:.1f}s ago; allocations resume after "
                f"put_slab_ttl_s={self.policy.put_slab_ttl_s}s (writes into old slabs must end first)")

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

    def _node_of(self, key: str) -> str | None:
        """The node of ``key``'s first DRAM copy, if it is stored or being put (a batch's
        parent is put just before its child)."""
        obj = self._pending.get(key) or self._objects.peek(key)
        if obj is None:
            return None
        return next((r.node_id for r in obj.replicas if r.tier is Tier.DRAM), None)

    def _check_parent(self, key: str, parent) -> None:
        if parent == "":
            return
        if not isinstance(parent, str):
            raise InvalidArgumentError(f"parent of {key!r} must be a str key, got {type(parent).__name__}")
        if parent == key:
            raise InvalidArgumentError(f"{key!r} names itself as its parent")
        n = len(parent.encode("utf-8", "surrogatepass"))
        if n > self.policy.max_key_bytes:
            raise InvalidArgumentError(f"parent of {key!r} is a key of {n} bytes, longer than "
                                       f"max_key_bytes={self.policy.max_key_bytes}: {parent[:64]!r}...")

    def put_start(self, key: str, size: int, replicas: int | None = None, client_node: str | None = None,
                  owner: str = "", upsert: bool = False, parent: str = "") -> PutAlloc:
        """Reserve extents for a new value on up to ``replicas`` distinct nodes.

        Returns ``PutAlloc(gen, [Extent(node_id, offset, length, incarnation), ...])``; the client writes ``size``
        bytes at each extent, then calls ``put_end(key, gen)``.

        ``parent``: the key of the value this one follows in its KV chain ("" none): it is
        not evicted while this one is stored (``master.chain_eviction``, chains.py).

        Raises:
            InvalidArgumentError: bad key, parent or size, or a value larger than every arena.
            ObjectExistsError: ``key`` is stored and ``upsert`` is false.
            ObjectPendingError: another put of ``key`` is in flight (retryable).
            NoCapacityError: no node has room even after eviction (retryable).
            MasterUnavailableError: the master is rebuilding (retryable).
        """
        self._ready()
        self._check_key(key)
        self._check_parent(key, parent)
        if not isinstance(size, int) or size < 0:
            raise InvalidArgumentError(f"size must be a non-negative int, got {size!r}")
        now = self._clock()
        self._allocation_gate(now)
        self._replicas.release_deferred(now)
        pending = self._pending.get(key)
        if pending is not None:
            if owner and pending.owner == owner and pending.size == size and not pending.failed:
                # The same client retrying after a lost reply: hand back its allocation
                # (once its nodes have recorded the reservations, as the first reply).
                for r in pending.replicas:
                    self._replicas.refence(put_key(pending.gen), r.node_id, pending.gen, r.offset, r.length)
                return PutAlloc(pending.gen, self._extents(pending.replicas))
            raise ObjectPendingError(f"a put of {key!r} is already in flight")
        if key in self._objects and not upsert:
            raise ObjectExistsError(f"{key!r} is already stored; use upsert to replace it")
        want = self.policy.replicas if replicas is None else check_replicas(replicas)
        usable = [n for n in self._nodes.values() if not n.suspect and not n.draining]
        if not usable:
            raise NoCapacityError("no store node is mounted" if not self._nodes
                                  else "every store node is unreachable or draining")
        biggest = max(self._alloc[n.node_id].capacity for n in usable)
        if size > biggest:
            where = ("any store node's arena" if all(n.arena_length <= n.capacity for n in usable) else
                     "this master shard's part of any store node's arena (each of master.shards takes an "
                     "equal part)")
            raise InvalidArgumentError(f"value of {size} bytes is larger than {where} (largest: {biggest} bytes)")
        ordered = order_nodes(self.policy.allocation_strategy, usable, self._alloc, client_node, self._rng)
        if parent and self.policy.chain_eviction:  # beside its parent, where that node is not the fuller
            ordered = self._slab_table.beside(ordered, self._node_of(parent))
        # The put holds its parent from here until it ends: its room never comes from it.
        self._objects.wait_child(parent)
        try:
            placed = self._replicas.place(size, want, ordered, now)
        except BaseException:
            self._objects.unwait_child(parent)
            raise
        if not placed:
            self._objects.unwait_child(parent)
            if any(n.offload_inflight for n in usable):
                raise OffloadPendingError(
                    f"no room for {size} bytes of {key!r} until offloads to disk finish; retry")
            if self._pending or self._replicas.deferred:
                raise OffloadPendingError(
                    f"no room for {size} bytes of {key!r} while other puts are in flight or "
                    "replaced values wait for their readers; retry")
            raise NoCapacityError(
                f"no room for {size} bytes of {key!r}: every store node is full of pinned, leased or pending objects")
        obj = Obj(key, size, self._gens.new(), placed, put_deadline=now + self.policy.put_timeout_s, owner=owner,
                  parent=parent, want=want)
        if len(placed) < want:
            self.repairs.note(key, obj.gen, want, size)  # fewer usable nodes than copies asked for
        self._pending[key] = obj
        self._mirror.pending(key)
        for r in placed:
            self._replicas.watermark(r.node_id, now)
            self._replicas.note_reserved(r.node_id, put_key(obj.gen), obj.gen, r.offset, r.length)
        return PutAlloc(obj.gen, self._extents(placed))

    def _extents(self, reps) -> list[Extent]:
        """The incarnation pins each extent to the arena it was allocated in (a restarted
        node has a new one)."""
        return [Extent(r.node_id, r.offset, r.length, self._nodes[r.node_id].incarnation) for r in reps]

    def put_end(self, key: str, gen: int, crc: int | None = None) -> None:
        """Publish a pending put. Idempotent: ending an already published ``gen`` is a no-op.
        ``crc``: the CRC-32C of the value the client took in its copy, carried into the
        commit-ring records (``store/ring.py``) so the nodes need not read the value back.

        Raises:
            ObjectNotFoundError: no put of ``key``/``gen`` is pending (revoked or timed out).
            NodeUnavailableError: a replica's node died before the put ended; the put is
                revoked, retry the whole put (retryable).
        """
        obj = self._pending.get(key)
        if obj is None or obj.gen != gen:
            done = self._objects.get(key)
            if done is not None and done.gen == gen:
                self._replicas.settled(done, crc)
                return
            raise ObjectNotFoundError(f"no pending put of {key!r} (gen {gen}): it was revoked or timed out")
        if obj.failed or not obj.replicas:
            self.put_revoke(key, gen)
            raise NodeUnavailableError(f"put of {key!r} failed: {obj.failed or 'no replica left'}")
        del self._pending[key]
        self._mirror.pending(key)
        self._unreserve(obj)
        self._replicas.publish(obj, self._clock(), crc)
        self._objects.unwait_child(obj.parent)

    def _unreserve(self, obj: Obj) -> None:
        for r in obj.replicas:
            self._replicas.note_unreserved(r.node_id, put_key(obj.gen), obj.gen)

    def put_revoke(self, key: str, gen: int) -> bool:
        """Abandon a pending put and free its extents. Idempotent (False if nothing to do)."""
        obj = self._pending.get(key)
        if obj is None or obj.gen != gen:
            return False
        del self._pending[key]
        self._mirror.pending(key)
        self._unreserve(obj)
        self._objects.unwait_child(obj.parent)
        for r in obj.replicas:
            self._replicas.free_extent(r, 0.0)
        self.counters["revoked"] += 1
        return True

    # -------------------------------------------------------- put slabs (slabs.py) --
    @contextlib.contextmanager
    def one_call(self):
        """The keys of one GET call: a node found without room to promote into is not
        searched for victims again within the call (``DiskTier.no_room``)."""
        self._tier.no_room = set()
        try:
            yield
        finally:
            self._tier.no_room = None

    def slab_grant(self, owner: str, client_node: str | None = None, need: int = 0,
                   prefer: str | None = None) -> SlabGrant:
        """Reserve a slab for ``owner``. Its length is ``put_slab_bytes`` (at most 1/16 of
        the node's arena), or ``need`` if larger. ``prefer``: a store node id, taken first
        while it is not fuller than the least full node by more than ``PREFER_SLACK`` (the
        node of the KV chain's parent the client is about to put children of: a chain on one
        node is evicted from its leaves there; ``SlabTable.beside``).

        Raises:
            MasterUnavailableError: rebuilding, or within ``put_slab_ttl_s`` of a restart.
            NoCapacityError: no node has the room (the client puts the two-call way).
        """
        self._ready()
        if self.policy.put_slab_bytes <= 0:
            raise InvalidArgumentError("put slabs are disabled (master.put_slab_bytes is 0)")
        now = self._clock()
        self._allocation_gate(now)
        self._replicas.release_deferred(now)
        if prefer is not None and not isinstance(prefer, str):
            raise InvalidArgumentError(f"prefer must be a store node id (str) or None, got {type(prefer).__name__}")
        return self._slab_table.grant(owner, client_node, need, now, prefer)

    def slab_return(self, slab_id: int) -> int:
        """Free a slab's uncommitted space; returns the bytes freed. Idempotent."""
        return self._slab_table.give_back(slab_id)

    def slab_bytes(self) -> int:
        return self._slab_table.free_bytes()

    def put_commit(self, key: str, slab_id: int, offset: int, size: int, upsert: bool = False,
                   owner: str = "", parent: str = "") -> int:
        """Publish ``size`` bytes the caller wrote at ``offset`` of slab ``slab_id`` as
        ``key``; returns its generation (see ``SlabTable.commit``; ``parent`` as
        ``put_start``). Idempotent."""
        self._ready()
        self._check_key(key)
        self._check_parent(key, parent)
        self._objects.wait_child(parent)  # the room for the child must not come from its parent
        try:
            return self._slab_table.commit(key, slab_id, offset, size, upsert, owner, self._clock(), parent)
        finally:
            self._objects.unwait_child(parent)

    # ------------------------------------------------------- read index (fastpath.py) --
    def apply_index_log(self, misses: int, hits: int, log, decide: bool = True) -> None:
        """Apply what the native side did since the last drain, in order: each entry does
        what ``get`` / ``release`` / ``put_commit`` would have done at its logged time
        (``hits``: leases it granted on cold records, done there).

        The watermark checks of the commits come last, once every entry is applied.
        ``decide=False`` leaves them for a later call (the actor applies a large log while
        native calls go on, then takes the index mutex, drains the rest and decides)."""
        if misses:
            self.counters["misses"] += misses
        if hits:
            self.counters["hits"] += hits
        objects = self._objects
        full = self._watermark_due  # nodes that took logged commits, not checked yet
        call: list = []  # the values of the call whose commits are being applied
        i, n = 0, len(log)
        while i < n:
            kind, key, gen, lease, now, offset, size, parent = log[i]
            i += 1
            if kind == COMMIT or kind == COMMIT_RINGED:
                j = i  # a batch's commits into one slab: applied as one run
                while j < n and log[j][0] == kind and log[j][3] == lease:
                    j += 1
                run = log[i - 1:j]
                i = j
                node_id = self._slab_table.apply_logged_run(run, message=kind == COMMIT)
                call.extend((e[1], e[2], (node_id,)) for e in run)
                full.add(node_id)
                continue
            if kind == HELD:  # the reply to the commits just applied (key: its bytes)
                self.held.append(((lease, gen, offset), key, [v[0] for v in call], call))
                call = []
                continue
            if kind == RETURN:  # a used-up slab given back with the commits before it
                self._slab_table.give_back(lease)
                continue
            obj = objects.get(key)
            if obj is None or obj.gen != gen:  # a release of a dropped value (a grant cannot be: see fastpath.py)
                self._replicas.end_dropped_lease(key, gen, lease)
                continue
            if kind == GRANT:
                self._replicas.grant_lease(obj, lease, now, touch=False)  # the index touched it
                self.counters["hits"] += 1
            elif obj.leases is not None:
                self._replicas.end_lease(obj, lease, now)
        if full and decide:
            now = self._clock()
            for node_id in full:
                if node_id in self._nodes:
                    self._replicas.watermark(node_id, now)
            full.clear()

    # ------------------------------------------------------- disk tier (tiering.py) --
    def offload_done(self, node_id: str, items) -> None:
        """A node finished offloads: ``items`` of ``(key, gen, length, ok, error)``.
        Idempotent. A disk copy this master never asked for (it restarted meanwhile) is
        adopted if it is the current value, dropped otherwise.

        Raises:
            InvalidArgumentError: a malformed item (nothing of the call is applied).
        """
        check_records(items, (str, int, int, bool, str), "offload report")
        self._tier.offload_done(node_id, items, self._clock())

    def promotions_reserved(self, node_id: str, items) -> list[bool]:
        """Per ``(key, gen, offset, size)`` item: whether this master reserved that extent
        of ``node_id`` to promote the value into (a store node reads a disk copy into its
        arena only then).

        Raises:
            InvalidArgumentError: a malformed item.
        """
        check_records(items, (str, int, int, int), "promote item")
        return [self._tier.reserved(node_id, *it) for it in items]

    def vouch(self, node_id: str) -> None:
        """This master reached the node itself: a client's report of it is discounted."""
        if node_id in self._nodes:
            self._nodes[node_id].suspect = False

    def promote_done(self, node_id: str, items) -> None:
        """A node finished promotions: ``items`` of ``(key, gen, offset, error_name)``
        (``error_name`` empty on success). Idempotent.

        Raises:
            InvalidArgumentError: a malformed item (nothing of the call is applied).
        """
        check_records(items, (str, int, int, str), "promote report")
        self._tier.promote_done(node_id, items, self._clock())

    # ------------------------------------------------------------------- reads --
    def get(self, key: str, client_node: str | None = None) -> ReadGrant | None:
        """Descriptors of a stored value, with a read lease.

        Returns a ``ReadGrant`` (its ``ReplicaLoc``s with the caller's local replica first),
        or ``None`` on a miss (a miss is a value).
        Release the lease with ``release(key, gen, lease)`` once the bytes are copied.
        """
        self._ready()
        if self.insertion.sampling:
            self.index.sample(REF_GET, key, 0, False)
        obj = self._objects.get(key)
        if obj is None:
            self.counters["misses"] += 1
            return None
        now = self._clock()
        # Lease first: a promotion below may evict, and must not evict this object.
        self._next_lease += 1
        lease = self._next_lease
        until = self._replicas.grant_lease(obj, lease, now)
        reps = [r for r in obj.replicas if r.tier is Tier.DRAM and r.ready]
        if reps:
            self.counters["hits"] += 1
            tier = Tier.DRAM.value
        else:  # only on disk: promote it into DRAM (may raise OffloadPendingError: retryable)
            try:
                prom = self._tier.promotion(obj, client_node, now)
            except OffloadPendingError:
                self._replicas.end_lease(obj, lease, now, until)
                raise
            if prom is None:  # neither tier readable: only a copy being written is left (its source died)
                self._replicas.end_lease(obj, lease, now, until)
                self.counters["misses"] += 1
                return None
            reps = [prom]
            self.counters["disk_hits"] += 1
            tier = PROMOTE
        if client_node and len(reps) > 1:
            reps = sorted(reps, key=lambda r: (r.node_id != client_node and
                                               self._nodes[r.node_id].ray_node_id != client_node))
        return ReadGrant(obj.size, obj.gen, self.policy.lease_ttl_s,
                         [ReplicaLoc(r.node_id, tier, r.offset, r.length, self._nodes[r.node_id].incarnation,
                                     r.placed) for r in reps], lease)

    def release(self, key: str, gen: int, lease: int, now: float | None = None) -> None:
        """A reader is done with lease ``lease`` on ``key``/``gen``. When the last one is
        released the lease ends at once instead of at its expiry, so a scan over a
        working set larger than DRAM never waits for leases. Idempotent (a lease id is
        released once; retrying after a lost reply is safe)."""
        obj = self._objects.get(key)
        if obj is None or obj.gen != gen:
            self._replicas.end_dropped_lease(key, gen, lease)
        elif obj.leases is not None:
            self._replicas.end_lease(obj, lease, self._clock() if now is None else now)

    def exists(self, key: str) -> bool:
        """Whether ``key`` is stored. A lookup is not a use: it neither moves the key in
        the eviction order nor holds it (only a read's lease does)."""
        self._ready()
        self.counters["lookups"] += 1
        return key in self._objects

    def take_held(self) -> list:
        """The replies the read index logged since the last call (see ``held``)."""
        held, self.held = self.held, []
        return held

    def holders(self, key: str, gen: int) -> set[str] | None:
        """The nodes holding a ready replica of ``key``'s value ``gen`` (empty: none left),
        or None when a newer value replaced it (fence.py)."""
        obj = self._objects.get(key)
        if obj is not None and obj.gen > gen:
            return None
        if obj is None or obj.gen != gen:
            return set()
        return {r.node_id for r in obj.replicas if r.ready and r.node_id in self._nodes}

    def where(self, key: str) -> list[tuple[str, str, bool]]:
        """``(node_id, tier, ready)`` of each replica of a stored key (for tests/tools)."""
        obj = self._objects.get(key)
        return [] if obj is None else [(r.node_id, r.tier.value, r.ready) for r in obj.replicas]

    # ----------------------------------------------------------------- removal --
    def remove(self, key: str, force: bool = False) -> bool:
        """Remove a stored value. Returns False if it was not stored (idempotent).

        Raises:
            ObjectLeasedError: a reader holds a lease and ``force`` is false (retryable).
        """
        self._ready()
        for _t, _inc, vouched, _had in self._gone.values():  # a removed key never comes back with a node
            vouched.pop(key, None)
        obj = self._objects.get(key)
        if obj is None:
            return False
        now = self._clock()
        if obj.leased(now) and not force:
            raise ObjectLeasedError(
                f"{key!r} is leased to a reader for {obj.lease_until - now:.1f}s more; retry or force=True")
        self._replicas.drop_object(obj, now)
        self.counters["removed"] += 1
        return True

    def remove_prefix(self, prefix: str, force: bool = False) -> int:
        """Remove every stored key starting with ``prefix``; leased ones are skipped
        unless ``force``. Returns how many were removed."""
        self._ready()
        for _t, _inc, vouched, _had in self._gone.values():
            for key in [k for k in vouched if k.startswith(prefix)]:
                del vouched[key]
        now, n = self._clock(), 0
        for key in self._objects.keys_with_prefix(prefix):
            obj = self._objects[key]
            if force or not obj.leased(now):
                self._replicas.drop_object(obj, now)
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
        if ttl_s is not None:
            check_ttl(ttl_s)
        obj = self._objects.get(key)
        if obj is None:
            raise ObjectNotFoundError(f"cannot pin {key!r}: not stored")
        obj.pin = Pin.HARD if hard else Pin.SOFT
        obj.pin_until = self._clock() + (ttl_s if ttl_s is not None else self.policy.soft_pin_ttl_s)
        self._replicas.pinned[key] = obj
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
                self._replicas.delta(r.node_id).add(inventory_entry(obj, r))

    # ---------------------------------------------------------------- periodic --
    def eviction_due(self) -> bool:
        """Whether some node waits for background eviction (``evict_in_background``)."""
        return bool(self._replicas.evict_due)

    def evict_due(self, chunk_bytes: int) -> bool:
        """One chunk of background eviction on each node past its watermark (a section of
        its own: the actor calls it repeatedly, releasing its lock in between, so a round
        of millions of small values never holds every call up at once). Returns whether
        more is due."""
        now = self._clock()
        for node_id in list(self._replicas.evict_due):
            self._replicas.evict_chunk(node_id, chunk_bytes, now)
        return self.eviction_due()

    def drain_effects(self) -> dict[str, NodeDelta]:
        """Inventory changes to deliver to store nodes (and forget here)."""
        return self._replicas.drain()

    def has_effects(self) -> bool:
        """Whether some node is owed an inventory change (the actor delivers them)."""
        return bool(self._replicas.effects)

    def _offload(self, node: NodeInfo, obj: Obj, rep: Replica, now: float) -> bool:
        return self._tier.try_offload(node, obj, rep, now)

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
        leases ended, drop orphaned chain tails. Returns what it did."""
        now = self._clock()
        self.adapt(now, every_s=0.0)
        self._replicas.release_deferred(now)
        self._tier.expire_promotions(now)
        self._drains.expire(now)
        self.repairs.expire(now)
        self.repairs.prune()
        for node_id in [n for n, (t, _i, _v, _h) in self._gone.items() if now - t > GONE_TTL_S]:
            del self._gone[node_id]
            self._release_held(node_id)
        slabs = self._slab_table.expire(now)
        expired = [(k, o.gen) for k, o in self._pending.items() if o.put_deadline <= now]
        for key, gen in expired:
            self.put_revoke(key, gen)
        silent = [n for n in self._nodes.values() if now - n.last_heartbeat > self.policy.node_ttl_s]
        lost = sum(self.unmount(n.node_id, f"silent for {now - n.last_heartbeat:.1f}s") for n in silent)
        self.counters["node_unmounts"] += len(silent)
        self.counters["unmount_lost_keys"] += lost
        # Orphans (a removed or lost parent, or one whose reader held it) go here too.
        tails = (self._replicas.drop_orphans(now)
                 if self.policy.chain_eviction and self._objects.chains.orphans and not self.recovering else 0)
        return {"revoked": len(expired), "unmounted": [n.node_id for n in silent], "lost": lost,
                "slabs_expired": slabs, "tails_dropped": tails}

    # ------------------------------------------------------------------- stats --
    def stats(self) -> dict:
        now = self._clock()
        nodes = {node_id: node.usage(self._alloc[node_id], detail=True) for node_id, node in self._nodes.items()}
        pinned = soft = 0
        table, objects = self._replicas.pinned, self._objects
        for key, obj in list(table.items()):
            pin = obj.effective_pin(now)
            if objects.hot(key) is not obj or obj.pin is Pin.NONE:
                del table[key]  # replaced, dropped or unpinned since
            elif pin is not Pin.NONE:
                pinned += 1
                soft += pin is Pin.SOFT
        return {
            "capacity": sum(a.capacity for a in self._alloc.values()),
            "used": sum(a.used for a in self._alloc.values()),
            "disk_capacity": sum(n.spill_capacity for n in self._nodes.values()),
            "disk_used": sum(n.disk_used for n in self._nodes.values()),
            "keys": len(self._objects),
            "pending": len(self._pending),
            "slabs": len(self._slab_table.slabs),
            "slab_bytes": self.slab_bytes(),
            "pinned": pinned,
            "soft_pinned": soft,
            "recovering": self.recovering,
            "draining": self.draining(),
            "under_replicated_keys": len(self.repairs.short),
            "under_replicated_bytes": self.repairs.short_bytes,
            "native_calls": self.index.served(),
            "ring_acks": self.index.ring_acks(),  # puts answered through commit rings
            "eviction_policy": self.insertion.stats(),
            "nodes": nodes,
            **self.counters,
            **self._chain_stats(),
        }

    def gauges(self) -> dict:
        """What the metrics need, in O(nodes): no scan of the objects (the master holds its
        lock meanwhile; a scan of a million keys every second would stall every client)."""
        nodes = {node_id: node.usage(self._alloc[node_id], detail=False) for node_id, node in self._nodes.items()}
        return {"nodes": nodes, "pending": len(self._pending), "keys": len(self._objects), **self.counters,
                "under_replicated_keys": len(self.repairs.short), "under_replicated_bytes": self.repairs.short_bytes,
                **self._chain_stats(), **self._insertion_gauges()}

    def _insertion_gauges(self) -> dict:
        ins = self.insertion
        return {"insert_old": int(ins.old), "insertion_score": ins.scores()[0],
                "insertion_switches": ins.counters["switches"],
                "shadow_refs": ins.counters["refs"], "shadow_hits_recent": ins.counters["hits_recent"],
                "shadow_hits_old": ins.counters["hits_old"]}

    def _chain_stats(self) -> dict:
        """Values linked into chains, orphans (stored, parent not), lookups answered here
        and by the read index (none takes a lease); with shards, links to parents other
        shards own and children other shards hold of this shard's values."""
        chains = self._objects.chains
        return {"chained": len(chains.parent), "orphaned_pages": len(chains.orphans),
                "lookups": self.counters["lookups"] + self.index.lookups(),
                "chain_remote_children": sum(len(k) for k in chains.remote.values())}

    # ---------------------------------------------------- chains across shards --
    def chain_outbox(self) -> dict[int, list[tuple[str, str, str]]]:
        """The chain messages owed to other master shards (chains.py), by shard: links
        and unlinks of this shard's children, and parents of this shard's that went or
        came back (those linked while not stored, once their grace ran out)."""
        chains = self._objects.chains
        chains.due(self._clock(), self._objects.__contains__)
        out: dict[int, list] = {}
        for shard, kind, parent, child in chains.outbox:
            out.setdefault(shard, []).append((kind, parent, child))
        chains.outbox.clear()
        return out

    def chain_messages_due(self) -> bool:
        return bool(self._objects.chains.outbox)

    def chain_links_to(self, shard: int) -> list[tuple[str, str]]:
        """Every link this shard holds to a parent ``shard`` owns (sent whole when either
        restarted)."""
        return self._objects.chains.foreign_links(shard)

    def chain_receive(self, shard: int, items, links=None) -> None:
        """Chain messages from master ``shard``; ``links``: every link it holds to this
        shard's parents, replacing what it said before.

        Raises:
            InvalidArgumentError: a shard that is not another of this store's, a message
                or link not of the wire's shape (nothing is applied then).
        """
        objects, now = self._objects, self._clock()
        chains = objects.chains
        chains.check_messages(shard, items, links)
        if links is not None:
            objects.remote_sync(shard, links, now)
        for kind, parent, child in items:
            if kind == LINK:
                objects.remote_link(parent, child, now)
            elif kind == UNLINK:
                objects.remote_unlink(parent, child)
            else:
                chains.foreign_status(parent, kind == BACK)
        self.counters["chain_messages"] += len(items)
        if chains.orphans and self.policy.chain_eviction and not self.recovering:
            self._replicas.drop_orphans(now)  # a parent went on its shard: its tail here goes now

    # --------------------------------------------------------------- checking --
    def check_invariants(self, unapplied: set[str] = frozenset()) -> None:
        """Raise AssertionError if the index is inconsistent (simulation tests).
        ``unapplied``: keys the index committed whose log entries Python has not applied
        yet (their records are ahead of the state machine: left out, and the index's
        answers are then not compared)."""
        live: dict[str, list[tuple[int, int]]] = {n: [] for n in self._nodes}
        self._slab_table.check(live)  # adds the slabs' uncommitted pieces
        self._replicas.check(live, unapplied)
        if not unapplied:
            self._mirror.check(self._slab_table.slabs)

