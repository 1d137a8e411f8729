"""An inference engine with a two-level KV cache: its own page pool (L1) and the store (L3).

This is how SGLang HiCache uses Mooncake, reduced to what the reference model needs:

- **L1**: the engine's page pool. Full pages are indexed by their chained hash (see
  ``mooncake_ray.kv``), shared by every sequence that has the same prefix, reference
  counted, and evicted least-recently-used once no sequence holds them.
- **L3**: the distributed store. On a request, the pages after the L1 prefix are looked up
  (one ``batch_exists``) and loaded (one ``batch_get_into`` straight into the pool), under
  a prefetch policy:

  - ``best_effort``: load whatever is there, stop at the first miss or error, never wait;
  - ``wait_complete``: load every page the store has, waiting out backpressure;
  - ``timeout``: like best_effort, but give up loading after
    ``min(max, base + per_ki_token * tokens / 1024)`` seconds (SGLang's defaults 2 s,
    0.1 s, 30 s) and recompute the rest.

  New full pages are written through to the store (batched), in prefill and optionally in
  decode.
- **Degradation**: any store error (master down, node lost, timeout) turns L3 off for
  ``l3_backoff_s`` and the request is served by recomputing. A request never fails
  because the cache is gone.

Exactness: see ``model.py``. Prefill runs in page-aligned chunks of ``page_size`` tokens
and only whole pages are reused, so logits are identical to the bit whatever was cached.

Not thread-safe: a deployment serialises calls (one request's step at a time).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from mooncake_ray.errors import MooncakeRayError
from mooncake_ray.engines.model import EOS, ModelConfig, TinyLM, set_deterministic_threads
from mooncake_ray.kv import ConversationHint, KVStore, PagePool, page_hashes

log = logging.getLogger(__name__)

POLICIES = ("best_effort", "wait_complete", "timeout")


@dataclass
class Sequence_:
    tokens: list[int]
    pages: list[int] = field(default_factory=list)  # pool page per sequence page
    computed: int = 0  # tokens whose K/V are in the pool
    cached_l1: int = 0
    cached_l3: int = 0
    hashes: list[str] = field(default_factory=list)
    registered: int = 0  # leading full pages already in the L1 index
    hint: ConversationHint | None = None  # the request's conversation (kv.ConversationHint)


@dataclass
class StepInfo:
    token: int
    logits: torch.Tensor
    prompt_tokens: int
    cached_tokens: int
    cached_l1: int
    cached_l3: int
    prefill_s: float = 0.0
    load_s: float = 0.0


class PoolExhausted(RuntimeError):
    """Every pool page is held by a running sequence."""


class InferenceEngine:
    def __init__(self, cfg: ModelConfig | None = None, *, pool_pages: int = 512, store=None,
                 layout: str = "page_first", prefetch: str = "best_effort", write_through: bool = True,
                 save_decode_cache: bool = True, threads: int = 1, tp_rank: int = 0, tp_size: int = 1,
                 l3_backoff_s: float = 5.0, prefetch_timeout=(2.0, 0.1, 30.0)):
        if prefetch not in POLICIES:
            raise ValueError(f"prefetch policy {prefetch!r} not allowed; allowed: {POLICIES}")
        set_deterministic_threads(threads)
        self.cfg = cfg or ModelConfig()
        self.model = TinyLM(self.cfg)
        self.pool = PagePool(self.cfg.geometry(), pool_pages, layout)
        self.kv = KVStore(store, self.cfg.model_id, self.cfg.geometry(), layout, tp_rank, tp_size) if store else None
        if self.kv is not None:
            try:
                self.kv.register_pool(self.pool)
            except MooncakeRayError as e:
                log.warning("could not register the page pool (%s): loads will copy", e)
        self.prefetch, self.write_through, self.save_decode_cache = prefetch, write_through, save_decode_cache
        self.l3_backoff_s, self.prefetch_timeout = l3_backoff_s, prefetch_timeout
        self._l3_off_until = 0.0
        self._free = list(range(pool_pages - 1, -1, -1))
        self._refs = [0] * pool_pages
        self._l1: OrderedDict[str, int] = OrderedDict()  # hash -> page, LRU first
        self._hash_of: dict[int, str] = {}
        self.stats = {"requests": 0, "prompt_tokens": 0, "cached_l1": 0, "cached_l3": 0, "computed": 0,
                      "l3_errors": 0, "l3_saved_pages": 0, "l1_evictions": 0,
                      "load_s": 0.0, "compute_s": 0.0}

    # ------------------------------------------------------------------ pages ----
    def _alloc(self) -> int:
        if self._free:
            page = self._free.pop()
        else:
            for h, page in self._l1.items():  # least recently used first
                if self._refs[page] == 0:
                    del self._l1[h]
                    del self._hash_of[page]
                    self.stats["l1_evictions"] += 1
                    break
            else:
                raise PoolExhausted(f"all {len(self._refs)} pool pages are in use")
        self._refs[page] = 1
        return page

    def pages_for(self, tokens: int) -> int:
        """Pool pages a sequence of ``tokens`` tokens occupies."""
        return -(-tokens // self.cfg.page_size)

    def _hold(self, page: int) -> None:
        self._refs[page] += 1

    def release(self, seq: Sequence_) -> None:
        """Drop a finished sequence's pages (indexed ones stay cached in L1).

        Its indexed pages are touched last page first, so that within one sequence the
        deepest pages are the least recently used: eviction then shortens a cached prefix
        from its end (as a radix tree evicts leaves) instead of taking its first page,
        which would strand every page after it (a prefix is only found from its start)."""
        for h in reversed(seq.hashes[:seq.registered]):
            if h in self._l1:
                self._l1.move_to_end(h)
        for page in seq.pages:
            self._refs[page] -= 1
            if self._refs[page] == 0 and page not in self._hash_of:
                self._free.append(page)
        seq.pages = []

    def _index(self, seq: Sequence_) -> list[int]:
        """Put the sequence's newly completed full pages into the L1 index; returns the
        indices of the pages that are new to L1 (to write through to L3)."""
        ps = self.cfg.page_size
        full = seq.computed // ps
        if len(seq.hashes) < full:
            seq.hashes = page_hashes(seq.tokens[:full * ps], ps)
        new = []
        for i in range(seq.registered, full):
            h, page = seq.hashes[i], seq.pages[i]
            if h not in self._l1 and page not in self._hash_of:
                self._l1[h] = page
                self._hash_of[page] = h
                new.append(i)
            elif h in self._l1:
                self._l1.move_to_end(h)
        seq.registered = full
        return new

    # --------------------------------------------------------------------- L3 ----
    def _l3_ok(self) -> bool:
        return self.kv is not None and time.monotonic() >= self._l3_off_until

    def _l3_failed(self, e: Exception) -> None:
        self.stats["l3_errors"] += 1
        self._l3_off_until = time.monotonic() + self.l3_backoff_s
        log.warning("store unavailable (%s): serving without L3 for %.0fs", e, self.l3_backoff_s)

    def _load_l3(self, seq: Sequence_, first_page: int, max_pages: int) -> int:
        """Load pages ``first_page..`` from the store; returns how many were loaded."""
        if max_pages <= 0 or not self._l3_ok():
            return 0
        ps = self.cfg.page_size
        try:
            keys = [self.kv.prefix + h for h in seq.hashes[first_page:first_page + max_pages]]
            n = self.kv.lookup(seq.tokens, keys) // ps
            if n == 0:
                return 0
            pages = [self._alloc() for _ in range(n)]
            t0, budget, step = time.monotonic(), None, n
            if self.prefetch == "timeout":
                base, per_ki, cap = self.prefetch_timeout
                budget = min(cap, base + per_ki * len(seq.tokens) / 1024)
                step = max(1, n // 4)
            loaded = 0
            while loaded < n:
                chunk = pages[loaded:loaded + step]
                got = self.kv.load(seq.tokens, self.pool, chunk, first_page + loaded)
                loaded += got
                if got < len(chunk):
                    break  # a miss (evicted meanwhile): the rest is recomputed
                if budget is not None and time.monotonic() - t0 > budget:
                    break
        except MooncakeRayError as e:
            self._l3_failed(e)
            return 0
        for page in pages[loaded:]:  # allocated but not loaded: give back
            self._refs[page] = 0
            self._free.append(page)
        seq.pages.extend(pages[:loaded])
        return loaded

    def _save_l3(self, seq: Sequence_, new_pages: list[int]) -> None:
        if not new_pages or not self.write_through or not self._l3_ok():
            return
        try:
            start = new_pages[0]
            idx = list(range(start, new_pages[-1] + 1))
            self.stats["l3_saved_pages"] += self.kv.save(
                seq.tokens, self.pool, [seq.pages[i] for i in idx], start_page=start, hint=seq.hint)
        except MooncakeRayError as e:
            self._l3_failed(e)

    # ------------------------------------------------------------------ steps ----
    def _begin(self, tokens: Sequence[int]) -> tuple[Sequence_, int]:
        """Validate, and take the prompt's L1 prefix; returns the sequence and how many of
        its pages may come from a cache (the page holding the last token never does)."""
        ps, n = self.cfg.page_size, len(tokens)
        if n == 0:
            raise ValueError("empty prompt")
        if n >= self.cfg.max_context:
            raise ValueError(f"prompt of {n} tokens exceeds max_context={self.cfg.max_context}")
        seq = Sequence_(list(tokens))
        seq.hashes = page_hashes(seq.tokens, ps)
        reusable = (n - 1) // ps
        while len(seq.pages) < reusable and seq.hashes[len(seq.pages)] in self._l1:
            h = seq.hashes[len(seq.pages)]
            self._l1.move_to_end(h)
            self._hold(self._l1[h])
            seq.pages.append(self._l1[h])
        seq.cached_l1 = len(seq.pages) * ps
        seq.registered = len(seq.pages)
        return seq, reusable

    def prefill(self, tokens: Sequence[int], use_l3: bool = True,
                hint: ConversationHint | None = None) -> tuple[Sequence_, StepInfo]:
        """Compute (or load) the prompt's KV and the first token's logits (``hint``: the
        request's conversation, for the pages it saves to the store)."""
        t_start = time.monotonic()
        seq, reusable = self._begin(tokens)
        seq.hint = hint
        i = len(seq.pages)
        t_load = time.monotonic()
        loaded = self._load_l3(seq, i, reusable - i) if use_l3 else 0
        seq.cached_l3 = loaded * self.cfg.page_size
        return seq, self._finish(seq, (i + loaded) * self.cfg.page_size, t_start, time.monotonic() - t_load)

    def reserve(self, tokens: Sequence[int]) -> tuple[Sequence_, int]:
        """Decode side of a direct handoff: take the L1 prefix and allocate pool pages for
        the rest of the prompt's reusable pages, for a prefill engine to write into.
        Returns the sequence and the index of its first page to be filled."""
        seq, reusable = self._begin(tokens)
        first = len(seq.pages)
        try:
            while len(seq.pages) < reusable:
                seq.pages.append(self._alloc())
        except PoolExhausted:
            self.release(seq)
            raise
        return seq, first

    def prefill_reserved(self, seq: Sequence_, filled: int) -> StepInfo:
        """After a peer wrote ``filled`` pages into a reserved sequence: compute the rest."""
        t_start = time.monotonic()
        first = seq.cached_l1 // self.cfg.page_size
        seq.cached_l3 = filled * self.cfg.page_size  # handed over, not computed here
        return self._finish(seq, (first + filled) * self.cfg.page_size, t_start, 0.0)

    def _finish(self, seq: Sequence_, cached: int, t_start: float, load_s: float) -> StepInfo:
        n = len(seq.tokens)
        seq.computed = cached
        self._index(seq)  # loaded or handed-over pages join L1
        t_compute = time.monotonic()
        logits = self._compute(seq, cached, n)
        st = self.stats
        st["compute_s"] += time.monotonic() - t_compute
        st["load_s"] += load_s
        self._save_l3(seq, self._index(seq))
        st["requests"] += 1
        st["prompt_tokens"] += n
        st["cached_l1"] += seq.cached_l1
        st["cached_l3"] += seq.cached_l3
        st["computed"] += n - seq.cached_l1 - seq.cached_l3
        return StepInfo(int(torch.argmax(logits)), logits, n, seq.cached_l1 + seq.cached_l3, seq.cached_l1,
                        seq.cached_l3, time.monotonic() - t_start, load_s)

    def _compute(self, seq: Sequence_, start: int, end: int) -> torch.Tensor:
        ps = self.cfg.page_size
        logits = None
        pos = start
        while pos < end:
            nxt = min(end, (pos // ps + 1) * ps)
            while len(seq.pages) <= (nxt - 1) // ps:
                seq.pages.append(self._alloc())
            logits = self.model.forward_chunk(seq.tokens[pos:nxt], pos, self.pool, seq.pages)[-1]
            pos = nxt
        seq.computed = end
        return logits

    def decode_step(self, seq: Sequence_, token: int) -> StepInfo:
        """Append ``token`` and compute the next token's logits."""
        seq.tokens.append(token)
        logits = self._compute(seq, seq.computed, len(seq.tokens))
        new = self._index(seq)
        if self.save_decode_cache:
            self._save_l3(seq, new)
        return StepInfo(int(torch.argmax(logits)), logits, len(seq.tokens), 0, 0, 0)

    def generate(self, tokens: Sequence[int], max_new_tokens: int, stop_at_eos: bool = True,
                 use_l3: bool = True) -> Iterator[StepInfo]:
        """Greedy generation: yields one StepInfo per new token (the first carries the
        prefill's cache figures)."""
        seq, info = self.prefill(tokens, use_l3=use_l3)
        try:
            yield from self.continue_(seq, info, max_new_tokens, stop_at_eos)
        finally:
            self.release(seq)

    def continue_(self, seq: Sequence_, first: StepInfo, max_new_tokens: int,
                  stop_at_eos: bool = True) -> Iterator[StepInfo]:
        info = first
        for i in range(max_new_tokens):
            yield info
            if (stop_at_eos and info.token == EOS) or i + 1 == max_new_tokens:
                return
            info = self.decode_step(seq, info.token)

    def flush_l1(self) -> None:
        """Forget every unreferenced L1 page (benchmarks: start cold)."""
        for h, page in list(self._l1.items()):
            if self._refs[page] == 0:
                del self._l1[h]
                del self._hash_of[page]
                self._free.append(page)
