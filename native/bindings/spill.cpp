// Binding of the io_uring spill tier (mcr::spill::Tier). Thin: the Python face with
// docstrings and error objects is mooncake_ray/_private/store/spill.py.
#include <cstring>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "mcr/spill.h"
#include "mcr/spill_format.h"
#include "mcr/spill_crc32c.h"

namespace nb = nanobind;
using namespace nb::literals;
using mcr::spill::Tier;

namespace {
using Released = nb::call_guard<nb::gil_scoped_release>;
using WriteItem = std::tuple<std::string, uint64_t, uintptr_t, uint64_t>;
using ReadItem = std::tuple<std::string, uintptr_t, uint64_t>;
using Outcome = std::tuple<int, std::string, uint64_t>;  // (code, message, gen)

std::vector<Outcome> outcomes(std::vector<mcr::spill::Result>&& rs) {
  std::vector<Outcome> out;
  out.reserve(rs.size());
  for (auto& r : rs) out.emplace_back(static_cast<int>(r.code), std::move(r.message), r.gen);
  return out;
}

std::tuple<std::string, uint64_t, uint64_t> as_tuple(const mcr::spill::ObjectInfo& o) {
  return {o.key, o.gen, o.length};
}
}  // namespace

void bind_spill(nb::module_& m) {
  nb::class_<Tier>(m, "SpillTier")
      .def(
          "__init__",
          [](Tier* t, const std::string& dir, uint64_t cap, unsigned qd, bool uring,
             uint64_t chunk, uint64_t compact_min, bool pack) {
            new (t) Tier(mcr::spill::Options{dir, cap, qd, uring, chunk, compact_min, pack});
          },
          "directory"_a, "capacity_bytes"_a, "queue_depth"_a = 32, "use_uring"_a = true,
          "chunk_bytes"_a = 256 << 10, "tombstone_compact_min"_a = 1 << 16, "pack_small"_a = true, Released())
      .def(
          "write",
          [](Tier& t, const std::string& key, uint64_t gen, uintptr_t src, uint64_t len) {
            t.write({key, gen, reinterpret_cast<const void*>(src), len});
          },
          "key"_a, "gen"_a, "src_addr"_a, "length"_a, Released())
      .def(
          "write_many",
          [](Tier& t, const std::vector<WriteItem>& items) {
            std::vector<mcr::spill::WriteRequest> reqs;
            reqs.reserve(items.size());
            for (auto& [k, g, a, n] : items)
              reqs.push_back({k, g, reinterpret_cast<const void*>(a), n});
            return outcomes(t.write_many(reqs));
          },
          "items"_a, Released())
      .def(
          "read",
          [](Tier& t, const std::string& key, uintptr_t dst, uint64_t len) {
            return t.read({key, reinterpret_cast<void*>(dst), len});
          },
          "key"_a, "dst_addr"_a, "length"_a, Released())
      .def(
          "read_many",
          [](Tier& t, const std::vector<ReadItem>& items) {
            std::vector<mcr::spill::ReadRequest> reqs;
            reqs.reserve(items.size());
            for (auto& [k, a, n] : items) reqs.push_back({k, reinterpret_cast<void*>(a), n});
            return outcomes(t.read_many(reqs));
          },
          "items"_a, Released())
      .def("remove", &Tier::remove, "key"_a, Released())
      .def("contains", &Tier::contains, "key"_a)
      .def(
          "info",
          [](const Tier& t, const std::string& key)
              -> std::optional<std::tuple<std::string, uint64_t, uint64_t>> {
            auto o = t.info(key);
            if (!o) return std::nullopt;
            return as_tuple(*o);
          },
          "key"_a)
      .def(
          "scan",
          [](Tier& t, bool verify) {
            std::vector<std::tuple<std::string, uint64_t, uint64_t>> out;
            for (auto& o : t.scan(verify)) out.push_back(as_tuple(o));
            return out;
          },
          "verify_data"_a = false, Released())
      .def("list", [](const Tier& t) {
        std::vector<std::tuple<std::string, uint64_t, uint64_t>> out;
        for (auto& o : t.list()) out.push_back(as_tuple(o));
        return out;
      })
      .def("recover", &Tier::recover, Released())
      .def("close", &Tier::close, Released())
      .def_prop_ro("capacity_bytes", &Tier::capacity_bytes)
      .def_prop_ro("used_bytes", &Tier::used_bytes)
      .def_prop_ro("num_keys", &Tier::num_keys)
      .def_prop_ro("degraded", &Tier::degraded)
      .def_prop_ro("uses_uring", &Tier::uses_uring)
      .def("_inject_io_error", &Tier::inject_io_error, "write"_a, "err"_a, "count"_a = 1)
      .def("stats", [](const Tier& t) {
        mcr::spill::Stats s = t.stats();
        nb::dict d;
        d["writes"] = s.writes;
        d["write_bytes"] = s.write_bytes;
        d["write_errors"] = s.write_errors;
        d["write_latency_ns_sum"] = s.write_latency_ns;
        d["reads"] = s.reads;
        d["read_bytes"] = s.read_bytes;
        d["read_errors"] = s.read_errors;
        d["read_latency_ns_sum"] = s.read_latency_ns;
        d["not_found"] = s.not_found;
        d["checksum_failures"] = s.checksum_failures;
        d["removes"] = s.removes;
        d["capacity_rejections"] = s.capacity_rejections;
        d["files_deleted_invalid"] = s.files_deleted_invalid;
        d["recycled_writes"] = s.recycled_writes;
        d["created_writes"] = s.created_writes;
        d["free_pool_files"] = s.pool_files;
        d["free_pool_bytes"] = s.pool_bytes;
        d["tombstones"] = s.tombstones;
        d["packs"] = s.packs;
        d["packed_objects"] = s.packed_objects;
        return d;
      });

  m.def(
      "spill_crc32c",
      [](uintptr_t addr, size_t n, uint32_t crc) {
        return mcr::spill::crc32c(reinterpret_cast<const void*>(addr), n, crc);
      },
      "addr"_a, "length"_a, "crc"_a = 0, Released());
  // CRC-32C of many ranges of one mapping (a re-adopted arena's values): `offsets` and
  // `sizes` little-endian int64s, each range inside [0, length); the CRCs as u32s.
  m.def(
      "spill_crc32c_many",
      [](uintptr_t base, uint64_t length, nb::bytes offsets, nb::bytes sizes) {
        const size_t n = offsets.size() / sizeof(int64_t);
        if (offsets.size() % sizeof(int64_t) || sizes.size() != offsets.size())
          throw nb::value_error("spill_crc32c_many: offsets and sizes must be int64s, as many of each");
        std::vector<int64_t> off(n), len(n);
        if (n) {
          std::memcpy(off.data(), offsets.c_str(), offsets.size());
          std::memcpy(len.data(), sizes.c_str(), sizes.size());
        }
        for (size_t i = 0; i < n; ++i)
          if (off[i] < 0 || len[i] < 0 || uint64_t(off[i]) > length || uint64_t(len[i]) > length - uint64_t(off[i]))
            throw nb::value_error(("spill_crc32c_many: range " + std::to_string(i) + " (" + std::to_string(off[i]) +
                                   ", " + std::to_string(len[i]) + ") is outside the mapping")
                                      .c_str());
        std::string out(n * sizeof(uint32_t), '\0');
        {
          nb::gil_scoped_release nogil;
          for (size_t i = 0; i < n; ++i) {
            const uint32_t c = len[i] ? mcr::spill::crc32c(reinterpret_cast<const void*>(base + off[i]), len[i], 0) : 0;
            std::memcpy(&out[i * sizeof c], &c, sizeof c);
          }
        }
        return nb::bytes(out.data(), out.size());
      },
      "base"_a, "length"_a, "offsets"_a, "sizes"_a);
  m.def("spill_crc32c_hardware", &mcr::spill::crc32c_hardware);
  m.def("spill_crc32c_folded", &mcr::spill::crc32c_folded);
  // Disk bytes an object takes: its record in a pack, or its own slot file.
  m.def("spill_disk_bytes", [](size_t key_len, uint64_t length) {
    return mcr::spill::packable(key_len, length) ? mcr::spill::record_bytes(key_len, length)
                                                 : mcr::spill::file_bytes(key_len, length);
  }, "key_len"_a, "length"_a);
}
