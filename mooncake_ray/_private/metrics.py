"""Prometheus metrics through ``ray.util.metrics``: they appear on each Ray node's
metrics endpoint (and so in the Ray dashboard and Grafana) with Ray's ``ray_`` prefix.

Master side: capacity / used / keys per store node and tier, hits (in all and per tier),
misses, evictions, puts, put bytes, offloads and promotions (count and bytes), KV chains
(orphaned pages, chain-tail evictions, lookups answered), membership (joins, drains with
the keys and bytes moved and lost, re-adoptions of restarted nodes' arenas). Client
side: put and get latency histograms (tags ``op`` and ``tier``), keys and bytes moved.

The master's totals (``mooncake_<name>_total``) are gauges set to its running count at
every tick, not Ray counters. Ray 2.60 sends a counter to the node's metrics agent as the
increase since its last export, and an export that fails (the agent is busy: its log says
``Failed to export metrics to the metrics agent``) loses that increase for good; a gauge
carries the whole count every time, so the next export repairs a lost one. ``rate()`` and
``increase()`` work on them as on counters (a master that restarts and rebuilds its state
reads as a counter reset). The client's, the connector's and the KV router's totals are
exported the same way (``RunningTotals``).
"""

from __future__ import annotations

import threading
import time

from ray.util import metrics

_LAT_BOUNDS_S = [2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.5, 1.0, 5.0]


class MasterMetrics:
    COUNTERS = {
        "hits": "Get hits served from DRAM (disk-tier hits: mooncake_tier_hits)",
        "misses": "Get misses",
        "evictions": "Replicas evicted from DRAM",
        "evicted_bytes": "Bytes evicted from DRAM",
        "puts": "Puts published",
        "put_bytes": "Bytes published by puts",
        "offloads": "Objects written to the disk tier",
        "promotions": "Objects read back from the disk tier into DRAM",
        "offload_bytes": "Value bytes written to the disk tier by completed offloads",
        "promotion_bytes": "Value bytes read back into DRAM by completed promotions",
        "node_unmounts": "Store nodes unmounted for missing heartbeats past node_ttl_s",
        "unmount_lost_keys": "Objects lost because the only store node holding them was unmounted",
        "chain_tail_evictions": "KV pages evicted because their parent went (orphans, forced chain evictions)",
        "lookups": "Keys looked up (exists; a lookup takes no lease and is not a use)",
        "joins": "Store nodes started on Ray nodes that joined the running cluster",
        "drains": "Store nodes drained (their Ray node was draining)",
        "drain_moved_keys": "Values moved off draining store nodes",
        "drain_moved_bytes": "Value bytes moved off draining store nodes",
        "drain_lost_keys": "Values lost by drains (no room elsewhere, deadline, or only on the node's disk)",
        "drain_lost_bytes": "Value bytes lost by drains",
        "readoptions": "Restarted store nodes that re-adopted their arena",
        "readopted_keys": "Values a restarted store node kept from its arena",
        "readopt_dropped_keys": "Values a restarted store node dropped: checksum mismatch",
        "readopt_refused": "Re-adopted values the master refused (removed or replaced meanwhile)",
        "repairs": "Copies made to restore values short of copies (a node lost, a put placed short)",
        "repair_bytes": "Value bytes copied by repairs",
        "repair_failures": "Repair copies that failed (planned again)",
        "surplus_copies_dropped": "Copies dropped because a value had more than before its node was lost (the node came back after a repair)",
        "insertion_switches": "Changes of the KV pages' insertion policy (chain_insert adaptive)",
        "shadow_refs": "Sampled references counted by the insertion policy's miniature caches",
        "shadow_hits_recent": "Sampled references the miniature cache inserting at the recent end hit",
        "shadow_hits_old": "Sampled references the miniature cache inserting on probation (old end) hit",
        "chain_messages": "KV chain messages received from other master shards (links, unlinks, parents gone or back)",
    }
    GAUGES = {
        "orphaned_pages": "Stored KV pages whose parent is not stored (dropped at the next eviction or tick; held while the parent may come back with its store node)",
        "chained": "Stored values linked to a parent (KV chains)",
        "chain_remote_children": "Children other master shards hold of this shard's values (KV chains across shards)",
        "under_replicated_keys": "Values with fewer copies than they had or asked for, waiting for a repair",
        "under_replicated_bytes": "Value bytes of the under-replicated values",
        "insert_old": "1 while new KV pages enter the eviction order on probation (old end), 0 at the recent end",
        "insertion_score": "Smoothed hit ratio of the old-end miniature cache less the recent-end one's",
    }
    # ``mooncake_tier_hits_total`` (tag ``tier``): gets served from DRAM (the ``hits`` total)
    # and gets of a value only on disk, promoted into DRAM for it (``disk_hits``).
    TIER_HITS = {"dram": "hits", "disk": "disk_hits"}

    def __init__(self, shard: int = 0) -> None:
        # Every series carries the master shard that exports it (tag ``shard``): a node's
        # capacity and use are the sum over shards of their parts of its arena.
        self._shard = {"shard": str(shard)}
        tags = ("node", "tier", "shard")
        self.capacity = metrics.Gauge("mooncake_capacity_bytes", "Store capacity", tag_keys=tags)
        self.used = metrics.Gauge("mooncake_used_bytes", "Store bytes in use", tag_keys=tags)
        self.keys = metrics.Gauge("mooncake_keys", "Objects held", tag_keys=tags)
        self.pending = metrics.Gauge("mooncake_pending_puts", "Puts in flight", tag_keys=("shard",))
        # stats name -> its per-shard gauge (the totals named ``_total``)
        self.gauges = {name: metrics.Gauge(f"mooncake_{name}", desc, tag_keys=("shard",))
                       for name, desc in self.GAUGES.items()}
        self.gauges.update({name: metrics.Gauge(f"mooncake_{name}_total", desc, tag_keys=("shard",))
                            for name, desc in self.COUNTERS.items()})
        self.tier_hits = metrics.Gauge("mooncake_tier_hits_total", "Get hits per tier (disk: promoted into DRAM)",
                                       tag_keys=("tier", "shard"))

    def update(self, stats: dict) -> None:
        shard = self._shard
        for node_id, node in stats["nodes"].items():
            for tier in ("dram", "disk"):
                t = node[tier]
                tags = {"node": node_id[:12], "tier": tier, **shard}
                self.capacity.set(t["capacity"], tags=tags)
                self.used.set(t["used"], tags=tags)
                self.keys.set(t.get("keys", 0), tags=tags)
        self.pending.set(stats.get("pending", 0), tags=shard)
        for name, gauge in self.gauges.items():
            gauge.set(stats.get(name, 0), tags=shard)
        for tier, name in self.TIER_HITS.items():
            self.tier_hits.set(stats.get(name, 0), tags={"tier": tier, **shard})


