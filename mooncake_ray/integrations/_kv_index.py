"""What the KV-aware router knows and how it decides, free of Ray, ZMQ and vLLM so it is
tested in microseconds (``tests/unit/test_kv_index.py``); the router itself is
:mod:`mooncake_ray.integrations.kv_router`.

Block identity. vLLM names a cached block by its own chained hash, salted per process
unless ``PYTHONHASHSEED`` is pinned, so two engines (and the router) need not agree on it.
The router keys blocks by the store's hash instead: :func:`mooncake_ray.kv.page_hashes`,
SHA-256 chained over each block's token ids, the hash the vLLM connector names store
values by. A ``BlockStored`` event carries the blocks' token ids and the parent block's
vLLM hash, so :class:`ReplicaIndex` translates: it keeps vLLM hash -> our hash for the
blocks the engine holds, and the set (with counts) of our hashes held. A block whose parent
it does not know (an event lost) or that carries extra hash keys (LoRA, multimodal, cache
salt) cannot be named by token ids alone and is left out: the index under-counts, never
invents.

Events come in numbered batches. A batch whose number is not the next expected means
batches were lost: the caller replays them from the engine's replay socket; when that is
impossible the index is reset and marked stale (its replica then counts as holding
nothing) until ``stale_s`` passes, while new events rebuild it.

:func:`choose` ranks replicas by a cost in prompt-token equivalents: the tokens a replica
must compute (the prompt less the longest prefix it holds or can load from the store), the
tokens it loads from the store (weighted by ``load_cost``, the measured time to load a
token over the time to compute one), and the prefill work already queued on it.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from mooncake_ray.kv import page_hashes

# Event type names as vLLM's msgspec tags them (vllm/distributed/kv_events.py).
STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"
# Mediums whose blocks are the engine's own cache (GPU memory; vLLM's CPU backend says GPU
# too, or nothing). CPU/STORAGE blocks belong to an offloading connector, not to us.
ENGINE_MEDIUMS = (None, "GPU", "gpu", "cpu")


def _get(ev: Any, name: str, pos: int, default=None):
    if isinstance(ev, dict):
        return ev.get(name, default)
    if isinstance(ev, (list, tuple)):
        return ev[pos] if len(ev) > pos else default
    return getattr(ev, name, default)


def decode_batch(payload: bytes) -> tuple[float, list]:
    """(timestamp, events) of one msgpack-encoded ``KVEventBatch``. Events stay as msgspec
    decoded them: maps with a ``type`` tag. Raises ValueError on a malformed payload."""
    import msgspec

    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise ValueError(f"undecodable KV event batch: {e}") from None
    if isinstance(batch, dict):
        ts, events = batch.get("ts", 0.0), batch.get("events", [])
    elif isinstance(batch, (list, tuple)) and len(batch) >= 2:
        ts, events = batch[0], batch[1]
    else:
        raise ValueError(f"KV event batch of unexpected shape: {type(batch).__name__}")
    if not isinstance(events, list):
        raise ValueError("KV event batch without an event list")
    return float(ts or 0.0), events


def event_type(ev: Any) -> str | None:
    if isinstance(ev, dict):
        return ev.get("type")
    if isinstance(ev, (list, tuple)) and ev and isinstance(ev[0], str):
        return ev[0]
    return type(ev).__name__


class ReplicaIndex:
    """The blocks one engine holds in its own KV cache, by the store's block hash."""

    def __init__(self, block_size: int, stale_s: float = 5.0, clock=time.monotonic):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.stale_s = stale_s
        self._clock = clock
        self._ours: dict[Any, str] = {}  # vLLM block hash -> our hash
        self._held: Counter[str] = Counter()  # our hash -> vLLM blocks holding it
        self.next_seq: int | None = None  # number of the next batch expected
        self._stale_until = 0.0
        self.applied = 0  # events applied
        self.unnamed = 0  # stored blocks left out (parent unknown, extra keys)
        self.resets = 0

    # ------------------------------------------------------------- events ----
    def gap(self, seq: int) -> bool:
        """Whether batch ``seq`` would skip batches (some were lost)."""
        return self.next_seq is not None and seq > self.next_seq

    def apply_batch(self, seq: int, events: Iterable[Any]) -> bool:
        """Apply batch ``seq``; False (nothing applied) for a batch seen already."""
        if self.next_seq is not None and seq < self.next_seq:
            return False
        for ev in events:
            self.apply(ev)
        self.next_seq = seq + 1
        return True

    def apply(self, ev: Any) -> None:
        kind = event_type(ev)
        if kind == STORED:
            # tag-less positions (array form): type, block_hashes, parent, token_ids, block_size,
            # lora_id, medium, lora_name, extra_keys
            if _get(ev, "medium", 6) not in ENGINE_MEDIUMS:
                return
            self.stored(_get(ev, "block_hashes", 1) or [], _get(ev, "parent_block_hash", 2),
                        _get(ev, "token_ids", 3) or [], _get(ev, "block_size", 4) or self.block_size,
                        _get(ev, "extra_keys", 8))
        elif kind == REMOVED:
            if _get(ev, "medium", 2) not in ENGINE_MEDIUMS:
                return
            self.removed(_get(ev, "block_hashes", 1) or [])
        elif kind == CLEARED:
            self.cleared()
        else:
            return
        self.applied += 1

    def stored(self, hashes: Sequence[Any], parent: Any, token_ids: Sequence[int], block_size: int,
               extra_keys: Sequence[Any] | None = None) -> None:
        if block_size != self.block_size or len(token_ids) < len(hashes) * block_size:
            self.unnamed += len(hashes)
            return
        if parent is None:
            prior = ""
        else:
            prior = self._ours.get(_hkey(parent))
            if prior is None:
                self.unnamed += len(hashes)
                return
        ours = page_hashes(token_ids[:len(hashes) * block_size], block_size, prior)
        for i, (h, o) in enumerate(zip(hashes, ours)):
            if extra_keys and i < len(extra_keys) and extra_keys[i]:
                self.unnamed += len(hashes) - i
                return  # its hash (and its children's) depends on more than tokens
            k = _hkey(h)
            old = self._ours.get(k)
            if old == o:
                continue
            if old is not None:
                self._drop(old)
            self._ours[k] = o
            self._held[o] += 1

    def removed(self, hashes: Sequence[Any]) -> None:
        for h in hashes:
            o = self._ours.pop(_hkey(h), None)
            if o is not None:
                self._drop(o)

    def _drop(self, o: str) -> None:
        n = self._held[o] - 1
        if n > 0:
            self._held[o] = n
        else:
            del self._held[o]

    def cleared(self) -> None:
        self._ours.clear()
        self._held.clear()

    def reset(self, next_seq: int | None = None) -> None:
        """Forget everything (events were lost for good): stale for ``stale_s``."""
        self.cleared()
        self.next_seq = next_seq
        self._stale_until = self._clock() + self.stale_s
        self.resets += 1

    # ------------------------------------------------------------- queries ----
    @property
    def stale(self) -> bool:
        return self._clock() < self._stale_until

    @property
    def blocks(self) -> int:
        return len(self._ours)

    def match(self, hashes: Sequence[str]) -> int:
        """How many leading blocks of ``hashes`` (a prompt's chained hashes) the engine
        holds; 0 while stale."""
        if self.stale:
            return 0
        n = 0
        for h in hashes:
            if h not in self._held:
                break
            n += 1
        return n


