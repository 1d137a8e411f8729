"""Engine replicas as Ray Serve deployments.

``EngineServer`` holds one :class:`InferenceEngine` and plays one of three roles:

- ``prefill``: compute the prompt's KV (reusing L1/L3), write its full pages through to
  the store, answer with the first token and the handoff parameters;
- ``decode``: get the prompt's pages, compute the partial last page, check it reaches
  the same first token, and stream the rest;
- ``both`` (aggregated mode): prefill and decode in one replica.

Two ways to hand the prompt's KV from prefill to decode (``handoff``):

- ``store`` (default): prefill writes its pages into the store, decode loads them. Two
  copies, but the pages stay as L3 for every later request, and any decode replica can
  take the request.
- ``direct``: decode first reserves pool pages (``reserve``), prefill writes its pages
  straight into them over the transport (one one-sided write per request), and the
  request is pinned to that decode replica. Measured about twice the store path's
  bandwidth (benchmarks/bench_pd_transfer.py). Pages are still written through to the
  store for later reuse. Page-first pools only.

Steps run on a worker thread under an asyncio lock, one engine step at a time: a
prefill holds the engine for its whole prompt, decode steps of concurrent requests
interleave token by token.

Admission: a request is started only when the pool pages it may occupy (prompt plus
``max_tokens``) fit beside those of the requests already running; otherwise it waits
for one to finish, as an engine's scheduler holds requests back when its KV blocks run
short. Without this, two long conversations on one replica take every page between
them and the next allocation fails mid-request. A request that could never fit
(larger than the whole pool) is refused with a ``ValueError`` naming both sizes.
"""

from __future__ import annotations

import asyncio
import logging
import time

from mooncake_ray.engines.engine import InferenceEngine
from mooncake_ray.engines.model import EOS, ModelConfig
from mooncake_ray.kv import ConversationHint

log = logging.getLogger(__name__)


