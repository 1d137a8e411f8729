"""The master's native read index (``mcr::MasterIndex``) against its Python reference
(``PyIndex``): the same replies, lease ids and logs on random streams of mirror updates
and requests, malformed ones included; its mutex; and its place in front of the master's
Python handler on a real engine."""

from __future__ import annotations

import random
import threading
import time

import msgpack
import pytest

from mooncake_ray._private import rpc
from mooncake_ray._private.master.fastpath import FIRST_LEASE, GRANT, RELEASE
from mooncake_ray._private.master.pyindex import PyIndex
from mooncake_ray._private.native import _native
from tests.native.transport_util import engines  # noqa: F401 - fixture


def random_key(rng: random.Random) -> str:
    # short (fixstr), str8 and str16 encodings, and non-ASCII
    return rng.choice([f"k{rng.randrange(40)}", "é" * rng.randrange(1, 3) + str(rng.randrange(5)),
                       "x" * 40 + str(rng.randrange(3)), "y" * 300 + str(rng.randrange(3))])


def random_reps(rng: random.Random) -> list:
    n = rng.choice([0, 1, 1, 2, 3])
    return [(f"n{i}", f"ray{i % 2}", rng.randrange(1 << 40) & ~4095, 4096 * rng.randrange(1, 1 << 12),
             f"inc{rng.randrange(1 << 30):x}", rng.choice([0, rng.randrange(1 << 63)]))
            for i in rng.sample(range(5), n)]


def random_commit(rng: random.Random, slabs: dict):
    sid = rng.choice(list(slabs) + [999]) if slabs else 999
    base = slabs.get(sid, 0)
    items = [[random_key(rng) if rng.random() < 0.3 else f"new{rng.randrange(1 << 40)}", sid,
              base + 4096 * rng.choice([-1, 0, 0, 1, 4, 4, 5, 8, 8, 11]) + rng.choice([0] * 30 + [1, 64, 192, 2048]),
              rng.choice([0, 1, 100, 256, 4096, 5000, 20000]), *([rng.random() < 0.3] if rng.random() < 0.8 else [])]
             for _ in range(rng.choice([1, 1, 1, 2, 4]))]
    for it in items:  # a parent (KV chains): a key, the item's own key (refused), or too long
        if len(it) == 5 and rng.random() < 0.4:
            it.append(rng.choice([random_key(rng), random_key(rng), it[0], "p" * 5000, ""]))
    owner = "c2" if rng.random() < 0.1 else "c1"
    # used-up slabs given back: answered natively (up to 64 ids), each dropped after the commits
    returns = rng.choice([[], [[]], [[]], [None], [[sid]], [[sid, 999]], [[rng.randrange(1, 6)]],
                          [["x"]], [[-1]], [list(range(100, 165))], [list(range(100, 164))]])
    return [rpc.PUT_COMMIT, items, owner, *returns]


def random_request(rng: random.Random, leases: list):
    keys = [random_key(rng) for _ in range(rng.choice([1, 1, 2, 5, 20, 70000 if rng.random() < 0.002 else 3]))]
    done = [list(x) for x in rng.sample(leases, min(len(leases), rng.randrange(4)))]
    r = rng.random()
    if r < 0.45:
        args = [keys, rng.choice([None, "", "n1", "ray0", "ray1"]), done][:rng.choice([1, 2, 3, 3])]
        return [rpc.GET, *args]
    if r < 0.6:
        return [rpc.EXISTS, keys]
    if r < 0.75:
        return [rpc.RELEASE, done]
    bad = [  # everything here is Python's to answer (or to reject)
        [rpc.PUT_START, [[keys[0], 10]]], [rpc.GET], [rpc.GET, keys, None, done, "extra"],
        [rpc.GET, [b"bytes-key"]], [rpc.GET, [1, 2]], [rpc.GET, "notalist"], [rpc.EXISTS, keys, 1],
        [rpc.RELEASE, [["k", -1, 5]]], [rpc.RELEASE, [["k", 1]]], [rpc.RELEASE, [["k", True, 1]]],
        [rpc.GET, keys, 7], [rpc.GET, keys, None, [["k", 1, 2.5]]], [-4, keys], [4.0, keys],
        {"op": 4}, "GET", [], [rpc.REMOVE, keys],
    ]
    return rng.choice(bad)


def decode(reply):
    return None if reply is None else msgpack.unpackb(reply, raw=False)


