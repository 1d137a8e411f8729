"""An engine's price of a computed and a loaded token, learned from its steps
(``_step_costs.StepCosts``), and the router weighing each replica's loads by its own
engine's price (no vLLM, no Serve: the router's methods on fake replicas)."""

import random
import types

import pytest

from mooncake_ray.integrations import _kv_index as kvi
from mooncake_ray.integrations import kv_router
from mooncake_ray.integrations._step_costs import NoCosts, StepCosts

COMPUTE_S, LOAD_S, OVERHEAD_S = 2e-4, 3e-5, 4e-3  # a token computed, a token loaded, a step


def run(costs: StepCosts, steps: list[tuple[int, int]], noise: float = 0.0, seed: int = 0, idle_every: int = 0):
    """Steps back to back, each taking what the model says (times ``1 +- noise``), one
    request running through them; every ``idle_every``-th step the engine first waits 5 s
    for work (its request finished) and a new request runs from there."""
    rng = random.Random(seed)
    t = 100.0
    prev: set[str] = set()
    ids = {"r"}
    for i, (computed, loaded) in enumerate(steps):
        if idle_every and i and i % idle_every == 0:
            t += 5.0
            prev, ids = set(), {f"new{i}"}  # a new request after a wait: nothing continues
        costs.step(t, computed, loaded, ids, prev & ids)
        t += (COMPUTE_S * computed + LOAD_S * loaded + OVERHEAD_S) * (1 + rng.uniform(-noise, noise))
        prev = ids


def mixed(n: int, seed: int = 1) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.5:
            out.append((rng.randint(1, 4), 0))  # decode steps
        elif kind < 0.8:
            out.append((rng.randint(64, 512), 0))  # prefills
        else:
            out.append((rng.randint(16, 256), rng.randint(64, 1024)))  # prefills with store loads
    return out


def test_the_prices_are_those_the_steps_took():
    c = StepCosts()
    run(c, mixed(300), noise=0.05)
    est = c.estimate()
    assert est["compute_s_per_token"] == pytest.approx(COMPUTE_S, rel=0.1)
    assert est["load_s_per_token"] == pytest.approx(LOAD_S, rel=0.25)
    assert est["load_cost"] == pytest.approx(LOAD_S / COMPUTE_S, rel=0.25)


def test_an_engine_no_router_reads_keeps_no_steps():
    c = NoCosts()  # the connector's, without a router key
    run(c, mixed(300))
    c.load_started("r", 64, 1.0)
    c.load_finished("r", 2.0)
    assert c.samples() == 0 and c.estimate() is None


def test_intervals_across_a_wait_for_work_are_not_steps():
    c = StepCosts()
    run(c, mixed(300), idle_every=10)  # every 10th interval holds 5 s of waiting
    est = c.estimate()
    assert c.samples() == 300 - 1 - 29
    assert est["compute_s_per_token"] == pytest.approx(COMPUTE_S, rel=1e-6)
    assert est["load_cost"] == pytest.approx(LOAD_S / COMPUTE_S, rel=1e-6)


def test_no_price_before_enough_steps_vary_in_what_it_multiplies():
    c = StepCosts(min_steps=8)
    assert c.estimate() is None
    run(c, [(2, 0)] * 50)  # decodes only: a computed token's price is not in them
    assert c.estimate() is None
    c = StepCosts(min_steps=8)
    run(c, [(2, 0), (300, 0)] * 20)  # prefills, but nothing loaded yet
    est = c.estimate()
    assert est["compute_s_per_token"] == pytest.approx(COMPUTE_S) and est["load_cost"] is None
    # fewer loading steps than a fit of three prices needs: each one's time beyond the
    # others' fit is its load's, a price from the first load on, with its count
    run(c, [(100, 500), (2, 0)])  # a step's time is known when the next one starts
    est = c.estimate()
    assert est["load_cost"] == pytest.approx(LOAD_S / COMPUTE_S) and est["load_samples"] == 1
    assert est["compute_s_per_token"] == pytest.approx(COMPUTE_S)
    run(c, [(100, 500), (50, 700)] * 4 + [(2, 0)])  # enough for the fit of all three
    est = c.estimate()
    assert est["load_cost"] == pytest.approx(LOAD_S / COMPUTE_S) and est["load_samples"] == 9


def test_a_few_loading_steps_do_not_bend_the_computed_price():
    """Loading steps left in a fit of the computed price alone would make each computed
    token dearer (their load time on their few computed tokens): they are fitted apart."""
    c = StepCosts(min_steps=8)
    run(c, [(2, 0), (300, 0)] * 20 + [(16, 4000)] * 3 + [(2, 0)], noise=0.02, seed=3)
    est = c.estimate()
    assert est["compute_s_per_token"] == pytest.approx(COMPUTE_S, rel=0.05)
    assert est["load_s_per_token"] == pytest.approx(LOAD_S, rel=0.1) and est["load_samples"] == 3


def test_a_load_dearer_than_computing_is_priced_at_one():
    c = StepCosts()
    slow = [(n, 0) for n in (100, 200, 300, 400)] * 5 + [(100, 100), (100, 300)] * 5
    t, prev = 0.0, set()
    for computed, loaded in slow:
        c.step(t, computed, loaded, {"r"}, prev)
        t += 1e-4 * computed + 5e-4 * loaded + 1e-3
        prev = {"r"}
    assert c.estimate()["load_cost"] == 1.0


def fake_replica(name):
    return types.SimpleNamespace(replica_id=types.SimpleNamespace(to_full_id_str=lambda: name))


