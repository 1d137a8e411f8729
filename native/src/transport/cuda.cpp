// The CUDA driver API, loaded at run time (see mcr/cuda.h). Every function is looked up
// by its ABI name (the _v2 names where cuda.h maps the plain ones to them).
#include "mcr/cuda.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>

#include <cstdlib>
#include <cstring>
#include <map>

#include "copy_ranges_ptx.h"
#include "mcr/status.h"

namespace mcr::cuda {

namespace {

using CUresult = int;
using CUdevice = int;
using CUcontext = void*;
using CUstream = void*;
using CUevent = void*;
using CUdeviceptr = unsigned long long;
using CUmodule = void*;
using CUfunction = void*;

constexpr int kAttrMemoryType = 2;     // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
constexpr int kAttrDeviceOrdinal = 9;  // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
constexpr unsigned kMemDevice = 2;     // CU_MEMORYTYPE_DEVICE
constexpr unsigned kMemUnified = 4;    // CU_MEMORYTYPE_UNIFIED
constexpr unsigned kHostRegisterPortable = 1;
constexpr unsigned kStreamNonBlocking = 1;
constexpr unsigned kEventDisableTiming = 2;
constexpr int kMaxDevices = 64;
constexpr int kAttrDevicePointer = 3;  // CU_POINTER_ATTRIBUTE_DEVICE_POINTER
constexpr unsigned kHostRegisterDeviceMap = 2;
constexpr int kDevAttrSmCount = 16;  // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT

struct IpcHandle {  // CUipcMemHandle
  char reserved[64];
};
constexpr unsigned kIpcLazyPeerAccess = 1;  // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
constexpr char kIpcMagic[9] = "MCRCUIPC";
constexpr size_t kIpcTrailer = sizeof(IpcHandle) + 8 + 8 + 8;

struct Api {
  void* lib = nullptr;
  std::string why;
  int ndev = 0;
  CUresult (*Init)(unsigned);
  CUresult (*DeviceGetCount)(int*);
  CUresult (*DeviceGet)(CUdevice*, int);
  CUresult (*PrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*CtxSetCurrent)(CUcontext);
  CUresult (*PointerGetAttribute)(void*, int, CUdeviceptr);
  CUresult (*MemHostRegister)(void*, size_t, unsigned);
  CUresult (*MemHostUnregister)(void*);
  CUresult (*Memcpy)(CUdeviceptr, CUdeviceptr, size_t);
  CUresult (*MemcpyAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*StreamCreate)(CUstream*, unsigned);
  CUresult (*StreamDestroy)(CUstream);
  CUresult (*StreamSynchronize)(CUstream);
  CUresult (*StreamWaitEvent)(CUstream, CUevent, unsigned);
  CUresult (*EventCreate)(CUevent*, unsigned);
  CUresult (*EventRecord)(CUevent, CUstream);
  CUresult (*EventSynchronize)(CUevent);
  CUresult (*EventDestroy)(CUevent);
  CUresult (*GetErrorString)(CUresult, const char**);
  // IPC (optional: a driver without them leaves device memory of other processes to UCX).
  CUresult (*MemGetAddressRange)(CUdeviceptr*, size_t*, CUdeviceptr) = nullptr;
  CUresult (*IpcGetMemHandle)(IpcHandle*, CUdeviceptr) = nullptr;
  CUresult (*IpcOpenMemHandle)(CUdeviceptr*, IpcHandle, unsigned) = nullptr;
  CUresult (*IpcCloseMemHandle)(CUdeviceptr) = nullptr;
  // CUDA 13's batched copy (optional: older drivers lack it, MCR_CUDA_BATCH_COPY=0 turns it off).
  CUresult (*MemcpyBatchAsync)(CUdeviceptr*, CUdeviceptr*, size_t*, size_t, void*, size_t*, size_t, CUstream) = nullptr;
  // The copy kernel (optional: without them, or MCR_CUDA_COPY_KERNEL=0, copies stay DMA).
  CUresult (*ModuleLoadData)(CUmodule*, const void*) = nullptr;
  CUresult (*ModuleGetFunction)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                           CUstream, void**, void**) = nullptr;
  CUresult (*MemAlloc)(CUdeviceptr*, size_t) = nullptr;
  CUresult (*MemFree)(CUdeviceptr) = nullptr;
  CUresult (*MemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream) = nullptr;
  CUresult (*DeviceGetAttribute)(int*, int, CUdevice) = nullptr;
  std::atomic<int> kernel_mode{2};  // MCR_CUDA_COPY_KERNEL: 0 never, 1 for every batch it can take, 2 auto
  CUfunction kernel[kMaxDevices] = {};
  bool kernel_fns = false;  // the driver has every function the kernel needs
  int kernel_state[kMaxDevices] = {};  // 0 not loaded yet, 1 loaded, -1 refused
  int sm_count[kMaxDevices] = {};
  std::string kernel_why;
  std::mutex mu;
  CUcontext ctx[kMaxDevices] = {};
};

template <typename F>
bool sym(Api& a, F& f, const char* name) {
  f = reinterpret_cast<F>(dlsym(a.lib, name));
  if (!f) a.why = std::string("libcuda.so.1 has no ") + name;
  return f != nullptr;
}

Api& api() {
  static Api* a = [] {
    auto* p = new Api;
    p->lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!p->lib) {
      const char* e = dlerror();
      p->why = std::string("no CUDA driver: ") + (e ? e : "libcuda.so.1 not found");
      return p;
    }
    bool ok = sym(*p, p->Init, "cuInit") && sym(*p, p->DeviceGetCount, "cuDeviceGetCount") &&
              sym(*p, p->DeviceGet, "cuDeviceGet") &&
              sym(*p, p->PrimaryCtxRetain, "cuDevicePrimaryCtxRetain") &&
              sym(*p, p->CtxSetCurrent, "cuCtxSetCurrent") &&
              sym(*p, p->PointerGetAttribute, "cuPointerGetAttribute") &&
              sym(*p, p->MemHostRegister, "cuMemHostRegister_v2") &&
              sym(*p, p->MemHostUnregister, "cuMemHostUnregister") &&
              sym(*p, p->Memcpy, "cuMemcpy") && sym(*p, p->MemcpyAsync, "cuMemcpyAsync") &&
              sym(*p, p->StreamCreate, "cuStreamCreate") &&
              sym(*p, p->StreamDestroy, "cuStreamDestroy_v2") &&
              sym(*p, p->StreamSynchronize, "cuStreamSynchronize") &&
              sym(*p, p->StreamWaitEvent, "cuStreamWaitEvent") &&
              sym(*p, p->EventCreate, "cuEventCreate") && sym(*p, p->EventRecord, "cuEventRecord") &&
              sym(*p, p->EventSynchronize, "cuEventSynchronize") &&
              sym(*p, p->EventDestroy, "cuEventDestroy_v2") &&
              sym(*p, p->GetErrorString, "cuGetErrorString");
    if (!ok) return p;
    p->MemGetAddressRange = reinterpret_cast<decltype(p->MemGetAddressRange)>(dlsym(p->lib, "cuMemGetAddressRange_v2"));
    p->IpcGetMemHandle = reinterpret_cast<decltype(p->IpcGetMemHandle)>(dlsym(p->lib, "cuIpcGetMemHandle"));
    p->IpcOpenMemHandle = reinterpret_cast<decltype(p->IpcOpenMemHandle)>(dlsym(p->lib, "cuIpcOpenMemHandle_v2"));
    p->IpcCloseMemHandle = reinterpret_cast<decltype(p->IpcCloseMemHandle)>(dlsym(p->lib, "cuIpcCloseMemHandle"));
    // MCR_CUDA_IPC=0 leaves other processes' device memory to UCX (its cuda_ipc).
    const char* ipc = getenv("MCR_CUDA_IPC");
    if (ipc && strcmp(ipc, "0") == 0) {
      p->IpcGetMemHandle = nullptr;
      p->IpcOpenMemHandle = nullptr;
    }
    const char* batch = getenv("MCR_CUDA_BATCH_COPY");
    if (!batch || strcmp(batch, "0") != 0)
      p->MemcpyBatchAsync = reinterpret_cast<decltype(p->MemcpyBatchAsync)>(dlsym(p->lib, "cuMemcpyBatchAsync_v2"));
    const char* kern = getenv("MCR_CUDA_COPY_KERNEL");
    p->kernel_mode = !kern || !*kern ? 2 : (strcmp(kern, "0") == 0 ? 0 : (strcmp(kern, "1") == 0 ? 1 : 2));
    p->ModuleLoadData = reinterpret_cast<decltype(p->ModuleLoadData)>(dlsym(p->lib, "cuModuleLoadData"));
    p->ModuleGetFunction = reinterpret_cast<decltype(p->ModuleGetFunction)>(dlsym(p->lib, "cuModuleGetFunction"));
    p->LaunchKernel = reinterpret_cast<decltype(p->LaunchKernel)>(dlsym(p->lib, "cuLaunchKernel"));
    p->MemAlloc = reinterpret_cast<decltype(p->MemAlloc)>(dlsym(p->lib, "cuMemAlloc_v2"));
    p->MemFree = reinterpret_cast<decltype(p->MemFree)>(dlsym(p->lib, "cuMemFree_v2"));
    p->MemcpyHtoDAsync = reinterpret_cast<decltype(p->MemcpyHtoDAsync)>(dlsym(p->lib, "cuMemcpyHtoDAsync_v2"));
    p->DeviceGetAttribute = reinterpret_cast<decltype(p->DeviceGetAttribute)>(dlsym(p->lib, "cuDeviceGetAttribute"));
    p->kernel_fns = p->ModuleLoadData && p->ModuleGetFunction && p->LaunchKernel && p->MemAlloc && p->MemFree &&
                    p->MemcpyHtoDAsync && p->DeviceGetAttribute;
    CUresult r = p->Init(0);
    if (r == 0) r = p->DeviceGetCount(&p->ndev);
    if (r != 0) {
      p->why = "cuInit failed with CUDA error " + std::to_string(r);
      p->ndev = 0;
    } else if (p->ndev == 0) {
      p->why = "the CUDA driver reports no device";
    }
    return p;
  }();
  return *a;
}

