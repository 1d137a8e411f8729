"""The NVMe spill tier on a real cluster: DRAM pool overflow goes to disk and comes back."""

import numpy as np
import ray

from mooncake_ray._private.naming import MASTER_NAME
from tests.conftest import wait_for

MB = 1 << 20


def val(i, n=MB):
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)


def test_512_objects_into_256mib_dram_all_readable(make_store, tmp_path):
    # two store nodes x 128 MiB = 256 MiB of DRAM for 512 MiB of values
    s = make_store(segment_size_bytes="128mb",
                   spill={"enabled": True, "directory": str(tmp_path / "spill"), "capacity_bytes": "1gb"})
    n = 512
    for i in range(n):
        s.put(f"obj/{i}", val(i))
    buf = np.empty(MB, dtype=np.uint8)
    wrong, missing = [], []
    for i in range(n):
        try:
            assert s.get_into(f"obj/{i}", buf) == MB
        except KeyError:
            missing.append(i)
            continue
        if not np.array_equal(buf, val(i)):
            wrong.append(i)
    assert missing == [] and wrong == []
    st = s.stats()
    assert st["offloads"] >= n - 256 and st["promotions"] > 0
    assert st["keys"] == n
    # every node reports both tiers
    for node in st["nodes"].values():
        assert node["disk"]["capacity"] > 0 and node["disk"]["keys"] > 0


def test_batch_get_promotes_in_parallel_and_status_splits_tiers(make_store, tmp_path):
    s = make_store(segment_size_bytes="16mb",
                   spill={"enabled": True, "directory": str(tmp_path / "spill"), "capacity_bytes": "512mb"})
    keys = [f"b/{i}" for i in range(64)]
    for i, k in enumerate(keys):
        s.put(k, val(i, 512 * 1024))
    master = ray.get_actor(MASTER_NAME, namespace=s.config.namespace)
    wait_for(lambda: any(w and all(t == "disk" for _, t, _ in w) for w in ray.get(master.where.remote(keys[:8]))),
             what="old objects to be disk-only")
    got = s.batch_get(keys)
    assert all(g == val(i, 512 * 1024).tobytes() for i, g in enumerate(got))
    from mooncake_ray.cli import format_status

    text = format_status(s.stats())
    assert " disk " in text and " dram " in text
