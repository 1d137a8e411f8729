"""The README's OpenAI-server command with the connector
(``python -m vllm.entrypoints.openai.api_server --kv-transfer-config '{...}'``) on a real Ray
cluster and store, beside a vLLM engine in another process (``harness.Engine``, the same
connector): the server answers a prompt it never saw from the KV the engine saved, with the
engine's tokens, and the engine answers the server's prompt from the KV the server saved."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import store_config, wait_for
from tests.vllm.harness import BLOCK, ROOT, Engine, tiny_model

# vLLM reserves a core when a connector is set; both sides compute with the same thread count
ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}

pytestmark = pytest.mark.timeout(600)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` with the connector, as the README runs it."""

    def __init__(self, name: str, model: str, ray_address: str, namespace: str, tmp_path):
        self.port = free_port()
        kv = {"kv_connector": "MooncakeRayConnector", "kv_connector_module_path": "mooncake_ray.integrations.vllm",
              "kv_role": "kv_both", "kv_connector_extra_config": {"namespace": namespace}}
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "bfloat16",
                "--block-size", str(BLOCK), "--max-model-len", "1024", "--enable-prompt-tokens-details",
                "--kv-transfer-config", json.dumps(kv)]
        env = {**os.environ, "RAY_ADDRESS": ray_address, "PYTHONPATH": ROOT, "VLLM_CPU_KVCACHE_SPACE": "1", **ENV}
        self.log = tmp_path / f"{name}.log"
        self._log = open(self.log, "w")
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        pytest.fail(f"server not ready in {timeout_s}s:\n{self.log.read_text()[-3000:]}")

    def complete(self, ids: list[int], max_tokens: int = 8) -> dict:
        r = httpx.post(f"http://127.0.0.1:{self.port}/v1/completions", timeout=120, json={
            "model": tiny_model(), "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 1,
            "return_tokens_as_token_ids": True})
        r.raise_for_status()
        body = r.json()
        choice = body["choices"][0]
        return {"tokens": [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]],
                "cached": (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def test_server_and_engine_load_each_others_kv(ray_cluster, tmp_path):
    import mooncake_ray
    from mooncake_ray._private import deploy

    cfg = store_config()
    client = mooncake_ray.start(cfg)
    model = tiny_model()
    # 300 tokens each (9 full blocks of 32), no block in common
    a = [7 + (i * 37) % 900 for i in range(300)]
    b = [11 + (i * 53) % 900 for i in range(300)]
    full = (300 - 1) // BLOCK * BLOCK  # every full block but the last token's
    server = engine = None
    try:
        server = Server("server", model, ray_cluster.address, cfg["namespace"], tmp_path)
        engine = Engine("engine", "kv_both", {"namespace": cfg["namespace"]}, ray_cluster.address, ENV)
        assert engine.wait_ready().get("ready")
        server.wait_ready()

        def saved(n0: int, what: str) -> int:
            wait_for(lambda: client.stats()["keys"] >= n0 + 300 // BLOCK, what=what)
            return client.stats()["keys"]

        keys = client.stats()["keys"]
        ea = engine.generate([{"prompt_token_ids": a}], max_tokens=8)[0]
        assert ea["cached"] == 0
        keys = saved(keys, "the engine's saves")
        sa = server.complete(a)
        assert sa["cached"] == full and sa["tokens"] == ea["tokens"]  # loaded from the store
        sb = server.complete(b)
        assert sb["cached"] == 0
        saved(keys, "the server's saves")
        eb = engine.generate([{"prompt_token_ids": b}], max_tokens=8)[0]
        assert eb["cached"] == full and eb["tokens"] == sb["tokens"]
    finally:
        if engine is not None:
            engine.close()
        if server is not None:
            server.stop()
        client.close()
        deploy.teardown(cfg["namespace"])
