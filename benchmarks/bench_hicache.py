"""SGLang HiCache L3 pages through SGLang's own storage interface: the mooncake-ray backend
against SGLang's Mooncake backend, on the same host pool and the same page keys, in one run.

What is measured. Each backend is built by SGLang's loader,
``StorageBackendFactory.create_backend`` (``"mooncake"`` for SGLang's ``MooncakeStore``,
``"dynamic"`` naming ``mooncake_ray.integrations.sglang.MooncakeRayHiCacheStorage`` for
ours), then given the host pool with ``register_mem_pool_host``, as SGLang's cache
controller does. The benchmark then drives the three calls the controller makes on the L3
path, in batches of ``--batch-pages`` pages (SGLang's ``STORAGE_BATCH_SIZE`` is 128):

- ``batch_set_v1(keys, host_indices)``: write-back of host pages (SGLang's Mooncake backend
  first asks which keys exist and writes only the others, as it does in SGLang);
- ``batch_exists(keys)``: the prefix query of a prefetch (all keys present);
- ``batch_get_v1(keys, host_indices)``: the prefetch, zero-copy into the host pool.

Each round writes ``--pages`` fresh pages (keys: SGLang's chained page hashes of random
tokens), queries them, reads them back, checks every byte read, then empties the store (not
timed). A repeat is ``--rounds`` rounds per backend; backends take turns within a repeat
(the order rotates). Per repeat: pages/s and GB/s per operation (pages over the summed time
of the calls); over repeats: median and min-max, and the ratio ours/Mooncake per repeat.

Shapes. One page is 64 tokens of Qwen3-8B (36 layers, 8 KV heads, head_dim 128, bf16, K and
V) in SGLang's ``page_first`` host layout: K and V are two contiguous 4.5 MiB runs, 9 MiB a
page. SGLang's Mooncake backend stores them as two objects (``{key}_0_k``, ``{key}_0_v``);
ours too (``.../{key}/k``, ``.../{key}/v``; the JSON records the keys of a page and the bytes
our transport wrote per byte stored). The host pool is SGLang's own
``MHATokenToKVPoolHost`` on CPU (its device side: one page of CPU tensors that storage I/O
never reads).

Fairness. SGLang's default Mooncake set-up has the engine process hold a global segment
(``mooncake-local``): with a single segment, every put and get is a memcpy inside the
benchmark process, with no process boundary, which ours always crosses (client in this
process, store node in a Ray actor process). So Mooncake is also measured in the two shapes
where, as for ours, the memory is held by another process on the same host:

- ``mooncake-remote``: a ``mooncake_client`` process holds the segment and the SGLang backend
  is client-only (``global_segment_size`` 0), data over Mooncake's TCP transport on loopback
  (of the transports of the PyPI wheel ``mooncake-transfer-engine-non-cuda``, the one usable
  here);
- ``mooncake-shm``: SGLang's ``standalone_storage`` mode, the backend a Mooncake "dummy
  client" whose host pool (allocated by Mooncake, same geometry and bytes) is shared memory
  mapped by the ``mooncake_client`` process, which copies between it and its segment. SGLang
  registers the K and V halves of the pool separately, which that client refuses for MHA
  pools in these versions, so the pool is registered whole (recorded in the JSON).

Ours uses the transport ``--protocol`` selects; with ``auto`` on one host the store node's
arena is mapped into the client process and pages move with one memcpy (the JSON records
the bytes per path). Every store gets the same DRAM
capacity (``--segment``). Each Mooncake shape has its own ``mooncake_master`` on 127.0.0.1
(metadata by P2P handshake, no HTTP metadata server). Every store's read lease is shortened
to ``--lease-ms`` so that it can be emptied between rounds: Mooncake does not remove objects
under a read lease; ours removes them by force and frees their memory once their readers
have released it; the harness waits until every store is empty (untimed) before the next
round. Nothing timed depends
on the lease.

    make bench B=benchmarks/bench_hicache.py ARGS="--quick"     # smoke run, about a minute
    make bench B=benchmarks/bench_hicache.py                    # the published run

Run it inside a private network namespace (``make bench`` does): it starts Ray and
``mooncake_master``, which listen on every interface. Writes
benchmarks/results/bench_hicache.json and bench_hicache.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from _common import ROOT, RESULTS, Processes, free_port, host_info, host_label, spread, versions, wait_port

MODEL = "Qwen/Qwen3-8B"
LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES, PAGE_TOKENS = 36, 8, 128, 2, 64
K_BYTES = PAGE_TOKENS * LAYERS * KV_HEADS * HEAD_DIM * DTYPE_BYTES   # one page of K (or V)
PAGE_BYTES = 2 * K_BYTES                                             # K and V
OPS = ("set", "exists", "get")
OURS = "mooncake-ray"
SHAPES = (OURS, "mooncake-local", "mooncake-remote", "mooncake-shm")
SGLANG_BATCH = 128  # SGLang's STORAGE_BATCH_SIZE

_tv_lib = None  # keeps the torchvision operator library below alive


def import_sglang():
    """Import the SGLang pieces the benchmark uses. SGLang imports torchvision; its PyPI
    wheel cannot load its C operators against the CPU build of torch, so it is installed
    aside (``.venv/sglang-extra``) and the two operators its Python code registers fake
    kernels for are declared here first, which is all an import needs."""
    global _tv_lib
    sys.path.insert(0, str(ROOT / ".venv" / "sglang-extra"))
    import torch

    if _tv_lib is None:
        _tv_lib = torch.library.Library("torchvision", "DEF")
        _tv_lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _tv_lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_hash_str

    return dict(KVBufferLayout=KVBufferLayout, KVBuffers=KVBuffers, MHABufferInfo=MHABufferInfo,
                HiCacheStorageConfig=HiCacheStorageConfig, host_memory_budget_scope=host_memory_budget_scope,
                MHATokenToKVPoolHost=MHATokenToKVPoolHost, StorageBackendFactory=StorageBackendFactory,
                get_hash_str=get_hash_str)


# ======================================================================= host pool ==

class Pages:
    """SGLang's host pool for ``n`` pages plus a reference copy of its contents: random
    bytes, each K and V page stamped in its first 8 bytes with the id of the page key it
    is written under, so a read that lands in the wrong place or not at all is caught."""

    def __init__(self, sg, n: int, allocator_type: str = "default", ref=None):
        import torch

        self.n = n
        dt = torch.bfloat16
        # the device side: one page of CPU tensors (the host pool keeps pointers to them for
        # its GPU copy kernels; storage I/O reads only the host buffer)
        k = tuple(torch.zeros(PAGE_TOKENS, KV_HEADS, HEAD_DIM, dtype=dt) for _ in range(LAYERS))
        v = tuple(torch.zeros(PAGE_TOKENS, KV_HEADS, HEAD_DIM, dtype=dt) for _ in range(LAYERS))
        ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)  # noqa: E731
        info = sg["MHABufferInfo"](
            buffers=sg["KVBuffers"](k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                                    layout=sg["KVBufferLayout"].NHD),
            page_size=PAGE_TOKENS, head_num=KV_HEADS, head_dim=HEAD_DIM, v_head_dim=HEAD_DIM,
            dtype=dt, device=torch.device("cpu"))
        # SGLang sizes host pools against free memory minus a 10 GiB reserve; book this one
        # against what the machine has free instead
        with sg["host_memory_budget_scope"](_available_bytes()):
            self.pool = sg["MHATokenToKVPoolHost"](
                info, host_to_device_ratio=1.0, host_size=0, page_size=PAGE_TOKENS, layout="page_first",
                pin_memory=False, device="cpu", allocator_type=allocator_type,
                device_capacity_tokens=PAGE_TOKENS, start_layer=0, end_layer=LAYERS - 1,
                host_token_capacity=n * PAGE_TOKENS)
        assert self.pool.get_ksize_per_token() * PAGE_TOKENS == K_BYTES
        self.u8 = self.pool.kv_buffer.view(torch.uint8).view(2, n, K_BYTES)
        if ref is None:
            gen = torch.Generator().manual_seed(0)
            ref = torch.randint(0, 256, (2, n, K_BYTES), dtype=torch.uint8, generator=gen)
        self.ref = ref
        self._torch = torch

    def indices(self, n: int):
        """Host token indices of the first ``n`` pages (what SGLang passes per batch)."""
        return self._torch.arange(n * PAGE_TOKENS, dtype=self._torch.int64)

    def load(self, stamps: list[int]) -> None:
        """The pool's first pages hold the reference bytes, stamped with ``stamps``."""
        n = len(stamps)
        self.ref[:, :n, :8].view(self._torch.int64)[:, :, 0] = self._torch.tensor(stamps, dtype=self._torch.int64)
        self.u8[:, :n].copy_(self.ref[:, :n])

    def wipe(self, n: int) -> None:
        self.u8[:, :n].zero_()

    def check(self, stamps: list[int]) -> None:
        """Raises if the first pages differ from what ``load(stamps)`` wrote."""
        n = len(stamps)
        self.ref[:, :n, :8].view(self._torch.int64)[:, :, 0] = self._torch.tensor(stamps, dtype=self._torch.int64)
        words = lambda t: t.view(self._torch.int64)  # noqa: E731 - compares 7x faster than bytes
        if not self._torch.equal(words(self.u8[:, :n]), words(self.ref[:, :n])):
            bad = [i for i in range(n) if not self._torch.equal(words(self.u8[:, i]), words(self.ref[:, i]))]
            raise AssertionError(f"pages read back differ from those written: batch positions {bad[:8]}")


