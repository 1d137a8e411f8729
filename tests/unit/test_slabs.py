"""Put slabs in the master state machine (one master call per put): grant, commit,
conflicts, expiry, node loss, and the allocation gate after a master restart."""

import pytest

from mooncake_ray.errors import (
    InvalidArgumentError,
    LeaseExpiredError,
    MasterUnavailableError,
    NoCapacityError,
    ObjectExistsError,
    ObjectPendingError,
)
from mooncake_ray._private.master.allocator import ALIGN
from mooncake_ray._private.master.state import MasterState, Policy
from tests.unit.test_master_state import Clock, make, node, put

K = ALIGN


def commit(m, key, slab_id, offset, size, upsert=False, owner="c1"):
    return m.put_commit(key, slab_id, offset, size, upsert, owner)


def grant(m, need=0, owner="c1", client_node=None):
    slab_id, node_id, off, length, inc, ttl = m.slab_grant(owner, client_node, need)
    return slab_id, node_id, off, length


def test_commit_publishes_in_one_call_and_pieces_are_carved():
    m, _ = make(n_nodes=1, cap=256 * K, put_slab_bytes=16 * K)
    sid, nid, off, length = grant(m)
    assert length == 16 * K  # min(put_slab_bytes, capacity / 16)
    assert m.stats()["used"] == 16 * K and m.stats()["slab_bytes"] == 16 * K
    gen_b = commit(m, "b", sid, off + 4 * K, 5000)  # out of order: another thread's value
    gen_a = commit(m, "a", sid, off, 100)
    assert gen_a > gen_b
    size, g, _ttl, reps, _lease = m.get("a")
    assert (size, g, reps[0][:3]) == (100, gen_a, (nid, "dram", off))
    assert m.get("b")[3][0][2] == off + 4 * K and m.get("b")[3][0][3] == 2 * K
    assert m.stats()["slab_bytes"] == 16 * K - 2 * K - 128  # "a" (100 bytes) is packed into 128
    delta = m.drain_effects()[nid]
    assert {e.key for e in delta.adds if e.tier == "dram"} == {"a", "b"}  # the node's inventory learns both
    assert [e.key for e in delta.adds if e.tier == "reserved"] == [f"slab/{sid}"]  # and the slab
    m.check_invariants()


def test_commit_of_a_used_or_outside_extent_is_refused():
    m, _ = make(n_nodes=1, cap=256 * K, put_slab_bytes=16 * K)
    sid, _nid, off, _ = grant(m)
    commit(m, "a", sid, off, K)
    for bad in (off, off + 100, off + 16 * K, off - K):
        with pytest.raises(InvalidArgumentError, match="not an uncommitted part"):
            commit(m, "x", sid, bad, K)
    with pytest.raises(InvalidArgumentError, match="uncommitted"):
        commit(m, "x", sid, off + K, 20 * K)  # longer than what is left
    with pytest.raises(InvalidArgumentError, match="size"):
        commit(m, "x", sid, off + K, -1)
    with pytest.raises(InvalidArgumentError, match="empty"):
        commit(m, "", sid, off + K, 1)
    assert not m.exists("x")
    m.check_invariants()


def test_commit_conflicts_free_their_extent_and_keep_the_stored_value():
    m, _ = make(n_nodes=1, cap=256 * K, put_slab_bytes=16 * K)
    sid, _nid, off, _ = grant(m)
    gen = commit(m, "a", sid, off, K)
    used = m.stats()["used"]
    with pytest.raises(ObjectExistsError):
        commit(m, "a", sid, off + K, K)
    assert m.stats()["used"] == used - K and m.get("a")[1] == gen  # freed, old value kept
    pgen, _ = m.put_start("p", K)  # a two-call put of "p" in flight
    with pytest.raises(ObjectPendingError):
        commit(m, "p", sid, off + 2 * K, K)
    m.put_end("p", pgen)
    new = commit(m, "a", sid, off + 3 * K, 2 * K, True)  # upsert replaces
    assert m.get("a")[:2] == (2 * K, new)
    m.check_invariants()