std::string err(const char* what, CUresult r) {
  const char* s = nullptr;
  if (api().GetErrorString) api().GetErrorString(r, &s);
  return std::string(what) + ": CUDA error " + std::to_string(r) + (s ? std::string(" (") + s + ")" : "");
}

void check(const char* what, CUresult r) {
  if (r != 0) throw Error(Code::kTransferFailed, err(what, r));
}

Api& need() {
  Api& a = api();
  if (a.ndev == 0) throw Error(Code::kInvalidArgument, "CUDA is not available: " + a.why);
  return a;
}

// Makes `device`'s primary context current in this thread (retained once per process).
void use_device(int device) {
  Api& a = need();
  if (device < 0 || device >= a.ndev || device >= kMaxDevices)
    throw Error(Code::kInvalidArgument, "CUDA device " + std::to_string(device) + " does not exist (" +
                                            std::to_string(a.ndev) + " devices)");
  static thread_local CUcontext current = nullptr;
  CUcontext c;
  {
    std::lock_guard<std::mutex> g(a.mu);
    if (!a.ctx[device]) {
      CUdevice d;
      check("cuDeviceGet", a.DeviceGet(&d, device));
      check("cuDevicePrimaryCtxRetain", a.PrimaryCtxRetain(&a.ctx[device], d));
    }
    c = a.ctx[device];
  }
  if (c != current) {
    check("cuCtxSetCurrent", a.CtxSetCurrent(c));
    current = c;
  }
}

}  // namespace

