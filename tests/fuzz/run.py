"""Longer fuzzing runs: each target under atheris for a number of seconds, in a subprocess.

    python tests/fuzz/run.py --target NAME|all --seconds S [--json out.json] [--workdir DIR]

Reports per target the executions, executions per second, coverage (libFuzzer's ``cov``
edges and ``ft`` features of the instrumented Python code) and crashes with the paths of
their saved inputs (reproduce one: ``python -m tests.fuzz.runner NAME --repro PATH``).
Run it inside a private network namespace (the transport target opens sockets), e.g.
    unshare --net --mount --propagation private sh -c 'mount --make-rprivate / &&
        ip link set lo up && exec .venv/bin/python tests/fuzz/run.py --target all --seconds 60'
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.fuzz.targets import MAX_LEN, TARGETS  # noqa: E402


def fuzz(name: str, workdir: Path, *, seconds: float | None = None, runs: int | None = None,
         env: dict | None = None) -> dict:
    """One libFuzzer run of ``name`` from its seeds; returns its figures and crashes."""
    out = workdir / name
    (out / "crashes").mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "tests.fuzz.runner", name, "--seed-corpus", str(out / "corpus"),
            f"-max_len={MAX_LEN[name]}", f"-artifact_prefix={out / 'crashes'}/", "-print_final_stats=1",
            "-timeout=30", "-rss_limit_mb=4096", "-seed=1"]
    if runs:
        args.append(f"-runs={runs}")
    if seconds:
        args.append(f"-max_total_time={max(1, int(seconds))}")
    t0 = time.monotonic()
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, errors="replace",
                          env={**os.environ, **(env or {})}, timeout=(seconds or 600) + 300)
    wall = time.monotonic() - t0
    log = proc.stderr + proc.stdout
    stat = dict(re.findall(r"^stat::(\w+):\s+(\d+)", log, re.M))
    cov = re.findall(r"cov: (\d+) ft: (\d+)", log)
    execs = int(stat.get("number_of_executed_units", 0))
    crashes = sorted(str(p) for p in (out / "crashes").iterdir())
    res = {
        "target": name, "returncode": proc.returncode, "wall_s": round(wall, 2),
        "executions": execs, "exec_per_s": int(stat.get("average_exec_per_sec", 0)) or round(execs / max(wall, 1e-9)),
        "cov": int(cov[-1][0]) if cov else None, "features": int(cov[-1][1]) if cov else None,
        "corpus": len(list((out / "corpus").iterdir())), "crashes": crashes,
    }
    if proc.returncode != 0 or crashes:
        res["log_tail"] = log[-6000:]
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="all", help=f"one of {', '.join(TARGETS)}, or all")
    ap.add_argument("--seconds", type=float, default=60.0, help="per target")
    ap.add_argument("--json", help="write the summary here")
    ap.add_argument("--workdir", help="corpora and crashes (default: a new temporary directory)")
    a = ap.parse_args()
    names = list(TARGETS) if a.target == "all" else [a.target]
    for n in names:
        if n not in TARGETS:
            ap.error(f"unknown target {n!r}")
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="mcr-fuzz-"))
    results = []
    print(f"{'target':16} {'execs':>10} {'exec/s':>8} {'cov':>6} {'ft':>6} {'corpus':>6}  crashes")
    for n in names:
        r = fuzz(n, workdir, seconds=a.seconds)
        results.append(r)
        print(f"{n:16} {r['executions']:>10} {r['exec_per_s']:>8} {r['cov'] or '-':>6} {r['features'] or '-':>6} "
              f"{r['corpus']:>6}  {len(r['crashes'])} {' '.join(r['crashes'])}", flush=True)
        if r["returncode"] != 0 and not r["crashes"]:
            print(r.get("log_tail", ""), file=sys.stderr)
    summary = {"workdir": str(workdir), "seconds_per_target": a.seconds, "targets": results}
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=2))
    return 1 if any(r["crashes"] or r["returncode"] != 0 for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
