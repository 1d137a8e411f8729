"""The master state machine with an injected clock: no Ray, each test in milliseconds."""

import pytest

from mooncake_ray.errors import (
    InvalidArgumentError,
    MasterUnavailableError,
    NoCapacityError,
    NodeUnavailableError,
    ObjectExistsError,
    ObjectLeasedError,
    ObjectNotFoundError,
    ObjectPendingError,
)
from mooncake_ray._private.master.allocator import ALIGN
from mooncake_ray._private.master.state import MasterState, Policy
from mooncake_ray._private.master.types import InventoryEntry, NodeInfo
from mooncake_ray._private.store.inventory import StoreInventory

K = ALIGN


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def node(i, cap=64 * K, inc="a"):
    return NodeInfo(f"n{i}", inc, b"addr", b"rkey", 0, cap, ray_node_id=f"ray{i}")


def make(n_nodes=2, cap=64 * K, **policy):
    clock = Clock()
    pol = Policy(**{"allocation_strategy": "free_ratio_first", **policy})
    m = MasterState(pol, clock=clock, wall_ns=lambda: 0, seed=1)
    for i in range(n_nodes):
        m.mount(node(i, cap))
    return m, clock


def put(m, key, size=K, **kw):
    gen, ext = m.put_start(key, size, **kw)
    m.put_end(key, gen)
    return gen, ext


def test_two_phase_put_is_invisible_until_end():
    m, _ = make()
    gen, ext = m.put_start("a", 10)
    assert not m.exists("a") and m.get("a") is None
    m.put_end("a", gen)
    m.put_end("a", gen)  # idempotent
    size, g, ttl, reps, _lease = m.get("a")
    assert (size, g) == (10, gen) and reps[0][0] == ext[0][0]
    m.check_invariants()


def test_put_of_existing_key_raises_and_keeps_old_value():
    m, _ = make()
    gen1, _ = put(m, "k")
    with pytest.raises(ObjectExistsError, match="upsert"):
        m.put_start("k", K)
    assert m.get("k")[1] == gen1


def test_upsert_replaces_at_put_end_and_old_stays_readable_meanwhile():
    m, _ = make()
    gen1, _ = put(m, "k")
    gen2, _ = m.put_start("k", 2 * K, upsert=True)
    assert m.get("k")[1] == gen1  # readers see the old value until publish
    with pytest.raises(ObjectPendingError):
        m.put_start("k", K, upsert=True)
    m.put_end("k", gen2)
    assert m.get("k")[:2] == (2 * K, gen2)
    m.check_invariants()


def test_revoke_and_put_timeout_reclaim_space():
    m, clock = make(n_nodes=1, put_timeout_s=5)
    gen, _ = m.put_start("a", 8 * K)
    assert m.stats()["used"] == 8 * K
    assert m.put_revoke("a", gen) and not m.put_revoke("a", gen)
    assert m.stats()["used"] == 0
    m.put_start("b", 8 * K)
    clock.t += 6
    m.tick()
    assert m.stats()["used"] == 0 and m.stats()["pending"] == 0
    with pytest.raises(ObjectNotFoundError):
        m.put_end("b", 1)


def test_replicas_land_on_distinct_nodes():
    m, _ = make(n_nodes=3)
    _, ext = put(m, "r", replicas=3)
    assert sorted(e[0] for e in ext) == ["n0", "n1", "n2"]
    _, ext = put(m, "r2", replicas=5)  # more than nodes: one per node
    assert len({e[0] for e in ext}) == 3
    m.check_invariants()


def test_local_first_prefers_callers_node():
    m, _ = make(n_nodes=3, allocation_strategy="local_first")
    for i in range(5):
        _, ext = put(m, f"k{i}", client_node="ray2")
        assert ext[0][0] == "n2"
    _, _, _, reps, _ = m.get("k0", client_node="ray2")
    assert reps[0][0] == "n2"


def test_free_ratio_first_balances():
    m, _ = make(n_nodes=2)
    nodes = [put(m, f"k{i}")[1][0][0] for i in range(6)]
    assert nodes == ["n0", "n1", "n0", "n1", "n0", "n1"]


