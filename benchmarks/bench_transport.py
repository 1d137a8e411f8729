"""The store's public client API against Mooncake Store, every peer measured in the same run.

Peers, all on one host over loopback, in one process tree:

- ours (auto): ``mooncake_ray.start(...)`` with ``transport.protocol="auto"`` (UCX picks
  shared memory on one host); the driver is a client-only process, the StoreNode actor is
  the remote store.
- ours (tcp): the same with ``protocol="tcp"`` forced (a separate store, own namespace).
- Mooncake Store, "remote" mode of shared/ANCHORS.md: ``mooncake_master`` (HTTP metadata
  server built in) and a ``mooncake_client`` store process holding a 4 GB global segment,
  run as subprocesses; a client-only ``MooncakeDistributedStore`` (global_segment_size=0,
  protocol tcp, a local buffer for the bytes API) in this process. A benchmark-only peer
  (``pip install mooncake-transfer-engine-non-cuda``): if it is missing, our side still runs
  and the peer is reported as skipped.
- ``ucx_perftest`` (libucx wheel) ``ucp_put_bw`` / ``ucp_get`` at 4 MiB on the transport each
  of our protocols uses (sm for auto, tcp for tcp), busy-polling on both sides.

For 4 KiB .. 64 MiB: single PUT and GET throughput (sum of per-op times) and latency p50/p99,
zero-copy (registered buffers: ``put_from``/``get_into``) and bytes (``put``/``get``), plus
batched 128 x 4 KiB zero-copy keys/s. Every read is verified (outside the timed region):
each key's value carries its own index in its first and last 8 bytes.

Each round has one phase per protocol: our store for that protocol is started, and every
measurement runs for ours and for Mooncake back to back (order alternating), with
ucx_perftest (sm for auto, tcp for tcp) right after each 4 MiB zero-copy pair, so paired
figures share the machine's noise (it is shared and noisy); then our store is shut down.
Sizes up to 4 MiB and the batch run ``--small-repeats`` times per phase. The table gives
median and min-max over all runs (Mooncake: the runs of both phases); each target ratio
is the ratio of the medians over the runs of its own phases, with the min-max of the
per-round paired ratios.

Run inside the private network namespace (Mooncake listens on all interfaces):
    make bench B=benchmarks/bench_transport.py ARGS="--rounds 5"
Writes benchmarks/results/bench_transport.json and bench_transport.png.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from _common import free_port, git_state, host_info, host_label, spread, stop_processes, ucx_perftest

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
TLS_OF = {"auto": "sm", "tcp": "tcp"}  # ucx_perftest's UCX_TLS for each of our protocols
BATCH, BATCH_SIZE = 128, 4 << 10
MIB4 = 4 << 20
COLD_SIZES = (4 << 10, 4 << 20)  # also timed with the client's location cache emptied
_MAGIC = np.uint64(0x9E3779B97F4A7C15)


def fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def ops_per_run(size: int) -> int:
    return max(16, min(2000, (256 << 20) // size))


# ================================================================ the two clients ==
class Ours:
    """mooncake_ray's public client API."""

    def __init__(self, store, label: str):
        self.s = store
        self.label = label

    def register(self, arr):
        self.s.register_buffer(arr)

    def unregister(self, arr):
        self.s.unregister_buffer(arr)

    def put_zc(self, key, arr):
        self.s.put_from(key, arr)

    def get_zc(self, key, arr):
        return self.s.get_into(key, arr)

    def put_bytes(self, key, value: bytes):
        self.s.put(key, value)

    def get_bytes(self, key) -> bytes:
        return self.s.get(key)

    def forget(self, key):
        """Drop the client's remembered location of ``key``: its next get looks it up
        first, as a client that never wrote or read it does (Mooncake's client always)."""
        self.s._locs.pop(key, None)

    def batch_args(self, rows):
        return list(rows)  # one numpy view per key (inside the registered block)

    def batch_put_zc(self, keys, args):
        return self.s.batch_put_from(keys, args)

    def batch_get_zc(self, keys, args):
        return self.s.batch_get_into(keys, args)

    def batch_ok_put(self, res):
        return all(r is None for r in res)

    def batch_ok_get(self, res, size):
        return all(r == size for r in res)

    def remove_prefix(self, prefix):
        self.s.remove_prefix(prefix, force=True)


