"""The store following the cluster's size: how fast a drain moves a leaving node's values,
against the transport's bulk put rate in the same run, and how soon a restarted store
node serves its values again, warm (it re-adopts its arena) against cold (an empty arena,
refilled by a client).

A Ray cluster of a head (no store) and two store nodes, on this machine. Per run
(``--runs``) and value size (``--value-bytes``, a list):

- bulk put: the driver's client puts ``--fill`` bytes of values with ``batch_put_from``
  from a registered buffer into the store (the transport's put path: here a memcpy into
  the node's mapped arena), timed: GB/s. Measured on the store with the arena kept in
  shared memory (its node journals each value with its CRC32C before the put is
  acknowledged) and on one without (``elastic.keep_arena=false``).
- drain: a third store node joins; ``--fill`` more bytes are put, about a third landing on
  it; Ray drains it (``DRAIN_NODE_REASON_PREEMPTION``, deadline 300 s); the store node's
  own report gives the bytes and keys it moved and the seconds it took: GB/s, keys/s.
- restart, warm: one store node holding its share of the values is SIGKILLed; Ray
  restarts it and it re-adopts its arena. Timed from the kill until every value it held
  reads back, and from the new process's start (the store node's ``started_at``).
- restart, cold: the same on a store with ``elastic.keep_arena=false``: the restarted node
  is empty; timed from the kill until it is mounted again plus the client's put of its
  values again (the refill), and from the new process's start likewise.

The kept arena's measurements run twice: with ``elastic.arena_dir`` on /dev/shm (4 KiB
pages) and, when run as root, on a tmpfs mounted ``huge=always`` in the make target's
private mount namespace (2 MiB pages: a peer's first write into a page, and the mapping's
pre-fault, cost 512 times fewer page faults).

    make bench B=benchmarks/bench_elastic.py ARGS="--runs 3"

Writes benchmarks/results/bench_elastic.json and bench_elastic.png. Every Ray process runs
inside the make target's private network namespace.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import numpy as np

from _common import host_info, host_label, parse_size, spread, store_cluster, wait_for as _wait

RESULTS = Path(__file__).resolve().parent / "results"


def _store(segment: int, keep_arena: bool, arena_dir: str = "/dev/shm"):
    import mooncake_ray

    ns = f"el{uuid.uuid4().hex[:8]}"
    return mooncake_ray.start({
        "namespace": ns, "segment_size_bytes": segment, "transport": {"devices": ["lo"]},
        "master": {"allocation_strategy": "free_ratio_first", "put_slab_bytes": 0},
        "elastic": {"poll_s": 0.5, "keep_arena": keep_arena, "arena_dir": arena_dir}}), ns


def huge_tmpfs(size: int) -> str | None:
    """A tmpfs mounted with huge=always (2 MiB pages) in this process's mount namespace
    (the make target's private one), for ``elastic.arena_dir``; None when not root."""
    if os.geteuid() != 0:
        return None
    path = f"/tmp/mooncake-ray-huge-{os.getpid()}"
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"huge=always,size={size}", "tmpfs", path], check=True)
    return path


def _handles(ns):
    import ray

    from mooncake_ray._private.naming import MASTER_NAME, store_actor_name

    return ray.get_actor(MASTER_NAME, namespace=ns), lambda node_id: ray.get_actor(store_actor_name(node_id),
                                                                                     namespace=ns)


