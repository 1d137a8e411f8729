"""Extent allocator for one store node's arena (pure Python, no Ray).

The arena is one contiguous region of ``capacity`` bytes. Extents are handed out in
multiples of ``ALIGN`` (4 KiB) at 4 KiB-aligned offsets: the spill tier writes extents to
disk with O_DIRECT straight from the arena, which needs aligned addresses and lengths, and
KV pages are large enough (tens of KiB and up) that the rounding costs little. A 100-byte
value still takes 4 KiB; that is the price of zero-copy disk I/O.

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

ALIGN = 4096


def align_up(n: int) -> int:
    """Round ``n`` up to the allocation granule (at least one granule)."""
    return max(ALIGN, (n + ALIGN - 1) // ALIGN * ALIGN)


def carve(free: dict, offset: int, length: int) -> bool:
    """Take ``[offset, offset+length)`` out of ``free`` (free runs: offset -> length) if
    one run holds all of it; False (``free`` untouched) otherwise. A put slab's
    uncommitted pieces are such a map (``slabs.py``, and the reference read index
    ``pyindex.py``; the C++ index carves the same way)."""
    if not isinstance(offset, int) or offset % ALIGN:
        return False
    for start, ln in free.items():
        if start <= offset and offset + length <= start + ln:
            del free[start]
            if offset > start:
                free[start] = offset - start
            if offset + length < start + ln:
                free[offset + length] = start + ln - offset - length
            return True
    return False


class ExtentAllocator:
    """Best-fit allocator of aligned extents over ``[0, capacity)``."""

    def __init__(self, capacity: int):
        capacity = capacity // ALIGN * ALIGN
        if capacity <= 0:
            raise ValueError(f"arena capacity must be at least {ALIGN} bytes, got {capacity}")
        self.capacity = capacity
        self.used = 0
        self._by_size: SortedList = SortedList()
        self._start: SortedDict = SortedDict()
        self._end: dict[int, int] = {}
        self._add_run(0, capacity)

    # -- queries ------------------------------------------------------------------
    @property
    def free(self) -> int:
        return self.capacity - self.used

    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    def can_fit(self, size: int) -> bool:
        return self.largest_free() >= align_up(size)

    def free_runs(self) -> list[tuple[int, int]]:
        """``(offset, length)`` of every free run, by offset (for tests and checks)."""
        return list(self._start.items())

    # -- mutations ----------------------------------------------------------------
    def allocate(self, size: int) -> tuple[int, int] | None:
        """Allocate ``size`` bytes; returns ``(offset, allocated_length)`` or ``None``."""
        need = align_up(size)
        i = self._by_size.bisect_left((need, -1))
        if i == len(self._by_size):
            return None
        length, offset = self._by_size[i]
        self._remove_run(offset, length)
        if length > need:
            self._add_run(offset + need, length - need)
        self.used += need
        return offset, need

    def reserve(self, offset: int, length: int) -> None:
        """Mark a specific extent used (rebuilding from a store node's inventory).

        Raises:
            ValueError: the extent is misaligned, out of range or not entirely free.
        """
        if offset % ALIGN or length % ALIGN or length <= 0 or offset + length > self.capacity:
            raise ValueError(f"bad extent ({offset}, {length}) for capacity {self.capacity}")
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

    def release(self, offset: int, length: int) -> None:
        """Return an extent; merges with free neighbours.

        Raises:
            ValueError: the extent overlaps free space (double free) or is out of range.
        """
        if offset % ALIGN or length % ALIGN or length <= 0 or offset + length > self.capacity:
            raise ValueError(f"bad extent ({offset}, {length}) for capacity {self.capacity}")
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
