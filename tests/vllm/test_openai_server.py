"""The README's OpenAI-server command with the connector: two servers
(``python -m vllm.entrypoints.openai.api_server --kv-transfer-config '{...}'``), started side
by side on a real Ray cluster and store; the first answers a prompt and is stopped, then the
second, which never saw the prompt, loads the first's KV through the store and answers with
the same tokens."""

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
from tests.vllm.harness import BLOCK, ROOT, tiny_model

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
        env = {**os.environ, "RAY_ADDRESS": ray_address, "PYTHONPATH": ROOT, "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
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
            "model": tiny_model(), "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 1})
        r.raise_for_status()
        body = r.json()
        choice = body["choices"][0]
        return {"text": choice["text"], "tokens": choice["logprobs"]["tokens"],
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


def test_second_server_loads_the_first_servers_kv(ray_cluster, tmp_path):
    import mooncake_ray
    from mooncake_ray._private import deploy

    cfg = store_config()
    client = mooncake_ray.start(cfg)
    model = tiny_model()
    ids = [7 + (i * 37) % 900 for i in range(300)]  # 300 tokens: 9 full blocks of 32
    servers = []
    try:
        first = Server("first", model, ray_cluster.address, cfg["namespace"], tmp_path)
        servers.append(first)
        second = Server("second", model, ray_cluster.address, cfg["namespace"], tmp_path)
        servers.append(second)
        first.wait_ready()
        second.wait_ready()
        keys0 = client.stats()["keys"]
        a = first.complete(ids)
        assert a["cached"] == 0
        wait_for(lambda: client.stats()["keys"] >= keys0 + 300 // BLOCK,
                 what="the first server's saves")
        first.stop()
        b = second.complete(ids)
        assert b["cached"] == (300 - 1) // BLOCK * BLOCK  # every full block but the last token's, from the store
        assert b["tokens"] == a["tokens"]
    finally:
        for s in servers:
            s.stop()
        client.close()
        deploy.teardown(cfg["namespace"])
