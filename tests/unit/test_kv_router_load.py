"""The KV router's load accounting between a decision and Serve's report that the request
was routed: decisions made side by side see each other, and other routers' requests (other
ingress replicas) count while they likely run (no Serve, no Ray: the router's own methods on
fake replicas, called as Serve calls them)."""

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
    r._use_replica_queue_len_cache = False  # Serve's own cache: off (its base methods then do nothing)
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


def test_the_best_replica_is_offered_alone_while_serve_retries_and_nothing_is_held_twice(router):
    """Serve takes the next replica offered when the first does not answer its queue-length
    probe within 0.1 s (a busy replica): the best is offered alone for the first tries."""
    from mooncake_ray.integrations.kv_router import BEST_TRIES

    r = router
    reps = [fake_replica("a"), fake_replica("b")]
    req = fake_request(0)
    offered = [asyncio.run(r.choose_replicas(reps, req)) for _ in range(BEST_TRIES + 1)]
    best = offered[0][0][0].replica_id.to_full_id_str()
    assert [len(o) for o in offered] == [1] * (BEST_TRIES - 1) + [2, 2], offered
    assert all(o[0][0].replica_id.to_full_id_str() == best for o in offered)
    # every try held the request's work once, not once per try
    assert {k: v.requests for k, v in r._load.items() if v.requests} == {best: 1}
    other = reps[1] if best == "a" else reps[0]
    r.on_request_routed(req, other.replica_id, None)  # Serve took the second after all
    assert {k: v.requests for k, v in r._load.items() if v.requests} == {other.replica_id.to_full_id_str(): 1}
    r.on_request_completed(other.replica_id, "req0")
    assert all((v.requests, v.tokens) == (0, 0) for v in r._load.values())


def test_a_best_replica_full_by_this_routers_count_is_not_offered_alone(router):
    r = router
    reps = [fake_replica("a"), fake_replica("b")]
    for rep in reps:
        rep.max_ongoing_requests = 2
    r._hold("a", 10), r._hold("a", 10)  # two requests in flight there: full
    r._hold("b", 5000), r._hold("b", 5000)
    r._load["b"].requests = 1  # b: room, but far more work queued, so "a" ranks first
    got = asyncio.run(r.choose_replicas(reps, fake_request(0)))
    assert [g[0].replica_id.to_full_id_str() for g in got] == ["a", "b"]


def test_other_routers_requests_count_until_ours_accepted_with_them_finishes_or_one_mean_request_time(router):
    """Serve's queue-length cache keeps another router's request until ten seconds after its
    last update (it never sees it finish): with two ingress replicas a conversation's holder
    looked busy and its later turns went elsewhere. The router counts the replica's report
    beyond its own requests, and only for one mean request time, or until its own request
    accepted with them finishes (they were in flight before it: a conversation's next turn,
    sent as its previous one finished, went to the other engine while they still counted)."""
    r = router
    reps = [fake_replica("a"), fake_replica("b")]
    a = reps[0].replica_id
    req0, req1 = fake_request(0), fake_request(1)
    asyncio.run(r.choose_replicas(reps, req0))
    r.on_new_queue_len_info(a, 3)  # "a" accepts it, with two of another router's in flight
    r.on_request_routed(req0, a, None)
    loads = r._loads(reps)
    assert (loads["a"].requests, loads["b"].requests) == (3, 0)
    assert loads["a"].tokens == 3 * r._load["a"].tokens  # each counted as a mean request of ours
    # a second request of ours accepted later, the replica then reporting 4: 2 of ours, 2 others'
    r._routed_at["req0"] -= 1.0  # ours took a second
    r._queue_report.clear()
    asyncio.run(r.choose_replicas([reps[0]], req1))
    r.on_new_queue_len_info(a, 4)
    r.on_request_routed(req1, a, None)
    r.on_request_completed(a, "req0")
    assert r._loads(reps)["a"].requests == 3  # req1's report is newer than req0: it stays
    n, seen = r._others["a"]
    r._others["a"] = (n, seen - r._mean_s - 0.01)  # one mean request time later
    assert r._loads(reps)["a"].requests == 1  # only ours
    r._others["a"] = (n, seen)
    r.on_request_completed(a, "req1")  # accepted with them, now finished: they went before it
    assert r._loads(reps)["a"] == kvi.Load(0, 0)


def test_a_report_not_from_accepting_a_request_of_ours_is_not_taken_for_others(router):
    r = router
    reps = [fake_replica("a"), fake_replica("b")]
    r.on_new_queue_len_info(reps[1].replica_id, 5)  # a probe's or a rejection's answer, no request routed
    req = fake_request(0)
    asyncio.run(r.choose_replicas(reps, req))
    r._queue_report["b"] = (5, r._queue_report["b"][1] - 2.0)  # two seconds old
    r.on_request_routed(req, reps[1].replica_id, None)
    assert r._loads(reps)["b"].requests == 1


def test_equal_choices_go_round_the_replicas_one_decision_after_another():
    """First turns of new conversations reaching a router one after another (each finished
    before the next is decided): nothing cached, engines idle, every cost equal. They
    alternate over the engines; a random pick sent four of them to one engine in a CI run
    (one time in eight)."""
    r = MooncakeKVRouter.__new__(MooncakeKVRouter)
    r.initialize_state()
    r._replica_queue_len_cache = None
    r._use_replica_queue_len_cache = False
    try:
        reps = [fake_replica("b"), fake_replica("a"), fake_replica("c")]
        firsts = []
        for i in range(6):
            req = fake_request(i)
            got = asyncio.run(r.choose_replicas(reps, req))  # no prompt: by load
            rid = got[0][0].replica_id
            r.on_request_routed(req, rid, None)
            r.on_request_completed(rid, f"req{i}")
            firsts.append(rid.to_full_id_str())
        assert sorted(firsts[:3]) == ["a", "b", "c"] and firsts[3:] == firsts[:3], firsts
    finally:
        r._feed.close()


def test_the_mean_request_time_is_the_first_measured_until_more_come(router):
    """Another router's request is counted for one mean request time after the replica
    reported it. The mean starts at the first request this router measured, not at a guess
    that an average would keep for many requests."""
    import time as _time

    r = router
    reps = [fake_replica("a"), fake_replica("b")]
    assert r._mean_s is None
    req = fake_request(0)
    asyncio.run(r.choose_replicas(reps, req))
    r.on_new_queue_len_info(reps[0].replica_id, 2)  # one of another router's in flight there
    r.on_request_routed(req, reps[0].replica_id, None)
    r._routed_at["req0"] = _time.monotonic() - 0.25  # ours took 0.25 s
    r.on_request_completed(reps[0].replica_id, "req0")
    assert r._mean_s == pytest.approx(0.25, abs=0.05)
    n, seen = r._others["a"]
    r._others["a"] = (n, seen - 0.5)  # half a second after the report: that request is done
    assert r._loads(reps)["a"] == kvi.Load(0, 0)
