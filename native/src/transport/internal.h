// Internals of the transport engine shared by its translation units.
#pragma once

#include <ucp/api/ucp.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "mcr/transport.h"

namespace mcr {

// ---- wire format (little-endian, same-architecture peers) ---------------------------
enum AmId : unsigned {
  kAmHello = 21,     // hdr HelloHdr, data = sender's full address (engines without a secret)
  kAmHelloAck = 22,  // hdr RepHdr
  kAmRpcReq = 23,    // hdr RpcReqHdr, data = payload
  kAmRpcRep = 24,    // hdr RepHdr, data = reply (or error message)
  kAmPushReq = 25,   // hdr PushHdr, data = reader rkey + Extent[n]
  // The authenticated handshake (auth.cpp): AUTH1 (initiator -> responder, no data),
  // AUTH_RESP (responder -> initiator over UCP's reply endpoint, no data), AUTH2
  // (initiator -> responder, data = initiator's full address), then kAmHelloAck.
  kAmAuth1 = 26,     // hdr Auth1Hdr
  kAmAuthResp = 27,  // hdr AuthRespHdr
  kAmAuth2 = 28,     // hdr Auth2Hdr, data = sender's full address
};

constexpr size_t kTokLen = 16;    // session token carried by every message after the handshake
constexpr size_t kNonceLen = 16;
constexpr size_t kMacLen = 32;    // HMAC-SHA256

#pragma pack(push, 1)
struct HelloHdr {
  uint64_t uid;
  uint64_t call_id;
};
struct RpcReqHdr {
  uint64_t uid;
  uint64_t call_id;
  uint32_t handler_id;
  uint32_t flags;
  uint8_t tok[kTokLen];
};
struct RepHdr {
  uint64_t uid;
  uint64_t call_id;
  int32_t code;
  uint32_t pad;  // kRepReject: the callee cannot answer over its own endpoint
  uint8_t tok[kTokLen];
};
constexpr uint32_t kRepReject = 1;
struct PushHdr {
  uint64_t uid;
  uint64_t call_id;
  uint32_t rkey_len;
  uint32_t n_ext;
  uint8_t tok[kTokLen];
};
struct Extent {
  uint64_t src;  // owner's address
  uint64_t dst;  // reader's address
  uint64_t len;
};
struct Auth1Hdr {
  uint64_t uid;  // initiator
  uint64_t call_id;
  uint8_t nonce_a[kNonceLen];
};
struct AuthRespHdr {
  uint64_t uid;  // responder
  uint64_t call_id;
  int32_t code;  // kOk, or kAuthFailed: the responder has no secret (mac is zero)
  uint32_t pad;
  uint8_t nonce_b[kNonceLen];
  uint8_t mac[kMacLen];  // HMAC(K, "resp" | uid_a | uid_b | nonce_a | nonce_b)
};
struct Auth2Hdr {
  uint64_t uid;  // initiator
  uint64_t call_id;
  uint8_t nonce_b[kNonceLen];
  uint8_t mac[kMacLen];  // HMAC(K, "init" | uid_a | uid_b | nonce_a | nonce_b | SHA256(data))
};
#pragma pack(pop)

constexpr uint32_t kAddrMagic = 0x3152434d;  // "MCR1"
constexpr size_t kMaxExtentsPerPush = 1024;
// Bounds on what comes off the wire, checked before anything is allocated for it.
constexpr size_t kMaxAddressBytes = 64u << 10;       // a full engine address
constexpr size_t kMaxLaneAddressBytes = 16u << 10;   // one UCX worker address
constexpr size_t kMaxAmPayload = 512ull << 20;       // an RPC request or reply
constexpr size_t kMaxRkeyBytes = 64u << 10;

struct Lane;
using Clock = std::chrono::steady_clock;

// Owns the ucp_context: released (ucp_cleanup) after the engine and its last region.
struct CtxHolder {
  ucp_context_h ctx = nullptr;
  ~CtxHolder() {
    if (ctx) ucp_cleanup(ctx);
  }
};
inline ucp_context_h ctx_of(const std::shared_ptr<void>& h) {
  return static_cast<CtxHolder*>(h.get())->ctx;
}

Code code_from_ucs(ucs_status_t st);
bool in_progress_context();  // true inside UCP progress / lane tasks on this thread
// Same-host identity: boot id + pid namespace (peers.cpp). Peers with the same id share
// /proc, so a dead process is seen by its pid disappearing.
std::string local_host_id();
// An arena in a memfd (alloc_arena) travels with a trailer on its rkey: the owner's pid,
// the memfd's number and inode, the arena's address and length, then the magic. A peer on
// the same host maps /proc/<pid>/fd/<fd> once its inode matches (memory.cpp, peer.cpp).
constexpr char kHostShmMagic[9] = "MCRSHM01";
constexpr size_t kHostShmTrailer = 5 * 8 + 8;
struct HostShm {
  uint32_t pid;
  int fd;
  uint64_t ino, addr, len;
};
std::string host_shm_export(int fd, uintptr_t addr, uint64_t len);
bool host_shm_split(std::string* rkey, HostShm* out);  // strips the trailer if there is one
uint64_t process_start_time(uint32_t pid);  // 0 if the process is gone (or a zombie)
std::string ucs_msg(const char* what, ucs_status_t st);

// Posts an active message; `data` moves into the send context and lives until the send
// completes. fail_call_id != 0: a pending call failed if the send fails later. Returns
// false (and *err) if the send failed immediately. Lane::mu must be held.
bool am_send_locked(EngineCore* c, Lane* lane, void* ep, unsigned id, const void* hdr,
                    size_t hlen, std::string data, uint64_t fail_call_id, bool reply_flag,
                    ucs_status_t* err);
// A cached reader rkey on the owner side of the push path (Peer::push_rkeys_ values).
void destroy_push_rkey(void* entry);

// ---- lane: one UCP worker, its lock and its progress thread ---------------------------
struct Lane {
  EngineCore* core = nullptr;
  int idx = 0;
  ucp_worker_h worker = nullptr;
  std::string worker_address;
  std::mutex mu;  // guards the worker and everything UCP calls back into
  int worker_fd = -1, wake_fd = -1, ep_fd = -1;
  std::thread thread;
  bool stop = false;  // under mu
  // Work queued by UCP callbacks, run right after ucp_worker_progress returns (under mu).
  std::vector<std::function<void()>> deferred;
  // Work posted by threads that do not hold mu (run by the progress thread, under mu).
  std::mutex task_mu;
  std::vector<std::function<void()>> tasks;
  bool tasks_closed = false;  // under task_mu
  std::atomic<int> outstanding{0};  // in-flight requests: the progress thread lingers
  // Who polls the worker: at most one of {progress thread, callers} at a time.
  std::atomic<bool> thread_polling{false};
  std::mutex poll_mu;              // guards the two below; taken before mu
  int callers_polling = 0;
  bool fd_watched = true;          // worker_fd is in ep_fd

