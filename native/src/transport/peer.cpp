#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
// Peers: engine addresses, endpoints (error mode PEER), the HELLO handshake, peer
// failure, and remote-key import.
//
// Connection model. Peers are keyed by the remote engine's uid (carried in its address).
// A request arriving on our worker is answered over OUR endpoint to the sender, never
// over UCP's internal reply endpoint: that one is destroyed by UCP when the sender dies,
// so a late reply through a saved pointer would be a use-after-free. connect() therefore
// sends a HELLO with the full local address on every lane; the receiver creates its own
// endpoints back (with an error callback) before acknowledging. Two engines that connect
// to each other share the same Peer objects on both sides.
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstring>

#include "internal.h"
#include "mcr/cuda.h"

namespace mcr {

namespace {
struct EpCtx {
  EngineCore* core;
  Peer* peer;
  int lane;
};

void on_ep_error(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* c = static_cast<EpCtx*>(arg);
  c->core->peer_failed(c->peer, code_from_ucs(status),
                       "peer '" + c->peer->name() + "' failed: " + ucs_status_string(status));
}

struct ParsedAddress {
  uint64_t uid = 0;
  std::string name;
  std::string host_id;
  uint32_t pid = 0;
  uint64_t start_time = 0;
  std::vector<std::string> lanes;
};

ParsedAddress parse_address(const std::string& a) {
  ParsedAddress out;
  size_t pos = 0;
  auto need = [&](size_t n) {
    if (a.size() - pos < n)
      throw Error(Code::kInvalidArgument, "malformed engine address (" + std::to_string(a.size()) + " bytes)");
  };
  auto u32 = [&] {
    need(4);
    uint32_t v;
    memcpy(&v, a.data() + pos, 4);
    pos += 4;
    return v;
  };
  if (a.size() < 20 || u32() != kAddrMagic)
    throw Error(Code::kInvalidArgument, "not a mooncake-ray engine address");
  need(8);
  memcpy(&out.uid, a.data() + pos, 8);
  pos += 8;
  uint32_t n = u32();
  if (n == 0 || n > 64) throw Error(Code::kInvalidArgument, "malformed engine address (lanes)");
  if (a.size() > kMaxAddressBytes)
    throw Error(Code::kInvalidArgument, "malformed engine address (" + std::to_string(a.size()) + " bytes)");
  uint32_t nl = u32();
  need(nl);
  out.name = a.substr(pos, nl);
  pos += nl;
  uint32_t hl = u32();
  need(hl);
  out.host_id = a.substr(pos, hl);
  pos += hl;
  out.pid = u32();
  need(8);
  memcpy(&out.start_time, a.data() + pos, 8);
  pos += 8;
  for (uint32_t i = 0; i < n; ++i) {
    uint32_t l = u32();
    // A UCX worker address: a header byte and a 64-bit worker id at least.
    if (l < 9 || l > kMaxLaneAddressBytes)
      throw Error(Code::kInvalidArgument, "malformed engine address (lane " + std::to_string(i) + ")");
    need(l);
    out.lanes.push_back(a.substr(pos, l));
    pos += l;
  }
  if (pos != a.size()) throw Error(Code::kInvalidArgument, "malformed engine address (trailing bytes)");
  return out;
}

// UCX parses a worker address without knowing its length: only bytes that look like an
// address from our own UCX build reach ucp_ep_create. The header byte's low four bits are
// UCX's address format version, which must be ours.
bool plausible_worker_address(const std::string& ra, const std::string& ours) {
  if (ra.size() < 9 || ra.size() > kMaxLaneAddressBytes || ours.empty()) return false;
  return (uint8_t(ra[0]) & 0x0f) == (uint8_t(ours[0]) & 0x0f);
}

// Whether RMA get on this endpoint avoids tcp (shared memory, cma, RDMA): then a plain
// get is fast; over tcp UCX's get runs at a fraction of put (see ANCHORS.md).
int get_is_fast(ucp_ep_h ep) {
  ucp_transport_entry_t entries[32];
  ucp_ep_attr_t attr;
  memset(&attr, 0, sizeof attr);
  attr.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS;
  attr.transports.entries = entries;
  attr.transports.num_entries = 32;
  attr.transports.entry_size = sizeof(ucp_transport_entry_t);
  if (ucp_ep_query(ep, &attr) != UCS_OK) return -1;
  bool other = false;
  for (unsigned i = 0; i < attr.transports.num_entries; ++i) {
    const char* t = entries[i].transport_name;
    if (t && strcmp(t, "tcp") != 0 && strcmp(t, "self") != 0) other = true;
  }
  return other ? 1 : 0;
}

void set_host(EngineCore* c, Peer* p, const ParsedAddress& pa) {
  p->same_host_ = !pa.host_id.empty() && pa.host_id == c->host_id && pa.start_time != 0;
  const std::string& m = c->cfg.error_mode;
  p->err_peer_ = m == "peer" || (m == "auto" && c->cfg.protocol == "rdma" && !p->same_host_);
  p->pid_ = pa.pid;
  p->start_time_ = pa.start_time;
}

// The live peer for a parsed address, or a new one (no endpoints yet).
std::shared_ptr<Peer> peer_for(EngineCore* c, const ParsedAddress& pa, const std::string& addr) {
  std::lock_guard<std::mutex> g(c->peers_mu);
  auto it = c->peers.find(pa.uid);
  if (it != c->peers.end() && !it->second->dead_.load()) return it->second;
  auto peer = std::make_shared<Peer>(c->shared_from_this(), pa.uid, addr, pa.lanes, pa.name);
  set_host(c, peer.get(), pa);
  c->init_peer_tokens(peer.get());
  if (peer->same_host_ && process_start_time(pa.pid) != pa.start_time)
    throw Error(Code::kUnreachable, "peer '" + pa.name + "' (pid " + std::to_string(pa.pid) + ") is not running");
  c->peers[pa.uid] = peer;
  return peer;
}

// Maps [offset, offset + len) of a shared file into rr (a page-aligned mapping, the range
// at its skew); false where mmap fails (errno set).
bool map_file_range(RemoteRegion* rr, int fd, uint64_t offset, uint64_t len) {
  const uint64_t page = uint64_t(sysconf(_SC_PAGESIZE));
  const uint64_t start = offset / page * page, skew = offset - start;
  void* m = mmap(nullptr, len + skew, PROT_READ | PROT_WRITE, MAP_SHARED, fd, off_t(start));
  if (m == MAP_FAILED) return false;
  rr->file_map_ = m;
  rr->file_map_len_ = len + skew;
  rr->ptr_ = static_cast<char*>(m) + skew;
  return true;
}

void close_ep(void* ep, bool err_peer) {
  ucp_request_param_t rp;
  memset(&rp, 0, sizeof rp);
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  rp.flags = err_peer ? UCP_EP_CLOSE_FLAG_FORCE : 0;  // FORCE needs error mode PEER
  void* r = ucp_ep_close_nbx(static_cast<ucp_ep_h>(ep), &rp);
  if (UCS_PTR_IS_PTR(r)) ucp_request_free(r);
}
}  // namespace

// ---- Peer ---------------------------------------------------------------------------

Peer::Peer(std::shared_ptr<EngineCore> core, uint64_t uid, std::string address,
           std::vector<std::string> lane_addrs, std::string name)
    : core_(std::move(core)),
      uid_(uid),
      address_(std::move(address)),
      lane_addrs_(std::move(lane_addrs)),
      name_(std::move(name)) {
  size_t n = core_->lanes.size();
  eps_.assign(n, nullptr);
  ep_ctx_.assign(n, nullptr);
  get_fast_.assign(n, -1);
  push_rkeys_.resize(n);
}

Peer::~Peer() {
  for (void* c : ep_ctx_) delete static_cast<EpCtx*>(c);
}

std::shared_ptr<Peer> EngineCore::find_peer(uint64_t id) {
  std::lock_guard<std::mutex> g(peers_mu);
  auto it = peers.find(id);
  if (it == peers.end() || it->second->dead_.load()) return nullptr;
  return it->second;
}

ucs_status_t EngineCore::create_ep_locked(Lane* lane, Peer* peer) {
  if (peer->eps_[lane->idx]) return UCS_OK;
  auto* ctx = static_cast<EpCtx*>(peer->ep_ctx_[lane->idx]);
  if (!ctx) {
    ctx = new EpCtx{this, peer, lane->idx};
    peer->ep_ctx_[lane->idx] = ctx;
  }
  if (peer->lane_addrs_.empty()) return UCS_ERR_INVALID_ADDR;
  const std::string& ra = peer->lane_addrs_[lane->idx % peer->lane_addrs_.size()];
  if (!plausible_worker_address(ra, lane->worker_address)) return UCS_ERR_INVALID_ADDR;
  ucp_ep_params_t p;
  memset(&p, 0, sizeof p);
  p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                 UCP_EP_PARAM_FIELD_ERR_HANDLER;
  p.address = reinterpret_cast<const ucp_address_t*>(ra.data());
  p.err_mode = peer->err_peer_ ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  p.err_handler.cb = on_ep_error;
  p.err_handler.arg = ctx;
  ucp_ep_h ep = nullptr;
  ucs_status_t st = ucp_ep_create(lane->worker, &p, &ep);
  if (st != UCS_OK) return st;
  peer->eps_[lane->idx] = ep;
  peer->get_fast_[lane->idx] = get_is_fast(ep);
  return UCS_OK;
}

std::shared_ptr<Peer> EngineCore::peer_from_hello(uint64_t id, const std::string& addr) {
  std::lock_guard<std::mutex> g(peers_mu);
  auto it = peers.find(id);
  if (it != peers.end() && !it->second->dead_.load()) return it->second;
  ParsedAddress pa = parse_address(addr);
  if (pa.uid != id) throw Error(Code::kInvalidArgument, "HELLO address does not match its uid");
  auto p = std::make_shared<Peer>(shared_from_this(), id, addr, pa.lanes, pa.name);
  set_host(this, p.get(), pa);
  init_peer_tokens(p.get());
  p->hello_done_.store(true);  // it connected to us: it has endpoints on all its lanes
  peers[id] = p;
  return p;
}

std::shared_ptr<Peer> EngineCore::connect(const std::string& addr, double timeout_s) {
  ActiveGuard guard(this);
  ParsedAddress pa = parse_address(addr);
  std::shared_ptr<Peer> peer = peer_for(this, pa, addr);
  if (peer->hello_done_.load()) {
    bool complete = true;
    for (auto& l : lanes) {
      std::lock_guard<std::mutex> g(l->mu);
      if (!peer->eps_[l->idx]) complete = false;
    }
    if (complete) return peer;
  }
  std::lock_guard<std::mutex> hg(peer->hello_mu_);
  for (auto& l : lanes) {
    std::lock_guard<std::mutex> g(l->mu);
    ucs_status_t st = create_ep_locked(l.get(), peer.get());
    if (st != UCS_OK) {
      std::string msg = ucs_msg(("connect to '" + pa.name + "'").c_str(), st);
      peer_failed(peer.get(), Code::kUnreachable, msg);
      throw Error(Code::kUnreachable, msg);
    }
  }
  if (peer->hello_done_.load()) return peer;

  // A handshake on every lane: the remote creates its endpoints back to us, then
  // acknowledges. With a secret: AUTH1/AUTH_RESP/AUTH2 (auth.cpp); without: one HELLO.
  auto op = std::make_shared<Op>(shared_from_this());
  std::vector<uint64_t> ids;
  const bool auth = auth_on();
  for (auto& l : lanes) {
    uint64_t id = next_id.fetch_add(1);
    ids.push_back(id);
    op->add_lane(l->idx);
    op->add_pending();
    add_pending(id, Pending{op, peer->uid_, {}, false});
    ucs_status_t err = UCS_OK;
    bool ok;
    {
      std::lock_guard<std::mutex> g(l->mu);
      void* ep = peer->eps_[l->idx];
      if (auth) {
        ok = send_auth1_locked(l.get(), peer, id, &err);
      } else {
        HelloHdr h{uid, id};
        ok = ep && am_send_locked(this, l.get(), ep, kAmHello, &h, sizeof h, address, id, true, &err);
        if (!ep) err = UCS_ERR_NOT_CONNECTED;
      }
    }
    if (!ok) {
      Pending p;
      if (take_pending(id, &p)) p.op->sub_done(Code::kUnreachable, ucs_msg("HELLO", err));
    }
  }
  op->sub_done();
  bool in_time = op->wait(timeout_s);
  if (auth) {
    std::lock_guard<std::mutex> g(auth_mu);
    for (uint64_t id : ids) handshakes.erase(id);
  }
  if (!in_time) {
    for (uint64_t id : ids) {
      Pending p;
      take_pending(id, &p);
    }
    std::string msg = "peer '" + pa.name + "' did not answer the connection handshake within " +
                      std::to_string(timeout_s) + " s";
    peer_failed(peer.get(), Code::kUnreachable, msg);
    throw Error(Code::kUnreachable, msg);
  }
  if (op->code() != Code::kOk) {
    peer_failed(peer.get(), op->code(), op->message());
    throw Error(op->code() == Code::kAuthFailed ? Code::kAuthFailed : Code::kUnreachable,
                "connect to '" + pa.name + "' failed: " + op->message());
  }
  peer->hello_done_.store(true);
  return peer;
}

void EngineCore::finish_hello_locked(Lane* lane, uint64_t id, uint64_t call_id,
                                     const std::string& addr) {
  std::shared_ptr<Peer> peer;
  try {
    peer = peer_from_hello(id, addr);
  } catch (const Error&) {
    st.malformed_dropped.fetch_add(1);
    return;  // malformed: ignored
  }
  ucs_status_t st_ = create_ep_locked(lane, peer.get());
  if (st_ != UCS_OK) {
    if (st_ == UCS_ERR_INVALID_ADDR) st.malformed_dropped.fetch_add(1);
    peer_failed(peer.get(), Code::kUnreachable, ucs_msg("endpoint back to caller", st_));
    return;
  }
  st.hs_acks_sent.fetch_add(1);
  send_reply_locked(lane, peer.get(), call_id, Code::kOk, std::string(), kAmHelloAck);
}

void EngineCore::debug_send_raw(const std::string& addr, unsigned am_id, const std::string& header,
                                const std::string& data) {
  ActiveGuard guard(this);
  std::shared_ptr<Peer> peer = peer_for(this, parse_address(addr), addr);
  Lane* l = lanes[0].get();
  std::lock_guard<std::mutex> g(l->mu);
  ucs_status_t st_ = create_ep_locked(l, peer.get());
  if (st_ != UCS_OK) throw Error(Code::kUnreachable, ucs_msg("debug_send_raw", st_));
  ucs_status_t err = UCS_OK;
  if (!am_send_locked(this, l, peer->eps_[0], am_id, header.data(), header.size(), data, 0, true, &err))
    throw Error(Code::kUnreachable, ucs_msg("debug_send_raw", err));
}

namespace {
// A UCP generic datatype whose packing kills the process: UCX calls pack() after it has
// taken its place in the transport (mm: a slot of the receiver's FIFO).
void* die_start_pack(void*, const void* buf, size_t) { return const_cast<void*>(buf); }
size_t die_packed_size(void*) { return 512; }
size_t die_pack(void*, size_t, void* dest, size_t max) {
  memset(dest, 0x5a, std::min<size_t>(max, 64));  // half a message
  raise(SIGKILL);
  return 0;
}
void die_finish(void*) {}
}  // namespace

void EngineCore::debug_die_mid_message(const std::string& addr) {
  std::shared_ptr<Peer> peer = connect(addr, 10.0);
  Lane* l = lanes[0].get();
  std::lock_guard<std::mutex> g(l->mu);
  ucp_generic_dt_ops_t ops;
  memset(&ops, 0, sizeof ops);
  ops.start_pack = die_start_pack;
  ops.packed_size = die_packed_size;
  ops.pack = die_pack;
  ops.finish = die_finish;
  ucp_datatype_t dt;
  if (ucp_dt_create_generic(&ops, nullptr, &dt) != UCS_OK) abort();
  ucp_request_param_t rp;
  memset(&rp, 0, sizeof rp);
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_FLAGS;
  rp.datatype = dt;
  rp.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_COPY_HEADER;
  static char one;
  RpcReqHdr h;
  memset(&h, 0, sizeof h);
  ucp_am_send_nbx(static_cast<ucp_ep_h>(peer->eps_[0]), kAmRpcReq, &h, sizeof h, &one, 1, &rp);
  for (;;) l->progress_locked();
}

void EngineCore::peer_failed(Peer* peer, Code code, const std::string& msg) {
  if (peer->dead_.exchange(true)) return;
  peer->death_code_ = code;
  peer->death_msg_ = msg;
  st.peers_failed.fetch_add(1);
  std::shared_ptr<Peer> sp;
  {
    std::lock_guard<std::mutex> g(peers_mu);
    auto it = peers.find(peer->uid_);
    if (it != peers.end() && it->second.get() == peer) {
      sp = it->second;
      peers.erase(it);
    }
  }
  fail_pending_for(peer->uid_, Code::kUnreachable, msg);
  orphan_xfers(peer, msg);
  if (!sp) return;  // already detached (engine closing)
  {
    std::lock_guard<std::mutex> g(sp->rr_mu_);
    sp->rr_cache_.clear();
  }
  // Close the endpoints on their own lanes (we may hold only one lane's lock here).
  for (auto& l : lanes) {
    Lane* lp = l.get();
    lp->post_task([sp, lp] {
      void* ep = sp->eps_[lp->idx];
      sp->eps_[lp->idx] = nullptr;
      for (auto& kv : sp->push_rkeys_[lp->idx]) destroy_push_rkey(kv.second);
      sp->push_rkeys_[lp->idx].clear();
      if (ep) close_ep(ep, sp->err_peer_);
    });
  }
}

std::string local_host_id() {
  std::string id;
  if (FILE* f = fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char buf[64] = {0};
    if (fgets(buf, sizeof buf, f)) id = buf;
    fclose(f);
    while (!id.empty() && (id.back() == '\n' || id.back() == ' ')) id.pop_back();
  }
  char ns[128] = {0};
  ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
  if (n > 0) id += "|" + std::string(ns, size_t(n));
  return id;
}

uint64_t process_start_time(uint32_t pid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%u/stat", pid);
  FILE* f = fopen(path, "r");
  if (!f) return 0;
  char buf[1024];
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  // Fields after the command name (which may contain spaces) start after the last ')'.
  const char* p = strrchr(buf, ')');
  if (!p) return 0;
  char state = 0;
  unsigned long long start = 0;
  // state(3) ... starttime(22): skip fields 4..21
  if (sscanf(p + 2, "%c %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %llu",
             &state, &start) != 2)
    return 0;
  if (state == 'Z' || state == 'X') return 0;
  return start;
}

bool Peer::check_process() {
  if (dead_.load()) return false;
  if (same_host_ && process_start_time(pid_) != start_time_) {
    core_->peer_failed(this, Code::kUnreachable,
                       "peer '" + name_ + "' (pid " + std::to_string(pid_) + ") exited");
    return false;
  }
  return true;
}

void EngineCore::watch_peers() {
  auto now = Clock::now();
  auto every = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(std::max(0.01, cfg.keepalive_s / 2)));
  if (now - last_watch < every) return;
  last_watch = now;
  std::vector<std::shared_ptr<Peer>> local;
  {
    std::lock_guard<std::mutex> g(peers_mu);
    for (auto& kv : peers)
      if (kv.second->same_host_) local.push_back(kv.second);
  }
  for (auto& p : local) {
    if (process_start_time(p->pid_) != p->start_time_)
      peer_failed(p.get(), Code::kUnreachable,
                  "peer '" + p->name_ + "' (pid " + std::to_string(p->pid_) + ") exited");
  }
}

