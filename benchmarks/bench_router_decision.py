"""How long MooncakeKVRouter takes to decide while its engines' KV events stream in: a
synthetic feed of N engines (8 and 64 by default), each a vLLM ``ZmqEventPublisher`` on
loopback publishing what an engine serving multi-turn chats publishes (a turn's new
blocks as ``BlockStored``, the blocks its cache evicts as ``BlockRemoved``), and the
router's own ``EventFeed`` subscribed to all of them, as an ingress replica runs it.

A decision is what ``MooncakeKVRouter._decide`` does once the prompt is tokenized: the
prompt's chained block hashes (``page_hashes``), every replica's engine match (the feed's
index, under its lock), and ``choose`` (with the store's answer given, not asked: the
store lookup is one batched RPC whose cost does not grow with the engines). It runs on the
main thread while the feed's thread applies batches, so it pays for the GIL and the
feed's lock as the router does.

The engines run in a process of their own, as engines do (their publishers' threads do
not share the router's interpreter). Per engine count: decision time p50 / p99 / max over
--decisions prompts (half continue a conversation some engine held when the stream
began, half are new), and the batch rates published and applied. Writes
benchmarks/results/bench_router_decision.json and .png.

    python benchmarks/bench_router_decision.py [--engines 8,64] [--rates 4,20] [--decisions 2000]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, host_info, host_label  # noqa: E402

BS = 16  # tokens a block (vLLM's default)


def applied_batches(feed) -> int:
    """Batches the feed has applied, over all engines (each publisher numbers from 0)."""
    with feed.lock:
        return sum(ix.next_seq or 0 for ix in feed.indexes.values())


def engines_process(conn, n_engines: int, args) -> None:
    """The engines' side, in a process of its own (as engines are): N publishers, their
    caches filled, then turns published at the asked rate until told to stop."""
    import vllm.distributed.kv_events as ev

    from mooncake_ray.integrations.kv_router import events_config

    rng = random.Random(7)
    system = [rng.randrange(1000, 30000) for _ in range(args["system_tokens"])]  # shared by every chat
    engines = []
    for i in range(n_engines):
        cfg, rec = events_config("127.0.0.1")
        pub = ev.ZmqEventPublisher(0, endpoint=cfg["endpoint"], replay_endpoint=rec["replay_endpoint"],
                                   buffer_steps=100_000)
        engines.append({"id": f"e{i}", "pub": pub, "rec": rec, "chats": [], "held": [], "next_hash": i << 40})
    published = 0

    def turn(e: dict, chat: dict | None) -> None:
        """One chat turn on engine e: its new blocks stored, the oldest evicted past capacity."""
        nonlocal published
        if chat is None:
            chat = {"tokens": list(system), "ids": []}
            e["chats"].append(chat)
        chat["tokens"] += [rng.randrange(1000, 30000) for _ in range(args["turn_tokens"])]
        full = len(chat["tokens"]) // BS
        new = range(len(chat["ids"]), full)
        ids = [e["next_hash"] + k for k in range(len(new))]
        e["next_hash"] += len(new)
        parent = chat["ids"][-1] if chat["ids"] else None
        events = [ev.BlockStored(block_hashes=ids, parent_block_hash=parent,
                                 token_ids=chat["tokens"][new.start * BS:full * BS], block_size=BS,
                                 lora_id=None, medium="GPU", lora_name=None, extra_keys=None)]
        chat["ids"] += ids
        e["held"] += ids
        if len(e["held"]) > args["engine_blocks"]:  # the engine's cache evicts its oldest blocks
            cut = len(e["held"]) - args["engine_blocks"]
            events.append(ev.BlockRemoved(block_hashes=e["held"][:cut], medium="GPU"))
            e["held"] = e["held"][cut:]
        e["pub"].publish(ev.KVEventBatch(ts=time.time(), events=events))
        published += 1

    for e in engines:  # every engine's cache filled to capacity
        while len(e["held"]) < args["engine_blocks"]:
            turn(e, None if len(e["chats"]) < 4 or rng.random() < 0.3 else rng.choice(e["chats"]))
    # the prompts the router will see: each chat as it stands now (its blocks still held)
    held = []
    for e in engines:
        have = set(e["held"])
        held.append([c["tokens"] for c in e["chats"] if c["ids"] and all(b in have for b in c["ids"])])
    conn.send({"recs": [e["rec"] for e in engines], "chats": held, "system": system, "published": published})
    conn.recv()  # go
    rate = args["batches_per_s_per_engine"] * n_engines
    p0, t0 = published, time.monotonic()
    t_next = t0
    while not conn.poll():
        e = rng.choice(engines)
        turn(e, rng.choice(e["chats"]) if rng.random() < 0.7 else None)
        t_next += 1.0 / rate
        d = t_next - time.monotonic()
        if d > 0:
            time.sleep(d)
        elif d < -1.0:
            t_next = time.monotonic()  # cannot keep up: as fast as it goes
    conn.recv()
    conn.send({"published": published, "rate": (published - p0) / (time.monotonic() - t0)})
    time.sleep(0.5)
    for e in engines:
        e["pub"].shutdown()


def run(n_engines: int, args) -> dict:
    import multiprocessing as mp

    from mooncake_ray.integrations import _kv_index as kvi
    from mooncake_ray.integrations.kv_router import EventFeed
    from mooncake_ray.kv import page_hashes

    rng = random.Random(11)
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=engines_process, args=(child, n_engines, vars(args)), daemon=True)
    proc.start()
    info = parent.recv()
    feed = EventFeed(stale_s=5.0, replay_timeout_s=10.0)
    ids = [f"e{i}" for i in range(n_engines)]
    for rid, rec in zip(ids, info["recs"]):
        feed.add(rid, rec, BS)  # replays what the engine published before
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and applied_batches(feed) < info["published"]:
        time.sleep(0.05)
    warm_applied = applied_batches(feed)
    parent.send("go")
    time.sleep(1.0)
    a0, t0 = applied_batches(feed), time.monotonic()
    model = kvi.CostModel()
    times, reasons = [], {}
    system = info["system"]
    for k in range(args.decisions):
        i = rng.randrange(n_engines)
        if k % 2 == 0 and info["chats"][i]:
            tokens = rng.choice(info["chats"][i]) + [rng.randrange(1000, 30000) for _ in range(args.turn_tokens)]
        else:
            tokens = system + [rng.randrange(1000, 30000) for _ in range(args.turn_tokens)]
        t = time.perf_counter()
        hashes = page_hashes(tokens, BS)
        engine = {rid: feed.match(rid, hashes) for rid in ids}
        present = [False] * len(hashes)
        loads = {rid: kvi.Load() for rid in ids}
        dec = kvi.choose(len(tokens), BS, engine, present, loads, model, {rid: rng.random() for rid in ids})
        times.append(time.perf_counter() - t)
        reasons[dec.reason] = reasons.get(dec.reason, 0) + 1
        time.sleep(args.gap_ms / 1e3)
    elapsed = time.monotonic() - t0
    applied = applied_batches(feed)
    parent.send("stop")
    parent.send("stop")
    end = parent.recv()
    proc.join(timeout=30)
    index_blocks = sum(ix.blocks for ix in feed.indexes.values())
    gaps = dict(feed.gaps)
    feed.close()
    ms = sorted(x * 1e3 for x in times)
    out = {
        "engines": n_engines, "decisions": len(ms), "warm_batches": info["published"], "warm_applied": warm_applied,
        "decision_ms": {"p50": ms[len(ms) // 2], "p90": ms[int(len(ms) * 0.9)], "p99": ms[int(len(ms) * 0.99)],
                        "max": ms[-1], "mean": statistics.mean(ms)},
        "batches_published_per_s": end["rate"], "batches_applied_per_s": (applied - a0) / elapsed,
        "asked_batches_per_s": args.batches_per_s_per_engine * n_engines,
        "index_blocks": index_blocks, "reasons": reasons, "feed_gaps": gaps,
    }
    print(f"{n_engines:3d} engines: decision p50 {out['decision_ms']['p50']:.3f} ms, p99 {out['decision_ms']['p99']:.3f} "
          f"ms, max {out['decision_ms']['max']:.2f} ms; batches/s published {end['rate']:.0f} (asked "
          f"{out['asked_batches_per_s']:.0f}), applied {out['batches_applied_per_s']:.0f}; index {index_blocks} "
          f"blocks; {reasons}; "
          f"gaps {gaps}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="8,64")
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches-per-s-per-engine", type=float, default=4.0, help=argparse.SUPPRESS)
    ap.add_argument("--engine-blocks", type=int, default=2048, help="blocks each engine's cache holds")
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--turn-tokens", type=int, default=256)
    ap.add_argument("--rates", default="4,20",
                    help="turns a second each engine reports (each one KV event batch), one run per rate")
    ap.add_argument("--gap-ms", type=float, default=2.0, help="pause between decisions")
    ap.add_argument("--out", default=str(RESULTS / "bench_router_decision.json"))
    args = ap.parse_args()
    runs = []
    for rate in (float(x) for x in args.rates.split(",")):
        args.batches_per_s_per_engine = rate
        for n in (int(x) for x in args.engines.split(",")):
            for r in range(args.repeats):
                res = run(n, args)
                res["repeat"], res["rate_per_engine"] = r, rate
                runs.append(res)
    summary = {}
    for key in sorted({(r["rate_per_engine"], r["engines"]) for r in runs}):
        rs = [r for r in runs if (r["rate_per_engine"], r["engines"]) == key]
        p99 = [r["decision_ms"]["p99"] for r in rs]
        summary[f"{key[1]} engines, {key[0]:g} batches/s each"] = {
                      "engines": key[1], "rate_per_engine": key[0],
                      "p99_ms": {"median": statistics.median(p99), "min": min(p99), "max": max(p99)},
                      "p50_ms": statistics.median(r["decision_ms"]["p50"] for r in rs),
                      "batches_applied_per_s": statistics.median(r["batches_applied_per_s"] for r in rs)}
    doc = {"host": host_info(), "args": vars(args), "runs": runs, "summary": summary, "target_p99_ms": 2.0}
    out = Path(args.out)
    out.write_text(json.dumps(doc, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for rate in sorted({v["rate_per_engine"] for v in summary.values()}):
        pts = sorted((v["engines"], v) for v in summary.values() if v["rate_per_engine"] == rate)
        ns = [n for n, _ in pts]
        ax.plot(ns, [v["p50_ms"] for _, v in pts], marker="o", linestyle=":", label=f"p50, {rate:g} batches/s/engine")
        ax.errorbar(ns, [v["p99_ms"]["median"] for _, v in pts],
                    yerr=[[v["p99_ms"]["median"] - v["p99_ms"]["min"] for _, v in pts],
                          [v["p99_ms"]["max"] - v["p99_ms"]["median"] for _, v in pts]],
                    marker="s", capsize=3, label=f"p99 (range), {rate:g} batches/s/engine")
    ax.axhline(2.0, color="k", linestyle="--", label="target p99 2 ms")
    ax.set_xlabel("engines streaming KV events")
    ax.set_ylabel("decision time (ms)")
    ax.set_title(f"MooncakeKVRouter decision while events stream, {host_label(doc['host'])}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
