"""Loads the compiled ``mooncake_ray._native`` module.

The UCX shared libraries come from the ``libucx`` wheel; its loader puts them in the
process's library cache so the module (and UCX's own transport plugins) resolve them
whatever the RPATH says.
"""

from __future__ import annotations

try:
    import libucx
except ImportError:  # pragma: no cover - an install without one of the UCX extras
    raise ImportError(
        "mooncake-ray needs UCX from PyPI: install mooncake-ray[cu12] (libucx-cu12: CUDA 12 drivers, or no GPU) "
        "or mooncake-ray[cu13] (libucx-cu13: CUDA 13 only)") from None

libucx.load_library()

from mooncake_ray import _native  # noqa: E402

__all__ = ["_native"]
