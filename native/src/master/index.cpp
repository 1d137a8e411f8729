// The master's native read path (see mcr/master_index.h), with the small msgpack subset
// its requests and replies use.
#include "mcr/master_index.h"

#include <sys/file.h>
#include <unistd.h>
#include <time.h>

#include <atomic>

#include <algorithm>
#include <chrono>
#include <cstring>

namespace mcr {
namespace {

// ---- msgpack: a bounds-checked reader and a writer for the types the master RPC uses --
class Reader {
 public:
  Reader(const char* p, size_t n) : p_(reinterpret_cast<const uint8_t*>(p)), end_(p_ + n) {}
  bool ok() const { return ok_; }
  bool at_end() const { return p_ == end_; }

  // A count off the wire is bounded by the bytes left (every element takes at least one),
  // so a caller may reserve or resize by it without a 7-byte message costing gigabytes.
  bool array(uint32_t* n) {
    uint8_t t;
    if (!byte(&t)) return false;
    if ((t & 0xf0) == 0x90) {
      *n = t & 0x0f;
    } else if (t == 0xdc || t == 0xdd) {
      if (!be(t == 0xdc ? 2 : 4, n)) return false;
    } else {
      return fail();
    }
    if (size_t(end_ - p_) < *n) return fail();
    return true;
  }
  bool uint(uint64_t* v) {
    uint8_t t;
    if (!byte(&t)) return false;
    if (t < 0x80) return (*v = t), true;
    switch (t) {
      case 0xcc: return be(1, v);
      case 0xcd: return be(2, v);
      case 0xce: return be(4, v);
      case 0xcf: return be(8, v);
      default: return fail();  // negative or not an integer
    }
  }
  bool str(std::string* s) {
    uint8_t t;
    uint32_t n;
    if (!byte(&t)) return false;
    if ((t & 0xe0) == 0xa0) {
      n = t & 0x1f;
    } else if (t == 0xd9 || t == 0xda || t == 0xdb) {
      if (!be(t == 0xd9 ? 1 : t == 0xda ? 2 : 4, &n)) return false;
    } else {
      return fail();
    }
    if (size_t(end_ - p_) < n) return fail();
    // Python reads a str as strict UTF-8 and refuses the request otherwise; a key it
    // could not read must not reach the mirror or the log (drain() would raise).
    if (!utf8_ok(p_, n)) return fail();
    s->assign(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    return true;
  }
  bool nil() {
    if (p_ < end_ && *p_ == 0xc0) return ++p_, true;
    return false;  // not nil: nothing consumed
  }
  bool boolean(bool* b) {
    uint8_t t;
    if (!byte(&t)) return false;
    if (t != 0xc2 && t != 0xc3) return fail();
    *b = t == 0xc3;
    return true;
  }

 private:
  // Well-formed UTF-8 (Unicode table 3-7: no overlongs, surrogates or code points past
  // U+10FFFF), as Python's strict decoder accepts it.
  static bool utf8_ok(const uint8_t* p, size_t n) {
    const uint8_t* e = p + n;
    while (p < e) {
      uint8_t c = *p++;
      if (c < 0x80) continue;
      size_t more;
      uint8_t lo = 0x80, hi = 0xbf;
      if (c >= 0xc2 && c <= 0xdf) {
        more = 1;
      } else if (c >= 0xe0 && c <= 0xef) {
        more = 2;
        if (c == 0xe0) lo = 0xa0;
        if (c == 0xed) hi = 0x9f;
      } else if (c >= 0xf0 && c <= 0xf4) {
        more = 3;
        if (c == 0xf0) lo = 0x90;
        if (c == 0xf4) hi = 0x8f;
      } else {
        return false;
      }
      if (size_t(e - p) < more || *p < lo || *p > hi) return false;
      ++p;
      for (size_t i = 1; i < more; ++i, ++p)
        if (*p < 0x80 || *p > 0xbf) return false;
    }
    return true;
  }
  bool fail() { return ok_ = false; }
  bool byte(uint8_t* b) {
    if (!ok_ || p_ >= end_) return fail();
    *b = *p_++;
    return true;
  }
  template <typename T>
  bool be(int width, T* v) {
    if (size_t(end_ - p_) < size_t(width)) return fail();
    uint64_t x = 0;
    for (int i = 0; i < width; i++) x = (x << 8) | *p_++;
    *v = static_cast<T>(x);
    return true;
  }
  const uint8_t* p_;
  const uint8_t* end_;
  bool ok_ = true;
};

class Writer {
 public:
  explicit Writer(std::string* out) : o_(out) {}
  void array(uint32_t n) {
    if (n < 16) return put(uint8_t(0x90 | n));
    if (n < 65536) return put(uint8_t(0xdc)), be(n, 2);
    put(uint8_t(0xdd)), be(n, 4);
  }
  void uint(uint64_t v) {
    if (v < 0x80) return put(uint8_t(v));
    if (v <= 0xff) return put(uint8_t(0xcc)), be(v, 1);
    if (v <= 0xffff) return put(uint8_t(0xcd)), be(v, 2);
    if (v <= 0xffffffffu) return put(uint8_t(0xce)), be(v, 4);
    put(uint8_t(0xcf)), be(v, 8);
  }
  void f64(double d) {
    uint64_t bits;
    std::memcpy(&bits, &d, 8);
    put(uint8_t(0xcb)), be(bits, 8);
  }
  void str(const std::string& s) {
    size_t n = s.size();
    if (n < 32) put(uint8_t(0xa0 | n));
    else if (n < 256) put(uint8_t(0xd9)), be(n, 1);
    else if (n < 65536) put(uint8_t(0xda)), be(n, 2);
    else put(uint8_t(0xdb)), be(n, 4);
    o_->append(s);
  }
  void nil() { put(uint8_t(0xc0)); }
  void boolean(bool b) { put(uint8_t(b ? 0xc3 : 0xc2)); }

