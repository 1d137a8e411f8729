"""Does eviction keep KV chains whole? Multi-turn conversations through ``mooncake_ray.kv``
with a DRAM arena smaller than the working set.

A stored KV page is worth something only while every page before it in its chain is
stored too: a prefix lookup stops at the first miss. Plain LRU evicts a conversation's
oldest pages (its beginning) first and leaves the rest stored but out of reach. Chain-aware
eviction (``master.chain_eviction``: every page names its parent, leaves go first) should
keep whole prefixes instead.

Workload: ``--conversations`` chats of ``--turns`` turns. Turn t's prompt is the whole
history (``--system-tokens`` of system prompt, distinct per conversation, then the earlier
questions and answers) plus a new question of ``--question-tokens`` random token ids; an
answer of ``--answer-tokens`` random ids joins the history afterwards. Per turn: look the
prompt's pages up, load the leading hits into an engine page pool, fill the rest with
random bytes (the "computed" KV, each page stamped so that loads are checked) and save
the pages not loaded. Round t sends every conversation's turn t, one at a time, in a
seeded random order. The arena is ``--fractions`` of the working set (the bytes of every
conversation's last-turn prompt pages); no spill tier.

Configurations, each on a fresh store, interleaved over ``--repeats`` seeds:

- ``chain``:    mooncake_ray, ``master.chain_eviction: true``;
- ``chain-old``: the same with ``master.chain_insert: old`` (a new page enters the eviction
  order at its old end and moves to the recent end when read);
- ``lru``:      mooncake_ray, ``master.chain_eviction: false``;
- ``mooncake``: Mooncake Store (``mooncake_master`` + one ``mooncake_client`` store process
  holding a segment of the same bytes + a client-only ``MooncakeDistributedStore`` here,
  tcp), the same keys, bytes and call sequence (``batch_is_exist``, ``batch_get_into``,
  ``batch_put_from``). Mooncake refuses segments under 16 MiB (hence 32 KiB pages by default:
  25 % of the default working set is 21 MiB); a run it refuses is recorded with its error
  and skipped. Its ``is_exist`` and ``get`` lease the key (``--lease-ttl-s``, 10 s by default
  in both stores) and a leased key is not evicted: a whole run here lasts seconds, so every
  page looked up is held and puts fail for want of space instead (counted in ``failures``).
  Mooncake's figures at the default lease therefore owe much to the compressed time; rerun
  with ``--lease-ttl-s 0.05`` to see them without it (ours takes no lease on lookups).

Per round: the share of prompt tokens loaded from the store, orphaned pages (measured here,
the same way for all three: of every page a conversation's chain holds, the pages stored
whose previous page is not; mooncake_ray via ``batch_exists``, which takes no lease;
Mooncake via its master's ``/get_all_keys``, since its ``is_exist`` leases the key and
refreshes its LRU position) and the store's own counters (``orphaned_pages``,
``chain_tail_evictions``, ``evictions``), time per turn. Summary per fraction: median and
range over repeats of the share served over turns ``--from-turn``..end, the ratios
chain/lru and chain/mooncake, orphaned pages after the last round. Targets at 50 %:
chain serves >= 2x lru, and leaves no orphaned page.

    make bench B=benchmarks/bench_chains.py ARGS="--repeats 3"
    make bench B=benchmarks/bench_chains.py ARGS="--conversations 6 --turns 4 --repeats 1 --layers 16"  # quick

Writes benchmarks/results/bench_chains.json and bench_chains.png (``--replot FILE`` redraws
the plot from a JSON).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from _common import Processes, free_port, git_state, host_info, host_label, spread, versions, wait_port

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = ("chain", "chain-old", "lru", "mooncake")
MODEL = "bench/chains"
MOONCAKE_MIN_SEGMENT = 16 << 20  # mooncake_client: "Total size must be at least 16777216"
STORE_STATS = ("orphaned_pages", "chain_tail_evictions", "evictions", "evicted_bytes", "keys", "used", "capacity",
               "puts", "hits", "misses")


# ====================================================================== workload ==
class Workload:
    """Every conversation's token ids, generated up front from one seed: ``prompt(c, t)``
    is turn t's prompt (t from 0), ``order(t)`` the order of round t."""

    def __init__(self, args, seed: int):
        rng = np.random.default_rng(seed)
        ids = lambda n: rng.integers(1, 1 << 17, n).tolist()  # noqa: E731
        self.system = [ids(args.system_tokens) for _ in range(args.conversations)]
        self.questions = [[ids(args.question_tokens) for _ in range(args.turns)] for _ in range(args.conversations)]
        self.answers = [[ids(args.answer_tokens) for _ in range(args.turns)] for _ in range(args.conversations)]
        self.orders = [rng.permutation(args.conversations).tolist() for _ in range(args.turns)]

    def prompt(self, c: int, t: int) -> list[int]:
        out = list(self.system[c])
        for k in range(t):
            out += self.questions[c][k] + self.answers[c][k]
        return out + self.questions[c][t]

    def order(self, t: int) -> list[int]:
        return self.orders[t]


