// The master's object table and its native fast path: GET, EXISTS, RELEASE and clean
// one-call PUT_COMMITs answered in C++ on the RPC progress thread, without waking Python.
//
// One record per complete object, in one recency list (least recently used first). A
// record is either
//
//  - cold: this index is its only copy, the common case (a value with one replica, ready
//    in DRAM or on disk, not pinned, at most two read leases held). Native GETs grant
//    its leases and native RELEASEs end them here, with no Python involved; or
//  - hot: the Python state machine (mooncake_ray/_private/master/state.py) holds the
//    object and is its authority; the record holds what a GET answers (size, generation,
//    the ready DRAM replicas: none means "present, but ask Python"), and what a native
//    call grants or releases on it is logged for Python to apply.
//
// Python hydrates a cold record when it needs the object (it becomes hot) and writes
// plain objects back cold at the end of its section (set_cold). So the per-key memory of
// the master is this record, not a Python object graph.
//
// Locking: the Python side holds lock() for its whole section (after its own lock, so
// the order is python-lock -> index mutex). A native call takes the same mutex, so it is
// serialised either wholly before a Python section (whose log is drained at its start) or
// wholly after it (and sees its changes): a lease is never granted on extents Python is
// freeing. The mutex is recursive so the table's setters can be called inside a section.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "mcr/record_map.h"

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

// What a GET of a record answers (lookup()).
struct IndexEntry {
  uint64_t size = 0;
  uint64_t gen = 0;
  std::vector<IndexReplica> reps;  // empty: present, but Python answers for it
};

// A cold record as Python reads and writes it (hydrate / set_cold).
struct ColdRecord {
  uint64_t size = 0;
  uint64_t gen = 0;
  IndexReplica rep;        // the one replica
  bool disk = false;       // on disk (a GET of it is Python's: it promotes)
  double lease_until = 0;  // CLOCK_MONOTONIC seconds
  std::vector<uint64_t> leases;  // ids held, at most two
};

// A record of the table (see the top of this file).
struct IndexRecord {
  IndexRecord()
      : hot(false), disk(false), has_rep(false), has_more(false), probation(false), grace(false),
        pass_held(false), unread(false) {}

  uint64_t size = 0;
  uint64_t gen = 0;
  IndexReplica rep;  // cold: its replica; hot: the GET answer's first replica (if any)
  double lease_until = 0;   // cold only
  uint64_t leases[2] = {0, 0};  // cold only: lease ids held (0: a free slot)
  IndexRecord* older = nullptr;  // the recency list
  IndexRecord* newer = nullptr;
  uint32_t hash = 0;             // RecordMap's fields: the key's hash (32 bits), the bucket
  uint32_t link = 0;             // (its KV chain links: MasterIndex::links_[link]; 0 none)
  IndexRecord* chain = nullptr;  // chain, the key's length and its bytes (key_data)
  uint32_t key_len = 0;
  bool hot : 1;
  bool disk : 1;       // cold: the replica is on disk
  bool has_rep : 1;    // hot: the GET answer is not empty
  bool has_more : 1;   // hot: the GET answer has other replicas (MasterIndex::more_)
  bool probation : 1;  // put on probation (insert_old), not used since: see probation()
  bool grace : 1;      // on probation, among the newest (grace_bytes): they go last of them
  bool pass_held : 1;  // met by the current eviction pass while held (MasterIndex::pass_held_)
  bool unread : 1;     // a chained value placed at the recent end by its put, not read since
  // The key's first bytes; the rest follow in the same allocation (RecordMap::make), so a
  // record and its key are one block: 144 bytes with an 18-byte key, where a std::string
  // member and a pointer to it took 208 in two.
  char key_data[2];

  std::string_view key() const { return {key_data, key_len}; }
};
static_assert(sizeof(void*) != 8 || sizeof(IndexRecord) == 120, "IndexRecord's layout: its key starts at byte 118");

