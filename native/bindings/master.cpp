// nanobind layer over mcr::MasterIndex (the master's native read path). The Python side
// (mooncake_ray/_private/master/fastpath.py) keeps it in step with the state machine.
#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "mcr/master_index.h"

namespace nb = nanobind;
using namespace nb::literals;

void bind_master(nb::module_& m) {
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
      .def("drop", &mcr::MasterIndex::drop, "key"_a)
      .def("drop_many", &mcr::MasterIndex::drop_many, "keys"_a)
      .def("clear", &mcr::MasterIndex::clear)
      // Blocks only while a native GET holds the mutex (microseconds): the GIL stays held.
      .def("lock", &mcr::MasterIndex::lock)
      .def("unlock", &mcr::MasterIndex::unlock)
      .def("set_enabled", &mcr::MasterIndex::set_enabled, "on"_a)
      .def("set_lease_ttl", &mcr::MasterIndex::set_lease_ttl, "ttl_s"_a)
      .def("set_max_log", &mcr::MasterIndex::set_max_log, "n"_a)
      // -> (misses, [(kind, key, gen, lease_or_slab, now, offset, size), ...])
      .def("drain", [](mcr::MasterIndex& ix) {
        uint64_t misses = 0;
        auto log = ix.drain(&misses);
        nb::list out;
        for (auto& e : log)
          out.append(nb::make_tuple(e.kind, e.key, e.gen, e.lease, e.now, e.offset, e.size));
        return nb::make_tuple(misses, out);
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
      .def("__len__", &mcr::MasterIndex::size)
      .def("served", &mcr::MasterIndex::served)
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
      .def("serve", [](mcr::MasterIndex& ix, nb::bytes req) -> nb::object {
        std::string out;
        bool ok;
        {
          nb::gil_scoped_release nogil;  // may wait for a thread holding lock()
          ok = ix.serve(req.c_str(), req.size(), &out);
        }
        if (!ok) return nb::none();
        return nb::bytes(out.data(), out.size());
      }, "request"_a);
}