 private:
  void put(uint8_t b) { o_->push_back(char(b)); }
  void be(uint64_t v, int width) {
    for (int i = width - 1; i >= 0; i--) o_->push_back(char((v >> (8 * i)) & 0xff));
  }
  std::string* o_;
};

double monotonic_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

uint64_t wall_ns() {  // Python's time.time_ns()
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

uint64_t extent_length(uint64_t n) {  // allocator.py extent_length
  const uint64_t a = n >= MasterIndex::kAlign ? MasterIndex::kAlign : MasterIndex::kGranule;
  return std::max(a, (n + a - 1) / a * a);
}

// slabs.py _carve: take [offset, offset+length) out of the uncommitted pieces.
bool carve(std::map<uint64_t, uint64_t>& free, uint64_t offset, uint64_t length) {
  if (offset % (length >= MasterIndex::kAlign ? MasterIndex::kAlign : MasterIndex::kGranule)) return false;
  auto it = free.upper_bound(offset);
  if (it == free.begin()) return false;
  --it;
  const uint64_t start = it->first, len = it->second;
  if (offset + length > start + len) return false;
  free.erase(it);
  if (offset > start) free[start] = offset - start;
  if (offset + length < start + len) free[offset + length] = start + len - offset - length;
  return true;
}

struct Release {
  std::string key;
  uint64_t gen = 0, lease = 0;
};

bool read_keys(Reader& r, std::vector<std::string>* keys) {
  uint32_t n;
  if (!r.array(&n)) return false;
  keys->resize(n);
  for (auto& k : *keys)
    if (!r.str(&k)) return false;
  return true;
}

// ``[[key, gen, lease], ...]``: leases a client is done with.
bool read_releases(Reader& r, std::vector<Release>* out) {
  uint32_t n;
  if (!r.array(&n)) return false;
  out->resize(n);
  for (auto& rel : *out) {
    uint32_t m;
    if (!r.array(&m) || m != 3 || !r.str(&rel.key) || !r.uint(&rel.gen) || !r.uint(&rel.lease))
      return false;
  }
  return true;
}

constexpr uint64_t kOk = 0;  // rpc.OK
}  // namespace

// ---- the table: records and their recency list -------------------------------------
IndexRecord* MasterIndex::find(std::string_view key) { return map_.find(key); }

void MasterIndex::unlink(IndexRecord* r) {
  if (r->probation) {  // the stack, then the grace window, from the oldest end
    if (r == stack_last_) stack_last_ = r->older;
    if (r == grace_first_) grace_first_ = r->newer && r->newer->grace ? r->newer : nullptr;
    if (r == grace_last_) grace_last_ = r->older && r->older->grace ? r->older : nullptr;
    if (r->grace) grace_bytes_ -= r->size;
    r->probation = r->grace = false;
  }
  (r->older ? r->older->newer : oldest_) = r->newer;
  (r->newer ? r->newer->older : newest_) = r->older;
  r->older = r->newer = nullptr;
}

void MasterIndex::link_recent(IndexRecord* r) {
  r->older = newest_;
  r->newer = nullptr;
  (newest_ ? newest_->newer : oldest_) = r;
  newest_ = r;
}

IndexRecord& MasterIndex::insert(const std::string& key, bool* fresh) {
  IndexRecord* r = map_.insert(key, fresh);
  if (*fresh) link_recent(r);
  return *r;
}

void MasterIndex::erase(IndexRecord* r) {
  unlink(r);
  if (!r->hot) cold_--;
  if (r->has_more) more_.erase(r);
  if (ChainLink* l = link_of(r)) {
    if (r->pass_held) {
      pass_held_[l->pass_seq] = nullptr;
      r->pass_held = false;
    }
    unchain(r, l);
  }
  map_.erase(r);
}

// ---- KV chain links -------------------------------------------------------------------
ChainLink& MasterIndex::chain(IndexRecord* r) {
  if (r->link == 0) {
    if (links_.empty()) links_.emplace_back();  // index 0: no link
    if (free_links_.empty()) {
      if (links_.size() > UINT32_MAX) throw std::length_error("MasterIndex: over 2^32 chain links");
      r->link = uint32_t(links_.size());
      links_.emplace_back();
    } else {
      r->link = free_links_.back();
      free_links_.pop_back();
      links_[r->link] = ChainLink{};
    }
  }
  return links_[r->link];
}

ChainLink* MasterIndex::link_of(const IndexRecord* r) {
  return r->link ? &links_[r->link] : nullptr;
}

void MasterIndex::free_link(IndexRecord* r) {
  free_links_.push_back(r->link);
  r->link = 0;
}

bool MasterIndex::held_by(const ChainLink* l) const {
  return l != nullptr && (l->kids > 0 || (l->holds & kHoldWait) || (remote_holds_ && (l->holds & kHoldRemote)));
}

bool MasterIndex::remote_only(const IndexRecord* r) const {
  if (!r->link) return false;
  const ChainLink& l = links_[r->link];
  return l.kids == 0 && !(l.holds & kHoldWait) && (l.holds & kHoldRemote);
}

// (A record the current eviction pass holds keeps its links, its place in the pass among
// them: end_pass trims them.)
void MasterIndex::trim_link(IndexRecord* r, ChainLink* l) {
  if (l->parent == nullptr && l->kid == nullptr && l->holds == 0 && !r->pass_held) free_link(r);
}

void MasterIndex::detach(IndexRecord* r, ChainLink* l) {
  IndexRecord* old = l->parent;
  ChainLink* ol = &links_[old->link];
  IndexRecord** at = &ol->kid;
  while (*at != r) at = &links_[(*at)->link].sib;
  *at = l->sib;
  l->sib = nullptr;
  l->parent = nullptr;
  ol->kids--;
  trim_link(old, ol);
}

void MasterIndex::set_parent(IndexRecord* r, IndexRecord* p) {
  ChainLink* l = link_of(r);
  if ((l ? l->parent : nullptr) == p) return;
  if (l != nullptr && l->parent != nullptr) detach(r, l);  // out of the old parent's children
  if (p != nullptr) {
    ChainLink& pl = chain(p);
    l = &chain(r);  // (a deque: pl is still good)
    l->parent = p;
    l->sib = pl.kid;
    pl.kid = r;
    pl.kids++;
  } else if (l != nullptr) {
    trim_link(r, l);
  }
}

void MasterIndex::unchain(IndexRecord* r, ChainLink* l) {
  if (l->parent != nullptr) detach(r, l);
  for (IndexRecord* k = l->kid; k != nullptr;) {
    ChainLink* kl = &links_[k->link];
    IndexRecord* next = kl->sib;
    kl->parent = kl->sib = nullptr;
    trim_link(k, kl);
    k = next;
  }
  free_link(r);
}

void MasterIndex::set_chain_links(bool on) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  links_on_ = on;
  if (!on) {
    end_pass();
    for (IndexRecord* r = oldest_; r != nullptr; r = r->newer) r->link = 0;
    links_.clear();
    free_links_.clear();
  }
}

void MasterIndex::link(const std::string& key, const std::string& parent) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  if (!links_on_) return;
  IndexRecord* r = find(key);
  if (r == nullptr) return;
  IndexRecord* p = parent.empty() ? nullptr : find(parent);
  set_parent(r, p == r ? nullptr : p);
}

void MasterIndex::set_holds(const std::string& key, uint32_t holds) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  if (!links_on_) return;
  IndexRecord* r = find(key);
  if (r == nullptr) return;
  if (holds != 0) {
    chain(r).holds = holds;
  } else if (ChainLink* l = link_of(r)) {
    l->holds = 0;
    trim_link(r, l);
  }
}

