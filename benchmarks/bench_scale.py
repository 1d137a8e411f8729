"""Metadata at scale: a million small values put and read back, ours against Mooncake Store.

Both systems are measured in the same invocation, one after the other.

Workload. ``--keys`` values of ``--value-bytes`` (each value is its key padded with ``#``,
so a read of the wrong value is caught) are put in batches of ``--batch`` into a store
whose memory is held by another process on the same host (``--arena`` of DRAM, no spill
tier), then every key is read back in batches of the same size. With ``--clients N``, N
processes put (then read) disjoint key ranges at once; with one, the writer is this
process. A run stops putting early, and says so, if the host's available memory falls
below ``--min-free``.

Sweep. ``--clients`` and ``--shards`` each take a comma-separated list (``1,2,4``): ours
runs once for every (clients, shards) pair, with that many master shards
(``{"master": {"shards": N}}``: N master actors, each owning the keys that hash to it and
1/N of the arena); Mooncake has one master, so it runs once per clients value (recorded
as shards = 1), and each of ours is compared with Mooncake at the same clients count.

Shapes. Both systems get the same arena, batch size, keys and values, through their bytes
API, with their default settings otherwise:

- mooncake-ray: a Ray instance started by the script (no dashboard), the store deployed on
  it with ``mooncake_ray.start`` (``--shards`` master actors, one store node actor holding
  the arena); clients call ``batch_put`` / ``batch_get`` (which split a batch by shard and
  run the parts at once).
- mooncake: ``mooncake_master`` (pip package ``mooncake-transfer-engine-non-cuda``) and a
  ``mooncake_client`` process holding the segment (Mooncake's shape for a store process of
  its own); clients are client-only ``MooncakeDistributedStore`` instances (no segment of
  their own, P2P handshake, TCP on loopback) calling ``put_batch`` / ``get_batch``. That
  call returns one code per batch: a batch with an error counts all its keys as failed
  (what was really kept is counted by reading back).

Each system is started from scratch for each run and stopped after it, so two never run
at once; with ``--repeats`` the order of the systems alternates.

What is reported, per system and (clients, shards):

- put and get keys/s: keys over the time during which at least one client was inside a
  batch call (for one client, the sum of its call durations: building keys and values and
  checking what was read are not counted);
- the put rate over the run: the same measure for each tenth of the keys (and up to 50
  windows for the plot), which shows eviction and index growth slowing puts down;
- values kept: values read back intact at the end over keys put;
- the master's processes (ours: every master shard's actor worker process, its pid asked
  of the actor, summed over the shards as role ``master`` and also each alone as
  ``shard0``, ``shard1``, ... when there are several; Mooncake: ``mooncake_master``):
  resident memory before the puts, after them and after the reads; its growth over the
  keys the masters hold after the puts ("bytes per live key") and over the keys put (the
  two differ when values were evicted: memory a process freed is not necessarily given
  back to the system); their CPU seconds (utime + stime from ``/proc/<pid>/stat``) per
  key put and per key read; the same for the store process and the clients, to show
  where the CPU goes on a small host (a client of ours maps the store's arena and counts
  the pages it wrote, ``rss_shmem``); a sample of the masters' and store's memory every
  half second;
- the master's own counters (ours: summed over the shards): live keys, arena bytes in
  use, evictions;
- the projected master capacity: ``master_put_capacity_keys_per_s = shards * 1e6 /
  master_cpu_us_per_put`` (and the same for reads), where the CPU per key is summed over
  every master shard. It is a projection, not a measurement: on a small host (2 vCPUs)
  the clients, the store and the masters share the cores, so measured keys/s cannot show
  what more shards would give; the projection says how many keys/s the masters' own CPU
  cost would allow with a core for each shard (keys spread evenly over the shards by
  hash; nothing else limiting). For Mooncake (one master) it is ``1e6 / CPU us per key``:
  what one core of its master allows.

Medians and min-max over repeats; the summary prints the ratio ours/Mooncake of the
medians (at the same clients count). With one (clients, shards) pair it prints every
figure; with a sweep, a table of one row per system and pair.

    make bench B=benchmarks/bench_scale.py ARGS="--quick"          # 100k x 256 B, about a minute
    make bench B=benchmarks/bench_scale.py                         # 1M x 256 B
    make bench B=benchmarks/bench_scale.py ARGS="--keys 10000000 --value-bytes 256,16k"
    make bench B=benchmarks/bench_scale.py ARGS="--keys 200000 --clients 1,2,4 --shards 1,2,4 --systems mooncake-ray,mooncake"

Run it inside a private network namespace (``make bench`` does): Ray and Mooncake listen on
every interface. Writes benchmarks/results/bench_scale.json and bench_scale.png; with more
than one clients value or shards other than 1, bench_scale_shards.json and .png
(``--out`` names another file; the plot is saved beside it, as ``.png``). With more than
one (clients, shards) pair the figure has a third row: put and get keys/s and the
projected master capacity against shards, a line per clients value (Mooncake's as dashed
horizontal lines).
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
import uuid
from pathlib import Path

from _common import RESULTS, Processes, free_port, host_info, host_label, spread, versions, wait_port

OURS, MOONCAKE = "mooncake-ray", "mooncake"
SYSTEMS = (OURS, MOONCAKE)
CLK_TCK = os.sysconf("SC_CLK_TCK")
CURVE_POINTS = 50  # windows of the put-rate curve (at least 5 batches each)
SAMPLE_S = 0.5
MEM_CHECK_BATCHES = 16


# ============================================================== processes, memory ==

def proc_sample(pid: int | tuple) -> dict:
    """Resident, peak resident, anonymous and shared-memory resident bytes, and CPU seconds
    (user + system, all threads) of one process, or summed over a tuple of processes (a
    role of several, such as every master shard). A process that maps another's shared
    memory and touches it counts those pages too (``rss_shmem``)."""
    if isinstance(pid, tuple):
        parts = [proc_sample(p) for p in pid]
        return {k: sum(p[k] for p in parts) for k in parts[0]}
    mem = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "VmHWM", "RssAnon", "RssShmem"):
            mem[name] = int(rest.split()[0]) * 1024
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # fields from the third (state) on
    return {"rss": mem["VmRSS"], "hwm": mem["VmHWM"], "rss_anon": mem["RssAnon"], "rss_shmem": mem["RssShmem"],
            "cpu_s": (int(fields[11]) + int(fields[12])) / CLK_TCK}


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 1 << 62


def own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class Sampler:
    """Memory and CPU of the named processes (or tuples of processes, summed) every
    ``SAMPLE_S`` seconds, on a thread."""

    def __init__(self, pids: dict[str, int | tuple]):
        self.pids, self.rows, self.phase = pids, [], "idle"
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            row = {"t": round(time.monotonic() - self._t0, 3), "phase": self.phase}
            for role, pid in self.pids.items():
                try:
                    s = proc_sample(pid)
                except OSError:
                    continue
                row[f"{role}_rss"], row[f"{role}_cpu_s"] = s["rss"], s["cpu_s"]
            self.rows.append(row)

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        return self.rows


# ======================================================================= workload ==

def key_of(i: int) -> str:
    return f"scale/{i:012d}"


def value_of(key: str, size: int) -> bytes:
    return key.encode().ljust(size, b"#")


def put_phase(client, lo: int, hi: int, batch: int, size: int, min_free: int) -> dict:
    """Put keys ``lo..hi`` in batches; the interval of every call, the failures."""
    marks, failed, first_error, stopped = [], 0, None, None
    cpu0 = own_cpu_s()
    for b, start in enumerate(range(lo, hi, batch)):
        if b % MEM_CHECK_BATCHES == 0 and mem_available() < min_free:
            stopped = f"available memory below {min_free >> 20} MiB after {start - lo} keys"
            break
        keys = [key_of(i) for i in range(start, min(hi, start + batch))]
        values = [value_of(k, size) for k in keys]
        t0 = time.monotonic()
        try:
            n_failed, err = client.put(keys, values)
        except Exception as e:  # noqa: BLE001 - a failed batch is a result
            n_failed, err = len(keys), repr(e)
        marks.append((t0, time.monotonic(), len(keys)))
        failed += n_failed
        if err and first_error is None:
            first_error = f"keys {start}..: {err}"
    put = sum(m[2] for m in marks)
    return {"marks": marks, "keys": put, "next": lo + put, "failed": failed, "first_error": first_error,
            "stopped": stopped, "cpu_s": own_cpu_s() - cpu0}


def get_phase(client, lo: int, hi: int, batch: int, size: int) -> dict:
    """Read keys ``lo..hi`` back in batches and check every value (outside the timing)."""
    marks, kept, missing, wrong, errors, first_error = [], 0, 0, 0, 0, None
    cpu0 = own_cpu_s()
    for start in range(lo, hi, batch):
        keys = [key_of(i) for i in range(start, min(hi, start + batch))]
        t0 = time.monotonic()
        try:
            values = client.get(keys)
        except Exception as e:  # noqa: BLE001
            values = [e] * len(keys)
        marks.append((t0, time.monotonic(), len(keys)))
        for k, v in zip(keys, values):
            if isinstance(v, BaseException):
                errors += 1
                first_error = first_error or f"{k}: {v!r}"
            elif not v:
                missing += 1
            elif v == value_of(k, size):
                kept += 1
            else:
                wrong += 1
    return {"marks": marks, "keys": hi - lo, "kept": kept, "missing": missing, "wrong": wrong,
            "errors": errors, "first_error": first_error, "cpu_s": own_cpu_s() - cpu0}


def busy_rate(marks: list, points: int) -> tuple[float, list, list]:
    """Keys/s over the time at least one call was in flight, overall and for ``points``
    equal shares of the keys (in order of completion); with the wall-clock seconds at
    which each share ended."""
    if not marks:
        return float("nan"), [], []
    spans = sorted((a, b) for a, b, _n in marks)
    union = [list(spans[0])]
    for a, b in spans[1:]:
        if a <= union[-1][1]:
            union[-1][1] = max(union[-1][1], b)
        else:
            union.append([a, b])

    def busy(x: float, y: float) -> float:
        return sum(max(0.0, min(b, y) - max(a, x)) for a, b in union)

    done = sorted((b, n) for _a, b, n in marks)
    total, t0 = sum(n for _b, n in done), union[0][0]
    rates, ends, cum, prev_t, prev_k, j = [], [], 0, t0, 0, 1
    for t, n in done:
        cum += n
        crossed = 0
        while j + crossed <= points and cum >= total * (j + crossed) / points:
            crossed += 1
        if crossed:  # a batch larger than a share completes several at once: same rate
            dt = busy(prev_t, t)
            rates += [(cum - prev_k) / dt if dt > 0 else float("nan")] * crossed
            ends += [t - t0] * crossed
            prev_t, prev_k, j = t, cum, j + crossed
    return total / busy(t0, union[-1][1]), rates, ends


def call_ms(marks: list) -> dict | None:
    """Percentiles of the batch calls' durations, in milliseconds."""
    ms = sorted(1e3 * (b - a) for a, b, _n in marks)
    if not ms:
        return None
    pick = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": ms[-1], "n": len(ms)}


