"""What one store node holds, and how the master's messages change it (pure, no Ray).

DRAM entries are written only by the master: a node cannot tell a finished put from an
abandoned one, so it records what the master says it holds. Reserved entries are ranges
of the arena the master handed out for writing (put slabs, pending puts): a restarted
master keeps them out of its allocations until no client can still write there. Disk entries are written by
the node when a spill file is complete (the master learns of it from OFFLOAD_DONE) and
deleted on the master's word. The whole inventory goes to the master on every mount, so a
restarted master loses nothing and a node that was unmounted comes back with its keys.

The master's messages form a stream per *mount*: each mount of a node gets a new
``mount_id`` (chosen by the node, increasing), and each message of that mount a sequence
number. The node applies a message once, in order, and answers a message of an older
mount with :data:`STALE` instead of applying it: the master then knows the message was
not applied, and re-sends it (with everything else it owed) after the remount.

Used by the store node actor (under its lock) and by the simulation, and by the master to
compute what a remounting node holds once it has applied what it was owed.
"""

from __future__ import annotations

import array
import sys
from collections.abc import MutableMapping

from mooncake_ray.errors import InvalidArgumentError
from mooncake_ray._private.master.types import RESERVED, InventoryEntry, NodeDelta

DRAM, DISK = "dram", "disk"
APPLIED = b""
STALE = b"stale"


def _entry(e) -> tuple:
    """An entry as the inventory keeps it: a plain tuple in ``InventoryEntry``'s field
    order, pin, parent and copies wanted included. Not the named tuple: CPython's
    collector stops tracking a plain tuple of strings and ints, but walks every named
    tuple at each full collection, which with millions of entries cost a store node most
    of its time."""
    n = len(e)
    return tuple(e) if n == 9 else (*e, 1) if n == 8 else (*e, "", 1) if n == 7 else (*e, 0, "", 1)


def apply_records(entries: dict, adds, drops, disk_drops: bool) -> list[tuple[str, int]]:
    """Apply a delta's drops (``entry.gen <= gen`` goes), then its adds, to ``entries``
    (``{(key, tier): entry}``, an entry a tuple in ``InventoryEntry``'s field order). DISK
    drops are returned as ``(key, gen)`` for the caller to delete the files; with
    ``disk_drops`` they also leave ``entries`` here. (A loop per record kind, no
    per-record calls: a store node applies every put's add and every eviction's drop.)"""
    files = []
    get = entries.get
    for key, gen, tier in drops:
        if tier == DISK:
            files.append((key, gen))
            if not disk_drops:
                continue
        k = (key, tier)
        e = get(k)
        if e is not None and e[1] <= gen:
            del entries[k]
    for e in adds:  # _entry inline (tuple() of a tuple, as unpacked, is that tuple: no copy)
        n = len(e)
        entries[(e[0], e[3])] = (tuple(e) if n == 9 else (*e, 1) if n == 8 else (*e, "", 1) if n == 7
                                 else (*e, 0, "", 1))
    return files


_TIERS = (DRAM, DISK, RESERVED)
_U48, _U64 = 1 << 48, 1 << 64  # an arena's offsets and lengths; generations, pins, copies


def _ints(xs) -> bool:
    return all(type(x) is int for x in xs)


