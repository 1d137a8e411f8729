"""KV-cache tiers benchmark in the shape of the MLPerf Storage KV-cache benchmark
(``mlcommons/storage:kv_cache_benchmark``), through our public client API.

Concurrent users (one thread and one client each) hold multi-turn conversations. A turn:

1. prefix reuse: read the KV pages of the conversation so far (the shared system prompt,
   then the user's own earlier turns), like prefix caching; pages that miss must be
   recomputed: they are counted as misses and written again (no compute is simulated);
2. prefill: write the KV of the new tokens (the previous answer + the new question), in
   pages of ``--page-tokens`` tokens, with ``batch_put_from`` from a registered buffer;
3. decode: read the whole context KV ceil(gen/32) times (``batch_get_into``), as
   MLPerf's ``access_cache`` once per 32 generated tokens; misses are recomputed too.

Token counts are drawn (seeded, per user) in whole pages: question lognormal around
``--input-tokens``, answer lognormal around ``--gen-tokens``; a conversation that would
outgrow ``--max-context`` ends and the user starts a new one (the old pages stay in the
store as garbage, as an engine's would). Bounded by ``--duration`` seconds per config
and/or ``--max-requests`` (split evenly over users: same requests in every config).

Tier configurations, each in a fresh store (namespace ``tiers_<cfg>``), one Ray instance:

- ``dram``:      DRAM pool ``--dram`` (well below the working set), no spill: an evicted
                 page is lost, a later read misses and the page is recomputed;
- ``dram_nvme``: the same DRAM pool + a spill directory on the real disk;
- ``nvme``:      NVMe-only, approximated: every put lands in DRAM first in our design, so
                 the smallest workable DRAM pool (``--nvme-dram``, 64 MiB) + spill.

Per read call the client's ``local_stats`` (values read, promoted from disk, misses) is
sampled around the call: a call that promoted at least one page is a disk-hit call, one
served entirely from DRAM a DRAM-hit call. After the workload, each spill config also runs
a short burst (pages put back to back into the full DRAM pool, then read back) to show
what the tier does when asked for all it can take. fio (io_uring, O_DIRECT, 1 MiB
sequential, queue depth 32) runs on the same directory before every trial and at the end;
the NVMe tier's observed bandwidth is compared with the fio runs around each trial
(target: >= 50%; MLPerf's own run reached 2.6% of its device).

Storage throughput here is tokens whose KV was read (hits) or written per second of wall
time; MLPerf's own figure (tokens generated / I/O latency summed over users) is reported
beside it, labelled. No compute is simulated: DRAM-only finishes requests sooner than it
would on a GPU because its misses cost nothing here; compare hit rates, not request rates.

    make bench B=benchmarks/bench_tiers.py            # defaults: 8 users, 3 trials x 25 s per config

Writes benchmarks/results/bench_tiers.{json,png}. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# KV bytes per token (MLPerf kv_cache_benchmark model table)
MODELS = {
    "tiny-1b": 24 * KiB,
    "mistral-7b": 128 * KiB,
    "llama3.1-8b": 128 * KiB,
    "llama2-7b": 512 * KiB,
    "llama3.1-70b-instruct": 320 * KiB,
    "qwen3-32b": 256 * KiB,
    "gpt-oss-120b": 72 * KiB,
    "gpt-oss-20b": 48 * KiB,
    "deepseek-v3": 61 * 576 * 2,
}

CONFIGS = ("dram", "dram_nvme", "nvme")
LABELS = {"dram": "DRAM only", "dram_nvme": "DRAM + NVMe", "nvme": "NVMe only (64 MiB DRAM)"}
DECODE_TOKENS_PER_READ = 32  # MLPerf: one access_cache per 32 generated tokens


# ---------------------------------------------------------------------- helpers ----
def pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if len(xs) else float("nan")


def lat_summary(seconds: list[float]) -> dict:
    ms = [x * 1e3 for x in seconds]
    out = {"count": len(ms), "mean": statistics.fmean(ms) if ms else float("nan")}
    for q, name in ((50, "p50"), (95, "p95"), (99, "p99"), (99.9, "p999")):
        out[name] = pct(ms, q)
    return out


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Wall time covered by at least one interval."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def med(values: list[float]) -> dict:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "runs": values}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "runs": values}


def stamp_of(key: str) -> np.ndarray:
    return np.frombuffer(hashlib.blake2b(key.encode(), digest_size=8).digest(), dtype=np.uint8)


# ---------------------------------------------------------------------- fio --------
def fio_round(directory: str, size: str, runtime_s: float) -> dict:
    """1 MiB sequential write then read (io_uring, O_DIRECT, qd 32) on one file in
    ``directory``; bench_spill's helper."""
    sys.path.insert(0, str(HERE))
    from bench_spill import fio  # noqa: E402
    from _common import parse_size  # noqa: E402

    path = os.path.join(directory, "fio-tiers.dat")
    try:
        w = fio(path, "write", MiB, 32, parse_size(size), runtime_s)
        r = fio(path, "read", MiB, 32, parse_size(size), runtime_s)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return {"write_gbps": w["gbps"], "read_gbps": r["gbps"], "write_p95_ms": w["p95_ms"], "read_p95_ms": r["p95_ms"]}


# ---------------------------------------------------------------------- users ------
class Rec:
    """One user's measurements."""

    def __init__(self):
        self.reads = []  # (t0, t1, kind, pages, hits, dram, disk, misses, errors)
        self.writes = []  # (t0, t1, kind, pages, ok, failed, attempts, failed_first_attempt)
        self.accesses = []  # (t0, t1, kind, pages): one whole-context read, all its calls
        self.requests = []  # (t0, t1, ctx_pages_before, new_pages, gen_tokens, decode_reads, conv_turn)
        self.hits = {"system_prompt": [0, 0], "multi_turn": [0, 0], "decode": [0, 0]}  # [hits, reads]
        self.corrupt = 0
        self.read_errors: dict[str, int] = {}
        self.write_errors: dict[str, int] = {}  # given up
        self.first_write_errors: dict[str, int] = {}  # first attempts that failed
        self.exists_on_recompute = 0
        self.error: str | None = None


