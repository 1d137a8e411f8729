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

#include <optional>

#include "mcr/master_index.h"
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

std::vector<mcr::IoOp> parse_ops(nb::handle ops) {
  std::vector<mcr::IoOp> out;
  for (nb::handle item : ops) {
    auto t = nb::cast<std::tuple<std::shared_ptr<mcr::RemoteRegion>, uint64_t, uintptr_t, uint64_t>>(item);
    out.push_back(mcr::IoOp{std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t)});
  }
  return out;
}

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

  nb::class_<mcr::Engine>(m, "TransportEngine")
      .def("__init__", [](mcr::Engine* self, std::string name, std::string protocol,
                          std::vector<std::string> devices, int num_lanes,
                          std::map<std::string, std::string> ucx_options, std::string rmode,
                          std::string wmode, uint64_t chunk_bytes, uint64_t stripe_min_bytes,
                          uint64_t staging_bytes, int spin_us, int linger_us, double keepalive_s,
                          std::string error_mode, uint64_t push_min_bytes, int serve_linger_us) {
        mcr::EngineConfig c;
        c.name = name;
        c.protocol = protocol;
        c.devices = devices;
        c.num_lanes = num_lanes;
        for (auto& kv : ucx_options) c.ucx_options.emplace_back(kv.first, kv.second);
        c.read_mode = read_mode(rmode);
        c.write_mode = write_mode(wmode);
        c.chunk_bytes = chunk_bytes;
        c.stripe_min_bytes = stripe_min_bytes;
        c.staging_bytes = staging_bytes;
        c.spin_us = spin_us;
        c.linger_us = linger_us;
        c.keepalive_s = keepalive_s;
        c.error_mode = error_mode;
        c.push_min_bytes = push_min_bytes;
        c.serve_linger_us = serve_linger_us;
        nb::gil_scoped_release nogil;
        new (self) mcr::Engine(c);
      }, "name"_a, "protocol"_a, "devices"_a, "num_lanes"_a, "ucx_options"_a, "read_mode"_a,
         "write_mode"_a, "chunk_bytes"_a, "stripe_min_bytes"_a, "staging_bytes"_a, "spin_us"_a,
         "linger_us"_a, "keepalive_s"_a, "error_mode"_a = "auto", "push_min_bytes"_a = 32768,
         "serve_linger_us"_a = 0)
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
                               uint64_t base, uint64_t length) {
        std::string k(rkey.c_str(), rkey.size());
        nb::gil_scoped_release nogil;
        return e.import_remote(peer, k, base, length);
      }, "peer"_a, "rkey"_a, "base"_a, "length"_a)
      .def("transfer", [](mcr::Engine& e, nb::handle ops, bool is_read, std::optional<double> timeout_s) {
        auto v = parse_ops(ops);
        nb::gil_scoped_release nogil;
        auto op = e.submit(v, is_read);
        wait_op(*op, timeout_or_forever(timeout_s), is_read ? "read" : "write");
      }, "ops"_a, "is_read"_a, "timeout_s"_a = nb::none())
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
        std::vector<std::tuple<std::shared_ptr<mcr::Peer>, uint32_t, std::string>> in;
        for (nb::handle item : calls) {
          auto t = nb::cast<nb::tuple>(item);
          if (t.size() != 3) throw Error(Code::kInvalidArgument, "call_many expects (peer, handler_id, payload) tuples");
          ByteView bv(t[2]);
          in.emplace_back(nb::cast<std::shared_ptr<mcr::Peer>>(t[0]), nb::cast<uint32_t>(t[1]),
                          std::string(bv.data(), bv.size()));
        }
        std::vector<std::pair<Code, std::string>> res(in.size());
        {
          nb::gil_scoped_release nogil;
          std::vector<std::shared_ptr<mcr::Op>> ops(in.size());
          for (size_t i = 0; i < in.size(); ++i) {
            try {
              auto& [p, h, d] = in[i];
              ops[i] = e.call_async(p, h, d.data(), d.size());
            } catch (const Error& err) {
              res[i] = {err.code(), err.what()};
            }
          }
          double t = timeout_or_forever(timeout_s);
          auto start = std::chrono::steady_clock::now();
          for (size_t i = 0; i < ops.size(); ++i) {
            if (!ops[i]) continue;
            double left = t;
            if (t >= 0) {
              left = t - std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
              if (left < 0) left = 0;
            }
            if (!ops[i]->wait(left)) {
              ops[i]->abandon();
              res[i] = {Code::kTimeout, "call did not complete within " + std::to_string(t) + " s"};
            } else if (ops[i]->code() != Code::kOk) {
              res[i] = {ops[i]->code(), ops[i]->message()};
            } else {
              res[i] = {Code::kOk, ops[i]->take_result()};
            }
          }
        }
        nb::list out;
        for (auto& [code, s] : res) {
          if (code == Code::kOk)
            out.append(nb::bytes(s.data(), s.size()));
          else
            out.append(error_instance(code, s));
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
      // The master's RPC: GET, EXISTS and RELEASE answered by the native index when it
      // can, everything else (and whatever it declines) by ``fn`` inline, as above.
      .def("serve_master", [](mcr::Engine& e, uint32_t hid, std::shared_ptr<mcr::MasterIndex> index,
                              nb::callable fn) {
        mcr::NativeHandler py = python_handler(fn);
        e.serve_native(hid, [index, py](const std::string& in, std::string* out) -> Code {
          if (index->serve(in.data(), in.size(), out)) return Code::kOk;
          return py(in, out);
        });
      }, "handler_id"_a, "index"_a, "fn"_a)
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
      .def("_debug_last_auth2", [](mcr::Engine& e) {
        auto p = e.debug_last_auth2();
        return nb::make_tuple(nb::bytes(p.first.data(), p.first.size()),
                              nb::bytes(p.second.data(), p.second.size()));
      })
      .def("close", &mcr::Engine::close, nb::call_guard<nb::gil_scoped_release>());
}
