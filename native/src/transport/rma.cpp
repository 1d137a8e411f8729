// One-sided transfers: the read/write paths and the owner side of the push path.
//
// Paths (chosen per RemoteRegion in import_remote, overridable by read_mode/write_mode):
//   memcpy  same host, remote memory mapped through ucp_rkey_ptr: a plain memcpy in the
//           calling thread, nothing sent at all.
//   get     ucp_get_nbx (shared memory via cma, RDMA): fast where get is one-sided in
//           hardware or the kernel.
//   push    over tcp UCX's get is slow (0.9 vs 4.3 GB/s put), so the reader sends a small
//           PUSH request (its rkey + extents) and the owner's engine, in C++ on its progress
//           thread, ucp_put_nbx'es the extents into the reader's memory, flushes, replies.
//   put     writes without a mapping.
// Local memory: a registered Region is used in place (zero-copy; it stays mapped until
// the transfer completes, whatever close() says); unregistered memory bounces through
// the staging buffer, one piece (<= chunk_bytes) at a time.
// Striping: with num_lanes > 1, a transfer of at least stripe_min_bytes is split into
// max(num_lanes, ceil(len / chunk_bytes)) pieces dealt round-robin to the lanes.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>

#include "internal.h"
#include "mcr/cuda.h"

namespace mcr {

namespace {

struct PushRkey {
  ucp_rkey_h rk = nullptr;
  int busy = 0;  // pushes in flight using it (not evicted while > 0)
};

// One UCX request of a transfer. Resources (staging piece, region reference) are held
// until UCX hands the request back; the Op may be failed earlier (orphan_xfers, when the
// peer dies: under error mode NONE, UCX never completes e.g. an emulated get whose
// reply will not come).
struct XferCtx {
  EngineCore* core;
  std::shared_ptr<Op> op;
  Lane* lane;
  std::shared_ptr<Region> region;    // registered local memory: in-flight reference
  std::shared_ptr<RemoteRegion> rr;  // keeps the remote key alive
  int64_t stage_off = -1;
  uint64_t len = 0;
  uintptr_t copy_to = 0;             // read via staging: the user's destination
  std::shared_ptr<Peer> peer;        // set while registered in peer->xfers_
  std::atomic<int> state{0};         // 0 running, 1 completed by UCX, 2 orphaned
};

void finish_xfer(XferCtx* x, ucs_status_t st) {
  if (x->peer) {
    std::lock_guard<std::mutex> g(x->peer->xfer_mu_);
    x->peer->xfers_.erase(x);
  }
  int expected = 0;
  const bool orphaned = !x->state.compare_exchange_strong(expected, 1);
  Code code = st == UCS_OK ? Code::kOk : code_from_ucs(st);
  if (code != Code::kOk && x->core->closing.load()) code = Code::kShutdown;  // we cancelled it
  if (x->stage_off >= 0) {
    if (!orphaned && code == Code::kOk && x->copy_to && x->op->enter_copy()) {
      memcpy(reinterpret_cast<void*>(x->copy_to),
             reinterpret_cast<char*>(x->core->staging.region()->addr()) + x->stage_off, x->len);
      x->op->exit_copy();
    }
    x->core->staging.free(x->stage_off, x->len);
  }
  if (x->region) x->region->inflight_sub();
  x->lane->outstanding.fetch_sub(1);
  if (orphaned) {  // the op was failed already
    delete x;
    return;
  }
  std::string msg;
  if (code != Code::kOk) {
    msg = ucs_msg("transfer", st);
    if (x->rr && x->rr->peer_) msg += " (peer '" + x->rr->peer_->name() + "')";
  }
  x->op->sub_done(code, msg);
  delete x;
}

void on_xfer(void* req, ucs_status_t st, void* user) {
  finish_xfer(static_cast<XferCtx*>(user), st);
  ucp_request_free(req);
}

enum class Kind { kGet, kPut, kFlush };

// Posts one get / put / flush on `lane`; Lane::mu held. Takes ownership of x.
void post_locked(Kind kind, void* ep, void* rkey, uint64_t raddr, void* laddr, void* memh,
                 XferCtx* x) {
  ucp_request_param_t rp;
  memset(&rp, 0, sizeof rp);
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  rp.cb.send = on_xfer;
  rp.user_data = x;
  if (memh) {
    rp.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    rp.memh = static_cast<ucp_mem_h>(memh);
  }
  x->op->add_pending();
  x->lane->outstanding.fetch_add(1);
  if (x->peer) {  // registered before posting: the completion may run before we return
    std::lock_guard<std::mutex> g(x->peer->xfer_mu_);
    x->peer->xfers_.insert(x);
  }
  auto e = static_cast<ucp_ep_h>(ep);
  auto rk = static_cast<ucp_rkey_h>(rkey);
  void* r;
  switch (kind) {
    case Kind::kGet: r = ucp_get_nbx(e, laddr, x->len, raddr, rk, &rp); break;
    case Kind::kPut: r = ucp_put_nbx(e, laddr, x->len, raddr, rk, &rp); break;
    default: r = ucp_ep_flush_nbx(e, &rp); break;
  }
  if (UCS_PTR_IS_PTR(r)) return;
  finish_xfer(x, UCS_PTR_STATUS(r));
}

struct PushFlushCtx {
  EngineCore* core;
  Lane* lane;
  std::shared_ptr<Peer> peer;
  uint64_t call_id;
  std::vector<std::shared_ptr<Region>> refs;
  PushRkey* entry;
};

void push_flushed(PushFlushCtx* f, ucs_status_t st, bool in_callback) {
  for (auto& r : f->refs) r->inflight_sub();
  f->entry->busy--;
  Code code = st == UCS_OK ? Code::kOk : code_from_ucs(st);
  std::string msg = st == UCS_OK ? std::string() : ucs_msg("push to reader", st);
  EngineCore* c = f->core;
  Lane* lane = f->lane;
  auto peer = f->peer;
  uint64_t id = f->call_id;
  delete f;
  if (in_callback) {
    lane->deferred.push_back([c, lane, peer, id, code, msg] {
      c->send_reply_locked(lane, peer.get(), id, code, msg);
    });
  } else {
    c->send_reply_locked(lane, peer.get(), id, code, msg);
  }
}

void on_push_flushed(void* req, ucs_status_t st, void* user) {
  auto* f = static_cast<PushFlushCtx*>(user);
  f->lane->outstanding.fetch_sub(1);
  push_flushed(f, st, true);
  ucp_request_free(req);
}

}  // namespace

void EngineCore::orphan_xfers(Peer* peer, const std::string& msg) {
  std::vector<std::shared_ptr<Op>> fail;
  {
    std::lock_guard<std::mutex> g(peer->xfer_mu_);
    for (void* p : peer->xfers_) {
      auto* x = static_cast<XferCtx*>(p);
      int expected = 0;
      if (x->state.compare_exchange_strong(expected, 2)) fail.push_back(x->op);
    }
  }
  for (auto& op : fail) op->sub_done(closing.load() ? Code::kShutdown : Code::kUnreachable, msg);
}

void destroy_push_rkey(void* entry) {
  auto* e = static_cast<PushRkey*>(entry);
  if (e->rk) ucp_rkey_destroy(e->rk);
  delete e;
}

// ---- owner side of the push path ----------------------------------------------------

void EngineCore::serve_push_locked(Lane* lane, const std::shared_ptr<Peer>& peer,
                                   const PushHdr& h, std::string body) {
  auto fail = [&](Code c, const std::string& m) {
    send_reply_locked(lane, peer.get(), h.call_id, c, m);
  };
  if (body.size() != h.rkey_len + uint64_t(h.n_ext) * sizeof(Extent))
    return fail(Code::kInvalidArgument, "malformed push request");
  void* ep = peer->eps_[lane->idx];
  if (!ep || peer->dead_.load()) return;
  std::string rkey = body.substr(0, h.rkey_len);
  auto& cache = peer->push_rkeys_[lane->idx];
  PushRkey* entry;
  auto it = cache.find(rkey);
  if (it != cache.end()) {
    entry = static_cast<PushRkey*>(it->second);
  } else {
    if (cache.size() >= 256) {
      for (auto ci = cache.begin(); ci != cache.end();) {
        if (static_cast<PushRkey*>(ci->second)->busy == 0) {
          destroy_push_rkey(ci->second);
          ci = cache.erase(ci);
        } else {
          ++ci;
        }
      }
    }
    entry = new PushRkey;
    ucs_status_t s = ucp_ep_rkey_unpack(static_cast<ucp_ep_h>(ep), rkey.data(), &entry->rk);
    if (s != UCS_OK) {
      delete entry;
      return fail(Code::kNotRegistered, ucs_msg("unpacking the reader's rkey", s));
    }
    cache[rkey] = entry;
  }
  std::vector<Extent> ext(h.n_ext);
  if (h.n_ext) memcpy(ext.data(), body.data() + h.rkey_len, h.n_ext * sizeof(Extent));
  // Never read outside our own registered memory, whatever the request says.
  std::vector<std::shared_ptr<Region>> refs;
  refs.reserve(ext.size());
  std::shared_ptr<Region> last;
  for (auto& e : ext) {
    std::shared_ptr<Region> r;
    try {
      r = (last && e.src >= last->addr() && e.src - last->addr() <= last->length() &&
           e.len <= last->length() - (e.src - last->addr()))
              ? last
              : find_local(e.src, e.len, true);
    } catch (const Error& err) {
      return fail(err.code(), err.what());
    }
    if (!r || r->mem_type() != MemType::kHost)
      return fail(Code::kNotRegistered, "push source [" + std::to_string(e.src) + ", +" +
                                            std::to_string(e.len) +
                                            ") is not registered memory of engine '" +
                                            cfg.name + "'");
    last = r;
    refs.push_back(r);
  }
  for (auto& r : refs) r->inflight_add();
  entry->busy++;
  auto* f = new PushFlushCtx{this, lane, peer, h.call_id, std::move(refs), entry};
  ucs_status_t bad = UCS_OK;
  uint64_t total = 0;
  for (size_t i = 0; i < ext.size(); ++i) {
    ucp_request_param_t rp;
    memset(&rp, 0, sizeof rp);
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
    rp.memh = static_cast<ucp_mem_h>(f->refs[i]->memh());
    void* r = ucp_put_nbx(static_cast<ucp_ep_h>(ep), reinterpret_cast<void*>(ext[i].src),
                          ext[i].len, ext[i].dst, entry->rk, &rp);
    if (UCS_PTR_IS_PTR(r)) {
      ucp_request_free(r);  // completion (and errors) are observed through the flush
    } else if (UCS_PTR_IS_ERR(r)) {
      bad = UCS_PTR_STATUS(r);
      break;
    }
    total += ext[i].len;
  }
  st.push_served_bytes.fetch_add(total);
  ucp_request_param_t rp;
  memset(&rp, 0, sizeof rp);
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  rp.cb.send = on_push_flushed;
  rp.user_data = f;
  // Flush (not ucp_worker_fence: measured no faster here) so the reply follows the data.
  void* r = ucp_ep_flush_nbx(static_cast<ucp_ep_h>(ep), &rp);
  if (UCS_PTR_IS_PTR(r)) {
    lane->outstanding.fetch_add(1);
    return;
  }
  ucs_status_t fs = UCS_PTR_STATUS(r);
  push_flushed(f, bad != UCS_OK ? bad : fs, false);
}

// ---- reader / writer side -------------------------------------------------------------

// Pins a mapped remote arena for the CUDA driver once, so copies between it and device
// memory are one DMA each; a refusal only makes them slower (the driver stages them).
static void pin_for_cuda(RemoteRegion& rr) {
  std::lock_guard<std::mutex> g(rr.cuda_mu_);
  if (rr.cuda_pinned_ != 0) return;
  rr.cuda_pinned_ = cuda::host_register(rr.ptr_, rr.length_) ? 1 : -1;
  rr.cuda_addressable_ = rr.cuda_pinned_ > 0 && cuda::device_addressable(rr.ptr_);
  // Refused: the copies still run, staged by the driver (slower); counted in stats.
  if (rr.cuda_pinned_ < 0 && rr.peer_) rr.peer_->core_->st.cuda_pin_refused.fetch_add(1);
}

// The device of a local region's memory, and of another process's device memory opened
// here, each asked of the driver once.
static int region_device(Region& r) {
  int d = r.cuda_device_.load(std::memory_order_relaxed);
  if (d == -2) {
    d = cuda::device_of(r.addr());
    r.cuda_device_.store(d, std::memory_order_relaxed);
  }
  return d;
}
static int remote_device(RemoteRegion& rr) {
  std::lock_guard<std::mutex> g(rr.cuda_mu_);
  if (rr.cuda_device_ == -2) rr.cuda_device_ = cuda::device_of(rr.cuda_ptr_);
  return rr.cuda_device_;
}

namespace {
constexpr uint64_t kGatherMaxBytes = 64u << 10;  // writes up to this size may be gathered

struct Item {
  IoOp* io;
  const std::shared_ptr<Region>* local;  // null inside: unregistered (staging)
  int path;                              // ReadPath / WritePath value
  const std::shared_ptr<Region>& loc() const { return *local; }
};

// The local regions one call's ops lie in, each looked up in the engine's table once and
// held once: a call of 18,432 ops over 36 layers looks each op up here (its last region,
// then the few first found, then a binary search of the rest) instead of in the table, and
// copies no reference per op. A call on up to kFew regions allocates nothing (a deque and a
// vector cost a one-op 4 KiB transfer about 0.03 us of its 1 us).
class LocalSpans {
 public:
  // The region holding [addr, addr + len), or a null pointer (unregistered memory).
  // find(addr, len): the table's lookup (throws for a range past a region's end).
  template <class Find>
  const std::shared_ptr<Region>& at(uintptr_t addr, uint64_t len, Find&& find) {
    if (addr + len >= addr) {
      if (last_ && inside(*last_, addr, len)) return *last_->sp;
      for (size_t k = 0; k < nfew_; ++k)
        if (inside(few_[k], addr, len)) return *(last_ = &few_[k])->sp;
      auto it = std::upper_bound(more_.begin(), more_.end(), addr,
                                 [](uintptr_t a, const Span& s) { return a < s.start; });
      if (it != more_.begin() && inside(*(it - 1), addr, len)) return *(last_ = &*(it - 1))->sp;
    }
    std::shared_ptr<Region> r = find(addr, len);
    if (!r) return none_;
    if (nfew_ < kFew) {
      held_few_[nfew_] = std::move(r);
      const auto& sp = held_few_[nfew_];
      few_[nfew_] = Span{sp->addr(), sp->addr() + sp->length(), &sp};
      last_ = &few_[nfew_++];
      return sp;
    }
    if (!held_more_) held_more_ = std::make_unique<std::deque<std::shared_ptr<Region>>>();
    held_more_->push_back(std::move(r));
    const auto& sp = held_more_->back();
    Span s{sp->addr(), sp->addr() + sp->length(), &sp};
    auto pos = std::upper_bound(more_.begin(), more_.end(), s.start,
                                [](uintptr_t a, const Span& x) { return a < x.start; });
    last_ = nullptr;  // an insertion moves more_'s spans
    more_.insert(pos, s);
    return sp;
  }

