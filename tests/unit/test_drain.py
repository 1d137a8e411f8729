"""Draining a store node in the master's state machine (drain.py): no Ray, injected clock."""

import pytest

from mooncake_ray._private.master.allocator import ALIGN
from mooncake_ray._private.master.drain import FROM_DISK, NO_ROOM_WAIT_S
from mooncake_ray.errors import ObjectLeasedError, OffloadPendingError
from mooncake_ray._private.master.state import MasterState, Policy
from mooncake_ray._private.master.types import NodeInfo
from tests.unit.test_master_state import Clock

K = ALIGN


def make(caps=(64 * K, 64 * K, 64 * K)):
    clock = Clock()
    m = MasterState(Policy(allocation_strategy="free_ratio_first"), clock=clock, wall_ns=lambda: 0, seed=1)
    for i, cap in enumerate(caps):
        m.mount(NodeInfo(f"n{i}", "a", b"addr", b"rkey", 0, cap, ray_node_id=f"ray{i}"))
    return m, clock


def put_on(m, node_id, key, size=K):
    """Put ``key`` with ``node_id`` as the only node placement may use."""
    others = [n for n in m._nodes.values() if n.node_id != node_id]
    for n in others:
        n.suspect = True
    try:
        gen, _ = m.put_start(key, size)
        m.put_end(key, gen)
    finally:
        for n in others:
            n.suspect = False
    return gen


def nodes_of(m, key):
    return {(n, tier, ready) for n, tier, ready in m.where(key)}


def run_drain(m, node_id, batch=8 * K, fail=()):
    """Plan, 'copy' and report until the plan is empty; returns the moves made."""
    moves = []
    while True:
        plan, again = m.drain_plan(node_id, batch)
        assert not again
        if not plan:
            return moves
        for key, gen, size, _src, dst, dst_off in plan:
            assert dst != node_id
            moves.append((key, dst))
        m.drain_done(node_id, [[k, g, d, o, k not in fail] for k, g, _s, _so, d, o in plan])
        m.check_invariants()


def test_drain_moves_every_value_most_recent_first_and_takes_no_new_values():
    m, _ = make()
    for i in range(10):
        put_on(m, "n0", f"k{i}")
    m.get("k3")  # the most recently used
    assert m.drain_begin("n0")
    for i in range(20):  # new values go elsewhere
        gen, ext = m.put_start(f"new{i}", K)
        assert all(e[0] != "n0" for e in ext)
        m.put_end(f"new{i}", gen)
    moves = run_drain(m, "n0")
    assert moves[0][0] == "k3"
    assert sorted(k for k, _ in moves) == sorted(f"k{i}" for i in range(10))
    for i in range(10):
        assert nodes_of(m, f"k{i}") <= {("n1", "dram", True), ("n2", "dram", True)}
        assert m.get(f"k{i}") is not None
    report = m.drain_end("n0")
    assert report["moved_keys"] == 10 and report["moved_bytes"] == 10 * K
    assert report["lost_keys"] == 0 and report["lost_bytes"] == 0
    assert "n0" not in m._nodes
    assert all(m.get(f"k{i}") is not None for i in range(10))
    m.check_invariants()


def test_reads_stay_served_from_the_leaving_node_until_the_move_is_reported():
    m, _ = make()
    gen = put_on(m, "n0", "k")
    m.drain_begin("n0")
    plan, _ = m.drain_plan("n0", K)
    assert [p[0] for p in plan] == ["k"]
    assert ("n0", "dram", True) in nodes_of(m, "k")
    got = m.get("k")
    assert got[1] == gen and {r[0] for r in got[3]} == {"n0"}  # only ready replicas are read
    m.drain_done("n0", [["k", gen, plan[0][4], plan[0][5], True]])
    got = m.get("k")
    assert {r[0] for r in got[3]} == {plan[0][4]}


def test_a_failed_move_frees_its_extent_and_the_value_stays_where_it_was():
    m, _ = make()
    put_on(m, "n0", "k")
    m.drain_begin("n0")
    used = {n: m._alloc[n].used for n in ("n1", "n2")}
    moves = run_drain(m, "n0", fail={"k"})
    assert [k for k, _ in moves] == ["k"]  # tried once, not again
    assert {n: m._alloc[n].used for n in ("n1", "n2")} == used
    assert nodes_of(m, "k") == {("n0", "dram", True)}
    report = m.drain_end("n0")
    assert report["failed_moves"] == 1 and report["lost_keys"] == 1 and report["lost_bytes"] == K


