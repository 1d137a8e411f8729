"""A bounded fuzzing run of every target (``targets.py``) under atheris, inside
``make test``: a fixed number of libFuzzer runs each, from seeds of valid messages, as many
targets at once as the host has CPUs (about 15 s for all of them on 2 vCPUs). A crash
fails the test and prints the input and the traceback. Longer runs: ``tests/fuzz/run.py``."""

from __future__ import annotations

import base64
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("atheris")

from mooncake_ray._private import rpc  # noqa: E402
from tests.fuzz import targets  # noqa: E402
from tests.fuzz.run import fuzz  # noqa: E402
from tests.native.transport_util import in_private_netns, require_private_netns  # noqa: E402

# Runs per target (each process also takes ~2 s to start); -max_total_time caps a slow
# machine.
RUNS = {"master_rpc": 40_000, "pyindex": 30_000, "native_index": 30_000, "store_inventory": 30_000,
        "store_promote": 30_000, "transport": 15_000}
CAP_S = 8


def test_every_target_has_a_run_count_and_seeds():
    assert set(RUNS) == set(targets.TARGETS) == set(targets.MAX_LEN)
    for name in targets.TARGETS:
        seeds = targets.seeds(name)
        assert seeds and max(map(len, seeds)) <= targets.MAX_LEN[name]


def test_master_table_has_every_operation():
    """The fuzz target's copy of the master's handler table follows ``rpc``'s operations:
    one it does not know yet is reported (a warning: fuzz it once the table has it)."""
    ops = {v for k, v in vars(rpc).items() if k.isupper() and type(v) is int
           and k not in ("OK", "ERR") and not k.endswith("_RPC")}
    m, _ = targets.master_fixture()
    table = set(targets.master_table(m))
    assert table <= ops and set(targets._ARGS) | {rpc.PING} == table
    if ops - table:
        warnings.warn(f"master operations not fuzzed (add them to targets.master_table): {sorted(ops - table)}")


def test_seeds_are_handled():
    for name in targets.TARGETS:
        if name == "transport":
            continue
        for s in targets.seeds(name):
            targets.run_one(name, s)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every target's run, started at the first test that asks, as many at once as the host
    has CPUs: each libFuzzer process is single-threaded (on 2 vCPUs, one at a time left a
    CPU idle for the ~70 s the six take)."""
    workdir = tmp_path_factory.mktemp("fuzz")
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        yield {name: pool.submit(fuzz, name, workdir, runs=RUNS[name], seconds=CAP_S) for name in targets.TARGETS
               if name != "transport" or in_private_netns()}  # it opens sockets


@pytest.mark.parametrize("name", list(targets.TARGETS))
def test_fuzz(name, runs):
    if name == "transport":
        require_private_netns()
    r = runs[name].result()
    report = [f"{name}: {r['executions']} runs in {r['wall_s']} s, cov {r['cov']} ft {r['features']}"]
    for p in r["crashes"]:
        data = Path(p).read_bytes()
        report.append(f"crashing input {p}: {data[:400]!r} (base64 {base64.b64encode(data).decode()[:600]})")
    if r["crashes"] or r["returncode"] != 0:
        report.append(r.get("log_tail", ""))
        pytest.fail("\n".join(report), pytrace=False)
    print(report[0])


def test_native_index_declines_keys_python_cannot_read():
    """Found by the native_index target: a PUT_COMMIT (or a RELEASE) whose key is not
    UTF-8 was committed natively, and the master's next drain() raised on it."""
    from mooncake_ray._private.native import _native

    ix = _native.MasterIndex()
    targets.prepare_index(ix)
    bad = [b"\xa2\xc3\x28", b"\xa3\xed\xa0\x80", b"\xa2\xc0\x80", b"\xa4\xf4\x90\x80\x80"]  # surrogate, overlong, > U+10FFFF
    for key in bad:
        commit = bytes([0x93, rpc.PUT_COMMIT, 0x91, 0x94]) + key + bytes([targets.SLAB_ID, 0, 100, 0xA2]) + b"c1"
        release = bytes([0x92, rpc.RELEASE, 0x91, 0x93]) + key + bytes([7, 1])
        assert ix.serve(commit) is None and ix.serve(release) is None
    assert ix.drain() == (0, 0, [])
    assert ix.serve(rpc.pack([rpc.EXISTS, ["é", "\U0010ffff"]])) == rpc.pack([rpc.OK, [True, False]])


def test_malformed_inventory_message_is_refused_whole():
    """Found by the store_inventory target: a bad record was applied in part, with the
    message's seq counted as applied."""
    from mooncake_ray.errors import InvalidArgumentError

    for delta in ([[["a", "7", 10, "dram", 0, 4096]], [], []], [[], [["a", 5, "tape"]], []],
                  [[["c", 9, 1, "dram", 0, 4096]], [], [["a", 5]]], [[], []], "x"):
        inv = targets.inventory_fixture()
        before = dict(inv.entries), inv.applied_seq
        with pytest.raises(InvalidArgumentError):
            inv.apply(1, 2, delta)
        assert (dict(inv.entries), inv.applied_seq) == before
