"""Ray Serve LLM serving real vLLM engines (CPU) with the mooncake-ray KV connector, over
HTTP (OpenAI API), on the test Ray cluster.

The aggregated app (one engine, kv_both) and the prefill/decode app (kv_producer ->
kv_consumer) are deployed one after the other, each with a store of its own that its
engines deploy themselves (``deploy_store``), and both serve the same two-turn chat
(greedy). The P/D app must answer exactly as the aggregated one, report cached tokens on
turn 2, and its decode engine must have read the prefill's KV from the store.
"""

from __future__ import annotations

import socket
import time
import uuid

import httpx
import pytest

from tests.conftest import store_config

# two vLLM apps start one after the other (engine start-up 20-70 s each here)
pytestmark = pytest.mark.timeout(600)

MODEL_ID = "tiny-llama"
# Logical CPUs for Serve LLM: a {CPU: 2} placement group per engine replica, {CPU: 1} for
# the ingress (P/D: 5). Added as a node of the session cluster (one ray.init per process).
SERVE_NODE_CPUS = 6
TURN1 = 100  # words (= tokens) of the first user message: three full 32-token blocks
TURN2 = 40
MAX_TOKENS = 16


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_transfer_config(role: str, namespace: str) -> dict:
    return {
        "kv_connector": "MooncakeRayConnector",
        "kv_connector_module_path": "mooncake_ray.integrations.vllm",
        "kv_role": role,
        "kv_connector_extra_config": {
            # the engines deploy the store themselves (the backend's setup); its namespace
            # becomes the connector's
            "deploy_store": store_config(namespace=namespace, segment_size_bytes="128mb"),
        },
    }


def llm_config(model_dir: str, role: str, namespace: str) -> dict:
    return {
        "model_loading_config": {"model_id": MODEL_ID, "model_source": model_dir},
        "accelerator_config": {"kind": "cpu"},
        "deployment_config": {"num_replicas": 1},
        "runtime_env": {"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
        "engine_kwargs": {
            "block_size": 32, "max_model_len": 1024, "max_num_seqs": 4, "enforce_eager": True,
            "dtype": "bfloat16", "enable_prefix_caching": True,
            "enable_prompt_tokens_details": True,
            "kv_transfer_config": kv_transfer_config(role, namespace),
        },
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def serve_url(ray_cluster):
    from ray import serve

    node = ray_cluster.add_node(num_cpus=SERVE_NODE_CPUS)
    ray_cluster.wait_for_nodes()
    port = _port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray_cluster.remove_node(node)


def chat(url: str, messages: list) -> tuple[str, dict]:
    body = {"model": MODEL_ID, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["message"]["content"], out["usage"]


def master_stats(namespace: str) -> dict:
    import ray
    from mooncake_ray._private import deploy

    return ray.get(deploy.find_master(namespace).stats.remote(), timeout=30)


def run_conversation(url: str, namespace: str) -> dict:
    """Two turns of a chat; the store's stats after each."""
    from mooncake_ray.integrations.tiny_model import words

    messages = [{"role": "user", "content": words(range(TURN1))}]
    t = time.monotonic()
    text1, usage1 = chat(url, messages)
    ttft1 = time.monotonic() - t
    stats1 = master_stats(namespace)
    messages += [{"role": "assistant", "content": text1},
                 {"role": "user", "content": words(range(500, 500 + TURN2))}]
    t = time.monotonic()
    text2, usage2 = chat(url, messages)
    ttft2 = time.monotonic() - t
    stats2 = master_stats(namespace)
    return {"texts": [text1, text2], "usage": [usage1, usage2], "stats": [stats1, stats2],
            "seconds": [ttft1, ttft2]}


def deploy_and_chat(url: str, builder, args: dict, namespace: str) -> dict:
    from ray import serve

    from mooncake_ray._private import deploy

    name = f"vllm-{uuid.uuid4().hex[:6]}"
    t = time.monotonic()
    try:
        serve.run(builder(args), name=name, route_prefix="/")
        ready_s = time.monotonic() - t
        out = run_conversation(url, namespace)
        out["ready_s"] = ready_s
        print(f"\n{builder.__name__}: ready in {ready_s:.0f} s, turns {out['seconds']} s, "
              f"usage {out['usage']}, texts {out['texts']}, store hits/keys "
              f"{[(st['hits'], st['keys']) for st in out['stats']]}")
        return out
    finally:
        serve.delete(name)
        deploy.teardown(namespace)


@pytest.fixture(scope="module")
def aggregated(serve_url, model_dir):
    from mooncake_ray.integrations.ray_serve_llm import build_app

    ns = f"agg{uuid.uuid4().hex[:8]}"
    args = {"tiny_model": {"out_dir": model_dir, "layers": 2},
            "llm_configs": [llm_config(model_dir, "kv_both", ns)]}
    return deploy_and_chat(serve_url, build_app, args, ns)


@pytest.fixture(scope="module")
def disaggregated(serve_url, model_dir, aggregated):  # after the aggregated app is gone
    from mooncake_ray.integrations.ray_serve_llm import build_pd_app

    ns = f"pd{uuid.uuid4().hex[:8]}"
    args = {"tiny_model": {"out_dir": model_dir, "layers": 2},
            "prefill_config": llm_config(model_dir, "kv_producer", ns),
            "decode_config": llm_config(model_dir, "kv_consumer", ns)}
    return deploy_and_chat(serve_url, build_pd_app, args, ns)


def cached(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


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
    # The prefill engine also saved turn 1's full blocks in the store (the fallback) ...
    assert s1["keys"] >= 2 * (cached(disaggregated["usage"][0]) // 32), s1
    # ... but the decode engine read them straight from the prefill engine's memory (Ray's
    # P/D app asks the prefill for a remote decode): the store served it one get, the
    # prefill engine's transport descriptor, and none of the blocks' objects.
    assert s1["hits"] == 1, s1
    # turn 2: prefill stored the new blocks (turn 1's reply, turn 2's message)
    assert s2["keys"] > s1["keys"], (s1, s2)
