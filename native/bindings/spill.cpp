// Binding of the io_uring spill engine (filled in by the spill tier).
#include <nanobind/nanobind.h>
namespace nb = nanobind;
void bind_spill(nb::module_& m) {}
