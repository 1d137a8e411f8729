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
import itertools
import json
import logging
import mmap
import os
import shutil
import struct
import time
import zlib
from typing import NamedTuple

from mooncake_ray.errors import ConfigError

log = logging.getLogger(__name__)

PREFIX = "mooncake-ray."
_MADV_POPULATE_WRITE = 23
_INDEX_MAGIC = b"MCRIDX1\n"  # a snapshot as one JSON list of entries (read, no longer written)
_INDEX_MAGIC2 = b"MCRIDX2\n"  # columns: see save_index
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
    for path in [stem + ext for ext in (".arena", ".index", ".journal", ".journal.old", ".owner", ".owner.tmp", ".index.tmp")] + rings:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _parse_json(body) -> dict[str, tuple]:
    return {e[0]: tuple(e) for e in json.loads(bytes(body))}


class IndexColumns(NamedTuple):
    """A kept arena's index as columns (``ArenaFile.load_index_columns``): ``rows`` n x 7
    int64 (gen, size, offset, length, pin, crc or -1 for none, copies wanted); ``bad``:
    ``[key, gen]`` of journal records that do not parse."""

    keys: list
    parents: list
    rows: object
    bad: list


def _split_columns(body) -> tuple[list, list, object]:
    """``save_index``'s columns: ``(keys, parents, rows)``, rows a read-only n x 7 int64
    array (gen, size, offset, length, pin, crc, copies wanted)."""
    import numpy as np

    n, nk, np_ = _HEAD2.unpack_from(body)
    at = _HEAD2.size
    keys = json.loads(bytes(body[at:at + nk]))
    parents = json.loads(bytes(body[at + nk:at + nk + np_]))
    if len(keys) != n or len(parents) != n or len(body) != at + nk + np_ + 56 * n:
        raise ValueError(f"{n} entries, {len(keys)} keys, {len(parents)} parents, {len(body)} bytes")
    return keys, parents, np.frombuffer(body, dtype="<i8", count=7 * n, offset=at + nk + np_).reshape(n, 7)


def _parse_columns(body) -> dict[str, tuple]:
    """``save_index``'s columns as entries by key."""
    keys, parents, cols = _split_columns(body)
    gen, size, off, length, pin, crc, want = (c.tolist() for c in cols.T)
    return dict(zip(keys, zip(keys, gen, size, off, length, pin, parents, crc, want)))


def _row(e) -> tuple | None:
    """A journal add (or a ring record) ``[key, gen, size, offset, length, pin, parent, crc
    (None: none), want?]`` as a row of ``IndexColumns``; None if malformed."""
    if not (isinstance(e, (list, tuple)) and 8 <= len(e) <= 9 and type(e[0]) is str and type(e[6]) is str):
        return None
    nums = (e[1], e[2], e[3], e[4], e[5], -1 if e[7] is None else e[7], e[8] if len(e) > 8 else 1)
    return nums if all(type(x) is int and -1 <= x < 1 << 63 for x in nums) else None


