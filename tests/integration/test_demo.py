"""``make demo`` as a user runs it, then the README's cluster flow after it with Ray's
default token handling; one run of the demo serves both tests.

The demo (the test suite already runs in the network namespace ``make demo`` makes) exits
0, reads back every value it spilled to disk, prints no error, and its end, from deleting
its Serve app to the process exit, takes under 10 s.

The demo's local Ray leaves ``~/.ray/auth_token``; ``ray start --head`` then turns token
authentication on, and ``mooncake-ray start``, a driver's ``connect()`` and ``mooncake-ray
status`` must still join (Ray 2.60 alone refuses them: ``RAY_AUTH_MODE`` unset, they send no
token). A process holding another token gets an error that names where its token came from,
on its first call to the GCS; an address nothing listens on, an error within seconds.
Everything runs in a mount namespace of its own whose ``~/.ray`` is a private tmpfs, so the
user's home is neither read nor changed."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

from tests.integration.serve_cli import BIN, ROOT, errors_in, free_port

pytestmark = [pytest.mark.timeout(420),
              pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare")]

# Each line of the demo's output is stamped with CLOCK_MONOTONIC (one clock for every
# process), and so is its exit: the test times the demo's end from them.
FLOW = r"""
set -u
mkdir -p "$HOME/.ray" && mount -t tmpfs -o size=4m tmpfs "$HOME/.ray"
export RAY_USAGE_STATS_ENABLED=0 PYTHONPATH="$ROOT"
unset RAY_ADDRESS RAY_AUTH_MODE RAY_AUTH_TOKEN RAY_AUTH_TOKEN_PATH
cd "$ROOT"
STAMP='import sys, time
for line in sys.stdin:
    sys.stdout.write(f"{time.monotonic():.3f} {line}")
    sys.stdout.flush()'
"$PY" -u -m mooncake_ray.demo 2>&1 | "$PY" -u -c "$STAMP" > "$OUT/demo.log"
rc=${PIPESTATUS[0]}
echo "exited $rc" | "$PY" -u -c "$STAMP" >> "$OUT/demo.log"
[ "$rc" = 0 ] || { echo "demo failed"; exit 10; }
test -s "$HOME/.ray/auth_token" || { echo "the demo left no token: the flow below tests nothing"; exit 11; }
"$BIN/ray" start --head --block --port="$PORT" --num-cpus=2 --include-dashboard=false --disable-usage-stats \
  --node-ip-address=127.0.0.1 > "$OUT/head.log" 2>&1 &
HEAD=$!
trap 'kill -TERM $HEAD 2>/dev/null; wait $HEAD 2>/dev/null' EXIT
for i in $(seq 120); do (echo > /dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.5; done
export RAY_ADDRESS="127.0.0.1:$PORT"
echo '{"segment_size_bytes": "32mb", "transport": {"devices": ["lo"]}}' > "$OUT/store.json"
"$BIN/mooncake-ray" start --config "$OUT/store.json" > "$OUT/start.log" 2>&1 || { echo "mooncake-ray start failed"; exit 12; }
"$PY" -c "
import mooncake_ray
c = mooncake_ray.connect()
c.put('after-demo', b'joined')
assert c.get('after-demo') == b'joined'
print('driver ok')
" > "$OUT/driver.log" 2>&1 || { echo "driver failed"; exit 13; }
RAY_AUTH_TOKEN=0000000000000000000000000000000000000000000000000000000000000000 \
  "$BIN/mooncake-ray" status > "$OUT/wrong.log" 2>&1
echo "wrong-token status exited $?"
"$BIN/mooncake-ray" status --address "127.0.0.1:$DEADPORT" > "$OUT/dead.log" 2>&1
echo "dead-port status exited $?"
"$BIN/mooncake-ray" stop > "$OUT/stop.log" 2>&1 || { echo "mooncake-ray stop failed"; exit 14; }
echo "flow ok"
"""


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    """The demo, then the cluster flow: (the flow's process, its logs by file name)."""
    out = tmp_path_factory.mktemp("demo-flow")
    # a port nothing listens on: bound here and never listened on, so no process of the
    # flow takes it and every connection to it is refused
    with socket.socket() as dead:
        dead.bind(("127.0.0.1", 0))
        env = {**os.environ, "ROOT": ROOT, "PY": sys.executable, "BIN": BIN, "OUT": str(out),
               "PORT": str(free_port()), "DEADPORT": str(dead.getsockname()[1])}
        p = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", FLOW], env=env,
                           capture_output=True, text=True, timeout=400)
    return p, {f.name: f.read_text(errors="replace") for f in out.iterdir() if f.suffix == ".log"}


def test_demo_runs_through_and_stops_cleanly(flow):
    _p, logs = flow
    stamped = [line.split(" ", 1) for line in logs["demo.log"].splitlines() if " " in line]
    out = "".join(text + "\n" for _t, text in stamped)
    assert stamped and stamped[-1][1] == "exited 0", out
    got = re.search(r"got (\d+)/(\d+) back byte-exact \((\d+) missing\)", out)
    assert got and got.group(1) == got.group(2) and got.group(3) == "0", out
    assert re.search(r"batch_get of 1000 x 4 KiB: .* \(1000 hits\)", out), out
    began = next((float(t) for t, text in stamped if "Deleting app ['demo-chat']" in text), None)
    assert began is not None and float(stamped[-1][0]) - began < 10.0, out
    assert not errors_in(out), errors_in(out)


def test_cluster_flow_after_the_demo_joins_with_the_default_token(flow):
    p, full = flow
    logs = {name: text[-2500:] for name, text in full.items()}
    assert p.returncode == 0 and "flow ok" in p.stdout, (p.stdout, p.stderr, logs)
    assert "driver ok" in logs["driver.log"]
    # another token than the cluster's: a clear error, exit 2, naming the token's source and the fix
    assert "wrong-token status exited 2" in p.stdout, (p.stdout, logs["wrong.log"])
    wrong = logs["wrong.log"]
    assert "token comes from the RAY_AUTH_TOKEN environment variable" in wrong and "ray get-auth-token" in wrong, wrong
    # refused on its first call to the GCS: ray.init alone retries a refused token once a
    # second for 20 s, and Ray logs each try
    assert "AuthenticationError" in wrong, wrong
    assert full["wrong.log"].count("Failed to get cluster ID from GCS server") == 1, wrong
    # an address nothing listens on: exit 2 within seconds (ray.init alone retries for minutes)
    assert "dead-port status exited 2" in p.stdout, (p.stdout, logs["dead.log"])
    assert "nothing listens at 127.0.0.1:" in logs["dead.log"], logs["dead.log"]
