"""The router's event feed against vLLM's own ZMQ publisher (``ZmqEventPublisher``: PUB
for live batches, ROUTER for replays), on loopback: batches published before the feed
connects are replayed, and so are those missed while disconnected, on reconnecting, and
those a subscription missed as it was being made;
batches the publisher no longer keeps leave the index reset and stale."""

from __future__ import annotations

import time

import pytest

from mooncake_ray.integrations.kv_router import EventFeed, events_config
from mooncake_ray.kv import page_hashes
from tests.integration.serve_cli import free_port
from tests.unit.test_kv_index import BS, stored

ev = pytest.importorskip("vllm.distributed.kv_events")
pytestmark = pytest.mark.timeout(60)

TOK = list(range(200, 200 + 10 * BS))
H = page_hashes(TOK, BS)


class Engine:
    """A publisher as a vLLM engine runs it; ``block(i)`` publishes block i of TOK."""

    def __init__(self, buffer_steps: int = 10_000):
        cfg, self.rec = events_config("127.0.0.1")  # as the Serve backend configures an engine
        self.pub = ev.ZmqEventPublisher(0, endpoint=cfg["endpoint"],
                                        replay_endpoint=self.rec["replay_endpoint"], buffer_steps=buffer_steps)

    def block(self, i: int) -> None:
        parent = None if i == 0 else i - 1
        self.pub.publish(ev.KVEventBatch(ts=time.time(), events=[stored([i], parent, TOK[i * BS:(i + 1) * BS])]))

    def close(self):
        self.pub.shutdown()


