"""Error paths: unreachable and killed peers, timeouts, deregistered memory, out of bounds,
bad configuration, a closed engine. Each must raise its typed error, never hang or crash,
and leave the engine usable."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest

from mooncake_ray.errors import (
    ConfigError,
    EngineClosedError,
    InvalidArgumentError,
    NodeUnavailableError,
    NotRegisteredError,
    TransferTimeoutError,
)
from tests.native.transport_util import addr_of, engines, require_private_netns, spawn_peer  # noqa: F401 - fixtures

PROTOCOLS = ["shm", "tcp"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_unreachable_peer(spawn_peer, engines, protocol):
    peer = spawn_peer(protocol=protocol, keepalive_s=0.2)
    address = peer.address
    peer.close()  # the process exits: its address now leads nowhere
    eng = engines(protocol=protocol, keepalive_s=0.2)
    t = time.monotonic()
    with pytest.raises(NodeUnavailableError):
        p = eng.connect(address, timeout_s=3)
        eng.call(p, 1, b"x", timeout_s=3)
    assert time.monotonic() - t < 4
    assert eng.stats()["peers"] == 0


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_killed_peer_fails_outstanding_and_is_evicted(spawn_peer, engines, protocol):
    peer = spawn_peer(protocol=protocol, keepalive_s=0.2)
    eng = engines(protocol=protocol, keepalive_s=0.2)
    rr = peer.remote(eng, "user")
    p = rr.peer
    assert eng.call(p, 1, b"hi") == b"hi"
    slow = eng.call_async(p, 3, b"30")  # in flight when the peer dies
    time.sleep(0.1)
    peer.signal(signal.SIGKILL)
    t = time.monotonic()
    with pytest.raises(NodeUnavailableError):
        slow.wait(10)
    assert time.monotonic() - t < 3
    assert not p.alive
    buf = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(NodeUnavailableError):
        eng.read([(rr, 0, addr_of(buf), 4096)], timeout_s=3)
    with pytest.raises(NodeUnavailableError):
        eng.call(p, 1, b"x", timeout_s=3)
    assert eng.stats()["peers"] == 0  # evicted: the next connect makes a new endpoint
    with pytest.raises(NodeUnavailableError):
        eng.connect(peer.address, timeout_s=2)
    # the engine still works with a new peer
    other = spawn_peer(protocol=protocol)
    assert eng.call(eng.connect(other.address), 1, b"new") == b"new"


def test_restarted_peer_gets_a_new_endpoint(spawn_peer, engines):
    eng = engines(protocol="tcp")
    a = spawn_peer(protocol="tcp")
    pa = eng.connect(a.address)
    assert eng.connect(a.address) is pa  # cached
    a.kill()
    b = spawn_peer(protocol="tcp")
    assert eng.call(eng.connect(b.address), 1, b"b") == b"b"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_transfer_timeout_then_recovery(spawn_peer, engines, protocol):
    peer = spawn_peer(protocol=protocol)
    eng = engines(protocol=protocol, read_mode="push")  # needs the owner's engine to act
    rr = peer.remote(eng, "arena")
    buf = np.zeros(1 << 20, dtype=np.uint8)
    reg = eng.register(buf)
    eng.read([(rr, 0, addr_of(buf), 1 << 20)])
    peer.stop()
    try:
        t = time.monotonic()
        with pytest.raises(TransferTimeoutError):
            eng.read([(rr, 0, addr_of(buf), 1 << 20)], timeout_s=0.3)
        with pytest.raises(TransferTimeoutError):
            eng.call(rr.peer, 1, b"x", timeout_s=0.3)
        assert time.monotonic() - t < 2
    finally:
        peer.signal(signal.SIGCONT)
    unreg = np.zeros(1 << 20, dtype=np.uint8)
    eng.read([(rr, 0, addr_of(unreg), 1 << 20)], timeout_s=10)
    assert eng.call(rr.peer, 1, b"back") == b"back"
    assert np.array_equal(unreg, buf)
    reg.close()


def test_deregistered_local_memory(spawn_peer, engines):
    peer = spawn_peer(protocol="tcp")
    eng = engines(protocol="tcp")
    rr = peer.remote(eng, "arena")
    buf = np.zeros(8192, dtype=np.uint8)
    reg = eng.register(buf)
    arena = eng.alloc_arena(1 << 20)
    eng.read([(rr, 0, addr_of(buf), 8192)])
    eng.read([(rr, 0, arena.addr, 8192)])
    reg.close()
    arena.close()
    reg.close()  # idempotent
    for addr in (addr_of(buf) + 100, arena.addr):
        with pytest.raises(NotRegisteredError):
            eng.read([(rr, 0, addr, 100)])
        with pytest.raises(NotRegisteredError):
            eng.write([(rr, 0, addr, 100)])
    with pytest.raises(NotRegisteredError):
        arena.view()
    with pytest.raises(NotRegisteredError):
        reg.view()
    # re-registering the same memory makes it usable again
    reg2 = eng.register(buf)
    eng.read([(rr, 0, addr_of(buf), 8192)])
    reg2.close()


def test_remote_region_closed_by_owner(spawn_peer, engines):
    peer = spawn_peer(protocol="tcp")
    eng = engines(protocol="tcp", read_mode="push")  # push: the owner checks its own registry
    rr = peer.remote(eng, "user")
    buf = np.zeros(1 << 16, dtype=np.uint8)
    eng.read([(rr, 0, addr_of(buf), 1 << 16)])
    peer.cmd("close_region", region="user")
    with pytest.raises(NotRegisteredError, match="closed region"):
        eng.read([(rr, 0, addr_of(buf), 1 << 16)])
    assert eng.call(rr.peer, 1, b"ok") == b"ok"


@pytest.mark.parametrize("protocol,mode", [("shm", "auto"), ("tcp", "auto"), ("shm", "get")])
def test_out_of_bounds(spawn_peer, engines, protocol, mode):
    peer = spawn_peer(protocol=protocol)
    eng = engines(protocol=protocol, read_mode=mode)
    rr = peer.remote(eng, "arena")
    buf = np.zeros(1 << 20, dtype=np.uint8)
    reg = eng.register(buf)
    before = eng.stats()
    bad = [(rr.length - 10, 11), (rr.length, 1), (2**63, 1), (0, rr.length + 1), (1, 2**64 - 1)]
    for off, n in bad:
        with pytest.raises(NotRegisteredError):
            eng.read([(rr, off, addr_of(buf), n)])
        with pytest.raises(NotRegisteredError):
            eng.write([(rr, off, addr_of(buf), n)])
    # a good op in the same batch is not executed either
    with pytest.raises(NotRegisteredError):
        eng.read([(rr, 0, addr_of(buf), 16), (rr, rr.length - 1, addr_of(buf), 2)])
    after = eng.stats()
    moved = sum(after[k] - before[k] for k in after if k.endswith("_bytes"))
    assert moved == 0
    # local range running past its registered region
    with pytest.raises(NotRegisteredError):
        eng.read([(rr, 0, addr_of(buf) + (1 << 20) - 10, 20)])
    # a sub-range import is bounded by its own length
    small = eng.import_remote(rr.peer, rr.rkey, rr.base + 4096, 4096)
    with pytest.raises(NotRegisteredError):
        eng.read([(small, 1, addr_of(buf), 4096)])
    eng.read([(small, 0, addr_of(buf), 4096)])
    reg.close()


def test_bad_config_and_arguments(engines):
    with pytest.raises(ConfigError):
        engines(protocol="bogus")
    with pytest.raises(ConfigError):
        engines(ucx_options={"NO_SUCH_SETTING": "1"})
    with pytest.raises(ConfigError):
        engines(read_mode="teleport")
    with pytest.raises(ConfigError):
        engines(num_lanes=0)
    with pytest.raises(ConfigError, match="RDMA"):
        engines(protocol="rdma")  # no InfiniBand/RoCE here; a machine with it would pass
    with pytest.raises(ConfigError):
        engines(error_mode="sometimes")
    eng = engines(protocol="tcp")
    with pytest.raises(InvalidArgumentError):
        eng.register(b"read-only bytes")
    with pytest.raises(InvalidArgumentError):
        eng.register(bytearray())
    with pytest.raises(InvalidArgumentError):
        eng.register(np.zeros((4, 4))[:, 1])
    with pytest.raises(InvalidArgumentError):
        eng.connect(b"not an address")
    with pytest.raises(InvalidArgumentError):
        eng.alloc_arena(0)


def test_engine_from_config_carries_every_engine_setting():
    """Each TransportConfig field the C++ EngineConfig also has reaches the engine; the
    server linger only a server's."""
    from mooncake_ray._private.transport import Engine
    from mooncake_ray.config import TransportConfig

    require_private_netns()
    cfg = TransportConfig(protocol="tcp", devices="lo", num_lanes=3, read_mode="push",
                          write_mode="put", ucx_options={"RNDV_THRESH": "8k"}, chunk_bytes="1mb",
                          stripe_min_bytes=8192, push_min_bytes=0, staging_bytes="8mb", spin_us=7,
                          inflight_linger_us=9, server_linger_us=11, keepalive_s=0.5,
                          error_mode="none", default_timeout_s=3.0)
    client = Engine.from_config(cfg, name="c")
    server = Engine.from_config(cfg, name="s", server=True, num_lanes=1)
    try:
        got = client._native.config
        shared = [f for f in TransportConfig.model_fields if hasattr(got, f)]
        assert len(shared) == 15 and got.name == "c" and client.default_timeout_s == 3.0
        for f in shared:
            assert getattr(got, f) == (0 if f == "server_linger_us" else getattr(cfg, f)), f
        assert server._native.config.server_linger_us == 11 and server.num_lanes == 1
    finally:
        client.close()
        server.close()