bool available() { return api().ndev > 0; }
std::string unavailable_reason() { return available() ? std::string() : api().why; }
int device_count() { return api().ndev; }

int device_of(uintptr_t addr) {
  Api& a = api();
  if (a.ndev == 0 || addr == 0) return -1;
  unsigned mt = 0;
  if (a.PointerGetAttribute(&mt, kAttrMemoryType, CUdeviceptr(addr)) != 0) return -1;  // not CUDA's
  if (mt != kMemDevice && mt != kMemUnified) return -1;
  int ordinal = -1;
  if (a.PointerGetAttribute(&ordinal, kAttrDeviceOrdinal, CUdeviceptr(addr)) != 0) return -1;
  return ordinal;
}

bool host_register(void* p, size_t n) {
  Api& a = api();
  if (a.ndev == 0) return false;
  use_device(0);
  // With a device mapping (the copy kernel's path; implied under unified addressing), or
  // without where a driver refuses that flag.
  return a.MemHostRegister(p, n, kHostRegisterPortable | kHostRegisterDeviceMap) == 0 ||
         a.MemHostRegister(p, n, kHostRegisterPortable) == 0;
}

bool device_addressable(const void* p) {
  Api& a = api();
  if (a.ndev == 0 || !p) return false;
  try {
    use_device(0);  // the query needs a context; unified addressing makes any one do
  } catch (const Error&) {
    return false;
  }
  CUdeviceptr d = 0;
  if (a.PointerGetAttribute(&d, kAttrDevicePointer, CUdeviceptr(p)) != 0) return false;
  return d == CUdeviceptr(p);  // the kernel uses host addresses as they are
}

