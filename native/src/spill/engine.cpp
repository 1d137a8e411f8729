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

#include "mcr/spill_crc32c.h"
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

Code code_of_errno(int e) { return (e == ENOSPC || e == EDQUOT) ? Code::kNoSpace : Code::kIoError; }

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
      retire_entry_locked(loser, &unlink);
    }
  }
  unlink_slots(unlink);
}

void Tier::Impl::commit_pack(Op& op) {
  // The pack's file is one slot charged to `used` as a whole (its reservation) for as long
  // as one of its objects is the current version of its key.
  std::vector<uint64_t> unlink;
  {
    std::lock_guard<std::mutex> g(mu);
    const Entry& pe = op.entry;
    Pack& pack = packs[pe.slot];
    pack = Pack{pe.seq, pe.bytes(), 0, {}};
    for (const PackMember& m : *op.members) {
      Entry e{pe.slot, m.seq, m.gen, m.length, pe.write_time_ns, pe.header_blocks,
              pe.header_bytes() + m.off, static_cast<uint32_t>(m.bytes)};
      pack.live++;  // counted first: retiring a loser of this same pack must not free it
      auto [it, inserted] = index.try_emplace(*m.key, e);
      if (inserted) continue;
      Entry loser = e;
      if (it->second.seq < e.seq) std::swap(loser, it->second);
      retire_entry_locked(loser, &unlink);
    }
  }
  unlink_slots(unlink);
}

void Tier::Impl::retire_locked(const Entry& e, std::vector<uint64_t>* unlink) {
  retire_slot_locked(e.slot, e.seq, e.bytes(), unlink);
}

void Tier::Impl::retire_slot_locked(uint64_t slot, uint64_t seq, uint64_t bytes, std::vector<uint64_t>* unlink) {
  // The tombstone is in the log (page cache) before the slot can be reused, so a crashed
  // process never brings a removed object back. If it cannot be written, delete the file.
  if (!tomb_append_locked(seq)) {
    pool_bytes -= bytes;
    unlink->push_back(slot);
    return;
  }
  pool.emplace(bytes, PoolFile{slot, seq});
  maybe_compact_locked();
}

void Tier::Impl::retire_entry_locked(const Entry& e, std::vector<uint64_t>* unlink) {
  if (!e.packed()) {
    used -= e.bytes();
    pool_bytes += e.bytes();
    retire_locked(e, unlink);
    return;
  }
  auto it = packs.find(e.slot);
  if (it == packs.end()) return;
  Pack& pack = it->second;
  // Its tombstone keeps a scan from bringing it back while the pack is on disk (if it
  // cannot be written, a crash may: the record is then still checked like any other).
  tomb_append_locked(e.seq);
  pack.dead.push_back(e.seq);
  pack_dead++;
  if (--pack.live > 0) {
    maybe_compact_locked();
    return;
  }
  // The pack's last object: its slot is free; its records need no tombstone once its own
  // seq has one.
  used -= pack.bytes;
  pool_bytes += pack.bytes;
  pack_dead -= pack.dead.size();
  uint64_t seq = pack.seq, bytes = pack.bytes;
  packs.erase(it);
  retire_slot_locked(e.slot, seq, bytes, unlink);
}