  void progress_locked();          // progress until idle, run deferred work
  unsigned progress_count_locked();
  bool begin_caller_poll();        // false: the progress thread is polling, just wait
  void end_caller_poll();          // re-arms the worker and hands it back
  bool try_progress();             // non-blocking: false if another thread holds mu
  void arm_for_sleep();            // leave the worker armed so the progress thread wakes
  void post_task(std::function<void()> fn);
  void wake();
  void run();                      // progress thread body
  void run_tasks_locked();
};

// ---- staging: a registered bounce buffer for unregistered user memory ----------------
class Staging {
 public:
  // First-fit allocator over [0, size) in 4 KiB units; blocks while full.
  void init(std::shared_ptr<Region> region);
  bool ready() const { return region_ != nullptr; }
  // Returns the offset, or -1 on timeout / shutdown.
  int64_t alloc(uint64_t len, Clock::time_point deadline);
  void free(int64_t off, uint64_t len);
  void shutdown();
  Region* region() const { return region_.get(); }
  std::shared_ptr<Region> region_ptr() const { return region_; }
  uint64_t piece_max() const { return piece_max_; }

 private:
  std::shared_ptr<Region> region_;
  uint64_t piece_max_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, uint64_t> free_;  // offset -> length
  bool shutdown_ = false;
};

// A pending reply (RPC, push or hello), keyed by call id.
struct Pending {
  std::shared_ptr<Op> op;
  uint64_t peer_uid = 0;
  // For push requests: runs on reply or failure before op->sub_done (copy-back, release).
  std::function<void(Code)> on_reply;
  bool is_call = false;
  int lane = -1;  // calls: the lane the caller sent on (and spins on)
};

struct Stats {
  std::atomic<uint64_t> read_memcpy_bytes{0}, read_get_bytes{0}, read_push_bytes{0};
  std::atomic<uint64_t> write_memcpy_bytes{0}, write_put_bytes{0};
  std::atomic<uint64_t> staged_bytes{0}, push_served_bytes{0}, write_gathered_bytes{0};
  std::atomic<uint64_t> read_push_joined_bytes{0};
  // Device memory copied by the CUDA driver to or from a mapped remote arena (same host).
  std::atomic<uint64_t> read_cuda_bytes{0}, write_cuda_bytes{0};
  std::atomic<uint64_t> cuda_kernel_launches{0};  // device copies done by the copy kernel (batches)
  std::atomic<uint64_t> cuda_pin_refused{0};  // mapped arenas the driver would not pin  // pushed reads joined to the extent before
  std::atomic<uint64_t> pushes_sent{0};             // push requests (one per lane and batch)
  std::atomic<uint64_t> calls_sent{0}, calls_served{0}, peers_failed{0};
  // Replies to our calls that arrived on another lane than the call's (its caller's spin
  // could not see them; the lane's progress thread had to wake). Should stay 0.
  std::atomic<uint64_t> replies_off_lane{0};
  // Messages dropped unread: no valid session token, a handshake step that failed its
  // check (bad MAC, unknown or reused nonce), or an unauthenticated HELLO.
  std::atomic<uint64_t> auth_rejected{0};
  std::atomic<uint64_t> auth_handshakes{0};  // handshakes completed as responder
  // Each step of the handshake as it arrives (auth.cpp): where a connect that timed out
  // stopped. Responder: AUTH1 in, HELLO_ACK out; initiator: AUTH_RESP in.
  std::atomic<uint64_t> hs_auth1_received{0}, hs_resp_received{0}, hs_acks_sent{0};
  std::atomic<uint64_t> malformed_dropped{0};  // messages failing a size or format check
};

// Plain and non-temporal copies (copy.cpp).
void copy_plain(char* dst, const char* src, size_t len);
void copy_stream(char* dst, const char* src, size_t len);
// copy_plain / copy_stream that also return the standard CRC-32C of the bytes, each piece
// checksummed from the source while it is in cache (copy.cpp).
uint32_t copy_crc(char* dst, const char* src, size_t len, bool stream);
constexpr size_t kStreamMinBytes = 256u << 10;  // smaller writes stay in cache

// Splits large memcpy transfers over helper threads (copy.cpp).
class CopyPool {
 public:
  explicit CopyPool(int helpers);
  ~CopyPool();
  // stream: non-temporal stores (writes into a peer's arena). crc: if given, the standard
  // CRC-32C of the bytes, taken in the copy (each piece's, combined in order).
  void copy(char* dst, const char* src, size_t len, bool stream, uint32_t* crc = nullptr);

