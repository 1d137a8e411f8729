"""A drain of a store node that holds about 1 GB, half of it only on its disk, within a
30 s deadline: how many values it moves, how many it loses, and how long it takes.

A Ray cluster of a head (no store) and two store nodes on this machine; per run a third
node joins (the one drained, removed afterwards). Each store node has an arena of
``--segment`` and a spill tier (O_DIRECT files under ``--spill-dir``, on the root
filesystem). Per run:

- ``--fill`` bytes of ``--value-bytes`` values are put with ``batch_put_from`` from a
  registered buffer: each node takes about a third, and what its arena cannot hold under
  the eviction watermark is offloaded to its disk (the puts wait for room meanwhile);
- once no offload is in flight, the values on the node to drain are counted by where they
  are: DRAM (a readable arena copy) or disk only;
- Ray drains that node (``DRAIN_NODE_REASON_PREEMPTION``, ``--deadline`` seconds): the
  store node moves its DRAM values into the peers' arenas and reads its disk-only values
  through its spill tier into them, while the peers make room by offloading their own
  values to their disks. The node's report gives the keys and bytes moved and lost and
  the seconds taken;
- afterwards a sample of the node's values (``--sample``) reads back with its bytes.

    make bench B=benchmarks/bench_drain_disk.py ARGS="--runs 3"

Writes benchmarks/results/bench_drain_disk.json and bench_drain_disk.png. Every Ray
process runs inside the make target's private network namespace.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from _common import host_info, host_label, parse_size, put_from_buffer, spread, store_cluster, wait_for as _wait

RESULTS = Path(__file__).resolve().parent / "results"


def _offloading(master) -> int:
    import ray

    return sum(n["dram"]["offloading_bytes"] for n in ray.get(master.stats.remote())["nodes"].values())


def run_once(cluster, fill: int, size: int, segment: int, spill_dir: str, deadline: float, sample: int,
             buf) -> dict:
    import ray

    import mooncake_ray
    from mooncake_ray._private import deploy, elastic
    from mooncake_ray._private.naming import MASTER_NAME, store_actor_name

    ns = f"dd{uuid.uuid4().hex[:8]}"
    directory = tempfile.mkdtemp(prefix="spill-", dir=spill_dir)
    joined = cluster.add_node(num_cpus=1, resources={"mooncake_store": 1})
    cluster.wait_for_nodes()
    s = mooncake_ray.start({
        "namespace": ns, "segment_size_bytes": segment, "transport": {"devices": ["lo"]},
        "master": {"allocation_strategy": "free_ratio_first"},
        "spill": {"enabled": True, "directory": directory, "capacity_bytes": 2 * fill},
        "elastic": {"poll_s": 0.5}})
    master = ray.get_actor(MASTER_NAME, namespace=ns)
    try:
        s.register_buffer(buf)
        n = fill // size
        keys = [f"v{i}" for i in range(n)]
        views, fill_s = put_from_buffer(s, keys, size, buf)
        _wait(lambda: _offloading(master) == 0, timeout_s=120, interval_s=0.2, what="offloads to finish")
        victim = joined.node_id
        assert victim in {x["node_id"] for x in ray.get(master.nodes.remote())}
        where = ray.get(master.where.remote(keys))
        dram, disk = [], []
        for k, reps in zip(keys, where):
            mine = [(tier, ready) for nd, tier, ready in reps if nd == victim]
            if any(t == "dram" and r for t, r in mine):
                dram.append(k)
            elif any(t == "disk" and r for t, r in mine):
                disk.append(k)
        st0 = ray.get(master.stats.remote())
        t_drain = time.time()
        elastic.drain_ray_node(victim, "DRAIN_NODE_REASON_PREEMPTION", deadline_s=int(deadline))
        node = ray.get_actor(store_actor_name(victim), namespace=ns)
        report = _wait(lambda: ray.get(node.stats.remote())["drain"], timeout_s=deadline + 60, interval_s=0.2,
                       what="the drain")
        wall = time.time() - t_drain
        st1 = ray.get(master.stats.remote())
        pick = np.random.default_rng(1).choice(len(dram) + len(disk), min(sample, len(dram) + len(disk)),
                                               replace=False)
        on_node = dram + disk
        chosen = [on_node[i] for i in sorted(pick)]
        got = s.batch_get(chosen)
        missing = sum(v is None for v in got)
        wrong = sum(1 for k, v in zip(chosen, got) if v is not None and v != views[keys.index(k)].tobytes())
        return {
            "value_bytes": size, "fill_bytes": n * size, "fill_gbs": n * size / fill_s / 1e9,
            "node_keys": len(on_node), "node_bytes": len(on_node) * size,
            "node_dram_keys": len(dram), "node_disk_only_keys": len(disk),
            "disk_only_share": len(disk) / max(1, len(on_node)),
            "deadline_s": deadline, "drain_s": report["seconds"], "drain_wall_s": wall,
            "moved_keys": report["moved_keys"], "moved_bytes": report["moved_bytes"],
            "lost_keys": report["lost_keys"], "lost_bytes": report["lost_bytes"],
            "failed_moves": report["failed_moves"],
            "spent": {k: report.get(k) for k in ("connect_s", "plan_s", "copy_s", "disk_s", "done_s")},
            "peer_offloads": st1.get("offloads", 0) - st0.get("offloads", 0),
            "evictions": st1.get("evictions", 0) - st0.get("evictions", 0),
            "sample": len(chosen), "sample_missing": missing, "sample_wrong": wrong,
        }
    finally:
        s.close()
        deploy.teardown(ns)
        cluster.remove_node(joined, allow_graceful=False)
        shutil.rmtree(directory, ignore_errors=True)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    x = list(range(len(runs)))
    a.bar([i - 0.2 for i in x], [r["node_dram_keys"] * r["value_bytes"] / 1e9 for r in runs], 0.4, label="in DRAM")
    a.bar([i - 0.2 for i in x], [r["node_disk_only_keys"] * r["value_bytes"] / 1e9 for r in runs], 0.4,
          bottom=[r["node_dram_keys"] * r["value_bytes"] / 1e9 for r in runs], label="on disk only")
    a.bar([i + 0.2 for i in x], [r["moved_bytes"] / 1e9 for r in runs], 0.4, label="moved")
    a.bar([i + 0.2 for i in x], [r["lost_bytes"] / 1e9 for r in runs], 0.4,
          bottom=[r["moved_bytes"] / 1e9 for r in runs], label="lost", color="red")
    a.set_xticks(x, [f"run {i + 1}" for i in x])
    a.set_ylabel("GB")
    a.legend(fontsize=8)
    a.set_title("The drained node's values")
    b.bar(x, [r["drain_s"] for r in runs], 0.5, label="drain")
    b.axhline(runs[0]["deadline_s"], color="k", ls="--", lw=1, label="deadline")
    b.set_xticks(x, [f"run {i + 1}" for i in x])
    b.set_ylabel("seconds")
    b.legend(fontsize=8)
    b.set_title("Drain time")
    fig.suptitle(host_label(results["host"]), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--fill", default="3200m", help="bytes of values over the three nodes")
    ap.add_argument("--value-bytes", default="1m")
    ap.add_argument("--segment", default="512m", help="arena of each store node")
    ap.add_argument("--spill-dir", default=str(Path(__file__).resolve().parent.parent / "build"),
                    help="where the spill directories go (a disk, not a tmpfs: O_DIRECT)")
    ap.add_argument("--deadline", type=float, default=30.0)
    ap.add_argument("--sample", type=int, default=400)
    args = ap.parse_args()
    import mooncake_ray  # noqa: F401 - the whole package first (parse_size alone loads a stub of it)

    fill, size, segment = parse_size(args.fill), parse_size(args.value_bytes), parse_size(args.segment)
    Path(args.spill_dir).mkdir(parents=True, exist_ok=True)
    buf = np.random.default_rng(0).integers(0, 256, 64 * size, dtype=np.uint8)
    results = {"host": host_info(), "args": vars(args), "runs": []}
    cluster = store_cluster(2)
    try:
        for _ in range(args.runs):
            r = run_once(cluster, fill, size, segment, args.spill_dir, args.deadline, args.sample, buf)
            print(json.dumps(r), flush=True)
            results["runs"].append(r)
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()
    runs = results["runs"]
    results["summary"] = {
        "node_gb": spread([r["node_bytes"] / 1e9 for r in runs]),
        "disk_only_share": spread([r["disk_only_share"] for r in runs]),
        "drain_s": spread([r["drain_s"] for r in runs]),
        "lost_keys": sum(r["lost_keys"] for r in runs),
        "sample_missing_or_wrong": sum(r["sample_missing"] + r["sample_wrong"] for r in runs),
    }
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "bench_drain_disk.json"
    out.write_text(json.dumps(results, indent=1))
    plot(results, out.with_suffix(".png"))
    print(json.dumps(results["summary"], indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
