// Request/response RPC over UCP active messages, and the AM receive side of every
// message kind (HELLO, requests, replies, push requests).
//
// A request carries (sender uid, call id, handler id). Native handlers run on the lane
// that received the request, right after ucp_worker_progress returns; other handlers
// (Python) are queued for Engine::next_request and answered with Engine::reply from any
// thread. Replies always travel over the receiver's own endpoint to the sender (see
// peer.cpp). Payloads above UCX's rendezvous threshold arrive as RNDV and are pulled
// with ucp_am_recv_data_nbx into a buffer the size of the message.
#include <cstring>

#include "internal.h"

namespace mcr {

namespace {
struct SendCtx {
  EngineCore* core;
  Lane* lane;
  std::string data;
  uint64_t fail_call_id;  // a call to fail if this send fails (0: none)
};

void on_send_done(void* req, ucs_status_t st, void* user) {
  auto* sc = static_cast<SendCtx*>(user);
  sc->lane->outstanding.fetch_sub(1);
  if (st != UCS_OK && sc->fail_call_id) {
    Pending p;
    if (sc->core->take_pending(sc->fail_call_id, &p)) {
      if (p.on_reply) p.on_reply(code_from_ucs(st));
      p.op->sub_done(code_from_ucs(st), ucs_msg("send request", st));
    }
  }
  delete sc;
  ucp_request_free(req);
}

}  // namespace

bool am_send_locked(EngineCore* c, Lane* lane, void* ep, unsigned id, const void* hdr,
                    size_t hlen, std::string data, uint64_t fail_call_id, bool reply_flag,
                    ucs_status_t* err) {
  auto* sc = new SendCtx{c, lane, std::move(data), fail_call_id};
  ucp_request_param_t rp;
  memset(&rp, 0, sizeof rp);
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                    UCP_OP_ATTR_FIELD_FLAGS;
  rp.flags = UCP_AM_SEND_FLAG_COPY_HEADER | (reply_flag ? UCP_AM_SEND_FLAG_REPLY : 0);
  rp.cb.send = on_send_done;
  rp.user_data = sc;
  void* r = ucp_am_send_nbx(static_cast<ucp_ep_h>(ep), id, hdr, hlen, sc->data.data(),
                            sc->data.size(), &rp);
  if (UCS_PTR_IS_PTR(r)) {
    lane->outstanding.fetch_add(1);
    return true;
  }
  delete sc;
  if (UCS_PTR_IS_ERR(r)) {
    if (err) *err = UCS_PTR_STATUS(r);
    return false;
  }
  return true;
}

namespace {
// Delivery of a payload that may be eager (copied now) or rendezvous (pulled, then fn).
struct RecvCtx {
  std::string buf;
  std::function<void(Code, std::string)> fn;
};

void on_recv_done(void* req, ucs_status_t st, size_t, void* user) {
  auto* rc = static_cast<RecvCtx*>(user);
  rc->fn(code_from_ucs(st), std::move(rc->buf));
  delete rc;
  ucp_request_free(req);
}

// Callers bound `len` first (for a rendezvous message it is only the sender's claim).
ucs_status_t recv_payload(Lane* lane, void* data, size_t len, const ucp_am_recv_param_t* param,
                          std::function<void(Code, std::string)> fn) {
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    fn(Code::kOk, std::string(static_cast<char*>(data), len));
    return UCS_OK;
  }
  auto* rc = new RecvCtx{std::string(len, '\0'), std::move(fn)};
  ucp_request_param_t rp;
  memset(&rp, 0, sizeof rp);
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                    UCP_OP_ATTR_FIELD_DATATYPE;
  rp.cb.recv_am = on_recv_done;
  rp.user_data = rc;
  rp.datatype = ucp_dt_make_contig(1);
  void* r = ucp_am_recv_data_nbx(lane->worker, data, rc->buf.data(), len, &rp);
  if (UCS_PTR_IS_PTR(r)) return UCS_INPROGRESS;
  rc->fn(UCS_PTR_IS_ERR(r) ? code_from_ucs(UCS_PTR_STATUS(r)) : Code::kOk, std::move(rc->buf));
  delete rc;
  return UCS_INPROGRESS;
}

// A sender we cannot answer over our own endpoint (unknown, or we lost the connection
// back): tell it through the reply endpoint, valid only inside the AM callback. With
// auth on, only a sender whose token was valid gets here.
void reject_unknown(EngineCore* c, Lane* lane, uint64_t caller_uid, uint64_t call_id,
                    const ucp_am_recv_param_t* param, Code code = Code::kUnreachable,
                    std::string msg = std::string()) {
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) || !param->reply_ep) return;
  RepHdr h{c->uid, call_id, int32_t(code), kRepReject, {}};
  if (c->auth_on() && code != Code::kAuthFailed) c->make_token(c->uid, caller_uid, h.tok);
  if (msg.empty())
    msg = "engine '" + c->cfg.name + "' has no connection back to the caller; reconnect";
  am_send_locked(c, lane, param->reply_ep, kAmRpcRep, &h, sizeof h, std::move(msg), 0, false,
                 nullptr);
}