bool Tier::Impl::drop_invalid(const std::string& key, const Entry& e, bool unlink_file) {
  if (e.packed()) {  // the pack's other records are checked on their own
    std::vector<uint64_t> unlink;
    {
      std::lock_guard<std::mutex> g(mu);
      auto it = index.find(key);
      if (it == index.end() || it->second.seq != e.seq) return false;
      index.erase(it);
      retire_entry_locked(e, &unlink);
    }
    unlink_slots(unlink);
    return true;
  }
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
  // Small objects are packed (spill_format.h): their records, up to kPackBytes a pack.
  std::vector<std::vector<PackMember>> groups;
  std::vector<size_t> own;  // requests written to slots of their own
  uint64_t fill = kPackBytes;
  for (size_t i = 0; i < reqs.size(); ++i) {
    const WriteRequest& r = reqs[i];
    if (!impl_->opt.pack_small || !packable(r.key.size(), r.length) || (!r.src && r.length)) {
      own.push_back(i);
      continue;
    }
    uint64_t n = record_bytes(r.key.size(), r.length);
    if (fill + n > kPackBytes) groups.emplace_back(), fill = 0;
    groups.back().push_back(PackMember{i, &r.key, r.gen, r.length, 0, fill, n});
    fill += n;
  }
  std::vector<AlignedBuf> bufs;
  bufs.reserve(groups.size());
  std::vector<Op> ops(own.size() + groups.size());
  for (size_t j = 0; j < own.size(); ++j) {
    const WriteRequest& r = reqs[own[j]];
    Op& op = ops[j];
    op.kind = OpKind::kWrite;
    op.key = &r.key;
    op.gen = r.gen;
    op.mem = const_cast<uint8_t*>(static_cast<const uint8_t*>(r.src));
    op.length = r.length;
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    auto& members = groups[g];
    const PackMember& last = members.back();
    bufs.emplace_back(last.off + last.bytes);
    for (PackMember& m : members) {
      const WriteRequest& r = reqs[m.req];
      m.seq = impl_->next_seq++;
      Record rec{r.key, r.gen, r.length, m.seq, r.length ? crc32c(r.src, r.length) : 0};
      encode_record(rec, r.src, bufs.back().data() + m.off);
    }
    Op& op = ops[own.size() + g];
    op.kind = OpKind::kWrite;
    op.key = &impl_->pack_key_;
    op.mem = bufs.back().data();
    op.length = last.off + last.bytes;
    op.flags = kFlagPack;
    op.members = &members;
  }
  impl_->execute(ops);
  std::vector<Result> out(reqs.size());
  for (size_t j = 0; j < own.size(); ++j) out[own[j]] = std::move(ops[j].result);
  for (size_t g = 0; g < groups.size(); ++g)
    for (const PackMember& m : groups[g]) out[m.req] = ops[own.size() + g].result;
  return out;
}

std::vector<Result> Tier::read_many(const std::vector<ReadRequest>& reqs) {
  std::shared_lock<std::shared_mutex> life(impl_->life_mu);
  check_open(*impl_);
  std::vector<Result> out(reqs.size());
  std::vector<size_t> own, packed;  // objects in slots of their own: one batch of I/O
  for (size_t i = 0; i < reqs.size(); ++i) {
    Entry e;
    (impl_->lookup(reqs[i].key, &e) && e.packed() ? packed : own).push_back(i);
  }
  if (!packed.empty()) impl_->read_packed_many(reqs, packed, &out);
  std::vector<Op> ops(own.size());
  for (size_t j = 0; j < own.size(); ++j) {
    Op& op = ops[j];
    op.kind = OpKind::kRead;
    op.key = &reqs[own[j]].key;
    op.mem = static_cast<uint8_t*>(reqs[own[j]].dst);
    op.length = reqs[own[j]].length;
  }
  impl_->execute(ops);
  for (size_t j = 0; j < own.size(); ++j) {
    const ReadRequest& r = reqs[own[j]];
    Entry e;  // packed since the lookup (rewritten meanwhile): read it as such
    if (ops[j].result.code == Code::kNotFound && ops[j].entry.packed() && impl_->lookup(r.key, &e) && e.packed())
      out[own[j]] = impl_->read_packed(r.key, r.dst, r.length);
    else
      out[own[j]] = std::move(ops[j].result);
  }
  return out;
}