class User(threading.Thread):
    def __init__(self, uid: int, client, args, spec: dict, stop_at: float, max_turns: int, live: list):
        super().__init__(name=f"user-{uid}", daemon=True)
        self.uid, self.c, self.a, self.spec = uid, client, args, spec
        self.stop_at, self.max_turns, self.live = stop_at, max_turns, live
        self.rec = Rec()
        pb = spec["page_bytes"]
        self.buf = np.ones(spec["max_pages"] * pb, dtype=np.uint8)  # touched: pre-faulted
        self.c.register_buffer(self.buf)
        self.views = [self.buf[i * pb:(i + 1) * pb] for i in range(spec["max_pages"])]

    # -- storage calls ------------------------------------------------------------
    def _stamp(self, slots, keys):
        for s, k in zip(slots, keys):
            st = stamp_of(k)
            v = self.views[s]
            v[:8] = st
            v[-8:] = st

    def _chunks(self, n: int):
        step = self.a.batch_pages or n
        return [(i, min(n, i + step)) for i in range(0, n, step)]

    def _write(self, kind: str, keys: list[str], slots: list[int]) -> None:
        """batch_put_from, in calls of --batch-pages pages; retryable errors are retried
        for up to --write-retry-s (the client itself already waits on offloads)."""
        if not keys:
            return
        self._stamp(slots, keys)
        for a, b in self._chunks(len(keys)):
            ks, ss = keys[a:b], slots[a:b]
            t0 = time.perf_counter()
            todo, attempts, first_fail, delay = list(range(len(ks))), 0, 0, 0.001
            failed: list[int] = []
            while todo:
                attempts += 1
                res = self.c.batch_put_from([ks[i] for i in todo], [self.views[ss[i]] for i in todo])
                retry = []
                for i, r in zip(todo, res):
                    if r is None:
                        continue
                    name = type(r).__name__
                    if name == "ObjectExistsError":  # another user recomputed the shared prefix first
                        self.rec.exists_on_recompute += 1
                        continue
                    if attempts == 1:
                        first_fail += 1
                        self.rec.first_write_errors[name] = self.rec.first_write_errors.get(name, 0) + 1
                    if getattr(r, "retryable", False) and time.perf_counter() - t0 < self.a.write_retry_s:
                        retry.append(i)
                    else:
                        self.rec.write_errors[name] = self.rec.write_errors.get(name, 0) + 1
                        failed.append(i)
                todo = retry
                if todo:
                    time.sleep(delay)
                    delay = min(delay * 2, 0.05)
            t1 = time.perf_counter()
            self.rec.writes.append((t0, t1, kind, len(ks), len(ks) - len(failed), len(failed), attempts, first_fail))

    def _read(self, kind: str, keys: list[str], slots: list[int], n_sys: int) -> list[int]:
        """One access to ``keys`` (batch_get_into, in calls of --batch-pages pages);
        returns the slots that missed (to recompute)."""
        missed: list[int] = []
        t_acc = time.perf_counter()
        for a, b in self._chunks(len(keys)):
            missed += self._read_call(kind, keys[a:b], slots[a:b], n_sys - a)
        self.rec.accesses.append((t_acc, time.perf_counter(), kind, len(keys)))
        return missed

    def _read_call(self, kind: str, keys: list[str], slots: list[int], n_sys: int) -> list[int]:
        ls = self.c.local_stats
        b_reads, b_disk, b_miss = ls["reads"], ls["disk_reads"], ls["misses"]
        t0 = time.perf_counter()
        res = self.c.batch_get_into(keys, [self.views[s] for s in slots])
        t1 = time.perf_counter()
        d_reads, d_disk, d_miss = ls["reads"] - b_reads, ls["disk_reads"] - b_disk, ls["misses"] - b_miss
        pb = self.spec["page_bytes"]
        hits, missed, errors = 0, [], 0
        for i, (s, k, r) in enumerate(zip(slots, keys, res)):
            cat = "decode" if kind == "decode" else ("system_prompt" if i < n_sys else "multi_turn")
            self.rec.hits[cat][1] += 1
            if isinstance(r, int) and r == pb:
                v = self.views[s]
                st = stamp_of(k)
                if not (np.array_equal(v[:8], st) and np.array_equal(v[-8:], st)):
                    self.rec.corrupt += 1
                    continue
                hits += 1
                self.rec.hits[cat][0] += 1
            elif type(r).__name__ == "ObjectNotFoundError":
                missed.append(s)
            else:
                errors += 1
                name = type(r).__name__ if not isinstance(r, int) else f"size {r}"
                self.rec.read_errors[name] = self.rec.read_errors.get(name, 0) + 1
        self.rec.reads.append((t0, t1, kind, len(keys), hits, d_reads - d_disk, d_disk, d_miss, errors))
        return missed

    def _recompute(self, keys: list[str], slots: list[int], missed: list[int]) -> None:
        if missed:
            idx = {s: i for i, s in enumerate(slots)}
            self._write("recompute", [keys[idx[s]] for s in missed], missed)

    # -- the conversation ---------------------------------------------------------
    def _draw(self, rng, median_tokens: int, sigma: float, max_pages: int) -> int:
        pt = self.a.page_tokens
        tokens = rng.lognormal(math.log(median_tokens), sigma)
        return int(min(max_pages, max(1, round(tokens / pt))))

    def run(self) -> None:
        try:
            self._run()
        except Exception as e:  # keep the others going; reported in the JSON
            import traceback

            self.rec.error = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"

    def _run(self) -> None:
        a, sp = self.a, self.spec
        rng = np.random.default_rng([a.seed, self.uid])
        n_sys, max_pages = sp["sys_pages"], sp["max_pages"]
        cap_in, cap_gen = sp["max_input_pages"], sp["max_gen_pages"]
        conv, own, prev_gen_pages, turn, conv_turn = 0, 0, 0, 0, 0
        sys_keys = [f"sys/p{i}" for i in range(n_sys)]
        while time.perf_counter() < self.stop_at and (self.max_turns == 0 or turn < self.max_turns):
            in_pages = self._draw(rng, a.input_tokens, 0.8, cap_in)
            gen_pages = self._draw(rng, a.gen_tokens, 0.7, cap_gen)
            new_pages = prev_gen_pages + in_pages
            if n_sys + own + new_pages > max_pages:  # the conversation outgrew the context
                conv, own, conv_turn, new_pages = conv + 1, 0, 0, in_pages
            own_keys = [f"u{self.uid}/c{conv}/p{i}" for i in range(own + new_pages)]
            ctx_keys = sys_keys + own_keys[:own]
            ctx_slots = list(range(n_sys + own))
            t0 = time.perf_counter()
            # 1. prefix reuse (system prompt + earlier turns)
            if ctx_keys:
                missed = self._read("prefix", ctx_keys, ctx_slots, n_sys)
                self._recompute(ctx_keys, ctx_slots, missed)
            # 2. prefill: the new tokens' KV
            new_keys = own_keys[own:]
            new_slots = list(range(n_sys + own, n_sys + own + new_pages))
            self._write("prefill", new_keys, new_slots)
            # 3. decode: the whole context, once per 32 generated tokens
            all_keys, all_slots = sys_keys + own_keys, list(range(n_sys + own + new_pages))
            gen_tokens = gen_pages * a.page_tokens
            n_dec = math.ceil(gen_tokens / DECODE_TOKENS_PER_READ)
            for _ in range(n_dec):
                missed = self._read("decode", all_keys, all_slots, n_sys)
                self._recompute(all_keys, all_slots, missed)
            t1 = time.perf_counter()
            self.rec.requests.append((t0, t1, n_sys + own, new_pages, gen_tokens, n_dec, conv_turn))
            own += new_pages
            self.live[self.uid] = own
            prev_gen_pages = gen_pages
            turn += 1
            conv_turn += 1


