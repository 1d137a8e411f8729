"""Where a put's CPU goes: the client, the master and the store node, per key and per GB.

On a small host every process of the store shares the same cores, so CPU a store node
spends after a put (applying the master's message about it, journaling it for its kept
arena, checksumming its bytes) is CPU the next puts do not get. This measures it.

Workload: one store node (its own Ray node, ``--segment`` of DRAM, kept arena, durable
acknowledgements: the defaults), one client (this process). For each size of
``--sizes``, ``--keys`` puts of new keys one at a time from one registered buffer
(``put_from``: the zero-copy path, into the client's put slab when the value fits half of
it), then a settle of ``--settle`` seconds for the node to finish what the puts left it,
then the keys are removed. CPU seconds (utime + stime) of the three processes are read
from ``/proc`` around puts and settle; reported per key (us) and per GB put (s), with the
put rate (GB/s, keys/s). ``--rounds`` rounds, sizes interleaved; medians and [min-max].

``--label`` names the code measured (runs of two versions of the code are compared by
running the script on each, into one ``--out`` file: runs are added under their label).
``--ab-checksum`` measures, in the same run and the same store, puts whose client takes
each value's CRC-32C in its copy (``client.checksum_in_copy``, the default; label
``<label>-crc-in-copy``) against puts whose store node reads the value back to checksum it
(``<label>-crc-by-node``), alternating in every round.

    make bench B=benchmarks/bench_put_cpu.py ARGS="--label current"

Writes benchmarks/results/bench_put_cpu.json and bench_put_cpu.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path

from _common import RESULTS, cpu_s, git_state, host_info, host_label, parse_size, role_pids, spread, store_cluster


def one_size(s, pids: dict, size: int, n: int, settle_s: float, tag: str) -> dict:
    import numpy as np

    buf = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    s.register_buffer(buf)
    keys = [f"cpu/{tag}/{size}/{i}" for i in range(n)]
    try:
        before = {role: cpu_s(pid) for role, pid in pids.items()}
        t0 = time.perf_counter()
        for k in keys:
            err = s.put_from(k, buf)
            if err is not None:
                raise RuntimeError(f"put of {k} failed: {err!r}")
        wall = time.perf_counter() - t0
        time.sleep(settle_s)
        after = {role: cpu_s(pid) for role, pid in pids.items()}
    finally:
        s.remove_prefix(f"cpu/{tag}/{size}/")
        s.unregister_buffer(buf)
    gb = n * size / 1e9
    out = {"gb_per_s": gb / wall, "keys_per_s": n / wall}
    for role in pids:
        used = after[role] - before[role]
        out[f"{role}_us_per_key"] = used / n * 1e6
        out[f"{role}_s_per_gb"] = used / gb
    return out


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(doc["runs"])
    sizes = doc["params"]["sizes"]
    roles = ("client", "master", "node")
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.2 * len(sizes), 3.8), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        width = 0.8 / max(1, len(labels))
        for j, label in enumerate(labels):
            summ = doc["runs"][label]["summary"].get(str(size), {})
            vals = [(summ.get(f"{r}_us_per_key") or {}).get("median", 0) for r in roles]
            ax.bar([i + j * width for i in range(len(roles))], vals, width, label=label)
        ax.set_xticks([i + width * (len(labels) - 1) / 2 for i in range(len(roles))], roles)
        ax.set_title(f"{size // 1024} KiB puts: CPU us per key")
        ax.legend(fontsize=7)
    fig.suptitle(f"Put CPU by process, median of rounds ({host_label(doc['host'])})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="4k,64k,4m")
    ap.add_argument("--keys", default="4k=20000,64k=4000,4m=150", help="puts per round, per size")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--settle", type=float, default=1.0, help="seconds after the puts still counted")
    ap.add_argument("--segment", default="1gb")
    ap.add_argument("--label", default="current")
    ap.add_argument("--ab-checksum", action="store_true",
                    help="each round twice: checksums taken in the client's copy, and by the node")
    ap.add_argument("--out", default=str(RESULTS / "bench_put_cpu.json"))
    ap.add_argument("--replot", action="store_true", help="only redraw the PNG of --out")
    args = ap.parse_args()
    out = Path(args.out)
    if args.replot:
        plot(json.loads(out.read_text()), out.with_suffix(".png"))
        return
    import ray  # before parse_size: the package itself, not _common's light import of it

    import mooncake_ray

    sizes = [parse_size(x) for x in args.sizes.split(",")]
    counts = {parse_size(k): int(v) for k, v in (kv.split("=") for kv in args.keys.split(","))}

    store_cluster(1)
    ns = f"cpu{uuid.uuid4().hex[:6]}"
    s = mooncake_ray.start({"namespace": ns, "segment_size_bytes": args.segment})
    pids = role_pids(ns)
    writers = [shard.writes for shard in s._shards]
    variants = {f"{args.label}-crc-in-copy": True, f"{args.label}-crc-by-node": False} if args.ab_checksum \
        else {args.label: None}
    rounds: dict[str, list] = {label: [] for label in variants}
    for r in range(args.rounds):
        for label in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            if variants[label] is not None:
                for w in writers:
                    w._checksums = variants[label]
            row = {}
            for size in (sizes if r % 2 == 0 else sizes[::-1]):
                row[str(size)] = one_size(s, pids, size, counts.get(size, 1000), args.settle, f"{r}")
                print(f"round {r} {label} {size // 1024} KiB: "
                      + ", ".join(f"{k} {v:.3g}" for k, v in row[str(size)].items()), flush=True)
            rounds[label].append(row)
    doc = json.loads(out.read_text()) if out.exists() else {}
    if doc.get("params", {}).get("sizes") not in (None, sizes):
        doc = {}
    doc.update(benchmark="bench_put_cpu", host=host_info(), params={"sizes": sizes, "keys": counts,
                                                                    "segment": args.segment, "settle_s": args.settle})
    for label, rows in rounds.items():
        summary = {str(size): {k: spread([rd[str(size)][k] for rd in rows]) for k in rows[0][str(size)]}
                   for size in sizes}
        doc.setdefault("runs", {})[label] = {"commit": git_state(), "rounds": rows, "summary": summary,
                                             "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    out.write_text(json.dumps(doc, indent=1))
    plot(doc, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    mooncake_ray.shutdown(ns)
    sys.exit(0)


if __name__ == "__main__":
    main()
