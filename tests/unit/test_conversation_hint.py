"""Conversation hints: what a request may carry, checked where it arrives."""

import json

import pytest

from mooncake_ray.engines.model import ByteTokenizer
from mooncake_ray.errors import InvalidArgumentError
from mooncake_ray.kv import ConversationHint
from mooncake_ray.serve import openai


def parse(**extra):
    body = json.dumps({"model": "m", "prompt": "hello", **extra}).encode()
    return openai.parse(body, "completion", "m", 4096, ByteTokenizer())


def test_the_serve_app_reads_the_hint_from_the_request_body():
    assert parse().conversation is None
    assert parse(conversation_id="c1", priority=2).conversation == {"conversation_id": "c1", "priority": 2,
                                                                     "keep_s": 600.0}
    assert parse(conversation_id="c1", keep_s=30).conversation["keep_s"] == 30
    for bad, param in [({"conversation_id": 7}, "conversation_id"), ({"conversation_id": "c", "priority": "hi"},
                                                                      "priority"),
                       ({"conversation_id": "c", "keep_s": -1}, "keep_s")]:
        with pytest.raises(openai.OpenAIError) as e:
            parse(**bad)
        assert e.value.status == 400 and e.value.body()["error"]["param"] == param


def test_a_hint_names_its_bad_field():
    assert ConversationHint.from_request(None) is None
    assert ConversationHint.from_request({"priority": 1}) is None  # no conversation id: no hint
    with pytest.raises(InvalidArgumentError, match="conversation_id"):
        ConversationHint("")
    with pytest.raises(InvalidArgumentError, match="priority"):
        ConversationHint("c", priority=True)
    with pytest.raises(InvalidArgumentError, match="keep_s"):
        ConversationHint("c", keep_s=0)
