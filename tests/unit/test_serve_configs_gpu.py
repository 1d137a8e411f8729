"""The GPU Ray Serve LLM configs (serve_configs/vllm-*-gpu.yaml), validated as a deployment
reads them, with no Ray cluster and no GPU: Serve's config schema, the builder's import path,
our builders' argument handling and Ray Serve LLM's own argument models (the first thing
Ray's builders do), vLLM's engine arguments and KV transfer config, the connector's extra
config, the tensor-parallel size against the model's geometry, the UCX environment, and the
prefill/decode roles. Nothing here starts Ray (``ray.init`` is made to fail)."""

from __future__ import annotations

import copy
import functools
import os
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
BUILDERS = {"vllm-aggregated-gpu.yaml": "build_app", "vllm-disaggregated-gpu.yaml": "build_pd_app"}
CPU_TWIN = {"vllm-aggregated-gpu.yaml": "vllm-aggregated.yaml",
            "vllm-disaggregated-gpu.yaml": "vllm-disaggregated.yaml"}

# Qwen3-8B's geometry, from its config.json on the Hugging Face hub (num_key_value_heads,
# num_hidden_layers, head_dim), hard-coded so nothing is downloaded: vLLM shards the KV heads
# over the TP ranks, so the TP size must divide them.
MODEL = "Qwen/Qwen3-8B"
KV_HEADS, LAYERS, HEAD_DIM = 8, 36, 128

# UCX transport names and aliases (ucx_info -c -f, UCX_TLS) a GPU host may list.
KNOWN_TLS = {"all", "self", "sm", "shm", "posix", "sysv", "cma", "knem", "xpmem", "tcp",
             "cuda", "cuda_copy", "cuda_ipc", "gdr_copy", "rc", "rc_v", "rc_x", "rc_verbs",
             "rc_mlx5", "ud", "ud_v", "ud_x", "dc", "dc_x", "ib", "srd"}
DEVICE_PATHS = ("auto", "direct", "staged")


@pytest.fixture(autouse=True)
def no_ray_cluster(monkeypatch):
    """Fail instead of starting a local Ray instance (Ray auto-initialises on some calls)."""
    import ray

    def refuse(*a, **k):
        raise AssertionError("this test must not start or join a Ray cluster")

    monkeypatch.setattr(ray, "init", refuse)


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / "serve_configs" / name).read_text())


def app_of(doc: dict) -> dict:
    (app,) = doc["applications"]
    return app


def raw_llm_configs(args: dict) -> dict[str, dict]:
    """The LLMConfig dicts of a builder's args, by where they sit."""
    if "llm_configs" in args:
        return {f"llm_configs[{i}]": c for i, c in enumerate(args["llm_configs"])}
    return {"prefill_config": args["prefill_config"], "decode_config": args["decode_config"]}


def serving_args(name: str, args: dict, monkeypatch):
    """``args`` through our builder's argument handling, then Ray Serve LLM's model of its
    builder's args (as ``build_openai_app`` / ``build_pd_openai_app`` begin)."""
    from ray.llm._internal.serve.core.ingress.builder import LLMServingArgs
    from ray.llm._internal.serve.serving_patterns.prefill_decode.builder import PDServingArgs

    from mooncake_ray.integrations import ray_serve_llm

    monkeypatch.setattr(ray_serve_llm, "register", lambda: None)  # needs Ray: not the point here
    prepared = ray_serve_llm._prepare(args)
    model = LLMServingArgs if BUILDERS[name] == "build_app" else PDServingArgs
    return model.model_validate(prepared)


def check_parallelism(engine_kwargs: dict) -> int:
    """The engine's GPU count (TP x PP) if the model's geometry allows it.

    Raises:
        ValueError: naming the bad size.
    """
    tp = engine_kwargs.get("tensor_parallel_size", 1)
    pp = engine_kwargs.get("pipeline_parallel_size", 1)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {tp!r}")
    if KV_HEADS % tp:
        raise ValueError(f"tensor_parallel_size {tp!r} does not divide {MODEL}'s {KV_HEADS} KV heads")
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1 or pp > LAYERS:
        raise ValueError(f"pipeline_parallel_size must be an int in [1, {LAYERS}], got {pp!r}")
    return tp * pp


