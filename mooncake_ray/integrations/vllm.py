"""vLLM on the store: a KV connector (vLLM's ``KVConnectorBase_V1``).

    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(model=..., kv_transfer_config=KVTransferConfig(
        kv_connector="MooncakeRayConnector",
        kv_connector_module_path="mooncake_ray.integrations.vllm",
        kv_role="kv_both",                        # or kv_producer (prefill), kv_consumer (decode)
        kv_connector_extra_config={},             # see MooncakeRayConnectorConfig
    ))

With an empty extra config the connector joins the Ray cluster of ``RAY_ADDRESS`` (else the
one running on this machine) and uses the store deployed there by ``mooncake-ray start`` or
``mooncake_ray.start()``. vLLM's scheduler and its workers are separate connector
instances (often separate processes); each connects to the store itself.

What each role does:

- ``kv_both``: before a request is scheduled, the scheduler side looks up the request's
  leading full blocks in the store with one batched call and tells vLLM how many tokens it
  can load; the worker side loads them zero-copy into the blocks vLLM allocated (``async``:
  in the background, the request waits; ``layerwise``: during the forward, each layer
  waited for just before it is used). Full blocks new to the store are saved after the
  step that completes them, in the background; a request whose saves are still running
  when it finishes keeps its blocks until they are done.
- ``kv_producer`` (prefill): the same, but each step's saves finish before the step
  returns, so the KV is stored before the response reaches a decode engine.
- ``kv_consumer`` (decode): loads only.

Keys and layout: see ``_vllm_plan`` and ``_vllm_layout`` (CPU and GPU KV layouts; on a GPU
``device_path`` says how the KV memory moves: registered with UCX, or staged through pinned
host memory). Blocks that fail to load are reported to vLLM, which
recomputes them (the connector sets vLLM's ``kv_load_failure_policy`` to ``recompute``
unless ``load_failure_policy`` says ``fail``): a store that is down, full or missing a
node costs recomputation, never a failed request or a wrong token.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mooncake_ray.config import _explain
from mooncake_ray.errors import ConfigError, InvalidArgumentError
from mooncake_ray.integrations import _store
from mooncake_ray.integrations._step_costs import NoCosts, StepCosts
from mooncake_ray.integrations._vllm_direct import publish
from mooncake_ray.integrations._vllm_groups import FULL, Kind, is_plain, kinds_of
from mooncake_ray.integrations._vllm_plan import HybridPlan, SchedulerPlan, StepPlan
from mooncake_ray.integrations._vllm_layout import LayerBlocks
from mooncake_ray.integrations._vllm_worker import KVTransfer
from mooncake_ray.kv import ConversationHint, KVGeometry, key_prefix

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

__all__ = ["MooncakeRayConnector", "MooncakeRayConnectorConfig", "MooncakeRayKVStats"]


class MooncakeRayConnectorConfig(BaseModel):
    """``kv_connector_extra_config`` of the connector. Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")

    ray_address: str | None = None
    """Ray cluster to join when the process is not in one already: ``host:port`` of its GCS,
    or ``auto``. Default: ``RAY_ADDRESS``, then ``auto`` (the cluster running on this machine)."""
    namespace: str = "mooncake_ray"
    """Ray namespace of the store (``StoreConfig.namespace``)."""
    load_mode: Literal["async", "layerwise"] = "async"
    """``async``: a request waits (without holding the engine) until its blocks are loaded.
    ``layerwise``: loads run during the forward pass, each layer waited for before use."""
    save_decode_cache: bool = True
    """Also save blocks filled by generated tokens (a chat's next turn then reuses them)."""
    load_failure_policy: Literal["recompute", "fail"] = "recompute"
    """What vLLM does with blocks that failed to load (vLLM's own default is ``fail``)."""
    model_id: str | None = None
    """Name of the model in keys (default: vLLM's ``model``). Engines that share KV must agree."""
    store_wait_s: float = Field(5.0, gt=0)
    """How long one store call may wait (for a restarting master, or for DRAM that offloads
    to disk are freeing) before the connector gives up on it: a load is recomputed, a save
    skipped. The client's own defaults (30 s) suit a notebook, not an engine's step."""
    router_key: str | None = None
    """Set by the Ray Serve LLM backend when the deployment routes with
    ``MooncakeKVRouter``: the Serve replica whose record (the store's key prefixes and
    block size) the connector publishes for the router. Not for users."""
    direct_handoff: bool = True
    """Prefill -> decode: a producer whose request asks for a remote decode
    (``kv_transfer_params["do_remote_decode"]``, as Ray Serve LLM's P/D app sends) keeps the
    request's blocks and names them in its response; the consumer reads them straight from
    the producer's memory over the transport, and from the store if that fails."""
    direct_hold_s: float = Field(30.0, gt=0)
    """How long a producer keeps blocks no consumer has read: in its engine's memory (the
    direct handoff), and in the store, where the blocks of a request for a remote decode
    are held (each soft-pinned by the master call that stores it) until the consumer's
    load releases them, so no eviction policy takes them before their read."""
    connect_timeout_s: float = Field(10.0, gt=0)
    """How long joining the Ray cluster may take before the engine fails to start."""
    device_path: Literal["auto", "direct", "staged"] = "auto"
    """How a GPU KV cache moves (the client's ``device_path``): ``direct`` (UCX registers
    the GPU memory: cuda_copy / cuda_ipc, GPUDirect RDMA; a decode engine reads a prefill
    engine's blocks straight from its GPU), ``staged`` (through a pinned host buffer, copies
    on a CUDA stream of the client's; prefill -> decode then goes through the store),
    ``auto`` (direct where the client's UCX can register CUDA memory, else staged). Forced
    ``staged`` stages a CPU KV cache too."""


