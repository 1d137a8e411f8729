"""Disk tier in the master state machine: offload on evict, disk LRU, promote on get."""

import pytest

from mooncake_ray.errors import NoCapacityError, OffloadPendingError
from mooncake_ray._private.master.allocator import ALIGN
from mooncake_ray._private.master.state import MasterState, Policy
from mooncake_ray._private.master.types import NodeInfo

K = ALIGN


class Clock:
    t = 100.0

    def __call__(self):
        return self.t


def make(dram=4 * K, disk=4 * K, hw=1.0):
    clock = Clock()
    m = MasterState(Policy(high_watermark=hw, evict_ratio=0.01, lease_ttl_s=5), clock=clock,
                    wall_ns=lambda: 0)
    m.mount(NodeInfo("n", "i", b"", b"", 0, dram, spill_capacity=disk, spill_high_watermark=1.0))
    return m, clock


def put(m, key, size=K):
    gen, _ = m.put_start(key, size)
    m.put_end(key, gen)
    return gen


def offload_all(m, ok=True, error=""):
    effects = m.drain_effects()
    items = [(k, g, ln, ok, error) for k, g, _s, _o, ln in effects["n"].offload] if "n" in effects else []
    m.offload_done("n", items)
    return [i[0] for i in items]


def test_evicted_objects_go_to_disk_not_away():
    m, clock = make()
    for k in "abcd":
        put(m, k)
        clock.t += 1
    # DRAM full: the next put starts offloading the LRU object and must wait for it
    with pytest.raises(NoCapacityError, match="offload"):
        m.put_start("e", K)
    assert offload_all(m) == ["a"]
    assert m.where("a") == [("n", "disk", True)]
    put(m, "e")
    st = m.stats()
    assert st["offloads"] == 1 and st["nodes"]["n"]["disk"]["keys"] == 1 and st["keys"] == 5
    m.check_invariants()


def a_on_disk():
    """DRAM full of a, b, c, d (oldest first); a put makes room by offloading "a"."""
    m, clock = make()
    for k in "abcd":
        put(m, k)
        clock.t += 1
    with pytest.raises(NoCapacityError):
        m.put_start("e", K)
    assert offload_all(m) == ["a"]
    return m, clock


def test_get_of_disk_object_promotes_it():
    m, clock = a_on_disk()
    size, gen, _, reps, _ = m.get("a")
    (node, tier, off, ln, _inc, placed), = reps
    assert tier == "promote" and node == "n"
    # A DRAM copy made anew: never the put's placement id (0), so a client's location
    # cache cannot take it for the bytes the put wrote, even at the same offset.
    assert placed != 0
    assert m.get("a")[3] == reps  # a second reader shares the promotion
    m.promote_done("n", [("a", gen, off, "")])
    assert m.get("a")[3] == [("n", "dram", off, ln, "i", placed)]
    assert sorted(m.where("a")) == [("n", "disk", True), ("n", "dram", True)]
    assert m.stats()["promotions"] == 1
    m.check_invariants()


def test_promotion_into_the_extent_its_put_wrote_is_a_new_placement():
    m, clock = make()
    offsets = {}
    for k in "abcd":
        gen, ext = m.put_start(k, K)
        m.put_end(k, gen)
        offsets[k] = ext[0][1]
        clock.t += 1
    assert m.get("b")[3][0][5] == 0  # the put's own placement
    with pytest.raises(NoCapacityError):
        m.put_start("e", K)
    assert offload_all(m) == ["a"]
    _, gen, _, ((_, tier, off, _, _, placed),), _ = m.get("a")
    # The same value back in the very extent its put wrote, which meanwhile was free for
    # other keys: a location cache holding (gen, offset, placed 0) must not match it.
    assert tier == "promote" and off == offsets["a"]
    assert placed != 0
    m.check_invariants()


def test_corrupt_disk_copy_becomes_a_miss():
    m, clock = a_on_disk()
    _, gen, _, ((_, _, off, _, _, _),), _ = m.get("a")
    m.promote_done("n", [("a", gen, off, "ChecksumError")])
    assert not m.exists("a")
    m.check_invariants()


def test_disk_lru_drops_oldest_when_disk_is_full():
    m, clock = make(dram=2 * K, disk=4 * K)  # a 1-granule object takes 2 on disk (header)
    for i, k in enumerate("abcdef"):
        try:
            put(m, k)
        except NoCapacityError:
            offload_all(m)
            put(m, k)
        clock.t += 10  # leases expire
    offload_all(m)
    # disk holds the 2 most recently offloaded, DRAM the newest; a and b really dropped
    assert [k for k in "abcdef" if m.exists(k)] == ["c", "d", "e", "f"]
    assert m.stats()["disk_evictions"] == 2
    m.check_invariants()


