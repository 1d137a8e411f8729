"""The store follows the Ray cluster's size, on the shared multi-node cluster: a Ray node
that joins gets a store node and takes puts; a node Ray drains moves its values to the
others before it goes (none lost with room elsewhere, those on its disk too, reads never
failing meanwhile; with a deadline too short, only what it reports is lost); a store node
SIGKILLed and restarted by Ray re-adopts its arena (a value corrupted on purpose is a
miss); a rolling restart of every store node under load loses nothing."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import ray

from mooncake_ray._private import deploy, elastic
from mooncake_ray._private.naming import MASTER_NAME, store_actor_name
from mooncake_ray.cli import format_status
from tests.conftest import STORE_RESOURCE, prometheus, query, wait_for  # noqa: F401 - fixture

KB = 1024

ELASTIC = {"poll_s": 0.5}
PLACEMENT = {"allocation_strategy": "free_ratio_first", "put_slab_bytes": 0}


def val(i, n=64 * KB):
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture
def extra_node(ray_cluster):
    """Add Ray nodes with the store resource to the shared cluster; removed after the test."""
    added = []

    def add():
        node = ray_cluster.add_node(num_cpus=1, resources={STORE_RESOURCE: 1})
        ray_cluster.wait_for_nodes()
        added.append(node)
        return node

    yield add
    for node in added:
        # Graceful: the raylet tells the GCS it is leaving, so the node is dead at once (a
        # killed raylet is found dead only after Ray's health checks, about 16 s here).
        ray_cluster.remove_node(node, allow_graceful=True)
    gone = {n.node_id for n in added}
    wait_for(lambda: not any(n["Alive"] for n in ray.nodes() if n["NodeID"] in gone), timeout_s=60,
             what="removed nodes to be reported dead")


def master_of(s):
    return ray.get_actor(MASTER_NAME, namespace=s.config.namespace)


def actor_node(handle) -> str:
    """The Ray node an actor runs on (from the GCS)."""
    return ray._private.state.actors(handle._actor_id.hex())["Address"]["NodeID"]


def mounted(master) -> dict:
    return {n["node_id"]: n["incarnation"] for n in ray.get(master.nodes.remote())}


def keys_on(master, keys, node_id) -> list:
    where = ray.get(master.where.remote(keys))
    return [k for k, reps in zip(keys, where) if any(r[0] == node_id for r in reps)]


def disk_only(master, keys, node_id) -> list:
    """The keys whose only copy is on ``node_id``'s disk."""
    where = ray.get(master.where.remote(keys))
    return [k for k, reps in zip(keys, where) if reps and all(r[0] == node_id and r[1] == "disk" for r in reps)]


def event(master, kind, node_id, after=0.0):
    return next((e for e in ray.get(master.events.remote())
                 if e["event"] == kind and e.get("node_id") == node_id and e.get("time", after) >= after), None)


class Load:
    """Puts of new keys and reads of acknowledged ones, on threads, until stopped."""

    def __init__(self, s, prefix, replicas=1):
        self.s, self.prefix, self.replicas = s, prefix, replicas
        self.acked: list[int] = []
        self.wrong: list[str] = []
        self.read_errors: list[str] = []
        self.misses: list[str] = []
        self.put_errors = 0
        self.reads = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._writer), threading.Thread(target=self._reader)]
        for t in self._threads:
            t.start()

    def _writer(self):
        i = 0
        while not self._stop.is_set():
            try:
                self.s.put(f"{self.prefix}{i}", val(i, 16 * KB), replicas=self.replicas)
                self.acked.append(i)
                i += 1
            except Exception:  # noqa: BLE001 - counted; a put may fail while a node restarts
                self.put_errors += 1
                time.sleep(0.05)

    def _reader(self):
        rng = np.random.default_rng(0)
        while not self._stop.is_set():
            if not self.acked:
                time.sleep(0.01)
                continue
            idx = [self.acked[int(j)] for j in rng.integers(0, len(self.acked), 16)]
            try:
                got = self.s.batch_get([f"{self.prefix}{i}" for i in idx])
            except Exception as e:  # noqa: BLE001
                self.read_errors.append(repr(e))
                continue
            for i, v in zip(idx, got):
                if v is None:
                    self.misses.append(f"{self.prefix}{i}")
                elif v != val(i, 16 * KB):
                    self.wrong.append(f"{self.prefix}{i}")
            self.reads += 1

    def stop(self):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)

    def all_readable(self) -> list:
        """The acknowledged keys that do not read back their bytes."""
        got = self.s.batch_get([f"{self.prefix}{i}" for i in self.acked])
        return [i for i, v in zip(self.acked, got) if v != val(i, 16 * KB)]


