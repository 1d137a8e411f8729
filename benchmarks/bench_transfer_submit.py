"""What one ``transfer`` call of many small ops costs before and besides the bytes: the
shape of a vLLM load (256 blocks of 72 ranges, one value each; 18,432 ranges), read from a
peer's arena mapped in this process (same host, protocol auto: every range is a memcpy),
into 36 registered "layers" the ranges alternate between, as a KV cache's layers do.

Measured, each the median of --reps calls (ms):
  parse            the call refused at its first op: converting the ops from Python only
  parse_validate   the call refused at its last op: converting and checking every op
  read_expanded    a whole read of the 18,432 ranges passed as one op each, expanded in
                   Python first (what the client sent before multi-range ops were taken
                   as they are)
  read_ranges      the same read with each block passed as one op carrying its 72 ranges
  parse_validate_arrays  the call refused at its last row, the ops passed as one op of
                   arrays (remote offsets, local addresses, one length)
  read_arrays      the whole read passed so
  direct_read      the vLLM connector's direct prefill -> decode read (DirectReader.read)
                   of the same shape: 256 blocks of 36 layers x 2 parts, each layer a
                   FlashAttention-layout CPU tensor on both sides, ops built by the reader
  memcpy           numpy copying as many bytes in one piece (the bytes' own cost)

The transport runs without Ray (two engines in this process). Writes
benchmarks/results/bench_transfer_submit.json and .png; --label tags a run (e.g. the
commit measured), and runs with other labels already in the JSON are kept, so a build of
an older commit can be measured into the same file and plotted side by side.

    python benchmarks/bench_transfer_submit.py [--reps 31] [--range-bytes 1024] [--label NAME]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, git_state, host_info, host_label, light_import  # noqa: E402

BLOCKS, LAYERS, PARTS = 256, 36, 2


def median_ms(fn, reps: int, fail: bool = False) -> float:
    ts = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        try:
            fn()
        except Exception:
            if not fail:
                raise
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[1:]) * 1e3


def direct_reader(part: int):
    """A call of the vLLM connector's DirectReader.read moving every block of a prefill
    worker's 36 layers (torch CPU tensors registered with an engine of its own) into a
    decode worker's (likewise), in reverse block order; checks the bytes once."""
    import torch

    from mooncake_ray._private.transport.engine import Engine
    from mooncake_ray.integrations._vllm_direct import DirectReader, publish
    from mooncake_ray.integrations._vllm_layout import LayerBlocks

    class Board:  # the rendezvous key a store would hold
        def __init__(self, engine, d):
            self.engine, self.d = engine, d

        def get(self, k):
            return self.d[k]

        def upsert(self, k, v):
            self.d[k] = v

    shape = (PARTS, BLOCKS, 16, 1, part // (16 * 2))  # bf16, 16 tokens a block, one KV head
    pre = [torch.randint(-32768, 32767, shape, dtype=torch.int16).view(torch.bfloat16) for _ in range(LAYERS)]
    dec = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    pre_eng, dec_eng = Engine(protocol="auto", name="prefill"), Engine(protocol="auto", name="decode")
    board: dict = {}
    keep = [pre_eng.register(t) for t in pre] + [dec_eng.register(t) for t in dec]  # registered while read
    assert publish(Board(pre_eng, board), "pre", 0, keep[:LAYERS], [LayerBlocks(f"l{i}", t) for i, t in enumerate(pre)])
    dr = DirectReader(Board(dec_eng, board), [LayerBlocks(f"l{i}", t) for i, t in enumerate(dec)], 30.0)
    blocks = list(range(BLOCKS))
    dr.read("pre", 0, blocks, blocks[::-1])
    assert all(torch.equal(a.flip(1).view(torch.int16), b.view(torch.int16)) for a, b in zip(pre, dec))

    def read() -> None:
        assert keep and pre_eng  # the engines and regions live as long as the reads
        dr.read("pre", 0, blocks, blocks[::-1])

    return read


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=31)
    ap.add_argument("--rounds", type=int, default=3, help="repeats of the whole measurement")
    ap.add_argument("--range-bytes", type=int, default=1024)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=str(RESULTS / "bench_transfer_submit.json"))
    args = ap.parse_args()
    _native = light_import("mooncake_ray._private.native")._native

    def engine(name: str):
        c = _native.EngineConfig()
        c.name, c.protocol = name, "auto"
        return _native.TransportEngine(c)

    part = args.range_bytes
    per_block = LAYERS * PARTS
    n_ranges = BLOCKS * per_block
    owner, reader = engine("owner"), engine("reader")
    arena = owner.alloc_arena(n_ranges * part)
    np.frombuffer(arena.view(), dtype=np.uint8)[:] = np.random.default_rng(1).integers(0, 256, n_ranges * part,
                                                                                         dtype=np.uint8)
    rr = reader.import_remote(reader.connect(owner.address, 10.0), arena.rkey, arena.addr, arena.length, "", 0)
    assert rr.mapped, "the arena should be mapped (same host, protocol auto)"
    layers = [np.zeros(BLOCKS * PARTS * part, dtype=np.uint8) for _ in range(LAYERS)]
    regs = [reader.register_memory(t.ctypes.data, t.nbytes, False) for t in layers]
    # block b's ranges: (layer l, part p) at layer l's offset (p * BLOCKS + b) * part
    values = [tuple((layers[li].ctypes.data + (p * BLOCKS + b) * part, part)
                    for li in range(LAYERS) for p in range(PARTS)) for b in range(BLOCKS)]
    block_ops = [(rr, b * per_block * part, values[b], per_block * part) for b in range(BLOCKS)]

    def expanded():
        out = []
        for r, off, ranges, _n in block_ops:
            at = 0
            for addr, m in ranges:
                out.append((r, off + at, addr, m))
                at += m
        return out

    flat = expanded()
    bad_first = [(rr, rr.length, flat[0][2], part)] + flat[1:]
    bad_last = flat[:-1] + [(rr, rr.length, flat[-1][2], part)]
    offsets = np.array([o for _, o, _, _ in flat], dtype=np.uint64)
    addrs = np.array([a for _, _, a, _ in flat], dtype=np.uint64)
    array_ops = [(rr, offsets, addrs, part)]
    bad_offsets = offsets.copy()
    bad_offsets[-1] = rr.length
    bad_last_arrays = [(rr, bad_offsets, addrs, part)]
    arena_np = np.frombuffer(arena.view(), dtype=np.uint8)
    dst = [np.empty_like(t) for t in layers]

    def expected():  # where each range's bytes belong
        for b in range(BLOCKS):
            base = b * per_block * part
            for k, (li, p) in enumerate((li, p) for li in range(LAYERS) for p in range(PARTS)):
                o = (p * BLOCKS + b) * part
                dst[li][o:o + part] = arena_np[base + k * part:base + (k + 1) * part]

    one_piece = np.empty(n_ranges * part, dtype=np.uint8)
    direct_read = direct_reader(part)

    rounds = []
    for _ in range(args.rounds):
        r = {
            "parse": median_ms(lambda: reader.transfer(bad_first, True, 10.0), args.reps, fail=True),
            "parse_validate": median_ms(lambda: reader.transfer(bad_last, True, 10.0), args.reps, fail=True),
            "read_expanded": median_ms(lambda: reader.transfer(expanded(), True, 10.0), args.reps),
            "memcpy": median_ms(lambda: np.copyto(one_piece, arena_np), args.reps),
        }
        try:
            r["read_ranges"] = median_ms(lambda: reader.transfer(block_ops, True, 10.0), args.reps)
        except Exception as e:  # a build that takes one address per op
            r["read_ranges"] = None
            r["read_ranges_error"] = f"{type(e).__name__}: {e}"[:200]
        r["direct_read"] = median_ms(direct_read, args.reps)
        try:
            r["parse_validate_arrays"] = median_ms(lambda: reader.transfer(bad_last_arrays, True, 10.0), args.reps,
                                                   fail=True)
            r["read_arrays"] = median_ms(lambda: reader.transfer(array_ops, True, 10.0), args.reps)
        except Exception as e:  # a build that takes no array ops
            r["parse_validate_arrays"] = r["read_arrays"] = None
            r["read_arrays_error"] = f"{type(e).__name__}: {e}"[:200]
        rounds.append(r)
    # every byte of the last read where it belongs
    for li in range(LAYERS):
        layers[li][:] = 0
    reader.transfer(block_ops if rounds[-1]["read_ranges"] is not None else flat, True, 10.0)
    expected()
    assert all(np.array_equal(a, b) for a, b in zip(layers, dst)), "the read put bytes in the wrong place"
    if rounds[-1].get("read_arrays") is not None:
        for li in range(LAYERS):
            layers[li][:] = 0
        reader.transfer(array_ops, True, 10.0)
        assert all(np.array_equal(a, b) for a, b in zip(layers, dst)), "the array read put bytes in the wrong place"
    for reg in regs:
        reg.close()

    keys = ["parse", "parse_validate", "parse_validate_arrays", "read_expanded", "read_ranges", "read_arrays",
            "direct_read", "memcpy"]
    run = {"label": args.label or git_state().get("head", "")[:10], "git": git_state(), "host": host_info(),
           "ranges": n_ranges, "range_bytes": part, "blocks": BLOCKS, "reps": args.reps,
           "ms": {k: {"median": statistics.median([r[k] for r in rounds if r.get(k) is not None] or [float("nan")]),
                      "min": min([r[k] for r in rounds if r.get(k) is not None] or [float("nan")]),
                      "max": max([r[k] for r in rounds if r.get(k) is not None] or [float("nan")])}
                  for k in keys},
           "rounds": rounds}
    out = Path(args.out)
    doc = json.loads(out.read_text()) if out.exists() else {"runs": []}
    doc["runs"] = [r for r in doc["runs"] if r["label"] != run["label"]] + [run]
    out.write_text(json.dumps(doc, indent=1))
    for k in keys:
        m = run["ms"][k]
        print(f"{run['label']:>12} {k:<15} {m['median']:7.2f} ms  [{m['min']:.2f}-{m['max']:.2f}]")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    w = 0.8 / len(doc["runs"])
    for i, r in enumerate(doc["runs"]):
        nan = {"median": float("nan"), "min": float("nan"), "max": float("nan")}
        ms = {k: r["ms"].get(k, nan) for k in keys}  # runs of older builds lack the array rows
        vals = [ms[k]["median"] for k in keys]
        lo = [v - ms[k]["min"] for k, v in zip(keys, vals)]
        hi = [ms[k]["max"] - v for k, v in zip(keys, vals)]
        ax.bar([x + i * w for x in range(len(keys))], vals, w, yerr=[lo, hi], capsize=3, label=r["label"])
    ax.set_xticks([x + 0.4 - w / 2 for x in range(len(keys))], [k.replace("_", "\n", 1) for k in keys], fontsize=8)
    ax.set_ylabel("ms per call (median of rounds; range)")
    ax.set_title(f"one transfer of {n_ranges} ranges of {part} B ({BLOCKS} blocks x {per_block}), "
                 f"{host_label(run['host'])}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
