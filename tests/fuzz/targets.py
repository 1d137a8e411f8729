"""Fuzz targets: one function per target, each taking the fuzzer's ``data: bytes``.

A target returns normally when the input was handled as the code promises (answered, or
refused with a typed error) and raises :class:`Finding` (or lets an unexpected exception
through) otherwise; ``runner.py`` runs them under atheris, ``test_fuzz.py`` for a fixed
number of runs inside ``make test``, ``run.py`` for longer. ``seeds(name)`` gives each
target a small corpus of valid messages to start from.

Targets:
  master_rpc      ``rpc.unpack`` then the master's dispatch of ``[op, *args]`` to its
                  handler table, against a ``MasterState`` with three mounted fake nodes,
                  a few stored keys, a pending put and a slab (no Ray). Anything raised
                  other than a ``MooncakeRayError`` is a finding (the RPC layer would answer
                  it as a ``RemoteHandlerError``: a bug of the master, see ``rpc.serve_request``);
                  so is a broken state invariant afterwards.
  pyindex         ``PyIndex.serve`` (the reference read index): answers or declines (None).
  native_index    ``_native.MasterIndex().serve`` on the same prepared mirror, compared
                  with ``PyIndex.serve``: the same answer, or both decline.
  store_inventory ``StoreInventory.apply`` of a message ``[mount_id, seq, delta]``: applied
                  whole (well-formed entries only) or refused with a typed error leaving the
                  inventory and its sequence untouched.
  store_promote   the store node's promote-item check (``_promote_item_ok``): an item it
                  accepts names an extent inside the arena, with a str key and an int gen.
  transport       raw active messages (HELLO, AUTH1, AUTH2, RPC and push requests, others)
                  with fuzzed headers and payloads from an engine in this process to two
                  receivers, one holding a secret and one without; every ``CHECK_EVERY``
                  inputs each receiver must still answer a legitimate peer's RPC, and the
                  secret receiver's handler must never have run for anyone but that peer.
"""

from __future__ import annotations

import os
import struct
import threading
import time

import msgpack

from mooncake_ray import errors
from mooncake_ray._private import rpc
from mooncake_ray._private.master.allocator import ALIGN
from mooncake_ray._private.master.pyindex import PyIndex
from mooncake_ray._private.master.state import MasterState, Policy
from mooncake_ray._private.master.types import InventoryEntry, NodeInfo
from mooncake_ray._private.store.inventory import DISK, DRAM, STALE, StoreInventory

# What msgpack raises on bytes that are not one well-formed object (the decoder refusing).
# TypeError: a map key msgpack cannot hash (an array or a map), which ``rpc.unpack`` lets out.
DECODE_ERRORS = (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError)


class Finding(Exception):
    """An input the code under test did not handle as it promises."""


def _decode(data: bytes):
    """``rpc.unpack(data)``, or ``_DECLINED`` when msgpack refuses the bytes."""
    try:
        return rpc.unpack(data)
    except DECODE_ERRORS:
        return _DECLINED


_DECLINED = object()


# ------------------------------------------------------------------------ master RPC --
NODES = 3
CAP = 64 * ALIGN
OWNER = "c1"


def _fixed_clock():
    return 1000.0


def master_fixture():
    """A fresh ``MasterState`` (deterministic: fixed clock, wall clock 0, seed 1) with
    three nodes, keys ``k0``..``k3`` stored (``k1`` pinned), ``pend`` pending and one slab
    of ``c1``. Returns ``(state, facts)``; facts name generations and ids seeds use."""
    # shard 1 of 2 (its keys k0..k3 fall on it): chain messages from shard 0 are taken
    pol = Policy(allocation_strategy="free_ratio_first", shards=2, shard=1)
    m = MasterState(pol, clock=_fixed_clock, wall_ns=lambda: 0, seed=1)
    for i in range(NODES):
        m.mount(NodeInfo(f"n{i}", "inc", b"addr", b"rkey", 0, CAP, ray_node_id=f"ray{i}"))
    facts = {"gens": {}}
    for i in range(4):
        gen, _ = m.put_start(f"k{i}", ALIGN + i, None, f"ray{i % NODES}", "c0", False)
        m.put_end(f"k{i}", gen)
        facts["gens"][f"k{i}"] = gen
    m.pin("k1", False, 30.0)
    facts["pend"], _ = m.put_start("pend", 100, None, None, "c0", False)
    grant = m.slab_grant(OWNER, "ray0", 0)
    facts["slab"] = grant[0]
    facts["lease"] = m.get("k0", "ray0")[4]
    m.drain_effects()
    return m, facts


