// The insertion policy's miniature caches (policy_sim.h; reference: adaptive.py).
#include "mcr/policy_sim.h"

namespace mcr {

namespace {
inline bool rejected(uint64_t h, int shift) { return shift > 0 && (h >> (64 - shift)) != 0; }
}  // namespace

uint32_t MiniCache::alloc(uint64_t h, uint64_t size, int which) {
  uint32_t i;
  if (!free_.empty()) {
    i = free_.back();
    free_.pop_back();
  } else {
    i = static_cast<uint32_t>(pool_.size());
    pool_.emplace_back();
  }
  Node& n = pool_[i];
  n.h = h;
  n.size = size;
  n.which = which;
  n.prev = n.next = kNil;
  at_.emplace(h, i);
  link_back(i);
  return i;
}

void MiniCache::link_back(uint32_t i) {
  Node& n = pool_[i];
  List& l = lists_[n.which];
  n.prev = l.tail;
  n.next = kNil;
  if (l.tail != kNil) pool_[l.tail].next = i;
  else l.head = i;
  l.tail = i;
}

void MiniCache::unlink(uint32_t i) {
  Node& n = pool_[i];
  List& l = lists_[n.which];
  if (n.prev != kNil) pool_[n.prev].next = n.next;
  else l.head = n.next;
  if (n.next != kNil) pool_[n.next].prev = n.prev;
  else l.tail = n.prev;
  n.prev = n.next = kNil;
}

void MiniCache::release(uint32_t i) {
  at_.erase(pool_[i].h);
  free_.push_back(i);
}

uint64_t MiniCache::pop(int which, bool back) {
  const uint32_t i = back ? lists_[which].tail : lists_[which].head;
  unlink(i);
  const uint64_t size = pool_[i].size;
  release(i);
  return size;
}

bool MiniCache::take(uint64_t h, int which, uint64_t* size) {
  auto it = at_.find(h);
  if (it == at_.end() || pool_[it->second].which != which) return false;
  const uint32_t i = it->second;
  unlink(i);
  *size = pool_[i].size;
  release(i);
  return true;
}

bool MiniCache::unprobe(uint64_t h, uint64_t* size) {
  if (take(h, kStack, size)) return true;
  if (take(h, kGraceList, size)) {
    grace_bytes -= *size;
    return true;
  }
  return false;
}

bool MiniCache::ref(uint64_t h) {
  auto it = at_.find(h);
  if (it == at_.end()) return false;
  const uint32_t i = it->second;
  if (pool_[i].which == kGraceList) grace_bytes -= pool_[i].size;
  unlink(i);
  pool_[i].which = kMain;  // to the recent end, off probation if it was on it
  link_back(i);
  return true;
}

void MiniCache::drop(uint64_t h) {
  uint64_t size = 0;
  if (take(h, kMain, &size) || unprobe(h, &size)) bytes -= size;
}

void MiniCache::put(uint64_t h, uint64_t size, bool chained, uint64_t cap, bool is_new) {
  if (!is_new) drop(h);
  bytes += size;
  if (old_ && chained) {
    alloc(h, size, kGraceList);
    grace_bytes += size;
    const double grace_max = static_cast<double>(cap) * kGrace;
    while (static_cast<double>(grace_bytes) > grace_max) {
      const uint32_t i = lists_[kGraceList].head;  // the oldest of the window: to the stack's top
      unlink(i);
      grace_bytes -= pool_[i].size;
      pool_[i].which = kStack;
      link_back(i);
    }
  } else {
    alloc(h, size, kMain);
  }
  while (bytes > cap) {
    evictions++;
    if (lists_[kStack].tail != kNil) {
      bytes -= pop(kStack, true);
    } else if (lists_[kGraceList].head != kNil) {
      const uint64_t gs = pop(kGraceList, false);
      grace_bytes -= gs;
      bytes -= gs;
    } else {
      bytes -= pop(kMain, false);
    }
  }
}

void MiniCache::keep_only(int shift) {
  std::vector<uint64_t> gone;
  for (const auto& [h, i] : at_)
    if (rejected(h, shift)) gone.push_back(h);
  for (uint64_t h : gone) drop(h);
}

std::vector<uint64_t> MiniCache::order(int which) const {
  std::vector<uint64_t> out;
  for (uint32_t i = lists_[which].head; i != kNil; i = pool_[i].next) out.push_back(pool_[i].h);
  return out;
}

std::vector<PolicyWindow> PolicySim::feed(const std::vector<RefSample>& samples, int shift, uint64_t capacity) {
  std::vector<PolicyWindow> out;
  const uint64_t cap = shift >= 64 ? 0 : capacity >> shift;
  const uint64_t caps[4] = {cap, cap, cap / 2, cap / 2};
  bool hits[4];
  for (const RefSample& s : samples) {
    if (rejected(s.hash, shift)) continue;  // taken before the rate was halved
    // The half-size pair decides only until the full-size pair feels pressure.
    const int n = pressed() ? 2 : 4;
    if (s.kind == MasterIndex::kRefPut) {
      // Stored again: a policy whose cache still holds it would have served it; a first
      // put counts for neither.
      if (seen_.insert(s.hash).second) {
        for (int c = 0; c < n; c++) caches_[c].put(s.hash, s.size, s.chained, caps[c], true);
        continue;
      }
      for (int c = 0; c < n; c++) hits[c] = caches_[c].contains(s.hash);
      for (int c = 0; c < n; c++) caches_[c].put(s.hash, s.size, s.chained, caps[c], false);
    } else {
      seen_.insert(s.hash);
      for (int c = 0; c < n; c++) hits[c] = caches_[c].ref(s.hash);
    }
    window_[0]++;
    for (int c = 0; c < n; c++) window_[c + 1] += hits[c];
    if (window_[0] >= kWindow) {
      PolicyWindow w;
      w.n = window_[0];
      for (int c = 0; c < 4; c++) w.hits[c] = window_[c + 1];
      w.pressed = pressed();
      out.push_back(w);
      for (uint32_t& x : window_) x = 0;
    }
  }
  return out;
}

int PolicySim::halve(size_t bound, int shift) {
  while (seen_.size() > bound && shift < 32) {
    shift++;
    for (auto it = seen_.begin(); it != seen_.end();)
      it = rejected(*it, shift) ? seen_.erase(it) : std::next(it);
  }
  for (MiniCache& c : caches_) c.keep_only(shift);
  return shift;
}

}  // namespace mcr
