"""Checks ``start()`` runs before it creates any actor, so a configuration the cluster
cannot hold fails within seconds with an error naming the cause, instead of an actor
dying in its constructor (or a pre-faulted arena larger than the host's memory taking the
host down).

- the UCX settings: a transport engine is opened with them in this process;
- on every Ray node that gets a new store node, by a zero-CPU task pinned to it: the
  arenas placed on each host fit in its available memory, and the spill directory is a
  directory this node can create files in.
"""

from __future__ import annotations

import os
import socket
import tempfile

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from mooncake_ray.config import StoreConfig
from mooncake_ray.errors import ConfigError, NodeUnavailableError

MEMORY_HEADROOM = 512 << 20  # left free beside the arenas for the processes of the node
PROBE_TIMEOUT_S = 30.0


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def mem_available() -> int:
    """This host's ``MemAvailable`` in bytes (what can be taken without swapping out)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable line")


def spill_problem(directory: str) -> str | None:
    """Why a store node could not use ``directory`` as its spill directory, or None."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        return f"spill.directory={directory!r} exists and is not a directory"
    try:
        os.makedirs(directory, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix=".mooncake-probe-", dir=directory)
        os.close(fd)
        os.unlink(path)
    except OSError as e:
        return f"spill.directory={directory!r} is not writable: {e.strerror or e}"
    return None


def _probe(spill_dir: str | None) -> dict:
    return {"host": socket.gethostname(), "mem_available": mem_available(),
            "spill": spill_problem(spill_dir) if spill_dir else None}


_probe_task = ray.remote(num_cpus=0, max_retries=0)(_probe)


def check_transport(cfg: StoreConfig) -> None:
    """Open (and close) an engine with the configured transport settings.

    Raises:
        ConfigError: a UCX setting or the protocol is rejected (names the setting).
    """
    from mooncake_ray._private.transport import Engine  # the native module: load on use

    Engine.from_config(cfg.transport, name="preflight").close()


def check_nodes(cfg: StoreConfig, nodes: list[dict]) -> None:
    """Probe the Ray nodes in ``nodes`` (``ray.nodes()`` entries) that are to get a store node.

    Raises:
        ConfigError: the arenas on some host do not fit in its available memory, or a
            spill directory is unusable; the message names the node, the setting and value.
        NodeUnavailableError: a node did not answer the probe in time.
    """
    if not nodes:
        return
    spill_dir = cfg.spill.directory if cfg.spill.enabled else None
    refs = [_probe_task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
            .remote(spill_dir) for n in nodes]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PROBE_TIMEOUT_S)
    problems, per_host = [], {}
    for n, ref in zip(nodes, refs):
        if ref not in ready:
            raise NodeUnavailableError(
                f"Ray node {n['NodeID'][:12]} did not answer the start-up check within {PROBE_TIMEOUT_S:.0f}s")
        got = ray.get(ref)
        if got["spill"]:
            problems.append(f"node {n['NodeID'][:12]} ({got['host']}): {got['spill']}")
        per_host.setdefault((n.get("NodeManagerAddress"), got["host"]), []).append(got["mem_available"])
    seg = cfg.segment_size_bytes
    for (_addr, host), avail in per_host.items():
        need, have = seg * len(avail), min(avail) - MEMORY_HEADROOM
        if need > have:
            problems.append(
                f"segment_size_bytes={seg} ({_gib(seg)}) x {len(avail)} store node(s) on host {host} needs "
                f"{_gib(need)} of DRAM, but only {_gib(max(have, 0))} is available there "
                f"(MemAvailable less {_gib(MEMORY_HEADROOM)} kept free)")
    if problems:
        raise ConfigError("the store cannot start:\n  " + "\n  ".join(problems))
