"""The client's location cache: a GET of a key whose placement the client knows reads the
bytes while the master's lookup is in flight, and keeps them only if the master's answer
names that same placement. On a real 3-node cluster, with tcp and with shared memory."""

import os

import numpy as np
import pytest

import mooncake_ray
from mooncake_ray import ObjectNotFoundError
from mooncake_ray._private import rpc
from mooncake_ray._private.client.locations import Loc

MB = 1 << 20
PROTOCOLS = ["tcp", "shm"]


def rand(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def store(make_store, protocol, **client):
    return make_store(transport={"protocol": protocol, "devices": ["lo"], "rpc_timeout_s": 2.0,
                                 "transfer_timeout_s": 5.0},
                      client={"early_read_max_bytes": "64mb", **client})


def early(client):
    return client.local_stats["early_reads"], client.local_stats["early_reads_dropped"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_reads_of_own_puts_overlap_the_lookup(make_store, protocol):
    s = store(make_store, protocol)
    # small values go through the put slab (one master call), large ones the two-call put
    sizes = [1, 4096, 70_000, 5 * MB]
    vals = {f"k{n}": rand(n, n) for n in sizes}
    for k, v in vals.items():
        s.put(k, v)
    for k, v in vals.items():
        assert s.get(k) == v
    buf = np.zeros(5 * MB, dtype=np.uint8)
    s.register_buffer(buf)
    assert s.get_into(f"k{5 * MB}", buf) == 5 * MB and buf.tobytes() == vals[f"k{5 * MB}"]
    # over the network every read here overlaps its lookup; a same-host mapped copy only from
    # 64 KiB (a shorter memcpy is over before an asynchronous call would pay off)
    overlapped = [n for n in sizes if protocol == "tcp" or n >= 64 << 10]
    if protocol == "shm":  # every store node's arena mapped here, from its file in /dev/shm
        nodes = s._shards[0].reads._nodes
        paths = {nid: (nodes.peek(nid).region.read_path, info["arena_file"], os.path.exists(info["arena_file"]))
                 for nid, info in ((n["node_id"], n) for n in s._shards[0].master.call(rpc.NODES))
                 if nodes.peek(nid) is not None}
        assert paths and all(p[0] == "memcpy" for p in paths.values()), paths
    assert early(s) == (len(overlapped) + 1, 0)
    # a client that never saw the keys reads them the usual way, then knows them
    other = mooncake_ray.connect(config=s.config)
    try:
        assert [other.get(k) for k in vals] == list(vals.values())
        assert early(other) == (0, 0)
        assert [other.get(k) for k in vals] == list(vals.values())
        assert early(other) == (len(overlapped), 0)
    finally:
        other.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_replaced_or_removed_value_is_never_read_from_its_old_place(make_store, protocol):
    s = store(make_store, protocol)
    other = mooncake_ray.connect(namespace=s.config.namespace)
    try:
        for n, key in ((64 << 10, "small"), (3 * MB, "large")):
            old, new = rand(n, 1), rand(n, 2)
            s.put(key, old)
            # Another client replaces the value: the old extent still holds the old bytes
            # (until reused), so an early read of the remembered place reads them. They
            # must be dropped.
            other.upsert(key, new)
            before = early(s)
            assert s.get(key) == new
            assert early(s) == (before[0], before[1] + 1)
            assert s.get(key) == new  # it now knows the new place
            assert early(s) == (before[0] + 1, before[1] + 1)
            other.remove(key, force=True)
            with pytest.raises(ObjectNotFoundError):
                s.get(key)
            assert early(s) == (before[0] + 1, before[1] + 2)
    finally:
        other.close()


def test_a_wrong_remembered_place_is_dropped_whatever_field_differs(make_store):
    """Tamper with the cache the way a stale entry could be wrong: the offset of another
    key's bytes, or the right offset with another placement id (the value's DRAM copy made
    anew). Each must be caught by the master's answer, and the right bytes returned."""
    s = store(make_store, "tcp")
    a, b = rand(8192, 3), rand(8192, 4)
    s.put("a", a)
    s.put("b", b)
    loc_a, loc_b = s._locs["a"], s._locs["b"]
    assert loc_a[:2] != loc_b[:2] and loc_a[5] == loc_b[5] == 0
    wrong = [
        Loc(loc_a[0], loc_a[1], loc_b[2], loc_b[3], loc_b[4], 0),          # b's offset
        Loc(loc_a[0], loc_a[1], loc_a[2], loc_a[3], loc_a[4], 12345),      # another placement
        Loc(loc_a[0], loc_b[1], loc_a[2], loc_a[3], loc_a[4], 0),          # another gen
    ]
    for i, loc in enumerate(wrong):
        s._locs["a"] = loc
        assert s.get("a") == a
        assert early(s) == (0, i + 1)
    assert s._locs["a"] == loc_a  # the master's answer put the right place back
    assert s.get("a") == a and early(s) == (1, len(wrong))


def test_large_network_reads_wait_for_the_lookup_by_default(make_store):
    s = store(make_store, "tcp", early_read_max_bytes=1 << 20)
    s.put("small", rand(1 << 20, 5))
    s.put("large", rand((1 << 20) + 1, 6))
    assert s.get("small") == rand(1 << 20, 5) and early(s) == (1, 0)
    assert s.get("large") == rand((1 << 20) + 1, 6) and early(s) == (1, 0)
