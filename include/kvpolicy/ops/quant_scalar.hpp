// SPDX-License-Identifier: Apache-2.0
// `backend::ScalarQuantOps`: quantize / dequantize rows of a K/V cache in the
// ggml block formats (quant/ggml.hpp), the reference every backend must match
// byte for byte (quantize) and bit for bit (dequantize). A row is n values,
// n a multiple of 32, into n / 32 consecutive blocks.
#pragma once

#include <cstdint>

#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/quant/ggml.hpp"

KVP_NAMESPACE_BEGIN
namespace backend {

struct ScalarQuantOps {
  /// Blocks of row x[0..n) (finite; any KV element type, widened exactly) into `out`.
  template <class T>
  static void ggml_quantize_row(GgmlType t, const T* x, std::int64_t n, std::uint8_t* out) noexcept {
    const std::int32_t bb = ggml_block_bytes(t);
    float blk[kGgmlBlock];
    for (std::int64_t b = 0; b < n / kGgmlBlock; ++b) {
      for (int j = 0; j < kGgmlBlock; ++j) blk[j] = to_float(x[b * kGgmlBlock + j]);
      ggml_quantize_block(t, blk, out + b * bb);
    }
  }
  /// First index of a NaN or infinity in x[0..n), or -1.
  template <class T>
  static std::int64_t first_nonfinite(const T* x, std::int64_t n) noexcept {
    for (std::int64_t j = 0; j < n; ++j) {
      const float v = to_float(x[j]);
      if (v - v != 0.0f) return j;  // NaN or infinity
    }
    return -1;
  }
  /// Blocks back to n values of type T (fp16 / bf16 outputs round to nearest even).
  template <class T>
  static void ggml_dequantize_row(GgmlType t, const std::uint8_t* in, std::int64_t n, T* y) noexcept {
    const std::int32_t bb = ggml_block_bytes(t);
    float blk[kGgmlBlock];
    for (std::int64_t b = 0; b < n / kGgmlBlock; ++b) {
      if constexpr (std::is_same_v<T, float>) {
        ggml_dequantize_block(t, in + b * bb, y + b * kGgmlBlock);
      } else {
        ggml_dequantize_block(t, in + b * bb, blk);
        for (int j = 0; j < kGgmlBlock; ++j) y[b * kGgmlBlock + j] = from_float<T>(blk[j]);
      }
    }
  }
};

}  // namespace backend
KVP_NAMESPACE_END
