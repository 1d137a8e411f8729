// Peer authentication: a per-cluster secret K, a mutual challenge-response handshake
// before any endpoint is created from a peer's address, and a session token in the
// header of every later message.
//
// Handshake (on every lane the initiator A connects; B is the responder):
//   A -> B  AUTH1     {uid_a, call, nonce_a}                     (no address)
//   B -> A  AUTH_RESP {uid_b, call, nonce_b, HMAC(K, "resp"|uid_a|uid_b|nonce_a|nonce_b)}
//           over UCP's reply endpoint: B creates nothing for A yet. B keeps nonce_b as an
//           open challenge (bounded table, expires), answerable once.
//   A       checks the MAC (constant time): B knows K.
//   A -> B  AUTH2     {uid_a, call, nonce_b, HMAC(K, "init"|uid_a|uid_b|nonce_a|nonce_b|
//                      SHA256(address_a))}, data = address_a
//   B       takes the challenge nonce_b out of its table (a replayed AUTH2 finds none),
//           checks the MAC; only then parses address_a and calls ucp_ep_create.
//   B -> A  HELLO_ACK over B's new endpoint, carrying B's token to A.
//
// Session tokens: messages from engine S to engine R carry HMAC(K, "tok"|uid_S|uid_R)
// truncated to 16 bytes. Uids are 64 random bits drawn at engine start, so a token is
// specific to one ordered pair of engine instances. They do not depend on the handshake's
// nonces on purpose: two engines may run handshakes in both directions and on several
// lanes at once, and a token that changed with each would race; a receiver can also
// check the token of a sender it no longer knows (and tell it to reconnect) without
// state. Checking one costs a 16-byte constant-time compare against the peer's entry.
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstring>

#include "internal.h"

namespace mcr {

namespace {
constexpr size_t kMaxChallenges = 4096;
constexpr auto kChallengeTtl = std::chrono::seconds(30);

void random_bytes(uint8_t* out, size_t n) {
  if (RAND_bytes(out, int(n)) != 1) throw Error(Code::kInternal, "RAND_bytes failed");
}

// HMAC-SHA256 over the concatenation of the parts.
void hmac(const std::string& key, const std::string& msg, uint8_t out[kMacLen]) {
  unsigned len = 0;
  if (!HMAC(EVP_sha256(), key.data(), int(key.size()),
            reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), out, &len) ||
      len != kMacLen)
    throw Error(Code::kInternal, "HMAC-SHA256 failed");
}

std::string sha256(const std::string& data) {
  unsigned char d[EVP_MAX_MD_SIZE];
  unsigned len = 0;
  if (!EVP_Digest(data.data(), data.size(), d, &len, EVP_sha256(), nullptr))
    throw Error(Code::kInternal, "SHA-256 failed");
  return std::string(reinterpret_cast<char*>(d), len);
}

void put(std::string* s, const void* p, size_t n) { s->append(static_cast<const char*>(p), n); }

// The MAC of the responder's answer and of the initiator's second message.
std::string transcript(const char* label, uint64_t uid_a, uint64_t uid_b, const uint8_t* nonce_a,
                       const uint8_t* nonce_b) {
  std::string m(label, strlen(label) + 1);
  put(&m, &uid_a, 8);
  put(&m, &uid_b, 8);
  put(&m, nonce_a, kNonceLen);
  put(&m, nonce_b, kNonceLen);
  return m;
}
}  // namespace

void EngineCore::set_auth_secret(const std::string& secret) {
  if (secret.size() < 16)
    throw Error(Code::kInvalidArgument, "the auth secret must be at least 16 bytes, got " +
                                            std::to_string(secret.size()));
  if (auth_on()) throw Error(Code::kInvalidArgument, "the auth secret is already set");
  check_open();
  {
    std::lock_guard<std::mutex> g(peers_mu);
    if (!peers.empty())
      throw Error(Code::kInvalidArgument,
                  "set the auth secret before the engine connects or is connected to");
  }
  auth_key = secret;
  auth_on_.store(true, std::memory_order_release);
}

