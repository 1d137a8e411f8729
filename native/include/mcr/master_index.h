// The master's read fast path: GET, EXISTS and RELEASE answered in C++ on the RPC
// progress thread, without waking Python.
//
// The Python state machine (mooncake_ray/_private/master/state.py) stays the only
// authority. This index is its mirror: one entry per complete object, holding exactly
// what a GET answers (size, generation, the ready DRAM replicas), written by the state
// machine each time that answer changes. An entry with no replicas means "present, but
// ask Python" (only on disk, being promoted).
//
// What a native GET grants (a read lease, a recency touch, a hit) is appended to a log
// instead of being applied; Python drains the log at the start of every section in which
// it reads or changes its state, and applies it as if it had served those calls itself.
//
// Locking: the Python side holds lock() for its whole section (after its own lock, so
// the order is python-lock -> index mutex). A native GET takes the same mutex, so it is
// serialised either wholly before a Python section (and drained at its start) or wholly
// after it (and sees its changes): a lease is never granted on extents Python is freeing.
// The mutex is recursive so the mirror's setters can be called inside a section.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace mcr {

// A store node incarnation, shared by every replica on it (MasterIndex::node interns them:
// three strings per replica were most of the mirror's memory per key).
struct IndexNode {
  std::string node_id;
  std::string ray_node_id;
  std::string incarnation;
};

struct IndexReplica {
  std::shared_ptr<const IndexNode> node;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t placed = 0;  // Replica.placed: 0 = where the value's put wrote it
};

struct IndexEntry {
  uint64_t size = 0;
  uint64_t gen = 0;
  std::vector<IndexReplica> reps;  // empty: present, but Python answers for it
};

// A client's put slab as the state machine holds it (slabs.py): its uncommitted pieces.
struct IndexSlab {
  std::string owner;
  IndexReplica node;  // node_id, ray_node_id, incarnation (offset/length unused)
  std::map<uint64_t, uint64_t> free;  // offset -> length
};

// What a native call did, for Python to apply: kGrant / kRelease (lease = the lease id),
// kCommit (lease = the slab id; offset, size of the committed value).
struct IndexLogEntry {
  int kind = 0;
  std::string key;
  uint64_t gen = 0;
  uint64_t lease = 0;
  double now = 0;  // CLOCK_MONOTONIC seconds (Python's time.monotonic)
  uint64_t offset = 0;
  uint64_t size = 0;
};

class MasterIndex {
 public:
  static constexpr int kGrant = 0;
  static constexpr int kRelease = 1;
  static constexpr int kCommit = 2;
  // The master's RPC operation ids (mooncake_ray/_private/rpc.py) this index answers.
  static constexpr uint64_t kOpGet = 4, kOpExists = 5, kOpRelease = 15, kOpPutCommit = 17;
  static constexpr uint64_t kAlign = 4096;   // paged extents (allocator.py ALIGN)
  static constexpr uint64_t kGranule = 64;  // packed extents (allocator.py GRANULE)
  // Native lease ids start here, far above the ids Python's counter hands out.
  static constexpr uint64_t kFirstLease = 1ull << 40;

  void set(const std::string& key, uint64_t size, uint64_t gen, std::vector<IndexReplica> reps);
  void drop(const std::string& key);
  void drop_many(const std::vector<std::string>& keys);
  // The shared record of a node incarnation (made on first use).
  std::shared_ptr<const IndexNode> node(const std::string& node_id, const std::string& ray_node_id,
                                        const std::string& incarnation);
  void clear();
  void lock() { mu_.lock(); }
  void unlock() { mu_.unlock(); }
  // Off while the master is rebuilding its index (every call goes to Python).
  void set_enabled(bool on);
  void set_lease_ttl(double ttl_s);
  void set_max_log(size_t n);
  // Takes the log and the number of misses answered since the last drain.
  std::vector<IndexLogEntry> drain(uint64_t* misses);

  // One-call puts (PUT_COMMIT into a put slab): the mirror of the slabs, of the keys with
  // a two-call put in flight, and of the generation counter. A clean commit (new key,
  // extent an uncommitted part of the caller's slab) is answered here: the value is
  // visible to native GETs at once and logged for Python; anything else goes to Python.
  void set_commits(bool on);
  void set_max_key_bytes(size_t n);
  void set_slab(uint64_t id, IndexSlab slab);
  void drop_slab(uint64_t id);
  bool lookup_slab(uint64_t id, IndexSlab* out);
  size_t slab_count();
  void add_pending(const std::string& key);
  void drop_pending(const std::string& key);
  size_t pending_count();
  bool is_pending(const std::string& key);
  void set_next_gen(uint64_t g);  // the state machine's counter, at the end of its sections (max)
  // Waits until a commit is logged (true) or the timeout passes (false).
  bool wait_commits(double timeout_s);
  size_t size();
  uint64_t served();  // calls answered natively so far
  bool lookup(const std::string& key, IndexEntry* out);

  // Answers a master RPC request (msgpack ``[op, *args]``) when it can: true with the
  // msgpack reply in *out. False when Python must answer: another operation, an entry
  // Python answers for, a request it cannot parse, the index disabled or its log full.
  bool serve(const char* data, size_t len, std::string* out);

 private:
  bool serve_commit(const char* data, size_t len, std::string* out);

  std::recursive_mutex mu_;
  std::unordered_map<std::string, IndexEntry> map_;
  std::map<std::pair<std::string, std::string>, std::shared_ptr<const IndexNode>> nodes_;  // (id, incarnation)
  std::vector<IndexLogEntry> log_;
  uint64_t misses_ = 0;
  uint64_t served_ = 0;
  uint64_t next_lease_ = kFirstLease;
  double ttl_s_ = 10.0;
  bool enabled_ = false;
  size_t max_log_ = 1u << 17;
  bool commits_ = false;
  bool commit_logged_ = false;
  std::condition_variable_any commit_cv_;
  size_t max_key_bytes_ = 4096;
  uint64_t next_gen_ = 0;
  std::unordered_map<uint64_t, IndexSlab> slabs_;
  std::unordered_set<std::string> pending_;
};

}  // namespace mcr
