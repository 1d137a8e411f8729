"""The aggregated app's LLMServer sends a stream's first output as soon as the engine makes it,
the rest on Ray Serve LLM's batching clock (no Ray cluster here: the app's use of it is
checked by tests/vllm/test_serve_llm.py, its effect on TTFT by bench_kv_routing.py)."""

from __future__ import annotations

import asyncio

import pytest

from mooncake_ray.integrations import ray_serve_llm as rsl
from mooncake_ray.integrations._serve_server import FirstOutBatcher, LLMServer

HOUR_MS = 3600e3  # a clock that never ticks within a test


async def outputs(go: asyncio.Event, first=("a",), rest=("b", "c"), fail_at_start=False, closed=None):
    try:
        if fail_at_start:
            raise ValueError("engine failed")
        for x in first:
            yield x
        await go.wait()
        for x in rest:
            yield x
    finally:
        if closed is not None:
            closed.set()


def test_the_first_output_leaves_at_once_and_the_rest_with_the_streams_end():
    async def main():
        go = asyncio.Event()
        stream = FirstOutBatcher(outputs(go), HOUR_MS).stream()
        # Ray's Batcher would hold "a" for the hour
        first = await asyncio.wait_for(stream.__anext__(), 30)
        go.set()
        rest = [b async for b in stream]
        return first, rest

    first, rest = asyncio.run(main())
    assert first == ["a"]
    assert rest == [["b", "c"]]


def test_outputs_made_before_the_first_read_leave_together():
    async def main():
        go = asyncio.Event()
        go.set()
        b = FirstOutBatcher(outputs(go, first=("a", "b"), rest=()), HOUR_MS)
        await asyncio.sleep(0)  # the reading task takes both before the stream is read
        await asyncio.sleep(0)
        return [x async for x in b.stream()]

    assert asyncio.run(main()) == [["a", "b"]]


def test_an_error_before_any_output_reaches_the_reader():
    async def main():
        stream = FirstOutBatcher(outputs(asyncio.Event(), fail_at_start=True), HOUR_MS).stream()
        return [x async for x in stream]

    with pytest.raises(ValueError, match="engine failed"):
        asyncio.run(main())


def test_a_reader_that_stops_after_the_first_output_closes_the_engines_stream():
    async def main():
        closed = asyncio.Event()
        b = FirstOutBatcher(outputs(asyncio.Event(), closed=closed), HOUR_MS)
        stream = b.stream()
        assert await asyncio.wait_for(stream.__anext__(), 30) == ["a"]
        await stream.aclose()
        await asyncio.wait_for(closed.wait(), 30)  # the engine's generator was closed, not left waiting
        return b.read_task.done()

    assert asyncio.run(main())


@pytest.mark.parametrize("interval_ms, want", [(0, [["a"], ["b"], ["c"]]), (None, [["a", "b", "c"]])])
def test_no_clock_is_rays_behaviour(interval_ms, want):
    async def main():
        go = asyncio.Event()
        go.set()
        return [x async for x in FirstOutBatcher(outputs(go), interval_ms).stream()]

    assert asyncio.run(main()) == want


def test_the_server_keeps_rays_name_and_batches_with_the_first_out_batcher():
    from ray.serve.llm import LLMServer as RayLLMServer

    assert LLMServer.__name__ == "LLMServer" and issubclass(LLMServer, RayLLMServer)

    class Fake:
        _get_batch_interval_ms = staticmethod(lambda stream=True: HOUR_MS)

    async def main():
        go = asyncio.Event()
        stream = LLMServer._batch_output_stream(Fake(), outputs(go))
        first = await asyncio.wait_for(stream.__anext__(), 30)
        go.set()
        return first, [x async for x in stream]

    assert asyncio.run(main()) == (["a"], [["b", "c"]])


def llm(**extra) -> dict:
    return {"model_loading_config": {"model_id": "m", "model_source": "/models/m"},
            "accelerator_config": {"kind": "cpu"}, **extra}


