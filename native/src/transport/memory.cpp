// Local memory: registration (ucp_mem_map), UCX-allocated arenas, the registry that
// classifies a local range as registered / unregistered / closed, and the staging
// buffer that bounces unregistered memory.
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include "internal.h"
#include "mcr/cuda.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace mcr {

namespace {
constexpr uint64_t kPage = 4096;

// Fault every page in now: first touch costs 2-5 GB/s, far below the transfer rates.
void prefault(void* p, uint64_t len) {
  madvise(p, len, MADV_HUGEPAGE);  // best effort (anonymous memory only)
  if (madvise(p, len, MADV_POPULATE_WRITE) == 0) return;
  auto* c = static_cast<volatile char*>(p);
  for (uint64_t i = 0; i < len; i += kPage) c[i] = c[i];
}

void unmap_memh(void* ctx, void* memh) {
  ucp_mem_unmap(static_cast<ucp_context_h>(ctx), static_cast<ucp_mem_h>(memh));
}

// Deregisters, then frees an arena's memfd mapping (alloc_arena).
void release(void* ctx, void* memh, int shm_fd, uintptr_t addr, uint64_t len) {
  unmap_memh(ctx, memh);
  if (shm_fd >= 0) {
    munmap(reinterpret_cast<void*>(addr), len);
    ::close(shm_fd);
  }
}

// An arena in a memfd of its own, mapped shared: peers on this host map the same pages
// (the rkey's trailer, host_shm_export), where UCX's posix/sysv transports, which mapped
// UCX-allocated memory before, are off (engine.cpp, tls_for). -1 where memfd is missing.
int alloc_shm(uint64_t len, void** out) {
  int fd = memfd_create("mooncake-ray-arena", MFD_CLOEXEC);
  if (fd < 0) return -1;
  if (ftruncate(fd, off_t(len)) != 0) {
    ::close(fd);
    throw Error(Code::kInternal, "ftruncate of a " + std::to_string(len) + "-byte arena: " + strerror(errno));
  }
  void* m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) {
    ::close(fd);
    throw Error(Code::kInternal, "mmap of a " + std::to_string(len) + "-byte arena: " + strerror(errno));
  }
  *out = m;
  return fd;
}

void put64(std::string* s, uint64_t v) { s->append(reinterpret_cast<const char*>(&v), 8); }
}  // namespace

std::string host_shm_export(int fd, uintptr_t addr, uint64_t len) {
  struct stat st;
  if (fstat(fd, &st) != 0) return "";
  std::string t;
  put64(&t, uint64_t(getpid()));
  put64(&t, uint64_t(fd));
  put64(&t, uint64_t(st.st_ino));
  put64(&t, addr);
  put64(&t, len);
  t.append(kHostShmMagic, 8);
  return t;
}

bool host_shm_split(std::string* rkey, HostShm* out) {
  if (rkey->size() <= kHostShmTrailer ||
      rkey->compare(rkey->size() - 8, 8, kHostShmMagic, 8) != 0)
    return false;
  const char* t = rkey->data() + rkey->size() - kHostShmTrailer;
  uint64_t v[5];
  memcpy(v, t, sizeof v);
  *out = HostShm{uint32_t(v[0]), int(v[1]), v[2], v[3], v[4]};
  rkey->resize(rkey->size() - kHostShmTrailer);
  return true;
}

// ---- Region -------------------------------------------------------------------------

Region::Region(std::shared_ptr<EngineCore> core, uint64_t id, uintptr_t addr, uint64_t len,
               bool arena, MemType mt, void* memh, std::string rkey)
    : core_(core),
      ctx_(core->ctx_holder),
      id_(id),
      addr_(addr),
      length_(len),
      arena_(arena),
      mem_type_(mt),
      memh_(memh),
      rkey_(std::move(rkey)) {}

Region::~Region() {
  if (auto c = core_.lock()) c->region_forgotten(this);
  if (!unmapped_ && memh_ && ctx_) {
    unmapped_ = true;
    void* ctx = ctx_of(ctx_);
    if (in_progress_context()) {
      // Not from inside UCP callbacks: hand it to a progress thread if one still runs.
      auto c = core_.lock();
      if (c && !c->closing.load() && !c->lanes.empty()) {
        auto holder = ctx_;
        void* memh = memh_;
        int fd = shm_fd_;
        uintptr_t a = addr_;
        uint64_t n = length_;
        c->lanes[0]->post_task([holder, ctx, memh, fd, a, n] { release(ctx, memh, fd, a, n); });
        return;
      }
    }
    release(ctx, memh_, shm_fd_, addr_, length_);
  }
}

