// The I/O queue under the spill tier: io_uring, or synchronous preadv/pwritev for
// comparison and as a fallback where io_uring is unavailable. Internal.
#pragma once
#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace mcr::spill {

// One read or write: the caller owns it until its completion is returned.
struct IoReq {
  int fd = -1;
  uint64_t offset = 0;
  iovec iov[3];
  int iovcnt = 0;
  bool write = false;

  size_t bytes() const {
    size_t n = 0;
    for (int i = 0; i < iovcnt; ++i) n += iov[i].iov_len;
    return n;
  }
  // Drop the first n bytes (after a short transfer), keeping offset in step.
  void advance(size_t n);
};

class IoQueue {
 public:
  virtual ~IoQueue() = default;
  virtual unsigned capacity() const = 0;  // requests in flight at most
  unsigned inflight() const { return inflight_; }
  // Queues a request (inflight() < capacity()); submit() hands queued requests to the
  // kernel without waiting.
  virtual void push(IoReq* r) = 0;
  virtual void submit() = 0;
  // Submits what is queued and appends completed (request, result) pairs, result = bytes
  // transferred or -errno. With wait, blocks until at least one completed (if any is in
  // flight); without, returns only what already completed.
  virtual void reap(std::vector<std::pair<IoReq*, int>>* done, bool wait) = 0;

  // io_uring with `depth` entries; throws Error(kIoError) if the kernel refuses.
  static std::unique_ptr<IoQueue> uring(unsigned depth);
  static std::unique_ptr<IoQueue> sync();

 protected:
  unsigned inflight_ = 0;
};

}  // namespace mcr::spill
