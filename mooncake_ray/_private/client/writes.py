"""The put paths. Single-replica values up to half a put slab take one master call: their
extents are carved from this client's slab, written, then committed (PUT_COMMIT, one
message for the whole batch). Larger or replicated values, and any the slab path could not
place, take two: PUT_START allocates, the bytes are written, PUT_END publishes (or
PUT_REVOKE frees what a failed write left)."""

from __future__ import annotations

from mooncake_ray.errors import (
    LeaseExpiredError,
    MasterUnavailableError,
    NoCapacityError,
    NodeUnavailableError,
    ObjectNotFoundError,
    OffloadPendingError,
    TransferError,
)
from mooncake_ray._private import rpc, wire
from mooncake_ray._private.checks import check_replicas
from mooncake_ray._private.client.args import key_errors, sources
from mooncake_ray._private.client.backoff import Backoff
from mooncake_ray._private.client.locations import Loc, _new
from mooncake_ray._private.client.nodes import TRANSFER_ERRORS
from mooncake_ray._private.master.allocator import extent_length

PUT_ATTEMPTS = 3  # rounds a key whose write failed (a node lost) is tried in
# Values from this size on have their CRC-32C taken in the client's copy (config
# client.checksum_in_copy): measured, puts of 1 and 4 MiB ran 1.23x and 1.29x as fast with
# it, puts of 64 and 256 KiB 0.97x and 0.98x, the client's CPU rising more than the store
# node's fell (docs/performance.md, "Where a put's CPU goes").
CHECKSUM_IN_COPY_MIN = 1 << 20
SLABS_PER_BATCH = 2  # a batch needing more slab room than this many slabs takes PUT_START / PUT_END


class _PutLost(MasterUnavailableError):
    """A two-call put whose pending allocation the master no longer has at PUT_END (a
    master restarted in between, or the put outlived ``put_timeout_s``): the put is made
    again; after PUT_ATTEMPTS rounds the caller gets it as the retryable
    MasterUnavailableError it is."""


