"""The store's shared secret: what every engine of one store (master, store nodes,
clients) proves it knows in the transport's handshake before anything is answered.

It is created once per store when the store is deployed (``start()`` or
``mooncake-ray start``): 32 bytes from ``os.urandom``, kept in Ray's internal key-value
store (the GCS) under the store's namespace. So exactly the processes that are members of
the Ray cluster can read it; with Ray's token auth on (its default), joining the cluster
takes Ray's token. A process that holds an engine's address bytes but is not a member
cannot get it, and the transport refuses it (see docs/internals.md, "Peer authentication").
"""

from __future__ import annotations

import hashlib
import hmac
import os

from mooncake_ray.errors import AuthenticationError, MasterUnavailableError
from mooncake_ray._private import rpc

SECRET_BYTES = 32
_KV_NAMESPACE = "mooncake_ray"


def _key(namespace: str) -> str:
    return f"{namespace}/transport-secret"


def ensure_secret(namespace: str) -> bytes:
    """The store's secret, created if this is the store's first deployment. Idempotent
    under races: the first writer wins and everyone reads its value."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(_key(namespace), os.urandom(SECRET_BYTES), overwrite=False,
                                 namespace=_KV_NAMESPACE)
    return store_secret(namespace)


def store_secret(namespace: str) -> bytes:
    """The secret of the store deployed in ``namespace`` (read from the GCS).

    Raises:
        MasterUnavailableError: no store was deployed in ``namespace``.
    """
    from ray.experimental import internal_kv

    got = internal_kv._internal_kv_get(_key(namespace), namespace=_KV_NAMESPACE)
    if not got or len(got) != SECRET_BYTES:
        raise MasterUnavailableError(
            f"no mooncake-ray store was deployed in Ray namespace {namespace!r} (it has no transport secret): "
            "call mooncake_ray.start() or run `mooncake-ray start`")
    return got


def forget_secret(namespace: str) -> None:
    """Drop the secret with the store (``shutdown``): a new deployment gets a new one."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(_key(namespace), namespace=_KV_NAMESPACE)


def node_devices(ip: str) -> list[str]:
    """The network devices a store's engines use when ``transport.devices`` is not set: the
    interface that holds the Ray node's address ``ip``, loopback, and the RDMA devices'
    ports (``/sys/class/infiniband``; that part is untested here: no RDMA NIC). UCX's own
    default is every interface the host has."""
    import psutil

    out = [name for name, addrs in psutil.net_if_addrs().items()
           if any(a.address.split("%")[0] == ip for a in addrs)]
    if "lo" not in out:
        out.append("lo")
    ib = "/sys/class/infiniband"
    if os.path.isdir(ib):
        for dev in sorted(os.listdir(ib)):
            ports = os.path.join(ib, dev, "ports")
            out += [f"{dev}:{p}" for p in sorted(os.listdir(ports))] if os.path.isdir(ports) else []
    return out


def role_engine(cfg, name: str, *, server: bool = False, **overrides):
    """The transport engine of a member of the store ``cfg`` (a ``StoreConfig``): its
    transport settings, listening on the Ray node's interface and loopback unless
    ``transport.devices`` says otherwise, and holding the store's secret unless
    ``transport.auth`` is false.

    Raises:
        MasterUnavailableError: the store has no secret (it was never deployed).
        ConfigError: a transport setting is rejected.
    """
    import ray

    from mooncake_ray._private.transport import Engine  # the native module: load on use

    t = cfg.transport
    if t.devices is None and "devices" not in overrides:
        try:
            ip = ray.util.get_node_ip_address()
        except Exception:  # not in a Ray process: UCX's default
            ip = None
        if ip:
            overrides["devices"] = node_devices(ip)
    engine = Engine.from_config(t, name=name, server=server, **overrides)
    if t.auth:
        try:
            engine.set_auth_secret(store_secret(cfg.namespace))
        except BaseException:
            engine.close()
            raise
    return engine


# ---- the node key: what only the master and its store nodes hold ------------------------
# The store's secret admits every member (clients too). Calls that only a store node may
# make to the master (OFFLOAD_DONE, PROMOTE_BEGIN, PROMOTE_DONE) and that only the master
# may make to a store node (inventory messages) also carry an HMAC-SHA256 under the node
# key: made by the master when it starts, handed to store nodes by a Ray call before they
# mount, never sent over the transport and never given to clients.

NODE_KEY_BYTES = 32
MAC_BYTES = 32


def new_node_key() -> bytes:
    return os.urandom(NODE_KEY_BYTES)


def _tag(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def mac(key: bytes, obj) -> bytes:
    """HMAC-SHA256 under ``key`` of ``obj`` as the RPC packs it."""
    return _tag(key, rpc.pack(obj))


def check_mac(key: bytes | None, obj, tag) -> None:
    """Raises AuthenticationError unless ``tag`` is ``mac(key, obj)`` (constant-time)."""
    if key is None or type(tag) is not bytes or not hmac.compare_digest(mac(key, obj), tag):
        raise AuthenticationError("this call is only accepted from the store's master or store nodes "
                                  "(its node-key signature is missing or wrong)")


def seal(key: bytes, payload: bytes) -> bytes:
    """``payload`` with its HMAC-SHA256 under ``key`` in front."""
    return _tag(key, payload) + payload


def unseal(key: bytes | None, data: bytes) -> bytes:
    """The payload of ``seal(key, payload)``.

    Raises:
        AuthenticationError: the signature is missing or wrong (or no key is held yet).
    """
    if key is None or len(data) < MAC_BYTES or not hmac.compare_digest(
            _tag(key, data[MAC_BYTES:]), data[:MAC_BYTES]):
        raise AuthenticationError("an inventory message not signed by this store's master was refused")
    return data[MAC_BYTES:]