void MasterIndex::set_remote_holds(bool on) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  remote_holds_ = on;
}

std::tuple<std::string, uint32_t, uint32_t> MasterIndex::chain_of(const std::string& key) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  IndexRecord* r = find(key);
  if (r == nullptr || !r->link) return {"", 0, 0};
  const ChainLink& l = links_[r->link];
  return {l.parent ? std::string(l.parent->key()) : std::string(), l.kids, l.holds};
}

size_t MasterIndex::link_count() {
  std::lock_guard<std::recursive_mutex> g(mu_);
  return links_.empty() ? 0 : links_.size() - 1 - free_links_.size();
}

void MasterIndex::end_pass() {
  for (IndexRecord* r : pass_held_)
    if (r != nullptr) {
      r->pass_held = false;
      trim_link(r, &links_[r->link]);
    }
  pass_held_.clear();
  pass_cut_ = false;
}

IndexEntry MasterIndex::answer(const IndexRecord& r) const {
  IndexEntry e;
  e.size = r.size;
  e.gen = r.gen;
  if (r.hot ? r.has_rep : !r.disk) {
    e.reps.push_back(r.rep);
    if (r.hot && r.has_more) {
      const auto& more = more_.at(&r);
      e.reps.insert(e.reps.end(), more.begin(), more.end());
    }
  }
  return e;
}

bool MasterIndex::grant_cold(IndexRecord& r, uint64_t lease, double now) {
  // As ReplicaTable.grant_lease: leases past their end are forgotten before a new one.
  if (r.lease_until <= now) r.leases[0] = r.leases[1] = 0;
  uint64_t* slot = r.leases[0] == 0 ? &r.leases[0] : r.leases[1] == 0 ? &r.leases[1] : nullptr;
  if (slot == nullptr) return false;
  *slot = lease;
  r.lease_until = std::max(r.lease_until, now + ttl_s_);
  return true;
}

void MasterIndex::release_cold(IndexRecord& r, uint64_t lease, double now) {
  // As ReplicaTable.end_lease: an id not held changes nothing; the last one held ends
  // the lease now rather than at its expiry.
  for (auto& slot : r.leases) {
    if (slot != lease) continue;
    slot = 0;
    if (r.leases[0] == 0 && r.leases[1] == 0) r.lease_until = std::min(r.lease_until, now);
    return;
  }
}

void MasterIndex::set(const std::string& key, uint64_t size, uint64_t gen,
                      std::vector<IndexReplica> reps) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  bool fresh;
  IndexRecord& r = insert(key, &fresh);
  if (!fresh && !r.hot) cold_--;  // a cold record replaced
  r.hot = true;
  resize(r, size);
  r.gen = gen;
  r.disk = false;
  r.lease_until = 0;
  r.leases[0] = r.leases[1] = 0;
  r.has_rep = !reps.empty();
  r.rep = r.has_rep ? reps[0] : IndexReplica{};
  if (reps.size() > 1)
    more_[&r].assign(reps.begin() + 1, reps.end());
  else if (r.has_more)
    more_.erase(&r);
  r.has_more = reps.size() > 1;
}

void MasterIndex::set_cold(const std::string& key, const ColdRecord& rec) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  bool fresh;
  IndexRecord& r = insert(key, &fresh);
  if (fresh || r.hot) cold_++;
  r.hot = false;
  r.has_rep = false;
  if (r.has_more) more_.erase(&r);
  r.has_more = false;
  resize(r, rec.size);
  r.gen = rec.gen;
  r.rep = rec.rep;
  r.disk = rec.disk;
  r.lease_until = rec.lease_until;
  r.leases[0] = rec.leases.size() > 0 ? rec.leases[0] : 0;
  r.leases[1] = rec.leases.size() > 1 ? rec.leases[1] : 0;
}

static void read_cold(const IndexRecord& r, ColdRecord* out) {
  out->size = r.size;
  out->gen = r.gen;
  out->rep = r.rep;
  out->disk = r.disk;
  out->lease_until = r.lease_until;
  out->leases.clear();
  for (uint64_t id : r.leases)
    if (id) out->leases.push_back(id);
  std::sort(out->leases.begin(), out->leases.end());
}

bool MasterIndex::hydrate(const std::string& key, ColdRecord* out) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  IndexRecord* r = find(key);
  if (r == nullptr || r->hot) return false;
  read_cold(*r, out);
  // Hot from now on: Python holds the object; the record keeps what a GET answers.
  r->hot = true;
  r->has_rep = !r->disk;
  r->disk = false;
  r->lease_until = 0;
  r->leases[0] = r->leases[1] = 0;
  cold_--;
  return true;
}

bool MasterIndex::peek_cold(const std::string& key, ColdRecord* out) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  IndexRecord* r = find(key);
  if (r == nullptr || r->hot) return false;
  read_cold(*r, out);
  return true;
}

bool MasterIndex::contains(const std::string& key) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  return find(key) != nullptr;
}

bool MasterIndex::is_hot(const std::string& key) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  IndexRecord* r = find(key);
  return r != nullptr && r->hot;
}

void MasterIndex::link_after(IndexRecord* r, IndexRecord* after) {
  r->older = after;
  r->newer = after ? after->newer : oldest_;
  (r->newer ? r->newer->older : newest_) = r;
  (after ? after->newer : oldest_) = r;
}

void MasterIndex::put_on_probation(IndexRecord* r) {
  unlink(r);
  link_after(r, grace_last_ ? grace_last_ : stack_last_);
  r->probation = r->grace = true;
  grace_bytes_ += r->size;
  grace_last_ = r;
  if (grace_first_ == nullptr) grace_first_ = r;
  while (grace_bytes_ > grace_max_ && grace_first_ != nullptr) {  // the oldest leaves the window
    IndexRecord* g = grace_first_;
    unlink(g);
    link_after(g, nullptr);  // the stack's top: the first to go
    g->probation = true;
    if (stack_last_ == nullptr) stack_last_ = g;
  }
}

void MasterIndex::set_grace_bytes(uint64_t n) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  grace_max_ = n;
}

void MasterIndex::resize(IndexRecord& r, uint64_t size) {
  if (r.grace) grace_bytes_ = grace_bytes_ - r.size + size;
  r.size = size;
}

