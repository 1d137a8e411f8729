"""The client's location cache stays within its bound however values arrive (one at a
time or in batches larger than it), keeps the most recently remembered keys, and answers
a key remembered again with its newest location."""

import random

from mooncake_ray._private.client.locations import LocationCache, Loc, _new


def loc(gen):
    return _new(Loc, (1, gen, "n", 0, "inc", 0))


def test_bounded_and_most_recent_kept():
    c = LocationCache(100)
    rng = random.Random(0)
    put = 0
    for _ in range(300):
        if rng.random() < 0.5:
            c.remember(f"k{put}", 1, put, "n", 0, "inc", 0)
            put += 1
        else:
            n = rng.choice([1, 7, 49, 50, 51, 230])
            c.remember_many([(f"k{put + i}", loc(put + i)) for i in range(n)])
            put += n
        assert len(c) <= 100
        assert all(f"k{i}" in c for i in range(max(0, put - 50), put)), "a recent key was dropped"
    assert c.get("k0") is None and c[f"k{put - 1}"].gen == put - 1


def test_newest_location_wins_and_pop_forgets_every_copy():
    c = LocationCache(10)
    c.remember("a", 1, 1, "n", 0, "inc", 0)
    for i in range(5):  # "a" moves to the old generation
        c.remember(f"x{i}", 1, i, "n", 0, "inc", 0)
    c["a"] = loc(2)
    assert c["a"].gen == 2
    assert c.pop("a").gen == 2 and "a" not in c and c.get("a") is None
    c.remember_many([("p/1", loc(1)), ("q/1", loc(1))])
    c.forget_prefix("p/")
    assert "p/1" not in c and "q/1" in c
    c.clear()
    assert len(c) == 0
