"""Where a new KV page enters the eviction order, learned from the workload (pure, no Ray).

Two insertion policies for values put with a parent (KV pages; other values always enter
at the recent end):

- ``recent``: the recent end (LRU). Right when a page is read again before the arena has
  turned over: a conversation whose next turn comes soon, a prefill's pages that a decode
  loads.
- ``old``: on probation at the old end until its first read, from where a read moves it
  to the recent end. Among the unread pages the newest goes first (LIP: a page not read
  since the arena filled has shown least that it will be), except those in a grace window
  of the newest ``GRACE`` of DRAM, which go last and first in first out: a page a reader
  is about to load (a prefill's pages that a decode reads next) is not the first to go.
  Right when more conversations take turns than the arena holds: LRU then evicts each
  conversation just before its next turn (a round over a working set larger than DRAM is
  LRU's worst case), while ``old`` keeps what was read and lets unread new pages pass
  through. A probation wholly first in first out served as little as LRU there (34.5%
  of the prompt pages against LRU's 34.0% and 55.0% newest first, in the rounds of
  tests/sim/test_eviction_workloads.py at half the working set): the new pages of many
  conversations lived long enough to be read, joined the read set, and it cycled.

No fixed choice is right for every workload, so the master runs both on a sample of the
keys: two miniature caches (Waldspurger et al., "Cache Modeling and Optimization using
Miniature Simulations", USENIX ATC '17), each sized at the sampling rate times this
master's DRAM capacity, fed the sampled references (reads and puts) in their order,
and counts each one's hits. The real order follows the one that has hit more lately
(``_decide``: a difference of hit ratios smoothed over about one cache's worth of counted
references, with a dead band so that a tie does not flap). With no pressure the two caches
hold the same keys and tie; so a second pair runs at half the capacity, feels pressure
first, and chooses until the full-size pair has evicted anything: the choice is made when
the real order starts to matter, not some time after (too late for a working set LRU has
already cycled out, or for the first handoffs). The policy starts at ``recent``: a stream
of puts that nothing reads gives the caches nothing to count, and under ``old`` it would
evict the newest values first, leaving the arena's free room in pieces that the next put
slab cannot use. Set dueling (DIP: groups of keys follow each policy, the rest follow the
winner) needs no shadow state but is biased in one fully associative order: the group
following ``old`` evicts its own new pages first whatever the other group does.

Sampling: a key is in the sample when the top ``shift`` bits of its hash are 0 (the read
index hashes, natively for the calls it answers; ``MasterIndex.sample`` for Python's).
``shift`` grows by one, halving the rate, whenever more than ``MAX_TRACKED`` sampled keys
are tracked (SHARDS's fixed-size sampling), so memory and time stay bounded at any number
of keys: at most ``MAX_TRACKED`` entries per cache and as many keys seen.

What counts as a reference: a use, as the real order sees it. A read (GET) is one: a hit
of a policy whose cache holds the key. A put of a key seen before is one too: an engine
puts a page again when this store had lost it, after computing it anew, so each policy
whose cache still holds the key would have served it; a first put counts for neither. A
lookup (EXISTS) is not a use, here as in the real order (an engine loads what its lookup
finds, and a router's or a monitor's lookups would otherwise count a request twice or
more). Both caches ignore chains (a page is a hit on its own); the real order evicts
leaves first, which changes both policies alike.
"""

from __future__ import annotations

from collections import OrderedDict

from mooncake_ray._private.master.pyindex import REF_PUT, PyIndex
from mooncake_ray._private.native import _native

MODES = ("adaptive", "recent", "old")
OFF_SHIFT = 64  # a shift that samples nothing (a fixed policy)
GRACE = 0.02  # of the DRAM capacity: the newest pages on probation, which go last of them


