"""The Ray cluster's membership as the store follows it: which Ray nodes are draining
(Ray's drain API: ``ray drain-node``, the autoscaler's idle termination, preemption
notices), and asking Ray to drain one (tests, tools)."""

from __future__ import annotations

import time

import ray


def draining_nodes() -> dict[str, float]:
    """Ray node id (hex) -> the drain's deadline (Unix seconds; 0.0: none) of every
    draining node, as the GCS reports them."""
    from ray._private import state

    return {node_id: ms / 1000.0 for node_id, ms in state.state.get_draining_nodes().items()}


def drain_ray_node(node_id: str, reason: str = "DRAIN_NODE_REASON_PREEMPTION", deadline_s: float = 0.0,
                   message: str = "mooncake-ray") -> None:
    """Ask Ray to drain node ``node_id`` (what ``ray drain-node`` does), with a deadline
    ``deadline_s`` seconds from now (0: none).

    Raises:
        RuntimeError: Ray refused the drain (e.g. an idle-termination drain of a busy node).
    """
    from ray.core.generated import autoscaler_pb2

    gcs = ray._private.worker.global_worker.gcs_client
    deadline_ms = int((time.time() + deadline_s) * 1000) if deadline_s > 0 else 0
    accepted, why = gcs.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value(reason), message, deadline_ms)
    if not accepted:
        raise RuntimeError(f"Ray refused to drain node {node_id}: {why}")