# ======================================================================== systems ==

class OursClient:
    def __init__(self, client):
        self.c = client

    def put(self, keys, values) -> tuple[int, str | None]:
        res = self.c.batch_put(keys, values)
        errs = [r for r in res if r is not None]
        return len(errs), (repr(errs[0]) if errs else None)

    def get(self, keys) -> list:
        return self.c.batch_get(keys)

    def close(self) -> None:
        self.c.close()


class MooncakeClient:
    """A client-only ``MooncakeDistributedStore`` (no segment of its own)."""

    def __init__(self, master: str, local_buffer: int):
        from mooncake.store import MooncakeDistributedStore

        self.s = MooncakeDistributedStore()
        rc = self.s.setup("127.0.0.1", "P2PHANDSHAKE", 0, local_buffer, "tcp", "", master)
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")

    def put(self, keys, values) -> tuple[int, str | None]:
        rc = self.s.put_batch(keys, values)
        return (0, None) if rc == 0 else (len(keys), f"put_batch returned {rc}")

    def get(self, keys) -> list:
        return self.s.get_batch(keys)

    def close(self) -> None:
        self.s.close()


def open_client(system: str, info: dict):
    """A client of a running store from its connection ``info`` (in any process)."""
    if system == MOONCAKE:
        return MooncakeClient(info["master"], info["local_buffer"])
    import logging

    import ray

    import mooncake_ray

    ray.init(address=info["gcs"], logging_level=logging.WARNING, log_to_driver=False)
    return OursClient(mooncake_ray.connect(info["namespace"],
                                           {"client": {"local_buffer_size_bytes": info["local_buffer"]}}))


