"""The staged device path on a GPU: vLLM's KV layouts seen as blocks (LayerBlocks), each
block's parts copied device -> pinned host on a CudaCopyStream (ordered after the torch
stream that wrote them, through a CudaMarker), then host -> device into another tensor of
the same layout at other block ids. Compared on the GPU, byte for byte. Each layout twice:
by the DMA engines, and by the copy kernel (the host buffer is pinned at the same device
address, so the stream may take the batch in one launch)."""

from __future__ import annotations

import numpy as np
import pytest

from mooncake_ray.integrations._vllm_layout import LayerBlocks, block_dim_of
from tests.gpu.gpu_util import say

NB, BS, H, D = 64, 16, 8, 128  # blocks, tokens a block, KV heads, head size
MLA_D = 576  # DeepSeek's MLA latent (512) + rope (64)

# layout: (physical shape, permutation to vLLM's logical shape or None, the bytes of
# block b part p as a slice of the physical tensor)
LAYOUTS = {
    "flash_attn_nhd": ((2, NB, BS, H, D), None, lambda t, b, p: t[p, b]),
    "flash_attn_hnd": ((2, NB, H, BS, D), (0, 1, 3, 2, 4), lambda t, b, p: t[p, b]),
    "flashinfer_nhd": ((NB, 2, BS, H, D), None, lambda t, b, p: t[b]),
    "flashinfer_hnd": ((NB, 2, H, BS, D), (0, 1, 3, 2, 4), lambda t, b, p: t[b]),
    "mla": ((NB, BS, MLA_D), None, lambda t, b, p: t[b]),
}
PARTS = {"flash_attn_nhd": 2, "flash_attn_hnd": 2, "flashinfer_nhd": 1, "flashinfer_hnd": 1, "mla": 1}


def _make(torch, layout: str, dev, random: bool):
    shape, perm, _ = LAYOUTS[layout]
    if random:
        phys = torch.randint(-32768, 32768, shape, dtype=torch.int16, device=dev)
    else:
        phys = torch.zeros(shape, dtype=torch.int16, device=dev)
    phys = phys.view(torch.bfloat16)
    logical = phys.permute(*perm) if perm else phys
    return phys, logical


@pytest.mark.parametrize("copy", ["dma", "kernel"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_staging_layouts(gpu, layout, copy):
    torch, _native, dev = gpu.torch, gpu.native, gpu.dev
    rng = np.random.default_rng(7)
    src_phys, src = _make(torch, layout, gpu.device, True)
    dst_phys, dst = _make(torch, layout, gpu.device, False)
    lb_src, lb_dst = LayerBlocks("layer.0", src), LayerBlocks("layer.0", dst)
    assert lb_src.num_parts == PARTS[layout], (layout, lb_src.num_parts)
    assert lb_src.num_blocks == NB
    part = lb_src.part_bytes
    k = 24
    src_ids = rng.choice(NB, k, replace=False)
    dst_ids = rng.choice(NB, k, replace=False)

    # pinned host staging buffer: block i's parts at (i * parts + p) * part
    host = np.zeros(k * lb_src.num_parts * part, dtype=np.uint8)
    pinned = _native.cuda_host_register(host.ctypes.data, host.nbytes)
    assert pinned, "cuMemHostRegister refused a numpy buffer"
    kernel = copy == "kernel"
    if kernel and not gpu.fake:
        assert _native.cuda_device_addressable(host.ctypes.data), "pinned host memory has another device address"
        assert _native.cuda_copy_kernel_unavailable(dev) == "", _native.cuda_copy_kernel_unavailable(dev)
    try:
        s = _native.CudaCopyStream(dev)
        # the copies must follow torch's kernels that wrote src (no torch.cuda.synchronize)
        s.wait_marker(_native.CudaMarker(dev, gpu.stream()))
        dsts, srcs, lens = [], [], []
        for i, b in enumerate(src_ids):
            for p, (addr, n) in enumerate(lb_src.block(int(b))):
                assert n == part
                dsts.append(host.ctypes.data + (i * lb_src.num_parts + p) * part)
                srcs.append(addr)
                lens.append(n)
        s.copy_many(dsts, srcs, lens, kernel)
        s.synchronize()
        assert s.bytes == host.nbytes

        # the host buffer holds each part's bytes as the physical tensor lays them out
        host_dev = torch.from_numpy(host).to(gpu.device).view(torch.int16)
        per = part // 2
        _, _, part_of = LAYOUTS[layout]
        for i, b in enumerate(src_ids):
            for p in range(lb_src.num_parts):
                want = part_of(src_phys.view(torch.int16), int(b), p).reshape(-1)
                off = (i * lb_src.num_parts + p) * per
                assert torch.equal(host_dev[off:off + per], want), (layout, "d2h", int(b), p)

        # host -> device, into other block ids of a second tensor
        dsts, srcs, lens = [], [], []
        for i, b in enumerate(dst_ids):
            for p, (addr, n) in enumerate(lb_dst.block(int(b))):
                dsts.append(addr)
                srcs.append(host.ctypes.data + (i * lb_dst.num_parts + p) * part)
                lens.append(n)
        s2 = _native.CudaCopyStream(dev)
        s2.copy_many(dsts, srcs, lens, kernel)
        s2.synchronize()
        if not gpu.fake:  # 24 blocks of 1 or 2 parts: one launch each way, or none
            assert (s.kernel_launches, s2.kernel_launches) == ((1, 1) if kernel else (0, 0))
    finally:
        _native.cuda_host_unregister(host.ctypes.data)

    bd = block_dim_of(tuple(src.shape))
    for sb, db in zip(src_ids, dst_ids):
        a = src.select(bd, int(sb)).view(torch.int16)
        b = dst.select(bd, int(db)).view(torch.int16)
        assert torch.equal(a, b), (layout, "h2d", int(sb), int(db))
    untouched = sorted(set(range(NB)) - {int(b) for b in dst_ids})
    for b in untouched:
        assert not dst.select(bd, b).view(torch.int16).any(), (layout, "block written that was not a target", b)
    say(f"staging {layout} ({copy}): shape {tuple(src.shape)} strides {tuple(src.stride())}, {lb_src.num_parts} part(s) "
        f"of {part} B, {k} blocks d2h+h2d, copies {s.copies}+{s2.copies}: exact")
