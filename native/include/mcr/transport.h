// mooncake-ray data plane: a UCP (UCX) engine for one-sided transfers and RPC.
//
// Object graph (shared_ptr unless noted):
//
//   Engine ──► EngineCore ──► Lane[num_lanes]     one ucp_worker + progress thread each
//                  │  ├──► Peer (by remote engine uid) ──► ucp_ep per lane
//                  │  │        └──► RemoteRegion cache ──► ucp_rkey per lane (+ rkey_ptr mapping)
//                  │  ├──► Region (local, by address) ──► ucp_mem_h
//                  │  └──► Staging (registered bounce buffer for unregistered memory)
//                  └──► ContextHolder (ucp_context; outlives the engine while arena views live)
//
// Threading: every public method may be called from any thread. Each lane's worker is
// guarded by Lane::mu; UCP callbacks run with it held. Lock order (outer → inner):
// Lane::mu → {peers_mu, pending_mu, regions_mu, handlers_mu, inq_mu, task_mu} (the latter
// are leaves: never take a Lane::mu while holding one of them).
//
// Errors: every failure throws mcr::Error with a Code from status.h.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "mcr/status.h"

namespace mcr {

class EngineCore;
class Op;
class Peer;
class Region;
class RemoteRegion;

enum class MemType { kHost = 0, kCuda = 1 };

// How a read reaches remote memory. kAuto picks per remote region (see RemoteRegion).
enum class ReadPath { kAuto = 0, kMemcpy = 1, kPush = 2, kGet = 3 };
enum class WritePath { kAuto = 0, kMemcpy = 1, kPut = 2 };

const char* read_path_name(ReadPath p);
const char* write_path_name(WritePath p);

struct EngineConfig {
  std::string name = "engine";
  std::string protocol = "auto";  // auto | tcp | shm | rdma
  std::vector<std::string> devices;  // UCX_NET_DEVICES; empty = UCX default
  int num_lanes = 1;
  std::vector<std::pair<std::string, std::string>> ucx_options;  // UCX settings, no UCX_ prefix
  ReadPath read_mode = ReadPath::kAuto;
  WritePath write_mode = WritePath::kAuto;
  size_t chunk_bytes = 4u << 20;     // stripe unit over lanes / staging piece size
  size_t stripe_min_bytes = 1u << 20;  // below this a transfer stays on one lane
  size_t staging_bytes = 64u << 20;  // bounce buffer for unregistered memory (lazy)
  size_t push_min_bytes = 32u << 10;  // auto mode: smaller reads use get even where push wins
  int spin_us = 50;                  // a waiter progresses its lanes this long before sleeping
  // While requests are in flight, a progress thread polls until idle this long.
  int inflight_linger_us = 100;
  // A progress thread woken by events polls until none came for this long before it
  // sleeps again (0: sleep at once). For servers (the master, store nodes).
  int server_linger_us = 0;
  double keepalive_s = 1.0;          // liveness checks (pid watchdog, UCX keepalive)
  std::string error_mode = "auto";   // endpoint error mode: auto | peer | none (see Peer)
};
// (The Python side binds this struct as ``EngineConfig`` and fills it by field name from
// mooncake_ray.config.TransportConfig, where each setting's default and doc live: a field
// added here is carried once TransportConfig has a field of the same name.)

// One transfer: [remote_offset, +length) of rr <-> [local_addr, +length).
struct IoOp {
  std::shared_ptr<RemoteRegion> rr;
  uint64_t remote_offset = 0;
  uintptr_t local_addr = 0;
  uint64_t length = 0;
  // Writes with want_crc: where this process copies the bytes itself (the peer's arena
  // mapped here, or a gathered staging piece), the CRC-32C of the bytes is taken in that
  // copy and left in crc (crc_ok true) when submit returns. UCX transfers, device memory
  // and reads leave crc_ok false.
  bool want_crc = false;
  bool crc_ok = false;
  uint32_t crc = 0;
};

// One call of Engine::call_many, and its outcome.
struct CallRequest {
  std::shared_ptr<Peer> peer;
  uint32_t handler_id = 0;
  std::string payload;
};
struct CallOutcome {
  Code code = Code::kOk;
  std::string data;  // the reply (code kOk), else the error message
};

// A request for a non-native (e.g. Python) handler, handed out by Engine::next_request.
struct IncomingRequest {
  uint64_t peer_uid = 0;
  uint64_t call_id = 0;
  uint32_t lane = 0;
  uint32_t handler_id = 0;
  std::string payload;
};

// A native handler runs on the progress thread: keep it short and non-blocking.
using NativeHandler = std::function<Code(const std::string& in, std::string* out)>;

// Inside a native handler: keep the request being served to answer it later, from any
// thread, with Engine::reply (its peer_uid, call_id and lane are the token; handler_id and
// payload are left empty). The handler's own return is then not sent. Outside a handler:
// false.
bool hold_current_request(IncomingRequest* out);
// The same token, without keeping the request (false outside a handler).
bool peek_current_request(IncomingRequest* out);

// Delivers completion tokens to an event loop: an eventfd plus a queue.
class Notifier {
 public:
  Notifier();
  ~Notifier();
  int fd() const { return fd_; }
  void push(uint64_t token);
  std::vector<uint64_t> drain();

