"""The commit ring between the master's native commit path and a store node
(``store/ring.py``, ``CommitRing`` in ``master_index.h``): a durable one-call commit is
answered at once when its node holds its ring, and held for the node's answer otherwise;
the node reads every record, in order, across the wrap, and a new process of the node
reads what the previous one left."""

from __future__ import annotations

import fcntl
import os
import time

import msgpack
import pytest

from mooncake_ray._private import rpc
from mooncake_ray._private.master.fastpath import COMMIT, COMMIT_RINGED, HELD
from mooncake_ray._private.native import _native
from mooncake_ray._private.store.ring import CommitRing


def index_with_slab(node="n0", inc="i0", pieces=((0, 1 << 30),)):
    ix = _native.MasterIndex()
    ix.set_enabled(True)
    ix.set_commits(True)
    ix.set_next_gen(1 << 62)
    ix.set_slab(1, "c1", node, "ray0", inc, list(pieces))
    return ix


def commit(ix, items, hold=True):
    req = [rpc.PUT_COMMIT, [[k, 1, off, size, False, parent] for k, off, size, parent in items], "c1"]
    got = ix.serve(msgpack.packb(req, use_bin_type=True), hold)
    return got if not got else msgpack.unpackb(got)


def attach(ix, master_view, epoch, node="n0", inc="i0"):
    ix.set_ring(node, inc, master_view.addr, master_view.nbytes, master_view.fd, epoch)


def attached(tmp_path):
    """A node's ring, the master's mapping of it, and an index writing there."""
    path = str(tmp_path / "ring0")
    node, _ = CommitRing.create(path, 64 + 4096)
    master = CommitRing.open(path)
    ix = index_with_slab()
    attach(ix, master, node.new_epoch())
    return node, master, ix


def test_a_commit_is_answered_through_the_ring_of_a_live_node(tmp_path):
    path = str(tmp_path / "ring0")
    node, left = CommitRing.create(path, 64 + 4096)
    assert left == []
    master = CommitRing.open(path)
    ix = index_with_slab()
    epoch = node.new_epoch()
    attach(ix, master, epoch)
    rep = commit(ix, [("a", 0, 100, ""), ("b", 4096, 5000, "a")])
    assert rep[0] == rpc.OK and len(rep[1]) == 2  # answered, not held
    assert not ix.wait_held(0.0)  # nothing for the master's applier to hurry for
    assert ix.ring_acks() == 2
    got = node.read()
    # the native index's commits: no message of the master will add them ("alone")
    assert got == [("a", rep[1][0], 100, 0, 128, "", False, 1, None, True),
                   ("b", rep[1][1], 5000, 4096, 8192, "a", False, 1, None, True)]
    assert node.read() == []
    log = ix.drain()[2]
    assert [e[0] for e in log] == [COMMIT_RINGED, COMMIT_RINGED]  # applied by Python, no message to the node, no HELD
    master.close()
    node.close()


def test_without_the_nodes_lock_or_with_another_epoch_the_reply_is_held(tmp_path):
    path = str(tmp_path / "ring0")
    node, _ = CommitRing.create(path, 64 + 4096)
    master = CommitRing.open(path)
    ix = index_with_slab()
    epoch = node.new_epoch()
    attach(ix, master, epoch)
    node.new_epoch()  # the node mounted again: the master's epoch is stale
    assert commit(ix, [("a", 0, 100, "")]) == b""
    assert node.read() == []  # nothing written under a stale epoch
    attach(ix, master, node.epoch)
    fcntl.flock(node.fd, fcntl.LOCK_UN)  # as if the node's process were gone
    assert commit(ix, [("b", 4096, 100, "")]) == b""  # held for the node's answer
    assert [r[0] for r in node.read()] == ["b"]  # (its record may still be read by a restart)
    assert ix.wait_held(0.0)  # the master's applier must not wait: replies are kept
    assert ix.ring_acks() == 0 and [e[0] for e in ix.drain()[2]] == [COMMIT, HELD, COMMIT, HELD]
    t0 = time.monotonic()
    assert not ix.wait_held(0.05) and time.monotonic() - t0 >= 0.04  # drained: nothing kept
    ix.set_slab(2, "c1", "n0", "ray0", "i1", [(1 << 20, 4096)])  # another incarnation's slab
    fcntl.flock(node.fd, fcntl.LOCK_EX)
    req = [rpc.PUT_COMMIT, [["c", 2, 1 << 20, 100]], "c1"]
    assert ix.serve(msgpack.packb(req, use_bin_type=True), True) == b""
    master.close()
    node.close()


