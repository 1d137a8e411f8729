"""start() failures: each a typed error naming its cause, within seconds, and no actor left
behind (checked before any actor is created)."""

import subprocess
import time

import pytest
import ray

import mooncake_ray
from mooncake_ray import ConfigError, NodeUnavailableError, StoreConfig
from mooncake_ray._private import deploy, preflight
from mooncake_ray._private.naming import MASTER_NAME
from tests.conftest import store_config


def _actors(namespace: str) -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a.get("namespace") == namespace]


def _start_fails(cfg: dict, exc, *patterns):
    t0 = time.monotonic()
    with pytest.raises(exc) as info:
        mooncake_ray.start(cfg)
    took = time.monotonic() - t0
    for p in patterns:
        assert p in str(info.value), f"{p!r} not in {info.value}"
    return took


def test_segment_larger_than_memory(ray_cluster):
    cfg = store_config(segment_size_bytes="1tb")
    took = _start_fails(cfg, ConfigError, "segment_size_bytes=1099511627776", "1024.00 GiB",
                        "x 2 store node(s)", "available there")
    assert took < 20
    assert _actors(cfg["namespace"]) == []


def test_arenas_that_fit_alone_but_not_together(ray_cluster):
    """Store nodes on one host: their arenas are summed against its memory. (The check is
    called directly: were it wrong, a start would pre-fault 1.5x this host's memory.)"""
    each = (preflight.mem_available() - preflight.MEMORY_HEADROOM) * 3 // 4
    cfg = StoreConfig.model_validate(store_config(segment_size_bytes=each))
    node = next(n for n in ray.nodes() if n["NodeID"] == ray_cluster.store_node_ids[0])
    preflight.check_nodes(cfg, [node])  # one fits
    with pytest.raises(ConfigError, match=rf"segment_size_bytes={each} .* x 2 store node\(s\)"):
        preflight.check_nodes(cfg, [node, node])


def test_spill_directory_is_a_file(ray_cluster, tmp_path):
    f = tmp_path / "spill-file"
    f.write_bytes(b"x")
    cfg = store_config(spill={"enabled": True, "directory": str(f)})
    _start_fails(cfg, ConfigError, f"spill.directory={str(f)!r} exists and is not a directory")
    assert _actors(cfg["namespace"]) == []
    assert f.read_bytes() == b"x"


def test_spill_directory_read_only(ray_cluster, tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    # root ignores file modes: a read-only mount (the tests run in a private mount namespace)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(d)], check=True)
    try:
        cfg = store_config(spill={"enabled": True, "directory": str(d)})
        _start_fails(cfg, ConfigError, f"spill.directory={str(d)!r} is not writable", "Read-only file system")
        assert _actors(cfg["namespace"]) == []
    finally:
        subprocess.run(["umount", str(d)], check=True)


@pytest.mark.parametrize("opts,match", [
    ({"NOT_A_VAR": "x"}, "NOT_A_VAR=x rejected"),
    ({"RNDV_THRESH": "abc"}, "RNDV_THRESH=abc rejected"),
])
def test_bad_ucx_options(ray_cluster, opts, match):
    cfg = store_config(transport={"ucx_options": opts})
    _start_fails(cfg, ConfigError, match)
    assert _actors(cfg["namespace"]) == []


def test_store_node_constructor_failure_names_its_cause(ray_cluster, monkeypatch):
    """Past the checks (memory taken after them, here: the check skipped), the store node
    refuses an arena larger than the host's memory before touching it, and start() says why."""
    monkeypatch.setattr(preflight, "check_nodes", lambda cfg, nodes: None)
    cfg = store_config(segment_size_bytes="1tb")
    try:
        took = _start_fails(cfg, NodeUnavailableError, "failed to start", "segment_size_bytes=1099511627776",
                            "more than this host's available memory")
        assert took < 60
    finally:
        deploy.teardown(cfg["namespace"])
    assert MASTER_NAME not in _actors(cfg["namespace"])


def test_good_start_after_failures(make_store):
    """The failed starts left nothing behind that stops a good one."""
    st = make_store(segment_size_bytes="8mb")
    st.put("k", b"v")
    assert st.get("k") == b"v"
