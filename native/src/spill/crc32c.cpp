// CRC-32C: SSE4.2 with three interleaved streams, or slicing-by-8 in software.
//
// The `crc32` instruction has a latency of 3 cycles and a throughput of 1 per cycle, so one
// dependency chain uses a third of the unit. We run three chains over three adjacent blocks
// of a round and merge them with the linearity of the CRC: for the raw register,
//   raw(r, A||B||C) = shift(shift(raw(r, A), |B|) ^ raw(0, B), |C|) ^ raw(0, C)
// where shift(v, n) = raw(v, n zero bytes) = v * x^(8n) mod P. For the two fixed block
// lengths used here the shift is precomputed as four 256-entry tables (it is linear in v).
#include <immintrin.h>

#include <cstdlib>
#include <cstring>

#include "mcr/spill_crc32c.h"

namespace mcr::spill {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // Castagnoli, bit-reflected
constexpr size_t kLong = 8192;           // per-stream block of a long round (24 KiB)
constexpr size_t kShort = 256;           // per-stream block of a short round (768 B)

// a * b mod P, polynomials in reflected order (bit 31 is x^0).
uint32_t multmodp(uint32_t a, uint32_t b) {
  if (a == 0) return 0;
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

struct Tables {
  uint32_t slice[8][256];   // slicing-by-8
  uint32_t x2n[32];         // x^(2^k) mod P
  uint32_t shift_long[4][256];
  uint32_t shift_short[4][256];
  bool hw;
  bool fold;  // AVX-512 with VPCLMULQDQ: long runs folded with carry-less multiplies

  uint32_t x8n(uint64_t n) const {  // x^(8n) mod P
    uint32_t p = 1u << 31;
    unsigned k = 3;
    while (n) {
      if (n & 1) p = multmodp(x2n[k & 31], p);
      n >>= 1;
      ++k;
    }
    return p;
  }

  void fill_shift(uint32_t (*t)[256], size_t len) {
    uint32_t op = x8n(len);
    for (int k = 0; k < 4; ++k)
      for (uint32_t b = 0; b < 256; ++b) t[k][b] = multmodp(op, b << (8 * k));
  }

  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int j = 0; j < 8; ++j) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      slice[0][i] = c;
    }
    for (int k = 1; k < 8; ++k)
      for (int i = 0; i < 256; ++i)
        slice[k][i] = (slice[k - 1][i] >> 8) ^ slice[0][slice[k - 1][i] & 0xff];
    x2n[0] = 1u << 30;  // x^1
    for (int k = 1; k < 32; ++k) x2n[k] = multmodp(x2n[k - 1], x2n[k - 1]);
    fill_shift(shift_long, kLong);
    fill_shift(shift_short, kShort);
    __builtin_cpu_init();
    hw = __builtin_cpu_supports("sse4.2");
    fold = hw && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("pclmul") && !std::getenv("MCR_CRC_NO_FOLD");
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

inline uint32_t apply(const uint32_t (*t)[256], uint32_t v) {
  return t[0][v & 0xff] ^ t[1][(v >> 8) & 0xff] ^ t[2][(v >> 16) & 0xff] ^ t[3][v >> 24];
}

inline uint64_t load64(const uint8_t* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);
  return w;
}

uint32_t sw_raw(const Tables& t, uint32_t reg, const uint8_t* p, size_t n) {
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    reg = (reg >> 8) ^ t.slice[0][(reg ^ *p++) & 0xff];
    --n;
  }
  while (n >= 8) {
    uint64_t w = load64(p) ^ reg;
    reg = t.slice[7][w & 0xff] ^ t.slice[6][(w >> 8) & 0xff] ^ t.slice[5][(w >> 16) & 0xff] ^
          t.slice[4][(w >> 24) & 0xff] ^ t.slice[3][(w >> 32) & 0xff] ^
          t.slice[2][(w >> 40) & 0xff] ^ t.slice[1][(w >> 48) & 0xff] ^ t.slice[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) reg = (reg >> 8) ^ t.slice[0][(reg ^ *p++) & 0xff];
  return reg;
}

// Three chains over blocks of `blk` bytes, as long as 3*blk bytes remain.
__attribute__((target("sse4.2"))) inline uint64_t hw_rounds(const uint32_t (*shift)[256],
                                                          size_t blk, uint64_t c0,
                                                          const uint8_t*& p, size_t& n) {
  while (n >= 3 * blk) {
    uint64_t c1 = 0, c2 = 0;
    const uint8_t* end = p + blk;
    do {
      c0 = _mm_crc32_u64(c0, load64(p));
      c1 = _mm_crc32_u64(c1, load64(p + blk));
      c2 = _mm_crc32_u64(c2, load64(p + 2 * blk));
      p += 8;
    } while (p < end);
    c0 = apply(shift, static_cast<uint32_t>(c0)) ^ c1;
    c0 = apply(shift, static_cast<uint32_t>(c0)) ^ c2;
    p += 2 * blk;
    n -= 3 * blk;
  }
  return c0;
}

