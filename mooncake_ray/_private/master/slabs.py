"""Put slabs: one master round trip per put instead of two (pure, no Ray).

A plain put costs the client two calls to the master: ``put_start`` (reserve extents),
the write, ``put_end`` (publish). With a slab, a client asks once for a run of DRAM on
one node (``slab_grant``), carves extents out of it itself, writes, and publishes each
value with one ``put_commit(key, slab, offset, size)``. The master checks that the
extent lies in a part of the slab nobody committed yet, then publishes exactly as
``put_end`` does. A failed commit (the key exists, another put of it is in flight) frees
its extent: the client wrote bytes nobody will read, nothing else is lost.

Room: a slab holds arena space no value uses yet, and every client has one per master
shard, so the slabs of a node together get a budget (``budget``: half the headroom above
the high watermark); a grant past it fails and the client puts the two-call way. Eviction
follows the bytes values hold, leaving out the slabs' uncommitted room, so a fleet of
clients does not make the store evict while its values fill a fraction of the arena.
A client gives back a slab it has not used up once its write window (``put_slab_ttl_s``)
is over; the master takes back a slab's room no earlier than that window plus
``put_timeout_s``, when no write into it can still land.

Safety rules (what makes a slab's bytes never land on someone else's value):

- Uncommitted slab space is allocated in the node's allocator for as long as the slab
  lives, so nothing else is placed there.
- The client writes into a slab only within ``put_slab_ttl_s`` of the moment it *sent*
  the grant request (so its window ends before the master's does). The master reclaims
  the uncommitted rest ``put_slab_ttl_s + put_timeout_s`` after granting it (a dead
  client's slab, like a dead client's pending put), or at once when the client returns it.
- Each slab, and each pending put's extent, is recorded in its node's inventory as a
  reserved range; with ``durable_acks`` the grant's (and PUT_START's) reply waits until the
  node has it. A restarted master learns them when the nodes remount and keeps the
  uncommitted parts out of its allocations (``adopt``: an ownerless slab) for
  ``put_slab_ttl_s`` (slabs) or ``put_timeout_s`` (pending puts), by which time no client
  may begin a write there; it allocates elsewhere at once. Without ``durable_acks`` a
  reservation may not have reached its node when the master died, so a restarted master
  allocates nothing (``put_start`` and ``slab_grant`` answer "rebuilding, retry") until
  ``put_slab_ttl_s`` after it started. A commit into a slab it does not know fails with
  ``LeaseExpiredError``; the client puts that value again the two-call way.
- A slab lives on one node incarnation: unmounting the node drops it.

``SlabTable`` keeps the live slabs and their uncommitted pieces; ``MasterState`` holds one
and does the rest of a commit (the key's checks, its generation, publishing it).

Only single-replica puts use slabs (a slab is one node); values larger than half a slab
take the two-call path, where the extra round trip is small next to the copy.
"""

from __future__ import annotations

import bisect
import collections
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from mooncake_ray.errors import (
    InvalidArgumentError,
    LeaseExpiredError,
    NoCapacityError,
    ObjectExistsError,
    ObjectPendingError,
)
from mooncake_ray._private.master.allocator import ALIGN, ExtentAllocator, carve, carve_span, extent_align, extent_length, page_up
from mooncake_ray._private.master.placement import order_nodes
from mooncake_ray._private.master.types import Generations, NodeInfo, Obj, Policy, Replica, Tier
from mooncake_ray._private.wire import SlabGrant

if TYPE_CHECKING:
    from mooncake_ray._private.master.fastpath import ReadMirror
    from mooncake_ray._private.master.table import ObjectTable
    from mooncake_ray._private.master.replicas import ReplicaTable


RETIRED_SLABS = 4096  # slabs given back that a retried commit is still recognised in
SLAB_MIN = 1 << 20  # the shortest slab granted out of a fragmented arena rather than evicting
SLAB_PIECE = 64 << 10  # the shortest run granted where the free room is there but in pieces
# A slab goes to the node a client prefers (its KV chain's parent's) while that node is no
# fuller than the least full one plus this share of an arena: chains stay whole on a node,
# and a node that fills faster sends new pages, and the chains that follow them, elsewhere.
PREFER_SLACK = 0.05


def slab_key(slab_id: int) -> str:
    """A slab's reserved entry in its node's inventory (gen: the slab id)."""
    return f"slab/{slab_id}"


