"""Extent allocator for one store node's arena (pure Python, no Ray).

The arena is one contiguous region of ``capacity`` bytes. Extents come in two kinds
(``extent_length``, ``extent_align``):

- a value of 4 KiB (``ALIGN``) or more takes a 4 KiB multiple at a 4 KiB-aligned offset:
  the spill tier writes such extents to disk with O_DIRECT straight from the arena, which
  needs aligned addresses and lengths, and KV pages are large enough that the rounding
  costs little;
- a smaller value is packed: it takes its size rounded up to ``GRANULE`` (64 bytes, one
  cache line) at any 64-byte offset, so a 256-byte value costs 256 bytes of arena. The
  spill tier copies such values through an aligned staging buffer.

Free space is a set of maximal free runs, indexed two ways:

- ``_by_size``: a sorted list of ``(length, offset)``: allocation is best fit (the smallest
  run that is large enough, lowest offset among equals), which keeps large runs intact
  for large values;
- ``_start`` / ``_end``: run start -> length and run end -> start, so a freed extent merges
  with both neighbours in O(log n).

A shortage is a value (``allocate`` returns ``None``); freeing memory that is not
allocated is a broken contract and raises.
"""

from __future__ import annotations

from sortedcontainers import SortedDict, SortedList

ALIGN = 4096  # page: the length and offset alignment of values this size and larger
GRANULE = 64  # the allocation unit of smaller values (packed)


