"""Value types of the master's state machine (pure, no Ray)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple


class Tier(str, enum.Enum):
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
    length: int  # bytes reserved (4 KiB multiple on DRAM)
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
    leases: set | None = None  # ids of leases granted and not released (a dead reader's expire)
    pin: Pin = Pin.NONE
    pin_until: float = 0.0
    put_deadline: float = 0.0
    owner: str = ""
    failed: str = ""  # why a pending put can no longer be published (a replica's node died)

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


@dataclass(slots=True)
class NodeDelta:
    """Inventory changes the master owes one store node (sent before it replies)."""

    add: list[InventoryEntry] = field(default_factory=list)
    drop: list[tuple[str, int, str]] = field(default_factory=list)  # (key, gen, tier)
    offload: list[tuple[str, int, int, int, int]] = field(default_factory=list)
    """Write these DRAM extents to disk: (key, gen, size, offset, length)."""

    def empty(self) -> bool:
        return not (self.add or self.drop or self.offload)


@dataclass
class NodeInfo:
    """A mounted store node, as the master sees it."""

    node_id: str
    incarnation: str
    address: bytes  # the node's transport address (UCX worker addresses)
    rkey: bytes  # packed remote key of its arena
    base: int  # arena base address in the node's process
    capacity: int
    ray_node_id: str = ""
    spill_capacity: int = 0
    spill_high_watermark: float = 0.9
    last_heartbeat: float = 0.0
    suspect: bool = False  # a client reported it unreachable: no new allocations
    keys: set[str] = field(default_factory=set)
    spill_used: int = 0  # as the node reports it
    spill_degraded: str | None = None
    disk_used: int = 0  # the master's account: disk replicas + offloads in flight
    disk_pending: dict = field(default_factory=dict)  # (key, gen) -> bytes reserved for an offload
    offload_inflight: int = 0  # DRAM bytes that will be freed when offloads complete
    tier_keys: dict = field(default_factory=lambda: {"dram": 0, "disk": 0})  # readable replicas here

    def spill_usable(self) -> bool:
        return self.spill_capacity > 0 and not self.spill_degraded

    def public(self) -> dict:
        """What clients need to reach the node."""
        return {
            "node_id": self.node_id,
            "incarnation": self.incarnation,
            "address": self.address,
            "rkey": self.rkey,
            "base": self.base,
            "capacity": self.capacity,
            "ray_node_id": self.ray_node_id,
            "spill_capacity": self.spill_capacity,
        }
