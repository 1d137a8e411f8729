"""Injected faults on a real 3-node Ray cluster: a store node killed mid-read-loop, the
master killed (after a batch of puts, and at random moments of a put stream), a client
killed mid-put, puts right after their node's SIGKILL."""

import os
import threading
import time
import traceback

import numpy as np
import pytest
import ray

import mooncake_ray
from mooncake_ray._private import rpc
from mooncake_ray._private.naming import MASTER_NAME, store_actor_name
from tests.conftest import wait_for

KB = 1024
MB = 1 << 20


def val(i, n=64 * KB):
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("keep_arena", [False, True])
def test_store_node_killed_during_read_loop(make_store, ray_cluster, keep_arena):
    """Without its arena kept, the killed node's keys are clean misses; with it (the
    default), the restarted node re-adopts them: all read back."""
    # Placement per object (no put slabs, which place a client's small puts per slab), so
    # the single-replica keys spread over both nodes.
    s = make_store(master={"allocation_strategy": "free_ratio_first", "put_slab_bytes": 0},
                   elastic={"keep_arena": keep_arena})
    ns = s.config.namespace
    both = [f"both{i}" for i in range(20)]
    single = [f"one{i}" for i in range(20)]
    assert s.batch_put(both, [val(i) for i in range(20)], replicas=2) == [None] * 20
    assert s.batch_put(single, [val(100 + i) for i in range(20)], replicas=1) == [None] * 20
    expect = {**{k: val(i) for i, k in enumerate(both)}, **{k: val(100 + i) for i, k in enumerate(single)}}
    victim = ray_cluster.store_node_ids[0]
    wrong, both_missing, rounds = [], [], [0]
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            got = s.batch_get(both + single)
            for k, v in zip(both + single, got):
                if v is not None and v != expect[k]:
                    wrong.append(k)
                if v is None and k in both:
                    both_missing.append(k)
            rounds[0] += 1

    t = threading.Thread(target=reader)
    t.start()
    wait_for(lambda: rounds[0] >= 3, what="reads before the kill")
    master = ray.get_actor(MASTER_NAME, namespace=ns)
    old_inc = {n["node_id"]: n["incarnation"] for n in ray.get(master.nodes.remote())}[victim]
    ray.kill(ray.get_actor(store_actor_name(victim), namespace=ns), no_restart=False)
    killed_at = time.monotonic()
    before = rounds[0]
    wait_for(lambda: rounds[0] >= before + 20, timeout_s=60, what="reads after the kill")
    # Puts go elsewhere (or to the restarted node) within a few seconds.
    deadline = time.monotonic() + 10
    while True:
        res = s.batch_put([f"after{time.monotonic()}"], [b"x"])
        if res == [None] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    put_delay = time.monotonic() - killed_at

    def victim_replaced():
        now = {n["node_id"]: n["incarnation"] for n in ray.get(master.nodes.remote())}
        return now.get(victim) not in (None, old_inc)

    wait_for(victim_replaced, timeout_s=30, what="the master to drop the dead node's replicas")
    before = rounds[0]
    wait_for(lambda: rounds[0] >= before + 5, timeout_s=60, what="reads after the node came back")
    stop.set()
    t.join()
    assert res == [None] and put_delay < 10
    assert wrong == [], f"wrong bytes returned for {wrong}"
    assert both_missing == [], f"replicated keys missed: {sorted(set(both_missing))}"
    got = s.batch_get(single)
    lost = [k for k, v in zip(single, got) if v is None]
    if keep_arena:
        assert lost == []  # re-adopted by the restarted node
    else:
        assert 0 < len(lost) < 20  # the victim's keys are clean misses, the others still read
    assert all(v == expect[k] for k, v in zip(single, got) if v is not None)


