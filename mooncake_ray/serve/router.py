"""Prefix-aware routing across engine replicas (a Ray Serve request router).

The store (L3) lets any replica hit any cached prefix, but a replica whose own page pool
(L1) already holds the prefix skips even the load. So requests go to the replica that
served the longest prefix of the prompt before, as long as its queue is not longer than
the shortest queue plus ``imbalance``; otherwise to the least loaded replica.

The router remembers, per page hash, which replicas it sent that prefix to (bounded LRU;
the replicas' pools are bounded too, so old entries are guesses that may have gone cold,
which costs a load from L3, never correctness). A request carrying ``pin_replica`` (a
direct KV handoff reserved pages there) goes to that replica while it lives.
"""

from __future__ import annotations

import importlib
import threading
from collections import OrderedDict
from typing import List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from mooncake_ray.kv import page_hashes


def _tokens(req: Optional[PendingRequest]) -> list[int] | None:
    if req is None or not req.args:
        return None
    first = req.args[0]
    return first.get("tokens") if isinstance(first, dict) else None


class _InFlight:
    """Requests routed to each replica and not finished yet, per deployment.

    Serve reports a streaming request complete (``on_request_completed``) as soon as its
    stream is set up, and its queue-length cache follows the same signal, so a replica
    streaming long answers looks idle to a router. The ingress, which consumes the
    streams, says when a request is really done (:func:`request_finished`); routers and
    the ingress of one Serve replica share this process, so they share this registry.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._where: dict[tuple[str, str], str] = {}  # (deployment, request id) -> replica
        self._count: dict[tuple[str, str], int] = {}  # (deployment, replica) -> in flight

    def add(self, deployment: str, request_id: str, replica: str) -> None:
        with self._lock:
            if (deployment, request_id) in self._where:
                return
            self._where[(deployment, request_id)] = replica
            self._count[(deployment, replica)] = self._count.get((deployment, replica), 0) + 1

    def done(self, deployment: str, request_id: str) -> None:
        with self._lock:
            replica = self._where.pop((deployment, request_id), None)
            if replica is not None:
                self._count[(deployment, replica)] -= 1

    def count(self, deployment: str, replica: str) -> int:
        return self._count.get((deployment, replica), 0)

    def forget_replica(self, deployment: str, replica: str) -> None:
        with self._lock:
            self._count.pop((deployment, replica), None)
            for k in [k for k, v in self._where.items() if k[0] == deployment and v == replica]:
                del self._where[k]


_INFLIGHT = _InFlight()


def _inflight() -> _InFlight:
    """The process's one registry. Serve hands the router class to the process that routes
    by value (pickled with the deployment's config), which makes a second copy of this
    module with a registry of its own that the ingress never updates; so both sides use
    the registry of the module that ``import`` finds."""
    return importlib.import_module(__name__)._INFLIGHT


def request_finished(deployment: str, request_id: str) -> None:
    """The ingress is done with ``request_id`` on ``deployment`` (its answer consumed)."""
    _inflight().done(deployment, request_id)


def _request_id(req: Optional[PendingRequest]) -> str | None:
    if req is None or not req.args or not isinstance(req.args[0], dict):
        return None
    return req.args[0].get("request_id")


class PrefixAwareRouter(RequestRouter):
    def initialize_state(self, page_size: int = 16, imbalance: int = 4, max_entries: int = 200_000):
        self._page_size, self._imbalance, self._max = page_size, imbalance, max_entries
        self._owners: OrderedDict[str, set] = OrderedDict()
        self._hashes: dict[str, list[str]] = {}

    def _queue(self, r: RunningReplica) -> int:
        """Requests in flight on ``r``: this process's own count (streams included), or
        Serve's cached queue length where that is higher (requests other ingress replicas
        sent)."""
        q = self._replica_queue_len_cache.get(r.replica_id)
        return max(q or 0, _inflight().count(self._deployment_id.name, r.replica_id.unique_id))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        _inflight().forget_replica(self._deployment_id.name, replica_id.unique_id)

    def match(self, hashes: list[str], replica_id: ReplicaID) -> int:
        n = 0
        for h in hashes:
            owners = self._owners.get(h)
            if owners is None or replica_id not in owners:
                break
            n += 1
        return n

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        tokens = _tokens(pending_request)
        if not candidate_replicas:
            return []
        pin = pending_request.args[0].get("pin_replica") if pending_request and pending_request.args \
            and isinstance(pending_request.args[0], dict) else None
        if pin is not None:  # its KV pages wait in that replica's pool (direct handoff)
            pinned = [r for r in candidate_replicas if r.replica_id.unique_id == pin]
            if pinned:
                return [pinned]
        by_load = sorted(candidate_replicas, key=self._queue)
        if not tokens or len(candidate_replicas) == 1:
            return [by_load]
        hashes = page_hashes(tokens, self._page_size)
        self._hashes[pending_request.metadata.request_id] = hashes
        while len(self._hashes) > 10_000:  # requests routed elsewhere never come back here
            self._hashes.pop(next(iter(self._hashes)))
        floor = self._queue(by_load[0]) + self._imbalance
        eligible = [r for r in by_load if self._queue(r) <= floor]
        best = max(eligible, key=lambda r: (self.match(hashes, r.replica_id), -self._queue(r)))
        if self.match(hashes, best.replica_id) == 0:
            return [by_load]
        return [[best], [r for r in by_load if r is not best]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        rid = _request_id(pending_request)
        if rid:
            _inflight().add(self._deployment_id.name, rid, replica_id.unique_id)
        hashes = self._hashes.pop(pending_request.metadata.request_id, None)
        if hashes is None:
            tokens = _tokens(pending_request)
            hashes = page_hashes(tokens, self._page_size) if tokens else []
        for h in hashes:
            owners = self._owners.get(h)
            if owners is None:
                owners = self._owners[h] = set()
            else:
                self._owners.move_to_end(h)
            owners.add(replica_id)
        while len(self._owners) > self._max:
            self._owners.popitem(last=False)