def test_a_joined_node_gets_a_store_node_and_takes_puts(make_store, extra_node):
    s = make_store(elastic=ELASTIC, master=PLACEMENT)
    master = master_of(s)
    assert len(mounted(master)) == 2
    load = Load(s, "j")
    wait_for(lambda: len(load.acked) > 20, what="puts before the join")
    t0 = time.monotonic()
    node = extra_node()
    wait_for(lambda: node.node_id in mounted(master), timeout_s=60, what="the joined node's store node to mount")
    join_s = time.monotonic() - t0
    first = len(load.acked)
    wait_for(lambda: keys_on(master, [f"j{i}" for i in load.acked[first:]], node.node_id), timeout_s=30,
             what="a put placed on the joined node")
    load.stop()
    print(f"joined node mounted {join_s:.1f}s after it was added")
    assert event(master, "joined", node.node_id) is not None
    assert ray.get(master.stats.remote())["joins"] >= 1
    assert load.wrong == [] and load.read_errors == [] and load.misses == []
    assert load.all_readable() == []
    assert s.stats()["capacity"] == 3 * (64 << 20)


def test_a_drained_node_with_room_elsewhere_loses_nothing_and_reads_never_fail(make_store, ray_cluster, extra_node,
                                                                                 prometheus, tmp_path):
    node = extra_node()
    # Arenas of 4 MiB with a spill tier: about half of what each node holds is on its disk,
    # and the drain moves those values too (read from the leaving node's disk).
    s = make_store(elastic=ELASTIC, master=PLACEMENT, segment_size_bytes="4mb",
                   spill={"enabled": True, "directory": str(tmp_path / "spill"), "capacity_bytes": "256mb"})
    master = master_of(s)
    assert node.node_id in mounted(master)
    # The master lives on the head, never on a node that can drain (the one drained here).
    assert actor_node(master) == ray.get_runtime_context().get_node_id() != node.node_id
    keys = [f"d{i}" for i in range(300)]
    assert s.batch_put(keys, [val(i) for i in range(300)]) == [None] * 300
    on_node = keys_on(master, keys, node.node_id)
    assert len(on_node) > 50
    wait_for(lambda: len(disk_only(master, keys, node.node_id)) >= len(on_node) // 3, timeout_s=30,
             what="a third or more of the node's values on its disk only")
    on_disk = disk_only(master, keys, node.node_id)
    load = Load(s, "dl")
    stop, wrong, misses, errors, rounds = threading.Event(), [], [], [], [0]

    def reader():  # in batches of 16 values (1 MiB): what the 4 MiB arenas can promote at once
        while not stop.is_set():
            for j in range(0, len(keys), 16):
                try:
                    got = s.batch_get(keys[j:j + 16])
                except Exception as e:  # noqa: BLE001
                    errors.append(repr(e))
                    continue
                misses.extend(k for k, v in zip(keys[j:j + 16], got) if v is None)
                wrong.extend(k for i, (k, v) in enumerate(zip(keys[j:j + 16], got), j)
                             if v is not None and v != val(i))
            rounds[0] += 1

    t = threading.Thread(target=reader)
    t.start()
    wait_for(lambda: rounds[0] >= 2, what="reads before the drain")
    started = time.time()
    # As an operator does it (a spot node's preemption notice).
    subprocess.run([str(Path(sys.executable).parent / "ray"), "drain-node", "--address", ray_cluster.address,
                    "--node-id", node.node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION",
                    "--reason-message", "spot preemption", "--deadline-remaining-seconds", "30"],
                   check=True, capture_output=True, timeout=60)
    report = wait_for(lambda: event(master, "drained", node.node_id), timeout_s=40, what="the drain to finish")
    before = rounds[0]
    wait_for(lambda: rounds[0] >= before + 2, what="reads after the drain")
    stop.set()
    t.join()
    load.stop()
    print("drain:", report, f"in {report['time'] - started:.1f}s;", len(on_disk), "of", len(on_node),
          "values were on its disk only")
    assert report["lost_keys"] == 0 and report["lost_bytes"] == 0
    assert report["moved_keys"] >= len(on_node)
    assert node.node_id not in mounted(master)
    assert errors == [] and misses == [] and wrong == []
    assert load.wrong == [] and load.misses == [] and load.read_errors == []
    assert keys_on(master, keys, node.node_id) == []
    assert s.batch_get(keys) == [val(i) for i in range(300)]
    assert load.all_readable() == []
    status = format_status(deploy.store_stats(s.config.namespace))
    assert f"drained: {report['moved_keys']} keys" in status and "drains 1:" in status
    moved = "ray_mooncake_drain_moved_keys_total"
    try:
        wait_for(lambda: sum(float(r["value"][1]) for r in query(prometheus, moved)) >= report["moved_keys"],
                 timeout_s=120, interval_s=1, what="the drain's moved keys in Prometheus")
    except AssertionError:
        names = sorted({r["metric"]["__name__"] for r in query(prometheus, '{__name__=~"ray_mooncake_.+"}')})
        print("series:", query(prometheus, moved), "targets up:", query(prometheus, "up"),
              "mooncake series:", names,
              "nodes:", [(n["NodeID"][:12], n["Alive"], n["MetricsExportPort"]) for n in ray.nodes()])
        raise