def master_table(state: MasterState) -> dict:
    """The master actor's own RPC handler table (``MasterActor._rpc_table``) over ``state``:
    an actor object made without ``__init__`` (no Ray, no engine) holding only the state.
    Calls that need the node key are taken unsigned (the fuzzer cannot sign; the state
    machine behind them is what is fuzzed), and no probe thread is started."""
    from mooncake_ray._private.master.actor import MasterActor

    class FuzzMaster(MasterActor):
        def _from_node(self, fn):
            return lambda node_id, items, tag=None: fn(node_id, items)

        def _start_probe(self, node_id):
            self._probing.discard(node_id)

    self = FuzzMaster.__new__(FuzzMaster)
    self.state = state
    self.incarnation = "fuzz"
    self._probing = set()
    return self._rpc_table()


# The wire types of each master operation's arguments (rpc.py, the handlers' signatures):
# a request that fits is "well-formed"; a handler raising anything but a MooncakeRayError
# on one is a bug. ``STRICT`` (env FUZZ_STRICT=1) makes any such exception a finding,
# whatever the request's shape; by default one on a malformed request (a wrong arity, a
# str where an int goes) is counted in ``SHAPE_REFUSALS`` (answered RemoteHandlerError,
# not a typed InvalidArgumentError: reported, not failed), but the state must still be
# whole after it.
def _int(x):
    return type(x) is int


def _str(x):
    return type(x) is str


def _bool(x):
    return type(x) is bool


def _opt(f):
    return lambda x: x is None or f(x)


def _num(x):
    return type(x) in (int, float)


def _list(f):
    return lambda x: isinstance(x, list) and all(f(e) for e in x)


def _rec(*fields, optional=0):
    """A list of ``fields`` (the last ``optional`` of them may be missing)."""
    def ok(x):
        return (isinstance(x, list) and len(fields) - optional <= len(x) <= len(fields)
                and all(f(v) for f, v in zip(fields, x)))
    return ok


def _any(x):
    return True


_ARGS = {  # op -> (argument checks, how many trailing ones are optional)
    rpc.PUT_START: ((_list(_rec(_str, _int, _opt(_int), _bool, _str, optional=3)), _opt(_str), _str), 2),
    rpc.PUT_END: ((_list(_rec(_str, _int)),), 0),
    rpc.PUT_REVOKE: ((_list(_rec(_str, _int)),), 0),
    rpc.GET: ((_list(_str), _opt(_str), _opt(_list(_rec(_str, _int, _int)))), 2),
    rpc.RELEASE: ((_list(_rec(_str, _int, _int)),), 0),
    rpc.EXISTS: ((_list(_str),), 0),
    rpc.REMOVE: ((_list(_str), _bool), 1),
    rpc.REMOVE_PREFIX: ((_str, _bool), 1),
    rpc.NODES: ((), 0),
    rpc.PIN: ((_list(lambda x: _str(x) or _rec(_str, _bool, _opt(_num), optional=2)(x)),), 0),
    rpc.UNPIN: ((_list(_str),), 0),
    rpc.REPORT_UNREACHABLE: ((_str,), 0),
    rpc.OFFLOAD_DONE: ((_str, _list(_rec(_str, _int, _int, _bool, _str))), 0),
    rpc.PROMOTE_BEGIN: ((_str, _list(_rec(_str, _int, _int, _int))), 0),
    rpc.PROMOTE_DONE: ((_str, _list(_rec(_str, _int, _int, _str))), 0),
    rpc.SLAB_GRANT: ((_str, _opt(_str), _int, _list(_int)), 3),
    rpc.PUT_COMMIT: ((_list(_rec(_str, _int, _int, _int, _bool, _str, optional=2)), _str, _list(_int)), 1),
    rpc.SLAB_RETURN: ((_list(_int),), 0),
    rpc.CHAIN_LINKS: ((_int, _list(_rec(_str, _str, _str)), _opt(_list(_rec(_str, _str)))), 1),
}