// An oversized or inconsistent message from an authenticated peer: answered with an
// error, its payload never received.
void reply_malformed(EngineCore* c, Lane* lane, const std::shared_ptr<Peer>& peer,
                     uint64_t call_id, const std::string& what) {
  c->st.malformed_dropped.fetch_add(1);
  lane->deferred.push_back([c, lane, peer, call_id, what] {
    c->send_reply_locked(lane, peer.get(), call_id, Code::kInvalidArgument, what);
  });
}

template <typename H>
bool read_hdr(const void* header, size_t hlen, H* out) {
  if (hlen < sizeof(H)) return false;
  memcpy(out, header, sizeof(H));
  return true;
}

// ---- AM callbacks (run inside ucp_worker_progress, Lane::mu held) ----------------------

ucs_status_t on_hello(void* arg, const void* header, size_t hlen, void* data, size_t len,
                      const ucp_am_recv_param_t* param) {
  auto* lane = static_cast<Lane*>(arg);
  EngineCore* c = lane->core;
  HelloHdr h;
  if (!read_hdr(header, hlen, &h) || c->closing.load()) return UCS_OK;
  if (c->auth_on()) {
    // An engine without the secret: refused before its address is even received.
    c->st.auth_rejected.fetch_add(1);
    reject_unknown(c, lane, h.uid, h.call_id, param, Code::kAuthFailed,
                   "engine '" + c->cfg.name +
                       "' requires authentication: set the cluster's auth secret on the "
                       "connecting engine");
    return UCS_OK;
  }
  if (len == 0 || len > kMaxAddressBytes) {
    c->st.malformed_dropped.fetch_add(1);
    return UCS_OK;
  }
  return recv_payload(lane, data, len, param, [c, lane, h](Code rc, std::string addr) {
    if (rc != Code::kOk) return;
    lane->deferred.push_back([c, lane, h, addr] { c->finish_hello_locked(lane, h.uid, h.call_id, addr); });
  });
}

// AUTH1 and AUTH_RESP: a header only, handed to the engine (auth.cpp).
template <typename H, void (EngineCore::*Fn)(Lane*, const H&, const ucp_am_recv_param_t*)>
ucs_status_t am_header_only(void* arg, const void* header, size_t hlen, void*, size_t,
                            const ucp_am_recv_param_t* param) {
  auto* lane = static_cast<Lane*>(arg);
  H h;
  if (!read_hdr(header, hlen, &h) || lane->core->closing.load()) return UCS_OK;
  (lane->core->*Fn)(lane, h, param);
  return UCS_OK;
}

