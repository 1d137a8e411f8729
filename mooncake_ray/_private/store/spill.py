"""The disk (NVMe spill) tier of a store node.

A thin face over the native engine (``native/src/spill``): objects live one per file in a
spill directory, written and read with io_uring and O_DIRECT, each with a CRC-32C, so a
corrupt, torn or truncated file is reported as a miss (:class:`ChecksumError`, and the file
is deleted), never as data. Small objects (a record of at most 3 KiB: 40 bytes of header,
the key, the data) written in one call share files instead ("packs", below). The index is
rebuilt from the files' headers when a directory is opened again.

On-disk layout (format version 1)::

    <directory>/LOCK                    flock: one SpillTier per directory
    <directory>/TOMBSTONES              seqs of removed / superseded objects (8 bytes each)
    <directory>/<h>/<slot:016x>         a slot file, h = slot & 15: an object, or free
        [0, H)        header: magic "MCRSPILL", version, generation, length, seq, write
                      time, CRC-32C of the data, flags, the key, CRC-32C of the header;
                      zero padded to H = 4096 (8192 for keys over 4032 bytes)
        [H, H + L')   data, zero padded to L' = length rounded up to 4096

A pack is a slot file whose header has the pack flag and whose data is the records of the
small objects one ``write_many`` wrote (up to 256 KiB of them): each record 64-byte
aligned, with its own magic, key, generation, length, seq and CRC-32Cs of its header and
data. A 256-byte value under a short key takes 320 bytes of disk instead of 8 KiB, and a
batch of them one write. A packed object is removed as any other (its seq tombstoned); the
pack's file goes to the free pool with its last live object. A read of one fetches the
blocks holding its record and checks both CRCs; a scan reads each live pack whole and keeps
the records whose CRCs match, so one corrupt record loses that object only.

A write fills a slot (a free one when the pool has one, else a new file) and publishes it
only when all of its I/O completed; the header goes last (with the only chunk, or after
all chunks), so a crash leaves either a valid object or a slot a scan discards. Removing
or overwriting a key appends the old version's seq to TOMBSTONES and keeps its slot in a
free pool, so later writes overwrite allocated blocks (the fast O_DIRECT path, what fio
measures) with no create, rename or unlink: on this machine's ext4 a create costs 0.3 ms
and an unlink of 1 MiB 2 ms. Free slots count against ``capacity_bytes`` (they are
deleted as needed to make room) but not in :attr:`used_bytes`. A tombstone is written
with a buffered write: a killed process never brings a removed object back; after a
power loss one may come back, and is then still checked like any other.

Threads: every method may be called from any thread; the blocking ones release the GIL,
so a store node can offload on a background thread while it serves. Policy (what to
spill, when to drop, LRU) is the caller's: this class only stores, checks and reports.
"""

from __future__ import annotations

from typing import Sequence

from mooncake_ray.errors import MooncakeRayError, _from_native_code
from mooncake_ray._private.native import _native

__all__ = ["SpillTier", "crc32c"]

_OK = 0


def _error(code: int, message: str) -> MooncakeRayError:
    cls = _from_native_code(code)
    err = cls(message)
    err.code = code
    return err


def crc32c(addr: int, length: int, crc: int = 0) -> int:
    """CRC-32C (Castagnoli) of ``length`` bytes at ``addr``, continuing ``crc``."""
    return _native.spill_crc32c(addr, length, crc)


