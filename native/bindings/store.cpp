// nanobind layer over mcr::NodeTable (a store node's DRAM and reserved entries). The
// Python face is mooncake_ray/_private/store/inventory.py (StoreInventory): entries as
// tuples (key, gen, size, tier, offset, length, pin, parent, want), tier "dram" or
// "reserved"; disk entries stay in Python.
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include <unistd.h>

#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "mcr/node_table.h"
#include "mcr/spill_crc32c.h"

namespace nb = nanobind;
using namespace nb::literals;
using mcr::NodeEntry;
using mcr::NodeTable;

namespace {

const char* tier_name(uint8_t t) { return t == NodeTable::kReserved ? "reserved" : "dram"; }

// "dram" -> kDram, "reserved" -> kReserved, anything else (disk) -> -1.
int tier_of(nb::handle h) {
  Py_ssize_t n = 0;
  const char* s = PyUnicode_AsUTF8AndSize(h.ptr(), &n);
  if (s == nullptr) throw nb::python_error();
  if (n == 4 && std::memcmp(s, "dram", 4) == 0) return NodeTable::kDram;
  if (n == 8 && std::memcmp(s, "reserved", 8) == 0) return NodeTable::kReserved;
  return -1;
}

int tier_arg(const std::string& t) {
  if (t == "dram") return NodeTable::kDram;
  if (t == "reserved") return NodeTable::kReserved;
  throw nb::value_error(("a node table holds tiers 'dram' and 'reserved', not " + t).c_str());
}

// A str's UTF-8 into *out (its capacity kept); std::bad_cast if it is not a str.
void utf8(nb::handle h, std::string* out) {
  if (!PyUnicode_Check(h.ptr())) throw std::bad_cast();
  Py_ssize_t n = 0;
  const char* p = PyUnicode_AsUTF8AndSize(h.ptr(), &n);
  if (p == nullptr) throw nb::python_error();
  out->assign(p, static_cast<size_t>(n));
}

nb::tuple as_tuple(const NodeEntry& e) {
  return nb::make_tuple(e.key, e.gen, e.size, tier_name(e.tier), e.offset, e.length, e.pin, e.parent, e.want);
}

// An entry sequence of 6-9 fields (key, gen, size, tier, offset, length[, pin[, parent[, want]]])
// into *e (its strings keep their capacity).
void fill_entry(nb::handle h, int tier, NodeEntry* e) {
  nb::sequence s = nb::borrow<nb::sequence>(h);
  size_t n = nb::len(s);
  if (n < 6 || n > 9) throw nb::value_error("a node table entry has 6 to 9 fields");
  try {
    utf8(s[0], &e->key);
    e->tier = static_cast<uint8_t>(tier);
    e->gen = nb::cast<uint64_t>(s[1]);
    e->size = nb::cast<uint64_t>(s[2]);
    e->offset = nb::cast<uint64_t>(s[4]);
    e->length = nb::cast<uint64_t>(s[5]);
    e->pin = n > 6 ? nb::cast<uint64_t>(s[6]) : 0;
    if (n > 7)
      utf8(s[7], &e->parent);
    else
      e->parent.clear();
    e->want = n > 8 ? nb::cast<uint64_t>(s[8]) : 1;
    e->has_crc = false;
  } catch (const std::bad_cast&) {
    throw nb::value_error(("a malformed node table entry " + nb::cast<std::string>(nb::repr(h))).c_str());
  }
  if (e->size > NodeTable::kMax48 || e->offset > NodeTable::kMax48 || e->length > NodeTable::kMax48)
    throw nb::value_error("a node table entry's size, offset and length fit in 48 bits");
}

NodeEntry entry_of(nb::handle h, int tier) {
  NodeEntry e;
  fill_entry(h, tier, &e);
  return e;
}

// A journal batch (NodeTable::replay's form) of drops [key, gen] (DRAM entries of gen <= gen)
// then adds [key, gen, size, offset, length, pin, parent, crc or None, want?], as a message
// applies them, into *out (cleared; its capacity kept).
void encode_batch(nb::handle adds, nb::handle drops, std::string* out) {
  static thread_local NodeEntry e;
  static thread_local std::string key;
  out->assign(12, '\0');
  for (nb::handle d : drops) {
    nb::sequence s = nb::borrow<nb::sequence>(d);
    uint64_t gen;
    try {
      if (nb::len(s) != 2) throw std::bad_cast();
      utf8(s[0], &key);
      gen = nb::cast<uint64_t>(s[1]);
    } catch (const std::bad_cast&) {
      throw nb::value_error(("a malformed journal drop " + nb::cast<std::string>(nb::repr(d))).c_str());
    }
    uint32_t klen = static_cast<uint32_t>(key.size());
    *out += '\x02';
    out->append(reinterpret_cast<const char*>(&gen), 8);
    out->append(reinterpret_cast<const char*>(&klen), 4);
    *out += key;
  }
  for (nb::handle a : adds) {
    nb::sequence s = nb::borrow<nb::sequence>(a);
    size_t n = nb::len(s);
    try {
      if (n != 8 && n != 9) throw std::bad_cast();
      utf8(s[0], &e.key);
      e.gen = nb::cast<uint64_t>(s[1]);
      e.size = nb::cast<uint64_t>(s[2]);
      e.offset = nb::cast<uint64_t>(s[3]);
      e.length = nb::cast<uint64_t>(s[4]);
      e.pin = nb::cast<uint64_t>(s[5]);
      utf8(s[6], &e.parent);
      e.has_crc = !s[7].is_none();
      e.crc = e.has_crc ? nb::cast<uint32_t>(s[7]) : 0;
      e.want = n > 8 ? nb::cast<uint64_t>(s[8]) : 1;
    } catch (const std::bad_cast&) {
      throw nb::value_error(("a malformed journal add " + nb::cast<std::string>(nb::repr(a))).c_str());
    }
    *out += '\x01';
    NodeTable::encode(e, out);
  }
  NodeTable::seal_batch(out);
}

// A reused buffer back to a small one once a large use is over: a thread-local buffer keeps
// its largest capacity, and a ring read or a message of 100,000 records once would leave
// megabytes resident in the node for its life.
constexpr size_t kKeepBytes = 256 << 10;
template <typename T>
void trim(T* buf, size_t bytes) {
  if (bytes > kKeepBytes) T().swap(*buf);
}

// All of buf appended to the file open at fd (a journal); OSError on failure.
void write_all(int fd, const std::string& buf) {
  for (size_t at = 0; at < buf.size();) {
    ssize_t w = ::write(fd, buf.data() + at, buf.size() - at);
    if (w < 0) {
      if (errno == EINTR) continue;
      PyErr_SetFromErrno(PyExc_OSError);
      throw nb::python_error();
    }
    at += static_cast<size_t>(w);
  }
}

std::vector<int64_t> int64s(nb::bytes b, size_t per, size_t n, const char* what) {
  if (b.size() != n * per * sizeof(int64_t)) throw nb::value_error(what);
  std::vector<int64_t> v(n * per);
  if (!v.empty()) std::memcpy(v.data(), b.c_str(), b.size());  // bytes' data need not be 8-aligned
  return v;
}

}  // namespace

