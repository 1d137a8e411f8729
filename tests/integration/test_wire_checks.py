"""Offsets, lengths and counts from the wire are checked before use: a store node refuses
a promote item naming an extent outside its arena and stays up, losing nothing."""

import pytest

from mooncake_ray._private import rpc


@pytest.fixture
def spill_store(make_store, tmp_path):
    s = make_store(segment_size_bytes="8mb",
                   spill={"enabled": True, "directory": str(tmp_path / "spill"), "capacity_bytes": "64mb"})
    s.put("keep", b"precious")
    return s


@pytest.mark.parametrize("item", [
    ["keep", 1, 8 << 20, 4096],          # starts at the arena's end
    ["keep", 1, (8 << 20) - 4096, 8192],  # runs past it
    ["keep", 1, -4096, 4096],             # before it
    ["keep", 1, 1 << 62, 1 << 62],        # wraps a 64-bit sum
    ["keep", 1, "0", 4096],               # not an int
    ["keep", 1, 0],                       # too short
    "keep",                               # not an item
])
def test_promote_outside_the_arena_is_refused(spill_store, item):
    s = spill_store
    info = s._master.call(rpc.NODES)[0]
    peer = s.engine.connect(info["address"])
    reply = rpc.unpack(s.engine.call(peer, rpc.NODE_PROMOTE_RPC, rpc.pack([item]), timeout_s=5.0))
    assert reply == ["InvalidArgumentError"]
    assert s.get("keep") == b"precious"
    s.upsert("after", b"still serving")
    assert s.get("after") == b"still serving"
