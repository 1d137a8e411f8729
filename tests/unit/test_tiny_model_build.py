"""The tiny model's build when several processes (two Serve replicas or test processes on one
host) ask for the same directory at once: one writes, the others wait and read a complete
build. Threads stand in for processes (``flock`` locks an open file, not a process)."""

from __future__ import annotations

import json
import pathlib
import threading
import time

import pytest

from mooncake_ray.integrations import tiny_model
from mooncake_ray.integrations.tiny_model import TinyModelSpec


@pytest.fixture
def slow_write(monkeypatch):
    """``_write`` replaced by one that takes 0.3 s and records how many ran at once."""
    seen = {"calls": 0, "active": 0, "most": 0}
    lock = threading.Lock()

    def write(out_dir, spec):
        with lock:
            seen["calls"] += 1
            seen["active"] += 1
            seen["most"] = max(seen["most"], seen["active"])
        time.sleep(0.3)
        pathlib.Path(out_dir).mkdir(parents=True, exist_ok=True)
        with lock:
            seen["active"] -= 1

    monkeypatch.setattr(tiny_model, "_write", write)
    return seen


def test_builders_of_one_directory_take_turns_and_only_the_first_writes(tmp_path, slow_write):
    out = tmp_path / "models" / "tiny"
    results, errors = [], []

    def run():
        try:
            results.append(tiny_model.build(str(out)))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors and results == [str(out)] * 4
    assert slow_write == {"calls": 1, "active": 0, "most": 1}
    assert json.loads((out / "mooncake_ray_tiny_model.json").read_text())["arch"] == TinyModelSpec().arch


def test_another_spec_rebuilds_and_its_marker_comes_last(tmp_path, slow_write):
    out = tmp_path / "tiny"
    tiny_model.build(str(out))
    tiny_model.build(str(out), TinyModelSpec(layers=3))
    assert slow_write["calls"] == 2
    assert json.loads((out / "mooncake_ray_tiny_model.json").read_text())["layers"] == 3
    tiny_model.build(str(out), TinyModelSpec(layers=3))
    assert slow_write["calls"] == 2  # the same spec again: nothing written


def test_a_bad_spec_is_refused_naming_the_value(tmp_path, slow_write):
    with pytest.raises(ValueError, match="arch 'gpt9' not known"):
        tiny_model.build(str(tmp_path / "x"), TinyModelSpec(arch="gpt9"))
    assert slow_write["calls"] == 0