 private:
  int fd_ = -1;
  std::mutex mu_;
  std::vector<uint64_t> tokens_;
};

// A local registered memory region.
class Region {
 public:
  ~Region();
  uint64_t id() const { return id_; }
  uintptr_t addr() const { return addr_; }
  uint64_t length() const { return length_; }
  bool is_arena() const { return arena_; }
  MemType mem_type() const { return mem_type_; }
  const std::string& rkey() const { return rkey_; }
  bool closed() const { return closed_.load(); }
  // Deregisters. Waits up to wait_s for in-flight transfers touching the region; returns
  // false if some are still running (the caller must keep the memory alive until then).
  bool close(double wait_s);
  // A view keeps the memory mapped after close() until the view is dropped.
  void add_view();
  void drop_view();

  // internal
  struct Private;
  Region(std::shared_ptr<EngineCore> core, uint64_t id, uintptr_t addr, uint64_t len, bool arena,
         MemType mt, void* memh, std::string rkey);
  void* memh() const { return memh_; }
  void inflight_add() { inflight_.fetch_add(1); }
  void inflight_sub();
  void unmap_now();  // engine close
  std::atomic<int> cuda_device_{-2};  // cuda::device_of(addr_), asked at the first device copy
  int shm_fd_ = -1;  // an arena's memfd (alloc_arena): unmapped and closed with the region

 private:
  void maybe_unmap_locked();
  std::weak_ptr<EngineCore> core_;
  std::shared_ptr<void> ctx_;  // keeps the ucp_context alive
  uint64_t id_;
  uintptr_t addr_;
  uint64_t length_;
  bool arena_;
  MemType mem_type_;
  void* memh_;
  std::string rkey_;
  std::atomic<bool> closed_{false};
  std::atomic<int> inflight_{0};
  std::mutex mu_;
  int views_ = 0;
  bool unmapped_ = false;
};

// A connection to a remote engine (one endpoint per lane).
class Peer {
 public:
  ~Peer();
  uint64_t uid() const { return uid_; }
  const std::string& address() const { return address_; }
  bool alive() const { return !dead_.load(); }
  // Checks now what the watchdog checks every keepalive_s/2: a peer on this host whose
  // process is gone is marked dead (its calls fail). False if the peer is dead.
  bool check_process();
  std::string name() const { return name_; }

