// nanobind layer over mcr::MasterIndex (the master's object table and native fast path).
// The Python side (mooncake_ray/_private/master/table.py, fastpath.py) keeps it in step
// with the state machine.
#include <cstring>

#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "mcr/master_index.h"
#include "mcr/policy_sim.h"

namespace nb = nanobind;
using namespace nb::literals;

static nb::object cold_tuple(const mcr::ColdRecord& c) {
  nb::list leases;
  for (uint64_t id : c.leases) leases.append(id);
  return nb::make_tuple(c.size, c.gen, c.rep.node->node_id, c.disk, c.rep.offset, c.rep.length, c.rep.placed,
                        c.lease_until, leases);
}

static nb::list windows_list(const std::vector<mcr::PolicyWindow>& ws) {
  nb::list out;
  for (const auto& w : ws) out.append(nb::make_tuple(w.n, w.hits[0], w.hits[1], w.hits[2], w.hits[3], w.pressed));
  return out;
}

static void bind_policy_sim(nb::module_& m) {
  nb::class_<mcr::PolicySim>(m, "PolicySim")
      .def(nb::init<>())
      // samples: [(hash, kind, size, chained), ...] as MasterIndex.take_samples gives them
      .def("feed", [](mcr::PolicySim& sim, nb::handle samples, int shift, uint64_t capacity) {
        std::vector<mcr::RefSample> v;
        for (nb::handle h : samples) {
          nb::tuple t = nb::cast<nb::tuple>(h);
          if (t.size() != 4) throw nb::type_error("a sample is (hash, kind, size, chained)");
          v.push_back(mcr::RefSample{nb::cast<uint64_t>(t[0]), nb::cast<uint64_t>(t[2]), nb::cast<int>(t[1]),
                                     nb::cast<bool>(t[3])});
        }
        return windows_list(sim.feed(v, shift, capacity));
      }, "samples"_a, "shift"_a, "capacity"_a)
      .def_prop_ro("pressed", &mcr::PolicySim::pressed)
      .def("tracked", &mcr::PolicySim::tracked)
      .def("cache_keys", &mcr::PolicySim::cache_keys)
      .def("halve", &mcr::PolicySim::halve, "bound"_a, "shift"_a)
      .def_prop_ro("window", [](const mcr::PolicySim& sim) {
        const uint32_t* w = sim.window();
        return std::vector<uint32_t>(w, w + 5);
      })
      // cache i (0 "recent", 1 "old", 2 and 3 the same at half size): (bytes, grace bytes,
      // evictions, main order, grace window, stack), as adaptive.MiniCache.state() gives them
      .def("cache_state", [](const mcr::PolicySim& sim, int i) {
        if (i < 0 || i > 3) throw nb::index_error("a cache is 0-3");
        const mcr::MiniCache& c = sim.cache(i);
        return nb::make_tuple(c.bytes, c.grace_bytes, c.evictions, c.order(mcr::MiniCache::kMain),
                              c.order(mcr::MiniCache::kGraceList), c.order(mcr::MiniCache::kStack));
      });
}

