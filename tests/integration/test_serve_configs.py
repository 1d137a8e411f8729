"""The shipped reference-model Serve configs (serve_configs/aggregated.yaml,
disaggregated.yaml) deployed as a user does: ``ray start --head``, ``serve run <file>``,
OpenAI requests over HTTP, Ctrl-C, ``mooncake-ray stop``. One Ray head for the module.

Also prefix-aware routing, observed by behaviour: the aggregated config runs two engine
replicas behind :class:`PrefixAwareRouter` (``router.imbalance: 4``); a non-streaming
answer names the engine replica that served it in the ``x-mooncake-replica`` header.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import uuid

import httpx
import pytest

from tests.integration.serve_cli import CONFIGS, RayHead, ServeRun, errors_in

pytestmark = pytest.mark.timeout(600)

MODEL_ID = "mooncake-ray/tiny-lm"
IMBALANCE = 4  # router.imbalance in aggregated.yaml
STOP_LIMIT_S = 10.0


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    h = RayHead(str(tmp_path_factory.mktemp("ray-head")), num_cpus=4)
    yield h
    h.stop()


def _serve(head, name, tmp_path_factory):
    s = ServeRun(head, os.path.join(CONFIGS, name), str(tmp_path_factory.mktemp("serve")))
    try:
        models = s.wait_ready("/v1/models", timeout_s=240)
        assert [m["id"] for m in models["data"]] == [MODEL_ID], models
    except BaseException:
        s.close()
        raise
    return s


@pytest.fixture(scope="module")
def aggregated(head, tmp_path_factory):
    s = _serve(head, "aggregated.yaml", tmp_path_factory)
    yield s
    s.close()
    head.run("mooncake-ray", "stop")


def chat(url: str, messages: list, max_tokens: int = 8, **extra) -> httpx.Response:
    body = {"model": MODEL_ID, "messages": messages, "max_tokens": max_tokens, **extra}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def cached(r: httpx.Response) -> int:
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def conversation(url: str, topic: str, turns: int = 2) -> tuple[list, list[httpx.Response]]:
    """A multi-turn chat; the messages so far and each turn's response."""
    msgs, out = [], []
    for i in range(turns):
        msgs.append({"role": "user", "content": f"{topic}: question {i}. " + "Tell me more about it. " * 6})
        r = chat(url, msgs)
        out.append(r)
        msgs.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    return msgs, out


