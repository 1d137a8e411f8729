"""Our UCX transport as a Ray Direct Transport (RDT) for torch CPU tensors.

Usage (driver)::

    import ray, torch
    from mooncake_ray.integrations import ray_rdt

    ray.init(...)
    ray_rdt.register()                  # before the actor classes below are defined

    @ray.remote
    class Producer:
        @ray.method(tensor_transport="mooncake")
        def make(self):
            return torch.randn(1 << 24)

    @ray.remote(enable_tensor_transport=True)   # receivers need it too (see below)
    class Consumer:
        def use(self, t):
            return float(t.sum())

    ref = producer.make.remote()
    consumer.use.remote(ref)            # the tensor moves actor to actor over UCX
    ray.get(ref)                        # the driver can read it the same way

How it works. The transport is one-sided, like Ray's NIXL transport: Ray never calls
``send_multiple_tensors``. When an RDT method returns, Ray calls
``extract_tensor_transport_metadata`` in the source actor: the tensors' storages are
registered with a per-process :class:`Engine` (created lazily) and the metadata (shapes,
dtypes, the engine's address, one packed rkey per storage, offsets) travels through the
owner to the receiver. There ``fetch_multiple_tensors`` connects to the source engine
(endpoints are cached by the engine), carves the destination tensors out of a pre-faulted,
registered receive pool (or uses ``target_buffers``), and issues one batched one-sided read;
``wait_fetch_complete`` polls it, honouring Ray's timeout and ``abort_transport``. When
Ray's reference counting frees the object it calls ``garbage_collect`` in the source,
which unregisters storages no longer named by any live object.

Read paths (chosen by the engine per remote region): a source storage that is ordinary
process memory is read with UCX ``get`` (cma / process_vm_readv on one host, tcp across
hosts); a source storage that lives in one of our arenas (a tensor this process received
through the transport, or one allocated with :func:`empty`) is read with a plain memcpy
through the shared mapping on one host.

Receive pool. First touch of fresh memory runs at ~2 GB/s here, slower than the transfer
itself, so received tensors are views into UCX arenas allocated (and pre-faulted) once and
reused: a block returns to the pool when the last tensor or storage viewing it is freed.
When the pool is exhausted (its limit is ``MOONCAKE_RDT_RECV_POOL_BYTES``, 0 disables it),
tensors are allocated with ``torch.empty`` and registered for the duration of the read.

Configuration, per process: arguments of :func:`register` (carried to the actors created
by that process together with the class Ray ships them), else the environment:

    MOONCAKE_RDT_PROTOCOL        "auto" (default) | "tcp" | "shm" | "rdma"
    MOONCAKE_RDT_DEVICES         comma-separated UCX devices, default "lo"; "" = UCX default
    MOONCAKE_RDT_RECV_POOL_BYTES receive-pool limit, default 1 GiB; 0 disables the pool
    MOONCAKE_RDT_TIMEOUT_S       connect / transfer timeout when Ray gives none, default 60

(The names deliberately avoid the ``MOONCAKE_RAY_`` prefix: that prefix is parsed into
the store's strict config, which would reject unknown keys.)

What Ray 2.60 requires, found by reading ``ray/experimental/rdt`` and ``ray/actor.py``:

* CPU tensors are fine for custom transports: the only device check is
  ``device_match_transport(tensor_device, transport)`` against the ``devices`` list given
  to ``register_tensor_transport`` (we pass ``["cpu"]``). Ray's own GLOO transport is
  CPU-only the same way.
* ``@ray.method(tensor_transport="mooncake")`` validates the name when the class body is
  executed, so :func:`register` must run in the driver before the actor classes are
  defined (and before any ``ray.put(..., _tensor_transport="mooncake")``).
* Registration in actor processes is done by Ray, not by us: when a process that has
  registered a custom transport creates an actor with tensor transport enabled, Ray
  (``register_custom_tensor_transports_on_actor``) runs a ``__ray_call__`` on the actor's
  ``_ray_system`` concurrency group that registers every custom transport known to the
  creator (our class is pickled by reference, or by value when :func:`register` was given
  settings), and waits for it before the first RDT call or transfer involving the actor.
  Consequences: (1) a *receiving* actor also needs ``enable_tensor_transport=True``.
  Without it, ``__ray_recv__`` runs on the actor's only task thread; when the consumer
  task gets there first it blocks waiting for tensors the queued receive would deliver,
  until Ray's RDT timeout (60 s) kills both actors. Seen here with Ray's GLOO and with this
  transport alike, intermittently (ray-project/ray#66264); we log and warn when we see
  such a receiver (``get_communicator_metadata``), but cannot refuse it safely, since Ray
  also calls that hook from a native callback. (2) Actors created by another process (an
  actor that creates actors, the Serve controller's replicas, another driver) are only
  covered if that process called :func:`register` too; otherwise the RDT call fails with
  "ValueError: Unsupported tensor transport protocol: MOONCAKE" (seen here with an actor
  creating the producer and consumer). (3) Ray registers once per actor handle, so an
  actor restarted after a crash loses the registration (read in the code, not tried).
  For (2) and (3) run :func:`register` in every worker:
  ``ray.init(runtime_env={"worker_process_setup_hook":
  "mooncake_ray.integrations.ray_rdt.register"})`` (the nested case above then works),
  or call it in the actor's ``__init__``.
* ``actor_has_tensor_transport`` is called by Ray on *every* ``.remote()`` of an RDT
  method (NIXL answers with a blocking actor round trip each time); we ask each actor
  once — the question also registers the transport there and creates its engine, so the
  first transfer does not pay for it — and cache the answer in the calling process.
* Once a worker has used any RDT transport, Ray serialises every torch tensor that worker
  returns *outside* RDT methods with ``pickle.dumps`` (a side effect of how it installs
  its tensor serializer), which is slower than its default path: measure the object store
  with actors that never used RDT.

Errors: a source that is dead or unreachable, a source that no longer has the memory
registered, a transfer that fails half-way or is aborted raise
``ray.exceptions.RayDirectTransportError`` with the object id, the source engine's name
and the engine's own error; a timeout given by Ray (``ray.get(timeout=...)``) raises
``TimeoutError`` as the RDT contract asks.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from mooncake_ray.integrations._rdt_pool import ALIGN, RecvPool
from ray.experimental.rdt.tensor_transport_manager import (
    CommunicatorMetadata,
    FetchRequest,
    TensorTransportManager,
    TensorTransportMetadata,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

    import ray
    from mooncake_ray._private.transport.engine import Engine

__all__ = [
    "TRANSPORT_NAME",
    "MooncakeTensorTransport",
    "MooncakeTransportMetadata",
    "register",
    "is_registered",
    "empty",
    "engine_stats",
]

logger = logging.getLogger(__name__)

TRANSPORT_NAME = "MOONCAKE"

ENV_PROTOCOL = "MOONCAKE_RDT_PROTOCOL"
ENV_DEVICES = "MOONCAKE_RDT_DEVICES"
ENV_RECV_POOL = "MOONCAKE_RDT_RECV_POOL_BYTES"
ENV_TIMEOUT = "MOONCAKE_RDT_TIMEOUT_S"

_DEFAULTS: Dict[str, Any] = {
    "protocol": "auto",
    "devices": ["lo"],
    "recv_pool_bytes": 1 << 30,
    "timeout_s": 60.0,
}
_POLL_S = 0.05  # wait_fetch_complete re-checks aborts this often


# ---- configuration --------------------------------------------------------------------
def _env_config() -> Dict[str, Any]:
    cfg: Dict[str, Any] = {}
    if ENV_PROTOCOL in os.environ:
        cfg["protocol"] = os.environ[ENV_PROTOCOL].strip().lower()
    if ENV_DEVICES in os.environ:
        raw = os.environ[ENV_DEVICES].strip()
        cfg["devices"] = [d.strip() for d in raw.split(",") if d.strip()]
    if ENV_RECV_POOL in os.environ:
        from mooncake_ray.config import parse_size

        cfg["recv_pool_bytes"] = int(parse_size(os.environ[ENV_RECV_POOL]))
    if ENV_TIMEOUT in os.environ:
        cfg["timeout_s"] = float(os.environ[ENV_TIMEOUT])
    return cfg


def _effective_config(overrides: Dict[str, Any]) -> Dict[str, Any]:
    return {**_DEFAULTS, **_env_config(), **overrides}


# ---- the per-process engine and receive pool ------------------------------------------
_engine_lock = threading.Lock()
_engine: Optional["Engine"] = None
_engine_config: Optional[Dict[str, Any]] = None
_pool: Optional["RecvPool"] = None


def _process_label() -> str:
    try:
        import ray

        ctx = ray.get_runtime_context()
        aid = ctx.get_actor_id()
        if aid:
            return f"rdt-actor-{aid[:12]}-{os.getpid()}"
    except Exception:  # noqa: BLE001 - Ray not initialised: still a usable name
        pass
    return f"rdt-driver-{os.getpid()}"


def _get_engine(overrides: Dict[str, Any]) -> "Engine":
    """The engine of this process (created on first use with the given settings)."""
    global _engine, _engine_config, _pool
    eng = _engine
    if eng is not None and not eng.closed:
        return eng
    with _engine_lock:
        if _engine is not None and not _engine.closed:
            return _engine
        from mooncake_ray._private.transport.engine import Engine

        cfg = _effective_config(overrides)
        eng = Engine(
            protocol=cfg["protocol"],
            devices=cfg["devices"] or None,
            name=_process_label(),
            default_timeout_s=cfg["timeout_s"],
        )
        _engine_config = cfg
        _pool = RecvPool(eng, int(cfg["recv_pool_bytes"]))
        _engine = eng
        return eng


def _get_pool() -> Optional["RecvPool"]:
    return _pool


# ---- metadata ------------------------------------------------------------------------
@dataclass
class MooncakeCommunicatorMetadata(CommunicatorMetadata):
    """Nothing to agree on beforehand: the source's address travels in the tensor metadata."""