def test_register_kinds(engines):
    torch = pytest.importorskip("torch")
    eng = engines(protocol="tcp", ucx_options={"RNDV_THRESH": "8k"})
    t = torch.arange(1024, dtype=torch.float32)
    r = eng.register(t)
    assert r.addr == t.data_ptr() and r.length == 4096
    r.view()[:4] = b"\x00\x00\x80\x3f"  # 1.0f
    assert t[0].item() == 1.0
    r.close()
    raw = np.zeros(100, dtype=np.uint8)
    r2 = eng.register((addr_of(raw), 100))
    r2.view()[0] = 7
    assert raw[0] == 7
    r2.close()
    arena = eng.alloc_arena(3 << 20)
    v = arena.view()
    v[-1] = 9
    assert len(v) == 3 << 20 and arena.is_arena
    arena.close()  # the view keeps the mapping alive until dropped
    assert v[-1] == 9
    del v


def test_closed_engine(engines):
    eng = engines(protocol="tcp")
    region = eng.alloc_arena(1 << 20)
    eng.close()
    eng.close()
    with pytest.raises(EngineClosedError):
        eng.alloc_arena(1 << 20)
    with pytest.raises(EngineClosedError):
        eng.connect(b"x" * 64)
    assert region.closed


SECRET = "5e" * 32