def test_master_killed_all_keys_readable_after_it_returns(make_store):
    s = make_store()
    keys = [f"m{i}" for i in range(60)]
    assert s.batch_put(keys, [val(i, 10 * KB) for i in range(60)]) == [None] * 60
    master = ray.get_actor(MASTER_NAME, namespace=s.config.namespace)
    inc = ray.get(master.ping.remote())
    # No waiting for deliveries: a put is acknowledged once its node has recorded it.
    ray.kill(master, no_restart=False)
    wait_for(lambda: ray.get(master.ping.remote()) != inc, timeout_s=60, what="the master to restart")
    # The new master is rebuilding its index from the store nodes' inventories: the
    # client waits and retries meanwhile.
    got = s.batch_get(keys)
    assert [k for k, v in zip(keys, got) if v is None] == []
    assert all(v == val(i, 10 * KB) for i, v in enumerate(got))
    st = s.stats()
    assert st["keys"] == 60 and not st["recovering"]
    # The restarted master asked every store node to heartbeat at once (no node waits out
    # its period before it remounts).
    nodes = [ray.get_actor(store_actor_name(n["node_id"]), namespace=s.config.namespace)
             for n in ray.get(master.nodes.remote())]
    wait_for(lambda: all(ray.get(n.stats.remote())["woken"] >= 1 for n in nodes), timeout_s=30,
             what="every store node to be woken by the restarted master")
    # Puts resume at once (the nodes recorded every slab: the new master allocates around
    # them); the client's slab from the old master is refused at commit and those values
    # go the two-call way.
    more = [f"after{i}" for i in range(20)]
    assert s.batch_put(more, [val(100 + i, 6 * KB) for i in range(20)]) == [None] * 20
    s.put("after-restart", b"ok")
    assert s.get("after-restart") == b"ok"
    assert s.batch_get(keys + more) == [val(i, 10 * KB) for i in range(60)] + [val(100 + i, 6 * KB) for i in range(20)]


def test_master_killed_at_random_moments_of_a_put_stream_keeps_every_acknowledged_key(make_store):
    """SIGKILL the master at random moments while a thread puts: one-call puts into slabs
    (answered by the native index), two-call puts of values larger than half a slab, and
    batches of both. Every put that returned without an error is readable afterwards,
    with its bytes."""
    s = make_store(master={"put_slab_bytes": "256kb"})
    master = ray.get_actor(MASTER_NAME, namespace=s.config.namespace)
    acked, stop, errors = {}, threading.Event(), {}
    in_call = [None]  # when the writer's current batch_put began (None between calls)
    sizes = [2 * KB, 8 * KB, 160 * KB]  # the last takes PUT_START / PUT_END (over half a slab)
    room = s.stats()["capacity"] // 2  # nothing is evicted: a lost key is lost to the kill

    def writer():
        i = 0
        while not stop.is_set() and sum(n for _, n in acked.values()) < room:
            i += 1
            keys = [f"stream{i}.{j}" for j in range(1 + i % 3)]
            vals = [val(i * 10 + j, sizes[(i + j) % 3]) for j in range(len(keys))]
            in_call[0] = time.monotonic()
            try:
                res = s.batch_put(keys, vals)
            except mooncake_ray.MooncakeRayError as e:
                errors[repr(e)[:120]] = errors.get(repr(e)[:120], 0) + 1
                continue
            except BaseException:  # anything else ends the writer: keep it for the failure message
                errors["writer died"] = traceback.format_exc()[-2000:]
                raise
            finally:
                in_call[0] = None
            for r in res:
                if r is not None:
                    errors[repr(r)[:120]] = errors.get(repr(r)[:120], 0) + 1
            acked.update({k: (i * 10 + j, len(v)) for j, (k, v, r) in enumerate(zip(keys, vals, res)) if r is None})
            time.sleep(0.005)  # a steady stream, not a flood: the arena must not fill before the last kill

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    rng = np.random.default_rng(7)
    try:
        for _ in range(3):
            n = len(acked)
            try:
                wait_for(lambda: len(acked) > n + 10, timeout_s=60, what="puts to go on")
            except AssertionError as e:
                began = in_call[0]
                busy = "between calls" if began is None else f"in one batch_put for {time.monotonic() - began:.1f}s"
                raise AssertionError(f"{e}: writer alive {t.is_alive()} ({busy}), {sum(b for _, b in acked.values())} "
                                     f"bytes acked of {room}, errors {errors}") from None
            time.sleep(float(rng.uniform(0.0, 0.3)))
            inc, pid = ray.get(master.ping.remote()), ray.get(master.pid.remote())
            os.kill(pid, 9)
            wait_for(lambda: ray.get(master.ping.remote()) != inc, timeout_s=60, what="the master to restart")
    finally:
        stop.set()
        t.join(timeout=120)
    keys = sorted(acked)
    got = s.batch_get(keys)
    lost = [k for k, v in zip(keys, got) if v is None]
    print(f"{len(keys)} keys acknowledged around 3 master kills")
    assert lost == [], f"{len(lost)} of {len(keys)} acknowledged keys lost: {lost[:10]}"
    # a put is answered as what happened: the master out of reach for the whole retry
    # window is the only failure a master kill may cause
    assert [e for e in errors if not e.startswith("MasterUnavailableError(")] == [], errors
    assert [k for k, v in zip(keys, got) if v != val(acked[k][0], acked[k][1])] == []


