// A store node's table of what it holds in its arena: (key, tier) -> where, which
// generation, the checksum of the bytes. One per master shard link, used under the store
// node's lock (no locking here).
//
// Compact because a node holds millions of small values: the records live one after
// another in a log (a 30-byte header and the key's bytes, 4-aligned), and an open-
// addressing table of 32-bit record numbers with a byte of each key's hash (linear
// probing, deletion by backward shift, no tombstones) finds them. A value of 256 bytes with
// an 18-byte key costs 48 bytes of log and 6-9 bytes of table. What few values have (a
// chain parent, a pin or a copy count above 255, an extent more than 64 KiB longer than
// the value) sits in a side table. A removed record is garbage in the log until the log is
// compacted (when a quarter of it is garbage), which keeps the order of the others:
// iteration is in the order keys were first added, as a Python dict's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace mcr {

struct NodeEntry {
  std::string key;
  uint8_t tier = 0;  // NodeTable::kDram or kReserved
  uint64_t gen = 0, size = 0, offset = 0, length = 0;
  uint64_t pin = 0;
  std::string parent;
  uint64_t want = 1;
  bool has_crc = false;
  uint32_t crc = 0;
};

class NodeTable {
 public:
  static constexpr uint8_t kDram = 0, kReserved = 1;
  static constexpr uint64_t kMax48 = (uint64_t{1} << 48) - 1;

  NodeTable();
  ~NodeTable();
  NodeTable(const NodeTable&) = delete;
  NodeTable& operator=(const NodeTable&) = delete;

  size_t size() const { return n_; }

  // Adds or replaces the entry of (key, tier), with the checksum e.crc if e.has_crc (DRAM
  // only). Without one, a replaced DRAM entry of the same gen and offset keeps its checksum;
  // otherwise one kept for (key, gen, offset) since its entry was removed comes back (see
  // erase). Throws std::invalid_argument for a size, offset or length
  // past 48 bits or a key over 16 MiB.
  void set(const NodeEntry& e);
  bool get(std::string_view key, uint8_t tier, NodeEntry* out) const;
  // Room for n entries without growing the slot table.
  void reserve(size_t n);
  // Removes the entry if its gen is <= max_gen; a DRAM entry's checksum is kept aside for
  // (key, gen, offset) until forget_sums (a message may drop a value and add it back).
  bool erase(std::string_view key, uint8_t tier, uint64_t max_gen, bool keep_sum = true);
  // The checksum of (key, gen, offset)'s DRAM bytes: its entry's, or one kept aside.
  bool crc_of(std::string_view key, uint64_t gen, uint64_t offset, uint32_t* crc) const;
  // Sets the checksum of the DRAM entry of key if it is of gen at offset; false if not.
  bool set_crc(std::string_view key, uint64_t gen, uint64_t offset, uint32_t crc);

  // Every entry in order (fn(const NodeEntry&)).
  template <typename Fn>
  void for_each(Fn&& fn) const {
    NodeEntry e;
    for (size_t at = 0; at < log_len_;) {
      const uint8_t* r = log_ + at;
      size_t n = rec_bytes(r);
      if (!(flags(r) & kDead)) {
        decode(static_cast<uint32_t>(at / 4), &e);
        fn(e);
      }
      at += n;
    }
  }

  // --- on disk (the kept arena's index, store/arena.py) ---------------------------------
  // A record: gen, size, offset, length, pin (u64 each), crc, copies wanted (u32 each), a
  // flags byte (bit 0: has a crc), the key's and the parent's lengths (u32 each), the key,
  // the parent; little-endian.
  static void encode(const NodeEntry& e, std::string* out);
  // One record at *p (advanced past it); false if it does not fit before end.
  static bool decode(const uint8_t** p, const uint8_t* end, NodeEntry* e);
  // A snapshot file: "MCRIDX3\n", n (u64), n records of the DRAM entries that have a
  // checksum, the CRC-32C of everything after the magic (u32). Sets *n.
  std::string snapshot(size_t* n) const;
  // Adds a snapshot file's entries; throws std::invalid_argument (what is wrong) if its
  // checksum or its records do not hold: before adding any, or (into an empty table, read
  // in one pass) with part of them added, for the caller to clear.
  size_t load_snapshot(const uint8_t* data, size_t len);
  // A journal batch: magic "MCJ1", the body's length and CRC-32C (u32 each), the body: ops,
  // each a kind byte, then an add's record (kind 1), or a drop's gen (u64), key length (u32)
  // and key (kind 2: the DRAM entry of gen <= gen goes).
  static constexpr uint32_t kJournalMagic = 0x314A434D;
  // Writes the head of a batch whose ops follow 12 reserved bytes at the start of *batch.
  static void seal_batch(std::string* batch);
  // Applies a journal file's batches in order; a batch whose checksum or records do not
  // hold is skipped (counted in *skipped), a torn last one ends it. Returns the ops applied.
  size_t replay(const uint8_t* data, size_t len, size_t* skipped);
  // Checks each DRAM entry against the arena (base, len): an extent outside it or a
  // checksum that does not match its bytes drops the entry (returned as key, gen); an entry
  // without a checksum takes its bytes' now. The checksums run on two threads: call
  // without the GIL.
  std::vector<std::pair<std::string, uint64_t>> verify(const uint8_t* base, size_t len);

