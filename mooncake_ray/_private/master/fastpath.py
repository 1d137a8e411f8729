"""The read index: GET, EXISTS, lease releases and one-call put commits answered without
the state machine.

A 4 KiB get is one master call plus a microsecond copy, and the master's Python handler
costs 50-120 µs per call on a busy 2-vCPU host (the same code takes ~15 µs in a hot
loop: the rest is cold caches). So the engine answers the read calls in C++ on its
progress thread (``mcr::MasterIndex``, ``native/src/master/index.cpp``) from a mirror of
the index, and Python runs only for everything else.

The contract between the two halves:

- **The mirror holds exactly what a GET answers.** One entry per complete object:
  ``(size, gen, [(node_id, ray_node_id, offset, length, incarnation), ...])`` listing its
  ready DRAM replicas in the state machine's order; an empty list means "present, but
  Python answers" (the value is only on disk and must be promoted). ``ReadIndexMixin``
  rewrites a key's entry at every place where that answer can change (publish, drop,
  replica dropped or promoted, node mount or unmount); ``check_invariants`` verifies the
  mirror against the objects, and the simulation runs with it.
- **What a native call grants is logged, not applied.** A lease (and the recency touch
  and hit that come with it), a release, a miss. Every section of the actor that reads
  or changes the state machine first holds the index's mutex and drains that log into
  the state machine (``apply_index_log``), as if Python had served those calls itself,
  in order. A native call takes the same mutex, so it falls wholly before a section
  (drained at its start) or wholly after it (and sees its changes): a lease is never
  granted on extents the state machine is freeing.
- **Clean one-call puts too.** ``PUT_COMMIT`` into a put slab is answered natively when
  every key is new (not stored, no two-call put in flight, not twice in the call) and every
  extent is an uncommitted part of the caller's slab. For that the mirror also holds the
  slabs' uncommitted pieces, the keys with a put in flight, and the generation counter
  (pushed at the end of every section). The value is visible to native GETs at once; the
  commit is logged, and a thread of the actor that the log wakes applies it within
  milliseconds (``_apply_commit``: carve, publish, inventory delta). Watermark eviction for
  the logged commits runs after the whole log is applied, so it sees every lease granted
  in it: evicting a value before its logged lease would free extents a reader holds.
- **Anything unusual is Python's.** Other operations, a key whose entry is empty, a
  commit that replaces or conflicts or gives slabs back, a request the native parser does
  not accept, a full log, a master still rebuilding its index: the native side declines
  and the Python handler answers the whole call.

``PyIndex`` is the reference implementation of the native index (same methods, same
replies, same lease ids): the unit tests compare the two on random streams, and the
simulation drives the state machine through it.
"""

from __future__ import annotations

import time

import msgpack

from mooncake_ray._private import rpc
from mooncake_ray._private.master.allocator import ALIGN, align_up
from mooncake_ray._private.master.types import Obj, Replica, Tier

GRANT, RELEASE, COMMIT = 0, 1, 2
_DRAM = Tier.DRAM
FIRST_LEASE = 1 << 40  # native lease ids; the state machine's own counter stays far below


