// The insertion policy's miniature caches (mooncake_ray/_private/master/adaptive.py, whose
// MiniCache and PolicySim are the reference this follows step for step): two caches of
// sampled key hashes, one per insertion policy ("recent", "old"), at the sampled share of
// the master's DRAM, and the same pair at half of it. The master feeds them the
// references its read index sampled and gets back the closed windows of hit counts; the
// decision stays in Python.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "mcr/master_index.h"

namespace mcr {

// A miniature cache under one insertion policy, in bytes: a main order (least recent
// first), and for "old" the chained values on probation (a grace window of the newest,
// first in first out, and before them a stack, last in first out).
class MiniCache {
 public:
  static constexpr double kGrace = 0.02;  // of the capacity: the grace window (adaptive.GRACE)

  explicit MiniCache(bool old) : old_(old) {}
  bool contains(uint64_t h) const { return at_.count(h) != 0; }
  size_t keys() const { return at_.size(); }  // the hashes it holds
  // A read: a hit moves ``h`` to the recent end (off probation).
  bool ref(uint64_t h);
  // ``h`` stored (``is_new``: never seen, so not here), then evict down to ``cap``.
  void put(uint64_t h, uint64_t size, bool chained, uint64_t cap, bool is_new);
  void drop(uint64_t h);
  // Forget every hash whose top ``shift`` bits are not all 0.
  void keep_only(int shift);
  // The hashes of one order, least recent (main), first in (grace), bottom (stack) first.
  std::vector<uint64_t> order(int which) const;

  uint64_t bytes = 0, grace_bytes = 0, evictions = 0;
  static constexpr int kMain = 0, kGraceList = 1, kStack = 2;

 private:
  static constexpr uint32_t kNil = UINT32_MAX;
  struct Node {
    uint64_t h = 0, size = 0;
    uint32_t prev = kNil, next = kNil;
    int which = 0;
  };
  struct List {
    uint32_t head = kNil, tail = kNil;
  };
  uint32_t alloc(uint64_t h, uint64_t size, int which);
  void link_back(uint32_t i);
  void unlink(uint32_t i);
  void release(uint32_t i);  // unlinked: back to the pool, out of the map
  // Pop the front (or back) of a list: its hash and size; the list must not be empty.
  uint64_t pop(int which, bool back);
  bool take(uint64_t h, int which, uint64_t* size);  // remove ``h`` if it is in ``which``
  bool unprobe(uint64_t h, uint64_t* size);

  bool old_;
  std::vector<Node> pool_;
  std::vector<uint32_t> free_;
  std::unordered_map<uint64_t, uint32_t> at_;
  List lists_[3];
};

// Hit counts over WINDOW counted references: n, the hits of "recent" and "old" at full
// size, at half size (0 once the full pair is pressed), and whether the full pair had
// evicted anything when the window closed.
struct PolicyWindow {
  uint32_t n = 0, hits[4] = {0, 0, 0, 0};
  bool pressed = false;
};

class PolicySim {
 public:
  static constexpr uint32_t kWindow = 64;

  // Runs the caches over ``samples`` (in order) at 1 / 2^shift of ``capacity`` bytes;
  // the windows that closed.
  std::vector<PolicyWindow> feed(const std::vector<RefSample>& samples, int shift, uint64_t capacity);
  // The full-size pair has evicted anything.
  bool pressed() const { return caches_[0].evictions || caches_[1].evictions; }
  size_t tracked() const { return seen_.size(); }
  // The keys the full-size "recent" cache holds (what a window's references are weighed
  // against: InsertionPolicy's score averages over about one cache's worth of them).
  size_t cache_keys() const { return caches_[0].keys(); }
  // Halves the sample rate (shift + 1) while more than ``bound`` sampled keys are tracked
  // (at most to 32), forgetting what the new rate rejects; the new shift.
  int halve(size_t bound, int shift);
  const uint32_t* window() const { return window_; }
  const MiniCache& cache(int i) const { return caches_[i]; }
  MiniCache& cache(int i) { return caches_[i]; }

 private:
  MiniCache caches_[4] = {MiniCache(false), MiniCache(true), MiniCache(false), MiniCache(true)};
  std::unordered_set<uint64_t> seen_;
  uint32_t window_[5] = {0, 0, 0, 0, 0};
};

}  // namespace mcr
