"""Chain messages between master shards (``master.shards > 1``; the links: ``chains.py``).

Each shard runs one thread that takes the messages its state machine owes other shards
(``MasterState.chain_outbox``) and sends each shard its part in one call over the store's
own transport (the op ``CHAIN_LINKS`` of the peer's master RPC, answered under its lock;
Ray is asked only for the peer's address). A Ray actor call cost about a millisecond of
CPU on each side: sent as often as commits came, they doubled a KV turn's time on 2 vCPUs
with 4 shards (15.8 against 7.9 ms, ``bench_chains.py``), and sent at most every 50 ms they
came too late to hold the parents (rounds at 25%: 2.9% served against 13.7%). The thread
wakes as soon as a section of the actor's lock leaves messages (``wanted``), and at least
every ``period_s``: a link must reach the parent's shard before that shard's next eviction
could take the parent as a leaf; messages that come while a round is in flight go in the
next. A shard it has nothing for is still called
every ``probe_s``: the answer carries the callee's incarnation, which is how a shard
notices that another restarted.

When either side restarted, the links are sent whole: a restarted shard sends every
peer all the links its children hold to that peer's parents (rebuilt from the store
nodes' inventories, which carry each value's parent), and a shard that sees a peer's new
incarnation does the same, since the peer forgot them. The whole set replaces what the
peer held from this shard (``Chains.remote_sync``), so links and unlinks lost in a failed
call are repaired by it too; a failed call's "parent gone / back" messages are sent again.
Everything here is a hint for eviction order: a message late by a round changes which
page goes first, never what a read returns.
"""

from __future__ import annotations

import logging
import threading
import time

import ray

from mooncake_ray._private import rpc
from mooncake_ray._private.master.chains import BACK, GONE
from mooncake_ray._private.naming import master_name

log = logging.getLogger(__name__)


class ChainExchange:
    """One shard's side of the exchange (see the module docstring)."""

    def __init__(self, shard: int, shards: int, namespace: str, lock, state, incarnation: str, engine,
                 period_s: float = 0.2, probe_s: float = 2.0, timeout_s: float = 5.0) -> None:
        self.shard, self.shards = shard, shards
        self._engine = engine
        self._namespace = namespace
        self._lock, self._state = lock, state
        self.incarnation = incarnation
        self.period_s, self.probe_s, self.timeout_s = period_s, probe_s, timeout_s
        self._peers = [s for s in range(shards) if s != shard]
        self._seen: dict[int, str] = {}  # peer -> its incarnation when it last answered
        self._whole = set(self._peers)  # peers owed every link (this shard, or they, restarted)
        self._retry: dict[int, list] = {}  # peer -> "gone" / "back" messages a failed call lost
        self._conns: dict[int, object] = {}  # peer -> transport endpoint
        self._quiet: dict[int, float] = {}  # peer -> when it was last called
        self.wanted = threading.Event()  # set when a section of the actor's lock leaves messages

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.wanted.wait(self.period_s)
            self.wanted.clear()
            try:
                self.round()
            except Exception:  # keep exchanging: one bad round must not end chains across shards
                log.exception("chain message round failed")

    def round(self) -> None:
        """Send each peer what it is owed (and probe the quiet ones)."""
        with self._lock:
            out = self._state.chain_outbox()
            whole = {p: self._state.chain_links_to(p) for p in self._whole}
        now = time.monotonic()
        calls = {}
        for peer in self._peers:
            items = self._retry.pop(peer, []) + out.get(peer, [])
            links = whole.get(peer)
            if not items and links is None and now - self._quiet.get(peer, 0.0) < self.probe_s:
                continue
            self._quiet[peer] = now
            try:
                call = self._engine.call_async(self._connect(peer), rpc.MASTER_RPC,
                                               rpc.pack([rpc.CHAIN_LINKS, self.shard, items, links]))
            except Exception:  # not there yet, or restarting
                self._failed(peer, items)
                continue
            calls[peer] = (call, items, links)
        for peer, (call, items, links) in calls.items():
            try:
                inc = rpc.decode_reply(call.result(self.timeout_s))
            except Exception:  # unreachable, timed out, or rebuilding its index
                call.cancel()
                self._failed(peer, items)
                continue
            if links is not None:
                self._whole.discard(peer)
            if self._seen.get(peer, inc) != inc:
                self._whole.add(peer)  # it restarted: it forgot the links this shard holds
            self._seen[peer] = inc

    def _failed(self, peer: int, items: list) -> None:
        self._conns.pop(peer, None)
        self._whole.add(peer)  # the whole set covers lost links and unlinks
        kept = [m for m in items if m[0] in (GONE, BACK)]
        if kept:
            self._retry[peer] = kept + self._retry.get(peer, [])

    def _connect(self, peer: int):
        """The transport endpoint of master shard ``peer`` (its address asked of Ray)."""
        conn = self._conns.get(peer)
        if conn is None:
            handle = ray.get_actor(master_name(peer), namespace=self._namespace)
            address = ray.get(handle.rpc_address.remote(), timeout=self.timeout_s)
            conn = self._conns[peer] = self._engine.connect(address)
        return conn
