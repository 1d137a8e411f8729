// mcr::NodeTable: see node_table.h.
#include "mcr/node_table.h"
#include "mcr/spill_crc32c.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <new>
#include <stdexcept>
#include <thread>

#include <sys/mman.h>

namespace mcr {
namespace {

// The log and the slot table are mappings of their own: freed, they go back to the system
// at once (from malloc, a block the allocator had raised its mmap threshold for stayed in
// its heap: 93 MB resident for a table of 61 MB at 1M keys), and grown, the log moves by
// mremap without a copy while its unwritten tail stays untouched.
size_t pages(size_t n) { return (n + 4095) & ~size_t{4095}; }

void* map_bytes(size_t n) {
  void* p = mmap(nullptr, pages(n), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  return p;
}

void unmap_bytes(void* p, size_t n) {
  if (p != nullptr) munmap(p, pages(n));
}

void* remap_bytes(void* p, size_t old_n, size_t n) {
  if (p == nullptr) return map_bytes(n);
  void* q = mremap(p, pages(old_n), pages(n), MREMAP_MAYMOVE);
  if (q == MAP_FAILED) throw std::bad_alloc();
  return q;
}

// Header layout (little-endian, unaligned): 0 gen u64 | 8 size u48 | 14 offset u48 |
// 20 slack u16 (length - size; kBigSlack: the length is in the side table) | 22 crc u32 |
// 26 pin u8 | 27 want u8 | 28 flags u8 | 29 key length u8 (kLongKey: a u32 at 30 holds it,
// the key follows at 34; else it follows at 30). A value's length is its size rounded up to
// a 64-byte granule or a 4 KiB page, so the slack fits in 16 bits but for odd extents.
constexpr size_t kMinCap = 16;
constexpr uint32_t kMaxKey = (1u << 24) - 1;
constexpr uint64_t kBigSlack = 0xFFFF;
constexpr uint8_t kLongKey = 0xFF;

uint64_t ld(const uint8_t* p, size_t n) {
  uint64_t v = 0;
  std::memcpy(&v, p, n);
  return v;
}
void st(uint8_t* p, uint64_t v, size_t n) { std::memcpy(p, &v, n); }

}  // namespace

NodeTable::NodeTable() { rebuild(kMinCap); }

NodeTable::~NodeTable() {
  unmap_bytes(log_, log_cap_);
  unmap_bytes(slots_, cap_ * kSlotBytes);
}

uint32_t NodeTable::key_len(const uint8_t* r) {
  return r[29] == kLongKey ? static_cast<uint32_t>(ld(r + 30, 4)) : r[29];
}

uint64_t NodeTable::length_of(uint32_t idx, const uint8_t* r) const {
  uint64_t slack = ld(r + 20, 2);
  return slack == kBigSlack ? extra_.at(idx).length : ld(r + 8, 6) + slack;
}

uint64_t NodeTable::hash(std::string_view key, uint8_t tier) {
  uint64_t h = std::hash<std::string_view>{}(key) ^ (uint64_t{tier} * 0x9E3779B97F4A7C15ull);
  h ^= h >> 33;  // spread into the high bits, which pick the slot (home)
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  return h;
}

size_t NodeTable::find(std::string_view key, uint8_t tier, uint64_t h) const {
  const uint8_t tag = static_cast<uint8_t>(h);
  for (size_t i = home(h);; i = i + 1 == cap_ ? 0 : i + 1) {
    uint32_t s = slots_[i];
    if (s == 0) return SIZE_MAX;
    if (tags_[i] != tag) continue;  // another key: its record is not read
    const uint8_t* r = rec(s - 1);
    if (key_len(r) == key.size() && ((flags(r) & kReservedFlag) != 0) == (tier == kReserved) &&
        std::memcmp(r + hdr_bytes(r), key.data(), key.size()) == 0)
      return i;
  }
}

void NodeTable::decode(uint32_t idx, NodeEntry* out) const {
  const uint8_t* r = rec(idx);
  uint8_t f = flags(r);
  out->key.assign(key_of(r));
  out->tier = (f & kReservedFlag) ? kReserved : kDram;
  out->gen = ld(r, 8);
  out->size = ld(r + 8, 6);
  out->offset = ld(r + 14, 6);
  out->length = length_of(idx, r);
  out->has_crc = (f & kHasCrc) != 0;
  out->crc = static_cast<uint32_t>(ld(r + 22, 4));
  if (f & kExtra) {
    const Extra& x = extra_.at(idx);
    out->pin = x.pin;
    out->want = x.want;
    out->parent = x.parent;
  } else {
    out->pin = r[26];
    out->want = r[27];
    out->parent.clear();
  }
}

void NodeTable::write_fields(uint8_t* r, uint32_t idx, const NodeEntry& e, bool keep_crc) {
  uint8_t f = (e.tier == kReserved ? kReservedFlag : 0) | (r[28] & kDead);
  if (keep_crc) f |= r[28] & kHasCrc;
  st(r, e.gen, 8);
  st(r + 8, e.size, 6);
  st(r + 14, e.offset, 6);
  const bool big_slack = e.length < e.size || e.length - e.size >= kBigSlack;
  st(r + 20, big_slack ? kBigSlack : e.length - e.size, 2);
  if (!keep_crc) st(r + 22, 0, 4);
  bool extra = e.pin > 255 || e.want > 255 || !e.parent.empty() || big_slack;
  if (extra) {
    f |= kExtra;
    Extra& x = extra_[idx];
    x.pin = e.pin;
    x.want = e.want;
    x.parent = e.parent;
    x.length = e.length;
    r[26] = r[27] = 0;
  } else {
    if (r[28] & kExtra) extra_.erase(idx);
    r[26] = static_cast<uint8_t>(e.pin);
    r[27] = static_cast<uint8_t>(e.want);
  }
  r[28] = f;
}

uint32_t NodeTable::append(const NodeEntry& e) {
  const bool long_key = e.key.size() >= kLongKey;
  const size_t hdr = long_key ? kHdr + 4 : kHdr;
  size_t need = (hdr + e.key.size() + 3) & ~size_t{3};
  if (log_len_ + need > log_cap_) {
    size_t cap = log_cap_ < 4096 ? 4096 : log_cap_ + log_cap_ / 2;
    while (cap < log_len_ + need) cap += cap / 2;
    if (cap / 4 > UINT32_MAX - 1) throw std::length_error("node table: log past 16 GiB");
    log_ = static_cast<uint8_t*>(remap_bytes(log_, log_cap_, cap));
    log_cap_ = cap;
  }
  uint8_t* r = log_ + log_len_;
  std::memset(r, 0, need);
  if (long_key) {
    r[29] = kLongKey;
    st(r + 30, e.key.size(), 4);
  } else {
    r[29] = static_cast<uint8_t>(e.key.size());
  }
  std::memcpy(r + hdr, e.key.data(), e.key.size());
  uint32_t idx = static_cast<uint32_t>(log_len_ / 4);
  log_len_ += need;
  write_fields(r, idx, e, false);
  return idx;
}

void NodeTable::insert_slot(uint32_t idx, uint64_t h) {
  for (size_t i = home(h);; i = i + 1 == cap_ ? 0 : i + 1) {
    if (slots_[i] == 0) {
      slots_[i] = idx + 1;
      tags_[i] = static_cast<uint8_t>(h);
      return;
    }
  }
}

void NodeTable::remove_slot(size_t i) {
  // Backward shift: move each later record of the run back into the hole if its home does
  // not lie cyclically in (hole, its slot].
  for (size_t j = i;;) {
    j = j + 1 == cap_ ? 0 : j + 1;
    uint32_t s = slots_[j];
    if (s == 0) break;
    const uint8_t* r = rec(s - 1);
    size_t k = home(hash(key_of(r), (flags(r) & kReservedFlag) ? kReserved : kDram));
    bool stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
    if (!stays) {
      slots_[i] = s;
      tags_[i] = tags_[j];
      i = j;
    }
  }
  slots_[i] = 0;
}

void NodeTable::rebuild(size_t cap) {
  auto* s = static_cast<uint32_t*>(map_bytes(cap * kSlotBytes));  // zero pages
  unmap_bytes(slots_, cap_ * kSlotBytes);
  slots_ = s;
  tags_ = reinterpret_cast<uint8_t*>(s + cap);
  cap_ = cap;
  for (size_t at = 0; at < log_len_;) {
    const uint8_t* r = log_ + at;
    if (!(flags(r) & kDead))
      insert_slot(static_cast<uint32_t>(at / 4), hash(key_of(r), (flags(r) & kReservedFlag) ? kReserved : kDram));
    at += rec_bytes(r);
  }
}

void NodeTable::compact_log() {
  size_t live = log_len_ - garbage_;
  size_t out_cap = live > 4096 ? live : 4096;
  auto* out = static_cast<uint8_t*>(map_bytes(out_cap));
  std::unordered_map<uint32_t, Extra> extra;
  size_t w = 0;
  for (size_t at = 0; at < log_len_;) {
    const uint8_t* r = log_ + at;
    size_t n = rec_bytes(r);
    if (!(flags(r) & kDead)) {
      std::memcpy(out + w, r, n);
      if (flags(r) & kExtra) extra.emplace(static_cast<uint32_t>(w / 4), std::move(extra_.at(static_cast<uint32_t>(at / 4))));
      w += n;
    }
    at += n;
  }
  unmap_bytes(log_, log_cap_);
  log_ = out;
  log_len_ = w;
  log_cap_ = pages(out_cap);
  garbage_ = 0;
  extra_ = std::move(extra);
  ++compactions_;
  rebuild(cap_);
}

void NodeTable::set(const NodeEntry& e) {
  if (e.size > kMax48 || e.offset > kMax48 || e.length > kMax48)
    throw std::invalid_argument("node table: size, offset and length must fit in 48 bits");
  if (e.key.size() > kMaxKey) throw std::invalid_argument("node table: a key over 16 MiB");
  uint64_t h = hash(e.key, e.tier);
  size_t slot = find(e.key, e.tier, h);
  uint8_t* r;
  bool kept = false;
  if (slot != SIZE_MAX) {
    uint32_t idx = slots_[slot] - 1;
    r = rec(idx);
    kept = e.tier == kDram && ld(r, 8) == e.gen && ld(r + 14, 6) == e.offset;
    write_fields(r, idx, e, kept);
  } else {
    if ((n_ + 1) * 100 > cap_ * 85) rebuild(cap_ + cap_ / 2);
    uint32_t idx = append(e);
    insert_slot(idx, h);
    ++n_;
    r = rec(idx);
  }
  if (e.tier != kDram || kept) {
    if (!e.has_crc) return;
  } else if (!e.has_crc) {
    if (sums_.empty()) return;
    auto it = sums_.find(sum_key(e.key, e.gen, e.offset));
    if (it == sums_.end()) return;
    st(r + 22, it->second, 4);
    r[28] |= kHasCrc;
    return;
  }
  if (e.tier == kDram) {  // a checksum given with the entry
    st(r + 22, e.crc, 4);
    r[28] |= kHasCrc;
  }
}

void NodeTable::reserve(size_t n) {
  size_t want = n * 100 / 85 + 1;
  if (want > cap_) rebuild(want);
}

bool NodeTable::get(std::string_view key, uint8_t tier, NodeEntry* out) const {
  size_t slot = find(key, tier, hash(key, tier));
  if (slot == SIZE_MAX) return false;
  decode(slots_[slot] - 1, out);
  return true;
}

std::string NodeTable::sum_key(std::string_view key, uint64_t gen, uint64_t offset) {
  std::string k(16 + key.size(), '\0');
  std::memcpy(k.data(), &gen, 8);
  std::memcpy(k.data() + 8, &offset, 8);
  std::memcpy(k.data() + 16, key.data(), key.size());
  return k;
}

bool NodeTable::erase(std::string_view key, uint8_t tier, uint64_t max_gen, bool keep_sum) {
  size_t slot = find(key, tier, hash(key, tier));
  if (slot == SIZE_MAX) return false;
  uint32_t idx = slots_[slot] - 1;
  uint8_t* r = rec(idx);
  uint64_t gen = ld(r, 8);
  if (gen > max_gen) return false;
  if (keep_sum && tier == kDram && (flags(r) & kHasCrc))
    sums_[sum_key(key, gen, ld(r + 14, 6))] = static_cast<uint32_t>(ld(r + 22, 4));
  if (flags(r) & kExtra) extra_.erase(idx);
  r[28] = (flags(r) & ~kExtra) | kDead;
  garbage_ += rec_bytes(r);
  remove_slot(slot);
  --n_;
  if (garbage_ > (1u << 20) && garbage_ * 4 > log_len_) compact_log();
  return true;
}

bool NodeTable::crc_of(std::string_view key, uint64_t gen, uint64_t offset, uint32_t* crc) const {
  size_t slot = find(key, kDram, hash(key, kDram));
  if (slot != SIZE_MAX) {
    const uint8_t* r = rec(slots_[slot] - 1);
    if ((flags(r) & kHasCrc) && ld(r, 8) == gen && ld(r + 14, 6) == offset) {
      *crc = static_cast<uint32_t>(ld(r + 22, 4));
      return true;
    }
  }
  if (sums_.empty()) return false;
  auto it = sums_.find(sum_key(key, gen, offset));
  if (it == sums_.end()) return false;
  *crc = it->second;
  return true;
}

bool NodeTable::set_crc(std::string_view key, uint64_t gen, uint64_t offset, uint32_t crc) {
  size_t slot = find(key, kDram, hash(key, kDram));
  if (slot == SIZE_MAX) return false;
  uint8_t* r = rec(slots_[slot] - 1);
  if (ld(r, 8) != gen || ld(r + 14, 6) != offset) return false;
  st(r + 22, crc, 4);
  r[28] |= kHasCrc;
  return true;
}

size_t NodeTable::memory_bytes() const {
  size_t x = 0;
  for (const auto& [idx, e] : extra_) x += 64 + e.parent.capacity();
  x += sums_.size() * 80;
  return log_len_ + cap_ * kSlotBytes + x;  // the log's unused tail is never touched
}

void NodeTable::clear() {
  unmap_bytes(log_, log_cap_);
  log_ = nullptr;
  log_len_ = log_cap_ = garbage_ = 0;
  n_ = 0;
  extra_.clear();
  sums_.clear();
  rebuild(kMinCap);
}

void NodeTable::encode(const NodeEntry& e, std::string* out) {
  uint8_t h[57];
  st(h, e.gen, 8);
  st(h + 8, e.size, 8);
  st(h + 16, e.offset, 8);
  st(h + 24, e.length, 8);
  st(h + 32, e.pin, 8);
  st(h + 40, e.crc, 4);
  st(h + 44, e.want > UINT32_MAX ? UINT32_MAX : e.want, 4);
  h[48] = e.has_crc ? 1 : 0;
  st(h + 49, e.key.size(), 4);
  st(h + 53, e.parent.size(), 4);
  out->append(reinterpret_cast<const char*>(h), sizeof h);
  out->append(e.key);
  out->append(e.parent);
}

bool NodeTable::decode(const uint8_t** p, const uint8_t* end, NodeEntry* e) {
  const uint8_t* h = *p;
  if (end - h < 57) return false;
  uint64_t klen = ld(h + 49, 4), plen = ld(h + 53, 4);
  if (static_cast<uint64_t>(end - h - 57) < klen + plen) return false;
  e->tier = kDram;
  e->gen = ld(h, 8);
  e->size = ld(h + 8, 8);
  e->offset = ld(h + 16, 8);
  e->length = ld(h + 24, 8);
  e->pin = ld(h + 32, 8);
  e->crc = static_cast<uint32_t>(ld(h + 40, 4));
  e->want = ld(h + 44, 4);
  e->has_crc = h[48] & 1;
  if (e->size > kMax48 || e->offset > kMax48 || e->length > kMax48 || e->want == 0 || klen > kMaxKey) return false;
  e->key.assign(reinterpret_cast<const char*>(h + 57), klen);
  e->parent.assign(reinterpret_cast<const char*>(h + 57 + klen), plen);
  *p = h + 57 + klen + plen;
  return true;
}

std::string NodeTable::snapshot(size_t* n) const {
  std::string out = "MCRIDX3\n";
  out.append(8, '\0');
  size_t count = 0;
  for_each([&](const NodeEntry& e) {
    if (e.tier != kDram || !e.has_crc) return;
    encode(e, &out);
    ++count;
  });
  std::memcpy(out.data() + 8, &count, 8);
  uint32_t crc = spill::crc32c(out.data() + 8, out.size() - 8);
  out.append(reinterpret_cast<const char*>(&crc), 4);
  *n = count;
  return out;
}

size_t NodeTable::load_snapshot(const uint8_t* data, size_t len) {
  if (len < 20 || std::memcmp(data, "MCRIDX3\n", 8) != 0) throw std::invalid_argument("not an MCRIDX3 snapshot");
  uint32_t crc = static_cast<uint32_t>(ld(data + len - 4, 4));
  if (spill::crc32c(data + 8, len - 12) != crc) throw std::invalid_argument("its checksum does not match");
  uint64_t n = ld(data + 8, 8);
  const uint8_t* end = data + len - 4;
  NodeEntry e;  // reused: its strings keep their capacity, no allocation per record
  uint64_t count = 0;
  if (n_ == 0) {
    // Into an empty table, in one pass (the whole file's checksum held: its records are the
    // ones a table wrote, each key once); on a record that does not parse, the caller
    // clears the table.
    reserve(n);
    for (const uint8_t* p = data + 16; p < end; ++count) {
      if (!decode(&p, end, &e)) throw std::invalid_argument("a record does not parse");
      set(e);
    }
  } else {
    for (const uint8_t* p = data + 16; p < end; ++count)  // all of it checked before any is added
      if (!decode(&p, end, &e)) throw std::invalid_argument("a record does not parse");
    reserve(size() + count);
    for (const uint8_t* p = data + 16; p < end;) {
      decode(&p, end, &e);
      set(e);
    }
  }
  if (count != n) throw std::invalid_argument("it holds another number of records than it says");
  return count;
}

size_t NodeTable::replay(const uint8_t* data, size_t len, size_t* skipped) {
  size_t ops = 0;
  *skipped = 0;
  NodeEntry e;
  reserve(size() + len / 80);  // about a record of a short key each: no growth on the way
  for (size_t at = 0; at + 12 <= len;) {
    const uint8_t* h = data + at;
    uint64_t blen = ld(h + 4, 4);
    if (ld(h, 4) != kJournalMagic || blen > len - at - 12) break;  // torn (or not a batch): the end
    const uint8_t* body = h + 12;
    const uint8_t* end = body + blen;
    at += 12 + blen;
    if (spill::crc32c(body, blen) != static_cast<uint32_t>(ld(h + 8, 4))) {
      ++*skipped;
      continue;
    }
    // checked whole before applied: a batch is all or nothing
    bool ok = true;
    size_t n = 0;
    for (int pass = 0; pass < 2 && ok; ++pass) {
      for (const uint8_t* p = body; p < end && ok;) {
        uint8_t kind = *p++;
        if (kind == 1) {
          ok = decode(&p, end, &e);
          if (ok && pass == 1) set(e);
        } else if (kind == 2 && end - p >= 12) {
          uint64_t gen = ld(p, 8), klen = ld(p + 8, 4);
          ok = static_cast<uint64_t>(end - p - 12) >= klen;
          if (ok && pass == 1) erase(std::string_view(reinterpret_cast<const char*>(p + 12), klen), kDram, gen);
          p += 12 + (ok ? klen : 0);
        } else {
          ok = false;
        }
        n += pass;
      }
    }
    if (!ok) {
      ++*skipped;
      continue;
    }
    ops += n;
  }
  sums_.clear();
  return ops;
}

std::vector<std::pair<std::string, uint64_t>> NodeTable::verify(const uint8_t* base, size_t len) {
  // The records to check, then their checksums on two threads (the arena's bytes are most
  // of the work: a million values of 256 bytes), then the verdicts.
  std::vector<uint32_t> recs;
  recs.reserve(n_);
  for (size_t at = 0; at < log_len_; at += rec_bytes(log_ + at))
    if (!(flags(log_ + at) & (kDead | kReservedFlag))) recs.push_back(static_cast<uint32_t>(at / 4));
  std::vector<uint32_t> now(recs.size());
  std::vector<uint8_t> fits(recs.size());
  auto work = [&](size_t from, size_t to) {
    for (size_t i = from; i < to; ++i) {
      const uint8_t* r = rec(recs[i]);
      uint64_t size = ld(r + 8, 6), off = ld(r + 14, 6), length = length_of(recs[i], r);
      fits[i] = size <= length && off <= len && length <= len - off;
      now[i] = fits[i] ? spill::crc32c(base + off, size) : 0;
    }
  };
  size_t half = recs.size() / 2;
  if (recs.size() >= 4096) {
    std::thread other(work, half, recs.size());
    work(0, half);
    other.join();
  } else {
    work(0, recs.size());
  }
  std::vector<std::pair<std::string, uint64_t>> bad;
  for (size_t i = 0; i < recs.size(); ++i) {
    uint8_t* r = rec(recs[i]);
    if (!fits[i] || ((flags(r) & kHasCrc) && now[i] != static_cast<uint32_t>(ld(r + 22, 4)))) {
      bad.emplace_back(std::string(key_of(r)), ld(r, 8));
    } else if (!(flags(r) & kHasCrc)) {
      st(r + 22, now[i], 4);
      r[28] |= kHasCrc;
    }
  }
  for (auto& [key, gen] : bad) erase(key, kDram, gen, false);
  return bad;
}

void NodeTable::seal_batch(std::string* batch) {
  uint32_t h[3] = {kJournalMagic, static_cast<uint32_t>(batch->size() - 12),
                   spill::crc32c(batch->data() + 12, batch->size() - 12)};
  std::memcpy(batch->data(), h, sizeof h);
}

NodeTable::RingRead NodeTable::apply_ring(const uint8_t* ring, size_t bytes, const uint8_t* arena, size_t arena_len,
                                          std::string* batch) {
  constexpr size_t kRingHeader = 64, kRec = 48;  // u32 length, u32 kind, u64 x4, u32 x2
  constexpr uint32_t kCommit = 1, kRes = 3, kHasCrcBit = 1u << 16, kAloneBit = 1u << 17;
  RingRead out;
  batch->clear();
  if (bytes < kRingHeader + 8) throw std::invalid_argument("commit ring: too small");
  // head is published with a release store after the records' bytes (the master's
  // ring_write); tail moves only here
  const uint64_t head = __atomic_load_n(reinterpret_cast<const uint64_t*>(ring + 16), __ATOMIC_ACQUIRE);
  uint64_t tail = ld(ring + 24, 8);
  const uint64_t cap = bytes - kRingHeader;
  if (head - tail > cap) throw std::invalid_argument("commit ring: head past tail by more than the ring");
  struct Rec {
    const uint8_t* key;
    const uint8_t* parent;
    uint32_t klen, plen, kind, crc;
    uint64_t gen, size, offset, length;
  };
  static thread_local std::vector<Rec> recs;  // reused: nothing allocated per read
  recs.clear();
  for (uint64_t at = tail; at < head;) {  // parsed whole before any is applied
    const uint8_t* r = ring + kRingHeader + at % cap;
    const uint64_t n = ld(r, 4);
    const uint32_t kind = static_cast<uint32_t>(ld(r + 4, 4));
    if (n < 8 || n % 8 || n > cap - at % cap)
      throw std::invalid_argument("commit ring: bad record length " + std::to_string(n) + " at " + std::to_string(at));
    at += n;
    if ((kind & 0xFF) != kCommit && (kind & 0xFF) != kRes) continue;  // padding to the area's end
    Rec x;
    if (n < kRec) throw std::invalid_argument("commit ring: record too short at " + std::to_string(at - n));
    x.kind = kind;
    x.gen = ld(r + 8, 8);
    x.size = ld(r + 16, 8);
    x.offset = ld(r + 24, 8);
    x.length = ld(r + 32, 8);
    x.klen = static_cast<uint32_t>(ld(r + 40, 4));
    x.plen = static_cast<uint32_t>(ld(r + 44, 4));
    const uint64_t need = kRec + uint64_t{x.klen} + x.plen + ((kind & kHasCrcBit) ? 4 : 0);
    if (need > n || x.klen > kMaxKey || x.size > kMax48 || x.offset > kMax48 || x.length > kMax48)
      throw std::invalid_argument("commit ring: a record that does not parse at " + std::to_string(at - n));
    x.key = r + kRec;
    x.parent = x.key + x.klen;
    x.crc = (kind & kHasCrcBit) ? static_cast<uint32_t>(ld(x.parent + x.plen, 4)) : 0;
    recs.push_back(x);
  }
  out.tail = head;
  static thread_local NodeEntry e;
  batch->assign(12, '\0');
  for (const Rec& x : recs) {
    const bool reserved = (x.kind & 0xFF) == kRes;
    e.key.assign(reinterpret_cast<const char*>(x.key), x.klen);
    e.parent.assign(reinterpret_cast<const char*>(x.parent), x.plen);
    e.tier = reserved ? kReserved : kDram;
    e.gen = x.gen;
    e.size = x.size;
    e.offset = x.offset;
    e.length = x.length;
    e.pin = 0;
    e.want = ((x.kind >> 8) & 0xFF) ? ((x.kind >> 8) & 0xFF) : 1;
    e.has_crc = !reserved && (x.kind & kHasCrcBit);
    e.crc = x.crc;
    set(e);
    ++out.records;
    if (reserved) continue;
    if (e.has_crc) {
      ++out.given;
    } else if (x.size <= arena_len && x.offset <= arena_len - x.size) {
      // not taken by its writer: the value's bytes now (as a message's add is journaled)
      e.crc = x.size ? spill::crc32c(arena + x.offset, x.size) : 0;
      e.has_crc = true;
      set_crc(e.key, e.gen, e.offset, e.crc);
      ++out.summed;
    }
    if (!(x.kind & kAloneBit)) out.told.push_back(e);
    *batch += '\x01';
    encode(e, batch);
  }
  sums_.clear();
  if (recs.capacity() * sizeof(Rec) > (256u << 10)) std::vector<Rec>().swap(recs);  // see trim in the bindings
  if (batch->size() == 12) {
    batch->clear();
  } else {
    seal_batch(batch);
  }
  return out;
}

}  // namespace mcr
