"""Seeded random operation sequences against the master state machine, with node loss
and master restarts; invariants checked after every step. A failure prints its seed:
rerun one with MCR_SIM_SEED=<seed>."""

import os
import random

import pytest

from mooncake_ray.errors import MooncakeRayError
from mooncake_ray._private.master.allocator import ALIGN
from mooncake_ray._private.master.state import MasterState, Policy
from mooncake_ray._private.master.types import NodeInfo

SEEDS = [int(os.environ["MCR_SIM_SEED"])] if "MCR_SIM_SEED" in os.environ else list(range(40))
STEPS = 600


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


class Sim:
    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.clock = Clock()
        self.losses = {}
        strategy = self.rng.choice(["random", "free_ratio_first", "local_first"])
        self.policy = Policy(lease_ttl_s=5, soft_pin_ttl_s=50, node_ttl_s=8, put_timeout_s=20,
                             allocation_strategy=strategy, replicas=self.rng.choice([1, 2]),
                             high_watermark=self.rng.choice([0.7, 0.9, 1.0]), evict_ratio=0.05)
        self.m = self._new_master()
        self.inv = {}   # node_id -> {key: entry}: what each store node remembers
        self.incs = {}
        for i in range(3):
            self.add_node(f"n{i}")
        self.pending = {}  # key -> gen
        self.leases = {}   # key -> (gen, until)
        self.forced = set()

    def _new_master(self):
        m = MasterState(self.policy, clock=self.clock, wall_ns=lambda: 0,
                        seed=self.rng.randrange(1 << 30))
        real_unmount = m.unmount

        def unmount(node_id, reason=""):  # count node losses: they legitimately lose keys
            if node_id in m._nodes:
                self.losses[node_id] = self.losses.get(node_id, 0) + 1
            return real_unmount(node_id, reason)

        m.unmount = unmount
        return m

    def add_node(self, node_id):
        inc = f"{node_id}.{self.rng.randrange(1 << 30)}"
        self.incs[node_id] = inc
        self.inv[node_id] = {}
        cap = self.rng.choice([32, 64, 128]) * ALIGN
        self.m.mount(NodeInfo(node_id, inc, b"", b"", 0, cap, ray_node_id="r" + node_id), [])
        self.caps = getattr(self, "caps", {})
        self.caps[node_id] = cap

    def deliver(self):
        for node_id, d in self.m.drain_effects().items():
            inv = self.inv[node_id]
            for key, gen in d.drop:
                if key in inv and inv[key].gen == gen:
                    del inv[key]
            for e in d.add:
                inv[e.key] = e

    def step(self):
        r, m, rng = self.rng.random(), self.m, self.rng
        key = f"k{rng.randrange(60)}"
        self.clock.t += rng.choice([0, 0, 0.1, 0.5, 1, 3])
        try:
            if r < 0.35:
                size = rng.choice([1, 100, ALIGN, 3 * ALIGN, 9 * ALIGN, 20 * ALIGN])
                gen, _ = m.put_start(key, size, client_node=rng.choice([None, "rn0", "rn1"]),
                                     upsert=rng.random() < 0.3)
                self.pending[key] = gen
                if rng.random() < 0.8:
                    m.put_end(key, gen)
                    self.pending.pop(key)
                elif rng.random() < 0.5:
                    m.put_revoke(key, gen)
                    self.pending.pop(key)
            elif r < 0.6:
                got = m.get(key)
                if got:
                    nodes = [rep[0] for rep in got[3]]
                    self.leases[key] = (got[1], self.clock.t + got[2],
                                        {n: self.losses.get(n, 0) for n in nodes})
            elif r < 0.68:
                force = rng.random() < 0.3
                if m.remove(key, force=force) and force:
                    self.forced.add(key)
            elif r < 0.74:
                m.pin(key, hard=rng.random() < 0.3)
            elif r < 0.77:
                m.unpin(key)
            elif r < 0.8 and self.pending:
                k, gen = rng.choice(list(self.pending.items()))
                m.put_end(k, gen)
                self.pending.pop(k)
            elif r < 0.84:
                m.tick()
            elif r < 0.87:   # heartbeats; a node the master forgot remounts with its inventory
                for n in list(self.incs):
                    if not m.heartbeat(n, self.incs[n]):
                        self.remount(n)
            elif r < 0.89:   # a store node dies and comes back empty
                victim = rng.choice(list(self.incs))
                m.unmount(victim, "killed")
                self.add_node(victim)
                self.forget_node(victim)
            elif r < 0.91:   # the master restarts and rebuilds from the inventories
                self.deliver()
                self.m = m = self._new_master()
                m.begin_recovery(set(self.incs))
                for n in self.incs:
                    self.remount(n)
                self.pending.clear()
            elif r < 0.93:
                m.report_unreachable(rng.choice(list(self.incs)))
        except MooncakeRayError:
            pass
        self.deliver()

    def remount(self, n):
        self.m.mount(NodeInfo(n, self.incs[n], b"", b"", 0, self.caps[n], ray_node_id="r" + n),
                     list(self.inv[n].values()))

    def forget_node(self, node_id):
        # leases on objects whose only replicas were there legitimately end
        for key in list(self.leases):
            if not self.m.exists(key):
                self.leases.pop(key)

    def check(self):
        m = self.m
        m.check_invariants()
        now = self.clock.t
        for key, (gen, until, seen) in list(self.leases.items()):
            if until <= now or key in self.forced:
                self.leases.pop(key)
                self.forced.discard(key)
                continue
            got = m.get(key) if m.exists(key) else None
            # a leased object is neither evicted nor replaced under the reader... unless
            # upserted (a new gen: the old extents stay reserved) or its node died.
            if got is None:  # only a forced remove or the loss of its nodes may take it
                lost = any(self.losses.get(n, 0) > c for n, c in seen.items())
                assert lost, f"leased {key} gen {gen} vanished while its nodes lived"
        for key, gen in self.pending.items():
            obj = m._pending.get(key)
            assert obj is None or obj.gen == gen or obj.gen > gen
        # inventories agree with the index
        for node_id, inv in self.inv.items():
            if node_id not in m._nodes:
                continue  # unmounted for silence: it remounts with this inventory
            for key, e in inv.items():
                obj = m._objects.get(key)
                assert obj is not None and obj.gen == e.gen, f"{node_id} remembers stale {key}"
                assert any(r.node_id == node_id and r.offset == e.offset for r in obj.replicas)
        for key, obj in m._objects.items():
            for r in obj.replicas:
                assert key in self.inv[r.node_id], f"{key} on {r.node_id} missing from its inventory"


@pytest.mark.parametrize("seed", SEEDS)
def test_random_operations_keep_invariants(seed):
    sim = Sim(seed)
    for i in range(STEPS):
        sim.step()
        try:
            sim.check()
        except AssertionError as e:
            raise AssertionError(f"seed {seed}, step {i}: {e} (rerun: MCR_SIM_SEED={seed})") from None
