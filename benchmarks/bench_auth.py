"""What the transport's peer authentication costs: the same store with ``transport.auth``
on and off, measured in the same run, paired.

Set-up: one local Ray cluster started here; per protocol (``transport.protocol="auto"``,
shared memory on one host, where bytes move by memcpy and only the metadata RPCs carry
the session token; and ``"tcp"``, where every transfer is messages) two stores deployed
side by side in their own namespaces, one with ``{"transport": {"auth": true}}`` and one
with ``false``, same segment size (``--segment``, 1 GiB: a 4 MiB run writes 256 MiB;
at 512 MiB the auth-on "auto" store answered a just-written 4 MiB key as a miss in round
3 of two runs: an open question, listed in docs/performance.md),
each with one store node (a StoreNode actor process) and a client in this driver. Every
store's pool is touched once before the first round.

Measured (each round: every measurement on both stores of a protocol, back to back,
which goes first alternating per round and per repetition):

- connect: a fresh engine built like a client's (``auth.role_engine`` with the store's
  config: holding the secret read from Ray's KV, or not), then ``Engine.connect`` to the
  master and then to the store node (the handshake: HELLO without auth; AUTH1 /
  AUTH_RESP / AUTH2 / HELLO_ACK with), ``--connect-reps`` times per round and side; and
  ``mooncake_ray.connect()`` then its first ``get`` of a 4 KiB key (master lookup over
  Ray, both connects, the lookup RPC, the read), ``--client-reps`` times.
- 4 KiB single GET ops/s: zero-copy ``get_into`` into a registered buffer, ``get``
  returning bytes, and ``get_into`` with the location cache emptied before each get (a
  client that never saw the key: the lookup RPC first); PUT ops/s comes with them.
- 4 MiB zero-copy GET and PUT GB/s (and GET with no location cache).
  The single-op runs are bench_transport.py's (``single_run``: n puts, then n gets, then
  the no-cache gets; each read verified outside the timed region), ``--repeats`` per
  round and side.

Each round's value per store is the median of its runs in that round; reported per
measurement: the median over rounds with min-max, and the paired ratio auth on / off
(per round, from that round's values) as its median with min-max over rounds. Target:
steady-state throughput ratio >= 0.98 (at most 2% cost); connect times have no target
(paid once per client and peer) and are reported as on/off time ratios and added ms.

Run inside the private network namespace (2 vCPUs shared: everything is paired):
    make bench B=benchmarks/bench_auth.py ARGS="--rounds 5"
    (--quick: 2 rounds, fewer repetitions: a smoke test)
Writes benchmarks/results/bench_auth.json and bench_auth.png.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from _common import RESULTS, host_info, host_label, parse_size, spread
from bench_transport import MIB4, Ours, _git_state, single_run, warm_pool

SIDES = ("on", "off")
KIB4 = 4 << 10
TARGET = 0.98

# (key, label, unit, higher_is_better, target, getter of one run's value)
# "conn": one connect_once(); "client": one client_first_get(); "zc4k" / "bytes4k" /
# "zc4m": one bench_transport.single_run().
METRICS = [
    ("engine_ms", "engine set-up (role_engine)", "ms", False, None, "conn", lambda x: x["engine_s"] * 1e3),
    ("connect_master_ms", "Engine.connect to the master", "ms", False, None, "conn",
     lambda x: x["master_s"] * 1e3),
    ("connect_node_ms", "Engine.connect to the store node", "ms", False, None, "conn",
     lambda x: x["node_s"] * 1e3),
    ("client_connect_ms", "mooncake_ray.connect()", "ms", False, None, "client", lambda x: x["connect_s"] * 1e3),
    ("client_first_get_ms", "its first get (4 KiB)", "ms", False, None, "client",
     lambda x: x["first_get_s"] * 1e3),
    ("client_total_ms", "connect() + first get", "ms", False, None, "client", lambda x: x["total_s"] * 1e3),
    ("get4k_zc", "4 KiB GET ops/s (get_into)", "ops/s", True, TARGET, "zc4k", lambda x: x["get"]["ops_per_s"]),
    ("get4k_bytes", "4 KiB GET ops/s (get -> bytes)", "ops/s", True, TARGET, "bytes4k",
     lambda x: x["get"]["ops_per_s"]),
    ("get4k_zc_cold", "4 KiB GET ops/s (get_into, no location cache)", "ops/s", True, TARGET, "zc4k",
     lambda x: x["get_cold"]["ops_per_s"]),
    ("put4k_zc", "4 KiB PUT ops/s (put_from)", "ops/s", True, TARGET, "zc4k", lambda x: x["put"]["ops_per_s"]),
    ("get4k_zc_p50_us", "4 KiB GET p50 latency (get_into)", "us", False, None, "zc4k",
     lambda x: x["get"]["p50_us"]),
    ("get4m_zc", "4 MiB GET GB/s (get_into)", "GB/s", True, TARGET, "zc4m", lambda x: x["get"]["gb_per_s"]),
    ("put4m_zc", "4 MiB PUT GB/s (put_from)", "GB/s", True, TARGET, "zc4m", lambda x: x["put"]["gb_per_s"]),
    ("get4m_zc_cold", "4 MiB GET GB/s (get_into, no location cache)", "GB/s", True, TARGET, "zc4m",
     lambda x: x["get_cold"]["gb_per_s"]),
]


# ================================================================ measurements ==
class Side:
    """One store (auth on or off) of one protocol: its client and its peers' addresses."""

    def __init__(self, proto: str, side: str, segment: str, rng):
        import ray

        import mooncake_ray

        self.proto, self.side = proto, side
        self.ns = f"bench_auth_{proto}_{side}"
        t = time.perf_counter()
        self.client = mooncake_ray.start({
            "segment_size_bytes": segment, "namespace": self.ns,
            "transport": {"protocol": proto, "devices": ["lo"], "auth": side == "on"}})
        self.up_s = time.perf_counter() - t
        auth_enabled = bool(self.client.engine.stats().get("auth_enabled"))
        if auth_enabled != (side == "on"):
            raise AssertionError(f"{self.ns}: client engine auth_enabled={auth_enabled}")
        self.cli = Ours(self.client, f"{proto}/{side}")
        from mooncake_ray._private.deploy import find_master

        master = find_master(self.ns)
        self.master_addr = ray.get(master.rpc_address.remote())
        nodes = ray.get(master.nodes.remote())
        if len(nodes) != 1:
            raise AssertionError(f"{self.ns}: expected one store node, got {len(nodes)}")
        self.node_addr = nodes[0]["address"]
        warm_pool(self.cli, f"warm/{self.ns}", parse_size(segment))
        # the key the fresh clients read first
        self.probe_key = f"ba/{self.ns}/probe"
        self.probe = rng.integers(0, 256, KIB4, dtype=np.uint8).tobytes()
        self.client.put(self.probe_key, self.probe)

    def connect_once(self) -> dict:
        """A fresh engine built like a client's, connected to the master then the node."""
        from mooncake_ray._private.auth import role_engine

        pc = time.perf_counter
        t0 = pc()
        eng = role_engine(self.client.config, "bench-auth-connect")
        t1 = pc()
        try:
            eng.connect(self.master_addr)
            t2 = pc()
            eng.connect(self.node_addr)
            t3 = pc()
            hs = eng.stats().get("auth_handshakes", 0)
        finally:
            eng.close()
        return {"engine_s": t1 - t0, "master_s": t2 - t1, "node_s": t3 - t2, "auth_handshakes": hs}

    def client_first_get(self) -> dict:
        """``mooncake_ray.connect()`` of a new client, then its first get."""
        import mooncake_ray

        pc = time.perf_counter
        t0 = pc()
        c = mooncake_ray.connect(namespace=self.ns)
        t1 = pc()
        try:
            v = c.get(self.probe_key)
            t2 = pc()
        finally:
            c.close()
        if v != self.probe:
            raise AssertionError(f"{self.ns}: first get read back wrong")
        return {"connect_s": t1 - t0, "first_get_s": t2 - t1, "total_s": t2 - t0}


