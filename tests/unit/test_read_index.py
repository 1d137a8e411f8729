"""The state machine's side of the read index (fastpath.py), through the reference
``PyIndex``: the mirror follows every change, native commits are applied exactly as
``put_commit`` would, and what native calls granted is applied before anything is evicted."""

from mooncake_ray._private import rpc
from mooncake_ray._private.master.allocator import ALIGN
from mooncake_ray._private.master.pyindex import PyIndex
from tests.unit.test_master_state import make, put

K = ALIGN


def with_index(m, clock):
    ix = PyIndex()
    ix.clock = clock
    ix.wall_ns = m._wall_ns
    ix.set_lease_ttl(m.policy.lease_ttl_s)
    ix.set_max_key_bytes(m.policy.max_key_bytes)
    ix.set_commits(True)
    ix.set_enabled(True)
    m.index = ix
    for key in list(m._objects):
        m._mirror.key(key)
    return ix


def native(ix, *request):
    reply = ix.serve(rpc.pack(list(request)))
    return None if reply is None else rpc.decode_reply(reply)


def section(m, ix):
    """What the actor's lock does around a Python section: the log applied at its start;
    at its end, plain objects written back cold and the generation counter handed over."""
    m.apply_index_log(*ix.drain())
    m.flush()
    ix.set_next_gen(m._next_gen)


def test_native_commit_is_applied_as_put_commit_would_be():
    m, clock = make(n_nodes=1, cap=256 * K, put_slab_bytes=16 * K)
    ix = with_index(m, clock)
    sid, nid, off, length, _inc, _ttl = m.slab_grant("c1")
    section(m, ix)
    gens = native(ix, rpc.PUT_COMMIT, [["a", sid, off, 100, False], ["b", sid, off + K, 5000, True]], "c1", [])
    assert gens and gens[0] < gens[1]
    assert native(ix, rpc.GET, ["a"])[0][1] == gens[0]  # visible before Python applied it
    # A cold record in the table already; the state machine has not counted it yet.
    assert "a" in m._objects and m._objects.hot("a") is None and m.counters["puts"] == 0
    # not clean: a key stored already, a carved extent, another owner, too many slabs given back
    assert native(ix, rpc.PUT_COMMIT, [["a", sid, off + 3 * K, 1, True]], "c1") is None
    assert native(ix, rpc.PUT_COMMIT, [["c", sid, off, 1]], "c1") is None
    assert native(ix, rpc.PUT_COMMIT, [["c", sid, off + 3 * K, 1]], "c2") is None
    assert native(ix, rpc.PUT_COMMIT, [["c", sid, off + 3 * K, 1]], "c1", list(range(100, 165))) is None
    assert native(ix, rpc.PUT_COMMIT, [["c", sid, off + 3 * K, 1]], "c1", ["x"]) is None
    section(m, ix)
    assert m.get("a")[1] == gens[0] and m.get("b")[3][0][2:4] == (off + K, 2 * K)
    # "a" (100 bytes) is packed into 128; "b" takes two pages
    assert sorted(m._slab_table.slabs[sid].free.items()) == [(off + 128, K - 128), (off + 3 * K, length - 3 * K)]
    assert m.counters["puts"] == 2 and m.counters["hits"] == 3
    delta = m.drain_effects()[nid]
    assert [(e.key, e.gen, e.offset) for e in delta.adds if e.tier == "dram"] == [("a", gens[0], off),
                                                                                   ("b", gens[1], off + K)]
    assert [(e.key, e.offset, e.length) for e in delta.adds if e.tier == "reserved"] == [(f"slab/{sid}", off, length)]
    assert m.put_commit("c", sid, off + 3 * K, 10, False, "c1") > gens[1]  # the counter went on
    m.check_invariants()


def test_a_slab_given_back_with_a_native_commit_is_freed_after_its_commits():
    """A client's used-up slabs ride on its next commit: the index answers that commit too,
    drops the slabs from its mirror at once (a later commit into one is Python's, and
    fails), and Python frees what is left of them, after the commits, when it applies the
    log. Its node is told the slab's range is no longer reserved."""
    m, clock = make(n_nodes=1, cap=256 * K, put_slab_bytes=16 * K)
    ix = with_index(m, clock)
    sid, nid, off, length, _inc, _ttl = m.slab_grant("c1")
    sid2, _nid, off2, _len2, _inc2, _ttl2 = m.slab_grant("c1")
    section(m, ix)
    m.drain_effects()
    used = m._alloc[nid].used
    gens = native(ix, rpc.PUT_COMMIT, [["a", sid, off, 100], ["b", sid2, off2, 5000]], "c1", [sid])
    assert gens and len(gens) == 2
    assert ix._slabs.get(sid) is None and ix._slabs.get(sid2) is not None
    assert native(ix, rpc.PUT_COMMIT, [["c", sid, off + K, 1]], "c1") is None  # gone from the mirror
    assert sid in m._slab_table.slabs  # Python has not applied the log yet
    section(m, ix)
    assert sid not in m._slab_table.slabs and sid2 in m._slab_table.slabs
    assert m.get("a")[1] == gens[0] and m.get("b")[1] == gens[1]
    # what "a" did not use of the slab is free again; "a" keeps its 128 bytes
    assert m._alloc[nid].used == used - (length - 128)
    delta = m.drain_effects()[nid]
    assert (f"slab/{sid}", "reserved") in [(k, t) for k, _g, t in delta.drops]
    assert [(e.key, e.gen) for e in delta.adds if e.tier == "dram"] == [("a", gens[0]), ("b", gens[1])]
    res = rpc.per_key(lambda k, s, o, n: m.put_commit(k, s, o, n, False, "c1"), [["c", sid, off + K, 1]])
    assert rpc.is_err(res[0])  # the returned slab takes no more commits
    m.check_invariants()


