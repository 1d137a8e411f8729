"""Typed errors of mooncake-ray.

One hierarchy rooted at :class:`MooncakeRayError`. Every class carries a ``retryable``
flag: ``True`` means the same call may succeed if repeated later unchanged (the store was
busy, a node or the master was restarting); ``False`` means the call itself is wrong or the
object is gone, and repeating it gives the same answer.

The native engine has one error-code enum (``native/include/mcr/status.h``); the binding
maps each code to exactly one class here through :func:`_from_native_code`.
"""

from __future__ import annotations

__all__ = [
    "MooncakeRayError",
    "ConfigError",
    "InvalidArgumentError",
    "ObjectNotFoundError",
    "ObjectExistsError",
    "ObjectLeasedError",
    "ObjectPendingError",
    "NoCapacityError",
    "OffloadPendingError",
    "LeaseExpiredError",
    "NodeUnavailableError",
    "MasterUnavailableError",
    "TransferError",
    "TransferTimeoutError",
    "RemoteHandlerError",
    "NotRegisteredError",
    "SpillError",
    "ChecksumError",
    "EngineClosedError",
    "AuthenticationError",
]


class MooncakeRayError(Exception):
    """Root of all mooncake-ray errors."""

    retryable: bool = False
    code: int | None = None  # the native code, when raised by the native engine


class ConfigError(MooncakeRayError, ValueError):
    """A configuration value is invalid: names the field, the value and what is allowed."""


class InvalidArgumentError(MooncakeRayError, ValueError):
    """A call was made with a bad argument (key, value type, buffer size, range)."""


class ObjectNotFoundError(MooncakeRayError, KeyError):
    """The key is not in the store (never stored, removed, evicted or lost with its node)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "object not found"


class ObjectExistsError(MooncakeRayError):
    """``put`` of a key that is already stored: use ``upsert`` to replace it."""


class ObjectLeasedError(MooncakeRayError):
    """The object is being read under a lease; retry after the lease ends or force."""

    retryable = True


class ObjectPendingError(MooncakeRayError):
    """Another client's put of this key has not completed yet."""

    retryable = True


class NoCapacityError(MooncakeRayError):
    """No store node has room, even after eviction (everything left is pinned, leased or
    pending), or the value is larger than any pool."""

    retryable = True


class OffloadPendingError(NoCapacityError):
    """DRAM is momentarily full: its room is held by offloads to disk in flight, by puts in
    progress or by replaced values waiting for their readers. Clients wait and retry this
    one automatically (bounded by ``client.backpressure_timeout_s``); a plain
    NoCapacityError means everything left is pinned."""

    retryable = True


class LeaseExpiredError(MooncakeRayError):
    """A read outlived its lease, so the bytes cannot be trusted; the read is retried."""

    retryable = True


class NodeUnavailableError(MooncakeRayError):
    """A store node is unreachable or was unmounted."""

    retryable = True


class MasterUnavailableError(MooncakeRayError):
    """The master did not answer within the retry window (restarting or gone)."""

    retryable = True


class TransferError(MooncakeRayError):
    """The transport reported a failure moving bytes (peer died, UCX error)."""

    retryable = True


class TransferTimeoutError(TransferError):
    """A transfer or RPC did not complete within its timeout."""

    retryable = True


class RemoteHandlerError(MooncakeRayError):
    """A remote RPC handler raised an unexpected exception."""


class NotRegisteredError(InvalidArgumentError):
    """Memory used in a transfer is not (or no longer) registered, or a range falls outside
    its registered region."""


class SpillError(MooncakeRayError):
    """The disk tier failed (I/O error, no space, directory gone)."""

    retryable = True


class ChecksumError(SpillError):
    """A spilled object failed its checksum: it is treated as a miss and removed."""

    retryable = False


class EngineClosedError(MooncakeRayError):
    """The native engine was shut down."""


class AuthenticationError(MooncakeRayError):
    """A peer failed, or refused, the authenticated handshake: the two engines do not hold
    the same cluster secret (or one holds none)."""


# Native codes (native/include/mcr/status.h) -> exactly one class each.
_NATIVE_CODES: dict[int, type[MooncakeRayError]] = {
    100: InvalidArgumentError,
    101: NotRegisteredError,  # out of bounds of a registered region
    102: NotRegisteredError,
    200: NodeUnavailableError,
    201: TransferTimeoutError,
    202: TransferError,
    203: RemoteHandlerError,
    204: RemoteHandlerError,
    205: EngineClosedError,
    206: ConfigError,
    207: AuthenticationError,
    300: SpillError,
    301: SpillError,
    302: ChecksumError,
    303: ObjectNotFoundError,
    304: SpillError,
    900: MooncakeRayError,
}


def _from_native_code(code: int) -> type[MooncakeRayError]:
    """Class for a native error code (used by the binding)."""
    return _NATIVE_CODES.get(int(code), MooncakeRayError)


# Names used to carry typed errors across the master RPC (see _private/rpc.py).
_BY_NAME: dict[str, type[MooncakeRayError]] = {
    cls.__name__: cls
    for cls in list(globals().values())
    if isinstance(cls, type) and issubclass(cls, MooncakeRayError)
}


def _from_name(name: str, message: str) -> MooncakeRayError:
    return _BY_NAME.get(name, MooncakeRayError)(message)