 private:
  struct Piece {
    char* dst = nullptr;
    const char* src = nullptr;
    size_t len = 0;
    std::atomic<int>* left = nullptr;
    bool stream = false;
    uint32_t* crc = nullptr;  // where this piece's CRC goes (null: none wanted)
  };
  void start_locked();
  void run();
  static void do_piece(const Piece& p);
  const int helpers_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Piece> queue_;
  std::vector<std::thread> threads_;
  bool stop_ = false;
};

class EngineCore : public std::enable_shared_from_this<EngineCore> {
 public:
  explicit EngineCore(const EngineConfig& cfg);
  ~EngineCore();
  void start();  // context, workers, threads (after make_shared)
  void close();
  void check_open() const;
  void progress_locked_external(Lane* l);

  // memory.cpp
  std::shared_ptr<Region> map_memory(uintptr_t addr, uint64_t len, bool allocate, MemType mt,
                                     bool track);
  // Finds the live region containing [addr, addr+len): the region, or nullptr if the range
  // is unregistered. Throws kNotRegistered for a closed region or a straddling range.
  std::shared_ptr<Region> find_local(uintptr_t addr, uint64_t len, bool for_remote);
  std::shared_ptr<Region> find_local_locked(uintptr_t addr, uint64_t len, bool for_remote);  // regions_mu held
  void region_closed(Region* r);
  void region_forgotten(Region* r);
  void ensure_staging();

