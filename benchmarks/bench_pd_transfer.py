"""Prefill -> decode KV handoff by prompt length, in the shape of Mooncake's vLLM P/D
benchmark (``shared/reference/vllm-pd-transfer-benchmark.md``): KV bytes, transfer time,
bandwidth and its share of the transport's measured ceiling.

A prefill actor and a decode actor (separate processes) each own a page pool with
Qwen3-8B's KV geometry (36 layers x 8 KV heads x 128 x bf16 x K,V = 144 KiB per token,
pages of 16 tokens). The pages are filled with random bytes (the reference CPU model is
too slow to compute 8k-token prompts at this geometry; the handoff does not depend on the
values), then handed over two ways:

- ``store``: prefill writes its full pages into the store (``KVStore.save``), decode loads
  them into its pool (``KVStore.load``): two copies, and the pages stay in the store as L3
  for later requests. Transfer time = save + load.
- ``direct``: decode registers its pool with the transport; prefill writes its pages
  straight into decode's pages in one batched one-sided write.

The ceiling is the transport's own bandwidth for one contiguous write of the largest size
between the same two processes, measured in the same run. TTFT is measured separately,
end to end with real compute, on the small demo model (8 KiB/token), where prefill compute
and the handoff can both be timed.

    make bench B=benchmarks/bench_pd_transfer.py

Writes benchmarks/results/bench_pd_transfer.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import ray

from _common import host_info, host_label

RESULTS = Path(__file__).resolve().parent / "results"
QWEN = dict(num_layers=36, num_kv_heads=8, head_dim=128, kv_dtype="bfloat16", page_size=16)


@ray.remote(num_cpus=0)
class Side:
    def __init__(self, namespace: str, max_tokens: int):
        import mooncake_ray
        from mooncake_ray.kv import KVGeometry, KVStore, PagePool

        self.client = mooncake_ray.connect(namespace=namespace)
        g = KVGeometry(QWEN["num_layers"], QWEN["num_kv_heads"], QWEN["head_dim"], QWEN["kv_dtype"],
                       QWEN["page_size"])
        self.geometry = g
        self.pool = PagePool(g, max_tokens // g.page_size + 1)
        self.kv = KVStore(self.client, "bench/qwen3-8b-geometry", g)
        self.kv.register_pool(self.pool)
        self.region = self.client.engine.register(self.pool.tensor)  # for the direct path
        self.rng = np.random.default_rng(0)

    def fill(self, n_pages: int) -> None:
        import torch

        raw = self.pool.tensor[:n_pages].view(torch.uint8).numpy()
        raw[:] = self.rng.integers(0, 256, raw.shape, dtype=np.uint8)

    def pool_info(self) -> dict:
        return {"address": self.client.engine.address, "rkey": self.region.rkey, "base": self.region.addr,
                "length": self.region.length, "page_bytes": self.geometry.page_bytes}

    def save(self, tokens: list[int], n_pages: int) -> float:
        t = time.perf_counter()
        stored = self.kv.save(tokens, self.pool, list(range(n_pages)))
        dt = time.perf_counter() - t
        assert stored == n_pages, (stored, n_pages)
        return dt

    def load(self, tokens: list[int], n_pages: int) -> float:
        t = time.perf_counter()
        got = self.kv.load(tokens, self.pool, list(range(n_pages)))
        dt = time.perf_counter() - t
        assert got == n_pages, (got, n_pages)
        return dt

    def write_direct(self, info: dict, n_pages: int, contiguous: bool = False) -> float:
        eng = self.client.engine
        peer = eng.connect(info["address"])
        rr = eng.import_remote(peer, info["rkey"], info["base"], info["length"])
        pb = info["page_bytes"]
        base = self.pool.tensor.data_ptr()
        if contiguous:
            ops = [(rr, 0, base, n_pages * pb)]
        else:
            ops = [(rr, p * pb, base + p * pb, pb) for p in range(n_pages)]
        t = time.perf_counter()
        eng.write(ops, timeout_s=120)
        return time.perf_counter() - t

    def checksum(self, n_pages: int) -> int:
        import torch

        return int(self.pool.tensor[:n_pages].contiguous().view(torch.uint8).sum())

    def drop(self, tokens: list[int]) -> None:
        self.client.remove_prefix(self.kv.prefix, force=True)


def ttft_sweep(namespace: str, lengths: list[int], repeats: int) -> dict:
    """End-to-end TTFT with real compute on the small model: prefill engine computes and
    saves, decode engine loads and computes the tail page."""
    from mooncake_ray.serve.deployments import EngineServer

    model = dict(model_id="bench/kv8k", num_layers=8, num_kv_heads=4, head_dim=64, num_q_heads=4, hidden=256,
                 ffn=512, page_size=16, kv_dtype="bfloat16")
    store = {"enabled": True, "namespace": namespace}

    @ray.remote(num_cpus=0)
    class Eng(EngineServer):
        async def first(self, req, pre=None):
            async for ev in self.generate(req, pre):
                return ev

    pre = Eng.remote("prefill", model, {"pool_pages": 1024}, store)
    dec = Eng.remote("decode", model, {"pool_pages": 1024}, store)
    out = {}
    rng = np.random.default_rng(1)
    for n in lengths:
        runs = []
        for _ in range(repeats):
            req = {"tokens": [int(x) for x in rng.integers(1, 256, n)], "max_tokens": 1, "ignore_eos": True,
                   "request_id": f"r{n}-{len(runs)}"}
            t = time.perf_counter()
            p = ray.get(pre.prefill.remote(req))
            ev = ray.get(dec.first.remote(req, p))
            runs.append({"ttft_s": time.perf_counter() - t, "prefill_s": p["prefill_s"],
                         "decode_first_s": ev["first_s"], "loaded_tokens": ev["decode_load_tokens"]})
        out[n] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"  ttft {n:>5} tokens: {out[n]['ttft_s'] * 1e3:8.1f} ms (prefill {out[n]['prefill_s'] * 1e3:.1f} ms, "
              f"decode load+tail {out[n]['decode_first_s'] * 1e3:.1f} ms)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="128,256,512,1024,2048,4096,8192")
    ap.add_argument("--ttft-lengths", default="256,512,1024,2048")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "bench_pd_transfer.json"))
    args = ap.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import mooncake_ray

    lengths = [int(x) for x in args.lengths.split(",")]
    ray.init(address="local", include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    store = mooncake_ray.start({"segment_size_bytes": "3gb", "transport": {"devices": ["lo"]}})
    ns = store.config.namespace
    maxt = max(lengths)
    prefill, decode = Side.remote(ns, maxt), Side.remote(ns, maxt)
    info = ray.get(decode.pool_info.remote())
    n_max = maxt // QWEN["page_size"]
    ray.get([prefill.fill.remote(n_max), decode.fill.remote(n_max)])  # both pools touched: no page faults timed
    page_bytes = info["page_bytes"]
    # the transport's ceiling: one contiguous write of the largest size between the same
    # two processes (after a warm-up write), median of several
    ray.get(prefill.write_direct.remote(info, n_max, True))
    ceil = [n_max * page_bytes / ray.get(prefill.write_direct.remote(info, n_max, True))
            for _ in range(max(3, args.repeats))]
    ceiling = statistics.median(ceil)
    print(f"transport ceiling: {ceiling / 1e9:.2f} GB/s ({min(ceil) / 1e9:.2f}-{max(ceil) / 1e9:.2f})", flush=True)
    rows = []
    rng = np.random.default_rng(2)
    for n in lengths:
        pages = n // QWEN["page_size"]
        kv_bytes = pages * page_bytes
        st, di = [], []
        for r in range(args.repeats):
            tokens = [int(x) for x in rng.integers(1, 256, n)]
            s = ray.get(prefill.save.remote(tokens, pages))
            l_ = ray.get(decode.load.remote(tokens, pages))
            assert ray.get(decode.checksum.remote(pages)) == ray.get(prefill.checksum.remote(pages))
            st.append(s + l_)
            ray.get(prefill.drop.remote(tokens))
            di.append(ray.get(prefill.write_direct.remote(info, pages)))
        row = {"prompt_tokens": n, "kv_bytes": kv_bytes}
        for name, times in (("store", st), ("direct", di)):
            med = statistics.median(times)
            row[name] = {"transfer_ms": med * 1e3, "transfer_ms_range": [min(times) * 1e3, max(times) * 1e3],
                         "gb_per_s": kv_bytes / med / 1e9, "share_of_ceiling": kv_bytes / med / ceiling}
        rows.append(row)
        print(f"{n:>6} tok {kv_bytes / 2**20:8.1f} MiB | store {row['store']['transfer_ms']:8.1f} ms "
              f"{row['store']['gb_per_s']:5.2f} GB/s {row['store']['share_of_ceiling']:5.0%} | direct "
              f"{row['direct']['transfer_ms']:8.1f} ms {row['direct']['gb_per_s']:5.2f} GB/s "
              f"{row['direct']['share_of_ceiling']:5.0%}", flush=True)
    ttft = ttft_sweep(ns, [int(x) for x in args.ttft_lengths.split(",")], args.repeats)
    mooncake_ray.shutdown()
    result = {"host": host_info(), "geometry": QWEN, "bytes_per_token": 144 * 1024, "ceiling_gb_per_s": ceiling / 1e9,
              "ceiling_range_gb_per_s": [min(ceil) / 1e9, max(ceil) / 1e9], "rows": rows, "ttft_small_model": ttft,
              "targets": targets(rows)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print("host:", host_label(result["host"], model=True))
    print(json.dumps(result["targets"], indent=2))


def targets(rows) -> dict:
    out = {}
    for path in ("store", "direct"):
        big = [r[path]["share_of_ceiling"] for r in rows if r["kv_bytes"] >= 64 << 20]
        small = min(rows, key=lambda r: abs(r["kv_bytes"] - 20e6))
        out[path] = {">=64MiB min share (target 0.6)": min(big) if big else None,
                     f"~20MB share (target 0.3) at {small['kv_bytes'] / 1e6:.0f} MB": small[path]["share_of_ceiling"]}
    return out


def plot(result, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    xs = [r["kv_bytes"] / 2**20 for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in ("store", "direct"):
        a.plot(xs, [r[mode]["transfer_ms"] for r in rows], marker="o", label=mode)
        b.plot(xs, [r[mode]["share_of_ceiling"] for r in rows], marker="o", label=mode)
    a.set_xscale("log"), a.set_yscale("log"), a.set_xlabel("KV bytes (MiB)"), a.set_ylabel("transfer time (ms)")
    b.set_xscale("log"), b.set_xlabel("KV bytes (MiB)"), b.set_ylabel("share of transport ceiling")
    b.axhline(0.6, ls="--", c="gray"), b.axhline(0.3, ls=":", c="gray")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"prefill -> decode KV handoff (Qwen3-8B geometry), ceiling {result['ceiling_gb_per_s']:.1f} GB/s "
                 f"({host_label(result.get('host'))})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
