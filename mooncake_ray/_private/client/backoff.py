"""Waiting before a retry while the store frees room (offloads to disk finishing)."""

from __future__ import annotations

import time


class Backoff:
    """Sleeps growing from 0.2 ms to 20 ms, until ``limit_s`` has passed (an offload of a
    few MiB finishes in about a millisecond, so start short)."""

    def __init__(self, limit_s: float):
        self._deadline = time.monotonic() + limit_s
        self._delay = 0.0002

    def expired(self) -> bool:
        return time.monotonic() >= self._deadline

    def sleep(self) -> None:
        time.sleep(self._delay)
        self._delay = min(self._delay * 1.5, 0.02)