def page_up(n: int) -> int:
    """Round ``n`` up to whole 4 KiB pages (at least one)."""
    return max(ALIGN, (n + ALIGN - 1) // ALIGN * ALIGN)


def extent_length(size: int) -> int:
    """Arena bytes a value of ``size`` bytes takes: whole pages from 4 KiB up, whole
    64-byte granules below (at least one)."""
    if size >= ALIGN:
        return (size + ALIGN - 1) // ALIGN * ALIGN
    return max(GRANULE, (size + GRANULE - 1) // GRANULE * GRANULE)


def extent_align(length: int) -> int:
    """The offset alignment of an extent of ``length`` bytes (an ``extent_length``)."""
    return ALIGN if length >= ALIGN else GRANULE


def carve(free: dict, offset: int, length: int) -> bool:
    """Take ``[offset, offset+length)`` out of ``free`` (free runs: offset -> length) if
    one run holds all of it; False (``free`` untouched) otherwise. A put slab's
    uncommitted pieces are such a map (``slabs.py``, and the reference read index
    ``pyindex.py``; the C++ index carves the same way)."""
    if not isinstance(offset, int) or offset % extent_align(length):
        return False
    return carve_span(free, offset, offset + length)


def carve_span(free: dict, start: int, end: int) -> bool:
    """``carve`` of ``[start, end)`` without the alignment check: one extent, or the
    extents of several values side by side (each checked by the caller)."""
    for s, ln in free.items():
        if s <= start and end <= s + ln:
            del free[s]
            if start > s:
                free[s] = start - s
            if end < s + ln:
                free[end] = s + ln - end
            return True
    return False


class ExtentAllocator:
    """Best-fit allocator of aligned extents over ``[origin, origin + capacity)``.

    ``origin`` is where this allocator's part of the arena begins: 0 for a whole arena, a
    page-aligned offset for one master shard's part of it (``shards.arena_part``); the
    offsets it hands out and takes back are arena offsets either way."""

    def __init__(self, capacity: int, origin: int = 0):
        capacity = capacity // ALIGN * ALIGN
        if capacity <= 0:
            raise ValueError(f"arena capacity must be at least {ALIGN} bytes, got {capacity}")
        if origin < 0 or origin % ALIGN:
            raise ValueError(f"an allocator's origin must be a page-aligned offset, got {origin}")
        self.capacity = capacity
        self.origin = origin
        self.used = 0
        self._by_size: SortedList = SortedList()
        self._start: SortedDict = SortedDict()
        self._end: dict[int, int] = {}
        self._add_run(origin, capacity)

    # -- queries ------------------------------------------------------------------
    @property
    def free(self) -> int:
        return self.capacity - self.used

    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    def largest_paged(self) -> int:
        """The longest page-aligned extent the largest free run holds."""
        if not self._by_size:
            return 0
        length, offset = self._by_size[-1]
        start = -(-offset // ALIGN) * ALIGN
        return max(0, (offset + length - start) // ALIGN * ALIGN)

    def can_fit(self, size: int) -> bool:
        return self._find(extent_length(size)) is not None

    def free_runs(self) -> list[tuple[int, int]]:
        """``(offset, length)`` of every free run, by offset (for tests and checks)."""
        return list(self._start.items())

    # -- mutations ----------------------------------------------------------------
    def allocate(self, size: int) -> tuple[int, int] | None:
        """Allocate ``size`` bytes; returns ``(offset, allocated_length)`` or ``None``."""
        need = extent_length(size)
        found = self._find(need)
        if found is None:
            return None
        length, offset, start = found
        self._remove_run(offset, length)
        if start > offset:
            self._add_run(offset, start - offset)
        tail = offset + length - (start + need)
        if tail:
            self._add_run(start + need, tail)
        self.used += need
        return start, need

    def reserve(self, offset: int, length: int) -> None:
        """Mark a specific extent used (rebuilding from a store node's inventory).

        Raises:
            ValueError: the extent is misaligned, out of range or not entirely free.
        """
        self._check_extent(offset, length)
        run = self._run_containing(offset)
        if run is None or run[0] + run[1] < offset + length:
            raise ValueError(f"extent ({offset}, {length}) is not free")
        start, run_len = run
        self._remove_run(start, run_len)
        if offset > start:
            self._add_run(start, offset - start)
        tail = start + run_len - (offset + length)
        if tail:
            self._add_run(offset + length, tail)
        self.used += length

    def reserve_all(self, offsets, lengths, beside=((), ())) -> bool:
        """Mark many extents used at once, on an allocator with nothing used yet (a store
        node's inventory as it mounts): the free runs are rebuilt as the gaps between them,
        in one pass over the extents sorted by offset, where ``reserve`` costs a search and
        two sorted-container updates per extent. ``offsets`` and ``lengths``: int sequences
        of the same length (numpy arrays or lists).

        ``beside``: ``(offsets, lengths)`` of extents the caller reserves one by one
        afterwards; they are checked with these, not reserved.

        Returns False, changing nothing, if the allocator is in use, or any extent is
        misaligned, out of range or overlaps another (the caller then reserves them one by
        one, deciding which of two overlapping extents to trust)."""
        import numpy as np

        off = np.asarray(offsets, dtype=np.int64)
        ln = np.asarray(lengths, dtype=np.int64)
        if self.used or off.shape != ln.shape or off.ndim != 1 or len(beside[0]) != len(beside[1]):
            return False
        if not off.size:
            return True
        lo, hi = self.origin, self.origin + self.capacity
        all_off = np.concatenate((off, np.asarray(beside[0], dtype=np.int64)))
        all_ln = np.concatenate((ln, np.asarray(beside[1], dtype=np.int64)))
        if ((all_off % GRANULE) | (all_ln % GRANULE)).any() or (all_ln <= 0).any() or (all_off < lo).any() \
                or (all_off + all_ln > hi).any():
            return False
        order = np.argsort(all_off, kind="stable")
        if ((all_off + all_ln)[order][:-1] > all_off[order][1:]).any():
            return False
        order = np.argsort(off, kind="stable")
        off, ln = off[order], ln[order]
        end = off + ln
        # The gaps: before the first extent, between neighbours, after the last.
        starts = np.concatenate(([lo], end))
        stops = np.concatenate((off, [hi]))
        keep = stops > starts
        runs = list(zip(starts[keep].tolist(), (stops - starts)[keep].tolist()))
        self._by_size = SortedList((length, start) for start, length in runs)
        self._start = SortedDict(runs)
        self._end = {start + length: start for start, length in runs}
        self.used = int(ln.sum())
        return True

    def release(self, offset: int, length: int) -> None:
        """Return an extent; merges with free neighbours.

        Raises:
            ValueError: the extent overlaps free space (double free) or is out of range.
        """
        self._check_extent(offset, length)
        if self._overlaps_free(offset, length):
            raise ValueError(f"double free of extent ({offset}, {length})")
        start, end = offset, offset + length
        prev_start = self._end.get(start)
        if prev_start is not None:
            self._remove_run(prev_start, start - prev_start)
            start = prev_start
        next_len = self._start.get(end)
        if next_len is not None:
            self._remove_run(end, next_len)
            end += next_len
        self._add_run(start, end - start)
        self.used -= length

    def release_many(self, extents: list[tuple[int, int]]) -> None:
        """Return many extents at once: adjacent ones are merged first, so a batch of
        evictions (often neighbours: values carved in turn from one put slab) costs one
        update of the free index per run rather than per extent.

        Raises:
            ValueError: as ``release``, or two of the extents overlap; then none of the
                extents from the overlapping one on is released.
        """
        start = end = None
        for offset, length in sorted(extents):
            if start is not None and offset == end:
                end += length
                continue
            if start is not None:
                if offset < end:
                    self.release(start, end - start)
                    raise ValueError(f"double free of extent ({offset}, {length}) within one batch")
                self.release(start, end - start)
            start, end = offset, offset + length
        if start is not None:
            self.release(start, end - start)

    # -- internals ----------------------------------------------------------------
    def _check_extent(self, offset: int, length: int) -> None:
        if (offset % GRANULE or length % GRANULE or length <= 0 or offset < self.origin
                or offset + length > self.origin + self.capacity):
            raise ValueError(f"bad extent ({offset}, {length}) for [{self.origin}, "
                             f"{self.origin + self.capacity})")

    def _find(self, need: int) -> tuple[int, int, int] | None:
        """Best fit for an extent of ``need`` bytes: ``(run length, run offset, extent
        offset)`` of the smallest free run that holds it at its alignment, or None.

        A packed (small) extent fits any run long enough. A paged one may need to skip to
        the run's first 4 KiB boundary; only runs shorter than ``need + ALIGN - GRANULE``
        can fail that, so the search tries a few of those and then takes the first longer one.
        """
        by_size = self._by_size
        i = by_size.bisect_left((need, -1))
        n = len(by_size)
        if i == n:
            return None
        length, offset = by_size[i]
        if need < ALIGN or not offset % ALIGN:
            return length, offset, offset
        sure = need + ALIGN - GRANULE  # any run this long holds an aligned extent
        tries = 0
        while True:
            start = -(-offset // ALIGN) * ALIGN
            if start + need <= offset + length:
                return length, offset, start
            i += 1
            tries += 1
            if tries == 8 and i < n and by_size[i][0] < sure:
                i = by_size.bisect_left((sure, -1))  # skip the rest of the short runs
            if i >= n:
                return None
            length, offset = by_size[i]

    def _add_run(self, offset: int, length: int) -> None:
        self._by_size.add((length, offset))
        self._start[offset] = length
        self._end[offset + length] = offset

    def _remove_run(self, offset: int, length: int) -> None:
        self._by_size.remove((length, offset))
        del self._start[offset]
        del self._end[offset + length]

    def _run_containing(self, offset: int) -> tuple[int, int] | None:
        """The free run that contains ``offset``, if any (O(log n))."""
        for start in self._start.irange(maximum=offset, reverse=True):
            length = self._start[start]
            return (start, length) if offset < start + length else None
        return None

    def _overlaps_free(self, offset: int, length: int) -> bool:
        if self._run_containing(offset) is not None:
            return True
        for start in self._start.irange(minimum=offset):
            return start < offset + length
        return False
