"""OpenAI-compatible serving on Ray Serve: prefill/decode disaggregation over the store."""

from mooncake_ray.serve.app import OpenAIIngress, build_app
from mooncake_ray.serve.deployments import EngineServer
from mooncake_ray.serve.router import PrefixAwareRouter

__all__ = ["build_app", "OpenAIIngress", "EngineServer", "PrefixAwareRouter"]
