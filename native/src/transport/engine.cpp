// Engine lifecycle: UCP context and workers, progress threads, shutdown.
//
// Progress model. Each lane has one worker and one progress thread that sleeps in
// epoll on the worker's event fd (ucp_worker_get_efd + ucp_worker_arm) plus an eventfd
// for wake-ups, so an idle engine costs no CPU. A thread waiting for its own operation
// first progresses the lane itself for a short while (Op::wait, cfg.spin_us): for a
// round trip of a few µs that avoids two thread wake-ups. Whoever stops progressing a
// lane leaves its worker armed (Lane::arm_for_sleep), so the sleeping progress thread is
// woken by the next event whichever thread consumed the previous one.
#include <sys/mman.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <openssl/rand.h>
#include <ucs/debug/log_def.h>

#include <cstdarg>
#include <cstring>
#include <random>

#include "internal.h"
#include "mcr/cuda.h"

namespace mcr {

namespace {
thread_local int tl_in_progress = 0;  // >0 while this thread runs UCP progress/callbacks

void put_u32(std::string* s, uint32_t v) { s->append(reinterpret_cast<char*>(&v), 4); }
void put_u64(std::string* s, uint64_t v) { s->append(reinterpret_cast<char*>(&v), 8); }

// Session tokens are derived from the two engines' uids (auth.cpp): drawn from the
// system's CSPRNG.
uint64_t random_uid() {
  uint64_t v = 0;
  if (RAND_bytes(reinterpret_cast<unsigned char*>(&v), sizeof v) != 1) {
    std::random_device rd;
    v = (uint64_t(rd()) << 32) ^ rd() ^ uint64_t(Clock::now().time_since_epoch().count());
  }
  return v ? v : 1;
}

// UCX's shared-memory FIFO transports (posix, sysv, xpmem) carry messages through one queue
// per receiving worker that all its senders share: a sender takes a slot, fills it, then
// marks it full. A sender killed in between (SIGKILL, the OOM killer) leaves a slot that is
// never marked, the receiver reads nothing behind it from anyone again, and its progress
// thread spins (ucp_worker_arm answers BUSY for ever). Engines here belong to processes that
// die on their own (a client, a restarted master), so no engine takes messages that way:
// they go over tcp (loopback on one host); bulk data on one host still moves through shared
// memory, by cross-memory attach (cma) and the mapped arenas. docs/internals.md, "Messages
// and dying senders"; tests/native/test_faults.py kills a sender inside that window.
const char* tls_for(const std::string& protocol) {
  if (protocol == "auto") return "^posix,sysv,xpmem";  // every transport UCX has but those
  if (protocol == "tcp") return "tcp";
  if (protocol == "shm") return "cma,tcp,self";  // messages over tcp on `lo` (start())
  if (protocol == "rdma") return "rc,ud,cma,self";
  throw Error(Code::kBadConfig,
              "protocol must be one of auto, tcp, shm, rdma; got '" + protocol + "'");
}
}  // namespace

bool in_progress_context() { return tl_in_progress > 0; }

std::atomic<uint64_t> g_ucx_quieted{0};

namespace {
// UCX logs a peer going away (reset, refused, unreachable) at ERROR level from inside
// the library. For us that is an expected event, reported to the caller as
// NodeUnavailableError: keep it out of the logs (counted in stats()["ucx_errors_quieted"]).
ucs_log_func_rc_t quiet_peer_errors(const char*, unsigned, const char*, ucs_log_level_t level,
                                    const ucs_log_component_config_t*, const char* fmt,
                                    va_list ap) {
  if (level > UCS_LOG_LEVEL_WARN) return UCS_LOG_FUNC_RC_CONTINUE;
  char buf[512];
  va_list copy;
  va_copy(copy, ap);
  vsnprintf(buf, sizeof buf, fmt, copy);
  va_end(copy);
  static const char* expected[] = {"Connection reset by remote peer", "Connection refused",
                                   "Destination is unreachable", "Broken pipe",
                                   "Endpoint timeout", "error during flush"};
  for (const char* e : expected) {
    if (strstr(buf, e)) {
      g_ucx_quieted.fetch_add(1);
      return UCS_LOG_FUNC_RC_STOP;
    }
  }
  return UCS_LOG_FUNC_RC_CONTINUE;
}
}  // namespace

Code code_from_ucs(ucs_status_t st) {
  switch (st) {
    case UCS_OK: return Code::kOk;
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_CANCELED:
    case UCS_ERR_IO_ERROR:
      return Code::kUnreachable;
    case UCS_ERR_TIMED_OUT: return Code::kTimeout;
    default: return Code::kTransferFailed;
  }
}

std::string ucs_msg(const char* what, ucs_status_t st) {
  return std::string(what) + ": " + ucs_status_string(st);
}

ActiveGuard::ActiveGuard(EngineCore* c) : c_(c) {
  c_->active.fetch_add(1);
  if (c_->closing.load()) {
    c_->active.fetch_sub(1);
    throw Error(Code::kShutdown, "engine '" + c_->cfg.name + "' is closed");
  }
}

// ---- Lane ---------------------------------------------------------------------------

void Lane::progress_locked() {
  ++tl_in_progress;
  for (;;) {
    while (ucp_worker_progress(worker) != 0) {
    }
    if (deferred.empty()) break;
    std::vector<std::function<void()>> work;
    work.swap(deferred);
    for (auto& fn : work) fn();
  }
  --tl_in_progress;
}

bool Lane::try_progress() {
  if (!mu.try_lock()) return false;
  if (!stop && worker) progress_locked();
  mu.unlock();
  return true;
}

void Lane::arm_for_sleep() {
  std::lock_guard<std::mutex> g(mu);
  if (stop || !worker) return;
  for (int i = 0; i < 1000; ++i) {
    progress_locked();
    if (ucp_worker_arm(worker) != UCS_ERR_BUSY) return;
  }
}

void Lane::wake() {
  uint64_t one = 1;
  ssize_t rc = ::write(wake_fd, &one, sizeof one);
  (void)rc;
}

void Lane::post_task(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> g(task_mu);
    if (tasks_closed) return;  // engine closed: its close() released everything
    tasks.push_back(std::move(fn));
  }
  wake();
}