def test_unknown_returned_or_expired_slab_raises_lease_expired():
    m, clock = make(n_nodes=1, cap=256 * K, put_slab_bytes=16 * K, put_slab_ttl_s=2, put_timeout_s=10,
              node_ttl_s=1000)
    with pytest.raises(LeaseExpiredError, match="slab 99"):
        commit(m, "a", 99, 0, K)
    sid, _nid, off, _ = grant(m)
    with pytest.raises(LeaseExpiredError):
        commit(m, "a", sid, off, K, owner="c2")  # someone else's slab
    commit(m, "a", sid, off, K)
    assert m.slab_return(sid) == 15 * K and m.slab_return(sid) == 0  # idempotent
    assert m.stats()["used"] == K
    with pytest.raises(LeaseExpiredError):
        commit(m, "b", sid, off + K, K)
    sid2, *_ = grant(m, owner="dead-client")
    clock.t += 11.9
    m.tick()
    assert m.stats()["slabs"] == 1  # ttl + put_timeout_s not passed yet
    clock.t += 0.2
    assert m.tick()["slabs_expired"] == 1
    assert m.stats()["used"] == K and m.exists("a")
    m.check_invariants()


def test_node_loss_drops_its_slabs():
    m, _ = make(n_nodes=2, cap=256 * K, put_slab_bytes=16 * K)
    sid, nid, off, _ = grant(m)
    m.unmount(nid, "killed")
    with pytest.raises(LeaseExpiredError):
        commit(m, "a", sid, off, K)
    m.mount(node(int(nid[1:]), 256 * K, inc="b"))  # back with a new arena: nothing reserved
    assert m.stats()["nodes"][nid]["dram"]["used"] == 0
    m.check_invariants()


def test_grant_size_placement_and_refusals():
    m, _ = make(n_nodes=2, cap=256 * K, put_slab_bytes=1 << 30, allocation_strategy="local_first")
    sid, nid, _off, length = grant(m, client_node="ray1")
    assert nid == "n1" and length == 16 * K  # capped at 1/16 of the arena, on the caller's node
    assert grant(m, need=40 * K)[3] == 40 * K  # a larger need gets what it asks
    with pytest.raises(NoCapacityError):
        m.slab_grant("c1", None, 100 * K)  # more than a quarter of any arena
    m2, _ = make(n_nodes=1, put_slab_bytes=0)
    with pytest.raises(InvalidArgumentError, match="disabled"):
        m2.slab_grant("c1")
    m.check_invariants()


def test_a_grant_goes_to_the_preferred_node_only_where_it_has_the_room_free():
    """``prefer`` (the node of a KV chain's parent): taken first where a slab fits in its
    free room; a full preferred node evicts nothing for it, the next node in the strategy's
    order gives the slab; an unknown node is no preference; a bad one is a typed error."""
    m, _ = make(n_nodes=2, cap=64 * K, put_slab_bytes=4 * K, high_watermark=1.0,
                allocation_strategy="local_first")
    assert m.slab_grant("c1", "ray0", 0, "n1")[1] == "n1"  # preferred over the caller's own node
    assert m.slab_grant("c1", "ray0", 0)[1] == "n0"
    assert m.slab_grant("c1", "ray0", 0, "nope")[1] == "n0"
    i = 0
    while m._alloc["n1"].free >= 4 * K:  # n1 full: values on all of it but its slab
        gen, ext = m.put_start(f"k{i}", K, client_node="ray1")
        assert ext[0][0] == "n1"
        m.put_end(f"k{i}", gen)
        i += 1
    evictions = m.counters["evictions"]
    assert m.slab_grant("c1", "ray0", 0, "n1")[1] == "n0"
    assert m.counters["evictions"] == evictions  # nothing evicted for a preference
    with pytest.raises(InvalidArgumentError, match="prefer"):
        m.slab_grant("c1", "ray0", 0, 7)
    m.check_invariants()


def test_grant_evicts_like_a_put_when_the_node_is_full():
    m, _ = make(n_nodes=1, cap=64 * K, put_slab_bytes=4 * K, high_watermark=1.0)
    for i in range(64):
        gen, _ = m.put_start(f"k{i}", K)
        m.put_end(f"k{i}", gen)
    sid, _nid, off, length = grant(m)
    assert length == 4 * K and m.counters["evictions"] >= 1
    commit(m, "new", sid, off, K)
    m.check_invariants()


