"""The store client: what notebooks, engines and connectors use.

A client owns a transport engine but no arena (Mooncake's client-only mode,
``global_segment_size=0``). Metadata goes to the master over the transport RPC, batched;
bytes go straight between the caller's memory and the store nodes' arenas (a memcpy
through shared memory on the same host, UCX across hosts), never through the Ray object
store.

Puts of single-replica values up to half a put slab take one master call: the client
carves their extents from a slab of one node's DRAM it holds (see master/slabs.py) and
commits them after writing; larger or replicated values take put_start / put_end.

Reads are validated: a get's descriptors come with a read lease, and bytes are only
returned if the copy finished before the lease could have ended (measured from before
the request was sent), so extents reallocated to another key are never returned.

Thread-safe: calls may come from several threads; the async variants run the batch calls
on a small thread pool (the engine releases the GIL while it waits).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import ray

from mooncake_ray.config import StoreConfig
from mooncake_ray.errors import (
    InvalidArgumentError,
    LeaseExpiredError,
    MasterUnavailableError,
    NoCapacityError,
    MooncakeRayError,
    NodeUnavailableError,
    NotRegisteredError,
    ObjectNotFoundError,
    OffloadPendingError,
    TransferError,
)
from mooncake_ray._private import rpc
from mooncake_ray._private.buffers import new_bytes, readable, writable
from mooncake_ray._private.master.allocator import align_up
from mooncake_ray._private.master.tiering import PROMOTE
from mooncake_ray._private.master_client import MasterChannel
from mooncake_ray._private.metrics import ClientMetrics

log = logging.getLogger(__name__)

__all__ = ["Client"]

_PUT_ATTEMPTS = 3
_GET_ATTEMPTS = 3
_LOC_CACHE_KEYS = 1 << 16  # location cache entries (~150 bytes each)
_EARLY_MEMCPY_MIN = 64 << 10  # a mapped read shorter than this takes less than the async call costs


@dataclass
class _Slab:
    """A run of one node's DRAM this client carves extents from (see master/slabs.py)."""

    slab_id: int
    node_id: str
    incarnation: str
    cur: int  # next free offset
    end: int
    use_until: float  # monotonic; no write into the slab starts after this


@dataclass
class _Node:
    node_id: str
    incarnation: str
    peer: Any
    region: Any  # RemoteRegion of the node's arena


