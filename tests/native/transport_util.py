"""Helpers and fixtures for the transport tests (imported by the test modules, not a
conftest, so the other suites in tests/native are unaffected): a second engine in another
process driven over stdin/stdout (peer_proc.py), and engines in this process closed after
each test.

These tests open sockets: run them inside a private network namespace, e.g.
    unshare --net sh -c 'ip link set lo up && exec .venv/bin/python -m pytest -q tests/native'
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mooncake_ray._private.transport import Engine

PEER_SCRIPT = Path(__file__).with_name("peer_proc.py")
ARENA_BYTES = 80 << 20
USER_BYTES = 16 << 20


def run_threads(fn, n: int, timeout_s: float = 60) -> list[BaseException]:
    """Runs ``fn(k)`` for k in range(n), each on a thread of its own; returns what they raised."""
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            fn(k)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return errors


def in_private_netns() -> bool:
    """Whether loopback is this process's only network interface."""
    return sorted(name for _, name in socket.if_nameindex()) == ["lo"]


def require_private_netns() -> None:
    """These tests open sockets: refuse to run outside a loopback-only namespace."""
    if not in_private_netns():
        ifaces = sorted(name for _, name in socket.if_nameindex())
        pytest.exit(f"run inside a private network namespace (found interfaces {ifaces})", 2)


def expected_data(seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The peer's initial arena and user-buffer contents."""
    rng = np.random.default_rng(seed)
    arena = rng.integers(0, 256, ARENA_BYTES, dtype=np.uint8)
    user = rng.integers(0, 256, USER_BYTES, dtype=np.uint8)
    return arena, user


class PeerProcess:
    def __init__(self, **engine_kwargs):
        require_private_netns()
        kw = {"arena_bytes": ARENA_BYTES, "user_bytes": USER_BYTES, **engine_kwargs}
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER_SCRIPT), json.dumps(kw)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        info = self.cmd("info")
        self.address = base64.b64decode(info["address"])
        self.regions = {
            k: (base64.b64decode(v["rkey"]), v["addr"], v["length"]) for k, v in info["regions"].items()
        }

    def cmd(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"peer process exited ({self.proc.poll()})")
            if line.startswith("@@"):  # anything else is a log line
                return json.loads(line[2:])

    def sha(self, region: str, off: int, length: int) -> str:
        return self.cmd("sha", region=region, off=off, len=length)["sha"]

    def remote(self, eng: Engine, region: str = "arena"):
        peer = eng.connect(self.address, timeout_s=10)
        rkey, addr, length = self.regions[region]
        return eng.import_remote(peer, rkey, addr, length)

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        """SIGSTOP, and wait until the process is actually stopped."""
        self.signal(signal.SIGSTOP)
        for _ in range(1000):
            with open(f"/proc/{self.proc.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    return
            time.sleep(0.001)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.cmd("exit")
            except (RuntimeError, BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def engines():
    """make(**kwargs) -> Engine; all closed at teardown."""
    made: list[Engine] = []

    def make(**kw) -> Engine:
        require_private_netns()
        kw.setdefault("devices", ["lo"])
        kw.setdefault("name", f"test{len(made)}")
        e = Engine(**kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


@pytest.fixture
def spawn_peer():
    """spawn(**engine_kwargs) -> PeerProcess; all stopped at teardown."""
    made: list[PeerProcess] = []

    def spawn(**kw) -> PeerProcess:
        kw.setdefault("devices", ["lo"])
        kw.setdefault("name", "peer")
        p = PeerProcess(**kw)
        made.append(p)
        return p

    yield spawn
    for p in made:
        try:
            p.signal(signal.SIGCONT)
        except ProcessLookupError:
            pass
        p.close()


def addr_of(a: np.ndarray) -> int:
    return a.ctypes.data