void MasterIndex::probation(const std::string& key) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  if (IndexRecord* r = find(key)) put_on_probation(r);
}

void MasterIndex::set_insert_old(bool on) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  if (on && !insert_old_) {
    std::vector<IndexRecord*> unread;
    for (IndexRecord* r = grace_last_ ? grace_last_->newer : stack_last_ ? stack_last_->newer : oldest_; r != nullptr;
         r = r->newer)
      if (r->unread && !r->probation) unread.push_back(r);
    // At the old end, oldest first, ahead of what is already on probation (and behind what
    // leaves the grace window from now on): a page a reader is about to load (put a turn
    // ago, say) is the last of them to go.
    for (auto it = unread.rbegin(); it != unread.rend(); ++it) {
      IndexRecord* r = *it;
      unlink(r);
      link_after(r, nullptr);
      r->probation = true;
      if (stack_last_ == nullptr) stack_last_ = r;
    }
  } else if (!on && insert_old_) {
    // Back to "recent": what is on probation goes to the recent end in the order it would
    // have gone in, unread (a put under "recent" lands there; a flip to "old" and back
    // must not leave a page a reader waits for among the first to go).
    std::vector<IndexRecord*> probed;
    for (IndexRecord* r = oldest_; r != nullptr && r->probation; r = r->newer) probed.push_back(r);
    for (IndexRecord* r : probed) {
      unlink(r);
      link_recent(r);
      r->unread = true;
    }
  }
  insert_old_ = on;
}

void MasterIndex::note(int kind, const std::string& key, const IndexRecord* r, uint64_t size, bool chained) {
  if (sample_shift_ >= 64) return;  // sampling off
  // the key's 32-bit hash as RecordMap takes it, in the top bits (they decide the sample)
  const uint64_t h = uint64_t(r != nullptr ? r->hash : RecordMap<IndexRecord>::hash(key)) << 32;
  if (sample_shift_ > 0 && (h >> (64 - sample_shift_)) != 0) return;
  if (samples_.size() >= kMaxSamples) {
    samples_dropped_++;
    return;
  }
  samples_.push_back(RefSample{h, size, kind, chained});
}

void MasterIndex::set_sample_shift(int shift) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  sample_shift_ = std::max(0, std::min(shift, 64));
}

void MasterIndex::sample(int kind, const std::string& key, uint64_t size, bool chained) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  note(kind, key, find(key), size, chained);
}

std::vector<RefSample> MasterIndex::take_samples(uint64_t* dropped) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  *dropped = samples_dropped_;
  samples_dropped_ = 0;
  std::vector<RefSample> out;
  out.swap(samples_);
  return out;
}

void MasterIndex::touch(const std::string& key, bool unread) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  IndexRecord* r = find(key);
  if (r == nullptr) return;
  r->unread = unread;
  if (r == newest_ && !r->probation) return;  // (on probation it is newest only when all are)
  unlink(r);
  link_recent(r);
}

void MasterIndex::drop(const std::string& key) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  if (IndexRecord* r = find(key)) erase(r);
}

void MasterIndex::drop_many(const std::vector<std::string>& keys) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  for (auto& k : keys)
    if (IndexRecord* r = find(k)) erase(r);
}

std::vector<ScanItem> MasterIndex::scan(const std::string& after, const std::string& node_id, bool disk,
                                        double now, size_t limit, std::string* next) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  std::vector<ScanItem> out;
  next->clear();
  IndexRecord* r = oldest_;
  if (!after.empty()) {
    IndexRecord* a = find(after);
    r = a == nullptr ? nullptr : a->newer;
  }
  size_t seen = 0;
  for (; r != nullptr; r = r->newer) {
    if (out.size() >= limit || seen >= 16 * limit) {  // the caller comes back for more
      next->assign(r->older->key());
      break;
    }
    seen++;
    if (r->hot) {
      out.push_back(ScanItem{std::string(r->key()), true});
    } else if (r->disk == disk && r->lease_until <= now && r->rep.node && r->rep.node->node_id == node_id) {
      out.push_back(ScanItem{std::string(r->key()), false, r->gen, r->size, r->rep.offset, r->rep.length});
    }
  }
  return out;
}

MasterIndex::Evicted MasterIndex::evict_cold(const std::string& after, const std::string& node_id, double now,
                                              uint64_t need, bool chains) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  Evicted out;
  IndexRecord* r = oldest_;
  if (!after.empty()) {
    IndexRecord* a = find(after);
    r = a == nullptr ? oldest_ : a->newer;
  } else {
    end_pass();  // a new pass
  }
  chains = chains && links_on_;
  std::vector<std::pair<uint64_t, uint64_t>> extents;
  auto drop = [&](IndexRecord* d) {
    out.keys.emplace_back(d->key());
    out.gens.push_back(d->gen);
    extents.emplace_back(d->rep.offset, d->rep.length);
    out.freed += d->rep.length;
    erase(d);
  };
  // Drop d; its parent, if met while held and now left with nothing holding it, is the
  // least recent leaf: it goes next (a held record was met before d, so is not next).
  auto drop_up = [&](IndexRecord* d, const ChainLink* l) {
    IndexRecord* p = l != nullptr ? l->parent : nullptr;
    drop(d);
    while (p != nullptr && out.freed < need && p->pass_held) {
      const ChainLink* pl = &links_[p->link];  // (a record the pass holds keeps its links)
      if (held_by(pl)) break;
      IndexRecord* pp = pl->parent;
      drop(p);
      p = pp;
    }
  };
  // Leaving the probation records short of the need: those held by remote children alone
  // go first (see the header).
  auto cut = [&]() {
    pass_cut_ = true;
    std::vector<size_t> left;  // in the order met
    for (size_t i = 0; i < pass_held_.size(); ++i)
      if (pass_held_[i] != nullptr && pass_held_[i]->probation && remote_only(pass_held_[i])) left.push_back(i);
    for (size_t i : left) {
      if (out.freed >= need) break;
      IndexRecord* h = pass_held_[i];  // (nullptr: it went above, as a parent)
      if (h != nullptr && remote_only(h)) drop_up(h, link_of(h));
    }
  };
  bool cutting = chains && remote_holds_ && !pass_cut_;
  while (r != nullptr && out.freed < need) {
    IndexRecord* next = r->newer;
    if (r->hot) {
      out.stop = r->key();
      break;
    }
    if (cutting && !r->probation) {
      cutting = false;
      cut();
      if (out.freed >= need) break;
    }
    if (!r->disk && r->lease_until <= now && r->rep.node && r->rep.node->node_id == node_id) {
      ChainLink* l = chains ? link_of(r) : nullptr;
      if (held_by(l)) {  // waits for its children
        if (!r->pass_held) {
          r->pass_held = true;
          l->pass_seq = uint32_t(pass_held_.size());
          pass_held_.push_back(r);
        }
      } else {
        drop_up(r, l);
      }
    }
    r = next;
  }
  if (cutting && r == nullptr && out.stop.empty() && out.freed < need) cut();
  if (chains && r == nullptr && out.stop.empty() && out.freed < need) {
    for (IndexRecord* h : pass_held_)
      if (h != nullptr)
        out.held.push_back(ScanItem{std::string(h->key()), false, h->gen, h->size, h->rep.offset, h->rep.length});
  }
  std::sort(extents.begin(), extents.end());
  for (auto& [off, len] : extents) {
    if (!out.runs.empty() && out.runs.back().first + out.runs.back().second == off)
      out.runs.back().second += len;
    else
      out.runs.emplace_back(off, len);
  }
  return out;
}

