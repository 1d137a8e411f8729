"""The master's table of complete objects (pure, no Ray), kept in the read index.

At ten million keys a Python object graph per key (the object, its replica list and
replica, their integers, dict and set entries) cost about 580 bytes, most of the master's
memory. So every complete object has one record in the index (``MasterIndex`` in C++,
``PyIndex`` its reference), which is also the recency list eviction walks, and Python
holds an ``Obj`` only while it needs one:

- **cold** records are plain values (one replica, ready in DRAM or on disk, one copy
  asked for, not pinned, at most two read leases held): the index is their only copy,
  grants and releases their leases natively, and lists them to eviction with what it
  needs to drop them;
- **hot** objects are held here in ``_hot``, and the state machine is their authority
  (anything unusual: a put being replaced, an offload or promotion in flight, pins, more
  replicas, a third lease); the record keeps only what a GET answers.

``get`` hydrates a cold record into a hot ``Obj`` (the same object for the rest of the
section and for as long as it stays hot, so ``table.get(key) is obj`` means what it
says). ``flush``, at the end of every section of the actor's lock, writes the plain
objects touched in the section back cold and lets them go. Being hot is always correct;
cold is what keeps the master small.

The table reads the state machine's node table (``nodes``): a cold record names its
replica's node by id, Ray node id and incarnation.
"""

from __future__ import annotations

from typing import Iterator

from mooncake_ray._private.master.adaptive import InsertionPolicy
from mooncake_ray._private.master.chains import Chains
from mooncake_ray._private.master.pyindex import HOLD_REMOTE, HOLD_WAIT, REF_PUT
from mooncake_ray._private.master.types import NodeInfo, Obj, Pin, Replica, Tier

SCAN_BATCH = 4096  # records the index lists per scan() call of a victim search

_DRAM, _DISK = Tier.DRAM, Tier.DISK


