// SPDX-License-Identifier: Apache-2.0
#pragma once
#include "kvpolicy/ops/scalar.hpp"

KVP_NAMESPACE_BEGIN
namespace backend {
struct Cpu : ScalarScoreOps {
  /// Name of the instruction set selected at run time.
  static const char* isa_name() noexcept;
};
}  // namespace backend
KVP_NAMESPACE_END
