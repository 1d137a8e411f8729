"""Chain-aware eviction (master/chains.py) on the state machine with an injected clock:
the literal order of victims, orphans, forced evictions, restarts. Orders written for new
pages at the recent end name ``chain_insert="recent"`` (the adaptive default starts on
probation: tests/unit/test_adaptive.py)."""

import pytest

from mooncake_ray.errors import InvalidArgumentError
from mooncake_ray._private.master.chains import Chains, Picker
from mooncake_ray._private.master.state import MasterState
from mooncake_ray._private.master.types import InventoryEntry

from tests.unit.test_master_state import K, Clock, make, node, put


def stored(m, keys):
    return "".join(k for k in keys if m.exists(k))


def chain(m, keys, clock, parent=""):
    """Put ``keys`` as one chain, first key first (each names the one before)."""
    for k in keys:
        put(m, k, parent=parent)
        parent = k
        clock.t += 1


@pytest.mark.parametrize("on", [True, False])
def test_leaf_goes_before_its_older_parent(on):
    """a->b->c, then plain keys; a hit on the root a. LRU takes b (oldest), leaving c
    unreachable; chain-aware takes c: b still has a child stored."""
    m, clock = make(n_nodes=1, cap=10 * K, high_watermark=1.0, evict_ratio=0.1, chain_eviction=on)
    chain(m, "abc", clock)
    for k in "stuvwxy":
        put(m, k)
        clock.t += 1
    m.get("a")
    clock.t += 20  # the lease ends
    put(m, "z")
    assert stored(m, "abc") == ("ab" if on else "ac")
    assert m.stats()["orphaned_pages"] == (0 if on else 1)
    m.check_invariants()


def test_a_pass_takes_the_least_recent_chain_whole_before_newer_leaves():
    """Two chains older than four plain keys, four pages needed: the least recent leaf
    each time: c, then b and a (each the least recent leaf once its child went), then f;
    the newer plain keys stay."""
    m, clock = make(n_nodes=1, cap=10 * K, high_watermark=1.0, evict_ratio=0.4, chain_insert="recent")
    chain(m, "abc", clock)
    chain(m, "def", clock)
    for k in "stuv":
        put(m, k)
        clock.t += 1
    put(m, "z")
    assert stored(m, "abcdefstuvz") == "destuvz"
    assert m.stats()["chain_tail_evictions"] == 0
    m.check_invariants()


def test_chains_shorten_tail_first_when_nothing_else_is_left():
    """Only chains: the least recent chain goes from its tail (c, b, a); the newer one
    stays whole."""
    m, clock = make(n_nodes=1, cap=6 * K, high_watermark=1.0, evict_ratio=0.5, chain_insert="recent")
    chain(m, "abc", clock)
    chain(m, "def", clock)
    put(m, "z")
    assert stored(m, "abcdefz") == "defz"
    m.check_invariants()


@pytest.mark.parametrize("insert", ["recent", "old"])
def test_chain_insert_old_puts_new_pages_first_in_line_until_read(insert):
    m, clock = make(n_nodes=1, cap=4 * K, high_watermark=1.0, evict_ratio=0.25, chain_insert=insert)
    chain(m, "a", clock)
    put(m, "x")
    clock.t += 1
    chain(m, "bc", clock, parent="a")  # new pages of a's chain
    put(m, "z")  # "recent": x is the oldest leaf; "old": c (new, not read yet) is
    assert stored(m, "abcxz") == ("abcz" if insert == "recent" else "abxz")
    m.get("b")  # read: to the recent end
    clock.t += 20
    put(m, "y")
    assert stored(m, "abcxyz") == "abyz"  # "recent": c the oldest leaf; "old": x (b was read)
    m.check_invariants()