def test_a_lease_granted_natively_is_applied_before_a_commit_evicts():
    """Log order: a native commit, then a native GET that leases X. Python applies both
    later; the commit's watermark must see X's lease (the GET came before Python evicted
    anything): evicting X would free extents its reader is copying."""
    m, clock = make(n_nodes=1, cap=64 * K, put_slab_bytes=4 * K, high_watermark=0.5)
    ix = with_index(m, clock)
    sid, _nid, off, _len, _inc, _ttl = m.slab_grant("c1")
    put(m, "x", 20 * K)
    _size, gen, _ttl, _reps, lease = m.get("x")  # held while z's put crosses the watermark
    put(m, "z", 10 * K)
    assert "x" in m._objects and m._alloc["n0"].used > 0.5 * 64 * K
    m.release("x", gen, lease)
    clock.t += 1
    section(m, ix)
    assert native(ix, rpc.PUT_COMMIT, [["y", sid, off, 100]], "c1") is not None
    assert native(ix, rpc.GET, ["x"])[0][1] == gen
    section(m, ix)  # applies the lease, then the commit's watermark: it must pass x over
    assert "x" in m._objects and m._objects["x"].leased(clock.t)
    assert "y" in m._objects
    m.check_invariants()


def test_an_add_and_a_drop_in_one_delta_leave_the_node_without_the_value():
    """A value published and evicted before its delta is delivered: the node applies
    drops before adds, so the add must not survive in the delta."""
    m, clock = make(n_nodes=1, cap=64 * K, high_watermark=0.5)
    put(m, "old", 20 * K)
    m.drain_effects()
    put(m, "new", 4 * K)
    m.remove("new")
    delta = m.drain_effects()["n0"]
    assert all(e.key != "new" for e in delta.adds) and ("new", m._next_gen, "dram") in delta.drops


def test_a_batch_of_chained_commits_is_applied_as_one_run_as_put_commit_would_apply_it():
    """A batch's native commits into one slab are applied as one run, parents and all: the
    chain links (a child committed before its parent in the same batch, a key naming no
    parent whose child was stored earlier), the objects and the node's inventory delta
    come out as ``put_commit`` key by key makes them."""
    items = [("p2", "p1"), ("p1", ""), ("q1", ""), ("q2", "q1"), ("q3", "q2"), ("r", "gone")]
    states = []
    for native_path in (True, False):
        m, clock = make(n_nodes=1, cap=256 * K, put_slab_bytes=16 * K)
        ix = with_index(m, clock)
        sid, nid, off, _length, _inc, _ttl = m.slab_grant("c1")
        m.put_commit("early", sid, off, 100, False, "c1", "q1")  # stored before its parent
        section(m, ix)
        m.drain_effects()
        batch = [[key, sid, off + (i + 1) * K, 100, False, parent] for i, (key, parent) in enumerate(items)]
        if native_path:
            assert native(ix, rpc.PUT_COMMIT, batch, "c1", [])
            assert m._objects.chains.parent.get("q2") is None  # not applied yet
            section(m, ix)
        else:
            for key, s, o, n, upsert, parent in batch:
                m.put_commit(key, s, o, n, upsert, "c1", parent)
        ch = m._objects.chains
        delta = m.drain_effects()[nid]
        states.append((dict(ch.parent), {k: set(v) for k, v in ch.kids.items()}, set(ch.orphans),
                       m.counters["puts"], sorted(m._slab_table.slabs[sid].free.items()),
                       [(e.key, e.parent, e.offset) for e in delta.adds if e.tier == "dram"]))
        m.check_invariants()
    assert states[0] == states[1]
    parents, kids, orphans = states[0][:3]
    assert parents["q2"] == "q1" and kids["q1"] == {"early", "q2"} and orphans == {"r"}
