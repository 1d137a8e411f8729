"""OpenAI-compatible request parsing and response shapes (no Serve, no Ray).

Supported: ``/v1/completions`` (``prompt`` as a string or a list of token ids),
``/v1/chat/completions`` (``messages``), both streaming (server-sent events) or not, and
``/v1/models``. Sampling is greedy (the reference model is a test model): ``temperature``
is accepted and ignored. Extensions: ``ignore_eos`` (generate exactly ``max_tokens``, as
benchmarks do). ``usage.prompt_tokens_details.cached_tokens`` reports the prompt tokens
whose KV came from a cache (the engine's L1 or the store) instead of being computed.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from mooncake_ray.engines.model import ByteTokenizer
from mooncake_ray.errors import InvalidArgumentError
from mooncake_ray.kv import ConversationHint


class OpenAIError(Exception):
    """An error answered as ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class GenRequest:
    """What the engines need from an OpenAI request."""

    request_id: str
    kind: str  # "completion" | "chat"
    model: str
    tokens: list[int]
    max_tokens: int
    stream: bool
    ignore_eos: bool
    include_usage: bool
    conversation: dict | None = None  # {"conversation_id", "priority", "keep_s"} (kv.ConversationHint)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def parse(body: bytes, kind: str, model_id: str, max_context: int, tokenizer: ByteTokenizer) -> GenRequest:
    """Validate a request body; raises OpenAIError (4xx) naming what is wrong."""
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise OpenAIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(req, dict):
        raise OpenAIError(400, f"request body must be a JSON object, got {type(req).__name__}")
    model = req.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError(400, "'model' is required", param="model")
    if model != model_id:
        raise OpenAIError(404, f"The model '{model}' does not exist; available: '{model_id}'",
                          type_="invalid_request_error", param="model", code="model_not_found")
    if kind == "chat":
        msgs = req.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise OpenAIError(400, "'messages' must be a non-empty list", param="messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                    or not isinstance(m.get("content"), str):
                raise OpenAIError(400, f"messages[{i}] must be {{'role': system|user|assistant, 'content': str}}",
                                  param=f"messages[{i}]")
        tokens = tokenizer.chat(msgs)
    else:
        prompt = req.get("prompt")
        if isinstance(prompt, str) and prompt:
            tokens = tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and 0 <= t < 260 for t in prompt):
            tokens = list(prompt)
        else:
            raise OpenAIError(400, "'prompt' must be a non-empty string or a list of token ids in [0, 260)",
                              param="prompt")
    max_tokens = req.get("max_tokens", req.get("max_completion_tokens", 16))
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise OpenAIError(400, f"'max_tokens' must be a positive integer, got {max_tokens!r}", param="max_tokens")
    if len(tokens) + max_tokens > max_context:
        raise OpenAIError(400, f"This model's maximum context length is {max_context} tokens; the request has "
                          f"{len(tokens)} prompt tokens and max_tokens={max_tokens}",
                          param="messages" if kind == "chat" else "prompt", code="context_length_exceeded")
    stream = bool(req.get("stream", False))
    opts = req.get("stream_options") or {}
    return GenRequest(f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}", kind, model, tokens,
                      max_tokens, stream, bool(req.get("ignore_eos", False)),
                      bool(opts.get("include_usage", False)) if isinstance(opts, dict) else False,
                      _conversation(req))


def _conversation(req: dict) -> dict | None:
    """The request's conversation hint: ``conversation_id`` (str), ``priority`` (int, > 0
    keeps the conversation's KV in the store, soft-pinned) and ``keep_s`` (how long)."""
    fields = {k: req[k] for k in ("conversation_id", "priority", "keep_s") if k in req}
    try:
        hint = ConversationHint.from_request(fields)
    except InvalidArgumentError as e:
        param = next((k for k in fields if k in str(e)), "conversation_id")
        raise OpenAIError(400, str(e), param=param) from None
    return None if hint is None else {"conversation_id": hint.conversation_id, "priority": hint.priority,
                                      "keep_s": hint.keep_s}


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def full_response(r: GenRequest, text: str, finish: str, prompt: int, completion: int, cached: int) -> dict:
    base = {"id": r.request_id, "created": int(time.time()), "model": r.model,
            "usage": usage(prompt, completion, cached)}
    if r.kind == "chat":
        return {**base, "object": "chat.completion", "choices": [{
            "index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}]}
    return {**base, "object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def chunk(r: GenRequest, text: str, finish: str | None, first: bool = False) -> dict:
    base = {"id": r.request_id, "created": int(time.time()), "model": r.model}
    if r.kind == "chat":
        delta: dict[str, Any] = {"content": text}
        if first:
            delta["role"] = "assistant"
        return {**base, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return {**base, "object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def usage_chunk(r: GenRequest, prompt: int, completion: int, cached: int) -> dict:
    obj = "chat.completion.chunk" if r.kind == "chat" else "text_completion"
    return {"id": r.request_id, "created": int(time.time()), "model": r.model, "object": obj, "choices": [],
            "usage": usage(prompt, completion, cached)}


def sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
