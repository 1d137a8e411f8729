"""Joining a cluster at an address nothing listens on fails within seconds with a
ConfigError naming the address, instead of ``ray.init``'s minutes of retries; a port that
starts listening within the wait, or one that accepts, is not taken for a dead one."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from mooncake_ray._private import rayjoin
from mooncake_ray.errors import ConfigError


@pytest.fixture
def dead_port():
    """A port bound here and never listened on: every connection to it is refused, and no
    other process can take it meanwhile."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@pytest.fixture
def no_ray_init(monkeypatch):
    """Reaching ray.init records the call and raises instead of joining anything."""
    import ray

    calls = []

    def init(*args, **kwargs):
        calls.append(kwargs.get("address", args[0] if args else None))
        raise RuntimeError("ray.init reached")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return calls


def test_a_port_nothing_listens_on_is_a_config_error_without_ray_init(no_ray_init, monkeypatch, dead_port):
    monkeypatch.setattr(rayjoin, "REFUSED_WAIT_S", 0.5)
    address = f"127.0.0.1:{dead_port}"
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        rayjoin.join(address)
    assert time.monotonic() - t0 < 5
    assert no_ray_init == []
    msg = str(e.value)
    assert repr(address) in msg and "nothing listens" in msg and "ray start --head" in msg, msg


def test_a_port_that_starts_listening_within_the_wait_is_not_refused():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))  # refused until it listens
    t = threading.Timer(0.5, srv.listen)
    t.start()
    try:
        t0 = time.monotonic()
        assert not rayjoin._refused(f"127.0.0.1:{srv.getsockname()[1]}", 3.0)
        assert 0.4 < time.monotonic() - t0 < 2.5
    finally:
        t.join()
        srv.close()


def test_refused_distinguishes_a_listener(dead_port):
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        assert not rayjoin._refused(f"127.0.0.1:{srv.getsockname()[1]}", 0.2)
    assert rayjoin._refused(f"127.0.0.1:{dead_port}", 0.2)
    assert not rayjoin._refused("no-port-here", 0.2)  # not host:port: left to ray.init


def test_a_seeded_process_joins_with_ids_of_its_own_and_keeps_its_sequence(monkeypatch):
    """Ray draws the ids of a joining process's GCS subscriptions from Python's ``random``;
    two engine processes seeded alike must still draw different ones, and each must go on
    with the sequence its seed gave it."""
    import random

    import ray

    drawn = []
    monkeypatch.setattr(ray, "init", lambda *a, **kw: drawn.append(random.getrandbits(224)))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    state = random.getstate()  # the other tests' sequence
    try:
        random.seed(0)
        expected_next = random.random()
        after = []
        for _ in range(2):  # two processes of one seed, each joining
            random.seed(0)
            rayjoin.join(None)
            after.append(random.random())
        random.seed(0)
        seeded_draw = random.getrandbits(224)
    finally:
        random.setstate(state)
    assert drawn[0] != drawn[1] and seeded_draw not in drawn, drawn
    assert after == [expected_next, expected_next]
