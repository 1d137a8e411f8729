"""KV chains on a real cluster (two store nodes): conversations saved through the KV layer
into arenas far smaller than they are, with and without a spill tier; conversation hints;
the master killed with chains stored."""

import os
import random
import signal
import time

import pytest
import ray

from mooncake_ray.errors import InvalidArgumentError, MasterUnavailableError
from mooncake_ray.kv import ConversationHint, KVGeometry, KVStore, PagePool
from mooncake_ray._private.naming import MASTER_NAME, store_actor_name
from tests.conftest import wait_for

GEOM = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32", page_size=16)  # 32 KiB pages


class Chat:
    """Conversations taking turns through ``KVStore``: each turn looks its prompt up,
    loads the hits, saves the rest (``hint``: a ConversationHint per conversation)."""

    def __init__(self, client, n, seed=0, system=64, question=48, hints=None):
        self.kv = KVStore(client, "test/chains", GEOM)
        self.pool = PagePool(GEOM, 64)
        self.kv.register_pool(self.pool)
        rng = random.Random(seed)
        self.rng, self.question = rng, question
        self.hist = [[rng.randrange(1 << 16) for _ in range(system)] for _ in range(n)]
        self.hints = hints or {}
        self.served = {c: 0 for c in range(n)}

    def turn(self, c):
        tokens = self.hist[c] + [self.rng.randrange(1 << 16) for _ in range(self.question)]
        n_pages = len(tokens) // GEOM.page_size
        hit = self.kv.lookup(tokens) // GEOM.page_size
        loaded = self.kv.load(tokens, self.pool, list(range(hit))) if hit else 0
        self.served[c] += loaded
        self.kv.save(tokens, self.pool, list(range(loaded, n_pages)), start_page=loaded, hint=self.hints.get(c))
        self.hist[c] = tokens + [self.rng.randrange(1 << 16) for _ in range(16)]

    def gaps(self):
        """Pages stored after a missing page of their conversation (unreachable)."""
        out = 0
        for h in self.hist:
            present = self.kv.client.batch_exists(self.kv.keys(h))
            first_gap = next((i for i, p in enumerate(present) if not p), len(present))
            out += sum(present[first_gap:])
        return out


def test_conversations_over_a_small_arena_leave_no_unreachable_page(make_store):
    """12 conversations x 8 turns (420 pages) into 2 x 4 MiB (256): eviction all along, and no stored page
    is ever cut off from its conversation's start (the same workload on plain LRU
    strands some)."""
    s = make_store(segment_size_bytes="4mb", master={"chain_eviction": True})
    chat = Chat(s, 12)
    for _ in range(8):
        for c in random.Random(1).sample(range(12), 12):
            chat.turn(c)
    st = s.stats()
    assert st["evictions"] > 100 and st["chained"] > 50, (st["evictions"], st["chained"])
    # A parent whose children all live on the other node is taken when its node's eviction
    # finds no leaf there (a forced eviction, chains.py); its tail is dropped as orphans at
    # the next eviction or master tick, so pages may be cut off until then.
    wait_for(lambda: s.stats()["orphaned_pages"] == 0, timeout_s=10, what="orphans to be dropped")
    assert chat.gaps() == 0
    assert sum(chat.served.values()) > 0


def test_a_conversation_with_priority_stays_whole(make_store):
    """A flood of other conversations evicts everything but the hinted one, which keeps
    every page it saved (its newest page is soft-pinned and holds the rest)."""
    s = make_store(segment_size_bytes="4mb")
    keep = ConversationHint("vip", priority=1, keep_s=60)
    chat = Chat(s, 10, system=256, hints={0: keep})
    for _ in range(2):
        chat.turn(0)
    vip_keys = chat.kv.keys(chat.hist[0][:-16])
    assert all(s.batch_exists(vip_keys))
    for _ in range(6):
        for c in range(1, 10):
            chat.turn(c)
    assert s.stats()["evictions"] > 100, s.stats()["evictions"]
    print("DBG", [(n[-4:], v["dram"]["used"], v["dram"]["keys"]) for n, v in s.stats()["nodes"].items()], s.stats()["evictions"], list(s.batch_exists(vip_keys)), s.stats().get("chain_tail_evictions"))
    assert all(s.batch_exists(vip_keys)), "the hinted conversation lost pages"
    assert s.stats()["soft_pinned"] == 1  # one pin per conversation, moved forward each turn
    with pytest.raises(Exception, match="priority must be an int"):
        ConversationHint("c", priority="high")


