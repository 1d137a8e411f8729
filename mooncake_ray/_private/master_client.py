"""The client's narrow door to the master: per-operation calls over the transport RPC,
found (and found again after a master restart) through Ray.

Retry rule: a call that fails because the master is unreachable, timed out or is
rebuilding its index is retried, with backoff, until ``master_retry_timeout_s`` has
passed; then it raises :class:`MasterUnavailableError` (retryable). Every operation
sent here is idempotent or made so (see ``rpc.py``), so a retry after a lost reply is
safe.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import ray

from mooncake_ray.errors import (
    EngineClosedError,
    MasterUnavailableError,
    MooncakeRayError,
    NodeUnavailableError,
    TransferError,
)
from mooncake_ray._private import rpc
from mooncake_ray._private.naming import MASTER_NAME


class MasterChannel:
    """Calls to one master actor (``name``: a shard's, ``naming.master_name``)."""

    def __init__(self, engine, namespace: str, retry_timeout_s: float, rpc_timeout_s: float,
                 name: str = MASTER_NAME):
        self._engine = engine
        self._namespace = namespace
        self.name = name
        self._retry_timeout_s = retry_timeout_s
        self._rpc_timeout_s = rpc_timeout_s
        self._lock = threading.Lock()
        self._handle = None
        self._peer = None
        self.incarnation: str | None = None
        self.calls = 0  # RPCs sent (retries of one call count once)

    def handle(self):
        """The master's Ray actor handle (lifecycle calls: stats, nodes, config)."""
        if self._handle is None:
            self._handle = ray.get_actor(self.name, namespace=self._namespace)
        return self._handle

    def _connect(self, deadline: float):
        with self._lock:
            if self._peer is not None:
                return self._peer
            remaining = max(0.5, deadline - time.monotonic())
            address = ray.get(self.handle().rpc_address.remote(), timeout=remaining)
            self._peer = self._engine.connect(address)
            return self._peer

    def _reset(self, peer) -> None:
        with self._lock:
            if self._peer is peer:
                self._peer = None

    def call(self, op: int, *args: Any) -> Any:
        """One RPC to the master, retried across restarts within the retry window."""
        payload = rpc.pack([op, *args])
        self.calls += 1
        peer = self._peer
        if peer is None:
            return self._call_retrying(payload)
        return self._settle(peer, payload, lambda: self._engine.call(
            peer, rpc.MASTER_RPC, payload, timeout_s=self._rpc_timeout_s))

    def start(self, op: int, *args: Any):
        """Sends a call over the current connection without waiting for its reply; pass
        what it returns to ``finish``. None when there is no connection (use ``call``)."""
        peer = self._peer
        if peer is None:
            return None
        payload = rpc.pack([op, *args])
        self.calls += 1
        try:
            return peer, payload, self._engine.call_async(peer, rpc.MASTER_RPC, payload)
        except (NodeUnavailableError, TransferError):
            self._reset(peer)
            return None

    def finish(self, started) -> Any:
        """The reply to a call sent by ``start``; any trouble goes on as ``call`` does."""
        peer, payload, handle = started
        return self._settle(peer, payload, lambda: handle.result(self._rpc_timeout_s), handle.cancel)

    def _settle(self, peer, payload: bytes, fetch, give_up=None) -> Any:
        """The decoded reply ``fetch()`` returns over the current connection (the common
        case); any trouble (unreachable, timed out, the master rebuilding its index)
        takes the slow path, retrying."""
        try:
            data = fetch()
        except (NodeUnavailableError, TransferError):
            if give_up is not None:
                give_up()
            self._reset(peer)
        else:
            try:
                return rpc.decode_reply(data)
            except MasterUnavailableError:
                pass
        return self._call_retrying(payload)

    def try_call(self, op: int, *args: Any) -> Any:
        """One attempt over the current connection, no retry; None if it fails
        (best-effort messages, such as giving slabs back at close)."""
        peer = self._peer
        if peer is None:
            return None
        self.calls += 1
        try:
            data = self._engine.call(peer, rpc.MASTER_RPC, rpc.pack([op, *args]), timeout_s=self._rpc_timeout_s)
            return rpc.decode_reply(data)
        except MooncakeRayError:
            return None

    def _call_retrying(self, payload: bytes) -> Any:
        deadline = time.monotonic() + self._retry_timeout_s
        delay, last = 0.01, None
        while True:
            peer = None
            if not ray.is_initialized():  # asking Ray for the master would start a new Ray instance
                raise MasterUnavailableError("Ray is not running in this process: the master cannot be reached")
            try:
                peer = self._connect(deadline)
                data = self._engine.call(peer, rpc.MASTER_RPC, payload,
                                         timeout_s=min(self._rpc_timeout_s, max(0.05, deadline - time.monotonic())))
            except EngineClosedError:
                raise
            except (NodeUnavailableError, TransferError, ray.exceptions.RayError, ValueError) as e:
                # unreachable, timed out, or restarting (the actor is not found or dead for now)
                last = e
                self._reset(peer)
                if not isinstance(e, (NodeUnavailableError, TransferError)):
                    self._handle = None
            else:
                try:
                    return rpc.decode_reply(data)
                except MasterUnavailableError as e:  # rebuilding its index: come back later
                    last = e
            if time.monotonic() + delay > deadline:
                who = "master" if self.name == MASTER_NAME else f"master {self.name!r}"
                raise MasterUnavailableError(
                    f"{who} did not answer within {self._retry_timeout_s:.0f}s: {last}") from last
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