ucs_status_t am_auth2(void* arg, const void* header, size_t hlen, void* data, size_t len,
                      const ucp_am_recv_param_t* param) {
  auto* lane = static_cast<Lane*>(arg);
  EngineCore* c = lane->core;
  Auth2Hdr h;
  if (!read_hdr(header, hlen, &h) || c->closing.load()) return UCS_OK;
  EngineCore::Challenge ch;
  if (!c->auth_on() || !c->take_challenge(h, &ch)) {
    c->st.auth_rejected.fetch_add(1);  // no challenge of ours: forged or replayed
    return UCS_OK;
  }
  if (len == 0 || len > kMaxAddressBytes) {
    c->st.malformed_dropped.fetch_add(1);
    return UCS_OK;
  }
  return recv_payload(lane, data, len, param, [c, lane, h, ch](Code rc, std::string addr) {
    if (rc != Code::kOk) return;
    lane->deferred.push_back([c, lane, h, ch, addr] {
      if (!c->verify_auth2(h, ch, addr)) {
        c->st.auth_rejected.fetch_add(1);
        return;
      }
      c->st.auth_handshakes.fetch_add(1);
      c->finish_hello_locked(lane, h.uid, h.call_id, addr);
    });
  });
}

ucs_status_t on_reply(void* arg, const void* header, size_t hlen, void* data, size_t len,
                      const ucp_am_recv_param_t* param) {
  auto* lane = static_cast<Lane*>(arg);
  EngineCore* c = lane->core;
  RepHdr h;
  if (!read_hdr(header, hlen, &h)) return UCS_OK;
  if (c->auth_on()) {
    bool tok_ok;
    c->auth_peer(h.uid, h.tok, &tok_ok);
    if (!tok_ok) return UCS_OK;  // dropped unread (counted)
  }
  Pending p;
  if (!c->take_pending(h.call_id, &p)) return UCS_OK;  // late (abandoned): dropped
  if (len > kMaxAmPayload) {
    c->st.malformed_dropped.fetch_add(1);
    if (p.on_reply) p.on_reply(Code::kTransferFailed);
    p.op->sub_done(Code::kTransferFailed, "reply of " + std::to_string(len) + " bytes exceeds the limit");
    return UCS_OK;
  }
  if (p.is_call && p.lane >= 0 && p.lane != lane->idx) c->st.replies_off_lane.fetch_add(1);
  Code code = static_cast<Code>(h.code);
  if (h.pad == kRepReject && code != Code::kAuthFailed) {
    // The callee has no connection back to us (it lost it): drop ours too, so that the
    // next connect() performs a fresh handshake.
    if (auto peer = c->find_peer(h.uid))
      c->peer_failed(peer.get(), Code::kUnreachable, "peer lost its connection back to us");
  }
  auto finish = [p, code](Code rc, std::string body) {
    if (rc != Code::kOk) {
      if (p.on_reply) p.on_reply(rc);
      p.op->sub_done(rc, "failed to receive the reply");
      return;
    }
    if (p.on_reply) p.on_reply(code);
    if (code == Code::kOk) {
      if (p.is_call) p.op->result_ = std::move(body);
      p.op->sub_done();
    } else {
      p.op->sub_done(code, body.empty() ? std::string(code_name(code)) : body);
    }
  };
  return recv_payload(lane, data, len, param, finish);
}

// The request a native handler is serving on this thread (hold_current_request).
struct ServingState {
  bool active = false;
  bool held = false;
  uint64_t peer_uid = 0;
  uint64_t call_id = 0;
  uint32_t lane = 0;
};
thread_local ServingState tl_serving;

