"""Does eviction keep KV chains whole, and does the store's default insertion policy serve as
much as the better fixed one? Multi-turn conversations through ``mooncake_ray.kv`` with a
DRAM arena smaller than the working set.

A stored KV page is worth something only while every page before it in its chain is
stored too: a prefix lookup stops at the first miss. Plain LRU evicts a conversation's
oldest pages (its beginning) first and leaves the rest stored but out of reach. Chain-aware
eviction (``master.chain_eviction``: every page names its parent, leaves go first) should
keep whole prefixes instead. Where a new page enters the eviction order
(``master.chain_insert``) decides which whole prefixes stay: at the recent end (LRU) suits
conversations that come back soon, at the old end suits many conversations taking turns
(each is LRU's least recent just before its next turn); the default adapts to the workload.

Conversations: turn t's prompt is the whole history (``--system-tokens`` of system prompt,
distinct per conversation, then the earlier questions and answers) plus a new question of
``--question-tokens`` random token ids; an answer of ``--answer-tokens`` random ids joins the
history afterwards; every conversation has ``--turns`` turns. Per turn: look the prompt's
pages up, load the leading hits into an engine page pool, fill the rest with random bytes
(the "computed" KV, each page stamped so that loads are checked) and save the pages not
loaded.

Workloads (``--workloads``), each measured for every fraction and configuration:

- ``rounds``: ``--conversations`` conversations (24); round t sends every conversation's turn
  t, one at a time, in a seeded random order (SGLang's multi-turn benchmark with its round
  barrier; LRU's worst case). Counted: turns ``--from-turn``..end.
- ``recency``: ``--recency-conversations`` conversations (default 3x ``--conversations``: 72)
  arrive over time, at most ``--active`` (8) live at once; each step one live conversation,
  picked at random (seeded), speaks its next turn; one that has spoken all its turns leaves
  and the next new one starts. A conversation's next turn comes after 7 others on average
  (median 5, at most about 30; the JSON records them per seed). Prefill -> decode handoffs
  go through the store: after ``--handoff-delay`` (2) other turns, a decode reads back
  (``load`` from the turn's first unloaded page, into a pool of its own) exactly the pages
  the turn saved (ours: saved with ``KVStore.save(handoff_s=--handoff-hold-s)``, held until
  that ``load(..., handoff=True)``; 0 saves it like any other turn). A conversation whose
  decode is pending does not speak (its answer is not out yet); if every live one waits, the oldest decode runs at once. Handoff pages missed:
  from a decode's first missing page on (a decode cannot use a page after a gap). Counted:
  every turn after the first ``--conversations`` (warm-up).
- ``shift``: the shape changes halfway: ``--conversations`` conversations in the ``rounds``
  shape, then ``--conversations`` new ones in the ``recency`` shape with its handoffs, as
  many turns in each half (``--shift-order recency-first`` reverses the halves). The share is
  reported per phase: phase 1 counted as its shape alone, phase 2 every turn (the policy's
  reaction to the shift is what it measures).

Working set: the ``rounds`` one, every one of its ``--conversations`` conversations' last-turn
prompt pages (85.5 MiB by default). Every workload runs at the same arenas, ``--fractions``
of it (no spill tier), so each ``shift`` phase runs where its shape does alone. In ``recency``
the live conversations take at most ``--active`` / ``--conversations`` of it (28.5 MiB) and
its conversations put 3x it in all: its arenas are under what it puts, around what stays in
use. (An arena under the live conversations' KV makes 8 conversations taking turns LRU's
worst case again, and leaves no room for a turn's pages until its decode: at the defaults,
``--fractions 0.083,0.167`` measures ``recency`` at 25 % and 50 % of it.) The JSON
records each workload's definition, its live conversations' KV and the pages put in all
against the arena, and per seed the other turns between a conversation's consecutive turns.

Our store runs on one store node, or with ``--store-nodes N`` on a local cluster of N store
nodes, each holding 1/N of the arena, the benchmark's driver on a head without one (a KV
chain then spans nodes wherever its pages are put; chain-aware eviction places a page
beside its parent).

Configurations, each on a fresh store, interleaved over ``--repeats`` seeds:

- ``chain``:        mooncake_ray with its default eviction: ``master.chain_eviction: true``
  and no ``chain_insert`` given (the store's default: ``adaptive`` where the store has it);
- ``chain-recent``: the same with ``master.chain_insert: recent`` (a new page enters the
  eviction order at its recent end: LRU order);
- ``chain-old``:    the same with ``master.chain_insert: old`` (a new page enters at the old
  end and moves to the recent end when read);
- ``lru``:          mooncake_ray, ``master.chain_eviction: false``;
- ``mooncake``:     Mooncake Store (``mooncake_master`` + one ``mooncake_client`` store process
  holding a segment of the same bytes + a client-only ``MooncakeDistributedStore`` here,
  tcp), the same keys, bytes and call sequence (``batch_is_exist``, ``batch_get_into``,
  ``batch_put_from``). Mooncake refuses segments under 16 MiB (hence 32 KiB pages by default:
  25 % of the working set is 21 MiB); a run it refuses is recorded with its error and
  skipped. Its ``is_exist`` and ``get`` lease the key (``--lease-ttl-s``, 10 s by default in
  both stores) and a leased key is not evicted: a whole run here lasts seconds, so every
  page looked up is held and puts fail for want of space instead (counted in ``failures``).
  Mooncake's figures at the default lease therefore owe much to the compressed time (in
  ``shift``, the first phase's pages hold the arena through the second); rerun with
  ``--lease-ttl-s 0.05`` to see them without it (ours takes no lease on lookups and ends a
  read's lease with the read).

Per round (``rounds``: one turn of every conversation; ``recency``: every ``--conversations``
turns; ``shift``: either, by phase): the share of prompt tokens loaded from the store,
handoff pages read back and missed, orphaned pages (measured here, the same way for every
store: of every page a conversation's chain holds, the pages stored whose previous page is
not; mooncake_ray via ``batch_exists``, which takes no lease; Mooncake via its master's
``/get_all_keys``, since its ``is_exist`` leases the key and refreshes its LRU position), the
store's own counters (``orphaned_pages``, ``chain_tail_evictions``, ``evictions``, and as-is
every ``stats()`` key starting with ``eviction_policy``: which insertion policy the store
chose), time per turn. Summary per workload and fraction: median [min-max] over repeats of
the counted share (per phase for ``shift``), handoff pages missed, orphaned pages after the
last round, and the ratios chain/mooncake, chain/lru and chain/best fixed (the better median
of chain-recent and chain-old). Targets, at 50 % and 25 % of the working set:

- ``rounds``: chain serves >= 1.25x mooncake and >= 2x lru, and leaves no orphaned page;
- ``recency``: chain serves >= 0.95x the best fixed policy and misses no handoff page;
- ``shift``: chain serves >= 0.9x the better fixed policy in each phase.

Against what is possible: per workload and fraction, the share an offline optimal eviction
serves with the whole arena (``optimal_pct_counted``, Belady's MIN over the schedule,
counting every page present: a bound no policy reaches, ``Workload.optimal_pct``), drawn
dotted in the plot; ``ratios["chain_over_optimal"]``. In ``rounds`` at the defaults it is
33.9 % at 25 % of the working set and 65.1 % at 50 %: 1.25x Mooncake's 24.7 % and 53.6 %
(``bench_chains_slab_fit.json``) would be 30.9 % and 67.0 %, the second above it.

Run it (the second line is a quick check: with ``--active`` a third of ``--conversations`` as
at the defaults):

    make bench B=benchmarks/bench_chains.py ARGS="--repeats 3"
    make bench B=benchmarks/bench_chains.py ARGS="--conversations 6 --active 2 --turns 4 --repeats 1 --layers 16"

Writes benchmarks/results/bench_chains.json and bench_chains.png, one panel per workload and
fraction (``--replot FILE`` redraws the plot from a JSON).
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
from collections import deque
from pathlib import Path
from typing import NamedTuple

import numpy as np

from _common import (Processes, belady_min_pct, free_port, git_state, host_info, host_label, local_ray, spread,
                     store_cluster, versions, wait_port)

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = ("chain", "chain-recent", "chain-old", "lru", "mooncake", "chain-sharded")
DEFAULT_CONFIGS = CONFIGS[:5]  # chain-sharded: by name (--configs), against chain
FIXED = ("chain-recent", "chain-old")  # the fixed insertion policies "best fixed" picks from
# master settings per configuration of ours; "chain" passes no chain_insert: the store's default
MASTER = {"chain": {"chain_eviction": True},
          "chain-recent": {"chain_eviction": True, "chain_insert": "recent"},
          "chain-old": {"chain_eviction": True, "chain_insert": "old"},
          "lru": {"chain_eviction": False},
          "chain-sharded": {"chain_eviction": True}}  # and master.shards: --shards
WORKLOADS = ("rounds", "recency", "shift")
MODEL = "bench/chains"
MOONCAKE_MIN_SEGMENT = 16 << 20  # mooncake_client: "Total size must be at least 16777216"
STORE_STATS = ("orphaned_pages", "chain_tail_evictions", "evictions", "evicted_bytes", "keys", "used", "capacity",
               "puts", "hits", "misses", "chained", "chain_remote_children", "chain_messages")


# ====================================================================== workload ==
def prompt_tokens(args, t: int) -> int:
    """Turn t's prompt length (t from 0): the same for every conversation."""
    return args.system_tokens + t * (args.question_tokens + args.answer_tokens) + args.question_tokens


