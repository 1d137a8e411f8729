"""Bad connector configuration fails before the engine serves, with an error naming the value."""

from __future__ import annotations

import pytest

from mooncake_ray.errors import ConfigError, MasterUnavailableError
from tests.vllm.harness import Engine, tiny_model


def vllm_config(role: str = "kv_both", extra: dict | None = None):
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=tiny_model(), block_size=32, max_model_len=1024, dtype="bfloat16", enforce_eager=True,
                      kv_transfer_config=KVTransferConfig(
                          kv_connector="MooncakeRayConnector", kv_connector_module_path="mooncake_ray.integrations.vllm",
                          kv_role=role, kv_connector_extra_config=extra or {})).create_engine_config()


def connector(cfg):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from mooncake_ray.integrations.vllm import MooncakeRayConnector

    return MooncakeRayConnector(cfg, KVConnectorRole.SCHEDULER, None)


def test_unknown_and_bad_extra_config_values_are_named(ray_cluster):
    with pytest.raises(ConfigError, match=r"namespce: got 'x'; unknown field"):
        connector(vllm_config(extra={"namespce": "x"}))
    with pytest.raises(ConfigError, match=r"load_mode: got 'eager'; allowed: 'async' or 'layerwise'"):
        connector(vllm_config(extra={"load_mode": "eager"}))


def test_bad_role_is_named():
    from vllm.config import KVTransferConfig

    with pytest.raises(ValueError, match="kv_decoder"):
        KVTransferConfig(kv_connector="MooncakeRayConnector", kv_role="kv_decoder")


def test_namespace_without_a_store_is_named(ray_cluster):
    with pytest.raises(MasterUnavailableError, match="'no-store-here'"):
        connector(vllm_config(extra={"namespace": "no-store-here"}))


def test_unreachable_ray_address_stops_the_engine_before_it_serves():
    # a real engine process, outside any Ray cluster: it must not come up
    e = Engine("badaddr", "kv_both", {"ray_address": "127.0.0.1:9", "connect_timeout_s": 2})
    try:
        res = e.wait_ready(timeout_s=300)
        assert "ready" not in res
        assert "ConfigError" in res["error"] and "'127.0.0.1:9' is unreachable" in res["error"]
        assert e.proc.wait(timeout=30) != 0
    finally:
        e.close()


def test_connector_stats_aggregate_across_workers_and_reduce_to_a_hit_rate():
    from mooncake_ray.integrations.vllm import MooncakeRayConnector, MooncakeRayKVStats

    a = MooncakeRayConnector.build_kv_connector_stats({"lookup_tokens": 200, "hit_tokens": 150, "loaded_bytes": 10})
    b = MooncakeRayKVStats(data={"loaded_bytes": 5, "save_failures": 1})
    out = a.aggregate(b).reduce()
    assert out == {"lookup_tokens": 200, "hit_tokens": 150, "loaded_bytes": 15, "save_failures": 1, "hit_rate": 0.75}
    assert not a.is_empty() and MooncakeRayKVStats(data={"loaded_bytes": 0}).is_empty()
