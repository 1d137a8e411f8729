"""What durable acknowledgements cost, and a put right after a store node dies.

Cost (``--repeats`` rounds, alternating): the same store with ``master.durable_acks`` on
(a put is answered once its store nodes have recorded it) and off (answered at once).
Measured per round: single 4 KiB puts (the one-call slab path, answered by the native
index), batches of 64 x 4 KiB, and single 4 KiB puts with ``replicas=2`` (two calls:
PUT_START, PUT_END); latency p50/p99 and keys/s.

Node loss (``--kills`` times, a fresh store each time): 1 head and 2 store nodes, 200
values put with ``replicas=2``, the master SIGKILLed and waited for, then one store node
SIGKILLed; reported: how long the next ``put`` (``replicas=1``) took, and whether every
acknowledged value reads back.

    make bench B=benchmarks/bench_durable.py ARGS="--repeats 3 --kills 5"

Writes benchmarks/results/bench_durable.json and bench_durable.png. Every Ray process runs
inside the make target's private network namespace.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

from _common import host_info, host_label, spread, store_cluster

RESULTS = Path(__file__).resolve().parent / "results"
KB = 1024


def _store(**master):
    import mooncake_ray

    ns = f"dur{uuid.uuid4().hex[:8]}"
    return mooncake_ray.start({"namespace": ns, "segment_size_bytes": "256mb",
                               "transport": {"devices": ["lo"]}, "master": master}), ns


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def cost_round(durable: bool, n: int, rnd: int) -> dict:
    from mooncake_ray._private import deploy

    store, ns = _store(durable_acks=durable)
    value = os.urandom(4 * KB)
    out = {"durable": durable, "round": rnd}
    for name, replicas, batch in (("single", 1, 1), ("batch64", 1, 64), ("replicas2", 2, 1)):
        for w in range(20):  # warm: slabs granted, connections made
            store.batch_put([f"w{name}{w}"], [value], replicas=replicas)
        lat = []
        t_all = time.perf_counter()
        for i in range(n // batch):
            keys = [f"{name}/{i}/{j}" for j in range(batch)]
            t = time.perf_counter()
            res = store.batch_put(keys, [value] * batch, replicas=replicas)
            lat.append(time.perf_counter() - t)
            assert res == [None] * batch, res
        secs = time.perf_counter() - t_all
        out[name] = {"p50_us": 1e6 * _pct(lat, 0.5), "p99_us": 1e6 * _pct(lat, 0.99),
                     "keys_per_s": (n // batch) * batch / secs}
    store.close()
    deploy.teardown(ns)
    return out


def kill_run(k: int) -> dict:
    import ray
    from mooncake_ray._private import deploy
    from mooncake_ray._private.naming import MASTER_NAME, store_actor_name

    store, ns = _store()
    master = ray.get_actor(MASTER_NAME, namespace=ns)
    keys = [f"pre{i}" for i in range(200)]
    vals = [os.urandom(8 * KB) for _ in keys]
    assert store.batch_put(keys, vals, replicas=2) == [None] * 200
    inc, pid = ray.get(master.ping.remote()), ray.get(master.pid.remote())
    os.kill(pid, 9)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if ray.get(master.ping.remote(), timeout=5) != inc:
                break
        except Exception:  # noqa: BLE001 - restarting
            pass
        time.sleep(0.05)
    assert store.get(keys[0]) == vals[0]  # the new master has rebuilt its index
    victim = sorted(n["node_id"] for n in ray.get(master.nodes.remote()))[k % 2]
    os.kill(ray.get(ray.get_actor(store_actor_name(victim), namespace=ns).pid.remote()), 9)
    killed = time.monotonic()
    t = time.perf_counter()
    store.put("after-kill", b"x" * 4096, replicas=1)
    took = time.perf_counter() - t
    more = [f"post{i}" for i in range(20)]
    assert store.batch_put(more, [b"y" * 4096] * 20) == [None] * 20
    readable = store.get("after-kill") == b"x" * 4096 and store.batch_get(more) == [b"y" * 4096] * 20
    pre_ok = sum(v == w for v, w in zip(store.batch_get(keys), vals))
    row = {"kill": k, "next_put_s": took, "since_kill_s": time.monotonic() - killed,
           "acked_readable": readable, "replicated_readable": pre_ok}
    store.close()
    deploy.teardown(ns)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--puts", type=int, default=2000, help="keys per measurement")
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS / "bench_durable.json"))
    args = ap.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = {"host": host_info(), "config": vars(args), "cost": [], "kill": []}
    cluster = store_cluster(2)
    for rnd in range(args.repeats):
        for durable in ((True, False) if rnd % 2 == 0 else (False, True)):
            row = cost_round(durable, args.puts, rnd)
            results["cost"].append(row)
            print(json.dumps(row), flush=True)
    for k in range(args.kills):
        row = kill_run(k)
        results["kill"].append(row)
        print(json.dumps(row), flush=True)
    ray.shutdown()
    cluster.shutdown()

    summary = {}
    for name in ("single", "batch64", "replicas2"):
        on = [r[name] for r in results["cost"] if r["durable"]]
        off = [r[name] for r in results["cost"] if not r["durable"]]
        summary[name] = {
            "p50_us_on": spread([r["p50_us"] for r in on]), "p50_us_off": spread([r["p50_us"] for r in off]),
            "p99_us_on": spread([r["p99_us"] for r in on]), "p99_us_off": spread([r["p99_us"] for r in off]),
            "keys_per_s_on_over_off": spread([a["keys_per_s"] / b["keys_per_s"] for a, b in zip(on, off)]),
        }
    summary["next_put_after_node_kill_s"] = spread([r["next_put_s"] for r in results["kill"]])
    summary["kills_all_readable"] = sum(r["acked_readable"] and r["replicated_readable"] == 200
                                        for r in results["kill"])
    results["summary"] = summary
    out.write_text(json.dumps(results, indent=2))
    plot(results, out.with_suffix(".png"))
    print("host:", host_label(results["host"], model=True))
    print(json.dumps(summary, indent=2))
    print(f"wrote {out}")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = ("single", "batch64", "replicas2")
    for j, durable in enumerate((True, False)):
        rows = [r for r in results["cost"] if r["durable"] == durable]
        med = [statistics.median(r[n]["p50_us"] for r in rows) for n in names]
        a.bar([i + 0.4 * j for i in range(3)], med, width=0.4, label="durable_acks " + ("on" if durable else "off"))
        for i, v in enumerate(med):
            a.text(i + 0.4 * j, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
    a.set_xticks([i + 0.2 for i in range(3)], ["4 KiB put\n(slab, native)", "64 x 4 KiB\nbatch", "4 KiB put\nreplicas=2"])
    a.set_ylabel("p50 latency per call (µs)")
    a.set_title(f"put latency, median of rounds\n{host_label(results.get('host'))}", fontsize=9)
    a.legend(fontsize=8)
    ms = [1000 * r["next_put_s"] for r in results["kill"]]
    b.bar(range(len(ms)), ms)
    for i, v in enumerate(ms):
        b.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
    b.axhline(500, color="red", linestyle="--", label="target 0.5 s")
    b.set_xlabel("run")
    b.set_ylabel("ms")
    b.set_title("next put after a store node's SIGKILL\n(after a master restart; replicas=1)", fontsize=9)
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--plot":
        plot(json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[2]).with_suffix(".png"))
    else:
        main()