def random_cold(rng: random.Random) -> tuple:
    """A cold record's fields after its key: size, gen, node_id, ray_node_id, incarnation,
    disk, offset, length, placed, lease_until, leases (ended long ago, or far ahead)."""
    i = rng.randrange(5)
    leases = sorted(rng.sample(range(1 << 41, (1 << 41) + 50), rng.choice([0, 0, 1, 2])))
    return (rng.randrange(1 << 34), rng.randrange(1 << 50), f"n{i}", f"ray{i % 2}", f"inc{rng.randrange(3)}",
            rng.random() < 0.2, rng.randrange(1 << 40) & ~63, 64 * rng.randrange(1, 1 << 12),
            rng.choice([0, rng.randrange(1 << 63)]), time.monotonic() + rng.choice([-100.0, 100.0]), leases)


def same_cold(a, b) -> bool:
    """Two cold records' fields alike (lease ends set a moment apart, from each one's clock)."""
    if a is None or b is None:
        return a is b
    return a[:7] == b[:7] and a[8] == b[8] and abs(a[7] - b[7]) < 30


@pytest.mark.parametrize("seed", range(6))
def test_native_index_matches_reference(seed):
    rng = random.Random(seed)
    native, ref = _native.MasterIndex(), PyIndex()
    max_log = rng.choice([50, 1 << 17])
    for ix in (native, ref):
        ix.set_lease_ttl(1000.0)  # no lease ends while the test runs: both decide alike
        ix.set_enabled(True)
        ix.set_max_log(max_log)
        ix.set_commits(True)
        ix.set_next_gen(1 << 62)  # above the wall clock: generations are the counter's
        ix.set_sample_shift(0)  # every reference sampled
        ix.set_chain_links(seed % 3 != 2)  # KV chain links kept (chain-aware eviction)
    leases: list = []
    slabs: dict = {}
    answered = commits = returned = 0
    for step in range(3000):
        r = rng.random()
        if r < 0.05:
            sid, base = rng.randrange(1, 6), 4096 * rng.randrange(100)
            slabs[sid] = base
            pieces = [(base + 4096 * i, 4096 * rng.randrange(1, 4)) for i in (0, 4, 8)]
            for ix in (native, ref):
                ix.set_slab(sid, rng.choice(["c1"]), f"n{sid % 3}", "ray0", "inc", pieces)
        elif r < 0.07 and slabs:
            sid = rng.choice(list(slabs))
            slabs.pop(sid)
            native.drop_slab(sid)
            ref.drop_slab(sid)
        elif r < 0.10:
            key = random_key(rng)
            if rng.random() < 0.5:
                native.add_pending(key)
                ref.add_pending(key)
            else:
                native.drop_pending(key)
                ref.drop_pending(key)
        elif r < 0.18:
            req = random_commit(rng, slabs)
            data = msgpack.packb(req, use_bin_type=True)
            got, want = decode(native.serve(data)), decode(ref.serve(data))
            assert got == want, f"step {step}: {req!r}"
            commits += got is not None
            for sid in slabs:
                assert native.lookup_slab(sid) == ref.lookup_slab(sid)
            if got is not None and len(req) == 4 and req[3]:
                returned += 1
                for sid in req[3]:
                    assert native.lookup_slab(sid) is None, f"step {step}: slab {sid} given back"
                    slabs.pop(sid, None)
        elif r < 0.21:
            key, size, gen = random_key(rng), rng.randrange(1 << 34), rng.randrange(1 << 50)
            reps = random_reps(rng)
            native.set(key, size, gen, reps)
            ref.set(key, size, gen, reps)
        elif r < 0.25:
            key, rec = random_key(rng), random_cold(rng)
            native.set_cold(key, *rec)
            ref.set_cold(key, *rec)
        elif r < 0.27:
            key = random_key(rng)
            how = rng.choice(["hydrate", "peek_cold", "touch"])
            got, want = getattr(native, how)(key), getattr(ref, how)(key)
            assert same_cold(got, want), f"step {step}: {how}({key!r}): {got} != {want}"
            assert native.is_hot(key) == ref.is_hot(key) and native.contains(key) == ref.contains(key)
        elif r < 0.28:
            now, node, disk = time.monotonic(), f"n{rng.randrange(5)}", rng.random() < 0.2
            after, limit = rng.choice(["", random_key(rng)]), rng.choice([1, 3, 1000])
            assert native.scan(after, node, disk, now, limit) == ref.scan(after, node, disk, now, limit)
            assert sorted(native.cold_on_node(node)) == sorted(ref.cold_on_node(node))
            prefix = rng.choice(["", "k", "é", "x" * 40])
            assert native.keys(prefix) == ref.keys(prefix), "recency order differs"
            assert native.cold_count() == ref.cold_count()
        elif r < 0.285:
            now, node, need = time.monotonic(), f"n{rng.randrange(5)}", rng.choice([1, 4096, 1 << 20, 1 << 60])
            after, chains = rng.choice(["", random_key(rng)]), rng.random() < 0.6
            got, want = native.evict_cold(after, node, now, need, chains), ref.evict_cold(after, node, now, need, chains)
            assert got == want, f"step {step}: evict_cold({after!r}, {node}, chains={chains})"
            assert native.keys("") == ref.keys("")
            assert [native.chain_of(k) for k in native.keys("")] == [ref.chain_of(k) for k in ref.keys("")]
        elif r < 0.30:
            key = random_key(rng)
            native.drop(key)
            ref.drop(key)
        elif r < 0.32:
            keys = [random_key(rng) for _ in range(rng.randrange(4))]
            native.drop_many(keys)
            ref.drop_many(keys)
        elif r < 0.33:
            on = rng.random() < 0.7
            native.set_enabled(on)
            ref.set_enabled(on)
        elif r < 0.36:
            t0 = time.monotonic()
            (m1, h1, log1), (m2, h2, log2) = native.drain(), ref.drain()
            assert (m1, h1) == (m2, h2)
            assert [e[:4] + e[5:] for e in log1] == [e[:4] + e[5:] for e in log2]
            assert all(0 <= t0 - e[4] < 60 for e in log1), "native times are CLOCK_MONOTONIC seconds"
            (d1, s1), (d2, s2) = native.take_samples(), ref.take_samples()
            assert d1 == d2 and [x[1:] for x in s1] == [x[1:] for x in s2], "sampled references differ"
        elif r < 0.362:
            native.clear()
            ref.clear()
        elif r < 0.38:  # the insertion policy: probation with a grace window (adaptive.py)
            how = rng.choice(["probation", "probation", "probation", "unread", "unread", "insert_old", "grace"])
            key, on, grace = random_key(rng), rng.random() < 0.5, rng.choice([0, 4096, 1 << 20, 1 << 36])
            for ix in (native, ref):
                if how == "probation":
                    ix.probation(key)
                elif how == "unread":  # a chained put under "recent" (table.touch_new)
                    ix.touch(key, True)
                elif how == "insert_old":
                    ix.set_insert_old(on)
                else:
                    ix.set_grace_bytes(grace)
            assert native.keys("") == ref.keys(""), "recency order differs"
        elif r < 0.42:  # KV chain links and holds (chain-aware eviction)
            key, how = random_key(rng), rng.choice(["link", "link", "link", "unlink", "holds", "remote"])
            parent, holds, on = random_key(rng), rng.randrange(4), rng.random() < 0.5
            for ix in (native, ref):
                if how == "link":
                    ix.link(key, parent)
                elif how == "unlink":
                    ix.link(key, "")
                elif how == "holds":
                    ix.set_holds(key, holds)
                else:
                    ix.set_remote_holds(on)
            assert native.chain_of(key) == ref.chain_of(key) and native.chain_of(parent) == ref.chain_of(parent)
            assert native.link_count() == ref.link_count()
        else:
            req = random_request(rng, leases)
            data = msgpack.packb(req, use_bin_type=True)
            got, want = decode(native.serve(data)), decode(ref.serve(data))
            assert got == want, f"step {step}: {req!r}"
            if got is not None:
                answered += 1
                if req[0] == rpc.GET:
                    leases += [(k, d[1], d[4]) for k, d in zip(req[1], got[1]) if d is not None]
        assert len(native) == len(ref) and native.served() == ref.served()
    assert answered > 300 and leases and commits > 5 and returned > 0, "the stream must exercise the native answers"
    assert min(lease for *_, lease in leases) >= FIRST_LEASE


