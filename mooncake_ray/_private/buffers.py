"""Turning user values and buffers into (address, length) pairs without copying.

Accepted: bytes, bytearray, memoryview and any C-contiguous buffer-protocol object,
numpy arrays, and torch CPU tensors (contiguous). The returned ``keep`` object must stay
referenced until the transfer completes.

A list of such buffers is one value made of several ranges: stored as their concatenation,
read back into them in order. Its "address" is then a tuple of ``(address, length)``
ranges (``gathered``), which the transport takes as they are: one op per range, contiguous
in the remote region.
"""

from __future__ import annotations

import bisect
import ctypes
from typing import Any, Callable

import numpy as np

from mooncake_ray.errors import InvalidArgumentError, NotRegisteredError
from mooncake_ray._private.native import _native

_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)


def _data_address(b: bytes) -> int:
    return ctypes.cast(ctypes.c_char_p(b), ctypes.c_void_p).value or 0


def _data_offset() -> int | None:
    """Where a ``bytes`` object's storage starts relative to ``id()`` (CPython keeps it
    inline, after the header), if this interpreter does so for every size; else None."""
    offsets = {_data_address(b) - id(b) for b in (_new_bytes(None, n) for n in (0, 1, 255, 4096, 1 << 20))}
    return offsets.pop() if len(offsets) == 1 else None


_DATA_OFFSET = _data_offset()


def new_bytes(n: int) -> tuple[bytes, int]:
    """An uninitialised ``bytes`` of ``n`` bytes and the address of its storage.

    The C API documents ``PyBytes_FromStringAndSize(NULL, n)`` as "contents
    uninitialised" for exactly this use: fill it once, before anyone else sees it. It saves
    the second copy a ``bytes(bytearray)`` would make. Below ``_ZEROED_MAX`` a zeroed
    ``bytes(n)`` is cheaper than that ctypes call (a fresh object for n >= 2: CPython
    shares only the empty and the one-byte values). The address is ``id()`` plus the
    header size, checked against ctypes at import (a ctypes cast costs 1.4 us a value,
    most of a small get's client time).
    """
    if _DATA_OFFSET is None:
        b = _new_bytes(None, n)
        return b, _data_address(b)
    b = bytes(n) if 2 <= n < _ZEROED_MAX else _new_bytes(None, n)
    return b, id(b) + _DATA_OFFSET


_ZEROED_MAX = 16 << 10


def _torch_view(t: Any, writable: bool) -> tuple[int, int, Any]:
    if t.device.type != "cpu":
        raise InvalidArgumentError(
            f"tensor on device {t.device} is not supported here: only CPU tensors (CUDA needs a "
            "UCX built with CUDA; that path is untested)")
    if not t.is_contiguous():
        raise InvalidArgumentError("tensor is not contiguous: call .contiguous() first")
    return t.data_ptr(), t.numel() * t.element_size(), t


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


def gathered(bufs: list, one: Callable[[Any], tuple],
             registered: Callable[[int, int], bool] | None = None) -> tuple[tuple, int, list]:
    """``(ranges, nbytes, keep)`` of a value made of the buffers of ``bufs``, each turned
    into ``(address, nbytes, keep)`` by ``one``; empty buffers are dropped. A raw
    ``(address, length)`` that ``registered`` accepts is taken as it is (the common case:
    a KV block's ranges in registered memory, dozens a value). Where ``registered`` has a
    ``ranges`` RangeSet (the client's), a list of nothing but such ranges inside it is
    checked in one native call.

    Raises:
        InvalidArgumentError: an empty list, a nested list, or a bad buffer (naming its index).
    """
    if not bufs:
        raise InvalidArgumentError("a list of buffers must hold at least one buffer")
    spans = getattr(registered, "ranges", None)
    if spans is not None and type(bufs) is list:
        got = _native.raw_ranges(bufs, *spans.arrays())
        if got is not None:
            return got[0], got[1], []
    ranges, keeps, total = [], [], 0
    for i, b in enumerate(bufs):
        if type(b) is tuple and registered is not None and len(b) == 2:
            a, n = b
            if type(a) is int and type(n) is int and a > 0 and n > 0 and registered(a, n):
                ranges.append(b)
                total += n
                continue
        if isinstance(b, list):
            raise InvalidArgumentError(f"buffer {i} of a list of buffers is itself a list")
        try:
            a, n, k = one(b)
        except InvalidArgumentError as e:
            raise type(e)(f"buffer {i} of the list: {e}") from None
        if n:
            ranges.append((a, n))
            keeps.append(k)
            total += n
    return tuple(ranges), total, keeps