def test_no_room_elsewhere_counts_what_is_lost_by_keys_and_bytes():
    m, clock = make(caps=(64 * K, 4 * K))
    for i in range(8):
        put_on(m, "n0", f"k{i}")
    for i in range(4):  # the other node is full of pinned values: nothing can be evicted there
        put_on(m, "n1", f"p{i}")
        m.pin(f"p{i}", hard=True)
    m.drain_begin("n0")
    # no room now: asked again for NO_ROOM_WAIT_S (leases may end, offloads finish), then not
    assert m.drain_plan("n0", 8 * K) == ([], True)
    clock.t += NO_ROOM_WAIT_S / 2
    assert m.drain_plan("n0", 8 * K) == ([], True)
    clock.t += NO_ROOM_WAIT_S
    assert run_drain(m, "n0") == []
    report = m.drain_end("n0")
    assert report["moved_keys"] == 0 and report["lost_keys"] == 8 and report["lost_bytes"] == 8 * K
    assert all(m.get(f"k{i}") is None for i in range(8))
    assert m.counters["drain_lost_keys"] == 8


def test_a_value_replaced_during_its_move_keeps_the_new_value():
    m, _ = make()
    put_on(m, "n0", "k")
    m.drain_begin("n0")
    plan, _ = m.drain_plan("n0", K)
    gen2, _ = m.put_start("k", 2 * K, upsert=True)
    m.put_end("k", gen2)
    m.drain_done("n0", [["k", plan[0][1], plan[0][4], plan[0][5], True]])
    assert m.get("k")[:2] == (2 * K, gen2)
    m.check_invariants()


def test_moves_not_reported_by_their_deadline_are_dropped():
    m, clock = make()
    put_on(m, "n0", "k")
    m.drain_begin("n0")
    plan, _ = m.drain_plan("n0", K)
    dst = plan[0][4]
    before = m._alloc[dst].used
    assert before > 0
    clock.t += m.policy.put_timeout_s + 1
    for n in m._nodes.values():
        n.last_heartbeat = clock.t
    m.tick()
    assert m._alloc[dst].used == 0
    assert nodes_of(m, "k") == {("n0", "dram", True)}
    m.check_invariants()


def test_a_target_node_lost_mid_drain_is_skipped():
    m, _ = make()
    put_on(m, "n0", "k")
    m.drain_begin("n0")
    plan, _ = m.drain_plan("n0", K)
    m.unmount(plan[0][4])
    m.drain_done("n0", [["k", plan[0][1], plan[0][4], plan[0][5], True]])
    assert nodes_of(m, "k") == {("n0", "dram", True)}
    moves = run_drain(m, "n0")
    assert len(moves) == 1 and moves[0][1] != plan[0][4]
    m.check_invariants()


def test_a_put_in_flight_into_the_node_is_waited_for_then_moved():
    m, _ = make()
    put_on(m, "n0", "a")
    others = [n for n in m._nodes.values() if n.node_id != "n0"]
    for n in others:
        n.suspect = True
    gen, _ = m.put_start("late", K)  # started before the drain, on the leaving node
    for n in others:
        n.suspect = False
    m.drain_begin("n0")
    plan, again = m.drain_plan("n0", 64 * K)
    assert [p[0] for p in plan] == ["a"] and again
    m.drain_done("n0", [[k, g, d, o, True] for k, g, _s, _so, d, o in plan])
    assert m.drain_plan("n0", 64 * K) == ([], True)
    m.put_end("late", gen)
    assert [k for k, _ in run_drain(m, "n0")] == ["late"]
    assert m.drain_end("n0")["lost_keys"] == 0


def make_with_disk():
    """n0: 4 pages of DRAM and 16 of disk (its evictions go to disk); n1: room for all."""
    clock = Clock()
    m = MasterState(Policy(allocation_strategy="free_ratio_first", high_watermark=1.0, evict_ratio=0.01),
                    clock=clock, wall_ns=lambda: 0, seed=1)
    m.mount(NodeInfo("n0", "a", b"addr", b"rkey", 0, 4 * K, ray_node_id="ray0", spill_capacity=16 * K,
                     spill_high_watermark=1.0))
    m.mount(NodeInfo("n1", "a", b"addr", b"rkey", 0, 64 * K, ray_node_id="ray1"))
    return m, clock