void host_unregister(void* p) {
  Api& a = api();
  if (a.ndev > 0) a.MemHostUnregister(p);
}

void copy_sync(int device, void* dst, const void* src, size_t n) {
  use_device(device);
  check("cuMemcpy", api().Memcpy(CUdeviceptr(dst), CUdeviceptr(src), n));
}

// ---- IPC --------------------------------------------------------------------------------

namespace {
void put64(std::string* s, uint64_t v) { s->append(reinterpret_cast<const char*>(&v), 8); }
uint64_t get64(const char* p) {
  uint64_t v;
  memcpy(&v, p, 8);
  return v;
}
struct Opened {
  uintptr_t base;
  int refs;
};
std::mutex ipc_mu;
std::map<std::string, Opened>& ipc_opened() {  // handle bytes -> this process's mapping
  static auto* m = new std::map<std::string, Opened>;
  return *m;
}
}  // namespace

std::string ipc_export(uintptr_t addr, uint64_t len) {
  Api& a = api();
  if (a.ndev == 0 || !a.MemGetAddressRange || !a.IpcGetMemHandle) return "";
  const int dev = device_of(addr);
  if (dev < 0) return "";
  try {
    use_device(dev);
  } catch (const Error&) {
    return "";
  }
  CUdeviceptr base = 0;
  size_t size = 0;
  if (a.MemGetAddressRange(&base, &size, CUdeviceptr(addr)) != 0) return "";
  if (addr < base || addr + len > base + size) return "";  // spans allocations
  IpcHandle h;
  if (a.IpcGetMemHandle(&h, base) != 0) return "";  // not IPC-capable (VMM, managed)
  std::string out(h.reserved, sizeof h.reserved);
  put64(&out, addr - base);
  put64(&out, size);
  out.append(kIpcMagic, 8);
  return out;
}

std::string ipc_split(std::string* rkey) {
  if (rkey->size() <= kIpcTrailer || rkey->compare(rkey->size() - 8, 8, kIpcMagic, 8) != 0) return "";
  std::string t = rkey->substr(rkey->size() - kIpcTrailer);
  rkey->resize(rkey->size() - kIpcTrailer);
  return t;
}

uintptr_t ipc_open(const std::string& t, uint64_t len, uintptr_t* base_out) {
  Api& a = api();
  if (t.size() != kIpcTrailer || a.ndev == 0 || !a.IpcOpenMemHandle || !a.IpcCloseMemHandle) return 0;
  const uint64_t off = get64(t.data() + sizeof(IpcHandle)), size = get64(t.data() + sizeof(IpcHandle) + 8);
  if (off > size || len > size - off) return 0;
  std::string key = t.substr(0, sizeof(IpcHandle));
  std::lock_guard<std::mutex> g(ipc_mu);
  auto& m = ipc_opened();
  auto it = m.find(key);
  if (it == m.end()) {
    try {
      use_device(0);  // any context: peers reach the memory through unified addressing
    } catch (const Error&) {
      return 0;
    }
    IpcHandle h;
    memcpy(h.reserved, key.data(), sizeof h.reserved);
    CUdeviceptr p = 0;
    // Fails for this process's own memory, memory of a GPU this one cannot reach, a
    // handle whose owner is gone: the region stays UCX's.
    if (a.IpcOpenMemHandle(&p, h, kIpcLazyPeerAccess) != 0) return 0;
    it = m.emplace(key, Opened{uintptr_t(p), 0}).first;
  }
  it->second.refs++;
  *base_out = it->second.base;
  return it->second.base + off;
}

