"""Where the values' bytes are: the replicas of complete and pending objects on the store
nodes' arenas and disks (pure, no Ray).

``ReplicaTable`` publishes values, drops objects and replicas, frees their extents (at
once, or once the last read lease ends: ``deferred``), evicts to make room, and queues what
each node must learn of it in its inventory delta (``effects``, see ``types.NodeDelta``).
``MasterState`` holds one and decides when; the disk tier and the put slabs use it through
the callbacks they are handed.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Callable

from mooncake_ray._private.master.allocator import ExtentAllocator, extent_length
from mooncake_ray._private.master.chains import Picker
from mooncake_ray._private.master.eviction import EVICT, judge, pick_victims, pinned_tail, take_orphans
from mooncake_ray._private.master.types import (
    RESERVED,
    InventoryEntry,
    NodeDelta,
    NodeInfo,
    Obj,
    Pin,
    Policy,
    Replica,
    Tier,
    inventory_entry,
)

COPY_LEASE_BASE = 1 << 50  # lease ids of copies node to node (the readers' stay far below)
_DRAM_TIER = Tier.DRAM.value


def split_inventory(inventory, known: Callable[[str], bool] | None, vouched: dict | None,
                    had: dict) -> tuple[tuple[list, bytes], list]:
    """A mounting node's inventory (entry lists, or ``inventory.pack``'s form) as
    ``((keys, cols), rest)``. Plain entries are the common case: DRAM values of one copy
    asked for, unpinned, naming no parent, not in the table (``known``; None: the table is
    empty), vouched for by what the master lost with the node (when ``vouched`` is given)
    and not short of copies (``had``); they come back as their keys and ``cols`` (4 int64s
    each: gen, size, offset, length), to become cold records in bulk (``restore_plain``).
    The rest are entry lists for ``restore``, one by one. A key listed twice (another
    tier) leaves every entry of it to ``restore``."""
    import numpy as np

    from mooncake_ray._private.store.inventory import _entry, pack

    if not isinstance(inventory, dict):
        inventory = pack(_entry(e) for e in inventory)
    keys, cols, rest = inventory["keys"], inventory["cols"], list(inventory["rest"])
    if not keys:
        return ([], b""), rest
    table = np.frombuffer(cols, dtype="<i8").reshape(-1, 4)
    if len(table) != len(keys):
        raise ValueError(f"a packed inventory of {len(keys)} keys has {len(table)} rows")
    others = {e[0] for e in rest}
    if known is not None or vouched is not None or had or others:
        gens = table[:, 0].tolist()
        keep = [not (known is not None and known(k) or vouched is not None and vouched.get(k) != g
                     or k in had or k in others) for k, g in zip(keys, gens)]
        if not all(keep):
            row = table.tolist()
            rest += [[k, r[0], r[1], _DRAM_TIER, r[2], r[3]] for k, r, ok in zip(keys, row, keep) if not ok]
            others = {e[0] for e in rest}  # a key now in rest by two entries takes the other one with it
            keep = [ok and k not in others for k, ok in zip(keys, keep)]
            mask = np.array(keep, dtype=bool)
            keys = [k for k, ok in zip(keys, keep) if ok]
            cols = table[mask].tobytes()
    return (keys, cols), rest


class ReplicaTable:
    """The objects' replicas and the space they hold (see the module docstring).

    Shares the state machine's tables (``nodes``, ``alloc``: each node's arena allocator,
    ``objects``: complete values and their recency (``table.ObjectTable``), ``pending``:
    puts in flight, ``counters``); tells ``mirror`` every change to what a GET answers.
    ``offload(node, obj, rep, now)`` is the disk tier's: eviction offers it each DRAM
    victim first (True: being offloaded, kept)."""

    def __init__(self, policy: Policy, clock: Callable[[], float], wall_ns: Callable[[], int],
                 nodes: dict[str, NodeInfo],
                 alloc: dict[str, ExtentAllocator], objects: ObjectTable, pending: dict[str, Obj],
                 counters: dict[str, int], mirror: ReadMirror,
                 offload: Callable[[NodeInfo, Obj, Replica, float], bool]):
        self.policy = policy
        self._clock = clock
        self._wall_ns = wall_ns
        self._last_placed = 0
        self._copy_lease = COPY_LEASE_BASE
        self._nodes = nodes
        self._alloc = alloc
        self._objects = objects
        self._pending = pending
        self.counters = counters
        self._mirror = mirror
        self._offload = offload
        # extents of dropped objects waiting for their read leases to end:
        # (until, seq, incarnation, node, off, len, (key, gen) or None)
        self.deferred: list[tuple[float, int, str, str, int, int, tuple | None]] = []
        self._seq = 0
        # a dropped object's leases still out, and its deferred entries: its readers'
        # releases free the extents before ``until`` (entries freed so: ``_void``)
        self._dropped: dict[tuple[str, int], tuple[set, list]] = {}
        self._void: set[int] = set()
        self._batch_free: list | None = None  # extents an eviction batch freed, released at its end
        self._batch_node: str | None = None
        self.effects: dict[str, NodeDelta] = {}
        self.evict_due: set[str] = set()  # nodes past the watermark (policy.evict_in_background)
        # Objects that were pinned (key -> object; entries for values since replaced,
        # dropped or unpinned go when counted): stats() counts pins without a scan of
        # every object, which at ten million keys held the state lock for seconds.
        self.pinned: dict[str, Obj] = {}
        # Bytes of a node's arena put slabs hold uncommitted (SlabTable.room, set by the
        # state machine): eviction follows the bytes values hold, not these.
        self.slab_room: Callable[[str], int] = lambda node_id: 0
        # While the actor collects them for its fence (fence.py): (key, gen, nodes) of each
        # value a call published or answered for again.
        self.fenced: list | None = None
        # Beside it, the commit-ring records (store/ring.py) that would make those values
        # durable without the round trip: (node_id, incarnation, reserved?, key, gen, size,
        # offset, length, parent[, want, crc]) each; None when one of them cannot go that way.
        self.ring: list | None = None
        # Told (key, gen, copies it had, size) of each value a lost node leaves short of copies
        # (repairs.py; set by the state machine).
        self.on_short: Callable[[str, int, int, int], None] | None = None
        # Called with ``now`` before an eviction round (the insertion policy catches up).
        self.before_evict: Callable[[float], None] | None = None

    def publish(self, obj: Obj, now: float, crc: int | None = None) -> None:
        """Make a written value visible, replacing the key's old value if any (``crc``: as
        ``settled``)."""
        key = obj.key
        old = self._objects.get(key)
        if old is not None:
            self.drop_object(old, now)
        obj.complete = True
        self._objects[key] = obj
        self._objects.touch_new(key, obj.parent, obj.size)
        self.counters["puts"] += 1
        self.counters["put_bytes"] += obj.size
        for r in obj.replicas:
            self._nodes[r.node_id].tier_keys[r.tier._value_] += 1
            self.delta(r.node_id).add(inventory_entry(obj, r))
        if self.fenced is not None:
            self.settled(obj, crc)

    def note_reserved(self, node_id: str, key: str, gen: int, offset: int, length: int) -> None:
        """Tell the node a range of its arena is handed out for writing (a put slab, a
        pending put's extent: ``key`` names it); the call's reply waits until the node has
        recorded it (fence.py), so a restarted master learns of every such range."""
        self.delta(node_id).add(InventoryEntry(key, gen, length, RESERVED, offset, length, 0))
        self.refence(key, node_id, gen, offset, length)

    def refence(self, key: str, node_id: str, gen: int, offset: int, length: int) -> None:
        """A call answers for a reservation (made now, or again on a retry): its reply
        waits until the node has recorded it."""
        if self.fenced is not None:
            self.fenced.append((key, -1, (node_id,)))
            node = self._nodes.get(node_id)
            if self.ring is not None and node is not None:
                self.ring.append((node_id, node.incarnation, True, key, gen, length, offset, length, ""))
            else:
                self.ring = None

    def note_unreserved(self, node_id: str, key: str, gen: int) -> None:
        if node_id in self._nodes:
            self.delta(node_id).drop(key, gen, RESERVED)

    def settled(self, obj: Obj, crc: int | None = None) -> None:
        """A call answers for ``obj``'s value (published now, or again on a retry): its
        reply waits until the nodes holding it have recorded it (fence.py). ``crc``: the
        CRC-32C of the value its writer took in its copy, for the ring records."""
        if self.fenced is not None:
            self.fenced.append((obj.key, obj.gen, tuple({r.node_id for r in obj.replicas})))
            if self.ring is None:
                return
            if obj.pin:  # a ring record carries no pin: the message brings it
                self.ring = None
                return
            for r in obj.replicas:
                node = self._nodes.get(r.node_id)
                if node is None or r.tier is not Tier.DRAM or not r.ready:
                    self.ring = None
                    return
                self.ring.append((r.node_id, node.incarnation, False, obj.key, obj.gen, obj.size, r.offset, r.length,
                                  obj.parent or "", obj.want, crc))

    def published_natively_many(self, entries: list, node_id: str, message: bool = True) -> None:
        """The bookkeeping of values the read index committed, a run of log entries all on
        ``node_id`` (``SlabTable.apply_logged_run``; their records are in the table already,
        cold): what ``publish`` does besides the record. ``message=False``: the index
        answered them through the node's commit ring, whose records are all the node gets of
        them (the node reads its ring before any later message, so a drop or replacement of
        a value still applies after it)."""
        self.counters["puts"] += len(entries)
        self.counters["put_bytes"] += sum(e[6] for e in entries)
        self._nodes[node_id].tier_keys["dram"] += len(entries)
        if message:
            delta = self.delta(node_id)
            for e in entries:
                delta.add(InventoryEntry(e[1], e[2], e[6], "dram", e[5], extent_length(e[6]), 0, e[7]))

    def restore(self, node: NodeInfo, e: InventoryEntry, now: float) -> None:
        """Take in one entry of a mounting node's inventory (newest first)."""
        tier = Tier(e.tier)
        obj = self._objects.get(e.key)
        if obj is not None and obj.gen != e.gen:
            if obj.gen > e.gen:  # a stale replica of a replaced value
                self.delta(node.node_id).drop(e.key, e.gen, e.tier)
                return
            self.drop_object(obj, now)  # ours is the newer value
            obj = None
        if tier is Tier.DRAM:
            try:
                self._alloc[node.node_id].reserve(e.offset, e.length)
            except ValueError:  # overlaps another entry: trust neither copy of these bytes
                self.delta(node.node_id).drop(e.key, e.gen, e.tier)
                return
        elif obj is not None and any(r.node_id == node.node_id and r.tier is tier for r in obj.replicas):
            return  # the same disk copy listed twice
        else:
            node.disk_used += e.length
        if obj is None:
            # Readers may still hold leases granted by the previous master: honour them.
            obj = Obj(e.key, e.size, e.gen, [], complete=True, lease_until=now + self.policy.lease_ttl_s,
                      pin=Pin(e.pin), pin_until=now + self.policy.soft_pin_ttl_s, parent=e.parent, want=e.want)
            self._objects[e.key] = obj
            self._objects.touch(e.key)
            if obj.pin is not Pin.NONE:
                self.pinned[e.key] = obj
        elif e.want > obj.want:
            obj.want = e.want  # each node's entry says how many copies the put asked for
        # Not the put's placement as far as this master knows: a new id (see Replica.placed).
        obj.replicas.append(Replica(node.node_id, tier, e.offset, e.length, placed=self.new_placement()))
        node.tier_keys[tier.value] += 1
        self._mirror.key(e.key)

    def restore_plain(self, node: NodeInfo, plain: tuple[list, bytes], now: float) -> None:
        """Take in a mounting node's plain DRAM values (``split_inventory``'s ``(keys,
        cols)``) whose extents the caller has reserved: each becomes a cold record, as
        ``restore`` followed by the section's ``flush`` would leave it (one replica, the
        previous master's leases honoured, a new placement id), in the order listed, in
        one call to the read index and without a Python object per value. A plain value
        that holds a stored child is made hot by the chain links."""
        keys, cols = plain
        if not keys:
            return
        placed = self.new_placement()
        self._last_placed = placed + len(keys) - 1
        self._objects.index.set_cold_many(keys, cols, node.node_id, node.ray_node_id, node.incarnation, placed,
                                          now + self.policy.lease_ttl_s)
        node.tier_keys["dram"] += len(keys)
        self._objects.restored_plain(keys)

    def grant_lease(self, obj: Obj, lease: int, now: float, touch: bool = True) -> float:
        """Lease ``lease`` on ``obj`` for ``lease_ttl_s`` from ``now``, with a recency
        touch (``get``; not for the leases native GETs granted, which touched the index
        themselves). Returns the end of ``obj``'s leases before this one (to undo it)."""
        until = obj.lease_until
        held = obj.leases
        if until <= now or held is None:
            obj.leases = lease  # earlier leases expired, released or not
        elif type(held) is int:
            obj.leases = {held, lease}
        else:
            held.add(lease)
        obj.lease_until = max(until, now + self.policy.lease_ttl_s)
        if touch:
            self._objects.touch(obj.key)
        return until

    @staticmethod
    def end_lease(obj: Obj, lease: int, now: float, until: float | None = None) -> None:
        """Lease ``lease`` on ``obj`` is released; the last one ends the lease at ``now``,
        not at its expiry (or sets it back to ``until``: undoing a grant). An id not held
        is a no-op."""
        held = obj.leases
        if type(held) is int:
            if held != lease:
                return
            obj.leases = None
        elif held is not None:
            held.discard(lease)
            if held:
                return
            obj.leases = None
        else:
            return
        obj.lease_until = min(obj.lease_until, now) if until is None else until

    def hold_for_copy(self, obj: Obj, until: float, now: float) -> int:
        """A lease on ``obj`` for a copy node to node (a drain's move, a repair) until
        ``until``: its copies' extents stay where they are meanwhile, the one read and the
        one written (eviction passes a leased value over; a value removed or replaced
        keeps its extents until the lease ends). Returns the lease, for ``release_copy``."""
        self._copy_lease += 1
        self.grant_lease(obj, self._copy_lease, now, touch=False)
        obj.lease_until = max(obj.lease_until, until)
        return self._copy_lease

    def release_copy(self, key: str, gen: int, obj: Obj, lease: int, now: float) -> None:
        """The copy that held ``lease`` ended (reported, failed or given up)."""
        cur = self._objects.get(key)
        if cur is not None and cur.gen == gen:  # (a new instance if it went cold meanwhile)
            self.end_lease(cur, lease, now)
        else:  # removed or replaced meanwhile: its extents were waiting for this lease
            self.end_dropped_lease(key, gen, lease)

    def new_placement(self) -> int:
        """A ``Replica.placed`` id no replica of this master (or an earlier one) has had."""
        self._last_placed = max(self._last_placed + 1, self._wall_ns())
        return self._last_placed

    def drop_object(self, obj: Obj, now: float) -> None:
        """Forget a complete object; its extents wait for its lease to end (or for the
        release of its last lease, :meth:`end_dropped_lease`)."""
        del self._objects[obj.key]
        owner = (obj.key, obj.gen) if obj.leases is not None else None
        entries = [e for r in obj.replicas if (e := self._release_replica(obj, r, owner)) is not None]
        if entries and owner is not None:
            held = obj.leases
            self._dropped[owner] = ({held} if type(held) is int else set(held), entries)

    def end_dropped_lease(self, key: str, gen: int, lease: int) -> None:
        """A reader released ``lease`` on a dropped (removed or replaced) version of
        ``key``; the last release frees its extents at once. Unknown leases: no-op."""
        d = self._dropped.get((key, gen))
        if d is None:
            return
        leases, entries = d
        leases.discard(lease)
        if leases:
            return
        del self._dropped[(key, gen)]
        for _, seq, inc, node_id, off, length, _ in entries:
            self._void.add(seq)
            node = self._nodes.get(node_id)
            if node is not None and node.incarnation == inc:
                self._alloc[node_id].release(off, length)

    def drop_replica(self, obj: Obj, rep: Replica, now: float) -> None:
        """Drop one replica; an object left with none is gone (a miss from now on)."""
        obj.replicas.remove(rep)
        self._release_replica(obj, rep)
        if self._objects.get(obj.key) is obj:
            if not obj.replicas:
                del self._objects[obj.key]
            else:
                self._mirror.key(obj.key)

    def _release_replica(self, obj: Obj, r: Replica, owner: tuple | None = None):
        """Forget replica ``r`` of ``obj``; returns the deferred entry of its extent, if
        it waits for a lease (``owner``: the dropped object it belongs to)."""
        node = self._nodes.get(r.node_id)
        if node is None:
            return None
        entry = None
        # An add of this replica still in the delta (published, then evicted before
        # delivery) is cancelled there, in O(1).
        self.delta(r.node_id).drop(obj.key, obj.gen, r.tier._value_)
        if obj.complete and r.ready:
            node.tier_keys[r.tier._value_] -= 1
        if r.tier is Tier.DISK:
            node.disk_used -= r.length
        else:
            if r.offloading:  # the offload's disk reservation ends with offload_done
                node.offload_inflight -= r.length
            entry = self.free_extent(r, obj.lease_until, owner)
        return entry

    def free_extent(self, rep: Replica, until: float, owner: tuple | None = None):
        """Free a DRAM replica's extent now, or at ``until`` (a lease's end); returns the
        deferred entry, if deferred."""
        if rep.tier is not Tier.DRAM or rep.node_id not in self._alloc:
            return None
        if until > self._clock():
            node = self._nodes[rep.node_id]
            self._seq += 1
            entry = (until, self._seq, node.incarnation, rep.node_id, rep.offset, rep.length, owner)
            heapq.heappush(self.deferred, entry)
            return entry
        if self._batch_free is not None and rep.node_id == self._batch_node:
            self._batch_free.append((rep.offset, rep.length))
        else:
            self._alloc[rep.node_id].release(rep.offset, rep.length)
        return None

    def release_deferred(self, now: float) -> None:
        while self.deferred and self.deferred[0][0] <= now:
            _, seq, inc, node_id, off, length, owner = heapq.heappop(self.deferred)
            if seq in self._void:  # freed already, by its readers' releases
                self._void.discard(seq)
                continue
            if owner is not None:
                self._dropped.pop(owner, None)
            node = self._nodes.get(node_id)
            if node is not None and node.incarnation == inc:
                self._alloc[node_id].release(off, length)

    def delta(self, node_id: str) -> NodeDelta:
        d = self.effects.get(node_id)
        if d is None:
            d = self.effects[node_id] = NodeDelta()
        return d

    def drain(self) -> dict[str, NodeDelta]:
        """Inventory changes to deliver to store nodes (and forget here)."""
        out, self.effects = self.effects, {}
        return {k: v for k, v in out.items() if k in self._nodes and not v.empty()}

    def evict(self, node_id: str, need: int, now: float, whole_round: bool = True, must: int | None = None) -> int:
        """Make room on one node's DRAM; returns the bytes freed now (offloads started
        free their bytes later and count toward ``need`` meanwhile). ``whole_round``: at
        least ``evict_ratio`` of the arena (else just ``need``: a chunk of background
        eviction). Soft-pinned values yield only to what an allocation needs (``need`` of a
        whole round, less the offloads in flight; at most ``must`` when given), never to
        room freed in advance."""
        if self.before_evict is not None:
            self.before_evict(now)
        node, alloc = self._nodes[node_id], self._alloc[node_id]
        must = min(need if must is None else must, max(0, need - node.offload_inflight)) if whole_round else 0
        if whole_round:
            if need and node.spill_usable():
                # Offloads free their room only when the disk write is done: start enough
                # for the next few allocations of this size, so a batch of puts does not
                # wait once per object (at most a quarter of the arena).
                need = max(need, min(8 * need, alloc.capacity // 4))
            need = max(need, int(self.policy.marks(node.spill_usable())[1] * alloc.capacity)) - node.offload_inflight
        freed = evicted = 0
        if need <= 0:
            return 0
        batch: list[tuple[int, int]] = []
        gone: list[str] = []  # keys dropped whole (the table forgets them in one call)
        self._batch_free, self._batch_node = batch, node_id
        objects = self._objects
        delta, dram, spill = self.delta(node_id), Tier.DRAM, node.spill_usable()
        tier_keys = node.tier_keys
        try:
            if spill:
                victims = pick_victims(objects, node_id, need, now, must=must)
            else:  # the index drops the cold victims itself; the hot ones come back here
                got, n, victims = self._evict_cold(node_id, need, now, delta, batch, must)
                freed += got
                evicted += n
            for v in victims:
                if type(v[0]) is str:  # a cold record: one ready replica, here, unleased
                    key, gen, _size, offset, length = v
                    if spill:  # offloaded rather than dropped: the disk tier needs the object
                        obj = objects.get(key)
                        rep = obj.replicas[0]
                        if self._offload(node, obj, rep, now):
                            continue
                    delta.drop(key, gen, "dram")
                    tier_keys["dram"] -= 1
                    batch.append((offset, length))
                    gone.append(key)
                    freed += length
                    evicted += 1
                    continue
                obj, rep = v
                if spill and self._offload(node, obj, rep, now):
                    continue
                key = obj.key
                if len(obj.replicas) == 1 and rep.tier is dram and not rep.offloading and objects.hot(key) is obj:
                    # The common hot case, inline (drop_replica's effects for it, in its order):
                    # the only copy of a complete, unleased value (pick_victims checked).
                    obj.replicas = []
                    delta.drop(key, obj.gen, "dram")
                    if rep.ready:
                        tier_keys["dram"] -= 1
                    batch.append((rep.offset, rep.length))
                    gone.append(key)
                else:
                    self.drop_replica(obj, rep, now)
                freed += rep.length
                evicted += 1
        finally:
            self._batch_free = self._batch_node = None
            alloc.release_many(batch)
            objects.drop_many(gone)
        self.counters["evictions"] += evicted
        self.counters["evicted_bytes"] += freed
        if objects.chains.orphans and self.policy.chain_eviction:
            self.drop_orphans(now)
        return freed

    def drop_orphans(self, now: float) -> int:
        """A chain's tail goes with it: drop every stored value whose parent is gone (no
        prefix lookup reaches it), on any node, and theirs in turn; those being read,
        moved or pinned stay orphans until a later eviction (a soft pin: a reader asked for
        it by key, such as a decode's handoff, which needs no prefix lookup; it goes when the
        pin ends, or as a soft-pinned victim), and so do those whose parent went with an
        unmounted node that may bring it back (``Chains.lost``). Returns how many went."""
        chains, objects, n = self._objects.chains, self._objects, 0
        todo = list(chains.orphans)
        tried = set(todo)
        while todo:
            for key in todo:
                if chains.held(key):  # its parent may come back with its node (chains.py: lost)
                    continue
                obj = objects.get(key)
                if (obj is None or not obj.complete or obj.leased(now) or obj.effective_pin(now) is not Pin.NONE
                        or any(r.offloading or not r.ready for r in obj.replicas)):
                    continue
                self.drop_object(obj, now)
                n += 1
            todo = [k for k in chains.orphans if k not in tried]
            tried.update(todo)
        self.counters["chain_tail_evictions"] += n
        return n

    def _evict_cold(self, node_id: str, need: int, now: float, delta: NodeDelta, batch: list,
                    must: int | None = None) -> tuple:
        """Eviction on a node without a spill tier: the index drops the cold victims, least
        recent first (``evict_cold``), stopping at each hot object met, which is judged here
        as ``pick_victims`` would. Returns the bytes and count dropped, and the hot victims
        (``(obj, rep)``, soft-pinned ones last and only while less than ``must`` was freed)
        to drop next.

        With chain-aware eviction the index takes leaves first itself (its chain links:
        ``MasterIndex.evict_cold``); a hot value with stored children waits for them here as
        in ``pick_victims``, and the held values the index lists when nothing more is left
        to it wait for a forced eviction (``Picker.close``)."""
        index, table = self._objects.index, self._objects
        node = self._nodes[node_id]
        chains = table.chains if self.policy.chain_eviction else None
        pick = Picker(chains, need, must)  # pick.freed: cold dropped + hot chosen
        if chains is not None and chains.orphans:
            take_orphans(table, chains, node_id, now, Tier.DRAM, pick)
        taken = {obj.key for obj, _rep in pick.chosen}
        after, cold, n, soft = "", 0, 0, []
        while not pick.done():
            keys, gens, runs, got, stop, held = index.evict_cold(after, node_id, now, pick.need - pick.freed,
                                                                 chains is not None)
            if keys:
                delta.drop_many(keys, gens, "dram")
                node.tier_keys["dram"] -= len(keys)
                batch.extend(runs)
                cold += got
                pick.freed += got
                n += len(keys)
                parents = {chains.parent.get(k) for k in keys} if chains is not None and pick.held else ()
                table.dropped_natively(keys)
                pick.childless(parents)
            for key, rec in held:  # the list ended short: forced eviction may take them
                pick.hold(key, (key, *rec), rec[3])
            if stop is None or pick.done():
                break
            obj = table.hot(stop)
            verdict = judge(obj, node_id, now)
            if verdict is not None and stop not in taken:
                if verdict[0] != EVICT:
                    soft.append((obj, verdict[1]))
                else:
                    pick.offer(obj, verdict[1])
            after = stop
        self.counters["chain_tail_evictions"] += pick.close(soft, pinned_tail(table, chains, now))
        return cold, n, pick.chosen

    def allocate(self, node_id: str, size: int, now: float, must: int | None = None) -> tuple[int, int] | None:
        """``size`` bytes of ``node_id``'s arena, evicting for them; soft pins and forced
        chain evictions yield only to ``must`` of them (default all: see ``evict``)."""
        alloc = self._alloc[node_id]
        got = alloc.allocate(size)
        while got is None and self.evict(node_id, size, now, must=must):
            got = alloc.allocate(size)  # eviction frees bytes, not always a contiguous run
        if got is not None:
            self.watermark(node_id, now)
        return got

    def reserve(self, size: int, targets: list[NodeInfo], now: float) -> Replica | None:
        """An extent of ``size`` bytes for a copy made node to node (a drain's move, a
        repair): on the first of ``targets`` where it fits, else where eviction makes room;
        a replica not readable yet, dropped at ``put_timeout_s`` unless reported."""
        for evict in (False, True):
            for node in targets:
                got = self.allocate(node.node_id, size, now) if evict else self._alloc[node.node_id].allocate(size)
                if got is not None:
                    return Replica(node.node_id, Tier.DRAM, got[0], got[1], ready=False,
                                   deadline=now + self.policy.put_timeout_s, placed=self.new_placement())
        return None

    def reserve_copy(self, obj: Obj, targets: list[NodeInfo], now: float) -> tuple[Replica | None, bool]:
        """``reserve`` for a copy of ``obj``: ``(replica, False)``, ``(None, False)`` for no
        room, or ``(None, True)`` if the eviction that made the room took ``obj`` itself (an
        orphan goes at the end of any eviction): its extent is given back."""
        dst = self.reserve(obj.size, targets, now)
        if dst is not None and self._objects.hot(obj.key) is not obj:
            self._alloc[dst.node_id].release(dst.offset, dst.length)
            return None, True
        return dst, False

    def settle_copy(self, key: str, gen: int, obj: Obj, rep: Replica, ok: bool, now: float) -> str:
        """The report of a copy into ``rep`` (``reserve``): "gone" (the value was removed
        or replaced meanwhile: its extents went with it), "left" (the target node left
        meanwhile), "failed" (the extent is freed), or "done" (the replica is readable and
        in its node's inventory; the caller updates the read mirror)."""
        cur = self._objects.get(key)
        if cur is not obj or obj.gen != gen:
            # the same value again (it went cold and back meanwhile, so its copy being
            # written had been dropped): planned again; else removed or replaced
            return "left" if cur is not None and cur.gen == gen == obj.gen else "gone"
        if not any(r is rep for r in obj.replicas):
            return "left"
        if not ok or rep.node_id not in self._nodes:
            self.drop_replica(obj, rep, now)
            return "failed"
        rep.ready, rep.deadline = True, 0.0
        self._nodes[rep.node_id].tier_keys["dram"] += 1
        self.delta(rep.node_id).add(inventory_entry(obj, rep))
        return "done"

    def place(self, size: int, want: int, ordered: list[NodeInfo], now: float) -> list[Replica]:
        """DRAM extents of ``size`` bytes on up to ``want`` distinct nodes, in the order
        given: first where they fit, then evicting."""
        placed: list[Replica] = []
        for evict in (False, True):
            for node in ordered:
                if len(placed) == want:
                    break
                if any(r.node_id == node.node_id for r in placed):
                    continue
                alloc = self._alloc[node.node_id]
                while evict and not alloc.can_fit(size) and self.evict(node.node_id, size, now):
                    pass  # eviction frees bytes, not always a contiguous run: repeat
                got = alloc.allocate(size)
                if got is not None:
                    placed.append(Replica(node.node_id, Tier.DRAM, got[0], got[1]))
        return placed

    def watermark(self, node_id: str, now: float) -> None:
        """Past the high watermark, evict (or start offloading) one batch, so the next
        allocations find room without waiting; or, with ``evict_in_background``, note the
        node for ``evict_chunk``."""
        alloc = self._alloc[node_id]
        mark = self.policy.marks(self._nodes[node_id].spill_usable())[0] * alloc.capacity
        # Values count, not the room put slabs hold for writes to come (slabs.py: budget).
        if alloc.used > mark and alloc.used - self.slab_room(node_id) > mark:
            if self.policy.evict_in_background:
                self.evict_due.add(node_id)
            else:
                self.evict(node_id, 0, now)  # one batch of evict_ratio * capacity

    def evict_chunk(self, node_id: str, chunk: int, now: float) -> bool:
        """One chunk (``chunk`` bytes at most) of a background round on ``node_id``: the
        round evicts until the node is ``evict_ratio`` of its arena below the watermark.
        Returns whether the round goes on (the node stays due)."""
        alloc, node = self._alloc.get(node_id), self._nodes.get(node_id)
        if alloc is None:
            self.evict_due.discard(node_id)
            return False
        hw, er = self.policy.marks(node.spill_usable())
        target = (hw - er) * alloc.capacity + self.slab_room(node_id)
        excess = int(alloc.used - node.offload_inflight - target)
        if (excess <= 0 or not self.evict(node_id, min(chunk, excess), now, whole_round=False)
                or alloc.used - node.offload_inflight <= target):
            self.evict_due.discard(node_id)  # done, or nothing left to evict
            return False
        return True

    def forget_node(self, node: NodeInfo, reason: str, except_incarnation: str = "") -> int:
        """A node is gone (already out of the node table): drop every replica on it; keys
        with no replica left become misses, pending puts on it fail. Returns the number
        of objects lost. ``except_incarnation``: cold records a new process of the node
        has taken over (``Membership._take_over``) stay."""
        node_id = node.node_id
        self.effects.pop(node_id, None)
        kept = []
        for d in self.deferred:
            if d[3] != node_id:
                kept.append(d)
            elif d[1] in self._void:
                self._void.discard(d[1])
            elif d[6] is not None:
                self._dropped.pop(d[6], None)
        self.deferred = kept
        heapq.heapify(self.deferred)
        # A cold record's one replica was there: those values are gone.
        cold = self._objects.cold_on_node(node_id, except_incarnation)
        self._objects.drop_many(cold)
        lost = len(cold)
        for key, obj in self._objects.hot_items():
            if not any(r.node_id == node_id for r in obj.replicas):
                continue
            had = len({r.node_id for r in obj.replicas if r.ready})
            obj.replicas = [r for r in obj.replicas if r.node_id != node_id]
            if not obj.replicas:
                del self._objects[key]
                lost += 1
            else:
                self._mirror.key(key)
                if self.on_short is not None:
                    self.on_short(key, obj.gen, had, obj.size)
        for obj in self._pending.values():
            if any(r.node_id == node_id for r in obj.replicas):
                obj.replicas = [r for r in obj.replicas if r.node_id != node_id]
                obj.failed = f"store node {node_id} {reason}"
        return lost

    def check(self, live: dict[str, list[tuple[int, int]]], unapplied=frozenset()) -> None:
        """Assert the objects, the nodes' key counters and disk accounting, and the arenas
        agree; ``live`` holds the other allocated extents by node (the slabs' pieces);
        ``unapplied``: keys committed natively, not applied yet (left out)."""
        disk = {n: 0 for n in self._nodes}
        inflight = {n: 0 for n in self._nodes}
        counted = {n: {"dram": 0, "disk": 0} for n in self._nodes}
        for table in (self._objects, self._pending):
            for key, obj in table.items():
                if key in unapplied:
                    continue
                assert obj.key == key
                assert obj.complete == (table is self._objects), key
                ids = [(r.node_id, r.tier) for r in obj.replicas]
                assert len(ids) == len(set(ids)), f"{key}: two replicas in one node's tier"
                for r in obj.replicas:
                    assert r.node_id in self._nodes, f"{key}: replica on unmounted {r.node_id}"
                    if table is self._objects and r.ready:
                        counted[r.node_id][r.tier.value] += 1
                    if r.tier is Tier.DRAM:
                        live[r.node_id].append((r.offset, r.length))
                    else:
                        disk[r.node_id] += r.length
                    if r.offloading:
                        inflight[r.node_id] += r.length
                if table is self._objects:
                    assert obj.replicas, f"{key}: complete object without replicas"
        for _, seq, inc, node_id, off, length, _ in self.deferred:
            if seq not in self._void and self._nodes[node_id].incarnation == inc:
                live[node_id].append((off, length))
        for node_id, node in self._nodes.items():
            assert node.tier_keys == counted[node_id], \
                f"{node_id}: key counters {node.tier_keys} != {counted[node_id]}"
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
        self._objects.check(unapplied)