__attribute__((target("sse4.2"))) uint32_t hw_raw(const Tables& t, uint32_t reg,
                                                  const uint8_t* p, size_t n) {
  uint64_t c = reg;
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --n;
  }
  c = hw_rounds(t.shift_long, kLong, c, p, n);
  c = hw_rounds(t.shift_short, kShort, c, p, n);
  while (n >= 8) {
    c = _mm_crc32_u64(c, load64(p));
    p += 8;
    n -= 8;
  }
  while (n--) c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
  return static_cast<uint32_t>(c);
}

// Long runs folded with carry-less multiplies (AVX-512 VPCLMULQDQ): four 64-byte
// accumulators, each of four 128-bit lanes, take the next 256 bytes per step; each lane is
// carried 256 bytes forward as lo * x^(8*256+31) + hi * x^(8*256-33) (mod P, bit-reflected),
// its next bytes XORed in. At the end the 16 lanes are folded into one by 16 bytes at a time
// and its 16 bytes go through the crc32 instruction from 0; the tail after it as usual.
// The register enters XORed into the first four bytes. With kCopy each 256 bytes are also
// stored to d (kStream: non-temporal, d 64-aligned first). About 4x the three crc32 chains
// here: the copy's memory traffic sets the pace, not the CRC.
constexpr uint64_t kFoldLo256 = 0xdcb17aa4, kFoldHi256 = 0xb9e02b86;  // x^2079, x^2015 mod P
constexpr uint64_t kFoldLo16 = 0xf20c0dfe, kFoldHi16 = 0x493c7d27;    // x^159, x^95 mod P
constexpr size_t kFoldMin = 512;  // below this the crc32 chains

template <bool kCopy, bool kStream>
__attribute__((target("avx512f,avx512bw,vpclmulqdq,pclmul,sse4.2"))) uint32_t fold_raw(const Tables& t, uint32_t reg,
                                                                                     uint8_t* d, const uint8_t* p,
                                                                                     size_t n) {
  if (kStream) {  // the destination aligned to 64 for the streamed stores
    size_t head = (64 - (reinterpret_cast<uintptr_t>(d) & 63)) & 63;
    if (head > n) head = n;
    std::memcpy(d, p, head);
    reg = hw_raw(t, reg, p, head);
    d += head, p += head, n -= head;
  }
  if (n < kFoldMin) {
    if (kCopy) std::memcpy(d, p, n);
    return hw_raw(t, reg, p, n);
  }
#define MCR_FOLD_STORE(o, v)                                                \
  do {                                                                      \
    if (kCopy && kStream) _mm512_stream_si512(reinterpret_cast<__m512i*>(o), v); \
    else if (kCopy) _mm512_storeu_si512(o, v);                             \
  } while (0)
  const __m512i k = _mm512_set_epi64(kFoldHi256, kFoldLo256, kFoldHi256, kFoldLo256, kFoldHi256, kFoldLo256,
                                     kFoldHi256, kFoldLo256);
  __m512i a0 = _mm512_loadu_si512(p), a1 = _mm512_loadu_si512(p + 64), a2 = _mm512_loadu_si512(p + 128),
          a3 = _mm512_loadu_si512(p + 192);
  MCR_FOLD_STORE(d, a0);
  MCR_FOLD_STORE(d + 64, a1);
  MCR_FOLD_STORE(d + 128, a2);
  MCR_FOLD_STORE(d + 192, a3);
  a0 = _mm512_xor_si512(a0, _mm512_set_epi64(0, 0, 0, 0, 0, 0, 0, reg));
  p += 256, d += 256, n -= 256;
  for (; n >= 256; p += 256, d += 256, n -= 256) {
    const __m512i b0 = _mm512_loadu_si512(p), b1 = _mm512_loadu_si512(p + 64), b2 = _mm512_loadu_si512(p + 128),
                  b3 = _mm512_loadu_si512(p + 192);
    MCR_FOLD_STORE(d, b0);
    MCR_FOLD_STORE(d + 64, b1);
    MCR_FOLD_STORE(d + 128, b2);
    MCR_FOLD_STORE(d + 192, b3);
    a0 = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a0, k, 0x00), _mm512_clmulepi64_epi128(a0, k, 0x11), b0,
                                   0x96);
    a1 = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a1, k, 0x00), _mm512_clmulepi64_epi128(a1, k, 0x11), b1,
                                   0x96);
    a2 = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a2, k, 0x00), _mm512_clmulepi64_epi128(a2, k, 0x11), b2,
                                   0x96);
    a3 = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a3, k, 0x00), _mm512_clmulepi64_epi128(a3, k, 0x11), b3,
                                   0x96);
  }