def test_chains_in_a_full_arena_with_a_spill_tier_and_the_master_killed(make_store, ray_cluster, tmp_path):
    """2 x 4 MiB of DRAM over 2 x 4 MiB of disk: chains go to disk and are evicted from
    there too, leaves first; the master is killed; it rebuilds the chains from the
    nodes' inventories and goes on with none cut. Then a store node stops (SIGSTOP) for
    longer than ``node_ttl_s``, so the master unmounts it, and is killed: its restarted
    process finds its spilled values with their parents (spill_parents.py) and its DRAM
    values in its kept arena, so no link is lost either; meanwhile the pages on the other
    node whose parents went with it are held, not dropped as orphans."""
    s = make_store(segment_size_bytes="4mb",
                   spill={"enabled": True, "directory": str(tmp_path / "spill"), "capacity_bytes": "4mb"})
    chat = Chat(s, 10, seed=2, system=512)
    for _ in range(5):
        for c in range(10):
            chat.turn(c)
    st = s.stats()
    assert st["disk_evictions"] > 0 and st["offloads"] > 0
    wait_for(lambda: s.stats()["orphaned_pages"] == 0, timeout_s=10, what="orphans to be dropped")
    assert chat.gaps() == 0
    chained = s.stats()["chained"]
    master = ray.get_actor(MASTER_NAME, namespace=s.config.namespace)
    inc = ray.get(master.ping.remote())
    ray.kill(master, no_restart=False)
    wait_for(lambda: ray.get(master.ping.remote()) != inc, timeout_s=60, what="the master to restart")
    wait_for(lambda: not s.stats()["recovering"], timeout_s=30, what="recovery")
    assert s.stats()["chained"] >= chained - 1  # the DRAM and disk inventories name the parents
    for _ in range(3):
        for c in range(10):
            chat.turn(c)
    wait_for(lambda: s.stats()["orphaned_pages"] == 0, timeout_s=10, what="orphans to be dropped")
    assert chat.gaps() == 0

    victim = ray_cluster.store_node_ids[0]
    on_disk = [e for e in ray.get(master.node_entries.remote(victim)) if e[3] == "disk" and e[7]]
    assert len(on_disk) > 10, "the victim holds too few chained values on disk to tell"
    keys, chained = s.stats()["keys"], s.stats()["chained"]
    old_inc = {n["node_id"]: n["incarnation"] for n in ray.get(master.nodes.remote())}[victim]
    pid = ray.get(ray.get_actor(store_actor_name(victim), namespace=s.config.namespace).pid.remote())
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: victim not in {n["node_id"] for n in ray.get(master.nodes.remote())}, timeout_s=30,
                 what="the master to unmount the stopped node")
        time.sleep(1.0)  # ticks pass: orphans of the values that went with it would be dropped now
        st = s.stats()
        assert st["keys"] < keys and st["orphaned_pages"] > 0, st  # cut off, held
    finally:
        os.kill(pid, signal.SIGKILL)

    def back():
        inc = {n["node_id"]: n["incarnation"] for n in ray.get(master.nodes.remote())}.get(victim)
        return inc not in (None, old_inc) and s.stats()["keys"] >= keys
    wait_for(back, timeout_s=60, what="the store node to come back with its values")
    assert s.stats()["chained"] >= chained, f"{chained - s.stats()['chained']} links lost with the node's restart"
    assert chat.gaps() == 0


def test_the_default_insertion_learns_a_round_over_more_conversations_than_fit(make_store):
    """16 conversations take turns in rounds over 2 x 4 MiB (under half of what they save):
    LRU evicts each just before its next turn. The default (``chain_insert`` adaptive)
    sees it in its miniature caches, fed by the native calls' samples, and keeps new pages
    on probation; no page is cut off from its conversation's start meanwhile. (What it
    serves is measured by benchmarks/bench_chains.py: at this size the store's own order
    decides too little to compare.)"""
    s = make_store(segment_size_bytes="4mb")
    chat = Chat(s, 16, system=64, question=48)
    order = random.Random(2)
    for _ in range(8):
        for c in order.sample(range(16), 16):
            chat.turn(c)
    policy = s.stats()["eviction_policy"]
    assert policy["mode"] == "adaptive" and policy["insert"] == "old" and policy["pressed"], policy
    assert policy["hit_ratio_old"] > policy["hit_ratio_recent"] + 0.1, policy
    assert policy["sampled_refs"] > 1000 and policy["score"] > 0.05, policy
    wait_for(lambda: s.stats()["orphaned_pages"] == 0, timeout_s=10, what="orphans to be dropped")
    assert chat.gaps() == 0


@pytest.mark.parametrize("chain_eviction", [True, False])
def test_a_conversations_pages_go_beside_the_page_before_them(make_store, chain_eviction):
    """Two store nodes of 64 MiB, the client on neither, put slabs of two pages (a turn
    takes one slab after another, or the two-call path): conversations taking turns, each
    turn's pages named after the page it loaded last. With chain-aware eviction a page goes
    to the node of its parent (the client's slab is asked for there, the master places a
    two-call put there) while that node is no fuller than the other by more than 5% of an
    arena (3.2 MiB here: more than these conversations put), so no link crosses nodes and
    each node can evict its chains from their leaves. Under plain LRU (no chains to keep)
    each slab and put goes to the emptier node, and conversations cross nodes all along."""
    s = make_store(master={"chain_eviction": chain_eviction, "put_slab_bytes": "64kb"})
    chat = Chat(s, 4, seed=1)
    for _ in range(4):
        for c in random.Random(1).sample(range(4), 4):
            chat.turn(c)
    links = cross = 0
    for h in chat.hist:
        nodes = [loc.node_id for loc in (s._locs.get(k) for k in chat.kv.keys(h)) if loc is not None]
        assert len(nodes) >= 16, len(nodes)  # (the last answer is not saved yet)
        links += len(nodes) - 1
        cross += sum(a != b for a, b in zip(nodes, nodes[1:]))
    assert links > 60
    if chain_eviction:
        assert cross == 0, f"{cross} of {links} links cross nodes"
    else:
        assert cross > links // 4, f"only {cross} of {links} links cross nodes without chains"


