"""The `mooncake-ray` command line against a real cluster: start from a config file,
status from a separate process, stop; a bad config is refused with a clear message."""

import re
import subprocess
import sys
from pathlib import Path

import yaml
from click.testing import CliRunner

from mooncake_ray.cli import main
from tests.conftest import store_config

CLI = str(Path(sys.executable).parent / "mooncake-ray")


def test_start_status_stop(ray_cluster, tmp_path):
    cfg = store_config()
    ns = cfg["namespace"]
    path = tmp_path / "store.yaml"
    path.write_text(yaml.safe_dump(cfg))
    runner = CliRunner()
    res = runner.invoke(main, ["start", "--config", str(path)])
    assert res.exit_code == 0, res.output
    assert "with 2 store node(s)" in res.output
    import mooncake_ray

    client = mooncake_ray.connect(namespace=ns)
    client.batch_put([f"k{i}" for i in range(5)], [b"x" * 5000] * 5)
    client.pin("k0")
    # status from another process, the way a user runs it
    out = subprocess.run([CLI, "status", "--namespace", ns, "--address", ray_cluster.address],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    first, membership, copies, header, _rule, *rows = out.stdout.strip().splitlines()
    assert re.match(r"Storage: 0\.00 / 0\.12 GB \| Keys: 5 \(soft-pinned: 1, pinned: 1\)", first), first
    assert membership.startswith("Membership: joins 0 | drains 0: 0 keys (0 B) moved"), membership
    assert copies == "Copies: under-replicated 0 keys (0 B) | repairs 0 (0 B)", copies
    assert header.split() == ["node", "tier", "used", "capacity", "use%", "keys", "memory", "state"]
    dram = [r.split() for r in rows if " dram " in r]
    assert len(dram) == 2
    assert sum(int(r[-3]) for r in dram) == 5
    assert [r[-2:] for r in dram] == [["host", "ok"]] * 2  # memory types UCX registers there; state
    client.close()
    res = runner.invoke(main, ["stop", "--namespace", ns])
    assert res.exit_code == 0 and "stopped 3 mooncake-ray actor(s)" in res.output
    res = runner.invoke(main, ["status", "--namespace", ns])
    assert res.exit_code == 2 and "no mooncake-ray store" in res.output


def test_bad_config_is_refused_with_field_value_and_allowed(ray_cluster, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"segment_size_bytes": "lots", "master": {"allocation_strategy": "nearest"}}))
    res = CliRunner().invoke(main, ["start", "--config", str(path)])
    assert res.exit_code == 2
    assert "segment_size_bytes: got 'lots'" in res.output
    assert "master.allocation_strategy: got 'nearest'; allowed: 'random', 'free_ratio_first' or 'local_first'" in res.output