def test_failed_offload_drops_unleased_and_keeps_leased():
    m, clock = make()
    for k in "abcd":
        put(m, k)
    clock.t += 10
    with pytest.raises(NoCapacityError):
        m.put_start("e", K)
    m.get("a")  # a reader arrives while "a" is being offloaded
    offload_all(m, ok=False, error="EIO")
    assert m.exists("a") and m.stats()["nodes"]["n"]["disk"]["degraded"] == "EIO"
    m.heartbeat("n", "i", spill_degraded=None)  # the node reports a healthy disk again
    m.check_invariants()


def test_offload_of_removed_object_deletes_its_file():
    m, clock = make()
    for k in "abcd":
        put(m, k)
    clock.t += 10
    with pytest.raises(NoCapacityError):
        m.put_start("e", K)
    m.remove("a")
    m.drain_effects()
    m.offload_done("n", [("a", 1, K, True, "")])
    assert ("a", 1, "disk") in m.drain_effects()["n"].drops
    assert m.stats()["disk_used"] == 0
    m.check_invariants()


def test_an_unfinished_promotion_expires_and_the_tick_looks_only_at_promotions():
    m, clock = a_on_disk()
    _, gen, _, ((_, tier, off, _, _, _),), _ = m.get("a")
    assert tier == "promote" and len(m._tier._promoting) == 1
    m.tick()
    assert len(m._tier._promoting) == 1  # not due yet
    clock.t += m.policy.put_timeout_s + 1
    assert m._tier.expire_promotions(clock.t) == 1  # the reader never came back: the extent is freed
    assert m.where("a") == [("n", "disk", True)] and not m._tier._promoting
    _, gen, _, ((_, tier, off, _, _, _),), _ = m.get("a")  # a new promotion, done this time
    m.promote_done("n", [("a", gen, off, "")])
    m.tick()
    assert not m._tier._promoting  # a finished one is forgotten at the next tick
    m.check_invariants()


def test_a_get_call_searches_a_full_node_for_room_once():
    """Disk-only keys of one GET call on a node with no room to promote into: the first
    starts offloads and fails (retryable), the others fail at once, with no search each."""
    m, clock = make(dram=4 * K, disk=16 * K)

    def put_waiting(k):
        for _ in range(3):
            try:
                return put(m, k)
            except (NoCapacityError, OffloadPendingError):
                offload_all(m)
        raise AssertionError(f"{k} never fit")

    for k in "abcdwxyz":
        put_waiting(k)
        clock.t += 1
    on_disk = [k for k in "abcd" if m.where(k) == [("n", "disk", True)]]
    assert len(on_disk) == 4
    for k in "wxyz":  # DRAM full of values being read: no room for a promotion now
        m.get(k)
    searched = []
    allocate = m._tier._allocate
    m._tier._allocate = lambda *a: searched.append(a[0]) or allocate(*a)
    with m.one_call():
        for k in on_disk:
            with pytest.raises(OffloadPendingError):
                m.get(k)
    assert searched == ["n"]
    with pytest.raises(OffloadPendingError):  # outside a call: each key searches
        m.get(on_disk[0])
    assert searched == ["n", "n"]
    m.check_invariants()


def test_default_marks_on_a_spilling_node_offload_past_90_percent_and_evict_the_disk():
    """Marks unset: a node with a spill tier offloads once its values pass 90% of DRAM, 5%
    a round, and its full disk evicts (``Policy.marks(True)``: 0.9 / 0.05)."""
    clock = Clock()
    m = MasterState(Policy(lease_ttl_s=5), clock=clock, wall_ns=lambda: 0)
    m.mount(NodeInfo("n", "i", b"", b"", 0, 20 * K, spill_capacity=4 * K, spill_high_watermark=1.0))
    for i in range(18):
        put(m, f"k{i}")
        clock.t += 1
    assert offload_all(m) == []  # 18 of 20: not past 90%
    put(m, "k18")  # 19 of 20 used > 18: one round of 5% (one value)
    assert offload_all(m) == ["k0"]
    for i in range(19, 40):  # the disk fills; its least recent value goes
        try:
            put(m, f"k{i}")
        except NoCapacityError:
            pass
        offload_all(m)
        clock.t += 1
    st = m.stats()["nodes"]["n"]["disk"]
    assert st["keys"] <= 4 and m.stats()["disk_evictions"] > 0
    m.check_invariants()
