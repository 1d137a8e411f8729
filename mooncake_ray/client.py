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

With ``master.shards`` > 1 each key belongs to one master shard (``_private/shards.py``):
a call goes to its key's shard, a batch is split by shard and the parts run at once, on
threads of this client (the engine releases the GIL while it waits), and a shard that is
down delays only its own keys.

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
from typing import Any, Callable, Sequence

import ray

from mooncake_ray.config import StoreConfig
from mooncake_ray.errors import (
    InvalidArgumentError,
    MasterUnavailableError,
    MooncakeRayError,
    NotRegisteredError,
    ObjectNotFoundError,
)
from mooncake_ray._private import rpc, shards
from mooncake_ray._private.auth import role_engine
from mooncake_ray._private.buffers import RangeSet, check_mapped, readable, writable
from mooncake_ray._private.device import describe as device_of
from mooncake_ray._private.checks import check_ttl
from mooncake_ray._private.client import gcpause
from mooncake_ray._private.client.args import Sized, check_key, key_errors, same_length
from mooncake_ray._private.client.locations import LocationCache
from mooncake_ray._private.client.nodes import NodeTable
from mooncake_ray._private.client.reads import Reader
from mooncake_ray._private.client.releases import Releases
from mooncake_ray._private.client.slabs import Slabs
from mooncake_ray._private.client.staged import DeviceIO
from mooncake_ray._private.client.writes import Writer
from mooncake_ray._private.master_client import MasterChannel
from mooncake_ray._private.metrics import ClientMetrics
from mooncake_ray._private.naming import master_name

__all__ = ["Client"]



class _InsideRegistered:
    """``registered(address, length)`` for a client's reads and writes: inside a buffer it
    registered. ``ranges`` (its RangeSet) lets a value's raw ranges be checked in one
    native call (``buffers.gathered``)."""

    __slots__ = ("_client",)

    def __init__(self, client):
        self._client = client

    def __call__(self, addr: int, n: int) -> bool:
        return self._client._inside_registered(addr, n)

    @property
    def ranges(self):
        return self._client._registered

class _Shard:
    """One master shard as this client sees it: its channel, the read leases to give
    back to it, the put slab it granted, and the put and get paths through it."""

    __slots__ = ("master", "releases", "slabs", "writes", "reads")

    def __init__(self, master: MasterChannel, releases: Releases, slabs: Slabs, writes: Writer, reads: Reader):
        self.master, self.releases, self.slabs, self.writes, self.reads = master, releases, slabs, writes, reads