def well_formed(req) -> bool:
    """``req`` is ``[op, *args]`` with args of the operation's wire types."""
    if not (isinstance(req, list) and req and _int(req[0])):
        return False
    if req[0] == rpc.PING:
        return True
    spec = _ARGS.get(req[0])
    if spec is None:
        return False
    checks, optional = spec
    args = req[1:]
    return len(checks) - optional <= len(args) <= len(checks) and all(f(a) for f, a in zip(checks, args))


STRICT = os.environ.get("FUZZ_STRICT") == "1"
SHAPE_REFUSALS = [0]
NATIVE_DECLINED = [0]


def master_rpc(data: bytes) -> None:
    req = _decode(data)
    m, _ = master_fixture()
    table = master_table(m)
    reply = rpc.serve_request(table, data)  # the RPC layer never raises...
    rep = rpc.unpack(reply)
    if not (isinstance(rep, list) and (rep[0] == rpc.OK and len(rep) == 2 or rpc.is_err(rep))):
        raise Finding(f"serve_request answered {rep!r}")
    try:
        m.check_invariants()
    except Exception as e:
        raise Finding(f"the master's state is broken after {req!r} (answered {rep!r})") from e
    if req is _DECLINED or not (rpc.is_err(rep) and rep[1] == "RemoteHandlerError"):
        return  # answered, refused with a typed error, or bytes msgpack refused
    if not STRICT and not well_formed(req):
        SHAPE_REFUSALS[0] += 1
        return
    # A bug's answer: run the request again on a fresh state the same way, to let the
    # exception out with its traceback.
    m, _ = master_fixture()
    table = master_table(m)
    try:
        table[req[0]](*req[1:])
    except errors.MooncakeRayError:
        pass
    except Exception as e:
        raise Finding(f"the master answered {rep[2]!r} to {req!r}") from e
    raise Finding(f"the master answered {rep[2]!r} to {req!r}")


def master_rpc_seeds() -> list[bytes]:
    _, f = master_fixture()
    g, slab, lease = f["gens"], f["slab"], f["lease"]
    reqs = [
        [rpc.PUT_START, [["new", 4096], ["k0", 10, 1, True], ["big", 1 << 40]], "ray0", "c1"],
        [rpc.PUT_START, [["r2", 100, 2]]],
        [rpc.PUT_END, [["pend", f["pend"]], ["k0", g["k0"]]]],
        [rpc.PUT_REVOKE, [["pend", f["pend"]]]],
        [rpc.GET, ["k0", "k1", "missing"], "ray1", [["k0", g["k0"], lease]]],
        [rpc.GET, ["k2"]],
        [rpc.RELEASE, [["k0", g["k0"], lease]]],
        [rpc.EXISTS, ["k0", "nope"]],
        [rpc.REMOVE, ["k2", "k1"], True],
        [rpc.REMOVE_PREFIX, "k", False],
        [rpc.NODES],
        [rpc.PIN, [["k0", True, 5.0], ["k3", False, None]]],
        [rpc.UNPIN, ["k1"]],
        [rpc.REPORT_UNREACHABLE, "n1"],
        [rpc.PING, 0],
        [rpc.OFFLOAD_DONE, "n0", [["k0", g["k0"], 8192, True, ""]]],
        [rpc.PROMOTE_DONE, "n0", [["k0", g["k0"], 0, ""]]],
        [rpc.SLAB_GRANT, "c2", "ray1", 8192, [slab]],
        [rpc.PUT_COMMIT, [["s1", slab, 0, 100], ["s2", slab, 4096, 10, True]], OWNER, []],
        [rpc.SLAB_RETURN, [slab, 99]],
        [rpc.CHAIN_LINKS, 0, [["link", "k0", "c5"], ["gone", "x4", ""], ["back", "x4", ""], ["unlink", "k0", "c5"]],
         [["k2", "c6"]]],
        [rpc.CHAIN_LINKS, 0, [["link", "k1", "c5"]]],
    ]
    return [rpc.pack(r) for r in reqs]


# ------------------------------------------------------------------------- read index --
SLAB_ID = 3


