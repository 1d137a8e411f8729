"""Seeded random operation sequences against the master state machine, with node loss,
master restarts, and the disk tier (offloads and promotions completing, failing and
racing with removals); invariants checked after every step. A failure prints its seed:
rerun one with MCR_SIM_SEED=<seed>.

Half the gets, releases and one-call put commits go through the read index (``PyIndex``, the reference of the
native one) as the actor's RPC handler would send them; its log is applied before every
other operation, as the actor's lock does. The invariants include the index matching the
objects, and leases granted through it must protect their objects like any other.

The simulated store nodes keep their inventories with the shipped code (``StoreInventory``)
and the master's messages reach them through the shipped outboxes (``NodeOutbox``,
``plan_mount``), with faults: a message lost, an answer lost (the message is applied, then
sent again), a node silent past ``node_ttl_s`` that rejoins. The invariant for a mounted
node is that its inventory, with what it is still owed applied, is exactly the master's
view of it.

``ShardedSim`` runs several master shards over the same store nodes, as ``master.shards``
does (``_private/shards.py``): one ``Sim`` per shard, each with its own master, its part of
every arena, its inventory on every node and its outboxes; keys go to the shard that owns
them, node deaths and pauses hit every shard at once, and a master restart hits one shard
while the others go on. On top of each shard's invariants: every key lives in its own
shard's index and inventories only, and every extent lies in its shard's part."""

import dataclasses
import os
import random

import pytest

from mooncake_ray.errors import MooncakeRayError
from mooncake_ray._private import rpc
from mooncake_ray._private.shards import shard_of
from mooncake_ray._private.master.chains import BACK, GONE
from mooncake_ray._private.master.fastpath import COMMIT
from mooncake_ray._private.master.pyindex import PyIndex
from mooncake_ray._private.master.repairs import copies
from mooncake_ray._private.master.outbox import plan_mount
from mooncake_ray._private.master.allocator import ALIGN, extent_length
from mooncake_ray._private.master.state import MasterState, Policy
from mooncake_ray._private.master.tiering import disk_length
from mooncake_ray._private.master.types import InventoryEntry, NodeInfo
from mooncake_ray._private.shards import arena_part, shard_of
from mooncake_ray._private.store.inventory import StoreInventory, reconcile

SEEDS = [int(os.environ["MCR_SIM_SEED"])] if "MCR_SIM_SEED" in os.environ else list(range(40))
STEPS = 600


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


