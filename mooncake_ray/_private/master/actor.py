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
for store nodes go to an outbox under that lock and a delivery thread sends them, in
order, per node (over the same transport). A client's put does not wait for them: the
window in which a just-acknowledged put is not yet in its store node's inventory is one
coalescing interval plus one delivery (about a millisecond). A master killed inside that window loses
those puts on rebuild: they become misses, never wrong bytes (overlapping inventory
entries are resolved in favour of the newer allocation).

Lock order: ``_lock`` (the Python lock, then the index mutex) before ``_outbox_cv``;
nothing is held while calling out.
"""

from __future__ import annotations

import functools
import logging
import threading
import time

import ray

from mooncake_ray.config import StoreConfig
from mooncake_ray.errors import MasterUnavailableError, MooncakeRayError
from mooncake_ray._private import rpc
from mooncake_ray._private.master.state import MasterState, Policy
from mooncake_ray._private.master.types import NodeInfo
from mooncake_ray._private.metrics import MasterMetrics
from mooncake_ray._private.naming import store_actor_ids

log = logging.getLogger(__name__)

INVENTORY_TIMEOUT_S = 2.0
DELIVERY_COALESCE_S = 0.001


class MasterActor:
    def __init__(self, config: dict):
        self.cfg = StoreConfig.model_validate(config)
        self.state = MasterState(Policy.from_config(self.cfg.master))
        t = self.cfg.transport
        from mooncake_ray._private.transport import Engine  # the native module: load on use
        from mooncake_ray._private.native import _native

        self.index = _native.MasterIndex()
        self.index.set_lease_ttl(self.cfg.master.lease_ttl_s)
        self.index.set_max_key_bytes(self.cfg.master.max_key_bytes)
        self.index.set_commits(self.cfg.master.native_calls)
        self.state.index = self.index
        self._lock = _StateLock(self.state, self.index, self._deliver)

        self.engine = Engine(protocol=t.protocol, devices=t.devices, num_lanes=1,
                             ucx_options=t.ucx_options, name="master",
                             serve_linger_us=t.linger_us())
        self._peers: dict[str, object] = {}
        self._metrics = MasterMetrics()
        self.incarnation = f"{time.time_ns():x}"
        ctx = ray.get_runtime_context()
        if ctx.was_current_actor_reconstructed:
            # A restart: rebuild the index from the store nodes' inventories. They notice
            # through their heartbeat (this master does not know them) and remount.
            expected = set(store_actor_ids(self.cfg.namespace))
            self.state.begin_recovery(expected)
            log.warning("master restarted; waiting for store nodes %s to remount", sorted(expected))
        self._table = {
            rpc.PUT_START: self._put_start,
            rpc.PUT_END: lambda items: rpc.per_key(self.state.put_end, items),
            rpc.PUT_REVOKE: lambda items: rpc.per_key(self.state.put_revoke, items),
            rpc.GET: self._get,
            rpc.RELEASE: self._release,
            rpc.EXISTS: lambda keys: [self.state.exists(k) for k in keys],
            rpc.REMOVE: lambda keys, force=False: rpc.per_key(self.state.remove, keys, force),
            rpc.REMOVE_PREFIX: lambda prefix, force=False: self.state.remove_prefix(prefix, force),
            rpc.NODES: self.state.nodes,
            rpc.PIN: lambda items: rpc.per_key(self.state.pin, items),
            rpc.UNPIN: lambda keys: rpc.per_key(self.state.unpin, keys),
            rpc.REPORT_UNREACHABLE: self.state.report_unreachable,
            rpc.PING: lambda *pad: self.incarnation,
            rpc.OFFLOAD_DONE: self.state.offload_done,
            rpc.PROMOTE_DONE: self.state.promote_done,
            rpc.SLAB_GRANT: self._slab_grant,
            rpc.PUT_COMMIT: self._put_commit,
            rpc.SLAB_RETURN: self._return_slabs,
        }
        self._stop = threading.Event()
        self._outbox: list = []
        self._outbox_cv = threading.Condition()
        # Inline: the handler never calls the engine (deliveries have their own thread).
        # A plain function, not the bound method: Ray wraps every method of an actor class
        # in a tracing shim, which would run on every call (~4% of the master's time).
        handler = functools.partial(_serve_rpc, self)
        if self.cfg.master.native_calls:
            self.engine.serve_master(rpc.MASTER_RPC, self.index, handler)
        else:
            self.engine.serve(rpc.MASTER_RPC, handler, inline=True)
        with self._lock:  # enables the index unless the master is rebuilding
            pass
        for target, name in ((self._tick_loop, "master-tick"), (self._delivery_loop, "master-deliver"),
                             (self._apply_loop, "master-apply")):
            threading.Thread(target=target, name=name, daemon=True).start()

    # ------------------------------------------------------------------- RPC door --
    def _put_start(self, items, client_node=None, owner=""):
        # Whole-call, so the client's channel waits and retries (per key it would be an answer).
        self.state._allocation_gate(self.state._clock())
        def one(key, size, replicas=None, upsert=False):
            return self.state.put_start(key, size, replicas, client_node, owner, upsert)

        return rpc.per_key(one, items)

    def _return_slabs(self, ids) -> list:
        return [self.state.slab_return(i) for i in ids]

    def _slab_grant(self, owner, client_node=None, need=0, returns=()):
        self._return_slabs(returns)  # the caller's used-up slabs, piggybacked
        return self.state.slab_grant(owner, client_node, need)

    def _put_commit(self, items, owner, returns=()):
        self._return_slabs(returns)

        def one(key, slab_id, offset, size, upsert=False):
            return self.state.put_commit(key, slab_id, offset, size, upsert, owner)

        return rpc.per_key(one, items)

    def _release(self, done) -> None:
        for key, gen, lease in done:
            self.state.release(key, gen, lease)

    def _get(self, keys, client_node=None, done=None):
        if done:  # leases of the caller's finished reads, piggybacked
            self._release(done)
        return rpc.per_key(self.state.get, keys, client_node)


    def _apply_loop(self) -> None:
        """Apply commits the index answered natively (publish, inventory delta) soon after
        they happen, not at the next Python call: a store node's inventory must follow."""
        while not self._stop.is_set():
            if not self.index.wait_commits(0.5):
                continue
            # Publishing frees nothing, so native calls may go on meanwhile: the Python
            # lock only (and the deltas queued at once). Then under both locks: the rest of
            # the log, and the watermark checks, which may evict, so they must see every
            # lease granted before them.
            with self._lock.python_only():
                self.state.apply_index_log(*self.index.drain(), decide=False)
                self._deliver()
            with self._lock:
                pass

    def _deliver(self) -> None:
        """Queue the state machine's inventory deltas for the delivery thread (lock held)."""
        effects = self.state.drain_effects()
        if effects:
            with self._outbox_cv:
                for node_id, delta in effects.items():
                    self._outbox.append((node_id, [[list(e) for e in delta.add], [list(d) for d in delta.drop],
                                                   [list(o) for o in delta.offload]]))
                self._outbox_cv.notify()

    def _delivery_loop(self) -> None:
        """Send queued deltas, in order, one batch per store node at a time: a node never
        sees deltas out of order, and no client call waits for a store node (a put would
        otherwise pay a second round trip)."""
        while not self._stop.is_set():
            with self._outbox_cv:
                while not self._outbox and not self._stop.is_set():
                    self._outbox_cv.wait(0.5)
            # Coalesce: under a stream of puts, one delivery per millisecond instead of one
            # per put (each costs the master and the store node a Python call).
            time.sleep(DELIVERY_COALESCE_S)
            with self._outbox_cv:
                batch, self._outbox = self._outbox, []
            per_node: dict[str, list] = {}
            for node_id, delta in batch:
                per_node.setdefault(node_id, []).append(delta)
            calls, ids = [], []
            for node_id, deltas in per_node.items():
                peer = self._peer(node_id)
                if peer is not None:
                    calls.append((peer, rpc.NODE_INVENTORY_RPC, rpc.pack(deltas)))
                    ids.append(node_id)
            if not calls:
                continue
            results = self.engine.call_many(calls, timeout_s=INVENTORY_TIMEOUT_S)
            for node_id, res in zip(ids, results):
                if isinstance(res, BaseException):
                    log.warning("store node %s missed an inventory update (%s); marking it suspect",
                                node_id, res)
                    with self._lock:
                        self._peers.pop(node_id, None)
                        self.state.report_unreachable(node_id)

    def flush_inventory(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued inventory delta was handed to its store node (tests)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._outbox_cv:
                if not self._outbox:
                    return True
            time.sleep(0.005)
        return False

    def _peer(self, node_id: str):
        """The endpoint to a store node (delivery thread only; connects without the lock:
        the RPC handler runs on the progress thread and may be waiting for that lock)."""
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

    def mount(self, info: dict, inventory: list) -> str:
        """A store node (re)joins with what it holds. Returns this master's incarnation."""
        node = NodeInfo(**info)
        with self._lock:
            self._peers.pop(node.node_id, None)
            self.state.mount(node, inventory)
            self._deliver()
        log.info("mounted store node %s (%d bytes, %d objects)", node.node_id, node.capacity,
                 len(inventory))
        return self.incarnation

    def heartbeat(self, node_id: str, incarnation: str, spill_used: int | None = None,
                  spill_degraded: str | None = None) -> bool:
        with self._lock:
            return self.state.heartbeat(node_id, incarnation, spill_used, spill_degraded)

    def unmount(self, node_id: str) -> int:
        with self._lock:
            self._peers.pop(node_id, None)
            return self.state.unmount(node_id, "unmounted by request")

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

    def config(self) -> dict:
        return self.cfg.model_dump()

    def ping(self) -> str:
        return self.incarnation

    def _tick_loop(self) -> None:
        period = min(1.0, self.cfg.master.node_ttl_s / 4)
        while not self._stop.wait(period):
            try:
                with self._lock:
                    done = self.state.tick()
                    self._deliver()
                    stats = self.state.gauges()
                for node_id in done["unmounted"]:
                    self._peers.pop(node_id, None)
                    log.warning("unmounted silent store node %s (%d keys lost)", node_id, done["lost"])
                self._metrics.update(stats)
            except Exception:  # keep ticking: a bug here must not stop liveness checks
                log.exception("master tick failed")


class _StateLock:
    """The master's lock: a reentrant Python lock, then the read index's mutex. The
    outermost acquire applies what the index did since the last section; the outermost
    release queues the inventory deltas, hands the generation counter to the index, and
    turns it on (off while the master rebuilds its index)."""

    def __init__(self, state: MasterState, index, deliver) -> None:
        self._rlock = threading.RLock()
        self._state = state
        self._index = index
        self._deliver = deliver
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
            if state._effects:
                self._deliver()
            self._index.set_next_gen(state._next_gen)
            self._index.set_enabled(not (state._expected and state.recovering))
            self._index.unlock()
        self._depth -= 1
        self._rlock.release()


def _serve_rpc(master: MasterActor, data: bytes) -> bytes:
    """The master's per-operation RPC handler (on the engine's progress thread)."""
    with master._lock:
        state = master.state
        if state._expected and state.recovering:
            return rpc.pack(rpc.err_entry(MasterUnavailableError(
                "master is rebuilding its index from the store nodes; retry")))
        reply = rpc.serve_request(master._table, data)
        if state._effects:
            master._deliver()
        return reply


def master_actor_class():
    return ray.remote(MasterActor)