// A cold record's replica is on `node_id`, in an incarnation other than `except_incarnation`
// (when given: the records a restarted process of the node took over stay out).
static bool cold_on(const IndexRecord* r, const std::string& node_id, const std::string& except_incarnation) {
  return !r->hot && r->rep.node && r->rep.node->node_id == node_id &&
         (except_incarnation.empty() || r->rep.node->incarnation != except_incarnation);
}

std::vector<std::pair<std::string, bool>> MasterIndex::cold_on_node(const std::string& node_id,
                                                                    const std::string& except_incarnation) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  std::vector<std::pair<std::string, bool>> out;
  for (IndexRecord* r = oldest_; r != nullptr; r = r->newer)
    if (cold_on(r, node_id, except_incarnation)) out.emplace_back(std::string(r->key()), bool(r->disk));
  return out;
}

std::vector<std::tuple<std::string, bool, uint64_t>> MasterIndex::cold_gens_on_node(
    const std::string& node_id, const std::string& except_incarnation) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  std::vector<std::tuple<std::string, bool, uint64_t>> out;
  for (IndexRecord* r = oldest_; r != nullptr; r = r->newer)
    if (cold_on(r, node_id, except_incarnation)) out.emplace_back(std::string(r->key()), bool(r->disk), r->gen);
  return out;
}

std::vector<uint8_t> MasterIndex::retarget_cold(const std::vector<std::string_view>& keys, const int64_t* cols,
                                                const std::shared_ptr<const IndexNode>& to) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  std::vector<uint8_t> out(keys.size(), 0);
  for (size_t i = 0; i < keys.size(); ++i, cols += 4) {
    IndexRecord* r = find(keys[i]);
    if (r == nullptr || r->hot || r->disk || !r->rep.node || r->rep.node == to ||
        r->rep.node->node_id != to->node_id)
      continue;
    if (r->gen == uint64_t(cols[0]) && r->size == uint64_t(cols[1]) && r->rep.offset == uint64_t(cols[2]) &&
        r->rep.length == uint64_t(cols[3])) {
      r->rep.node = to;
      out[i] = 1;
    }
  }
  return out;
}

std::vector<std::string> MasterIndex::keys(const std::string& prefix) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  std::vector<std::string> out;
  for (IndexRecord* r = oldest_; r != nullptr; r = r->newer)
    if (r->key().substr(0, prefix.size()) == prefix) out.emplace_back(r->key());
  return out;
}

std::vector<std::string> MasterIndex::hot_keys_recent_first() {
  std::lock_guard<std::recursive_mutex> g(mu_);
  std::vector<std::string> out;
  for (IndexRecord* r = newest_; r != nullptr; r = r->older)
    if (r->hot) out.emplace_back(r->key());
  return out;
}

size_t MasterIndex::cold_count() {
  std::lock_guard<std::recursive_mutex> g(mu_);
  return cold_;
}

std::shared_ptr<const IndexNode> MasterIndex::node(const std::string& node_id, const std::string& ray_node_id,
                                                   const std::string& incarnation) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  auto& slot = nodes_[{node_id, incarnation}];
  if (!slot || slot->ray_node_id != ray_node_id)
    slot = std::make_shared<const IndexNode>(IndexNode{node_id, ray_node_id, incarnation});
  if (nodes_.size() > 4096) {  // remounts made many: forget those no replica or slab uses
    for (auto it = nodes_.begin(); it != nodes_.end();)
      it = it->second.use_count() == 1 && it->second != slot ? nodes_.erase(it) : std::next(it);
  }
  return slot;
}

void MasterIndex::clear() {
  std::lock_guard<std::recursive_mutex> g(mu_);
  more_.clear();
  links_.clear();
  free_links_.clear();
  pass_held_.clear();
  map_.clear();
  oldest_ = newest_ = stack_last_ = grace_first_ = grace_last_ = nullptr;
  grace_bytes_ = 0;
  cold_ = 0;
}

void MasterIndex::set_enabled(bool on) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  enabled_ = on;
}

void MasterIndex::set_lease_ttl(double ttl_s) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  ttl_s_ = ttl_s;
}

void MasterIndex::set_max_log(size_t n) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  max_log_ = n;
}

std::vector<IndexLogEntry> MasterIndex::drain(uint64_t* misses, uint64_t* hits) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  *misses = misses_;
  misses_ = 0;
  *hits = hits_;
  hits_ = 0;
  commit_logged_ = false;
  held_logged_ = 0;
  std::vector<IndexLogEntry> out;
  out.swap(log_);
  return out;
}

size_t MasterIndex::size() {
  std::lock_guard<std::recursive_mutex> g(mu_);
  return map_.size();
}

uint64_t MasterIndex::served() {
  std::lock_guard<std::recursive_mutex> g(mu_);
  return served_;
}

uint64_t MasterIndex::lookups() {
  std::lock_guard<std::recursive_mutex> g(mu_);
  return lookups_;
}

bool MasterIndex::lookup(const std::string& key, IndexEntry* out) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  IndexRecord* r = find(key);
  if (r == nullptr) return false;
  *out = answer(*r);
  return true;
}

void MasterIndex::set_commits(bool on) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  commits_ = on;
}

void MasterIndex::set_max_key_bytes(size_t n) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  max_key_bytes_ = n;
}

void MasterIndex::set_slab(uint64_t id, IndexSlab slab) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  slabs_[id] = std::move(slab);
}

void MasterIndex::drop_slab(uint64_t id) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  slabs_.erase(id);
}

bool MasterIndex::lookup_slab(uint64_t id, IndexSlab* out) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  auto it = slabs_.find(id);
  if (it == slabs_.end()) return false;
  *out = it->second;
  return true;
}