def replica_id() -> str | None:
    """This Serve replica's unique id (None outside a replica): reported with the
    answers, so that a client can see which replica served a request."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not in a replica (engines built directly in tests)
        return None


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
    def __init__(self, role: str, model: dict, engine: dict | None = None, store: dict | None = None,
                 handoff: str = "store", transport: dict | None = None):
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
        self._room = asyncio.Event()  # set when pages are given back
        self._committed = 0  # pool pages promised to admitted requests
        self.admission_waits = 0
        self.mismatches = 0
        if handoff not in ("store", "direct"):
            raise ValueError(f"handoff must be store or direct, got {handoff!r}")
        self.handoff = handoff if self.engine.pool.layout == "page_first" else "store"
        self._xfer = self._peers = None
        self._reserved: dict[str, tuple] = {}
        self.replica = replica_id()
        if self.handoff == "direct" and role != "both":
            from mooncake_ray._private.transport import Engine

            t = transport or {}
            self._xfer = Engine(protocol=t.get("protocol", "auto"), devices=t.get("devices"), name=f"{role}-kv")
            self._region = self._xfer.register(self.engine.pool.tensor)
            self._peers = {}

    async def _admit(self, tokens: int) -> int:
        """Wait until ``tokens`` tokens' pages fit beside the running requests'; returns
        the pages promised (give them back with ``_leave``)."""
        need, size = self.engine.pages_for(tokens), self.engine.pool.num_pages
        if need > size:
            raise ValueError(f"a request of {tokens} tokens (prompt + max_tokens) needs {need} pool pages; "
                             f"this engine's pool has {size} (engine.pool_pages)")
        if self._committed + need > size:
            self.admission_waits += 1
            while self._committed + need > size:  # one event loop: no await between test and take
                self._room.clear()
                await self._room.wait()
        self._committed += need
        return need

    def _leave(self, need: int) -> None:
        """Synchronous, so that it runs in any ``finally`` (a generator closed by its
        consumer going away included)."""
        self._committed -= need
        self._room.set()

    async def _run(self, fn, *args):
        async with self._lock:
            return await asyncio.to_thread(fn, *args)

    async def prefill(self, req: dict, target: dict | None = None) -> dict:
        """Prefill role: compute the prompt's KV; it reaches decode through the store, or
        (``target`` from a decode replica's ``reserve``) written straight into its pool."""
        need = await self._admit(len(req["tokens"]))
        try:
            seq, info = await self._run(self.engine.prefill, req["tokens"], True, _hint(req))
        except BaseException:
            self._leave(need)
            raise
        params = {"mode": "store", "pages": (len(req["tokens"]) - 1) // self.cfg.page_size}
        try:
            if target is not None and self._xfer is not None:
                t0 = time.monotonic()
                params = {"mode": "direct", "filled": await asyncio.to_thread(self._write_pages, seq, target),
                          "transfer_s": None}
                params["transfer_s"] = time.monotonic() - t0
        except Exception as e:  # noqa: BLE001 - decode falls back to the store / recompute
            log.warning("direct KV handoff failed (%s): decode falls back to the store", e)
        finally:
            self.engine.release(seq)
            self._leave(need)
        return {"first_token": info.token, "prompt_tokens": info.prompt_tokens,
                "cached_tokens": info.cached_tokens, "prefill_s": info.prefill_s, "kv_transfer_params": params,
                "replica": self.replica}

    def _write_pages(self, seq, target: dict) -> int:
        peer = self._peers.get(target["address"])
        if peer is None:
            peer = self._peers[target["address"]] = self._xfer.connect(target["address"])
        rr = self._xfer.import_remote(peer, target["rkey"], target["base"], target["length"])
        pb, base, first = target["page_bytes"], self._region.addr, target["first_page"]
        ops = [(rr, dst * pb, base + seq.pages[first + k] * pb, pb) for k, dst in enumerate(target["page_ids"])]
        if ops:
            self._xfer.write(ops, timeout_s=30)
        return len(ops)

    async def reserve(self, req: dict) -> dict | None:
        """Decode role, direct handoff: reserve pool pages for the prompt and say where a
        prefill engine should write them. None when direct handoff is off."""
        if self._xfer is None:
            return None
        now = time.monotonic()
        for rid in [r for r, v in self._reserved.items() if now - v[2] > 120]:  # abandoned
            stale = self._reserved.pop(rid)
            self.engine.release(stale[0])
            self._leave(stale[3])
        need = await self._admit(len(req["tokens"]) + req["max_tokens"])
        try:
            async with self._lock:
                seq, first = self.engine.reserve(req["tokens"])
        except BaseException:
            self._leave(need)
            raise
        self._reserved[req["request_id"]] = (seq, first, now, need)
        return {"address": self._xfer.address, "rkey": self._region.rkey, "base": self._region.addr,
                "length": self._region.length, "page_bytes": self.engine.pool.geometry.page_bytes,
                "first_page": first, "page_ids": seq.pages[first:],
                "replica": self.replica}

    async def generate(self, req: dict, prefilled: dict | None = None):
        """Stream ``{"token", "cached_tokens", "prompt_tokens"}`` events, one per new token;
        the first also names this replica (``replica``)."""
        t0 = time.monotonic()
        reserved = self._reserved.pop(req.get("request_id"), None)
        params = (prefilled or {}).get("kv_transfer_params", {})
        need = reserved[3] if reserved is not None else await self._admit(len(req["tokens"]) + req["max_tokens"])
        try:
            if reserved is not None and params.get("mode") == "direct":
                reserved[0].hint = _hint(req)
                seq, info = reserved[0], await self._run(self.engine.prefill_reserved, reserved[0], params["filled"])
            else:
                if reserved is not None:  # the direct write did not happen: use the store
                    self.engine.release(reserved[0])
                seq, info = await self._run(self.engine.prefill, req["tokens"], True, _hint(req))
        except BaseException:
            self._leave(need)
            raise
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
                       "decode_load_tokens": info.cached_l3, "first_s": time.monotonic() - t0 if i == 0 else None,
                       "replica": self.replica if i == 0 else None}
                if (stop and info.token == EOS) or i + 1 == req["max_tokens"]:
                    break
                info = await self._run(self.engine.decode_step, seq, info.token)
        finally:
            self.engine.release(seq)
            self._leave(need)

    def stats(self) -> dict:
        return {**self.engine.stats, "role": self.role, "mismatches": self.mismatches,
                "admission_waits": self.admission_waits, "pages_committed": self._committed,
                "l3_page_failures": dict(self.engine.kv.failures) if self.engine.kv else {},
                "l3": self.client is not None, "handoff": self.handoff, "reserved": len(self._reserved), "replica": self.replica}


def _hint(req: dict) -> ConversationHint | None:
    """The request's conversation hint (openai.parse checked it)."""
    return ConversationHint.from_request(req.get("conversation"))
