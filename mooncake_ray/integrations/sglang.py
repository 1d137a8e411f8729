"""SGLang HiCache on the store: an L3 storage backend (SGLang's ``HiCacheStorage``).

    python -m sglang.launch_server --model-path Qwen/Qwen3-8B --page-size 64 \\
        --enable-hierarchical-cache --hicache-mem-layout page_first \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "mooncake_ray",
            "module_path": "mooncake_ray.integrations.sglang",
            "class_name": "MooncakeRayHiCacheStorage", "interface_v1": 1}'

Every TP/PP rank process builds one backend. With none of our keys in the extra config
(:class:`MooncakeRayHiCacheConfig`) it joins the Ray cluster of ``RAY_ADDRESS`` (else the
one on this machine) and the store deployed there by ``mooncake-ray start``.
``"interface_v1": 1`` is SGLang's switch for dynamic backends: with it SGLang calls the
zero-copy ``batch_get_v1``/``batch_set_v1``; without it SGLang copies each page through a
temporary tensor and calls ``batch_get``/``batch_set``, which store the same objects.

What is stored: a page (``page_size`` tokens) is one object per component, K and V for
MHA models, the latent ``kv`` for MLA models, each holding that component for every layer
of this rank's pipeline stage in token-major order ``[token, layer, head, dim]``, whatever
the host pool's layout:

    host layout         one page of a component     moved
    page_first          [token, layer, head, dim]   zero-copy, from and into the pool
    layer_first         [layer, token, head, dim]   through a registered staging buffer
    page_first_direct   [layer, token, head, dim]   through the staging buffer
    page_head (MHA)     [head, token, layer, dim]   through the staging buffer

A strided page is gathered into (and scattered from) the staging buffer with one copy
rather than stored as one object per layer: per-layer objects would multiply the keys by
the layer count (72 objects a page for an MHA model of 36 layers, 9,216 per SGLang batch of
128 pages) and the master's work is per key, while a host memcpy of a page costs little
next to moving it. One byte order for all layouts also lets engines started with different
``--hicache-mem-layout`` share pages.

Keys: ``sglang/[<extra_backend_tag>/]<model>/<mha|mla>/<dtype>/L<layers>H<heads>D<dim>
[V<v dim>]/P<page size>/[tp<r>of<n>/][pp<r>of<n>/][cp<r>of<n>/]<page hash>/<k|v|kv>``
(MLA geometry: ``L<layers>D<dim>``). MHA keys carry the TP rank (each rank holds its own heads). MLA keys do not: every TP rank
holds the same latent cache, so it is stored once; only SGLang's storage writer (TP rank
0) writes, and the other ranks' writes return True without storing. Pipeline and attention
context-parallel ranks are named only when there are several.

Failures: ``batch_get_v1``/``batch_set_v1`` and the tensor calls raise
``MasterUnavailableError`` when the store does not answer within ``store_wait_s``; they
never return None. A missing page, or one whose own transfer failed, is a False for that
page. ``batch_exists``/``exists`` report a store that does not answer as a miss, with a
warning: a miss costs recomputation. Writes skip pages the store already holds.

Hybrid models (SGLang's v2 interface): besides the KV pool, SGLang registers the model's
other host pools with ``register_mem_host_pool_v2`` (``mamba``: a Mamba/linear-attention
layer's state per prefix; ``swa``: sliding-window KV; DSA ``indexer``, ``draft`` ...), and
calls ``batch_exists_v2`` / ``batch_get_v2`` / ``batch_set_v2`` with one ``PoolTransfer``
per pool. A pool's page is one object, ``<prefix><page hash>/<pool>`` next to the page's KV
objects, holding the bytes of the pool's flat data page (``get_data_page(flat=True)``,
written back with ``set_from_flat_data_page``: one copy each way, through the staging
buffer). ``batch_exists_v2`` counts a prefix of ``n`` pages as a hit only when every pool
holds what its hit policy asks at ``n``: ``all_pages``, each of the ``n`` pages;
``trailing_pages``, the last ``len(transfer.keys)`` pages before ``n`` (a state or a
window ends there); a policy this backend does not know gives no hit at all. Pools without
SGLang's flat-page methods are refused when registered.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mooncake_ray.config import Size, _explain
from mooncake_ray.errors import (
    ConfigError,
    InvalidArgumentError,
    MasterUnavailableError,
    MooncakeRayError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectPendingError,
)
from mooncake_ray.integrations import _store

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

try:
    from sglang.srt.observability.metrics_collector import StorageMetrics
except ImportError:  # SGLang before the observability package
    from sglang.srt.metrics.collector import StorageMetrics

log = logging.getLogger(__name__)

__all__ = ["MooncakeRayHiCacheStorage", "MooncakeRayHiCacheConfig", "parse_config"]

WHO = "MooncakeRayHiCacheStorage"

# Keys SGLang itself reads from --hicache-storage-backend-extra-config. The dynamic loader
# reads the first three; the controller reads interface_v1; the next five SGLang removes
# before building the backend (accepted in case a caller passes the dict on unchanged);
# enable_metadata_cache is SGLang's file backend's, accepted so one config can serve both.
_SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1",
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys", "tp_lcm_size", "enable_metadata_cache",
})


class MooncakeRayHiCacheConfig(BaseModel):
    """Our keys in ``--hicache-storage-backend-extra-config``. Keys neither ours nor
    SGLang's are errors."""

    model_config = ConfigDict(extra="forbid")

    ray_address: str | None = None
    """Ray cluster to join when the process is not in one: ``host:port`` of its GCS, or
    ``auto``. Default: ``RAY_ADDRESS``, then ``auto`` (the cluster running on this machine)."""
    namespace: str = "mooncake_ray"
    """Ray namespace of the store (``StoreConfig.namespace``)."""
    model_id: str | None = None
    """Name of the model in keys (default: SGLang's model name). Engines that share KV must agree."""
    extra_backend_tag: str | None = None
    """A tag put in every key, to keep tenants apart in one store (the key SGLang's own
    Mooncake backend reads for the same purpose)."""
    store_wait_s: float = Field(5.0, gt=0)
    """How long one store call may wait (for a restarting master, or for room) before it
    fails: a prefetch then ends with the pages it has, a backup is dropped."""
    connect_timeout_s: float = Field(10.0, gt=0)
    """How long joining the Ray cluster may take before the engine fails to start."""
    replicas: int | None = Field(None, ge=1, le=64)
    """Copies of each page on distinct store nodes (default: the store's ``master.replicas``)."""
    staging_bytes: Size = 64 << 20
    """Size of each of the two staging buffers (reads, writes) of layouts whose pages are
    strided (raised to one page if smaller). Accepts ``"64mb"``-style strings."""


