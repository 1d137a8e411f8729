"""The store node's native table (``_native.NodeTable``) against a dict that does what it
should: seeded random adds, replacements, drops and checksums, past its growth and its log
compactions; order, contents and checksums compared after every step batch."""

import random
import struct

import pytest

from mooncake_ray._private.native import _native

DRAM, RES = "dram", "reserved"
GEN0 = 1_764_000_000_000_000_000  # generations are wall-clock nanoseconds


class Model:
    """What the table should hold: entries by (key, tier) in first-added order (a dict's),
    checksums by key where the entry's gen and offset match."""

    def __init__(self):
        self.entries, self.crc, self.kept = {}, {}, {}

    def set(self, e):
        k = (e[0], e[3])
        old = self.entries.get(k)
        self.entries[k] = e
        if e[3] == DRAM and not (old is not None and (old[1], old[4]) == (e[1], e[4])):
            self.crc.pop(e[0], None)
            c = self.kept.get((e[0], e[1], e[4]))
            if c is not None:
                self.crc[e[0]] = c

    def erase(self, key, tier, max_gen):
        e = self.entries.get((key, tier))
        if e is None or e[1] > max_gen:
            return False
        del self.entries[(key, tier)]
        if tier == DRAM and key in self.crc:
            self.kept[(key, e[1], e[4])] = self.crc.pop(key)
        return True

    def crc_of(self, key, gen, off):
        e = self.entries.get((key, DRAM))
        if e is not None and (e[1], e[4]) == (gen, off) and key in self.crc:
            return self.crc[key]
        return self.kept.get((key, gen, off))


def entry(rng, key, tier):
    size = rng.choice([0, 1, 256, 4096, (1 << 40) + 3])
    parent = rng.choice(["", "", "", "p/" + "x" * rng.randrange(40)])
    # an extent a few granules longer than the value (most), far longer or shorter (the
    # side table holds its length)
    length = rng.choice([size + rng.randrange(64)] * 6 + [size + 65534, size + 65535, size + (1 << 30), max(0, size - 1)])
    return (key, GEN0 + rng.randrange(1, 50), size, tier, rng.randrange(1 << 47), length,
            rng.choice([0, 0, 1, 2, 300]), parent, rng.choice([1, 1, 2, 255, 256, 1000]))


@pytest.mark.parametrize("seed", range(2))
def test_the_table_matches_a_dict_through_growth_drops_and_log_compaction(seed):
    rng = random.Random(seed)
    t, m = _native.NodeTable(), Model()
    # keys of 254 bytes and up take the long form of the record
    keys = [f"k/{i}" + "z" * (rng.randrange(0, 70) if i % 50 else rng.randrange(245, 300)) for i in range(30000)]
    for step in range(6):
        for _ in range(15000):
            op = rng.random()
            key = rng.choice(keys[: 5000 * (step + 1)])
            tier = DRAM if rng.random() < 0.9 else RES
            if op < 0.55:
                e = entry(rng, key, tier)
                t.set(e)
                m.set(e)
            elif op < 0.85:
                g = GEN0 + rng.randrange(60)
                assert t.erase(key, tier, g) == m.erase(key, tier, g)
            else:
                e = m.entries.get((key, DRAM))
                if e is not None:
                    c = rng.randrange(1 << 32)
                    assert t.set_crc(key, e[1], e[4], c)
                    m.crc[key] = c
                else:
                    assert not t.set_crc(key, 1, 0, 5)
        if step == 2:  # most entries go at once: the log compacts, the order must hold
            for key, tier in [k for i, k in enumerate(list(m.entries)) if i % 10]:
                assert t.erase(key, tier, 1 << 62) == m.erase(key, tier, 1 << 62)
        if step % 2:
            t.forget_sums()
            m.kept.clear()
        assert len(t) == len(m.entries)
        assert t.keys() == list(m.entries)
        assert t.entries() == list(m.entries.values())
        for (key, tier), e in rng.sample(sorted(m.entries.items()), 500):
            assert t.get(key, tier) == e
            if tier == DRAM:
                assert t.crc_of(key, e[1], e[4]) == m.crc_of(key, e[1], e[4])
        for key in rng.sample(keys, 200):
            if (key, DRAM) not in m.entries:
                assert t.get(key, DRAM) is None
    assert t.log_compactions() > 0
    used = sum(e[5] for e in m.entries.values() if e[3] == DRAM)
    n_dram = sum(e[3] == DRAM for e in m.entries.values())
    assert t.counts() == (used, n_dram, len(m.entries) - n_dram)


