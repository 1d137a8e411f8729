"""Helpers for tests that drive the shipped ``serve_configs/*.yaml`` the way a user does:
a Ray head started with ``ray start --head`` (here ``--block``, so the test owns one
process to stop), ``serve run <file>`` as a subprocess, HTTP requests, then SIGINT.

Only processes these helpers start are ever signalled, by pid or by the process group
of a session they created; never ``ray stop`` (it would stop every Ray on the machine).
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
CONFIGS = os.path.join(ROOT, "serve_configs")

# What a clean stop must not print (Ray's and ours).
ERROR_PATTERNS = re.compile(r"Traceback|\bERROR\b|\bError:|failed|killed by `?ray\.kill|SIGTERM received|"
                            r"SIGSEGV|core dumped|Exception", re.IGNORECASE)


def free_port() -> int:
    """A port free now for a process that binds it later (seconds for ``ray start``'s
    agents, a minute for a vLLM server): from outside the kernel's ephemeral range, where
    an outgoing connection could take it meanwhile (``kv_router.publisher_ports``)."""
    from mooncake_ray.integrations.kv_router import publisher_ports

    return publisher_ports("127.0.0.1", 1)[0]


# Ray 2.60's own line on every ``serve run`` Ctrl-C, whatever the app (a two-replica app of a
# dozen lines, none of ours, prints it each time): ``serve.shutdown`` waits on the controller's
# ``graceful_shutdown`` task, which by design returns only by the controller killing itself,
# and the raylet reports that infinitely retried task as failed: the controller "killed by
# `ray.kill`", or, when its socket closed before the raylet heard of the kill, "temporarily
# unavailable: ... Socket closed" (seen once in a full-suite run).
RAY_SERVE_SHUTDOWN_LINE = re.compile(r"\(raylet\).*Task ServeController\.graceful_shutdown failed\. There are "
                                     r"infinite retries remaining.*(killed by `ray\.kill`|The actor is temporarily "
                                     r"unavailable: RpcError: RPC error: Socket closed)")


# A Ray driver's warning in the tests' network namespace, which has no route off loopback
# (Ray asks the kernel for a route to a public address to pick its IP; nothing is sent).
NO_ROUTE_LINE = re.compile(r"network_util\.cc:\d+: Failed to determine local IP via external connectivity")


def errors_in(text: str, *, serve_run_stop: bool = False) -> list[str]:
    """Lines of ``text`` that report an error; ``serve_run_stop``: the output of stopping
    ``serve run``, where Ray's own shutdown line is not ours to remove."""
    return [line for line in text.splitlines() if ERROR_PATTERNS.search(line)
            and not NO_ROUTE_LINE.search(line)
            and not (serve_run_stop and RAY_SERVE_SHUTDOWN_LINE.search(line))]


class RayHead:
    """``ray start --head --block`` on free ports; ``env`` points the CLIs at it."""

    def __init__(self, tmp_dir: str, num_cpus: int = 4, resources: str | None = None):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = {**os.environ, "RAY_ADDRESS": self.address, "RAY_USAGE_STATS_ENABLED": "0",
                    "PYTHONPATH": ROOT, "RAY_AUTH_MODE": "token", "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}
        self.env.pop("RAY_DASHBOARD_ADDRESS", None)
        # A test's head goes when its test is done: no traffic to move elsewhere first, so
        # SIGTERM stops it at once (Ray otherwise drains the node for up to 30 s, and a
        # replica's engine processes still winding down take all of it)
        self.env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
        # this head's own token (Ray's token auth is on): the CLIs and drivers given
        # ``env`` find it; nothing depends on a ~/.ray/auth_token left by an earlier run
        token = os.path.join(tmp_dir, "ray-auth-token")
        if not os.path.exists(token):  # heads started from one directory share it
            with open(os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                f.write(secrets.token_hex(32))
        self.env["RAY_AUTH_TOKEN_PATH"] = token
        self.env.pop("RAY_AUTH_TOKEN", None)
        self.log_path = os.path.join(tmp_dir, "ray-head.log")
        self.metrics_port = free_port()  # Ray's metrics agent: Prometheus text at /metrics
        self._log = open(self.log_path, "w")
        cmd = [f"{BIN}/ray", "start", "--head", "--block", f"--port={self.port}", f"--num-cpus={num_cpus}",
               "--include-dashboard=false", "--disable-usage-stats", "--node-ip-address=127.0.0.1",
               f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
               f"--metrics-export-port={self.metrics_port}", f"--runtime-env-agent-port={free_port()}"]
        if resources:
            cmd.append(f"--resources={resources}")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT,
                                     start_new_session=True)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"ray start exited {self.proc.returncode}:\n{self.log()}")
            if "Ray runtime started" in self.log():
                return
            time.sleep(0.5)
        raise AssertionError(f"ray head did not come up:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()[-5000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # --block: ray start stops its processes
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        try:  # anything of this head's session that outlived it
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)
        self._log.close()

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """A CLI of the venv (``mooncake-ray``, ``serve``) against this head."""
        return subprocess.run([f"{BIN}/{args[0]}", *args[1:]], env=self.env, capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT)


