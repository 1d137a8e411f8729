"""Small values on the spill tier: packed (the default) against a file per value, in the
same run.

A store node offloads what its master evicts in batches of up to 64 (``_OFFLOAD_BATCH`` in
``store/actor.py``) and promotes what clients read back in batches. This script does the
same to a spill tier directly (no Ray, no store), for values of ``--sizes`` bytes under
keys like the benchmarks' ("bench/0000012345"):

- write: ``--count`` values in ``write_many`` calls of ``--batch``; values/s and MB/s;
- disk: bytes the directory's files take (``st_blocks``) per value, and the tier's own
  ``used_bytes`` per value;
- read: every value read back in ``read_many`` calls of ``--batch`` keys in random order,
  checked byte for byte; values/s;
- reopen: how long opening the directory again takes (the scan that rebuilds the index).

Both layouts run on the same disk, interleaved, ``--reps`` times each; medians and ranges.
The page cache is dropped (``/proc/sys/vm/drop_caches``, when writable) before each read
phase and reopen; O_DIRECT reads bypass it anyway.

    .venv/bin/python benchmarks/bench_spill_small.py [--dir D] [--sizes 256,1k,2k] [--count 100000]

Writes benchmarks/results/bench_spill_small.json and .png. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time

import numpy as np

from _common import RESULTS, host_info, host_label, light_import, parse_size, spread

SpillTier = light_import("mooncake_ray._private.store.spill").SpillTier

LAYOUTS = {"packed": True, "file per value": False}


def key_of(i: int) -> str:
    return f"bench/{i:010d}"


def disk_bytes(directory: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(directory):
        for f in files:
            total += os.stat(os.path.join(root, f)).st_blocks * 512
    return total


def drop_caches() -> None:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass


def run(directory: str, pack: bool, size: int, count: int, batch: int, seed: int) -> dict:
    shutil.rmtree(directory, ignore_errors=True)
    rng = np.random.default_rng(seed)
    arena = rng.integers(0, 256, count * size, dtype=np.uint8)  # the values, as in an arena
    base = arena.ctypes.data
    out = {"layout": "packed" if pack else "file per value", "value_bytes": size, "count": count}
    with SpillTier(directory, 1 << 40, pack_small=pack) as t:
        t0 = time.perf_counter()
        for lo in range(0, count, batch):
            items = [(key_of(i), i, base + i * size, size) for i in range(lo, min(count, lo + batch))]
            res = t.write_many(items)
            if any(r is not None for r in res):
                raise RuntimeError(f"write failed: {next(r for r in res if r is not None)!r}")
        write_s = time.perf_counter() - t0
        out["write_values_per_s"] = count / write_s
        out["write_mb_per_s"] = count * size / write_s / 1e6
        out["tier_used_bytes_per_value"] = t.used_bytes / count
        st = t.stats()
        out["files"] = st["packs"] + (st["writes"] - st["packed_objects"]) if pack else count
    os.sync()
    out["disk_bytes_per_value"] = disk_bytes(directory) / count
    drop_caches()
    t0 = time.perf_counter()
    t = SpillTier(directory, 1 << 40, pack_small=pack)
    out["reopen_s"] = time.perf_counter() - t0
    try:
        if t.num_keys != count:
            raise RuntimeError(f"reopen found {t.num_keys} of {count} values")
        order = rng.permutation(count)
        dst = np.empty(batch * size, np.uint8)
        wrong = 0
        t0 = time.perf_counter()
        for lo in range(0, count, batch):
            idx = order[lo:lo + batch]
            res = t.read_many([(key_of(int(i)), dst.ctypes.data + j * size, size) for j, i in enumerate(idx)])
            for j, (i, r) in enumerate(zip(idx, res)):
                if r != int(i) or not np.array_equal(dst[j * size:(j + 1) * size], arena[int(i) * size:(int(i) + 1) * size]):
                    wrong += 1
        read_s = time.perf_counter() - t0
        out["read_values_per_s"] = count / read_s
        out["read_wrong"] = wrong
    finally:
        t.close()
    shutil.rmtree(directory, ignore_errors=True)
    return out


METRICS = [("write_values_per_s", "write values/s", True), ("read_values_per_s", "read values/s", True),
           ("disk_bytes_per_value", "disk bytes per value", False), ("reopen_s", "reopen (scan) s", False)]


def summarize(runs: list[dict]) -> dict:
    out: dict = {}
    for size in sorted({r["value_bytes"] for r in runs}):
        out[size] = {}
        for layout in LAYOUTS:
            rs = [r for r in runs if r["value_bytes"] == size and r["layout"] == layout]
            out[size][layout] = {m: spread([r[m] for r in rs]) for m, _l, _h in METRICS + [
                ("tier_used_bytes_per_value", "", False), ("write_mb_per_s", "", True)]}
        packed, own = out[size]["packed"], out[size]["file per value"]
        out[size]["ratio packed / file per value"] = {
            m: packed[m]["median"] / own[m]["median"] for m, _l, _h in METRICS if own[m]["median"]}
    return out


def plot(summary: dict, path: str, host: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(summary)
    fig, axes = plt.subplots(1, len(METRICS), figsize=(4.2 * len(METRICS), 3.8))
    width = 0.38
    for ax, (metric, label, higher) in zip(axes, METRICS):
        for k, layout in enumerate(LAYOUTS):
            med = [summary[s][layout][metric]["median"] for s in sizes]
            lo = [m - summary[s][layout][metric]["min"] for s, m in zip(sizes, med)]
            hi = [summary[s][layout][metric]["max"] - m for s, m in zip(sizes, med)]
            ax.bar([i + (k - 0.5) * width for i in range(len(sizes))], med, width, yerr=[lo, hi], capsize=3,
                   label=layout)
        ax.set_xticks(range(len(sizes)))
        ax.set_xticklabels([f"{s} B" for s in sizes])
        ax.set_title(label + (" (higher is better)" if higher else " (lower is better)"), fontsize=9)
        if metric == "disk_bytes_per_value":
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle("Spill tier, small values: packed vs a file per value (medians, min-max bars); "
                 f"{host_label(host)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="where the spill directories go (default: a temporary one)")
    ap.add_argument("--sizes", default="256,1k,2k")
    ap.add_argument("--count", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "bench_spill_small.json"))
    a = ap.parse_args()
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    base = a.dir or tempfile.mkdtemp(prefix="spill-small-", dir="/var/tmp")
    runs = []
    try:
        for rep in range(a.reps):
            for size in sizes:
                layouts = list(LAYOUTS.items())
                for name, pack in (layouts if rep % 2 == 0 else layouts[::-1]):
                    r = run(os.path.join(base, "tier"), pack, size, a.count, a.batch, seed=rep)
                    r["repeat"] = rep
                    runs.append(r)
                    print(f"{name:>15} {size:>5} B: write {r['write_values_per_s']:>9.0f}/s, read "
                          f"{r['read_values_per_s']:>8.0f}/s, disk {r['disk_bytes_per_value']:>7.0f} B/value, "
                          f"reopen {r['reopen_s']:.2f} s, wrong {r['read_wrong']}", flush=True)
    finally:
        if not a.dir:
            shutil.rmtree(base, ignore_errors=True)
    summary = summarize(runs)
    result = {"params": vars(a), "host": {**host_info(), "platform": platform.platform()},
              "runs": runs, "summary": summary}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(summary, a.out.replace(".json", ".png"), result["host"])
    print("host:", host_label(result["host"], model=True))
    for size, s in summary.items():
        print(size, {k: round(v, 3) for k, v in s["ratio packed / file per value"].items()})


if __name__ == "__main__":
    main()