def test_records_wrap_in_order_and_a_full_ring_holds_the_reply(tmp_path):
    node, master, ix = attached(tmp_path)
    seen, i = [], 0
    for rnd in range(40):  # about 1 MB of records through 4 KiB: many wraps
        batch = [(f"k{i + j}-{'x' * (rnd % 13)}", 4096 * (i + j), 64, f"p{i + j}") for j in range(7)]
        i += 7
        rep = commit(ix, batch)
        assert rep and rep[0] == rpc.OK, rnd
        seen += node.read()
    assert [r[0] for r in seen] == [f"k{j}-{'x' * (j // 7 % 13)}" for j in range(i)]
    assert [r[5] for r in seen] == [f"p{j}" for j in range(i)]
    # unread, the ring fills: the commit that does not fit is held, not written
    filled = 0
    while True:
        rep = commit(ix, [(f"f{filled}", 4096 * (i + filled), 64, "")])
        if rep == b"":
            break
        filled += 1
    assert 20 < filled < 4096 // 56
    assert [r[0] for r in node.read()] == [f"f{j}" for j in range(filled)]
    master.close()
    node.close()


def test_a_new_process_of_the_node_reads_what_the_previous_one_left(tmp_path):
    node, master, ix = attached(tmp_path)
    path = node.path
    assert commit(ix, [("a", 0, 100, ""), ("b", 4096, 100, "")])[0] == rpc.OK
    node.close()  # the process exits: its lock goes with it
    again, left = CommitRing.create(path, 64 + 4096)
    assert [r[0] for r in left] == ["a", "b"]
    assert again.epoch == 0 and not again.pending()
    assert commit(ix, [("c", 8192, 100, "")]) == b""  # the old epoch: not through the ring
    assert again.read() == []
    master.close()
    again.close()
    os.unlink(path)


