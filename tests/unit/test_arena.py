"""A store node's arena in named shared memory (store/arena.py) and the master's check of
what a restarted node re-adopts (MasterState.mount): no Ray."""

import json
import os
import time
import struct
import zlib

import pytest

from mooncake_ray._private.master.allocator import ALIGN
from mooncake_ray._private.master.state import MasterState, Policy
from mooncake_ray._private.master.types import NodeInfo
from mooncake_ray._private.store import arena
from tests.unit.test_master_state import Clock

MB = 1 << 20


@pytest.fixture
def shm(tmp_path):
    return str(tmp_path)


def test_a_reopened_arena_keeps_its_bytes_and_its_index(shm):
    a = arena.ArenaFile(shm, "ns", "node1", MB)
    assert not a.reused
    view = memoryview(a._mm)
    view[4096:4096 + 5] = b"hello"
    a.journal([["k", 7, 5, 4096, 4096, 0, "", a.checksum(4096, 5)]], [])
    a.journal([["j", 8, 3, 8192, 4096, 0, "", a.checksum(8192, 3)]], [])
    a.journal([], [["j", 8]])
    view.release()
    b = arena.ArenaFile(shm, "ns", "node1", MB)
    assert b.reused and b.path == a.path
    assert bytes(b._mm[4096:4101]) == b"hello"
    assert b.load_index() == [("k", 7, 5, 4096, 4096, 0, "", a.checksum(4096, 5), 1)]
    state = [list(e) for e in b.load_index()]
    b.rotate_journal()  # compaction: the state taken, the journal rotated ...
    b.journal([["late", 9, 1, 0, 4096, 0, "", 0]], [])  # ... appends go on ...
    assert sorted(e[0] for e in arena.ArenaFile(shm, "ns", "node1", MB).load_index()) == ["k", "late"]
    b.save_index(state)  # ... and the snapshot is written: the rotated journal goes
    assert not os.path.exists(b.journal_path + ".old")
    assert sorted(e[0] for e in arena.ArenaFile(shm, "ns", "node1", MB).load_index()) == ["k", "late"]


def test_the_snapshot_keeps_every_field_and_an_earlier_versions_json_snapshot_still_reads(shm):
    a = arena.ArenaFile(shm, "ns", "n", MB)
    entries = [["k", 7, 5, 4096, 4096, 1, "", 123, 2], ["é/\"x\"\n", 8, 64, 64, 64, 0, "k", 2**32 - 1, 1],
               ["old", 9, 1, 128, 64, 0, "p", 5]]  # without copies wanted: one
    a.save_index(entries)
    with open(a.index_path, "rb") as f:
        assert f.read(8) == b"MCRIDX3\n"
    want = sorted([tuple(entries[0]), tuple(entries[1]), (*entries[2], 1)])
    assert sorted(a.load_index()) == want
    body = json.dumps(entries).encode()  # what the previous version wrote
    with open(a.index_path, "wb") as f:
        f.write(b"MCRIDX1\n" + body + struct.pack("<I", zlib.crc32(body)))
    assert sorted(a.load_index()) == want
    # A body whose CRC holds but whose parts do not add up is ignored, as a corrupt one is.
    head = struct.pack("<QQQ", 2, 2, 2)
    body = head + b"[]" + b"[]"
    with open(a.index_path, "wb") as f:
        f.write(b"MCRIDX2\n" + body + struct.pack("<I", zlib.crc32(body)))
    os.unlink(a.journal_path)
    assert a.load_index() == []


def test_a_snapshot_never_written_keeps_both_journals(shm):
    a = arena.ArenaFile(shm, "ns", "n", MB)
    a.journal([["a", 1, 1, 0, 4096, 0, "", 0]], [])
    a.rotate_journal()
    a.journal([["b", 2, 1, 4096, 4096, 0, "", 0]], [])
    a.rotate_journal()  # the first compaction died before its snapshot
    a.journal([], [["a", 1]])
    assert [e[0] for e in a.load_index()] == ["b"]