def offload_all(m, node_id):
    effects = m.drain_effects()
    items = [(k, g, ln, True, "") for k, g, _s, _o, ln in effects[node_id].offload] if node_id in effects else []
    m.offload_done(node_id, items)
    return [i[0] for i in items]


def put_spilling(m, key):
    """Put ``key`` on n0, finishing the offloads to disk its room waits for."""
    try:
        return put_on(m, "n0", key)
    except OffloadPendingError:
        offload_all(m, "n0")
        return put_on(m, "n0", key)


def test_values_only_on_the_nodes_disk_are_moved_read_from_disk():
    m, clock = make_with_disk()
    on_disk = []
    for i in range(10):
        put_spilling(m, f"k{i}")
        clock.t += 1
        on_disk += offload_all(m, "n0")
    on_disk = [f"k{i}" for i in range(10) if nodes_of(m, f"k{i}") == {("n0", "disk", True)}]
    assert len(on_disk) >= 4, on_disk
    m.drain_begin("n0")
    from_disk = []
    while True:
        plan, _ = m.drain_plan("n0", 4 * K)
        if not plan:
            break
        for key, gen, size, src, dst, _o in plan:
            assert dst == "n1" and size == K
            if src == FROM_DISK:
                from_disk.append(key)
        # a disk read that failed (k0's file went bad) fails its move; the rest land
        m.drain_done("n0", [[k, g, d, o, k != on_disk[0]] for k, g, _s, _so, d, o in plan])
        m.check_invariants()
    assert sorted(from_disk) == sorted(on_disk)
    for key in on_disk[1:]:
        assert nodes_of(m, key) == {("n1", "dram", True)}  # the disk copy on n0 is dropped
    report = m.drain_end("n0")
    assert report["moved_keys"] == 9 and report["failed_moves"] == 1
    assert report["lost_keys"] == 1 and report["lost_bytes"] == K
    assert m.get(on_disk[0]) is None
    assert all(m.get(f"k{i}") is not None for i in range(10) if f"k{i}" != on_disk[0])
    m.check_invariants()



def test_a_target_whose_room_waits_for_offloads_to_disk_is_waited_for():
    clock = Clock()
    m = MasterState(Policy(allocation_strategy="free_ratio_first", high_watermark=1.0, evict_ratio=0.01),
                    clock=clock, wall_ns=lambda: 0, seed=1)
    for node_id, dram in (("n0", 4 * K), ("n1", 2 * K)):
        m.mount(NodeInfo(node_id, "a", b"addr", b"rkey", 0, dram, ray_node_id=f"ray-{node_id}",
                         spill_capacity=16 * K, spill_high_watermark=1.0))
    for key in ("a", "b"):
        put_on(m, "n1", key)  # n1's DRAM is full: room there means an offload first
        clock.t += 1
    put_on(m, "n0", "k")
    m.drain_begin("n0")
    assert m.drain_plan("n0", K) == ([], True)  # not "no room": the offload it started is awaited
    assert offload_all(m, "n1")
    plan, _ = m.drain_plan("n0", K)
    assert [(p[0], p[4]) for p in plan] == [("k", "n1")]
    m.drain_done("n0", [[k, g, d, o, True] for k, g, _s, _so, d, o in plan])
    assert m.drain_end("n0")["lost_keys"] == 0
    m.check_invariants()



def test_a_value_being_offloaded_when_the_drain_comes_is_moved_once_on_disk():
    m, clock = make_with_disk()
    for i in range(4):
        put_on(m, "n0", f"k{i}")
        clock.t += 1
    with pytest.raises(OffloadPendingError):
        put_on(m, "n0", "k4")  # no room: offloads to disk start, and are not finished yet
    effects = m.drain_effects()["n0"].offload
    offloading = [k for k, _g, _s, _o, _ln in effects]
    assert offloading
    m.drain_begin("n0")
    moved, again = [], False
    for _ in range(10):
        plan, again = m.drain_plan("n0", 64 * K)
        moved += [p[0] for p in plan]
        m.drain_done("n0", [[k, g, d, o, True] for k, g, _s, _so, d, o in plan])
        if not plan:
            break
    assert again, "the drain must wait for values between tiers, not end"
    assert not set(offloading) & set(moved)
    m.offload_done("n0", [(k, g, ln, True, "") for k, g, _s, _o, ln in effects])
    plan, _ = m.drain_plan("n0", 64 * K)
    assert sorted(p[0] for p in plan) == sorted(offloading) and all(p[3] == FROM_DISK for p in plan)
    m.drain_done("n0", [[k, g, d, o, True] for k, g, _s, _so, d, o in plan])
    assert m.drain_end("n0")["lost_keys"] == 0
    m.check_invariants()


