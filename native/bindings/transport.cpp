#include <nanobind/nanobind.h>
#include <ucp/api/ucp.h>
namespace nb = nanobind;
void bind_transport(nb::module_& m) {
  m.def("ucx_version", []() {
    unsigned major, minor, release;
    ucp_get_version(&major, &minor, &release);
    return nb::make_tuple(major, minor, release);
  });
}