@dataclass
class MooncakeTransportMetadata(TensorTransportMetadata):
    """Tensor metadata plus what a reader needs to fetch them.

    Args:
        engine_address: the source engine's address (``Engine.address``).
        engine_name: the source engine's name (for error messages).
        regions: one (rkey, base address, length) per registered storage.
        placements: one (region index, offset in the region, nbytes) per tensor; region
            index -1 for empty tensors.
    """

    engine_address: Optional[bytes] = None
    engine_name: str = ""
    regions: List[Tuple[bytes, int, int]] = field(default_factory=list)
    placements: List[Tuple[int, int, int]] = field(default_factory=list)

    __eq__ = object.__eq__
    __hash__ = object.__hash__


@dataclass
class _SourceReg:
    region: Any  # Region, or an arena Region we do not own
    owned: bool
    storage: Any  # keeps the memory alive while registered
    count: int


@dataclass
class MooncakeFetchRequest(FetchRequest):
    """State of a read started by ``fetch_multiple_tensors``."""

    handle: Any = None
    source: str = ""
    nbytes: int = 0
    started: float = 0.0
    temp_regions: List[Any] = field(default_factory=list)
    transport: Any = None
    finished: bool = False

    def __del__(self):
        t = self.transport
        if t is not None and not self.finished:
            try:
                t._abandon(self)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