def test_a_drain_deadline_too_short_loses_only_what_it_reports(make_store, extra_node):
    node = extra_node()
    # The deadline is 1 s away and a drain stops 1 s before it: the node moves nothing.
    s = make_store(elastic={**ELASTIC, "drain_margin_s": 1.0, "drain_batch_bytes": "1mb"}, master=PLACEMENT)
    master = master_of(s)
    keys = [f"s{i}" for i in range(400)]
    size = 128 * KB
    assert s.batch_put(keys, [val(i, size) for i in range(400)]) == [None] * 400
    on_node = keys_on(master, keys, node.node_id)
    assert len(on_node) > 50
    elastic.drain_ray_node(node.node_id, "DRAIN_NODE_REASON_PREEMPTION", deadline_s=1.0)
    report = wait_for(lambda: event(master, "drained", node.node_id), timeout_s=30, what="the drain to finish")
    print("short drain:", report)
    got = s.batch_get(keys)
    missing = [k for k, v in zip(keys, got) if v is None]
    assert [k for i, (k, v) in enumerate(zip(keys, got)) if v is not None and v != val(i, size)] == []
    assert len(missing) == report["lost_keys"] and report["lost_bytes"] == report["lost_keys"] * size
    assert set(missing) <= set(on_node)
    assert report["moved_keys"] + report["lost_keys"] == len(on_node) and report["lost_keys"] > 0


def sigkill_and_wait(s, master, node_id) -> float:
    """SIGKILL ``node_id``'s store node; returns when Ray restarted it and it mounted again
    (the time of the kill)."""
    old = mounted(master)[node_id]
    t0 = time.time()
    os.kill(ray.get(ray.get_actor(store_actor_name(node_id), namespace=s.config.namespace).pid.remote()), 9)
    wait_for(lambda: mounted(master).get(node_id) not in (None, old), timeout_s=60,
             what="the restarted store node to mount")
    return t0


def stored_on(s, master, prefix, n, size, victim):
    """Put ``n`` values of ``size`` bytes; returns the keys and those held on ``victim``."""
    keys = [f"{prefix}{i}" for i in range(n)]
    assert s.batch_put(keys, [val(i, size) for i in range(n)]) == [None] * n
    return keys, keys_on(master, keys, victim)


