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
When the pool is exhausted (its limit is ``recv_pool_bytes``, 0 disables it), tensors are
allocated with ``torch.empty`` and registered for the duration of the read.

Configuration, per process: ``mooncake_ray.config.RdtConfig`` (each setting's default and
meaning): arguments of :func:`register` (carried to the actors created by that process
together with the class Ray ships them) over the environment, with the config's usual
prefix and section, ``MOONCAKE_RAY_RDT__PROTOCOL``, ``MOONCAKE_RAY_RDT__DEVICES``,
``MOONCAKE_RAY_RDT__RECV_POOL_BYTES``, ``MOONCAKE_RAY_RDT__TIMEOUT_S``, or under this
plug-in's older names ``MOONCAKE_RDT_PROTOCOL``, ``MOONCAKE_RDT_DEVICES``,
``MOONCAKE_RDT_RECV_POOL_BYTES``, ``MOONCAKE_RDT_TIMEOUT_S`` (the prefixed ones win). The
store's own config (``load_config``) leaves the ``rdt`` section to the plug-in.

Modules: this one registers the transport and holds the helpers; ``_rdt_transport`` the
transport class, ``_rdt_meta`` the metadata it hands Ray, ``_rdt_engine`` the per-process
engine and ``_rdt_pool`` its receive pool.

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

import threading
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from mooncake_ray.integrations import _rdt_engine
from mooncake_ray.integrations._rdt_meta import MooncakeTransportMetadata
from mooncake_ray.integrations._rdt_transport import (
    TRANSPORT_NAME,
    MooncakeTensorTransport,
    register_class,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "TRANSPORT_NAME",
    "MooncakeTensorTransport",
    "MooncakeTransportMetadata",
    "register",
    "is_registered",
    "empty",
    "engine_stats",
]

_register_lock = threading.Lock()
_bound_classes: Dict[Tuple, type] = {}


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
        register_class(cls)
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
        _rdt_engine.get_engine({})
    pool = _rdt_engine.pool()
    block = pool.alloc(nbytes) if (pool is not None and nbytes) else None
    if block is None:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(block[0], dtype=torch.uint8)[:nbytes].view(dtype).reshape(shape)


def engine_stats() -> Dict[str, Any]:
    """Counters of this process's transport engine and receive pool (empty if unused)."""
    eng, pool = _rdt_engine.engine(), _rdt_engine.pool()
    if eng is None:
        return {}
    out: Dict[str, Any] = dict(eng.stats())
    if pool is not None:
        out.update(pool.stats())
    out["config"] = _rdt_engine.settings().model_dump()
    from ray.experimental.rdt import util as rdt_util

    mgr = rdt_util.transport_managers.get(TRANSPORT_NAME)
    if mgr is not None:
        out.update(rdt_reads=mgr.reads, rdt_read_bytes=mgr.read_bytes,
                   rdt_read_seconds=mgr.read_seconds, rdt_live_objects=len(mgr._objects))
    return out