size_t MasterIndex::slab_count() {
  std::lock_guard<std::recursive_mutex> g(mu_);
  return slabs_.size();
}

void MasterIndex::add_pending(const std::string& key) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  pending_.insert(key);
}

void MasterIndex::drop_pending(const std::string& key) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  pending_.erase(key);
}

size_t MasterIndex::pending_count() {
  std::lock_guard<std::recursive_mutex> g(mu_);
  return pending_.size();
}

bool MasterIndex::is_pending(const std::string& key) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  return pending_.count(key) > 0;
}

void MasterIndex::set_next_gen(uint64_t gen) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  next_gen_ = std::max(next_gen_, gen);
}

bool MasterIndex::wait_held(double timeout_s) {
  std::unique_lock<std::recursive_mutex> g(mu_);
  return commit_cv_.wait_for(g, std::chrono::duration<double>(timeout_s), [this] { return held_logged_ > 0; });
}

bool MasterIndex::wait_commits(double timeout_s) {
  std::unique_lock<std::recursive_mutex> g(mu_);
  return commit_cv_.wait_for(g, std::chrono::duration<double>(timeout_s),
                             [this] { return commit_logged_; });
}

// ``[PUT_COMMIT, [[key, slab_id, offset, size, upsert?], ...], owner, returns?]``. Only the
// clean case: every key new (not stored, no put in flight, not twice in the call), every
// extent an uncommitted part of the caller's slab. All or nothing. ``returns``: the caller's
// used-up slabs, given back after the commits (as Python's ``_put_commit`` does): they leave
// the mirror at once, so no later commit lands in them, and Python frees what is left of
// them when it applies the log (kReturn).
bool MasterIndex::serve_commit(const char* data, size_t len, std::string* out, const HeldReply* hold,
                               bool* held) {
  bool wake = false;
  const bool ok = serve_commit_locked(data, len, out, hold, held, &wake);
  // Python's applier waits for the first commit since it drained the log, or for a held
  // reply; the commits that follow within its gathering window wake nobody. Notified with
  // mu_ released, so the woken thread does not block on it while the reply is still to go.
  if (wake) commit_cv_.notify_all();
  return ok;
}

bool MasterIndex::serve_commit_locked(const char* data, size_t len, std::string* out, const HeldReply* hold,
                                      bool* held, bool* wake) {
  Reader r(data, len);
  uint32_t nargs, nitems;
  uint64_t op;
  if (!r.array(&nargs) || (nargs != 3 && nargs != 4) || !r.uint(&op) || !r.array(&nitems))
    return false;
  struct Item {
    std::string key;
    uint64_t slab = 0, offset = 0, size = 0;
    std::string parent;  // its KV chain's previous value ("" none)
    uint64_t crc = 0;    // the CRC-32C of its bytes, taken by the client in its copy
    bool has_crc = false;
  };
  std::vector<Item> items(nitems);
  for (auto& it : items) {
    uint32_t m;
    bool upsert = false;  // of a key not stored: a plain put
    if (!r.array(&m) || m < 4 || m > 7 || !r.str(&it.key) || !r.uint(&it.slab) || !r.uint(&it.offset) ||
        !r.uint(&it.size) || (m >= 5 && !r.boolean(&upsert)) || (m >= 6 && !r.str(&it.parent)))
      return false;
    if (m == 7) {
      if (r.nil()) continue;
      if (!r.uint(&it.crc) || it.crc > 0xffffffffull) return false;
      it.has_crc = true;
    }
  }
  std::string owner;
  if (!r.str(&owner)) return false;
  std::vector<uint64_t> returns;
  if (nargs == 4 && !r.nil()) {
    uint32_t nret;
    if (!r.array(&nret) || nret > kMaxReturns) return false;
    returns.resize(nret);
    for (auto& id : returns)
      if (!r.uint(&id)) return false;
  }
  if (!r.ok() || !r.at_end() || items.empty()) return false;

  std::lock_guard<std::recursive_mutex> g(mu_);
  if (!enabled_ || !commits_ || log_.size() + items.size() + returns.size() + (hold != nullptr) > max_log_)
    return false;
  std::unordered_map<uint64_t, std::map<uint64_t, uint64_t>> scratch;  // carved copies
  std::unordered_set<std::string> seen;
  // Durable through commit rings: every item's node has a usable ring with room for its
  // records (twice their bytes: room for padding at the wrap).
  std::unordered_map<CommitRing*, uint64_t> need;
  bool by_ring = hold != nullptr && !rings_.empty();
  for (auto& it : items) {
    if (it.key.empty() || it.key.size() > max_key_bytes_ || !seen.insert(it.key).second) return false;
    if (it.parent == it.key || it.parent.size() > max_key_bytes_) return false;  // Python's error
    if (pending_.count(it.key) || find(it.key) != nullptr) return false;
    auto s = slabs_.find(it.slab);
    if (s == slabs_.end() || s->second.owner != owner) return false;
    auto sc = scratch.find(it.slab);
    if (sc == scratch.end()) sc = scratch.emplace(it.slab, s->second.free).first;
    if (!carve(sc->second, it.offset, extent_length(it.size))) return false;
    if (by_ring) {
      CommitRing* ring = usable_ring(*s->second.node.node);
      if (ring == nullptr) by_ring = false;
      else need[ring] += 2 * ring_record_bytes(it.key, it.parent);
    }
  }
  std::unordered_map<CommitRing*, uint64_t> heads;  // where each ring's next record goes
  by_ring = by_ring && ring_room(need, &heads);
  for (auto& kv : scratch) slabs_[kv.first].free = std::move(kv.second);
  const double now = monotonic_s();
  const uint64_t wall = wall_ns();
  out->clear();
  Writer w(out);
  w.array(2);
  w.uint(kOk);
  w.array(uint32_t(items.size()));
  for (auto& it : items) {
    const uint64_t gen = std::max(next_gen_ + 1, wall);  // as put_commit numbers values
    next_gen_ = gen;
    // A new value with one ready DRAM replica and no lease: cold from the start.
    bool fresh;
    IndexRecord& r = insert(it.key, &fresh);
    r.size = it.size;
    r.gen = gen;
    r.rep = slabs_[it.slab].node;
    r.rep.offset = it.offset;
    r.rep.length = extent_length(it.size);
    cold_++;
    if (insert_old_ && !it.parent.empty())
      put_on_probation(&r);
    else
      r.unread = !it.parent.empty();
    if (links_on_ && !it.parent.empty()) {  // its chain link (a parent in the same call is stored already)
      if (IndexRecord* p = find(it.parent)) set_parent(&r, p);
    }
    note(kRefPut, it.key, &r, it.size, !it.parent.empty());
    if (by_ring) {
      CommitRing* ring = usable_ring(*slabs_[it.slab].node.node);
      const uint32_t crc = uint32_t(it.crc);
      ring_write(*ring, &heads[ring], gen, it.size, it.offset, extent_length(it.size), it.key, it.parent,
                 kRingCommit | kRingAlone, it.has_crc ? &crc : nullptr);
    }
    log_.push_back(IndexLogEntry{kCommit, it.key, gen, it.slab, now, it.offset, it.size, std::move(it.parent)});
    w.uint(gen);
  }
  if (by_ring) {
    by_ring = ring_publish_heads(heads);
    if (by_ring) {
      ring_acks_ += items.size();
      // Answered through the rings: the nodes have the records, and Python sends them no
      // message adding these values (a node whose process is gone gets its records from
      // the ring when it restarts; a held reply below waits for the message instead).
      for (size_t k = log_.size() - items.size(); k < log_.size(); ++k) log_[k].kind = kCommitRinged;
    }
  }
  for (uint64_t id : returns) {  // after the commits: a returned slab may hold some of them
    slabs_.erase(id);
    log_.push_back(IndexLogEntry{kReturn, std::string(), 0, id, now, 0, 0, std::string()});
  }
  *wake = !commit_logged_;
  if (hold != nullptr && !by_ring) {
    log_.push_back(IndexLogEntry{kHeld, std::move(*out), hold->call_id, hold->peer_uid, now, hold->lane, 0});
    held_logged_++;
    out->clear();
    if (held != nullptr) *held = true;
    *wake = true;
  }
  served_++;
  commit_logged_ = true;
  return true;
}

