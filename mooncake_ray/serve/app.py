"""The OpenAI-compatible front door and the application builders.

Disaggregated: ingress -> prefill pool (prefix-aware routing) -> decode pool; the KV of
the prompt moves from prefill to decode through the store. Aggregated: ingress -> one
pool of engines doing both. Deployed with ``serve run serve_configs/<name>.yaml``, whose
``import_path`` is ``mooncake_ray.serve:build_app`` and whose ``args`` are::

    mode: disaggregated | aggregated
    model: {...}            # ModelConfig fields (KV geometry, sizes, seed, model_id)
    store: {enabled: true, namespace: mooncake_ray, config: {...StoreConfig...}}
    handoff: store | direct  # how the prompt's KV goes from prefill to decode
    transport: {devices: [...]}  # for the direct handoff's transport engine
    prefill: {num_replicas: 2, engine: {...}, ray_actor_options: {...}}
    decode:  {num_replicas: 1, engine: {...}, ray_actor_options: {...}}
    router: {imbalance: 4}

Which replica served a (non-streaming) request is in the response headers, for tests and
debugging: ``x-mooncake-replica`` names the replica of the prefix-routed pool (the engine
in aggregated mode, the prefill replica in disaggregated mode), ``x-mooncake-decode-replica``
the decode replica (disaggregated). The ids are Serve's replica ids (``serve status``,
``EngineServer.stats()["replica"]``).
"""


import codecs
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig

from mooncake_ray.engines.model import ByteTokenizer, ModelConfig
from mooncake_ray.serve import openai
from mooncake_ray.serve.deployments import EngineServer
from mooncake_ray.serve.router import PrefixAwareRouter, request_finished

log = logging.getLogger(__name__)

api = FastAPI(title="mooncake-ray")

# How often a stopping replica checks that its requests have drained. Serve's default (2 s)
# is slept at least once by each replica, and an app stops in two stages (the ingress, then
# the engines): 4 of the 5.5 s a Ctrl-C of ``serve run`` took. A request in flight is still
# waited for; only the idle sleeps between checks are shorter.
DRAIN_CHECK_S = 0.25


@serve.deployment(max_ongoing_requests=256, ray_actor_options={"num_cpus": 0},
                  graceful_shutdown_wait_loop_s=DRAIN_CHECK_S)