class Mooncake:
    """Mooncake Store's Python client (pointer + size API)."""

    def __init__(self, store, label: str = "mooncake"):
        self.s = store
        self.label = label

    def register(self, arr):
        rc = self.s.register_buffer(arr.ctypes.data, arr.nbytes)
        if rc != 0:
            raise RuntimeError(f"mooncake register_buffer rc={rc}")

    def unregister(self, arr):
        self.s.unregister_buffer(arr.ctypes.data)

    def put_zc(self, key, arr):
        rc = self.s.put_from(key, arr.ctypes.data, arr.nbytes)
        if rc != 0:
            raise RuntimeError(f"mooncake put_from({key}) rc={rc}")

    def get_zc(self, key, arr):
        n = self.s.get_into(key, arr.ctypes.data, arr.nbytes)
        if n < 0:
            raise RuntimeError(f"mooncake get_into({key}) rc={n}")
        return n

    def put_bytes(self, key, value: bytes):
        rc = self.s.put(key, value)
        if rc != 0:
            raise RuntimeError(f"mooncake put({key}) rc={rc}")

    def get_bytes(self, key) -> bytes:
        return self.s.get(key)  # b"" on a miss: caught by the verification

    def batch_args(self, rows):
        return [r.ctypes.data for r in rows], [r.nbytes for r in rows]

    def batch_put_zc(self, keys, args):
        return self.s.batch_put_from(keys, args[0], args[1])

    def batch_get_zc(self, keys, args):
        return self.s.batch_get_into(keys, args[0], args[1])

    def batch_ok_put(self, res):
        return all(r == 0 for r in res)

    def batch_ok_get(self, res, size):
        return all(r == size for r in res)

    def remove_prefix(self, prefix):
        self.s.remove_by_regex("^" + re.escape(prefix), True)


# ================================================================ measurements ==
def _stamp(arr: np.ndarray, i: int) -> None:
    w = arr.view(np.uint64)
    w[0] = i
    w[-1] = np.uint64(i) ^ _MAGIC


def _check(got: np.ndarray, base: np.ndarray, i: int, what: str) -> None:
    w = got.view(np.uint64)
    ok = (got.nbytes == base.nbytes and w[0] == i and w[-1] == (np.uint64(i) ^ _MAGIC)
          and np.array_equal(got[8:-8], base[8:-8]))
    if not ok:
        raise AssertionError(f"{what}: value {i} read back wrong")


def _lat_summary(lat: list[float], size: int) -> dict:
    a = np.asarray(lat)
    total = float(a.sum())
    return {"gb_per_s": len(a) * size / total / 1e9, "ops_per_s": len(a) / total,
            "p50_us": float(np.percentile(a, 50) * 1e6), "p99_us": float(np.percentile(a, 99) * 1e6)}


_COPY_DST: np.ndarray | None = None


def memcpy_run(size: int) -> dict:
    """What a put of ``size`` moves, with nothing else: the same number of ops as a run,
    each one copy (numpy's, one thread, this process) from a source stamped as the puts'
    is into the next slot of a 256 MiB buffer faulted in beforehand, walked as puts walk an
    arena. The reference for "a PUT within 0.85x of memcpy"."""
    global _COPY_DST
    if _COPY_DST is None:
        _COPY_DST = np.ones(256 << 20, dtype=np.uint8)
    src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    slots, lat = len(_COPY_DST) // size, []
    for i in range(ops_per_run(size)):
        _stamp(src, i)
        at = (i % slots) * size
        t = time.perf_counter()
        np.copyto(_COPY_DST[at:at + size], src)
        lat.append(time.perf_counter() - t)
    return {"put": _lat_summary(lat, size)}


def single_run(cli, size: int, mode: str, tag: str, rng) -> dict:
    """n puts then n gets of distinct keys, one op at a time; returns put/get summaries."""
    n = ops_per_run(size)
    prefix = f"bt/{tag}/{mode}/{size}/"
    keys = [f"{prefix}{i}" for i in range(n)]
    base = rng.integers(0, 256, size, dtype=np.uint8)
    src = base.copy()
    dst = np.empty(size, dtype=np.uint8)
    zc = mode == "zc"
    if zc:
        cli.register(src)
        cli.register(dst)
    try:
        # warm this size's path (untimed)
        for j in range(3):
            wk = f"{prefix}w{j}"
            _stamp(src, j)
            if zc:
                cli.put_zc(wk, src)
                cli.get_zc(wk, dst)
            else:
                cli.put_bytes(wk, src.tobytes())
                cli.get_bytes(wk)
        put_lat, get_lat = [], []
        pc = time.perf_counter
        for i, k in enumerate(keys):
            _stamp(src, i)
            if zc:
                t = pc()
                cli.put_zc(k, src)
                put_lat.append(pc() - t)
            else:
                v = src.tobytes()
                t = pc()
                cli.put_bytes(k, v)
                put_lat.append(pc() - t)
                del v
        for i, k in enumerate(keys):
            if zc:
                t = pc()
                got = cli.get_zc(k, dst)
                get_lat.append(pc() - t)
                if got != size:
                    raise AssertionError(f"{cli.label} get_into({k}) returned {got}")
                _check(dst, base, i, f"{cli.label} {mode} {size}")
            else:
                t = pc()
                v = cli.get_bytes(k)
                get_lat.append(pc() - t)
                _check(np.frombuffer(v, dtype=np.uint8), base, i, f"{cli.label} {mode} {size}")
                del v
        cold_lat = []
        if zc and size in COLD_SIZES and hasattr(cli, "forget"):
            # again, every location forgotten: the lookup before the read, never overlapped
            for i, k in enumerate(keys):
                cli.forget(k)
                t = pc()
                cli.get_zc(k, dst)
                cold_lat.append(pc() - t)
                _check(dst, base, i, f"{cli.label} {mode} {size} cold")
    finally:
        cli.remove_prefix(prefix)
        if zc:
            cli.unregister(src)
            cli.unregister(dst)
    out = {"put": _lat_summary(put_lat, size), "get": _lat_summary(get_lat, size)}
    if cold_lat:
        out["get_cold"] = _lat_summary(cold_lat, size)
    return out


