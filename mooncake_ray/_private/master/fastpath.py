"""The read index: GET, EXISTS, lease releases and one-call put commits answered without
the state machine.

A 4 KiB get is one master call plus a microsecond copy, and the master's Python handler
costs 50-120 µs per call on a busy 2-vCPU host (the same code takes ~15 µs in a hot
loop: the rest is cold caches). So the engine answers the read calls in C++ on its
progress thread (``mcr::MasterIndex``, ``native/src/master/index.cpp``) from a mirror of
the index, and Python runs only for everything else.

The contract between the two halves:

- **The mirror holds exactly what a GET answers.** One entry per complete object:
  ``(size, gen, [(node_id, ray_node_id, offset, length, incarnation), ...])`` listing its
  ready DRAM replicas in the state machine's order; an empty list means "present, but
  Python answers" (the value is only on disk and must be promoted). ``ReadMirror``
  rewrites a key's entry at every place where that answer can change (publish, drop,
  replica dropped or promoted, node mount or unmount); ``check_invariants`` verifies the
  mirror against the objects, and the simulation runs with it.
- **What a native call grants is logged, not applied.** A lease (and the recency touch
  and hit that come with it), a release, a miss. Every section of the actor that reads
  or changes the state machine first holds the index's mutex and drains that log into
  the state machine (``apply_index_log``), as if Python had served those calls itself,
  in order. A native call takes the same mutex, so it falls wholly before a section
  (drained at its start) or wholly after it (and sees its changes): a lease is never
  granted on extents the state machine is freeing.
- **Clean one-call puts too.** ``PUT_COMMIT`` into a put slab is answered natively when
  every key is new (not stored, no two-call put in flight, not twice in the call) and every
  extent is an uncommitted part of the caller's slab. The used-up slabs a commit gives back
  (up to ``MAX_RETURNS``) leave the mirror in the same call, so no later commit lands in
  them, and are logged after its commits (``RETURN``) for Python to free what is left. For that the mirror also holds the
  slabs' uncommitted pieces, the keys with a put in flight, and the generation counter
  (pushed at the end of every section). The value is visible to native GETs at once; the
  commit is logged, and a thread of the actor that the log wakes applies it within
  milliseconds (``SlabTable.apply_logged_run``: carve, counters, inventory delta; the record
  is cold in the index already). Watermark eviction for
  the logged commits runs after the whole log is applied, so it sees every lease granted
  in it: evicting a value before its logged lease would free extents a reader holds.
- **Anything unusual is Python's.** Other operations, a key whose entry is empty, a
  commit that replaces or conflicts, a request the native parser does
  not accept, a full log, a master still rebuilding its index: the native side declines
  and the Python handler answers the whole call.

``ReadMirror`` keeps the mirror; ``MasterState.apply_index_log`` applies the log.
``pyindex.PyIndex`` is the reference implementation of the native index (same methods, same
replies, same lease ids): the unit tests compare the two on random streams, and the
simulation drives the state machine through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mooncake_ray._private.master.types import NodeInfo, Obj

if TYPE_CHECKING:
    from mooncake_ray._private.master.slabs import Slab
    from mooncake_ray._private.master.table import ObjectTable

GRANT, RELEASE, COMMIT, HELD, COMMIT_RINGED, RETURN = 0, 1, 2, 3, 4, 5  # COMMIT_RINGED: COMMIT whose node has its ring record only
MAX_RETURNS = 64  # slabs one PUT_COMMIT may give back natively (RETURN: the slab id in the lease field)
FIRST_LEASE = 1 << 40  # native lease ids; the state machine's own counter stays far below


class ReadMirror:
    """The state machine's side of the contract (see the module docstring): keeps the
    index's hot records, put slabs and keys in flight equal to what the state machine
    answers. It reads the state machine's tables it is handed and writes none."""

    def __init__(self, objects: ObjectTable, pending: dict[str, Obj], nodes: dict[str, NodeInfo]):
        self._objects = objects
        self._pending = pending
        self._nodes = nodes

    @property
    def index(self):
        return self._objects.index

    def key(self, key: str) -> None:
        """Tell the index what a GET of ``key`` answers now (a hot object's)."""
        self._objects.sync(key)

    def pending(self, key: str) -> None:
        """Tell the index whether a put of ``key`` is in flight."""
        if key in self._pending:
            self.index.add_pending(key)
        else:
            self.index.drop_pending(key)

    def slab(self, slab_id: int, slab: Slab | None) -> None:
        """Tell the index a put slab's uncommitted pieces (``slab`` None: it is gone)."""
        if slab is None:
            self.index.drop_slab(slab_id)
        else:
            node = self._nodes[slab.node_id]
            self.index.set_slab(slab_id, slab.owner, node.node_id, node.ray_node_id, node.incarnation,
                                list(slab.free.items()))

    def check(self, slabs: dict[int, Slab]) -> None:
        """Assert the index holds what the state machine would answer."""
        assert self.index.slab_count() == len(slabs), "read index: slabs out of sync"
        for slab_id, slab in slabs.items():
            node = self._nodes[slab.node_id]
            want = (slab.owner, node.node_id, node.ray_node_id, node.incarnation, sorted(slab.free.items()))
            got = self.index.lookup_slab(slab_id)
            assert got is not None and (*got[:4], [tuple(p) for p in got[4]]) == want, \
                f"slab {slab_id}: read index says {got}, the state machine {want}"
        assert self.index.pending_count() == len(self._pending), "read index: pending keys out of sync"
        assert all(self.index.is_pending(k) for k in self._pending), "read index: pending keys differ"
        assert len(self.index) == len(self._objects), \
            f"read index has {len(self.index)} keys, the state machine {len(self._objects)}"
        for key, obj in self._objects.items():
            got = self.index.lookup(key)
            want = (obj.size, obj.gen, self._objects.answer(obj))
            assert got is not None and (got[0], got[1], list(got[2])) == want, \
                f"{key}: read index says {got}, the state machine {want}"
