"""A master shard stopped, then killed, on a real 3-node Ray cluster: the other shards keep
serving reads and writes throughout, calls on the stopped shard's keys fail with
MasterUnavailableError (per key in a batch), and the killed shard comes back with its
index rebuilt from the store nodes' inventories."""

import os
import signal

import numpy as np
import pytest
import ray

import mooncake_ray
from mooncake_ray._private.naming import master_name
from mooncake_ray._private.shards import shard_of
from tests.conftest import wait_for

SHARDS = 4
VICTIM = 2


def val(i, n=5000):
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_one_shard_killed_the_others_keep_serving_and_it_rebuilds(make_store):
    s = make_store(master={"shards": SHARDS}, client={"master_retry_timeout_s": 2.0})
    ns = s.config.namespace
    keys = [f"f/{i}" for i in range(300)]
    assert s.batch_put(keys, [val(i) for i in range(300)]) == [None] * 300
    masters = [ray.get_actor(master_name(i), namespace=ns) for i in range(SHARDS)]
    assert all(ray.get([m.flush_inventory.remote() for m in masters]))
    victim = masters[VICTIM]
    inc, pid = ray.get(victim.ping.remote()), ray.get(victim.pid.remote())
    theirs = [i for i, k in enumerate(keys) if shard_of(k, SHARDS) == VICTIM]
    ours = [i for i, k in enumerate(keys) if shard_of(k, SHARDS) != VICTIM]
    assert theirs and ours

    os.kill(pid, signal.SIGSTOP)  # the shard stops answering (as a hung or partitioned process)
    try:
        # The other shards serve reads and writes as before.
        assert s.batch_get([keys[i] for i in ours]) == [val(i) for i in ours]
        new = [f"g/{i}" for i in range(200)]
        new_ours = [k for k in new if shard_of(k, SHARDS) != VICTIM]
        assert s.batch_put(new_ours, [val(1000 + i) for i in range(len(new_ours))]) == [None] * len(new_ours)
        assert s.batch_get(new_ours) == [val(1000 + i) for i in range(len(new_ours))]
        # The stopped shard's keys fail, alone: per key in a batch, raised for one key.
        mixed = [f"h/{i}" for i in range(40)]
        res = s.batch_put(mixed, [b"v"] * 40)
        for k, r in zip(mixed, res):
            if shard_of(k, SHARDS) == VICTIM:
                assert isinstance(r, mooncake_ray.MasterUnavailableError), (k, r)
            else:
                assert r is None, (k, r)
        with pytest.raises(mooncake_ray.MasterUnavailableError, match=master_name(VICTIM)):
            s.get(keys[theirs[0]])
    finally:
        os.kill(pid, signal.SIGKILL)  # Ray restarts it; it rebuilds from the inventories

    wait_for(lambda: ray.get(victim.ping.remote(), timeout=5) != inc, timeout_s=60,
             what="the killed shard to restart")
    # Every key acknowledged before the kill reads back, the rebuilt shard's included.
    got = s.batch_get(keys)
    assert [k for k, v in zip(keys, got) if v is None] == []
    assert got == [val(i) for i in range(300)]
    wait_for(lambda: not s.stats()["recovering"], timeout_s=30, what="the shard to finish rebuilding")
    st = s.stats()
    assert st["shards"][VICTIM]["keys"] == len(theirs)  # the failed puts of its keys left nothing
    # Puts to the rebuilt shard work again.
    late = [keys[i].replace("f/", "late/") for i in theirs]
    assert s.batch_put(late, [b"after"] * len(late)) == [None] * len(late)
    assert s.batch_get(late) == [b"after"] * len(late)
    assert s.batch_get(new_ours) == [val(1000 + i) for i in range(len(new_ours))]
