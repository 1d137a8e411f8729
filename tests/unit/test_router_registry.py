"""The prefix-aware router's in-flight registry is one per process, even when Serve
delivers the router class as a by-value copy of its module (it pickles the class with the
deployment's config): the ingress reports finished requests to the module ``import``
finds, and the router must count against that same registry."""

from __future__ import annotations

import importlib.util

import mooncake_ray.serve.router as router


def _copy_of_router_module():
    """What unpickling the class by value gives: the module's code run again, under the
    same name, without replacing the imported module."""
    spec = importlib.util.spec_from_file_location(router.__name__, router.__file__)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod._INFLIGHT is not router._INFLIGHT
    return mod


def test_a_copy_of_the_module_counts_in_the_imported_registry():
    copy = _copy_of_router_module()
    assert copy._inflight() is router._INFLIGHT
    copy._inflight().add("LLM", "req-1", "replica-a")
    copy._inflight().add("LLM", "req-1", "replica-a")  # added once per request id
    assert router._INFLIGHT.count("LLM", "replica-a") == 1
    router.request_finished("LLM", "req-1")  # what the ingress calls
    assert copy._inflight().count("LLM", "replica-a") == 0
    router.request_finished("LLM", "req-1")  # a second finish is harmless
    assert router._INFLIGHT.count("LLM", "replica-a") == 0


def test_a_dead_replica_is_forgotten():
    reg = router._inflight()
    reg.add("LLM", "req-2", "replica-b")
    reg.add("LLM", "req-3", "replica-b")
    reg.add("Other", "req-2", "replica-b")
    reg.forget_replica("LLM", "replica-b")
    assert reg.count("LLM", "replica-b") == 0 and reg.count("Other", "replica-b") == 1
    router.request_finished("LLM", "req-2")  # finishing a forgotten request changes nothing
    assert reg.count("LLM", "replica-b") == 0
    router.request_finished("Other", "req-2")