def test_a_torn_journal_line_and_a_corrupt_snapshot_are_ignored(shm):
    a = arena.ArenaFile(shm, "ns", "n", MB)
    a.journal([["k", 1, 1, 0, 4096, 0, "", 0]], [])
    with open(a.journal_path, "ab") as f:
        f.write(b"0badf00d [[[\"x\"\nzzzzzzzz not hex\n")  # a write cut short; garbage
    assert [e[0] for e in a.load_index()] == ["k"]
    with open(a.index_path, "r+b") as f:
        f.seek(10)
        f.write(b"!!")
    os.unlink(a.journal_path)
    assert a.load_index() == []


def test_a_new_size_makes_a_new_zeroed_file_and_the_old_mapping_stays_valid(shm):
    a = arena.ArenaFile(shm, "ns", "n", MB)
    a._mm[0:3] = b"old"
    ino = os.stat(a.path).st_ino
    b = arena.ArenaFile(shm, "ns", "n", 2 * MB)
    assert not b.reused and os.stat(b.path).st_ino != ino
    assert bytes(b._mm[0:3]) == b"\0\0\0" and bytes(a._mm[0:3]) == b"old"


def test_files_of_a_gone_ray_node_are_collected(shm):
    a = arena.ArenaFile(shm, "ns", "n", MB)
    assert arena.collect_garbage(shm) == 1  # the process that made it is not a raylet
    assert not os.path.exists(a.path) and not os.path.exists(a.index_path)


def test_a_local_mapping_needs_the_same_file_and_a_shared_memory_protocol(shm):
    a = arena.ArenaFile(shm, "ns", "n", MB)
    info = {"arena_file": a.path, "arena_file_id": a.file_id, "boot_id": arena.boot_id()}
    assert arena.local_mapping(info, "auto") == (a.path, 0)
    assert arena.local_mapping(info, "tcp") == ("", 0)
    assert arena.local_mapping({**info, "boot_id": "another host"}, "auto") == ("", 0)
    assert arena.local_mapping({**info, "arena_file_id": [0, 0]}, "auto") == ("", 0)


def test_a_full_directory_is_a_config_error_naming_the_setting(shm, monkeypatch):
    monkeypatch.setattr(arena.shutil, "disk_usage", lambda d: type("U", (), {"free": MB})())
    with pytest.raises(arena.ConfigError, match="elastic.keep_arena"):
        arena.ArenaFile(shm, "ns", "n", 4 * MB)


def node(inc):
    return NodeInfo("n0", inc, b"a", b"r", 0, 64 * ALIGN)


def test_the_master_takes_back_only_what_it_lost_with_the_node():
    clock = Clock()
    m = MasterState(Policy(), clock=clock, wall_ns=lambda: 0, seed=1)
    m.mount(node("a"))
    for k in ("keep", "removed", "replaced"):
        gen, _ = m.put_start(k, ALIGN)
        m.put_end(k, gen)
    held = {e.key: e for e in m.node_entries("n0")}
    m.remove("removed")
    gen, _ = m.put_start("replaced", ALIGN, upsert=True)
    m.put_end("replaced", gen)
    m.unmount("n0")  # the process died
    assert m.get("keep") is None
    stale_replaced = held["replaced"]
    m.mount(node("b"), [list(held["keep"]), list(held["removed"]), list(stale_replaced)])
    assert m.get("keep") is not None
    assert m.get("removed") is None
    assert m.get("replaced") is None  # its newer value died with the node too; the older one stays gone
    assert m.counters["readopt_refused"] == 2
    m.check_invariants()


def test_a_master_that_never_knew_the_node_takes_its_entries():
    m = MasterState(Policy(), clock=Clock(), wall_ns=lambda: 0, seed=1)
    m.mount(node("a"), [["k", 5, ALIGN, "dram", 0, ALIGN]])
    assert m.get("k")[1] == 5


def test_files_of_another_host_or_pid_namespace_are_left_alone(shm):
    import json

    a = arena.ArenaFile(shm, "ns", "other", MB)
    owner = a.stem + ".owner"
    with open(owner) as f:
        rec = json.load(f)
    for field in ("boot_id", "pid_ns"):
        with open(owner, "w") as f:
            json.dump({**rec, field: "elsewhere"}, f)
        assert arena.collect_garbage(shm) == 0 and os.path.exists(a.path)


