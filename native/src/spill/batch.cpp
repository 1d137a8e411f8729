// The spill I/O executor: runs a batch of operations over one I/O queue.
//
// Every op is split into units (one I/O each). A unit goes
//   new --prepare--> ready --push--> in flight --complete--> landed --post--> done
// where prepare and post are the CPU work: a write's CRC (and copy, for unaligned memory)
// happens at prepare, a read's CRC (and copy out) at post. The loop below keeps the queue
// full first and does CPU work while I/O is in flight, one unit at a time, looking at the
// completion ring in between (no system call), so a checksum never leaves the disk idle:
//
//   reap (no wait) -> activate ops (open files) -> push ready units, submit
//     -> one unit of CPU work (prepare a write unit if the queue has room, else post a
//        landed unit, else prepare ahead) -> ... -> nothing to do: wait for a completion
//
// At most `slots` ops are active (file open, header/tail buffers held) and at most
// capacity() units in flight. Units of one op are prepared and pushed in order; a write's
// header goes last (with the only chunk, or as its own unit after all chunks), so a file
// whose header is valid had all of its data written first.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>

#include "mcr/spill_crc32c.h"
#include "mcr/spill_internal.h"

namespace mcr::spill {
namespace {

bool is_disk_errno(int e) {
  return e == ENOSPC || e == EDQUOT || e == EIO || e == EROFS || e == ENOENT || e == ENOTDIR ||
         e == ESTALE || e == EUCLEAN || e == ENXIO || e == ENODEV;
}

Code code_for_errno(int e) { return (e == ENOSPC || e == EDQUOT) ? Code::kNoSpace : Code::kIoError; }

std::string show_key(const std::string* k) {
  if (!k) return "?";
  return k->size() <= 120 ? "'" + *k + "'" : "'" + k->substr(0, 120) + "...'";
}

class Batch {
 public:
  Batch(Tier::Impl& t, Context& c, std::vector<Op>& ops)
      : t_(t), c_(c), q_(*c.q), ops_(ops), chunk_op_(crc32c_shift_op(c.chunk)) {}
  void run();

 private:
  uint32_t nchunks(const Op& op) const {
    return op.length ? static_cast<uint32_t>((op.length + c_.chunk - 1) / c_.chunk) : 1;
  }
  uint64_t chunk_len(const Op& op, uint32_t i) const {
    return std::min<uint64_t>(c_.chunk, op.length - uint64_t(i) * c_.chunk);
  }
  std::string path(const Op& op) const { return t_.path_of(op.entry.slot); }

  bool can_activate() const;
  void activate(Op& op);
  bool activate_write(Op& op);
  bool activate_read(Op& op);
  bool activate_header(Op& op);
  bool open_recycled(Op& op, const Space& sp);
  void finish(Op& op);
  void finish_write(Op& op);
  void finish_read(Op& op);
  void fail(Op& op, Code code, const std::string& msg);
  void fail_errno(Op& op, int err, const std::string& what);
  void unit_done(Unit& u);

  void fill();
  bool prepare_one();
  bool prepare_write(Unit& u);
  bool prepare_read(Unit& u);
  void set_data_iov(Op& op, Unit& u, uint32_t i, bool with_header);
  void complete(Unit& u, int res);
  void post(Unit& u);
  void post_read(Unit& u);
  void post_header(Unit& u);
  void reap(bool wait);

