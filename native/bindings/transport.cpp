// Thin nanobind layer over mcr::Engine. Arguments are converted with the GIL held, then
// every call that waits, copies or touches UCX runs with the GIL released. The Python
// face (mooncake_ray/_private/transport) adds buffer handling, asyncio and handlers.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <optional>

#include "mcr/master_index.h"
#include "mcr/spill_crc32c.h"
#include "mcr/transport.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using mcr::Code;
using mcr::Error;

// A read-only view of a bytes-like argument, held while the GIL is released.
class ByteView {
 public:
  explicit ByteView(nb::handle obj) {
    if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_SIMPLE) != 0) {
      PyErr_Clear();
      throw Error(Code::kInvalidArgument, "payload must be bytes-like");
    }
  }
  ~ByteView() { PyBuffer_Release(&view_); }
  const char* data() const { return static_cast<const char*>(view_.buf); }
  size_t size() const { return size_t(view_.len); }

 private:
  Py_buffer view_;
};

double timeout_or_forever(std::optional<double> t) { return t ? *t : -1.0; }

// Transfer ops: (RemoteRegion, remote_offset, local, length) sequences, where local is an
// address, or the ranges of a multi-range value ((address, length), ...), which become
// one op per range covering the value's first `length` bytes (its remote bytes are
// contiguous). Read without a nanobind cast per op: the region is cast once per run of
// ops naming it; ints of other types (numpy's) go through nanobind's.
class OpParser {
 public:
  // want_crc: every op asks for the checksum of its bytes (IoOp::want_crc); item_of()
  // then says which Python op each IoOp came from (a multi-range value gives several).
  explicit OpParser(bool want_crc = false) : want_crc_(want_crc) {}
  const std::vector<uint32_t>& item_of() const { return item_of_; }

  std::vector<mcr::IoOp> parse(nb::handle ops) {
    nb::object seq = nb::steal(PySequence_Fast(ops.ptr(), "transfer ops must be a sequence of ops"));
    if (!seq.is_valid()) {
      PyErr_Clear();
      throw Error(Code::kInvalidArgument, "transfer ops must be a sequence (list or tuple) of ops, not " +
                                              type_name(ops));
    }
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
    PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
    out_.reserve(size_t(n));
    for (Py_ssize_t i = 0; i < n; ++i) add(items[i], size_t(i));
    return std::move(out_);
  }

 private:
  static std::string type_name(nb::handle h) { return nb::cast<std::string>(nb::str(h.type().attr("__name__"))); }

  [[noreturn]] static void bad(PyObject* item, size_t i, const char* why) {
    std::string r = nb::cast<std::string>(nb::repr(nb::handle(item)));
    if (r.size() > 200) r = r.substr(0, 200) + "...";
    throw Error(Code::kInvalidArgument, "transfer op " + std::to_string(i) + " is " + r + ": " + why);
  }

  // A non-negative int (Python's, or anything nanobind takes as one); false if not.
  static bool u64(PyObject* x, uint64_t* v) {
    if (PyLong_CheckExact(x)) {
      *v = PyLong_AsUnsignedLongLong(x);
      if (*v == uint64_t(-1) && PyErr_Occurred()) {
        PyErr_Clear();
        return false;
      }
      return true;
    }
    return nb::try_cast<uint64_t>(nb::handle(x), *v);
  }

  static bool pair_or_quad(PyObject* x, Py_ssize_t size) {
    return (PyTuple_Check(x) && PyTuple_GET_SIZE(x) == size) || (PyList_Check(x) && PyList_GET_SIZE(x) == size);
  }
  static PyObject* at(PyObject* x, Py_ssize_t k) {
    return PyTuple_Check(x) ? PyTuple_GET_ITEM(x, k) : PyList_GET_ITEM(x, k);
  }