def _die_inside_a_message(spawn_peer, recv, **kw) -> None:
    """A second engine connects to ``recv``, then is SIGKILLed by its own payload while
    UCX packs it into the transport (``_debug_die_mid_message``)."""
    import base64

    dying = spawn_peer(name="dying", auth_secret=SECRET, **kw)
    with pytest.raises(RuntimeError, match="exited"):
        dying.cmd("die_mid_message", address=base64.b64encode(recv.address).decode())
    assert dying.proc.wait(10) == -signal.SIGKILL


@pytest.mark.parametrize("protocol", ["auto", "shm", "tcp"])
def test_a_sender_killed_inside_a_message_leaves_the_receiver_serving(spawn_peer, engines, protocol):
    """A process killed while its message is half in the transport (a client or a master
    SIGKILLed mid-call) must not take the receiver's lane with it: the next engine's
    handshake and call are answered at once."""
    recv = spawn_peer(protocol=protocol, auth_secret=SECRET)
    _die_inside_a_message(spawn_peer, recv, protocol=protocol)
    eng = engines(protocol=protocol)
    eng.set_auth_secret(bytes.fromhex(SECRET))
    assert eng.call(eng.connect(recv.address, timeout_s=10), 1, b"after", timeout_s=10) == b"after"


def test_a_sender_killed_inside_a_shared_memory_fifo_message_blocks_its_receiver(spawn_peer, engines):
    """Why no protocol sends messages through UCX's shared-memory FIFO (sysv here): a
    sender killed between taking a slot of the receiver's FIFO and filling it leaves the
    receiver deaf to everyone. Also shows that the test above kills inside the message."""
    fifo = {"protocol": "auto", "ucx_options": {"TLS": "sysv,cma,tcp,self"}}
    recv = spawn_peer(auth_secret=SECRET, **fifo)
    _die_inside_a_message(spawn_peer, recv, **fifo)
    eng = engines(**fifo)
    eng.set_auth_secret(bytes.fromhex(SECRET))
    with pytest.raises(NodeUnavailableError, match="did not answer the connection handshake"):
        eng.connect(recv.address, timeout_s=3)
