"""The reference read index: a pure-Python ``MasterIndex`` (``native/src/master/index.cpp``).

Same methods, same replies, same lease ids and the same log as the native index, whose
contract with the state machine ``fastpath.py`` describes. The unit tests compare the two
on random streams (``tests/native/test_master_index.py``), and the simulation drives the
state machine through this one. GET answers are ``wire.ReadGrant`` records; PUT_COMMIT
items are read as ``wire.Commit`` records.
"""

from __future__ import annotations

import time

import msgpack

from mooncake_ray._private import rpc
from mooncake_ray._private.master.allocator import carve, extent_length
from mooncake_ray._private.master.fastpath import COMMIT, FIRST_LEASE, GRANT, RELEASE
from mooncake_ray._private.master.types import Tier
from mooncake_ray._private.wire import Commit, ReadGrant, ReplicaLoc

_DRAM = Tier.DRAM.value


class PyIndex:
    """A pure-Python ``MasterIndex`` (see the module docstring)."""

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

    def drop_many(self, keys) -> None:
        for key in keys:
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
            out.append(ReadGrant(size, gen, float(self._ttl),
                                 [ReplicaLoc(r[0], _DRAM, r[2], r[3], r[4], r[5]) for r in reps], lease))
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
            items.append(Commit(*it))
        if not self._enabled or not self._commits or len(self._log) + len(items) > self._max_log:
            return None
        scratch: dict[int, dict] = {}
        seen: set[str] = set()
        for key, slab_id, offset, size, _upsert in items:
            nbytes = len(key.encode("utf-8", "surrogatepass"))
            if not key or nbytes > self._max_key_bytes or key in seen:
                return None
            seen.add(key)
            slab = self._slabs.get(slab_id)
            if key in self._pending or key in self._map or slab is None or slab[0] != owner:
                return None
            free = scratch.setdefault(slab_id, dict(slab[4]))
            if not carve(free, offset, extent_length(size)):
                return None
        for slab_id, free in scratch.items():
            self._slabs[slab_id] = (*self._slabs[slab_id][:4], free)
        now, wall, gens = self.clock(), self.wall_ns(), []
        for key, slab_id, offset, size, _upsert in items:
            self._next_gen = gen = max(self._next_gen + 1, wall)
            _o, node_id, ray_node_id, inc, _f = self._slabs[slab_id]
            self._map[key] = (size, gen, [(node_id, ray_node_id, offset, extent_length(size), inc, 0)])
            self._log.append((COMMIT, key, gen, slab_id, now, offset, size))
            gens.append(gen)
        self._served += 1
        return rpc.pack([rpc.OK, gens])


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