def one_round(pair: dict, r: int, rng, args) -> dict:
    """Every measurement on both stores of one protocol, the order alternating with the
    round and the repetition. Returns {side: {kind: [runs]}, "failed_runs": [...]}."""
    from mooncake_ray.errors import ObjectNotFoundError

    out = {s: {"conn": [], "client": [], "zc4k": [], "bytes4k": [], "zc4m": []} for s in SIDES}
    out["failed_runs"] = []

    def order(k):
        return SIDES if (k + r) % 2 == 0 else SIDES[::-1]

    for k in range(args.connect_reps):
        for s in order(k):
            out[s]["conn"].append(pair[s].connect_once())
    for k in range(args.client_reps):
        for s in order(k):
            out[s]["client"].append(pair[s].client_first_get())
    for kind, size, mode in (("zc4k", KIB4, "zc"), ("bytes4k", KIB4, "bytes"), ("zc4m", MIB4, "zc")):
        for k in range(args.repeats):
            for s in order(k):
                for attempt in range(3):  # a run whose keys went missing (a node lost under load) again
                    try:
                        out[s][kind].append(single_run(pair[s].cli, size, mode, f"ba/{s}/{r}/{k}/{attempt}", rng))
                        break
                    except (ObjectNotFoundError, AssertionError) as e:
                        out["failed_runs"].append(f"{pair[s].ns} {kind} round {r} rep {k}: {type(e).__name__}: {e}")
                        print(f"  run failed, again: {out['failed_runs'][-1]}", flush=True)
                else:
                    raise RuntimeError(f"{pair[s].ns} {kind}: three runs failed")
    return out


