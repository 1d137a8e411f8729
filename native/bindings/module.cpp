// The _native module: error translation plus one bind_* call per subsystem.
#include <nanobind/nanobind.h>

#include "mcr/status.h"

namespace nb = nanobind;

void bind_transport(nb::module_& m);
void bind_spill(nb::module_& m);
void bind_master(nb::module_& m);
void bind_device(nb::module_& m);
void bind_store(nb::module_& m);

NB_MODULE(_native, m) {
  m.doc() = "mooncake-ray native engine (UCX transport, io_uring spill)";
  // Map every native code to exactly one class of mooncake_ray.errors, once.
  nb::module_ errors = nb::module_::import_("mooncake_ray.errors");
  // Kept alive for the life of the process (the module is never unloaded).
  static nb::handle from_code = nb::object(errors.attr("_from_native_code")).release();
  nb::register_exception_translator(
      [](const std::exception_ptr& p, void* payload) {
        try {
          std::rethrow_exception(p);
        } catch (const mcr::Error& e) {
          auto* fn = static_cast<nb::handle*>(payload);
          nb::object cls = (*fn)(static_cast<int>(e.code()));
          PyErr_SetString(cls.ptr(), e.what());
        }
      },
      &from_code);
  m.def("code_name", [](int c) { return mcr::code_name(static_cast<mcr::Code>(c)); });
  bind_transport(m);
  bind_spill(m);
  bind_master(m);
  bind_device(m);
  bind_store(m);
}
