"""What the GPU checks share with their peer process and with run.sh: loading the native
module (from the Ray-free stub package run.sh builds, or from the checkout), making a
native transport engine, and a description of the machine.

No pytest and no Ray here: peer.py (a plain script) and run.sh import this file too.

Where ``MCR_GPU_PKG`` is set (run.sh), ``mooncake_ray`` must be the stub package there
(``/tmp/gpu-pkg/mooncake_ray``: the checkout's tree with a Ray-free ``__init__`` and the
module built by run.sh), not the checkout's own package: pytest puts the repository root
first on ``sys.path`` and an editable install adds a finder of its own, and either would
load the real package (Ray, pydantic) and the wrong ``_native``.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def use_stub() -> None:
    """Where ``MCR_GPU_PKG`` names a stub package, make ``mooncake_ray`` resolve to it (the
    conftest calls this at import, before the test modules import anything of the package)."""
    stub = os.environ.get("MCR_GPU_PKG")
    if not stub:
        return
    stub = os.path.abspath(stub)
    # An editable install's finder (scikit-build-core) answers for mooncake_ray before
    # sys.path is searched: drop it, and put the stub ahead of the repository root.
    sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__name__.startswith("ScikitBuild")]
    if stub in sys.path:
        sys.path.remove(stub)
    sys.path.insert(0, stub)
    mod = sys.modules.get("mooncake_ray")
    if mod is not None and not str(getattr(mod, "__file__", "") or "").startswith(stub):
        raise RuntimeError(f"mooncake_ray was imported from {mod.__file__} before the stub package "
                           f"in {stub} could be put first")
    import mooncake_ray

    if not str(mooncake_ray.__file__).startswith(stub):
        raise RuntimeError(f"mooncake_ray resolves to {mooncake_ray.__file__}, not the stub in {stub}")


def load_native():
    """The ``_native`` module, from the stub package when ``MCR_GPU_PKG`` names one."""
    if os.environ.get("MCR_GPU_PKG"):
        use_stub()
    elif "mooncake_ray" not in sys.modules and os.environ.get("MCR_GPU_BARE_PACKAGE"):
        # A peer process of the normal suite: the checkout's package without running its
        # __init__ (which imports Ray, ~2 s), as tests/native/peer_proc.py does.
        pkg = types.ModuleType("mooncake_ray")
        pkg.__path__ = [str(REPO / "mooncake_ray")]
        sys.modules["mooncake_ray"] = pkg
    from mooncake_ray._private.native import _native

    return _native


def native_engine(_native, name: str, protocol: str = "auto", devices=("lo",), num_lanes: int = 2,
                  ucx_options: dict | None = None, **fields):
    """A native TransportEngine (no pydantic config in between). ``fields``: any other
    EngineConfig field (read_mode, write_mode, chunk_bytes...)."""
    cfg = _native.EngineConfig()
    cfg.name = name
    cfg.protocol = protocol
    cfg.devices = list(devices) if devices else None
    cfg.num_lanes = num_lanes
    if ucx_options:
        cfg.ucx_options = dict(ucx_options)
    for k, v in fields.items():
        setattr(cfg, k, v)
    return _native.TransportEngine(cfg)


def cpu_info() -> dict:
    model, flags = "", []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not model and line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    flags = line.split(":", 1)[1].split()
                    break
    except OSError:
        pass
    wanted = [f for f in flags if f in ("avx2", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16",
                                         "amx_int8", "sha_ni", "erms", "fsrm")]
    return {"model": model, "flags": wanted, "cores": os.cpu_count()}


def describe(_native) -> dict:
    """The machine as the checks see it (printed by run.sh, stored in gpu_bench.json)."""
    info: dict = {"python": sys.version.split()[0], "cpu": cpu_info()}
    try:
        info["ucx_version"] = ".".join(map(str, _native.ucx_version()))
    except Exception as e:  # noqa: BLE001
        info["ucx_version"] = f"? ({e})"
    info["cuda_available"] = bool(_native.cuda_available())
    info["cuda_devices"] = _native.cuda_device_count()
    if not info["cuda_available"]:
        info["cuda_unavailable_reason"] = _native.cuda_unavailable_reason()
    mt = {}
    for proto in ("auto", "tcp"):
        try:
            e = native_engine(_native, f"probe-{proto}", protocol=proto, num_lanes=1)
            mt[proto] = list(e.memory_types)
            e.close()
        except Exception as ex:  # noqa: BLE001
            mt[proto] = f"error: {ex}"
    info["memory_types"] = mt
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["card"] = torch.cuda.get_device_name(0)
    except Exception as e:  # noqa: BLE001
        info["torch"] = f"not importable ({type(e).__name__})"
    try:
        import cupy

        info["cupy"] = cupy.__version__
    except Exception as e:  # noqa: BLE001
        info["cupy"] = f"not importable ({type(e).__name__})"
    try:
        import libucx

        info["libucx"] = f"{libucx.__version__} at {os.path.dirname(libucx.__file__)}"
    except Exception as e:  # noqa: BLE001
        info["libucx"] = f"? ({e})"
    import mooncake_ray

    info["mooncake_ray"] = os.path.dirname(mooncake_ray.__file__ or "")
    info["native"] = _native.__file__
    return info


if __name__ == "__main__":  # run.sh: print the machine's description
    import json

    print(json.dumps(describe(load_native()), indent=1))