def working_set_pages(args) -> int:
    last = args.system_tokens + (args.turns - 1) * (args.question_tokens + args.answer_tokens) + args.question_tokens
    return args.conversations * (last // args.page_size)


def ideal_share(args, from_turn: int = 1) -> float:
    """The share an unbounded store serves: every full page of the previous turn's prompt."""
    num = den = 0
    for t in range(from_turn - 1, args.turns):
        prompt = args.system_tokens + t * (args.question_tokens + args.answer_tokens) + args.question_tokens
        prev = args.system_tokens + (t - 1) * (args.question_tokens + args.answer_tokens) + args.question_tokens
        num += (prev // args.page_size) * args.page_size if t > 0 else 0
        den += prompt
    return num / den


# ======================================================================= drivers ==
class OursDriver:
    """mooncake_ray through ``KVStore`` (it names each page's parent where the store supports it)."""

    def __init__(self, client, kv, pool):
        self.client, self.kv = client, kv
        kv.register_pool(pool)

    def lookup(self, tokens, keys) -> int:
        return self.kv.lookup(tokens, keys) // self.kv.geometry.page_size

    def load(self, tokens, keys, pool, n: int) -> int:
        return self.kv.load(tokens, pool, list(range(n)))

    def save(self, tokens, keys, pool, start: int, n: int) -> int:
        return self.kv.save(tokens, pool, list(range(start, n)), start_page=start)

    def present(self, chains: list[list[str]]) -> list[list[bool]]:
        flat = list(self.client.batch_exists([k for keys in chains for k in keys]))  # takes no lease
        out, i = [], 0
        for keys in chains:
            out.append(flat[i:i + len(keys)])
            i += len(keys)
        return out

    def store_stats(self) -> dict:
        st = self.client.stats()
        return {k: st.get(k) for k in STORE_STATS}

    def failures(self) -> dict:
        return dict(self.kv.failures)


class MooncakeDriver:
    """Mooncake Store's client, the same call sequence as ``KVStore`` (exists, get the leading
    hits, exists again and put the missing pages)."""

    def __init__(self, peer, geometry, pool):
        self.peer, self.s, self.g = peer, peer.store, geometry
        self.base = pool.tensor.data_ptr()
        rc = self.s.register_buffer(self.base, pool.tensor.numel() * pool.tensor.element_size())
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.register_buffer rc={rc}")
        self.fail: dict[str, int] = {}

    def _ptr(self, page_id: int) -> int:
        return self.base + page_id * self.g.page_bytes

    def _count(self, op, codes):
        for rc in codes:
            if rc < 0:
                k = f"{op}:{rc}"
                self.fail[k] = self.fail.get(k, 0) + 1

    def lookup(self, tokens, keys) -> int:
        n = 0
        for hit in self.s.batch_is_exist(keys):  # 1, 0, or -1 (an error: a miss here)
            if hit != 1:
                break
            n += 1
        return n

    def load(self, tokens, keys, pool, n: int) -> int:
        keys = keys[:n]
        sizes = self.s.batch_get_into(keys, [self._ptr(i) for i in range(n)], [self.g.page_bytes] * n)
        out = 0
        for size in sizes:
            if size != self.g.page_bytes:
                break
            out += 1
        return out

    def save(self, tokens, keys, pool, start: int, n: int) -> int:
        keys = keys[start:n]
        if not keys:
            return 0
        present = self.s.batch_is_exist(keys)
        todo = [(k, start + i) for i, (k, p) in enumerate(zip(keys, present)) if p != 1]
        if not todo:
            return 0
        res = self.s.batch_put_from([k for k, _ in todo], [self._ptr(i) for _, i in todo],
                                    [self.g.page_bytes] * len(todo))
        self._count("put", res)
        return sum(1 for r in res if r == 0)

    def present(self, chains: list[list[str]]) -> list[list[bool]]:
        stored = self.peer.all_keys()  # the master's key list: no lease, no LRU touch
        return [[k in stored for k in keys] for keys in chains]

    def store_stats(self) -> dict:
        return self.peer.eviction_metrics()

    def failures(self) -> dict:
        return dict(self.fail)


class MooncakePeer:
    """``mooncake_master`` (HTTP metadata server built in) + one ``mooncake_client`` store
    process holding the segment + a client-only ``MooncakeDistributedStore`` here (tcp), as
    in bench_transport.py; the master's eviction settings are ours."""

    def __init__(self, segment: int, local_buffer: int, high_watermark: float, evict_ratio: float, lease_ms: int):
        self.segment, self.local_buffer = segment, local_buffer
        self.hw, self.er, self.lease_ms = high_watermark, evict_ratio, lease_ms
        self.logdir = Path(tempfile.mkdtemp(prefix="bench-chains-mooncake-"))
        self.procs = Processes(self.logdir)
        self.store = None
        self.commands: list[str] = []

    @staticmethod
    def _bin(name: str) -> str:
        cand = Path(sys.executable).parent / name
        if cand.exists():
            return str(cand)
        import shutil

        found = shutil.which(name)
        if not found:
            raise FileNotFoundError(f"{name} not found next to {sys.executable} nor on PATH")
        return found

    def _spawn(self, name: str, args: list[str]):
        argv = [self._bin(name), *args]
        self.commands.append(" ".join(argv))
        return self.procs.start(name, argv)

    def start(self) -> None:
        # No address but loopback here: the transfer engine must be told to use 127.0.0.1.
        os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
        rpc, http, self.metrics_port, svc = (free_port() for _ in range(4))
        self.master_addr = f"127.0.0.1:{rpc}"
        self.metadata = f"http://127.0.0.1:{http}/metadata"
        master, mlog = self._spawn("mooncake_master", [
            "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
            "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={http}", "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}",
            f"--eviction_high_watermark_ratio={self.hw}", f"--eviction_ratio={self.er}",
            f"--default_kv_lease_ttl={self.lease_ms}"])
        wait_port(rpc, 30, master, mlog)
        wait_port(http, 30, master, mlog)
        wait_port(self.metrics_port, 30, master, mlog)
        store_proc, slog = self._spawn("mooncake_client", [
            f"--global_segment_size={self.segment}", f"--master_server_address={self.master_addr}",
            f"--metadata_server={self.metadata}", "--host=127.0.0.1", f"--port={svc}", "--protocol=tcp"])
        wait_port(svc, 60, store_proc, slog)
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        rc = self.store.setup("127.0.0.1", self.metadata, 0, self.local_buffer, "tcp", "", self.master_addr)
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup rc={rc}")
        deadline = time.monotonic() + 60
        while "127.0.0.1" not in self._http("get_all_segments"):  # the store process's segment is mounted
            if time.monotonic() > deadline or store_proc.poll() is not None:
                raise RuntimeError(f"Mooncake's segment never mounted; logs in {self.logdir}")
            time.sleep(0.2)

    def _http(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/{path}", timeout=30) as r:
            return r.read().decode()

    def all_keys(self) -> set[str]:
        return set(self._http("get_all_keys").split())

    def eviction_metrics(self) -> dict:
        """The master's Prometheus counters and gauges that name eviction, keys or memory use."""
        out = {}
        try:
            for line in self._http("metrics").splitlines():
                if line.startswith("#") or not line.strip():
                    continue
                name, _, value = line.rpartition(" ")
                if any(w in name for w in ("evict", "key_count", "allocated_mem_size", "total_mem_capacity")) \
                        and "{" not in name:
                    try:
                        out[name] = float(value)
                    except ValueError:
                        pass
        except OSError as e:
            out["error"] = str(e)
        return out

    def error_lines(self) -> list[str]:
        """Error and fatal lines of the processes' logs (what a refusal said)."""
        out = []
        for f in sorted(self.logdir.glob("*.log")):
            for line in f.read_text(errors="replace").splitlines():
                if line[:1] in ("E", "F") and line[1:5].isdigit():
                    out.append(f"{f.stem}: {line.strip()}")
        return out[-6:]

    def stop(self) -> None:
        if self.store is not None:
            try:
                self.store.close()
            except Exception:  # noqa: BLE001
                pass
            self.store = None
        self.procs.stop_all()  # only the processes started here, by pid


# =========================================================================== runs ==
def run_one(cfg: str, frac: float, rep: int, args, geometry, wl: Workload, arena: int) -> dict:
    import torch

    import mooncake_ray
    from mooncake_ray.kv import KVStore, PagePool, key_prefix, page_hashes

    row = {"config": cfg, "fraction": frac, "repeat": rep, "seed": args.seed + rep, "arena_bytes": arena}
    max_pages = working_set_pages(args) // args.conversations
    pool = PagePool(geometry, max_pages, "page_first")
    pages_u8 = pool.tensor.view(torch.uint8).numpy().reshape(max_pages, geometry.page_bytes)
    prefix = key_prefix(MODEL, geometry, "page_first")
    rng = np.random.default_rng(args.seed + 1000 + rep)
    ns, peer, t_up = None, None, time.perf_counter()
    try:
        if cfg == "mooncake":
            if arena < MOONCAKE_MIN_SEGMENT:
                row["skipped"] = (f"arena {arena} B is under Mooncake's minimum segment: mooncake_client "
                                  f"says 'Total size must be at least {MOONCAKE_MIN_SEGMENT}' and aborts")
                return row
            peer = MooncakePeer(arena, args.mooncake_local_buffer, args.high_watermark, args.evict_ratio,
                                int(args.lease_ttl_s * 1000))
            atexit.register(peer.stop)
            try:
                peer.start()
            except Exception as e:  # noqa: BLE001
                row["skipped"] = f"Mooncake did not start: {e}"
                row["mooncake_errors"] = peer.error_lines()
                return row
            row["mooncake_commands"] = peer.commands
            drv = MooncakeDriver(peer, geometry, pool)
        else:
            ns = f"bench_chains_{cfg}_{rep}_{int(frac * 1000)}"
            client = mooncake_ray.start({
                "namespace": ns, "segment_size_bytes": arena, "transport": {"devices": ["lo"]},
                "master": {"chain_eviction": cfg != "lru",
                           "chain_insert": "old" if cfg == "chain-old" else "recent", "high_watermark": args.high_watermark,
                           "evict_ratio": args.evict_ratio, "lease_ttl_s": args.lease_ttl_s}})
            drv = OursDriver(client, KVStore(client, MODEL, geometry, "page_first"), pool)
        row["startup_s"] = time.perf_counter() - t_up

        chains: dict[int, list[str]] = {}  # every page key each conversation's chain holds so far
        rounds, bad_loads = [], 0
        ps = geometry.page_size
        for t in range(args.turns):
            recs = []
            for c in wl.order(t):
                tokens = wl.prompt(c, t)
                keys = [prefix + h for h in page_hashes(tokens, ps)]
                n = len(keys)
                t0 = time.perf_counter()
                hit = drv.lookup(tokens, keys)
                loaded = drv.load(tokens, keys, pool, hit) if hit else 0
                t_loaded = time.perf_counter()
                # loaded pages must carry their own key's stamp (outside the timed part)
                for i in range(loaded):
                    if pages_u8[i, :8].tobytes() != bytes.fromhex(keys[i][-16:]):
                        bad_loads += 1
                # the pages not loaded are "computed": random bytes, stamped with their key
                t_fill = time.perf_counter()
                if n > loaded:
                    pages_u8[loaded:n] = rng.integers(0, 256, (n - loaded, geometry.page_bytes), dtype=np.uint8)
                    for i in range(loaded, n):
                        pages_u8[i, :8] = np.frombuffer(bytes.fromhex(keys[i][-16:]), dtype=np.uint8)
                t_fill = time.perf_counter() - t_fill
                t1 = time.perf_counter()
                stored = drv.save(tokens, keys, pool, loaded, n) if n > loaded else 0
                t_end = time.perf_counter()
                chains[c] = keys
                recs.append({"conv": c, "prompt_tokens": len(tokens), "hit_tokens": hit * ps,
                             "loaded_tokens": loaded * ps, "saved_pages": stored, "pages": n,
                             "turn_s": (t_loaded - t0) + (t_end - t1), "load_s": t_loaded - t0, "save_s": t_end - t1,
                             "fill_s": t_fill})
            orphaned = unreachable = stored_pages = 0
            for keys, present in zip(chains.values(), drv.present(list(chains.values()))):
                stored_pages += sum(present)
                orphaned += sum(1 for i in range(1, len(keys)) if present[i] and not present[i - 1])
                first_gap = next((i for i, p in enumerate(present) if not p), len(present))
                unreachable += sum(present[first_gap:])
            prompt = sum(r["prompt_tokens"] for r in recs)
            turn_ms = sorted(1e3 * r["turn_s"] for r in recs)
            rounds.append({"turn": t + 1, "prompt_tokens": prompt, "loaded_tokens": sum(r["loaded_tokens"] for r in recs),
                           "hit_tokens": sum(r["hit_tokens"] for r in recs),
                           "served_pct": 100.0 * sum(r["loaded_tokens"] for r in recs) / prompt,
                           "saved_pages": sum(r["saved_pages"] for r in recs),
                           "orphaned_pages": orphaned, "unreachable_pages": unreachable, "stored_pages": stored_pages,
                           "store": drv.store_stats(), "turn_ms_mean": statistics.mean(turn_ms),
                           "turn_ms_p50": turn_ms[len(turn_ms) // 2], "turn_ms_max": turn_ms[-1],
                           "fill_ms_mean": 1e3 * statistics.mean(r["fill_s"] for r in recs)})
            st = rounds[-1]["store"]
            own = (f" | store orphaned {st.get('orphaned_pages')} tail-ev {st.get('chain_tail_evictions')} "
                   f"ev {st.get('evictions')}") if cfg != "mooncake" else ""
            print(f"    turn {t + 1:2}: served {rounds[-1]['served_pct']:5.1f}%  orphaned {orphaned:4}  unreachable "
                  f"{unreachable:4}  stored {stored_pages:5}  turn {rounds[-1]['turn_ms_mean']:6.1f} ms{own}", flush=True)
        sel = [r for r in rounds if r["turn"] >= args.from_turn]
        row.update({
            "rounds": rounds,
            "served_pct": 100.0 * sum(r["loaded_tokens"] for r in rounds) / sum(r["prompt_tokens"] for r in rounds),
            "served_pct_from_turn": 100.0 * sum(r["loaded_tokens"] for r in sel) / sum(r["prompt_tokens"] for r in sel),
            "orphaned_last": rounds[-1]["orphaned_pages"], "unreachable_last": rounds[-1]["unreachable_pages"],
            "store_orphaned_last": rounds[-1]["store"].get("orphaned_pages"),
            "turn_ms_mean": statistics.mean(r["turn_ms_mean"] for r in rounds),
            "bad_loads": bad_loads, "failures": drv.failures()})
        return row
    finally:
        if ns is not None:
            mooncake_ray.shutdown(namespace=ns, stop_ray=False)
        if peer is not None:
            peer.stop()


# ======================================================================== summary ==
def summarize(rows: list[dict], args) -> dict:
    out = {}
    for frac in args.fraction_list:
        per = {}
        for cfg in args.config_list:
            runs = [r for r in rows if r["fraction"] == frac and r["config"] == cfg and "rounds" in r]
            skipped = [r.get("skipped") for r in rows if r["fraction"] == frac and r["config"] == cfg and "skipped" in r]
            per[cfg] = {"served_pct_from_turn": spread([r["served_pct_from_turn"] for r in runs]),
                        "served_pct": spread([r["served_pct"] for r in runs]),
                        "orphaned_last": spread([r["orphaned_last"] for r in runs]),
                        "unreachable_last": spread([r["unreachable_last"] for r in runs]),
                        "stored_pages_last": spread([r["rounds"][-1]["stored_pages"] for r in runs]),
                        "store_orphaned_last": spread([r["store_orphaned_last"] for r in runs]),
                        "turn_ms_mean": spread([r["turn_ms_mean"] for r in runs]),
                        "runs": len(runs), "skipped": skipped or None}

        def ratio(a, b):
            pa, pb = per.get(a, {}).get("served_pct_from_turn"), per.get(b, {}).get("served_pct_from_turn")
            if not pa or not pb or not pb["median"]:
                return None
            paired = []
            for ra in rows:
                if ra["fraction"] == frac and ra["config"] == a and "rounds" in ra:
                    rb = next((r for r in rows if r["fraction"] == frac and r["config"] == b and "rounds" in r
                               and r["repeat"] == ra["repeat"]), None)
                    if rb and rb["served_pct_from_turn"]:
                        paired.append(ra["served_pct_from_turn"] / rb["served_pct_from_turn"])
            return {"of_medians": pa["median"] / pb["median"], "paired": spread(paired)}

        out[str(frac)] = {"configs": per, "chain_over_lru": ratio("chain", "lru"),
                          "chain_old_over_lru": ratio("chain-old", "lru"),
                          "chain_over_mooncake": ratio("chain", "mooncake"),
                          "chain_old_over_mooncake": ratio("chain-old", "mooncake")}
    s = out.get("0.5")
    if s:
        r, r_old = s["chain_over_lru"], s["chain_old_over_lru"]
        orph = s["configs"].get("chain", {}).get("orphaned_last")
        out["targets"] = {
            "chain_served_ge_2x_lru_at_50pct": {"value": r and r["of_medians"], "goal": 2.0,
                                                "met": bool(r and r["of_medians"] >= 2.0)},
            "chain_old_served_ge_2x_lru_at_50pct": {"value": r_old and r_old["of_medians"], "goal": 2.0,
                                                    "met": bool(r_old and r_old["of_medians"] >= 2.0)},
            "chain_orphaned_zero_at_50pct": {"value": orph and orph["max"], "goal": 0,
                                             "met": bool(orph is not None and orph["max"] == 0)}}
    return out


# =========================================================================== plot ==
COLORS = {"chain": "tab:green", "chain-old": "tab:olive", "lru": "tab:red", "mooncake": "tab:blue"}


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = res["args"]
    fracs = a["fraction_list"]
    fig, axes = plt.subplots(2, len(fracs), figsize=(5.5 * len(fracs), 7.5), squeeze=False, sharex=True)
    for j, frac in enumerate(fracs):
        ax, bx = axes[0][j], axes[1][j]
        for cfg in a["config_list"]:
            runs = [r for r in res["runs"] if r["fraction"] == frac and r["config"] == cfg and "rounds" in r]
            if not runs:
                continue
            turns = [rd["turn"] for rd in runs[0]["rounds"]]
            for key, axis, style, label in (("served_pct", ax, "-", cfg), ("orphaned_pages", bx, "-", f"{cfg} orphaned"),
                                            ("unreachable_pages", bx, "--", f"{cfg} unreachable")):
                vals = [[r["rounds"][i][key] for r in runs] for i in range(len(turns))]
                axis.plot(turns, [statistics.median(v) for v in vals], style, marker="o", ms=3, color=COLORS[cfg],
                          label=label)
                axis.fill_between(turns, [min(v) for v in vals], [max(v) for v in vals], color=COLORS[cfg], alpha=0.15)
            own = [[r["rounds"][i]["store"].get("orphaned_pages") for r in runs] for i in range(len(turns))]
            if cfg != "mooncake" and all(x is not None for v in own for x in v):
                bx.plot(turns, [statistics.median(v) for v in own], ":", color=COLORS[cfg],
                        label=f"{cfg} orphaned (store's count)")
        ax.plot(range(1, a["turns"] + 1), res["ideal_served_pct_by_turn"], "--", color="gray", label="unbounded store")
        ax.set_title(f"arena = {frac:.0%} of the working set ({res['arena_bytes'][str(frac)] / 2**20:.1f} MiB)")
        ax.set_ylabel("prompt tokens served from the store (%)")
        ax.set_ylim(0, 100)
        bx.set_ylabel("pages after the round: orphaned (—), stored\nbut unreachable from the chain's start (--)")
        bx.xaxis.get_major_locator().set_params(integer=True)
        bx.set_xlabel("turn (round)")
        for axis in (ax, bx):
            axis.grid(alpha=0.3)
            axis.legend(fontsize=8)
    skips = sorted({f"{r['config']} @ {r['fraction']:.0%}" for r in res["runs"] if "skipped" in r})
    fig.suptitle(f"KV chains under eviction: {a['conversations']} conversations x {a['turns']} turns, "
                 f"{res['page_bytes'] >> 10} KiB pages, median and range over {a['repeats']} repeat(s) "
                 f"({host_label(res.get('host'))})" + (f"\nskipped: {', '.join(skips)}" if skips else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# =========================================================================== main ==
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--question-tokens", type=int, default=128)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16, help="tokens per page")
    ap.add_argument("--layers", type=int, default=4, help="KV geometry: layers (4 x 2 heads x 64 x bf16: 32 KiB pages)")
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--fractions", default="0.25,0.5", help="arena sizes as fractions of the working set")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--from-turn", type=int, default=4, help="the summary's share counts turns from this one")
    ap.add_argument("--high-watermark", type=float, default=0.9, help="both stores (ours' and Mooncake's default)")
    ap.add_argument("--evict-ratio", type=float, default=0.05, help="both stores (ours' and Mooncake's default)")
    ap.add_argument("--lease-ttl-s", type=float, default=10.0, help="read lease, both stores (both defaults: 10 s)")
    ap.add_argument("--mooncake-local-buffer", type=int, default=16 << 20)
    ap.add_argument("--out", default=str(RESULTS / "bench_chains.json"))
    ap.add_argument("--replot", metavar="JSON", help="only redraw the plot of a results file")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), Path(args.replot).with_suffix(".png"))
        return
    args.fraction_list = [float(f) for f in args.fractions.split(",") if f]
    args.config_list = [c for c in args.configs.split(",") if c]
    bad = set(args.config_list) - set(CONFIGS)
    if bad:
        sys.exit(f"unknown configs {sorted(bad)}; allowed: {','.join(CONFIGS)}")
    names = sorted(n for _, n in socket.if_nameindex())
    if names != ["lo"]:
        sys.exit(f"run inside a private network namespace (interfaces: {names}): "
                 "make bench B=benchmarks/bench_chains.py")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run atexit: stop Mooncake's processes
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("GLOG_minloglevel", "1")  # Mooncake's in-process client: warnings and up

    from mooncake_ray.kv import KVGeometry

    geometry = KVGeometry(num_layers=args.layers, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                          dtype=args.dtype, page_size=args.page_size)
    ws_pages = working_set_pages(args)
    ws_bytes = ws_pages * geometry.page_bytes
    arenas = {f: max(1 << 20, int(f * ws_pages) * geometry.page_bytes) for f in args.fraction_list}
    ideal_by_turn = []
    for t in range(args.turns):  # one turn's share in an unbounded store
        p = args.system_tokens + t * (args.question_tokens + args.answer_tokens) + args.question_tokens
        q = args.system_tokens + (t - 1) * (args.question_tokens + args.answer_tokens) + args.question_tokens
        ideal_by_turn.append(100.0 * (q // args.page_size * args.page_size) / p if t else 0.0)
    host = host_info()
    print(f"host: {host_label(host, model=True)}; page {geometry.page_bytes >> 10} KiB, working set {ws_pages} pages "
          f"= {ws_bytes / 2**20:.1f} MiB; arenas " + ", ".join(f"{f:.0%}: {b / 2**20:.1f} MiB" for f, b in arenas.items())
          + f"; unbounded store serves {100 * ideal_share(args, args.from_turn):.1f}% of turns {args.from_turn}+",
          flush=True)

    import ray

    # A local Ray of our own (never whatever cluster /tmp/ray names); each run its own store.
    ray.init(address="local", include_dashboard=False, logging_level="WARNING", log_to_driver=False,
             object_store_memory=128 << 20)
    git = git_state()
    rows, t_start = [], time.perf_counter()
    try:
        for rep in range(args.repeats):
            wl = Workload(args, args.seed + rep)
            for frac in args.fraction_list:
                k = rep * len(args.fraction_list) + args.fraction_list.index(frac)
                order = args.config_list[k % len(args.config_list):] + args.config_list[:k % len(args.config_list)]
                for cfg in order:
                    print(f"[repeat {rep + 1}/{args.repeats}] {cfg} @ {frac:.0%} ({arenas[frac] / 2**20:.1f} MiB)",
                          flush=True)
                    t = time.perf_counter()
                    row = run_one(cfg, frac, rep, args, geometry, wl, arenas[frac])
                    row["wall_s"] = time.perf_counter() - t
                    rows.append(row)
                    if "skipped" in row:
                        print(f"    skipped: {row['skipped']}" + "".join(f"\n      {e}" for e in row.get("mooncake_errors", [])),
                              flush=True)
                    else:
                        print(f"    served {row['served_pct_from_turn']:.1f}% of turns {args.from_turn}+, orphaned "
                              f"{row['orphaned_last']}, {row['turn_ms_mean']:.1f} ms/turn, bad loads {row['bad_loads']}, "
                              f"failures {row['failures'] or 'none'} ({row['wall_s']:.1f}s)", flush=True)
    finally:
        ray.shutdown()
    summary = summarize(rows, args)
    ver = versions(["mooncake-ray", "ray", "torch", "numpy", "mooncake-transfer-engine-non-cuda"])
    chain_landed = any(r.get("store_orphaned_last") is not None for r in rows)
    res = {"description": "share of prompt tokens served and orphaned pages under eviction, multi-turn KV chains",
           "args": {k: v for k, v in vars(args).items() if k != "replot"}, "host": host, "versions": ver, "git": git,
           "page_bytes": geometry.page_bytes, "working_set_pages": ws_pages, "working_set_bytes": ws_bytes,
           "arena_bytes": {str(f): b for f, b in arenas.items()},
           "ideal_served_pct_by_turn": ideal_by_turn,
           "ideal_served_pct_from_turn": 100 * ideal_share(args, args.from_turn),
           "store_chain_stats_reported": chain_landed,
           "orphan_probe": {"ours": "client.batch_exists over each chain (takes no lease)",
                            "mooncake": "GET /get_all_keys on the master's metrics port (no lease, no LRU touch)"},
           "notes": ["Mooncake leases a key on is_exist/get for --lease-ttl-s and never evicts a leased key; "
                     "a run lasts seconds, so at the default 10 s every page looked up stays and puts fail "
                     "(-200, no space) instead: compare with --lease-ttl-s 0.05",
                     "mooncake_client refuses a global segment under 16 MiB"],
           "wall_s": time.perf_counter() - t_start, "summary": summary, "runs": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    plot(res, out.with_suffix(".png"))

    print(f"\nserved from the store, turns {args.from_turn}-{args.turns} (median [min-max] over {args.repeats}); "
          f"unbounded store: {res['ideal_served_pct_from_turn']:.1f}%")
    for frac in args.fraction_list:
        s = summary[str(frac)]
        parts = []
        for cfg in args.config_list:
            c = s["configs"][cfg]
            if c["served_pct_from_turn"]:
                v, o = c["served_pct_from_turn"], c["orphaned_last"]
                parts.append(f"{cfg} {v['median']:.1f}% [{v['min']:.1f}-{v['max']:.1f}] orphaned {o['median']:g}")
            else:
                parts.append(f"{cfg} skipped")
        ratios = [(name.replace("_over_", "/").replace("chain_old", "chain-old"), r)
                  for name, r in s.items() if name.endswith(("_over_lru", "_over_mooncake"))]
        print(f"  {frac:.0%}: " + "; ".join(parts)
              + "".join(f"; {name} x{r['of_medians']:.2f}" for name, r in ratios if r))
    for name, t in summary.get("targets", {}).items():
        print(f"  target {name}: {t['value']} (goal {t['goal']}) -> {'met' if t['met'] else 'NOT met'}")
    if not chain_landed:
        print("  (the store's stats carry no orphaned_pages: chain-aware eviction is not (fully) in the tree measured)")
    print(f"wrote {out} and {out.with_suffix('.png')} in {res['wall_s']:.0f}s")


if __name__ == "__main__":
    main()
