"""The master's inventory stream to a store node: merged deltas, exactly-once in-order
application per mount, resends, and the rejoin of a node that was unmounted."""

from mooncake_ray._private import rpc
from mooncake_ray._private.master.outbox import MESSAGE_MAX_ITEMS, NodeOutbox, plan_mount
from mooncake_ray._private.master.types import InventoryEntry, NodeDelta
from mooncake_ray._private.store.inventory import APPLIED, STALE, StoreInventory, reconcile


def e(key, gen, off=0, tier="dram"):
    return InventoryEntry(key, gen, 100, tier, off, 4096)


def test_delta_merges_per_key_and_cancels_an_unsent_add():
    d = NodeDelta()
    d.add(e("a", 1))
    d.drop("a", 1, "dram")  # published then evicted before delivery: only the drop is left
    d.add(e("b", 2))
    d.drop("c", 3, "dram")
    d.add(e("c", 5, off=8192))  # replaced: drop the old gen, add the new one
    d.drop("x", 4, "disk")
    assert d.adds == [e("b", 2), e("c", 5, off=8192)]
    assert d.drops == [("a", 1, "dram"), ("c", 3, "dram"), ("x", 4, "disk")]
    assert len(d) == 4  # records, not operations


def test_delta_size_is_bounded_by_keys_not_operations():
    d = NodeDelta()
    for gen in range(10_000):  # one key put and evicted over and over
        d.add(e("hot", gen))
        d.drop("hot", gen, "dram")
    assert len(d) == 1 and d.drops == [("hot", 9999, "dram")] and d.adds == []


def test_merge_applies_the_second_delta_after_the_first():
    first, second = NodeDelta(), NodeDelta()
    first.add(e("a", 1))
    second.drop("a", 1, "dram")
    second.add(e("b", 2))
    second.offload.append(("b", 2, 100, 0, 4096))
    first.merge(second)
    assert first.adds == [e("b", 2)] and first.drops == [("a", 1, "dram")]
    assert first.offload == [("b", 2, 100, 0, 4096)]


def _random_delta(rng, keys, n):
    d = NodeDelta()
    for _ in range(n):
        key, tier = rng.choice(keys), rng.choice(("dram", "disk"))
        if rng.random() < 0.5:
            d.add(e(key, rng.randrange(20), tier=tier))
        else:
            d.drop(key, rng.randrange(20), tier)
    d.offload.extend((f"o{i}", i, 1, 0, 4096) for i in range(rng.randrange(3)))
    return d


def _state(d):
    return sorted(d._recs.items()), d.offload


def test_absorb_equals_merge_whichever_side_is_larger():
    """``absorb`` (the outbox taking a fresh delta) nets to what ``merge`` does, record for
    record, with the older side larger, smaller or overlapping it entirely."""
    import copy
    import random
    rng = random.Random(3)
    for trial in range(300):
        keys = [f"k{i}" for i in range(rng.randrange(1, 40))]
        older, newer = _random_delta(rng, keys, rng.randrange(60)), _random_delta(rng, keys, rng.randrange(60))
        want = copy.deepcopy(older)
        want.merge(copy.deepcopy(newer))
        older.absorb(newer)
        assert _state(older) == _state(want), trial


def test_a_message_goes_through_msgpack_as_the_node_reads_it():
    d = NodeDelta()
    d.add(e("a", 1))
    d.drop("b", 2, "disk")
    d.offload.append(("a", 1, 100, 0, 4096))
    wire = rpc.unpack(rpc.pack(d.to_wire()))
    assert wire == [[list(e("a", 1))], [["b", 2, "disk"]], [["a", 1, 100, 0, 4096]]]
    inv = StoreInventory()
    mount_id, _ = inv.begin_mount()
    assert inv.apply(mount_id, 1, wire) == (APPLIED, [("b", 2)], [("a", 1, 100, 0, 4096)])
    assert inv.entries[("a", "dram")] == tuple(e("a", 1))


def test_node_applies_each_message_once_and_refuses_an_older_mount():
    inv = StoreInventory([e("old", 1)])
    mount_id, snap = inv.begin_mount()
    assert snap == [list(e("old", 1))]
    d = NodeDelta()
    d.drop("old", 1, "dram")
    d.add(e("new", 2))
    d.drop("f", 3, "disk")
    d.offload.append(("new", 2, 100, 0, 4096))
    assert inv.apply(mount_id, 1, d.to_wire()) == (APPLIED, [("f", 3)], [("new", 2, 100, 0, 4096)])
    # The same message again (its answer was lost): acknowledged, nothing done twice.
    assert inv.apply(mount_id, 1, d.to_wire()) == (APPLIED, [], [])
    assert list(inv.entries) == [("new", "dram")]
    inv.begin_mount()
    assert inv.apply(mount_id, 2, NodeDelta().to_wire())[0] == STALE


