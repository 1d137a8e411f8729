"""Checks of call arguments shared by the client (which fails fast, before any call) and
the master (which is called over the wire by clients it cannot trust to have checked)."""

from __future__ import annotations

import math
from typing import Any

from mooncake_ray.errors import InvalidArgumentError

MAX_REPLICAS = 64
MAX_TTL_S = 10 * 365 * 86400.0  # ten years: a pin meant to outlive that is a hard pin


def check_replicas(replicas: Any) -> int:
    """``replicas`` as a count of copies.

    Raises:
        InvalidArgumentError: not an int (bool is not one) in 1..MAX_REPLICAS.
    """
    if type(replicas) is not int or not 1 <= replicas <= MAX_REPLICAS:
        raise InvalidArgumentError(f"replicas must be an int from 1 to {MAX_REPLICAS}, got {replicas!r:.40}")
    return replicas


def check_ttl(ttl_s: Any, name: str = "ttl_s") -> float:
    """``ttl_s`` as a duration in seconds (``name``: the argument, for the error).

    Raises:
        InvalidArgumentError: not a finite number of seconds in (0, MAX_TTL_S].
    """
    if type(ttl_s) not in (int, float) or not math.isfinite(ttl_s) or not 0 < ttl_s <= MAX_TTL_S:
        raise InvalidArgumentError(
            f"{name} must be a finite number of seconds in (0, {MAX_TTL_S:.0f}], got {ttl_s!r:.40}")
    return float(ttl_s)


def check_records(items, types: tuple, what: str) -> None:
    """That ``items`` is a list of records (lists or tuples) of exactly ``types`` (a bool is
    not an int here).

    Raises:
        InvalidArgumentError: naming the first bad item.
    """
    if not isinstance(items, (list, tuple)):
        raise InvalidArgumentError(f"{what}s must come as a list, got {type(items).__name__}")
    for it in items:
        if not (isinstance(it, (list, tuple)) and len(it) == len(types)
                and all(type(x) is t for x, t in zip(it, types))):
            raise InvalidArgumentError(f"malformed {what} {it!r:.120}: expected {[t.__name__ for t in types]}")
