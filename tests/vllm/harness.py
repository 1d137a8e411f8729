"""Real vLLM engines in processes of their own (``engine_proc.py``), for the tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MODEL_DIR = os.environ.get("MOONCAKE_RAY_TEST_MODEL", "/tmp/mooncake-ray-test/tiny-llama")
BLOCK = 32


def tiny_model() -> str:
    from mooncake_ray.integrations.tiny_model import build

    return build(MODEL_DIR)


class Engine:
    """One engine process. ``start`` returns at once; ``wait_ready`` waits for start-up
    (vLLM takes 10-70 s here), so several engines start side by side."""

    def __init__(self, name: str, kv_role: str | None, extra: dict | None = None, ray_address: str | None = None,
                 env: dict | None = None, model: str | None = None, llm: dict | None = None):
        self.name = name
        spec = {"model": model or tiny_model(), "kv_role": kv_role, "extra": extra or {}, "llm": llm or {}}
        penv = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
        if ray_address:
            penv["RAY_ADDRESS"] = ray_address
        self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"mcr-engine-{name}-{os.getpid()}.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "engine_proc.py"), json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env=penv, cwd=ROOT)
        self._lock = threading.Lock()

    def _read(self, timeout_s: float):
        out: list = []

        def reader():
            for line in self.proc.stdout:
                if line.startswith("MCR-RESULT "):
                    out.append(json.loads(line[len("MCR-RESULT "):]))
                    return

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        t.join(timeout_s)
        if not out:
            raise AssertionError(f"engine {self.name}: no answer within {timeout_s}s (exit code "
                                 f"{self.proc.poll()}); log tail:\n{self.log_tail()}")
        return out[0]

    def log_tail(self, n: int = 3000) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()[-n:]

    def wait_ready(self, timeout_s: float = 300.0) -> dict:
        return self._read(timeout_s)

    def call(self, timeout_s: float = 180.0, **cmd):
        with self._lock:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
            res = self._read(timeout_s)
        if isinstance(res, dict) and "error" in res:
            raise AssertionError(f"engine {self.name}: {res['error']}\n{res.get('trace', '')}")
        return res

    def generate(self, prompts, max_tokens: int = 16, params: list | None = None, timeout_s: float = 180.0,
                 logprobs: bool = False) -> list[dict]:
        """Greedy outputs: per prompt ``tokens``, ``cached`` (vLLM's num_cached_tokens),
        ``prompt_tokens``, ``params`` (the kv_transfer_params the engine returned) and with
        ``logprobs`` each generated token's log-probability. ``params``: kv_transfer_params
        to send with each prompt."""
        return self.call(op="generate", prompts=list(prompts), max_tokens=max_tokens, params=params,
                         timeout_s=timeout_s, logprobs=logprobs)

    def reset(self) -> None:
        self.call(op="reset")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def start_engines(specs: dict[str, tuple], timeout_s: float = 400.0) -> dict[str, Engine]:
    """Start engines side by side; ``specs``: name -> Engine args after the name."""
    engines = {name: Engine(name, *args) for name, args in specs.items()}
    deadline = time.monotonic() + timeout_s
    try:
        for e in engines.values():
            ready = e.wait_ready(max(1.0, deadline - time.monotonic()))
            assert ready.get("ready"), f"engine {e.name} failed to start: {ready}"
    except BaseException:
        for e in engines.values():
            e.close()
        raise
    return engines