def put_key(gen: int) -> str:
    """A pending put's reserved entry on each node it writes to (gen: the put's gen)."""
    return f"put/{gen}"


@dataclass(slots=True)
class Slab:
    slab_id: int
    node_id: str
    offset: int
    length: int
    owner: str
    expires: float  # the master reclaims the uncommitted rest at this time
    free: dict = field(default_factory=dict)  # uncommitted pieces: offset -> length


class SlabTable:
    """The live put slabs: grant, commit, return, expire.

    Uncommitted slab space stays allocated in the node's allocator (``alloc``) until the
    slab is returned or expires. ``replicas`` allocates a slab (evicting if need be) and
    publishes a committed value; ``objects`` and ``pending`` (read only) decide whether a
    commit conflicts; ``gens`` gives its generation. Every change to a slab's pieces is
    told to ``mirror``.
    """

    def __init__(self, policy: Policy, nodes: dict[str, NodeInfo], alloc: dict[str, ExtentAllocator],
                 objects: ObjectTable, pending: dict[str, Obj], replicas: ReplicaTable, mirror: ReadMirror,
                 gens: Generations, rng: random.Random, wall_ns: Callable[[], int]):
        self.policy = policy
        self.slabs: dict[int, Slab] = {}
        self._nodes = nodes
        self._alloc = alloc
        self._objects = objects
        self._pending = pending
        self._replicas = replicas
        self._mirror = mirror
        self._gens = gens
        self._rng = rng
        self._wall_ns = wall_ns
        self._next_id = 0
        # slab id -> (node, owner) of the slabs given back lately, oldest first: a commit
        # retried after its reply was lost may arrive after the call that carried it gave
        # the slab back (a client returns slabs with its commits) or after it expired.
        self._retired: collections.OrderedDict[int, tuple[str, str]] = collections.OrderedDict()
        self._first_id = self._wall_ns()  # ids below: slabs of a previous master incarnation

    # ------------------------------------------------------------------ grant ----
    def grant(self, owner: str, client_node: str | None, need: int, now: float,
              prefer: str | None = None) -> SlabGrant:
        """Reserve a slab for ``owner`` (see ``MasterState.slab_grant``): on ``prefer``
        while that node's values fill no more of its arena than the least filled node's
        plus ``PREFER_SLACK`` (evicting there like any grant: a chain on one node is evicted
        from its leaves there), else on the first node in the allocation strategy's order
        that has the room or can evict for it."""
        usable = [n for n in self._nodes.values() if not n.suspect and not n.draining]
        if not usable:
            raise NoCapacityError("no usable store node for a put slab")
        ordered = order_nodes(self.policy.allocation_strategy, usable, self._alloc, client_node, self._rng)
        for node in self.beside(ordered, prefer):
            got = self._grant_on(node, owner, need, now)
            if got is not None:
                return got
        raise NoCapacityError(f"no store node has room for a put slab of {need} bytes or more (or the put slabs "
                              "of other clients hold their budget: the value goes the two-call way)")

    def beside(self, ordered: list, prefer: str | None) -> list:
        """``ordered`` (usable nodes in the allocation strategy's order) with ``prefer``
        first while that node's values fill no more of its arena than the least filled
        node's plus ``PREFER_SLACK``: the node a KV chain's parent is on, so the chain is
        whole on a node and evicted from its leaves there."""
        if not prefer or len(ordered) < 2 or ordered[0].node_id == prefer:
            return ordered
        node = next((n for n in ordered if n.node_id == prefer), None)
        if node is None:
            return ordered
        room = collections.Counter()  # each node's bytes slabs hold uncommitted, in one pass (``room``)
        for s in self.slabs.values():
            room[s.node_id] += sum(s.free.values())
        fill = {n.node_id: (self._alloc[n.node_id].used - room[n.node_id]) / self._alloc[n.node_id].capacity
                for n in ordered}  # the share of each arena its values hold
        if fill[prefer] > min(fill.values()) + PREFER_SLACK:
            return ordered
        return [node, *(n for n in ordered if n is not node)]

    def _grant_on(self, node, owner: str, need: int, now: float) -> SlabGrant | None:
        """A slab on ``node``, evicting for it if need be; None where it has no room."""
        policy = self.policy
        cap = self._alloc[node.node_id].capacity
        left = self.budget(cap) - self.room(node.node_id)
        length = max(page_up(need), min(policy.put_slab_bytes, cap // 16, left) // ALIGN * ALIGN)
        if length > cap // 4 or length > left:
            return None  # a slab must not take a large share of any arena, nor more than the slabs' budget
        got = self._fit(node.node_id, length, need, now)
        if got is None:
            got = self._evict_fit(node.node_id, length, need, now)
        if got is None:
            return None
        # Unique across master incarnations (like generations), so a commit into a
        # previous master's slab can never match one of ours.
        self._next_id = max(self._next_id + 1, self._wall_ns())
        slab = Slab(self._next_id, node.node_id, got[0], got[1], owner,
                    now + policy.put_slab_ttl_s + policy.put_timeout_s, {got[0]: got[1]})
        self.slabs[slab.slab_id] = slab
        self._mirror.slab(slab.slab_id, slab)
        self._replicas.note_reserved(node.node_id, slab_key(slab.slab_id), slab.slab_id, slab.offset, slab.length)
        return SlabGrant(slab.slab_id, node.node_id, slab.offset, slab.length, node.incarnation,
                         policy.put_slab_ttl_s)

    def _evict_fit(self, node_id: str, length: int, need: int, now: float) -> tuple[int, int] | None:
        """A slab of ``length`` bytes where no free run holds one: the largest free run if it
        holds ``need`` (what eviction freed lies wherever the least recent values did); else
        evicting a round at a time, but never a soft-pinned value nor a chain cut for a slab
        (it is room in advance: the values it was for can go the two-call way, where each
        allocation asks only for its own extent), and after each round the same. Waiting for
        a whole slab's run to form evicted round after round, newer and newer values: at a
        quarter of the working set it took pages a decode was about to read
        (benchmarks/bench_chains.py, recency)."""
        alloc, replicas = self._alloc[node_id], self._replicas
        need = page_up(need)
        while True:
            got = alloc.allocate(length)
            if got is None:
                shorter = min(length, alloc.largest_paged())
                if shorter >= need:
                    got = alloc.allocate(shorter)
                elif alloc.free >= need:
                    # The room is there, in shorter runs: the longest of them if a piece
                    # worth a grant, else none (the values go the two-call way, each into
                    # a run of its own). Evicting until a run of the whole need formed
                    # took values far beyond what the puts needed, scattered as they were
                    # (an arena split four ways by master shards kept a third of it full).
                    if shorter < min(need, SLAB_PIECE):
                        return None
                    got = alloc.allocate(shorter)
            if got is not None:
                replicas.watermark(node_id, now)
                return got
            if not replicas.evict(node_id, length, now, must=0):
                return None

    def budget(self, capacity: int) -> int:
        """The most a node's arena holds in put slabs' uncommitted room, all clients
        together: half the headroom above the high watermark of a node without a spill tier
        (at least one small slab).
        Eviction counts only the bytes values hold, so values fill the arena up to the
        watermark whatever the number of clients, and the slabs still fit beside them."""
        # A slab holds DRAM: the same budget on every node, from the marks of a node without
        # a spill tier (2.5% of the arena by default). Twice that, 5%, left so little free
        # room beside values at the watermark that grants evicted for runs long enough, and
        # bench_chains.py's rounds at half the working set served 52.2% instead of 59.7%.
        hw = self.policy.marks(False)[0]
        return max(SLAB_MIN, int((1 - hw) * capacity) // 2 // ALIGN * ALIGN)

    def room(self, node_id: str) -> int:
        """Bytes of ``node_id``'s arena that slabs hold uncommitted."""
        return sum(ln for s in self.slabs.values() if s.node_id == node_id for ln in s.free.values())

    def _fit(self, node_id: str, length: int, need: int, now: float) -> tuple[int, int] | None:
        """A slab of ``length`` bytes, or a shorter one (down to ``SLAB_MIN`` or ``need``)
        out of the largest free run, without evicting. Slabs given back partly used leave
        free runs a little shorter than a slab: asking for a whole slab there would evict
        until a run that long formed, evicting far more than the values need. Only slabs of
        4 MiB and up are shortened: in small arenas a store filled with pinned values must
        still report itself full rather than hand out ever smaller pieces."""
        alloc = self._alloc[node_id]
        got = alloc.allocate(length)
        if got is None and length >= 4 * SLAB_MIN:
            shorter = min(length, alloc.largest_paged())
            if shorter >= min(page_up(need), SLAB_MIN):
                got = alloc.allocate(shorter)
        if got is not None:
            self._replicas.watermark(node_id, now)
        return got

    # ----------------------------------------------------------------- commit ----
    def commit(self, key: str, slab_id: int, offset: int, size: int, upsert: bool, owner: str, now: float,
               parent: str = "") -> int:
        """Publish ``size`` bytes the caller wrote at ``offset`` of slab ``slab_id`` as
        ``key`` (a checked key). Returns the value's generation. Idempotent: a retry of a
        commit that went through answers with the same generation.

        Raises:
            LeaseExpiredError: the slab is unknown (expired, returned, its node gone,
                granted by a previous master incarnation, or to another owner): put the
                value again.
            InvalidArgumentError: bad size, or the extent is not an uncommitted part of the slab.
            ObjectExistsError / ObjectPendingError: as ``put_start`` (the extent is freed).
        """
        if not isinstance(size, int) or size < 0:
            raise InvalidArgumentError(f"size must be a non-negative int, got {size!r}")
        slab = self.slabs.get(slab_id)
        if slab is None or slab.node_id not in self._nodes or slab.owner != owner:
            gen = self._committed_before(key, slab_id, offset, size, owner)
            if gen is not None:
                return gen
            raise LeaseExpiredError(f"put slab {slab_id} is gone (expired, returned or its node left); "
                                    f"put {key!r} again")
        length = extent_length(size)
        if carve(slab.free, offset, length):
            self._mirror.slab(slab_id, slab)
        else:
            done = self._objects.get(key)
            if done is not None and any(r.node_id == slab.node_id and r.tier is Tier.DRAM and r.offset == offset
                                        and r.length == length for r in done.replicas):
                self._replicas.settled(done)
                return done.gen  # a retry after a lost reply: already committed
            raise InvalidArgumentError(
                f"extent ({offset}, {length}) of {key!r} is not an uncommitted part of put slab {slab_id}")
        conflict = (ObjectPendingError(f"a put of {key!r} is already in flight") if key in self._pending
                    else ObjectExistsError(f"{key!r} is already stored; use upsert to replace it")
                    if key in self._objects and not upsert else None)
        if conflict is not None:
            self._alloc[slab.node_id].release(offset, length)
            raise conflict
        gen = self._gens.new()
        # Evict before publishing (as put_start does): a node applies a delta's drops
        # before its adds, so the new value must not be a victim of this same delta.
        self._publish(slab, key, size, gen, offset, now, parent)
        return gen

    def _committed_before(self, key: str, slab_id: int, offset: int, size: int, owner: str) -> int | None:
        """The generation of ``key`` when it is stored exactly where this commit of a slab
        that is gone put it: the commit went through and this is its retry (its reply was
        lost or late, and the slab was given back, expired, or granted by a previous master
        incarnation meanwhile). None otherwise.

        A slab given back lately is known by its node and owner. One of a previous master
        incarnation is not known at all: the value's extent (offset and length) and size
        must match; on another node that would take another put of the same key landing at
        the same offset with the same length (a KV page's key names its bytes)."""
        done = self._objects.get(key)
        if done is None or done.size != size:
            return None
        length = extent_length(size)
        retired = self._retired.get(slab_id)
        if retired is not None:
            node, granted_to = retired
            if granted_to != owner:
                return None
        elif slab_id < self._first_id:
            node = None  # a previous incarnation's slab: its node is not known here
        else:
            return None
        if any(r.tier is Tier.DRAM and r.offset == offset and r.length == length and node in (None, r.node_id)
               for r in done.replicas):
            self._replicas.settled(done)
            return done.gen
        return None

    def apply_logged_run(self, entries: list, message: bool = True) -> str:
        """Commits the read index answered (its checks made, its pieces carved there):
        consecutive log entries into one slab (a batch's, or one), as ``commit`` without the
        watermark check, which the caller makes once the whole log is applied (see
        ``fastpath.py``). One carve per contiguous span of their extents, the counters once,
        then the chain links in the log's order. Returns the slab's node. ``message=False``:
        the commits went through the node's commit ring, which is all the node gets of them."""
        slab = self.slabs[entries[0][3]]
        free = slab.free
        start = end = -1
        for e in entries:
            offset, length = e[5], extent_length(e[6])
            assert offset % extent_align(length) == 0, f"index committed {e[1]!r} at a misaligned offset"
            if offset == end:
                end += length
                continue
            if start >= 0:
                assert carve_span(free, start, end), f"index committed {e[1]!r} outside the free pieces of slab {e[3]}"
            start, end = offset, offset + length
        assert carve_span(free, start, end), f"index committed {entries[-1][1]!r} outside the free pieces of slab {entries[-1][3]}"
        self._gens.seen(max(e[2] for e in entries))
        self._replicas.published_natively_many(entries, slab.node_id, message)
        self._objects.stored_natively_run(entries)
        return slab.node_id

    def _publish(self, slab: Slab, key: str, size: int, gen: int, offset: int, now: float, parent: str = "") -> None:
        obj = Obj(key, size, gen, [Replica(slab.node_id, Tier.DRAM, offset, extent_length(size))], parent=parent)
        self._replicas.watermark(slab.node_id, now)
        self._replicas.publish(obj, now)

    # ------------------------------------------------------------- life cycle ----
    def give_back(self, slab_id: int) -> int:
        """Free a slab's uncommitted space; returns the bytes freed. Idempotent."""
        slab = self.slabs.pop(slab_id, None)
        if slab is None:
            return 0
        self._retired[slab_id] = (slab.node_id, slab.owner)
        if len(self._retired) > RETIRED_SLABS:
            self._retired.popitem(last=False)
        self._mirror.slab(slab_id, None)
        self._replicas.note_unreserved(slab.node_id, slab_key(slab_id), slab_id)
        alloc = self._alloc.get(slab.node_id)
        freed = 0
        for off, ln in slab.free.items():
            if alloc is not None:
                alloc.release(off, ln)
            freed += ln
        return freed

    def expire(self, now: float) -> int:
        gone = [s.slab_id for s in self.slabs.values() if s.expires <= now]
        for slab_id in gone:
            self.give_back(slab_id)
        return len(gone)

    def adopt(self, node_id: str, reserved: list, hold: dict[str, float], now: float) -> None:
        """A mounting node's reserved ranges this master did not hand out (a previous
        master did, or this one before it unmounted the node): clients may still write
        there. Each becomes a slab nobody owns (no commit matches it) over the parts of the
        range no restored value holds, given back when it expires: ``now`` plus
        ``hold[kind]``, the longest a client may still start a write into that kind of
        range ("slab" or "put"). The node's entry for it is replaced by the new slab's."""
        alloc = self._alloc[node_id]
        runs = sorted(alloc.free_runs())
        starts = [r[0] for r in runs]
        for e in reserved:
            self._replicas.note_unreserved(node_id, e.key, e.gen)
            kind = e.key.split("/", 1)[0]
            lo, hi = e.offset, e.offset + e.length
            free = {}
            for start, length in runs[max(0, bisect.bisect_right(starts, lo) - 1):]:
                if start >= hi:
                    break
                a, b = max(start, lo), min(start + length, hi)
                if a < b:
                    free[a] = b - a
            for off, ln in free.items():
                alloc.reserve(off, ln)
            if free:
                runs = sorted(alloc.free_runs())
                starts = [r[0] for r in runs]
                self._next_id = max(self._next_id + 1, self._wall_ns())
                ghost = Slab(self._next_id, node_id, lo, e.length, "", now + hold.get(kind, 0.0), free)
                self.slabs[ghost.slab_id] = ghost
                self._mirror.slab(ghost.slab_id, ghost)
                self._replicas.note_reserved(node_id, slab_key(ghost.slab_id), ghost.slab_id, lo, e.length)

    def drop_node(self, node_id: str) -> None:
        for slab_id in [s.slab_id for s in self.slabs.values() if s.node_id == node_id]:
            del self.slabs[slab_id]  # the node's allocator is gone with it
            self._mirror.slab(slab_id, None)

    def free_bytes(self) -> int:
        return sum(ln for s in self.slabs.values() for ln in s.free.values())

    def check(self, live: dict[str, list[tuple[int, int]]]) -> None:
        """Assert every slab is on a mounted node with its pieces inside it, and add the
        pieces to ``live`` (allocated extents by node) for the state machine's check."""
        for slab in self.slabs.values():
            assert slab.node_id in self._nodes, f"slab {slab.slab_id} on unmounted {slab.node_id}"
            for off, length in slab.free.items():
                assert slab.offset <= off and off + length <= slab.offset + slab.length, \
                    f"slab {slab.slab_id}: piece {off} outside the slab"
                live[slab.node_id].append((off, length))