def _arena_file(master, node_id):
    return next(n for n in ray.get(master.nodes.remote()) if n["node_id"] == node_id)["arena_file"]


def test_a_sigkilled_store_node_readopts_its_arena_and_a_corrupt_value_is_a_miss(make_store, ray_cluster):
    s = make_store(elastic=ELASTIC, master=PLACEMENT)
    master, victim = master_of(s), ray_cluster.store_node_ids[0]
    keys, on_victim = stored_on(s, master, "r", 200, 32 * KB, victim)
    assert len(on_victim) > 20
    entries = {e[0]: e for e in ray.get(master.node_entries.remote(victim))}
    bad = on_victim[3]
    # A node takes a value's checksum when it records the value (from its commit ring, or
    # the master's message), which may come after the put was answered: bytes changed before
    # then would be checksummed as they are. Corrupt a value the node has recorded.
    node = ray.get_actor(store_actor_name(victim), namespace=s.config.namespace)
    wait_for(lambda: bad in {e[0] for e in ray.get(node.inventory_snapshot.remote()) if e[3] == "dram"},
             timeout_s=30, interval_s=0.2, what=f"the victim node to record {bad!r}")
    # The index compacted into a snapshot now (the values are read back from it, not from
    # the journal), then some of them removed (journaled after the snapshot).
    assert ray.get(node.debug_compact.remote()) > 0
    gone = [k for k in on_victim[5:8]]
    assert all(s.remove(k) for k in gone)
    path = _arena_file(master, victim)
    assert path.startswith("/dev/shm/")
    with open(path, "r+b") as f:  # flip bytes of one value inside the arena
        f.seek(entries[bad][4] + 100)
        f.write(bytes(b ^ 0xFF for b in f.read(16)))
    t0 = sigkill_and_wait(s, master, victim)
    readopted = wait_for(lambda: event(master, "readopted", victim, after=t0), timeout_s=30,
                         what="the re-adoption event")
    print("re-adopted:", readopted)
    kept = len(on_victim) - 1 - len(gone)
    assert readopted["dropped"] == 1 and readopted["keys"] == kept
    got = s.batch_get(keys)
    assert [k for i, (k, v) in enumerate(zip(keys, got)) if k not in gone + [bad] and v != val(i, 32 * KB)] == []
    assert [got[keys.index(k)] for k in gone + [bad]] == [None] * (len(gone) + 1)
    assert len(keys_on(master, keys, victim)) == kept
    stats = ray.get(master.stats.remote())
    assert stats["readoptions"] >= 1 and stats["readopted_keys"] >= kept
    assert f"re-adopted its arena: {kept} keys kept, 1 dropped (bad checksum)" in format_status(
        deploy.store_stats(s.config.namespace))
    # Killed again: the index files it left (the re-adoption journaled, not rewritten) still
    # give back every value but the corrupt one, which is not even looked at again.
    sigkill_and_wait(s, master, victim)

    def readoptions():
        got = [e for e in ray.get(master.events.remote()) if e["event"] == "readopted" and e.get("node_id") == victim]
        return got if len(got) >= 2 else None

    again = wait_for(readoptions, timeout_s=30, what="the second re-adoption event")[-1]
    assert (again["keys"], again["dropped"]) == (kept, 0)
    got = s.batch_get(keys)
    assert [k for i, (k, v) in enumerate(zip(keys, got)) if k not in gone + [bad] and v != val(i, 32 * KB)] == []
    assert [got[keys.index(k)] for k in gone + [bad]] == [None] * (len(gone) + 1)