def test_a_node_process_that_is_exiting_or_gone_is_not_answered_through_its_ring(tmp_path):
    """Its lock may outlive a SIGKILL by milliseconds (the exit unmaps the arena first): the
    master also reads the process's /proc entry. A zombie, and a reaped process, are gone."""
    import signal
    import subprocess
    import time

    path = str(tmp_path / "ring0")
    node, _ = CommitRing.create(path, 64 + 4096)
    master = CommitRing.open(path)
    child = subprocess.Popen(["sleep", "60"])
    master.proc_fd = os.open(f"/proc/{child.pid}/task/{child.pid}/stat", os.O_RDONLY)  # as the master opens it
    ix = index_with_slab()
    ix.set_ring("n0", "i0", master.addr, master.nbytes, master.fd, node.new_epoch(), master.proc_fd)
    assert commit(ix, [("a", 0, 100, "")])[0] == rpc.OK  # alive
    os.kill(child.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while open(f"/proc/{child.pid}/stat").read().split(") ")[1][0] != "Z":  # exited, not reaped
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert commit(ix, [("b", 4096, 100, "")]) == b""
    child.wait()
    assert commit(ix, [("c", 8192, 100, "")]) == b""
    assert ix.ring_acks() == 1
    master.close()
    node.close()


def test_pythons_commits_and_reservations_go_through_the_ring_all_or_nothing(tmp_path):
    paths = [str(tmp_path / f"ring{i}") for i in range(2)]
    nodes = [CommitRing.create(p, 64 + 4096)[0] for p in paths]
    masters = [CommitRing.open(p) for p in paths]
    ix = index_with_slab()
    for i, (n, m) in enumerate(zip(nodes, masters)):
        ix.set_ring(f"n{i}", f"i{i}", m.addr, m.nbytes, m.fd, n.new_epoch())
    # a value put with replicas=2: each record says so (a restarted master finds it short)
    recs = [("n0", "i0", False, "v", 7, 100, 4096, 4096, "p", 2), ("n1", "i1", False, "v", 7, 100, 0, 4096, "p", 2),
            ("n1", "i1", True, "put/8", 8, 8192, 8192, 8192, "")]
    assert ix.ring_publish(recs)
    assert nodes[0].read() == [("v", 7, 100, 4096, 4096, "p", False, 2, None, False)]
    assert nodes[1].read() == [("v", 7, 100, 0, 4096, "p", False, 2, None, False),
                               ("put/8", 8, 8192, 8192, 8192, "", True, 1, None, False)]
    with pytest.raises(ValueError, match="want is not in 1..255"):
        ix.ring_publish([("n0", "i0", False, "w", 9, 1, 0, 64, "", 0)])
    # one record for a node without a usable ring (another incarnation): none is written
    assert not ix.ring_publish([("n0", "i0", False, "w", 9, 1, 0, 64, ""), ("n1", "old", False, "w", 9, 1, 0, 64, "")])
    assert nodes[0].read() == [] and nodes[1].read() == []
    assert ix.ring_acks() == 3
    for r in masters + nodes:
        r.close()


def test_a_commit_carries_the_clients_checksum_into_the_ring(tmp_path):
    """A PUT_COMMIT item's seventh field (the CRC-32C the client took in its copy) goes into
    the value's ring record, so the node journals it without reading the value; None or
    an absent field: no checksum. A checksum that is not a u32 is not the native side's to
    answer (Python refuses it with a typed error). The PyIndex reference takes the same."""
    node, master, ix = attached(tmp_path)
    req = [rpc.PUT_COMMIT, [["a", 1, 0, 100, False, "", 0xDEADBEEF], ["b", 1, 4096, 5000, False, "a", 0],
                            ["c", 1, 16384, 10, False, "", None], ["d", 1, 20480, 10, False]], "c1"]
    rep = msgpack.unpackb(ix.serve(msgpack.packb(req, use_bin_type=True), True))
    assert rep[0] == rpc.OK and len(rep[1]) == 4
    got = node.read()
    assert [(r[0], r[5], r[8]) for r in got] == [("a", "", 0xDEADBEEF), ("b", "a", 0), ("c", "", None), ("d", "", None)]
    for bad in (1 << 32, -1, "x", 1.5):
        req = [rpc.PUT_COMMIT, [["e", 1, 24576, 10, False, "", bad]], "c1"]
        assert ix.serve(msgpack.packb(req, use_bin_type=True), True) is None, bad
    assert node.read() == []
    # Python's commits (PUT_END) carry it the same way
    assert ix.ring_publish([("n0", "i0", False, "f", 9, 10, 0, 64, "", 1, 7), ("n0", "i0", False, "g", 9, 10, 64, 64, "", 1, None)])
    assert [(r[0], r[8]) for r in node.read()] == [("f", 7), ("g", None)]
    with pytest.raises(ValueError, match="crc is not a u32"):
        ix.ring_publish([("n0", "i0", False, "h", 9, 10, 0, 64, "", 1, 1 << 32)])

    from mooncake_ray._private.master.pyindex import PyIndex

    py = PyIndex()
    py.set_enabled(True)
    py.set_commits(True)
    py.set_next_gen(1 << 62)
    py.set_slab(1, "c1", "n0", "ray0", "i0", [(0, 1 << 30)])
    req = [rpc.PUT_COMMIT, [["a", 1, 0, 100, False, "", 0xDEADBEEF], ["c", 1, 16384, 10, False, "", None]], "c1"]
    assert msgpack.unpackb(py.serve(msgpack.packb(req, use_bin_type=True)))[0] == rpc.OK
    for bad in (1 << 32, -1, "x"):
        req = [rpc.PUT_COMMIT, [["e", 1, 24576, 10, False, "", bad]], "c1"]
        assert py.serve(msgpack.packb(req, use_bin_type=True)) is None, bad
    master.close()
    node.close()


def test_a_ring_is_sized_by_its_arena_and_an_existing_one_keeps_its_size(tmp_path):
    """1/64 of the arena, 4-64 MiB; a ring left by a previous process (a master may still
    map it, its records wrap at its size) is read at its own size, never resized."""
    from mooncake_ray._private.store.ring import DEFAULT_BYTES, MAX_BYTES, ring_bytes

    assert ring_bytes(64 << 20) == DEFAULT_BYTES and ring_bytes(2 << 30) == 32 << 20
    assert ring_bytes(1 << 40) == MAX_BYTES
    node, master, ix = attached(tmp_path)  # 64 + 4096 bytes
    assert commit(ix, [("a", 0, 100, "")])[0] == rpc.OK
    path = node.path
    node.close()  # the process is gone, its record unread
    again, left = CommitRing.create(path, 64 + 8192)
    assert again.nbytes == 64 + 4096 and [r[0] for r in left] == ["a"]
    again.close()
    master.close()


def test_the_nodes_native_read_applies_and_journals_what_the_ring_holds(tmp_path):
    """``NodeTable.read_ring`` (the store node's read of its ring: no Python object per
    record) against the reference decoder ``CommitRing.read``, across wraps: the same
    records applied, checksums taken by the writer kept and the others taken from the
    arena, one journal batch per read that a restarted node replays to the same table,
    the commits a message will add too handed back, and the ring's tail left for the
    caller to move."""
    import ctypes
    import random

    rng = random.Random(7)
    buf = (ctypes.c_char * (1 << 20)).from_buffer_copy(rng.randbytes(1 << 20))  # the arena
    base = ctypes.addressof(buf)

    def crc(off, size):
        return _native.spill_crc32c(base + off, size, 0) if size else 0

    node, master, ix = attached(tmp_path)
    table = _native.NodeTable()
    jpath = str(tmp_path / "journal")
    fd = os.open(jpath, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    want_entries, told_all, at = {}, [], 0

    def place(size):  # a fresh extent of whole 64-byte granules
        nonlocal at
        off, at = at, at + max(64, (size + 63) // 64 * 64)
        return off

    for rnd in range(60):
        items, pub = [], []
        for j in range(rng.randrange(1, 6)):
            k = f"k{rnd}-{j}" + "z" * rng.randrange(0, 30)
            size = rng.randrange(1, 2000)
            off = place(size)
            given = rng.choice([None, rng.randrange(1 << 32)])
            items.append([k, 1, off, size, False, rng.choice(["", "p"]), given])
        req = [rpc.PUT_COMMIT, items, "c1"]
        rep = msgpack.unpackb(ix.serve(msgpack.packb(req, use_bin_type=True), True))
        assert rep[0] == rpc.OK
        if rnd % 3 == 0:  # Python's commits: copies wanted, a reservation, not alone
            off = place(300)
            pub = [("n0", "i0", False, f"py{rnd}", 5, 300, off, 320, "", 2, rng.choice([None, 99])),
                   ("n0", "i0", True, f"res{rnd}", 6, 256, place(256), 256, "")]
            assert ix.ring_publish(pub)
        tail0 = node._words[3]
        records, given_n, summed, tail, told = table.read_ring(node.addr, node.nbytes, base, 1 << 20, fd)
        assert node._words[3] == tail0  # not moved: the caller commits once it has journaled
        ref = node.read()  # the reference decoder, which moves the tail itself
        assert tail == node._words[3] and records == len(ref)
        for key, gen, size, offset, length, parent, reserved, want, c, alone in ref:
            tier = "reserved" if reserved else "dram"
            assert table.get(key, tier) == (key, gen, size, tier, offset, length, 0, parent, want)
            if not reserved:
                assert table.crc_of(key, gen, offset) == (c if c is not None else crc(offset, size))
                want_entries[key] = (key, gen, size, "dram", offset, length, 0, parent, want)
                if not alone:
                    told_all.append((key, gen, offset, parent, want))
        assert given_n == sum(1 for r in ref if not r[6] and r[8] is not None)
        assert summed == sum(1 for r in ref if not r[6] and r[8] is None)
    assert told_all and [t[0] for t in told_all] == [f"py{r}" for r in range(0, 60, 3)]
    os.close(fd)
    again = _native.NodeTable()
    with open(jpath, "rb") as f:
        ops, skipped = again.replay(f.read())
    assert (ops, skipped) == (len(want_entries), 0)
    assert {e[0]: e for e in again.entries()} == want_entries
    for key, e in want_entries.items():
        assert again.crc_of(key, e[1], e[4]) == table.crc_of(key, e[1], e[4])
    # a record that does not parse: nothing applied, a typed error
    node._words[3] = node._words[2] = 0
    ctypes.memmove(node.addr + 64, (ctypes.c_uint32 * 2)(12, 1), 8)
    node._words[2] = 16
    n = len(table)
    with pytest.raises(ValueError, match="bad record length 12"):
        table.read_ring(node.addr, node.nbytes, base, 1 << 20, -1)
    assert len(table) == n
    master.close()
    node.close()


def test_the_applier_is_woken_by_the_first_commit_after_a_drain_and_by_a_held_reply(tmp_path):
    """Only these wake the master's applier (a commit into a log it has not drained yet
    wakes nobody: it is gathering them): each must reach a thread already waiting."""
    import threading

    node, master, ix = attached(tmp_path)

    def waited(wait, act):
        out = {}
        t = threading.Thread(target=lambda: out.update(ok=wait(10.0), at=time.monotonic()))
        t.start()
        time.sleep(0.1)  # the thread is waiting
        t0 = time.monotonic()
        act()
        t.join(12.0)
        return out["ok"], out["at"] - t0

    ok, took = waited(ix.wait_commits, lambda: commit(ix, [("a", 0, 100, "")]))
    assert ok and took < 2.0
    commit(ix, [("b", 4096, 100, "")])  # the log not drained: the applier is gathering
    fcntl.flock(node.fd, fcntl.LOCK_UN)  # as if the node's process were gone: the reply is held
    ok, took = waited(ix.wait_held, lambda: commit(ix, [("c", 8192, 100, "")]))
    assert ok and took < 2.0
    ix.drain()
    fcntl.flock(node.fd, fcntl.LOCK_EX)
    ok, took = waited(ix.wait_commits, lambda: commit(ix, [("d", 12288, 100, "")]))
    assert ok and took < 2.0
    master.close()
    node.close()