class RangeSet:
    """Memory ranges (registered buffers) with a value each, answering which one holds
    ``[addr, addr + n)`` by bisection: a value of dozens of ranges is checked range by
    range, against as many registrations (one per model layer). Changes replace the
    sorted lists whole, so lookups from other threads never see them half made."""

    def __init__(self):
        self._set([])

    def _set(self, items: list[tuple[int, int, Any]]) -> None:
        """One state, replaced whole: starts, ``(start, end, value)`` items, and the starts
        and ends as uint64 arrays for the native checks (``_native.raw_ranges``, ``span_set``)."""
        starts = [it[0] for it in items]
        self._state = (starts, items, np.array(starts, dtype=np.uint64), np.array([it[1] for it in items], dtype=np.uint64))

    def add(self, start: int, length: int, value: Any) -> None:
        items = list(self._state[1])
        items.insert(bisect.bisect_right(self._state[0], start), (start, start + length, value))
        self._set(items)

    def remove(self, value: Any) -> None:
        self._set([it for it in self._state[1] if it[2] is not value])

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Starts and ends of the ranges, by start, as uint64 arrays."""
        return self._state[2], self._state[3]

    def snapshot(self) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int, Any]]]:
        """``arrays()`` and the ``(start, end, value)`` items they index, of one state."""
        _, items, starts, ends = self._state
        return starts, ends, items

    def find(self, addr: int, n: int) -> Any:
        """The value of a range holding ``[addr, addr + n)``, or None."""
        starts, items = self._state[:2]
        i = bisect.bisect_right(starts, addr) - 1
        if i < 0:
            return None
        if addr + n <= items[i][1]:
            return items[i][2]
        for _start, end, value in items[:i]:  # ranges that overlap: an earlier, longer one
            if addr + n <= end:
                return value
        return None

    def values(self) -> list:
        return [it[2] for it in self._state[1]]

    def __len__(self) -> int:
        return len(self._state[1])


def spans(ranges: tuple, n: int) -> list[tuple[int, int, int]]:
    """``(offset in the value, address, length)`` of the ranges covering a multi-range
    value's first ``n`` bytes."""
    out, at = [], 0
    for addr, m in ranges:
        if at >= n:
            break
        m = min(m, n - at)
        out.append((at, addr, m))
        at += m
    return out


def readable(value: Any) -> tuple[int, int, Any]:
    """``(address, nbytes, keep)`` of a value to store (a tuple of ranges for a list)."""
    if isinstance(value, list):
        return gathered(value, readable)
    if isinstance(value, bytes):
        return ctypes.cast(ctypes.c_char_p(value), ctypes.c_void_p).value or 0, len(value), value
    if isinstance(value, np.ndarray):
        if not value.flags.c_contiguous:
            raise InvalidArgumentError("numpy array is not C-contiguous: use np.ascontiguousarray")
        return value.__array_interface__["data"][0], value.nbytes, value
    if _is_torch(value):
        return _torch_view(value, False)
    if isinstance(value, str):
        raise InvalidArgumentError("value is a str: encode it to bytes first (e.g. value.encode())")
    try:
        mv = memoryview(value)
    except TypeError:
        raise InvalidArgumentError(
            f"value of type {type(value).__name__} is not bytes-like: expected bytes, bytearray, "
            "memoryview, a numpy array or a torch CPU tensor") from None
    if not mv.c_contiguous:
        raise InvalidArgumentError("buffer is not C-contiguous")
    arr = np.frombuffer(mv.cast("B"), dtype=np.uint8) if mv.nbytes else np.empty(0, np.uint8)
    return (arr.ctypes.data if mv.nbytes else 0), mv.nbytes, (arr, value)


