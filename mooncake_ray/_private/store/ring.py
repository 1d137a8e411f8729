"""A store node's commit ring: where the master records a put before it answers it.

With durable acknowledgements a put is answered only once a restarted master, or the
node restarted with its kept arena, would still find the value. Without a ring that
means a round trip to the node (the master's inventory message, the node's Python
handler, its answer: about 0.5 ms on a busy host). With one, the master's native commit
path writes the value's record into this file in shared memory, which both processes map,
and answers at once: no message, no thread of the node, no Python on either side.

The file (``<arena stem>.ring<shard>``, beside the kept arena) is a single-producer,
single-consumer ring (layout: ``CommitRing`` in ``native/include/mcr/master_index.h``):

- The master (one shard's) writes records and then publishes them by moving ``head``.
  It writes only while the header shows the epoch (drawn by the node at each mount) it was given at
  the mount, and answers through the ring only while the node holds an exclusive flock
  on the file: a node that is gone holds none, and the reply waits for the node instead
  (so a replica is never acknowledged through the ring of a dead process).
- The node reads every published record before it applies any message of the master
  (a later message that drops or replaces the value then applies after it), when it
  mounts (the records go to the new master with its inventory), and when it restarts
  with its kept arena (the previous process's records are re-adopted like its journal's).

Memory ordering: the master publishes ``head`` with a release store after the record's
bytes; the node reads ``head`` and then the records. Reads here are plain loads of
aligned 8-byte words, which x86-64 and AArch64 perform whole; the acquire side relies on
x86-64's ordering of loads (the store nodes this runs on). Only hosts where the master
and the node share ``/dev/shm`` (the same boot id) use a ring; a node on another host is
answered the round-trip way.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import struct

MAGIC = 0x31474E4952524D43  # "MCRRING1"
HEADER = 64
COMMIT, PAD, RESERVED = 1, 2, 3
HAS_CRC = 1 << 16  # kind flag: the record carries the value's CRC-32C after its parent
ALONE = 1 << 17  # kind flag: no message of the master will add the value (the native index's commits)
DEFAULT_BYTES = 4 << 20
MAX_BYTES = 64 << 20


def ring_bytes(arena_bytes: int) -> int:
    """The size of a ring for ``arena_bytes`` of arena (a master shard's part of a node's
    arena: each shard has its own ring): 1/64 of it, 4-64 MiB. A record of a small value
    takes about 80 bytes, so a 2 GB arena's 32 MiB ring holds about 400,000 commits: seconds
    of a put stream the node is slow to read (a snapshot being built holds its GIL). A full
    ring sends commits back to waiting for the node's answer: a 4 MiB ring filled twice in a
    million 256-byte puts into 2 GB, and each time the client waited."""
    return max(DEFAULT_BYTES, min(MAX_BYTES, arena_bytes // 64 // 4096 * 4096))


_REC = struct.Struct("<IIQQQQII")  # length, kind, gen, size, offset, length, key bytes, parent bytes
_CRC = struct.Struct("<I")  # after the key and the parent, with HAS_CRC


class CommitRing:
    """One ring file, mapped. The node creates it (``create``) and holds its lock; the
    master opens it (``open``) to write through the native index."""

    def __init__(self, path: str, fd: int, mm: mmap.mmap) -> None:
        self.path = path
        self.fd = fd
        self.proc_fd = -1  # the master's: the node process's /proc/<pid>/stat (closed with the ring)
        self._mm = mm
        self.nbytes = len(mm)
        self._words = (ctypes.c_uint64 * (HEADER // 8)).from_buffer(mm)
        self.addr = ctypes.addressof(self._words)

    @classmethod
    def create(cls, path: str, nbytes: int = DEFAULT_BYTES) -> tuple["CommitRing", list[tuple]]:
        """The node's ring at ``path``, locked by this process for its life. Returns it and
        the records a previous process of the node left unread (``read``'s tuples). Waits
        until no other process holds the file (a previous process of this node still
        exiting). An existing ring is never truncated, resized or reset (a master may still
        map it and be writing): it is read to its head, and its epoch cleared, so that no
        master writes there until this process mounts. ``nbytes`` sizes a new one (a new
        arena file removes its node's old rings)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            left: list[tuple] = []
            size = os.fstat(fd).st_size
            if size >= HEADER + 4096 and size % 8 == 0:
                nbytes = size  # an existing ring keeps its size (a master may map it; its records wrap at it)
            else:
                os.ftruncate(fd, nbytes)
            ring = cls(path, fd, mmap.mmap(fd, nbytes))
            ring._words[1] = 0
            if ring._words[0] == MAGIC:
                try:
                    left = ring.read()
                except ValueError:  # garbage: start over past it
                    ring._words[3] = ring._words[2]
            else:
                ring._words[2] = ring._words[3] = 0
                ring._words[0] = MAGIC
            return ring, left
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def open(cls, path: str) -> "CommitRing":
        """The master's mapping of a node's ring (no lock taken)."""
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER + 4096 or size % 8:
                raise ValueError(f"{path} is not a commit ring ({size} bytes)")
            ring = cls(path, fd, mmap.mmap(fd, size))
        except BaseException:
            os.close(fd)
            raise
        if ring._words[0] != MAGIC:
            ring.close()
            raise ValueError(f"{path} is not a commit ring (bad magic)")
        return ring

    @property
    def epoch(self) -> int:
        return self._words[1]

    def new_epoch(self) -> int:
        """A new mount: a master given another epoch (an earlier mount's, an earlier
        process's) stops writing here. Call with every record read, under the node's lock;
        returns the epoch to give the master with the mount."""
        epoch = int.from_bytes(os.urandom(8), "little") | 1
        self._words[1] = epoch
        return epoch

    def pending(self) -> bool:
        return self._words[2] != self._words[3]

    def read(self) -> list[tuple]:
        """Every record published since the last read, in order, as
        ``(key, gen, size, offset, length, parent, reserved, want, crc, alone)``; they count
        as read. (A record's kind carries in bits 8-15 how many copies the put asked for; the
        index's own commits, of one copy, leave them 0. ``crc``: the CRC-32C of the value's
        bytes the writing client took in its copy, or None where it took none. ``alone``: no
        message of the master will add the value, the record is all the node gets.) A
        running node reads its ring with ``NodeTable.read_ring`` and ``commit`` instead."""
        w = self._words
        head, tail = w[2], w[3]
        if head == tail:
            return []
        cap = self.nbytes - HEADER
        if head - tail > cap:
            raise ValueError(f"commit ring {self.path}: head {head} is {head - tail} bytes past tail (of {cap})")
        mm, out = self._mm, []
        while tail < head:
            pos = HEADER + tail % cap
            n, kind = struct.unpack_from("<II", mm, pos)
            if n < 8 or n % 8 or n > cap:
                raise ValueError(f"commit ring {self.path}: bad record length {n} at {tail}")
            want, crc_in, alone, kind = (kind >> 8) & 0xFF or 1, kind & HAS_CRC, bool(kind & ALONE), kind & 0xFF
            if kind == COMMIT or kind == RESERVED:
                _n, _k, gen, size, offset, length, klen, plen = _REC.unpack_from(mm, pos)
                body = pos + _REC.size
                key = mm[body:body + klen].decode()
                parent = mm[body + klen:body + klen + plen].decode()
                crc = None
                if crc_in:
                    if _REC.size + klen + plen + 4 > n:
                        raise ValueError(f"commit ring {self.path}: record at {tail} too short for its checksum")
                    crc = _CRC.unpack_from(mm, body + klen + plen)[0]
                out.append((key, gen, size, offset, length, parent, kind == RESERVED, want, crc, alone))
            tail += n
        w[3] = tail
        return out

    def commit(self, tail: int) -> None:
        """Count the records before ``tail`` (a read position ``NodeTable.read_ring``
        returned) as read, once the caller has journaled them: the master may reuse their
        room from now on. A node killed before finds them again when it restarts."""
        self._words[3] = tail

    def close(self, keep_fd: bool = False) -> None:
        """Unmap (and close the file, releasing the lock, unless ``keep_fd``)."""
        del self._words
        try:
            self._mm.close()
        except BufferError:  # a view still exported: the mapping goes with the process
            pass
        if not keep_fd:
            os.close(self.fd)
        if self.proc_fd >= 0:
            os.close(self.proc_fd)
            self.proc_fd = -1
