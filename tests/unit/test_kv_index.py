"""The KV-aware router's pure parts: vLLM KV events (real vLLM event classes, encoded as
vLLM's publisher encodes them) into a per-replica index keyed by the store's block hash,
and the cost that ranks replicas."""

from __future__ import annotations

import msgspec
import pytest

from mooncake_ray.integrations import _kv_index as kvi
from mooncake_ray.kv import page_hashes

ev = pytest.importorskip("vllm.distributed.kv_events")

BS = 4
ENC = msgspec.msgpack.Encoder()


def stored(hashes, parent, tokens, medium="GPU", extra=None):
    return ev.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS,
                          lora_id=None, medium=medium, lora_name=None, extra_keys=extra)


def batch(*events) -> bytes:
    return ENC.encode(ev.KVEventBatch(ts=1.0, events=list(events)))


def apply(idx, seq, *events):
    _ts, evs = kvi.decode_batch(batch(*events))
    return idx.apply_batch(seq, evs)


TOK = list(range(100, 116))  # four blocks
H = page_hashes(TOK, BS)


def test_stored_blocks_are_named_by_the_store_hash_across_batches():
    idx = kvi.ReplicaIndex(BS)
    apply(idx, 0, stored([b"a", b"b"], None, TOK[:8]))
    assert idx.match(H) == 2
    # the next blocks name their parent by vLLM's hash: the chain continues
    apply(idx, 1, stored([b"c", b"d"], b"b", TOK[8:16]))
    assert idx.match(H) == 4
    assert idx.match(page_hashes([1] + TOK[1:], BS)) == 0  # a different first token: nothing
    assert idx.blocks == 4


def test_removed_and_cleared():
    idx = kvi.ReplicaIndex(BS)
    apply(idx, 0, stored([1, 2, 3], None, TOK[:12]))
    apply(idx, 1, ev.BlockRemoved(block_hashes=[2], medium="GPU"))
    assert idx.match(H) == 1  # block 1 gone: the prefix stops before it
    apply(idx, 2, ev.AllBlocksCleared())
    assert idx.match(H) == 0 and idx.blocks == 0


def test_the_same_content_twice_counts_until_both_copies_go():
    idx = kvi.ReplicaIndex(BS)
    apply(idx, 0, stored([1], None, TOK[:4]), stored([9], None, TOK[:4]))
    apply(idx, 1, ev.BlockRemoved(block_hashes=[1], medium="GPU"))
    assert idx.match(H) == 1
    apply(idx, 2, ev.BlockRemoved(block_hashes=[9], medium="GPU"))
    assert idx.match(H) == 0


def test_blocks_it_cannot_name_are_left_out_not_invented():
    idx = kvi.ReplicaIndex(BS)
    apply(idx, 0, stored([5], b"unknown-parent", TOK[4:8]))  # parent's event was lost
    apply(idx, 1, stored([6], None, TOK[:4], extra=[("lora-x",)]))  # hash depends on more than tokens
    apply(idx, 2, stored([7], None, TOK[:4], medium="CPU"))  # an offloading tier's block, not the engine's
    assert idx.match(H) == 0 and idx.unnamed == 2 and idx.blocks == 0


def test_batches_in_order_gaps_and_stale_reset():
    now = [0.0]
    idx = kvi.ReplicaIndex(BS, stale_s=5.0, clock=lambda: now[0])
    assert apply(idx, 7, stored([1], None, TOK[:4]))  # the first batch seen sets the sequence
    assert not apply(idx, 7, stored([2], 1, TOK[4:8]))  # seen already (a replay overlapping live)
    assert idx.gap(9) and not idx.gap(8)
    idx.reset()
    assert idx.stale and idx.match(H) == 0
    apply(idx, 9, stored([1], None, TOK[:4]))  # events keep rebuilding it while stale
    assert idx.match(H) == 0
    now[0] = 6.0
    assert not idx.stale and idx.match(H) == 1


def test_malformed_payloads_are_value_errors():
    with pytest.raises(ValueError, match="undecodable"):
        kvi.decode_batch(b"\xc1")
    with pytest.raises(ValueError, match="shape"):
        kvi.decode_batch(ENC.encode(3))
    with pytest.raises(ValueError, match="block_size"):
        kvi.ReplicaIndex(0)


# ------------------------------------------------------------------ choose ----
M = kvi.CostModel(load_cost=0.1, request_cost=64)


