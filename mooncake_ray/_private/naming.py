"""Names of the store's Ray actors inside its namespace (the GCS is the metadata service:
actors find each other by name, no etcd)."""

from __future__ import annotations

import ray

MASTER_NAME = "mooncake_master"
STORE_PREFIX = "mooncake_store:"


def master_name(shard: int = 0) -> str:
    """The Ray actor name of a master shard (shard 0 keeps the unsharded store's name)."""
    return MASTER_NAME if shard == 0 else f"{MASTER_NAME}.{shard}"


def is_master_name(name: str) -> bool:
    return name == MASTER_NAME or name.startswith(MASTER_NAME + ".")


def store_actor_name(node_id: str) -> str:
    return STORE_PREFIX + node_id


def store_actor_ids(namespace: str) -> list[str]:
    """Ray node ids of the store-node actors alive in ``namespace``."""
    out = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry.get("namespace") == namespace and entry["name"].startswith(STORE_PREFIX):
            out.append(entry["name"][len(STORE_PREFIX):])
    return out