def test_restarted_master_allocates_nothing_until_old_slabs_are_dead():
    clock = Clock()
    m = MasterState(Policy(put_slab_ttl_s=2.0, put_slab_bytes=16 * K), clock=clock, wall_ns=lambda: 0)
    m.begin_recovery({"n0"})
    m.mount(node(0, 256 * K))
    assert not m.recovering
    with pytest.raises(MasterUnavailableError, match="put_slab_ttl_s"):
        m.slab_grant("c1")
    with pytest.raises(MasterUnavailableError, match="put_slab_ttl_s"):
        m.put_start("a", K)
    assert m.get("a") is None and not m.exists("a")  # reads are not held up
    clock.t += 2.0
    grant(m)
    m.put_start("a", K)
    m.check_invariants()


def test_restarted_master_keeps_recorded_slabs_and_pending_puts_out_of_allocations_and_allocates_at_once():
    """With durable acknowledgements every slab and pending put is in its node's inventory
    (reserved entries) before the client writes there: the next master allocates at once,
    around those ranges, and frees them once no client may start a write into them."""
    from mooncake_ray._private.store.inventory import StoreInventory

    clock, wall = Clock(), iter(range(1, 10_000))
    policy = Policy(put_slab_ttl_s=2.0, put_slab_bytes=16 * K, put_timeout_s=30.0, durable_acks=True)
    old = MasterState(policy, clock=clock, wall_ns=lambda: next(wall))
    old.mount(node(0, 256 * K))
    sid, nid, off, length = grant(old)
    gen_a = commit(old, "a", sid, off, 3 * K)  # a value in the slab, the rest still the client's
    pgen, [ext] = old.put_start("big", 8 * K)  # a two-call put being written
    inv = StoreInventory()  # the node, once it has applied what the old master sent
    delta = old.drain_effects()[nid]
    inv.apply(0, 1, delta.to_wire())
    assert {e[0] for e in inv.entries.values() if e[3] == "reserved"} == {f"slab/{sid}", f"put/{pgen}"}

    new = MasterState(policy, clock=clock, wall_ns=lambda: next(wall))
    new.begin_recovery({nid})
    new.mount(node(0, 256 * K), inv.snapshot())
    assert new.get("a")[1] == gen_a
    taken = [(off + 3 * K, length - 3 * K), (ext.offset, ext.length)]  # nobody may allocate these yet
    placed = []
    for i in range(12):  # no wait (no allocation gate), and never on the reserved ranges
        g, [e] = new.put_start(f"n{i}", 8 * K)
        new.put_end(f"n{i}", g)
        placed.append((e.offset, e.length))
    assert all(o + n <= t or t + tl <= o for o, n in placed for t, tl in taken), (placed, taken)
    with pytest.raises(LeaseExpiredError):  # the old slab is not the client's any more
        commit(new, "late", sid, off + 3 * K, K)
    new.check_invariants()
    # The node's entries now name the new master's ownerless slabs; they go at expiry.
    reserved = new.reserved_entries(nid)
    assert sorted((e.offset, e.length) for e in reserved) == sorted([(off, length), (ext.offset, ext.length)])
    clock.t += 2.5
    new.heartbeat(nid, "a")
    new.tick()
    assert [(e.offset, e.length) for e in new.reserved_entries(nid)] == [(ext.offset, ext.length)]
    clock.t += 30
    new.heartbeat(nid, "a")
    new.tick()
    assert new.reserved_entries(nid) == []
    assert new.stats()["used"] == 3 * K + 12 * 8 * K
    new.check_invariants()


def test_a_fragmented_arena_gets_a_shorter_slab_rather_than_evictions():
    """Slabs given back partly used leave free runs a little shorter than a slab; a grant
    there takes the largest run instead of evicting until a whole slab's run forms."""
    M = 1 << 20
    m, _ = make(n_nodes=1, cap=64 * M, put_slab_bytes=4 * M, high_watermark=0.85, evict_ratio=0.05)
    for i in range(16):  # fill the arena with 16 slabs, each given back with its first MiB unused
        sid, _nid, off, length = grant(m)
        assert (off, length) == (4 * M * i, 4 * M)
        for j in range(1, 4):
            commit(m, f"k{i}.{j}", sid, off + j * M, M)
        m.slab_return(sid)
    assert m.stats()["used"] == 48 * M
    sid, _nid, off, length = grant(m)
    assert length == M  # the largest free run (1 MiB), no eviction
    assert m.stats()["evictions"] == 0 and len(m._objects) == 48
    commit(m, "last", sid, off, M)
    assert m.stats()["evictions"] == 0
    sid, _nid, off, length = grant(m)  # 15 runs of 1 MiB left: the same again
    assert length == M and m.stats()["evictions"] == 0
    m.check_invariants()