class ReadIndexMixin:
    """The state machine's side of the contract (see the module docstring)."""

    index = None  # a MasterIndex (native) or PyIndex; None: no mirror

    def _index_entry(self, obj: Obj) -> list:
        nodes, out = self._nodes, []
        for r in obj.replicas:
            if r.tier is _DRAM and r.ready:
                node = nodes[r.node_id]
                out.append((r.node_id, node.ray_node_id, r.offset, r.length, node.incarnation, r.placed))
        return out

    def _mirror_slab(self, slab_id: int) -> None:
        """Tell the index a put slab's uncommitted pieces (or that it is gone)."""
        if self.index is None:
            return
        slab = self._slabs.get(slab_id)
        if slab is None:
            self.index.drop_slab(slab_id)
        else:
            node = self._nodes[slab.node_id]
            self.index.set_slab(slab_id, slab.owner, node.node_id, node.ray_node_id, node.incarnation,
                                list(slab.free.items()))

    def _mirror_pending(self, key: str) -> None:
        if self.index is None:
            return
        if key in self._pending:
            self.index.add_pending(key)
        else:
            self.index.drop_pending(key)

    def _mirror_key(self, key: str) -> None:
        """Tell the index what a GET of ``key`` answers now."""
        if self.index is None:
            return
        obj = self._objects.get(key)
        if obj is None:
            self.index.drop(key)
        else:
            self.index.set(key, obj.size, obj.gen, self._index_entry(obj))

    def apply_index_log(self, misses: int, log, decide: bool = True) -> None:
        """Apply what the native side did since the last drain, in order: each entry does
        what ``get`` / ``release`` / ``put_commit`` would have done at its logged time.

        The watermark checks of the commits come last, once every entry is applied.
        ``decide=False`` leaves them for a later call (the actor applies a large log while
        native calls go on, then takes the index mutex, drains the rest and decides)."""
        if misses:
            self.counters["misses"] += misses
        ttl = self.policy.lease_ttl_s
        objects = self._objects
        full = self._watermark_due  # nodes that took logged commits, not checked yet
        for kind, key, gen, lease, now, offset, size in log:
            if kind == COMMIT:
                full.add(self._apply_commit(key, gen, lease, offset, size, now))
                continue
            obj = objects.get(key)
            if obj is None or obj.gen != gen:
                continue  # a release of a replaced value (a grant cannot be: see above)
            if kind == GRANT:
                until = obj.lease_until
                if until <= now or obj.leases is None:
                    obj.leases = set()
                obj.leases.add(lease)
                obj.lease_until = max(until, now + ttl)
                self._lru.touch(key)
                self.counters["hits"] += 1
            elif obj.leases:
                obj.leases.discard(lease)
                if not obj.leases:
                    obj.lease_until = min(obj.lease_until, now)
        if full and decide:
            now = self._clock()
            for node_id in full:
                if node_id in self._nodes:
                    self._watermark(node_id, now)
            full.clear()

    def _apply_commit(self, key: str, gen: int, slab_id: int, offset: int, size: int, now: float) -> str:
        """``put_commit`` after its checks, which the index made (see the module docstring)."""
        slab = self._slabs[slab_id]
        length = align_up(size)
        piece = self._carve(slab, offset, length)
        assert piece is not None, f"index committed {key!r} outside the free pieces of slab {slab_id}"
        self._next_gen = max(self._next_gen, gen)
        obj = Obj(key, size, gen, [Replica(slab.node_id, Tier.DRAM, offset, length)])
        self._nodes[slab.node_id].keys.add(key)
        self._publish(obj, now)
        return slab.node_id

    def _check_index(self) -> None:
        if self.index is None:
            return
        assert self.index.slab_count() == len(self._slabs), "read index: slabs out of sync"
        for slab_id, slab in self._slabs.items():
            node = self._nodes[slab.node_id]
            want = (slab.owner, node.node_id, node.ray_node_id, node.incarnation, sorted(slab.free.items()))
            got = self.index.lookup_slab(slab_id)
            assert got is not None and (*got[:4], [tuple(p) for p in got[4]]) == want, \
                f"slab {slab_id}: read index says {got}, the state machine {want}"
        assert self.index.pending_count() == len(self._pending), "read index: pending keys out of sync"
        assert all(self.index.is_pending(k) for k in self._pending), "read index: pending keys differ"
        assert len(self.index) == len(self._objects), \
            f"read index has {len(self.index)} keys, the state machine {len(self._objects)}"
        for key, obj in self._objects.items():
            got = self.index.lookup(key)
            want = (obj.size, obj.gen, self._index_entry(obj))
            assert got is not None and (got[0], got[1], list(got[2])) == want, \
                f"{key}: read index says {got}, the state machine {want}"


