"""A second process for the GPU checks: one native transport engine driven by JSON lines on
stdin, answering on stdout in lines prefixed "@@" (UCX may log to stdout too).

Started by the tests (``gpu_util.Peer``) with its settings as argv[1] (JSON):
  engine: name, protocol, devices, num_lanes, ucx_options, read_mode, write_mode;
  arena_bytes  a host arena filled with seeded random bytes (seed), made as a store node
               makes it (arena):
    arena "file"  (default; elastic.keep_arena) a file in /dev/shm mapped shared
                  (``ArenaFile``) and registered; peers on this host map the file itself
                  (its path is in "info": arena_file);
          "ucx"   (keep_arena false) ``alloc_arena``: UCX allocates it, and peers on this
                  host map it through UCX;
  cuda_bytes   if > 0, a torch CUDA tensor of that many bytes, random (cuda_seed), registered
               directly (``register_memory(ptr, n, cuda=True)``).
Commands (one JSON object a line):
  {"op": "info"}                          address (hex), memory types, regions (rkey hex,
                                          addr, length), arena_file ("" for "ucx"),
                                          cuda_error if registration failed
  {"op": "sha", "region": "arena"|"cuda", "ranges": [[off, len], ...]}
                                          sha256 of the ranges' bytes, concatenated
  {"op": "stats"}                         the engine's counters
  {"op": "exit"}
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import traceback

import numpy as np

import gpu_env  # this directory is sys.path[0]

CHUNK = 64 << 20


def main() -> None:
    cfg = json.loads(sys.argv[1])
    _native = gpu_env.load_native()
    arena_bytes = int(cfg.pop("arena_bytes", 64 << 20))
    seed = int(cfg.pop("seed", 1))
    cuda_bytes = int(cfg.pop("cuda_bytes", 0))
    cuda_seed = int(cfg.pop("cuda_seed", 2))
    kind = cfg.pop("arena", "file")
    eng = gpu_env.native_engine(_native, **cfg)

    arena_file = None
    if kind == "file":
        from mooncake_ray._private.store.arena import ArenaFile
        from mooncake_ray.errors import ConfigError

        try:
            arena_file = ArenaFile(os.environ.get("MCR_GPU_ARENA_DIR", "/dev/shm"), "gpu-check",
                                   f"{cfg.get('name', 'peer')}-{os.getpid()}", arena_bytes)
        except (OSError, ConfigError) as e:  # as a store node does: UCX's arena instead
            sys.stderr.write(f"[peer] no file arena ({e}): UCX allocates it\n")
            kind = "ucx"
    if arena_file is not None:
        arena = eng.register_memory(arena_file.addr, arena_bytes, False)
        av = np.frombuffer(arena_file._mm, dtype=np.uint8)
    elif kind == "ucx":
        arena = eng.alloc_arena(arena_bytes)
        av = np.frombuffer(arena.view(), dtype=np.uint8)
    else:
        raise ValueError(f"arena={kind!r}: 'file' or 'ucx'")
    rng = np.random.default_rng(seed)
    for off in range(0, arena_bytes, CHUNK):  # in chunks: bounded memory
        n = min(CHUNK, arena_bytes - off)
        av[off:off + n] = rng.integers(0, 256, n, dtype=np.uint8)
    regions = {"arena": arena}

    cuda_t, cuda_error = None, None
    if cuda_bytes:
        import torch

        fake = os.environ.get("MCR_GPU_FAKE") == "1" and not _native.cuda_available()  # host memory stands in
        device = "cpu" if fake else "cuda"
        g = torch.Generator(device=device)
        g.manual_seed(cuda_seed)
        cuda_t = torch.randint(0, 256, (cuda_bytes,), dtype=torch.uint8, device=device, generator=g)
        if not fake:
            torch.cuda.synchronize()
        try:
            regions["cuda"] = eng.register_memory(cuda_t.data_ptr(), cuda_bytes, not fake)
        except Exception as e:  # noqa: BLE001 - reported to the test
            cuda_error = f"{type(e).__name__}: {e}"

    def sha(region: str, ranges) -> str:
        h = hashlib.sha256()
        for off, n in ranges:
            if region == "arena":
                h.update(av[off:off + n])
            else:
                for o in range(off, off + n, CHUNK):
                    h.update(cuda_t[o:min(off + n, o + CHUNK)].cpu().numpy())
        return h.hexdigest()

    out = sys.stdout
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            if op == "info":
                res = {
                    "address": bytes(eng.address).hex(),
                    "memory_types": list(eng.memory_types),
                    "regions": {k: {"rkey": bytes(r.rkey).hex(), "addr": r.addr, "length": r.length}
                                for k, r in regions.items()},
                    "arena_file": arena_file.path if arena_file is not None else "",
                    "arena_kind": kind,
                    "cuda_error": cuda_error,
                }
            elif op == "sha":
                res = {"sha": sha(cmd["region"], cmd["ranges"])}
            elif op == "stats":
                res = {"stats": dict(eng.stats())}
            elif op == "exit":
                eng.close()
                if arena_file is not None:
                    arena_file.remove()
                out.write("@@" + json.dumps({"ok": True}) + "\n")
                out.flush()
                return
            else:
                raise ValueError(f"unknown op {op!r}")
            out.write("@@" + json.dumps({"ok": True, **res}) + "\n")
        except Exception as e:  # noqa: BLE001 - reported to the test
            out.write("@@" + json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}",
                                         "trace": traceback.format_exc()}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
