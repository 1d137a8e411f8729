// nanobind layer over mcr::MasterIndex (the master's native read path). The Python side
// (mooncake_ray/_private/master/fastpath.py) keeps it in step with the state machine.
#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>

#include "mcr/master_index.h"

namespace nb = nanobind;
using namespace nb::literals;

void bind_master(nb::module_& m) {
  nb::class_<mcr::MasterIndex>(m, "MasterIndex")
      .def(nb::init<>())
      // reps: [(node_id, ray_node_id, offset, length, incarnation), ...]
      .def("set", [](mcr::MasterIndex& ix, const std::string& key, uint64_t size, uint64_t gen,
                     nb::handle reps) {
        std::vector<mcr::IndexReplica> v;
        for (nb::handle r : reps) {
          nb::tuple t = nb::cast<nb::tuple>(r);
          v.push_back(mcr::IndexReplica{nb::cast<std::string>(t[0]), nb::cast<std::string>(t[1]),
                                        nb::cast<uint64_t>(t[2]), nb::cast<uint64_t>(t[3]),
                                        nb::cast<std::string>(t[4])});
        }
        ix.set(key, size, gen, std::move(v));
      }, "key"_a, "size"_a, "gen"_a, "reps"_a)
      .def("drop", &mcr::MasterIndex::drop, "key"_a)
      .def("clear", &mcr::MasterIndex::clear)
      // Blocks only while a native GET holds the mutex (microseconds): the GIL stays held.
      .def("lock", &mcr::MasterIndex::lock)
      .def("unlock", &mcr::MasterIndex::unlock)
      .def("set_enabled", &mcr::MasterIndex::set_enabled, "on"_a)
      .def("set_lease_ttl", &mcr::MasterIndex::set_lease_ttl, "ttl_s"_a)
      .def("set_max_log", &mcr::MasterIndex::set_max_log, "n"_a)
      // -> (misses, [(kind, key, gen, lease, now), ...])
      .def("drain", [](mcr::MasterIndex& ix) {
        uint64_t misses = 0;
        auto log = ix.drain(&misses);
        nb::list out;
        for (auto& e : log) out.append(nb::make_tuple(e.kind, e.key, e.gen, e.lease, e.now));
        return nb::make_tuple(misses, out);
      })
      .def("__len__", &mcr::MasterIndex::size)
      .def("served", &mcr::MasterIndex::served)
      // -> (size, gen, [(node_id, ray_node_id, offset, length, incarnation), ...]) or None
      .def("lookup", [](mcr::MasterIndex& ix, const std::string& key) -> nb::object {
        mcr::IndexEntry e;
        if (!ix.lookup(key, &e)) return nb::none();
        nb::list reps;
        for (auto& r : e.reps)
          reps.append(nb::make_tuple(r.node_id, r.ray_node_id, r.offset, r.length, r.incarnation));
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