void bind_master(nb::module_& m) {
  bind_policy_sim(m);
  nb::class_<mcr::MasterIndex>(m, "MasterIndex")
      .def(nb::init<>())
      // reps: [(node_id, ray_node_id, offset, length, incarnation, placed), ...]
      .def("set", [](mcr::MasterIndex& ix, const std::string& key, uint64_t size, uint64_t gen,
                     nb::handle reps) {
        std::vector<mcr::IndexReplica> v;
        for (nb::handle r : reps) {
          nb::tuple t = nb::cast<nb::tuple>(r);
          if (t.size() != 6)
            throw nb::type_error("a replica is (node_id, ray_node_id, offset, length, incarnation, placed)");
          v.push_back(mcr::IndexReplica{
              ix.node(nb::cast<std::string>(t[0]), nb::cast<std::string>(t[1]), nb::cast<std::string>(t[4])),
              nb::cast<uint64_t>(t[2]), nb::cast<uint64_t>(t[3]), nb::cast<uint64_t>(t[5])});
        }
        ix.set(key, size, gen, std::move(v));
      }, "key"_a, "size"_a, "gen"_a, "reps"_a)
      // A cold record: (key, size, gen, node_id, ray_node_id, incarnation, disk, offset,
      // length, placed, lease_until, [lease ids, at most two])
      .def("set_cold", [](mcr::MasterIndex& ix, const std::string& key, uint64_t size, uint64_t gen,
                          const std::string& node_id, const std::string& ray_node_id, const std::string& incarnation,
                          bool disk, uint64_t offset, uint64_t length, uint64_t placed, double lease_until,
                          const std::vector<uint64_t>& leases) {
        if (leases.size() > 2) throw nb::value_error("a cold record holds at most two leases");
        mcr::ColdRecord c;
        c.size = size;
        c.gen = gen;
        c.rep = mcr::IndexReplica{ix.node(node_id, ray_node_id, incarnation), offset, length, placed};
        c.disk = disk;
        c.lease_until = lease_until;
        c.leases = leases;
        ix.set_cold(key, c);
      }, "key"_a, "size"_a, "gen"_a, "node_id"_a, "ray_node_id"_a, "incarnation"_a, "disk"_a, "offset"_a,
         "length"_a, "placed"_a, "lease_until"_a, "leases"_a)
      // Many new cold records on one node, each with one DRAM replica and no lease held
      // (a mounting node's plain values): keys, and ``cols`` the bytes of n x 4 native
      // int64s (gen, size, offset, length per key); placed ids ``placed``, ``placed`` + 1,
      // ... in that order. Added at the recent end in the order given.
      .def("set_cold_many", [](mcr::MasterIndex& ix, const std::vector<std::string>& keys, nb::bytes cols,
                               const std::string& node_id, const std::string& ray_node_id,
                               const std::string& incarnation, uint64_t placed, double lease_until) {
        if (cols.size() != keys.size() * 4 * sizeof(int64_t))
          throw nb::value_error("set_cold_many: cols must hold 4 int64s per key");
        const char* c = cols.c_str();
        mcr::ColdRecord rec;
        rec.rep.node = ix.node(node_id, ray_node_id, incarnation);
        rec.disk = false;
        rec.lease_until = lease_until;
        for (size_t i = 0; i < keys.size(); ++i, c += sizeof(int64_t[4])) {
          int64_t v[4];
          std::memcpy(v, c, sizeof v);  // bytes' data need not be 8-aligned
          if (v[0] < 0 || v[1] < 0 || v[2] < 0 || v[3] < 0)
            throw nb::value_error("set_cold_many: a negative generation, size, offset or length");
          rec.gen = static_cast<uint64_t>(v[0]);
          rec.size = static_cast<uint64_t>(v[1]);
          rec.rep.offset = static_cast<uint64_t>(v[2]);
          rec.rep.length = static_cast<uint64_t>(v[3]);
          rec.rep.placed = placed + i;
          ix.set_cold(keys[i], rec);
        }
      }, "keys"_a, "cols"_a, "node_id"_a, "ray_node_id"_a, "incarnation"_a, "placed"_a, "lease_until"_a)
      // -> (size, gen, node_id, disk, offset, length, placed, lease_until, [leases]) or None;
      // hydrate makes the record hot, peek_cold leaves it cold.
      .def("hydrate", [](mcr::MasterIndex& ix, const std::string& key) -> nb::object {
        mcr::ColdRecord c;
        if (!ix.hydrate(key, &c)) return nb::none();
        return cold_tuple(c);
      }, "key"_a)
      .def("peek_cold", [](mcr::MasterIndex& ix, const std::string& key) -> nb::object {
        mcr::ColdRecord c;
        if (!ix.peek_cold(key, &c)) return nb::none();
        return cold_tuple(c);
      }, "key"_a)
      .def("contains", &mcr::MasterIndex::contains, "key"_a)
      .def("is_hot", &mcr::MasterIndex::is_hot, "key"_a)
      .def("touch", &mcr::MasterIndex::touch, "key"_a, "unread"_a = false)
      .def("probation", &mcr::MasterIndex::probation, "key"_a)
      .def("set_insert_old", &mcr::MasterIndex::set_insert_old, "on"_a)
      .def("set_grace_bytes", &mcr::MasterIndex::set_grace_bytes, "n"_a)
      .def("set_sample_shift", &mcr::MasterIndex::set_sample_shift, "shift"_a)
      .def("sample", &mcr::MasterIndex::sample, "kind"_a, "key"_a, "size"_a, "chained"_a)
      // -> (dropped, [(hash, kind, size, chained), ...])
      .def("take_samples", [](mcr::MasterIndex& ix) {
        uint64_t dropped = 0;
        auto got = ix.take_samples(&dropped);
        nb::list out;
        for (auto& s : got) out.append(nb::make_tuple(s.hash, s.kind, s.size, s.chained));
        return nb::make_tuple(dropped, out);
      })
      // The samples since the last call, run through ``sim`` -> (dropped, [window, ...]),
      // each window (n, hits recent, old, half-size recent, half-size old, pressed)
      .def("feed_policy", [](mcr::MasterIndex& ix, mcr::PolicySim& sim, int shift, uint64_t capacity) {
        uint64_t dropped = 0;
        auto got = ix.take_samples(&dropped);
        return nb::make_tuple(dropped, windows_list(sim.feed(got, shift, capacity)));
      })
      // -> ([(key, None | (gen, size, offset, length)), ...], next key or None)
      .def("scan", [](mcr::MasterIndex& ix, const std::string& after, const std::string& node_id, bool disk,
                      double now, size_t limit) {
        std::string next;
        auto items = ix.scan(after, node_id, disk, now, limit, &next);
        nb::list out;
        for (auto& it : items) {
          if (it.hot)
            out.append(nb::make_tuple(it.key, nb::none()));
          else
            out.append(nb::make_tuple(it.key, nb::make_tuple(it.gen, it.size, it.offset, it.length)));
        }
        return nb::make_tuple(out, next.empty() ? nb::object(nb::none()) : nb::object(nb::str(next.c_str(), next.size())));
      }, "after"_a, "node_id"_a, "disk"_a, "now"_a, "limit"_a)
      // -> (keys, gens, [(offset, length) merged runs], freed bytes, hot key met or None,
      // held): ``held``, with ``chains`` and the list ended short of ``need``:
      // [(key, (gen, size, offset, length)), ...]
      .def("evict_cold", [](mcr::MasterIndex& ix, const std::string& after, const std::string& node_id, double now,
                            uint64_t need, bool chains) {
        auto e = ix.evict_cold(after, node_id, now, need, chains);
        nb::list runs;
        for (auto& [off, len] : e.runs) runs.append(nb::make_tuple(off, len));
        nb::list held;
        for (auto& it : e.held)
          held.append(nb::make_tuple(it.key, nb::make_tuple(it.gen, it.size, it.offset, it.length)));
        return nb::make_tuple(e.keys, e.gens, runs, e.freed,
                              e.stop.empty() ? nb::object(nb::none()) : nb::object(nb::str(e.stop.c_str(), e.stop.size())),
                              held);
      }, "after"_a, "node_id"_a, "now"_a, "need"_a, "chains"_a = false)
      .def("set_chain_links", &mcr::MasterIndex::set_chain_links, "on"_a)
      .def("link", &mcr::MasterIndex::link, "key"_a, "parent"_a)
      .def("set_holds", &mcr::MasterIndex::set_holds, "key"_a, "holds"_a)
      .def("set_remote_holds", &mcr::MasterIndex::set_remote_holds, "on"_a)
      .def("chain_of", &mcr::MasterIndex::chain_of, "key"_a)
      .def("link_count", &mcr::MasterIndex::link_count)
      .def("cold_on_node", &mcr::MasterIndex::cold_on_node, "node_id"_a, "except_incarnation"_a = "")
      .def("cold_gens_on_node", &mcr::MasterIndex::cold_gens_on_node, "node_id"_a, "except_incarnation"_a = "")
      .def("retarget_cold", [](mcr::MasterIndex& ix, nb::list key_list, nb::bytes cols,
                               const std::string& node_id, const std::string& ray_node_id,
                               const std::string& incarnation) {
        // the keys' UTF-8 as views into the str objects (kept alive by the list): no string
        // made per key, which for a million keys was half the call
        std::vector<std::string_view> keys;
        keys.reserve(nb::len(key_list));
        for (nb::handle k : key_list) {
          Py_ssize_t n = 0;
          const char* p = PyUnicode_AsUTF8AndSize(k.ptr(), &n);
          if (p == nullptr) throw nb::python_error();
          keys.emplace_back(p, static_cast<size_t>(n));
        }
        if (cols.size() != keys.size() * 4 * sizeof(int64_t))
          throw nb::value_error("retarget_cold: cols must hold 4 int64s per key");
        std::vector<int64_t> v(keys.size() * 4);  // bytes' data need not be 8-aligned
        if (!v.empty()) std::memcpy(v.data(), cols.c_str(), cols.size());
        auto to = ix.node(node_id, ray_node_id, incarnation);
        std::vector<uint8_t> moved = ix.retarget_cold(keys, v.data(), to);
        return nb::bytes(reinterpret_cast<const char*>(moved.data()), moved.size());
      }, "keys"_a, "cols"_a, "node_id"_a, "ray_node_id"_a, "incarnation"_a)
      .def("keys", &mcr::MasterIndex::keys, "prefix"_a)
      .def("hot_keys_recent_first", &mcr::MasterIndex::hot_keys_recent_first)
      .def("cold_count", &mcr::MasterIndex::cold_count)
      .def("drop", &mcr::MasterIndex::drop, "key"_a)
      .def("drop_many", &mcr::MasterIndex::drop_many, "keys"_a)
      .def("clear", &mcr::MasterIndex::clear)
      // Blocks only while a native GET holds the mutex (microseconds): the GIL stays held.
      .def("lock", &mcr::MasterIndex::lock)
      .def("unlock", &mcr::MasterIndex::unlock)
      .def("set_enabled", &mcr::MasterIndex::set_enabled, "on"_a)
      .def("set_lease_ttl", &mcr::MasterIndex::set_lease_ttl, "ttl_s"_a)
      .def("set_max_log", &mcr::MasterIndex::set_max_log, "n"_a)
      // -> (misses, hits on cold records, [(kind, key, gen, lease_or_slab, now, offset, size), ...]);
      // a kHeld entry: (kind, reply bytes, call id, peer uid, now, lane, 0)
      .def("drain", [](mcr::MasterIndex& ix) {
        uint64_t misses = 0, hits = 0;
        auto log = ix.drain(&misses, &hits);
        nb::list out;
        for (auto& e : log) {
          if (e.kind == mcr::MasterIndex::kHeld)  // the reply: bytes, not a key
            out.append(nb::make_tuple(e.kind, nb::bytes(e.key.data(), e.key.size()), e.gen, e.lease, e.now,
                                      e.offset, e.size, e.parent));
          else
            out.append(nb::make_tuple(e.kind, e.key, e.gen, e.lease, e.now, e.offset, e.size, e.parent));
        }
        return nb::make_tuple(misses, hits, out);
      })
      .def("set_commits", &mcr::MasterIndex::set_commits, "on"_a)
      .def("set_max_key_bytes", &mcr::MasterIndex::set_max_key_bytes, "n"_a)
      .def("set_slab", [](mcr::MasterIndex& ix, uint64_t id, const std::string& owner,
                          const std::string& node_id, const std::string& ray_node_id,
                          const std::string& incarnation,
                          const std::vector<std::pair<uint64_t, uint64_t>>& free) {
        mcr::IndexSlab s;
        s.owner = owner;
        s.node = mcr::IndexReplica{ix.node(node_id, ray_node_id, incarnation), 0, 0, 0};
        for (auto& p : free) s.free[p.first] = p.second;
        ix.set_slab(id, std::move(s));
      }, "slab_id"_a, "owner"_a, "node_id"_a, "ray_node_id"_a, "incarnation"_a, "free"_a)
      .def("drop_slab", &mcr::MasterIndex::drop_slab, "slab_id"_a)
      // A store node's commit ring mapped at ``addr`` (``nbytes``, the whole file) in this
      // process; ``fd``: an open descriptor of the file, kept open by the caller until
      // drop_ring, as ``proc_fd`` (the node process's /proc/<pid>/task/<pid>/stat, or -1); ``epoch``:
      // the number the node drew for this mount, which the ring must show.
      .def("set_ring", [](mcr::MasterIndex& ix, const std::string& node_id, const std::string& incarnation,
                          uintptr_t addr, uint64_t nbytes, int fd, uint64_t epoch, int proc_fd) {
        if (addr == 0 || addr % 8 != 0 || nbytes < mcr::MasterIndex::kRingHeader + 4096 || nbytes % 8 != 0 || fd < 0)
          throw nb::value_error("a commit ring needs an 8-aligned mapping of at least 64 + 4096 bytes and an fd");
        mcr::CommitRing r;
        r.base = reinterpret_cast<uint8_t*>(addr);
        r.bytes = nbytes;
        r.fd = fd;
        r.proc_fd = proc_fd;
        r.epoch = epoch;
        r.incarnation = incarnation;
        ix.set_ring(node_id, std::move(r));
      }, "node_id"_a, "incarnation"_a, "addr"_a, "nbytes"_a, "fd"_a, "epoch"_a, "proc_fd"_a = -1)
      .def("drop_ring", &mcr::MasterIndex::drop_ring, "node_id"_a)
      // [(node_id, incarnation, reserved?, key, gen, size, offset, length, parent[, want[, crc]]), ...]:
      // see MasterIndex::ring_publish. ``want`` (the copies the put asked for, 1-255) goes in
      // the record kind's high bits (store/ring.py reads it back).
      .def("ring_publish", [](mcr::MasterIndex& ix, nb::list items) {
        std::vector<mcr::MasterIndex::RingRecord> recs;
        recs.reserve(items.size());
        for (nb::handle h : items) {
          nb::tuple t = nb::cast<nb::tuple>(h);
          mcr::MasterIndex::RingRecord r;
          r.node_id = nb::cast<std::string>(t[0]);
          r.incarnation = nb::cast<std::string>(t[1]);
          r.kind = nb::cast<bool>(t[2]) ? mcr::MasterIndex::kRingReserved : mcr::MasterIndex::kRingCommit;
          r.key = nb::cast<std::string>(t[3]);
          r.gen = nb::cast<uint64_t>(t[4]);
          r.size = nb::cast<uint64_t>(t[5]);
          r.offset = nb::cast<uint64_t>(t[6]);
          r.length = nb::cast<uint64_t>(t[7]);
          r.parent = nb::cast<std::string>(t[8]);
          if (t.size() > 9) {
            const uint64_t want = nb::cast<uint64_t>(t[9]);
            if (want < 1 || want > 255) throw nb::value_error("ring_publish: want is not in 1..255");
            if (want > 1) r.kind |= uint32_t(want) << 8;
          }
          if (t.size() > 10 && !t[10].is_none()) {  // the value's CRC-32C, taken by its writer
            const uint64_t crc = nb::cast<uint64_t>(t[10]);
            if (crc > 0xffffffffull) throw nb::value_error("ring_publish: crc is not a u32");
            r.crc = uint32_t(crc);
            r.has_crc = true;
          }
          recs.push_back(std::move(r));
        }
        return ix.ring_publish(recs);
      }, "records"_a)
      .def("ring_acks", &mcr::MasterIndex::ring_acks)
      // -> (owner, node_id, ray_node_id, incarnation, [(offset, length), ...] sorted) or None
      .def("lookup_slab", [](mcr::MasterIndex& ix, uint64_t id) -> nb::object {
        mcr::IndexSlab s;
        if (!ix.lookup_slab(id, &s)) return nb::none();
        nb::list free;
        for (auto& p : s.free) free.append(nb::make_tuple(p.first, p.second));
        const mcr::IndexNode& n = *s.node.node;
        return nb::make_tuple(s.owner, n.node_id, n.ray_node_id, n.incarnation, free);
      }, "slab_id"_a)
      .def("slab_count", &mcr::MasterIndex::slab_count)
      .def("add_pending", &mcr::MasterIndex::add_pending, "key"_a)
      .def("drop_pending", &mcr::MasterIndex::drop_pending, "key"_a)
      .def("pending_count", &mcr::MasterIndex::pending_count)
      .def("is_pending", &mcr::MasterIndex::is_pending, "key"_a)
      .def("set_next_gen", &mcr::MasterIndex::set_next_gen, "gen"_a)
      .def("wait_commits", &mcr::MasterIndex::wait_commits, "timeout_s"_a,
           nb::call_guard<nb::gil_scoped_release>())
      .def("wait_held", &mcr::MasterIndex::wait_held, "timeout_s"_a,
           nb::call_guard<nb::gil_scoped_release>())
      .def("__len__", &mcr::MasterIndex::size)
      .def("served", &mcr::MasterIndex::served)
      .def("lookups", &mcr::MasterIndex::lookups)
      // -> (size, gen, [(node_id, ray_node_id, offset, length, incarnation, placed), ...]) or None
      .def("lookup", [](mcr::MasterIndex& ix, const std::string& key) -> nb::object {
        mcr::IndexEntry e;
        if (!ix.lookup(key, &e)) return nb::none();
        nb::list reps;
        for (auto& r : e.reps)
          reps.append(nb::make_tuple(r.node->node_id, r.node->ray_node_id, r.offset, r.length, r.node->incarnation,
                                     r.placed));
        return nb::make_tuple(e.size, e.gen, reps);
      }, "key"_a)
      // What the RPC handler would answer natively: the reply bytes, or None (Python's turn).
      // ``hold``: as the master's handler with durable acknowledgements serves it; a commit
      // whose reply is logged (kHeld) instead of given back answers b"".
      .def("serve", [](mcr::MasterIndex& ix, nb::bytes req, bool hold) -> nb::object {
        std::string out;
        bool ok, held = false;
        mcr::HeldReply to{0, 0, 0};
        {
          nb::gil_scoped_release nogil;  // may wait for a thread holding lock()
          ok = ix.serve(req.c_str(), req.size(), &out, hold ? &to : nullptr, &held);
        }
        if (!ok) return nb::none();
        if (held) return nb::bytes("", 0);
        return nb::bytes(out.data(), out.size());
      }, "request"_a, "hold"_a = false);
}
