"""DRAM <-> disk tiering for the master's state machine (pure, no Ray).

Offload on evict: when DRAM eviction picks a replica on a node with a usable spill tier,
the replica is not dropped. It is marked ``offloading`` (still readable, not evictable),
room is reserved on the node's disk, and the node is asked (through the inventory delta)
to write the extent to disk. When the node reports back (``offload_done``), a DISK
replica replaces the DRAM one and the extent is freed. Eviction counts in-flight
offloads toward its target, so a burst of puts does not offload more than it needs.

The disk has its own watermark and LRU: making room on disk drops the least recently
used disk replicas (really dropped: an object with no replica left is gone). If the disk
cannot take the victim (full of pinned data, degraded, no spill tier) the DRAM replica
is dropped as it would be without a disk.

Promote on get: a get of an object with no ready DRAM replica reserves a DRAM extent on
the node holding its disk copy and answers with a "promote" descriptor. The client asks
that node to read the disk copy into the extent (io_uring, checksum verified); the node
reports ``promote_done`` to the master, which marks the replica ready: from then on it
is a DRAM hit. Several readers of the same object share one promotion.

Neither path makes the master wait on a disk.

``DiskTier`` does the bookkeeping of both; ``MasterState`` holds one and calls it from
eviction (``try_offload``), ``get`` (``promotion``) and ``tick`` (``expire_promotions``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from mooncake_ray.errors import ChecksumError, ObjectNotFoundError, OffloadPendingError
from mooncake_ray._private.master.eviction import pick_victims
from mooncake_ray._private.master.types import NodeDelta, NodeInfo, Obj, Policy, Replica, Tier, inventory_entry

if TYPE_CHECKING:
    from mooncake_ray._private.master.fastpath import ReadMirror
    from mooncake_ray._private.master.table import ObjectTable

PROMOTE = "promote"  # descriptor tier: read the disk copy into this DRAM extent first
DISK_HEADER = 4096  # each spilled object's header block (see store/spill.py)
PACK_RECORD_HEADER = 40  # a packed object's record header (native spill_format.h)
PACK_MAX_RECORD = 3072  # objects whose record is this small are packed


def disk_length(size: int, key: str = "") -> int:
    """Disk bytes one object takes (see store/spill.py): a small one, its 64-byte aligned
    record in a pack (40 bytes of header, the key, the data); any other, a file of its own:
    its header (one 4 KiB block, two for keys over 4032 bytes) plus 4 KiB-padded data."""
    n = len(key.encode("utf-8", "surrogatepass"))
    record = (PACK_RECORD_HEADER + n + size + 63) // 64 * 64
    if 1 <= n and record <= PACK_MAX_RECORD:
        return record
    header = DISK_HEADER if n <= 4032 else 2 * DISK_HEADER
    return header + (size + DISK_HEADER - 1) // DISK_HEADER * DISK_HEADER


class DiskTier:
    """Offloads to and promotions from the store nodes' disks (see the module docstring).

    It changes the objects' replicas and the nodes' disk accounting itself; the rest it
    asks of the state machine: ``delta(node_id)``, the inventory delta a node is owed;
    ``drop_replica(obj, rep, now)``, which frees a replica (the object goes with its last);
    ``allocate(node_id, size, now)``, a DRAM extent (evicting if need be); ``new_placement()``,
    a fresh ``Replica.placed`` id. A promoted replica becoming readable is told to ``mirror``.
    """

    def __init__(self, policy: Policy, nodes: dict[str, NodeInfo], objects: ObjectTable,
                 counters: dict[str, int], mirror: ReadMirror, *, delta: Callable[[str], NodeDelta],
                 drop_replica: Callable[[Obj, Replica, float], None],
                 allocate: Callable[[str, int, float], tuple[int, int] | None], new_placement: Callable[[], int]):
        self.policy = policy
        self._nodes = nodes
        self._objects = objects
        self.counters = counters
        for name in ("offload_bytes", "promotion_bytes"):  # value bytes moved by completed offloads / promotions
            counters.setdefault(name, 0)
        self._mirror = mirror
        self._delta = delta
        self._drop_replica = drop_replica
        self._allocate = allocate
        # During one GET call (``MasterState.one_call``): the nodes where a promotion found
        # no room. Their other keys in the call fail at once (retryable) instead of each
        # scanning the node for victims again: a call of a few hundred disk-only keys
        # otherwise cost hundreds of scans, outlasted the client's RPC timeout, and its
        # retries kept the master busy for good.
        self.no_room: set[str] | None = None
        self._new_placement = new_placement
        self._promoting: dict[int, tuple[Obj, Replica]] = {}  # id(replica) -> promotions started

    # -------------------------------------------------------------- offload ----
    def try_offload(self, node: NodeInfo, obj: Obj, rep: Replica, now: float) -> bool:
        """Start offloading ``rep`` instead of dropping it; False if the disk can't take it."""
        if not node.spill_usable():
            return False
        if any(r.node_id == node.node_id and r.tier is Tier.DISK for r in obj.replicas):
            return False  # already on this node's disk: dropping the DRAM copy is enough
        length = disk_length(obj.size, obj.key)
        if not self._reserve_disk(node, length, now):
            return False
        node.disk_pending[(obj.key, obj.gen)] = length
        rep.offloading = True
        node.offload_inflight += rep.length
        self._delta(node.node_id).offload.append((obj.key, obj.gen, obj.size, rep.offset, rep.length))
        return True

    def _reserve_disk(self, node: NodeInfo, length: int, now: float) -> bool:
        limit = node.spill_capacity * node.spill_high_watermark
        if node.disk_used + length > limit:
            need = node.disk_used + length - limit + self.policy.marks(True)[1] * node.spill_capacity
            chains = self._objects.chains if self.policy.chain_eviction else None
            must = max(0, node.disk_used + length - node.spill_capacity)  # without it, no fit at all
            for v in pick_victims(self._objects, node.node_id, int(need), now, Tier.DISK, chains, must):
                if type(v[0]) is str:  # a cold record (only on this disk): the object, to drop it
                    obj = self._objects.get(v[0])
                    v = (obj, obj.replicas[0])
                self._drop_replica(*v, now)
                self.counters["disk_evictions"] += 1
        if node.disk_used + length > node.spill_capacity:
            return False
        node.disk_used += length
        return True

    def offload_done(self, node_id: str, items, now: float) -> None:
        """A node finished offloads: ``items`` of ``(key, gen, length, ok, error)``.
        Idempotent. A disk copy this master never asked for (it restarted meanwhile) is
        adopted if it is the current value, dropped otherwise."""
        node = self._nodes.get(node_id)
        if node is None:
            return
        for key, gen, length, ok, error in items:
            reserved = node.disk_pending.pop((key, gen), None)
            if reserved is None:
                if ok:
                    self._adopt_disk_copy(node, key, gen, length)
                continue
            obj = self._objects.get(key)
            rep = None
            if obj is not None and obj.gen == gen:
                rep = next((r for r in obj.replicas if r.node_id == node_id and r.offloading), None)
            if rep is None:  # removed or replaced meanwhile: its disk copy is garbage
                node.disk_used -= reserved
                if ok:
                    self._delta(node_id).drop(key, gen, Tier.DISK.value)
                continue
            rep.offloading = False
            node.offload_inflight -= rep.length
            if ok:
                obj.replicas.append(Replica(node_id, Tier.DISK, 0, reserved))
                node.tier_keys["disk"] += 1
                self.counters["offloads"] += 1
                self.counters["offload_bytes"] += obj.size
            else:
                node.disk_used -= reserved
                if error:
                    node.spill_degraded = str(error)
                if obj.leased(now):
                    continue  # a reader came meanwhile: keep the DRAM copy, evict later
            # The DRAM copy goes: the room was needed (the extent waits out any lease).
            self._drop_replica(obj, rep, now)
            self.counters["evictions"] += 1
            self.counters["evicted_bytes"] += rep.length

    def _adopt_disk_copy(self, node: NodeInfo, key: str, gen: int, length: int) -> None:
        obj = self._objects.get(key)
        if obj is None or obj.gen != gen:
            self._delta(node.node_id).drop(key, gen, Tier.DISK.value)
            return
        if any(r.node_id == node.node_id and r.tier is Tier.DISK for r in obj.replicas):
            return  # the same file written twice (a repeated offload): already known
        obj.replicas.append(Replica(node.node_id, Tier.DISK, 0, length))
        node.disk_used += length
        node.tier_keys["disk"] += 1

    # -------------------------------------------------------------- promote ----
    def promotion(self, obj: Obj, client_node: str | None, now: float) -> Replica | None:
        """The DRAM extent a disk-only object is being promoted into (reserving one)."""
        # (only a promotion's own extent: a DRAM copy a drain or a repair is writing is not
        # readable yet either, and its node has no disk copy to read it from)
        prom = next((r for r in obj.replicas if r.tier is Tier.DRAM and not r.ready and id(r) in self._promoting),
                    None)
        if prom is None:
            disks = [r for r in obj.replicas if r.tier is Tier.DISK]
            if not disks:
                return None
            disks.sort(key=lambda r: r.node_id != client_node and
                       self._nodes[r.node_id].ray_node_id != client_node)
            for disk in disks:
                if self.no_room is not None and disk.node_id in self.no_room:
                    continue
                got = self._allocate(disk.node_id, obj.size, now)
                if got is None and self.no_room is not None:
                    self.no_room.add(disk.node_id)
                if got is not None:
                    prom = Replica(disk.node_id, Tier.DRAM, got[0], got[1], ready=False,
                                   deadline=now + self.policy.put_timeout_s, placed=self._new_placement())
                    obj.replicas.append(prom)
                    self._promoting[id(prom)] = (obj, prom)
                    break
            if prom is None:
                raise OffloadPendingError(
                    f"no DRAM free to promote {obj.key!r} from disk yet (offloads in flight); retry")
        return prom

    def reserved(self, node_id: str, key, gen, offset, size) -> bool:
        """Whether ``offset`` on ``node_id`` is the DRAM extent reserved to promote
        ``key``/``gen`` (of ``size`` bytes) into, and not yet filled."""
        obj = self._objects.get(key) if type(key) is str else None
        if obj is None or obj.gen != gen or obj.size != size:
            return False
        return any(r.node_id == node_id and r.tier is Tier.DRAM and not r.ready and r.offset == offset
                   and id(r) in self._promoting for r in obj.replicas)

    def promote_done(self, node_id: str, items, now: float) -> None:
        """A node finished promotions: ``items`` of ``(key, gen, offset, error_name)``
        (``error_name`` empty on success). Idempotent."""
        for key, gen, offset, error in items:
            obj = self._objects.get(key)
            if obj is None or obj.gen != gen:
                continue
            rep = next((r for r in obj.replicas if r.node_id == node_id and r.tier is Tier.DRAM
                        and r.offset == offset and not r.ready and id(r) in self._promoting), None)
            if not error:
                if rep is not None:
                    rep.ready = True
                    self._mirror.key(key)
                    self._nodes[node_id].tier_keys["dram"] += 1
                    self.counters["promotions"] += 1
                    self.counters["promotion_bytes"] += obj.size
                    self._delta(node_id).add(inventory_entry(obj, rep))
                continue
            if rep is not None:
                self._drop_replica(obj, rep, now)
            if error in (ChecksumError.__name__, ObjectNotFoundError.__name__):
                # The disk copy is corrupt or gone (the node deleted it): a miss from now
                # on, never wrong bytes.
                disk = next((r for r in obj.replicas if r.node_id == node_id and r.tier is Tier.DISK), None)
                if disk is not None:
                    self._drop_replica(obj, disk, now)

    def expire_promotions(self, now: float) -> int:
        """Drop the DRAM extents of promotions not done by their deadline. Looks only at the
        promotions started (``_promoting``), not at every object: a scan of every object on
        every tick took half the master's time at ten million keys."""
        n = 0
        objects = self._objects
        for k, (obj, rep) in list(self._promoting.items()):
            if rep.ready or objects.get(obj.key) is not obj or not any(r is rep for r in obj.replicas):
                del self._promoting[k]  # done, or gone with its object or its node
            elif rep.deadline <= now:
                del self._promoting[k]
                self._drop_replica(obj, rep, now)
                n += 1
        return n