# ---------------------------------------------------------------------- a config ---
def store_config(name: str, args, spill_dir: str | None) -> dict:
    cfg = {"namespace": f"tiers_{name}", "segment_size_bytes": args.nvme_dram if name == "nvme" else args.dram,
           "transport": {"devices": ["lo"]}}
    if name != "dram":
        cfg["spill"] = {"enabled": True, "directory": spill_dir, "capacity_bytes": args.spill_capacity}
    return cfg


class SpillMonitor(threading.Thread):
    """Samples the store nodes' spill counters (``stats()`` of each store-node actor)."""

    def __init__(self, actors, period_s: float):
        super().__init__(name="spill-monitor", daemon=True)
        self.actors, self.period = actors, period_s
        self.samples: list[tuple[float, dict]] = []
        self.stop = threading.Event()

    def sample(self) -> None:
        import ray

        tot: dict[str, int] = {}
        for st in ray.get([a.stats.remote() for a in self.actors], timeout=30):
            for k, v in (st.get("spill") or {}).items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    tot[k] = tot.get(k, 0) + v
        self.samples.append((time.perf_counter(), tot))

    def run(self) -> None:
        while not self.stop.wait(self.period):
            try:
                self.sample()
            except Exception:  # a slow actor: skip the sample
                pass

    def busy(self, key: str) -> tuple[int, float]:
        """(bytes moved, seconds of the sampling intervals in which the counter grew): a
        lower bound of the rate while the tier was working on ``key``."""
        moved, busy = 0, 0.0
        for (t0, s0), (t1, s1) in zip(self.samples, self.samples[1:]):
            d = s1.get(key, 0) - s0.get(key, 0)
            if d > 0:
                moved += d
                busy += t1 - t0
        return moved, busy


def run_config(name: str, args, spec: dict, trial: int) -> dict:
    import ray

    import mooncake_ray
    from mooncake_ray._private.naming import store_actor_name

    spill_dir = tempfile.mkdtemp(prefix=f"tiers-{name}-", dir=args.spill_dir) if name != "dram" else None
    cfg = store_config(name, args, spill_dir)
    ns = cfg["namespace"]
    t_start = time.perf_counter()
    store = mooncake_ray.start(cfg)
    startup_s = time.perf_counter() - t_start
    pb = spec["page_bytes"]
    out: dict = {"config": name, "trial": trial, "namespace": ns,
                 "store_config": {k: v for k, v in cfg.items() if k != "namespace"}, "startup_s": startup_s}
    if name == "nvme":
        out["note"] = ("NVMe-only approximated: a put always lands in a store node's DRAM arena first in this "
                       f"design, so this is the smallest workable DRAM pool ({args.nvme_dram}) + the spill tier; "
                       "nearly every read of older pages promotes from disk.")
    try:
        # the shared system prompt, written once (its prefill)
        sys_keys = [f"sys/p{i}" for i in range(spec["sys_pages"])]
        if sys_keys:
            sbuf = np.ones(len(sys_keys) * pb, dtype=np.uint8)
            store.register_buffer(sbuf)
            views = [sbuf[i * pb:(i + 1) * pb] for i in range(len(sys_keys))]
            for k, v in zip(sys_keys, views):
                v[:8] = stamp_of(k)
                v[-8:] = stamp_of(k)
            res = store.batch_put_from(sys_keys, views)
            assert all(r is None for r in res), res
        clients = [mooncake_ray.connect(namespace=ns) for _ in range(args.num_users)]
        node_ids = list(store.stats()["nodes"])
        monitor = None
        if name != "dram":
            actors = [ray.get_actor(store_actor_name(n), namespace=ns) for n in node_ids]
            monitor = SpillMonitor(actors, args.sample_period)
        live = [0] * args.num_users
        max_turns = math.ceil(args.max_requests / args.num_users) if args.max_requests else 0
        users = [User(u, clients[u], args, spec, 0.0, max_turns, live) for u in range(args.num_users)]
        m0 = store.stats()
        if monitor:
            monitor.sample()
            monitor.start()
        t0 = time.perf_counter()
        for u in users:
            u.stop_at = t0 + args.duration
        for u in users:
            u.start()
        peak_live = 0
        while any(u.is_alive() for u in users):
            peak_live = max(peak_live, sum(live))
            time.sleep(0.1)
        t1 = time.perf_counter()
        m1 = store.stats()
        if monitor:
            monitor.stop.set()
            monitor.join()
            monitor.sample()
        out["wall_s"] = t1 - t0
        out["peak_live_context_gb"] = (peak_live + spec["sys_pages"]) * pb / 1e9
        out.update(summarize(name, users, t0, t1, m0, m1, monitor, spec, args))
        if monitor and args.burst_pages:
            out["burst"] = burst(store, users[:args.burst_threads], monitor, spec, args)
    finally:
        mooncake_ray.shutdown(namespace=ns, stop_ray=False)
        if spill_dir:
            shutil.rmtree(spill_dir, ignore_errors=True)
    return out


# ---------------------------------------------------------------------- burst ------
def burst(store, users: list, monitor: SpillMonitor, spec: dict, args) -> dict:
    """After the workload, what the spill tier does when the client asks for all it can
    take: ``--burst-pages`` new pages put back to back (``--burst-threads`` clients,
    ``--batch-pages`` per call) into the full DRAM pool, so the offload path sets the pace;
    then read back oldest first (disk-only by then: each is promoted). Bandwidths from the
    tier's own counters over the phase (writes: until the last offload is done)."""
    pb, n, step = spec["page_bytes"], args.burst_pages, args.batch_pages or 16
    per = [list(range(t, n, len(users))) for t in range(len(users))]
    errors: list[str] = []

    def offloading() -> int:
        return sum(nd["dram"]["offloading_bytes"] for nd in store.stats()["nodes"].values())

    def put_worker(u: User, pages: list[int]) -> None:
        first = len(u.rec.writes)
        for a in range(0, len(pages), step):
            keys = [f"burst/{i}" for i in pages[a:a + step]]
            u._write("burst", keys, list(range(len(keys))))  # same retries as the workload's puts
        for w in u.rec.writes[first:]:
            if w[5]:
                errors.append(f"put: {w[5]} pages not stored after {w[6]} attempts")
        retried[u.uid] = sum(1 for w in u.rec.writes[first:] if w[6] > 1)

    disk_reads: dict[int, int] = {}
    retried: dict[int, int] = {}

    def get_worker(u: User, pages: list[int]) -> None:
        d0 = u.c.local_stats["disk_reads"]
        for a in range(0, len(pages), step):
            keys = [f"burst/{i}" for i in pages[a:a + step]]
            res = u.c.batch_get_into(keys, [u.views[j] for j in range(len(keys))])
            for j, (k, r) in enumerate(zip(keys, res)):
                v = u.views[j]
                if r != pb or not (np.array_equal(v[:8], stamp_of(k)) and np.array_equal(v[-8:], stamp_of(k))):
                    errors.append(f"get {k}: {r if isinstance(r, int) else type(r).__name__}")
        disk_reads[u.uid] = u.c.local_stats["disk_reads"] - d0

    def phase(worker, order) -> float:
        ths = [threading.Thread(target=worker, args=(u, o)) for u, o in zip(users, order)]
        t = time.perf_counter()
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        return time.perf_counter() - t

    monitor.sample()
    s0, t0 = monitor.samples[-1][1], time.perf_counter()
    put_s = phase(put_worker, per)
    deadline = time.perf_counter() + 60
    while offloading() and time.perf_counter() < deadline:
        time.sleep(0.02)
    drained_s = time.perf_counter() - t0
    monitor.sample()
    s1 = monitor.samples[-1][1]
    # read back in the order written (oldest first: on disk only by now)
    get_s = phase(get_worker, per)
    monitor.sample()
    s2 = monitor.samples[-1][1]
    wb = s1.get("write_bytes", 0) - s0.get("write_bytes", 0)
    rb = s2.get("read_bytes", 0) - s1.get("read_bytes", 0)
    promoted = sum(disk_reads.values())
    return {
        "pages": n, "bytes_gb": n * pb / 1e9, "threads": len(users), "pages_per_call": step,
        "put_s": put_s, "offloads_drained_s": drained_s,
        "put_gbps": n * pb / 1e9 / put_s,
        "offload_gb": wb / 1e9, "offload_gbps": wb / 1e9 / drained_s,
        "get_s": get_s, "get_gbps": n * pb / 1e9 / get_s,
        "pages_promoted": promoted, "promote_gb": rb / 1e9, "promote_gbps": rb / 1e9 / get_s,
        "spill_write_ms_per_object": ((s1.get("write_latency_ns_sum", 0) - s0.get("write_latency_ns_sum", 0)) / 1e6
                                      / max(1, s1.get("writes", 0) - s0.get("writes", 0))),
        "spill_read_ms_per_object": ((s2.get("read_latency_ns_sum", 0) - s1.get("read_latency_ns_sum", 0)) / 1e6
                                     / max(1, s2.get("reads", 0) - s1.get("reads", 0))),
        "put_calls_retried": sum(retried.values()),
        "errors": errors[:20], "error_count": len(errors),
    }