def _available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 1 << 40


def page_keys(sg, seed: int, n: int) -> list[str]:
    """``n`` chained page hashes of random tokens, as SGLang's controller computes them."""
    import random

    rnd = random.Random(seed)
    tokens = [rnd.randrange(150_000) for _ in range(n * PAGE_TOKENS)]
    return list(sg["get_hash_str"](tokens, None, page_size=PAGE_TOKENS))


def storage_config(sg, extra: dict):
    """What SGLang's controller builds for one TP rank of a dense model, page_first layout."""
    return sg["HiCacheStorageConfig"](
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name=MODEL, extra_config=extra)


def attach(sg, name: str, extra: dict, pages: Pages):
    """A backend made and attached the way SGLang's cache controller does it."""
    backend = sg["StorageBackendFactory"].create_backend(name, storage_config(sg, extra), pages.pool)
    backend.register_mem_pool_host(pages.pool)
    backend.on_host_pools_registered()
    return backend


# ========================================================================== shapes ==

class Shape:
    """One backend under test: its host pool, how it was set up, how to empty it."""

    def __init__(self, name: str, backend, pages: Pages, info: dict, clear, close=None):
        self.name, self.backend, self.pages, self.info = name, backend, pages, info
        self._clear, self._close = clear, close

    def clear(self) -> None:
        self._clear()

    def close(self) -> None:
        if self._close is not None:
            self._close()