void EngineCore::make_token(uint64_t from, uint64_t to, uint8_t* out) const {
  std::string m("mcr-ray tok v1", 15);
  put(&m, &from, 8);
  put(&m, &to, 8);
  uint8_t mac[kMacLen];
  hmac(auth_key, m, mac);
  memcpy(out, mac, kTokLen);
}

void EngineCore::init_peer_tokens(Peer* p) const {
  if (!auth_on()) return;
  make_token(uid, p->uid_, p->tok_send_);
  make_token(p->uid_, uid, p->tok_recv_);
}

bool EngineCore::token_valid(uint64_t from, const uint8_t* tok) const {
  uint8_t want[kTokLen];
  make_token(from, uid, want);
  return CRYPTO_memcmp(want, tok, kTokLen) == 0;
}

std::shared_ptr<Peer> EngineCore::auth_peer(uint64_t id, const uint8_t* tok, bool* tok_ok) {
  if (!auth_on()) {
    *tok_ok = true;
    return find_peer(id);
  }
  std::shared_ptr<Peer> p;
  {
    std::lock_guard<std::mutex> g(peers_mu);
    auto it = peers.find(id);
    if (it != peers.end() && !it->second->dead_.load()) p = it->second;
  }
  if (p) {
    *tok_ok = CRYPTO_memcmp(tok, p->tok_recv_, kTokLen) == 0;
  } else {
    // Rare (a peer we dropped): the token is recomputed, so an authenticated sender can be
    // told to reconnect and anyone else learns nothing.
    *tok_ok = token_valid(id, tok);
  }
  if (!*tok_ok) {
    st.auth_rejected.fetch_add(1);
    return nullptr;
  }
  return p;
}

bool EngineCore::send_auth1_locked(Lane* lane, const std::shared_ptr<Peer>& peer,
                                   uint64_t call_id, ucs_status_t* err) {
  Auth1Hdr h;
  h.uid = uid;
  h.call_id = call_id;
  random_bytes(h.nonce_a, kNonceLen);
  {
    std::lock_guard<std::mutex> g(auth_mu);
    Handshake& hs = handshakes[call_id];
    hs.peer_uid = peer->uid_;
    memcpy(hs.nonce_a, h.nonce_a, kNonceLen);
    hs.lane = lane->idx;
  }
  void* ep = peer->eps_[lane->idx];
  if (!ep) {
    *err = UCS_ERR_NOT_CONNECTED;
    return false;
  }
  return am_send_locked(this, lane, ep, kAmAuth1, &h, sizeof h, std::string(), call_id, true, err);
}

void EngineCore::on_auth1(Lane* lane, const Auth1Hdr& h, const ucp_am_recv_param_t* param) {
  st.hs_auth1_received.fetch_add(1);
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) || !param->reply_ep) {
    st.malformed_dropped.fetch_add(1);
    return;
  }
  AuthRespHdr r;
  memset(&r, 0, sizeof r);
  r.uid = uid;
  r.call_id = h.call_id;
  if (!auth_on()) {
    // We cannot prove anything: say so, so that the initiator fails at once.
    r.code = int32_t(Code::kAuthFailed);
  } else {
    random_bytes(r.nonce_b, kNonceLen);
    Challenge ch;
    ch.uid = h.uid;
    memcpy(ch.nonce_a, h.nonce_a, kNonceLen);
    ch.issued = Clock::now();
    {
      std::lock_guard<std::mutex> g(auth_mu);
      if (challenges.size() >= kMaxChallenges) {
        for (auto it = challenges.begin(); it != challenges.end();)
          it = ch.issued - it->second.issued > kChallengeTtl ? challenges.erase(it) : std::next(it);
        if (challenges.size() >= kMaxChallenges) challenges.erase(challenges.begin());  // random
      }
      challenges[std::string(reinterpret_cast<char*>(r.nonce_b), kNonceLen)] = ch;
    }
    hmac(auth_key, transcript("resp", h.uid, uid, h.nonce_a, r.nonce_b), r.mac);
  }
  am_send_locked(this, lane, param->reply_ep, kAmAuthResp, &r, sizeof r, std::string(), 0, false,
                 nullptr);
}