  // A column of an array op: a 1-D C-contiguous buffer of 64-bit ints (numpy uint64 or
  // int64), or one int standing for every row.
  struct Column {
    Py_buffer view{};
    bool held = false;
    uint64_t scalar = 0;
    const uint64_t* data = nullptr;
    bool is_signed = false;
    Py_ssize_t n = -1;  // -1: a scalar
    Column() = default;
    Column(const Column&) = delete;
    Column& operator=(const Column&) = delete;
    ~Column() {
      if (held) PyBuffer_Release(&view);
    }
    uint64_t operator[](Py_ssize_t k) const { return n < 0 ? scalar : data[k]; }
  };

  // A buffer of one or more dimensions (a numpy integer scalar is a buffer of none: an int).
  static bool is_array(PyObject* x) {
    if (PyLong_Check(x) || PyTuple_Check(x) || PyList_Check(x) || !PyObject_CheckBuffer(x)) return false;
    Py_buffer v;
    if (PyObject_GetBuffer(x, &v, PyBUF_ND) != 0) {
      PyErr_Clear();
      return true;  // column() says why it cannot be read
    }
    const bool dims = v.ndim >= 1;
    PyBuffer_Release(&v);
    return dims;
  }

  // false: neither a non-negative int nor a 1-D buffer of 64-bit ints (why says which).
  static bool column(PyObject* x, Column* c, const char** why) {
    if (!is_array(x)) {
      if (u64(x, &c->scalar)) return true;
      *why = "its columns must be non-negative ints or 1-D arrays of 64-bit ints";
      return false;
    }
    if (PyObject_GetBuffer(x, &c->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
      PyErr_Clear();
      *why = "an array column must be C-contiguous";
      return false;
    }
    c->held = true;
    const char* f = c->view.format ? c->view.format : "B";
    if (*f == '<' || *f == '=' || *f == '@') ++f;
    const bool fmt_ok = f[0] != '\0' && f[1] == '\0' && std::strchr("QqLlNn", f[0]) != nullptr;
    if (c->view.ndim != 1 || c->view.itemsize != 8 || !fmt_ok) {
      *why = "an array column must be one-dimensional, of 64-bit ints (numpy uint64 or int64)";
      return false;
    }
    c->data = static_cast<const uint64_t*>(c->view.buf);
    c->n = c->view.shape ? c->view.shape[0] : c->view.len / 8;
    c->is_signed = std::islower(static_cast<unsigned char>(f[0])) != 0;
    return true;
  }

  // (rr, remote_offsets, local_addrs, lengths) with one or more array columns: one op per
  // row (row k: remote_offsets[k], local_addrs[k], lengths[k]; an int column repeats).
  void add_rows(PyObject* item, size_t i) {
    Column cols[3];
    const char* why = nullptr;
    Py_ssize_t n = -1;
    for (int k = 0; k < 3; ++k) {
      if (!column(at(item, k + 1), &cols[k], &why)) bad(item, i, why);
      if (cols[k].n >= 0) {
        if (n >= 0 && cols[k].n != n) bad(item, i, "its array columns differ in length");
        n = cols[k].n;
      }
    }
    for (auto& c : cols)
      if (c.is_signed)
        for (Py_ssize_t k = 0; k < c.n; ++k)
          if (int64_t(c.data[k]) < 0)
            bad(item, i, ("row " + std::to_string(k) + " holds a negative value (" +
                          std::to_string(int64_t(c.data[k])) + ")").c_str());
    out_.reserve(out_.size() + size_t(n));
    for (Py_ssize_t k = 0; k < n; ++k)
      push(mcr::IoOp{last_rr_, cols[0][k], uintptr_t(cols[1][k]), cols[2][k]}, i);
  }

  void add(PyObject* item, size_t i) {
    static const char* kShape =
        "not (RemoteRegion, remote_offset, local_addr or ((addr, length), ...), length) with non-negative ints, "
        "or with arrays of them";
    if (!pair_or_quad(item, 4)) bad(item, i, kShape);
    PyObject* r = at(item, 0);
    if (r != last_obj_) {
      std::shared_ptr<mcr::RemoteRegion> rr;
      if (r != Py_None && !nb::try_cast<std::shared_ptr<mcr::RemoteRegion>>(nb::handle(r), rr)) bad(item, i, kShape);
      last_rr_ = std::move(rr);  // None: refused by the engine ("remote region is None")
      last_obj_ = r;
    }
    PyObject* local = at(item, 2);
    // Python ints (the common case) skip the look for array columns
    const bool ints = PyLong_CheckExact(at(item, 1)) && PyLong_CheckExact(at(item, 3));
    if (!ints && (is_array(at(item, 1)) || is_array(local) || is_array(at(item, 3)))) return add_rows(item, i);
    uint64_t off, len;
    if (!u64(at(item, 1), &off) || !u64(at(item, 3), &len)) bad(item, i, kShape);
    uint64_t addr;
    if (PyTuple_Check(local) || PyList_Check(local)) {  // a multi-range value
      const Py_ssize_t k = PySequence_Fast_GET_SIZE(local);
      uint64_t done = 0;
      for (Py_ssize_t j = 0; j < k && done < len; ++j) {
        PyObject* rg = PySequence_Fast_ITEMS(local)[j];
        uint64_t a, m;
        if (!pair_or_quad(rg, 2) || !u64(at(rg, 0), &a) || !u64(at(rg, 1), &m))
          bad(item, i, "its ranges are not (address, length) pairs of non-negative ints");
        m = std::min(m, len - done);
        push(mcr::IoOp{last_rr_, off + done, uintptr_t(a), m}, i);
        done += m;
      }
      return;
    }
    if (!u64(local, &addr)) {
      if (is_array(local)) return add_rows(item, i);  // local addresses an array, the rest ints
      bad(item, i, kShape);
    }
    push(mcr::IoOp{last_rr_, off, uintptr_t(addr), len}, i);
  }

  void push(mcr::IoOp&& io, size_t i) {
    io.want_crc = want_crc_;
    out_.push_back(std::move(io));
    if (want_crc_) item_of_.push_back(uint32_t(i));
  }

  const bool want_crc_;
  std::vector<uint32_t> item_of_;
  std::vector<mcr::IoOp> out_;
  PyObject* last_obj_ = nullptr;
  std::shared_ptr<mcr::RemoteRegion> last_rr_;
};

std::vector<mcr::IoOp> parse_ops(nb::handle ops) { return OpParser().parse(ops); }

// A Python callable as a native handler: run on the progress thread with the GIL taken
// for the call only.
mcr::NativeHandler python_handler(nb::callable fn) {
  std::shared_ptr<nb::object> holder(new nb::object(fn), [](nb::object* o) {
    if (Py_IsInitialized()) {
      nb::gil_scoped_acquire g;
      delete o;
    }
  });
  return [holder](const std::string& in, std::string* out) -> Code {
    nb::gil_scoped_acquire g;
    try {
      nb::object r = (*holder)(nb::bytes(in.data(), in.size()));
      if (!r.is_none()) {
        nb::bytes b = nb::cast<nb::bytes>(r);
        out->assign(b.c_str(), b.size());
      }
      return Code::kOk;
    } catch (nb::python_error& err) {
      *out = err.what();
      return Code::kRpcHandlerError;
    } catch (const std::exception& err) {
      *out = err.what();
      return Code::kRpcHandlerError;
    }
  };
}

void wait_op(mcr::Op& op, double timeout_s, const char* what) {
  if (!op.wait(timeout_s)) {
    op.abandon();
    throw Error(Code::kTimeout, std::string(what) + " did not complete within " +
                                    std::to_string(timeout_s) + " s");
  }
  op.check();
}

mcr::ReadPath read_mode(const std::string& s) {
  if (s == "auto") return mcr::ReadPath::kAuto;
  if (s == "memcpy") return mcr::ReadPath::kMemcpy;
  if (s == "push") return mcr::ReadPath::kPush;
  if (s == "get") return mcr::ReadPath::kGet;
  throw Error(Code::kBadConfig, "read_mode must be auto, get, push or memcpy; got '" + s + "'");
}

mcr::WritePath write_mode(const std::string& s) {
  if (s == "auto") return mcr::WritePath::kAuto;
  if (s == "memcpy") return mcr::WritePath::kMemcpy;
  if (s == "put") return mcr::WritePath::kPut;
  throw Error(Code::kBadConfig, "write_mode must be auto, put or memcpy; got '" + s + "'");
}

nb::object error_instance(Code code, const std::string& msg) {
  nb::object cls = nb::module_::import_("mooncake_ray.errors").attr("_from_native_code")(int(code));
  nb::object e = cls(msg);
  e.attr("code") = int(code);
  return e;
}

}  // namespace

