"""The reference engine: exact greedy results whether KV is computed, reused from L1, or
loaded from L3, in both pool layouts; degradation when the store fails. L3 here is an
in-memory stand-in with the client's batch interface (the real store is exercised by the
integration tests)."""

import numpy as np
import pytest
import torch

from mooncake_ray.errors import MasterUnavailableError, ObjectNotFoundError
from mooncake_ray.engines.engine import InferenceEngine
from mooncake_ray.engines.model import ByteTokenizer, ModelConfig
from mooncake_ray.kv import KVGeometry, page_hashes


class DictStore:
    """Stores real bytes; same batch calls as mooncake_ray.Client."""

    def __init__(self):
        self.data, self.fail = {}, False

    def _check(self):
        if self.fail:
            raise MasterUnavailableError("master is down (injected)")

    def register_buffer(self, buf):
        pass

    def batch_exists(self, keys):
        self._check()
        return [k in self.data for k in keys]

    def batch_put_from(self, keys, bufs, parents=None):
        self._check()
        for k, b, p in zip(keys, bufs, parents or [None] * len(keys)):
            assert p is None or p in self.data, f"{k} names a parent never stored: {p}"
            self.data[k] = b.contiguous().view(torch.uint8).numpy().tobytes()
        return [None] * len(keys)

    def batch_get_into(self, keys, bufs):
        self._check()
        out = []
        for k, b in zip(keys, bufs):
            if k not in self.data:
                out.append(ObjectNotFoundError(k))
                continue
            b.view(torch.uint8).numpy()[:] = np.frombuffer(self.data[k], np.uint8).reshape(b.view(torch.uint8).shape)
            out.append(len(self.data[k]))
        return out


CFG = ModelConfig(num_layers=3, num_kv_heads=2, head_dim=16, num_q_heads=4, hidden=64, ffn=128, page_size=8,
                  kv_dtype="bfloat16")
PROMPT = ByteTokenizer().encode("The quick brown fox jumps over the lazy dog; " * 3)  # 139 tokens


def run(engine, prompt=PROMPT, n=12):
    steps = list(engine.generate(prompt, n, stop_at_eos=False))
    return [s.token for s in steps], torch.stack([s.logits for s in steps]), steps[0]


def test_l1_reuse_is_bit_exact():
    e = InferenceEngine(CFG, pool_pages=128)
    toks, logits, first = run(e)
    assert first.cached_tokens == 0
    toks2, logits2, first2 = run(e)
    assert first2.cached_l1 == (len(PROMPT) - 1) // 8 * 8
    assert toks == toks2 and torch.equal(logits, logits2)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_l3_load_is_bit_exact_across_engines(layout):
    store = DictStore()
    a = InferenceEngine(CFG, pool_pages=128, store=store, layout=layout)
    toks, logits, _ = run(a)
    assert a.stats["l3_saved_pages"] >= len(PROMPT) // 8
    b = InferenceEngine(CFG, pool_pages=128, store=store, layout=layout)  # another engine: cold L1
    toks2, logits2, first = run(b)
    assert first.cached_l3 == (len(PROMPT) - 1) // 8 * 8 and first.cached_l1 == 0
    assert toks == toks2 and torch.equal(logits, logits2)
    plain = InferenceEngine(CFG, pool_pages=128, layout=layout)  # no cache at all
    toks3, logits3, _ = run(plain)
    assert torch.equal(logits, logits3)


def test_layouts_agree():
    _, l1, _ = run(InferenceEngine(CFG, pool_pages=64, layout="page_first"))
    _, l2, _ = run(InferenceEngine(CFG, pool_pages=64, layout="layer_first"))
    assert torch.equal(l1, l2)


def test_prefix_sharing_and_partial_hits():
    store = DictStore()
    a = InferenceEngine(CFG, pool_pages=128, store=store)
    run(a, PROMPT[:64])
    b = InferenceEngine(CFG, pool_pages=128, store=store)
    toks, logits, first = run(b, PROMPT)  # first 64 tokens' pages come from L3
    assert first.cached_l3 == 64
    _, ref, _ = run(InferenceEngine(CFG, pool_pages=128), PROMPT)
    assert torch.equal(logits, ref)