void bind_store(nb::module_& m) {
  // Several NodeTable.snapshot files (one per master shard link) as one.
  m.def("join_snapshots", [](const std::vector<nb::bytes>& parts) {
    std::string out = "MCRIDX3\n";
    out.append(8, '\0');
    uint64_t n = 0;
    for (const nb::bytes& p : parts) {
      if (p.size() < 20 || std::memcmp(p.c_str(), "MCRIDX3\n", 8) != 0) throw nb::value_error("not an MCRIDX3 snapshot");
      uint64_t k;
      std::memcpy(&k, p.c_str() + 8, 8);
      n += k;
      out.append(p.c_str() + 16, p.size() - 20);
    }
    std::memcpy(out.data() + 8, &n, 8);
    uint32_t crc = mcr::spill::crc32c(out.data() + 8, out.size() - 8);
    out.append(reinterpret_cast<const char*>(&crc), 4);
    return nb::bytes(out.data(), out.size());
  }, "parts"_a);

  // One journal batch (encode_batch) as bytes.
  m.def("journal_batch", [](nb::handle adds, nb::handle drops) {
    std::string out;
    encode_batch(adds, drops, &out);
    return nb::bytes(out.data(), out.size());
  }, "adds"_a, "drops"_a);
  // One journal batch appended to the file open at fd: no buffer made per batch (a batch of
  // a thousand values is 76 KB, which came from the allocator and went back each time).
  m.def("journal_write", [](int fd, nb::handle adds, nb::handle drops) {
    static thread_local std::string out;
    encode_batch(adds, drops, &out);
    write_all(fd, out);
    trim(&out, out.capacity());
  }, "fd"_a, "adds"_a, "drops"_a);

  nb::class_<NodeTable>(m, "NodeTable")
      .def(nb::init<>())
      .def("__len__", &NodeTable::size)
      .def("set", [](NodeTable& t, nb::handle entry) {
        nb::sequence s = nb::borrow<nb::sequence>(entry);
        int tier = nb::len(s) > 3 ? tier_of(s[3]) : -1;
        if (tier < 0) throw nb::value_error("a node table holds tiers 'dram' and 'reserved'");
        t.set(entry_of(entry, tier));
      }, "entry"_a)
      .def("get", [](const NodeTable& t, const std::string& key, const std::string& tier) -> nb::object {
        NodeEntry e;
        if (!t.get(key, static_cast<uint8_t>(tier_arg(tier)), &e)) return nb::none();
        return as_tuple(e);
      }, "key"_a, "tier"_a)
      .def("erase", [](NodeTable& t, const std::string& key, const std::string& tier, uint64_t max_gen) {
        return t.erase(key, static_cast<uint8_t>(tier_arg(tier)), max_gen);
      }, "key"_a, "tier"_a, "max_gen"_a = UINT64_MAX)
      .def("crc_of", [](const NodeTable& t, const std::string& key, uint64_t gen, uint64_t offset) -> nb::object {
        uint32_t c;
        if (!t.crc_of(key, gen, offset, &c)) return nb::none();
        return nb::int_(c);
      }, "key"_a, "gen"_a, "offset"_a)
      .def("set_crc", [](NodeTable& t, const std::string& key, uint64_t gen, uint64_t offset, uint32_t crc) {
        return t.set_crc(key, gen, offset, crc);
      }, "key"_a, "gen"_a, "offset"_a, "crc"_a)
      // A message's records: drops [(key, gen, tier)] (entries of gen <= gen go), then adds
      // (entry sequences). Parsed whole before any is applied. Disk records are not this
      // table's: returned as (disk drops [(key, gen)], disk adds [entry]) for the caller.
      // A checksum kept aside by a drop serves an add of the same (key, gen, offset) in the
      // same call, and is forgotten after it.
      .def("apply", [](NodeTable& t, nb::handle adds, nb::handle drops) {
        std::vector<std::tuple<std::string, uint64_t, int>> ds;
        nb::list disk_drops, disk_adds;
        for (nb::handle d : drops) {
          nb::sequence s = nb::borrow<nb::sequence>(d);
          if (nb::len(s) != 3) throw nb::value_error("a drop is (key, gen, tier)");
          int tier = tier_of(s[2]);
          if (tier < 0)
            disk_drops.append(nb::make_tuple(s[0], s[1]));
          else
            try {
              ds.emplace_back(nb::cast<std::string>(s[0]), nb::cast<uint64_t>(s[1]), tier);
            } catch (const std::bad_cast&) {
              throw nb::value_error(("a malformed drop " + nb::cast<std::string>(nb::repr(d))).c_str());
            }
        }
        static thread_local std::vector<NodeEntry> es;  // reused: no entry allocated per record
        size_t n = 0;
        for (nb::handle a : adds) {
          nb::sequence s = nb::borrow<nb::sequence>(a);
          if (nb::len(s) < 6) throw nb::value_error("an add has 6 to 9 fields");
          int tier = tier_of(s[3]);
          if (tier < 0) {
            disk_adds.append(a);
          } else {
            if (n == es.size()) es.emplace_back();
            fill_entry(a, tier, &es[n++]);
          }
        }
        for (auto& [key, gen, tier] : ds) t.erase(key, static_cast<uint8_t>(tier), gen);
        for (size_t i = 0; i < n; ++i) t.set(es[i]);
        t.forget_sums();
        trim(&es, es.capacity() * sizeof(NodeEntry));
        return nb::make_tuple(disk_drops, disk_adds);
      }, "adds"_a, "drops"_a)
      // The commit ring mapped at ring_addr (ring_bytes long): its records since its tail
      // applied (NodeTable::apply_ring) and their journal batch appended to the file open at
      // fd, no Python object made per record. Returns (records, checksums given, checksums
      // taken here, the ring's new tail for the caller to commit once this returns, the DRAM
      // commits a message will add too as [(key, gen, offset, parent, want)]).
      .def("read_ring", [](NodeTable& t, uintptr_t ring_addr, size_t ring_bytes, uintptr_t arena_addr,
                           size_t arena_len, int fd) {
        static thread_local std::string batch;
        NodeTable::RingRead r = t.apply_ring(reinterpret_cast<const uint8_t*>(ring_addr), ring_bytes,
                                             reinterpret_cast<const uint8_t*>(arena_addr), arena_len, &batch);
        write_all(fd, batch);
        trim(&batch, batch.capacity());
        nb::list told;
        for (const NodeEntry& e : r.told) told.append(nb::make_tuple(e.key, e.gen, e.offset, e.parent, e.want));
        return nb::make_tuple(r.records, r.given, r.summed, r.tail, told);
      }, "ring_addr"_a, "ring_bytes"_a, "arena_addr"_a, "arena_len"_a, "fd"_a)
      .def("entries", [](const NodeTable& t) {
        nb::list out;
        t.for_each([&](const NodeEntry& e) { out.append(as_tuple(e)); });
        return out;
      })
      .def("keys", [](const NodeTable& t) {
        nb::list out;
        t.for_each([&](const NodeEntry& e) { out.append(nb::make_tuple(e.key, tier_name(e.tier))); });
        return out;
      })
      // (keys, cols, rest): the plain DRAM entries (one copy wanted, unpinned, no parent) as
      // their keys and 4 little-endian int64s each (gen, size, offset, length); the others as
      // entry lists (inventory.pack's form).
      .def("pack", [](const NodeTable& t) {
        nb::list keys, rest;
        std::vector<int64_t> cols;
        cols.reserve(t.size() * 4);
        t.for_each([&](const NodeEntry& e) {
          if (e.tier == NodeTable::kDram && e.pin == 0 && e.parent.empty() && e.want <= 1) {
            keys.append(nb::str(e.key.data(), e.key.size()));
            cols.insert(cols.end(), {static_cast<int64_t>(e.gen), static_cast<int64_t>(e.size),
                                     static_cast<int64_t>(e.offset), static_cast<int64_t>(e.length)});
          } else {
            rest.append(nb::list(as_tuple(e)));
          }
        });
        return nb::make_tuple(keys, nb::bytes(reinterpret_cast<const char*>(cols.data()), cols.size() * 8), rest);
      })
      // (keys, parents, rows): the DRAM entries, rows the bytes of n x 7 little-endian int64s
      // (gen, size, offset, length, pin, crc or -1 for none, copies wanted).
      .def("dram_rows", [](const NodeTable& t) {
        nb::list keys, parents;
        std::vector<int64_t> rows;
        t.for_each([&](const NodeEntry& e) {
          if (e.tier != NodeTable::kDram) return;
          keys.append(nb::str(e.key.data(), e.key.size()));
          parents.append(nb::str(e.parent.data(), e.parent.size()));
          rows.insert(rows.end(), {static_cast<int64_t>(e.gen), static_cast<int64_t>(e.size),
                                   static_cast<int64_t>(e.offset), static_cast<int64_t>(e.length),
                                   static_cast<int64_t>(e.pin), e.has_crc ? int64_t{e.crc} : int64_t{-1},
                                   static_cast<int64_t>(e.want)});
        });
        return nb::make_tuple(keys, parents, nb::bytes(reinterpret_cast<const char*>(rows.data()), rows.size() * 8));
      })
      // DRAM entries from dram_rows's form (a crc of -1: none), added in order.
      .def("load_rows", [](NodeTable& t, nb::list keys, nb::list parents, nb::bytes rows) {
        size_t n = nb::len(keys);
        if (nb::len(parents) != n) throw nb::value_error("load_rows: as many parents as keys");
        std::vector<int64_t> v = int64s(rows, 7, n, "load_rows: rows must hold 7 int64s per key");
        auto text = [](nb::handle h, std::string* out) {  // no std::string per key made and freed
          Py_ssize_t len = 0;
          const char* p = PyUnicode_AsUTF8AndSize(h.ptr(), &len);
          if (p == nullptr) throw nb::python_error();
          out->assign(p, static_cast<size_t>(len));
        };
        NodeEntry e;
        e.tier = NodeTable::kDram;
        t.reserve(t.size() + n);
        for (size_t i = 0; i < n; ++i) {
          const int64_t* r = &v[i * 7];
          if (r[0] < 0 || r[1] < 0 || r[2] < 0 || r[3] < 0 || r[4] < 0 || r[6] < 1 || r[5] < -1 || r[5] > 0xFFFFFFFFll) {
            text(keys[i], &e.key);
            throw nb::value_error(("load_rows: a malformed row for key " + e.key).c_str());
          }
        }
        for (size_t i = 0; i < n; ++i) {
          const int64_t* r = &v[i * 7];
          text(keys[i], &e.key);
          text(parents[i], &e.parent);
          e.gen = r[0], e.size = r[1], e.offset = r[2], e.length = r[3], e.pin = r[4], e.want = r[6];
          e.has_crc = r[5] >= 0;
          e.crc = static_cast<uint32_t>(r[5]);
          t.set(e);
        }
      }, "keys"_a, "parents"_a, "rows"_a)
      // (bytes of DRAM values' lengths, DRAM entries, reserved entries)
      .def("counts", [](const NodeTable& t) {
        uint64_t used = 0, dram = 0, reserved = 0;
        t.for_each([&](const NodeEntry& e) {
          if (e.tier == NodeTable::kDram) {
            used += e.length;
            ++dram;
          } else {
            ++reserved;
          }
        });
        return nb::make_tuple(used, dram, reserved);
      })
      // The kept arena's index files (arena.py): a snapshot file's bytes and its count; one
      // loaded (ValueError naming what does not hold, nothing added); a journal file's
      // batches replayed -> (ops applied, batches skipped); the DRAM entries checked against
      // the arena at (addr, length) -> [(key, gen)] of those dropped.
      .def("snapshot", [](const NodeTable& t) {
        size_t n = 0;
        std::string out = t.snapshot(&n);
        return nb::make_tuple(n, nb::bytes(out.data(), out.size()));
      })
      .def("load_snapshot", [](NodeTable& t, nb::bytes data) {
        return t.load_snapshot(reinterpret_cast<const uint8_t*>(data.c_str()), data.size());
      }, "data"_a)
      .def("replay", [](NodeTable& t, nb::bytes data) {
        size_t skipped = 0;
        size_t ops = t.replay(reinterpret_cast<const uint8_t*>(data.c_str()), data.size(), &skipped);
        return nb::make_tuple(ops, skipped);
      }, "data"_a)
      .def("verify", [](NodeTable& t, uintptr_t addr, size_t length) {
        std::vector<std::pair<std::string, uint64_t>> bad;
        {
          nb::gil_scoped_release unlocked;  // the caller owns the table (a restart, before any thread)
          bad = t.verify(reinterpret_cast<const uint8_t*>(addr), length);
        }
        return bad;
      }, "addr"_a, "length"_a)
      .def("memory_bytes", &NodeTable::memory_bytes)
      .def("kept_sums", &NodeTable::kept_sums)
      .def("log_compactions", &NodeTable::log_compactions)
      .def("forget_sums", &NodeTable::forget_sums)
      .def("clear", &NodeTable::clear);
}
