"""The KV router's load accounting between a decision and Serve's report that the request
was routed: decisions made side by side see each other (no Serve, no Ray: the router's
own methods on fake replicas)."""

import asyncio
import types

import pytest

from mooncake_ray.integrations import _kv_index as kvi
from mooncake_ray.integrations.kv_router import MooncakeKVRouter


def fake_replica(name):
    return types.SimpleNamespace(replica_id=types.SimpleNamespace(to_full_id_str=lambda: name))


def fake_request(i):
    return types.SimpleNamespace(metadata=types.SimpleNamespace(internal_request_id=f"req{i}"), args=[])


@pytest.fixture
def router():
    r = MooncakeKVRouter.__new__(MooncakeKVRouter)  # Serve's base needs a running controller
    r.initialize_state()
    r._replica_queue_len_cache = None
    r._ties = lambda candidates: {c.replica_id.to_full_id_str(): 0.0 for c in candidates}  # no luck

    async def decide(candidates, pending_request):
        await asyncio.sleep(0.01)  # the store lookup: every decision is in flight at once
        zero = {c.replica_id.to_full_id_str(): 0 for c in candidates}
        return kvi.choose(100, 32, zero, None, r._loads(candidates), r._model, r._ties(candidates))

    r._decide = decide
    yield r
    r._feed.close()  # its thread would outlive the test in this process


def test_requests_decided_together_are_spread_and_the_hold_moves_to_where_serve_routed_them(router):
    r = router
    reps = [fake_replica("a"), fake_replica("b")]

    async def four():
        return await asyncio.gather(*(r.choose_replicas(reps, fake_request(i)) for i in range(4)))

    ranked = asyncio.run(four())
    firsts = [got[0][0].replica_id.to_full_id_str() for got in ranked]
    assert sorted(firsts) == ["a", "a", "b", "b"], firsts
    assert (r._load["a"].requests, r._load["b"].requests) == (2, 2)
    # Serve routes req0 to "b" after all (its first choice was busy): the hold moves there
    r.on_request_routed(fake_request(0), reps[1].replica_id, None)
    moved = {"a": 1, "b": 3} if firsts[0] == "a" else {"a": 2, "b": 2}
    assert {k: v.requests for k, v in r._load.items()} == moved
    for i in range(1, 4):  # req1 routed, the others cancelled before routing
        if i == 1:
            r.on_request_routed(fake_request(i), reps[0].replica_id, None)
        r.on_request_completed(reps[0].replica_id, f"req{i}")
    r.on_request_completed(reps[1].replica_id, "req0")
    assert {k: (v.requests, v.tokens) for k, v in r._load.items()} == {"a": (0, 0), "b": (0, 0)}
