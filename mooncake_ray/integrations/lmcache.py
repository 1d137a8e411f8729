"""LMCache on the store: a remote storage plugin (LMCache's ``RemoteConnector``).

LMCache 0.5 loads a third-party remote connector when its name is listed in
``remote_storage_plugins`` and ``extra_config`` names the module and class to import under
``remote_storage_plugin.<name>.``; the plugin's own settings sit under the same prefix::

    chunk_size: 256
    local_cpu: true
    max_local_cpu_size: 5
    remote_storage_plugins: ["mooncake_ray"]
    extra_config:
      remote_storage_plugin.mooncake_ray.module_path: mooncake_ray.integrations.lmcache
      remote_storage_plugin.mooncake_ray.class_name: MooncakeRayConnectorAdapter
      remote_storage_plugin.mooncake_ray.namespace: mooncake_ray   # MooncakeRayLMCacheConfig
      save_chunk_meta: false          # LMCache's own key: chunks without a header, zero-copy

The plugin's name is ``mooncake_ray`` or ``mooncake_ray.<instance>`` (LMCache matches
adapters by the part before the dot). ``remote_url`` stays unset: LMCache builds the
backend's ``plugin://mooncake_ray`` address itself, and a ``remote_url`` would add a
second backend onto the same store.

Keys: ``<key_prefix><layout>/<CacheEngineKey.to_string()>``, e.g.
``lmcache/r/Qwen3-0.6B@1@0@3fa2...@bfloat16``. The layout letter keeps engines that
disagree on ``save_chunk_meta`` from reading each other's values as their own:

- ``r`` (``save_chunk_meta: false``): the chunk's bytes only. A put reads them straight
  from the MemoryObj's buffer, a get writes them straight into a MemoryObj of the engine's
  full-chunk shape, both zero-copy once LMCache's CPU buffer is registered with the store
  client (``register_cpu_buffer``). A shorter value is a partial chunk: its token count
  follows from its size. Needs ``remote_serde: naive`` (other serdes change the shape);
  LMCache's layerwise mode always writes the header.
- ``m`` (LMCache's default): LMCache's ``RemoteMetadata`` header (length, memory format,
  dtype and shape of each group) and then the bytes, as LMCache's own remote connectors
  lay them out. Any serde; a put copies header and bytes into one staging buffer, a get
  copies the bytes out of the value into a MemoryObj allocated from the header.

Failures. Every store call is bounded: by ``store_wait_s`` for the master (restarting or
gone) and by the store's transfer timeout for bytes. The connector raises the store's
typed errors (``MasterUnavailableError``, ``TransferError``, ...); LMCache's remote
backend turns them into misses (a get returns nothing, a lookup 0 hits) and counts
failed puts. A key another engine stored already counts as stored. A get that finds no
room in LMCache's CPU buffer is a miss rather than a wait.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mooncake_ray.config import _explain
from mooncake_ray.errors import (
    ConfigError,
    MooncakeRayError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectPendingError,
)
from mooncake_ray.integrations import _store

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.exceptions import IrrecoverableException
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.connector import (
    ConnectorAdapter,
    ConnectorContext,
    extract_plugin_type,
)
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

log = logging.getLogger(__name__)

__all__ = [
    "PLUGIN_TYPE",
    "MooncakeRayConnectorAdapter",
    "MooncakeRayLMCacheConfig",
    "MooncakeRayRemoteConnector",
    "PluginConfigError",
    "parse_config",
]

PLUGIN_TYPE = "mooncake_ray"
"""The name (or the part before the dot of the name) under ``remote_storage_plugins``."""

_SCHEME = "plugin://"
_LOADER_KEYS = frozenset({"module_path", "class_name"})  # read by LMCache's loader, not by us


class PluginConfigError(ConfigError, IrrecoverableException):
    """A bad plugin configuration. Also LMCache's IrrecoverableException, so its remote
    backend reports it once instead of retrying the same configuration every few seconds."""


class MooncakeRayLMCacheConfig(BaseModel):
    """The plugin's keys in LMCache's ``extra_config``, each written
    ``remote_storage_plugin.<plugin name>.<field>``. Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")

    namespace: str = "mooncake_ray"
    """Ray namespace of the store (``StoreConfig.namespace``)."""
    ray_address: str | None = None
    """Ray cluster to join when the process is not in one already: ``host:port`` of its GCS,
    or ``auto``. Default: ``RAY_ADDRESS``, then ``auto``."""
    key_prefix: str = "lmcache/"
    """Prepended to every key. Engines share chunks only under the same prefix."""
    store_wait_s: float = Field(5.0, gt=0)
    """How long one store call may wait for a restarting master, or for room, before it
    fails. Keep it below LMCache's ``blocking_timeout_secs`` (10 s by default)."""
    connect_timeout_s: float = Field(10.0, gt=0)
    """How long joining the Ray cluster may take when the connector is created."""
    register_cpu_buffer: bool = True
    """Register LMCache's CPU buffer with the store client, making puts and gets
    zero-copy; without it each value is copied through the transport's own buffers."""


