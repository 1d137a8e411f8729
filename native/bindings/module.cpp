// The _native module: error translation plus one bind_* call per subsystem.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "mcr/status.h"

namespace nb = nanobind;
using namespace nb::literals;

void bind_transport(nb::module_& m);
void bind_spill(nb::module_& m);
void bind_master(nb::module_& m);
void bind_device(nb::module_& m);
void bind_store(nb::module_& m);

namespace {

// ``put_sources(values, sized_type, ndarray_type)``: ``(address, nbytes, keep)`` of each
// value to put, for the plain cases only: ``bytes`` and C-contiguous numpy arrays (read
// through the buffer protocol; read-only ones too: a put only reads), bare or wrapped in
// ``sized_type`` (``.buf``, ``.size``: None or an int within the buffer). Anything else
// is None, for the Python checks (``args.source``) to take or reject with their errors.
// One call for a batch: the Python path costs about a microsecond a value.
nb::list put_sources(nb::list values, nb::handle sized_type, nb::handle ndarray_type) {
  nb::list out;
  const Py_ssize_t n = PyList_GET_SIZE(values.ptr());
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* v = PyList_GET_ITEM(values.ptr(), i);
    PyObject* buf = v;
    nb::object buf_obj, size_obj;
    if (Py_TYPE(v) == reinterpret_cast<PyTypeObject*>(sized_type.ptr())) {
      nb::handle h(v);
      buf_obj = h.attr("buf");
      size_obj = h.attr("size");
      buf = buf_obj.ptr();
    }
    uint64_t addr = 0, nbytes = 0;
    if (PyBytes_CheckExact(buf)) {
      addr = reinterpret_cast<uint64_t>(PyBytes_AS_STRING(buf));
      nbytes = uint64_t(PyBytes_GET_SIZE(buf));
    } else if (PyObject_TypeCheck(buf, reinterpret_cast<PyTypeObject*>(ndarray_type.ptr()))) {
      Py_buffer view;
      if (PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE) != 0) {  // not C-contiguous, or no export
        PyErr_Clear();
        out.append(nb::none());
        continue;
      }
      addr = reinterpret_cast<uint64_t>(view.buf);
      nbytes = uint64_t(view.len);
      PyBuffer_Release(&view);  // the array itself keeps its memory
    } else {
      out.append(nb::none());
      continue;
    }
    if (size_obj.is_valid() && !size_obj.is_none()) {
      if (!PyLong_CheckExact(size_obj.ptr())) {
        out.append(nb::none());
        continue;
      }
      int overflow = 0;
      long long sz = PyLong_AsLongLongAndOverflow(size_obj.ptr(), &overflow);
      if (overflow || sz < 0 || uint64_t(sz) > nbytes) {
        out.append(nb::none());
        continue;
      }
      nbytes = uint64_t(sz);
    }
    out.append(nb::make_tuple(addr, nbytes, nb::handle(buf)));
  }
  return out;
}

using Spans = nb::ndarray<const uint64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// One raw range: an exact tuple of two exact ints, both positive, not wrapping around.
bool raw_range(PyObject* b, uint64_t* a, uint64_t* len) {
  if (!PyTuple_CheckExact(b) || PyTuple_GET_SIZE(b) != 2) return false;
  PyObject* pa = PyTuple_GET_ITEM(b, 0);
  PyObject* pn = PyTuple_GET_ITEM(b, 1);
  if (!PyLong_CheckExact(pa) || !PyLong_CheckExact(pn)) return false;
  *a = PyLong_AsUnsignedLongLong(pa);
  *len = PyLong_AsUnsignedLongLong(pn);
  if (PyErr_Occurred()) {  // negative, or past 64 bits
    PyErr_Clear();
    return false;
  }
  return *a != 0 && *len != 0 && *a + *len >= *a;
}

// The span holding [a, a + len) as RangeSet.find picks it: the one with the greatest start
// <= a, else the first earlier one long enough; -1 if none.
long span_of(const uint64_t* st, const uint64_t* en, size_t spans, uint64_t a, uint64_t len) {
  const size_t k = size_t(std::upper_bound(st, st + spans, a) - st);
  if (k == 0) return -1;
  if (a + len <= en[k - 1]) return long(k - 1);
  for (size_t j = 0; j + 1 < k; ++j)
    if (a + len <= en[j]) return long(j);
  return -1;
}

// ``raw_ranges(bufs, starts, ends)``: a multi-range buffer made only of raw
// ``(address, length)`` tuples of positive ints, each inside one of the registered spans
// ``[starts[k], ends[k])`` (uint64 arrays sorted by start): ``(tuple of the same tuples,
// total length)``. Anything else is None, for the Python path (``buffers.gathered``) to
// take or reject with its errors. A KV block's dozens of ranges cost about 0.5 us each
// there, a few nanoseconds here.
nb::object raw_ranges(nb::list bufs, Spans starts, Spans ends) {
  const size_t spans = starts.shape(0);
  const Py_ssize_t n = PyList_GET_SIZE(bufs.ptr());
  if (ends.shape(0) != spans || n == 0) return nb::none();
  uint64_t total = 0, a, len;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!raw_range(PyList_GET_ITEM(bufs.ptr(), i), &a, &len) ||
        span_of(starts.data(), ends.data(), spans, a, len) < 0)
      return nb::none();
    total += len;
  }
  nb::tuple ranges = nb::steal<nb::tuple>(PyList_AsTuple(bufs.ptr()));
  return nb::make_tuple(ranges, total);
}

// ``span_set(bufs, starts, ends)``: for a list of nothing but raw ranges each inside a span
// (as raw_ranges), the sorted indices of the spans they lie in, each once; else None. The
// device path routes a KV block's ranges by the registrations they fall in.
nb::object span_set(nb::list bufs, Spans starts, Spans ends) {
  const size_t spans = starts.shape(0);
  const Py_ssize_t n = PyList_GET_SIZE(bufs.ptr());
  if (ends.shape(0) != spans || n == 0) return nb::none();
  std::vector<long> seen;
  uint64_t a, len;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!raw_range(PyList_GET_ITEM(bufs.ptr(), i), &a, &len)) return nb::none();
    const long k = span_of(starts.data(), ends.data(), spans, a, len);
    if (k < 0) return nb::none();
    if (std::find(seen.begin(), seen.end(), k) == seen.end()) seen.push_back(k);
  }
  std::sort(seen.begin(), seen.end());
  nb::list out;
  for (long k : seen) out.append(k);
  return nb::tuple(out);
}

}  // namespace

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
  m.def("put_sources", &put_sources, "values"_a, "sized_type"_a, "ndarray_type"_a);
  m.def("raw_ranges", &raw_ranges, "bufs"_a, "starts"_a, "ends"_a);
  m.def("span_set", &span_set, "bufs"_a, "starts"_a, "ends"_a);
  bind_transport(m);
  bind_spill(m);
  bind_master(m);
  bind_device(m);
  bind_store(m);
}