  // internal (see peer.cpp)
  Peer(std::shared_ptr<EngineCore> core, uint64_t uid, std::string address,
       std::vector<std::string> lane_addrs, std::string name);
  std::shared_ptr<EngineCore> core_;
  uint64_t uid_;
  std::string address_;
  std::vector<std::string> lane_addrs_;  // remote workers' addresses
  std::string name_;
  std::vector<void*> eps_;               // ucp_ep_h per local lane, under Lane::mu
  std::vector<void*> ep_ctx_;            // error-callback contexts (owned)
  std::vector<int> get_fast_;            // per lane: RMA get avoids tcp (1) or not (0), -1 unknown
  std::atomic<bool> dead_{false};
  std::atomic<bool> hello_done_{false};
  // Session tokens (auth on): carried in messages to the peer / expected from it.
  uint8_t tok_send_[16] = {0};
  uint8_t tok_recv_[16] = {0};
  // Same host (and pid namespace): liveness is watched through the peer's pid
  // (EngineCore::watch_peers), whatever the transport.
  bool same_host_ = false;
  // Endpoint error mode. UCX 1.22 under mode PEER gives up its fast paths: shared memory
  // transports are dropped (no peer-failure support: everything goes over tcp) and tcp
  // put turns into software emulation (~1 GB/s instead of 4+). So by default only RDMA
  // peers on other hosts use PEER; the others use NONE with the error callback still
  // installed (tcp resets are reported through it) plus the pid watchdog.
  bool err_peer_ = false;
  uint32_t pid_ = 0;
  uint64_t start_time_ = 0;
  std::mutex hello_mu_;
  Code death_code_ = Code::kUnreachable;
  std::string death_msg_;
  // import_remote cache: (rkey, base, length) -> region
  std::mutex rr_mu_;
  std::map<std::string, std::shared_ptr<RemoteRegion>> rr_cache_;
  // owner side of the push path: the reader's unpacked rkeys, per lane (under Lane::mu)
  std::vector<std::map<std::string, void*>> push_rkeys_;
  // UCX requests in flight to this peer (rma.cpp XferCtx), failed early if it dies.
  std::mutex xfer_mu_;
  std::unordered_set<void*> xfers_;
};

// A remote region imported from a packed rkey.
class RemoteRegion {
 public:
  ~RemoteRegion();
  uint64_t base() const { return base_; }
  uint64_t length() const { return length_; }
  const std::shared_ptr<Peer>& peer() const { return peer_; }
  const std::string& rkey() const { return rkey_bytes_; }
  ReadPath read_path() const { return read_path_; }
  WritePath write_path() const { return write_path_; }
  bool mapped() const { return ptr_ != nullptr; }
  bool device_mapped() const { return cuda_ptr_ != 0; }  // another process's GPU memory (CUDA IPC)

  // internal
  RemoteRegion(std::shared_ptr<Peer> peer, std::string rkey, uint64_t base, uint64_t len);
  std::shared_ptr<Peer> peer_;
  std::string rkey_bytes_;
  uint64_t base_, length_;
  std::vector<void*> rkeys_;  // ucp_rkey_h per local lane
  char* ptr_ = nullptr;       // rkey_ptr mapping of base_ (same host, shared memory)
  // Or this process's own mapping of the owner's memory file (same host, a registered
  // file in shared memory that UCX cannot map itself): unmapped when the region goes.
  void* file_map_ = nullptr;
  size_t file_map_len_ = 0;
  // Or the owner's device memory, opened here through CUDA IPC (same host; the driver
  // copies to and from it): cuda_ptr_ is base_'s byte, cuda_base_ what ipc_close takes.
  uintptr_t cuda_ptr_ = 0, cuda_base_ = 0;
  ReadPath read_path_ = ReadPath::kGet;
  WritePath write_path_ = WritePath::kPut;
  std::shared_mutex mu_;      // shared: using rkeys/ptr; exclusive: destroying them
  bool destroyed_ = false;
  // ptr_ pinned for CUDA DMA (cuMemHostRegister), done at the first copy between it and
  // device memory: 0 not tried, 1 pinned (unpinned before the mapping goes), -1 refused.
  std::mutex cuda_mu_;
  int cuda_pinned_ = 0;
  bool cuda_addressable_ = false;  // pinned at the same device address (the copy kernel may use it)
  int cuda_device_ = -2;           // the device of cuda_ptr_ (-2: not asked yet)
  void unpin_cuda_locked();
};

// The completion of one user-level operation (a batch of transfers, or one call).
class Op {
 public:
  explicit Op(std::shared_ptr<EngineCore> core);
  ~Op();
  bool done() const { return done_word_.load(std::memory_order_acquire) != 0; }
  // Waits; returns false on timeout (timeout_s < 0: forever). Spins on its lanes first.
  bool wait(double timeout_s);
  Code code() const { return code_; }
  const std::string& message() const { return msg_; }
  // Throws the recorded error, if any (call after done()).
  void check() const;
  std::string take_result() { return std::move(result_); }
  // The caller gives up: late completions no longer copy into user memory, a pending
  // call's reply is dropped. Safe to call at any time.
  void abandon();
  void set_notify(std::shared_ptr<Notifier> n, uint64_t token);

