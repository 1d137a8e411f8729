"""The OpenAI-compatible app on Ray Serve, disaggregated over the store, on a real
3-node Ray cluster, driven over HTTP."""

import json
import socket
import uuid

import httpx
import pytest
import ray
from ray import serve

import mooncake_ray
from mooncake_ray.engines.engine import InferenceEngine
from mooncake_ray.engines.model import ByteTokenizer, ModelConfig
from mooncake_ray.serve import build_app
from mooncake_ray._private import deploy
from mooncake_ray._private.naming import MASTER_NAME
from tests.conftest import store_config, wait_for

MODEL = dict(model_id="test/tiny", num_layers=2, num_kv_heads=2, head_dim=16, num_q_heads=4, hidden=64,
             ffn=128, page_size=8, kv_dtype="bfloat16", max_context=2048)


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=["store", "direct"])
def app(ray_cluster, request):
    cfg = store_config()
    ns = cfg.pop("namespace")
    port = _port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    args = {"mode": "disaggregated", "model": MODEL, "handoff": request.param, "transport": {"devices": ["lo"]},
            "store": {"enabled": True, "namespace": ns, "config": cfg, "retry_timeout_s": 1.0},
            "prefill": {"num_replicas": 2, "engine": {"pool_pages": 256}},
            "decode": {"num_replicas": 1, "engine": {"pool_pages": 256}}}
    name = f"llm-{uuid.uuid4().hex[:6]}"
    serve.run(build_app(args), name=name, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, timeout_s=120, what="serve")
    yield url, ns, name, request.param
    serve.delete(name)
    serve.shutdown()
    deploy.teardown(ns)


def chat(url, messages, stream=False, max_tokens=8):
    body = {"model": "test/tiny", "messages": messages, "max_tokens": max_tokens, "stream": stream,
            "stream_options": {"include_usage": True}}
    if not stream:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        return out["choices"][0]["message"]["content"], out["usage"]
    text, usage = [], None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            for c in ev["choices"]:
                text.append(c["delta"].get("content", ""))
    return "".join(text), usage


def expected(messages, max_tokens=8):
    eng = InferenceEngine(ModelConfig(**MODEL), pool_pages=256)
    toks = [s.token for s in eng.generate(ByteTokenizer().chat(messages), max_tokens)]
    return ByteTokenizer().decode(toks)


def test_models_endpoint(app):
    url = app[0]
    r = httpx.get(f"{url}/v1/models", timeout=30)
    assert r.json()["data"][0]["id"] == "test/tiny"


def test_multi_turn_cached_tokens_rise_and_output_is_exact(app):
    url = app[0]
    msgs = [{"role": "user", "content": "Tell me about KV caches and why prefill is expensive. " * 4}]
    text1, u1 = chat(url, msgs)
    assert text1 == expected(msgs)  # prefill->decode handoff through the store is exact
    msgs += [{"role": "assistant", "content": text1}, {"role": "user", "content": "And decode?"}]
    text2, u2 = chat(url, msgs, stream=True)
    assert text2 == expected(msgs)
    assert u1["prompt_tokens_details"]["cached_tokens"] == 0
    assert u2["prompt_tokens_details"]["cached_tokens"] >= u1["prompt_tokens"] // 8 * 8 - 8
    assert u2["prompt_tokens"] > u1["prompt_tokens"]
    decode = serve.get_deployment_handle("Decode", app_name=app[2]).stats.remote().result()
    assert decode["handoff"] == app[3] and decode["mismatches"] == 0
    assert decode["cached_l3"] > 0  # the prompt's pages came from prefill, not recomputed


def test_a_conversation_hint_pins_its_newest_page_in_the_store(app):
    url, ns = app[0], app[1]
    body = {"model": "test/tiny", "prompt": "A conversation the store should keep. " * 6, "max_tokens": 4,
            "conversation_id": f"keep-{app[3]}", "priority": 1, "keep_s": 120}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    store = mooncake_ray.connect(ns)
    try:
        wait_for(lambda: store.stats()["soft_pinned"] >= 1, timeout_s=30, what="the conversation's pin")
    finally:
        store.close()
    bad = httpx.post(f"{url}/v1/completions", json={**body, "priority": "high"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"


def test_completions_with_token_ids_and_ignore_eos(app):
    url = app[0]
    body = {"model": "test/tiny", "prompt": list(range(40, 140)), "max_tokens": 5, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 5 and r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body,status,code", [
    ({"model": "test/tiny", "messages": []}, 400, None),
    ({"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]}, 404, "model_not_found"),
    ({"model": "test/tiny", "messages": [{"role": "user", "content": "x" * 5000}]}, 400, "context_length_exceeded"),
    ({"model": "test/tiny", "messages": [{"role": "robot", "content": "hi"}]}, 400, None),
    ({"model": "test/tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, None),
])
def test_bad_requests_get_openai_errors(app, body, status, code):
    url = app[0]
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error" and err["code"] == code


def test_bad_json(app):
    url = app[0]
    r = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_master_killed_mid_conversation_requests_still_succeed(app):
    url, ns = app[0], app[1]
    msgs = [{"role": "user", "content": "A conversation that survives the cache going away. " * 3}]
    text1, _ = chat(url, msgs)
    ray.kill(ray.get_actor(MASTER_NAME, namespace=ns), no_restart=False)
    msgs += [{"role": "assistant", "content": text1}, {"role": "user", "content": "still there?"}]
    text2, usage = chat(url, msgs)
    assert text2 == expected(msgs)  # served (recomputed if the cache is gone), and exact
    text3, _ = chat(url, msgs, stream=True)
    assert text3 == text2