class MiniCache:
    """A miniature cache of sampled key hashes under one insertion policy, in bytes: the
    same order the read index keeps (``MasterIndex::probation``), without chains."""

    def __init__(self, old: bool) -> None:
        self.old = old
        self.main: OrderedDict[int, int] = OrderedDict()  # hash -> size, least recent first
        self.grace: OrderedDict[int, int] = OrderedDict()  # the newest on probation, first in first
        self.stack: OrderedDict[int, int] = OrderedDict()  # on probation before them, last in first
        self.bytes = self.grace_bytes = 0
        self.evictions = 0

    def __contains__(self, h: int) -> bool:
        return h in self.main or h in self.grace or h in self.stack

    def keys(self) -> int:
        """How many hashes it holds."""
        return len(self.main) + len(self.grace) + len(self.stack)

    def ref(self, h: int) -> bool:
        """A read of ``h``: a hit moves it to the recent end."""
        if h in self.main:
            self.main.move_to_end(h)
            return True
        size = self._unprobe(h)
        if size is None:
            return False
        self.main[h] = size
        return True

    def put(self, h: int, size: int, chained: bool, cap: int, new: bool = False) -> None:
        """``h`` stored (again; ``new``: never seen, so not here): where the policy puts it,
        then evict down to ``cap``."""
        if not new:
            self.drop(h)
        self.bytes += size
        if self.old and chained:
            self.grace[h] = size
            self.grace_bytes += size
            while self.grace_bytes > cap * GRACE:
                g, gs = self.grace.popitem(last=False)
                self.grace_bytes -= gs
                self.stack[g] = gs
        else:
            self.main[h] = size
        while self.bytes > cap:
            self.evictions += 1
            if self.stack:
                self.bytes -= self.stack.popitem(last=True)[1]
            elif self.grace:
                gs = self.grace.popitem(last=False)[1]
                self.grace_bytes -= gs
                self.bytes -= gs
            else:
                self.bytes -= self.main.popitem(last=False)[1]

    def _unprobe(self, h: int) -> int | None:
        size = self.stack.pop(h, None)
        if size is None:
            size = self.grace.pop(h, None)
            if size is not None:
                self.grace_bytes -= size
        return size

    def drop(self, h: int) -> None:
        size = self.main.pop(h, None)
        if size is None:
            size = self._unprobe(h)
        if size is not None:
            self.bytes -= size

    def keep_only(self, sampled) -> None:
        """Forget the hashes ``sampled`` rejects (the rate was halved)."""
        for h in [h for h in (*self.main, *self.grace, *self.stack) if not sampled(h)]:
            self.drop(h)

    def state(self) -> tuple:
        """(bytes, grace bytes, evictions, main order, grace window, stack), as the native
        ``PolicySim.cache_state`` gives them."""
        return self.bytes, self.grace_bytes, self.evictions, list(self.main), list(self.grace), list(self.stack)


def sampled(h: int, shift: int) -> bool:
    """Whether the sample rate 1 / 2^shift takes the key hashed to ``h``."""
    return not shift or not h >> (64 - shift)


