"""The KV-chain parents of a store node's spilled values, kept beside its spill tier
(``<spill directory>/PARENTS``), so a value found on disk when the node starts again keeps
its place in its chain (``master/chains.py``) instead of becoming a plain value.

The spill tier's own files hold the values and their keys, checked by CRC-32C; a parent
is a hint for eviction order, so it lives in a log of its own, written after the value's
file is: records ``<gen u64><key len u32><parent len u32><key><parent>``, appended with one
buffered write per offload batch. At start the node reads the log, keeps the newest record
of each key whose generation is the one its file holds, and writes those back as a new log
(a torn record at the end, from a process killed mid-write, is dropped). A value whose
record is missing or stale starts without a parent, as before this log existed. The log
is written anew from the live records also when it has grown to twice them plus
``COMPACT_SLACK`` records.
"""

from __future__ import annotations

import os
import struct

NAME = "PARENTS"
_REC = struct.Struct("<QII")
COMPACT_SLACK = 65536


class SpillParents:
    """The parents log of one spill directory. Not thread-safe: the store node holds its
    lock around every call."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, NAME)
        self._fd = -1
        self._records = 0  # in the file now
        self._live = 0  # when it was last written anew

    def load(self, present: dict[str, int]) -> dict[str, str]:
        """The parents of the values on disk (``present``: key -> generation found), the
        log written anew with them."""
        found: dict[str, tuple[int, str]] = {}
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            data = b""
        at, n = 0, len(data)
        while at + _REC.size <= n:
            gen, klen, plen = _REC.unpack_from(data, at)
            end = at + _REC.size + klen + plen
            if end > n:
                break  # torn at the end
            key = data[at + _REC.size:at + _REC.size + klen].decode("utf-8", "surrogatepass")
            parent = data[at + _REC.size + klen:end].decode("utf-8", "surrogatepass")
            at = end
            if present.get(key) == gen:
                found[key] = (gen, parent)
        self._rewrite([(k, g, p) for k, (g, p) in found.items() if p])
        return {k: p for k, (_g, p) in found.items() if p}

    def record(self, items) -> None:
        """``(key, gen, parent)`` of values just written to disk (those with a parent)."""
        buf = bytearray()
        n = 0
        for key, gen, parent in items:
            if not parent:
                continue
            k, p = key.encode("utf-8", "surrogatepass"), parent.encode("utf-8", "surrogatepass")
            buf += _REC.pack(gen, len(k), len(p)) + k + p
            n += 1
        if n:
            self._write(bytes(buf))
            self._records += n

    def due(self) -> bool:
        """Whether the log has grown enough to be written anew (``rewrite``)."""
        return self._records > 2 * self._live + COMPACT_SLACK

    def rewrite(self, live) -> None:
        """Write the log anew from ``live``: ``(key, gen, parent)`` of the values on disk."""
        self._rewrite([x for x in live if x[2]])

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _rewrite(self, live: list) -> None:
        tmp = self.path + ".new"
        self.close()
        with open(tmp, "wb") as f:
            for key, gen, parent in live:
                k, p = key.encode("utf-8", "surrogatepass"), parent.encode("utf-8", "surrogatepass")
                f.write(_REC.pack(gen, len(k), len(p)) + k + p)
        os.replace(tmp, self.path)
        self._records = self._live = len(live)

    def _write(self, data: bytes) -> None:
        if self._fd < 0:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]