def mooncake_master(procs: Processes, name: str, lease_ms: int) -> str:
    """A ``mooncake_master`` on 127.0.0.1; returns its RPC address."""
    exe = Path(sys.executable).parent / "mooncake_master"
    if not exe.exists():
        raise FileNotFoundError(f"{exe} (pip package mooncake-transfer-engine-non-cuda is not installed)")
    rpc = free_port()
    p, log = procs.start(name, [str(exe), f"-rpc_port={rpc}", "-rpc_address=127.0.0.1",
                                "-enable_http_metadata_server=false", f"-metrics_port={free_port()}",
                                f"-default_kv_lease_ttl={lease_ms}", "-logtostderr"])
    wait_port(rpc, proc=p, log=log)
    return f"127.0.0.1:{rpc}"


def mooncake_extra(master: str, segment: int) -> dict:
    """SGLang's ``MooncakeStoreConfig`` through ``extra_config``: loopback, TCP."""
    return {"master_server_address": master, "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
            "device_name": "", "global_segment_size": segment, "local_hostname": "127.0.0.1",
            "check_server": False}


def _mooncake_shape(name: str, backend, pages: Pages, info: dict, lease_ms: int) -> Shape:
    def clear():
        # Mooncake keeps objects read within the lease; wait it out, then remove everything
        time.sleep(lease_ms / 1000 + 0.2)
        backend.clear()

    def close():
        backend.store.close()  # before its master goes: a client without one waits to time out

    info.update(objects_per_page=2, object_bytes=K_BYTES)
    return Shape(name, backend, pages, info, clear, close)


def _mooncake_client(procs: Processes, master: str, segment: int) -> str:
    """A ``mooncake_client`` process holding a segment; returns its service address."""
    exe = Path(sys.executable).parent / "mooncake_client"
    port = free_port()
    p, log = procs.start("mooncake-client", [
        str(exe), "-host=127.0.0.1", f"-port={port}", f"-global_segment_size={segment}",
        f"-master_server_address={master}", "-metadata_server=P2PHANDSHAKE", "-protocol=tcp", "-logtostderr"])
    wait_port(port, proc=p, log=log)
    return f"127.0.0.1:{port}"


