"""What the vLLM connector loads and saves each step: the scheduler side's bookkeeping,
free of vLLM and Ray so it is tested in microseconds (``tests/unit/test_vllm_plan.py``).

A vLLM KV block of ``block_size`` tokens is stored as one value holding every layer, keyed

    <prefix><chained hash of the block's tokens>

(``prefix`` from :func:`mooncake_ray.kv.key_prefix`: model, geometry, layout and the
worker's tensor- and pipeline-parallel rank). The value is the block's range of each
layer's paged KV tensor, layer by layer: the whole block per layer on vLLM's CPU backend
(``[num_blocks, kv_heads, block_size, 2 * head_dim]``), its K part then its V part in
FlashAttention's GPU layout (``_vllm_layout``). One key per block keeps the store's work
per token independent of the model's depth (36 layers: 36 times fewer keys, lookups and
leases than one object per layer); loads and saves move the bytes between the store and
vLLM's registered KV memory with no copy in between (or one, on the staged device path),
and a layer-wise load reads layer 0 of every block first, then layer 1, ...

Per request the plan keeps the chained hashes of its full blocks and ``saved_upto``: the
blocks below it are in the store already or need no saving. It starts at the blocks vLLM
had computed before the request was scheduled (its own prefix cache: computed by this
engine earlier, and saved then) plus the blocks found in the store, so a loaded or stored
block is never written again; a block becomes due once a step completes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from mooncake_ray.kv import page_hashes


@dataclass
class BlockRun:
    """Consecutive blocks of one request to load or save: block ``first + i`` of the
    request, with chained hash ``hashes[i]``, lives in vLLM block ``block_ids[i]``."""

    req_id: str
    first: int
    hashes: list[str]
    block_ids: list[int]
    direct: dict | None = None  # read from a prefill engine: {"engine", "req", "blocks"} (see _vllm_direct)
    parent: str = ""  # the chained hash of block ``first - 1`` (saves; "" for the first block)
    keep: tuple[str, float] | None = None  # (conversation id, seconds): soft-pin the run's last block
    kind: str = ""  # a hybrid model's kind tag (_vllm_groups); "" for a one-group model
    hold_s: float | None = None  # saves: hold the run's blocks for a decode's read, at most this long
    release: list[str] = field(default_factory=list)  # loads: hashes of the blocks a prefill held for this read


@dataclass
class StepPlan:
    loads: list[BlockRun] = field(default_factory=list)
    saves: list[BlockRun] = field(default_factory=list)
    sync_saves: bool = False  # the worker finishes this step's saves before it returns
    drain_saves: bool = False  # a request was preempted: its blocks may be reused, finish saves first
    holds: list[str] = field(default_factory=list)  # finished requests whose blocks a decode engine reads


@dataclass
class _Req:
    hashes: list[str] = field(default_factory=list)
    saved_upto: int | None = None  # None until the request is first scheduled
    found: tuple[int, int] = (0, 0)  # (first block, number) of the store's match
    direct: dict | None = None  # the prefill engine's blocks, when a decode request names them
    load: BlockRun | None = None  # allocated, to be sent to the worker
    saves_sent: bool = False
    keep: tuple[str, float] | None = None  # the request's conversation hint (kv.ConversationHint)
    hold_s: float | None = None  # a prefill for a decode engine: hold its prompt's blocks until read
    held_from_start: bool = False  # its first held save covered the blocks it found stored or cached
    release: list[str] = field(default_factory=list)  # a decode of a prefill's blocks: the blocks it held


class SchedulerPlan:
    """Bookkeeping of the scheduler-side connector (one per engine).

    Args:
        block_size: tokens per vLLM block.
        load: whether this engine loads from the store (not a pure producer... any role may).
        save: whether it saves (False for a kv_consumer).
        save_decode: save blocks completed by generated tokens too (a chat's next turn
            then finds its previous answer), not only the prompt's.
        sync_saves: the worker waits for each step's saves (a prefill producer: the KV must
            be in the store before the response reaches the decode engine).
    """

    def __init__(self, block_size: int, *, load: bool = True, save: bool = True,
                 save_decode: bool = True, sync_saves: bool = False):
        self.block_size = block_size
        self.load, self.save, self.save_decode, self.sync_saves = load, save, save_decode, sync_saves
        self._reqs: dict[str, _Req] = {}
        self._holds: list[str] = []

    def _req(self, req_id: str) -> _Req:
        return self._reqs.setdefault(req_id, _Req())

    # --------------------------------------------------------------- hashes ----
    def hashes(self, req_id: str, tokens: Sequence[int], n_blocks: int) -> list[str]:
        """Chained hashes of the first ``n_blocks`` full blocks of ``tokens`` (extended
        incrementally as the request grows)."""
        r = self._req(req_id)
        have = len(r.hashes)
        if have < n_blocks:
            bs = self.block_size
            prior = r.hashes[-1] if r.hashes else ""
            r.hashes.extend(page_hashes(tokens[have * bs:n_blocks * bs], bs, prior))
        return r.hashes[:n_blocks]

    # ------------------------------------------------------------ scheduling ----
    def match(self, req_id: str, tokens: Sequence[int], num_computed: int,
              present: Callable[[list[str]], int]) -> int:
        """Tokens beyond ``num_computed`` whose blocks the store holds. The block holding
        the last token is never matched (vLLM must compute at least one token).
        ``present(hashes)`` returns how many leading hashes are stored."""
        if not self.load:
            return 0
        bs = self.block_size
        first, last = num_computed // bs, (len(tokens) - 1) // bs
        if num_computed % bs or first >= last:
            return 0
        hs = self.hashes(req_id, tokens, last)[first:]
        r = self._reqs[req_id]
        d, nb = r.direct, len(r.direct["blocks"]) if r.direct else 0
        mine = self.hashes(req_id, tokens, min(nb, len(tokens) // bs)) if nb else []
        if nb and len(mine) == nb and mine[-1] == d["last_hash"]:
            n = max(0, min(last, nb) - first)  # the prefill engine holds this prompt's blocks
        else:
            r.direct = None
            n = present(hs)
        r.found = (first, n)
        return n * bs

    def keep(self, req_id: str, conversation_id: str, keep_s: float) -> None:
        """The request's conversation asks to be kept: its saves pin their last block."""
        self._reqs.setdefault(req_id, _Req()).keep = (conversation_id, keep_s)

    def hold(self, req_id: str, hold_s: float) -> None:
        """A prefill whose decode runs elsewhere: its saves hold the prompt's blocks (each
        soft-pinned by the call that stores it) until the decode engine's read releases
        them, or ``hold_s``. Its first save run starts at block 0: the blocks it loaded
        from the store or had in the engine's cache are held too (the worker pins those
        the store has and stores again those it lost)."""
        self._req(req_id).hold_s = hold_s

    def release_source(self, req_id: str, tokens: Sequence[int], stored_tokens: Any) -> None:
        """A decode request whose prefill stored ``stored_tokens`` of its prompt (the
        producer's params): its load releases the prefill's holds on every block of them,
        those it loads and those the engine had (and the last, which vLLM computes)."""
        bs = self.block_size
        if type(stored_tokens) is int and bs <= stored_tokens <= len(tokens):
            self._req(req_id).release = self.hashes(req_id, tokens, stored_tokens // bs)

    def direct_source(self, req_id: str, params: dict | None) -> None:
        """Remember the prefill engine's blocks named by a decode request's params."""
        if params:
            self._reqs.setdefault(req_id, _Req()).direct = params

    def held_blocks(self, req_id: str, tokens: Sequence[int], num_prompt: int, block_ids: Sequence[int]) -> dict:
        """A finished prefill request's full prompt blocks, to be read by a decode engine."""
        n = min(num_prompt // self.block_size, len(block_ids))
        hs = self.hashes(req_id, tokens, n)
        if n:
            self._holds.append(req_id)
        return {"blocks": list(block_ids[:n]), "last_hash": hs[-1] if hs else ""}

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM allocated ``block_ids`` (all of the request's blocks) and will take
        ``num_external_tokens`` from us."""
        r = self._reqs.setdefault(req_id, _Req())
        n = num_external_tokens // self.block_size
        if n <= 0:
            return
        first, found = r.found
        n = min(n, found)
        direct = None
        if r.direct is not None:
            direct = {"engine": r.direct["engine"], "req": r.direct["req"],
                      "blocks": r.direct["blocks"][first:first + n]}
        r.load = BlockRun(req_id, first, r.hashes[first:first + n], list(block_ids[first:first + n]), direct,
                          release=r.release)
        r.release = []  # released once

    def step(self, scheduled: Sequence[tuple[str, Sequence[int], int, int, int]],
             block_ids_of: Callable[[str], Sequence[int]], preempted: bool = False) -> StepPlan:
        """The plan of one step. ``scheduled``: per request scheduled this step,
        ``(req_id, all token ids, prompt length, tokens computed before the step, tokens
        scheduled)``."""
        plan = StepPlan(sync_saves=self.sync_saves, drain_saves=preempted, holds=self._holds)
        self._holds = []
        for req_id, r in self._reqs.items():
            if r.load is not None:
                plan.loads.append(r.load)
                r.load = None
        if not self.save:
            return plan
        bs = self.block_size
        for req_id, tokens, prompt_len, computed, n_sched in scheduled:
            r = self._reqs.setdefault(req_id, _Req())
            if r.saved_upto is None:
                first, found = r.found
                r.saved_upto = max(computed // bs, first + found)
            limit = len(tokens) if self.save_decode else prompt_len
            full = min(computed + n_sched, limit) // bs
            start = r.saved_upto
            if r.hold_s is not None and not r.held_from_start:
                start = 0  # the blocks before saved_upto are read by the decode too
                full = max(full, r.saved_upto)
            if full <= start:
                continue
            ids = block_ids_of(req_id)
            full = min(full, len(ids))
            if full <= start:
                continue
            hs = self.hashes(req_id, tokens, full)
            plan.saves.append(BlockRun(req_id, start, hs[start:full], list(ids[start:full]),
                                       parent=hs[start - 1] if start else "", keep=r.keep, hold_s=r.hold_s))
            r.saved_upto = max(full, r.saved_upto)
            r.held_from_start = r.hold_s is not None
            r.saves_sent = True
        return plan

    def finished(self, req_id: str) -> bool:
        """The request is done; returns whether its blocks must outlive it until the
        worker reports its saves finished (asynchronous saves were sent for it)."""
        r = self._reqs.pop(req_id, None)
        return bool(r and r.saves_sent and not self.sync_saves)

    def forget(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._reqs)


@dataclass
class _HybridReq(_Req):
    saved: dict[str, int] = field(default_factory=dict)  # kind tag -> blocks below it stored or not due
    loads: list[BlockRun] = field(default_factory=list)
    no_loads: bool = False  # a load of it failed: computed whole from now on


class HybridPlan(SchedulerPlan):
    """The plan of a hybrid model (several KV cache groups, ``_vllm_groups``): per block
    one value per kind, the hit every kind accepts, and for each kind only the blocks it
    needs (a sliding window's last blocks, a state-space layer's last state).

    ``BlockRun.kind`` names the kind; ``block_ids[i]`` is a tuple of vLLM block ids, one
    per group of the kind. Saves are synchronous (vLLM frees a sliding window's old blocks
    and a state-space layer's old states while the request runs, so a save cannot wait for
    the request to finish); a prefill engine's direct handoff is not used.

    A prefill for a decode engine (``hold``) holds every block it saves, of every kind, and
    its first held save also takes what the decode reads of the blocks it found stored or
    cached (``needs(0, found)`` per kind: pinned if stored, stored again if lost). The
    decode's loads release, per kind, every block of the producer's ``stored_tokens``
    (``release_source``): a superset of what was held, which costs a not-found answer per
    block never stored and leaves nothing held past the read."""

    def __init__(self, block_size: int, kinds, *, load: bool = True, save: bool = True,
                 save_decode: bool = True, null_block: int = 0):
        super().__init__(block_size, load=load, save=save, save_decode=save_decode, sync_saves=True)
        self.kinds = list(kinds)
        self.null_block = null_block

    def _req(self, req_id: str) -> _HybridReq:
        return self._reqs.setdefault(req_id, _HybridReq())

    def match(self, req_id: str, tokens: Sequence[int], num_computed: int,
              present: Callable[[list[tuple[str, str]]], list[bool]]) -> int:
        """Tokens beyond ``num_computed`` the store gives back whole. ``present`` takes
        ``(kind tag, hash)`` pairs and returns whether each is stored (one batched call)."""
        from mooncake_ray.integrations._vllm_groups import hit_blocks

        r = self._req(req_id)
        r.found = (0, 0)
        if not self.load or r.no_loads:
            return 0
        bs = self.block_size
        first, last = num_computed // bs, (len(tokens) - 1) // bs
        if num_computed % bs or first >= last:
            return 0
        hs = self.hashes(req_id, tokens, last)
        ask = [(k.tag, hs[i]) for k in self.kinds for i in range(first, last)]
        found = dict(zip(ask, present(ask)))
        n = hit_blocks(self.kinds, first, last, lambda k, i: found[(k.tag, hs[i])])
        r.found = (first, n - first)
        return (n - first) * bs

    def no_loads(self, req_id: str) -> None:
        """The request's load failed: it is not looked up again."""
        self._req(req_id).no_loads = True

    def allocated(self, req_id: str, block_ids, num_external_tokens: int) -> None:
        """``block_ids``: vLLM's block ids per group (all of the request's blocks)."""
        r = self._req(req_id)
        n_ext = num_external_tokens // self.block_size
        first, found = r.found
        n = first + min(n_ext, found)
        if n <= first:
            return
        r.loads = []
        for k in self.kinds:
            idx = list(k.needs(first, n))
            if idx:
                r.loads.append(BlockRun(req_id, idx[0], [r.hashes[i] for i in idx],
                                        [tuple(block_ids[g][i] for g in k.groups) for i in idx], kind=k.tag,
                                        release=r.release))
        r.release = []  # released once

    def step(self, scheduled, block_ids_of, preempted: bool = False) -> StepPlan:
        from mooncake_ray.integrations._vllm_groups import STATE, state_block

        plan = StepPlan(sync_saves=True, drain_saves=preempted)
        for r in self._reqs.values():
            if r.loads:
                plan.loads.extend(r.loads)
                r.loads = []
        if not self.save:
            return plan
        bs = self.block_size
        for req_id, tokens, prompt_len, computed, n_sched in scheduled:
            r = self._req(req_id)
            if r.saved_upto is None:
                first, found = r.found
                r.saved_upto = max(computed // bs, first + found)
                r.saved = {k.tag: r.saved_upto for k in self.kinds}
            limit = len(tokens) if self.save_decode else prompt_len
            end = computed + n_sched
            full = min(end, limit) // bs
            held_first = r.hold_s is not None and not r.held_from_start
            if held_first:  # the decode reads what was found too
                full = max(full, r.saved_upto)
            elif full <= min(r.saved.values()):
                continue
            ids = block_ids_of(req_id)
            hs = self.hashes(req_id, tokens, full)
            for k in self.kinds:
                start = r.saved[k.tag]
                if k.rule == STATE:
                    b = state_block(end, bs) if end <= limit else None
                    todo = [b] if b is not None and b >= start else []
                else:
                    todo = list(range(0 if held_first else start, full))
                if held_first:
                    todo = sorted(set(todo).union(k.needs(0, r.saved_upto)))
                todo = [i for i in todo if all(i < len(ids[g]) and ids[g][i] != self.null_block for g in k.groups)]
                if todo:
                    plan.saves.append(BlockRun(req_id, todo[0], [hs[i] for i in todo],
                                               [tuple(ids[g][i] for g in k.groups) for i in todo],
                                               keep=r.keep, kind=k.tag, hold_s=r.hold_s))
                r.saved[k.tag] = max(start, full)
            r.saved_upto = min(r.saved.values())
            r.held_from_start = r.hold_s is not None
        return plan