def test_lease_blocks_remove_and_eviction_until_it_ends():
    m, clock = make(n_nodes=1, lease_ttl_s=10)
    put(m, "a")
    m.get("a")
    with pytest.raises(ObjectLeasedError):
        m.remove("a")
    clock.t += 11
    assert m.remove("a") and not m.remove("a")


def test_forced_remove_of_leased_object_defers_extent_reuse():
    m, clock = make(n_nodes=1, cap=4 * K, lease_ttl_s=10, high_watermark=1.0)
    _, ext = put(m, "a", 4 * K)
    m.get("a")
    assert m.remove("a", force=True)
    assert not m.exists("a")
    # The reader's lease still covers those bytes: they are not handed out again.
    with pytest.raises(NoCapacityError):
        m.put_start("b", 4 * K)
    clock.t += 10.5
    _, ext2 = m.put_start("b", 4 * K)
    assert ext2[0][1] == ext[0][1]
    m.check_invariants()


def test_a_removed_or_replaced_value_is_freed_when_its_readers_release():
    """A reader's release of a dropped value frees its extent at once, not at the
    lease's expiry; with two readers, only the second release does."""
    m, clock = make(n_nodes=1, cap=4 * K, lease_ttl_s=10, high_watermark=1.0)
    _, ext = put(m, "a", 4 * K)
    _, gen, _, _, l1 = m.get("a")
    *_, l2 = m.get("a")
    m.release("a", gen, m.get("a")[4])  # a third lease, released before the remove
    assert m.remove("a", force=True)
    m.release("a", gen, l1)
    with pytest.raises(NoCapacityError):  # the other reader still copies from it
        m.put_start("b", 4 * K)
    m.release("a", gen, l2)
    m.release("a", gen, l2)  # idempotent
    gen_b, ext2 = m.put_start("b", 4 * K)
    assert ext2[0][1] == ext[0][1]
    m.check_invariants()
    clock.t += 11  # the deferred entry's time passes: nothing is freed twice
    m.put_end("b", gen_b)
    m.put_start("c", 4 * K)  # room for c only by evicting b: the old entry freed nothing
    assert not m.exists("b")
    m.check_invariants()


def test_eviction_order_is_lru_skipping_leased_pinned_pending():
    # 10 slots of 1 granule; watermark eviction off so the order is observed on demand.
    m, clock = make(n_nodes=1, cap=10 * K, high_watermark=1.0, evict_ratio=0.1)
    for k in "abcdefgh":
        put(m, k)
        clock.t += 1
    m.get("a")               # a becomes most recent and leased
    m.pin("b")               # soft pin
    m.pin("c", hard=True)    # hard pin
    m.put_start("p", K)      # pending
    clock.t += 20            # leases over, except we re-lease e
    m.get("e")
    put(m, "x")              # fills the 10th slot
    evicted = []
    all_keys = list("abcdefghx")
    for i in range(8):
        alive = {k for k in all_keys if m.exists(k)}
        put(m, f"new{i}")    # each needs one slot: evicts exactly one victim
        all_keys.append(f"new{i}")
        evicted += sorted(alive - {k for k in all_keys if m.exists(k)})
    # Recency after the gets: b c d f g h a e x. Leased e is skipped, soft-pinned b waits
    # until no unpinned candidate is left (the new keys are plain ones), hard-pinned c never.
    assert evicted == ["d", "f", "g", "h", "a", "x", "new0", "new1"]
    assert m.exists("b") and m.exists("c") and m.exists("e")
    m.check_invariants()