def start_mooncake_local(sg, pages: Pages, procs: Processes, a) -> Shape:
    master = mooncake_master(procs, "mooncake-master-local", a.lease_ms)
    extra = mooncake_extra(master, a.segment)
    backend = attach(sg, "mooncake", extra, pages)
    info = {"process_shape": "segment inside the benchmark process (SGLang's default set-up): puts "
                             "and gets are memcpy within this process",
            "segment_bytes": a.segment, "extra_config": extra}
    return _mooncake_shape("mooncake-local", backend, pages, info, a.lease_ms)


def start_mooncake_remote(sg, pages: Pages, procs: Processes, a) -> Shape:
    master = mooncake_master(procs, "mooncake-master-remote", a.lease_ms)
    _mooncake_client(procs, master, a.segment)
    extra = mooncake_extra(master, 0)
    backend = attach(sg, "mooncake", extra, pages)
    info = {"process_shape": "segment in a separate mooncake_client process, the SGLang backend "
                             "client-only: data over Mooncake's TCP transport on loopback",
            "segment_bytes": a.segment, "extra_config": extra}
    return _mooncake_shape("mooncake-remote", backend, pages, info, a.lease_ms)


def start_mooncake_shm(sg, pages: Pages, procs: Processes, a) -> Shape:
    """SGLang's ``standalone_storage`` mode: the segment in a ``mooncake_client`` process, the
    backend a dummy client whose host pool Mooncake's allocator places in memory shared with
    that process, which does the copies. Its own host pool (same geometry, same bytes)."""
    master = mooncake_master(procs, "mooncake-master-shm", a.lease_ms)
    client = _mooncake_client(procs, master, a.segment)
    own = Pages(sg, pages.n, allocator_type="mooncake", ref=pages.ref)
    # SGLang registers the K and V halves of the MHA host buffer one by one, and Mooncake's
    # dummy client accepts only the whole shared allocation ("Invalid buffer address or size
    # for registration ... need size" twice the half): register the whole buffer instead
    own.pool.get_hybrid_pool_buffer = lambda: [own.pool.kv_buffer]
    extra = {**mooncake_extra(master, 0), "standalone_storage": True, "client_server_address": client}
    backend = attach(sg, "mooncake", extra, own)
    info = {"process_shape": "segment in a separate mooncake_client process; the SGLang backend is "
                             "Mooncake's dummy client (standalone_storage) with the host pool in memory "
                             "shared with that process, which copies between pool and segment",
            "segment_bytes": a.segment, "extra_config": extra,
            "host_pool": "its own MHATokenToKVPoolHost (allocator_type 'mooncake'), same geometry and bytes",
            "patched": "host pool registered as one buffer (SGLang's per-half registration is refused by "
                       "the dummy client in these versions)"}
    return _mooncake_shape("mooncake-shm", backend, own, info, a.lease_ms)


