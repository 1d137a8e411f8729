"""Copies from this store node's arena into other store nodes' arenas: a drain's moves and
the repairs of values short of copies (master/drain.py, master/repairs.py) go this way.

The master plans each copy as ``[key, gen, size, src_offset, dst_node, dst_offset]``: the
bytes at ``src_offset`` of this arena (``FROM_DISK``: of a buffer the value was read into
from this node's disk first) go to an extent it reserved on ``dst_node``. The
writes of a batch go out as one transfer: a memcpy into the peer's arena where this host
maps it (shared memory), a UCX put elsewhere. A peer is connected the first time a plan
names it, with what the master knows of it (address, remote key, arena file)."""

from __future__ import annotations

import logging

import ray

from mooncake_ray.errors import MooncakeRayError
from mooncake_ray._private.master.drain import FROM_DISK
from mooncake_ray._private.store import arena

log = logging.getLogger(__name__)


def extent_ok(offset, size, capacity: int) -> bool:
    """``[offset, offset + size)`` is inside an arena of ``capacity`` bytes."""
    return type(offset) is int and type(size) is int and 0 <= offset and 0 <= size <= capacity - offset


class PeerCopier:
    """Writes planned copies out of one node's arena (``base``, ``capacity``)."""

    def __init__(self, engine, node_id: str, base: int, capacity: int, what: str) -> None:
        self._engine = engine
        self._node_id = node_id
        self._base, self._cap = base, capacity
        self._what = what  # "drain" or "repair", for the log
        self.regions: dict[str, object] = {}

    def connect(self, master, plan: list) -> None:
        """Connect to the targets of ``plan`` not connected yet (a peer that cannot be
        reached is logged; its copies fail)."""
        if all(dst in self.regions for *_x, dst, _o in plan):
            return
        for info in ray.get(master.nodes.remote(), timeout=60):
            if info["node_id"] in self.regions or info["node_id"] == self._node_id:
                continue
            try:
                peer = self._engine.connect(info["address"])
                # Not populated: a copy writes a small part of each arena once.
                self.regions[info["node_id"]] = self._engine.import_remote(
                    peer, info["rkey"], info["base"], info["capacity"],
                    *arena.local_mapping(info, self._engine.protocol), populate=False)
            except MooncakeRayError as e:
                log.warning("%s: store node %s unreachable (%s)", self._what, info["node_id"], e)

    def start(self, plan: list, staged: dict[int, int] | None = None) -> tuple[list[bool], object]:
        """Start the writes of ``plan``; returns which copies were started and the
        transfer's handle (None: nothing to wait for). ``staged``: for the copies whose
        bytes are not in the arena (a drain's values read from disk), the address they
        were read to, by position in ``plan`` (a copy from disk missing there fails)."""
        staged = staged or {}
        ok = [dst in self.regions and (i in staged if src == FROM_DISK else extent_ok(src, size, self._cap))
              for i, (_k, _g, size, src, dst, _o) in enumerate(plan)]
        ops = [(self.regions[dst], dst_off, staged[i] if src == FROM_DISK else self._base + src, size)
               for i, ((_k, _g, size, src, dst, dst_off), good) in enumerate(zip(plan, ok)) if good and size]
        try:
            return ok, (self._engine.write_async(ops) if ops else None)
        except MooncakeRayError as e:
            log.warning("%s: a batch of %d copies was refused (%s)", self._what, len(ops), e)
            return [False] * len(plan), None

    def finish(self, plan: list, ok: list[bool], handle, timeout_s: float) -> list[list]:
        """Wait for a started batch; the report for the master: ``[key, gen, dst_node,
        dst_offset, ok]`` per copy (one bad target fails the batch)."""
        if handle is not None:
            try:
                handle.wait(timeout_s)
            except MooncakeRayError as e:
                log.warning("%s: a batch of %d copies failed (%s)", self._what, len(plan), e)
                ok = [False] * len(plan)
        return [[k, g, dst, off, good] for (k, g, _s, _src, dst, off), good in zip(plan, ok)]
