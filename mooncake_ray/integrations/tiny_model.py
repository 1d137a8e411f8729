"""A random-weight model and a tokenizer built locally, for tests, benchmarks and the
Serve configs: nothing is downloaded.

    python -m mooncake_ray.integrations.tiny_model /tmp/tiny-llama --layers 2 --hidden 256
    mooncake-ray make-model /tmp/tiny-llama            # the same, from the CLI
    mooncake-ray make-model /tmp/tiny-gemma2 --arch gemma2 --layers 4 --sliding-window 64

Architectures (``arch``): ``llama`` (full attention in every layer), ``gemma2`` and
``gemma3`` (sliding-window layers alternating with full-attention ones: every other layer,
or five of every six), ``qwen3_next`` (Gated DeltaNet linear-attention layers, whose
per-request recurrent state vLLM keeps as "mamba" state, with a full-attention layer every
fourth). The hybrid ones are what vLLM runs with several KV cache groups.

The weights are seeded, so two builds with the same geometry are the same model. The
tokenizer is a word-level vocabulary (``w0``, ``w1``, ... plus a few special tokens) padded
to the model's vocabulary size, with a chat template, so the model serves
``/v1/chat/completions``. Text made of ``w<i>`` words maps one word to one token: tests and
benchmarks build prompts of exact token counts with :func:`words`.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
from dataclasses import asdict, dataclass

SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Geometry of the model. KV bytes per token = 2 * layers * kv_heads * head_dim * 2 (bf16)."""

    layers: int = 2
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    vocab: int = 1024
    max_positions: int = 4096
    seed: int = 0
    arch: str = "llama"
    sliding_window: int = 64  # tokens seen by a sliding-window layer (gemma2 / gemma3)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


def words(ids, vocab: int = 1024) -> str:
    """Text that the tiny tokenizer maps to exactly these word ids (one token each)."""
    n = vocab - len(SPECIAL) - 3  # role words take three slots
    return " ".join(f"w{i % n}" for i in ids)


ARCHS = ("llama", "gemma2", "gemma3", "qwen3_next")


def _model(spec: TinyModelSpec):
    common = dict(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                  num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                  num_key_value_heads=spec.kv_heads, max_position_embeddings=spec.max_positions,
                  bos_token_id=1, eos_token_id=2, pad_token_id=3, torch_dtype="bfloat16")
    if spec.arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    if spec.arch in ("gemma2", "gemma3"):
        period = 2 if spec.arch == "gemma2" else 6
        types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(spec.layers)]
        if "full_attention" not in types:
            raise ValueError(f"{spec.arch} with {spec.layers} layers has no full-attention layer "
                             f"(one in every {period}); use at least {period} layers")
        if spec.arch == "gemma2":
            from transformers import Gemma2Config as Config, Gemma2ForCausalLM as Model
        else:
            from transformers import Gemma3ForCausalLM as Model, Gemma3TextConfig as Config
        cfg = Config(**common, head_dim=spec.head_dim, sliding_window=spec.sliding_window, layer_types=types)
        return Model(cfg)
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(spec.layers)]
    if "full_attention" not in types:
        raise ValueError(f"qwen3_next with {spec.layers} layers has no full-attention layer (one in every 4)")
    cfg = Qwen3NextConfig(**common, head_dim=spec.head_dim, layer_types=types, linear_num_key_heads=spec.kv_heads,
                          linear_num_value_heads=spec.heads, linear_key_head_dim=spec.head_dim,
                          linear_value_head_dim=spec.head_dim, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=spec.intermediate // 2,
                          shared_expert_intermediate_size=spec.intermediate // 2, tie_word_embeddings=False)
    return Qwen3NextForCausalLM(cfg)


def build(out_dir: str, spec: TinyModelSpec = TinyModelSpec()) -> str:
    """Write the model (safetensors, bf16) and the tokenizer into ``out_dir``; returns it.
    Skips the work when ``out_dir`` already holds a build of the same spec. Processes that
    build the same directory at once take turns (a lock file beside it): none reads a file
    another is still writing."""
    if spec.hidden % spec.heads or spec.heads % spec.kv_heads:
        raise ValueError(f"hidden {spec.hidden} must divide by heads {spec.heads}, and heads by "
                         f"kv_heads {spec.kv_heads}")
    if spec.arch not in ARCHS:
        raise ValueError(f"arch {spec.arch!r} not known; allowed: {', '.join(ARCHS)}")
    marker = os.path.join(out_dir, "mooncake_ray_tiny_model.json")
    if _built(marker, spec):
        return out_dir
    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    with open(os.path.abspath(out_dir).rstrip("/") + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _built(marker, spec):
            if os.path.exists(marker):
                os.remove(marker)  # another spec's build: not complete once a file is rewritten
            _write(out_dir, spec)
            with open(marker, "w") as f:
                json.dump(asdict(spec), f)
    return out_dir


def _built(marker: str, spec: TinyModelSpec) -> bool:
    try:
        with open(marker) as f:
            return json.load(f) == asdict(spec)
    except (OSError, ValueError):
        return False


def _write(out_dir: str, spec: TinyModelSpec) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(spec.seed)
    model = _model(spec).to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)

    vocab = {t: i for i, t in enumerate(SPECIAL)}
    for role in ("system", "user", "assistant"):
        vocab[f"{role}:"] = len(vocab)
    i = 0
    while len(vocab) < spec.vocab:
        vocab[f"w{i}"] = len(vocab)
        i += 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    d = TinyModelSpec()
    for field in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "max_positions", "seed",
                  "sliding_window"):
        p.add_argument(f"--{field.replace('_', '-')}", type=int, default=getattr(d, field))
    p.add_argument("--arch", choices=ARCHS, default=d.arch)
    a = p.parse_args(argv)
    spec = TinyModelSpec(**{k: getattr(a, k) for k in asdict(d)})
    print(build(a.out_dir, spec))


if __name__ == "__main__":
    main()
