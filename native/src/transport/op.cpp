// Completion of user-level operations: counting, waiting (spin, then futex), abandonment,
// asyncio notification.
#include <sched.h>
#include <linux/futex.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

#include "internal.h"

namespace mcr {

namespace {
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, const timespec* ts) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, ts,
          nullptr, 0);
}
void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr,
          nullptr, 0);
}
}  // namespace

// ---- Notifier -----------------------------------------------------------------------

Notifier::Notifier() {
  fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (fd_ < 0) throw Error(Code::kInternal, std::string("eventfd: ") + strerror(errno));
}
Notifier::~Notifier() {
  if (fd_ >= 0) ::close(fd_);
}
void Notifier::push(uint64_t token) {
  {
    std::lock_guard<std::mutex> g(mu_);
    tokens_.push_back(token);
  }
  uint64_t one = 1;
  ssize_t rc = ::write(fd_, &one, sizeof one);
  (void)rc;
}
std::vector<uint64_t> Notifier::drain() {
  uint64_t v;
  ssize_t rc = ::read(fd_, &v, sizeof v);
  (void)rc;
  std::lock_guard<std::mutex> g(mu_);
  std::vector<uint64_t> out;
  out.swap(tokens_);
  return out;
}

// ---- Op -----------------------------------------------------------------------------

Op::Op(std::shared_ptr<EngineCore> core) : core_(std::move(core)) {}
Op::~Op() = default;

void Op::add_lane(int lane) { lanes_mask_ |= (uint64_t(1) << lane); }

void Op::record_error(Code c, const std::string& msg) {
  if (c == Code::kOk) return;
  std::lock_guard<std::mutex> g(err_mu_);
  if (code_ == Code::kOk) {
    code_ = c;
    msg_ = msg;
  }
}

void Op::sub_done(Code c, const std::string& msg) {
  if (c != Code::kOk) record_error(c, msg.empty() ? std::string(code_name(c)) : msg);
  if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) finish();
}

void Op::finish() {
  done_word_.store(1, std::memory_order_seq_cst);
  if (waiters_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&done_word_);
  std::shared_ptr<Notifier> n;
  uint64_t tok;
  {
    std::lock_guard<std::mutex> g(notify_mu_);
    n = notifier_;
    tok = token_;
  }
  if (n) n->push(tok);
}

void Op::set_notify(std::shared_ptr<Notifier> n, uint64_t token) {
  {
    std::lock_guard<std::mutex> g(notify_mu_);
    notifier_ = n;
    token_ = token;
  }
  // Completed before the notifier was attached: notify now (a duplicate token is harmless).
  if (done()) n->push(token);
}

bool Op::wait(double timeout_s) {
  if (done()) return true;
  const auto deadline = deadline_after(timeout_s);
  EngineCore* c = core_.get();
  if (c && lanes_mask_ && !c->closing.load() && c->cfg.spin_us > 0) {
    auto spin_end = Clock::now() + std::chrono::microseconds(c->cfg.spin_us);
    if (spin_end > deadline) spin_end = deadline;
    uint64_t polling = 0;  // lanes this thread polls (others are polled by their thread)
    for (size_t i = 0; i < c->lanes.size(); ++i)
      if ((lanes_mask_ & (uint64_t(1) << i)) && c->lanes[i]->begin_caller_poll())
        polling |= uint64_t(1) << i;
    for (;;) {
      for (size_t i = 0; i < c->lanes.size(); ++i)
        if (polling & (uint64_t(1) << i)) c->lanes[i]->try_progress();
      if (done()) break;
      if (Clock::now() >= spin_end) break;
      // Yield, not just pause: on a machine with few cores the peer we wait for (the
      // master's progress thread, a store node) may be runnable on this very CPU; a pure
      // spin would hold it off for the whole spin (measured: RTT 28 vs 50 µs, bimodal).
      sched_yield();
    }
    // Hand the lanes back to their progress threads, armed.
    for (size_t i = 0; i < c->lanes.size(); ++i)
      if (polling & (uint64_t(1) << i)) c->lanes[i]->end_caller_poll();
    if (done()) return true;
  }
  waiters_.fetch_add(1, std::memory_order_seq_cst);
  while (!done()) {
    auto now = Clock::now();
    if (now >= deadline) break;
    // Sleep in slices: a lost wake-up costs at most one slice.
    auto left = std::min<Clock::duration>(deadline - now, std::chrono::milliseconds(50));
    auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    timespec ts{time_t(ns / 1000000000), long(ns % 1000000000)};
    futex_wait(&done_word_, 0, &ts);
  }
  waiters_.fetch_sub(1, std::memory_order_seq_cst);
  return done();
}

void Op::check() const {
  if (!done()) throw Error(Code::kInternal, "operation not complete");
  if (code_ != Code::kOk) throw Error(code_, msg_);
}

bool Op::enter_copy() {
  uint32_t s = copy_state_.load();
  while (!(s & kAbandonBit)) {
    if (copy_state_.compare_exchange_weak(s, s + 1)) return true;
  }
  return false;
}

void Op::exit_copy() { copy_state_.fetch_sub(1); }

void Op::abandon() {
  copy_state_.fetch_or(kAbandonBit);
  // A copy-back into user memory may be running: wait for it (it is a memcpy).
  while ((copy_state_.load() & ~kAbandonBit) != 0) __builtin_ia32_pause();
  if (is_call_ && core_) {
    Pending p;
    if (core_->take_pending(call_id_, &p)) p.op->sub_done(Code::kTimeout, "call abandoned");
  }
}

}  // namespace mcr