#undef MCR_FOLD_STORE
  alignas(64) uint8_t lanes[256];
  _mm512_store_si512(lanes, a0);
  _mm512_store_si512(lanes + 64, a1);
  _mm512_store_si512(lanes + 128, a2);
  _mm512_store_si512(lanes + 192, a3);
  const __m128i k16 = _mm_set_epi64x(kFoldHi16, kFoldLo16);
  __m128i x = _mm_load_si128(reinterpret_cast<const __m128i*>(lanes));
  for (int i = 1; i < 16; ++i)
    x = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k16, 0x00), _mm_clmulepi64_si128(x, k16, 0x11)),
                      _mm_load_si128(reinterpret_cast<const __m128i*>(lanes + 16 * i)));
  uint64_t c = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(x)));
  c = _mm_crc32_u64(c, static_cast<uint64_t>(_mm_extract_epi64(x, 1)));
  if (kCopy) std::memcpy(d, p, n);
  c = hw_raw(t, static_cast<uint32_t>(c), p, n);
  if (kStream) _mm_sfence();  // streamed stores are weakly ordered: visible before the caller reports done
  return static_cast<uint32_t>(c);
}

}  // namespace

uint32_t crc32c_raw(uint32_t reg, const void* data, size_t n) {
  const Tables& t = tables();
  const auto* p = static_cast<const uint8_t*>(data);
  if (t.fold && n >= kFoldMin) return fold_raw<false, false>(t, reg, nullptr, p, n);
  return t.hw ? hw_raw(t, reg, p, n) : sw_raw(t, reg, p, n);
}

uint32_t crc32c_shift(uint32_t reg, uint64_t nbytes) {
  return multmodp(tables().x8n(nbytes), reg);
}

uint32_t crc32c_shift_op(uint64_t nbytes) { return tables().x8n(nbytes); }
uint32_t crc32c_apply_shift(uint32_t op, uint32_t reg) { return multmodp(op, reg); }

namespace {

// One pass over the source: three chains, each over its own block of a round, load each
// 64-byte line, store it (streamed past the cache, or plain) and feed its eight words to
// the chain's CRC. The CRC's 24 instructions per three lines run beside the copy's loads
// and stores, so the copy's memory traffic sets the pace, as it does for a plain copy.
template <bool kStream>
__attribute__((target("sse4.2"))) uint32_t hw_copy_raw(const Tables& t, uint32_t reg, uint8_t* d,
                                                       const uint8_t* p, size_t n) {
  uint64_t c0 = reg;
  if (kStream) {  // the destination aligned to 16 for the streamed stores
    size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;
    if (head > n) head = n;
    std::memcpy(d, p, head);
    c0 = hw_raw(t, static_cast<uint32_t>(c0), p, head);
    d += head, p += head, n -= head;
  }
  constexpr size_t blk = kLong;  // a chain's block of a round (each line's words are read right after its load)
  while (n >= 3 * blk) {
    uint64_t c1 = 0, c2 = 0;
    for (size_t i = 0; i < blk; i += 64) {
      const uint8_t* q0 = p + i;
      const uint8_t* q1 = q0 + blk;
      const uint8_t* q2 = q1 + blk;
      __m128i v[12];
      for (int k = 0; k < 4; ++k) {
        v[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q0 + 16 * k));
        v[4 + k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q1 + 16 * k));
        v[8 + k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q2 + 16 * k));
      }
      for (int k = 0; k < 8; ++k) {
        c0 = _mm_crc32_u64(c0, load64(q0 + 8 * k));
        c1 = _mm_crc32_u64(c1, load64(q1 + 8 * k));
        c2 = _mm_crc32_u64(c2, load64(q2 + 8 * k));
      }
      for (int s = 0; s < 3; ++s)
        for (int k = 0; k < 4; ++k) {
          auto* o = reinterpret_cast<__m128i*>(d + s * blk + i + 16 * k);
          if (kStream)
            _mm_stream_si128(o, v[4 * s + k]);
          else
            _mm_storeu_si128(o, v[4 * s + k]);
        }
    }
    c0 = apply(t.shift_long, static_cast<uint32_t>(c0)) ^ c1;
    c0 = apply(t.shift_long, static_cast<uint32_t>(c0)) ^ c2;
    p += 3 * blk, d += 3 * blk, n -= 3 * blk;
  }
  c0 = hw_raw(t, static_cast<uint32_t>(c0), p, n);
  std::memcpy(d, p, n);
  if (kStream) _mm_sfence();  // streamed stores are weakly ordered: visible before the caller reports done
  return static_cast<uint32_t>(c0);
}

}  // namespace

uint32_t crc32c_copy_raw(uint32_t reg, void* dst, const void* src, size_t n, bool stream) {
  const Tables& t = tables();
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  if (!t.hw) {  // no SSE4.2: the table CRC, then the copy
    reg = sw_raw(t, reg, s, n);
    std::memcpy(d, s, n);
    return reg;
  }
  if (t.fold && n >= kFoldMin)
    return stream ? fold_raw<true, true>(t, reg, d, s, n) : fold_raw<true, false>(t, reg, d, s, n);
  return stream ? hw_copy_raw<true>(t, reg, d, s, n) : hw_copy_raw<false>(t, reg, d, s, n);
}

bool crc32c_folded() { return tables().fold; }

bool crc32c_hardware() { return tables().hw; }

}  // namespace mcr::spill
