"""The get paths.

Reads are validated: a get's descriptors come with a read lease, and bytes are only
returned if the copy finished before the lease could have ended (measured from before
the request was sent), so extents reallocated to another key are never returned.

A single get takes ``get_one`` (one lookup, one read; with a remembered location the read
overlaps the lookup); a batch, and anything unusual, takes ``get_many``: rounds of one GET
for every key left, promotions of values only on disk, and reads falling over to the next
replica."""

from __future__ import annotations

import time
from typing import Any

from mooncake_ray.errors import (
    InvalidArgumentError,
    LeaseExpiredError,
    NodeUnavailableError,
    ObjectNotFoundError,
    OffloadPendingError,
    TransferError,
)
from mooncake_ray._private import rpc, wire
from mooncake_ray._private.buffers import new_bytes, writable
from mooncake_ray._private.client.args import check_key, convert, key_errors
from mooncake_ray._private.client.backoff import Backoff
from mooncake_ray._private.client.locations import Loc
from mooncake_ray._private.client.nodes import TRANSFER_ERRORS, Node
from mooncake_ray._private.master.tiering import PROMOTE

GET_ATTEMPTS = 3  # lookup + read rounds before a read that outlives its lease is an error
EARLY_MEMCPY_MIN = 64 << 10  # a mapped read shorter than this takes less than the async call costs


