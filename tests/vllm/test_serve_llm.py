"""The shipped Ray Serve LLM configs serving real vLLM engines (CPU) with the mooncake-ray KV
connector, deployed as a user does: ``ray start --head``, ``serve run <file>``, OpenAI
requests over HTTP, Ctrl-C, ``mooncake-ray stop``. One Ray head (with a real Prometheus
scraping it) serves, one after the other:

1. ``serve_configs/vllm-aggregated.yaml`` at two replicas (two engines, kv_both, one store
   the engines deploy themselves) and two ingress replicas, each with its own
   ``MooncakeKVRouter``:

   - a two-turn chat (greedy) reuses turn one's KV on turn two;
   - the test watches the engines as the router does, with its own :class:`EventFeed` on
     both engines' KV events (their endpoints from the records the replicas publish), so
     which engine served a request is a fact, not a guess: the one whose cache gained the
     prompt's blocks. First turns sent at once are spread over both engines, every later
     turn of a conversation goes to the engine that holds its earlier turns whichever ingress
     replica takes it (their access logs say which did; both do), and the
     router's expected cached tokens match what the engines report;
   - events lost (a subscription closed while the engines publish) are replayed from the
     engine's replay socket, to the same index as a feed that lost nothing;
   - the router's metrics (decisions by reason, expected cached tokens against what the
     engines reported) through Prometheus, and the dashboard's router panels;
   - a replica killed: the next turn of its conversations is served by the survivor, from
     the store (cached tokens reported, and counted in Prometheus), and no request fails;
   - Ctrl-C stops ``serve run``, and ``mooncake-ray stop`` removes the store.

2. ``serve_configs/vllm-disaggregated.yaml`` (a pool of two kv_producer replicas, routed by
   ``MooncakeKVRouter``, -> one kv_consumer; its own store), whose engines start without
   Ray's model-resolving task (a local model): the same two-turn chat answers exactly as the
   aggregated app did, reports cached tokens on turn two, and its decode engine read the
   prefill's KV from the prefill engine's memory; the router's conversations, watched on
   both prefill engines' KV events: first turns spread over the pool, every later turn to
   the prefill replica that computed the earlier ones, and every full block reaching the
   decode engine. It runs first (each app is stopped, with its store, before the next starts).
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

# two vLLM apps, one after the other (engine start-up 20-70 s each here)
pytestmark = pytest.mark.timeout(1500)

MODEL_ID = "tiny-llama"
# Logical CPUs for Serve LLM: a {CPU: 2} placement group per engine replica, {CPU: 1} for
# each ingress replica (two engine and two ingress replicas: 6; P/D, two prefill, one decode and
# the ingress: 7), as the configs' comments tell users.
HEAD_CPUS = 8
TURN1 = 100  # words (= tokens) of the two-turn chat's first message: three full 32-token blocks
TURN2 = 40
CHAT_TOKENS = 16
STOP_LIMIT_S = 30.0
# the router's conversations (their words never overlap the two-turn chat's)
CONVS = 4
TURNS = 3
FIRST = 120
NEXT = 40
MAX_TOKENS = 8

PY_RECORDS = ("import json, ray; ray.init(logging_level='ERROR', log_to_driver=False); "
              "from mooncake_ray.integrations.kv_router import list_records; print(json.dumps(list_records()))")
PY_RUNNING = ("import ray; from ray import serve; ray.init(logging_level='ERROR', log_to_driver=False); "
              "d = serve.status().applications['vllm-agg'].deployments['LLMServer:" + MODEL_ID + "']; "
              "print(d.replica_states.get('RUNNING', 0))")
PY_PD_PREFILL = ("import ray; from ray import serve; ray.init(logging_level='ERROR', log_to_driver=False); "
                 "ds = serve.status().applications['vllm-pd'].deployments; "
                 "print(sum(d.replica_states.get('RUNNING', 0) for n, d in ds.items() if n.startswith('Prefill')))")
PY_INGRESS = ("import ray; from ray import serve; ray.init(logging_level='ERROR', log_to_driver=False); "
              "print(serve.status().applications['vllm-agg'].deployments['OpenAiIngress'].replica_states.get('RUNNING', 0))")
PY_SESSION = ("import ray; ray.init(logging_level='ERROR', log_to_driver=False); "
              "print(ray._private.worker.global_worker.node.get_session_dir_path())")
INGRESS_LINE = re.compile(r"vllm-agg_OpenAiIngress (\w+) (conv\d+-turn\d+) -- POST /v1/chat/completions 200")
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


def chat(url: str, messages: list, rid: str, max_tokens: int = MAX_TOKENS) -> dict:
    body = {"model": MODEL_ID, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300, headers={"x-request-id": rid})
    assert r.status_code == 200, r.text
    return r.json()


def cached(u: dict) -> int:
    return (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def master_stats(head) -> dict:
    r = head.run("mooncake-ray", "status", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def two_turn_chat(url: str, head, tag: str) -> dict:
    """Two turns of a chat (greedy); the store's stats after each."""
    from mooncake_ray.integrations.tiny_model import words

    messages = [{"role": "user", "content": words(range(TURN1))}]
    out1 = chat(url, messages, f"{tag}-1", CHAT_TOKENS)
    text1, usage1 = out1["choices"][0]["message"]["content"], out1["usage"]
    stats1 = master_stats(head)
    messages += [{"role": "assistant", "content": text1},
                 {"role": "user", "content": words(range(500, 500 + TURN2))}]
    out2 = chat(url, messages, f"{tag}-2", CHAT_TOKENS)
    stats2 = master_stats(head)
    return {"texts": [text1, out2["choices"][0]["message"]["content"]], "usage": [usage1, out2["usage"]],
            "stats": [stats1, stats2]}


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("vllm-head"))
    h = RayHead(tmp, num_cpus=HEAD_CPUS)
    try:
        with running_prometheus([f"127.0.0.1:{h.metrics_port}"], tmp_path_factory.mktemp("prometheus")) as prom:
            yield h, prom
    finally:
        h.stop()


