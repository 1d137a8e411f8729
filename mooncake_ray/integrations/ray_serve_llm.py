"""Ray Serve LLM serving vLLM with the mooncake-ray KV connector.

``serve run serve_configs/vllm-disaggregated.yaml`` (or ``vllm-aggregated.yaml``) deploys
Ray Serve LLM's OpenAI app, prefill/decode disaggregated or not, with every vLLM engine
carrying ``kv_transfer_config: {kv_connector: MooncakeRayConnector, kv_connector_module_path:
mooncake_ray.integrations.vllm, ...}``. The app builders here take the same ``args`` as
Ray's ``build_pd_openai_app`` / ``build_openai_app`` (``prefill_config`` / ``decode_config``,
or ``llm_configs``: LLMConfig dicts) plus an optional ``tiny_model`` key::

    tiny_model: {out_dir: /tmp/mooncake-ray/tiny-llama, layers: 2, hidden: 256}

which builds the local random-weight model of :mod:`mooncake_ray.integrations.tiny_model`
there first (idempotent; the path must be readable on every node that runs an engine).

How the KV moves. Ray's default P/D protocol runs the prefill request first (clamped to one
token, with ``kv_transfer_params={"do_remote_decode": True, ...}``) and copies its response's
``kv_transfer_params`` into the decode request. The prefill engine (``kv_producer``) saves
the prompt's blocks in the store, keeps them in its own memory and names them in those
params; the decode engine (``kv_consumer``) reads them straight from the prefill engine's
memory over the transport, or from the store if that fails (see
``mooncake_ray.integrations.vllm``). So the backend needs no peer binding: the default
protocol carries everything.

What :class:`MooncakeRayConnectorBackend` adds (its ``setup()`` runs in each LLMServer
replica before the engine starts):

- vLLM's engine-core process is a plain subprocess of the replica, not a Ray worker, so the
  connector must ``ray.init(address=...)`` itself: unless the extra config names a
  ``ray_address``, the replica's own cluster (its GCS address) is put there.
- ``kv_connector_extra_config.deploy_store`` (a StoreConfig dict) deploys the store onto the
  cluster (idempotent: the replicas that start second find it) and is removed from the
  config vLLM sees; the connector's ``namespace`` is taken from it when not given. Without
  it the connector connects to a store already running in its namespace
  (``mooncake-ray start`` or ``mooncake_ray.start(config)``).

- when the deployment routes with ``MooncakeKVRouter`` (``request_router_config``), the
  engine publishes its KV events on two free ports of the node and the replica records
  them in the GCS for the router (:mod:`mooncake_ray.integrations.kv_router`).

Ray resolves a connector's backend by the ``kv_connector`` name through a registry kept in
the cluster's GCS; :func:`register` puts ours there (the builders call it).

The builders also give every LLM config without a ``callback_config`` of its own
:class:`LocalModelCallback`: Ray starts each engine replica with a task per node of its
placement group that resolves the model's files. For a model with no cloud mirror (a local
path, a Hugging Face id) that task returns the name it was given, after importing torch,
transformers and Ray Serve LLM in a fresh worker: 10-15 s of CPU on the replica's critical
path. The callback skips it where every bundle of the replica is on its own node.
"""

from __future__ import annotations

import copy
import logging

from ray.llm._internal.common.callbacks.base import CallbackBase
from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
from ray.llm._internal.serve.engines.vllm.kv_transfer.base import (
    BaseConnectorBackend,
    DefaultPDProtocolMixin,
)

log = logging.getLogger(__name__)

CONNECTOR_NAME = "MooncakeRayConnector"
CONNECTOR_MODULE = "mooncake_ray.integrations.vllm"
BACKEND_PATH = "mooncake_ray.integrations.ray_serve_llm:MooncakeRayConnectorBackend"
DEFAULT_NAMESPACE = "mooncake_ray"

# Keys of kv_connector_extra_config that are ours (the backend's), never the connector's.
BACKEND_KEYS = ("deploy_store",)