def test_entries_without_replicas_are_pythons():
    ix = _native.MasterIndex()
    ix.set_enabled(True)
    ix.set("disk-only", 10, 3, [])
    ix.set("dram", 10, 4, [("n0", "r0", 4096, 4096, "i0", 77)])
    ask = lambda req: decode(ix.serve(msgpack.packb(req)))  # noqa: E731
    assert ask([rpc.GET, ["dram", "disk-only"]]) is None  # promotion: Python answers the call
    assert ask([rpc.EXISTS, ["disk-only", "dram", "nope"]]) == [rpc.OK, [True, True, False]]
    assert ask([rpc.GET, ["dram", "nope"]])[1][1] is None
    ix.set_enabled(False)
    assert ask([rpc.EXISTS, ["dram"]]) is None
    ix.set_enabled(True)
    misses, hits, log = ix.drain()
    assert (misses, hits) == (1, 0) and [(k, key, g) for k, key, g, *_ in log] == [(GRANT, "dram", 4)]
    assert ask([rpc.RELEASE, [["dram", 4, log[0][3]]]]) == [rpc.OK, None]
    assert [e[:4] for e in ix.drain()[2]] == [(RELEASE, "dram", 4, log[0][3])]
    assert ix.lookup("dram") == (10, 4, [("n0", "r0", 4096, 4096, "i0", 77)]) and ix.lookup("nope") is None


