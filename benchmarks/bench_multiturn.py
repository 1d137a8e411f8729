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

``--serve-config FILE`` measures what users deploy instead: ``ray start --head``, then
``serve run FILE`` as a user runs it, and the same file with ``store.enabled: false``, each
driven over ``/v1/chat/completions`` with text turns (``--turn-chars`` characters of
question, the answer as the server returned it re-sent in the history, so the chat
template is rendered anew every turn). Each measurement runs on a Ray head of its own;
``--repeat N`` runs N store-on/store-off pairs. Reported over the rounds that began with the
engines' own page pools full, and over the last three rounds: the share of prompt tokens
cached, the share that repeated the previous turn's prompt (the most any cache can serve),
mean TTFT and input throughput as ratios to store-off, and the engines' load time per
loaded token against compute time per computed token. Targets: >= 85% of prompt tokens
cached with the store, mean TTFT <= 0.5x store-off. Writes ``bench_multiturn_serve.{json,png}``.

    make bench B=benchmarks/bench_multiturn.py ARGS="--serve-config serve_configs/aggregated.yaml --repeat 3"
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

from _common import host_info, host_label

RESULTS = Path(__file__).resolve().parent / "results"

MODEL = dict(model_id="bench/kv8k", num_layers=8, num_kv_heads=4, head_dim=64, num_q_heads=4, hidden=256,
             ffn=512, page_size=16, kv_dtype="bfloat16", max_context=8192)  # 8 KiB of KV per token


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def stream_openai(http, url, path, body):
    """POST a streaming OpenAI request; returns (TTFT, usage, generated text, latency)."""
    body = {**body, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    async with http.stream("POST", f"{url}{path}", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("error"):
                raise RuntimeError(f"stream error: {ev['error']}")
            if ev.get("usage"):
                usage = ev["usage"]
            for c in ev.get("choices", []):
                piece = c["text"] if "text" in c else (c.get("delta") or {}).get("content")
                if piece is not None and ttft is None and c.get("finish_reason") is None:
                    ttft = time.perf_counter() - t0
                text.append(piece or "")
    return ttft, usage, "".join(text), time.perf_counter() - t0


async def one_request(http, url, tokens, out_len):
    ttft, usage, _, lat = await stream_openai(http, url, "/v1/completions",
                                              {"model": MODEL["model_id"], "prompt": tokens, "max_tokens": out_len})
    return ttft, usage, lat


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


WORDS = ("cache page store prefix token layer replica engine request answer question model memory disk "
         "transfer batch round client latency throughput region arena spill master lease key value").split()


def turn_text(rng: random.Random, chars: int) -> str:
    out, n = [], 0
    while n < chars:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


async def one_chat(http, url, model_id, messages, out_len):
    return await stream_openai(http, url, "/v1/chat/completions",
                               {"model": model_id, "messages": messages, "max_tokens": out_len})


async def run_chat_workload(url, model_id, args, seed, probe, page_size=16):
    """Text conversations over /v1/chat/completions; ``probe()`` returns the engines'
    summed stats after each round."""
    import httpx

    rng = random.Random(seed)
    convs = [[{"role": "user", "content": turn_text(rng, args.turn_chars)}] for _ in range(args.num_clients)]
    rounds, before = [], await asyncio.to_thread(probe)
    prev_prompt = [0] * args.num_clients
    t_start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as http:
        for rnd in range(args.num_rounds):
            ready = list(range(args.num_clients))
            rng.shuffle(ready)
            sem = asyncio.Semaphore(args.max_parallel)
            recs = []

            async def go(c):
                async with sem:
                    ttft, usage, answer, lat = await one_chat(http, url, model_id, convs[c], args.output_length)
                # what a prefix cache can serve: the previous round's prompt, whole pages
                reusable = prev_prompt[c] // page_size * page_size
                prev_prompt[c] = usage["prompt_tokens"]
                recs.append({"client": c, "ttft": ttft, "latency": lat, "prompt": usage["prompt_tokens"],
                             "cached": usage["prompt_tokens_details"]["cached_tokens"], "reusable": reusable})
                convs[c] += [{"role": "assistant", "content": answer},
                             {"role": "user", "content": turn_text(rng, args.turn_chars)}]

            t0 = time.perf_counter()
            await asyncio.gather(*(go(c) for c in ready))
            dt = time.perf_counter() - t0
            after = await asyncio.to_thread(probe)
            delta = {k: after[k] - before.get(k, 0) for k in after}
            before = after
            prompt = sum(r["prompt"] for r in recs)
            rounds.append({"round": rnd, "mean_ttft_s": statistics.mean(r["ttft"] for r in recs),
                           "p90_ttft_s": sorted(r["ttft"] for r in recs)[int(0.9 * (len(recs) - 1))],
                           "cache_hit_rate": sum(r["cached"] for r in recs) / prompt, "prompt_tokens": prompt,
                           "reusable_tokens": sum(r["reusable"] for r in recs),
                           "input_throughput_tok_s": prompt / dt, "duration_s": dt, "engines": delta,
                           "requests": recs})
            print(f"  round {rnd}: ttft {rounds[-1]['mean_ttft_s']:.3f}s hit {rounds[-1]['cache_hit_rate']:.3f} "
                  f"(l1 {delta['cached_l1']} l3 {delta['cached_l3']} computed {delta['computed']}, "
                  f"l1 evictions {delta['l1_evictions']}, l3 errors {delta['l3_errors']} "
                  f"{ {k: v for k, v in delta.items() if k.startswith('l3_failed') and v} }) in {dt:.1f}s", flush=True)
    total = time.perf_counter() - t_start
    allr = [r for rd in rounds for r in rd["requests"]]
    return {"rounds": rounds, "mean_ttft_s": statistics.mean(r["ttft"] for r in allr),
            "cache_hit_rate": sum(r["cached"] for r in allr) / sum(r["prompt"] for r in allr),
            "input_throughput_tok_s": sum(r["prompt"] for r in allr) / total}


def serve_config_run(args) -> None:
    """Measure a shipped serve config as deployed by ``serve run``, against the same file
    with the store disabled; ``--repeat`` times, alternating. Each measurement runs in a
    process of its own (one Ray driver per process), on a Ray head of its own."""
    import subprocess
    import sys

    import yaml

    root = Path(__file__).resolve().parent.parent
    src = Path(args.serve_config).resolve()
    doc = yaml.safe_load(src.read_text())
    app = doc["applications"][0]
    work = Path(tempfile.mkdtemp(prefix="bench-multiturn-serve-"))
    off = work / f"store-off-{src.name}"
    doc["applications"][0]["args"]["store"] = {"enabled": False}
    off.write_text(yaml.safe_dump(doc))
    results = {"host": host_info(), "args": vars(args),
               "serve_config": str(src.relative_to(root) if src.is_relative_to(root) else src),
               "model": app["args"]["model"], "configs": {}, "repeats": []}
    for rep in range(args.repeat):
        one = {}
        for label, path in (("store", src), ("store_off", off)):
            print(f"repeat {rep} config {label}: serve run {path.name}", flush=True)
            part = work / f"{label}-{rep}.json"
            argv = [sys.executable, __file__, "--measure", f"{label}={path}", "--measure-out", str(part),
                    "--serve-config", str(src)] + [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                                                   if k in ("num_clients", "num_rounds", "turn_chars", "output_length",
                                                            "max_parallel", "seed", "head_cpus")]
            subprocess.run(argv, check=True, cwd=root)
            one[label] = json.loads(part.read_text())
        results["repeats"].append(one)
    results["configs"] = results["repeats"][-1]
    results["summary"] = summarize_serve(results)
    out = Path(args.out if args.out != str(RESULTS / "bench_multiturn.json") else RESULTS / "bench_multiturn_serve.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    plot(results, out.with_suffix(".png"))
    print("host:", host_label(results["host"], model=True))
    print(json.dumps(results["summary"], indent=2))


def measure_one(args) -> None:
    """One ``--measure LABEL=FILE``: a Ray head, ``serve run FILE``, the chat workload."""
    import sys

    import yaml

    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))
    from tests.integration.serve_cli import RayHead, ServeRun

    label, path = args.measure.split("=", 1)
    app = yaml.safe_load(Path(path).read_text())["applications"][0]
    a = app["args"]
    deployment = "LLM" if a.get("mode", "aggregated") == "aggregated" else "Decode"
    replicas = a.get("engines", a.get("decode", {})).get("num_replicas", 1)
    work = Path(tempfile.mkdtemp(prefix=f"bench-multiturn-{label}-"))
    # Ray reads its auth settings when imported: set them first
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(work / "ray-auth-token")})
    head = RayHead(str(work), num_cpus=args.head_cpus)
    run = None
    import ray
    from ray import serve

    try:
        ray.init(address=head.address, logging_level="WARNING", log_to_driver=False)
        run = ServeRun(head, path, str(work))
        run.wait_ready()
        handle = serve.get_deployment_handle(deployment, app["name"])

        def probe():
            seen = {}
            for _ in range(40):  # calls land on replicas at random: ask until all answered
                st = handle.stats.remote().result(timeout_s=60)
                seen[st["replica"]] = st
                if len(seen) >= replicas:
                    break
            keys = ("requests", "prompt_tokens", "cached_l1", "cached_l3", "computed", "l3_errors",
                    "l3_saved_pages", "l1_evictions", "load_s", "compute_s", "admission_waits")
            out = {k: sum(s.get(k, 0) for s in seen.values()) for k in keys}
            for st in seen.values():
                for k, v in st.get("l3_page_failures", {}).items():
                    out[f"l3_failed_{k}"] = out.get(f"l3_failed_{k}", 0) + v
            return out

        res = asyncio.run(run_chat_workload(run.url, a["model"]["model_id"], args, args.seed, probe,
                                            a["model"].get("page_size", 16)))
        if a.get("store", {}).get("enabled", True):
            st = head.run("mooncake-ray", "status", "--json", "--namespace", a["store"].get("namespace", "mooncake_ray"))
            res["store"] = json.loads(st.stdout) if st.returncode == 0 else {"error": st.stderr[-2000:]}
        res["stopped_in_s"] = run.interrupt()
        Path(args.measure_out).write_text(json.dumps(res))
    finally:
        if run is not None:
            run.close()
        ray.shutdown()
        head.stop()