// A record's KV chain links (MasterIndex::link): kept beside the records, for the chained
// ones only, in a pool the record indexes (IndexRecord::link). ``parent`` is the stored
// record it names; ``kid`` / ``sib`` list the stored records naming it (first child, next
// sibling); ``holds``: bits Python sets (kHoldWait: a put naming it is in flight;
// kHoldRemote: another master shard holds a child of it).
struct ChainLink {
  IndexRecord* parent = nullptr;
  IndexRecord* kid = nullptr;
  IndexRecord* sib = nullptr;
  uint32_t kids = 0;
  uint32_t holds = 0;
  // While the record is pass_held: its place in MasterIndex::pass_held_ (the order the
  // pass met it). The links stay while it is set (trim_link).
  uint32_t pass_seq = 0;
};

// A reference to a key, sampled for the eviction policy's miniature caches
// (mooncake_ray/_private/master/adaptive.py): a read (GET) or a put.
struct RefSample {
  uint64_t hash = 0;  // of the key: its 32-bit table hash in the top bits (they decide the sample)
  uint64_t size = 0;  // a put's value size
  int kind = 0;
  bool chained = false;  // a put naming a parent
};

// One entry of scan(): a hot record (Python decides), or a cold one that may be evicted.
struct ScanItem {
  std::string key;
  bool hot = false;
  uint64_t gen = 0, size = 0, offset = 0, length = 0;
};

// A client's put slab as the state machine holds it (slabs.py): its uncommitted pieces.
struct IndexSlab {
  std::string owner;
  IndexReplica node;  // node_id, ray_node_id, incarnation (offset/length unused)
  std::map<uint64_t, uint64_t> free;  // offset -> length
};

// A store node's commit ring (store/ring.py): a file in shared memory the node maps, and
// the master maps too when the node is on its host. A clean native commit into a slab on
// that node writes each value's record there and is answered at once: the node reads the
// ring before it applies any message of the master, when it mounts and when it restarts,
// so a master killed after the reply, or a node restarted with its kept arena, still
// finds the value. The node holds an exclusive flock on the file while it lives; a commit
// whose node holds none is held for the node's answer as before (the node is gone). A
// process being killed still holds its lock until it has exited (milliseconds): where the
// master sees the node's process (the same PID namespace), a SIGKILL pending or an exit
// under way counts as gone too.
//
// Layout: 64-byte header (magic, epoch = a number the node draws at each mount, head =
// bytes the master has written, tail = bytes the node has read; the last two only grow),
// then the data area.
// A record: u32 length (with padding, a multiple of 8), u32 kind (low byte: 1 commit, 2
// padding to the end of the area, 3 a range reserved for a client's write; bits 8-15: the
// copies a commit's put asked for, 0 for one; bit 16: the record carries the value's
// CRC-32C; bit 17: the master sends the node no message adding the value, the record is
// all it gets), u64 gen, size, offset, length, u32 key bytes, u32 parent bytes, the key, the
// parent, u32 the CRC-32C of the value's bytes (taken by the writing client in its copy;
// read only with bit 16).

struct CommitRing {
  uint8_t* base = nullptr;
  uint64_t bytes = 0;  // the whole mapping
  int fd = -1;
  int proc_fd = -1;  // the node process's /proc/<pid>/task/<pid>/stat, when in this PID namespace (else -1)
  uint64_t epoch = 0;
  std::string incarnation;
};

// What a native call did, for Python to apply: kGrant / kRelease (lease = the lease id),
// kCommit (lease = the slab id; offset, size of the committed value; parent), kReturn (a
// slab the committing client gave back after its commits: lease = the slab id), kHeld (the reply to
// the commits logged just before it, kept until they are durable: key = the reply, lease
// = the caller's peer uid, gen = its call id, offset = the lane; see HeldReply).
struct IndexLogEntry {
  int kind = 0;
  std::string key;
  uint64_t gen = 0;
  uint64_t lease = 0;
  double now = 0;  // CLOCK_MONOTONIC seconds (Python's time.monotonic)
  uint64_t offset = 0;
  uint64_t size = 0;
  std::string parent;  // kCommit: the key the value names as its parent (KV chains), "" none
};