def test_eviction_order_is_the_same_with_cold_records():
    """The same order as above when plain values are cold records the index drops itself
    (each section ends with a flush, as the actor's lock does): pins and the pending put
    are hot objects judged in Python, the leased and the plain values cold ones."""
    m, clock = make(n_nodes=1, cap=10 * K, high_watermark=1.0, evict_ratio=0.1)
    for k in "abcdefgh":
        put(m, k)
        m.flush()
        clock.t += 1
    m.get("a")
    m.pin("b")
    m.pin("c", hard=True)
    m.put_start("p", K)
    m.flush()
    clock.t += 20
    m.get("e")
    put(m, "x")
    m.flush()
    assert {k for k in "adefghx" if m._objects.hot(k) is None} == set("adefghx")  # cold
    assert m._objects.hot("b") is not None and m._objects.hot("c") is not None  # pinned: hot
    evicted = []
    all_keys = list("abcdefghx")
    for i in range(8):
        alive = {k for k in all_keys if m.exists(k)}
        put(m, f"new{i}")
        m.flush()
        all_keys.append(f"new{i}")
        evicted += sorted(alive - {k for k in all_keys if m.exists(k)})
    assert evicted == ["d", "f", "g", "h", "a", "x", "new0", "new1"]
    assert m.exists("b") and m.exists("c") and m.exists("e")
    m.check_invariants()


def test_soft_pinned_evicted_only_after_unpinned():
    m, clock = make(n_nodes=1, cap=3 * K, high_watermark=1.0, evict_ratio=0.1)
    put(m, "s")
    m.pin("s")
    clock.t += 1
    put(m, "h")
    m.pin("h", hard=True)
    put(m, "u")
    put(m, "n1")   # evicts u, the only unpinned one
    assert not m.exists("u") and m.exists("s")
    m.get("n1")    # leased: not a candidate either
    put(m, "n2")   # only the soft-pinned s is left to take
    assert not m.exists("s") and m.exists("h") and m.exists("n1")
    m.get("n2")
    with pytest.raises(NoCapacityError):
        m.put_start("n3", K)  # h hard-pinned, n1 and n2 leased: nothing to evict
    m.check_invariants()


def test_soft_pins_yield_to_what_a_put_needs_not_to_a_rounds_target():
    """A round aims past the put's need (``evict_ratio``): the unpinned values go up to
    that target, the soft-pinned ones only for the room the put cannot do without."""
    m, clock = make(n_nodes=1, cap=10 * K, high_watermark=1.0, evict_ratio=0.5)
    for k in "abcdefgh":
        put(m, k)
        clock.t += 1
    for k in "abcdef":
        m.pin(k)
    put(m, "i")
    put(m, "j")
    put(m, "x")  # one slot needed, five aimed at: the four unpinned go, no pinned one
    assert [k for k in "abcdefghijx" if m.exists(k)] == list("abcdefx")
    m.check_invariants()


def test_a_put_slab_never_takes_a_soft_pin_the_two_call_put_takes_only_its_room():
    """A put slab is room in advance: granting one evicts only unpinned values; when they
    do not make the room, the grant fails and the client's values go the two-call way,
    where each allocation takes soft-pinned values only for its own extent."""
    m, clock = make(n_nodes=1, cap=64 * K, high_watermark=1.0, evict_ratio=0.01, put_slab_bytes=16 * K)
    keys = [f"v{i}" for i in range(64)]
    for k in keys:
        put(m, k)
        clock.t += 1
    for k in keys[:60]:
        m.pin(k)
    for k in keys[60:]:
        m.get(k)  # leased: not evictable now
    with pytest.raises(NoCapacityError):
        m.slab_grant("c1", need=K)
    assert all(m.exists(k) for k in keys)
    put(m, "n")
    assert [k for k in keys if not m.exists(k)] == ["v0"] and m.exists("n")
    m.check_invariants()


def test_a_round_past_the_high_watermark_leaves_soft_pins():
    """The watermark's round frees ahead of puts to come: it never takes a soft pin."""
    m, clock = make(n_nodes=1, cap=10 * K, high_watermark=0.5, evict_ratio=0.3)
    for k in "abcd":
        put(m, k)
        m.pin(k)
        clock.t += 1
    put(m, "e")
    clock.t += 1
    put(m, "f")  # past the watermark: e goes, the pinned stay though the round wanted more
    assert [k for k in "abcdef" if m.exists(k)] == list("abcdf")
    m.check_invariants()


