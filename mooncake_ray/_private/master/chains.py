"""KV chains (pure, no Ray): which stored values name which parent, and the order in
which eviction may take them.

A KV page is useful only while every page before it is stored: a prefix lookup stops at
the first miss. A put may name its ``parent`` (the previous page's key); the master keeps,
for the values stored now,

- ``parent``: key -> the parent it named;
- ``kids``: key -> the stored keys naming it (the key itself need not be stored: a child
  published before its parent, or whose parent went, waits here);
- ``orphans``: stored keys whose parent is not stored. Nothing can reach them through a
  prefix lookup, so eviction takes them first (``eviction.take_orphans``) and
  ``ReplicaTable.drop_orphans`` drops them at each eviction and tick;
- ``waiting``: keys named by puts in flight (a put holds its parent as a child does).

With ``master.chain_eviction`` on, an eviction pass takes leaves first (``Picker``): a value
is held while a child of it is stored, and the pass takes the least recent leaf each time.
A parent is older than its children (it was stored or read before them), so once its last
child is taken it is the least recent leaf and goes next, before the pass moves on: a
chain goes from its end toward its start, the least recent chain first, and the pages a
conversation just saved are the last to go. (Taking one round of leaves first, each
chain's tail, then the next round, cut the newest conversations' tails before the oldest
conversations' second pages: a recency-friendly workload served 66.6% against plain
LRU's 83.5%, benchmarks/bench_chains.py.) Only a pass that frees nothing else takes a
value whose children are stored ("forced": their leases or pins hold every leaf, or they
live on other nodes), and its tail then goes as orphans.

Chains are per master shard: a parent that hashes to another shard is not named (the
client drops it), so with ``master.shards > 1`` only the links inside one shard hold.
"""

from __future__ import annotations

from typing import Callable


class Chains:
    """The chain links of the stored values (see the module docstring)."""

    __slots__ = ("parent", "kids", "orphans", "counters", "waiting")

    def __init__(self, counters: dict | None = None) -> None:
        self.parent: dict[str, str] = {}
        self.kids: dict[str, set[str]] = {}
        self.orphans: set[str] = set()
        self.waiting: dict[str, int] = {}  # key -> puts in flight naming it (they hold it too)
        self.counters = counters if counters is not None else {}
        self.counters.setdefault("chain_tail_evictions", 0)

    def stored(self, key: str, parent: str, is_stored: Callable[[str], bool]) -> str | None:
        """``key`` is stored now (new, or a new value of it) naming ``parent`` ("" none).
        Returns the parent if it just gained its first child (the table keeps such a
        parent where eviction judges it)."""
        old = self.parent.get(key)
        if old is not None and old != parent:
            self._unlink(key, old)
        kids = self.kids.get(key)
        if kids:
            self.orphans.difference_update(kids)  # their parent is back
        if not parent:
            self.orphans.discard(key)
            return None
        self.parent[key] = parent
        sibs = self.kids.get(parent)
        first = not sibs
        if sibs is None:
            sibs = self.kids[parent] = set()
        sibs.add(key)
        if is_stored(parent):
            self.orphans.discard(key)
            return parent if first else None
        self.orphans.add(key)
        return None

    def gone(self, key: str) -> str | None:
        """``key`` is no longer stored. Its stored children become orphans. Returns its
        parent if the parent lost its last child."""
        self.orphans.discard(key)
        kids = self.kids.get(key)
        if kids:
            self.orphans.update(kids)
        parent = self.parent.pop(key, None)
        if parent is None:
            return None
        return parent if self._unlink(key, parent) else None

    def _unlink(self, key: str, parent: str) -> bool:
        """Drop ``key`` from its parent's children; True if it was the last."""
        sibs = self.kids.get(parent)
        if sibs is None:
            return False
        sibs.discard(key)
        if sibs:
            return False
        del self.kids[parent]
        return True

    def kid_count(self, key: str) -> int:
        """Children stored, and puts in flight naming ``key``."""
        kids = self.kids.get(key)
        return (len(kids) if kids else 0) + self.waiting.get(key, 0)

    def wait(self, parent: str) -> bool:
        """A put naming ``parent`` started; True if it is the first thing to hold it."""
        n = self.waiting.get(parent, 0)
        self.waiting[parent] = n + 1
        return n == 0 and parent not in self.kids

    def unwait(self, parent: str) -> None:
        """That put ended (published, revoked or failed)."""
        n = self.waiting.get(parent, 0) - 1
        if n > 0:
            self.waiting[parent] = n
        else:
            self.waiting.pop(parent, None)

    def holds(self, key: str) -> bool:
        return key in self.kids or key in self.waiting

    def tail(self, key: str) -> list[str]:
        """Every stored descendant of ``key`` (its chain's tail), nearest first."""
        out, todo, seen = [], [key], {key}
        while todo:
            nxt = []
            for k in todo:
                for c in self.kids.get(k, ()):
                    if c not in seen:
                        seen.add(c)
                        out.append(c)
                        nxt.append(c)
            todo = nxt
        return out

    def check(self, is_stored: Callable[[str], bool]) -> None:
        """Assert the links agree with themselves and with the table."""
        for key, parent in self.parent.items():
            assert is_stored(key), f"{key!r} has a parent link but is not stored"
            assert key in self.kids.get(parent, ()), f"{key!r} is missing from its parent's children"
            assert (key in self.orphans) == (not is_stored(parent)), f"{key!r}: orphan flag wrong"
        for parent, kids in self.kids.items():
            assert kids, f"{parent!r} has an empty child set"
            for k in kids:
                assert self.parent.get(k) == parent, f"{k!r} listed under {parent!r} but names another"
        for k in self.orphans:
            assert k in self.parent, f"orphan {k!r} names no parent"


