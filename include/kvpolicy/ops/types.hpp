// SPDX-License-Identifier: Apache-2.0
// Vocabulary of the ops contract and the backend tag types.
#pragma once

#include <cstdint>

#include "kvpolicy/core/version.hpp"

KVP_NAMESPACE_BEGIN

/// Reduction of window attention over the observation queries.
enum class WindowReduce : std::uint8_t {
  kMean,  ///< kvpress, Ada-KV
  kSum,   ///< SnapKV / PyramidKV originals
};

/// 1-D pooling along the token axis (stride 1, padding kernel/2, odd kernel).
enum class Pooling : std::uint8_t {
  kNone,
  kAvg,  ///< torch avg_pool1d(count_include_pad=True): divisor is always `kernel`
  kMax,  ///< torch max_pool1d: padding never wins
};

/// Reduction over the G query heads of a GQA group.
enum class GroupReduce : std::uint8_t { kMean, kMax, kSum };

namespace backend {
/// Portable scalar reference: the oracle every other backend is tested against.
struct Scalar;
/// CPU SIMD backend (xsimd, run-time ISA dispatch). Falls back to Scalar for
/// ops it does not specialise (by inheritance). Defined in kvpolicy::cpu.
struct Cpu;
/// CUDA backend. Device pointers only; never falls back to host code.
struct Cuda;
}  // namespace backend

KVP_NAMESPACE_END
