"""The adaptive insertion policy (master/adaptive.py): the read index's probation order
(literal, native and reference alike), the miniature caches, the decision switching when
the workload does, and the state machine keeping a handoff's fresh pages."""

import random

import pytest

from mooncake_ray._private import rpc
from mooncake_ray._private.master.adaptive import GRACE, InsertionPolicy, MiniCache, PolicySim
from mooncake_ray._private.master.pyindex import REF_GET, REF_PUT, PyIndex
from mooncake_ray._private.native import _native

from tests.unit.test_master_state import K, make, put


def indexes():
    return [PyIndex(), _native.MasterIndex()]


def probed(ix):
    """a..f of one byte each, a..d put on probation with a window of 2 bytes: c, d in the
    window (first in first out); a and b left it, b last: b goes first."""
    ix.set_grace_bytes(2)
    for k in "abcdef":
        ix.set(k, 1, 1, [])
    for k in "abcd":
        ix.probation(k)
    assert ix.keys("") == list("bacdef")
    return ix


@pytest.mark.parametrize("ix", indexes(), ids=["reference", "native"])
def test_probation_keeps_the_newest_in_a_grace_window_and_the_rest_newest_first(ix):
    probed(ix)
    ix.touch("a")  # a use takes it off probation
    assert ix.keys("") == list("bcdefa")
    ix.probation("e")  # c leaves the window to the top of the stack
    assert ix.keys("") == list("cbdefa")
    ix.set("d", 2, 2, [])  # d grows: with f the window is over by 2, and d leaves it
    ix.probation("f")
    assert ix.keys("") == list("dcbefa")


@pytest.mark.parametrize("ix", indexes(), ids=["reference", "native"])
def test_probation_literal_order_after_drops_and_a_bigger_window(ix):
    probed(ix)
    ix.drop("c")  # the window's oldest goes: d alone in it
    ix.probation("e")  # d, e fit
    assert ix.keys("") == list("badef")
    ix.drop("b")  # the stack's top
    ix.set_grace_bytes(10)
    ix.probation("f")  # all of d, e, f fit now; a stays on the stack
    assert ix.keys("") == list("adef")
    ix.clear()
    ix.set("x", 1, 1, [])
    ix.probation("x")
    assert ix.keys("") == ["x"]


@pytest.mark.parametrize("ix", indexes(), ids=["reference", "native"])
def test_turning_to_old_puts_the_chained_values_nobody_read_on_probation_and_back(ix):
    """Values a chained put placed at the recent end under "recent" and nothing read
    since go on probation when the policy turns to "old": at the old end, oldest first
    (a page a decode is about to read, put a turn ago, goes last of them), ahead of what
    was on probation before; those read, and values put without a parent, stay. Turning
    back to "recent" takes what is on probation to the recent end, in its order."""
    ix.set_grace_bytes(2)
    for k in "abcdef":
        ix.set(k, 1, 1, [])
        ix.touch(k, k in "acdf")  # a, c, d, f: chained puts under "recent"; b, e: not chained
    ix.touch("c")  # read since
    ix.set_insert_old(True)
    assert ix.keys("") == list("adfbec")  # a, d, f at the old end, a first
    ix.set_insert_old(True)  # no turn, no change
    assert ix.keys("") == list("adfbec")
    ix.set_insert_old(False)  # back: a, d, f to the recent end in their order, unread
    assert ix.keys("") == list("becadf")
    ix.touch("x")  # not stored: nothing
    ix.set("g", 1, 1, [])
    ix.touch("g", True)
    ix.touch("e", True)
    ix.touch("e")  # read again: off the list of the unread
    ix.set_insert_old(True)  # a, d, f and g, still unread
    assert ix.keys("") == list("adfgbce")
    ix.probation("h")  # not stored: nothing
    ix.set("h", 1, 1, [])
    ix.probation("h")  # a new page under "old": into the grace window (2 bytes), behind them
    assert ix.keys("") == list("adfghbce")