def start_ours(sg, pages: Pages, a) -> Shape:
    """Ray on this machine (a head node, no dashboard), the store deployed onto it with one
    store node (a Ray actor process), our backend in this process as the client."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import logging

    import ray

    import mooncake_ray

    ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False,
             object_store_memory=a.ray_object_store)
    cfg = {"namespace": "bench_hicache", "segment_size_bytes": a.segment,
           "transport": {"protocol": a.protocol, "devices": ["lo"]}, "master": {"lease_ttl_s": a.lease_ms / 1000}}
    for section, values in json.loads(a.ours_store).items():
        cfg[section] = {**cfg.get(section, {}), **values} if isinstance(values, dict) else values
    t0 = time.perf_counter()
    mooncake_ray.start(cfg)
    deploy_s = time.perf_counter() - t0
    extra = {"backend_name": "mooncake_ray", "module_path": "mooncake_ray.integrations.sglang",
             "class_name": "MooncakeRayHiCacheStorage", "interface_v1": 1, "namespace": cfg["namespace"]}
    extra.update(json.loads(a.ours_extra))
    backend = attach(sg, "dynamic", extra, pages)
    example = backend.object_keys(["<page hash>"]) if hasattr(backend, "object_keys") else None
    info = {"process_shape": "client in the benchmark process, store node in a Ray actor process "
                             f"(transport protocol {a.protocol!r})",
            "segment_bytes": a.segment, "extra_config": extra, "store_config": cfg, "deploy_s": deploy_s,
            "objects_per_page": len(example) if example else None, "object_keys_of_a_page": example}

    waits = info["clear_waits_s"] = []

    def clear():
        # removed by force, pages a reader held stay allocated until their lease expires
        # (the reader's release finds no key to release): wait for the memory to be free
        backend.clear()
        t0 = time.perf_counter()
        deadline = t0 + a.lease_ms / 1000 + 5
        while time.perf_counter() < deadline:
            st = backend.client.stats()
            if st["used"] <= st.get("slab_bytes", 0):
                break
            time.sleep(0.1)
        waits.append(round(time.perf_counter() - t0, 2))

    return Shape(OURS, backend, pages, info, clear)


# ===================================================================== measurement ==

def run_round(shape: Shape, keys: list[str], batch: int, verify: bool) -> dict:
    """One round on one backend: set, exists, get over ``keys`` in batches. Returns each
    call's time per operation."""
    be, pages = shape.backend, shape.pages
    chunks = [keys[i:i + batch] for i in range(0, len(keys), batch)]
    stamps = [[int(k[:15], 16) for k in c] for c in chunks]  # keys are hex digests
    times = {op: [] for op in OPS}
    for c, st in zip(chunks, stamps):
        pages.load(st)
        idx = pages.indices(len(c))
        t = time.perf_counter()
        ok = be.batch_set_v1(c, idx)
        times["set"].append(time.perf_counter() - t)
        if not all(ok):
            raise RuntimeError(f"{shape.name}: batch_set_v1 stored {sum(map(bool, ok))} of {len(c)} pages")
    for c in chunks:
        t = time.perf_counter()
        hit = be.batch_exists(c)
        times["exists"].append(time.perf_counter() - t)
        if hit != len(c):
            raise RuntimeError(f"{shape.name}: batch_exists found {hit} of {len(c)} pages just stored")
    for c, st in zip(chunks, stamps):
        if verify:
            pages.wipe(len(c))
        idx = pages.indices(len(c))
        t = time.perf_counter()
        ok = be.batch_get_v1(c, idx)
        times["get"].append(time.perf_counter() - t)
        if not all(ok):
            raise RuntimeError(f"{shape.name}: batch_get_v1 read {sum(map(bool, ok))} of {len(c)} pages")
        if verify:
            pages.check(st)
    return times


