"""The staged path's stager against a store made of a dict, with host memory standing in
for device memory (the copy thread in place of the CUDA stream): groups through the two
halves, values larger than a half, results per key, and a failure midway that leaves the
stager usable."""

import numpy as np
import pytest

from mooncake_ray.errors import MasterUnavailableError
from mooncake_ray._private.client.staged import DeviceIO, Staged
from mooncake_ray._private.transport import Engine

HALF = 4096


@pytest.fixture
def dio():
    eng = Engine(protocol="tcp", devices=["lo"], name="stager-test")
    d = DeviceIO(eng, "staged", 2 * HALF)
    yield d
    d.close()
    eng.close()


class DictStore:
    """put_fn / get_fn over a dict, recording which staging address each call used."""

    def __init__(self):
        self.values, self.calls = {}, []

    def put(self, keys, bufs):
        self.calls.append(("put", [b[0] if isinstance(b, tuple) else None for b in bufs]))
        out = []
        for k, b in zip(keys, bufs):
            mv = (np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * b[1]).from_address(b[0]))
                  if isinstance(b, tuple) else b)
            self.values[k] = bytes(mv)
            out.append(None)
        return out

    def get(self, keys, bufs):
        self.calls.append(("get", [b[0] if isinstance(b, tuple) else None for b in bufs]))
        out = []
        for k, b in zip(keys, bufs):
            v = self.values.get(k)
            if v is None:
                out.append(KeyError(k))
                continue
            dst = (np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * b[1]).from_address(b[0]))
                   if isinstance(b, tuple) else b)
            dst[:len(v)] = np.frombuffer(v, dtype=np.uint8)
            out.append(len(v))
        return out


def items_of(arr, sizes):
    out, at = [], 0
    for n in sizes:
        out.append(Staged(arr.ctypes.data + at, n, "host", -1, arr))
        at += n
    return out


def test_groups_alternate_halves_and_bytes_survive(dio):
    sizes = [1000, 3000, 500, 2000, 2500, 9000, 100]  # 9000 is larger than a half
    src = np.random.default_rng(0).integers(0, 256, sum(sizes), dtype=np.uint8)
    store = DictStore()
    keys = [f"k{i}" for i in range(len(sizes))]
    assert dio.put(keys, items_of(src, sizes), store.put) == [None] * len(sizes)
    at = 0
    for k, n in zip(keys, sizes):
        assert store.values[k] == src[at:at + n].tobytes()
        at += n
    stager = dio._stagers[0]
    bases = [stager.addr, stager.addr + stager.half]
    firsts = [addrs[0] for _, addrs in store.calls]
    # groups: [1000, 3000] [500, 2000] [2500] [9000 alone, own buffer] [100]
    assert firsts == [bases[0], bases[1], bases[0], None, bases[0]]
    dst = np.zeros_like(src)
    got = dio.get(keys + ["missing"], items_of(dst, sizes) + items_of(np.zeros(64, np.uint8), [64]), store.get)
    assert got[:-1] == sizes and isinstance(got[-1], KeyError)
    assert np.array_equal(dst, src)
    assert dio.stats["staged_bytes"] == 2 * sum(sizes)


def test_a_failure_midway_leaves_the_stager_usable(dio):
    src = np.random.default_rng(1).integers(0, 256, 4 * HALF, dtype=np.uint8)
    store = DictStore()
    keys = [f"f{i}" for i in range(8)]
    dio.put(keys, items_of(src, [HALF // 2] * 8), store.put)
    calls = {"n": 0}

    def flaky_get(ks, bs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise MasterUnavailableError("master shard 0 did not answer")
        return store.get(ks, bs)

    dst = np.zeros(4 * HALF, dtype=np.uint8)
    with pytest.raises(MasterUnavailableError):
        dio.get(keys, items_of(dst, [HALF // 2] * 8), flaky_get)
    assert len(dio._free) == 1  # given back
    assert dio.get(keys, items_of(dst, [HALF // 2] * 8), store.get) == [HALF // 2] * 8
    assert np.array_equal(dst, src)
    assert len(dio._stagers) == 1  # the same stager served both calls