def test_minicache_old_evicts_unread_newest_first_after_the_grace_window():
    cap = 100 * 1000
    c = MiniCache(old=True)
    grace = int(cap * GRACE)  # 2000: two values of 1000
    assert grace == 2000
    c.put(1, 1000, False, cap)  # not chained: the recent end
    for h in range(2, 101):
        c.put(h, 1000, True, cap)
    assert c.bytes == cap and len(c.grace) == 2 and list(c.grace) == [99, 100]
    c.ref(5)  # read: off probation
    c.put(101, 1000, True, cap)  # 99 leaves the window to the stack's top; it goes
    assert 99 not in c and 5 in c and 1 in c and list(c.grace) == [100, 101]
    c.put(102, 1000, True, cap)  # 100 to the stack, then evicted; 98 (older) stays
    assert 100 not in c and 98 in c


def test_minicache_recent_is_lru():
    c = MiniCache(old=False)
    for h in range(1, 11):
        c.put(h, 10, True, 100)
    assert c.ref(1)
    c.put(11, 10, True, 100)
    assert 2 not in c and 1 in c and 11 in c


def refs(ix, kind, keys, size=1000):
    for k in keys:
        ix.sample(kind, k, size, kind == REF_PUT)


def converse(ix, p, keys):
    """One request over a chain of pages as an engine makes it against a store that
    follows ``p``: a read of each page the store holds (its cache under the policy in
    force stands for it), a put of each page it lost."""
    held = p.sim.caches[p.old]
    for k in keys:
        h = int.from_bytes(__import__("hashlib").blake2b(k.encode(), digest_size=8).digest(), "big")
        refs(ix, REF_GET if h in held else REF_PUT, [k])


def test_the_policy_turns_old_on_a_loop_and_recent_on_a_small_working_set():
    ix = PyIndex()
    p = InsertionPolicy("adaptive", ix)
    cap = 200 * 1000  # 200 pages of 1000 bytes
    assert not p.old and p.sampling  # where it starts

    for _round in range(6):  # 40 conversations of 10 pages in turn: LRU's worst case
        for c in range(40):
            converse(ix, p, [f"c{c}.{i}" for i in range(10)])
            p.update(cap)
    assert p.old and p.counters["switches"] == 1, p.stats()
    assert p.stats()["hit_ratio_old"] > p.stats()["hit_ratio_recent"] + 0.2
    # 8 new conversations take turns at random, each well within DRAM: the old pages the
    # probation keeps crowd them out, and recency wins
    rng = random.Random(1)
    for _ in range(300):
        c = rng.randrange(8)
        converse(ix, p, [f"s{c}.{i}" for i in range(rng.randrange(5, 15))])
        p.update(cap)
    assert not p.old and p.counters["switches"] == 2, p.stats()
    # (A loop over new conversations now is served by neither: "recent" cycles, and "old"
    # keeps the read-once pages of those 8 before anything new. The policy stays.)