# ---------------------------------------------------------------------- summary ----
def summarize(name, users, t0, t1, m0, m1, monitor, spec, args) -> dict:
    pb, pt = spec["page_bytes"], args.page_tokens
    wall = t1 - t0
    reads = [r for u in users for r in u.rec.reads]
    writes = [w for u in users for w in u.rec.writes]
    reqs = [q for u in users for q in u.rec.requests]
    rd_lat = [r[1] - r[0] for r in reads]
    wr_lat = [w[1] - w[0] for w in writes]
    dram_calls = [r for r in reads if r[6] == 0 and r[5] > 0]
    disk_calls = [r for r in reads if r[6] > 0]
    miss_calls = [r for r in reads if r[6] == 0 and r[5] == 0]
    pages_read_ok = sum(r[4] for r in reads)
    pages_read = sum(r[3] for r in reads)
    pages_disk = sum(r[6] for r in reads)
    pages_dram = sum(r[5] for r in reads)
    pages_missed = sum(r[7] for r in reads)
    pages_written = sum(w[4] for w in writes)
    prefill = [w for w in writes if w[2] == "prefill"]
    recompute = [w for w in writes if w[2] == "recompute"]
    decode = [r for r in reads if r[2] == "decode"]
    io_time = sum(rd_lat) + sum(wr_lat)
    gen_tokens = sum(q[4] for q in reqs)
    io_tokens = (pages_read_ok + pages_written) * pt
    hits = {k: [sum(u.rec.hits[k][0] for u in users), sum(u.rec.hits[k][1] for u in users)]
            for k in ("system_prompt", "multi_turn", "decode")}
    disk_union = union_seconds([(r[0], r[1]) for r in disk_calls])
    disk_sum = sum(r[1] - r[0] for r in disk_calls)
    delta = {k: m1.get(k, 0) - m0.get(k, 0) for k in m1 if isinstance(m1.get(k), (int, float))
             and not isinstance(m1.get(k), bool)}
    errs_r: dict[str, int] = {}
    errs_w: dict[str, int] = {}
    errs_w1: dict[str, int] = {}
    for u in users:
        for src, dst in ((u.rec.read_errors, errs_r), (u.rec.write_errors, errs_w), (u.rec.first_write_errors, errs_w1)):
            for k, v in src.items():
                dst[k] = dst.get(k, 0) + v
    accesses = [x for u in users for x in u.rec.accesses]

    tiers = {
        "dram": {"read_calls": len(dram_calls), "pages": pages_dram, "bytes_read_gb": pages_dram * pb / 1e9,
                 "read_latency_ms": lat_summary([r[1] - r[0] for r in dram_calls]),
                 "read_bandwidth_gbps_in_dram_calls": (sum(r[5] for r in dram_calls) * pb / 1e9
                                                       / max(1e-9, union_seconds([(r[0], r[1]) for r in dram_calls])))},
        "disk": {"read_calls": len(disk_calls), "pages_promoted": pages_disk,
                 "bytes_promoted_gb": pages_disk * pb / 1e9,
                 "read_latency_ms": lat_summary([r[1] - r[0] for r in disk_calls]),
                 "mean_fraction_of_call_pages_from_disk": (statistics.fmean(r[6] / max(1, r[3]) for r in disk_calls)
                                                           if disk_calls else float("nan")),
                 "time_in_disk_hit_reads_summed_s": disk_sum,
                 "time_in_disk_hit_reads_union_s": disk_union,
                 "read_bandwidth_gbps_summed": pages_disk * pb / 1e9 / disk_sum if disk_sum else float("nan"),
                 "read_bandwidth_gbps": pages_disk * pb / 1e9 / disk_union if disk_union else float("nan")},
        "miss_only_calls": {"read_calls": len(miss_calls), "read_latency_ms": lat_summary([r[1] - r[0] for r in miss_calls])},
    }
    if name != "dram":
        offloaded = delta.get("offloads", 0) * pb  # every offloaded object is one page
        tiers["disk"]["write_bandwidth_gbps_wall"] = offloaded / 1e9 / wall
        tiers["disk"]["offloaded_gb"] = offloaded / 1e9
    if monitor is not None and len(monitor.samples) >= 2:
        s0, s1 = monitor.samples[0][1], monitor.samples[-1][1]
        dspill = {k: s1.get(k, 0) - s0.get(k, 0) for k in s1}
        wb, wbusy = monitor.busy("write_bytes")
        rb, rbusy = monitor.busy("read_bytes")
        span = monitor.samples[-1][0] - monitor.samples[0][0]
        tiers["disk"]["spill_counters"] = {
            "delta": dspill,
            "sample_period_s": monitor.period, "samples": len(monitor.samples), "span_s": span,
            "write_gb": dspill.get("write_bytes", 0) / 1e9, "read_gb": dspill.get("read_bytes", 0) / 1e9,
            "write_bandwidth_gbps_wall": dspill.get("write_bytes", 0) / 1e9 / span,
            "read_bandwidth_gbps_wall": dspill.get("read_bytes", 0) / 1e9 / span,
            "write_busy_s": wbusy, "read_busy_s": rbusy,
            "write_bandwidth_gbps_busy": wb / 1e9 / wbusy if wbusy else float("nan"),
            "read_bandwidth_gbps_busy": rb / 1e9 / rbusy if rbusy else float("nan"),
            "mean_write_latency_ms_per_object": (dspill.get("write_latency_ns_sum", 0) / 1e6
                                                 / max(1, dspill.get("writes", 0))),
            "mean_read_latency_ms_per_object": (dspill.get("read_latency_ns_sum", 0) / 1e6
                                                / max(1, dspill.get("reads", 0))),
        }
    read_p95 = lat_summary(rd_lat)["p95"]
    write_p95 = lat_summary(wr_lat)["p95"]
    dram_p95 = tiers["dram"]["read_latency_ms"]["p95"]
    disk_p95 = tiers["disk"]["read_latency_ms"]["p95"]
    hit_rate = pages_read_ok / pages_read if pages_read else float("nan")
    criteria = [
        {"name": "NVMe write P95 < 500 ms", "target_ms": 500,
         "actual_ms": write_p95 if name != "dram" else None,
         "passed": (write_p95 < 500) if name != "dram" else None,
         "note": "our writes land in DRAM; with a spill tier their latency includes waiting for offloads"},
        {"name": "NVMe read P95 < 200 ms", "target_ms": 200, "actual_ms": disk_p95 if disk_calls else None,
         "passed": (disk_p95 < 200) if disk_calls else None, "note": "disk-hit read calls"},
        {"name": "CPU P95 < 150 ms", "target_ms": 150, "actual_ms": dram_p95 if dram_calls else None,
         "passed": (dram_p95 < 150) if dram_calls else None, "note": "DRAM-hit read calls (MLPerf's CPU tier)"},
        {"name": "cache hit rate > 30%", "target": 0.30, "actual": hit_rate, "passed": hit_rate > 0.30},
    ]
    judged = [c for c in criteria if c["passed"] is not None]
    passed = sum(1 for c in judged if c["passed"])
    summary = {
        "total_requests": len(reqs),
        "total_tokens": gen_tokens,
        "total_tokens_note": "tokens generated (decode), as MLPerf's total_tokens",
        "prompt_tokens_written": sum(w[4] for w in prefill) * pt,
        "elapsed_time": wall,
        "requests_per_second": len(reqs) / wall,
        "avg_throughput_tokens_per_sec": gen_tokens / wall,
        "storage_throughput_tokens_per_sec": io_tokens / wall,
        "storage_throughput_definition": ("tokens whose KV was read (hits) or written per second of wall time, "
                                          "all users together"),
        "io_tokens_read": pages_read_ok * pt,
        "io_tokens_written": pages_written * pt,
        "io_tokens_written_prefill": sum(w[4] for w in prefill) * pt,
        "io_tokens_written_recompute": sum(w[4] for w in recompute) * pt,
        "cache_served_tokens_per_sec": pages_read_ok * pt / wall,
        "cache_served_definition": "tokens whose KV was read from the store (hits) per second of wall time",
        "total_storage_io_time": io_time,
        "mlperf_storage_throughput_tokens_per_sec": gen_tokens / io_time if io_time else float("nan"),
        "mlperf_storage_throughput_definition": ("MLPerf's: tokens generated / storage I/O latency summed over all "
                                                 "users' calls (an efficiency ratio, not a rate)"),
        "io_tokens_per_summed_io_second": io_tokens / io_time if io_time else float("nan"),
        "end_to_end_latency_ms": lat_summary([q[1] - q[0] for q in reqs]),
        "storage_io_latency_ms": lat_summary(rd_lat + wr_lat),
        "storage_read_latency_ms": lat_summary(rd_lat),
        "storage_write_latency_ms": lat_summary(wr_lat),
        "storage_write_latency_ms_prefill": lat_summary([w[1] - w[0] for w in prefill]),
        "storage_write_latency_ms_recompute": lat_summary([w[1] - w[0] for w in recompute]),
        "storage_latency_note": ("per call of at most --batch-pages pages; a write call's time includes its "
                                 "retries of retryable errors"),
        "context_access_latency_ms": lat_summary([x[1] - x[0] for x in accesses]),
        "context_access_latency_ms_decode": lat_summary([x[1] - x[0] for x in accesses if x[2] == "decode"]),
        "context_access_note": "one whole-context read (all its calls): MLPerf's access_cache",
        "generation_latency_ms": {"note": "--generation-mode none: no compute is simulated"},
        "cache_stats": {
            "cache_hit_rate": hit_rate,
            "cache_hit_rate_definition": "pages read successfully / pages asked for, over every read call",
            "system_prompt_hits": hits["system_prompt"][0], "system_prompt_reads": hits["system_prompt"][1],
            "multi_turn_hits": hits["multi_turn"][0], "multi_turn_reads": hits["multi_turn"][1],
            "decode_hits": hits["decode"][0], "decode_page_reads": hits["decode"][1],
            "multi_turn_hit_rate": hits["multi_turn"][0] / hits["multi_turn"][1] if hits["multi_turn"][1] else None,
            "system_prompt_hit_rate": (hits["system_prompt"][0] / hits["system_prompt"][1]
                                       if hits["system_prompt"][1] else None),
            "decode_hit_rate": hits["decode"][0] / hits["decode"][1] if hits["decode"][1] else None,
            "misses": pages_missed,
            "miss_tokens_to_recompute": pages_missed * pt,
            "recompute_writes": sum(w[4] for w in recompute),
            "total_read_gb": pages_read_ok * pb / 1e9,
            "total_write_gb": pages_written * pb / 1e9,
            "read_write_ratio": pages_read_ok / pages_written if pages_written else float("nan"),
            "read_iops": pages_read_ok / wall, "write_iops": pages_written / wall,
            "iops_unit": "pages (objects) per second",
            "prefill_writes": len(prefill), "prefill_bytes_written_gb": sum(w[4] for w in prefill) * pb / 1e9,
            "decode_reads": len(decode), "decode_bytes_read_gb": sum(r[4] for r in decode) * pb / 1e9,
            "tier_dram_read_p95_ms": dram_p95, "tier_nvme_read_p95_ms": disk_p95,
            "storage_write_p95_ms": write_p95, "storage_read_p95_ms": read_p95,
            "tier_dram_kv_bytes_read_gb": pages_dram * pb / 1e9,
            "tier_nvme_kv_bytes_read_gb": pages_disk * pb / 1e9,
            "tiers": tiers,
            "read_errors": errs_r, "write_errors_given_up": errs_w,
            "write_errors_first_attempt": errs_w1,
            "write_calls_retried": sum(1 for w in writes if w[6] > 1),
            "write_attempts": sum(w[6] for w in writes),
            "exists_on_recompute": sum(u.rec.exists_on_recompute for u in users),
            "corrupt_pages": sum(u.rec.corrupt for u in users),
            "storage_health": {"overall_status": "PASS" if passed == len(judged) else "FAIL",
                               "passed_count": passed, "total_count": len(judged), "criteria": criteria},
        },
        "master_stats_delta": delta,
        "master_stats_end": {k: v for k, v in m1.items()},
        "user_errors": [u.rec.error for u in users if u.rec.error],
    }
    return {"summary": summary}


