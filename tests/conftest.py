"""Shared fixtures: a real multi-node Ray cluster on this machine (ray.cluster_utils),
and stores deployed onto it, each in a namespace of its own so tests do not see each
other's keys or actors."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
import uuid

import pytest

# Tests run inside a private network namespace (see the Makefile); keep Ray quiet and
# on loopback.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

STORE_RESOURCE = "mooncake_store"
SCRAPE_S = "5s"  # the test Prometheus's scrape interval and timeout (running_prometheus)


def wait_for(predicate, timeout_s: float = 30.0, interval_s: float = 0.05, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value (returned) or time runs out."""
    deadline = time.monotonic() + timeout_s
    last_exc = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as e:  # noqa: BLE001 - keep polling, report the last error
            last_exc = e
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; last error: {last_exc!r}")


@pytest.fixture(scope="module", autouse=True)
def no_event_feed_left():
    """A KV event feed a module leaves running in the test process keeps a thread (a router
    made in a unit test once left one spinning through every later module)."""
    import threading

    yield
    left = [t.name for t in threading.enumerate() if t.name == "mooncake-kv-events"]
    assert not left, f"{len(left)} KV event feed thread(s) left running by this module"


def _uses_cluster(item) -> bool:
    return "ray_cluster" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(session, config, items):
    """The modules none of whose tests use the shared cluster (``ray_cluster``) run after
    every module that does, in their own order, and the cluster is shut down after its last
    test: idle, its three nodes take about 8% of a 2-vCPU host, while the Serve apps, the
    demo and the unit tests run."""
    def module(item) -> str:
        return item.nodeid.split("::")[0]

    users = {module(i) for i in items if _uses_cluster(i)}
    first = [i for i in items if module(i) in users]
    items[:] = first + [i for i in items if module(i) not in users]
    # The last test of the last module that uses it, not the last test that asks for it:
    # a module-scoped fixture built on the cluster (an actor pair) is torn down only when
    # its module ends, and a test after the last user in that module would otherwise run
    # with the cluster gone under it (the fixture's teardown then met a new local Ray).
    config.stash[_LAST_CLUSTER_TEST] = first[-1].nodeid if first else None


_LAST_CLUSTER_TEST = pytest.StashKey[str]()
_CLUSTER: dict = {}


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the test's fixtures are torn down
    if nextitem is not None and item.nodeid == item.config.stash.get(_LAST_CLUSTER_TEST, None):
        _shutdown_cluster()


def _cpu_ticks() -> tuple[int, int]:
    """The host's busy and total CPU ticks since boot (``/proc/stat``, every CPU)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return sum(v) - v[3] - v[4], sum(v)  # less idle and iowait


_IDLE = pytest.StashKey[list]()
_CPUS = os.cpu_count() or 1
IDLE_REPORT = 15  # the tests (set-up, call and teardown together) that left the CPUs idle longest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Per test, how much of the host's CPU time went unused while it ran: on a 2-vCPU host
    the suite's time is its CPU work plus its waits (start-ups, timeouts, heartbeats), and
    these are the waits."""
    t0, (b0, n0) = time.monotonic(), _cpu_ticks()
    yield
    wall, (b1, n1) = time.monotonic() - t0, _cpu_ticks()
    if n1 > n0:
        idle_cpu_s = wall * _CPUS * (1 - (b1 - b0) / (n1 - n0))
        item.config.stash.setdefault(_IDLE, []).append((idle_cpu_s, wall, item.nodeid))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    rows = sorted(config.stash.get(_IDLE, []), reverse=True)
    if not rows:
        return
    total_idle, total_wall = sum(r[0] for r in rows), sum(r[1] for r in rows)
    tr = terminalreporter
    tr.write_sep("=", f"CPU left idle: {total_idle:.0f} CPU-s of {total_wall * _CPUS:.0f} "
                      f"({_CPUS} CPUs x {total_wall:.0f} s); the {IDLE_REPORT} tests that left the most")
    for idle, wall, nodeid in rows[:IDLE_REPORT]:
        tr.write_line(f"{idle:8.1f} CPU-s idle of {wall:7.1f} s  {nodeid}")


def _shutdown_cluster() -> None:
    cluster = _CLUSTER.pop("cluster", None)
    if cluster is None:
        return
    import ray

    ray.shutdown()
    cluster.shutdown()
    from mooncake_ray._private.store import arena

    arena.collect_garbage("/dev/shm")  # arenas of store nodes the shutdown killed