def test_apply_takes_a_message_whole_and_hands_back_the_disk_records():
    t = _native.NodeTable()
    t.set(("a", 1, 10, DRAM, 0, 16, 0, "", 1))
    t.set_crc("a", 1, 0, 77)
    disk_drops, disk_adds = t.apply([("a", 1, 10, DRAM, 0, 16, 1, "", 1), ("d", 3, 5, "disk", 0, 4096)],
                                    [("a", 1, DRAM), ("d", 2, "disk")])
    assert disk_drops == [("d", 2)] and [tuple(x) for x in disk_adds] == [("d", 3, 5, "disk", 0, 4096)]
    # dropped and added back in one message at the same gen and place: the checksum stays
    assert t.get("a", DRAM) == ("a", 1, 10, DRAM, 0, 16, 1, "", 1) and t.crc_of("a", 1, 0) == 77
    assert t.kept_sums() == 0
    # a malformed record anywhere: nothing of the message applied
    with pytest.raises(ValueError, match="'c', -1"):
        t.apply([("b", 1, 10, DRAM, 0, 16), ("c", -1, 10, DRAM, 0, 16)], [("a", 1, DRAM)])
    assert t.keys() == [("a", DRAM)]
    with pytest.raises(ValueError, match="48 bits"):
        t.set(("e", 1, 1 << 48, DRAM, 0, 1 << 48))


def test_pack_and_rows_round_trip():
    t = _native.NodeTable()
    t.set(("plain", 2, 10, DRAM, 64, 16, 0, "", 1))
    t.set(("child", 3, 10, DRAM, 128, 16, 0, "plain", 1))
    t.set(("slab/1", 1, 4096, RES, 4096, 4096, 0, "", 1))
    t.set_crc("plain", 2, 64, 9)
    keys, cols, rest = t.pack()
    assert keys == ["plain"] and struct.unpack("<4q", cols) == (2, 10, 64, 16)
    assert rest == [["child", 3, 10, DRAM, 128, 16, 0, "plain", 1], ["slab/1", 1, 4096, RES, 4096, 4096, 0, "", 1]]
    keys, parents, rows = t.dram_rows()
    assert keys == ["plain", "child"] and parents == ["", "plain"]
    assert struct.unpack("<14q", rows) == (2, 10, 64, 16, 0, 9, 1, 3, 10, 128, 16, 0, -1, 1)
    u = _native.NodeTable()
    u.load_rows(keys, parents, rows)
    assert u.entries() == [e for e in t.entries() if e[3] == DRAM] and u.crc_of("plain", 2, 64) == 9
    with pytest.raises(ValueError, match="key bad"):
        u.load_rows(["bad"], [""], struct.pack("<7q", 1, 1, -5, 1, 0, -1, 1))
    assert len(u) == 2


def test_a_million_plain_values_cost_under_56_bytes_each():
    t = _native.NodeTable()
    keys = [f"scale/{i:012d}" for i in range(1_000_000)]
    rows = struct.pack("<7q", 1, 256, 0, 256, 0, 1, 1) * len(keys)
    t.load_rows(keys, [""] * len(keys), rows)
    assert len(t) == len(keys)
    # a 48-byte record (30-byte header, the 18-byte key) and 5 bytes of slot at 85% full
    assert t.memory_bytes() / len(keys) <= 56
