"""A sharded master (``master.shards``) on a real 3-node Ray cluster: keys spread over the
shards by hash, each shard allocates only from its own part of every arena, batch calls
split across shards, and the store's stats are summed over them."""

import numpy as np
import pytest
import ray

import mooncake_ray
from mooncake_ray._private.naming import master_name, store_actor_name
from mooncake_ray._private.shards import arena_part, shard_of
from mooncake_ray.cli import format_status
from tests.conftest import wait_for

SHARDS = 4
MB = 1 << 20


def val(i, n=3000):
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_keys_spread_over_shards_and_read_back(make_store, ray_cluster):
    s = make_store(master={"shards": SHARDS})
    ns = s.config.namespace
    keys = [f"sh/{i}" for i in range(400)]
    sizes = [100, 3000, 9000, 70000]
    values = [val(i, sizes[i % 4]) for i in range(400)]
    assert s.batch_put(keys, values) == [None] * 400
    assert s.batch_get(keys) == values
    s.put("one", b"single")
    assert s.get("one") == b"single" and s.exists("one")
    buf = bytearray(70000)
    assert s.get_into(keys[3], buf) == 70000 and bytes(buf) == values[3]
    assert s.batch_exists(keys[:3] + ["absent", 7]) == [True, True, True, False, False]

    # Each shard holds exactly the keys that hash to it, and the summed stats say so.
    masters = [ray.get_actor(master_name(i), namespace=ns) for i in range(SHARDS)]
    per_shard = [ray.get(m.stats.remote())["keys"] for m in masters]
    want = [sum(shard_of(k, SHARDS) == i for k in keys + ["one"]) for i in range(SHARDS)]
    assert per_shard == want and min(want) > 60
    st = s.stats()
    assert st["keys"] == 401 and st["master_shards"] == SHARDS and not st["recovering"]
    assert [p["keys"] for p in st["shards"]] == want
    arena = 64 * MB
    assert st["capacity"] == 2 * (arena // SHARDS) * SHARDS
    for node in st["nodes"].values():
        assert node["dram"]["capacity"] == arena // SHARDS * SHARDS
    assert sum(n["dram"]["keys"] for n in st["nodes"].values()) == 401
    assert "Master shards: 4" in format_status(st)

    # Each shard's extents lie in its own part of every node's arena.
    for shard, m in enumerate(masters):
        lo, length = arena_part(arena, SHARDS, shard)
        for node_id in ray_cluster.store_node_ids:
            for key, _gen, _size, tier, off, ln, *_ in ray.get(m.node_entries.remote(node_id)):
                assert shard_of(key, SHARDS) == shard
                if tier == "dram":
                    assert lo <= off and off + ln <= lo + length, (shard, key, off, ln)

    # The store nodes' own inventories hold every key (one inventory per shard).
    held = set()
    for node_id in ray_cluster.store_node_ids:
        actor = ray.get_actor(store_actor_name(node_id), namespace=ns)
        held |= {e[0] for e in ray.get(actor.inventory_snapshot.remote()) if e[3] != "reserved"}  # not slabs
    assert held == set(keys + ["one"])

    s.pin(keys[0], hard=True)
    assert s.stats()["pinned"] == 1
    s.unpin(keys[0])
    assert s.remove(keys[0]) and not s.exists(keys[0])
    assert s.remove_prefix("sh/", force=True) == 399
    assert s.stats()["keys"] == 1
    assert s.remove_all(force=True) == 1


def test_a_running_store_is_not_redeployed_with_another_shard_count(make_store):
    s = make_store(master={"shards": 2})
    ns = s.config.namespace
    with pytest.raises(mooncake_ray.ConfigError, match="master.shards=2, not 4"):
        mooncake_ray.start({"namespace": ns, "segment_size_bytes": "64mb", "master": {"shards": 4},
                            "transport": {"devices": ["lo"]}})
    with pytest.raises(ValueError):  # nothing was made for the refused deployment
        ray.get_actor(master_name(3), namespace=ns)
    s.put("still", b"serving")
    assert s.get("still") == b"serving"


def test_a_value_must_fit_in_one_shards_part(make_store):
    s = make_store(master={"shards": SHARDS, "put_slab_bytes": 0})
    with pytest.raises(mooncake_ray.InvalidArgumentError, match="master shard's part"):
        s.put("big", b"x" * (20 * MB))  # a 64 MiB arena: parts of 16 MiB
    s.put("fits", b"y" * (12 * MB))
    assert s.get("fits") == b"y" * (12 * MB)


def test_each_shard_evicts_within_its_own_part(make_store):
    """Filling the store several times over: every shard evicts its own oldest values,
    none runs out of room, and what is read back is right."""
    s = make_store(master={"shards": SHARDS}, segment_size_bytes="16mb")
    n = 3000
    keys = [f"ev/{i}" for i in range(n)]
    for lo in range(0, n, 250):
        assert s.batch_put(keys[lo:lo + 250], [val(i, 32 * 1024) for i in range(lo, lo + 250)]) == [None] * 250
    got = s.batch_get(keys)
    assert all(v == val(i, 32 * 1024) for i, v in enumerate(got) if v is not None)
    kept = [i for i, v in enumerate(got) if v is not None]
    assert 0 < len(kept) < n
    st = s.stats()
    assert all(p["evictions"] > 0 for p in st["shards"])
    # The newest values survive in every shard (each shard's LRU is its own).
    newest = keys[-100:]
    assert all(v is not None for v in s.batch_get(newest))


def test_sharded_spill_tier_offloads_promotes_and_survives_a_store_node_restart(make_store, tmp_path):
    """Each shard offloads its own keys to the shared spill directory and promotes them
    back; a restarted store node hands every spilled key to the shard that owns it."""
    s = make_store(master={"shards": SHARDS}, segment_size_bytes="16mb",
                   spill={"enabled": True, "directory": str(tmp_path / "spill"), "capacity_bytes": "512mb"})
    ns = s.config.namespace
    keys = [f"sp/{i}" for i in range(160)]
    for lo in range(0, 160, 20):  # 40 MiB of values into 2 x 16 MiB of DRAM
        assert s.batch_put(keys[lo:lo + 20], [val(i, 256 * 1024) for i in range(lo, lo + 20)]) == [None] * 20
    got = s.batch_get(keys)
    assert got == [val(i, 256 * 1024) for i in range(160)]
    st = s.stats()
    assert all(p["offloads"] > 0 for p in st["shards"]) and st["promotions"] > 0
    assert all(n["disk"]["capacity"] == 512 * MB // SHARDS * SHARDS for n in st["nodes"].values())

    # Restart one store node: its DRAM is gone, its spill files are found again and each
    # goes to its own shard's inventory; those keys stay readable.
    masters = [ray.get_actor(master_name(i), namespace=ns) for i in range(SHARDS)]
    assert all(ray.get([m.flush_inventory.remote() for m in masters]))
    victim = next(n for n, v in st["nodes"].items() if v["disk"]["keys"] > 0)
    on_disk = {k for m in masters for k, _g, _s, tier, *_ in ray.get(m.node_entries.remote(victim)) if tier == "disk"}
    assert on_disk
    old = {n["node_id"]: n["incarnation"] for n in ray.get(masters[0].nodes.remote())}[victim]
    ray.kill(ray.get_actor(store_actor_name(victim), namespace=ns), no_restart=False)

    def remounted():
        return all({n["node_id"]: n["incarnation"] for n in ray.get(m.nodes.remote())}.get(victim) not in (None, old)
                   for m in masters)

    wait_for(remounted, timeout_s=60, what="the store node to remount on every shard")
    after = s.batch_get(sorted(on_disk))
    assert after == [val(int(k.split("/")[1]), 256 * 1024) for k in sorted(on_disk)]
