"""Values short of copies are copied again (master/repairs.py): what is noted short, when
a repair is planned, from where to where, and what its report does. Literal plans."""

import pytest

from mooncake_ray.errors import InvalidArgumentError
from mooncake_ray._private.master.allocator import ALIGN
from mooncake_ray._private.master.state import MasterState
from mooncake_ray._private.store.inventory import StoreInventory, check_delta
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


def test_repairs_start_once_every_lost_node_is_back_not_after_the_whole_delay():
    """A lost node that mounts again, empty (a new process without its arena), brings
    nothing back: what is still short is due at once. While another lost node may still
    come back, the delay stands; a node that re-adopts takes its values off the list."""
    m, clock = make(n_nodes=4, cap=64 * K, repair_delay_s=10.0)
    for i in range(8):
        put(m, f"v{i}", K, replicas=2)
    on = {n: {e.key: e for e in m.node_entries(n)} for n in ("n0", "n1", "n2", "n3")}
    # two nodes that share no value (each value keeps a copy), the others the sources
    a, b = next((a, b) for a in on for b in on if a < b and on[a] and on[b] and not set(on[a]) & set(on[b]))
    sources = ("n0", "n1", "n2", "n3")
    m.unmount(a, "killed")
    m.unmount(b, "killed")
    assert short(m) == len(on[a]) + len(on[b])
    clock.t += 1.0
    m.mount(node(int(a[1:]), 64 * K, inc="b"))  # back empty
    assert [p for n in sources for p in m.repair_plan(n, 1 << 20)] == []  # b may still come back
    m.mount(node(int(b[1:]), 64 * K, inc="b"), [list(e) for e in on[b].values()])  # back with its arena
    plans = [p for n in sources for p in m.repair_plan(n, 1 << 20)]  # 1 s after the loss, not 10
    assert sorted(p[0] for p in plans) == sorted(on[a]) and short(m) == len(on[a])
    m.repair_done([[k, g, dst, off, True] for k, g, _s, _src, dst, off in plans])
    assert short(m) == 0 and all(len(nodes_of(m, f"v{i}")) == 2 for i in range(8))
    m.unmount(a, "killed")  # a node lost for good: the delay stands, then repairs go
    assert short(m) > 0 and [p for n in sources for p in m.repair_plan(n, 1 << 20)] == []
    clock.t += 10.0
    assert [p for n in sources for p in m.repair_plan(n, 1 << 20)] != []
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


def test_a_restarted_master_finds_the_values_short_of_the_copies_their_puts_asked_for():
    """Each node's entry of a value says how many copies its put asked for: a master that
    restarts after a node's loss (the node's entries gone with it) queues what is short,
    through the store nodes' inventories, as the master that saw the loss would have."""
    m, clock = make(n_nodes=3, cap=64 * K, repair_delay_s=10.0)
    for i in range(6):
        put(m, f"two{i}", K, replicas=2)
        put(m, f"one{i}", K, replicas=1)
    put(m, "three", K, replicas=3)
    inv = {n: StoreInventory() for n in ("n0", "n1", "n2")}
    for node_id, d in m.drain_effects().items():
        mount_id, _ = inv[node_id].begin_mount()
        inv[node_id].apply(mount_id, 1, d.to_wire())
    lost = "n0"
    on_lost = {e[0] for e in inv[lost].entries.values()}
    assert all(e[8] == (2 if e[0].startswith("two") else 3 if e[0] == "three" else 1)
               for i in inv.values() for e in i.entries.values())
    m2 = MasterState(m.policy, clock=clock, wall_ns=lambda: 0)  # the master restarts; n0 is gone
    m2.begin_recovery({"n1", "n2"})
    for n in ("n1", "n2"):
        m2.mount(node(int(n[1:]), 64 * K), [e for e in inv[n].entries.values()])
    expect = sorted(k for k in on_lost if not k.startswith("one"))
    assert sorted(m2.repairs.short) == expect and "three" in expect
    plans = [p for n in ("n1", "n2") for p in m2.repair_plan(n, 1 << 20)]  # no lost node to wait for
    assert sorted(p[0] for p in plans) == [k for k in expect if k != "three"]  # "three": no third node
    m2.repair_done([[k, g, dst, off, True] for k, g, _s, _src, dst, off in plans])
    assert all(len(nodes_of(m2, k)) == 2 for k in expect if k != "three")
    m2.mount(node(0, 64 * K, inc="b"))  # a node without a copy of "three"
    plans = [p for n in ("n0", "n1", "n2") for p in m2.repair_plan(n, 1 << 20)]
    assert [(p[0], p[4]) for p in plans] == [("three", "n0")]
    m2.repair_done([[k, g, dst, off, True] for k, g, _s, _src, dst, off in plans])
    assert short(m2) == 0 and len(nodes_of(m2, "three")) == 3
    new = {}  # the copies made after the restart say how many the put asked for, too
    for node_id, d in m2.drain_effects().items():
        new.update({e.key: e.want for e in d.adds})
    assert new and all(w == (3 if k == "three" else 2) for k, w in new.items())
    m2.check_invariants()


def test_an_entry_saved_before_entries_said_how_many_copies_means_one():
    inv = StoreInventory([("a", 1, K, "dram", 0, K), ("b", 2, K, "dram", K, K, 0, "p")])
    assert sorted(e[8] for e in inv.entries.values()) == [1, 1]
    with pytest.raises(InvalidArgumentError, match="malformed inventory entry"):
        check_delta([[("c", 3, K, "dram", 0, K, 0, "", 0)], [], []])


@pytest.mark.parametrize("native", [False, True])
def test_a_lost_nodes_values_are_copied_most_recently_used_first(native):
    """Within one loss, the values read last are whole again first (the read index's
    recency order, Python's reference index and the native one alike)."""
    from mooncake_ray._private.master.state import Policy
    from mooncake_ray._private.master.pyindex import PyIndex
    from mooncake_ray._private.native import _native
    from tests.unit.test_master_state import Clock

    clock = Clock()
    m = MasterState(Policy(allocation_strategy="free_ratio_first", repair_delay_s=0.0), clock=clock,
                    wall_ns=lambda: 0, seed=1, index=_native.MasterIndex() if native else PyIndex())
    for i in range(3):
        m.mount(node(i, 64 * K))
    keys = [f"v{i}" for i in range(9)]
    for k in keys:
        put(m, k, K, replicas=2)
    on_lost = [k for k in keys if "n0" in nodes_of(m, k)]
    assert len(on_lost) >= 4
    read = [on_lost[2], on_lost[0], on_lost[3], on_lost[1]]  # the last read is the most recent
    for k in read:
        m.get(k)
    m.unmount("n0", "killed")
    assert list(m.repairs.short)[:4] == list(reversed(read))
    firsts = {p[0][0] for p in (m.repair_plan(n, 1) for n in ("n1", "n2")) if p}  # one copy a call
    assert read[-1] in firsts