  // --- the commit ring (store/ring.py; layout: CommitRing in mcr/master_index.h) ---------
  struct RingRead {
    size_t records = 0;  // commits and reserved ranges applied
    size_t given = 0;    // DRAM commits whose writer took the checksum in its copy
    size_t summed = 0;   // DRAM commits without one: checksummed here from the arena
    uint64_t tail = 0;   // the ring's read position after them (the caller commits it)
    std::vector<NodeEntry> told;  // DRAM commits a message of the master will add too
  };
  // Applies the records published in the ring mapped at ``ring`` (``bytes`` long) since its
  // tail, in order, and encodes into *batch (cleared) the journal batch of the DRAM ones
  // with their checksums (replay's form; empty if none); the ring's tail is not moved.
  // Throws std::invalid_argument for a record that does not parse, before applying any.
  RingRead apply_ring(const uint8_t* ring, size_t bytes, const uint8_t* arena, size_t arena_len,
                      std::string* batch);

  // Forgets the checksums kept aside by erase.
  void forget_sums() { sums_.clear(); }
  size_t kept_sums() const { return sums_.size(); }
  size_t log_compactions() const { return compactions_; }
  // Bytes this table has written (log, table, side tables; allocator overheads aside).
  size_t memory_bytes() const;
  void clear();

 private:
  static constexpr size_t kHdr = 30;  // 34 for a key of 255 bytes or more
  static constexpr uint8_t kReservedFlag = 1, kHasCrc = 2, kExtra = 4, kDead = 8;
  struct Extra {
    uint64_t pin = 0, want = 1, length = 0;
    std::string parent;
  };

  static size_t hdr_bytes(const uint8_t* r) { return r[29] == 0xFF ? kHdr + 4 : kHdr; }
  static size_t rec_bytes(const uint8_t* r) { return (hdr_bytes(r) + key_len(r) + 3) & ~size_t{3}; }
  static uint32_t key_len(const uint8_t* r);
  static uint8_t flags(const uint8_t* r) { return r[28]; }
  static std::string_view key_of(const uint8_t* r) {
    return {reinterpret_cast<const char*>(r + hdr_bytes(r)), key_len(r)};
  }
  uint64_t length_of(uint32_t idx, const uint8_t* r) const;
  static uint64_t hash(std::string_view key, uint8_t tier);
  size_t home(uint64_t h) const { return static_cast<size_t>((static_cast<unsigned __int128>(h) * cap_) >> 64); }
  uint8_t* rec(uint32_t idx) const { return log_ + size_t{idx} * 4; }
  // The slot holding (key, tier), or SIZE_MAX.
  size_t find(std::string_view key, uint8_t tier, uint64_t h) const;
  void decode(uint32_t idx, NodeEntry* out) const;
  void write_fields(uint8_t* r, uint32_t idx, const NodeEntry& e, bool keep_crc);
  uint32_t append(const NodeEntry& e);
  void insert_slot(uint32_t idx, uint64_t h);
  void remove_slot(size_t slot);
  void rebuild(size_t cap);
  void compact_log();
  static std::string sum_key(std::string_view key, uint64_t gen, uint64_t offset);

  uint8_t* log_ = nullptr;
  size_t log_len_ = 0, log_cap_ = 0, garbage_ = 0;
  // A slot: the record's number + 1 (0: empty), and beside it in tags_ a byte of its key's
  // hash, so a probe reads the record only when that byte matches: a new key's search at
  // 85% full probes about 22 slots, and reading each one's record was most of an insert.
  static constexpr size_t kSlotBytes = sizeof(uint32_t) + 1;
  uint32_t* slots_ = nullptr;
  uint8_t* tags_ = nullptr;  // in the same mapping, after the slots
  size_t cap_ = 0, n_ = 0, compactions_ = 0;
  std::unordered_map<uint32_t, Extra> extra_;
  std::unordered_map<std::string, uint32_t> sums_;  // kept aside by erase
};

}  // namespace mcr