class Writer:
    """A client's puts: writes the bytes into its slab or into extents the master
    allocates, then publishes them; remembers where each value landed in ``locs``."""

    def __init__(self, engine, master, nodes, slabs, locs, *, config, owner: str, here: str | None,
                 registered):
        self._engine = engine
        self._registered = registered  # (address, length) -> inside a buffer the client registered
        self._master = master
        self._nodes = nodes
        self._slabs = slabs
        self._locs = locs
        self._owner = owner
        self._here = here
        self._timeout = config.transport.transfer_timeout_s
        self._replicas = config.master.replicas
        self._max_key = config.master.max_key_bytes
        self._backpressure_s = config.client.backpressure_timeout_s
        self._checksums = config.client.checksum_in_copy
        self._beside = config.master.chain_eviction  # chained values go beside their parent
        self.moved = 0  # bytes written by the call being timed (metrics only)

    def put_many(self, keys, values, replicas, upsert, parents=None, hold_s=None) -> list:
        """Put each value; returns, per key, None or the error it got (a bad key or value
        is that key's InvalidArgumentError; the others are put). ``parents``: per key, the
        key of its parent in a KV chain, or "" / None (master/chains.py). ``hold_s``: the
        master soft-pins each value for that long in the call that publishes it (checked
        by the caller), so no eviction comes between the two.

        Raises:
            InvalidArgumentError: ``replicas`` is not a count of copies.
        """
        if replicas is not None:
            check_replicas(replicas)
        bad = key_errors(keys, self._max_key)
        srcs = sources(values, self._registered, bad)
        if parents is not None:
            parents = [p or "" for p in parents]
            if all(not p for p in parents):
                parents = None
        if not bad:
            return self._put_checked(keys, srcs, replicas, upsert, parents, hold_s)
        good = [i for i in range(len(keys)) if i not in bad]
        results: list = [bad.get(i) for i in range(len(keys))]
        if good:
            for i, r in zip(good, self._put_checked([keys[i] for i in good], [srcs[i] for i in good],
                                                    replicas, upsert,
                                                    None if parents is None else [parents[i] for i in good],
                                                    hold_s)):
                results[i] = r
        return results

    def _put_checked(self, keys, srcs, replicas, upsert, parents=None, hold_s=None) -> list:
        results: list = [None] * len(keys)
        todo = list(range(len(keys)))
        if self._slabs.slab_bytes and (replicas or self._replicas) == 1:
            todo = self._put_slabbed(keys, srcs, upsert, results, parents, hold_s)
        failures, backoff = 0, Backoff(self._backpressure_s)
        while todo:
            retry = self._put_round([keys[i] for i in todo], [srcs[i] for i in todo], replicas, upsert,
                                    None if parents is None else [parents[i] for i in todo], hold_s)
            nxt, transfer_failed = [], False
            for i, res in zip(todo, retry):
                results[i] = res
                if isinstance(res, (OffloadPendingError, NoCapacityError)) and not backoff.expired():
                    # DRAM frees up as offloads to disk complete and leases end: wait
                    nxt.append(i)
                elif isinstance(res, (NodeUnavailableError, TransferError, _PutLost)) and failures + 1 < PUT_ATTEMPTS:
                    nxt.append(i)
                    transfer_failed = True
            failures += transfer_failed
            todo = nxt
            if todo and not transfer_failed:
                backoff.sleep()
        return [MasterUnavailableError(f"{r} (put {PUT_ATTEMPTS} times)") if isinstance(r, _PutLost) else r
                for r in results]

    def _parent_node(self, idxs, parents) -> str | None:
        """The store node of the first parent these puts name that this client wrote or
        read lately (the location cache): its KV chain's children go beside it, so each
        node holds whole chains and evicts them from their leaves."""
        if parents is None or not self._beside:
            return None
        for i in idxs:
            p = parents[i]
            if p:
                loc = self._locs.get(p)
                return None if loc is None else loc.node_id
        return None

    def _put_slabbed(self, keys, srcs, upsert, results, parents=None, hold_s=None) -> list[int]:
        """Put what fits into this client's slab with one master call for all of them
        (carve, write, commit). Returns the indices left for the two-call path: values too
        large for a slab, no slab to be had, or a retryable failure here."""
        limit = self._slabs.slab_bytes // 2
        ext = {n: extent_length(n) for n in {s[1] for s in srcs}}  # a batch's values mostly share a size
        lengths = [ext[s[1]] for s in srcs]
        if not lengths:
            return []
        if max(lengths) <= limit:
            idxs, rest = list(range(len(lengths))), []
        else:
            idxs = [i for i, n in enumerate(lengths) if n <= limit]
            rest = [i for i, n in enumerate(lengths) if n > limit]
        if not idxs:
            return rest
        if sum(lengths[i] for i in idxs) > SLABS_PER_BATCH * self._slabs.slab_bytes:
            return list(range(len(srcs)))  # one slab grant per slab: two calls for all are fewer
        placed = self._slabs.carve([lengths[i] for i in idxs], self._parent_node(idxs, parents),
                                   parents is not None and self._beside)
        ops, owners, items = [], [], []
        for i, got in zip(idxs, placed):
            if got is None:
                rest.append(i)
                continue
            slab, off = got
            items.append((i, slab, off))
            if srcs[i][1]:
                ops.append((slab.node_id, off, srcs[i][0], srcs[i][1], slab.incarnation))
                owners.append(i)
        if not items:
            return sorted(rest)
        settled = [slab.slab_id for _, slab, _ in items]  # each put's slab, once committed or abandoned
        sums: dict[int, int] = {}
        want = self._checksums and max(lengths) >= CHECKSUM_IN_COPY_MIN
        failed = self._write(ops, owners, sums if want else None)
        if failed:  # the slab's node failed us: give the slab up, retry those the two-call way
            self._slabs.give_up({s.slab_id for i, s, _ in items if i in failed})
        # PUT_COMMIT items as lists in wire.Commit's field order (a Commit record costs 0.15 us a key more)
        if failed:
            items = [it for it in items if it[0] not in failed]
        commits = [(i, [keys[i], slab.slab_id, off, srcs[i][1], upsert]) for i, slab, off in items]
        if parents is not None or sums:  # the optional last fields: parent, then the checksum
            for i, c in commits:
                parent = parents[i] if parents is not None else ""
                crc = sums.get(i)
                if crc is not None:
                    c += (parent or "", crc)
                elif parent:
                    c.append(parent)
        rest.extend(failed)
        if not commits:
            self._slabs.settle(settled)
        else:
            returns = self._slabs.take_returns(settled)
            try:
                # a hold is Python's (the native commit declines a fifth argument)
                done = self._master.call(rpc.PUT_COMMIT, [c for _, c in commits], self._owner, returns,
                                         *(() if hold_s is None else (hold_s,)))
            except MasterUnavailableError as e:
                for i, _ in commits:
                    results[i] = e
                return sorted(rest)
            seen, moved = [], 0  # (key, Loc) of each value stored, for the location cache
            for (i, slab, off), r in zip(items, done):
                if type(r) is int:  # the value's gen (else an error entry)
                    n = srcs[i][1]
                    moved += n
                    seen.append((keys[i], _new(Loc, (n, r, slab.node_id, off, slab.incarnation, 0))))
                    continue
                exc = rpc.to_exc(r)
                if isinstance(exc, LeaseExpiredError):
                    rest.append(i)  # the slab died under us (master restart, node loss)
                else:
                    results[i] = exc
            self.moved += moved
            self._locs.remember_many(seen)
        return sorted(rest)

    def _put_round(self, keys, srcs, replicas, upsert, parents=None, hold_s=None) -> list:
        """One PUT_START, write, PUT_END round; returns None or the error per key."""
        reqs = [[k, s[1], replicas, upsert] for k, s in zip(keys, srcs)]
        if parents is not None:
            for r, p in zip(reqs, parents):
                if p:
                    r.append(p)
        allocs = self._master.call(rpc.PUT_START, reqs, self._here, self._owner)
        results: list = [None] * len(keys)
        ops, owners = [], []
        for i, a in enumerate(allocs):
            if rpc.is_err(a):
                results[i] = rpc.to_exc(a)
                continue
            allocs[i] = a = wire.put_alloc(a)  # in place: the raw lists are freed as we go
            addr, n, _ = srcs[i]
            for e in a.extents:
                if n:
                    ops.append((e.node_id, e.offset, addr, n, e.incarnation))
                    owners.append(i)
        sums: dict[int, int] = {}
        want = self._checksums and max((s[1] for s in srcs), default=0) >= CHECKSUM_IN_COPY_MIN
        failed = self._write(ops, owners, sums if want else None)
        ends, revokes = [], []
        for i, a in enumerate(allocs):
            if results[i] is not None:
                continue
            if i in failed:
                revokes.append([keys[i], a.gen])
                results[i] = failed[i]
            else:
                crc = sums.get(i)
                if hold_s is not None:
                    ends.append((i, [keys[i], a.gen, crc, hold_s]))
                else:
                    ends.append((i, [keys[i], a.gen] if crc is None else [keys[i], a.gen, crc]))
        if revokes:
            self._master.call(rpc.PUT_REVOKE, revokes)
        if ends:
            done = self._master.call(rpc.PUT_END, [e for _, e in ends])
            for (i, _), r in zip(ends, done):
                if rpc.is_err(r):
                    exc = rpc.to_exc(r)
                    # The master no longer has the pending put (it restarted since PUT_START,
                    # or put_timeout_s revoked it): nothing was published, so put it again.
                    results[i] = _PutLost(str(exc)) if isinstance(exc, ObjectNotFoundError) else exc
                else:
                    self.moved += srcs[i][1]
                    a = allocs[i]
                    if a.extents:
                        e = a.extents[0]
                        self._locs.remember(keys[i], srcs[i][1], a.gen, e.node_id, e.offset, e.incarnation, 0)
        return results

    def _write(self, ops, owners, sums: dict[int, int] | None = None) -> dict[int, Exception]:
        """Write every extent; ``ops`` are ``(node_id, offset, address, size, incarnation)``
        and ``owners[j]`` the item op ``j`` belongs to. Returns {item index: error} for items
        that failed. ``sums``: filled with {item index: CRC-32C} for the items whose bytes
        this process copied itself (``Engine.write_checksummed``; each item one op)."""
        if not ops:
            return {}
        failed: dict[int, Exception] = {}
        try:
            # one lookup per (node, incarnation), not per op
            regions = {k: self._nodes.get(*k).region for k in {(op[0], op[4]) for op in ops}}
            wire_ops = [(regions[(nid, inc)], off, addr, n) for nid, off, addr, n, inc in ops]
            if sums is None:
                self._engine.write(wire_ops, timeout_s=self._timeout)
                return failed
            for owner, crc in zip(owners, self._engine.write_checksummed(wire_ops, timeout_s=self._timeout)):
                if crc is not None:
                    sums[owner] = crc
            return failed
        except TRANSFER_ERRORS:
            pass  # find the culprit node(s) below
        by_node: dict[str, list[int]] = {}
        for j, (node_id, *_rest) in enumerate(ops):
            by_node.setdefault(node_id, []).append(j)
        for node_id, idxs in by_node.items():
            try:
                self._nodes.on(node_id, ops[idxs[0]][4], lambda node: self._engine.write(
                    [(node.region, ops[j][1], ops[j][2], ops[j][3]) for j in idxs], timeout_s=self._timeout))
            except TRANSFER_ERRORS as e:
                err = e if isinstance(e, (NodeUnavailableError, TransferError)) else NodeUnavailableError(str(e))
                for j in idxs:
                    failed[owners[j]] = err
        return failed
