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

    make bench B=benchmarks/bench_elastic.py ARGS="--runs 3"

Writes benchmarks/results/bench_elastic.json and bench_elastic.png. Every Ray process runs
inside the make target's private network namespace.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from pathlib import Path

import numpy as np

from _common import host_info, host_label, parse_size, spread

RESULTS = Path(__file__).resolve().parent / "results"


def _cluster():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1, resources={"mooncake_store": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    return cluster


def _store(segment: int, keep_arena: bool):
    import mooncake_ray

    ns = f"el{uuid.uuid4().hex[:8]}"
    return mooncake_ray.start({
        "namespace": ns, "segment_size_bytes": segment, "transport": {"devices": ["lo"]},
        "master": {"allocation_strategy": "free_ratio_first", "put_slab_bytes": 0},
        "elastic": {"poll_s": 0.5, "keep_arena": keep_arena}}), ns


def _handles(ns):
    import ray

    from mooncake_ray._private.naming import MASTER_NAME, store_actor_name

    return ray.get_actor(MASTER_NAME, namespace=ns), lambda node_id: ray.get_actor(store_actor_name(node_id),
                                                                                     namespace=ns)


def _wait(pred, timeout_s=120.0, interval_s=0.01, what="condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(interval_s)
    raise TimeoutError(f"timed out waiting for {what}")


def _fill(s, prefix: str, total: int, size: int, buf: np.ndarray) -> tuple[list[str], float]:
    """Put ``total`` bytes of ``size``-byte values from ``buf``; returns keys and GB/s."""
    n = max(1, total // size)
    per = max(1, min(64, (64 << 20) // size))
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


def drain_run(cluster, size: int, fill: int, segment: int, buf) -> dict:
    import ray

    from mooncake_ray._private import deploy, elastic

    s, ns = _store(segment, keep_arena=True)
    master, store_actor = _handles(ns)
    try:
        _, put_gbs = _fill(s, "warmup", fill, size, buf)  # the bulk put rate, measured in this run
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
        return {"value_bytes": size, "bulk_put_gbs": put_gbs, "keys_on_node": len(on_node),
                "moved_keys": report["moved_keys"], "moved_bytes": report["moved_bytes"],
                "lost_keys": report["lost_keys"], "seconds": report["seconds"],
                "drain_gbs": report["moved_bytes"] / report["seconds"] / 1e9,
                "drain_keys_per_s": report["moved_keys"] / report["seconds"],
                "ratio_to_bulk_put": report["moved_bytes"] / report["seconds"] / 1e9 / put_gbs,
                "missing_after_of_200": missing}
    finally:
        s.close()
        deploy.teardown(ns)


def restart_run(cluster, size: int, fill: int, segment: int, buf, warm: bool) -> dict:
    import ray

    from mooncake_ray._private import deploy

    s, ns = _store(segment, keep_arena=warm)
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
        return {"value_bytes": size, "warm": warm, "keys": len(mine), "bytes": len(mine) * size,
                "from_kill_s": t_serving - t_kill, "from_process_start_s": t_serving - started,
                "respawn_s": started - t_kill, "mounted_from_kill_s": t_mounted - t_kill, "refill_s": refill,
                "readopted": st.get("readopted"), "bulk_put_gbs": put_gbs}
    finally:
        s.close()
        deploy.teardown(ns)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    sizes = sorted({r["value_bytes"] for r in results["drain"]})
    x = np.arange(len(sizes))
    for off, key, label in ((-0.2, "bulk_put_gbs", "bulk put (client, same run)"), (0.2, "drain_gbs", "drain")):
        med = [spread([r[key] for r in results["drain"] if r["value_bytes"] == sz])["median"] for sz in sizes]
        a1.bar(x + off, med, 0.4, label=label)
    a1.set_xticks(x, [f"{sz >> 10} KiB" for sz in sizes])
    a1.set_ylabel("GB/s (median)")
    a1.set_title("Drain rate against the bulk put rate")
    a1.legend()
    for off, warm, label in ((-0.2, True, "warm (re-adopts its arena)"), (0.2, False, "cold (empty, refilled)")):
        med = [spread([r["from_process_start_s"] for r in results["restart"]
                       if r["value_bytes"] == sz and r["warm"] == warm])["median"] for sz in sizes]
        a2.bar(x + off, med, 0.4, label=label)
    a2.set_xticks(x, [f"{sz >> 10} KiB" for sz in sizes])
    a2.set_ylabel("seconds from the new process's start until its values read back")
    a2.set_title("Restarted store node serving again")
    a2.legend()
    fig.suptitle(f"mooncake-ray elastic store ({host_label(results['host'])})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--value-bytes", default="64k,1m")
    ap.add_argument("--fill", default="256m", help="bytes put per store for each measurement")
    ap.add_argument("--segment", default="768m", help="arena of each store node")
    args = ap.parse_args()
    sizes = [parse_size(v) for v in args.value_bytes.split(",")]
    fill, segment = parse_size(args.fill), parse_size(args.segment)
    buf = np.random.default_rng(0).integers(0, 256, 64 * max(sizes), dtype=np.uint8)
    cluster = _cluster()
    results = {"host": host_info(), "args": vars(args), "drain": [], "restart": []}
    try:
        for run in range(args.runs):
            for size in sizes:
                for warm in (True, False):
                    r = restart_run(cluster, size, fill, segment, buf, warm)
                    print(json.dumps(r), flush=True)
                    results["restart"].append(r)
                r = drain_run(cluster, size, fill, segment, buf)
                print(json.dumps(r), flush=True)
                results["drain"].append(r)
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()
    summary = {}
    for size in sizes:
        d = [r for r in results["drain"] if r["value_bytes"] == size]
        w = [r for r in results["restart"] if r["value_bytes"] == size and r["warm"]]
        c = [r for r in results["restart"] if r["value_bytes"] == size and not r["warm"]]
        summary[str(size)] = {
            "drain_gbs": spread([r["drain_gbs"] for r in d]),
            "drain_keys_per_s": spread([r["drain_keys_per_s"] for r in d]),
            "bulk_put_gbs": spread([r["bulk_put_gbs"] for r in d]),
            "drain_over_bulk_put": spread([r["ratio_to_bulk_put"] for r in d]),
            "warm_from_start_s": spread([r["from_process_start_s"] for r in w]),
            "cold_from_start_s": spread([r["from_process_start_s"] for r in c]),
            "warm_over_cold_from_start": spread([a["from_process_start_s"] / b["from_process_start_s"]
                                                 for a, b in zip(w, c)]),
            "warm_from_kill_s": spread([r["from_kill_s"] for r in w]),
            "cold_from_kill_s": spread([r["from_kill_s"] for r in c]),
            "warm_over_cold_from_kill": spread([a["from_kill_s"] / b["from_kill_s"] for a, b in zip(w, c)]),
            "put_gbs_kept_arena_over_plain": spread([a["bulk_put_gbs"] / b["bulk_put_gbs"] for a, b in zip(w, c)]),
        }
    results["summary"] = summary
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "bench_elastic.json"
    out.write_text(json.dumps(results, indent=1))
    plot(results, RESULTS / "bench_elastic.png")
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