# ---------------------------------------------------------------------- target -----
def nvme_target(configs: dict, fio_runs: list[dict]) -> dict:
    fio_w = statistics.median(f["write_gbps"] for f in fio_runs)
    fio_r = statistics.median(f["read_gbps"] for f in fio_runs)
    out = {"fio_median": {"write_gbps": fio_w, "read_gbps": fio_r}, "threshold": 0.5,
           "definitions": {
               "in_workload.read": ("bytes promoted from disk / wall time during which at least one disk-hit read "
                                    "call was in flight (union over users), client side"),
               "in_workload.read_wall": "the spill tier's read bytes / the whole run",
               "in_workload.write_wall": ("offloaded bytes (master's offload count x page size) / the whole run: "
                                          "bounded by how much the workload writes, not by the tier"),
               "in_workload.write_busy": ("the spill tier's write bytes / the sampled intervals in which it wrote "
                                          "(a lower bound of its rate while writing)"),
               "burst.offload": ("after the workload: pages put back to back into the full DRAM pool; the tier's "
                                 "write bytes / time until the last offload finished"),
               "burst.promote": "then read back oldest first: the tier's read bytes / time of the read phase",
               "fio": "1 MiB sequential, io_uring, O_DIRECT, queue depth 32, same directory",
               "ratio": ("per trial, ours / the mean of the fio runs just before and just after that trial (the "
                         "disk is shared and its speed drifts); median over trials, met if >= threshold"),
           },
           "configs": {}}

    def bracket(trial: int, key: str) -> float:
        near = fio_runs[trial:trial + 2]
        return statistics.fmean(f[key] for f in near)

    def entry(runs, xs, key):
        pairs = [(x, bracket(r["trial"], key)) for r, x in zip(runs, xs) if x is not None and not math.isnan(x)]
        if not pairs:
            return None
        ratios = [x / ref for x, ref in pairs]
        m = statistics.median(ratios)
        return {"gbps": statistics.median(x for x, _ in pairs), "fio_gbps": statistics.median(f for _, f in pairs),
                "ratio": m, "ratio_min": min(ratios), "ratio_max": max(ratios), "met": m >= 0.5,
                "runs": [x for x, _ in pairs], "fio_runs": [f for _, f in pairs]}

    for name, runs in configs.items():
        if name == "dram":
            continue
        disk = [r["summary"]["cache_stats"]["tiers"]["disk"] for r in runs]
        sc = [d.get("spill_counters", {}) for d in disk]
        bu = [r.get("burst", {}) for r in runs]
        r, w = "read_gbps", "write_gbps"
        c = {"in_workload": {
                 "read": entry(runs, [d["read_bandwidth_gbps"] for d in disk], r),
                 "read_wall": entry(runs, [x.get("read_bandwidth_gbps_wall", float("nan")) for x in sc], r),
                 "write_busy": entry(runs, [x.get("write_bandwidth_gbps_busy", float("nan")) for x in sc], w),
                 "write_wall": entry(runs, [d.get("write_bandwidth_gbps_wall", float("nan")) for d in disk], w)},
             "burst": {
                 "offload": entry(runs, [x.get("offload_gbps", float("nan")) for x in bu], w),
                 "promote": entry(runs, [x.get("promote_gbps", float("nan")) for x in bu], r)}}
        for part in c.values():
            for k in [k for k, v in part.items() if v is None]:
                del part[k]
        iw, b = c["in_workload"], c["burst"]
        if "read" in iw and "write_busy" in iw:
            c["met_in_workload"] = iw["read"]["met"] and iw["write_busy"]["met"]
        if "offload" in b and "promote" in b:
            c["met_burst"] = b["offload"]["met"] and b["promote"]["met"]
        out["configs"][name] = c
    return out


