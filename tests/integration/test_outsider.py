"""A process that holds the store's transport addresses and a node's rkey, but not the
store's secret (it is not a member of the Ray cluster), can call, read and write nothing."""

import json
import subprocess
import sys

import ray

from mooncake_ray._private import auth, rpc
from mooncake_ray._private.naming import MASTER_NAME

OUTSIDER = r"""
import json, sys
from mooncake_ray.config import TransportConfig
from mooncake_ray._private.transport import Engine
from mooncake_ray.errors import MooncakeRayError
target = json.loads(sys.stdin.read())
out = {}
for secret in (None, b"x" * 32, bytes.fromhex(target["near_secret"])):
    label = "none" if secret is None else ("wrong" if secret == b"x" * 32 else "near")
    for role in ("master", "node"):
        eng = Engine.from_config(TransportConfig(devices=["lo"]), name="outsider")
        if secret is not None:
            eng.set_auth_secret(secret)
        try:
            peer = eng.connect(bytes.fromhex(target[role]), timeout_s=5.0)
            got = ["connected"]
            try:
                got.append(eng.call(peer, 1, bytes.fromhex(target["nodes_req"]), timeout_s=3.0).hex())
            except MooncakeRayError as e:
                got.append(type(e).__name__)
            try:
                r = eng.import_remote(peer, bytes.fromhex(target["rkey"]), target["base"], target["capacity"])
                buf = bytearray(4096)
                eng.read([(r, 0, buf)], timeout_s=3.0)
                got.append("read")
            except MooncakeRayError as e:
                got.append(type(e).__name__)
            out[f"{label}/{role}"] = got
        except MooncakeRayError as e:
            out[f"{label}/{role}"] = [type(e).__name__, str(e)[:200]]
        eng.close()
print(json.dumps(out))
"""


def test_outsider_without_the_secret_gets_nothing(make_store):
    s = make_store(segment_size_bytes="8mb")
    s.put("keep", b"precious")
    ns = s.config.namespace
    master = ray.get_actor(MASTER_NAME, namespace=ns)
    node = s._master.call(rpc.NODES)[0]
    secret = auth.store_secret(ns)
    near = bytes([secret[0] ^ 1]) + secret[1:]  # one bit off
    target = {"master": ray.get(master.rpc_address.remote()).hex(), "node": node["address"].hex(),
              "rkey": node["rkey"].hex(), "base": node["base"], "capacity": node["capacity"],
              "nodes_req": rpc.pack([rpc.NODES]).hex(), "near_secret": near.hex()}
    before = s.engine.stats()
    proc = subprocess.run([sys.executable, "-c", OUTSIDER], input=json.dumps(target), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(got) == {f"{a}/{b}" for a in ("none", "wrong", "near") for b in ("master", "node")}
    for case, res in got.items():
        assert res[0] == "AuthenticationError", (case, res)
    # the store is untouched and its members still work
    assert s.get("keep") == b"precious"
    s.put("after", b"v")
    assert s.get("after") == b"v"
    assert before["auth_enabled"]


def test_members_share_one_secret_per_store(make_store):
    a = make_store(segment_size_bytes="8mb")
    b = make_store(segment_size_bytes="8mb")
    sa, sb = auth.store_secret(a.config.namespace), auth.store_secret(b.config.namespace)
    assert len(sa) == auth.SECRET_BYTES and sa != sb
    a.put("k", b"a")
    b.put("k", b"b")
    assert a.get("k") == b"a" and b.get("k") == b"b"


def _node_peer(s):
    info = s._master.call(rpc.NODES)[0]
    return info, s.engine.connect(info["address"])


def test_a_client_cannot_play_master_or_store_node(make_store, tmp_path):
    """A member holding the store's secret but not the node key: the calls only the
    master makes to a store node, or a store node to the master, are refused."""
    import pytest

    from mooncake_ray.errors import AuthenticationError, MooncakeRayError

    s = make_store(segment_size_bytes="8mb",
                   spill={"enabled": True, "directory": str(tmp_path / "spill"), "capacity_bytes": "64mb"})
    s.put("keep", b"precious")
    info, peer = _node_peer(s)
    before = s._master.call(rpc.NODES)
    forged = rpc.pack([1, 1, [[["ghost", 1, 4096, "dram", 0, 4096, 0]], [], []]])
    with pytest.raises(MooncakeRayError, match="not signed by this store's master"):
        s.engine.call(peer, rpc.NODE_INVENTORY_RPC, forged, timeout_s=5.0)
    for op, items in ((rpc.OFFLOAD_DONE, [["keep", 1, 4096, True, ""]]),
                      (rpc.PROMOTE_BEGIN, [["keep", 1, 0, 8]]),
                      (rpc.PROMOTE_DONE, [["keep", 1, 0, ""]])):
        for tag in ((), (b"\0" * 32,)):
            with pytest.raises(AuthenticationError, match="only accepted from the store's master or store nodes"):
                s._master.call(op, info["node_id"], items, *tag)
    # a promote of an extent the master did not reserve writes nothing
    reply = rpc.unpack(s.engine.call(peer, rpc.NODE_PROMOTE_RPC, rpc.pack([["keep", 1, 0, 4096]]), timeout_s=5.0))
    assert reply == ["InvalidArgumentError"]
    assert s.get("keep") == b"precious" and not s.exists("ghost")
    assert s._master.call(rpc.NODES) == before


def test_a_client_cannot_take_a_healthy_node_out_of_use(make_store):
    """A report that a node is unreachable is checked by the master: with heartbeats 5 s
    apart, puts go to the node again well before the next heartbeat could vouch for it."""
    import time

    s = make_store(segment_size_bytes="8mb",  # no put slab: every put asks the master for room
                   master={"heartbeat_interval_s": 5.0, "node_ttl_s": 30.0, "put_slab_bytes": 0})
    s.put("first", b"v")
    for n in s._master.call(rpc.NODES):
        s._master.call(rpc.REPORT_UNREACHABLE, n["node_id"])
    t0 = time.monotonic()
    while True:
        try:
            s.put(f"after-{time.monotonic()}", b"v")
            break
        except Exception:
            assert time.monotonic() - t0 < 1.5, "the reported nodes stayed out of use"
            time.sleep(0.02)
    assert time.monotonic() - t0 < 1.5
