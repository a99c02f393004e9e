// SPDX-License-Identifier: Apache-2.0
// `backend::CpuQuantOps`: the ggml row quantizers on the level chosen at run
// time (src/quant_ops_<isa>.cpp), fp32 and fp16 rows; byte-identical to
// `ScalarQuantOps` (same block algorithms, no contraction). bf16 rows use the
// reference by inheritance.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/ops/quant_scalar.hpp"

KVP_NAMESPACE_BEGIN
namespace backend {

struct CpuQuantOps : ScalarQuantOps {
  template <class T>
  static void ggml_quantize_row(GgmlType t, const T* x, std::int64_t n, std::uint8_t* out) noexcept {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, half>)
      quantize_row_kernel(t, x, n, out);
    else
      ScalarQuantOps::ggml_quantize_row(t, x, n, out);
  }
  template <class T>
  static void ggml_dequantize_row(GgmlType t, const std::uint8_t* in, std::int64_t n, T* y) noexcept {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, half>)
      dequantize_row_kernel(t, in, n, y);
    else
      ScalarQuantOps::ggml_dequantize_row(t, in, n, y);
  }
  template <class T>
  static std::int64_t first_nonfinite(const T* x, std::int64_t n) noexcept {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, half>)
      return first_nonfinite_kernel(x, n);
    else
      return ScalarQuantOps::first_nonfinite(x, n);
  }

 private:
  static void quantize_row_kernel(GgmlType t, const float* x, std::int64_t n, std::uint8_t* out) noexcept;
  static void quantize_row_kernel(GgmlType t, const half* x, std::int64_t n, std::uint8_t* out) noexcept;
  static void dequantize_row_kernel(GgmlType t, const std::uint8_t* in, std::int64_t n, float* y) noexcept;
  static void dequantize_row_kernel(GgmlType t, const std::uint8_t* in, std::int64_t n, half* y) noexcept;
  static std::int64_t first_nonfinite_kernel(const float* x, std::int64_t n) noexcept;
  static std::int64_t first_nonfinite_kernel(const half* x, std::int64_t n) noexcept;
};

}  // namespace backend
KVP_NAMESPACE_END