def test_a_held_lock_holds_native_calls_back():
    ix = _native.MasterIndex()
    ix.set_enabled(True)
    ix.set("k", 1, 1, [("n0", "r0", 0, 4096, "i0", 0)])
    req = msgpack.packb([rpc.GET, ["k"]])
    ix.lock()
    ix.lock()  # reentrant: the mirror's setters run inside the master's sections
    ix.set("k2", 1, 1, [])
    out = []
    t = threading.Thread(target=lambda: out.append(ix.serve(req)))
    t.start()
    time.sleep(0.2)
    assert not out, "a native GET ran while the master held the index"
    ix.unlock()
    time.sleep(0.1)
    assert not out
    ix.unlock()
    t.join(5)
    assert out and decode(out[0])[1][0][1] == 1


def test_serve_master_answers_reads_natively_and_hands_the_rest_to_python(engines):  # noqa: F811
    server, client = engines(protocol="tcp"), engines(protocol="tcp")
    ix = _native.MasterIndex()
    ix.set_enabled(True)
    ix.set("k", 4096, 7, [("n0", "r0", 8192, 4096, "i0", 5)])
    python_calls = []

    def handler(data: bytes) -> bytes:
        python_calls.append(rpc.unpack(data))
        return rpc.pack([rpc.OK, "from python"])

    server.serve_master(rpc.MASTER_RPC, ix, handler)
    peer = client.connect(server.address, timeout_s=10)
    call = lambda *req: rpc.decode_reply(client.call(peer, rpc.MASTER_RPC, rpc.pack(list(req))))  # noqa: E731
    size, gen, ttl, reps, lease = call(rpc.GET, ["k"], "r0", [])[0]
    assert (size, gen, reps) == (4096, 7, [["n0", "dram", 8192, 4096, "i0", 5]]) and lease >= FIRST_LEASE
    assert call(rpc.EXISTS, ["k", "x"]) == [True, False]
    assert not python_calls
    assert call(rpc.PUT_START, [["k2", 1]]) == "from python"
    ix.set("k", 4096, 7, [])  # now on disk only
    assert call(rpc.GET, ["k"]) == "from python"
    assert [c[0] for c in python_calls] == [rpc.PUT_START, rpc.GET]
    assert ix.served() == 2


def test_replicas_share_their_node_record_and_a_remount_gets_a_new_one():
    ix = _native.MasterIndex()
    ix.set("a", 10, 1, [("n1", "ray1", 0, 64, "inc1", 0)])
    ix.set("b", 10, 2, [("n1", "ray1", 64, 64, "inc1", 0), ("n2", "ray2", 0, 64, "inc7", 5)])
    ix.set("c", 10, 3, [("n1", "ray1", 128, 64, "inc2", 0)])  # n1 remounted
    assert ix.lookup("a") == (10, 1, [("n1", "ray1", 0, 64, "inc1", 0)])
    assert ix.lookup("b") == (10, 2, [("n1", "ray1", 64, 64, "inc1", 0), ("n2", "ray2", 0, 64, "inc7", 5)])
    assert ix.lookup("c") == (10, 3, [("n1", "ray1", 128, 64, "inc2", 0)])
    for i in range(5000):  # many incarnations: the unused ones are forgotten, the used kept
        ix.set(f"k{i}", 1, 1, [("n3", "ray3", 0, 64, f"x{i}", 0)])
        ix.drop(f"k{i}")
    ix.drop_many(["b", "missing"])
    assert ix.lookup("a") == (10, 1, [("n1", "ray1", 0, 64, "inc1", 0)]) and ix.lookup("b") is None
    assert len(ix) == 2


