"""Log lines of the store's actors (master shards, store nodes): each with its time, level
and source, INFO and up, on the process's stderr, which Ray keeps in the session's
``logs/worker-*.err`` and shows in the dashboard. Without it Python prints only warnings,
as bare messages: a node unmounted, but not when."""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure() -> None:
    """Once per process; the ``mooncake_ray`` loggers only."""
    root = logging.getLogger("mooncake_ray")
    if any(getattr(h, "mooncake_ray", False) for h in root.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.mooncake_ray = True
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False  # one line each, whatever the process's root logger does
