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
        assert app["import_path"] == "mooncake_ray.serve:build_app", path
        assert app["args"]["mode"] in ("disaggregated", "aggregated")
        ModelConfig(**app["args"]["model"])  # unknown or mistyped fields raise