  // peer.cpp
  std::shared_ptr<Peer> connect(const std::string& address, double timeout_s);
  std::shared_ptr<Peer> find_peer(uint64_t uid);
  std::shared_ptr<Peer> peer_from_hello(uint64_t uid, const std::string& address);
  ucs_status_t create_ep_locked(Lane* lane, Peer* peer);
  void peer_failed(Peer* peer, Code code, const std::string& msg);
  std::shared_ptr<RemoteRegion> import_remote(const std::shared_ptr<Peer>& peer,
                                              const std::string& rkey, uint64_t base,
                                              uint64_t len, const std::string& map_path,
                                              uint64_t map_offset, bool populate);

  // rma.cpp
  std::shared_ptr<Op> submit(std::vector<IoOp>& ops, bool is_read);
  void post_push(Lane* lane, const std::shared_ptr<Peer>& peer, const std::string& rkey,
                 std::vector<Extent> ext, const std::shared_ptr<Op>& op,
                 std::function<void(Code)> on_reply);
  void orphan_xfers(Peer* peer, const std::string& msg);  // peer died: fail its transfers
  void serve_push_locked(Lane* lane, const std::shared_ptr<Peer>& peer, const PushHdr& hdr,
                         std::string body);

  // rpc.cpp
  void register_am_handlers(Lane* lane);
  std::shared_ptr<Op> call_async(const std::shared_ptr<Peer>& peer, uint32_t handler_id,
                                 const char* data, size_t len);
  void send_reply_locked(Lane* lane, Peer* peer, uint64_t call_id, Code code, std::string data,
                         unsigned am_id = kAmRpcRep);
  void add_pending(uint64_t id, Pending p);
  bool take_pending(uint64_t id, Pending* out);
  void fail_pending_for(uint64_t peer_uid, Code code, const std::string& msg);
  bool next_request(IncomingRequest* out, double timeout_s);
  void reply(const IncomingRequest& req, Code code, const char* data, size_t len);

  void watch_peers();  // lane 0: fail same-host peers whose process is gone

  EngineConfig cfg;
  uint64_t uid = 0;
  std::string host_id;
  uint32_t pid = 0;
  uint64_t start_time = 0;
  Clock::time_point last_watch{};
  std::string address;
  std::shared_ptr<void> ctx_holder;  // owns the ucp_context (ucp_cleanup on release)
  ucp_context_h ctx = nullptr;
  std::vector<std::unique_ptr<Lane>> lanes;
  std::atomic<bool> closing{false};
  std::atomic<bool> closed{false};
  std::atomic<int> active{0};  // API calls in progress (close waits for them)
  std::atomic<uint64_t> next_id{1};
  std::atomic<uint32_t> lane_rr{0};

  std::mutex peers_mu;
  std::unordered_map<uint64_t, std::shared_ptr<Peer>> peers;
  std::mutex rr_all_mu;
  std::vector<std::weak_ptr<RemoteRegion>> rr_all;  // for close()

  std::mutex pending_mu;
  std::unordered_map<uint64_t, Pending> pending;

  std::shared_mutex regions_mu;
  std::map<uintptr_t, std::vector<std::shared_ptr<Region>>> regions;  // start -> live regions
  std::map<uint64_t, std::pair<uintptr_t, uint64_t>> tombstones;     // region id -> range
  std::mutex staging_mu;
  Staging staging;

