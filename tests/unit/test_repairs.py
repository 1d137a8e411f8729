"""Values short of copies are copied again (master/repairs.py): what is noted short, when
a repair is planned, from where to where, and what its report does. Literal plans."""

from mooncake_ray._private.master.allocator import ALIGN
from tests.unit.test_master_state import make, node, put

K = ALIGN


def nodes_of(m, key):
    """The nodes holding a readable copy (no lease taken)."""
    return sorted(n for n, _tier, ready in m.where(key) if ready)


def short(m):
    m.tick()
    return m.stats()["under_replicated_keys"]


def test_a_lost_node_leaves_its_values_short_and_they_are_copied_back_after_the_delay():
    m, clock = make(n_nodes=3, cap=64 * K, repair_delay_s=5.0)
    put(m, "a", 2 * K, replicas=2)
    put(m, "one", K, replicas=1)
    held = nodes_of(m, "a")
    lost, src = held[0], held[1]
    (other,) = {"n0", "n1", "n2"} - set(held)
    m.unmount(lost, "killed")
    assert nodes_of(m, "a") == [src] and short(m) == 1  # "one" wanted one copy: not short
    assert m.repair_plan(src, 1 << 20) == []  # a restarting node re-adopts sooner
    clock.t += 5.0
    assert m.repair_plan(other, 1 << 20) == []  # not a source: it holds no copy
    src_off = next(r for r in m.get("a")[3] if r[0] == src)[2]
    plan = m.repair_plan(src, 1 << 20)
    assert [p[:5] for p in plan] == [["a", m.get("a")[1], 2 * K, src_off, other]]
    assert m.repair_plan(src, 1 << 20) == []  # in flight: planned once
    assert nodes_of(m, "a") == [src]  # the new copy is not readable before it is written
    m.repair_done([[k, g, dst, off, True] for k, g, _s, _src, dst, off in plan])
    assert nodes_of(m, "a") == sorted([src, other])
    assert short(m) == 0 and m.stats()["repairs"] == 1 and m.stats()["repair_bytes"] == 2 * K
    delta = m.drain_effects()[other]  # the new holder records it (a restarted master finds it)
    assert "a" in [e.key for e in delta.adds if e.tier == "dram"]
    m.check_invariants()


def test_never_two_copies_on_one_node_and_a_failed_copy_is_planned_again():
    m, clock = make(n_nodes=2, cap=64 * K, repair_delay_s=0.0)
    put(m, "a", K, replicas=2)
    m.unmount("n1", "killed")
    assert m.repair_plan("n0", 1 << 20) == []  # no node without a copy
    m.mount(node(1, 64 * K, inc="b"))  # a new, empty process
    plan = m.repair_plan("n0", 1 << 20)
    assert [p[4] for p in plan] == ["n1"]
    used = m.stats()["used"]
    m.repair_done([[k, g, dst, off, False] for k, g, _s, _src, dst, off in plan])
    assert m.stats()["used"] == used - K and m.stats()["repair_failures"] == 1  # the extent is freed
    plan = m.repair_plan("n0", 1 << 20)
    assert [p[4] for p in plan] == ["n1"]
    m.repair_done([[k, g, dst, off, True] for k, g, _s, _src, dst, off in plan])
    assert nodes_of(m, "a") == ["n0", "n1"] and short(m) == 0
    m.check_invariants()


def test_a_put_placed_on_fewer_nodes_than_asked_is_short_until_another_node_joins():
    m, clock = make(n_nodes=1, cap=64 * K, repair_delay_s=0.0)
    put(m, "a", K, replicas=3)
    assert nodes_of(m, "a") == ["n0"] and short(m) == 1
    m.mount(node(1))
    m.mount(node(2))
    plan = m.repair_plan("n0", 1 << 20)
    assert sorted(p[4] for p in plan) == ["n1"]  # one copy of a value at a time
    m.repair_done([[k, g, dst, off, True] for k, g, _s, _src, dst, off in plan])
    assert short(m) == 1
    plan = m.repair_plan("n1", 1 << 20)  # any holder may be the source
    assert [p[4] for p in plan] == ["n2"]
    m.repair_done([[k, g, dst, off, True] for k, g, _s, _src, dst, off in plan])
    assert nodes_of(m, "a") == ["n0", "n1", "n2"] and short(m) == 0
    m.check_invariants()