def test_literal_victim_sequence():
    m, clock = make(n_nodes=1, cap=6 * K, high_watermark=1.0, evict_ratio=1 / 6)
    for k in "uvwxyz":
        put(m, k)
        clock.t += 1
    m.get("u")
    clock.t += 100  # lease over; u is now the most recent
    order = []
    for i in range(6):
        before = {k for k in "uvwxyz" if m.exists(k)}
        put(m, f"n{i}")
        order += sorted(before - {k for k in "uvwxyz" if m.exists(k)})
    assert order == ["v", "w", "x", "y", "z", "u"]


def test_high_watermark_frees_a_batch():
    m, _ = make(n_nodes=1, cap=100 * K, high_watermark=0.9, evict_ratio=0.05)
    for i in range(91):
        put(m, f"k{i}")
    st = m.stats()
    assert st["evictions"] == 5 and st["used"] == 86 * K  # 91 used > 90: 5 evicted
    assert [m.exists(f"k{i}") for i in range(6)] == [False] * 5 + [True]


def test_default_marks_keep_a_cache_full_and_a_spilling_node_wider_apart():
    """Unset, a node without a spill tier evicts once its values pass 95% of the arena,
    2% a round; one with a spill tier (its evictions are offloads) at 90%, 5% a round."""
    m, _ = make(n_nodes=1, cap=100 * K)
    for i in range(95):
        put(m, f"k{i}")
    assert m.stats()["evictions"] == 0
    put(m, "k95")  # 96 used > 95: 2 evicted
    assert m.stats()["evictions"] == 2 and m.stats()["used"] == 94 * K
    assert Policy().marks(False) == (0.95, 0.02) and Policy().marks(True) == (0.9, 0.05)
    assert Policy(high_watermark=0.8, evict_ratio=0.1).marks(True) == (0.8, 0.1)


def test_value_larger_than_any_pool_is_bad_input_and_nothing_lost():
    m, _ = make(cap=16 * K)
    put(m, "keep")
    with pytest.raises(InvalidArgumentError, match="larger than any store node"):
        m.put_start("huge", 17 * K)
    assert m.exists("keep")


def test_no_capacity_when_everything_is_pinned():
    m, _ = make(n_nodes=1, cap=4 * K, high_watermark=1.0)
    for k in "ab":
        put(m, k, 2 * K)
        m.pin(k, hard=True)
    with pytest.raises(NoCapacityError):
        m.put_start("c", K)
    assert m.exists("a") and m.exists("b")


def test_bad_keys():
    m, _ = make(max_key_bytes=8)
    for bad, msg in [("", "empty"), ("x" * 9, "longer"), (5, "str")]:
        with pytest.raises(InvalidArgumentError, match=msg):
            m.put_start(bad, 1)


def test_node_ttl_unmounts_and_keys_become_misses():
    m, clock = make(n_nodes=2, node_ttl_s=5)
    put(m, "one", client_node=None)
    put(m, "two", replicas=2)
    gen, ext = m.put_start("pend", K, replicas=2)
    clock.t += 3
    assert m.heartbeat("n1", "a")
    clock.t += 3
    res = m.tick()
    assert res["unmounted"] == ["n0"]
    assert m.exists("two")
    assert m.get("two")[3][0][0] == "n1"
    assert not m.exists("one") or m.get("one")[3][0][0] == "n1"
    with pytest.raises(NodeUnavailableError):
        m.put_end("pend", gen)
    m.check_invariants()


def test_a_stalled_master_does_not_take_its_own_pause_for_the_nodes_silence():
    m, clock = make(n_nodes=2, node_ttl_s=5)
    clock.t += 60  # nobody was heard: the master itself did not run
    m.excuse_silence(2.5)
    clock.t += 2
    assert m.tick()["unmounted"] == []
    assert m.heartbeat("n1", "a")
    clock.t += 1  # n0 stays silent past the window it was given
    assert m.tick()["unmounted"] == ["n0"]
    assert m.counters["node_unmounts"] == 1


def test_suspect_node_gets_no_new_puts_until_heartbeat():
    m, _ = make(n_nodes=2)
    m.report_unreachable("n0")
    assert all(put(m, f"k{i}")[1][0][0] == "n1" for i in range(3))
    m.heartbeat("n0", "a")
    assert {put(m, f"j{i}")[1][0][0] for i in range(3)} == {"n0"}


