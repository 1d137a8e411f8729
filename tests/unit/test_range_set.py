"""RangeSet: which registered buffer holds a range, by bisection (with overlapping
registrations and removals), against a linear scan over random ranges."""

import random

from mooncake_ray._private.buffers import RangeSet


def linear(regs, addr, n):
    return [v for s, ln, v in regs if s <= addr and addr + n <= s + ln]


def random_set(rng: random.Random, added: int, removed: int) -> tuple[RangeSet, list]:
    """Overlapping registrations in [1, 10,800), some taken out again."""
    rs, regs = RangeSet(), []
    for _ in range(added):
        s, ln = rng.randrange(1, 10_000), rng.randrange(1, 800)
        v = object()
        rs.add(s, ln, v)
        regs.append((s, ln, v))
    for _ in range(removed):
        rs.remove(regs.pop(rng.randrange(len(regs)))[2])
    return rs, regs


def test_matches_a_linear_scan_with_overlaps_and_removals():
    rng = random.Random(0)
    rs, regs = random_set(rng, 60, 20)
    assert len(rs) == len(regs) == 40
    for _ in range(5000):
        addr, n = rng.randrange(0, 11_000), rng.randrange(0, 300)
        got, want = rs.find(addr, n), linear(regs, addr, n)
        assert (got is None and not want) or got in want, (addr, n)


def test_edges():
    rs = RangeSet()
    a, b = object(), object()
    rs.add(100, 50, a)
    rs.add(120, 10, b)  # inside a
    assert rs.find(100, 50) is a and rs.find(149, 1) is a and rs.find(150, 1) is None
    assert rs.find(125, 5) in (a, b) and rs.find(128, 20) is a  # past b's end: only a holds it
    assert rs.find(99, 2) is None and rs.find(0, 0) is None
    rs.remove(a)
    assert rs.find(128, 20) is None and rs.find(121, 2) is b and rs.values() == [b]


def test_the_native_check_of_raw_ranges_agrees_with_find():
    """``_native.raw_ranges`` (a value's raw ranges checked in one call) takes a list
    exactly when every element is a raw ``(address, length)`` of positive ints that
    ``find`` places (overlaps and removals included), giving the same ranges and total;
    anything else is left to the Python path. ``gathered`` gives the same either way."""
    from mooncake_ray._private.buffers import gathered
    from mooncake_ray._private.native import _native

    rng = random.Random(1)
    rs, _ = random_set(rng, 40, 10)

    class Registered:  # as the client's: callable, with its RangeSet
        ranges = rs

        def __call__(self, a, n):
            return rs.find(a, n) is not None

    odd = [(5, 0), (-1, 4), (True, 3), (1 << 70, 1), [100, 4], (100, 4, 0), 100, (100.0, 4), (3, 1 << 64)]
    taken = 0
    for _ in range(3000):
        bufs = []
        for _ in range(rng.randrange(1, 6)):
            bufs.append(rng.choice(odd) if rng.random() < 0.03 else (rng.randrange(1, 11_000), rng.randrange(1, 200)))
        want = all(type(b) is tuple and len(b) == 2 and type(b[0]) is int and type(b[1]) is int
                   and b[0] > 0 and b[1] > 0 and rs.find(*b) is not None for b in bufs)
        got = _native.raw_ranges(bufs, *rs.arrays())
        if not want:
            assert got is None, bufs
            continue
        taken += 1
        assert got == (tuple(bufs), sum(n for _, n in bufs)), bufs
        assert gathered(bufs, None, Registered()) == gathered(bufs, None, Registered().__call__) == (got[0], got[1], [])
    assert taken > 300  # both outcomes were exercised
    assert _native.raw_ranges([], *rs.arrays()) is None