class PyIndex:
    """A pure-Python ``MasterIndex`` (the reference; see the module docstring)."""

    def __init__(self) -> None:
        self._map: dict[str, tuple] = {}
        self._log: list = []
        self._misses = 0
        self._next_lease = FIRST_LEASE
        self._ttl = 10.0
        self._enabled = False
        self._max_log = 1 << 17
        self._served = 0
        self._commits = False
        self._max_key_bytes = 4096
        self._slabs: dict[int, tuple] = {}  # id -> (owner, node_id, ray_node_id, incarnation, {off: len})
        self._pending: set[str] = set()
        self._next_gen = 0
        self.clock = time.monotonic
        self.wall_ns = time.time_ns

    def set(self, key, size, gen, reps) -> None:
        self._map[key] = (size, gen, [tuple(r) for r in reps])

    def drop(self, key) -> None:
        self._map.pop(key, None)

    def clear(self) -> None:
        self._map.clear()

    def lock(self) -> None:
        pass

    def unlock(self) -> None:
        pass

    def set_enabled(self, on: bool) -> None:
        self._enabled = on

    def set_lease_ttl(self, ttl_s: float) -> None:
        self._ttl = ttl_s

    def set_max_log(self, n: int) -> None:
        self._max_log = n

    def drain(self):
        out, self._log, misses, self._misses = self._log, [], self._misses, 0
        return misses, out

    def set_commits(self, on: bool) -> None:
        self._commits = on

    def set_max_key_bytes(self, n: int) -> None:
        self._max_key_bytes = n

    def set_slab(self, slab_id, owner, node_id, ray_node_id, incarnation, free) -> None:
        self._slabs[slab_id] = (owner, node_id, ray_node_id, incarnation, dict(free))

    def drop_slab(self, slab_id) -> None:
        self._slabs.pop(slab_id, None)

    def lookup_slab(self, slab_id):
        s = self._slabs.get(slab_id)
        return None if s is None else (*s[:4], sorted(s[4].items()))

    def slab_count(self) -> int:
        return len(self._slabs)

    def add_pending(self, key) -> None:
        self._pending.add(key)

    def drop_pending(self, key) -> None:
        self._pending.discard(key)

    def pending_count(self) -> int:
        return len(self._pending)

    def is_pending(self, key) -> bool:
        return key in self._pending

    def set_next_gen(self, gen: int) -> None:
        self._next_gen = gen

    def wait_commits(self, timeout_s: float) -> bool:
        return any(e[0] == COMMIT for e in self._log)

    def __len__(self) -> int:
        return len(self._map)

    def served(self) -> int:
        return self._served

    def lookup(self, key):
        return self._map.get(key)

    def serve(self, request: bytes) -> bytes | None:
        try:
            req = rpc.unpack(request)
            if isinstance(req, list) and req and type(req[0]) is int and req[0] == rpc.PUT_COMMIT:
                return self._commit(req)
            parsed = _parse(req)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            return None
        if parsed is None:
            return None
        op, keys, client_node, done = parsed
        if not self._enabled or len(self._log) + len(keys) + len(done) > self._max_log:
            return None
        found = [self._map.get(k) for k in keys]
        if op == rpc.GET and any(e is not None and not e[2] for e in found):
            return None
        self._served += 1
        if op == rpc.EXISTS:
            return rpc.pack([rpc.OK, [e is not None for e in found]])
        now = self.clock()
        self._log.extend((RELEASE, k, g, lease, now, 0, 0) for k, g, lease in done)
        if op == rpc.RELEASE:
            return rpc.pack([rpc.OK, None])
        out = []
        for key, e in zip(keys, found):
            if e is None:
                self._misses += 1
                out.append(None)
                continue
            size, gen, reps = e
            lease, self._next_lease = self._next_lease, self._next_lease + 1
            self._log.append((GRANT, key, gen, lease, now, 0, 0))
            if client_node and len(reps) > 1:
                reps = sorted(reps, key=lambda r: r[0] != client_node and r[1] != client_node)
            out.append([size, gen, float(self._ttl),
                        [[r[0], Tier.DRAM.value, r[2], r[3], r[4], r[5]] for r in reps], lease])
        return rpc.pack([rpc.OK, out])


    def _commit(self, req) -> bytes | None:
        """The clean case of PUT_COMMIT (see the module docstring), all or nothing."""
        if len(req) not in (3, 4) or not isinstance(req[1], list) or not req[1] or type(req[2]) is not str:
            return None
        owner = req[2]
        if len(req) == 4 and req[3] is not None and req[3] != []:
            return None
        items = []
        for it in req[1]:
            if not (isinstance(it, list) and len(it) in (4, 5) and type(it[0]) is str
                    and all(type(x) is int and x >= 0 for x in it[1:4])
                    and (len(it) == 4 or type(it[4]) is bool)):
                return None
            items.append(it[:4])
        if not self._enabled or not self._commits or len(self._log) + len(items) > self._max_log:
            return None
        scratch: dict[int, dict] = {}
        seen: set[str] = set()
        for key, slab_id, offset, size in items:
            nbytes = len(key.encode("utf-8", "surrogatepass"))
            if not key or nbytes > self._max_key_bytes or key in seen:
                return None
            seen.add(key)
            slab = self._slabs.get(slab_id)
            if key in self._pending or key in self._map or slab is None or slab[0] != owner:
                return None
            free = scratch.setdefault(slab_id, dict(slab[4]))
            if not _carve(free, offset, align_up(size)):
                return None
        for slab_id, free in scratch.items():
            self._slabs[slab_id] = (*self._slabs[slab_id][:4], free)
        now, wall, gens = self.clock(), self.wall_ns(), []
        for key, slab_id, offset, size in items:
            self._next_gen = gen = max(self._next_gen + 1, wall)
            _o, node_id, ray_node_id, inc, _f = self._slabs[slab_id]
            self._map[key] = (size, gen, [(node_id, ray_node_id, offset, align_up(size), inc, 0)])
            self._log.append((COMMIT, key, gen, slab_id, now, offset, size))
            gens.append(gen)
        self._served += 1
        return rpc.pack([rpc.OK, gens])