void Lane::run_tasks_locked() {
  std::vector<std::function<void()>> work;
  {
    std::lock_guard<std::mutex> g(task_mu);
    work.swap(tasks);
  }
  ++tl_in_progress;
  for (auto& fn : work) fn();
  --tl_in_progress;
}

unsigned Lane::progress_count_locked() {
  ++tl_in_progress;
  unsigned total = 0;
  for (;;) {
    unsigned n;
    while ((n = ucp_worker_progress(worker)) != 0) total += n;
    if (deferred.empty()) break;
    std::vector<std::function<void()>> work;
    work.swap(deferred);
    total += unsigned(work.size());
    for (auto& fn : work) fn();
  }
  --tl_in_progress;
  return total;
}

bool Lane::begin_caller_poll() {
  if (thread_polling.load()) return false;  // the progress thread is already polling
  std::lock_guard<std::mutex> g(poll_mu);
  if (callers_polling++ == 0 && fd_watched) {
    // Keep the sleeping progress thread out while we poll: it would only wake up to
    // find the events consumed, and fight us for the lane lock.
    epoll_ctl(ep_fd, EPOLL_CTL_DEL, worker_fd, nullptr);
    fd_watched = false;
  }
  return true;
}

void Lane::end_caller_poll() {
  std::lock_guard<std::mutex> g(poll_mu);
  if (--callers_polling > 0) return;
  arm_for_sleep();
  epoll_event ev;
  memset(&ev, 0, sizeof ev);
  ev.events = EPOLLIN;
  ev.data.fd = worker_fd;
  epoll_ctl(ep_fd, EPOLL_CTL_ADD, worker_fd, &ev);
  fd_watched = true;
}