class Ours:
    """Ray started here, the store deployed on it: ``a.shards`` master actors, one store
    node actor."""

    name = OURS

    def __init__(self, a, size: int, log_dir: Path):
        self.a, self.local_buffer = a, local_buffer(a, size)
        self.ns = f"scale{uuid.uuid4().hex[:8]}"

    def start(self) -> None:
        import logging

        import ray

        import mooncake_ray
        from mooncake_ray._private.naming import master_name, store_actor_name

        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ctx = ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING,
                       log_to_driver=False, object_store_memory=256 << 20)
        n = self.a.shards
        self.client = mooncake_ray.start({
            "namespace": self.ns, "segment_size_bytes": self.a.arena, "transport": {"devices": ["lo"]},
            "master": {"shards": n}, "spill": {"enabled": False},
            "client": {"local_buffer_size_bytes": self.local_buffer}, **json.loads(self.a.store_json)})
        self.masters = [ray.get_actor(master_name(i), namespace=self.ns) for i in range(n)]
        nodes = list(self._stats(60)["nodes"])
        store = ray.get_actor(store_actor_name(nodes[0]), namespace=self.ns)
        shard_pids = ray.get([m.pid.remote() for m in self.masters], timeout=60)
        # "master": every shard's process, summed (one shard: that process alone, as before)
        self.pids = {"master": shard_pids[0] if n == 1 else tuple(shard_pids),
                     **({f"shard{i}": pid for i, pid in enumerate(shard_pids)} if n > 1 else {}),
                     "store": ray.get(store.pid.remote())}
        self.info = {"gcs": ctx.address_info["gcs_address"], "namespace": self.ns,
                     "local_buffer": self.local_buffer}
        self.shape = {"master": "Ray actor process (MasterActor)" + (f", {n} shards" if n > 1 else ""),
                      "master_shards": n, "store": "Ray actor process (StoreNodeActor)",
                      "client_api": "Client.batch_put / batch_get (bytes)", "store_nodes": len(nodes),
                      "config": ray.get(self.masters[0].config.remote())}

    def local_client(self):
        return OursClient(self.client)

    def _stats(self, timeout: float) -> dict:
        """The masters' statistics, summed over the shards."""
        import ray

        from mooncake_ray._private.shards import merge_stats

        return merge_stats(ray.get([m.stats.remote() for m in self.masters], timeout=timeout))

    def counters(self) -> dict:
        st = self._stats(120)
        return {"live_keys": st["keys"], "arena_used_bytes": st["used"], "arena_capacity_bytes": st["capacity"],
                "evictions": st["evictions"], "slab_bytes": st.get("slab_bytes"), "pending": st.get("pending"),
                "master_shards": st["master_shards"],
                **({"shards_live_keys": [x["keys"] for x in st["shards"]]} if "shards" in st else {})}

    def stop(self) -> None:
        import ray

        import mooncake_ray

        if ray.is_initialized():
            mooncake_ray.shutdown(self.ns, stop_ray=True)


class Mooncake:
    """``mooncake_master`` and a ``mooncake_client`` holding the segment, started here."""

    name = MOONCAKE

    def __init__(self, a, size: int, log_dir: Path):
        self.a, self.local_buffer, self.log_dir = a, local_buffer(a, size), log_dir
        self.procs = Processes(log_dir)
        self.client = None

    def start(self) -> None:
        bin_dir = Path(sys.executable).parent
        if not (bin_dir / "mooncake_master").exists():
            raise FileNotFoundError("mooncake_master: pip package mooncake-transfer-engine-non-cuda is not installed")
        rpc, self.metrics_port, svc = free_port(), free_port(), free_port()
        master, log = self.procs.start("mooncake_master", [
            str(bin_dir / "mooncake_master"), f"-rpc_port={rpc}", "-rpc_address=127.0.0.1",
            "-enable_http_metadata_server=false", "-metrics_host=127.0.0.1", f"-metrics_port={self.metrics_port}",
            "-logtostderr"])
        wait_port(rpc, proc=master, log=log)
        self.master_addr = f"127.0.0.1:{rpc}"
        store, log = self.procs.start("mooncake_client", [
            str(bin_dir / "mooncake_client"), "-host=127.0.0.1", f"-port={svc}",
            f"-global_segment_size={self.a.arena}", f"-master_server_address={self.master_addr}",
            "-metadata_server=P2PHANDSHAKE", "-protocol=tcp", "-logtostderr"])
        wait_port(svc, timeout_s=60, proc=store, log=log)
        self.client = MooncakeClient(self.master_addr, self.local_buffer)
        deadline = time.monotonic() + 60
        while self.client.s.put("scale/probe", b"p" * 64) != 0:  # until the segment is mounted
            if time.monotonic() > deadline or store.poll() is not None:
                raise RuntimeError(f"the Mooncake store never took a put; logs in {self.log_dir}")
            time.sleep(0.5)
        self.client.s.remove("scale/probe", True)
        self.pids = {"master": master.pid, "store": store.pid}
        self.info = {"master": self.master_addr, "local_buffer": self.local_buffer}
        self.shape = {"master": "mooncake_master", "store": "mooncake_client process holding the segment",
                      "client_api": "MooncakeDistributedStore.put_batch / get_batch (bytes), client-only, "
                                    "P2PHANDSHAKE, tcp", "segment_bytes": self.a.arena}

    def local_client(self):
        return self.client

    def counters(self) -> dict:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=30).read().decode()
        m = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, _, value = line.rpartition(" ")
                m[name] = float(value)
        get = lambda k: int(m[k]) if k in m else None  # noqa: E731
        return {"live_keys": get("master_key_count"), "arena_used_bytes": get("master_allocated_bytes"),
                "arena_capacity_bytes": get("master_total_capacity_bytes"),
                "evictions": get("master_evicted_key_count")}

    def stop(self) -> None:
        if self.client is not None:
            try:
                self.client.close()  # before its master goes: a client without one waits to time out
            except Exception as e:  # noqa: BLE001
                print(f"mooncake client close: {e!r}", file=sys.stderr)
            self.client = None
        self.procs.stop_all()  # only the processes started here, by pid


