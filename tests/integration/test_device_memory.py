"""Device memory through the client on a real store, on a machine with no GPU: the staged
path forced (``client.device_path: staged``) with host memory standing in for device
memory runs end to end (pinned staging buffer in two halves, a copy thread in place of the
CUDA stream, groups overlapped with the transfers), and its bytes and keys are the plain
path's. What needs a GPU (CUDA copies, direct registration of device memory) is checked by
tests/gpu/run.sh on a machine that has one."""

import numpy as np
import pytest
import torch

import mooncake_ray
from mooncake_ray import ConfigError, InvalidArgumentError, ObjectNotFoundError

KB, MB = 1 << 10, 1 << 20
STAGING = 256 * KB  # two halves of 128 KiB: a batch of a few MiB cycles through both many times


def staged_store(make_store, **client):
    return make_store(client={"device_path": "staged", "local_buffer_size_bytes": STAGING, **client})


def rand(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_engine_reports_host_memory_only_here(make_store):
    s = make_store()
    assert s.memory_types == ["host"]  # no GPU driver: UCX's CUDA transports do not load
    st = s.stats()
    nodes = st["nodes"]
    assert len(nodes) == 2 and all(n["memory_types"] == ["host"] for n in nodes.values()), nodes
    from mooncake_ray.cli import format_status

    rows = [line for line in format_status(st).splitlines() if " dram " in line]
    assert len(rows) == 2 and all(" host " in r for r in rows), rows  # the `memory` column


def test_staged_roundtrip_of_blocks_at_random_ids(make_store):
    """A vLLM-like pool: blocks of one registered tensor put from and read back into
    random block ids, through raw (address, length) ranges, in one batch per direction."""
    s = staged_store(make_store)
    block, nblocks = 24 * KB, 160  # 3.75 MiB: about 30 groups through 128 KiB halves
    pool = torch.from_numpy(rand(block * nblocks, 1))
    reg = s.register_buffer(pool)
    assert reg.path == "staged" and reg.kind == "host" and reg.rkey is None
    ids = np.random.default_rng(2).permutation(nblocks)[:100]
    base = pool.data_ptr()
    keys = [f"blk/{i}" for i in range(len(ids))]
    assert s.batch_put_from(keys, [(base + int(b) * block, block) for b in ids]) == [None] * len(ids)

    out = torch.zeros(block * nblocks, dtype=torch.uint8)
    s.register_buffer(out)
    dst = np.random.default_rng(3).permutation(nblocks)[:100]
    got = s.batch_get_into(keys, [(out.data_ptr() + int(b) * block, block) for b in dst])
    assert got == [block] * len(ids)
    src, res = pool.numpy().reshape(nblocks, block), out.numpy().reshape(nblocks, block)
    for a, b in zip(ids, dst):
        assert np.array_equal(src[a], res[b])
    untouched = sorted(set(range(nblocks)) - set(int(b) for b in dst))
    assert not res[untouched].any()  # nothing written outside the blocks read
    ds = s.device_stats
    assert ds["staged_puts"] == ds["staged_gets"] == len(ids)
    assert ds["staged_bytes"] == 2 * len(ids) * block


def test_staged_values_of_several_ranges(make_store):
    """A vLLM block stored as one value of every layer's range: gathered from scattered
    ranges into the staging buffer, scattered back on the way in; the bytes are the plain
    path's, and a grouped read reports each group."""
    s = staged_store(make_store)
    layers, nblocks, part = 12, 24, 16 * KB  # 192 KiB a value: more than a half, through its own buffer
    src = torch.from_numpy(rand(layers * nblocks * part, 11))
    dst = torch.zeros(layers * nblocks * part, dtype=torch.uint8)
    for t in (src, dst):
        assert s.register_buffer(t).path == "staged"

    def block(t, b):
        return [(t.data_ptr() + (li * nblocks + b) * part, part) for li in range(layers)]

    keys = [f"blk/{b}" for b in range(nblocks)]
    small = [block(src, b)[:4] for b in range(nblocks)]  # 64 KiB values: several a half
    assert s.batch_put_from([k + "s" for k in keys], small) == [None] * nblocks
    assert s.batch_put_from(keys, [block(src, b) for b in range(nblocks)]) == [None] * nblocks
    perm = np.random.default_rng(12).permutation(nblocks).tolist()
    seen = []
    got = s.batch_get_into(keys, [block(dst, b) for b in perm], groups=layers, on_group=lambda g, f: seen.append(f))
    assert got == [layers * part] * nblocks and seen == [set()] * layers
    view = lambda t: t.numpy().reshape(layers, nblocks, part)  # noqa: E731
    assert np.array_equal(view(dst)[:, perm], view(src))
    assert s.get(keys[3]) == b"".join(view(src)[li, 3].tobytes() for li in range(layers))
    assert s.get(keys[5] + "s") == b"".join(view(src)[li, 5].tobytes() for li in range(4))
    mixed = [(src.data_ptr(), 100), np.zeros(100, np.uint8)]  # staged memory and plain host memory
    with pytest.raises(InvalidArgumentError, match="must take one path"):
        s.put_from("mixed", mixed)
    assert not s.exists("mixed")


def test_staged_bytes_and_keys_are_the_plain_paths(make_store):
    s = staged_store(make_store)
    cfg = s.config.model_copy(update={"client": s.config.client.model_copy(update={"device_path": "auto"})})
    plain = mooncake_ray.connect(config=cfg)  # same store, device_path auto: host memory takes the usual path
    try:
        a = rand(300 * KB, 4)  # larger than a half: moves through a buffer of its own
        s.register_buffer(a)
        s.put_from("big", a)
        assert plain.get("big") == a.tobytes()
        plain.put("small", rand(5000, 5).tobytes())
        b = np.zeros(8 * KB, dtype=np.uint8)
        s.register_buffer(b)
        assert s.get_into("small", b) == 5000
        assert b[:5000].tobytes() == rand(5000, 5).tobytes() and not b[5000:].any()
    finally:
        plain.close()


def test_staged_errors_per_key_and_nothing_lost(make_store):
    s = staged_store(make_store)
    buf = torch.from_numpy(rand(64 * KB, 6))
    s.register_buffer(buf)
    base = buf.data_ptr()
    s.put_from("kept", buf, 16 * KB)
    res = s.batch_put_from(["kept", "a", "b"], [(base, 4 * KB), (base, 8 * KB), (base, 8 * KB)],
                           sizes=[4 * KB, 70 * KB, 1000])
    assert type(res[0]).__name__ == "ObjectExistsError"
    assert isinstance(res[1], InvalidArgumentError) and "size 71680 is outside the buffer of 8192" in str(res[1])
    assert res[2] is None
    out = torch.zeros(32 * KB, dtype=torch.uint8)
    s.register_buffer(out)
    got = s.batch_get_into(["kept", "missing", "b"], [(out.data_ptr(), 16 * KB),
                                                      (out.data_ptr() + 16 * KB, 8 * KB),
                                                      (out.data_ptr() + 24 * KB, 8 * KB)])
    assert got[0] == 16 * KB and isinstance(got[1], ObjectNotFoundError) and got[2] == 1000
    assert bytes(out[:16 * KB].numpy()) == bytes(buf[:16 * KB].numpy())  # the first value survived
    assert not out[16 * KB:24 * KB].any()  # a miss writes nothing
    with pytest.raises(ObjectNotFoundError):
        s.get_into("missing", out)
    small = torch.zeros(100, dtype=torch.uint8)
    s.register_buffer(small)
    with pytest.raises(InvalidArgumentError, match="smaller than the value"):
        s.get_into("kept", small)


def test_direct_forced_without_cuda_names_the_problem(make_store):
    s = make_store(client={"device_path": "direct"})
    host = np.zeros(4096, dtype=np.uint8)
    assert not hasattr(s.register_buffer(host), "path")  # host memory is registered as always

    class FakeCudaArray:  # what cupy hands out; the pointer is never touched
        __cuda_array_interface__ = {"shape": (4096,), "typestr": "|u1", "data": (0x7f0000000000, False),
                                    "version": 3, "strides": None}
        device = type("D", (), {"id": 0})()

    with pytest.raises(ConfigError, match="device_path='direct'.*registers only \\['host'\\]"):
        s.register_buffer(FakeCudaArray())
