"""A busy store node is not a dead one: unmounts and lost keys under a put burst with
eviction, and how soon puts succeed again after a store node is SIGKILLed.

Burst (``--runs`` times, a fresh store each time): a client in the driver process puts
``--keys`` values of ``--value-bytes`` in batches of ``--batch`` into one store node
(``--segment`` arena, no spill) until eviction has turned the arena over; then the
master's counters (store nodes unmounted for silence, keys lost with them) and a
reconciliation of the node's inventory against the master's view of it.

``--busy N`` adds N CPU-bound processes at the niceness Ray gives its workers (15) for the
bursts: a host busy with other work, where a node is slow without being dead.

Kill (``--kills`` times): three store nodes, a writer putting one small value at a time
with ``replicas=2``; one store node's process gets SIGKILL; reported: the time from the
signal to the first put (issued after it) that succeeds, and the puts that failed. Ray
restarts the node; the next kill waits until it has remounted.

    make bench B=benchmarks/bench_liveness.py ARGS="--runs 10"

Writes benchmarks/results/bench_liveness.json and bench_liveness.png. Every Ray process
runs inside the make target's private network namespace.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from _common import host_info, host_label, spread, store_cluster

RESULTS = Path(__file__).resolve().parent / "results"


def _store(segment: str, protocol: str = "auto", **master):
    import mooncake_ray

    ns = f"live{uuid.uuid4().hex[:8]}"
    return mooncake_ray.start({"namespace": ns, "segment_size_bytes": segment,
                              "transport": {"devices": ["lo"], "protocol": protocol}, "master": master}), ns


def burst_run(args, run: int) -> dict:
    import ray
    from mooncake_ray._private import deploy
    from mooncake_ray._private.naming import MASTER_NAME, store_actor_name

    store, ns = _store(args.segment)
    master = ray.get_actor(MASTER_NAME, namespace=ns)
    value = os.urandom(args.value_bytes)
    n_batches = args.keys // args.batch
    rates, failed, first_error = [], 0, None
    t_start = time.perf_counter()
    for b in range(n_batches):
        keys = [f"b{run}/{b * args.batch + j}" for j in range(args.batch)]
        t = time.perf_counter()
        res = store.batch_put(keys, [value] * args.batch)
        rates.append(args.batch / (time.perf_counter() - t))
        errs = [r for r in res if r is not None]
        failed += len(errs)
        if errs and first_error is None:
            first_error = f"batch {b}: {errs[0]!r}"
    elapsed = time.perf_counter() - t_start
    stats = ray.get(master.stats.remote())
    flushed = ray.get(master.flush_inventory.remote(60.0))
    node_id = next(iter(stats["nodes"]), None)
    mismatch = None
    if node_id is not None:
        node = ray.get_actor(store_actor_name(node_id), namespace=ns)
        want = {tuple(e) for e in ray.get(master.node_entries.remote(node_id))}
        have = {tuple(e) for e in ray.get(node.inventory_snapshot.remote()) if e[3] == "dram"}
        mismatch = len(want ^ have)
    tenth = max(1, n_batches // 10)
    out = {
        "run": run, "seconds": elapsed, "put_keys_per_s": args.keys / elapsed,
        "first_tenth_keys_per_s": statistics.median(rates[:tenth]),
        "last_tenth_keys_per_s": statistics.median(rates[-tenth:]),
        "rate_by_tenth": [statistics.median(rates[i * tenth:(i + 1) * tenth]) for i in range(10)],
        # keys over the time the tenth took (eviction rounds included), not a median batch
        "overall_rate_by_tenth": [len(rates[i * tenth:(i + 1) * tenth]) * args.batch
                                  / sum(1 / r * args.batch for r in rates[i * tenth:(i + 1) * tenth])
                                  for i in range(10)],
        "failed_puts": failed, "first_error": first_error,
        "node_unmounts": stats["node_unmounts"], "unmount_lost_keys": stats["unmount_lost_keys"],
        "evictions": stats["evictions"], "keys_indexed": stats["keys"],
        "nodes_mounted_at_end": len(stats["nodes"]), "inventory_flushed": flushed,
        "inventory_mismatch": mismatch,
    }
    store.close()
    deploy.teardown(ns)
    return out


def kill_runs(args, protocol: str) -> list[dict]:
    import ray
    from mooncake_ray._private import deploy
    from mooncake_ray._private.naming import MASTER_NAME, store_actor_name

    store, ns = _store("64mb", protocol, replicas=2)
    master = ray.get_actor(MASTER_NAME, namespace=ns)
    results = []
    for k in range(args.kills):
        nodes = {n["node_id"]: n["incarnation"] for n in ray.get(master.nodes.remote())}
        victim = sorted(nodes)[k % len(nodes)]
        pid = ray.get(ray.get_actor(store_actor_name(victim), namespace=ns).pid.remote())
        log: list[tuple[float, float, bool]] = []  # (issued, finished, ok)
        stop = threading.Event()

        def writer():
            i = 0
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    ok = store.batch_put([f"kill{k}/{i}"], [b"v" * 1024], replicas=2) == [None]
                except Exception:  # noqa: BLE001 - a failed put is what is measured
                    ok = False
                log.append((t0, time.monotonic(), ok))
                i += 1

        th = threading.Thread(target=writer)
        th.start()
        time.sleep(1.0)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        deadline = killed_at + 30
        while time.monotonic() < deadline and not any(ok and t0 >= killed_at for t0, _t1, ok in log):
            time.sleep(0.01)
        time.sleep(0.5)
        stop.set()
        th.join()
        after = [(t0, t1, ok) for t0, t1, ok in log if t0 >= killed_at]
        first_ok = next((t1 for _t0, t1, ok in after if ok), None)
        straddling = [ok for t0, t1, ok in log if t0 < killed_at <= t1]
        row = {"kill": k, "protocol": protocol, "victim": victim[:12],
               "first_put_after_kill_s": None if first_ok is None else first_ok - killed_at,
               "failed_puts_after_kill": sum(not ok for _a, _b, ok in after),
               "puts_in_flight_at_kill_failed": straddling.count(False)}
        results.append(row)
        print(f"kill {k} ({protocol}): first successful put {row['first_put_after_kill_s']:.3f} s after SIGKILL, "
              f"{row['failed_puts_after_kill']} failed", flush=True)
        t_wait = time.monotonic() + 60  # Ray restarts the node: wait for it to remount
        while time.monotonic() < t_wait:
            now = {n["node_id"]: n["incarnation"] for n in ray.get(master.nodes.remote())}
            if victim in now and now[victim] != nodes[victim]:
                break
            time.sleep(0.2)
    store.close()
    deploy.teardown(ns)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--value-bytes", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--segment", default="2gb")
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--busy", type=int, default=0, help="CPU-bound processes (nice 15) during the bursts")
    ap.add_argument("--protocols", default="auto,tcp", help="transport protocols for the kill runs")
    ap.add_argument("--out", default=str(RESULTS / "bench_liveness.json"))
    args = ap.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    results = {"host": host_info(), "config": vars(args), "burst": [], "kill": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.runs:
        cluster = store_cluster(1)
        hogs = [subprocess.Popen(["nice", "-n", "15", sys.executable, "-c", "while True: pass"])
                for _ in range(args.busy)]
        for run in range(args.runs):
            row = burst_run(args, run)
            results["burst"].append(row)
            print(f"burst {run}: overall keys/s by tenth {[round(x) for x in row['overall_rate_by_tenth']]}")
            print(f"burst {run}: {row['seconds']:.0f} s, {row['put_keys_per_s']:.0f} keys/s "
                  f"(first tenth {row['first_tenth_keys_per_s']:.0f}, last {row['last_tenth_keys_per_s']:.0f}), "
                  f"failed {row['failed_puts']}, unmounts {row['node_unmounts']}, lost {row['unmount_lost_keys']}, "
                  f"inventory mismatch {row['inventory_mismatch']}", flush=True)
            out.write_text(json.dumps(results, indent=2))
        for h in hogs:
            h.kill()
            h.wait()
        ray.shutdown()
        cluster.shutdown()
    if args.kills:
        cluster = store_cluster(3)
        for protocol in args.protocols.split(","):
            results["kill"] += kill_runs(args, protocol)
        ray.shutdown()
        cluster.shutdown()
    b = results["burst"]
    results["summary"] = {
        "burst_runs": len(b),
        "node_unmounts_total": sum(r["node_unmounts"] for r in b),
        "unmount_lost_keys_total": sum(r["unmount_lost_keys"] for r in b),
        "failed_puts_total": sum(r["failed_puts"] for r in b),
        "inventory_mismatch_total": sum(r["inventory_mismatch"] or 0 for r in b),
        "last_over_first_tenth": spread([r["last_tenth_keys_per_s"] / r["first_tenth_keys_per_s"] for r in b]),
        "last_over_first_tenth_overall": spread([r["overall_rate_by_tenth"][-1] / r["overall_rate_by_tenth"][0]
                                                 for r in b]),
        "first_put_after_kill_s": {p: spread([r["first_put_after_kill_s"] for r in results["kill"]
                                              if r["protocol"] == p]) for p in args.protocols.split(",")},
    }
    out.write_text(json.dumps(results, indent=2))
    plot(results, out.with_suffix(".png"))
    print("host:", host_label(results["host"], model=True))
    print(json.dumps(results["summary"], indent=2))
    print(f"wrote {out}")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for i, r in enumerate(results["burst"]):
        color = f"C{i % 10}"
        a.plot(range(1, 11), [x / 1000 for x in r["rate_by_tenth"]], alpha=0.6, color=color,
               label=f"run {r['run']}: unmounts {r['node_unmounts']}, lost {r['unmount_lost_keys']}")
        if "overall_rate_by_tenth" in r:
            a.plot(range(1, 11), [x / 1000 for x in r["overall_rate_by_tenth"]], "--", alpha=0.6, color=color)
    a.set_xlabel("tenth of the burst")
    a.set_ylabel("put k keys/s")
    a.set_title("put burst, one store node (solid: median batch; dashed: whole tenth)\n"
                f"{host_label(results.get('host'))}", fontsize=9)
    if results["burst"]:
        a.legend(fontsize=6)
    kills = [r["first_put_after_kill_s"] for r in results["kill"]]
    ms = [1000 * k if k is not None else 30_000 for k in kills]  # none within 30 s: drawn at 30 s
    b.bar(range(len(kills)), ms, color=["C0" if r["protocol"] == "auto" else "C1" for r in results["kill"]])
    for i, v in enumerate(ms):
        b.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
    b.set_xticks(range(len(kills)), [f"{r['protocol']}\n{r['kill']}" for r in results["kill"]], fontsize=7)
    b.axhline(2000, color="red", linestyle="--", label="target 2 s")
    b.set_yscale("log")
    b.set_xlabel("kill (protocol, n)")
    b.set_ylabel("ms from SIGKILL to first successful put")
    b.set_title("store node SIGKILLed, replicas=2")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--plot":  # redraw from a results file
        plot(json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[2]).with_suffix(".png"))
    else:
        main()
