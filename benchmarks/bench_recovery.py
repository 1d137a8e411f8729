"""Recovery at scale: how long a restarted master, and a store node restarted with its kept
arena, take to serve again after holding ``--keys`` small values.

Set-up (per repeat, a fresh store): a Ray cluster on this host (a head and one store node,
``ray.cluster_utils``), ``mooncake_ray.start`` with the defaults (durable acknowledgements,
kept arena in ``/dev/shm``, commit rings), a ``--arena`` DRAM arena and no spill tier. This
process puts ``--keys`` values of ``--value-bytes`` (each value its key padded with ``#``) in
batches of ``--batch`` through the bytes API; every put must be acknowledged.

Master restart: the master actor's process is SIGKILLed; Ray restarts the actor (often in a
worker process it started earlier, so the process's own start time says nothing here); the
store node remounts with its inventory. Measured from the kill:

- ``answers_s``: the new master answers ``ping`` (its actor is up);
- ``indexed_s``: its ``stats()`` counts every key and it is not recovering;
- ``serves_s``: a batch GET of a sample (``--sample`` random keys and the last batch put)
  returns every value intact, polled every 20 ms; ``serves_after_answer_s`` is the part
  after the actor answered (the rebuild and the client reconnecting, not Ray's restart).

Store node restart: the store node actor's process is SIGKILLed; Ray restarts it, and it
re-adopts its arena (the journal and index beside it, each value's checksum checked) and
remounts. Measured from the new node process's start and from the kill: ``actor_init_s``
(its ``__init__`` began: imports and Ray's worker start before it), ``readopted_s`` (the
node's own time for the re-adoption, its ``stats()``), ``mounted_s`` (the
master lists the new incarnation and counts every key), ``serves_s`` as above.

After each phase every key is read back (untimed) and counted: ``intact`` must equal
``--keys``. Targets (issue: durable puts): both restarts serve every key within 2 s.

    make bench B=benchmarks/bench_recovery.py ARGS="--keys 1000000 --repeats 3"

Writes benchmarks/results/bench_recovery.json and bench_recovery.png. Every Ray process runs
inside the make target's private network namespace.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import uuid
from pathlib import Path

from _common import host_info, host_label, spread, store_cluster

RESULTS = Path(__file__).resolve().parent / "results"
HZ = os.sysconf("SC_CLK_TCK")


def proc_started_mono(pid: int) -> float:
    """When process ``pid`` started, on this process's ``time.monotonic()`` clock."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    started_s = int(fields[19]) / HZ  # field 22: start time, ticks since boot
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.monotonic() - (uptime - started_s)


def value_of(key: str, n: int) -> bytes:
    b = key.encode()
    return b + b"#" * (n - len(b))


def wait(pred, timeout_s: float, what: str, interval_s: float = 0.02):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = pred()
        except Exception:  # noqa: BLE001 - restarting
            got = None
        if got:
            return time.monotonic()
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def serves(store, sample: list[str], n: int) -> bool:
    got = store.batch_get(sample)
    return all(v is not None and bytes(v) == value_of(k, n) for k, v in zip(sample, got))


def intact(store, keys: list[str], n: int, batch: int) -> int:
    ok = 0
    for i in range(0, len(keys), batch):
        part = keys[i:i + batch]
        ok += sum(v is not None and bytes(v) == value_of(k, n) for k, v in zip(part, store.batch_get(part)))
    return ok