// Where a reply kept for later goes (the transport's request token).
struct HeldReply {
  uint64_t peer_uid = 0;
  uint64_t call_id = 0;
  uint32_t lane = 0;
};

class MasterIndex {
 public:
  static constexpr int kGrant = 0;
  static constexpr int kRelease = 1;
  static constexpr int kCommit = 2;
  static constexpr int kHeld = 3;
  static constexpr int kCommitRinged = 4;  // kCommit answered through its node's ring: no message to the node
  static constexpr int kReturn = 5;        // a put slab given back with a commit (lease = its id)
  static constexpr uint32_t kMaxReturns = 64;  // slabs one commit may give back natively
  // The master's RPC operation ids (mooncake_ray/_private/rpc.py) this index answers.
  static constexpr uint64_t kOpGet = 4, kOpExists = 5, kOpRelease = 15, kOpPutCommit = 17;
  static constexpr uint64_t kAlign = 4096;   // paged extents (allocator.py ALIGN)
  static constexpr uint64_t kGranule = 64;  // packed extents (allocator.py GRANULE)
  // Native lease ids start here, far above the ids Python's counter hands out.
  static constexpr uint64_t kFirstLease = 1ull << 40;

  // A hot record answering a GET with ``reps`` (a new key goes to the recent end).
  void set(const std::string& key, uint64_t size, uint64_t gen, std::vector<IndexReplica> reps);
  // A cold record (a new key goes to the recent end; an existing one keeps its place).
  void set_cold(const std::string& key, const ColdRecord& rec);
  // A cold record's contents, and it is hot from now on; false if absent or hot already.
  bool hydrate(const std::string& key, ColdRecord* out);
  // A cold record's contents, left cold (checks, inventories); false if absent or hot.
  bool peek_cold(const std::string& key, ColdRecord* out);
  bool contains(const std::string& key);
  bool is_hot(const std::string& key);
  // To the recent end: a use, or (``unread``) a chained value's put under "recent", which
  // set_insert_old(true) puts on probation if nothing has read it by then.
  void touch(const std::string& key, bool unread = false);
  // On probation: ahead of every record not on it, from where a use (touch, a native
  // GET) takes it off. Among the records on probation the newest ``grace_bytes`` go last,
  // first in first out (a value a reader waits for is not the first to go); the others
  // go before them, the last one to leave the grace window first. So a working set larger
  // than DRAM keeps what was read and lets unread new values pass through.
  void probation(const std::string& key);
  void set_grace_bytes(uint64_t n);
  // Native commits of values with a parent go on probation (master.chain_insert "old").
  // Turned on, it also puts on probation the chained values placed at the recent end
  // under "recent" and not read since (``unread``), at the old end, to go oldest first:
  // left where they were, they hold the room that probation needs, and the records that
  // were read go instead, least recent first (LRU's worst case, which "old" was chosen to
  // avoid). Turned off, what is on probation goes to the recent end, in the order it would
  // have gone in, unread.
  void set_insert_old(bool on);
  // Sampling of references for the insertion policy's miniature caches: a key is sampled
  // when the top ``shift`` bits of its hash are 0 (a rate of 2^-shift; 0: every key, 64:
  // none).
  // Native GETs and commits are sampled here (a lookup is not a use); Python's own calls
  // use sample().
  static constexpr int kRefGet = 2, kRefPut = 3;
  void set_sample_shift(int shift);
  void sample(int kind, const std::string& key, uint64_t size, bool chained);
  // Takes the samples since the last call; *dropped: how many did not fit (kMaxSamples).
  std::vector<RefSample> take_samples(uint64_t* dropped);
  static constexpr size_t kMaxSamples = 1u << 16;
  void drop(const std::string& key);
  void drop_many(const std::vector<std::string>& keys);
  // Records from the least recent (after ``after``, if not empty) in recency order: every
  // hot one, and the cold ones on ``node_id`` in that tier whose leases ended by ``now``;
  // at most ``limit`` items. *next is where to go on from ("" when the list is done).
  std::vector<ScanItem> scan(const std::string& after, const std::string& node_id, bool disk, double now,
                             size_t limit, std::string* next);
  // Eviction's fast path: from the least recent record (after ``after``, if not empty),
  // drops the cold ones in DRAM on ``node_id`` whose leases ended by ``now`` until their
  // extents total ``need`` bytes, skipping other cold ones; stops at a hot record, naming
  // it in *stop (Python judges it, then calls again after it). Returns what it dropped
  // (keys, gens) with their extents sorted and merged into runs; *freed, their bytes.
  struct Evicted {
    std::vector<std::string> keys;
    std::vector<uint64_t> gens;
    std::vector<std::pair<uint64_t, uint64_t>> runs;  // (offset, length), merged
    uint64_t freed = 0;
    std::string stop;  // a hot record met ("" if the need was met or the list ended)
    std::vector<ScanItem> held;  // with chains, the list ended short: the held records met
  };
  //
  // With ``chains`` (chain-aware eviction, mooncake_ray/_private/master/chains.py), a cold
  // record that is held (a stored child names it, or Python set a hold) is passed over and
  // remembered for the pass (which starts at a call with an empty ``after``); dropping its
  // last child drops it next, while the need lasts, and so on up the chain: a chain goes
  // from its end toward its start. If the list ends short of the need, *held lists the
  // held records left (least recent first) for Python's forced eviction.
  //
  // With master shards (``remote_holds``), a page on probation is held by a child on another
  // shard as by one here, but a pass that leaves the probation records for the read ones
  // (or the list) short of its need first takes those it passed over that nothing but
  // remote children holds, least recent first (the top of the stack: the newest pages),
  // with the parents they leave childless: a page never read goes before a read one, as
  // on one shard, where its chain's leaf would have been here to take. Their children
  // elsewhere go as orphans (chains.py).
  Evicted evict_cold(const std::string& after, const std::string& node_id, double now, uint64_t need,
                     bool chains = false);
  // KV chain links (see ChainLink). Off: none are kept (and none made by native commits).
  void set_chain_links(bool on);
  // ``key`` names ``parent`` ("" none): linked to the parent's record when both are stored
  // (idempotent; a native commit links its values itself).
  void link(const std::string& key, const std::string& parent);
  void set_holds(const std::string& key, uint32_t holds);  // kHold* bits (a stored key's)
  void set_remote_holds(bool on);  // whether kHoldRemote holds (chains.py: remote_holds)
  // (parent key, stored children, hold bits) of ``key`` as linked here.
  std::tuple<std::string, uint32_t, uint32_t> chain_of(const std::string& key);
  size_t link_count();
  static constexpr uint32_t kHoldWait = 1, kHoldRemote = 2;
  // Cold records on a node (any incarnation): (key, on disk).
  std::vector<std::pair<std::string, bool>> cold_on_node(const std::string& node_id,
                                                         const std::string& except_incarnation = "");
  // The same, with each record's generation: (key, disk, gen).
  std::vector<std::tuple<std::string, bool, uint64_t>> cold_gens_on_node(const std::string& node_id,
                                                                         const std::string& except_incarnation = "");
  // A restarted process `to` of a node brought back these DRAM values unchanged (a kept
  // arena; `cols`: 4 int64s per key, gen, size, offset, length): each cold DRAM record on
  // an earlier incarnation of that node with the same four is moved to `to` in place,
  // keeping its recency, leases and placement id. Returns, per key, whether it moved.
  std::vector<uint8_t> retarget_cold(const std::vector<std::string_view>& keys, const int64_t* cols,
                                     const std::shared_ptr<const IndexNode>& to);
  // Every key starting with ``prefix``, least recent first.
  std::vector<std::string> keys(const std::string& prefix);
  // The hot records' keys, most recently used first (the order repairs copy a lost node's
  // values in: master/repairs.py).
  std::vector<std::string> hot_keys_recent_first();
  size_t cold_count();
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
  // Takes the log, the number of misses answered and of the leases granted on cold
  // records (hits Python did not see) since the last drain.
  std::vector<IndexLogEntry> drain(uint64_t* misses, uint64_t* hits);

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
  // Waits until the log holds a reply kept for its commits' durability (true: Python must
  // apply the log to send it) or the timeout passes (false).
  bool wait_held(double timeout_s);
  size_t size();
  uint64_t served();  // calls answered natively so far
  uint64_t lookups();  // keys EXISTS calls answered natively so far (a lookup takes no lease)
  bool lookup(const std::string& key, IndexEntry* out);

