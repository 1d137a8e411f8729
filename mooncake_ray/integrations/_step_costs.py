"""What a token costs one engine, learned from its own steps (no vLLM, no Ray).

The connector's scheduler side sees every engine step as it is scheduled: the tokens the
step computes (``num_scheduled_tokens``) and the tokens it loads from the store (the
requests whose external hit is loaded inside the step's forward pass, as the connector's
``layerwise`` load mode does). The time from one step's scheduling to the next is that
step's time, when the engine ran them back to back: a request of the earlier step is among
the later one's running requests (else the engine may have waited for work in between, and
the interval says nothing). Over the last ``window`` such steps, a least-squares fit of

    seconds = compute_s x computed + load_s x loaded + overhead_s

gives the engine's price of a computed token and of a loaded one. Loads made outside the
steps (the connector's ``async`` load mode, its default, and direct reads from a prefill
engine) are timed themselves instead: from the step that starts a request's load to the
step that schedules the request with its KV in place, which is what the load adds to the
request's time to first token (the copy, and the wait for a step to take the request
again: on a busy engine most of it). Their price per token is that time summed over the
window's loads over the tokens they loaded.
``load_s / compute_s`` is the ``load_cost`` ``MooncakeKVRouter`` weighs loaded tokens by.
A computed token's price needs ``min_steps`` prefill steps. A loaded token's is given from
the first load on, with the number of loads behind it (``load_samples``): while fewer than
``min_steps`` steps loaded, each loading step's time beyond what the fit of the others
gives for its computed tokens is its load's. The router weighs a price by its samples
against its configured ``load_cost`` (``kv_router.blend_price``): an engine that loads a
few times a minute would otherwise run on the configured price for most of its life.
"""

from __future__ import annotations

import math
import threading
from collections import deque


class StepCosts:
    """Thread-safe: ``step`` from the scheduler's thread, ``estimate`` from any."""

    def __init__(self, window: int = 512, min_steps: int = 8, min_tokens: int = 16):
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._last: tuple[float, int, int, frozenset] | None = None
        self._min_steps = min_steps
        self._min_tokens = min_tokens  # a step computing at least this many tokens is a prefill step
        self._loads: deque[tuple[int, float]] = deque(maxlen=window)  # loads outside the steps: (tokens, seconds)
        self._loading: dict[str, tuple[int, float]] = {}  # request -> (tokens, started)
        self._lock = threading.Lock()

    def step(self, now: float, computed: int, loaded: int, req_ids, continuing) -> None:
        """A step scheduled at ``now`` (monotonic seconds) computing ``computed`` tokens and
        loading ``loaded``, of requests ``req_ids``, of which ``continuing`` ran in earlier
        steps: closes the previous step's interval."""
        with self._lock:
            if self._last is not None:
                t0, c0, l0, ids0 = self._last
                if now > t0 and not ids0.isdisjoint(continuing):
                    self._steps.append((c0, l0, now - t0))
            self._last = (now, int(computed), int(loaded), frozenset(req_ids)) if computed > 0 else None

    def load_started(self, req_id: str, tokens: int, now: float) -> None:
        """A load outside the steps begins: ``tokens`` of request ``req_id``."""
        with self._lock:
            if len(self._loading) < 65536:
                self._loading[req_id] = (int(tokens), now)

    def load_finished(self, req_id: str, now: float, ok: bool = True) -> None:
        """The request is scheduled with its loaded KV in place (``ok``; a failed or
        abandoned load is not timed)."""
        with self._lock:
            got = self._loading.pop(req_id, None)
            if got is not None and ok and now > got[1]:
                self._loads.append((got[0], now - got[1]))

    def samples(self) -> int:
        return len(self._steps)

    def estimate(self) -> dict | None:
        """``{"compute_s_per_token", "load_s_per_token" (None until something loaded),
        "load_cost" (the ratio, within [0, 1], or None), "steps", "loads" (timed outside the
        steps), "load_samples" (the loads behind the price)}``, or None while too few steps
        computed a prefill's worth of tokens to price a computed one."""
        import numpy as np

        with self._lock:
            rows = list(self._steps)
            loads = list(self._loads)
        prefill = sum(1 for c, _, _ in rows if c >= self._min_tokens)
        if prefill < self._min_steps or len(rows) < self._min_steps + 2:
            return None
        loading = sum(1 for _, l, _ in rows if l > 0)
        with_loads = loading >= self._min_steps
        # few loading steps: the price of a computed token from the others, and each loading
        # step's time beyond it is its load's
        fit = rows if with_loads or not loading else [r for r in rows if r[1] == 0]
        if len(fit) < self._min_steps:
            return None
        x = np.array([[c, l, 1.0] if with_loads else [c, 1.0] for c, l, _ in fit], dtype=float)
        y = np.array([t for _, _, t in fit], dtype=float)
        coef, _res, rank, _sv = np.linalg.lstsq(x, y, rcond=None)
        if rank < x.shape[1]:
            return None
        compute_s = float(coef[0])
        if not math.isfinite(compute_s) or compute_s <= 0:
            return None
        load_s, samples = None, 0
        if with_loads:
            load_s, samples = max(float(coef[1]), 0.0), loading
        elif loads:  # outside the steps (async): their own times
            tokens = sum(n for n, _ in loads)
            if tokens > 0:
                load_s, samples = sum(t for _, t in loads) / tokens, len(loads)
        elif loading:
            tokens = sum(l for _, l, _ in rows if l > 0)
            beyond = sum(t - (compute_s * c + float(coef[1])) for c, l, t in rows if l > 0)
            load_s, samples = max(beyond / tokens, 0.0), loading
        return {"compute_s_per_token": compute_s, "load_s_per_token": load_s,
                "load_cost": None if load_s is None else min(load_s / compute_s, 1.0), "steps": len(rows),
                "loads": len(loads), "load_samples": samples}


class NoCosts:
    """``StepCosts`` for an engine no router reads prices from: its scheduler steps keep
    nothing."""

    def step(self, now: float, computed: int, loaded: int, req_ids, continuing) -> None:
        pass

    def load_started(self, req_id: str, tokens: int, now: float) -> None:
        pass

    def load_finished(self, req_id: str, now: float, ok: bool = True) -> None:
        pass

    def samples(self) -> int:
        return 0

    def estimate(self) -> None:
        return None
