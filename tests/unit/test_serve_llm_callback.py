"""What the Ray Serve LLM builders add to each LLM config: a callback that skips Ray's
model-resolving task where it would only return the model's name (no Ray cluster here; the
task's skip on a real app is checked by tests/vllm/test_serve_llm.py)."""

from __future__ import annotations

import pytest

from mooncake_ray.integrations import ray_serve_llm as rsl


def llm(**extra) -> dict:
    return {"model_loading_config": {"model_id": "m", "model_source": "/models/m"},
            "accelerator_config": {"kind": "cpu"}, **extra}


def test_each_config_without_a_callback_gets_ours_and_a_users_own_is_kept(monkeypatch):
    monkeypatch.setattr(rsl, "register", lambda: None)
    mine = {"callback_class": "my.module:MyCallback"}
    args = rsl._prepare({"llm_configs": [llm(), llm(callback_config=mine), "/path/to/llm.yaml"]})
    assert args["llm_configs"][0]["callback_config"] == {"callback_class": rsl.CALLBACK_PATH}
    assert args["llm_configs"][1]["callback_config"] == mine
    assert args["llm_configs"][2] == "/path/to/llm.yaml"
    pd = rsl._prepare({"prefill_config": llm(), "decode_config": llm(callback_config=mine)})
    assert pd["prefill_config"]["callback_config"]["callback_class"] == rsl.CALLBACK_PATH
    assert pd["decode_config"]["callback_config"] == mine


def test_an_llm_config_object_gets_ours_unless_it_names_its_own(monkeypatch):
    from ray.llm._internal.common.callbacks.base import CallbackBase
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig

    monkeypatch.setattr(rsl, "register", lambda: None)
    plain, own = LLMConfig(**llm()), LLMConfig(**llm(callback_config={"callback_class": "my.module:C"}))
    args = rsl._prepare({"llm_configs": [plain, own]})
    assert args["llm_configs"][0].callback_config.callback_class == rsl.CALLBACK_PATH
    assert args["llm_configs"][1].callback_config.callback_class == "my.module:C"
    assert plain.callback_config.callback_class is CallbackBase  # the caller's object is not changed


@pytest.mark.parametrize("model, mirror, bundles, skip", [
    ("/models/m", None, {"n1"}, True),
    ("Qwen/Qwen3-8B", None, None, True),           # a hub id: the task returns it unchanged
    ("s3://bucket/m", None, {"n1"}, False),        # the task downloads
    ("gs://bucket/m", None, {"n1"}, False),
    ("/models/m", object(), {"n1"}, False),        # a cloud mirror: the task downloads
    ("/models/m", None, {"n1", "n2"}, False),      # bundles on other nodes: the task runs there
    ("/models/m", None, {"n2"}, False),
    (None, None, {"n1"}, False),
])
def test_the_task_is_skipped_only_where_it_would_return_the_name_on_this_node(model, mirror, bundles, skip):
    assert rsl.resolves_to_itself(model, mirror, bundles, "n1") is skip
