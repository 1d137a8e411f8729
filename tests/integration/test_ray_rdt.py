"""Our UCX transport as a Ray Direct Transport: actor to actor across Ray nodes.

The producer and the consumer run on the two worker nodes of the shared 3-node cluster
(pinned with NodeAffinitySchedulingStrategy); every tensor is compared byte for byte by
sha256, and the consumer's engine counters prove the bytes came through our transport,
not the object store.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time

import pytest
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from mooncake_ray.integrations import ray_rdt
from tests.conftest import wait_for

# Before the actor classes: @ray.method(tensor_transport="mooncake") checks the name when
# the class body runs. Ray then registers the transport in the actors we create.
ray_rdt.register()

MiB = 1 << 20
BIG = 64 * MiB


def small_tensors() -> list[torch.Tensor]:
    """Deterministic tensors of many dtypes and shapes, including odd sizes, a 0-d scalar
    and an empty tensor."""
    g = torch.Generator().manual_seed(7)
    return [
        torch.randn(3, 5, generator=g),                                    # float32
        torch.randn(7, generator=g, dtype=torch.float64),
        torch.randn(4, 4, generator=g).to(torch.bfloat16),
        torch.randn(33, generator=g).to(torch.float16),
        torch.randint(-2**62, 2**62, (9,), generator=g, dtype=torch.int64),
        torch.randint(-128, 127, (1001,), generator=g, dtype=torch.int8),  # odd byte count
        torch.randint(0, 2, (2, 3, 5), generator=g).bool(),
        torch.randn(6, generator=g, dtype=torch.complex64),
        torch.tensor(3.5, dtype=torch.float64),                            # 0-d
        torch.empty(0, 4, dtype=torch.int32),                              # no bytes
    ]


def digest(t: torch.Tensor) -> tuple:
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return tuple(t.shape), str(t.dtype), hashlib.sha256(raw).hexdigest()


@ray.remote(num_cpus=0, max_restarts=0)
class Producer:
    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.big = torch.randint(0, 256, (BIG,), generator=g, dtype=torch.uint8)
        self.small = small_tensors()

    @ray.method(tensor_transport="mooncake")
    def tensors(self):
        return [self.big, *self.small]

    @ray.method(tensor_transport="mooncake")
    def ones(self, n: int):
        return torch.ones(n, dtype=torch.uint8)

    def expected(self):
        return [digest(t) for t in [self.big, *self.small]]

    def pid(self) -> int:
        return os.getpid()

    def live_registrations(self) -> int:
        from ray.experimental.rdt import util

        return len(util.get_tensor_transport_manager(ray_rdt.TRANSPORT_NAME)._source_regs)


# A receiver needs enable_tensor_transport=True: Ray runs the read on its "_ray_system"
# concurrency group. "probe" lets the test look at counters while a task waits for bytes.
@ray.remote(num_cpus=0, enable_tensor_transport=True, concurrency_groups={"probe": 1})
class Consumer:
    def digests(self, tensors):
        return [digest(t) for t in tensors]

    def total(self, t):
        return int(t.sum())

    @ray.method(concurrency_group="probe")
    def stats(self):
        return ray_rdt.engine_stats()


def pinned(cls, node_id, **opts):
    return cls.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False), **opts
    ).remote()


@pytest.fixture(scope="module")
def pair(ray_cluster):
    a, b = ray_cluster.store_node_ids
    prod, cons = pinned(Producer, a), pinned(Consumer, b)
    yield prod, cons
    for h in (prod, cons):
        ray.kill(h)


def test_register_is_idempotent_and_refuses_other_settings():
    cls = ray_rdt.register()
    assert ray_rdt.register() is cls and ray_rdt.is_registered()
    with pytest.raises(ValueError, match="already registered"):
        ray_rdt.register(devices=["eth9"])


def test_64mib_and_small_tensors_arrive_byte_exact(pair):
    prod, cons = pair
    expected = ray.get(prod.expected.remote())
    st = ray.get(cons.stats.remote())
    before = st.get("read_get_bytes", 0) + st.get("read_memcpy_bytes", 0)
    ref = prod.tensors.remote()
    assert ray.get(cons.digests.remote(ref), timeout=60) == expected
    st = ray.get(cons.stats.remote())
    assert st["read_get_bytes"] + st["read_memcpy_bytes"] - before >= BIG  # our transport moved it
    assert st["config"]["devices"] == ["lo"]

    # The same object once more, and to the driver (a one-sided fetch into this process),
    # then into buffers we provide.
    assert ray.get(cons.digests.remote(ref), timeout=60) == expected
    assert [digest(t) for t in ray.get(ref, timeout=60)] == expected
    bufs = [torch.empty(s, dtype=getattr(torch, d.split(".")[1])) for s, d, _ in expected]
    ray.experimental.set_target_for_ref(ref, bufs)
    got = ray.get(ref, timeout=60)
    assert all(g.data_ptr() == b.data_ptr() for g, b in zip(got[:-1], bufs[:-1]))
    assert [digest(t) for t in bufs] == expected

    # The driver as the source: ray.put through the transport, read by the consumer.
    mine = small_tensors()
    put_ref = ray.put(mine, _tensor_transport="mooncake")
    assert ray.get(cons.digests.remote(put_ref), timeout=60) == [digest(t) for t in mine]

    # Freed once the last reference is gone: the producer unregisters the memory.
    assert ray.get(prod.live_registrations.remote()) > 0
    del ref, got
    wait_for(lambda: ray.get(prod.live_registrations.remote()) == 0, timeout_s=20,
             what="the producer to unregister a freed object")


def test_source_killed_mid_transfer_fails_fast_with_a_clear_error(ray_cluster):
    """Over tcp a read needs the source's engine (it pushes the bytes): stopping the source
    leaves the read in flight, killing it must fail the read at once, not after a timeout."""
    a, b = ray_cluster.store_node_ids
    env = {"env_vars": {"MOONCAKE_RDT_PROTOCOL": "tcp", "MOONCAKE_RDT_TIMEOUT_S": "30"}}
    prod = pinned(Producer, a, runtime_env=env)
    cons = pinned(Consumer, b, runtime_env=env)
    try:
        pid = ray.get(prod.pid.remote())
        assert ray.get(cons.total.remote(prod.ones.remote(MiB)), timeout=60) == MiB  # warm
        ref = prod.ones.remote(BIG)
        ray.wait([ref], timeout=30)  # created: metadata is with the owner
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        out = cons.total.remote(ref)
        wait_for(lambda: ray.get(cons.stats.remote())["read_push_bytes"] > MiB,
                 timeout_s=20, what="the consumer to start reading")
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ray.exceptions.RayTaskError) as ei:
            ray.get(out, timeout=30)
        took = time.monotonic() - t0
        assert isinstance(ei.value.as_instanceof_cause(), ray.exceptions.RayDirectTransportError)
        msg = str(ei.value)
        assert "mooncake RDT transfer of object" in msg and "source actor may have died" in msg
        assert "NodeUnavailableError" in msg
        assert took < 20, f"the failure took {took:.1f}s"
        # The consumer survives (Ray kills the actors of a failed transfer only for
        # transports that cannot abort) and knows the peer is gone.
        assert ray.get(cons.stats.remote())["peers_failed"] >= 1
    finally:
        ray.kill(prod)
        ray.kill(cons)


def test_source_dead_before_the_read_fails_at_once(pair, ray_cluster):
    a, _ = ray_cluster.store_node_ids
    _, cons = pair
    prod = pinned(Producer, a)
    ref = prod.ones.remote(MiB)
    ray.wait([ref], timeout=30)
    os.kill(ray.get(prod.pid.remote()), signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(ray.exceptions.RayTaskError, match="cannot read object"):
        ray.get(cons.total.remote(ref), timeout=30)
    assert time.monotonic() - t0 < 10


def test_receive_pool_reuses_and_coalesces_freed_blocks():
    """No Ray: blocks come back when the last view of them dies, and neighbours merge."""
    import gc

    from mooncake_ray._private.transport.engine import Engine
    from mooncake_ray.integrations._rdt_pool import RecvPool

    with Engine(devices=["lo"], name="pool-test") as eng:
        pool = RecvPool(eng, limit_bytes=96 * MiB)
        a, a_addr = pool.alloc(16 * MiB)
        b, b_addr = pool.alloc(16 * MiB)
        assert b_addr == a_addr + 16 * MiB and pool.stats()["recv_pool_reserved"] == 64 * MiB
        ta = torch.frombuffer(a, dtype=torch.uint8)
        view = ta[10:20].view(torch.int16)  # a view keeps the whole block
        del a, ta
        gc.collect()
        assert pool.stats()["recv_pool_allocated"] == 32 * MiB
        del view, b
        gc.collect()
        assert pool.stats()["recv_pool_allocated"] == 0
        c, c_addr = pool.alloc(40 * MiB)  # fits only in the two merged blocks (+ the rest)
        assert c_addr == a_addr
        assert pool.alloc(64 * MiB) is None  # over the 96 MiB limit: the caller falls back
        del c