def wait_for(pred, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


@pytest.fixture
def feed():
    f = EventFeed(stale_s=2.0, replay_timeout_s=1.0)
    yield f
    f.close()


def test_batches_before_connecting_and_while_disconnected_are_replayed(feed):
    eng = Engine()
    try:
        for i in range(3):
            eng.block(i)  # before the feed exists: only a replay can bring them
        time.sleep(0.2)
        feed.add("r1", eng.rec, BS)
        assert wait_for(lambda: feed.match("r1", H) == 3)
        eng.block(3)
        assert wait_for(lambda: feed.match("r1", H) == 4)
        feed.disconnect("r1")
        time.sleep(0.2)
        for i in (4, 5, 6):
            eng.block(i)  # published while nobody listens: lost to the feed
        time.sleep(0.2)
        feed.reconnect("r1")  # asks for everything after the last batch it applied
        assert wait_for(lambda: feed.match("r1", H) == 7), feed.match("r1", H)
        assert feed.gaps == {"replayed": 1, "lost": 0, "silent": 0}
        eng.block(7)
        assert wait_for(lambda: feed.match("r1", H) == 8)
    finally:
        eng.close()


def test_batches_the_engine_no_longer_keeps_reset_the_index_to_stale(feed):
    eng = Engine(buffer_steps=2)
    try:
        feed.add("r1", eng.rec, BS)
        time.sleep(0.5)
        eng.block(0)
        assert wait_for(lambda: feed.match("r1", H) == 1)
        feed.disconnect("r1")
        time.sleep(0.2)
        for i in range(1, 6):
            eng.block(i)  # 5 batches, the publisher keeps 2
        time.sleep(0.2)
        feed.reconnect("r1")
        time.sleep(0.3)
        eng.block(6)
        assert wait_for(lambda: feed.gaps["lost"] == 1)
        assert feed.match("r1", H) == 0  # reset, and stale: counts as holding nothing
        assert wait_for(lambda: feed.match("r1", H) == 0 and not feed.indexes["r1"].stale, 5)
        # it rebuilt from what came after the loss: blocks 5 and 6, whose chain from
        # block 0 it cannot know, so the prompt's prefix still matches nothing
        assert feed.indexes["r1"].blocks == 0 and feed.indexes["r1"].unnamed >= 1
    finally:
        eng.close()


def test_after_an_empty_first_replay_the_feed_expects_batch_zero(feed):
    """The first replay found nothing (the engine had published nothing yet): the feed then
    expects batch 0, so a batch lost to the subscription's start (ZMQ's slow joiner) shows
    as a gap when the next one arrives, and is replayed then. (It expected nothing: batch 3
    after a lost 0-2 was taken as the first, and the engine's chain was never known.)"""
    eng = Engine()
    try:
        feed.add("r1", eng.rec, BS)
        assert wait_for(lambda: feed.indexes["r1"].next_seq == 0)  # the empty replay answered
        assert feed.indexes["r1"].gap(3) and not feed.indexes["r1"].gap(0)
        time.sleep(0.3)
        for i in range(3):
            eng.block(i)
        assert wait_for(lambda: feed.match("r1", H) == 3)
        assert feed.gaps == {"replayed": 0, "lost": 0, "silent": 0}
    finally:
        eng.close()


def test_batches_a_subscription_missed_as_it_was_made_come_by_probe_without_a_later_batch(feed):
    """ZMQ's slow joiner: batches published while the live subscription is still being
    made are lost to it, and a quiet engine may publish nothing after them that would show
    the gap (in a two-ingress Serve app, a router made at its first request subscribed as
    the engine stored that request's blocks; the conversation's next turn went elsewhere).
    Until a live batch arrives, the feed asks the replay socket again every second. Here
    the live endpoint never answers, so every batch can only come that way."""
    eng = Engine()
    try:
        rec = {**eng.rec, "endpoint": f"tcp://127.0.0.1:{free_port()}"}  # a subscription that never takes
        feed.add("r1", rec, BS)
        assert wait_for(lambda: feed.indexes["r1"].next_seq == 0)  # the first, empty, replay answered
        for i in range(3):
            eng.block(i)
        assert wait_for(lambda: feed.match("r1", H) == 3, 5), feed.match("r1", H)
        time.sleep(2.2)  # probes that find nothing new count as no gap
        assert feed.gaps == {"replayed": 1, "lost": 0, "silent": 0}
        assert feed.match("r1", H) == 3 and not feed.indexes["r1"].stale
    finally:
        eng.close()


def test_an_engine_that_is_not_there_only_empties_its_index(feed):
    rec = {"endpoint": f"tcp://127.0.0.1:{free_port()}", "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}
    feed.add("gone", rec, BS)
    assert wait_for(lambda: feed.gaps["lost"] == 1)  # the replay never answered
    assert feed.match("gone", H) == 0
    feed.remove("gone")
    assert "gone" not in feed.indexes and feed.match("gone", H) == 0


def test_a_feed_with_no_engine_waits_instead_of_spinning(feed):
    """With nothing subscribed (a router before its replicas' records, or after the last
    went) zmq's poll returns at once: the feed's thread waits on its commands instead, so
    its loop turns at most every 50 ms. (It spun: a whole core, and the GIL, in every
    process holding such a router.)"""
    time.sleep(0.2)
    before = feed.rounds
    time.sleep(1.0)
    assert feed.rounds - before <= 25, feed.rounds - before
    rec = {"endpoint": f"tcp://127.0.0.1:{free_port()}", "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}
    feed.add("gone", rec, BS)  # a command still wakes it at once
    assert wait_for(lambda: feed.gaps["lost"] == 1)
    feed.remove("gone")
    time.sleep(0.2)
    before = feed.rounds
    time.sleep(1.0)
    assert feed.rounds - before <= 25, feed.rounds - before


def test_publisher_ports_avoid_the_kernels_and_rays_ranges_and_ports_in_use():
    """The engine binds its event ports a minute after they are chosen: they come from
    outside the range the kernel takes outgoing connections' local ports from (a port it
    handed out was taken meanwhile, and the replica failed to start), above Ray's workers'."""
    import random
    import socket

    from mooncake_ray.integrations.kv_router import RAY_WORKER_PORTS, _ephemeral_ports, publisher_ports

    lo, hi = _ephemeral_ports()
    ports = publisher_ports("127.0.0.1", 50, random.Random(1))
    assert len(set(ports)) == 50
    for p in ports:
        assert not lo <= p <= hi and p > RAY_WORKER_PORTS[1], p
    # a port in use is passed over: the same draw with its first port taken
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports[0]))
        taken.listen()
        again = publisher_ports("127.0.0.1", 2, random.Random(1))
    assert ports[0] not in again and again[0] == ports[1]


def _router(silent_s: float):
    """The router's own methods around a real feed (Serve's base needs a controller)."""
    from mooncake_ray.integrations import _kv_index as kvi
    from mooncake_ray.integrations.kv_router import MooncakeKVRouter

    r = MooncakeKVRouter.__new__(MooncakeKVRouter)
    r.initialize_state(silent_s=silent_s, stale_s=2.0)
    r._feed.close()
    r._feed = EventFeed(stale_s=2.0, replay_timeout_s=1.0)
    r._block_size = BS

    def route(rid: str, i: int, prompt_tokens: int = 6 * BS):
        """Serve reports a request routed to ``rid``, decided on an empty engine match."""
        import types

        dec = kvi.choose(prompt_tokens, BS, {rid: 0}, None, {}, r._model)
        key = f"req{i}"
        r._pending[key] = (dec, 0.0, None, 1)
        req = types.SimpleNamespace(metadata=types.SimpleNamespace(internal_request_id=key))
        r.on_request_routed(req, types.SimpleNamespace(to_full_id_str=lambda: rid), None)

    return r, route


def test_an_engine_whose_events_stop_is_resubscribed_and_routed_by_load_until_they_flow():
    """Two requests that must store blocks went to an engine and no batch of its came for
    silent_s: the router subscribes again. A link that had dropped gets its batches back by
    replay; a publisher that is gone leaves the index reset (the replica holds nothing in
    the router's eyes, so the store and load decide), and no decision fails meanwhile."""
    r, route = _router(silent_s=0.5)
    eng = Engine()
    try:
        r._records["r1"] = eng.rec
        r._feed.add("r1", eng.rec, BS)
        time.sleep(0.5)  # subscribed: what comes next arrives live
        for i in range(3):
            eng.block(i)
        assert wait_for(lambda: r._feed.match("r1", H) == 3)
        # events flow: the expectation is met by the next batch, nothing is resynced
        route("r1", 0)
        route("r1", 1)
        eng.block(3)
        assert wait_for(lambda: r._feed.match("r1", H) == 4)
        time.sleep(0.6)
        r._check_silent()
        assert r._expect == {} and r._feed.gaps["silent"] == 0
        # the link drops (the router misses batches 4, 5) and nothing more comes
        r._feed.disconnect("r1")
        time.sleep(0.2)
        eng.block(4)
        eng.block(5)
        route("r1", 2)
        r._check_silent()
        assert r._feed.gaps["silent"] == 0  # one request is not enough to call it silent
        route("r1", 3)
        time.sleep(0.6)
        r._check_silent()  # silent: subscribed again, and the replay brings 4 and 5 back
        assert r._feed.gaps["silent"] == 1
        assert wait_for(lambda: r._feed.match("r1", H) == 6), r._feed.match("r1", H)
        assert r._feed.gaps["lost"] == 0
        # the publisher goes away: routing keeps going, the index ends reset
        eng.close()
        route("r1", 4)
        route("r1", 5)
        time.sleep(0.6)
        r._check_silent()
        assert wait_for(lambda: r._feed.gaps["lost"] == 1)  # the replay never answered
        assert r._feed.match("r1", H) == 0 and r._feed.gaps["silent"] == 2
        # short prompts (no full block to store) set no expectation
        route("r1", 6, prompt_tokens=BS - 1)
        assert "r1" not in r._expect
    finally:
        r._feed.close()
        eng.close()