ucs_status_t on_request(void* arg, const void* header, size_t hlen, void* data, size_t len,
                        const ucp_am_recv_param_t* param) {
  auto* lane = static_cast<Lane*>(arg);
  EngineCore* c = lane->core;
  RpcReqHdr h;
  if (!read_hdr(header, hlen, &h) || c->closing.load()) return UCS_OK;
  bool tok_ok;
  auto peer = c->auth_peer(h.uid, h.tok, &tok_ok);
  if (!tok_ok) return UCS_OK;  // dropped unread (counted), never answered
  if (!peer || !peer->eps_[lane->idx]) {
    reject_unknown(c, lane, h.uid, h.call_id, param);
    return UCS_OK;
  }
  if (len > kMaxAmPayload) {
    reply_malformed(c, lane, peer, h.call_id, "request of " + std::to_string(len) + " bytes exceeds the limit");
    return UCS_OK;
  }
  return recv_payload(lane, data, len, param, [c, lane, peer, h](Code rc, std::string body) {
    if (rc != Code::kOk) return;
    c->st.calls_served.fetch_add(1);
    NativeHandler fn;
    bool external = false;
    {
      std::shared_lock<std::shared_mutex> g(c->handlers_mu);
      auto it = c->native_handlers.find(h.handler_id);
      if (it != c->native_handlers.end())
        fn = it->second;
      else
        external = c->external_handlers.count(h.handler_id) > 0;
    }
    if (external) {
      std::lock_guard<std::mutex> g(c->inq_mu);
      c->inq.push_back(IncomingRequest{h.uid, h.call_id, uint32_t(lane->idx), h.handler_id,
                                       std::move(body)});
      c->inq_cv.notify_one();
      return;
    }
    auto payload = std::make_shared<std::string>(std::move(body));
    lane->deferred.push_back([c, lane, peer, h, fn, payload] {
      std::string out;
      Code code = Code::kNoHandler;
      if (fn) {
        tl_serving = ServingState{true, false, h.uid, h.call_id, uint32_t(lane->idx)};
        try {
          code = fn(*payload, &out);
        } catch (const std::exception& e) {
          code = Code::kRpcHandlerError;
          out = e.what();
        }
        const bool held = tl_serving.held;
        tl_serving = ServingState{};
        if (held) return;  // answered later (Engine::reply)
      } else {
        out = "no handler registered for id " + std::to_string(h.handler_id) + " on engine '" +
              c->cfg.name + "'";
      }
      c->send_reply_locked(lane, peer.get(), h.call_id, code, std::move(out));
    });
  });
}

ucs_status_t on_push(void* arg, const void* header, size_t hlen, void* data, size_t len,
                     const ucp_am_recv_param_t* param) {
  auto* lane = static_cast<Lane*>(arg);
  EngineCore* c = lane->core;
  PushHdr h;
  if (!read_hdr(header, hlen, &h) || c->closing.load()) return UCS_OK;
  bool tok_ok;
  auto peer = c->auth_peer(h.uid, h.tok, &tok_ok);
  if (!tok_ok) return UCS_OK;  // dropped unread (counted), never answered
  if (!peer || !peer->eps_[lane->idx]) {
    reject_unknown(c, lane, h.uid, h.call_id, param);
    return UCS_OK;
  }
  if (h.n_ext > kMaxExtentsPerPush || h.rkey_len == 0 || h.rkey_len > kMaxRkeyBytes ||
      len != h.rkey_len + uint64_t(h.n_ext) * sizeof(Extent)) {
    reply_malformed(c, lane, peer, h.call_id, "malformed push request");
    return UCS_OK;
  }
  return recv_payload(lane, data, len, param, [c, lane, peer, h](Code rc, std::string body) {
    if (rc != Code::kOk) return;
    auto b = std::make_shared<std::string>(std::move(body));
    lane->deferred.push_back([c, lane, peer, h, b] { c->serve_push_locked(lane, peer, h, std::move(*b)); });
  });
}
}  // namespace

