"""Put slabs on a real cluster: one master call per put, the same answers as the
two-call path, slabs given back when idle or at close, and a dead client's slab
reclaimed by the master."""

import time

import numpy as np
import pytest
import ray

import mooncake_ray
from mooncake_ray import ObjectExistsError
from mooncake_ray._private import rpc
from mooncake_ray._private.gcyoung import GC_YOUNG_THRESHOLD
from mooncake_ray._private.naming import MASTER_NAME, store_actor_name
from tests.conftest import wait_for

KB, MB = 1 << 10, 1 << 20


def rand(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


class CallCounter:
    def __init__(self, client):
        self.ops: list[int] = []
        real = client._master.call

        def call(op, *args):
            self.ops.append(op)
            return real(op, *args)

        client._master.call = call
        real_try = client._master.try_call

        def try_call(op, *args):
            self.ops.append(op)
            return real_try(op, *args)

        client._master.try_call = try_call


def test_small_puts_take_one_master_call_each_and_read_back(make_store):
    s = make_store(master={"put_slab_bytes": "1mb"})
    calls = CallCounter(s)
    values = {f"s{i}": rand(1 + (i * 7919) % (300 * KB), i) for i in range(60)}
    for k, v in values.items():
        s.put(k, v)
    commits = calls.ops.count(rpc.PUT_COMMIT)
    grants = calls.ops.count(rpc.SLAB_GRANT)
    assert commits == 60 and rpc.PUT_START not in calls.ops and rpc.PUT_END not in calls.ops
    assert 1 <= grants <= 20  # a 1 MiB slab holds several of these values
    assert s.batch_get(list(values)) == list(values.values())
    st = s.stats()
    assert st["slabs"] == 1 and 0 < st["slab_bytes"] <= MB


def test_mixed_batch_large_values_take_two_calls_and_errors_match(make_store):
    s = make_store(master={"put_slab_bytes": "2mb"})
    s.put("exists", b"old")
    calls = CallCounter(s)
    keys = ["a", "big", "b", "exists", "c"]
    vals = [rand(10 * KB, 1), rand(3 * MB, 2), b"", b"new", rand(KB, 3)]  # 3 MiB > half a slab
    res = s.batch_put(keys, vals)
    assert [type(r) for r in res] == [type(None), type(None), type(None), ObjectExistsError, type(None)]
    assert calls.ops.count(rpc.PUT_START) == 1 and calls.ops.count(rpc.PUT_COMMIT) == 1  # one commit for 4
    st = s.stats()  # the refused commit freed its extent: what is used is what is stored
    # whole pages from 4 KiB up; smaller values packed in 64-byte granules
    assert st["used"] - st["slab_bytes"] == 64 + 12 * KB + 3 * MB + 64 + KB  # old, a, big, b, c
    assert s.batch_get(keys) == [vals[0], vals[1], b"", b"old", vals[4]]
    with pytest.raises(ObjectExistsError):
        s.put("a", b"again")
    s.upsert("a", b"replaced")
    assert s.get("a") == b"replaced"


def test_a_batch_spanning_several_slabs_commits_every_value_once(make_store):
    """A slab replaced in the middle of a batch is given back only with the commit of the
    values carved from it: none of them is refused and written again the two-call way."""
    s = make_store(master={"put_slab_bytes": "1mb"})
    calls = CallCounter(s)
    s.put("first", rand(300 * KB, 99))  # carved from the first slab
    keys = [f"span{i}" for i in range(9)]
    vals = [rand(200 * KB, i) for i in range(9)]  # 1.8 MB: the rest of that slab, then two more
    assert s.batch_put(keys, vals) == [None] * 9
    assert calls.ops.count(rpc.SLAB_GRANT) == 3
    assert calls.ops.count(rpc.PUT_COMMIT) == 2  # "first", then one for the whole batch
    assert rpc.PUT_START not in calls.ops  # nothing fell back to the two-call path
    assert s.batch_get(keys) == vals
    st = s.stats()  # the replaced slabs went back with the commit: only the current one is held
    assert st["slabs"] == 1 and st["used"] - st["slab_bytes"] == 9 * 200 * KB + 300 * KB


def test_a_batch_larger_than_two_slabs_takes_two_calls(make_store):
    """A batch that would take a slab grant per slab (a prompt's KV blocks, hundreds of
    MiB) goes PUT_START / PUT_END instead: two master calls, whatever its size."""
    s = make_store(master={"put_slab_bytes": "1mb"})
    calls = CallCounter(s)
    keys = [f"big{i}" for i in range(24)]
    vals = [rand(200 * KB, i) for i in range(24)]  # 4.8 MB: five 1 MiB slabs
    assert s.batch_put(keys, vals) == [None] * 24
    assert calls.ops.count(rpc.PUT_START) == 1 and calls.ops.count(rpc.PUT_END) == 1
    assert rpc.SLAB_GRANT not in calls.ops and rpc.PUT_COMMIT not in calls.ops
    assert s.batch_get(keys) == vals


def test_idle_client_gives_its_slab_back(make_store):
    s = make_store(master={"put_slab_ttl_s": 0.5})
    calls = CallCounter(s)
    s.put("k", b"v")
    assert calls.ops.count(rpc.SLAB_GRANT) == 1
    wait_for(lambda: s.stats()["slabs"] == 0, timeout_s=10, what="the idle slab to come back")
    assert calls.ops.count(rpc.SLAB_RETURN) == 1 and s.stats()["used"] == 64  # one packed granule
    s.put("k2", b"v")  # and a new one is granted when needed
    assert s.batch_get(["k", "k2"]) == [b"v"] * 2


def test_closing_client_gives_its_slab_back(make_store):
    s = make_store(master={"put_slab_ttl_s": 30})
    s.put("k", b"v")
    other = mooncake_ray.connect(namespace=s.config.namespace)
    other.put("k2", b"v")
    assert s.stats()["slabs"] == 2
    other.close()
    assert s.stats()["slabs"] == 1
    assert s.batch_get(["k", "k2"]) == [b"v"] * 2


def test_disabled_slabs_use_two_calls(make_store):
    s = make_store(master={"put_slab_bytes": 0})
    calls = CallCounter(s)
    s.put("k", b"v")
    assert rpc.SLAB_GRANT not in calls.ops and calls.ops.count(rpc.PUT_END) == 1
    assert s.get("k") == b"v" and s.stats()["slabs"] == 0


@ray.remote(num_cpus=0)
class Putter:
    def __init__(self, namespace):
        self.s = mooncake_ray.connect(namespace=namespace)

    def put(self, key, n):
        self.s.put(key, b"y" * n)


def test_dead_clients_slab_is_reclaimed(make_store):
    s = make_store(master={"put_slab_ttl_s": 0.5, "put_timeout_s": 1.5, "put_slab_bytes": "4mb",
                           "high_watermark": 0.85})  # a slab budget (half the headroom) of 4.8 MiB
    base = s.stats()["used"]
    p = Putter.remote(s.config.namespace)
    ray.get(p.put.remote("from-dead", 5000))
    st = s.stats()
    assert st["slabs"] == 1 and st["used"] >= base + 4 * MB
    ray.kill(p)  # no close, no return: the master's expiry must do it
    t0 = time.monotonic()
    wait_for(lambda: s.stats()["slabs"] == 0, timeout_s=15, what="the dead client's slab to expire")
    assert time.monotonic() - t0 < 10
    assert s.stats()["used"] == base + 8 * KB and s.get("from-dead") == b"y" * 5000


def test_small_values_are_packed_and_evicted_ones_make_room(make_store):
    """256-byte values take 256 bytes of arena each; more of them than the arena holds
    evict the oldest and keep the newest, byte-exact (the master's batched eviction)."""
    s = make_store(segment_size_bytes="4mb", master={"put_slab_bytes": "64kb"})
    keys = [f"small{i}" for i in range(1000)]
    vals = [k.encode().ljust(256, b"#") for k in keys]
    assert s.batch_put(keys, vals) == [None] * 1000
    st = s.stats()
    assert st["used"] - st["slab_bytes"] == 1000 * 256
    assert s.batch_get(keys) == vals
    more = [f"more{i}" for i in range(40_000)]  # 10 MiB into two 4 MiB arenas
    for i in range(0, len(more), 1000):
        assert s.batch_put(more[i:i + 1000], [k.encode().ljust(256, b"#") for k in more[i:i + 1000]]) == [None] * 1000
    st = s.stats()
    assert st["evictions"] > 0
    got = s.batch_get(more[-1000:])
    assert got == [k.encode().ljust(256, b"#") for k in more[-1000:]]
    kept = [v for v in s.batch_get(more) if v is not None]
    assert len(kept) > 20_000  # 2 x 4 MiB at 256 B each, less the watermark and the slabs
    master = ray.get_actor(MASTER_NAME, namespace=s.config.namespace)
    young = lambda _self: __import__("gc").get_threshold()[0]  # noqa: E731
    assert ray.get(master.__ray_call__.remote(young)) == GC_YOUNG_THRESHOLD
    for node_id in ray.get(master.stats.remote())["nodes"]:  # the store nodes' processes too
        store = ray.get_actor(store_actor_name(node_id), namespace=s.config.namespace)
        assert ray.get(store.__ray_call__.remote(young)) == GC_YOUNG_THRESHOLD


@ray.remote(num_cpus=0)
class SlabWriter:
    """Client processes, as the engine workers of a fleet are; ``clients`` clients in this
    one (each has its own put slab, as a process of its own would)."""

    def __init__(self, namespace, clients=1):
        self.clients = [mooncake_ray.connect(namespace=namespace) for _ in range(clients)]
        self.s = self.clients[0]

    def put(self, prefix, n, size):
        value = b"w" * size
        return self.s.batch_put([f"{prefix}/{i}" for i in range(n)], [value] * n)

    def put_each(self, prefix, n, size):
        """``put`` from every client of this process, one after the other."""
        value = b"w" * size
        return [c.batch_put([f"{prefix}/c{j}/{i}" for i in range(n)], [value] * n)
                for j, c in enumerate(self.clients)]


def test_thirty_two_clients_the_store_evicts_only_once_values_fill_it(make_store):
    """32 clients (8 in each of 4 processes: each has its own put slab) put small values
    (the one-call slab path) in rounds. Their put slabs share a budget (half the headroom
    above the watermark: 5% of the arena), and eviction counts the bytes values hold, so
    nothing is evicted while the values fill less than the arena's watermark; evictions
    start past it. Slabs go to the node with the most room (``free_ratio_first``): with
    ``local_first`` a process on a store node fills that node first, and the store evicts
    there while the arenas as a whole are less full."""
    s = make_store(segment_size_bytes="32mb", master={"allocation_strategy": "free_ratio_first"})
    ns = s.config.namespace
    writers = [SlabWriter.remote(ns, clients=8) for _ in range(4)]
    ray.get([w.__ray_ready__.remote() for w in writers])
    capacity = s.stats()["capacity"]
    size, per_round = 32 * KB, 8  # 32 x 8 x 32 KiB = 8 MiB a round
    rounds, first_eviction, slab_share = 0, None, []
    while rounds < 16 and first_eviction is None:
        res = ray.get([w.put_each.remote(f"r{rounds}/w{j}", per_round, size) for j, w in enumerate(writers)])
        assert all(r == [None] * per_round for per_process in res for r in per_process)
        rounds += 1
        st = s.stats()
        slab_share.append(st["slab_bytes"] / capacity)
        if st["evictions"]:
            first_eviction = rounds * 32 * per_round * size / capacity
    assert max(slab_share) <= 0.05, f"put slabs held {max(slab_share):.0%} of the arena unused"
    assert first_eviction is not None, "the store never evicted"
    assert first_eviction > 0.85, f"eviction started with values at {first_eviction:.0%} of the arena"


def _node_checksums(s) -> tuple[int, int]:
    """(values journaled with their client's checksum, values checksummed from the arena),
    over every store node."""
    nodes = [ray.get_actor(store_actor_name(n["node_id"]), namespace=s.config.namespace)
             for n in s._master.call(rpc.NODES)]
    stats = ray.get([n.stats.remote() for n in nodes])
    return sum(st["checksums_given"] for st in stats), sum(st["checksums_read"] for st in stats)


def test_a_put_hands_the_checksum_of_its_copy_to_the_master_and_a_bad_one_is_refused(make_store):
    """On this host the client copies each value into the mapped arena itself and takes the
    CRC-32C of every value of 1 MiB or more in that copy: one-call commits and two-call
    PUT_ENDs carry it, and the store nodes journal it from their commit rings without
    reading those values back (smaller ones they checksum themselves). A checksum that is
    not a CRC-32C is refused with a typed error naming it, and nothing stored is lost."""
    from mooncake_ray._private.client.writes import CHECKSUM_IN_COPY_MIN
    from mooncake_ray._private.native import _native

    # a slab budget (half the headroom above 0.9: 3.2 MiB of 64) that holds the 3 MiB value
    s = make_store(master={"high_watermark": 0.9})
    sent: list = []
    real = s._master.call

    def call(op, *args):
        if op in (rpc.PUT_COMMIT, rpc.PUT_END):
            sent.extend(args[0])
        return real(op, *args)

    s._master.call = call
    values = {f"c{i}": rand(n, i) for i, n in enumerate([100, 4096, 300 * KB, MB, 3 * MB + 3])}
    for k, v in values.items():
        s.put(k, v)
    twice = {f"t{i}": rand(n, 10 + i) for i, n in enumerate([5000, 2 * MB])}
    for k, v in twice.items():
        s.put(k, v, replicas=2)  # PUT_START, two copies written, PUT_END
    everything = {**values, **twice}

    def crc(v: bytes) -> int:
        a = np.frombuffer(v, dtype=np.uint8)
        return _native.spill_crc32c(a.ctypes.data, len(v), 0)

    by_key = {it[0]: it for it in sent}
    assert set(by_key) == set(everything)
    given = read = 0
    for k, v in everything.items():
        one_call, copies = k in values, 1 if k in values else 2
        if len(v) >= CHECKSUM_IN_COPY_MIN:  # [key, slab, offset, size, upsert, parent, crc] / [key, gen, crc]
            assert len(by_key[k]) == (7 if one_call else 3) and by_key[k][-1] == crc(v), k
            given += copies
        else:
            assert len(by_key[k]) == (5 if one_call else 2), k
            read += copies
    wait_for(lambda: sum(_node_checksums(s)) >= given + read, timeout_s=30, what="the nodes to journal every copy")
    assert _node_checksums(s) == (given, read)

    for op, item in ((rpc.PUT_COMMIT, ["bad1", 1, 0, 10, False, "", 1 << 32]), (rpc.PUT_END, ["bad2", 1, "x"])):
        args = ([item], s._writes._owner) if op == rpc.PUT_COMMIT else ([item],)
        got = real(op, *args)
        with pytest.raises(mooncake_ray.InvalidArgumentError, match="checksum .* is not a CRC-32C"):
            raise rpc.to_exc(got[0])
    assert s.batch_get(list(everything)) == list(everything.values())


def test_with_checksums_in_the_copy_off_the_nodes_read_the_values_back(make_store):
    s = make_store(client={"checksum_in_copy": False})
    values = {f"o{i}": rand(n, i) for i, n in enumerate([100, 2 * MB])}
    for k, v in values.items():
        s.put(k, v)
    wait_for(lambda: _node_checksums(s)[1] >= len(values), timeout_s=30, what="the nodes to journal every value")
    assert _node_checksums(s) == (0, len(values))
    assert s.batch_get(list(values)) == list(values.values())