def test_a_put_in_flight_holds_its_parent():
    """A pending child holds its parent: the room for the child never comes from it."""
    m, clock = make(n_nodes=1, cap=3 * K, high_watermark=1.0, evict_ratio=1 / 3)
    put(m, "x")
    clock.t += 1
    put(m, "a")
    clock.t += 1
    put(m, "y")
    m.get("x")
    clock.t += 20
    gen, _ = m.put_start("b", K, parent="a")  # a is the oldest now, but held
    assert stored(m, "axy") == "ax"
    m.put_end("b", gen)
    assert m.stats()["orphaned_pages"] == 0
    m.check_invariants()


def test_a_shared_prefix_stays_while_any_branch_does():
    """p is the parent of two branches; the older branch goes whole, p stays for the
    other one."""
    m, clock = make(n_nodes=1, cap=6 * K, high_watermark=1.0, evict_ratio=1 / 6, chain_insert="recent")
    chain(m, "p", clock)
    chain(m, "ab", clock, parent="p")
    chain(m, "cd", clock, parent="p")
    put(m, "x")
    clock.t += 1
    for k in "yz":  # each evicts one: b, then a
        put(m, k)
        clock.t += 1
    assert stored(m, "pabcd") == "pcd"
    m.get("c")
    clock.t += 20
    put(m, "w")  # p is the oldest, held by c->d: d goes (the leaf), not p
    assert stored(m, "pcd") == "pc"
    m.check_invariants()


def test_an_orphan_goes_first_and_a_removed_parent_takes_its_tail():
    m, clock = make(n_nodes=1, cap=8 * K, high_watermark=1.0, evict_ratio=1 / 8)
    put(m, "old")
    clock.t += 1
    put(m, "o", parent="nowhere")  # its parent is not stored: no lookup reaches it
    assert m.stats()["orphaned_pages"] == 1
    chain(m, "abc", clock)
    for k in "xyz":
        put(m, k)
    put(m, "n")  # full: the orphan goes before "old"
    assert not m.exists("o") and m.exists("old")
    assert m.remove("a")
    assert m.stats()["orphaned_pages"] == 1  # b; c hangs from b
    put(m, "q")  # a's room
    assert m.stats()["chain_tail_evictions"] == 1  # o
    put(m, "r")  # eviction drops the tail (b, then c) wherever it is
    assert stored(m, "bc") == "" and m.exists("old")
    assert m.stats()["orphaned_pages"] == 0 and m.stats()["chain_tail_evictions"] == 3
    m.check_invariants()


def test_a_soft_pinned_orphan_stays_until_its_pin_ends():
    """A page a reader asked to be held (a decode's handoff reads it by key, no prefix
    lookup) stays when its parent goes: not dropped at the tick, nor first in line; once
    unpinned it is an orphan like any other and goes at the next tick."""
    m, clock = make(n_nodes=1, cap=8 * K, high_watermark=1.0, evict_ratio=1 / 8)
    chain(m, "ab", clock)
    m.pin("b", ttl_s=30)
    assert m.remove("a") and m.stats()["orphaned_pages"] == 1
    m.tick()
    assert m.exists("b")
    for k in "uvwxyz":
        put(m, k)
        clock.t += 0.1
    put(m, "n")  # the last free slot
    put(m, "o")  # full: the oldest unpinned value goes, not the pinned orphan
    assert m.exists("b") and not m.exists("u")
    m.unpin("b")
    m.tick()
    assert not m.exists("b") and m.stats()["orphaned_pages"] == 0
    m.check_invariants()


def test_a_leased_leaf_forces_its_parent_only_when_nothing_else_can_go():
    """Every slot holds a->b->c with c being read: the round frees nothing but a chain
    value, so it takes the oldest (a); b goes with it, c once its reader is done."""
    m, clock = make(n_nodes=1, cap=3 * K, high_watermark=1.0, evict_ratio=1 / 3, lease_ttl_s=10, node_ttl_s=100, chain_insert="recent")
    chain(m, "abc", clock)
    m.get("c")
    put(m, "z")
    assert stored(m, "abcz") == "cz"
    assert m.stats()["orphaned_pages"] == 1
    put(m, "y")
    m.tick()  # c is still read
    assert stored(m, "cyz") == "cyz"
    clock.t += 11
    m.tick()  # c's lease is over: the orphan goes
    assert stored(m, "cyz") == "yz" and m.stats()["orphaned_pages"] == 0
    m.check_invariants()


