"""The read index: GET, EXISTS and lease releases answered without the state machine.

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
- **Anything unusual is Python's.** Other operations, a key whose entry is empty, a
  request the native parser does not accept, a full log, a master still rebuilding its
  index: the native side declines and the Python handler answers the whole call.

``PyIndex`` is the reference implementation of the native index (same methods, same
replies, same lease ids): the unit tests compare the two on random streams, and the
simulation drives the state machine through it.
"""

from __future__ import annotations

import time

import msgpack

from mooncake_ray._private import rpc
from mooncake_ray._private.master.types import Obj, Tier

GRANT, RELEASE = 0, 1
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
                out.append((r.node_id, node.ray_node_id, r.offset, r.length, node.incarnation))
        return out

    def _mirror_key(self, key: str) -> None:
        """Tell the index what a GET of ``key`` answers now."""
        if self.index is None:
            return
        obj = self._objects.get(key)
        if obj is None:
            self.index.drop(key)
        else:
            self.index.set(key, obj.size, obj.gen, self._index_entry(obj))

    def apply_index_log(self, misses: int, log) -> None:
        """Apply what the native side granted since the last drain, in order: each entry
        does what ``get`` / ``release`` would have done at its logged time."""
        if misses:
            self.counters["misses"] += misses
        ttl = self.policy.lease_ttl_s
        objects = self._objects
        for kind, key, gen, lease, now in log:
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

    def _check_index(self) -> None:
        if self.index is None:
            return
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
        self.clock = time.monotonic

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

    def __len__(self) -> int:
        return len(self._map)

    def served(self) -> int:
        return self._served

    def lookup(self, key):
        return self._map.get(key)

    def serve(self, request: bytes) -> bytes | None:
        try:
            req = rpc.unpack(request)
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
        self._log.extend((RELEASE, k, g, lease, now) for k, g, lease in done)
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
            self._log.append((GRANT, key, gen, lease, now))
            if client_node and len(reps) > 1:
                reps = sorted(reps, key=lambda r: r[0] != client_node and r[1] != client_node)
            out.append([size, gen, float(self._ttl),
                        [[r[0], Tier.DRAM.value, r[2], r[3], r[4]] for r in reps], lease])
        return rpc.pack([rpc.OK, out])


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