def test_each_replicas_loads_are_weighed_by_its_own_engines_price(monkeypatch):
    """Two replicas, neither holding the prompt, the store holding all of it: with the
    configured price they tie; once "a" says its loads cost it 0.9 of computing and "b"
    0.1, "b" is chosen; a replica with no price yet is weighed by ``load_cost``."""
    model = kvi.CostModel(load_cost=0.4)
    engine = {"a": 0, "b": 0, "c": 0}
    present = [True] * 10
    tie = {"a": 0, "b": 1, "c": 2}
    assert kvi.choose(320, 32, engine, present, {}, model, tie).best.key == "a"
    model.load_costs.update(a=0.9, b=0.1)
    dec = kvi.choose(320, 32, engine, present, {}, model, tie)
    assert [o.key for o in dec.ranked] == ["b", "c", "a"]
    assert [round(o.cost, 1) for o in dec.ranked] == [0.1 * 288 + 32, 0.4 * 288 + 32, 0.9 * 288 + 32]

    # the router reads the prices from the engines' records
    r = kv_router.MooncakeKVRouter.__new__(kv_router.MooncakeKVRouter)
    r.initialize_state(load_cost=0.4)
    try:
        r._records = {"a": {}, "b": {}}
        recs = {("a", "costs"): {"load_cost": 0.9, "compute_s_per_token": 1e-4},
                ("b", "costs"): {"load_cost": 7.0}}  # out of range: ignored
        monkeypatch.setattr(kv_router, "get_record", lambda rid, part: recs.get((rid, part)))
        r._costs_reading = True
        r._read_costs()
        # a price given without its count stood for 8 loads; "b" (nothing valid) takes the others'
        assert r._model.load_costs == pytest.approx({"a": (8 * 0.9 + 0.4) / 9, "b": (8 * 0.9 + 0.4) / 9})
        assert not r._costs_reading
        r._forget("a")
        assert r._model.load_costs == pytest.approx({"b": (8 * 0.9 + 0.4) / 9})
    finally:
        r._feed.close()


def test_a_price_counts_by_the_loads_behind_it(monkeypatch):
    """The configured price counts as one load: an engine's first load moves its replica's
    price halfway; a replica whose engine loaded nothing takes the others' loads together;
    with no load anywhere every replica keeps ``load_cost``."""
    assert kv_router.blend_price(0.1, 1, 0.4) == pytest.approx(0.25)
    assert kv_router.blend_price(0.1, 9, 0.4) == pytest.approx(0.13)
    r = kv_router.MooncakeKVRouter.__new__(kv_router.MooncakeKVRouter)
    r.initialize_state(load_cost=0.4)
    try:
        r._records = {"a": {}, "b": {}, "c": {}}
        recs = {}
        monkeypatch.setattr(kv_router, "get_record", lambda rid, part: recs.get((rid, part)))
        r._read_costs()
        assert r._model.load_costs == {}
        recs[("a", "costs")] = {"load_cost": 0.1, "load_samples": 1, "compute_s_per_token": 4e-3}
        recs[("b", "costs")] = {"load_cost": None, "load_samples": 0, "compute_s_per_token": 4e-3}
        r._read_costs()
        assert r._model.load_costs == pytest.approx({"a": 0.25, "b": 0.25, "c": 0.25})
        recs[("b", "costs")] = {"load_cost": 0.05, "load_samples": 3}
        recs[("c", "costs")] = {"load_cost": 0.2, "load_samples": 0.5}  # under one load: not a price
        r._read_costs()
        pooled = (0.1 + 3 * 0.05) / 4
        assert r._model.load_costs == pytest.approx(
            {"a": 0.25, "b": (3 * 0.05 + 0.4) / 4, "c": (4 * pooled + 0.4) / 5})
        # the decision weighs each replica's loads by it: all three hold nothing, the store all
        dec = kvi.choose(320, 32, {"a": 0, "b": 0, "c": 0}, [True] * 10, {}, r._model, {"a": 0, "b": 1, "c": 2})
        assert [o.key for o in dec.ranked] == ["c", "b", "a"]
    finally:
        r._feed.close()


def test_learn_costs_must_be_a_bool():
    r = kv_router.MooncakeKVRouter.__new__(kv_router.MooncakeKVRouter)
    with pytest.raises(ValueError, match="learn_costs must be true or false, got 'yes'"):
        r.initialize_state(learn_costs="yes")


def test_loads_outside_the_steps_are_priced_by_the_time_they_add():
    """Asynchronous loads: from the step starting one to the step taking its request
    again, over the tokens loaded; a failed or abandoned load is not counted."""
    c = StepCosts(min_steps=4)
    run(c, [(2, 0), (300, 0)] * 10)
    assert c.estimate()["load_cost"] is None
    for i, (tokens, seconds) in enumerate([(100, 0.02), (300, 0.05), (200, 0.03), (400, 0.06)]):
        c.load_started(f"l{i}", tokens, 10.0)
        c.load_finished(f"l{i}", 10.0 + seconds)
        assert c.estimate()["load_samples"] == i + 1  # a price from the first load on
    c.load_started("failed", 1000, 10.0)
    c.load_finished("failed", 20.0, ok=False)
    c.load_finished("never-started", 20.0)
    est = c.estimate()
    assert est["loads"] == est["load_samples"] == 4
    assert est["load_s_per_token"] == pytest.approx(0.16 / 1000)
    assert est["load_cost"] == pytest.approx(0.16 / 1000 / COMPUTE_S)