def test_a_put_whose_master_restarts_between_its_two_calls_is_put_again(make_store):
    """The master is SIGKILLed after PUT_START allocated a value and before PUT_END: the
    new master has no pending put to publish, so the client puts the value again and the
    call answers success, not the restarted master's "no pending put"."""
    s = make_store(master={"put_slab_bytes": 0})  # every put takes PUT_START / PUT_END
    master = ray.get_actor(MASTER_NAME, namespace=s.config.namespace)
    writes, write = [], s._writes._write

    def kill_the_master_then_write(ops, owners, *sums):
        writes.append(len(ops))
        if len(writes) == 1:
            inc = ray.get(master.ping.remote())
            os.kill(ray.get(master.pid.remote()), 9)
            wait_for(lambda: ray.get(master.ping.remote()) != inc, timeout_s=60, what="the master to restart")
        return write(ops, owners, *sums)

    s._writes._write = kill_the_master_then_write
    assert s.batch_put(["a", "b"], [val(1, 96 * KB), val(2, 8 * KB)]) == [None, None]
    assert len(writes) == 2  # written once for the lost allocation, once more for the new one
    s._writes._write = write
    assert s.batch_get(["a", "b"]) == [val(1, 96 * KB), val(2, 8 * KB)]
    assert s.stats()["pending"] == 0


@ray.remote(num_cpus=0, max_restarts=0)
class DyingWriter:
    def __init__(self, namespace):
        self.s = mooncake_ray.connect(namespace=namespace)

    def start_put_then_die(self, key, size):
        reply = self.s._master.call(rpc.PUT_START, [[key, size, None, False]], None, "dying")
        assert not rpc.is_err(reply[0]), reply
        os._exit(1)


def test_client_killed_mid_put_space_reclaimed(make_store):
    s = make_store(master={"put_timeout_s": 3.0})
    w = DyingWriter.remote(s.config.namespace)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(w.start_put_then_die.remote("orphan", 4 << 20))
    st = s.stats()
    assert st["pending"] == 1 and st["used"] >= 4 << 20
    wait_for(lambda: s.stats()["pending"] == 0, timeout_s=15, what="the orphaned put to be revoked")
    assert s.stats()["used"] == 0
    assert not s.exists("orphan")
    s.put("orphan", b"now it works")
    assert s.get("orphan") == b"now it works"


def test_store_node_killed_under_a_clients_put_slab(make_store, ray_cluster):
    """The node holding a client's put slab dies: puts go on (a new slab elsewhere, or the
    two-call path), nothing reads back wrong, and what is put once the master has dropped
    the dead incarnation is all readable."""
    s = make_store(master={"allocation_strategy": "free_ratio_first", "put_slab_bytes": "8mb"})
    ns = s.config.namespace
    master = ray.get_actor(MASTER_NAME, namespace=ns)
    s.put("first", val(0, 8 * KB))
    victim = s._slabs.current.node_id
    old_inc = {n["node_id"]: n["incarnation"] for n in ray.get(master.nodes.remote())}[victim]
    ray.kill(ray.get_actor(store_actor_name(victim), namespace=ns), no_restart=False)

    def gone():
        return {n["node_id"]: n["incarnation"] for n in ray.get(master.nodes.remote())}.get(victim) != old_inc

    done, i, deadline = [], 0, time.monotonic() + 60
    while time.monotonic() < deadline:
        i += 1
        try:
            s.put(f"after{i}", val(i, 8 * KB))
            done.append(i)
        except (mooncake_ray.NodeUnavailableError, mooncake_ray.TransferError, mooncake_ray.NoCapacityError):
            time.sleep(0.05)
        if i % 20 == 0 and gone():
            break
    assert gone(), "the master never dropped the killed node"
    late = list(range(i + 1, i + 51))
    assert s.batch_put([f"after{j}" for j in late], [val(j, 8 * KB) for j in late]) == [None] * 50
    got = s.batch_get([f"after{j}" for j in done + late])
    assert [j for j, v in zip(done + late, got) if v is not None and v != val(j, 8 * KB)] == []
    assert all(v is not None for v in got[len(done):]), "puts after the node was dropped got lost"
    assert len(done) >= 20  # puts kept going while the node was dying


