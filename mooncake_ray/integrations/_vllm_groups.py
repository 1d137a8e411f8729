"""Hybrid models in the vLLM connector: vLLM's KV cache groups as the store sees them, and
the rule that decides how much of a prompt the store can give back. Free of vLLM's
engine and of Ray, so it is tested in microseconds (``tests/unit/test_vllm_groups.py``).

vLLM's hybrid KV cache manager splits a model's layers into *groups* by what a layer keeps
per request: every token's K and V (full attention), the last ``window`` tokens' (sliding
window), or one recurrent state (state-space / linear-attention layers, which vLLM keeps as
"mamba" state). Each group has its own block table over one shared pool of blocks, and
each block of a request covers the same ``block_size`` tokens in every group.

The connector stores a request's block ``i`` once per *kind*: the groups of one kind
(several groups of sliding-window layers with the same window, say) are stored together,
as one value holding every layer of those groups, keyed ``<prefix><tag>/<hash of blocks
0..i>``. What a block holds and when it may be stored differs per kind:

=============  ===============================================  ==========================
kind           block ``i`` holds                                 a hit of ``n`` blocks needs
=============  ===============================================  ==========================
``full``       K, V of tokens ``i*bs .. (i+1)*bs``               blocks ``0 .. n-1``
``swa<w>``     the same, for layers that look back ``w`` tokens   the last ``ceil((w-1)/bs)``
                                                                 blocks before ``n``
``ssm``        the layers' state after token ``(i+1)*bs``        block ``n-1``
=============  ===============================================  ==========================

A hit is the longest ``n`` every kind accepts, found as vLLM finds its own prefix-cache
hits (a fixed point: each kind keeps or lowers the candidate until none lowers it). Blocks
the engine computed itself (its own prefix cache) are not looked up again.

What cannot be stored completely is refused when the engine starts (:func:`kinds_of`
raises :class:`~mooncake_ray.errors.ConfigError` naming the group): state-space layers
whose state vLLM keeps only for the running request (``mamba_cache_mode`` other than
``align``), chunked-local or cross attention, groups vLLM itself does not prefix-cache, and
groups with different block sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from mooncake_ray.errors import ConfigError

FULL, WINDOW, STATE = "full", "window", "state"


@dataclass(frozen=True)
class Kind:
    """The groups stored together under one key tag."""

    tag: str  # in keys: "full", "swa<window>", "ssm"
    rule: str  # FULL, WINDOW or STATE
    groups: tuple[int, ...]  # vLLM's group indices, in order
    layers: tuple[tuple[str, ...], ...]  # each group's layer names
    window_blocks: int = 0  # WINDOW: blocks a hit needs before its end

    def needs(self, first: int, n: int) -> range:
        """The blocks of a hit ending at block ``n`` (exclusive) that this kind loads, given
        that the engine holds blocks below ``first`` itself."""
        if n <= first:
            return range(0)
        if self.rule == FULL:
            return range(first, n)
        if self.rule == WINDOW:
            return range(max(first, n - self.window_blocks), n)
        return range(n - 1, n)


def _describe(i: int, group) -> str:
    names = list(group.layer_names)
    shown = ", ".join(names[:3]) + (f", ... ({len(names)} layers)" if len(names) > 3 else "")
    return f"KV cache group {i} ({type(group.kv_cache_spec).__name__}: {shown})"


def kinds_of(kv_cache_config) -> tuple[list[Kind], int]:
    """The kinds of a vLLM ``KVCacheConfig`` and their common block size.

    Raises:
        ConfigError: a group the store cannot hold completely, naming it and why.
    """
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowMLASpec, SlidingWindowSpec,
    )

    groups = list(kv_cache_config.kv_cache_groups)
    if not groups:
        raise ConfigError("MooncakeRayConnector: the model has no KV cache groups (attention-free models "
                          "have no KV to store)")
    found: dict[str, tuple[str, list[int], int]] = {}
    sizes = set()
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        what = _describe(i, g)
        if not getattr(spec, "prefix_cacheable", True):
            raise ConfigError(f"MooncakeRayConnector: {what} is not prefix-cacheable in vLLM, so its "
                              "contents cannot be reused from the store; this model is not supported")
        if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
            tag, rule, wb = "full", FULL, 0
        elif type(spec) in (SlidingWindowSpec, SlidingWindowMLASpec):
            tag, rule, wb = f"swa{spec.sliding_window}", WINDOW, -(-(spec.sliding_window - 1) // spec.block_size)
        elif type(spec) is MambaSpec:
            mode = getattr(spec, "mamba_cache_mode", "none")
            if mode != "align":
                raise ConfigError(
                    f"MooncakeRayConnector: {what} keeps its state only for the running request "
                    f"(mamba_cache_mode={mode!r}), so the store could hold its attention KV but not "
                    "its state and a loaded prefix would be wrong; start vLLM with "
                    "mamba_cache_mode='align' (--mamba-cache-mode align) and prefix caching on")
            if getattr(spec, "num_speculative_blocks", 0):
                raise ConfigError(f"MooncakeRayConnector: {what} with speculative decoding blocks "
                                  f"({spec.num_speculative_blocks}) is not supported")
            tag, rule, wb = "ssm", STATE, 0
        else:
            raise ConfigError(
                f"MooncakeRayConnector: {what}: {type(spec).__name__} layers are not supported (supported: "
                "full attention, sliding-window attention, state-space layers with "
                "mamba_cache_mode='align'); for an attention-only model, --disable-hybrid-kv-cache-manager "
                "makes vLLM keep one group the connector stores")
        sizes.add(spec.block_size)
        k = found.setdefault(tag, (rule, [], wb))
        k[1].append(i)
    if len(sizes) != 1:
        raise ConfigError(f"MooncakeRayConnector: KV cache groups of different block sizes {sorted(sizes)} are "
                          "not supported")
    kinds = [Kind(tag, rule, tuple(ids), tuple(tuple(groups[i].layer_names) for i in ids), wb)
             for tag, (rule, ids, wb) in found.items()]
    return kinds, sizes.pop()


def is_plain(kinds: Sequence[Kind]) -> bool:
    """One group of full attention: the connector's original one-value-per-block layout."""
    return len(kinds) == 1 and kinds[0].rule == FULL and kinds[0].groups == (0,)


