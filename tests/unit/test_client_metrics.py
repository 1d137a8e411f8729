"""Client, connector and router totals: counted in process and exported as running
totals, so an export the metrics agent loses is repaired by the next one."""

import os

import pytest

from mooncake_ray._private import metrics as m


class FakeGauge:
    """Stands in for ``ray.util.metrics.Gauge``: records every ``set`` (Ray's gauge
    needs a running Ray worker; what is under test is what we hand it)."""

    made: dict[str, "FakeGauge"] = {}

    def __init__(self, name, description="", tag_keys=()):
        self.name, self.tag_keys, self.sets = name, tuple(tag_keys), []
        FakeGauge.made[name] = self

    def set(self, value, tags=None):
        assert set(tags) == set(self.tag_keys), (self.name, tags, self.tag_keys)
        self.sets.append((value, dict(tags)))


@pytest.fixture
def gauges(monkeypatch):
    FakeGauge.made = {}
    monkeypatch.setattr(m.metrics, "Gauge", FakeGauge)
    return FakeGauge.made


def last(g: FakeGauge, **tags) -> float:
    return [v for v, t in g.sets if all(t[k] == x for k, x in tags.items())][-1]


def test_bytes_by_direction_for_single_and_batch_calls():
    c = m.ClientMetrics()
    c.observe("put", 0.001, 1, 10)
    c.observe("batch_put", 0.001, 4, 100)
    c.observe("get", 0.001, 1, 1000)
    c.observe("batch_get", 0.001, 4, 10000, tier="disk")
    c.fold()
    totals = c.totals.totals()
    assert totals[("client_bytes", (("direction", "write"),))] == 110
    assert totals[("client_bytes", (("direction", "read"),))] == 11000
    assert {t[0][1]: v for (name, t), v in totals.items() if name == "client_ops"} == {
        "put": 1, "batch_put": 4, "get": 1, "batch_get": 4}


def test_an_export_carries_the_whole_count_so_a_lost_one_is_repaired(gauges):
    t = m.RunningTotals({"client_ops": ("ops", ("op",))})
    t.add("client_ops", 3, {"op": "put"})
    t.export()  # say the metrics agent drops this one
    t.add("client_ops", 2, {"op": "put"})
    t.add("client_ops", 7, {"op": "get"})
    t.export()
    g = gauges["mooncake_client_ops_total"]
    assert g.tag_keys == ("op", "pid")
    assert last(g, op="put") == 5 and last(g, op="get") == 7
    # an unchanged total is set again at every export (Ray drops a gauge not refreshed
    # within two export intervals)
    n = len(g.sets)
    t.export()
    assert len(g.sets) == n + 2 and last(g, op="put") == 5
    assert {tags["pid"] for _, tags in g.sets} == {str(os.getpid())}


def test_connector_and_router_totals_are_running_totals(gauges):
    c = m.ConnectorMetrics("kv_both")
    c.add("hit_tokens", 16)
    c.add("hit_tokens", 32)
    c.add("not_a_counter", 1)  # ignored, as before
    c.flush()
    c.flush()
    g = gauges["mooncake_connector_hit_tokens_total"]
    assert [v for v, _ in g.sets] == [48, 48]
    assert g.sets[-1][1] == {"role": "kv_both", "pid": str(os.getpid())}

    from mooncake_ray.integrations import kv_router

    class Noop:
        def __init__(self, *a, **k):
            pass

        def observe(self, *a, **k):
            pass

    import ray.util.metrics as rm

    orig = rm.Histogram
    rm.Histogram = Noop
    try:
        r = kv_router._Metrics()
    finally:
        rm.Histogram = orig
    r.decided("engine", 100, 64, 16, 0.001)
    r.decided("balance", 50, 0, 0, 0.001)
    r.batch("replica-1", 12)
    r.gap("lost")
    r.flush()
    assert last(gauges["mooncake_router_decisions_total"], reason="engine") == 1
    assert last(gauges["mooncake_router_prompt_tokens_total"]) == 150
    assert last(gauges["mooncake_router_expected_cached_tokens_total"], source="store") == 16
    assert last(gauges["mooncake_router_event_gaps_total"], outcome="lost") == 1
    assert last(gauges["mooncake_router_index_blocks"], replica="replica-1") == 12