def test_removed_replaced_and_readopted_values_are_not_repaired():
    m, clock = make(n_nodes=2, cap=64 * K, repair_delay_s=1.0)
    for k in ("removed", "replaced", "readopted"):
        put(m, k, K, replicas=2)  # on n0 and n1
    m.mount(node(2))
    lost = "n0"
    held = {e.key: e for e in m.node_entries(lost)}
    m.unmount(lost, "killed")
    assert short(m) == 3
    m.remove("removed")
    gen, _ = m.put_start("replaced", K, replicas=2, upsert=True)
    m.put_end("replaced", gen)
    m.mount(node(int(lost[1:]), 64 * K, inc="b"), [list(held["readopted"])])  # Ray restarted it
    clock.t += 1.0
    sources = {"n0", "n1", "n2"}
    assert [p for n in sorted(sources) for p in m.repair_plan(n, 1 << 20)] == []
    assert short(m) == 0
    assert lost in nodes_of(m, "readopted")
    m.check_invariants()


def test_a_target_lost_mid_copy_and_an_unreported_copy_are_planned_again():
    m, clock = make(n_nodes=3, cap=64 * K, repair_delay_s=0.0, put_timeout_s=10.0)
    put(m, "a", K, replicas=2)
    lost, src = nodes_of(m, "a")
    (other,) = {"n0", "n1", "n2"} - {lost, src}
    m.unmount(lost, "killed")
    plan = m.repair_plan(src, 1 << 20)
    assert [p[4] for p in plan] == [other]
    m.unmount(other, "killed")
    m.repair_done([[k, g, dst, off, True] for k, g, _s, _src, dst, off in plan])  # too late
    assert nodes_of(m, "a") == [src] and short(m) == 1
    m.mount(node(int(other[1:]), 64 * K, inc="b"))
    plan = m.repair_plan(src, 1 << 20)
    assert [p[4] for p in plan] == [other]
    clock.t += 10.0  # never reported: the reserved extent goes at the put timeout
    m.heartbeat(src, "a")
    m.heartbeat(other, "b")
    m.tick()
    assert nodes_of(m, "a") == [src] and m.repair_plan(src, 1 << 20) != []
    m.check_invariants()


def test_a_node_back_after_its_values_were_copied_again_does_not_leave_a_copy_too_many():
    """Re-adoption after a repair: the returning copy is dropped (two copies, not three).
    A repair that finishes after the node came back: the new copy is dropped. A value of
    one copy the node took with it comes back whole."""
    m, clock = make(n_nodes=3, cap=64 * K, repair_delay_s=0.0)
    for k in ("repaired", "in_flight"):
        put(m, k, K, replicas=2)
    put(m, "single", K, replicas=1)
    lost = next(n for n in nodes_of(m, "repaired") if n in nodes_of(m, "in_flight"))
    held = {e.key: e for e in m.node_entries(lost)}
    m.unmount(lost, "killed")
    plans = {n: m.repair_plan(n, 1 << 20) for n in ("n0", "n1", "n2")}
    done = [[k, g, dst, off, True] for ps in plans.values() for k, g, _s, _src, dst, off in ps if k == "repaired"]
    assert len(done) == 1
    m.repair_done(done)  # "repaired" has two copies again; "in_flight"'s copy is still being made
    assert len(nodes_of(m, "repaired")) == 2
    back = [list(held[k]) for k in held]
    m.mount(node(int(lost[1:]), 64 * K, inc="b"), back)  # Ray restarted it: it re-adopts
    assert len(nodes_of(m, "repaired")) == 2 and lost not in nodes_of(m, "repaired")
    assert len(nodes_of(m, "in_flight")) == 2 and lost in nodes_of(m, "in_flight")
    if "single" in held:
        assert nodes_of(m, "single") == [lost]
    late = [[k, g, dst, off, True] for ps in plans.values() for k, g, _s, _src, dst, off in ps if k == "in_flight"]
    m.repair_done(late)
    assert len(nodes_of(m, "in_flight")) == 2 and short(m) == 0
    assert m.stats()["surplus_copies_dropped"] == 2
    for n in ("n0", "n1", "n2"):  # every node's inventory is what the master holds
        m.drain_effects()
    m.check_invariants()