def test_effects_carry_inventory_and_rebuild_restores_everything():
    m, clock = make(n_nodes=2)
    put(m, "a", 3 * K, replicas=2)
    put(m, "b", K)
    put(m, "c", K)
    m.remove("c")
    m.pin("b", hard=True)
    inv = {"n0": StoreInventory(), "n1": StoreInventory()}
    for node_id, d in m.drain_effects().items():
        mount_id, _ = inv[node_id].begin_mount()
        inv[node_id].apply(mount_id, 1, d.to_wire())
    inv = {n: {e[0]: InventoryEntry(*e) for e in i.entries.values()} for n, i in inv.items()}
    assert m.drain_effects() == {}
    # A new master incarnation rebuilds from the nodes' inventories.
    m2 = MasterState(m.policy, clock=clock, wall_ns=lambda: 0)
    m2.begin_recovery({"n0", "n1"})
    with pytest.raises(MasterUnavailableError):
        m2.get("a")
    m2.mount(node(0), list(inv["n0"].values()))
    assert m2.recovering
    m2.mount(node(1), list(inv["n1"].values()))
    assert not m2.recovering
    assert m2.get("a")[0] == 3 * K and len(m2.get("a")[3]) == 2
    assert m2.exists("b") and not m2.exists("c")
    assert m2.stats()["used"] == m.stats()["used"] and m2.stats()["pinned"] == 1
    clock.t += m2.policy.put_slab_ttl_s  # allocations wait until old put slabs are dead
    gen, _ = m2.put_start("d", K)
    assert gen > max(e.gen for d in inv.values() for e in d.values())
    m2.check_invariants()


def test_recovery_gives_up_waiting_after_timeout():
    m, clock = make(n_nodes=0, recovery_timeout_s=5)
    m.begin_recovery({"n0"})
    assert m.recovering
    clock.t += 6
    assert not m.recovering


def test_remount_with_new_incarnation_drops_old_replicas():
    m, _ = make(n_nodes=1)
    put(m, "a")
    m.mount(node(0, inc="b"))
    assert not m.exists("a") and m.stats()["used"] == 0


def test_remove_prefix_and_all():
    m, _ = make()
    for k in ["x/1", "x/2", "y/1"]:
        put(m, k)
    assert m.remove_prefix("x/") == 2
    assert m.remove_all() == 1 and m.stats()["keys"] == 0


def test_hits_misses_counted():
    m, _ = make()
    put(m, "a")
    m.get("a"), m.get("a"), m.get("zz")
    st = m.stats()
    assert (st["hits"], st["misses"]) == (2, 1)


def test_put_start_retry_by_same_owner_is_idempotent():
    m, _ = make()
    a = m.put_start("k", K, owner="c1")
    assert m.put_start("k", K, owner="c1") == a
    with pytest.raises(ObjectPendingError):
        m.put_start("k", K, owner="c2")
    m.put_end("k", a[0])
    m.check_invariants()


def test_released_leases_end_at_once_and_release_is_idempotent():
    m, clock = make(n_nodes=1, lease_ttl_s=10)
    put(m, "a")
    *_, l1 = m.get("a")
    *_, l2 = m.get("a")
    gen = m.get("a")[1]
    m.release("a", gen, l1)
    m.release("a", gen, l1)  # a retried release does not end the other readers' leases
    with pytest.raises(ObjectLeasedError):
        m.remove("a")
    m.release("a", gen, l2)
    m.release("a", gen, l2 + 1)  # the third get's lease
    assert m.remove("a")  # no reader left: no need to wait for expiry


