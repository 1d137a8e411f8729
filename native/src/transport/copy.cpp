// Parallel memcpy for large same-host transfers (the "memcpy" read/write paths, where the
// peer's arena is mapped into this process). One core copies cold memory at about 6.5 GB/s
// here, two at about 11 GB/s (measured with 4 MiB buffers over a 256 MiB working set), so a
// copy of at least stripe_min_bytes is cut into page-aligned pieces: helper threads take
// them from the front of a queue, the caller copies the first and then takes pieces from the
// back until none is left, and waits for those in progress. Helpers start on the first large copy; an engine that never copies has none.
//
// Writes into a peer's arena (puts) use non-temporal stores: the destination is fresh
// arena space this process will not read, so streaming it past the cache skips the
// read-for-ownership of every line (cold 4 MiB copies: ~2x here, see copy_stream).
//
// A put's checksum is taken in its copy (copy_crc, spill::crc32c_copy_raw): each line
// of the source is loaded once, stored and fed to the CRC, so the value is read from memory
// once, and the store node need not read it back to journal it (store/ring.py).
#include <emmintrin.h>
#include <sched.h>

#include <cstring>

#include "internal.h"
#include "mcr/spill_crc32c.h"

namespace mcr {

namespace {
constexpr size_t kPiece = 512u << 10;
}  // namespace

void copy_stream(char* dst, const char* src, size_t len) {
  size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
  if (head > len) head = len;
  memcpy(dst, src, head);
  dst += head, src += head, len -= head;
  size_t i = 0;
  for (; i + 64 <= len; i += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  memcpy(dst + i, src + i, len - i);
  _mm_sfence();  // streamed stores are weakly ordered: visible before the caller reports done
}

uint32_t copy_crc(char* dst, const char* src, size_t len, bool stream) {
  return ~spill::crc32c_copy_raw(~0u, dst, src, len, stream);
}

CopyPool::CopyPool(int helpers) : helpers_(helpers) {}

CopyPool::~CopyPool() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void CopyPool::start_locked() {
  for (int i = 0; i < helpers_; ++i) threads_.emplace_back([this] { run(); });
}

void CopyPool::run() {
  for (;;) {
    Piece p;
    {
      std::unique_lock<std::mutex> g(mu_);
      cv_.wait(g, [this] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      p = queue_.front();
      queue_.pop_front();
    }
    do_piece(p);
    p.left->fetch_sub(1, std::memory_order_release);
  }
}

void CopyPool::do_piece(const Piece& p) {
  if (p.crc != nullptr)
    *p.crc = copy_crc(p.dst, p.src, p.len, p.stream);
  else
    (p.stream ? copy_stream : copy_plain)(p.dst, p.src, p.len);
}

void copy_plain(char* dst, const char* src, size_t len) { memcpy(dst, src, len); }

void CopyPool::copy(char* dst, const char* src, size_t len, bool stream, uint32_t* crc) {
  if (helpers_ <= 0) {
    do_piece(Piece{dst, src, len, nullptr, stream, crc});
    return;
  }
  // Pieces of at most kPiece: a helper that is preempted mid-copy (2 vCPUs shared with
  // other processes) holds up the caller by one small piece, not by half the transfer.
  const size_t parts = size_t(helpers_) + 1;
  const size_t piece = std::min(kPiece, ((len + parts - 1) / parts + 4095) & ~size_t(4095));
  const size_t count = (len + piece - 1) / piece;
  std::vector<uint32_t> crcs(crc != nullptr ? count : 0);
  auto slot = [&](size_t k) { return crc != nullptr ? &crcs[k] : nullptr; };
  std::atomic<int> left{0};
  {
    std::lock_guard<std::mutex> g(mu_);
    if (threads_.empty()) start_locked();
    for (size_t off = piece, k = 1; off < len; off += piece, ++k) {
      queue_.push_back(Piece{dst + off, src + off, std::min(piece, len - off), &left, stream, slot(k)});
      left.fetch_add(1, std::memory_order_relaxed);
    }
  }
  cv_.notify_all();
  do_piece(Piece{dst, src, std::min(piece, len), nullptr, stream, slot(0)});
  for (;;) {  // take back pieces no helper has started (helpers may be busy or asleep)
    Piece p;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (queue_.empty()) break;
      p = queue_.back();
      queue_.pop_back();
    }
    do_piece(p);
    p.left->fetch_sub(1, std::memory_order_release);
  }
  while (left.load(std::memory_order_acquire) > 0) sched_yield();
  if (crc != nullptr) {  // the pieces' CRCs, in order (CRC-32C is linear)
    uint32_t c = crcs[0];
    for (size_t k = 1; k < count; ++k)
      c = spill::crc32c_combine(c, crcs[k], std::min(piece, len - k * piece));
    *crc = c;
  }
}

}  // namespace mcr