// ---- remote regions -----------------------------------------------------------------

RemoteRegion::RemoteRegion(std::shared_ptr<Peer> peer, std::string rkey, uint64_t base,
                           uint64_t len)
    : peer_(std::move(peer)), rkey_bytes_(std::move(rkey)), base_(base), length_(len) {}

void RemoteRegion::unpin_cuda_locked() {
  std::lock_guard<std::mutex> g(cuda_mu_);
  if (cuda_pinned_ == 1 && ptr_) cuda::host_unregister(ptr_);
  cuda_pinned_ = 0;
}

RemoteRegion::~RemoteRegion() {
  std::unique_lock<std::shared_mutex> lk(mu_);
  if (destroyed_) return;
  destroyed_ = true;
  unpin_cuda_locked();
  if (file_map_) {
    munmap(file_map_, file_map_len_);
    file_map_ = nullptr;
    ptr_ = nullptr;
  }
  if (cuda_base_) {
    cuda::ipc_close(cuda_base_);
    cuda_ptr_ = cuda_base_ = 0;
  }
  auto core = peer_ ? peer_->core_ : nullptr;
  if (!core) return;
  for (size_t i = 0; i < rkeys_.size() && i < core->lanes.size(); ++i) {
    if (!rkeys_[i]) continue;
    void* rk = rkeys_[i];
    core->lanes[i]->post_task([rk] { ucp_rkey_destroy(static_cast<ucp_rkey_h>(rk)); });
  }
}