def test_a_live_nodes_owner_file_rewritten_while_another_node_collects_is_never_removed(shm, monkeypatch):
    """Store nodes of one host start together: each collects garbage while the others
    write their owner files. An owner read half-written must not pass for an unreadable
    one (whose arena is removed): the live node's clients would lose their mapping."""
    import json
    import multiprocessing

    a = arena.ArenaFile(shm, "ns", "live", MB)
    with open(a.stem + ".owner") as f:
        rec = json.load(f)
    monkeypatch.setattr(arena, "_raylet_alive", lambda pid: pid == rec["raylet_pid"])
    stop = multiprocessing.get_context("fork").Event()

    def rewrite():
        while not stop.is_set():
            arena._write_owner(a.stem, rec)

    writer = multiprocessing.get_context("fork").Process(target=rewrite, daemon=True)
    writer.start()
    try:
        removed = sum(arena.collect_garbage(shm) for _ in range(3000))
    finally:
        stop.set()
        writer.join(10)
    assert removed == 0 and os.path.exists(a.path) and os.path.exists(a.index_path)


def test_an_unreadable_owner_file_is_judged_only_once_old(shm, monkeypatch):
    monkeypatch.setattr(arena, "_raylet_alive", lambda pid: True)
    a = arena.ArenaFile(shm, "ns", "torn", MB)
    open(a.stem + ".owner", "w").close()  # torn by a crash of an older version
    assert arena.collect_garbage(shm) == 0 and os.path.exists(a.path)
    old = os.stat(a.path).st_mtime - arena.UNREADABLE_OWNER_S - 1
    os.utime(a.stem + ".owner", (old, old))
    assert arena.collect_garbage(shm) == 1 and not os.path.exists(a.path)


def _legacy_json_line(adds, drops) -> bytes:
    """A journal line as the previous version wrote it (``.journal``)."""
    body = json.dumps([adds, drops], separators=(",", ":")).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


def _legacy_columns_snapshot(entries) -> bytes:
    """An ``MCRIDX2`` snapshot as the previous version wrote it."""
    keys = json.dumps([e[0] for e in entries]).encode()
    parents = json.dumps([e[6] for e in entries]).encode()
    rows = b"".join(struct.pack("<7q", *e[1:6], e[7], e[8] if len(e) > 8 else 1) for e in entries)
    body = struct.pack("<QQQ", len(entries), len(keys), len(parents)) + keys + parents + rows
    return b"MCRIDX2\n" + body + struct.pack("<I", zlib.crc32(body))


@pytest.mark.parametrize("seed", range(8))
def test_the_index_read_back_is_the_snapshot_with_the_journals_applied_in_order(shm, seed):
    """What a restarted node reads (``load_into``: snapshot, an earlier version's JSON
    journal, the binary journals, a ring's records) against a dict applying the same: a
    snapshot of this version or the previous one, then adds, drops, drops of an older
    generation, keys dropped and added back, rotations, a torn last batch."""
    import random

    from mooncake_ray._private.native import _native

    rng = random.Random(seed)
    a = arena.ArenaFile(shm, "ns", f"n{seed}", MB)

    base = time.time_ns()  # generations are wall-clock nanoseconds (master/types.py, Generations)

    def entry(key):
        return [key, base + rng.randrange(1, 50), rng.randrange(0, 64), 64 * rng.randrange(0, 100), 64,
                rng.randrange(2), rng.choice(["", "p", "é\"\n"]), rng.randrange(1 << 32),
                rng.choice([1, 2])][:rng.choice([8, 9])]

    def norm(e):
        return (*e, 1) if len(e) == 8 else tuple(e)

    keys = [f"k{i}" for i in range(60)]
    model = {}
    snap = [entry(k) for k in keys[:30]] if seed % 4 else []
    model.update((e[0], norm(e)) for e in snap)
    if seed % 4 == 1:
        with open(a.index_path, "wb") as f:
            f.write(_legacy_columns_snapshot(snap))
    else:
        a.save_index(snap)

    def apply(adds, drops):
        for k, g in drops:
            if k in model and model[k][1] <= g:
                del model[k]
        for e in adds:
            model[e[0]] = norm(e)

    if seed % 2:  # an earlier version's journal, left by the process before an upgrade
        with open(a.legacy_journal_path, "ab") as f:
            for _ in range(10):
                adds = [entry(rng.choice(keys)) for _ in range(rng.randrange(4))]
                drops = [[rng.choice(keys), base + rng.randrange(1, 50)] for _ in range(rng.randrange(3))]
                f.write(_legacy_json_line(adds, drops))
                apply(adds, drops)
    for _ in range(2):
        for _ in range(20):
            adds = [entry(rng.choice(keys)) for _ in range(rng.randrange(4))]
            drops = [[rng.choice(keys), base + rng.randrange(1, 50)] for _ in range(rng.randrange(3))]
            a.journal(adds, drops)
            apply(adds, drops)
        if seed % 3:
            a.rotate_journal()
    with open(a.journal_path, "ab") as f:  # a batch cut short by a crash: never applied
        f.write(_native.journal_batch([entry("torn")[:8] + [1]], [])[:-3])
    ring = [tuple(entry(rng.choice(keys))[:8]) + (1,) for _ in range(5)]
    ring[0] = (*ring[0][:7], None, 1)  # no client checksum
    apply(ring, [])
    table = _native.NodeTable()
    assert a.load_into(table, ring) == []
    ks, parents, rows = table.dram_rows()
    flat = struct.unpack(f"<{7 * len(ks)}q", rows)
    got = {k: (k, *flat[7 * i:7 * i + 5], p, None if flat[7 * i + 5] < 0 else flat[7 * i + 5], flat[7 * i + 6])
           for i, (k, p) in enumerate(zip(ks, parents))}
    assert got == model


