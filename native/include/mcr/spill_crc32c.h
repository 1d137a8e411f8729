// CRC-32C (Castagnoli), the checksum of every spilled object.
//
// Why CRC-32C and not XXH3: both run far above the disk (the SSE4.2 `crc32` instruction,
// three interleaved streams, measures 15-25 GB/s in cache here, i.e. memory-bound), but
// CRC-32C is a standard with known error-detection guarantees (every burst up to 32 bits,
// every odd number of flipped bits), it is what ext4/btrfs/iSCSI put on disk, it needs no
// third-party code, and it is *linear*: the CRC of A||B is computable from crc(A), crc(B)
// and |B|. That lets a large object be checksummed in independent chunks, as each chunk's
// I/O completes and in any order, and combined at the end (see crc32c_combine).
#pragma once
#include <cstddef>
#include <cstdint>

namespace mcr::spill {

// Raw register update (no pre/post inversion): the register after feeding `n` bytes.
// Linear over GF(2): raw(a ^ b, M) = raw(a, M) ^ raw(b, 0...) etc.
uint32_t crc32c_raw(uint32_t reg, const void* data, size_t n);

// The standard CRC-32C of `data` continued from a previous standard CRC `crc`
// (crc32c("123456789") == 0xE3069283).
inline uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0) {
  return ~crc32c_raw(~crc, data, n);
}

// raw(reg, n zero bytes): the register shifted over n zero bytes, in O(log n).
uint32_t crc32c_shift(uint32_t reg, uint64_t nbytes);

// The same shift as a reusable operator (x^(8n) mod P) and its application, for folding
// many chunks of one length: crc32c_shift(v, n) == crc32c_apply_shift(crc32c_shift_op(n), v).
uint32_t crc32c_shift_op(uint64_t nbytes);
uint32_t crc32c_apply_shift(uint32_t op, uint32_t reg);

// Standard CRC of A||B from crc(A), crc(B) and |B|.
inline uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  return crc32c_shift(crc_a, len_b) ^ crc_b;
}

// memcpy(dst, src, n) and the raw register update over those bytes in one pass: each line
// of src is loaded once, stored to dst (with stream, non-temporal stores past the cache, as
// for fresh arena space) and fed to the CRC from the same loads' cache lines.
uint32_t crc32c_copy_raw(uint32_t reg, void* dst, const void* src, size_t n, bool stream = false);

// True when the SSE4.2 instruction is used (else a slicing-by-8 table, ~1-2 GB/s).
bool crc32c_hardware();

// True when runs of 512 bytes or more are folded with AVX-512 carry-less multiplies
// (VPCLMULQDQ; MCR_CRC_NO_FOLD in the environment turns it off), the copy included.
bool crc32c_folded();

}  // namespace mcr::spill