def test_build_app_serves_each_config_with_ours_unless_it_names_a_server(monkeypatch):
    import ray.serve.llm
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig

    got = {}
    monkeypatch.setattr(rsl, "register", lambda: None)
    monkeypatch.setattr(ray.serve.llm, "build_openai_app", lambda args: got.setdefault("args", args))
    plain_obj = LLMConfig(**llm())
    rsl.build_app({"llm_configs": [llm(), llm(server_cls="ray.serve.llm:LLMServer"), plain_obj]})
    cfgs = got["args"]["llm_configs"]
    assert cfgs[0]["server_cls"] == rsl.FIRST_OUT_SERVER
    assert cfgs[1]["server_cls"] == "ray.serve.llm:LLMServer"
    assert cfgs[2].server_cls is LLMServer
    assert plain_obj.server_cls is None  # the caller's object is not changed
    assert LLMConfig(**cfgs[0]).server_cls is LLMServer  # the path loads


def test_build_app_leaves_rays_server_when_asked(monkeypatch):
    import ray.serve.llm

    got = {}
    monkeypatch.setattr(rsl, "register", lambda: None)
    monkeypatch.setattr(ray.serve.llm, "build_openai_app", lambda args: got.setdefault("args", args))
    rsl.build_app({"llm_configs": [llm()], "first_token_at_once": False})
    assert "server_cls" not in got["args"]["llm_configs"][0] and "first_token_at_once" not in got["args"]


@pytest.mark.parametrize("at_once", [True, False])
def test_build_pd_app_serves_decode_with_ours_and_puts_rays_class_back(monkeypatch, at_once):
    import ray.serve.llm
    from ray.llm._internal.serve.serving_patterns.prefill_decode import builder

    from mooncake_ray.integrations._serve_server import PDDecodeServer

    ray_cls = builder.PDDecodeServer
    seen = {}

    def build(args):
        seen["cls"] = builder.PDDecodeServer
        seen["args"] = args
        raise RuntimeError("built")  # the class goes back whatever the build does

    monkeypatch.setattr(rsl, "register", lambda: None)
    monkeypatch.setattr(ray.serve.llm, "build_pd_openai_app", build)
    with pytest.raises(RuntimeError, match="built"):
        rsl.build_pd_app({"prefill_config": llm(), "decode_config": llm(), "first_token_at_once": at_once})
    assert seen["cls"] is (PDDecodeServer if at_once else ray_cls)
    assert "first_token_at_once" not in seen["args"]
    assert builder.PDDecodeServer is ray_cls
    assert PDDecodeServer.__name__ == "PDDecodeServer" and issubclass(PDDecodeServer, ray_cls)
    assert PDDecodeServer._batch_output_stream is LLMServer._batch_output_stream


@pytest.mark.parametrize("at_once", [True, False])
def test_the_apps_ray_builds_bind_our_servers_under_rays_names(monkeypatch, at_once):
    """Ray's own builders, run (no cluster: the one call that would start Ray answers here):
    the aggregated app's LLM deployment and the P/D app's decode deployment are ours."""
    import types

    import ray
    from ray.llm._internal.serve.serving_patterns.prefill_decode.pd_server import PDPrefillServer
    from ray.runtime_env import RuntimeEnv

    from mooncake_ray.integrations._serve_server import PDDecodeServer

    monkeypatch.setattr(rsl, "register", lambda: None)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(runtime_env=RuntimeEnv()))
    extra = {"first_token_at_once": at_once}
    agg = rsl.build_app({"llm_configs": [llm()], **extra})._bound_deployment
    server = agg.init_kwargs["llm_deployments"]["m"]._bound_deployment
    assert server.name == "LLMServer:m"
    assert (server.func_or_class is LLMServer) == at_once
    kv = {"engine_kwargs": {"kv_transfer_config": {"kv_connector": "MooncakeRayConnector", "kv_role": "kv_both"}}}
    pd = rsl.build_pd_app({"prefill_config": llm(**kv), "decode_config": llm(**kv), **extra})._bound_deployment
    decode = pd.init_kwargs["llm_deployments"]["m"]._bound_deployment
    prefill = decode.init_kwargs["prefill_server"]._bound_deployment
    assert (decode.name, prefill.name) == ("Decode:m", "Prefill:m")
    assert (decode.func_or_class is PDDecodeServer) == at_once
    assert prefill.func_or_class is PDPrefillServer  # its one-token answer ends its stream at once