def writable(buf: Any, registered: Callable[[int, int], bool] | None = None) -> tuple[int, int, Any]:
    """``(address, nbytes, keep)`` of a buffer to read into. A raw ``(address, length)``
    must lie inside registered memory (``registered(address, length)``) when that is given.

    A list of buffers is read into in order (``gathered``).

    Raises:
        InvalidArgumentError: not writable contiguous memory, or a malformed raw range.
        NotRegisteredError: a raw range outside every registered buffer.
    """
    if isinstance(buf, list):
        return gathered(buf, lambda b: writable(b, registered), registered)
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous or not buf.flags.writeable:
            raise InvalidArgumentError("numpy buffer must be C-contiguous and writeable")
        return buf.__array_interface__["data"][0], buf.nbytes, buf
    if _is_torch(buf):
        return _torch_view(buf, True)
    if isinstance(buf, tuple) and len(buf) == 2:  # (address, length) of memory the caller owns
        addr, n = raw_range(buf)
        if registered is not None and not registered(addr, n):
            raise not_registered(addr, n)
        return addr, n, None
    try:
        mv = memoryview(buf)
    except TypeError:
        raise InvalidArgumentError(
            f"buffer of type {type(buf).__name__} is not writable memory: expected bytearray, "
            "memoryview, a numpy array, a torch CPU tensor or (address, length)") from None
    if mv.readonly:
        raise InvalidArgumentError(f"buffer of type {type(buf).__name__} is read-only")
    if not mv.c_contiguous:
        raise InvalidArgumentError("buffer is not C-contiguous")
    if not mv.nbytes:
        return 0, 0, mv
    arr = np.frombuffer(mv.cast("B"), dtype=np.uint8)
    return arr.ctypes.data, mv.nbytes, (arr, buf)


_ADDR_MAX = (1 << 64) - 1


def raw_range(buf: tuple) -> tuple[int, int]:
    """``(address, length)`` given as a tuple, checked for shape and range only.

    Raises:
        InvalidArgumentError: not two ints, a negative value, or past the address space.
    """
    addr, n = buf
    if type(addr) is not int or type(n) is not int:
        raise InvalidArgumentError(
            f"(address, length) must be two ints, got ({type(addr).__name__}, {type(n).__name__})")
    if addr <= 0 or n < 0 or addr + n > _ADDR_MAX:
        raise InvalidArgumentError(f"(address, length) = ({addr:#x}, {n}) is not a memory range")
    return addr, n


def check_mapped(addr: int, n: int) -> None:
    """That ``[addr, addr + n)`` is mapped readable and writable in this process (from
    ``/proc/self/maps``; for registering raw memory, not for the data path).

    Raises:
        InvalidArgumentError: some byte of the range is not mapped read-write.
    """
    end, at = addr + n, addr
    with open("/proc/self/maps") as f:
        spans = []
        for line in f:
            rng, perms = line.split(None, 2)[:2]
            lo, hi = (int(x, 16) for x in rng.split("-"))
            if hi > addr and lo < end and perms.startswith("rw"):
                spans.append((lo, hi))
    for lo, hi in sorted(spans):
        if lo > at:
            break
        at = max(at, hi)
    if at < end:
        raise InvalidArgumentError(
            f"(address, length) = ({addr:#x}, {n}): {at:#x} is not mapped read-write in this process")


def not_registered(addr: int, n: int) -> NotRegisteredError:
    return NotRegisteredError(
        f"(address, length) = ({addr:#x}, {n}) is not inside a buffer registered with register_buffer: "
        "raw addresses are accepted only there")
