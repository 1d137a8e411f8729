"""A store node's arena kept in named shared memory, so that it outlives the process.

With ``elastic.keep_arena`` (the default) the arena is a file in ``elastic.arena_dir``
(``/dev/shm``: memory, not disk), mapped shared and registered with the transport. When
the store node's process dies (a crash, an upgrade) and Ray restarts it on the same host,
the new process maps the same file: the bytes are still there. Beside it, the node keeps
an index of the values in it, each with a CRC32C of its bytes: a journal it appends to as
it applies the master's messages (before it answers them, so every acknowledged put is in
it), compacted now and then into a snapshot. A restarted node re-adopts an entry only if its checksum
still matches the arena's bytes (a torn or overwritten value is a miss, never wrong
bytes); the master then takes it back only if the value is the one it lost with the node
(same key and generation, ``MasterState.mount``).

Clients on the same host map the file themselves (UCX maps only memory it allocated
itself), so reads and writes stay plain memory copies.

Files of a Ray node that is gone (its raylet no longer runs) are removed by the next store
node that starts on the host; ``mooncake-ray stop`` removes a store's own.
"""

from __future__ import annotations

import ctypes
import glob
import json
import logging
import mmap
import os
import shutil
import struct
import time
import zlib

from mooncake_ray.errors import ConfigError

log = logging.getLogger(__name__)

PREFIX = "mooncake-ray."
_MADV_POPULATE_WRITE = 23
_INDEX_MAGIC = b"MCRIDX1\n"  # a snapshot as one JSON list of entries (read, no longer written)
_INDEX_MAGIC2 = b"MCRIDX2\n"  # columns, keys as JSON (read, no longer written)
_INDEX_MAGIC3 = b"MCRIDX3\n"  # binary records: NodeTable.snapshot
_HEAD2 = struct.Struct("<QQQ")  # entries, bytes of the keys' JSON, bytes of the parents' JSON
UNREADABLE_OWNER_S = 60.0  # an owner file that does not parse is judged only when this old