def _raise_rdt(msg: str, cause: Optional[BaseException] = None):
    from ray.exceptions import RayDirectTransportError

    if cause is not None:
        msg = f"{msg}: {type(cause).__name__}: {cause}"
    raise RayDirectTransportError(msg) from cause


# ---- the transport -------------------------------------------------------------------
class MooncakeTensorTransport(TensorTransportManager):
    """One-sided RDT transport over the mooncake-ray UCX engine (torch CPU tensors)."""

    #: settings given to :func:`register` (a subclass carries them to actors)
    _overrides: Dict[str, Any] = {}

    def __init__(self):
        self._lock = threading.RLock()
        # (storage data_ptr, nbytes) -> registration shared by every live object naming it
        self._source_regs: Dict[Tuple[int, int], _SourceReg] = {}
        # obj_id -> storage keys it holds (decremented by garbage_collect)
        self._objects: Dict[str, List[Tuple[int, int]]] = {}
        self._aborted: set = set()
        # (handle, fetch request) of reads abandoned before completion: their memory is
        # kept until the engine is done with it
        self._limbo: List[Tuple[Any, Any]] = []
        self._actors_ok: set = set()
        self._warned: set = set()
        self.reads = 0  # completed reads, their bytes and seconds (start to completion)
        self.read_bytes = 0
        self.read_seconds = 0.0

    # -- identity ----------------------------------------------------------------------
    def tensor_transport_backend(self) -> str:
        return TRANSPORT_NAME

    @staticmethod
    def is_one_sided() -> bool:
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        return True

    def engine(self) -> "Engine":
        return _get_engine(type(self)._overrides)

    # -- owner side --------------------------------------------------------------------
    def actor_has_tensor_transport(self, actor: "ray.actor.ActorHandle") -> bool:
        import ray

        key = actor._actor_id.hex()
        if key in self._actors_ok:
            return True
        ok = ray.get(
            actor.__ray_call__.options(concurrency_group="_ray_system").remote(
                _actor_side_check, type(self)
            )
        )
        if ok:
            self._actors_ok.add(key)
        return bool(ok)

    def get_communicator_metadata(self, src_actor, dst_actor, backend=None):
        if dst_actor is not None and not getattr(dst_actor, "_ray_enable_tensor_transport", True):
            key = dst_actor._actor_id.hex()
            if key not in self._warned:
                self._warned.add(key)
                # Not raised: Ray also calls this from a native callback (a transfer queued
                # until the source's task finishes), where an exception would crash.
                msg = (f"mooncake RDT: the receiving actor {dst_actor} was created without "
                       "enable_tensor_transport=True: the transfer then runs on the thread "
                       "of its tasks, and a task waiting for the tensors deadlocks it until "
                       "Ray's RDT timeout (RAY_rdt_fetch_fail_timeout_milliseconds, 60 s). "
                       "Declare the receiver with @ray.remote(enable_tensor_transport=True).")
                logger.error(msg)
                warnings.warn(msg, RuntimeWarning, stacklevel=2)
        return MooncakeCommunicatorMetadata()

    # -- source side -------------------------------------------------------------------
    def extract_tensor_transport_metadata(
        self, obj_id: str, rdt_object: List["torch.Tensor"]
    ) -> MooncakeTransportMetadata:
        import torch

        if not rdt_object:
            return MooncakeTransportMetadata(tensor_meta=[], tensor_device=None)
        for t in rdt_object:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"mooncake RDT moves torch tensors, got {type(t).__name__}")
            if t.device.type != "cpu":
                raise ValueError(
                    f"mooncake RDT moves CPU tensors only; got a tensor on {t.device}")
            if not t.is_contiguous():
                raise ValueError(
                    "All tensors in an RDT object must be contiguous (call .contiguous()).")
        eng = self.engine()
        regions: List[Tuple[bytes, int, int]] = []
        region_index: Dict[Tuple[int, int], int] = {}
        placements: List[Tuple[int, int, int]] = []
        keys: List[Tuple[int, int]] = []
        with self._lock:
            try:
                for t in rdt_object:
                    nbytes = t.numel() * t.element_size()
                    if nbytes == 0:
                        placements.append((-1, 0, 0))
                        continue
                    storage = t.untyped_storage()
                    key = (storage.data_ptr(), storage.nbytes())
                    reg = self._source_regs.get(key)
                    if reg is None:
                        reg = self._register_storage(eng, storage)
                        self._source_regs[key] = reg
                    reg.count += 1
                    keys.append(key)
                    r = reg.region
                    if key not in region_index:
                        region_index[key] = len(regions)
                        regions.append((r.rkey, r.addr, r.length))
                    placements.append((region_index[key], t.data_ptr() - r.addr, nbytes))
            except BaseException:
                self._release(keys)
                raise
            self._objects[obj_id] = self._objects.get(obj_id, []) + keys
        return MooncakeTransportMetadata(
            tensor_meta=[(t.shape, t.dtype) for t in rdt_object],
            tensor_device="cpu",
            engine_address=eng.address,
            engine_name=eng.name,
            regions=regions,
            placements=placements,
        )

    def _register_storage(self, eng: "Engine", storage: Any) -> _SourceReg:
        addr, nbytes = storage.data_ptr(), storage.nbytes()
        pool = _get_pool()
        arena = pool.find(addr, nbytes) if pool is not None else None
        if arena is not None:  # already shared memory of ours: readers memcpy it
            return _SourceReg(arena, False, storage, 0)
        return _SourceReg(eng.register((addr, nbytes)), True, storage, 0)

    def _release(self, keys: List[Tuple[int, int]]) -> None:
        for key in keys:
            reg = self._source_regs.get(key)
            if reg is None:
                continue
            reg.count -= 1
            if reg.count <= 0:
                del self._source_regs[key]
                if reg.owned:
                    reg.region.close()
                # drop our references now: a closed Region that is still referenced makes
                # the engine refuse later transfers touching its (possibly reused) range

    def garbage_collect(self, obj_id: str, tensor_transport_meta, tensors) -> None:
        with self._lock:
            keys = self._objects.pop(obj_id, None)
            if keys:
                self._release(keys)

    def send_multiple_tensors(self, tensors, tensor_transport_metadata, communicator_metadata):
        raise NotImplementedError(
            "the mooncake transport is one-sided: the receiver reads, nothing is sent")

    # -- receiver side -----------------------------------------------------------------
    def fetch_multiple_tensors(
        self,
        obj_id: str,
        tensor_transport_metadata: TensorTransportMetadata,
        communicator_metadata: CommunicatorMetadata,
        target_buffers: Optional[List["torch.Tensor"]] = None,
    ) -> MooncakeFetchRequest:
        import torch

        meta = tensor_transport_metadata
        if not isinstance(meta, MooncakeTransportMetadata):
            raise TypeError(f"expected MooncakeTransportMetadata, got {type(meta).__name__}")
        with self._lock:
            if obj_id in self._aborted:
                self._aborted.discard(obj_id)
                _raise_rdt(f"mooncake RDT transfer of object {obj_id} was aborted")
            self._reap_limbo()
        tensor_meta = meta.tensor_meta
        if not tensor_meta:
            return MooncakeFetchRequest(obj_id=obj_id, tensors=[], finished=True)
        started = time.monotonic()
        eng = self.engine()
        src = meta.engine_name or "?"
        timeout = _engine_config["timeout_s"] if _engine_config else _DEFAULTS["timeout_s"]

        # 1. destination tensors
        temp_regions: List[Any] = []
        sizes = [p[2] for p in meta.placements]
        if target_buffers:
            tensors = list(target_buffers)
            if len(tensors) != len(tensor_meta):
                raise ValueError(f"{len(tensors)} target buffers for {len(tensor_meta)} tensors")
            for i, (b, n) in enumerate(zip(tensors, sizes)):
                if b.device.type != "cpu" or not b.is_contiguous():
                    raise ValueError(f"target buffer {i} must be a contiguous CPU tensor")
                if b.numel() * b.element_size() != n:
                    raise ValueError(
                        f"target buffer {i} holds {b.numel() * b.element_size()} bytes, "
                        f"the object's tensor {n}")
            local = [b.data_ptr() for b in tensors]
            pool = _get_pool()
            for b, n in zip(tensors, sizes):
                if n and (pool is None or pool.find(b.data_ptr(), n) is None):
                    temp_regions.append(eng.register((b.data_ptr(), n)))
        else:
            offsets, total = [], 0
            for n in sizes:
                offsets.append(total)
                total += -(-n // ALIGN) * ALIGN
            pool = _get_pool()
            block = pool.alloc(total) if (pool is not None and total) else None
            if block is not None:
                flat = torch.frombuffer(block[0], dtype=torch.uint8)
            else:
                flat = torch.empty(max(total, 1), dtype=torch.uint8)
                temp_regions.append(eng.register((flat.data_ptr(), flat.numel())))
            tensors, local = [], []
            for (shape, dtype), off, n in zip(tensor_meta, offsets, sizes):
                if n == 0:
                    tensors.append(torch.empty(shape, dtype=dtype))
                    local.append(0)
                    continue
                tensors.append(flat[off:off + n].view(dtype).reshape(shape))
                local.append(flat.data_ptr() + off)
            del flat

        # 2. connect, import the source's regions, start one batched read
        try:
            peer = eng.connect(meta.engine_address, timeout_s=timeout)
            rrs = [eng.import_remote(peer, rkey, base, length)
                   for rkey, base, length in meta.regions]
            ops = [(rrs[ri], off, la, n)
                   for (ri, off, n), la in zip(meta.placements, local) if n]
            handle = eng.read_async(ops)
        except Exception as e:  # noqa: BLE001 - mapped to one clear error
            for r in temp_regions:
                r.close()
            temp_regions.clear()
            _raise_rdt(
                f"mooncake RDT: cannot read object {obj_id} from source engine {src!r} "
                "(the source actor may have died, or freed the object)", e)
        return MooncakeFetchRequest(
            obj_id=obj_id, tensors=tensors, handle=handle, source=src, nbytes=sum(sizes),
            started=started, temp_regions=temp_regions, transport=self)

    def wait_fetch_complete(self, fetch_request: FetchRequest, timeout: float = -1) -> List[Any]:
        req = fetch_request
        if not isinstance(req, MooncakeFetchRequest):
            raise TypeError(f"expected MooncakeFetchRequest, got {type(req).__name__}")
        if req.finished:
            return req.tensors
        own = _engine_config["timeout_s"] if _engine_config else _DEFAULTS["timeout_s"]
        ray_deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        own_deadline = req.started + own
        while True:
            now = time.monotonic()
            with self._lock:
                if req.obj_id in self._aborted:
                    self._aborted.discard(req.obj_id)
                    self._abandon(req)
                    _raise_rdt(f"mooncake RDT transfer of object {req.obj_id} from "
                               f"{req.source!r} was aborted by Ray")
            if ray_deadline is not None and now >= ray_deadline:
                self._abandon(req)
                raise TimeoutError(
                    f"mooncake RDT transfer of object {req.obj_id} ({req.nbytes} bytes from "
                    f"{req.source!r}) did not complete within {timeout}s")
            if now >= own_deadline:
                self._abandon(req)
                _raise_rdt(f"mooncake RDT transfer of object {req.obj_id} ({req.nbytes} bytes "
                           f"from {req.source!r}) did not complete within {own}s "
                           f"(set {ENV_TIMEOUT} to wait longer)")
            step = min(_POLL_S, own_deadline - now,
                       (ray_deadline - now) if ray_deadline is not None else _POLL_S)
            try:
                req.handle.wait(max(step, 0.0))
                break
            except Exception as e:  # noqa: BLE001
                from mooncake_ray import errors

                if isinstance(e, errors.TransferTimeoutError) and not req.handle.done():
                    continue  # not complete yet: poll again
                self._finish(req)
                _raise_rdt(
                    f"mooncake RDT transfer of object {req.obj_id} ({req.nbytes} bytes) from "
                    f"source engine {req.source!r} failed (the source actor may have died "
                    "mid-transfer)", e)
        self._finish(req, ok=True)
        return req.tensors

    def recv_multiple_tensors(self, obj_id, tensor_transport_metadata, communicator_metadata,
                              target_buffers=None):
        req = self.fetch_multiple_tensors(obj_id, tensor_transport_metadata,
                                          communicator_metadata, target_buffers)
        return self.wait_fetch_complete(req)

    def _finish(self, req: MooncakeFetchRequest, ok: bool = False) -> None:
        req.finished = True
        if ok:
            self.reads += 1
            self.read_bytes += req.nbytes
            self.read_seconds += time.monotonic() - req.started
        for r in req.temp_regions:
            r.close()
        req.temp_regions = []

    def _abandon(self, req: MooncakeFetchRequest) -> None:
        """Gives up on a read; its memory stays with us until the engine is done with it."""
        if req.finished:
            return
        req.finished = True
        h = req.handle
        if h is not None and not h.done():
            h.cancel()
            with self._lock:
                self._limbo.append((h, (req.tensors, req.temp_regions)))
        else:
            for r in req.temp_regions:
                r.close()
        req.tensors = []
        req.temp_regions = []

    def _reap_limbo(self) -> None:
        keep = []
        for h, (tensors, regions) in self._limbo:
            if h.done():
                for r in regions:
                    r.close()
            else:
                keep.append((h, (tensors, regions)))
        self._limbo = keep

    def abort_transport(self, obj_id: str, communicator_metadata: CommunicatorMetadata) -> None:
        with self._lock:
            self._aborted.add(obj_id)


def _actor_side_check(actor_self: Any, cls: type) -> bool:
    """Runs in an actor (``__ray_call__``): makes sure the transport is registered there and
    its engine is up; False (logged) if the engine cannot start."""
    try:
        from ray.experimental.rdt import util as rdt_util

        rdt_util._ensure_default_transports_registered()
        if TRANSPORT_NAME not in rdt_util.transport_manager_info:
            _register_class(cls)
        rdt_util.get_tensor_transport_manager(TRANSPORT_NAME).engine()
        return True
    except Exception:  # noqa: BLE001 - reported as "transport unavailable"
        logger.exception("mooncake RDT transport unavailable in this actor")
        return False


# ---- registration --------------------------------------------------------------------
_register_lock = threading.Lock()
_bound_classes: Dict[Tuple, type] = {}


def _register_class(cls: type) -> None:
    import torch

    from ray.experimental import register_tensor_transport

    register_tensor_transport(TRANSPORT_NAME, ["cpu"], cls, torch.Tensor)


def is_registered() -> bool:
    """Whether this process has the mooncake transport registered with Ray."""
    from ray.experimental.rdt import util as rdt_util

    return TRANSPORT_NAME in rdt_util.transport_manager_info


def register(
    protocol: Optional[str] = None,
    devices: Optional[List[str]] = None,
    recv_pool_bytes: Optional[int] = None,
    timeout_s: Optional[float] = None,
) -> type:
    """Registers the "mooncake" tensor transport with Ray in this process. Idempotent.

    Call it in the driver before defining actor classes that use
    ``@ray.method(tensor_transport="mooncake")``; Ray then registers it in the actors that
    this process creates. It may also serve as a ``worker_process_setup_hook`` to cover
    every worker of a job.

    Args override the environment (see the module docstring) in this process and in the
    actors it creates; None keeps the environment's value or the default.

    Returns:
        The registered transport class.

    Raises:
        ValueError: the transport is already registered here with different settings, or
            another class is registered under the name "MOONCAKE".
    """
    from ray.experimental.rdt import util as rdt_util

    overrides: Dict[str, Any] = {}
    if protocol is not None:
        overrides["protocol"] = str(protocol).lower()
    if devices is not None:
        overrides["devices"] = [devices] if isinstance(devices, str) else list(devices)
    if recv_pool_bytes is not None:
        overrides["recv_pool_bytes"] = int(recv_pool_bytes)
    if timeout_s is not None:
        overrides["timeout_s"] = float(timeout_s)
    with _register_lock:
        if overrides:
            key = tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                               for k, v in overrides.items()))
            cls = _bound_classes.get(key)
            if cls is None:
                # Defined here, not importable by name: cloudpickle ships it to the actors
                # by value, settings included.
                cls = type("MooncakeTensorTransport", (MooncakeTensorTransport,),
                           {"_overrides": dict(overrides), "__module__": __name__})
                _bound_classes[key] = cls
        else:
            cls = MooncakeTensorTransport
        rdt_util._ensure_default_transports_registered()
        info = rdt_util.transport_manager_info.get(TRANSPORT_NAME)
        if info is not None:
            have = info.transport_manager_class
            if not (isinstance(have, type) and issubclass(have, MooncakeTensorTransport)):
                raise ValueError(f"another transport ({have!r}) is registered as {TRANSPORT_NAME}")
            if overrides and have._overrides != overrides:
                raise ValueError(
                    f"the mooncake transport is already registered in this process with "
                    f"settings {have._overrides or 'from the environment'}; got {overrides}")
            return have
        _register_class(cls)
        return cls