def connector_extra(kvt: dict) -> dict:
    """The extra config the connector sees: the backend's own keys (deploy_store) removed."""
    from mooncake_ray.integrations.ray_serve_llm import BACKEND_KEYS

    return {k: v for k, v in (kvt.get("kv_connector_extra_config") or {}).items() if k not in BACKEND_KEYS}


@functools.lru_cache(maxsize=1)
def ucx_settings() -> frozenset[str] | None:
    """Names of the settings the bundled UCX knows (``ucx_info -c``), or None without it."""
    try:
        import libucx
    except ImportError:
        return None
    d = os.path.dirname(libucx.__file__)
    exe = os.path.join(d, "bin", "ucx_info")
    if not os.access(exe, os.X_OK):
        return None
    env = dict(os.environ, LD_LIBRARY_PATH=os.path.join(d, "lib"))
    out = subprocess.run([exe, "-c"], env=env, capture_output=True, text=True, timeout=30, check=True).stdout
    return frozenset(line.split("=", 1)[0] for line in out.splitlines() if line.startswith("UCX_"))


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_parses_as_a_serve_config_naming_our_builder(name):
    from ray._common.utils import import_attr
    from ray.serve.schema import ServeDeploySchema

    from mooncake_ray.integrations import ray_serve_llm

    doc = load(name)
    schema = ServeDeploySchema.model_validate(doc)  # what `serve run` / `serve deploy` check
    (app,) = schema.applications
    builder = import_attr(app.import_path)  # as Serve resolves it
    assert callable(builder)
    assert builder is getattr(ray_serve_llm, BUILDERS[name]), app.import_path
    assert "tiny_model" not in app.args  # a real model, nothing built locally


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_llm_configs_validate_as_ray_serve_llm_and_vllm_read_them(name, monkeypatch):
    args = app_of(load(name))["args"]
    validated = serving_args(name, args, monkeypatch)
    llm_configs = validated.llm_configs if hasattr(validated, "llm_configs") else \
        [validated.prefill_config, validated.decode_config]
    assert len(llm_configs) == len(raw_llm_configs(args))
    for cfg in llm_configs:
        assert cfg.model_id == MODEL and cfg.model_loading_config.model_source == MODEL
        assert cfg.accelerator_config.kind == "gpu" and cfg.accelerator_type, cfg.accelerator_type
        assert not any(k.startswith("VLLM_CPU") for k in cfg.runtime_env["env_vars"])
        # Splits engine_kwargs into vLLM's engine and frontend args (an unknown one raises)
        # and validates placement_group_config, which LLMConfig alone takes as any dict.
        engine = cfg.get_engine_config()
        devices = check_parallelism(cfg.engine_kwargs)
        assert engine.num_devices == devices
        bundles = engine.placement_bundles  # what the replica's placement group asks for
        assert sum(b.get("GPU", 0) for b in bundles) == devices, bundles
        assert all(b.get(f"accelerator_type:{cfg.accelerator_type}") for b in bundles), bundles
        assert 0 < cfg.engine_kwargs["gpu_memory_utilization"] <= 1


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_kv_transfer_config_names_our_connector_and_passes_its_parser(name):
    from vllm.config import KVTransferConfig

    from mooncake_ray.integrations.vllm import parse_config

    for where, cfg in raw_llm_configs(app_of(load(name))["args"]).items():
        kvt = cfg["engine_kwargs"]["kv_transfer_config"]
        assert kvt["kv_connector"] == "MooncakeRayConnector", where
        assert kvt["kv_connector_module_path"] == "mooncake_ray.integrations.vllm", where
        KVTransferConfig(**kvt)  # vLLM's own check of the roles and fields
        extra = connector_extra(kvt)
        assert extra.get("device_path") in DEVICE_PATHS, (where, extra.get("device_path"))
        parsed = parse_config(extra)  # ConfigError naming any unknown key or bad value
        assert parsed.device_path == extra["device_path"]


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_ucx_environment_suits_gpu_memory(name):
    known = ucx_settings()
    for where, cfg in raw_llm_configs(app_of(load(name))["args"]).items():
        env = cfg["runtime_env"]["env_vars"]
        tls = env["UCX_TLS"].split(",")
        assert "cuda_copy" in tls, (where, tls)
        # no shared-memory message queue: a sender dying mid-message blocks its receiver
        assert not set(tls) & {"all", "sm", "shm", "mm", "posix", "sysv", "xpmem"}, (where, tls)
        assert set(tls) <= KNOWN_TLS, (where, set(tls) - KNOWN_TLS)
        assert env["UCX_MEMTYPE_CACHE"] == "n", where
        assert all(isinstance(v, str) for v in env.values()), env  # env vars are strings
        if known is not None:  # names checked against the UCX the transport is built on
            assert {k for k in env if k.startswith("UCX_")} <= known, (where, env)


