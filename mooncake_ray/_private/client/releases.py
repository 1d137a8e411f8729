"""Read leases given back in batches.

Read leases are released as soon as the copy is done, piggybacked on the next GET (or
flushed by a timer when no GET follows), so a lease lasts as long as the read, not
lease_ttl_s: otherwise a scan over more data than DRAM holds stalls on leases."""

from __future__ import annotations

import threading

from mooncake_ray._private import rpc

FLUSH_DELAY_S = 0.05  # how long a finished read's release waits for a GET to carry it


class Releases:
    """Finished reads' ``[key, gen, lease]`` waiting to be given back to the master."""

    def __init__(self, master):
        self._master = master
        self._pending: list = []  # [key, gen, lease] of finished reads
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._closed = False

    def take(self) -> list:
        """The releases waiting, to send with a GET (they are no longer waiting)."""
        if not self._pending:
            return []
        with self._lock:
            out, self._pending = self._pending, []
        return out

    def later(self, entry: list) -> None:
        """Release ``[key, gen, lease]`` with the next GET, or within ``FLUSH_DELAY_S``."""
        with self._lock:
            self._pending.append(entry)
        self._schedule_flush()

    def later_all(self, entries: list) -> None:
        with self._lock:
            self._pending.extend(entries)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if self._timer is None or not self._timer.is_alive():
            self._timer = threading.Timer(FLUSH_DELAY_S, self.flush)
            self._timer.daemon = True
            self._timer.start()

    def flush(self) -> None:
        """Send what waits now (best effort: a lease lost here expires by itself)."""
        done = self.take()
        if done and not self._closed:
            try:
                self._master.call(rpc.RELEASE, done)
            except Exception:  # noqa: BLE001 - on a timer thread; the leases expire by themselves
                pass

    def close(self) -> None:
        """Send what waits; later flushes send nothing."""
        timer = self._timer
        if timer is not None:
            timer.cancel()
        self.flush()
        self._closed = True