  // internal
  void add_pending(int n = 1) { remaining_.fetch_add(n, std::memory_order_relaxed); }
  void sub_done(Code c = Code::kOk, const std::string& msg = std::string());
  void record_error(Code c, const std::string& msg);
  bool enter_copy();  // false if abandoned
  void exit_copy();
  bool abandoned() const { return (copy_state_.load() & kAbandonBit) != 0; }
  void add_lane(int lane);
  std::string result_;
  uint64_t call_id_ = 0;  // for calls: the pending-map key
  bool is_call_ = false;

 private:
  void finish();
  static constexpr uint32_t kAbandonBit = 1u << 31;
  std::shared_ptr<EngineCore> core_;
  std::atomic<int> remaining_{1};  // 1 = the submission guard
  std::atomic<uint32_t> done_word_{0};
  std::atomic<int> waiters_{0};
  std::atomic<uint32_t> copy_state_{0};
  std::mutex err_mu_;
  Code code_ = Code::kOk;
  std::string msg_;
  uint64_t lanes_mask_ = 0;
  std::mutex notify_mu_;
  std::shared_ptr<Notifier> notifier_;
  uint64_t token_ = 0;
};

class Engine {
 public:
  explicit Engine(const EngineConfig& cfg);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const std::string& address() const;
  uint64_t uid() const;
  const EngineConfig& config() const;

  std::shared_ptr<Region> alloc_arena(uint64_t size);
  std::shared_ptr<Region> register_memory(uintptr_t addr, uint64_t length, MemType mt);

  std::shared_ptr<Peer> connect(const std::string& address, double timeout_s);
  // map_path: where UCX cannot map the remote memory itself (registered, not allocated by
  // it), the file holding it on this host, and ``map_offset`` the file offset of ``base``
  // (the caller checked it is the owner's file): mapped here for same-host memcpy.
  // populate: fill this process's page tables for a same-host mapping now (reads and
  // writes of the whole region to come); false leaves them to the first touch of each
  // page (a few writes into a large region, e.g. a drain's).
  std::shared_ptr<RemoteRegion> import_remote(const std::shared_ptr<Peer>& peer,
                                              const std::string& rkey, uint64_t base,
                                              uint64_t length, const std::string& map_path = "",
                                              uint64_t map_offset = 0, bool populate = true);

  std::shared_ptr<Op> submit(std::vector<IoOp>& ops, bool is_read);

  std::shared_ptr<Op> call_async(const std::shared_ptr<Peer>& peer, uint32_t handler_id,
                                 const char* data, size_t len);
  // Issues every call at once, then waits for all of them within one deadline (timeout_s
  // < 0: forever). Never throws for one call: a call that cannot be sent, fails, or is not
  // answered in time (it is then abandoned: a late reply is dropped) has its own outcome.
  std::vector<CallOutcome> call_many(const std::vector<CallRequest>& calls, double timeout_s);

  void serve_native(uint32_t handler_id, NativeHandler fn);
  void serve_external(uint32_t handler_id);
  void unserve(uint32_t handler_id);
  // Blocks until a request for an external handler arrives (true), the timeout passes or
  // the engine closes (false).
  bool next_request(IncomingRequest* out, double timeout_s);
  void reply(const IncomingRequest& req, Code code, const char* data, size_t len);

  std::map<std::string, uint64_t> stats() const;
  // The memory types UCX can register in this engine ("host", and "cuda" where a UCX built
  // with CUDA found a GPU), from ucp_context_query.
  std::vector<std::string> memory_types() const;
  // The per-cluster secret (>= 16 bytes), set before the engine connects or serves; it
  // cannot be changed afterwards. Peers must then prove it in a mutual challenge-response
  // handshake, and every later message carries a session token derived from it.
  void set_auth_secret(const std::string& secret);
  bool auth_enabled() const;
  // Test hooks: send one raw active message to the engine at `address` (no handshake),
  // and the last AUTH2 (header, data) this engine sent.
  void debug_send_raw(const std::string& address, unsigned am_id, const std::string& header,
                      const std::string& data);
  // Sends a message to the connected engine at `address` whose payload, packed by UCX into
  // the transport's send buffer (a shared-memory FIFO slot, a socket buffer), SIGKILLs this
  // process halfway: a sender dying inside a message. Never returns.
  [[noreturn]] void debug_die_mid_message(const std::string& address);
  std::pair<std::string, std::string> debug_last_auth2() const;
  void close();
  bool closed() const;

 private:
  std::shared_ptr<EngineCore> core_;
};

}  // namespace mcr