class PolicySim:
    """The miniature caches and the references counted in them: "recent" and "old" at the
    sampled share of the capacity, and the same pair at half of it (the module docstring).
    The reference of the native ``_native.PolicySim``, which the master runs (the same
    steps; ``tests/unit/test_adaptive.py`` compares them): in Python a sample cost about
    2 us, and at the first sample rates of a put stream that was 6% of the put rate."""

    WINDOW = 64  # counted references per window

    def __init__(self) -> None:
        self.caches = (MiniCache(old=False), MiniCache(old=True))
        self.half = (MiniCache(old=False), MiniCache(old=True))
        self._seen: set[int] = set()  # sampled keys referenced so far (a put of one is a put again)
        # counted references, hits of "recent" and "old" at full size, at half size
        self.window = [0, 0, 0, 0, 0]

    @property
    def pressed(self) -> bool:
        """Whether the full-size caches have felt pressure (evicted anything)."""
        return any(c.evictions for c in self.caches)

    def tracked(self) -> int:
        return len(self._seen)

    def cache_keys(self) -> int:
        """The keys the full-size "recent" cache holds."""
        return self.caches[0].keys()

    def feed(self, samples, shift: int, capacity: int) -> list[tuple]:
        """Run the caches over ``samples`` ((hash, kind, size, chained), in order) at
        1 / 2^shift of ``capacity`` bytes; the windows that closed, each (references,
        hits of "recent", "old", the same at half size, pressed when it closed)."""
        out = []
        seen_before, window = self._seen, self.window
        cap = capacity >> shift
        caps = (cap, cap, cap // 2, cap // 2)  # the full-size pair's, then the half-size pair's
        full, both = self.caches, (*self.caches, *self.half)
        # The half-size pair decides only until the full-size pair feels pressure: from
        # then on it is not kept.
        caches = full if self.pressed else both
        for h, kind, size, chained in samples:
            if shift and h >> (64 - shift):
                continue  # taken before the rate was halved
            if caches is both and (full[0].evictions or full[1].evictions):
                caches = full
            if kind == REF_PUT:
                # Stored again: this store had lost it (or it is replaced). A policy whose
                # cache still holds it would have served it; a first put counts for neither.
                if h not in seen_before:
                    seen_before.add(h)
                    for c, c_cap in zip(caches, caps):
                        c.put(h, size, chained, c_cap, new=True)
                    continue
                hits = [h in c for c in caches]
                for c, c_cap in zip(caches, caps):
                    c.put(h, size, chained, c_cap)
            else:
                seen_before.add(h)
                hits = [c.ref(h) for c in caches]
            window[0] += 1
            for i, hit in enumerate(hits, 1):
                window[i] += hit
            if window[0] >= self.WINDOW:
                out.append((*window, self.pressed))
                window[:] = [0, 0, 0, 0, 0]
        return out

    def halve(self, bound: int, shift: int) -> int:
        """Halve the sample rate while more than ``bound`` sampled keys are tracked (to
        1 / 2^32 at most), forgetting what the new rate rejects; the new shift."""
        while len(self._seen) > bound and shift < 32:
            shift += 1
            self._seen = {h for h in self._seen if sampled(h, shift)}
        for cache in (*self.caches, *self.half):
            cache.keep_only(lambda h: sampled(h, shift))
        return shift

    def cache_state(self, i: int) -> tuple:
        return (*self.caches, *self.half)[i].state()


def new_sim(index):
    """The miniature caches for ``index``: native beside the native index, the reference
    beside the reference index."""
    return PolicySim() if isinstance(index, PyIndex) else _native.PolicySim()


class InsertionPolicy:
    """The master's choice of insertion policy (module docstring). ``old`` is what the
    read index and the table apply now; ``update`` reads the index's samples and decides."""

    MAX_TRACKED = 16384  # sampled keys remembered as seen
    # Weight of the newest window in the score: a window's share of the keys the cache
    # holds, between SMOOTH_MIN and SMOOTH, so the score averages over about one cache's
    # worth of references. A window is often one conversation's pages, which one cache
    # holds whole and the other not; with a tenth, 96 conversations taking turns at half
    # their working set (5,472 keys in the cache) swung the score from -0.18 to +0.62
    # around a mean of +0.22 and the policy turned 21 times in a run, each turn to
    # ``recent`` an LRU pass over the conversations about to speak. A fixed 0.02 held it,
    # but made four shards (a quarter of the keys each) slow to turn back when recency
    # returned (docs/internals.md, "adaptive").
    SMOOTH = 0.1
    SMOOTH_MIN = 0.02
    BAND = 0.05  # the score must pass +BAND to turn to "old", -BAND to turn back

    def __init__(self, mode: str, index) -> None:
        if mode not in MODES:
            raise ValueError(f"chain_insert must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.index = index
        self.old = mode == "old"
        self.shift = 0 if mode == "adaptive" else OFF_SHIFT
        # The caches at full size and, feeling pressure first, at half of it (they choose
        # until the full-size pair has evicted anything; see the module docstring).
        self.sim = new_sim(index)
        self.score = 0.0  # smoothed hit ratio of "old" less that of "recent", full size
        self.score_half = 0.0
        self._weight = 0.0  # the windows' total weight in the scores: they are divided by it
        self._grace = 0
        self.counters = {"refs": 0, "hits_recent": 0, "hits_old": 0, "switches": 0, "dropped": 0}
        index.set_insert_old(self.old)
        index.set_sample_shift(self.shift)

    def rebind(self, index) -> None:
        """The table moved to ``index``: it applies and samples from now on."""
        self.index = index
        if isinstance(index, PyIndex) != isinstance(self.sim, PolicySim):
            self.sim = new_sim(index)  # another kind of index: its kind of caches, empty
        index.set_insert_old(self.old)
        index.set_sample_shift(self.shift)
        index.set_grace_bytes(self._grace)

    @property
    def pressed(self) -> bool:
        """Whether the full-size caches have felt pressure (evicted anything)."""
        return self.sim.pressed

    @property
    def sampling(self) -> bool:
        return self.shift < OFF_SHIFT

    def update(self, capacity: int) -> bool:
        """Size the grace window to ``capacity`` (this master's DRAM bytes), run the
        caches over the samples taken since the last call and decide; True when the
        policy changed."""
        grace = int(capacity * GRACE)
        if grace != self._grace:
            self._grace = grace
            self.index.set_grace_bytes(grace)
        if not self.sampling:
            return False
        dropped, windows = self.index.feed_policy(self.sim, self.shift, capacity)
        self.counters["dropped"] += dropped
        was = self.old
        weight = self.weight()
        for window in windows:
            self._decide(window, weight)
        if self.sim.tracked() > self.MAX_TRACKED:
            self.shift = self.sim.halve(self.MAX_TRACKED // 2, self.shift)
            self.index.set_sample_shift(self.shift)
        return self.old != was

    def weight(self) -> float:
        """The newest window's weight in the scores: its share of the keys the full-size
        "recent" cache holds, between ``SMOOTH_MIN`` and ``SMOOTH``."""
        return min(self.SMOOTH, max(self.SMOOTH_MIN, PolicySim.WINDOW / max(1, self.sim.cache_keys())))

    def _decide(self, window: tuple, w: float) -> None:
        """One window of counted references (``PolicySim.feed``) into the scores, with
        weight ``w`` (``weight()``); the policy turns when the score in force passes the
        dead band."""
        n, hit_recent, hit_old, half_recent, half_old, pressed = window
        self.counters["refs"] += n
        self.counters["hits_recent"] += hit_recent
        self.counters["hits_old"] += hit_old
        self.score += w * ((hit_old - hit_recent) / n - self.score)
        self.score_half += w * ((half_old - half_recent) / n - self.score_half)
        self._weight += w * (1 - self._weight)
        # Scores start at 0: divided by their weight so far, the first windows count in full
        # (the first one alone decides) rather than a tenth of their difference.
        score = self.scores()[0 if pressed else 1]
        want = score > self.BAND if not self.old else score > -self.BAND
        if want != self.old:
            self.old = want
            self.counters["switches"] += 1
            self.index.set_insert_old(want)

    def scores(self) -> tuple[float, float]:
        """The full-size and half-size scores, each divided by its windows' weight."""
        w = self._weight or 1.0
        return self.score / w, self.score_half / w

    def stats(self) -> dict:
        c = self.counters
        refs = max(1, c["refs"])
        score, half = self.scores()
        return {"mode": self.mode, "insert": "old" if self.old else "recent", "score": round(score, 4),
                "score_half": round(half, 4), "pressed": self.pressed,
                "sampled_refs": c["refs"], "hit_ratio_recent": c["hits_recent"] / refs,
                "hit_ratio_old": c["hits_old"] / refs, "switches": c["switches"], "sample_shift": self.shift,
                "samples_dropped": c["dropped"]}
