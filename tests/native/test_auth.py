"""Peer authentication (native/src/transport/auth.cpp) and checks on what comes off the
wire: two engines with the same secret work as before; an outsider holding only the
server's address bytes (no secret, or another one) cannot connect, its raw requests are
dropped unread, a captured handshake message cannot be replayed, malformed HELLOs do not
bring the receiver down, and a lying msgpack count does not allocate."""

from __future__ import annotations

import base64
import hashlib
import os
import resource
import struct
import time

import numpy as np
import pytest

from mooncake_ray._private import rpc
from mooncake_ray._private.native import _native
from mooncake_ray.errors import AuthenticationError, InvalidArgumentError
from tests.native.transport_util import addr_of, engines, spawn_peer  # noqa: F401 - fixtures

SECRET = b"cluster-secret-0123456789abcdef!"
OTHER = b"another-secret-0123456789abcdef!"
AM_HELLO, AM_RPC_REQ, AM_PUSH_REQ, AM_AUTH1, AM_AUTH2 = 21, 23, 25, 26, 28
COUNT_HANDLER = 6


def _secret_engine(engines, secret=SECRET, **kw):
    e = engines(**kw)
    if secret is not None:
        e.set_auth_secret(secret)
    return e


def _stats(peer) -> dict:
    return peer.cmd("stats")