class ObjectTable:
    """key -> ``Obj`` of every complete value, in recency order (see the module
    docstring). Dict-like for the state machine: ``get``, ``in``, ``[]``, ``del``,
    ``len``, iteration; ``touch`` marks a use; ``items`` and ``peek`` read without
    hydrating. Not thread-safe: the actor holds its lock (and the index's) around it."""

    def __init__(self, index, nodes: dict[str, NodeInfo]):
        self.index = index
        self._nodes = nodes
        self._hot: dict[str, Obj] = {}
        self._dirty: set[str] = set()  # hot keys touched since the last flush
        self.chains = Chains()
        # Chain-aware eviction: the index keeps the chain links between stored keys and
        # what else holds a value (its puts in flight, children on other shards), so its
        # own eviction (evict_cold) takes leaves first without Python (set_chain_eviction).
        self.chain_eviction = False
        # Where a new value with a parent enters the eviction order (adaptive.py); the
        # state machine sets it.
        self.insertion: InsertionPolicy | None = None

    # ----------------------------------------------------------------- mapping --
    def get(self, key: str, default=None) -> Obj | None:
        obj = self._hot.get(key)
        if obj is None:
            rec = self.index.hydrate(key)
            if rec is None:
                return default
            obj = self._hot[key] = _obj(key, rec)
            obj.parent = self.chains.parent.get(key, "")
        self._dirty.add(key)
        return obj

    def __getitem__(self, key: str) -> Obj:
        obj = self.get(key)
        if obj is None:
            raise KeyError(key)
        return obj

    def __contains__(self, key) -> bool:
        return key in self._hot or self.index.contains(key)

    def __setitem__(self, key: str, obj: Obj) -> None:
        """A new or replaced value: hot, answering GETs (a new key is the most recent)."""
        self._hot[key] = obj
        self._dirty.add(key)
        self.index.set(key, obj.size, obj.gen, self.answer(obj))
        self._linked(key, obj.parent)

    def touch_new(self, key: str, parent: str, size: int) -> None:
        """A put published ``key``: to the recent end, or (the insertion policy says
        ``old``, a chained value) on probation at the old end, from where its first read
        moves it. The native index does the same for its own commits."""
        insertion = self.insertion
        if parent and insertion is not None and insertion.old:
            self.index.probation(key)
        else:
            self.index.touch(key, bool(parent))
        if insertion is not None and insertion.sampling:
            self.index.sample(REF_PUT, key, size, bool(parent))

    def __delitem__(self, key: str) -> None:
        self._hot.pop(key, None)
        self.index.drop(key)
        self._unlinked(key)

    # ------------------------------------------------------------------ chains --
    def set_chain_eviction(self, on: bool) -> None:
        """Whether eviction takes leaves first: the index then keeps the chain links."""
        self.chain_eviction = on
        self.index.set_chain_links(on)

    def _linked(self, key: str, parent: str, native: bool = False) -> None:
        """``key`` stored naming ``parent``; ``native``: by the index's own commit, which
        linked it there."""
        chains = self.chains
        if chains.lost:
            chains.lost.discard(key)  # back (with its node, or put again)
        if parent or chains.holds(key) or key in chains.parent:
            chains.stored(key, parent, self.__contains__)
            if self.chain_eviction:
                index = self.index
                if not native:
                    index.link(key, parent)
                for kid in chains.kids.get(key, ()):  # stored before it (or it was replaced)
                    index.link(kid, key)
                if key in chains.waiting or key in chains.remote:
                    self._sync_holds(key)

    def _unlinked(self, key: str) -> None:
        """``key`` went (the index dropped its links with its record)."""
        self.chains.gone(key)

    def _hold_bits(self, key: str) -> int:
        """What besides its children holds ``key``, as the index's hold bits."""
        c = self.chains
        return (HOLD_WAIT if key in c.waiting else 0) | (HOLD_REMOTE if key in c.remote else 0)

    def _sync_holds(self, key: str) -> None:
        """Tell the index what besides its children holds ``key``."""
        if self.chain_eviction:
            self.index.set_holds(key, self._hold_bits(key))

    def wait_child(self, parent: str) -> None:
        """A put naming ``parent`` started: it holds the parent until it ends."""
        if parent:
            self.chains.wait(parent)
            self._sync_holds(parent)

    def unwait_child(self, parent: str) -> None:
        if parent:
            self.chains.unwait(parent)
            self._sync_holds(parent)

    def remote_link(self, parent: str, child: str, now: float) -> None:
        """Another master shard linked ``child`` to ``parent`` (this shard's key)."""
        self.chains.remote_link(parent, child, self.__contains__, now)
        self._sync_holds(parent)

    def remote_unlink(self, parent: str, child: str) -> None:
        self.chains.remote_unlink(parent, child)
        self._sync_holds(parent)

    def remote_sync(self, shard: int, links, now: float) -> None:
        """Every link ``shard`` holds to this shard's keys, replacing what it said."""
        before = set(self.chains.remote)
        self.chains.remote_sync(shard, links, self.__contains__, now)
        for parent in before.symmetric_difference(self.chains.remote):
            self._sync_holds(parent)

    def stored_natively_run(self, entries: list) -> None:
        """The read index committed these keys, a run of log entries in order (``e[1]`` the
        key, ``e[7]`` its parent; each record is in the index already, where the insertion
        policy put it, linked to its parent). A key naming no parent has anything to do only where a chain
        knows of it (a child waiting, a link held elsewhere, a key lost with a node)."""
        chains = self.chains
        if not (chains.lost or chains.kids or chains.waiting or chains.remote or chains.parent) and \
                not any(e[7] for e in entries):
            return
        linked = self._linked
        for e in entries:  # (a link made earlier in the run may concern a later key)
            if e[7] or chains.lost or chains.kids or chains.waiting or chains.remote or chains.parent:
                linked(e[1], e[7], native=True)

    def restored_plain(self, keys: list[str]) -> None:
        """These keys came back cold with a mounting node, naming no parent
        (``ReplicaTable.restore_plain``): their chain links, where any refer to them
        (children waiting for them, links another shard holds, keys lost with a node)."""
        chains = self.chains
        if chains.lost or chains.kids or chains.waiting or chains.remote or chains.parent:
            for key in keys:
                self._linked(key, "")

    def dropped_natively(self, keys: list[str]) -> None:
        """The read index dropped these keys (its eviction)."""
        if self.chains.parent or self.chains.kids or self.chains.remote:
            self.chains.gone_many(keys)

    def __len__(self) -> int:
        return len(self.index)

    def __iter__(self) -> Iterator[str]:
        return iter(self.index.keys(""))

    def keys_with_prefix(self, prefix: str) -> list[str]:
        return self.index.keys(prefix)

    def hot(self, key: str) -> Obj | None:
        """The object if it is hot (never hydrates)."""
        return self._hot.get(key)

    def peek(self, key: str) -> Obj | None:
        """The object, without hydrating: the hot one, or a copy of a cold record (changes
        to the copy are lost)."""
        obj = self._hot.get(key)
        if obj is not None:
            return obj
        rec = self.index.peek_cold(key)
        if rec is None:
            return None
        obj = _obj(key, rec)
        obj.parent = self.chains.parent.get(key, "")
        return obj

    def items(self) -> Iterator[tuple[str, Obj]]:
        """Every ``(key, object)``, least recent first, without hydrating (``peek``)."""
        for key in self.index.keys(""):
            obj = self.peek(key)
            if obj is not None:
                yield key, obj

    def values(self) -> Iterator[Obj]:
        return (obj for _key, obj in self.items())

    def hot_items(self) -> list[tuple[str, Obj]]:
        return list(self._hot.items())

    # ---------------------------------------------------------------- recency --
    def touch(self, key: str) -> None:
        """A use (publish, a hit): the key goes to the recent end."""
        self.index.touch(key)

    def drop_many(self, keys: list[str]) -> None:
        """Forget these keys (an eviction batch), hot or cold."""
        if keys:
            hot = self._hot
            for key in keys:
                hot.pop(key, None)
            self.index.drop_many(keys)
            self.dropped_natively(keys)

    def scan(self, node_id: str, tier: Tier, now: float) -> Iterator[tuple[str, tuple | None]]:
        """Eviction candidates on ``node_id`` in ``tier``, least recent first: ``(key,
        None)`` for a hot object (the caller decides), ``(key, (gen, size, offset,
        length))`` for a cold one whose leases have ended."""
        after, disk = "", tier is _DISK
        while True:
            items, after = self.index.scan(after, node_id, disk, now, SCAN_BATCH)
            yield from items
            if after is None:
                return

    def cold_gens_on_node(self, node_id: str, except_incarnation: str = "") -> list[tuple[str, bool, int]]:
        """``(key, on disk, gen)`` of the cold records with their replica on ``node_id``
        (not those on its incarnation ``except_incarnation``, when given)."""
        return self.index.cold_gens_on_node(node_id, except_incarnation)

    def cold_on_node(self, node_id: str, except_incarnation: str = "") -> list[str]:
        """Keys of the cold records with their replica on ``node_id`` (not those on its
        incarnation ``except_incarnation``, when given)."""
        return [key for key, _disk in self.index.cold_on_node(node_id, except_incarnation)]

    # -------------------------------------------------------------- hot / cold --
    def answer(self, obj: Obj) -> list:
        """What a GET of ``obj`` answers: its ready DRAM replicas."""
        nodes, out = self._nodes, []
        for r in obj.replicas:
            if r.tier is _DRAM and r.ready:
                node = nodes[r.node_id]
                out.append((r.node_id, node.ray_node_id, r.offset, r.length, node.incarnation, r.placed))
        return out

    def sync(self, key: str) -> None:
        """A hot object's GET answer changed: tell the index (cold records answer for
        themselves, and a dropped key's record went with it)."""
        obj = self._hot.get(key)
        if obj is not None:
            self.index.set(key, obj.size, obj.gen, self.answer(obj))

    def flush(self) -> int:
        """Write the plain objects touched since the last flush back cold; returns how
        many. The actor calls it at the end of each section (index mutex held)."""
        hot, index, nodes, n = self._hot, self.index, self._nodes, 0
        for key in self._dirty:
            obj = hot.get(key)
            if (obj is None or obj.pin is not Pin.NONE or len(obj.replicas) != 1 or not obj.complete
                    or obj.want > 1):
                continue
            r = obj.replicas[0]
            held = obj.leases
            node = nodes.get(r.node_id)
            if not r.ready or r.offloading or node is None:
                continue
            if held is None:
                leases = []
            elif type(held) is int:
                leases = [held]
            elif len(held) <= 2:
                leases = sorted(held)
            else:
                continue
            index.set_cold(key, obj.size, obj.gen, r.node_id, node.ray_node_id, node.incarnation, r.tier is _DISK,
                           r.offset, r.length, r.placed, obj.lease_until, leases)
            del hot[key]
            n += 1
        self._dirty.clear()
        return n

    def rebind(self, index) -> None:
        """Move every record to ``index`` (a new read index), in recency order."""
        old, nodes = self.index, self._nodes
        for key in old.keys(""):
            obj = self._hot.get(key)
            if obj is not None:
                index.set(key, obj.size, obj.gen, self.answer(obj))
                continue
            size, gen, node_id, disk, offset, length, placed, lease_until, leases = old.peek_cold(key)
            node = nodes[node_id]
            index.set_cold(key, size, gen, node_id, node.ray_node_id, node.incarnation, disk, offset, length,
                           placed, lease_until, leases)
        self.index = index
        if self.chain_eviction:
            index.set_chain_links(True)
            for key, parent in self.chains.parent.items():
                index.link(key, parent)
            for key in {*self.chains.waiting, *self.chains.remote}:
                self._sync_holds(key)

    def check(self, unapplied=frozenset()) -> None:
        """Assert the hot objects and the index's hot records are the same keys, and the
        chain links agree with the table (``unapplied``: keys the index committed that the
        state machine has not seen yet)."""
        index = self.index
        assert all(index.is_hot(k) for k in self._hot), "a hot object without a hot record"
        hot_records = len(index) - index.cold_count()
        assert hot_records == len(self._hot), f"{hot_records} hot records, {len(self._hot)} hot objects"
        chains = self.chains
        chains.check(lambda k: k in self and k not in unapplied)
        if self.chain_eviction:  # the index's links are the table's
            for key, parent in chains.parent.items():
                if key in unapplied:
                    continue
                want = parent if parent in self and parent not in unapplied else ""
                got = index.chain_of(key)[0]
                assert got == want, f"{key!r} is linked to {got!r} in the index, names {want!r}"
            for key in {*chains.waiting, *chains.remote}:
                if key in self and key not in unapplied:
                    assert index.chain_of(key)[2] == self._hold_bits(key), f"{key!r}: hold bits wrong in the index"


def _obj(key: str, rec: tuple) -> Obj:
    """A hot ``Obj`` from a cold record's fields."""
    size, gen, node_id, disk, offset, length, placed, lease_until, leases = rec
    held = None if not leases else leases[0] if len(leases) == 1 else set(leases)
    return Obj(key, size, gen, [Replica(node_id, _DISK if disk else _DRAM, offset, length, placed=placed)],
               complete=True, lease_until=lease_until, leases=held)
