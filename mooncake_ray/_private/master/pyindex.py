"""The reference object table and read index: a pure-Python ``MasterIndex``
(``native/src/master/index.cpp``, whose header says what a hot and a cold record are).

Same methods, same replies, same lease ids, the same log and the same recency order as the
native index, whose contract with the state machine ``fastpath.py`` and ``table.py``
describe. The unit tests compare the two on random streams
(``tests/native/test_master_index.py``), and the simulation drives the state machine
through this one. GET answers are ``wire.ReadGrant`` records; PUT_COMMIT items are read as
``wire.Commit`` records. A master with its native calls off keeps its table here.
"""

from __future__ import annotations

import hashlib
import struct
import time

import msgpack

from mooncake_ray._private import rpc
from mooncake_ray._private.master.allocator import carve, extent_length
from mooncake_ray._private.master.fastpath import COMMIT, FIRST_LEASE, GRANT, MAX_RETURNS, RELEASE, RETURN
from mooncake_ray._private.master.types import Tier
from mooncake_ray._private.wire import Commit, ReadGrant, ReplicaLoc

_DRAM = Tier.DRAM.value
# Reference kinds of sampled keys (MasterIndex::kRefGet, kRefPut), and how many samples wait.
REF_GET, REF_PUT = 2, 3
SAMPLES_MAX = 1 << 16
# Hold bits of a record's chain links (MasterIndex::kHoldWait, kHoldRemote).
HOLD_WAIT, HOLD_REMOTE = 1, 2


class _Rec:
    """One record (``IndexRecord`` in C++). Hot: ``reps`` is the GET answer. Cold: ``rep``
    is ``(node_id, ray_node_id, incarnation, offset, length, placed)``, ``disk`` its tier,
    ``lease_until`` and ``leases`` (at most two ids) its read leases."""

    __slots__ = ("size", "gen", "hot", "reps", "rep", "disk", "lease_until", "leases")

    def __init__(self, size, gen, hot, reps=(), rep=None, disk=False, lease_until=0.0, leases=()):
        self.size, self.gen, self.hot, self.reps = size, gen, hot, list(reps)
        self.rep, self.disk, self.lease_until, self.leases = rep, disk, lease_until, list(leases)

    def answer(self) -> list:
        if self.hot:
            return self.reps
        if self.disk:
            return []
        n, r, inc, off, ln, placed = self.rep
        return [(n, r, off, ln, inc, placed)]

    def cold(self) -> tuple:
        return (self.size, self.gen, self.rep[0], self.disk, self.rep[3], self.rep[4], self.rep[5],
                self.lease_until, sorted(self.leases))


