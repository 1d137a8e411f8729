"""RangeSet: which registered buffer holds a range, by bisection (with overlapping
registrations and removals), against a linear scan over random ranges."""

import random

from mooncake_ray._private.buffers import RangeSet


def linear(regs, addr, n):
    return [v for s, ln, v in regs if s <= addr and addr + n <= s + ln]


def test_matches_a_linear_scan_with_overlaps_and_removals():
    rng = random.Random(0)
    rs, regs = RangeSet(), []
    for i in range(60):
        s, ln = rng.randrange(1, 10_000), rng.randrange(1, 800)
        v = object()
        rs.add(s, ln, v)
        regs.append((s, ln, v))
    for _ in range(20):  # take some out again
        s, ln, v = regs.pop(rng.randrange(len(regs)))
        rs.remove(v)
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