# ---- helpers -------------------------------------------------------------------------
def empty(shape, dtype=None) -> "torch.Tensor":
    """A CPU tensor allocated in this process's transport arena (the receive pool).

    Returning such a tensor from an RDT method lets same-host readers copy it with a plain
    memcpy through shared memory instead of a UCX get. Falls back to ``torch.empty`` when
    the pool is full or disabled.
    """
    import torch

    dtype = dtype or torch.get_default_dtype()
    t = torch.empty(shape, dtype=dtype, device="meta")
    nbytes = t.numel() * t.element_size()
    if is_registered():
        from ray.experimental.rdt import util as rdt_util

        rdt_util.get_tensor_transport_manager(TRANSPORT_NAME).engine()
    else:
        _get_engine({})
    pool = _get_pool()
    block = pool.alloc(nbytes) if (pool is not None and nbytes) else None
    if block is None:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(block[0], dtype=torch.uint8)[:nbytes].view(dtype).reshape(shape)


def engine_stats() -> Dict[str, Any]:
    """Counters of this process's transport engine and receive pool (empty if unused)."""
    eng, pool = _engine, _pool
    if eng is None:
        return {}
    out: Dict[str, Any] = dict(eng.stats())
    if pool is not None:
        out.update(pool.stats())
    out["config"] = dict(_engine_config or {})
    from ray.experimental.rdt import util as rdt_util

    mgr = rdt_util.transport_managers.get(TRANSPORT_NAME)
    if mgr is not None:
        out.update(rdt_reads=mgr.reads, rdt_read_bytes=mgr.read_bytes,
                   rdt_read_seconds=mgr.read_seconds, rdt_live_objects=len(mgr._objects))
    return out