def parse_config(extra: dict | None, who: str = WHO) -> MooncakeRayHiCacheConfig:
    """Validate the extra config, ignoring the keys SGLang reads itself.

    Raises:
        ConfigError: naming each unknown or bad key, its value and what is allowed.
    """
    ours = {k: v for k, v in (extra or {}).items() if k not in _SGLANG_KEYS}
    try:
        return MooncakeRayHiCacheConfig.model_validate(ours)
    except ValidationError as e:
        raise ConfigError(f"{who} --hicache-storage-backend-extra-config: " + _explain(e)) from None


# ---------------------------------------------------------------------- layouts ----
# Each layout: where the page starting at token ``start`` lies in a component buffer, and
# the permutation of that page's dims giving [token, layer, head, dim].
_LAYOUTS: dict[str, tuple[Callable[[torch.Tensor, int, int], torch.Tensor], tuple[int, ...]]] = {
    "page_first": (lambda buf, start, ps: buf[start:start + ps], (0, 1, 2, 3)),              # [size, L, H, D]
    "layer_first": (lambda buf, start, ps: buf[:, start:start + ps], (1, 0, 2, 3)),          # [L, size, H, D]
    "page_first_direct": (lambda buf, start, ps: buf[start // ps], (1, 0, 2, 3)),           # [pages, L, ps, H, D]
    "page_head": (lambda buf, start, ps: buf[start // ps], (1, 2, 0, 3)),                   # [pages, H, ps, L, D]
}
_MLA_LAYOUTS = ("page_first", "layer_first", "page_first_direct")


@dataclass(frozen=True)
class _Part:
    """One component of a page: its name in keys, the pool's buffer of it, and the shape
    and size of one page of it (token-major)."""

    name: str
    buffer: torch.Tensor
    native_shape: tuple[int, ...]
    shape: tuple[int, ...]
    nbytes: int


def _host_pool_classes() -> tuple[type, type]:
    try:
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    except ImportError:  # SGLang before the pool_host package
        from sglang.srt.mem_cache.memory_pool_host import MHATokenToKVPoolHost, MLATokenToKVPoolHost
    return MHATokenToKVPoolHost, MLATokenToKVPoolHost


class _Staging:
    """A registered bounce buffer and the lock of its one user at a time."""

    def __init__(self, client, nbytes: int):
        self.buf = torch.empty(nbytes, dtype=torch.uint8)
        self.region = client.register_buffer(self.buf)
        self.lock = threading.Lock()

    def chunks(self, sizes: Sequence[int]) -> list[list[tuple[int, int]]]:
        """``sizes`` packed in order into runs that fit the buffer: per run, each
        object's ``(index, offset)``."""
        runs, run, used = [], [], 0
        for i, n in enumerate(sizes):
            if run and used + n > self.buf.numel():
                runs.append(run)
                run, used = [], 0
            run.append((i, used))
            used += n
        if run:
            runs.append(run)
        return runs

    def slot(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        """The staging bytes at ``offset`` seen as a contiguous tensor shaped like ``like``."""
        n = like.numel() * like.element_size()
        return self.buf[offset:offset + n].view(like.dtype).view(like.shape)


class _Throttled:
    """At most one warning of a kind every 10 s: a store that is down is reported once,
    not once per request."""

    def __init__(self):
        self._last: dict[str, float] = {}

    def warning(self, kind: str, msg: str, *args) -> None:
        if time.monotonic() - self._last.get(kind, -math.inf) >= 10.0:
            self._last[kind] = time.monotonic()
            log.warning(msg, *args)


class MooncakeRayHiCacheStorage(HiCacheStorage):
    """SGLang HiCache L3 backend onto a mooncake-ray store (see the module docstring).

    Thread-safe: SGLang calls it from its prefetch, backup and scheduler threads. Reads and
    writes each have their own staging buffer, so a backup never waits for a prefetch.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None):
        """Validate the settings and join the store (the host pool comes later, through
        ``register_mem_pool_host``). ``kwargs`` are further settings of ours, as
        ``StorageBackendFactory.create_backend(..., **kwargs)`` passes them.

        Raises:
            ConfigError: an unknown or bad extra-config key (named), a parallel layout we
                do not store (decode context parallel, split heads), or a Ray cluster
                that cannot be joined.
            MooncakeRayError: no store runs in ``namespace``.
        """
        extra = {**(storage_config.extra_config or {}), **(kwargs or {})}
        self.cfg = parse_config(extra)
        if getattr(storage_config, "dcp_size", 1) > 1:
            raise ConfigError(f"{WHO}: decode context parallel (dcp_size={storage_config.dcp_size}) "
                              "is not supported")
        if getattr(storage_config, "should_split_heads", False):
            raise ConfigError(f"{WHO}: split heads (tp_lcm_size={storage_config.tp_lcm_size}) "
                              "is not supported")
        if "backend_name" in extra and not extra.get("interface_v1"):  # loaded by SGLang's controller
            log.warning('%s: "interface_v1" is not set in the extra config, so SGLang will copy '
                        "every page through batch_get/batch_set; set it to 1 for zero-copy", WHO)
        self.storage_config = storage_config
        self.is_mla = bool(storage_config.is_mla_model)
        writer = getattr(storage_config, "is_storage_writer", None)
        self.is_writer = writer if writer is not None else (not self.is_mla or storage_config.tp_rank == 0)
        self.client = _store.store_client(namespace=self.cfg.namespace, ray_address=self.cfg.ray_address,
                                          store_wait_s=self.cfg.store_wait_s,
                                          connect_timeout_s=self.cfg.connect_timeout_s, who=WHO)
        self.mem_pool_host = None
        self.prefix: str | None = None
        self._parts: list[_Part] = []
        self._layout = ""
        self._direct = False
        self._regions: list = []
        self._staging: dict[str, _Staging] = {}
        self._extra: dict[str, tuple[Any, int]] = {}  # v2 pools besides KV: name -> (host pool, page bytes)
        self._metrics = StorageMetrics()
        self._metrics_lock = threading.Lock()
        self._staging_lock = threading.Lock()
        self._warn = _Throttled()

    # ======================================================== host pool ==
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Take SGLang's host KV pool: register its memory with the store's transport (so
        transfers read and write it directly) and derive the key prefix from its geometry.

        Raises:
            ConfigError: a host pool class or layout that is not supported (named).
        """
        mha_cls, mla_cls = _host_pool_classes()
        kind = type(mem_pool_host)
        if kind not in (mha_cls, mla_cls) or getattr(mem_pool_host, "kv_buffer", None) is None:
            raise ConfigError(f"{WHO}: host pool {kind.__name__} is not supported; supported: "
                              f"{mha_cls.__name__}, {mla_cls.__name__} (with a KV buffer)")
        if (kind is mla_cls) != self.is_mla:
            raise ConfigError(f"{WHO}: host pool {kind.__name__} but is_mla_model={self.is_mla}")
        layout = mem_pool_host.layout
        allowed = _MLA_LAYOUTS if self.is_mla else tuple(_LAYOUTS)
        if layout not in allowed:
            raise ConfigError(f"{WHO}: host pool layout {layout!r} is not supported; allowed: {', '.join(allowed)}")
        if getattr(mem_pool_host, "dcp_size", 1) != 1:
            raise ConfigError(f"{WHO}: a host pool split across decode context parallel ranks is not supported")
        self.close()
        buffers = {"kv": mem_pool_host.kv_buffer} if self.is_mla else \
            {"k": mem_pool_host.k_buffer, "v": mem_pool_host.v_buffer}
        ps = mem_pool_host.page_size
        locate, perm = _LAYOUTS[layout]
        parts = []
        for name, buf in buffers.items():
            page = locate(buf, 0, ps)
            shape = tuple(page.permute(perm).shape)
            if page.dim() != 4 or shape[:2] != (ps, mem_pool_host.layer_num):
                raise ConfigError(f"{WHO}: {layout} host buffer {name!r} of shape {tuple(buf.shape)} does not "
                                  f"hold pages of {ps} tokens x {mem_pool_host.layer_num} layers")
            parts.append(_Part(name, buf, tuple(page.shape), shape, page.numel() * page.element_size()))
        super().register_mem_pool_host(mem_pool_host)
        self._parts, self._layout = parts, layout
        self._direct = all(locate(p.buffer, 0, ps).permute(perm).is_contiguous() for p in parts)
        self._regions = [self.client.register_buffer(p.buffer) for p in parts]
        if not self._direct:
            size = max(self.cfg.staging_bytes, self.page_bytes)
            self._staging = {"read": _Staging(self.client, size), "write": _Staging(self.client, size)}
        self.prefix = self._key_prefix(mem_pool_host)
        log.info("%s: %s host pool, layout %s (%s), %d bytes a page, keys %s", WHO, kind.__name__, layout,
                 "zero-copy" if self._direct else "staged", self.page_bytes, self.prefix)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """Take one of a hybrid model's host pools (SGLang's v2 interface): the KV pool
        again under its v2 name, or a pool of another kind (``mamba``, ``swa``, ...),
        stored page by page through its flat data pages.

        Raises:
            ConfigError: a second, different KV pool; a pool name that is not a plain
                word; or a pool without SGLang's flat-page methods (named).
        """
        name = str(host_pool_name)
        if name == "kv":
            if host_pool is not self.mem_pool_host and self.mem_pool_host is not None:
                raise ConfigError(f"{WHO}: a second KV host pool ({type(host_pool).__name__}) is not supported")
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
            return
        if not name.replace("_", "").isalnum():
            raise ConfigError(f"{WHO}: host pool name {name!r} is not a plain word")
        missing = [m for m in ("get_data_page", "set_from_flat_data_page", "get_dummy_flat_data_page")
                   if not callable(getattr(host_pool, m, None))]
        if missing:
            raise ConfigError(f"{WHO}: host pool {name!r} ({type(host_pool).__name__}) has no "
                              f"{', '.join(missing)}: it cannot be stored")
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        page = host_pool.get_dummy_flat_data_page()
        with self._staging_lock:
            self._extra[name] = (host_pool, page.numel() * page.element_size())
        log.info("%s: host pool %r (%s), %d bytes a page", WHO, name, type(host_pool).__name__,
                 self._extra[name][1])

    @property
    def page_bytes(self) -> int:
        """Bytes of one page, all components."""
        return sum(p.nbytes for p in self._parts)

    def _page_numel(self) -> int:
        return sum(math.prod(p.shape) for p in self._parts)

    def _key_prefix(self, pool) -> str:
        sc = self.storage_config
        first = self._parts[0].shape  # [token, layer, head, dim]
        geometry = f"L{first[1]}D{first[3]}" if self.is_mla else f"L{first[1]}H{first[2]}D{first[3]}"
        if not self.is_mla and self._parts[1].shape[3] != first[3]:
            geometry += f"V{self._parts[1].shape[3]}"
        parts = ["sglang"]
        if self.cfg.extra_backend_tag:
            parts.append(self.cfg.extra_backend_tag)
        parts += [self.cfg.model_id or sc.model_name or "unnamed-model", "mla" if self.is_mla else "mha",
                  str(pool.dtype).removeprefix("torch."), geometry, f"P{pool.page_size}"]
        if not self.is_mla:
            parts.append(f"tp{sc.tp_rank}of{sc.tp_size}")
        if sc.pp_size > 1:
            parts.append(f"pp{sc.pp_rank}of{sc.pp_size}")
        if getattr(sc, "attn_cp_size", 1) > 1:
            parts.append(f"cp{sc.attn_cp_rank}of{sc.attn_cp_size}")
        return "/".join(parts) + "/"

    def object_keys(self, keys: Sequence[str]) -> list[str]:
        """The store keys of pages (SGLang's page hashes), components of each page in turn.

        Raises:
            MooncakeRayError: no host pool registered yet.
        """
        self._check_registered()
        return [f"{self.prefix}{k}/{p.name}" for k in keys for p in self._parts]

    def _check_registered(self) -> None:
        if self.prefix is None:
            raise MooncakeRayError(f"{WHO}: no host KV pool registered (register_mem_pool_host comes first)")

    # ====================================================== zero-copy I/O ==
    def _pool_pages(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[torch.Tensor]:
        """Token-major views of the pages at ``host_indices`` in the pool, per component."""
        self._check_registered()
        ps = self.mem_pool_host.page_size
        if host_indices.numel() != len(keys) * ps:
            raise InvalidArgumentError(f"{WHO}: {len(keys)} keys need {len(keys) * ps} host indices "
                                       f"(page size {ps}), got {host_indices.numel()}")
        starts = host_indices.reshape(-1)[::ps].tolist()
        size = self.mem_pool_host.size
        for s in starts:
            if s % ps or not 0 <= s <= size - ps:
                raise InvalidArgumentError(f"{WHO}: host index {s} does not start a page of {ps} tokens "
                                           f"inside the pool of {size}")
        locate, perm = _LAYOUTS[self._layout]
        return [locate(p.buffer, s, ps).permute(perm) for s in starts for p in self._parts]

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Read pages into the host pool at ``host_indices`` (zero-copy for page_first).
        Returns a bool per page: False for a miss or a page whose transfer failed (its
        slots' content is then unspecified).

        Raises:
            MasterUnavailableError: the store did not answer within ``store_wait_s``
                (retryable; a retry is safe).
            InvalidArgumentError: ``host_indices`` do not hold one page per key.
        """
        views = self._pool_pages(keys, host_indices)
        return self._timed("prefetch", lambda: self._read(self.object_keys(keys), views, self._direct))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store the pages at ``host_indices`` of the host pool, skipping pages already
        stored. Returns a bool per page: True if the store holds it now (on an MLA rank
        other than the writer: True, without storing). Safe to retry.

        Raises:
            MasterUnavailableError: the store did not answer within ``store_wait_s``.
            InvalidArgumentError: ``host_indices`` do not hold one page per key.
        """
        views = self._pool_pages(keys, host_indices)
        if not self.is_writer:
            return [True] * len(keys)
        prior = (extra_info.prefix_keys or [None])[-1] if extra_info is not None else None
        return self._timed("backup", lambda: self._write(self.object_keys(keys), views, self._direct,
                                                         self._parents(keys, prior)))

    def _parents(self, keys: Sequence[str], prior: str | None) -> list[str | None]:
        """Each object's parent in its KV chain: the same component of the page before
        (``prior``: the page before the call's first, from ``extra_info.prefix_keys``)."""
        pages = [prior, *keys[:-1]]
        return [None if k is None else f"{self.prefix}{k}/{p.name}" for k in pages for p in self._parts]

    # ========================================================== tensor I/O ==
    def _flat_pages(self, pages: Sequence[Any]) -> list[torch.Tensor]:
        """Token-major views, per component, into flat pages as the host pool's
        ``get_data_page(flat=True)`` returns them."""
        self._check_registered()
        _, perm = _LAYOUTS[self._layout]
        numel = self._page_numel()
        views = []
        for page in pages:
            if not isinstance(page, torch.Tensor) or page.dtype != self.mem_pool_host.dtype \
                    or page.numel() != numel or not page.is_contiguous():
                got = f"{page.dtype} tensor of {page.numel()} elements" if isinstance(page, torch.Tensor) \
                    else type(page).__name__
                raise InvalidArgumentError(f"{WHO}: a page is a contiguous {self.mem_pool_host.dtype} tensor "
                                           f"of {numel} elements, got {got}")
            flat, off = page.reshape(-1), 0
            for p in self._parts:
                n = math.prod(p.shape)
                views.append(flat[off:off + n].view(p.native_shape).permute(perm))
                off += n
        return views

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """Read one page into ``target_location`` (a flat page tensor, allocated if None);
        returns it, or None for a miss. Raises as ``batch_get``."""
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """``get`` for many pages; a tensor or None per key.

        Raises:
            InvalidArgumentError: a target is not a flat page of the pool, or the lists
                differ in length.
            MasterUnavailableError: the store did not answer within ``store_wait_s``.
        """
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        if len(targets) != len(keys):
            raise InvalidArgumentError(f"{WHO}: {len(keys)} keys but {len(targets)} target locations")
        self._check_registered()
        targets = [torch.empty(self._page_numel(), dtype=self.mem_pool_host.dtype) if t is None else t
                   for t in targets]
        views = self._flat_pages(targets)
        ok = self._timed("prefetch", lambda: self._read(self.object_keys(keys), views, False))
        return [t if good else None for t, good in zip(targets, ok)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store one page given as a flat page tensor (``get_data_page(index, flat=True)``);
        True if the store holds it now. Raises as ``batch_set``."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """``set`` for many pages; True if the store holds every one now.

        Raises:
            InvalidArgumentError: a value is not a flat page of the pool, or the lists
                differ in length.
            MasterUnavailableError: the store did not answer within ``store_wait_s``.
        """
        values = list(values or [])
        if len(values) != len(keys):
            raise InvalidArgumentError(f"{WHO}: {len(keys)} keys but {len(values)} values")
        views = self._flat_pages(values)
        if not self.is_writer:
            return True
        return all(self._timed("backup", lambda: self._write(self.object_keys(keys), views, False, self._parents(keys, None))))

    # ============================================================= lookup ==
    def exists(self, key: str) -> bool:
        """Whether every component of the page is stored; raises as ``batch_exists``."""
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many pages from the start are stored whole (one batched lookup). A store
        that does not answer within ``store_wait_s`` counts as 0 (with a warning).

        Raises:
            MooncakeRayError: no host pool registered yet.
        """
        names = self.object_keys(keys)
        try:
            found = self.client.batch_exists(names)
        except MooncakeRayError as e:
            self._warn.warning("lookup", "%s: lookup failed (%s): reporting a miss", WHO, e)
            return 0
        per = len(self._parts)
        n = 0
        while n < len(keys) and all(found[n * per:(n + 1) * per]):
            n += 1
        return n

    # ==================================================== v2: hybrid pools ==
    def _pool_keys(self, name: str, keys: Sequence[str]) -> list[str]:
        return [f"{self.prefix}{k}/{name}" for k in keys]

    def batch_exists_v2(self, keys: list[str], pool_transfers: list | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None):
        """How many pages from the start are a hit in every pool (one batched lookup):
        the KV pages from the start, and each pool's pages as its hit policy asks. A store
        that does not answer counts as no hit (with a warning).

        Raises:
            MooncakeRayError: no host pool registered yet.
        """
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransferResult

        transfers = [t for t in pool_transfers or () if str(t.name) != "kv"]
        names = self.object_keys(keys) + [k for t in transfers for k in self._pool_keys(str(t.name), keys)]
        try:
            found = self.client.batch_exists(names)
        except MooncakeRayError as e:
            self._warn.warning("lookup", "%s: lookup failed (%s): reporting a miss", WHO, e)
            return PoolTransferResult(0, {}, [])
        per, n_kv = len(self._parts), len(keys) * len(self._parts)
        kv = 0
        while kv < len(keys) and all(found[kv * per:(kv + 1) * per]):
            kv += 1
        hits = {"kv": kv} if kv else {}
        restorable = set(range(1, kv + 1))
        for j, t in enumerate(transfers):
            has = found[n_kv + j * len(keys):n_kv + (j + 1) * len(keys)]
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                edge = next((i for i in range(kv) if not has[i]), kv)
                ok = set(range(1, edge + 1))
            elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                back = max(1, len(t.keys or ()))
                ok = {n for n in range(1, kv + 1) if all(has[max(0, n - back):n])}
            else:  # a policy we do not know: load nothing rather than part of a prefix
                self._warn.warning("policy", "%s: pool %s: hit policy %s not supported: no hit", WHO, t.name,
                                   t.hit_policy)
                ok = set()
            if ok:
                hits[str(t.name)] = max(ok)
            restorable &= ok
        pages = sorted(restorable)
        return PoolTransferResult(pages[-1] if pages else 0, hits, pages)

    def _pool_pages_of(self, t) -> tuple[Any, list[int]]:
        """(host pool, page index of each key) of a v2 transfer."""
        name = str(t.name)
        if name not in self._extra:
            raise InvalidArgumentError(f"{WHO}: pool {name!r} was not registered (register_mem_host_pool_v2)")
        pool, _ = self._extra[name]
        keys, ps = list(t.keys or ()), getattr(pool, "page_size", 1) or 1
        idx = t.host_indices
        if idx is None or idx.numel() != len(keys) * ps:
            raise InvalidArgumentError(f"{WHO}: pool {name!r}: {len(keys)} keys need {len(keys) * ps} host "
                                       f"indices (page size {ps}), got {0 if idx is None else idx.numel()}")
        return pool, idx.reshape(-1)[::ps].tolist()

    def batch_get_v2(self, transfers: list, extra_info: HiCacheStorageExtraInfo | None = None) -> dict:
        """Read each pool's pages into its host pool; a bool per page per pool name.
        Raises as :meth:`batch_set_v2`."""
        return {t.name: self._get_pool(t, extra_info) for t in transfers}

    def batch_set_v2(self, transfers: list, extra_info: HiCacheStorageExtraInfo | None = None) -> dict:
        """Store each pool's pages from its host pool, skipping pages already stored; a
        bool per page per pool name (True: the store holds it now).

        Raises:
            MasterUnavailableError: the store did not answer within ``store_wait_s``.
            InvalidArgumentError: a pool not registered, or host indices that do not hold
                one page per key.
        """
        return {t.name: self._set_pool(t, extra_info) for t in transfers}

    def _get_pool(self, t, extra_info) -> list[bool]:
        name, keys = str(t.name), list(t.keys or ())
        if name == "kv":
            return self.batch_get_v1(keys, t.host_indices, extra_info)
        pool, starts = self._pool_pages_of(t)
        pages = [pool.get_dummy_flat_data_page() for _ in keys]
        ok = self._timed("prefetch", lambda: self._read(self._pool_keys(name, keys),
                                                        [p.view(torch.uint8) for p in pages], False, per=1))
        for start, page, good in zip(starts, pages, ok):
            if good:
                pool.set_from_flat_data_page(start, page)
        return ok

    def _set_pool(self, t, extra_info) -> list[bool]:
        name, keys = str(t.name), list(t.keys or ())
        if name == "kv":
            return self.batch_set_v1(keys, t.host_indices, extra_info)
        pool, starts = self._pool_pages_of(t)
        if not self.is_writer:
            return [True] * len(keys)
        pages = [pool.get_data_page(start, flat=True).contiguous().view(torch.uint8) for start in starts]
        return self._timed("backup", lambda: self._write(self._pool_keys(name, keys), pages, False, per=1))

    # ========================================================== transfers ==
    def _pages_ok(self, ok: list[bool], per: int | None = None) -> list[bool]:
        per = per or len(self._parts)
        return [all(ok[i:i + per]) for i in range(0, len(ok), per)]

    def _read(self, names: list[str], dsts: list[torch.Tensor], direct: bool,
              per: int | None = None) -> tuple[list[bool], int]:
        """Read each object into its view (directly when ``direct``: the views are
        contiguous pool memory). Returns a bool per page and the bytes read."""
        sizes = [v.numel() * v.element_size() for v in dsts]
        ok = [False] * len(names)
        if not names:
            pass
        elif direct:
            got = self.client.batch_get_into(names, [(v.data_ptr(), n) for v, n in zip(dsts, sizes)])
            ok = [self._read_ok(r, n, k) for r, n, k in zip(got, sizes, names)]
        else:
            st = self._staging_for("read")
            with st.lock:
                for run in st.chunks(sizes):
                    slots = [st.slot(off, dsts[i]) for i, off in run]
                    got = self.client.batch_get_into([names[i] for i, _ in run],
                                                     [(s.data_ptr(), sizes[i]) for s, (i, _) in zip(slots, run)])
                    for (i, _), s, r in zip(run, slots, got):
                        ok[i] = self._read_ok(r, sizes[i], names[i])
                        if ok[i]:
                            dsts[i].copy_(s)
        return self._pages_ok(ok, per), sum(n for n, good in zip(sizes, ok) if good)

    def _read_ok(self, result, size: int, name: str) -> bool:
        if isinstance(result, MasterUnavailableError):
            raise result
        if isinstance(result, ObjectNotFoundError):
            return False
        if isinstance(result, BaseException):
            self._warn.warning("read", "%s: reading %s failed: %s", WHO, name, result)
            return False
        if result != size:
            self._warn.warning("read", "%s: %s holds %d bytes, a page component is %d", WHO, name, result, size)
            return False
        return True

    def _write(self, names: list[str], srcs: list[torch.Tensor], direct: bool,
               parents: list[str | None] | None = None, per: int | None = None) -> tuple[list[bool], int]:
        """Store each object not stored yet from its view (naming ``parents[i]`` as its
        parent). Returns a bool per page and the bytes stored (objects already held are
        not counted)."""
        present = self.client.batch_exists(names)
        par = parents if parents is not None else [None] * len(names)
        ok = list(present)
        missing = [i for i, p in enumerate(present) if not p]
        sizes = [srcs[i].numel() * srcs[i].element_size() for i in missing]
        results: list = [None] * len(missing)
        if not missing:
            pass
        elif direct:
            results = self.client.batch_put_from([names[i] for i in missing],
                                                 [(srcs[i].data_ptr(), n) for i, n in zip(missing, sizes)],
                                                 replicas=self.cfg.replicas, parents=[par[i] for i in missing])
        else:
            st = self._staging_for("write")
            with st.lock:
                for run in st.chunks(sizes):
                    bufs = []
                    for j, off in run:
                        slot = st.slot(off, srcs[missing[j]])
                        slot.copy_(srcs[missing[j]])
                        bufs.append((slot.data_ptr(), sizes[j]))
                    res = self.client.batch_put_from([names[missing[j]] for j, _ in run], bufs,
                                                     replicas=self.cfg.replicas,
                                                     parents=[par[missing[j]] for j, _ in run])
                    for (j, _), r in zip(run, res):
                        results[j] = r
        for i, r in zip(missing, results):
            ok[i] = self._write_ok(r, names[i])
        return self._pages_ok(ok, per), sum(n for n, r in zip(sizes, results) if r is None)

    def _write_ok(self, result, name: str) -> bool:
        if result is None or isinstance(result, (ObjectExistsError, ObjectPendingError)):
            return True  # stored, by us or by another rank writing the same page
        if isinstance(result, MasterUnavailableError):
            raise result
        self._warn.warning("write", "%s: storing %s failed: %s", WHO, name, result)
        return False

    def _staging_for(self, direction: str) -> _Staging:
        with self._staging_lock:
            st = self._staging.get(direction)
            if st is None:  # first tensor call on a zero-copy layout
                st = self._staging[direction] = _Staging(self.client, max(self.cfg.staging_bytes, self.page_bytes))
            return st

    # ============================================================ metrics ==
    def _timed(self, op: str, fn: Callable[[], tuple[list[bool], int]]) -> list[bool]:
        t0 = time.perf_counter()
        ok, moved = fn()
        if not self.storage_config.enable_storage_metrics or not moved:
            return ok
        dt = max(time.perf_counter() - t0, 1e-9)
        pages = moved // self.page_bytes
        with self._metrics_lock:
            m = self._metrics
            (m.prefetch_pgs if op == "prefetch" else m.backup_pgs).append(pages)
            (m.prefetch_bandwidth if op == "prefetch" else m.backup_bandwidth).append(moved / dt / (1 << 30))
        return ok

    def get_stats(self) -> StorageMetrics:
        """Pages and bandwidth (GiB/s) of each prefetch and backup batch since the last
        call (empty unless SGLang runs with ``--enable-metrics``); a backup counts only
        what it stored, not pages the store already held."""
        with self._metrics_lock:
            out, self._metrics = self._metrics, StorageMetrics()
        return out

    # ========================================================== lifecycle ==
    def clear(self) -> None:
        """Remove every page under this backend's key prefix (this model, geometry and
        rank), even pages a reader holds. Safe to retry.

        Raises:
            MasterUnavailableError: the store did not answer within ``store_wait_s``.
        """
        if self.prefix is not None:
            n = self.client.remove_prefix(self.prefix, force=True)
            log.info("%s: removed %d objects under %s", WHO, n, self.prefix)

    def close(self) -> None:
        """Unregister the host pool and staging memory from the transport; the store and
        this process's client stay. Idempotent; raises nothing."""
        with self._staging_lock:
            regions = self._regions + [s.region for s in self._staging.values()]
            self._regions, self._staging, self.prefix = [], {}, None
        for r in regions:
            try:
                self.client.unregister_buffer(r)
            except MooncakeRayError as e:
                log.debug("%s: unregistering a buffer: %s", WHO, e)