def parse_config(extra: dict | None) -> MooncakeRayConnectorConfig:
    """Validate ``kv_connector_extra_config``.

    Raises:
        ConfigError: naming each bad key, its value and what is allowed.
    """
    try:
        return MooncakeRayConnectorConfig.model_validate(dict(extra or {}))
    except ValidationError as e:
        raise ConfigError("MooncakeRayConnector kv_connector_extra_config: " + _explain(e)) from None


# ------------------------------------------------------------------------ store ----
def store_client(cfg: MooncakeRayConnectorConfig):
    """This process's client of the store (shared by the scheduler and worker sides)."""
    return _store.store_client(namespace=cfg.namespace, ray_address=cfg.ray_address,
                               store_wait_s=cfg.store_wait_s, connect_timeout_s=cfg.connect_timeout_s,
                               who="MooncakeRayConnector", device_path=cfg.device_path)


# ---------------------------------------------------------------------- stats ----
@dataclass
class MooncakeRayKVStats(KVConnectorStats):
    """Counters of one interval (summed across workers): lookup/hit tokens (scheduler),
    loaded/saved bytes and blocks, failures, seconds spent loading and saving (workers)."""

    def reset(self):
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out = dict(self.data)
        if out.get("lookup_tokens"):
            out["hit_rate"] = round(out.get("hit_tokens", 0) / out["lookup_tokens"], 4)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


# -------------------------------------------------------------------- metadata ----
@dataclass
class MooncakeRayMetadata(KVConnectorMetadata):
    plan: StepPlan


