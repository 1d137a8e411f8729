"""Replies to puts kept until the values are durable (pure, no Ray).

A put is acknowledged only once every store node holding one of its replicas has recorded
the value in its inventory: that inventory is what a restarted master rebuilds its index
from, so a master killed after the acknowledgement still finds the value. The reply to a
PUT_COMMIT or PUT_END (the native index's or Python's) is therefore held here, with what
it waits for: per node, a ticket of that node's outbox (``outbox.NodeOutbox.queued`` when
the put's inventory change was merged into it). The node's answer to the message carrying
that change brings its ``applied`` count to the ticket, and the reply goes out.

A node lost meanwhile (unmounted, unmounted by request, or back as another incarnation)
takes its replicas with it: each key whose value now has no replica left is answered with
a retryable error instead of its generation, so the client puts it again elsewhere, and
a key still held by another node waits for that node alone. A node that remounts as the
same incarnation is sent what it is owed again under its new mount: the wait moves to
the new outbox.

Replies are sent by the actor's delivery thread with no lock held (``take_out``): the
progress thread holds the transport lane while it runs the RPC handler, and the handler
takes the master's locks.
"""

from __future__ import annotations

from collections.abc import Callable

from mooncake_ray import errors
from mooncake_ray._private import rpc
from mooncake_ray._private.master.outbox import NodeOutbox

# key, gen, the nodes holding a replica (one item per value a call published or answered;
# gen -1: a range reserved for the caller to write into, ReplicaTable.note_reserved)
Published = tuple[str, int, tuple[str, ...]]


class Held:
    """One reply waiting for its values to be durable."""

    __slots__ = ("token", "reply", "op", "item_keys", "values", "waits")

    def __init__(self, token, reply: bytes, op: int, item_keys: list, values: list[Published]) -> None:
        self.token = token  # the transport's reply token
        self.reply = reply
        self.op = op  # rpc.PUT_COMMIT or rpc.PUT_END: which error a lost value gets
        self.item_keys = item_keys  # the key of each item of the reply, in order
        self.values = values
        self.waits: dict[str, tuple[NodeOutbox, int]] = {}


class Fence:
    """The held replies of one master (the actor holds its outbox lock around each call)."""

    def __init__(self) -> None:
        self._held: list[Held] = []
        self._out: list[tuple[object, bytes]] = []  # (token, reply) due, sent by take_out

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, held: Held, outboxes: dict[str, NodeOutbox]) -> bool:
        """Wait for ``held``'s values on their nodes' outboxes as they are now. False when
        nothing is owed to those nodes any more (durable already: answer at once). A node
        without an outbox (lost already) is judged by ``lost`` when that happens; here it
        is not waited for."""
        for _key, _gen, nodes in held.values:
            for node_id in nodes:
                ob = outboxes.get(node_id)
                if ob is not None and ob.mounted and node_id not in held.waits and ob.applied < ob.queued:
                    held.waits[node_id] = (ob, ob.queued)
        if not held.waits:
            return False
        self._held.append(held)
        return True

    def due(self, token, reply: bytes) -> None:
        """A reply to send as it is (durable already, but found under a lock)."""
        self._out.append((token, reply))

    def progress(self, outboxes: dict[str, NodeOutbox]) -> None:
        """Move the replies whose waits are all met to the send queue. A wait on an outbox
        replaced by a remount of the same incarnation moves to the new one (it was sent
        the same changes again)."""
        if not self._held:
            return
        keep = []
        for h in self._held:
            for node_id, (ob, ticket) in list(h.waits.items()):
                cur = outboxes.get(node_id)
                if cur is not ob and cur is not None and cur.incarnation == ob.incarnation and cur.mounted:
                    h.waits[node_id] = (cur, cur.queued)
                    continue
                if cur is ob and ob.applied >= ticket:
                    del h.waits[node_id]
            if h.waits:
                keep.append(h)
            else:
                self._out.append((h.token, h.reply))
        self._held = keep

    def lost(self, node_ids: set[str], fate: Callable[[str, int], set[str] | None]) -> None:
        """Nodes that are gone with their replicas. ``fate(key, gen)``: the nodes that still
        hold that value (empty: none), or None when a newer value replaced it."""
        if not self._held or not node_ids:
            return
        keep = []
        for h in self._held:
            if not node_ids & h.waits.keys():
                keep.append(h)
                continue
            failed = set()
            for key, gen, nodes in h.values:
                if gen < 0 or node_ids.isdisjoint(nodes):  # a reservation: the client's write fails
                    continue
                left = fate(key, gen)
                if left is not None and not left:
                    failed.add(key)
            if h.op == rpc.SLAB_GRANT:  # the slab was on a lost node: the client asks again
                h.reply = rpc.pack(rpc.err_entry(errors.NodeUnavailableError(
                    f"the store node of the put slab granted was lost ({', '.join(sorted(node_ids & h.waits.keys()))})")))
            for node_id in node_ids:
                h.waits.pop(node_id, None)
            if failed:
                h.reply = _fail(h.reply, h.op, h.item_keys, failed)
            if h.waits:
                keep.append(h)
            else:
                self._out.append((h.token, h.reply))
        self._held = keep

    def take_out(self) -> list[tuple[object, bytes]]:
        out, self._out = self._out, []
        return out


def _fail(reply: bytes, op: int, item_keys: list, keys: set[str]) -> bytes:
    """``reply`` with each of ``keys``' items turned into a retryable error."""
    rep = rpc.unpack(reply)
    if rep[0] != rpc.OK:
        return reply
    items = rep[1]
    for i, key in enumerate(item_keys[:len(items)]):
        if key in keys and not rpc.is_err(items[i]):
            msg = f"the store node holding {key!r} was lost before it recorded the value; put it again"
            exc = errors.LeaseExpiredError(msg) if op == rpc.PUT_COMMIT else errors.NodeUnavailableError(msg)
            items[i] = rpc.err_entry(exc)
    return rpc.pack([rpc.OK, items])