def one_run(args, rep: int) -> dict:
    import ray
    import mooncake_ray
    from mooncake_ray._private import deploy
    from mooncake_ray._private.naming import MASTER_NAME, store_actor_name

    ns = f"rec{uuid.uuid4().hex[:8]}"
    store = mooncake_ray.start({"namespace": ns, "segment_size_bytes": args.arena,
                                "transport": {"devices": ["lo"]}})
    n, keys = args.value_bytes, [f"r{rep}/{i}" for i in range(args.keys)]
    row: dict = {"repeat": rep, "keys": args.keys}
    t = time.perf_counter()
    for i in range(0, len(keys), args.batch):
        part = keys[i:i + args.batch]
        res = store.batch_put(part, [value_of(k, n) for k in part])
        bad = [r for r in res if r is not None]
        if bad:
            raise RuntimeError(f"batch at {i}: {len(bad)} puts failed, first {bad[0]!r}")
    row["put_s"] = time.perf_counter() - t
    rng = random.Random(rep)
    sample = rng.sample(keys, min(args.sample, len(keys))) + keys[-args.batch:]
    master = ray.get_actor(MASTER_NAME, namespace=ns)

    # ---- the master
    inc, pid = ray.get(master.ping.remote()), ray.get(master.pid.remote())
    killed = time.monotonic()
    os.kill(pid, 9)
    answered = wait(lambda: ray.get(master.ping.remote(), timeout=5) != inc, 120, "the master to restart")

    def indexed():
        s = ray.get(master.stats.remote(), timeout=5)
        return s["keys"] >= args.keys and not s["recovering"]

    idx = wait(indexed, 120, "the new master to count every key")
    srv = wait(lambda: serves(store, sample, n), 120, "the sample to read back")
    row["master"] = {"answers_s": answered - killed, "indexed_s": idx - killed, "serves_s": srv - killed,
                     "serves_after_answer_s": srv - answered, "intact": intact(store, keys, n, args.batch)}
    print(json.dumps({"repeat": rep, "master": row["master"]}), flush=True)

    # ---- the store node
    (info,) = ray.get(master.nodes.remote())
    node = ray.get_actor(store_actor_name(info["node_id"]), namespace=ns)
    npid, ninc = ray.get(node.pid.remote()), info["incarnation"]
    killed = time.monotonic()
    os.kill(npid, 9)

    def new_pid():
        p = ray.get(node.pid.remote(), timeout=5)
        return p if p != npid else None

    wait(new_pid, 120, "the store node to restart")
    started = proc_started_mono(ray.get(node.pid.remote()))

    def mounted():
        (i,) = ray.get(master.nodes.remote(), timeout=5)
        return i["incarnation"] != ninc and ray.get(master.stats.remote(), timeout=5)["keys"] >= args.keys

    mnt = wait(mounted, 120, "the restarted node to mount with every key")
    srv = wait(lambda: serves(store, sample, n), 120, "the sample to read back")
    st = ray.get(node.stats.remote())
    readopt, init_at = st.get("readopted") or {}, st["started_at"] - time.time() + time.monotonic()
    row["node"] = {"mounted_s": mnt - started, "serves_s": srv - started, "serves_since_kill_s": srv - killed,
                   "process_start_after_kill_s": started - killed,
                   "actor_init_s": init_at - started, "startup_s": st.get("startup"),
                   "readopted_s": readopt.get("seconds"), "readopted_keys": readopt.get("keys"),
                   "intact": intact(store, keys, n, args.batch)}
    print(json.dumps({"repeat": rep, "node": row["node"]}), flush=True)
    store.close()
    deploy.teardown(ns)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--value-bytes", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--arena", default="512mb")
    ap.add_argument("--sample", type=int, default=1000, help="random keys read back to call a restart served")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "bench_recovery.json"))
    args = ap.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = {"benchmark": "bench_recovery", "host": host_info(), "config": vars(args), "runs": []}
    cluster = store_cluster(1)
    try:
        for rep in range(args.repeats):
            results["runs"].append(one_run(args, rep))
    finally:
        ray.shutdown()
        cluster.shutdown()
    runs = results["runs"]
    results["summary"] = {
        f"{role}_{m}": spread([r[role][m] for r in runs], keep=True)
        for role, ms in (("master", ("answers_s", "indexed_s", "serves_s", "serves_after_answer_s")),
                         ("node", ("actor_init_s", "readopted_s", "mounted_s", "serves_s", "serves_since_kill_s",
                                   "process_start_after_kill_s")))
        for m in ms}
    results["summary"]["all_intact"] = all(r[role]["intact"] == args.keys for r in runs for role in ("master", "node"))
    out.write_text(json.dumps(results, indent=2))
    plot(results, out.with_suffix(".png"))
    print("host:", host_label(results["host"], model=True))
    print(json.dumps(results["summary"], indent=2))
    print(f"wrote {out}")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    bars = [("master", "answers_s", "master:\nanswers"), ("master", "indexed_s", "master:\nevery key indexed"),
            ("master", "serves_s", "master:\nsample served"), ("node", "readopted_s", "node: re-adoption\n(its own time)"),
            ("node", "mounted_s", "node:\nmounted, every key"), ("node", "serves_s", "node:\nsample served")]
    for i, (role, m, label) in enumerate(bars):
        vals = [r[role][m] for r in results["runs"] if r[role][m] is not None]
        if not vals:
            continue
        med = sorted(vals)[len(vals) // 2]
        ax.bar(i, med, color="tab:blue" if role == "master" else "tab:orange")
        ax.scatter([i] * len(vals), vals, color="black", s=10, zorder=3)
        ax.text(i, med, f"{med:.2f}", ha="center", va="bottom", fontsize=8)
    ax.axhline(2.0, color="red", linestyle="--", label="target 2 s")
    ax.set_xticks(range(len(bars)), [b[2] for b in bars], fontsize=8)
    ax.set_ylabel("seconds: master from its kill,\nnode from its new process's start")
    keys = results["config"]["keys"]
    ax.set_title(f"recovery with {keys:,} x {results['config']['value_bytes']} B values (median, dots: runs)\n"
                 f"{host_label(results.get('host'))}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--plot":
        plot(json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[2]).with_suffix(".png"))
    else:
        main()
