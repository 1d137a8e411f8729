"""Spill tier benchmark: offload (write-out) and promote (read-back) by object size,
against fio (io_uring, O_DIRECT) on the same directory, same block size and queue depth,
in the same run, rounds interleaved so both see the same machine noise.

    .venv/bin/python benchmarks/bench_spill.py [--dir D] [--sizes 128k,1m,4m,16m] [--reps 3]

Modes, per object size S (queue depth 32 = fio --iodepth=32, bs = S):
  stream   a set of --total bytes moved in write_many / read_many calls of 512 objects
           at queue depth 32: the queue stays full, like fio's; throughput.
  batch32  calls of exactly 32 objects (one io_uring batch each, the queue drains at the
           end of every call); throughput and per-call latency p50/p95/p99.
  single   one call per object (queue depth 1), per-call latency p50/p95/p99;
           fio: --iodepth=1, completion latency percentiles.
Writes are measured twice: "cold" (empty directory: every write creates and allocates a
file) and steady state (the free pool holds the files of evicted objects, as in a full
spill tier that keeps offloading). fio's write overwrites a laid-out file, so the steady
case is the like-for-like one. A third peer is our engine with use_uring=False (preadv /
pwritev, O_DIRECT, one I/O at a time).

Writes JSON and a PNG into benchmarks/results/. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

from _common import host_info, host_label, parse_size, spread

from mooncake_ray._private.store.spill import SpillTier, crc32c

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
HERE = os.path.dirname(os.path.abspath(__file__))


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def populated(n: int) -> tuple[mmap.mmap, np.ndarray]:
    """n bytes of page-aligned, pre-faulted memory (like a store node's arena)."""
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
    a = np.frombuffer(m, np.uint8)
    return m, a


# ---- fio ---------------------------------------------------------------------------------


def fio(path: str, rw: str, bs: int, qd: int, size: int, runtime_s: float) -> dict:
    cmd = [
        "fio", "--name=peer", f"--filename={path}", f"--size={size}", f"--bs={bs}", f"--rw={rw}",
        "--ioengine=io_uring", "--direct=1", f"--iodepth={qd}", "--time_based",
        f"--runtime={runtime_s}", "--ramp_time=0.3", "--norandommap", "--randrepeat=0",
        "--output-format=json",
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["write" if "write" in rw else "read"]
    p = side["clat_ns"].get("percentile", {})
    return {
        "gbps": side["bw_bytes"] / 1e9,
        "p50_ms": p.get("50.000000", float("nan")) / 1e6,
        "p95_ms": p.get("95.000000", float("nan")) / 1e6,
        "p99_ms": p.get("99.000000", float("nan")) / 1e6,
    }


# ---- our tier ----------------------------------------------------------------------------


class Round:
    """Measurements of one object size on one tier."""

    def __init__(self, tier: SpillTier, size: int, src: np.ndarray, dst: np.ndarray):
        self.t, self.size = tier, size
        self.src, self.dst = src.ctypes.data, dst.ctypes.data

    def write(self, keys: list[str], per_call: int) -> tuple[float, list[float]]:
        """(GB/s, per-call seconds) writing keys[i] from src slot i."""
        calls, t0 = [], time.perf_counter()
        for b in range(0, len(keys), per_call):
            items = [(k, 1, self.src + (b + i) * self.size, self.size) for i, k in enumerate(keys[b : b + per_call])]
            c0 = time.perf_counter()
            res = self.t.write_many(items)
            calls.append(time.perf_counter() - c0)
            bad = [r for r in res if r is not None]
            if bad:
                raise bad[0]
        return len(keys) * self.size / (time.perf_counter() - t0) / 1e9, calls

    def read(self, keys: list[str], per_call: int) -> tuple[float, list[float]]:
        calls, t0 = [], time.perf_counter()
        for b in range(0, len(keys), per_call):
            items = [(k, self.dst + (b + i) * self.size, self.size) for i, k in enumerate(keys[b : b + per_call])]
            c0 = time.perf_counter()
            res = self.t.read_many(items)
            calls.append(time.perf_counter() - c0)
            bad = [r for r in res if not isinstance(r, int)]
            if bad:
                raise bad[0]
        return len(keys) * self.size / (time.perf_counter() - t0) / 1e9, calls

    def single_writes(self, old: list[str], new: list[str]) -> list[float]:
        lat = []
        for i, (o, k) in enumerate(zip(old, new)):
            self.t.remove(o)  # an eviction frees a file, the next offload reuses it
            t0 = time.perf_counter()
            self.t.write(k, 2, self.src + i * self.size, self.size)
            lat.append(time.perf_counter() - t0)
        return lat

    def single_reads(self, keys: list[str]) -> list[float]:
        lat = []
        for i, k in enumerate(keys):
            t0 = time.perf_counter()
            self.t.read(k, self.dst + i * self.size, self.size)
            lat.append(time.perf_counter() - t0)
        return lat


def latencies(out: dict, name: str, lat: list[float]) -> None:
    for q in (50, 95, 99):
        out[f"{name}_p{q}_ms"] = pct(lat, q) * 1e3


def measure_tier(directory: str, size: int, total: int, src, dst, qd: int, uring: bool, singles: int) -> dict:
    shutil.rmtree(directory, ignore_errors=True)
    count = max(total // size, qd)
    keys = lambda tag, n=count: [f"{tag}/{size}/{i}" for i in range(n)]  # noqa: E731
    out: dict = {}
    with SpillTier(directory, 2 * count * (size + 8 * KiB), queue_depth=qd, use_uring=uring) as t:
        r = Round(t, size, src, dst)
        out["write_cold_gbps"], _ = r.write(keys("a"), 512)
        for k in keys("a"):
            t.remove(k)
        # The first reuse of fresh files runs slower here (ext4 / the host still settling
        # the first pass); steady state is from the second reuse on.
        out["write_reuse1_gbps"], _ = r.write(keys("b"), 512)
        for k in keys("b"):
            t.remove(k)
        out["write_gbps"], _ = r.write(keys("c"), 512)
        out["read_gbps"], _ = r.read(keys("c"), 512)
        if not np.array_equal(src[: count * size : 4099], dst[: count * size : 4099]):
            raise AssertionError("read-back differs from what was written")
        for k in keys("c"):
            t.remove(k)
        out["batch32_write_gbps"], calls = r.write(keys("d"), qd)
        latencies(out, "batch32_write", calls)
        out["batch32_read_gbps"], calls = r.read(keys("d"), qd)
        latencies(out, "batch32_read", calls)
        n = min(singles, count)
        wl = r.single_writes(keys("d", n), keys("e", n))
        rl = r.single_reads(keys("e", n))
        for name, lat in (("single_write", wl), ("single_read", rl)):
            latencies(out, name, lat)
            out[f"{name}_gbps"] = size / statistics.median(lat) / 1e9
        st = t.stats()
        out["recycled_writes"], out["created_writes"] = st["recycled_writes"], st["created_writes"]
        out["uses_uring"] = t.uses_uring
    shutil.rmtree(directory, ignore_errors=True)
    return out


def measure_fio(path: str, size: int, total: int, qd: int, runtime_s: float) -> dict:
    out = {}
    for key, rw, depth in (("write", "randwrite", qd), ("read", "randread", qd), ("single_write", "randwrite", 1), ("single_read", "randread", 1)):
        r = fio(path, rw, size, depth, total, runtime_s)
        out[f"{key}_p50_ms"], out[f"{key}_p95_ms"], out[f"{key}_p99_ms"] = r["p50_ms"], r["p95_ms"], r["p99_ms"]
        out[f"{key}_gbps"] = r["gbps"]
    return out


def checksum_speed() -> float:
    m, a = populated(256 * MiB)
    a[:] = 1
    crc32c(a.ctypes.data, a.size)
    t0 = time.perf_counter()
    for _ in range(4):
        crc32c(a.ctypes.data, a.size)
    gbps = 4 * a.size / (time.perf_counter() - t0) / 1e9
    del a
    m.close()
    return gbps


# ---- report ------------------------------------------------------------------------------

METRICS = [
    "write_cold_gbps", "write_reuse1_gbps", "write_gbps", "read_gbps",
    "batch32_write_gbps", "batch32_read_gbps",
    "batch32_write_p50_ms", "batch32_write_p95_ms", "batch32_write_p99_ms",
    "batch32_read_p50_ms", "batch32_read_p95_ms", "batch32_read_p99_ms",
    "write_p50_ms", "write_p95_ms", "write_p99_ms", "read_p50_ms", "read_p95_ms", "read_p99_ms",
    "single_write_gbps", "single_read_gbps",
    "single_write_p50_ms", "single_write_p95_ms", "single_write_p99_ms",
    "single_read_p50_ms", "single_read_p95_ms", "single_read_p99_ms",
]


def aggregate(runs: list[dict]) -> dict:
    return {m: spread([r[m] for r in runs], keep=True) for m in METRICS if all(m in r for r in runs)}


def ratios(ours: list[dict], fio_runs: list[dict]) -> dict:
    """Per metric, the median over rounds of ours/fio measured in the same round."""
    out = {}
    pairs = {"write_gbps": "write_gbps", "read_gbps": "read_gbps", "write_cold_gbps": "write_gbps",
             "write_reuse1_gbps": "write_gbps",
             "batch32_write_gbps": "write_gbps", "batch32_read_gbps": "read_gbps",
             "single_write_gbps": "single_write_gbps", "single_read_gbps": "single_read_gbps",
             "single_write_p50_ms": "single_write_p50_ms", "single_read_p50_ms": "single_read_p50_ms"}
    for m, fm in pairs.items():
        vals = [o[m] / f[fm] for o, f in zip(ours, fio_runs) if m in o and fm in f]
        if vals:
            out[m] = spread(vals, keep=True)
    return out


def plot(result: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["size"] for r in result["sizes"]]
    xs = np.arange(len(sizes))
    labels = [f"{s // MiB} MiB" if s >= MiB else f"{s // KiB} KiB" for s in sizes]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    peers = [("ours", "io_uring engine", "C0"), ("ours_sync", "engine, pread/pwrite", "C2"), ("fio", "fio io_uring", "C1")]

    def series(ax, metric, title, ylabel, extra=None):
        width = 0.8 / (len(peers) + (1 if extra else 0))
        k = 0
        for peer, name, color in peers:
            meds, lo, hi = [], [], []
            for r in result["sizes"]:
                s = r[peer].get(metric)
                if s is None:
                    meds.append(np.nan), lo.append(0), hi.append(0)
                    continue
                meds.append(s["median"]), lo.append(s["median"] - s["min"]), hi.append(s["max"] - s["median"])
            ax.bar(xs + (k - 1) * width, meds, width, yerr=[lo, hi], label=name, color=color, capsize=3)
            k += 1
        if extra:
            peer, m2, name, color = extra
            meds = [r[peer][m2]["median"] for r in result["sizes"]]
            lo = [r[peer][m2]["median"] - r[peer][m2]["min"] for r in result["sizes"]]
            hi = [r[peer][m2]["max"] - r[peer][m2]["median"] for r in result["sizes"]]
            ax.bar(xs + (k - 1) * width, meds, width, yerr=[lo, hi], label=name, color=color, capsize=3, alpha=0.6)
        ax.set_xticks(xs, labels)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)

    series(axes[0][0], "write_gbps", "offload, batches at queue depth 32 (steady state)", "GB/s",
           extra=("ours", "write_cold_gbps", "io_uring engine, cold (new files)", "C4"))
    series(axes[0][1], "read_gbps", "promote, batches at queue depth 32", "GB/s")
    series(axes[1][0], "single_write_p50_ms", "offload latency, one object (p50; bars: range)", "ms")
    series(axes[1][1], "single_read_p50_ms", "promote latency, one object (p50; bars: range)", "ms")
    axes[1][0].set_yscale("log")
    axes[1][1].set_yscale("log")
    fig.suptitle(f"mooncake-ray spill tier vs fio, {result['reps']} rounds, medians (bars: min-max); "
                 f"{host_label(result.get('host'))}, {result['dir_fs']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def print_table(result: dict) -> None:
    print(f"\nhost: {host_label(result.get('host'), model=True)}")
    print("median [min-max] over rounds; ours/fio: per-round ratio (GB/s: >1 is faster; ms: >1 is slower)")
    print(f"{'size':>8} | {'metric':<20} | {'ours':>18} | {'pread/pwrite':>18} | {'fio':>18} | ours/fio")
    for r in result["sizes"]:
        label = f"{r['size'] // KiB} KiB"
        fio_of = {"write_cold_gbps": "write_gbps", "write_reuse1_gbps": "write_gbps",
                  "batch32_write_gbps": "write_gbps", "batch32_read_gbps": "read_gbps"}
        for m in ("write_cold_gbps", "write_reuse1_gbps", "write_gbps", "read_gbps", "batch32_write_gbps", "batch32_read_gbps",
                  "single_write_p50_ms", "single_write_p99_ms", "single_read_p50_ms", "single_read_p99_ms"):
            def cell(peer, metric=m):
                s = r[peer].get(fio_of.get(metric, metric) if peer == "fio" else metric)
                return f"{s['median']:.3f} [{s['min']:.2f}-{s['max']:.2f}]" if s else "-"
            rt = r["ratio_vs_fio"].get(m)
            ratio = f"{rt['median']:.2f} [{rt['min']:.2f}-{rt['max']:.2f}]" if rt else ""
            print(f"{label:>8} | {m:<20} | {cell('ours'):>18} | {cell('ours_sync'):>18} | {cell('fio'):>18} | {ratio}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=os.path.join(HERE, ".spill-tmp"), help="working directory (on the disk under test)")
    ap.add_argument("--sizes", default="128k,1m,4m,16m")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--total", default="2g", help="bytes per round and size (our object set; fio's file)")
    ap.add_argument("--qd", type=int, default=32)
    ap.add_argument("--singles", type=int, default=100, help="objects timed one by one per round")
    ap.add_argument("--fio-runtime", type=float, default=2.0)
    ap.add_argument("--no-sync-peer", action="store_true", help="skip the pread/pwrite peer")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "spill"))
    args = ap.parse_args()
    if shutil.which("fio") is None:
        print("fio is not installed", file=sys.stderr)
        return 2

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    total = parse_size(args.total)
    os.makedirs(args.dir, exist_ok=True)
    fs = subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "-T", args.dir], capture_output=True, text=True).stdout.strip()
    if fs in ("tmpfs", "ramfs"):
        print(f"warning: {args.dir} is {fs}, not a disk", file=sys.stderr)
    src_map, src = populated(total + 16 * MiB)
    dst_map, dst = populated(total + 16 * MiB)
    src[:] = np.random.default_rng(0).integers(0, 256, src.size, dtype=np.uint8)
    result = {
        "benchmark": "spill",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "host": host_info(),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
        "dir": os.path.abspath(args.dir),
        "dir_fs": fs,
        "reps": args.reps,
        "qd": args.qd,
        "total_bytes": total,
        "crc32c_gbps": checksum_speed(),
        "load_avg_start": os.getloadavg(),
        "sizes": [],
    }
    print(f"crc32c: {result['crc32c_gbps']:.1f} GB/s (256 MiB, from DRAM)")
    fio_file = os.path.join(args.dir, "fio.dat")
    tier_dir = os.path.join(args.dir, "tier")
    try:
        subprocess.run(["fio", "--name=layout", f"--filename={fio_file}", f"--size={total}", "--bs=1m",
                        "--rw=write", "--ioengine=io_uring", "--direct=1", "--iodepth=32"],
                       check=True, capture_output=True)
        for size in sizes:
            ours, sync, peers = [], [], []
            for rep in range(args.reps):
                # alternate who goes first, so a burst of load from other tenants is not
                # always charged to the same side
                if rep % 2 == 0:
                    ours.append(measure_tier(tier_dir, size, total, src, dst, args.qd, True, args.singles))
                    peers.append(measure_fio(fio_file, size, total, args.qd, args.fio_runtime))
                else:
                    peers.append(measure_fio(fio_file, size, total, args.qd, args.fio_runtime))
                    ours.append(measure_tier(tier_dir, size, total, src, dst, args.qd, True, args.singles))
                if not args.no_sync_peer:
                    sync.append(measure_tier(tier_dir, size, total // 2, src, dst, args.qd, False, args.singles // 2))
                o, f = ours[-1], peers[-1]
                print(f"{size // KiB:6d} KiB rep {rep}: write {o['write_gbps']:.2f} (cold {o['write_cold_gbps']:.2f}) "
                      f"vs fio {f['write_gbps']:.2f} | read {o['read_gbps']:.2f} vs {f['read_gbps']:.2f} | "
                      f"1-obj read p50 {o['single_read_p50_ms']:.3f} vs {f['single_read_p50_ms']:.3f} ms, "
                      f"write p50 {o['single_write_p50_ms']:.3f} vs {f['single_write_p50_ms']:.3f} ms", flush=True)
            entry = {"size": size, "ours": aggregate(ours), "fio": aggregate(peers), "ratio_vs_fio": ratios(ours, peers),
                     "ours_raw": ours, "fio_raw": peers}
            entry["ours_sync"] = aggregate(sync) if sync else {}
            result["sizes"].append(entry)
    finally:
        shutil.rmtree(tier_dir, ignore_errors=True)
        if os.path.exists(fio_file):
            os.unlink(fio_file)
        if args.dir == os.path.join(HERE, ".spill-tmp"):
            shutil.rmtree(args.dir, ignore_errors=True)
    result["load_avg_end"] = os.getloadavg()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result, args.out + ".png")
    print_table(result)
    print(f"\nwrote {args.out}.json and {args.out}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
