"""Joining a Ray cluster that token authentication (Ray's default) may guard.

Ray 2.60 trips here: ``ray start --head`` turns token authentication on when it finds a
token (``~/.ray/auth_token``, left by any earlier local ``ray.init()``, such as ``make
demo``'s), but a process joining that cluster with ``RAY_AUTH_MODE`` unset sends no token,
and the cluster refuses it with a bare ``ConnectionError``. ``join`` sets ``RAY_AUTH_MODE=token``
(for this process and its children) whenever it joins a running cluster with a token at
hand: a cluster without token authentication accepts such a process too. A token that is
not the cluster's still fails; the error then names where the token came from and the fix."""

from __future__ import annotations

import os
import random
import socket
import time
from pathlib import Path

from mooncake_ray.errors import ConfigError


def token_source() -> str:
    """Where this process's Ray token comes from, as Ray looks for it: ``RAY_AUTH_TOKEN``,
    the file ``RAY_AUTH_TOKEN_PATH`` names, else ``~/.ray/auth_token``."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "the RAY_AUTH_TOKEN environment variable"
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        age = time.time() - path.stat().st_mtime
    except OSError:
        return f"{path} (not there: this process has no token)"
    return f"{path} (written {_ago(age)} ago)"


def has_token() -> bool:
    """Whether Ray would find a token for this process."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def _ago(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


CHECK_TIMEOUT_MS = 2000  # the token check's wait for a GCS; ray.init then waits as it always did
REFUSED_WAIT_S = 3.0  # how long a refused connection may last before nothing is taken to listen there


def _refused(gcs: str, wait_s: float) -> bool:
    """Whether every TCP connection to ``gcs`` (``host:port``) is refused for ``wait_s``:
    nothing listens there. A connection made, or any other failure (a timeout, no route),
    is not that, and is left to ``ray.init``."""
    host, _, port = gcs.rpartition(":")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                return False
        except ConnectionRefusedError:
            if time.monotonic() >= deadline:
                return True
            time.sleep(0.1)
        except (OSError, ValueError):
            return False


def _check_token(address: str | None) -> None:
    """One GCS call with this process's token before ``ray.init``: a refused token raises
    ``AuthenticationError`` in milliseconds, where ``ray.init`` retries it once a second
    for 20 s. A port nothing listens on (every connection refused for ``REFUSED_WAIT_S``)
    raises ``ConfigError``, where ``ray.init`` retries for minutes. Any other outcome (a
    GCS still starting, a host that does not answer) is left to ``ray.init`` as before."""
    from ray._private import services
    from ray._raylet import InnerGcsClient
    from ray.exceptions import AuthenticationError

    if address and address.startswith("ray://"):  # Ray Client: its server, not a GCS, answers there
        return
    try:
        gcs = services.canonicalize_bootstrap_address(address)
    except Exception:  # noqa: BLE001 - ray.init reports a bad or absent address itself
        return
    if not gcs:
        return
    if _refused(gcs, REFUSED_WAIT_S):
        raise ConfigError(
            f"cannot join the Ray cluster at {address!r}: nothing listens at {gcs} (every connection refused "
            f"for {REFUSED_WAIT_S:g} s). Start the cluster (`ray start --head`), or give the address its head "
            "printed (`ray status` on the head shows it).")
    try:
        InnerGcsClient.standalone(gcs, None, CHECK_TIMEOUT_MS)
    except AuthenticationError:
        raise
    except Exception:  # noqa: BLE001 - not up yet, unreachable: ray.init waits for it and reports
        return


def join(address: str | None, **kwargs) -> None:
    """``ray.init(address, **kwargs)``.

    Raises:
        ConfigError: Ray could not join the cluster at ``address``: names the address, Ray's
            error, where this process's token came from and how to give it the cluster's.
    """
    import ray

    joining = address not in (None, "local") or bool(os.environ.get("RAY_ADDRESS"))
    if joining and "RAY_AUTH_MODE" not in os.environ and has_token():
        os.environ["RAY_AUTH_MODE"] = "token"
        try:  # Ray read its configuration at import: have it read the mode again
            from ray._raylet import Config

            Config.initialize("")
        except (ImportError, AttributeError):
            pass
    # Ray names this process's GCS subscriptions (error and log channels) with ids drawn from
    # Python's ``random``. Engines seed it before their connector joins (vLLM seeds every
    # engine process, with one seed for all engines by default), so twin engine processes
    # drew the same ids, and the GCS answered each one's long poll at once to take the
    # other's: half a core of the GCS and a tenth in each process, without end. The ids come
    # from fresh entropy here, and the process gets its seeded sequence back.
    seeded = random.getstate()
    random.seed()
    try:
        if joining:
            _check_token(address)
        ray.init(address=address, **kwargs)
    except (ConnectionError, RuntimeError, ray.exceptions.AuthenticationError) as e:
        if address in (None, "local"):
            raise
        raise ConfigError(
            f"cannot join the Ray cluster at {address!r}: {type(e).__name__}: {e}. If the cluster is up, "
            "the likely cause is its token authentication (Ray's default): this process's token comes "
            f"from {token_source()}, and a token another Ray left there (an earlier local ray.init(), a "
            "notebook) is not the cluster's. Give this process the cluster's token (`ray get-auth-token` "
            "on the head, into RAY_AUTH_TOKEN or a file named by RAY_AUTH_TOKEN_PATH), or move the "
            "stale file away and start the cluster again.") from None
    finally:
        random.setstate(seeded)