def _hkey(h: Any) -> Any:
    """vLLM block hashes arrive as bytes or ints (lists once through msgpack for tuples)."""
    return tuple(h) if isinstance(h, list) else h


# ---------------------------------------------------------------- decision ----
@dataclass
class Load:
    """Work a replica has in hand, as the router sees it."""

    tokens: int = 0  # prompt tokens still to compute of the requests routed to it, in flight
    requests: int = 0  # requests in flight (ours, and other routers' seen at the replica lately)


@dataclass
class Option:
    """One replica's answer for one prompt."""

    key: Any
    engine_blocks: int
    store_blocks: int  # blocks after ``engine_blocks`` the store holds, in order
    cost: float = 0.0
    hit_tokens: int = 0  # prompt tokens it does not compute (held or loaded)
    loaded_tokens: int = 0


@dataclass
class CostModel:
    """Weights of :func:`choose`, in prompt-token equivalents."""

    load_cost: float = 0.4  # loading a token from the store / computing one (measured, docs/performance.md)
    request_cost: float = 64.0  # per request in flight (its decode steps, scheduling)
    min_hit_blocks: int = 1  # a replica's hit shorter than this counts as none
    # replica -> its engine's own load_cost, learned from its steps (``_step_costs``); the
    # others are weighed by ``load_cost``
    load_costs: dict = field(default_factory=dict)

    def __post_init__(self):
        if not 0 <= self.load_cost <= 1:
            raise ValueError(f"load_cost must be in [0, 1], got {self.load_cost}")
        if self.request_cost < 0:
            raise ValueError(f"request_cost must be >= 0, got {self.request_cost}")


