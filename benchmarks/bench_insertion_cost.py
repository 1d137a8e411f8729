"""What the adaptive insertion policy costs on the put path: put and get rates of chained
values with ``master.chain_insert`` adaptive (the default) against a fixed policy and
plain LRU.

The master decides where a new KV page enters the eviction order (``master.chain_insert``:
``recent``, ``old``, or ``adaptive``, the default). To adapt it samples every GET and every
put commit (a hash per key in C++ on the RPC thread), drains the samples in Python at each
tick and before each eviction round, and runs two miniature caches, one per fixed policy
(``_private/master/adaptive.py``). A fixed policy does none of that, and plain LRU
(``master.chain_eviction: false``) keeps no chains either. This measures whether the
default's bookkeeping slows the puts it serves, in a workload that evicts throughout.

Per configuration, each on a fresh store (one store node, an arena of ``--arena-mb`` MiB,
loopback transport), interleaved over ``--repeats`` rounds (the order rotates each round):

- ``adaptive``: ``master.chain_eviction`` on, no ``chain_insert`` given (the store's default);
- ``recent``:   the same with ``master.chain_insert: recent`` (fixed, no sampling);
- ``old``:      the same with ``master.chain_insert: old`` (fixed, no sampling). A put-only
  stream gives the adaptive policy no reference to count (a first put counts for neither
  policy), so it puts under its starting choice, ``old``, the whole loop: adaptive/old is
  the cost of the sampling alone, adaptive/recent and adaptive/lru add that of the order
  chosen (which pages eviction takes, and so how much it takes);
- ``lru``:      ``master.chain_eviction: false`` (plain LRU).

1. put: ``--keys`` values of ``--value-bytes`` bytes with ``client.batch_put`` in batches of
   ``--batch``, each batch one chain (every key names the key before it as its ``parent``;
   ``--link-batches``: the first key of a batch names the last key of the batch before,
   making the whole run one chain, whose only leaf is its newest key: chain eviction then
   takes the newest pages, or forces out old ones and drops their whole tail as orphans,
   which measures that path rather than the insertion policy). At the defaults the keys put take 2.4x the arena, so
   eviction runs through most of the loop. Measured: keys/s over the whole loop, the
   latency of each ``batch_put`` call (p50, p99), and the CPU each process used during the
   loop per key put (this client, the master, the store node; user + system from ``/proc``:
   on a small host they share the cores, so CPU one spends is rate the others lose). Keys a
   put refused are counted.
2. get: ``--reads`` ``client.batch_get`` calls of ``--get-batch`` keys drawn at random (seeded)
   from the last arena's worth of keys put (GETs are sampled too); keys/s, per-call p50 and
   p99, and the share of keys found (every value found is checked byte for byte, outside
   the timed calls).
3. the store's ``stats()`` after the puts and at the end (after a master tick, which drains
   the GETs' samples): ``eviction_policy`` (which policy the master chose, its sampled
   references and hit ratios), evictions, keys, hits, misses, orphaned pages.

Summary: per configuration the median [min-max] over repeats of put keys/s, put batch
p50/p99, get keys/s; the ratios adaptive/lru, adaptive/recent and adaptive/old of put and
get rates, paired per repeat and of the medians. The get rates depend on the share found (a
miss moves no bytes). Target: adaptive's put rate >= 0.95x plain LRU's (ratio of the
medians).

    make bench B=benchmarks/bench_insertion_cost.py ARGS="--repeats 3"

Writes benchmarks/results/bench_insertion_cost.json and bench_insertion_cost.png (median
bars with min-max whiskers; ``--replot FILE`` redraws the plot from a JSON). Not a test:
nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np

from _common import RESULTS, cpu_s, git_state, host_info, host_label, local_ray, role_pids, spread, versions

CONFIGS = ("adaptive", "recent", "old", "lru")
OTHERS = ("lru", "recent", "old")  # what adaptive is compared with
# master settings per configuration; "adaptive" passes no chain_insert: the store's default
MASTER = {"adaptive": {"chain_eviction": True},
          "recent": {"chain_eviction": True, "chain_insert": "recent"},
          "old": {"chain_eviction": True, "chain_insert": "old"},
          "lru": {"chain_eviction": False}}
SETTLE_S = 1.5  # before the last stats(): the master's tick (1 s) drains the samples
TARGET = 0.95  # adaptive's put rate over plain LRU's, ratio of the medians
STORE_STATS = ("keys", "used", "capacity", "puts", "hits", "misses", "evictions", "evicted_bytes",
               "orphaned_pages", "chain_tail_evictions")
METRICS = ("put_keys_per_s", "put_batch_p50_ms", "put_batch_p99_ms", "get_keys_per_s", "get_batch_p50_ms",
           "get_batch_p99_ms", "get_hit_pct")


def key_of(i: int) -> str:
    return f"bench/ic/{i:010d}"


def pct(lat_s: list[float], q: float) -> float:
    """The ``q`` percentile of latencies in seconds, in milliseconds."""
    return float(np.percentile(np.asarray(lat_s) * 1e3, q))


def run_one(cfg: str, rep: int, args, values: list[bytes]) -> dict:
    """One configuration on a fresh store: the put loop, then the reads; the JSON's row.
    ``values``: one value per position in a batch (key i holds ``values[i % batch]``)."""
    import mooncake_ray

    row: dict = {"config": cfg, "repeat": rep, "seed": args.seed + rep, "master": MASTER[cfg]}
    ns = f"bench_insertion_cost_{cfg}_{rep}"
    t_up = time.perf_counter()
    client = mooncake_ray.start({"namespace": ns, "segment_size_bytes": args.arena_mb << 20,
                                 "transport": {"devices": ["lo"]}, "master": dict(MASTER[cfg])})
    try:
        row["startup_s"] = time.perf_counter() - t_up
        pids = role_pids(ns)
        n, b = args.keys, args.batch
        batches = [(s, min(s + b, n)) for s in range(0, n, b)]
        keys = [key_of(i) for i in range(n)]
        parents: list[list[str | None]] = []
        for s, e in batches:  # built before the loop: the loop times batch_put alone
            first = keys[s - 1] if args.link_batches and s else None
            parents.append([first] + keys[s:e - 1])
        lat, failed = [], {}
        cpu0 = {role: cpu_s(pid) for role, pid in pids.items()}
        t0 = time.perf_counter()
        for (s, e), ps in zip(batches, parents):
            t = time.perf_counter()
            res = client.batch_put(keys[s:e], values[:e - s], parents=ps)
            lat.append(time.perf_counter() - t)
            for err in res:
                if err is not None:
                    failed[type(err).__name__] = failed.get(type(err).__name__, 0) + 1
        put_s = time.perf_counter() - t0
        row["put_cpu_us_per_key"] = {role: (cpu_s(pid) - cpu0[role]) / n * 1e6 for role, pid in pids.items()}
        row.update({"put_s": put_s, "put_keys_per_s": n / put_s, "put_batch_p50_ms": pct(lat, 50),
                    "put_batch_p99_ms": pct(lat, 99), "put_batch_max_ms": max(lat) * 1e3,
                    "put_failures": failed or None})
        after_put = client.stats()
        row["store_after_put"] = {k: after_put.get(k) for k in STORE_STATS}
        row["eviction_policy_after_put"] = after_put.get("eviction_policy")  # what the puts ran under

        # reads: random keys from the last arena's worth put
        window = min(n, (args.arena_mb << 20) // args.value_bytes)
        rng = np.random.default_rng(args.seed + rep)
        picks = rng.integers(n - window, n, (args.reads, args.get_batch))
        lat, found, bad = [], 0, 0
        t0 = time.perf_counter()
        for idx in picks.tolist():
            ks = [keys[i] for i in idx]
            t = time.perf_counter()
            got = client.batch_get(ks)
            lat.append(time.perf_counter() - t)
            for i, v in zip(idx, got):
                if v is not None:
                    found += 1
                    bad += bytes(v) != values[i % b]
        get_s = time.perf_counter() - t0  # includes the checks: get_keys_per_s uses the calls' time
        calls_s = sum(lat)
        row.update({"get_window_keys": window, "get_s": get_s, "get_calls_s": calls_s,
                    "get_keys_per_s": args.reads * args.get_batch / calls_s, "get_batch_p50_ms": pct(lat, 50),
                    "get_batch_p99_ms": pct(lat, 99), "get_hit_pct": 100.0 * found / (args.reads * args.get_batch),
                    "get_bad_values": bad})
        time.sleep(SETTLE_S)  # the master drains the GETs' samples at its next tick
        st = client.stats()
        row["store"] = {k: st.get(k) for k in STORE_STATS}
        row["eviction_policy"] = st.get("eviction_policy")
        return row
    finally:
        mooncake_ray.shutdown(namespace=ns, stop_ray=False)


# ======================================================================== summary ==
def summarize(rows: list[dict], args) -> dict:
    """Per configuration the spread of each metric; adaptive over lru and over recent, paired
    per repeat and of the medians; the target."""
    per = {cfg: {m: spread([r[m] for r in rows if r["config"] == cfg], keep=True) for m in METRICS}
           for cfg in args.config_list}
    for cfg, p in per.items():  # CPU per key put, per process
        mine = [r["put_cpu_us_per_key"] for r in rows if r["config"] == cfg]
        p["put_cpu"] = {role: spread([m[role] for m in mine], keep=True) for role in (mine[0] if mine else {})}

    def ratio(metric: str, other: str) -> dict | None:
        pa, pb = per.get("adaptive", {}).get(metric), per.get(other, {}).get(metric)
        if not pa or not pb or not pb["median"]:
            return None
        by_rep = {r["repeat"]: r[metric] for r in rows if r["config"] == other}
        paired = [r[metric] / by_rep[r["repeat"]] for r in rows
                  if r["config"] == "adaptive" and by_rep.get(r["repeat"])]
        return {"of_medians": pa["median"] / pb["median"], "paired": spread(paired, keep=True)}

    ratios = {f"adaptive_over_{o}": {m: ratio(m, o) for m in ("put_keys_per_s", "get_keys_per_s")}
              for o in OTHERS}
    r = ratios["adaptive_over_lru"]["put_keys_per_s"]
    target = {"what": f"adaptive put keys/s >= {TARGET}x lru's (ratio of the medians)", "goal": TARGET,
              "value": r["of_medians"] if r else None,
              "paired_min": r["paired"]["min"] if r and r["paired"] else None,
              "met": None if not r else r["of_medians"] >= TARGET}
    return {"configs": per, "ratios": ratios, "target": target}


# =========================================================================== plot ==
COLORS = {"adaptive": "tab:green", "recent": "tab:cyan", "old": "tab:olive", "lru": "tab:red"}


def plot(res: dict, path: Path) -> None:
    """Three panels: put keys/s, put batch latency (p50 and p99), get keys/s; median bars
    with min-max whiskers per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, cfgs = res["args"], res["args"]["config_list"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))

    def bars(ax, metric: str, offset: float, width: float, scale: float = 1.0, hatch: str | None = None,
             fmt: str = "{:.0f}") -> None:
        for k, cfg in enumerate(cfgs):
            s = res["summary"]["configs"][cfg][metric]
            if not s:
                continue
            med, lo, hi = s["median"] * scale, s["min"] * scale, s["max"] * scale
            x = k + offset
            ax.bar(x, med, width, color=COLORS[cfg], edgecolor="black", linewidth=0.4, hatch=hatch,
                   alpha=0.55 if hatch else 1.0, yerr=[[med - lo], [hi - med]], capsize=3, error_kw={"linewidth": 0.8})
            ax.text(x, hi, fmt.format(med), ha="center", va="bottom", fontsize=7)

    ratios = res["summary"]["ratios"]

    def note(metric: str) -> str:
        parts = [f"adaptive/{o} x{r['of_medians']:.3f}" for o in OTHERS
                 if (r := ratios[f"adaptive_over_{o}"][metric])]
        return ", ".join(parts)

    ax = axes[0]
    bars(ax, "put_keys_per_s", 0, 0.7, 1e-3, fmt="{:.1f}")
    ax.set_ylabel("put rate (thousand keys/s)")
    t = res["summary"]["target"]
    met = "n/a" if t["met"] is None else ("met" if t["met"] else "MISSED")
    ax.set_title(f"put ({a['batch']} keys per batch_put)\n{note('put_keys_per_s')}\n"
                 f"target adaptive/lru >= x{t['goal']}: {met}", fontsize=8)
    ax = axes[1]
    bars(ax, "put_batch_p50_ms", -0.2, 0.38, fmt="{:.2f}")
    bars(ax, "put_batch_p99_ms", 0.2, 0.38, hatch="//", fmt="{:.2f}")
    ax.set_ylabel("batch_put latency (ms)")
    ax.set_title("put latency per batch: p50 (solid), p99 (hatched)", fontsize=8)
    ax = axes[2]
    bars(ax, "get_keys_per_s", 0, 0.7, 1e-3, fmt="{:.1f}")
    ax.set_ylabel("get rate (thousand keys/s)")
    ax.set_title(f"get ({a['get_batch']} keys per batch_get, last arena's worth)\n{note('get_keys_per_s')}",
                 fontsize=8)
    for ax in axes[:2]:
        ax.set_xticks(range(len(cfgs)), cfgs, fontsize=8)
    found = [res["summary"]["configs"][c]["get_hit_pct"] for c in cfgs]
    axes[2].set_xticks(range(len(cfgs)), [f"{c}\nfound {f['median']:.0f}%" if f else c for c, f in zip(cfgs, found)],
                       fontsize=8)
    for ax in axes:
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"Cost of the adaptive insertion policy: median and range over {a['repeats']} repeat(s)\n"
                 f"{a['keys']} keys x {a['value_bytes']} B into a {a['arena_mb']} MiB arena "
                 f"({a['keys'] * a['value_bytes'] / (a['arena_mb'] << 20):.1f}x), {host_label(res.get('host'))}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# =========================================================================== main ==
