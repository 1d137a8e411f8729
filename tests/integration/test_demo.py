"""``make demo`` as a user runs it (the test suite already runs in the network namespace
``make demo`` makes): it exits 0, reads back every value it spilled to disk, prints no
error, and its end — from deleting its Serve app to the process exit — takes under 10 s."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from tests.integration.serve_cli import ROOT, errors_in

pytestmark = pytest.mark.timeout(300)


def test_demo_runs_through_and_stops_cleanly():
    proc = subprocess.Popen([sys.executable, "-u", "-m", "mooncake_ray.demo"], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines, end_began = [], None
    for line in proc.stdout:
        lines.append(line)
        if "Deleting app ['demo-chat']" in line:
            end_began = time.monotonic()
    rc = proc.wait(timeout=60)
    ended = time.monotonic()
    out = "".join(lines)
    assert rc == 0, out
    got = re.search(r"got (\d+)/(\d+) back byte-exact \((\d+) missing\)", out)
    assert got and got.group(1) == got.group(2) and got.group(3) == "0", out
    assert re.search(r"batch_get of 1000 x 4 KiB: .* \(1000 hits\)", out), out
    assert end_began is not None and ended - end_began < 10.0, out
    assert not errors_in(out), errors_in(out)
