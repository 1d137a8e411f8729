"""The client's table of store nodes: a connection and the imported arena of each mounted
node's current incarnation, refreshed from the master when a descriptor names one it does
not know."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from mooncake_ray.errors import MooncakeRayError, NodeUnavailableError, NotRegisteredError, TransferError
from mooncake_ray._private import rpc
from mooncake_ray._private.store.arena import local_mapping

# What a transfer to or from a node raises when the node (or this client's view of it) fails.
TRANSFER_ERRORS = (NodeUnavailableError, TransferError, NotRegisteredError)


@dataclass
class Node:
    node_id: str
    incarnation: str
    peer: Any
    region: Any  # RemoteRegion of the node's arena


class NodeTable:
    """The store nodes this client has connected to, by node id (thread-safe). ``master``
    is the channel its refreshes ask; ``others``, the other master shards' (told of an
    unreachable node too). ``via`` gives another shard's view of the same table."""

    def __init__(self, engine, master, others=(), *, _shared: "NodeTable | None" = None):
        self._engine = engine
        self._master = master
        self._others = list(others)
        self._nodes: dict[str, Node] = {} if _shared is None else _shared._nodes
        self._lock = threading.Lock() if _shared is None else _shared._lock

    def via(self, master, others=()) -> "NodeTable":
        """The same nodes and connections, refreshed from ``master`` (a master shard's
        channel): a shard that is down never holds up another shard's reads and writes."""
        return NodeTable(self._engine, master, others, _shared=self)

    def peek(self, node_id: str) -> Node | None:
        """The cached view of a node, if any (never asks the master)."""
        return self._nodes.get(node_id)

    def get(self, node_id: str, inc: str | None = None, refresh: bool = False) -> Node:
        """The cached view of a store node; refreshed from the master when it is missing
        or older than incarnation ``inc``.

        Raises:
            NodeUnavailableError: the node is not mounted, or not as incarnation ``inc``.
        """
        node = self._nodes.get(node_id)
        if node is not None and not refresh and (inc is None or node.incarnation == inc):
            return node
        with self._lock:
            infos = {n["node_id"]: n for n in self._master.call(rpc.NODES)}
            for nid, info in infos.items():
                cur = self._nodes.get(nid)
                if cur is not None and cur.incarnation == info["incarnation"]:
                    continue
                peer = self._engine.connect(info["address"])
                region = self._engine.import_remote(peer, info["rkey"], info["base"], info["capacity"],
                                                    *local_mapping(info, self._engine.protocol))
                self._nodes[nid] = Node(nid, info["incarnation"], peer, region)
            for nid in list(self._nodes):
                if nid not in infos:
                    del self._nodes[nid]
        node = self._nodes.get(node_id)
        if node is None:
            raise NodeUnavailableError(f"store node {node_id} is not mounted")
        if inc is not None and node.incarnation != inc:
            raise NodeUnavailableError(f"store node {node_id} restarted (incarnation {inc} is gone)")
        return node

    def report(self, node_id: str) -> None:
        """Tell the master (and, without waiting on a shard that is down, the other master
        shards) that the node is unreachable, best effort, and forget it."""
        try:
            self._master.call(rpc.REPORT_UNREACHABLE, node_id)
        except MooncakeRayError:
            pass
        for other in self._others:
            other.try_call(rpc.REPORT_UNREACHABLE, node_id)
        with self._lock:
            self._nodes.pop(node_id, None)

    def on(self, node_id: str, inc: str, fn):
        """``fn(node)`` on incarnation ``inc`` of a node (the one the master's descriptor
        names). A failure reports the node unreachable and raises; a descriptor naming
        an incarnation that is gone never touches the new one's arena, where its offsets
        may belong to other keys."""
        try:
            return fn(self.get(node_id, inc))
        except TRANSFER_ERRORS:
            self.report(node_id)
            raise
