"""``make demo``: start an embedded Ray, deploy the store, run a short workload, and say
what happened. Run inside a private network namespace (the Makefile does that)."""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np


def main() -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import mooncake_ray
    from mooncake_ray.cli import format_status

    spill_dir = tempfile.mkdtemp(prefix="mooncake-ray-demo-spill-", dir=os.environ.get("DEMO_SPILL_DIR"))
    t0 = time.perf_counter()
    store = mooncake_ray.start({
        "segment_size_bytes": "64mb",          # a small DRAM pool, so the demo fills it
        "spill": {"enabled": True, "directory": spill_dir, "capacity_bytes": "256mb"},
        "transport": {"devices": ["lo"]},
    })
    print(f"store deployed in {time.perf_counter() - t0:.1f}s")

    n, size = 160, 1 << 20  # 160 MiB of values into a 64 MiB pool: offload to disk
    rng = np.random.default_rng(0)
    values = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]
    t0 = time.perf_counter()
    for i, v in enumerate(values):
        store.put(f"demo/{i}", v)
    dt = time.perf_counter() - t0
    print(f"put {n} x 1 MiB in {dt:.2f}s ({n * size / dt / 1e9:.2f} GB/s)")

    buf = np.empty(size, dtype=np.uint8)
    t0, ok, missing = time.perf_counter(), 0, 0
    for i, v in enumerate(values):
        try:
            store.get_into(f"demo/{i}", buf)
            ok += bool(np.array_equal(buf, v))
        except mooncake_ray.ObjectNotFoundError:
            missing += 1
    dt = time.perf_counter() - t0
    print(f"got {ok}/{n} back byte-exact ({missing} missing) in {dt:.2f}s "
          f"({ok * size / dt / 1e9:.2f} GB/s; older values came back from disk)")

    small = [f"small/{i}" for i in range(1000)]
    store.batch_put(small, [b"x" * 4096] * len(small))
    t0 = time.perf_counter()
    got = store.batch_get(small)
    dt = time.perf_counter() - t0
    print(f"batch_get of 1000 x 4 KiB: {dt * 1e3:.1f} ms ({sum(g is not None for g in got)} hits)")
    try:
        store.get("never-stored")
    except mooncake_ray.ObjectNotFoundError as e:
        print(f"a miss raises ObjectNotFoundError: {e}")

    print()
    print(format_status(store.stats()))
    mooncake_ray.shutdown()


if __name__ == "__main__":
    main()