def test_the_table_stays_exact_while_it_grows_and_shrinks():
    """Records go in and out while the table's buckets are being moved to a larger array
    (incremental rehashing): every lookup finds exactly what the model holds."""
    rng = random.Random(7)
    ix, model = _native.MasterIndex(), {}
    for step in range(120_000):
        r = rng.random()
        key = f"k{rng.randrange(60_000)}"
        if r < 0.6:
            gen = step + 1
            ix.set_cold(key, 64, gen, "n0", "r0", "i0", False, 64 * step, 64, 0, 0.0, [])
            model[key] = gen
        elif r < 0.8:
            ix.drop(key)
            model.pop(key, None)
        else:
            got = ix.lookup(key)
            assert (got is None) == (key not in model) and (got is None or got[1] == model[key]), (step, key)
    assert len(ix) == len(model) and ix.cold_count() == len(model)
    assert set(ix.keys("")) == set(model)
    assert all(ix.lookup(k)[1] == g for k, g in model.items())
    ix.clear()
    assert len(ix) == 0 and ix.keys("") == [] and ix.lookup("k1") is None


@pytest.mark.parametrize("use", ["touch", "get"])
@pytest.mark.parametrize("make", [_native.MasterIndex, PyIndex], ids=["native", "reference"])
def test_using_the_only_record_on_probation_ends_its_probation(make, use):
    """A record on probation is the newest one only when every record is on probation; a
    touch or a GET hit of it still ends its probation (seeds 263 and 537 of the
    differential stream found the native index keeping it, so a later probation landed
    behind it)."""
    ix = make()
    ix.set_enabled(True)
    ix.set_lease_ttl(1000.0)
    ix.set_grace_bytes(1 << 20)  # what goes on probation stays in the grace window
    ix.set_cold("a", 100, 1, "n1", "ray0", "inc", False, 0, 100, 0, 0.0, [])
    ix.probation("a")
    if use == "touch":
        ix.touch("a", False)
    else:
        got = msgpack.unpackb(ix.serve(msgpack.packb([rpc.GET, ["a"]], use_bin_type=True)))
        assert got[0] == rpc.OK and got[1][0] is not None
    ix.set_cold("b", 100, 2, "n1", "ray0", "inc", False, 4096, 100, 0, 0.0, [])
    ix.probation("b")
    assert ix.keys("") == ["b", "a"]  # b on probation, the oldest; a is not


@pytest.mark.parametrize("links", [True, False])
@pytest.mark.parametrize("make", [_native.MasterIndex, PyIndex], ids=["native", "reference"])
def test_with_chain_links_a_batch_read_uses_its_hits_last_to_first(make, links):
    """A prefix read is a batch GET of a chain's pages in order: with chain links its hits
    are used last to first, so the chain's end is the least recent of them and recency
    order alone (another master shard's, which cannot see the links) takes a chain from
    its end. Without links (plain LRU) a batch is used in order."""
    ix = make()
    ix.set_enabled(True)
    ix.set_chain_links(links)
    for i, key in enumerate(["p1", "p2", "p3", "x"]):
        ix.set_cold(key, 100, i + 1, "n1", "ray0", "inc", False, 1000 * i, 100, 0, 0.0, [])
    got = msgpack.unpackb(ix.serve(msgpack.packb([rpc.GET, ["p1", "nope", "p2", "p3"]], use_bin_type=True)))
    assert got[0] == rpc.OK and [g is None for g in got[1]] == [False, True, False, False]
    assert ix.keys("") == (["x", "p3", "p2", "p1"] if links else ["x", "p1", "p2", "p3"])


