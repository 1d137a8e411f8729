"""``MooncakeKVRouter`` in a real Ray Serve LLM app: the shipped
``serve_configs/vllm-aggregated.yaml`` at two replicas (two vLLM engines on CPU, one
mooncake-ray store), deployed with ``serve run``, OpenAI chat requests over HTTP.

The test watches the engines as the router does: its own :class:`EventFeed` on both
engines' KV events (their endpoints from the records the replicas publish). Which engine
served a request is then a fact, not a guess: the one whose cache gained the prompt's
blocks. Checked:

- routing follows residency: first turns sent at once are spread over both engines, every
  later turn of a conversation goes to the engine that holds its earlier turns, and the router's expected cached tokens match what the engines
  report;
- events lost (a subscription closed while the engines publish) are replayed from the
  engine's replay socket, to the same index as a feed that lost nothing;
- a replica killed: the next turn of its conversations is served by the survivor, from the
  store (cached tokens reported), and no request fails;
- the router's metrics (decisions by reason, expected cached tokens against what the engines
  reported) through a real Prometheus, and the dashboard's router panels.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml

from tests.conftest import running_prometheus
from tests.integration.serve_cli import CONFIGS, RayHead, ServeRun

pytestmark = pytest.mark.timeout(1500)

MODEL_ID = "tiny-llama"
HEAD_CPUS = 8  # two {CPU: 2} engine replicas + the ingress
CONVS = 4
TURNS = 3
FIRST = 120  # words (= tokens) of a conversation's first message
NEXT = 40
MAX_TOKENS = 8

PY_RECORDS = ("import json, ray; ray.init(logging_level='ERROR', log_to_driver=False); "
              "from mooncake_ray.integrations.kv_router import list_records; print(json.dumps(list_records()))")
PY_RUNNING = ("import ray; from ray import serve; ray.init(logging_level='ERROR', log_to_driver=False); "
              "d = serve.status().applications['vllm-agg'].deployments['LLMServer:" + MODEL_ID + "']; "
              "print(d.replica_states.get('RUNNING', 0))")
PY_KILL = ("import sys, ray; ray.init(logging_level='ERROR', log_to_driver=False); "
           "ray.kill(ray.get_actor(sys.argv[1], namespace='serve'))")


def py(head, code: str, *args: str) -> str:
    r = head.run(os.path.basename(sys.executable), "-c", code, *args, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""


def wait_for(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def chat(url: str, messages: list, rid: str) -> dict:
    body = {"model": MODEL_ID, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300, headers={"x-request-id": rid})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("kv-router"))
    with open(os.path.join(CONFIGS, "vllm-aggregated.yaml")) as f:
        cfg = yaml.safe_load(f)
    llm = cfg["applications"][0]["args"]["llm_configs"][0]
    rrc = llm["deployment_config"]["request_router_config"]
    assert rrc["request_router_class"] == "mooncake_ray.integrations.kv_router:MooncakeKVRouter", rrc
    llm["deployment_config"]["num_replicas"] = 2
    path = os.path.join(tmp, "two-replicas.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    head = RayHead(tmp, num_cpus=HEAD_CPUS)
    prom_cm = running_prometheus([f"127.0.0.1:{head.metrics_port}"], tmp_path_factory.mktemp("prometheus"))
    prom = prom_cm.__enter__()
    s = ServeRun(head, path, tmp)
    try:
        s.wait_ready("/v1/models", timeout_s=900)
        # /v1/models answers once one replica runs: wait for the second engine too
        wait_for(lambda: py(head, PY_RUNNING) == "2", 600, "two running replicas")
        seen = []

        def records():
            seen.append(json.loads(py(head, PY_RECORDS)))
            r = seen[-1]
            return r if len(r) == 2 and all("prefixes" in v and "endpoint" in v for v in r.values()) else None

        try:
            recs = wait_for(records, 120, "both replicas' records")
        except AssertionError as e:
            raise AssertionError(f"{e}; last seen: {seen[-1:]}") from None
        yield head, s, recs, prom
    finally:
        s.close()
        head.run("mooncake-ray", "stop")
        prom_cm.__exit__(None, None, None)
        head.stop()


@pytest.fixture(scope="module")
def watched(app):
    """The test's own feed on both engines, and the model's tokenizer as the router loads it."""
    from mooncake_ray.integrations.kv_router import EventFeed, Tokenizer

    head, s, recs, _ = app
    feed = EventFeed(stale_s=2.0)
    bs = {rid: int(r["block_size"]) for rid, r in recs.items()}
    for rid, r in recs.items():
        feed.add(rid, r, bs[rid])
    tok = Tokenizer(next(iter(recs.values()))["model_source"])
    yield feed, tok, next(iter(bs.values()))
    feed.close()


def served_by(feed, hashes: list[str], timeout_s: float = 20.0) -> str:
    """The replica whose engine holds every full block of the prompt."""
    return wait_for(lambda: next((rid for rid in feed.indexes if feed.match(rid, hashes) == len(hashes)), None),
                    timeout_s, "an engine to cache the prompt's blocks")


@pytest.fixture(scope="module")
def conversations(app, watched):
    from mooncake_ray.integrations.tiny_model import words
    from mooncake_ray.kv import page_hashes

    head, s, _, _ = app
    feed, tok, bs = watched
    convs = [[{"role": "user", "content": words(range(1000 * c, 1000 * c + FIRST))}] for c in range(CONVS)]
    where: list[list[str]] = [[] for _ in range(CONVS)]
    usage: list[list[dict]] = [[] for _ in range(CONVS)]
    for turn in range(TURNS):
        if turn == 0:  # first turns at once: nothing cached anywhere, the router spreads them
            with ThreadPoolExecutor(CONVS) as pool:
                outs = list(pool.map(lambda c: chat(s.url, convs[c], f"conv{c}-turn0"), range(CONVS)))
        for c in range(CONVS):
            out = outs[c] if turn == 0 else chat(s.url, convs[c], f"conv{c}-turn{turn}")
            prompt = tok("messages", convs[c])
            assert out["usage"]["prompt_tokens"] == len(prompt), (out["usage"], len(prompt))
            where[c].append(served_by(feed, page_hashes(prompt, bs)))
            usage[c].append(out["usage"])
            convs[c] += [{"role": "assistant", "content": out["choices"][0]["message"]["content"]},
                         {"role": "user", "content": words(range(1000 * c + 500 + NEXT * turn,
                                                                 1000 * c + 500 + NEXT * (turn + 1)))}]
    return {"convs": convs, "where": where, "usage": usage}


def cached(u: dict) -> int:
    return (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def test_later_turns_go_to_the_engine_holding_the_conversation(conversations):
    where, usage = conversations["where"], conversations["usage"]
    print("\nserved by:", [[w.rsplit("#", 1)[1] for w in ws] for ws in where])
    assert len({ws[0] for ws in where}) == 2, where  # the first turns were spread over both engines
    for c in range(CONVS):
        assert len(set(where[c])) == 1, (c, where[c])  # every later turn on the first turn's engine
        for t in range(1, TURNS):
            # the engine reused the whole previous prompt's full blocks (at least)
            assert cached(usage[c][t]) >= usage[c][t - 1]["prompt_tokens"] // 32 * 32, usage[c]


def test_lost_events_are_replayed_from_a_real_engine(app, watched, conversations):
    from mooncake_ray.integrations.kv_router import EventFeed
    from mooncake_ray.integrations.tiny_model import words

    head, s, recs, _ = app
    feed, tok, bs = watched
    lossy = EventFeed(stale_s=2.0)
    try:
        for rid, r in recs.items():
            lossy.add(rid, r, bs)
        wait_for(lambda: all(lossy.indexes[r].blocks == feed.indexes[r].blocks for r in recs), 30,
                 "a new feed to catch up by replay")
        for rid in recs:
            lossy.disconnect(rid)
        time.sleep(0.5)
        for i in range(3):  # both engines publish while the subscriptions are closed
            chat(s.url, [{"role": "user", "content": words(range(20000 + 100 * i, 20000 + 100 * i + 96))}],
                 f"lossy-{i}")
        time.sleep(0.5)
        for rid in recs:
            lossy.reconnect(rid)
        wait_for(lambda: all(lossy.indexes[r].blocks == feed.indexes[r].blocks for r in recs), 30,
                 "the replayed index to equal the reference")
        assert lossy.gaps["lost"] == 0 and lossy.gaps["replayed"] >= 1, lossy.gaps
    finally:
        lossy.close()


def test_a_killed_replica_leaves_routing_to_the_survivor_and_the_store(app, watched, conversations):
    from mooncake_ray.kv import page_hashes

    head, s, recs, _ = app
    feed, tok, bs = watched
    convs, where = conversations["convs"], conversations["where"]
    victim = where[0][0]
    survivor = next(r for r in recs if r != victim)
    py(head, PY_KILL, victim)
    mine = [c for c in range(CONVS) if where[c][0] == victim]
    errors, outs = [], []
    t = time.monotonic()
    for c in mine:  # their engine is gone: the store still has their blocks
        try:
            out = chat(s.url, convs[c], f"conv{c}-after-kill")
        except AssertionError as e:
            errors.append(str(e)[:300])
            continue
        outs.append(out)
        assert served_by(feed, page_hashes(tok("messages", convs[c]), bs)) == survivor
        prev = conversations["usage"][c][-1]["prompt_tokens"]
        assert cached(out["usage"]) >= prev // 32 * 32, out["usage"]  # loaded from the store
    print(f"\nafter the kill: {len(outs)} served in {time.monotonic() - t:.1f} s, errors {errors}")
    assert not errors
    assert re.search(r"SERVE_REPLICA::", victim)


def test_router_metrics_and_dashboard_panels_in_prometheus(app, conversations):
    """Runs last: every request of this module went through the router. Its decisions, the
    tokens it expected the engines not to compute, and what the engines (the connector's
    counts) reported, through a real Prometheus; every router panel of the dashboard has data."""
    from tests.conftest import query
    from tests.integration.test_metrics import ROUTER_EXPRS

    prom = app[3]
    n_later = CONVS * (TURNS - 1)
    reported = sum(cached(u) for us in conversations["usage"] for u in us)  # the conversations' turns

    def total(expr: str) -> float:
        return sum(float(r["value"][1]) for r in query(prom, expr))

    def settled():
        eng = total('ray_mooncake_router_decisions_total{reason="engine"}')
        n = total("ray_mooncake_router_decisions_total")
        exp = total("ray_mooncake_router_expected_cached_tokens_total")
        engine_hits = total("ray_mooncake_connector_engine_hit_tokens_total")
        store_hits = total("ray_mooncake_connector_hit_tokens_total")  # the kill test's loads
        last[:] = [eng, n, exp, engine_hits, store_hits]
        # every request's expected hit is what its engine then reported, give or take a block
        return eng >= n_later and exp >= reported and store_hits > 0 and \
            abs(exp - (engine_hits + store_hits)) <= 32 * n * 0.25

    last: list = []
    try:
        wait_for(settled, 120, "the router's and the engines' counts in Prometheus")
    finally:
        print(f"\nengine decisions, decisions, expected cached tokens, reported by the engines (own cache, "
              f"store): {last}")
    assert total("ray_mooncake_router_event_batches_total") > 0
    wait_for(lambda: not [e for e in ROUTER_EXPRS if not query(prom, e)], 60, "data in every router panel")
