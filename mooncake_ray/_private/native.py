"""Loads the compiled ``mooncake_ray._native`` module.

The UCX shared libraries come from the ``libucx`` wheel; its loader puts them in the
process's library cache so the module (and UCX's own transport plugins) resolve them
whatever the RPATH says.

UCX's memory hooks. Loading ``libucs`` installs hooks on mmap, munmap, brk and friends so
that UCX's registration caches learn when registered memory goes away. By default it
patches those functions' code in place (``UCX_MEM_MMAP_HOOK_MODE=bistro``), which took
0.35-0.40 s of CPU per process on a 2-vCPU host: every store actor, master, engine,
Serve replica and CLI call that imports this package paid it at start. Only transports
that register memory keep such a cache: RDMA (``/sys/class/infiniband``), CUDA and ROCm
devices, knem and xpmem. On a host with none of them the hooks serve nothing, so UCX's
memory events are turned off for the load (``UCX_MEM_EVENTS=n``), unless the user set
them; on a host with any of them UCX keeps its defaults.
"""

from __future__ import annotations

import os

try:
    import libucx
except ImportError:  # pragma: no cover - an install without one of the UCX extras
    raise ImportError(
        "mooncake-ray needs UCX from PyPI: install mooncake-ray[cu12] (libucx-cu12: CUDA 12 drivers, or no GPU) "
        "or mooncake-ray[cu13] (libucx-cu13: CUDA 13 only)") from None

# Device files and class directories whose presence means some UCX transport may keep a
# registration cache (and so needs the memory hooks).
REGISTERING_DEVICES = ("/dev/nvidiactl", "/dev/kfd", "/dev/knem", "/dev/xpmem")
RDMA_CLASS = "/sys/class/infiniband"


def memory_hooks_needed(devices: tuple[str, ...] = REGISTERING_DEVICES, rdma_class: str = RDMA_CLASS) -> bool:
    """Whether a UCX transport on this host may register memory: an RDMA device, a GPU
    (CUDA or ROCm), knem or xpmem."""
    if any(os.path.exists(p) for p in devices):
        return True
    try:
        return bool(os.listdir(rdma_class))
    except OSError:
        return False


_HOOKS_OFF = "UCX_MEM_EVENTS" not in os.environ and not memory_hooks_needed()
if _HOOKS_OFF:
    os.environ["UCX_MEM_EVENTS"] = "n"  # read once, by libucs's constructor below
try:
    libucx.load_library()
finally:
    if _HOOKS_OFF:  # the process's children decide for themselves
        os.environ.pop("UCX_MEM_EVENTS", None)

from mooncake_ray import _native  # noqa: E402

__all__ = ["_native", "memory_hooks_needed"]
