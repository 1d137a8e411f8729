"""Direct prefill -> decode handoff for the vLLM connector: the decode engine reads the
prefill engine's KV blocks from its registered memory over the transport (one-sided reads;
over tcp the owner pushes them), instead of reading the copies the prefill saved to the
store.

Ray Serve LLM (and vLLM's own P/D proxies) run the prefill request to completion before
the decode request exists, so the decode engine's blocks are not allocated while the
prefill runs: the handoff is a pull. The prefill engine keeps the request's blocks after
it finishes (``delay_free``) and names them in the response's ``kv_transfer_params``; the
decode engine reads them and marks the request done; the prefill engine then frees them.
If anything fails (the prefill engine is gone, a read times out), the decode engine loads
the same blocks from the store, where the prefill saved them before answering.

Rendezvous goes through the store itself, so no side channel is needed:
- ``mcr-direct/peer/<engine id>/<tp rank>``: the prefill worker's transport address, the
  packed remote keys of its registered KV memory and each layer's (base, block bytes);
- ``mcr-direct/done/<request id>``: written by the decode worker after its read; the prefill
  worker polls for these (batched, throttled) and frees the blocks, or frees them anyway
  after ``direct_hold_s``.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Sequence

import numpy as np

log = logging.getLogger(__name__)

PEER_PREFIX = "mcr-direct/peer/"
DONE_PREFIX = "mcr-direct/done/"


def peer_key(engine_id: str, tp_rank: int) -> str:
    return f"{PEER_PREFIX}{engine_id}/{tp_rank}"


def publish(client, engine_id: str, tp_rank: int, regions, layers) -> bool:
    """Make this worker's KV memory readable by decode engines (``regions``: registered
    Regions; ``layers``: LayerBlocks in layer order). Returns False, publishing nothing,
    when the memory is not registered with the transport (staged device memory): decode
    engines then load these blocks from the store."""
    if any(getattr(r, "rkey", None) is None for r in regions):
        return False
    desc = {"address": client.engine.address.hex(),
            "regions": [[r.rkey.hex(), r.addr, r.length] for r in regions],
            "layers": [layer.describe() for layer in layers]}
    client.upsert(peer_key(engine_id, tp_rank), json.dumps(desc).encode())
    return True


class DirectReader:
    """Decode side: reads blocks out of a prefill worker's memory into ours."""

    def __init__(self, client, layers, timeout_s: float):
        self.client, self.layers, self.timeout_s = client, list(layers), timeout_s
        self.enabled = True  # False: this worker's memory cannot be read into (staged)
        self._peers: dict[str, tuple] = {}  # peer key -> (peer, [(RemoteRegion, base, end)], layers)

    def _peer(self, key: str):
        got = self._peers.get(key)
        if got is None:
            desc = json.loads(self.client.get(key))
            engine = self.client.engine
            peer = engine.connect(bytes.fromhex(desc["address"]), self.timeout_s)
            regions = [(engine.import_remote(peer, bytes.fromhex(rk), base, n), base, base + n)
                       for rk, base, n in desc["regions"]]
            got = self._peers[key] = (peer, regions, desc["layers"])
        return got

    def read(self, engine_id: str, tp_rank: int, remote_blocks: Sequence[int], local_blocks: Sequence[int]) -> None:
        """Read every layer of ``remote_blocks`` into ``local_blocks``: one transfer whose ops
        are arrays, one op per (layer, part, prefill region) holding every block's range.

        Raises:
            MooncakeRayError, ValueError, KeyError, IndexError: the caller falls back to the
                store.
        """
        key = peer_key(engine_id, tp_rank)
        try:
            _, regions, rlayers = self._peer(key)
            if len(rlayers) != len(self.layers):
                raise ValueError(f"prefill engine {engine_id} has {len(rlayers)} layers, this one {len(self.layers)}")
            rb = np.asarray(remote_blocks, dtype=np.int64).reshape(-1)
            lb = np.asarray(local_blocks, dtype=np.int64).reshape(-1)
            if rb.size != lb.size:
                raise ValueError(f"{rb.size} remote blocks for {lb.size} local ones")
            order = sorted(range(len(regions)), key=lambda k: regions[k][1])
            bases = np.array([regions[k][1] for k in order], dtype=np.int64)
            ends = np.array([regions[k][2] for k in order], dtype=np.int64)
            ops = []
            for li, layer in enumerate(self.layers):
                rparts, rbytes, rstride, rblocks = rlayers[li]
                if rbytes != layer.part_bytes or len(rparts) != layer.num_parts:
                    raise ValueError(f"layer {li}: {len(rparts)} parts of {rbytes} bytes per block there, "
                                     f"{layer.num_parts} of {layer.part_bytes} here")
                if rb.size and not (0 <= rb.min() and rb.max() < rblocks):
                    bad = int(rb[(rb < 0) | (rb >= rblocks)][0])
                    raise ValueError(f"remote block {bad} outside {rblocks} blocks")
                if lb.size and not (0 <= lb.min() and lb.max() < layer.num_blocks):
                    bad = int(lb[(lb < 0) | (lb >= layer.num_blocks)][0])
                    raise IndexError(f"block {bad} outside layer {layer.name!r} of {layer.num_blocks} blocks")
                n = layer.part_bytes
                for rpart, lpart in zip(rparts, layer.parts):
                    raddr = rpart + rb * rstride
                    laddr = lpart + lb * layer.block_stride
                    at = np.searchsorted(bases, raddr, side="right") - 1  # the region each range starts in
                    inside = (at >= 0) & (raddr + n <= ends[np.maximum(at, 0)])
                    if not inside.all():
                        bad = int(raddr[~inside][0])
                        raise ValueError(f"layer {li}: remote range [{bad}, +{n}) lies outside the prefill "
                                         f"engine's registered memory")
                    for k in np.unique(at):
                        rr, base, _ = regions[order[k]]
                        sel = at == k
                        ops.append((rr, raddr[sel] - base, laddr[sel], n))
            self.client.engine.read(ops, self.timeout_s)
        except BaseException:
            self._peers.pop(key, None)  # reconnect next time (the prefill engine may have restarted)
            raise

    def done(self, req_id: str) -> None:
        try:
            self.client.upsert(DONE_PREFIX + req_id, b"1")
        except Exception as e:  # noqa: BLE001 - the prefill frees the blocks at its deadline
            log.warning("could not mark direct handoff %s done (%s)", req_id, e)


