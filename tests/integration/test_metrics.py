"""Metrics reach a real Prometheus (scraping every Ray node's metrics endpoint), and
every query of the shipped Grafana dashboard runs against it."""

import json
import time
from pathlib import Path

import mooncake_ray
from tests.conftest import prometheus, query, wait_for  # noqa: F401 - fixture

DASHBOARD = Path(mooncake_ray.__file__).parent / "dashboards" / "mooncake-ray.json"
CONNECTOR_EXPRS = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] if "connector" in p["title"].lower()
                   for t in p["targets"]]


def test_store_metrics_in_prometheus_and_dashboard_queries(make_store, prometheus):
    s = make_store(segment_size_bytes="16mb")
    for i in range(40):  # 40 MiB into 2 x 16 MiB: evictions
        s.put(f"m{i}", bytes(1 << 20))
    for i in range(40):
        s.batch_get([f"m{i}", "never"])
    ns_nodes = {n[:12] for n in s.stats()["nodes"]}
    st = s.stats()

    def keys_visible():
        res = query(prometheus, 'sum by (node) (ray_mooncake_keys{tier="dram"})')
        got = {r["metric"]["node"]: float(r["value"][1]) for r in res if r["metric"]["node"] in ns_nodes}
        return got if sum(got.values()) == st["keys"] and len(got) == 2 else None

    wait_for(keys_visible, timeout_s=90, interval_s=1, what="store gauges in prometheus")
    cap = query(prometheus, 'ray_mooncake_capacity_bytes{tier="dram"}')
    assert {r["metric"]["node"] for r in cap} >= ns_nodes
    wait_for(lambda: sum(float(r["value"][1]) for r in query(prometheus, "ray_mooncake_evictions_total")) > 0,
             timeout_s=60, interval_s=1, what="eviction counter")
    wait_for(lambda: query(prometheus, 'ray_mooncake_client_latency_seconds_bucket{op="put"}'),
             timeout_s=60, interval_s=1, what="client latency histogram")
    wait_for(lambda: query(prometheus, "ray_mooncake_misses_total"), timeout_s=60, interval_s=1, what="misses")

    # Every query of the Grafana dashboard is valid PromQL against the real metric names,
    # and the core panels return data.
    dash = json.loads(DASHBOARD.read_text())
    empty = []
    for panel in dash["panels"]:
        for t in panel["targets"]:
            if not query(prometheus, t["expr"]):
                empty.append((panel["title"], t["expr"]))
    # rates need two scrapes of a change; give them a moment, then everything has data
    deadline = time.monotonic() + 30
    while empty and time.monotonic() < deadline:
        time.sleep(2)
        s.batch_get([f"m{i}" for i in range(30, 40)])
        empty = [(p, e) for p, e in empty if not query(prometheus, e)]
    allowed_empty = {"sum(rate(ray_mooncake_offloads_total[1m]))", "sum(rate(ray_mooncake_promotions_total[1m]))"}
    allowed_empty |= set(CONNECTOR_EXPRS)  # engine connectors: tests/vllm checks them
    assert [e for e in empty if e[1] not in allowed_empty] == []
