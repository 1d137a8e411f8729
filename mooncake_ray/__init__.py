"""mooncake-ray: a distributed KV-cache store for LLM serving, built on Ray and UCX.

    import mooncake_ray
    store = mooncake_ray.start()          # deploy onto the Ray cluster (or an embedded one)
    store.put("k", b"value")
    assert store.get("k") == b"value"
"""

from mooncake_ray.client import Client
from mooncake_ray.config import (
    ClientConfig,
    MasterConfig,
    SpillConfig,
    StoreConfig,
    TransportConfig,
    load_config,
    parse_size,
)
from mooncake_ray.errors import *  # noqa: F401,F403
from mooncake_ray import errors as _errors
from mooncake_ray._private.api import connect, shutdown, start
from mooncake_ray._private.client.staged import device_marker

__version__ = "0.1.0"
__all__ = [
    "start",
    "connect",
    "shutdown",
    "device_marker",
    "Client",
    "StoreConfig",
    "MasterConfig",
    "TransportConfig",
    "SpillConfig",
    "ClientConfig",
    "load_config",
    "parse_size",
    *_errors.__all__,
]
