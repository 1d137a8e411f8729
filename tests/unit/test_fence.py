"""Put replies held until durable (master/fence.py) over the outboxes' tickets."""

from mooncake_ray._private import rpc
from mooncake_ray._private.master.fence import Fence, Held
from mooncake_ray._private.master.outbox import MESSAGE_MAX_ITEMS, NodeOutbox
from mooncake_ray._private.master.types import InventoryEntry, NodeDelta
from mooncake_ray._private.store.inventory import APPLIED, STALE


def delta(*keys):
    d = NodeDelta()
    for i, k in enumerate(keys):
        d.add(InventoryEntry(k, i + 1, 100, "dram", 4096 * i, 4096))
    return d


def commit_reply(*gens):
    return rpc.pack([rpc.OK, list(gens)])


def send_and_answer(ob, reply=APPLIED):
    assert ob.next_message(now=0.0) is not None
    ob.answered(reply)


def test_tickets_count_merges_and_only_the_last_part_of_a_split_backlog_covers_them():
    ob = NodeOutbox("inc", mount_id=1)
    ob.merged(delta("a"))
    ob.merged(delta("b"))
    assert (ob.queued, ob.applied) == (2, 0)
    send_and_answer(ob)
    assert ob.applied == 2
    big = NodeDelta()
    for i in range(MESSAGE_MAX_ITEMS + 3):
        big.add(InventoryEntry(f"k{i}", 1, 1, "dram", 0, 4096))
    ob.merged(big)
    send_and_answer(ob)  # the first part: the ticket is not met yet
    assert ob.applied == 2
    send_and_answer(ob)
    assert ob.applied == 3


def test_a_reply_waits_for_every_node_holding_the_value():
    a, b = NodeOutbox("ia", 1), NodeOutbox("ib", 1)
    outboxes = {"A": a, "B": b}
    a.merged(delta("k"))
    b.merged(delta("k"))
    fence = Fence()
    assert fence.hold(Held("tok", commit_reply(7), rpc.PUT_END, ["k"], [("k", 7, ("A", "B"))]), outboxes)
    send_and_answer(a)
    fence.progress(outboxes)
    assert fence.take_out() == [] and len(fence) == 1
    send_and_answer(b)
    fence.progress(outboxes)
    assert fence.take_out() == [("tok", commit_reply(7))] and len(fence) == 0


def test_nothing_owed_means_answered_at_once_and_a_stale_answer_does_not_count():
    ob = NodeOutbox("inc", 1)
    fence = Fence()
    assert not fence.hold(Held("t", b"r", rpc.PUT_COMMIT, ["k"], [("k", 1, ("N",))]), {"N": ob})
    ob.merged(delta("k"))
    assert fence.hold(Held("t", b"r", rpc.PUT_COMMIT, ["k"], [("k", 1, ("N",))]), {"N": ob})
    send_and_answer(ob, STALE)  # the node remounted: the message was not applied
    fence.progress({"N": ob})
    assert fence.take_out() == []


def test_a_remount_of_the_same_incarnation_moves_the_wait_to_the_new_outbox():
    old = NodeOutbox("inc", 1)
    old.merged(delta("k"))
    fence = Fence()
    assert fence.hold(Held("t", b"r", rpc.PUT_COMMIT, ["k"], [("k", 1, ("N",))]), {"N": old})
    new = NodeOutbox("inc", 2, pending=old.owed())  # what plan_mount does
    fence.progress({"N": new})
    assert fence.take_out() == []
    send_and_answer(new)
    fence.progress({"N": new})
    assert fence.take_out() == [("t", b"r")]


def test_a_lost_node_fails_only_the_values_left_with_no_replica():
    a, b = NodeOutbox("ia", 1), NodeOutbox("ib", 1)
    for ob in (a, b):
        ob.merged(delta("x", "y"))
    fence = Fence()
    values = [("x", 5, ("A",)), ("y", 6, ("A", "B")), ("z", 7, ("B",))]
    reply = commit_reply(5, 6, 7)
    assert fence.hold(Held("t", reply, rpc.PUT_COMMIT, ["x", "y", "z"], values), {"A": a, "B": b})
    holders = {("x", 5): set(), ("y", 6): {"B"}, ("z", 7): {"B"}}
    fence.lost({"A"}, lambda key, gen: holders[(key, gen)])
    assert fence.take_out() == []  # y and z still wait for B
    send_and_answer(b)
    fence.progress({"B": b})
    [(token, out)] = fence.take_out()
    items = rpc.unpack(out)[1]
    assert token == "t" and items[1:] == [6, 7]
    assert rpc.is_err(items[0]) and items[0][1] == "LeaseExpiredError" and "'x'" in items[0][2]


def test_a_lost_node_answers_at_once_and_a_replaced_value_is_not_an_error():
    ob = NodeOutbox("inc", 1)
    ob.merged(delta("k", "m"))
    fence = Fence()
    assert fence.hold(Held("t", rpc.pack([rpc.OK, [None, None]]), rpc.PUT_END, ["k", "m"],
                           [("k", 3, ("N",)), ("m", 4, ("N",))]), {"N": ob})
    fence.lost({"N"}, lambda key, gen: None if key == "m" else set())  # m: a newer put replaced it
    [(_t, out)] = fence.take_out()
    items = rpc.unpack(out)[1]
    assert items[1] is None and rpc.is_err(items[0]) and items[0][1] == "NodeUnavailableError"


def test_a_slab_grant_on_a_lost_node_is_answered_with_a_retryable_error():
    ob = NodeOutbox("inc", 1)
    ob.merged(delta("slab/9"))
    fence = Fence()
    grant = rpc.pack([rpc.OK, [9, "N", 0, 4096, "inc", 2.0]])
    assert fence.hold(Held("t", grant, rpc.SLAB_GRANT, [], [("slab/9", -1, ("N",))]), {"N": ob})
    fence.lost({"N"}, lambda key, gen: set())
    [(_t, out)] = fence.take_out()
    rep = rpc.unpack(out)
    assert rpc.is_err(rep) and rep[1] == "NodeUnavailableError"