void bind_transport(nb::module_& m) {
  // Engines, peers and regions still referenced at interpreter exit (module globals, Ray
  // actors killed mid-call) are normal here, not binding bugs: no warning flood at exit.
  nb::set_leak_warnings(false);
  m.def("ucx_version", []() {
    unsigned major, minor, release;
    ucp_get_version(&major, &minor, &release);
    return nb::make_tuple(major, minor, release);
  });

  nb::class_<mcr::Notifier>(m, "Notifier")
      .def(nb::init<>())
      .def_prop_ro("fd", &mcr::Notifier::fd)
      .def("drain", &mcr::Notifier::drain);

  nb::class_<mcr::Region>(m, "NativeRegion")
      .def_prop_ro("id", &mcr::Region::id)
      .def_prop_ro("addr", &mcr::Region::addr)
      .def_prop_ro("length", &mcr::Region::length)
      .def_prop_ro("is_arena", &mcr::Region::is_arena)
      .def_prop_ro("closed", &mcr::Region::closed)
      .def_prop_ro("rkey", [](mcr::Region& r) { return nb::bytes(r.rkey().data(), r.rkey().size()); })
      .def("close", &mcr::Region::close, "wait_s"_a = 10.0, nb::call_guard<nb::gil_scoped_release>())
      .def("view", [](std::shared_ptr<mcr::Region> r) {
        if (r->closed()) throw Error(Code::kNotRegistered, "region is closed");
        if (r->mem_type() != mcr::MemType::kHost)
          throw Error(Code::kInvalidArgument, "device memory has no host view");
        r->add_view();
        auto* keep = new std::shared_ptr<mcr::Region>(r);
        nb::capsule owner(keep, [](void* p) noexcept {
          auto* sp = static_cast<std::shared_ptr<mcr::Region>*>(p);
          (*sp)->drop_view();
          delete sp;
        });
        size_t shape[1] = {size_t(r->length())};
        return nb::ndarray<nb::memview, uint8_t, nb::ndim<1>>(
            reinterpret_cast<void*>(r->addr()), 1, shape, owner);
      });

  nb::class_<mcr::Peer>(m, "Peer")
      .def_prop_ro("uid", &mcr::Peer::uid)
      .def_prop_ro("alive", &mcr::Peer::alive)
      .def("check_process", &mcr::Peer::check_process, nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("name", &mcr::Peer::name)
      .def_prop_ro("address", [](mcr::Peer& p) { return nb::bytes(p.address().data(), p.address().size()); })
      .def("__repr__", [](mcr::Peer& p) {
        return "<Peer '" + p.name() + "' " + (p.alive() ? "alive" : "dead") + ">";
      });

  nb::class_<mcr::RemoteRegion>(m, "RemoteRegion")
      .def_prop_ro("base", &mcr::RemoteRegion::base)
      .def_prop_ro("length", &mcr::RemoteRegion::length)
      .def_prop_ro("peer", &mcr::RemoteRegion::peer)
      .def_prop_ro("mapped", &mcr::RemoteRegion::mapped)
      .def_prop_ro("device_mapped", &mcr::RemoteRegion::device_mapped)
      .def_prop_ro("rkey", [](mcr::RemoteRegion& r) { return nb::bytes(r.rkey().data(), r.rkey().size()); })
      .def_prop_ro("read_path", [](mcr::RemoteRegion& r) { return mcr::read_path_name(r.read_path()); })
      .def_prop_ro("write_path", [](mcr::RemoteRegion& r) { return mcr::write_path_name(r.write_path()); })
      .def("__repr__", [](mcr::RemoteRegion& r) {
        return "<RemoteRegion base=" + std::to_string(r.base()) + " length=" +
               std::to_string(r.length()) + " read=" + mcr::read_path_name(r.read_path()) + ">";
      });

  nb::class_<mcr::Op>(m, "NativeHandle")
      .def("done", &mcr::Op::done)
      .def("wait", [](mcr::Op& op, std::optional<double> timeout_s) {
        nb::gil_scoped_release nogil;
        double t = timeout_or_forever(timeout_s);
        if (!op.wait(t))
          throw Error(Code::kTimeout, "operation did not complete within " + std::to_string(t) + " s");
        op.check();
      }, "timeout_s"_a = nb::none())
      .def("take_result", [](mcr::Op& op) {
        std::string r = op.take_result();
        return nb::bytes(r.data(), r.size());
      })
      .def("error", [](mcr::Op& op) -> nb::object {
        if (!op.done() || op.code() == Code::kOk) return nb::none();
        return error_instance(op.code(), op.message());
      })
      .def("cancel", &mcr::Op::abandon, nb::call_guard<nb::gil_scoped_release>())
      .def("set_notify", &mcr::Op::set_notify);

  // The engine's settings, one property per EngineConfig field (read_mode and write_mode
  // as their names). mooncake_ray.config.TransportConfig fills it by field name.
  nb::class_<mcr::EngineConfig>(m, "EngineConfig")
      .def(nb::init<>())
      .def_rw("name", &mcr::EngineConfig::name)
      .def_rw("protocol", &mcr::EngineConfig::protocol)
      .def_prop_rw("devices", [](const mcr::EngineConfig& c) { return c.devices; },
          [](mcr::EngineConfig& c, std::optional<std::vector<std::string>> d) {  // None: UCX default
            c.devices = d ? *d : std::vector<std::string>{};
          })
      .def_rw("num_lanes", &mcr::EngineConfig::num_lanes)
      .def_prop_rw("ucx_options",  // a dict, applied in key order
          [](const mcr::EngineConfig& c) {
            return std::map<std::string, std::string>(c.ucx_options.begin(), c.ucx_options.end());
          },
          [](mcr::EngineConfig& c, const std::map<std::string, std::string>& opts) {
            c.ucx_options.assign(opts.begin(), opts.end());
          })
      .def_prop_rw("read_mode",
          [](const mcr::EngineConfig& c) { return std::string(mcr::read_path_name(c.read_mode)); },
          [](mcr::EngineConfig& c, const std::string& s) { c.read_mode = read_mode(s); })
      .def_prop_rw("write_mode",
          [](const mcr::EngineConfig& c) { return std::string(mcr::write_path_name(c.write_mode)); },
          [](mcr::EngineConfig& c, const std::string& s) { c.write_mode = write_mode(s); })
      .def_rw("chunk_bytes", &mcr::EngineConfig::chunk_bytes)
      .def_rw("stripe_min_bytes", &mcr::EngineConfig::stripe_min_bytes)
      .def_rw("staging_bytes", &mcr::EngineConfig::staging_bytes)
      .def_rw("push_min_bytes", &mcr::EngineConfig::push_min_bytes)
      .def_rw("spin_us", &mcr::EngineConfig::spin_us)
      .def_rw("inflight_linger_us", &mcr::EngineConfig::inflight_linger_us)
      .def_rw("server_linger_us", &mcr::EngineConfig::server_linger_us)
      .def_rw("keepalive_s", &mcr::EngineConfig::keepalive_s)
      .def_rw("error_mode", &mcr::EngineConfig::error_mode);

  nb::class_<mcr::Engine>(m, "TransportEngine")
      .def("__init__", [](mcr::Engine* self, const mcr::EngineConfig& config) {
        mcr::EngineConfig c = config;  // a copy: the Python object may change meanwhile
        nb::gil_scoped_release nogil;
        new (self) mcr::Engine(c);
      }, "config"_a)
      .def_prop_ro("config", [](mcr::Engine& e) { return e.config(); })  // a copy
      .def_prop_ro("address", [](mcr::Engine& e) { return nb::bytes(e.address().data(), e.address().size()); })
      .def_prop_ro("uid", &mcr::Engine::uid)
      .def_prop_ro("closed", &mcr::Engine::closed)
      .def_prop_ro("num_lanes", [](mcr::Engine& e) { return e.config().num_lanes; })
      .def("alloc_arena", &mcr::Engine::alloc_arena, "size"_a, nb::call_guard<nb::gil_scoped_release>())
      .def("register_memory", [](mcr::Engine& e, uintptr_t addr, uint64_t length, bool cuda) {
        return e.register_memory(addr, length, cuda ? mcr::MemType::kCuda : mcr::MemType::kHost);
      }, "addr"_a, "length"_a, "cuda"_a = false, nb::call_guard<nb::gil_scoped_release>())
      .def("connect", [](mcr::Engine& e, nb::bytes address, double timeout_s) {
        std::string a(address.c_str(), address.size());
        nb::gil_scoped_release nogil;
        return e.connect(a, timeout_s);
      }, "address"_a, "timeout_s"_a)
      .def("import_remote", [](mcr::Engine& e, std::shared_ptr<mcr::Peer> peer, nb::bytes rkey,
                               uint64_t base, uint64_t length, std::string map_path, uint64_t map_offset,
                               bool populate) {
        std::string k(rkey.c_str(), rkey.size());
        nb::gil_scoped_release nogil;
        return e.import_remote(peer, k, base, length, map_path, map_offset, populate);
      }, "peer"_a, "rkey"_a, "base"_a, "length"_a, "map_path"_a = "", "map_offset"_a = 0, "populate"_a = true)
      .def("transfer", [](mcr::Engine& e, nb::handle ops, bool is_read, std::optional<double> timeout_s) {
        auto v = parse_ops(ops);
        nb::gil_scoped_release nogil;
        auto op = e.submit(v, is_read);
        wait_op(*op, timeout_or_forever(timeout_s), is_read ? "read" : "write");
      }, "ops"_a, "is_read"_a, "timeout_s"_a = nb::none())
      // A write that also returns, per op, the CRC-32C of the bytes written where this
      // process copied them itself (a same-host arena: the checksum is taken in the copy),
      // else None (UCX moved them; an op of no bytes: 0).
      .def("write_checksummed", [](mcr::Engine& e, nb::handle ops, std::optional<double> timeout_s) {
        OpParser parser(true);
        auto v = parser.parse(ops);
        const size_t n = size_t(PySequence_Size(ops.ptr()));
        std::vector<uint32_t> crc(n, 0);
        std::vector<char> ok(n, 1);
        {
          nb::gil_scoped_release nogil;
          auto op = e.submit(v, false);
          wait_op(*op, timeout_or_forever(timeout_s), "write");
          std::vector<char> seen(n, 0);
          for (size_t k = 0; k < v.size(); ++k) {  // a value's ranges in order: CRC-32C is linear
            const size_t i = parser.item_of()[k];
            if (v[k].length == 0) continue;
            if (!v[k].crc_ok) ok[i] = 0;
            else crc[i] = seen[i] ? mcr::spill::crc32c_combine(crc[i], v[k].crc, v[k].length) : v[k].crc;
            seen[i] = 1;
          }
        }
        nb::list out;
        for (size_t i = 0; i < n; ++i) out.append(ok[i] ? nb::object(nb::int_(crc[i])) : nb::none());
        return out;
      }, "ops"_a, "timeout_s"_a = nb::none())
      .def("transfer_async", [](mcr::Engine& e, nb::handle ops, bool is_read) {
        auto v = parse_ops(ops);
        nb::gil_scoped_release nogil;
        return e.submit(v, is_read);
      }, "ops"_a, "is_read"_a)
      .def("call", [](mcr::Engine& e, std::shared_ptr<mcr::Peer> peer, uint32_t hid,
                      nb::handle payload, std::optional<double> timeout_s) {
        std::string out;
        {
          ByteView bv(payload);
          nb::gil_scoped_release nogil;
          auto op = e.call_async(peer, hid, bv.data(), bv.size());
          wait_op(*op, timeout_or_forever(timeout_s), "call");
          out = op->take_result();
        }
        return nb::bytes(out.data(), out.size());
      }, "peer"_a, "handler_id"_a, "payload"_a, "timeout_s"_a = nb::none())
      .def("call_async", [](mcr::Engine& e, std::shared_ptr<mcr::Peer> peer, uint32_t hid,
                            nb::handle payload) {
        ByteView bv(payload);
        nb::gil_scoped_release nogil;
        return e.call_async(peer, hid, bv.data(), bv.size());
      }, "peer"_a, "handler_id"_a, "payload"_a)
      .def("call_many", [](mcr::Engine& e, nb::handle calls, std::optional<double> timeout_s) {
        std::vector<mcr::CallRequest> in;
        for (nb::handle item : calls) {
          auto t = nb::cast<nb::tuple>(item);
          if (t.size() != 3) throw Error(Code::kInvalidArgument, "call_many expects (peer, handler_id, payload) tuples");
          ByteView bv(t[2]);
          in.push_back({nb::cast<std::shared_ptr<mcr::Peer>>(t[0]), nb::cast<uint32_t>(t[1]),
                        std::string(bv.data(), bv.size())});
        }
        std::vector<mcr::CallOutcome> res;
        {
          nb::gil_scoped_release nogil;
          res = e.call_many(in, timeout_or_forever(timeout_s));
        }
        nb::list out;
        for (auto& r : res) {
          if (r.code == Code::kOk)
            out.append(nb::bytes(r.data.data(), r.data.size()));
          else
            out.append(error_instance(r.code, r.data));
        }
        return out;
      }, "calls"_a, "timeout_s"_a = nb::none())
      .def("serve_external", &mcr::Engine::serve_external, "handler_id"_a)
      // A Python handler run inline on the progress thread (GIL taken for the call):
      // one thread hop less than serve_external. The handler must not make engine calls
      // nor wait on anything that does (the progress thread is busy running it).
      .def("serve_inline", [](mcr::Engine& e, uint32_t hid, nb::callable fn) {
        e.serve_native(hid, python_handler(fn));
      }, "handler_id"_a, "fn"_a)
      // The master's RPC: GET, EXISTS, RELEASE and clean PUT_COMMITs answered by the
      // native index when it can, everything else (and whatever it declines) by ``fn``
      // inline, as above. ``hold_commits``: a native commit's reply is logged in the index
      // (kHeld) instead of sent; the master sends it (``reply``) once it is durable.
      .def("serve_master", [](mcr::Engine& e, uint32_t hid, std::shared_ptr<mcr::MasterIndex> index,
                              nb::callable fn, bool hold_commits) {
        mcr::NativeHandler py = python_handler(fn);
        e.serve_native(hid, [index, py, hold_commits](const std::string& in, std::string* out) -> Code {
          mcr::IncomingRequest req;
          mcr::HeldReply to;
          const mcr::HeldReply* hold = nullptr;
          bool held = false;
          if (hold_commits && mcr::peek_current_request(&req)) {
            to = mcr::HeldReply{req.peer_uid, req.call_id, req.lane};
            hold = &to;
          }
          if (index->serve(in.data(), in.size(), out, hold, &held)) {
            if (held) mcr::hold_current_request(&req);
            return Code::kOk;
          }
          return py(in, out);
        });
      }, "handler_id"_a, "index"_a, "fn"_a, "hold_commits"_a = false)
      // Inside an inline handler: keep the request to answer later with ``reply`` (the
      // handler's return is then not sent). -> the reply token, or None outside a handler.
      .def("hold_request", [](mcr::Engine&) -> nb::object {
        mcr::IncomingRequest req;
        if (!mcr::hold_current_request(&req)) return nb::none();
        return nb::make_tuple(req.peer_uid, req.call_id, req.lane);
      })
      .def("serve_echo", [](mcr::Engine& e, uint32_t hid) {
        e.serve_native(hid, [](const std::string& in, std::string* out) {
          *out = in;
          return Code::kOk;
        });
      }, "handler_id"_a)
      .def("unserve", &mcr::Engine::unserve, "handler_id"_a)
      .def("next_request", [](mcr::Engine& e, std::optional<double> timeout_s) -> nb::object {
        mcr::IncomingRequest req;
        bool got;
        {
          nb::gil_scoped_release nogil;
          got = e.next_request(&req, timeout_or_forever(timeout_s));
        }
        if (!got) return nb::none();
        return nb::make_tuple(nb::make_tuple(req.peer_uid, req.call_id, req.lane), req.handler_id,
                              nb::bytes(req.payload.data(), req.payload.size()));
      }, "timeout_s"_a = nb::none())
      .def("reply", [](mcr::Engine& e, std::tuple<uint64_t, uint64_t, uint32_t> token, int code,
                       nb::handle data) {
        mcr::IncomingRequest req;
        req.peer_uid = std::get<0>(token);
        req.call_id = std::get<1>(token);
        req.lane = std::get<2>(token);
        ByteView bv(data);
        nb::gil_scoped_release nogil;
        e.reply(req, static_cast<Code>(code), bv.data(), bv.size());
      }, "token"_a, "code"_a, "data"_a)
      .def("stats", &mcr::Engine::stats)
      .def_prop_ro("memory_types", &mcr::Engine::memory_types)
      .def("set_auth_secret", [](mcr::Engine& e, nb::bytes secret) {
        e.set_auth_secret(std::string(secret.c_str(), secret.size()));
      }, "secret"_a)
      .def_prop_ro("auth_enabled", &mcr::Engine::auth_enabled)
      // Test hooks (tests/native/test_auth.py).
      .def("_debug_send_raw", [](mcr::Engine& e, nb::bytes address, unsigned am_id,
                                 nb::bytes header, nb::bytes data) {
        std::string a(address.c_str(), address.size()), h(header.c_str(), header.size()),
            d(data.c_str(), data.size());
        nb::gil_scoped_release nogil;
        e.debug_send_raw(a, am_id, h, d);
      }, "address"_a, "am_id"_a, "header"_a, "data"_a)
      .def("_debug_die_mid_message", [](mcr::Engine& e, nb::bytes address) {
        std::string a(address.c_str(), address.size());
        nb::gil_scoped_release nogil;
        e.debug_die_mid_message(a);
      }, "address"_a)
      .def("_debug_last_auth2", [](mcr::Engine& e) {
        auto p = e.debug_last_auth2();
        return nb::make_tuple(nb::bytes(p.first.data(), p.first.size()),
                              nb::bytes(p.second.data(), p.second.size()));
      })
      .def("close", &mcr::Engine::close, nb::call_guard<nb::gil_scoped_release>());
}
