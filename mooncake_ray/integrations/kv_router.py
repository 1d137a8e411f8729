"""A Ray Serve request router for Ray Serve LLM that knows where KV cache is.

Switch it on in an LLM deployment that carries the ``MooncakeRayConnector``::

    deployment_config:
      request_router_config:
        request_router_class: mooncake_ray.integrations.kv_router:MooncakeKVRouter

(``serve_configs/vllm-aggregated.yaml`` does; in a prefill/decode app, the prefill
deployment's router is the one that matters.) Per request it weighs, for every replica:

- what the replica's engine holds in its own KV cache, from vLLM's KV events
  (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` on a ZMQ publisher the
  connector's Serve backend switches on, one port per replica);
- what the mooncake-ray store holds, which every replica can load: one batched lookup of
  the prompt's chained block hashes (the keys the connector stores blocks under);
- the prefill work the replica has in hand (prompt tokens of the requests routed to it and
  not finished) and its requests in flight; with several ingress replicas (a router each),
  the requests of the others too, as the replica reports them when it accepts one of this
  router's, each counted until that request of this router's finishes, or for one mean
  request time from the report;

and sends the request to the replica of least cost (``_kv_index.choose``: tokens to
compute + ``load_cost`` x tokens to load from the store + queued tokens +
``request_cost`` x requests in flight + the store's pressure x the tokens of the prompt
the replica holding most of it holds and this one does not). The pressure is the share of
the blocks engines hold that the store lacks, read from the router's own lookups
(``_kv_index.StoreCoverage``): 0 while the store holds the working set, so a busy holder
gives way to an idle replica that loads what it lacks; a store below the working set does
not back what a moved conversation leaves behind, and there the holder is kept unless the
queue it has in hand outweighs that. It tokenizes prompts itself, with the model's
tokenizer (Hugging Face ``AutoTokenizer`` from the deployment's model source, the chat
template applied for chat requests).

Nothing here fails a request: no tokenizer, no events, events lost and not replayable, a
store that does not answer -- each only takes that signal out of the cost, down to plain
load balancing. A replica that dies leaves the index.

Each engine learns its own price of a loaded token over a computed one from its steps'
times (``_step_costs``: the connector fits step seconds to the tokens each step computed
and loaded) and publishes it in its record every ``COSTS_EVERY_S``, with the number of loads behind
it. The router weighs that replica's loads by the price blended with ``load_cost``, which
counts as ``PRIOR_LOADS`` loads (``blend_price``): after one load the price is halfway,
after nine nine tenths of the way. A replica whose engine has loaded nothing yet is
weighed by the other engines' loads together, blended the same way (the replicas of one
deployment run one model, mostly on one kind of host).

Router options (``request_router_kwargs``): ``load_cost`` (default 0.4, measured: see
docs/performance.md; the starting value), ``learn_costs`` (true: each engine's learned
price replaces it; false: ``load_cost`` for every replica), ``request_cost`` (64), ``stale_s`` (5.0:
how long an index whose events were lost counts as empty), ``lookup_timeout_s`` (0.5),
``tokenizer`` (a path or model id, when the model source is not one), ``silent_s`` (30:
an engine sent two or more requests that must store new blocks, and not one event batch
from it for this long, has its stream checked: subscribed again and asked for what it
published since; if it does not answer, its index is reset and the replica is routed by
load and the store alone until its events flow again).

Metrics (Ray metrics, on the ingress's node): ``mooncake_router_decisions{reason}``
(engine: to the replica holding the longest prefix; store: for a store hit; load: away
from a holder with too much work; balance: no hit anywhere; no_prompt: no prompt to
tokenize; error), ``mooncake_router_prompt_tokens``,
``mooncake_router_expected_cached_tokens{source=engine|store}`` (compare with the
connector's ``mooncake_connector_engine_hit_tokens`` and ``mooncake_connector_hit_tokens``,
what the engines then reported), ``mooncake_router_event_batches``,
``mooncake_router_event_gaps{outcome=replayed|lost|silent}``, ``mooncake_router_index_blocks{replica}``,
``mooncake_router_load_cost{replica}`` (the learned price in use), ``mooncake_router_store_pressure``,
``mooncake_router_decision_seconds``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import random
import socket
import threading
import time
from typing import Any

from mooncake_ray.integrations import _kv_index as kvi
from mooncake_ray.kv import page_hashes

log = logging.getLogger(__name__)

ROUTER_CLASS = "mooncake_ray.integrations.kv_router:MooncakeKVRouter"
# Calls of ``choose_replicas`` for one request that offer only the best replica (while it
# has room): Serve's queue-length probes of it then get 0.1, 0.2, 0.4 s before the others.
BEST_TRIES = 4
# How often an engine publishes its token costs (``_step_costs``) and a router reads them.
COSTS_EVERY_S = 5.0
# The configured ``load_cost`` counts as this many measured loads against an engine's own.
PRIOR_LOADS = 1.0
# Loads behind a price an engine published without saying (it gave one after 8).
OLD_MIN_LOADS = 8
KV_NAMESPACE = b"mooncake_ray"  # GCS internal KV namespace of the replicas' records
PROBE_S = 1.0  # until a subscription delivers its first live batch, the replay is asked this often
MEAN_S = 1.0  # a request's time from routed to finished, until this router has measured one
END_SEQ = b"\xff" * 8  # vLLM's replay end marker: (-1).to_bytes(8, "big", signed=True)


def blend_price(measured: float, samples: float, configured: float, prior: float = PRIOR_LOADS) -> float:
    """A load price from ``samples`` measured loads averaging ``measured`` and the
    configured price counted as ``prior`` loads."""
    return (samples * measured + prior * configured) / (samples + prior)


# ----------------------------------------------------------------- records ----
def record_key(replica_full_id: str, part: str) -> bytes:
    """GCS key of a replica's record: ``events`` (written by the connector's Serve backend
    before the engine starts) or ``store`` (by the connector, once it knows its key prefixes)."""
    return f"router/{replica_full_id}/{part}".encode()


def put_record(replica_full_id: str, part: str, value: dict) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(record_key(replica_full_id, part), json.dumps(value).encode(),
                                 overwrite=True, namespace=KV_NAMESPACE)


def get_record(replica_full_id: str, part: str) -> dict | None:
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(record_key(replica_full_id, part), namespace=KV_NAMESPACE)
    return json.loads(raw) if raw else None


def list_records() -> dict[str, dict]:
    """Every replica's records (``events`` and ``store`` merged), by replica id; for tools
    and tests that watch the engines as the router does."""
    from ray.experimental import internal_kv

    out: dict[str, dict] = {}
    for key in internal_kv._internal_kv_list(b"router/", namespace=KV_NAMESPACE):
        rid, part = key.decode().removeprefix("router/").rsplit("/", 1)
        rec = get_record(rid, part)
        if rec is not None:
            out.setdefault(rid, {}).update(rec)
    return out


def uses_router(deployment_config: dict | None) -> bool:
    """Whether an LLMConfig's ``deployment_config`` selects this router."""
    rrc = (deployment_config or {}).get("request_router_config")
    if rrc is None:
        return False
    cls = rrc.get("request_router_class") if isinstance(rrc, dict) else getattr(rrc, "request_router_class", None)
    if isinstance(cls, str):
        return cls.replace(":", ".") == ROUTER_CLASS.replace(":", ".")
    return isinstance(cls, type) and issubclass(cls, MooncakeKVRouter)


