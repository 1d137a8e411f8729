// Internals of the spill tier shared by engine.cpp (index, directory, public methods) and
// batch.cpp (the I/O executor). Not part of the library's interface.
#pragma once
#include <atomic>
#include <map>
#include <unordered_set>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "mcr/spill.h"
#include "mcr/spill_format.h"
#include "mcr/spill_io.h"

namespace mcr::spill {

uint64_t mono_ns();
uint64_t wall_ns();

// Page-aligned anonymous memory (O_DIRECT needs aligned buffers).
class AlignedBuf {
 public:
  AlignedBuf() = default;
  explicit AlignedBuf(size_t n);
  ~AlignedBuf();
  AlignedBuf(AlignedBuf&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr, o.n_ = 0; }
  AlignedBuf& operator=(AlignedBuf&& o) noexcept;
  uint8_t* data() const { return p_; }

 private:
  uint8_t* p_ = nullptr;
  size_t n_ = 0;
};

// What the index knows of one object on disk: a slot of its own, or (pack_off != 0) a
// record at that offset of a pack's slot.
struct Entry {
  uint64_t slot = 0, seq = 0, gen = 0, length = 0, write_time_ns = 0;
  uint32_t header_blocks = 1;
  uint64_t pack_off = 0;   // packed: the record's offset in the pack's file
  uint32_t rec_bytes = 0;  // packed: the record's size
  bool packed() const { return pack_off != 0; }
  uint64_t header_bytes() const { return header_blocks * kBlock; }
  uint64_t bytes() const { return header_bytes() + round_up(length); }  // a slot's file
};

// A live pack: its slot's seq and file size, how many of its records are the current
// version of their key, and the seqs of those that are not (kept in TOMBSTONES while the
// pack's records are on disk).
struct Pack {
  uint64_t seq = 0, bytes = 0, live = 0;
  std::vector<uint64_t> dead;
};

// One object of a pack being written.
struct PackMember {
  size_t req = 0;  // the request it answers
  const std::string* key = nullptr;
  uint64_t gen = 0, length = 0, seq = 0, off = 0, bytes = 0;  // off: in the pack's data
};

enum class OpKind : uint8_t {
  kWrite,   // create a file: data chunks, then (or with the first chunk) the header
  kRead,    // header + data into the caller's memory, CRC checked
  kVerify,  // like kRead into staging only (scan with verify_data)
  kHeader,  // read and check a header (scan)
};

struct Op;

// One I/O of an operation. An op of n data chunks has n units (reads: unit 0 also carries
// the header; writes of more than one chunk: a last unit writes the header).
struct Unit : IoReq {
  Op* op = nullptr;
  uint32_t index = 0;
  uint8_t* staging = nullptr;  // bounce buffer (unaligned memory), owned by the context
  size_t want = 0;             // bytes the I/O moves when complete
  size_t got = 0;
  int res = 0;                 // -errno of a failed I/O
};

struct Op {
  OpKind kind = OpKind::kRead;
  // the request
  const std::string* key = nullptr;
  uint8_t* mem = nullptr;  // write source / read destination; nullptr for kVerify
  uint64_t length = 0;
  uint64_t gen = 0;
  Entry entry;             // the file: from the index (reads) or new (writes)
  // progress
  int fd = -1;
  int slot = -1;           // header/tail buffers of the context while active
  uint8_t* hdr = nullptr;  // kMaxHeaderBytes, aligned
  uint8_t* tail = nullptr; // one block: a partial last block bounced through it
  bool direct = false;     // mem is 4 KiB aligned: the I/O goes straight to/from it
  std::vector<Unit> units;
  uint32_t next_prep = 0, next_push = 0, remaining = 0;
  uint32_t crc = 0;                 // writes: running raw register of the data
  std::vector<uint32_t> chunk_crc;  // reads: raw register of each chunk, from 0
  uint64_t file_size = 0;           // header ops: from fstat
  Header header;                    // header ops: decoded header
  uint64_t t0 = 0;
  int retries = 0;                  // reads that raced an overwrite and looked again
  bool reserved = false;            // writes: capacity reserved for entry.bytes()
  bool created = false;             // writes: the slot file exists and must go on failure
  bool recycled = false;            // writes: overwriting a free-pool slot
  uint64_t stale_seq = 0;           // writes: the seq of the stale header in that slot
  uint32_t flags = 0;               // writes: header flags (kFlagPack)
  const std::vector<PackMember>* members = nullptr;  // writes of a pack: its objects
  bool failed = false, finishing = false, finished = false;
  Result result;
};

// The I/O resources one call uses: a queue and aligned buffers. Pooled per tier.
struct Context {
  std::unique_ptr<IoQueue> q;
  unsigned slots = 0;         // ops active at once
  AlignedBuf slot_mem;        // per slot: header (8 KiB) + tail (4 KiB)
  std::vector<int> free_slots;
  size_t chunk = 0;
  std::vector<AlignedBuf> staging;
  std::vector<uint8_t*> free_staging;
  size_t max_staging = 0;

