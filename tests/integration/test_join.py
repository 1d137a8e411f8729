"""Processes that join the cluster as engines' connectors do (``rayjoin.join``, after the
engine seeded Python's ``random``) cost the GCS nothing while idle: Ray draws the ids of
their GCS subscriptions from ``random``, and two subscribers of one id displaced each
other's long polls at the GCS without end (half a core on this machine)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

CHILD = """
import random, sys
random.seed(0)  # as vLLM seeds each engine process, one seed for all engines
from mooncake_ray._private.rayjoin import join
join(sys.argv[1], logging_level="WARNING", log_to_driver=False)
print("joined", flush=True)
sys.stdin.read()  # until the test closes it
"""


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def test_engines_seeded_alike_join_without_loading_the_gcs(ray_cluster, tmp_path):
    gcs = ray_cluster.head_node.all_processes["gcs_server"][0].process.pid
    errs = [open(tmp_path / f"child{i}.err", "w+") for i in range(2)]
    children = [subprocess.Popen([sys.executable, "-c", CHILD, ray_cluster.address], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=err, text=True) for err in errs]
    try:
        for c, err in zip(children, errs):
            line = c.stdout.readline()
            assert line.strip() == "joined", (line, err.seek(0) or err.read()[-3000:])
        time.sleep(1.0)  # both subscribed and polling
        c0, t0 = _cpu_s(gcs), time.monotonic()
        time.sleep(3.0)
        share = (_cpu_s(gcs) - c0) / (time.monotonic() - t0)
        # two subscribers of one id keep the GCS at 0.5 core or more; idle it is near 0.01
        assert share < 0.15, f"the GCS used {share:.2f} of a core with two joined processes idle"
    finally:
        for c, err in zip(children, errs):
            c.stdin.close()
            c.wait(timeout=30)
            err.close()
