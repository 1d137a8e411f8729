"""Configuration: pydantic v2 models, validated once, passed to every actor.

Sources, later ones winning: defaults < the config file / dict given to ``start`` <
environment. Environment overrides use one prefix, ``MOONCAKE_RAY_``, with ``__`` between
nesting levels (``MOONCAKE_RAY_MASTER__LEASE_TTL_S=5``), plus an alias table that accepts
Mooncake's own variables so a Mooncake deployment translates without edits
(``MOONCAKE_GLOBAL_SEGMENT_SIZE=16gb``). Hot paths never read the environment.

Sizes accept a number of bytes or a string such as ``"16gb"``, ``"512 MiB"``, ``"4k"``.
Units are binary: ``kb``/``kib``/``k`` = 1024 bytes, ``mb`` = 1024², ``gb`` = 1024³, ``tb``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from mooncake_ray.errors import ConfigError

__all__ = [
    "StoreConfig",
    "MasterConfig",
    "TransportConfig",
    "RdtConfig",
    "SpillConfig",
    "ClientConfig",
    "parse_size",
    "load_config",
    "load_rdt_config",
]

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(value: Any) -> int:
    """Bytes from an int or a string like ``"16gb"``; raises ValueError naming the value."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m:
            raise ValueError(
                f"expected a size like 16gb, 512mb, 4k or a number of bytes, got {value!r}")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise ValueError(f"expected a size like 16gb or a number of bytes, got {value!r}")
    if n < 0:
        raise ValueError(f"a size cannot be negative, got {value!r}")
    return n


