"""The vLLM connector's worker moving Qwen3-8B-shaped KV blocks, by device path, in one run.

What is measured. ``KVTransfer`` (the connector's worker side, as vLLM drives it) saves
``--blocks`` blocks of 16 tokens into the store and loads them back into other block ids of
a second pool, in vLLM's FlashAttention GPU layout ``(2, num_blocks, 16, 8, 128)`` per
layer, 36 layers, bf16: one value of 2.25 MiB per block (K and V of every layer, 72 ranges
of 32 KiB), 576 MiB for 256 blocks. The pools are CPU tensors (this machine has no GPU) and each client moves them on
one path:

- ``host``: the memory registered with the transport as it is (what a GPU's memory gets on
  the direct path, where UCX registers it);
- ``staged``: ``device_path: staged`` forced: every block goes through the client's pinned
  staging buffer, copied by a copy thread standing in for the CUDA stream, overlapped with
  the transfers: the path a GPU KV cache takes where UCX cannot register device memory.

Per repeat, each path saves (every block new to the store) then loads (every byte checked);
the host's own memcpy rate over the same bytes is measured in the same repeat. The save
hand-off is what ``KVTransfer.save`` costs the thread that calls it (vLLM's forward thread),
against the time the save then takes on the save thread.

GPU figures (CUDA copies, direct registration, GPU to GPU) come from tests/gpu/run.sh on a
machine with a GPU.

    make bench B=benchmarks/bench_device.py ARGS="--blocks 256 --repeats 3"
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, host_info, host_label, spread  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 36, 8, 128, 16
PART = BLOCK_TOKENS * KV_HEADS * HEAD_DIM * 2  # one K or V block of one layer, bf16: 32 KiB


def pools(n_blocks: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    shape = (2, n_blocks, BLOCK_TOKENS, KV_HEADS, HEAD_DIM)
    src = [torch.randint(-30000, 30000, shape, generator=g, dtype=torch.int16).view(torch.bfloat16)
           for _ in range(LAYERS)]
    dst = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    return src, dst


def transfer(client, tensors, tag: str):
    from mooncake_ray.integrations._vllm_layout import LayerBlocks
    from mooncake_ray.integrations._vllm_worker import KVTransfer

    layers = [LayerBlocks(f"model.layers.{i}.attn", t) for i, t in enumerate(tensors)]
    return KVTransfer(client, f"bench/{tag}/", layers, layerwise=False)


def check(src, dst, src_ids, dst_ids) -> None:
    for s, d in zip(src, dst):
        if not torch_equal(s[:, src_ids], d[:, dst_ids]):
            raise AssertionError("a loaded block differs from the saved one")


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))


def run(a) -> dict:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    import mooncake_ray
    from mooncake_ray.integrations._vllm_plan import BlockRun

    ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    cfg = {"namespace": "bench_device", "segment_size_bytes": a.segment,
           "transport": {"devices": ["lo"]}, "client": {"local_buffer_size_bytes": a.staging}}
    host = mooncake_ray.start(cfg)
    staged = mooncake_ray.connect(config={**cfg, "client": {**cfg["client"], "device_path": "staged"}})
    n = a.blocks
    src, dst = pools(2 * n, a.seed)
    rng = np.random.default_rng(a.seed)
    src_ids = rng.permutation(2 * n)[:n].tolist()
    dst_ids = rng.permutation(2 * n)[:n].tolist()
    nbytes = n * LAYERS * 2 * PART
    xfer = {"host": (transfer(host, src, "h"), transfer(host, dst, "h")),
            "staged": (transfer(staged, src, "s"), transfer(staged, dst, "s"))}
    assert xfer["staged"][0].path == "staged" and xfer["host"][0].path == "host"
    flat_a = np.empty(nbytes, dtype=np.uint8)
    flat_b = np.empty(nbytes, dtype=np.uint8)
    flat_a[:] = 1
    flat_b[:] = 0
    runs = {}
    for r in range(a.repeats):
        rec = {}
        t0 = time.perf_counter()
        np.copyto(flat_b, flat_a)
        rec["memcpy_gbps"] = nbytes / (time.perf_counter() - t0) / 1e9
        for path in (("host", "staged") if r % 2 == 0 else ("staged", "host")):
            saver, loader = xfer[path]
            host.remove_all()
            for t in dst:
                t.zero_()
            hashes = [f"{path}{r}-{i:06d}" for i in range(n)]
            save_run = BlockRun("req", 0, hashes, src_ids)
            t0 = time.perf_counter()
            saver.save([save_run], sync=False)  # as vLLM's forward thread hands it over
            handoff = time.perf_counter() - t0
            saver.drain_saves()
            save_s = time.perf_counter() - t0
            assert saver.stats["save_failures"] == 0, saver.stats
            t0 = time.perf_counter()
            bad = loader._load([BlockRun("req", 0, hashes, dst_ids)])
            load_s = time.perf_counter() - t0
            assert not bad, f"{len(bad)} blocks failed to load on the {path} path"
            check(src, dst, src_ids, dst_ids)
            rec[path] = {"save_gbps": nbytes / save_s / 1e9, "load_gbps": nbytes / load_s / 1e9,
                         "save_s": save_s, "load_s": load_s, "handoff_ms": handoff * 1e3,
                         "handoff_share": handoff / save_s}
        rec["staged_over_host"] = {op: rec["staged"][f"{op}_gbps"] / rec["host"][f"{op}_gbps"]
                                   for op in ("save", "load")}
        rec["staged_over_memcpy"] = {op: rec["staged"][f"{op}_gbps"] / rec["memcpy_gbps"] for op in ("save", "load")}
        runs[r] = rec
        print(f"repeat {r}: memcpy {rec['memcpy_gbps']:.2f} GB/s | " + " | ".join(
            f"{p}: save {rec[p]['save_gbps']:.2f} load {rec[p]['load_gbps']:.2f} GB/s, hand-off "
            f"{rec[p]['handoff_ms']:.2f} ms" for p in ("host", "staged")), flush=True)
    summary = {
        "memcpy_gbps": spread(r["memcpy_gbps"] for r in runs.values()),
        **{f"{p}_{op}_gbps": spread(r[p][f"{op}_gbps"] for r in runs.values())
           for p in ("host", "staged") for op in ("save", "load")},
        **{f"staged_over_host_{op}": spread(r["staged_over_host"][op] for r in runs.values()) for op in ("save", "load")},
        **{f"staged_over_memcpy_{op}": spread(r["staged_over_memcpy"][op] for r in runs.values())
           for op in ("save", "load")},
        **{f"{p}_handoff_ms": spread(r[p]["handoff_ms"] for r in runs.values()) for p in ("host", "staged")},
        **{f"{p}_handoff_share": spread(r[p]["handoff_share"] for r in runs.values()) for p in ("host", "staged")},
    }
    out = {"host": host_info(), "params": vars(a), "bytes": nbytes, "objects": n, "ranges": n * LAYERS * 2,
           "range_bytes": PART, "device_stats": staged.device_stats, "runs": runs,
           "summary": summary}
    for x in xfer.values():
        for t in x:
            t.close()
    staged.close()
    mooncake_ray.shutdown(cfg["namespace"], stop_ray=True)
    return out


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = res["summary"]
    fig, ax = plt.subplots(figsize=(7, 4))
    labels, meds, lo, hi = [], [], [], []
    for p in ("host", "staged"):
        for op in ("save", "load"):
            v = s[f"{p}_{op}_gbps"]
            labels.append(f"{p}\n{op}")
            meds.append(v["median"])
            lo.append(v["median"] - v["min"])
            hi.append(v["max"] - v["median"])
    ax.bar(labels, meds, yerr=[lo, hi], capsize=4, color=["#4c72b0", "#4c72b0", "#dd8452", "#dd8452"])
    ax.axhline(s["memcpy_gbps"]["median"], color="k", ls="--", lw=1, label="host memcpy (same run)")
    ax.set_ylabel("GB/s (median, min-max)")
    ax.set_title(f"KVTransfer, {res['params']['blocks']} Qwen3-8B blocks ({res['bytes'] / 2**20:.0f} MiB), "
                 f"{host_label(res.get('host'))}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--segment", default="1536mb", help="the store node's arena")
    ap.add_argument("--staging", default="64mb", help="client.local_buffer_size_bytes of the staged client")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "bench_device.json"))
    a = ap.parse_args()
    res = run(a)
    Path(a.out).write_text(json.dumps(res, indent=1, default=str))
    plot(res, Path(a.out).with_suffix(".png"))
    s = res["summary"]
    print("\nhost:", host_label(res["host"], model=True))
    print("median (min-max) over", a.repeats, "repeats")
    for k, v in s.items():
        print(f"  {k:28} {v['median']:8.3f} ({v['min']:.3f}-{v['max']:.3f})")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