  Tier::Impl& t_;
  Context& c_;
  IoQueue& q_;
  std::vector<Op>& ops_;
  const uint32_t chunk_op_;
  std::vector<Op*> active_;
  std::deque<Unit*> landed_;
  size_t next_op_ = 0, finished_ = 0;
  unsigned ready_ = 0;  // prepared, not yet pushed
  std::vector<std::pair<IoReq*, int>> done_;
};

void Batch::run() {
  while (finished_ < ops_.size()) {
    reap(false);
    while (can_activate()) activate(ops_[next_op_++]);
    fill();
    if (finished_ == ops_.size()) break;
    bool room = q_.inflight() < q_.capacity();
    if (room && prepare_one()) continue;
    if (!landed_.empty()) {
      Unit* u = landed_.front();
      landed_.pop_front();
      post(*u);
      continue;
    }
    if (prepare_one()) continue;
    if (q_.inflight() == 0) {
      // Nothing in flight, nothing to do: only a bug gets here. Fail what is left rather
      // than spin (no I/O is outstanding, so the buffers can be released).
      for (Op* op : std::vector<Op*>(active_)) fail(*op, Code::kInternal, "spill batch stalled");
      continue;
    }
    reap(true);
  }
}

bool Batch::can_activate() const {
  if (next_op_ >= ops_.size() || c_.free_slots.empty()) return false;
  size_t unpushed = 0;
  for (const Op* op : active_)
    if (!op->failed) unpushed += op->units.size() - op->next_push;
  // Writes: open the next file while the current one is being checksummed, not 32 ahead.
  size_t room = q_.capacity() - q_.inflight();
  size_t want = ops_[next_op_].kind == OpKind::kWrite ? std::min<size_t>(room, 2) : room;
  return unpushed < std::max<size_t>(want, 1);
}

void Batch::activate(Op& op) {
  op.t0 = mono_ns();
  op.slot = c_.free_slots.back();
  c_.free_slots.pop_back();
  op.hdr = c_.slot_mem.data() + size_t(op.slot) * (kMaxHeaderBytes + kBlock);
  op.tail = op.hdr + kMaxHeaderBytes;
  bool ok = op.kind == OpKind::kWrite    ? activate_write(op)
            : op.kind == OpKind::kHeader ? activate_header(op)
                                         : activate_read(op);
  if (!ok) {
    if (!op.finished) finish(op);
    return;
  }
  uint32_t n = op.kind == OpKind::kHeader ? 1 : nchunks(op);
  size_t units = n + (op.kind == OpKind::kWrite && n > 1 ? 1 : 0);
  op.units.assign(units, Unit{});
  for (uint32_t i = 0; i < units; ++i) {
    op.units[i].op = &op;
    op.units[i].index = i;
    op.units[i].fd = op.fd;
  }
  op.remaining = static_cast<uint32_t>(units);
  if (op.kind == OpKind::kRead || op.kind == OpKind::kVerify) op.chunk_crc.assign(n, 0);
  op.crc = ~0u;
  op.direct = op.mem && op.kind != OpKind::kVerify &&
              (reinterpret_cast<uintptr_t>(op.mem) % kBlock) == 0;
  active_.push_back(&op);
}

bool Batch::activate_write(Op& op) {
  const std::string& key = *op.key;
  if (key.empty() || key.size() > kMaxKeyBytes) {
    fail(op, Code::kInvalidArgument,
         "spill key must be 1.." + std::to_string(kMaxKeyBytes) + " bytes, got " +
             std::to_string(key.size()));
    return false;
  }
  if (!op.mem && op.length) {
    fail(op, Code::kInvalidArgument, "spill write of " + show_key(op.key) + ": null source");
    return false;
  }
  if (t_.is_degraded()) {
    fail(op, Code::kDegraded, "spill tier is degraded (" + t_.degraded_text() + ")");
    return false;
  }
  Entry& e = op.entry;
  e.gen = op.gen;
  e.length = op.length;
  e.header_blocks = header_blocks_for(key.size());
  e.write_time_ns = wall_ns();
  e.seq = t_.next_seq++;
  Space sp = t_.reserve_space(e.bytes());
  if (!sp.ok) {
    t_.ctr.capacity_rejections++;
    fail(op, Code::kNoSpace,
         "spill capacity exceeded: writing " + show_key(op.key) + " needs " +
             std::to_string(e.bytes()) + " bytes, " + std::to_string(t_.used_now()) + " of " +
             std::to_string(t_.opt.capacity_bytes) + " used");
    return false;
  }
  op.reserved = true;
  if (!sp.trim.empty()) {
    std::vector<uint64_t> slots;
    for (const PoolFile& f : sp.trim) slots.push_back(f.slot);
    t_.unlink_slots(slots);
  }
  if (sp.from_pool && open_recycled(op, sp)) return !op.failed;
  if (op.failed) return false;
  for (int attempt = 0;; ++attempt) {
    e.slot = t_.next_slot++;
    op.fd = openat(t_.dir_of(e.slot), slot_name(e.slot).c_str(),
                   O_WRONLY | O_CREAT | O_EXCL | O_DIRECT | O_CLOEXEC, 0644);
    if (op.fd >= 0) break;
    if (errno != EEXIST || attempt > 3) {
      fail_errno(op, errno, "create " + path(op));
      return false;
    }
  }
  op.created = true;
  // Allocate all blocks at once: the chunk writes then stay inside the file (no extending
  // writes serialised on the inode), and a full disk shows here, before any data moves.
  if (fallocate(op.fd, 0, 0, static_cast<off_t>(e.bytes())) != 0 && errno != EOPNOTSUPP) {
    fail_errno(op, errno, "allocate " + std::to_string(e.bytes()) + " bytes for " + path(op));
    return false;
  }
  return true;
}

// True when the slot was taken (opened, or failed for good: see op.failed); false when it
// vanished and the caller should create a new file.
bool Batch::open_recycled(Op& op, const Space& sp) {
  // Overwriting blocks that are already allocated and written is the fast O_DIRECT path
  // (no allocation, no unwritten-extent conversion, no inode creation): what fio measures.
  // The slot's stale header stays tombstoned until ours replaces it, last.
  uint64_t need = op.entry.bytes();
  op.entry.slot = sp.file.slot;
  op.recycled = true;
  op.stale_seq = sp.file.stale_seq;
  op.fd = openat(t_.dir_of(op.entry.slot), slot_name(op.entry.slot).c_str(),
                 O_WRONLY | O_DIRECT | O_CLOEXEC);
  if (op.fd < 0) {
    int err = errno;
    if (err == ENOENT && t_.root_exists()) {  // deleted behind our back: create instead
      t_.end_write(op);
      op.recycled = false;
      op.stale_seq = 0;
      return false;
    }
    fail_errno(op, err, "open free slot " + path(op));
    return true;
  }
  op.created = true;  // from here on ours: deleted if the write fails
  int rc = 0;
  if (sp.pool_size > need)
    rc = ftruncate(op.fd, static_cast<off_t>(need));
  else if (sp.pool_size < need)
    rc = fallocate(op.fd, 0, 0, static_cast<off_t>(need));
  if (rc != 0) {
    fail_errno(op, errno, "resize free slot " + path(op));
  }
  return true;
}

bool Batch::activate_read(Op& op) {
  for (;;) {
    if (op.kind == OpKind::kVerify) {  // scan: the entry comes from the header, not the index
      op.length = op.entry.length;
    } else if (!t_.lookup(*op.key, &op.entry)) {
      fail(op, Code::kNotFound, "spill: no object " + show_key(op.key));
      return false;
    }
    if (op.kind == OpKind::kRead && !op.mem && op.length) {
      fail(op, Code::kInvalidArgument, "spill read of " + show_key(op.key) + ": null destination");
      return false;
    }
    if (op.kind == OpKind::kRead && op.entry.packed()) {  // packed since the caller looked: its turn
      fail(op, Code::kNotFound, "spill: object " + show_key(op.key) + " is packed");
      return false;
    }
    if (op.kind == OpKind::kRead && op.entry.length != op.length) {
      fail(op, Code::kInvalidArgument,
           "spill read of " + show_key(op.key) + ": buffer length " + std::to_string(op.length) +
               " != stored length " + std::to_string(op.entry.length));
      return false;
    }
    op.length = op.entry.length;
    op.fd = openat(t_.dir_of(op.entry.slot), slot_name(op.entry.slot).c_str(),
                   O_RDONLY | O_DIRECT | O_CLOEXEC);
    if (op.fd >= 0) return true;
    int err = errno;
    if (err != ENOENT) {
      fail_errno(op, err, "open " + path(op));
      return false;
    }
    if (op.kind == OpKind::kVerify) {
      fail(op, Code::kNotFound, "file vanished: " + path(op));
      return false;
    }
    // Replaced since the lookup: look again. Else the file was deleted under us.
    Entry now;
    if (t_.lookup(*op.key, &now) && now.seq != op.entry.seq && ++op.retries < 8) continue;
    if (!t_.root_exists())
      t_.degrade("spill directory " + t_.opt.directory + " was removed");
    t_.drop_invalid(*op.key, op.entry, false);
    fail(op, Code::kNotFound, "spill: object " + show_key(op.key) + " vanished (" + path(op) + ")");
    return false;
  }
}

bool Batch::activate_header(Op& op) {
  op.fd = openat(t_.dir_of(op.entry.slot), slot_name(op.entry.slot).c_str(),
                 O_RDONLY | O_DIRECT | O_CLOEXEC);
  struct stat st;
  if (op.fd < 0 || fstat(op.fd, &st) != 0) {
    fail_errno(op, errno, "open " + path(op));
    return false;
  }
  op.file_size = static_cast<uint64_t>(st.st_size);
  return true;
}

void Batch::fail(Op& op, Code code, const std::string& msg) {
  if (op.failed) return;
  op.failed = true;
  op.result.code = code;
  op.result.message = msg;
  // Units not yet in flight will never be: release them now.
  for (size_t i = op.next_push; i < op.units.size(); ++i) {
    Unit& u = op.units[i];
    if (i < op.next_prep) --ready_;
    if (u.staging) c_.put_staging(u.staging), u.staging = nullptr;
    --op.remaining;
  }
  op.next_prep = op.next_push = static_cast<uint32_t>(op.units.size());
  if (op.remaining == 0 && !op.units.empty() && !op.finishing) finish(op);
}

void Batch::fail_errno(Op& op, int err, const std::string& what) {
  std::string msg = what + ": " + strerror(err);
  if (is_disk_errno(err) && op.kind != OpKind::kHeader) {
    if (err == ENOENT && !t_.root_exists())
      t_.degrade("spill directory " + t_.opt.directory + " was removed");
    else
      t_.degrade(msg);
  }
  fail(op, code_for_errno(err), msg);
}

void Batch::unit_done(Unit& u) {
  if (u.staging) c_.put_staging(u.staging), u.staging = nullptr;
  Op& op = *u.op;
  if (--op.remaining == 0) finish(op);
}

void Batch::finish(Op& op) {
  op.finishing = true;  // a failure found while finishing must not finish it again
  if (op.fd >= 0) close(op.fd), op.fd = -1;
  if (op.kind == OpKind::kWrite)
    finish_write(op);
  else if (op.kind != OpKind::kHeader)
    finish_read(op);
  c_.free_slots.push_back(op.slot);
  op.slot = -1;
  auto it = std::find(active_.begin(), active_.end(), &op);
  if (it != active_.end()) active_.erase(it);
  op.finished = true;
  ++finished_;
}

void Batch::finish_write(Op& op) {
  uint64_t dt = mono_ns() - op.t0;
  const Entry& e = op.entry;
  if (op.failed) {
    // Error path: the slot is not worth keeping (its blocks may be the problem). Deleted
    // before its stale header stops being protected by a tombstone.
    if (op.created) t_.unlink_slots({e.slot});
    if (op.recycled) t_.end_write(op);
    if (op.reserved) t_.release(e.bytes());
    t_.ctr.write_errors++;
    return;
  }
  if (op.recycled) t_.end_write(op);  // our header replaced the stale one
  (op.recycled ? t_.ctr.recycled_writes : t_.ctr.created_writes)++;
  t_.ctr.write_latency_ns += dt;
  if (op.members) {  // a pack: its objects are what was written
    t_.commit_pack(op);
    t_.ctr.writes += op.members->size();
    for (const PackMember& m : *op.members) t_.ctr.write_bytes += m.length;
    return;
  }
  t_.commit_write(op);
  t_.ctr.writes++;
  t_.ctr.write_bytes += op.length;
}

void Batch::finish_read(Op& op) {
  if (!op.failed) {
    uint32_t fold = 0;  // raw register of the data from 0, chunk by chunk
    for (size_t i = 0; i < op.chunk_crc.size(); ++i) {
      uint64_t n = chunk_len(op, static_cast<uint32_t>(i));
      fold = (n == c_.chunk ? crc32c_apply_shift(chunk_op_, fold) : crc32c_shift(fold, n)) ^
             op.chunk_crc[i];
    }
    uint32_t crc = ~(crc32c_shift(~0u, op.length) ^ fold);
    if (crc != op.header.data_crc)
      fail(op, Code::kChecksumMismatch,
           "spill: data checksum mismatch in " + path(op) + " (key " + show_key(op.key) + ")");
    else
      op.result.gen = op.header.gen;
  }
  if (op.kind != OpKind::kRead) return;  // kVerify: scan decides
  if (op.failed && op.result.code == Code::kChecksumMismatch) {
    if (t_.drop_invalid(*op.key, op.entry, true)) {
      t_.ctr.checksum_failures++;
    } else {
      // Removed or replaced while we read, and its slot reused under us: a miss, but not
      // a corrupt file.
      op.result.code = Code::kNotFound;
      op.result.message = "spill: object " + show_key(op.key) + " changed while being read";
    }
  }
  if (op.failed) {
    if (op.result.code == Code::kNotFound)
      t_.ctr.not_found++;
    else
      t_.ctr.read_errors++;
    return;
  }
  t_.ctr.reads++;
  t_.ctr.read_bytes += op.length;
  t_.ctr.read_latency_ns += mono_ns() - op.t0;
}

void Batch::fill() {
  bool pushed = false;
  while (q_.inflight() < q_.capacity()) {
    Unit* u = nullptr;
    for (Op* op : active_) {
      if (op->failed) continue;
      if (op->next_push == op->next_prep && op->kind != OpKind::kWrite &&
          op->next_prep < op->units.size()) {
        if (!prepare_read(op->units[op->next_prep])) break;  // out of staging
        ++op->next_prep;
        ++ready_;
      }
      if (op->next_push < op->next_prep) {
        u = &op->units[op->next_push++];
        break;
      }
    }
    if (!u) break;
    --ready_;
    q_.push(u);
    pushed = true;
  }
  if (pushed) q_.submit();
}

bool Batch::prepare_one() {
  if (ready_ >= q_.capacity()) return false;
  for (Op* op : active_) {
    if (op->failed || op->kind != OpKind::kWrite || op->next_prep >= op->units.size()) continue;
    if (!prepare_write(op->units[op->next_prep])) return false;
    ++op->next_prep;
    ++ready_;
    return true;
  }
  return false;
}

void Batch::set_data_iov(Op& op, Unit& u, uint32_t i, bool with_header) {
  uint64_t d = uint64_t(i) * c_.chunk, n = chunk_len(op, i);
  u.iovcnt = 0;
  auto add = [&u](void* p, size_t len) { u.iov[u.iovcnt++] = iovec{p, len}; };
  if (with_header) add(op.hdr, op.entry.header_bytes());
  if (u.staging) {
    if (n) add(u.staging, round_up(n));
  } else {
    uint64_t whole = n & ~(kBlock - 1);
    if (whole) add(op.mem + d, whole);
    if (n > whole) add(op.tail, kBlock);
  }
  u.offset = with_header ? 0 : op.entry.header_bytes() + d;
  u.want = u.bytes();
}

bool Batch::prepare_write(Unit& u) {
  Op& op = *u.op;
  uint32_t n = nchunks(op);
  u.write = true;
  if (u.index == n) {  // the header of a multi-chunk object, after all chunks' CRCs
    Header h{*op.key, op.gen, op.length, op.entry.seq, op.entry.write_time_ns, ~op.crc, 0, op.flags};
    encode_header(h, op.hdr);
    u.iov[0] = iovec{op.hdr, op.entry.header_bytes()};
    u.iovcnt = 1;
    u.offset = 0;
    u.want = u.bytes();
    return true;
  }
  uint64_t d = uint64_t(u.index) * c_.chunk, len = chunk_len(op, u.index);
  const uint8_t* src = op.mem + d;
  if (!op.direct) {
    if (!(u.staging = c_.get_staging())) return false;
    op.crc = crc32c_copy_raw(op.crc, u.staging, src, len);
    std::memset(u.staging + len, 0, round_up(len) - len);
  } else {
    op.crc = crc32c_raw(op.crc, src, len);
    uint64_t whole = len & ~(kBlock - 1);
    if (len > whole) {  // the partial last block: bounced, so no bytes past the object leave
      std::memcpy(op.tail, src + whole, len - whole);
      std::memset(op.tail + (len - whole), 0, kBlock - (len - whole));
    }
  }
  if (n == 1) {
    Header h{*op.key, op.gen, op.length, op.entry.seq, op.entry.write_time_ns, ~op.crc, 0, op.flags};
    encode_header(h, op.hdr);
  }
  set_data_iov(op, u, u.index, n == 1);
  return true;
}

bool Batch::prepare_read(Unit& u) {
  Op& op = *u.op;
  u.write = false;
  if (op.kind == OpKind::kHeader) {
    u.iov[0] = iovec{op.hdr, kMaxHeaderBytes};
    u.iovcnt = 1;
    u.offset = 0;
    u.want = kMaxHeaderBytes;
    return true;
  }
  if (!op.direct && op.length && !(u.staging = c_.get_staging())) return false;
  set_data_iov(op, u, u.index, u.index == 0);
  return true;
}

void Batch::reap(bool wait) {
  done_.clear();
  q_.reap(&done_, wait);
  for (auto& [req, res] : done_) complete(*static_cast<Unit*>(req), res);
}

void Batch::complete(Unit& u, int res) {
  Op& op = *u.op;
  if (int injected = t_.take_injected(u.write)) res = -injected;
  if (op.failed) return unit_done(u);
  if (res < 0) {
    fail_errno(op, -res, std::string(u.write ? "write " : "read ") + path(op));
    return unit_done(u);
  }
  u.got += static_cast<size_t>(res);
  if (op.kind == OpKind::kHeader || u.got >= u.want) {  // a header read may stop at EOF
    landed_.push_back(&u);
    return;
  }
  if (res == 0) {  // end of file (reads) or a device that takes nothing (writes)
    if (u.write)
      fail_errno(op, EIO, "write " + path(op) + " made no progress");
    else
      fail(op, Code::kChecksumMismatch, "spill: " + path(op) + " is truncated");
    return unit_done(u);
  }
  u.advance(static_cast<size_t>(res));  // short transfer: the rest, in the slot just freed
  q_.push(&u);
  q_.submit();
}

void Batch::post(Unit& u) {
  Op& op = *u.op;
  if (!op.failed) {
    if (op.kind == OpKind::kHeader)
      post_header(u);
    else if (!u.write)
      post_read(u);
  }
  unit_done(u);
}

void Batch::post_read(Unit& u) {
  Op& op = *u.op;
  if (u.index == 0) {
    std::string why;
    Header& h = op.header;
    bool ok = decode_header(op.hdr, op.entry.header_bytes(), &h, &why);
    if (ok && (h.key != *op.key || h.seq != op.entry.seq || h.length != op.entry.length ||
               h.gen != op.entry.gen)) {
      ok = false;
      why = "header does not match the index";
    }
    if (!ok) {
      fail(op, Code::kChecksumMismatch, "spill: invalid header in " + path(op) + ": " + why);
      return;
    }
  }
  uint64_t d = uint64_t(u.index) * c_.chunk, n = chunk_len(op, u.index);
  if (!n) return;
  uint32_t crc;
  if (u.staging) {
    crc = op.mem ? crc32c_copy_raw(0, op.mem + d, u.staging, n) : crc32c_raw(0, u.staging, n);
  } else {
    uint64_t whole = n & ~(kBlock - 1);
    if (n > whole) std::memcpy(op.mem + d + whole, op.tail, n - whole);
    crc = crc32c_raw(0, op.mem + d, n);
  }
  op.chunk_crc[u.index] = crc;
}

void Batch::post_header(Unit& u) {
  Op& op = *u.op;
  std::string why;
  Header& h = op.header;
  if (!decode_header(op.hdr, u.got, &h, &why)) {
    fail(op, Code::kChecksumMismatch, why);
    return;
  }
  uint64_t want = uint64_t(h.header_blocks) * kBlock + round_up(h.length);
  if (op.file_size != want)
    fail(op, Code::kChecksumMismatch,
         "file size " + std::to_string(op.file_size) + ", header says " + std::to_string(want) +
             " (torn or truncated)");
}

}  // namespace

void run_batch(Tier::Impl& t, Context& c, std::vector<Op>& ops) { Batch(t, c, ops).run(); }

}  // namespace mcr::spill