def test_drop_removes_every_gen_up_to_it_and_keeps_newer():
    inv = StoreInventory([e("k", 5), e("j", 9), e("d", 4, tier="disk")])
    mount_id, _ = inv.begin_mount()
    inv.apply(mount_id, 1, [[], [["k", 7, "dram"], ["j", 8, "dram"]], []])
    assert set(inv.entries) == {("j", "dram"), ("d", "disk")}
    inv.drop_disk("d", 3)  # an older file's drop does not take the newer one
    assert ("d", "disk") in inv.entries
    inv.drop_disk("d", 4)
    assert ("d", "disk") not in inv.entries


def test_outbox_keeps_one_message_in_flight_and_resends_it_until_answered():
    ob = NodeOutbox("inc", mount_id=3)
    ob.pending.add(e("a", 1))
    first = ob.next_message(now=0.0)
    assert rpc.unpack(first)[:2] == [3, 1]
    ob.handle = object()  # the call is running
    ob.pending.add(e("b", 2))
    assert ob.next_message(now=0.1) is None  # no second message while one is in flight
    ob.failed(now=0.2, backoff_s=0.2)
    assert ob.next_message(now=0.3) is None  # backing off
    assert ob.next_message(now=0.5) == first  # the same bytes, the same sequence number
    ob.answered(APPLIED)
    second = rpc.unpack(ob.next_message(now=0.6))
    assert second[:2] == [3, 2] and second[2][0] == [list(e("b", 2))]
    ob.answered(STALE)  # the node remounted: the message is kept for after the mount
    assert ob.stale and ob.next_message(now=1.0) is None and ob.owed().adds == [e("b", 2)]


def test_outbox_splits_large_backlogs_into_bounded_messages():
    ob = NodeOutbox("inc", mount_id=1)
    for i in range(MESSAGE_MAX_ITEMS + 5):
        ob.pending.add(e(f"k{i}", i))
    assert len(rpc.unpack(ob.next_message(now=0.0))[2][0]) == MESSAGE_MAX_ITEMS
    ob.answered(APPLIED)
    assert len(rpc.unpack(ob.next_message(now=0.0))[2][0]) == 5


def test_rejoining_node_is_owed_what_it_missed_and_restores_nothing_dropped():
    # The node held a and b, then was unmounted while a drop of a and an add of c
    # (a put acknowledged just before) were owed to it, one of them in flight.
    node = StoreInventory([e("a", 1), e("b", 2, off=4096)])
    first_mount, _ = node.begin_mount()
    old = NodeOutbox("inc", mount_id=first_mount)
    old.pending.drop("a", 1, "dram")
    old.next_message(now=0.0)  # in flight, never answered
    old.pending.add(e("c", 3, off=8192))
    old.pending.offload.append(("b", 2, 100, 4096, 4096))
    old.mounted = False
    mount_id, snapshot = node.begin_mount()
    inventory, new = plan_mount(old, "inc", mount_id, known=False, inventory=snapshot)
    assert sorted(x[0] for x in inventory) == ["b", "c"]  # a stays dropped, c comes back
    assert new.mount_id == mount_id and new.owed().offload == []  # offloads were forgotten
    msg = rpc.unpack(new.next_message(now=0.0))
    node.apply(*msg)
    assert sorted(node.entries) == [("b", "dram"), ("c", "dram")]
    # A late repeat of the older mount is ignored; another incarnation starts afresh.
    assert plan_mount(new, "inc", mount_id - 1, known=True, inventory=[]) is None
    inventory, fresh = plan_mount(new, "other", 1, known=False, inventory=[])
    assert inventory == [] and fresh.owed().empty()


def test_reconcile_applies_owed_changes_to_a_snapshot():
    owed = NodeDelta()
    owed.drop("gone", 1, "disk")
    owed.add(e("n", 2))
    snap = [list(e("gone", 1, tier="disk")), list(e("keep", 1))]
    assert sorted(x[0] for x in reconcile(snap, owed)) == ["keep", "n"]
