"""Engine replicas as Ray Serve deployments.

``EngineServer`` holds one :class:`InferenceEngine` and plays one of three roles:

- ``prefill``: compute the prompt's KV (reusing L1/L3), write its full pages through to
  the store, answer with the first token and the handoff parameters;
- ``decode``: load the prompt's pages from the store (the prefill engine just wrote
  them), compute the partial last page, check it reaches the same first token, and
  stream the rest;
- ``both`` (aggregated mode): prefill and decode in one replica.

Steps run on a worker thread under an asyncio lock, one engine step at a time: a
prefill holds the engine for its whole prompt, decode steps of concurrent requests
interleave token by token.
"""

from __future__ import annotations

import asyncio
import logging
import time

from mooncake_ray.engines.engine import InferenceEngine
from mooncake_ray.engines.model import EOS, ModelConfig

log = logging.getLogger(__name__)


def connect_store(store: dict | None):
    """A store client for an engine, or None (engine-only mode, or no store running).
    Engines wait at most ``store_wait_s`` for a master: they degrade, they never block."""
    if not store or not store.get("enabled", True):
        return None
    import mooncake_ray

    try:
        return mooncake_ray.connect(namespace=store.get("namespace", "mooncake_ray"), config={
            "namespace": store.get("namespace", "mooncake_ray"),
            "client": {"master_retry_timeout_s": float(store.get("retry_timeout_s", 1.0)),
                       "backpressure_timeout_s": float(store.get("backpressure_timeout_s", 5.0))}})
    except Exception as e:  # noqa: BLE001 - no store is a supported mode
        log.warning("no mooncake-ray store reachable (%s): running without L3", e)
        return None


class EngineServer:
    def __init__(self, role: str, model: dict, engine: dict | None = None, store: dict | None = None):
        if role not in ("prefill", "decode", "both"):
            raise ValueError(f"role must be prefill, decode or both, got {role!r}")
        self.role = role
        self.cfg = ModelConfig(**model)
        self.client = connect_store(store)
        opts = dict(engine or {})
        if role == "prefill":
            opts["save_decode_cache"] = False
        self.engine = InferenceEngine(self.cfg, store=self.client, **opts)
        self._lock = asyncio.Lock()
        self.mismatches = 0

    async def _run(self, fn, *args):
        async with self._lock:
            return await asyncio.to_thread(fn, *args)

    async def prefill(self, req: dict) -> dict:
        """Prefill role: the prompt's KV goes to the store; returns the handoff."""
        seq, info = await self._run(self.engine.prefill, req["tokens"])
        self.engine.release(seq)
        return {"first_token": info.token, "prompt_tokens": info.prompt_tokens,
                "cached_tokens": info.cached_tokens, "prefill_s": info.prefill_s,
                "kv_transfer_params": {"mode": "store", "pages": (len(req["tokens"]) - 1) // self.cfg.page_size}}

    async def generate(self, req: dict, prefilled: dict | None = None):
        """Stream ``{"token", "cached_tokens", "prompt_tokens"}`` events, one per new token."""
        t0 = time.monotonic()
        seq, info = await self._run(self.engine.prefill, req["tokens"])
        cached = info.cached_tokens
        if prefilled is not None:
            if info.token != prefilled["first_token"]:  # exactness says this never happens
                self.mismatches += 1
                log.error("decode reached token %d, prefill %d", info.token, prefilled["first_token"])
            cached = prefilled["cached_tokens"]
        try:
            stop = not req.get("ignore_eos", False)
            for i in range(req["max_tokens"]):
                yield {"token": info.token, "cached_tokens": cached, "prompt_tokens": info.prompt_tokens,
                       "decode_load_tokens": info.cached_l3, "first_s": time.monotonic() - t0 if i == 0 else None}
                if (stop and info.token == EOS) or i + 1 == req["max_tokens"]:
                    break
                info = await self._run(self.engine.decode_step, seq, info.token)
        finally:
            self.engine.release(seq)

    def stats(self) -> dict:
        return {**self.engine.stats, "role": self.role, "mismatches": self.mismatches,
                "l3": self.client is not None}