def hit_blocks(kinds: Sequence[Kind], first: int, last: int,
               present: Callable[[Kind, int], bool]) -> int:
    """The longest hit ``n`` (``first <= n <= last``, in blocks) every kind accepts:
    ``present(kind, i)`` says whether the store holds block ``i`` of that kind. Returns
    ``first`` when the store adds nothing."""
    n = last
    while True:
        before = n
        for k in kinds:
            n = _longest(k, first, n, present)
        if n == before or n <= first:
            return max(n, first)


def _longest(k: Kind, first: int, n: int, present) -> int:
    """The largest ``m <= n`` this kind accepts on its own."""
    if k.rule == FULL:
        m = first
        while m < n and present(k, m):
            m += 1
        return m
    if k.rule == STATE:
        for m in range(n, first, -1):
            if present(k, m - 1):
                return m
        return first
    run = 0  # WINDOW: a run of window_blocks present blocks ending at m, or present back to first
    for m in range(n, first, -1):
        run = 0
        while run < k.window_blocks and m - run > first and present(k, m - run - 1):
            run += 1
        if run == k.window_blocks or m - run == first:
            return m
    return first


def state_block(end: int, block_size: int) -> int | None:
    """The block a state-space kind may store after a step that leaves the request at
    ``end`` tokens: the block ending there (vLLM writes a request's state into the block
    that holds its last token; only a step that ends on a block boundary leaves a state
    another request can start from), else None."""
    if end <= 0 or end % block_size:
        return None
    return end // block_size - 1