void EngineCore::register_am_handlers(Lane* lane) {
  struct {
    unsigned id;
    ucp_am_recv_callback_t cb;
  } table[] = {{kAmHello, on_hello},
               {kAmHelloAck, on_reply},
               {kAmRpcReq, on_request},
               {kAmRpcRep, on_reply},
               {kAmPushReq, on_push},
               {kAmAuth1, am_header_only<Auth1Hdr, &EngineCore::on_auth1>},
               {kAmAuthResp, am_header_only<AuthRespHdr, &EngineCore::on_auth_resp>},
               {kAmAuth2, am_auth2}};
  for (auto& t : table) {
    ucp_am_handler_param_t p;
    memset(&p, 0, sizeof p);
    p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                   UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    p.id = t.id;
    p.flags = UCP_AM_FLAG_WHOLE_MSG;
    p.cb = t.cb;
    p.arg = lane;
    ucs_status_t st = ucp_worker_set_am_recv_handler(lane->worker, &p);
    if (st != UCS_OK) throw Error(Code::kInternal, ucs_msg("ucp_worker_set_am_recv_handler", st));
  }
}

// ---- pending replies ----------------------------------------------------------------

void EngineCore::add_pending(uint64_t id, Pending p) {
  std::lock_guard<std::mutex> g(pending_mu);
  pending.emplace(id, std::move(p));
}

bool EngineCore::take_pending(uint64_t id, Pending* out) {
  std::lock_guard<std::mutex> g(pending_mu);
  auto it = pending.find(id);
  if (it == pending.end()) return false;
  *out = std::move(it->second);
  pending.erase(it);
  return true;
}

