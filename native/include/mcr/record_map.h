// The master index's table of records: key -> record, a chained hash table that grows by
// incremental rehashing (Redis's dict does the same). A std::unordered_map rehashes every
// node at once when it grows: measured here, 0.96 s at 6M keys, under the index's mutex,
// so every GET and every Python section of the master stopped for it. Here growing makes a
// bucket array twice the size, and each later insert, lookup or erase moves a few buckets
// of the old one, so no call pays for more than a handful.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace mcr {

template <typename Record>
class RecordMap {
 public:
  RecordMap() { t_[0].reset(kMinBuckets); }
  ~RecordMap() { clear(); }
  RecordMap(const RecordMap&) = delete;
  RecordMap& operator=(const RecordMap&) = delete;

  size_t size() const { return n_; }

  Record* find(std::string_view key) {
    step();
    size_t h = hash(key);
    for (int t = 0; t < (moving() ? 2 : 1); ++t) {
      if (t == 0 && moving() && (h & (t_[0].size() - 1)) < cursor_) continue;  // moved already
      for (Record* r = t_[t][h & (t_[t].size() - 1)]; r != nullptr; r = r->chain)
        if (r->hash == h && r->key_len == key.size() && std::memcmp(r->key_data, key.data(), key.size()) == 0)
          return r;
    }
    return nullptr;
  }

  // The record of `key`, made (value-initialised, key set) if absent; *made says which.
  Record* insert(const std::string& key, bool* made) {
    Record* r = find(key);
    *made = r == nullptr;
    if (r != nullptr) return r;
    if (!moving() && n_ >= t_[0].size()) grow();
    r = make(key);
    r->hash = hash(key);
    auto& table = t_[moving() ? 1 : 0];
    Record*& head = table[r->hash & (table.size() - 1)];
    r->chain = head;
    head = r;
    ++n_;
    return r;
  }

  // Removes and deletes `r` (a record of this map).
  void erase(Record* r) {
    step();
    for (int t = 0; t < (moving() ? 2 : 1); ++t) {
      Record** p = &t_[t][r->hash & (t_[t].size() - 1)];
      for (; *p != nullptr; p = &(*p)->chain) {
        if (*p == r) {
          *p = r->chain;
          --n_;
          destroy(r);
          return;
        }
      }
    }
  }

  void clear() {
    for (auto& table : t_) {
      for (size_t i = 0; i < table.size(); ++i) {
        for (Record* head = table[i]; head != nullptr;) {
          Record* next = head->chain;
          destroy(head);
          head = next;
        }
      }
    }
    t_[0].reset(kMinBuckets);
    t_[1].reset(0);
    cursor_ = 0;
    n_ = 0;
  }

 private:
  static constexpr size_t kMinBuckets = 64;
  static constexpr size_t kStepBuckets = 16;  // old buckets moved per operation while growing

  // A bucket array from calloc: a large one is fresh zero pages, faulted in as they are
  // first touched, so making the new table of a growth costs no time up front either.
  class Buckets {
   public:
    ~Buckets() { std::free(p_); }
    void reset(size_t n) {
      std::free(p_);
      p_ = nullptr;
      n_ = n;
      if (n && !(p_ = static_cast<Record**>(std::calloc(n, sizeof(Record*))))) throw std::bad_alloc();
    }
    void swap(Buckets& o) {
      std::swap(p_, o.p_);
      std::swap(n_, o.n_);
    }
    size_t size() const { return n_; }
    bool empty() const { return n_ == 0; }
    Record*& operator[](size_t i) { return p_[i]; }

   private:
    Record** p_ = nullptr;
    size_t n_ = 0;
  };

  // std::hash<std::string> of the same bytes (the standard says so), its low 32 bits
 public:
  static uint32_t hash(std::string_view key) { return uint32_t(std::hash<std::string_view>{}(key)); }

 private:

  // A record with room for its key after it (key_data is the struct's last member).
  static Record* make(const std::string& key) {
    if (key.size() > UINT32_MAX) throw std::length_error("RecordMap: a key of over 4 GiB");
    const size_t extra = key.size() > sizeof(Record::key_data) ? key.size() - sizeof(Record::key_data) : 0;
    void* mem = ::operator new(sizeof(Record) + extra);
    Record* r = new (mem) Record();
    r->key_len = static_cast<uint32_t>(key.size());
    std::memcpy(r->key_data, key.data(), key.size());
    return r;
  }
  static void destroy(Record* r) {
    r->~Record();
    ::operator delete(static_cast<void*>(r));
  }
  bool moving() const { return !t_[1].empty(); }

  void grow() {
    t_[1].reset(t_[0].size() * 2);
    cursor_ = 0;
  }

  // Moves up to kStepBuckets old buckets (and skips up to 10x as many empty ones).
  void step() {
    if (!moving()) return;
    size_t moved = 0, empty = 0;
    auto& from = t_[0];
    auto& to = t_[1];
    while (cursor_ < from.size() && moved < kStepBuckets && empty < 10 * kStepBuckets) {
      Record* r = from[cursor_];
      if (r == nullptr) {
        ++empty;
      } else {
        while (r != nullptr) {
          Record* next = r->chain;
          Record*& head = to[r->hash & (to.size() - 1)];
          r->chain = head;
          head = r;
          r = next;
        }
        from[cursor_] = nullptr;
        ++moved;
      }
      ++cursor_;
    }
    if (cursor_ == from.size()) {
      from.swap(to);
      to.reset(0);
      cursor_ = 0;
    }
  }

  Buckets t_[2];  // t_[1] is not empty while growing (t_[0] the old table)
  size_t cursor_ = 0;          // old buckets below it have moved
  size_t n_ = 0;
};

}  // namespace mcr
