// SPDX-License-Identifier: Apache-2.0
// `backend::CpuQuantOps`: the ggml row quantizers on the level chosen at run
// time (src/quant_ops_<isa>.cpp), fp32 and fp16 rows; byte-identical to
// `ScalarQuantOps` (same block algorithms, no contraction); and the row codecs
// of the other formats (Hadamard rotation, INT4, fp8, KIVI), vectorised on
// AVX2 / AVX-512 and bit-identical with the reference (src/quant_codec_impl.hpp).
// bf16 rows, shapes a kernel does not vectorise and the SSE2 level use the
// reference.
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

  // Row codecs: the level's kernels for fp32 / fp16 rows where they vectorise the shape, else the reference.
  template <class T>
  static void rotate_rows_in(const T* x, std::int64_t rows, std::int64_t x_stride, std::int64_t d, std::int64_t n, float* y) noexcept {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, half>)
      if (rotate_in_kernel(x, rows, x_stride, d, n, y)) return;
    ScalarQuantOps::rotate_rows_in(x, rows, x_stride, d, n, y);
  }
  template <class T>
  static void rotate_rows_out(float* y, std::int64_t rows, std::int64_t d, std::int64_t n, T* out, std::int64_t out_stride) noexcept {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, half>)
      if (rotate_out_kernel(y, rows, d, n, out, out_stride)) return;
    ScalarQuantOps::rotate_rows_out(y, rows, d, n, out, out_stride);
  }
  static void int4_quantize_rows(const float* x, std::int64_t rows, std::int64_t d, int bits, std::uint8_t* out,
                                 std::int64_t out_stride) noexcept;
  template <class T>
  static void int4_dequantize_rows(const std::uint8_t* in, std::int64_t rows, std::int64_t in_stride, std::int64_t d, int bits, T* y,
                                   std::int64_t y_stride) noexcept {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, half>)
      if (int4_dequantize_kernel(in, rows, in_stride, d, bits, y, y_stride)) return;
    ScalarQuantOps::int4_dequantize_rows(in, rows, in_stride, d, bits, y, y_stride);
  }
  template <class T>
  static void fp8_quantize_rows(Fp8Format f, const T* x, std::int64_t rows, std::int64_t x_stride, std::int64_t d, float scale,
                                std::uint8_t* out, std::int64_t out_stride) noexcept {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, half>)
      if (fp8_quantize_kernel(f, x, rows, x_stride, d, scale, out, out_stride)) return;
    ScalarQuantOps::fp8_quantize_rows(f, x, rows, x_stride, d, scale, out, out_stride);
  }
  template <class T>
  static void fp8_dequantize_rows(Fp8Format f, const std::uint8_t* in, std::int64_t rows, std::int64_t in_stride, std::int64_t d,
                                  float scale, T* y, std::int64_t y_stride) noexcept {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, half>)
      if (fp8_dequantize_kernel(f, in, rows, in_stride, d, scale, y, y_stride)) return;
    ScalarQuantOps::fp8_dequantize_rows(f, in, rows, in_stride, d, scale, y, y_stride);
  }
  template <class T>
  static void kivi_r16_rows(const T* x, std::int64_t rows, std::int64_t x_stride, std::int64_t d, float* y) noexcept {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, half>)
      if (kivi_r16_kernel(x, rows, x_stride, d, y)) return;
    ScalarQuantOps::kivi_r16_rows(x, rows, x_stride, d, y);
  }
  static std::int64_t first_not_below(const float* x, std::int64_t n, float bound) noexcept;
  static std::int64_t first_not_below(const half* x, std::int64_t n, float bound) noexcept;
  static void kivi_quantize_keys(const float* x, std::int64_t d, int group, int bits, std::uint8_t* codes, std::uint8_t* scales) noexcept;
  template <class T>
  static void kivi_dequantize_keys(const std::uint8_t* codes, const std::uint8_t* scales, std::int64_t d, int group, int bits, T* y,
                                   std::int64_t y_stride) noexcept {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, half>)
      if (kivi_dequantize_keys_kernel(codes, scales, d, group, bits, y, y_stride)) return;
    ScalarQuantOps::kivi_dequantize_keys(codes, scales, d, group, bits, y, y_stride);
  }
  static void kivi_quantize_value_rows(const float* x, std::int64_t rows, std::int64_t d, int group, int bits, std::uint8_t* codes,
                                       std::int64_t codes_stride, std::uint8_t* scales, std::int64_t scales_stride) noexcept;
  template <class T>
  static void kivi_dequantize_value_rows(const std::uint8_t* codes, std::int64_t codes_stride, const std::uint8_t* scales,
                                         std::int64_t scales_stride, std::int64_t rows, std::int64_t d, int group, int bits, T* y,
                                         std::int64_t y_stride) noexcept {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, half>)
      if (kivi_dequantize_values_kernel(codes, codes_stride, scales, scales_stride, rows, d, group, bits, y, y_stride)) return;
    ScalarQuantOps::kivi_dequantize_value_rows(codes, codes_stride, scales, scales_stride, rows, d, group, bits, y, y_stride);
  }

 private:
  static bool kivi_dequantize_keys_kernel(const std::uint8_t* codes, const std::uint8_t* scales, std::int64_t d, int group, int bits,
                                          float* y, std::int64_t ys) noexcept;
  static bool kivi_dequantize_keys_kernel(const std::uint8_t* codes, const std::uint8_t* scales, std::int64_t d, int group, int bits,
                                          half* y, std::int64_t ys) noexcept;
  static bool kivi_dequantize_values_kernel(const std::uint8_t* codes, std::int64_t cs, const std::uint8_t* scales, std::int64_t ss,
                                            std::int64_t rows, std::int64_t d, int group, int bits, float* y, std::int64_t ys) noexcept;
  static bool kivi_dequantize_values_kernel(const std::uint8_t* codes, std::int64_t cs, const std::uint8_t* scales, std::int64_t ss,
                                            std::int64_t rows, std::int64_t d, int group, int bits, half* y, std::int64_t ys) noexcept;
  static bool rotate_in_kernel(const float* x, std::int64_t rows, std::int64_t xs, std::int64_t d, std::int64_t n, float* y) noexcept;
  static bool rotate_in_kernel(const half* x, std::int64_t rows, std::int64_t xs, std::int64_t d, std::int64_t n, float* y) noexcept;
  static bool rotate_out_kernel(float* y, std::int64_t rows, std::int64_t d, std::int64_t n, float* out, std::int64_t os) noexcept;
  static bool rotate_out_kernel(float* y, std::int64_t rows, std::int64_t d, std::int64_t n, half* out, std::int64_t os) noexcept;
  static bool fp8_quantize_kernel(Fp8Format f, const float* x, std::int64_t rows, std::int64_t xs, std::int64_t d, float scale,
                                  std::uint8_t* out, std::int64_t os) noexcept;
  static bool fp8_quantize_kernel(Fp8Format f, const half* x, std::int64_t rows, std::int64_t xs, std::int64_t d, float scale,
                                  std::uint8_t* out, std::int64_t os) noexcept;
  static bool fp8_dequantize_kernel(Fp8Format f, const std::uint8_t* in, std::int64_t rows, std::int64_t is, std::int64_t d, float scale,
                                    float* y, std::int64_t ys) noexcept;
  static bool fp8_dequantize_kernel(Fp8Format f, const std::uint8_t* in, std::int64_t rows, std::int64_t is, std::int64_t d, float scale,
                                    half* y, std::int64_t ys) noexcept;
  static bool int4_dequantize_kernel(const std::uint8_t* in, std::int64_t rows, std::int64_t is, std::int64_t d, int bits, float* y,
                                     std::int64_t ys) noexcept;
  static bool int4_dequantize_kernel(const std::uint8_t* in, std::int64_t rows, std::int64_t is, std::int64_t d, int bits, half* y,
                                     std::int64_t ys) noexcept;
  static bool kivi_r16_kernel(const float* x, std::int64_t rows, std::int64_t xs, std::int64_t d, float* y) noexcept;
  static bool kivi_r16_kernel(const half* x, std::int64_t rows, std::int64_t xs, std::int64_t d, float* y) noexcept;
  static void quantize_row_kernel(GgmlType t, const float* x, std::int64_t n, std::uint8_t* out) noexcept;
  static void quantize_row_kernel(GgmlType t, const half* x, std::int64_t n, std::uint8_t* out) noexcept;
  static void dequantize_row_kernel(GgmlType t, const std::uint8_t* in, std::int64_t n, float* y) noexcept;
  static void dequantize_row_kernel(GgmlType t, const std::uint8_t* in, std::int64_t n, half* y) noexcept;
  static std::int64_t first_nonfinite_kernel(const float* x, std::int64_t n) noexcept;
  static std::int64_t first_nonfinite_kernel(const half* x, std::int64_t n) noexcept;
};

}  // namespace backend
KVP_NAMESPACE_END
