"""Deploying the store onto a Ray cluster: the master (one actor per shard,
``master.shards``), one store node per Ray node that offers memory, all detached named
actors in the store's namespace (so the store outlives the driver that started it, and
``connect`` finds it from any process)."""

from __future__ import annotations

import logging
import time

import ray

from mooncake_ray.config import StoreConfig
from mooncake_ray.errors import ConfigError, MasterUnavailableError, NodeUnavailableError
from mooncake_ray._private import auth, preflight
from mooncake_ray._private.master.actor import master_actor_class
from mooncake_ray._private.rayjoin import join
from mooncake_ray._private.naming import MASTER_NAME, is_master_name, master_name, store_actor_name
from mooncake_ray._private.shards import merge_stats
from mooncake_ray._private.store_nodes import ACTOR_OPTS, spawn_store_node, store_nodes

log = logging.getLogger(__name__)

_started_ray = False


def ensure_ray(cfg: StoreConfig) -> None:
    """Connect to the configured cluster, the running one, or start an embedded one."""
    global _started_ray
    if ray.is_initialized():
        return
    join(cfg.ray_address, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    _started_ray = True


def _exists(name: str, namespace: str) -> bool:
    try:
        ray.get_actor(name, namespace=namespace)
        return True
    except ValueError:
        return False


def deploy(cfg: StoreConfig, timeout_s: float = 120.0):
    """Create (or find) the master shards and the store nodes; wait until every node is
    mounted on every shard. Returns ``(masters, store_nodes)``: the masters' actor handles,
    shard 0 first.

    Raises:
        ConfigError: the transport settings are rejected, the arenas do not fit in a host's
            memory or a spill directory is unusable (checked before any actor is created),
            or the namespace runs a store with another number of master shards.
        NodeUnavailableError: a store node failed to start (names the cause) or to mount.
    """
    _check_shards(cfg)
    nodes = store_nodes(cfg)
    if cfg.segment_size_bytes == 0:
        nodes = []  # a client-only deployment onto an existing store
    preflight.check_transport(cfg)
    if cfg.transport.auth:
        auth.ensure_secret(cfg.namespace)  # before any member's engine is made
    preflight.check_nodes(cfg, [n for n in nodes if not _exists(store_actor_name(n["NodeID"]), cfg.namespace)])
    masters = [master_actor_class().options(
        name=master_name(shard), max_concurrency=4, **_MASTER_PLACEMENT, **ACTOR_OPTS, namespace=cfg.namespace,
    ).remote(cfg.model_dump(), shard) for shard in range(cfg.master.shards)]
    actors = [spawn_store_node(cfg, n["NodeID"]) for n in nodes]
    deadline = time.monotonic() + timeout_s
    ray.get([m.ping.remote() for m in masters], timeout=timeout_s)
    for n, a in zip(nodes, actors):
        left = max(1.0, deadline - time.monotonic())
        try:
            mounted = ray.get(a.wait_mounted.remote(left), timeout=left + 5)
        except ray.exceptions.RayActorError as e:
            raise NodeUnavailableError(
                f"the store node on Ray node {n['NodeID'][:12]} failed to start: {_cause(e)}") from None
        if not mounted:
            raise NodeUnavailableError(f"a store node did not mount within {timeout_s:.0f}s")
    return masters, actors


# The master shards live on the head node, which the autoscaler never removes and no drain
# takes away: each asks for a sliver of the resource every Ray head offers, and a restarted
# shard goes back there (to a new head too, after a head restart). A soft node affinity is
# not enough: Ray 2.60 places such a zero-CPU actor on another node about half the time,
# and a master on a node that drains or scales down dies with it. "DEFAULT" keeps the
# master out of a placement group the caller runs in (a Ray Serve LLM replica's).
_MASTER_PLACEMENT = dict(resources={"node:__internal_head__": 0.001}, scheduling_strategy="DEFAULT")


def _check_shards(cfg: StoreConfig) -> None:
    """A store already running in the namespace must have the shard count asked for: its
    store nodes split their arenas and clients route keys by it."""
    try:
        running = ray.get_actor(MASTER_NAME, namespace=cfg.namespace)
    except ValueError:
        return
    try:
        have = StoreConfig.model_validate(ray.get(running.config.remote(), timeout=60)).master.shards
    except ray.exceptions.RayError:
        return  # restarting: it keeps the configuration it was made with
    if have != cfg.master.shards:
        raise ConfigError(f"namespace {cfg.namespace!r} runs a store with master.shards={have}, not "
                          f"{cfg.master.shards}: stop it first (`mooncake-ray stop`) or use another namespace")


def _cause(e: BaseException) -> str:
    """The last line of the error an actor's constructor raised (Ray wraps it in its own)."""
    text = str(getattr(e, "error_msg", "") or e).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__


def find_master(namespace: str, shard: int = 0):
    try:
        return ray.get_actor(master_name(shard), namespace=namespace)
    except ValueError:
        raise MasterUnavailableError(
            f"no mooncake-ray store in Ray namespace {namespace!r}: call mooncake_ray.start() "
            "or run `mooncake-ray start`") from None


def store_stats(namespace: str, timeout_s: float = 30.0) -> dict:
    """The store's statistics, summed over its master shards (``shards.merge_stats``),
    and its recent membership events (``events``: joins, drains, re-adoptions).

    Raises:
        MasterUnavailableError: no store in ``namespace``.
        ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError: with one shard, its
            master did not answer (with several, a shard that does not answer is reported
            in ``stats["shards"]`` instead).
    """
    first = find_master(namespace)
    n = StoreConfig.model_validate(ray.get(first.config.remote(), timeout=timeout_s)).master.shards
    events = first.events.remote()
    if n == 1:
        return {**merge_stats([ray.get(first.stats.remote(), timeout=timeout_s)]),
                "events": ray.get(events, timeout=timeout_s)}
    refs = [first.stats.remote()]
    for shard in range(1, n):
        try:
            refs.append(find_master(namespace, shard).stats.remote())
        except MasterUnavailableError as e:
            refs.append(e)
    parts = []
    for shard, ref in enumerate(refs):
        try:
            parts.append(ref if isinstance(ref, dict) else
                         {"error": str(ref)} if isinstance(ref, Exception) else ray.get(ref, timeout=timeout_s))
        except (ray.exceptions.RayError, ValueError) as e:
            parts.append({"error": f"master shard {shard}: {type(e).__name__}: {e}"})
    try:
        evs = ray.get(events, timeout=timeout_s)
    except ray.exceptions.RayError:
        evs = []
    return {**merge_stats(parts), "events": evs}


def teardown(namespace: str) -> int:
    """Kill the store's actors in ``namespace`` and drop its secret; returns how many."""
    n = 0
    names = [e["name"] for e in ray.util.list_named_actors(all_namespaces=True) if e.get("namespace") == namespace]
    handles = {}
    for name in names:
        if is_master_name(name) or name.startswith(store_actor_name("")):
            try:
                handles[name] = ray.get_actor(name, namespace=namespace)
            except ValueError:
                pass
    # Store nodes delete their arenas' files in shared memory first (store/arena.py).
    released = [h.release.remote() for name, h in handles.items() if not is_master_name(name)]
    if released:
        ray.wait(released, num_returns=len(released), timeout=10)
    # Masters first: shard 0 would otherwise start store nodes again (join_new_nodes).
    for name in sorted(handles, key=lambda name: not is_master_name(name)):
        ray.kill(handles[name], no_restart=True)
        n += 1
    auth.forget_secret(namespace)
    return n