void ipc_close(uintptr_t base) {
  Api& a = api();
  std::lock_guard<std::mutex> g(ipc_mu);
  auto& m = ipc_opened();
  for (auto it = m.begin(); it != m.end(); ++it) {
    if (it->second.base != base) continue;
    if (--it->second.refs == 0) {
      try {
        use_device(0);
        a.IpcCloseMemHandle(CUdeviceptr(base));
      } catch (const Error&) {
      }
      m.erase(it);
    }
    return;
  }
}

size_t coalesce(std::vector<Copy>& v) {
  size_t out = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    if (v[i].len == 0) continue;
    if (out > 0 && v[out - 1].dst + v[out - 1].len == v[i].dst && v[out - 1].src + v[out - 1].len == v[i].src) {
      v[out - 1].len += v[i].len;
    } else {
      v[out++] = v[i];
    }
  }
  v.resize(out);
  return out;
}

// ---- Marker ---------------------------------------------------------------------------

Marker::Marker(int device, uintptr_t stream) : device_(device) {
  use_device(device);
  Api& a = api();
  check("cuEventCreate", a.EventCreate(&ev_, kEventDisableTiming));
  CUresult r = a.EventRecord(ev_, reinterpret_cast<CUstream>(stream));
  if (r != 0) {
    a.EventDestroy(ev_);
    ev_ = nullptr;
    check("cuEventRecord", r);
  }
}

Marker::~Marker() {
  if (ev_) api().EventDestroy(ev_);
}

void Marker::synchronize() {
  use_device(device_);
  check("cuEventSynchronize", api().EventSynchronize(ev_));
}

// ---- CudaCopyStream ---------------------------------------------------------------------

int copy_lanes() {
  static const int n = [] {
    const char* v = getenv("MCR_CUDA_COPY_STREAMS");
    int k = v && *v ? atoi(v) : kDefaultCopyLanes;
    return k < 1 ? 1 : (k > 16 ? 16 : k);
  }();
  return n;
}

CudaCopyStream::CudaCopyStream(int device, int lanes) : device_(device) {
  use_device(device);
  Api& a = api();
  const int n = lanes > 0 ? lanes : copy_lanes();
  try {
    for (int i = 0; i < n; ++i) {
      void* st = nullptr;
      check("cuStreamCreate", a.StreamCreate(&st, kStreamNonBlocking));
      streams_.push_back(st);
      if (i == 0) continue;
      void* ev = nullptr;
      check("cuEventCreate", a.EventCreate(&ev, kEventDisableTiming));
      forks_.push_back(ev);
    }
    if (n > 1) {  // forks_[0] is the fork event; forks_[i] (i >= 1) lane i's join
      void* ev = nullptr;
      check("cuEventCreate", a.EventCreate(&ev, kEventDisableTiming));
      forks_.insert(forks_.begin(), ev);
    }
  } catch (...) {
    for (void* e : forks_) a.EventDestroy(e);
    for (void* st : streams_) a.StreamDestroy(st);
    throw;
  }
}

namespace {
// Loads the copy kernel into `device`'s primary context once (current in this thread).
CUfunction copy_kernel(int device) {
  Api& a = api();
  if (a.kernel_mode == 0 || !a.kernel_fns || device < 0 || device >= kMaxDevices) return nullptr;
  std::lock_guard<std::mutex> g(a.mu);
  if (a.kernel_state[device] == 0) {
    CUmodule mod = nullptr;
    CUfunction fn = nullptr;
    CUdevice d = 0;
    CUresult r = a.ModuleLoadData(&mod, kCopyRangesPtx);
    if (r == 0) r = a.ModuleGetFunction(&fn, mod, "mcr_copy_ranges");
    if (r == 0) r = a.DeviceGet(&d, device);
    if (r == 0) r = a.DeviceGetAttribute(&a.sm_count[device], kDevAttrSmCount, d);
    if (r != 0 || !fn || a.sm_count[device] <= 0) {
      a.kernel_state[device] = -1;
      a.kernel_why = err("loading the copy kernel", r);
    } else {
      a.kernel[device] = fn;
      a.kernel_state[device] = 1;
    }
  }
  return a.kernel_state[device] == 1 ? a.kernel[device] : nullptr;
}
}  // namespace