def test_put_acknowledged_right_after_a_node_sigkill_is_kept(make_store, ray_cluster):
    """The client's write into the dead node's mapped arena succeeds; the master holds the
    commit's reply until the node records it, finds the node gone, and the client puts the
    value again elsewhere: every put succeeds, none is lost."""
    s = make_store(master={"put_slab_bytes": "8mb"})
    ns = s.config.namespace
    master = ray.get_actor(MASTER_NAME, namespace=ns)
    s.put("first", val(0, 8 * KB))
    victim = s._slabs.current.node_id
    old_inc = {n["node_id"]: n["incarnation"] for n in ray.get(master.nodes.remote())}[victim]
    os.kill(ray.get(ray.get_actor(store_actor_name(victim), namespace=ns).pid.remote()), 9)
    acked, took = [], []
    for i in range(5):
        t0 = time.monotonic()
        s.put(f"right-after{i}", val(i, 8 * KB))
        took.append(time.monotonic() - t0)
        acked.append(i)
    print("put latencies right after the kill (s):", [round(t, 3) for t in took])
    wait_for(lambda: {n["node_id"]: n["incarnation"] for n in ray.get(master.nodes.remote())}.get(victim) != old_inc,
             timeout_s=60, what="the master to drop the killed node")
    got = s.batch_get([f"right-after{i}" for i in acked])
    assert [i for i, v in zip(acked, got) if v != val(i, 8 * KB)] == [], f"acknowledged puts lost, of {acked}"


def test_puts_whose_replies_come_after_the_client_timeout_succeed_once(make_store, ray_cluster):
    """Every store node holds its inventory messages for 3 s, past the client's 2 s RPC
    timeout: the master holds each put's reply until the nodes record the value (durable
    acknowledgements), so the client sends the call again. One-call puts into a slab (the
    slab given back with the first attempt), two-call puts and batches of both: each is
    answered with its success once, stored once, never ObjectExistsError. (The arena is not
    kept, so the nodes have no commit ring: every reply waits for the stalled nodes.)"""
    s = make_store(master={"put_slab_bytes": "256kb", "allocation_strategy": "free_ratio_first"},
                   elastic={"keep_arena": False})
    ns = s.config.namespace
    nodes = [ray.get_actor(store_actor_name(n), namespace=ns) for n in ray_cluster.store_node_ids]
    master = ray.get_actor(MASTER_NAME, namespace=ns)
    assert s.put("warm", b"x") is None  # the client's slab and connections exist
    small = [f"small{i}" for i in range(20)]  # one call each (into the slab)
    large = [f"large{i}" for i in range(3)]  # over half a slab: PUT_START / PUT_END
    before = ray.get(master.stats.remote())
    ray.get([n.debug_stall_inventory.remote(3.0) for n in nodes])
    t0 = time.monotonic()
    res = s.batch_put(small[:10] + large[:2], [val(i, 2 * KB) for i in range(10)] + [val(50 + i, 160 * KB)
                                                                                     for i in range(2)])
    waited = time.monotonic() - t0
    assert res == [None] * 12
    ray.get([n.debug_stall_inventory.remote(3.0) for n in nodes])
    assert s.put(small[10], val(10, 2 * KB)) is None and s.put(large[2], val(52, 160 * KB)) is None
    assert waited > 2.0, f"the replies came after {waited:.1f}s: not past the client's timeout"
    after = ray.get(master.stats.remote())
    assert after["puts"] - before["puts"] == 14  # each value published once
    got = s.batch_get(small[:11] + large)
    assert got == [val(i, 2 * KB) for i in range(11)] + [val(50 + i, 160 * KB) for i in range(3)]


def _ring_acked_puts(s, nodes, prefix: str, n: int) -> list[str]:
    """``n`` puts answered while every store node holds its inventory messages (its
    applier stalled for 20 s): only the commit ring records them on the nodes."""
    master = ray.get_actor(MASTER_NAME, namespace=s.config.namespace)
    assert s.put(f"{prefix}-warm", b"x") is None  # the client's slab exists
    before = ray.get(master.stats.remote())["ring_acks"]
    ray.get([n_.debug_stall_inventory.remote(20.0) for n_ in nodes])
    keys = [f"{prefix}{i}" for i in range(n)]
    for i, k in enumerate(keys):
        assert s.put(k, val(i, 4 * KB)) is None
    assert ray.get(master.stats.remote())["ring_acks"] - before == n  # none waited for a node
    return keys


def test_puts_answered_through_the_commit_ring_survive_a_master_kill(make_store, ray_cluster):
    """The master answers a put once it has written the value's record into its node's
    commit ring, without waiting for the node. Killed then, with every node's applier
    stalled (no message of it applied, nothing journaled), the new master still finds every
    value: each node reads its ring before it mounts."""
    s = make_store(master={"put_slab_bytes": "8mb"})
    ns = s.config.namespace
    nodes = [ray.get_actor(store_actor_name(n), namespace=ns) for n in ray_cluster.store_node_ids]
    keys = _ring_acked_puts(s, nodes, "rm", 40)
    master = ray.get_actor(MASTER_NAME, namespace=ns)
    inc, pid = ray.get(master.ping.remote()), ray.get(master.pid.remote())
    os.kill(pid, 9)
    wait_for(lambda: ray.get(master.ping.remote()) != inc, timeout_s=60, what="the master to restart")
    got = s.batch_get(keys)
    assert [k for k, v in zip(keys, got) if v != val(keys.index(k), 4 * KB)] == []