def prepare_index(ix) -> None:
    """The same table in either index: hot keys with and without DRAM replicas, cold ones
    in DRAM (one with two leases held, one leased long ago) and on disk, a pending key, a
    slab of ``c1``; generations from the counter (above the wall clock)."""
    ix.set_lease_ttl(2.5)
    ix.set_enabled(True)
    ix.set_max_log(64)
    ix.set_commits(True)
    ix.set_max_key_bytes(64)
    ix.set_next_gen(1 << 62)
    ix.set("k", 4096, 7, [("n0", "r0", 8192, 4096, "i0", 5)])
    ix.set("two", 100, 8, [("n0", "r0", 0, 4096, "i0", 0), ("n1", "r1", 4096, 4096, "i1", 0)])
    ix.set("é", 1, 9, [("n1", "r1", 1 << 40, 4096, "i1", 1 << 62)])
    ix.set("disk", 10, 10, [])
    far = time.monotonic() + 1000
    ix.set_cold("c", 64, 11, "n0", "r0", "i0", False, 64, 64, 0, 0.0, [])
    ix.set_cold("c2", 300, 12, "n1", "r1", "i1", False, 128, 320, 3, far, [1 << 41, (1 << 41) + 1])
    ix.set_cold("c1", 5000, 13, "n0", "r0", "i0", False, 8192, 8192, 0, far, [(1 << 41) + 2])
    ix.set_cold("cd", 5000, 14, "n1", "r1", "i1", True, 0, 12288, 0, 0.0, [])
    ix.add_pending("pend")
    ix.set_slab(SLAB_ID, OWNER, "n0", "r0", "i0", [(0, 4 * ALIGN), (8 * ALIGN, 2 * ALIGN)])


def _index_serve(ix, data: bytes):
    out = ix.serve(data)
    if out is not None and type(out) is not bytes:
        raise Finding(f"serve returned {type(out).__name__}")
    return out


def pyindex(data: bytes) -> None:
    ix = PyIndex()
    prepare_index(ix)
    out = _index_serve(ix, data)
    if out is not None:
        rep = rpc.unpack(out)
        if not (isinstance(rep, list) and len(rep) == 2 and rep[0] == rpc.OK):
            raise Finding(f"PyIndex answered {rep!r}")


def native_index(data: bytes) -> None:
    from mooncake_ray._private.native import _native

    nat, ref = _native.MasterIndex(), PyIndex()
    for ix in (nat, ref):
        prepare_index(ix)
    got, want = _index_serve(nat, data), _index_serve(ref, data)
    if got is None and want is not None and not STRICT:
        # Safe: the master's Python handler answers what the native index declines. Known
        # case: ints in signed encodings (msgpack 0xd0-0xd3) with values >= 0, which the
        # native reader refuses and msgpack-python never writes.
        NATIVE_DECLINED[0] += 1
        return
    if (got is None) != (want is None):
        raise Finding(f"native {'declined' if got is None else 'answered'}, reference "
                      f"{'declined' if want is None else 'answered'}: native {got!r}, reference {want!r}")
    if got is not None:
        a, b = rpc.unpack(got), rpc.unpack(want)
        if a != b:
            raise Finding(f"native answered {a!r}, reference {b!r}")
    if len(nat) != len(ref) or nat.served() != ref.served():
        raise Finding("native and reference mirrors differ after the call")
    (m1, h1, log1), (m2, h2, log2) = nat.drain(), ref.drain()
    if (m1, h1) != (m2, h2) or [e[:4] + e[5:] for e in log1] != [e[:4] + e[5:] for e in log2]:
        raise Finding(f"logs differ: native {m1, h1, log1!r}, reference {m2, h2, log2!r}")
    for key in ("c", "c1", "c2", "cd", "k"):
        a, b = nat.peek_cold(key), ref.peek_cold(key)
        if (a is None) != (b is None) or a is not None and (a[:7] != b[:7] or a[8] != b[8]):
            raise Finding(f"cold record {key!r} differs after the call: native {a!r}, reference {b!r}")
    if nat.keys("") != ref.keys(""):
        raise Finding("recency orders differ after the call")
    for sid in (SLAB_ID,):
        if nat.lookup_slab(sid) != ref.lookup_slab(sid):
            raise Finding("slabs differ after the call")