def test_the_default_slab_budget_is_half_the_headroom_above_the_default_watermark():
    M = 1 << 20
    m, _ = make(n_nodes=1, cap=64 * M)  # marks unset: values evicted past 95%
    assert m._slab_table.budget(64 * M) == int(0.05 * 64 * M) // 2 // K * K
    assert m._slab_table.budget(4 * M) == M  # at least one small slab


def test_slabs_of_many_clients_share_a_budget_and_eviction_follows_the_values():
    """A fleet of clients, each with a slab: the slabs' uncommitted room stays within half
    the headroom above the watermark (a grant past it fails: the two-call way), and the
    store evicts only once the values themselves pass the watermark."""
    M = 1 << 20
    m, _ = make(n_nodes=1, cap=64 * M, put_slab_bytes=32 * M, high_watermark=0.9)
    budget = m._slab_table.budget(64 * M)
    assert budget == int(0.1 * 64 * M) // 2 // K * K
    granted = []
    for c in range(32):
        try:
            granted.append((f"c{c}", grant(m, owner=f"c{c}")))
        except NoCapacityError:
            pass
    assert 0 < sum(g[1][3] for g in granted) <= budget and len(granted) < 32
    # Values fill the arena two-call, while the slabs hold their room: no eviction
    # until the values pass the watermark.
    i = 0
    while m.stats()["used"] - m.stats()["slab_bytes"] + M <= 0.9 * 64 * M:
        put(m, f"v{i}", M)
        i += 1
    assert m.stats()["evictions"] == 0 and i >= 0.9 * 64 - budget / M - 2
    for j in range(3):
        put(m, f"more{j}", M)
    assert m.stats()["evictions"] > 0
    m.check_invariants()


def test_a_retried_commit_whose_slab_is_gone_answers_with_its_generation():
    """A commit whose reply was lost or late is sent again; meanwhile the call that carried
    it gave the slab back (clients return slabs with their commits), or the slab expired,
    or the master restarted. The retry answers with the value's generation: never
    LeaseExpiredError (the client would put the value again and meet its own commit as
    ObjectExistsError). Anything else into a gone slab is still refused."""
    from mooncake_ray._private.store.inventory import StoreInventory

    clock, wall = Clock(), iter(range(1, 10_000))
    policy = Policy(put_slab_ttl_s=2.0, put_slab_bytes=16 * K, put_timeout_s=30.0, durable_acks=True)
    m = MasterState(policy, clock=clock, wall_ns=lambda: next(wall))
    m.mount(node(0, 256 * K))
    sid, nid, off, _ = grant(m)
    gen = commit(m, "a", sid, off, 3 * K)
    gen_b = commit(m, "b", sid, off + 3 * K, K)
    m.slab_return(sid)
    assert commit(m, "a", sid, off, 3 * K) == gen  # the retry
    with pytest.raises(LeaseExpiredError):
        commit(m, "a", sid, off, 3 * K, owner="c2")  # not the owner's
    with pytest.raises(LeaseExpiredError):
        commit(m, "a", sid, off + 4 * K, 3 * K)  # not where "a" is
    with pytest.raises(LeaseExpiredError):
        commit(m, "c", sid, off + 4 * K, K)  # a new value into a returned slab
    m.remove("a")
    with pytest.raises(LeaseExpiredError):
        commit(m, "a", sid, off, 3 * K)  # removed since: not a retry any more
    m.check_invariants()

    inv = StoreInventory()  # a restarted master, rebuilt from the node's inventory
    inv.apply(0, 1, m.drain_effects()[nid].to_wire())
    new = MasterState(policy, clock=clock, wall_ns=lambda: next(wall))
    new.begin_recovery({nid})
    new.mount(node(0, 256 * K), inv.snapshot())
    assert commit(new, "b", sid, off + 3 * K, K) == gen_b
    with pytest.raises(LeaseExpiredError):
        commit(new, "b", sid, off + 5 * K, K)
    new.check_invariants()