def measure(shape: Shape, sg, a, seed: int, rounds: int | None = None) -> dict:
    """``rounds`` (default ``--rounds``) rounds on fresh keys; the store is emptied after
    each (not timed)."""
    rounds = a.rounds if rounds is None else rounds
    calls = {op: [] for op in OPS}
    for r in range(rounds):
        keys = page_keys(sg, seed * 1000 + r, a.pages)
        for op, ts in run_round(shape, keys, a.batch_pages, not a.no_verify).items():
            calls[op].extend(ts)
        shape.clear()
        if shape.backend.batch_exists(keys[:1]) != 0:
            raise RuntimeError(f"{shape.name}: keys still present after clear()")
    n = rounds * a.pages
    out = {}
    for op in OPS:
        total = sum(calls[op])
        out[op] = {"pages_per_s": n / total, "gb_per_s": n * PAGE_BYTES / total / 1e9,
                   "batch_ms_p50": sorted(calls[op])[len(calls[op]) // 2] * 1e3, "seconds": total}
    return out


def ratios(results: dict, num: str, den: str) -> dict:
    """ours/theirs per operation: of the medians, and the range of per-repeat ratios."""
    out = {}
    theirs = {r["repeat"]: r for r in results[den]["runs"]}
    for op in OPS:
        per = [r[op]["pages_per_s"] / theirs[r["repeat"]][op]["pages_per_s"]
               for r in results[num]["runs"] if r["repeat"] in theirs]
        out[op] = {"of_medians": results[num][op]["pages_per_s"]["median"] / results[den][op]["pages_per_s"]["median"],
                   "per_repeat": spread(per, keep=True)}
    return out


# ========================================================================== record ==

def _versions() -> dict:
    out = versions(("sglang", "mooncake-transfer-engine-non-cuda", "torch", "ray", "mooncake-ray"))
    try:
        out["mooncake-ray commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                                    text=True, timeout=30).stdout.strip()
        out["mooncake-ray tree dirty"] = bool(subprocess.run(
            ["git", "status", "--porcelain", "mooncake_ray"], cwd=ROOT, capture_output=True, text=True,
            timeout=30).stdout.strip())
    except (OSError, subprocess.TimeoutExpired):
        pass
    return out


def _machine() -> dict:
    model = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    mem = Path("/proc/meminfo").read_text().splitlines()[0].split()[1]
    return {"cpu": model, "cpus": os.cpu_count(), "mem_total_bytes": int(mem) * 1024,
            "kernel": platform.release(), "python": platform.python_version(), "loadavg_start": os.getloadavg()}


def print_summary(res: dict) -> None:
    print(f"\nhost: {host_label(res.get('host'), model=True)}")
    print(f"page: {PAGE_TOKENS} tokens x {LAYERS} layers x {KV_HEADS} KV heads x {HEAD_DIM} x bf16, K+V "
          f"= {PAGE_BYTES} B ({PAGE_BYTES / 2**20:.2f} MiB); batches of {res['params']['batch_pages']} pages, "
          f"{res['params']['pages']} pages x {res['params']['rounds']} rounds per repeat, "
          f"{res['params']['repeats']} repeats")
    print(f"{'backend':16} {'op':7} {'pages/s median (min-max)':>30} {'GB/s median (min-max)':>26} {'batch ms':>9}")
    for name, r in res["results"].items():
        for op in OPS:
            p, g = r[op]["pages_per_s"], r[op]["gb_per_s"]
            gbs = "" if op == "exists" else f"{g['median']:8.2f} ({g['min']:6.2f}-{g['max']:6.2f})"
            print(f"{name:16} {op:7} {p['median']:12.1f} ({p['min']:8.1f}-{p['max']:8.1f}) "
                  f"{gbs:>26} {r[op]['batch_ms_p50']['median']:9.2f}")
    for pair, rr in res["ratios"].items():
        print(f"{pair}: " + ", ".join(
            f"{op} {v['of_medians']:.2f}x ({v['per_repeat']['min']:.2f}-{v['per_repeat']['max']:.2f})"
            for op, v in rr.items()))
    for name, err in res["errors"].items():
        print(f"{name}: FAILED: {err.splitlines()[0] if err else ''}")


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["results"])
    colors = dict(zip(SHAPES, ("tab:blue", "tab:orange", "tab:red", "tab:purple")))
    fig, axes = plt.subplots(1, len(OPS), figsize=(4.2 * len(OPS), 4.2))
    for ax, op in zip(axes, OPS):
        for i, n in enumerate(names):
            s = res["results"][n][op]["pages_per_s"]
            ax.bar(i, s["median"], color=colors.get(n, "tab:gray"),
                   yerr=[[s["median"] - s["min"]], [s["max"] - s["median"]]], capsize=5)
            gb = res["results"][n][op]["gb_per_s"]["median"]
            label = f"{s['median']:.0f}" + ("" if op == "exists" else f"\n{gb:.2f} GB/s")
            ax.text(i, s["max"], label, ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=15, fontsize=8)
        ax.set_title({"set": "batch_set_v1", "exists": "batch_exists", "get": "batch_get_v1 (zero-copy)"}[op])
        ax.set_ylabel("pages/s (median, min-max bars)")
        ax.margins(y=0.2)
        ax.grid(axis="y", alpha=0.3)
    p = res["params"]
    fig.suptitle(f"SGLang HiCache storage interface, {PAGE_BYTES / 2**20:.0f} MiB pages (Qwen3-8B, 64 tokens, "
                 f"page_first), batches of {p['batch_pages']}, {p['repeats']} repeats; {host_label(res.get('host'))}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ============================================================================ main ==

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=64,
                    help="pages written and read per round (each 9 MiB; must fit in --segment)")
    ap.add_argument("--batch-pages", type=int, default=32,
                    help=f"pages per call (SGLang uses up to {SGLANG_BATCH}); the host pool holds one batch")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per backend per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup-rounds", type=int, default=1, help="untimed rounds per backend first")
    ap.add_argument("--segment", default="768mb", help="DRAM capacity of every store (ours and each Mooncake's)")
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help="comma-separated, from: " + ", ".join(SHAPES))
    ap.add_argument("--protocol", default="auto", choices=["auto", "tcp", "shm"],
                    help="our store's transport between client and store node")
    ap.add_argument("--ours-extra", default="{}", help="JSON merged into our backend's extra_config")
    ap.add_argument("--ours-store", default="{}",
                    help='JSON merged into our store\'s config, e.g. \'{"master": {"put_slab_bytes": 0}}\'')
    ap.add_argument("--lease-ms", type=int, default=1000,
                    help="read lease of every store (lets each be emptied between rounds)")
    ap.add_argument("--ray-object-store", default="256mb", help="Ray's object store (unused by the data path)")
    ap.add_argument("--no-verify", action="store_true", help="skip the byte check of pages read")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run (~1 min): defaults of 16 pages, batches of 16, 1 round, 2 repeats, "
                         "512 MiB stores")
    ap.add_argument("--log-dir", default=None, help="logs of mooncake_master and mooncake_client (default: a temp dir)")
    ap.add_argument("--out", default=str(RESULTS / "bench_hicache.json"))
    a = ap.parse_args(argv)
    if a.quick:  # other defaults; what is given on the command line still wins
        ap.set_defaults(pages=16, batch_pages=16, rounds=1, repeats=2, warmup_rounds=1, segment="512mb")
        a = ap.parse_args(argv)
    from mooncake_ray import parse_size  # the package itself (``_common.parse_size`` would stub it)

    a.segment = parse_size(a.segment)
    a.ray_object_store = parse_size(a.ray_object_store)
    a.batch_pages = min(a.batch_pages, a.pages)
    a.shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    need = a.pages * PAGE_BYTES
    if need > 0.85 * a.segment:
        ap.error(f"--pages {a.pages} is {need / 2**20:.0f} MiB, more than 85% of --segment "
                 f"({a.segment / 2**20:.0f} MiB): the stores would start evicting")
    return a


