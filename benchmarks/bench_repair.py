"""Re-replication after a store node's loss: how soon every value it held has two copies
again, and what clients' puts and gets keep of their rate meanwhile.

A Ray cluster of a head (no store) and three store nodes, on this machine. Per run:

- a store (puts with ``replicas=2``, an arena of ``--segment`` per node, ``keep_arena``
  off so that a killed node comes back empty, as a replaced host would) is filled with
  ``--fill`` bytes of ``--value-bytes`` values, two copies each: each node holds about
  two thirds of ``--fill``;
- a load actor on the head (a client of its own) runs a closed loop of ``replicas=2``
  upserts (1024 keys in turn) and gets of 64 KiB values, timing each completed operation;
- after ``--before`` seconds one store node is SIGKILLed; Ray restarts it, empty;
- noticed: the first time the master counts values short of copies
  (``under_replicated_keys`` > 0); copying: from the first repair the master counts to
  repaired, the first time after that it counts none. The master's counters are polled
  every 100 ms, before the kill as after, so that both rates bear the polls' cost. The
  repair's bytes are ``repair_bytes`` of the master's counters;
- the load's rate while copies run, and between noticed and repaired (the killed node's
  restart included), over its rate in the ``--before`` seconds before the kill;
- afterwards every value of the fill reads back with its bytes, and every one has two
  ready copies.

``master.repair_delay_s`` is the store's default (10 s) unless ``--delay`` says otherwise:
repairs wait for it, or until the killed node has mounted again (here empty: nothing more
can come back), whichever is sooner. ``master.repair_bytes_per_s`` is the default unless
``--pace`` says otherwise (with ``--out`` naming the JSON, e.g. bench_repair_pace64m.json).
``--hold S`` makes no repair at all and measures the load for S seconds after the loss is
noticed: what the loss and the node's restart cost by themselves.

    make bench B=benchmarks/bench_repair.py ARGS="--runs 3"

Writes benchmarks/results/bench_repair.json and bench_repair.png. Every Ray process runs
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

from _common import host_info, host_label, parse_size, put_from_buffer, spread, store_cluster, wait_for as _wait

RESULTS = Path(__file__).resolve().parent / "results"
LOAD_BYTES = 64 << 10
POLL_S = 0.1  # the master's counters, before the kill as after (each poll costs it a Ray call)


def _load_actor():
    import ray

    @ray.remote(num_cpus=0, max_concurrency=2)
    class Load:
        """Puts (two copies) and gets of 64 KiB values in a closed loop until stopped."""

        def __init__(self, ns: str):
            import mooncake_ray

            self.s = mooncake_ray.connect(namespace=ns)
            self.stopped = False

        def stop(self) -> None:
            self.stopped = True

        def run(self, seconds: float) -> dict:
            import numpy as np

            val = np.random.default_rng(7).integers(0, 256, LOAD_BYTES, dtype=np.uint8).tobytes()
            end = time.time() + seconds
            puts, gets, errors, done = [], [], [], 0
            i = 0
            while time.time() < end and not self.stopped:
                key = f"load{i % 1024}"  # 64 MiB of load values, replaced in turn
                try:
                    self.s.upsert(key, val, replicas=2)
                    puts.append(time.time())
                    done = i
                    got = self.s.get(f"load-seed{i % 64}")
                    if got != val:
                        errors.append(f"get load-seed{i % 64}: {None if got is None else len(got)}")
                    gets.append(time.time())
                except Exception as e:  # noqa: BLE001 - counted: the rate is what is measured
                    errors.append(repr(e))
                i += 1
            return {"puts": puts, "gets": gets, "errors": errors[:20], "n_errors": len(errors), "ops": done}

        def seed(self) -> None:
            import numpy as np

            val = np.random.default_rng(7).integers(0, 256, LOAD_BYTES, dtype=np.uint8).tobytes()
            for i in range(64):
                self.s.put(f"load-seed{i}", val, replicas=2)

    head = ray.get_runtime_context().get_node_id()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return Load.options(scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False))


def run_once(cluster, fill: int, size: int, segment: int, delay: float | None, before: float, buf,
             pace: int | None = None, hold: float = 0.0) -> dict:
    import ray

    import mooncake_ray
    from mooncake_ray._private import deploy
    from mooncake_ray._private.naming import MASTER_NAME, store_actor_name

    ns = f"rp{uuid.uuid4().hex[:8]}"
    s = mooncake_ray.start({
        "namespace": ns, "segment_size_bytes": segment, "transport": {"devices": ["lo"]},
        "master": {"allocation_strategy": "free_ratio_first",
                   **({"repair_delay_s": delay} if delay is not None else {}),
                   **({"repair_bytes_per_s": pace} if pace else {})},
        "elastic": {"keep_arena": False}})
    master = ray.get_actor(MASTER_NAME, namespace=ns)
    try:
        s.register_buffer(buf)
        n = fill // size
        keys = [f"v{i}" for i in range(n)]
        views, fill_s = put_from_buffer(s, keys, size, buf, replicas=2)
        nodes = sorted(n_["node_id"] for n_ in ray.get(master.nodes.remote()))
        victim = nodes[0]
        where = ray.get(master.where.remote(keys))
        on_victim = sum(1 for reps in where if any(r[0] == victim for r in reps))
        load = _load_actor().remote(ns)
        ray.get(load.seed.remote())
        st0 = ray.get(master.stats.remote())
        total = before + 60.0
        peak = {"keys": 0, "bytes": 0}
        began = []  # when the master first counted a repair done

        def short() -> int:
            st = ray.get(master.stats.remote())
            peak["keys"] = max(peak["keys"], st["under_replicated_keys"])
            peak["bytes"] = max(peak["bytes"], st["under_replicated_bytes"])
            if not began and st["repairs"] > st0["repairs"]:
                began.append(time.time())
            return st["under_replicated_keys"]

        ref = load.run.remote(total)
        t_end = time.time() + before
        while time.time() < t_end:  # polled as during the repair, so both rates bear its cost
            short()
            time.sleep(POLL_S)
        old = {n_["node_id"]: n_["incarnation"] for n_ in ray.get(master.nodes.remote())}[victim]
        pid = ray.get(ray.get_actor(store_actor_name(victim), namespace=ns).pid.remote())
        t_kill = time.time()
        os.kill(pid, 9)
        _wait(lambda: short() > 0, timeout_s=60, interval_s=POLL_S, what="the loss to be noticed")
        t_noticed = time.time()
        if hold:  # no repair (repair_delay_s is an hour): the loss and the node's restart alone
            time.sleep(hold)
        else:
            _wait(lambda: short() == 0, timeout_s=120, interval_s=POLL_S, what="every value back to two copies")
        t_repaired = time.time()
        st1 = ray.get(master.stats.remote())
        remounted = {n_["node_id"]: n_["incarnation"] for n_ in ray.get(master.nodes.remote())}.get(victim)
        ray.get(load.stop.remote())
        got = ray.get(ref, timeout=60)
        ray.kill(load)
        sample = keys[:: max(1, n // 2000)]
        vals = s.batch_get(sample)
        missing = sum(1 for v in vals if v is None)
        wrong = sum(1 for k, v in zip(sample, vals) if v is not None and v != views[keys.index(k)].tobytes())
        st2 = ray.get(master.stats.remote())
        where = ray.get(master.where.remote(keys))
        copies = sorted({len({nd for nd, _t, ready in reps if ready}) for reps in where})

        def rate(ts, a, b):
            return sum(1 for t in ts if a <= t < b) / max(b - a, 1e-9)

        window = (t_noticed, max(t_repaired, t_noticed + 0.5))  # at least half a second counted
        copying = (began[0], max(t_repaired, began[0] + 0.5)) if began else window
        return {
            "value_bytes": size, "fill_bytes": n * size, "keys": n, "victim_keys": on_victim,
            "victim_bytes": on_victim * size, "fill_gbs": 2 * n * size / fill_s / 1e9,
            "noticed_after_kill_s": t_noticed - t_kill, "repair_s": t_repaired - t_noticed,
            "repaired_after_kill_s": t_repaired - t_kill, "peak_short_keys": peak["keys"],
            "peak_short_bytes": peak["bytes"],
            "repairs": st1["repairs"] - st0["repairs"], "repair_bytes": st1["repair_bytes"] - st0["repair_bytes"],
            "repair_failures": st1["repair_failures"] - st0["repair_failures"],
            "repair_gbs": (st1["repair_bytes"] - st0["repair_bytes"]) / max(t_repaired - t_noticed, 1e-9) / 1e9,
            "put_rate_before": rate(got["puts"], t_kill - before, t_kill),
            "put_rate_during": rate(got["puts"], *window),
            "repairs_began_after_kill_s": (began[0] - t_kill) if began else None,
            "copying_s": copying[1] - copying[0],
            "put_rate_copying": rate(got["puts"], *copying),
            "get_rate_before": rate(got["gets"], t_kill - before, t_kill),
            "get_rate_during": rate(got["gets"], *window),
            "load_errors": got["n_errors"], "load_error_sample": got["errors"][:5],
            "sample_wrong_or_missing": wrong + missing, "sample_missing": missing, "sample_wrong": wrong,
            "sample": len(sample), "evictions": st2.get("evictions", 0) - st0.get("evictions", 0),
            "lost_keys": st2.get("lost_keys", 0) - st0.get("lost_keys", 0), "copies_per_value": copies,
            "victim_remounted": remounted not in (None, old), "delay_s": delay,
        }
    finally:
        s.close()
        deploy.teardown(ns)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(runs))
    a.bar([i - 0.2 for i in x], [r["noticed_after_kill_s"] for r in runs], 0.4, label="kill -> noticed")
    a.bar([i + 0.2 for i in x], [r["repair_s"] for r in runs], 0.4, label="noticed -> two copies again")
    a.axhline(10, color="k", ls="--", lw=1, label="target (from noticed)")
    a.set_xticks(list(x), [f"run {i + 1}\n{r['victim_bytes'] / 1e9:.2f} GB" for i, r in enumerate(runs)])
    a.set_ylabel("seconds")
    a.legend(fontsize=8)
    a.set_title("Re-replication of a lost node's values")
    for key, lab, off in (("put_rate_copying", "while copies run", -0.2),
                          ("put_rate_during", "noticed -> repaired (restart included)", 0.2)):
        b.bar([i + off for i in x], [r[key] / max(r["put_rate_before"], 1e-9) for r in runs], 0.4, label=lab)
    b.axhline(0.8, color="k", ls="--", lw=1, label="target")
    b.set_xticks(list(x), [f"run {i + 1}" for i in x])
    b.set_ylabel("load's rate / before the loss")
    b.legend(fontsize=8)
    b.set_title("Client puts and gets meanwhile")
    fig.suptitle(host_label(results["host"]), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--fill", default="1536m", help="bytes of values (two copies each) over the three nodes")
    ap.add_argument("--value-bytes", default="256k")
    ap.add_argument("--segment", default="1792m", help="arena of each store node (room for the fill, the repairs and the load under the eviction watermark)")
    ap.add_argument("--delay", type=float, default=None, help="master.repair_delay_s (default: the store's)")
    ap.add_argument("--before", type=float, default=5.0, help="seconds of load measured before the kill")
    ap.add_argument("--pace", default="", help="master.repair_bytes_per_s (default: the store's default)")
    ap.add_argument("--hold", type=float, default=0.0,
                    help="no repair: measure the load for this many seconds after the loss is noticed "
                         "(what the loss and the node's restart cost alone)")
    ap.add_argument("--out", default="bench_repair.json", help="file name under benchmarks/results")
    args = ap.parse_args()
    import mooncake_ray  # noqa: F401 - the whole package first (parse_size alone loads a stub of it)

    fill, size, segment = parse_size(args.fill), parse_size(args.value_bytes), parse_size(args.segment)
    buf = np.random.default_rng(0).integers(0, 256, 64 * size, dtype=np.uint8)
    cluster = store_cluster(3)
    results = {"host": host_info(), "args": vars(args), "runs": []}
    try:
        for _ in range(args.runs):
            r = run_once(cluster, fill, size, segment, 3600.0 if args.hold else args.delay, args.before, buf,
                         parse_size(args.pace) if args.pace else None, args.hold)
            print(json.dumps(r), flush=True)
            results["runs"].append(r)
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()
    runs = results["runs"]
    results["summary"] = {
        "victim_gb": spread([r["victim_bytes"] / 1e9 for r in runs]),
        "noticed_after_kill_s": spread([r["noticed_after_kill_s"] for r in runs]),
        "repair_s": spread([r["repair_s"] for r in runs]),
        "repaired_after_kill_s": spread([r["repaired_after_kill_s"] for r in runs]),
        "repairs_began_after_kill_s": spread([r["repairs_began_after_kill_s"] for r in runs
                                              if r["repairs_began_after_kill_s"] is not None]),
        "put_copying_over_before": spread([r["put_rate_copying"] / max(r["put_rate_before"], 1e-9) for r in runs]),
        "repair_gbs": spread([r["repair_gbs"] for r in runs]),
        "put_during_over_before": spread([r["put_rate_during"] / max(r["put_rate_before"], 1e-9) for r in runs]),
        "get_during_over_before": spread([r["get_rate_during"] / max(r["get_rate_before"], 1e-9) for r in runs]),
        "wrong_or_missing": sum(r["sample_wrong_or_missing"] for r in runs),
        "copies_per_value": sorted({c for r in runs for c in r["copies_per_value"]}),
    }
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / args.out
    out.write_text(json.dumps(results, indent=1))
    plot(results, out.with_suffix(".png"))
    print(json.dumps(results["summary"], indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
