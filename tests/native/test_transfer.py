"""Reads and writes between two processes on every path and protocol, with random
offsets and sizes from 1 byte to 64 MiB, registered and unregistered local memory."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from mooncake_ray.errors import InvalidArgumentError

from tests.native.transport_util import (  # noqa: F401 - fixtures
    PeerProcess,
    addr_of,
    engines,
    expected_data,
    run_threads,
    spawn_peer,
)

MIB = 1 << 20

# (peer/engine protocol, reader read_mode, path the arena read must take, user-buffer path)
CONFIGS = [
    ("shm", "auto", "memcpy", "get"),
    ("shm", "get", "get", "get"),
    ("shm", "push", "push", "push"),
    ("tcp", "auto", "push", "push"),
    ("tcp", "get", "get", "get"),
    ("auto", "auto", "memcpy", "get"),
]


@pytest.fixture(scope="module")
def peers():
    made: dict[str, PeerProcess] = {}

    def get(protocol: str) -> PeerProcess:
        if protocol not in made:
            made[protocol] = PeerProcess(protocol=protocol, devices=["lo"], name=f"peer-{protocol}")
        return made[protocol]

    yield get
    for p in made.values():
        p.close()


@pytest.fixture(scope="module")
def expected():
    return expected_data()


def sizes(rng: np.random.Generator, n: int, max_size: int) -> list[int]:
    out = [1, 4096, max_size]
    out += [int(v) for v in np.exp(rng.uniform(0, np.log(max_size), n))]
    return out


@pytest.mark.parametrize("protocol,mode,arena_path,user_path", CONFIGS)
def test_read_paths(peers, expected, engines, protocol, mode, arena_path, user_path):
    peer = peers(protocol)
    eng = engines(protocol=protocol, read_mode=mode)
    exp_arena, exp_user = expected
    rr_arena = peer.remote(eng, "arena")
    assert rr_arena.read_path == arena_path
    rrs = {"arena": (rr_arena, exp_arena)}
    if mode != "memcpy":
        rr_user = peer.remote(eng, "user")
        assert rr_user.read_path == user_path
        rrs["user"] = (rr_user, exp_user)
    rng = np.random.default_rng(hash((protocol, mode)) & 0xFFFF)
    dst = np.zeros(64 * MIB + 8192, dtype=np.uint8)
    reg = eng.register(dst)
    unreg = np.zeros(64 * MIB + 8192, dtype=np.uint8)  # bounced through staging
    before = eng.stats()
    moved = 0
    for name, (rr, exp) in rrs.items():
        for size in sizes(rng, 8, min(64 * MIB, rr.length)):
            off = int(rng.integers(0, rr.length - size + 1))
            loff = int(rng.integers(0, 4096))
            for buf in (dst, unreg):
                buf[loff : loff + size] = 0
                eng.read([(rr, off, addr_of(buf) + loff, size)], timeout_s=30)
                assert np.array_equal(buf[loff : loff + size], exp[off : off + size]), (name, size, off)
                moved += size
    after = eng.stats()
    delta = {k: after[k] - before[k] for k in after}
    got = delta["read_memcpy_bytes"] + delta["read_get_bytes"] + delta["read_push_bytes"]
    assert got == moved
    if arena_path == "memcpy":
        assert delta["read_memcpy_bytes"] > 0
    if "push" in (arena_path, user_path):
        assert delta["read_push_bytes"] > 0
    if "get" in (arena_path, user_path):
        assert delta["read_get_bytes"] > 0
    assert delta["staged_bytes"] > 0 or arena_path == "memcpy" and user_path == "memcpy"
    reg.close()


@pytest.mark.parametrize("protocol,write_mode", [("shm", "auto"), ("shm", "put"), ("tcp", "auto"), ("auto", "put")])
def test_write_paths(peers, engines, protocol, write_mode):
    peer = peers(protocol)
    eng = engines(protocol=protocol, write_mode=write_mode)
    rr = peer.remote(eng, "scratch")
    expect = "memcpy" if (protocol != "tcp" and write_mode == "auto") else "put"
    assert rr.write_path == expect
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, 64 * MIB + 4096, dtype=np.uint8)
    reg = eng.register(src)
    unreg = src.copy()
    for i, size in enumerate(sizes(rng, 8, 64 * MIB)):
        off = int(rng.integers(0, rr.length - size + 1))
        loff = int(rng.integers(0, 4096))
        buf = src if i % 2 == 0 else unreg
        eng.write([(rr, off, addr_of(buf) + loff, size)], timeout_s=30)
        want = hashlib.sha256(buf[loff : loff + size]).hexdigest()
        assert peer.sha("scratch", off, size) == want, (size, off)
    stats = eng.stats()
    key = "write_memcpy_bytes" if expect == "memcpy" else "write_put_bytes"
    assert stats[key] > 0
    reg.close()


@pytest.mark.parametrize("protocol,mode", [("shm", "auto"), ("tcp", "auto"), ("shm", "get")])
def test_many_outstanding(peers, expected, engines, protocol, mode):
    peer = peers(protocol)
    eng = engines(protocol=protocol, read_mode=mode)
    exp_arena, exp_user = expected
    rr = peer.remote(eng, "user")
    n, size = 512, 4096
    dst = np.zeros(n * size, dtype=np.uint8)
    reg = eng.register(dst)
    rng = np.random.default_rng(3)
    offs = rng.integers(0, rr.length - size, n)
    handles = [eng.read_async([(rr, int(o), addr_of(dst) + i * size, size)]) for i, o in enumerate(offs)]
    for h in handles:
        h.wait(30)
    for i, o in enumerate(offs):
        assert np.array_equal(dst[i * size : (i + 1) * size], exp_user[o : o + size])
    # one batch of many ops
    dst[:] = 0
    eng.read([(rr, int(o), addr_of(dst) + i * size, size) for i, o in enumerate(offs)], timeout_s=30)
    for i, o in enumerate(offs):
        assert np.array_equal(dst[i * size : (i + 1) * size], exp_user[o : o + size])
    reg.close()


@pytest.mark.parametrize("protocol", ["shm", "tcp"])
def test_threads(peers, expected, engines, protocol):
    peer = peers(protocol)
    eng = engines(protocol=protocol, num_lanes=2)
    exp_arena, exp_user = expected
    rrs = [peer.remote(eng, "arena"), peer.remote(eng, "user")]
    exps = [exp_arena, exp_user]

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        buf = np.zeros(4 * MIB, dtype=np.uint8)
        reg = eng.register(buf) if seed % 2 else None
        for _ in range(40):
            k = int(rng.integers(0, 2))
            size = int(rng.integers(1, 4 * MIB))
            off = int(rng.integers(0, rrs[k].length - size))
            eng.read([(rrs[k], off, addr_of(buf), size)], timeout_s=30)
            assert np.array_equal(buf[:size], exps[k][off : off + size])
        if reg:
            reg.close()

    failures = run_threads(worker, 4)
    assert not failures, failures


def test_small_tcp_reads_use_get(peers, expected, engines):
    """Measured: below ~32 KiB a get (one round trip) beats a push (two) over tcp."""
    peer = peers("tcp")
    eng = engines(protocol="tcp")
    exp_arena, _ = expected
    rr = peer.remote(eng, "arena")
    assert rr.read_path == "push"
    dst = np.zeros(1 << 20, dtype=np.uint8)
    reg = eng.register(dst)
    eng.read([(rr, 100, addr_of(dst), 4096)])
    eng.read([(rr, 200, addr_of(dst) + 8192, 1 << 19)])
    s = eng.stats()
    assert s["read_get_bytes"] == 4096 and s["read_push_bytes"] == 1 << 19
    assert np.array_equal(dst[:4096], exp_arena[100:4196])
    assert np.array_equal(dst[8192 : 8192 + (1 << 19)], exp_arena[200 : 200 + (1 << 19)])
    reg.close()


def test_batches_of_small_tcp_reads_are_pushed(peers, expected, engines):
    """One push carries many extents: a batch of small reads from one owner whose sum is
    past push_min_bytes is pushed, not read by one emulated get each."""
    peer = peers("tcp")
    eng = engines(protocol="tcp")
    exp_arena, _ = expected
    rr = peer.remote(eng, "arena")
    dst = np.zeros(1 << 20, dtype=np.uint8)
    reg = eng.register(dst)
    offs = [int(o) for o in np.random.default_rng(3).integers(0, rr.length - 4096, 64)]
    eng.read([(rr, o, addr_of(dst) + i * 4096, 4096) for i, o in enumerate(offs)])
    s = eng.stats()
    assert s["read_push_bytes"] == 64 * 4096 and s["read_get_bytes"] == 0
    for i, o in enumerate(offs):
        assert np.array_equal(dst[i * 4096 : (i + 1) * 4096], exp_arena[o : o + 4096]), i
    reg.close()


def test_staged_reads_are_striped_over_lanes(peers, expected, engines):
    """Unregistered memory bounces through staging in pieces cut like registered memory:
    a 4 MiB read over tcp with two lanes is two pushes of 2 MiB (it was one of 4 MiB, whose
    copy out of staging waited for all of it); below stripe_min_bytes it stays one piece."""
    peer = peers("tcp")
    eng = engines(protocol="tcp", num_lanes=2)
    exp_arena, _ = expected
    rr = peer.remote(eng, "arena")
    unreg = np.zeros(4 * MIB, dtype=np.uint8)
    for size, pushes in ((4 * MIB, 2), (512 << 10, 1)):
        before = eng.stats()
        eng.read([(rr, 12288, addr_of(unreg), size)], timeout_s=30)
        after = eng.stats()
        assert after["staged_bytes"] - before["staged_bytes"] == size
        assert after["pushes_sent"] - before["pushes_sent"] == pushes, size
        assert np.array_equal(unreg[:size], exp_arena[12288 : 12288 + size]), size


def test_pushed_reads_of_consecutive_ranges_are_joined(peers, expected, engines):
    """Small reads that continue each other on both sides (values carved from one slab,
    read into consecutive rows) are pushed as one extent; a gap on either side starts a
    new one, and every byte lands where it belongs."""
    peer = peers("tcp")
    eng = engines(protocol="tcp")
    exp_arena, _ = expected
    rr = peer.remote(eng, "arena")
    dst = np.zeros(2 * MIB, dtype=np.uint8)
    reg = eng.register(dst)
    ops, want, roff, loff = [], [], 8192, 0
    for i in range(128):
        if i == 50:
            roff += 4096  # a gap in the remote ranges
        if i == 90:
            loff += 4096  # a gap in the local rows
        ops.append((rr, roff, addr_of(dst) + loff, 4096))
        want.append((roff, loff))
        roff += 4096
        loff += 4096
    before = eng.stats()
    eng.read(ops, timeout_s=30)
    after = eng.stats()
    assert after["read_push_bytes"] - before["read_push_bytes"] == 128 * 4096
    # three runs (0-49, 50-89, 90-127): all but each run's first read are joined
    assert after["read_push_joined_bytes"] - before["read_push_joined_bytes"] == (128 - 3) * 4096
    for roff, loff in want:
        assert np.array_equal(dst[loff : loff + 4096], exp_arena[roff : roff + 4096]), (roff, loff)
    reg.close()


@pytest.mark.parametrize("registered", [True, False])
def test_small_writes_into_consecutive_ranges_are_gathered(peers, engines, registered):
    """A batch of small writes into consecutive remote ranges (values carved from one put
    slab) goes as one put from staging; runs break at gaps, at another region, and at
    large writes, and every byte lands where it was sent."""
    peer = peers("tcp")
    eng = engines(protocol="tcp")
    rr = peer.remote(eng, "scratch")
    rng = np.random.default_rng(11)
    src = rng.integers(0, 256, 8 * MIB, dtype=np.uint8)
    reg = eng.register(src) if registered else None
    lens = [int(n) for n in rng.integers(1, 64 << 10, 120)] + [2 * MIB, 4096, 4096]
    ops, want, roff, loff = [], [], 4096, 0
    for i, n in enumerate(lens):
        if i % 37 == 36:
            roff += 8192  # a gap: a new run starts
        ops.append((rr, roff, addr_of(src) + loff, n))
        want.append((roff, hashlib.sha256(src[loff : loff + n]).hexdigest(), n))
        roff += n
        loff = (loff + n + 13) % (4 * MIB)  # sources are anywhere, not consecutive
    before = eng.stats()
    eng.write(ops, timeout_s=30)
    after = eng.stats()
    assert after["write_put_bytes"] - before["write_put_bytes"] == sum(lens)
    # every run has 2 or more values: all is gathered but the 2 MiB write
    assert after["write_gathered_bytes"] - before["write_gathered_bytes"] == sum(lens) - 2 * MIB
    for off, digest, n in want:
        assert peer.sha("scratch", off, n) == digest, (off, n)
    if reg is not None:
        reg.close()


def test_lanes_stripe(peers, expected, engines):
    peer = peers("tcp")
    eng = engines(protocol="tcp", num_lanes=3, chunk_bytes=1 * MIB)
    exp_arena, _ = expected
    rr = peer.remote(eng, "arena")
    wr = peer.remote(eng, "scratch")
    dst = np.zeros(40 * MIB, dtype=np.uint8)
    reg = eng.register(dst)
    eng.read([(rr, 12345, addr_of(dst), 40 * MIB - 7)], timeout_s=30)
    assert np.array_equal(dst[: 40 * MIB - 7], exp_arena[12345 : 12345 + 40 * MIB - 7])
    src = np.random.default_rng(5).integers(0, 256, 40 * MIB, dtype=np.uint8)
    eng.write([(wr, 999, addr_of(src), 40 * MIB)], timeout_s=30)
    assert peer.sha("scratch", 999, 40 * MIB) == hashlib.sha256(src).hexdigest()
    reg.close()


def test_op_lists_of_every_shape_are_read_alike(peers, expected, engines):
    """Ops come as a list or tuple of 4-tuples (read directly, one cast per run of one
    region), or as anything iterable and sequence-like (read through nanobind's casts):
    the same bytes land either way, and a malformed op is refused before anything moves."""
    peer = peers("tcp")
    eng = engines(protocol="tcp")
    exp_arena, _ = expected
    rr, wr = peer.remote(eng, "arena"), peer.remote(eng, "scratch")
    dst = np.zeros(1 * MIB, dtype=np.uint8)
    reg = eng.register(dst)
    base = addr_of(dst)
    # regions alternate (run breaks), ints of numpy types and lists take the slow reading
    ops = [(rr if i % 3 else rr, 1000 * i, base + 4096 * i, 100 + i) for i in range(40)]
    ops[5] = [rr, 5000, base + 4096 * 5, 105]                           # a list, not a tuple
    ops[6] = (rr, np.uint64(6000), np.int64(base + 4096 * 6), 106)      # numpy ints
    for shape in (list, tuple, iter):
        dst[:] = 0
        eng.read(shape(ops), timeout_s=30)
        for i in range(40):
            assert np.array_equal(dst[4096 * i:4096 * i + 100 + i], exp_arena[1000 * i:1000 * i + 100 + i]), (shape, i)
    # multi-range values: ((address, length), ...) on the local side, contiguous remotely,
    # cut at the op's length, as the client's values made of several buffers are
    dst[:] = 0
    ranges = tuple((base + 8192 * j + 3 * j, 1000 + j) for j in range(20))
    eng.read([(rr, 777, ranges, 15000), (rr, 50000, [[base + 500000, 64]], 64)], timeout_s=30)
    at = 0
    for addr, m in ranges:
        m = min(m, 15000 - at)
        if m <= 0:
            assert not dst[addr - base:addr - base + 1000].any()  # past the length: untouched
            continue
        assert np.array_equal(dst[addr - base:addr - base + m], exp_arena[777 + at:777 + at + m]), addr
        at += m
    assert at == 15000
    assert np.array_equal(dst[500000:500064], exp_arena[50000:50064])
    # two regions interleaved in one call
    src = np.random.default_rng(3).integers(0, 256, 8192, dtype=np.uint8)
    reg2 = eng.register(src)
    eng.write([(wr, 0, addr_of(src), 4096), (rr, 0, addr_of(src), 0), (wr, 4096, addr_of(src) + 4096, 4096)],
              timeout_s=30)
    assert peer.sha("scratch", 0, 8192) == hashlib.sha256(src).hexdigest()
    for bad, what in [([(rr, 0, base)], "op 0 is"), ([(rr, 0, base, 10), (rr, -1, base, 10)], "op 1 is"),
                      ([(rr, 0, base, 10), ("rr", 0, base, 10)], "op 1 is \\('rr', 0"),
                      ([(rr, 0, base, 10), 7], "op 1 is 7:"),
                      ([(rr, 0, ((base, 10), (base + 20, -1)), 20)], "op 0 is .*ranges are not"),
                      ((rr, 0, base, 10), "op 0 is <RemoteRegion"),
                      ([(rr, 0, base, 10), (None, 0, base, 10)], "remote region is None")]:
        dst[:] = 0
        with pytest.raises(InvalidArgumentError, match=what):
            eng.read(bad, timeout_s=30)
        assert not dst.any(), bad  # nothing moved
    reg.close()
    reg2.close()



@pytest.mark.parametrize("protocol", ["auto", "tcp"])
def test_ops_given_as_arrays_move_the_same_bytes_as_op_lists(peers, expected, engines, protocol):
    """An op whose remote offsets, local addresses and lengths are 1-D arrays of 64-bit
    ints (an int column repeats) stands for one op per row: rows in any order, in several
    array ops of one call and beside ordinary ops, read and written alike (a mapped arena
    and tcp). A malformed array op is refused before anything moves, its fault named."""
    peer = peers(protocol)
    eng = engines(protocol=protocol)
    exp_arena, _ = expected
    rr, wr = peer.remote(eng, "arena"), peer.remote(eng, "scratch")
    rng = np.random.default_rng(11)
    dst = np.zeros(2 * MIB, dtype=np.uint8)
    reg = eng.register(dst)
    base = addr_of(dst)
    rows = rng.permutation(256)                                      # 256 rows of 4 KiB, shuffled
    offs = (rows * 8192 + 5).astype(np.uint64)                       # odd remote offsets
    addrs = (base + np.arange(256) * 4096).astype(np.int64)          # int64 addresses
    lens = np.full(256, 4096, dtype=np.uint64)
    eng.read([(rr, offs[:100], addrs[:100], 4096),                   # an int length for every row
              (rr, 3, base + 256 * 4096 + 1, 999),                   # an ordinary op between them
              (rr, offs[100:], addrs[100:], lens[100:])], timeout_s=30)
    for k in range(256):
        o = int(offs[k])
        assert np.array_equal(dst[4096 * k:4096 * (k + 1)], exp_arena[o:o + 4096]), k
    assert np.array_equal(dst[256 * 4096 + 1:256 * 4096 + 1000], exp_arena[3:1002])
    dst[:] = 0
    eng.read([(rr, 777, addrs[:3] + 100, 50)], timeout_s=30)  # only the addresses an array: one range, 3 copies
    for k in range(3):
        assert np.array_equal(dst[4096 * k + 100:4096 * k + 150], exp_arena[777:827]), k
    assert int(dst.astype(np.int64).sum()) == 3 * int(exp_arena[777:827].astype(np.int64).sum())
    # writes: rows of several lengths (0 among them) into the scratch region, then read back
    src = rng.integers(0, 256, 1 * MIB, dtype=np.uint8)
    reg2 = eng.register(src)
    n = np.array([1, 0, 4096, 777, 65536, 12], dtype=np.uint64)
    at = np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.uint64)
    eng.write([(wr, 70000 + at, addr_of(src) + at * 2, n)], timeout_s=30)
    for k in range(len(n)):
        got = peer.sha("scratch", 70000 + int(at[k]), int(n[k]))
        a = int(at[k]) * 2
        assert got == hashlib.sha256(src[a:a + int(n[k])]).hexdigest(), k
    dst[:] = 0
    good = (rr, offs[:4], addrs[:4], 4096)
    for bad, what in [((rr, offs[:3], addrs[:4], 4096), "op 1 is .*array columns differ in length"),
                      ((rr, np.array([0, 8192, -1, 4096]), addrs[:4], 4096), "op 1 is .*row 2 holds a negative value \\(-1\\)"),
                      ((rr, offs[:8:2], addrs[:4], 4096), "op 1 is .*C-contiguous"),
                      ((rr, offs[:4].astype(np.uint32), addrs[:4], 4096), "op 1 is .*64-bit ints"),
                      ((rr, offs[:4], addrs[:4].astype(np.float64), 4096), "op 1 is .*64-bit ints"),
                      ((rr, offs[:4].reshape(2, 2), addrs[:4], 4096), "op 1 is .*one-dimensional"),
                      ((rr, offs[:4], addrs[:4], -1), "op 1 is .*non-negative ints or 1-D arrays")]:
        with pytest.raises(InvalidArgumentError, match="(?s)" + what):  # numpy's repr spans lines
            eng.read([good, bad], timeout_s=30)
        assert not dst.any(), what  # nothing moved, the good op's rows neither
    # a row outside the remote region: refused as a bound, before anything moves
    with pytest.raises(Exception, match="outside the remote region"):
        eng.read([good, (rr, np.array([0, rr.length - 10], dtype=np.uint64), addrs[:2], 4096)], timeout_s=30)
    assert not dst.any()
    reg.close()
    reg2.close()


@pytest.mark.parametrize("protocol,write_mode", [("shm", "auto"), ("shm", "put"), ("tcp", "auto")])
def test_a_checksummed_write_returns_the_crc_of_each_value_it_copied(peers, engines, protocol, write_mode):
    """``write_checksummed``: where the engine copies the bytes itself (the peer's arena
    mapped here; small writes gathered into staging) each op's CRC-32C is taken in that
    copy and equals the CRC of the bytes; where UCX moves them from the caller's memory it
    is None. Sizes cover the cached copy, the streamed one (256 KiB and up), the copy
    striped over helper threads, a multi-range value, and an op of no bytes."""
    from mooncake_ray._private.native import _native

    peer = peers(protocol)
    eng = engines(protocol=protocol, write_mode=write_mode)
    rr = peer.remote(eng, "scratch")
    mapped = rr.write_path == "memcpy"
    assert mapped == (protocol == "shm" and write_mode == "auto")
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, 16 * MIB, dtype=np.uint8)
    reg = eng.register(src)
    base = addr_of(src)
    ops, want, roff, loff = [], [], 0, 0
    for n in [1, 7, 4096, 5000, 60 << 10, 256 << 10, (1 << 20) + 3, 3 * MIB + 4097, 9 * MIB]:
        ops.append((rr, roff, base + loff, n))
        want.append((roff, bytes(src[loff:loff + n])))
        roff += n  # consecutive: over UCX the first five (up to 64 KiB each) are gathered
        loff = (loff + n + 13) % (4 * MIB)
    ranges = ((100, 3000), (9000, 70000), (MIB, 300 << 10))
    ops.append((rr, roff + 8192, tuple((base + a, m) for a, m in ranges), sum(m for _, m in ranges)))
    want.append((roff + 8192, b"".join(bytes(src[a:a + m]) for a, m in ranges)))
    ops.append((rr, 0, base, 0))
    got = eng.write_checksummed(ops, timeout_s=30)
    assert len(got) == len(ops) and got[-1] == 0  # nothing written: the CRC of no bytes
    for k, ((off, data), g) in enumerate(zip(want, got)):
        assert peer.sha("scratch", off, len(data)) == hashlib.sha256(data).hexdigest(), (off, len(data))
        staged = np.frombuffer(data, dtype=np.uint8)
        crc = _native.spill_crc32c(addr_of(staged), len(data), 0)
        if mapped or k < 5:
            assert g == crc, (k, len(data))
        else:
            assert g is None, (k, len(data))
    reg.close()
