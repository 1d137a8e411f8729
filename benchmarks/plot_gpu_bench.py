"""Plots the GPU checks' bandwidth figures (``tests/gpu/test_bandwidth.py`` writes one JSON
per run on a machine with a GPU; ``tests/gpu/run.sh`` says how to run it there).

    python benchmarks/plot_gpu_bench.py OUT.png RUN.json [RUN.json ...]

One group of bars per path (load, save, staged, GPU to GPU), one bar per run, each as a
ratio to its own baseline from the same run (torch's pinned copies, host memcpy, a
device-to-device copy), with the target drawn as a line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def label(path: Path, b: dict) -> str:
    name = path.stem.removeprefix("gpu_bench_")
    if "copy_streams" not in b:  # written before the run recorded its settings
        return name
    extra = ""
    if "copy_kernel" in b:
        extra = f", copy kernel mode {b['copy_kernel']['mode']}"
    return f"{name}: copy streams {b['copy_streams']}, batched copies {b['cuda_batch_copy']}{extra}"


def main() -> None:
    out, runs = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
    data = [(p, json.loads(p.read_text())) for p in runs]
    targets = {k: t for _, b in data for k, t in b["targets"].items()}
    keys = list(targets)
    fig, ax = plt.subplots(figsize=(11, 6))
    w = 0.8 / len(data)
    for i, (p, b) in enumerate(data):
        vals = [b["ratios"].get(k, 0.0) for k in keys]
        ax.bar([x + i * w for x in range(len(keys))], vals, w, label=label(p, b))
    for x, k in enumerate(keys):
        t = targets[k]
        ax.hlines(t, x - 0.1, x + 0.9, colors="k", linestyles="dashed")
    ax.set_xticks([x + 0.4 - w / 2 for x in range(len(keys))], keys, rotation=15, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("ratio to the same run's baseline (log)")
    ax.set_title(f"GPU paths on {data[0][1].get('card')}, {data[0][1]['bytes'] >> 20} MiB in "
                 f"{data[0][1]['ranges']} ranges (dashed: target)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