def parse_config(extra: Mapping[str, Any] | None, plugin_name: str,
                 plugin_names: Iterable[str] = ()) -> MooncakeRayLMCacheConfig:
    """The plugin's configuration from LMCache's ``extra_config``: the keys under
    ``remote_storage_plugin.<plugin_name>.``, less the loader's ``module_path`` and
    ``class_name`` and the keys of other plugins whose names extend ``plugin_name``
    (``plugin_names``: everything in ``remote_storage_plugins``).

    Raises:
        PluginConfigError: naming each unknown key, or bad value and what is allowed.
    """
    prefix = f"remote_storage_plugin.{plugin_name}."
    others = [n for n in plugin_names if n != plugin_name and n.startswith(plugin_name + ".")]
    ours = {}
    for key, value in (extra or {}).items():
        if not isinstance(key, str) or not key.startswith(prefix):
            continue
        field = key[len(prefix):]
        if field in _LOADER_KEYS or any(f"{plugin_name}.{field}".startswith(o + ".") for o in others):
            continue
        ours[field] = value
    try:
        return MooncakeRayLMCacheConfig.model_validate(ours)
    except ValidationError as e:
        raise PluginConfigError(f"LMCache extra_config under {prefix!r}: {_explain(e)}") from None


# ------------------------------------------------------------- buffer registry ----
# One registration per (client, buffer address): several connectors of one process can
# share both the store client (one per namespace) and LMCache's CPU buffer.
_registered: dict[tuple[int, int], list] = {}  # -> [registration, users]
_registered_lock = threading.Lock()


def _cpu_buffer(local_cpu_backend) -> Any:
    """LMCache's CPU buffer that MemoryObjs are carved from, if it is one torch CPU tensor."""
    buf = getattr(getattr(local_cpu_backend, "memory_allocator", None), "buffer", None)
    if buf is None or not hasattr(buf, "data_ptr") or getattr(buf.device, "type", None) != "cpu":
        return None
    return buf


def _register(client, buf) -> tuple[int, int] | None:
    ident = (id(client), buf.data_ptr())
    with _registered_lock:
        entry = _registered.get(ident)
        if entry is None:
            try:
                entry = _registered[ident] = [client.register_buffer(buf), 0]
            except MooncakeRayError as e:
                log.warning("LMCache CPU buffer not registered (%s): values are copied", e)
                return None
        entry[1] += 1
    return ident


def _unregister(client, ident: tuple[int, int]) -> None:
    with _registered_lock:
        entry = _registered.get(ident)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _registered[ident]
    try:
        client.unregister_buffer(entry[0])
    except MooncakeRayError as e:  # the client was closed already: nothing left to undo
        log.debug("unregistering LMCache's CPU buffer: %s", e)


def _release(objs: Iterable[MemoryObj | None]) -> None:
    for obj in objs:
        if obj is not None:
            obj.ref_count_down()