class Holds:
    """Prefill side: requests whose blocks stay allocated until a decode engine read them."""

    POLL_S = 0.005

    def __init__(self, client, hold_s: float):
        self.client, self.hold_s = client, hold_s
        self._until: dict[str, float] = {}
        self._next_poll = 0.0

    def hold(self, req_ids: Sequence[str]) -> None:
        until = time.monotonic() + self.hold_s
        for r in req_ids:
            self._until[r] = until

    def held(self, req_id: str) -> bool:
        return req_id in self._until

    def poll(self) -> set[str]:
        """Requests released now: read by their decode engine, or past their deadline."""
        now = time.monotonic()
        if not self._until or now < self._next_poll:
            return set()
        self._next_poll = now + self.POLL_S
        reqs = list(self._until)
        try:
            done = self.client.batch_exists([DONE_PREFIX + r for r in reqs])
        except Exception:  # noqa: BLE001 - the deadline still frees them
            done = [False] * len(reqs)
        released = {r for r, d in zip(reqs, done) if d}
        expired = {r for r in reqs if r not in released and self._until[r] <= now}
        if expired:
            log.warning("%d direct handoffs were not read within %.0fs: blocks freed", len(expired), self.hold_s)
        for r in released | expired:
            del self._until[r]
        for r in released:
            try:
                self.client.remove(DONE_PREFIX + r, force=True)
            except Exception:  # noqa: BLE001 - a leftover marker is a few bytes
                pass
        return released | expired