  std::shared_mutex handlers_mu;
  std::unordered_map<uint32_t, NativeHandler> native_handlers;
  std::unordered_set<uint32_t> external_handlers;
  std::mutex inq_mu;
  std::condition_variable inq_cv;
  std::deque<IncomingRequest> inq;

  // auth.cpp. The secret is set once, before the engine connects or serves; with none
  // set, tokens are zero and unchecked (the engine behaves as before authentication).
  void set_auth_secret(const std::string& secret);
  bool auth_on() const { return auth_on_.load(std::memory_order_acquire); }
  // The token messages from engine `from` to engine `to` carry: HMAC(K, "tok"|from|to).
  void make_token(uint64_t from, uint64_t to, uint8_t* out) const;
  void init_peer_tokens(Peer* p) const;
  // The live peer a message claims to come from, if its token is valid (always, with
  // auth off). Otherwise nullptr; *tok_ok says whether the token itself was valid (an
  // authenticated sender we no longer know: it may be told to reconnect).
  std::shared_ptr<Peer> auth_peer(uint64_t uid, const uint8_t* tok, bool* tok_ok);
  bool token_valid(uint64_t from, const uint8_t* tok) const;
  // Initiator side: sends AUTH1 on a lane, registers the pending handshake.
  bool send_auth1_locked(Lane* lane, const std::shared_ptr<Peer>& peer, uint64_t call_id,
                         ucs_status_t* err);
  // Responder: answers AUTH1 over UCP's reply endpoint with its nonce and MAC.
  void on_auth1(Lane* lane, const Auth1Hdr& h, const ucp_am_recv_param_t* param);
  // Initiator: checks the responder's MAC, then sends AUTH2 with its address.
  void on_auth_resp(Lane* lane, const AuthRespHdr& h, const ucp_am_recv_param_t* param);
  struct Challenge;
  // Responder: the challenge an AUTH2 answers, removed (a nonce is answered once).
  bool take_challenge(const Auth2Hdr& h, Challenge* out);
  bool verify_auth2(const Auth2Hdr& h, const Challenge& ch, const std::string& addr);
  // Responder, after the checks: parses the address, creates the endpoint back, acks.
  void finish_hello_locked(Lane* lane, uint64_t uid, uint64_t call_id, const std::string& addr);
  void debug_send_raw(const std::string& address, unsigned am_id, const std::string& header,
                      const std::string& data);
  [[noreturn]] void debug_die_mid_message(const std::string& address);

  std::atomic<bool> auth_on_{false};
  std::string auth_key;  // K (read-only once auth_on_ is set)
  struct Challenge {     // responder: a nonce it issued, answered at most once
    uint64_t uid = 0;
    uint8_t nonce_a[kNonceLen];
    Clock::time_point issued;
  };
  struct Handshake {     // initiator: an AUTH1 in flight
    uint64_t peer_uid = 0;
    uint8_t nonce_a[kNonceLen];
    int lane = 0;
  };
  std::mutex auth_mu;  // leaf, like peers_mu
  std::map<std::string, Challenge> challenges;  // by nonce_b
  std::unordered_map<uint64_t, Handshake> handshakes;  // by call id
  std::string debug_auth2_hdr, debug_auth2_data;  // the last AUTH2 sent (replay tests), under auth_mu

  Stats st;
  std::unique_ptr<CopyPool> copier;  // num_lanes - 1 helpers (none with one lane)
};

// RAII guard for public API calls: rejects calls after close, lets close() wait for
// calls in progress.
class ActiveGuard {
 public:
  explicit ActiveGuard(EngineCore* c);
  ~ActiveGuard() { c_->active.fetch_sub(1); }

 private:
  EngineCore* c_;
};

inline Clock::time_point deadline_after(double timeout_s) {
  if (timeout_s < 0 || timeout_s > 1e8) return Clock::time_point::max();
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(timeout_s));
}

}  // namespace mcr