def batch_run(cli, tag: str, rng, batches: int) -> dict:
    """``batches`` zero-copy batch puts of BATCH x BATCH_SIZE keys, then as many batch gets."""
    prefix = f"bt/{tag}/batch/"
    base = rng.integers(0, 256, BATCH_SIZE, dtype=np.uint8)
    src = np.tile(base, (BATCH, 1))
    dst = np.zeros_like(src)
    cli.register(src)
    cli.register(dst)
    sargs, dargs = cli.batch_args(src), cli.batch_args(dst)
    pc = time.perf_counter
    put_t = get_t = 0.0
    try:
        wk = [f"{prefix}w/{i}" for i in range(BATCH)]
        cli.batch_put_zc(wk, sargs)
        cli.batch_get_zc(wk, dargs)
        all_keys = []
        for b in range(batches):
            keys = [f"{prefix}{b}/{i}" for i in range(BATCH)]
            for i in range(BATCH):
                _stamp(src[i], b * BATCH + i)
            t = pc()
            res = cli.batch_put_zc(keys, sargs)
            put_t += pc() - t
            if not cli.batch_ok_put(res):
                raise AssertionError(f"{cli.label} batch put failed: {res[:4]}")
            all_keys.append(keys)
        for b, keys in enumerate(all_keys):
            dst[:] = 0
            t = pc()
            res = cli.batch_get_zc(keys, dargs)
            get_t += pc() - t
            if not cli.batch_ok_get(res, BATCH_SIZE):
                raise AssertionError(f"{cli.label} batch get failed: {res[:4]}")
            for i in range(BATCH):
                _check(dst[i], base, b * BATCH + i, f"{cli.label} batch")
    finally:
        cli.remove_prefix(prefix)
        cli.unregister(src)
        cli.unregister(dst)
    n = batches * BATCH
    return {"put": {"keys_per_s": n / put_t, "gb_per_s": n * BATCH_SIZE / put_t / 1e9},
            "get": {"keys_per_s": n / get_t, "gb_per_s": n * BATCH_SIZE / get_t / 1e9}}