def test_engine_hit_wins_when_load_is_equal():
    d = kvi.choose(1000, 100, {"a": 0, "b": 8}, None, {}, M)
    assert d.best.key == "b" and d.reason == "engine" and d.best.hit_tokens == 800


def test_store_hit_makes_every_replica_cheap_so_load_decides():
    present = [True] * 8 + [False, False]
    loads = {"a": kvi.Load(tokens=0, requests=0), "b": kvi.Load(tokens=500, requests=2)}
    d = kvi.choose(1000, 100, {"a": 0, "b": 8}, present, loads, M)
    # a: computes 200 + loads 800 (80) = 280; b: computes 200 + queue 500 + 128 = 828
    assert d.best.key == "a" and d.reason == "store"
    assert d.best.loaded_tokens == 800 and d.best.cost == pytest.approx(280)


def test_holder_with_too_much_work_loses_to_an_idle_replica():
    loads = {"b": kvi.Load(tokens=5000, requests=4)}
    d = kvi.choose(1000, 100, {"a": 0, "b": 8}, None, loads, M)
    assert d.best.key == "a" and d.reason == "load"


def test_store_run_continues_after_the_engine_prefix_and_the_last_block_is_computed():
    present = [False, False, True, True]  # the store holds blocks 2-3 only: no use to anyone from block 0
    d = kvi.choose(400, 100, {"a": 2, "b": 0}, present, {}, M)
    assert d.best.key == "a" and d.best.hit_tokens == 300 and d.best.engine_blocks == 2
    assert [o.key for o in d.ranked] == ["a", "b"] and d.ranked[1].hit_tokens == 0


def test_no_hits_is_balance_and_ties_break_by_the_given_order():
    d = kvi.choose(1000, 100, {"a": 0, "b": 0}, [False] * 10, {}, M, tie={"a": 0.9, "b": 0.1})
    assert d.best.key == "b" and d.reason == "balance"


def test_under_store_pressure_leaving_the_holder_costs_what_it_holds():
    """A busy holder loses to an idle replica when the store backs what engines hold; with a
    store below the working set (pressure), leaving the holder also costs the tokens it
    holds and the other does not, weighted by the pressure."""
    loads = {"b": kvi.Load(tokens=900, requests=2)}
    # a: computes 1000; b: computes 200 + queue 900 + 128 = 1228
    d = kvi.choose(1000, 100, {"a": 0, "b": 8}, None, loads, M)
    assert d.best.key == "a" and d.reason == "load" and d.best.cost == pytest.approx(1000)
    d = kvi.choose(1000, 100, {"a": 0, "b": 8}, None, loads, M, pressure=0.5)
    # a: 1000 + 0.5 x 800 = 1400; b: 1228 (the holder pays nothing)
    assert d.best.key == "b" and d.reason == "engine"
    assert [o.cost for o in d.ranked] == [pytest.approx(1228), pytest.approx(1400)]
    d = kvi.choose(1000, 100, {"a": 0, "b": 8}, None, loads, M, pressure=0.2)  # a: 1160, still cheaper
    assert d.best.key == "a"


def test_store_coverage_reads_the_lookups_blocks_some_engine_holds_and_another_not():
    cov = kvi.StoreCoverage(alpha=1.0)
    assert cov.pressure == 0.0
    present = [False, False, True, False, True, True, False]  # blocks 0-1 not asked (both engines hold them)
    cov.observe({"a": 2, "b": 6}, present)  # blocks 2-5: 3 of 4 in the store
    assert cov.value == pytest.approx(0.75) and cov.pressure == pytest.approx(0.25)
    cov.observe({"a": 3, "b": 3}, present)  # the engines hold the same: nothing to read
    cov.observe({"a": 0, "b": 4}, None)  # no store answer
    assert cov.value == pytest.approx(0.75)
    slow = kvi.StoreCoverage()  # alpha 0.1: one decision moves it a tenth of the way
    slow.observe({"a": 0, "b": 2}, [False, False, True])
    assert slow.value == pytest.approx(0.9)
    with pytest.raises(ValueError, match="alpha.*0"):
        kvi.StoreCoverage(alpha=0)


def test_cost_model_bounds_name_the_bad_value():
    with pytest.raises(ValueError, match="load_cost.*1.5"):
        kvi.CostModel(load_cost=1.5)
    with pytest.raises(ValueError, match="request_cost.*-1"):
        kvi.CostModel(request_cost=-1)