  // Answers a master RPC request (msgpack ``[op, *args]``) when it can: true with the
  // msgpack reply in *out. False when Python must answer: another operation, an entry
  // Python answers for, a request it cannot parse, the index disabled or its log full.
  // ``hold`` (commits only): a commit's reply is not given back in *out but logged
  // (kHeld, after its commits) for Python to send once the store node has recorded the
  // values; *held says so.
  bool serve(const char* data, size_t len, std::string* out, const HeldReply* hold = nullptr,
             bool* held = nullptr);

  // Commit rings (see CommitRing): the node's incarnation, its ring's mapping in this
  // process, an fd of the file (the liveness probe) and the epoch it must show.
  void set_ring(const std::string& node_id, CommitRing ring);
  void drop_ring(const std::string& node_id);
  uint64_t ring_acks();  // commits answered through a ring so far
  // Python's commits (two-call puts, replicas): writes each record into its node's ring;
  // true when every one was written and every node is alive (the reply may go now).
  // All or nothing: false writes none when a ring is unusable or lacks room.
  struct RingRecord {
    std::string node_id, incarnation;
    uint32_t kind = kRingCommit;
    std::string key;
    uint64_t gen = 0, size = 0, offset = 0, length = 0;
    std::string parent;
    uint32_t crc = 0;  // with has_crc: the value's CRC-32C, taken by its writer
    bool has_crc = false;
  };
  bool ring_publish(const std::vector<RingRecord>& recs);
  static constexpr uint64_t kRingHeader = 64;
  static constexpr uint32_t kRingCommit = 1, kRingPad = 2, kRingReserved = 3;
  static constexpr uint32_t kRingHasCrc = 1u << 16;  // kind flag: the u32 after the parent is the value's CRC-32C
  static constexpr uint32_t kRingAlone = 1u << 17;   // kind flag: no message of the master will add this value
  static constexpr uint64_t kRingMagic = 0x31474e4952524d43ull;  // "MCRRING1"