def index_seeds() -> list[bytes]:
    reqs = [
        [rpc.GET, ["k", "two", "nope"], "r1", [["k", 7, 1 << 32]]],
        [rpc.GET, ["é"]],
        [rpc.GET, ["disk"]],
        [rpc.GET, ["c", "c1", "k"], None, [["c1", 13, (1 << 41) + 2], ["c2", 12, 1 << 41]]],
        [rpc.GET, ["c2"]],
        [rpc.GET, ["c", "c"]],
        [rpc.GET, ["cd"]],
        [rpc.RELEASE, [["c2", 12, (1 << 41) + 1], ["c2", 11, 1 << 41], ["c", 11, 5]]],
        [rpc.EXISTS, ["k", "disk", "x"]],
        [rpc.RELEASE, [["k", 7, 1 << 32]]],
        [rpc.PUT_COMMIT, [["new", SLAB_ID, 0, 100], ["new2", SLAB_ID, 8 * ALIGN, 4096, True]], OWNER],
        [rpc.PUT_COMMIT, [["new", SLAB_ID, ALIGN, 5000]], OWNER, []],
        [rpc.PUT_COMMIT, [["pend", SLAB_ID, 0, 1]], OWNER, None],
    ]
    return [rpc.pack(r) for r in reqs]


# ------------------------------------------------------------------------- store node --
def inventory_fixture() -> StoreInventory:
    inv = StoreInventory([InventoryEntry("a", 5, 10, DRAM, 0, 4096), InventoryEntry("b", 6, 20, DRAM, 4096, 4096),
                          InventoryEntry("a", 4, 10, DISK, 0, 8192)])
    inv.begin_mount()  # mount 1
    inv.apply(1, 1, [[], [], []])
    return inv


def _entry_ok(k, e) -> bool:
    if not (type(e) is tuple and len(e) == 9):
        return False
    e = InventoryEntry(*e)
    return (type(e.key) is str and e.tier in (DRAM, DISK) and k == (e.key, e.tier) and type(e.parent) is str
            and all(type(x) is int for x in (e.gen, e.size, e.offset, e.length, e.pin, e.want)) and e.want >= 1)


def store_inventory(data: bytes) -> None:
    msg = _decode(data)
    # What the store node's handler destructures first (``_on_inventory``).
    if not (isinstance(msg, list) and len(msg) == 3):
        return
    mount_id, seq, delta = msg
    inv = inventory_fixture()
    before = (dict(inv.entries), inv.mount_id, inv.applied_seq)
    try:
        answer, files, offloads = inv.apply(mount_id, seq, delta)
    except errors.MooncakeRayError:
        if (dict(inv.entries), inv.mount_id, inv.applied_seq) != before:
            raise Finding(f"a refused message changed the inventory: {msg!r}") from None
        return
    except Exception as e:
        raise Finding(f"apply raised {type(e).__name__} on {msg!r}") from e
    if answer not in (b"", STALE):
        raise Finding(f"answer {answer!r}")
    if answer == STALE or inv.applied_seq == before[2]:
        if (dict(inv.entries), inv.applied_seq) != before[::2] or files or offloads:
            raise Finding(f"a message not applied changed the inventory: {msg!r}")
        return
    bad = [e for k, e in inv.entries.items() if not _entry_ok(k, e)]
    if bad:
        raise Finding(f"malformed entries kept: {bad!r} from {msg!r}")
    if not all(type(k) is str and type(g) is int for k, g in files):
        raise Finding(f"malformed disk drops returned: {files!r}")
    if not all(len(o) == 5 and type(o[0]) is str and all(type(x) is int for x in o[1:]) for o in offloads):
        raise Finding(f"malformed offloads returned: {offloads!r}")
    inv.counts()
    rpc.pack(inv.snapshot())


def inventory_seeds() -> list[bytes]:
    msgs = [
        [1, 2, [[["c", 9, 30, DRAM, 8192, 4096, 0]], [["a", 5, DRAM], ["a", 4, DISK]], [["b", 6, 20, 4096, 4096]]]],
        [1, 2, [[["a", 7, 10, DRAM, 0, 4096, 1]], [], []]],
        [1, 2, [[["d", 8, 10, DRAM, 0, 4096, 0, "c", 2]], [], []]],  # a value put with replicas=2
        [1, 1, [[], [], []]],
        [2, 1, [[], [["b", 6, DRAM]], []]],
    ]
    return [rpc.pack(m) for m in msgs]