# Ray's worker processes listen on ports in [min_worker_port, max_worker_port] (Ray's
# defaults), and below them sit the well-known ones (Ray's 6379, 8265, Serve's 8000): the
# publishers' ports are chosen above them.
RAY_WORKER_PORTS = (10002, 19999)


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux's default if
    it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def publisher_ports(node_ip: str, n: int, rng: random.Random | None = None) -> list[int]:
    """``n`` ports free on ``node_ip`` now, for a process that binds them later (vLLM's
    engine core binds its KV event sockets a minute after they are chosen, once it has
    loaded). Drawn at random from above Ray's worker ports and outside the kernel's
    ephemeral range: a port the kernel handed out (``bind(0)``) goes back to the pool it
    takes the local ports of outgoing connections from, and under Ray's many connections
    one of them took it before vLLM bound it (``Address already in use``, the replica
    failed)."""
    rng = rng or random.Random()
    lo, hi = _ephemeral_ports()
    pool = [(a, b) for a, b in ((RAY_WORKER_PORTS[1] + 1, lo - 1), (hi + 1, 65535)) if b - a >= 256]
    ports: list[int] = []
    for _ in range(200 * n):
        if len(ports) == n or not pool:
            break
        a, b = rng.choice(pool)
        port = rng.randint(a, b)
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind((node_ip, port))
            except OSError:
                continue
        ports.append(port)
    while len(ports) < n:  # no room outside those ranges: the kernel's choice
        with socket.socket() as s:
            s.bind((node_ip, 0))
            ports.append(s.getsockname()[1])
    return ports


def events_config(node_ip: str) -> tuple[dict, dict]:
    """(vLLM ``kv_events_config``, the record the router reads) on two free ports of this
    node (``publisher_ports``). vLLM binds its publisher only to a wildcard address (it
    connects out to any other), so the live socket listens on every interface of the node,
    as vLLM's default does; the replay socket binds the node's address."""
    ports = publisher_ports(node_ip, 2)
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{ports[0]}",
           "replay_endpoint": f"tcp://{node_ip}:{ports[1]}"}
    return cfg, {"endpoint": f"tcp://{node_ip}:{ports[0]}", "replay_endpoint": cfg["replay_endpoint"]}


# -------------------------------------------------------------------- feed ----
class _Sub:
    """One replica's event stream: SUB for live batches, DEALER for replays."""

    def __init__(self, ctx, rid: str, rec: dict, index: kvi.ReplicaIndex, replay_timeout_s: float):
        import zmq

        self.rid, self.rec, self.index = rid, rec, index
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(rec["endpoint"])
        self.dealer = None
        self.replay_timeout_s = replay_timeout_s
        self.replaying_until = 0.0
        self.replay: list[tuple[int, bytes]] = []
        self.live: list[tuple[int, bytes]] = []  # held while a replay runs
        self.want_from = 0  # the first batch the running replay asked for
        # Until the subscription has delivered a live batch, a batch published as it was
        # being made can be lost to it (ZMQ's slow joiner) with nothing to show the gap
        # until the engine's next batch, which a quiet engine may not publish for long: the
        # replay socket is asked again every PROBE_S for batches after the last applied.
        self.live_seen = False
        self.probing = False  # the running replay is such a probe
        self.probe_at = 0.0

    def probe_due(self, now: float) -> bool:
        return (not self.live_seen and not self.replaying_until and 0 < self.probe_at <= now
                and self.index.next_seq is not None)

    def close(self) -> None:
        for s in (self.sub, self.dealer):
            if s is not None:
                s.close(linger=0)