void Lane::run() {
  epoll_event evs[4];
  // Lingering after every event was measured to hurt clients: on 2 vCPUs the polling
  // thread competes with the Python dispatcher and the caller, who spins itself (spin_us).
  // Servers opt in (server_linger_us): their callers wait on them.
  const auto linger = std::chrono::microseconds(std::max(0, core->cfg.inflight_linger_us));
  const auto serve_linger = std::chrono::microseconds(std::max(0, core->cfg.server_linger_us));
  const int keepalive_ms = std::max(10, int(core->cfg.keepalive_s * 1000));
  // Polls until no event came for `idle` (serving: also runs posted tasks; otherwise also
  // stops once none of our requests is in flight).
  auto poll_until_idle = [this](std::chrono::microseconds idle, bool serving) {
    thread_polling.store(true);
    auto last = Clock::now();
    for (;;) {
      unsigned n;
      {
        std::lock_guard<std::mutex> g(mu);
        if (stop) break;
        if (serving) run_tasks_locked();
        n = progress_count_locked();
      }
      auto now = Clock::now();
      if (n) last = now;
      if ((!serving && outstanding.load() <= 0) || now - last > idle) break;
      __builtin_ia32_pause();
    }
    thread_polling.store(false);
  };
  for (;;) {
    ucs_status_t st;
    unsigned events;
    {
      std::unique_lock<std::mutex> g(mu);
      if (stop) return;
      run_tasks_locked();
      events = progress_count_locked();
    }
    // A server woken by work (a call, a get or push to serve) polls a little for the
    // next: a client in a loop sends it within microseconds, and a wake-up from epoll
    // costs tens of them on a VM. A steady stream keeps the thread polling.
    if (serve_linger.count() > 0 && events > 0) poll_until_idle(serve_linger, true);
    // While our own requests are in flight (a bulk transfer, a push being served), keep
    // polling as long as events keep coming: a wake-up per tcp segment would cost more
    // than the segment. Callers stay out meanwhile (thread_polling).
    if (outstanding.load() > 0 && linger.count() > 0) poll_until_idle(linger, false);
    {
      std::unique_lock<std::mutex> g(mu);
      if (stop) return;
      progress_locked();
      st = ucp_worker_arm(worker);
    }
    if (st == UCS_ERR_BUSY) continue;
    int timeout = -1;
    if (outstanding.load() > 0) {
      timeout = 20;  // safety tick while requests are in flight
    } else {
      std::lock_guard<std::mutex> g(core->peers_mu);
      if (!core->peers.empty()) timeout = keepalive_ms;  // drives UCX keepalive
    }
    // Lane 0 watches same-host peers' processes (watch_peers) every keepalive / 2, also
    // when it went to sleep with no peer yet: a peer added meanwhile whose traffic all
    // goes through other lanes would otherwise never be watched, and a call to it that
    // was in flight when it died waited for its own timeout (tests/native/test_faults.py).
    if (idx == 0 && (timeout < 0 || timeout > keepalive_ms / 2)) timeout = std::max(10, keepalive_ms / 2);
    int n = epoll_wait(ep_fd, evs, 4, timeout);
    if (idx == 0) core->watch_peers();
    for (int i = 0; i < n; ++i) {
      if (evs[i].data.fd == wake_fd) {
        uint64_t v;
        ssize_t rc = ::read(wake_fd, &v, sizeof v);
        (void)rc;
      }
    }
  }
}

// ---- EngineCore ---------------------------------------------------------------------