class Reader:
    """A client's gets: looks keys up on the master, reads the bytes from the store nodes,
    and gives the read leases back through ``releases``."""

    def __init__(self, engine, master, nodes, locs, releases, stats: dict, *, config, here: str | None,
                 registered):
        self._engine = engine
        self._registered = registered  # (address, length) -> inside a buffer the client registered
        self._master = master
        self._nodes = nodes
        self._locs = locs
        self._releases = releases
        self._stats = stats  # the client's local_stats
        self._here = here
        self._timeout = config.transport.transfer_timeout_s
        self._early_max = config.client.early_read_max_bytes
        self._max_key = config.master.max_key_bytes
        self._backpressure_s = config.client.backpressure_timeout_s
        self.moved = 0  # bytes read by the call being timed (metrics only)

    def get_one(self, key: str, buffer: Any):
        """A single get without the batch machinery (the hot path of small reads): one
        lookup, one read of the first replica. Anything unusual (a promotion from disk, a
        failed read, a lease outlived) takes the general path. Returns the value (bytes, or
        its size when read into ``buffer``) or the error.

        A key whose location this client knows (it wrote or read the value) is read while
        the lookup is in flight, not after it: the bytes are kept only if the master's
        answer names that same placement (gen, node incarnation, offset, and ``placed``,
        which changes whenever a value's DRAM copy is made anew). That placement then held
        the value from before the read began until the lease was granted, so the bytes are
        the value's. Otherwise they are dropped and the value is read as usual."""
        check_key(key, self._max_key)
        dst = writable(buffer, self._registered) if buffer is not None else None
        t0 = time.monotonic()
        args = ([key], self._here, self._releases.take())
        loc = self._locs.get(key)
        if loc is not None:
            node = self._nodes.peek(loc.node_id)
            if node is None or node.incarnation != loc.incarnation:
                loc = None
            elif node.region.read_path == "memcpy":  # a copy in this thread: overlap only a long one
                loc = loc if loc.size >= EARLY_MEMCPY_MIN else None
            elif loc.size > self._early_max:
                loc = None
        if loc is not None and (dst is None or dst[1] >= loc.size):
            d = self._get_early(key, loc, node, buffer, dst, args, t0)
            if not isinstance(d, _Lookup):
                return d  # the value (or the careful path's answer)
            d = d.desc
        else:
            d = self._master.call(rpc.GET, *args)[0]
        if d is None:
            self._stats["misses"] += 1
            return ObjectNotFoundError(f"{key!r} is not in the store")
        if rpc.is_err(d):
            e = rpc.to_exc(d)
            # no DRAM yet to promote the value into: the general path waits for offloads
            return self._careful(key, buffer) if isinstance(e, OffloadPendingError) else e
        g = wire.read_grant(d)
        rep = g.replicas[0]
        if rep.tier != "dram":
            self._releases.later([key, g.gen, g.lease])
            return self._careful(key, buffer)
        if dst is None:
            out, addr = new_bytes(g.size)
        else:
            addr, cap, _ = dst
            if cap < g.size:
                self._releases.later([key, g.gen, g.lease])
                return InvalidArgumentError(
                    f"buffer of {cap} bytes is smaller than the value of {key!r} ({g.size} bytes)")
            out = g.size
        try:
            if g.size:
                self._engine.read([(self._nodes.get(rep.node_id, rep.incarnation).region, rep.offset, addr,
                                    g.size)], timeout_s=self._timeout)
            ok = time.monotonic() - t0 <= g.ttl
        except TRANSFER_ERRORS:
            ok = False
        self._releases.later([key, g.gen, g.lease])
        if not ok:  # a node failed, or the lease may have ended: the careful path
            return self._careful(key, buffer)
        self._stats["reads"] += 1
        self.moved += g.size
        self._locs.remember(key, g.size, g.gen, rep.node_id, rep.offset, rep.incarnation, rep.placed)
        return out

    def _careful(self, key: str, buffer: Any):
        """``get_one`` the general way."""
        return self.get_many([key], None if buffer is None else [buffer])[0]

    def _get_early(self, key: str, loc: Loc, node: Node, buffer: Any, dst, args: tuple, t0: float):
        """``get_one`` for a key with a known location: the lookup sent, the bytes read
        meanwhile. Returns the value (or the careful path's answer) when the master's
        answer confirms the placement; otherwise a ``_Lookup`` for the usual path."""
        size = loc.size
        started = self._master.start(rpc.GET, *args)
        if started is None:  # not connected: the usual path (it reconnects)
            return _Lookup(self._master.call(rpc.GET, *args)[0])
        if dst is None:
            out, addr = new_bytes(size)
        else:
            out, addr = size, dst[0]
        try:
            if size:
                self._engine.read([(node.region, loc.offset, addr, size)], timeout_s=self._timeout)
            read_ok = True
        except TRANSFER_ERRORS:
            read_ok = False
        d = self._master.finish(started)[0]
        g = wire.read_grant(d) if read_ok and d is not None and not rpc.is_err(d) else None
        if g is None or not _confirms(g, loc):
            self._locs.pop(key, None)
            self._stats["early_reads_dropped"] += 1
            return _Lookup(d)
        self._releases.later([key, g.gen, g.lease])
        if time.monotonic() - t0 > g.ttl:  # the lease may have ended: the careful path
            return self._careful(key, buffer)
        self._stats["reads"] += 1
        self._stats["early_reads"] += 1
        self.moved += size
        return out

    def get_many(self, keys, buffers) -> list:
        """Per key, the value (bytes, or its size when read into ``buffers[i]``) or the
        error: ObjectNotFoundError for a miss, InvalidArgumentError for a buffer too
        small, LeaseExpiredError for reads that kept outliving their lease."""
        results: list = [None] * len(keys)
        bad = key_errors(keys, self._max_key)
        dsts = None if buffers is None else convert(buffers, lambda b: writable(b, self._registered), bad)
        for i, e in bad.items():
            results[i] = e
        todo = [i for i in range(len(keys)) if i not in bad] if bad else list(range(len(keys)))
        attempt, backoff = 0, Backoff(self._backpressure_s)
        while todo:
            attempt += 1
            todo = self._get_round(keys, dsts, todo, results, last=attempt >= GET_ATTEMPTS)
            waiting = [i for i, r in enumerate(results) if isinstance(r, OffloadPendingError)]
            if waiting and not backoff.expired():
                todo = sorted(set(todo) | set(waiting))
                backoff.sleep()
        return results

    def _get_round(self, keys, dsts, todo, results, last: bool) -> list[int]:
        """One lookup + read round for ``todo``; returns indices to retry."""
        t0 = time.monotonic()
        descs = self._master.call(rpc.GET, [keys[i] for i in todo], self._here, self._releases.take())
        # Each found key's descriptor is replaced by its ReadGrant, in place: the raw lists
        # are freed as the records are made, so a batch does not double the objects alive
        # (which would set off a garbage collection every call).
        promote = []  # (index, key, gen, size, ReplicaLoc) of values only on disk
        for j, (i, d) in enumerate(zip(todo, descs)):
            if d is None:
                results[i] = ObjectNotFoundError(f"{keys[i]!r} is not in the store")
                self._stats["misses"] += 1
            elif rpc.is_err(d):
                results[i] = rpc.to_exc(d)
                descs[j] = None
            else:
                descs[j] = g = wire.read_grant(d)
                reps = g.replicas
                if reps and reps[0].tier == PROMOTE:
                    promote.append((i, keys[i], g.gen, g.size, reps[0]))
        failed_promotions = self._promote_many(promote) if promote else {}
        self._stats["disk_reads"] += len(promote) - len(failed_promotions)
        reads = []  # (index, size, replicas, dst_addr, result, ttl, gen)
        mine = []
        for i, g in zip(todo, descs):
            if g is None:  # a miss or an error, recorded above
                continue
            if i in failed_promotions:
                results[i] = failed_promotions[i]
                continue
            size = g.size
            mine.append([keys[i], g.gen, g.lease])  # released once this round's copies are done
            if dsts is None:
                out, addr = new_bytes(size)
            else:
                addr, cap, _ = dsts[i]
                if cap < size:
                    results[i] = InvalidArgumentError(
                        f"buffer of {cap} bytes is smaller than the value of {keys[i]!r} ({size} bytes)")
                    continue
                out = size
            reads.append((i, size, g.replicas, addr, out, g.ttl, g.gen))
        retry = []
        pending = reads
        for rank in range(max((len(r[2]) for r in reads), default=0)):
            if not pending:
                break
            ops, idx = [], []
            for r in pending:
                if rank < len(r[2]) and r[1]:
                    rep = r[2][rank]
                    ops.append((rep.node_id, rep.offset, r[3], r[1], rep.incarnation))
                    idx.append(r)
            failed = self._read(ops)
            still = []
            n_read = n_bytes = 0
            for j, r in enumerate(idx):
                if j in failed and rank + 1 < len(r[2]):
                    still.append(r)
                elif j in failed:
                    results[r[0]] = failed[j]
                else:
                    results[r[0]] = r[4]
                    n_bytes += r[1]
                    n_read += 1
            self.moved += n_bytes
            self._stats["reads"] += n_read
            for r in pending:
                if r[1] == 0:
                    results[r[0]] = r[4]
            pending = still
        # Where the batch's last value read lives: a KV chain's next pages name it as their
        # parent, and their slab is asked for beside it (writes.Writer._parent_node). One
        # entry a batch: remembering every value read cost a batch GET more than its gain.
        for r in reversed(reads):
            if r[1] and not isinstance(results[r[0]], Exception):
                rep = r[2][0]
                self._locs.remember(keys[r[0]], r[1], r[6], rep.node_id, rep.offset, rep.incarnation, rep.placed)
                break
        if time.monotonic() - t0 > min((r[5] for r in reads), default=1e9):
            # The copy may have outlived the lease: the extents could belong to another
            # key by now. Never return such bytes.
            for r in reads:
                if last:
                    results[r[0]] = LeaseExpiredError(f"read of {keys[r[0]]!r} outlived its lease")
                else:
                    retry.append(r[0])
        self._releases.later_all(mine)
        for r in reads:
            res = results[r[0]]
            if isinstance(res, (NodeUnavailableError, TransferError)):
                # Every replica failed: a node died. A clean miss, never wrong bytes.
                results[r[0]] = ObjectNotFoundError(f"{keys[r[0]]!r} was lost with its store node ({res})")
        return retry

    def get_grouped(self, keys, buffers, groups: int, on_group) -> list:
        """``get_many`` into lists of buffers read group by group: each list is cut into
        ``groups`` equal slices, one lookup serves every key, then slice ``g`` of every key
        is read before slice ``g + 1``, and ``on_group(g, failed)`` is called as soon as it
        has landed (``failed``: indices of the keys whose slice ``g`` did not). A value must
        fill its buffers exactly. A replica that fails, or reads that outlive the lease,
        fail their key for the remaining groups (no fallback to another replica)."""
        results: list = [None] * len(keys)
        bad = key_errors(keys, self._max_key)
        slices: dict[int, list] = {}
        for i, b in enumerate(buffers):
            if i in bad:
                continue
            if not isinstance(b, list) or not b or len(b) % groups:
                bad[i] = InvalidArgumentError(
                    f"buffer {i} must be a list of buffers in {groups} equal groups, got "
                    f"{len(b) if isinstance(b, list) else type(b).__name__}")
                continue
            k = len(b) // groups
            try:
                slices[i] = [writable(b[g * k:(g + 1) * k], self._registered) for g in range(groups)]
            except InvalidArgumentError as e:
                bad[i] = e
        for i, e in bad.items():
            results[i] = e
        todo = sorted(slices)
        t0 = time.monotonic()
        descs = self._master.call(rpc.GET, [keys[i] for i in todo], self._here, self._releases.take()) if todo else []
        live, mine, promote = {}, [], []
        for i, d in zip(todo, descs):
            if d is None:
                results[i] = ObjectNotFoundError(f"{keys[i]!r} is not in the store")
                self._stats["misses"] += 1
                continue
            if rpc.is_err(d):
                results[i] = rpc.to_exc(d)
                continue
            g = wire.read_grant(d)
            mine.append([keys[i], g.gen, g.lease])
            total = sum(s[1] for s in slices[i])
            if g.size != total:
                results[i] = InvalidArgumentError(
                    f"value of {keys[i]!r} is {g.size} bytes, its buffers hold {total}")
            elif not g.replicas:
                results[i] = ObjectNotFoundError(f"{keys[i]!r} has no copy to read")
            else:
                live[i] = g
                if g.replicas[0].tier == PROMOTE:
                    promote.append((i, keys[i], g.gen, g.size, g.replicas[0]))
        if promote:
            failed_promotions = self._promote_many(promote)
            for i, e in failed_promotions.items():
                results[i] = e
                del live[i]
            self._stats["disk_reads"] += len(promote) - len(failed_promotions)
        ttl = min((g.ttl for g in live.values()), default=0.0)
        at = dict.fromkeys(live, 0)
        failed_keys = set(range(len(keys))) - set(live)
        try:
            for gi in range(groups):
                ops, owners = [], []
                for i, g in live.items():
                    addr, n, _ = slices[i][gi]
                    rep = g.replicas[0]
                    if n:
                        ops.append((rep.node_id, rep.offset + at[i], addr, n, rep.incarnation))
                        owners.append(i)
                    at[i] += n
                dead = {owners[j]: e for j, e in self._read(ops).items()}
                if live and time.monotonic() - t0 > ttl:  # bytes past the lease are never handed out
                    dead.update((i, LeaseExpiredError(f"read of {keys[i]!r} outlived its lease")) for i in live)
                for i, e in dead.items():
                    results[i] = e if isinstance(e, LeaseExpiredError) else ObjectNotFoundError(
                        f"{keys[i]!r} was lost with its store node ({e})")
                    live.pop(i, None)
                failed_keys |= set(dead)
                on_group(gi, set(failed_keys))
        finally:
            self._releases.later_all(mine)
        for i, g in live.items():
            results[i] = g.size
            self.moved += g.size
        self._stats["reads"] += len(live)
        return results

    def _promote_many(self, items) -> dict[int, Exception]:
        """Have the nodes holding disk copies read them into the DRAM extents the master
        reserved (one request per node, read in parallel there; the node tells the master).
        ``items`` are ``(index, key, gen, size, ReplicaLoc)``; returns errors by index."""
        by_node: dict[str, list] = {}
        for it in items:
            by_node.setdefault(it[4].node_id, []).append(it)
        errors: dict[int, Exception] = {}
        for node_id, its in by_node.items():
            req = [[key, gen, rep.offset, size] for _i, key, gen, size, rep in its]
            try:
                errs = rpc.unpack(self._nodes.on(node_id, its[0][4].incarnation, lambda node: self._engine.call(
                    node.peer, rpc.NODE_PROMOTE_RPC, rpc.pack(req), timeout_s=self._timeout)))
            except (NodeUnavailableError, TransferError) as e:
                for i, key, *_ in its:
                    errors[i] = ObjectNotFoundError(f"{key!r} was lost with its store node ({e})")
                continue
            for (i, key, *_), err in zip(its, errs):
                if err == InvalidArgumentError.__name__:
                    # the master no longer reserves that extent for it: another reader's
                    # promotion of the same value filled it first, or the value moved
                    # (a drain): a fresh lookup finds where it is now
                    errors[i] = OffloadPendingError(f"{key!r} is no longer promoted there; looked up again")
                elif err:
                    errors[i] = ObjectNotFoundError(f"{key!r}'s copy on disk is unreadable ({err}): a miss")
        return errors

    def _read(self, ops) -> dict[int, Exception]:
        """Read ``(node_id, offset, address, size, incarnation)`` ops; returns {op index:
        error} for those that failed."""
        if not ops:
            return {}
        try:
            self._engine.read([(self._nodes.get(nid, inc).region, off, addr, n)
                               for nid, off, addr, n, inc in ops], timeout_s=self._timeout)
            return {}
        except TRANSFER_ERRORS:
            pass
        failed: dict[int, Exception] = {}
        by_node: dict[tuple, list[int]] = {}
        for j, op in enumerate(ops):
            by_node.setdefault((op[0], op[4]), []).append(j)
        for (node_id, inc), idxs in by_node.items():
            try:
                self._nodes.on(node_id, inc, lambda node: self._engine.read(
                    [(node.region, ops[j][1], ops[j][2], ops[j][3]) for j in idxs], timeout_s=self._timeout))
            except TRANSFER_ERRORS as e:
                for j in idxs:
                    failed[j] = e
        return failed


def _confirms(g: wire.ReadGrant, loc: Loc) -> bool:
    """Whether the master's answer names the placement ``loc`` remembers: then that
    placement held the value from before an early read began until the lease."""
    return g.size == loc.size and g.gen == loc.gen and any(
        r.tier == "dram" and r.node_id == loc.node_id and r.offset == loc.offset
        and r.incarnation == loc.incarnation and r.placed == loc.placed for r in g.replicas)


class _Lookup:
    """The master's descriptor of one key, to be read the usual way."""
    __slots__ = ("desc",)

    def __init__(self, desc):
        self.desc = desc
