"""The shipped Ray Serve LLM configs (serve_configs/vllm-aggregated.yaml and
vllm-disaggregated.yaml) serving real vLLM engines (CPU) with the mooncake-ray KV
connector, deployed as a user does: ``ray start --head``, ``serve run <file>``, OpenAI
requests over HTTP, Ctrl-C, ``mooncake-ray stop``.

The aggregated app (one engine, kv_both) and the prefill/decode app (kv_producer ->
kv_consumer) are run one after the other, each with a store its engines deploy themselves
(``deploy_store``, removed by ``mooncake-ray stop`` in between), and both serve the same
two-turn chat (greedy). The P/D app must answer exactly as the aggregated one, report
cached tokens on turn 2, and its decode engine must have read the prefill's KV from the
prefill engine's memory.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from tests.integration.serve_cli import CONFIGS, RayHead, ServeRun

# two vLLM apps start one after the other (engine start-up 20-70 s each here)
pytestmark = pytest.mark.timeout(900)

MODEL_ID = "tiny-llama"
# Logical CPUs for Serve LLM: a {CPU: 2} placement group per engine replica, {CPU: 1} for
# the ingress (P/D: 5), as the configs' comments tell users.
HEAD_CPUS = 8
TURN1 = 100  # words (= tokens) of the first user message: three full 32-token blocks
TURN2 = 40
MAX_TOKENS = 16
STOP_LIMIT_S = 30.0


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    h = RayHead(str(tmp_path_factory.mktemp("vllm-head")), num_cpus=HEAD_CPUS)
    yield h
    h.stop()


def chat(url: str, messages: list) -> tuple[str, dict]:
    body = {"model": MODEL_ID, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["message"]["content"], out["usage"]


def master_stats(head) -> dict:
    r = head.run("mooncake-ray", "status", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def run_conversation(url: str, head) -> dict:
    """Two turns of a chat; the store's stats after each."""
    from mooncake_ray.integrations.tiny_model import words

    messages = [{"role": "user", "content": words(range(TURN1))}]
    t = time.monotonic()
    text1, usage1 = chat(url, messages)
    ttft1 = time.monotonic() - t
    stats1 = master_stats(head)
    messages += [{"role": "assistant", "content": text1},
                 {"role": "user", "content": words(range(500, 500 + TURN2))}]
    t = time.monotonic()
    text2, usage2 = chat(url, messages)
    ttft2 = time.monotonic() - t
    stats2 = master_stats(head)
    return {"texts": [text1, text2], "usage": [usage1, usage2], "stats": [stats1, stats2],
            "seconds": [ttft1, ttft2]}


def deploy_and_chat(head, config: str, tmp: str) -> dict:
    t = time.monotonic()
    s = ServeRun(head, os.path.join(CONFIGS, config), tmp)
    try:
        models = s.wait_ready("/v1/models", timeout_s=600)
        assert MODEL_ID in [m["id"] for m in models["data"]], models
        ready_s = time.monotonic() - t
        out = run_conversation(s.url, head)
        out["ready_s"] = ready_s
        out["stopped_in"] = s.interrupt()
        out["returncode"], out["stop_output"] = s.proc.returncode, s.stop_output
        print(f"\n{config}: ready in {ready_s:.0f} s, turns {out['seconds']} s, usage {out['usage']}, "
              f"texts {out['texts']}, store hits/keys {[(st['hits'], st['keys']) for st in out['stats']]}, "
              f"stopped in {out['stopped_in']:.1f} s")
        return out
    finally:
        s.close()
        head.run("mooncake-ray", "stop")


@pytest.fixture(scope="module")
def aggregated(head, tmp_path_factory):
    return deploy_and_chat(head, "vllm-aggregated.yaml", str(tmp_path_factory.mktemp("vllm-agg")))


@pytest.fixture(scope="module")
def disaggregated(head, tmp_path_factory, aggregated):  # after the aggregated app is gone
    return deploy_and_chat(head, "vllm-disaggregated.yaml", str(tmp_path_factory.mktemp("vllm-pd")))


def cached(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def test_serve_run_stops_on_ctrl_c(aggregated, disaggregated):
    for run in (aggregated, disaggregated):
        assert run["returncode"] == 0 and run["stopped_in"] < STOP_LIMIT_S, run["stop_output"]


def test_aggregated_chat_reuses_turn_one(aggregated):
    u1, u2 = aggregated["usage"]
    assert u1["prompt_tokens"] >= TURN1 and u1["completion_tokens"] > 0
    assert cached(u2) >= 96, u2  # turn 1's three full blocks, at least


def test_pd_answers_as_aggregated(aggregated, disaggregated):
    assert disaggregated["texts"] == aggregated["texts"]
    assert [u["prompt_tokens"] for u in disaggregated["usage"]] == \
        [u["prompt_tokens"] for u in aggregated["usage"]]
    assert [u["completion_tokens"] for u in disaggregated["usage"]] == \
        [u["completion_tokens"] for u in aggregated["usage"]]
    assert cached(disaggregated["usage"][1]) > 0, disaggregated["usage"][1]


def test_pd_decode_read_the_prefill_engines_kv(aggregated, disaggregated):
    s1, s2 = disaggregated["stats"]
    # The decode engine's own prefix cache was empty on turn 1 (the aggregated app reports
    # none there), so the tokens it reports cached were handed over by the prefill engine.
    assert cached(disaggregated["usage"][0]) > 0, disaggregated["usage"][0]
    assert cached(aggregated["usage"][0]) == 0, aggregated["usage"][0]
    # The prefill engine also saved turn 1's full blocks in the store (the fallback), one
    # value a block ...
    assert s1["keys"] >= cached(disaggregated["usage"][0]) // 32, s1
    # ... but the decode engine read them straight from the prefill engine's memory (Ray's
    # P/D app asks the prefill for a remote decode): the store served it one get, the
    # prefill engine's transport descriptor, and none of the blocks' objects.
    assert s1["hits"] == 1, s1
    # turn 2: prefill stored the new blocks (turn 1's reply, turn 2's message)
    assert s2["keys"] > s1["keys"], (s1, s2)
