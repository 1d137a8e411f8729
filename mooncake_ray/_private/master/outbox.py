"""What the master owes each store node, and the rules for delivering it (pure, no Ray).

One :class:`NodeOutbox` per store node incarnation. Changes the state machine makes are
merged into ``pending`` (a :class:`NodeDelta`, bounded by the keys touched, see there).
At most one message is in flight per node; it carries the node's ``mount_id`` and a
sequence number, so the node applies it exactly once and in order however often it is
sent. A message is sent again only when the send failed or stayed unanswered for
``resend_after_s`` (a busy node answers late: sending more copies would only queue more
work behind the first).

An undelivered message is never a reason to unmount a node (liveness is the heartbeat's
business). When a node remounts, whatever it may not have applied (the message in flight
and ``pending``) is applied to its inventory by the master and sent to it again under the
new mount: the rejoining node and the master agree on every key, including puts
acknowledged and values dropped while it was away.
"""

from __future__ import annotations

from mooncake_ray._private import rpc
from mooncake_ray._private.master.types import NodeDelta
from mooncake_ray._private.store.inventory import STALE, reconcile, unpack

MESSAGE_MAX_ITEMS = 20_000  # records per message: a node applies one under its lock


class NodeOutbox:
    """Delivery state of one store node incarnation (the master actor holds its outbox
    lock around every call)."""

    def __init__(self, incarnation: str, mount_id: int, pending: NodeDelta | None = None) -> None:
        self.incarnation = incarnation
        self.mount_id = mount_id
        self.pending = pending if pending is not None else NodeDelta()
        # Tickets (fence.py): ``queued`` counts the merges into ``pending``; the node has
        # recorded every change merged up to ``applied``; ``covers``: the count the
        # message in flight brings it to.
        self.queued = 0 if self.pending.empty() else 1
        self.applied = 0
        self.covers = 0
        self.next_seq = 1
        self.inflight: NodeDelta | None = None
        self.inflight_seq = 0
        self.payload = b""
        self.handle = None  # the transport call carrying the message, while it runs
        self.sent_at = 0.0
        self.retry_at = 0.0
        self.attempts = 0
        self.stale = False  # the node answered STALE: it remounted; wait for the mount
        self.mounted = True  # False once the master unmounted the node (kept until it returns)
        self.slow_since = 0.0  # when the current message was first sent (for the log)
        self.slow_logged = False
        self.probed = False  # the node was checked for this message (puts waited on it)

    def busy(self) -> bool:
        return self.inflight is not None or not self.pending.empty()

    def next_message(self, now: float) -> bytes | None:
        """The message to send now, or None (nothing owed, an answer awaited, a retry
        not due, or the node remounting)."""
        if self.stale or self.handle is not None:
            return None
        if self.inflight is None:
            if self.pending.empty():
                return None
            self.inflight = self.pending.split(MESSAGE_MAX_ITEMS)
            # A part of pending brings no ticket: only its last part covers them all.
            self.covers = self.queued if self.pending.empty() else self.applied
            self.inflight_seq = self.next_seq
            self.next_seq += 1
            self.payload = rpc.pack([self.mount_id, self.inflight_seq, self.inflight.to_wire()])
            self.attempts = 0
            self.slow_since = now
            self.slow_logged = False
            self.probed = False
        elif now < self.retry_at:
            return None
        self.attempts += 1
        self.sent_at = now
        return self.payload

    def answered(self, reply: bytes) -> None:
        """The node answered the message in flight."""
        self.handle = None
        if reply == STALE:
            self.stale = True  # kept in flight: it goes again after the remount
            return
        self.inflight = None
        self.payload = b""
        self.applied = max(self.applied, self.covers)

    def merged(self, delta: NodeDelta) -> None:
        """Take more changes into ``pending`` (a new ticket)."""
        if self.pending.empty():
            self.pending = delta
        else:
            self.pending.absorb(delta)
        self.queued += 1

    def failed(self, now: float, backoff_s: float) -> None:
        """The send failed or was given up: send the same message again later."""
        self.handle = None
        self.retry_at = now + min(backoff_s * self.attempts, 2.0)

    def owed(self) -> NodeDelta:
        """Everything the node may not have applied, in order (in flight, then pending)."""
        out = NodeDelta()
        if self.inflight is not None:
            out.merge(self.inflight)
        out.merge(self.pending)
        return out

    def accepts(self, incarnation: str, mount_id: int) -> bool:
        """A heartbeat from this incarnation and mount is current (else: remount)."""
        return self.mounted and self.incarnation == incarnation and self.mount_id == mount_id


def plan_mount(old: NodeOutbox | None, incarnation: str, mount_id: int, known: bool,
               inventory: list) -> tuple[list, NodeOutbox] | None:
    """How the master takes a node's mount: the inventory to restore and the node's new
    outbox, or None for a repeat of an older mount of the same incarnation (ignored: the
    node has moved on and refuses that mount's messages).

    ``known``: the state machine still has this incarnation mounted (its view is current,
    so what the node is owed is simply sent again). Otherwise the node was unmounted; if
    this outbox knew it, the inventory it brings is brought up to date with what it was
    owed before anything is restored, and sent the same changes (without the offloads the
    unmount forgot)."""
    same = old is not None and old.incarnation == incarnation
    if same and mount_id <= old.mount_id:
        return None
    owed = None
    if same:
        owed = old.owed()
        if not known:
            inventory = reconcile(unpack(inventory) if isinstance(inventory, dict) else inventory, owed)
            kept = NodeDelta()
            kept.merge(owed, offloads=False)
            owed = kept
    return inventory, NodeOutbox(incarnation, mount_id, owed)
