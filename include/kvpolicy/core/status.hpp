// SPDX-License-Identifier: Apache-2.0
// `Status`: the result of every hot-path entry point. No allocation, no
// exceptions: the message lives in a fixed buffer inside the object. A thin
// throwing layer (`throw_if_error`) serves examples and scripts.
#pragma once

#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kvpolicy/core/version.hpp"

KVP_NAMESPACE_BEGIN

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument,    ///< shape, stride, dtype, null pointer, value out of range
  kWorkspaceTooSmall,  ///< caller-provided workspace below what `requirements()` reported
  kOutputTooSmall,     ///< caller-provided output buffer too small
  kUnsupported,        ///< valid input this build or backend does not handle
  kDeviceError,        ///< error reported by a device runtime (CUDA)
  kCollectiveError,    ///< error reported by the engine's collective (core/collective.hpp), or a peer rank's rejection
};

constexpr const char* status_code_name(StatusCode c) noexcept {
  switch (c) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid argument";
    case StatusCode::kWorkspaceTooSmall: return "workspace too small";
    case StatusCode::kOutputTooSmall: return "output too small";
    case StatusCode::kUnsupported: return "unsupported";
    case StatusCode::kDeviceError: return "device error";
    case StatusCode::kCollectiveError: return "collective error";
  }
  return "unknown";
}

/// Error code plus a message that names the argument and the violated
/// constraint, e.g. "snapkv: queries has 12 heads, not a multiple of the 8 kv heads".
class [[nodiscard]] Status {
 public:
  static constexpr std::size_t kMaxMessage = 240;

  constexpr Status() noexcept = default;
  static constexpr Status ok() noexcept { return Status(); }

  /// printf-style constructor; the message is truncated to kMaxMessage-1 chars.
  [[gnu::format(printf, 2, 3)]] static Status error(StatusCode code, const char* fmt, ...) noexcept {
    Status s;
    s.code_ = code;
    va_list args;
    va_start(args, fmt);
    std::vsnprintf(s.message_, kMaxMessage, fmt, args);
    va_end(args);
    return s;
  }

  constexpr bool is_ok() const noexcept { return code_ == StatusCode::kOk; }
  constexpr explicit operator bool() const noexcept { return is_ok(); }
  constexpr StatusCode code() const noexcept { return code_; }
  const char* message() const noexcept { return is_ok() ? "ok" : message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  char message_[kMaxMessage] = {};
};

#define KVP_INVALID(...) ::kvpolicy::Status::error(::kvpolicy::StatusCode::kInvalidArgument, __VA_ARGS__)

/// Return early from a Status-returning function when `expr` fails.
#define KVP_RETURN_IF_ERROR(expr)                 \
  do {                                            \
    ::kvpolicy::Status kvp_status_ = (expr);      \
    if (!kvp_status_.is_ok()) return kvp_status_; \
  } while (0)

/// Return an invalid-argument Status (printf-style message) unless `cond` holds.
#define KVP_REQUIRE(cond, ...)                    \
  do {                                            \
    if (!(cond)) return KVP_INVALID(__VA_ARGS__); \
  } while (0)

/// Exception carrying a failed Status (throwing layer for scripts/examples).
class Error : public std::runtime_error {
 public:
  explicit Error(const Status& s) : std::runtime_error(s.message()), code_(s.code()) {}
  StatusCode code() const noexcept { return code_; }

 private:
  StatusCode code_;
};

inline void throw_if_error(const Status& s) {
  if (!s.is_ok()) throw Error(s);
}

KVP_NAMESPACE_END