# ================================================================ aggregation ==
def summarize(rounds: list[dict]) -> dict:
    """Per metric: per-round values per side (median of the round's runs), their spread,
    the per-round paired ratios on/off and their spread."""
    res = {}
    for key, label, unit, higher, target, kind, get in METRICS:
        per = {s: [statistics.median([get(x) for x in rd[s][kind]]) for rd in rounds] for s in SIDES}
        ratios = [on / off for on, off in zip(per["on"], per["off"]) if off > 0]
        row = {"label": label, "unit": unit, "higher_is_better": higher, "target": target,
               "on": spread(per["on"], keep=True), "off": spread(per["off"], keep=True),
               "ratio_on_off": spread(ratios, keep=True),
               "ratio_of_medians": statistics.median(per["on"]) / statistics.median(per["off"]),
               "added": statistics.median([on - off for on, off in zip(per["on"], per["off"])])}
        if target is not None:
            row["met"] = row["ratio_on_off"]["median"] >= target
        res[key] = row
    return res


# 4 KiB single-op latencies: (key, label, kind, op) whose per-run p50 is compared by mode
LAT_MODES = [("get4k_zc", "4 KiB GET p50 (get_into)", "zc4k", "get"),
             ("get4k_bytes", "4 KiB GET p50 (get -> bytes)", "bytes4k", "get"),
             ("get4k_zc_cold", "4 KiB GET p50 (get_into, no location cache)", "zc4k", "get_cold"),
             ("put4k_zc", "4 KiB PUT p50 (put_from)", "zc4k", "put")]


def latency_modes(rounds: list[dict]) -> dict:
    """Per-op p50 latency of the 4 KiB runs, split by mode. On a loaded host a run's
    p50 falls in one of two modes (same-host: ~15 us when the peers' threads are awake,
    ~75 us when a wake-up is paid), whichever the side, and a mode flip inside a pair
    swamps a 2% effect. So: all runs' p50s of both sides sorted, split at the largest gap
    if it is over 2x, and on vs off compared within each mode (median of the runs' p50s,
    their count, the ratio on/off and the added us)."""
    res = {}
    for key, label, kind, op in LAT_MODES:
        runs = {s: [x[op]["p50_us"] for rd in rounds for x in rd[s][kind]] for s in SIDES}
        vals = sorted(runs["on"] + runs["off"])
        gaps = [(b / a, a) for a, b in zip(vals, vals[1:]) if a > 0]
        cut = max(gaps)[1] if gaps and max(gaps)[0] > 2 else None
        modes = {"all": (0.0, float("inf"))} if cut is None else {"fast": (0.0, cut), "slow": (cut, float("inf"))}
        row = {"label": label, "split_at_us": cut, "modes": {}}
        for name, (lo, hi) in modes.items():
            sel = {s: [v for v in runs[s] if (lo < v <= hi) or (lo == 0.0 and v <= hi)] for s in SIDES}
            if not sel["on"] or not sel["off"]:
                row["modes"][name] = {"n_on": len(sel["on"]), "n_off": len(sel["off"])}
                continue
            on, off = statistics.median(sel["on"]), statistics.median(sel["off"])
            row["modes"][name] = {"n_on": len(sel["on"]), "n_off": len(sel["off"]), "p50_on_us": on,
                                  "p50_off_us": off, "ratio_on_off": on / off, "added_us": on - off}
        res[key] = row
    return res


