// The spill tier: directory, index, capacity, degraded state, and the public methods.
// The I/O itself is in batch.cpp.
#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <algorithm>
#include <iterator>
#include <unordered_map>

#include "mcr/spill_internal.h"

namespace mcr::spill {

uint64_t mono_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

uint64_t wall_ns() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

AlignedBuf::AlignedBuf(size_t n) : n_(round_up(n ? n : 1)) {
  void* p = mmap(nullptr, n_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                 -1, 0);
  if (p == MAP_FAILED) throw Error(Code::kIoError, "spill: cannot map an aligned buffer");
  p_ = static_cast<uint8_t*>(p);
}

AlignedBuf::~AlignedBuf() {
  if (p_) munmap(p_, n_);
}

AlignedBuf& AlignedBuf::operator=(AlignedBuf&& o) noexcept {
  if (this != &o) {
    if (p_) munmap(p_, n_);
    p_ = o.p_, n_ = o.n_;
    o.p_ = nullptr, o.n_ = 0;
  }
  return *this;
}

uint8_t* Context::get_staging() {
  if (!free_staging.empty()) {
    uint8_t* p = free_staging.back();
    free_staging.pop_back();
    return p;
  }
  if (staging.size() >= max_staging) return nullptr;
  staging.emplace_back(chunk);
  return staging.back().data();
}

namespace {

[[noreturn]] void throw_errno(const std::string& what, int err) {
  throw Error(Code::kIoError, what + ": " + strerror(err));
}

void mkdirs(const std::string& path) {
  for (size_t i = 1; i <= path.size(); ++i) {
    if (i < path.size() && path[i] != '/') continue;
    std::string p = path.substr(0, i);
    if (mkdir(p.c_str(), 0755) != 0 && errno != EEXIST) throw_errno("create " + p, errno);
  }
}

const char* kHex = "0123456789abcdef";

}  // namespace

Tier::Impl::Impl(const Options& o) : opt(o) {
  for (int& fd : sub_fd) fd = -1;
  if (opt.directory.empty()) throw Error(Code::kInvalidArgument, "spill directory is empty");
  if (opt.capacity_bytes == 0)
    throw Error(Code::kInvalidArgument, "spill capacity_bytes must be > 0");
  if (opt.queue_depth < 1 || opt.queue_depth > 4096)
    throw Error(Code::kInvalidArgument,
                "spill queue_depth must be 1..4096, got " + std::to_string(opt.queue_depth));
  if (opt.chunk_bytes < 64 * 1024 || opt.chunk_bytes > (64u << 20) || opt.chunk_bytes % kBlock)
    throw Error(Code::kInvalidArgument, "spill chunk_bytes must be a multiple of 4096 in "
                                        "[64 KiB, 64 MiB], got " + std::to_string(opt.chunk_bytes));
  uring = opt.use_uring;
  if (uring) {
    try {
      IoQueue::uring(1);  // refused by old kernels and some seccomp profiles
    } catch (const Error&) {
      uring = false;
    }
  }
}

Tier::Impl::~Impl() { close_dirs(); }

void Tier::Impl::open_dirs(bool create) {
  close_dirs();
  const std::string& root = opt.directory;
  if (create) mkdirs(root);
  std::string lock = root + "/LOCK";
  lock_fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock_fd < 0) throw_errno("open " + lock, errno);
  if (flock(lock_fd, LOCK_EX | LOCK_NB) != 0)
    throw Error(Code::kIoError, "spill directory " + root + " is in use by another SpillTier");
  struct stat st;
  if (stat(root.c_str(), &st) != 0) throw_errno("stat " + root, errno);
  root_dev = st.st_dev, root_ino = st.st_ino;
  for (unsigned b = 0; b < kSubdirs; ++b) {
    std::string p = root + "/" + kHex[b];
    if (mkdir(p.c_str(), 0755) != 0 && errno != EEXIST) throw_errno("create " + p, errno);
    sub_fd[b] = ::open(p.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (sub_fd[b] < 0) throw_errno("open " + p, errno);
  }
  tomb_open();
  // O_DIRECT is the design (no page-cache copies, no double caching): refuse a filesystem
  // without it rather than silently buffer.
  std::string probe = root + "/.direct-probe";
  int fd = ::open(probe.c_str(), O_RDWR | O_CREAT | O_DIRECT | O_CLOEXEC, 0644);
  int err = errno;
  unlink(probe.c_str());
  if (fd < 0)
    throw Error(err == EINVAL ? Code::kInvalidArgument : Code::kIoError,
                "spill directory " + root + " does not support O_DIRECT: " + strerror(err));
  ::close(fd);
}

void Tier::Impl::close_dirs() {
  for (int& fd : sub_fd)
    if (fd >= 0) ::close(fd), fd = -1;
  if (tomb_fd >= 0) ::close(tomb_fd), tomb_fd = -1;
  if (lock_fd >= 0) ::close(lock_fd), lock_fd = -1;  // releases the flock
}

bool Tier::Impl::root_exists() const {
  struct stat st;
  return stat(opt.directory.c_str(), &st) == 0 && st.st_dev == root_dev && st.st_ino == root_ino;
}

std::string Tier::Impl::path_of(uint64_t slot) const {
  return opt.directory + "/" + kHex[subdir_of(slot)] + "/" + slot_name(slot);
}

Space Tier::Impl::reserve_space(uint64_t need) {
  Space s;
  std::lock_guard<std::mutex> g(mu);
  const uint64_t cap = opt.capacity_bytes;
  if (used + need > cap) return s;
  // A free slot to overwrite: the same size, else the smallest larger (truncated), else
  // the largest smaller (extended). Any of them beats creating an inode.
  auto it = pool.lower_bound(need);
  if (it == pool.end() && !pool.empty()) it = std::prev(pool.end());
  if (it != pool.end()) {
    s.from_pool = true;
    s.file = it->second;
    s.pool_size = it->first;
    pool_bytes -= it->first;
    pool.erase(it);
    if (s.file.stale_seq) rewriting.insert(s.file.stale_seq);
  }
  // Keep the disk within capacity: delete other free slots, largest first.
  while (used + pool_bytes + need > cap && !pool.empty()) {
    auto last = std::prev(pool.end());
    s.trim.push_back(last->second);
    pool_bytes -= last->first;
    pool.erase(last);
  }
  used += need;
  s.ok = true;
  return s;
}

void Tier::Impl::end_write(const Op& op) {
  if (!op.stale_seq) return;
  std::lock_guard<std::mutex> g(mu);
  auto it = rewriting.find(op.stale_seq);
  if (it != rewriting.end()) rewriting.erase(it);
}

void Tier::Impl::unlink_slots(const std::vector<uint64_t>& slots) {
  for (uint64_t slot : slots) unlinkat(dir_of(slot), slot_name(slot).c_str(), 0);
}

void Tier::Impl::release(uint64_t bytes) {
  std::lock_guard<std::mutex> g(mu);
  used -= bytes;
}

uint64_t Tier::Impl::used_now() const {
  std::lock_guard<std::mutex> g(mu);
  return used;
}

void Tier::Impl::degrade(const std::string& reason) {
  std::lock_guard<std::mutex> g(mu);
  if (degraded_reason.empty()) degraded_reason = reason;  // the first cause is the useful one
}

bool Tier::Impl::is_degraded() const {
  std::lock_guard<std::mutex> g(mu);
  return !degraded_reason.empty();
}

std::string Tier::Impl::degraded_text() const {
  std::lock_guard<std::mutex> g(mu);
  return degraded_reason;
}

bool Tier::Impl::lookup(const std::string& key, Entry* e) const {
  std::lock_guard<std::mutex> g(mu);
  auto it = index.find(key);
  if (it == index.end()) return false;
  *e = it->second;
  return true;
}

void Tier::Impl::commit_write(Op& op) {
  // The newest write of a key wins (the largest seq), which is also what a scan concludes
  // from the slots if we crash before the loser's tombstone is written.
  std::vector<uint64_t> unlink;
  {
    std::lock_guard<std::mutex> g(mu);
    auto [it, inserted] = index.try_emplace(*op.key, op.entry);
    if (!inserted) {
      Entry loser = op.entry;
      if (it->second.seq < op.entry.seq) std::swap(loser, it->second);
      used -= loser.bytes();
      pool_bytes += loser.bytes();
      retire_locked(loser, &unlink);
    }
  }
  unlink_slots(unlink);
}

void Tier::Impl::retire_locked(const Entry& e, std::vector<uint64_t>* unlink) {
  // The tombstone is in the log (page cache) before the slot can be reused, so a crashed
  // process never brings a removed object back. If it cannot be written, delete the file.
  if (!tomb_append_locked(e.seq)) {
    pool_bytes -= e.bytes();
    unlink->push_back(e.slot);
    return;
  }
  pool.emplace(e.bytes(), PoolFile{e.slot, e.seq});
  maybe_compact_locked();
}

bool Tier::Impl::drop_invalid(const std::string& key, const Entry& e, bool unlink_file) {
  {
    std::lock_guard<std::mutex> g(mu);
    auto it = index.find(key);
    if (it == index.end() || it->second.seq != e.seq) return false;
    used -= it->second.bytes();
    index.erase(it);
  }
  // Out of the index and never pooled, the slot is ours alone: no one can reuse it.
  if (unlink_file && unlinkat(dir_of(e.slot), slot_name(e.slot).c_str(), 0) == 0)
    ctr.files_deleted_invalid++;
  return true;
}

std::unique_ptr<Context> Tier::Impl::take_context() {
  {
    std::lock_guard<std::mutex> g(ctx_mu);
    if (!idle.empty()) {
      auto c = std::move(idle.back());
      idle.pop_back();
      return c;
    }
  }
  auto c = std::make_unique<Context>();
  c->q = uring ? IoQueue::uring(opt.queue_depth) : IoQueue::sync();
  c->slots = opt.queue_depth;
  c->slot_mem = AlignedBuf(size_t(c->slots) * (kMaxHeaderBytes + kBlock));
  for (int i = static_cast<int>(c->slots) - 1; i >= 0; --i) c->free_slots.push_back(i);
  c->chunk = opt.chunk_bytes;
  c->max_staging = 2 * size_t(opt.queue_depth);
  return c;
}

void Tier::Impl::give_context(std::unique_ptr<Context> c) {
  std::lock_guard<std::mutex> g(ctx_mu);
  idle.push_back(std::move(c));
}

void Tier::Impl::execute(std::vector<Op>& ops) {
  if (ops.empty()) return;
  auto c = take_context();
  run_batch(*this, *c, ops);  // on an exception the context is dropped, not reused
  give_context(std::move(c));
}

void Tier::Impl::execute_in_slices(std::vector<Op>& ops, size_t slice) {
  // Units and per-op state are allocated per run: bound them for scans of many files.
  std::vector<Op> part;
  for (size_t b = 0; b < ops.size(); b += slice) {
    size_t e = std::min(ops.size(), b + slice);
    part.assign(std::make_move_iterator(ops.begin() + b), std::make_move_iterator(ops.begin() + e));
    execute(part);
    for (size_t i = b; i < e; ++i) {
      ops[i] = std::move(part[i - b]);
      ops[i].units.clear();
      ops[i].units.shrink_to_fit();
    }
  }
}

// ---- public face -------------------------------------------------------------------

Tier::Tier(const Options& options) : impl_(std::make_unique<Impl>(options)) {
  impl_->open_dirs(true);
  impl_->scan_locked(false);
}

Tier::~Tier() = default;

namespace {
void check_open(const Tier::Impl& t) {
  if (t.closed) throw Error(Code::kShutdown, "spill tier " + t.opt.directory + " is closed");
}
}  // namespace

std::vector<Result> Tier::write_many(const std::vector<WriteRequest>& reqs) {
  std::shared_lock<std::shared_mutex> life(impl_->life_mu);
  check_open(*impl_);
  std::vector<Op> ops(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    Op& op = ops[i];
    op.kind = OpKind::kWrite;
    op.key = &reqs[i].key;
    op.gen = reqs[i].gen;
    op.mem = const_cast<uint8_t*>(static_cast<const uint8_t*>(reqs[i].src));
    op.length = reqs[i].length;
  }
  impl_->execute(ops);
  std::vector<Result> out(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) out[i] = std::move(ops[i].result);
  return out;
}

std::vector<Result> Tier::read_many(const std::vector<ReadRequest>& reqs) {
  std::shared_lock<std::shared_mutex> life(impl_->life_mu);
  check_open(*impl_);
  std::vector<Op> ops(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    Op& op = ops[i];
    op.kind = OpKind::kRead;
    op.key = &reqs[i].key;
    op.mem = static_cast<uint8_t*>(reqs[i].dst);
    op.length = reqs[i].length;
  }
  impl_->execute(ops);
  std::vector<Result> out(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) out[i] = std::move(ops[i].result);
  return out;
}

void Tier::write(const WriteRequest& req) {
  Result r = std::move(write_many({req})[0]);
  if (r.code != Code::kOk) throw Error(r.code, r.message);
}

uint64_t Tier::read(const ReadRequest& req) {
  Result r = std::move(read_many({req})[0]);
  if (r.code != Code::kOk) throw Error(r.code, r.message);
  return r.gen;
}

bool Tier::remove(const std::string& key) {
  std::shared_lock<std::shared_mutex> life(impl_->life_mu);
  check_open(*impl_);
  Entry e;
  std::vector<uint64_t> unlink;
  {
    std::lock_guard<std::mutex> g(impl_->mu);
    auto it = impl_->index.find(key);
    if (it == impl_->index.end()) return false;
    e = it->second;
    impl_->used -= e.bytes();
    impl_->pool_bytes += e.bytes();
    impl_->index.erase(it);
    impl_->retire_locked(e, &unlink);
  }
  impl_->unlink_slots(unlink);
  impl_->ctr.removes++;
  return true;
}

bool Tier::contains(const std::string& key) const {
  std::lock_guard<std::mutex> g(impl_->mu);
  return impl_->index.count(key) != 0;
}

std::optional<ObjectInfo> Tier::info(const std::string& key) const {
  Entry e;
  if (!impl_->lookup(key, &e)) return std::nullopt;
  return ObjectInfo{key, e.gen, e.length};
}

std::vector<ObjectInfo> Tier::list() const {
  std::lock_guard<std::mutex> g(impl_->mu);
  std::vector<ObjectInfo> out;
  out.reserve(impl_->index.size());
  for (auto& [k, e] : impl_->index) out.push_back(ObjectInfo{k, e.gen, e.length});
  return out;
}

std::vector<ObjectInfo> Tier::scan(bool verify_data) {
  std::unique_lock<std::shared_mutex> life(impl_->life_mu);
  check_open(*impl_);
  if (!impl_->root_exists()) {
    impl_->degrade("spill directory " + impl_->opt.directory + " was removed");
    throw Error(Code::kDegraded, "spill directory " + impl_->opt.directory + " was removed");
  }
  return impl_->scan_locked(verify_data);
}

bool Tier::Impl::dirs_intact() const {
  if (!root_exists()) return false;
  struct stat a, b;
  for (unsigned i = 0; i < kSubdirs; ++i) {
    std::string p = opt.directory + "/" + kHex[i];
    if (stat(p.c_str(), &a) != 0 || fstat(sub_fd[i], &b) != 0 || a.st_ino != b.st_ino)
      return false;
  }
  return true;
}

bool Tier::recover() {
  std::unique_lock<std::shared_mutex> life(impl_->life_mu);
  check_open(*impl_);
  try {
    // Cheap when the directory is intact (ENOSPC, EIO): clear the flag and let the next
    // write find out. A removed or replaced directory is recreated and rescanned.
    if (!impl_->dirs_intact()) {
      impl_->open_dirs(true);
      impl_->scan_locked(false);
    }
  } catch (const Error& e) {
    impl_->degrade(e.what());
    return false;
  }
  std::lock_guard<std::mutex> g(impl_->mu);
  impl_->degraded_reason.clear();
  return true;
}

uint64_t Tier::capacity_bytes() const { return impl_->opt.capacity_bytes; }
uint64_t Tier::used_bytes() const { return impl_->used_now(); }

uint64_t Tier::num_keys() const {
  std::lock_guard<std::mutex> g(impl_->mu);
  return impl_->index.size();
}

std::optional<std::string> Tier::degraded() const {
  std::string s = impl_->degraded_text();
  if (s.empty()) return std::nullopt;
  return s;
}

Stats Tier::stats() const {
  const Counters& c = impl_->ctr;
  Stats s;
  s.writes = c.writes, s.write_bytes = c.write_bytes, s.write_errors = c.write_errors;
  s.write_latency_ns = c.write_latency_ns;
  s.reads = c.reads, s.read_bytes = c.read_bytes, s.read_errors = c.read_errors;
  s.read_latency_ns = c.read_latency_ns;
  s.not_found = c.not_found, s.checksum_failures = c.checksum_failures;
  s.removes = c.removes, s.capacity_rejections = c.capacity_rejections;
  s.files_deleted_invalid = c.files_deleted_invalid;
  s.recycled_writes = c.recycled_writes, s.created_writes = c.created_writes;
  {
    std::lock_guard<std::mutex> g(impl_->mu);
    s.pool_files = impl_->pool.size(), s.pool_bytes = impl_->pool_bytes;
    s.tombstones = impl_->tomb_records;
  }
  return s;
}

bool Tier::uses_uring() const { return impl_->uring; }

void Tier::inject_io_error(bool write, int err, unsigned count) {
  impl_->inject_err[write] = err;
  impl_->inject_count[write] = count;
}

void Tier::close() {
  std::unique_lock<std::shared_mutex> life(impl_->life_mu);
  if (impl_->closed) return;
  impl_->closed = true;
  impl_->close_dirs();
  std::lock_guard<std::mutex> g(impl_->ctx_mu);
  impl_->idle.clear();
}

}  // namespace mcr::spill
