"""Device memory as the client sees it: which buffers are GPU memory, which path moves
them, and how a batch is cut into groups for the staged path. Pure: no Ray, no CUDA
calls except ``cuda_device_of`` where a pointer's device is not given.

Paths (``client.device_path``, chosen once per registered buffer):

- ``direct``: UCX registers the device memory (``ucp_mem_map`` with memory type CUDA);
  the transport moves it (on one host, the CUDA driver copies between it and the mapped
  arena; elsewhere UCX's cuda_copy, cuda_ipc or GPUDirect RDMA). Needs a UCX whose CUDA
  transports loaded: the engine's ``memory_types`` then include ``cuda``.
- ``staged``: bytes go through a pinned host buffer registered with the transport, with
  copies on a stream of our own, group by group, overlapped with the transfers.
- ``host``: host memory, registered as it always was.

``auto`` takes ``direct`` where the engine can register CUDA memory, else ``staged``.
Forcing ``staged`` also stages host memory: on a CPU machine that runs the staged path
end to end (a copy thread stands in for the CUDA stream).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from mooncake_ray.errors import ConfigError, InvalidArgumentError

HOST, CUDA = "host", "cuda"
PATHS = ("auto", "direct", "staged")
_DLPACK_CUDA = 2  # DLDeviceType kDLCUDA (kDLCUDAHost, 3, is pinned host memory)


@dataclass(frozen=True)
class DeviceMem:
    """A contiguous range of device memory: ``nbytes`` at ``addr`` on CUDA device
    ``device``; ``keep`` holds the owning object alive."""

    addr: int
    nbytes: int
    device: int
    keep: Any = None


def _torch_cuda(t: Any) -> DeviceMem:
    if not t.is_contiguous():
        raise InvalidArgumentError(
            f"CUDA tensor of shape {tuple(t.shape)} is not contiguous: call .contiguous() first")
    index = t.device.index
    return DeviceMem(t.data_ptr(), t.numel() * t.element_size(), 0 if index is None else index, t)


def _array_interface(buf: Any, cai: dict) -> DeviceMem:
    shape = tuple(cai["shape"])
    itemsize = int(cai["typestr"][2:])
    strides = cai.get("strides")
    if strides is not None:
        expect, step = [], itemsize
        for d in reversed(shape):
            expect.append(step)
            step *= d
        if tuple(strides) != tuple(reversed(expect)):
            raise InvalidArgumentError(f"CUDA array with strides {tuple(strides)} is not C-contiguous")
    n = itemsize
    for d in shape:
        n *= d
    addr = int(cai["data"][0])
    dev = getattr(getattr(buf, "device", None), "id", None)
    if dev is None:
        from mooncake_ray._private.native import _native

        dev = max(_native.cuda_device_of(addr), 0)
    return DeviceMem(addr, n, int(dev), buf)


def describe(buf: Any) -> DeviceMem | None:
    """The device memory of ``buf`` (a torch CUDA tensor, a cupy array or anything with
    ``__cuda_array_interface__``, a DLPack CUDA tensor), or None for anything else.

    Raises:
        InvalidArgumentError: device memory that is not contiguous.
    """
    mod = type(buf).__module__ or ""
    if mod.startswith("torch") and hasattr(buf, "data_ptr"):
        return _torch_cuda(buf) if buf.device.type == "cuda" else None
    if isinstance(buf, (bytes, bytearray, memoryview, tuple)):
        return None
    cai = getattr(buf, "__cuda_array_interface__", None)
    if cai is not None:
        return _array_interface(buf, cai)
    dl = getattr(buf, "__dlpack_device__", None)
    if dl is not None:
        try:
            dev_type, _ = dl()
        except Exception:  # noqa: BLE001 - not a DLPack producer after all
            return None
        if int(dev_type) == _DLPACK_CUDA:
            import torch  # the one DLPack consumer we rely on

            return _torch_cuda(torch.from_dlpack(buf))
    return None


def choose_path(kind: str, memory_types: Sequence[str], setting: str) -> str:
    """``direct``, ``staged`` or ``host`` for memory of ``kind`` (``host`` | ``cuda``), given
    the engine's registrable ``memory_types`` and the ``device_path`` setting.

    Raises:
        ConfigError: ``direct`` forced where the engine cannot register CUDA memory, or an
            unknown setting.
    """
    if setting not in PATHS:
        raise ConfigError(f"device_path {setting!r} is not one of {', '.join(map(repr, PATHS))}")
    if kind == HOST:
        return "staged" if setting == "staged" else "host"
    if setting == "staged":
        return "staged"
    if CUDA in memory_types:
        return "direct"
    if setting == "direct":
        raise ConfigError(
            f"device_path='direct' but this engine's UCX registers only {list(memory_types)}: it needs a "
            "UCX with CUDA transports (libucx-cu12 / libucx-cu13) on a machine with a GPU driver; use "
            "'auto' or 'staged' to go through pinned host memory")
    return "staged"


def groups(sizes: Sequence[int], capacity: int, align: int = 64) -> list[list[int]]:
    """Cuts items of ``sizes`` (in order) into groups whose aligned sizes fit in
    ``capacity`` bytes each. An item larger than ``capacity`` forms a group of its own
    (the caller moves it through a buffer of its size)."""
    out: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, n in enumerate(sizes):
        need = -(-n // align) * align
        if cur and used + need > capacity:
            out.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += need
    if cur:
        out.append(cur)
    return out


def offsets(sizes: Sequence[int], align: int = 64) -> list[int]:
    """Where each item of one group starts in the staging half it goes through."""
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += -(-n // align) * align
    return out
