// SPDX-License-Identifier: Apache-2.0
// Kernel table of the quantization ops (internal): what each per-ISA unit
// (quant_ops_<isa>.cpp) provides to the entry points in cpu_quant_ops.cpp.
// Every kernel produces exactly the bytes / values of `ScalarQuantOps` (the
// block algorithms are the same source, quant/ggml_blocks.inl, compiled
// without floating-point contraction).
#pragma once

#include <cstdint>

#include "isa_dispatch.hpp"
#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/quant/ggml.hpp"

KVP_NAMESPACE_BEGIN
namespace cpu_detail {

struct QuantKernels {
  void (*quantize_f32)(GgmlType t, const float* x, std::int64_t n, std::uint8_t* out) noexcept;
  void (*quantize_f16)(GgmlType t, const half* x, std::int64_t n, std::uint8_t* out) noexcept;
  void (*dequantize_f32)(GgmlType t, const std::uint8_t* in, std::int64_t n, float* y) noexcept;
  void (*dequantize_f16)(GgmlType t, const std::uint8_t* in, std::int64_t n, half* y) noexcept;
  /// First index of a NaN or infinity in x[0..n), or -1.
  std::int64_t (*first_nonfinite_f32)(const float* x, std::int64_t n) noexcept;
  std::int64_t (*first_nonfinite_f16)(const half* x, std::int64_t n) noexcept;
};

KVP_CPU_DECLARE_KERNELS(QuantKernels, quant_kernels)

}  // namespace cpu_detail
KVP_NAMESPACE_END
