"""A store node: the DRAM arena and the spill directory of one Ray node.

It is not on the data path of a DRAM hit: clients read and write the arena directly
through the transport (a memcpy through shared memory on the same host, UCX put/get or a
push from this node's engine across hosts, served in C++ without waking Python). What
runs here in Python is bookkeeping and the disk tier:

- the inventory (``inventory.py``: what this node holds and where): DRAM entries are
  written only by the master's messages, applied once and in order per mount; disk
  entries by this node when a spill file is complete, and deleted by the master's drops.
  Every (re)mount hands the whole inventory to the master, so a restarted master loses
  nothing, and a restarted node gets its spilled keys back;
- offloads (write these arena extents to disk) run on a worker thread, in batches,
  with io_uring; each batch is reported to the master (OFFLOAD_DONE);
- promotions (read this spilled object into that arena extent), asked by clients;
- mount and heartbeat (Ray actor calls to the master, from a thread that does nothing
  else once mounted): the heartbeat is the master's only evidence of liveness; one
  answered "unknown" means the master restarted or unmounted us, and we remount with
  the inventory.

With ``master.shards`` > 1 (``_private/shards.py``) all of this is per shard: each master
shard allocates from its own part of the arena and 1/N of the spill capacity, and this
node keeps one inventory per shard (a key's entries live in its shard's), takes each
shard's messages on a handler of its own, and mounts on and heartbeats to each shard from
a thread of its own, so a shard that is down or restarting holds up no other.

Lock order: ``_lock`` guards the inventories; it is never held across a call out.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import shutil
import threading
import time
import uuid

import ray

from mooncake_ray.config import StoreConfig
from mooncake_ray.errors import (
    ChecksumError,
    ConfigError,
    InvalidArgumentError,
    MooncakeRayError,
    ObjectNotFoundError,
)
from mooncake_ray._private import auth, gcyoung, logs, malloc_tune, preflight, rpc, shards
from mooncake_ray._private.store import arena
from mooncake_ray._private.auth import role_engine
from mooncake_ray._private.master.drain import FROM_DISK
from mooncake_ray._private.master.tiering import disk_length
from mooncake_ray._private.master.types import RESERVED, InventoryEntry
from mooncake_ray._private.master_client import MasterChannel
from mooncake_ray._private.store.copies import PeerCopier, extent_ok
from mooncake_ray._private.store.inventory import DISK, DRAM, StoreInventory
from mooncake_ray._private.store.spill_parents import SpillParents
from mooncake_ray._private.store.ring import CommitRing, ring_bytes
from mooncake_ray._private.naming import master_name
from mooncake_ray._private.native import _native

log = logging.getLogger(__name__)

_OFFLOAD_BATCH = 64
_REPORT_RETRY_S = 0.25  # first wait before resending an unacknowledged offload report
_REPORT_RETRY_MAX_S = 5.0
REPAIR_POLL_S = 0.5  # how often a node asks the master shards for repairs to make
RING_POLL_S = 0.005  # how often a node reads its commit rings (store/ring.py)
REPAIR_BATCH_BYTES = 16 << 20  # bytes of copies per master call
REPAIR_STEP_BYTES = 1 << 20  # bytes copied at a time, each followed by its share of the pace




def _promote_item_ok(item, capacity: int) -> bool:
    return (isinstance(item, list) and len(item) == 4 and type(item[0]) is str and type(item[1]) is int
            and extent_ok(item[2], item[3], capacity))


def _parts(plan: list, step: int) -> list[list]:
    """``plan``'s copies (``[key, gen, size, ...]``) in runs of about ``step`` bytes."""
    out, cur, n = [], [], 0
    for p in plan:
        cur.append(p)
        n += p[2]
        if n >= step:
            out.append(cur)
            cur, n = [], 0
    return out + [cur] if cur else out


class _ShardLink:
    """This node's side of one master shard: the inventory of that shard's keys, the
    node key it signs with, its mount, and the channel its calls go over."""

    def __init__(self, shard: int, part: tuple[int, int], channel: MasterChannel) -> None:
        self.shard = shard
        self.wake = threading.Event()  # heartbeat now (a restarted master asks: heartbeat_now)
        self.part_offset, self.part_length = part
        self.inv = StoreInventory()
        self.node_key: bytes | None = None  # from the master, before each mount (auth.py)
        self.mounted = threading.Event()
        self.channel = channel
        self.handle = None  # the master shard's Ray actor handle
        self.left = False  # drained off this shard: no heartbeat, no mount (StoreNodeActor.drain)
        self.ring: CommitRing | None = None  # where the master records puts it answers at once


