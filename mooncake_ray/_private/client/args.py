"""Checking what callers pass: keys and the buffers values are put from."""

from __future__ import annotations

from typing import Any

from mooncake_ray.errors import InvalidArgumentError
from mooncake_ray._private.buffers import readable, writable


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
    if len(key) * 4 > max_key and len(key.encode()) > max_key:
        raise InvalidArgumentError(
            f"key of {len(key.encode())} bytes is longer than max_key_bytes={max_key}: {key[:64]!r}...")


def same_length(keys, other, what: str) -> None:
    if len(keys) != len(other):
        raise InvalidArgumentError(f"{len(keys)} keys but {len(other)} {what}")


def sources(values) -> list[tuple]:
    """``(address, size, keep-alive)`` of each value to put (a ``Sized`` or anything
    ``readable``).

    Raises:
        InvalidArgumentError: a ``Sized`` size outside its buffer, or a bad value.
    """
    srcs = []
    for v in values:
        if isinstance(v, Sized):
            addr, n, keep = readable(v.buf) if isinstance(v.buf, bytes) else writable(v.buf)
            if v.size is not None:
                if not 0 <= v.size <= n:
                    raise InvalidArgumentError(f"size {v.size} is outside the buffer of {n} bytes")
                n = v.size
        else:
            addr, n, keep = readable(v)
        srcs.append((addr, n, keep))
    return srcs
