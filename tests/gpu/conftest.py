"""The GPU checks (tests/gpu): run on a GPU machine by tests/gpu/run.sh, skipped elsewhere.

Every test here asks for ``gpu`` (autouse): without a CUDA device, or without torch seeing
one, each skips with the reason. They import only what loads without Ray or pydantic (the
native module and ``integrations._vllm_layout``; engines are native ones), so the same
files run in the normal suite (real package, CPU: all skip) and under run.sh (stub
package, GPU). ``MCR_GPU_FAKE=1`` runs them without a GPU, host memory standing in for it
(gpu_util.FakeNative): a check of the checks, not of CUDA.
"""

from __future__ import annotations

import os
import types

import pytest

from tests.gpu import gpu_env

gpu_env.use_stub()  # under run.sh: mooncake_ray is the Ray-free stub, before any test module imports it

from tests.gpu.gpu_util import FakeEngine, FakeNative, Peer  # noqa: E402

FAKE = os.environ.get("MCR_GPU_FAKE") == "1"


def _probe():
    try:
        _native = gpu_env.load_native()
    except Exception as e:  # noqa: BLE001 - reported as the skip reason
        return None, f"native module not importable: {type(e).__name__}: {e}"
    if not _native.cuda_available():
        return _native, f"no GPU: {_native.cuda_unavailable_reason()}"
    try:
        import torch
    except ImportError as e:
        return _native, f"torch not importable: {e}"
    if not torch.cuda.is_available():
        return _native, f"torch {torch.__version__} sees no CUDA device"
    return _native, None


@pytest.fixture(scope="session")
def gpu():
    """The native module, torch, the device and how to wait for it; skips without a GPU
    (MCR_GPU_FAKE=1: host memory stands in for it, see gpu_util.FakeNative)."""
    _native, why = _probe()
    fake = bool(why) and FAKE and _native is not None
    if why and not fake:
        pytest.skip(why)
    import torch

    if fake:
        return types.SimpleNamespace(
            native=FakeNative(_native), torch=torch, dev=0, device=torch.device("cpu"), name="fake GPU (host memory)",
            fake=True, sync=lambda: None, stream=lambda: 0, pinned=lambda n: torch.empty(n, dtype=torch.uint8))
    torch.cuda.set_device(0)
    return types.SimpleNamespace(
        native=_native, torch=torch, dev=0, device=torch.device("cuda", 0), name=torch.cuda.get_device_name(0),
        fake=False, sync=torch.cuda.synchronize, stream=lambda: torch.cuda.current_stream(0).cuda_stream,
        pinned=lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True))


@pytest.fixture(autouse=True)
def _requires_gpu(gpu):
    yield


@pytest.fixture
def engines(gpu):
    """make(name, **kw) -> a native engine (gpu_env.native_engine); all closed at teardown."""
    made = []

    def make(name: str, **kw):
        e = gpu_env.native_engine(gpu.native, name, **kw)
        made.append(e)
        return FakeEngine(e) if gpu.fake else e

    yield make
    for e in reversed(made):
        e.close()


@pytest.fixture
def spawn_peer(gpu):
    """spawn(**cfg) -> Peer (peer.py); all stopped at teardown."""
    made = []

    def spawn(**cfg):
        p = Peer(**cfg)
        made.append(p)
        return p

    yield spawn
    for p in made:
        p.close()