# the running totals the router test compares (summed over processes by ``prom_total``)
ROUTER_TOTALS = ('ray_mooncake_router_decisions_total{reason="engine"}', "ray_mooncake_router_decisions_total",
                 "ray_mooncake_router_expected_cached_tokens_total",
                 "ray_mooncake_connector_engine_hit_tokens_total", "ray_mooncake_connector_hit_tokens_total")


class App:
    """A ``serve run`` of the app; ``stop`` is Ctrl-C (once), then ``mooncake-ray stop``.
    ``base``: ``ROUTER_TOTALS`` in Prometheus before it served (what the P/D app counted)."""

    def __init__(self, head, s, recs=None):
        self.head, self.s, self.recs, self.stopped = head, s, recs, None
        self.base: dict[str, float] = {}
        self.session = ""  # the head's Ray session directory

    def ingress_of(self, rids: list[str]) -> dict[str, str]:
        """Which ingress replica answered each request (its access log in the session's logs)."""
        import glob

        def read():
            got = {}
            for path in glob.glob(os.path.join(self.session, "logs", "serve", "replica_vllm-agg_OpenAiIngress_*.log")):
                with open(path, errors="replace") as f:
                    for m in INGRESS_LINE.finditer(f.read()):
                        got[m.group(2)] = m.group(1)
            return got if all(r in got for r in rids) else None

        return wait_for(read, 30, f"the ingress access log lines of {rids}")

    def stop(self) -> dict:
        if self.stopped is None:
            try:
                took = self.s.interrupt()
                self.stopped = {"stopped_in": took, "returncode": self.s.proc.returncode,
                                "stop_output": self.s.stop_output}
            finally:
                self.s.close()
                self.head.run("mooncake-ray", "stop")
        return self.stopped


