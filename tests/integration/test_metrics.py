"""Metrics reach a real Prometheus (scraping every Ray node's metrics endpoint), and
every query of the shipped Grafana dashboard runs against it, the disk tier's included:
the store has a spill tier and more values than its DRAM holds."""

import json
import time
from pathlib import Path

import ray

import mooncake_ray
from mooncake_ray._private.naming import MASTER_NAME
from tests.conftest import prometheus, query, wait_for  # noqa: F401 - fixture

DASHBOARD = Path(mooncake_ray.__file__).parent / "dashboards" / "mooncake-ray.json"
CONNECTOR_EXPRS = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] if "connector" in p["title"].lower()
                   for t in p["targets"]]
ROUTER_EXPRS = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] if "router" in p["title"].lower()
                for t in p["targets"]]
MEMBERSHIP_EXPRS = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"]
                    if "membership" in p["title"].lower() for t in p["targets"]]
MB = 1 << 20


def total(url: str, expr: str) -> float:
    return sum(float(r["value"][1]) for r in query(url, expr))


def test_store_metrics_in_prometheus_and_dashboard_queries(make_store, prometheus, tmp_path):
    s = make_store(segment_size_bytes="16mb",
                   spill={"enabled": True, "directory": str(tmp_path / "spill"), "capacity_bytes": "256mb"})
    n = 40
    for i in range(n):  # 40 MiB into 2 x 16 MiB of DRAM: the oldest are offloaded to disk
        s.put(f"m{i}", bytes([i % 256]) * MB)
    master = ray.get_actor(MASTER_NAME, namespace=s.config.namespace)
    keys = [f"m{i}" for i in range(n)]

    def disk_only():  # each node evicts its own oldest: which keys went depends on placement
        return [k for k, w in zip(keys, ray.get(master.where.remote(keys))) if w and all(t == "disk" for _, t, _ in w)]

    old = wait_for(lambda: len(disk_only()) >= 8 and disk_only()[:8],
                   timeout_s=30, interval_s=0.2, what="8 values to be disk-only")
    disk_reads = s.local_stats["disk_reads"]
    for k in old:  # each promoted from disk
        i = int(k[1:])
        assert s.get(k) == bytes([i % 256]) * MB
    promoted = s.local_stats["disk_reads"] - disk_reads
    assert promoted == len(old)
    for i in range(n - 8, n):  # DRAM hits, and misses
        s.batch_get([f"m{i}", "never"])

    # A KV chain whose head is removed: its tail goes at the master's next tick. (Its pages
    # are 1 MiB too: new chained pages may go to disk first, see adaptive.py.)
    s.put("c0", b"a" * MB)
    s.put("c1", b"b" * MB, parent="c0")
    s.put("c2", b"c" * MB, parent="c1")
    assert s.batch_exists(["c0", "c1", "c2"]) == [True] * 3
    assert s.remove("c0")
    wait_for(lambda: s.batch_exists(["c1", "c2"]) == [False, False], timeout_s=10, what="the tail to go")

    st = s.stats()
    assert st["chain_tail_evictions"] == 2 and st["orphaned_pages"] == 0 and st["lookups"] >= 5
    assert st["offloads"] > 0 and st["offload_bytes"] == st["offloads"] * MB
    assert st["disk_hits"] >= promoted and st["hits"] > 0 and st["misses"] > 0
    assert st["promotion_bytes"] == st["promotions"] * MB

    ns_nodes = {nid[:12] for nid in s.stats()["nodes"]}

    def keys_visible():
        want = {node_id[:12]: float(node["dram"]["keys"]) for node_id, node in s.stats()["nodes"].items()}
        res = query(prometheus, 'sum by (node) (ray_mooncake_keys{tier="dram"})')
        got = {r["metric"]["node"]: float(r["value"][1]) for r in res if r["metric"]["node"] in ns_nodes}
        return got == want

    wait_for(keys_visible, timeout_s=90, interval_s=1, what="store gauges in prometheus")
    cap = query(prometheus, 'ray_mooncake_capacity_bytes{tier="disk"}')
    assert {r["metric"]["node"] for r in cap} >= ns_nodes
    wait_for(lambda: total(prometheus, "ray_mooncake_evictions_total") > 0,
             timeout_s=60, interval_s=1, what="eviction counter")
    wait_for(lambda: query(prometheus, 'ray_mooncake_client_latency_seconds_bucket{op="put"}'),
             timeout_s=60, interval_s=1, what="client latency histogram")
    wait_for(lambda: query(prometheus, 'ray_mooncake_client_latency_seconds_bucket{op="get",tier="disk"}'),
             timeout_s=60, interval_s=1, what="client get latency of disk-tier reads")
    wait_for(lambda: query(prometheus, "ray_mooncake_misses_total"), timeout_s=60, interval_s=1, what="misses")
    # Per-tier hits and the disk tier's bytes: what the master counted reaches Prometheus.
    wait_for(lambda: total(prometheus, 'ray_mooncake_tier_hits_total{tier="disk"}') >= promoted,
             timeout_s=60, interval_s=1, what="disk-tier hits")
    wait_for(lambda: total(prometheus, 'ray_mooncake_tier_hits_total{tier="dram"}') > 0,
             timeout_s=60, interval_s=1, what="dram-tier hits")
    wait_for(lambda: total(prometheus, "ray_mooncake_offload_bytes_total") >= st["offloads"] * MB > 0,
             timeout_s=60, interval_s=1, what="offload bytes")
    wait_for(lambda: total(prometheus, "ray_mooncake_promotion_bytes_total") >= st["promotions"] * MB > 0,
             timeout_s=60, interval_s=1, what="promotion bytes")

    # Every query of the Grafana dashboard is valid PromQL against the real metric names,
    # and every panel but the engine connector's returns data.
    dash = json.loads(DASHBOARD.read_text())
    empty = []
    for panel in dash["panels"]:
        for t in panel["targets"]:
            if not query(prometheus, t["expr"]):
                empty.append((panel["title"], t["expr"]))
    # Rates need two scrapes of a change: keep the store busy (new values offload older
    # ones; reads of the least recently used promote them back), then every query has data.
    # The engine connector's, the KV router's and the membership panels stay empty:
    # tests/vllm and tests/integration/test_elastic.py check them.
    def missing():
        return [e for e in empty if e[1] not in CONNECTOR_EXPRS + ROUTER_EXPRS + MEMBERSHIP_EXPRS]

    deadline = time.monotonic() + 30
    nxt, lru = n, len(old)
    while missing() and time.monotonic() < deadline:
        time.sleep(1)
        for _ in range(2):
            s.put(f"m{nxt}", bytes([nxt % 256]) * MB)
            nxt += 1
        s.batch_get([f"m{i}" for i in range(nxt - 8, nxt)])
        s.get(f"m{lru}")
        s.batch_get([f"m{lru + 1}", f"m{lru + 2}"])
        lru += 3
        empty = [(p, e) for p, e in empty if not query(prometheus, e)]
    assert missing() == []