def _wait_for(pred, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def _lane_addresses(address: bytes) -> list[bytes]:
    """The per-lane UCX worker addresses inside an engine address (see parse_address)."""
    pos = 12
    (n,) = struct.unpack_from("<I", address, pos)
    pos += 4
    for _ in range(2):  # name, host id
        (ln,) = struct.unpack_from("<I", address, pos)
        pos += 4 + ln
    pos += 4 + 8  # pid, start time
    lanes = []
    for _ in range(n):
        (ln,) = struct.unpack_from("<I", address, pos)
        lanes.append(address[pos + 4 : pos + 4 + ln])
        pos += 4 + ln
    return lanes


def _address(uid: int, lanes: list[bytes], name: bytes = b"evil") -> bytes:
    out = struct.pack("<IQI", 0x3152434D, uid, len(lanes))
    out += struct.pack("<I", len(name)) + name
    out += struct.pack("<I", 0) + struct.pack("<IQ", 1, 0)  # no host id: not "same host"
    for lane in lanes:
        out += struct.pack("<I", len(lane)) + lane
    return out


@pytest.mark.parametrize("protocol", ["shm", "tcp"])
def test_same_secret_connects_calls_and_transfers(engines, spawn_peer, protocol):
    peer = spawn_peer(protocol=protocol, auth_secret=SECRET.hex(), num_lanes=2)
    eng = _secret_engine(engines, protocol=protocol, num_lanes=2)
    assert eng._native.auth_enabled
    p = eng.connect(peer.address, timeout_s=10)
    assert eng.call(p, 1, b"hello") == b"hello"
    assert eng.call(p, 100, b"native" * 1000) == b"native" * 1000
    assert eng.call(p, COUNT_HANDLER, b"") == b"counted"
    assert eng.call(p, 4, b"9000000", timeout_s=30) == (bytes(range(256)) * 35157)[:9000000]
    rr = eng.import_remote(p, *peer.regions["arena"])
    buf = np.zeros(4 << 20, dtype=np.uint8)
    local = eng.register(buf)
    eng.read([(rr, 4096, addr_of(buf), buf.nbytes)])
    assert hashlib.sha256(buf).hexdigest() == peer.sha("arena", 4096, buf.nbytes)
    buf[:] = 7
    rs = eng.import_remote(p, *peer.regions["scratch"])
    eng.write([(rs, 0, addr_of(buf), buf.nbytes)])
    assert peer.sha("scratch", 0, buf.nbytes) == hashlib.sha256(buf).hexdigest()
    # The peer connects back (a handshake in the other direction), then calls us.
    eng.serve(1, lambda b: b)
    peer.cmd("connect", address=base64.b64encode(eng.address).decode())
    assert eng.call(p, 5, b"1", timeout_s=10) == b"nested"
    local.close()
    s = _stats(peer)
    assert s["auth_enabled"] == 1 and s["auth_handshakes"] >= 2 and s["auth_rejected"] == 0
    assert eng.stats()["auth_rejected"] == 0


def test_secret_is_checked_and_set_once(engines):
    e = engines()
    with pytest.raises(InvalidArgumentError, match="at least 16 bytes"):
        e.set_auth_secret(b"short")
    e.set_auth_secret(SECRET)
    with pytest.raises(InvalidArgumentError, match="already set"):
        e.set_auth_secret(OTHER)


@pytest.mark.parametrize(
    "client_secret,server_secret,message",
    [
        (OTHER, SECRET, "different auth secrets"),
        (None, SECRET, "requires authentication"),
        (SECRET, None, "has no auth secret"),
    ],
)
def test_mismatched_secrets_fail_fast(engines, spawn_peer, client_secret, server_secret, message):
    kw = {"auth_secret": server_secret.hex()} if server_secret else {}
    peer = spawn_peer(protocol="tcp", **kw)
    eng = _secret_engine(engines, secret=client_secret, protocol="tcp")
    t = time.monotonic()
    with pytest.raises(AuthenticationError, match=message):
        eng.connect(peer.address, timeout_s=10)
    assert time.monotonic() - t < 3
    assert peer.cmd("count")["count"] == 0
    if server_secret:
        assert _stats(peer)["peers"] == 0
    # The server still serves engines that hold its secret.
    good = _secret_engine(engines, secret=server_secret, protocol="tcp")
    assert good.call(good.connect(peer.address, timeout_s=10), 1, b"ok") == b"ok"


@pytest.mark.parametrize("outsider_secret", [None, OTHER])
def test_outsider_requests_are_dropped_unread(engines, spawn_peer, outsider_secret):
    peer = spawn_peer(protocol="tcp", auth_secret=SECRET.hex())
    legit = _secret_engine(engines, protocol="tcp")
    lp = legit.connect(peer.address, timeout_s=10)
    assert legit.call(lp, COUNT_HANDLER, b"") == b"counted"
    before = _stats(peer)
    rkey, base, length = peer.regions["arena"]
    out = _secret_engine(engines, secret=outsider_secret, protocol="tcp")
    with pytest.raises(AuthenticationError):
        out.connect(peer.address, timeout_s=5)
    sent = 0
    for uid in (out.uid, legit.uid):  # its own uid, and a legitimate engine's (spoofed)
        for tok in (bytes(16), os.urandom(16)):
            hdr = struct.pack("<QQII", uid, 1000 + sent, COUNT_HANDLER, 0) + tok
            out._native._debug_send_raw(peer.address, AM_RPC_REQ, hdr, b"x" * 100)
            # A push request naming the server's arena: it would put bytes into our buffer.
            body = rkey + struct.pack("<QQQ", base, 0x10000, 4096)
            hdr = struct.pack("<QQII", uid, 2000 + sent, len(rkey), 1) + tok
            out._native._debug_send_raw(peer.address, AM_PUSH_REQ, hdr, body)
            sent += 1
    assert _wait_for(lambda: _stats(peer)["auth_rejected"] >= before["auth_rejected"] + 2 * sent)
    after = _stats(peer)
    assert peer.cmd("count")["count"] == 1  # the legitimate call only
    assert after["calls_served"] == before["calls_served"]
    assert after["push_served_bytes"] == before["push_served_bytes"]
    st = out.stats()
    assert st["pending"] == 0  # nothing was answered to the outsider
    # The legitimate engine is unaffected.
    assert legit.call(lp, COUNT_HANDLER, b"") == b"counted"
    buf = np.zeros(1 << 20, dtype=np.uint8)
    legit.read([(legit.import_remote(lp, rkey, base, length), 0, addr_of(buf), buf.nbytes)])
    assert hashlib.sha256(buf).hexdigest() == peer.sha("arena", 0, buf.nbytes)


def test_outsider_has_no_peer_to_transfer_with(engines, spawn_peer):
    peer = spawn_peer(protocol="tcp", auth_secret=SECRET.hex())
    out = engines(protocol="tcp")
    with pytest.raises(AuthenticationError):
        out.connect(peer.address, timeout_s=5)
    # A second attempt performs a fresh handshake and fails the same way.
    with pytest.raises(AuthenticationError):
        out.connect(peer.address, timeout_s=5)
    assert _stats(peer)["peers"] == 0


def test_replayed_auth2_is_refused(engines, spawn_peer):
    peer = spawn_peer(protocol="tcp", auth_secret=SECRET.hex())
    legit = _secret_engine(engines, protocol="tcp")
    legit.connect(peer.address, timeout_s=10)
    hdr, data = legit._native._debug_last_auth2()
    assert len(hdr) == 64 and data == legit.address
    before = _stats(peer)
    # Replayed by an outsider, and by the legitimate engine itself: the challenge it
    # answered is gone either way.
    out = engines(protocol="tcp")
    out._native._debug_send_raw(peer.address, AM_AUTH2, hdr, data)
    legit._native._debug_send_raw(peer.address, AM_AUTH2, hdr, data)
    assert _wait_for(lambda: _stats(peer)["auth_rejected"] >= before["auth_rejected"] + 2)
    after = _stats(peer)
    assert after["auth_handshakes"] == before["auth_handshakes"]
    assert after["peers"] == before["peers"] == 1


def test_replayed_auth2_after_a_fresh_challenge_is_refused(engines, spawn_peer):
    """An outsider opens a challenge of its own, then answers it with a captured AUTH2
    (rewritten to its own nonce): the MAC covers both nonces."""
    peer = spawn_peer(protocol="tcp", auth_secret=SECRET.hex())
    legit = _secret_engine(engines, protocol="tcp")
    legit.connect(peer.address, timeout_s=10)
    hdr, data = legit._native._debug_last_auth2()
    before = _stats(peer)
    out = engines(protocol="tcp")
    out._native._debug_send_raw(peer.address, AM_AUTH1, struct.pack("<QQ", legit.uid, 9) + os.urandom(16), b"")
    # The outsider never sees the responder's nonce (the reply goes to its worker, which
    # has no handler for it): a guessed nonce finds no challenge.
    forged = hdr[:16] + os.urandom(16) + hdr[32:]
    out._native._debug_send_raw(peer.address, AM_AUTH2, forged, data)
    assert _wait_for(lambda: _stats(peer)["auth_rejected"] >= before["auth_rejected"] + 1)
    assert _stats(peer)["auth_handshakes"] == before["auth_handshakes"]


@pytest.mark.parametrize("secret", [None, SECRET])
def test_garbage_hello_does_not_crash_the_receiver(engines, spawn_peer, secret):
    kw = {"auth_secret": secret.hex()} if secret else {}
    peer = spawn_peer(protocol="tcp", **kw)
    out = engines(protocol="tcp")
    real = _lane_addresses(out.address)[0]
    rng = np.random.default_rng(3)
    garbage = [
        rng.integers(0, 256, 300, dtype=np.uint8).tobytes(),  # random
        real[:1] + rng.integers(0, 256, 300, dtype=np.uint8).tobytes(),  # right UCX version byte
        real[:9],  # header and worker id only
        real[: len(real) // 2],  # truncated
        real[:1] + b"\xff" * 16,
        real[:9] + b"\x00" * 40,
    ]
    for i, lane in enumerate(garbage):
        addr = _address(0xBAD0 + i, [lane])
        out._native._debug_send_raw(peer.address, AM_HELLO, struct.pack("<QQ", 0xBAD0 + i, i + 1), addr)
    # Inconsistent lengths and short headers.
    out._native._debug_send_raw(peer.address, AM_HELLO, struct.pack("<QQ", 0xBAE0, 50), b"\x4d\x43\x52\x31" + b"\xff" * 40)
    out._native._debug_send_raw(peer.address, AM_HELLO, b"\x01\x02", b"")
    out._native._debug_send_raw(peer.address, AM_RPC_REQ, b"\x01" * 7, b"")
    out._native._debug_send_raw(peer.address, AM_PUSH_REQ, struct.pack("<QQII", 1, 2, 1 << 30, 1 << 30) + bytes(16), b"")
    out._native._debug_send_raw(peer.address, AM_AUTH2, b"\x00" * 64, b"\x00" * 10)
    time.sleep(0.5)
    assert peer.proc.poll() is None, "the receiver died"
    good = _secret_engine(engines, secret=secret, protocol="tcp")
    assert good.call(good.connect(peer.address, timeout_s=10), 1, b"alive") == b"alive"
    assert peer.cmd("count")["count"] == 0


def test_push_with_lying_counts_is_refused(engines, spawn_peer):
    """An authenticated peer's push request whose counts do not match its bytes gets an
    error, not a read past the message."""
    peer = spawn_peer(protocol="tcp", read_mode="push")
    eng = engines(protocol="tcp", read_mode="push")
    eng.connect(peer.address, timeout_s=10)
    before = _stats(peer)
    hdr = struct.pack("<QQII", eng.uid, 77, 64, 1 << 20) + bytes(16)
    eng._native._debug_send_raw(peer.address, AM_PUSH_REQ, hdr, b"\x00" * 64)
    assert _wait_for(lambda: _stats(peer)["malformed_dropped"] > before["malformed_dropped"])
    assert _stats(peer)["push_served_bytes"] == before["push_served_bytes"]


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("op", [rpc.GET, rpc.EXISTS, rpc.PUT_COMMIT])
def test_master_index_huge_count_does_not_allocate(op):
    ix = _native.MasterIndex()
    ix.set_enabled(True)
    ix.set_commits(True)
    ix.set("k", 4096, 7, [("n0", "r0", 8192, 4096, "i0", 5)])
    before = _maxrss_mb()
    count = struct.pack(">BI", 0xDD, 1 << 24)  # an array of 2^24 elements, in 7 bytes
    for req in (
        bytes([0x93, op]) + count,
        bytes([0x94, op]) + count + b"\xa1k",
        bytes([0x93, op]) + struct.pack(">BH", 0xDC, 0xFFFF),
    ):
        t = time.monotonic()
        assert ix.serve(req) is None  # not answered natively: Python's turn (and it fails)
        assert time.monotonic() - t < 0.05
    assert _maxrss_mb() - before < 50
    # Well-formed requests still work.
    assert ix.serve(rpc.pack([rpc.EXISTS, ["k", "x"]])) is not None


def test_master_rpc_with_huge_count_does_not_allocate(engines):
    server, client = engines(protocol="tcp"), engines(protocol="tcp")
    ix = _native.MasterIndex()
    ix.set_enabled(True)
    seen = []
    server.serve_master(rpc.MASTER_RPC, ix, lambda data: seen.append(data) or rpc.pack([rpc.ERR, "bad"]))
    peer = client.connect(server.address, timeout_s=10)
    before = _maxrss_mb()
    req = bytes([0x93, rpc.GET]) + struct.pack(">BI", 0xDD, 1 << 24)
    client.call(peer, rpc.MASTER_RPC, req, timeout_s=10)
    assert seen == [req] and _maxrss_mb() - before < 50



def test_without_a_secret_a_sender_claiming_anothers_uid_cannot_answer_its_call(engines):
    """An outsider sends requests that claim a legitimate peer's uid, with call ids 1-4000:
    the receiver answers each to the peer that uid names. Call ids used to count from 1,
    so one of those answers matched the legitimate peer's own call in flight and it took
    the outsider's reply for its own (the transport fuzz target found it); ids now start at
    a random point, and the legitimate call gets its own answer."""
    import threading

    recv = engines(protocol="tcp", name="recv")
    release = threading.Event()

    def handle(payload: bytes) -> bytes:
        if payload.startswith(b"legit"):
            release.wait(10)
        return b"ok:" + bytes(payload)

    recv.serve(7, handle)
    legit, out = engines(protocol="tcp", name="legit"), engines(protocol="tcp", name="outsider")
    peer = legit.connect(recv.address, timeout_s=10)
    assert legit.call(peer, 7, b"warm", timeout_s=10) == b"ok:warm"
    h = legit.call_async(peer, 7, b"legit-call")
    for cid in range(1, 4001):
        hdr = struct.pack("<QQII", legit.uid, cid, 7, 0) + bytes(16)
        out._native._debug_send_raw(recv.address, AM_RPC_REQ, hdr, b"x" * 32)
    time.sleep(0.5)  # the forged answers reach the legitimate peer first
    release.set()
    assert h.result(timeout_s=10) == b"ok:legit-call"
