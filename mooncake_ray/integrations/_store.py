"""One store client per process and namespace, shared by the engine integrations (vLLM's
connector, SGLang's HiCache backend, LMCache's plugin): they run inside engine processes
that may not have joined a Ray cluster yet."""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any

from mooncake_ray.errors import ConfigError

_clients: dict[tuple, Any] = {}  # (namespace, device_path) -> client
_clients_lock = threading.Lock()


def _check_reachable(address: str, timeout_s: float, who: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto", "ray://..." and the like: ray.init reports those itself
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(f"{who}: Ray address {address!r} is unreachable ({e})") from None


def store_client(*, namespace: str, ray_address: str | None, store_wait_s: float,
                 connect_timeout_s: float, who: str, device_path: str = "auto"):
    """This process's client of the store in ``namespace``, joining the Ray cluster at
    ``ray_address`` (default: ``RAY_ADDRESS``, then ``auto``) if the process is not in one.
    ``store_wait_s`` bounds how long one store call waits for a restarting master or for
    room; ``device_path`` is the client's (how device memory moves); ``who`` names the
    integration in errors.

    Raises:
        ConfigError: the Ray cluster cannot be reached or joined (naming the address).
        MooncakeRayError: no store runs in ``namespace`` (from ``mooncake_ray.connect``).
    """
    import ray

    import mooncake_ray
    from mooncake_ray._private.rayjoin import join

    with _clients_lock:
        client = _clients.get((namespace, device_path))
        if client is not None:
            return client
        if not ray.is_initialized():
            address = ray_address or os.environ.get("RAY_ADDRESS") or "auto"
            _check_reachable(address, connect_timeout_s, who)
            try:
                join(address, logging_level=logging.WARNING, log_to_driver=False)
            except ConfigError as e:
                raise ConfigError(f"{who}: {e}") from None
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise ConfigError(f"{who}: cannot join the Ray cluster at {address!r}: {e}") from None
        client = mooncake_ray.connect(namespace=namespace, config={
            "namespace": namespace,
            "client": {"master_retry_timeout_s": store_wait_s, "backpressure_timeout_s": store_wait_s,
                       "device_path": device_path}})
        _clients[(namespace, device_path)] = client
        return client