void Region::maybe_unmap_locked() {
  if (unmapped_ || !closed_.load() || views_ > 0 || inflight_.load() > 0) return;
  unmapped_ = true;
  release(ctx_of(ctx_), memh_, shm_fd_, addr_, length_);
}

bool Region::close(double wait_s) {
  if (!closed_.exchange(true)) {
    if (auto c = core_.lock()) c->region_closed(this);
  }
  auto until = deadline_after(wait_s);
  while (inflight_.load() > 0 && Clock::now() < until)
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  std::lock_guard<std::mutex> g(mu_);
  maybe_unmap_locked();
  return inflight_.load() == 0;
}

void Region::inflight_sub() { inflight_.fetch_sub(1); }

void Region::add_view() {
  std::lock_guard<std::mutex> g(mu_);
  ++views_;
}

void Region::drop_view() {
  std::lock_guard<std::mutex> g(mu_);
  --views_;
  maybe_unmap_locked();
}

void Region::unmap_now() {
  closed_.store(true);
  std::lock_guard<std::mutex> g(mu_);
  if (views_ > 0 || unmapped_) return;  // a live view keeps the mapping (and the context)
  unmapped_ = true;
  release(ctx_of(ctx_), memh_, shm_fd_, addr_, length_);
}

// ---- registry -----------------------------------------------------------------------

std::shared_ptr<Region> EngineCore::map_memory(uintptr_t addr, uint64_t len, bool allocate,
                                               MemType mt, bool track) {
  if (len == 0) throw Error(Code::kInvalidArgument, "cannot register 0 bytes");
  if (!allocate && addr == 0) throw Error(Code::kInvalidArgument, "cannot register address 0");
  const bool arena = allocate;
  int shm_fd = -1;
  if (allocate && mt == MemType::kHost) {
    void* m = nullptr;
    shm_fd = alloc_shm(len, &m);
    if (shm_fd >= 0) {
      allocate = false;  // registered below like user memory; freed with the region
      addr = reinterpret_cast<uintptr_t>(m);
      prefault(m, len);
    }
  }
  auto drop_shm = [&] {
    if (shm_fd >= 0) munmap(reinterpret_cast<void*>(addr), len), ::close(shm_fd);
  };
  ucp_mem_map_params_t p;
  memset(&p, 0, sizeof p);
  p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                 UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  p.address = allocate ? nullptr : reinterpret_cast<void*>(addr);
  p.length = len;
  p.flags = allocate ? UCP_MEM_MAP_ALLOCATE : 0;
  if (mt == MemType::kCuda) {
    // CUDA device memory (torch/cupy pointers). CI has no GPU: tests/gpu runs it on one.
    p.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
    p.memory_type = UCS_MEMORY_TYPE_CUDA;
  }
  ucp_mem_h memh = nullptr;
  ucs_status_t st = ucp_mem_map(ctx, &p, &memh);
  if (st != UCS_OK) {
    drop_shm();
    throw Error(arena ? Code::kInternal : Code::kInvalidArgument,
                ucs_msg(arena ? "ucp_mem_map (arena)" : "ucp_mem_map (register)", st) +
                    " for " + std::to_string(len) + " bytes");
  }
  if (allocate) {
    ucp_mem_attr_t a;
    memset(&a, 0, sizeof a);
    a.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
    ucp_mem_query(memh, &a);
    addr = reinterpret_cast<uintptr_t>(a.address);
    prefault(a.address, len);
  }
  void* rbuf = nullptr;
  size_t rsize = 0;
  st = ucp_rkey_pack(ctx, memh, &rbuf, &rsize);
  if (st != UCS_OK) {
    ucp_mem_unmap(ctx, memh);
    drop_shm();
    throw Error(Code::kInternal, ucs_msg("ucp_rkey_pack", st));
  }
  std::string rkey(static_cast<char*>(rbuf), rsize);
  ucp_rkey_buffer_release(rbuf);
  // Same-host importers map device memory themselves (CUDA IPC, unless MCR_CUDA_IPC=0):
  // UCX's cuda_ipc costs about 7 us a copy, which block-sized reads feel.
  if (mt == MemType::kCuda) rkey += cuda::ipc_export(addr, len);
  if (shm_fd >= 0) rkey += host_shm_export(shm_fd, addr, len);
  auto r = std::make_shared<Region>(shared_from_this(), next_id.fetch_add(1), addr, len,
                                    arena, mt, memh, std::move(rkey));
  r->shm_fd_ = shm_fd;
  if (track) {
    std::unique_lock<std::shared_mutex> g(regions_mu);
    regions[addr].push_back(r);
    for (auto it = tombstones.begin(); it != tombstones.end();) {
      auto [s, l] = it->second;
      if (s < addr + len && addr < s + l)
        it = tombstones.erase(it);
      else
        ++it;
    }
  }
  return r;
}