def test_one_reader_holds_its_lease_without_a_set_and_a_released_value_holds_none():
    m, clock = make(n_nodes=1, lease_ttl_s=10)
    put(m, "a")
    obj = m._objects["a"]
    *_, l1 = m.get("a")
    assert obj.leases == l1                      # one reader: the id itself
    *_, l2 = m.get("a")
    assert obj.leases == {l1, l2}
    m.release("a", obj.gen, l2)
    m.release("a", obj.gen, l2)
    assert obj.leases == {l1} and obj.lease_until > clock.t
    m.release("a", obj.gen, l1 + l2 + 1)         # not a lease of it: no-op
    m.release("a", obj.gen, l1)
    assert obj.leases is None and obj.lease_until <= clock.t
    *_, l3 = m.get("a")
    clock.t += 11                                # l3 expires unreleased
    *_, l4 = m.get("a")
    assert obj.leases == l4
    m.release("a", obj.gen, l3)                  # the expired lease's late release
    assert obj.leases == l4 and obj.lease_until > clock.t
    m.release("a", obj.gen, l4)
    assert obj.leases is None and m.remove("a")


def test_random_strategy_spreads_over_nodes():
    m, _ = make(n_nodes=3, allocation_strategy="random")
    nodes = {put(m, f"k{i}")[1][0][0] for i in range(30)}
    assert nodes == {"n0", "n1", "n2"}


def test_rebuild_resolves_overlapping_entries_in_favour_of_the_newer_allocation():
    # A drop of "old" never reached the node before the master died, and its extent was
    # reused by "new": the node remembers both. The newer allocation must win, or "old"
    # would come back pointing at "new"'s bytes.
    m = MasterState(Policy(), clock=Clock(), wall_ns=lambda: 0)
    stale = InventoryEntry("old", 5, K, "dram", 0, K)
    fresh = InventoryEntry("new", 9, K, "dram", 0, K)
    m.mount(node(0), [stale, fresh])
    assert m.exists("new") and not m.exists("old")
    assert ("old", 5, "dram") in m.drain_effects()["n0"].drops
    m.check_invariants()


def test_pin_counts_follow_pins_unpins_expiry_removal_and_replacement():
    m, clock = make(n_nodes=1)
    for k in "abcdef":
        put(m, k)
    m.pin("a", hard=True)
    m.pin("b", ttl_s=5)
    m.pin("c")
    m.unpin("c")
    m.pin("d")
    m.remove("d")
    m.pin("e")
    gen, _ = m.put_start("e", K, upsert=True)
    m.put_end("e", gen)  # the new value is not pinned
    st = m.stats()
    assert (st["pinned"], st["soft_pinned"]) == (2, 1)
    clock.t += 6  # b's soft pin expires
    st = m.stats()
    assert (st["pinned"], st["soft_pinned"]) == (1, 0)
    m.pin("f")
    assert (m.stats()["pinned"], m.stats()["soft_pinned"]) == (2, 1)
    assert set(m._replicas.pinned) <= {"a", "b", "f"}  # the others were forgotten when counted


def test_background_eviction_works_in_chunks_down_to_a_round_below_the_watermark():
    """With evict_in_background, crossing the watermark only notes the node; evict_due
    then evicts at most a chunk per call, oldest first, until the node is evict_ratio below
    the watermark. A put that finds no room still evicts at once."""
    m, clock = make(n_nodes=1, cap=100 * K, high_watermark=0.5, evict_ratio=0.2, evict_in_background=True)
    for i in range(60):
        put(m, f"k{i}")
        m.flush()
        clock.t += 1
    assert m.eviction_due() and m.counters["evictions"] == 0 and m.stats()["used"] == 60 * K
    sizes = []
    while m.evict_due(7 * K):  # chunks of 7 pages
        sizes.append(60 * K - m.stats()["used"] - sum(sizes))
    sizes.append(60 * K - m.stats()["used"] - sum(sizes))
    assert sizes == [7 * K, 7 * K, 7 * K, 7 * K, 2 * K]  # 60 -> 30 pages: (0.5 - 0.2) x 100
    assert [k for k in (f"k{i}" for i in range(60)) if m.exists(k)] == [f"k{i}" for i in range(30, 60)]
    assert not m.eviction_due()
    for i in range(60, 140):  # past 100%: allocation evicts inline, never fails
        put(m, f"k{i}")
    assert m.exists("k139") and m.counters["evictions"] > 30
    m.check_invariants()
