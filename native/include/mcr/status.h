// One error-code enum for the whole native library, with a range per subsystem.
// The binding maps each code to exactly one Python class in mooncake_ray/errors.py.
#pragma once
#include <stdexcept>
#include <string>

namespace mcr {

enum class Code : int {
  kOk = 0,
  // 1xx: caller errors
  kInvalidArgument = 100,
  kOutOfBounds = 101,      // a range outside its registered region
  kNotRegistered = 102,    // memory (local or remote key) not registered / deregistered
  // 2xx: transport
  kUnreachable = 200,      // peer unknown, endpoint failed, connection refused
  kTimeout = 201,          // a transfer or an RPC did not complete in time
  kTransferFailed = 202,   // UCX reported an error on a transfer
  kRpcHandlerError = 203,  // the remote handler raised
  kNoHandler = 204,        // no handler registered under that id
  kShutdown = 205,         // the engine is closed
  kBadConfig = 206,        // an engine setting (protocol, UCX option) is invalid
  kAuthFailed = 207,       // a peer failed (or refused) the authenticated handshake
  // 3xx: spill / disk
  kIoError = 300,
  kNoSpace = 301,
  kChecksumMismatch = 302,
  kNotFound = 303,
  kDegraded = 304,
  // 9xx
  kInternal = 900,
};

const char* code_name(Code c);

// Thrown by native code; the binding translates it to the mapped Python class.
class Error : public std::runtime_error {
 public:
  Error(Code code, const std::string& msg) : std::runtime_error(msg), code_(code) {}
  Code code() const { return code_; }

 private:
  Code code_;
};

}  // namespace mcr