def check_delta(delta) -> None:
    """Refuse a malformed message ``[adds, drops, offloads]`` as a whole: applied in part,
    it would count as applied, or keep an entry (a str gen, say) that breaks every later
    message, and one bad offload item would fail the worker's whole batch.

    Raises:
        InvalidArgumentError: naming the first malformed record.
    """
    if not (isinstance(delta, (list, tuple)) and len(delta) == 3
            and all(isinstance(part, (list, tuple)) for part in delta)):
        raise InvalidArgumentError(f"an inventory delta is [adds, drops, offloads], got {delta!r:.200}")
    adds, drops, offloads = delta
    ok_seq, ok_ints = (list, tuple), int
    for e in adds:  # InventoryEntry: key, gen, size, tier, offset, length[, pin[, parent[, want]]]
        if not (isinstance(e, ok_seq) and 6 <= len(e) <= 9 and type(e[0]) is str and e[3] in _TIERS
                and type(e[1]) is ok_ints and type(e[2]) is ok_ints and type(e[4]) is ok_ints
                and type(e[5]) is ok_ints and (len(e) == 6 or type(e[6]) is ok_ints)
                and (len(e) < 8 or type(e[7]) is str) and (len(e) < 9 or type(e[8]) is ok_ints and e[8] >= 1)
                and 0 <= e[1] < _U64 and 0 <= e[2] < _U48 and 0 <= e[4] < _U48 and 0 <= e[5] < _U48
                and (len(e) == 6 or 0 <= e[6] < _U64) and (len(e) < 9 or e[8] < _U64)):
            raise InvalidArgumentError(f"malformed inventory entry {e!r:.200}")
    for d in drops:  # key, gen, tier
        if not (type(d) in ok_seq and len(d) == 3 and type(d[0]) is str and type(d[1]) is ok_ints
                and d[2] in _TIERS and 0 <= d[1] < _U64):
            raise InvalidArgumentError(f"malformed inventory drop {d!r:.200}")
    for o in offloads:  # key, gen, size, offset, length
        if not (isinstance(o, (list, tuple)) and len(o) == 5 and type(o[0]) is str and _ints(o[1:])):
            raise InvalidArgumentError(f"malformed offload {o!r:.200}")


class _Entries(MutableMapping):
    """A node's entries by ``(key, tier)``, each a tuple in ``InventoryEntry``'s field
    order (see ``_entry``): DRAM and reserved ones in the native table (``NodeTable``: a
    log of 36-byte records and their keys, about 61 bytes a value with an 18-byte key where
    a dict of tuples took over 600), disk ones in a dict. Iterates the table's entries (in
    the order first added), then the disk's."""

    def __init__(self, table, disk: dict) -> None:
        self._table, self._disk = table, disk

    def __getitem__(self, k):
        key, tier = k
        if tier == DISK:
            return self._disk[k]
        e = self._table.get(key, tier) if tier in _TABLE_TIERS else None
        if e is None:
            raise KeyError(k)
        return e

    def __setitem__(self, k, e) -> None:
        e = _entry(e)
        if (e[0], e[3]) != tuple(k):
            raise InvalidArgumentError(f"entry {e!r:.200} stored under {k!r:.200}")
        if e[3] == DISK:
            self._disk[k] = e
        else:
            self._table.set(e)

    def __delitem__(self, k) -> None:
        key, tier = k
        if tier == DISK:
            del self._disk[k]
        elif tier not in _TABLE_TIERS or not self._table.erase(key, tier):
            raise KeyError(k)

    def __iter__(self):
        yield from self._table.keys()
        yield from list(self._disk)

    def __len__(self) -> int:
        return len(self._table) + len(self._disk)

    def values(self) -> list:
        return self._table.entries() + list(self._disk.values())


_TABLE_TIERS = (DRAM, RESERVED)