@dataclass
class Decision:
    ranked: list[Option]
    reason: str  # engine | store | load | balance
    prompt_tokens: int = 0
    engine_blocks: dict = field(default_factory=dict)

    @property
    def best(self) -> Option:
        return self.ranked[0]


class StoreCoverage:
    """How much of what the engines hold the store holds too, read from the router's own
    lookups (no call of its own): per decision, of the prompt's blocks that some
    candidate's engine holds and another's does not (the store was asked for them), the
    share the store has, as a moving average (weight ``alpha`` per decision). A store that
    holds the working set has them all (coverage 1, pressure 0); one below it holds the
    most recent part. Starts at 1: no pressure until lookups show some."""

    def __init__(self, alpha: float = 0.1):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.value = 1.0

    @property
    def pressure(self) -> float:
        return 1.0 - self.value

    def observe(self, engine_blocks: dict, present: Sequence[bool] | None) -> None:
        if present is None or not engine_blocks:
            return
        lo, hi = min(engine_blocks.values()), min(max(engine_blocks.values()), len(present))
        if hi <= lo:
            return
        share = sum(1 for p in present[lo:hi] if p) / (hi - lo)
        self.value += self.alpha * (share - self.value)


def store_run(present: Sequence[bool], start: int) -> int:
    """Consecutive blocks the store holds from block ``start``."""
    n = 0
    while start + n < len(present) and present[start + n]:
        n += 1
    return n


def choose(prompt_tokens: int, block_size: int, engine_blocks: dict, store_present: Sequence[bool] | None,
           load: dict, model: CostModel, tie=None, pressure: float = 0.0) -> Decision:
    """Rank replicas (``engine_blocks``'s keys) for a prompt of ``prompt_tokens`` tokens.

    Args:
        engine_blocks: replica -> leading blocks of the prompt its engine holds.
        store_present: per prompt block, whether the store holds it (None: no store).
        load: replica -> :class:`Load` (missing: idle).
        tie: replica -> a number breaking equal costs (e.g. random), lower first.
        pressure: the share of the blocks engines hold that the store lacks
            (:class:`StoreCoverage`), 0 to 1. A replica holding less of the prompt than the
            one holding most pays ``pressure`` per token of the difference: a store below
            the working set does not back what a conversation leaves behind when it moves,
            and its next turns compute what neither engine then holds whole.
    """
    # the engine computes at least the last token, and reuses whole blocks only
    limit = max(prompt_tokens - 1, 0) // block_size * block_size
    most = max((e for e in engine_blocks.values() if e >= model.min_hit_blocks), default=0)
    most_tokens = min(most * block_size, limit)
    opts = []
    for r, e in engine_blocks.items():
        e = e if e >= model.min_hit_blocks else 0
        s = store_run(store_present, e) if store_present is not None else 0
        hit = min((e + s) * block_size, limit)
        loaded = max(hit - e * block_size, 0)
        ld = load.get(r) or Load()
        cost = (prompt_tokens - hit) + model.load_costs.get(r, model.load_cost) * loaded + ld.tokens \
            + model.request_cost * ld.requests
        if pressure > 0:
            cost += pressure * max(most_tokens - min(e * block_size, limit), 0)
        opts.append(Option(r, e, s, cost, hit, loaded))
    tie = tie or {}
    opts.sort(key=lambda o: (o.cost, tie.get(o.key, 0)))
    best = opts[0]
    if best.engine_blocks and best.engine_blocks == most:
        reason = "engine"
    elif best.store_blocks:
        reason = "store"
    elif most:
        reason = "load"  # a replica holds more of the prompt but has too much work in hand
    else:
        reason = "balance"
    return Decision(opts, reason, prompt_tokens, dict(engine_blocks))