void EngineCore::region_closed(Region* r) {
  std::unique_lock<std::shared_mutex> g(regions_mu);
  auto it = regions.find(r->addr());
  if (it != regions.end()) {
    auto& v = it->second;
    for (size_t i = 0; i < v.size(); ++i)
      if (v[i].get() == r) {
        v.erase(v.begin() + i);
        break;
      }
    if (v.empty()) regions.erase(it);
  }
  // Remember the range while the Region object lives: a transfer naming it must fail,
  // not silently bounce through staging (or touch unmapped arena memory).
  tombstones[r->id()] = {r->addr(), r->length()};
}

void EngineCore::region_forgotten(Region* r) {
  std::unique_lock<std::shared_mutex> g(regions_mu);
  tombstones.erase(r->id());
}

std::shared_ptr<Region> EngineCore::find_local(uintptr_t addr, uint64_t len, bool for_remote) {
  std::shared_lock<std::shared_mutex> g(regions_mu);
  return find_local_locked(addr, len, for_remote);
}

std::shared_ptr<Region> EngineCore::find_local_locked(uintptr_t addr, uint64_t len, bool) {
  if (addr + len < addr) throw Error(Code::kOutOfBounds, "local range wraps around");
  auto it = regions.upper_bound(addr);
  while (it != regions.begin()) {
    --it;
    for (auto& r : it->second) {
      uintptr_t s = r->addr(), e = s + r->length();
      if (addr >= s && addr < e) {
        if (addr + len <= e) return r;
        throw Error(Code::kOutOfBounds,
                    "local range [" + std::to_string(addr) + ", +" + std::to_string(len) +
                        ") runs past the end of registered region " + std::to_string(r->id()) +
                        " [" + std::to_string(s) + ", +" + std::to_string(r->length()) + ")");
      }
    }
  }
  for (auto& kv : tombstones) {
    auto [s, l] = kv.second;
    if (s < addr + len && addr < s + l)
      throw Error(Code::kNotRegistered, "range [" + std::to_string(addr) + ", +" +
                                            std::to_string(len) + ") lies in closed region " +
                                            std::to_string(kv.first) + " of engine '" +
                                            cfg.name + "'");
  }
  return nullptr;
}

void EngineCore::ensure_staging() {
  if (staging.ready()) return;
  std::lock_guard<std::mutex> g(staging_mu);
  if (staging.ready()) return;
  staging.init(map_memory(0, cfg.staging_bytes, true, MemType::kHost, false));
}

// ---- Staging ------------------------------------------------------------------------

void Staging::init(std::shared_ptr<Region> region) {
  std::lock_guard<std::mutex> g(mu_);
  free_[0] = region->length() / kPage * kPage;
  piece_max_ = std::max<uint64_t>(kPage, free_[0] / 4);
  region_ = std::move(region);
}

int64_t Staging::alloc(uint64_t len, Clock::time_point deadline) {
  len = (len + kPage - 1) / kPage * kPage;
  std::unique_lock<std::mutex> g(mu_);
  for (;;) {
    if (shutdown_) return -1;
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < len) continue;
      uint64_t off = it->first, rest = it->second - len;
      free_.erase(it);
      if (rest) free_[off + len] = rest;
      return int64_t(off);
    }
    if (cv_.wait_until(g, deadline) == std::cv_status::timeout) return -1;
  }
}

void Staging::free(int64_t off, uint64_t len) {
  len = (len + kPage - 1) / kPage * kPage;
  {
    std::lock_guard<std::mutex> g(mu_);
    uint64_t o = uint64_t(off);
    auto next = free_.lower_bound(o);
    if (next != free_.end() && o + len == next->first) {
      len += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == o) {
        prev->second += len;
        len = 0;
      }
    }
    if (len) free_[o] = len;
  }
  cv_.notify_all();
}

void Staging::shutdown() {
  {
    std::lock_guard<std::mutex> g(mu_);
    shutdown_ = true;
  }
  cv_.notify_all();
}

}  // namespace mcr
