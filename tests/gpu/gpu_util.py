"""Helpers of the GPU checks: the peer process (peer.py) and byte comparisons."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

PEER_SCRIPT = Path(__file__).with_name("peer.py")
MiB = 1 << 20


class Peer:
    """peer.py in a process of its own; ``cmd`` sends one command and waits for its answer."""

    def __init__(self, timeout_s: float = 60.0, **cfg):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if not env.get("MCR_GPU_PKG"):
            env["MCR_GPU_BARE_PACKAGE"] = "1"
        # Same interpreter and flags (-S, -I...) as this process.
        argv = [sys.executable, *subprocess._args_from_interpreter_flags(), str(PEER_SCRIPT), json.dumps(cfg)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        info = self.cmd("info", timeout_s=timeout_s)
        self.address = bytes.fromhex(info["address"])
        self.memory_types = info["memory_types"]
        self.cuda_error = info["cuda_error"]
        self.arena_file, self.arena_kind = info["arena_file"], info["arena_kind"]
        self.regions = {k: (bytes.fromhex(v["rkey"]), v["addr"], v["length"]) for k, v in info["regions"].items()}

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self._lines.put(line[2:])
            else:  # UCX's own log lines
                sys.stdout.write("[peer] " + line)
        self._lines.put(None)

    def cmd(self, op: str, timeout_s: float = 120.0, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"peer gave no answer to {op!r} within {timeout_s} s") from None
        if line is None:
            raise RuntimeError(f"peer process exited ({self.proc.poll()})")
        res = json.loads(line)
        if not res.pop("ok"):
            raise RuntimeError(f"peer failed {op!r}: {res['error']}\n{res.get('trace', '')}")
        return res

    def sha(self, region: str, ranges) -> str:
        return self.cmd("sha", region=region, ranges=[[int(o), int(n)] for o, n in ranges])["sha"]

    def stats(self) -> dict:
        return self.cmd("stats")["stats"]

    def import_into(self, eng, region: str = "arena"):
        """(peer handle, RemoteRegion) of one of the peer's regions, seen from ``eng``; a
        file arena is mapped from its file, as a client maps a store node's
        (``arena.local_mapping``), where ``eng`` may use shared memory."""
        conn = eng.connect(self.address, 10.0)
        rkey, addr, length = self.regions[region]
        path = self.arena_file if region == "arena" and eng.config.protocol in ("auto", "shm") else ""
        return conn, eng.import_remote(conn, rkey, addr, length, path, 0)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.cmd("exit", timeout_s=20)
            except (RuntimeError, TimeoutError, BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def sha_torch(t, ranges=None) -> str:
    """sha256 of a 1-D uint8 CUDA tensor's ranges (all of it by default), concatenated."""
    h = hashlib.sha256()
    for off, n in ranges if ranges is not None else [(0, t.numel())]:
        h.update(t[off:off + n].cpu().numpy())
    return h.hexdigest()


def sha_cupy(a, ranges=None) -> str:
    import cupy

    h = hashlib.sha256()
    for off, n in ranges if ranges is not None else [(0, a.size)]:
        h.update(cupy.asnumpy(a[off:off + n]))
    return h.hexdigest()


def delta(after: dict, before: dict, key: str) -> int:
    return int(after.get(key, 0)) - int(before.get(key, 0))


def timed(fn, sync, reps: int = 5) -> float:
    """Median seconds of ``reps`` runs of fn() + sync(), after one warm-up."""
    fn()
    sync()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def say(msg: str) -> None:
    print(f"[gpu] {msg}", flush=True)


# ---- MCR_GPU_FAKE=1: the checks' own logic on a machine without a GPU ------------------
# Host memory stands in for device memory: the real engine registers it as host memory, a
# HostCopyStream stands in for the CUDA stream, and the engine's memcpy counters stand in
# for its CUDA ones (the same code path on a GPU: a mapped remote arena). It tests the
# tests (peer protocol, ranges, hashes, the JSON), nothing of CUDA.

class _FakeStream:
    def __init__(self, real):
        self._s = real

    def wait_marker(self, marker) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self._s, name)


class FakeNative:
    def __init__(self, real):
        self._n = real

    def cuda_available(self) -> bool:
        return True

    def cuda_host_register(self, addr: int, n: int) -> bool:
        return True

    def cuda_host_unregister(self, addr: int) -> None:
        pass

    def CudaCopyStream(self, device: int):  # noqa: N802 - the native name
        return _FakeStream(self._n.HostCopyStream())

    def CudaMarker(self, device: int, stream: int):  # noqa: N802
        return None

    def __getattr__(self, name):
        return getattr(self._n, name)


class FakeEngine:
    def __init__(self, real):
        self._e = real

    @property
    def memory_types(self):
        return list(self._e.memory_types) + ["cuda"]

    def register_memory(self, addr: int, length: int, cuda: bool = False):
        return self._e.register_memory(addr, length, False)

    def stats(self) -> dict:
        s = dict(self._e.stats())
        s["read_cuda_bytes"], s["write_cuda_bytes"] = s["read_memcpy_bytes"], s["write_memcpy_bytes"]
        # device memory never takes the push path (the engine reads it with UCX gets)
        s["read_get_bytes"] = s["read_get_bytes"] + s["read_push_bytes"]
        return s

    def __getattr__(self, name):
        return getattr(self._e, name)