def warm_pool(cli, tag: str, pool_bytes: int) -> None:
    """Touch ~75% of the store's pool once with 64 MiB values, then free it: neither side
    pays first-touch page faults inside the timed runs."""
    size = 64 << 20
    arr = np.ones(size, dtype=np.uint8)
    cli.register(arr)
    prefix = f"bt/{tag}/warm/"
    try:
        for i in range(max(1, int(pool_bytes * 0.75) // size)):
            cli.put_zc(f"{prefix}{i}", arr)
    finally:
        cli.remove_prefix(prefix)
        cli.unregister(arr)


def phase(peers: dict, tls: str | None, r: int, rng, sizes, small_repeats: int, batches: int,
          perf_iters: int) -> dict:
    """One round of every measurement with one of our stores up, peers interleaved at the
    finest grain: each run of one peer is followed by the same run of the other (order
    alternating), and at 4 MiB zero-copy by ucx_perftest on our transport, so paired
    figures share the machine's noise. Returns {label: {"single": {mode: {size: [runs]}},
    "batch": [runs]}, "perftest": [{"put", "get", ...} per 4 MiB run]}."""
    labels = list(peers)
    out: dict = {lab: {"single": {"zc": {}, "bytes": {}}, "batch": []} for lab in labels}
    out["perftest"] = []
    for mode in ("zc", "bytes"):
        for size in sizes:
            reps = small_repeats if size <= MIB4 else 1
            for k in range(reps):
                order = labels if (k + r) % 2 == 0 else labels[::-1]
                for lab in order:
                    out[lab]["single"][mode].setdefault(str(size), []).append(
                        single_run(peers[lab], size, mode, f"{lab}/{r}/{k}", rng))
                if tls and mode == "zc" and size == MIB4:
                    out["perftest"].append(perftest_set(tls, perf_iters))
                if mode == "zc" and size == MIB4:
                    out.setdefault("memcpy", []).append(memcpy_run(size))
    for k in range(small_repeats):
        for lab in (labels if (k + r) % 2 == 0 else labels[::-1]):
            out[lab]["batch"].append(batch_run(peers[lab], f"{lab}/{r}/{k}", rng, batches))
    return out


# ================================================================ Mooncake processes ==
def _wait_port(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"port {port} not listening after {timeout:.0f}s")


class MooncakePeer:
    """mooncake_master + a mooncake_client store process + a client-only store here."""

    def __init__(self, segment: str, local_buffer: int):
        self.segment = segment
        self.local_buffer = local_buffer
        self.procs: list[subprocess.Popen] = []
        self.logdir = Path(tempfile.mkdtemp(prefix="bench-transport-mooncake-"))
        self.store = None
        self.commands: list[str] = []

    def _bin(self, name: str) -> str:
        for cand in (Path(sys.executable).parent / name, shutil.which(name)):
            if cand and Path(cand).exists():
                return str(cand)
        raise FileNotFoundError(f"{name} not found next to {sys.executable} nor on PATH")

    def _spawn(self, name: str, args: list[str], env: dict) -> subprocess.Popen:
        cmd = [self._bin(name), *args]
        self.commands.append(" ".join(f"{k}={v}" for k, v in env.items() if k.startswith("MC_")) + " " + " ".join(cmd))
        log = open(self.logdir / f"{name}.log", "w")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env={**os.environ, **env})
        self.procs.append(p)
        return p

    def start(self) -> None:
        # The transfer engine advertises the first non-loopback address unless told: here
        # there is none (loopback-only namespace), so bind it to 127.0.0.1 explicitly.
        env = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        os.environ.update(env)  # for the in-process client
        rpc, http, metrics, svc = (free_port() for _ in range(4))
        self.master_addr = f"127.0.0.1:{rpc}"
        self.metadata = f"http://127.0.0.1:{http}/metadata"
        master = self._spawn("mooncake_master", [
            "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
            "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={http}", "--metrics_host=127.0.0.1", f"--metrics_port={metrics}",
        ], env)
        _wait_port(rpc, master, 30)
        _wait_port(http, master, 30)
        store_proc = self._spawn("mooncake_client", [
            f"--global_segment_size={self.segment}", f"--master_server_address={self.master_addr}",
            f"--metadata_server={self.metadata}", "--host=127.0.0.1", f"--port={svc}", "--protocol=tcp",
        ], env)
        _wait_port(svc, store_proc, 60)
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        rc = self.store.setup("127.0.0.1", self.metadata, 0, self.local_buffer, "tcp", "", self.master_addr)
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup rc={rc}")
        # Wait until the store process's segment is mounted: a put succeeds.
        probe = np.ones(4096, dtype=np.uint8)
        deadline = time.monotonic() + 60
        while True:
            rc = self.store.put("bt/probe", probe.tobytes())
            if rc == 0 and self.store.get("bt/probe") == probe.tobytes():
                self.store.remove("bt/probe", True)
                break
            if time.monotonic() > deadline or store_proc.poll() is not None:
                raise RuntimeError(f"Mooncake store never took a put (rc={rc}); logs in {self.logdir}")
            time.sleep(0.5)

    def log_tail(self, n: int = 15) -> str:
        out = []
        for f in sorted(self.logdir.glob("*.log")):
            lines = f.read_text(errors="replace").splitlines()
            out.append(f"--- {f.name}\n" + "\n".join(lines[-n:]))
        return "\n".join(out)

    def stop(self) -> None:
        if self.store is not None:
            try:
                self.store.close()
            except Exception:  # noqa: BLE001
                pass
            self.store = None
        stop_processes(self.procs)  # only the processes started here, by pid


# ================================================================ ucx_perftest ==
def perftest(tls: str, test: str, size: int, iters: int, extra: tuple = ()) -> float:
    """GB/s of one busy-polling ucx_perftest run (NaN if it gave none)."""
    return ucx_perftest(tls, test, size, iters, extra)["gbps"]


def perftest_set(tls: str, iters: int) -> dict:
    """4 MiB ucp_put_bw and ucp_get, busy-polling on both sides (perftest's best case on an
    idle machine); over tcp also put_bw in sleep mode (``-E sleep``: both sides wait in
    epoll, like the engine's progress threads), which does better than busy-polling when
    two spinning processes share 2 busy vCPUs. (ucp_get under -E sleep never completes
    here: not run.)"""
    out = {"put": perftest(tls, "ucp_put_bw", MIB4, iters), "get": perftest(tls, "ucp_get", MIB4, iters)}
    if tls == "tcp":
        out["put_sleep"] = perftest(tls, "ucp_put_bw", MIB4, iters, ("-E", "sleep"))
    return out


# ================================================================ aggregation ==
def aggregate(rounds: list[dict]) -> dict:
    """Per peer: single[mode][size][op][metric] and batch[op][metric] -> median/min/max over runs."""
    res: dict = {"single": {}, "batch": {}}
    first = rounds[0]
    for mode, per_size in first["single"].items():
        for size in per_size:
            runs = [run for rd in rounds for run in rd["single"][mode][size]]
            res["single"].setdefault(mode, {})[size] = {
                op: {m: spread([r[op][m] for r in runs]) for m in runs[0][op]}
                for op in ("put", "get", "get_cold") if op in runs[0]}
    runs = [run for rd in rounds for run in rd["batch"]]
    res["batch"] = {op: {m: spread([r[op][m] for r in runs]) for m in runs[0][op]} for op in ("put", "get")}
    return res


def targets(phases: dict, protocols: list[str]) -> dict:
    """Per protocol, ours against the peers measured in the same phases (paired): the ratio
    of the medians over all runs, with the min-max of the per-round ratios (each round's
    median over its runs)."""
    out: dict = {}

    def add(name, ours_runs, peer_runs, goal, unit, note=""):
        """``*_runs``: per round, the list of that round's values."""
        flat = lambda rr: [v for r in rr for v in r if v == v]  # noqa: E731
        if not ours_runs or not peer_runs or not flat(peer_runs):
            out[name] = {"skipped": True, "target": goal, "note": note}
            return
        om, pm = statistics.median(flat(ours_runs)), statistics.median(flat(peer_runs))
        pairs = []
        for o, p in zip(ours_runs, peer_runs):
            p = [v for v in p if v == v]
            if o and p and statistics.median(p) > 0:
                pairs.append(statistics.median(o) / statistics.median(p))
        ratio = om / pm
        out[name] = {"ours": om, "peer": pm, "unit": unit, "ratio": ratio,
                     "ratio_range": [min(pairs), max(pairs)] if pairs else None,
                     "per_round_ratios": pairs, "target": goal, "met": ratio >= goal, "note": note}

    def single(rounds, who, mode, size, op, metric):
        if not rounds or who not in rounds[0]:
            return None
        return [[x[op][metric] for x in rd[who]["single"][mode][str(size)]] for rd in rounds]

    def batch(rounds, who, op):
        if not rounds or who not in rounds[0]:
            return None
        return [[x[op]["keys_per_s"] for x in rd[who]["batch"]] for rd in rounds]

    goals = {"auto": (3.0, "ours (auto) / Mooncake remote"), "tcp": (1.5, "ours (tcp forced) / Mooncake remote")}
    for proto in protocols:
        ph = phases.get(proto)
        goal, who = goals.get(proto, (1.5, f"ours ({proto}) / Mooncake"))
        for op in ("get", "put"):
            add(f"{proto}: 4 MiB zc {op.upper()} GB/s, {who}", single(ph, "ours", "zc", MIB4, op, "gb_per_s"),
                single(ph, "mooncake", "zc", MIB4, op, "gb_per_s"), goal, "GB/s")
    for proto in protocols:
        ph = phases.get(proto)
        for mode in ("bytes", "zc"):
            add(f"{proto}: 4 KiB single GET ops/s ({mode}), ours / Mooncake",
                single(ph, "ours", mode, 4096, "get", "ops_per_s"),
                single(ph, "mooncake", mode, 4096, "get", "ops_per_s"), 1.5, "ops/s",
                "ANCHORS quotes Mooncake's bytes API" if mode == "bytes" else "")
    for proto in protocols:  # a reader that never wrote or read the keys
        ph = phases.get(proto)
        goal, who = goals.get(proto, (1.5, f"ours ({proto}) / Mooncake"))
        note = "no location cache: each get looks the key up first (a client that never saw it)"
        add(f"{proto}: 4 MiB zc GET GB/s, no location cache, {who}",
            single(ph, "ours", "zc", MIB4, "get_cold", "gb_per_s"),
            single(ph, "mooncake", "zc", MIB4, "get", "gb_per_s"), goal, "GB/s", note)
        add(f"{proto}: 4 KiB single GET ops/s (zc), no location cache, ours / Mooncake",
            single(ph, "ours", "zc", 4096, "get_cold", "ops_per_s"),
            single(ph, "mooncake", "zc", 4096, "get", "ops_per_s"), 1.5, "ops/s", note)
    for proto in protocols:
        ph = phases.get(proto)
        for op in ("get", "put"):
            add(f"{proto}: {BATCH} x 4 KiB batch zc {op.upper()} keys/s, ours / Mooncake",
                batch(ph, "ours", op), batch(ph, "mooncake", op), 2.0, "keys/s")
    if phases.get("auto"):  # same host: the copy a put is
        ph = phases["auto"]
        add("auto: 4 MiB zc PUT GB/s, ours / memcpy (one thread, the client's process)",
            single(ph, "ours", "zc", MIB4, "put", "gb_per_s"),
            [[m["put"]["gb_per_s"] for m in rd.get("memcpy", [])] for rd in ph], 0.85, "GB/s",
            "the same ops copied by numpy into a 256 MiB buffer faulted in beforehand, in the same rounds")
    for proto in protocols:
        ph = phases.get(proto)
        tls = TLS_OF.get(proto)
        if tls is None or not ph or not ph[0]["perftest"]:
            continue
        for op, test in (("put", "ucp_put_bw"), ("get", "ucp_get")):
            # the better of busy-polling and sleep mode where both ran: the stricter reference
            ref = [[max([v for v in (pt[op], pt.get(op + "_sleep", float("nan"))) if v == v], default=float("nan"))
                    for pt in rd["perftest"]] for rd in ph]
            add(f"{proto}: 4 MiB zc {op.upper()} GB/s, ours / ucx_perftest {test} (UCX_TLS={tls})",
                single(ph, "ours", "zc", MIB4, op, "gb_per_s"), ref, 0.8, "GB/s",
                "reference: the better of busy-polling and -E sleep" if (tls, op) == ("tcp", "put") else
                "reference: busy-polling (this op hangs under -E sleep)")
    return out


# ================================================================ output ==
def _cell(st, fmt="{:.2f}") -> str:
    if st is None:
        return "-"
    return f"{fmt.format(st['median'])} [{fmt.format(st['min'])}-{fmt.format(st['max'])}]"


def print_table(agg: dict, peers: list[str]) -> None:
    w = 42
    for mode in ("zc", "bytes"):
        for op in ("put", "get"):
            print(f"\n== single {op.upper()} ({mode}): GB/s median [min-max] | p50 / p99 us (medians)")
            print(f"{'size':>8} " + " ".join(f"{p:^{w}}" for p in peers))
            for size in SIZES:
                cells = []
                for p in peers:
                    row = agg[p]["single"].get(mode, {}).get(str(size))
                    if row is None:
                        cells.append(f"{'-':^{w}}")
                        continue
                    r = row[op]
                    txt = f"{_cell(r['gb_per_s'])} | {r['p50_us']['median']:.0f} / {r['p99_us']['median']:.0f}"
                    cells.append(f"{txt:^{w}}")
                print(f"{fmt_size(size):>8} " + " ".join(cells))
    print("\n== 4 KiB single GET ops/s, median [min-max]")
    for mode in ("bytes", "zc"):
        print(f"{mode:>8} " + " ".join(f"{_cell(agg[p]['single'][mode][str(4096)]['get']['ops_per_s'], '{:.0f}'):^{w}}"
                                       for p in peers))
    print(f"\n== batch {BATCH} x 4 KiB zero-copy keys/s, median [min-max]")
    for op in ("put", "get"):
        print(f"{op:>8} " + " ".join(f"{_cell(agg[p]['batch'][op]['keys_per_s'], '{:.0f}'):^{w}}" for p in peers))


def print_targets(tg: dict, perf: dict | None) -> None:
    if perf:
        print("\n== ucx_perftest 4 MiB (busy-polling), GB/s median [min-max]")
        for tls, ops in perf.items():
            line = f"  UCX_TLS={tls:4} put_bw {_cell(ops['put'])}   get {_cell(ops['get'])}"
            if "put_sleep" in ops:
                line += f"   (-E sleep: put_bw {_cell(ops['put_sleep'])})"
            print(line)
    print("\n== targets (ratio of medians; [min-max] of per-round paired ratios)")
    for name, t in tg.items():
        if t.get("skipped"):
            print(f"  {name}: skipped (peer not measured), target >= {t['target']}")
            continue
        rr = t["ratio_range"]
        rng = f"[{rr[0]:.2f}-{rr[1]:.2f}]" if rr else ""
        print(f"  {name}: {t['ours']:.3g} vs {t['peer']:.3g} {t['unit']} -> {t['ratio']:.2f}x {rng} "
              f"(target >= {t['target']}x): {'met' if t['met'] else 'missed'}")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(14, 10))
    colors = {"ours_auto": "tab:blue", "ours_tcp": "tab:green", "ours_shm": "tab:cyan", "mooncake": "tab:red"}
    panels = ((axes[0][0], "put", "gb_per_s", "PUT GB/s"), (axes[0][1], "get", "gb_per_s", "GET GB/s"),
              (axes[1][0], "get", "p50_us", "GET p50 latency (us)"))
    for ax, op, metric, title in panels:
        for peer, agg in results["peers"].items():
            for mode, style in (("zc", "-"), ("bytes", "--")):
                rows = agg["single"].get(mode)
                if not rows:
                    continue
                sizes = [int(s) for s in rows]
                med = [rows[str(s)][op][metric]["median"] for s in sizes]
                lo = [rows[str(s)][op][metric]["min"] for s in sizes]
                hi = [rows[str(s)][op][metric]["max"] for s in sizes]
                ax.plot(sizes, med, style, marker="o", color=colors.get(peer), label=f"{peer} {mode}")
                ax.fill_between(sizes, lo, hi, alpha=0.12, color=colors.get(peer))
        if metric == "gb_per_s" and results.get("perftest"):
            for tls, key, ls, what in (("sm", op, ":", "busy"), ("tcp", op, "-.", "busy"),
                                       ("tcp", op + "_sleep", "--", "-E sleep")):
                v = results["perftest"].get(tls, {}).get(key)
                if v:
                    ax.axhline(v["median"], ls=ls, color="gray", lw=1,
                               label=f"ucx_perftest {tls} 4 MiB ({what})")
        ax.set_xscale("log", base=2)
        if metric == "p50_us":
            ax.set_yscale("log")
        ax.set_xlabel("value size (bytes)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[1][1]
    tg = [(n, t) for n, t in results["targets"].items() if not t.get("skipped")]
    if tg:
        ys = np.arange(len(tg))
        ratios = [t["ratio"] for _, t in tg]
        errs = [[t["ratio"] - (t["ratio_range"] or [t["ratio"]] * 2)[0] for _, t in tg],
                [(t["ratio_range"] or [t["ratio"]] * 2)[1] - t["ratio"] for _, t in tg]]
        errs = [[max(0.0, e) for e in side] for side in errs]
        ax.barh(ys, ratios, xerr=errs, color=["tab:green" if t["met"] else "tab:red" for _, t in tg], alpha=0.7)
        for y, (_, t) in zip(ys, tg):
            ax.plot([t["target"], t["target"]], [y - 0.4, y + 0.4], color="black", lw=2)
        ax.set_yticks(ys)
        ax.set_yticklabels([n.replace(", ours", "\nours") for n, _ in tg], fontsize=6)
        ax.invert_yaxis()
        ax.set_xscale("log")
        from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator, ScalarFormatter

        ax.xaxis.set_major_locator(FixedLocator([0.25, 0.5, 0.8, 1, 1.5, 2, 3, 5, 10, 20]))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.axvline(1.0, color="gray", lw=0.8)
        ax.set_title("target ratios: bar = ratio of medians, whisker = per-round range,\nblack tick = target (green met, red missed)", fontsize=9)
    else:
        ax.text(0.5, 0.5, "no peer measured", ha="center")
    fig.suptitle("mooncake-ray vs Mooncake Store (remote, tcp) vs ucx_perftest, one host, one run "
                 f"({results['rounds']} interleaved rounds; {host_label(results.get('host'))})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# ================================================================ main ==
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (every peer once per round)")
    ap.add_argument("--small-repeats", type=int, default=3, help="runs per round for sizes <= 4 MiB and batch")
    ap.add_argument("--batches", type=int, default=20, help="batches of 128 x 4 KiB per batch run")
    ap.add_argument("--protocols", default="auto,tcp")
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES))
    ap.add_argument("--segment", default="2gb", help="our store's DRAM segment")
    ap.add_argument("--mooncake-segment", default="4GB", help="mooncake_client --global_segment_size")
    ap.add_argument("--mooncake-local-buffer", type=int, default=256 << 20)
    ap.add_argument("--perftest-iters", type=int, default=128)
    ap.add_argument("--no-mooncake", action="store_true")
    ap.add_argument("--store-json", default="{}", help='more of our StoreConfig, e.g. \'{"elastic": {"keep_arena": false}}\'')
    ap.add_argument("--no-perftest", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "bench_transport.json"))
    ap.add_argument("--replot", metavar="JSON", help="only redraw the PNG of a results file")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), Path(args.replot).with_suffix(".png"))
        return

    names = sorted(n for _, n in socket.if_nameindex())
    if names != ["lo"]:
        sys.exit(f"run inside a private network namespace (interfaces: {names}): "
                 "make bench B=benchmarks/bench_transport.py")
    sizes = [int(s) for s in args.sizes.split(",")]
    if MIB4 not in sizes or 4096 not in sizes:
        sys.exit("sizes must include 4096 and 4194304 (the targets are stated there)")
    protocols = [p for p in args.protocols.split(",") if p]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run atexit: stop Mooncake's processes
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("GLOG_minloglevel", "1")  # Mooncake's in-process client: warnings and up
    rng = np.random.default_rng(0)

    # ---- Mooncake (optional peer)
    mc_peer = None
    mc_skip = None
    if args.no_mooncake:
        mc_skip = "--no-mooncake"
    else:
        try:
            import mooncake.store  # noqa: F401
        except ImportError as e:
            mc_skip = (f"mooncake not installed ({e}); install it with "
                       "`.venv/bin/pip install mooncake-transfer-engine-non-cuda`")
    if mc_skip is None:
        mc_peer = MooncakePeer(args.mooncake_segment, args.mooncake_local_buffer)
        atexit.register(mc_peer.stop)
        try:
            t = time.perf_counter()
            mc_peer.start()
            print(f"Mooncake up in {time.perf_counter() - t:.1f}s (logs {mc_peer.logdir})", flush=True)
            for c in mc_peer.commands:
                print(f"  $ {c.strip()}")
            t = time.perf_counter()
            seg = int(args.mooncake_segment.upper().replace("GB", "").strip()) << 30 \
                if args.mooncake_segment.upper().endswith("GB") else 4 << 30
            warm_pool(Mooncake(mc_peer.store), "mc", seg)
            print(f"Mooncake pool warmed in {time.perf_counter() - t:.1f}s", flush=True)
        except Exception as e:  # noqa: BLE001
            mc_skip = f"Mooncake failed to start: {e}"
            print(mc_peer.log_tail(), file=sys.stderr)
            mc_peer.stop()
            mc_peer = None
    if mc_skip:
        print(f"Mooncake peer skipped: {mc_skip}", flush=True)

    import ray

    import mooncake_ray
    from mooncake_ray.config import parse_size

    # A new local Ray of our own: ray.init() without an address attaches to whatever
    # cluster /tmp/ray/ray_current_cluster names (another user's, unreachable from this
    # namespace, on a shared /tmp) and then waits for its GCS forever.
    ray.init(address="local", include_dashboard=False, logging_level="WARNING", log_to_driver=False)

    git_start = git_state()
    phases: dict = {p: [] for p in protocols}
    load = [os.getloadavg()[0]]
    t_start = time.perf_counter()
    for r in range(args.rounds):
        for proto in protocols:
            ns = f"bench_transport_{proto}_{r}"
            t = time.perf_counter()
            store = mooncake_ray.start({"segment_size_bytes": args.segment, "namespace": ns,
                                        "transport": {"protocol": proto, "devices": ["lo"]},
                                        **json.loads(args.store_json)})
            t_up = time.perf_counter() - t
            peers = {"ours": Ours(store, f"ours_{proto}")}
            warm_pool(peers["ours"], f"warm/{proto}/{r}", parse_size(args.segment))
            if mc_peer:
                peers["mooncake"] = Mooncake(mc_peer.store)
            t = time.perf_counter()
            tls = None if args.no_perftest else TLS_OF.get(proto)
            phases[proto].append(phase(peers, tls, r, rng, sizes, args.small_repeats, args.batches,
                                       args.perftest_iters))
            phases[proto][-1]["ours_client_stats"] = dict(store.local_stats)  # early reads and drops
            mooncake_ray.shutdown(namespace=ns, stop_ray=False)
            load.append(os.getloadavg()[0])
            print(f"[round {r + 1}/{args.rounds}] {proto}: store up {t_up:.1f}s, phase {time.perf_counter() - t:.1f}s, "
                  f"load {load[-1]:.1f}", flush=True)
    ray.shutdown()
    if mc_peer:
        mc_peer.stop()

    def pooled(who, protos):
        return [rd[who] for p in protos for rd in phases[p] if who in rd]

    agg = {f"ours_{p}": aggregate(pooled("ours", [p])) for p in protocols}
    if mc_peer:
        agg["mooncake"] = aggregate(pooled("mooncake", protocols))  # every phase's runs
    peers_order = list(agg)
    perf = {}
    for p in protocols:
        pts = [pt for rd in phases[p] for pt in rd["perftest"]]
        if pts:
            perf[TLS_OF[p]] = {op: spread([pt[op] for pt in pts]) for op in pts[0]}
    tg = targets(phases, protocols)
    results = {
        "description": "mooncake_ray public API vs Mooncake Store remote mode vs ucx_perftest, one host, loopback",
        "host": host_info(),
        "rounds": args.rounds, "small_repeats": args.small_repeats, "batch": {"keys": BATCH, "size": BATCH_SIZE,
                                                                             "batches_per_run": args.batches},
        "sizes": sizes, "ops_per_run": {str(s): ops_per_run(s) for s in sizes},
        "throughput_definition": "bytes / sum of per-op times (verification outside the timed region)",
        "ours": {"segment": args.segment, "protocols": protocols, "git_at_start": git_start,
                 "git_at_end": git_state()},
        "mooncake": ({"skipped": mc_skip} if mc_skip else
                     {"version": _mooncake_version(), "segment": args.mooncake_segment,
                      "local_buffer_bytes": args.mooncake_local_buffer, "commands": [c.strip() for c in mc_peer.commands],
                      "client_setup": "MooncakeDistributedStore.setup('127.0.0.1', <metadata>, 0, local_buffer, "
                                      "'tcp', '', <master>)"}),
        "perftest": perf,
        "peers": agg, "targets": tg, "load_avg_1m": load, "wall_s": time.perf_counter() - t_start,
        "phases": phases,
    }
    print(f"\nhost: {host_label(results['host'], model=True)}")
    print_table(agg, peers_order)
    if mc_skip:
        print(f"\nMooncake peer skipped: {mc_skip}")
    print_targets(tg, perf)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    plot(results, out.with_suffix(".png"))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")


def _mooncake_version() -> str:
    try:
        from importlib.metadata import version

        return version("mooncake-transfer-engine-non-cuda")
    except Exception:  # noqa: BLE001
        return "?"


if __name__ == "__main__":
    main()