 private:
  bool serve_commit(const char* data, size_t len, std::string* out, const HeldReply* hold, bool* held);
  bool serve_commit_locked(const char* data, size_t len, std::string* out, const HeldReply* hold, bool* held,
                           bool* wake);
  CommitRing* usable_ring(const std::string& node_id, const std::string& incarnation);
  CommitRing* usable_ring(const IndexNode& node) { return usable_ring(node.node_id, node.incarnation); }
  static bool ring_node_alive(const CommitRing& ring);
  // Each ring's head in *heads when all have room for ``need`` bytes (else false).
  static bool ring_room(const std::unordered_map<CommitRing*, uint64_t>& need,
                        std::unordered_map<CommitRing*, uint64_t>* heads);
  // Moves each ring's head to publish what was written; true if every node is alive.
  static bool ring_publish_heads(const std::unordered_map<CommitRing*, uint64_t>& heads);
  static uint64_t ring_record_bytes(const std::string& key, const std::string& parent);
  static void ring_write(CommitRing& ring, uint64_t* head, uint64_t gen, uint64_t size, uint64_t offset,
                         uint64_t length, const std::string& key, const std::string& parent,
                         uint32_t kind = kRingCommit, const uint32_t* crc = nullptr);

  IndexRecord* find(std::string_view key);
  IndexRecord& insert(const std::string& key, bool* fresh);  // a new record at the recent end, or the existing one
  void erase(IndexRecord* r);
  void unlink(IndexRecord* r);
  void link_recent(IndexRecord* r);
  void put_on_probation(IndexRecord* r);
  void link_after(IndexRecord* r, IndexRecord* after);  // nullptr: at the oldest end
  void resize(IndexRecord& r, uint64_t size);
  ChainLink& chain(IndexRecord* r);  // its links (made on first use; the pool's other links stay put)
  ChainLink* link_of(const IndexRecord* r);  // its links, or nullptr
  void set_parent(IndexRecord* r, IndexRecord* p);  // nullptr: none
  void detach(IndexRecord* r, ChainLink* l);  // r out of its parent's children (it has a parent)
  void unchain(IndexRecord* r, ChainLink* l);  // r goes: out of its parent's children, its children parentless
  void trim_link(IndexRecord* r, ChainLink* l);  // forgets r's links if they hold nothing
  void free_link(IndexRecord* r);
  bool held_by(const ChainLink* l) const;  // whether links l hold their record (nullptr: none)
  bool remote_only(const IndexRecord* r) const;  // held by children on other shards alone
  void end_pass();
  // ``r``: the key's record if there is one (its hash is taken once, with the table's).
  void note(int kind, const std::string& key, const IndexRecord* r, uint64_t size, bool chained);  // mutex held
  IndexEntry answer(const IndexRecord& r) const;
  bool grant_cold(IndexRecord& r, uint64_t lease, double now);  // false: no slot free
  void release_cold(IndexRecord& r, uint64_t lease, double now);