def test_lookups_do_not_hold_a_value():
    """exists() is not a use: the value looked up stays the oldest and goes first."""
    m, clock = make(n_nodes=1, cap=4 * K, high_watermark=1.0, evict_ratio=0.25)
    for k in "abcd":
        put(m, k)
        clock.t += 1
    assert m.exists("a") and m.exists("a")
    assert m.stats()["lookups"] == 2
    put(m, "e")
    assert stored(m, "abcde") == "bcde"


def test_chains_survive_a_master_restart_through_the_inventory():
    m, clock = make(n_nodes=1, cap=10 * K, high_watermark=1.0, evict_ratio=0.1)
    chain(m, "abc", clock)
    entries = m.node_entries("n0")
    assert {e.key: e.parent for e in entries} == {"a": "", "b": "a", "c": "b"}
    m2 = MasterState(m.policy, clock=clock, wall_ns=lambda: 0, seed=1)
    m2.mount(node(0, 10 * K), [InventoryEntry(*e) for e in entries])
    for k in "stuvwxy":
        put(m2, k)
    m2.get("a")
    clock.t += 20
    put(m2, "z")
    assert stored(m2, "abc") == "ab"
    m2.check_invariants()


def test_a_bad_parent_is_refused_and_stores_nothing():
    m, _ = make(n_nodes=1)
    with pytest.raises(InvalidArgumentError, match="names itself"):
        m.put_start("k", K, parent="k")
    with pytest.raises(InvalidArgumentError, match="must be a str"):
        m.put_start("k", K, parent=7)
    with pytest.raises(InvalidArgumentError, match="max_key_bytes"):
        m.put_start("k", K, parent="p" * 5000)
    assert not m.exists("k") and m.stats()["used"] == 0


def test_a_replaced_parent_keeps_its_children():
    m, clock = make(n_nodes=1, cap=10 * K, high_watermark=1.0)
    chain(m, "ab", clock)
    gen, _ = m.put_start("a", K, upsert=True)
    m.put_end("a", gen)
    assert m.stats()["orphaned_pages"] == 0
    m.check_invariants()


def test_picker_goes_up_a_chain_at_once_within_the_need():
    c = Chains()
    for k, p in [("b", "a"), ("c", "b"), ("d", "c")]:
        c.stored(k, p, lambda key: True)
    pick = Picker(c, need=3)
    for k in "abc":  # met oldest first: each has a child
        assert pick.blocks(k, last_copy=True)
        pick.hold(k, k, 1)
    pick.take("d", "d", 1)  # c is the least recent leaf now, then b: taken at once
    assert pick.chosen == ["d", "c", "b"] and pick.done() and list(pick.held) == ["a"]
    pick.finish()
    assert pick.chosen == ["d", "c", "b"]
    assert not Picker(c, 1).blocks("b", last_copy=False)  # another copy stays: no hold


def test_a_pinned_conversation_stays_while_loads_lease_the_others():
    """Nine conversations take turns over two nodes, each turn's load leasing its earlier
    pages, so a round finds few leaves to take; the rounds (each aiming at evict_ratio of
    the arena, and the ones past the high watermark) must not take the soft-pinned leaf of
    a tenth conversation: its pin holds the chain, and a pin yields only to the room a put
    cannot do without. (Taking the leaf left the chain's pages unpinned leaves: all 12 went.)"""
    m, clock = make(n_nodes=2, cap=64 * K, high_watermark=0.9, evict_ratio=0.05, chain_eviction=True)
    vip = [f"v{i}" for i in range(12)]
    chain(m, vip, clock)
    m.pin(vip[-1])
    convs: dict[int, list[str]] = {c: [] for c in range(9)}
    for turn in range(10):
        for c, pages in convs.items():
            for k in pages:
                if m.exists(k):
                    m.get(k)  # the turn's load leases what it reads
            for j in range(6):  # 10 ms a page: the leases (10 s) outlive the turn
                put(m, f"c{c}/{turn}/{j}", parent=pages[-1] if pages else "")
                pages.append(f"c{c}/{turn}/{j}")
                clock.t += 0.01
            assert stored(m, vip) == "".join(vip), (turn, c)
    assert m.stats()["evictions"] > 100
    m.check_invariants()


