"""``start`` / ``connect`` / ``shutdown``: the entry points re-exported by the package."""

from __future__ import annotations

import threading
import weakref

import ray

from mooncake_ray.client import Client
from mooncake_ray.config import StoreConfig, load_config
from mooncake_ray._private import deploy

_clients: "weakref.WeakSet[Client]" = weakref.WeakSet()
_lock = threading.Lock()


def start(config=None) -> Client:
    """Deploy the store onto the Ray cluster this process is connected to (or the one in
    ``config.ray_address``, or a new embedded local one, as ``ray.init()`` does) and return
    a client. Idempotent: a store already running in the namespace is reused.

    Args:
        config: a StoreConfig, a dict, a YAML/JSON file path, or None for defaults;
            ``MOONCAKE_RAY_*`` and Mooncake's own environment variables override it.

    Raises:
        ConfigError: naming each bad field, its value and what is allowed.
        NodeUnavailableError: a store node did not come up.
    """
    cfg = load_config(config)
    deploy.ensure_ray(cfg)
    with _lock:
        deploy.deploy(cfg)
    return connect(namespace=cfg.namespace, config=cfg)


def connect(namespace: str | None = None, config=None) -> Client:
    """A client of a running store (found by name in its Ray namespace). The store's own
    configuration is used; ``config`` may only change client-side settings."""
    cfg = load_config(config) if not isinstance(config, StoreConfig) else config
    deploy.ensure_ray(cfg)
    ns = namespace or cfg.namespace
    master = deploy.find_master(ns)
    deployed = StoreConfig.model_validate(ray.get(master.config.remote(), timeout=60))
    deployed = deployed.model_copy(update={"client": cfg.client})
    client = Client(deployed)
    _clients.add(client)
    return client


def shutdown(namespace: str | None = None, *, stop_ray: bool | None = None) -> None:
    """Close this process's clients, remove the store's actors from the cluster, and stop
    Ray if ``start`` started it (or if ``stop_ray`` says so)."""
    for c in list(_clients):
        c.close()
    if ray.is_initialized():
        deploy.teardown(namespace or StoreConfig().namespace)
        if stop_ray or (stop_ray is None and deploy._started_ray):
            ray.shutdown()
            deploy._started_ray = False