# ---------------------------------------------------------------------- plot -------
def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sys.path.insert(0, str(HERE))
    from _common import host_label  # noqa: E402

    agg = result["aggregate"]
    names = [n for n in CONFIGS if n in agg]
    xs = np.arange(len(names))
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))

    def bars(ax, series, ylabel, title, scale=1.0):
        width = 0.8 / len(series)
        for k, (label, metric) in enumerate(series):
            meds, lo, hi = [], [], []
            for n in names:
                s = agg[n].get(metric)
                if s is None or s["median"] is None or math.isnan(s["median"]):
                    meds.append(0), lo.append(0), hi.append(0)
                    continue
                meds.append(s["median"] * scale)
                lo.append((s["median"] - s["min"]) * scale), hi.append((s["max"] - s["median"]) * scale)
            ax.bar(xs + (k - (len(series) - 1) / 2) * width, meds, width, yerr=[lo, hi], capsize=3, label=label)
        ax.set_xticks(xs, [LABELS[n] for n in names], fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)

    bars(axes[0][0], [("KV tokens read (hits) + written / wall s", "storage_throughput_tokens_per_sec"),
                      ("KV tokens read from the store (hits) / wall s", "cache_served_tokens_per_sec")],
         "tokens/s", "storage throughput (wall clock, all users)")
    bars(axes[0][1], [("MLPerf's: generated tokens / summed I/O latency", "mlperf_storage_throughput_tokens_per_sec")],
         "tokens/s", "MLPerf's storage_throughput_tokens_per_sec (an efficiency ratio)")
    bars(axes[1][0], [("all reads", "cache_hit_rate"), ("multi-turn (earlier turns)", "multi_turn_hit_rate")],
         "hit rate (%)", "cache hit rate (pages; misses are recomputed)", scale=100)
    axes[1][0].axhline(30, color="r", ls="--", lw=0.8)
    bars(axes[1][1], [("read call, DRAM-hit", "dram_read_p95_ms"), ("read call, disk-hit", "disk_read_p95_ms"),
                      ("write call", "write_p95_ms"), ("end-to-end request", "e2e_p95_ms")],
         "ms", f"p95 latency (calls of <= {result['params']['batch_pages']} pages)")
    axes[1][1].set_yscale("log")
    t = result["target"]
    fio = t["fio_median"]
    fig.suptitle(f"mooncake-ray tiers, MLPerf-KV-cache-shaped workload ({result['params']['model']}, "
                 f"{result['params']['num_users']} users, {result['params']['page_tokens']}-token pages, "
                 f"{result['params']['trials']} trials, medians, bars min-max); fio seq 1 MiB: "
                 f"write {fio['write_gbps']:.2f} read {fio['read_gbps']:.2f} GB/s; {host_label(result.get('host'))}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------- main -------
AGG_METRICS = {
    "storage_throughput_tokens_per_sec": lambda s: s["storage_throughput_tokens_per_sec"],
    "mlperf_storage_throughput_tokens_per_sec": lambda s: s["mlperf_storage_throughput_tokens_per_sec"],
    "avg_throughput_tokens_per_sec": lambda s: s["avg_throughput_tokens_per_sec"],
    "cache_served_tokens_per_sec": lambda s: s["cache_served_tokens_per_sec"],
    "requests_per_second": lambda s: s["requests_per_second"],
    "cache_hit_rate": lambda s: s["cache_stats"]["cache_hit_rate"],
    "multi_turn_hit_rate": lambda s: s["cache_stats"]["multi_turn_hit_rate"],
    "decode_hit_rate": lambda s: s["cache_stats"]["decode_hit_rate"],
    "dram_read_p50_ms": lambda s: s["cache_stats"]["tiers"]["dram"]["read_latency_ms"]["p50"],
    "dram_read_p95_ms": lambda s: s["cache_stats"]["tiers"]["dram"]["read_latency_ms"]["p95"],
    "dram_read_p99_ms": lambda s: s["cache_stats"]["tiers"]["dram"]["read_latency_ms"]["p99"],
    "disk_read_p50_ms": lambda s: s["cache_stats"]["tiers"]["disk"]["read_latency_ms"]["p50"],
    "disk_read_p95_ms": lambda s: s["cache_stats"]["tiers"]["disk"]["read_latency_ms"]["p95"],
    "disk_read_p99_ms": lambda s: s["cache_stats"]["tiers"]["disk"]["read_latency_ms"]["p99"],
    "write_p50_ms": lambda s: s["storage_write_latency_ms"]["p50"],
    "write_p95_ms": lambda s: s["storage_write_latency_ms"]["p95"],
    "write_p99_ms": lambda s: s["storage_write_latency_ms"]["p99"],
    "e2e_p50_ms": lambda s: s["end_to_end_latency_ms"]["p50"],
    "e2e_p95_ms": lambda s: s["end_to_end_latency_ms"]["p95"],
    "access_p95_ms": lambda s: s["context_access_latency_ms"]["p95"],
    "total_read_gb": lambda s: s["cache_stats"]["total_read_gb"],
    "total_write_gb": lambda s: s["cache_stats"]["total_write_gb"],
    "nvme_bytes_read_gb": lambda s: s["cache_stats"]["tier_nvme_kv_bytes_read_gb"],
    "disk_read_gbps": lambda s: s["cache_stats"]["tiers"]["disk"]["read_bandwidth_gbps"],
    "disk_write_gbps_wall": lambda s: s["cache_stats"]["tiers"]["disk"].get("write_bandwidth_gbps_wall"),
    "disk_write_gbps_busy": lambda s: s["cache_stats"]["tiers"]["disk"].get("spill_counters", {}).get(
        "write_bandwidth_gbps_busy"),
    "misses": lambda s: s["cache_stats"]["misses"],
}
BURST_METRICS = ("put_gbps", "offload_gbps", "get_gbps", "promote_gbps", "spill_write_ms_per_object",
                 "spill_read_ms_per_object")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3.1-8b", choices=sorted(MODELS))
    ap.add_argument("--num-users", type=int, default=8)
    ap.add_argument("--page-tokens", type=int, default=16)
    ap.add_argument("--input-tokens", type=int, default=256, help="median new question length (lognormal)")
    ap.add_argument("--gen-tokens", type=int, default=128, help="median answer length (lognormal)")
    ap.add_argument("--max-input-tokens", type=int, default=1024)
    ap.add_argument("--max-gen-tokens", type=int, default=512)
    ap.add_argument("--max-context", type=int, default=2048, help="tokens; a longer conversation starts over")
    ap.add_argument("--system-prompt-tokens", type=int, default=256, help="shared prefix; 0: none")
    ap.add_argument("--duration", type=float, default=25.0, help="seconds per config (users finish their request)")
    ap.add_argument("--max-requests", type=int, default=0, help="requests per config, split over users; 0: no cap")
    ap.add_argument("--batch-pages", type=int, default=16,
                    help="pages per batch_put_from / batch_get_into call (16 x 16 tokens = 256, LMCache's chunk); "
                         "0: one call per access")
    ap.add_argument("--write-retry-s", type=float, default=10.0,
                    help="how long a put of a page is retried on a retryable error (NoCapacityError...)")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--dram", default="512mb", help="DRAM pool of dram and dram_nvme")
    ap.add_argument("--nvme-dram", default="64mb", help="DRAM pool of the NVMe-only approximation")
    ap.add_argument("--spill-capacity", default="8gb")
    ap.add_argument("--spill-dir", default=str(HERE.parent / "build"), help="on the disk under test")
    ap.add_argument("--sample-period", type=float, default=0.25, help="spill counter sampling (s)")
    ap.add_argument("--burst-pages", type=int, default=768,
                    help="pages put then read back at full speed after the workload (spill configs); 0: skip")
    ap.add_argument("--burst-threads", type=int, default=4)
    ap.add_argument("--fio-size", default="1g")
    ap.add_argument("--fio-runtime", type=float, default=3.0)
    ap.add_argument("--out", default=str(RESULTS / "bench_tiers.json"))
    args = ap.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if shutil.which("fio") is None:
        print("fio is not installed", file=sys.stderr)
        return 2
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        ap.error(f"unknown configs {bad}; choose from {CONFIGS}")
    bpt = MODELS[args.model]
    pt = args.page_tokens
    spec = {"bytes_per_token": bpt, "page_bytes": bpt * pt,
            "sys_pages": math.ceil(args.system_prompt_tokens / pt),
            "max_pages": args.max_context // pt,
            "max_input_pages": max(1, args.max_input_tokens // pt),
            "max_gen_pages": max(1, args.max_gen_tokens // pt)}
    if spec["sys_pages"] + spec["max_input_pages"] + spec["max_gen_pages"] > spec["max_pages"]:
        ap.error("--max-context must hold the system prompt + the longest question and answer")
    os.makedirs(args.spill_dir, exist_ok=True)
    fs = subprocess.run(["findmnt", "-n", "-o", "FSTYPE,SOURCE", "-T", args.spill_dir],
                        capture_output=True, text=True).stdout.strip()
    buffers_gb = args.num_users * spec["max_pages"] * spec["page_bytes"] / 1e9
    print(f"model {args.model}: {bpt // KiB} KiB/token, page {pt} tokens = {spec['page_bytes'] / MiB:.1f} MiB; "
          f"{args.num_users} users, context <= {args.max_context} tokens "
          f"({spec['max_pages'] * spec['page_bytes'] / MiB:.0f} MiB), client buffers {buffers_gb:.2f} GB; "
          f"spill dir {args.spill_dir} ({fs})", flush=True)

    import ray

    # address="local": a new instance even if /tmp/ray/ray_current_cluster names one (another
    # `ray start`, likely in another network namespace, unreachable from ours)
    ray.init(address="local", include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    sys.path.insert(0, str(HERE))
    from _common import host_info  # noqa: E402

    result = {"benchmark": "tiers", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": host_info(),
              "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
              "params": {**vars(args), **spec}, "spill_fs": fs, "load_avg_start": os.getloadavg(),
              "fio": [], "runs": {c: [] for c in configs}}
    try:
        for trial in range(args.trials):
            f = fio_round(args.spill_dir, args.fio_size, args.fio_runtime)
            result["fio"].append(f)
            print(f"trial {trial}: fio seq 1 MiB qd32 write {f['write_gbps']:.2f} GB/s, read {f['read_gbps']:.2f} GB/s",
                  flush=True)
            order = configs if trial % 2 == 0 else configs[::-1]  # alternate: noise is not always charged to one
            for name in order:
                r = run_config(name, args, spec, trial)
                result["runs"][name].append(r)
                s = r["summary"]
                cs = s["cache_stats"]
                tiers = cs["tiers"]
                print(f"  {name:9} {s['total_requests']:4d} req in {s['elapsed_time']:5.1f}s | "
                      f"{s['storage_throughput_tokens_per_sec']:8.0f} tok/s (MLPerf def "
                      f"{s['mlperf_storage_throughput_tokens_per_sec']:6.0f}) | hit {cs['cache_hit_rate']:.1%} "
                      f"(multi-turn {cs['multi_turn_hit_rate'] or 0:.1%}) | p95 read dram "
                      f"{tiers['dram']['read_latency_ms']['p95']:6.1f} disk {tiers['disk']['read_latency_ms']['p95']:6.1f} "
                      f"write {s['storage_write_latency_ms']['p95']:6.1f} ms | disk read "
                      f"{tiers['disk']['read_bandwidth_gbps']:.2f} GB/s, spill write busy "
                      f"{tiers['disk'].get('spill_counters', {}).get('write_bandwidth_gbps_busy', float('nan')):.2f} "
                      f"GB/s | errors r{cs['read_errors']} w{cs['write_errors_given_up']} (1st try {cs['write_errors_first_attempt']}) corrupt {cs['corrupt_pages']}"
                      + (f" | USER ERRORS {len(s['user_errors'])}" if s["user_errors"] else ""), flush=True)
                if "burst" in r:
                    b = r["burst"]
                    print(f"  {'':9} burst {b['bytes_gb']:.2f} GB: put {b['put_gbps']:.2f} GB/s, offload "
                          f"{b['offload_gbps']:.2f} GB/s ({b['spill_write_ms_per_object']:.1f} ms/object), read back "
                          f"{b['get_gbps']:.2f} GB/s, promote {b['promote_gbps']:.2f} GB/s "
                          f"({b['pages_promoted']}/{b['pages']} pages, {b['spill_read_ms_per_object']:.1f} ms/object)"
                          f"{', ERRORS ' + str(b['error_count']) if b['error_count'] else ''}", flush=True)
        f = fio_round(args.spill_dir, args.fio_size, args.fio_runtime)
        result["fio"].append(f)
        print(f"end: fio seq 1 MiB qd32 write {f['write_gbps']:.2f} GB/s, read {f['read_gbps']:.2f} GB/s", flush=True)
    finally:
        ray.shutdown()
    result["load_avg_end"] = os.getloadavg()
    result["aggregate"] = {name: {m: med([fn(r["summary"]) for r in runs]) for m, fn in AGG_METRICS.items()}
                           for name, runs in result["runs"].items() if runs}
    for name, runs in result["runs"].items():
        if runs and all("burst" in r for r in runs):
            result["aggregate"][name]["burst"] = {m: med([r["burst"][m] for r in runs]) for m in BURST_METRICS}
    result["target"] = nvme_target(result["runs"], result["fio"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(clean(result), indent=1, default=str))
    plot(result, out.with_suffix(".png"))
    report(result)
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def clean(x):
    """NaN -> null: strict JSON."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    return x


def report(result: dict) -> None:
    sys.path.insert(0, str(HERE))
    from _common import host_label  # noqa: E402

    agg = result["aggregate"]
    print(f"\nhost: {host_label(result.get('host'), model=True)}")
    print(f"medians over {result['params']['trials']} trials [min-max]")
    cols = [("storage_throughput_tokens_per_sec", "tok/s", "{:.0f}"),
            ("mlperf_storage_throughput_tokens_per_sec", "MLPerf tok/s", "{:.0f}"),
            ("cache_hit_rate", "hit", "{:.1%}"), ("multi_turn_hit_rate", "multi-turn hit", "{:.1%}"),
            ("dram_read_p95_ms", "DRAM rd p95 ms", "{:.1f}"), ("disk_read_p95_ms", "disk rd p95 ms", "{:.1f}"),
            ("write_p95_ms", "write p95 ms", "{:.1f}"), ("e2e_p95_ms", "e2e p95 ms", "{:.0f}")]
    for name, a in agg.items():
        cells = []
        for m, label, fmt in cols:
            s = a[m]
            if s["median"] is None or (isinstance(s["median"], float) and math.isnan(s["median"])):
                cells.append(f"{label} -")
            else:
                cells.append(f"{label} {fmt.format(s['median'])} [{fmt.format(s['min'])}-{fmt.format(s['max'])}]")
        print(f"{LABELS[name]:24} " + " | ".join(cells))
    print("\nMLPerf pass/fail criteria (median actual over trials; trials passed / judged):")
    for name, runs in result["runs"].items():
        cells = []
        for i, c in enumerate(runs[0]["summary"]["cache_stats"]["storage_health"]["criteria"]):
            got = [r["summary"]["cache_stats"]["storage_health"]["criteria"][i] for r in runs]
            judged = [g for g in got if g["passed"] is not None]
            if not judged:
                cells.append(f"{c['name']}: n/a")
                continue
            vals = [g.get("actual_ms", g.get("actual")) for g in judged]
            v = statistics.median(vals)
            shown = f"{v:.1%}" if "target" in c else f"{v:.0f} ms"
            cells.append(f"{c['name']}: {shown} ({sum(1 for g in judged if g['passed'])}/{len(judged)})")
        print(f"  {LABELS[name]:24} " + " | ".join(cells))
    t = result["target"]
    print(f"\nNVMe tier vs fio (fio medians: write {t['fio_median']['write_gbps']:.2f}, "
          f"read {t['fio_median']['read_gbps']:.2f} GB/s); per-trial ratio vs the fio runs around the trial, "
          f"median [min-max]; target >= 50%:")
    for name, c in t["configs"].items():
        for part in ("in_workload", "burst"):
            for key, x in c[part].items():
                print(f"  {LABELS[name]:24} {part + '.' + key:22} {x['gbps']:.3f} GB/s vs fio {x['fio_gbps']:.2f}: "
                      f"{x['ratio']:6.1%} [{x['ratio_min']:.1%}-{x['ratio_max']:.1%}] -> {'met' if x['met'] else 'missed'}")
        for key in ("met_in_workload", "met_burst"):
            if key in c:
                print(f"  {LABELS[name]:24} {key}: {'MET' if c[key] else 'MISSED'} (read and write)")


if __name__ == "__main__":
    sys.exit(main())