# Chains across master shards (chains.py, chainlinks.py). With 2 shards, shard 0 owns
# d e f g l m n o t u v w and shard 1 owns a b c h i j k p q r s x y z (CRC-32 mod 2).

def test_links_across_shards_in_literal_message_order():
    """A child on shard 0 names a parent on shard 1: each side learns what it must from
    the other's messages, in order."""
    s, t = Chains(shard=0, shards=2), Chains(shard=1, shards=2)
    on_t = {"a"}
    assert s.stored("d", "a", lambda k: False) is None  # shard 0 cannot see "a": assumed stored
    assert s.outbox == [(1, "link", "a", "d")] and s.orphans == set()
    s.outbox.clear()
    assert t.remote_link("a", "d", on_t.__contains__, now=0.0) is True  # the first thing to hold "a"
    assert t.holds("a") and t.kid_count("a") == 1
    assert t.gone("a") is None and t.outbox == [(0, "gone", "a", "")]
    t.outbox.clear()
    s.foreign_status("a", False)
    assert s.orphans == {"d"}
    assert t.stored("a", "", on_t.__contains__) is None and t.outbox == [(0, "back", "a", "")]
    t.outbox.clear()
    s.foreign_status("a", True)
    assert s.orphans == set()
    assert s.gone("d") is None and s.outbox == [(1, "unlink", "a", "d")]
    assert t.remote_unlink("a", "d") is True and not t.holds("a")  # nothing holds "a" any more
    s.check(lambda k: False)
    t.check(on_t.__contains__)


def test_a_link_to_a_parent_not_stored_is_reported_gone_after_the_grace():
    """The parent's put may still be on its way (a batch's parts run on both shards at
    once): "gone" only once ``grace_s`` has passed, and never if it arrives meanwhile."""
    t = Chains(shard=1, shards=2, grace_s=1.0)
    on_t: set[str] = set()
    t.remote_link("a", "d", on_t.__contains__, now=10.0)
    t.remote_link("b", "e", on_t.__contains__, now=10.0)
    t.due(10.9, on_t.__contains__)
    assert t.outbox == []
    on_t.add("b")
    t.stored("b", "", on_t.__contains__)  # "b" arrived within the grace: "back", never "gone"
    t.due(11.0, on_t.__contains__)
    assert t.outbox == [(0, "back", "b", ""), (0, "gone", "a", "")]


def test_links_sent_whole_replace_what_a_shard_said_before():
    """After a restart the child's shard sends every link it holds: the parent's shard
    drops the links that shard no longer holds, keeps other shards' links, and says
    which parents are stored (the other side may have heard they went)."""
    t = Chains(shard=1, shards=4)
    on_t = {"a", "b"}
    from mooncake_ray._private.shards import shard_of
    kids = [k for k in (f"k{i}" for i in range(40)) if shard_of(k, 4) != 1]
    first, other = kids[0], next(k for k in kids if shard_of(k, 4) != shard_of(kids[0], 4))
    t.remote_link("a", first, on_t.__contains__, 0.0)
    t.remote_link("b", other, on_t.__contains__, 0.0)
    held, freed = t.remote_sync(shard_of(first, 4), [("b", first)], on_t.__contains__, 0.0)
    assert t.remote == {"b": {first, other}}
    assert (held, freed) == ([], ["a"])
    assert t.outbox == [(shard_of(first, 4), "back", "b", "")]


