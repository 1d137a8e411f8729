"""Spill-tier faults: a corrupt file is a miss (never wrong bytes), a full spill
filesystem degrades to DRAM-only without losing what fit, and a restarted store node
finds its spilled keys again."""

from pathlib import Path

import numpy as np
import ray

from mooncake_ray._private.naming import MASTER_NAME, store_actor_name
from tests.conftest import wait_for
from tests.native.test_spill import small_ext4

MB = 1 << 20


def val(i, n=MB):
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def where(s, keys):
    master = ray.get_actor(MASTER_NAME, namespace=s.config.namespace)
    return dict(zip(keys, ray.get(master.where.remote(keys))))


def disk_only(s, keys):
    return [k for k, w in where(s, keys).items() if w and all(t == "disk" for _, t, _ in w)]


def spill_file_of(root: Path, key: str) -> Path:
    """The live spill file of ``key``: among slot files whose header names it (free slots
    may still hold an old header), the one with the highest sequence number."""
    best, best_seq = None, -1
    for f in root.rglob("*"):
        if not f.is_file() or f.name in ("LOCK", "TOMBSTONES"):
            continue
        head = f.read_bytes()[:8192]
        klen = int.from_bytes(head[12:16], "little")
        if head[:8] == b"MCRSPILL" and head[64:64 + klen] == key.encode():
            seq = int.from_bytes(head[32:40], "little")
            if seq > best_seq:
                best, best_seq = f, seq
    assert best is not None, f"no spill file holds {key}"
    return best


def test_corrupt_spill_file_is_a_miss_never_wrong_bytes(make_store, tmp_path):
    root = tmp_path / "spill"
    s = make_store(segment_size_bytes="16mb",
                   spill={"enabled": True, "directory": str(root), "capacity_bytes": "256mb"})
    keys = [f"c/{i}" for i in range(60)]
    for i, k in enumerate(keys):
        s.put(k, val(i))
    victims = wait_for(lambda: disk_only(s, keys)[:3] if len(disk_only(s, keys)) >= 3 else None,
                       what="objects only on disk")
    for k in victims:
        f = spill_file_of(root, k)
        data = bytearray(f.read_bytes())
        data[4096 + 1000] ^= 0xFF  # one flipped bit of payload
        f.write_bytes(bytes(data))
    got = s.batch_get(keys)
    for i, (k, g) in enumerate(zip(keys, got)):
        if k in victims:
            assert g is None, f"{k}: corrupt copy returned (equal to the original: {g == val(i)})"
        else:
            assert g == val(i), f"{k}: wrong bytes"
    assert not any(s.exists(k) for k in victims)  # removed, not retried forever


def test_spill_filesystem_full_degrades_without_losing_what_fit(make_store):
    with small_ext4(48) as mnt:
        s = make_store(segment_size_bytes="16mb",
                       spill={"enabled": True, "directory": mnt, "capacity_bytes": "1gb"})
        # 40 MiB: fits in 32 MiB of DRAM plus the disk
        first = [f"f/{i}" for i in range(40)]
        for i, k in enumerate(first):
            s.put(k, val(i))
        got = s.batch_get(first)
        assert [k for k, g in zip(first, got) if g is None] == []
        assert all(g == val(i) for i, g in enumerate(got))
        # keep putting far past what the disk holds: puts keep working (DRAM-only
        # eviction once the disk is full), never an error, never wrong bytes
        more = [f"m/{i}" for i in range(120)]
        for i, k in enumerate(more):
            s.put(k, val(1000 + i))
        st = s.stats()
        degraded = [n["disk"]["degraded"] for n in st["nodes"].values()]
        assert any(degraded), st["nodes"]
        assert s.get(more[-1]) == val(1119)  # the newest value is in DRAM
        got = s.batch_get(first + more)
        for k, g, i in zip(first + more, got, list(range(40)) + [1000 + j for j in range(120)]):
            assert g is None or g == val(i), k
        # what reached the disk before it filled up is still there
        assert sum(g is not None for g in got[:40]) >= 16
        from mooncake_ray.cli import format_status

        assert "DEGRADED" in format_status(st)


def test_restarted_store_node_finds_its_spilled_keys(make_store, ray_cluster, tmp_path):
    s = make_store(segment_size_bytes="16mb",
                   spill={"enabled": True, "directory": str(tmp_path / "spill"), "capacity_bytes": "256mb"})
    keys = [f"r/{i}" for i in range(60)]
    for i, k in enumerate(keys):
        s.put(k, val(i))
    victim = ray_cluster.store_node_ids[0]
    on_disk = wait_for(lambda: [k for k, w in where(s, keys).items()
                                if any(n == victim and t == "disk" for n, t, _ in w)] or None,
                       what="spilled keys on the victim")
    ns = s.config.namespace
    actor = ray.get_actor(store_actor_name(victim), namespace=ns)
    old = ray.get(actor.ping.remote())
    ray.kill(actor, no_restart=False)
    wait_for(lambda: ray.get(actor.ping.remote()) != old, timeout_s=60, what="the store node to restart")
    master = ray.get_actor(MASTER_NAME, namespace=ns)
    wait_for(lambda: {n["node_id"]: n["incarnation"] for n in ray.get(master.nodes.remote())}.get(victim)
             == ray.get(actor.ping.remote()), timeout_s=30, what="the restarted node to remount")
    got = s.batch_get(on_disk)
    idx = {k: i for i, k in enumerate(keys)}
    assert [k for k, g in zip(on_disk, got) if g is None] == []
    assert all(g == val(idx[k]) for k, g in zip(on_disk, got))


def test_lost_offload_reports_are_resent_and_the_dram_copies_go(make_store, ray_cluster, tmp_path):
    """An offload whose report to the master fails (the master unreachable or timed out for
    a moment) is reported again: the master learns of the disk copy, drops the DRAM copy it
    kept meanwhile and frees the disk reservation, instead of holding both for ever."""
    s = make_store(segment_size_bytes="16mb",
                   spill={"enabled": True, "directory": str(tmp_path / "spill"), "capacity_bytes": "256mb"})
    ns = s.config.namespace
    actors = [ray.get_actor(store_actor_name(n), namespace=ns) for n in ray_cluster.store_node_ids]
    ray.get([a.debug_fail_offload_reports.remote(3) for a in actors])
    keys = [f"o/{i}" for i in range(60)]
    for i, k in enumerate(keys):
        s.put(k, val(i))

    def settled():
        nodes = s.stats()["nodes"].values()
        inflight = sum(n["dram"]["offloading_bytes"] for n in nodes)
        return not inflight and len(disk_only(s, keys)) >= 10

    wait_for(settled, timeout_s=60, what="every offload reported and its DRAM copy dropped")
    # the injected failures happened on the node(s) that offloaded
    left = ray.get([a.debug_fail_offload_reports.remote(0) for a in actors])
    assert 0 in left, left
    got = s.batch_get(keys)
    assert [k for k, g in zip(keys, got) if g != val(keys.index(k))] == []
