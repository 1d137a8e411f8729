"""Values made of several buffers (a list of buffers is one value: stored as their
concatenation, read back into them in order) and grouped reads (slice by slice, one lookup
for every key), on a real two-node store."""

import ctypes
import time

import numpy as np
import pytest
import torch

from mooncake_ray import InvalidArgumentError, LeaseExpiredError, ObjectNotFoundError

KB = 1 << 10


def rand(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def pool(s, nbytes, seed):
    t = torch.from_numpy(rand(nbytes, seed))
    s.register_buffer(t)
    return t, t.data_ptr()


def test_ranges_in_registered_memory_roundtrip(make_store):
    s = make_store()
    src, base = pool(s, 64 * KB, 1)
    # A value of four ranges at scattered offsets, as a KV block of four layers would be.
    offs = [40 * KB, 0, 12 * KB, 60 * KB]
    ranges = [(base + o, 4 * KB) for o in offs]
    s.put_from("v", ranges)
    want = b"".join(src.numpy()[o:o + 4 * KB].tobytes() for o in offs)
    assert s.get("v") == want

    dst, dbase = pool(s, 64 * KB, 2)
    dst.zero_()
    back = [(dbase + o, 4 * KB) for o in (8 * KB, 24 * KB, 4 * KB, 48 * KB)]
    assert s.get_into("v", back) == 16 * KB
    assert b"".join(dst.numpy()[o:o + 4 * KB].tobytes() for o in (8 * KB, 24 * KB, 4 * KB, 48 * KB)) == want
    assert int(dst.numpy().astype(bool).sum()) <= 16 * KB  # nothing written outside the ranges


def test_batches_sizes_replicas_and_unregistered_lists(make_store):
    s = make_store()
    _, base = pool(s, 256 * KB, 3)
    keys = [f"b/{i}" for i in range(20)]
    vals = [[(base + (i * 9 + j) % 60 * 4 * KB, 3 * KB + j) for j in range(3)] for i in range(20)]
    assert s.batch_put_from(keys, vals) == [None] * 20
    got = s.batch_get(keys)
    for k, v, g in zip(keys, vals, got):
        assert g == b"".join(ctypes.string_at(a, n) for a, n in v), k
    # sizes: only the first bytes of the concatenation
    s.batch_put_from(["cut"], [vals[0]], sizes=[4 * KB])
    assert s.get("cut") == got[0][:4 * KB]
    # replicated values take the two-call path, one op per range and replica
    s.put_from("rep", vals[1], replicas=2)
    assert s.get("rep") == got[1]
    # a list of plain (unregistered) buffers: numpy arrays and a bytearray
    parts = [rand(1000, 7), bytearray(b"x" * 10), rand(70 * KB, 8)]
    s.put("plain", parts)
    assert s.get("plain") == b"".join(bytes(p) for p in parts)
    outs = [np.zeros(1000, np.uint8), np.zeros(10, np.uint8), np.zeros(70 * KB, np.uint8)]
    assert s.get_into("plain", outs) == 1010 + 70 * KB
    assert all(bytes(o) == bytes(p) for o, p in zip(outs, parts))


def test_bad_lists_are_named_errors_and_lose_nothing(make_store):
    s = make_store()
    _, base = pool(s, 16 * KB, 4)
    s.put("kept", b"abc")
    with pytest.raises(InvalidArgumentError, match="at least one buffer"):
        s.put_from("e", [])
    with pytest.raises(InvalidArgumentError, match="buffer 1 of a list of buffers is itself a list"):
        s.put_from("e", [(base, 10), [(base, 10)]])
    with pytest.raises(InvalidArgumentError, match=r"buffer 1 of the list: .*not inside a buffer registered"):
        s.put_from("e", [(base, 10), (base + 64 * KB, 10)])
    with pytest.raises(InvalidArgumentError, match="register each buffer"):
        s.register_buffer([np.zeros(10, np.uint8)])
    # a list too small for the value: nothing is read
    out = [np.zeros(1, np.uint8), np.zeros(1, np.uint8)]
    with pytest.raises(InvalidArgumentError, match="smaller than the value"):
        s.get_into("kept", out)
    assert not any(o.any() for o in out)
    r = s.batch_put_from(["e1", "e2"], [[], [(base, 100)]])
    assert isinstance(r[0], InvalidArgumentError) and r[1] is None
    assert s.get("kept") == b"abc" and not s.exists("e") and not s.exists("e1")


def test_grouped_reads_land_slice_by_slice(make_store):
    s = make_store()
    layers, nblocks, part = 6, 10, 2 * KB
    src, base = pool(s, layers * nblocks * part, 5)
    keys = [f"g/{b}" for b in range(nblocks)]

    def block(b0, b):  # block b: one range per layer, layer-major, in a per-layer-tensor layout
        return [(b0 + (li * nblocks + b) * part, part) for li in range(layers)]

    assert s.batch_put_from(keys, [block(base, b) for b in range(nblocks)]) == [None] * nblocks
    dst, dbase = pool(s, layers * nblocks * part, 6)
    dst.zero_()
    calls, seen = s.master_calls, []
    landed_per_layer = []

    def on_group(g, failed):
        seen.append((g, failed))
        d = dst.numpy().reshape(layers, nblocks, part)
        landed_per_layer.append([bool(d[li].any()) for li in range(layers)])

    ask = keys[:4] + ["g/missing"] + keys[4:]
    bufs = [block(dbase, b) for b in range(4)] + [block(dbase, 0)] + [block(dbase, b) for b in range(4, nblocks)]
    got = s.batch_get_into(ask, bufs, groups=layers, on_group=on_group)
    assert s.master_calls - calls == 1  # one lookup for every key and every slice
    assert isinstance(got[4], ObjectNotFoundError)
    assert [r for i, r in enumerate(got) if i != 4] == [layers * part] * nblocks
    assert [g for g, _ in seen] == list(range(layers)) and all(f == {4} for _, f in seen)
    for g, row in enumerate(landed_per_layer):  # slice g had landed when on_group(g) ran; later ones had not
        assert row == [li <= g for li in range(layers)], (g, row)
    assert np.array_equal(dst.numpy(), src.numpy())


def test_grouped_read_errors(make_store):
    s = make_store()
    _, base = pool(s, 64 * KB, 7)
    s.put_from("v", [(base, 4 * KB), (base + 8 * KB, 4 * KB)])
    with pytest.raises(InvalidArgumentError, match="groups must be a positive int"):
        s.batch_get_into(["v"], [[(base, 1)]], groups=0)
    failed = []
    got = s.batch_get_into(["v", "v", "v"], [
        [(base + 16 * KB, 4 * KB)] * 3,  # three buffers do not cut into two groups
        [(base + 16 * KB, 2 * KB), (base + 20 * KB, 2 * KB)],  # 4 KiB of buffers for an 8 KiB value
        [(base + 32 * KB, 4 * KB), (base + 40 * KB, 4 * KB)]], groups=2, on_group=lambda g, f: failed.append(f))
    assert isinstance(got[0], InvalidArgumentError) and "2 equal groups" in str(got[0])
    assert isinstance(got[1], InvalidArgumentError) and "its buffers hold 4096" in str(got[1])
    assert got[2] == 8 * KB and failed == [{0, 1}, {0, 1}]
    assert s.get("v") == s.get("v")  # still there


def test_grouped_read_that_outlives_its_lease_hands_out_nothing_late(make_store):
    """A reader slower than the lease (injected: the callback sleeps past it) gets the
    slices read in time and a LeaseExpiredError for the rest, never bytes read after."""
    s = make_store(master={"lease_ttl_s": 0.3})
    _, base = pool(s, 64 * KB, 8)
    s.batch_put_from(["a", "b"], [[(base, KB), (base + 4 * KB, KB)], [(base + 8 * KB, KB), (base + 12 * KB, KB)]])
    failed = []

    def slow(g, f):
        failed.append(f)
        if g == 0:
            time.sleep(0.5)

    got = s.batch_get_into(["a", "b"], [[(base + 32 * KB, KB), (base + 36 * KB, KB)],
                                        [(base + 40 * KB, KB), (base + 44 * KB, KB)]], groups=2, on_group=slow)
    assert failed == [set(), {0, 1}]
    assert all(isinstance(r, LeaseExpiredError) for r in got)
