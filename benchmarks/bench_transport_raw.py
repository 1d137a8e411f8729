"""The raw transport engine between two processes vs ucx_perftest on the same transport.

For each transport (shm, tcp) and size (4 KiB .. 64 MiB): ucx_perftest ucp_put_bw and
ucp_get next to the engine's write (put / memcpy) and read paths (memcpy, get, push),
plus latency: RPC round trip (C++ and Python handlers), a 4 KiB read per path, and
ucx_perftest ucp_am_lat (busy-polling, both sides) for reference. Rounds alternate
perftest and engine runs so both see the same machine noise; medians and min-max over
rounds are reported.

Run inside a network namespace:  make bench B=benchmarks/bench_transport_raw.py
    ARGS="--rounds 3 --sizes 4k,64k,1m,4m,16m,64m"
Writes benchmarks/results/transport_raw.json and transport_raw.png.

--auth on|both: engines hold a shared secret (Engine.set_auth_secret: authenticated
handshake, a session token checked on every message); "both" measures each engine series
without and with it in the same rounds (keys of the latter end in "+auth").
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from _common import RESULTS, host_info, host_label, light_import, parse_size, ucx_perftest


def _import_engine():
    # The transport alone: mooncake_ray/__init__ imports Ray, which this does not need.
    return light_import("mooncake_ray._private.transport").Engine


def fmt_size(n: int) -> str:
    for unit, v in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= v and n % v == 0:
            return f"{n // v}{unit}"
    return f"{n}B"


# ---- the server process ---------------------------------------------------------------

def serve(args) -> None:
    Engine = _import_engine()
    kw = json.loads(args.serve)
    eng = Engine(**kw["engine"])
    if kw.get("secret"):
        eng.set_auth_secret(bytes.fromhex(kw["secret"]))
    size = kw["size"]
    arena = eng.alloc_arena(size)
    user_buf = np.zeros(size, dtype=np.uint8)
    user = eng.register(user_buf)
    eng.serve_echo(100)
    eng.serve(1, lambda b: b)
    info = {
        "address": base64.b64encode(eng.address).decode(),
        "arena": [base64.b64encode(arena.rkey).decode(), arena.addr, arena.length],
        "user": [base64.b64encode(user.rkey).decode(), user.addr, user.length],
    }
    print(json.dumps(info), flush=True)
    sys.stdin.readline()  # until the client is done
    eng.close()


class Server:
    def __init__(self, engine_kw: dict, size: int, secret: bytes | None = None):
        cfg = json.dumps({"engine": engine_kw, "size": size, "secret": secret.hex() if secret else None})
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", cfg],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        info = json.loads(self.proc.stdout.readline())
        self.address = base64.b64decode(info["address"])
        self.regions = {k: (base64.b64decode(info[k][0]), info[k][1], info[k][2]) for k in ("arena", "user")}

    def close(self) -> None:
        try:
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
            self.proc.wait(20)
        except Exception:  # noqa: BLE001
            self.proc.kill()


# ---- ucx_perftest ---------------------------------------------------------------------

def perftest(tls: str, test: str, size: int, iters: int, extra: tuple = ()) -> dict:
    return ucx_perftest(tls, test, size, iters, extra)


# ---- engine measurements --------------------------------------------------------------

def bw(fn, size: int, min_bytes: int = 256 << 20, min_iters: int = 8) -> float:
    fn()  # warm
    n = max(min_iters, min_bytes // size)
    n = min(n, 20000)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return n * size / (time.perf_counter() - t) / 1e9


def lat(fn, n: int) -> tuple[float, float]:
    for _ in range(min(200, n)):
        fn()
    ts = np.empty(n)
    for i in range(n):
        t = time.perf_counter()
        fn()
        ts[i] = time.perf_counter() - t
    return float(np.percentile(ts, 50) * 1e6), float(np.percentile(ts, 99) * 1e6)


def lanes_round(protocol: str, sizes: list[int], lanes: int, ekw: dict) -> dict:
    """Bandwidth only, default paths, with the transfer striped over `lanes` workers."""
    Engine = _import_engine()
    kw = {**ekw, "num_lanes": lanes}
    srv = Server({"protocol": protocol, "devices": ["lo"], "name": "bench-server", **kw}, max(sizes))
    out: dict = {"bw": {}, "lat": {}}
    try:
        buf = np.ones(max(sizes), dtype=np.uint8)
        for mode, wmode in (("auto", "auto"), ("get", "put")):
            eng = Engine(protocol=protocol, devices=["lo"], name="bench-lanes", read_mode=mode,
                         write_mode=wmode, **kw)
            eng.register(buf)
            peer = eng.connect(srv.address)
            rr = eng.import_remote(peer, *srv.regions["arena"])
            if mode == "get" and protocol == "tcp":
                mode = "skip"  # tcp get is emulated: striping it says nothing
            addr = buf.ctypes.data
            if mode != "skip":
                out["bw"][f"read_{rr.read_path}_l{lanes}"] = {
                    fmt_size(s): bw(lambda s=s: eng.read([(rr, 0, addr, s)]), s) for s in sizes}
            if rr.write_path == "put":
                out["bw"][f"write_put_l{lanes}"] = {
                    fmt_size(s): bw(lambda s=s: eng.write([(rr, 0, addr, s)]), s) for s in sizes}
            eng.close()
    finally:
        srv.close()
    return out


def engine_round(protocol: str, sizes: list[int], server_kw: dict, client_kw: dict, lat_iters: int,
                 secret: bytes | None = None) -> dict:
    base = _import_engine()

    def Engine(**kw):  # noqa: N802 - the engine class, with the secret set when given
        e = base(**kw)
        if secret:
            e.set_auth_secret(secret)
        return e

    maxsize = max(sizes)
    srv = Server({"protocol": protocol, "devices": ["lo"], "name": "bench-server", **server_kw}, maxsize, secret)
    out: dict = {"bw": {}, "lat": {}}
    modes = ["auto", "get", "push"]
    try:
        buf = np.zeros(maxsize, dtype=np.uint8)
        buf[:] = 1
        for mode in modes:
            eng = Engine(protocol=protocol, devices=["lo"], name=f"bench-{mode}", read_mode=mode, **client_kw)
            reg = eng.register(buf)
            peer = eng.connect(srv.address)
            arena = eng.import_remote(peer, *srv.regions["arena"])
            user = eng.import_remote(peer, *srv.regions["user"])
            addr = buf.ctypes.data
            targets = {"arena": arena}
            if mode == "auto" and arena.read_path == "memcpy":
                targets["user"] = user  # not mapped: auto picks get/push for it
            for tname, rr in targets.items():
                path = rr.read_path
                key = f"read_{path}" + ("" if tname == "arena" else "_user")
                if key in out["bw"]:
                    continue
                out["bw"][key] = {fmt_size(s): bw(lambda s=s: eng.read([(rr, 0, addr, s)]), s) for s in sizes}
                out["lat"][f"{key}_4KiB"] = lat(lambda: eng.read([(rr, 0, addr, 4096)]), lat_iters)
            if mode == "auto":
                for tname, rr in (("arena", arena),):
                    key = f"write_{rr.write_path}"
                    out["bw"][key] = {fmt_size(s): bw(lambda s=s: eng.write([(rr, 0, addr, s)]), s) for s in sizes}
                    out["lat"][f"{key}_4KiB"] = lat(lambda: eng.write([(rr, 0, addr, 4096)]), lat_iters)
                out["lat"]["rpc_cpp_64B"] = lat(lambda: eng.call(peer, 100, b"x" * 64), lat_iters)
                out["lat"]["rpc_py_64B"] = lat(lambda: eng.call(peer, 1, b"x" * 64), lat_iters)
                out["lat"]["rpc_py_4KiB"] = lat(lambda: eng.call(peer, 1, b"x" * 4096), lat_iters)
            reg.close()
            eng.close()
        # forced put (for shm, where auto writes with memcpy)
        if protocol != "tcp":
            eng = Engine(protocol=protocol, devices=["lo"], name="bench-put", write_mode="put", **client_kw)
            eng.register(buf)
            peer = eng.connect(srv.address)
            arena = eng.import_remote(peer, *srv.regions["arena"])
            addr = buf.ctypes.data
            out["bw"]["write_put"] = {fmt_size(s): bw(lambda s=s: eng.write([(arena, 0, addr, s)]), s) for s in sizes}
            eng.close()
    finally:
        srv.close()
    return out


def perftest_round(tls: str, sizes: list[int], lat_iters: int) -> dict:
    """Busy-polling perftest (its best case), plus its sleep mode ("-E sleep": both sides
    wait in epoll like the engine's progress threads) for put >= 1 MiB over tcp and for
    latency (its get, and anything one-sided over sm, hangs in sleep mode: no target event)."""
    out: dict = {"bw": {"perftest_put": {}, "perftest_get": {}, "perftest_put_sleep": {}}, "lat": {}}
    for s in sizes:
        iters = max(20, min(20000, (512 << 20) // s))
        out["bw"]["perftest_put"][fmt_size(s)] = perftest(tls, "ucp_put_bw", s, iters)["gbps"]
        out["bw"]["perftest_get"][fmt_size(s)] = perftest(tls, "ucp_get", s, iters)["gbps"]
        if s >= 1 << 20 and tls == "tcp":  # sm one-sided ops raise no target event: hangs
            sl = ("-E", "sleep")
            out["bw"]["perftest_put_sleep"][fmt_size(s)] = perftest(tls, "ucp_put_bw", s, iters, sl)["gbps"]
    for k in [k for k, v in out["bw"].items() if not v]:
        del out["bw"][k]
    one_way = perftest(tls, "ucp_am_lat", 64, lat_iters * 5)["lat_us"]
    out["lat"]["perftest_am_rtt_64B"] = (2 * one_way, 2 * one_way)
    one_way = perftest(tls, "ucp_am_lat", 64, lat_iters, ("-E", "sleep"))["lat_us"]
    out["lat"]["perftest_am_rtt_64B_sleep"] = (2 * one_way, 2 * one_way)
    return out


def merge(rounds: list[dict]) -> dict:
    """Median and [min, max] per series point across rounds."""
    res: dict = {"bw": {}, "lat": {}}
    for key in rounds[0]["bw"]:
        res["bw"][key] = {}
        for size in rounds[0]["bw"][key]:
            vals = [r["bw"][key][size] for r in rounds if key in r["bw"]]
            res["bw"][key][size] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    for key in rounds[0]["lat"]:
        p50 = [r["lat"][key][0] for r in rounds if key in r["lat"]]
        p99 = [r["lat"][key][1] for r in rounds if key in r["lat"]]
        res["lat"][key] = {"p50_us": statistics.median(p50), "p50_range": [min(p50), max(p50)],
                           "p99_us": statistics.median(p99), "p99_range": [min(p99), max(p99)]}
    return res


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    protos = list(results["transports"])
    fig, axes = plt.subplots(1, len(protos), figsize=(7 * len(protos), 5), squeeze=False)
    for ax, proto in zip(axes[0], protos):
        bwres = results["transports"][proto]["bw"]
        for key, series in bwres.items():
            sizes = list(series)
            xs = [parse_size(s) for s in sizes]
            med = [series[s]["median"] for s in sizes]
            lo = [series[s]["min"] for s in sizes]
            hi = [series[s]["max"] for s in sizes]
            style = "--" if key.startswith("perftest") else "-"
            ax.plot(xs, med, style, marker="o", label=key)
            ax.fill_between(xs, lo, hi, alpha=0.15)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("transfer size (bytes)")
        ax.set_ylabel("GB/s (median, min-max band)")
        ax.set_title(f"{proto}: engine vs ucx_perftest ({host_label(results.get('host'))})")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", default="4k,64k,1m,4m,16m,64m")
    ap.add_argument("--transports", default="shm,tcp")
    ap.add_argument("--lat-iters", type=int, default=2000)
    ap.add_argument("--engine", default="{}", help="JSON engine kwargs for both sides (e.g. spin_us)")
    ap.add_argument("--lanes", default="1", help="extra lane counts to measure (sizes >= 1 MiB; the main "
                    "series use the engine default, 2 lanes); '' for none")
    ap.add_argument("--no-perftest", action="store_true")
    ap.add_argument("--out", default="transport_raw")
    ap.add_argument("--auth", choices=("off", "on", "both"), default="off",
                    help="engines with a shared secret; both: each engine series without and with")
    args = ap.parse_args()
    if args.serve:
        serve(args)
        return
    names = sorted(n for _, n in socket.if_nameindex())
    if names != ["lo"]:
        sys.exit(f"run inside a private network namespace (interfaces: {names}); see the module docstring")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    ekw = json.loads(args.engine)
    tls = {"shm": "sm", "tcp": "tcp"}
    results: dict = {"host": host_info(), "sizes": [fmt_size(s) for s in sizes], "rounds": args.rounds,
                     "engine_kwargs": ekw, "load_avg_start": os.getloadavg(), "transports": {}}
    for proto in args.transports.split(","):
        rounds = []
        for r in range(args.rounds):
            rd = {"bw": {}, "lat": {}}
            if not args.no_perftest:
                pt = perftest_round(tls[proto], sizes, args.lat_iters)
                rd["bw"].update(pt["bw"])
                rd["lat"].update(pt["lat"])
            secrets = {"off": [None], "on": [b"bench-secret-0123456789"],
                       "both": [None, b"bench-secret-0123456789"]}[args.auth]
            for secret in secrets:
                eng = engine_round(proto, sizes, ekw, ekw, args.lat_iters, secret)
                tag = "+auth" if secret and args.auth == "both" else ""
                rd["bw"].update({k + tag: v for k, v in eng["bw"].items()})
                rd["lat"].update({k + tag: v for k, v in eng["lat"].items()})
            big = [s for s in sizes if s >= 1 << 20]
            for lanes in [int(x) for x in args.lanes.split(",") if x.strip()]:
                if big:
                    rd["bw"].update(lanes_round(proto, big, lanes, ekw)["bw"])
            rounds.append(rd)
            print(f"[{proto}] round {r + 1}/{args.rounds} done (load {os.getloadavg()[0]:.2f})", flush=True)
        results["transports"][proto] = merge(rounds)
    results["load_avg_end"] = os.getloadavg()
    # Ratios at each size: engine path / perftest (put for writes, get for reads), from medians.
    for proto, res in results["transports"].items():
        ratios: dict = {}
        for key, series in res["bw"].items():
            if key.startswith("perftest"):
                continue
            ref = res["bw"].get("perftest_put" if key.startswith("write") else "perftest_get")
            if ref:
                ratios[key] = {s: round(v["median"] / ref[s]["median"], 2) for s, v in series.items()
                               if s in ref and ref[s]["median"] > 0}
        res["ratio_vs_perftest"] = ratios
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(results, indent=1))
    plot(results, RESULTS / f"{args.out}.png")
    # a compact table
    print(f"\nhost: {host_label(results['host'], model=True)}")
    for proto, res in results["transports"].items():
        print(f"\n== {proto} (GB/s, median [min-max])")
        for key, series in res["bw"].items():
            cells = "  ".join(f"{s}:{v['median']:.2f}[{v['min']:.2f}-{v['max']:.2f}]" for s, v in series.items())
            print(f"{key:18s} {cells}")
        print(f"-- {proto} ratio vs perftest (put for writes, get for reads)")
        for key, series in res.get("ratio_vs_perftest", {}).items():
            print(f"{key:18s} " + "  ".join(f"{s}:{v:.2f}" for s, v in series.items()))
        print(f"-- {proto} latency (us)")
        for key, v in res["lat"].items():
            print(f"{key:24s} p50 {v['p50_us']:.1f} [{v['p50_range'][0]:.1f}-{v['p50_range'][1]:.1f}]  "
                  f"p99 {v['p99_us']:.1f}")


if __name__ == "__main__":
    main()