# ------------------------------------------------------------------- connector ----
class MooncakeRayConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector onto a mooncake-ray store (see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        kvt = self._kv_transfer_config
        self.cfg = parse_config(kvt.kv_connector_extra_config)
        if kvt.kv_role not in ("kv_both", "kv_producer", "kv_consumer"):
            raise ConfigError(f"MooncakeRayConnector: kv_role {kvt.kv_role!r} not supported; "
                              "allowed: 'kv_both', 'kv_producer', 'kv_consumer'")
        kvt.kv_load_failure_policy = self.cfg.load_failure_policy
        self.kv_role = kvt.kv_role
        self.block_size = vllm_config.cache_config.block_size
        # vLLM's KV cache groups (several for hybrid models): refused here if the store
        # cannot hold one of them completely
        self.kinds: list[Kind] = []
        if kv_cache_config is not None:
            self.kinds, self.block_size = kinds_of(kv_cache_config)
        self.hybrid = bool(self.kinds) and not is_plain(self.kinds)
        if self.hybrid and self.cfg.load_mode == "layerwise":
            raise ConfigError(
                "MooncakeRayConnector: load_mode 'layerwise' is not supported for hybrid models (KV cache groups "
                f"{', '.join(k.tag for k in self.kinds)}): their loads are reported whole per request; use 'async'")
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        dtype = vllm_config.cache_config.cache_dtype
        if dtype == "auto":
            dtype = str(mc.dtype).removeprefix("torch.")
        self.geometry = KVGeometry(num_layers=mc.get_num_layers(pc), num_kv_heads=mc.get_num_kv_heads(pc),
                                   head_dim=mc.get_head_size(), dtype=dtype, page_size=self.block_size)
        from vllm.platforms import current_platform

        self.layout = "vllm-cpu" if current_platform.is_cpu() else f"vllm-{current_platform.device_name}"
        self.model_id = self.cfg.model_id or str(mc.model)
        self.tp_size, self.pp_size = pc.tensor_parallel_size, pc.pipeline_parallel_size
        self.client = store_client(self.cfg)  # fails here, before the engine serves, if the store is not there
        from mooncake_ray._private.metrics import ConnectorMetrics

        self.metrics = ConnectorMetrics(self.kv_role)
        self._stats: dict[str, int | float] = {}
        self._stats_lock = threading.Lock()
        if role == KVConnectorRole.SCHEDULER:
            save_decode = self.cfg.save_decode_cache and self.kv_role == "kv_both"
            if self.hybrid:
                self.plan = HybridPlan(self.block_size, self.kinds, save=self.kv_role != "kv_consumer",
                                       save_decode=save_decode)
            else:
                self.plan = SchedulerPlan(self.block_size, save=self.kv_role != "kv_consumer",
                                          save_decode=save_decode, sync_saves=self.kv_role == "kv_producer")
            self._reqs: dict[str, "Request"] = {}
            self._prefixes = [self._prefix(t, p) for t in range(self.tp_size) for p in range(self.pp_size)]
            self._local_hits: dict[str, int] = {}
            self.transfer = None
            # steps are timed only where a router reads the prices (a replica it serves)
            self._costs = StepCosts() if self.cfg.router_key else NoCosts()
            self._sync_loads: set[str] = set()  # requests whose hit is loaded inside their step's forward
            self._step_loaded = 0  # tokens of the step being scheduled loaded that way
            self._costs_stop = threading.Event()
            if self.cfg.router_key:
                self._publish_router_record()
                threading.Thread(target=self._publish_costs, name="mooncake-connector-costs", daemon=True).start()
        else:
            self.plan = None
            self.transfer: KVTransfer | None = None

    def _publish_router_record(self) -> None:
        """What ``MooncakeKVRouter`` needs to look this engine's prompts up in the store."""
        from mooncake_ray.integrations.kv_router import put_record

        prefixes = self._prefixes
        if self.hybrid:  # the router estimates a hybrid model's hits by its full-attention blocks
            prefixes = [f"{p}{k.tag}/" for p in prefixes for k in self.kinds[:1] if k.rule == FULL]
        put_record(self.cfg.router_key, "store", {
            "namespace": self.cfg.namespace, "prefixes": prefixes, "block_size": self.block_size,
            "model_id": self.model_id})

    def _publish_costs(self) -> None:
        """This engine's prices of a computed and a loaded token (``StepCosts``), in its
        router record (part ``costs``) every ``COSTS_EVERY_S`` once known and when changed."""
        from mooncake_ray.integrations.kv_router import COSTS_EVERY_S, put_record

        last = None
        while not self._costs_stop.wait(COSTS_EVERY_S):
            est = self._costs.estimate()
            if est is None or est == last:
                continue
            try:
                put_record(self.cfg.router_key, "costs", est)
                last = est
            except Exception as e:  # noqa: BLE001 - the router keeps its configured load_cost
                log.debug("cannot publish the engine's token costs: %s", e)

    def _prefix(self, tp_rank: int, pp_rank: int) -> str:
        return key_prefix(self.model_id, self.geometry, self.layout, tp_rank, self.tp_size, pp_rank, self.pp_size)

    def _add_stat(self, name: str, n) -> None:
        with self._stats_lock:
            self._stats[name] = self._stats.get(name, 0) + n

    # ============================================================ worker side ==
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        for name, t in kv_caches.items():
            if not hasattr(t, "data_ptr"):
                raise ConfigError(f"MooncakeRayConnector: the KV cache of layer {name!r} is a "
                                  f"{type(t).__name__} of tensors, a layout the connector does not store")
        layers = [LayerBlocks(name, t) for name, t in kv_caches.items()]
        tp_rank = get_tensor_model_parallel_rank()
        prefix = self._prefix(tp_rank, get_pp_group().rank_in_group)
        self.transfer = KVTransfer(self.client, prefix, layers, layerwise=self.cfg.load_mode == "layerwise",
                                   metrics=self.metrics, tp_rank=tp_rank, direct_timeout_s=self.cfg.store_wait_s,
                                   hold_s=self.cfg.direct_hold_s, kinds=self.kinds if self.hybrid else None)
        direct = False
        if self.kv_role == "kv_producer" and self.cfg.direct_handoff and not self.hybrid:
            direct = publish(self.client, self._kv_transfer_config.engine_id, tp_rank, self.transfer.regions, layers)
        log.info("MooncakeRayConnector: %d layers registered (%s, %s memory), blocks of %d bytes stored as one "
                 "value (%d part(s) per layer), keys %s%s", len(layers), layers[0].tensor.device if layers else "-",
                 self.transfer.path, self.transfer.block_bytes, self.transfer.parts, prefix,
                 ", direct handoff published" if direct else "")

    def _plan(self) -> StepPlan | None:
        if self.transfer is None or not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, MooncakeRayMetadata) else None

    def handle_preemptions(self, kv_connector_metadata) -> None:
        if self.transfer is not None and isinstance(kv_connector_metadata, MooncakeRayMetadata) \
                and kv_connector_metadata.plan.drain_saves:
            self.transfer.drain_saves()

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        plan = self._plan()
        if plan is not None:
            if plan.drain_saves:
                self.transfer.drain_saves()
            self.transfer.start_loads(plan.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.transfer is not None:
            self.transfer.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # whole blocks are saved once the step is done (wait_for_save)

    def wait_for_save(self) -> None:
        plan = self._plan()
        if plan is not None:
            self.transfer.wait_all_layers()
            self.transfer.save(plan.saves, sync=plan.sync_saves)
            self.transfer.holds.hold(plan.holds)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.transfer is None:
            return None, None
        return self.transfer.finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        out = super().get_transfer_results(finished_req_ids)
        if self.transfer is not None:
            out.failed_recving = self.transfer.failed_loads()  # hybrid: a request loads whole or not at all
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.transfer.load_errors() if self.transfer is not None else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.transfer is not None:
            for k, v in self.transfer.take_interval().items():
                self._add_stat(k, v)
        with self._stats_lock:
            data, self._stats = self._stats, {}
        return MooncakeRayKVStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return MooncakeRayKVStats(data=dict(data or {}))

    def shutdown(self) -> None:
        stop = getattr(self, "_costs_stop", None)
        if stop is not None:
            stop.set()
        if self.transfer is not None:
            self.transfer.close()
            self.transfer = None

    # ========================================================= scheduler side ==
    def _present_kinds(self, pairs: list[tuple[str, str]]) -> list[bool]:
        """Whether the store holds each ``(kind tag, hash)`` block of a hybrid model, on
        every rank."""
        n_per = len(self._prefixes)
        try:
            found = self.client.batch_exists([f"{p}{tag}/{h}" for tag, h in pairs for p in self._prefixes])
        except Exception as e:  # noqa: BLE001 - a store that does not answer is a miss
            log.warning("KV lookup failed (%s): computing instead", e)
            return [False] * len(pairs)
        return [all(found[i * n_per:(i + 1) * n_per]) for i in range(len(pairs))]

    def _present(self, hashes: list[str]) -> int:
        """How many leading blocks the store holds whole (every layer, every rank)."""
        per = [f"{p}{h}" for h in hashes for p in self._prefixes]  # one value per block and rank
        n_per = len(self._prefixes)
        try:
            found = self.client.batch_exists(per)
        except Exception as e:  # noqa: BLE001 - a store that does not answer is a miss
            log.warning("KV lookup failed (%s): computing instead", e)
            return 0
        n = 0
        while n < len(hashes) and all(found[n * n_per:(n + 1) * n_per]):
            n += 1
        return n

    def update_connector_output(self, connector_output) -> None:
        for req_id in getattr(connector_output, "failed_recving", None) or ():
            self._costs.load_finished(req_id, 0.0, ok=False)  # computed instead: not a load's time
        # A hybrid request whose load failed is computed whole when vLLM schedules it again:
        # a value the lookup finds but the load cannot read would otherwise fail it forever.
        if self.hybrid:
            for req_id in getattr(connector_output, "failed_recving", None) or ():
                self.plan.no_loads(req_id)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        self._reqs[request.request_id] = request
        self._local_hits[request.request_id] = num_computed_tokens
        self._note_hint(request)
        direct, params = None, request.kv_transfer_params or {}
        if self.kv_role == "kv_producer" and params.get("do_remote_decode"):
            self.plan.hold(request.request_id, self.cfg.direct_hold_s)
        elif self.kv_role != "kv_producer":
            ours = params.get("mooncake_ray") if isinstance(params.get("mooncake_ray"), dict) else {}
            self.plan.release_source(request.request_id, request.all_token_ids, ours.get("stored_tokens"))
            if self.cfg.direct_handoff and not self.hybrid:
                direct = ours.get("direct")
                self.plan.direct_source(request.request_id, direct)
        if self.hybrid:
            hit = self.plan.match(request.request_id, request.all_token_ids, num_computed_tokens,
                                  self._present_kinds)
            return hit, hit > 0
        hit = self.plan.match(request.request_id, request.all_token_ids, num_computed_tokens, self._present)
        asynchronous = self.cfg.load_mode == "async" or direct is not None
        if hit and not asynchronous:
            self._sync_loads.add(request.request_id)
        else:
            self._sync_loads.discard(request.request_id)
        return hit, hit > 0 and asynchronous

    def _note_hint(self, request: "Request") -> None:
        """A conversation hint in the request's ``kv_transfer_params["mooncake_ray"]``
        (``conversation_id``, ``priority``, ``keep_s``; see kv.ConversationHint): with
        ``priority > 0`` its saved blocks stay soft-pinned. A bad hint is logged, not fatal."""
        fields = (request.kv_transfer_params or {}).get("mooncake_ray")
        if not isinstance(fields, dict):
            return
        try:
            hint = ConversationHint.from_request(fields)
        except InvalidArgumentError as e:
            log.warning("request %s: conversation hint ignored: %s", request.request_id, e)
            return
        if hint is not None and hint.priority > 0:
            self.plan.keep(request.request_id, hint.conversation_id, hint.keep_s)

    def update_state_after_alloc(self, request: "Request", blocks, num_external_tokens: int) -> None:
        self._reqs[request.request_id] = request
        local = self._local_hits.pop(request.request_id, 0)
        if local:
            self.metrics.add("engine_hit_tokens", local)
        if num_external_tokens > 0:
            ids = blocks.get_block_ids()
            self.plan.allocated(request.request_id, ids if self.hybrid else ids[0], num_external_tokens)
            self._add_stat("hit_tokens", num_external_tokens)
            self.metrics.add("hit_tokens", num_external_tokens)
            if request.request_id in self._sync_loads:
                self._step_loaded += num_external_tokens
            else:
                self._costs.load_started(request.request_id, num_external_tokens, time.monotonic())
        self._sync_loads.discard(request.request_id)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        scheduled = []
        now = time.monotonic()
        for new in scheduler_output.scheduled_new_reqs:
            self._costs.load_finished(new.req_id, now)  # its load (if it waited for one) is over
            req = self._reqs.get(new.req_id)
            if req is not None:
                n = scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
                scheduled.append((new.req_id, req.all_token_ids, req.num_prompt_tokens, new.num_computed_tokens, n))
                self._count_lookup(req)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            req = self._reqs.get(req_id)
            if req is not None:
                n = scheduler_output.num_scheduled_tokens.get(req_id, 0)
                scheduled.append((req_id, req.all_token_ids, req.num_prompt_tokens, cached.num_computed_tokens[i], n))
        preempted = bool(getattr(scheduler_output, "preempted_req_ids", None))
        self._costs.step(now, scheduler_output.total_num_scheduled_tokens, self._step_loaded,
                         scheduler_output.num_scheduled_tokens, cached.req_ids)
        self._step_loaded = 0
        return MooncakeRayMetadata(self.plan.step(scheduled, self._block_ids, preempted))

    def _count_lookup(self, req) -> None:
        self._add_stat("lookup_tokens", req.num_prompt_tokens)
        self.metrics.add("lookup_tokens", req.num_prompt_tokens)

    def _block_ids(self, req_id: str):
        if not self._kv_cache_manager:
            return []
        ids = self._kv_cache_manager.get_block_ids(req_id)
        return ids if self.hybrid else list(ids[0])

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        super().bind_gpu_block_pool(gpu_block_pool)
        if isinstance(self.plan, HybridPlan):
            self.plan.null_block = gpu_block_pool.null_block.block_id

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        if not self.hybrid:
            return self.request_finished(request, block_ids[0])
        self._costs.load_finished(request.request_id, 0.0, ok=False)  # a load still timed: not finished
        self._reqs.pop(request.request_id, None)
        self._local_hits.pop(request.request_id, None)
        self.plan.finished(request.request_id)  # saves are synchronous: nothing outlives the request
        params = None
        if self.kv_role == "kv_producer":
            params = {"mooncake_ray": {"namespace": self.cfg.namespace, "direct": None,
                                       "stored_tokens": request.num_prompt_tokens // self.block_size * self.block_size}}
        return False, params

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._costs.load_finished(request.request_id, 0.0, ok=False)  # a load still timed: not finished
        self._reqs.pop(request.request_id, None)
        self._local_hits.pop(request.request_id, None)
        params, direct = None, None
        if self.kv_role == "kv_producer":
            if self.cfg.direct_handoff and (request.kv_transfer_params or {}).get("do_remote_decode"):
                direct = self.plan.held_blocks(request.request_id, request.all_token_ids,
                                               request.num_prompt_tokens, block_ids)
                direct.update(engine=self._kv_transfer_config.engine_id, req=request.request_id)
            params = {"mooncake_ray": {"namespace": self.cfg.namespace, "direct": direct,
                                       "stored_tokens": request.num_prompt_tokens // self.block_size * self.block_size}}
        delay = self.plan.finished(request.request_id)
        return delay or bool(direct and direct["blocks"]), params