@pytest.mark.parametrize("insert", ["old", "recent"])
def test_a_parent_with_a_child_on_another_shard_under_each_insertion(insert):
    """On the parent's shard, "a" is the least recent value and a child on shard 0 names
    it. Where new pages go on probation (``old``: many conversations taking turns), that
    child holds "a" as a local one would: eviction takes the next least recent leaf, and
    "a" only once the child is unlinked. Where they enter at the recent end (``recent``,
    LRU), a remote child does not hold its parent: the pass cannot take the child's
    tail on its own shard first, and keeping its old pages would make it take fresh
    leaves (a handoff's pages) instead; "a" goes in LRU order and shard 0 is told.
    On the child's shard: the link goes out with the put, and the child goes as soon as
    its parent is said to be gone (unless being read: then at a later tick)."""
    t, clock = make(n_nodes=1, cap=4 * K, high_watermark=1.0, evict_ratio=0.25, chain_insert=insert,
                    shard=1, shards=2)
    for k in "abch":
        put(t, k)
        clock.t += 1
    t.chain_receive(0, [("link", "a", "d")])
    put(t, "i")
    if insert == "old":
        assert stored(t, "abchi") == "achi" and t.chain_outbox() == {}
        t.chain_receive(0, [("unlink", "a", "d")])
        put(t, "j")
        assert stored(t, "achij") == "chij"
    else:
        assert stored(t, "abchi") == "bchi" and t.chain_outbox() == {0: [("gone", "a", "")]}
    t.check_invariants()

    s, clock = make(n_nodes=1, cap=4 * K, shard=0, shards=2)
    put(s, "d", parent="a")
    put(s, "e", parent="a")
    assert s.chain_outbox() == {1: [("link", "a", "d"), ("link", "a", "e")]}
    assert s.stats()["orphaned_pages"] == 0
    read = s.get("e")
    s.chain_receive(1, [("gone", "a", "")])
    assert not s.exists("d") and s.exists("e") and s.stats()["orphaned_pages"] == 1
    s.release("e", read.gen, read.lease)
    s.tick()
    assert not s.exists("e") and s.chain_outbox() == {1: [("unlink", "a", "d"), ("unlink", "a", "e")]}
    s.check_invariants()


def test_chain_messages_of_the_wrong_shape_or_shard_are_refused_and_change_nothing():
    """Shard 1 of 2 takes links to its own parents from shard 0's children, and "gone" /
    "back" of shard 0's parents; anything else is an InvalidArgumentError naming it, and a
    refused batch applies none of its messages."""
    t, _clock = make(n_nodes=1, cap=8 * K, shard=1, shards=2)
    put(t, "a")
    for shard, items, links, named in [
            (1, [], None, "shard 1"),                      # from itself
            (2, [], None, "shard 2"),                      # no such shard
            (0, [["link", "a", "d"], ["link", "d", "e"]], None, "'d', 'e'"),  # "d" is not shard 1's
            (0, [["link", "a", "b"]], None, "'a', 'b'"),   # "b" is not shard 0's
            (0, [["gone", "a", ""]], None, "'gone', 'a'"),  # "a" is shard 1's own
            (0, [["hold", "a", "d"]], None, "'hold'"),
            (0, [["link", "a", 3]], None, "chain message"),
            (0, [], [["a"]], "chain link")]:
        with pytest.raises(InvalidArgumentError, match=named):
            t.chain_receive(shard, items, links)
    assert t.stats()["chain_remote_children"] == 0 and t.chain_outbox() == {}
    t.chain_receive(0, [["link", "a", "d"]], [["a", "e"]])
    assert t.stats()["chain_remote_children"] == 2
    t.check_invariants()


