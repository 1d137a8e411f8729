"""The vLLM worker stores a block as one value holding every layer: its keys, the ranges
each value is made of (K and V parts of FlashAttention's layout included), what saves and
loads count, and how a layer-wise load reports each layer. A fake client records the calls
(it copies bytes between the ranges as the store would); no Ray, no vLLM."""

import ctypes
import threading
import types

import torch

from mooncake_ray.errors import NoCapacityError, ObjectNotFoundError
from mooncake_ray.integrations._vllm_layout import LayerBlocks
from mooncake_ray.integrations._vllm_plan import BlockRun
from mooncake_ray.integrations._vllm_worker import KVTransfer


class FakeClient:
    """Stores each value's bytes, gathered from its ranges; reads scatter them back."""

    def __init__(self, refuse=()):
        self.puts, self.gets, self.stored, self.refuse = [], [], {}, set(refuse)
        self.pins = {}
        self.held, self.gone = {}, set()  # soft pins of handoff holds; keys to lose before a pin
        self.groups_seen = []

    def register_buffer(self, t):
        return types.SimpleNamespace(path="host", rkey=b"k", addr=t.data_ptr(), length=t.numel(), close=lambda: None)

    def batch_exists(self, keys):
        return [k in self.stored for k in keys]

    def pin(self, key, hard=False, ttl_s=None):
        if key not in self.stored:
            raise ObjectNotFoundError(key)
        self.pins[key] = ttl_s

    def unpin(self, key):
        self.pins.pop(key, None)

    def batch_pin(self, keys, hard=False, ttl_s=None):
        out = []
        for k in keys:
            if k in self.gone:  # evicted between the save's check and its pin
                self.stored.pop(k, None)
                self.gone.discard(k)
            out.append(None if k in self.stored else ObjectNotFoundError(k))
            if k in self.stored:
                self.held[k] = ttl_s
        return out

    def batch_put_from(self, keys, bufs, after=None, parents=None, hold_s=None):
        self.puts.append(list(keys))
        for k in keys:
            if hold_s is not None:
                self.held[k] = hold_s
        self.parents = list(parents) if parents is not None else None
        out = []
        for k, ranges in zip(keys, bufs):
            if k in self.refuse:
                out.append(NoCapacityError(f"no room for {k}"))
            else:
                self.stored[k] = b"".join(ctypes.string_at(a, n) for a, n in ranges)
                out.append(None)
        return out

    def batch_get_into(self, keys, bufs, groups=1, on_group=None):
        self.gets.append(list(keys))
        out, failed = [], set()
        for i, (k, ranges) in enumerate(zip(keys, bufs)):
            if k not in self.stored:
                out.append(ObjectNotFoundError(k))
                failed.add(i)
                continue
            v, at = self.stored[k], 0
            for a, n in ranges:
                ctypes.memmove(a, v[at:at + n], n)
                at += n
            out.append(len(v))
        for g in range(groups):
            self.groups_seen.append(g)
            if on_group is not None:
                on_group(g, set(failed))
        return out


def transfer(client, layers=3, blocks=4, flash=True, layerwise=False):
    """``layers`` KV tensors, FlashAttention's (2, num_blocks, block, heads, head) layout
    (two parts a block) or the CPU backend's (num_blocks, heads, block, 2 * head)."""
    shape = (2, blocks, 16, 2, 64) if flash else (blocks, 2, 16, 128)
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randint(-100, 100, shape, generator=g).to(torch.bfloat16) for _ in range(layers)]
    return KVTransfer(client, "p/", [LayerBlocks(f"l{i}", t) for i, t in enumerate(tensors)], layerwise=layerwise)


def test_a_block_is_one_value_of_every_layers_parts_in_order():
    c = FakeClient()
    t = transfer(c)
    assert t.parts == 2 and t.block_bytes == 3 * 2 * (16 * 2 * 64 * 2)
    t._save([BlockRun("r", 0, ["h0", "h1"], [3, 1])])
    assert c.puts == [["p/h0", "p/h1"]]  # one key a block, one call for the step
    assert c.parents == [None, "p/h0"]  # each block names the one before (chain-aware eviction)
    want = b"".join(layer.tensor[p, 3].contiguous().view(torch.uint8).numpy().tobytes()
                    for layer in t.layers for p in range(2))  # layer 0 K, layer 0 V, layer 1 K, ...
    assert c.stored["p/h0"] == want
    assert t.stats["saved_blocks"] == 2 and t.stats["saved_bytes"] == 2 * t.block_bytes
    assert t.stats["save_cpu_s"] > 0
    t._save([BlockRun("r2", 0, ["h0", "h2"], [3, 0])])  # h0 is there: skipped, not rewritten
    assert c.puts[-1] == ["p/h2"] and t.stats["skipped_blocks"] == 1
    assert c.parents == ["p/h0"]
    t._save([BlockRun("r", 2, ["h3"], [0], parent="h1")])  # a later run names the block before it
    assert c.parents == ["p/h1"]
    t.close()