class StoreInventory:
    """A node's inventory and its position in the master's message stream. Not
    thread-safe: the store node actor holds its lock around every call.

    ``table`` (``_native.NodeTable``) holds the DRAM and reserved entries and the checksum
    of each DRAM value's bytes; ``disk`` the disk entries; ``entries`` shows both as one
    mapping."""

    def __init__(self, entries=()) -> None:
        from mooncake_ray._private.native import _native

        self.table = _native.NodeTable()
        self.disk: dict[tuple[str, str], tuple] = {}
        self.entries = _Entries(self.table, self.disk)
        for e in entries:
            e = _entry(e)
            self.entries[(e[0], e[3])] = e
        self.mount_id = 0
        self.applied_seq = 0

    def begin_mount(self, packed: bool = False) -> tuple[int, list[list] | dict]:
        """A new mount: messages of earlier mounts are refused from now on. Returns the
        new ``mount_id`` and the inventory to send with it (with ``packed``, in ``pack``'s
        form)."""
        self.mount_id += 1
        self.applied_seq = 0
        if not packed:
            return self.mount_id, self.snapshot()
        keys, cols, rest = self.table.pack()
        if sys.byteorder != "little":
            flat = array.array("q")
            flat.frombytes(cols)
            flat.byteswap()
            cols = flat.tobytes()
        return self.mount_id, {"keys": keys, "cols": cols, "rest": rest + [list(e) for e in self.disk.values()]}

    def snapshot(self) -> list[list]:
        return [list(e) for e in self.entries.values()]

    def apply(self, mount_id: int, seq: int, delta) -> tuple[bytes, list, list]:
        """Apply one message ``[adds, drops, offloads]`` of mount ``mount_id``.

        Returns ``(answer, disk_drops, offloads)``: the answer for the master
        (:data:`APPLIED`, also for a repeat of a message already applied, or
        :data:`STALE`), and the work the message asks of the disk tier (empty unless
        applied now).
        """
        if type(seq) is not int:
            raise InvalidArgumentError(f"an inventory message's seq is an int, got {seq!r}")
        if mount_id != self.mount_id:
            return STALE, [], []
        check_delta(delta)  # all of it, before any of it is applied or the seq moves
        if seq <= self.applied_seq:
            return APPLIED, [], []  # a retry of a message whose answer was late or lost
        adds, drops, offloads = delta
        try:
            files, disk_adds = self.table.apply(adds, drops)  # drops, then adds; parsed whole first
        except (ValueError, TypeError) as e:  # a key that is no UTF-8 text, say
            raise InvalidArgumentError(f"malformed inventory message: {e}") from None
        self.applied_seq = seq
        for e in disk_adds:
            e = _entry(e)
            self.disk[(e[0], DISK)] = e
        return APPLIED, files, [tuple(o) for o in offloads]

    def add_disk(self, e: InventoryEntry) -> None:
        e = _entry(e)
        dram = self.table.get(e[0], DRAM)
        if dram is not None and dram[1] == e[1]:  # an offloaded value keeps the parent and
            e = (*e[:7], e[7] or dram[7], max(e[8], dram[8]))  # the copies its DRAM entry names
        self.disk[(e[0], DISK)] = e

    def drop_disk(self, key: str, gen: int) -> None:
        """A file went (the master's drop, or found corrupt): forget it if not newer."""
        e = self.disk.get((key, DISK))
        if e is not None and e[1] <= gen:
            del self.disk[(key, DISK)]

    def counts(self) -> dict:
        used, keys, _reserved = self.table.counts()
        return {"used": used, "keys": keys, "disk_keys": len(self.disk)}


def pack(entries) -> dict:
    """An inventory as a node sends it when it mounts: ``{"keys", "cols", "rest"}``, the plain
    DRAM values (one copy asked for, unpinned, no parent: most of them) as their keys and the
    bytes of 4 little-endian int64s each (gen, size, offset, length), the rest as entry
    lists. A million entries pickle in about a tenth of the time as lists, and the master
    takes the plain ones in bulk (``replicas.split_inventory``)."""
    keys, flat, rest = [], array.array("q"), []
    add_key, add = keys.append, flat.extend
    for e in entries:
        if e[3] == DRAM and not e[6] and not e[7] and e[8] <= 1:
            add_key(e[0])
            add((e[1], e[2], e[4], e[5]))
        else:
            rest.append(list(e))
    if sys.byteorder != "little":
        flat.byteswap()
    return {"keys": keys, "cols": flat.tobytes(), "rest": rest}


def unpack(packed: dict) -> list[list]:
    """``pack``'s form as entry lists."""
    flat = array.array("q")
    flat.frombytes(packed["cols"])
    if sys.byteorder != "little":
        flat.byteswap()
    out = [[k, flat[4 * i], flat[4 * i + 1], DRAM, flat[4 * i + 2], flat[4 * i + 3], 0, "", 1]
           for i, k in enumerate(packed["keys"])]
    return out + [list(e) for e in packed["rest"]]


def reconcile(snapshot: list, owed: NodeDelta) -> list[list]:
    """What a remounting node holds once it has applied ``owed`` (the master's messages it
    may not have applied; applying one twice changes nothing): its snapshot with the
    DRAM and disk records of ``owed`` applied. Used by the master to rebuild a node it
    unmounted without trusting entries the node was told to drop."""
    entries = {(e[0], e[3]): _entry(e) for e in snapshot}
    apply_records(entries, owed.adds, owed.drops, disk_drops=True)
    return [list(e) for e in entries.values()]
