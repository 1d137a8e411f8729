"""A mounting node's plain values are taken in bulk (``split_inventory``,
``ExtentAllocator.reserve_all``, ``ReplicaTable.restore_plain``); the master must end in the
same state as when every entry goes through ``restore`` one by one. Seeded random
inventories (plain values, pins, parents, two copies asked, disk copies, reserved ranges,
overlapping extents, keys the table holds, values a lost node's new process brings back),
both read indexes (the native ``MasterIndex`` and ``PyIndex``)."""

import random

import pytest

from mooncake_ray._private.master import membership as mount_mod
from mooncake_ray._private.master.allocator import GRANULE, ExtentAllocator
from mooncake_ray._private.master.replicas import split_inventory
from mooncake_ray._private.master.state import MasterState, Policy
from mooncake_ray._private.master.types import NodeInfo
from mooncake_ray._private.native import _native
from mooncake_ray._private.store.inventory import _entry, pack, unpack

CAP = 1 << 20


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def node(i, inc="a"):
    return NodeInfo(f"n{i}", inc, b"addr", b"rkey", 0, CAP, ray_node_id=f"ray{i}")


def new_state(native: bool, clock) -> MasterState:
    pol = Policy(allocation_strategy="free_ratio_first")
    if not native:
        return MasterState(pol, clock=clock, wall_ns=lambda: 0, seed=1)
    index = _native.MasterIndex()
    index.set_lease_ttl(pol.lease_ttl_s)
    return MasterState(pol, clock=clock, wall_ns=lambda: 0, seed=1, index=index)


