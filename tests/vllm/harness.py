"""Real vLLM engines in processes of their own (``engine_proc.py``), for the tests."""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
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


class _Zygote:
    """``zygote.py``, started once per test process: engines are forked from it with vLLM
    already imported (each engine process would otherwise import it again: 13-15 s of CPU
    here, most of an engine's start)."""

    _lock = threading.Lock()
    _it: "_Zygote | None" = None

    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"mcr-zygote-{os.getpid()}.log")
        self._log = open(self.log_path, "w")
        env = {**os.environ, "PYTHONPATH": ROOT}
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "zygote.py"), str(theirs.fileno())],
                                     stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log, env=env, cwd=ROOT,
                                     pass_fds=[theirs.fileno()])
        theirs.close()
        self.sock = ours
        self.sock.settimeout(300)
        try:
            ready = self.sock.recv(1 << 16)
        except OSError:
            ready = b""
        if not ready:
            self.proc.kill()
            self._log.flush()
            with open(self.log_path) as f:
                raise AssertionError(f"the engine zygote did not start; log tail:\n{f.read()[-3000:]}")
        atexit.register(self.close)

    @classmethod
    def get(cls) -> "_Zygote":
        with cls._lock:
            if cls._it is None or cls._it.proc.poll() is not None:
                cls._it = cls()
            return cls._it

    def fork(self, spec: dict, env: dict, fds: list[int]) -> int:
        with self._lock:
            socket.send_fds(self.sock, [json.dumps({"spec": spec, "env": env, "cwd": ROOT}).encode()], fds)
            return json.loads(self.sock.recv(1 << 16))["pid"]

    def close(self) -> None:
        self.sock.close()  # the zygote exits at EOF
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


class _Forked:
    """The parts of ``subprocess.Popen`` the tests use, for an engine forked by the zygote
    (not this process's child: it is reaped there, so a gone pid means it exited)."""

    def __init__(self, spec: dict, env: dict, stderr):
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        try:
            self.pid = _Zygote.get().fork(spec, env, [in_r, out_w, stderr.fileno()])
        finally:
            os.close(in_r)
            os.close(out_w)
        self.stdin = os.fdopen(in_w, "w")
        self.stdout = os.fdopen(out_r, "r")
        self.returncode = None

    def poll(self):
        if self.returncode is None:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self.returncode = "exited"  # its status went to the zygote
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"engine {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode

    def kill(self):
        for kill in (os.killpg, os.kill):  # its group: any process it started too
            try:
                kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Engine:
    """One engine process. ``start`` returns at once; ``wait_ready`` waits for start-up
    (vLLM takes 10-70 s here), so several engines start side by side. The process is a
    fork of the zygote (vLLM imported once per test process)."""

    def __init__(self, name: str, kv_role: str | None, extra: dict | None = None, ray_address: str | None = None,
                 env: dict | None = None, model: str | None = None, llm: dict | None = None):
        self.name = name
        spec = {"model": model or tiny_model(), "kv_role": kv_role, "extra": extra or {}, "llm": llm or {}}
        penv = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
        if ray_address:
            penv["RAY_ADDRESS"] = ray_address
        self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"mcr-engine-{name}-{os.getpid()}.log")
        self._log = open(self.log_path, "w")
        self.proc = _Forked(spec, penv, self._log)
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
        self.proc.stdin.close()
        self.proc.stdout.close()
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
