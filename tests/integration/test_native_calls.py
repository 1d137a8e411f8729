"""The master's native path on a real cluster: gets, exists and one-call put commits
answered by the C++ index, their leases, hits, misses and commits applied to the state
machine before it acts, and the same answers with the path turned off."""

import numpy as np
import pytest

from mooncake_ray import ObjectExistsError, ObjectLeasedError, ObjectNotFoundError
from mooncake_ray._private import rpc
from tests.conftest import wait_for

KB = 1 << 10


def rand(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("native", [True, False])
def test_reads_answer_the_same_with_and_without_the_native_path(make_store, native):
    s = make_store(master={"native_calls": native})
    values = {f"v{i}": rand(1 + i * 997, i) for i in range(40)}
    before = s.stats()
    for k, v in values.items():
        s.put(k, v)
    s.batch_put([f"b{i}" for i in range(30)], [rand(5000, i) for i in range(30)])
    with pytest.raises(ObjectExistsError):
        s.put("v3", b"again")  # a conflict: Python answers, the value stays
    assert s.stats()["puts"] - before["puts"] == 70  # applied by the master, natively or not
    commits = s.stats()["native_calls"] - before["native_calls"]
    assert commits >= 30 if native else commits == 0  # one per put (bar slab returns)
    before = s.stats()
    assert [s.get(k) for k in values] == list(values.values())
    assert s.batch_get([f"b{i}" for i in range(30)]) == [rand(5000, i) for i in range(30)]
    assert s.batch_get(list(values) + ["nope"])[:-1] == list(values.values())
    assert s.batch_exists(["v0", "nope", "v39"]) == [True, False, True]
    with pytest.raises(ObjectNotFoundError):
        s.get("nope")
    st = s.stats()
    assert st["hits"] - before["hits"] == 110  # applied to the state machine either way
    assert st["misses"] - before["misses"] == 2
    served = st["native_calls"] - before["native_calls"]
    assert served >= 42 if native else served == 0


def _removed(s, key) -> bool:
    try:
        return s.remove(key)
    except ObjectLeasedError:
        return False


def test_a_native_lease_holds_off_remove_until_released(make_store):
    s = make_store()
    s.put("k", rand(8 * KB))
    m = s._master
    size, gen, _ttl, reps, lease = m.call(rpc.GET, ["k"], s._here, [])[0]
    assert size == 8 * KB and lease >= 1 << 40, "answered by the native index"
    with pytest.raises(ObjectLeasedError):
        s.remove("k")  # the state machine saw the lease before it acted
    m.call(rpc.RELEASE, [["k", gen, lease]])
    assert s.remove("k") is True
    assert not s.exists("k")


def test_upsert_and_remove_reach_the_native_index_at_once(make_store):
    s = make_store()
    s.put("u", b"one")
    assert s.get("u") == b"one"
    s.upsert("u", b"two!")
    assert s.get("u") == b"two!"
    # the get's lease ends when its release is flushed (50 ms after the read)
    wait_for(lambda: s.batch_exists(["u"]) and _removed(s, "u"), what="remove after the lease")
    assert not s.exists("u")
    with pytest.raises(ObjectNotFoundError):
        s.get("u")