class MooncakeRayConnectorBackend(DefaultPDProtocolMixin, BaseConnectorBackend):
    """Ray Serve LLM backend of the ``MooncakeRayConnector`` vLLM KV connector.

    No peer binding and sequential handoff (the defaults): the prefill response names the
    blocks the decode engine reads (from the prefill's memory, else the store).
    """

    def setup(self) -> None:
        import ray

        ktc = self.kv_transfer_config
        extra = dict(ktc.get("kv_connector_extra_config") or {})

        store_cfg = extra.pop("deploy_store", None)
        if store_cfg is not None:
            from mooncake_ray.config import load_config
            from mooncake_ray._private import deploy

            cfg = load_config(store_cfg)
            ns = extra.setdefault("namespace", cfg.namespace)
            if ns != cfg.namespace:
                raise ValueError(
                    f"kv_connector_extra_config: namespace {ns!r} differs from deploy_store's "
                    f"namespace {cfg.namespace!r}")
            log.info("deploying (or finding) the mooncake-ray store in namespace %r", cfg.namespace)
            deploy.deploy(cfg)
        else:
            self._check_store(extra.get("namespace", DEFAULT_NAMESPACE))

        if not extra.get("ray_address"):
            # vLLM's engine core is not a Ray worker: it joins this replica's cluster.
            extra["ray_address"] = ray.get_runtime_context().gcs_address

        from mooncake_ray.integrations.kv_router import uses_router

        if uses_router(self.llm_config.deployment_config):
            extra["router_key"] = self._publish_kv_events()

        # In place, so every holder of this dict (the LLMConfig's engine_kwargs, an engine
        # config built from it earlier) sees it, and explicitly through Ray's own updater.
        ktc["kv_connector_extra_config"] = extra
        self.llm_config.update_engine_kwargs(kv_transfer_config=ktc)

    def _publish_kv_events(self) -> str:
        """This replica's engine publishes its KV events on two free ports of the node (live
        and replay); the record naming them (and the model's tokenizer source) goes to the
        GCS for ``MooncakeKVRouter``. Returns the replica's id, the record's key."""
        import ray
        from ray import serve

        from mooncake_ray.integrations.kv_router import events_config, put_record

        rid = serve.get_replica_context().replica_id.to_full_id_str()
        ek = self.llm_config.engine_kwargs
        if ek.get("enable_prefix_caching") is False:
            log.warning("MooncakeKVRouter: enable_prefix_caching is off, so the engine has no cache to "
                        "report; routing uses the store and load only")
        if ek.get("kv_events_config"):
            log.warning("MooncakeKVRouter: engine_kwargs.kv_events_config replaced by the router's own")
        cfg, rec = events_config(ray.util.get_node_ip_address())
        self.llm_config.update_engine_kwargs(kv_events_config=cfg)
        source = self.llm_config.model_loading_config.model_source
        rec["model_source"] = source if isinstance(source, str) else self.llm_config.model_id
        rec["chat_template"] = ek.get("chat_template")
        put_record(rid, "events", rec)
        log.info("KV events of replica %s on %s (replay %s)", rid, rec["endpoint"], rec["replay_endpoint"])
        return rid

    @staticmethod
    def _check_store(namespace: str) -> None:
        import ray
        from mooncake_ray._private.naming import MASTER_NAME

        try:
            ray.get_actor(MASTER_NAME, namespace=namespace)
        except ValueError:
            log.warning(
                "no mooncake-ray store in Ray namespace %r yet: deploy one (`mooncake-ray start`, "
                "mooncake_ray.start(config)) or set kv_connector_extra_config.deploy_store",
                namespace)


class LocalModelCallback(CallbackBase):
    """Skips Ray Serve LLM's model-resolving task where it would only return the model's name:
    no cloud mirror, not a remote path, every bundle of the replica's placement group on this
    node. It still creates torch's ``kernels`` cache directory, as that task does."""

    async def on_before_node_init(self) -> None:
        import os

        import ray

        ec = self.llm_config.get_engine_config()
        pg = self.ctx.placement_group
        nodes = set(ray.util.placement_group_table(pg)["bundles_to_node_id"].values()) if pg else None
        if not resolves_to_itself(ec.actual_hf_model_id, ec.mirror_config, nodes,
                                  ray.get_runtime_context().get_node_id()):
            return
        import torch

        os.makedirs(os.path.join(torch.hub._get_torch_home(), "kernels"), exist_ok=True)
        self.ctx.run_init_node = False
        log.info("model %s has no cloud mirror: not running the model-resolving task",
                 ec.actual_hf_model_id)


def resolves_to_itself(model: str | None, mirror_config, bundle_nodes: set | None, node: str) -> bool:
    """Whether Ray Serve LLM's model-resolving task would only return ``model``, on this node
    alone: no cloud mirror, not a remote path, every bundle (if a placement group is given) on
    ``node``."""
    from ray.llm._internal.common.utils.cloud_utils import is_remote_path

    if mirror_config is not None or not model or is_remote_path(model):
        return False
    return bundle_nodes is None or bundle_nodes == {node}


CALLBACK_PATH = "mooncake_ray.integrations.ray_serve_llm:LocalModelCallback"


def _with_callback(cfg):
    """``cfg`` (an LLM config: dict, ``LLMConfig`` or a file's path) with
    :class:`LocalModelCallback` where it names no callback of its own."""
    if isinstance(cfg, dict):
        if not cfg.get("callback_config"):
            cfg["callback_config"] = {"callback_class": CALLBACK_PATH}
    elif isinstance(cfg, LLMConfig) and cfg.callback_config.callback_class is CallbackBase \
            and cfg._callback_instance is None:
        cfg.callback_config.callback_class = CALLBACK_PATH
    return cfg


