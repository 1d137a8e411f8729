"""Which master shard owns a key, the parts of an arena the shards allocate from, and the
store's statistics summed over shards (``_private/shards.py``)."""

import pytest

from mooncake_ray._private.master.allocator import ALIGN
from mooncake_ray._private.shards import arena_part, merge_stats, shard_of, split


def test_a_key_has_the_same_shard_in_every_process():
    # CRC-32 of the key's UTF-8 bytes: fixed values, not Python's salted hash.
    assert [shard_of(k, 4) for k in ("a", "b", "page/0", "page/1", "ключ", "x" * 4096)] == [3, 1, 3, 1, 2, 1]
    assert [shard_of(k, 3) for k in ("a", "b", "page/0")] == [0, 2, 2]
    assert shard_of("anything", 1) == 0
    assert shard_of("\ud800", 4) in range(4)  # a lone surrogate still routes (its checks fail later)


def test_keys_spread_evenly_and_split_keeps_order():
    keys = [f"model/{i:08d}" for i in range(40_000)]
    groups = split(keys, 4)
    assert sorted(i for g in groups for i in g) == list(range(40_000))
    assert all(g == sorted(g) for g in groups)
    assert all(9_600 < len(g) < 10_400 for g in groups), [len(g) for g in groups]
    assert all(shard_of(keys[i], 4) == s for s, g in enumerate(groups) for i in g)


def test_arena_parts_are_equal_disjoint_and_page_aligned():
    arena = 64 * ALIGN + 1000
    parts = [arena_part(arena, 3, s) for s in range(3)]
    assert parts == [(0, 21 * ALIGN), (21 * ALIGN, 21 * ALIGN), (42 * ALIGN, 21 * ALIGN)]
    assert arena_part(arena, 1, 0) == (0, 64 * ALIGN)
    with pytest.raises(ValueError, match="shard 3 is outside 0..2"):
        arena_part(arena, 3, 3)
    with pytest.raises(ValueError, match="cannot be split into 4 parts"):
        arena_part(3 * ALIGN, 4, 0)


def _shard_stats(keys, used, hits, recovering=False, degraded=None):
    return {"capacity": 100, "used": used, "keys": keys, "hits": hits, "recovering": recovering,
            "nodes": {"n1": {"ray_node_id": "n1", "suspect": False,
                             "dram": {"capacity": 50, "used": used, "keys": keys, "offloading_bytes": 0},
                             "disk": {"capacity": 10, "used": 0, "keys": 0, "reported_used": 0,
                                      "degraded": degraded}}}}


def test_stats_are_summed_over_shards():
    one = merge_stats([_shard_stats(5, 7, 1)])
    assert one["keys"] == 5 and one["master_shards"] == 1 and "shards" not in one
    got = merge_stats([_shard_stats(5, 7, 1), _shard_stats(3, 2, 4, degraded="ENOSPC")])
    assert (got["keys"], got["used"], got["hits"], got["capacity"]) == (8, 9, 5, 200)
    assert got["master_shards"] == 2 and not got["recovering"]
    assert got["nodes"]["n1"]["dram"] == {"capacity": 100, "used": 9, "keys": 8, "offloading_bytes": 0}
    assert got["nodes"]["n1"]["disk"]["capacity"] == 20 and got["nodes"]["n1"]["disk"]["degraded"] == "ENOSPC"
    assert [s["keys"] for s in got["shards"]] == [5, 3]
    # A shard that did not answer adds nothing, and the store counts as recovering.
    down = merge_stats([_shard_stats(5, 7, 1), {"error": "master shard 1: timed out"}])
    assert down["keys"] == 5 and down["recovering"] and down["shards"][1] == {"error": "master shard 1: timed out"}
