"""Draining a store node in the master's state machine (drain.py): no Ray, injected clock."""

from mooncake_ray._private.master.allocator import ALIGN
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
    gen, _ = m.put_start(key, size)
    m.put_end(key, gen)
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
    m, _ = make(caps=(64 * K, 4 * K))
    for i in range(8):
        put_on(m, "n0", f"k{i}")
    for i in range(4):  # the other node is full of pinned values: nothing can be evicted there
        put_on(m, "n1", f"p{i}")
        m.pin(f"p{i}", hard=True)
    m.drain_begin("n0")
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