def start_shapes(sg, pages: Pages, procs: Processes, a, errors: dict) -> dict[str, Shape]:
    """Every requested backend, set up and warmed (its segment touched once); one that
    cannot start is recorded in ``errors`` with its traceback and left out."""
    starters = {OURS: lambda: start_ours(sg, pages, a),
                "mooncake-local": lambda: start_mooncake_local(sg, pages, procs, a),
                "mooncake-remote": lambda: start_mooncake_remote(sg, pages, procs, a),
                "mooncake-shm": lambda: start_mooncake_shm(sg, pages, procs, a)}
    shapes = {}
    for name in a.shapes:
        t = time.perf_counter()
        try:
            shape = starters[name]()
            shape.info["setup_s"] = time.perf_counter() - t
            shapes[name] = shape
            if a.warmup_rounds:
                measure(shape, sg, a, seed=900_000, rounds=a.warmup_rounds)
            print(f"{name}: ready in {time.perf_counter() - t:.1f}s", flush=True)
        except Exception:  # noqa: BLE001 - a backend that cannot start is a result; the others run
            errors[name] = traceback.format_exc()
            print(f"{name}: could not start:\n{errors[name]}", file=sys.stderr, flush=True)
    return shapes


def run_repeats(shapes: dict[str, Shape], sg, a, errors: dict) -> dict[str, list]:
    """``--repeats`` turns over the backends (the order rotating), the same keys for all."""
    runs: dict[str, list] = {}
    order = [n for n in shapes if n not in errors]
    for rep in range(a.repeats):
        k = rep % max(1, len(order))
        for name in order[k:] + order[:k]:
            if name in errors:
                continue
            try:
                r = measure(shapes[name], sg, a, seed=rep)
            except Exception:  # noqa: BLE001
                errors[name] = traceback.format_exc()
                print(f"{name}: failed in repeat {rep}:\n{errors[name]}", file=sys.stderr, flush=True)
                continue
            runs.setdefault(name, []).append({"repeat": rep, **r})
            print(f"repeat {rep} {name:16} " + "  ".join(
                f"{op} {r[op]['pages_per_s']:8.1f} pages/s" + ("" if op == "exists" else f" {r[op]['gb_per_s']:5.2f} GB/s")
                for op in OPS), flush=True)
    return runs


def record_our_transport(shape: Shape, a, repeats_done: int) -> None:
    """Which copy path our transport took (bytes per path), and the bytes it wrote per
    byte stored (1.0 unless values are written more than once)."""
    stats = shape.backend.client.engine.stats()
    moved = {k: v for k, v in stats.items() if k.endswith("_bytes")}
    stored = (a.warmup_rounds + repeats_done * a.rounds) * a.pages * PAGE_BYTES
    shape.info["transport_bytes"] = moved
    written = moved.get("write_memcpy_bytes", 0) + moved.get("write_put_bytes", 0)  # gathered: part of put
    shape.info["bytes_written_per_byte_stored"] = written / stored if stored else None


