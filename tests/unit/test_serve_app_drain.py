"""The built-in engine's Serve app checks its drain every ``DRAIN_CHECK_S`` in every
deployment (Serve's default, 2 s, is slept at least once by each stopping replica). Read
from the built application's deployments (Serve keeps them in ``_bound_deployment`` and
``_deployment_config``: no public accessor); no Ray cluster needed."""

from __future__ import annotations

import pytest

from mooncake_ray.serve import app as serve_app
from mooncake_ray.serve import build_app


@pytest.mark.parametrize("mode, names", [("aggregated", ["OpenAIIngress", "LLM"]),
                                         ("disaggregated", ["OpenAIIngress", "Prefill", "Decode"])])
def test_every_deployment_checks_its_drain_often(mode, names):
    ingress = build_app({"mode": mode, "store": {"enabled": False}})._bound_deployment
    deps = [ingress] + [a._bound_deployment for a in ingress.init_args if hasattr(a, "_bound_deployment")]
    assert [d.name for d in deps] == names
    assert [d._deployment_config.graceful_shutdown_wait_loop_s for d in deps] == [serve_app.DRAIN_CHECK_S] * len(names)
    assert serve_app.DRAIN_CHECK_S < 2.0
