"""The receive pool of the Ray Direct Transport plug-in (``ray_rdt``): pre-faulted,
registered arenas that received tensors are carved from, so a 64 MiB tensor lands in memory
that is neither page-faulted nor registered on the data path."""

from __future__ import annotations

import collections
import logging
import threading
import weakref
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

if TYPE_CHECKING:
    from mooncake_ray._private.transport import Engine, Region

logger = logging.getLogger(__name__)

ALIGN = 256  # offset of every tensor inside a receive block (>= any dtype's alignment)
POOL_ARENA_MIN = 64 << 20


class Arena:
    __slots__ = ("region", "mv", "base", "length", "free")

    def __init__(self, region: "Region"):
        self.region = region
        self.mv = region.view()
        self.base = region.addr
        self.length = region.length
        self.free: List[List[int]] = [[0, region.length]]  # sorted [offset, length]


class RecvPool:
    """Pre-faulted, registered arenas that received tensors are carved from.

    A block is handed out as a memoryview slice; ``torch.frombuffer`` keeps that slice
    alive for as long as any storage views it, and a ``weakref.finalize`` on the slice
    queues the block for return. Returns are only queued in the finalizer (it may run in
    any thread, inside a garbage collection) and applied under the lock by ``alloc``.
    """

    def __init__(self, engine: "Engine", limit_bytes: int):
        self._engine = engine
        self.limit = max(0, int(limit_bytes))
        self._arenas: List[Arena] = []
        self._lock = threading.Lock()
        self._returns: collections.deque = collections.deque()
        self.allocated = 0

    @property
    def reserved(self) -> int:
        return sum(a.length for a in self._arenas)

    def _drain_returns(self) -> None:
        while self._returns:
            idx, off, length = self._returns.popleft()
            fl = self._arenas[idx].free
            fl.append([off, length])
            fl.sort()
            merged: List[List[int]] = []
            for o, n in fl:
                if merged and merged[-1][0] + merged[-1][1] == o:
                    merged[-1][1] += n
                else:
                    merged.append([o, n])
            self._arenas[idx].free = merged
            self.allocated -= length

    def _take(self, idx: int, nbytes: int) -> Optional[int]:
        fl = self._arenas[idx].free
        for i, (off, n) in enumerate(fl):
            if n >= nbytes:
                if n == nbytes:
                    fl.pop(i)
                else:
                    fl[i] = [off + nbytes, n - nbytes]
                return off
        return None

    def alloc(self, nbytes: int) -> Optional[Tuple[memoryview, int]]:
        """A block of at least ``nbytes`` as (memoryview, address), or None (no room)."""
        if self.limit <= 0 or nbytes <= 0:
            return None
        nbytes = -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            self._drain_returns()
            idx = off = None
            for i in range(len(self._arenas)):
                off = self._take(i, nbytes)
                if off is not None:
                    idx = i
                    break
            if idx is None:
                size = max(POOL_ARENA_MIN, -(-nbytes // (2 << 20)) * (2 << 20))
                if self.reserved + size > self.limit:
                    size = nbytes
                    if self.reserved + size > self.limit:
                        return None
                try:
                    arena = Arena(self._engine.alloc_arena(size))
                except Exception:  # noqa: BLE001 - out of memory: fall back to torch.empty
                    logger.warning("mooncake RDT: cannot allocate a %d-byte receive arena", size,
                                   exc_info=True)
                    return None
                self._arenas.append(arena)
                idx = len(self._arenas) - 1
                off = self._take(idx, nbytes)
            self.allocated += nbytes
            arena = self._arenas[idx]
            mv = arena.mv[off:off + nbytes]
        weakref.finalize(mv, self._returns.append, (idx, off, nbytes))
        return mv, arena.base + off

    def stats(self) -> Dict[str, int]:
        with self._lock:
            self._drain_returns()
            return {"recv_pool_reserved": self.reserved, "recv_pool_allocated": self.allocated}

    def find(self, addr: int, length: int) -> Optional["Region"]:
        """The arena region holding [addr, addr+length), if any."""
        for a in self._arenas:
            if a.base <= addr and addr + length <= a.base + a.length:
                return a.region
        return None
