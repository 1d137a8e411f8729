"""What KV chain links cost the master's read index itself, with no Ray, RPC or Python
bookkeeping around it: the index's share of what chain-aware eviction adds to a put.

One ``MasterIndex`` (the native read index), no cluster. ``--keys`` cold records of 4 KiB
in batches of ``--batch`` (``set_cold_many``), each batch one chain (every key names the key
before it), kept at ``--keep`` records by ``evict_cold`` passes as a store at its watermark
is, so eviction runs from the second batch on. Per configuration, interleaved over
``--repeats`` rounds:

- ``links``: chain links on (``set_chain_links(True)``), each key linked to its parent
  (``link``, as a commit naming a parent does), eviction leaves first (``chains=True``);
- ``plain``: links off, eviction in recency order (plain LRU).

Measured per key put: the time in ``link`` calls (links only) and in ``evict_cold`` calls,
each a Python call into the index, so both include the binding's cost (the same in both
configurations for eviction). Summary: median [min-max] per configuration, and the extra
time per key that links cost (links' link + evict against plain's evict).

    make bench B=benchmarks/bench_index_chains.py ARGS="--repeats 5"

Writes benchmarks/results/bench_index_chains.json and .png. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time
from pathlib import Path

from _common import RESULTS, git_state, host_info, host_label, spread

CONFIGS = ("links", "plain")


def run(links: bool, keys: int, batch: int, keep: int) -> dict:
    from mooncake_ray._native import MasterIndex

    ix = MasterIndex()
    ix.set_chain_links(links)
    link_s = evict_s = 0.0
    evicted = 0
    for b in range(keys // batch):
        names = [f"c{b}/{i:04d}" for i in range(batch)]
        gen = b * batch
        cols = b"".join(struct.pack("4q", gen + i, 4096, (gen + i) * 4096, 4096) for i in range(batch))
        ix.set_cold_many(names, cols, "n0", "r0", "i0", gen, 0.0)
        if links:
            t0 = time.perf_counter()
            parent = ""
            for k in names:
                ix.link(k, parent)
                parent = k
            link_s += time.perf_counter() - t0
        if len(ix) > keep:
            need, got, after = (len(ix) - keep) * 4096, 0, ""
            t0 = time.perf_counter()
            while got < need:
                dropped, _gens, _runs, freed, stop, _held = ix.evict_cold(after, "n0", 1.0, need - got, links)
                got += freed
                evicted += len(dropped)
                if stop is None or not dropped:
                    break
                after = stop
            evict_s += time.perf_counter() - t0
    n = keys // batch * batch
    return {"link_us_per_key": link_s * 1e6 / n, "evict_us_per_key": evict_s * 1e6 / n,
            "total_us_per_key": (link_s + evict_s) * 1e6 / n, "evicted": evicted, "links_left": ix.link_count()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--keep", type=int, default=15_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS / "bench_index_chains.json"))
    a = ap.parse_args()
    host = host_info()
    print(f"host: {host_label(host, model=True)}; {a.keys} keys in chains of {a.batch}, {a.keep} kept", flush=True)
    runs: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    for r in range(a.repeats):
        for c in (CONFIGS if r % 2 == 0 else CONFIGS[::-1]):
            res = run(c == "links", a.keys, a.batch, a.keep)
            runs[c].append(res)
            print(f"[{r + 1}/{a.repeats}] {c:5s}: link {res['link_us_per_key']:.3f} evict {res['evict_us_per_key']:.3f}"
                  f" us/key, {res['evicted']} evicted", flush=True)
    summary = {c: {m: spread([x[m] for x in runs[c]]) for m in ("link_us_per_key", "evict_us_per_key",
                                                              "total_us_per_key")} for c in CONFIGS}
    extra = [x["total_us_per_key"] - y["total_us_per_key"] for x, y in zip(runs["links"], runs["plain"])]
    summary["links_extra_us_per_key"] = spread(extra)
    for c in CONFIGS:
        s = summary[c]
        print(f"  {c:5s}: link {s['link_us_per_key']['median']:.3f}, evict {s['evict_us_per_key']['median']:.3f}"
              f" [{s['evict_us_per_key']['min']:.3f}-{s['evict_us_per_key']['max']:.3f}] us/key")
    e = summary["links_extra_us_per_key"]
    print(f"  links cost {e['median']:.3f} [{e['min']:.3f}-{e['max']:.3f}] us a key more than plain LRU")
    doc = {"benchmark": "bench_index_chains", "host": host, "git": git_state(), "args": vars(a),
           "runs": runs, "summary": summary}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    plot(doc, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = doc["summary"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for i, c in enumerate(CONFIGS):
        bottom = 0.0
        for m, color in (("link_us_per_key", "tab:orange"), ("evict_us_per_key", "tab:blue")):
            v = s[c][m]
            ax.bar(i, v["median"], bottom=bottom, color=color, label=m.split("_")[0] if i == 0 else None)
            ax.errorbar(i, bottom + v["median"], yerr=[[v["median"] - v["min"]], [v["max"] - v["median"]]],
                        color="black", capsize=4)
            bottom += v["median"]
    ax.set_xticks(range(len(CONFIGS)), ["chain links on", "links off (LRU)"])
    ax.set_ylabel("us per key put (median, min-max)")
    ax.set_title(f"Read index: chain links' cost per key, {host_label(doc['host'])}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
