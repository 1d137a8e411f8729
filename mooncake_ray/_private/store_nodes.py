"""Store node actors: which Ray nodes get one, starting one, and giving one to every Ray
node that joins a running cluster (master shard 0's join loop). Apart from ``deploy`` so
that the master can start store nodes without importing what starts masters."""

from __future__ import annotations

import logging
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from mooncake_ray.config import StoreConfig
from mooncake_ray.errors import ConfigError, NodeUnavailableError
from mooncake_ray._private import elastic, preflight
from mooncake_ray._private.naming import store_actor_name
from mooncake_ray._private.store.actor import StoreNodeActor

log = logging.getLogger(__name__)

# Detached, restarted by Ray wherever it dies, its calls retried: masters and store nodes.
ACTOR_OPTS = dict(lifetime="detached", get_if_exists=True, num_cpus=0, max_restarts=-1, max_task_retries=-1)


def store_nodes(cfg: StoreConfig) -> list[dict]:
    """Ray nodes that get a store node: those with the store resource, else all alive;
    never one Ray is draining (it is leaving)."""
    try:
        leaving = elastic.draining_nodes()
    except Exception:  # noqa: BLE001 - an older GCS: no drains known
        leaving = {}
    alive = [n for n in ray.nodes() if n.get("Alive") and n["NodeID"] not in leaving]
    offering = [n for n in alive if n.get("Resources", {}).get(cfg.store_resource, 0) > 0]
    return offering or alive


def spawn_store_node(cfg: StoreConfig, node_id: str):
    """The store node of Ray node ``node_id`` (created, or the running one): a detached
    actor pinned to that node, restarted there by Ray if its process dies."""
    return ray.remote(StoreNodeActor).options(
        name=store_actor_name(node_id), max_concurrency=4, namespace=cfg.namespace,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False), **ACTOR_OPTS,
    ).remote(cfg.model_dump(), node_id)


def join_new_nodes(cfg: StoreConfig, skip: dict[str, float]) -> list[str]:
    """Give a store node to every Ray node that should have one and has none (a node that
    joined the running cluster). ``skip``: node id -> monotonic time before which a node
    whose probe failed is not probed again (updated here). Returns the Ray node ids that
    got one. Called by master shard 0 every ``elastic.poll_s``."""
    have = {e["name"] for e in ray.util.list_named_actors(all_namespaces=True) if e.get("namespace") == cfg.namespace}
    now = time.monotonic()
    new = [n for n in store_nodes(cfg)
           if store_actor_name(n["NodeID"]) not in have and skip.get(n["NodeID"], 0.0) <= now]
    made = []
    for n in new:
        try:
            preflight.check_nodes(cfg, [n])
        except (ConfigError, NodeUnavailableError) as e:
            skip[n["NodeID"]] = now + 60.0
            log.warning("Ray node %s joined but gets no store node: %s", n["NodeID"][:12], e)
            continue
        spawn_store_node(cfg, n["NodeID"])
        made.append(n["NodeID"])
        log.info("Ray node %s joined: store node started", n["NodeID"][:12])
    return made
