import random

import pytest

from mooncake_ray._private.master.allocator import ALIGN, GRANULE, ExtentAllocator, carve, extent_length, page_up

K = ALIGN
G = GRANULE


def test_extent_lengths():
    assert [page_up(n) for n in (0, 1, K, K + 1, 3 * K)] == [K, K, K, 2 * K, 3 * K]
    assert [extent_length(n) for n in (0, 1, G, G + 1, 256, K - 1, K, K + 1)] == \
        [G, G, G, 2 * G, 256, K, K, 2 * K]


def test_small_values_are_packed_and_large_ones_stay_on_pages():
    a = ExtentAllocator(4 * K)
    small = [a.allocate(256) for _ in range(16)]  # one page holds sixteen 256-byte values
    assert small == [(i * 256, 256) for i in range(16)]
    assert a.allocate(100) == (K, 128)            # the next granule multiple
    big = a.allocate(K + 1)                       # skips to the next page boundary
    assert big == (2 * K, 2 * K)
    assert a.free_runs() == [(K + 128, K - 128)]  # the gap before it stays free for small ones
    assert a.allocate(K) is None                  # 3968 bytes free, but no free page
    assert not a.can_fit(K)
    assert a.allocate(K - 128) == (K + 128, K - 128)
    assert a.free == 0
    a.release_many([(o, n) for o, n in small])
    assert a.allocate(K) == (0, K)


def test_paged_allocation_skips_short_misaligned_runs():
    a = ExtentAllocator(64 * K)
    offs = [a.allocate(K)[0] for _ in range(64)]
    # 12 runs of 1.25 pages from mid-page to 3/4 of the next: none holds a whole page
    for i in range(12):
        a.release(offs[4 * i] + K // 2, K // 2)
        a.release(offs[4 * i + 1], 3 * K // 4)
    a.release(offs[60], 2 * K)  # the one run that fits
    assert a.allocate(K) == (offs[60], K)
    assert a.allocate(K) == (offs[61], K)
    assert a.allocate(K) is None


def test_carve_checks_the_alignment_of_the_extent_kind():
    free = {0: 4 * K}
    assert not carve(free, 64, K)       # a paged extent must start on a page
    assert not carve(free, 32, 64)      # a packed one on a granule
    assert carve(free, 64, 128) and free == {0: 64, 192: 4 * K - 192}
    assert carve(free, K, K) and free == {0: 64, 192: K - 192, 2 * K: 2 * K}


def test_best_fit_picks_smallest_run_lowest_offset():
    a = ExtentAllocator(16 * K)
    offs = [a.allocate(K)[0] for _ in range(16)]
    assert offs == [i * K for i in range(16)]
    # free runs of 3, 1, 2 granules (at offsets 0, 5K, 10K)
    for o in (0, K, 2 * K, 5 * K, 10 * K, 11 * K):
        a.release(o, K)
    assert a.free_runs() == [(0, 3 * K), (5 * K, K), (10 * K, 2 * K)]
    assert a.allocate(K) == (5 * K, K)       # exact fit
    assert a.allocate(2 * K) == (10 * K, 2 * K)
    assert a.allocate(2 * K) == (0, 2 * K)   # the 3-granule run is split
    assert a.free_runs() == [(2 * K, K)]
    assert a.allocate(2 * K) is None         # a shortage is a value


def test_release_merges_both_neighbours():
    a = ExtentAllocator(8 * K)
    x, y, z = a.allocate(K), a.allocate(2 * K), a.allocate(K)
    a.release(*x)
    a.release(*z)
    a.release(*y)
    assert a.free_runs() == [(0, 8 * K)]
    assert a.used == 0


def test_double_free_and_bad_extents_raise():
    a = ExtentAllocator(8 * K)
    off, ln = a.allocate(2 * K)
    a.release(off, ln)
    with pytest.raises(ValueError, match="double free"):
        a.release(off, ln)
    with pytest.raises(ValueError):
        a.release(K + 1, K)
    with pytest.raises(ValueError):
        a.release(K, G + 1)
    with pytest.raises(ValueError):
        a.release(8 * K, K)


def test_reserve_specific_extent():
    a = ExtentAllocator(8 * K)
    a.reserve(3 * K, 2 * K)
    assert a.free_runs() == [(0, 3 * K), (5 * K, 3 * K)]
    with pytest.raises(ValueError, match="not free"):
        a.reserve(4 * K, 2 * K)
    assert a.used == 2 * K


def test_random_against_model():
    rng = random.Random(7)
    cap = 256 * K
    a = ExtentAllocator(cap)
    owned = {}
    for _ in range(3000):
        if owned and rng.random() < 0.45:
            off = rng.choice(list(owned))
            a.release(off, owned.pop(off))
        else:
            got = a.allocate(rng.choice((rng.randint(1, K), rng.randint(1, 9 * K))))
            if got:
                off, ln = got
                assert off % (K if ln >= K else G) == 0
                assert all(off + ln <= o or o + l <= off for o, l in owned.items())
                owned[off] = ln
        assert a.used == sum(owned.values())
        assert a.used + sum(l for _, l in a.free_runs()) == cap


def test_release_many_merges_neighbours_before_touching_the_free_index():
    a = ExtentAllocator(16 * ALIGN)
    ext = [a.allocate(ALIGN) for _ in range(16)]
    assert a.free_runs() == []
    # out of order, with a gap at 8: two runs come back, merged with nothing else
    a.release_many([ext[i] for i in (3, 1, 2, 0, 9, 10, 11)])
    assert a.free_runs() == [(0, 4 * ALIGN), (9 * ALIGN, 3 * ALIGN)] and a.used == 9 * ALIGN
    a.release_many([ext[8], ext[4]])  # each joins its free neighbours
    assert a.free_runs() == [(0, 5 * ALIGN), (8 * ALIGN, 4 * ALIGN)]
    a.release_many([])
    with pytest.raises(ValueError, match="double free"):
        a.release_many([ext[5], ext[5]])
    assert a.free_runs() == [(0, 6 * ALIGN), (8 * ALIGN, 4 * ALIGN)]  # the first copy only
    with pytest.raises(ValueError, match="double free"):
        a.release_many([ext[0]])


def test_largest_paged_is_what_the_largest_run_holds_on_pages():
    a = ExtentAllocator(8 * K)
    assert a.largest_paged() == 8 * K
    a.allocate(100)                      # [0, 128) used: the run from 128 holds 7 pages
    assert a.largest_paged() == 7 * K
    a.allocate(7 * K)
    assert a.largest_paged() == 0        # 3968 bytes free, not one whole page


def test_an_allocator_with_an_origin_keeps_to_its_part_of_the_arena():
    """A master shard's allocator covers one part of an arena; its offsets are the
    arena's, and nothing outside the part is handed out or taken back."""
    a = ExtentAllocator(4 * K, origin=8 * K)
    assert a.allocate(256) == (8 * K, 256)
    assert a.allocate(K) == (9 * K, K)
    assert a.free_runs() == [(8 * K + 256, K - 256), (10 * K, 2 * K)]
    a.reserve(11 * K, K)
    assert a.allocate(2 * K) is None and a.allocate(K) == (10 * K, K)
    for bad in ((7 * K, K), (12 * K, K), (11 * K + K // 2, K)):
        with pytest.raises(ValueError, match="bad extent"):
            a.release(*bad)
    with pytest.raises(ValueError, match="page-aligned"):
        ExtentAllocator(4 * K, origin=100)
    a.release_many([(8 * K, 256), (9 * K, K), (10 * K, K), (11 * K, K)])
    assert a.used == 0 and a.free_runs() == [(8 * K, 4 * K)]
