"""The copy kernel of CudaCopyStream on a GPU: many ranges of odd sizes and alignments in
one launch (16-byte words where a range allows, bytes where not), host -> device, device
-> host and device -> device, against numpy's copies of the same ranges. The destination
is poisoned first: every byte outside the ranges must keep the poison, every byte inside
must be the source's. A batch the auto rule leaves to the DMA engines (few, large ranges)
launches nothing."""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.gpu_util import MiB, say

N = 32 * MiB


def _ranges(rng, n: int, max_len: int, align: int):
    """n non-overlapping (dst_off, src_off, len) in [0, N), shuffled, each a multiple of
    `align` in offset and length when align > 1, else anything."""
    lens = rng.integers(1, max_len, n)
    if align > 1:
        lens = np.maximum(lens // align, 1) * align
    slot = N // n
    lens = np.minimum(lens, slot - align)
    out = []
    dst_slots, src_slots = rng.permutation(n), rng.permutation(n)
    for i in range(n):
        pad = int(rng.integers(0, slot - lens[i] + 1))
        if align > 1:
            pad = pad // align * align
        out.append((int(dst_slots[i]) * slot + pad, int(src_slots[i]) * slot + pad, int(lens[i])))
    return out


@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
@pytest.mark.parametrize("align", [16, 1], ids=["aligned", "odd"])
def test_copy_kernel_ranges(gpu, direction, align):
    if gpu.fake:
        pytest.skip("MCR_GPU_FAKE: the kernel needs a GPU (the host stream has no kernel)")
    torch, _native = gpu.torch, gpu.native
    assert _native.cuda_copy_kernel_unavailable(gpu.dev) == "", _native.cuda_copy_kernel_unavailable(gpu.dev)
    rng = np.random.default_rng({"h2d": 1, "d2h": 2, "d2d": 3}[direction] * 10 + align)
    src_np = rng.integers(0, 256, N, dtype=np.uint8)
    host = np.full(N, 0xA5, dtype=np.uint8)
    assert _native.cuda_host_register(host.ctypes.data, N)
    try:
        assert _native.cuda_device_addressable(host.ctypes.data)
        if direction == "h2d":
            host[:] = src_np
            dev = torch.full((N,), 0xA5, dtype=torch.uint8, device=gpu.device)
            src_addr, dst_addr = host.ctypes.data, dev.data_ptr()
        elif direction == "d2h":
            dev = torch.from_numpy(src_np).to(gpu.device)
            src_addr, dst_addr = dev.data_ptr(), host.ctypes.data
        else:
            dev_src = torch.from_numpy(src_np).to(gpu.device)
            dev = torch.full((N,), 0xA5, dtype=torch.uint8, device=gpu.device)
            src_addr, dst_addr = dev_src.data_ptr(), dev.data_ptr()
        gpu.sync()
        ranges = _ranges(rng, 2000, 64 << 10, align)
        s = _native.CudaCopyStream(gpu.dev)
        s.copy_many([dst_addr + d for d, _, _ in ranges], [src_addr + o for _, o, _ in ranges],
                    [n for _, _, n in ranges], True)
        s.synchronize()
        assert s.kernel_launches == 1
        want = np.full(N, 0xA5, dtype=np.uint8)
        for d, o, n in ranges:
            want[d:d + n] = src_np[o:o + n]
        got = host if direction == "d2h" else dev.cpu().numpy()
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, f"{direction}/{align}: {bad.size} bytes differ, first at {bad[:5]}"

        # few large ranges: auto leaves them to the DMA engines
        s2 = _native.CudaCopyStream(gpu.dev)
        s2.copy_many([dst_addr, dst_addr + 8 * MiB], [src_addr + 16, src_addr + 8 * MiB + 16], [4 * MiB, 4 * MiB], True)
        s2.synchronize()
        assert s2.kernel_launches == 0
        say(f"copy kernel {direction} ({'16-byte aligned' if align > 1 else 'odd'} ranges): "
            f"{len(ranges)} ranges, {sum(n for _, _, n in ranges)} B in one launch: exact")
    finally:
        _native.cuda_host_unregister(host.ctypes.data)
