"""A second process holding a transport engine, driven by JSON lines on stdin/stdout.

Started by tests (``PeerProcess`` in conftest.py) with the engine's keyword arguments as
argv[1] (JSON). It owns:
  - "arena": a UCX-allocated region, filled with seeded random bytes;
  - "user":  a registered bytearray (not UCX-allocated: never mapped by peers),
  - "scratch": a second UCX-allocated region that tests write into,
and serves RPC handlers:
  1 echo (Python)              2 raise ValueError
  3 sleep float(payload) s     4 reply int(payload) bytes of a pattern
  5 nested: call handler int(payload) back on the connected test engine
  6 count: counts its calls (op "count" reads the counter)
Replies are single lines prefixed with "@@" (UCX may log to stdout too).
  100 built-in C++ echo
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
import time

import types
from pathlib import Path

import numpy as np


def _import_engine():
    """Imports the transport without running mooncake_ray/__init__ (which imports Ray and
    costs ~2 s per peer process): the package is registered as a bare namespace first."""
    root = Path(__file__).resolve().parents[2] / "mooncake_ray"
    if "mooncake_ray" not in sys.modules:
        pkg = types.ModuleType("mooncake_ray")
        pkg.__path__ = [str(root)]
        sys.modules["mooncake_ray"] = pkg
    from mooncake_ray._private.transport import Engine

    return Engine


Engine = _import_engine()


def pattern(n: int) -> bytes:
    return (bytes(range(256)) * (n // 256 + 1))[:n]


def main() -> None:
    kwargs = json.loads(sys.argv[1])
    arena_bytes = kwargs.pop("arena_bytes", 80 << 20)
    user_bytes = kwargs.pop("user_bytes", 16 << 20)
    seed = kwargs.pop("seed", 1)
    kwargs_scratch = kwargs.pop("scratch_bytes", 65 << 20)
    secret = kwargs.pop("auth_secret", None)  # hex
    eng = Engine(**kwargs)
    if secret is not None:
        eng.set_auth_secret(bytes.fromhex(secret))
    arena = eng.alloc_arena(arena_bytes)
    rng = np.random.default_rng(seed)
    av = np.frombuffer(arena.view(), dtype=np.uint8)
    av[:] = rng.integers(0, 256, arena_bytes, dtype=np.uint8)
    user = bytearray(rng.integers(0, 256, user_bytes, dtype=np.uint8).tobytes())
    user_region = eng.register(user)
    scratch = eng.alloc_arena(kwargs_scratch)
    regions = {"arena": arena, "user": user_region, "scratch": scratch}
    back: dict = {}

    eng.serve(1, lambda b: b)

    def boom(b: bytes) -> bytes:
        raise ValueError("boom: " + b.decode())

    eng.serve(2, boom)

    def sleeper(b: bytes) -> bytes:
        time.sleep(float(b))
        return b"slept"

    eng.serve(3, sleeper)
    eng.serve(4, lambda b: pattern(int(b)))
    eng.serve(5, lambda b: eng.call(back["peer"], int(b), b"nested", timeout_s=10))
    eng.serve_echo(100)
    counted = [0]

    def count(b: bytes) -> bytes:
        counted[0] += 1
        return b"counted"

    eng.serve(6, count)

    def region_info(r):
        return {"rkey": base64.b64encode(r.rkey).decode(), "addr": r.addr, "length": r.length}

    out = sys.stdout
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        res: dict = {}
        if op == "info":
            res = {
                "address": base64.b64encode(eng.address).decode(),
                "regions": {k: region_info(v) for k, v in regions.items()},
            }
        elif op == "sha":
            mv = regions[cmd["region"]].view()
            res = {"sha": hashlib.sha256(mv[cmd["off"] : cmd["off"] + cmd["len"]]).hexdigest()}
        elif op == "get":
            mv = regions[cmd["region"]].view()
            res = {"data": base64.b64encode(bytes(mv[cmd["off"] : cmd["off"] + cmd["len"]])).decode()}
        elif op == "connect":
            back["peer"] = eng.connect(base64.b64decode(cmd["address"]))
        elif op == "die_mid_message":  # SIGKILLed by its own payload, inside the send
            eng._native._debug_die_mid_message(base64.b64decode(cmd["address"]))
        elif op == "close_region":
            regions[cmd["region"]].close()
        elif op == "stats":
            res = eng.stats()
        elif op == "count":
            res = {"count": counted[0]}
        elif op == "exit":
            eng.close()
            out.write("@@" + json.dumps({"ok": True}) + "\n")
            out.flush()
            return
        out.write("@@" + json.dumps({"ok": True, **res}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