def test_an_extent_a_move_writes_into_is_never_evicted_meanwhile():
    """A move's reserved extent on its target is not readable yet and is being written:
    eviction there (room for other puts) passes it over, so it is never handed out twice."""
    m, clock = make(caps=(64 * K, 4 * K))
    put_on(m, "n0", "k")
    m.drain_begin("n0")
    plan, _ = m.drain_plan("n0", K)
    assert [(p[0], p[4]) for p in plan] == [("k", "n1")]
    dst_off = plan[0][5]
    for i in range(8):  # n1 fills and evicts, over and over
        clock.t += 1
        put_on(m, "n1", f"other{i}")
        m.check_invariants()
        got = [r for r in m._objects.get("k").replicas if r.node_id == "n1"]
        assert [(r.offset, r.ready) for r in got] == [(dst_off, False)]
        for key in (f"other{j}" for j in range(i + 1)):
            obj = m._objects.get(key)
            assert obj is None or all(r.offset != dst_off for r in obj.replicas if r.node_id == "n1")
    m.drain_done("n0", [["k", plan[0][1], "n1", dst_off, True]])
    assert nodes_of(m, "k") == {("n1", "dram", True)}
    m.check_invariants()


def test_a_value_removed_while_it_is_moved_keeps_its_extents_until_the_move_is_reported():
    """The move holds a lease on the value: removed meanwhile, its extent on the target is
    not handed out again while the copy may still be writing into it."""
    m, _ = make(caps=(64 * K, 4 * K))
    put_on(m, "n0", "k")
    m.drain_begin("n0")
    plan, _ = m.drain_plan("n0", K)
    dst_off = plan[0][5]
    with pytest.raises(ObjectLeasedError):  # a remove waits for the move (retried by clients) ...
        m.remove("k")
    assert m.remove("k", force=True)  # ... unless forced

    def offsets_on_n1():
        return {r.offset for _key, obj in m._objects.items() for r in obj.replicas if r.node_id == "n1"}
    for i in range(3):  # the rest of n1: 3 pages
        put_on(m, "n1", f"other{i}")
    assert dst_off not in offsets_on_n1()
    m.drain_done("n0", [["k", plan[0][1], "n1", dst_off, True]])  # reported: "gone", the lease ends
    put_on(m, "n1", "after")
    assert dst_off in offsets_on_n1()
    m.check_invariants()


def test_a_read_of_a_value_moved_from_disk_promotes_it_where_its_disk_copy_is():
    """A DRAM copy a move is writing is not a promotion's extent: a reader of the value (on
    disk only until the move is reported) gets a promotion on the node holding the disk
    copy, and the move's extent stays the move's."""
    m, clock = make_with_disk()
    for i in range(10):
        put_spilling(m, f"k{i}")
        clock.t += 1
        offload_all(m, "n0")
    key = next(f"k{i}" for i in range(10) if nodes_of(m, f"k{i}") == {("n0", "disk", True)})
    m.drain_begin("n0")
    plan, _ = m.drain_plan("n0", 64 * K)
    move = next(p for p in plan if p[0] == key)
    assert move[3] == FROM_DISK and move[4] == "n1"
    others = [p for p in plan if p[0] != key]  # (their sources on n0 are held until they are done)
    m.drain_done("n0", [[k, g, d, o, True] for k, g, _s, _so, d, o in others])
    got = m.get(key)
    locs = [(loc[0], loc[1], loc[2]) for loc in got[3]]
    assert locs and all(n == "n0" and tier == "promote" for n, tier, _off in locs), locs
    assert not m.promotions_reserved("n1", [[key, move[1], move[5], K]])[0]
    m.drain_done("n0", [[key, move[1], move[4], move[5], True]])
    assert ("n1", "dram", True) in nodes_of(m, key)
    m.check_invariants()