CommitRing* MasterIndex::usable_ring(const std::string& node_id, const std::string& incarnation) {
  auto it = rings_.find(node_id);
  if (it == rings_.end() || it->second.incarnation != incarnation) return nullptr;
  auto* hdr = reinterpret_cast<std::atomic<uint64_t>*>(it->second.base);
  if (hdr[0].load(std::memory_order_relaxed) != kRingMagic ||
      hdr[1].load(std::memory_order_acquire) != it->second.epoch)
    return nullptr;  // the node has mounted again since (or reset its ring)
  return &it->second;
}

bool MasterIndex::ring_node_alive(const CommitRing& ring) {
  if (flock(ring.fd, LOCK_SH | LOCK_NB) == 0) {  // nobody holds it: the node is gone
    flock(ring.fd, LOCK_UN);
    return false;
  }
  if (ring.proc_fd < 0) return true;
  // /proc/<pid>/task/<pid>/stat (the main thread's; its flags and pending signals are what
  // /proc/<pid>/stat shows): "pid (comm) state ppid ...": field 9 the flags (PF_EXITING 0x4),
  // field 31 the pending signals (a SIGKILL is queued to every thread as it is sent).
  char buf[1024];
  const ssize_t n = pread(ring.proc_fd, buf, sizeof buf - 1, 0);
  if (n <= 0) return false;  // reaped
  buf[n] = 0;
  const char* p = strrchr(buf, ')');
  if (p == nullptr || p[1] != ' ') return true;
  p += 2;
  if (*p == 'Z' || *p == 'X' || *p == 'x') return false;
  uint64_t flags = 0, sigs = 0;
  for (int field = 3; *p != 0 && field <= 31; field++) {
    if (field == 9) flags = strtoull(p, nullptr, 10);
    if (field == 31) sigs = strtoull(p, nullptr, 10);
    p = strchr(p, ' ');
    if (p == nullptr) break;
    p++;
  }
  return !(flags & 0x4) && !(sigs & (1ull << 8));
}

bool MasterIndex::ring_room(const std::unordered_map<CommitRing*, uint64_t>& need,
                            std::unordered_map<CommitRing*, uint64_t>* heads) {
  for (auto& kv : need) {
    auto* hdr = reinterpret_cast<std::atomic<uint64_t>*>(kv.first->base);
    const uint64_t area = kv.first->bytes - kRingHeader;
    const uint64_t head = hdr[2].load(std::memory_order_relaxed);
    const uint64_t used = head - hdr[3].load(std::memory_order_acquire);
    if (used > area || area - used < kv.second) return false;
    (*heads)[kv.first] = head;
  }
  return true;
}

bool MasterIndex::ring_publish_heads(const std::unordered_map<CommitRing*, uint64_t>& heads) {
  // Published, then the nodes' liveness: a record written while its node held its lock
  // is read by that node or, after its death, by the process that restarts it.
  for (auto& kv : heads)
    reinterpret_cast<std::atomic<uint64_t>*>(kv.first->base)[2].store(kv.second, std::memory_order_release);
  bool alive = true;
  for (auto& kv : heads)
    if (!ring_node_alive(*kv.first)) alive = false;
  return alive;
}

uint64_t MasterIndex::ring_record_bytes(const std::string& key, const std::string& parent) {
  return (48 + key.size() + parent.size() + 4 + 7) / 8 * 8;  // room for a CRC after the parent
}

void MasterIndex::ring_write(CommitRing& ring, uint64_t* head, uint64_t gen, uint64_t size, uint64_t offset,
                             uint64_t length, const std::string& key, const std::string& parent, uint32_t kind,
                             const uint32_t* crc) {
  uint8_t* area = ring.base + kRingHeader;
  const uint64_t cap = ring.bytes - kRingHeader;
  const uint64_t n = ring_record_bytes(key, parent);
  uint64_t pos = *head % cap;
  if (cap - pos < n) {  // no room before the end: pad to it, start over at 0
    const uint32_t pad[2] = {uint32_t(cap - pos), kRingPad};
    std::memcpy(area + pos, pad, sizeof pad);
    *head += cap - pos;
    pos = 0;
  }
  uint8_t* p = area + pos;
  const uint32_t h[2] = {uint32_t(n), crc != nullptr ? kind | kRingHasCrc : kind};
  const uint64_t f[4] = {gen, size, offset, length};
  const uint32_t lens[2] = {uint32_t(key.size()), uint32_t(parent.size())};
  std::memcpy(p, h, 8);
  std::memcpy(p + 8, f, 32);
  std::memcpy(p + 40, lens, 8);
  std::memcpy(p + 48, key.data(), key.size());
  std::memcpy(p + 48 + key.size(), parent.data(), parent.size());
  const uint32_t c = crc != nullptr ? *crc : 0;
  std::memcpy(p + 48 + key.size() + parent.size(), &c, 4);
  *head += n;
}