def register() -> None:
    """Register the backend under the connector's name in Ray Serve LLM's registry (kept in
    the cluster's GCS, so every replica finds it). Needs Ray initialised; idempotent."""
    import ray
    from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import KVConnectorBackendFactory

    if not ray.is_initialized():
        raise RuntimeError("register() needs Ray initialised (the registry lives in the GCS)")
    if not KVConnectorBackendFactory.is_registered(CONNECTOR_NAME):
        try:
            KVConnectorBackendFactory.register_backend(CONNECTOR_NAME, BACKEND_PATH)
        except ValueError:  # registered by someone else in between
            pass


def _prepare(args: dict | None) -> dict:
    """Copy of ``args`` without our keys; builds the tiny model when asked; registers."""
    args = copy.deepcopy(dict(args or {}))
    tiny = args.pop("tiny_model", None)
    if tiny:
        from mooncake_ray.integrations.tiny_model import TinyModelSpec, build

        tiny = dict(tiny)
        out_dir = tiny.pop("out_dir", None)
        if not out_dir:
            raise ValueError("tiny_model needs out_dir (where to build the model; the LLM "
                             "configs' model_source should name the same path)")
        build(out_dir, TinyModelSpec(**tiny))
    if isinstance(args.get("llm_configs"), list):
        args["llm_configs"] = [_with_callback(c) for c in args["llm_configs"]]
    for key in ("prefill_config", "decode_config"):
        if key in args:
            args[key] = _with_callback(args[key])
    register()
    return args


def build_pd_app(args: dict):
    """``import_path`` for a prefill/decode app: ``args`` as Ray's ``build_pd_openai_app``
    (``prefill_config``, ``decode_config``, ...) plus optional ``tiny_model``. The decode
    deployment (one engine per replica: no ``data_parallel_size``) is served by
    :mod:`mooncake_ray.integrations._serve_server`'s ``PDDecodeServer``, which sends a
    stream's first token as soon as the engine makes it (``first_token_at_once: false`` in
    ``args`` for Ray's, which sends it on its batching clock)."""
    from ray.llm._internal.serve.serving_patterns.prefill_decode import builder
    from ray.serve.llm import build_pd_openai_app

    args = _prepare(args)
    if not args.pop("first_token_at_once", True) or not hasattr(builder, "PDDecodeServer"):
        return build_pd_openai_app(args)
    from mooncake_ray.integrations._serve_server import PDDecodeServer

    # Ray's builder names its decode server class itself: ours stands in while it builds
    ray_cls, builder.PDDecodeServer = builder.PDDecodeServer, PDDecodeServer
    try:
        return build_pd_openai_app(args)
    finally:
        builder.PDDecodeServer = ray_cls


WARM_INGRESS = "mooncake_ray.integrations._serve_ingress:OpenAiIngress"
FIRST_OUT_SERVER = "mooncake_ray.integrations._serve_server:LLMServer"


def _with_server(cfg):
    """``cfg`` (as :func:`_with_callback`) served by :mod:`mooncake_ray.integrations._serve_server`'s
    ``LLMServer`` (a stream's first token sent at once) where it names no ``server_cls``."""
    if isinstance(cfg, dict):
        if not cfg.get("server_cls"):
            cfg["server_cls"] = FIRST_OUT_SERVER
    elif isinstance(cfg, LLMConfig) and cfg.server_cls is None:
        from mooncake_ray.integrations._serve_server import LLMServer

        cfg.server_cls = LLMServer
    return cfg


def build_app(args: dict):
    """``import_path`` for an aggregated app: ``args`` as Ray's ``build_openai_app``
    (``llm_configs``, ...) plus optional ``tiny_model``. Where an LLM deployment routes
    with ``MooncakeKVRouter`` and no ``ingress_cls_config`` is given, the ingress makes its
    routers as it starts (:mod:`mooncake_ray.integrations._serve_ingress`). An LLM config
    without a ``server_cls`` of its own is served by
    :mod:`mooncake_ray.integrations._serve_server`'s ``LLMServer``, which sends a stream's
    first token as soon as the engine makes it (``first_token_at_once: false`` in ``args``,
    or a config's ``server_cls: ray.serve.llm:LLMServer``, for Ray's, which sends it on its
    batching clock)."""
    from ray.llm._internal.serve.constants import RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING
    from ray.serve.llm import build_openai_app

    from mooncake_ray.integrations.kv_router import uses_router

    args = _prepare(args)
    if args.pop("first_token_at_once", True) and isinstance(args.get("llm_configs"), list):
        args["llm_configs"] = [_with_server(c) for c in args["llm_configs"]]
    routed = any(uses_router(c.get("deployment_config") if isinstance(c, dict) else
                             c.deployment_config if isinstance(c, LLMConfig) else None)  # (a file's path: not read)
                 for c in args.get("llm_configs") or [])
    if routed and "ingress_cls_config" not in args and not RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING:
        args["ingress_cls_config"] = {"ingress_cls": WARM_INGRESS}
    return build_openai_app(args)