def test_a_pin_set_before_its_node_heard_of_the_put_survives_the_nodes_restart(make_store, ray_cluster):
    """Values committed through their node's commit ring and pinned before the master's
    message about them reached the node (one message then says both): the node journaled
    them from the ring unpinned, and must journal the pin too; after a SIGKILL the restarted
    node gives them back pinned."""
    s = make_store(elastic=ELASTIC, master={"allocation_strategy": "free_ratio_first"})
    master = master_of(s)
    s.put("first", val(0, 8 * KB))
    victim = s._slabs.current.node_id  # this client's small puts go into its slab there
    node = ray.get_actor(store_actor_name(victim), namespace=s.config.namespace)
    ray.get(node.debug_stall_inventory.remote(3.0))
    s.put("warm", val(1, 8 * KB))  # answered through the ring; the master's message waits at the node
    keys = [f"pin{i}" for i in range(8)]
    assert s.batch_put(keys, [val(10 + i, 8 * KB) for i in range(8)]) == [None] * 8
    for k in keys:
        s.pin(k, hard=True)

    def pinned_at_node():
        return {e[0] for e in ray.get(node.inventory_snapshot.remote()) if e[0] in keys and e[6]}

    wait_for(lambda: pinned_at_node() == set(keys), timeout_s=30, what="the node to hear of the pins")
    assert keys_on(master, keys, victim) == keys
    sigkill_and_wait(s, master, victim)
    entries = {e[0]: e for e in ray.get(master.node_entries.remote(victim))}
    assert [k for k in keys if not entries[k][6]] == []
    assert s.batch_get(keys) == [val(10 + i, 8 * KB) for i in range(8)]


def test_a_removed_value_does_not_come_back_with_its_restarted_node(make_store, ray_cluster):
    s = make_store(elastic=ELASTIC, master=PLACEMENT)
    master, victim = master_of(s), ray_cluster.store_node_ids[1]
    keys, on_victim = stored_on(s, master, "x", 60, 8 * KB, victim)
    gone = on_victim[:5]
    for k in gone:
        assert s.remove(k)
    sigkill_and_wait(s, master, victim)
    got = dict(zip(keys, s.batch_get(keys)))
    assert [k for k in gone if got[k] is not None] == []
    assert [k for k in on_victim[5:] if got[k] != val(keys.index(k), 8 * KB)] == []


def copies_short(master) -> int:
    return ray.get(master.stats.remote())["under_replicated_keys"]


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_rolling_restart_of_every_store_node_under_load_loses_nothing(make_store, ray_cluster, extra_node,
                                                                         replicas):
    """Every acknowledged value reads back after each node in turn is SIGKILLed and
    restarted. With one replica a restarting node's values miss until it has re-adopted
    them (about 2 s here). With two, no read misses: a put that lands while a node is
    down, or not yet known dead, may be acknowledged with one copy, and the master copies
    it to another node (repairs) before the next node goes; the test waits for no value to
    be short of copies before each kill."""
    extra_node()
    s = make_store(elastic=ELASTIC, master={**PLACEMENT, "repair_delay_s": 1.0})
    master = master_of(s)
    nodes = sorted(mounted(master))
    assert len(nodes) == 3
    load = Load(s, "rr", replicas=replicas)
    wait_for(lambda: len(load.acked) > 50, what="puts before the restarts")
    windows = []
    for node_id in nodes:
        if replicas == 2:
            wait_for(lambda: copies_short(master) == 0, timeout_s=30, what="every value back to two copies")
        misses = len(load.misses)
        t0 = sigkill_and_wait(s, master, node_id)
        wait_for(lambda: event(master, "readopted", node_id, after=t0), timeout_s=30, what="re-adoption")
        windows.append((node_id[:8], round(time.time() - t0, 2), len(load.misses) - misses))
    load.stop()
    st = ray.get(master.stats.remote())
    print("restarts (node, seconds until mounted again, reads that missed meanwhile):", windows,
          "acked puts:", len(load.acked), "put errors:", load.put_errors, "reads:", load.reads,
          "repairs:", st["repairs"])
    assert load.wrong == [] and load.read_errors == []
    assert load.all_readable() == [], "acknowledged keys lost across the rolling restart"
    if replicas == 2:
        assert load.misses == [], f"{len(load.misses)} reads missed although two copies were asked for"