class EventFeed:
    """A thread keeping a :class:`~mooncake_ray.integrations._kv_index.ReplicaIndex` per
    replica from its engine's KV events. On connecting, and on a gap in the batch numbers,
    it asks the engine's replay socket for the missing batches; when they cannot be had
    (no answer in ``replay_timeout_s``, or the engine's replay buffer no longer holds them)
    the index is reset and stale for ``stale_s``."""

    def __init__(self, stale_s: float = 5.0, replay_timeout_s: float = 2.0, metrics=None):
        self.stale_s, self.replay_timeout_s = stale_s, replay_timeout_s
        self.indexes: dict[str, kvi.ReplicaIndex] = {}
        self.lock = threading.Lock()  # guards every ReplicaIndex (the feed writes, routing reads)
        self._cmds: queue.Queue = queue.Queue()
        self._subs: dict[str, _Sub] = {}
        self._metrics = metrics
        self.gaps = {"replayed": 0, "lost": 0, "silent": 0}
        self._stop = threading.Event()
        self.rounds = 0  # turns of the thread's loop (each waits up to 50 ms for something to do)
        self._thread = threading.Thread(target=self._run, name="mooncake-kv-events", daemon=True)
        self._thread.start()

    # commands (any thread)
    def add(self, rid: str, rec: dict, block_size: int) -> None:
        with self.lock:
            self.indexes[rid] = kvi.ReplicaIndex(block_size, self.stale_s)
        self._cmds.put(("add", rid, rec))

    def remove(self, rid: str) -> None:
        with self.lock:
            self.indexes.pop(rid, None)
        self._cmds.put(("remove", rid, None))

    def disconnect(self, rid: str) -> None:
        """Close ``rid``'s subscription (its index stays); :meth:`reconnect` opens it again.
        What the engine publishes in between is lost to this feed, as when a link drops."""
        self._cmds.put(("disconnect", rid, None))

    def reconnect(self, rid: str) -> None:
        self._cmds.put(("reconnect", rid, None))

    def resync(self, rid: str) -> None:
        """Subscribe to ``rid`` again and ask its engine for every batch after the last one
        applied: what a dropped link lost comes back; an engine that no longer answers
        leaves the index reset and stale (``replay_timeout_s``)."""
        self._cmds.put(("resync", rid, None))

    def progress(self, rid: str) -> tuple:
        """A mark that changes whenever a batch of ``rid``'s is applied or its index reset."""
        with self.lock:
            idx = self.indexes.get(rid)
            return (None, 0) if idx is None else (idx.next_seq, idx.resets)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def match(self, rid: str, hashes: list[str]) -> int:
        with self.lock:
            idx = self.indexes.get(rid)
            return idx.match(hashes) if idx is not None else 0

    # the thread
    def _run(self) -> None:
        import zmq

        ctx = zmq.Context()
        poller = zmq.Poller()
        parked: dict[str, tuple[dict, kvi.ReplicaIndex]] = {}
        try:
            while not self._stop.is_set():
                self.rounds += 1
                # with nothing subscribed, zmq's poll returns at once: wait on the commands
                for op, rid, rec in self._commands(wait=not self._subs):
                    old = self._subs.pop(rid, None)
                    if old is not None:
                        for s in (old.sub, old.dealer):
                            if s is not None:
                                poller.unregister(s)
                        old.close()
                    if op == "disconnect" and old is not None:
                        parked[rid] = (old.rec, old.index)
                        continue
                    if op == "resync" and old is not None:  # subscribed or parked: subscribe afresh
                        parked[rid] = (old.rec, old.index)
                    if op in ("reconnect", "resync"):
                        if rid not in parked:
                            continue
                        rec, index = parked.pop(rid)
                    elif op == "add":
                        with self.lock:
                            index = self.indexes.get(rid)
                        if index is None:
                            continue
                    else:
                        parked.pop(rid, None)
                        continue
                    try:
                        sub = _Sub(ctx, rid, rec, index, self.replay_timeout_s)
                    except zmq.ZMQError as e:
                        log.warning("KV events of replica %s: cannot subscribe to %s: %s", rid, rec.get("endpoint"), e)
                        continue
                    self._subs[rid] = sub
                    poller.register(sub.sub, zmq.POLLIN)
                    # the engine published before we connected: ask for everything it keeps
                    start = 0 if index.next_seq is None else index.next_seq
                    self._ask_replay(ctx, poller, sub, start)
                events = dict(poller.poll(50)) if self._subs else {}
                now = time.monotonic()
                for sub in list(self._subs.values()):
                    if sub.dealer is not None and sub.dealer in events:
                        self._on_replay(sub)
                    if sub.sub in events:
                        while True:
                            try:
                                _topic, seq_b, payload = sub.sub.recv_multipart(zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            except ValueError:
                                continue
                            sub.live_seen = True
                            self._on_live(ctx, poller, sub, int.from_bytes(seq_b, "big"), payload)
                    if sub.replaying_until and now > sub.replaying_until:
                        if sub.probing:
                            self._drop_probe(poller, sub)
                        else:
                            self._end_replay(sub, complete=False)
                    if sub.probe_due(now):
                        self._ask_replay(ctx, poller, sub, sub.index.next_seq, probe=True)
        except Exception:  # noqa: BLE001 - the router degrades to load balancing
            log.exception("KV event feed stopped; routing goes on without engine residency")
            with self.lock:
                for idx in self.indexes.values():
                    idx.reset()
        finally:
            for sub in self._subs.values():
                sub.close()
            ctx.destroy(linger=0)

    def _commands(self, wait: bool):
        """The commands queued (``add``, ``remove``, ...), the first waited for up to 50 ms
        if ``wait``."""
        try:
            yield self._cmds.get(timeout=0.05) if wait else self._cmds.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                yield self._cmds.get_nowait()
            except queue.Empty:
                return

    def _ask_replay(self, ctx, poller, sub: _Sub, start: int, probe: bool = False) -> None:
        import zmq

        rep = sub.rec.get("replay_endpoint")
        if not rep:
            if start > 0 or sub.index.next_seq is not None:
                self._lost(sub)
            return
        if sub.dealer is None:
            sub.dealer = ctx.socket(zmq.DEALER)
            sub.dealer.setsockopt(zmq.LINGER, 0)
            sub.dealer.connect(rep)
            poller.register(sub.dealer, zmq.POLLIN)
        sub.replay, sub.replaying_until, sub.want_from = [], time.monotonic() + self.replay_timeout_s, start
        sub.probing = probe
        sub.dealer.send_multipart((b"", start.to_bytes(8, "big")))

    def _on_live(self, ctx, poller, sub: _Sub, seq: int, payload: bytes) -> None:
        if sub.replaying_until:
            sub.live.append((seq, payload))
            return
        if sub.index.gap(seq):
            sub.live.append((seq, payload))
            self._ask_replay(ctx, poller, sub, sub.index.next_seq)
            if not sub.replaying_until:  # no replay socket
                self._drain(sub)
            return
        self._apply(sub, seq, payload)

    def _on_replay(self, sub: _Sub) -> None:
        import zmq

        while True:
            try:
                frames = sub.dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) == 5:
                frames = frames[1:]  # the empty delimiter
            if len(frames) != 4:
                continue
            _topic, seq_b, payload = frames[1], frames[2], frames[3]
            if seq_b == END_SEQ:
                self._end_replay(sub, complete=True)
                return
            sub.replay.append((int.from_bytes(seq_b, "big"), payload))

    def _drop_probe(self, poller, sub: _Sub) -> None:
        """A probe not answered in time (a busy engine): nothing is lost, so nothing is
        reset; its late answer goes with the closed socket, and the probe runs again later."""
        poller.unregister(sub.dealer)
        sub.dealer.close(linger=0)
        sub.dealer, sub.replaying_until, sub.replay, sub.probing = None, 0.0, [], False
        sub.probe_at = time.monotonic() + PROBE_S
        self._drain(sub)

    def _end_replay(self, sub: _Sub, complete: bool) -> None:
        """The replay answered (``complete``) or timed out: apply what came, then the live
        batches held meanwhile. Batches from ``want_from`` on that neither brought are lost."""
        want, got, probe = sub.want_from, sorted(sub.replay), sub.probing
        sub.replaying_until, sub.replay, sub.probing = 0.0, [], False
        if not sub.live_seen:
            sub.probe_at = time.monotonic() + PROBE_S
        first = got[0][0] if got else (min(sub.live)[0] if sub.live else None)
        if not complete or (first is not None and first > want):
            self._lost(sub)
        else:
            if got if probe else want > 0:  # a probe that found nothing is no gap
                self._count_gap("replayed")
            if not got:
                # the engine had nothing from ``want`` on: that is the next batch, so one
                # published before this subscription took (a slow joiner's loss) is
                # brought by a probe (``_Sub.live_seen``) or shows as a gap when the next
                # arrives, and is replayed then
                with self.lock:
                    if sub.index.next_seq is None:
                        sub.index.next_seq = want
        for seq, payload in got:
            self._apply(sub, seq, payload)
        self._drain(sub)

    def _drain(self, sub: _Sub) -> None:
        live, sub.live = sorted(sub.live), []
        for seq, payload in live:
            if sub.index.gap(seq):
                self._lost(sub)
                sub.index.next_seq = seq
            self._apply(sub, seq, payload)

    def _lost(self, sub: _Sub) -> None:
        with self.lock:
            sub.index.reset(None)
        self._count_gap("lost")
        log.warning("KV events of replica %s lost and not replayable: its index restarts empty", sub.rid)

    def count_silent(self) -> None:
        """A stream found silent by the router (``MooncakeKVRouter._check_silent``)."""
        self._count_gap("silent")

    def _count_gap(self, outcome: str) -> None:
        self.gaps[outcome] += 1
        if self._metrics is not None:
            self._metrics.gap(outcome)

    def _apply(self, sub: _Sub, seq: int, payload: bytes) -> None:
        try:
            _ts, events = kvi.decode_batch(payload)
        except ValueError as e:
            log.warning("replica %s: %s", sub.rid, e)
            return
        with self.lock:
            if sub.index.next_seq is None:
                sub.index.next_seq = seq
            sub.index.apply_batch(seq, events)
        if self._metrics is not None:
            self._metrics.batch(sub.rid, sub.index.blocks)