class Client:
    """Put and get values in the distributed store. Create it with
    ``mooncake_ray.start()`` or ``mooncake_ray.connect()``."""

    def __init__(self, config: StoreConfig, name: str = "client"):
        self.config = config
        t = config.transport
        from mooncake_ray._private.transport import Engine  # the native module: load on use

        self.engine = Engine(protocol=t.protocol, devices=t.devices, num_lanes=t.num_lanes,
                             ucx_options=t.ucx_options, read_mode=t.read_mode, name=name)
        self._master = MasterChannel(self.engine, config.namespace,
                                     config.client.master_retry_timeout_s, t.rpc_timeout_s)
        self._timeout = t.transfer_timeout_s
        self._owner = uuid.uuid4().hex
        try:
            self._here = ray.get_runtime_context().get_node_id()
        except Exception:  # not inside a Ray worker/driver: no local preference
            self._here = None
        self._nodes: dict[str, _Node] = {}
        self._nodes_lock = threading.Lock()
        self._regions: dict[int, Any] = {}
        self._metrics = ClientMetrics()
        self.local_stats = {"reads": 0, "disk_reads": 0, "misses": 0, "early_reads": 0,
                            "early_reads_dropped": 0}
        """This client's own counts: values read, of which promoted from disk, misses; reads
        done while the lookup was in flight (location cache), and such reads whose bytes
        were dropped because the value had moved or gone."""
        self._releases: list = []  # [key, gen, lease] of finished reads
        # Location cache: key -> (size, gen, node_id, offset, incarnation, placed) of values
        # this client wrote or read (see _get_one). Bounded; entries go stale harmlessly.
        # An OrderedDict, not a dict: evicting the oldest entry of a full dict with
        # next(iter(d)) walks the dead slots its earlier deletions left at the front
        # (measured 8.4 us per put at 65k entries, against 0.33 us with popitem here).
        self._locs: OrderedDict[str, tuple] = OrderedDict()
        self._early_max = config.client.early_read_max_bytes
        self._release_lock = threading.Lock()
        self._release_timer: threading.Timer | None = None
        self._moved = 0  # bytes moved by the call being timed (per thread is not needed: metrics only)
        self._pool: ThreadPoolExecutor | None = None
        self._max_key = config.master.max_key_bytes
        # Put slabs: one master call per put (single replica, up to half a slab).
        self._slab_max = config.master.put_slab_bytes
        self._slab: _Slab | None = None
        self._slab_lock = threading.Lock()
        self._slab_returns: list[int] = []
        self._slab_timer: threading.Timer | None = None
        self._closed = False

    # ================================================================ public API ==
    def put(self, key: str, value: Any, *, replicas: int | None = None) -> None:
        """Store ``value`` under a new ``key``.

        Args:
            key: non-empty str, at most ``max_key_bytes`` UTF-8 bytes.
            value: bytes, bytearray, memoryview, numpy array or torch CPU tensor.
            replicas: copies on distinct store nodes (default: config ``master.replicas``).

        Raises:
            ObjectExistsError: the key is stored already (use ``upsert``); not retryable.
            InvalidArgumentError: bad key or value, or a value larger than every pool.
            NoCapacityError: no room even after eviction (retryable).
            MasterUnavailableError, TransferError: retryable; a retry is safe.
        """
        self._raise_first(self._timed("put", [key], lambda: self._put_many([key], [value], replicas, False)))

    def upsert(self, key: str, value: Any, *, replicas: int | None = None) -> None:
        """Store ``value`` under ``key``, replacing any stored value. Readers see the old
        value until the new one is complete. Raises as ``put`` (never ObjectExistsError)."""
        self._raise_first(self._timed("put", [key], lambda: self._put_many([key], [value], replicas, True)))

    def put_from(self, key: str, buffer: Any, size: int | None = None, *, replicas: int | None = None) -> None:
        """``put`` from a buffer (zero-copy if it was registered with ``register_buffer``);
        ``size`` stores only the first ``size`` bytes.

        Raises:
            InvalidArgumentError: ``size`` outside the buffer, or a bad key or buffer.
            Otherwise as ``put``.
        """
        self._raise_first(self._timed("put", [key], lambda: self._put_many(
            [key], [_Sized(buffer, size)], replicas, False)))

    def get(self, key: str) -> bytes:
        """The value stored under ``key``, as bytes.

        Raises:
            ObjectNotFoundError: a miss (a ``KeyError``).
            MasterUnavailableError, TransferError: retryable.
        """
        out = self._timed("get", [key], lambda: self._get_one(key, None))
        if isinstance(out, BaseException):
            raise out
        return out

    def get_into(self, key: str, buffer: Any) -> int:
        """Read the value of ``key`` into ``buffer`` (zero-copy if registered); returns its
        size in bytes.

        Raises:
            ObjectNotFoundError: a miss.
            InvalidArgumentError: the buffer is smaller than the value (nothing is read).

        After any other error the buffer's content is unspecified (a read from a remembered
        location may have landed before the master said the value had moved or gone).
        """
        out = self._timed("get", [key], lambda: self._get_one(key, buffer))
        if isinstance(out, BaseException):
            raise out
        return out

    def batch_put(self, keys: Sequence[str], values: Sequence[Any], *, replicas: int | None = None,
                  upsert: bool = False) -> list[MooncakeRayError | None]:
        """Put many values in one round of metadata calls. Returns, per key, ``None`` on
        success or the error (e.g. ObjectExistsError) for that key; a key that failed with a
        retryable error may be retried alone. ``upsert=True`` replaces stored values.

        Raises:
            InvalidArgumentError: ``keys`` and ``values`` differ in length, or a bad key.
        """
        self._same_length(keys, values, "values")
        return self._timed("batch_put", keys, lambda: self._put_many(keys, values, replicas, upsert))

    def batch_put_from(self, keys: Sequence[str], buffers: Sequence[Any], sizes: Sequence[int] | None = None,
                       *, replicas: int | None = None) -> list[MooncakeRayError | None]:
        """``batch_put`` from buffers (zero-copy from registered ones); ``sizes`` stores
        only the first ``sizes[i]`` bytes of each. Returns ``None`` or the error per key.

        Raises:
            InvalidArgumentError: the lists differ in length, or a bad key.
        """
        self._same_length(keys, buffers, "buffers")
        items = [_Sized(b, None if sizes is None else sizes[i]) for i, b in enumerate(buffers)]
        return self._timed("batch_put", keys, lambda: self._put_many(keys, items, replicas, False))

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values of many keys, in order; ``None`` for a miss.

        Raises:
            MasterUnavailableError, TransferError: a failure other than a miss (retryable).
        """
        out = self._timed("batch_get", keys, lambda: self._get_many(keys, None))
        for v in out:
            if isinstance(v, BaseException) and not isinstance(v, ObjectNotFoundError):
                raise v
        return [None if isinstance(v, BaseException) else v for v in out]

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int | MooncakeRayError]:
        """Read many values into buffers; per key, the size read or the error
        (ObjectNotFoundError for a miss, InvalidArgumentError for a buffer too small).

        Raises:
            InvalidArgumentError: ``keys`` and ``buffers`` differ in length.
        """
        self._same_length(keys, buffers, "buffers")
        return self._timed("batch_get", keys, lambda: self._get_many(keys, buffers))

    def exists(self, key: str) -> bool:
        """Whether ``key`` is stored and complete (a put in flight is not). Safe to retry.

        Raises:
            InvalidArgumentError: a bad key.
            MasterUnavailableError: the master did not answer in time (retryable).
        """
        self._check_key(key)
        return self._master.call(rpc.EXISTS, [key])[0]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """``exists`` for many keys, in one call; a bool per key. Raises as ``exists``."""
        for k in keys:
            self._check_key(k)
        return self._master.call(rpc.EXISTS, list(keys)) if keys else []

    def remove(self, key: str, *, force: bool = False) -> bool:
        """Remove ``key``; False if it was not stored.

        Raises:
            ObjectLeasedError: a reader holds it and ``force`` is false (retryable).
        """
        self._check_key(key)
        self._locs.pop(key, None)
        res = self._master.call(rpc.REMOVE, [key], force)[0]
        if rpc.is_err(res):
            raise rpc.to_exc(res)
        return res

    def remove_prefix(self, prefix: str, *, force: bool = False) -> int:
        """Remove every key starting with ``prefix``; returns how many. Keys a reader
        holds a lease on stay unless ``force``. Safe to retry.

        Raises:
            InvalidArgumentError: ``prefix`` is not a str.
        """
        if not isinstance(prefix, str):
            raise InvalidArgumentError(f"prefix must be a str, got {type(prefix).__name__}")
        self._forget_prefix(prefix)
        return self._master.call(rpc.REMOVE_PREFIX, prefix, force)

    def remove_all(self, *, force: bool = False) -> int:
        """Remove every key (leased ones only with ``force``); returns how many."""
        self._locs.clear()
        return self._master.call(rpc.REMOVE_PREFIX, "", force)

    def pin(self, key: str, *, hard: bool = False, ttl_s: float | None = None) -> None:
        """Soft pin (evicted last; expires after ``ttl_s`` or the configured soft-pin TTL)
        or hard pin (never evicted, until ``unpin``). Safe to retry.

        Raises:
            ObjectNotFoundError: the key is not stored.
            InvalidArgumentError: a bad key.
        """
        self._check_key(key)
        self._raise_first(self._master.call(rpc.PIN, [[key, hard, ttl_s]]))

    def unpin(self, key: str) -> None:
        """Remove a soft or hard pin; the value is evicted like any other from now on.

        Raises:
            ObjectNotFoundError: the key is not stored.
        """
        self._check_key(key)
        self._raise_first(self._master.call(rpc.UNPIN, [key]))

    def register_buffer(self, buffer: Any):
        """Register memory with the transport so puts from it and gets into it are
        zero-copy. Returns the registration; keep the buffer alive until
        ``unregister_buffer``."""
        addr, n, keep = writable(buffer) if not isinstance(buffer, bytes) else readable(buffer)
        if n == 0:
            raise InvalidArgumentError("cannot register an empty buffer")
        region = self.engine.register((addr, n))
        self._regions[addr] = (region, keep)
        return region

    def unregister_buffer(self, buffer: Any) -> None:
        """Undo ``register_buffer`` (given the buffer or the registration it returned).

        Raises:
            NotRegisteredError: the buffer is not registered with this client.
        """
        addr = buffer.addr if hasattr(buffer, "rkey") else (
            writable(buffer)[0] if not isinstance(buffer, bytes) else readable(buffer)[0])
        entry = self._regions.pop(addr, None)
        if entry is None:
            raise NotRegisteredError(f"buffer at 0x{addr:x} is not registered")
        entry[0].close()

    def stats(self) -> dict:
        """The master's statistics (capacity, used, keys, hits, misses, evictions, per
        node and tier)."""
        return ray.get(self._master.handle().stats.remote(), timeout=30)

    # async variants of the batch calls: the same call on a small thread pool of this client
    async def batch_put_async(self, *args, **kwargs):
        """``batch_put`` without blocking the event loop; returns and raises as it does."""
        return await self._in_pool(self.batch_put, *args, **kwargs)

    async def batch_put_from_async(self, *args, **kwargs):
        """``batch_put_from`` without blocking the event loop; returns and raises as it does."""
        return await self._in_pool(self.batch_put_from, *args, **kwargs)

    async def batch_get_async(self, *args, **kwargs):
        """``batch_get`` without blocking the event loop; returns and raises as it does."""
        return await self._in_pool(self.batch_get, *args, **kwargs)

    async def batch_get_into_async(self, *args, **kwargs):
        """``batch_get_into`` without blocking the event loop; returns and raises as it does."""
        return await self._in_pool(self.batch_get_into, *args, **kwargs)

    async def batch_exists_async(self, *args, **kwargs):
        """``batch_exists`` without blocking the event loop; returns and raises as it does."""
        return await self._in_pool(self.batch_exists, *args, **kwargs)

    def close(self) -> None:
        """Return this client's put slab and read leases, unregister its buffers and close
        its transport engine. Idempotent; the store itself keeps running."""
        if self._closed:
            return
        self._flush_releases()
        self._return_slab(expired_only=False)
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for region, _ in self._regions.values():
            region.close()
        self._regions.clear()
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ================================================================ internals ==
    def _in_pool(self, fn, *args, **kwargs):
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="mooncake-client")
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def _timed(self, op: str, keys, fn):
        t0 = time.perf_counter()
        out = fn()
        self._metrics.observe(op, time.perf_counter() - t0, len(keys), self._moved)
        self._moved = 0
        return out

    @staticmethod
    def _raise_first(results) -> None:
        for r in results:
            if isinstance(r, BaseException):
                raise r
            if rpc.is_err(r):
                raise rpc.to_exc(r)

    @staticmethod
    def _same_length(keys, other, what: str) -> None:
        if len(keys) != len(other):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(other)} {what}")

    def _check_key(self, key: Any) -> None:
        if not isinstance(key, str):
            raise InvalidArgumentError(f"key must be a str, got {type(key).__name__}: {key!r:.80}")
        if not key:
            raise InvalidArgumentError("key must not be empty")
        if len(key) * 4 > self._max_key and len(key.encode()) > self._max_key:
            raise InvalidArgumentError(
                f"key of {len(key.encode())} bytes is longer than max_key_bytes={self._max_key}: {key[:64]!r}...")

    # ---------------------------------------------------------------- nodes ------
    def _node(self, node_id: str, inc: str | None = None, refresh: bool = False) -> _Node:
        """The cached view of a store node; refreshed from the master when it is missing
        or older than incarnation ``inc``.

        Raises:
            NodeUnavailableError: the node is not mounted, or not as incarnation ``inc``.
        """
        node = self._nodes.get(node_id)
        if node is not None and not refresh and (inc is None or node.incarnation == inc):
            return node
        with self._nodes_lock:
            infos = {n["node_id"]: n for n in self._master.call(rpc.NODES)}
            for nid, info in infos.items():
                cur = self._nodes.get(nid)
                if cur is not None and cur.incarnation == info["incarnation"]:
                    continue
                peer = self.engine.connect(info["address"])
                region = self.engine.import_remote(peer, info["rkey"], info["base"], info["capacity"])
                self._nodes[nid] = _Node(nid, info["incarnation"], peer, region)
            for nid in list(self._nodes):
                if nid not in infos:
                    del self._nodes[nid]
        node = self._nodes.get(node_id)
        if node is None:
            raise NodeUnavailableError(f"store node {node_id} is not mounted")
        if inc is not None and node.incarnation != inc:
            raise NodeUnavailableError(f"store node {node_id} restarted (incarnation {inc} is gone)")
        return node

    def _report(self, node_id: str) -> None:
        try:
            self._master.call(rpc.REPORT_UNREACHABLE, node_id)
        except MooncakeRayError:
            pass
        with self._nodes_lock:
            self._nodes.pop(node_id, None)

    # ----------------------------------------------------------------- puts ------
    def _put_many(self, keys, values, replicas, upsert) -> list:
        for k in keys:
            self._check_key(k)
        srcs = []
        for v in values:
            if isinstance(v, _Sized):
                addr, n, keep = readable(v.buf) if isinstance(v.buf, bytes) else writable(v.buf)
                if v.size is not None:
                    if not 0 <= v.size <= n:
                        raise InvalidArgumentError(f"size {v.size} is outside the buffer of {n} bytes")
                    n = v.size
            else:
                addr, n, keep = readable(v)
            srcs.append((addr, n, keep))
        results: list = [None] * len(keys)
        todo = list(range(len(keys)))
        if self._slab_max and (replicas or self.config.master.replicas) == 1:
            todo = self._put_slabbed(keys, srcs, upsert, results)
        failures, backoff = 0, _Backoff(self.config.client.backpressure_timeout_s)
        while todo:
            retry = self._put_round([keys[i] for i in todo], [srcs[i] for i in todo], replicas, upsert)
            nxt, transfer_failed = [], False
            for i, res in zip(todo, retry):
                results[i] = res
                if isinstance(res, OffloadPendingError) and not backoff.expired():
                    nxt.append(i)  # DRAM frees up as offloads to disk complete: wait
                elif isinstance(res, (NodeUnavailableError, TransferError)) and failures + 1 < _PUT_ATTEMPTS:
                    nxt.append(i)
                    transfer_failed = True
            failures += transfer_failed
            todo = nxt
            if todo and not transfer_failed:
                backoff.sleep()
        return results

    def _put_slabbed(self, keys, srcs, upsert, results) -> list[int]:
        """Put what fits into this client's slab with one master call for all of them
        (carve, write, commit). Returns the indices left for the two-call path: values too
        large for a slab, no slab to be had, or a retryable failure here."""
        limit = self._slab_max // 2
        lengths = [align_up(s[1]) for s in srcs]
        idxs = [i for i, n in enumerate(lengths) if n <= limit]
        rest = [i for i, n in enumerate(lengths) if n > limit]
        if not idxs:
            return rest
        placed = self._carve([lengths[i] for i in idxs])
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
        failed = self._write(ops, owners)
        if failed:  # the slab's node failed us: give the slab up, retry those the two-call way
            with self._slab_lock:
                bad = {s.slab_id for i, s, _ in items if i in failed}
                if self._slab is not None and self._slab.slab_id in bad:
                    self._slab = None
                self._slab_returns.extend(bad)
        commits = [(i, [keys[i], slab.slab_id, off, srcs[i][1], upsert]) for i, slab, off in items
                   if i not in failed]
        rest.extend(failed)
        if commits:
            with self._slab_lock:
                returns = self._take_slab_returns()
            try:
                done = self._master.call(rpc.PUT_COMMIT, [c for _, c in commits], self._owner, returns)
            except MasterUnavailableError as e:
                for i, _ in commits:
                    results[i] = e
                return sorted(rest)
            where = {i: (slab, off) for i, slab, off in items}
            for (i, _), r in zip(commits, done):
                if not rpc.is_err(r):
                    self._moved += srcs[i][1]
                    slab, off = where[i]
                    self._remember(keys[i], srcs[i][1], r, slab.node_id, off, slab.incarnation, 0)
                    continue
                exc = rpc.to_exc(r)
                if isinstance(exc, LeaseExpiredError):
                    rest.append(i)  # the slab died under us (master restart, node loss)
                else:
                    results[i] = exc
        return sorted(rest)

    def _carve(self, lengths: list[int]) -> list:
        """``(slab, offset)`` per length from this client's slab, asking the master for a
        new one when it runs out; ``None`` for lengths that got no room."""
        out: list = []
        with self._slab_lock:
            grants = 0
            for j, n in enumerate(lengths):
                s = self._slab
                if s is None or s.end - s.cur < n or time.monotonic() > s.use_until:
                    if grants >= 8 or not self._new_slab(min(sum(lengths[j:]), self._slab_max)):
                        out.extend([None] * (len(lengths) - j))
                        break
                    grants += 1
                    s = self._slab
                    if s.end - s.cur < n:
                        out.append(None)
                        continue
                out.append((s, s.cur))
                s.cur += n
        return out

    def _new_slab(self, need: int) -> bool:
        """Replace the current slab (lock held). False if the master has none to give."""
        if self._slab is not None:
            self._slab_returns.append(self._slab.slab_id)
            self._slab = None
        sent = time.monotonic()
        try:
            slab_id, node_id, off, length, inc, ttl = self._master.call(
                rpc.SLAB_GRANT, self._owner, self._here, need, self._take_slab_returns())
        except (NoCapacityError, MasterUnavailableError, InvalidArgumentError):
            return False
        # Writes start at most 3/4 of the ttl after the request left: the master's window
        # (counted from when it granted) ends later still.
        self._slab = _Slab(slab_id, node_id, inc, off, off + length, sent + 0.75 * ttl)
        if self._slab_timer is None or not self._slab_timer.is_alive():
            self._arm_slab_timer(ttl)
        return True

    def _arm_slab_timer(self, delay_s: float) -> None:
        self._slab_timer = threading.Timer(delay_s, self._return_slab)
        self._slab_timer.daemon = True
        self._slab_timer.start()

    def _take_slab_returns(self) -> list[int]:
        out, self._slab_returns = self._slab_returns, []
        return out

    def _return_slab(self, expired_only: bool = True) -> None:
        """Give back a slab this client can no longer write into (or every slab, on close),
        so its unused room is free at once rather than when the master expires it."""
        with self._slab_lock:
            s = self._slab
            if s is not None and (not expired_only or time.monotonic() > s.use_until):
                self._slab_returns.append(s.slab_id)
                self._slab = s = None
            ids = self._take_slab_returns()
            if s is not None and not self._closed:  # still in use: look again when it runs out
                self._arm_slab_timer(max(0.05, s.use_until - time.monotonic()))
        if ids and not self._closed:
            self._master.try_call(rpc.SLAB_RETURN, ids)  # if it is lost, the master expires them

    def _put_round(self, keys, srcs, replicas, upsert) -> list:
        reqs = [[k, s[1], replicas, upsert] for k, s in zip(keys, srcs)]
        allocs = self._master.call(rpc.PUT_START, reqs, self._here, self._owner)
        results: list = [None] * len(keys)
        ops, owners = [], []
        for i, a in enumerate(allocs):
            if rpc.is_err(a):
                results[i] = rpc.to_exc(a)
                continue
            _, extents = a
            addr, n, _ = srcs[i]
            for node_id, offset, _length, inc in extents:
                if n:
                    ops.append((node_id, offset, addr, n, inc))
                    owners.append(i)
        failed = self._write(ops, owners)
        ends, revokes = [], []
        for i, a in enumerate(allocs):
            if results[i] is not None:
                continue
            if i in failed:
                revokes.append([keys[i], a[0]])
                results[i] = failed[i]
            else:
                ends.append((i, [keys[i], a[0]]))
        if revokes:
            self._master.call(rpc.PUT_REVOKE, revokes)
        if ends:
            done = self._master.call(rpc.PUT_END, [e for _, e in ends])
            for (i, _), r in zip(ends, done):
                if rpc.is_err(r):
                    results[i] = rpc.to_exc(r)
                else:
                    self._moved += srcs[i][1]
                    gen, extents = allocs[i]
                    if extents:
                        node_id, offset, _length, inc = extents[0]
                        self._remember(keys[i], srcs[i][1], gen, node_id, offset, inc, 0)
        return results

    def _write(self, ops, owners) -> dict[int, Exception]:
        """Write every extent; returns {item index: error} for items that failed."""
        if not ops:
            return {}
        by_node: dict[str, list[int]] = {}
        for j, (node_id, *_rest) in enumerate(ops):
            by_node.setdefault(node_id, []).append(j)
        failed: dict[int, Exception] = {}
        try:
            self.engine.write([(self._node(nid, inc).region, off, addr, n) for nid, off, addr, n, inc in ops],
                              timeout_s=self._timeout)
            return failed
        except (NodeUnavailableError, TransferError, NotRegisteredError):
            pass  # find the culprit node(s) below
        for node_id, idxs in by_node.items():
            try:
                self._on_node(node_id, ops[idxs[0]][4], lambda node: self.engine.write(
                    [(node.region, ops[j][1], ops[j][2], ops[j][3]) for j in idxs], timeout_s=self._timeout))
            except (NodeUnavailableError, TransferError, NotRegisteredError) as e:
                err = e if isinstance(e, (NodeUnavailableError, TransferError)) else NodeUnavailableError(str(e))
                for j in idxs:
                    failed[owners[j]] = err
        return failed

    # ----------------------------------------------------------------- gets ------
    def _remember(self, key: str, size: int, gen: int, node_id: str, offset: int, inc: str,
                  placed: int) -> None:
        locs = self._locs
        locs[key] = (size, gen, node_id, offset, inc, placed)
        if len(locs) > _LOC_CACHE_KEYS:
            try:
                locs.popitem(last=False)  # the oldest entry (one C call: atomic under the GIL)
            except KeyError:
                pass  # another thread emptied it first

    def _forget_prefix(self, prefix: str) -> None:
        # Not needed for correctness (a stale location only costs a dropped read), but
        # removed keys should not cost one.
        for k in [k for k in list(self._locs) if k.startswith(prefix)]:
            self._locs.pop(k, None)

    def _get_one(self, key: str, buffer: Any):
        """A single get without the batch machinery (the hot path of small reads): one
        lookup, one read of the first replica. Anything unusual (a promotion from disk, a
        failed read, a lease outlived) takes the general path.

        A key whose location this client knows (it wrote or read the value) is read while
        the lookup is in flight, not after it: the bytes are kept only if the master's
        answer names that same placement (gen, node incarnation, offset, and ``placed``,
        which changes whenever a value's DRAM copy is made anew). That placement then held
        the value from before the read began until the lease was granted, so the bytes are
        the value's. Otherwise they are dropped and the value is read as usual."""
        self._check_key(key)
        dst = writable(buffer) if buffer is not None else None
        t0 = time.monotonic()
        args = ([key], self._here, self._take_releases())
        loc = self._locs.get(key)
        if loc is not None:
            node = self._nodes.get(loc[2])
            if node is None or node.incarnation != loc[4]:
                loc = None
            elif node.region.read_path == "memcpy":  # a copy in this thread: overlap only a long one
                loc = loc if loc[0] >= _EARLY_MEMCPY_MIN else None
            elif loc[0] > self._early_max:
                loc = None
        if loc is not None and (dst is None or dst[1] >= loc[0]):
            d = self._get_early(key, loc, node, buffer, dst, args, t0)
            if not isinstance(d, _Lookup):
                return d  # the value (or the careful path's answer)
            d = d.desc
        else:
            d = self._master.call(rpc.GET, *args)[0]
        if d is None:
            self.local_stats["misses"] += 1
            return ObjectNotFoundError(f"{key!r} is not in the store")
        if rpc.is_err(d):
            return rpc.to_exc(d)
        size, gen, ttl, reps, lease = d
        node_id, tier, offset, _length, inc = reps[0][:5]
        if tier != "dram":
            self._release_later([key, gen, lease])
            return self._get_many([key], None if buffer is None else [buffer])[0]
        if dst is None:
            out, addr = new_bytes(size)
        else:
            addr, cap, _ = dst
            if cap < size:
                self._release_later([key, gen, lease])
                return InvalidArgumentError(
                    f"buffer of {cap} bytes is smaller than the value of {key!r} ({size} bytes)")
            out = size
        try:
            if size:
                self.engine.read([(self._node(node_id, inc).region, offset, addr, size)], timeout_s=self._timeout)
            ok = time.monotonic() - t0 <= ttl
        except (NodeUnavailableError, TransferError, NotRegisteredError):
            ok = False
        self._release_later([key, gen, lease])
        if not ok:  # a node failed, or the lease may have ended: the careful path
            return self._get_many([key], None if buffer is None else [buffer])[0]
        self.local_stats["reads"] += 1
        self._moved += size
        self._remember(key, size, gen, node_id, offset, inc, reps[0][5])
        return out

    def _get_early(self, key: str, loc: tuple, node: _Node, buffer: Any, dst, args: tuple, t0: float):
        """``_get_one`` for a key with a known location: the lookup sent, the bytes read
        meanwhile. Returns the value (or the careful path's answer) when the master's
        answer confirms the placement; otherwise a ``_Lookup`` for the usual path."""
        size, gen, node_id, offset, inc, placed = loc
        started = self._master.start(rpc.GET, *args)
        if started is None:  # not connected: the usual path (it reconnects)
            return _Lookup(self._master.call(rpc.GET, *args)[0])
        if dst is None:
            out, addr = new_bytes(size)
        else:
            out, addr = size, dst[0]
        try:
            if size:
                self.engine.read([(node.region, offset, addr, size)], timeout_s=self._timeout)
            read_ok = True
        except (NodeUnavailableError, TransferError, NotRegisteredError):
            read_ok = False
        d = self._master.finish(started)[0]
        same = (read_ok and d is not None and not rpc.is_err(d) and d[0] == size and d[1] == gen
                and any(r[1] == "dram" and r[0] == node_id and r[2] == offset and r[4] == inc
                        and r[5] == placed for r in d[3]))
        if not same:
            self._locs.pop(key, None)
            self.local_stats["early_reads_dropped"] += 1
            return _Lookup(d)
        self._release_later([key, gen, d[4]])
        if time.monotonic() - t0 > d[2]:  # the lease may have ended: the careful path
            return self._get_many([key], None if buffer is None else [buffer])[0]
        self.local_stats["reads"] += 1
        self.local_stats["early_reads"] += 1
        self._moved += size
        return out

    def _get_many(self, keys, buffers) -> list:
        for k in keys:
            self._check_key(k)
        dsts = [writable(b) for b in buffers] if buffers is not None else None
        results: list = [None] * len(keys)
        todo = list(range(len(keys)))
        attempt, backoff = 0, _Backoff(self.config.client.backpressure_timeout_s)
        while todo:
            attempt += 1
            todo = self._get_round(keys, dsts, todo, results, last=attempt >= _GET_ATTEMPTS)
            waiting = [i for i, r in enumerate(results) if isinstance(r, OffloadPendingError)]
            if waiting and not backoff.expired():
                todo = sorted(set(todo) | set(waiting))
                backoff.sleep()
        return results

    def _get_round(self, keys, dsts, todo, results, last: bool) -> list[int]:
        """One lookup + read round for ``todo``; returns indices to retry."""
        t0 = time.monotonic()
        descs = self._master.call(rpc.GET, [keys[i] for i in todo], self._here, self._take_releases())
        promote = [(i, keys[i], d[1], d[0], d[3][0]) for i, d in zip(todo, descs)
                   if d is not None and not rpc.is_err(d) and d[3] and d[3][0][1] == PROMOTE]
        failed_promotions = self._promote_many(promote) if promote else {}
        self.local_stats["disk_reads"] += len(promote) - len(failed_promotions)
        reads = []  # (index, size, replicas, dst_addr, keep)
        mine = []
        for i, d in zip(todo, descs):
            if i in failed_promotions:
                results[i] = failed_promotions[i]
                continue
            if d is None:
                results[i] = ObjectNotFoundError(f"{keys[i]!r} is not in the store")
                self.local_stats["misses"] += 1
                continue
            if rpc.is_err(d):
                results[i] = rpc.to_exc(d)
                continue
            size, gen, ttl, reps, lease = d
            mine.append([keys[i], gen, lease])  # released once this round's copies are done
            if dsts is None:
                out, addr = new_bytes(size)
                reads.append((i, size, reps, addr, out, ttl))
            else:
                addr, cap, _ = dsts[i]
                if cap < size:
                    results[i] = InvalidArgumentError(
                        f"buffer of {cap} bytes is smaller than the value of {keys[i]!r} ({size} bytes)")
                    continue
                reads.append((i, size, reps, addr, size, ttl))
        retry = []
        pending = reads
        for rank in range(max((len(r[2]) for r in reads), default=0)):
            if not pending:
                break
            ops, idx = [], []
            for r in pending:
                if rank < len(r[2]) and r[1]:
                    node_id, _tier, offset, _ln, inc = r[2][rank][:5]
                    ops.append((node_id, offset, r[3], r[1], inc))
                    idx.append(r)
            failed = self._read(ops)
            still = []
            for j, r in enumerate(idx):
                if j in failed and rank + 1 < len(r[2]):
                    still.append(r)
                elif j in failed:
                    results[r[0]] = failed[j]
                else:
                    results[r[0]] = r[4]
                    self._moved += r[1]
                    self.local_stats["reads"] += 1
            for r in pending:
                if r[1] == 0:
                    results[r[0]] = r[4]
            pending = still
        if time.monotonic() - t0 > min((r[5] for r in reads), default=1e9):
            # The copy may have outlived the lease: the extents could belong to another
            # key by now. Never return such bytes.
            for r in reads:
                if last:
                    results[r[0]] = LeaseExpiredError(f"read of {keys[r[0]]!r} outlived its lease")
                else:
                    retry.append(r[0])
        with self._release_lock:
            self._releases.extend(mine)
        self._schedule_release_flush()
        for r in reads:
            res = results[r[0]]
            if isinstance(res, (NodeUnavailableError, TransferError)):
                # Every replica failed: a node died. A clean miss, never wrong bytes.
                results[r[0]] = ObjectNotFoundError(f"{keys[r[0]]!r} was lost with its store node ({res})")
        return retry

    # Read leases are released as soon as the copy is done, piggybacked on the next GET
    # (or flushed by a timer when no GET follows), so a lease lasts as long as the read,
    # not lease_ttl_s: otherwise a scan over more data than DRAM holds stalls on leases.
    def _take_releases(self) -> list:
        if not self._releases:
            return []
        with self._release_lock:
            out, self._releases = self._releases, []
        return out

    def _release_later(self, entry: list) -> None:
        with self._release_lock:
            self._releases.append(entry)
        self._schedule_release_flush()

    def _schedule_release_flush(self) -> None:
        if self._release_timer is None or not self._release_timer.is_alive():
            self._release_timer = threading.Timer(0.05, self._flush_releases)
            self._release_timer.daemon = True
            self._release_timer.start()

    def _flush_releases(self) -> None:
        done = self._take_releases()
        if done and not self._closed:
            try:
                self._master.call(rpc.RELEASE, done)
            except MooncakeRayError:
                pass  # the leases expire by themselves

    def _promote_many(self, items) -> dict[int, Exception]:
        """Have the nodes holding disk copies read them into the DRAM extents the master
        reserved (one request per node, read in parallel there), then tell the master.
        ``items`` are ``(index, key, gen, size, replica)``; returns errors by index."""
        by_node: dict[str, list] = {}
        for it in items:
            by_node.setdefault(it[4][0], []).append(it)
        errors: dict[int, Exception] = {}
        for node_id, its in by_node.items():
            req = [[key, gen, rep[2], size] for _i, key, gen, size, rep in its]
            try:
                errs = rpc.unpack(self._on_node(node_id, its[0][4][4], lambda node: self.engine.call(
                    node.peer, rpc.NODE_PROMOTE_RPC, rpc.pack(req), timeout_s=self._timeout)))
            except (NodeUnavailableError, TransferError) as e:
                for i, key, *_ in its:
                    errors[i] = ObjectNotFoundError(f"{key!r} was lost with its store node ({e})")
                continue
            self._master.call(rpc.PROMOTE_DONE, node_id, [r + [e] for r, e in zip(
                [[key, gen, off] for key, gen, off, _ in req], errs)])
            for (i, key, *_), err in zip(its, errs):
                if err:
                    errors[i] = ObjectNotFoundError(f"{key!r}'s copy on disk is unreadable ({err}): a miss")
        return errors

    def _read(self, ops) -> dict[int, Exception]:
        if not ops:
            return {}
        try:
            self.engine.read([(self._node(nid, inc).region, off, addr, n) for nid, off, addr, n, inc in ops],
                             timeout_s=self._timeout)
            return {}
        except (NodeUnavailableError, TransferError, NotRegisteredError):
            pass
        failed: dict[int, Exception] = {}
        by_node: dict[tuple, list[int]] = {}
        for j, op in enumerate(ops):
            by_node.setdefault((op[0], op[4]), []).append(j)
        for (node_id, inc), idxs in by_node.items():
            try:
                self._on_node(node_id, inc, lambda node: self.engine.read(
                    [(node.region, ops[j][1], ops[j][2], ops[j][3]) for j in idxs], timeout_s=self._timeout))
            except (NodeUnavailableError, TransferError, NotRegisteredError) as e:
                for j in idxs:
                    failed[j] = e
        return failed

    def _on_node(self, node_id: str, inc: str, fn):
        """``fn(node)`` on incarnation ``inc`` of a node (the one the master's descriptor
        names). A failure reports the node unreachable and raises; a descriptor naming
        an incarnation that is gone never touches the new one's arena, where its offsets
        may belong to other keys."""
        try:
            return fn(self._node(node_id, inc))
        except (NodeUnavailableError, TransferError, NotRegisteredError):
            self._report(node_id)
            raise


class _Backoff:
    """Sleeps growing from 0.2 ms to 20 ms, until ``limit_s`` has passed (an offload of a
    few MiB finishes in about a millisecond, so start short)."""

    def __init__(self, limit_s: float):
        self._deadline = time.monotonic() + limit_s
        self._delay = 0.0002

    def expired(self) -> bool:
        return time.monotonic() >= self._deadline

    def sleep(self) -> None:
        time.sleep(self._delay)
        self._delay = min(self._delay * 1.5, 0.02)


class _Lookup:
    """The master's descriptor of one key, to be read the usual way."""
    __slots__ = ("desc",)

    def __init__(self, desc):
        self.desc = desc


class _Sized:
    __slots__ = ("buf", "size")

    def __init__(self, buf, size):
        self.buf, self.size = buf, size
