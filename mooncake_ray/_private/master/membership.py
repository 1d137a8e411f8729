"""The store nodes as the master's state machine sees them: mounts (a node's inventory
taken in, in bulk where it can be), heartbeats, unmounts (what a lost node held, kept for
its restarted process to re-adopt), drains, repairs, and a restarted master's wait for its
nodes. A part of ``MasterState`` (``state.py``), kept here by concern: the methods use the
state machine's tables as its other methods do."""

from __future__ import annotations

import numpy as np

from mooncake_ray.errors import MasterUnavailableError
from mooncake_ray._private.master.allocator import ExtentAllocator
from mooncake_ray._private.master.replicas import split_inventory
from mooncake_ray._private.master.repairs import copies
from mooncake_ray._private.master.slabs import put_key, slab_key
from mooncake_ray._private.master.types import RESERVED, InventoryEntry, NodeInfo, Tier, inventory_entry


class Membership:
    """The node-facing half of ``MasterState`` (see the module docstring)."""

    # ------------------------------------------------------------------ nodes --
    def mount(self, node: NodeInfo, inventory: list[InventoryEntry] = ()) -> None:
        """Add a store node with what it already holds. Idempotent for the same
        incarnation; a new incarnation replaces the old one (its replicas are gone)."""
        now = self._clock()
        old = self._nodes.get(node.node_id)
        if old is not None and old.incarnation == node.incarnation:
            old.last_heartbeat, old.suspect = now, False
            return
        kept = None
        if old is not None:
            inventory, kept = self._take_over(node, inventory)
            self.unmount(node.node_id, "remounted with a new incarnation",
                         except_incarnation=node.incarnation if kept is not None else "")
        # The DRAM values a restarted node re-adopted from its arena (store/arena.py) come
        # back only if they are what this master lost with its previous process: same key,
        # same generation, not removed since. (A master that never knew the node, e.g. one
        # rebuilding after its own restart, takes what the nodes hold, as for disk; the same
        # process rejoining brings what the actor's plan_mount reconciled with what it was
        # owed.)
        gone = self._gone.pop(node.node_id, None)
        self.repairs.back(node.node_id)
        vouched = None if gone is None or gone[1] == node.incarnation else gone[2]
        had = {} if vouched is None else gone[3]  # copies a value had when the node was lost
        node.last_heartbeat = now
        self._nodes[node.node_id] = node
        alloc = self._alloc[node.node_id] = ExtentAllocator(node.capacity, node.part_offset)
        # The plain values (most of them) in bulk: their extents reserved at once, cold
        # records without a Python object each, if no two extents of the inventory overlap.
        held = len(self._objects)
        if not held:
            known = None
        elif held * 4 < (len(inventory["keys"]) if isinstance(inventory, dict) else len(inventory)):
            known = set(self._objects).__contains__  # a few keys held: one call for all, not one per entry
        else:
            known = self._objects.__contains__
        plain, inventory = split_inventory(inventory, known, vouched, had)
        if kept is not None:  # the records moved to this incarnation keep their extents
            node.tier_keys["dram"] += len(kept)
        if plain[0] or kept is not None:
            cols = np.frombuffer(plain[1], dtype="<i8").reshape(-1, 4)
            if kept is not None:
                cols = np.concatenate((kept, cols))
            beside = [e for e in inventory if e[3] == "dram"]
            if alloc.reserve_all(cols[:, 2], cols[:, 3], ([e[4] for e in beside], [e[5] for e in beside])):
                self._gens.seen(int(cols[:, 0].max()) + 1)
                self._replicas.restore_plain(node, plain, now)
            else:
                for off, length in (kept.tolist() if kept is not None else ()):
                    alloc.reserve(off, length)  # as the previous process held them: no overlap
                inventory = [[k, *r[:2], "dram", *r[2:]] for k, r in zip(plain[0], cols[len(cols) - len(plain[0]):]
                                                                         .tolist())] + inventory
        # Newest allocation first: if two entries overlap (a drop that never reached the
        # node before a crash, then the extent reused), the newer one wins.
        entries = [InventoryEntry(*e) for e in inventory]
        for e in sorted((e for e in entries if e.tier != RESERVED), key=lambda e: -e.gen):
            if vouched is not None and e.tier == "dram" and vouched.get(e.key) != e.gen:
                self._replicas.delta(node.node_id).drop(e.key, e.gen, e.tier)
                self.counters["readopt_refused"] += 1
                continue
            self._gens.seen(e.gen + 1)
            self._replicas.restore(node, e, now)
            if e.key in had and e.tier == "dram":
                self._drop_surplus(node.node_id, e.key, had[e.key], now)
        # Then the ranges clients may still be writing into (slabs.py: adopt).
        reserved = [e for e in entries if e.tier == RESERVED]
        if reserved:
            hold = {"slab": self.policy.put_slab_ttl_s, "put": self.policy.put_timeout_s}
            self._slab_table.adopt(node.node_id, reserved, hold, now)
        self._release_held(node.node_id)
        self._expected.discard(node.node_id)
        if not self._expected:
            self._find_short()

    def _take_over(self, node: NodeInfo, inventory) -> tuple[dict, np.ndarray | None]:
        """A new process of a node mounted here (a restart that kept its arena): the cold
        DRAM records its inventory lists unchanged (key, generation, size, offset, length)
        move to the new incarnation in place, with their recency, leases and placement ids
        (the same bytes, never moved), instead of being forgotten by the unmount and made
        again by the mount: a million of them took the master over 2 s that way. Returns
        the inventory without them (packed) and their ``(gen, size, offset, length)`` rows
        (None if none moved). A key listed again in another entry (a disk copy, say) stays
        with the rest, for ``restore``."""
        from mooncake_ray._private.store.inventory import _entry, pack

        if not isinstance(inventory, dict):
            inventory = pack(_entry(e) for e in inventory)
        keys, rest = inventory["keys"], inventory["rest"]
        if not keys:
            return inventory, None
        table = np.frombuffer(inventory["cols"], dtype="<i8").reshape(-1, 4)
        if len(table) != len(keys):
            raise ValueError(f"a packed inventory of {len(keys)} keys has {len(table)} rows")
        others = {e[0] for e in rest}
        eligible = np.fromiter((k not in others for k in keys), dtype=bool, count=len(keys)) if others else None
        pick = keys if eligible is None else [k for k, ok in zip(keys, eligible) if ok]
        rows = table if eligible is None else table[eligible]
        moved = np.frombuffer(self._objects.index.retarget_cold(pick, rows.tobytes(), node.node_id,
                                                                node.ray_node_id, node.incarnation), dtype=bool)
        if not moved.any():
            return inventory, None
        if eligible is None:
            stay = ~moved
        else:
            stay = np.ones(len(keys), dtype=bool)
            stay[np.flatnonzero(eligible)[moved]] = False
        left = [k for k, s in zip(keys, stay.tolist()) if s] if stay.any() else []
        return {"keys": left, "cols": table[stay].tobytes(), "rest": rest}, rows[moved]

    def heartbeat(self, node_id: str, incarnation: str, spill_used: int | None = None,
                  spill_degraded: str | None = None) -> bool:
        """Record liveness. Returns False if the node must (re)mount with its inventory.
        Writes only the node's liveness fields: the actor calls it without its lock."""
        node = self._nodes.get(node_id)
        if node is None or node.incarnation != incarnation:
            return False
        node.last_heartbeat, node.suspect = self._clock(), False
        if spill_used is not None:
            node.spill_used = spill_used
        node.spill_degraded = spill_degraded
        return True

    def report_unreachable(self, node_id: str) -> None:
        """A client could not reach the node: stop placing new objects there until it
        heartbeats again (or is unmounted after node_ttl_s)."""
        if node_id in self._nodes:
            self._nodes[node_id].suspect = True

    def unmount(self, node_id: str, reason: str = "unmounted", except_incarnation: str = "") -> int:
        """Drop a node and every replica on it; keys with no replica left become misses.
        Returns the number of objects lost. Idempotent. ``except_incarnation``: the cold
        records a new process of the node has taken over stay (``_take_over``)."""
        had: dict[str, int] = {}
        chains, held = self._objects.chains, None
        if node_id in self._nodes:  # what it held in DRAM, should it come back (mount), and
            # how many copies each value of several had then (filled by _on_short as the
            # node's replicas go): one repaired meanwhile does not take the returning copy
            dram, keys = self._held_on(node_id, except_incarnation)
            self._gone[node_id] = (self._clock(), self._nodes[node_id].incarnation, dram, had)
            if reason != "drained":  # chains cut by its loss wait for it (chains.py: lost)
                held = {k for k in keys if k not in chains.lost and (k in chains.kids or k in chains.remote)}
                chains.lost.update(held)
        node = self._nodes.pop(node_id, None)
        self._alloc.pop(node_id, None)
        self._replicas.effects.pop(node_id, None)
        self._slab_table.drop_node(node_id)
        self._drains.forget(node_id)
        if node is None:
            return 0
        if reason != "drained":  # a drained node does not come back with its copies
            self.repairs.lost(node_id)
        self._had = had
        start = len(self.repairs.short)
        try:
            return self._replicas.forget_node(node, reason, except_incarnation)
        finally:
            self._had = None
            self.repairs.recent_first(start)
            if held:
                kept = {k for k in held if k in self._objects}  # copies elsewhere: not lost
                chains.lost.difference_update(kept)
                self._held[node_id] = self._held.get(node_id, set()) | (held - kept)

    def _release_held(self, node_id: str) -> None:
        """``node_id`` remounted, or the master stopped waiting for it: what it did not
        bring back went for good; the orphans of those keys go at the next tick."""
        keys = self._held.pop(node_id, None)
        if keys:
            self._objects.chains.release_lost(keys, lambda k: k in self._objects)

    def _on_short(self, key: str, gen: int, want: int, size: int) -> None:
        """A value left with fewer copies than ``want`` (a node lost; ``ReplicaTable``)."""
        self.repairs.note(key, gen, want, size)
        if self._had is not None and want > 1:
            self._had[key] = want

    def _drop_surplus(self, node_id: str, key: str, want: int, now: float) -> None:
        """A re-adopted copy of ``key`` beyond the ``want`` copies it had when its node was
        lost (a repair made the copy again meanwhile) is dropped, not kept on top."""
        obj = self._objects.peek(key)
        if obj is None or copies(obj) <= want:
            return
        r = next((r for r in obj.replicas if r.node_id == node_id and r.tier is Tier.DRAM and r.ready), None)
        if r is not None:
            self._replicas.drop_replica(obj, r, now)
            self.counters["surplus_copies_dropped"] += 1

    def nodes(self) -> list[dict]:
        return [n.public() for n in self._nodes.values()]

    # ----------------------------------------------------------------- drains --
    def drain_begin(self, node_id: str) -> bool:
        """``node_id`` is leaving: no new values there; its values are to be moved
        (``drain.py``). False: not mounted. Idempotent."""
        return self._drains.begin(node_id)

    def drain_plan(self, node_id: str, max_bytes: int) -> tuple[list[list], bool]:
        """The next batch of moves of a drain, and whether to ask again (``Drains.plan``)."""
        return self._drains.plan(node_id, max_bytes)

    def _writes_into(self, node_id: str) -> bool:
        """Puts in flight or put slabs on ``node_id``."""
        return (any(s.node_id == node_id for s in self._slab_table.slabs.values())
                or any(r.node_id == node_id for o in self._pending.values() for r in o.replicas))

    def drain_done(self, node_id: str, items) -> None:
        """Moves made (``Drains.done``)."""
        self._drains.done(node_id, items)

    def drain_end(self, node_id: str) -> dict:
        """Finish a drain and unmount the node; returns moved and lost keys and bytes."""
        report = self._drains.end(node_id)
        self.unmount(node_id, "drained")
        return report

    def draining(self) -> list[str]:
        return sorted(self._drains.active)

    # ---------------------------------------------------------------- repairs --
    def repair_plan(self, node_id: str, max_bytes: int) -> list[list]:
        """Copies ``node_id`` is to make for values short of copies (``Repairs.plan``)."""
        if node_id not in self._nodes or not self.repairs.due():
            return []
        return self.repairs.plan(node_id, max_bytes)

    def repair_done(self, items) -> None:
        """Copies made (``Repairs.done``)."""
        self.repairs.done(items)

    # --------------------------------------------------------------- recovery --
    def begin_recovery(self, expected_nodes: set[str]) -> None:
        """A restarted master: refuse calls until these nodes remount or the timeout."""
        self._expected = set(expected_nodes) - set(self._nodes)
        self._restarted_at = self._clock()
        self._recovery_deadline = self._restarted_at + self.policy.recovery_timeout_s
        self._alloc_gate_until = self._restarted_at + self.policy.put_slab_ttl_s
        self._short_scan_due = True
        if not self._expected:
            self._find_short()

    @property
    def recovering(self) -> bool:
        if self._expected and self._clock() >= self._recovery_deadline:
            for node_id in self._expected:  # may still come back with its copies
                self.repairs.lost(node_id)
            self._expected.clear()
            self._find_short()
        return bool(self._expected)

    def _find_short(self) -> None:
        """A restarted master, once the nodes it waited for have mounted (or the wait timed
        out): every value with fewer copies than its put asked for (each node's entry says
        how many) is queued for repair, as if this master had seen the loss. Such values
        are held as objects (``ObjectTable.flush``), so the scan is of those only."""
        if not self._short_scan_due:
            return
        self._short_scan_due = False
        start = len(self.repairs.short)
        for key, obj in self._objects.hot_items():
            if obj.want > 1 and obj.complete and copies(obj) < obj.want:
                self.repairs.note(key, obj.gen, obj.want, obj.size)
        self.repairs.recent_first(start)

    def _ready(self) -> None:
        if self._expected and self.recovering:
            raise MasterUnavailableError(
                f"master is rebuilding its index; waiting for store nodes {sorted(self._expected)}")


    # --------------------------------------------------------- what nodes hold --
    def _held_on(self, node_id: str, except_incarnation: str = "") -> tuple[dict[str, int], list[str]]:
        """What ``node_entries`` lists, as the generation of each DRAM value and every key
        (a key twice if it has both tiers there), from the read index in one call for the
        cold records: an unmount of a node of a million values needs no object per value.
        (Not the cold records on its incarnation ``except_incarnation``, when given.)"""
        objects = self._objects
        cold = objects.cold_gens_on_node(node_id, except_incarnation)
        dram = {key: gen for key, disk, gen in cold if not disk}
        keys = [key for key, _disk, _gen in cold]
        for key, obj in objects.hot_items():
            for r in obj.replicas:
                if r.node_id == node_id and r.ready:
                    keys.append(key)
                    if r.tier is Tier.DRAM:
                        dram[key] = obj.gen
        return dram, keys

    def node_entries(self, node_id: str) -> list[InventoryEntry]:
        """The inventory this master believes ``node_id`` holds (complete, readable
        replicas): what the node's own inventory must equal once it has applied every
        message it is owed (tests and tools)."""
        if node_id not in self._nodes:
            return []
        objects = self._objects
        out = [inventory_entry(obj, obj.replicas[0]) for obj in map(objects.peek, objects.cold_on_node(node_id))]
        for _key, obj in objects.hot_items():
            out.extend(inventory_entry(obj, r) for r in obj.replicas if r.node_id == node_id and r.ready)
        return out

    def reserved_entries(self, node_id: str) -> list[InventoryEntry]:
        """The ranges of ``node_id``'s arena this master handed out for writing (put slabs,
        pending puts), as the node's inventory must list them once it has applied every
        message it is owed (slabs.py; tests and tools)."""
        if node_id not in self._nodes:
            return []
        out = []
        for slab in self._slab_table.slabs.values():
            if slab.node_id == node_id:
                out.append(InventoryEntry(slab_key(slab.slab_id), slab.slab_id, slab.length, RESERVED, slab.offset,
                                          slab.length, 0))
        for obj in self._pending.values():
            out.extend(InventoryEntry(put_key(obj.gen), obj.gen, r.length, RESERVED, r.offset, r.length, 0)
                       for r in obj.replicas if r.node_id == node_id)
        return out