def test_a_blocks_ranges_come_from_one_table_and_a_bad_id_names_the_layer():
    """The ranges of a block (every layer's parts, in order) as LayerBlocks gives them, for
    both layouts; a block id outside the pool raises IndexError naming the layer."""
    import pytest

    for flash in (True, False):
        t = transfer(FakeClient(), blocks=5, flash=flash)
        for b in range(5):
            assert t._block(b) == [r for layer in t.layers for r in layer.block(b)], (flash, b)
        for b in (5, -1):
            with pytest.raises(IndexError, match=f"block {b} outside layer 'l0' of 5 blocks"):
                t._block(b)
        t.close()


def test_a_refused_block_is_a_failure_and_not_stored():
    c = FakeClient(refuse={"p/h1"})
    t = transfer(c, flash=False)
    t._save([BlockRun("r", 0, ["h0", "h1"], [0, 2])])
    assert set(c.stored) == {"p/h0"}
    assert t.stats["saved_blocks"] == 1 and t.stats["save_failures"] == 1
    t.close()


def test_loads_put_every_layer_back_and_report_missing_blocks():
    c = FakeClient()
    src = transfer(c)
    src._save([BlockRun("r", 0, ["h0", "h1"], [2, 0])])
    dst = transfer(c, layerwise=False)
    for layer in dst.layers:
        layer.tensor.zero_()
    bad = dst._load([BlockRun("q", 0, ["h0", "h1", "h9"], [1, 3, 0])])
    assert bad == {0}  # h9 is not stored: its vLLM block is recomputed
    for a, b in zip(src.layers, dst.layers):
        assert torch.equal(a.tensor[:, 2], b.tensor[:, 1]) and torch.equal(a.tensor[:, 0], b.tensor[:, 3])
        assert not b.tensor[:, 0].any() and not b.tensor[:, 2].any()
    assert dst.stats["loaded_blocks"] == 2 and dst.stats["load_failures"] == 1
    assert dst.stats["loaded_bytes"] == 2 * dst.block_bytes
    src.close()
    dst.close()


def test_layerwise_load_reads_once_and_hands_over_each_layer():
    c = FakeClient()
    src = transfer(c, layers=4)
    src._save([BlockRun("r", 0, ["h0", "h1"], [0, 1])])
    dst = transfer(c, layers=4, layerwise=True)
    gate = threading.Event()
    real = c.batch_get_into

    def held(*a, **kw):
        gate.wait(5)
        return real(*a, **kw)

    c.batch_get_into = held
    dst.start_loads([BlockRun("a", 0, ["h0"], [2]), BlockRun("b", 0, ["h1", "h7"], [3, 0])])
    assert not dst._layer_futs[0].done()  # the forward waits for layer 0 until it lands
    gate.set()
    for i in range(4):
        dst.wait_layer(f"l{i}")
    assert c.gets == [["p/h0", "p/h1", "p/h7"]] and c.groups_seen == [0, 1, 2, 3]  # one read, four layers
    assert dst.load_errors() == {0}
    for a, b in zip(src.layers, dst.layers):
        assert torch.equal(a.tensor[:, 0], b.tensor[:, 2]) and torch.equal(a.tensor[:, 1], b.tensor[:, 3])
    src.close()
    dst.close()


def test_layerwise_load_that_raises_fails_every_block_of_it():
    c = FakeClient()
    t = transfer(c, layerwise=True)

    def boom(*a, **kw):
        raise ConnectionError("store gone")

    c.batch_get_into = boom
    t.start_loads([BlockRun("a", 0, ["h0", "h1"], [1, 2])])
    t.wait_all_layers()
    assert t.load_errors() == {1, 2} and t.stats["load_failures"] == 2
    t.close()


def test_a_conversation_hint_pins_the_last_saved_block_and_moves_forward():
    c = FakeClient()
    t = transfer(c)
    t._save([BlockRun("r", 0, ["h0", "h1"], [3, 1], keep=("conv", 60.0))])
    assert c.pins == {"p/h1": 60.0}
    t._save([BlockRun("r", 2, ["h2"], [0], parent="h1", keep=("conv", 60.0))])
    assert c.pins == {"p/h2": 60.0}  # one pin per conversation: its newest block
    t._save([BlockRun("q", 0, ["h9"], [2])])
    assert c.pins == {"p/h2": 60.0}
    t.close()


def test_a_held_save_holds_the_blocks_stored_before_it_and_stores_again_those_lost():
    """A prefill for a remote decode whose prefix was in the store: its save holds the
    stored blocks with one pin call (they are not written again), stores and holds the new
    ones, and a block evicted between the check and the pin is stored again, held."""
    c = FakeClient()
    t = transfer(c)
    t._save([BlockRun("old", 0, ["h0", "h1", "h2"], [0, 1, 2])])  # an earlier request stored these
    assert c.held == {}
    c.gone.add("p/h1")
    t._save([BlockRun("r", 0, ["h0", "h1", "h2", "h3"], [0, 1, 2, 3], hold_s=30.0)])
    assert c.held == {"p/h0": 30.0, "p/h1": 30.0, "p/h2": 30.0, "p/h3": 30.0}
    assert c.puts[-1] == ["p/h1", "p/h3"]  # only the lost block and the new one were written
    assert t.stats["skipped_blocks"] == 2 and t.stats["saved_blocks"] == 5
    t._save([BlockRun("q", 0, ["h0", "h4"], [0, 3])])  # no hold: nothing pinned
    assert "p/h4" not in c.held
    t.close()
