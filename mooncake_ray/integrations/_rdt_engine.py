"""The Ray Direct Transport plug-in's per-process engine and receive pool (``ray_rdt``),
created on first use with the settings of ``mooncake_ray.config.RdtConfig``."""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, Mapping, Optional

from mooncake_ray.config import RdtConfig, load_rdt_config
from mooncake_ray.integrations._rdt_pool import RecvPool

if TYPE_CHECKING:  # pragma: no cover
    from mooncake_ray._private.transport.engine import Engine

_lock = threading.Lock()
_engine: Optional["Engine"] = None
_settings: Optional[RdtConfig] = None
_pool: Optional[RecvPool] = None


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


def get_engine(overrides: Mapping[str, Any]) -> "Engine":
    """The engine of this process (created on first use: ``overrides`` over the
    environment, see ``load_rdt_config``)."""
    global _engine, _settings, _pool
    eng = _engine
    if eng is not None and not eng.closed:
        return eng
    with _lock:
        if _engine is not None and not _engine.closed:
            return _engine
        from mooncake_ray._private.transport.engine import Engine

        cfg = load_rdt_config(overrides)
        eng = Engine(protocol=cfg.protocol, devices=cfg.devices, name=_process_label(),
                     default_timeout_s=cfg.timeout_s)
        _settings = cfg
        _pool = RecvPool(eng, cfg.recv_pool_bytes)
        _engine = eng
        return eng


def engine() -> Optional["Engine"]:
    """This process's engine, None before its first use."""
    return _engine


def pool() -> Optional[RecvPool]:
    """This process's receive pool, None before the engine's first use."""
    return _pool


def settings() -> RdtConfig:
    """The settings the engine was made with (the defaults before that)."""
    return _settings or RdtConfig()