bool MasterIndex::ring_publish(const std::vector<RingRecord>& recs) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  std::unordered_map<CommitRing*, uint64_t> need;
  for (auto& r : recs) {
    CommitRing* ring = usable_ring(r.node_id, r.incarnation);
    if (ring == nullptr || r.key.size() > max_key_bytes_ || r.parent.size() > max_key_bytes_) return false;
    need[ring] += 2 * ring_record_bytes(r.key, r.parent);
  }
  std::unordered_map<CommitRing*, uint64_t> heads;
  if (!ring_room(need, &heads)) return false;
  for (auto& r : recs) {
    CommitRing* ring = usable_ring(r.node_id, r.incarnation);
    ring_write(*ring, &heads[ring], r.gen, r.size, r.offset, r.length, r.key, r.parent, r.kind,
               r.has_crc ? &r.crc : nullptr);
  }
  const bool alive = ring_publish_heads(heads);
  if (alive) ring_acks_ += recs.size();
  return alive && !recs.empty();
}

void MasterIndex::set_ring(const std::string& node_id, CommitRing ring) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  rings_[node_id] = std::move(ring);
}

void MasterIndex::drop_ring(const std::string& node_id) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  rings_.erase(node_id);
}

uint64_t MasterIndex::ring_acks() {
  std::lock_guard<std::recursive_mutex> g(mu_);
  return ring_acks_;
}

bool MasterIndex::serve(const char* data, size_t len, std::string* out, const HeldReply* hold, bool* held) {
  Reader r(data, len);
  uint32_t nargs;
  uint64_t op;
  if (!r.array(&nargs) || nargs < 2 || !r.uint(&op)) return false;
  if (op == kOpPutCommit) return serve_commit(data, len, out, hold, held);
  std::vector<std::string> keys;
  std::vector<Release> releases;
  std::string client_node;
  if (op == kOpGet) {  // [GET, keys, client_node?, done?]
    if (nargs > 4 || !read_keys(r, &keys)) return false;
    if (nargs >= 3 && !r.nil() && !r.str(&client_node)) return false;
    if (nargs == 4 && !r.nil() && !read_releases(r, &releases)) return false;
  } else if (op == kOpExists) {  // [EXISTS, keys]
    if (nargs != 2 || !read_keys(r, &keys)) return false;
  } else if (op == kOpRelease) {  // [RELEASE, done]
    if (nargs != 2 || !read_releases(r, &releases)) return false;
  } else {
    return false;
  }
  if (!r.ok() || !r.at_end()) return false;

  std::lock_guard<std::recursive_mutex> g(mu_);
  if (!enabled_ || log_.size() + keys.size() + releases.size() > max_log_) return false;
  const double now = monotonic_s();
  std::vector<IndexRecord*> found(keys.size(), nullptr);
  for (size_t i = 0; i < keys.size(); i++) {
    IndexRecord* r = find(keys[i]);
    if (r == nullptr) continue;  // a miss
    if (op == kOpGet) {
      if (r->hot ? !r->has_rep : r->disk) return false;  // Python promotes it
      // A cold value read by two readers already: Python holds the third lease.
      if (!r->hot && r->lease_until > now && r->leases[0] && r->leases[1]) return false;
    }
    found[i] = r;
  }
  if (op == kOpGet) {  // the same key twice in one call: its second lease may not fit
    for (size_t i = 0; i < keys.size(); i++)
      for (size_t j = 0; j < i && found[i] && !found[i]->hot; j++)
        if (found[j] == found[i]) return false;
  }
  served_++;
  out->clear();
  Writer w(out);
  w.array(2);
  w.uint(kOk);
  if (op == kOpGet)
    for (size_t i = 0; i < keys.size(); i++) note(kRefGet, keys[i], found[i], 0, false);
  if (op == kOpExists) {
    lookups_ += keys.size();
    w.array(uint32_t(keys.size()));
    for (auto* r : found) w.boolean(r != nullptr);
    return true;
  }
  // Releases first, as Python's handler does: a reader's earlier leases end before this
  // call grants new ones. A cold record's end here; any other is logged for Python (a
  // hot object's, or one of a value dropped or replaced since).
  for (auto& rel : releases) {
    IndexRecord* r = find(rel.key);
    if (r != nullptr && !r->hot && r->gen == rel.gen)
      release_cold(*r, rel.lease, now);
    else
      log_.push_back(IndexLogEntry{kRelease, std::move(rel.key), rel.gen, rel.lease, now});
  }
  if (op == kOpRelease) {
    w.nil();
    return true;
  }
  w.array(uint32_t(keys.size()));
  std::vector<const IndexReplica*> order;
  for (size_t i = 0; i < keys.size(); i++) {
    IndexRecord* r = found[i];
    if (r == nullptr) {
      misses_++;
      w.nil();
      continue;
    }
    uint64_t lease = next_lease_++;
    if (r->hot) {
      log_.push_back(IndexLogEntry{kGrant, keys[i], r->gen, lease, now});
    } else {
      grant_cold(*r, lease, now);  // a slot is free: checked above
      hits_++;
    }
    r->unread = false;
    // The caller's own replicas first (by store-node id or Ray node id), otherwise in
    // the state machine's order, as its get() does.
    order.clear();
    order.push_back(&r->rep);
    if (r->hot && r->has_more)
      for (auto& rep : more_.at(r)) order.push_back(&rep);
    if (!client_node.empty() && order.size() > 1)
      std::stable_partition(order.begin(), order.end(), [&](const IndexReplica* x) {
        return x->node->node_id == client_node || x->node->ray_node_id == client_node;
      });
    w.array(5);
    w.uint(r->size);
    w.uint(r->gen);
    w.f64(ttl_s_);
    w.array(uint32_t(order.size()));
    for (auto* x : order) {
      w.array(6);
      w.str(x->node->node_id);
      w.str("dram");
      w.uint(x->offset);
      w.uint(x->length);
      w.str(x->node->incarnation);
      w.uint(x->placed);
    }
    w.uint(lease);
  }
  // A hit is a use (and ends a probation). With chain links, a batch's hits are used last
  // to first: a prefix read leaves its chain's end the least recent of it, so recency order
  // takes a chain from its end (on another master shard too, which cannot see the links).
  auto use = [&](IndexRecord* r) {
    if (r != nullptr && (r != newest_ || r->probation)) {
      unlink(r);
      link_recent(r);
    }
  };
  if (links_on_)
    for (size_t i = found.size(); i-- > 0;) use(found[i]);
  else
    for (IndexRecord* r : found) use(r);
  return true;
}

}  // namespace mcr