 private:
  struct Span {
    uintptr_t start, end;
    const std::shared_ptr<Region>* sp;
  };
  static bool inside(const Span& s, uintptr_t addr, uint64_t len) {
    return addr >= s.start && addr + len <= s.end;
  }
  static constexpr size_t kFew = 4;
  std::shared_ptr<Region> held_few_[kFew];  // the first regions found
  Span few_[kFew];
  size_t nfew_ = 0;
  std::unique_ptr<std::deque<std::shared_ptr<Region>>> held_more_;  // stable addresses
  std::vector<Span> more_;                                           // by start address
  const Span* last_ = nullptr;
  const std::shared_ptr<Region> none_;
};
}  // namespace

std::shared_ptr<Op> EngineCore::submit(std::vector<IoOp>& ops, bool is_read) {
  ActiveGuard guard(this);
  // Small reads over tcp: UCX's emulated get is one round trip, a push is two (put, flush
  // ack) plus the reply; measured crossover 16-64 KiB (benchmarks/). But one push carries
  // many extents: a batch of small reads from one owner is pushed when their sum is large.
  std::unordered_map<const Peer*, uint64_t> push_bytes;
  if (is_read && cfg.read_mode == ReadPath::kAuto)
    for (auto& io : ops)
      if (io.rr && io.rr->read_path_ == ReadPath::kPush) push_bytes[io.rr->peer_.get()] += io.length;
  // 1. Validate every op before anything moves.
  std::vector<Item> items;
  items.reserve(ops.size());
  std::shared_lock<std::shared_mutex> regions_lock(regions_mu);  // one lookup lock for the batch
  LocalSpans spans;
  auto find = [this](uintptr_t a, uint64_t n) { return find_local_locked(a, n, false); };
  const RemoteRegion* checked = nullptr;  // the remote region of the ops before: checked
  for (auto& io : ops) {
    if (!io.rr) throw Error(Code::kInvalidArgument, "remote region is None");
    RemoteRegion& rr = *io.rr;
    if (&rr != checked) {
      if (!rr.peer_ || rr.peer_->core_.get() != this)
        throw Error(Code::kInvalidArgument, "remote region belongs to another engine");
      if (rr.peer_->dead_.load())
        throw Error(Code::kUnreachable, rr.peer_->death_msg_.empty() ? "peer is gone" : rr.peer_->death_msg_);
      checked = &rr;
    }
    if (io.remote_offset > rr.length_ || io.length > rr.length_ - io.remote_offset)
      throw Error(Code::kOutOfBounds,
                  "remote range [" + std::to_string(io.remote_offset) + ", +" +
                      std::to_string(io.length) + ") is outside the remote region of " +
                      std::to_string(rr.length_) + " bytes");
    if (io.length == 0) continue;
    if (io.local_addr == 0) throw Error(Code::kInvalidArgument, "local address is 0");
    const std::shared_ptr<Region>& local = spans.at(io.local_addr, io.length, find);
    int path = is_read ? int(rr.read_path_) : int(rr.write_path_);
    if (is_read && path == int(ReadPath::kPush) && cfg.read_mode == ReadPath::kAuto &&
        push_bytes[rr.peer_.get()] < cfg.push_min_bytes)
      path = int(ReadPath::kGet);
    if (local && local->mem_type() != MemType::kHost) {
      // Device memory: with the remote arena mapped (same host) the CUDA driver copies
      // between it and the device (one DMA: the mapping is pinned at first use); else UCX
      // moves it (cuda_copy / cuda_ipc / GPUDirect RDMA, as its build allows).
      const bool mapped = (rr.ptr_ || rr.cuda_ptr_) && cfg.read_mode != ReadPath::kGet &&
                          cfg.write_mode != WritePath::kPut;
      if (mapped && cuda::available())
        path = is_read ? int(ReadPath::kMemcpy) : int(WritePath::kMemcpy);
      else
        path = is_read ? int(ReadPath::kGet) : int(WritePath::kPut);
    }
    items.push_back(Item{&io, &local, path});
  }
  regions_lock.unlock();

  auto op = std::make_shared<Op>(shared_from_this());
  const size_t nl = lanes.size();
  const auto stage_deadline = Clock::now() + std::chrono::seconds(120);
  std::vector<std::pair<std::shared_ptr<Peer>, int>> to_flush;  // writes: (peer, lane)
  struct PushBatch {
    std::shared_ptr<Peer> peer;
    int lane;
    std::shared_ptr<Region> region;
    std::vector<Extent> ext;
    const RemoteRegion* last_rr = nullptr;  // of ext.back(): a join stays inside one region
  };
  std::vector<PushBatch> batches;

  auto post_piece = [&](Kind kind, int li, const std::shared_ptr<RemoteRegion>& rrp,
                        uint64_t raddr, void* laddr, uint64_t len,
                        const std::shared_ptr<Region>& region, int64_t stage_off,
                        uintptr_t copy_to) {
    Lane* lane = lanes[li].get();
    auto* x = new XferCtx{this, op, lane, nullptr, rrp, stage_off, len, copy_to, rrp->peer_};
    void* memh = nullptr;
    if (stage_off >= 0) {
      memh = staging.region()->memh();
    } else {
      x->region = region;
      region->inflight_add();
      memh = region->memh();
    }
    op->add_lane(li);
    std::lock_guard<std::mutex> g(lane->mu);
    std::shared_lock<std::shared_mutex> rl(rrp->mu_);
    void* ep = rrp->peer_->eps_[li];
    if (rrp->destroyed_ || !ep) {
      x->op->add_pending();
      x->lane->outstanding.fetch_add(1);
      finish_xfer(x, UCS_ERR_NOT_CONNECTED);
      return;
    }
    post_locked(kind, ep, rrp->rkeys_[li], raddr, laddr, memh, x);
    if (kind == Kind::kPut) {
      bool seen = false;
      for (auto& f : to_flush)
        if (f.first == rrp->peer_ && f.second == li) seen = true;
      if (!seen) to_flush.emplace_back(rrp->peer_, li);
    }
  };

  // 2. Small writes into consecutive ranges of one remote region (a batch of values
  // carved from a put slab) are gathered into one staging piece and sent as one put: over
  // tcp every put is a message of its own, and 128 puts of 4 KiB took 6-14x as long as one
  // of 512 KiB. The copy costs ~0.1 ms per 512 KiB.
  std::vector<cuda::Copy> cuda_copies;  // device memory <-> mapped remote arenas
  // Whether a kernel on one device may copy them all (every address device-addressable,
  // every device address on that device): then many small ranges go in one launch.
  bool kernel_ok = true;
  int kernel_dev = -2;
  const RemoteRegion* last_rr = nullptr;
  const RemoteRegion* last_pinned = nullptr;
  const Region* last_local = nullptr;
  uint64_t cuda_bytes = 0, memcpy_bytes = 0;  // added to the stats once
  auto kernel_note = [&](int dev) {
    if (dev < 0 || (kernel_dev != -2 && dev != kernel_dev)) kernel_ok = false;
    kernel_dev = dev;
  };
  auto kernel_note_local = [&](const Item& it) {  // once per run of ops on one local region
    if (!it.loc()) kernel_ok = false;  // unregistered memory: no device address known
    if (!kernel_ok || it.loc().get() == last_local) return;
    kernel_note(it.loc()->mem_type() == MemType::kCuda ? region_device(*it.loc()) : -1);
    last_local = it.loc().get();
  };
  std::vector<char> gathered(items.size(), 0);
  if (!is_read) {
    auto small_put = [&](const Item& it) {
      return it.path == int(WritePath::kPut) && it.io->length <= kGatherMaxBytes &&
             (!it.loc() || it.loc()->mem_type() == MemType::kHost);
    };
    for (size_t i = 0, j; i < items.size(); i = j) {
      j = i + 1;
      if (!small_put(items[i])) continue;
      ensure_staging();
      const uint64_t cap = std::min<uint64_t>(cfg.chunk_bytes, staging.piece_max());
      uint64_t total = items[i].io->length;
      while (j < items.size() && small_put(items[j]) && items[j].io->rr == items[i].io->rr &&
             items[j].io->remote_offset == items[j - 1].io->remote_offset + items[j - 1].io->length &&
             total + items[j].io->length <= cap)
        total += items[j++].io->length;
      if (j - i < 2) continue;
      int64_t so = staging.alloc(total, stage_deadline);
      if (so < 0) continue;  // sent one by one below
      char* sp = reinterpret_cast<char*>(staging.region()->addr()) + so;
      for (size_t k = i, off = 0; k < j; off += items[k].io->length, ++k) {
        IoOp& g = *items[k].io;
        if (g.want_crc) {
          g.crc = copy_crc(sp + off, reinterpret_cast<const char*>(g.local_addr), g.length, false);
          g.crc_ok = true;
        } else {
          memcpy(sp + off, reinterpret_cast<const char*>(g.local_addr), g.length);
        }
        gathered[k] = 1;
      }
      const IoOp& first = *items[i].io;
      st.write_put_bytes.fetch_add(total);
      st.write_gathered_bytes.fetch_add(total);
      post_piece(Kind::kPut, int(lane_rr.fetch_add(1) % nl), first.rr, first.rr->base_ + first.remote_offset,
                 sp, total, nullptr, so, 0);
    }
  }

  // A mapped remote region's lock is taken once per run of copies from it, not once per
  // op (a load of 18,432 small ranges spent a fifth of its CPU time taking and releasing
  // it), and let go before any other kind of op.
  std::shared_lock<std::shared_mutex> mapped_lock;
  const RemoteRegion* mapped_rr = nullptr;
  auto release_mapped = [&] {
    if (mapped_lock.owns_lock()) mapped_lock.unlock();
    mapped_rr = nullptr;
  };
  for (size_t n = 0; n < items.size(); ++n) {
    if (gathered[n]) continue;
    Item& it = items[n];
    IoOp& io = *it.io;
    RemoteRegion& rr = *io.rr;
    const uint64_t raddr = rr.base_ + io.remote_offset;
    const uint64_t len = io.length;
    char* const laddr = reinterpret_cast<char*>(io.local_addr);

    if ((is_read && it.path == int(ReadPath::kMemcpy)) ||
        (!is_read && it.path == int(WritePath::kMemcpy))) {
      if (mapped_rr != &rr) {
        release_mapped();
        mapped_lock = std::shared_lock<std::shared_mutex>(rr.mu_);
        mapped_rr = &rr;
      }
      if (rr.destroyed_ || (!rr.ptr_ && !rr.cuda_ptr_)) {
        op->record_error(Code::kUnreachable, "remote mapping is gone");
        continue;
      }
      if (rr.cuda_ptr_) {  // the owner's device memory, mapped here (CUDA IPC): device to device
        const uintptr_t remote = rr.cuda_ptr_ + io.remote_offset;
        if (kernel_ok && &rr != last_rr) {
          kernel_note(remote_device(rr));
          last_rr = &rr;
        }
        kernel_note_local(it);
        cuda_copies.push_back(cuda::Copy{is_read ? uintptr_t(laddr) : remote, is_read ? remote : uintptr_t(laddr), len});
        cuda_bytes += len;
        continue;
      }
      char* remote = rr.ptr_ + io.remote_offset;
      char* dst = is_read ? laddr : remote;
      const char* src = is_read ? remote : laddr;
      if (it.loc() && it.loc()->mem_type() == MemType::kCuda) {
        if (&rr != last_pinned) {  // once per run of ops on one region
          pin_for_cuda(rr);
          last_pinned = &rr;
        }
        if (!rr.cuda_addressable_) kernel_ok = false;
        kernel_note_local(it);
        cuda_copies.push_back(cuda::Copy{uintptr_t(dst), uintptr_t(src), len});
        cuda_bytes += len;
        continue;
      }
      // Writes land in fresh arena space this process will not read: streamed past the cache.
      const bool stream = !is_read && len >= kStreamMinBytes;
      uint32_t* crc = !is_read && io.want_crc ? &io.crc : nullptr;  // a put's checksum, taken in its copy
      if (copier && len >= cfg.stripe_min_bytes)
        copier->copy(dst, src, len, stream, crc);  // striped over helper threads, like lanes
      else if (crc != nullptr)
        *crc = copy_crc(dst, src, len, stream);
      else
        (stream ? copy_stream : copy_plain)(dst, src, len);
      io.crc_ok = crc != nullptr;
      memcpy_bytes += len;
      continue;
    }

    release_mapped();  // post_piece and the staging path take region locks of their own
    const bool push = is_read && it.path == int(ReadPath::kPush);
    const Kind kind = is_read ? Kind::kGet : Kind::kPut;
    (is_read ? (push ? st.read_push_bytes : st.read_get_bytes) : st.write_put_bytes).fetch_add(len);
    const uint32_t start = lane_rr.fetch_add(1);

    if (it.loc()) {  // registered: zero-copy, striped over the lanes
      uint64_t n = 1;
      if (nl > 1 && len >= cfg.stripe_min_bytes)
        n = std::max<uint64_t>(nl, (len + cfg.chunk_bytes - 1) / cfg.chunk_bytes);
      const uint64_t piece = (len + n - 1) / n;
      for (uint64_t k = 0, off = 0; off < len; ++k, off += piece) {
        const uint64_t plen = std::min(piece, len - off);
        const int li = int((start + k) % nl);
        if (push) {
          // A small read that continues an earlier one in both memories (a batch of
          // values carved from one put slab, read into consecutive rows of one buffer)
          // joins its extent: the owner then sends one put, not one per value (over tcp
          // each put is a message of its own). Striped pieces are never joined back, and
          // a joined extent stays under stripe_min_bytes so long runs still spread.
          if (n == 1) {
            Extent* tail = nullptr;
            for (auto& pb : batches)
              if (pb.peer == rr.peer_ && pb.region == it.loc() && pb.last_rr == &rr &&
                  pb.ext.back().src + pb.ext.back().len == raddr &&
                  pb.ext.back().dst + pb.ext.back().len == uint64_t(io.local_addr) &&
                  pb.ext.back().len + plen <= cfg.stripe_min_bytes)
                tail = &pb.ext.back();
            if (tail) {
              tail->len += plen;
              st.read_push_joined_bytes.fetch_add(plen);
              continue;
            }
          }
          PushBatch* b = nullptr;
          for (auto& pb : batches)
            if (pb.peer == rr.peer_ && pb.lane == li && pb.region == it.loc() &&
                pb.ext.size() < kMaxExtentsPerPush)
              b = &pb;
          if (!b) {
            batches.push_back(PushBatch{rr.peer_, li, it.loc(), {}});
            b = &batches.back();
          }
          b->ext.push_back(Extent{raddr + off, uint64_t(io.local_addr) + off, plen});
          b->last_rr = &rr;
        } else {
          post_piece(kind, li, io.rr, raddr + off, laddr + off, plen, it.loc(), -1, 0);
        }
      }
      continue;
    }

    // Unregistered: bounce through staging, one piece at a time, striped over the lanes
    // like registered memory. A 4 MiB staged read in one piece went to one lane, and its
    // copy out of staging began only when all of it had arrived. Bytes gets of 4 MiB over
    // tcp, paired rounds: 1 MiB pieces x1.22 [1.00-1.47] against one piece, 2 MiB pieces
    // x1.07 [0.94-1.31] against 1 MiB.
    ensure_staging();
    uint64_t pmax = std::min<uint64_t>(cfg.chunk_bytes, staging.piece_max());
    if (nl > 1 && len >= cfg.stripe_min_bytes) pmax = std::min<uint64_t>(pmax, (len + nl - 1) / nl);
    st.staged_bytes.fetch_add(len);
    for (uint64_t k = 0, off = 0; off < len; ++k, off += pmax) {
      const uint64_t plen = std::min(pmax, len - off);
      const int li = int((start + k) % nl);
      int64_t so = staging.alloc(plen, stage_deadline);
      if (so < 0) {
        op->record_error(closing.load() ? Code::kShutdown : Code::kTimeout,
                         "no staging space for unregistered memory");
        break;
      }
      char* sp = reinterpret_cast<char*>(staging.region()->addr()) + so;
      if (!is_read) memcpy(sp, laddr + off, plen);
      if (!push) {
        post_piece(kind, li, io.rr, raddr + off, sp, plen, nullptr, so, is_read ? uintptr_t(laddr + off) : 0);
        continue;
      }
      uintptr_t dst = uintptr_t(laddr + off);
      auto opw = op;
      EngineCore* self = this;
      post_push(lanes[li].get(), rr.peer_, staging.region()->rkey(),
                {Extent{raddr + off, uint64_t(uintptr_t(sp)), plen}}, op,
                [self, opw, so, plen, sp, dst](Code c) {
                  if (c == Code::kOk && opw->enter_copy()) {
                    memcpy(reinterpret_cast<void*>(dst), sp, plen);
                    opw->exit_copy();
                  }
                  self->staging.free(so, plen);
                });
    }
  }

  release_mapped();
  if (cuda_bytes) (is_read ? st.read_cuda_bytes : st.write_cuda_bytes).fetch_add(cuda_bytes);
  if (memcpy_bytes) (is_read ? st.read_memcpy_bytes : st.write_memcpy_bytes).fetch_add(memcpy_bytes);
  if (!cuda_copies.empty()) {
    // One stream of this thread's, one synchronisation for the whole batch. The copies
    // ran in the caller's thread like memcpy ones: the op is complete when they are.
    try {
      thread_local std::map<int, std::unique_ptr<cuda::CudaCopyStream>> streams;
      const int dev = cuda::device_of(cuda_copies[0].dst) >= 0 ? cuda::device_of(cuda_copies[0].dst)
                                                                : cuda::device_of(cuda_copies[0].src);
      auto& s = streams[dev < 0 ? 0 : dev];
      if (!s) s = std::make_unique<cuda::CudaCopyStream>(dev < 0 ? 0 : dev);
      const uint64_t launches = s->kernel_launches();
      s->copy_many(std::move(cuda_copies), kernel_ok && kernel_dev == (dev < 0 ? 0 : dev));
      st.cuda_kernel_launches.fetch_add(s->kernel_launches() - launches);
      s->synchronize();
    } catch (const Error& e) {
      op->record_error(Code::kTransferFailed, e.what());
    }
  }

  for (auto& b : batches) {
    auto region = b.region;
    region->inflight_add();
    post_push(lanes[b.lane].get(), b.peer, region->rkey(), std::move(b.ext), op,
              [region](Code) { region->inflight_sub(); });
  }
  for (auto& f : to_flush) {
    Lane* lane = lanes[f.second].get();
    auto* x = new XferCtx{this, op, lane, nullptr, nullptr, -1, 0, 0, f.first};
    std::lock_guard<std::mutex> g(lane->mu);
    void* ep = f.first->eps_[f.second];
    if (!ep) {
      x->op->add_pending();
      lane->outstanding.fetch_add(1);
      finish_xfer(x, UCS_ERR_NOT_CONNECTED);
      continue;
    }
    post_locked(Kind::kFlush, ep, nullptr, 0, nullptr, nullptr, x);
  }
  op->sub_done();  // drop the submission guard
  return op;
}

void EngineCore::post_push(Lane* lane, const std::shared_ptr<Peer>& peer, const std::string& rkey,
                           std::vector<Extent> ext, const std::shared_ptr<Op>& op,
                           std::function<void(Code)> on_reply) {
  uint64_t id = next_id.fetch_add(1);
  op->add_lane(lane->idx);
  op->add_pending();
  add_pending(id, Pending{op, peer->uid_, on_reply, false});
  st.pushes_sent.fetch_add(1);
  PushHdr h{uid, id, uint32_t(rkey.size()), uint32_t(ext.size()), {}};
  memcpy(h.tok, peer->tok_send_, kTokLen);
  std::string body;
  body.reserve(rkey.size() + ext.size() * sizeof(Extent));
  body += rkey;
  body.append(reinterpret_cast<const char*>(ext.data()), ext.size() * sizeof(Extent));
  ucs_status_t err = UCS_ERR_NOT_CONNECTED;
  bool ok;
  {
    std::lock_guard<std::mutex> g(lane->mu);
    void* ep = peer->eps_[lane->idx];
    ok = ep && am_send_locked(this, lane, ep, kAmPushReq, &h, sizeof h, std::move(body), id, true, &err);
  }
  if (!ok) {
    Pending p;
    if (take_pending(id, &p)) {
      if (p.on_reply) p.on_reply(code_from_ucs(err));
      p.op->sub_done(code_from_ucs(err), ucs_msg("push request", err));
    }
  }
}

}  // namespace mcr