class ArenaFile:
    """The arena of one store node, mapped from ``<arena_dir>/mooncake-ray.<ns>.<node>.arena``.

    ``reused`` tells whether the file existed with this size (a restart: its bytes and
    index are the previous process's). Raises ``ConfigError`` when the directory lacks
    room for a new arena."""

    def __init__(self, directory: str, namespace: str, node_id: str, size: int, prefault: bool = True):
        self.stem = os.path.join(directory, _name(namespace, node_id))
        self.path = self.stem + ".arena"
        self.index_path = self.stem + ".index"
        self.journal_path = self.stem + ".journal"
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

    def _snapshot(self) -> tuple[bytes, memoryview] | None:
        """The snapshot's format magic and body, if its CRC holds (else logged, None)."""
        try:
            with open(self.index_path, "rb") as f:
                data = f.read()
        except OSError:
            return None
        for magic in (_INDEX_MAGIC2, _INDEX_MAGIC):
            if data.startswith(magic) and len(data) >= len(magic) + 4:
                body, (crc,) = memoryview(data)[len(magic):-4], struct.unpack("<I", data[-4:])
                if zlib.crc32(body) == crc:
                    return magic, body
                log.warning("arena index %s is corrupt: ignored", self.index_path)
                return None
        return None

    def load_index_by_key(self) -> dict[str, tuple]:
        """``load_index``'s entries by key."""
        entries: dict[str, tuple] = {}
        snap = self._snapshot()
        if snap is not None:
            try:
                entries = (_parse_columns if snap[0] == _INDEX_MAGIC2 else _parse_json)(snap[1])
            except (ValueError, struct.error) as e:
                log.warning("arena index %s does not parse (%s): ignored", self.index_path, e)
        for adds, drops in self._journal_ops():
            for key, gen in drops:
                e = entries.get(key)
                if e is not None and e[1] <= gen:
                    del entries[key]
            for e in adds:
                entries[e[0]] = tuple(e)
        return entries

    def load_index_columns(self, extra=()) -> "IndexColumns":
        """What ``load_index_by_key`` returns, then ``extra`` (records to apply after the
        journal: a ring's unread ones, crc None where none was given), as columns: no tuple
        per value. A snapshot of a million entries with a short journal reads in a fraction
        of the time the entries by key take."""
        import numpy as np

        keys, parents, rows, bad = [], [], np.zeros((0, 7), dtype="<i8"), []
        snap = self._snapshot()
        if snap is not None:
            try:
                if snap[0] == _INDEX_MAGIC2:
                    keys, parents, rows = _split_columns(snap[1])
                else:
                    old = list(_parse_json(snap[1]).values())
                    bad = [[e[0], e[1]] for e in old if _row(e) is None and len(e) > 1]
                    old = [e for e in old if _row(e) is not None]
                    keys, parents = [e[0] for e in old], [e[6] for e in old]
                    rows = np.array([_row(e) for e in old], dtype="<i8").reshape(-1, 7)
            except (ValueError, struct.error) as e:
                log.warning("arena index %s does not parse (%s): ignored", self.index_path, e)
                keys, parents, rows, bad = [], [], np.zeros((0, 7), dtype="<i8"), []
        ops = self._journal_ops()
        if extra:
            ops.append((list(extra), []))
        if not ops:
            return IndexColumns(keys, parents, rows, bad)
        # Apply the journal by key: rows of the snapshot changed in place (a copy), later
        # ones appended; a dropped row is marked dead, and an add brings its key back.
        rows = np.array(rows)
        n = len(keys)
        pos = dict(zip(keys, range(n)))
        alive = np.ones(n, dtype=bool)
        more_keys, more_parents, more_rows, more_alive = [], [], [], []
        for adds, drops in ops:
            for key, gen in drops:
                i = pos.get(key)
                if i is None:
                    continue
                if i < n:
                    if alive[i] and rows[i, 0] <= gen:
                        alive[i] = False
                elif more_alive[i - n] and more_rows[i - n][0] <= gen:
                    more_alive[i - n] = False
            for e in adds:
                r = _row(e)
                if r is None:
                    if isinstance(e, (list, tuple)) and len(e) > 1 and type(e[0]) is str:
                        bad.append([e[0], e[1]])
                    continue
                i = pos.get(e[0])
                if i is None:
                    pos[e[0]] = n + len(more_keys)
                    more_keys.append(e[0])
                    more_parents.append(e[6])
                    more_rows.append(r)
                    more_alive.append(True)
                elif i < n:
                    rows[i] = r
                    parents[i] = e[6]
                    alive[i] = True
                else:
                    more_rows[i - n], more_parents[i - n], more_alive[i - n] = r, e[6], True
        if more_keys:
            rows = np.concatenate((rows, np.array(more_rows, dtype="<i8").reshape(-1, 7)))
            alive = np.concatenate((alive, np.array(more_alive, dtype=bool)))
            keys, parents = keys + more_keys, parents + more_parents
        if not alive.all():
            keep = alive.tolist()
            keys = [k for k, ok in zip(keys, keep) if ok]
            parents = [p for p, ok in zip(parents, keep) if ok]
            rows = rows[alive]
        return IndexColumns(keys, parents, rows, bad)

    def _journal_ops(self) -> list[tuple[list, list]]:
        """The journal's ``(adds, drops)`` lines, rotated one first; a torn or corrupt line
        is skipped."""
        lines = []
        for path in (self.journal_path + ".old", self.journal_path):
            try:
                with open(path, "rb") as f:
                    lines += f.read().split(b"\n")
            except OSError:
                pass
        ops = []
        for line in lines:  # "<crc32 hex> [adds, drops]"
            try:
                if len(line) < 10 or int(line[:8], 16) != zlib.crc32(line[9:]):
                    continue
                adds, drops = json.loads(line[9:])
            except ValueError:
                continue
            ops.append((adds, [d for d in drops if isinstance(d, list) and len(d) == 2 and type(d[1]) is int]))
        return ops

    def checksums(self, offsets, sizes):
        """CRC32C of many ranges of the arena at once (int64 arrays; GIL released): a
        uint32 array."""
        import numpy as np

        out = self._crc_many(self.addr, self.length, np.ascontiguousarray(offsets, dtype="<i8").tobytes(),
                                        np.ascontiguousarray(sizes, dtype="<i8").tobytes())
        return np.frombuffer(out, dtype="<u4")

    def load_index(self) -> list[tuple]:
        """The entries the previous process saved (its snapshot, then its journal):
        ``(key, gen, size, offset, length, pin, parent, crc, want)`` each (without ``want``
        where an earlier version saved them: one copy)."""
        return list(self.load_index_by_key().values())

    def journal(self, adds: list, drops: list) -> None:
        """Append what one inventory message changed: ``adds`` as ``load_index`` returns
        entries, ``drops`` as ``[key, gen]`` (entries of gen <= gen go)."""
        body = json.dumps([adds, drops], separators=(",", ":")).encode()
        os.write(self._jfd, b"%08x %s\n" % (zlib.crc32(body), body))

    def journal_bytes(self) -> int:
        return os.fstat(self._jfd).st_size

    def rotate_journal(self) -> None:
        """Start a new journal; the current one is kept (``.journal.old``, joined to one
        still there) until ``save_index`` writes a snapshot of the state at this point.
        The caller holds off appends meanwhile."""
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
        """Replace the snapshot with ``entries`` (as ``load_index`` returns them: the state
        when the journal was last rotated); ``save_index_columns`` with them as columns."""
        import numpy as np

        n = len(entries)
        rows = np.fromiter(itertools.chain.from_iterable(
            (e[1], e[2], e[3], e[4], e[5], e[7], e[8] if len(e) > 8 else 1) for e in entries),
            dtype="<i8", count=7 * n).reshape(n, 7)
        return self.save_index_columns([e[0] for e in entries], [e[6] for e in entries], rows)

    def save_index_columns(self, keys: list, parents: list, rows) -> int:
        """Replace the snapshot with these entries (``rows`` n x 7 int64: gen, size, offset,
        length, pin, crc, copies wanted); ``save_index_parts`` with them encoded."""
        import numpy as np

        n = len(keys)
        return self.save_index_parts(n, json.dumps(keys, separators=(",", ":")).encode(),
                                     json.dumps(parents, separators=(",", ":")).encode(),
                                     np.ascontiguousarray(rows, dtype="<i8").reshape(n, 7).tobytes())

    def save_index_parts(self, n: int, keys_json: bytes, parents_json: bytes, rows: bytes) -> int:
        """Replace the snapshot, atomically, with n entries: their keys and their parents as
        JSON lists, and n rows of 7 little-endian int64s (gen, size, offset, length, pin, crc,
        copies wanted); the rotated journal goes. Returns the snapshot's size in bytes.

        Format (``_INDEX_MAGIC2``): the magic, then a body of ``_HEAD2`` (n, and the bytes
        of the next two parts), the keys, the parents, the rows; then the body's CRC-32. A
        million entries write in about a third and read in about a fifth of the time one
        JSON list of entries took (``_parse_json``: still read)."""
        if len(rows) != 56 * n:
            raise ValueError(f"{n} entries need {56 * n} bytes of rows, got {len(rows)}")
        head = _HEAD2.pack(n, len(keys_json), len(parents_json))
        crc = zlib.crc32(rows, zlib.crc32(parents_json, zlib.crc32(keys_json, zlib.crc32(head))))
        tmp = self.index_path + ".tmp"
        with open(tmp, "wb") as f:
            for part in (_INDEX_MAGIC2, head, keys_json, parents_json, rows, struct.pack("<I", crc)):
                f.write(part)
        os.replace(tmp, self.index_path)
        try:
            os.unlink(self.journal_path + ".old")
        except FileNotFoundError:
            pass
        return len(head) + len(keys_json) + len(parents_json) + len(rows)

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