EngineCore::EngineCore(const EngineConfig& c) : cfg(c) {
  if (cfg.num_lanes < 1 || cfg.num_lanes > 16)
    throw Error(Code::kBadConfig, "num_lanes must be in [1, 16], got " + std::to_string(cfg.num_lanes));
  if (cfg.error_mode != "auto" && cfg.error_mode != "peer" && cfg.error_mode != "none")
    throw Error(Code::kBadConfig, "error_mode must be auto, peer or none; got '" + cfg.error_mode + "'");
  if (cfg.chunk_bytes < 4096)
    throw Error(Code::kBadConfig, "chunk_bytes must be >= 4096");
  uid = random_uid();
  // Call, push and region ids start at a random point: a reply names the call it answers,
  // and with ids counted from 1 a peer that claims another's uid (no secret to check it)
  // could have the callee send a reply the other is waiting for (the transport fuzz target
  // found one). Kept below 2^62 so they never wrap, never 0.
  next_id.store((random_uid() & ((1ull << 62) - 1)) | (1ull << 32));
  host_id = local_host_id();
  pid = uint32_t(getpid());
  start_time = process_start_time(pid);
  if (cfg.num_lanes > 1) copier = std::make_unique<CopyPool>(cfg.num_lanes - 1);
}

EngineCore::~EngineCore() { close(); }