def last_pages(args) -> int:
    """Full pages of a conversation's last prompt: the most its chain holds."""
    return prompt_tokens(args, args.turns - 1) // args.page_size


def live_max(kind: str, args) -> int:
    """The most conversations live (started, not finished) at once in a workload."""
    recency = min(args.active, args.conversations if kind == "shift" else args.recency_conversations)
    return {"rounds": args.conversations, "recency": recency, "shift": max(args.conversations, recency)}[kind]


def working_set_pages(args) -> int:
    """Every workload's arenas are fractions of this: the ``rounds`` working set, every one of
    its ``--conversations`` conversations' last-turn prompt pages."""
    return args.conversations * last_pages(args)


class Event(NamedTuple):
    """One step of a schedule: ``kind`` "turn" (conversation ``conv`` speaks its turn ``turn``,
    from 0; ``counted``: the summary's share counts it) or "handoff" (the decode reads back
    what that turn saved), in ``phase`` 1 (or 2: ``shift``'s second half)."""
    kind: str
    conv: int
    turn: int
    counted: bool
    phase: int


class Workload:
    """One workload's token ids and schedule, generated up front from one seed. ``prompt(c, t)``
    is turn t's prompt (t from 0); ``rounds`` the schedule, a list of rounds (the unit of the
    per-round figures), each a list of ``Event``; ``handed_off`` the (conv, turn) pairs a
    decode reads back. The ``rounds`` workload draws the same ids and orders from a seed as
    this benchmark did before the other workloads."""

    def __init__(self, kind: str, args, seed: int):
        self.args, self.kind = args, kind
        rng = np.random.default_rng(seed)
        self.system: list[list[int]] = []
        self.questions: list[list[list[int]]] = []
        self.answers: list[list[list[int]]] = []
        self.handed_off: set[tuple[int, int]] = set()
        c = args.conversations
        if kind == "rounds":
            self.rounds = self._rounds_shape(self._add(c, rng), c, rng, 1)
        elif kind == "recency":
            self.rounds = self._recency_shape(self._add(args.recency_conversations, rng), args.recency_conversations,
                                              rng, 1)
        else:
            shapes = (self._rounds_shape, self._recency_shape)
            first, second = shapes if args.shift_order == "rounds-first" else shapes[::-1]
            self.rounds = first(self._add(c, rng), c, rng, 1) + second(self._add(c, rng), c, rng, 2, count_all=True)

    def _add(self, n: int, rng) -> int:
        """Token ids of ``n`` new conversations (system prompts, then questions, then answers);
        returns the first one's id."""
        a = self.args
        ids = lambda k: rng.integers(1, 1 << 17, k).tolist()  # noqa: E731
        base = len(self.system)
        self.system += [ids(a.system_tokens) for _ in range(n)]
        self.questions += [[ids(a.question_tokens) for _ in range(a.turns)] for _ in range(n)]
        self.answers += [[ids(a.answer_tokens) for _ in range(a.turns)] for _ in range(n)]
        return base

    def _rounds_shape(self, base: int, n: int, rng, phase: int, count_all: bool = False) -> list[list[Event]]:
        """Round t: every conversation's turn t, in a seeded random order; counted from
        ``--from-turn`` (or every turn: ``count_all``)."""
        start = 1 if count_all else self.args.from_turn
        return [[Event("turn", base + c, t, t + 1 >= start, phase) for c in rng.permutation(n).tolist()]
                for t in range(self.args.turns)]

    def _recency_shape(self, base: int, n: int, rng, phase: int, count_all: bool = False) -> list[list[Event]]:
        """Conversations ``base``..``base + n - 1`` arrive in order, at most ``--active`` live;
        each step a live one whose decode is not pending speaks; a turn's decode reads back
        after ``--handoff-delay`` other turns. Counted after the first ``--conversations``
        turns (or every turn: ``count_all``); rounds of ``--conversations`` turns."""
        a = self.args
        warmup = 0 if count_all else a.conversations
        waiting, live = deque(range(base, base + n)), {}  # live: conversation -> its next turn
        pending: deque[tuple[int, int]] = deque()  # turns whose decode has not read back, oldest first
        events: list[Event] = []
        step = 0
        while waiting or live:
            while len(live) < a.active and waiting:
                live[waiting.popleft()] = 0
            busy = {c for c, _ in pending}
            ready = [c for c in live if c not in busy]
            if not ready:  # every live conversation waits for its decode: the oldest runs now
                events.append(Event("handoff", *pending.popleft(), False, phase))
                continue
            c = ready[int(rng.integers(len(ready)))]
            t = live[c]
            events.append(Event("turn", c, t, step >= warmup, phase))
            self.handed_off.add((c, t))
            step += 1
            pending.append((c, t))
            if t + 1 == a.turns:
                del live[c]
            else:
                live[c] = t + 1
            while len(pending) > a.handoff_delay:
                events.append(Event("handoff", *pending.popleft(), False, phase))
        events += [Event("handoff", c, t, False, phase) for c, t in pending]
        rounds: list[list[Event]] = []
        in_round = 0
        for ev in events:  # a round: --conversations turns and the decodes that follow them
            if ev.kind == "turn":
                if not rounds or in_round == a.conversations:
                    rounds.append([])
                    in_round = 0
                in_round += 1
            rounds[-1].append(ev)
        return rounds

    def prompt(self, c: int, t: int) -> list[int]:
        out = list(self.system[c])
        for k in range(t):
            out += self.questions[c][k] + self.answers[c][k]
        return out + self.questions[c][t]

    def turns(self) -> list[Event]:
        return [ev for rd in self.rounds for ev in rd if ev.kind == "turn"]

    def phases(self) -> list[int]:
        return sorted({ev.phase for ev in self.turns()})

    def turn_gaps(self, phase: int | None = None) -> dict | None:
        """Other turns between a conversation's consecutive turns: mean, median, max."""
        seen, gaps = {}, []
        for i, ev in enumerate(self.turns()):
            if ev.conv in seen and (phase is None or ev.phase == phase):
                gaps.append(i - seen[ev.conv] - 1)
            seen[ev.conv] = i
        return {"mean": statistics.mean(gaps), "median": statistics.median(gaps), "max": max(gaps)} if gaps else None

    def ideal_pct(self, phase: int | None = None) -> float:
        """The counted share an unbounded store serves: every full page of the previous turn's
        prompt."""
        ps, num, den = self.args.page_size, 0, 0
        for ev in self.turns():
            if ev.counted and (phase is None or ev.phase == phase):
                num += prompt_tokens(self.args, ev.turn - 1) // ps * ps if ev.turn else 0
                den += prompt_tokens(self.args, ev.turn)
        return 100.0 * num / den

    def optimal_pct(self, capacity_pages: int) -> float:
        """A bound on the counted share any eviction policy can serve with room for
        ``capacity_pages`` pages: Belady's MIN, knowing the whole schedule, keeps after each
        turn the pages whose next counted use comes soonest (a turn's prompt holds every
        page of the conversation's earlier prompts, so all of a conversation's pages are
        next used at its next counted turn), and counts every page present, not only a
        leading run. Decodes' reads count for nothing here, as in the share."""
        ps = self.args.page_size
        return belady_min_pct(((ev.conv, ev.counted, prompt_tokens(self.args, ev.turn) // ps,
                                prompt_tokens(self.args, ev.turn) // ps, prompt_tokens(self.args, ev.turn), ps)
                               for ev in self.turns()), capacity_pages)

    def describe(self, seed: int) -> dict:
        """What the JSON records of this seed's schedule."""
        out = {"seed": seed, "conversations": len(self.system), "turns": len(self.turns()),
               "handoffs": len(self.handed_off), "turn_gap_others": self.turn_gaps(),
               "ideal_served_pct_counted": self.ideal_pct()}
        if self.kind == "shift":
            for p in self.phases():
                out[f"turn_gap_others_phase{p}"] = self.turn_gaps(p)
                out[f"ideal_served_pct_phase{p}"] = self.ideal_pct(p)
        return out


# ======================================================================= drivers ==
class OursDriver:
    """mooncake_ray through ``KVStore`` (it names each page's parent where the store supports it)."""

    def __init__(self, client, kv, pools):
        self.client, self.kv = client, kv
        for pool in pools:
            kv.register_pool(pool)

    def lookup(self, tokens, keys) -> int:
        return self.kv.lookup(tokens, keys) // self.kv.geometry.page_size

    def load(self, tokens, keys, pool, start: int, n: int, handoff: bool = False) -> int:
        """Pages ``start``..``n - 1`` into pool pages 0..; returns the leading pages loaded.
        ``handoff``: the decode's read, which releases the save's hold."""
        return self.kv.load(tokens, pool, list(range(n - start)), start_page=start, handoff=handoff)

    def save(self, tokens, keys, pool, start: int, n: int, handoff_s: float | None = None) -> int:
        """``handoff_s``: a decode will read these pages back; held until then (KVStore.save)."""
        return self.kv.save(tokens, pool, list(range(start, n)), start_page=start, handoff_s=handoff_s)

    def present(self, chains: list[list[str]]) -> list[list[bool]]:
        flat = list(self.client.batch_exists([k for keys in chains for k in keys]))  # takes no lease
        out, i = [], 0
        for keys in chains:
            out.append(flat[i:i + len(keys)])
            i += len(keys)
        return out

    def store_stats(self) -> dict:
        """``STORE_STATS`` and, as the store gives them, its keys naming the eviction policy."""
        st = self.client.stats()
        policy = {k: v for k, v in st.items() if k.startswith("eviction_policy")}
        return {**{k: st.get(k) for k in STORE_STATS}, **policy}

    def failures(self) -> dict:
        return dict(self.kv.failures)


class MooncakeDriver:
    """Mooncake Store's client, the same call sequence as ``KVStore`` (exists, get the leading
    hits, exists again and put the missing pages)."""

    def __init__(self, peer, geometry, pools):
        self.peer, self.s, self.g = peer, peer.store, geometry
        for pool in pools:
            rc = self.s.register_buffer(pool.tensor.data_ptr(), pool.tensor.numel() * pool.tensor.element_size())
            if rc != 0:
                raise RuntimeError(f"MooncakeDistributedStore.register_buffer rc={rc}")
        self.fail: dict[str, int] = {}

    def _ptr(self, pool, page_id: int) -> int:
        return pool.tensor.data_ptr() + page_id * self.g.page_bytes

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

    def load(self, tokens, keys, pool, start: int, n: int, handoff: bool = False) -> int:
        keys = keys[start:n]
        sizes = self.s.batch_get_into(keys, [self._ptr(pool, i) for i in range(len(keys))],
                                      [self.g.page_bytes] * len(keys))
        out = 0
        for size in sizes:
            if size != self.g.page_bytes:
                break
            out += 1
        return out

    def save(self, tokens, keys, pool, start: int, n: int, handoff_s: float | None = None) -> int:
        """(``handoff_s``: Mooncake's put holds nothing for a reader; ignored.)"""
        keys = keys[start:n]
        if not keys:
            return 0
        present = self.s.batch_is_exist(keys)
        todo = [(k, start + i) for i, (k, p) in enumerate(zip(keys, present)) if p != 1]
        if not todo:
            return 0
        res = self.s.batch_put_from([k for k, _ in todo], [self._ptr(pool, i) for _, i in todo],
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
    in bench_transport.py; its master's eviction marks are its own defaults unless given."""

    def __init__(self, segment: int, local_buffer: int, high_watermark: float | None, evict_ratio: float | None,
                 lease_ms: int):
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
            *([f"--eviction_high_watermark_ratio={self.hw}"] if self.hw is not None else []),
            *([f"--eviction_ratio={self.er}"] if self.er is not None else []),
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
def share(recs: list[dict]) -> float | None:
    """Percent of the prompt tokens of ``recs`` (per-turn records) loaded from the store."""
    prompt = sum(r["prompt_tokens"] for r in recs)
    return 100.0 * sum(r["loaded_tokens"] for r in recs) / prompt if prompt else None


def policy_label(stats: dict) -> str:
    """The store's ``eviction_policy*`` stats in short, for a printed line: their string
    fields (which policy it chose; the JSON keeps them whole)."""
    out = []
    for k, v in stats.items():
        if k.startswith("eviction_policy"):
            fields = {f: x for f, x in v.items() if isinstance(x, str)} if isinstance(v, dict) else {"": v}
            out += [f"{f}={x}" if f else f"{k}={x}" for f, x in fields.items()]
    return f" policy {' '.join(out)}" if out else ""


def run_one(kind: str, cfg: str, frac: float, rep: int, args, geometry, wl: Workload, arena: int) -> dict:
    """One configuration through one workload's schedule on a fresh store of ``arena`` bytes:
    the JSON's row (``skipped`` where Mooncake refused or did not start)."""
    import torch

    import mooncake_ray
    from mooncake_ray.kv import KVStore, PagePool, key_prefix, page_hashes

    row = {"workload": kind, "config": cfg, "fraction": frac, "repeat": rep, "seed": args.seed + rep,
           "arena_bytes": arena, "optimal_pct_counted": wl.optimal_pct(arena // geometry.page_bytes)}
    max_pages = last_pages(args)
    pool = PagePool(geometry, max_pages, "page_first")  # the prefill engine's
    dpool = PagePool(geometry, max_pages, "page_first")  # the decode engine's: handoffs land here
    pages_u8 = pool.tensor.view(torch.uint8).numpy().reshape(max_pages, geometry.page_bytes)
    dpages_u8 = dpool.tensor.view(torch.uint8).numpy().reshape(max_pages, geometry.page_bytes)
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
            drv = MooncakeDriver(peer, geometry, (pool, dpool))
        else:
            ns = f"bench_chains_{kind}_{cfg}_{rep}_{int(frac * 1000)}"
            marks = {k: v for k, v in (("high_watermark", args.high_watermark), ("evict_ratio", args.evict_ratio))
                     if v is not None}
            client = mooncake_ray.start({
                "namespace": ns, "segment_size_bytes": arena // args.store_nodes, "transport": {"devices": ["lo"]},
                "master": {**MASTER[cfg], **marks,
                           "lease_ttl_s": args.lease_ttl_s, **({"shards": args.shards} if cfg == "chain-sharded" else {})}})
            drv = OursDriver(client, KVStore(client, MODEL, geometry, "page_first"), (pool, dpool))
        row["startup_s"] = time.perf_counter() - t_up

        chains: dict[int, list[str]] = {}  # every page key each conversation's chain holds so far
        pending: dict[tuple[int, int], tuple] = {}  # (conv, turn) -> what its decode reads back: tokens, keys, start, n
        rounds, every, bad_loads = [], [], 0
        hold = args.handoff_hold_s or None  # KVStore.save's handoff_s for a turn a decode reads back
        row["handoff_hold_s"] = hold
        ps = geometry.page_size
        for r, events in enumerate(wl.rounds):
            recs, hand = [], []
            for ev in events:
                if ev.kind == "handoff":
                    tokens, keys, start, n = pending.pop((ev.conv, ev.turn))
                    t0 = time.perf_counter()
                    got = drv.load(tokens, keys, dpool, start, n, handoff=hold is not None) if n > start else 0
                    hand.append({"pages": n - start, "ok": got, "s": time.perf_counter() - t0})
                    bad_loads += sum(1 for j in range(got)
                                     if dpages_u8[j, :8].tobytes() != bytes.fromhex(keys[start + j][-16:]))
                    continue
                c, t = ev.conv, ev.turn
                tokens = wl.prompt(c, t)
                keys = [prefix + h for h in page_hashes(tokens, ps)]
                n = len(keys)
                t0 = time.perf_counter()
                hit = drv.lookup(tokens, keys)
                loaded = drv.load(tokens, keys, pool, 0, hit) if hit else 0
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
                stored = (drv.save(tokens, keys, pool, loaded, n, hold if (c, t) in wl.handed_off else None)
                          if n > loaded else 0)
                t_end = time.perf_counter()
                chains[c] = keys
                if (c, t) in wl.handed_off:
                    pending[(c, t)] = (tokens, keys, loaded, n)
                recs.append({"conv": c, "phase": ev.phase, "counted": ev.counted, "prompt_tokens": len(tokens),
                             "hit_tokens": hit * ps, "loaded_tokens": loaded * ps, "saved_pages": stored, "pages": n,
                             "turn_s": (t_loaded - t0) + (t_end - t1), "load_s": t_loaded - t0, "save_s": t_end - t1,
                             "fill_s": t_fill})
            every += recs
            orphaned = unreachable = stored_pages = named = 0
            for keys, present in zip(chains.values(), drv.present(list(chains.values()))):
                stored_pages += sum(present)
                named += sum(present[1:])  # stored pages that named a parent (each but a chain's first)
                orphaned += sum(1 for i in range(1, len(keys)) if present[i] and not present[i - 1])
                first_gap = next((i for i, p in enumerate(present) if not p), len(present))
                unreachable += sum(present[first_gap:])
            turn_ms = sorted(1e3 * x["turn_s"] for x in recs)
            rounds.append({"round": r + 1, "phase": events[0].phase, "turns": len(recs),
                           "prompt_tokens": sum(x["prompt_tokens"] for x in recs),
                           "loaded_tokens": sum(x["loaded_tokens"] for x in recs),
                           "hit_tokens": sum(x["hit_tokens"] for x in recs), "served_pct": share(recs),
                           "saved_pages": sum(x["saved_pages"] for x in recs),
                           "handoff_pages": sum(h["pages"] for h in hand), "handoff_ok": sum(h["ok"] for h in hand),
                           "orphaned_pages": orphaned, "unreachable_pages": unreachable, "stored_pages": stored_pages,
                           "named_parent_pages": named,
                           "store": drv.store_stats(), "turn_ms_mean": statistics.mean(turn_ms),
                           "turn_ms_p50": turn_ms[len(turn_ms) // 2], "turn_ms_max": turn_ms[-1],
                           "fill_ms_mean": 1e3 * statistics.mean(x["fill_s"] for x in recs),
                           "handoff_ms_mean": 1e3 * statistics.mean(h["s"] for h in hand) if hand else None})
            rd, st = rounds[-1], rounds[-1]["store"]
            own = (f" | store orphaned {st.get('orphaned_pages')} tail-ev {st.get('chain_tail_evictions')} "
                   f"ev {st.get('evictions')}" + policy_label(st)) if cfg != "mooncake" else ""
            handoffs = f"  handoff {rd['handoff_ok']:4}/{rd['handoff_pages']:<4}" if hand else ""
            print(f"    round {r + 1:2} [phase {rd['phase']}]: served {rd['served_pct']:5.1f}%{handoffs}  orphaned "
                  f"{orphaned:4}  unreachable {unreachable:4}  stored {stored_pages:5}  "
                  f"turn {rd['turn_ms_mean']:6.1f} ms" + own, flush=True)
        row.update({
            "rounds": rounds, "served_pct": share(every),
            "served_pct_counted": share([x for x in every if x["counted"]]),
            "handoff_pages": sum(rd["handoff_pages"] for rd in rounds),
            "handoff_misses": sum(rd["handoff_pages"] - rd["handoff_ok"] for rd in rounds),
            "orphaned_last": rounds[-1]["orphaned_pages"], "unreachable_last": rounds[-1]["unreachable_pages"],
            "store_orphaned_last": rounds[-1]["store"].get("orphaned_pages"),
            "links_kept_pct": links_kept(rounds) if cfg != "mooncake" else None,
            "turn_ms_mean": statistics.mean(rd["turn_ms_mean"] for rd in rounds),
            "bad_loads": bad_loads, "failures": drv.failures()})
        if kind == "shift":
            for p in wl.phases():
                row[f"served_pct_phase{p}"] = share([x for x in every if x["counted"] and x["phase"] == p])
        return row
    finally:
        if ns is not None:
            mooncake_ray.shutdown(namespace=ns, stop_ray=False)
        if peer is not None:
            peer.stop()


def links_kept(rounds: list[dict]) -> float | None:
    """Of the stored pages that named a parent, the share the store keeps linked (its
    ``chained``), over every round (the store's count, taken after the probe, may
    include a page or two put since: capped at 100)."""
    named = sum(rd["named_parent_pages"] for rd in rounds)
    linked = sum(min(rd["store"].get("chained") or 0, rd["named_parent_pages"]) for rd in rounds)
    return 100.0 * linked / named if named else None


# ======================================================================== summary ==
def metrics_of(kind: str) -> list[str]:
    """The shares a workload's summary compares configurations on."""
    return ["served_pct_counted"] + (["served_pct_phase1", "served_pct_phase2"] if kind == "shift" else [])


def summarize(rows: list[dict], args) -> dict:
    out: dict = {}
    for kind in args.workload_list:
        out[kind] = {}
        for frac in args.fraction_list:
            sel = [r for r in rows if r["workload"] == kind and r["fraction"] == frac]
            per = {}
            for cfg in args.config_list:
                runs = [r for r in sel if r["config"] == cfg and "rounds" in r]
                skipped = [r["skipped"] for r in sel if r["config"] == cfg and "skipped" in r]
                per[cfg] = {**{m: spread([r[m] for r in runs]) for m in metrics_of(kind) + ["served_pct"]},
                            "handoff_pages": spread([r["handoff_pages"] for r in runs]),
                            "handoff_misses": spread([r["handoff_misses"] for r in runs]),
                            "orphaned_last": spread([r["orphaned_last"] for r in runs]),
                            "unreachable_last": spread([r["unreachable_last"] for r in runs]),
                            "stored_pages_last": spread([r["rounds"][-1]["stored_pages"] for r in runs]),
                            "store_orphaned_last": spread([r["store_orphaned_last"] for r in runs]),
                            "links_kept_pct": spread([r["links_kept_pct"] for r in runs
                                                      if r.get("links_kept_pct") is not None]),
                            "turn_ms_mean": spread([r["turn_ms_mean"] for r in runs]),
                            "runs": len(runs), "skipped": skipped or None}

            def ratio(metric: str, other: str, mine: str = "chain") -> dict | None:
                """``mine`` over ``other``: of the medians, and paired by repeat."""
                pa, pb = per.get(mine, {}).get(metric), per.get(other, {}).get(metric)
                if not pa or not pb or not pb["median"]:
                    return None
                paired = []
                for ra in sel:
                    if ra["config"] == mine and "rounds" in ra:
                        rb = next((r for r in sel if r["config"] == other and "rounds" in r
                                   and r["repeat"] == ra["repeat"]), None)
                        if rb and rb[metric]:
                            paired.append(ra[metric] / rb[metric])
                return {"of_medians": pa["median"] / pb["median"], "paired": spread(paired)}

            ratios = {}
            for m in metrics_of(kind):
                fixed = [c for c in FIXED if per.get(c, {}).get(m)]
                best = max(fixed, key=lambda c: per[c][m]["median"]) if fixed else None
                ratios[m] = {"chain_over_mooncake": ratio(m, "mooncake"), "chain_over_lru": ratio(m, "lru"),
                             "best_fixed": best, "chain_over_best_fixed": ratio(m, best) if best else None,
                             "sharded_over_chain": ratio(m, "chain", "chain-sharded")}
            optimal = spread([r["optimal_pct_counted"] for r in sel if r["config"] == args.config_list[0]])
            chain = per.get("chain", {}).get("served_pct_counted")
            ratios["chain_over_optimal"] = chain["median"] / optimal["median"] if chain and optimal else None
            out[kind][str(frac)] = {"configs": per, "ratios": ratios, "optimal_pct_counted": optimal}
    out["targets"] = targets(out)
    return out


def targets(summary: dict) -> dict:
    """The docstring's targets at 50 % and 25 %, where measured (``met`` None: not measured)."""
    def goal(value, at_least: float | None = None, zero: bool = False) -> dict:
        if value is None:
            return {"value": None, "goal": 0 if zero else at_least, "met": None}
        return {"value": value, "goal": 0 if zero else at_least, "met": value == 0 if zero else value >= at_least}

    def of(r: dict | None):
        return r["of_medians"] if r else None

    out = {}
    for frac in (0.5, 0.25):
        at = f"at_{round(frac * 100)}pct"
        s = summary.get("rounds", {}).get(str(frac))
        if s:
            r = s["ratios"]["served_pct_counted"]
            orph = s["configs"].get("chain", {}).get("orphaned_last")
            out[f"rounds_chain_ge_1.25x_mooncake_{at}"] = goal(of(r["chain_over_mooncake"]), 1.25)
            out[f"rounds_chain_ge_2x_lru_{at}"] = goal(of(r["chain_over_lru"]), 2.0)
            out[f"rounds_chain_orphaned_zero_{at}"] = goal(orph and orph["max"], zero=True)
        for kind in WORKLOADS:
            s = summary.get(kind, {}).get(str(frac))
            if s and s["configs"].get("chain-sharded", {}).get("runs"):
                kept = s["configs"]["chain-sharded"]["links_kept_pct"]
                out[f"{kind}_sharded_links_kept_ge_95pct_{at}"] = goal(kept and kept["min"], 95.0)
                out[f"{kind}_sharded_ge_0.95x_one_shard_{at}"] = goal(
                    of(s["ratios"]["served_pct_counted"]["sharded_over_chain"]), 0.95)
        s = summary.get("recency", {}).get(str(frac))
        if s:
            miss = s["configs"].get("chain", {}).get("handoff_misses")
            out[f"recency_chain_ge_0.95x_best_fixed_{at}"] = goal(
                of(s["ratios"]["served_pct_counted"]["chain_over_best_fixed"]), 0.95)
            out[f"recency_chain_handoff_misses_zero_{at}"] = goal(miss and miss["max"], zero=True)
        s = summary.get("shift", {}).get(str(frac))
        if s:
            for p in (1, 2):
                out[f"shift_chain_ge_0.9x_best_fixed_phase{p}_{at}"] = goal(
                    of(s["ratios"][f"served_pct_phase{p}"]["chain_over_best_fixed"]), 0.9)
    return out


# =========================================================================== plot ==
COLORS = {"chain": "tab:green", "chain-recent": "tab:cyan", "chain-old": "tab:olive", "lru": "tab:red",
          "mooncake": "tab:blue", "chain-sharded": "tab:purple"}
PHASE_LABELS = {"served_pct_counted": "counted turns", "served_pct_phase1": "phase 1", "served_pct_phase2": "phase 2"}


def plot(res: dict, path: Path) -> None:
    """One panel per workload and fraction: the counted share per configuration (for
    ``shift``, phase 1 and phase 2 side by side), median bars with min-max whiskers, the
    unbounded store's share dashed; under each bar orphaned pages after the last round and,
    where decodes read back, handoff pages missed (medians)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    a = res["args"]
    kinds, fracs, cfgs = a["workload_list"], a["fraction_list"], a["config_list"]
    fig, axes = plt.subplots(len(kinds), len(fracs), figsize=(1.1 * len(cfgs) * len(fracs) + 2, 3.6 * len(kinds) + 0.8),
                             squeeze=False)
    for i, kind in enumerate(kinds):
        info = res["workloads"][kind]
        metrics = metrics_of(kind)[1:] or metrics_of(kind)  # shift: its phases side by side
        ideal = info["by_seed"][0]
        width = 0.8 / len(metrics)
        for j, frac in enumerate(fracs):
            ax, labels = axes[i][j], []
            for k, cfg in enumerate(cfgs):
                runs = [r for r in res["runs"] if r["workload"] == kind and r["fraction"] == frac
                        and r["config"] == cfg and "rounds" in r]
                if not runs:
                    ax.text(k, 2, "skipped", rotation=90, ha="center", va="bottom", fontsize=8, color="gray")
                    labels.append(cfg)
                    continue
                for m, metric in enumerate(metrics):
                    vals = [r[metric] for r in runs]
                    med, x = statistics.median(vals), k + (m - (len(metrics) - 1) / 2) * width
                    ax.bar(x, med, width * 0.9, color=COLORS[cfg], alpha=1.0 if m == 0 else 0.5,
                           hatch="//" if m else None, edgecolor="black", linewidth=0.4,
                           yerr=[[med - min(vals)], [max(vals) - med]], capsize=2, error_kw={"linewidth": 0.8})
                    ax.text(x, max(vals) + 1.5, f"{med:.0f}", ha="center", va="bottom", fontsize=7)
                note = f"{cfg}\norph {statistics.median(r['orphaned_last'] for r in runs):g}"
                if any(r["handoff_pages"] for r in runs):
                    note += (f"\nmissed {statistics.median(r['handoff_misses'] for r in runs):g}"
                             f"/{statistics.median(r['handoff_pages'] for r in runs):g}")
                labels.append(note)
            for m, metric in enumerate(metrics):
                key = "ideal_served_pct_counted" if metric == "served_pct_counted" else f"ideal_{metric}"
                ax.axhline(ideal[key], color="gray", linestyle=("--", ":", "-.")[m], linewidth=0.9,
                           label=f"unbounded store, {PHASE_LABELS[metric]}: {ideal[key]:.0f}%")
            opt = [r["optimal_pct_counted"] for r in res["runs"] if r["workload"] == kind and r["fraction"] == frac
                   and "optimal_pct_counted" in r]
            if opt:
                ax.axhline(statistics.median(opt), color="black", linestyle=":", linewidth=0.9,
                           label=f"optimal eviction (Belady), counted: {statistics.median(opt):.0f}%")
            if kind == "shift":
                ax.legend(handles=[Patch(facecolor="white", edgecolor="black", label="phase 1"),
                                   Patch(facecolor="white", edgecolor="black", hatch="//", label="phase 2")]
                          + ax.get_legend_handles_labels()[0], fontsize=7, loc="upper left", ncol=2)
            else:
                ax.legend(fontsize=7, loc="upper left")
            ax.set_xticks(range(len(cfgs)), labels, fontsize=7)
            ax.set_ylim(0, 135)  # room above 100 % for the legend
            ax.set_yticks(range(0, 101, 20))
            ax.set_ylabel("prompt tokens served (%)", fontsize=8)
            ax.set_title(f"{kind} @ {frac:.0%} of the working set ({res['arena_bytes'][str(frac)] / 2**20:.1f} MiB)",
                         fontsize=9)
            ax.grid(axis="y", alpha=0.3)
    skips = sorted({f"{r['config']} {r['workload']} @ {r['fraction']:.0%}" for r in res["runs"] if "skipped" in r})
    fig.suptitle(f"KV chains under eviction: median and range over {a['repeats']} repeat(s)\n{a['turns']} turns per "
                 f"conversation, {res['page_bytes'] >> 10} KiB pages ({host_label(res.get('host'))})"
                 + (f"\nskipped: {', '.join(skips)}" if skips else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# =========================================================================== main ==
def describe_workload(kind: str, args, geometry, arenas: dict) -> dict:
    """What the JSON records of a workload beyond its schedules: its definition, what its
    share counts, the most its live conversations hold, and the pages put in all against the
    arena."""
    recency = (f"conversations arrive over time, at most {args.active} live; each step one live conversation "
               f"whose decode is not pending (picked at random, seeded) speaks its next turn; one done with its "
               f"{args.turns} turns leaves and a new one starts; a turn's decode reads back the pages it saved "
               f"after {args.handoff_delay} other turns")
    rounds = "round t: every conversation's turn t, in a seeded random order"
    first, second = (("rounds", "recency") if args.shift_order == "rounds-first" else ("recency", "rounds"))
    shape = {"rounds": f"{args.conversations} conversations; {rounds}",
             "recency": f"{args.recency_conversations} conversations; {recency}",
             "shift": f"phase 1: {args.conversations} conversations in the {first} shape, phase 2: "
                      f"{args.conversations} new ones in the {second} shape ({rounds}; {recency})"}[kind]
    counted = {"rounds": f"turns {args.from_turn}..{args.turns}",
               "recency": f"every turn after the first {args.conversations} (warm-up)",
               "shift": f"phase 1 as its shape alone (rounds: turns {args.from_turn}..; recency: after the first "
                        f"{args.conversations} turns), phase 2 every turn"}[kind]
    live = live_max(kind, args) * last_pages(args)
    n_conv = {"rounds": args.conversations, "recency": args.recency_conversations,
              "shift": 2 * args.conversations}[kind]
    return {"shape": shape, "counted": counted,
            "live_definition": "the most pages the live (started, not finished) conversations' last-turn prompts "
                               f"take at once: {live_max(kind, args)} x {last_pages(args)} pages",
            "live_pages": live, "live_bytes": live * geometry.page_bytes,
            "chain_pages_put": n_conv * last_pages(args),
            "chain_bytes_put_over_arena": {str(f): n_conv * last_pages(args) * geometry.page_bytes / b
                                           for f, b in arenas.items()},
            "by_seed": []}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--conversations", type=int, default=24,
                    help="rounds: conversations (every arena is a fraction of their KV); recency: turns per round "
                         "and warm-up; shift: conversations per phase")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--active", type=int, default=8, help="recency: most conversations live at once")
    ap.add_argument("--recency-conversations", type=int, help="recency: conversations in all (3 x --conversations)")
    ap.add_argument("--handoff-delay", type=int, default=2,
                    help="recency: other turns between a turn's save and its decode's read-back")
    ap.add_argument("--handoff-hold-s", type=float, default=30.0,
                    help="recency: a turn whose decode reads it back is saved with KVStore.save(handoff_s=...), "
                         "held until that read; 0: saved like any other turn")
    ap.add_argument("--shift-order", choices=("rounds-first", "recency-first"), default="rounds-first")
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--question-tokens", type=int, default=128)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16, help="tokens per page")
    ap.add_argument("--layers", type=int, default=4, help="KV geometry: layers (4 x 2 heads x 64 x bf16: 32 KiB pages)")
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--fractions", default="0.25,0.5", help="arena sizes as fractions of the working set")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help=f"of {','.join(CONFIGS)} (chain-sharded: chain with master.shards --shards)")
    ap.add_argument("--shards", type=int, default=4, help="master shards of config chain-sharded")
    ap.add_argument("--store-nodes", type=int, default=1,
                    help="store nodes our store runs on (a local cluster; each takes 1/n of the arena). Mooncake "
                         "Store runs one segment of the whole arena either way")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--from-turn", type=int, default=4, help="rounds: the summary's share counts turns from this one")
    ap.add_argument("--high-watermark", type=float, help="both stores; default: each its own (ours 0.95 without a "
                    "spill tier, Mooncake 0.3.13 0.9)")
    ap.add_argument("--evict-ratio", type=float, help="both stores; default: each its own (ours 0.02, Mooncake 0.05)")
    ap.add_argument("--lease-ttl-s", type=float, default=10.0, help="read lease, both stores (both defaults: 10 s)")
    ap.add_argument("--mooncake-local-buffer", type=int, default=16 << 20)
    ap.add_argument("--out", default=str(RESULTS / "bench_chains.json"))
    ap.add_argument("--replot", metavar="JSON", help="only redraw the plot of a results file")
    args = ap.parse_args()
    if args.replot:
        res = json.loads(Path(args.replot).read_text())
        if "workloads" not in res:
            sys.exit(f"{args.replot} was written before bench_chains.py measured several workloads: rerun it")
        plot(res, Path(args.replot).with_suffix(".png"))
        return
    if args.recency_conversations is None:
        args.recency_conversations = 3 * args.conversations
    args.fraction_list = [float(f) for f in args.fractions.split(",") if f]
    args.config_list = [c for c in args.configs.split(",") if c]
    args.workload_list = [w for w in args.workloads.split(",") if w]
    for name, given, allowed in (("configs", args.config_list, CONFIGS), ("workloads", args.workload_list, WORKLOADS)):
        bad = set(given) - set(allowed)
        if bad:
            sys.exit(f"unknown {name} {sorted(bad)}; allowed: {','.join(allowed)}")
    if min(args.active, args.recency_conversations, args.conversations, args.turns) < 1 or args.handoff_delay < 0 \
            or args.handoff_hold_s < 0:
        sys.exit("--active, --recency-conversations, --conversations and --turns must be >= 1, --handoff-delay and "
                 "--handoff-hold-s >= 0")
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
    arenas = {f: max(1 << 20, int(f * ws_pages) * geometry.page_bytes) for f in args.fraction_list}
    workloads = {kind: describe_workload(kind, args, geometry, arenas) for kind in args.workload_list}
    host = host_info()
    print(f"host: {host_label(host, model=True)}; page {geometry.page_bytes >> 10} KiB, working set {ws_pages} pages "
          f"= {ws_pages * geometry.page_bytes / 2**20:.1f} MiB; arenas "
          + ", ".join(f"{f:.0%}: {b / 2**20:.1f} MiB" for f, b in arenas.items()), flush=True)
    for kind, info in workloads.items():
        print(f"  {kind}: {info['shape']}; live conversations take at most {info['live_bytes'] / 2**20:.1f} MiB, "
              f"{info['chain_pages_put'] * geometry.page_bytes / 2**20:.1f} MiB put in all; counted: {info['counted']}",
              flush=True)

    import ray

    # each run its own store on it; with --store-nodes, a local cluster of that many store
    # nodes (the driver on a head with none), each with 1/n of the arena
    cluster = store_cluster(args.store_nodes) if args.store_nodes > 1 else local_ray()
    git = git_state()
    rows, t_start = [], time.perf_counter()
    try:
        for rep in range(args.repeats):
            for kind in args.workload_list:
                wl = Workload(kind, args, args.seed + rep)
                workloads[kind]["by_seed"].append(wl.describe(args.seed + rep))
                d = workloads[kind]["by_seed"][-1]
                gap = d["turn_gap_others"] or {"mean": 0, "max": 0}
                print(f"[repeat {rep + 1}/{args.repeats}] {kind}: {d['turns']} turns, {d['handoffs']} handoffs; other "
                      f"turns between a conversation's turns: mean {gap['mean']:.1f}, max {gap['max']}; unbounded "
                      f"store serves {d['ideal_served_pct_counted']:.1f}% counted", flush=True)
                for frac in args.fraction_list:
                    k = rep * len(args.fraction_list) + args.fraction_list.index(frac)
                    order = args.config_list[k % len(args.config_list):] + args.config_list[:k % len(args.config_list)]
                    for cfg in order:
                        arena = arenas[frac]
                        print(f"[repeat {rep + 1}/{args.repeats}] {kind}: {cfg} @ {frac:.0%} ({arena / 2**20:.1f} MiB)",
                              flush=True)
                        t = time.perf_counter()
                        row = run_one(kind, cfg, frac, rep, args, geometry, wl, arena)
                        row["wall_s"] = time.perf_counter() - t
                        rows.append(row)
                        if "skipped" in row:
                            print(f"    skipped: {row['skipped']}"
                                  + "".join(f"\n      {e}" for e in row.get("mooncake_errors", [])), flush=True)
                            continue
                        phases = "".join(f", phase {p} {row[f'served_pct_phase{p}']:.1f}%" for p in wl.phases()
                                         if f"served_pct_phase{p}" in row)
                        handoff = (f", handoff pages missed {row['handoff_misses']}/{row['handoff_pages']}"
                                   if row["handoff_pages"] else "")
                        print(f"    served {row['served_pct_counted']:.1f}% counted{phases}{handoff}, orphaned "
                              f"{row['orphaned_last']}, {row['turn_ms_mean']:.1f} ms/turn, bad loads "
                              f"{row['bad_loads']}, failures {row['failures'] or 'none'} ({row['wall_s']:.1f}s)",
                              flush=True)
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    summary = summarize(rows, args)
    ver = versions(["mooncake-ray", "ray", "torch", "numpy", "mooncake-transfer-engine-non-cuda"])
    chain_landed = any(r.get("store_orphaned_last") is not None for r in rows)
    policy_landed = any(k.startswith("eviction_policy")
                        for r in rows for rd in r.get("rounds", ()) for k in rd["store"])
    res = {"description": "share of prompt tokens served, handoff pages read back, and orphaned pages under eviction, "
                          "multi-turn KV chains in three workload shapes",
           "args": {k: v for k, v in vars(args).items() if k != "replot"}, "host": host, "versions": ver, "git": git,
           "page_bytes": geometry.page_bytes,
           "working_set_definition": f"the rounds working set, every one of {args.conversations} conversations' "
                                     f"last-turn prompts: {args.conversations} x {last_pages(args)} pages; every "
                                     "workload runs at the same arenas",
           "working_set_pages": ws_pages, "working_set_bytes": ws_pages * geometry.page_bytes,
           "arena_bytes": {str(f): b for f, b in arenas.items()}, "workloads": workloads,
           "store_chain_stats_reported": chain_landed, "store_eviction_policy_reported": policy_landed,
           "orphan_probe": {"ours": "client.batch_exists over each chain (takes no lease)",
                            "mooncake": "GET /get_all_keys on the master's metrics port (no lease, no LRU touch)"},
           "handoff_probe": "the decode loads the pages its turn saved (from the turn's first unloaded page) into a "
                            "pool of its own; pages from the first one not read back on count as missed. Ours saves a turn a "
                            "decode reads back with KVStore.save(handoff_s=--handoff-hold-s) and the decode loads with "
                            "handoff=True (the hold released); Mooncake's put has no such hold",
           "notes": ["Mooncake leases a key on is_exist/get for --lease-ttl-s and never evicts a leased key; "
                     "a run lasts seconds, so at the default 10 s every page looked up stays and puts fail "
                     "(-200, no space) instead: compare with --lease-ttl-s 0.05",
                     "mooncake_client refuses a global segment under 16 MiB",
                     "config chain passes no master.chain_insert: it measures the store's default"],
           "wall_s": time.perf_counter() - t_start, "summary": summary, "runs": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    plot(res, out.with_suffix(".png"))

    print(f"\nserved from the store, counted turns (median [min-max] over {args.repeats}); orphaned pages after the "
          "last round; handoff pages missed")
    for kind in args.workload_list:
        ideal = workloads[kind]["by_seed"][0]
        for frac in args.fraction_list:
            s = summary[kind][str(frac)]
            for metric in metrics_of(kind):
                key = "ideal_served_pct_counted" if metric == "served_pct_counted" else f"ideal_{metric}"
                parts = []
                for cfg in args.config_list:
                    c = s["configs"][cfg]
                    if not c[metric]:
                        parts.append(f"{cfg} skipped")
                        continue
                    v = c[metric]
                    parts.append(f"{cfg} {v['median']:.1f}% [{v['min']:.1f}-{v['max']:.1f}] orph "
                                 f"{c['orphaned_last']['median']:g}"
                                 + (f" miss {c['handoff_misses']['median']:g}" if c["handoff_pages"]["max"] else "")
                                 + (f" links {c['links_kept_pct']['median']:.1f}%" if cfg == "chain-sharded"
                                    and c.get("links_kept_pct") else ""))
                r = s["ratios"][metric]
                ratios = [(f"chain/{o}", r[f"chain_over_{o}"]) for o in ("mooncake", "lru")]
                ratios.append((f"chain/best fixed ({r['best_fixed']})", r["chain_over_best_fixed"]))
                ratios.append((f"chain-sharded/chain", r.get("sharded_over_chain")))
                opt = s.get("optimal_pct_counted") if metric == "served_pct_counted" else None
                bound = f", optimal {opt['median']:.1f}%" if opt else ""
                print(f"  {kind} @ {frac:.0%}, {PHASE_LABELS[metric]} (unbounded {ideal[key]:.1f}%{bound}): "
                      + "; ".join(parts) + "".join(f"; {name} x{x['of_medians']:.2f}" for name, x in ratios if x))
    unmeasured = [name for name, t in summary["targets"].items() if t["met"] is None]
    for name, t in summary["targets"].items():
        if t["met"] is not None:
            print(f"  target {name}: {t['value']} (goal {t['goal']}) -> {'met' if t['met'] else 'NOT met'}")
    if unmeasured:
        print(f"  {len(unmeasured)} target(s) not measured in this run (a config or fraction missing or skipped)")
    if not chain_landed:
        print("  (the store's stats carry no orphaned_pages: chain-aware eviction is not (fully) in the tree measured)")
    if not policy_landed and "chain" in args.config_list:
        print("  (the store's stats carry no eviction_policy: chain measured the store's default without its report)")
    print(f"wrote {out} and {out.with_suffix('.png')} in {res['wall_s']:.0f}s")


if __name__ == "__main__":
    main()
