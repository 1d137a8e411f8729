"""Hybrid models in the vLLM connector, without an engine: which KV cache groups are
accepted or refused (vLLM's own spec classes), the hit every kind accepts, which blocks a
hit loads and a step saves, state pages, and a request that loads whole or fails whole."""

import time

import pytest
import torch

from mooncake_ray.errors import ConfigError
from mooncake_ray.integrations._vllm_groups import FULL, STATE, WINDOW, Kind, hit_blocks, is_plain, kinds_of, state_block
from mooncake_ray.integrations._vllm_layout import LayerBlocks
from mooncake_ray.integrations._vllm_plan import HybridPlan
from mooncake_ray.integrations._vllm_worker import KVTransfer
from tests.unit.test_vllm_blocks import FakeClient

from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec, CircularBufferSpec, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec,
)

BS = 16


def full(bs=BS):
    return FullAttentionSpec(block_size=bs, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


def swa(window=40, bs=BS):
    return SlidingWindowSpec(block_size=bs, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=window)


def mamba(mode="align", bs=BS):
    return MambaSpec(block_size=bs, shapes=((3, 8), (2, 4, 4)), dtypes=(torch.bfloat16, torch.float32),
                     mamba_cache_mode=mode)


def config(*specs) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec([f"layers.{i}"], s) for i, s in enumerate(specs)])


# ------------------------------------------------------------------ kinds ----
def test_groups_of_one_kind_are_stored_together():
    kinds, bs = kinds_of(config(swa(), full(), swa(), mamba(), mamba()))
    assert bs == BS
    assert [(k.tag, k.rule, k.groups) for k in kinds] == [("swa40", WINDOW, (0, 2)), ("full", FULL, (1,)),
                                                          ("ssm", STATE, (3, 4))]
    assert kinds[0].window_blocks == 3  # 39 tokens back: 3 blocks of 16
    assert kinds[0].layers == (("layers.0",), ("layers.2",))
    assert is_plain(kinds_of(config(full()))[0]) and not is_plain(kinds)


@pytest.mark.parametrize("specs, words", [
    ((full(), mamba("none")), ["group 1", "MambaSpec", "mamba_cache_mode='none'", "align"]),
    ((full(), mamba("all")), ["group 1", "mamba_cache_mode='all'"]),
    ((full(), ChunkedLocalAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                                        attention_chunk_size=64)), ["group 1", "ChunkedLocalAttentionSpec"]),
    ((full(), swa(bs=32)), ["different block sizes", "16", "32"]),
    ((), ["no KV cache groups"]),
])
def test_what_cannot_be_stored_completely_is_refused_by_name(specs, words):
    with pytest.raises(ConfigError) as e:
        kinds_of(config(*specs))
    for w in words:
        assert w in str(e.value)


def test_a_group_vllm_does_not_prefix_cache_is_refused():
    ring = CircularBufferSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="group 1 .*CircularBufferSpec.* not prefix-cacheable"):
        kinds_of(config(full(), ring))


# -------------------------------------------------------------------- hits ----
F, W, S = Kind("full", FULL, (0,), ()), Kind("swa", WINDOW, (1,), (), window_blocks=2), Kind("ssm", STATE, (2,), ())


def present(stored: dict[str, set[int]]):
    return lambda k, i: i in stored.get(k.tag, set())


