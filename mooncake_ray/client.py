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

This module is the API; how it works is in ``mooncake_ray/_private/client/``.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import ray

from mooncake_ray.config import StoreConfig
from mooncake_ray.errors import (
    InvalidArgumentError,
    MooncakeRayError,
    NotRegisteredError,
    ObjectNotFoundError,
)
from mooncake_ray._private import rpc
from mooncake_ray._private.auth import role_engine
from mooncake_ray._private.buffers import check_mapped, readable, writable
from mooncake_ray._private.checks import check_ttl
from mooncake_ray._private.client import gcpause
from mooncake_ray._private.client.args import Sized, check_key, key_errors, same_length
from mooncake_ray._private.client.locations import LocationCache
from mooncake_ray._private.client.nodes import NodeTable
from mooncake_ray._private.client.reads import Reader
from mooncake_ray._private.client.releases import Releases
from mooncake_ray._private.client.slabs import Slabs
from mooncake_ray._private.client.writes import Writer
from mooncake_ray._private.master_client import MasterChannel
from mooncake_ray._private.metrics import ClientMetrics

__all__ = ["Client"]


class Client:
    """Put and get values in the distributed store. Create it with
    ``mooncake_ray.start()`` or ``mooncake_ray.connect()``."""

    def __init__(self, config: StoreConfig, name: str = "client"):
        self.config = config
        t = config.transport
        self.engine = role_engine(config, name)
        self._master = MasterChannel(self.engine, config.namespace,
                                     config.client.master_retry_timeout_s, t.rpc_timeout_s)
        owner = uuid.uuid4().hex
        try:
            self._here = ray.get_runtime_context().get_node_id()
        except Exception:  # not inside a Ray worker/driver: no local preference
            self._here = None
        self._regions: dict[int, Any] = {}  # address -> (Region, keep-alive) of each registered buffer
        self._metrics = ClientMetrics()
        self.local_stats = {"reads": 0, "disk_reads": 0, "misses": 0, "early_reads": 0,
                            "early_reads_dropped": 0}
        """This client's own counts: values read, of which promoted from disk, misses; reads
        done while the lookup was in flight (location cache), and such reads whose bytes
        were dropped because the value had moved or gone."""
        self._locs = LocationCache()
        self._releases = Releases(self._master)
        self._slabs = Slabs(self._master, owner, self._here, config.master.put_slab_bytes)
        nodes = NodeTable(self.engine, self._master)
        self._writes = Writer(self.engine, self._master, nodes, self._slabs, self._locs,
                              config=config, owner=owner, here=self._here,
                              registered=self._inside_registered)
        self._reads = Reader(self.engine, self._master, nodes, self._locs, self._releases, self.local_stats,
                             config=config, here=self._here, registered=self._inside_registered)
        self._pool: ThreadPoolExecutor | None = None
        self._max_key = config.master.max_key_bytes
        self._closed = False

    # ================================================================ public API ==
    def put(self, key: str, value: Any, *, replicas: int | None = None) -> None:
        """Store ``value`` under a new ``key``. Returns None.

        Args:
            key: non-empty str, at most ``max_key_bytes`` UTF-8 bytes.
            value: bytes, bytearray, memoryview, numpy array or torch CPU tensor.
            replicas: copies on distinct store nodes (default: config ``master.replicas``).

        Raises:
            ObjectExistsError: the key is stored already (use ``upsert``); not retryable.
            InvalidArgumentError: bad key or value, a value larger than every pool, or
                ``replicas`` not an int from 1 to 64 (more than the store has nodes places
                one copy per node).
            NoCapacityError: no room even after eviction (retryable).
            MasterUnavailableError, TransferError: retryable; a retry is safe.
        """
        self._raise_first(self._timed("put", [key], lambda: self._writes.put_many([key], [value], replicas, False)))

    def upsert(self, key: str, value: Any, *, replicas: int | None = None) -> None:
        """Store ``value`` under ``key``, replacing any stored value. Readers see the old
        value until the new one is complete. Returns None; raises as ``put`` (never
        ObjectExistsError)."""
        self._raise_first(self._timed("put", [key], lambda: self._writes.put_many([key], [value], replicas, True)))

    def put_from(self, key: str, buffer: Any, size: int | None = None, *, replicas: int | None = None) -> None:
        """``put`` from a buffer (zero-copy if it was registered with ``register_buffer``);
        ``size`` stores only the first ``size`` bytes. Returns None.

        Raises:
            InvalidArgumentError: ``size`` outside the buffer, or a bad key or buffer.
            Otherwise as ``put``.
        """
        self._raise_first(self._timed("put", [key], lambda: self._writes.put_many(
            [key], [Sized(buffer, size)], replicas, False)))

    def get(self, key: str) -> bytes:
        """The value stored under ``key``, as bytes.

        Raises:
            ObjectNotFoundError: a miss (a ``KeyError``).
            InvalidArgumentError: a bad key.
            MasterUnavailableError, TransferError: retryable.
        """
        out = self._timed("get", [key], lambda: self._reads.get_one(key, None))
        if isinstance(out, BaseException):
            raise out
        return out

    def get_into(self, key: str, buffer: Any) -> int:
        """Read the value of ``key`` into ``buffer`` (zero-copy if registered); returns its
        size in bytes.

        Raises:
            ObjectNotFoundError: a miss.
            InvalidArgumentError: the buffer is smaller than the value (nothing is read), or
                a bad key or buffer.
            NotRegisteredError: ``buffer`` is a raw ``(address, length)`` outside every
                buffer registered with ``register_buffer``.
            MasterUnavailableError, TransferError: retryable.

        After any other error the buffer's content is unspecified (a read from a remembered
        location may have landed before the master said the value had moved or gone).
        """
        out = self._timed("get", [key], lambda: self._reads.get_one(key, buffer))
        if isinstance(out, BaseException):
            raise out
        return out

    def batch_put(self, keys: Sequence[str], values: Sequence[Any], *, replicas: int | None = None,
                  upsert: bool = False) -> list[MooncakeRayError | None]:
        """Put many values in one round of metadata calls. Returns, per key, ``None`` on
        success or the error (e.g. ObjectExistsError) for that key; a key that failed with a
        retryable error may be retried alone. ``upsert=True`` replaces stored values.

        Raises:
            InvalidArgumentError: ``keys`` and ``values`` differ in length, or ``replicas``
                is not a count of copies (a bad key or value is that key's entry).
            MasterUnavailableError: the master did not answer in time (retryable).
        """
        same_length(keys, values, "values")
        return self._timed("batch_put", keys, lambda: self._writes.put_many(keys, values, replicas, upsert))

    def batch_put_from(self, keys: Sequence[str], buffers: Sequence[Any], sizes: Sequence[int] | None = None,
                       *, replicas: int | None = None) -> list[MooncakeRayError | None]:
        """``batch_put`` from buffers (zero-copy from registered ones); ``sizes`` stores
        only the first ``sizes[i]`` bytes of each. Returns ``None`` or the error per key.

        Raises:
            InvalidArgumentError: the lists differ in length (a bad key or buffer is that
                key's entry).
            MasterUnavailableError: the master did not answer in time (retryable).
        """
        same_length(keys, buffers, "buffers")
        items = [Sized(b, None if sizes is None else sizes[i]) for i, b in enumerate(buffers)]
        return self._timed("batch_put", keys, lambda: self._writes.put_many(keys, items, replicas, False))

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None | InvalidArgumentError]:
        """Values of many keys, in order; ``None`` for a miss, and for a bad key its
        InvalidArgumentError (the other keys are read).

        Raises:
            MasterUnavailableError, TransferError: a failure other than a miss or a bad key
                (retryable).
        """
        out = self._timed("batch_get", keys, lambda: self._reads.get_many(keys, None))
        for v in out:
            if isinstance(v, BaseException) and not isinstance(v, (ObjectNotFoundError, InvalidArgumentError)):
                raise v
        return [None if isinstance(v, ObjectNotFoundError) else v for v in out]

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int | MooncakeRayError]:
        """Read many values into buffers; per key, the size read or the error
        (ObjectNotFoundError for a miss, InvalidArgumentError for a buffer too small).

        Raises:
            InvalidArgumentError: ``keys`` and ``buffers`` differ in length (a bad key or
                buffer is that key's entry; NotRegisteredError for a raw ``(address, length)``
                outside every registered buffer).
            MasterUnavailableError: the master did not answer in time (retryable).
        """
        same_length(keys, buffers, "buffers")
        return self._timed("batch_get", keys, lambda: self._reads.get_many(keys, buffers))

    def exists(self, key: str) -> bool:
        """Whether ``key`` is stored and complete (a put in flight is not). Safe to retry.

        Raises:
            InvalidArgumentError: a bad key.
            MasterUnavailableError: the master did not answer in time (retryable).
        """
        self._check_key(key)
        return self._master.call(rpc.EXISTS, [key])[0]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """``exists`` for many keys, in one call; a bool per key (False for a key that is
        not a valid key: it cannot be stored).

        Raises:
            MasterUnavailableError: the master did not answer in time (retryable).
        """
        keys = list(keys)
        bad = key_errors(keys, self._max_key)
        if not bad:
            return self._master.call(rpc.EXISTS, keys) if keys else []
        good = [i for i in range(len(keys)) if i not in bad]
        out = [False] * len(keys)
        if good:
            for i, e in zip(good, self._master.call(rpc.EXISTS, [keys[i] for i in good])):
                out[i] = e
        return out

    def remove(self, key: str, *, force: bool = False) -> bool:
        """Remove ``key``; False if it was not stored.

        Raises:
            ObjectLeasedError: a reader holds it and ``force`` is false (retryable).
            InvalidArgumentError: a bad key.
            MasterUnavailableError: the master did not answer in time (retryable).
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
            MasterUnavailableError: the master did not answer in time (retryable).
        """
        if not isinstance(prefix, str):
            raise InvalidArgumentError(f"prefix must be a str, got {type(prefix).__name__}")
        self._locs.forget_prefix(prefix)
        return self._master.call(rpc.REMOVE_PREFIX, prefix, force)

    def remove_all(self, *, force: bool = False) -> int:
        """Remove every key (leased ones only with ``force``); returns how many. Safe to
        retry.

        Raises:
            MasterUnavailableError: the master did not answer in time (retryable).
        """
        self._locs.clear()
        return self._master.call(rpc.REMOVE_PREFIX, "", force)

    def pin(self, key: str, *, hard: bool = False, ttl_s: float | None = None) -> None:
        """Soft pin (evicted last; expires after ``ttl_s`` or the configured soft-pin TTL)
        or hard pin (never evicted, until ``unpin``). Returns None. Safe to retry.

        Raises:
            ObjectNotFoundError: the key is not stored.
            InvalidArgumentError: a bad key, or ``ttl_s`` not a finite positive number of
                seconds (at most ten years).
        """
        self._check_key(key)
        if ttl_s is not None:
            ttl_s = check_ttl(ttl_s)
        self._raise_first(self._master.call(rpc.PIN, [[key, bool(hard), ttl_s]]))

    def unpin(self, key: str) -> None:
        """Remove a soft or hard pin; the value is evicted like any other from now on.
        Returns None.

        Raises:
            ObjectNotFoundError: the key is not stored.
            InvalidArgumentError: a bad key.
        """
        self._check_key(key)
        self._raise_first(self._master.call(rpc.UNPIN, [key]))

    def register_buffer(self, buffer: Any):
        """Register memory with the transport so puts from it and gets into it are
        zero-copy. Returns the registration; keep the buffer alive until
        ``unregister_buffer``.

        Raises:
            InvalidArgumentError: an empty buffer, or one that is not contiguous memory.
        """
        addr, n, keep = writable(buffer) if not isinstance(buffer, bytes) else readable(buffer)
        if n == 0:
            raise InvalidArgumentError("cannot register an empty buffer")
        if keep is None:  # a raw (address, length): it must be this process's memory
            check_mapped(addr, n)
        region = self.engine.register((addr, n))
        self._regions[addr] = (region, keep)
        return region

    def unregister_buffer(self, buffer: Any) -> None:
        """Undo ``register_buffer`` (given the buffer or the registration it returned).
        Returns None.

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
        node and tier), as a dict.

        Raises:
            ray.exceptions.GetTimeoutError: no answer within 30 s.
            ray.exceptions.RayActorError: the master actor is dead.
        """
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
        its transport engine. Idempotent; the store itself keeps running. Returns None;
        raises nothing of its own (a lost slab return or lease release expires on the
        master)."""
        if self._closed:
            return
        self._releases.close()
        self._slabs.close()
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for region, _ in self._regions.values():
            region.close()
        self._regions.clear()
        self.engine.close()

    def __enter__(self):
        """Returns the client itself; leaving the ``with`` block closes it."""
        return self

    def __exit__(self, *exc):
        """``close()``; returns None, so an exception from the block propagates."""
        self.close()

    # ================================================================ internals ==
    def _in_pool(self, fn, *args, **kwargs):
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="mooncake-client")
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def _timed(self, op: str, keys, fn):
        disk_reads = self.local_stats["disk_reads"]
        t0 = time.perf_counter()
        if len(keys) >= gcpause.BATCH_MIN:
            with gcpause.paused():
                out = fn()
        else:
            out = fn()
        dt = time.perf_counter() - t0
        moved = self._reads.moved + self._writes.moved
        self._reads.moved = self._writes.moved = 0
        # A call that promoted a value from the disk tier counts as a disk-tier read.
        tier = "disk" if self.local_stats["disk_reads"] != disk_reads else "dram"
        self._metrics.observe(op, dt, len(keys), moved, tier)
        return out

    @staticmethod
    def _raise_first(results) -> None:
        for r in results:
            if isinstance(r, BaseException):
                raise r
            if rpc.is_err(r):
                raise rpc.to_exc(r)

    def _inside_registered(self, addr: int, n: int) -> bool:
        return any(r.addr <= addr and addr + n <= r.addr + r.length for r, _ in list(self._regions.values()))

    def _check_key(self, key: Any) -> None:
        check_key(key, self._max_key)
