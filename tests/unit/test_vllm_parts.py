"""The vLLM worker's saves where a layer's block has two parts (FlashAttention's K and V):
part 0, the key the scheduler's lookup asks for, goes in only after the other part of its
(block, layer) is stored. A fake client records the calls; no Ray, no vLLM."""

import types

import torch

from mooncake_ray.errors import NoCapacityError
from mooncake_ray.integrations._vllm_layout import LayerBlocks
from mooncake_ray.integrations._vllm_plan import BlockRun
from mooncake_ray.integrations._vllm_worker import KVTransfer


class FakeClient:
    def __init__(self, refuse=()):
        self.calls, self.stored, self.refuse = [], {}, set(refuse)

    def register_buffer(self, t):
        return types.SimpleNamespace(path="host", rkey=b"k", addr=t.data_ptr(), length=t.numel(), close=lambda: None)

    def batch_exists(self, keys):
        return [k in self.stored for k in keys]

    def batch_put_from(self, keys, bufs, after=None):
        self.calls.append(list(keys))
        out = []
        for k, (addr, n) in zip(keys, bufs):
            if k in self.refuse:
                out.append(NoCapacityError(f"no room for {k}"))
            else:
                self.stored[k] = (addr, n)
                out.append(None)
        return out


def transfer(client, layers=2, blocks=4):
    tensors = [torch.zeros((2, blocks, 16, 2, 64), dtype=torch.bfloat16) for _ in range(layers)]
    return KVTransfer(client, "p/", [LayerBlocks(f"l{i}", t) for i, t in enumerate(tensors)], layerwise=False)


def test_part_zero_goes_in_after_the_others():
    c = FakeClient()
    t = transfer(c)
    assert t.parts == 2
    t._save([BlockRun("r", 0, ["h0", "h1"], [3, 1])])
    assert c.calls == [["p/h0/0.1", "p/h0/1.1", "p/h1/0.1", "p/h1/1.1"], ["p/h0/0", "p/h0/1", "p/h1/0", "p/h1/1"]]
    layer0 = t.layers[0]
    assert c.stored["p/h0/0"] == layer0.block(3)[0] and c.stored["p/h0/0.1"] == layer0.block(3)[1]
    assert t.stats["saved_blocks"] == 2 and t.stats["save_failures"] == 0
    t.close()


def test_a_refused_part_keeps_its_part_zero_out():
    c = FakeClient(refuse={"p/h1/1.1"})
    t = transfer(c)
    t._save([BlockRun("r", 0, ["h0", "h1"], [0, 2])])
    assert c.calls[1] == ["p/h0/0", "p/h0/1", "p/h1/0"]  # not p/h1/1: its V part was refused
    assert "p/h1/1" not in c.stored
    assert t.stats["saved_blocks"] == 1 and t.stats["save_failures"] == 1
    t.close()
