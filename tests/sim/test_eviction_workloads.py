"""The adaptive insertion policy on the state machine (no Ray, an injected clock): seeded
multi-turn conversation workloads through lookups, reads and chained puts, as an engine
makes them, with DRAM at half and a quarter of the working set. The default must serve
about as much as the better fixed policy on each shape, and follow a change of shape."""

import random

import pytest

from mooncake_ray._private.master.state import MasterState, Policy
from mooncake_ray._private.native import _native
from tests.unit.test_master_state import K, Clock, node, put

CONVERSATIONS, TURNS, SYSTEM_PAGES, PAGES_PER_TURN, ACTIVE = 24, 10, 16, 10, 8


def steps(shape: str, rng: random.Random) -> list[tuple[str, int]]:
    """(conversation, turn) in order. ``rounds``: every conversation speaks once per round
    in a random order (more than DRAM holds: LRU's worst case); ``recency``: at most
    ACTIVE conversations live, a random one speaks, a finished one is replaced by a new
    one; ``shift``: rounds, then recency over new conversations."""
    out: list[tuple[str, int]] = []
    if shape in ("rounds", "shift"):
        for t in range(TURNS):
            order = list(range(CONVERSATIONS))
            rng.shuffle(order)
            out += [(f"r{c}", t) for c in order]
    if shape in ("recency", "shift"):
        live: dict[str, int] = {}
        started = 0
        for _ in range(CONVERSATIONS * TURNS):
            while len(live) < ACTIVE:
                live[f"s{started}"] = 0
                started += 1
            c = rng.choice(sorted(live))
            out.append((c, live[c]))
            live[c] += 1
            if live[c] == TURNS:
                del live[c]
    return out


def run(mode: str, shape: str, frac: float, seed: int = 0) -> dict:
    """The share of prompt pages served from the store from turn 4 on (per half of the
    steps for ``shift``), and the policy at the end of each half."""
    final = SYSTEM_PAGES + TURNS * PAGES_PER_TURN
    clock = Clock()
    index = _native.MasterIndex()  # the actor's (the reference index scans in Python: slow here)
    m = MasterState(Policy(chain_insert=mode), clock=clock, wall_ns=lambda: 0, seed=1, index=index)
    m.mount(node(0, int(frac * CONVERSATIONS * final) * K))
    plan = steps(shape, random.Random(seed))
    half = len(plan) // 2 if shape == "shift" else len(plan)
    out, served, total = {}, 0, 0
    for n, (c, t) in enumerate(plan, 1):
        keys = [f"{c}.{i}" for i in range(SYSTEM_PAGES + (t + 1) * PAGES_PER_TURN)]
        hit = next((i for i, k in enumerate(keys) if not m.exists(k)), len(keys))
        for k in keys[:hit]:
            g = m.get(k)
            m.release(k, g.gen, g.lease)
        for i in range(hit, len(keys)):
            m.exists(keys[i])  # the saver checks before it puts
            put(m, keys[i], parent=keys[i - 1] if i else "")
        clock.t += 0.02
        if t >= 3:
            served, total = served + hit, total + len(keys)
        if n in (half, len(plan)):
            out[f"served{1 if n == half else 2}"] = served / total
            out[f"old{1 if n == half else 2}"] = m.insertion.old
            served = total = 0
    m.check_invariants()
    return out


@pytest.mark.parametrize("frac", [0.5, 0.25])
def test_the_default_serves_about_what_the_better_fixed_policy_does_on_each_shape(frac):
    got = {(mode, shape): run(mode, shape, frac) for mode in ("adaptive", "recent", "old")
           for shape in ("rounds", "recency", "shift")}
    print({k: {n: round(x, 3) for n, x in v.items()} for k, v in got.items()})
    # rounds: LRU's worst case; "old" keeps a stable part of the working set
    assert got["old", "rounds"]["served1"] > 1.4 * got["recent", "rounds"]["served1"]
    assert got["adaptive", "rounds"]["served1"] >= 0.9 * got["old", "rounds"]["served1"]
    assert got["adaptive", "rounds"]["old1"]
    # recency: every conversation comes back before DRAM turns over; LRU is right
    assert got["recent", "recency"]["served1"] > got["old", "recency"]["served1"]
    assert got["adaptive", "recency"]["served1"] >= 0.95 * got["recent", "recency"]["served1"]
    assert not got["adaptive", "recency"]["old1"]
    # shift: the default follows the change
    shift = got["adaptive", "shift"]
    assert shift["old1"] and not shift["old2"]
    assert shift["served1"] >= 0.9 * max(got[m, "shift"]["served1"] for m in ("recent", "old"))
    assert shift["served2"] >= 0.9 * max(got[m, "shift"]["served2"] for m in ("recent", "old"))