def _carve(free: dict, offset: int, length: int) -> bool:
    if offset % ALIGN:
        return False
    for start, ln in free.items():
        if start <= offset and offset + length <= start + ln:
            del free[start]
            if offset > start:
                free[start] = offset - start
            if offset + length < start + ln:
                free[offset + length] = start + ln - offset - length
            return True
    return False


def _parse(req):
    """``(op, keys, client_node, done)`` of a request the index answers, else None."""
    if not isinstance(req, list) or len(req) < 2 or type(req[0]) is not int:
        return None
    op, args = req[0], req[1:]

    def keys_ok(keys):
        return isinstance(keys, list) and all(type(k) is str for k in keys)

    def done_ok(done):
        return isinstance(done, list) and all(
            isinstance(d, list) and len(d) == 3 and type(d[0]) is str
            and all(type(x) is int and x >= 0 for x in d[1:]) for d in done)

    if op == rpc.GET and 1 <= len(args) <= 3 and keys_ok(args[0]):
        client = args[1] if len(args) > 1 else None
        done = args[2] if len(args) > 2 else None
        if (client is None or type(client) is str) and (done is None or done_ok(done)):
            return op, args[0], client or "", done or []
    elif op == rpc.EXISTS and len(args) == 1 and keys_ok(args[0]):
        return op, args[0], "", []
    elif op == rpc.RELEASE and len(args) == 1 and done_ok(args[0]):
        return op, [], "", args[0]
    return None
