"""Multi-turn chat against the OpenAI endpoint, in the shape of SGLang's
``benchmark/hicache/bench_multiturn.py``: ``--num-clients`` conversations, each round
appending the previous answer and a new question to the history; at most
``--max-parallel`` requests in flight, sent at ``--request-rate`` (Poisson), picked from
the ready queue at random; a barrier between rounds. Per round: mean TTFT, cache hit
rate (cached / prompt tokens) and input throughput.

Three configurations in one run, the engine's own pool (L1) small as a GPU's would be:

- ``engine``: the engine alone (L1 only);
- ``dram``:   + the store's DRAM pool, sized to run out mid-run;
- ``spill``:  + the store's DRAM pool and an NVMe spill tier.

    make bench B=benchmarks/bench_multiturn.py ARGS="--num-clients 12 --num-rounds 8"

Writes benchmarks/results/bench_multiturn.{json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import tempfile
import time
import uuid
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

MODEL = dict(model_id="bench/kv8k", num_layers=8, num_kv_heads=4, head_dim=64, num_q_heads=4, hidden=256,
             ffn=512, page_size=16, kv_dtype="bfloat16", max_context=8192)  # 8 KiB of KV per token


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one_request(http, url, tokens, out_len):
    body = {"model": MODEL["model_id"], "prompt": tokens, "max_tokens": out_len, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, out, usage = None, [], None
    async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            for c in ev.get("choices", []):
                if c.get("text") is not None and ttft is None and c.get("finish_reason") is None:
                    ttft = time.perf_counter() - t0
                out.append(c.get("text", ""))
    return ttft, usage, time.perf_counter() - t0


async def run_workload(url, args, seed, probe=None):
    import httpx

    rng = random.Random(seed)
    histories = [[rng.randrange(1, 256) for _ in range(args.request_length)] for _ in range(args.num_clients)]
    rounds = []
    t_start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as http:
        for rnd in range(args.num_rounds):
            ready = list(range(args.num_clients))
            if args.ready_queue_policy == "random":
                rng.shuffle(ready)
            sem = asyncio.Semaphore(args.max_parallel)
            recs = []

            async def go(c):
                async with sem:
                    ttft, usage, lat = await one_request(http, url, histories[c], args.output_length)
                recs.append({"client": c, "ttft": ttft, "latency": lat, "prompt": usage["prompt_tokens"],
                             "cached": usage["prompt_tokens_details"]["cached_tokens"]})
                # the answer (output_length tokens) and the next question join the history
                histories[c] += [rng.randrange(1, 256) for _ in range(args.output_length + args.sub_question_length)]

            t0 = time.perf_counter()
            tasks = []
            for c in ready:
                tasks.append(asyncio.create_task(go(c)))
                await asyncio.sleep(rng.expovariate(args.request_rate))
            await asyncio.gather(*tasks)
            dt = time.perf_counter() - t0
            prompt = sum(r["prompt"] for r in recs)
            rounds.append({"round": rnd, "mean_ttft_s": statistics.mean(r["ttft"] for r in recs),
                           "p90_ttft_s": sorted(r["ttft"] for r in recs)[int(0.9 * (len(recs) - 1))],
                           "cache_hit_rate": sum(r["cached"] for r in recs) / prompt,
                           "prompt_tokens": prompt, "input_throughput_tok_s": prompt / dt, "duration_s": dt,
                           "evictions_so_far": probe() if probe else None, "requests": recs})
            print(f"  round {rnd}: ttft {rounds[-1]['mean_ttft_s']:.3f}s hit {rounds[-1]['cache_hit_rate']:.2f} "
                  f"in {dt:.1f}s", flush=True)
            await asyncio.sleep(args.barrier_s)
    total = time.perf_counter() - t_start - args.barrier_s * args.num_rounds
    allr = [r for rd in rounds for r in rd["requests"]]
    return {"rounds": rounds, "mean_ttft_s": statistics.mean(r["ttft"] for r in allr),
            "cache_hit_rate": sum(r["cached"] for r in allr) / sum(r["prompt"] for r in allr),
            "input_throughput_tok_s": sum(r["prompt"] for r in allr) / total}


def deploy(mode, args, port):
    from ray import serve

    from mooncake_ray.serve import build_app

    ns = f"bench{uuid.uuid4().hex[:8]}"
    store = {"enabled": False}
    if mode != "engine":
        cfg = {"segment_size_bytes": args.dram, "transport": {"devices": ["lo"]}}
        if mode == "spill":
            cfg["spill"] = {"enabled": True, "directory": tempfile.mkdtemp(dir=args.spill_dir),
                            "capacity_bytes": args.spill}
        store = {"enabled": True, "namespace": ns, "config": cfg, "retry_timeout_s": 2.0,
                 "backpressure_timeout_s": 10.0}
    app = build_app({"mode": "aggregated", "model": MODEL, "store": store,
                     "engines": {"num_replicas": 1, "engine": {"pool_pages": args.l1_pages, "threads": args.threads},
                                 "max_ongoing_requests": 64}})
    name = f"mt-{mode}"
    serve.run(app, name=name, route_prefix="/")
    return name, ns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-clients", type=int, default=12)
    ap.add_argument("--num-rounds", type=int, default=10)
    ap.add_argument("--request-length", type=int, default=384)
    ap.add_argument("--sub-question-length", type=int, default=64)
    ap.add_argument("--output-length", type=int, default=1)
    ap.add_argument("--max-parallel", type=int, default=4)
    ap.add_argument("--request-rate", type=float, default=16.0)
    ap.add_argument("--ready-queue-policy", choices=["random", "fifo"], default="random")
    ap.add_argument("--barrier-s", type=float, default=1.0)
    ap.add_argument("--l1-pages", type=int, default=160, help="engine pool pages (x16 tokens)")
    ap.add_argument("--dram", default="64mb", help="store DRAM pool (sized to run out mid-run)")
    ap.add_argument("--spill", default="1gb")
    ap.add_argument("--spill-dir", default=str(Path(__file__).resolve().parent.parent / "build"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--configs", default="engine,dram,spill")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "bench_multiturn.json"))
    args = ap.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from mooncake_ray._private import deploy as store_deploy

    ray.init(address="local", include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    port = _port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    url = f"http://127.0.0.1:{port}"
    results = {"args": vars(args), "model": MODEL, "configs": {}}
    for mode in args.configs.split(","):
        print(f"config {mode}", flush=True)
        name, ns = deploy(mode, args, port)
        probe = None
        if mode != "engine":
            master = store_deploy.find_master(ns)

            def probe():
                return ray.get(master.stats.remote())["evictions"]
        res = asyncio.run(run_workload(url, args, args.seed, probe))
        if mode != "engine":
            st = ray.get(store_deploy.find_master(ns).stats.remote())
            res["store"] = {k: st[k] for k in ("capacity", "used", "keys", "evictions", "offloads", "promotions",
                                               "disk_used", "hits", "misses")}
        results["configs"][mode] = res
        serve.delete(name)
        if mode != "engine":
            store_deploy.teardown(ns)
    results["summary"] = summarize(results)
    serve.shutdown()
    ray.shutdown()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    plot(results, out.with_suffix(".png"))
    print(json.dumps(results["summary"], indent=2))


def summarize(results) -> dict:
    c = results["configs"]
    out = {m: {"mean_ttft_s": r["mean_ttft_s"], "cache_hit_rate": r["cache_hit_rate"],
               "input_throughput_tok_s": r["input_throughput_tok_s"]} for m, r in c.items()}
    if {"engine", "dram", "spill"} <= set(c):
        # "after DRAM runs out": the rounds after the first one that evicted from the
        # DRAM-only pool (its evictions hurt the next round's reads)
        dram_rounds = c["dram"]["rounds"]
        n = len(dram_rounds)
        first = next((r["round"] for r in dram_rounds if r["evictions_so_far"]), n - 1)
        late = range(min(first + 1, n - 1), n)
        out["after_dram_full"] = {
            "rounds": list(late),
            "spill_hit_rate": statistics.mean(c["spill"]["rounds"][i]["cache_hit_rate"] for i in late),
            "dram_hit_rate": statistics.mean(dram_rounds[i]["cache_hit_rate"] for i in late),
        }
        out["targets"] = {
            "spill_hit_rate_after_dram_full>=0.8": out["after_dram_full"]["spill_hit_rate"] >= 0.8,
            "dram_only_hit_rate_after_dram_full<0.5": out["after_dram_full"]["dram_hit_rate"] < 0.5,
            "ttft_spill/engine<=0.5": c["spill"]["mean_ttft_s"] / c["engine"]["mean_ttft_s"],
            "throughput_spill/engine>=2": c["spill"]["input_throughput_tok_s"] / c["engine"]["input_throughput_tok_s"],
        }
    return out


def plot(results, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    labels = {"engine": "engine only (L1)", "dram": "+ store DRAM", "spill": "+ store DRAM + spill"}
    for mode, r in results["configs"].items():
        xs = [x["round"] for x in r["rounds"]]
        a.plot(xs, [x["mean_ttft_s"] for x in r["rounds"]], marker="o", label=labels.get(mode, mode))
        b.plot(xs, [x["cache_hit_rate"] for x in r["rounds"]], marker="o", label=labels.get(mode, mode))
    a.set_xlabel("round"), a.set_ylabel("mean TTFT (s)"), a.grid(alpha=0.3), a.legend()
    b.set_xlabel("round"), b.set_ylabel("cache hit rate"), b.set_ylim(0, 1.05), b.grid(alpha=0.3), b.legend()
    fig.suptitle("multi-turn chat: TTFT and cache hit rate per round")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