std::shared_ptr<RemoteRegion> EngineCore::import_remote(const std::shared_ptr<Peer>& peer,
                                                        const std::string& rkey, uint64_t base,
                                                        uint64_t len, const std::string& map_path,
                                                        uint64_t map_offset, bool populate) {
  ActiveGuard guard(this);
  if (!peer) throw Error(Code::kInvalidArgument, "peer is None");
  if (peer->core_.get() != this) throw Error(Code::kInvalidArgument, "peer belongs to another engine");
  if (peer->dead_.load()) throw Error(Code::kUnreachable, peer->death_msg_);
  if (rkey.empty()) throw Error(Code::kNotRegistered, "empty remote key");
  if (base + len < base) throw Error(Code::kOutOfBounds, "remote range wraps around");
  std::string ucx_rkey = rkey;
  HostShm shm;
  const bool has_shm = host_shm_split(&ucx_rkey, &shm);  // an arena in a memfd
  const std::string ipc = cuda::ipc_split(&ucx_rkey);  // a device region's CUDA IPC handle
  std::string key = rkey;
  key.append(reinterpret_cast<const char*>(&base), 8);
  key.append(reinterpret_cast<const char*>(&len), 8);
  {
    std::lock_guard<std::mutex> g(peer->rr_mu_);
    auto it = peer->rr_cache_.find(key);
    if (it != peer->rr_cache_.end()) return it->second;
  }
  auto rr = std::make_shared<RemoteRegion>(peer, rkey, base, len);
  rr->rkeys_.assign(lanes.size(), nullptr);
  for (auto& l : lanes) {
    std::lock_guard<std::mutex> g(l->mu);
    void* ep = peer->eps_[l->idx];
    if (!ep) throw Error(Code::kUnreachable, "peer '" + peer->name_ + "' is not connected");
    ucp_rkey_h rk = nullptr;
    ucs_status_t s = ucp_ep_rkey_unpack(static_cast<ucp_ep_h>(ep), ucx_rkey.data(), &rk);
    if (s != UCS_OK) throw Error(Code::kNotRegistered, ucs_msg("ucp_ep_rkey_unpack", s));
    rr->rkeys_[l->idx] = rk;
  }
  // Same host and shared memory: map the owner's memory directly.
  void* p0 = nullptr;
  void* p1 = nullptr;
  if (len > 0 && ucp_rkey_ptr(static_cast<ucp_rkey_h>(rr->rkeys_[0]), base, &p0) == UCS_OK &&
      ucp_rkey_ptr(static_cast<ucp_rkey_h>(rr->rkeys_[0]), base + len - 1, &p1) == UCS_OK &&
      static_cast<char*>(p1) == static_cast<char*>(p0) + (len - 1) &&
      cuda::device_of(reinterpret_cast<uintptr_t>(p0)) < 0) {  // a mapping of host memory only
    rr->ptr_ = static_cast<char*>(p0);
  } else if (len > 0 && !map_path.empty()) {
    // The owner registered a file in shared memory (a store node's arena that outlives its
    // process): UCX will not map registered memory, so map the same file here.
    int fd = ::open(map_path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) throw Error(Code::kInvalidArgument, "cannot open " + map_path + ": " + strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || uint64_t(st.st_size) < map_offset + len) {
      ::close(fd);
      throw Error(Code::kOutOfBounds, map_path + " is smaller than the remote region");
    }
    const bool mapped = map_file_range(rr.get(), fd, map_offset, len);
    ::close(fd);
    if (!mapped) throw Error(Code::kInternal, "mmap " + map_path + ": " + strerror(errno));
    p0 = rr->ptr_;
  } else if (len > 0 && has_shm && peer->same_host_ && shm.pid == peer->pid_ && base >= shm.addr &&
             base - shm.addr <= shm.len && len <= shm.len - (base - shm.addr) &&
             cfg.protocol != "tcp") {
    // The owner's arena in a memfd: mapped here through its /proc entry, once the inode
    // shows it is that memfd (another PID namespace's pid could name another process).
    // Where it cannot be opened the region is read and written through UCX instead.
    const std::string path = "/proc/" + std::to_string(shm.pid) + "/fd/" + std::to_string(shm.fd);
    int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    struct stat st;
    if (fd >= 0 && fstat(fd, &st) == 0 && uint64_t(st.st_ino) == shm.ino &&
        uint64_t(st.st_size) >= shm.len && map_file_range(rr.get(), fd, base - shm.addr, len))
      p0 = rr->ptr_;
    if (fd >= 0) ::close(fd);
  }
  if (!ipc.empty() && !rr->ptr_ && len > 0 && peer->same_host_ && cfg.protocol != "tcp" &&
      cuda::available()) {
    // The owner's device memory on this host: mapped here, copied by the driver (a
    // batched call for a whole transfer, where UCX's cuda_ipc pays about 7 us a copy).
    uintptr_t b = 0;
    uintptr_t p = cuda::ipc_open(ipc, len, &b);
    if (p) rr->cuda_ptr_ = p, rr->cuda_base_ = b;
  }
  if (rr->ptr_ && populate) {
    // This process's mapping of the owner's memory starts with empty page tables: every
    // first touch of a 4 KiB page is a minor fault (~1024 per 4 MiB written, measured to
    // cost as much as the copy). Populate them once, now, not on the data path.
    madvise(reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(p0) & ~uintptr_t(4095)),
            len + (reinterpret_cast<uintptr_t>(p0) & 4095), 23 /* MADV_POPULATE_WRITE */);
  }
  int fast = peer->get_fast_[0];
  switch (cfg.read_mode) {
    case ReadPath::kAuto:
      rr->read_path_ = rr->ptr_ ? ReadPath::kMemcpy : (fast == 0 ? ReadPath::kPush : ReadPath::kGet);
      break;
    case ReadPath::kMemcpy:
      if (!rr->ptr_)
        throw Error(Code::kInvalidArgument,
                    "read_mode='memcpy' but the remote region cannot be mapped (not the same "
                    "host, not shared memory, or not allocated by UCX)");
      rr->read_path_ = ReadPath::kMemcpy;
      break;
    default: rr->read_path_ = cfg.read_mode;
  }
  switch (cfg.write_mode) {
    case WritePath::kAuto: rr->write_path_ = rr->ptr_ ? WritePath::kMemcpy : WritePath::kPut; break;
    case WritePath::kMemcpy:
      if (!rr->ptr_)
        throw Error(Code::kInvalidArgument, "write_mode='memcpy' but the remote region cannot be mapped");
      rr->write_path_ = WritePath::kMemcpy;
      break;
    default: rr->write_path_ = cfg.write_mode;
  }
  {
    std::lock_guard<std::mutex> g(peer->rr_mu_);
    auto it = peer->rr_cache_.find(key);
    if (it != peer->rr_cache_.end()) return it->second;  // lost a race: ours is dropped
    if (peer->rr_cache_.size() >= 4096) peer->rr_cache_.erase(peer->rr_cache_.begin());
    peer->rr_cache_[key] = rr;
  }
  {
    std::lock_guard<std::mutex> g(rr_all_mu);
    if (rr_all.size() > 1024) {
      std::vector<std::weak_ptr<RemoteRegion>> keep;
      for (auto& w : rr_all)
        if (!w.expired()) keep.push_back(w);
      rr_all.swap(keep);
    }
    rr_all.push_back(rr);
  }
  return rr;
}

const char* read_path_name(ReadPath p) {
  switch (p) {
    case ReadPath::kAuto: return "auto";
    case ReadPath::kMemcpy: return "memcpy";
    case ReadPath::kPush: return "push";
    case ReadPath::kGet: return "get";
  }
  return "?";
}

const char* write_path_name(WritePath p) {
  switch (p) {
    case WritePath::kAuto: return "auto";
    case WritePath::kMemcpy: return "memcpy";
    case WritePath::kPut: return "put";
  }
  return "?";
}

}  // namespace mcr