  std::recursive_mutex mu_;
  RecordMap<IndexRecord> map_;
  // A hot record's GET answer beyond its first replica (few records have one: a value put
  // with replicas > 1), kept here rather than a pointer in every record.
  std::unordered_map<const IndexRecord*, std::vector<IndexReplica>> more_;
  // KV chain links, for the chained records only (see ChainLink): IndexRecord::link
  // indexes it (0 is no link); a deque, so a link made never moves the others.
  std::deque<ChainLink> links_;
  std::vector<uint32_t> free_links_;  // indexes of links_ to use again
  bool links_on_ = false;
  bool remote_holds_ = true;
  // The current eviction pass's held records in the order met (ChainLink::pass_seq is each
  // one's index; a record erased meanwhile leaves nullptr).
  std::vector<IndexRecord*> pass_held_;
  bool pass_cut_ = false;  // the pass took its held probation records (evict_cold)
  IndexRecord* oldest_ = nullptr;
  IndexRecord* newest_ = nullptr;
  // Records on probation are the oldest ones: the stack (from oldest_ to stack_last_),
  // then the grace window (grace_first_ .. grace_last_, grace_bytes_ of values).
  IndexRecord* stack_last_ = nullptr;
  IndexRecord* grace_first_ = nullptr;
  IndexRecord* grace_last_ = nullptr;
  uint64_t grace_bytes_ = 0;
  uint64_t grace_max_ = 0;
  bool insert_old_ = false;
  int sample_shift_ = 64;  // off until the master sets its rate
  std::vector<RefSample> samples_;
  uint64_t samples_dropped_ = 0;
  size_t cold_ = 0;
  uint64_t hits_ = 0;
  std::map<std::pair<std::string, std::string>, std::shared_ptr<const IndexNode>> nodes_;  // (id, incarnation)
  std::vector<IndexLogEntry> log_;
  uint64_t misses_ = 0;
  uint64_t served_ = 0;
  uint64_t lookups_ = 0;
  uint64_t next_lease_ = kFirstLease;
  double ttl_s_ = 10.0;
  bool enabled_ = false;
  size_t max_log_ = 1u << 17;
  bool commits_ = false;
  bool commit_logged_ = false;
  size_t held_logged_ = 0;  // kHeld entries in the log
  std::condition_variable_any commit_cv_;
  size_t max_key_bytes_ = 4096;
  uint64_t next_gen_ = 0;
  std::unordered_map<uint64_t, IndexSlab> slabs_;
  std::unordered_set<std::string> pending_;
  std::unordered_map<std::string, CommitRing> rings_;
  uint64_t ring_acks_ = 0;
};

}  // namespace mcr