class Picker:
    """Victims of one eviction pass on one node, leaves first (see the module docstring).

    ``offer`` / ``take`` choose an item; a value held (``hold``) while a child of it is
    stored is taken as soon as its last child is (``take``, ``childless``): it is older
    than every item the scan meets after it. Items are whatever the caller evicts (``(obj, rep)`` or a cold record's
    tuple); lengths count toward the need.

    ``need``: what the pass aims to free (a round frees ahead of the allocations to come);
    ``must``: what the allocation it serves cannot do without (default ``need``; 0 for a
    round that only frees ahead). Unpinned leaves go up to ``need``; soft-pinned values and
    forced evictions only up to ``must``, so a pin never yields to room freed in advance.
    """

    def __init__(self, chains: Chains | None, need: int, must: int | None = None) -> None:
        self.chains = chains
        self.need = need
        self.must = need if must is None else min(must, need)
        self.freed = 0
        self.chosen: list = []
        self.held: dict[str, tuple] = {}  # key -> (item, length), in the order met (LRU)
        self._taken: dict[str, int] = {}  # parent -> children chosen in this pass
        self.cascade = True  # the scan's leaves take their parents (not pinned values: close)
        self._met: dict[str, int] = {}  # held key -> when the scan met it (least recent first)

    def done(self) -> bool:
        return self.freed >= self.need

    def blocks(self, key: str, last_copy: bool) -> bool:
        """Whether ``key`` must wait for its children (it has stored children not chosen
        yet, and this is its last copy)."""
        c = self.chains
        return (c is not None and last_copy
                and c.kid_count(key) > self._taken.get(key, 0))

    def hold(self, key: str, item, length: int) -> None:
        self.held[key] = (item, length)
        self._met[key] = len(self._met)

    def offer(self, obj, rep) -> None:
        """A hot object's evictable replica: taken, or held while children of it stay."""
        if self.blocks(obj.key, len(obj.replicas) == 1):
            self.hold(obj.key, (obj, rep), rep.length)
        else:
            self.take(obj.key, (obj, rep), rep.length)

    def close(self, soft: list, protected: Callable[[str], bool] | None = None) -> int:
        """The end of a pass: the next rounds of leaves (``finish``), then, only while less
        than ``must`` was freed, the soft-pinned candidates (``(obj, rep)``) and the values
        they held, and if nothing at all was freed, the held values (``force``). Returns
        how many were forced."""
        self.finish()
        self.cascade = False  # a soft-pinned value's parents only up to ``must`` (finish)
        for obj, rep in soft:
            if self.freed >= self.must:
                break
            self.offer(obj, rep)
        self.finish(self.must)
        if self.freed or self.chains is None or not self.must:
            return 0
        return self.force(protected)

    def take(self, key: str, item, length: int) -> None:
        """Choose ``item`` (``key``'s). A held parent it leaves childless is the least
        recent leaf now: taken next, while the pass needs more."""
        self.chosen.append(item)
        self.freed += length
        c = self.chains
        parent = c.parent.get(key) if c is not None else None
        if parent is not None:
            self._taken[parent] = self._taken.get(parent, 0) + 1
            self.childless([parent])

    def childless(self, parents) -> None:
        """Take the held values among ``parents`` left with no child (children chosen,
        or dropped by the index), least recent first, while the pass needs more."""
        c, held = self.chains, self.held
        if c is None or not held or not self.cascade:
            return
        met = self._met
        for key in sorted((k for k in parents if k in held), key=met.__getitem__):
            if self.freed >= self.need:
                return
            if key in held and c.kid_count(key) <= self._taken.get(key, 0):
                self.take(key, *held.pop(key))

    def finish(self, upto: int | None = None) -> None:
        """The scan is over and the need (or ``upto``) not met: the next round of leaves,
        the held values left with no child (least recent first), and so on."""
        c = self.chains
        if c is None:
            return
        upto = self.need if upto is None else upto
        progress = True
        while progress and self.freed < upto:
            progress = False
            for key in list(self.held):
                if self.freed >= upto:
                    return
                if c.kid_count(key) <= self._taken.get(key, 0):
                    self.take(key, *self.held.pop(key))
                    progress = True

    def force(self, protected: Callable[[str], bool] | None = None) -> int:
        """Nothing else could be freed (the leaves are read, pinned, or on other nodes):
        take held values, least recent first, although children of theirs are stored
        (their tails go as orphans); first those whose tail holds no pinned value
        (``protected``). Returns how many."""
        n = 0
        for last in (False, True):
            for key in list(self.held):
                if self.freed >= self.must:
                    return n
                if not last and protected is not None and protected(key):
                    continue
                item, length = self.held.pop(key)
                self.chosen.append(item)
                self.freed += length
                n += 1
        return n