# ------------------------------------------------------------------ connector ----
class MooncakeRayRemoteConnector(RemoteConnector):
    """LMCache remote connector onto a mooncake-ray store (see the module docstring).

    Created by :class:`MooncakeRayConnectorAdapter`. Store calls block, so the async
    methods run them on threads of the event loop's default executor; the synchronous
    ones (``exists_sync``, ``batched_contains``, ``remove_sync``) call the store directly
    in the caller's thread.

    MemoryObj references: a put holds its own reference on each object until the store
    call has returned, since LMCache drops the caller's reference as soon as the put's
    coroutine ends, which happens early if it is cancelled. A get returns objects holding
    one reference each, which LMCache takes over; if the get is cancelled (LMCache does so
    after ``blocking_timeout_secs``), the call still completes, writing into objects
    nobody can see any more, and releases them then.
    """

    def __init__(self, *, loop: asyncio.AbstractEventLoop, local_cpu_backend,
                 config: LMCacheEngineConfig, metadata: LMCacheMetadata,
                 plugin_name: str = PLUGIN_TYPE):
        """Validate the configuration and join the store.

        Raises:
            PluginConfigError: an unknown or bad key under
                ``remote_storage_plugin.<plugin_name>.``, or ``save_chunk_meta: false``
                with a serde other than ``naive``.
            ConfigError: the Ray cluster cannot be reached or joined.
            MooncakeRayError: no store runs in the namespace (MasterUnavailableError).
        """
        self.cfg = parse_config(config.extra_config, plugin_name, config.remote_storage_plugins or ())
        super().__init__(config, metadata)
        if not self.save_chunk_meta and config.remote_serde != "naive":
            raise PluginConfigError(
                f"LMCache remote_serde {config.remote_serde!r} needs save_chunk_meta: true "
                "(values of other serdes do not have the engine's chunk shape); allowed with "
                "save_chunk_meta: false: 'naive'")
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.plugin_name = plugin_name
        self._inflight: set[asyncio.Future] = set()  # store calls running on executor threads
        self.layout = "m" if self.save_chunk_meta else "r"
        self.prefix = f"{self.cfg.key_prefix}{self.layout}/"
        self.client = _store.store_client(
            namespace=self.cfg.namespace, ray_address=self.cfg.ray_address,
            store_wait_s=self.cfg.store_wait_s, connect_timeout_s=self.cfg.connect_timeout_s,
            who=f"LMCache plugin {plugin_name!r}")
        buf = _cpu_buffer(local_cpu_backend) if self.cfg.register_cpu_buffer else None
        self._registration = _register(self.client, buf) if buf is not None else None
        log.info("LMCache plugin %r: store namespace %r, keys %s..., %s", plugin_name, self.cfg.namespace,
                 self.prefix, "zero-copy" if self.zero_copy else "copying through the transport")

    def __repr__(self) -> str:
        return f"<MooncakeRayRemoteConnector {self.plugin_name} namespace={self.cfg.namespace!r}>"

    @property
    def zero_copy(self) -> bool:
        """Whether LMCache's CPU buffer is registered with the store client (puts and
        gets move bytes without an intermediate copy)."""
        return self._registration is not None

    def name_of(self, key: CacheEngineKey) -> str:
        """The store key of an LMCache key."""
        return self.prefix + key.to_string()

    async def _run(self, fn: Callable[[], Any], abandon: Callable[[Any], None] | None = None) -> Any:
        """``fn()`` on an executor thread. If the awaiting task is cancelled, ``fn`` still
        runs to its end (it may be using LMCache's buffers) and ``abandon`` gets its result."""
        fut = asyncio.get_running_loop().run_in_executor(None, fn)
        self._inflight.add(fut)
        fut.add_done_callback(self._inflight.discard)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if abandon is not None:
                fut.add_done_callback(
                    lambda f: None if f.cancelled() or f.exception() is not None else abandon(f.result()))
            raise

    # ---------------------------------------------------------------- lookups ----
    async def exists(self, key: CacheEngineKey) -> bool:
        """Whether the store holds ``key`` (complete). Safe to retry.

        Raises:
            MasterUnavailableError: the master did not answer within ``store_wait_s``.
        """
        return await self._run(lambda: self.exists_sync(key))

    def exists_sync(self, key: CacheEngineKey) -> bool:
        """``exists``, blocking the calling thread. Raises as ``exists``."""
        return self.client.batch_exists([self.name_of(key)])[0]

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        """How many of ``keys``, from the first, the store holds (one master call). Safe to
        retry.

        Raises:
            MasterUnavailableError: the master did not answer within ``store_wait_s``.
        """
        if not keys:
            return 0
        found = self.client.batch_exists([self.name_of(k) for k in keys])
        return found.index(False) if False in found else len(found)

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False) -> int:
        """``batched_contains`` without blocking the event loop. ``pin`` is not used: the
        store's eviction is its own. Raises as ``batched_contains``."""
        return await self._run(lambda: self.batched_contains(keys))

    # ------------------------------------------------------------------- gets ----
    def support_batched_get(self) -> bool:
        return True

    async def get(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        """The chunk of ``key`` in a new MemoryObj, or None (a miss, no room in LMCache's
        CPU buffer, or a value that does not fit the layout). Raises as ``batched_get``."""
        return (await self.batched_get([key]))[0]

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[Optional[MemoryObj]]:
        """The chunks of ``keys``, in order, each a new MemoryObj (one reference, LMCache's)
        or None. A key whose bytes failed to move is None, with a warning.

        Raises:
            MasterUnavailableError: the master did not answer within ``store_wait_s``
                (retryable; no MemoryObj is left allocated).
        """
        if not keys:
            return []
        names = [self.name_of(k) for k in keys]
        read = self._get_raw if self.layout == "r" else self._get_with_header
        return await self._run(lambda: read(names), abandon=_release)

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey]) -> list[MemoryObj]:
        """The chunks of ``keys`` up to the first one missing. Raises as ``batched_get``."""
        objs = await self.batched_get(keys)
        n = objs.index(None) if None in objs else len(objs)
        _release(objs[n:])
        return objs[:n]

    def _allocate(self, shapes, dtypes, fmt) -> Optional[MemoryObj]:
        # no busy loop: with LMCache's CPU buffer full of pinned chunks, a get is a miss
        return self.local_cpu_backend.allocate(shapes, dtypes, fmt, busy_loop=False)

    def _get_raw(self, names: list[str]) -> list[Optional[MemoryObj]]:
        objs = [self._allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt) for _ in names]
        out: list[Optional[MemoryObj]] = [None] * len(names)
        idx = [i for i, o in enumerate(objs) if o is not None]
        if len(idx) < len(names):
            log.warning("LMCache CPU buffer full: %d of %d chunks not read", len(names) - len(idx), len(names))
        if not idx:
            return out
        try:
            sizes = self.client.batch_get_into([names[i] for i in idx],
                                               [objs[i].raw_tensor[:objs[i].get_size()] for i in idx])
        except BaseException:
            _release(objs)
            raise
        for i, n in zip(idx, sizes):
            if isinstance(n, BaseException):
                self._warn_read(names[i], n)
                objs[i].ref_count_down()
                continue
            try:
                out[i] = self.reshape_partial_chunk(objs[i], n)
            except ValueError as e:
                log.warning("%s: a value of %d bytes is not a chunk of this engine (%s)", names[i], n, e)
                objs[i].ref_count_down()
        return out

    def _get_with_header(self, names: list[str]) -> list[Optional[MemoryObj]]:
        values = self.client.batch_get(names)
        out: list[Optional[MemoryObj]] = []
        for name, v in zip(names, values):
            if isinstance(v, BaseException):
                self._warn_read(name, v)
            out.append(self._unpack(name, v) if isinstance(v, bytes) else None)
        return out

    def _unpack(self, name: str, value: bytes) -> Optional[MemoryObj]:
        h = self.remote_metadata_bytes
        try:
            if len(value) < h:
                raise ValueError(f"{len(value)} bytes, shorter than the {h}-byte header")
            meta = RemoteMetadata.deserialize(value[:h])
            if meta.length != len(value) - h:
                raise ValueError(f"header says {meta.length} bytes, {len(value) - h} follow it")
        except (ValueError, KeyError) as e:  # KeyError: a dtype code LMCache does not know
            log.warning("%s: not a value with an LMCache header (%s)", name, e)
            return None
        obj = self._allocate(meta.shapes, meta.dtypes, meta.fmt)
        if obj is None:
            log.warning("%s: LMCache CPU buffer full, chunk not read", name)
            return None
        dst = np.frombuffer(obj.byte_array, dtype=np.uint8)
        if dst.size != meta.length:
            log.warning("%s: header shapes hold %d bytes, the value %d", name, dst.size, meta.length)
            obj.ref_count_down()
            return None
        dst[:] = np.frombuffer(value, dtype=np.uint8, offset=h)
        return obj

    @staticmethod
    def _warn_read(name: str, err: BaseException) -> None:
        if not isinstance(err, ObjectNotFoundError):
            log.warning("%s: not read (%s: %s)", name, type(err).__name__, err)

    # ------------------------------------------------------------------- puts ----
    def support_batched_put(self) -> bool:
        return True

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        """Store one chunk. Raises as ``batched_put``."""
        await self.batched_put([key], [memory_obj])

    async def batched_put(self, keys: Sequence[CacheEngineKey], memory_objs: Sequence[MemoryObj]) -> None:
        """Store chunks under ``keys``; a key stored already (or being stored by another
        engine) is left as it is. A retry is safe: keys stored by the first attempt count
        as stored.

        Raises:
            MasterUnavailableError: the master did not answer within ``store_wait_s``.
            MooncakeRayError: the first per-key failure (e.g. NoCapacityError, TransferError)
                after every other key was tried; the number of failures is logged.
        """
        if not keys:
            return
        names = [self.name_of(k) for k in keys]
        # LMCache stores a request's new chunks in token order in one call: each chunk of
        # the same model, rank, dtype and tags names the one before as its parent
        parents = [None] + [names[i - 1] if _same_stream(keys[i - 1], keys[i]) else None
                            for i in range(1, len(keys))]
        objs = list(memory_objs)
        for obj in objs:
            obj.ref_count_up()
        write = self._put_raw if self.layout == "r" else self._put_with_header
        await self._run(lambda: self._put_holding(write, names, objs, parents))

    def _put_holding(self, write, names: list[str], objs: list[MemoryObj], parents: list) -> None:
        try:
            results = write(names, objs, parents)
        finally:
            _release(objs)
        failed = [(n, r) for n, r in zip(names, results)
                  if r is not None and not isinstance(r, (ObjectExistsError, ObjectPendingError))]
        if failed:
            log.warning("%d of %d chunks not stored; first %s: %s: %s", len(failed), len(names),
                        failed[0][0], type(failed[0][1]).__name__, failed[0][1])
            raise failed[0][1]

    def _put_raw(self, names: list[str], objs: list[MemoryObj], parents: list) -> list:
        bufs = [o.raw_tensor if o.raw_tensor is not None else o.byte_array for o in objs]
        return self.client.batch_put_from(names, bufs, [o.get_size() for o in objs], parents=parents)

    def _put_with_header(self, names: list[str], objs: list[MemoryObj], parents: list) -> list:
        h = self.remote_metadata_bytes
        staged = []
        for obj in objs:
            src = np.frombuffer(obj.byte_array, dtype=np.uint8)
            buf = np.empty(h + src.size, dtype=np.uint8)
            RemoteMetadata(src.size, obj.get_shapes(), obj.get_dtypes(),
                           obj.get_memory_format()).serialize_into(buf)
            buf[h:] = src
            staged.append(buf)
        return self.client.batch_put(names, staged, parents=parents)

    # ------------------------------------------------------------------ admin ----
    def remove_sync(self, key: CacheEngineKey) -> bool:
        """Remove ``key`` from the store; False if it was not stored. Safe to retry.

        Raises:
            ObjectLeasedError: a reader holds it (retryable).
            MasterUnavailableError: the master did not answer within ``store_wait_s``.
        """
        return self.client.remove(self.name_of(key))

    async def list(self) -> list[str]:
        """Not offered: the store has no enumeration of keys.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError("the mooncake-ray store does not list keys; look keys up with exists")

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 once the master has answered a lookup.

        Raises:
            MasterUnavailableError: the master did not answer within ``store_wait_s``.
        """
        await self._run(lambda: self.client.batch_exists([self.prefix + "ping"]))
        return 0

    async def close(self) -> None:
        """Wait for the store calls still running (each bounded by the store's timeouts;
        LMCache does not wait for its puts), then unregister LMCache's CPU buffer unless
        another connector of this process uses it. The store client stays open: it is
        shared by the process. Idempotent."""
        if self._inflight:
            await asyncio.gather(*list(self._inflight), return_exceptions=True)
        ident, self._registration = self._registration, None
        if ident is not None:
            _unregister(self.client, ident)