class SpillTier:
    """Objects on local disk, keyed by string, with a generation number each.

    Args:
        directory: where the files go (created if missing). One tier per directory at a
            time (an exclusive lock is taken). Must be on a filesystem with O_DIRECT.
        capacity_bytes: the most the tier may occupy, counting each object's header and
            padding (see :attr:`used_bytes`).
        queue_depth: I/Os in flight per call.
        use_uring: ``False`` uses plain ``preadv``/``pwritev`` (still O_DIRECT), one I/O at
            a time, for comparison. Also the fallback when the kernel refuses io_uring
            (see :attr:`uses_uring`).
        chunk_bytes: objects larger than this move as several I/Os of this size, so the
            checksum of one chunk overlaps the I/O of the next.
        tombstone_compact_min: records in the tombstone log before it may be compacted.
        pack_small: small objects written in one call share files (packs, above); False
            gives each a file of its own (for comparison). Either way, what is on disk is
            read back.

    Raises:
        InvalidArgumentError: bad arguments, or a filesystem without O_DIRECT.
        SpillError: the directory cannot be created, or another tier holds it.
    """

    def __init__(
        self,
        directory: str,
        capacity_bytes: int,
        queue_depth: int = 32,
        use_uring: bool = True,
        *,
        chunk_bytes: int = 256 << 10,
        tombstone_compact_min: int = 1 << 16,
        pack_small: bool = True,
    ) -> None:
        self._directory = str(directory)
        self._t = _native.SpillTier(
            self._directory,
            int(capacity_bytes),
            int(queue_depth),
            bool(use_uring),
            int(chunk_bytes),
            int(tombstone_compact_min),
            bool(pack_small),
        )

    # -- writes ------------------------------------------------------------------------

    def write(self, key: str, gen: int, src_addr: int, length: int) -> None:
        """Stores ``length`` bytes at address ``src_addr`` under ``key`` with generation ``gen``.

        A 4 KiB-aligned source is written straight from memory (O_DIRECT); any other is
        copied through an aligned staging buffer. Replaces an existing object of the key
        once the new one is completely on disk. Idempotent: a retry is safe.

        Raises:
            SpillError: no capacity left (nothing written), a disk error (the partial file is
                removed and the tier becomes :attr:`degraded`), or the tier is degraded.
            InvalidArgumentError: empty key or key over 4096 bytes, null source.
        """
        self._t.write(key, gen, src_addr, length)

    def write_many(self, items: Sequence[tuple[str, int, int, int]]) -> list[None | Exception]:
        """Writes ``(key, gen, src_addr, length)`` items together (up to ``queue_depth`` I/Os
        in flight). Returns, per item, ``None`` or the exception :meth:`write` would raise."""
        return [None if c == _OK else _error(c, m) for c, m, _ in self._t.write_many(list(items))]

    # -- reads -------------------------------------------------------------------------

    def read(self, key: str, dst_addr: int, length: int) -> int:
        """Reads the object into ``length`` bytes at ``dst_addr`` and returns its generation.

        ``length`` must equal the stored length. The checksum is verified before returning;
        exactly ``length`` bytes at ``dst_addr`` are written (an unaligned destination or a
        partial last block goes through a staging buffer). Safe to retry.

        Raises:
            ObjectNotFoundError: no such key (or its file vanished).
            ChecksumError: the file is corrupt, torn or truncated; it has been deleted, so
                the key is now a miss. The bytes at ``dst_addr`` are undefined.
            InvalidArgumentError: ``length`` differs from the stored length.
            SpillError: a disk error (the tier becomes :attr:`degraded`).
        """
        return self._t.read(key, dst_addr, length)

    def read_many(self, items: Sequence[tuple[str, int, int]]) -> list[int | Exception]:
        """Reads ``(key, dst_addr, length)`` items in one io_uring batch. Returns, per item,
        the generation or the exception :meth:`read` would raise."""
        return [g if c == _OK else _error(c, m) for c, m, g in self._t.read_many(list(items))]

    # -- index -------------------------------------------------------------------------

    def remove(self, key: str) -> bool:
        """Deletes the object; returns whether it existed. Idempotent."""
        return self._t.remove(key)

    def contains(self, key: str) -> bool:
        return self._t.contains(key)

    def info(self, key: str) -> tuple[str, int, int] | None:
        """``(key, gen, length)`` of a stored object, or ``None``."""
        return self._t.info(key)

    def keys(self) -> list[tuple[str, int, int]]:
        """``(key, gen, length)`` of every object in the index (no disk access)."""
        return self._t.list()

    def scan(self, verify_data: bool = False) -> list[tuple[str, int, int]]:
        """Rebuilds the index from the disk and returns ``(key, gen, length)`` of every valid
        object, for a store node's inventory after a restart.

        Every header is read and checked (magic, version, header CRC, name, file size);
        with ``verify_data`` every object's data CRC too. Invalid, torn and superseded files
        are deleted. Other calls wait while a scan runs. (Opening a tier already scans the
        headers; call this again to report the inventory or to verify data.)

        Raises:
            SpillError: the directory was removed (the tier becomes degraded).
        """
        return self._t.scan(verify_data)

    def recover(self) -> bool:
        """After a disk error: clears :attr:`degraded` so writes are tried again (a
        persisting ENOSPC or EIO degrades the tier again on the next write). Cheap, may be
        called periodically. A removed or replaced directory is recreated and rescanned
        first (its objects are gone). Returns False if that fails."""
        return self._t.recover()

    # -- state -------------------------------------------------------------------------

    @property
    def directory(self) -> str:
        return self._directory

    @property
    def capacity_bytes(self) -> int:
        return self._t.capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes on disk, headers and padding included, plus writes in flight."""
        return self._t.used_bytes

    @property
    def num_keys(self) -> int:
        return self._t.num_keys

    @property
    def degraded(self) -> str | None:
        """Why the tier stopped accepting writes (ENOSPC, EIO, directory removed), or
        ``None``. Reads of existing objects keep working; :meth:`recover` clears it."""
        return self._t.degraded

    @property
    def uses_uring(self) -> bool:
        return self._t.uses_uring

    def _inject_io_error(self, kind: str, err: int, count: int = 1) -> None:
        """Testing hook: the next ``count`` completed ``"read"`` or ``"write"`` I/Os fail
        with ``err`` (an errno), as a failing disk would."""
        if kind not in ("read", "write"):
            raise ValueError(f"kind must be 'read' or 'write', got {kind!r}")
        self._t._inject_io_error(kind == "write", int(err), int(count))

    def stats(self) -> dict[str, int]:
        """Counters: writes, reads, bytes, errors, checksum failures, latency sums (ns)."""
        return self._t.stats()

    def close(self) -> None:
        """Waits for calls in progress, releases the directory. Later calls raise
        EngineClosedError. Files stay on disk."""
        self._t.close()

    def __enter__(self) -> "SpillTier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"SpillTier({self._directory!r}, used={self.used_bytes}/{self.capacity_bytes}, "
            f"keys={self.num_keys}, degraded={self.degraded!r})"
        )
