"""A small decoder-only transformer that runs on a CPU, with a paged KV cache.

It exists so the whole system (store, transport, engines, Serve app) runs and is tested
anywhere, with real KV bytes moving. Weights come from a seed; the tokenizer is
byte-level. Its KV geometry (layers, KV heads, head dim, dtype) is configurable so a
benchmark can carry a real model's KV bytes per token (Qwen3-8B: 36 x 8 x 128 x bf16 x
K,V = 144 KiB), while ``hidden`` and ``ffn`` stay small.

Exactness: greedy generation gives the same tokens, and the same logits to the bit,
whether a prompt's KV was computed here, loaded from the store, or handed over by a
prefill engine. Three rules make that true:

1. prefill runs in chunks of exactly ``page_size`` tokens starting at page boundaries,
   and cached prefixes are whole pages, so every token's K/V is computed by the same
   operations on the same shapes whatever was cached;
2. attention always reads K/V back from the page pool (in the pool's dtype), never from
   the fresh float32 values, so computed and loaded KV are the same numbers;
3. one intra-op thread by default (``torch.set_num_threads``), so GEMM reductions run in
   the same order in every process.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import torch

from mooncake_ray.kv import KVGeometry, PagePool

BOS, EOS, PAD = 256, 257, 258
VOCAB = 260


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    kv_dtype: str = "float32"
    num_q_heads: int = 4
    hidden: int = 128
    ffn: int = 256
    page_size: int = 16
    seed: int = 0
    rope_theta: float = 10000.0
    max_context: int = 32768
    model_id: str = "mooncake-ray/tiny-lm"

    def geometry(self) -> KVGeometry:
        return KVGeometry(self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype, self.page_size)

    def to_dict(self) -> dict:
        return asdict(self)


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus BOS/EOS; a minimal chat template."""

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return ([BOS] if bos else []) + list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def chat(self, messages: Sequence[dict]) -> list[int]:
        out = [BOS]
        for m in messages:
            out += list(f"<|{m['role']}|>{m['content']}\n".encode("utf-8"))
        return out + list(b"<|assistant|>")


class TinyLM(torch.nn.Module):
    """Pre-norm transformer with grouped-query attention and rotary positions."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.num_q_heads % cfg.num_kv_heads:
            raise ValueError(f"num_q_heads {cfg.num_q_heads} must be a multiple of num_kv_heads {cfg.num_kv_heads}")
        self.cfg = cfg
        g = torch.Generator().manual_seed(cfg.seed)

        def w(*shape):
            return torch.nn.Parameter(torch.randn(*shape, generator=g) / math.sqrt(shape[-1]), requires_grad=False)

        qd, kvd = cfg.num_q_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.embed = w(VOCAB, cfg.hidden)
        self.layers = []
        for i in range(cfg.num_layers):
            layer = {"wq": w(qd, cfg.hidden), "wk": w(kvd, cfg.hidden), "wv": w(kvd, cfg.hidden),
                     "wo": w(cfg.hidden, qd), "w1": w(cfg.ffn, cfg.hidden), "w2": w(cfg.hidden, cfg.ffn)}
            for name, p in layer.items():
                self.register_parameter(f"l{i}_{name}", p)
            self.layers.append(layer)
        self.head = w(VOCAB, cfg.hidden)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
        pos = torch.arange(cfg.max_context, dtype=torch.float64)[:, None] * inv[None]
        self.register_buffer("cos", pos.cos().float(), persistent=False)
        self.register_buffer("sin", pos.sin().float(), persistent=False)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    @torch.no_grad()
    def forward_chunk(self, tokens: Sequence[int], start: int, pool: PagePool, page_table: Sequence[int]) -> torch.Tensor:
        """Run tokens at positions ``start..start+n`` (their pages listed in ``page_table``,
        one pool page per sequence page), write their K/V into the pool, and return the
        float32 logits ``[n, VOCAB]``. K/V of positions before ``start`` must be in the pool."""
        cfg, ps = self.cfg, self.cfg.page_size
        n = len(tokens)
        end = start + n
        positions = torch.arange(start, end)
        x = self.embed[torch.as_tensor(list(tokens), dtype=torch.long)]
        ctx_pages = [page_table[p] for p in range((end + ps - 1) // ps)]
        group = cfg.num_q_heads // cfg.num_kv_heads
        mask = positions[:, None] >= torch.arange(end)[None, :]  # [n, end] causal
        dtype = pool.tensor.dtype
        for li, L in enumerate(self.layers):
            h = self._norm(x)
            q = self._rope((h @ L["wq"].T).view(n, cfg.num_q_heads, cfg.head_dim), positions)
            k = self._rope((h @ L["wk"].T).view(n, cfg.num_kv_heads, cfg.head_dim), positions)
            v = (h @ L["wv"].T).view(n, cfg.num_kv_heads, cfg.head_dim)
            pos = start
            while pos < end:  # write this chunk's K/V into its pages
                nxt = min(end, (pos // ps + 1) * ps)
                i0, i1 = pos - start, nxt - start
                pool.write_layer_kv(li, page_table[pos // ps], pos % ps, k[i0:i1].to(dtype), v[i0:i1].to(dtype))
                pos = nxt
            kk, vv = pool.layer_kv(li, ctx_pages)  # read back: computed and loaded KV are equal
            kk, vv = kk[:end].float(), vv[:end].float()
            kk = kk.repeat_interleave(group, dim=1)
            vv = vv.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(cfg.head_dim)
            scores = scores.masked_fill(~mask[None], float("-inf"))
            att = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv).reshape(n, -1)
            x = x + att @ L["wo"].T
            x = x + torch.nn.functional.gelu(self._norm(x) @ L["w1"].T) @ L["w2"].T
        return self._norm(x) @ self.head.T


def set_deterministic_threads(n: int = 1) -> None:
    torch.set_num_threads(n)
