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
from mooncake_ray._private import auth, gcyoung, preflight, rpc, shards
from mooncake_ray._private.auth import role_engine
from mooncake_ray._private.master.tiering import disk_length
from mooncake_ray._private.master.types import InventoryEntry
from mooncake_ray._private.master_client import MasterChannel
from mooncake_ray._private.store.inventory import DISK, StoreInventory
from mooncake_ray._private.naming import master_name

log = logging.getLogger(__name__)

_OFFLOAD_BATCH = 64


def _extent_ok(offset, size, capacity: int) -> bool:
    """``[offset, offset + size)`` is inside an arena of ``capacity`` bytes."""
    return type(offset) is int and type(size) is int and 0 <= offset and 0 <= size <= capacity - offset


def _promote_item_ok(item, capacity: int) -> bool:
    return (isinstance(item, list) and len(item) == 4 and type(item[0]) is str and type(item[1]) is int
            and _extent_ok(item[2], item[3], capacity))


class _ShardLink:
    """This node's side of one master shard: the inventory of that shard's keys, the
    node key it signs with, its mount, and the channel its calls go over."""

    def __init__(self, shard: int, part: tuple[int, int], channel: MasterChannel) -> None:
        self.shard = shard
        self.part_offset, self.part_length = part
        self.inv = StoreInventory()
        self.node_key: bytes | None = None  # from the master, before each mount (auth.py)
        self.mounted = threading.Event()
        self.channel = channel
        self.handle = None  # the master shard's Ray actor handle


class StoreNodeActor:
    def __init__(self, config: dict, node_id: str):
        gcyoung.raise_young_threshold()  # inventory messages: many records, each short-lived
        self.cfg = StoreConfig.model_validate(config)
        self.node_id = node_id
        self.incarnation = uuid.uuid4().hex[:16]
        t = self.cfg.transport
        self.engine = role_engine(self.cfg, f"store-{node_id[:8]}", server=True)
        seg, avail = self.cfg.segment_size_bytes, preflight.mem_available()
        if seg > avail:  # start() checked the host; this guards against memory taken since
            raise ConfigError(f"segment_size_bytes={seg} is more than this host's available memory "
                              f"({avail} bytes): the arena's pre-fault would exhaust it")
        self.arena = self.engine.alloc_arena(seg)
        self._lock = threading.Lock()
        n = self.cfg.master.shards
        self._links = [_ShardLink(i, shards.arena_part(self.arena.length, n, i),
                                  MasterChannel(self.engine, self.cfg.namespace, retry_timeout_s=60.0,
                                                rpc_timeout_s=t.rpc_timeout_s, name=master_name(i)))
                       for i in range(n)]
        self._stall_until = 0.0  # fault injection: inventory messages wait until then
        self.tier = self._open_spill()
        self._work: queue.Queue = queue.Queue()
        for link in self._links:
            self.engine.serve(rpc.node_inventory_rpc(link.shard), functools.partial(self._on_inventory, link))
        self.engine.serve(rpc.NODE_PROMOTE_RPC, self._on_promote)
        self.engine.serve_echo(rpc.NODE_ECHO_RPC)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._heartbeat_loop, args=(link,), daemon=True,
                                          name=f"store-heartbeat-{link.shard}") for link in self._links]
        self._threads.append(threading.Thread(target=self._worker_loop, name="store-offload", daemon=True))
        for th in self._threads:
            th.start()

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
        for key, gen, length in tier.keys():  # opening the tier scanned the headers
            self._link(key).inv.add_disk(InventoryEntry(key, gen, length, DISK, 0, disk_length(length, key)))
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
                first = self._work.get(timeout=0.5)
            except queue.Empty:
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
            good = [i for i, (_k, _g, size, off, _ln) in enumerate(offloads) if _extent_ok(off, size, cap)]
            for i in set(range(len(offloads))) - set(good):
                results[i] = InvalidArgumentError(f"offload extent at {offloads[i][3]!r} of {offloads[i][2]!r} "
                                                  f"bytes is outside the arena of {cap} bytes")
            written = self.tier.write_many([(k, g, base + off, size) for k, g, size, off, _ln in
                                            (offloads[i] for i in good)])
            for i, res in zip(good, written):
                results[i] = res
        report = []
        for (key, gen, size, _off, _ln), res in zip(offloads, results):
            ok = not isinstance(res, BaseException)
            if ok:
                with self._lock:
                    self._link(key).inv.add_disk(InventoryEntry(key, gen, size, DISK, 0, disk_length(size, key)))
            degraded = self.tier.degraded if self.tier is not None else "no spill tier"
            report.append([key, gen, disk_length(size, key), ok, "" if ok else (degraded or "")])
        self._call_master(rpc.OFFLOAD_DONE, report)

    # ---------------------------------------------------------------- inventory --
    def _on_inventory(self, link: _ShardLink, data: bytes) -> bytes:
        """One message of a master shard's stream: ``[mount_id, seq, [adds, drops,
        offloads]]``, signed with that shard's node key (anyone else's is refused before it
        is decoded)."""
        mount_id, seq, delta = rpc.unpack_tuples(auth.unseal(link.node_key, data))
        if self._stall_until > time.monotonic():  # fault injection (tests): a stalled applier
            time.sleep(max(0.0, self._stall_until - time.monotonic()))
        with self._lock:
            answer, files, offloads = link.inv.apply(mount_id, seq, delta)
        for key, gen in files:
            self._work.put(("drop", (key, gen)))
        for item in offloads:
            self._work.put(("offload", item))
        return answer

    def debug_stall_inventory(self, seconds: float) -> None:
        """Fault injection: hold inventory messages for ``seconds`` before applying them."""
        self._stall_until = time.monotonic() + seconds

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
        }

    # ---------------------------------------------------------------- liveness --
    def _master_handle(self, link: _ShardLink):
        if link.handle is None:
            link.handle = ray.get_actor(master_name(link.shard), namespace=self.cfg.namespace)
        return link.handle

    def _mount(self, link: _ShardLink) -> None:
        link.mounted.clear()
        master = self._master_handle(link)
        link.node_key = ray.get(master.node_key.remote(), timeout=60)
        with self._lock:  # from here on, messages of earlier mounts are refused
            mount_id, entries = link.inv.begin_mount()
        ray.get(master.mount.remote(self.info(link.shard), entries, mount_id), timeout=60)
        link.mounted.set()

    def _heartbeat_loop(self, link: _ShardLink) -> None:
        period = self.cfg.master.heartbeat_interval_s
        beats = 0
        while not self._stop.is_set():
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
            self._stop.wait(period)

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
        out = {"node_id": self.node_id, "capacity": self.arena.length, **counts}
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

    def shutdown(self) -> None:
        self._stop.set()
