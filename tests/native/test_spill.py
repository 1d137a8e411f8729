"""The disk spill tier (mooncake_ray/_private/store/spill.py over native/src/spill).

No Ray. Run from /work/main inside a private mount namespace so the disk-full tests can
mount a small filesystem of their own:

    unshare --net --mount --propagation private sh -c 'mount --make-rprivate / && \
        ip link set lo up && exec .venv/bin/python -m pytest -q tests/native/test_spill.py'

Outside such a namespace those tests skip (they never touch the host's mounts).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import threading
import time

import numpy as np
import pytest

from mooncake_ray.errors import (
    ChecksumError,
    EngineClosedError,
    InvalidArgumentError,
    ObjectNotFoundError,
    SpillError,
)
from mooncake_ray._private.store.spill import SpillTier, crc32c

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
CHUNK = 256 * KiB  # small chunks in most tests, so multi-chunk paths run with small objects


# ---- helpers -----------------------------------------------------------------------------


def buffer(n: int, align: int = 4096, offset: int = 0) -> np.ndarray:
    """n bytes whose address is `offset` bytes past an `align` boundary (a view; the base
    array stays alive through .base)."""
    raw = np.empty(n + align + offset + 64, np.uint8)
    start = (-raw.ctypes.data) % align + offset
    return raw[start : start + n]


def random_bytes(rng: np.random.Generator, n: int, align: int = 4096, offset: int = 0) -> np.ndarray:
    a = buffer(n, align, offset)
    a[:] = rng.integers(0, 256, n, dtype=np.uint8)
    return a


def slot_files(root: str) -> list[str]:
    """Every slot file (live objects and free slots)."""
    return sorted(
        os.path.join(root, d, f)
        for d in os.listdir(root)
        if len(d) == 1 and os.path.isdir(os.path.join(root, d))
        for f in os.listdir(os.path.join(root, d))
    )


def file_of(tier: SpillTier, key: str) -> str:
    """The slot holding the current version of `key`: its header names the key, with the
    largest seq (a free slot may still hold an older version's header)."""
    best, best_seq = None, -1
    for path in slot_files(tier.directory):
        with open(path, "rb") as f:
            head = f.read(8192)
        klen = int.from_bytes(head[12:16], "little")
        seq = int.from_bytes(head[32:40], "little")
        if head[:8] == b"MCRSPILL" and head[64 : 64 + klen] == key.encode() and seq > best_seq:
            best, best_seq = path, seq
    assert best, f"no file holds {key!r}"
    return best


@pytest.fixture
def spill_dir(tmp_path):
    # Needs a filesystem with O_DIRECT (ext4/xfs; tmpfs only on Linux >= 6.6):
    # MCR_SPILL_TEST_DIR overrides where the directories are made.
    base = os.environ.get("MCR_SPILL_TEST_DIR")
    d = tempfile.mkdtemp(prefix="spill-test-", dir=base) if base else str(tmp_path / "spill")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def tier(spill_dir):
    t = SpillTier(spill_dir, 1 * GiB, chunk_bytes=CHUNK)
    yield t
    t.close()


def in_private_mount_ns() -> bool:
    """True when this process runs in a mount namespace of its own (an ancestor's differs;
    /proc/1 is often unreadable) whose root mount does not propagate back."""
    try:
        me = os.readlink("/proc/self/ns/mnt")
        pid = os.getppid()
        while pid > 1:
            if os.readlink(f"/proc/{pid}/ns/mnt") != me:
                break
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        else:
            return False
        with open("/proc/self/mountinfo") as f:
            root = [line.split(" - ")[0].split() for line in f if line.split()[4] == "/"]
        return bool(root) and not any(x.startswith("shared:") for x in root[-1][6:])
    except OSError:
        return False


@contextlib.contextmanager
def small_ext4(size_mib: int):
    """A fresh ext4 of `size_mib` on a loop device, mounted in this (private) mount
    namespace; gone afterwards."""
    if os.geteuid() != 0 or not in_private_mount_ns():
        pytest.skip("needs root in a private mount namespace (run under `unshare --mount`)")
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("mkfs.ext4 not installed")
    work = tempfile.mkdtemp(prefix="spill-fs-", dir="/tmp")
    img, mnt = os.path.join(work, "fs.img"), os.path.join(work, "mnt")
    os.mkdir(mnt)
    try:
        with open(img, "wb") as f:
            f.truncate(size_mib * MiB)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", img], check=True)
        subprocess.run(["mount", "-o", "loop", img, mnt], check=True)
        try:
            yield mnt
        finally:
            subprocess.run(["umount", "-l", mnt], check=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---- checksum ------------------------------------------------------------------------------


def test_crc32c_known_vector():
    data = np.frombuffer(b"123456789", np.uint8)
    assert crc32c(data.ctypes.data, 9) == 0xE3069283
    # continuation: crc(a || b) == crc(b, crc(a))
    rng = np.random.default_rng(1)
    a = random_bytes(rng, 100_003, offset=3)
    whole = crc32c(a.ctypes.data, a.size)
    part = crc32c(a.ctypes.data + 77_777, a.size - 77_777, crc32c(a.ctypes.data, 77_777))
    assert whole == part


# ---- round trips ---------------------------------------------------------------------------

EDGE_SIZES = [0, 1, 4095, 4096, 4097, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 4096, 5 * MiB + 123]


@pytest.mark.parametrize("src_off,dst_off", [(0, 0), (1, 0), (0, 3), (17, 4001)])
def test_roundtrip_single(tier, src_off, dst_off):
    rng = np.random.default_rng(src_off * 100 + dst_off)
    for n in EDGE_SIZES:
        src = random_bytes(rng, n, offset=src_off)
        tier.write(f"k{n}", n + 1, src.ctypes.data, n)
        # guard bytes on both sides of the destination must survive the read
        dst = buffer(n + 2 * 4096, offset=dst_off)
        dst[:] = 0xA5
        gen = tier.read(f"k{n}", dst.ctypes.data + 4096, n)
        assert gen == n + 1
        assert np.array_equal(dst[4096 : 4096 + n], src), n
        assert (dst[:4096] == 0xA5).all() and (dst[4096 + n :] == 0xA5).all(), f"wrote outside {n}"
    assert tier.num_keys == len(EDGE_SIZES)


def test_roundtrip_batched_random(tier):
    rng = np.random.default_rng(7)
    sizes = [int(x) for x in rng.integers(1, 3 * MiB, 60)] + [4 * KiB, 128 * KiB, 1 * MiB]
    srcs, items = [], []
    for i, n in enumerate(sizes):
        src = random_bytes(rng, n, offset=0 if i % 3 else int(rng.integers(1, 4096)))
        srcs.append(src)
        items.append((f"batch/{i} key with spaces", i, src.ctypes.data, n))
    assert tier.write_many(items) == [None] * len(items)
    dsts = [buffer(n, offset=0 if i % 2 else 8) for i, n in enumerate(sizes)]
    res = tier.read_many([(k, d.ctypes.data, n) for (k, _, _, n), d in zip(items, dsts)])
    assert res == list(range(len(items)))
    for s, d in zip(srcs, dsts):
        assert np.array_equal(s, d)
    assert sorted(tier.scan()) == sorted((k, g, n) for k, g, _, n in items)


def test_roundtrip_without_uring(spill_dir):
    rng = np.random.default_rng(3)
    with SpillTier(spill_dir, GiB, use_uring=False, chunk_bytes=CHUNK) as t:
        assert not t.uses_uring
        srcs = [random_bytes(rng, n, offset=o) for n, o in [(5000, 0), (CHUNK * 2 + 1, 5), (MiB, 0)]]
        assert t.write_many([(f"s{i}", i, s.ctypes.data, s.size) for i, s in enumerate(srcs)]) == [None] * 3
        for i, s in enumerate(srcs):
            d = buffer(s.size, offset=i)
            assert t.read(f"s{i}", d.ctypes.data, s.size) == i
            assert np.array_equal(s, d)


def test_keys_any_string(tier):
    rng = np.random.default_rng(5)
    keys = ["a/b/../c", " spaced key ", "ключ/😀", "x" * 4032, "y" * 4096, "\n\t"]
    for i, k in enumerate(keys):
        src = random_bytes(rng, 10_000 + i)
        tier.write(k, i, src.ctypes.data, src.size)
        dst = buffer(src.size)
        assert tier.read(k, dst.ctypes.data, src.size) == i
        assert np.array_equal(src, dst)
    assert sorted(k for k, _, _ in tier.scan()) == sorted(keys)
    a = buffer(16)
    with pytest.raises(InvalidArgumentError):
        tier.write("z" * 4097, 0, a.ctypes.data, 16)
    with pytest.raises(InvalidArgumentError):
        tier.write("", 0, a.ctypes.data, 16)


def test_overwrite_keeps_newest_and_recycles(tier):
    rng = np.random.default_rng(9)
    a, b = random_bytes(rng, 300 * KiB), random_bytes(rng, 300 * KiB)
    tier.write("k", 1, a.ctypes.data, a.size)
    used = tier.used_bytes
    assert used == 4096 + 300 * KiB
    tier.write("k", 2, b.ctypes.data, b.size)
    assert tier.used_bytes == used and tier.num_keys == 1
    d = buffer(b.size)
    assert tier.read("k", d.ctypes.data, d.size) == 2 and np.array_equal(d, b)
    assert len(slot_files(tier.directory)) == 2
    st = tier.stats()
    assert st["free_pool_files"] == 1 and st["tombstones"] == 1  # the old slot, kept
    tier.write("k2", 3, a.ctypes.data, a.size)
    assert tier.stats()["recycled_writes"] == 1 and tier.stats()["free_pool_files"] == 0
    assert len(slot_files(tier.directory)) == 2  # no file created
    assert tier.read("k2", d.ctypes.data, d.size) == 3 and np.array_equal(d, a)
    assert tier.read("k", d.ctypes.data, d.size) == 2 and np.array_equal(d, b)


def test_read_errors(tier):
    a = buffer(8192)
    with pytest.raises(ObjectNotFoundError):
        tier.read("missing", a.ctypes.data, 8192)
    tier.write("k", 0, a.ctypes.data, 8192)
    with pytest.raises(InvalidArgumentError, match="8191"):
        tier.read("k", a.ctypes.data, 8191)
    res = tier.read_many([("k", a.ctypes.data, 8192), ("nope", a.ctypes.data, 10)])
    assert res[0] == 0 and isinstance(res[1], ObjectNotFoundError)
    assert tier.remove("k") and not tier.remove("k") and not tier.contains("k")
    with pytest.raises(ObjectNotFoundError):
        tier.read("k", a.ctypes.data, 8192)


# ---- capacity -------------------------------------------------------------------------------


def test_capacity_limit(spill_dir):
    a = buffer(600 * KiB)
    with SpillTier(spill_dir, MiB) as t:
        t.write("a", 1, a.ctypes.data, a.size)
        files = slot_files(spill_dir)
        with pytest.raises(SpillError, match="capacity"):
            t.write("b", 1, a.ctypes.data, a.size)
        assert slot_files(spill_dir) == files and not t.contains("b")
        assert t.degraded is None  # a full tier is not a broken one
        res = t.write_many([("c", 1, a.ctypes.data, 100 * KiB), ("d", 1, a.ctypes.data, 600 * KiB)])
        assert res[0] is None and isinstance(res[1], SpillError)
        assert t.used_bytes == (4096 + 600 * KiB) + (4096 + 100 * KiB) <= t.capacity_bytes
        t.remove("a")
        t.write("b", 2, a.ctypes.data, a.size)  # the pool file of "a" is reused
        assert t.stats()["capacity_rejections"] == 2
        # pool files count against the capacity: the disk never holds more than capacity
        t.remove("b")
        t.write("e", 1, a.ctypes.data, 300 * KiB)
        on_disk = sum(os.path.getsize(p) for p in slot_files(spill_dir))
        assert on_disk <= t.capacity_bytes


# ---- corruption -----------------------------------------------------------------------------


def _corrupt_cases():
    def flip_data(p):
        with open(p, "r+b") as f:
            f.seek(4096 + 12345)
            b = f.read(1)
            f.seek(4096 + 12345)
            f.write(bytes([b[0] ^ 0x40]))

    def truncate(p):
        os.truncate(p, os.path.getsize(p) - 4096)

    def garbage_header(p):
        with open(p, "r+b") as f:
            f.write(os.urandom(4096))

    def flip_key(p):  # header CRC covers the key
        with open(p, "r+b") as f:
            f.seek(64)
            f.write(b"X")

    def zero_tail(p):  # a torn write: the last block never reached the disk
        size = os.path.getsize(p)
        with open(p, "r+b") as f:
            f.seek(size - 4096)
            f.write(bytes(4096))

    return [flip_data, truncate, garbage_header, flip_key, zero_tail]


@pytest.mark.parametrize("corrupt", _corrupt_cases(), ids=lambda f: f.__name__)
def test_corrupt_file_is_a_miss_and_deleted(tier, corrupt):
    rng = np.random.default_rng(11)
    src = random_bytes(rng, 3 * CHUNK + 100)  # several chunks: the CRC is combined
    tier.write("victim", 5, src.ctypes.data, src.size)
    tier.write("bystander", 6, src.ctypes.data, src.size)
    path = file_of(tier, "victim")
    corrupt(path)
    dst = buffer(src.size)
    with pytest.raises(ChecksumError):
        tier.read("victim", dst.ctypes.data, dst.size)
    assert not os.path.exists(path) and not tier.contains("victim")
    with pytest.raises(ObjectNotFoundError):
        tier.read("victim", dst.ctypes.data, dst.size)
    assert tier.read("bystander", dst.ctypes.data, dst.size) == 6 and np.array_equal(dst, src)
    st = tier.stats()
    assert st["checksum_failures"] == 1 and st["files_deleted_invalid"] == 1


def test_vanished_file_is_not_found(tier):
    a = buffer(8192)
    tier.write("k", 0, a.ctypes.data, a.size)
    os.unlink(file_of(tier, "k"))
    with pytest.raises(ObjectNotFoundError):
        tier.read("k", a.ctypes.data, a.size)
    assert not tier.contains("k") and tier.used_bytes == 0


# ---- restart ----------------------------------------------------------------------------------


def test_scan_after_reopen_finds_exactly_the_valid_objects(spill_dir):
    rng = np.random.default_rng(13)
    srcs = {f"obj/{i}": random_bytes(rng, int(rng.integers(1, 700 * KiB))) for i in range(40)}
    with SpillTier(spill_dir, GiB, chunk_bytes=CHUNK) as t:
        assert t.write_many([(k, i, s.ctypes.data, s.size) for i, (k, s) in enumerate(srcs.items())]) == [None] * 40
        t.write("obj/0", 100, srcs["obj/0"].ctypes.data, srcs["obj/0"].size)  # a newer version
        t.remove("obj/1")
        paths = {k: file_of(t, k) for k in ["obj/2", "obj/3", "obj/4", "obj/5"]}
    # damage while "down": a bad header and a truncation (found by the header scan), a
    # flipped data byte (found only by verify_data), a torn write (zero header, right size)
    with open(paths["obj/2"], "r+b") as f:
        f.write(b"NOTMAGIC")
    os.truncate(paths["obj/3"], 4096 + 100)
    with open(paths["obj/4"], "r+b") as f:
        f.seek(4096 + 7)
        b = f.read(1)
        f.seek(4096 + 7)
        f.write(bytes([b[0] ^ 1]))
    with open(paths["obj/5"], "r+b") as f:
        f.write(bytes(4096))
    with open(os.path.join(spill_dir, "0", "not-ours.txt"), "w") as f:
        f.write("left alone")
    gens = {k: i for i, k in enumerate(srcs)}
    gens["obj/0"] = 100
    expect = {k for k in srcs if k not in ("obj/1", "obj/2", "obj/3", "obj/5")}
    with SpillTier(spill_dir, GiB, chunk_bytes=CHUNK) as t:
        assert {k for k, _, _ in t.keys()} == expect  # opening scans the headers
        found = t.scan(verify_data=True)
        expect.discard("obj/4")
        assert sorted(found) == sorted((k, gens[k], srcs[k].size) for k in expect)
        for k in expect:
            d = buffer(srcs[k].size, offset=1)
            assert t.read(k, d.ctypes.data, d.size) == gens[k]
            assert np.array_equal(d, srcs[k])
        # + the slots of obj/1 (removed) and of obj/0's first version, free; + not-ours.txt
        assert t.stats()["free_pool_files"] == 2
        assert len(slot_files(spill_dir)) == len(expect) + 2 + 1
        assert os.path.exists(os.path.join(spill_dir, "0", "not-ours.txt"))
        assert t.used_bytes == sum(4096 + -(-srcs[k].size // 4096) * 4096 for k in expect)


def test_removed_object_stays_removed_after_restart(spill_dir):
    """A removed object's slot keeps its (valid) header until reused; the tombstone keeps
    it from coming back, also when a reuse of the slot was cut short."""
    rng = np.random.default_rng(19)
    a = random_bytes(rng, 200 * KiB)
    with SpillTier(spill_dir, GiB, chunk_bytes=CHUNK) as t:
        t.write("gone", 1, a.ctypes.data, a.size)
        t.write("kept", 2, a.ctypes.data, a.size)
        path = file_of(t, "gone")
        t.remove("gone")
    # a later write into that slot that died after its data, before its header
    with open(path, "r+b") as f:
        f.seek(4096)
        f.write(os.urandom(100 * KiB))
    with SpillTier(spill_dir, GiB, chunk_bytes=CHUNK) as t:
        assert [k for k, _, _ in t.scan()] == ["kept"]
        assert t.stats()["free_pool_files"] == 1
        t.write("new", 3, a.ctypes.data, a.size)  # reuses the slot
        assert t.stats()["recycled_writes"] == 1
    with SpillTier(spill_dir, GiB, chunk_bytes=CHUNK) as t:
        assert sorted(k for k, _, _ in t.scan(verify_data=True)) == ["kept", "new"]


def test_tombstone_log_is_compacted(spill_dir):
    a = buffer(4096)
    a[:] = 9
    with SpillTier(spill_dir, GiB, tombstone_compact_min=64) as t:
        for rnd in range(6):  # 600 overwrites of a few keys: 600 tombstones written
            assert t.write_many([(f"k{i % 4}", rnd * 100 + i, a.ctypes.data, a.size) for i in range(100)]) == [None] * 100
        st = t.stats()
        # without compaction 600; with it, a few times the free pool (<= 32 + 4 slots)
        assert st["tombstones"] < 300 and st["free_pool_files"] <= 36
        size = os.path.getsize(os.path.join(spill_dir, "TOMBSTONES"))
        assert size == 16 + 8 * st["tombstones"]
    with SpillTier(spill_dir, GiB, tombstone_compact_min=64) as t:
        assert sorted(t.scan()) == [(f"k{i}", 500 + 96 + i, 4096) for i in range(4)]


def test_one_tier_per_directory(spill_dir):
    with SpillTier(spill_dir, GiB):
        with pytest.raises(SpillError, match="in use"):
            SpillTier(spill_dir, GiB)
    SpillTier(spill_dir, GiB).close()  # free again once closed


def test_closed_tier_raises(spill_dir):
    t = SpillTier(spill_dir, GiB)
    t.close()
    a = buffer(4096)
    with pytest.raises(EngineClosedError):
        t.write("k", 0, a.ctypes.data, 4096)


# ---- small objects in packs ------------------------------------------------------------------------


def record_size(key: str, n: int) -> int:
    return -(-(40 + len(key.encode()) + n) // 64) * 64


def small_values(rng, keys, sizes):
    return {k: random_bytes(rng, n, align=64, offset=8) for k, n in zip(keys, sizes)}


def test_small_objects_share_packs_and_read_back(tier):
    rng = np.random.default_rng(31)
    keys = [f"small/{i}" for i in range(1200)]
    vals = small_values(rng, keys, [int(x) for x in rng.integers(0, 2900, len(keys))])
    big = random_bytes(rng, 70 * KiB)
    items = [(k, i, v.ctypes.data, v.size) for i, (k, v) in enumerate(vals.items())]
    res = tier.write_many(items[:600] + [("big", 99, big.ctypes.data, big.size)] + items[600:])
    assert res == [None] * 1201
    st = tier.stats()
    records = sum(record_size(k, v.size) for k, v in vals.items())
    assert st["packed_objects"] == 1200
    assert -(-records // (256 * KiB)) <= st["packs"] <= -(-records // (256 * KiB)) + 1
    assert st["writes"] == 1201
    # one file per pack (at most 256 KiB of records each) and one for the large value
    assert len(slot_files(tier.directory)) == st["packs"] + 1 < 12
    pack_bytes = sum(os.path.getsize(p) for p in slot_files(tier.directory)) - (4096 + 70 * KiB)
    assert tier.used_bytes == pack_bytes + 4096 + 70 * KiB
    assert pack_bytes < records + st["packs"] * 2 * 4096  # a header and a partial block a pack
    dsts = {k: buffer(v.size) for k, v in vals.items()}
    assert tier.read_many([(k, dsts[k].ctypes.data, v.size) for k, v in vals.items()]) == list(range(1200))
    assert all(np.array_equal(dsts[k], v) for k, v in vals.items())
    for i, (k, v) in enumerate(list(vals.items())[::97]):
        d = buffer(v.size, offset=3)
        assert tier.read(k, d.ctypes.data, d.size) == 97 * i and np.array_equal(d, v)
    with pytest.raises(InvalidArgumentError, match="stored length"):
        tier.read("small/1", buffer(4096).ctypes.data, vals["small/1"].size + 1)


def test_a_pack_is_freed_with_its_last_object(tier):
    rng = np.random.default_rng(32)
    keys = [f"p/{i}" for i in range(50)]
    vals = small_values(rng, keys, [256] * 50)
    assert tier.write_many([(k, 1, v.ctypes.data, v.size) for k, v in vals.items()]) == [None] * 50
    used = tier.used_bytes
    assert used == 4096 + -(-50 * record_size("p/0", 256) // 4096) * 4096
    for k in keys[:49]:
        assert tier.remove(k)
    st = tier.stats()
    assert (st["packs"], st["packed_objects"], st["free_pool_files"]) == (1, 1, 0) and tier.used_bytes == used
    d = buffer(256)
    assert tier.read("p/49", d.ctypes.data, 256) == 1 and np.array_equal(d, vals["p/49"])
    assert tier.remove("p/49")
    st = tier.stats()
    assert (st["packs"], st["free_pool_files"], tier.used_bytes, tier.num_keys) == (0, 1, 0, 0)
    # a later write reuses the pack's file
    assert tier.write_many([(k, 2, v.ctypes.data, v.size) for k, v in vals.items()]) == [None] * 50
    assert tier.stats()["recycled_writes"] == 1 and len(slot_files(tier.directory)) == 1


def test_packed_objects_survive_a_restart_and_removed_ones_stay_removed(spill_dir):
    rng = np.random.default_rng(33)
    keys = [f"r/{i}" for i in range(300)]
    vals = small_values(rng, keys, [int(x) for x in rng.integers(1, 2000, 300)])
    big = random_bytes(rng, 9000)
    with SpillTier(spill_dir, GiB, chunk_bytes=CHUNK) as t:
        assert t.write_many([(k, i, vals[k].ctypes.data, vals[k].size) for i, k in enumerate(keys[:150])]) == [None] * 150
        assert t.write_many([(k, 150 + i, vals[k].ctypes.data, vals[k].size)
                             for i, k in enumerate(keys[150:])]) == [None] * 150
        for k in keys[:40]:
            t.remove(k)                                                   # removed
        t.write(keys[40], 1000, vals[keys[41]].ctypes.data, vals[keys[41]].size)  # packed -> packed
        t.write(keys[42], 1001, big.ctypes.data, big.size)                # packed -> own slot
        t.write("was-big", 5, big.ctypes.data, big.size)
        t.write("was-big", 1002, vals[keys[43]].ctypes.data, vals[keys[43]].size)  # own slot -> packed
        keys_before = sorted(t.keys())
    with SpillTier(spill_dir, GiB, chunk_bytes=CHUNK) as t:
        assert sorted(t.keys()) == keys_before
        gens = {k: g for k, g, _ in t.scan(verify_data=True)}
        assert set(gens) == set(keys[40:]) | {"was-big"}
        assert (gens[keys[40]], gens[keys[42]], gens["was-big"]) == (1000, 1001, 1002)
        want = {**{k: vals[k] for k in keys[43:]}, keys[40]: vals[keys[41]], keys[41]: vals[keys[41]],
                keys[42]: big, "was-big": vals[keys[43]]}
        for k, v in want.items():
            d = buffer(v.size)
            t.read(k, d.ctypes.data, d.size)
            assert np.array_equal(d, v), k
        for k in keys[40:]:  # everything removed: both packs' files go to the free pool
            t.remove(k)
        assert t.stats()["packs"] == 1  # "was-big"'s own pack
    with SpillTier(spill_dir, GiB, chunk_bytes=CHUNK) as t:
        assert [k for k, _, _ in t.keys()] == ["was-big"]


def test_a_corrupt_record_is_a_miss_and_its_pack_neighbours_stay(spill_dir):
    rng = np.random.default_rng(34)
    keys = [f"c/{i}" for i in range(10)]
    vals = small_values(rng, keys, [500] * 10)
    with SpillTier(spill_dir, GiB) as t:
        assert t.write_many([(k, 7, v.ctypes.data, v.size) for k, v in vals.items()]) == [None] * 10
        (path,) = slot_files(spill_dir)
        rec = record_size("c/0", 500)
        with open(path, "r+b") as f:  # a data byte of the fourth record
            f.seek(4096 + 3 * rec + 40 + 3 + 100)
            b = f.read(1)
            f.seek(4096 + 3 * rec + 40 + 3 + 100)
            f.write(bytes([b[0] ^ 0x10]))
        dsts = [buffer(500) for _ in range(10)]  # one batched read: the bad one fails alone
        res = t.read_many([(k, d.ctypes.data, 500) for k, d in zip(keys, dsts)])
        assert isinstance(res[3], ChecksumError) and res[:3] + res[4:] == [7] * 9
        assert all(np.array_equal(d, vals[k]) for i, (k, d) in enumerate(zip(keys, dsts)) if i != 3)
        assert not t.contains("c/3") and os.path.exists(path)
        dsts = [buffer(500) for _ in range(9)]
        assert t.read_many([(k, d.ctypes.data, 500) for k, d in zip([k for k in keys if k != "c/3"], dsts)]) == [7] * 9
        assert t.stats()["checksum_failures"] == 1
        with open(path, "r+b") as f:  # and the seventh's, found only by the next scan
            f.seek(4096 + 6 * rec + 40 + 3)
            f.write(b"\xff\xfe")
    with SpillTier(spill_dir, GiB) as t:
        assert sorted(k for k, _, _ in t.keys()) == [k for k in keys if k not in ("c/3", "c/6")]
        for k in keys:
            if k not in ("c/3", "c/6"):
                d = buffer(500)
                assert t.read(k, d.ctypes.data, 500) == 7 and np.array_equal(d, vals[k])


def test_a_failing_disk_fails_packed_reads_and_degrades_the_tier(tier):
    rng = np.random.default_rng(37)
    vals = small_values(rng, [f"e/{i}" for i in range(8)], [300] * 8)
    assert tier.write_many([(k, 1, v.ctypes.data, v.size) for k, v in vals.items()]) == [None] * 8
    tier._inject_io_error("read", 5, 1)  # EIO on the next read completion
    dsts = [buffer(300) for _ in range(8)]
    res = tier.read_many([(k, d.ctypes.data, 300) for k, d in zip(vals, dsts)])
    assert sum(isinstance(r, SpillError) for r in res) == 1 and res.count(1) == 7
    assert tier.degraded is not None and tier.num_keys == 8  # nothing dropped for a disk error
    assert tier.recover() and tier.degraded is None
    assert tier.read_many([(k, d.ctypes.data, 300) for k, d in zip(vals, dsts)]) == [1] * 8


def test_a_torn_pack_brings_back_none_of_its_records(spill_dir):
    rng = np.random.default_rng(35)
    vals = small_values(rng, [f"t/{i}" for i in range(20)], [700] * 20)
    with SpillTier(spill_dir, GiB) as t:
        assert t.write_many([(k, 1, v.ctypes.data, v.size) for k, v in vals.items()]) == [None] * 20
        (path,) = slot_files(spill_dir)
    with open(path, "r+b") as f:  # the header never reached the disk
        f.write(bytes(4096))
    with SpillTier(spill_dir, GiB) as t:
        assert t.keys() == [] and t.used_bytes == 0 and not os.path.exists(path)


def test_a_pack_that_does_not_fit_fails_every_object_in_it(spill_dir):
    rng = np.random.default_rng(36)
    vals = small_values(rng, [f"f/{i}" for i in range(100)], [2000] * 100)
    with SpillTier(spill_dir, 64 * KiB) as t:
        res = t.write_many([(k, 1, v.ctypes.data, v.size) for k, v in vals.items()])
        assert all(isinstance(r, SpillError) and "capacity" in str(r) for r in res)
        assert t.used_bytes == 0 and t.keys() == [] and t.degraded is None


def test_the_masters_disk_length_is_what_the_tier_charges():
    from mooncake_ray._private.master.tiering import disk_length
    from mooncake_ray._private.native import _native

    for key in ("k", "ключ/" * 3, "x" * 200, "y" * 3000, "z" * 4033):
        for n in (0, 1, 64, 256, 1000, 2900, 3000, 3032, 3033, 4096, 10_000):
            assert disk_length(n, key) == _native.spill_disk_bytes(len(key.encode()), n), (key[:8], n)


# ---- disk failures ------------------------------------------------------------------------------


def test_enospc_on_a_full_filesystem():
    rng = np.random.default_rng(17)
    with small_ext4(48) as mnt:
        t = SpillTier(os.path.join(mnt, "spill"), 10 * GiB, chunk_bytes=CHUNK)  # far above the fs
        src = random_bytes(rng, MiB + 5000)
        written, err = [], None
        for i in range(200):
            try:
                t.write(f"fill/{i}", i, src.ctypes.data, src.size)
                written.append(f"fill/{i}")
            except SpillError as e:
                err = e
                break
        assert err is not None and not isinstance(err, ChecksumError), "never hit ENOSPC"
        assert "No space" in str(err) or "space" in str(err).lower()
        assert t.degraded and "space" in t.degraded.lower()
        assert len(written) > 10
        # no partial file left behind, the rest is intact
        assert len(slot_files(t.directory)) == len(written) == t.num_keys
        with pytest.raises(SpillError, match="degraded"):
            t.write("after", 0, src.ctypes.data, src.size)
        dsts = [buffer(src.size) for _ in written]
        assert t.read_many([(k, d.ctypes.data, d.size) for k, d in zip(written, dsts)]) == list(range(len(written)))
        assert all(np.array_equal(d, src) for d in dsts)
        # the owner frees space and recovers
        for k in written[:5]:
            t.remove(k)
        assert t.recover() and t.degraded is None
        t.write("after", 1, src.ctypes.data, src.size)
        t.close()


def test_directory_removed_under_the_tier(spill_dir):
    a = buffer(64 * KiB)
    a[:] = 1
    t = SpillTier(spill_dir, GiB)
    t.write("k", 0, a.ctypes.data, a.size)
    shutil.rmtree(spill_dir)
    with pytest.raises(SpillError):
        t.write("k2", 0, a.ctypes.data, a.size)
    assert t.degraded and "removed" in t.degraded
    with pytest.raises((ObjectNotFoundError, SpillError)):
        t.read("k", a.ctypes.data, a.size)
    with pytest.raises(SpillError):
        t.scan()
    assert t.recover() and t.degraded is None and t.num_keys == 0
    t.write("k3", 0, a.ctypes.data, a.size)
    assert t.read("k3", a.ctypes.data, a.size) == 0
    t.close()


def test_io_errors_degrade_without_losing_data(tier):
    """EIO (injected at completion, as a failing disk reports it): a failed write leaves no
    file behind and degrades the tier; a failed read is an error, not a corrupt object."""
    import errno

    rng = np.random.default_rng(23)
    src = random_bytes(rng, 3 * CHUNK + 10)
    tier.write("ok", 1, src.ctypes.data, src.size)
    files = slot_files(tier.directory)
    tier._inject_io_error("write", errno.EIO)
    with pytest.raises(SpillError, match="Input/output error") as ei:
        tier.write("bad", 2, src.ctypes.data, src.size)
    assert not isinstance(ei.value, ChecksumError)
    assert slot_files(tier.directory) == files and not tier.contains("bad")
    assert tier.degraded and "Input/output" in tier.degraded
    assert tier.used_bytes == 4096 + -(-src.size // 4096) * 4096
    d = buffer(src.size)
    tier._inject_io_error("read", errno.EIO)
    with pytest.raises(SpillError, match="Input/output error") as ei:
        tier.read("ok", d.ctypes.data, d.size)
    assert not isinstance(ei.value, ChecksumError) and tier.contains("ok")
    assert tier.read("ok", d.ctypes.data, d.size) == 1 and np.array_equal(d, src)
    assert tier.recover() and tier.degraded is None
    tier.write("bad", 2, src.ctypes.data, src.size)
    assert tier.stats()["write_errors"] == 1 and tier.stats()["read_errors"] == 1


# ---- concurrency ----------------------------------------------------------------------------------


def test_threads_share_a_tier(tier):
    errors = []

    def worker(w: int):
        rng = np.random.default_rng(100 + w)
        try:
            for i in range(25):
                n = int(rng.integers(1, 2 * CHUNK))
                src = random_bytes(rng, n, offset=int(rng.integers(0, 2)) * 9)
                key = f"t{w}/{i % 7}"  # overwrite own keys, contend on the index
                tier.write(key, i, src.ctypes.data, n)
                dst = buffer(n)
                assert tier.read(key, dst.ctypes.data, n) == i
                assert np.array_equal(dst, src)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    assert not errors, errors
    assert tier.num_keys == 28


def test_blocking_calls_release_the_gil(tier):
    big = buffer(32 * MiB)
    big[:] = 3
    items = [(f"g{i}", 0, big.ctypes.data, big.size) for i in range(4)]
    done = threading.Event()
    ticks = 0

    def offload():
        tier.write_many(items)
        tier.read_many([(k, big.ctypes.data, big.size) for k, *_ in items])
        done.set()

    th = threading.Thread(target=offload)
    th.start()
    t0 = time.perf_counter()
    while not done.is_set():
        ticks += 1
    elapsed = time.perf_counter() - t0
    th.join()
    # With the GIL held for the whole call this loop would barely run at all.
    assert elapsed > 0.02 and ticks > 10_000, (elapsed, ticks)
