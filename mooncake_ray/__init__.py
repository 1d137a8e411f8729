"""mooncake-ray: a distributed KV-cache store for LLM serving, built on Ray and UCX."""

from mooncake_ray.errors import *  # noqa: F401,F403
from mooncake_ray import errors as _errors

__version__ = "0.1.0"
__all__ = list(_errors.__all__)
