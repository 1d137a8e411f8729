"""The put slab: a run of one node's DRAM this client carves single-call puts from (see
master/slabs.py and docs/internals.md, "Put slabs"). A slab is written into only within
3/4 of its ttl of asking for it, and given back when idle, given up, or on close.

A slab replaced while puts carved from it are still being written is not given back until
those puts are settled (committed or abandoned): the master frees a returned slab's
uncommitted space, so their commits would fail and another client could be handed the
room they are writing into. The last such put's PUT_COMMIT carries the return (the master
applies a PUT_COMMIT's commits before its returns)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass

from mooncake_ray.errors import InvalidArgumentError, MasterUnavailableError, NoCapacityError, NodeUnavailableError
from mooncake_ray._private import rpc, wire
from mooncake_ray._private.master.allocator import ALIGN

_GRANTS_PER_CARVE = 8  # new slabs one carve may ask for before it leaves the rest uncarved
_DECLINED_S = 1.0  # a node that had no room free for a preferred slab is not asked again for this long


@dataclass
class Slab:
    """A run of one node's DRAM this client carves extents from."""

    slab_id: int
    node_id: str
    incarnation: str
    cur: int  # next free offset
    end: int
    use_until: float  # monotonic; no write into the slab starts after this


class Slabs:
    """This client's current slab, and the ids of slabs to give back to the master."""

    def __init__(self, master, owner: str, here: str | None, slab_bytes: int):
        self._master = master
        self._owner = owner
        self._here = here
        self.slab_bytes = slab_bytes  # 0: slabs are off
        self._slab: Slab | None = None
        self._lock = threading.Lock()
        self._returns: list[int] = []
        self._inuse: dict[int, int] = {}  # slab id -> puts carved from it, not settled yet
        self._retired: set[int] = set()  # replaced slabs waiting for their puts to settle
        self._timer: threading.Timer | None = None
        self._closed = False
        self._prefer: str | None = None  # the node the slab being asked for should be on (carve)
        self._declined: dict[str, float] = {}  # node -> until when not to prefer it (it had no room)

    @property
    def current(self) -> Slab | None:
        return self._slab

    def carve(self, lengths: list[int], prefer: str | None = None, chained: bool = False) -> list:
        """``(slab, offset)`` per extent length (``allocator.extent_length``) from this
        client's slab, asking the master for a new one when it runs out; ``None`` for
        lengths that got no room. Packed extents follow each other; a paged one starts at
        the next 4 KiB boundary (the gap stays uncommitted and goes back with the slab).

        ``prefer``: a store node these values should go to (their KV chain's parent is
        there). A slab on another node is replaced by one on ``prefer`` where that node has
        the room free; where it had none, it is not asked again for ``_DECLINED_S``.
        ``chained``: the values form a chain, so a new slab the carve needs midway prefers
        the node of the slab it ran out of."""
        out: list = []
        total = len(lengths)
        with self._lock:
            grants = j = 0
            s = self._slab
            if prefer is not None and self._declined.get(prefer, 0.0) <= time.monotonic():
                self._declined.pop(prefer, None)
                self._prefer = prefer  # for each slab this carve asks for
                if s is not None and s.node_id != prefer:
                    self._retire(s)
                    self._slab = None
            while j < total:
                s = self._slab
                if s is not None and time.monotonic() <= s.use_until:
                    cur, end, first = s.cur, s.end, j  # as many as fit, in one pass
                    while j < total:
                        n = lengths[j]
                        at = -(-cur // ALIGN) * ALIGN if n >= ALIGN else cur
                        if end - at < n:
                            break
                        out.append((s, at))
                        cur = at + n
                        j += 1
                    s.cur = cur
                    if j > first:
                        self._inuse[s.slab_id] = self._inuse.get(s.slab_id, 0) + (j - first)
                    if j == total:
                        break
                if chained and j > 0 and self._prefer is None and s is not None:
                    self._prefer = s.node_id  # the rest of the chain beside its start
                if grants >= _GRANTS_PER_CARVE or not self._new_slab(min(sum(lengths[j:]), self.slab_bytes)):
                    out.extend([None] * (total - j))
                    break
                grants += 1
                s = self._slab
                if s.end - s.cur < lengths[j]:  # too large even for a new slab (which starts on a page)
                    out.append(None)
                    j += 1
            self._prefer = None
        return out

    def settle(self, slab_ids: list[int]) -> None:
        """Puts carved from these slabs (one id per put) are committed or abandoned."""
        with self._lock:
            self._settle(slab_ids)

    def _settle(self, slab_ids: list[int]) -> None:  # lock held
        for sid, k in Counter(slab_ids).items():  # a batch's puts mostly share a slab
            left = self._inuse.get(sid, 0) - k
            if left > 0:
                self._inuse[sid] = left
                continue
            self._inuse.pop(sid, None)
            if sid in self._retired:
                self._retired.discard(sid)
                self._returns.append(sid)

    def _retire(self, slab: Slab) -> None:  # lock held
        """Stop carving from ``slab``; give it back once its puts are settled."""
        if self._inuse.get(slab.slab_id, 0) > 0:
            self._retired.add(slab.slab_id)
        else:
            self._returns.append(slab.slab_id)

    def give_up(self, slab_ids: set[int]) -> None:
        """Stop writing into these slabs (their node failed a write) and give them back."""
        with self._lock:
            if self._slab is not None and self._slab.slab_id in slab_ids:
                self._slab = None
            self._retired -= slab_ids
            self._returns.extend(slab_ids)

    def take_returns(self, settled: list[int] = ()) -> list[int]:
        """The ids of slabs to give back, to send with a PUT_COMMIT; ``settled``: the slab
        id of each put that PUT_COMMIT commits (or that was abandoned)."""
        with self._lock:
            self._settle(settled)
            return self._take_returns()

    def _take_returns(self) -> list[int]:  # lock held
        out, self._returns = self._returns, []
        return out

    def _new_slab(self, need: int) -> bool:
        """Replace the current slab (lock held). False if the master has none to give."""
        if self._slab is not None:
            self._retire(self._slab)
            self._slab = None
        sent, prefer = time.monotonic(), self._prefer
        try:
            g = wire.slab_grant(self._master.call(
                rpc.SLAB_GRANT, self._owner, self._here, need, self._take_returns(),
                *(() if prefer is None else (prefer,))))
        except (NoCapacityError, MasterUnavailableError, InvalidArgumentError, NodeUnavailableError):
            return False
        if prefer is not None and g.node_id != prefer:
            self._declined[prefer] = sent + _DECLINED_S
            self._prefer = None
        # Writes start at most 3/4 of the ttl after the request left: the master's window
        # (counted from when it granted) ends later still.
        self._slab = Slab(g.slab_id, g.node_id, g.incarnation, g.offset, g.offset + g.length, sent + 0.75 * g.ttl)
        if self._timer is None or not self._timer.is_alive():
            self._arm_timer(g.ttl)
        return True

    def _arm_timer(self, delay_s: float) -> None:
        self._timer = threading.Timer(delay_s, self._return)
        self._timer.daemon = True
        self._timer.start()

    def _return(self, expired_only: bool = True) -> None:
        """Give back a slab this client can no longer write into (or every slab, on close),
        so its unused room is free at once rather than when the master expires it."""
        with self._lock:
            s = self._slab
            if s is not None and (not expired_only or time.monotonic() > s.use_until):
                self._retire(s)
                self._slab = s = None
            if not expired_only:  # closing: nothing more will be written or committed
                self._returns.extend(self._retired)
                self._retired.clear()
            ids = self._take_returns()
            if s is not None and not self._closed:  # still in use: look again when it runs out
                self._arm_timer(max(0.05, s.use_until - time.monotonic()))
        if ids and not self._closed:
            self._master.try_call(rpc.SLAB_RETURN, ids)  # if it is lost, the master expires them

    def close(self) -> None:
        """Give every slab back; no timer asks the master anything afterwards."""
        self._return(expired_only=False)
        self._closed = True