def _flush_every(owner, interval_s: float, name: str) -> threading.Thread:
    """A daemon thread calling ``owner.flush()`` every ``interval_s``; it holds the owner
    weakly, so a dropped owner is not kept alive by its thread."""
    import weakref

    ref = weakref.ref(owner)

    def loop() -> None:
        while True:
            time.sleep(interval_s)
            o = ref()
            if o is None:
                return
            try:
                o.flush()
            except Exception:  # metrics must never break the caller
                pass
            del o

    t = threading.Thread(target=loop, name=name, daemon=True)
    t.start()
    return t


class RunningTotals:
    """Totals counted in this process and exported as running totals: gauges named
    ``mooncake_<name>_total`` set to the whole count at every export, as the master's
    are. A Ray counter sends only its increase since the last export, and an export the
    node's metrics agent does not take (``Failed to export metrics to the metrics
    agent``) loses that increase for good; a running total is repaired by the next
    export. Ray keeps a gauge only while it is refreshed (two export intervals), so every
    total is set again at each export, changed or not.

    Every series carries the process it comes from (tag ``pid``): two processes on one
    node exporting the same tags would otherwise overwrite each other. Sum over ``pid``
    (Grafana's ``sum(rate(...))`` does); a process that restarts reads as a counter reset.

    Args:
        specs: name -> (description, tag keys).
    """

    def __init__(self, specs: dict[str, tuple[str, tuple[str, ...]]]) -> None:
        import os

        self._specs = specs
        self._pid = str(os.getpid())
        self._lock = threading.Lock()
        self._totals: dict[tuple[str, tuple], float] = {}
        self._gauges = None

    def add(self, name: str, n: float = 1, tags: dict | None = None) -> None:
        """Adds ``n`` to the total of ``name`` with ``tags`` (the hot path: a dict update)."""
        key = (name, tuple(sorted(tags.items())) if tags else ())
        with self._lock:
            self._totals[key] = self._totals.get(key, 0) + n

    def totals(self) -> dict[tuple[str, tuple], float]:
        """A copy of every running total: (name, sorted tag items) -> total."""
        with self._lock:
            return dict(self._totals)

    def export(self) -> None:
        """Sets every gauge to its running total (from a metrics thread, never per call)."""
        totals = self.totals()
        if not totals:
            return
        if self._gauges is None:
            self._gauges = {name: metrics.Gauge(f"mooncake_{name}_total", desc, tag_keys=(*keys, "pid"))
                            for name, (desc, keys) in self._specs.items()}
        for (name, tags), value in totals.items():
            self._gauges[name].set(value, tags={**dict(tags), "pid": self._pid})