Size = Annotated[int, BeforeValidator(parse_size)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


def _split_devices(value: Any) -> Any:
    if isinstance(value, str):  # "eth0,eth1", as UCX_NET_DEVICES spells it
        return [d.strip() for d in value.split(",") if d.strip()]
    return value


Protocol = Literal["auto", "tcp", "shm", "rdma"]
Devices = Annotated[list[str] | None, BeforeValidator(_split_devices)]  # a list or "eth0,eth1"


class TransportConfig(_Model):
    """The native UCX engine (``mooncake_ray._private.transport.Engine``).

    ``Engine.from_config`` carries every field named like a field of the C++
    ``mcr::EngineConfig`` (native/include/mcr/transport.h) into it, so a setting's default
    and doc live here once; the others are read by the Python engine or its callers."""

    protocol: Protocol = "auto"
    """UCX transports: auto (UCX chooses among all but its shared-memory message queues,
    which a sender killed mid-message leaves blocked: on one host messages go over loopback
    tcp, data through shared memory by cma and mapped arenas; tcp/RDMA across hosts), tcp,
    shm (cma and mapped arenas, messages over tcp on lo), or rdma (rc, ud, cma)."""
    devices: Devices = None
    """Network devices UCX may use (UCX_NET_DEVICES), e.g. ["eth0"] or ["mlx5_0:1"]. None:
    the store's engines use the interface holding their Ray node's address, loopback and
    the RDMA devices, not every interface of the host."""
    num_lanes: int = Field(2, ge=1, le=16)
    """Workers/endpoints (each with its own progress thread) a large transfer is striped
    over. Measured on 2 vCPUs over tcp, 1 -> 2 lanes: 4 MiB push read 3.2 -> 3.6 GB/s, put
    2.4 -> 3.7 GB/s, 64 MiB 3.1 -> 4.8 / 2.6 -> 4.5 GB/s (shared memory: no change; 4
    lanes: no better than 2). Idle lanes sleep."""
    read_mode: Literal["auto", "memcpy", "push", "get"] = "auto"
    """Force a read path (tests, benchmarks); auto picks one per remote region."""
    write_mode: Literal["auto", "memcpy", "put"] = "auto"
    """Force a write path (tests, benchmarks)."""
    ucx_options: dict[str, str] = Field(default_factory=dict)
    """Extra UCX settings passed through (without the UCX_ prefix), e.g. {"RNDV_THRESH": "8k"};
    applied to the engine's own UCX context, never through the environment."""
    chunk_bytes: Size = 4 << 20
    """Stripe unit over lanes and staging piece size (at least 4 KiB; 1-4 MiB measured
    alike over 2 lanes, 16 MiB worse: fewer pieces than lanes in flight)."""
    stripe_min_bytes: Size = 1 << 20
    """Transfers below this stay on one lane."""
    push_min_bytes: Size = 32 << 10
    """In read_mode auto, reads smaller than this use get even where the push path is
    chosen (tcp): one round trip instead of two."""
    staging_bytes: Size = 64 << 20
    """Bounce buffer for unregistered memory (allocated on first use)."""
    spin_us: int = 50
    """A waiting caller progresses the engine itself this long before sleeping."""
    inflight_linger_us: int = 100
    """While an engine's requests are in flight, its progress thread keeps polling until
    no event came for this long (0: sleep after every event)."""
    server_linger_us: int | None = Field(None, ge=0, le=10000)
    """The master's and store nodes' progress threads poll this long after their last
    event before they sleep: a client's next call or read usually comes within it, and a
    wake-up from epoll costs tens of µs on a VM (0: sleep at once). None: 50, or 0 with
    protocol "tcp" (measured on 2 vCPUs: x2.5-3 for same-host 4 KiB gets, -20-30% over
    loopback tcp, whose kernel processing the polling threads starve). Clients' engines
    never linger."""
    keepalive_s: float = 1.0
    """Liveness check interval (same-host pid watchdog, UCX keepalive)."""
    error_mode: Literal["auto", "peer", "none"] = "auto"
    """UCX endpoint error mode. auto uses PEER only for RDMA peers on other hosts: under
    PEER, UCX 1.22 drops shared memory and turns tcp put into software emulation. Dead
    peers are still detected (tcp resets, a pid watchdog on the same host, timeouts)."""
    rpc_threads: int = Field(4, ge=1)
    """Dispatcher threads running an engine's Python RPC handlers."""
    default_timeout_s: float = Field(30.0, gt=0)
    """Timeout of an engine's blocking calls (connect, read, write, call) when the caller
    gives none."""
    transfer_timeout_s: float = Field(30.0, gt=0)
    """The client's timeout for reads and writes."""
    rpc_timeout_s: float = Field(5.0, gt=0)
    """The client's and store nodes' timeout for calls to the master."""
    auth: bool = True
    """Every engine of the store proves it holds the store's secret before a peer answers
    it (docs/internals.md, "Peer authentication"). Off only to measure what it costs."""

    def linger_us(self) -> int:
        """``server_linger_us`` resolved: what a server engine (master, store node) uses."""
        if self.server_linger_us is not None:
            return self.server_linger_us
        return 0 if self.protocol == "tcp" else 50


class RdtConfig(_Model):
    """The Ray Direct Transport plug-in (``mooncake_ray.integrations.ray_rdt``): one engine
    and receive pool per process. Not a section of StoreConfig: each process reads it from
    the arguments of ``ray_rdt.register`` over its environment (``load_rdt_config``):
    ``MOONCAKE_RAY_RDT__PROTOCOL`` and so on, or the plug-in's older names
    ``MOONCAKE_RDT_PROTOCOL``, ``MOONCAKE_RDT_DEVICES``, ``MOONCAKE_RDT_RECV_POOL_BYTES``,
    ``MOONCAKE_RDT_TIMEOUT_S``."""

    protocol: Protocol = "auto"
    """As ``transport.protocol``."""
    devices: Devices = Field(default_factory=lambda: ["lo"])
    """UCX devices, default the loopback device; empty (or "") = UCX's default."""
    recv_pool_bytes: Size = 1 << 30
    """Limit of the receive pool: pre-faulted arenas received tensors are carved from
    (0 disables it: tensors are then allocated and registered per read)."""
    timeout_s: float = Field(60.0, gt=0)
    """Connect and transfer timeout when Ray gives none."""


class SpillConfig(_Model):
    """The NVMe spill tier of each store node (off unless a directory is given)."""

    enabled: bool = False
    directory: str | None = None
    capacity_bytes: Size = 0
    """0 = use what the filesystem has free at start, minus 5%."""
    high_watermark: float = Field(0.9, gt=0, le=1)
    evict_ratio: float = Field(0.05, gt=0, le=1)
    queue_depth: int = Field(32, ge=1, le=4096)
    use_uring: bool = True

    @model_validator(mode="after")
    def _needs_directory(self) -> "SpillConfig":
        if self.enabled and not self.directory:
            raise ValueError("spill.enabled is true but spill.directory is not set")
        return self


class ElasticConfig(_Model):
    """How the store follows the Ray cluster's size (``docs/internals.md``, "Elastic store")."""

    join: bool = True
    """A Ray node that joins the running cluster (with ``store_resource``, or any node when
    no node offers it) gets a store node within ``poll_s``."""
    poll_s: float = Field(2.0, gt=0, le=60)
    """How often the master looks for joined nodes, and a store node for its Ray node's drain."""
    drain: bool = True
    """When Ray drains a node (``ray drain-node``, autoscaler idle termination, a preemption
    notice), its store node takes no new values, moves its most recently used keys to the
    other nodes before the drain's deadline, then unmounts."""
    drain_batch_bytes: Size = 64 << 20
    """Bytes moved per batch of a drain (one master call and one transfer per batch)."""
    drain_no_deadline_s: float = Field(300.0, gt=0)
    """How long a drain without a deadline may take."""
    drain_margin_s: float = Field(1.0, ge=0)
    """A drain stops this long before its deadline, to unmount in time."""
    keep_arena: bool = True
    """The arena lives in named shared memory (``arena_dir``) that outlives the store node's
    process: a store node restarted on the same host re-adopts it, and its keys stay
    readable (each checked against the master's generation and a checksum)."""
    arena_dir: str = "/dev/shm"


class MasterConfig(_Model):
    """Metadata service: leases, pins, eviction, liveness, allocation."""

    lease_ttl_s: float = Field(10.0, gt=0)
    """A get's read lease: the object's extents are neither evicted nor reused meanwhile."""
    soft_pin_ttl_s: float = Field(1800.0, gt=0)
    high_watermark: float | None = Field(None, gt=0, le=1)
    """Eviction starts when the values on a node pass this fraction of its arena. Default:
    0.95, or 0.9 on a node with a spill tier (whose evictions are offloads, and free their
    room only once written to disk)."""
    evict_ratio: float | None = Field(None, gt=0, le=1)
    """Fraction of a node's arena an eviction round frees. Default: 0.02, or 0.05 on a node
    with a spill tier."""
    node_ttl_s: float = Field(5.0, gt=0)
    """A store node silent this long is unmounted and its replicas dropped."""
    heartbeat_interval_s: float = Field(1.0, gt=0)
    put_timeout_s: float = Field(60.0, gt=0)
    """A pending put not ended within this time is revoked and its space reclaimed."""
    allocation_strategy: Literal["random", "free_ratio_first", "local_first"] = "local_first"
    replicas: int = Field(1, ge=1, le=8)
    """Default replica count of a put (on distinct store nodes)."""
    recovery_timeout_s: float = Field(15.0, gt=0)
    """After a restart, how long the master waits for known store nodes to remount."""
    put_slab_bytes: Size = 32 << 20
    """DRAM a client reserves at a time on one node to put values with one master call
    each (capped at 1/16 of the node's arena; 0 disables: every put takes two calls)."""
    put_slab_ttl_s: float = Field(2.0, gt=0, le=60)
    """A client starts writes into a slab only this long after asking for it; a restarted
    master allocates nothing for this long."""
    native_calls: bool = True
    """Answer GET, EXISTS, lease releases and clean one-call put commits in C++ on the RPC
    thread from a mirror of the index (False: every call runs the Python state machine)."""
    durable_acks: bool = True
    """Acknowledge a put once every store node holding it has recorded it in its inventory,
    which a restarted master rebuilds from: an acknowledged value survives a master kill.
    False acknowledges at once (about 1 ms sooner): a master killed in that millisecond
    loses the value, and a value written into a node killed just before is acknowledged."""
    max_key_bytes: int = Field(4096, ge=1, le=65536)
    repair_delay_s: float = Field(10.0, ge=0)
    """A value left with fewer copies than its put asked for (a store node lost, a put
    placed while a node was down) is copied to another node again after this long, or as
    soon as every node lost meanwhile has mounted again (a store node that Ray restarts
    re-adopts its arena within seconds, and its values need no copy; one back empty brings
    nothing more)."""
    repair_bytes_per_s: Size = 96 << 20
    """The most bytes per second a store node copies to restore other values' copies
    (0: no repairs), a MiB at a time: puts and gets keep their rate meanwhile (0.85x of it
    on 2 vCPUs, docs/performance.md)."""
    chain_eviction: bool = True
    """Evict KV chains leaves first: a value put with a ``parent`` holds its parent (and so
    its whole prefix) in the store while it is stored or being put; a page whose parent
    went is dropped (no prefix lookup reaches it). False: plain LRU over every key."""
    chain_insert: Literal["adaptive", "recent", "old"] = "adaptive"
    """Where a new value put with a parent (a KV page) enters the eviction order. ``recent``:
    the recent end (LRU), right when pages are read again soon (a conversation's next turn
    before the arena turns over, a prefill's pages that a decode loads). ``old``: on
    probation at the old end, unread pages first in first out, moving to the recent end at
    its first read; right when more conversations take turns than DRAM holds (LRU then
    evicts each just before its next turn). ``adaptive`` (default): the master simulates
    both on a sample of the keys and follows the one that hits more lately; the setting is
    for experiments. Figures in docs/performance.md."""
    shards: int = Field(1, ge=1, le=64)
    """Master actors, each owning the keys that hash to it and an equal part of every
    store node's arena (``_private/shards.py``): more metadata throughput, and a shard's
    restart pauses only its own keys. A value must fit in one part (1/shards of
    ``segment_size_bytes``)."""
    max_restarts: int = Field(-1, ge=-1)
    num_cpus: float = Field(0.0, ge=0)


class ClientConfig(_Model):
    local_buffer_size_bytes: Size = 64 << 20
    """Pinned host buffer of the staged device-memory path, one per concurrent staged call
    (Mooncake's local_buffer_size)."""
    master_retry_timeout_s: float = Field(30.0, gt=0)
    """How long a call waits and retries while the master is down before raising
    MasterUnavailableError."""
    backpressure_timeout_s: float = Field(30.0, gt=0)
    """How long a put (or a get that must promote from disk) waits for room, retrying as
    offloads to disk, eviction and ending read leases free it, before raising
    OffloadPendingError or NoCapacityError."""
    device_path: Literal["auto", "direct", "staged"] = "auto"
    """How device memory (torch CUDA tensors, cupy arrays) moves, chosen per registered
    buffer: ``direct`` (UCX registers it: cuda_copy / cuda_ipc / GPUDirect RDMA, and on one
    host the CUDA driver copies to and from the mapped arena), ``staged`` (through a pinned
    host buffer of ``local_buffer_size_bytes``, copies on a stream of its own overlapped
    with the transfers; forced, it stages registered host memory too), ``auto`` (direct
    where the transport's UCX can register CUDA memory, else staged)."""
    checksum_in_copy: bool = True
    """Where a put's bytes are copied by the client itself (a store node's arena mapped
    from this host's shared memory), take the value's CRC-32C in that copy and hand it to
    the master with the commit, so the store node journals it without reading the value
    back (``docs/internals.md``, "Checksums taken in the copy"). Off: the node checksums
    the value from its arena, as it does for values that came over the network."""
    early_read_max_bytes: Size = 1 << 20
    """A single get of a key whose location this client knows (it wrote or read it) reads
    the bytes while the master's lookup is in flight, when they are mapped from this host's
    shared memory (any size) or at most this many bytes (0: never over the network). Over
    loopback tcp on 2 vCPUs, overlapping the lookup with a 4 MiB transfer made it slower
    (the master's thread competes with both ends of the transfer): x0.81 there, against
    x1.19 at 4 KiB."""


class StoreConfig(_Model):
    """Everything ``mooncake_ray.start`` deploys. Nested sections: master, transport,
    spill, client."""

    namespace: str = "mooncake_ray"
    """Ray namespace of the store's named actors; two stores never share one."""
    segment_size_bytes: Size = 1 << 30
    """DRAM arena of each store node (Mooncake's global_segment_size)."""
    store_resource: str = "mooncake_store"
    """Ray nodes offering this custom resource get a store node; if none does, every
    alive node does."""
    ray_address: str | None = None
    """Ray cluster to deploy onto (None: the connected one, or an embedded local one)."""
    prefault: bool = True
    master: MasterConfig = Field(default_factory=MasterConfig)
    transport: TransportConfig = Field(default_factory=TransportConfig)
    spill: SpillConfig = Field(default_factory=SpillConfig)
    client: ClientConfig = Field(default_factory=ClientConfig)
    elastic: ElasticConfig = Field(default_factory=ElasticConfig)

    @model_validator(mode="after")
    def _arena_fits(self) -> "StoreConfig":
        if self.segment_size_bytes and self.segment_size_bytes < 1 << 20:
            raise ValueError(
                f"segment_size_bytes must be 0 (no arena) or at least 1 MiB, got {self.segment_size_bytes}")
        return self


# Mooncake's variables -> our field paths. MOONCAKE_MASTER names where the master lives;
# here that is the Ray cluster holding the master actor.
MOONCAKE_ALIASES: dict[str, tuple[str, ...]] = {
    "MOONCAKE_GLOBAL_SEGMENT_SIZE": ("segment_size_bytes",),
    "MOONCAKE_LOCAL_BUFFER_SIZE": ("client", "local_buffer_size_bytes"),
    "MOONCAKE_PROTOCOL": ("transport", "protocol"),
    "MOONCAKE_DEVICE": ("transport", "devices"),
    "MOONCAKE_MASTER": ("ray_address",),
    "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": ("spill", "directory"),
    "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES": ("spill", "capacity_bytes"),
    "MOONCAKE_USE_URING": ("spill", "use_uring"),
    "MOONCAKE_ENABLE_OFFLOAD": ("spill", "enabled"),
    # The RDT plug-in's own older names (MOONCAKE_RAY_RDT__* is the regular spelling).
    "MOONCAKE_RDT_PROTOCOL": ("rdt", "protocol"),
    "MOONCAKE_RDT_DEVICES": ("rdt", "devices"),
    "MOONCAKE_RDT_RECV_POOL_BYTES": ("rdt", "recv_pool_bytes"),
    "MOONCAKE_RDT_TIMEOUT_S": ("rdt", "timeout_s"),
}
ENV_PREFIX = "MOONCAKE_RAY_"
# The environment's section read by load_rdt_config, never by the store (load_config).
RDT_SECTION = "rdt"


def _set_path(d: dict, path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        d = d.setdefault(part, {})
        if not isinstance(d, dict):
            raise ConfigError(f"cannot set {'.'.join(path)}: {part} is not a section")
    d[path[-1]] = value


def _env_value(raw: str) -> Any:
    # JSON for structured values ({"RNDV_THRESH": "8k"}, ["eth0"], true, 5); else the string.
    try:
        return json.loads(raw)
    except ValueError:
        low = raw.strip().lower()
        if low in ("true", "yes", "on"):
            return True
        if low in ("false", "no", "off"):
            return False
        return raw


def env_overrides(environ: Mapping[str, str] | None = None) -> dict:
    """The nested override dict that the environment asks for."""
    environ = os.environ if environ is None else environ
    out: dict = {}
    for name, path in MOONCAKE_ALIASES.items():
        if name in environ:
            raw = environ[name]
            value: Any = raw if path[-1] in ("devices", "ray_address", "directory") else _env_value(raw)
            if path[-1] == "protocol" and isinstance(value, str):
                value = value.strip().lower()
            if name == "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH" and "MOONCAKE_ENABLE_OFFLOAD" not in environ:
                _set_path(out, ("spill", "enabled"), True)  # a spill path alone turns offload on
            _set_path(out, path, value)
    for name, raw in environ.items():
        if name.startswith(ENV_PREFIX):
            path = tuple(p.lower() for p in name[len(ENV_PREFIX):].split("__") if p)
            if path:
                _set_path(out, path, _env_value(raw) if path[-1] not in ("namespace", "directory", "ray_address") else raw)
    return out


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "config"
        got = e.get("input")
        msg = e["msg"]
        if e["type"] == "literal_error":
            msg = f"allowed: {e['ctx']['expected']}"
        elif e["type"] == "extra_forbidden":
            msg = "unknown field"
        lines.append(f"{field}: got {got!r}; {msg}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def load_config(config: "StoreConfig | Mapping | str | os.PathLike | None" = None,
                environ: Mapping[str, str] | None = None) -> StoreConfig:
    """Validate a config (model, dict, or a YAML/JSON file path) plus the environment.

    Raises:
        ConfigError: naming each bad field, its value and what is allowed.
    """
    if isinstance(config, StoreConfig):
        base = config.model_dump()
    elif config is None:
        base = {}
    elif isinstance(config, Mapping):
        base = dict(config)
    else:
        path = Path(config)
        if not path.exists():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml  # ray depends on pyyaml

            base = yaml.safe_load(text) or {}
        else:
            base = json.loads(text)
        if not isinstance(base, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping, got {type(base).__name__}")
    env = env_overrides(environ)
    env.pop(RDT_SECTION, None)
    return validated(StoreConfig, _merge(base, env))


def load_rdt_config(overrides: Mapping[str, Any] | None = None,
                    environ: Mapping[str, str] | None = None) -> RdtConfig:
    """The RDT plug-in's settings: ``overrides`` (``ray_rdt.register``'s arguments) over
    the environment over the defaults.

    Raises:
        ConfigError: naming each bad field, its value and what is allowed.
    """
    env = env_overrides(environ).get(RDT_SECTION, {})
    if not isinstance(env, dict):
        raise ConfigError(f"{ENV_PREFIX}{RDT_SECTION.upper()} must name a field "
                          f"({ENV_PREFIX}{RDT_SECTION.upper()}__PROTOCOL=tcp)")
    return validated(RdtConfig, _merge(env, dict(overrides or {})))


M = TypeVar("M", bound=BaseModel)


def validated(model: type[M], data: Mapping[str, Any]) -> M:
    """``model`` validated from ``data``.

    Raises:
        ConfigError: naming each bad field, its value and what is allowed.
    """
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_explain(e)) from None
