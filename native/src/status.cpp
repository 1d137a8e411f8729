#include "mcr/status.h"

namespace mcr {

const char* code_name(Code c) {
  switch (c) {
    case Code::kOk: return "OK";
    case Code::kInvalidArgument: return "INVALID_ARGUMENT";
    case Code::kOutOfBounds: return "OUT_OF_BOUNDS";
    case Code::kNotRegistered: return "NOT_REGISTERED";
    case Code::kUnreachable: return "UNREACHABLE";
    case Code::kTimeout: return "TIMEOUT";
    case Code::kTransferFailed: return "TRANSFER_FAILED";
    case Code::kRpcHandlerError: return "RPC_HANDLER_ERROR";
    case Code::kNoHandler: return "NO_HANDLER";
    case Code::kShutdown: return "SHUTDOWN";
    case Code::kBadConfig: return "BAD_CONFIG";
    case Code::kAuthFailed: return "AUTH_FAILED";
    case Code::kIoError: return "IO_ERROR";
    case Code::kNoSpace: return "NO_SPACE";
    case Code::kChecksumMismatch: return "CHECKSUM_MISMATCH";
    case Code::kNotFound: return "NOT_FOUND";
    case Code::kDegraded: return "DEGRADED";
    case Code::kInternal: return "INTERNAL";
  }
  return "UNKNOWN";
}

}  // namespace mcr