def test_a_malformed_record_of_an_earlier_versions_journal_is_listed_as_bad_and_the_writer_refuses_one(shm):
    from mooncake_ray._private.native import _native

    a = arena.ArenaFile(shm, "ns", "n", MB)
    with open(a.legacy_journal_path, "wb") as f:
        f.write(_legacy_json_line([["k", 3, 5, 4096, 64, 0, "", 9], ["bad", "3", 5, 0, 64, 0, "", 9]], []))
    table = _native.NodeTable()
    assert a.load_into(table) == [["bad", "3"]]
    assert table.keys() == [("k", "dram")]
    with pytest.raises(ValueError, match="'bad', '3'"):
        a.journal([["bad", "3", 5, 0, 64, 0, "", 9, 1]], [])


def test_many_checksums_at_once_are_each_ranges_and_a_range_outside_is_refused(shm):
    import numpy as np

    a = arena.ArenaFile(shm, "ns", "n", MB)
    view = memoryview(a._mm)
    view[0:MB] = os.urandom(MB)
    view.release()
    offs, sizes = np.array([0, 100, 4096, MB - 7, 5], dtype=np.int64), np.array([64, 1000, 0, 7, 3], dtype=np.int64)
    assert a.checksums(offs, sizes).tolist() == [a.checksum(o, s) for o, s in zip(offs.tolist(), sizes.tolist())]
    with pytest.raises(ValueError, match="range 1 .* outside the mapping"):
        a.checksums(np.array([0, MB - 3], dtype=np.int64), np.array([1, 4], dtype=np.int64))


def test_a_snapshot_from_the_node_table_reads_back_as_the_table_held_it(shm):
    """What a compaction writes (``NodeTable.dram_snapshot``, keys escaped natively) reads
    back with every field; a value not checksummed yet is left to the journal."""
    from mooncake_ray._private.native import _native

    t = _native.NodeTable()
    entries = [["k", 7, 5, "dram", 4096, 4096, 1, "", 2], ["é/\"x\"\n\\\x01😀", 8, 64, "dram", 64, 64, 0, "k", 1],
               ["unsummed", 9, 1, "dram", 128, 64, 0, "", 1], ["slab/1", 1, 4096, "reserved", 0, 4096, 0, "", 1]]
    for e in entries:
        t.set(e)
    t.set_crc("k", 7, 4096, 123)
    t.set_crc(entries[1][0], 8, 64, 2**32 - 1)
    a = arena.ArenaFile(shm, "ns", "n", MB)
    assert a.save_snapshot(t.snapshot()[1]) > 0
    assert sorted(a.load_index()) == sorted([("k", 7, 5, 4096, 4096, 1, "", 123, 2),
                                             (entries[1][0], 8, 64, 64, 64, 0, "k", 2**32 - 1, 1)])