class StoreNodeActor:
    def __init__(self, config: dict, node_id: str):
        logs.configure()
        self.started_at = time.time()  # this process's start (benchmarks: restart timings)
        gcyoung.raise_young_threshold()  # inventory messages: many records, each short-lived
        malloc_tune.fix_mmap_threshold()  # large transient blocks go back to the system when freed
        self.cfg = StoreConfig.model_validate(config)
        self.node_id = node_id
        self.incarnation = uuid.uuid4().hex[:16]
        t = self.cfg.transport
        self.engine = role_engine(self.cfg, f"store-{node_id[:8]}", server=True)
        self.startup = {"engine_s": time.time() - self.started_at}  # seconds from the process's start
        self.woken = 0  # heartbeat_now calls (restarted master shards asking for a remount)
        # values journaled with the checksum their writer took in its copy / read back here
        self.sums_given = self.sums_read = 0
        self.ring_records = 0  # records read from the commit rings
        self.arena_file, self.arena = self._open_arena()
        self.startup["arena_s"] = time.time() - self.started_at
        self._lock = threading.Lock()
        n = self.cfg.master.shards
        self._links = [_ShardLink(i, shards.arena_part(self.arena.length, n, i),
                                  MasterChannel(self.engine, self.cfg.namespace, retry_timeout_s=60.0,
                                                rpc_timeout_s=t.rpc_timeout_s, name=master_name(i)))
                       for i in range(n)]
        self._stall_until = 0.0  # fault injection: inventory messages wait until then
        self._fail_reports = 0  # fault injection: this many OFFLOAD_DONE reports fail first
        # Offload outcomes the master has not acknowledged yet: resent (with the next batch,
        # or alone when the worker is idle) until a report goes through. The master keeps the
        # DRAM copy and the disk reservation of an offload until it hears of it.
        self._unreported: list = []
        self._report_retry_at = 0.0
        self._report_delay = _REPORT_RETRY_S
        # (key, gen, offset) -> (pin, parent, copies) of DRAM values journaled from a commit
        # ring whose add the master's message has not brought yet: that add, when it says
        # the same, is not journaled again
        self._ring_journaled: dict[tuple, tuple] = {}
        left = self._open_rings()
        self.readopted = self._readopt(left) if self.arena_file is not None and self.arena_file.reused else None
        self.startup["readopted_s"] = time.time() - self.started_at
        self._parents = None  # the spilled values' chain parents (spill_parents.py)
        self.tier = self._open_spill()
        self._work: queue.Queue = queue.Queue()
        for link in self._links:
            self.engine.serve(rpc.node_inventory_rpc(link.shard), functools.partial(self._on_inventory, link))
        self.engine.serve(rpc.NODE_PROMOTE_RPC, self._on_promote)
        self.engine.serve_echo(rpc.NODE_ECHO_RPC)
        self._stop = threading.Event()
        self._left = threading.Event()  # drained: not mounted until Ray stops draining the node
        self.drain_report: dict | None = None
        self._drain_staging = None  # where a drain reads values from disk before moving them
        self._threads = [threading.Thread(target=self._heartbeat_loop, args=(link,), daemon=True,
                                          name=f"store-heartbeat-{link.shard}") for link in self._links]
        self._threads.append(threading.Thread(target=self._worker_loop, name="store-offload", daemon=True))
        if self.cfg.elastic.drain:
            self._threads.append(threading.Thread(target=self._drain_watch_loop, name="store-drain", daemon=True))
        if self.cfg.master.repair_bytes_per_s > 0:
            self._threads.append(threading.Thread(target=self._repair_loop, name="store-repair", daemon=True))
        if self.arena_file is not None:
            self._threads.append(threading.Thread(target=self._index_loop, name="store-arena-index", daemon=True))
        if any(link.ring is not None for link in self._links):
            self._threads.append(threading.Thread(target=self._ring_loop, name="store-commit-ring", daemon=True))
        for th in self._threads:
            th.start()

    def _open_arena(self):
        """The arena: a file in shared memory that a restart re-adopts (``arena.py``), or
        (``elastic.keep_arena`` false, or no room there) memory UCX allocates."""
        seg, el = self.cfg.segment_size_bytes, self.cfg.elastic
        if el.keep_arena:
            arena.collect_garbage(el.arena_dir)
            try:
                f = arena.ArenaFile(el.arena_dir, self.cfg.namespace, self.node_id, seg, self.cfg.prefault)
            except (OSError, ConfigError) as e:
                log.warning("arena kept in memory only (a restart loses it): %s", e)
            else:
                if not f.reused:
                    self._check_memory(seg)
                return f, self.engine.register((f.addr, seg))
        self._check_memory(seg)
        return None, self.engine.alloc_arena(seg)

    @staticmethod
    def _check_memory(seg: int) -> None:
        avail = preflight.mem_available()
        if seg > avail:  # start() checked the host; this guards against memory taken since
            raise ConfigError(f"segment_size_bytes={seg} is more than this host's available memory "
                              f"({avail} bytes): the arena's pre-fault would exhaust it")

    def _open_rings(self) -> list[list[tuple]]:
        """Each shard link's commit ring (``ring.py``), beside the kept arena; returns, per
        link, the records the previous process of this node left unread."""
        left: list[list[tuple]] = [[] for _ in self._links]
        for link in self._links:
            if self.arena_file is not None and self.cfg.master.durable_acks:
                try:
                    link.ring, left[link.shard] = CommitRing.create(f"{self.arena_file.stem}.ring{link.shard}",
                                                                    ring_bytes(self.arena.length // len(self._links)))
                except OSError as e:
                    log.warning("no commit ring (puts wait for this node's answer instead): %s", e)
        return left

    def _read_ring(self, link: _ShardLink) -> None:
        """Apply the records the master wrote to ``link``'s commit ring since the last
        read, and journal them with their checksums (lock held). Called before any message
        of the master is applied, so a later drop or replacement applies after them.

        In C++ (``NodeTable.read_ring``): parsed, applied to the table, checksummed where
        the writing client took no checksum, and journaled as one batch, with no Python
        object per record. They count as read in the ring only once journaled: a node
        killed in between finds them there again at its restart (they were acknowledged
        from the ring)."""
        ring = link.ring
        if ring is None or not ring.pending():
            return
        arena = self.arena_file  # a ring lives beside a kept arena: there is a journal
        records, given, summed, tail, told = link.inv.table.read_ring(ring.addr, ring.nbytes, arena.addr,
                                                                      arena.length, arena.journal_fd)
        # commits a message of the master will add too: that add need not be journaled again
        for key, gen, offset, parent, want in told:
            self._ring_journaled[(key, gen, offset)] = (0, parent, want)
        self.ring_records += records
        self.sums_given += given
        self.sums_read += summed
        ring.commit(tail)

    def _ring_loop(self) -> None:
        """Read the commit rings every few milliseconds: the native index's commits reach
        the node only there (no message of the master follows them), and a ring the node
        does not read fills up, after which commits wait for the node again."""
        rings = [link for link in self._links if link.ring is not None]
        while rings and not self._stop.wait(RING_POLL_S):
            for link in rings:
                if link.ring is not None and link.ring.pending():
                    with self._lock:
                        self._read_ring(link)

    def _readopt(self, ring_left: list[list[tuple]]) -> dict:
        """Take back the values the previous process of this node left in the arena: each
        entry of its index whose bytes still have the checksum it was saved with, and the
        values its commit rings named that it had not read yet (newer than its journal;
        checksummed now). The master checks them against what it lost when the node mounts.

        The index files stay as they are, and what this changed is appended to the journal
        (the ring's values, the drops of entries whose bytes no longer match), so that the
        files still say what the arena holds; the index loop compacts them later, off the
        restart's path (a new snapshot of a million values took 0.7 s)."""
        started = time.monotonic()
        cap = self.arena.length
        extra = [(key, gen, size, offset, length, 0, parent, crc, want)
                 for recs in ring_left  # a range handed out for writing is kept as the journal keeps them
                 for key, gen, size, offset, length, parent, reserved, want, crc, _alone in recs
                 if not reserved and extent_ok(offset, length, cap) and 0 <= size <= length]
        one = len(self._links) == 1
        table = self._links[0].inv.table if one else _native.NodeTable()
        bad = self.arena_file.load_into(table, extra)
        # every value's bytes against its checksum, natively; a ring's value without the
        # client's checksum is taken as its bytes are now
        bad += [[k, g] for k, g in table.verify(self.arena_file.addr, self.arena_file.length)]
        if not one:  # each shard link's values into its own table
            import numpy as np

            keys, parents, rows = table.dram_rows()
            rows = np.frombuffer(rows, dtype="<i8").reshape(-1, 7)
            owner = np.fromiter((shards.shard_of(k, len(self._links)) for k in keys), dtype=np.int64, count=len(keys))
            for link in self._links:
                mine = owner == link.shard
                pick = mine.tolist()
                link.inv.table.load_rows([k for k, m in zip(keys, pick) if m], [p for p, m in zip(parents, pick) if m],
                                         rows[mine].tobytes())
        kept, dropped = table.counts()[1], len(bad)
        ringed = []
        for key, gen, size, offset, length, _pin, parent, _crc, want in extra:  # as the journal will keep them
            t = self._link(key).inv.table
            e = t.get(key, DRAM)
            if e is not None and (e[1], e[4]) == (gen, offset):
                ringed.append([key, gen, e[2], offset, e[5], 0, e[7], t.crc_of(key, gen, offset), e[8]])
        if bad or ringed:  # and the bad ones' drops
            self.arena_file.journal(ringed, bad)
        report = {"event": "readopted", "node_id": self.node_id, "keys": kept, "dropped": dropped,
                  "seconds": time.monotonic() - started}
        log.warning("re-adopted the arena of the previous process: %d values kept, %d dropped (bad checksum)",
                    kept, dropped)
        return report

    def _journal(self, link: _ShardLink, delta) -> None:
        """Record one applied inventory message in the arena's journal, each added DRAM
        value with the checksum of its bytes (under the lock: in the order applied; before
        the master hears it applied). A value committed through the ring was journaled and
        checksummed when the ring was read (``_read_ring``): the master's message adding it
        (the same key, gen and place, so the same bytes) is journaled again only if it
        changes the entry (a pin set meanwhile)."""
        adds, drops, _offloads = delta
        out, checksum, ringed = [], self.arena_file.checksum, self._ring_journaled
        crc_of, set_crc = link.inv.table.crc_of, link.inv.table.set_crc
        for e in adds:
            if e[3] == DRAM:
                at = (e[0], e[1], e[4])
                rest = (e[6] if len(e) > 6 else 0, e[7] if len(e) > 7 else "", e[8] if len(e) > 8 else 1)
                if ringed.pop(at, None) == rest:
                    continue
                crc = crc_of(*at)
                if crc is None:
                    crc = checksum(e[4], e[2])
                    set_crc(*at, crc)
                    self.sums_read += 1
                out.append([e[0], e[1], e[2], e[4], e[5], rest[0], rest[1], crc, rest[2]])
        gone = [[d[0], d[1]] for d in drops if d[2] == DRAM]
        if out or gone:
            self.arena_file.journal(out, gone)

    def _index_loop(self) -> None:
        """Compact the arena's journal into a snapshot once it has grown as large as the
        last snapshot (at least 4 MiB; amortized, a value is written a bounded number of
        times), or 30 s after its last change (``_compact``). Not while a master shard is
        mounting this node: a restarted node finds the journal of a million puts and would
        build a snapshot of it (seconds of its GIL and of the host's CPUs) while packing its
        inventory for the mount; the journal grows only through mounted shards."""
        last, snapshot_bytes = time.monotonic(), 0
        while not self._stop.wait(1.0):
            if not all(link.left or link.mounted.is_set() for link in self._links):
                continue
            try:
                size = self.arena_file.journal_bytes()
                if size < max(4 << 20, snapshot_bytes) and not (size and time.monotonic() - last > 30.0):
                    continue
                snapshot_bytes = self._compact()
                last = time.monotonic()
            except Exception:  # never stop: a later round compacts it
                log.exception("compacting the arena index failed")

    def _compact(self) -> int:
        """Write the arena's index snapshot; returns its size. Under the lock only what
        must be taken at one moment: each table's checksummed DRAM entries, encoded as a
        snapshot (``NodeTable.snapshot``: no Python object per value), and the journal's
        rotation; the snapshot is written outside it (holding the lock for the whole
        write held a node of a million values for over a second, and with it the master's
        messages and a mount). A value not checksummed yet is in the journal that follows.
        Ring values still waiting for a master's add that will never come (dropped since)
        are forgotten afterwards, under the lock again."""
        with self._lock:
            parts = [link.inv.table.snapshot()[1] for link in self._links]
            self.arena_file.rotate_journal()
        data = parts[0] if len(parts) == 1 else _native.join_snapshots(parts)
        del parts
        if self._ring_journaled:
            with self._lock:
                for at in list(self._ring_journaled):
                    e = self._link(at[0]).inv.table.get(at[0], DRAM)
                    if e is None or (e[1], e[4]) != (at[1], at[2]):
                        self._ring_journaled.pop(at, None)
        return self.arena_file.save_snapshot(data)

    def debug_compact(self) -> int:
        """Write the arena's index snapshot now (tests); returns its size in bytes, 0 with
        no kept arena."""
        return self._compact() if self.arena_file is not None else 0

    @property
    def inv(self) -> StoreInventory:
        """The inventory of an unsharded store (shard 0's)."""
        return self._links[0].inv

    def _link(self, key: str) -> _ShardLink:
        return self._links[shards.shard_of(key, len(self._links))]

    # ------------------------------------------------------------------ spill ----
    def _open_spill(self):
        sp = self.cfg.spill
        if not sp.enabled:
            return None
        from mooncake_ray._private.store.spill import SpillTier

        directory = os.path.join(sp.directory, self.node_id[:16])
        os.makedirs(directory, exist_ok=True)
        cap = sp.capacity_bytes or int(shutil.disk_usage(directory).free * 0.95)
        tier = SpillTier(directory, cap, queue_depth=sp.queue_depth, use_uring=sp.use_uring)
        found = tier.keys()  # opening the tier scanned the headers
        self._parents = SpillParents(directory)
        parents = self._parents.load({key: gen for key, gen, _length in found})
        for key, gen, length in found:
            self._link(key).inv.add_disk(InventoryEntry(key, gen, length, DISK, 0, disk_length(length, key), 0,
                                                        parents.get(key, "")))
        log.info("spill tier %s: %d objects found", directory, tier.num_keys)
        return tier

    def _on_promote(self, data: bytes) -> bytes:
        """Read spilled objects into the arena extents the master reserved for them:
        ``[[key, gen, offset, size], ...]`` in, an error class name per item out ("" = done).
        Asked by a client; an item is read only if it is inside the arena and the master
        confirms it reserved that extent for it (PROMOTE_BEGIN), and the outcome goes to
        the master from here (PROMOTE_DONE), both signed with the node key."""
        items = rpc.unpack(data)
        if not isinstance(items, list):
            raise InvalidArgumentError(f"a promote request is a list of items, got {type(items).__name__}")
        if self.tier is None:
            return rpc.pack([ObjectNotFoundError.__name__] * len(items))
        base, cap = self.arena.addr, self.arena.length
        good = [i for i, it in enumerate(items) if _promote_item_ok(it, cap)]
        if good:
            asked = [items[i] for i in good]
            reserved = self._call_master(rpc.PROMOTE_BEGIN, asked)
            good = [i for i, ok in zip(good, reserved) if ok]
        if len(good) < len(items):
            log.warning("refused %d promote item(s): outside the arena, malformed, or not reserved by the master",
                        len(items) - len(good))
        out = [InvalidArgumentError.__name__] * len(items)
        results = self.tier.read_many([(items[i][0], base + items[i][2], items[i][3]) for i in good])
        for i, res in zip(good, results):
            key, gen = items[i][0], items[i][1]
            if isinstance(res, BaseException):
                name = type(res).__name__
                if isinstance(res, (ChecksumError, ObjectNotFoundError)):
                    with self._lock:  # the tier deleted the corrupt file
                        self._link(key).inv.drop_disk(key, gen)
            else:
                name = "" if res == gen else ObjectNotFoundError.__name__
            out[i] = name
        if good:
            self._call_master(rpc.PROMOTE_DONE, [[items[i][0], items[i][1], items[i][2], out[i]] for i in good])
        return rpc.pack(out)

    def _call_master(self, op: int, items: list) -> list | None:
        """A call only store nodes may make, signed with the node key: to each shard, its
        keys' items (each item's first field is its key). Returns the replies' lists joined
        in the order of ``items`` (None for calls that answer nothing)."""
        if len(self._links) == 1:
            return self._call_shard(self._links[0], op, items)
        out: list = [None] * len(items)
        answered = False
        for link, idxs in zip(self._links, shards.split([it[0] for it in items], len(self._links))):
            if idxs:
                got = self._call_shard(link, op, [items[i] for i in idxs])
                if got is not None:
                    answered = True
                    for i, g in zip(idxs, got):
                        out[i] = g
        return out if answered else None

    def _call_shard(self, link: _ShardLink, op: int, items: list):
        return link.channel.call(op, self.node_id, items, auth.mac(link.node_key or b"", [self.node_id, items]))

    def _worker_loop(self) -> None:
        """Offloads and disk deletions, in the order the master asked for them."""
        while not self._stop.is_set():
            try:
                first = self._work.get(timeout=self._report_delay if self._unreported else 0.5)
            except queue.Empty:
                if self._unreported and time.monotonic() >= self._report_retry_at:
                    self._send_reports()
                continue
            batch = [first]
            while len(batch) < _OFFLOAD_BATCH:
                try:
                    batch.append(self._work.get_nowait())
                except queue.Empty:
                    break
            try:
                self._run_batch(batch)
            except Exception:  # never let the worker die: report and go on
                log.exception("offload batch failed")

    def _run_batch(self, batch) -> None:
        offloads = []
        for kind, item in batch:
            if kind == "drop":
                key, gen = item
                info = self.tier.info(key) if self.tier else None
                if info is not None and info[1] <= gen:
                    self.tier.remove(key)
                with self._lock:
                    self._link(key).inv.drop_disk(key, gen)
            else:
                offloads.append(item)
        if not offloads:
            return
        base, cap = self.arena.addr, self.arena.length
        results: list = [MooncakeRayError("this node has no spill tier")] * len(offloads)
        if self.tier is not None:
            good = [i for i, (_k, _g, size, off, _ln) in enumerate(offloads) if extent_ok(off, size, cap)]
            for i in set(range(len(offloads))) - set(good):
                results[i] = InvalidArgumentError(f"offload extent at {offloads[i][3]!r} of {offloads[i][2]!r} "
                                                  f"bytes is outside the arena of {cap} bytes")
            try:
                written = self.tier.write_many([(k, g, base + off, size) for k, g, size, off, _ln in
                                                (offloads[i] for i in good)])
            except Exception as e:  # the whole batch failed: each item is reported as failed
                log.exception("offload batch write failed")
                written = [e] * len(good)
            for i, res in zip(good, written):
                results[i] = res
        report, chained = [], []
        for (key, gen, size, _off, _ln), res in zip(offloads, results):
            ok = not isinstance(res, BaseException)
            if ok:
                with self._lock:
                    inv = self._link(key).inv
                    inv.add_disk(InventoryEntry(key, gen, size, DISK, 0, disk_length(size, key)))
                    parent = inv.entries[(key, DISK)][7]
                if parent:
                    chained.append((key, gen, parent))
            degraded = self.tier.degraded if self.tier is not None else "no spill tier"
            report.append([key, gen, disk_length(size, key), ok, "" if ok else (degraded or "")])
        if chained:
            self._note_parents(chained)
        self._unreported.extend(report)
        self._send_reports()

    def _note_parents(self, chained: list) -> None:
        """Keep the chain parents of values just written to disk beside them (a failure
        costs only their chain position after a restart)."""
        try:
            with self._lock:
                self._parents.record(chained)
                if self._parents.due():
                    self._parents.rewrite([(e[0], e[1], e[7]) for link in self._links
                                           for e in link.inv.disk.values() if e[7]])
        except OSError:
            log.exception("recording the parents of spilled values failed")

    def _send_reports(self) -> bool:
        """Sends every offload outcome not yet acknowledged (``offload_done`` is idempotent,
        so one that arrived but whose reply was lost may go twice). On failure they stay,
        and the worker tries again after a growing wait."""
        items = list(self._unreported)
        try:
            if self._fail_reports > 0:
                self._fail_reports -= 1
                raise MooncakeRayError("offload report failed (fault injection)")
            self._call_master(rpc.OFFLOAD_DONE, items)
        except Exception as e:
            log.warning("offload report of %d item(s) not delivered, will resend: %s", len(items), e)
            self._report_retry_at = time.monotonic() + self._report_delay
            self._report_delay = min(_REPORT_RETRY_MAX_S, self._report_delay * 2)
            return False
        del self._unreported[:len(items)]
        self._report_delay = _REPORT_RETRY_S
        return True

    # ---------------------------------------------------------------- inventory --
    def _on_inventory(self, link: _ShardLink, data: bytes) -> bytes:
        """One message of a master shard's stream: ``[mount_id, seq, [adds, drops,
        offloads]]``, signed with that shard's node key (anyone else's is refused before it
        is decoded)."""
        mount_id, seq, delta = rpc.unpack_tuples(auth.unseal(link.node_key, data))
        if self._stall_until > time.monotonic():  # fault injection (tests): a stalled applier
            time.sleep(max(0.0, self._stall_until - time.monotonic()))
        with self._lock:
            self._read_ring(link)
            before = (link.inv.mount_id, link.inv.applied_seq)
            answer, files, offloads = link.inv.apply(mount_id, seq, delta)
            if self.arena_file is not None and (link.inv.mount_id, link.inv.applied_seq) != before:
                self._journal(link, delta)  # before the master hears it: an acknowledged put is in it
        for key, gen in files:
            self._work.put(("drop", (key, gen)))
        for item in offloads:
            self._work.put(("offload", item))
        return answer

    def debug_stall_inventory(self, seconds: float) -> None:
        """Fault injection: hold inventory messages for ``seconds`` before applying them."""
        self._stall_until = time.monotonic() + seconds

    def debug_fail_offload_reports(self, count: int) -> int:
        """Fault injection: the next ``count`` offload reports to the master fail. Returns
        how many of the previous injection had not been used up yet."""
        left, self._fail_reports = self._fail_reports, count
        return left

    def info(self, shard: int = 0) -> dict:
        """What master shard ``shard`` knows of this node: its transport address and arena,
        the part of the arena it allocates from, and its share of the spill capacity."""
        sp = self.cfg.spill
        link = self._links[shard]
        return {
            "node_id": self.node_id,
            "incarnation": self.incarnation,
            "address": self.engine.address,
            "rkey": self.arena.rkey,
            "base": self.arena.addr,
            "capacity": link.part_length,
            "part_offset": link.part_offset,
            "arena_length": self.arena.length,
            "ray_node_id": self.node_id,
            "spill_capacity": self.tier.capacity_bytes // len(self._links) if self.tier else 0,
            "spill_high_watermark": sp.high_watermark,
            "memory_types": self.engine.memory_types,
            "arena_file": self.arena_file.path if self.arena_file else "",
            "arena_file_id": self.arena_file.file_id if self.arena_file else [],
            "boot_id": arena.boot_id(),
        }

    # ---------------------------------------------------------------- liveness --
    def _master_handle(self, link: _ShardLink):
        if link.handle is None:
            link.handle = ray.get_actor(master_name(link.shard), namespace=self.cfg.namespace)
        return link.handle

    def _mount(self, link: _ShardLink) -> None:
        link.mounted.clear()
        if link.left:
            return
        self.startup.setdefault("mount_begun_s", time.time() - self.started_at)
        master = self._master_handle(link)
        link.node_key = ray.get(master.node_key.remote(), timeout=60)
        info = self.info(link.shard)
        self.startup.setdefault("node_key_s", time.time() - self.started_at)
        with self._lock:  # from here on, messages of earlier mounts are refused
            self._read_ring(link)
            mount_id, entries = link.inv.begin_mount(packed=True)
            # the master mounted now sends no add for what its rings held: it reads the inventory
            self._ring_journaled = {at: v for at, v in self._ring_journaled.items() if self._link(at[0]) is not link}
            if link.ring is not None:
                info.update(commit_ring=link.ring.path, commit_ring_epoch=link.ring.new_epoch(), pid=os.getpid(),
                            pid_ns=arena.pid_namespace())
        self.startup.setdefault("packed_s", time.time() - self.started_at)
        ray.get(master.mount.remote(info, entries, mount_id), timeout=60)
        link.mounted.set()
        self.startup.setdefault("mounted_s", time.time() - self.started_at)
        if self.readopted is not None and link.shard == 0 and not self.readopted.get("reported"):
            master.note_event.remote(self.readopted)
            self.readopted["reported"] = True

    def _heartbeat_loop(self, link: _ShardLink) -> None:
        period = self.cfg.master.heartbeat_interval_s
        beats = 0
        while not self._stop.is_set():
            if link.left:
                self._stop.wait(period)
                continue
            try:
                if not link.mounted.is_set():
                    self._mount(link)
                else:
                    degraded = self.tier.degraded if self.tier else None
                    if degraded and beats % 10 == 0 and link.shard == 0:
                        self.tier.recover()  # the disk may be back (space freed, dir recreated)
                        degraded = self.tier.degraded
                    # The disk's use as the node sees it: reported to shard 0 only, so the
                    # shards' stats add up to it.
                    used = self.tier.used_bytes if self.tier and link.shard == 0 else None
                    ok = ray.get(self._master_handle(link).heartbeat.remote(
                        self.node_id, self.incarnation, link.inv.mount_id, used, degraded),
                        timeout=max(2.0, period * 3))
                    if not ok:
                        log.warning("master shard %d does not know this store node: remounting", link.shard)
                        self._mount(link)
            except Exception as e:  # master restarting or unreachable: keep trying
                log.info("heartbeat/mount to master shard %d failed (%s); retrying", link.shard, e)
                if isinstance(e, ValueError):
                    link.handle = None
            beats += 1
            link.wake.wait(period)
            link.wake.clear()

    # ------------------------------------------------------------------- drain --
    def _drain_watch_loop(self) -> None:
        """Watch Ray's drain of this node; drain the store node once it starts (a drain that
        failed, e.g. the master restarting, is tried again at the next look). A node Ray
        no longer drains mounts again with what it still holds."""
        from mooncake_ray._private import elastic

        while not self._stop.wait(self.cfg.elastic.poll_s):
            try:
                deadline = elastic.draining_nodes().get(self.node_id)
            except Exception as e:  # the GCS is restarting: look again later
                log.info("could not read Ray's draining nodes (%s)", e)
                continue
            if deadline is not None and not self._left.is_set() and all(l.mounted.is_set() for l in self._links):
                try:
                    self.drain(deadline)
                except Exception:
                    log.exception("drain of store node %s failed", self.node_id)
            elif deadline is None and self._left.is_set():
                log.warning("Ray no longer drains node %s: the store node mounts again", self.node_id)
                for link in self._links:
                    link.left = False
                self._left.clear()

    def drain(self, deadline: float = 0.0) -> dict:
        """Move this node's values to the other store nodes, most recently used first,
        until none is left or ``deadline`` (Unix seconds, less ``elastic.drain_margin_s``;
        0: ``elastic.drain_no_deadline_s`` from now), then unmount. Reads are served
        meanwhile. Returns what was moved and lost (keys, bytes), summed over shards."""
        el = self.cfg.elastic
        until = (deadline - el.drain_margin_s) if deadline > 0 else time.time() + el.drain_no_deadline_s
        started = time.monotonic()
        total = {"moved_keys": 0, "moved_bytes": 0, "failed_moves": 0, "lost_keys": 0, "lost_bytes": 0}
        spent = {"connect_s": 0.0, "plan_s": 0.0, "copy_s": 0.0, "done_s": 0.0, "disk_s": 0.0}
        masters = [self._master_handle(link) for link in self._links]
        ray.get([m.drain_begin.remote(self.node_id) for m in masters], timeout=60)
        for link, master in zip(self._links, masters):
            self._drain_shard(master, until, spent)
            link.left = True
            try:
                report = ray.get(master.drain_end.remote(self.node_id), timeout=60)
            except BaseException:
                link.left = False  # still mounted there: keep heartbeating, drain again later
                raise
            link.mounted.clear()
            for k in total:
                total[k] += report[k]
        self._left.set()
        if self._drain_staging is not None:  # only a drain reads values from disk into it
            self._drain_staging.close()
            self._drain_staging = None
        total.update(node_id=self.node_id, seconds=time.monotonic() - started, deadline=deadline, **spent)
        self.drain_report = total
        log.warning("drained: %d keys (%d bytes) moved, %d keys (%d bytes) lost in %.1fs", total["moved_keys"],
                    total["moved_bytes"], total["lost_keys"], total["lost_bytes"], total["seconds"])
        return total

    def _drain_shard(self, master, until: float, spent: dict) -> None:
        """Plan, copy and report batches of moves with one master shard, pipelined: the
        next batch is planned while the last one's bytes are copied, and reports are sent
        without waiting (all are waited for before the drain ends)."""
        copier = PeerCopier(self.engine, self.node_id, self.arena.addr, self.arena.length, "drain")
        timeout = self.cfg.transport.transfer_timeout_s
        inflight, reports = None, []

        def finish(batch) -> None:
            plan, ok, handle, t_copy = batch
            report = copier.finish(plan, ok, handle, min(timeout, max(1.0, until - time.time())))
            spent["copy_s"] += time.monotonic() - t_copy
            reports.append(master.drain_done.remote(self.node_id, report))

        while time.time() < until:
            t0 = time.monotonic()
            ref = master.drain_plan.remote(self.node_id, self.cfg.elastic.drain_batch_bytes)
            if inflight is not None:
                finish(inflight)
                inflight = None
            plan, again = ray.get(ref, timeout=60)
            t1 = time.monotonic()
            spent["plan_s"] += t1 - t0
            if not plan:
                if not again:
                    break
                time.sleep(0.05)  # puts into this node still in flight
                continue
            copier.connect(master, plan)
            t2 = time.monotonic()
            spent["connect_s"] += t2 - t1
            # (the batch before is finished: its staged bytes are no longer read)
            staged = self._read_for_drain(plan)
            spent["disk_s"] += time.monotonic() - t2
            ok, handle = copier.start(plan, staged)
            inflight = (plan, ok, handle, t2)
        if inflight is not None:
            finish(inflight)
        t3 = time.monotonic()
        ray.get(reports, timeout=60)
        spent["done_s"] += time.monotonic() - t3

    def _read_for_drain(self, plan: list) -> dict[int, int]:
        """Read the moves of ``plan`` whose value is only on this node's disk (source
        ``FROM_DISK``) through the spill tier into a staging buffer of this engine's;
        returns, by position in ``plan``, where each one that read back whole (its
        checksum checked, its generation the planned one) now is."""
        disk = [i for i, it in enumerate(plan) if it[3] == FROM_DISK]
        if not disk or self.tier is None:
            return {}
        offs, need = [], 0
        for i in disk:
            offs.append(need)
            need += -(-plan[i][2] // 4096) * 4096
        if self._drain_staging is None or self._drain_staging.length < need:
            if self._drain_staging is not None:
                self._drain_staging.close()
            self._drain_staging = self.engine.alloc_arena(max(need, self.cfg.elastic.drain_batch_bytes))
        base = self._drain_staging.addr
        results = self.tier.read_many([(plan[i][0], base + off, plan[i][2]) for i, off in zip(disk, offs)])
        out = {}
        for i, off, res in zip(disk, offs, results):
            if res == plan[i][1]:
                out[i] = base + off
            else:
                log.warning("drain: %s not read from disk (%s)", plan[i][0], res)
        return out

    # ----------------------------------------------------------------- repairs --
    def _repair_loop(self) -> None:
        """Make the copies the master shards plan from this node's values for values short
        of copies (``master/repairs.py``), at most ``master.repair_bytes_per_s``."""
        rate = self.cfg.master.repair_bytes_per_s
        batch = max(1 << 20, min(REPAIR_BATCH_BYTES, rate // 4))
        timeout = self.cfg.transport.transfer_timeout_s
        copier = PeerCopier(self.engine, self.node_id, self.arena.addr, self.arena.length, "repair")
        while not self._stop.wait(REPAIR_POLL_S):
            for link in self._links:
                if link.left or not link.mounted.is_set():
                    continue
                report: list = []
                try:
                    master = self._master_handle(link)
                    while True:  # each step reports the last batch and takes the next
                        plan = ray.get(master.repair_round.remote(self.node_id, report, batch), timeout=60)
                        report = []
                        if not plan:
                            break
                        copier.connect(master, plan)
                        # Copied a MiB at a time at the configured rate, not in one burst
                        # per batch: clients' calls keep finding a CPU meanwhile.
                        for part in _parts(plan, REPAIR_STEP_BYTES):
                            t0 = time.monotonic()
                            report += copier.finish(part, *copier.start(part), timeout)
                            if self._stop.wait(max(0.0, sum(p[2] for p in part) / rate - (time.monotonic() - t0))):
                                break
                        if self._stop.is_set():
                            return  # what was not reported expires at its deadline
                except Exception as e:  # master restarting or unreachable: next round (copies
                    # not reported are dropped at their deadline and planned again)
                    log.info("repairs with master shard %d paused (%s)", link.shard, e)

    def wait_mounted(self, timeout_s: float = 60.0) -> bool:
        """Whether every master shard has mounted this node within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        return all(link.mounted.wait(max(0.0, deadline - time.monotonic())) for link in self._links)

    def inventory_snapshot(self) -> list:
        """Every entry of every shard's inventory."""
        with self._lock:
            return [e for link in self._links for e in link.inv.snapshot()]

    def stats(self) -> dict:
        with self._lock:
            parts = [link.inv.counts() for link in self._links]
        counts = {k: sum(p[k] for p in parts) for k in parts[0]}
        out = {"node_id": self.node_id, "capacity": self.arena.length, **counts,
               "left": self._left.is_set(), "drain": self.drain_report, "started_at": self.started_at,
               "readopted": self.readopted, "startup": self.startup, "woken": self.woken,
               "checksums_given": self.sums_given, "checksums_read": self.sums_read,
               "ring_records": self.ring_records}
        if self.tier is not None:
            out["spill"] = {**self.tier.stats(), "degraded": self.tier.degraded,
                            "used_bytes": self.tier.used_bytes, "capacity_bytes": self.tier.capacity_bytes}
        return out

    def spill_directory(self) -> str | None:
        return self.tier.directory if self.tier else None

    def ping(self) -> str:
        return self.incarnation

    def pid(self) -> int:
        return os.getpid()

    def heartbeat_now(self, shard: int) -> None:
        """Heartbeat master shard ``shard`` now, not at the end of the period (its restarted
        actor asks, so the node remounts at once)."""
        if 0 <= shard < len(self._links):
            self.woken += 1
            self._links[shard].wake.set()

    def shutdown(self) -> None:
        self._stop.set()
        for link in self._links:
            link.wake.set()

    def release(self) -> None:
        """The store is being stopped: delete the arena's files (the mapping lives on
        until the process ends)."""
        self._stop.set()
        for link in self._links:
            link.wake.set()
        if self.arena_file is not None:
            self.arena_file.remove()