def test_the_first_window_decides_alone():
    """The scores start at 0 and are divided by the weight their windows have so far, so
    a first window whose caches differ by more than the dead band turns the policy at once
    (undivided, 0.1 of a difference of 0.3 stayed inside the band for two windows more,
    and a real store evicted under the wrong policy meanwhile)."""
    ix = PyIndex()
    p = InsertionPolicy("adaptive", ix)
    cap = 100 * 1000
    p.sim.caches[1].put(7, 1000, True, cap, new=True)  # "old" (and its half-size twin) hold one key
    p.sim.half[1].put(7, 1000, True, cap // 2, new=True)
    samples = [(7, REF_GET, 1000, True)] * 20 + [(8 + i, REF_GET, 1000, True) for i in range(44)]
    ix._samples.extend(samples)  # one window of 64: "old" hits 20, "recent" none
    assert p.update(cap) and p.old, p.stats()
    assert p.stats()["score_half"] == pytest.approx(20 / 64, abs=1e-3)


def test_windows_that_favour_one_policy_in_bursts_do_not_turn_it_back():
    """A window of 64 references is often one conversation's pages, which one cache holds
    whole and the other not, so the windows' differences jump between -1 and +1 around
    their mean. Here "old" wins by 0.23 on average (the mean a probe measured with 96
    conversations taking turns at half their working set, 5,472 keys in the cache) in
    windows drawn from five kinds: at the weight such a cache gives a window (0.02) the
    policy turns to "old" once and stays; at a tenth, the same windows turn it 7 times."""
    kinds = [((0, 64), 20), ((20, 60), 25), ((64, 64), 30), ((64, 45), 17), ((64, 0), 8)]
    draw = [k for k, n in kinds for _ in range(n)]
    assert sum((o - r) / 64 for r, o in draw) / len(draw) == pytest.approx(0.23, abs=0.01)

    def switches(weight: float) -> tuple[int, bool]:
        p = InsertionPolicy("adaptive", PyIndex())
        rng = random.Random(0)
        for _ in range(1000):
            r, o = rng.choice(draw)
            p._decide((64, r, o, r, o, True), weight)
        return p.counters["switches"], p.old

    assert switches(0.02) == (1, True)
    assert switches(0.1) == (7, True)


@pytest.mark.parametrize("keys, weight", [(0, 0.1), (300, 0.1), (1280, 0.05), (5472, 0.02), (100_000, 0.02)])
def test_a_window_weighs_its_share_of_the_cache_between_a_fiftieth_and_a_tenth(keys, weight):
    """The score averages over about one cache's worth of references: a window of 64
    weighs 64 / (the keys the full-size "recent" cache holds), at least 0.02, at most
    0.1 (the reference caches and the native ones count their keys alike)."""
    for ix in (PyIndex(), _native.MasterIndex()):
        p = InsertionPolicy("adaptive", ix)
        cap = (keys + 1) * 1000
        p.sim.feed([(h << 32, REF_PUT, 1000, True) for h in range(keys)], 0, cap)  # first puts: held, not counted
        assert p.sim.cache_keys() == keys
        assert p.weight() == pytest.approx(weight)


def test_a_fixed_policy_samples_nothing():
    ix = PyIndex()
    p = InsertionPolicy("old", ix)
    assert p.old and not p.sampling
    refs(ix, REF_GET, ["a", "b"])
    assert ix.take_samples() == (0, [])
    with pytest.raises(ValueError, match="'lru'"):
        InsertionPolicy("lru", ix)


def test_the_sample_rate_halves_past_its_bound():
    ix = PyIndex()
    p = InsertionPolicy("adaptive", ix)
    p.MAX_TRACKED = 500
    refs(ix, REF_GET, [f"k{i}" for i in range(2000)])
    p.update(10 ** 9)
    assert p.shift >= 2 and p.sim.tracked() <= 500
    kept = p.sim.tracked()
    refs(ix, REF_GET, [f"k{i}" for i in range(2000)])  # the same keys: the sample holds
    p.update(10 ** 9)
    assert p.sim.tracked() == kept
    assert ix._shift == p.shift


def test_reads_and_puts_again_count_and_a_first_put_does_not():
    ix = PyIndex()
    p = InsertionPolicy("adaptive", ix)
    refs(ix, REF_PUT, ["a", "b"])  # first puts: no reference counted
    refs(ix, REF_GET, ["a"])  # a read: both caches hold it
    refs(ix, REF_GET, ["zz"])  # a read of a key never stored: a miss for both
    refs(ix, REF_PUT, ["b"])  # put again: both caches still hold it
    p.update(10 ** 6)
    assert p.sim.window == [3, 2, 2, 2, 2]  # at full and at half size
    assert ix.take_samples() == (0, [])
    ix.set_enabled(True)
    assert ix.serve(rpc.pack([rpc.EXISTS, ["a", "b"]])) is not None  # a lookup is not a use
    assert ix.take_samples() == (0, [])
    ix.serve(rpc.pack([rpc.GET, ["a"]]))
    assert [k for _h, k, _s, _c in ix.take_samples()[1]] == [REF_GET]


def test_a_handoff_page_is_not_the_first_to_go_under_the_old_policy():
    """Chains put unread under pressure with the policy fixed at "old": the pages a
    prefill just saved (a handoff, read next by a decode) stay while older unread pages go,
    and the reads move them to the recent end. Without the grace window they would be the
    first to go (the newest unread page goes first)."""
    m, clock = make(n_nodes=1, cap=200 * K, high_watermark=1.0, evict_ratio=0.02, chain_insert="old")
    m.adapt(clock.t)  # sizes the grace window: 2% of 200 pages = 4 pages
    for c in range(40):  # fill DRAM with unread conversations: 5 pages each
        for i in range(5):
            put(m, f"c{c}.{i}", parent=f"c{c}.{i - 1}" if i else "")
        clock.t += 0.01
    handoff = [f"h.{i}" for i in range(3)]
    for i, k in enumerate(handoff):
        put(m, k, parent=handoff[i - 1] if i else "")
    before = m.stats()["evictions"]
    put(m, "o.1", parent="c0.4")  # the room the handoff's eviction round left
    put(m, "o.2", parent="o.1")  # an eviction round of 4 pages
    assert m.stats()["evictions"] - before == 4
    assert all(m.exists(k) for k in handoff), "the handoff's pages went first"
    for k in handoff:
        g = m.get(k)
        m.release(k, g.gen, g.lease)
    assert m.index.keys("")[-3:] == handoff  # read: the recent end
    m.check_invariants()


def sample_stream(rng, n, keys, put_share, shift_bits=0):
    """``n`` references over ``keys`` hashes (top bits set on some, so a halved rate
    rejects them), puts and reads mixed, chained or not, of varied sizes."""
    hashes = [rng.getrandbits(64) >> shift_bits for _ in range(keys)]
    out = []
    for _ in range(n):
        h = rng.choice(hashes[: rng.randrange(1, keys + 1)])  # a skew toward the first keys
        kind = REF_PUT if rng.random() < put_share else REF_GET
        out.append((h, kind, rng.choice((700, 1000, 4096)), rng.random() < 0.8))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_the_native_caches_take_the_reference_steps(seed):
    """The native miniature caches against the reference on seeded streams: the same
    windows (hit counts, pressure) and the same orders in each cache after every feed, at
    capacities from no pressure to heavy, with the rate halved midway."""
    rng = random.Random(seed)
    ref, nat = PolicySim(), _native.PolicySim()
    capacity = rng.choice((50_000, 200_000, 2_000_000))
    shift = 0
    for step in range(12):
        samples = sample_stream(rng, rng.randrange(50, 600), rng.choice((40, 300, 2000)), rng.random())
        got_ref, got_nat = ref.feed(samples, shift, capacity), nat.feed(samples, shift, capacity)
        assert got_nat == got_ref, (seed, step)
        assert nat.window == ref.window and nat.pressed == ref.pressed and nat.tracked() == ref.tracked()
        for i in range(4):
            assert nat.cache_state(i) == ref.cache_state(i), (seed, step, i)
        if step in (5, 9):  # the rate halved: the same keys forgotten
            bound = ref.tracked() // 3
            was, shift = shift, ref.halve(bound, shift)
            assert nat.halve(bound, was) == shift > was
            for i in range(4):
                assert nat.cache_state(i) == ref.cache_state(i), (seed, step, "halved", i)
            assert nat.tracked() == ref.tracked()
    assert ref.pressed or capacity == 2_000_000  # the stream exercised eviction


def test_the_native_index_feeds_its_samples_to_the_native_caches():
    """``MasterIndex.feed_policy``: the samples the index took, through the native caches,
    close the windows the reference caches close over the same samples."""
    twin, ix = _native.MasterIndex(), _native.MasterIndex()
    rng = random.Random(3)
    for x in (twin, ix):
        x.set_sample_shift(0)
    for _ in range(700):
        k, kind = f"k{rng.randrange(150)}", rng.choice((REF_GET, REF_PUT))
        for x in (twin, ix):
            x.sample(kind, k, 1000, True)
    _dropped, samples = twin.take_samples()
    sim = _native.PolicySim()
    dropped, windows = ix.feed_policy(sim, 0, 60_000)
    assert dropped == 0 and len(windows) >= 8 and windows[-1][5]  # pressed by the end
    assert windows == PolicySim().feed(samples, 0, 60_000)
    assert ix.take_samples() == (0, [])  # taken


def test_a_policy_beside_the_native_index_runs_the_native_caches():
    ix = _native.MasterIndex()
    p = InsertionPolicy("adaptive", ix)
    assert isinstance(p.sim, _native.PolicySim)
    for _round in range(3):  # 30 conversations of 10 pages in turn over 100 pages: the loop
        for c in range(30):
            for i in range(10):
                ix.sample(REF_PUT if _round == 0 else REF_GET, f"c{c}.{i}", 1000, True)
        p.update(100 * 1000)
    assert p.stats()["sampled_refs"] > 0 and p.pressed
    p.rebind(PyIndex())  # another kind of index: the reference caches, empty
    assert isinstance(p.sim, PolicySim) and not p.pressed
