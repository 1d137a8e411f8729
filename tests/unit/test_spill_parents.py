"""The spilled values' chain parents log (store/spill_parents.py): what a restarted store
node reads back, a torn record, stale generations, and the log written anew."""

import os

from mooncake_ray._private.store.spill_parents import COMPACT_SLACK, SpillParents


def test_parents_read_back_for_the_generations_on_disk_only(tmp_path):
    log = SpillParents(str(tmp_path))
    log.record([("a", 1, ""), ("b", 1, "a"), ("c", 1, "b"), ("b", 2, "x"), ("d", 5, "c\u00e9")])
    log.close()
    # "b" is on disk at generation 2 (its newer record wins), "c" at 3 (its record is stale),
    # "e" has none: no parent, as before the log existed
    again = SpillParents(str(tmp_path))
    assert again.load({"a": 1, "b": 2, "c": 3, "d": 5, "e": 1}) == {"b": "x", "d": "c\u00e9"}
    # written anew with what it kept, and read back the same
    assert SpillParents(str(tmp_path)).load({"b": 2, "d": 5}) == {"b": "x", "d": "c\u00e9"}


def test_a_record_torn_by_a_kill_is_dropped_and_the_others_kept(tmp_path):
    log = SpillParents(str(tmp_path))
    log.record([("b", 1, "a"), ("c", 1, "b")])
    log.close()
    size = os.path.getsize(log.path)
    with open(log.path, "r+b") as f:
        f.truncate(size - 1)
    assert SpillParents(str(tmp_path)).load({"b": 1, "c": 1}) == {"b": "a"}


def test_the_log_is_written_anew_once_it_has_grown_past_its_live_records(tmp_path):
    log = SpillParents(str(tmp_path))
    log.load({})
    log.record([(f"k{i}", 1, "p") for i in range(COMPACT_SLACK)])
    assert not log.due()
    log.record([("one", 1, "p")])
    assert log.due()
    log.rewrite([("k1", 1, "p"), ("k2", 1, "")])
    assert not log.due() and SpillParents(str(tmp_path)).load({"k1": 1, "k2": 1}) == {"k1": "p"}