void EngineCore::on_auth_resp(Lane* lane, const AuthRespHdr& h, const ucp_am_recv_param_t*) {
  st.hs_resp_received.fetch_add(1);
  Handshake hs;
  {
    std::lock_guard<std::mutex> g(auth_mu);
    auto it = handshakes.find(h.call_id);
    if (it == handshakes.end() || it->second.peer_uid != h.uid) {
      st.auth_rejected.fetch_add(1);  // not ours, or already answered
      return;
    }
    hs = it->second;
    handshakes.erase(it);
  }
  auto fail = [&](const std::string& msg) {
    Pending p;
    if (take_pending(h.call_id, &p)) p.op->sub_done(Code::kAuthFailed, msg);
  };
  auto peer = find_peer(h.uid);
  if (!peer) return fail("the peer failed during the handshake");
  if (h.code != 0)
    return fail("engine '" + peer->name_ +
                "' has no auth secret and cannot authenticate (set the same secret on every "
                "engine of the cluster)");
  if (!auth_on()) return fail("this engine has no auth secret");
  uint8_t want[kMacLen];
  hmac(auth_key, transcript("resp", uid, h.uid, hs.nonce_a, h.nonce_b), want);
  if (CRYPTO_memcmp(want, h.mac, kMacLen) != 0) {
    st.auth_rejected.fetch_add(1);
    return fail("engine '" + peer->name_ +
                "' failed authentication: its answer to our challenge does not match our "
                "secret (the two engines have different auth secrets)");
  }
  Auth2Hdr a;
  a.uid = uid;
  a.call_id = h.call_id;
  memcpy(a.nonce_b, h.nonce_b, kNonceLen);
  std::string m = transcript("init", uid, h.uid, hs.nonce_a, h.nonce_b) + sha256(address);
  hmac(auth_key, m, a.mac);
  {
    std::lock_guard<std::mutex> g(auth_mu);
    debug_auth2_hdr.assign(reinterpret_cast<char*>(&a), sizeof a);
    debug_auth2_data = address;
  }
  uint64_t call_id = h.call_id;
  auto send = [this, peer, a, call_id](Lane* l) {
    ucs_status_t err = UCS_OK;
    void* ep = peer->eps_[l->idx];
    if (!ep || !am_send_locked(this, l, ep, kAmAuth2, &a, sizeof a, address, call_id, true, &err)) {
      Pending p;
      if (take_pending(call_id, &p))
        p.op->sub_done(Code::kUnreachable, ucs_msg("handshake", ep ? err : UCS_ERR_NOT_CONNECTED));
    }
  };
  if (hs.lane == lane->idx) {
    lane->deferred.push_back([send, lane] { send(lane); });
  } else if (hs.lane >= 0 && size_t(hs.lane) < lanes.size()) {
    Lane* l = lanes[hs.lane].get();
    l->post_task([send, l] { send(l); });
  }
}

bool EngineCore::take_challenge(const Auth2Hdr& h, Challenge* out) {
  std::lock_guard<std::mutex> g(auth_mu);
  auto it = challenges.find(std::string(reinterpret_cast<const char*>(h.nonce_b), kNonceLen));
  if (it == challenges.end()) return false;  // never issued, expired, or already answered
  *out = it->second;
  challenges.erase(it);
  return out->uid == h.uid && Clock::now() - out->issued <= kChallengeTtl;
}

bool EngineCore::verify_auth2(const Auth2Hdr& h, const Challenge& ch, const std::string& addr) {
  uint8_t want[kMacLen];
  hmac(auth_key, transcript("init", h.uid, uid, ch.nonce_a, h.nonce_b) + sha256(addr), want);
  return CRYPTO_memcmp(want, h.mac, kMacLen) == 0;
}

}  // namespace mcr
