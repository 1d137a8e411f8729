"""Loads the compiled ``mooncake_ray._native`` module.

The UCX shared libraries come from the ``libucx`` wheel; its loader puts them in the
process's library cache so the module (and UCX's own transport plugins) resolve them
whatever the RPATH says.
"""

from __future__ import annotations

import libucx

libucx.load_library()

from mooncake_ray import _native  # noqa: E402

__all__ = ["_native"]
