"""The master's per-operation RPC: a narrow, batched request/response protocol carried by
the native transport (UCX active messages), never by a Ray actor call per operation.

Wire format (msgpack): a request is ``[op, *args]``; a reply is ``[OK, payload]`` or
``[ERR, class_name, message]``. Batch operations carry one entry per key, and per-key
failures come back inside the payload as ``[ERR, class_name, message]`` entries, so one
bad key never fails its neighbours.

Which calls are safe to retry after a lost reply (the client does so across a master
restart): GET, EXISTS, NODES, PUT_END, PUT_REVOKE, PIN, OFFLOAD_DONE, PROMOTE_DONE,
SLAB_RETURN, PROMOTE_BEGIN are idempotent; PUT_START is made idempotent by the owner id (a retry from
the same client returns the same allocation), PUT_COMMIT by its extent (a value already
committed at that extent answers with its generation); a retried SLAB_GRANT at worst
grants a second slab, which expires unused;
REMOVE* answers "not found" the second time, which the client treats as done.
"""

from __future__ import annotations

from typing import Any, Callable

import msgpack

from mooncake_ray import errors

# Handler ids on the master's engine.
MASTER_RPC = 1
# Handler ids on store nodes: inventory deltas from the master; disk promotions asked by
# clients (read a spilled object into a DRAM extent the master reserved); an echo the
# master uses to check a client's report that the node is unreachable.
NODE_INVENTORY_RPC = 2
NODE_PROMOTE_RPC = 3
NODE_ECHO_RPC = 4


def node_inventory_rpc(shard: int) -> int:
    """The store node's handler id for inventory messages of master shard ``shard``
    (shard 0: ``NODE_INVENTORY_RPC``; shard s > 0: 64 + s)."""
    return NODE_INVENTORY_RPC if shard == 0 else 64 + shard


OK, ERR = 0, 1

# master operations
PUT_START = 1
PUT_END = 2
PUT_REVOKE = 3
GET = 4
EXISTS = 5
REMOVE = 6
REMOVE_PREFIX = 7
NODES = 8
PIN = 9
UNPIN = 10
REPORT_UNREACHABLE = 11
PING = 12
OFFLOAD_DONE = 13
PROMOTE_DONE = 14
RELEASE = 15
SLAB_GRANT = 16
PUT_COMMIT = 17
SLAB_RETURN = 18
PROMOTE_BEGIN = 19  # a store node asks which promote items are the master's reservations
CHAIN_LINKS = 20  # a master shard's KV chain messages to another (master/chainlinks.py)


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def unpack_tuples(data: bytes) -> Any:
    """``unpack`` with arrays as tuples: records kept as they arrive, with no copy (a store
    node's inventory messages)."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=False)


def err_entry(e: BaseException) -> list:
    name = type(e).__name__ if isinstance(e, errors.MooncakeRayError) else "RemoteHandlerError"
    msg = str(e) if isinstance(e, errors.MooncakeRayError) else f"{type(e).__name__}: {e}"
    return [ERR, name, msg]


def is_err(entry: Any) -> bool:
    return isinstance(entry, list) and len(entry) == 3 and entry[0] == ERR and isinstance(entry[1], str)


def to_exc(entry: list) -> errors.MooncakeRayError:
    return errors._from_name(entry[1], entry[2])


def per_key(fn: Callable[..., Any], items, *extra) -> list:
    """Apply ``fn`` to each item, turning a typed error into an error entry."""
    out = []
    for item in items:
        try:
            out.append(fn(*item, *extra) if isinstance(item, (list, tuple)) else fn(item, *extra))
        except errors.MooncakeRayError as e:
            out.append(err_entry(e))
    return out


def serve_request(table: dict[int, Callable[..., Any]], data: bytes) -> bytes:
    """Decode a request, run its handler, encode the reply (used on the server side)."""
    try:
        req = unpack(data)
        handler = table.get(req[0])
        if handler is None:
            raise errors.InvalidArgumentError(f"unknown master operation {req[0]!r}")
        return pack([OK, handler(*req[1:])])
    except errors.MooncakeRayError as e:
        return pack(err_entry(e))
    except Exception as e:  # a bug: report it to the caller rather than hang it
        return pack(err_entry(e))


def decode_reply(data: bytes) -> Any:
    rep = unpack(data)
    if rep[0] == OK:
        return rep[1]
    raise to_exc(rep)