# -------------------------------------------------------------------- adapter ----
class MooncakeRayConnectorAdapter(ConnectorAdapter):
    """What ``remote_storage_plugin.<name>.class_name`` names: LMCache instantiates it
    without arguments and asks it for a connector for ``plugin://<name>``."""

    def __init__(self) -> None:
        super().__init__(_SCHEME + PLUGIN_TYPE)

    def can_parse(self, url: str) -> bool:
        return url.startswith(_SCHEME) and extract_plugin_type(url[len(_SCHEME):]) == PLUGIN_TYPE

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        """A connector for ``context.url`` (``plugin://mooncake_ray[.<instance>]``).

        Raises:
            PluginConfigError: no LMCache configuration or engine metadata in the context,
                or a bad plugin configuration.
            ConfigError, MooncakeRayError: as ``MooncakeRayRemoteConnector``.
        """
        name = context.plugin_name or context.url[len(_SCHEME):]
        metadata = context.metadata or getattr(context.local_cpu_backend, "metadata", None)
        if context.config is None or metadata is None:
            raise PluginConfigError(
                f"LMCache plugin {name!r} needs LMCache's engine configuration and metadata; got "
                f"config={type(context.config).__name__}, metadata={type(metadata).__name__}")
        return MooncakeRayRemoteConnector(loop=context.loop, local_cpu_backend=context.local_cpu_backend,
                                          config=context.config, metadata=metadata, plugin_name=name)


def _same_stream(a: CacheEngineKey, b: CacheEngineKey) -> bool:
    """Two chunks of one model's KV on one rank (only the chunk hash differs)."""
    return (a.model_name, a.world_size, a.worker_id, a.dtype, a.tags) == \
        (b.model_name, b.world_size, b.worker_id, b.dtype, b.tags)
