"""The vLLM connector's direct prefill -> decode read (``_vllm_direct``) between two real
transport engines: KV caches in vLLM's FlashAttention layout on CPU tensors, the prefill's
memory registered in two regions that split a layer, read as ops of arrays. The store's
part (the rendezvous key) is a dict here: these tests are about the read.

These tests open sockets: run them inside a private network namespace (``make test``
does)."""

from __future__ import annotations

import pytest
import torch

from mooncake_ray.integrations._vllm_direct import DirectReader, publish
from mooncake_ray.integrations._vllm_layout import LayerBlocks
from tests.native.transport_util import engines  # noqa: F401 - fixture

LAYERS, BLOCKS, BS, H, D = 4, 64, 16, 2, 64  # parts of 4 KiB


class Rendezvous:
    """What publish and DirectReader ask of a store client: its engine, get and upsert."""

    def __init__(self, engine, board: dict):
        self.engine, self.board = engine, board

    def get(self, key: str) -> bytes:
        return self.board[key]

    def upsert(self, key: str, value: bytes) -> None:
        self.board[key] = value


def kv_layers(fill: bool, flat: torch.Tensor | None = None) -> list[torch.Tensor]:
    shape = (2, BLOCKS, BS, H, D)
    n = 2 * BLOCKS * BS * H * D
    if flat is None:
        flat = torch.zeros(LAYERS * n, dtype=torch.int16)
    if fill:
        flat.random_(-32768, 32767)
    return [flat[i * n:(i + 1) * n].view(torch.bfloat16).view(shape) for i in range(LAYERS)]


@pytest.fixture
def pair(engines):  # noqa: F811 - fixture
    """A prefill worker's published KV (one flat buffer registered as two regions, the cut
    inside layer 1) and a decode worker's reader (one tensor a layer)."""
    board: dict = {}
    pre_eng, dec_eng = engines(name="prefill"), engines(name="decode")
    n = 2 * BLOCKS * BS * H * D
    flat = torch.empty(LAYERS * n, dtype=torch.int16)
    pre_layers = kv_layers(True, flat)
    cut = n + BLOCKS * BS * H * D + 40 * BS * H * D  # layer 1, part 1 (V), block 40
    raw = flat.view(torch.uint8)
    regions = [pre_eng.register(raw[:cut * 2]), pre_eng.register(raw[cut * 2:])]
    pre_blocks = [LayerBlocks(f"model.layers.{i}.self_attn.attn", t) for i, t in enumerate(pre_layers)]
    assert publish(Rendezvous(pre_eng, board), "pre-0", 0, regions, pre_blocks)
    dec_layers = [t.contiguous() for t in kv_layers(False)]
    dec_regs = [dec_eng.register(t.view(torch.int16).view(-1)) for t in dec_layers]
    dec_blocks = [LayerBlocks(f"model.layers.{i}.self_attn.attn", t) for i, t in enumerate(dec_layers)]
    reader = DirectReader(Rendezvous(dec_eng, board), dec_blocks, timeout_s=30)
    yield pre_layers, dec_layers, reader
    for r in regions + dec_regs:
        r.close()


def test_a_decode_worker_reads_the_prefill_workers_blocks_into_its_own(pair):
    pre, dec, reader = pair
    remote, local = [5, 0, 63, 17, 40, 39, 41], [1, 2, 3, 60, 7, 8, 9]  # 39-41: both sides of the cut
    reader.read("pre-0", 0, remote, local)
    for li in range(LAYERS):
        for p in range(2):
            for rb, lb in zip(remote, local):
                assert torch.equal(dec[li][p, lb].view(torch.int16), pre[li][p, rb].view(torch.int16)), (li, p, rb)
            others = [b for b in range(BLOCKS) if b not in local]
            assert not dec[li][p, others].view(torch.int16).any(), (li, p)  # nothing else written


@pytest.mark.parametrize("remote,local,error,match", [
    ([1, 64], [0, 1], ValueError, "remote block 64 outside 64 blocks"),
    ([1, -2], [0, 1], ValueError, "remote block -2 outside"),
    ([1, 2], [0, 64], IndexError, "block 64 outside layer 'model.layers.0.self_attn.attn' of 64 blocks"),
    ([1, 2, 3], [0, 1], ValueError, "3 remote blocks for 2 local ones"),
])
def test_bad_block_ids_are_refused_before_anything_moves(pair, remote, local, error, match):
    pre, dec, reader = pair
    with pytest.raises(error, match=match):
        reader.read("pre-0", 0, remote, local)
    assert not any(t.view(torch.int16).any() for t in dec)
    reader.read("pre-0", 0, [2], [3])  # the reader still works (it reconnects)
    assert torch.equal(dec[0][1, 3].view(torch.int16), pre[0][1, 2].view(torch.int16))


def test_a_layer_count_that_differs_is_refused(pair):
    _, dec, reader = pair
    reader.layers = reader.layers[:3]
    with pytest.raises(ValueError, match="prefill engine pre-0 has 4 layers, this one 3"):
        reader.read("pre-0", 0, [1], [1])
    assert not any(t.view(torch.int16).any() for t in dec)