def test_a_grant_evicts_a_round_then_takes_a_shorter_run_rather_than_the_newest_values():
    """Eviction frees the least recent values wherever they lie: when a round leaves no run
    of a whole slab, a shorter slab that holds the put is taken from the largest run, rather
    than evicting round after round (newer and newer values) until a whole slab's run forms."""
    m, clock = make(n_nodes=1, cap=64 * K, put_slab_bytes=1 << 30, high_watermark=1.0, evict_ratio=0.0625)
    for i in range(64):  # 64 values of a page each (K), in offset order: the arena is full
        assert put(m, f"k{i}")[1][0].offset == i * K
    for i in range(64):  # every fourth value is now the least recent (reads leave their leases)
        if i % 4:
            assert m.get(f"k{i}") is not None
    clock.t += 60  # the reads' leases ended
    sid, _nid, off, length = grant(m, need=K)
    # one round (1/16 of the arena: the 4 least recent values, 4 pages apart) and a slab of
    # one page; waiting for a whole slab (4 pages) took all 16 such values, then read ones
    assert length == K and m.counters["evictions"] == 4
    assert sorted(k for k in m._objects if int(k[1:]) % 4 == 0) == [f"k{i}" for i in range(16, 64, 4)]
    commit(m, "new", sid, off, K)
    # a need the free bytes hold, only not in one run: no round more (the batch goes the
    # two-call way, each value into a run of its own)
    with pytest.raises(NoCapacityError):
        grant(m, need=2 * K + 1)
    assert m.counters["evictions"] == 4
    # a need past the free bytes: a round (the next 4 least recent values), and then the
    # bytes are there, in single pages: no slab, and no round more
    with pytest.raises(NoCapacityError):
        grant(m, need=3 * K + 1)
    assert m.counters["evictions"] == 8
    # the two-call way, a value that needs one run evicts until one forms
    _gen, ext = put(m, "big", 3 * K + 1)
    assert ext[0].length >= 3 * K + 1 and m.counters["evictions"] > 8
    m.check_invariants()


def test_a_grant_takes_the_longest_piece_of_free_room_rather_than_evicting_for_one_run():
    """Free bytes enough for the batch, in runs shorter than it: the longest run is granted
    where it is worth a slab (64 KiB and up), with no eviction. Evicting until one run held
    the whole batch took far more than the puts needed (the least recent values lie
    anywhere): an arena split four ways by master shards stayed a third full."""
    m, _clock = make(n_nodes=1, cap=256 * K, put_slab_bytes=1 << 30, high_watermark=1.0, evict_ratio=0.0625)
    for i in range(256):
        put(m, f"k{i}")
    for i in range(16, 32):  # one run of 16 pages (64 KiB)
        m.remove(f"k{i}")
    for i in range(64, 256, 8):  # and 24 single pages
        m.remove(f"k{i}")
    sid, _nid, off, length = grant(m, need=32 * K)  # 40 pages free, none in a run of 32
    assert (off, length) == (16 * K, 16 * K) and m.counters["evictions"] == 0
    commit(m, "new", sid, off, 32 * K // 2)
    # what is left is single pages: no piece worth a slab, and still no eviction
    with pytest.raises(NoCapacityError):
        grant(m, need=20 * K)
    assert m.counters["evictions"] == 0
    m.check_invariants()


def test_a_small_slab_takes_a_shorter_run_where_the_room_is_free_but_not_in_one_run():
    """Room eviction freed lies where the least recent values did: a grant whose whole slab
    would fit in the free bytes, only not in one run, takes the largest run that holds its
    batch rather than evicting another round."""
    m, _clock = make(n_nodes=1, cap=64 * K, put_slab_bytes=1 << 30, high_watermark=1.0, evict_ratio=0.0625)
    for i in range(64):
        put(m, f"k{i}")
    for i in range(0, 64, 8):  # 8 pages free, each alone: room for a slab (4 pages), no run of one
        m.remove(f"k{i}")
    sid, _nid, off, length = grant(m, need=K)
    assert length == K and m.counters["evictions"] == 0
    commit(m, "new", sid, off, K)
    for key in list(m._objects):  # a grant evicts no soft-pinned value
        m.pin(key)
    with pytest.raises(NoCapacityError):  # a batch no free run holds: the store is full for it
        m.slab_grant("c1", None, 3 * K)
    assert m.counters["evictions"] == 0
    m.check_invariants()