def print_modes(modes: dict) -> None:
    for proto, rows in modes.items():
        print(f"\n== {proto}: 4 KiB per-op p50 by mode (median of runs' p50s; on/off ratio > 1: auth costs)")
        for row in rows.values():
            parts = []
            for name, m in row["modes"].items():
                if "p50_on_us" not in m:
                    parts.append(f"{name}: runs on {m['n_on']} / off {m['n_off']}")
                    continue
                parts.append(f"{name}: {m['p50_on_us']:.1f} vs {m['p50_off_us']:.1f} us ({m['ratio_on_off']:.3f}, "
                             f"{m['added_us']:+.1f} us; runs {m['n_on']}/{m['n_off']})")
            print(f"  {row['label']:46} " + " | ".join(parts))


def _fmt(v: float, unit: str) -> str:
    if unit == "ops/s":
        return f"{v:,.0f}"
    if unit == "GB/s":
        return f"{v:.2f}"
    return f"{v:.2f}" if v < 100 else f"{v:.0f}"


def print_table(summary: dict) -> None:
    for proto, rows in summary.items():
        print(f"\n== {proto}: median over rounds [min-max]; paired ratio on/off median [min-max]")
        print(f"  {'measurement':48} {'auth on':>26} {'auth off':>26} {'on/off':>20}")
        for key, row in rows.items():
            u = row["unit"]
            cells = []
            for s in SIDES:
                st = row[s]
                cells.append(f"{_fmt(st['median'], u)} [{_fmt(st['min'], u)}-{_fmt(st['max'], u)}]")
            rt = row["ratio_on_off"]
            verdict = ""
            if row["target"] is not None:
                verdict = " met" if row["met"] else " MISSED"
            print(f"  {row['label'] + ' (' + u + ')':48} {cells[0]:>26} {cells[1]:>26} "
                  f"{rt['median']:.3f} [{rt['min']:.3f}-{rt['max']:.3f}]{verdict}")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    protos = list(results["summary"])
    fig, axes = plt.subplots(1, 2, figsize=(15, 7))
    colors = {"auto": "tab:blue", "tcp": "tab:green"}
    for ax, higher, title in ((axes[0], True, "steady state: throughput ratio auth on / off\n"
                                               "(>= 0.98 target, dashed; < 1: auth costs)"),
                              (axes[1], False, "connect: time ratio auth on / off\n"
                                               "(> 1: auth costs; label: added ms, medians)")):
        keys = [k for k, row in results["summary"][protos[0]].items()
                if row["higher_is_better"] == higher and row["unit"] != "us"]
        ys = np.arange(len(keys))
        h = 0.8 / len(protos)
        for i, proto in enumerate(protos):
            rows = results["summary"][proto]
            med = [rows[k]["ratio_on_off"]["median"] for k in keys]
            lo = [max(0.0, m - rows[k]["ratio_on_off"]["min"]) for m, k in zip(med, keys)]
            hi = [max(0.0, rows[k]["ratio_on_off"]["max"] - m) for m, k in zip(med, keys)]
            y = ys + (i - (len(protos) - 1) / 2) * h
            ax.barh(y, [m - 1 for m in med], left=1, height=h * 0.9, xerr=[lo, hi], color=colors.get(proto),
                    alpha=0.75, label=proto, capsize=3)
            for yy, m, k in zip(y, med, keys):  # the label right of the whisker
                extra = "" if higher else f"  {rows[k]['added']:+.2f} ms"
                ax.text((m + hi[keys.index(k)]) * 1.01, yy, f"{m:.3f}{extra}", va="center", fontsize=7)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(FixedLocator([0.25, 0.5, 0.8, 1, 1.25, 2, 3, 5]))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_locator(NullLocator())
        ax.axvline(1.0, color="gray", lw=0.8)
        if higher:
            ax.axvline(TARGET, color="black", ls="--", lw=1)
        ax.set_yticks(ys)
        ax.set_yticklabels([results["summary"][protos[0]][k]["label"] for k in keys], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.suptitle(f"transport authentication cost, paired (auth on vs off, same run, {results['rounds']} rounds); "
                 f"bar = median of per-round ratios, whisker = min-max over rounds; {host_label(results.get('host'))}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# ================================================================ main ==
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="rounds (every measurement on both stores per round)")
    ap.add_argument("--quick", action="store_true", help="2 rounds, fewer repetitions (smoke test)")
    ap.add_argument("--repeats", type=int, default=3, help="single-op runs per round, side and kind")
    ap.add_argument("--connect-reps", type=int, default=15, help="fresh-engine connects per round and side")
    ap.add_argument("--client-reps", type=int, default=4, help="connect() + first get per round and side")
    ap.add_argument("--protocols", default="auto,tcp")
    ap.add_argument("--segment", default="1gb", help="each store's DRAM segment")
    ap.add_argument("--out", default=str(RESULTS / "bench_auth.json"))
    ap.add_argument("--replot", metavar="JSON", help="only redraw the PNG of a results file")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), Path(args.replot).with_suffix(".png"))
        return
    if args.quick:
        args.rounds, args.repeats, args.connect_reps, args.client_reps = 2, 1, 5, 2
    names = sorted(n for _, n in socket.if_nameindex())
    if names != ["lo"]:
        sys.exit(f"run inside a private network namespace (interfaces: {names}): "
                 "make bench B=benchmarks/bench_auth.py")
    protocols = [p for p in args.protocols.split(",") if p]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    rng = np.random.default_rng(0)
    loadavg_start = Path("/proc/loadavg").read_text().strip()
    git_start = _git_state()

    import ray

    import mooncake_ray

    # A new local Ray of our own (not whatever /tmp/ray/ray_current_cluster names).
    ray.init(address="local", include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    t_start = time.perf_counter()
    stores = {}
    try:
        for proto in protocols:
            stores[proto] = {s: Side(proto, s, args.segment, rng) for s in SIDES}
            print(f"{proto}: stores up in " + ", ".join(f"{s} {stores[proto][s].up_s:.1f}s" for s in SIDES),
                  flush=True)
        rounds: dict = {p: [] for p in protocols}
        load = [os.getloadavg()[0]]
        for r in range(args.rounds):
            for proto in (protocols if r % 2 == 0 else protocols[::-1]):
                t = time.perf_counter()
                rounds[proto].append(one_round(stores[proto], r, rng, args))
                load.append(os.getloadavg()[0])
                print(f"[round {r + 1}/{args.rounds}] {proto}: {time.perf_counter() - t:.1f}s, "
                      f"load {load[-1]:.2f}", flush=True)
        client_stats = {p: {s: {"engine": stores[p][s].client.engine.stats(), "local": dict(stores[p][s].client.local_stats)}
                            for s in SIDES} for p in protocols}
    finally:
        for proto in stores:
            for s in stores[proto]:
                mooncake_ray.shutdown(namespace=stores[proto][s].ns, stop_ray=False)
        ray.shutdown()
    wall = time.perf_counter() - t_start
    loadavg_end = Path("/proc/loadavg").read_text().strip()

    summary = {p: summarize(rounds[p]) for p in protocols}
    modes = {p: latency_modes(rounds[p]) for p in protocols}
    results = {
        "description": "transport.auth on vs off: two stores per protocol side by side, paired per round",
        "host": host_info(),
        "rounds": args.rounds, "repeats": args.repeats, "connect_reps": args.connect_reps,
        "client_reps": args.client_reps, "segment": args.segment, "protocols": protocols,
        "target": f"steady-state throughput ratio on/off >= {TARGET}",
        "value_per_round": "median of the round's runs; summaries are median [min-max] over rounds",
        "git_at_start": git_start, "git_at_end": _git_state(),
        "loadavg_start": loadavg_start, "loadavg_end": loadavg_end, "load_avg_1m": load, "wall_s": wall,
        "summary": summary, "latency_modes": modes, "client_stats": client_stats, "rounds_raw": rounds,
    }
    print(f"\nhost: {host_label(results['host'], model=True)}")
    print_table(summary)
    print_modes(modes)
    print(f"\nload: start {loadavg_start} | end {loadavg_end}; wall {wall:.0f}s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