int copy_kernel_mode(int mode) {
  Api& a = api();
  std::lock_guard<std::mutex> g(a.mu);
  const int was = a.kernel_mode;
  if (mode >= 0 && mode <= 2) a.kernel_mode = mode;
  return was;
}

std::string copy_kernel_unavailable(int device) {
  Api& a = api();
  if (a.ndev == 0) return a.why;
  if (a.kernel_mode == 0) return "turned off (MCR_CUDA_COPY_KERNEL=0)";
  if (!a.kernel_fns) return "the CUDA driver lacks a function the copy kernel needs";
  try {
    use_device(device);
  } catch (const Error& e) {
    return e.what();
  }
  if (copy_kernel(device)) return "";
  std::lock_guard<std::mutex> g(a.mu);
  return a.kernel_why;
}

CudaCopyStream::~CudaCopyStream() {
  try {
    use_device(device_);
    for (void* st : streams_) api().StreamSynchronize(st);
    if (ranges_) api().MemFree(CUdeviceptr(ranges_));
    for (void* e : forks_) api().EventDestroy(e);
    for (void* st : streams_) api().StreamDestroy(st);
  } catch (const Error&) {
  }
}

// CUmemcpyAttributes (cuda.h, CUDA 12.8+): source access order, two location hints, flags.
struct BatchAttrs {
  int src_access_order;
  int src_loc[2];
  int dst_loc[2];
  unsigned flags;
};
constexpr int kSrcAccessOrderStream = 1;  // CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
// Below this many bytes a call stays on one stream: the fork and join cost more than the
// overlap wins.
constexpr uint64_t kSpreadMinBytes = 4ull << 20;

void CudaCopyStream::issue(void* stream, const Copy* c, size_t n) {
  Api& a = api();
  if (a.MemcpyBatchAsync && n > 1) {
    // One call for the batch: thousands of block-sized copies cost one launch, not one each.
    std::vector<CUdeviceptr> dst(n), src(n);
    std::vector<size_t> len(n);
    for (size_t i = 0; i < n; ++i) {
      dst[i] = c[i].dst;
      src[i] = c[i].src;
      len[i] = c[i].len;
    }
    BatchAttrs attrs{kSrcAccessOrderStream, {0, 0}, {0, 0}, 0};
    size_t first = 0;
    if (a.MemcpyBatchAsync(dst.data(), src.data(), len.data(), n, &attrs, &first, 1, stream) == 0) return;
    // Refused (an older driver's rules, a pointer kind it does not take): one copy each.
  }
  for (size_t i = 0; i < n; ++i)
    check("cuMemcpyAsync", a.MemcpyAsync(CUdeviceptr(c[i].dst), CUdeviceptr(c[i].src), c[i].len, stream));
}

bool CudaCopyStream::launch(const std::vector<Copy>& copies) {
  Api& a = api();
  CUfunction fn = copy_kernel(device_);
  if (!fn || copies.size() > 0xffffffffull) return false;
  static_assert(sizeof(Copy) == 24, "the kernel reads {dst, src, len} as three 64-bit words");
  const size_t bytes = copies.size() * sizeof(Copy);
  void* main = streams_[0];
  if (bytes > ranges_cap_) {
    // The old buffer may still be read by a kernel queued before: let it finish first.
    if (ranges_) {
      check("cuStreamSynchronize", a.StreamSynchronize(main));
      a.MemFree(CUdeviceptr(ranges_));
      ranges_ = 0;
      ranges_cap_ = 0;
    }
    size_t cap = 64 << 10;
    while (cap < bytes) cap *= 2;
    CUdeviceptr p = 0;
    if (a.MemAlloc(&p, cap) != 0) return false;
    ranges_ = uintptr_t(p);
    ranges_cap_ = cap;
  }
  // From pageable memory the driver takes a copy before returning, so `copies` may go;
  // on the main stream, after the previous launch that read the buffer.
  check("cuMemcpyHtoDAsync", a.MemcpyHtoDAsync(CUdeviceptr(ranges_), copies.data(), bytes, main));
  CUdeviceptr arg0 = CUdeviceptr(ranges_);
  unsigned arg1 = unsigned(copies.size());
  void* params[] = {&arg0, &arg1};
  const unsigned grid = unsigned(std::min<size_t>(copies.size(), size_t(a.sm_count[device_]) * 8));
  check("cuLaunchKernel", a.LaunchKernel(fn, grid, 1, 1, 256, 1, 1, 0, main, params, nullptr));
  ++launches_;
  return true;
}