# ----------------------------------------------------------------- metrics ----
class _Metrics:
    """The router's figures: totals counted in process and exported as running totals
    (``mooncake_router_<name>_total``, see ``RunningTotals``) once a second by a
    background thread, with the per-replica index size and the decision-time histogram.
    A decision only updates a dict: no Ray metric call on the request path."""

    TOTALS = {
        "router_decisions": ("Routing decisions by reason", ("reason",)),
        "router_prompt_tokens": ("Prompt tokens routed", ()),
        "router_expected_cached_tokens": ("Prompt tokens the router expected the chosen replica not to compute",
                                          ("source",)),
        "router_event_batches": ("KV event batches applied", ()),
        "router_event_gaps": ("Gaps in KV event streams", ("outcome",)),
    }

    def __init__(self):
        from ray.util import metrics

        from mooncake_ray._private.metrics import RunningTotals, _flush_every

        self.totals = RunningTotals(self.TOTALS)
        self.blocks = metrics.Gauge("mooncake_router_index_blocks", "Blocks indexed per replica",
                                    tag_keys=("replica",))
        self.load_costs = metrics.Gauge("mooncake_router_load_cost",
                                        "Price of a token loaded from the store over one computed, per replica "
                                        "(learned from its engine's steps)", tag_keys=("replica",))
        self.store_pressure = metrics.Gauge(
            "mooncake_router_store_pressure",
            "Share of the blocks engines hold that the store lacks, from this router's lookups (0: the store "
            "backs them all)")
        self._pressure: float | None = None
        self.seconds = metrics.Histogram("mooncake_router_decision_seconds",
                                         "Time to choose a replica (tokenize, hash, store lookup, cost)",
                                         boundaries=[1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0])
        self._lock = threading.Lock()
        self._seconds: list[float] = []
        self._blocks: dict[str, int] = {}
        self._load_costs: dict[str, float] = {}
        _flush_every(self, 1.0, "mooncake-router-metrics")

    def decided(self, reason: str, prompt: int, engine: int, store: int, seconds: float) -> None:
        t = self.totals
        t.add("router_decisions", 1, {"reason": reason})
        if prompt:
            t.add("router_prompt_tokens", prompt)
        if engine:
            t.add("router_expected_cached_tokens", engine, {"source": "engine"})
        if store:
            t.add("router_expected_cached_tokens", store, {"source": "store"})
        with self._lock:
            if len(self._seconds) < 1024:
                self._seconds.append(seconds)

    def batch(self, rid: str, blocks: int) -> None:
        self.totals.add("router_event_batches", 1)
        with self._lock:
            self._blocks[rid] = blocks

    def gap(self, outcome: str) -> None:
        self.totals.add("router_event_gaps", 1, {"outcome": outcome})

    def load_cost(self, rid: str, value: float) -> None:
        with self._lock:
            self._load_costs[rid] = value

    def pressure(self, value: float) -> None:
        self._pressure = value

    def flush(self) -> None:
        with self._lock:
            seconds, self._seconds = self._seconds, []
            blocks = dict(self._blocks)
            load_costs = dict(self._load_costs)
        for v in seconds:
            self.seconds.observe(v)
        for rid, n in blocks.items():
            self.blocks.set(n, tags={"replica": rid})
        for rid, v in load_costs.items():
            self.load_costs.set(v, tags={"replica": rid})
        if self._pressure is not None:
            self.store_pressure.set(self._pressure)
        self.totals.export()