def local_buffer(a, size: int) -> int:
    """The bytes API's staging buffer: room for two batches, at least 64 MiB, for both."""
    return max(64 << 20, 2 * a.batch * size)


# ======================================================================== clients ==

def _client_process(system: str, info: dict, lo: int, hi: int, batch: int, size: int, min_free: int,
                    conn) -> None:
    """One spawned client: connect, say ready, then put and read its range when told."""
    client = None
    try:
        client = open_client(system, info)
        conn.send(("ready", None))
        conn.recv()
        put = put_phase(client, lo, hi, batch, size, min_free)
        conn.send(("put", put))
        conn.recv()
        conn.send(("get", get_phase(client, lo, put["next"], batch, size)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the run
        conn.send(("error", traceback.format_exc()))
    finally:
        if client is not None:
            client.close()


class Writers:
    """The clients of one run: this process's own client when there is one, else
    ``--clients`` spawned processes on disjoint key ranges, each phase started in all of
    them at once (after every one has connected)."""

    def __init__(self, system, a, size: int):
        self.a, self.size, n = a, size, a.clients
        self.ranges = [(a.keys * c // n, a.keys * (c + 1) // n) for c in range(n)]
        self.procs, self.conns, self.local = [], [], None
        if n == 1:
            self.local = system.local_client()
            return
        ctx = multiprocessing.get_context("spawn")
        try:
            for lo, hi in self.ranges:
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_client_process, name=f"client-{lo}",
                                args=(system.name, system.info, lo, hi, a.batch, size, a.min_free, child))
                p.start()
                self.procs.append(p)
                self.conns.append(parent)
            self._gather("ready")
        except BaseException:
            self.close()
            raise

    def pids(self) -> dict[str, int]:
        if self.local is not None:
            return {"client": os.getpid()}
        return {f"client{i}": p.pid for i, p in enumerate(self.procs)}

    def put(self) -> list[dict]:
        if self.local is not None:
            lo, hi = self.ranges[0]
            return [put_phase(self.local, lo, hi, self.a.batch, self.size, self.a.min_free)]
        for c in self.conns:
            c.send("put")
        return self._gather("put")

    def get(self, puts: list[dict]) -> list[dict]:
        if self.local is not None:
            return [get_phase(self.local, self.ranges[0][0], puts[0]["next"], self.a.batch, self.size)]
        for c in self.conns:
            c.send("get")
        return self._gather("get")

    def _gather(self, tag: str) -> list:
        out = []
        for i, c in enumerate(self.conns):
            if not c.poll(self.a.phase_timeout_s):
                raise TimeoutError(f"client {i}: no '{tag}' within {self.a.phase_timeout_s} s")
            got, payload = c.recv()
            if got == "error":
                raise RuntimeError(f"client {i} failed:\n{payload}")
            out.append(payload)
        return out

    def close(self) -> None:
        for p in self.procs:  # only the processes started here
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()


# ============================================================================ run ==

def run_one(cls, a, size: int, rep: int, log_dir: Path) -> dict:
    """One system, started from scratch: put every key, read every key back, stop it."""
    system = cls(a, size, log_dir)
    out = {"system": cls.name, "value_bytes": size, "repeat": rep, "clients": a.clients, "shards": a.shards}
    writers = sampler = None
    try:
        t = time.perf_counter()
        system.start()
        writers = Writers(system, a, size)
        out["setup_s"] = time.perf_counter() - t
        out["shape"] = system.shape
        pids = {**system.pids, **writers.pids()}
        out["pids"] = pids
        meter = {"before": {r: proc_sample(p) for r, p in pids.items()}}
        out["counters_before"] = system.counters()
        sampler = Sampler(system.pids)
        sampler.phase = "put"
        puts = writers.put()
        meter["after_put"] = {r: proc_sample(p) for r, p in pids.items()}
        out["counters_after_put"] = system.counters()
        sampler.phase = "get"
        gets = writers.get(puts)
        meter["after_get"] = {r: proc_sample(p) for r, p in pids.items()}
        out["counters_after_get"] = system.counters()
        out.update(measures(puts, gets, meter, out["counters_after_put"], out["counters_before"], a.shards))
    finally:
        if sampler is not None:
            out["samples"] = sampler.stop()
        if writers is not None:
            writers.close()
        system.stop()
    return out


def measures(puts: list, gets: list, meter: dict, live: dict, start: dict, shards: int) -> dict:
    """The figures of one run from the clients' call intervals and the process meters
    (role ``master`` is every master process, summed; ``shard<i>`` one shard's alone)."""
    keys_put = sum(p["keys"] for p in puts)
    keys_read = sum(g["keys"] for g in gets)
    put_rate, tenths, _ = busy_rate([m for p in puts for m in p["marks"]], 10)
    n_batches = sum(len(p["marks"]) for p in puts)
    _, curve, ends = busy_rate([m for p in puts for m in p["marks"]], max(1, min(CURVE_POINTS, n_batches // 5)))
    get_rate, _, _ = busy_rate([m for g in gets for m in g["marks"]], 10)
    kept = sum(g["kept"] for g in gets)
    live_keys = max(1, (live["live_keys"] or 0) - (start["live_keys"] or 0))
    procs = {}
    for role in meter["before"]:
        b, p, g = (meter[k][role] for k in ("before", "after_put", "after_get"))
        procs[role] = {"rss_before": b["rss"], "rss_after_put": p["rss"], "rss_after_get": g["rss"],
                       "rss_anon_before": b["rss_anon"], "rss_anon_after_put": p["rss_anon"],
                       "rss_shmem_after_put": p["rss_shmem"], "hwm": g["hwm"],
                       "cpu_put_s": p["cpu_s"] - b["cpu_s"], "cpu_get_s": g["cpu_s"] - p["cpu_s"]}
    cpu = lambda role_prefix, phase: sum(v[f"cpu_{phase}_s"] for r, v in procs.items()  # noqa: E731
                                         if r.startswith(role_prefix))
    master = procs["master"]
    metrics = {
        "keys_put": keys_put, "put_failed": sum(p["failed"] for p in puts),
        "put_keys_per_s": put_rate, "get_keys_per_s": get_rate,
        "put_first_tenth_keys_per_s": tenths[0] if tenths else None,
        "put_last_tenth_keys_per_s": tenths[-1] if tenths else None,
        "kept": kept, "kept_fraction": kept / keys_put if keys_put else None,
        "live_keys_after_put": live["live_keys"],
        "master_bytes_per_live_key": (master["rss_after_put"] - master["rss_before"]) / live_keys,
        "master_anon_bytes_per_live_key": (master["rss_anon_after_put"] - master["rss_anon_before"]) / live_keys,
        "master_bytes_per_key_put": (master["rss_after_put"] - master["rss_before"]) / max(1, keys_put),
        "master_rss_after_put_mib": master["rss_after_put"] / 2**20,
        "arena_bytes_per_live_key": (live["arena_used_bytes"] or 0) / live_keys,
    }
    for role in ("master", "store", "client"):
        metrics[f"{role}_cpu_us_per_put"] = 1e6 * cpu(role, "put") / max(1, keys_put)
        metrics[f"{role}_cpu_us_per_get"] = 1e6 * cpu(role, "get") / max(1, keys_read)
    for op in ("put", "get"):  # a projection: a core for each shard (module docstring)
        us = metrics[f"master_cpu_us_per_{op}"]
        metrics[f"master_{op}_capacity_keys_per_s"] = shards * 1e6 / us if us > 0 else None
    return {
        "metrics": metrics,
        "put": {"rate_by_tenth": tenths, "curve_keys_per_s": curve, "curve_end_s": ends,
                "failed": metrics["put_failed"], "first_error": next((p["first_error"] for p in puts
                                                                      if p["first_error"]), None),
                "stopped": [p["stopped"] for p in puts if p["stopped"]],
                "seconds_in_calls": [sum(b - a for a, b, _n in p["marks"]) for p in puts],
                "batch_ms": call_ms([m for p in puts for m in p["marks"]])},
        "get": {k: sum(g[k] for g in gets) for k in ("keys", "kept", "missing", "wrong", "errors")}
        | {"first_error": next((g["first_error"] for g in gets if g["first_error"]), None),
           "seconds_in_calls": [sum(b - a for a, b, _n in g["marks"]) for g in gets],
           "batch_ms": call_ms([m for g in gets for m in g["marks"]])},
        "processes": procs,
    }


# ======================================================================== summary ==

LABELS = {
    "put_keys_per_s": "put keys/s",
    "put_first_tenth_keys_per_s": "put keys/s, first tenth",
    "put_last_tenth_keys_per_s": "put keys/s, last tenth",
    "get_keys_per_s": "get keys/s",
    "kept": "values kept",
    "kept_fraction": "values kept / keys put",
    "live_keys_after_put": "keys the master holds after the puts",
    "master_bytes_per_live_key": "master RSS growth per live key (B)",
    "master_bytes_per_key_put": "master RSS growth per key put (B)",
    "master_rss_after_put_mib": "master RSS after the puts (MiB)",
    "arena_bytes_per_live_key": "arena bytes in use per live key",
    "master_cpu_us_per_put": "master CPU us per key put",
    "master_cpu_us_per_get": "master CPU us per key read",
    "master_put_capacity_keys_per_s": "projected master put keys/s, core/shard",
    "master_get_capacity_keys_per_s": "projected master get keys/s, core/shard",
    "store_cpu_us_per_put": "store process CPU us per key put",
    "store_cpu_us_per_get": "store process CPU us per key read",
    "client_cpu_us_per_put": "client CPU us per key put",
    "client_cpu_us_per_get": "client CPU us per key read",
    "put_failed": "keys whose put failed",
}
# the sweep's table: a column per metric (median), then ours/Mooncake for some of them
SWEEP = {"put_keys_per_s": "put/s", "get_keys_per_s": "get/s", "kept_fraction": "kept",
         "master_cpu_us_per_put": "us/put", "master_cpu_us_per_get": "us/get",
         "master_put_capacity_keys_per_s": "cap put/s", "master_get_capacity_keys_per_s": "cap get/s"}
SWEEP_RATIOS = ("put_keys_per_s", "get_keys_per_s", "master_put_capacity_keys_per_s",
                "master_get_capacity_keys_per_s")


def case_key(clients: int, shards: int) -> str:
    return f"clients={clients} shards={shards}"


def case_of(key: str) -> tuple[int, int]:
    """``(clients, shards)`` of a ``case_key``."""
    clients, shards = (int(part.partition("=")[2]) for part in key.split())
    return clients, shards


def summarize(runs: list[dict]) -> tuple[dict, dict]:
    """Per value size, (clients, shards) case (``case_key``) and system, the spread of each
    metric over repeats; and per value size and case of ours, the ratio ours/Mooncake of
    the medians, Mooncake's at the same clients count (it always runs with one shard)."""
    table: dict = {}
    for r in runs:
        if "metrics" in r:
            table.setdefault(str(r["value_bytes"]), {}).setdefault((r["clients"], r["shards"]), {}) \
                .setdefault(r["system"], []).append(r["metrics"])
    summary = {size: {case_key(*case): {sys_: {m: spread([x.get(m) for x in rows], keep=True) for m in LABELS}
                                        for sys_, rows in by_case[case].items()}
                      for case in sorted(by_case)} for size, by_case in table.items()}
    ratios: dict = {}
    for size, by_case in summary.items():
        for case, by_sys in by_case.items():
            peer = mooncake_at(by_case, case_of(case)[0])
            if OURS in by_sys and peer:
                ratios.setdefault(size, {})[case] = {m: _ratio(by_sys[OURS][m], peer[m]) for m in LABELS}
    return summary, ratios


def mooncake_at(by_case: dict, clients: int) -> dict | None:
    """Mooncake's figures at ``clients`` (one master: shards = 1) in a size's summary."""
    return by_case.get(case_key(clients, 1), {}).get(MOONCAKE)


def _ratio(a, b):
    if not a or not b or not b["median"]:
        return None
    return a["median"] / b["median"]


def print_summary(summary: dict, ratios: dict) -> None:
    """One (clients, shards) case per size: every figure; several: the sweep's table."""
    for size, by_case in summary.items():
        if len(by_case) == 1:
            (case, by_sys), = by_case.items()
            print(f"\n{size} B values, {case}: median (min-max) over repeats")
            print(f"  {'':40} {'mooncake-ray':>22} {'mooncake':>22} {'ours/mooncake':>14}")
            for m, label in LABELS.items():
                cells = []
                for s in SYSTEMS:
                    v = by_sys.get(s, {}).get(m)
                    cells.append(f"{_fmt(v['median'])} ({_fmt(v['min'])}-{_fmt(v['max'])})" if v else "-")
                r = ratios.get(size, {}).get(case, {}).get(m)
                print(f"  {label:40} {cells[0]:>22} {cells[1]:>22} {'' if r is None else f'{r:.2f}':>14}")
            continue
        print(f"\n{size} B values: medians over repeats; us = master CPU per key (all shards); cap = projected "
              f"master keys/s with a core per shard (shards x 1e6 / us); x = ours / mooncake at the same clients")
        print(f"  {'system':13} {'clients':>7} {'shards':>6} " + " ".join(f"{h:>9}" for h in SWEEP.values())
              + " " + " ".join(f"{'x ' + SWEEP[m]:>11}" for m in SWEEP_RATIOS))
        for case, by_sys in by_case.items():
            clients, shards = case_of(case)
            for s in SYSTEMS:
                if s not in by_sys:
                    continue
                cells = [_fmt(v["median"]) if (v := by_sys[s][m]) else "-" for m in SWEEP]
                r = ratios.get(size, {}).get(case, {}) if s == OURS else {}
                print(f"  {s:13} {clients:>7} {shards:>6} " + " ".join(f"{c:>9}" for c in cells) + " "
                      + " ".join(f"{'' if r.get(m) is None else f'{r[m]:.2f}':>11}" for m in SWEEP_RATIOS))


def _fmt(x: float) -> str:
    if x is None:
        return "-"
    if abs(x) >= 1e6:
        return f"{x / 1e6:.2f}M"
    if abs(x) >= 1e4:
        return f"{x / 1e3:.1f}k"
    return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


def _series(runs: list[dict]) -> list[tuple[str, int]]:
    """The (system, shards) pairs the runs hold, ours first: a colour each in the plot."""
    return sorted({(r["system"], r["shards"]) for r in runs}, key=lambda x: (SYSTEMS.index(x[0]), x[1]))


def _series_label(series: list, system: str, shards: int) -> str:
    alone = sum(s == system for s, _n in series) == 1
    return system if alone else f"{system}, {shards} shard{'s' if shards > 1 else ''}"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in res["runs"] if "metrics" in r]
    series = _series(runs)
    sizes = list(res["summary"])
    clients = sorted({r["clients"] for r in runs})
    shards = sorted({r["shards"] for r in runs if r["system"] == OURS})
    sweep = any(len(by_case) > 1 for by_case in res["summary"].values())
    fig, ax = plt.subplots(3 if sweep else 2, 3, figsize=(16, 12.5 if sweep else 8.5))
    styles = ["-", "--", ":", "-."]
    for r in runs:
        if r["repeat"] != 0:
            continue
        k = series.index((r["system"], r["shards"]))
        ls = styles[(sizes.index(str(r["value_bytes"])) * len(clients) + clients.index(r["clients"])) % len(styles)]
        label = (_series_label(series, r["system"], r["shards"])
                 + (f", {r['clients']} cl." if len(clients) > 1 else "") + f" {r['value_bytes']} B")
        ax[0, 0].plot(r["put"]["curve_end_s"], [x / 1e3 for x in r["put"]["curve_keys_per_s"]], ls,
                      color=f"C{k}", label=label)
        samples = [s for s in r.get("samples", []) if "master_rss" in s]
        ax[1, 2].plot([s["t"] for s in samples], [s["master_rss"] / 2**20 for s in samples], ls,
                      color=f"C{k}", label=label)
    ax[0, 0].set(xlabel="seconds into the puts", ylabel="put k keys/s", title="put rate over the run")
    ax[1, 2].set(xlabel="seconds since the puts began", ylabel="MiB",
                 title="master resident memory, all shards (puts, then reads)")
    bars = functools.partial(_bars, summary=res["summary"], series=series, clients=clients)
    bars(ax[0, 1], ["put_keys_per_s", "get_keys_per_s"], ["put", "get"], 1e-3, "k keys/s")
    bars(ax[0, 2], ["kept_fraction"], ["kept"], 1, "values kept / keys put")
    bars(ax[1, 0], ["master_bytes_per_live_key", "arena_bytes_per_live_key"], ["master RSS", "arena"], 1,
         "bytes per live key")
    bars(ax[1, 1], ["master_cpu_us_per_put", "master_cpu_us_per_get", "store_cpu_us_per_put",
                    "client_cpu_us_per_put"],
         ["master put", "master get", "store put", "client put"], 1, "CPU us per key (master: all shards)")
    if sweep:
        _sweep(ax[2, 0], res["summary"], clients, shards, {"put_keys_per_s": "put"}, "measured put keys/s")
        _sweep(ax[2, 1], res["summary"], clients, shards, {"get_keys_per_s": "get"}, "measured get keys/s")
        _sweep(ax[2, 2], res["summary"], clients, shards,
               {"master_put_capacity_keys_per_s": "put", "master_get_capacity_keys_per_s": "get"},
               "projected master keys/s with a core per shard\n(shards x 1e6 / master CPU us per key, all shards)")
    for a in ax.flat:
        a.grid(alpha=0.3)
        if n := len(a.get_legend_handles_labels()[0]):
            a.legend(fontsize=7 if n <= 6 else 6, ncol=1 if n <= 6 else 2)
    p = res["params"]
    if sweep:
        cases = f"clients {','.join(map(str, clients))} x shards {','.join(map(str, shards))} (mooncake: one master)"
    else:
        cases = f"{clients[0]} client(s)" + (f", {shards[0]} master shards" if shards and shards[0] > 1 else "")
    fig.suptitle(f"{p['keys']:,} keys in batches of {p['batch']}, {p['arena'] / 2**30:g} GiB arena, no spill, "
                 f"{cases}, one host ({host_label(res.get('host'))}); medians, bars min-max over {p['repeats']} "
                 "repeat(s)")
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=110)


def _bars(ax, metrics: list, names: list, scale: float, ylabel: str, *, summary: dict, series: list,
          clients: list) -> None:
    """A group of bars per value size, clients count and metric; a bar per (system, shards)."""
    groups = [(size, c, m, n) for size in summary for c in clients for m, n in zip(metrics, names)]
    width = 0.76 / len(series)
    for k, (s, shards) in enumerate(series):
        xs, ys, lo, hi = [], [], [], []
        for i, (size, c, m, _n) in enumerate(groups):
            v = summary[size].get(case_key(c, shards), {}).get(s, {}).get(m)
            if v:
                xs.append(i + (k - (len(series) - 1) / 2) * width)
                ys.append(v["median"] * scale)
                lo.append((v["median"] - v["min"]) * scale)
                hi.append((v["max"] - v["median"]) * scale)
        ax.bar(xs, ys, width, yerr=[lo, hi], label=_series_label(series, s, shards), color=f"C{k}", capsize=3)
        for x, y in zip(xs, ys):
            ax.text(x, y, _fmt(y), ha="center", va="bottom", fontsize=7 if len(series) <= 2 else 5)
    ax.set_xticks(range(len(groups)), ["\n".join([n] + ([f"{size} B"] if len(summary) > 1 else [])
                                                 + ([f"{c} cl."] if len(clients) > 1 else []))
                                       for size, c, _m, n in groups], fontsize=8 if len(groups) <= 6 else 6.5)
    ax.set_ylabel(ylabel)


def _sweep(ax, summary: dict, clients: list, shards: list, metrics: dict, title: str) -> None:
    """Ours against shards, a line per clients count (a colour), metric (solid, dotted)
    and value size (a marker); Mooncake (one master) a dashed line at its figure."""
    markers = ["o", "s", "^", "D"]
    for j, size in enumerate(summary):
        for i, c in enumerate(clients):
            for k, (m, what) in enumerate(metrics.items()):
                label = (f"{what + ', ' if len(metrics) > 1 else ''}{c} client{'s' if c > 1 else ''}"
                         + (f", {size} B" if len(summary) > 1 else ""))
                pts = [(n, v) for n in shards if (v := summary[size].get(case_key(c, n), {}).get(OURS, {}).get(m))]
                if pts:
                    ax.errorbar([n for n, _v in pts], [v["median"] / 1e3 for _n, v in pts],
                                yerr=[[(v["median"] - v["min"]) / 1e3 for _n, v in pts],
                                      [(v["max"] - v["median"]) / 1e3 for _n, v in pts]],
                                capsize=3, color=f"C{i}", marker=markers[j % len(markers)], ls=["-", ":"][k % 2],
                                label=f"mooncake-ray, {label}")
                peer = (mooncake_at(summary[size], c) or {}).get(m)
                if peer:
                    ax.axhline(peer["median"] / 1e3, color=f"C{i}", ls=["--", "-."][k % 2], lw=1, alpha=0.7,
                               label=f"mooncake, {label}")
    ax.set_xticks(shards)
    ax.set(xlabel="master shards (mooncake-ray)", ylabel="k keys/s", title=title)
    ax.set_ylim(bottom=0)


# =========================================================================== main ==

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--keys", type=int, default=1_000_000, help="values put (and read back) per run")
    ap.add_argument("--value-bytes", default="256", help="value size(s), comma-separated: 256,16k")
    ap.add_argument("--batch", type=int, default=1000, help="keys per put or get call")
    ap.add_argument("--arena", default="2gb", help="DRAM of the store process (both systems)")
    ap.add_argument("--clients", default="1", help="client processes putting disjoint key ranges at once "
                                                   "(1: this process); comma-separated for a sweep: 1,2,4")
    ap.add_argument("--shards", default="1", help="master shards of ours (Mooncake has one master); "
                                                  "comma-separated for a sweep: 1,2,4")
    ap.add_argument("--repeats", type=int, default=1, help="runs per system, value size and "
                                                                       "(clients, shards)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="which systems to run")
    ap.add_argument("--store-json", default="{}", help='more of our StoreConfig, e.g. \'{"elastic": {"keep_arena": false}}\'')
    ap.add_argument("--min-free", default="2gb",
                    help="stop putting when the host's available memory falls below this")
    ap.add_argument("--phase-timeout-s", type=float, default=7200, help="longest wait for the clients' phase")
    ap.add_argument("--quick", action="store_true", help="100k keys: a check that everything runs")
    ap.add_argument("--log-dir", default=None, help="keep the Mooncake processes' logs here (else a temporary "
                                                    "directory, kept only if a run fails)")
    ap.add_argument("--out", default=None, help=f"results file (the plot beside it, .png); default "
                                                f"{RESULTS / 'bench_scale.json'}, or bench_scale_shards.json "
                                                f"there with more than one clients value or shards other than 1")
    a = ap.parse_args(argv)
    if a.quick:  # other defaults; what is given on the command line still wins
        ap.set_defaults(keys=100_000)
        a = ap.parse_args(argv)
    from mooncake_ray import parse_size  # the package itself (``_common.parse_size`` would stub it)
    from mooncake_ray._private.shards import MAX_SHARDS

    try:
        a.clients, a.shards = (sorted({int(x) for x in v.split(",") if x.strip()}) for v in (a.clients, a.shards))
    except ValueError:
        ap.error(f"--clients and --shards take comma-separated integers (got {a.clients!r}, {a.shards!r})")
    if not a.clients or not a.shards or not all(1 <= n <= MAX_SHARDS for n in a.shards):
        ap.error(f"--shards from 1 to {MAX_SHARDS}, and at least one clients and shards value")
    if a.out is None:  # a sweep (or other shards) does not overwrite the single-shard results
        sweep = len(a.clients) > 1 or a.shards != [1]
        a.out = str(RESULTS / ("bench_scale_shards.json" if sweep else "bench_scale.json"))
    a.sizes = [parse_size(s) for s in a.value_bytes.split(",") if s.strip()]
    if min(a.sizes) < len(key_of(a.keys)):
        ap.error(f"--value-bytes must be at least {len(key_of(a.keys))} (a value holds its key)")
    a.arena, a.min_free = parse_size(a.arena), parse_size(a.min_free)
    a.systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    unknown = set(a.systems) - set(SYSTEMS)
    if unknown or a.clients[0] < 1 or a.keys < a.clients[-1] or a.batch < 1:
        ap.error(f"systems from {SYSTEMS}, clients >= 1, keys >= clients (got {sorted(unknown)}, "
                 f"{a.clients}, {a.keys})")
    return a


def environment() -> dict:
    root = Path(__file__).resolve().parents[1]
    git = lambda *args: subprocess.run(["git", "-C", str(root), *args], capture_output=True,  # noqa: E731
                                       text=True).stdout.strip()
    return {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "mem_total_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
                        "loadavg_start": os.getloadavg()},
            "commit": git("rev-parse", "HEAD"), "package_changes": git("status", "--porcelain", "mooncake_ray"),
            "versions": versions(["ray", "mooncake-transfer-engine-non-cuda", "mooncake-ray", "numpy"])}


def plan(a):
    """``(value size, repeat, clients, system, shards)`` of every run, in order: ours once
    per shards value, Mooncake (one master) once, for each clients value; the systems'
    order alternates between repeats."""
    for size in a.sizes:
        for rep in range(a.repeats):
            for clients in a.clients:
                for name in (a.systems if rep % 2 == 0 else a.systems[::-1]):
                    for shards in (a.shards if name == OURS else [1]):
                        yield size, rep, clients, name, shards


def main(argv=None) -> None:
    a = parse_args(argv)
    log_dir = Path(a.log_dir or tempfile.mkdtemp(prefix="bench_scale-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    params = {k: v for k, v in vars(a).items() if k not in ("out", "log_dir")}
    res = {"benchmark": "bench_scale", "host": host_info(), "params": params, **environment(), "runs": [], "errors": [],
           "log_dir": str(log_dir)}  # removed at the end unless asked for or a run failed
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    classes = {OURS: Ours, MOONCAKE: Mooncake}
    t_all = time.perf_counter()
    for size, rep, clients, name, shards in plan(a):
        t = time.perf_counter()
        print(f"{name}: {a.keys:,} x {size} B, {clients} client(s), {shards} master shard(s), repeat {rep} ...",
              flush=True)
        try:
            run = run_one(classes[name], argparse.Namespace(**{**vars(a), "clients": clients, "shards": shards}),
                          size, rep, log_dir)
        except Exception:  # noqa: BLE001 - a system that fails is recorded; the other runs
            err = traceback.format_exc()
            res["errors"].append({"system": name, "value_bytes": size, "repeat": rep, "clients": clients,
                                  "shards": shards, "traceback": err})
            print(f"{name} failed:\n{err}", file=sys.stderr, flush=True)
            continue
        run["seconds"] = time.perf_counter() - t
        res["runs"].append(run)
        res["summary"], res["ratios"] = summarize(res["runs"])
        out.write_text(json.dumps(res, indent=1, default=str))
        m = run["metrics"]
        print(f"  {run['seconds']:.0f} s: put {m['put_keys_per_s']:.0f} keys/s (tenths "
              f"{' '.join(f'{x:.0f}' for x in run['put']['rate_by_tenth'])}), "
              f"get {m['get_keys_per_s']:.0f} keys/s, kept {m['kept']}/{m['keys_put']}, "
              f"master {m['master_bytes_per_live_key']:.0f} B/live key, "
              f"{m['master_cpu_us_per_put']:.1f} / {m['master_cpu_us_per_get']:.1f} us CPU/put / get, projected "
              f"{_fmt(m['master_put_capacity_keys_per_s'])} / {_fmt(m['master_get_capacity_keys_per_s'])} "
              f"keys/s", flush=True)
    res["seconds"] = time.perf_counter() - t_all
    res["machine"]["loadavg_end"] = os.getloadavg()
    res["summary"], res["ratios"] = summarize(res["runs"])
    out.write_text(json.dumps(res, indent=1, default=str))
    if res["runs"]:
        plot(res, out.with_suffix(".png"))
    print(f"\nhost: {host_label(res['host'], model=True)}")
    print_summary(res["summary"], res["ratios"])
    print(f"\n{res['seconds']:.0f} s in all; wrote {out}")
    if a.log_dir is None and not res["errors"]:
        shutil.rmtree(log_dir, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--plot":  # redraw from a results file
        res = json.loads(Path(sys.argv[2]).read_text())
        res["summary"], res["ratios"] = summarize(res["runs"])  # files from before the sweep: another shape
        plot(res, Path(sys.argv[2]).with_suffix(".png"))
    else:
        main()