void CudaCopyStream::copy_many(std::vector<Copy> copies, bool addressable) {
  coalesce(copies);
  if (copies.empty()) return;
  use_device(device_);
  Api& a = api();
  uint64_t total = 0;
  for (auto& c : copies) total += c.len;
  const bool kernel = addressable && copies.size() >= 2 &&
                      (a.kernel_mode == 1 ||
                       (a.kernel_mode == 2 && copies.size() >= kKernelMinCopies &&
                        total / copies.size() <= kKernelMaxMeanBytes));
  if (kernel && launch(copies)) {
    copies_ += copies.size();
    bytes_ += total;
    return;
  }
  size_t lanes = streams_.size();
  if (lanes > copies.size()) lanes = copies.size();
  if (lanes <= 1 || total < kSpreadMinBytes) {
    issue(streams_[0], copies.data(), copies.size());
  } else {
    // Fork: each side lane starts after what the main stream holds (markers included).
    check("cuEventRecord", a.EventRecord(forks_[0], streams_[0]));
    size_t begin = 0;
    uint64_t done = 0;
    for (size_t l = 0; l < lanes; ++l) {
      // slice l ends where the bytes so far reach (l + 1) / lanes of the total
      const uint64_t goal = total * (l + 1) / lanes;
      size_t end = begin;
      while (end < copies.size() && (done < goal || end == begin)) done += copies[end++].len;
      if (l + 1 == lanes) {
        for (; end < copies.size(); ++end) done += copies[end].len;
      }
      if (end == begin) continue;
      if (l > 0) check("cuStreamWaitEvent", a.StreamWaitEvent(streams_[l], forks_[0], 0));
      issue(streams_[l], copies.data() + begin, end - begin);
      if (l > 0) {  // join: the main stream waits for this lane
        check("cuEventRecord", a.EventRecord(forks_[l], streams_[l]));
        check("cuStreamWaitEvent", a.StreamWaitEvent(streams_[0], forks_[l], 0));
      }
      begin = end;
    }
  }
  copies_ += copies.size();
  bytes_ += total;
}

void CudaCopyStream::wait_marker(const Marker& m) {
  use_device(device_);
  // the main stream: every side lane forks from it after this
  check("cuStreamWaitEvent", api().StreamWaitEvent(streams_[0], m.event(), 0));
}

void CudaCopyStream::synchronize() {
  use_device(device_);
  // the main stream has joined every lane's copies
  check("cuStreamSynchronize", api().StreamSynchronize(streams_[0]));
}

// ---- HostCopyStream ---------------------------------------------------------------------

HostCopyStream::HostCopyStream() : worker_([this] { run(); }) {}

HostCopyStream::~HostCopyStream() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

void HostCopyStream::copy_many(std::vector<Copy> copies, bool) {
  coalesce(copies);
  for (auto& c : copies) {
    ++copies_;
    bytes_ += c.len;
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    queue_.push_back(std::move(copies));
  }
  cv_.notify_one();
}

void HostCopyStream::run() {
  for (;;) {
    std::vector<Copy> batch;
    {
      std::unique_lock<std::mutex> g(mu_);
      cv_.wait(g, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ with nothing left
      batch = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    for (auto& c : batch)
      memcpy(reinterpret_cast<void*>(c.dst), reinterpret_cast<const void*>(c.src), c.len);
    {
      std::lock_guard<std::mutex> g(mu_);
      busy_ = false;
    }
    idle_cv_.notify_all();
  }
}

void HostCopyStream::synchronize() {
  std::unique_lock<std::mutex> g(mu_);
  idle_cv_.wait(g, [this] { return queue_.empty() && !busy_; });
}

}  // namespace mcr::cuda