void EngineCore::start() {
  static std::once_flag log_once;
  std::call_once(log_once, [] { ucs_log_push_handler(quiet_peer_errors); });
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) throw Error(Code::kBadConfig, ucs_msg("ucp_config_read", st));
  auto modify = [&](const std::string& k, const std::string& v) {
    ucs_status_t s = ucp_config_modify(config, k.c_str(), v.c_str());
    if (s != UCS_OK) {
      ucp_config_release(config);
      throw Error(Code::kBadConfig,
                  "UCX setting " + k + "=" + v + " rejected: " + ucs_status_string(s));
    }
  };
  const char* tls = tls_for(cfg.protocol);
  if (cfg.protocol != "auto") {
    // A named protocol still lets UCX move device memory where a GPU is there: its CUDA
    // transports join the list (without them UCX registers host memory only).
    std::string list = tls;
    if (cuda::available()) list += ",cuda_copy,cuda_ipc";
    modify("TLS", list);
  } else if (!getenv("UCX_TLS")) {
    modify("TLS", tls);  // a UCX_TLS the user set is theirs (ucx_options below too)
  }
  if (cfg.protocol == "shm" && cfg.devices.empty()) modify("NET_DEVICES", "lo");
  if (cuda::available() && !getenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY")) {
    // UCX turns cuda_ipc reads off where it sees no NVLink (one GPU; GPUs on PCIe), and a
    // read of another process's device memory then goes through host bounce buffers
    // (0.7 GB/s on an H200 for what is a device-to-device copy): turn them on, unless the
    // user chose (the environment, or ucx_options below). Older UCX without the setting
    // keeps its default.
    ucp_config_modify(config, "CUDA_IPC_ENABLE_GET_ZCOPY", "on");
  }
  if (!cfg.devices.empty()) {
    std::string devs;
    for (auto& d : cfg.devices) devs += (devs.empty() ? "" : ",") + d;
    modify("NET_DEVICES", devs);
  }
  char ka[64];
  snprintf(ka, sizeof ka, "%dms", std::max(10, int(cfg.keepalive_s * 1000)));
  modify("KEEPALIVE_INTERVAL", ka);
  // Endpoints run in error mode NONE (see Peer::err_peer_), where UCP sends no keepalive:
  // a peer host that vanishes without a reset is found by tcp's own keepalive instead.
  snprintf(ka, sizeof ka, "%dms", std::max(1000, int(cfg.keepalive_s * 2000)));
  modify("TCP_KEEPIDLE", ka);
  snprintf(ka, sizeof ka, "%dms", std::max(200, int(cfg.keepalive_s * 1000)));
  modify("TCP_KEEPINTVL", ka);
  for (auto& kv : cfg.ucx_options) {
    std::string k = kv.first.rfind("UCX_", 0) == 0 ? kv.first.substr(4) : kv.first;
    modify(k, kv.second);
  }

  ucp_params_t params;
  memset(&params, 0, sizeof params);
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED |
                      UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 1;
  params.name = cfg.name.c_str();
  st = ucp_init(&params, config, &ctx);
  ucp_config_release(config);
  if (st != UCS_OK)
    throw Error(Code::kBadConfig, ucs_msg(("ucp_init (protocol=" + cfg.protocol + ")").c_str(), st));
  auto holder = std::make_shared<CtxHolder>();
  holder->ctx = ctx;
  ctx_holder = holder;
  if (cfg.protocol == "rdma") {
    // UCX only warns when the requested transports are missing; a caller asking for RDMA
    // should learn it is not there.
    char* text = nullptr;
    size_t n = 0;
    FILE* f = open_memstream(&text, &n);
    ucp_context_print_info(ctx, f);
    fclose(f);
    std::string info(text ? text : "", n);
    free(text);
    if (info.find("rc_") == std::string::npos && info.find("ud_") == std::string::npos &&
        info.find("dc_") == std::string::npos)
      throw Error(Code::kBadConfig,
                  "protocol='rdma' but UCX found no RDMA transport (no InfiniBand/RoCE "
                  "device, or a UCX build without verbs: see MCR_UCX=system in CMakeLists.txt)");
  }

  for (int i = 0; i < cfg.num_lanes; ++i) {
    auto lane = std::make_unique<Lane>();
    lane->core = this;
    lane->idx = i;
    ucp_worker_params_t wp;
    memset(&wp, 0, sizeof wp);
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // Lane::mu serializes all access
    st = ucp_worker_create(ctx, &wp, &lane->worker);
    if (st != UCS_OK) {
      close();
      throw Error(Code::kBadConfig,
                  ucs_msg(("ucp_worker_create (protocol=" + cfg.protocol + ")").c_str(), st));
    }
    ucp_worker_attr_t wa;
    memset(&wa, 0, sizeof wa);
    wa.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
    st = ucp_worker_query(lane->worker, &wa);
    if (st != UCS_OK) {
      close();
      throw Error(Code::kInternal, ucs_msg("ucp_worker_query", st));
    }
    lane->worker_address.assign(reinterpret_cast<char*>(wa.address), wa.address_length);
    ucp_worker_release_address(lane->worker, wa.address);
    st = ucp_worker_get_efd(lane->worker, &lane->worker_fd);
    if (st != UCS_OK) {
      close();
      throw Error(Code::kInternal, ucs_msg("ucp_worker_get_efd", st));
    }
    lane->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    lane->ep_fd = epoll_create1(EPOLL_CLOEXEC);
    epoll_event ev;
    memset(&ev, 0, sizeof ev);
    ev.events = EPOLLIN;
    ev.data.fd = lane->worker_fd;
    epoll_ctl(lane->ep_fd, EPOLL_CTL_ADD, lane->worker_fd, &ev);
    ev.data.fd = lane->wake_fd;
    epoll_ctl(lane->ep_fd, EPOLL_CTL_ADD, lane->wake_fd, &ev);
    register_am_handlers(lane.get());
    lanes.push_back(std::move(lane));
  }

  // Address: magic | uid | nlanes | name | per lane: len + worker address.
  put_u32(&address, kAddrMagic);
  put_u64(&address, uid);
  put_u32(&address, uint32_t(lanes.size()));
  put_u32(&address, uint32_t(cfg.name.size()));
  address += cfg.name;
  put_u32(&address, uint32_t(host_id.size()));
  address += host_id;
  put_u32(&address, pid);
  put_u64(&address, start_time);
  for (auto& l : lanes) {
    put_u32(&address, uint32_t(l->worker_address.size()));
    address += l->worker_address;
  }
  for (auto& l : lanes) {
    Lane* lp = l.get();
    lp->thread = std::thread([lp] { lp->run(); });
  }
}