class ClientMetrics:
    """Client-side metrics, aggregated in-process and exported once a second by a
    background thread, so the hot path only appends to a list: a Ray metric call per
    operation would cost more than a 4 KiB get itself. Latencies are sampled (at most
    ``MAX_SAMPLES`` per op, tier and interval) for the histogram; the totals
    (``mooncake_client_ops_total``, ``mooncake_client_bytes_total``) are exact running
    totals (``RunningTotals``).

    The latency histogram's ``tier`` tag says where a call's values came from: ``dram``,
    or ``disk`` when the call promoted at least one value from the disk tier (puts:
    ``dram``)."""

    MAX_SAMPLES = 256
    INTERVAL_S = 1.0
    TOTALS = {
        "client_ops": ("Client calls (keys)", ("op",)),
        "client_bytes": ("Bytes moved by clients", ("direction",)),
    }

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lat: dict[tuple[str, str], list[float]] = {}
        self._ops: dict[str, int] = {}  # since the last flush, folded into ``totals`` there
        self._bytes: dict[str, int] = {"read": 0, "write": 0}
        self.totals = RunningTotals(self.TOTALS)
        self._hist = None
        self._thread = _flush_every(self, ClientMetrics.INTERVAL_S, "mooncake-client-metrics")

    def observe(self, op: str, seconds: float, keys: int = 1, nbytes: int = 0, tier: str = "dram") -> None:
        with self._lock:
            lat = self._lat.setdefault((op, tier), [])
            if len(lat) < self.MAX_SAMPLES:
                lat.append(seconds)
            self._ops[op] = self._ops.get(op, 0) + keys
            if nbytes:
                self._bytes["write" if op in ("put", "batch_put") else "read"] += nbytes

    def fold(self) -> dict[tuple[str, str], list[float]]:
        """Move what was counted since the last call into the running totals; returns the
        latency samples taken meanwhile."""
        with self._lock:
            lat, self._lat = self._lat, {}
            ops, self._ops = self._ops, {}
            nbytes, self._bytes = self._bytes, {"read": 0, "write": 0}
        for op, n in ops.items():
            self.totals.add("client_ops", n, {"op": op})
        for direction, n in nbytes.items():
            if n:
                self.totals.add("client_bytes", n, {"direction": direction})
        return lat

    def flush(self) -> None:
        lat = self.fold()
        if lat and self._hist is None:
            self._hist = metrics.Histogram("mooncake_client_latency_seconds", "Client call latency",
                                           boundaries=_LAT_BOUNDS_S, tag_keys=("op", "tier"))
        for (op, tier), values in lat.items():
            tags = {"op": op, "tier": tier}
            for v in values:
                self._hist.observe(v, tags=tags)
        self.totals.export()


class ConnectorMetrics:
    """An engine connector's figures (vLLM's), exported like the client's: counted in
    process, exported once a second by a background thread.

    Running totals ``mooncake_connector_<name>_total`` (tags ``role``, ``pid``;
    ``RunningTotals``): lookup_tokens (prompt tokens looked up), hit_tokens (of those,
    found in the store), engine_hit_tokens (in the engine's own cache), loaded_bytes,
    saved_bytes, load_failures, save_failures; histogram
    ``mooncake_connector_transfer_seconds`` (tags ``role``, ``op`` = load | save)."""

    NAMES = {
        "lookup_tokens": "Prompt tokens the connector looked up in the store",
        "hit_tokens": "Prompt tokens found in the store (loaded instead of computed)",
        "engine_hit_tokens": "Prompt tokens the engine had in its own KV cache (vLLM's prefix cache)",
        "loaded_bytes": "KV bytes loaded from the store into the engine",
        "saved_bytes": "KV bytes saved from the engine into the store",
        "load_failures": "Block loads that failed (recomputed by the engine)",
        "save_failures": "Block saves that failed (a later miss, nothing else)",
    }

    def __init__(self, role: str) -> None:
        self.role = role
        self._tags = {"role": role}
        self._lock = threading.Lock()
        self._lat: dict[str, list[float]] = {}
        self.totals = RunningTotals({f"connector_{n}": (d, ("role",)) for n, d in self.NAMES.items()})
        self._hist = None
        _flush_every(self, ClientMetrics.INTERVAL_S, "mooncake-connector-metrics")

    def add(self, name: str, n: int = 1) -> None:
        if name in self.NAMES:
            self.totals.add(f"connector_{name}", n, self._tags)

    def observe(self, op: str, seconds: float) -> None:
        with self._lock:
            lat = self._lat.setdefault(op, [])
            if len(lat) < ClientMetrics.MAX_SAMPLES:
                lat.append(seconds)

    def flush(self) -> None:
        with self._lock:
            lat, self._lat = self._lat, {}
        if lat and self._hist is None:
            self._hist = metrics.Histogram("mooncake_connector_transfer_seconds", "Connector load/save time per batch",
                                           boundaries=_LAT_BOUNDS_S, tag_keys=("role", "op"))
        for op, values in lat.items():
            for v in values:
                self._hist.observe(v, tags={"role": self.role, "op": op})
        self.totals.export()