def test_aggregated_yaml_answers_and_reuses_the_conversation(aggregated):
    msgs, (r1, r2) = conversation(aggregated.url, f"kv caches {uuid.uuid4().hex[:6]}")
    u1, u2 = r1.json()["usage"], r2.json()["usage"]
    assert r1.json()["object"] == "chat.completion" and u1["completion_tokens"] > 0
    assert cached(r1) == 0
    assert u2["prompt_tokens"] > u1["prompt_tokens"]
    assert cached(r2) >= u1["prompt_tokens"] // 16 * 16 - 16, (u1, u2)  # turn 1's full pages
    # the same request twice answers the same (greedy, exact KV reuse), now mostly cached
    again = chat(aggregated.url, msgs[:-1])
    assert again.json()["choices"][0]["message"]["content"] == msgs[-1]["content"]
    assert cached(again) >= cached(r2)
    r = httpx.post(f"{aggregated.url}/v1/completions", timeout=60, json={
        "model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text


def test_prefix_routing_follows_the_conversation(aggregated):
    """Turn 2 of each conversation goes to the replica that served its turn 1."""
    topics = [f"topic {k} {uuid.uuid4().hex[:6]}" for k in range(6)]
    first: dict[str, str] = {}

    def turn1(t):
        first[t] = chat(aggregated.url, [{"role": "user", "content": f"{t}: " + "Explain this. " * 8}]) \
            .headers["x-mooncake-replica"]

    threads = [threading.Thread(target=turn1, args=(t,)) for t in topics]  # concurrent: they spread
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(first) == len(topics)
    for t in topics:
        msgs = [{"role": "user", "content": f"{t}: " + "Explain this. " * 8},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "And then?"}]
        r = chat(aggregated.url, msgs)
        assert r.headers["x-mooncake-replica"] == first[t], (t, first)
        assert cached(r) > 0


def test_prefix_routing_gives_way_to_an_imbalanced_queue(aggregated):
    """With more than ``imbalance`` requests in flight on the conversation's replica and
    none on the other, its next turn goes to the other replica."""
    url = aggregated.url
    prefix = [{"role": "user", "content": f"busy {uuid.uuid4().hex[:6]}: " + "Keep talking. " * 8}]
    owner = chat(url, prefix).headers["x-mooncake-replica"]
    hold = {"model": MODEL_ID, "messages": prefix, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(httpx.Client(timeout=120))
        held = []  # the line iterators too: one dropped closes its stream, and the server cancels it
        for _ in range(IMBALANCE + 1):  # each joins the owner's queue: they share its prefix
            resp = stack.enter_context(client.stream("POST", f"{url}/v1/chat/completions", json=hold))
            assert resp.status_code == 200
            held.append(resp.iter_lines())
            assert next(held[-1]).startswith("data: ")  # its first token: in flight on a replica
        ext = prefix + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "Anything else?"}]
        r = chat(url, ext)
        assert r.headers["x-mooncake-replica"] != owner, "went to the replica with the long queue"
        # and the conversation still reused its prefix, from the store (L3)
        assert cached(r) > 0
    # the conversation now follows the replica that served its latest turn (the longest
    # prefix), the held streams closed or not
    ext2 = ext + [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                  {"role": "user", "content": "Something new?"}]
    assert chat(url, ext2).headers["x-mooncake-replica"] == r.headers["x-mooncake-replica"]


def _assert_clean_stop(head, serve_run):
    serve_run.wait_quiet()  # earlier tests' cancelled streams log their own lines
    took = serve_run.interrupt()
    out = serve_run.stop_output
    assert serve_run.proc.returncode == 0, out
    assert took < STOP_LIMIT_S, f"serve run took {took:.1f}s to stop:\n{out}"
    assert not errors_in(out, serve_run_stop=True), out
    with pytest.raises(httpx.TransportError):  # Serve's proxy is gone with the app
        httpx.get(f"{serve_run.url}/v1/models", timeout=5)
    import time

    t = time.monotonic()
    r = head.run("mooncake-ray", "stop", timeout=60)
    took = time.monotonic() - t
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert took < STOP_LIMIT_S, f"mooncake-ray stop took {took:.1f}s:\n{out}"
    assert "stopped" in r.stdout and "stopped 0 " not in r.stdout, out
    assert not errors_in(out), out


def test_aggregated_serve_run_stops_cleanly_on_ctrl_c(head, aggregated):
    _assert_clean_stop(head, aggregated)


def test_disaggregated_yaml(head, tmp_path_factory):
    s = _serve(head, "disaggregated.yaml", tmp_path_factory)
    try:
        msgs, (r1, r2) = conversation(s.url, f"disaggregated {uuid.uuid4().hex[:6]}")
        assert cached(r1) == 0 and cached(r2) >= r1.json()["usage"]["prompt_tokens"] // 16 * 16 - 16
        assert r1.headers["x-mooncake-replica"] and r1.headers["x-mooncake-decode-replica"]
        # streaming answers the same
        body = {"model": MODEL_ID, "messages": msgs[:-1], "max_tokens": 8, "stream": True}
        text = []
        with httpx.stream("POST", f"{s.url}/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += [c["delta"].get("content", "") for c in json.loads(line[6:])["choices"]]
        assert "".join(text) == msgs[-1]["content"]
        s.interrupt()
        assert s.stopped_in < STOP_LIMIT_S and s.proc.returncode == 0, s.stop_output
        assert not errors_in(s.stop_output, serve_run_stop=True), s.stop_output
    finally:
        s.close()
        head.run("mooncake-ray", "stop")
