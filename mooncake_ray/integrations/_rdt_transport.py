"""The Ray Direct Transport plug-in's transport class (``ray_rdt``): the source side
registers the tensors' storages and describes them, the receiver side reads them with one
batched one-sided read into its receive pool; see ``ray_rdt``'s docstring."""

from __future__ import annotations

import logging
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from mooncake_ray.integrations import _rdt_engine
from mooncake_ray.integrations._rdt_meta import (
    MooncakeCommunicatorMetadata,
    MooncakeFetchRequest,
    MooncakeTransportMetadata,
    SourceReg,
    raise_rdt,
)
from mooncake_ray.integrations._rdt_pool import ALIGN
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

logger = logging.getLogger(__name__)

TRANSPORT_NAME = "MOONCAKE"
_POLL_S = 0.05  # wait_fetch_complete re-checks aborts this often


class MooncakeTensorTransport(TensorTransportManager):
    """One-sided RDT transport over the mooncake-ray UCX engine (torch CPU tensors)."""

    #: settings given to :func:`register` (a subclass carries them to actors)
    _overrides: Dict[str, Any] = {}

    def __init__(self):
        self._lock = threading.RLock()
        # (storage data_ptr, nbytes) -> registration shared by every live object naming it
        self._source_regs: Dict[Tuple[int, int], SourceReg] = {}
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
        return _rdt_engine.get_engine(type(self)._overrides)

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

    def _register_storage(self, eng: "Engine", storage: Any) -> SourceReg:
        addr, nbytes = storage.data_ptr(), storage.nbytes()
        pool = _rdt_engine.pool()
        arena = pool.find(addr, nbytes) if pool is not None else None
        if arena is not None:  # already shared memory of ours: readers memcpy it
            return SourceReg(arena, False, storage, 0)
        return SourceReg(eng.register((addr, nbytes)), True, storage, 0)

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
                raise_rdt(f"mooncake RDT transfer of object {obj_id} was aborted")
            self._reap_limbo()
        tensor_meta = meta.tensor_meta
        if not tensor_meta:
            return MooncakeFetchRequest(obj_id=obj_id, tensors=[], finished=True)
        started = time.monotonic()
        eng = self.engine()
        src = meta.engine_name or "?"
        timeout = _rdt_engine.settings().timeout_s

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
            pool = _rdt_engine.pool()
            for b, n in zip(tensors, sizes):
                if n and (pool is None or pool.find(b.data_ptr(), n) is None):
                    temp_regions.append(eng.register((b.data_ptr(), n)))
        else:
            offsets, total = [], 0
            for n in sizes:
                offsets.append(total)
                total += -(-n // ALIGN) * ALIGN
            pool = _rdt_engine.pool()
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
            raise_rdt(
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
        own = _rdt_engine.settings().timeout_s
        ray_deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        own_deadline = req.started + own
        while True:
            now = time.monotonic()
            with self._lock:
                if req.obj_id in self._aborted:
                    self._aborted.discard(req.obj_id)
                    self._abandon(req)
                    raise_rdt(f"mooncake RDT transfer of object {req.obj_id} from "
                               f"{req.source!r} was aborted by Ray")
            if ray_deadline is not None and now >= ray_deadline:
                self._abandon(req)
                raise TimeoutError(
                    f"mooncake RDT transfer of object {req.obj_id} ({req.nbytes} bytes from "
                    f"{req.source!r}) did not complete within {timeout}s")
            if now >= own_deadline:
                self._abandon(req)
                raise_rdt(f"mooncake RDT transfer of object {req.obj_id} ({req.nbytes} bytes "
                           f"from {req.source!r}) did not complete within {own}s "
                           f"(set MOONCAKE_RAY_RDT__TIMEOUT_S to wait longer)")
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
                raise_rdt(
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
            register_class(cls)
        rdt_util.get_tensor_transport_manager(TRANSPORT_NAME).engine()
        return True
    except Exception:  # noqa: BLE001 - reported as "transport unavailable"
        logger.exception("mooncake RDT transport unavailable in this actor")
        return False


def register_class(cls: type) -> None:
    """Registers ``cls`` with Ray under TRANSPORT_NAME in this process."""
    import torch

    from ray.experimental import register_tensor_transport

    register_tensor_transport(TRANSPORT_NAME, ["cpu"], cls, torch.Tensor)