def test_a_node_lost_for_good_leaves_every_value_with_two_copies_again(make_store, ray_cluster, extra_node):
    """A store node SIGKILLed and back empty (no kept arena) while ``replicas=2`` puts and
    gets run: every value it held is copied again from its other copy, no read misses,
    no byte is wrong, and ``mooncake-ray status`` shows the repairs."""
    extra_node()
    s = make_store(elastic={**ELASTIC, "keep_arena": False}, master={**PLACEMENT, "repair_delay_s": 0.5})
    master = master_of(s)
    nodes = sorted(mounted(master))
    keys = [f"two{i}" for i in range(300)]
    assert s.batch_put(keys, [val(i, 32 * KB) for i in range(300)], replicas=2) == [None] * 300
    load = Load(s, "lg", replicas=2)
    wait_for(lambda: len(load.acked) > 50, what="puts before the kill")
    victim = nodes[0]
    on_victim = keys_on(master, keys, victim)
    assert len(on_victim) > 50
    sigkill_and_wait(s, master, victim)
    wait_for(lambda: copies_short(master) == 0, timeout_s=60, what="every value back to two copies")
    load.stop()
    where = ray.get(master.where.remote(keys + [f"lg{i}" for i in load.acked]))
    counts = sorted({len({n for n, _t, ready in reps if ready}) for reps in where})
    assert counts == [2], f"copies per value: {counts}"
    st = ray.get(master.stats.remote())
    assert st["repairs"] >= len(on_victim) and st["repair_failures"] == 0
    assert load.wrong == [] and load.read_errors == [] and load.misses == []
    assert s.batch_get(keys) == [val(i, 32 * KB) for i in range(300)]
    assert f"repairs {st['repairs']}" in format_status(s.stats())


def test_a_master_killed_with_a_node_still_repairs_what_the_node_held(make_store, ray_cluster, extra_node):
    """The master and a store node SIGKILLed together (the node back empty): the new master
    never saw the loss, but each surviving node's entry of a value says how many copies its
    put asked for, so the values short of them are found and copied again."""
    extra_node()
    s = make_store(elastic={**ELASTIC, "keep_arena": False}, master={**PLACEMENT, "repair_delay_s": 0.5})
    master = master_of(s)
    keys = [f"mk{i}" for i in range(120)]
    assert s.batch_put(keys, [val(i, 16 * KB) for i in range(120)], replicas=2) == [None] * 120
    assert s.batch_put(["one"], [b"x" * KB], replicas=1) == [None]
    victim = sorted(mounted(master))[0]
    on_victim = keys_on(master, keys, victim)
    assert len(on_victim) > 20
    ns = s.config.namespace
    inc, master_pid = ray.get(master.ping.remote()), ray.get(master.pid.remote())
    node_pid = ray.get(ray.get_actor(store_actor_name(victim), namespace=ns).pid.remote())
    os.kill(node_pid, 9)
    os.kill(master_pid, 9)
    wait_for(lambda: ray.get(master.ping.remote()) != inc, timeout_s=60, what="the master to restart")
    wait_for(lambda: victim in mounted(master), timeout_s=60, what="the restarted store node to mount")
    wait_for(lambda: copies_short(master) == 0 and ray.get(master.stats.remote())["repairs"] >= len(on_victim),
             timeout_s=60, what="the values the node held back to two copies")
    where = ray.get(master.where.remote(keys))
    assert sorted({len({n for n, _t, ready in reps if ready}) for reps in where}) == [2]
    assert s.batch_get(keys) == [val(i, 16 * KB) for i in range(120)]


def test_stopping_the_store_removes_its_arena_files(ray_cluster):
    import mooncake_ray
    from tests.conftest import store_config

    cfg = store_config(elastic=ELASTIC)
    s = mooncake_ray.start(cfg)
    master = master_of(s)
    files = [n["arena_file"] for n in ray.get(master.nodes.remote())]
    assert len(files) == 2 and all(os.path.exists(f) and f.startswith("/dev/shm/") for f in files)
    s.close()
    deploy.teardown(cfg["namespace"])
    assert [f for f in files if os.path.exists(f)] == []
