"""Value types of the master's state machine (pure, no Ray)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Callable, NamedTuple


RESERVED = "reserved"
"""An inventory entry's tier for a range the master reserved (a put slab, a pending put's
extent): not a value, but space a client may still write into (``SlabTable.adopt``)."""


class Tier(str, enum.Enum):
    """A replica's tier. Hot paths read a member's string as ``_value_`` (a plain attribute;
    ``.value`` is a Python-level property, about 1 us a read, on every put and eviction)."""

    DRAM = "dram"
    DISK = "disk"


class Pin(enum.IntEnum):
    NONE = 0
    SOFT = 1  # evicted only after every unpinned candidate; expires after soft_pin_ttl_s
    HARD = 2  # never evicted


@dataclass(slots=True)
class Replica:
    node_id: str
    tier: Tier
    offset: int  # arena offset (DRAM); 0 on disk
    length: int  # bytes reserved on DRAM (allocator.extent_length: pages, or 64-byte granules under 4 KiB)
    offloading: bool = False  # DRAM copy being written to disk (spill tier)
    ready: bool = True  # False: a DRAM copy being promoted from disk, not readable yet
    deadline: float = 0.0  # when an unfinished promotion is abandoned
    placed: int = 0
    """0: the extent the value was written into by its put. A DRAM copy made later for the
    same value (a promotion from disk, a master's recovery) gets an id never used before,
    so a client that remembers where a value was (its location cache) can tell "the same
    bytes, never moved" from "the same key and gen, back at the same offset after the
    extent held something else"."""


@dataclass(slots=True)
class Obj:
    """One key's object. ``complete`` objects are visible to readers; a pending one is
    being written by ``owner`` until ``put_deadline``."""

    key: str
    size: int
    gen: int
    replicas: list[Replica]
    complete: bool = False
    lease_until: float = 0.0
    leases: int | set | None = None
    """Ids of the leases granted and not released (a dead reader's expire): None, one id,
    or a set of several (most values are read by one reader at a time; a set costs 216 B)."""
    pin: Pin = Pin.NONE
    pin_until: float = 0.0
    put_deadline: float = 0.0
    owner: str = ""
    failed: str = ""  # why a pending put can no longer be published (a replica's node died)
    parent: str = ""  # the key its put named as its parent (chains.py); "" none
    want: int = 1  # the copies its put asked for (repairs.py); kept in every node's entry of it

    def dram(self) -> list[Replica]:
        return [r for r in self.replicas if r.tier is Tier.DRAM]

    def leased(self, now: float) -> bool:
        return self.lease_until > now

    def effective_pin(self, now: float) -> Pin:
        if self.pin is Pin.SOFT and self.pin_until <= now:
            return Pin.NONE
        return self.pin


class InventoryEntry(NamedTuple):
    """What a store node remembers of one replica it holds, enough to rebuild the index."""

    key: str
    gen: int
    size: int
    tier: str
    offset: int
    length: int
    pin: int = 0
    parent: str = ""  # the key its put named as its parent (chains.py)
    want: int = 1  # the copies its put asked for: a restarted master knows a value short of them


def inventory_entry(obj: Obj, r: Replica) -> InventoryEntry:
    """The entry a node keeps for replica ``r`` of ``obj``."""
    return InventoryEntry(obj.key, obj.gen, obj.size, r.tier._value_, r.offset, r.length, int(obj.pin), obj.parent,
                          obj.want)


class NodeDelta:
    """Inventory changes the master owes one store node, merged per ``(key, tier)``.

    A record is ``[drop_gen, entry]``: the node deletes its entry for that key and tier if
    the entry's gen is ``<= drop_gen`` (-1: no drop), then stores ``entry`` (None: no
    add). A value's gens only grow, so "drop every gen up to g" is what any sequence of
    drops and adds of one key nets to, and a put evicted before its add was sent leaves
    only its drop (the add is cancelled here in O(1), not searched for in a list).
    Offloads are commands, kept in order. Merging keeps what a slow or unreachable node
    is owed bounded by the keys touched on it, not by the number of operations.
    """

    __slots__ = ("_recs", "offload")

    def __init__(self) -> None:
        self._recs: dict[tuple[str, str], list] = {}
        self.offload: list[tuple[str, int, int, int, int]] = []
        """Write these DRAM extents to disk: (key, gen, size, offset, length)."""

    def add(self, e: InventoryEntry) -> None:
        rec = self._recs.get((e.key, e.tier))
        if rec is None:
            self._recs[(e.key, e.tier)] = [-1, e]
        else:
            rec[1] = e

    def drop(self, key: str, gen: int, tier: str) -> None:
        rec = self._recs.get((key, tier))
        if rec is None:
            self._recs[(key, tier)] = [gen, None]
        else:
            _combine(rec, gen, None)

    def drop_many(self, keys: list[str], gens: list[int], tier: str) -> None:
        """``drop`` of each key at its gen (an eviction batch's victims; inline: a call per
        key would double its cost)."""
        recs = self._recs
        for key, gen in zip(keys, gens):
            k = (key, tier)
            rec = recs.get(k)
            if rec is None:
                recs[k] = [gen, None]
                continue
            if rec[1] is not None and rec[1].gen <= gen:
                rec[1] = None
            if gen > rec[0]:
                rec[0] = gen

    def merge(self, other: "NodeDelta", offloads: bool = True) -> None:
        """Apply ``other``'s changes after this one's (``other`` stays as it was)."""
        recs = self._recs
        for k, (gen, e) in other._recs.items():
            rec = recs.get(k)
            if rec is None:
                recs[k] = [gen, e]
            else:
                _combine(rec, gen, e)
        if offloads:
            self.offload.extend(other.offload)

    def absorb(self, other: "NodeDelta") -> None:
        """``merge(other)``, taking ``other``'s records rather than copying them (``other``
        is not to be used afterwards). Keys only one side holds, the common case, move in
        one ``dict.update``; only keys both hold are combined record by record."""
        mine, theirs = self._recs, other._recs
        if len(theirs) > len(mine):  # keep the larger table and move the smaller one
            mine, theirs = theirs, mine
            for key in mine.keys() & theirs.keys():  # older over newer: redo in order
                newer = mine[key]
                rec = mine[key] = theirs.pop(key)
                _combine(rec, *newer)
        else:
            for key in mine.keys() & theirs.keys():
                _combine(mine[key], *theirs.pop(key))
        mine.update(theirs)
        self._recs = mine
        self.offload.extend(other.offload)

    def split(self, max_items: int) -> "NodeDelta":
        """Move up to ``max_items`` records and offloads out of this delta into a new one
        (records of distinct keys are independent, so any subset may go first)."""
        out = NodeDelta()
        if len(self) <= max_items:
            out._recs, self._recs = self._recs, {}
            out.offload, self.offload = self.offload, []
            return out
        recs = self._recs
        if len(recs) <= 4 * max_items:  # copy both parts at C speed rather than pop key by key
            out._recs = dict(itertools.islice(recs.items(), max_items))
            self._recs = dict(itertools.islice(recs.items(), max_items, None))
        else:
            for k in list(itertools.islice(recs, max_items)):
                out._recs[k] = recs.pop(k)
        room = max(0, max_items - len(out._recs))
        out.offload, self.offload = self.offload[:room], self.offload[room:]
        return out

    @property
    def adds(self) -> list[InventoryEntry]:
        return [e for _g, e in self._recs.values() if e is not None]

    @property
    def drops(self) -> list[tuple[str, int, str]]:
        return [(k, g, t) for (k, t), (g, _e) in self._recs.items() if g >= 0]

    def to_wire(self) -> list:
        """``[adds, drops, offloads]`` for msgpack (which sends tuples as arrays)."""
        return [self.adds, self.drops, self.offload]

    def empty(self) -> bool:
        return not (self._recs or self.offload)

    def __len__(self) -> int:
        return len(self._recs) + len(self.offload)


def _combine(rec: list, gen: int, e) -> None:
    """Apply a newer record ``[gen, e]`` of the same key and tier after ``rec``, in place:
    its drop (-1: none), then its add (None: none)."""
    if gen >= 0:
        if rec[1] is not None and rec[1].gen <= gen:
            rec[1] = None
        if gen > rec[0]:
            rec[0] = gen
    if e is not None:
        rec[1] = e


@dataclass
class NodeInfo:
    """A mounted store node, as the master sees it."""

    node_id: str
    incarnation: str
    address: bytes  # the node's transport address (UCX worker addresses)
    rkey: bytes  # packed remote key of its arena
    base: int  # arena base address in the node's process
    capacity: int  # bytes of the arena this master allocates from
    ray_node_id: str = ""
    part_offset: int = 0  # where that part begins in the arena (a sharded master's part)
    arena_length: int = 0  # the whole arena (0: ``capacity``, an unsharded master's)
    spill_capacity: int = 0
    spill_high_watermark: float = 0.9
    last_heartbeat: float = 0.0
    suspect: bool = False  # a client reported it unreachable: no new allocations
    draining: bool = False  # leaving the cluster (drain.py): no new allocations
    spill_used: int = 0  # as the node reports it
    spill_degraded: str | None = None
    disk_used: int = 0  # the master's account: disk replicas + offloads in flight
    disk_pending: dict = field(default_factory=dict)  # (key, gen) -> bytes reserved for an offload
    offload_inflight: int = 0  # DRAM bytes that will be freed when offloads complete
    tier_keys: dict = field(default_factory=lambda: {"dram": 0, "disk": 0})  # readable replicas here
    memory_types: list = field(default_factory=lambda: ["host"])  # what the node's UCX registers
    arena_file: str = ""  # the arena's file in shared memory (store/arena.py), "" none
    arena_file_id: list = field(default_factory=list)  # its [st_dev, st_ino]
    boot_id: str = ""  # the node's host's boot id: same-host clients map arena_file

    def spill_usable(self) -> bool:
        return self.spill_capacity > 0 and not self.spill_degraded

    def usage(self, alloc, detail: bool) -> dict:
        """DRAM (``alloc``: the node's arena allocator) and disk use: ``stats`` with
        ``detail``, the metrics' gauges without."""
        keys = self.tier_keys
        dram = {"capacity": alloc.capacity, "used": alloc.used, "keys": keys["dram"]}
        disk = {"capacity": self.spill_capacity, "used": self.disk_used, "keys": keys["disk"]}
        if not detail:
            return {"dram": dram, "disk": disk}
        dram["offloading_bytes"] = self.offload_inflight
        disk.update(reported_used=self.spill_used, degraded=self.spill_degraded)
        return {"ray_node_id": self.ray_node_id, "suspect": self.suspect, "draining": self.draining,
                "dram": dram, "disk": disk,
                "memory_types": list(self.memory_types)}

    def public(self) -> dict:
        """What clients need to reach the node."""
        return {
            "node_id": self.node_id,
            "incarnation": self.incarnation,
            "address": self.address,
            "rkey": self.rkey,
            "base": self.base,
            "capacity": self.arena_length or self.capacity,  # the whole arena: clients map it all
            "ray_node_id": self.ray_node_id,
            "spill_capacity": self.spill_capacity,
            "arena_file": self.arena_file,
            "arena_file_id": list(self.arena_file_id),
            "boot_id": self.boot_id,
        }


# Default eviction marks (high watermark, share of the arena a round frees). A node whose
# eviction drops values keeps them between 93% and 95% of its arena: the room kept free is
# room a cache does not use (bench_chains.py at a quarter of the working set: 0.9 / 0.05 kept
# 581 pages of 684 and served 23.2% of the prompts' tokens where Mooncake Store, filling its
# segment, served 24.7%). A node with a spill tier offloads instead, and its room comes back
# only when the disk write is done: it keeps the wider margin.
DRAM_MARKS = (0.95, 0.02)
SPILL_MARKS = (0.9, 0.05)


@dataclass
class Policy:
    """The subset of MasterConfig the state machine needs (plain values)."""

    lease_ttl_s: float = 10.0
    soft_pin_ttl_s: float = 1800.0
    high_watermark: float | None = None
    """A node evicts once its values pass this share of its arena; None: ``marks``."""
    evict_ratio: float | None = None
    """Share of a node's arena an eviction round frees; None: ``marks``."""
    node_ttl_s: float = 5.0
    put_timeout_s: float = 60.0
    allocation_strategy: str = "local_first"
    replicas: int = 1
    max_key_bytes: int = 4096
    recovery_timeout_s: float = 15.0
    put_slab_bytes: int = 32 << 20
    put_slab_ttl_s: float = 2.0
    durable_acks: bool = False
    """The actor holds put, PUT_START and slab grant replies until the nodes recorded them
    (fence.py): a restarted master then knows every range a client may still write into
    from the nodes' reservations, and allocates at once instead of waiting out
    ``put_slab_ttl_s``."""
    chain_eviction: bool = True
    """Leaves first among values put with a parent (chains.py); False: plain LRU."""
    chain_insert: str = "adaptive"
    """Where a new value put with a parent enters the eviction order: "recent" (LRU), "old"
    (on probation at the old end until read), or "adaptive" (adaptive.py: whichever of the
    two a miniature simulation of each says hits more)."""
    repair_delay_s: float = 10.0
    """How long a value short of copies waits before it is copied again (repairs.py): a
    restarted store node re-adopts its arena sooner."""
    shards: int = 1
    shard: int = 0
    """Which of ``shards`` master shards this is (its own keys: ``shards.shard_of``)."""
    evict_in_background: bool = False
    """Past the high watermark, only note the node (``MasterState.evict_due`` then evicts
    in small chunks, each its own section of the actor's lock) instead of evicting a whole
    round inside the put that crossed it. An allocation that finds no room still evicts
    at once."""

    def marks(self, spill: bool) -> tuple[float, float]:
        """``(high_watermark, evict_ratio)`` of a node, with a spill tier (``spill``) or
        not: those configured, else DRAM_MARKS or SPILL_MARKS."""
        hw, er = SPILL_MARKS if spill else DRAM_MARKS
        return (hw if self.high_watermark is None else self.high_watermark,
                er if self.evict_ratio is None else self.evict_ratio)

    @classmethod
    def from_config(cls, cfg, **extra) -> "Policy":
        return cls(**{k: getattr(cfg, k) for k in cls.__dataclass_fields__ if hasattr(cfg, k)}, **extra)


class Generations:
    """Value generations: each new one above every earlier one, this master's or a
    previous master's (they start at the wall clock in ns)."""

    __slots__ = ("last", "_wall_ns")

    def __init__(self, wall_ns: Callable[[], int]) -> None:
        self.last = 0
        self._wall_ns = wall_ns

    def new(self) -> int:
        self.last = max(self.last + 1, self._wall_ns())
        return self.last

    def seen(self, gen: int) -> None:
        """``gen`` was handed out elsewhere (by the read index, or a previous master)."""
        if gen > self.last:
            self.last = gen
