"""The vLLM connector's worker side: blocks move between vLLM's registered KV tensors and
the store, zero-copy, on two background threads (one loads, one saves), so a load is never
queued behind a save.

Threads and ordering:
- A block is one stored value holding every layer (``_keys``): one key, one lookup and one
  lease per block whatever the model's depth, its bytes moved straight between the value
  and each layer's memory (a list of ranges, ``Client.batch_get_into``).
- ``start_loads`` hands a step's loads to the load thread: per request (``async`` mode: vLLM
  schedules the request once ``finished`` reports it), or all of the step's requests in one
  read, layer by layer (``layerwise`` mode: one lookup, then layer 0 of every block, layer
  1, ...; ``wait_layer`` blocks the forward only until that layer has landed).
- ``save`` hands a step's saves to the save thread; with ``sync`` it waits for them (a
  prefill producer's KV must be in the store before its response leaves). The forward
  thread only queues the job (``save_handoff_s``); the save thread's CPU time is counted
  (``save_cpu_s``, ``load_cpu_s`` for the load thread).
- A request whose saves are in flight when it finishes keeps its blocks: the scheduler side
  returned ``delay_free`` for it, and ``finished`` reports it only after its last save.
- Before vLLM reuses a preempted request's blocks, ``drain_saves`` waits for every save.

KV caches on a GPU: each layer's memory is registered with the client, which moves it on
the direct path (UCX registers the device memory) or the staged one (a pinned host buffer,
copies on a CUDA stream of the client's). A save reads blocks the step's kernels wrote: the
forward thread marks the engine's current stream when it hands the save over (a CUDA event,
no wait), and the save thread's copies (or UCX's reads) start after that mark. A load is
reported done only once its bytes are in the blocks.

Never raises into the engine: a failed load becomes a set of invalid block ids (vLLM
recomputes them), a failed save a later miss.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

from mooncake_ray._private.client.staged import device_marker
from mooncake_ray.errors import MooncakeRayError, ObjectExistsError, ObjectNotFoundError
from mooncake_ray.integrations._vllm_direct import DirectReader, Holds
from mooncake_ray.integrations._vllm_layout import LayerBlocks
from mooncake_ray.integrations._vllm_plan import BlockRun
from mooncake_ray.kv import ConversationPins

log = logging.getLogger(__name__)


class KVTransfer:
    def __init__(self, client, prefix: str, layers: Sequence[LayerBlocks], *, layerwise: bool, metrics=None,
                 tp_rank: int = 0, direct_timeout_s: float = 5.0, hold_s: float = 30.0, kinds=None):
        self.client, self.prefix, self.layers, self.layerwise = client, prefix, list(layers), layerwise
        # A hybrid model (_vllm_groups): per kind tag, its layers with the position of their
        # group in a block's id tuple. Its loads succeed or fail per request.
        by_name = {layer.name: layer for layer in self.layers}
        self.kinds = {k.tag: [(p, by_name[n]) for p, names in enumerate(k.layers) for n in names]
                      for k in kinds or ()}
        self.kind_bytes = {tag: sum(layer.nbytes for _, layer in ls) for tag, ls in self.kinds.items()}
        # A block's ranges from one table, (part address, block stride, part bytes) per part
        # of every layer: 18,432 ranges of 256 blocks took 12 ms through LayerBlocks.block.
        self._ranges = [(a, layer.block_stride, layer.part_bytes) for layer in self.layers for a in layer.parts]
        self._blocks = min((layer.num_blocks for layer in self.layers), default=0)
        self._kind_ranges = {tag: [(p, a, layer.block_stride, layer.part_bytes, layer.num_blocks)
                                   for p, layer in ls for a in layer.parts] for tag, ls in self.kinds.items()}
        self._failed: set[str] = set()  # hybrid requests whose load failed, to report
        self._failed_out: set[str] = set()
        self.metrics, self.tp_rank = metrics, tp_rank
        self.direct = DirectReader(client, self.layers, direct_timeout_s)
        self.holds = Holds(client, hold_s)
        self._pins = ConversationPins(client)
        self._index = {layer.name: i for i, layer in enumerate(self.layers)}
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="mooncake-vllm-load")
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="mooncake-vllm-save")
        self._lock = threading.Lock()
        self._recved: set[str] = set()  # async loads finished, to report
        self._bad_blocks: set[int] = set()  # blocks that failed to load, to report
        self._layer_futs: dict[int, Future] = {}  # layerwise loads of the current step
        self._save_futs: dict[str, list[Future]] = {}  # req -> saves not yet known finished
        self._finishing: set[str] = set()  # finished requests waiting for their saves
        self.stats = {"loaded_blocks": 0, "loaded_bytes": 0, "load_failures": 0, "saved_blocks": 0,
                      "saved_bytes": 0, "skipped_blocks": 0, "save_failures": 0, "load_s": 0.0, "save_s": 0.0,
                      "direct_blocks": 0, "direct_fallbacks": 0, "save_handoff_s": 0.0,
                      "load_cpu_s": 0.0, "save_cpu_s": 0.0}
        self._reported: dict = {}  # stats as of the last take_interval
        import torch

        self.regions = []  # this worker's registered KV memory
        seen = set()
        for layer in self.layers:  # layers may share one allocation: register each once
            st = layer.tensor.untyped_storage()
            if st.data_ptr() in seen:
                continue
            seen.add(st.data_ptr())
            flat = torch.empty(0, dtype=torch.uint8, device=layer.tensor.device).set_(st)
            self.regions.append(client.register_buffer(flat))
        self.parts = self.layers[0].num_parts if self.layers else 1
        self.block_bytes = sum(layer.nbytes for layer in self.layers)  # one stored value
        dev = self.layers[0].tensor.device if self.layers else None
        self.cuda_device = (dev.index or 0) if dev is not None and dev.type == "cuda" else None
        # How the KV memory moves: "host", "direct" (UCX registered it) or "staged".
        self.path = getattr(self.regions[0], "path", "host") if self.regions else "host"
        if self.path == "staged":
            self.direct.enabled = False  # staged memory is not registered with UCX: no peer reads into it

    # ----------------------------------------------------------------- keys ----
    def _block(self, b, kind: str = "") -> list[tuple[int, int]]:
        """vLLM block ``b`` as one value: every layer's parts, layer by layer. For a hybrid
        model's kind, ``b`` holds one block id per group of the kind."""
        if kind:
            tab = self._kind_ranges[kind]
            if not all(0 <= b[p] < n for p, _, _, _, n in tab):
                return [r for p, layer in self.kinds[kind] for r in layer.block(b[p])]  # raises, naming it
            return [(a + b[p] * s, m) for p, a, s, m, _ in tab]
        if not 0 <= b < self._blocks:
            return [r for layer in self.layers for r in layer.block(b)]  # raises, naming the layer
        return [(a + b * s, m) for a, s, m in self._ranges]

    def _key(self, run: BlockRun, h: str) -> str:
        return f"{self.prefix}{run.kind}/{h}" if run.kind else f"{self.prefix}{h}"

    def _keys(self, runs: Sequence[BlockRun]) -> tuple[list[str], list[list], list, list[int]]:
        """One key, one list of memory ranges, one vLLM block id (a tuple for a hybrid
        kind) and one value size per block of ``runs``."""
        keys, bufs, owners, sizes = [], [], [], []
        for run in runs:
            keys += [self._key(run, h) for h in run.hashes]
            bufs += [self._block(b, run.kind) for b in run.block_ids]
            owners += run.block_ids
            sizes += [self.kind_bytes[run.kind] if run.kind else self.block_bytes] * len(run.hashes)
        return keys, bufs, owners, sizes

    def _count(self, name: str, n) -> None:
        self.stats[name] += n
        if self.metrics is not None and name in self.metrics.NAMES:
            self.metrics.add(name, n)

    # ---------------------------------------------------------------- loads ----
    def _load(self, runs: Sequence[BlockRun], layer_futs: Sequence[Future] | None = None) -> set[int]:
        """Load ``runs`` in one batched call; returns the vLLM blocks that did not load
        whole. With ``layer_futs`` (layerwise), layer ``i`` of every block is read before
        layer ``i + 1`` and ``layer_futs[i]`` is given the blocks whose layer ``i`` failed
        as soon as it has landed."""
        keys, bufs, owners, sizes = self._keys(runs)
        if not keys:
            for f in layer_futs or ():
                f.set_result(set())
            return set()
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            if layer_futs is None:
                results = self.client.batch_get_into(keys, bufs)
            else:
                def landed(g: int, failed: set[int]) -> None:
                    layer_futs[g].set_result({owners[i] for i in failed})

                results = self.client.batch_get_into(keys, bufs, groups=len(self.layers), on_group=landed)
        except Exception as e:  # noqa: BLE001 - the engine recomputes; never fail its step
            log.warning("KV load of %d blocks failed (%s): the engine recomputes them", len(keys), e)
            results = [e] * len(keys)
        finally:
            for f in layer_futs or ():
                if not f.done():
                    f.set_result(set(owners))
        dt, cpu = time.perf_counter() - t0, time.thread_time() - c0
        ok = [r == n for r, n in zip(results, sizes)]
        bad = {blk for blk, good in zip(owners, ok) if not good}
        with self._lock:
            self.stats["load_s"] += dt
            self.stats["load_cpu_s"] += cpu
            self._count("loaded_bytes", sum(n for n, good in zip(sizes, ok) if good))
            self._count("load_failures", ok.count(False))
            self.stats["loaded_blocks"] += ok.count(True)
        if self.metrics is not None:
            self.metrics.observe("load", dt)
        self._release(runs)
        return bad

    def _load_direct(self, run: BlockRun) -> bool:
        """Read the run from the prefill engine that holds it; False if that failed (or
        this worker's KV memory is staged, which peers cannot write into)."""
        if not self.direct.enabled:
            self.direct.done(run.direct["req"])  # the producer may free the blocks now
            return False
        t0 = time.perf_counter()
        try:
            self.direct.read(run.direct["engine"], self.tp_rank, run.direct["blocks"], run.block_ids)
        except Exception as e:  # noqa: BLE001 - the same blocks are in the store
            log.warning("direct read of %d blocks from engine %s failed (%s): loading them from the store",
                        len(run.block_ids), run.direct["engine"], e)
            with self._lock:
                self.stats["direct_fallbacks"] += 1
            self.direct.done(run.direct["req"])  # not needed any more: the producer may free them
            return False
        dt = time.perf_counter() - t0
        self.direct.done(run.direct["req"])
        self._release([run])  # the store's copy was not needed
        with self._lock:
            self.stats["load_s"] += dt
            self.stats["direct_blocks"] += len(run.block_ids)
            self.stats["loaded_blocks"] += len(run.block_ids)
            self._count("loaded_bytes", len(run.block_ids) * self.block_bytes)
        if self.metrics is not None:
            self.metrics.observe("load", dt)
        return True

    def _load_request(self, run: BlockRun) -> None:
        bad = set() if run.direct and self._load_direct(run) else self._load([run])
        with self._lock:  # errors first: vLLM reads both in the same step
            self._bad_blocks |= bad
            self._recved.add(run.req_id)

    def _load_whole(self, req_id: str, runs: Sequence[BlockRun]) -> None:
        """A hybrid request's runs (one per kind) in one batched call: the request loads
        whole or is reported failed (vLLM then recomputes all of it)."""
        bad = self._load(runs)
        with self._lock:
            if bad:
                self._failed.add(req_id)
            self._recved.add(req_id)

    def start_loads(self, runs: Sequence[BlockRun]) -> None:
        if not runs:
            return
        if self.kinds:
            by_req: dict[str, list[BlockRun]] = {}
            for run in runs:
                by_req.setdefault(run.req_id, []).append(run)
            for req_id, rs in by_req.items():
                self._loader.submit(self._load_whole, req_id, rs)
            return
        whole = [r for r in runs if r.direct or not self.layerwise]  # asynchronous to vLLM: one job each
        for run in whole:
            self._loader.submit(self._load_request, run)
        runs = [r for r in runs if not (r.direct or not self.layerwise)]
        if runs:
            futs = [Future() for _ in self.layers]
            self._layer_futs = dict(enumerate(futs))
            self._loader.submit(self._load, runs, futs)

    def wait_layer(self, layer_name: str) -> None:
        fut = self._layer_futs.pop(self._index.get(layer_name, -1), None)
        if fut is None:
            return
        bad = fut.result()
        if bad:
            with self._lock:
                self._bad_blocks |= bad

    def wait_all_layers(self) -> None:
        for name in [self.layers[li].name for li in list(self._layer_futs)]:
            self.wait_layer(name)

    # ---------------------------------------------------------------- saves ----
    def _save(self, runs: Sequence[BlockRun], marker=None) -> None:
        """Store the runs' blocks that the store does not hold (one value per block, every
        layer in it), counted in vLLM blocks like loads: saved, skipped (there already)
        or failed."""
        keys, bufs, owners, sizes = self._keys(runs)
        # each block names the one before it (chain-aware eviction holds a prefix while
        # its suffix is stored); a hybrid kind's blocks do not form such chains
        parents = [self._key(run, h) if h and not run.kind else None
                   for run in runs for h in [run.parent, *run.hashes[:-1]]]
        holds = [run.hold_s for run in runs for _ in run.hashes]  # a prefill's blocks for its decode
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            present = self.client.batch_exists(keys)
            self._hold_present(keys, present, holds)
            todo = [i for i, p in enumerate(present) if not p]
            res: list = [None] * len(todo)
            for hold in dict.fromkeys(holds[i] for i in todo):  # one call per hold: the step's runs share one
                part = [j for j, i in enumerate(todo) if holds[i] == hold]
                got = self.client.batch_put_from([keys[todo[j]] for j in part], [bufs[todo[j]] for j in part],
                                                 after=marker, parents=[parents[todo[j]] for j in part],
                                                 **({} if hold is None else {"hold_s": hold}))
                for j, r in zip(part, got):
                    res[j] = r
        except Exception as e:  # noqa: BLE001 - a failed save is a later miss, nothing more
            log.warning("KV save of %d blocks failed (%s)", len(keys), e)
            with self._lock:
                self._count("save_failures", len(keys))
            return
        dt, cpu = time.perf_counter() - t0, time.thread_time() - c0
        failed = [owners[i] for i, r in zip(todo, res) if r is not None and not isinstance(r, ObjectExistsError)]
        if failed:
            log.warning("KV save: %d of %d blocks not stored", len(failed), len(keys))
        for run in runs:
            if run.keep is not None and run.hashes:
                self._keep(run)
        with self._lock:
            self.stats["save_s"] += dt
            self.stats["save_cpu_s"] += cpu
            self.stats["skipped_blocks"] += len(keys) - len(todo)
            self._count("saved_bytes", sum(n for n, r in zip([sizes[i] for i in todo], res) if r is None))
            self._count("save_failures", len(failed))
            self.stats["saved_blocks"] += len(todo) - len(failed)
        if self.metrics is not None:
            self.metrics.observe("save", dt)

    def _hold_present(self, keys: list[str], present: list[bool], holds: list) -> None:
        """Held runs' blocks the store has already (a prefill's prefix, loaded from the
        store or found in the engine's cache): held from now, as the put holds the rest;
        a block evicted since the check is marked absent, to be stored (and held) again."""
        for hold in dict.fromkeys(h for h, p in zip(holds, present) if p and h is not None):
            idx = [i for i, (h, p) in enumerate(zip(holds, present)) if p and h == hold]
            for i, r in zip(idx, self.client.batch_pin([keys[i] for i in idx], ttl_s=hold)):
                if isinstance(r, ObjectNotFoundError):
                    present[i] = False

    def _keep(self, run: BlockRun) -> None:
        """A conversation hint: soft-pin the run's last block (kv.ConversationPins)."""
        conversation_id, keep_s = run.keep
        try:
            self._pins.keep(conversation_id, self._key(run, run.hashes[-1]), keep_s)
        except Exception as e:  # noqa: BLE001 - a pin is a hint: the save stands without it
            log.warning("KV save: pinning the conversation %s failed (%s)", conversation_id, e)

    def _release(self, runs: Sequence[BlockRun]) -> None:
        """A decode read what a prefill held for it (``BlockRun.hold_s``): the blocks are
        evicted like any other now. One call; a block not stored answers ObjectNotFoundError."""
        keys = [self._key(run, h) for run in runs for h in run.release]
        if not keys:
            return
        try:
            self.client.batch_unpin(keys)
        except Exception as e:  # noqa: BLE001 - the holds lapse at their TTL
            log.warning("KV load: releasing %d blocks a prefill held failed (%s)", len(keys), e)

    def save(self, runs: Sequence[BlockRun], sync: bool) -> None:
        """Hand the step's saves to the save thread; with ``sync``, wait for them."""
        if not runs:
            return
        t0 = time.perf_counter()
        # The step's kernels wrote these blocks on the engine's current stream: mark it here,
        # in the forward thread (no wait), and let the save start after the mark.
        marker = device_marker(None, self.cuda_device) if self.cuda_device is not None else None
        self.stats["save_handoff_s"] += time.perf_counter() - t0
        fut = self._saver.submit(self._save, list(runs), marker)
        if sync:
            fut.result()
            return
        with self._lock:
            for req_id in {r.req_id for r in runs}:
                self._save_futs.setdefault(req_id, []).append(fut)

    def drain_saves(self) -> None:
        self._saver.submit(lambda: None).result()

    # ----------------------------------------------------------- completion ----
    def finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(saves done, loads done)`` request ids, each reported once."""
        released = self.holds.poll()
        with self._lock:
            self._finishing |= {r for r in finished_req_ids if r in self._save_futs or self.holds.held(r)}
            self._finishing |= released
            sent = {r for r in self._finishing
                    if all(f.done() for f in self._save_futs.get(r, ())) and not self.holds.held(r)}
            for r in sent:
                self._finishing.discard(r)
                self._save_futs.pop(r, None)
            for r, futs in self._save_futs.items():  # drop finished futures of live requests
                if r not in self._finishing:
                    futs[:] = [f for f in futs if not f.done()]
            recved, self._recved = self._recved, set()
            # taken with the same lock: a failed request is never reported received alone
            self._failed_out, self._failed = self._failed, set()
        return (sent or None), (recved or None)

    def failed_loads(self) -> set[str]:
        """The hybrid requests whose load failed among those the last :meth:`finished`
        reported received."""
        failed, self._failed_out = self._failed_out, set()
        return failed

    def load_errors(self) -> set[int]:
        with self._lock:
            bad, self._bad_blocks = self._bad_blocks, set()
        return bad

    def take_interval(self) -> dict:
        """What changed in ``stats`` (cumulative) since the last call."""
        with self._lock:
            last = self._reported
            delta = {k: v - last.get(k, 0) for k, v in self.stats.items() if v != last.get(k, 0)}
            self._reported = dict(self.stats)
        return delta

    def close(self) -> None:
        self._loader.shutdown(wait=True)
        self._saver.shutdown(wait=True)
        for region in self.regions:
            try:
                region.close()
            except MooncakeRayError:
                pass