@pytest.mark.parametrize("stored, first, last, want", [
    ({"full": set(range(10)), "swa": set(range(10))}, 0, 10, 10),
    ({"full": set(range(10)), "swa": {7, 8}}, 0, 10, 9),            # the window ends where its last 2 blocks are
    ({"full": set(range(6)), "swa": {3, 4, 5, 8, 9}}, 0, 10, 6),     # full attention stops at 6; swa has 4, 5
    ({"full": set(range(10)), "swa": {0}}, 0, 10, 1),                # from the start fewer than a window is a hit
    ({"full": set(range(10)), "swa": set()}, 0, 10, 0),
    ({"full": set(range(10)), "swa": {5}}, 5, 10, 6),                # the engine holds blocks below 5
    ({"full": set(range(10)), "swa": {5}}, 4, 10, 4),                # ... but not block 4
    ({"full": set(range(10)), "ssm": {2, 6}}, 0, 10, 7),             # the last stored state
    ({"full": set(range(5)), "ssm": {2, 6}}, 0, 10, 3),
    ({"full": set(range(10)), "ssm": set()}, 0, 10, 0),
    ({"full": set(range(10)), "ssm": {6}, "swa": {5, 6}}, 0, 10, 7),
    ({"full": set(range(10)), "ssm": {6, 8}, "swa": {5, 6}}, 0, 10, 7),  # swa lowers 9 to 7, ssm agrees
    ({"full": set(range(10)), "ssm": {8}, "swa": {5, 6}}, 0, 10, 0),     # no point both accept
])
def test_the_hit_is_the_longest_every_kind_accepts(stored, first, last, want):
    kinds = [F] + [k for k in (W, S) if k.tag in stored]
    got = hit_blocks(kinds, first, last, present(stored))
    assert got == max(want, first)
    if got > first:  # and every block the kinds need at that point is there
        assert all(i in stored[k.tag] for k in kinds for i in k.needs(first, got))


def test_window_rule_case_with_a_gap():
    # swa {3, 5}: at 6 the window is 4, 5 (4 missing); at 5: 3, 4 (4 missing); at 4: 2, 3 (2 missing);
    # from the start: block 0 missing. Nothing is a hit.
    assert hit_blocks([F, W], 0, 10, present({"full": set(range(6)), "swa": {3, 5}})) == 0


def test_a_state_is_stored_only_where_a_step_ends_on_a_block_boundary():
    assert state_block(320, 160) == 1 and state_block(330, 160) is None and state_block(0, 160) is None


# -------------------------------------------------------------------- plan ----
def plan(kinds, **kw):
    return HybridPlan(4, kinds, **kw)


def tokens(n):
    return list(range(1, n + 1))


def ids(kinds, n_blocks, base=100):
    """Block ids per group: group g's block i is base * (g + 1) + i."""
    groups = max(g for k in kinds for g in k.groups) + 1
    return tuple([base * (g + 1) + i for i in range(n_blocks)] for g in range(groups))


def test_a_hit_loads_what_each_kind_needs_with_one_lookup():
    p = plan([F, W, S])
    calls = []

    def lookup(pairs):
        calls.append(pairs)
        return [True] * len(pairs)

    assert p.match("r", tokens(41), 0, lookup) == 40  # 10 blocks; the one holding the last token is not
    assert len(calls) == 1 and len(calls[0]) == 3 * 10
    p.allocated("r", ids([F, W, S], 11), 40)
    loads = {run.kind: run for run in p.step([], lambda r: ()).loads}
    assert loads["full"].block_ids == [(100 + i,) for i in range(10)]
    assert loads["swa"].first == 8 and loads["swa"].block_ids == [(208,), (209,)]
    assert loads["ssm"].first == 9 and loads["ssm"].block_ids == [(309,)]
    assert loads["ssm"].hashes == [p.hashes("r", tokens(41), 10)[9]]


def test_fewer_tokens_taken_than_found_load_the_window_at_the_new_end():
    p = plan([F, W])
    p.match("r", tokens(41), 0, lambda pairs: [True] * len(pairs))
    p.allocated("r", ids([F, W], 11), 24)  # vLLM took 6 blocks
    loads = {run.kind: run for run in p.step([], lambda r: ()).loads}
    assert loads["full"].first == 0 and len(loads["full"].block_ids) == 6
    assert loads["swa"].first == 4 and loads["swa"].block_ids == [(204,), (205,)]


def test_steps_save_every_attention_block_and_the_state_at_a_step_end():
    k = [F, W, S]
    p = plan(k)
    t = tokens(30)
    p.match("r", t, 0, lambda pairs: [False] * len(pairs))
    table = ids(k, 8)
    saves = p.step([("r", t, 30, 0, 16)], lambda r: table).saves  # 16 tokens: blocks 0-3, a state at 16
    got = {run.kind: run for run in saves}
    assert got["full"].block_ids == [(100,), (101,), (102,), (103,)] and got["swa"].first == 0
    assert got["ssm"].first == 3 and got["ssm"].block_ids == [(303,)]
    assert p.step([("r", t, 30, 16, 6)], lambda r: table).saves[0].kind == "full"  # 22: block 4, no state
    saves = p.step([("r", t, 30, 22, 2)], lambda r: table).saves  # 24: block 5 and its state
    assert {run.kind: [b[0] for b in run.block_ids] for run in saves} == {"full": [105], "swa": [205],
                                                                          "ssm": [305]}


