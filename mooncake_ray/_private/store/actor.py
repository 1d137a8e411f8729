"""A store node: the DRAM arena (and spill directory) of one Ray node.

It is not on the data path of a DRAM hit: clients read and write the arena directly
through the transport (a memcpy through shared memory on the same host, UCX put/get or a
push from this node's engine across hosts, served in C++ without waking Python). What
runs here in Python is bookkeeping:

- the inventory (what this node holds and where), written only by the master's
  deltas and handed back on every (re)mount, so a restarted master loses nothing;
- mount and heartbeat (Ray actor calls to the master); a heartbeat answered "unknown"
  means the master restarted or unmounted us, and we remount with the inventory.

Lock order: ``_lock`` guards the inventory; it is never held across a call out.
"""

from __future__ import annotations

import logging
import threading
import uuid

import ray

from mooncake_ray.config import StoreConfig
from mooncake_ray._private import rpc
from mooncake_ray._private.master.types import InventoryEntry
from mooncake_ray._private.naming import MASTER_NAME

log = logging.getLogger(__name__)


class StoreNodeActor:
    def __init__(self, config: dict, node_id: str):
        self.cfg = StoreConfig.model_validate(config)
        self.node_id = node_id
        self.incarnation = uuid.uuid4().hex[:16]
        t = self.cfg.transport
        from mooncake_ray._private.transport import Engine  # the native module: load on use

        self.engine = Engine(protocol=t.protocol, devices=t.devices, num_lanes=t.num_lanes,
                             ucx_options=t.ucx_options, read_mode=t.read_mode, name=f"store-{node_id[:8]}")
        self.arena = self.engine.alloc_arena(self.cfg.segment_size_bytes)
        self._lock = threading.Lock()
        self.inventory: dict[str, InventoryEntry] = {}
        self.engine.serve(rpc.NODE_INVENTORY_RPC, self._on_inventory)
        self._master = None
        self._mounted = threading.Event()
        self._stop = threading.Event()
        self._hb = threading.Thread(target=self._heartbeat_loop, name="store-heartbeat", daemon=True)
        self._hb.start()

    # ---------------------------------------------------------------- inventory --
    def _on_inventory(self, data: bytes) -> bytes:
        adds, drops = rpc.unpack(data)
        with self._lock:
            for key, gen in drops:
                e = self.inventory.get(key)
                if e is not None and e.gen == gen:
                    del self.inventory[key]
            for e in adds:
                self.inventory[e[0]] = InventoryEntry(*e)
        return b""

    def info(self) -> dict:
        return {
            "node_id": self.node_id,
            "incarnation": self.incarnation,
            "address": self.engine.address,
            "rkey": self.arena.rkey,
            "base": self.arena.addr,
            "capacity": self.arena.length,
            "ray_node_id": self.node_id,
        }

    # ---------------------------------------------------------------- liveness --
    def _master_handle(self):
        if self._master is None:
            self._master = ray.get_actor(MASTER_NAME, namespace=self.cfg.namespace)
        return self._master

    def _mount(self) -> None:
        with self._lock:
            entries = [list(e) for e in self.inventory.values()]
        ray.get(self._master_handle().mount.remote(self.info(), entries), timeout=30)
        self._mounted.set()

    def _heartbeat_loop(self) -> None:
        period = self.cfg.master.heartbeat_interval_s
        while not self._stop.is_set():
            try:
                if not self._mounted.is_set():
                    self._mount()
                else:
                    ok = ray.get(self._master_handle().heartbeat.remote(
                        self.node_id, self.incarnation), timeout=max(2.0, period * 3))
                    if not ok:
                        log.warning("master does not know this store node: remounting")
                        self._mount()
            except Exception as e:  # master restarting or unreachable: keep trying
                log.info("heartbeat/mount failed (%s); retrying", e)
                self._master = None if isinstance(e, ValueError) else self._master
            self._stop.wait(period)

    def wait_mounted(self, timeout_s: float = 60.0) -> bool:
        return self._mounted.wait(timeout_s)

    def inventory_snapshot(self) -> list:
        with self._lock:
            return [list(e) for e in self.inventory.values()]

    def stats(self) -> dict:
        with self._lock:
            used = sum(e.length for e in self.inventory.values() if e.tier == "dram")
            return {"node_id": self.node_id, "capacity": self.arena.length, "used": used,
                    "keys": len(self.inventory)}

    def ping(self) -> str:
        return self.incarnation

    def shutdown(self) -> None:
        self._stop.set()