class PyIndex:
    """A pure-Python ``MasterIndex`` (see the module docstring)."""

    def __init__(self) -> None:
        self._map: dict[str, _Rec] = {}  # in recency order, least recent first
        # On probation (older than all of _map): the newest ones (``_grace_max`` bytes) first
        # in first out, those before them newest first.
        self._stack: dict[str, None] = {}  # left the grace window: the last one in goes first
        self._grace: dict[str, int] = {}  # the newest, oldest first: key -> size counted
        self._grace_bytes = 0
        self._grace_max = 0
        self._insert_old = False
        self._unread: set[str] = set()  # chained values put at the recent end, not read since
        self._shift = 64  # sampling off until the master sets its rate
        self._samples: list = []
        self._dropped = 0
        self._log: list = []
        self._misses = 0
        self._hits = 0
        self._next_lease = FIRST_LEASE
        self._ttl = 10.0
        self._enabled = False
        self._max_log = 1 << 17
        self._served = 0
        self._lookups = 0
        self._commits = False
        self._max_key_bytes = 4096
        self._slabs: dict[int, tuple] = {}  # id -> (owner, node_id, ray_node_id, incarnation, {off: len})
        self._pending: set[str] = set()
        self._next_gen = 0
        self.clock = time.monotonic
        self.wall_ns = time.time_ns
        # KV chain links (MasterIndex::links_): between stored keys only.
        self._links_on = False
        self._remote_holds = True
        self._up: dict[str, str] = {}  # key -> the stored parent it names
        self._down: dict[str, list[str]] = {}  # parent -> its stored children, newest link first
        self._holds: dict[str, int] = {}  # key -> HOLD_* bits
        self._pass: dict[str, int] = {}  # the eviction pass's held keys -> when met
        self._pass_cut = False  # the pass took its held probation records (evict_cold)

    # ------------------------------------------------------------- the table --
    def _resize(self, key, size) -> None:
        if key in self._grace:
            self._grace_bytes += size - self._grace[key]
            self._grace[key] = size

    def set(self, key, size, gen, reps) -> None:
        self._resize(key, size)
        self._map[key] = _Rec(size, gen, True, [tuple(r) for r in reps])

    def set_cold(self, key, size, gen, node_id, ray_node_id, incarnation, disk, offset, length, placed,
                 lease_until, leases) -> None:
        if len(leases) > 2:
            raise ValueError("a cold record holds at most two leases")
        self._resize(key, size)
        self._map[key] = _Rec(size, gen, False, rep=(node_id, ray_node_id, incarnation, offset, length, placed),
                              disk=disk, lease_until=float(lease_until), leases=leases)

    def set_cold_many(self, keys, cols, node_id, ray_node_id, incarnation, placed, lease_until) -> None:
        if len(cols) != len(keys) * 32:
            raise ValueError("set_cold_many: cols must hold 4 int64s per key")
        vals = struct.unpack(f"<{4 * len(keys)}q", cols)
        if any(v < 0 for v in vals):
            raise ValueError("set_cold_many: a negative generation, size, offset or length")
        for i, key in enumerate(keys):
            gen, size, offset, length = vals[4 * i:4 * i + 4]
            self.set_cold(key, size, gen, node_id, ray_node_id, incarnation, False, offset, length, placed + i,
                          lease_until, [])

    def hydrate(self, key):
        r = self._map.get(key)
        if r is None or r.hot:
            return None
        out = r.cold()
        r.reps, r.hot = r.answer(), True
        r.rep, r.disk, r.lease_until, r.leases = None, False, 0.0, []
        return out

    def peek_cold(self, key):
        r = self._map.get(key)
        return None if r is None or r.hot else r.cold()

    def contains(self, key) -> bool:
        return key in self._map

    def is_hot(self, key) -> bool:
        r = self._map.get(key)
        return r is not None and r.hot

    def _unprobe(self, key) -> None:
        self._stack.pop(key, None)
        self._grace_bytes -= self._grace.pop(key, 0)

    def touch(self, key, unread: bool = False) -> None:
        if key in self._map:
            self._unprobe(key)
            if unread:
                self._unread.add(key)
            else:
                self._unread.discard(key)
        r = self._map.pop(key, None)
        if r is not None:
            self._map[key] = r

    def probation(self, key) -> None:
        if key not in self._map:
            return
        self._unprobe(key)
        self._grace[key] = size = self._map[key].size
        self._grace_bytes += size
        while self._grace_bytes > self._grace_max:
            old = next(iter(self._grace))
            self._grace_bytes -= self._grace.pop(old)
            self._stack[old] = None

    def set_grace_bytes(self, n: int) -> None:
        self._grace_max = n

    def set_insert_old(self, on: bool) -> None:
        if on and not self._insert_old:
            for key in reversed([k for k in self._map
                                 if k in self._unread and k not in self._stack and k not in self._grace]):
                self._stack[key] = None  # the front, oldest first (MasterIndex::set_insert_old)
        elif not on and self._insert_old:
            for key in [*reversed(self._stack), *self._grace]:
                self.touch(key, True)
        self._insert_old = on

    def set_sample_shift(self, shift: int) -> None:
        self._shift = max(0, min(shift, 64))

    def sample(self, kind, key, size, chained) -> None:
        if self._shift >= 64:
            return
        h = int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")
        if self._shift and h >> (64 - self._shift):
            return
        if len(self._samples) >= SAMPLES_MAX:
            self._dropped += 1
            return
        self._samples.append((h, kind, size, chained))

    def take_samples(self):
        out, self._samples, dropped, self._dropped = self._samples, [], self._dropped, 0
        return dropped, out

    def feed_policy(self, sim, shift: int, capacity: int):
        """The samples since the last call, run through ``sim`` (``adaptive.PolicySim``)
        -> (dropped, the windows that closed)."""
        dropped, samples = self.take_samples()
        return dropped, sim.feed(samples, shift, capacity)

    def _order(self) -> list:
        """Every key, least recent first: those on probation, then the rest."""
        if not self._stack and not self._grace:
            return list(self._map)
        return [*reversed(self._stack), *self._grace,
                *(k for k in self._map if k not in self._stack and k not in self._grace)]

    def drop(self, key) -> None:
        if key in self._map:
            self._unprobe(key)
            self._unread.discard(key)
            del self._map[key]
            self._unchain(key)
            self._pass.pop(key, None)

    # ----------------------------------------------------------- chain links --
    def _set_parent(self, key, parent) -> None:
        old = self._up.get(key)
        if old == parent:
            return
        if old is not None:
            kids = self._down[old]
            kids.remove(key)
            if not kids:
                del self._down[old]
            del self._up[key]
        if parent is not None:
            self._up[key] = parent
            self._down.setdefault(parent, []).insert(0, key)

    def _unchain(self, key) -> None:
        self._set_parent(key, None)
        for kid in self._down.pop(key, ()):
            del self._up[kid]
        self._holds.pop(key, None)

    def _probed(self, key) -> bool:
        return key in self._stack or key in self._grace

    def _remote_only(self, key) -> bool:
        return key not in self._down and self._holds.get(key, 0) & (HOLD_WAIT | HOLD_REMOTE) == HOLD_REMOTE

    def _held(self, key) -> bool:
        h = self._holds.get(key, 0)
        return key in self._down or bool(h & HOLD_WAIT) or (self._remote_holds and bool(h & HOLD_REMOTE))

    def set_chain_links(self, on: bool) -> None:
        self._links_on = on
        if not on:
            self._up.clear()
            self._down.clear()
            self._holds.clear()

    def link(self, key, parent) -> None:
        if not self._links_on or key not in self._map:
            return
        self._set_parent(key, parent if parent and parent != key and parent in self._map else None)

    def set_holds(self, key, holds) -> None:
        if not self._links_on or key not in self._map:
            return
        if holds:
            self._holds[key] = holds
        else:
            self._holds.pop(key, None)

    def set_remote_holds(self, on: bool) -> None:
        self._remote_holds = on

    def chain_of(self, key):
        if key not in self._map:
            return "", 0, 0
        return self._up.get(key, ""), len(self._down.get(key, ())), self._holds.get(key, 0)

    def link_count(self) -> int:
        return len(set(self._up) | set(self._down) | set(self._holds))

    def drop_many(self, keys) -> None:
        for key in keys:
            self.drop(key)

    def scan(self, after, node_id, disk, now, limit):
        keys = self._order()
        i = 0 if not after else keys.index(after) + 1 if after in self._map else len(keys)
        out, seen = [], 0
        for j in range(i, len(keys)):
            if len(out) >= limit or seen >= 16 * limit:
                return out, keys[j - 1]
            seen += 1
            r = self._map[keys[j]]
            if r.hot:
                out.append((keys[j], None))
            elif r.disk == disk and r.lease_until <= now and r.rep[0] == node_id:
                out.append((keys[j], (r.gen, r.size, r.rep[3], r.rep[4])))
        return out, None

    def evict_cold(self, after, node_id, now, need, chains=False):
        keys = self._order()
        i = 0 if not after or after not in self._map else keys.index(after) + 1
        if not after:
            self._pass.clear()
            self._pass_cut = False
        chains = chains and self._links_on
        out_keys, gens, extents, stop = [], [], [], None
        freed = 0

        def drop(key) -> None:
            nonlocal freed
            r = self._map[key]
            out_keys.append(key)
            gens.append(r.gen)
            extents.append((r.rep[3], r.rep[4]))
            freed += r.rep[4]
            self.drop(key)

        def drop_up(key) -> None:
            parent = self._up.get(key) if chains else None
            drop(key)
            while parent is not None and freed < need and parent in self._pass and not self._held(parent):
                up = self._up.get(parent)
                drop(parent)
                parent = up

        def cut() -> None:  # MasterIndex::evict_cold: leaving the probation records short
            self._pass_cut = True
            for key in sorted((k for k in self._pass if self._probed(k) and self._remote_only(k)),
                              key=self._pass.__getitem__):
                if freed >= need:
                    return
                if key in self._pass and self._remote_only(key):
                    drop_up(key)

        cutting = chains and self._remote_holds and not self._pass_cut
        ended = True
        for key in keys[i:]:
            if freed >= need:
                ended = False
                break
            r = self._map[key]
            if r.hot:
                stop = key
                break
            if cutting and not self._probed(key):
                cutting = False
                cut()
                if freed >= need:
                    ended = False
                    break
            if not r.disk and r.lease_until <= now and r.rep[0] == node_id:
                if chains and self._held(key):
                    self._pass.setdefault(key, len(self._pass))
                    continue
                drop_up(key)
        if cutting and ended and stop is None and freed < need:
            cut()
        held = []
        if chains and ended and stop is None and freed < need:
            recs = ((k, self._map[k]) for k in sorted(self._pass, key=self._pass.__getitem__))
            held = [(k, (r.gen, r.size, r.rep[3], r.rep[4])) for k, r in recs]
        runs: list = []
        for off, ln in sorted(extents):
            if runs and runs[-1][0] + runs[-1][1] == off:
                runs[-1] = (runs[-1][0], runs[-1][1] + ln)
            else:
                runs.append((off, ln))
        return out_keys, gens, runs, freed, stop, held

    def _cold_on(self, node_id, except_incarnation):
        return ((k, r) for k, r in self._map.items() if not r.hot and r.rep[0] == node_id
                and not (except_incarnation and r.rep[2] == except_incarnation))

    def cold_on_node(self, node_id, except_incarnation="") -> list:
        return [(k, r.disk) for k, r in self._cold_on(node_id, except_incarnation)]

    def cold_gens_on_node(self, node_id, except_incarnation="") -> list:
        return [(k, r.disk, r.gen) for k, r in self._cold_on(node_id, except_incarnation)]

    def retarget_cold(self, keys, cols, node_id, ray_node_id, incarnation) -> bytes:
        if len(cols) != len(keys) * 32:
            raise ValueError("retarget_cold: cols must hold 4 int64s per key")
        vals = struct.unpack(f"<{4 * len(keys)}q", cols)
        out = bytearray(len(keys))
        for i, key in enumerate(keys):
            r = self._map.get(key)
            if r is None or r.hot or r.disk or r.rep[0] != node_id or r.rep[2] == incarnation:
                continue
            if (r.gen, r.size, r.rep[3], r.rep[4]) == vals[4 * i:4 * i + 4]:
                r.rep = (node_id, ray_node_id, incarnation, *r.rep[3:])
                out[i] = 1
        return bytes(out)

    def keys(self, prefix) -> list:
        return [k for k in self._order() if k.startswith(prefix)]

    def hot_keys_recent_first(self) -> list:
        return [k for k in reversed(self._order()) if self._map[k].hot]

    def cold_count(self) -> int:
        return sum(not r.hot for r in self._map.values())

    def clear(self) -> None:
        self._map.clear()
        self._unread.clear()
        self._up.clear()
        self._down.clear()
        self._holds.clear()
        self._pass.clear()
        self._stack.clear()
        self._grace.clear()
        self._grace_bytes = 0

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
        out, self._log, misses, self._misses, hits, self._hits = self._log, [], self._misses, 0, self._hits, 0
        return misses, hits, out

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

    def wait_held(self, timeout_s: float) -> bool:
        return False  # no replies are kept here (durability waits are the native index's)

    def wait_commits(self, timeout_s: float) -> bool:
        return any(e[0] == COMMIT for e in self._log)  # (COMMIT_RINGED is the native index's: rings)

    def __len__(self) -> int:
        return len(self._map)

    def ring_acks(self) -> int:  # commit rings are the native index's alone
        return 0

    def served(self) -> int:
        return self._served

    def lookups(self) -> int:
        return self._lookups

    def lookup(self, key):
        r = self._map.get(key)
        return None if r is None else (r.size, r.gen, r.answer())

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
        now = self.clock()
        found = [self._map.get(k) for k in keys]
        if op == rpc.GET:
            for i, r in enumerate(found):
                if r is None:
                    continue
                if (r.hot and not r.reps) or (not r.hot and r.disk):
                    return None  # Python promotes it
                if not r.hot and (r.lease_until > now and len(r.leases) == 2 or any(f is r for f in found[:i])):
                    return None  # a third lease, or the same key twice: Python's
        self._served += 1
        if op == rpc.GET:
            for key in keys:
                self.sample(REF_GET, key, 0, False)
        if op == rpc.EXISTS:
            self._lookups += len(keys)
            return rpc.pack([rpc.OK, [e is not None for e in found]])
        for k, g, lease in done:
            r = self._map.get(k)
            if r is not None and not r.hot and r.gen == g:
                _release_cold(r, lease, now)
            else:
                self._log.append((RELEASE, k, g, lease, now, 0, 0, ""))
        if op == rpc.RELEASE:
            return rpc.pack([rpc.OK, None])
        out = []
        for key, r in zip(keys, found):
            if r is None:
                self._misses += 1
                out.append(None)
                continue
            size, gen, reps = r.size, r.gen, r.answer()
            lease, self._next_lease = self._next_lease, self._next_lease + 1
            if r.hot:
                self._log.append((GRANT, key, gen, lease, now, 0, 0, ""))
            else:
                _grant_cold(r, lease, now, self._ttl)
                self._hits += 1
            if client_node and len(reps) > 1:
                reps = sorted(reps, key=lambda r: r[0] != client_node and r[1] != client_node)
            out.append(ReadGrant(size, gen, float(self._ttl),
                                 [ReplicaLoc(r[0], _DRAM, r[2], r[3], r[4], r[5]) for r in reps], lease))
        for key, r in (reversed(list(zip(keys, found))) if self._links_on else zip(keys, found)):
            if r is not None:
                self.touch(key)  # MasterIndex::serve: with chain links, last to first
        return rpc.pack([rpc.OK, out])

    def _commit(self, req) -> bytes | None:
        """The clean case of PUT_COMMIT (see the module docstring), all or nothing."""
        if len(req) not in (3, 4) or not isinstance(req[1], list) or not req[1] or type(req[2]) is not str:
            return None
        owner = req[2]
        returns = req[3] if len(req) == 4 and req[3] is not None else []
        if not (isinstance(returns, list) and len(returns) <= MAX_RETURNS
                and all(type(x) is int and 0 <= x < 1 << 64 for x in returns)):
            return None
        items = []
        for it in req[1]:
            if not (isinstance(it, list) and len(it) in (4, 5, 6, 7) and type(it[0]) is str
                    and all(type(x) is int and x >= 0 for x in it[1:4])
                    and (len(it) == 4 or type(it[4]) is bool) and (len(it) < 6 or type(it[5]) is str)
                    and (len(it) < 7 or it[6] is None or (type(it[6]) is int and 0 <= it[6] < 1 << 32))):
                return None
            items.append(Commit(*it))
        if not self._enabled or not self._commits or len(self._log) + len(items) + len(returns) > self._max_log:
            return None
        scratch: dict[int, dict] = {}
        seen: set[str] = set()
        for key, slab_id, offset, size, _upsert, parent, _crc in items:
            nbytes = len(key.encode("utf-8", "surrogatepass"))
            if not key or nbytes > self._max_key_bytes or key in seen:
                return None
            if parent == key or len(parent.encode("utf-8", "surrogatepass")) > self._max_key_bytes:
                return None  # Python's error
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
        for key, slab_id, offset, size, _upsert, parent, _crc in items:
            self._next_gen = gen = max(self._next_gen + 1, wall)
            _o, node_id, ray_node_id, inc, _f = self._slabs[slab_id]
            self._map[key] = _Rec(size, gen, False, rep=(node_id, ray_node_id, inc, offset, extent_length(size), 0))
            if self._insert_old and parent:
                self.probation(key)
            elif parent:
                self._unread.add(key)
            else:
                self._unread.discard(key)
            if parent:
                self.link(key, parent)
            self.sample(REF_PUT, key, size, bool(parent))
            self._log.append((COMMIT, key, gen, slab_id, now, offset, size, parent))
            gens.append(gen)
        for slab_id in returns:  # after the commits: a returned slab may hold some of them
            self._slabs.pop(slab_id, None)
            self._log.append((RETURN, "", 0, slab_id, now, 0, 0, ""))
        self._served += 1
        return rpc.pack([rpc.OK, gens])


def _grant_cold(r: _Rec, lease: int, now: float, ttl: float) -> None:
    """As ``ReplicaTable.grant_lease`` (a free slot was checked)."""
    if r.lease_until <= now:
        r.leases = []
    r.leases.append(lease)
    r.lease_until = max(r.lease_until, now + ttl)


def _release_cold(r: _Rec, lease: int, now: float) -> None:
    """As ``ReplicaTable.end_lease``."""
    if lease in r.leases:
        r.leases.remove(lease)
        if not r.leases:
            r.lease_until = min(r.lease_until, now)


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