def _after_overflow(pair: dict, last: int | None = None) -> dict:
    """Store on against store off, over the rounds that began with the engines' own pools
    full (the rounds after the first one in which the store-off run's engines evicted),
    or over the ``last`` rounds."""
    on, off = pair["store"]["rounds"], pair["store_off"]["rounds"]
    n = len(off)
    first = next((r["round"] for r in off if r["engines"]["l1_evictions"]), n)
    late = list(range(first + 1, n)) if last is None else list(range(max(first + 1, n - last), n))
    if not late:
        return {"rounds": []}

    def tot(rounds, key):
        return sum(rounds[i][key] for i in late)

    def ttft(rounds):
        return statistics.mean(r["ttft"] for i in late for r in rounds[i]["requests"])

    hit_on = sum(r["cached"] for i in late for r in on[i]["requests"]) / tot(on, "prompt_tokens")
    hit_off = sum(r["cached"] for i in late for r in off[i]["requests"]) / tot(off, "prompt_tokens")
    return {"rounds": late, "pools_first_evicted_in_round": first,
            "cache_hit_rate_store": hit_on, "cache_hit_rate_store_off": hit_off,
            "repeated_prefix_share": tot(on, "reusable_tokens") / tot(on, "prompt_tokens"),
            "cached_of_repeated_prefix_store": sum(r["cached"] for i in late for r in on[i]["requests"])
            / tot(on, "reusable_tokens"),
            "mean_ttft_s_store": ttft(on), "mean_ttft_s_store_off": ttft(off),
            "ttft_ratio": ttft(on) / ttft(off),
            "input_throughput_ratio": (tot(on, "prompt_tokens") / tot(on, "duration_s"))
            / (tot(off, "prompt_tokens") / tot(off, "duration_s")),
            "l3_errors_store": sum(on[i]["engines"]["l3_errors"] for i in late),
            "l3_load_s_per_token": sum(on[i]["engines"]["load_s"] for i in late)
            / max(1, sum(on[i]["engines"]["cached_l3"] for i in late)),
            "compute_s_per_token_store_off": sum(off[i]["engines"]["compute_s"] for i in late)
            / max(1, sum(off[i]["engines"]["computed"] for i in late))}


