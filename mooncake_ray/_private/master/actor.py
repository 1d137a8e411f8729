"""The master as a Ray actor: a thin adapter around :class:`MasterState`.

Two doors lead in:

- the per-operation RPC (put_start/end/revoke, slab grant and put_commit, get, exists,
  remove, pin, batch forms),
  served by the native engine on its progress thread (``_serve_rpc``);
- Ray actor calls for the lifecycle: the RPC address, mount, heartbeat, stats, nodes.

Both take ``_lock`` around the state machine. GET, EXISTS, lease releases and clean
one-call put commits are mostly answered without it, in C++ from a mirror of the index
(``fastpath.py``): ``_lock`` also holds that mirror's mutex and first applies what it did;
a thread woken by logged commits applies them within milliseconds. Inventory changes the state machine queues
for store nodes are merged into each node's outbox (``outbox.py``) under that lock,
and a delivery thread sends them, in order, one message in flight per node, over the same
transport; a message that fails or goes unanswered is sent again, never counted as the
node's death. The reply to a put waits for them (``fence.py``, ``master.durable_acks``):
it is sent once every node holding the value has recorded it, so a master restarted from
the nodes' inventories finds every acknowledged value. The native index logs its commit
replies instead of sending them; the delivery thread sends each when its nodes answer.
A node whose process is gone (the transport says unreachable, and a fresh connection is
refused too) is unmounted at once rather than after ``node_ttl_s``: the puts waiting on
it are answered with a retryable error and go elsewhere.

Liveness is the heartbeat alone: store nodes call ``heartbeat`` on a concurrency group of
its own, and it is answered without the state lock, so neither a burst of RPCs, an
eviction, a large mount nor a slow inventory delivery delays it.

Lock order: ``_lock`` (the Python lock, then the index mutex) before ``_outbox_cv``;
nothing is held while calling out.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import os
import threading
import time

import ray

from mooncake_ray.config import StoreConfig
from mooncake_ray.errors import (InvalidArgumentError, MasterUnavailableError, MooncakeRayError, NodeUnavailableError,
                                 ObjectNotFoundError)
from mooncake_ray._private import auth, gcyoung, logs, rpc
from mooncake_ray._private.checks import check_ttl
from mooncake_ray._private.auth import role_engine
from mooncake_ray._private.master.chainlinks import ChainExchange
from mooncake_ray._private.master.fence import Fence, Held
from mooncake_ray._private.master.outbox import NodeOutbox, plan_mount
from mooncake_ray._private.master.state import MasterState, Policy
from mooncake_ray._private.master.types import NodeInfo
from mooncake_ray._private.metrics import MasterMetrics
from mooncake_ray._private.naming import store_actor_ids, store_actor_name
from mooncake_ray._private.store.arena import boot_id, pid_namespace
from mooncake_ray._private.store.ring import CommitRing
from mooncake_ray._private.store_nodes import join_new_nodes

log = logging.getLogger(__name__)

DELIVERY_COALESCE_S = 0.001
RESEND_AFTER_S = 10.0  # an unanswered inventory message goes again (the node dedupes it)
RETRY_BACKOFF_S = 0.2  # after a failed send; grows per attempt, up to 2 s
SLOW_DELIVERY_S = 2.0  # log a node that has not answered an inventory message for this long
ANSWER_POLL_S = 0.01  # longest wait on one answer before checking the others (a busy node)
LIVENESS_GROUP = "liveness"
_SENDING = object()  # NodeOutbox.handle while a thread sends its message
EVICT_CHUNK_BYTES = 1 << 20  # background eviction per section: 4k values of 256 B (a few ms), 64 of 16 KiB
EVICT_YIELD_S = 0.0005  # between chunks: Python's lock is not fair, a waiting call must get its turn
APPLY_GATHER_S = 0.002  # how long commits answered through the rings gather before Python applies them
PROBE_TIMEOUT_S = 1.0  # this master's own check of a node a client reported unreachable
FENCE_PROBE_S = 0.1  # a node this slow to record puts that wait on it is checked (dead or busy?)


class MasterActor:
    def __init__(self, config: dict, shard: int = 0):
        logs.configure()
        self.cfg = StoreConfig.model_validate(config)
        self.shard = shard  # which of master.shards this is (shards.py: its keys, its part of each arena)
        self._inventory_rpc = rpc.node_inventory_rpc(shard)
        gcyoung.raise_young_threshold()  # this actor's own process
        from mooncake_ray._private.native import _native

        # The object table and the native fast path (table.py, fastpath.py); with
        # native_calls off it still holds the table, and Python answers every call.
        self.index = _native.MasterIndex()
        self.index.set_lease_ttl(self.cfg.master.lease_ttl_s)
        self.index.set_max_key_bytes(self.cfg.master.max_key_bytes)
        self.index.set_commits(self.cfg.master.native_calls)
        # Watermark eviction on a thread of its own, in chunks (_evict_loop); a put that
        # finds no room still evicts at once.
        self.state = MasterState(Policy.from_config(self.cfg.master, evict_in_background=True, shard=shard),
                                 index=self.index)
        self._evict_wanted = threading.Event()
        self._lock = _StateLock(self.state, self.index, self._deliver, self._evict_wanted)

        self.engine = role_engine(self.cfg, "master" if shard == 0 else f"master{shard}", server=True, num_lanes=1)
        self._node_key = auth.new_node_key()  # a restarted master makes a new one: nodes remount
        self._probing: set[str] = set()
        self._peers: dict[str, object] = {}
        self._metrics = MasterMetrics(shard)
        self.incarnation = f"{time.time_ns():x}"
        ctx = ray.get_runtime_context()
        if ctx.was_current_actor_reconstructed:
            # A restart: rebuild the index from the store nodes' inventories. They notice
            # through their heartbeat (this master does not know them) and remount; each is
            # told at once too, so none waits out its heartbeat period.
            expected = set(store_actor_ids(self.cfg.namespace))
            self.state.begin_recovery(expected)
            log.warning("master shard %d restarted; waiting for store nodes %s to remount", shard, sorted(expected))
            threading.Thread(target=_wake_nodes, args=(self.cfg.namespace, sorted(expected), shard), daemon=True,
                             name="master-wake-nodes").start()
        self._table = self._rpc_table()
        self._stop = threading.Event()
        self._outboxes: dict[str, NodeOutbox] = {}  # node_id -> what it is owed
        self._outbox_cv = threading.Condition()
        self._durable = self.cfg.master.durable_acks
        self._fence = Fence()  # put replies held until durable (under _outbox_cv)
        self._rings: dict[str, CommitRing] = {}  # node_id -> its commit ring, mapped (store/ring.py)
        # Inline: the handler never calls the engine (deliveries have their own thread).
        # A plain function, not the bound method: Ray wraps every method of an actor class
        # in a tracing shim, which would run on every call (~4% of the master's time).
        handler = functools.partial(_serve_rpc, self)
        if self.cfg.master.native_calls:
            self.engine.serve_master(rpc.MASTER_RPC, self.index, handler, hold_commits=self._durable)
        else:
            self.engine.serve(rpc.MASTER_RPC, handler, inline=True)
        with self._lock:  # enables the index unless the master is rebuilding
            pass
        self._events: collections.deque = collections.deque(maxlen=100)
        self.state.counters.update(joins=0, readoptions=0, readopted_keys=0, readopt_dropped_keys=0)
        loops = [(self._tick_loop, "master-tick"), (self._delivery_loop, "master-deliver"),
                 (self._apply_loop, "master-apply"), (self._evict_loop, "master-evict")]
        if shard == 0 and self.cfg.elastic.join and self.cfg.segment_size_bytes:
            loops.append((self._join_loop, "master-join"))
        if self.cfg.master.shards > 1 and self.cfg.master.chain_eviction:
            chains = ChainExchange(shard, self.cfg.master.shards, self.cfg.namespace, self._lock, self.state,
                                   self.incarnation, self.engine)
            self._lock.chains_wanted = chains.wanted
            loops.append((functools.partial(chains.run, self._stop), "master-chains"))
        for target, name in loops:
            threading.Thread(target=target, name=name, daemon=True).start()

    # ------------------------------------------------------------------- RPC door --
    def _rpc_table(self) -> dict:
        """The master's RPC operations and their handlers (``rpc.serve_request``)."""
        return {
            rpc.PUT_START: self._put_start,
            rpc.PUT_END: lambda items: rpc.per_key(self._put_end, items),
            rpc.PUT_REVOKE: lambda items: rpc.per_key(self.state.put_revoke, items),
            rpc.GET: self._get,
            rpc.RELEASE: self._release,
            rpc.EXISTS: lambda keys: [self.state.exists(k) for k in keys],
            rpc.REMOVE: lambda keys, force=False: rpc.per_key(self.state.remove, keys, force),
            rpc.REMOVE_PREFIX: lambda prefix, force=False: self.state.remove_prefix(prefix, force),
            rpc.NODES: self.state.nodes,
            rpc.PIN: lambda items: rpc.per_key(self.state.pin, items),
            rpc.UNPIN: lambda keys: rpc.per_key(self.state.unpin, keys),
            rpc.REPORT_UNREACHABLE: self._report_unreachable,
            rpc.PING: lambda *pad: self.incarnation,
            # Only store nodes make these: signed with the node key (auth.py).
            rpc.OFFLOAD_DONE: self._from_node(self.state.offload_done),
            rpc.PROMOTE_BEGIN: self._from_node(self.state.promotions_reserved),
            rpc.PROMOTE_DONE: self._from_node(self.state.promote_done),
            rpc.SLAB_GRANT: self._slab_grant,
            rpc.PUT_COMMIT: self._put_commit,
            rpc.SLAB_RETURN: self._return_slabs,
            rpc.CHAIN_LINKS: self._chain_links,
        }

    def _chain_links(self, shard: int, items: list, links: list | None = None) -> str:
        """Chain messages from master ``shard`` (chainlinks.py); ``links``: every link it
        holds to this shard's keys. Returns this master's incarnation."""
        self.state.chain_receive(shard, items, links)
        return self.incarnation

    def _from_node(self, fn):
        def checked(node_id, items, tag=None):
            auth.check_mac(self._node_key, [node_id, items], tag)
            return fn(node_id, items)

        return checked

    def _report_unreachable(self, node_id) -> None:
        """A client could not reach a store node: no new puts go there until this master
        has checked it can reach the node itself (a fresh connection and an echo, on a
        thread of its own), or until the node's next heartbeat; a client cannot take a
        healthy node out of use."""
        self.state.report_unreachable(node_id)
        if node_id in self.state._nodes:
            self._check_node(node_id)

    def _start_probe(self, node_id: str) -> None:
        threading.Thread(target=self._probe, args=(node_id,), name="master-probe", daemon=True).start()

    def _probe(self, node_id: str) -> None:
        """Whether this master reaches the node over a fresh connection. Refused (the
        transport says unreachable: on the same host, its process is gone): the node is
        unmounted now. Unanswered: busy or paused, not dead (its heartbeat decides)."""
        try:
            with self._lock:
                node = self.state._nodes.get(node_id)
                address, incarnation = (node.address, node.incarnation) if node is not None else (None, None)
            if address is None:
                return
            cached = self._peers.get(node_id)
            if cached is not None:
                cached.check_process()  # on this host: is its process still there? (now, not at the next watch)
            try:
                peer = self.engine.connect(address, timeout_s=PROBE_TIMEOUT_S)  # a new one if that died
                self.engine.call(peer, rpc.NODE_ECHO_RPC, b"", timeout_s=PROBE_TIMEOUT_S)
            except NodeUnavailableError as e:
                self._gone(node_id, incarnation, e)
                return
            except MooncakeRayError as e:
                log.info("store node %s did not answer this master's check (%s); its heartbeat decides", node_id, e)
                return
            self._peers[node_id] = peer
            with self._lock:
                self.state.vouch(node_id)
        finally:
            self._probing.discard(node_id)

    def _check_node(self, node_id: str) -> None:
        """Probe a node (once at a time) that failed a send or left puts waiting."""
        if node_id not in self._probing:
            self._probing.add(node_id)
            self._start_probe(node_id)

    def _gone(self, node_id: str, incarnation: str, err: Exception) -> None:
        """A node this master cannot connect to (its process is gone): unmount it now, so
        the puts waiting on it are answered and go elsewhere."""
        with self._lock:
            node = self.state._nodes.get(node_id)
            if node is None or node.incarnation != incarnation:
                return
            lost = self.state.unmount(node_id, f"unreachable ({err})")
            self._peers.pop(node_id, None)
            with self._outbox_cv:
                ob = self._outboxes.get(node_id)
                if ob is not None:
                    ob.mounted = False
            self._lose({node_id})
        log.warning("unmounted store node %s: a fresh connection to it failed (%s); %d keys lost", node_id, err, lost)

    def _attach_ring(self, node: NodeInfo, path: str, epoch: int, pid: int, pid_ns: str) -> None:
        """Map a mounted node's commit ring, when it is on this host, so that native
        commits into its slabs are answered at once (``store/ring.py``; lock held). The
        ring must show the epoch the node drew for this mount: a file of the same name in
        another container's shared memory does not. The node's process is watched through
        its ``/proc`` entry when it is in this PID namespace (``pid_ns``): its main thread's
        (``task/<pid>/stat``), which shows a pending SIGKILL and an exit under way as the
        process's does, without summing every thread's counters at each commit (3.0-3.7 us a
        read against 4.5-6.6 us for a process of 1-60 threads)."""
        self._drop_rings({node.node_id})
        if not (self._durable and path and epoch) or node.boot_id != boot_id():
            return
        try:
            ring = CommitRing.open(path)
        except (OSError, ValueError):
            return
        if ring.epoch != epoch:
            ring.close()
            return
        if pid and pid_ns and pid_ns == pid_namespace():
            try:
                ring.proc_fd = os.open(f"/proc/{pid}/task/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:  # gone already
                ring.close()
                return
        self.index.set_ring(node.node_id, node.incarnation, ring.addr, ring.nbytes, ring.fd, epoch, ring.proc_fd)
        self._rings[node.node_id] = ring

    def _drop_rings(self, node_ids) -> None:
        for node_id in node_ids:
            ring = self._rings.pop(node_id, None)
            if ring is not None:
                self.index.drop_ring(node_id)  # under the index's mutex: no commit writes there now
                ring.close()

    def _lose(self, node_ids: set[str]) -> None:
        """Nodes gone with their replicas: the puts waiting on them are answered (lock held)."""
        self._drop_rings(node_ids)
        with self._outbox_cv:
            if len(self._fence):
                self._fence.lost(node_ids, self.state.holders)
                self._outbox_cv.notify()

    def _put_start(self, items, client_node=None, owner=""):
        # Whole-call, so the client's channel waits and retries (per key it would be an answer).
        self.state._allocation_gate(self.state._clock())
        def one(key, size, replicas=None, upsert=False, parent=""):
            return self.state.put_start(key, size, replicas, client_node, owner, upsert, parent)

        return rpc.per_key(one, items)

    def _return_slabs(self, ids) -> list:
        return [self.state.slab_return(i) for i in ids]

    def _slab_grant(self, owner, client_node=None, need=0, returns=(), prefer=None):
        self._return_slabs(returns)  # the caller's used-up slabs, piggybacked
        return self.state.slab_grant(owner, client_node, need, prefer)

    def _put_end(self, key, gen, crc=None, hold_s=None):
        _check_crc(key, crc)
        if hold_s is not None:
            check_ttl(hold_s, "hold_s")
        self.state.put_end(key, gen, crc)
        self._hold(key, hold_s)

    def _hold(self, key: str, hold_s: float | None) -> None:
        """A put with ``hold_s`` (``batch_put_from``): soft-pin the value in the call that
        published it, before any eviction can run (the call holds the actor's lock)."""
        if hold_s is None:
            return
        try:
            self.state.pin(key, False, hold_s)
        except ObjectNotFoundError:  # its own publication's eviction round took it: a later miss
            pass

    def _put_commit(self, items, owner, returns=(), hold_s=None):
        if hold_s is not None:
            check_ttl(hold_s, "hold_s")

        def one(key, slab_id, offset, size, upsert=False, parent="", crc=None):
            _check_crc(key, crc)
            # The checksum is carried only by the native commit's ring record; on this path
            # the store node takes it from the arena when it journals the value.
            gen = self.state.put_commit(key, slab_id, offset, size, upsert, owner, parent)
            self._hold(key, hold_s)  # before the next item's commit may evict
            return gen

        out = rpc.per_key(one, items)
        self._return_slabs(returns)  # after the commits: a returned slab may hold some of them
        return out

    def _release(self, done) -> None:
        for key, gen, lease in done:
            self.state.release(key, gen, lease)

    def _get(self, keys, client_node=None, done=None):
        if done:  # leases of the caller's finished reads, piggybacked
            self._release(done)
        with self.state.one_call():
            if self.state.policy.chain_eviction and len(keys) > 1:
                # a batch's hits used last to first, as the index does (MasterIndex::serve)
                return rpc.per_key(self.state.get, keys[::-1], client_node)[::-1]
            return rpc.per_key(self.state.get, keys, client_node)


    def _apply_loop(self) -> None:
        """Apply commits the index answered natively (publish, inventory delta) soon after
        they happen, not at the next Python call: a store node's inventory must follow."""
        while not self._stop.is_set():
            if not self.index.wait_commits(0.5):
                continue
            # Commits answered through the rings are durable and answered already: let a few
            # milliseconds' worth gather and apply them at once (Python costs about 60 us
            # a wake-up). A reply kept for durability (the round trip) ends the wait.
            self.index.wait_held(APPLY_GATHER_S)
            # Publishing frees nothing, so native calls may go on meanwhile: the Python
            # lock only (and the deltas queued at once). Then under both locks: the rest of
            # the log, and the watermark checks, which may evict, so they must see every
            # lease granted before them.
            with self._lock.python_only():
                self.state.apply_index_log(*self.index.drain(), decide=False)
                self._deliver()
            self._send_now()
            with self._lock:
                # the commits' samples into the insertion policy's caches now (at most every
                # 10 ms), not at the next tick or eviction round: the half-size caches must
                # choose before the pressure comes, and a tick is a second
                self.state.adapt(time.monotonic())

    def _evict_loop(self) -> None:
        """Background eviction: a chunk per section of the lock, so RPCs and native calls
        get in between (a round at ten million small values is hundreds of thousands of
        keys: one section would hold every call up for a good part of a second)."""
        while not self._stop.is_set():
            if not self._evict_wanted.wait(0.5):
                continue
            self._evict_wanted.clear()
            try:
                more = True
                while more and not self._stop.is_set():
                    with self._lock:
                        more = self.state.evict_due(EVICT_CHUNK_BYTES)
                    time.sleep(EVICT_YIELD_S)
            except Exception:  # never let eviction die: report and go on
                log.exception("background eviction failed")
                time.sleep(0.1)

    def _deliver(self) -> None:
        """Merge the state machine's inventory changes into the nodes' outboxes, and hold
        the replies the read index logged until their values are durable (lock held)."""
        effects = self.state.drain_effects()
        held = self.state.take_held()
        if not effects and not held:
            return
        with self._outbox_cv:
            for node_id, delta in effects.items():
                ob = self._outboxes.get(node_id)
                if ob is not None:
                    ob.merged(delta)
            for token, reply, item_keys, values in held:
                if not self._fence.hold(Held(token, reply, rpc.PUT_COMMIT, item_keys, values), self._outboxes):
                    self._fence.due(token, reply)
            self._outbox_cv.notify()

    def _hold_reply(self, data: bytes, reply: bytes, values: list) -> bool:
        """On the RPC thread, after a call published ``values`` (or reserved ranges for the
        caller to write into): keep its reply until the nodes have recorded them (True), or
        let it go now (False: nothing owed, or not a put call)."""
        req = rpc.unpack(data)
        if req[0] not in (rpc.PUT_COMMIT, rpc.PUT_END, rpc.PUT_START, rpc.SLAB_GRANT):
            return False
        items = req[1] if req[0] != rpc.SLAB_GRANT and isinstance(req[1], list) else []
        item_keys = [it[0] if isinstance(it, list) and it else None for it in items]
        with self._outbox_cv:
            held = Held(None, reply, req[0], item_keys, values)
            if not self._fence.hold(held, self._outboxes):
                return False
            held.token = self.engine.hold_request()
            self._outbox_cv.notify()
        return True

    def _send_replies(self) -> None:
        """Send the put replies that became durable (no lock held: see fence.py)."""
        with self._outbox_cv:
            if len(self._fence):
                self._fence.progress(self._outboxes)
            out = self._fence.take_out()
        for token, reply in out:
            try:
                self.engine.reply(token, reply)
            except MooncakeRayError as e:  # the caller went away; it retries the put
                log.debug("put reply not sent: %s", e)

    def _delivery_loop(self) -> None:
        """Send each node what it is owed, one message in flight per node (so a node never
        applies them out of order, and a slow node does not hold up the others); no client
        call waits for this (a put would otherwise pay a second round trip)."""
        while not self._stop.is_set():
            try:
                self._delivery_round()
            except Exception:  # never let delivery die: report and go on
                log.exception("inventory delivery failed")
                time.sleep(0.1)

    def _delivery_round(self) -> None:
        self._send_replies()
        with self._outbox_cv:
            sends, waiting = self._collect(time.monotonic())
            if not sends and not waiting:
                self._outbox_cv.wait(0.05)
                # Coalesce: under a stream of puts, one message per millisecond instead of
                # one per put (each costs the master and the store node a Python call). Not
                # while replies wait for the message: more puts arrive while it is out.
                woke = not len(self._fence)
            else:
                woke = False
        if woke:
            time.sleep(DELIVERY_COALESCE_S)
            return
        waiting += self._send(sends)
        handles = [h for h in (ob.handle for _node_id, ob in waiting) if h is not None and h is not _SENDING]
        if not handles:  # another thread is sending: its answer is awaited next round
            time.sleep(0.0002)
            return
        try:  # GIL released; returns as soon as the answer is in (usually well under 1 ms)
            handles[0].wait(ANSWER_POLL_S)
        except MooncakeRayError:
            pass
        now = time.monotonic()
        for node_id, ob in waiting:
            self._check_answer(node_id, ob, now)
        if len(self._fence):
            self._send_replies()

    def _collect(self, now: float):
        """Messages due (outbox lock held), each outbox marked as being sent, and the
        outboxes awaiting an answer."""
        sends, waiting = [], []
        for node_id, ob in self._outboxes.items():
            if ob.handle is not None:
                waiting.append((node_id, ob))
            elif ob.mounted:
                payload = ob.next_message(now)
                if payload is not None:
                    ob.handle = _SENDING  # no other thread sends it meanwhile
                    sends.append((node_id, ob, payload))
        return sends, waiting

    def _send(self, sends) -> list:
        """Send collected messages (no lock held); returns those now awaiting an answer."""
        waiting = []
        for node_id, ob, payload in sends:
            peer = self._peer(node_id)
            handle = None
            if peer is None:
                self._check_node(node_id)  # cannot connect: is it gone?
            else:
                try:
                    handle = self.engine.call_async(peer, self._inventory_rpc, auth.seal(self._node_key, payload))
                except MooncakeRayError as e:
                    log.info("inventory send to store node %s failed (%s); retrying", node_id, e)
                    self._peers.pop(node_id, None)
                    self._check_node(node_id)
            with self._outbox_cv:
                if handle is None:
                    ob.failed(time.monotonic(), RETRY_BACKOFF_S)
                else:
                    ob.handle = handle
                    waiting.append((node_id, ob))
                self._outbox_cv.notify()
        return waiting

    def _send_now(self) -> None:
        """From the thread that applied logged commits, when puts wait for their delivery:
        send at once rather than hand over to the delivery thread (a thread wake-up, tens
        to hundreds of µs on a busy host, saved per put). The delivery thread awaits the
        answer."""
        with self._outbox_cv:
            if not len(self._fence):
                return
            sends, _waiting = self._collect(time.monotonic())
        if sends:
            self._send(sends)

    def _check_answer(self, node_id: str, ob: NodeOutbox, now: float) -> None:
        handle = ob.handle
        if handle is None or handle is _SENDING:
            return
        if handle.done():
            try:
                reply = handle.result(0)
                err = None
            except MooncakeRayError as e:
                reply, err = None, e
            with self._outbox_cv:
                if err is None:
                    ob.answered(reply)
                else:
                    ob.failed(now, RETRY_BACKOFF_S)
            if err is not None:  # loud on the 1st, 10th, 100th... failure of one message
                level = logging.WARNING if math.log10(ob.attempts).is_integer() else logging.DEBUG
                log.log(level, "store node %s did not take an inventory update (attempt %d: %s); retrying",
                        node_id, ob.attempts, err)
                self._peers.pop(node_id, None)
                self._check_node(node_id)
            elif ob.slow_logged:
                log.warning("store node %s took the inventory update after %.1fs", node_id, now - ob.slow_since)
            return
        if now - ob.sent_at > FENCE_PROBE_S and not ob.probed and len(self._fence):
            ob.probed = True  # puts wait on this answer: is the node still there?
            self._check_node(node_id)
        if now - ob.slow_since > SLOW_DELIVERY_S and not ob.slow_logged:
            ob.slow_logged = True
            log.warning("store node %s has not answered an inventory update for %.1fs (busy or paused); "
                        "still waiting (its liveness is its heartbeat)", node_id, now - ob.slow_since)
        if now - ob.sent_at > RESEND_AFTER_S:
            handle.cancel()
            with self._outbox_cv:
                ob.failed(now, RETRY_BACKOFF_S)

    def flush_inventory(self, timeout_s: float = 10.0) -> bool:
        """Wait until every mounted store node has applied what it is owed (tests)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:  # effects queued by calls in progress reach the outboxes
                pass
            with self._outbox_cv:
                if not any(ob.busy() for ob in self._outboxes.values() if ob.mounted):
                    return True
            time.sleep(0.005)
        return False

    def _peer(self, node_id: str):
        """The endpoint to a store node (delivery and probe threads only; connects without
        the lock: the RPC handler runs on the progress thread and may be waiting for it)."""
        peer = self._peers.get(node_id)
        if peer is None:
            with self._lock:
                node = self.state._nodes.get(node_id)
                address = node.address if node is not None else None
            if address is None:
                return None
            try:
                peer = self._peers[node_id] = self.engine.connect(address)
            except MooncakeRayError as e:
                log.warning("cannot reach store node %s: %s", node_id, e)
                return None
        return peer

    # --------------------------------------------------------------- lifecycle door --
    def rpc_address(self) -> bytes:
        return self.engine.address

    def node_key(self) -> bytes:
        """The key store nodes sign their calls with (a Ray call: only Ray cluster members
        reach it; store nodes fetch it before they mount)."""
        return self._node_key

    def mount(self, info: dict, inventory: list | dict, mount_id: int = 0) -> str:
        """A store node (re)joins with what it holds. Returns this master's incarnation.

        A node this master unmounted (silent past ``node_ttl_s``) that comes back as the
        same incarnation is first brought up to date: whatever it was owed and may not have
        applied (puts acknowledged, values dropped meanwhile) is applied to its inventory
        here and sent to it again, so its keys come back and nothing dropped returns.
        A repeat of an older mount of the same incarnation is ignored. ``inventory``:
        entry lists, or their packed form (``store.inventory.pack``, what nodes send)."""
        ring = (info.pop("commit_ring", ""), info.pop("commit_ring_epoch", 0), info.pop("pid", 0),
                info.pop("pid_ns", ""))
        node = NodeInfo(**info)
        with self._lock:
            cur = self.state._nodes.get(node.node_id)
            known = cur is not None and cur.incarnation == node.incarnation
            with self._outbox_cv:
                old = self._outboxes.get(node.node_id)
                plan = plan_mount(old, node.incarnation, mount_id, known, inventory)
                if plan is None:
                    return self.incarnation
                inventory, self._outboxes[node.node_id] = plan
                self._outbox_cv.notify()
            self._peers.pop(node.node_id, None)
            self.state.mount(node, inventory)
            self._deliver()
            if old is not None and old.incarnation != node.incarnation:
                self._lose({node.node_id})  # a new process: the old one's replicas are gone
            self._attach_ring(node, *ring)
        rejoined = old is not None and old.incarnation == node.incarnation and not known
        log.info("mounted store node %s (%d bytes, %d objects, mount %d%s)", node.node_id, node.capacity,
                 len(inventory["keys"]) + len(inventory["rest"]) if isinstance(inventory, dict) else len(inventory),
                 mount_id, ", rejoining" if rejoined else "")
        return self.incarnation

    @ray.method(concurrency_group=LIVENESS_GROUP)
    def heartbeat(self, node_id: str, incarnation: str, mount_id: int = 0, spill_used: int | None = None,
                  spill_degraded: str | None = None) -> bool:
        """A store node is alive. False: it must (re)mount with its inventory.

        Answered without the state lock (it writes only the node's liveness fields), on a
        thread of its own, so a master busy with RPCs, eviction or a large mount still
        hears every heartbeat."""
        ob = self._outboxes.get(node_id)
        if ob is None or not ob.accepts(incarnation, mount_id):
            return False
        return self.state.heartbeat(node_id, incarnation, spill_used, spill_degraded)

    def unmount(self, node_id: str) -> int:
        with self._lock:
            self._peers.pop(node_id, None)
            with self._outbox_cv:
                self._outboxes.pop(node_id, None)
            lost = self.state.unmount(node_id, "unmounted by request")
            self._lose({node_id})
            return lost

    # ------------------------------------------------------------------- drains --
    def drain_begin(self, node_id: str) -> bool:
        """A store node's Ray node is draining: take no new values there (``drain.py``)."""
        with self._lock:
            ok = self.state.drain_begin(node_id)
        if ok:
            log.warning("store node %s is draining: moving its values to the other nodes", node_id)
        return ok

    def drain_plan(self, node_id: str, max_bytes: int) -> list:
        with self._lock:
            return self.state.drain_plan(node_id, int(max_bytes))

    def drain_done(self, node_id: str, items: list) -> None:
        with self._lock:
            self.state.drain_done(node_id, items)

    # ------------------------------------------------------------------ repairs --
    def repair_round(self, node_id: str, report: list, max_bytes: int) -> list:
        """A store node's repair step (``repairs.py``): the copies it made since its last
        step (``[key, gen, dst_node, dst_offset, ok]`` each), then the next ones it is to
        make, in one call (each Ray call costs both sides about a millisecond of CPU).
        Asked every few hundred milliseconds by each node; answered without the lock while
        nothing is reported and nothing is due."""
        if not report and not self.state.repairs.due():
            return []
        with self._lock:
            if report:
                self.state.repair_done(report)
            return self.state.repair_plan(node_id, int(max_bytes))

    def drain_end(self, node_id: str) -> dict:
        """Finish a drain: unmount the node; returns what was moved and what was lost."""
        with self._lock:
            self._peers.pop(node_id, None)
            with self._outbox_cv:
                self._outboxes.pop(node_id, None)
            report = self.state.drain_end(node_id)
            self._lose({node_id})
        self._events.append({"event": "drained", "time": time.time(), **report})
        log.warning("store node %s drained: %d keys (%d bytes) moved, %d keys (%d bytes) lost", node_id,
                    report["moved_keys"], report["moved_bytes"], report["lost_keys"], report["lost_bytes"])
        return report

    def events(self) -> list:
        """The store's membership events, oldest first (at most 100): joins, drains (moved /
        lost keys and bytes), re-adoptions of a restarted node's arena."""
        return list(self._events)

    def note_event(self, event: dict) -> None:
        """A store node reports a membership event (a re-adopted arena)."""
        self._events.append(dict(event))
        if event.get("event") == "readopted":
            with self._lock:
                self.state.counters["readoptions"] += 1
                self.state.counters["readopted_keys"] += int(event.get("keys", 0))
                self.state.counters["readopt_dropped_keys"] += int(event.get("dropped", 0))


    def _join_loop(self) -> None:
        """Master shard 0: give a store node to every Ray node that joins (``elastic.join``)."""
        skip: dict[str, float] = {}
        while not self._stop.wait(self.cfg.elastic.poll_s):
            try:
                for node_id in join_new_nodes(self.cfg, skip):
                    self._events.append({"event": "joined", "time": time.time(), "node_id": node_id})
                    with self._lock:
                        self.state.counters["joins"] += 1
            except Exception:  # keep watching: a GCS hiccup must not end joins
                log.exception("looking for joined Ray nodes failed")

    def stats(self) -> dict:
        with self._lock:
            return self.state.stats()

    def where(self, keys: list) -> list:
        """``[(node_id, tier, ready), ...]`` per key (tools and tests)."""
        with self._lock:
            return [self.state.where(k) for k in keys]

    def nodes(self) -> list:
        with self._lock:
            return self.state.nodes()

    def node_entries(self, node_id: str) -> list:
        """What this master believes ``node_id`` holds, as inventory entries (tests, tools)."""
        with self._lock:
            return [list(e) for e in self.state.node_entries(node_id)]

    def config(self) -> dict:
        return self.cfg.model_dump()

    def ping(self) -> str:
        return self.incarnation

    def pid(self) -> int:
        """This master's process id (fault-injection tests stop and kill it)."""
        return os.getpid()

    def _tick_loop(self) -> None:
        ttl = self.cfg.master.node_ttl_s
        period = min(1.0, ttl / 4)
        last = time.monotonic()
        while not self._stop.wait(period):
            try:
                with self._lock:
                    now = time.monotonic()
                    if now - last > max(3 * period, ttl / 2):
                        log.warning("master tick ran %.1fs late: giving store nodes time to be heard",
                                    now - last - period)
                        self.state.excuse_silence(ttl / 2)
                    done = self.state.tick()
                    last = time.monotonic()
                    self._deliver()
                    if done["unmounted"]:
                        self._lose(set(done["unmounted"]))
                    stats = self.state.gauges()
                if done["unmounted"]:
                    with self._outbox_cv:  # kept: a node that comes back is owed them
                        for node_id in done["unmounted"]:
                            if node_id in self._outboxes:
                                self._outboxes[node_id].mounted = False
                for node_id in done["unmounted"]:
                    self._peers.pop(node_id, None)
                    log.warning("unmounted store node %s: no heartbeat for over %.1fs (%d keys lost)", node_id,
                                self.cfg.master.node_ttl_s, done["lost"])
                self._metrics.update(stats)
            except Exception:  # keep ticking: a bug here must not stop liveness checks
                log.exception("master tick failed")


def _wake_nodes(namespace: str, node_ids: list[str], shard: int) -> None:
    """Ask each store node to heartbeat master shard ``shard`` now (and so remount): a
    restarted master's rebuild then starts without waiting out the nodes' heartbeat period.
    Best effort: a node not told still remounts at its next heartbeat."""
    for node_id in node_ids:
        try:
            ray.get_actor(store_actor_name(node_id), namespace=namespace).heartbeat_now.remote(shard)
        except Exception as e:  # noqa: BLE001 - gone, or the GCS busy: its heartbeat will do
            log.info("could not wake store node %s: %s", node_id, e)


class _StateLock:
    """The master's lock: a reentrant Python lock, then the read index's mutex. The
    outermost acquire applies what the index did since the last section; the outermost
    release writes the plain objects the section touched back into the index as cold
    records (``table.py``), queues the inventory deltas, hands the generation counter to
    the index, and turns it on (off while the master rebuilds its index)."""

    def __init__(self, state: MasterState, index, deliver, evict_wanted: threading.Event) -> None:
        self._rlock = threading.RLock()
        self._state = state
        self._index = index
        self._deliver = deliver
        self._evict_wanted = evict_wanted
        self.chains_wanted: threading.Event | None = None  # chain messages to send (chainlinks.py)
        self._depth = 0  # changed only by the thread holding _rlock

    def __enter__(self):
        self._rlock.acquire()
        self._depth += 1
        if self._depth == 1:
            self._index.lock()
            try:
                self._state.apply_index_log(*self._index.drain())
            except BaseException:
                self.__exit__()
                raise
        return self

    def python_only(self):
        """The Python lock without the index mutex (only for applying the log)."""
        return self._rlock

    def __exit__(self, *exc) -> None:
        if self._depth == 1:
            state = self._state
            state.flush()
            if state.has_effects():
                self._deliver()
            if state.eviction_due():
                self._evict_wanted.set()
            if self.chains_wanted is not None and state.chain_messages_due():
                self.chains_wanted.set()
            self._index.set_next_gen(state._next_gen)
            self._index.set_enabled(not (state._expected and state.recovering))
            self._index.unlock()
        self._depth -= 1
        self._rlock.release()


def _check_crc(key, crc) -> None:
    """A put's checksum (the CRC-32C its client took in its copy) is None or a u32."""
    if crc is not None and not (type(crc) is int and 0 <= crc < 1 << 32):
        raise InvalidArgumentError(f"put {key!r}: checksum {crc!r} is not a CRC-32C (an int below 2**32)")


def _serve_rpc(master: MasterActor, data: bytes) -> bytes:
    """The master's per-operation RPC handler (on the engine's progress thread)."""
    with master._lock:
        state = master.state
        if state._expected and state.recovering:
            return rpc.pack(rpc.err_entry(MasterUnavailableError(
                "master is rebuilding its index from the store nodes; retry")))
        fenced = state._replicas.fenced = [] if master._durable else None
        state._replicas.ring = [] if master._rings else None
        try:
            reply = rpc.serve_request(master._table, data)
        finally:
            state._replicas.fenced = None
            ring, state._replicas.ring = state._replicas.ring, None
        if state.has_effects():
            master._deliver()
        # Durable through the nodes' commit rings when every value and reservation can go
        # there (store/ring.py), under the lock: before any later change reaches a node.
        if fenced and not (ring and master.index.ring_publish(ring)) and master._hold_reply(data, reply, fenced):
            return b""  # sent once durable
        return reply


def master_actor_class():
    """The master as a Ray actor class; heartbeats run on a concurrency group of their own."""
    return ray.remote(concurrency_groups={LIVENESS_GROUP: 1})(MasterActor)