def test_chains_keep_their_links_across_four_master_shards(make_store):
    """master.shards: 4, so three of every four pages name a parent another shard owns:
    the links are kept all the same (the shards tell each other, chainlinks.py), eviction
    still leaves no stored page cut off from its conversation's start, and each
    conversation's pages read back."""
    s = make_store(segment_size_bytes="4mb", master={"shards": 4, "chain_eviction": True})
    chat = Chat(s, 12)
    for _ in range(8):
        for c in random.Random(1).sample(range(12), 12):
            chat.turn(c)
    st = s.stats()
    assert st["evictions"] > 100 and st["master_shards"] == 4, (st["evictions"], st["master_shards"])

    def named_a_parent():  # stored pages after a conversation's first
        return sum(sum(s.batch_exists(chat.kv.keys(h))[1:]) for h in chat.hist)

    stored, linked = named_a_parent(), s.stats()["chained"]
    assert stored > 50 and linked >= 0.95 * stored, f"{linked} links kept of {stored} pages that named a parent"
    assert s.stats()["chain_remote_children"] > stored / 2  # most parents live on another shard
    wait_for(lambda: chat.gaps() == 0, timeout_s=15, what="pages cut off by a parent on another shard to go")
    assert sum(chat.served.values()) > 0


@pytest.mark.parametrize("insert", ["recent", "old"])
def test_pages_saved_for_a_handoff_stay_until_their_read(make_store, insert):
    """A prefill saves a turn for a decode (``save(..., handoff_s=...)``), then other
    conversations put more than the arena holds before the decode reads it: the turn is
    read back whole whatever the insertion policy, while the same turn saved without the
    hold is evicted under LRU (under ``old`` the newest unread pages go first, the flood's
    own, and the turn saved before it stays); the read releases the hold, and (under LRU,
    where an unread turn is the first to go) a hold whose time passed holds nothing."""
    s = make_store(segment_size_bytes="4mb", master={"chain_insert": insert})
    chat = Chat(s, 24, seed=3, system=256)
    kv, rng = chat.kv, random.Random(4)
    decode = PagePool(GEOM, 64)
    kv.register_pool(decode)

    def prompt():  # 32 pages (1 MiB) of a new conversation, saved from the prefill's pool
        return [rng.randrange(1 << 16) for _ in range(32 * GEOM.page_size)]

    def flood():  # 24 conversations' turns: 24 x 19 pages over an arena of 256, read back at once
        for c in range(24):
            chat.turn(c)

    with pytest.raises(InvalidArgumentError, match="handoff_s"):
        kv.save(prompt(), chat.pool, list(range(32)), handoff_s=0)
    assert s.stats()["keys"] == 0, "a refused save stored pages"
    held, plain = prompt(), prompt()
    assert kv.save(plain, chat.pool, list(range(32))) == 32
    assert kv.save(held, chat.pool, list(range(32)), handoff_s=60) == 32
    assert s.stats()["soft_pinned"] == 32  # each page held by the call that stored it
    flood()
    st = s.stats()
    assert st["evictions"] > 256 and st["eviction_policy"]["insert"] == insert, st
    if insert == "recent":
        assert kv.load(plain, decode, list(range(32))) < 32, "the turn saved without a hold survived: nothing pressed"
    else:  # on probation last in, first out: evicting for the flood took none of the turn saved before it
        assert kv.load(plain, decode, list(range(32))) == 32, "an older unread turn went before newer ones"
    assert kv.load(held, decode, list(range(32)), handoff=True) == 32, "a handoff's pages went before its read"
    assert s.stats()["soft_pinned"] == 0  # the read released the hold

    # a release no master answers: the read stands, the failure is counted, the holds stay
    again = prompt()
    kv.save(again, chat.pool, list(range(32)), handoff_s=60)
    s.batch_unpin = lambda keys: (_ for _ in ()).throw(MasterUnavailableError("no master shard answered"))
    try:
        assert kv.load(again, decode, list(range(32)), handoff=True) == 32
    finally:
        del s.batch_unpin
    assert kv.failures.get("unpin:MasterUnavailableError") == 1 and s.stats()["soft_pinned"] == 32
    kv.load(again, decode, list(range(32)), handoff=True)
    assert s.stats()["soft_pinned"] == 0

    if insert == "old":  # (which unread turn goes first is the policy's; under LRU the oldest)
        return
    lapsed = prompt()
    kv.save(lapsed, chat.pool, list(range(32)), handoff_s=0.2)
    time.sleep(0.5)
    flood()
    assert kv.load(lapsed, decode, list(range(32)), handoff=True) < 32, "a hold outlived its handoff_s"