def boot_id() -> str:
    """This host's boot id: two processes share a file in shared memory only if equal."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _name(namespace: str, node_id: str) -> str:
    tag = f"{zlib.crc32(namespace.encode()):08x}"
    return f"{PREFIX}{tag}.{node_id[:24]}"


def pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _raylet_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"raylet" in f.read()
    except OSError:
        return False


def collect_garbage(directory: str) -> int:
    """Remove arena files whose Ray node is gone (its raylet process no longer runs).
    Only files made on this host in this PID namespace are judged (a process id means
    nothing elsewhere). Returns how many arenas were removed."""
    n = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not (name.startswith(PREFIX) and name.endswith(".owner")):
            continue
        stem = os.path.join(directory, name[: -len(".owner")])
        try:
            with open(stem + ".owner") as f:
                owner = json.load(f)
        except FileNotFoundError:
            continue  # removed meanwhile
        except (OSError, ValueError):
            # Owner files are written whole (``_write_owner``), so one that does not parse
            # was torn by a crash or an older version: removed once it is old, never while
            # it may still be a live node's.
            try:
                if time.time() - os.stat(stem + ".owner").st_mtime < UNREADABLE_OWNER_S:
                    continue
            except OSError:
                continue
            owner = {}
        if owner and (owner.get("boot_id") != boot_id() or owner.get("pid_ns", "") != pid_namespace()):
            continue  # another host's or container's: not ours to judge
        if owner and _raylet_alive(int(owner.get("raylet_pid", 0))):
            continue
        remove_files(stem)
        n += 1
    return n


def _write_owner(stem: str, owner: dict) -> None:
    """``<stem>.owner``, whole or not at all: another store node starting on the host may
    read it at any moment (``collect_garbage``), and a file caught between its creation and
    its write would read as unreadable."""
    tmp = stem + ".owner.tmp"
    with open(tmp, "w") as f:
        json.dump(owner, f)
    os.replace(tmp, stem + ".owner")


def remove_files(stem: str) -> None:
    rings = glob.glob(glob.escape(stem) + ".ring[0-9]*")  # commit rings, one per master shard
    for path in [stem + ext for ext in (".arena", ".index", ".bjournal", ".bjournal.old", ".journal", ".journal.old",
                                        ".owner", ".owner.tmp", ".index.tmp")] + rings:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _parse_json(body) -> list:
    return json.loads(bytes(body))


def _split_columns(body) -> tuple[list, list, object]:
    """An ``MCRIDX2`` snapshot's columns: ``(keys, parents, rows)``, rows a read-only n x 7
    int64 array (gen, size, offset, length, pin, crc, copies wanted)."""
    import numpy as np

    n, nk, np_ = _HEAD2.unpack_from(body)
    at = _HEAD2.size
    keys = json.loads(bytes(body[at:at + nk]))
    parents = json.loads(bytes(body[at + nk:at + nk + np_]))
    if len(keys) != n or len(parents) != n or len(body) != at + nk + np_ + 56 * n:
        raise ValueError(f"{n} entries, {len(keys)} keys, {len(parents)} parents, {len(body)} bytes")
    return keys, parents, np.frombuffer(body, dtype="<i8", count=7 * n, offset=at + nk + np_).reshape(n, 7)


def _entry_of(e) -> tuple | None:
    """A JSON journal add or an ``MCRIDX1`` entry ``[key, gen, size, offset, length, pin,
    parent, crc (None: none), want?]`` as a node table entry and its crc; None if malformed."""
    if not (isinstance(e, (list, tuple)) and 8 <= len(e) <= 9 and type(e[0]) is str and type(e[6]) is str):
        return None
    want = e[8] if len(e) > 8 else 1
    if not (all(type(x) is int for x in (e[1], e[2], e[3], e[4], e[5], want)) and 0 <= e[1] < 1 << 63
            and all(0 <= x < 1 << 48 for x in (e[2], e[3], e[4])) and 0 <= e[5] < 1 << 63 and 1 <= want < 1 << 32
            and (e[7] is None or type(e[7]) is int and 0 <= e[7] < 1 << 32)):
        return None  # generations are wall-clock nanoseconds: past 48 bits
    return (e[0], e[1], e[2], "dram", e[3], e[4], e[5], e[6], want), e[7]


class ArenaFile:
    """The arena of one store node, mapped from ``<arena_dir>/mooncake-ray.<ns>.<node>.arena``.

    ``reused`` tells whether the file existed with this size (a restart: its bytes and
    index are the previous process's). Raises ``ConfigError`` when the directory lacks
    room for a new arena."""

    def __init__(self, directory: str, namespace: str, node_id: str, size: int, prefault: bool = True):
        self.stem = os.path.join(directory, _name(namespace, node_id))
        self.path = self.stem + ".arena"
        self.index_path = self.stem + ".index"
        self.journal_path = self.stem + ".bjournal"  # binary batches (NodeTable.replay)
        self.legacy_journal_path = self.stem + ".journal"  # an earlier version's JSON lines
        try:
            old = os.stat(self.path).st_size
        except FileNotFoundError:
            old = -1
        self.reused = old == size and os.path.exists(self.index_path)
        if not self.reused:
            free = shutil.disk_usage(directory).free + max(old, 0)
            if free < size:
                raise ConfigError(f"elastic.arena_dir={directory!r} has {free} bytes free, less than "
                                  f"segment_size_bytes={size}: give it room or set elastic.keep_arena=false")
            # A new file (a new inode), never the old one truncated: a client may still map
            # the old one, and pages cut from under a mapping fault on access.
            remove_files(self.stem)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if not self.reused:
                os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            st = os.fstat(fd)
        finally:
            os.close(fd)
        from mooncake_ray._private.native import _native

        self._crc, self._crc_many = _native.spill_crc32c, _native.spill_crc32c_many
        self._write_batch = _native.journal_write
        self.file_id = [st.st_dev, st.st_ino]
        self.length = size
        self._anchor = ctypes.c_char.from_buffer(self._mm)
        self.addr = ctypes.addressof(self._anchor)
        try:  # huge pages where the tmpfs allows them (mounted huge=advise, or shmem_enabled)
            self._mm.madvise(mmap.MADV_HUGEPAGE)
        except (OSError, AttributeError):
            pass
        if prefault:
            try:
                self._mm.madvise(_MADV_POPULATE_WRITE)  # allocate and map every page now
            except OSError:  # kernels before 5.14: touch one byte per page
                view = memoryview(self._mm)
                for off in range(0, size, mmap.PAGESIZE):
                    view[off] = view[off]
                view.release()
        _write_owner(self.stem, {"namespace": namespace, "node_id": node_id, "raylet_pid": os.getppid(),
                                 "boot_id": boot_id(), "pid_ns": pid_namespace(), "size": size})
        if not self.reused:
            self.save_index([])
        self._jfd = os.open(self.journal_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def checksum(self, offset: int, size: int) -> int:
        """CRC32C of ``size`` bytes at ``offset`` of the arena (hardware, GIL released)."""
        return self._crc(self.addr + offset, size, 0) if size else 0

    def _snapshot(self) -> tuple[bytes, bytes] | None:
        """The snapshot's format magic and its whole contents, if it has a known magic."""
        try:
            with open(self.index_path, "rb") as f:
                data = f.read()
        except OSError:
            return None
        for magic in (_INDEX_MAGIC3, _INDEX_MAGIC2, _INDEX_MAGIC):
            if data.startswith(magic):
                return magic, data
        return None

    def load_into(self, table, extra=()) -> list:
        """Rebuild, into the node table ``table`` (``_native.NodeTable``), the DRAM entries the
        previous process left: its snapshot, its journals (an earlier version's JSON lines,
        then the binary batches, each rotated one first), then ``extra`` (records to apply
        last: a ring's unread ones, ``(key, gen, size, offset, length, pin, parent, crc or
        None, want)``). A corrupt snapshot is ignored (logged), a torn or corrupt journal
        batch or line skipped. Returns ``[key, gen]`` of journal records that do not parse.
        The checksums are not checked here (``NodeTable.verify``)."""
        bad: list = []
        snap = self._snapshot()
        if snap is not None:
            magic, data = snap
            try:
                if magic == _INDEX_MAGIC3:
                    table.load_snapshot(data)
                else:
                    body, (crc,) = memoryview(data)[len(magic):-4], struct.unpack("<I", data[-4:])
                    if zlib.crc32(body) != crc:
                        raise ValueError("its checksum does not match")
                    if magic == _INDEX_MAGIC2:
                        keys, parents, rows = _split_columns(body)
                        table.load_rows(keys, parents, rows.tobytes())
                    else:
                        self._apply_json(table, [(_parse_json(body), [])], bad)
            except (ValueError, struct.error) as e:
                log.warning("arena index %s is corrupt or does not parse (%s): ignored", self.index_path, e)
                table.clear()
                bad = []
        self._apply_json(table, self._json_journal_ops(), bad)
        for path in (self.journal_path + ".old", self.journal_path):
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            _ops, skipped = table.replay(data)
            if skipped:
                log.warning("arena journal %s: %d corrupt batch(es) skipped", path, skipped)
        if extra:
            self._apply_json(table, [(list(extra), [])], bad)
        return bad

    @staticmethod
    def _apply_json(table, ops, bad: list) -> None:
        for adds, drops in ops:
            for key, gen in drops:
                table.erase(key, "dram", gen)
            for e in adds:
                got = _entry_of(e)
                if got is None:
                    if isinstance(e, (list, tuple)) and len(e) > 1 and type(e[0]) is str:
                        bad.append([e[0], e[1]])
                    continue
                entry, crc = got
                table.set(entry)
                if crc is not None:
                    table.set_crc(entry[0], entry[1], entry[4], crc)
        table.forget_sums()

    def _json_journal_ops(self) -> list[tuple[list, list]]:
        """An earlier version's journal (``.journal``: JSON lines ``<crc32 hex> [adds,
        drops]``), rotated one first; a torn or corrupt line is skipped. Read after an
        upgrade, removed with the next snapshot."""
        lines = []
        for path in (self.legacy_journal_path + ".old", self.legacy_journal_path):
            try:
                with open(path, "rb") as f:
                    lines += f.read().split(b"\n")
            except OSError:
                pass
        ops = []
        for line in lines:
            try:
                if len(line) < 10 or int(line[:8], 16) != zlib.crc32(line[9:]):
                    continue
                adds, drops = json.loads(line[9:])
            except ValueError:
                continue
            ops.append((adds, [d for d in drops if isinstance(d, list) and len(d) == 2 and type(d[1]) is int
                               and type(d[0]) is str and d[1] >= 0]))
        return ops

    def load_index(self) -> list[tuple]:
        """The entries the previous process saved (``load_into``), as ``(key, gen, size,
        offset, length, pin, parent, crc, want)``, crc None where none was saved."""
        from mooncake_ray._private.native import _native

        table = _native.NodeTable()
        self.load_into(table)
        keys, parents, rows = table.dram_rows()
        n = len(keys)
        flat = struct.unpack(f"<{7 * n}q", rows)
        return [(k, *flat[7 * i:7 * i + 5], p, None if flat[7 * i + 5] < 0 else flat[7 * i + 5], flat[7 * i + 6])
                for i, (k, p) in enumerate(zip(keys, parents))]

    def checksums(self, offsets, sizes):
        """CRC32C of many ranges of the arena at once (int64 arrays; GIL released): a
        uint32 array."""
        import numpy as np

        out = self._crc_many(self.addr, self.length, np.ascontiguousarray(offsets, dtype="<i8").tobytes(),
                                        np.ascontiguousarray(sizes, dtype="<i8").tobytes())
        return np.frombuffer(out, dtype="<u4")

    def journal(self, adds: list, drops: list) -> None:
        """Append what one inventory message changed, as one batch (``_native.journal_write``:
        length, CRC-32C, binary records): ``drops`` as ``[key, gen]`` (entries of gen <= gen
        go), then ``adds`` as ``[key, gen, size, offset, length, pin, parent, crc, want?]``."""
        self._write_batch(self._jfd, adds, drops)

    @property
    def journal_fd(self) -> int:
        """The journal's file descriptor, open for appending (it changes at each rotation)."""
        return self._jfd

    def journal_bytes(self) -> int:
        return os.fstat(self._jfd).st_size

    def rotate_journal(self) -> None:
        """Start a new journal; the current one is kept (``.bjournal.old``, joined to one
        still there) until the next snapshot is written: the state at this point, taken by
        the caller, who holds off appends meanwhile."""
        os.close(self._jfd)
        old = self.journal_path + ".old"
        if os.path.exists(old):  # an earlier snapshot was never written: keep both
            with open(self.journal_path, "rb") as src, open(old, "ab") as dst:
                dst.write(src.read())
            os.unlink(self.journal_path)
        elif os.path.exists(self.journal_path):
            os.replace(self.journal_path, old)
        self._jfd = os.open(self.journal_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def save_index(self, entries: list) -> int:
        """Replace the snapshot with ``entries`` (as ``load_index`` returns them; crc None:
        left out); ``save_snapshot`` with them in a node table."""
        from mooncake_ray._private.native import _native

        table = _native.NodeTable()
        self._apply_json(table, [([list(e) for e in entries], [])], [])
        return self.save_snapshot(table.snapshot()[1])

    def save_snapshot(self, data: bytes) -> int:
        """Replace the snapshot with ``data`` (``NodeTable.snapshot``'s, or ``join_snapshots``'
        of several), atomically; the journals it covers go (the rotated one, and an earlier
        version's). Returns its size in bytes."""
        tmp = self.index_path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, self.index_path)
        for path in (self.journal_path + ".old", self.legacy_journal_path, self.legacy_journal_path + ".old"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        return len(data)

    def remove(self) -> None:
        """Delete the files (the mapping stays valid until the process ends)."""
        remove_files(self.stem)


def local_mapping(info: dict, protocol: str) -> tuple[str, int]:
    """``(map_path, map_offset)`` for ``Engine.import_remote`` of a store node's arena
    (``info``: the master's public view of the node) by an engine speaking ``protocol``:
    the arena's file, when it is one in shared memory on this very host (same boot id,
    same device and inode) and the engine may use shared memory; else ``("", 0)``."""
    path = info.get("arena_file") or ""
    if not path or protocol not in ("auto", "shm") or info.get("boot_id") != boot_id():
        return "", 0
    try:
        st = os.stat(path)
    except OSError:
        return "", 0
    return (path, 0) if [st.st_dev, st.st_ino] == list(info.get("arena_file_id") or []) else ("", 0)