class Sim:
    """One master (or one master shard, ``shard`` of ``shards``, sharing the nodes, the
    clock and the random stream of ``world``, the first shard's ``Sim``)."""

    def __init__(self, seed, spill=None, shards=1, shard=0, world=None):
        self.shards, self.shard = shards, shard
        self.chained = seed % 2 == 0  # puts name parents (chains.py) in half of the runs
        self.rng = random.Random(seed) if world is None else world.rng
        self.clock = Clock() if world is None else world.clock
        self.losses = {}
        self.totals = {}  # counters of earlier master incarnations
        if world is None:
            strategy = self.rng.choice(["random", "free_ratio_first", "local_first"])
            self.spill = self.rng.random() < 0.6 if spill is None else spill
            self.policy = Policy(lease_ttl_s=5, soft_pin_ttl_s=50, node_ttl_s=8, put_timeout_s=20,
                                 allocation_strategy=strategy, replicas=self.rng.choice([1, 2]),
                                 high_watermark=self.rng.choice([0.7, 0.9, 1.0]), evict_ratio=0.05,
                                 evict_in_background=self.rng.random() < 0.5,
                                 repair_delay_s=(0.0, 1.0, 5.0)[seed % 3],
                                 chain_insert=("recent", "old", "adaptive")[seed % 4 // 2 % 3 if seed % 4 else 2])
        else:  # the shards of one store share its configuration
            self.spill, self.policy = world.spill, world.policy
        self.m = self._new_master()
        self.inv = {}       # node_id -> StoreInventory (of this shard's keys)
        self.outboxes = {}  # node_id -> NodeOutbox (the master actor's)
        # node_id -> clock time it resumes (SIGSTOP): no answers, no heartbeats
        self.paused = {} if world is None else world.paused
        self.incs, self.caps, self.spills = ({}, {}, {}) if world is None else (world.incs, world.caps, world.spills)
        self.offloads = {}  # node_id -> queued (key, gen, size, offset, length)
        self.promotions = []  # (node_id, key, gen, offset)
        self.restarts = 0
        self.kill_node = self._kill_node  # a sharded run kills the node on every shard
        for n in ([f"n{i}" for i in range(3)] if world is None else list(world.incs)):
            if world is None:
                self.new_incarnation(n)
            self.join(n)
        self.pending = {}
        self.leases = {}
        self.forced = set()
        self.slabs = {}  # slab_id -> [next free offset, end, owner]: the client's view
        self.owner = "client0"  # a restarted master sees a new client (the old one's slabs are dead)

    def _new_master(self):
        # A wall clock that only moves forward across restarts, as the real one does: slab
        # ids and gens of one master never equal a previous master's.
        m = MasterState(dataclasses.replace(self.policy, shard=self.shard, shards=self.shards), clock=self.clock,
                        wall_ns=self._wall_ns, seed=self.rng.randrange(1 << 30))
        real_unmount = m.unmount

        def unmount(node_id, reason=""):  # count node losses: they legitimately lose keys
            if node_id in m._nodes:
                self.losses[node_id] = self.losses.get(node_id, 0) + 1
            return real_unmount(node_id, reason)

        m.unmount = unmount
        m.index = PyIndex()
        m.index.clock = self.clock
        m.index.wall_ns = m._wall_ns
        m.index.set_lease_ttl(self.policy.lease_ttl_s)
        m.index.set_max_key_bytes(self.policy.max_key_bytes)
        m.index.set_commits(True)
        m.index.set_enabled(True)
        return m

    def _wall_ns(self) -> int:
        self.wall = getattr(self, "wall", 0) + 1
        return self.wall

    def python(self, fn):
        """A call the index declined: the actor's lock applies the log first, and pushes
        the state back to the index when it ends."""
        m = self.m
        m.apply_index_log(*m.index.drain())
        try:
            return fn()
        finally:
            m = self.m
            m.flush()
            m.index.set_enabled(not (m._expected and m.recovering))
            m.index.set_next_gen(m._next_gen)

    def native(self, request):
        """What the actor's handler answers natively, in a list (None: Python's turn)."""
        reply = self.m.index.serve(rpc.pack(request))
        return None if reply is None else [rpc.decode_reply(reply)]

    def info(self, n):
        part_offset, part_length = arena_part(self.caps[n], self.shards, self.shard)
        return NodeInfo(n, self.incs[n], b"", b"", 0, part_length, ray_node_id="r" + n,
                        spill_capacity=self.spills[n] // self.shards, part_offset=part_offset,
                        arena_length=self.caps[n])

    def new_incarnation(self, node_id):
        """A store node process starts (shared by every shard)."""
        self.incs[node_id] = f"{node_id}.{self.rng.randrange(1 << 30)}"
        self.caps[node_id] = self.rng.choice([32, 64, 128]) * ALIGN * self.shards
        self.spills.setdefault(node_id, self.rng.choice([64, 256]) * ALIGN * self.shards if self.spill else 0)

    def join(self, node_id, keep_disk=False):
        """This shard's side of a node that started: its inventory, mounted."""
        old = self.inv[node_id].entries.values() if node_id in self.inv else ()
        # a restarted node keeps its spill files, never its DRAM
        self.inv[node_id] = StoreInventory([e for e in old if e[3] == "disk"] if keep_disk else [])
        self.offloads[node_id] = []
        self.remount(node_id)

    def add_node(self, node_id, keep_disk=False):
        self.new_incarnation(node_id)
        self.join(node_id, keep_disk)

    def copies_at_risk(self, victim):
        """The stored values holding a readable copy on ``victim`` and on another node."""
        out = {}
        for key, obj in self.m._objects.items():
            nodes = {r.node_id for r in obj.replicas if r.ready}
            if victim in nodes and len(nodes) > 1:
                out[key] = obj.gen
        return out

    def check_queued_for_repair(self, at_risk):
        """After a node's loss: every value it left short of copies is queued for repair."""
        m = self.m
        for key, gen in at_risk.items():
            obj = m._objects.peek(key)
            if obj is not None and obj.gen == gen:
                assert key in m.repairs.short, f"{key} lost a copy with its node and is not queued for repair"

    def check_short_after_restart(self, wanted):
        """After a master restart: a value keeps the copies its put asked for (``wanted``:
        the previous master's ``{key: (gen, want)}``), and each one with fewer is queued."""
        m = self.m
        for key, (gen, want) in wanted.items():
            obj = m._objects.peek(key)
            if obj is None or obj.gen != gen:
                continue
            assert obj.want == want, f"{key} wants {want} copies; the restarted master says {obj.want}"
            if copies(obj) < want:
                assert key in m.repairs.short, f"{key} has {copies(obj)} of {want} copies and is not queued"

    def _kill_node(self, victim):
        """A store node dies and comes back: DRAM empty, spill files kept."""
        at_risk = self.copies_at_risk(victim)
        self.m.unmount(victim, "killed")
        self.check_queued_for_repair(at_risk)
        self.add_node(victim, keep_disk=True)
        self.promotions = [p for p in self.promotions if p[0] != victim]

    def remount(self, n):
        """What the store node's heartbeat thread and the master actor's ``mount`` do."""
        m = self.m
        mount_id, entries = self.inv[n].begin_mount()
        cur = m._nodes.get(n)
        known = cur is not None and cur.incarnation == self.incs[n]
        plan = plan_mount(self.outboxes.get(n), self.incs[n], mount_id, known, entries)
        if plan is not None:
            entries, self.outboxes[n] = plan
            m.mount(self.info(n), entries)

    def deliver(self, faults=True):
        """The master actor's delivery: effects merged into the outboxes, then messages
        sent; with ``faults``, some are lost on the way there or back, some wait."""
        for node_id, d in self.m.drain_effects().items():
            self.outboxes[node_id].pending.absorb(d)  # as the actor does
        now = self.clock.t
        for node_id, ob in self.outboxes.items():
            while ob.mounted:
                payload = ob.next_message(now)
                if payload is None:
                    break
                fate = self.rng.random() if faults else 1.0
                if self.paused.get(node_id, -1) > now:
                    ob.failed(now, 0.0)
                    break
                if fate < 0.1:
                    ob.failed(now, 0.0)  # lost on the way: sent again next time
                    break
                mount_id, seq, delta = rpc.unpack(payload)
                answer, files, offloads = self.inv[node_id].apply(mount_id, seq, delta)
                for key, gen in files:  # the node's worker deletes the files
                    self.inv[node_id].drop_disk(key, gen)
                self.offloads[node_id].extend(offloads)
                if fate < 0.2:
                    ob.failed(now, 0.0)  # the answer lost: applied, sent again, applied once
                    break
                ob.answered(answer)

    def flush(self):
        self.paused.clear()
        while any(ob.mounted and ob.busy() and not ob.stale for ob in self.outboxes.values()):
            self.deliver(faults=False)

    def finish_offloads(self):
        node_id = self.rng.choice(list(self.offloads))
        q, self.offloads[node_id] = self.offloads[node_id], []
        items = []
        for key, gen, size, _off, length in q:
            ok = self.rng.random() < 0.9
            length = disk_length(size, key)
            if ok:  # the node wrote the file: it remembers it
                self.inv[node_id].add_disk(InventoryEntry(key, gen, size, "disk", 0, length))
            items.append((key, gen, length, ok, "" if ok else "EIO"))
        self.m.offload_done(node_id, items)

    def finish_promotions(self):
        self.rng.shuffle(self.promotions)
        done, self.promotions = self.promotions[:3], self.promotions[3:]
        for node_id, key, gen, off in done:
            err = self.rng.choice(["", "", "", "ChecksumError"])
            if err:
                self.forced.add(key)  # a corrupt copy may legitimately take a leased key
            if err:
                self.inv[node_id].drop_disk(key, gen)  # a corrupt file is removed by the node
            self.m.promote_done(node_id, [(key, gen, off, err)])

    def step(self, key=None):
        r, m, rng = self.rng.random(), self.m, self.rng
        key = key or f"k{rng.randrange(60)}"
        self.clock.t += rng.choice([0, 0, 0.1, 0.5, 1, 3])
        if rng.random() < 0.1:  # the actor's applier: the log applied, decisions left for later
            m.apply_index_log(*m.index.drain(), decide=False)
            self.deliver()
        if m.eviction_due() and rng.random() < 0.3:  # the actor's evictor: one chunk a section
            self.python(lambda: m.evict_due(rng.choice([64, 4096, 8 * ALIGN])))
            self.deliver()
        if r < 0.13:
            try:
                self.slab_put(key, native=rng.random() < 0.5)
            except MooncakeRayError:
                pass
            self.deliver()
            return
        if 0.33 <= r < 0.55 and rng.random() < 0.5:
            got = self.native([rpc.GET, [key], rng.choice([None, "rn0", "n1"])])
            if got is not None:
                self.took(key, got[0][0])
                return
        elif 0.94 <= r < 0.98 and self.leases and rng.random() < 0.5:
            k = rng.choice(sorted(self.leases))
            gen, _until, _seen, lease = self.leases.pop(k)
            if self.native([rpc.RELEASE, [[k, gen, lease]]]) is not None:
                return
            self.python(lambda: m.release(k, gen, lease))
            return
        self.python(lambda: self.python_step(r, key))

    def took(self, key, got):
        if got:
            for node_id, tier, off, *_ in got[3]:
                if tier == "promote":
                    self.promotions.append((node_id, key, got[1], off))
            self.leases[key] = (got[1], self.clock.t + got[2],
                                {rep[0]: self.losses.get(rep[0], 0) for rep in got[3]}, got[4])

    def python_step(self, r, key):
        m, rng = self.m, self.rng
        try:
            if r < 0.33:
                size = rng.choice([1, 100, ALIGN, 3 * ALIGN, 9 * ALIGN, 20 * ALIGN])
                gen, _ = m.put_start(key, size, client_node=rng.choice([None, "rn0", "rn1"]),
                                     upsert=rng.random() < 0.3, parent=self.parent_of(key))
                self.pending[key] = gen
                if rng.random() < 0.8:
                    m.put_end(key, gen)
                    self.pending.pop(key)
                elif rng.random() < 0.5:
                    m.put_revoke(key, gen)
                    self.pending.pop(key)
            elif r < 0.55:
                self.took(key, m.get(key, rng.choice([None, "rn0", "n1"])))
            elif r < 0.62:
                force = rng.random() < 0.3
                if m.remove(key, force=force) and force:
                    self.forced.add(key)
            elif r < 0.67:
                m.pin(key, hard=rng.random() < 0.3)
            elif r < 0.70:
                m.unpin(key)
            elif r < 0.73 and self.pending:
                k, gen = rng.choice(list(self.pending.items()))
                m.put_end(k, gen)
                self.pending.pop(k)
            elif r < 0.78:
                self.finish_offloads()
            elif r < 0.82:
                self.finish_promotions()
            elif r < 0.85:
                for n in m.tick()["unmounted"]:  # the actor keeps the outbox for its return
                    self.outboxes[n].mounted = False
                self.check_tails()
            elif r < 0.88:   # heartbeats; a node the master forgot remounts with its inventory
                for n in list(self.incs):
                    if self.paused.get(n, -1) > self.clock.t:
                        continue
                    ob = self.outboxes.get(n)
                    if not (ob is not None and ob.accepts(self.incs[n], self.inv[n].mount_id)
                            and m.heartbeat(n, self.incs[n])):
                        self.remount(n)
            elif r < 0.885:  # a store node pauses, sometimes past node_ttl_s
                self.paused[rng.choice(list(self.incs))] = self.clock.t + rng.choice([2, 5, 12, 20])
            elif r < 0.90:   # a store node dies and comes back: DRAM empty, spill files kept
                self.kill_node(rng.choice(list(self.incs)))
            elif r < 0.92:   # the master restarts and rebuilds from the inventories
                self.flush()  # (a put acknowledged inside the delivery window is lost: not modelled)
                self.outboxes = {}
                self.restarts += 1
                for k, v in m.counters.items():
                    self.totals[k] = self.totals.get(k, 0) + v
                wanted = {k: (o.gen, o.want) for k, o in m._objects.items() if o.want > 1}
                self.m = m = self._new_master()
                m.begin_recovery(set(self.incs))
                for n in self.incs:
                    self.remount(n)
                self.check_short_after_restart(wanted)
                self.pending.clear()
                self.owner = f"client{rng.randrange(1 << 30)}"
            elif r < 0.915 and self.slabs:
                m.slab_return(rng.choice(sorted(self.slabs)))
            elif r < 0.93:  # the store nodes make the repairs they are the source of
                for node_id in list(self.incs):
                    plan = m.repair_plan(node_id, rng.choice([1, 4 * ALIGN, 1 << 20]))
                    if plan and rng.random() < 0.9:  # else it died before reporting: they expire
                        m.repair_done([[k, g, dst, off, rng.random() < 0.9] for k, g, _s, _src, dst, off in plan])
            elif r < 0.94:
                m.report_unreachable(rng.choice(list(self.incs)))
            elif r < 0.98 and self.leases:  # a reader finished: release its lease
                k = rng.choice(sorted(self.leases))
                gen, _until, _seen, lease = self.leases.pop(k)
                m.release(k, gen, lease)
        except MooncakeRayError:
            pass
        self.deliver()

    def slab_put(self, key, native=False):
        """A one-call put through a slab, as the client does it: carve, (write), commit;
        sometimes into a dead slab, sometimes never committed (the client died)."""
        m, rng = self.m, self.rng
        size = rng.choice([1, 100, 256, ALIGN, 3 * ALIGN])
        length = extent_length(size)

        def at(cur):  # where the client carves it: packed, or on the next page
            return -(-cur // ALIGN) * ALIGN if length >= ALIGN else cur

        fits = [sid for sid, (cur, end, _o) in self.slabs.items() if end - at(cur) >= length]
        if not fits or rng.random() < 0.2:
            sid, _n, off, ln, _inc, _ttl = self.python(lambda: m.slab_grant(
                self.owner, rng.choice([None, "rn0", "rn1"]), rng.choice([0, size])))
            self.slabs[sid] = [off, off + ln, self.owner]
            fits = [sid]
        sid = rng.choice(fits)
        cur, _end, owner = self.slabs[sid]
        cur = at(cur)
        self.slabs[sid][0] = cur + length
        if rng.random() < 0.1:
            return  # carved, never committed: the slab's expiry reclaims it
        upsert = rng.random() < 0.3
        parent = self.parent_of(key)
        item = [key, sid, cur, size, upsert] + ([parent] if parent else [])
        # sometimes with a used-up slab given back, as the client does (maybe this very one)
        returns = [rng.choice(sorted(self.slabs))] if rng.random() < 0.1 else []
        if native and self.native([rpc.PUT_COMMIT, [item], owner, returns]) is not None:
            return
        self.python(lambda: m.put_commit(key, sid, cur, size, upsert, owner, parent))
        for r in returns:  # as the actor's _put_commit: after the commits
            m.slab_return(r)

    def parent_of(self, key):
        """Keys k0..k59 form chains (k<i> follows k<i-1>) in most puts."""
        i = int(key[1:]) if key[1:].isdigit() else 0
        if not self.chained:
            return ""
        draw = random.Random(f"{key}/{self.clock.t}").random()  # not from self.rng: the same runs
        return f"k{i - 1}" if i % 10 and draw < 0.7 else ""  # on any shard (chainlinks.py)

    def check_tails(self):
        """After a tick (chain_eviction on): no stored value whose parent is gone, but
        those held by a reader, a pin (a soft one until it ends: a reader asked for the
        value by key) or a move in flight (their tail goes later), and those whose parent
        went with an unmounted node that may bring it back."""
        m, now = self.m, self.clock.t
        if m.recovering:
            return
        for key in m._objects.chains.orphans:
            obj = m._objects.peek(key)
            assert obj is not None, f"orphan {key} is not stored"
            assert (obj.leased(now) or obj.effective_pin(now).value != 0 or m._objects.chains.held(key)
                    or any(r.offloading or not r.ready for r in obj.replicas)), \
                f"{key} outlived its parent {m._objects.chains.parent[key]} past a tick"

    def check(self):
        m = self.m
        index = m.index
        # commits not applied yet: their records are ahead of the state machine
        unapplied = {e[1] for e in index._log if e[0] == COMMIT}
        m.check_invariants(unapplied)
        now = self.clock.t
        pins = [o.effective_pin(now) for o in m._objects.values()]  # counted without a scan = a scan
        st = m.stats()
        assert (st["pinned"], st["soft_pinned"]) == (sum(p != 0 for p in pins), sum(p == 1 for p in pins))
        for key, (gen, until, seen, _lease) in list(self.leases.items()):
            if until <= now or key in self.forced:
                self.leases.pop(key)
                self.forced.discard(key)
                continue
            cur = m._objects.peek(key)
            native = index.lookup(key)
            if cur is None and native is not None and native[1] == gen:
                continue  # committed natively, applied at the next Python section
            if cur is not None and cur.gen != gen:
                self.leases.pop(key)  # replaced by an upsert: the old extents wait out the lease
                continue
            if cur is None:  # only a forced remove or the loss of its nodes may take it
                lost = any(self.losses.get(n, 0) > c for n, c in seen.items())
                assert lost, f"leased {key} gen {gen} vanished while its nodes lived"
        views = {}
        for node_id, store in self.inv.items():
            if node_id not in m._nodes:
                continue  # unmounted for silence: it remounts with this inventory
            # what the node holds once it has applied what it is owed
            view = {(e[0], e[3]): InventoryEntry(*e)
                    for e in reconcile(store.snapshot(), self.outboxes[node_id].owed())}
            views[node_id] = view
            reserved = {(e.key, e.gen, e.offset, e.length) for e in view.values() if e.tier == "reserved"}
            want = {(e.key, e.gen, e.offset, e.length) for e in m.reserved_entries(node_id)}
            assert reserved == want, f"{node_id} reserves {sorted(reserved ^ want)[:4]} unlike the master"
            for (key, tier), e in view.items():
                if tier == "reserved":
                    continue
                obj = m._objects.peek(key)
                assert obj is not None and obj.gen == e.gen, f"{node_id} remembers stale {key}/{tier}"
                assert any(r.node_id == node_id and r.tier.value == tier and
                           (tier == "disk" or r.offset == e.offset) for r in obj.replicas), \
                    f"{node_id} holds {key}/{tier} that the master does not know"
        for key, obj in m._objects.items():
            if key in unapplied:
                continue
            for r in obj.replicas:
                if r.ready:
                    assert (key, r.tier.value) in views[r.node_id], \
                        f"{key}/{r.tier.value} on {r.node_id} missing from its inventory"


class ShardedSim:
    """Several master shards over the same store nodes (see the module docstring)."""

    def __init__(self, seed, shards, spill=None):
        first = Sim(seed, spill=spill, shards=shards, shard=0)
        self.sims = [first] + [Sim(seed, shards=shards, shard=i, world=first) for i in range(1, shards)]
        self.rng = first.rng
        for sim in self.sims:
            sim.kill_node = self.kill_node
        self.kills = 0
        self.checks = 0
        # the chain exchange of each shard (chainlinks.py): peers owed whole links, the
        # restarts of each peer it saw last, "gone / back" messages to send again
        self.whole = [set(range(shards)) - {i} for i in range(shards)]
        self.seen = [{} for _ in range(shards)]
        self.retry = [{} for _ in range(shards)]
        self.restarts = [0] * shards

    def kill_node(self, victim):
        """The node's process dies and restarts: every shard unmounts the old incarnation
        and mounts the new one (each with its own inventory's spill files)."""
        self.kills += 1
        for sim in self.sims:  # each under its actor's lock: its index's log applied first
            at_risk = sim.copies_at_risk(victim)
            sim.python(lambda: sim.m.unmount(victim, "killed"))
            sim.check_queued_for_repair(at_risk)
        self.sims[0].new_incarnation(victim)
        for sim in self.sims:
            sim.python(lambda: sim.join(victim, keep_disk=True))
            sim.deliver()  # what the mount queued (the actor's mount hands it to the outbox)
            sim.promotions = [p for p in sim.promotions if p[0] != victim]

    def step(self):
        key = f"k{self.rng.randrange(90)}"
        self.sims[shard_of(key, len(self.sims))].step(key)
        if self.rng.random() < 0.3:
            self.exchange()

    def exchange(self, lossy=True):
        """One round of chain messages between the shards, as ``ChainExchange`` sends them:
        a shard that restarted, or saw a peer's new incarnation, sends its links whole;
        a lost call (``lossy``: 1 in 20) is made up by the whole links, and its "gone /
        back" messages are sent again."""
        sims, n = self.sims, len(self.sims)
        for i, sim in enumerate(sims):
            if sim.restarts != self.restarts[i]:  # this shard's master restarted: its peers forgot it
                self.restarts[i] = sim.restarts
                self.whole[i] = set(range(n)) - {i}
                self.seen[i] = {}
                self.retry[i] = {}
            out = self.locked(sim, sim.m.chain_outbox)
            whole = {j: sim.m.chain_links_to(j) for j in self.whole[i]}
            for j in sorted(set(range(n)) - {i}):  # every peer: the empty calls are the probes
                items = self.retry[i].pop(j, []) + out.get(j, [])
                if lossy and self.rng.random() < 0.05:
                    self.whole[i].add(j)
                    kept = [m for m in items if m[0] in (GONE, BACK)]
                    if kept:
                        self.retry[i][j] = kept
                    continue
                peer = sims[j]
                self.locked(peer, lambda: peer.m.chain_receive(i, items, whole.get(j)))
                if j in whole:
                    self.whole[i].discard(j)
                if self.seen[i].get(j, peer.restarts) != peer.restarts:
                    self.whole[i].add(j)
                self.seen[i][j] = peer.restarts

    @staticmethod
    def locked(sim, fn):
        """A section of the actor's lock: the index's log applied first, what it changed
        delivered after."""
        try:
            return sim.python(fn)
        finally:
            sim.deliver()

    def settle_chains(self):
        """Messages exchanged until none is left, a parent linked while missing given its
        grace: then every link a child's shard holds is known to its parent's shard, and
        a child is an orphan exactly when its parent is not stored (nor held as lost with
        a node that may bring it back)."""
        for _ in range(2):
            for _ in range(4):
                self.exchange(lossy=False)
            self.sims[0].clock.t += self.sims[0].m._objects.chains.grace_s
        self.exchange(lossy=False)
        self.exchange(lossy=False)
        n = len(self.sims)
        if any(s.m.recovering for s in self.sims):
            return
        for shard, sim in enumerate(self.sims):
            chains = sim.m._objects.chains
            for parent, kids in chains.kids.items():
                if not chains.foreign(parent):
                    continue
                owner = self.sims[shard_of(parent, n)].m._objects
                for child in kids:
                    assert child in owner.chains.remote.get(parent, ()), \
                        f"{child} (shard {shard}) names {parent}, which its shard does not know"
                    # a parent that went with an unmounted node is held until the node
                    # remounts or is given up (chains.py: lost): not said to be gone
                    stored = (parent in owner or parent in owner.chains.lost) and parent not in owner.chains.missing
                    assert (child in chains.orphans) == (not stored), \
                        f"{child} (shard {shard}): orphan {child in chains.orphans}, parent {parent} stored {stored}"
            for parent, kids in chains.remote.items():
                for child in kids:
                    holder = self.sims[shard_of(child, n)].m._objects.chains
                    assert holder.parent.get(child) == parent, f"{parent} held for {child}, which names another"

    def check(self):
        self.check_shards()
        self.checks += 1
        if self.checks % 50 == 0 and self.sims[0].chained:
            self.settle_chains()
            self.check_shards()

    def check_shards(self):
        n = len(self.sims)
        for shard, sim in enumerate(self.sims):
            sim.check()
            m = sim.m
            assert all(shard_of(k, n) == shard for k in m._objects), f"shard {shard} holds another shard's key"
            for node_id, inv in sim.inv.items():
                assert all(shard_of(e[0], n) == shard for e in inv.entries.values() if e[3] != "reserved"), \
                    f"{node_id}'s inventory for shard {shard} holds another shard's key"
            for node_id, alloc in m._alloc.items():
                lo, length = arena_part(sim.caps[node_id], n, shard)
                assert (alloc.origin, alloc.capacity) == (lo, length), f"shard {shard} allocates outside its part"
                for obj in list(m._objects.values()) + list(m._pending.values()):
                    for r in obj.replicas:
                        if r.node_id == node_id and r.tier.value == "dram":
                            assert lo <= r.offset and r.offset + r.length <= lo + length, \
                                f"shard {shard}: {obj.key} at {r.offset} outside its part [{lo}, {lo + length})"


def run_checked(sim, seed) -> None:
    """``STEPS`` steps of ``sim``, its invariants checked after each; a failure names the
    seed and step to replay."""
    for i in range(STEPS):
        sim.step()
        try:
            sim.check()
        except AssertionError as e:
            raise AssertionError(f"seed {seed}, step {i}: {e} (rerun: MCR_SIM_SEED={seed})") from None


@pytest.mark.parametrize("seed", SEEDS[:15])
def test_sharded_masters_keep_invariants(seed):
    run_checked(ShardedSim(seed, shards=3), seed)


def test_sharded_runs_exercise_shard_restarts_node_deaths_repairs_and_the_disk_tier():
    """The sharded runs reach what they are meant to check (how often each happens varies
    with the random stream: seeds are run until each is seen often enough, 40 at most)."""
    restarts = kills = offloads = repairs = 0
    for seed in range(40):
        sim = ShardedSim(seed, shards=3, spill=True)
        for _ in range(STEPS):
            sim.step()
        restarts += sum(s.restarts for s in sim.sims)
        kills += sim.kills
        offloads += sum(s.m.counters["offloads"] + s.totals.get("offloads", 0) for s in sim.sims)
        repairs += sum(s.m.counters["repairs"] + s.totals.get("repairs", 0) for s in sim.sims)
        if restarts > 10 and kills > 10 and offloads > 20 and repairs > 20:
            break
    assert restarts > 10 and kills > 10 and offloads > 20 and repairs > 20, (restarts, kills, offloads, repairs)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_operations_keep_invariants(seed):
    run_checked(Sim(seed), seed)


def test_spill_runs_exercise_offload_and_promotion():
    # Twenty runs: a run's choices depend on set order (PYTHONHASHSEED) as well as its seed,
    # and the first ten promoted 3 or 4 values in all, at the bound, by hash seed; twenty
    # promote 18-19 (and offload 109-111) over 16 hash seeds.
    offloads = promotions = 0
    for seed in range(20):
        sim = Sim(seed, spill=True)
        for _ in range(STEPS):
            sim.step()
        offloads += sim.m.counters["offloads"] + sim.totals.get("offloads", 0)
        promotions += sim.m.counters["promotions"] + sim.totals.get("promotions", 0)
    assert offloads > 60 and promotions > 9, (offloads, promotions)