bool Tier::Impl::finish_packed(const std::string& key, const Entry& e, const uint8_t* blocks, ssize_t got,
                               void* dst, Result* res) {
  Record rec;
  const uint8_t* data = nullptr;
  std::string why;
  uint64_t at = e.pack_off % kBlock;  // blocks start at the record's first block
  bool ok = got >= 0 && uint64_t(got) >= at && decode_record(blocks + at, uint64_t(got) - at, &rec, &data, &why);
  if (ok && (rec.key != key || rec.seq != e.seq || rec.gen != e.gen || rec.length != e.length)) {
    ok = false;
    why = "record does not match the index";
  } else if (ok && (rec.length ? crc32c(data, rec.length) : 0) != rec.data_crc) {
    ok = false;
    why = "data checksum mismatch";
  }
  if (!ok) {
    res->message = why;
    return false;
  }
  if (rec.length) std::memcpy(dst, data, rec.length);
  res->code = Code::kOk;
  res->gen = rec.gen;
  ctr.reads++;
  ctr.read_bytes += rec.length;
  return true;
}

void Tier::Impl::read_packed_many(const std::vector<ReadRequest>& reqs, const std::vector<size_t>& which,
                                  std::vector<Result>* out) {
  // The blocks of each record, read together through an I/O queue (a file per pack opened
  // once); anything unusual (a record moved, vanished, torn or corrupt) is read again the
  // careful way, one by one (read_packed), which also decides what a failure means.
  constexpr size_t kSpan = kPackMaxRecord + 2 * kBlock;
  struct Read : IoReq {
    size_t req = 0;
    Entry e;
    uint8_t* buf = nullptr;
  };
  std::vector<Read> reads;
  std::vector<size_t> careful;
  std::unordered_map<uint64_t, int> fds;  // pack slot -> fd
  for (size_t i : which) {
    const ReadRequest& r = reqs[i];
    Entry e;
    if (!lookup(r.key, &e) || !e.packed() || e.length != r.length || (!r.dst && r.length)) {
      careful.push_back(i);
      continue;
    }
    auto f = fds.find(e.slot);
    int fd = f != fds.end() ? f->second
                            : openat(dir_of(e.slot), slot_name(e.slot).c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
    if (fd < 0) {
      careful.push_back(i);
      continue;
    }
    fds.emplace(e.slot, fd);
    Read rd;
    rd.req = i;
    rd.e = e;
    rd.fd = fd;
    rd.offset = e.pack_off / kBlock * kBlock;
    rd.iovcnt = 1;
    rd.iov[0].iov_len = round_up(e.pack_off + e.rec_bytes) - rd.offset;
    reads.push_back(rd);
  }
  if (!reads.empty()) {
    uint64_t t0 = mono_ns();
    auto c = take_context();
    IoQueue& q = *c->q;
    size_t depth = std::min<size_t>(q.capacity(), reads.size());
    AlignedBuf mem(depth * kSpan);
    std::vector<uint8_t*> bufs;
    for (size_t j = 0; j < depth; ++j) bufs.push_back(mem.data() + j * kSpan);
    size_t next = 0, landed = 0;
    std::vector<std::pair<IoReq*, int>> done;
    while (landed < reads.size()) {
      while (next < reads.size() && !bufs.empty() && q.inflight() < q.capacity()) {
        Read& rd = reads[next++];
        rd.buf = bufs.back();
        bufs.pop_back();
        rd.iov[0].iov_base = rd.buf;
        q.push(&rd);
      }
      q.submit();
      done.clear();
      q.reap(&done, true);
      for (auto& [req, n] : done) {
        Read& rd = *static_cast<Read*>(req);
        const ReadRequest& r = reqs[rd.req];
        ++landed;
        int res = n;
        if (int injected = take_injected(false)) res = -injected;
        if (res < 0) {  // the disk failed: as a slot's read would
          std::string msg = "read " + path_of(rd.e.slot) + ": " + strerror(-res);
          degrade(msg);
          (*out)[rd.req] = Result{code_of_errno(-res), msg, 0};
          ctr.read_errors++;
        } else if (!finish_packed(r.key, rd.e, rd.buf, res, r.dst, &(*out)[rd.req])) {
          careful.push_back(rd.req);
        }
        bufs.push_back(rd.buf);
      }
    }
    give_context(std::move(c));
    ctr.read_latency_ns += mono_ns() - t0;
  }
  for (auto& [slot, fd] : fds) ::close(fd);
  for (size_t i : careful) (*out)[i] = read_packed(reqs[i].key, reqs[i].dst, reqs[i].length);
}

Result Tier::Impl::read_packed(const std::string& key, void* dst, uint64_t length) {
  // A record is at most kPackMaxRecord bytes: the two blocks around it, read at once.
  thread_local AlignedBuf buf(kPackMaxRecord + 2 * kBlock);
  Result res;
  uint64_t t0 = mono_ns();
  auto miss = [&](Code code, const std::string& msg) {
    res.code = code;
    res.message = msg;
    (code == Code::kNotFound ? ctr.not_found : ctr.read_errors)++;
    return res;
  };
  for (int attempt = 0;; ++attempt) {
    Entry e;
    if (!lookup(key, &e)) return miss(Code::kNotFound, "spill: no object '" + key.substr(0, 120) + "'");
    if (!e.packed()) {  // rewritten into a slot of its own meanwhile
      std::vector<ReadRequest> one{ReadRequest{key, dst, length}};
      std::vector<Op> ops(1);
      ops[0].kind = OpKind::kRead, ops[0].key = &one[0].key, ops[0].mem = static_cast<uint8_t*>(dst);
      ops[0].length = length;
      execute(ops);
      return ops[0].result;
    }
    if (e.length != length)
      return miss(Code::kInvalidArgument, "spill read of '" + key.substr(0, 120) + "': buffer length " +
                                              std::to_string(length) + " != stored length " + std::to_string(e.length));
    if (!dst && length) return miss(Code::kInvalidArgument, "spill read of '" + key.substr(0, 120) + "': null destination");
    std::string path = path_of(e.slot);
    int fd = openat(dir_of(e.slot), slot_name(e.slot).c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
    if (fd < 0) {
      int err = errno;
      Entry now;
      if (err == ENOENT && lookup(key, &now) && now.seq != e.seq && attempt < 8) continue;
      if (err != ENOENT) {
        degrade("open " + path + ": " + strerror(err));
        return miss(Code::kIoError, "open " + path + ": " + strerror(err));
      }
      if (!root_exists()) degrade("spill directory " + opt.directory + " was removed");
      drop_invalid(key, e, false);
      return miss(Code::kNotFound, "spill: object '" + key.substr(0, 120) + "' vanished (" + path + ")");
    }
    uint64_t start = e.pack_off / kBlock * kBlock, end = round_up(e.pack_off + e.rec_bytes);
    ssize_t got = pread(fd, buf.data(), end - start, static_cast<off_t>(start));
    int err = got < 0 ? errno : 0;
    ::close(fd);
    if (int injected = take_injected(false)) got = -1, err = injected;
    if (got < 0) {
      degrade("read " + path + ": " + strerror(err));
      return miss(code_of_errno(err), "read " + path + ": " + strerror(err));
    }
    if (!finish_packed(key, e, buf.data(), got, dst, &res)) {
      if (drop_invalid(key, e, false)) {
        ctr.checksum_failures++;
        return miss(Code::kChecksumMismatch, "spill: invalid record in " + path + " (key '" + key.substr(0, 120) +
                                                 "'): " + res.message);
      }
      // Removed or replaced while we read, and its pack's slot reused: a miss, not a corrupt file.
      return miss(Code::kNotFound, "spill: object '" + key.substr(0, 120) + "' changed while being read");
    }
    ctr.read_latency_ns += mono_ns() - t0;
    return res;
  }
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
    impl_->index.erase(it);
    impl_->retire_entry_locked(e, &unlink);
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
    s.packs = impl_->packs.size();
    for (auto& [slot, p] : impl_->packs) s.packed_objects += p.live;
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
