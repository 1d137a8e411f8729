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
- ``waiting``: keys named by puts in flight (a put holds its parent as a child does);
- ``lost``: keys that went with a store node the master unmounted (missed heartbeats) and
  that may come back with it (its kept arena, its spill directory): their orphans are held,
  not dropped at a tick, and other shards are not told they went, until the node remounts
  or the master stops waiting for it (``MasterState.unmount``). Eviction still takes such
  orphans first when it needs room.

With ``master.chain_eviction`` on, an eviction pass takes leaves first (``Picker``, and the
read index's own pass over its cold records, ``MasterIndex.evict_cold``, which keeps the
same links between its records: ``ObjectTable._linked``): a value
is held while a child of it is stored, and the pass takes the least recent leaf each time.
A parent stored before its children is older than them, so once its last child is taken
it is the least recent leaf and goes next, before the pass moves on; a prefix read (a
batch GET of a chain's pages in order) uses its hits last to first
(``MasterIndex::serve``), so a chain read back has its end the least recent of it and the
pass meets it end first. Either way a chain goes from its end toward its start, the least
recent chain first, and the pages a conversation just saved are the last to go. (Taking one round of leaves first, each
chain's tail, then the next round, cut the newest conversations' tails before the oldest
conversations' second pages: a recency-friendly workload served 66.6% against plain
LRU's 83.5%, benchmarks/bench_chains.py.) Only a pass that frees nothing else takes a
value whose children are stored ("forced": their leases or pins hold every leaf, or they
live on other nodes), and its tail then goes as orphans.

Chains cross master shards (``master.shards > 1``): a value's parent may be owned by
another shard. The child's shard links it as any other (``parent``, ``kids``) but cannot see
the parent: it treats it as stored until told otherwise (``foreign_gone``). The parent's
shard keeps ``remote`` (its key -> the child keys other shards hold), which hold the parent
as local children do. The two learn of each other through messages (``outbox``, applied by
``remote_link`` / ``remote_unlink`` / ``remote_sync`` and ``foreign_status``) that the
master actors exchange a few times a second: a child's shard says when a child is linked
or unlinked (and, after either side restarts, every link it holds: ``foreign_links``); a
parent's shard says when a parent with remote children goes (they become orphans there)
or comes back. A link to a parent that is not stored is reported gone only after
``grace_s`` (the parent's put may still be on its way: a batch's parts run on their
shards at the same time).

On one shard of four, three in four pages have their child elsewhere, so a chain's leaf is
seldom here to take and most of a shard's pages on probation (never read) are held. The
read index's pass (``MasterIndex.evict_cold``) therefore takes, when it leaves the records
on probation short of its need, those that nothing but remote children holds, least
recent first, before any read page: a page never read goes before a read one, as on one
shard. Their children elsewhere go as orphans. (Python's ``Picker``, which judges the hot
values and a node with a spill tier, holds them as before.)
"""

from __future__ import annotations

from typing import Callable

from mooncake_ray.errors import InvalidArgumentError
from mooncake_ray._private.checks import check_records
from mooncake_ray._private.shards import shard_of

# Messages between shards (``Chains.outbox`` items: ``(shard, kind, parent, child)``).
LINK, UNLINK, GONE, BACK = "link", "unlink", "gone", "back"
CHAIN_KINDS = (LINK, UNLINK, GONE, BACK)


class Chains:
    """The chain links of the stored values (see the module docstring). ``shard`` of
    ``shards``: which keys are this master's own (the others' are foreign)."""

    __slots__ = ("parent", "kids", "orphans", "counters", "waiting", "shard", "shards", "remote", "foreign_gone",
                 "outbox", "missing", "grace_s", "remote_holds", "lost")

    def __init__(self, counters: dict | None = None, shard: int = 0, shards: int = 1, grace_s: float = 0.25) -> None:
        self.parent: dict[str, str] = {}
        self.kids: dict[str, set[str]] = {}
        self.orphans: set[str] = set()
        self.waiting: dict[str, int] = {}  # key -> puts in flight naming it (they hold it too)
        self.counters = counters if counters is not None else {}
        self.counters.setdefault("chain_tail_evictions", 0)
        self.shard, self.shards = shard, shards
        self.remote: dict[str, set[str]] = {}  # own key -> child keys other shards hold
        self.foreign_gone: set[str] = set()  # foreign parents their shard said are not stored
        self.outbox: list[tuple[int, str, str, str]] = []  # (shard, kind, parent, child) to send
        self.missing: dict[str, float] = {}  # own key linked remotely while not stored -> since when
        self.grace_s = grace_s
        self.remote_holds = True
        self.lost: set[str] = set()  # went with an unmounted node that may bring them back

    def foreign(self, key: str) -> bool:
        """Whether another shard owns ``key``."""
        return self.shards > 1 and shard_of(key, self.shards) != self.shard

    def stored(self, key: str, parent: str, is_stored: Callable[[str], bool]) -> str | None:
        """``key`` is stored now (new, or a new value of it) naming ``parent`` ("" none).
        Returns the parent if it just gained its first child (the table keeps such a
        parent where eviction judges it)."""
        old = self.parent.get(key)
        if old is not None and old != parent:
            self._unlink(key, old)
        self.lost.discard(key)
        kids = self.kids.get(key)
        if kids:
            self.orphans.difference_update(kids)  # their parent is back
        if key in self.remote:  # and so are theirs, on other shards
            self.missing.pop(key, None)
            self._tell(key, BACK)
        if not parent:
            self.orphans.discard(key)
            return None
        self.parent[key] = parent
        sibs = self.kids.get(parent)
        first = not sibs
        if sibs is None:
            sibs = self.kids[parent] = set()
        sibs.add(key)
        if self.foreign(parent):
            if old != parent:
                self.outbox.append((shard_of(parent, self.shards), LINK, parent, key))
            if parent in self.foreign_gone:
                self.orphans.add(key)
            else:
                self.orphans.discard(key)
            return None
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
        if key in self.remote and key not in self.lost:
            self._tell(key, GONE)
        parent = self.parent.pop(key, None)
        if parent is None:
            return None
        return parent if self._unlink(key, parent) else None

    def gone_many(self, keys) -> None:
        """``gone`` for each key, in order (what the read index's eviction dropped): the
        same state, with a shard's own parents unlinked inline. An eviction takes a chain
        from its leaf, so nearly every key unlinks itself from a parent it leaves empty."""
        orphans, kids_of, parents, remote = self.orphans, self.kids, self.parent, self.remote
        sharded = self.shards > 1
        for key in keys:
            orphans.discard(key)
            kids = kids_of.get(key)
            if kids:
                orphans.update(kids)
            if remote and key in remote and key not in self.lost:
                self._tell(key, GONE)
            parent = parents.pop(key, None)
            if parent is None:
                continue
            if sharded:
                self._unlink(key, parent)
                continue
            sibs = kids_of.get(parent)
            if sibs is not None:
                sibs.discard(key)
                if not sibs:
                    del kids_of[parent]

    def _unlink(self, key: str, parent: str) -> bool:
        """Drop ``key`` from its parent's children; True if it was the last (of a
        parent of this shard's own)."""
        sibs = self.kids.get(parent)
        if sibs is None:
            return False
        sibs.discard(key)
        foreign = self.foreign(parent)
        if foreign:
            self.outbox.append((shard_of(parent, self.shards), UNLINK, parent, key))
        if sibs:
            return False
        del self.kids[parent]
        if foreign:
            self.foreign_gone.discard(parent)
            return False
        return True

    # ------------------------------------------------------- across shards --
    def _tell(self, key: str, kind: str) -> None:
        """Tell every shard holding children of own ``key`` that it went or came back."""
        for shard in {shard_of(c, self.shards) for c in self.remote[key]}:
            self.outbox.append((shard, kind, key, ""))

    def remote_link(self, parent: str, child: str, is_stored: Callable[[str], bool], now: float) -> bool:
        """Another shard linked ``child`` to own ``parent``. True if that is the first
        thing to hold the parent (the table keeps it where eviction judges it)."""
        held = self.holds(parent)
        kids = self.remote.get(parent)
        if kids is None:
            kids = self.remote[parent] = set()
        kids.add(child)
        if not is_stored(parent):
            self.missing.setdefault(parent, now)
        return not held

    def remote_unlink(self, parent: str, child: str) -> bool:
        """Another shard's ``child`` of own ``parent`` went (or names another parent).
        True if nothing holds the parent any more."""
        kids = self.remote.get(parent)
        if kids is None:
            return False
        kids.discard(child)
        if kids:
            return False
        del self.remote[parent]
        self.missing.pop(parent, None)
        return not self.holds(parent)

    def remote_sync(self, shard: int, links, is_stored: Callable[[str], bool], now: float) -> tuple[list, list]:
        """Every link ``(parent, child)`` that ``shard`` holds to own parents, replacing
        what it said before (it, or this master, restarted); the stored parents among them
        are said to be back. Returns the parents now held and those no longer held."""
        before = {p for p in self.remote if self.holds(p)}
        for parent in list(self.remote):
            kids = {c for c in self.remote[parent] if shard_of(c, self.shards) != shard}
            if kids:
                self.remote[parent] = kids
            else:
                del self.remote[parent]
                self.missing.pop(parent, None)
        back = set()
        for parent, child in links:
            self.remote_link(parent, child, is_stored, now)
            if is_stored(parent):
                back.add(parent)
        # ``shard`` may have heard that one went (before this master restarted, say)
        self.outbox.extend((shard, BACK, parent, "") for parent in sorted(back))
        after = {p for p in self.remote if self.holds(p)}
        return sorted(after - before), sorted(p for p in before - after if not self.holds(p))

    def due(self, now: float, is_stored: Callable[[str], bool]) -> None:
        """Report gone the parents linked remotely while not stored, once ``grace_s``
        has passed and they still are not."""
        for parent, since in list(self.missing.items()):
            if now - since >= self.grace_s:
                del self.missing[parent]
                if parent in self.remote and not is_stored(parent) and parent not in self.lost:
                    self._tell(parent, GONE)

    def held(self, key: str) -> bool:
        """Whether orphan ``key`` waits for its parent to come back with a store node."""
        return self.parent.get(key) in self.lost

    def release_lost(self, keys, is_stored: Callable[[str], bool]) -> None:
        """The node that took ``keys`` remounted (those it brought back are stored again)
        or is no longer waited for: the rest went for good, and other shards holding their
        children are told."""
        for key in keys:
            if key in self.lost:
                self.lost.discard(key)
                if key in self.remote and not is_stored(key):
                    self._tell(key, GONE)

    def foreign_status(self, parent: str, stored: bool) -> None:
        """The shard owning ``parent`` says it went (its children here become orphans)
        or came back."""
        kids = self.kids.get(parent)
        if not kids:
            return
        if stored:
            self.foreign_gone.discard(parent)
            self.orphans.difference_update(kids)
        else:
            self.foreign_gone.add(parent)
            self.orphans.update(kids)

    def check_messages(self, shard, items, links) -> None:
        """That chain messages (and whole links) from master ``shard`` fit the wire and the
        shards: a link names this shard's parent and the sender's child, "gone" / "back"
        the sender's parent.

        Raises:
            InvalidArgumentError: naming the first that does not.
        """
        if type(shard) is not int or not 0 <= shard < self.shards or shard == self.shard:
            raise InvalidArgumentError(f"chain messages from shard {shard!r}: this is shard {self.shard} "
                                       f"of {self.shards}")
        check_records(items, (str, str, str), "chain message")
        if links is not None:
            check_records(links, (str, str), "chain link")
        for m in items:
            kind, parent, child = m
            if kind not in CHAIN_KINDS:
                raise InvalidArgumentError(f"chain message {m!r:.120}: its kind is one of {CHAIN_KINDS}")
            if (self.foreign(parent) or shard_of(child, self.shards) != shard if kind in (LINK, UNLINK)
                    else shard_of(parent, self.shards) != shard):
                raise InvalidArgumentError(f"chain message {m!r:.120} from shard {shard} names keys of other shards")
        for link in links or ():
            if self.foreign(link[0]) or shard_of(link[1], self.shards) != shard:
                raise InvalidArgumentError(f"chain link {link!r:.120} from shard {shard} names keys of other shards")

    def foreign_links(self, shard: int) -> list[tuple[str, str]]:
        """Every ``(parent, child)`` link here to a parent ``shard`` owns."""
        return [(p, c) for p, kids in self.kids.items()
                if self.foreign(p) and shard_of(p, self.shards) == shard for c in kids]

    def kid_count(self, key: str) -> int:
        """What holds ``key`` in an eviction pass: its children here and puts in flight
        naming it, and its children on other shards while ``remote_holds``."""
        kids = self.kids.get(key)
        n = (len(kids) if kids else 0) + self.waiting.get(key, 0)
        if self.remote_holds:
            remote = self.remote.get(key)
            n += len(remote) if remote else 0
        return n

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
        return key in self.kids or key in self.waiting or key in self.remote

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
            gone = parent in self.foreign_gone if self.foreign(parent) else not is_stored(parent)
            assert (key in self.orphans) == gone, f"{key!r}: orphan flag wrong"
        for parent in self.foreign_gone:
            assert self.kids.get(parent), f"foreign parent {parent!r} marked gone without children here"
        for parent, kids in self.remote.items():
            assert kids and not self.foreign(parent), f"remote children of {parent!r} listed wrong"
        for parent, kids in self.kids.items():
            assert kids, f"{parent!r} has an empty child set"
            for k in kids:
                assert self.parent.get(k) == parent, f"{k!r} listed under {parent!r} but names another"
        for k in self.orphans:
            assert k in self.parent, f"orphan {k!r} names no parent"
        for k in self.lost:
            assert not is_stored(k), f"{k!r} is stored but held as lost with a node"


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