def stop(shapes: dict[str, Shape], procs: Processes, ray_used: bool) -> None:
    """Close the backends, then the Mooncake processes, then our store and Ray."""
    for s in shapes.values():
        try:
            s.close()
        except Exception as e:  # noqa: BLE001
            print(f"{s.name}: close: {e!r}", file=sys.stderr)
    procs.stop_all()
    if ray_used:
        try:
            import ray

            import mooncake_ray

            if ray.is_initialized():
                mooncake_ray.shutdown("bench_hicache", stop_ray=True)
        except Exception as e:  # noqa: BLE001
            print(f"shutdown: {e!r}", file=sys.stderr)


def summarize(a, shapes: dict[str, Shape], runs: dict[str, list], errors: dict, extra: dict) -> dict:
    results = {}
    for name, rs in runs.items():
        row = {op: {m: spread([r[op][m] for r in rs], keep=(m == "pages_per_s"))
                    for m in ("pages_per_s", "gb_per_s", "batch_ms_p50")} for op in OPS}
        row["runs"] = rs
        results[name] = row
    ratio = {f"{OURS}/{o}": ratios(results, OURS, o) for o in SHAPES[1:] if OURS in results and o in results}
    return {
        "benchmark": "bench_hicache",
        "geometry": {"model": MODEL, "layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16",
                     "page_tokens": PAGE_TOKENS, "layout": "page_first", "k_bytes_per_page": K_BYTES,
                     "page_bytes": PAGE_BYTES},
        "host_pool": {"class": "sglang MHATokenToKVPoolHost", "layout": "page_first", "device": "cpu",
                      "pin_memory": False, "pages": a.batch_pages, "bytes": a.batch_pages * PAGE_BYTES,
                      "shared_by": [n for n in shapes if shapes[n].info.get("host_pool") is None],
                      "note": "SGLang's own class; its device-side pointers are one page of CPU tensors the "
                              "storage calls never read"},
        "params": {"pages": a.pages, "batch_pages": a.batch_pages, "rounds": a.rounds, "repeats": a.repeats,
                   "warmup_rounds": a.warmup_rounds, "segment_bytes": a.segment, "protocol": a.protocol,
                   "ours_store": json.loads(a.ours_store), "lease_ms": a.lease_ms,
                   "verify": not a.no_verify, "quick": a.quick},
        "shapes": {n: s.info for n, s in shapes.items()},
        "results": results,
        "ratios": ratio,
        "errors": errors,
        "versions": _versions(),
        **extra,
    }


def main(argv=None) -> None:
    a = parse_args(argv)
    print(f"page bytes: K {K_BYTES} + V {K_BYTES} = {PAGE_BYTES} ({PAGE_BYTES / 2**20:.3f} MiB); host pool "
          f"{a.batch_pages} pages = {a.batch_pages * PAGE_BYTES / 2**20:.0f} MiB; stores {a.segment / 2**20:.0f} MiB "
          f"each; {a.pages} pages per round = {a.pages * PAGE_BYTES / 2**20:.0f} MiB", flush=True)
    machine = _machine()
    log_dir = Path(a.log_dir or tempfile.mkdtemp(prefix="bench_hicache-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    sg = import_sglang()
    import_s = time.perf_counter() - t0
    pages = Pages(sg, a.batch_pages)
    procs = Processes(log_dir)
    shapes: dict[str, Shape] = {}
    errors: dict[str, str] = {}
    runs: dict[str, list] = {}
    try:
        shapes = start_shapes(sg, pages, procs, a, errors)
        runs = run_repeats(shapes, sg, a, errors)
        if OURS in shapes:
            record_our_transport(shapes[OURS], a, len(runs.get(OURS, [])))
    finally:
        stop(shapes, procs, ray_used=OURS in a.shapes)
    keep_logs = a.log_dir is not None or bool(errors)
    res = summarize(a, shapes, runs, errors, {
        "host": host_info(), "machine": {**machine, "loadavg_end": os.getloadavg()}, "sglang_import_s": import_s,
        "log_dir": str(log_dir) if keep_logs else None})
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, default=str))
    if res["results"]:
        plot(res, out.with_suffix(".png"))
    print_summary(res)
    print(f"wrote {out}")
    if not keep_logs:
        shutil.rmtree(log_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