@pytest.fixture(scope="session")
def ray_cluster():
    """Three Ray nodes: a head that offers no store memory (client-only) and two workers
    with the store resource. Shut down after the last test that uses it."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "include_dashboard": False,
        # export metrics every second (default 10 s) so the Prometheus test is quick
        "_system_config": {"metrics_report_interval_ms": 1000},
    })
    workers = [cluster.add_node(num_cpus=1, resources={STORE_RESOURCE: 1}) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    cluster.store_node_ids = [w.node_id for w in workers]
    _CLUSTER["cluster"] = cluster
    yield cluster
    _shutdown_cluster()


def store_config(**overrides) -> dict:
    cfg = {
        "namespace": f"t{uuid.uuid4().hex[:10]}",
        "segment_size_bytes": "64mb",
        "transport": {"devices": ["lo"], "rpc_timeout_s": 2.0, "transfer_timeout_s": 5.0},
        "master": {"node_ttl_s": 3.0, "heartbeat_interval_s": 0.3, "recovery_timeout_s": 10.0},
        "client": {"master_retry_timeout_s": 30.0},
    }
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k] = {**cfg[k], **v}
        else:
            cfg[k] = v
    return cfg


@pytest.fixture
def make_store(ray_cluster):
    """Deploy stores onto the shared cluster; each is torn down after the test."""
    import mooncake_ray
    from mooncake_ray._private import deploy

    made = []

    def make(**overrides):
        cfg = store_config(**overrides)
        client = mooncake_ray.start(cfg)
        made.append((client, cfg["namespace"]))
        return client

    yield make
    for client, ns in made:
        client.close()
        deploy.teardown(ns)


def _free_port() -> int:
    from tests.integration.serve_cli import free_port

    return free_port()


@pytest.fixture
def prometheus(ray_cluster, tmp_path):
    """A real Prometheus scraping every Ray node's metrics endpoint; yields its URL."""
    import ray

    with running_prometheus([f"{n['NodeManagerAddress']}:{n['MetricsExportPort']}" for n in ray.nodes()
                             if n["Alive"]], tmp_path) as url:
        yield url


@contextlib.contextmanager
def running_prometheus(targets: list[str], tmp_path):
    """A real Prometheus scraping ``targets`` (``host:port``) every ``SCRAPE_S``; yields its URL.

    A scrape must be answered within its interval (Prometheus's timeout is the interval
    when that is shorter than 10 s), and a Ray node's metrics agent renders its page in
    about a second on a 2-vCPU host while vLLM engines run (0.98 s measured on an AVX2
    host): at a 1 s interval the head node's scrapes timed out (``up`` 0) and counters its
    processes exported never reached Prometheus."""
    import httpx

    exe = shutil.which("prometheus")
    if exe is None:
        pytest.fail("prometheus is not installed (make test installs Debian's prometheus)")
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(json.dumps({  # YAML is a superset of JSON
        "global": {"scrape_interval": SCRAPE_S, "scrape_timeout": SCRAPE_S, "evaluation_interval": SCRAPE_S},
        "scrape_configs": [{"job_name": "ray", "static_configs": [{"targets": targets}]}],
    }))
    port = _free_port()
    proc = subprocess.Popen([exe, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(f"{url}/-/ready", timeout=1).status_code == 200, timeout_s=60,
                 what="prometheus to start")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def scrapes(url: str) -> str:
    """Each target's last scrape, for a failure message: ``instance up=0|1 (seconds)``."""
    try:
        took = {r["metric"]["instance"]: float(r["value"][1]) for r in query(url, "scrape_duration_seconds")}
        return ", ".join(f"{r['metric']['instance']} up={r['value'][1]} ({took.get(r['metric']['instance'], 0):.2f}s)"
                         for r in query(url, "up"))
    except Exception as e:  # noqa: BLE001 - only a diagnostic
        return f"unknown ({e!r})"


def wait_for_series(url: str, predicate, timeout_s: float, what: str, interval_s: float = 1.0):
    """``wait_for`` on a Prometheus query; a timeout names each target's last scrape."""
    try:
        return wait_for(predicate, timeout_s=timeout_s, interval_s=interval_s, what=what)
    except AssertionError as e:
        raise AssertionError(f"{e}; scrapes: {scrapes(url)}") from None


def query(url: str, expr: str) -> list:
    """An instant PromQL query; the result vector."""
    import httpx

    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=5)
    body = r.json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]