def test_store_failure_degrades_to_recompute():
    store = DictStore()
    a = InferenceEngine(CFG, pool_pages=128, store=store)
    toks, logits, _ = run(a)
    store.fail = True
    b = InferenceEngine(CFG, pool_pages=128, store=store, l3_backoff_s=60)
    toks2, logits2, first = run(b)
    assert first.cached_tokens == 0 and b.stats["l3_errors"] == 1
    assert toks == toks2 and torch.equal(logits, logits2)


def test_small_pool_evicts_unreferenced_l1_pages():
    e = InferenceEngine(CFG, pool_pages=24)
    run(e, PROMPT[:100])
    run(e, ByteTokenizer().encode("something else entirely, long enough to need pages " * 2))
    toks, logits, first = run(e, PROMPT[:100])
    _, ref, _ = run(InferenceEngine(CFG, pool_pages=64), PROMPT[:100])
    assert torch.equal(logits, ref)


def test_geometry_bytes_per_token():
    assert KVGeometry(36, 8, 128, "bfloat16").bytes_per_token == 144 * 1024
    assert len(page_hashes(list(range(20)), 8)) == 2
    # chained: a page's hash depends on every earlier token
    assert page_hashes([1] * 16, 8)[1] != page_hashes([2] * 8 + [1] * 8, 8)[1]


def test_direct_handoff_into_reserved_pages_is_bit_exact():
    a = InferenceEngine(CFG, pool_pages=128)
    seq_a, info_a = a.prefill(PROMPT)
    b = InferenceEngine(CFG, pool_pages=128)
    seq_b, first = b.reserve(PROMPT)
    n = len(seq_b.pages) - first
    assert first == 0 and n == (len(PROMPT) - 1) // 8
    for i in range(first, first + n):  # what the transport does: page bytes, prefill -> decode
        b.pool.tensor[seq_b.pages[i]].copy_(a.pool.tensor[seq_a.pages[i]])
    info_b = b.prefill_reserved(seq_b, n)
    assert info_b.token == info_a.token and torch.equal(info_b.logits, info_a.logits)
    assert info_b.cached_tokens == n * 8
    toks_a = [s.token for s in a.continue_(seq_a, info_a, 6, False)]
    toks_b = [s.token for s in b.continue_(seq_b, info_b, 6, False)]
    assert toks_a == toks_b


def test_pool_overflow_shortens_a_cached_prefix_from_its_end():
    """An overflowing pool evicts a finished conversation's deepest pages first: its next
    turn still finds the leading pages in L1 (evicting the first page would strand all
    the others, which are only found through it)."""
    tok = ByteTokenizer()
    a = tok.encode("conversation A " * 10)[:121]  # 15 full pages of 8
    b = tok.encode("another talk B " * 10)[:121]
    e = InferenceEngine(CFG, pool_pages=24)
    run(e, a, n=1)
    run(e, b, n=1)  # needs 16 pages: 8 more than are free, taken from A's cached pages
    assert e.stats["l1_evictions"] > 0
    first = run(e, a, n=1)[2]
    assert first.cached_l1 >= 5 * 8, first  # A's leading pages survived, not its trailing ones
    assert torch.equal(first.logits, run(InferenceEngine(CFG, pool_pages=64), a, n=1)[2].logits)


def test_engine_server_admits_requests_only_while_their_pages_fit():
    """Two requests that cannot both fit in the pool run one after the other instead of
    the second failing for want of pages; a request larger than the pool is refused with
    both sizes named."""
    import asyncio

    from mooncake_ray.serve.deployments import EngineServer

    model = {k: getattr(CFG, k) for k in ("num_layers", "num_kv_heads", "head_dim", "num_q_heads", "hidden", "ffn",
                                          "page_size", "kv_dtype")}
    srv = EngineServer("both", model, {"pool_pages": 24})
    tok = ByteTokenizer()

    async def one(text, max_tokens=4):
        req = {"tokens": tok.encode(text)[:120], "max_tokens": max_tokens, "ignore_eos": True}
        return [ev["token"] async for ev in srv.generate(req)]

    async def main():
        return await asyncio.gather(one("first request " * 10), one("second request " * 10))

    outs = asyncio.run(main())  # 16 pages each, 24 in the pool
    assert [len(o) for o in outs] == [4, 4]
    assert srv.admission_waits == 1 and srv._committed == 0
    with pytest.raises(ValueError, match=r"needs 26 pool pages; this engine's pool has 24"):
        asyncio.run(one("x" * 300, max_tokens=88))  # 120 + 88 tokens = 26 pages
    assert srv._committed == 0