@serve.ingress(api)
class OpenAIIngress:
    def __init__(self, first, decode, model: dict, mode: str, handoff: str = "store"):
        self.cfg = ModelConfig(**model)
        self.first, self.decode, self.mode, self.handoff = first, decode, mode, handoff
        self.tok = ByteTokenizer()

    @api.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.cfg.model_id, "object": "model", "owned_by": "mooncake-ray",
                                            "created": 0}]}

    @api.get("/health")
    async def health(self) -> dict:
        return {"status": "ok", "mode": self.mode}

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve(await request.body(), "completion")

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        return await self._serve(await request.body(), "chat")

    async def _serve(self, body: bytes, kind: str) -> Response:
        try:
            r = openai.parse(body, kind, self.cfg.model_id, self.cfg.max_context, self.tok)
        except openai.OpenAIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        req = r.to_dict()
        # the routers count a request against its replica until it is finished here
        last = (self.decode if self.mode == "disaggregated" else self.first).deployment_name
        try:
            if self.mode == "disaggregated":
                target = await self.decode.reserve.remote(req) if self.handoff == "direct" else None
                if target is not None:
                    req = {**req, "pin_replica": target["replica"]}  # decode where the pages wait
                try:
                    pre = await self.first.prefill.remote(req, target)
                finally:
                    request_finished(self.first.deployment_name, r.request_id)
                events = self.decode.options(stream=True).generate.remote(req, pre)
                served_by = {"x-mooncake-replica": pre.get("replica")}
            else:
                events = self.first.options(stream=True).generate.remote(req, None)
                served_by = {}
        except BaseException:
            request_finished(last, r.request_id)
            raise
        if r.stream:
            return StreamingResponse(self._stream(r, events, last), media_type="text/event-stream")
        return await self._collect(r, events, served_by, last)

    async def _collect(self, r: openai.GenRequest, events, served_by: dict, last: str) -> Response:
        try:
            return await self._collect_events(r, events, served_by)
        except ValueError as e:  # refused by the engine (e.g. larger than its page pool)
            err = openai.OpenAIError(400, str(e))
            return JSONResponse(err.body(), status_code=err.status)
        finally:
            request_finished(last, r.request_id)

    async def _collect_events(self, r: openai.GenRequest, events, served_by: dict) -> Response:
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        text, n, cached, prompt, last = [], 0, 0, len(r.tokens), None
        async for ev in events:
            n += 1
            if ev.get("replica"):
                served_by["x-mooncake-decode-replica" if self.mode == "disaggregated" else "x-mooncake-replica"] = \
                    ev["replica"]
            cached, prompt, last = ev["cached_tokens"], ev["prompt_tokens"], ev["token"]
            if ev["token"] < 256:
                text.append(dec.decode(bytes([ev["token"]])))
        text.append(dec.decode(b"", final=True))
        finish = "stop" if last == 257 and not r.ignore_eos else "length"
        return JSONResponse(openai.full_response(r, "".join(text), finish, prompt, n, cached),
                            headers={k: v for k, v in served_by.items() if v})

    async def _stream(self, r: openai.GenRequest, events, last: str):
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        n, cached, prompt, token = 0, 0, len(r.tokens), None
        try:
            async for ev in events:
                piece = dec.decode(bytes([ev["token"]])) if ev["token"] < 256 else ""
                cached, prompt, token = ev["cached_tokens"], ev["prompt_tokens"], ev["token"]
                yield openai.sse(openai.chunk(r, piece, None, first=n == 0))
                n += 1
            finish = "stop" if token == 257 and not r.ignore_eos else "length"
            yield openai.sse(openai.chunk(r, dec.decode(b"", final=True), finish))
            if r.include_usage:
                yield openai.sse(openai.usage_chunk(r, prompt, n, cached))
        except Exception as e:  # noqa: BLE001 - a stream cannot change its status any more
            log.exception("stream failed")
            yield openai.sse({"error": {"message": str(e), "type": "server_error"}})
        finally:
            request_finished(last, r.request_id)
        yield openai.sse("[DONE]")


def _engine_deployment(name: str, role: str, spec: dict, model: dict, store: dict | None, router: dict,
                       handoff: str = "store", transport: dict | None = None):
    opts = {"num_cpus": 0, **spec.get("ray_actor_options", {})}
    router_cfg = RequestRouterConfig(
        request_router_class=PrefixAwareRouter,
        request_router_kwargs={"page_size": model.get("page_size", 16), **router})
    return serve.deployment(EngineServer, name=name).options(
        num_replicas=spec.get("num_replicas", 1), max_ongoing_requests=spec.get("max_ongoing_requests", 32),
        ray_actor_options=opts, request_router_config=router_cfg, graceful_shutdown_wait_loop_s=DRAIN_CHECK_S,
    ).bind(role, model, spec.get("engine", {}), store, handoff, transport)


def build_app(args: dict):
    """Build the Serve application (``serve run`` calls this with the YAML's args).
    Starts (or reuses) the store on the cluster first when ``store.enabled``."""
    args = dict(args or {})
    mode = args.get("mode", "disaggregated")
    if mode not in ("disaggregated", "aggregated"):
        raise ValueError(f"mode must be disaggregated or aggregated, got {mode!r}")
    model = ModelConfig(**args.get("model", {})).to_dict()
    store = args.get("store", {"enabled": False})
    if store.get("enabled", True):
        import mooncake_ray

        cfg = {**store.get("config", {}), "namespace": store.get("namespace", "mooncake_ray")}
        mooncake_ray.start(cfg).close()
    router = args.get("router", {})
    handoff, transport = args.get("handoff", "store"), args.get("transport")
    if handoff not in ("store", "direct"):
        raise ValueError(f"handoff must be store or direct, got {handoff!r}")
    if mode == "disaggregated":
        first = _engine_deployment("Prefill", "prefill", args.get("prefill", {}), model, store, router,
                                   handoff, transport)
        decode = _engine_deployment("Decode", "decode", args.get("decode", {}), model, store, router,
                                    handoff, transport)
    else:
        first = _engine_deployment("LLM", "both", args.get("engines", args.get("prefill", {})), model, store, router)
        decode = None
    return OpenAIIngress.bind(first, decode, model, mode, handoff)