def inventory(rng: random.Random, n: int, overlap: bool) -> list[list]:
    """Entries as a node sends them: ``[key, gen, size, tier, offset, length, pin, parent, want]``."""
    out, at = [], 0
    keys = [f"k{i}" for i in range(n)]
    for i, key in enumerate(keys):
        size = rng.choice((64, 256, 1000))
        length = -(-size // GRANULE) * GRANULE
        at += rng.choice((0, 0, 0, GRANULE, 4 * GRANULE))
        roll = rng.random()
        tier = "disk" if roll < 0.08 else "reserved" if roll < 0.12 else "dram"
        pin = 1 if rng.random() < 0.05 else 0
        parent = rng.choice(keys[:i]) if i and rng.random() < 0.2 else ""
        want = 2 if rng.random() < 0.05 else 1
        gen = rng.randrange(1, 10 * n)
        if tier == "disk":
            out.append([key, gen, size, tier, 0, length, pin, parent, want])
            if rng.random() < 0.5:  # the same value in DRAM too
                out.append([key, gen, size, "dram", at, length, pin, parent, want])
                at += length
            continue
        out.append([key, gen, size, tier, at, length, pin, parent, want][:rng.choice((6, 7, 8, 9))]
                   if not (pin or parent or want > 1) else [key, gen, size, tier, at, length, pin, parent, want])
        at += length
    if overlap:  # a drop that never reached the node, then its extent reused
        dram = [e for e in out if e[3] == "dram"]
        victim = rng.choice(dram)
        out.append([victim[0] + "-old", 1, victim[2], "dram", victim[4], victim[5]])
    rng.shuffle(out)
    return out


def snapshot(m: MasterState) -> dict:
    objs = {}
    for key, obj in m._objects.items():
        reps = sorted((r.node_id, r.tier.value, r.offset, r.length) for r in obj.replicas)
        objs[key] = (obj.size, obj.gen, reps, int(obj.pin), obj.parent, obj.want, obj.lease_until)
    chains = m._objects.chains
    effects = {n: (sorted(map(tuple, d.adds)), sorted(map(tuple, d.drops)))
               for n, d in m.drain_effects().items()}
    return {
        "objects": objs,
        "alloc": {n: (a.used, a.free_runs()) for n, a in m._alloc.items()},
        "tier_keys": {n: dict(x.tier_keys) for n, x in m._nodes.items()},
        "disk_used": {n: x.disk_used for n, x in m._nodes.items()},
        "counters": dict(m.counters),
        "parent": dict(chains.parent), "kids": {k: set(v) for k, v in chains.kids.items()},
        "orphans": set(chains.orphans), "lost": set(chains.lost),
        "effects": effects, "next_gen": m._next_gen,
        "slabs": sorted((s.node_id, sorted(s.free.items())) for s in m._slab_table.slabs.values()),
    }


def run(native: bool, seed: int, bulk: bool, monkeypatch) -> tuple[dict, int]:
    rng = random.Random(seed)
    clock = Clock()
    m = new_state(native, clock)
    plain_taken = []
    real = split_inventory

    def split(inv, *a):
        if not bulk:
            return ([], b""), unpack(inv) if isinstance(inv, dict) else list(inv)
        plain, rest = real(inv, *a)
        plain_taken.append(len(plain[0]))
        return plain, rest

    def sent(inv):  # as a node sends it (half the seeds), or as lists
        return pack(_entry(e) for e in inv) if seed % 4 >= 2 else inv

    monkeypatch.setattr(mount_mod, "split_inventory", split)
    case = seed % 3
    if case == 0:  # a restarted master: nodes bring everything
        m.begin_recovery({"n0", "n1"})
        m.mount(node(0), sent(inventory(rng, 300, overlap=seed % 2 == 0)))
        m.mount(node(1), sent(inventory(rng, 300, overlap=False)))
    elif case == 1:  # some keys are in the table already (another node holds them)
        m.mount(node(0), sent(inventory(rng, 200 if seed % 2 else 60, overlap=False)))  # 60: looked up as a set
        m.mount(node(1), sent(inventory(rng, 300, overlap=seed % 2 == 0)))
    else:  # a node's new process comes back with its kept arena: the lost values are vouched for
        m.mount(node(0), sent(inventory(rng, 300, overlap=False)))
        kept = sorted(list(e) for e in m.node_entries("n0"))
        m.mount(node(0, inc="b"))  # the old incarnation's replicas go
        for e in kept:
            if rng.random() < 0.1:
                e[1] += 1  # not the value the master lost: refused
        m.mount(node(0, inc="c"), sent(kept))
    m.check_invariants()
    return snapshot(m), sum(plain_taken)


@pytest.mark.parametrize("native", [True, False], ids=["native-index", "py-index"])
@pytest.mark.parametrize("seed", range(12))
def test_bulk_mount_ends_in_the_state_one_by_one_restores_reach(native, seed, monkeypatch):
    slow, _ = run(native, seed, bulk=False, monkeypatch=monkeypatch)
    fast, taken = run(native, seed, bulk=True, monkeypatch=monkeypatch)
    assert fast == slow
    if seed % 6 != 0:  # an inventory with an overlap goes one by one (seeds 0, 6: node 0's)
        assert taken > 100  # the bulk path did run


def test_reserve_all_rebuilds_the_free_runs_that_reserve_would_leave():
    rng = random.Random(7)
    extents, at = [], 4096
    while at < CAP - 8192:
        length = rng.choice((64, 128, 4096))
        extents.append((at, length))
        at += length + rng.choice((0, 0, 64, 4096))
    a, b = ExtentAllocator(CAP), ExtentAllocator(CAP)
    for off, ln in extents:
        a.reserve(off, ln)
    rng.shuffle(extents)
    assert b.reserve_all([e[0] for e in extents], [e[1] for e in extents])
    assert (b.used, b.free_runs()) == (a.used, a.free_runs())
    assert b.allocate(4096) == a.allocate(4096) and b.allocate(64) == a.allocate(64)


@pytest.mark.parametrize("bad", ["overlap", "beside-overlap", "misaligned", "out-of-range", "in-use"])
def test_reserve_all_refuses_and_changes_nothing(bad):
    a = ExtentAllocator(CAP)
    offs, lens, beside = [0, 4096, 8192], [4096, 4096, 64], ([], [])
    if bad == "overlap":
        offs[2] = 4096 + 64
    elif bad == "beside-overlap":
        beside = ([8192 + 64 - 64], [128])
    elif bad == "misaligned":
        offs[2] = 8192 + 8
    elif bad == "out-of-range":
        offs[2] = CAP - 32
    else:
        a.reserve(CAP - 64, 64)
    before = (a.used, a.free_runs())
    assert not a.reserve_all(offs, lens, beside)
    assert (a.used, a.free_runs()) == before


def test_pack_round_trips_every_entry():
    inv = [_entry(e) for e in inventory(random.Random(3), 500, overlap=True)]
    packed = pack(inv)
    assert 0 < len(packed["keys"]) < len(inv) and len(packed["cols"]) == 32 * len(packed["keys"])
    assert sorted(map(tuple, unpack(packed))) == sorted(inv)


@pytest.mark.parametrize("native", [True, False], ids=["native-index", "py-index"])
def test_an_unmount_reads_what_node_entries_lists(native):
    """``unmount`` records a lost node's values from the read index in one call
    (``_held_on``), hot objects (pinned, parents, two copies) included."""
    m = new_state(native, Clock())
    m.mount(node(0), inventory(random.Random(5), 400, overlap=False))
    m.mount(node(1), inventory(random.Random(6), 100, overlap=False))
    for n in ("n0", "n1"):
        entries = m.node_entries(n)
        dram, keys = m._held_on(n)
        assert dram == {e.key: e.gen for e in entries if e.tier == "dram"}
        assert sorted(keys) == sorted(e.key for e in entries)
    assert len(m._objects.hot_items()) > 10 and len(m._held_on("n0")[0]) > 200


_TAKE_OVER = mount_mod.Membership._take_over


def restart(native: bool, seed: int, take_over: bool, monkeypatch) -> tuple[dict, int]:
    """A node's new process mounts while its old one is still mounted (Ray restarted it
    within ``node_ttl_s``), bringing back its kept arena's values: some replaced meanwhile
    (another generation: refused), some missing (lost)."""
    rng = random.Random(seed)
    m = new_state(native, Clock())
    real, moved = _TAKE_OVER, []

    def take(self, node, inv):
        if not take_over:
            from mooncake_ray._private.store.inventory import _entry, pack
            return (inv if isinstance(inv, dict) else pack(_entry(e) for e in inv)), None
        out, kept = real(self, node, inv)
        moved.append(0 if kept is None else len(kept))
        return out, kept

    monkeypatch.setattr(mount_mod.Membership, "_take_over", take)

    def sent(inv):
        return pack(_entry(e) for e in inv) if seed % 2 else inv

    m.mount(node(0), sent(inventory(rng, 300, overlap=False)))
    m.mount(node(1), sent(inventory(rng, 40, overlap=False)))  # a few keys held elsewhere too
    back = []
    for e in sorted(list(e) for e in m.node_entries("n0")):
        roll = rng.random()
        if roll < 0.05:
            continue  # not in the new process's arena: lost
        if roll < 0.12:
            e[1] += 1  # not the value the master holds: refused
        back.append(e)
    m.mount(node(0, inc="b"), sent(back))
    m.check_invariants()
    snap = snapshot(m)
    snap["objects"] = {k: v[:-1] for k, v in snap["objects"].items()}  # leases: kept in place, or renewed
    return snap, sum(moved)


@pytest.mark.parametrize("native", [True, False], ids=["native-index", "py-index"])
@pytest.mark.parametrize("seed", range(6))
def test_a_restarted_node_takes_its_records_over_in_place_as_a_remount_would_rebuild_them(native, seed,
                                                                                           monkeypatch):
    rebuilt, _ = restart(native, seed, take_over=False, monkeypatch=monkeypatch)
    kept, moved = restart(native, seed, take_over=True, monkeypatch=monkeypatch)
    assert kept == rebuilt
    assert moved > 90  # most plain values moved in place
    assert kept["counters"]["readopt_refused"] > 0 and kept["tier_keys"]["n0"]["dram"] > moved


@pytest.mark.parametrize("native", [True, False], ids=["native-index", "py-index"])
def test_records_taken_over_answer_with_the_new_process_and_keep_their_placement(native):
    m = new_state(native, Clock())
    m.mount(node(0), pack(_entry(e) for e in [["a", 3, 100, "dram", 0, 128], ["b", 4, 100, "dram", 4096, 128]]))
    placed = {k: m._objects.index.peek_cold(k)[6] for k in "ab"}
    m.mount(node(1), pack(_entry(e) for e in [["c", 5, 100, "dram", 0, 128]]))
    placed["c"] = m._objects.index.peek_cold("c")[6]
    # a: as the master holds it; b: where the master did not put it (a new placement); c:
    # another generation than the master's (refused)
    back = [["a", 3, 100, "dram", 0, 128], ["b", 4, 100, "dram", 8192, 128], ["c", 6, 100, "dram", 4096, 128]]
    m.mount(node(0, inc="b"), pack(_entry(e) for e in back))
    a, b = m._objects.index.peek_cold("a"), m._objects.index.peek_cold("b")
    assert a[2] == "n0" and a[6] == placed["a"]  # moved in place: the same placement id
    assert b[2] == "n0" and b[4] == 8192 and b[6] != placed["b"]  # made again
    assert m.counters["readopt_refused"] == 1 and m._objects.index.peek_cold("c")[6] == placed["c"]
    (grant,) = m.get("a").replicas
    assert (grant.node_id, grant.incarnation, grant.placed) == ("n0", "b", placed["a"])
    m.check_invariants()
