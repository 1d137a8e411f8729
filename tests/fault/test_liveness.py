"""A busy store node is not a dead one: liveness comes from the heartbeat alone, an
inventory update that is late is delivered later (never a reason to unmount), and a node
unmounted for silence rejoins with its keys. Faults injected on a real 3-node Ray cluster:
a stalled inventory applier, SIGSTOP for less and for more than ``node_ttl_s``, 15 s
of puts with eviction."""

import os
import signal
import threading
import time

import numpy as np
import ray

from mooncake_ray._private.naming import MASTER_NAME, store_actor_name
from tests.conftest import wait_for

KB = 1024
TTL_S = 3.0


def val(i, n=4 * KB):
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def handles(store, ray_cluster):
    ns = store.config.namespace
    master = ray.get_actor(MASTER_NAME, namespace=ns)
    nodes = {nid: ray.get_actor(store_actor_name(nid), namespace=ns) for nid in ray_cluster.store_node_ids}
    return master, nodes


def assert_inventories_agree(master, nodes):
    """Every node holds exactly what the master believes it holds (once delivered)."""
    assert ray.get(master.flush_inventory.remote(30.0)), "inventory updates still undelivered"
    for nid, actor in nodes.items():
        want = sorted(tuple(e) for e in ray.get(master.node_entries.remote(nid)))
        have = sorted(tuple(e) for e in ray.get(actor.inventory_snapshot.remote()) if e[3] == "dram")
        assert have == want, f"node {nid[:8]}: {len(have)} entries held, master knows {len(want)}"


def counters(master):
    st = ray.get(master.stats.remote())
    return st["node_unmounts"], st["unmount_lost_keys"]


def test_stalled_inventory_applier_is_not_unmounted(make_store, ray_cluster):
    # Placement per object, so both nodes take puts while one of them cannot apply updates.
    s = make_store(master={"node_ttl_s": TTL_S, "allocation_strategy": "free_ratio_first", "put_slab_bytes": 0})
    master, nodes = handles(s, ray_cluster)
    victim = ray_cluster.store_node_ids[0]
    ray.get(nodes[victim].debug_stall_inventory.remote(3 * TTL_S))  # longer than the TTL
    keys = [f"k{i}" for i in range(300)]
    t0 = time.monotonic()
    failed, first = [], {}
    # A put is acknowledged once its nodes have recorded it: the first batch (both nodes
    # take some of it) waits for the stalled node, in a thread of its own meanwhile.
    th = threading.Thread(target=lambda: first.setdefault("res", s.batch_put(keys[:10], [val(j) for j in range(10)])))
    th.start()
    time.sleep(0.5)
    # Occupy every thread of the master's default concurrency group for two TTLs (these
    # calls wait for the stalled node): heartbeats have a group of their own.
    busy = [master.flush_inventory.remote(2 * TTL_S) for _ in range(4)]
    th.join()
    failed += [k for k, r in zip(keys[:10], first["res"]) if r is not None]
    for i in range(10, len(keys), 10):  # then puts keep coming
        res = s.batch_put(keys[i:i + 10], [val(j) for j in range(i, i + 10)])
        failed += [k for k, r in zip(keys[i:i + 10], res) if r is not None]
        time.sleep(max(0.0, (i / 10) * 0.3 - (time.monotonic() - t0)))
    assert time.monotonic() - t0 > 2 * TTL_S
    assert counters(master) == (0, 0)  # (node_unmounts, unmount_lost_keys)
    assert ray.get(busy) == [False] * 4  # they did block for two TTLs
    assert failed == []
    placed = {nid for k in keys for nid, _t, _r in ray.get(master.where.remote([k]))[0]}
    assert victim in placed  # the stalled node kept taking puts: it was never suspect
    assert {n["node_id"] for n in ray.get(master.nodes.remote())} == set(nodes)
    assert s.batch_get(keys) == [val(i) for i in range(len(keys))]
    assert_inventories_agree(master, nodes)


def test_paused_shorter_than_ttl_keeps_its_keys(make_store, ray_cluster):
    s = make_store(master={"node_ttl_s": TTL_S})
    master, nodes = handles(s, ray_cluster)
    keys = [f"p{i}" for i in range(100)]
    assert s.batch_put(keys, [val(i) for i in range(100)]) == [None] * 100
    pids = {nid: ray.get(a.pid.remote()) for nid, a in nodes.items()}
    for pid in pids.values():
        os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(TTL_S * 0.4)
    finally:
        for pid in pids.values():
            os.kill(pid, signal.SIGCONT)
    time.sleep(TTL_S)  # a wrong unmount would have happened by now
    assert counters(master) == (0, 0)
    assert s.batch_get(keys) == [val(i) for i in range(100)]
    assert_inventories_agree(master, nodes)