def _fill(s, prefix: str, total: int, size: int, buf: np.ndarray) -> tuple[list[str], float]:
    """Put ``total`` bytes of ``size``-byte values from ``buf``; returns keys and GB/s
    (after one batch not timed: the client's first connection and mapping of each node)."""
    n = max(1, total // size)
    per = max(1, min(64, (64 << 20) // size))
    s.batch_put_from([f"{prefix}-warmup{i}" for i in range(per)], [buf[i * size:(i + 1) * size] for i in range(per)])
    keys = [f"{prefix}{i}" for i in range(n)]
    views = [buf[(i % per) * size:(i % per + 1) * size] for i in range(n)]
    t0 = time.perf_counter()
    for i in range(0, n, per):
        errs = s.batch_put_from(keys[i:i + per], views[i:i + per])
        bad = [e for e in errs if e is not None]
        if bad:
            raise RuntimeError(f"put failed: {bad[0]!r}")
    return keys, n * size / (time.perf_counter() - t0) / 1e9


def _keys_on(master, keys, node_id):
    import ray

    where = ray.get(master.where.remote(keys))
    return [k for k, reps in zip(keys, where) if any(r[0] == node_id for r in reps)]


def drain_run(cluster, size: int, fill: int, segment: int, buf, arena_dir: str) -> dict:
    import ray

    from mooncake_ray._private import deploy, elastic

    s, ns = _store(segment, keep_arena=True, arena_dir=arena_dir)
    s.register_buffer(buf)
    master, store_actor = _handles(ns)
    try:
        _, put_gbs = _fill(s, "bulk", fill, size, buf)  # the bulk put rate, measured in this run
        node = cluster.add_node(num_cpus=1, resources={"mooncake_store": 1})
        cluster.wait_for_nodes()
        _wait(lambda: node.node_id in {n["node_id"] for n in ray.get(master.nodes.remote())}, what="the join")
        keys, _ = _fill(s, "d", fill * 3 // 2, size, buf)
        on_node = _keys_on(master, keys, node.node_id)
        elastic.drain_ray_node(node.node_id, "DRAIN_NODE_REASON_PREEMPTION", deadline_s=300)
        report = _wait(lambda: ray.get(store_actor(node.node_id).stats.remote())["drain"], timeout_s=320,
                       interval_s=0.1, what="the drain")
        missing = sum(v is None for v in s.batch_get(on_node[:200]))
        cluster.remove_node(node, allow_graceful=False)
        return {"value_bytes": size, "arena_dir": arena_dir, "bulk_put_gbs": put_gbs, "keys_on_node": len(on_node),
                "moved_keys": report["moved_keys"], "moved_bytes": report["moved_bytes"],
                "lost_keys": report["lost_keys"], "seconds": report["seconds"],
                "drain_gbs": report["moved_bytes"] / report["seconds"] / 1e9,
                "drain_keys_per_s": report["moved_keys"] / report["seconds"],
                "ratio_to_bulk_put": report["moved_bytes"] / report["seconds"] / 1e9 / put_gbs,
                "missing_after_of_200": missing,
                "spent": {k: report.get(k) for k in ("connect_s", "plan_s", "copy_s", "done_s")}}
    finally:
        s.close()
        deploy.teardown(ns)


def restart_run(cluster, size: int, fill: int, segment: int, buf, warm: bool, arena_dir: str = "/dev/shm") -> dict:
    import ray

    from mooncake_ray._private import deploy

    s, ns = _store(segment, keep_arena=warm, arena_dir=arena_dir)
    s.register_buffer(buf)
    master, store_actor = _handles(ns)
    try:
        keys, put_gbs = _fill(s, "r", fill, size, buf)
        victim = cluster.list_all_nodes()[1].node_id
        mine = _keys_on(master, keys, victim)
        old = {n["node_id"]: n["incarnation"] for n in ray.get(master.nodes.remote())}[victim]
        pid = ray.get(store_actor(victim).pid.remote())
        t_kill = time.time()
        os.kill(pid, 9)
        _wait(lambda: {n["node_id"]: n["incarnation"] for n in ray.get(master.nodes.remote())}.get(victim)
              not in (None, old), what="the restart")
        t_mounted = time.time()
        st = ray.get(store_actor(victim).stats.remote())
        started = st["started_at"]
        if warm:
            _wait(lambda: all(v is not None for v in s.batch_get(mine)), what="its values to read back")
            t_serving = time.time()
            refill = 0.0
        else:
            t0 = time.time()
            views = [buf[(i % 64) * size:(i % 64 + 1) * size] for i in range(len(mine))]
            for i in range(0, len(mine), 64):
                errs = s.batch_put_from(mine[i:i + 64], views[i:i + 64])
                if any(e is not None and type(e).__name__ != "ObjectExistsError" for e in errs):
                    raise RuntimeError(f"refill failed: {errs}")
            t_serving = time.time()
            refill = t_serving - t0
        got = s.batch_get(mine)
        assert all(v is not None and len(v) == size for v in got), "values missing after the restart"
        return {"value_bytes": size, "warm": warm, "arena_dir": arena_dir if warm else None, "keys": len(mine), "bytes": len(mine) * size,
                "from_kill_s": t_serving - t_kill, "from_process_start_s": t_serving - started,
                "respawn_s": started - t_kill, "mounted_from_kill_s": t_mounted - t_kill, "refill_s": refill,
                "readopted": st.get("readopted"), "startup": st.get("startup"), "bulk_put_gbs": put_gbs}
    finally:
        s.close()
        deploy.teardown(ns)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    sizes = list(results["summary"])
    labels = list(results["summary"][sizes[0]]["pages"])
    x = np.arange(len(sizes))
    w = 0.8 / (1 + len(labels))
    put = [results["summary"][sz]["pages"][labels[0]]["bulk_put_gbs"]["median"] for sz in sizes]
    a1.bar(x - 0.4 + w / 2, put, w, label="bulk put (client, same run)")
    for i, lab in enumerate(labels):
        a1.bar(x - 0.4 + w * (i + 1.5), [results["summary"][sz]["pages"][lab]["drain_gbs"]["median"] for sz in sizes],
               w, label=f"drain, arena on {lab}")
    a1.set_xticks(x, [f"{int(sz) >> 10} KiB values" for sz in sizes])
    a1.set_ylabel("GB/s (median)")
    a1.set_title("Drain rate against the bulk put rate")
    a1.legend(fontsize=8)
    cold = [results["summary"][sz]["cold_from_start_s"]["median"] for sz in sizes]
    a2.bar(x - 0.4 + w / 2, cold, w, label="cold: empty arena, refilled")
    for i, lab in enumerate(labels):
        a2.bar(x - 0.4 + w * (i + 1.5),
               [results["summary"][sz]["pages"][lab]["warm_from_start_s"]["median"] for sz in sizes], w,
               label=f"warm: re-adopted, arena on {lab}")
    a2.set_xticks(x, [f"{int(sz) >> 10} KiB values" for sz in sizes])
    a2.set_ylabel("s from the new process's start to serving")
    a2.set_title("Restarted store node serving its values again")
    a2.legend(fontsize=8)
    fig.suptitle(f"mooncake-ray elastic store ({host_label(results['host'])})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--value-bytes", default="64k,1m")
    ap.add_argument("--fill", default="256m", help="bytes put per store for each measurement")
    ap.add_argument("--segment", default="640m", help="arena of each store node")
    args = ap.parse_args()
    import mooncake_ray  # noqa: F401 - the whole package first (parse_size alone loads a stub of it)

    sizes = [parse_size(v) for v in args.value_bytes.split(",")]
    fill, segment = parse_size(args.fill), parse_size(args.segment)
    buf = np.random.default_rng(0).integers(0, 256, 64 * max(sizes), dtype=np.uint8)
    huge = huge_tmpfs(4 * segment + (256 << 20))
    dirs = {"4 KiB pages (/dev/shm)": "/dev/shm"}
    if huge:
        dirs["2 MiB pages (tmpfs huge=always)"] = huge
    cluster = store_cluster(2)
    results = {"host": host_info(), "args": vars(args), "arena_dirs": dirs, "drain": [], "restart": []}
    try:
        for _run in range(args.runs):
            for size in sizes:
                r = restart_run(cluster, size, fill, segment, buf, warm=False)
                print(json.dumps(r), flush=True)
                results["restart"].append(r)
                for label, d in dirs.items():
                    r = restart_run(cluster, size, fill, segment, buf, warm=True, arena_dir=d)
                    print(json.dumps(r), flush=True)
                    results["restart"].append({**r, "pages": label})
                    r = drain_run(cluster, size, fill, segment, buf, d)
                    print(json.dumps(r), flush=True)
                    results["drain"].append({**r, "pages": label})
                    gc.collect()
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()
        if huge:
            subprocess.run(["umount", huge], check=False)
    summary = {}
    for size in sizes:
        c = [r for r in results["restart"] if r["value_bytes"] == size and not r["warm"]]
        per = {}
        for label in dirs:
            d = [r for r in results["drain"] if r["value_bytes"] == size and r["pages"] == label]
            w = [r for r in results["restart"] if r["value_bytes"] == size and r["warm"] and r["pages"] == label]
            per[label] = {
                "drain_gbs": spread([r["drain_gbs"] for r in d]),
                "drain_keys_per_s": spread([r["drain_keys_per_s"] for r in d]),
                "bulk_put_gbs": spread([r["bulk_put_gbs"] for r in d]),
                "drain_over_bulk_put": spread([r["ratio_to_bulk_put"] for r in d]),
                "warm_from_start_s": spread([r["from_process_start_s"] for r in w]),
                "warm_over_cold_from_start": spread([a["from_process_start_s"] / b["from_process_start_s"]
                                                     for a, b in zip(w, c)]),
                "warm_from_kill_s": spread([r["from_kill_s"] for r in w]),
                "warm_over_cold_from_kill": spread([a["from_kill_s"] / b["from_kill_s"] for a, b in zip(w, c)]),
                "put_gbs_kept_arena_over_plain": spread([a["bulk_put_gbs"] / b["bulk_put_gbs"]
                                                         for a, b in zip(w, c)]),
            }
        summary[str(size)] = {"cold_from_start_s": spread([r["from_process_start_s"] for r in c]),
                              "cold_from_kill_s": spread([r["from_kill_s"] for r in c]),
                              "cold_refill_s": spread([r["refill_s"] for r in c]), "pages": per}
    results["summary"] = summary
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "bench_elastic.json"
    out.write_text(json.dumps(results, indent=1))
    plot(results, RESULTS / "bench_elastic.png")
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
