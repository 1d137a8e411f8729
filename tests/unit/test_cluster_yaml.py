"""cluster.yaml is a valid Ray cluster-launcher config (checked with Ray's own schema)."""

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_cluster_yaml_validates_against_rays_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    validate_config(prepare_config(cfg))  # as `ray up` does; raises on a violation
    assert any("mooncake_store" in c for c in cfg["worker_start_ray_commands"])


def test_serve_configs_name_the_builder_and_valid_args():
    from mooncake_ray.engines.model import ModelConfig

    for path in (ROOT / "serve_configs").glob("*.yaml"):
        app = yaml.safe_load(path.read_text())["applications"][0]
        if path.name.startswith("vllm-"):
            continue  # Ray Serve LLM apps: test_vllm_serve_configs_validate
        assert app["import_path"] == "mooncake_ray.serve:build_app", path
        assert app["args"]["mode"] in ("disaggregated", "aggregated")
        ModelConfig(**app["args"]["model"])  # unknown or mistyped fields raise


def test_vllm_serve_configs_validate():
    """The vLLM Serve configs: our builders, LLMConfigs Ray accepts, and connector extra
    configs the connector accepts (the backend's own deploy_store aside)."""
    from ray.serve.llm import LLMConfig

    from mooncake_ray.integrations.ray_serve_llm import BACKEND_KEYS
    from mooncake_ray.integrations.vllm import parse_config

    builders = {"vllm-disaggregated.yaml": "build_pd_app", "vllm-aggregated.yaml": "build_app"}
    for name, builder in builders.items():
        app = yaml.safe_load((ROOT / "serve_configs" / name).read_text())["applications"][0]
        assert app["import_path"] == f"mooncake_ray.integrations.ray_serve_llm:{builder}"
        args = app["args"]
        cfgs = args["llm_configs"] if "llm_configs" in args else [args["prefill_config"], args["decode_config"]]
        roles = []
        for cfg in cfgs:
            LLMConfig(**cfg)  # raises on a bad field
            kvt = cfg["engine_kwargs"]["kv_transfer_config"]
            assert kvt["kv_connector"] == "MooncakeRayConnector"
            extra = {k: v for k, v in kvt["kv_connector_extra_config"].items() if k not in BACKEND_KEYS}
            parse_config(extra)
            roles.append(kvt["kv_role"])
        assert roles == (["kv_both"] if "llm_configs" in args else ["kv_producer", "kv_consumer"])