def test_paused_longer_than_ttl_is_unmounted_and_rejoins_with_its_keys(make_store, ray_cluster):
    # Per-object placement: the paused node's keys are known; after the unmount, puts and
    # removes go on while it is away (it is owed those drops and adds when it returns).
    s = make_store(master={"node_ttl_s": TTL_S, "allocation_strategy": "free_ratio_first", "put_slab_bytes": 0})
    master, nodes = handles(s, ray_cluster)
    victim = ray_cluster.store_node_ids[0]
    keys = [f"r{i}" for i in range(200)]
    assert s.batch_put(keys, [val(i) for i in range(200)]) == [None] * 200
    on_victim = [k for k in keys if any(n == victim for n, _t, _r in ray.get(master.where.remote([k]))[0])]
    assert len(on_victim) > 20
    removed = on_victim[:10]
    pid = ray.get(nodes[victim].pid.remote())
    os.kill(pid, signal.SIGSTOP)
    try:
        for k in removed:  # drops the paused node cannot apply yet
            assert s.remove(k)
        wait_for(lambda: victim not in {n["node_id"] for n in ray.get(master.nodes.remote())},
                 timeout_s=6 * TTL_S, what="the paused node to be unmounted")
        unmounts, lost = counters(master)
        assert unmounts == 1 and lost == len(on_victim) - len(removed)
        kept = [k for k in keys if k not in on_victim]
        assert s.batch_get(kept) == [val(keys.index(k)) for k in kept]  # the other node serves
        assert s.batch_put(["during"], [val(999)]) == [None]
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: victim in {n["node_id"] for n in ray.get(master.nodes.remote())},
             timeout_s=30, what="the node to rejoin")
    back = [k for k in on_victim if k not in removed]
    got = s.batch_get(on_victim)
    assert got[len(removed):] == [val(keys.index(k)) for k in back]  # its keys are back
    assert got[:len(removed)] == [None] * len(removed)  # removed while away: stay removed
    assert s.get("during") == val(999)
    assert_inventories_agree(master, nodes)


def test_puts_under_constant_eviction_lose_nothing(make_store, ray_cluster):
    """Two writers keep a 16 MiB arena per node evicting for at least 15 s and until the
    arenas turned over twice (evictions twice what they hold: the amount of work, not the
    host's speed, decides when to stop); every put succeeds, no node is unmounted, every
    key still indexed reads back right, and each node's inventory ends equal to the
    master's view of it. The longer soak, with CPU hogs beside it, is
    ``benchmarks/bench_liveness.py``."""
    s = make_store(segment_size_bytes="16mb", master={"node_ttl_s": TTL_S})
    master, nodes = handles(s, ray_cluster)
    stop = threading.Event()
    done, failed = [0, 0], []
    payload = {i: val(i, 256) for i in range(64)}

    def writer(w):
        n = 0
        while not stop.is_set():
            keys = [f"w{w}/{n + j}" for j in range(1000)]
            res = s.batch_put(keys, [payload[(n + j) % 64] for j in range(1000)])
            failed.extend(r for r in res if r is not None)
            n += 1000
            done[w] = n

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    start = time.monotonic()
    try:
        while True:
            time.sleep(1.0)
            st = ray.get(master.stats.remote())
            turned = st["evictions"] >= 2 * st["keys"] > 0
            if turned and time.monotonic() - start >= 15:
                break
            assert time.monotonic() - start < 120, f"the arenas did not turn over twice in 120 s: {st}"
    finally:
        stop.set()
        for t in threads:
            t.join()
    st = ray.get(master.stats.remote())
    assert failed == []
    assert st["evictions"] >= 2 * st["keys"], st
    assert (st["node_unmounts"], st["unmount_lost_keys"]) == (0, 0)
    tail = [f"w{w}/{n}" for w in range(2) for n in range(done[w] - 2000, done[w])]
    got = s.batch_get(tail)
    for k, v in zip(tail, got):
        assert v is None or v == payload[int(k.split("/")[1]) % 64], k
    assert sum(v is not None for v in got) > 0
    assert_inventories_agree(master, nodes)