@pytest.mark.parametrize("remote_holds", [True, False])
@pytest.mark.parametrize("make", [_native.MasterIndex, PyIndex], ids=["native", "reference"])
def test_a_page_never_read_goes_before_a_read_leaf_although_a_child_on_another_shard_holds_it(make, remote_holds):
    """With master shards, a page's child may live on another shard: it holds the page, so
    on one shard of four most pages on probation are held and a pass found its leaves among
    the read pages (bench_chains.py: conversations kept cut at random). Leaving the probation
    records short of its need, a pass first takes those that nothing but remote children
    holds, newest first, and the parents they leave childless; a page held by a child here,
    or by a put in flight, still waits."""
    ix = make()
    ix.set_chain_links(True)
    ix.set_remote_holds(remote_holds)
    ix.set_grace_bytes(0)  # each page on probation goes straight to the stack
    for i, key in enumerate(["r1", "r2", "p1", "p2", "w", "q1", "q2"]):
        ix.set_cold(key, 100, i + 1, "n1", "ray0", "inc", False, 1000 * i, 100, 0, 0.0, [])
    ix.link("r2", "r1")  # a read chain: r1 <- r2, r2 its leaf
    ix.link("p2", "p1")  # never read: p1 <- p2, p2's child on another shard
    ix.link("q2", "q1")
    for key in ("p1", "p2", "w", "q1", "q2"):
        ix.probation(key)
    for key in ("p2", "w", "q1"):  # q1: held by q2 here and by a child elsewhere
        ix.set_holds(key, 2)
    ix.set_holds("w", 3)  # and a put naming w is in flight
    assert ix.keys("") == ["q2", "q1", "w", "p2", "p1", "r1", "r2"]
    keys, _g, _r, freed, stop, held = ix.evict_cold("", "n1", time.monotonic(), 250, True)
    if remote_holds:
        # q2, the stack's top, is a leaf; at the read pages the pass takes what only
        # remote children held, least recent first: q1 (q2 gone), then p2 (p1 waits for
        # nothing now, but the need is met); w waits for its put, the read leaf stays
        assert keys == ["q2", "q1", "p2"] and freed == 300 and held == []
        assert ix.keys("") == ["w", "p1", "r1", "r2"]
        keys, *_rest = ix.evict_cold("", "n1", time.monotonic(), 150, True)
        assert keys == ["p1", "r2"]  # a new pass: p1 is a leaf now; then the read leaf
    else:  # one shard (remote holds off): only local children and puts hold
        assert keys == ["q2", "q1", "p2"] and freed == 300


@pytest.mark.parametrize("make", [_native.MasterIndex, PyIndex], ids=["native", "reference"])
def test_chain_eviction_takes_leaves_first_and_a_parent_right_after_its_last_child(make):
    ix = make()
    ix.set_chain_links(True)
    # least recent first: a1 <- a2 <- a3 (a chain), b (plain), c1 <- c2, a2 <- a2x (a fork)
    order = ["a1", "a2", "b", "c1", "a3", "c2", "a2x"]
    parents = {"a2": "a1", "a3": "a2", "c2": "c1", "a2x": "a2"}
    for i, key in enumerate(order):
        ix.set_cold(key, 100, i + 1, "n1", "ray0", "inc", False, 1000 * i, 100, 0, 0.0, [])
    for key, parent in parents.items():
        ix.link(key, parent)
    assert ix.chain_of("a2") == ("a1", 2, 0) and ix.chain_of("a1") == ("", 1, 0)
    ix.set_holds("c2", 1)  # a put naming c2 is in flight: it holds c2 as a child would
    keys, _gens, runs, freed, stop, held = ix.evict_cold("", "n1", time.monotonic(), 450, True)
    # b is the least recent leaf; a3 leaves a2 with a2x; a2x takes a2 then a1 at once
    assert keys == ["b", "a3", "a2x", "a2", "a1"] and freed == 500 and stop is None and held == []
    assert runs == [(0, 100), (1000, 100), (2000, 100), (4000, 100), (6000, 100)]
    assert ix.keys("") == ["c1", "c2"] and ix.chain_of("c1") == ("", 1, 0)
    # c1 and c2 are held; the list ends short: both listed for a forced eviction, least recent first
    keys, _g, _r, freed, stop, held = ix.evict_cold("", "n1", time.monotonic(), 1000, True)
    assert keys == [] and freed == 0 and [k for k, _rec in held] == ["c1", "c2"]
    assert held[0][1] == (4, 100, 3000, 100)
    ix.set_holds("c2", 0)
    keys, *_rest = ix.evict_cold("", "n1", time.monotonic(), 1000, True)
    assert keys == ["c2", "c1"] and ix.keys("") == [] and ix.link_count() == 0
    # without chains, plain LRU order; a removed parent leaves its children unlinked
    for i, key in enumerate(order):
        ix.set_cold(key, 100, i + 1, "n1", "ray0", "inc", False, 1000 * i, 100, 0, 0.0, [])
    for key, parent in parents.items():
        ix.link(key, parent)
    ix.drop("a2")
    assert ix.chain_of("a3") == ("", 0, 0) and ix.chain_of("a1") == ("", 0, 0)
    keys, *_rest = ix.evict_cold("", "n1", time.monotonic(), 250, False)
    assert keys == ["a1", "b", "c1"]