@pytest.fixture(scope="module")
def app(head, tmp_path_factory, disaggregated):
    """vllm-aggregated.yaml at two replicas, both running and publishing their records. It
    runs after the P/D app: the kill test leaves the killed replica's engine processes to
    wind down, busy, while later engines would start."""
    head, prom = head
    tmp = str(tmp_path_factory.mktemp("vllm-agg"))
    with open(os.path.join(CONFIGS, "vllm-aggregated.yaml")) as f:
        cfg = yaml.safe_load(f)
    llm = cfg["applications"][0]["args"]["llm_configs"][0]
    rrc = llm["deployment_config"]["request_router_config"]
    assert rrc["request_router_class"] == "mooncake_ray.integrations.kv_router:MooncakeKVRouter", rrc
    llm["deployment_config"]["num_replicas"] = 2
    # two ingress replicas, each with its own router: Serve's proxy picks one per request
    cfg["applications"][0]["args"]["ingress_deployment_config"] = {"num_replicas": 2}
    path = os.path.join(tmp, "two-replicas.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    s = ServeRun(head, path, tmp)
    run = App(head, s)
    try:
        models = s.wait_ready("/v1/models", timeout_s=900)
        assert MODEL_ID in [m["id"] for m in models["data"]], models
        # /v1/models answers once one replica runs: wait for the second engine too
        wait_for(lambda: py(head, PY_RUNNING) == "2", 600, "two running replicas")
        wait_for(lambda: py(head, PY_INGRESS) == "2", 120, "two running ingress replicas")
        run.session = py(head, PY_SESSION)
        # this app's replicas (the P/D app's records outlive its replicas in the GCS)
        run.recs = replica_records(head, "SERVE_REPLICA::vllm-agg#", 2)
        run.base = {expr: prom_total(prom, expr) for expr in ROUTER_TOTALS}  # the P/D app's processes are gone
        yield run
    finally:
        run.stop()


@pytest.fixture(scope="module")
def aggregated(app):
    """The two-turn chat on the aggregated app (first: nothing else was asked before it)."""
    out = two_turn_chat(app.s.url, app.head, "agg")
    print(f"\naggregated: usage {out['usage']}, texts {out['texts']}")
    return out


def watch(recs: dict):
    """The test's own feed on the engines of ``recs`` (the records their replicas
    published), the model's tokenizer as the router loads it, and the block size."""
    from mooncake_ray.integrations.kv_router import EventFeed, Tokenizer

    feed = EventFeed(stale_s=2.0)
    bs = {rid: int(r["block_size"]) for rid, r in recs.items()}
    for rid, r in recs.items():
        feed.add(rid, r, bs[rid])
    return feed, Tokenizer(next(iter(recs.values()))["model_source"]), next(iter(bs.values()))


def replica_records(head, prefix: str, n: int) -> dict:
    """The records of the ``n`` replicas whose ids start with ``prefix``, once each names
    its engine's event endpoint and its store prefixes."""
    seen = []

    def records():
        seen.append(json.loads(py(head, PY_RECORDS)))
        r = {k: v for k, v in seen[-1].items() if k.startswith(prefix)}
        return r if len(r) == n and all("prefixes" in v and "endpoint" in v for v in r.values()) else None

    try:
        return wait_for(records, 120, f"{n} records of {prefix}")
    except AssertionError as e:
        raise AssertionError(f"{e}; last seen: {seen[-1:]}") from None


@pytest.fixture(scope="module")
def watched(app):
    """The test's own feed on both engines."""
    feed, tok, bs = watch(app.recs)
    yield feed, tok, bs
    feed.close()


def served_by(feed, hashes: list[str], timeout_s: float = 20.0) -> str:
    """The replica whose engine holds every full block of the prompt."""
    return wait_for(lambda: next((rid for rid in feed.indexes if feed.match(rid, hashes) == len(hashes)), None),
                    timeout_s, "an engine to cache the prompt's blocks")


def converse(url: str, feed, tok, bs: int, tag: str = "conv") -> dict:
    """``CONVS`` conversations of ``TURNS`` turns, the first turns sent at once; which
    replica's engine served each turn (``served_by``) and each turn's usage."""
    from mooncake_ray.integrations.tiny_model import words

    convs = [[{"role": "user", "content": words(range(1000 * c + 1000, 1000 * c + 1000 + FIRST))}]
             for c in range(CONVS)]
    where: list[list[str]] = [[] for _ in range(CONVS)]
    usage: list[list[dict]] = [[] for _ in range(CONVS)]
    for turn in range(TURNS):
        if turn == 0:  # first turns at once: nothing cached anywhere, the router spreads them
            with ThreadPoolExecutor(CONVS) as pool:
                outs = list(pool.map(lambda c: chat(url, convs[c], f"{tag}{c}-turn0"), range(CONVS)))
        for c in range(CONVS):
            out = outs[c] if turn == 0 else chat(url, convs[c], f"{tag}{c}-turn{turn}")
            prompt = tok("messages", convs[c])
            assert out["usage"]["prompt_tokens"] == len(prompt), (out["usage"], len(prompt))
            record_turn(out, prompt, convs[c], where[c], usage[c], feed, bs,
                        range(1000 * c + 1500 + NEXT * turn, 1000 * c + 1500 + NEXT * (turn + 1)))
    return {"convs": convs, "where": where, "usage": usage}


def record_turn(out: dict, prompt: list[int], conv: list, where: list, usage: list, feed, bs: int, next_words) -> None:
    """A turn answered: the replica whose engine holds its prompt (``prompt``, its token
    ids) and its usage are recorded, and the reply and the next message (``next_words``)
    join the conversation."""
    from mooncake_ray.integrations.tiny_model import words
    from mooncake_ray.kv import page_hashes

    where.append(served_by(feed, page_hashes(prompt, bs)))
    usage.append(out["usage"])
    conv += [{"role": "assistant", "content": out["choices"][0]["message"]["content"]},
             {"role": "user", "content": words(next_words)}]


def assert_later_turns_stay(where: list[list[str]], usage: list[list[dict]]) -> None:
    """The first turns were spread over both replicas, and every later turn of a
    conversation went to the replica of its first turn, whose engine reused the whole
    previous prompt's full blocks (at least)."""
    assert len({ws[0] for ws in where}) == 2, where
    for c in range(CONVS):
        assert len(set(where[c])) == 1, (c, where[c])
        for t in range(1, len(where[c])):
            assert cached(usage[c][t]) >= usage[c][t - 1]["prompt_tokens"] // 32 * 32, usage[c]


@pytest.fixture(scope="module")
def conversations(app, watched, aggregated):  # after the two-turn chat: its turn one must find nothing cached
    s = app.s
    feed, tok, bs = watched
    out = converse(s.url, feed, tok, bs)
    convs, where, usage = out["convs"], out["where"], out["usage"]
    # Serve's proxy picks an ingress replica at random for each request: more turns until
    # both ingress replicas (their routers) have taken later turns (1 in 2^7 runs needs any)
    ingress = app.ingress_of([f"conv{c}-turn{t}" for c in range(CONVS) for t in range(TURNS)])
    extra = 0
    while len({ingress[f"conv{c}-turn{t}"] for c in range(CONVS) for t in range(1, len(where[c]))}) < 2:
        assert extra < 24, ingress  # 2^-31
        c, extra = extra % CONVS, extra + 1
        rid = f"conv{c}-turn{len(where[c])}"
        out = chat(s.url, convs[c], rid)
        record_turn(out, tok("messages", convs[c]), convs[c], where[c], usage[c], feed, bs,
                    range(1000 * c + 1800 + NEXT * extra, 1000 * c + 1800 + NEXT * (extra + 1)))
        ingress.update(app.ingress_of([rid]))
    return {"convs": convs, "where": where, "usage": usage, "ingress": ingress}


def test_aggregated_chat_reuses_turn_one(aggregated):
    u1, u2 = aggregated["usage"]
    assert u1["prompt_tokens"] >= TURN1 and u1["completion_tokens"] > 0
    assert cached(u1) == 0, u1
    assert cached(u2) >= 96, u2  # turn 1's three full blocks, at least


def test_later_turns_go_to_the_engine_holding_the_conversation_whichever_ingress_takes_them(conversations):
    where, usage, ingress = conversations["where"], conversations["usage"], conversations["ingress"]
    print("\nserved by (engine/ingress):",
          [[f"{w.rsplit('#', 1)[1]}/{ingress[f'conv{c}-turn{t}']}" for t, w in enumerate(ws)] for c, ws in enumerate(where)])
    assert_later_turns_stay(where, usage)


def test_each_ingress_replica_made_its_router_as_it_started(app, conversations):
    """Serve LLM's ingress makes its handle to the engines (and the handle its router) at
    its first request; ours as it starts, so no ingress replica's first requests are routed
    by a router that has not yet subscribed to the engines' events. A handle made at a
    request is logged with that request's id."""
    import glob

    made = {}
    for path in glob.glob(os.path.join(app.session, "logs", "serve", "replica_vllm-agg_OpenAiIngress_*.log")):
        with open(path, errors="replace") as f:
            for m in re.finditer(r"vllm-agg_OpenAiIngress (\w+) (\S+ )?-- Initialized DeploymentHandle \w+ "
                                 r"for Deployment\(name='LLMServer", f.read()):
                made[m.group(1)] = m.group(2)
    assert len(made) == 2 and not any(made.values()), made  # each replica's, at no request


def test_lost_events_are_replayed_from_a_real_engine(app, watched, conversations):
    from mooncake_ray.integrations.kv_router import EventFeed
    from mooncake_ray.integrations.tiny_model import words

    s, recs = app.s, app.recs
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


def test_router_metrics_in_prometheus_match_what_the_engines_reported(head, app, conversations):
    """Every request to the aggregated app went through the router. Its decisions, the
    tokens it expected the engines not to compute, and what the engines (the connector's
    counts) reported, through a real Prometheus. Checked while both engines run: a process
    exports its totals every ``metrics_report_interval_ms`` (10 s on a ``ray start`` head),
    so a process killed within that time of its last request takes what it counted since
    with it."""
    prom = head[1]
    n_later = CONVS * (TURNS - 1)
    reported = sum(cached(u) for us in conversations["usage"] for u in us)  # the conversations' turns

    def total(expr: str) -> float:
        return prom_total(prom, expr) - app.base.get(expr, 0.0)

    def settled():
        eng = total('ray_mooncake_router_decisions_total{reason="engine"}')
        n = total("ray_mooncake_router_decisions_total")
        exp = total("ray_mooncake_router_expected_cached_tokens_total")
        engine_hits = total("ray_mooncake_connector_engine_hit_tokens_total")
        store_hits = total("ray_mooncake_connector_hit_tokens_total")
        last[:] = [eng, n, exp, engine_hits, store_hits]
        # every request's expected hit is what its engine then reported, give or take a block
        return eng >= n_later and exp >= reported and \
            abs(exp - (engine_hits + store_hits)) <= 32 * n * 0.25

    last: list = []
    try:
        wait_for(settled, 120, "the router's and the engines' counts in Prometheus")
    finally:
        print(f"\nengine decisions, decisions, expected cached tokens, reported by the engines (own cache, "
              f"store): {last}")
    assert total("ray_mooncake_router_event_batches_total") > 0


def prom_total(prom: str, expr: str) -> float:
    """A running total summed over the processes that export it, each at its last value in
    the module's run (a process's series ends with it)."""
    from tests.conftest import query

    return sum(float(r["value"][1]) for r in query(prom, f"max_over_time({expr}[1h])"))


def test_a_killed_replica_leaves_routing_to_the_survivor_and_the_store(head, app, watched, conversations):
    """The next turn of the killed replica's conversations: served by the survivor from the
    store, counted as its store hits in Prometheus; then every router panel has data."""
    from mooncake_ray.kv import page_hashes

    prom = head[1]
    head, s, recs = app.head, app.s, app.recs
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
    # the survivor's connector counts those loads as store hits (Prometheus)
    loaded = sum(cached(o["usage"]) for o in outs)
    hits = "ray_mooncake_connector_hit_tokens_total"
    wait_for(lambda: prom_total(prom, hits) - app.base.get(hits, 0.0) >= loaded, 60,
             "the survivor's store hits in Prometheus")
    # every router panel of the dashboard has data (store hits now among them)
    from tests.conftest import query
    from tests.integration.test_metrics import ROUTER_EXPRS

    wait_for(lambda: not [e for e in ROUTER_EXPRS if not query(prom, e)], 60, "data in every router panel")


@pytest.fixture(scope="module")
def aggregated_stopped(app, aggregated, conversations):
    """Ctrl-C to the aggregated app's ``serve run`` (after its tests), then ``mooncake-ray stop``."""
    return app.stop()


@pytest.fixture(scope="module")
def disaggregated(head, tmp_path_factory):  # first, on a head with nothing else running
    head, _prom = head
    tmp = str(tmp_path_factory.mktemp("vllm-pd"))
    s = ServeRun(head, os.path.join(CONFIGS, "vllm-disaggregated.yaml"), tmp)
    run = App(head, s)
    feed = None
    try:
        models = s.wait_ready("/v1/models", timeout_s=600)
        assert MODEL_ID in [m["id"] for m in models["data"]], models
        wait_for(lambda: py(head, PY_PD_PREFILL) == "2", 600, "two running prefill replicas")
        recs = replica_records(head, "SERVE_REPLICA::vllm-pd#Prefill", 2)
        out = two_turn_chat(s.url, head, "pd")
        feed, tok, bs = watch(recs)
        out["pool"] = converse(s.url, feed, tok, bs, "pd")  # which prefill engine took each turn
    finally:
        if feed is not None:
            feed.close()
        out_stop = run.stop()
    with open(s.log_path) as f:
        log = f.read()
    # the builder's callback skipped Ray's model-resolving task (a local model); Ray may print
    # the two engines' alike lines once
    assert "not running the model-resolving task" in log, log[-3000:]
    assert "Running tasks to download model files" not in log
    print(f"\ndisaggregated: usage {out['usage']}, texts {out['texts']}, store hits/keys "
          f"{[(st['hits'], st['keys']) for st in out['stats']]}, stopped in {out_stop['stopped_in']:.1f} s")
    return {**out, **out_stop}


def test_serve_run_stops_on_ctrl_c(aggregated_stopped, disaggregated):
    for run in (aggregated_stopped, disaggregated):
        assert run["returncode"] == 0 and run["stopped_in"] < STOP_LIMIT_S, run["stop_output"]


def test_pd_answers_as_aggregated(aggregated, disaggregated):
    assert disaggregated["texts"] == aggregated["texts"]
    assert [u["prompt_tokens"] for u in disaggregated["usage"]] == \
        [u["prompt_tokens"] for u in aggregated["usage"]]
    assert [u["completion_tokens"] for u in disaggregated["usage"]] == \
        [u["completion_tokens"] for u in aggregated["usage"]]
    assert cached(disaggregated["usage"][1]) > 0, disaggregated["usage"][1]


def test_pd_later_turns_go_to_the_prefill_replica_holding_the_conversation(disaggregated):
    where, usage = disaggregated["pool"]["where"], disaggregated["pool"]["usage"]
    print("\nP/D prefill replica of each turn:", [[w.rsplit("#", 1)[1] for w in ws] for ws in where])
    assert_later_turns_stay(where, usage)
    # every full block of every turn's prompt came to the decode engine (its own cache, or
    # read from the prefill engine that computed it): it computed only the last block
    for us in usage:
        for u in us:
            assert cached(u) >= (u["prompt_tokens"] - 1) // 32 * 32, us


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
