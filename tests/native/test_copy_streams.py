"""The copy streams of the staged device-memory path, on a machine without a GPU: the host
stream (a copy thread standing in for a CUDA stream) keeps order and merges adjacent
copies; the CUDA side says clearly that it is not there."""

import numpy as np
import pytest

from mooncake_ray.errors import InvalidArgumentError
from mooncake_ray._private.native import _native


def test_host_stream_copies_in_order_and_merges_neighbours():
    src = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    s = _native.HostCopyStream()
    a, b = src.ctypes.data, dst.ctypes.data
    # four 64 KiB copies continuing each other in both memories, then one more far away
    s.copy_many([b + i * 65536 for i in range(4)] + [b + 900_000],
                [a + i * 65536 for i in range(4)] + [a + 10],
                [65536] * 4 + [100])
    # queued after the first batch: overwrites part of what it wrote
    s.copy_many([b], [a + 500_000], [4096], addressable=True)  # no kernel on a host stream: the same copy
    s.synchronize()
    assert s.copies == 3 and s.bytes == 4 * 65536 + 100 + 4096  # the four merged into one
    assert s.kernel_launches == 0
    assert np.array_equal(dst[:4096], src[500_000:504_096])
    assert np.array_equal(dst[4096:262144], src[4096:262144])
    assert np.array_equal(dst[900_000:900_100], src[10:110])
    assert not dst[262144:900_000].any()


def test_copy_lists_are_checked():
    s = _native.HostCopyStream()
    with pytest.raises(InvalidArgumentError, match="2 destinations, 1 sources and 2 lengths"):
        s.copy_many([1, 2], [3], [4, 5])
    with pytest.raises(InvalidArgumentError, match="copy 0 is not a memory range"):
        s.copy_many([0], [4096], [8])


@pytest.mark.skipif(_native.cuda_available(), reason="this machine has a GPU (tests/gpu checks CUDA)")
def test_without_a_gpu_cuda_is_reported_unavailable():
    assert not _native.cuda_available() and _native.cuda_device_count() == 0
    assert "libcuda" in _native.cuda_unavailable_reason() or "device" in _native.cuda_unavailable_reason()
    buf = np.zeros(4096, dtype=np.uint8)
    assert _native.cuda_device_of(buf.ctypes.data) == -1
    assert _native.cuda_host_register(buf.ctypes.data, buf.nbytes) is False
    with pytest.raises(InvalidArgumentError, match="CUDA is not available"):
        _native.CudaCopyStream(0)
    # the copy kernel: nothing to load it into, and no address a device could use
    assert _native.cuda_copy_kernel_unavailable(0) != ""
    assert _native.cuda_device_addressable(buf.ctypes.data) is False
    assert _native.cuda_copy_kernel_mode() == 2  # auto, unless MCR_CUDA_COPY_KERNEL says otherwise
    assert _native.cuda_copy_kernel_mode(0) == 2 and _native.cuda_copy_kernel_mode() == 0
    assert _native.cuda_copy_kernel_mode(2) == 0