def _terminal_signals() -> None:
    """In the child before exec: Ctrl-C as a terminal delivers it, whatever this test
    process's signal mask and SIGINT disposition are (a child inherits a blocked or ignored
    SIGINT, and Python then never raises KeyboardInterrupt). In two full-suite runs
    ``serve run`` slept on through the test's SIGINT, its main thread in its idle loop."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class ServeRun:
    """``serve run <config>`` in the background, as a user runs it."""

    def __init__(self, head: RayHead, config: str, tmp_dir: str, port: int = 8000):
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = os.path.join(tmp_dir, f"serve-run-{os.path.basename(config)}.log")
        self._log = open(self.log_path, "w")
        # Unbuffered, and with faulthandler on: if a stop hangs, ``interrupt`` has it print
        # every thread's stack before killing it, and nothing it printed is lost.
        env = {**head.env, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
        self.proc = subprocess.Popen([f"{BIN}/serve", "run", config], stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env, cwd=ROOT, start_new_session=True, preexec_fn=_terminal_signals)
        self.stopped_in = None

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()

    def wait_ready(self, path: str = "/v1/models", timeout_s: float = 180) -> dict:
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve run exited {self.proc.returncode}:\n{self.log()[-5000:]}")
            if "DEPLOY_FAILED" in self.log():  # serve run keeps running after a failed deploy
                raise AssertionError(f"the app's deploy failed:\n{self.log()[-5000:]}")
            try:
                # a request sent before the app runs waits in Serve's proxy: ask again every
                # 2 s rather than 5 (what an answer takes once it runs, here: under 0.1 s)
                r = httpx.get(self.url + path, timeout=2)
                if r.status_code == 200:
                    return r.json()
                last = f"{r.status_code} {r.text[:200]}"
            except httpx.HTTPError as e:
                last = repr(e)
            time.sleep(0.5)
        raise AssertionError(f"{self.url}{path} not ready in {timeout_s}s ({last}):\n{self.log()[-5000:]}")

    def wait_quiet(self, quiet_s: float = 1.0, timeout_s: float = 15.0) -> None:
        """Wait until the log has not grown for ``quiet_s`` (Ray delivers replicas' log lines
        to ``serve run`` late: what earlier requests logged must not count as the stop's)."""
        deadline = time.monotonic() + timeout_s
        size, since = len(self.log()), time.monotonic()
        while time.monotonic() < deadline and time.monotonic() - since < quiet_s:
            time.sleep(0.1)
            now = len(self.log())
            if now != size:
                size, since = now, time.monotonic()

    def interrupt(self, timeout_s: float = 60) -> float:
        """Ctrl-C: SIGINT to ``serve run``; the seconds it took to exit."""
        mark = len(self.log())
        t = time.monotonic()
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)  # faulthandler: every thread's stack to the log
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stopped_in = time.monotonic() - t
        self.stop_output = self.log()[mark:]
        self._log.close()
        return self.stopped_in

    def close(self) -> None:
        if self.proc.poll() is None:
            self.interrupt()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
