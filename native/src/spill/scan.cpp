// Rebuilding the index from the disk, and the tombstone log that makes it possible to
// recycle slots without renaming or unlinking them (layout in mcr/spill_format.h).
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <unordered_set>

#include "mcr/spill_crc32c.h"
#include "mcr/spill_internal.h"

namespace mcr::spill {
namespace {

// Calls fn(name) for every entry of a directory (by fd; the fd stays open).
template <typename Fn>
void list_dir(int dir_fd, const std::string& what, Fn fn) {
  int fd = dup(dir_fd);
  DIR* d = fd >= 0 ? fdopendir(fd) : nullptr;
  if (!d) {
    if (fd >= 0) ::close(fd);
    throw Error(Code::kIoError, "list " + what + ": " + strerror(errno));
  }
  rewinddir(d);
  while (dirent* de = readdir(d))
    if (de->d_name[0] != '.') fn(std::string(de->d_name));
  closedir(d);
}

}  // namespace

// ---- tombstone log -------------------------------------------------------------------

void Tier::Impl::tomb_open() {
  std::string path = opt.directory + "/TOMBSTONES";
  tomb_fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (tomb_fd < 0)
    throw Error(Code::kIoError, "open " + path + ": " + strerror(errno));
  struct stat st;
  if (fstat(tomb_fd, &st) != 0 || st.st_size < static_cast<off_t>(kTombHeader)) {
    uint8_t head[kTombHeader] = {};
    std::memcpy(head, kTombMagic, sizeof kTombMagic);
    if (pwrite(tomb_fd, head, sizeof head, 0) != static_cast<ssize_t>(sizeof head))
      throw Error(Code::kIoError, "write " + path + ": " + strerror(errno));
    tomb_records = 0;
  } else {
    tomb_records = (uint64_t(st.st_size) - kTombHeader) / 8;  // a torn last record is dropped
  }
}

static std::unordered_set<uint64_t> tomb_read(int fd, uint64_t records, uint64_t* max_seq) {
  std::unordered_set<uint64_t> dead;
  std::vector<uint8_t> buf(kTombHeader + records * 8);
  ssize_t n = pread(fd, buf.data(), buf.size(), 0);
  if (n < static_cast<ssize_t>(kTombHeader) || std::memcmp(buf.data(), kTombMagic, 8) != 0)
    return dead;  // unreadable: removed objects may come back (their data is still checked)
  dead.reserve(records);
  for (size_t off = kTombHeader; off + 8 <= size_t(n); off += 8) {
    uint64_t seq;
    std::memcpy(&seq, buf.data() + off, 8);
    dead.insert(seq);
    *max_seq = std::max(*max_seq, seq);
  }
  return dead;
}

bool Tier::Impl::tomb_append_locked(uint64_t seq) {
  // pwrite at the record's own offset: a failed or short write is simply overwritten by the
  // next append, never leaves the records misaligned.
  off_t off = static_cast<off_t>(kTombHeader + tomb_records * 8);
  if (tomb_fd < 0 || pwrite(tomb_fd, &seq, 8, off) != 8) return false;
  ++tomb_records;
  return true;
}

void Tier::Impl::tomb_rewrite(const std::vector<uint64_t>& seqs) {
  std::string path = opt.directory + "/TOMBSTONES", tmp = path + ".new";
  int fd = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return;  // keep the old, longer log
  std::vector<uint8_t> buf(kTombHeader + seqs.size() * 8, 0);
  std::memcpy(buf.data(), kTombMagic, sizeof kTombMagic);
  if (!seqs.empty()) std::memcpy(buf.data() + kTombHeader, seqs.data(), seqs.size() * 8);
  bool ok = pwrite(fd, buf.data(), buf.size(), 0) == static_cast<ssize_t>(buf.size()) &&
            fdatasync(fd) == 0 && rename(tmp.c_str(), path.c_str()) == 0;
  if (!ok) {
    ::close(fd);
    unlink(tmp.c_str());
    return;
  }
  if (tomb_fd >= 0) ::close(tomb_fd);
  tomb_fd = fd;
  tomb_records = seqs.size();
}

void Tier::Impl::maybe_compact_locked() {
  // Only the stale headers still on disk need their tombstones: those of free slots and of
  // slots being overwritten. Rewriting costs O(pool); doing it when the log is 4x that
  // keeps it amortised O(1) per removal and the log small.
  // So do the dead records of packs still on disk.
  uint64_t live = pool.size() + rewriting.size() + pack_dead;
  if (tomb_records < opt.tombstone_compact_min || tomb_records < 4 * live) return;
  std::vector<uint64_t> seqs;
  seqs.reserve(live);
  for (auto& [size, f] : pool)
    if (f.stale_seq) seqs.push_back(f.stale_seq);
  seqs.insert(seqs.end(), rewriting.begin(), rewriting.end());
  for (auto& [slot, p] : packs) seqs.insert(seqs.end(), p.dead.begin(), p.dead.end());
  tomb_rewrite(seqs);
}

// ---- scan ----------------------------------------------------------------------------

std::vector<ObjectInfo> Tier::Impl::scan_locked(bool verify) {
  uint64_t max_seq = 0, max_slot = 0;
  std::unordered_set<uint64_t> dead = tomb_read(tomb_fd, tomb_records, &max_seq);
  // 1. every slot file and its header
  std::vector<Op> heads;
  for (unsigned b = 0; b < kSubdirs; ++b) {
    list_dir(sub_fd[b], opt.directory, [&](const std::string& name) {
      Op op;
      op.kind = OpKind::kHeader;
      if (!parse_slot_name(name, &op.entry.slot)) return;  // not ours: left alone
      max_slot = std::max(max_slot, op.entry.slot);
      heads.push_back(std::move(op));
    });
  }
  execute_in_slices(heads, 4096);
  // 2. invalid slots go; tombstoned and superseded ones become free; live packs are read
  //    whole and their records parsed; the newest version of each key is the object
  std::unordered_map<std::string, Entry> best;
  std::multimap<uint64_t, PoolFile> free_slots;
  std::vector<uint64_t> invalid;
  std::unordered_map<uint64_t, Pack> found_packs;
  std::vector<Op> pack_reads;
  auto consider = [&](const std::string& key, const Entry& e) {
    auto [it, inserted] = best.try_emplace(key, e);
    if (inserted) return;
    Entry loser = e;
    if (it->second.seq < e.seq) std::swap(loser, it->second);
    if (loser.packed())
      found_packs[loser.slot].dead.push_back(loser.seq);
    else
      free_slots.emplace(loser.bytes(), PoolFile{loser.slot, loser.seq});
  };
  for (Op& op : heads) {
    if (op.failed) {
      if (op.result.code == Code::kChecksumMismatch) invalid.push_back(op.entry.slot);
      continue;
    }
    const Header& h = op.header;
    max_seq = std::max(max_seq, h.seq);
    Entry e{op.entry.slot, h.seq, h.gen, h.length, h.write_time_ns, h.header_blocks};
    if (dead.count(h.seq)) {
      free_slots.emplace(e.bytes(), PoolFile{e.slot, e.seq});
      continue;
    }
    if (h.flags & kFlagPack) {
      found_packs[e.slot] = Pack{h.seq, e.bytes(), 0, {}};
      Op read;
      read.kind = OpKind::kVerify;
      read.key = &pack_key_;
      read.entry = e;
      pack_reads.push_back(std::move(read));
      continue;
    }
    consider(h.key, e);
  }
  {
    // A pack's data CRC failing still leaves its records, each with its own CRCs, to check.
    std::vector<AlignedBuf> bufs;
    for (size_t b = 0; b < pack_reads.size(); b += 64) {
      size_t e = std::min(pack_reads.size(), b + 64);
      std::vector<Op> part(std::make_move_iterator(pack_reads.begin() + b),
                           std::make_move_iterator(pack_reads.begin() + e));
      bufs.clear();
      for (Op& op : part) {
        bufs.emplace_back(op.entry.length);
        op.mem = bufs.back().data();
      }
      execute(part);
      for (size_t i = 0; i < part.size(); ++i) {
        Op& op = part[i];
        bool readable = !op.failed || op.result.code == Code::kChecksumMismatch;
        if (!readable) {  // vanished or unreadable: left alone, as a header that failed
          found_packs.erase(op.entry.slot);
          continue;
        }
        const uint8_t* p = bufs[i].data();
        uint64_t off = 0, n = op.entry.length;
        while (off < n) {
          Record rec;
          const uint8_t* data = nullptr;
          std::string why;
          if (!decode_record(p + off, n - off, &rec, &data, &why)) break;  // the rest is torn
          uint64_t bytes = record_bytes(rec.key.size(), rec.length);
          max_seq = std::max(max_seq, rec.seq);
          bool good = (rec.length ? crc32c(data, rec.length) : 0) == rec.data_crc;
          if (!good || dead.count(rec.seq)) {
            if (good) found_packs[op.entry.slot].dead.push_back(rec.seq);
          } else {
            Entry re{op.entry.slot, rec.seq, rec.gen, rec.length, op.entry.write_time_ns,
                     op.entry.header_blocks, op.entry.header_bytes() + off, static_cast<uint32_t>(bytes)};
            consider(rec.key, re);
          }
          off += bytes;
        }
      }
    }
  }
  for (auto& [key, e] : best)
    if (e.packed()) found_packs[e.slot].live++;
  for (auto it = found_packs.begin(); it != found_packs.end();) {
    if (it->second.live == 0) {  // nothing current in it: a free slot
      free_slots.emplace(it->second.bytes, PoolFile{it->first, it->second.seq});
      it = found_packs.erase(it);
    } else {
      ++it;
    }
  }
  // 3. optionally every byte
  if (verify) {
    std::vector<Op> reads;
    reads.reserve(best.size());
    for (auto& [key, e] : best) {
      if (e.packed()) continue;  // its record's CRCs were checked when its pack was parsed
      Op op;
      op.kind = OpKind::kVerify;
      op.key = &key;
      op.entry = e;
      reads.push_back(std::move(op));
    }
    execute_in_slices(reads, 1024);
    for (Op& op : reads) {
      if (!op.failed) continue;
      if (op.result.code == Code::kChecksumMismatch) invalid.push_back(op.entry.slot);
      best.erase(*op.key);
    }
  }
  for (uint64_t slot : invalid)
    if (unlinkat(dir_of(slot), slot_name(slot).c_str(), 0) == 0) ctr.files_deleted_invalid++;
  // 4. the log keeps only what is still on disk, then the new state goes live
  std::vector<uint64_t> seqs;
  for (auto& [size, f] : free_slots) seqs.push_back(f.stale_seq);
  for (auto& [slot, p] : found_packs) seqs.insert(seqs.end(), p.dead.begin(), p.dead.end());
  tomb_rewrite(seqs);
  std::vector<ObjectInfo> out;
  out.reserve(best.size());
  std::vector<uint64_t> trim;
  {
    std::lock_guard<std::mutex> g(mu);
    used = 0;
    pack_dead = 0;
    for (auto& [key, e] : best) {
      if (!e.packed()) used += e.bytes();
      out.push_back(ObjectInfo{key, e.gen, e.length});
    }
    for (auto& [slot, p] : found_packs) {
      used += p.bytes;
      pack_dead += p.dead.size();
    }
    index = std::move(best);
    packs = std::move(found_packs);
    pool = std::move(free_slots);
    pool_bytes = 0;
    for (auto& [size, f] : pool) pool_bytes += size;
    while (used + pool_bytes > opt.capacity_bytes && !pool.empty()) {  // capacity lowered
      auto last = std::prev(pool.end());
      trim.push_back(last->second.slot);
      pool_bytes -= last->first;
      pool.erase(last);
    }
    rewriting.clear();
    if (next_seq.load() <= max_seq) next_seq = max_seq + 1;
    if (next_slot.load() <= max_slot) next_slot = max_slot + 1;
  }
  unlink_slots(trim);
  return out;
}

}  // namespace mcr::spill
