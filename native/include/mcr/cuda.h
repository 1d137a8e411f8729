// CUDA device memory, through the driver API loaded at run time (dlopen of libcuda.so.1):
// the build needs no CUDA toolkit, and a machine without a GPU driver simply reports CUDA
// as unavailable. Only what the transport needs: pointer queries, pinning host memory,
// copies on a stream of our own, and events to order them against an engine's streams.
//
// Copy streams come in two kinds with one interface:
//   CudaCopyStream  cuMemcpyBatchAsync (or cuMemcpyAsync) on non-blocking CUDA streams of
//                   the device's primary context (one DMA per copy; pinned host memory
//                   makes it full speed), a call spread over several streams.
//   HostCopyStream  memcpy on a worker thread, in order: the same asynchronous contract
//                   with host memory on both sides. It is what CPU machines (and CI) run
//                   when staging is forced, standing in for the CUDA stream.
// CI has no GPU: tests/gpu/run.sh checks the CUDA side on one (run on an NVIDIA H200).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace mcr::cuda {

// Whether the driver loaded and reports at least one device; else why not.
bool available();
std::string unavailable_reason();
int device_count();

// Where an address lives: on a device (ordinal >= 0), or host memory (-1: plain host
// memory, pinned host memory, or no CUDA at all).
int device_of(uintptr_t addr);

// Pins [p, p + n) for DMA (cuMemHostRegister, portable). False if CUDA is unavailable or
// the driver refused (the copies still work, through the driver's own staging).
bool host_register(void* p, size_t n);
void host_unregister(void* p);

// Whether a kernel on the device may use this address as it is: device memory, or host
// memory registered with a device mapping at the same address. Decides the copy kernel.
bool device_addressable(const void* p);

// Why the copy kernel is not used ("" where it can be): MCR_CUDA_COPY_KERNEL=0, a driver
// without the functions, or the PTX refused on the device (asked once per device).
std::string copy_kernel_unavailable(int device);
// The copy kernel's use, process-wide: 0 never, 1 every batch it can take, 2 auto (the
// default; MCR_CUDA_COPY_KERNEL sets it at start). Returns the previous mode; -1 only asks.
int copy_kernel_mode(int mode = -1);

// A synchronous copy in any direction (unified addressing), in the context of `device`.
void copy_sync(int device, void* dst, const void* src, size_t n);

// CUDA IPC: another process's device memory on this host, mapped here. A device region's
// remote key carries a trailer (ipc_export: the allocation's IPC handle, the region's offset
// in it, the allocation's size; "" where the driver gives none, e.g. memory from the VMM
// API); an importer on the same host opens it (ipc_open: the device address of the
// region's first byte, 0 on any failure, which leaves the region to UCX) and copies with
// the driver. Opened handles are shared per allocation and closed with their last region.
std::string ipc_export(uintptr_t addr, uint64_t len);
std::string ipc_split(std::string* rkey);  // strips the trailer off rkey; returns it ("" if none)
uintptr_t ipc_open(const std::string& trailer, uint64_t len, uintptr_t* base);
void ipc_close(uintptr_t base);

struct Copy {
  uintptr_t dst;
  uintptr_t src;
  uint64_t len;
};

// Merges copies that continue each other in both memories (consecutive blocks of one
// request), keeping the order. Returns the number of copies left.
size_t coalesce(std::vector<Copy>& copies);

// A point in an engine's CUDA stream (cuEventRecord), for ordering our copies after the
// kernels that wrote the memory.
class Marker {
 public:
  Marker(int device, uintptr_t stream);
  ~Marker();
  void synchronize();
  void* event() const { return ev_; }
  int device() const { return device_; }

 private:
  int device_;
  void* ev_ = nullptr;
};

class CopyStream {
 public:
  virtual ~CopyStream() = default;
  // Queues the copies (after everything queued before); returns at once. `addressable`:
  // the caller checked that every address is one a kernel may use (device_addressable),
  // which lets a CUDA stream copy many small ranges with one kernel instead of the DMA
  // engines.
  virtual void copy_many(std::vector<Copy> copies, bool addressable = false) = 0;
  // Later copies wait for the marker (the engine's kernels up to it).
  virtual void wait_marker(const Marker& m) = 0;
  // Blocks until every queued copy is done; throws the first failure.
  virtual void synchronize() = 0;
  virtual const char* kind() const = 0;
  uint64_t copies() const { return copies_; }
  uint64_t bytes() const { return bytes_; }
  uint64_t kernel_launches() const { return launches_; }

 protected:
  uint64_t copies_ = 0, bytes_ = 0, launches_ = 0;
};

// A call's copies are spread over `lanes` CUDA streams (MCR_CUDA_COPY_STREAMS, default
// kDefaultCopyLanes) so that the device's copy engines overlap their per-copy costs, in
// slices of about equal bytes: a fork from the main stream and a join back into it keep
// every call after everything queued before it, as one stream would.
constexpr int kDefaultCopyLanes = 4;
int copy_lanes();

// The copy kernel takes a batch (MCR_CUDA_COPY_KERNEL unset or "auto") of at least this
// many ranges, after merging, averaging at most kKernelMaxMeanBytes; "1": any batch of 2+.
constexpr size_t kKernelMinCopies = 16;
constexpr uint64_t kKernelMaxMeanBytes = 1ull << 20;

class CudaCopyStream : public CopyStream {
 public:
  explicit CudaCopyStream(int device, int lanes = 0);  // 0: copy_lanes()
  ~CudaCopyStream() override;
  void copy_many(std::vector<Copy> copies, bool addressable = false) override;
  void wait_marker(const Marker& m) override;
  void synchronize() override;
  const char* kind() const override { return "cuda"; }
  int lanes() const { return int(streams_.size()); }

 private:
  void issue(void* stream, const Copy* c, size_t n);
  bool launch(const std::vector<Copy>& copies);  // false: the kernel cannot run here
  uintptr_t ranges_ = 0;  // device buffer of the kernel's ranges, reused in stream order
  size_t ranges_cap_ = 0;
  int device_;
  std::vector<void*> streams_;  // [0]: the main stream
  std::vector<void*> forks_;    // an event per side stream: [0] the fork, [i] lane i's join
};

class HostCopyStream : public CopyStream {
 public:
  HostCopyStream();
  ~HostCopyStream() override;
  void copy_many(std::vector<Copy> copies, bool addressable = false) override;
  void wait_marker(const Marker&) override {}
  void synchronize() override;
  const char* kind() const override { return "host"; }

 private:
  void run();
  std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<std::vector<Copy>> queue_;
  bool busy_ = false, stop_ = false;
  std::thread worker_;
};

}  // namespace mcr::cuda