// peer_uid 0: every pending entry (engine shutdown).
void EngineCore::fail_pending_for(uint64_t peer_uid, Code code, const std::string& msg) {
  std::vector<Pending> failed;
  {
    std::lock_guard<std::mutex> g(pending_mu);
    for (auto it = pending.begin(); it != pending.end();) {
      if (peer_uid == 0 || it->second.peer_uid == peer_uid) {
        failed.push_back(std::move(it->second));
        it = pending.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& p : failed) {
    if (p.on_reply) p.on_reply(code);
    p.op->sub_done(code, msg);
  }
}

// ---- sending ------------------------------------------------------------------------

void EngineCore::send_reply_locked(Lane* lane, Peer* peer, uint64_t call_id, Code code,
                                   std::string data, unsigned am_id) {
  void* ep = peer->eps_[lane->idx];
  if (!ep || peer->dead_.load()) return;  // the caller is gone: nobody to answer
  RepHdr h{uid, call_id, int32_t(code), 0, {}};
  memcpy(h.tok, peer->tok_send_, kTokLen);
  am_send_locked(this, lane, ep, am_id, &h, sizeof h, std::move(data), 0, false, nullptr);
}

std::shared_ptr<Op> EngineCore::call_async(const std::shared_ptr<Peer>& peer,
                                           uint32_t handler_id, const char* data, size_t len) {
  ActiveGuard guard(this);
  if (!peer) throw Error(Code::kInvalidArgument, "peer is None");
  if (peer->core_.get() != this) throw Error(Code::kInvalidArgument, "peer belongs to another engine");
  if (peer->dead_.load()) throw Error(Code::kUnreachable, peer->death_msg_);
  auto op = std::make_shared<Op>(shared_from_this());
  uint64_t id = next_id.fetch_add(1);
  op->is_call_ = true;
  op->call_id_ = id;
  // Calls from different threads spread over the lanes, but only over lanes the peer has
  // a worker of its own for: the reply comes back over the peer's receiving lane, i.e. to
  // our lane (ours % theirs) % ours. Past the peer's lane count that is another lane than
  // the one the caller spins on (a master has one lane), and the reply then waits for
  // that lane's sleeping progress thread: a wake-up of tens of µs per call here.
  // (Threads are numbered in order of their first call: a hash of the thread id spread
  // them unevenly; in one test process 8 threads all landed on lanes 1 and 2 of 3.)
  static std::atomic<uint32_t> next_thread{0};
  static thread_local uint32_t tl_lane = next_thread.fetch_add(1, std::memory_order_relaxed);
  const size_t usable = std::max<size_t>(1, std::min(lanes.size(), peer->lane_addrs_.size()));
  Lane* lane = lanes[tl_lane % usable].get();
  op->add_lane(lane->idx);
  op->add_pending();
  add_pending(id, Pending{op, peer->uid_, {}, true, lane->idx});
  RpcReqHdr h{uid, id, handler_id, 0, {}};
  memcpy(h.tok, peer->tok_send_, kTokLen);
  ucs_status_t err = UCS_OK;
  bool ok;
  {
    std::lock_guard<std::mutex> g(lane->mu);
    void* ep = peer->eps_[lane->idx];
    ok = ep && am_send_locked(this, lane, ep, kAmRpcReq, &h, sizeof h, std::string(data, len), id,
                              true, &err);
    if (!ep) err = UCS_ERR_NOT_CONNECTED;
  }
  if (!ok) {
    Pending p;
    if (take_pending(id, &p)) p.op->sub_done(code_from_ucs(err), ucs_msg("send request", err));
  }
  st.calls_sent.fetch_add(1);
  op->sub_done();
  return op;
}

std::vector<CallOutcome> Engine::call_many(const std::vector<CallRequest>& calls,
                                           double timeout_s) {
  std::vector<CallOutcome> res(calls.size());
  std::vector<std::shared_ptr<Op>> ops(calls.size());
  for (size_t i = 0; i < calls.size(); ++i) {
    try {
      const CallRequest& c = calls[i];
      ops[i] = core_->call_async(c.peer, c.handler_id, c.payload.data(), c.payload.size());
    } catch (const Error& err) {
      res[i] = {err.code(), err.what()};
    }
  }
  // One deadline for the batch: each wait gets what is left of it.
  auto start = Clock::now();
  for (size_t i = 0; i < ops.size(); ++i) {
    Op* op = ops[i].get();
    if (!op) continue;
    double left = timeout_s;
    if (timeout_s >= 0) {
      left = timeout_s - std::chrono::duration<double>(Clock::now() - start).count();
      if (left < 0) left = 0;
    }
    if (!op->wait(left)) {
      op->abandon();
      res[i] = {Code::kTimeout, "call did not complete within " + std::to_string(timeout_s) + " s"};
    } else if (op->code() != Code::kOk) {
      res[i] = {op->code(), op->message()};
    } else {
      res[i] = {Code::kOk, op->take_result()};
    }
  }
  return res;
}

bool hold_current_request(IncomingRequest* out) {
  if (!tl_serving.active) return false;
  tl_serving.held = true;
  out->peer_uid = tl_serving.peer_uid;
  out->call_id = tl_serving.call_id;
  out->lane = tl_serving.lane;
  return true;
}

bool peek_current_request(IncomingRequest* out) {
  if (!tl_serving.active) return false;
  out->peer_uid = tl_serving.peer_uid;
  out->call_id = tl_serving.call_id;
  out->lane = tl_serving.lane;
  return true;
}

bool EngineCore::next_request(IncomingRequest* out, double timeout_s) {
  auto deadline = deadline_after(timeout_s);
  std::unique_lock<std::mutex> g(inq_mu);
  while (inq.empty() && !closing.load()) {
    if (deadline == Clock::time_point::max())
      inq_cv.wait(g);
    else if (inq_cv.wait_until(g, deadline) == std::cv_status::timeout)
      break;
  }
  if (inq.empty() || closing.load()) return false;
  *out = std::move(inq.front());
  inq.pop_front();
  return true;
}

void EngineCore::reply(const IncomingRequest& req, Code code, const char* data, size_t len) {
  if (closing.load()) return;
  auto peer = find_peer(req.peer_uid);
  if (!peer || req.lane >= lanes.size()) return;  // the caller died meanwhile
  Lane* lane = lanes[req.lane].get();
  int before;
  {
    std::lock_guard<std::mutex> g(lane->mu);
    before = lane->outstanding.load();
    send_reply_locked(lane, peer.get(), req.call_id, code, std::string(data, len));
    if (lane->outstanding.load() == before) return;  // sent immediately
  }
  lane->wake();  // a queued (e.g. rendezvous) reply needs the progress thread
}

}  // namespace mcr