def fmt_spread(s: dict | None, scale: float = 1.0, digits: int = 0) -> str:
    if not s:
        return "n/a"
    return (f"{s['median'] * scale:.{digits}f} [{s['min'] * scale:.{digits}f}-{s['max'] * scale:.{digits}f}]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keys", type=int, default=40000, help="values put per configuration and repeat")
    ap.add_argument("--value-bytes", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=64, help="keys per batch_put: one chain")
    ap.add_argument("--link-batches", action="store_true",
                    help="a batch's first key names the last key of the batch before (the whole run one chain)")
    ap.add_argument("--arena-mb", type=int, default=64, help="the store node's DRAM arena (MiB)")
    ap.add_argument("--reads", type=int, default=20000, help="batch_get calls after the puts")
    ap.add_argument("--get-batch", type=int, default=64, help="keys per batch_get")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "bench_insertion_cost.json"))
    ap.add_argument("--replot", metavar="JSON", help="only redraw the plot of a results file")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), Path(args.replot).with_suffix(".png"))
        return
    args.config_list = [c for c in args.configs.split(",") if c]
    bad = set(args.config_list) - set(CONFIGS)
    if bad:
        sys.exit(f"unknown configs {sorted(bad)}; allowed: {','.join(CONFIGS)}")
    if min(args.keys, args.batch, args.reads, args.get_batch, args.value_bytes, args.arena_mb, args.repeats) < 1:
        sys.exit("--keys, --batch, --reads, --get-batch, --value-bytes, --arena-mb and --repeats must be >= 1")
    names = sorted(n for _, n in socket.if_nameindex())
    if names != ["lo"]:
        sys.exit(f"run inside a private network namespace (interfaces: {names}): "
                 "make bench B=benchmarks/bench_insertion_cost.py")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    host = host_info()
    put_over_arena = args.keys * args.value_bytes / (args.arena_mb << 20)
    print(f"host: {host_label(host, model=True)}; {args.keys} keys x {args.value_bytes} B in batches of "
          f"{args.batch} = {put_over_arena:.1f}x the {args.arena_mb} MiB arena; {args.reads} batch_get x "
          f"{args.get_batch} keys", flush=True)
    rng = np.random.default_rng(args.seed)
    values = [rng.integers(0, 256, args.value_bytes, dtype=np.uint8).tobytes() for _ in range(args.batch)]

    import ray

    local_ray()  # each run its own store on it
    git = git_state()
    rows, t_start = [], time.perf_counter()
    try:
        for rep in range(args.repeats):
            k = rep % len(args.config_list)
            for cfg in args.config_list[k:] + args.config_list[:k]:
                t = time.perf_counter()
                row = run_one(cfg, rep, args, values)
                row["wall_s"] = time.perf_counter() - t
                rows.append(row)
                pol = row["eviction_policy"] or {}
                st = row["store"]
                print(f"[repeat {rep + 1}/{args.repeats}] {cfg:8}: put {row['put_keys_per_s']:7.0f} keys/s "
                      f"(batch p50 {row['put_batch_p50_ms']:.2f} p99 {row['put_batch_p99_ms']:.2f} ms"
                      f"{', failed ' + str(row['put_failures']) if row['put_failures'] else ''}) | get "
                      f"{row['get_keys_per_s']:7.0f} keys/s, {row['get_hit_pct']:.1f}% found"
                      f"{', BAD ' + str(row['get_bad_values']) if row['get_bad_values'] else ''} | evictions "
                      f"{st.get('evictions')}, keys {st.get('keys')}, orphaned {st.get('orphaned_pages')} | policy "
                      f"{pol.get('mode')}->{pol.get('insert')} sampled {pol.get('sampled_refs')} "
                      f"({row['wall_s']:.0f}s) | put CPU us/key "
                      + " ".join(f"{k} {v:.2f}" for k, v in row["put_cpu_us_per_key"].items()), flush=True)
    finally:
        ray.shutdown()
    summary = summarize(rows, args)
    res = {"description": "put and get rates of chained values under eviction: the adaptive insertion policy "
                          "(default) against chain_insert recent and plain LRU",
           "args": {k: v for k, v in vars(args).items() if k != "replot"}, "host": host,
           "versions": versions(["mooncake-ray", "ray", "numpy"]), "git": git,
           "put_bytes_over_arena": put_over_arena,
           "definitions": {"put_keys_per_s": "keys put / wall time of the whole put loop (batch_put calls only)",
                           "put_cpu_us_per_key": "CPU (user + system, /proc) each process used during the put "
                                                 "loop / keys put: this client, the master, the store node",
                           "put_batch_p50_ms/p99_ms": "latency of one batch_put call",
                           "get_keys_per_s": "keys asked / summed time of the batch_get calls (checks excluded)",
                           "get_window": "reads draw from the last arena_mb MiB / value_bytes keys put"},
           "master": MASTER, "wall_s": time.perf_counter() - t_start, "summary": summary, "runs": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    plot(res, out.with_suffix(".png"))

    print(f"\nmedian [min-max] over {args.repeats} repeat(s)")
    for cfg in args.config_list:
        c = summary["configs"][cfg]
        print(f"  {cfg:8}: put {fmt_spread(c['put_keys_per_s'])} keys/s, batch p50 "
              f"{fmt_spread(c['put_batch_p50_ms'], digits=2)} ms, p99 {fmt_spread(c['put_batch_p99_ms'], digits=2)} ms"
              f" | get {fmt_spread(c['get_keys_per_s'])} keys/s, found {fmt_spread(c['get_hit_pct'], digits=1)}%"
              f" | put CPU us/key " + " ".join(f"{role} {fmt_spread(v, digits=2)}" for role, v in c["put_cpu"].items()))
    for name, rs in summary["ratios"].items():
        for metric, r in rs.items():
            if r:
                p = r["paired"]
                print(f"  {name.replace('_over_', '/')} {metric}: x{r['of_medians']:.3f} of medians, paired "
                      f"{fmt_spread(p, digits=3) if p else 'n/a'}")
    t = summary["target"]
    if t["met"] is None:
        print(f"  target {t['what']}: not measured (adaptive or lru missing)")
    else:
        print(f"  target {t['what']}: x{t['value']:.3f} -> {'met' if t['met'] else 'MISSED'}")
    print(f"wrote {out} and {out.with_suffix('.png')} in {res['wall_s']:.0f}s")


if __name__ == "__main__":
    main()
