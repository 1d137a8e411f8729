"""The master's replies, as typed records: declared here once, built by the state machine
and the reference index (``master/pyindex.py``), read by the client.

On the wire each record is a msgpack array of its fields in declaration order (a
``NamedTuple`` packs as one); the C++ index (``native/src/master/index.cpp``) writes the
same arrays, and ``tests/native/test_master_index.py`` checks it against the reference.
What arrives is a list: ``read_grant`` and the other ``as_*`` functions give it its
names again (about 0.3 µs a key, against ~9 µs a key of a batched 4 KiB get).
"""

from __future__ import annotations

from typing import NamedTuple

_new = tuple.__new__  # builds a record from a sequence without re-checking its arity


class ReplicaLoc(NamedTuple):
    """Where a reader finds one copy of a value."""

    node_id: str
    tier: str  # "dram", or tiering.PROMOTE: on disk, being read into the DRAM extent named
    offset: int  # arena offset of the DRAM extent
    length: int  # bytes reserved (allocator.extent_length of the size)
    incarnation: str  # the node's arena this extent belongs to (a restarted node has another)
    placed: int  # changes whenever the value's DRAM copy is made anew (see types.Replica)


class ReadGrant(NamedTuple):
    """A GET's answer for one stored key: its copies and a read lease on them."""

    size: int
    gen: int
    ttl: float  # the lease lasts at least this long from when the request was sent
    replicas: list  # [ReplicaLoc]; the caller's local copy first
    lease: int  # release with RELEASE [key, gen, lease] once the bytes are copied


class Extent(NamedTuple):
    """One extent a two-call put writes its value into."""

    node_id: str
    offset: int
    length: int
    incarnation: str


class PutAlloc(NamedTuple):
    """PUT_START's answer for one key: write the value at every extent, then PUT_END."""

    gen: int
    extents: list  # [Extent], one per replica


class SlabGrant(NamedTuple):
    """SLAB_GRANT's answer: a run of one node's DRAM the client carves puts from."""

    slab_id: int
    node_id: str
    offset: int
    length: int
    incarnation: str
    ttl: float  # no write into the slab may start after this long


class Commit(NamedTuple):
    """One PUT_COMMIT item: a value written into the caller's slab, to be published."""

    key: str
    slab_id: int
    offset: int
    size: int
    upsert: bool = False
    parent: str = ""  # its KV chain's previous value (master/chains.py)
    crc: int | None = None  # the CRC-32C of its bytes, taken in the client's copy (store/ring.py)


def read_grant(d) -> ReadGrant:
    """A GET descriptor from the wire (a list) as a ``ReadGrant``."""
    return _new(ReadGrant, (d[0], d[1], d[2], [_new(ReplicaLoc, r) for r in d[3]], d[4]))


def put_alloc(a) -> PutAlloc:
    return _new(PutAlloc, (a[0], [_new(Extent, e) for e in a[1]]))


def slab_grant(s) -> SlabGrant:
    return _new(SlabGrant, s)