def test_disaggregated_roles_follow_the_cpu_config():
    from mooncake_ray.integrations.ray_serve_llm import BACKEND_KEYS

    gpu = raw_llm_configs(app_of(load("vllm-disaggregated-gpu.yaml"))["args"])
    cpu = raw_llm_configs(app_of(load("vllm-disaggregated.yaml"))["args"])
    roles = {"prefill_config": "kv_producer", "decode_config": "kv_consumer"}
    for where, role in roles.items():
        gkvt = gpu[where]["engine_kwargs"]["kv_transfer_config"]
        ckvt = cpu[where]["engine_kwargs"]["kv_transfer_config"]
        assert gkvt["kv_role"] == ckvt["kv_role"] == role, where
        # The same connector settings as the CPU config, less the store it deploys there
        # (here `mooncake-ray start` runs it), plus device_path.
        gkeys = set(gkvt["kv_connector_extra_config"]) - {"device_path"}
        ckeys = set(ckvt["kv_connector_extra_config"]) - set(BACKEND_KEYS)
        assert gkeys == ckeys, (where, gkeys ^ ckeys)
    # Blocks move between the two engines keyed by model, geometry, dtype and TP rank.
    p, d = gpu["prefill_config"], gpu["decode_config"]
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "dtype", "block_size", "max_model_len"):
        assert p["engine_kwargs"].get(key) == d["engine_kwargs"].get(key), key
    assert p["model_loading_config"] == d["model_loading_config"]
    assert p["runtime_env"] == d["runtime_env"]
    pe, de = (c["engine_kwargs"]["kv_transfer_config"]["kv_connector_extra_config"] for c in (p, d))
    assert pe["namespace"] == de["namespace"] and pe["device_path"] == de["device_path"]


def test_aggregated_engines_save_and_load():
    (cfg,) = raw_llm_configs(app_of(load("vllm-aggregated-gpu.yaml"))["args"]).values()
    assert cfg["engine_kwargs"]["kv_transfer_config"]["kv_role"] == "kv_both"


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_bad_device_path_is_rejected_naming_it(name):
    from mooncake_ray.errors import ConfigError
    from mooncake_ray.integrations.vllm import parse_config

    for where, cfg in raw_llm_configs(app_of(load(name))["args"]).items():
        extra = connector_extra(cfg["engine_kwargs"]["kv_transfer_config"])
        parse_config(extra)  # the file's value passes, so the failure below is the value's
        bad = dict(extra, device_path="gpu")
        with pytest.raises(ConfigError, match=r"device_path.*'gpu'.*allowed") as e:
            parse_config(bad)
        assert all(p in str(e.value) for p in DEVICE_PATHS), str(e.value)


@pytest.mark.parametrize("tp", [3, 16, 0, -2, "2", 2.0, True])
def test_bad_tensor_parallel_size_is_rejected_naming_it(tp):
    args = app_of(load("vllm-disaggregated-gpu.yaml"))["args"]
    check_parallelism(args["prefill_config"]["engine_kwargs"])  # the file's value passes
    bad = copy.deepcopy(args["prefill_config"]["engine_kwargs"])
    bad["tensor_parallel_size"] = tp
    with pytest.raises(ValueError, match=f"tensor_parallel_size.*{tp!r}"):
        check_parallelism(bad)