def test_blocks_vllm_already_released_are_not_saved():
    p = plan([F, W], null_block=0)
    t = tokens(30)
    p.match("r", t, 0, lambda pairs: [False] * len(pairs))
    table = ([100, 101, 102, 103], [0, 0, 202, 203])  # the window's first blocks already released
    saves = {run.kind: run for run in p.step([("r", t, 30, 0, 16)], lambda r: table).saves}
    assert saves["swa"].first == 2 and saves["swa"].block_ids == [(202,), (203,)]
    assert len(saves["full"].block_ids) == 4


def test_a_request_with_a_local_hit_saves_only_past_it():
    p = plan([F, S])
    t = tokens(30)
    p.match("r", t, 16, lambda pairs: [False] * len(pairs))
    table = ids([F, S], 8)
    saves = {run.kind: run for run in p.step([("r", t, 30, 16, 8)], lambda r: table).saves}
    assert saves["full"].first == 4 and saves["ssm"].first == 5


def test_a_held_hybrid_prefill_holds_what_its_decode_reads_and_the_decodes_loads_release_it():
    """A prefill for a remote decode: every save carries the hold, and the first also takes,
    per kind, what the decode reads of the blocks found in the store (all of them for full
    attention, the window's, the state at the hit's end). The decode's loads, one per kind,
    each release every block of the producer's stored tokens, once."""
    k = [F, W, S]
    t = tokens(30)  # 7 full blocks of 4
    table = ids(k, 8)
    p = plan(k, save_decode=False)
    assert p.match("r", t, 0, lambda pairs: [i < 3 for i in range(len(pairs))]) == 0  # the state misses
    p = plan(k, save_decode=False)
    found = {(kind.tag, h) for kind in k for h in p.hashes("r", t, 3)}
    assert p.match("r", t, 0, lambda pairs: [x in found for x in pairs]) == 12  # blocks 0-2
    p.hold("r", 30.0)
    first = {run.kind: run for run in p.step([("r", t, 30, 12, 8)], lambda r: table).saves}  # to 20
    assert {kind: [b[0] % 100 for b in run.block_ids] for kind, run in first.items()} == {
        "full": [0, 1, 2, 3, 4], "swa": [0, 1, 2, 3, 4], "ssm": [2, 4]}
    assert {run.hold_s for run in first.values()} == {30.0}
    last = p.step([("r", t, 30, 20, 10)], lambda r: table).saves  # to 30: blocks 5, 6; no state
    assert [(run.kind, [b[0] % 100 for b in run.block_ids], run.hold_s) for run in last] == [
        ("full", [5, 6], 30.0), ("swa", [5, 6], 30.0)]
    other = plan(k, save_decode=False)  # no remote decode: nothing held
    other.match("o", t, 0, lambda pairs: [False] * len(pairs))
    assert {run.hold_s for run in other.step([("o", t, 30, 0, 30)], lambda r: table).saves} == {None}

    c = plan(k, save=False)
    prompt = t + [99]
    c.release_source("d", prompt, 28)  # the producer's stored_tokens
    assert c.match("d", prompt, 0, lambda pairs: [True] * len(pairs)) == 28
    c.allocated("d", ids(k, 8), 28)
    loads = {run.kind: run for run in c.step([], lambda r: ()).loads}
    assert {kind: len(run.hashes) for kind, run in loads.items()} == {"full": 7, "swa": 2, "ssm": 1}
    assert all(run.release == c.hashes("d", prompt, 7) for run in loads.values())
    c.match("d", prompt, 0, lambda pairs: [True] * len(pairs))
    c.allocated("d", ids(k, 8), 28)
    assert all(run.release == [] for run in c.step([], lambda r: ()).loads)  # released once
    c.release_source("x", prompt, None)  # no producer's figure
    c.match("x", prompt, 0, lambda pairs: [True] * len(pairs))
    c.allocated("x", ids(k, 8), 28)
    assert all(run.release == [] for run in c.step([], lambda r: ()).loads)