PROMOTE_CAPS = (0, 4096, 8 << 20)


def store_promote(data: bytes) -> None:
    from mooncake_ray._private.store.actor import _promote_item_ok

    items = _decode(data)
    if not isinstance(items, list):
        return  # the handler refuses it with InvalidArgumentError
    for cap in PROMOTE_CAPS:
        for it in items:
            if _promote_item_ok(it, cap):
                key, gen, off, size = it
                if not (type(key) is str and type(gen) is int and type(off) is int and type(size) is int
                        and 0 <= off and 0 <= size and off + size <= cap):
                    raise Finding(f"promote item {it!r} accepted in an arena of {cap} bytes")


def promote_seeds() -> list[bytes]:
    return [rpc.pack(x) for x in (
        [["k", 1, 0, 4096], ["k", 2, (8 << 20) - 4096, 4096]],
        [["k", 1, 1 << 62, 1 << 62], ["k", 1, -1, 1], ["k", 1, 0, 8 << 20]],
        [["k", True, 0, 1], ["k", 1, 0.0, 1]],
    )]


# -------------------------------------------------------------------------- transport --
SECRET = b"fuzz-secret-0123456789abcdef0123"
AM_HELLO, AM_HELLO_ACK, AM_RPC_REQ, AM_RPC_REP, AM_PUSH_REQ, AM_AUTH1, AM_AUTH_RESP, AM_AUTH2 = range(21, 29)
AMS = (AM_HELLO, AM_HELLO_ACK, AM_RPC_REQ, AM_RPC_REP, AM_PUSH_REQ, AM_AUTH1, AM_AUTH_RESP, AM_AUTH2)
HANDLER = 7
PROBE = b"legit-probe:"
CHECK_EVERY = 64
MAX_HEADER = 512


class _Rig:
    """Two receivers (one with a secret), a legitimate peer of each, an outsider that
    sends the raw messages. Built on the first transport input, kept for the process."""

    def __init__(self) -> None:
        from mooncake_ray._private.transport import Engine

        def eng(name, secret=None):
            e = Engine(protocol="tcp", devices=["lo"], name=name, default_timeout_s=5.0)
            if secret:
                e.set_auth_secret(secret)
            return e

        self.seen = {"auth": [], "open": []}
        self.lock = threading.Lock()
        self.recv = {"auth": eng("fz-recv-auth", SECRET), "open": eng("fz-recv-open")}
        for name, r in self.recv.items():
            r.serve(HANDLER, self._handler(name))
        self.legit = {"auth": eng("fz-legit-auth", SECRET), "open": eng("fz-legit-open")}
        self.peers = {n: self.legit[n].connect(self.recv[n].address, timeout_s=10) for n in self.recv}
        self.outsider = eng("fz-outsider")
        self.inputs = 0
        self.probes = 0
        self.check()

    def _handler(self, name):
        def handle(payload: bytes) -> bytes:
            with self.lock:
                self.seen[name].append(bytes(payload[:64]))
            return b"ok:" + payload

        return handle

    def check(self) -> None:
        """Each receiver answers its legitimate peer; the secret one ran its handler for
        that peer's probes only."""
        for name, r in self.recv.items():
            self.probes += 1
            probe = PROBE + str(self.probes).encode()
            try:
                out = self.legit[name].call(self.peers[name], HANDLER, probe, timeout_s=10)
            except errors.MooncakeRayError as e:
                raise Finding(f"the {name} receiver no longer answers a legitimate peer: {e!r}") from e
            if out != b"ok:" + probe:
                raise Finding(f"the {name} receiver answered {out!r} to {probe!r}")
        with self.lock:
            strangers = [p for p in self.seen["auth"] if not p.startswith(PROBE)]
            self.seen = {"auth": [], "open": []}
        if strangers:
            raise Finding(f"the secret receiver ran its handler for an unauthenticated sender: {strangers[:3]!r}")


_rig: _Rig | None = None


def _patch(base: bytes, patch: bytes) -> bytes:
    """``base`` with ``patch`` applied as (position u16, byte) triples."""
    out = bytearray(base)
    for i in range(0, len(patch) - 2, 3):
        pos = int.from_bytes(patch[i:i + 2], "little")
        if out:
            out[pos % len(out)] = patch[i + 2]
    return bytes(out)