# --------------------------------------------------------------- tokenizer ----
def prompt_text_or_ids(args: list) -> tuple[str, Any] | None:
    """("prompt", str | list[int]) or ("messages", list) from a Serve LLM request's args."""
    for a in args or ():
        for name in ("prompt", "messages"):
            v = a.get(name) if isinstance(a, dict) else getattr(a, name, None)
            if v is not None:
                return name, v
    return None


class Tokenizer:
    """The model's tokenizer, as vLLM applies it: completions with special tokens, chat
    rendered by the chat template (the deployment's, else the tokenizer's) without."""

    def __init__(self, source: str, chat_template: str | None = None):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(source)
        self.chat_template = chat_template

    def __call__(self, kind: str, value: Any) -> list[int] | None:
        if kind == "prompt":
            if isinstance(value, list):
                if value and all(isinstance(t, int) for t in value):
                    return value
                if len(value) == 1 and isinstance(value[0], str):
                    value = value[0]
                else:
                    return None  # a batch of prompts: no single prefix to route on
            if not isinstance(value, str):
                return None
            return self.tok(value, add_special_tokens=True)["input_ids"]
        msgs = []
        for m in value:
            m = m if isinstance(m, dict) else (m.model_dump() if hasattr(m, "model_dump") else dict(m))
            c = m.get("content")
            if isinstance(c, list):
                c = "".join(p.get("text", "") for p in c if isinstance(p, dict))
            msgs.append({"role": m.get("role", "user"), "content": c or ""})
        text = self.tok.apply_chat_template(msgs, chat_template=self.chat_template, tokenize=False,
                                            add_generation_prompt=True)
        return self.tok(text, add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------ router ----
def _router_base():
    from ray.serve._private.request_router.request_router import RequestRouter

    return RequestRouter


class MooncakeKVRouter(_router_base()):
    """Ray Serve ``RequestRouter`` choosing the replica of least prefill cost given its
    engine cache (KV events) and the shared store (see the module docstring)."""

    def initialize_state(self, load_cost: float = 0.4, request_cost: float = 64.0, stale_s: float = 5.0,
                         lookup_timeout_s: float = 0.5, tokenizer: str | None = None, silent_s: float = 30.0,
                         learn_costs: bool = True, **_unknown):
        if _unknown:
            raise ValueError(f"MooncakeKVRouter: unknown request_router_kwargs {sorted(_unknown)}; allowed: "
                             "load_cost, request_cost, stale_s, lookup_timeout_s, tokenizer, silent_s, learn_costs")
        if not isinstance(learn_costs, bool):
            raise ValueError(f"MooncakeKVRouter: learn_costs must be true or false, got {learn_costs!r}")
        self._learn_costs = learn_costs
        self._costs_read_at = 0.0  # when the engines' costs were last read (every COSTS_EVERY_S)
        self._costs_reading = False
        if not silent_s > 0:
            raise ValueError(f"MooncakeKVRouter: silent_s must be > 0, got {silent_s!r}")
        self._silent_s = float(silent_s)
        # replica -> [since, the feed's progress mark then, requests since]: requests routed
        # there that must make its engine store blocks, and no batch of its applied since
        self._expect: dict[str, list] = {}
        self._model = kvi.CostModel(load_cost=load_cost, request_cost=request_cost)
        self._coverage = kvi.StoreCoverage()  # how much of what the engines hold the store backs
        self._lookup_timeout_s = lookup_timeout_s
        self._tokenizer_source = tokenizer
        self._tok: Tokenizer | None = None
        self._tok_loading = False
        try:
            self._metrics = _Metrics()
        except Exception as e:  # noqa: BLE001 - outside a Ray worker (unit use)
            log.debug("router metrics off: %s", e)
            self._metrics = None
        self._feed = EventFeed(stale_s=stale_s, metrics=self._metrics)
        self._records: dict[str, dict] = {}  # replica full id -> its events + store records
        self._missing: set[str] = set()  # replicas whose records are not there yet
        self._looked_at = 0.0  # when the routing path last read the GCS for them (at most once a second)
        self._block_size: int | None = None
        self._store: dict | None = None  # {"namespace", "prefixes"}
        self._client = None
        self._load: dict[str, kvi.Load] = {}
        self._inflight: dict[str, tuple[str, int]] = {}  # internal request id -> (replica, tokens)
        # Other routers' requests (other ingress replicas): a replica reports its requests in
        # flight when it accepts one of ours (Serve's queue-length answer); what it holds
        # beyond ours then counts until that request of ours finishes, or for one mean request
        # time from the report, whichever comes first. (Serve's own
        # queue-length cache keeps them until ten seconds after its last update: it never
        # sees another router's requests finish.)
        self._queue_report: dict[str, tuple[int, float]] = {}  # replica -> (requests it reported, when)
        self._others: dict[str, tuple[int, float]] = {}  # replica -> (others' requests, when seen)
        self._routed_at: dict[str, float] = {}  # internal request id -> when routed
        # A request's mean time from routed to finished: the first one measured, then a
        # moving average (MEAN_S until one is measured). Started at a guess instead, the
        # average kept the guess for many requests: with requests of 0.25 s, another
        # router's request counted as running for 0.85 s after it was reported, and a
        # conversation's later turn went past the idle engine holding it.
        self._mean_s: float | None = None
        # Equal costs go round the replicas (``_ties``), from a point of this router's own.
        self._turn = random.randrange(1 << 30)
        self._mean_tokens: float | None = None  # a request's mean prompt tokens to compute (moving average)
        # internal request id -> (decision, seconds it took, the load it holds on its best
        # replica until routed: (replica, tokens) or None, how many times Serve asked)
        self._pending: dict[str, tuple[kvi.Decision, float, tuple | None, int]] = {}
        self._warned: set[str] = set()

    # ------------------------------------------------------------ replicas ----
    def update_replicas(self, replicas):
        old = set(self._records) | self._missing
        super().update_replicas(replicas)
        new = {r.replica_id.to_full_id_str() for r in replicas}
        for rid in old - new:
            self._forget(rid)
        for rid in new - old:
            self._missing.add(rid)
        self._find_records()

    def on_replica_actor_died(self, replica_id):
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.to_full_id_str())

    def _forget(self, rid: str) -> None:
        self._expect.pop(rid, None)
        self._others.pop(rid, None)
        self._queue_report.pop(rid, None)
        self._records.pop(rid, None)
        self._missing.discard(rid)
        self._load.pop(rid, None)
        self._model.load_costs.pop(rid, None)
        self._feed.remove(rid)

    def _find_records(self) -> None:
        """Read the records of replicas that have none yet (two GCS reads each; retried on
        replica updates and, at most once a second, from the routing path until found)."""
        for rid in list(self._missing):
            try:
                ev, st = get_record(rid, "events"), get_record(rid, "store")
            except Exception as e:  # noqa: BLE001
                self._warn_once("gcs", "cannot read replica records from the GCS: %s", e)
                return
            if ev is None or st is None:
                continue
            self._missing.discard(rid)
            self._records[rid] = {**ev, **st}
            bs = int(st["block_size"])
            if self._block_size is None:
                self._block_size = bs
            elif bs != self._block_size:
                self._warn_once(f"bs{rid}", "replica %s has block size %d, others %d: it is routed by load",
                                rid, bs, self._block_size)
                continue
            if self._store is None:
                self._store = {"namespace": st["namespace"], "prefixes": list(st["prefixes"])}
            self._feed.add(rid, ev, bs)
            if self._tok is None and not self._tok_loading:
                self._load_tokenizer(self._tokenizer_source or ev.get("model_source"), ev.get("chat_template"))

    def _load_tokenizer(self, source: str | None, chat_template: str | None) -> None:
        if not source:
            self._warn_once("tok", "no tokenizer source: routing by load only (set request_router_kwargs.tokenizer)")
            return
        self._tok_loading = True

        def load():
            t0 = time.monotonic()
            try:
                self._tok = Tokenizer(source, chat_template)
                log.info("MooncakeKVRouter: tokenizer %r loaded in %.1f s", source, time.monotonic() - t0)
            except Exception as e:  # noqa: BLE001
                self._warn_once("tok", "cannot load tokenizer %r (%s): routing by load only", source, e)

        threading.Thread(target=load, name="mooncake-router-tokenizer", daemon=True).start()

    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("MooncakeKVRouter: " + msg, *args)

    # ------------------------------------------------------------- routing ----
    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if not candidate_replicas:
            return []
        t0 = time.perf_counter()
        key = before = None
        if pending_request is not None:
            key = pending_request.metadata.internal_request_id
            # Serve calls again for the same request when no replica offered took it: its
            # earlier hold goes before deciding again
            before = self._pending.pop(key, None)
            if before is not None:
                self._release(before[2])
        try:
            dec = await self._decide(candidate_replicas, pending_request)
        except Exception as e:  # noqa: BLE001 - never fail a request for want of a signal
            self._warn_once(f"err{type(e).__name__}", "routing by load after an error: %r", e)
            dec = self._by_load(candidate_replicas, "error")
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        ranked = [[by_id[o.key]] for o in dec.ranked if o.key in by_id]
        if key is None:
            return ranked
        tries = 1 if before is None else before[3] + 1
        if len(self._pending) >= 10_000:  # requests cancelled before they were routed
            self._release(self._pending.pop(next(iter(self._pending)))[2])
        # Decisions made side by side (each awaits its store lookup) must see each
        # other: the best replica holds this request's work from now, not only once Serve
        # reports it routed, or requests sent together all go to the same replica.
        best = dec.ranked[0] if dec.ranked else None
        room = best is not None and best.key in by_id and (
            (self._load.get(best.key) or kvi.Load()).requests < getattr(by_id[best.key], "max_ongoing_requests", 1 << 30))
        held = None if best is None else self._hold(best.key, dec.prompt_tokens - best.hit_tokens)
        self._pending[key] = (dec, time.perf_counter() - t0, held, tries)
        # Serve asks each offered replica for its queue length, 0.1 s at first, doubling on
        # each later try, and takes the next one offered when it does not answer in time. A
        # busy replica answers late, and the next one would lose the cache the decision
        # chose: the best is offered alone for its first BEST_TRIES - 1 tries while it has room
        # by this router's count (a replica full by the count of other routers answers
        # that it is full, at once).
        if tries < BEST_TRIES and room:
            return ranked[:1]
        return ranked

    def _check_silent(self) -> None:
        """Engines whose events stopped though requests that must store blocks went there
        (``silent_s``): their streams are checked again (``EventFeed.resync``)."""
        now = time.monotonic()
        for rid, (since, mark, n) in list(self._expect.items()):
            if self._feed.progress(rid) != mark:
                del self._expect[rid]  # its engine's events flow
            elif n >= 2 and now - since > self._silent_s:
                del self._expect[rid]
                log.warning("MooncakeKVRouter: no KV events from replica %s for %.0f s after %d requests that "
                            "store blocks: subscribing again", rid, now - since, n)
                self._feed.count_silent()
                self._feed.resync(rid)

    def _by_load(self, candidates, reason: str) -> kvi.Decision:
        zero = {r.replica_id.to_full_id_str(): 0 for r in candidates}
        dec = kvi.choose(0, 1, zero, None, self._loads(candidates), self._model, self._ties(candidates))
        dec.reason = reason
        return dec

    def _ties(self, candidates) -> dict:
        """What breaks equal costs: the replicas in a fixed order, rotated by one at each
        decision. New conversations (nothing cached anywhere, engines idle) then spread
        over the engines even when they reach this router one after another; a random
        pick sent four such first turns to one engine one time in eight. Each router
        starts at a point of its own, so several routers do not move in step."""
        ids = sorted(r.replica_id.to_full_id_str() for r in candidates)
        self._turn += 1
        n = len(ids)
        return {rid: (i - self._turn) % n for i, rid in enumerate(ids)}

    def _loads(self, candidates) -> dict:
        out = {}
        now = time.monotonic()
        for r in candidates:
            rid = r.replica_id.to_full_id_str()
            mine = self._load.get(rid) or kvi.Load()
            n, seen = self._others.get(rid, (0, 0.0))
            if n and now - seen > (MEAN_S if self._mean_s is None else self._mean_s):
                n = 0  # most likely finished by now
            out[rid] = kvi.Load(int(mine.tokens + n * (self._mean_tokens or 0)), mine.requests + n)
        return out

    def on_new_queue_len_info(self, replica_id, num_ongoing_requests):
        super().on_new_queue_len_info(replica_id, num_ongoing_requests)
        self._queue_report[replica_id.to_full_id_str()] = (int(num_ongoing_requests), time.monotonic())

    def _read_costs(self) -> None:
        """Each engine's ``load_cost`` as it learned it (its record's ``costs`` part), in a
        thread: the routing path never waits on the GCS for it."""
        try:
            got: dict[str, tuple[float, float]] = {}  # replica -> (its price, loads behind it)
            for rid in list(self._records):
                try:
                    rec = get_record(rid, "costs") or {}
                except Exception as e:  # noqa: BLE001
                    self._warn_once("gcs-costs", "cannot read the engines' token costs from the GCS: %s", e)
                    return
                lc, n = rec.get("load_cost"), rec.get("load_samples", OLD_MIN_LOADS)
                if isinstance(lc, (int, float)) and 0 <= lc <= 1 and isinstance(n, (int, float)) and n >= 1:
                    got[rid] = (float(lc), float(n))
            loads = sum(n for _, n in got.values())
            pooled = sum(lc * n for lc, n in got.values()) / loads if loads else None
            for rid in list(self._records):
                lc, n = got.get(rid, (pooled, loads))
                if lc is None:
                    continue
                price = blend_price(lc, n, self._model.load_cost)
                self._model.load_costs[rid] = price
                if self._metrics is not None:
                    self._metrics.load_cost(rid, price)
        finally:
            self._costs_reading = False

    async def _decide(self, candidates, pending_request) -> kvi.Decision:
        now = time.monotonic()
        if self._missing and now - self._looked_at > 1.0:
            self._looked_at = now
            self._find_records()
        if self._learn_costs and self._records and not self._costs_reading and now - self._costs_read_at > COSTS_EVERY_S:
            self._costs_read_at, self._costs_reading = now, True
            threading.Thread(target=self._read_costs, name="mooncake-router-costs", daemon=True).start()
        got = prompt_text_or_ids(pending_request.args) if pending_request is not None else None
        if got is None or self._tok is None or self._block_size is None:
            if got is not None:
                self._warn_once("notyet", "no %s yet: routing by load", "tokenizer" if self._block_size else "replica records")
            return self._by_load(candidates, "no_prompt")
        tokens = self._tok(*got)
        if not tokens:
            return self._by_load(candidates, "no_prompt")
        bs = self._block_size
        if self._expect:
            self._check_silent()
        hashes = page_hashes(tokens, bs)
        engine = {}
        for r in candidates:
            rid = r.replica_id.to_full_id_str()
            engine[rid] = self._feed.match(rid, hashes) if rid in self._records else 0
        present = await self._lookup(hashes, min(engine.values()) if engine else 0)
        self._coverage.observe(engine, present)
        if self._metrics is not None:
            self._metrics.pressure(self._coverage.pressure)
        return kvi.choose(len(tokens), bs, engine, present, self._loads(candidates), self._model,
                          self._ties(candidates), self._coverage.pressure)

    async def _lookup(self, hashes: list[str], skip: int) -> list[bool] | None:
        """Which of the prompt's blocks the store holds (every rank's value of a block), in
        one batched call; blocks every candidate holds already are not asked (False)."""
        if self._store is None or len(hashes) <= skip:
            return None
        prefixes = self._store["prefixes"]
        ask = [p + h for h in hashes[skip:] for p in prefixes]
        try:
            client = await self._store_client()
            found = await asyncio.wait_for(client.batch_exists_async(ask), self._lookup_timeout_s)
        except Exception as e:  # noqa: BLE001 - a store that does not answer is no store
            self._warn_once("lookup", "store lookup failed (%r): routing without the store this time", e)
            return None
        n = len(prefixes)
        return [False] * skip + [all(found[i * n:(i + 1) * n]) for i in range(len(hashes) - skip)]

    async def _store_client(self):
        if self._client is None:
            from mooncake_ray.integrations import _store

            ns = self._store["namespace"]
            self._client = await asyncio.to_thread(
                _store.store_client, namespace=ns, ray_address=None, store_wait_s=2.0,
                connect_timeout_s=5.0, who="MooncakeKVRouter")
        return self._client

    # -------------------------------------------------------- bookkeeping ----
    def on_request_routed(self, pending_request, replica_id, result):
        rid = replica_id.to_full_id_str()
        key = pending_request.metadata.internal_request_id
        dec, seconds, held, _tries = self._pending.pop(key, (None, 0.0, None, 0))
        self._release(held)
        if dec is None:
            return
        self._routed_at[key] = time.monotonic()
        opt = next((o for o in dec.ranked if o.key == rid), None)
        reason = dec.reason if opt is dec.best else "load"
        compute = dec.prompt_tokens - (opt.hit_tokens if opt else 0)
        self._inflight[key] = self._hold(rid, compute)
        self._mean_tokens = compute if self._mean_tokens is None else self._mean_tokens + 0.2 * (compute - self._mean_tokens)
        report = self._queue_report.pop(rid, None)  # the replica's answer as it accepted this one
        if report is not None and time.monotonic() - report[1] < 1.0:
            self._others[rid] = (max(report[0] - self._load[rid].requests, 0), report[1])
        if self._block_size and compute >= self._block_size and rid in self._records:
            e = self._expect.get(rid)  # its engine will store at least one block: a batch is due
            if e is None:
                self._expect[rid] = [time.monotonic(), self._feed.progress(rid), 1]
            else:
                e[2] += 1
        if self._metrics is not None and opt is not None:
            engine = min(opt.engine_blocks * (self._block_size or 0), opt.hit_tokens)
            self._metrics.decided(reason, dec.prompt_tokens, engine, opt.hit_tokens - engine, seconds)
        elif self._metrics is not None:
            self._metrics.decided(reason, dec.prompt_tokens, 0, 0, seconds)

    def on_request_completed(self, replica_id, internal_request_id):
        self._release(self._inflight.pop(internal_request_id, None))
        routed = self._routed_at.pop(internal_request_id, None)
        if routed is not None:
            took = time.monotonic() - routed
            self._mean_s = took if self._mean_s is None else self._mean_s + 0.2 * (took - self._mean_s)
            # The other routers' requests the replica reported up to this one's acceptance
            # were in flight before it, in an engine that batches them all: with this one
            # finished, they most likely have too. (Kept for a mean request time instead, one
            # of them made a conversation's holder look a request busier just as its next
            # turn came, and the turn went to the other engine.) A later report stays.
            rid = replica_id.to_full_id_str()
            n, seen = self._others.get(rid, (0, 0.0))
            if n and seen <= routed:
                self._others[rid] = (0, seen)
        pending = self._pending.pop(internal_request_id, None)
        if pending is not None:
            self._release(pending[2])

    def _hold(self, rid: str, tokens: int) -> tuple[str, int]:
        """Count a request's work on replica ``rid``; returns what ``_release`` takes back."""
        ld = self._load.setdefault(rid, kvi.Load())
        ld.tokens += tokens
        ld.requests += 1
        return rid, tokens

    def _release(self, held: tuple[str, int] | None) -> None:
        if held is None:
            return
        rid, tokens = held
        ld = self._load.get(rid)
        if ld is not None:
            ld.tokens = max(ld.tokens - tokens, 0)
            ld.requests = max(ld.requests - 1, 0)