# ---------------------------------------------------------------- worker ----
def hybrid_transfer(client):
    """An attention layer (CPU layout) and a state layer in pages padded to 640 bytes, one
    storage, as vLLM lays out a hybrid model's cache."""
    pages = torch.zeros(8, 640, dtype=torch.int8)
    attn = pages.view(torch.bfloat16).view(8, 2, 4, 40)  # 640 bytes a block
    state = pages.as_strided((8, 1, 1, 500), (640, 500, 500, 1))
    layers = [LayerBlocks("attn", attn), LayerBlocks("state", state)]
    kinds = [Kind("full", FULL, (0,), (("attn",),)), Kind("ssm", STATE, (1,), (("state",),))]
    return KVTransfer(client, "p/", layers, layerwise=False, kinds=kinds), pages


def test_state_pages_are_stored_without_their_padding():
    layer = LayerBlocks("s", torch.zeros(8, 640, dtype=torch.int8).as_strided((8, 1, 1, 500), (640, 500, 500, 1)))
    assert layer.part_bytes == 500 and layer.block_stride == 640 and layer.block(2)[0][1] == 500


def test_a_hybrid_request_loads_whole_or_is_reported_failed_whole():
    from mooncake_ray.integrations._vllm_plan import BlockRun

    c = FakeClient()
    src, pages = hybrid_transfer(c)
    pages.copy_(torch.randint(-100, 100, pages.shape, dtype=torch.int8))
    src._save([BlockRun("w", 0, ["h0", "h1"], [(0,), (1,)], kind="full"), BlockRun("w", 1, ["h1"], [(2,)], kind="ssm")])
    assert set(c.stored) == {"p/full/h0", "p/full/h1", "p/ssm/h1"} and len(c.stored["p/ssm/h1"]) == 500
    dst, dpages = hybrid_transfer(c)
    ok = [BlockRun("a", 0, ["h0", "h1"], [(4,), (5,)], kind="full"), BlockRun("a", 1, ["h1"], [(6,)], kind="ssm")]
    bad = [BlockRun("b", 0, ["h0", "h1"], [(3,), (7,)], kind="full"), BlockRun("b", 1, ["h9"], [(1,)], kind="ssm")]
    dst.start_loads(ok + bad)
    deadline = time.monotonic() + 10
    recved = set()
    while recved != {"a", "b"} and time.monotonic() < deadline:
        recved |= dst.finished(set())[1] or set()
        if "b" in recved:
            assert dst.failed_loads() == {"b"}  # reported with the same call that reports it received
        time.sleep(0.01)
    assert recved == {"a", "b"}
    assert torch.equal(dpages[4], pages[0]) and torch.equal(dpages[5], pages[1])
    assert torch.equal(dpages[6, :500], pages[2, :500]) and not dpages[6, 500:].any()
    assert dst.load_errors() == set()  # no block-level errors: vLLM takes those for one group only
    src.close()
    dst.close()


# ------------------------------------------------------------ tiny models ----
def test_make_model_builds_the_hybrid_layouts_and_names_a_bad_one(tmp_path):
    """``mooncake-ray make-model --arch``: the layer types vLLM groups by, and a layer count
    with no full-attention layer refused by name."""
    import json

    from click.testing import CliRunner

    from mooncake_ray.cli import main

    r = CliRunner().invoke(main, ["make-model", str(tmp_path / "g"), "--arch", "gemma2", "--layers", "4",
                                  "--sliding-window", "32"])
    assert r.exit_code == 0, r.output
    cfg = json.loads((tmp_path / "g" / "config.json").read_text())
    assert cfg["model_type"] == "gemma2" and cfg["sliding_window"] == 32
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * 2
    r = CliRunner().invoke(main, ["make-model", str(tmp_path / "q"), "--arch", "qwen3_next", "--layers", "3"])
    assert r.exit_code == 2 and "no full-attention layer" in r.output


def test_a_request_whose_load_failed_is_not_looked_up_again():
    p = plan([F, S])
    assert p.match("r", tokens(41), 0, lambda pairs: [True] * len(pairs)) == 40
    p.no_loads("r")
    assert p.match("r", tokens(41), 0, lambda pairs: [True] * len(pairs)) == 0
