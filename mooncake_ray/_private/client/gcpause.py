"""The cyclic garbage collector paused for the length of a client's batch call.

A batch get or put of small values makes several short-lived containers per key (the
master's reply, the read grants, the read and release records). CPython counts each one
toward its next collection, so a 1000-key batch sets off about a dozen collections, each
walking the young objects of the whole process: 2.3 us a key of a 6.6 us client-side get
of 256-byte values here. None of those containers forms a cycle (reference counting frees
them all), so the collector finds nothing in them.

``paused()`` turns the collector off for the batch and back on after, if it was on. It is
process-wide: concurrent batches keep it off until the last ends. Garbage cycles made by
other threads meanwhile are collected when it is back on.
"""

from __future__ import annotations

import gc
import threading

BATCH_MIN = 16  # keys: smaller calls make too few containers to matter

_lock = threading.Lock()
_depth = 0
_resume = False


class paused:
    """Context manager: no cyclic collection inside (see the module docstring)."""

    __slots__ = ()

    def __enter__(self) -> None:
        global _depth, _resume
        with _lock:
            if _depth == 0:
                _resume = gc.isenabled()
                gc.disable()
            _depth += 1

    def __exit__(self, *exc: object) -> None:
        global _depth
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
