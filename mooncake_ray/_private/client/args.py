"""Checking what callers pass: keys and the buffers values are put from."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from mooncake_ray.errors import InvalidArgumentError
from mooncake_ray._private.buffers import gathered, readable, writable
from mooncake_ray._private.native import _native


class Sized:
    """A buffer to put from, of which only the first ``size`` bytes (all if None)."""

    __slots__ = ("buf", "size")

    def __init__(self, buf, size):
        self.buf, self.size = buf, size


def check_key(key: Any, max_key: int) -> None:
    """Raises InvalidArgumentError unless ``key`` is a non-empty str of at most
    ``max_key`` UTF-8 bytes."""
    if not isinstance(key, str):
        raise InvalidArgumentError(f"key must be a str, got {type(key).__name__}: {key!r:.80}")
    if not key:
        raise InvalidArgumentError("key must not be empty")
    if not key.isascii():
        try:
            n = len(key.encode())
        except UnicodeEncodeError as e:
            raise InvalidArgumentError(
                f"key is not valid Unicode text: {key[e.start:e.end]!r} at position {e.start} "
                f"is a lone surrogate: {key[:64]!r}") from None
    else:
        n = len(key)
    if n > max_key:
        raise InvalidArgumentError(f"key of {n} bytes is longer than max_key_bytes={max_key}: {key[:64]!r}...")


def key_errors(keys, max_key: int) -> dict[int, Exception]:
    """``{index: InvalidArgumentError}`` of the bad keys among ``keys``."""
    bad = {}
    for i, k in enumerate(keys):
        try:
            check_key(k, max_key)
        except InvalidArgumentError as e:
            bad[i] = e
    return bad


def convert(items, fn, bad: dict[int, Exception]) -> list:
    """``fn(item)`` for each item whose index is not in ``bad`` (None for those); an
    InvalidArgumentError ``fn`` raises is put in ``bad`` under the item's index."""
    out: list = [None] * len(items)
    for i, v in enumerate(items):
        if i not in bad:
            try:
                out[i] = fn(v)
            except InvalidArgumentError as e:
                bad[i] = e
    return out


def same_length(keys, other, what: str) -> None:
    if len(keys) != len(other):
        raise InvalidArgumentError(f"{len(keys)} keys but {len(other)} {what}")


def sources(values, registered: Callable[[int, int], bool], bad: dict[int, Exception]) -> list:
    """``convert(values, source)``: bytes and C-contiguous numpy arrays, bare or ``Sized``,
    are read in one native call (about a microsecond a value less than ``source``);
    everything else, and every bad one, goes through ``source`` and its errors."""
    out = _native.put_sources(values if type(values) is list else list(values), Sized, np.ndarray)
    if None in out:
        for i, got in enumerate(out):
            if got is None and i not in bad:
                try:
                    out[i] = source(values[i], registered)
                except InvalidArgumentError as e:
                    bad[i] = e
    for i in bad:
        out[i] = None
    return out


def source(v, registered: Callable[[int, int], bool]) -> tuple:
    """``(address, size, keep-alive)`` of a value to put (a ``Sized`` or anything
    ``readable``).

    Raises:
        InvalidArgumentError: a ``Sized`` size outside its buffer, or a bad value.
        NotRegisteredError: a raw ``(address, length)`` outside every registered buffer.
    """
    if isinstance(v, Sized):
        if isinstance(v.buf, list):
            addr, n, keep = gathered(v.buf, lambda b: source(Sized(b, None), registered), registered)
        else:
            addr, n, keep = readable(v.buf) if isinstance(v.buf, bytes) else writable(v.buf, registered)
        if v.size is not None:
            if type(v.size) is not int or not 0 <= v.size <= n:
                raise InvalidArgumentError(f"size {v.size!r:.40} is outside the buffer of {n} bytes")
            n = v.size
        return addr, n, keep
    return readable(v)