def test_puts_answered_through_the_commit_ring_survive_their_nodes_restart(make_store, ray_cluster):
    """The same, with the node SIGKILLed instead (the kept arena), twice: the restarted
    process reads what the previous one left in its ring, and the master takes those values
    back; a third process finds them in the files the second left."""
    s = make_store(master={"put_slab_bytes": "8mb"})
    ns = s.config.namespace
    nodes = [ray.get_actor(store_actor_name(n), namespace=ns) for n in ray_cluster.store_node_ids]
    keys = _ring_acked_puts(s, nodes, "rn", 40)
    victim = s._slabs.current.node_id
    actor = ray.get_actor(store_actor_name(victim), namespace=ns)
    master = ray.get_actor(MASTER_NAME, namespace=ns)

    def restart():
        old = ray.get(actor.ping.remote())
        os.kill(ray.get(actor.pid.remote()), 9)
        wait_for(lambda: ray.get(actor.ping.remote()) != old, timeout_s=60, what="the store node to restart")
        wait_for(lambda: {n["node_id"]: n["incarnation"] for n in ray.get(master.nodes.remote())}.get(victim)
                 == ray.get(actor.ping.remote()), timeout_s=30, what="the restarted node to remount")

    restart()
    # Killed again before it applies any message: what it took from the previous process's
    # ring is in its arena's files only as its re-adoption journaled it.
    ray.get(actor.debug_stall_inventory.remote(20.0))
    restart()
    ray.get([n_.debug_stall_inventory.remote(0.0) for n_ in nodes])
    got = s.batch_get(keys)
    assert [k for k, v in zip(keys, got) if v != val(keys.index(k), 4 * KB)] == []


def test_a_ring_value_changed_in_the_arena_before_its_node_read_it_is_dropped_at_restart(make_store, ray_cluster):
    """Values of 1 MiB answered through the commit ring carry the checksum their client took
    in its copy. The node, its applier stalled, has not read the ring yet when one value's
    bytes are changed in the arena and the node is SIGKILLed: the restarted process checks
    the ring's values against their checksums and drops the changed one (a miss), where it
    used to take the bytes as they were; the others read back intact."""
    # a slab budget (half the headroom above 0.9) that holds the three values in one slab
    s = make_store(master={"put_slab_bytes": "16mb", "high_watermark": 0.9})
    ns = s.config.namespace
    nodes = [ray.get_actor(store_actor_name(n), namespace=ns) for n in ray_cluster.store_node_ids]
    master = ray.get_actor(MASTER_NAME, namespace=ns)
    assert s.put("warm", b"x") is None  # the client's slab exists
    victim = s._slabs.current.node_id
    actor = ray.get_actor(store_actor_name(victim), namespace=ns)
    ray.get([n_.debug_stall_inventory.remote(20.0) for n_ in nodes])
    keys = [f"big{i}" for i in range(3)]
    for i, k in enumerate(keys):
        assert s.put(k, val(i, MB)) is None
    where = {e[0]: e for e in ray.get(master.node_entries.remote(victim))}
    assert set(keys) <= set(where)  # all in the client's slab, on the victim
    path = next(n for n in ray.get(master.nodes.remote()) if n["node_id"] == victim)["arena_file"]
    with open(path, "r+b") as f:  # flip bytes of keys[1] in the arena
        f.seek(where[keys[1]][4] + 4096)
        f.write(bytes(b ^ 0xFF for b in f.read(16)))
    old = ray.get(actor.ping.remote())
    os.kill(ray.get(actor.pid.remote()), 9)
    wait_for(lambda: ray.get(actor.ping.remote()) != old, timeout_s=60, what="the store node to restart")

    def readopted():
        got = [e for e in ray.get(master.events.remote())
               if e["event"] == "readopted" and e.get("node_id") == victim]  # this store's first
        return got[-1] if got else None

    ev = wait_for(readopted, timeout_s=30, what="the re-adoption event")
    assert ev["dropped"] == 1, ev
    ray.get([n_.debug_stall_inventory.remote(0.0) for n_ in nodes])
    wait_for(lambda: s.get(keys[0]) is not None, timeout_s=30, what="the restarted node to serve")
    assert s.batch_get(keys) == [val(0, MB), None, val(2, MB)]