  uint8_t* get_staging();
  void put_staging(uint8_t* p) { free_staging.push_back(p); }
};

// A free slot: its file size and the seq of the stale header it still holds (0: none).
struct PoolFile {
  uint64_t slot = 0, stale_seq = 0;
};

// What reserve_space granted a write: a free slot to overwrite (from_pool, of pool_size
// bytes) or the room to create one; and pool files to delete first.
struct Space {
  bool ok = false, from_pool = false;
  PoolFile file;
  uint64_t pool_size = 0;
  std::vector<PoolFile> trim;
};

struct Counters {
  std::atomic<uint64_t> writes{0}, write_bytes{0}, write_errors{0}, write_latency_ns{0};
  std::atomic<uint64_t> reads{0}, read_bytes{0}, read_errors{0}, read_latency_ns{0};
  std::atomic<uint64_t> not_found{0}, checksum_failures{0}, removes{0}, capacity_rejections{0};
  std::atomic<uint64_t> files_deleted_invalid{0}, recycled_writes{0}, created_writes{0};
};

struct Tier::Impl {
  Options opt;
  int lock_fd = -1;
  int sub_fd[kSubdirs];
  int tomb_fd = -1;
  uint64_t root_dev = 0, root_ino = 0;  // to notice the directory replaced under us
  bool uring = true;                    // false: io_uring unavailable or not wanted
  mutable std::shared_mutex life_mu;  // shared: every operation; exclusive: scan/recover/close
  mutable std::mutex mu;              // the fields below; never held across data I/O
  std::unordered_map<std::string, Entry> index;
  uint64_t used = 0;                  // committed files + reservations of writes in flight
  // Free pool: slots of removed objects, kept with their blocks for later writes to
  // overwrite (size -> slot). Disk use is used + pool_bytes <= capacity, always.
  std::multimap<uint64_t, PoolFile> pool;
  uint64_t pool_bytes = 0;
  std::unordered_multiset<uint64_t> rewriting;  // stale seqs of slots being overwritten
  std::unordered_map<uint64_t, Pack> packs;     // live packs by slot
  const std::string pack_key_ = "\x01pack";     // the key in a pack's slot header
  uint64_t pack_dead = 0;                       // dead records in live packs
  uint64_t tomb_records = 0;
  std::string degraded_reason;
  bool closed = false;
  std::atomic<uint64_t> next_seq{1}, next_slot{1};
  std::mutex ctx_mu;
  std::vector<std::unique_ptr<Context>> idle;
  Counters ctr;
  std::atomic<int> inject_err[2] = {0, 0};          // [read, write]
  std::atomic<unsigned> inject_count[2] = {0, 0};

  int take_injected(bool write) {  // an armed error for this completion, else 0
    unsigned n = inject_count[write].load();
    while (n && !inject_count[write].compare_exchange_weak(n, n - 1)) {
    }
    return n ? inject_err[write].load() : 0;
  }

  explicit Impl(const Options& o);
  ~Impl();

  // engine.cpp
  std::unique_ptr<Context> take_context();
  void give_context(std::unique_ptr<Context> c);
  void execute(std::vector<Op>& ops);  // runs a batch on a pooled context
  void execute_in_slices(std::vector<Op>& ops, size_t slice);
  void open_dirs(bool create);
  void close_dirs();
  int dir_of(uint64_t slot) const { return sub_fd[subdir_of(slot)]; }
  std::string path_of(uint64_t slot) const;
  Space reserve_space(uint64_t bytes);
  void end_write(const Op& op);  // a write's slot is no longer being rewritten
  void release(uint64_t bytes);
  void degrade(const std::string& reason);
  bool is_degraded() const;
  std::string degraded_text() const;
  uint64_t used_now() const;
  void commit_write(Op& op);
  void commit_pack(Op& op);  // a pack's objects go into the index
  // Under mu, after moving e.bytes() from used to pool_bytes: tombstone and pool the slot.
  void retire_locked(const Entry& e, std::vector<uint64_t>* unlink);
  void retire_slot_locked(uint64_t slot, uint64_t seq, uint64_t bytes, std::vector<uint64_t>* unlink);
  // Under mu, an entry out of the index: its slot goes to the pool, or its record dies in
  // its pack (and the pack's slot goes to the pool with its last live record).
  void retire_entry_locked(const Entry& e, std::vector<uint64_t>* unlink);
  // Reads a packed object (pread of the blocks holding its record), checked.
  Result read_packed(const std::string& key, void* dst, uint64_t length);
  // Reads packed objects reqs[which[...]] together through an I/O queue.
  void read_packed_many(const std::vector<ReadRequest>& reqs, const std::vector<size_t>& which,
                        std::vector<Result>* out);
  // Checks the record of `e` in `blocks` (got bytes read from its first block) and copies
  // its data to dst: true, with *res filled; false with the reason in res->message.
  bool finish_packed(const std::string& key, const Entry& e, const uint8_t* blocks, ssize_t got, void* dst,
                     Result* res);
  void unlink_slots(const std::vector<uint64_t>& slots);
  // A read found the object invalid: if the index still holds that version, drop it and
  // delete its file (true); false if it was removed or replaced meanwhile.
  bool drop_invalid(const std::string& key, const Entry& e, bool unlink_file);
  bool lookup(const std::string& key, Entry* e) const;
  bool root_exists() const;
  bool dirs_intact() const;  // root and every subdir are still the ones we opened

  // scan.cpp
  std::vector<ObjectInfo> scan_locked(bool verify);
  void tomb_open();
  bool tomb_append_locked(uint64_t seq);
  void tomb_rewrite(const std::vector<uint64_t>& seqs);
  void maybe_compact_locked();
};

// batch.cpp: performs every op of the batch, filling op.result.
void run_batch(Tier::Impl& t, Context& c, std::vector<Op>& ops);

}  // namespace mcr::spill