void EngineCore::check_open() const {
  if (closing.load()) throw Error(Code::kShutdown, "engine '" + cfg.name + "' is closed");
}

void EngineCore::close() {
  if (closing.exchange(true)) {
    while (!closed.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return;
  }
  {
    std::lock_guard<std::mutex> g(inq_mu);
    inq_cv.notify_all();
  }
  staging.shutdown();
  fail_pending_for(0, Code::kShutdown, "engine '" + cfg.name + "' closed");

  // Force-close every endpoint: outstanding requests complete with an error.
  std::vector<std::shared_ptr<Peer>> all;
  {
    std::lock_guard<std::mutex> g(peers_mu);
    for (auto& kv : peers) all.push_back(kv.second);
    peers.clear();
  }
  for (auto& p : all) {
    p->dead_.store(true);
    orphan_xfers(p.get(), "engine '" + cfg.name + "' closed");
  }
  for (auto& l : lanes) {
    if (!l->worker) continue;
    std::lock_guard<std::mutex> g(l->mu);
    std::vector<void*> reqs;
    for (auto& p : all) {
      if (size_t(l->idx) >= p->eps_.size() || !p->eps_[l->idx]) continue;
      ucp_request_param_t rp;
      memset(&rp, 0, sizeof rp);
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      rp.flags = p->err_peer_ ? UCP_EP_CLOSE_FLAG_FORCE : 0;  // FORCE needs mode PEER
      void* r = ucp_ep_close_nbx(static_cast<ucp_ep_h>(p->eps_[l->idx]), &rp);
      p->eps_[l->idx] = nullptr;
      if (UCS_PTR_IS_PTR(r)) reqs.push_back(r);
    }
    auto until = Clock::now() + std::chrono::milliseconds(500);
    for (void* r : reqs) {
      while (ucp_request_check_status(r) == UCS_INPROGRESS && Clock::now() < until)
        progress_locked_external(l.get());
      ucp_request_free(r);
    }
    progress_locked_external(l.get());
  }
  // Wait for API calls in flight (their operations have failed or completed by now).
  auto until = Clock::now() + std::chrono::seconds(5);
  while (active.load() > 0 && Clock::now() < until) {
    for (auto& l : lanes) l->try_progress();
    fail_pending_for(0, Code::kShutdown, "engine '" + cfg.name + "' closed");  // stragglers
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  for (auto& l : lanes) {
    {
      std::lock_guard<std::mutex> g(l->mu);
      l->stop = true;
    }
    if (l->wake_fd >= 0) l->wake();
    if (l->thread.joinable()) l->thread.join();
  }
  // Remote keys: imported regions still referenced from Python, and push caches.
  {
    std::lock_guard<std::mutex> g(rr_all_mu);
    for (auto& w : rr_all) {
      auto rr = w.lock();
      if (!rr) continue;
      std::unique_lock<std::shared_mutex> lk(rr->mu_);
      if (rr->destroyed_) continue;
      rr->destroyed_ = true;
      rr->unpin_cuda_locked();
      for (void* rk : rr->rkeys_)
        if (rk) ucp_rkey_destroy(static_cast<ucp_rkey_h>(rk));
      rr->rkeys_.clear();
      rr->ptr_ = nullptr;
      if (rr->file_map_) munmap(rr->file_map_, rr->file_map_len_);  // an owner's arena file
      rr->file_map_ = nullptr;
      if (rr->cuda_base_) cuda::ipc_close(rr->cuda_base_);  // an owner's device memory
      rr->cuda_ptr_ = rr->cuda_base_ = 0;
    }
    rr_all.clear();
  }
  for (auto& p : all) {
    std::lock_guard<std::mutex> g(p->rr_mu_);
    p->rr_cache_.clear();
  }
  for (auto& l : lanes) {
    std::lock_guard<std::mutex> g(l->mu);
    for (auto& p : all) {
      if (size_t(l->idx) >= p->push_rkeys_.size()) continue;
      for (auto& kv : p->push_rkeys_[l->idx]) destroy_push_rkey(kv.second);
      p->push_rkeys_[l->idx].clear();
    }
    std::vector<std::function<void()>> rest;
    {
      std::lock_guard<std::mutex> tg(l->task_mu);
      l->tasks_closed = true;
      rest.swap(l->tasks);
    }
    for (auto& fn : rest) fn();
    if (l->worker) progress_locked_external(l.get());
  }
  for (auto& l : lanes) {
    if (l->worker) ucp_worker_destroy(l->worker);
    l->worker = nullptr;
    if (l->ep_fd >= 0) ::close(l->ep_fd);
    if (l->wake_fd >= 0) ::close(l->wake_fd);
    l->ep_fd = l->wake_fd = -1;
  }
  // Local regions: unmapped now unless a view still uses them (then on the last drop).
  std::vector<std::shared_ptr<Region>> regs;
  {
    std::unique_lock<std::shared_mutex> g(regions_mu);
    for (auto& kv : regions)
      for (auto& r : kv.second) regs.push_back(r);
    regions.clear();
  }
  for (auto& r : regs) r->unmap_now();
  if (auto sreg = staging.region_ptr()) sreg->unmap_now();
  for (auto& p : all) p->core_.reset();  // break Peer <-> core cycles
  ctx_holder.reset();  // ucp_cleanup once the last region is unmapped
  ctx = nullptr;
  closed.store(true);
}

void EngineCore::progress_locked_external(Lane* l) { l->progress_locked(); }

// ---- Engine (public facade) ----------------------------------------------------------

Engine::Engine(const EngineConfig& cfg) : core_(std::make_shared<EngineCore>(cfg)) {
  core_->start();
}
Engine::~Engine() { close(); }
const std::string& Engine::address() const { return core_->address; }
uint64_t Engine::uid() const { return core_->uid; }
const EngineConfig& Engine::config() const { return core_->cfg; }
void Engine::close() {
  core_->close();
  std::lock_guard<std::mutex> g(core_->peers_mu);
  core_->peers.clear();
}
bool Engine::closed() const { return core_->closing.load(); }

std::shared_ptr<Region> Engine::alloc_arena(uint64_t size) {
  ActiveGuard g(core_.get());
  return core_->map_memory(0, size, true, MemType::kHost, true);
}
std::shared_ptr<Region> Engine::register_memory(uintptr_t addr, uint64_t length, MemType mt) {
  ActiveGuard g(core_.get());
  return core_->map_memory(addr, length, false, mt, true);
}
std::shared_ptr<Peer> Engine::connect(const std::string& address, double timeout_s) {
  return core_->connect(address, timeout_s);
}
std::shared_ptr<RemoteRegion> Engine::import_remote(const std::shared_ptr<Peer>& peer,
                                                    const std::string& rkey, uint64_t base,
                                                    uint64_t length, const std::string& map_path,
                                                    uint64_t map_offset, bool populate) {
  return core_->import_remote(peer, rkey, base, length, map_path, map_offset, populate);
}
std::shared_ptr<Op> Engine::submit(std::vector<IoOp>& ops, bool is_read) {
  return core_->submit(ops, is_read);
}
std::shared_ptr<Op> Engine::call_async(const std::shared_ptr<Peer>& peer, uint32_t handler_id,
                                       const char* data, size_t len) {
  return core_->call_async(peer, handler_id, data, len);
}
void Engine::serve_native(uint32_t handler_id, NativeHandler fn) {
  std::unique_lock<std::shared_mutex> g(core_->handlers_mu);
  core_->external_handlers.erase(handler_id);
  core_->native_handlers[handler_id] = std::move(fn);
}
void Engine::serve_external(uint32_t handler_id) {
  std::unique_lock<std::shared_mutex> g(core_->handlers_mu);
  core_->native_handlers.erase(handler_id);
  core_->external_handlers.insert(handler_id);
}
void Engine::unserve(uint32_t handler_id) {
  std::unique_lock<std::shared_mutex> g(core_->handlers_mu);
  core_->native_handlers.erase(handler_id);
  core_->external_handlers.erase(handler_id);
}
bool Engine::next_request(IncomingRequest* out, double timeout_s) {
  return core_->next_request(out, timeout_s);
}
void Engine::reply(const IncomingRequest& req, Code code, const char* data, size_t len) {
  core_->reply(req, code, data, len);
}

void Engine::set_auth_secret(const std::string& secret) { core_->set_auth_secret(secret); }
bool Engine::auth_enabled() const { return core_->auth_on(); }
void Engine::debug_send_raw(const std::string& address, unsigned am_id, const std::string& header,
                            const std::string& data) {
  core_->debug_send_raw(address, am_id, header, data);
}
void Engine::debug_die_mid_message(const std::string& address) { core_->debug_die_mid_message(address); }
std::pair<std::string, std::string> Engine::debug_last_auth2() const {
  std::lock_guard<std::mutex> g(core_->auth_mu);
  return {core_->debug_auth2_hdr, core_->debug_auth2_data};
}

std::vector<std::string> Engine::memory_types() const {
  ucp_context_attr_t a;
  memset(&a, 0, sizeof a);
  a.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  std::vector<std::string> out;
  if (!core_->ctx || ucp_context_query(core_->ctx, &a) != UCS_OK) return {"host"};
  for (int t = 0; t < UCS_MEMORY_TYPE_LAST; ++t)
    if (a.memory_types & (uint64_t(1) << t)) out.push_back(ucs_memory_type_names[t]);
  if (out.empty()) out.push_back("host");
  return out;
}

std::map<std::string, uint64_t> Engine::stats() const {
  const Stats& s = core_->st;
  std::map<std::string, uint64_t> m{
      {"read_memcpy_bytes", s.read_memcpy_bytes.load()},
      {"read_get_bytes", s.read_get_bytes.load()},
      {"read_push_bytes", s.read_push_bytes.load()},
      {"read_push_joined_bytes", s.read_push_joined_bytes.load()},
      {"read_cuda_bytes", s.read_cuda_bytes.load()},
      {"write_cuda_bytes", s.write_cuda_bytes.load()},
      {"cuda_pin_refused", s.cuda_pin_refused.load()},
      {"cuda_kernel_launches", s.cuda_kernel_launches.load()},
      {"pushes_sent", s.pushes_sent.load()},
      {"write_memcpy_bytes", s.write_memcpy_bytes.load()},
      {"write_put_bytes", s.write_put_bytes.load()},
      {"staged_bytes", s.staged_bytes.load()},
      {"push_served_bytes", s.push_served_bytes.load()},
      {"calls_sent", s.calls_sent.load()},
      {"calls_served", s.calls_served.load()},
      {"replies_off_lane", s.replies_off_lane.load()},
      {"write_gathered_bytes", s.write_gathered_bytes.load()},
      {"peers_failed", s.peers_failed.load()},
      {"auth_enabled", core_->auth_on() ? 1u : 0u},
      {"auth_rejected", s.auth_rejected.load()},
      {"auth_handshakes", s.auth_handshakes.load()},
      {"hs_auth1_received", s.hs_auth1_received.load()},
      {"hs_resp_received", s.hs_resp_received.load()},
      {"hs_acks_sent", s.hs_acks_sent.load()},
      {"malformed_dropped", s.malformed_dropped.load()},
      {"ucx_errors_quieted", g_ucx_quieted.load()},
  };
  {
    std::lock_guard<std::mutex> g(core_->peers_mu);
    m["peers"] = core_->peers.size();
  }
  {
    std::lock_guard<std::mutex> g(core_->pending_mu);
    m["pending"] = core_->pending.size();
  }
  return m;
}

}  // namespace mcr