class Client:
    """Put and get values in the distributed store. Create it with
    ``mooncake_ray.start()`` or ``mooncake_ray.connect()``."""

    def __init__(self, config: StoreConfig, name: str = "client"):
        self.config = config
        t = config.transport
        self.engine = role_engine(config, name)
        n = config.master.shards
        masters = [MasterChannel(self.engine, config.namespace, config.client.master_retry_timeout_s,
                                 t.rpc_timeout_s, name=master_name(i)) for i in range(n)]
        owner = uuid.uuid4().hex
        try:
            self._here = ray.get_runtime_context().get_node_id()
        except Exception:  # not inside a Ray worker/driver: no local preference
            self._here = None
        self._regions: dict[int, Any] = {}  # address -> (Region, keep-alive) of each registered buffer
        self._registered = RangeSet()  # the same buffers, found by any address inside them
        self._device = DeviceIO(self.engine, config.client.device_path, config.client.local_buffer_size_bytes)
        self._metrics = ClientMetrics()
        self.local_stats = {"reads": 0, "disk_reads": 0, "misses": 0, "early_reads": 0,
                            "early_reads_dropped": 0}
        """This client's own counts: values read, of which promoted from disk, misses; reads
        done while the lookup was in flight (location cache), and such reads whose bytes
        were dropped because the value had moved or gone."""
        self._locs = LocationCache()
        inside = _InsideRegistered(self)
        table = NodeTable(self.engine, masters[0], masters[1:])
        self._shards = []
        for i, master in enumerate(masters):
            nodes = table.via(master, masters[:i] + masters[i + 1:])
            releases = Releases(master)
            slabs = Slabs(master, owner, self._here, config.master.put_slab_bytes)
            self._shards.append(_Shard(
                master, releases, slabs,
                Writer(self.engine, master, nodes, slabs, self._locs, config=config, owner=owner, here=self._here,
                       registered=inside),
                Reader(self.engine, master, nodes, self._locs, releases, self.local_stats, config=config,
                       here=self._here, registered=inside)))
        # Shard 0's parts (the only shard of an unsharded store).
        first = self._shards[0]
        self._master, self._releases, self._slabs = first.master, first.releases, first.slabs
        self._writes, self._reads = first.writes, first.reads
        self._fanout: ThreadPoolExecutor | None = None  # runs a batch's parts on other shards
        self._pool: ThreadPoolExecutor | None = None
        self._max_key = config.master.max_key_bytes
        self._closed = False

    # ================================================================ public API ==
    def put(self, key: str, value: Any, *, replicas: int | None = None, parent: str | None = None) -> None:
        """Store ``value`` under a new ``key``. Returns None.

        Args:
            key: non-empty str, at most ``max_key_bytes`` UTF-8 bytes.
            value: bytes, bytearray, memoryview, numpy array or torch CPU tensor.
            replicas: copies on distinct store nodes (default: config ``master.replicas``).
            parent: the key this value follows in a KV chain (the previous page): with
                ``master.chain_eviction`` the parent is not evicted while this value is
                stored, and this value goes if its parent does (a lookup could not reach
                it), on any master shard.

        Raises:
            ObjectExistsError: the key is stored already (use ``upsert``); not retryable.
            InvalidArgumentError: bad key or value, a value larger than every pool, or
                ``replicas`` not an int from 1 to 64 (more than the store has nodes places
                one copy per node).
            NoCapacityError: no room even after eviction (retryable).
            MasterUnavailableError, TransferError: retryable; a retry is safe.
        """
        ps = self._parents([key], None if parent is None else [parent])
        if self._device.needed((value,)):
            return self._raise_first(self._put_routed([key], [value], None, replicas, False, None, ps))
        w = self._shard(key).writes
        self._raise_first(self._timed("put", [key], lambda: w.put_many([key], [value], replicas, False, ps)))

    def upsert(self, key: str, value: Any, *, replicas: int | None = None, parent: str | None = None) -> None:
        """Store ``value`` under ``key``, replacing any stored value. Readers see the old
        value until the new one is complete. Returns None; raises as ``put`` (never
        ObjectExistsError)."""
        ps = self._parents([key], None if parent is None else [parent])
        if self._device.needed((value,)):
            return self._raise_first(self._put_routed([key], [value], None, replicas, True, None, ps))
        w = self._shard(key).writes
        self._raise_first(self._timed("put", [key], lambda: w.put_many([key], [value], replicas, True, ps)))

    def put_from(self, key: str, buffer: Any, size: int | None = None, *, replicas: int | None = None,
                 after: Any = None, parent: str | None = None) -> None:
        """``put`` from a buffer (zero-copy if it was registered with ``register_buffer``);
        ``size`` stores only the first ``size`` bytes. Returns None.

        ``buffer`` may be device memory (a torch CUDA tensor, a cupy array, or a raw
        ``(address, length)`` inside registered device memory); its bytes are read once the
        work queued on ``after`` is done (a CUDA stream, a torch or cupy stream, or a marker
        from ``mooncake_ray.device_marker``; default: the device's current stream).

        Raises:
            InvalidArgumentError: ``size`` outside the buffer, or a bad key or buffer.
            Otherwise as ``put``.
        """
        ps = self._parents([key], None if parent is None else [parent])
        if self._device.needed((buffer,)):
            return self._raise_first(self._put_routed([key], [buffer], None if size is None else [size],
                                                      replicas, False, after, ps))
        w = self._shard(key).writes
        self._raise_first(self._timed("put", [key], lambda: w.put_many([key], [Sized(buffer, size)], replicas, False,
                                                                       ps)))

    def get(self, key: str) -> bytes:
        """The value stored under ``key``, as bytes.

        Raises:
            ObjectNotFoundError: a miss (a ``KeyError``).
            InvalidArgumentError: a bad key.
            MasterUnavailableError, TransferError: retryable.
        """
        r = self._shard(key).reads
        out = self._timed("get", [key], lambda: r.get_one(key, None))
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
        if self._device.needed((buffer,)):
            out = self._get_routed([key], [buffer])[0]
            if isinstance(out, BaseException):
                raise out
            return out
        r = self._shard(key).reads
        out = self._timed("get", [key], lambda: r.get_one(key, buffer))
        if isinstance(out, BaseException):
            raise out
        return out

    def batch_put(self, keys: Sequence[str], values: Sequence[Any], *, replicas: int | None = None,
                  upsert: bool = False, parents: Sequence[str | None] | None = None) -> list[MooncakeRayError | None]:
        """Put many values in one round of metadata calls. Returns, per key, ``None`` on
        success or the error (e.g. ObjectExistsError) for that key; a key that failed with a
        retryable error may be retried alone. ``upsert=True`` replaces stored values.
        ``parents``: per key, its parent in a KV chain or None (see ``put``); a chain's
        pages in order, first page first.

        Raises:
            InvalidArgumentError: ``keys`` and ``values`` differ in length, or ``replicas``
                is not a count of copies (a bad key or value is that key's entry).
            MasterUnavailableError: the master did not answer in time (retryable).
        """
        same_length(keys, values, "values")
        ps = self._parents(keys, parents)
        if self._device.needed(values):
            return self._put_routed(keys, values, None, replicas, upsert, None, ps)
        return self._timed("batch_put", keys, lambda: self._by_shard(
            keys, lambda sh, ks, idx: sh.writes.put_many(ks, [values[i] for i in idx], replicas, upsert,
                                                         _pick(ps, idx)),
            lambda sh: sh.writes.put_many(keys, values, replicas, upsert, ps)))

    def batch_put_from(self, keys: Sequence[str], buffers: Sequence[Any], sizes: Sequence[int] | None = None,
                       *, replicas: int | None = None, after: Any = None,
                       parents: Sequence[str | None] | None = None,
                       hold_s: float | None = None) -> list[MooncakeRayError | None]:
        """``batch_put`` from buffers (zero-copy from registered ones); ``sizes`` stores
        only the first ``sizes[i]`` bytes of each. Returns ``None`` or the error per key.
        Device memory and ``after`` as in ``put_from``.

        ``hold_s``: the values are read soon by another engine (a prefill's KV for its
        decode): each is soft-pinned for ``hold_s`` seconds by the master call that
        publishes it, so no eviction comes between the put and the hold, until the reader's
        ``batch_unpin`` (a soft pin yields only when nothing unpinned is left to evict).
        Such a call is served by the master's Python handler, not its native fast path.

        Raises:
            InvalidArgumentError: the lists differ in length, or ``hold_s`` is not a finite
                positive number of seconds (nothing is put); a bad key or buffer is that
                key's entry.
            MasterUnavailableError: the master did not answer in time (retryable).
        """
        same_length(keys, buffers, "buffers")
        if sizes is not None:
            same_length(keys, sizes, "sizes")
        if hold_s is not None:
            hold_s = check_ttl(hold_s, "hold_s")
        ps = self._parents(keys, parents)
        if self._device.needed(buffers):
            return self._put_routed(keys, buffers, sizes, replicas, False, after, ps, hold_s)
        return self._host_put_from(keys, buffers, sizes, replicas, False, ps, hold_s)

    def _host_put_from(self, keys, buffers, sizes, replicas, upsert, parents=None, hold_s=None) -> list:
        items = [Sized(b, None if sizes is None else sizes[i]) for i, b in enumerate(buffers)]
        return self._timed("batch_put", keys, lambda: self._by_shard(
            keys, lambda sh, ks, idx: sh.writes.put_many(ks, [items[i] for i in idx], replicas, upsert,
                                                         _pick(parents, idx), hold_s),
            lambda sh: sh.writes.put_many(keys, items, replicas, upsert, parents, hold_s)))

    def _parents(self, keys, parents) -> list[str] | None:
        """``parents`` checked and aligned with ``keys``. None: no parent named.

        Raises:
            InvalidArgumentError: not one parent per key, or a parent not a str or None.
        """
        if parents is None:
            return None
        same_length(keys, parents, "parents")
        out = []
        for k, p in zip(keys, parents):
            if p is None or p == "":
                out.append("")
                continue
            if not isinstance(p, str):
                raise InvalidArgumentError(f"parent of {k!r} must be a str key or None, got {type(p).__name__}")
            out.append(p)
        return out if any(out) else None

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None | InvalidArgumentError]:
        """Values of many keys, in order; ``None`` for a miss, and for a bad key its
        InvalidArgumentError (the other keys are read).

        Raises:
            MasterUnavailableError, TransferError: a failure other than a miss or a bad key
                (retryable).
        """
        out = self._timed("batch_get", keys, lambda: self._by_shard(
            keys, lambda sh, ks, idx: sh.reads.get_many(ks, None), lambda sh: sh.reads.get_many(keys, None)))
        for v in out:
            if isinstance(v, BaseException) and not isinstance(v, (ObjectNotFoundError, InvalidArgumentError)):
                raise v
        return [None if isinstance(v, ObjectNotFoundError) else v for v in out]

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any], *, groups: int = 1,
                       on_group: Callable[[int, set[int]], None] | None = None) -> list[int | MooncakeRayError]:
        """Read many values into buffers; per key, the size read or the error
        (ObjectNotFoundError for a miss, InvalidArgumentError for a buffer too small).

        ``groups`` > 1 reads values made of several buffers (each a list, cut into
        ``groups`` equal slices, e.g. one per model layer) slice by slice: one lookup for
        every key, slice 0 of every value, then slice 1, ...; ``on_group(g, failed)`` is
        called once slice ``g`` has landed, ``failed`` being the indices of keys whose
        slice ``g`` did not (misses included). Each value must fill its buffers exactly.
        (Device memory on the staged path, and a store with several master shards, read
        whole first and then call ``on_group`` for each slice.)

        Raises:
            InvalidArgumentError: ``keys`` and ``buffers`` differ in length (a bad key or
                buffer is that key's entry; NotRegisteredError for a raw ``(address, length)``
                outside every registered buffer).
            MasterUnavailableError: the master did not answer in time (retryable).
        """
        same_length(keys, buffers, "buffers")
        if groups != 1 or on_group is not None:
            if type(groups) is not int or groups < 1:
                raise InvalidArgumentError(f"groups must be a positive int, got {groups!r:.40}")
            return self._get_grouped(keys, buffers, groups, on_group or (lambda g, failed: None))
        if self._device.needed(buffers):
            return self._get_routed(keys, buffers)
        return self._host_get_into(keys, buffers)

    def _get_grouped(self, keys, buffers, groups: int, on_group) -> list:
        if len(self._shards) == 1 and not self._device.needed(buffers):
            return self._timed("batch_get", keys, lambda: self._reads.get_grouped(keys, buffers, groups, on_group))
        out = self._get_routed(keys, buffers) if self._device.needed(buffers) else self._host_get_into(keys, buffers)
        failed = {i for i, r in enumerate(out) if isinstance(r, BaseException)}
        for g in range(groups):
            on_group(g, set(failed))
        return out

    def _host_get_into(self, keys, buffers) -> list:
        return self._timed("batch_get", keys, lambda: self._by_shard(
            keys, lambda sh, ks, idx: sh.reads.get_many(ks, [buffers[i] for i in idx]),
            lambda sh: sh.reads.get_many(keys, buffers)))

    def exists(self, key: str) -> bool:
        """Whether ``key`` is stored and complete (a put in flight is not). Safe to retry.

        Raises:
            InvalidArgumentError: a bad key.
            MasterUnavailableError: the master did not answer in time (retryable).
        """
        self._check_key(key)
        return self._shard(key).master.call(rpc.EXISTS, [key])[0]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """``exists`` for many keys, in one call; a bool per key (False for a key that is
        not a valid key: it cannot be stored).

        Raises:
            MasterUnavailableError: the master did not answer in time (retryable).
        """
        keys = list(keys)
        bad = key_errors(keys, self._max_key)
        good = [i for i in range(len(keys)) if i not in bad] if bad else None
        if not keys or good == []:
            return [False] * len(keys)
        ask = keys if good is None else [keys[i] for i in good]
        found = self._by_shard(ask, lambda sh, ks, idx: sh.master.call(rpc.EXISTS, ks),
                               lambda sh: sh.master.call(rpc.EXISTS, ask), per_key_errors=False)
        if good is None:
            return found
        out = [False] * len(keys)
        for i, e in zip(good, found):
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
        sh = self._shard(key)
        sh.releases.flush()  # this client's own finished reads must not hold the key
        res = sh.master.call(rpc.REMOVE, [key], force)[0]
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
        return self._on_every_shard(lambda sh: (sh.releases.flush(), sh.master.call(rpc.REMOVE_PREFIX, prefix, force))[1])

    def remove_all(self, *, force: bool = False) -> int:
        """Remove every key (leased ones only with ``force``); returns how many. Safe to
        retry.

        Raises:
            MasterUnavailableError: the master did not answer in time (retryable).
        """
        self._locs.clear()
        return self._on_every_shard(lambda sh: (sh.releases.flush(), sh.master.call(rpc.REMOVE_PREFIX, "", force))[1])

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
        self._raise_first(self._shard(key).master.call(rpc.PIN, [[key, bool(hard), ttl_s]]))

    def unpin(self, key: str) -> None:
        """Remove a soft or hard pin; the value is evicted like any other from now on.
        Returns None.

        Raises:
            ObjectNotFoundError: the key is not stored.
            InvalidArgumentError: a bad key.
        """
        self._check_key(key)
        self._raise_first(self._shard(key).master.call(rpc.UNPIN, [key]))

    def batch_pin(self, keys: Sequence[str], *, hard: bool = False,
                  ttl_s: float | None = None) -> list[MooncakeRayError | None]:
        """``pin`` for many keys in one call per master shard. Returns, per key, None or
        its error (ObjectNotFoundError: not stored; InvalidArgumentError: a bad key).

        Raises:
            InvalidArgumentError: ``ttl_s`` not a finite positive number of seconds.
            MasterUnavailableError: no master shard answered (retryable).
        """
        if ttl_s is not None:
            ttl_s = check_ttl(ttl_s)
        return self._per_key_call(keys, lambda ks: [rpc.PIN, [[k, bool(hard), ttl_s] for k in ks]])

    def batch_unpin(self, keys: Sequence[str]) -> list[MooncakeRayError | None]:
        """``unpin`` for many keys in one call per master shard (what a reader calls once
        it has read values put with ``hold_s``). Returns, per key, None or its error
        (ObjectNotFoundError: not stored; InvalidArgumentError: a bad key).

        Raises:
            MasterUnavailableError: no master shard answered (retryable).
        """
        return self._per_key_call(keys, lambda ks: [rpc.UNPIN, ks])

    def _per_key_call(self, keys: Sequence[str], request) -> list:
        """A master call answering per key (``request(keys)``: the op and its argument),
        split by shard; bad keys are their InvalidArgumentError without a call."""
        keys = list(keys)
        bad = key_errors(keys, self._max_key)
        out: list = [bad.get(i) for i in range(len(keys))]
        good = [i for i in range(len(keys)) if i not in bad]
        if not good:
            return out
        ask = [keys[i] for i in good]
        got = self._by_shard(ask, lambda sh, ks, idx: sh.master.call(*request(ks)),
                             lambda sh: sh.master.call(*request(ask)))
        for i, r in zip(good, got):
            out[i] = rpc.to_exc(r) if rpc.is_err(r) else (r if isinstance(r, BaseException) else None)
        return out

    def register_buffer(self, buffer: Any):
        """Register memory with the transport so puts from it and gets into it are
        zero-copy. Returns the registration; keep the buffer alive until
        ``unregister_buffer``.

        Device memory (a torch CUDA tensor, a cupy array, anything with
        ``__cuda_array_interface__`` or a DLPack CUDA tensor) is registered on the path
        ``client.device_path`` picks: ``direct`` (UCX registers it) where the engine's UCX
        can register CUDA memory (``memory_types``), else ``staged`` (through a pinned
        host buffer); the answer's ``path`` says which. Forcing ``staged`` stages host
        memory registered from then on too.

        Raises:
            InvalidArgumentError: an empty buffer, or one that is not contiguous memory.
            ConfigError: ``device_path='direct'`` where UCX cannot register CUDA memory.
        """
        if isinstance(buffer, list):
            raise InvalidArgumentError("register_buffer takes one buffer: register each buffer of the list")
        reg = self._device.register(buffer)
        if reg is not None:
            return reg
        addr, n, keep = writable(buffer) if not isinstance(buffer, bytes) else readable(buffer)
        if n == 0:
            raise InvalidArgumentError("cannot register an empty buffer")
        if keep is None:  # a raw (address, length): it must be this process's memory
            check_mapped(addr, n)
        region = self.engine.register((addr, n))
        old = self._regions.get(addr)
        if old is not None:
            self._registered.remove(old)
        self._regions[addr] = entry = (region, keep)
        self._registered.add(addr, n, entry)
        return region

    def unregister_buffer(self, buffer: Any) -> None:
        """Undo ``register_buffer`` (given the buffer or the registration it returned).
        Returns None.

        Raises:
            NotRegisteredError: the buffer is not registered with this client.
        """
        mem = None if hasattr(buffer, "rkey") else device_of(buffer)
        addr = buffer.addr if hasattr(buffer, "rkey") else mem.addr if mem is not None else (
            writable(buffer)[0] if not isinstance(buffer, bytes) else readable(buffer)[0])
        if self._device.unregister(addr):
            return
        entry = self._regions.pop(addr, None)
        if entry is None:
            raise NotRegisteredError(f"buffer at 0x{addr:x} is not registered")
        self._registered.remove(entry)
        entry[0].close()

    def stats(self) -> dict:
        """The master's statistics (capacity, used, keys, hits, misses, evictions, per
        node and tier), as a dict; with several master shards, summed over them
        (``master_shards``; each shard's own under ``shards``, a shard that did not answer
        as ``{"error": ...}``, and ``recovering`` is then true).

        Raises:
            ray.exceptions.GetTimeoutError: no answer within 30 s (one master shard).
            ray.exceptions.RayActorError: the master actor is dead (one master shard).
        """
        if len(self._shards) == 1:
            return shards.merge_stats([ray.get(self._master.handle().stats.remote(), timeout=30)])
        parts = []
        for i, sh in enumerate(self._shards):
            try:
                parts.append(ray.get(sh.master.handle().stats.remote(), timeout=30))
            except (ray.exceptions.RayError, ValueError) as e:
                parts.append({"error": f"master shard {i}: {type(e).__name__}: {e}"})
        return shards.merge_stats(parts)

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
        for sh in self._shards:
            sh.releases.close()
            sh.slabs.close()
        self._closed = True
        for pool in (self._pool, self._fanout):
            if pool is not None:
                pool.shutdown(wait=True)
        for region, _ in self._regions.values():
            region.close()
        self._regions.clear()
        self._registered = RangeSet()
        self._device.close()
        self.engine.close()

    def __enter__(self):
        """Returns the client itself; leaving the ``with`` block closes it."""
        return self

    def __exit__(self, *exc):
        """``close()``; returns None, so an exception from the block propagates."""
        self.close()

    # ================================================================ internals ==
    def _shard(self, key) -> "_Shard":
        """The master shard that owns ``key`` (shard 0 for a key that is not a str: its
        checks raise there)."""
        if len(self._shards) == 1 or not isinstance(key, str):
            return self._shards[0]
        return self._shards[shards.shard_of(key, len(self._shards))]

    def _by_shard(self, keys, part, whole, per_key_errors: bool = True) -> list:
        """A batch call split by master shard: ``part(shard, keys, indices)`` for each
        shard's keys, at once (all but one on this client's fan-out threads), joined back
        in the order of ``keys``; ``whole(shard)`` when one shard owns them all.

        A shard that does not answer (``MasterUnavailableError``) fails only its own
        keys: with ``per_key_errors`` each gets that error as its entry, unless no shard
        answered, which raises it (as without shards)."""
        n = len(self._shards)
        if n == 1:
            return whole(self._shards[0])
        groups = shards.split([k if isinstance(k, str) else "" for k in keys], n)
        busy = [(self._shards[s], idx) for s, idx in enumerate(groups) if idx]
        if len(busy) == 1:
            return whole(busy[0][0])
        if self._fanout is None:
            self._fanout = ThreadPoolExecutor(max_workers=n - 1, thread_name_prefix="mooncake-shard")
        futures = [self._fanout.submit(part, sh, [keys[i] for i in idx], idx) for sh, idx in busy[1:]]
        out: list = [None] * len(keys)
        down: list[MasterUnavailableError] = []
        for j, (sh, idx) in enumerate(busy):
            try:
                got = part(sh, [keys[i] for i in idx], idx) if j == 0 else futures[j - 1].result()
            except MasterUnavailableError as e:
                down.append(e)
                got = [e] * len(idx)
            for i, r in zip(idx, got):
                out[i] = r
        if down and (not per_key_errors or len(down) == len(busy)):
            raise down[0]
        return out

    def _on_every_shard(self, fn) -> int:
        """``fn(shard)`` on every master shard at once; the sum of what they return."""
        if len(self._shards) == 1:
            return fn(self._shards[0])
        if self._fanout is None:
            self._fanout = ThreadPoolExecutor(max_workers=len(self._shards) - 1, thread_name_prefix="mooncake-shard")
        futures = [self._fanout.submit(fn, sh) for sh in self._shards[1:]]
        total = fn(self._shards[0])
        return total + sum(f.result() for f in futures)

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
        moved = 0
        for sh in self._shards:
            moved += sh.reads.moved + sh.writes.moved
            sh.reads.moved = sh.writes.moved = 0
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
        return self._registered.find(addr, n) is not None or self._device.registered(addr, n)

    def _put_routed(self, keys, bufs, sizes, replicas, upsert, after, parents=None, hold_s=None) -> list:
        of = None if parents is None else dict(zip(keys, parents))
        return self._device.put_routed(keys, bufs, sizes, after, lambda ks, bs, sz: self._host_put_from(
            ks, bs, sz, replicas, upsert, None if of is None else [of.get(k, "") for k in ks], hold_s))

    def _get_routed(self, keys, bufs) -> list:
        return self._device.get_routed(keys, bufs, self._host_get_into)

    @property
    def memory_types(self) -> list[str]:
        """The memory types this client's transport registers (``host``; ``cuda`` where
        UCX has CUDA transports and a GPU): device memory of another type is staged."""
        return list(self._device.memory_types)

    @property
    def master_calls(self) -> int:
        """Calls this client has sent to the master (all shards; a call retried across a
        master restart counts once)."""
        return sum(sh.master.calls for sh in self._shards)

    @property
    def device_stats(self) -> dict:
        """This client's device-memory counts: registrations per path, values and bytes
        moved through the staging buffer."""
        return dict(self._device.stats)

    def _check_key(self, key: Any) -> None:
        check_key(key, self._max_key)


def _pick(parents, idx):
    return None if parents is None else [parents[i] for i in idx]