def test_a_chain_cut_by_a_lost_node_waits_for_the_node():
    """The parent's node misses its heartbeats and is unmounted: its child on the other node
    is an orphan, held (not dropped at a tick: the parent may come back with the node's
    kept arena or spill directory). The node's restarted process remounts with it and the
    chain is whole. Unmounted again and not back within GONE_TTL_S: the tail goes."""
    from mooncake_ray._private.master.state import GONE_TTL_S

    m, clock = make(n_nodes=1, cap=10 * K, node_ttl_s=3.0)
    put(m, "a")
    m.mount(node(1, 100 * K))
    put(m, "b", parent="a")
    put(m, "c", parent="b")
    assert {e.key for e in m.node_entries("n1")} == {"b", "c"}
    held = m.node_entries("n0")

    def tick(dt):
        clock.t += dt
        m.heartbeat("n1", "a")
        return m.tick()

    assert tick(5.0)["unmounted"] == ["n0"]
    assert stored(m, "abc") == "bc" and m.stats()["orphaned_pages"] == 1
    for _ in range(3):
        assert tick(10.0)["tails_dropped"] == 0
    assert stored(m, "abc") == "bc"
    m.check_invariants()
    m.mount(node(0, 10 * K, inc="b"), held)  # the restarted process re-adopted its arena
    assert stored(m, "abc") == "abc" and m.stats()["orphaned_pages"] == 0
    m.check_invariants()

    assert tick(5.0)["unmounted"] == ["n0"]
    tick(GONE_TTL_S - 10.0)
    assert stored(m, "abc") == "bc"
    assert tick(20.0)["tails_dropped"] == 2  # no longer waited for: b, then c hanging from it
    assert stored(m, "abc") == "" and m.stats()["orphaned_pages"] == 0
    m.check_invariants()


def test_other_shards_hear_a_lost_parent_went_only_once_its_node_is_not_waited_for():
    """A parent with a child on another shard goes with its unmounted node: the child's
    shard is told nothing while the node may bring it back, "back" when it does, and
    "gone" only when the master stops waiting."""
    from mooncake_ray._private.master.state import GONE_TTL_S

    t, clock = make(n_nodes=1, cap=10 * K, node_ttl_s=3.0, shard=1, shards=2)
    put(t, "a")
    t.chain_receive(0, [("link", "a", "d")])
    t.mount(node(1, 100 * K))
    held = t.node_entries("n0")

    def tick(dt):
        clock.t += dt
        t.heartbeat("n1", "a")
        return t.tick()

    assert tick(5.0)["unmounted"] == ["n0"] and not t.exists("a")
    assert t.chain_outbox() == {}
    t.mount(node(0, 10 * K, inc="b"), held)
    assert t.exists("a") and t.chain_outbox() == {0: [("back", "a", "")]}
    assert tick(5.0)["unmounted"] == ["n0"]
    tick(GONE_TTL_S - 10.0)
    assert t.chain_outbox() == {}
    tick(20.0)
    assert t.chain_outbox() == {0: [("gone", "a", "")]}
    t.check_invariants()


@pytest.mark.parametrize("shards", [1, 4])
def test_gone_many_leaves_the_state_gone_leaves_key_by_key(shards):
    """``Chains.gone_many`` (the read index's evictions) against ``gone`` one key at a
    time, on seeded chains, forks, children stored before their parents, remote children
    and lost keys, the keys dropped leaf first, root first and at random."""
    import random

    def build(seed):
        rng = random.Random(seed)
        c = Chains(shard=0, shards=shards)
        keys = []
        for i in range(300):
            key = f"k{i}"
            parent = rng.choice(["", *keys[-20:], f"absent{i % 7}"]) if rng.random() < 0.9 else ""
            c.stored(key, parent, lambda k: k in keys)
            keys.append(key)
        for key in rng.sample(keys, 15):
            c.remote.setdefault(key, set()).add(f"far/{key}")
        c.lost.update(rng.sample(keys, 5))
        return c, keys, rng

    def state(c):
        return (c.parent, c.kids, c.orphans, c.remote, c.foreign_gone, c.outbox, c.missing, c.lost)

    for seed in range(12):
        one, keys, rng = build(seed)
        many, _, _ = build(seed)
        order = [keys[::-1], keys, rng.sample(keys, len(keys))][seed % 3][: rng.randrange(50, 300)]
        for key in order:
            one.gone(key)
        many.gone_many(order)
        assert state(many) == state(one), seed