def summarize_serve(results) -> dict:
    per = [_after_overflow(pair) for pair in results["repeats"]]
    tail = [_after_overflow(pair, last=3) for pair in results["repeats"]]
    out = {"after_pools_overflow": per, "last_3_rounds": tail}
    keys = ("cache_hit_rate_store", "cache_hit_rate_store_off", "repeated_prefix_share",
            "cached_of_repeated_prefix_store", "ttft_ratio", "input_throughput_ratio")
    if all(p.get("rounds") for p in per + tail):
        for name, rows in (("", per), ("last_3_rounds_", tail)):
            out[name + "median"] = {k: statistics.median(p[k] for p in rows) for k in keys}
            out[name + "range"] = {k: [min(p[k] for p in rows), max(p[k] for p in rows)] for k in keys}
        m, t = out["median"], out["last_3_rounds_median"]
        # the cached share can reach at most the repeated share (each turn's new text is
        # computed), reported as repeated_prefix_share: below 0.85 in early rounds
        out["targets"] = {"cache_hit_rate_store>=0.85 (last 3 rounds)": t["cache_hit_rate_store"] >= 0.85,
                          "cache_hit_rate_store>=0.85 (all rounds after overflow)": m["cache_hit_rate_store"] >= 0.85,
                          "ttft_store/store_off<=0.5": m["ttft_ratio"] <= 0.5}
    return out


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
    ap.add_argument("--serve-config", help="measure this serve config deployed with serve run (see above)")
    ap.add_argument("--turn-chars", type=int, default=2000, help="--serve-config: characters per question")
    ap.add_argument("--head-cpus", type=int, default=4, help="--serve-config: ray start --head --num-cpus")
    ap.add_argument("--repeat", type=int, default=1, help="--serve-config: store on/off pairs to run")
    ap.add_argument("--measure", help=argparse.SUPPRESS)  # LABEL=FILE: one measurement (a child process)
    ap.add_argument("--measure-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if args.serve_config:
        if args.output_length == 1:
            args.output_length = 32
        if args.max_parallel == 4:
            args.max_parallel = 2
        return measure_one(args) if args.measure else serve_config_run(args)
    import ray
    from ray import serve

    from mooncake_ray._private import deploy as store_deploy

    ray.init(address="local", include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    port = _port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    url = f"http://127.0.0.1:{port}"
    results = {"host": host_info(), "args": vars(args), "model": MODEL, "configs": {}}
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
    print("host:", host_label(results["host"], model=True))
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
    labels = {"engine": "engine only (L1)", "dram": "+ store DRAM", "spill": "+ store DRAM + spill",
              "store": "store on", "store_off": "store off"}
    runs = results.get("repeats") or [results["configs"]]  # --serve-config: every repeat
    for k, configs in enumerate(runs):
        for c, (mode, r) in enumerate(configs.items()):
            xs = [x["round"] for x in r["rounds"]]
            style = dict(marker="o", color=f"C{c}", alpha=1.0 if len(runs) == 1 else 0.6,
                         label=labels.get(mode, mode) + (f" ({len(runs)} runs)" if len(runs) > 1 else "")
                         if k == 0 else None)
            a.plot(xs, [x["mean_ttft_s"] for x in r["rounds"]], **style)
            b.plot(xs, [x["cache_hit_rate"] for x in r["rounds"]], **style)
    a.set_xlabel("round"), a.set_ylabel("mean TTFT (s)"), a.grid(alpha=0.3), a.legend()
    b.set_xlabel("round"), b.set_ylabel("cache hit rate"), b.set_ylim(0, 1.05), b.grid(alpha=0.3), b.legend()
    fig.suptitle(f"multi-turn chat: TTFT and cache hit rate per round ({host_label(results.get('host'))})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
