"""The location cache: where the values this client wrote or read live, so that a single
get can read the bytes while the master's lookup is in flight (see ``reads.Reader.get_one``).
Bounded; entries go stale harmlessly (a stale one only costs a dropped read)."""

from __future__ import annotations

from typing import NamedTuple

LOC_CACHE_KEYS = 1 << 16  # location cache entries (~150 bytes each)

_new = tuple.__new__  # builds a record from a sequence without re-checking its arity


class Loc(NamedTuple):
    """Where one value was last seen (see wire.ReplicaLoc for the fields)."""

    size: int
    gen: int
    node_id: str
    offset: int
    incarnation: str
    placed: int


class LocationCache:
    """key -> ``Loc`` of values this client wrote or read lately: at most ``LOC_CACHE_KEYS``.

    Two generations of plain dicts: new entries go into the young one; when it holds half
    the bound it becomes the old one and the previous old one is dropped whole, so the cache
    keeps between half the bound and the bound of the most recently remembered keys. A
    lookup tries the young generation first (a key remembered again is there). Adding a
    batch is one C call, and nothing is evicted entry by entry: an OrderedDict trimmed with
    ``popitem`` per put cost 0.25 us a key at the bound (17% of a client's CPU putting
    1,000-value batches of 256 B); a dict trimmed with next(iter(d)) walked the dead slots
    its deletions left (8.4 us a put at 65k entries). Every operation is a dict call or two,
    so threads need no lock: a race loses at most a generation, which only costs lookups."""

    def __init__(self, bound: int = LOC_CACHE_KEYS):
        self._half = max(1, bound // 2)
        self._young: dict = {}
        self._old: dict = {}

    def get(self, key: str, default=None):
        loc = self._young.get(key)
        if loc is None:
            loc = self._old.get(key, default)
        return loc

    def __getitem__(self, key: str) -> Loc:
        loc = self.get(key)
        if loc is None:
            raise KeyError(key)
        return loc

    def __setitem__(self, key: str, loc: Loc) -> None:
        self._young[key] = loc
        self._rotate()

    def __contains__(self, key: str) -> bool:
        return key in self._young or key in self._old

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def _rotate(self) -> None:
        if len(self._young) >= self._half:
            self._old, self._young = self._young, {}

    def remember(self, key: str, size: int, gen: int, node_id: str, offset: int, inc: str,
                 placed: int) -> None:
        self._young[key] = _new(Loc, (size, gen, node_id, offset, inc, placed))
        self._rotate()

    def remember_many(self, entries: list) -> None:
        """``remember`` of many values at once: ``entries`` are ``(key, Loc)`` pairs."""
        if len(entries) < self._half - len(self._young):
            self._young.update(entries)
            return
        i = 0
        while i < len(entries):  # up to each generation's room
            room = max(1, self._half - len(self._young))
            self._young.update(entries[i:i + room])
            i += room
            self._rotate()

    def pop(self, key: str, default=None):
        a = self._young.pop(key, None)
        b = self._old.pop(key, None)
        return a if a is not None else (b if b is not None else default)

    def clear(self) -> None:
        self._young, self._old = {}, {}

    def forget_prefix(self, prefix: str) -> None:
        # Not needed for correctness (a stale location only costs a dropped read), but
        # removed keys should not cost one.
        for d in (self._young, self._old):
            for k in [k for k in list(d) if k.startswith(prefix)]:
                d.pop(k, None)
