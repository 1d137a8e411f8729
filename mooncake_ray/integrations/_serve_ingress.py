"""The aggregated app's ingress where a deployment routes with ``MooncakeKVRouter``.

Ray Serve LLM's ``OpenAiIngress`` makes its handle to an LLM deployment, and with it the
handle's request router, at its first request for that model. A router made then has not
yet read the engines' records, subscribed to their KV events or loaded the tokenizer, so it
routes that request and the next few by load alone, and the subscription it makes while an
engine is storing the request's blocks can miss them. With several ingress replicas each
one's router starts that way at its own first request. This ingress makes its handles
(``_get_configured_serve_handle``, the ingress's own cache of them) as the replica starts.
"""

from __future__ import annotations

from ray.serve.llm.ingress import OpenAiIngress as _RayIngress


class OpenAiIngress(_RayIngress):
    """Ray's, under Ray's name: the deployment keeps the name ``OpenAiIngress`` (what
    ``serve status``, the dashboard and a Serve config's ``deployments`` entries use)."""

    def __init__(self, llm_deployments, model_cards, **kwargs):
        super().__init__(llm_deployments, model_cards, **kwargs)
        for model_id in model_cards:
            self._get_configured_serve_handle(model_id)  # the handle and its router, now
