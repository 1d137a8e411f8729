"""RPC over UCX active messages between two processes: Python and C++ handlers, errors,
timeouts, large payloads, concurrency, nested calls, asyncio."""

from __future__ import annotations

import asyncio
import time

import pytest

from mooncake_ray.errors import InvalidArgumentError, RemoteHandlerError, TransferTimeoutError
from tests.native.peer_proc import pattern
from tests.native.transport_util import PeerProcess, engines, run_threads  # noqa: F401 - fixture

MIB = 1 << 20


@pytest.fixture(scope="module", params=["shm", "tcp"])
def peer(request):
    p = PeerProcess(protocol=request.param, devices=["lo"], name=f"rpc-{request.param}")
    p.protocol = request.param
    yield p
    p.close()


@pytest.fixture
def conn(peer, engines):
    eng = engines(protocol=peer.protocol)
    return eng, eng.connect(peer.address, timeout_s=10)


def test_echo_python_and_native(conn):
    eng, p = conn
    assert eng.call(p, 1, b"hello") == b"hello"
    assert eng.call(p, 1, b"") == b""
    assert eng.call(p, 100, b"native") == b"native"
    assert eng.call(p, 1, bytearray(b"ba")) == b"ba"
    assert eng.call(p, 1, memoryview(b"mv")) == b"mv"


def test_handler_raises(conn):
    eng, p = conn
    with pytest.raises(RemoteHandlerError, match="ValueError: boom: x"):
        eng.call(p, 2, b"x")
    assert eng.call(p, 1, b"still ok") == b"still ok"


def test_unknown_handler(conn):
    eng, p = conn
    with pytest.raises(RemoteHandlerError, match="no handler registered for id 4242"):
        eng.call(p, 4242, b"x")


def test_timeout_leaves_engine_usable(conn):
    eng, p = conn
    t = time.monotonic()
    with pytest.raises(TransferTimeoutError):
        eng.call(p, 3, b"0.6", timeout_s=0.2)
    assert 0.15 < time.monotonic() - t < 0.5
    assert eng.call(p, 1, b"after") == b"after"
    time.sleep(0.6)  # the late reply arrives and is dropped
    assert eng.call(p, 1, b"later") == b"later"
    assert eng.stats()["pending"] == 0


@pytest.mark.parametrize("size", [64 * 1024, 8 * MIB + 3, 48 * MIB])
def test_large_reply(conn, size):
    eng, p = conn
    out = eng.call(p, 4, str(size).encode(), timeout_s=30)
    assert len(out) == size and out == pattern(size)


def test_large_request(conn):
    eng, p = conn
    payload = pattern(20 * MIB)[::-1]
    assert eng.call(p, 1, payload, timeout_s=30) == payload
    assert eng.call(p, 100, payload, timeout_s=30) == payload


def test_many_threads_many_calls(conn):
    eng, p = conn

    def worker(k: int) -> None:
        handles = []
        for i in range(100):
            msg = f"{k}:{i}".encode()
            if i % 3 == 0:
                handles.append((msg, eng.call_async(p, 1 if i % 2 else 100, msg)))
            else:
                assert eng.call(p, 1, msg) == msg
        for msg, h in handles:
            assert h.result(10) == msg

    errors = run_threads(worker, 6)
    assert not errors, errors[:3]


def test_call_many(conn):
    eng, p = conn
    calls = [(p, 1, b"a"), (p, 2, b"bad"), (p, 100, b"c"), (p, 999, b"d"), (p, 3, b"0.5")]
    out = eng.call_many(calls, timeout_s=0.3)
    assert out[0] == b"a" and out[2] == b"c"
    assert isinstance(out[1], RemoteHandlerError) and "boom" in str(out[1])
    assert isinstance(out[3], RemoteHandlerError)
    assert isinstance(out[4], TransferTimeoutError)


def test_nested_rpc(peer, conn):
    eng, p = conn
    eng.serve(9, lambda b: b"inner:" + b)
    peer.cmd("connect", address=__import__("base64").b64encode(eng.address).decode())
    # the peer's handler 5 calls our handler 9, from its dispatcher thread
    assert eng.call(p, 5, b"9", timeout_s=10) == b"inner:nested"
    # and our handler may call the peer while serving (re-entrant engine use)
    eng.serve(10, lambda b: eng.call(p, 1, b"from-handler:" + b, timeout_s=5))
    assert eng.call(p, 5, b"10", timeout_s=10) == b"from-handler:nested"


def test_asyncio(conn):
    eng, p = conn

    async def main():
        hs = [eng.call_async(p, 1 if i % 2 else 100, str(i).encode()) for i in range(50)]
        outs = await asyncio.gather(*hs)
        assert outs == [str(i).encode() for i in range(50)]
        slow = eng.call_async(p, 3, b"0.2")
        t = time.monotonic()
        ticks = 0
        while not slow.done():  # the loop keeps running while the call is in flight
            await asyncio.sleep(0.01)
            ticks += 1
        assert ticks > 5 and await slow == b"slept"
        with pytest.raises(RemoteHandlerError):
            await eng.call_async(p, 2, b"x")
        return time.monotonic() - t

    assert asyncio.run(main()) < 5


def test_bad_payload(conn):
    eng, p = conn
    with pytest.raises(InvalidArgumentError):
        eng.call(p, 1, "not bytes")  # type: ignore[arg-type]


def test_replies_come_back_on_the_calling_lane(engines):
    """A client with more lanes than the server (the master has one) sends each call on a
    lane the server has a worker for, so the reply arrives on the lane its caller spins on
    (otherwise it waits for another lane's sleeping progress thread)."""
    srv = PeerProcess(protocol="shm", devices=["lo"], name="rpc-one-lane", num_lanes=1)
    try:
        eng = engines(protocol="shm", num_lanes=3)
        p = eng.connect(srv.address, timeout_s=10)

        def worker(k: int) -> None:
            for i in range(20):
                msg = f"{k}:{i}".encode()
                assert eng.call(p, 100 if i % 2 else 1, msg) == msg

        errors = run_threads(worker, 8)
        assert not errors, errors[:3]
        st = eng.stats()
        assert st["calls_sent"] >= 160
        assert st["replies_off_lane"] == 0
    finally:
        srv.close()


@pytest.mark.parametrize("protocol", ["shm", "tcp"])
def test_an_inline_handler_keeps_a_request_and_another_thread_answers_it(engines, protocol):
    """``hold_request`` inside an inline handler: the handler's return is not sent; ``reply``
    from any thread answers the caller later (the master holds put replies so)."""
    srv = engines(protocol=protocol, name="holder")
    cli = engines(protocol=protocol, name="asker")
    kept = []

    def handler(payload):
        if payload == b"now":
            return b"answered inline"
        kept.append((srv.hold_request(), payload))
        return b"never sent"

    srv.serve(7, handler, inline=True)
    p = cli.connect(srv.address, timeout_s=10)
    first, second = cli.call_async(p, 7, b"one"), cli.call_async(p, 7, b"two")
    deadline = time.monotonic() + 5
    while len(kept) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [k[1] for k in kept] == [b"one", b"two"]
    assert cli.call(p, 7, b"now") == b"answered inline"  # the lane is not blocked meanwhile
    assert not first.done() and not second.done()
    srv.reply(kept[1][0], b"later: two")  # in any order
    srv.reply(kept[0][0], b"later: one")
    assert first.result(5) == b"later: one" and second.result(5) == b"later: two"
    assert srv.hold_request() is None  # outside a handler