def transport(data: bytes) -> None:
    """Input: ``[recv/uid-fix/data-mode byte][am byte][header length u16][header][data]``."""
    global _rig
    if _rig is None:
        _rig = _Rig()
    rig = _rig
    if len(data) < 4:
        return
    ctl, am_b = data[0], data[1]
    hlen = min(int.from_bytes(data[2:4], "little"), MAX_HEADER)
    header, body = bytearray(data[4:4 + hlen]), data[4 + hlen:]
    name = "auth" if ctl & 1 else "open"
    recv = rig.recv[name]
    am = AMS[am_b % len(AMS)] if am_b < 248 else 19 + am_b % 12  # now and then one no engine handles
    uid = (None, rig.outsider.uid, rig.legit[name].uid, recv.uid)[(ctl >> 1) & 3]
    if uid is not None and len(header) >= 8:
        header[:8] = struct.pack("<Q", uid)
    mode = (ctl >> 3) & 3
    if mode:  # a real engine address, patched
        base = (rig.outsider.address, rig.legit[name].address, recv.address)[mode - 1]
        body = _patch(base, body)
    sender = rig.legit[name] if ctl & 0x20 else rig.outsider
    try:
        sender._native._debug_send_raw(recv.address, am, bytes(header), bytes(body))
    except errors.MooncakeRayError:
        pass  # the sender refused to send it (fine)
    rig.inputs += 1
    if rig.inputs % CHECK_EVERY == 0:
        rig.check()


def transport_seeds() -> list[bytes]:
    def frame(ctl, am, header, body=b""):
        return bytes([ctl, AMS.index(am)]) + struct.pack("<H", len(header)) + header + body

    tok = bytes(16)
    out = []
    for recv in (0, 1):
        out += [
            frame(recv | 2 << 1 | 1 << 3, AM_HELLO, struct.pack("<QQ", 0, 1)),  # HELLO, outsider's own address
            frame(recv | 1 << 1 | 1 << 3, AM_HELLO, struct.pack("<QQ", 0, 2), b"\x00\x00\x00"),
            frame(recv | 1 << 1, AM_AUTH1, struct.pack("<QQ", 0, 3) + bytes(16)),
            frame(recv | 1 << 1 | 1 << 3, AM_AUTH2, struct.pack("<QQ", 0, 4) + bytes(16 + 32)),
            frame(recv | 2 << 1, AM_RPC_REQ, struct.pack("<QQII", 0, 5, HANDLER, 0) + tok, b"x" * 32),
            frame(recv | 1 << 1 | 0x20, AM_RPC_REQ, struct.pack("<QQII", 0, 6, HANDLER, 0) + tok, b"y"),
            frame(recv | 1 << 1, AM_PUSH_REQ, struct.pack("<QQII", 0, 7, 8, 1) + tok, bytes(8) + bytes(24)),
            frame(recv | 1 << 1, AM_RPC_REP, struct.pack("<QQiI", 0, 8, 0, 0) + tok, b"reply"),
            frame(recv | 3 << 1, AM_HELLO_ACK, struct.pack("<QQiI", 0, 1, 0, 0) + tok),
            frame(recv | 1 << 1, AM_AUTH_RESP, struct.pack("<QQiI", 0, 3, 0, 0) + bytes(16 + 32)),
        ]
    return out


def transport_finish() -> None:
    """The last check of a run (the runner calls it when libFuzzer stops)."""
    if _rig is not None and _rig.inputs % CHECK_EVERY:
        _rig.check()


# ----------------------------------------------------------------------------- table --
TARGETS = {
    "master_rpc": (master_rpc, master_rpc_seeds),
    "pyindex": (pyindex, index_seeds),
    "native_index": (native_index, index_seeds),
    "store_inventory": (store_inventory, inventory_seeds),
    "store_promote": (store_promote, promote_seeds),
    "transport": (transport, transport_seeds),
}
# libFuzzer -max_len per target: room for the seeds and some growth.
MAX_LEN = {"master_rpc": 1024, "pyindex": 1024, "native_index": 1024, "store_inventory": 1024,
           "store_promote": 512, "transport": 2048}


def seeds(name: str) -> list[bytes]:
    return TARGETS[name][1]()


def run_one(name: str, data: bytes) -> None:
    TARGETS[name][0](data)

