"""Store throughput and latency by value size, through the public client API.

Starts an embedded Ray with one store node (same host as the client: the client-only
driver and the StoreNode actor are separate processes), then for each size measures
single puts/gets (bytes API and zero-copy into registered buffers) and batched calls.
Repeats every measurement ``--repeats`` times and reports medians and min-max ranges.

    make bench B=benchmarks/bench_store.py ARGS="--repeats 3"

Writes benchmarks/results/bench_store.json and bench_store.png.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from _common import host_info, host_label, spread

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20]


def _bytes_per_round(size: int) -> int:
    return max(size, min(256 << 20, 64 * size))


def measure(store, size: int, mode: str, rng) -> dict:
    """One round: returns ops/s, GB/s and latency percentiles for put and get."""
    n = max(8, min(2000, _bytes_per_round(size) // size))
    keys = [f"b/{mode}/{size}/{i}/{rng.integers(1 << 60)}" for i in range(n)]
    src = rng.integers(0, 256, size, dtype=np.uint8)
    dst = np.empty(size, dtype=np.uint8)
    if mode == "zc":
        src_reg = store.register_buffer(src)
        dst_reg = store.register_buffer(dst)
    out = {}
    lat = []
    t0 = time.perf_counter()
    for k in keys:
        t = time.perf_counter()
        if mode == "zc":
            store.put_from(k, src)
        else:
            store.put(k, src.tobytes() if size <= 4096 else src)
        lat.append(time.perf_counter() - t)
    dt = time.perf_counter() - t0
    out["put"] = _summary(lat, n, size, dt)
    lat = []
    t0 = time.perf_counter()
    for k in keys:
        t = time.perf_counter()
        if mode == "zc":
            store.get_into(k, dst)
        else:
            store.get(k)
        lat.append(time.perf_counter() - t)
    dt = time.perf_counter() - t0
    out["get"] = _summary(lat, n, size, dt)
    if mode == "zc":
        assert np.array_equal(src, dst)
        store.unregister_buffer(src_reg)
        store.unregister_buffer(dst_reg)
    store.remove_prefix(f"b/{mode}/{size}/", force=True)
    return out


def measure_batch(store, size: int, batch: int, rng) -> dict:
    rounds = max(2, min(50, (256 << 20) // (size * batch)))
    bufs = rng.integers(0, 256, (batch, size), dtype=np.uint8)
    outs = np.empty_like(bufs)
    store.register_buffer(bufs)
    store.register_buffer(outs)
    put_t = get_t = 0.0
    for r in range(rounds):
        keys = [f"bb/{size}/{r}/{i}" for i in range(batch)]
        t = time.perf_counter()
        res = store.batch_put_from(keys, list(bufs))
        put_t += time.perf_counter() - t
        assert all(x is None for x in res), res[:3]
        t = time.perf_counter()
        sizes = store.batch_get_into(keys, list(outs))
        get_t += time.perf_counter() - t
        assert sizes == [size] * batch
    assert np.array_equal(bufs, outs)
    store.unregister_buffer(bufs)
    store.unregister_buffer(outs)
    store.remove_prefix("bb/", force=True)
    keys_total = rounds * batch
    return {"put": {"keys_per_s": keys_total / put_t, "gb_per_s": keys_total * size / put_t / 1e9},
            "get": {"keys_per_s": keys_total / get_t, "gb_per_s": keys_total * size / get_t / 1e9}}


def _summary(lat, n, size, dt) -> dict:
    lat_us = sorted(x * 1e6 for x in lat)
    return {"ops_per_s": n / dt, "gb_per_s": n * size / dt / 1e9,
            "p50_us": lat_us[len(lat_us) // 2], "p99_us": lat_us[min(len(lat_us) - 1, int(len(lat_us) * 0.99))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--protocol", default="auto", choices=["auto", "tcp", "shm"])
    ap.add_argument("--segment", default="2gb")
    ap.add_argument("--out", default=str(RESULTS / "bench_store.json"))
    args = ap.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    import mooncake_ray

    ray.init(address="local", include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    store = mooncake_ray.start({"segment_size_bytes": args.segment,
                                "transport": {"protocol": args.protocol, "devices": ["lo"]}})
    rng = np.random.default_rng(0)
    results = {"host": host_info(), "protocol": args.protocol, "repeats": args.repeats, "single": {}, "batch": {}}
    print("host:", host_label(results["host"], model=True), flush=True)
    for mode in ("bytes", "zc"):
        for size in SIZES:
            runs = [measure(store, size, mode, rng) for _ in range(args.repeats)]
            row = {op: {m: spread([r[op][m] for r in runs]) for m in runs[0][op]} for op in ("put", "get")}
            results["single"].setdefault(mode, {})[str(size)] = row
            print(f"{mode:5} {size >> 10:>6} KiB  put {row['put']['gb_per_s']['median']:6.2f} GB/s "
                  f"{row['put']['ops_per_s']['median']:8.0f} ops/s p50 {row['put']['p50_us']['median']:7.1f} us | "
                  f"get {row['get']['gb_per_s']['median']:6.2f} GB/s {row['get']['ops_per_s']['median']:8.0f} ops/s "
                  f"p50 {row['get']['p50_us']['median']:7.1f} us", flush=True)
    for size, batch in ((4 << 10, 128), (1 << 20, 16)):
        runs = [measure_batch(store, size, batch, rng) for _ in range(args.repeats)]
        row = {op: {m: spread([r[op][m] for r in runs]) for m in runs[0][op]} for op in ("put", "get")}
        results["batch"][f"{batch}x{size}"] = row
        print(f"batch {batch} x {size >> 10} KiB: put {row['put']['keys_per_s']['median']:.0f} keys/s, "
              f"get {row['get']['keys_per_s']['median']:.0f} keys/s", flush=True)
    mooncake_ray.shutdown(stop_ray=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out}")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric, label in ((axes[0], "gb_per_s", "GB/s"), (axes[1], "p50_us", "p50 latency (us)")):
        for mode, rows in results["single"].items():
            sizes = [int(s) for s in rows]
            for op, style in (("put", "--"), ("get", "-")):
                med = [rows[str(s)][op][metric]["median"] for s in sizes]
                lo = [rows[str(s)][op][metric]["min"] for s in sizes]
                hi = [rows[str(s)][op][metric]["max"] for s in sizes]
                ax.plot(sizes, med, style, marker="o", label=f"{op} {mode}")
                ax.fill_between(sizes, lo, hi, alpha=0.15)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("value size (bytes)")
        ax.set_ylabel(label)
        if metric == "p50_us":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"mooncake-ray store, public API, client and StoreNode on one host ({results['protocol']}; "
                 f"{host_label(results.get('host'))})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
