"""The public API against a store deployed on a real 3-node Ray cluster (2 store nodes,
1 client-only head)."""

import asyncio

import numpy as np
import pytest
import ray
import torch

import mooncake_ray
from mooncake_ray import (
    InvalidArgumentError,
    ObjectExistsError,
    ObjectNotFoundError,
)

MB = 1 << 20


def rand(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_roundtrip_every_value_type(make_store):
    s = make_store()
    vals = {
        "bytes": rand(1000, 1),
        "bytearray": bytearray(rand(5000, 2)),
        "memoryview": memoryview(rand(3 * MB + 7, 3)),
        "numpy": np.arange(100_000, dtype=np.float32),
        "torch": torch.arange(50_000, dtype=torch.int64),
        "empty": b"",
    }
    for k, v in vals.items():
        s.put(k, v)
    for k, v in vals.items():
        got = s.get(k)
        assert isinstance(got, bytes)
        expect = v.numpy().tobytes() if isinstance(v, torch.Tensor) else bytes(memoryview(v).cast("B"))
        assert got == expect, k
    out = torch.empty(50_000, dtype=torch.int64)
    assert s.get_into("torch", out) == 400_000
    assert torch.equal(out, vals["torch"])


def test_zero_copy_registered_buffers_and_batches(make_store):
    s = make_store()
    n, size = 16, 256 * 1024
    src = np.random.default_rng(5).integers(0, 256, (n, size), dtype=np.uint8)
    dst = np.zeros_like(src)
    s.register_buffer(src)
    s.register_buffer(dst)
    keys = [f"zc/{i}" for i in range(n)]
    assert s.batch_put_from(keys, list(src)) == [None] * n
    sizes = s.batch_get_into(keys, list(dst))
    assert sizes == [size] * n
    assert np.array_equal(src, dst)
    s.put_from("partial", src[0], 1000)
    assert s.get("partial") == src[0][:1000].tobytes()
    s.unregister_buffer(src)
    s.unregister_buffer(dst)


def test_values_put_for_a_reader_are_held_until_it_releases_them(make_store):
    """``batch_put_from(..., hold_s=)`` soft-pins each value in the call that publishes it,
    through a put slab (small values) and the two-call path (one too large for a slab)
    alike; ``batch_unpin`` releases them and answers per key. A bad ``hold_s`` stores nothing."""
    s = make_store()
    small, large = np.full(64 * 1024, 7, np.uint8), np.full(3 * MB, 9, np.uint8)
    s.register_buffer(small)
    s.register_buffer(large)
    for bad in (0, -1.0, float("nan"), "30"):
        with pytest.raises(InvalidArgumentError, match="hold_s"):
            s.batch_put_from(["held/s", "held/l"], [small, large], hold_s=bad)
    assert s.batch_exists(["held/s", "held/l"]) == [False, False]
    pinned = s.stats()["soft_pinned"]
    assert s.batch_put_from(["held/s", "held/l"], [small, large], hold_s=30) == [None, None]
    assert s.stats()["soft_pinned"] == pinned + 2
    assert s.get("held/l") == large.tobytes()
    res = s.batch_unpin(["held/s", "held/l", "held/nope", ""])
    assert res[:2] == [None, None]
    assert isinstance(res[2], ObjectNotFoundError) and isinstance(res[3], InvalidArgumentError)
    assert s.stats()["soft_pinned"] == pinned
    res = s.batch_pin(["held/s", "held/nope", "held/l"], ttl_s=30)  # values stored before: held from now
    assert res[0] is None and isinstance(res[1], ObjectNotFoundError) and res[2] is None
    assert s.stats()["soft_pinned"] == pinned + 2
    with pytest.raises(InvalidArgumentError, match="ttl_s"):
        s.batch_pin(["held/s"], ttl_s=0)
    s.batch_unpin(["held/s", "held/l"])
    s.unregister_buffer(small)
    s.unregister_buffer(large)


def test_batch_calls_report_per_key(make_store):
    s = make_store()
    s.put("a", b"1")
    res = s.batch_put(["a", "b", "c"], [b"x", b"2", b"3"])
    assert isinstance(res[0], ObjectExistsError) and res[1:] == [None, None]
    assert s.batch_get(["a", "nope", "c"]) == [b"1", None, b"3"]
    assert s.batch_exists(["a", "nope"]) == [True, False]
    buf = [bytearray(8), bytearray(8)]
    out = s.batch_get_into(["b", "nope"], buf)
    assert out[0] == 1 and isinstance(out[1], ObjectNotFoundError)


def test_async_batch_variants(make_store):
    s = make_store()

    async def go():
        await s.batch_put_async(["x", "y"], [b"xx", b"yy"])
        return await s.batch_get_async(["x", "y", "z"]), await s.batch_exists_async(["x", "z"])

    assert asyncio.run(go()) == ([b"xx", b"yy", None], [True, False])


def test_put_existing_key_raises_upsert_replaces(make_store):
    s = make_store()
    s.put("k", b"old")
    with pytest.raises(ObjectExistsError):
        s.put("k", b"new")
    assert s.get("k") == b"old"
    s.upsert("k", b"newer value")
    assert s.get("k") == b"newer value"


def test_remove_prefix_all_and_miss(make_store):
    s = make_store()
    for k in ["p/1", "p/2", "q/1"]:
        s.put(k, b"v")
    with pytest.raises(ObjectNotFoundError) as ei:
        s.get("missing")
    assert isinstance(ei.value, KeyError)
    assert s.remove("q/1", force=True) and not s.remove("q/1")
    assert s.remove_prefix("p/", force=True) == 2
    s.put("z", b"v")
    assert s.remove_all(force=True) == 1
    assert s.stats()["keys"] == 0


def test_replicas_land_on_distinct_nodes(make_store, ray_cluster):
    s = make_store()
    s.batch_put([f"r{i}" for i in range(10)], [rand(100_000, i) for i in range(10)], replicas=2)
    st = s.stats()
    assert sorted(st["nodes"]) == sorted(ray_cluster.store_node_ids)
    for node in st["nodes"].values():
        assert node["dram"]["keys"] == 10
    assert st["keys"] == 10


def test_eviction_under_pressure_keeps_recent_and_never_returns_wrong_bytes(make_store):
    s = make_store(segment_size_bytes="32mb")
    n = 100  # 100 MiB into 2 x 32 MiB
    for i in range(n):
        s.put(f"e{i}", rand(MB, i))
    st = s.stats()
    assert st["evictions"] > 0 and st["used"] <= st["capacity"]
    got = s.batch_get([f"e{i}" for i in range(n)])
    hits = [i for i, v in enumerate(got) if v is not None]
    assert all(got[i] == rand(MB, i) for i in hits)
    assert hits and hits[-1] == n - 1 and 0 not in hits  # LRU: newest kept, oldest gone
    assert 40 <= len(hits) <= 64


def test_value_larger_than_pool_is_clear_error_and_loses_nothing(make_store):
    s = make_store(segment_size_bytes="8mb")
    s.put("keep", b"safe")
    with pytest.raises(InvalidArgumentError, match="larger than any store node"):
        s.put("huge", bytes(9 * MB))
    assert s.get("keep") == b"safe"


@ray.remote(num_cpus=0)
class RemoteUser:
    """A client inside an actor on a chosen Ray node."""

    def __init__(self, namespace):
        self.s = mooncake_ray.connect(namespace=namespace)

    def put_many(self, n):
        for i in range(n):
            self.s.put(f"local{i}", b"x" * 10_000)
        return ray.get_runtime_context().get_node_id()

    def get(self, key):
        return self.s.get(key)


def test_local_first_placement(make_store, ray_cluster):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    s = make_store(master={"allocation_strategy": "local_first"})
    target = ray_cluster.store_node_ids[1]
    user = RemoteUser.options(scheduling_strategy=NodeAffinitySchedulingStrategy(target, soft=False)).remote(
        s.config.namespace)
    assert ray.get(user.put_many.remote(8)) == target
    nodes = s.stats()["nodes"]
    assert nodes[target]["dram"]["keys"] == 8
    assert sum(n["dram"]["keys"] for nid, n in nodes.items() if nid != target) == 0
    # and a client on another node reads them across nodes
    assert s.get("local3") == b"x" * 10_000


def test_start_is_idempotent_and_connect_finds_it(make_store):
    s = make_store()
    s.put("k", b"v")
    again = mooncake_ray.start(s.config)
    assert again.get("k") == b"v"
    other = mooncake_ray.connect(namespace=s.config.namespace)
    assert other.get("k") == b"v"
    again.close()
    other.close()


@pytest.mark.parametrize("protocol", ["tcp", "shm"])
def test_public_api_through_each_transport(make_store, protocol):
    s = make_store(transport={"protocol": protocol, "devices": ["lo"], "rpc_timeout_s": 2.0,
                              "transfer_timeout_s": 5.0})
    sizes = [1, 4096, 100_000, 3 << 20]
    vals = [rand(n, n) for n in sizes]
    assert s.batch_put([f"t{n}" for n in sizes], vals, replicas=2) == [None] * 4
    assert s.batch_get([f"t{n}" for n in sizes]) == vals
    buf = np.zeros(3 << 20, dtype=np.uint8)
    s.register_buffer(buf)
    assert s.get_into(f"t{3 << 20}", buf) == 3 << 20 and buf.tobytes() == vals[-1]
    paths = s.engine.stats()
    if protocol == "tcp":
        assert not any(v for k, v in paths.items() if "memcpy" in k), paths
    else:
        assert any(v for k, v in paths.items() if "memcpy" in k), paths


def test_a_put_refused_for_room_is_retried_until_room_comes_back(make_store):
    """Both arenas full of hard-pinned values: a put waits (retrying) and lands as soon as
    they are unpinned; with nothing freed it raises NoCapacityError after
    client.backpressure_timeout_s."""
    import threading
    import time

    s = make_store(segment_size_bytes="4mb", client={"backpressure_timeout_s": 0.5},
                   master={"high_watermark": 1.0})
    mb = 1 << 20
    pinned = []
    for i in range(16):  # until a put finds no room (after 0.5 s of retries)
        if s.batch_put([f"pin{i}"], [bytes(mb)])[0] is not None:
            break
        s.pin(f"pin{i}", hard=True)
        pinned.append(f"pin{i}")
    assert len(pinned) >= 4
    t0 = time.monotonic()
    with pytest.raises(mooncake_ray.NoCapacityError):
        s.put("late", bytes(2 * mb))
    assert 0.4 <= time.monotonic() - t0 < 10

    patient = mooncake_ray.connect(s.config.namespace, {"client": {"backpressure_timeout_s": 20.0}})

    def unpin_later():
        time.sleep(1.5)
        for k in pinned:
            s.unpin(k)

    t = threading.Thread(target=unpin_later)
    t0 = time.monotonic()
    t.start()
    assert patient.batch_put(["late"], [bytes(2 * mb)]) == [None]
    t.join()
    assert time.monotonic() - t0 >= 1.4
    assert s.get("late") == bytes(2 * mb)
    patient.close()
