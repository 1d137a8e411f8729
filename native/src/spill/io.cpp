// io_uring and synchronous implementations of IoQueue.
#include <liburing.h>

#include <cerrno>
#include <cstring>

#include "mcr/spill_io.h"
#include "mcr/status.h"

namespace mcr::spill {

void IoReq::advance(size_t n) {
  offset += n;
  int out = 0;
  for (int i = 0; i < iovcnt; ++i) {
    if (n >= iov[i].iov_len) {
      n -= iov[i].iov_len;
      continue;
    }
    iov[out].iov_base = static_cast<char*>(iov[i].iov_base) + n;
    iov[out].iov_len = iov[i].iov_len - n;
    n = 0;
    ++out;
  }
  iovcnt = out;
}

namespace {

class UringQueue final : public IoQueue {
 public:
  explicit UringQueue(unsigned depth) : depth_(depth) {
    io_uring_params p{};
    // No COOP_TASKRUN: with it, completions are only posted when the thread enters the
    // kernel, and the executor peeks at the completion ring between CPU work (checksums)
    // without a system call.
    p.flags = IORING_SETUP_SUBMIT_ALL;
    int rc = io_uring_queue_init_params(depth, &ring_, &p);
    if (rc == -EINVAL) {
      p = io_uring_params{};
      rc = io_uring_queue_init_params(depth, &ring_, &p);
    }
    if (rc < 0)
      throw Error(Code::kIoError, std::string("io_uring_queue_init failed: ") + strerror(-rc));
  }
  ~UringQueue() override { io_uring_queue_exit(&ring_); }

  unsigned capacity() const override { return depth_; }

  void push(IoReq* r) override {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (!sqe) {  // cannot happen while inflight < depth; flush and retry once
      io_uring_submit(&ring_);
      sqe = io_uring_get_sqe(&ring_);
      if (!sqe) throw Error(Code::kInternal, "io_uring submission queue full");
    }
    if (r->write)
      io_uring_prep_writev(sqe, r->fd, r->iov, r->iovcnt, r->offset);
    else
      io_uring_prep_readv(sqe, r->fd, r->iov, r->iovcnt, r->offset);
    io_uring_sqe_set_data(sqe, r);
    ++inflight_;
  }

  void submit() override {
    if (io_uring_sq_ready(&ring_)) enter(0);
  }

  void reap(std::vector<std::pair<IoReq*, int>>* done, bool wait) override {
    if (wait && inflight_) {
      enter(1);
    } else if (io_uring_sq_ready(&ring_)) {
      enter(0);
    }
    unsigned head, n = 0;
    io_uring_cqe* cqe;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      done->emplace_back(static_cast<IoReq*>(io_uring_cqe_get_data(cqe)), cqe->res);
      ++n;
    }
    io_uring_cq_advance(&ring_, n);
    inflight_ -= n;
  }

 private:
  void enter(unsigned wait_nr) {
    for (;;) {
      int rc = io_uring_submit_and_wait(&ring_, wait_nr);
      if (rc >= 0) return;
      if (rc != -EINTR && rc != -EAGAIN && rc != -EBUSY)
        throw Error(Code::kIoError, std::string("io_uring_enter failed: ") + strerror(-rc));
    }
  }

  unsigned depth_;
  io_uring ring_{};
};

// One request at a time, performed at push(): the pread/pwrite baseline.
class SyncQueue final : public IoQueue {
 public:
  unsigned capacity() const override { return 1; }
  void push(IoReq* r) override {
    ssize_t rc;
    do {
      rc = r->write ? pwritev(r->fd, r->iov, r->iovcnt, static_cast<off_t>(r->offset))
                    : preadv(r->fd, r->iov, r->iovcnt, static_cast<off_t>(r->offset));
    } while (rc < 0 && errno == EINTR);
    done_.emplace_back(r, rc < 0 ? -errno : static_cast<int>(rc));
    ++inflight_;
  }
  void submit() override {}
  void reap(std::vector<std::pair<IoReq*, int>>* done, bool wait) override {
    inflight_ -= static_cast<unsigned>(done_.size());
    done->insert(done->end(), done_.begin(), done_.end());
    done_.clear();
  }

 private:
  std::vector<std::pair<IoReq*, int>> done_;
};

}  // namespace

std::unique_ptr<IoQueue> IoQueue::uring(unsigned depth) {
  return std::make_unique<UringQueue>(depth);
}
std::unique_ptr<IoQueue> IoQueue::sync() { return std::make_unique<SyncQueue>(); }

}  // namespace mcr::spill
