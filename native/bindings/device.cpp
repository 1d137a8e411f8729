// Device memory: the CUDA driver shim and the copy streams of the staged path (mcr/cuda.h).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "mcr/cuda.h"
#include "mcr/status.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// (dst, src, len) triples from three equal-length sequences of ints.
std::vector<mcr::cuda::Copy> copies_of(const std::vector<uint64_t>& dst, const std::vector<uint64_t>& src,
                                       const std::vector<uint64_t>& len) {
  if (dst.size() != src.size() || dst.size() != len.size())
    throw mcr::Error(mcr::Code::kInvalidArgument,
                     "copy_many: " + std::to_string(dst.size()) + " destinations, " + std::to_string(src.size()) +
                         " sources and " + std::to_string(len.size()) + " lengths");
  std::vector<mcr::cuda::Copy> v(dst.size());
  for (size_t i = 0; i < v.size(); ++i) {
    if ((len[i] && (!dst[i] || !src[i])) || dst[i] + len[i] < dst[i] || src[i] + len[i] < src[i])
      throw mcr::Error(mcr::Code::kInvalidArgument, "copy_many: copy " + std::to_string(i) + " is not a memory range");
    v[i] = mcr::cuda::Copy{dst[i], src[i], len[i]};
  }
  return v;
}

}  // namespace

void bind_device(nb::module_& m) {
  m.def("cuda_available", &mcr::cuda::available);
  m.def("cuda_unavailable_reason", &mcr::cuda::unavailable_reason);
  m.def("cuda_device_count", &mcr::cuda::device_count);
  m.def("cuda_device_of", &mcr::cuda::device_of, "addr"_a);
  m.def("cuda_host_register", [](uintptr_t addr, size_t n) {
    return mcr::cuda::host_register(reinterpret_cast<void*>(addr), n);
  }, "addr"_a, "length"_a, nb::call_guard<nb::gil_scoped_release>());
  m.def("cuda_device_addressable", [](uintptr_t addr) {
    return mcr::cuda::device_addressable(reinterpret_cast<const void*>(addr));
  }, "addr"_a, nb::call_guard<nb::gil_scoped_release>());
  m.def("cuda_copy_kernel_unavailable", &mcr::cuda::copy_kernel_unavailable, "device"_a = 0,
        nb::call_guard<nb::gil_scoped_release>());
  m.def("cuda_copy_kernel_mode", &mcr::cuda::copy_kernel_mode, "mode"_a = -1);
  m.def("cuda_host_unregister", [](uintptr_t addr) { mcr::cuda::host_unregister(reinterpret_cast<void*>(addr)); },
        "addr"_a, nb::call_guard<nb::gil_scoped_release>());

  nb::class_<mcr::cuda::Marker>(m, "CudaMarker")
      .def(nb::init<int, uintptr_t>(), "device"_a, "stream"_a)
      .def_prop_ro("device", &mcr::cuda::Marker::device)
      .def("synchronize", &mcr::cuda::Marker::synchronize, nb::call_guard<nb::gil_scoped_release>());

  nb::class_<mcr::cuda::CopyStream>(m, "CopyStream")
      .def("copy_many", [](mcr::cuda::CopyStream& s, const std::vector<uint64_t>& dst,
                           const std::vector<uint64_t>& src, const std::vector<uint64_t>& len, bool addressable) {
        auto v = copies_of(dst, src, len);
        nb::gil_scoped_release nogil;
        s.copy_many(std::move(v), addressable);
      }, "dst"_a, "src"_a, "length"_a, "addressable"_a = false)
      .def("wait_marker", &mcr::cuda::CopyStream::wait_marker, "marker"_a, nb::call_guard<nb::gil_scoped_release>())
      .def("synchronize", &mcr::cuda::CopyStream::synchronize, nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("kind", &mcr::cuda::CopyStream::kind)
      .def_prop_ro("copies", &mcr::cuda::CopyStream::copies)
      .def_prop_ro("bytes", &mcr::cuda::CopyStream::bytes)
      .def_prop_ro("kernel_launches", &mcr::cuda::CopyStream::kernel_launches);
  nb::class_<mcr::cuda::CudaCopyStream, mcr::cuda::CopyStream>(m, "CudaCopyStream")
      .def(nb::init<int>(), "device"_a, nb::call_guard<nb::gil_scoped_release>());
  nb::class_<mcr::cuda::HostCopyStream, mcr::cuda::CopyStream>(m, "HostCopyStream").def(nb::init<>());
}
