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
#include "kvpolicy/quant/fp8.hpp"
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
  // Row codecs (quant_codec_impl.hpp; contracts of ScalarQuantOps): false = shape not vectorised, nothing written.
  bool (*rotate_in_f32)(const float* x, std::int64_t rows, std::int64_t x_stride, std::int64_t d, std::int64_t n, float* y) noexcept;
  bool (*rotate_in_f16)(const half* x, std::int64_t rows, std::int64_t x_stride, std::int64_t d, std::int64_t n, float* y) noexcept;
  bool (*rotate_out_f32)(float* y, std::int64_t rows, std::int64_t d, std::int64_t n, float* out, std::int64_t out_stride) noexcept;
  bool (*rotate_out_f16)(float* y, std::int64_t rows, std::int64_t d, std::int64_t n, half* out, std::int64_t out_stride) noexcept;
  bool (*int4_quantize)(const float* x, std::int64_t rows, std::int64_t d, int bits, std::uint8_t* out, std::int64_t out_stride) noexcept;
  bool (*int4_dequantize_f32)(const std::uint8_t* in, std::int64_t rows, std::int64_t in_stride, std::int64_t d, int bits, float* y,
                              std::int64_t y_stride) noexcept;
  bool (*int4_dequantize_f16)(const std::uint8_t* in, std::int64_t rows, std::int64_t in_stride, std::int64_t d, int bits, half* y,
                              std::int64_t y_stride) noexcept;
  bool (*fp8_quantize_f32)(Fp8Format f, const float* x, std::int64_t rows, std::int64_t x_stride, std::int64_t d, float scale,
                           std::uint8_t* out, std::int64_t out_stride) noexcept;
  bool (*fp8_quantize_f16)(Fp8Format f, const half* x, std::int64_t rows, std::int64_t x_stride, std::int64_t d, float scale,
                           std::uint8_t* out, std::int64_t out_stride) noexcept;
  bool (*fp8_dequantize_f32)(Fp8Format f, const std::uint8_t* in, std::int64_t rows, std::int64_t in_stride, std::int64_t d, float scale,
                             float* y, std::int64_t y_stride) noexcept;
  bool (*fp8_dequantize_f16)(Fp8Format f, const std::uint8_t* in, std::int64_t rows, std::int64_t in_stride, std::int64_t d, float scale,
                             half* y, std::int64_t y_stride) noexcept;
  std::int64_t (*first_not_below_f32)(const float* x, std::int64_t n, float bound) noexcept;
  std::int64_t (*first_not_below_f16)(const half* x, std::int64_t n, float bound) noexcept;
  bool (*kivi_r16_f32)(const float* x, std::int64_t rows, std::int64_t x_stride, std::int64_t d, float* y) noexcept;
  bool (*kivi_r16_f16)(const half* x, std::int64_t rows, std::int64_t x_stride, std::int64_t d, float* y) noexcept;
  bool (*kivi_quantize_keys)(const float* x, std::int64_t d, int group, int bits, std::uint8_t* codes, std::uint8_t* scales) noexcept;
  bool (*kivi_dequantize_keys_f32)(const std::uint8_t* codes, const std::uint8_t* scales, std::int64_t d, int group, int bits, float* y,
                                   std::int64_t y_stride) noexcept;
  bool (*kivi_dequantize_keys_f16)(const std::uint8_t* codes, const std::uint8_t* scales, std::int64_t d, int group, int bits, half* y,
                                   std::int64_t y_stride) noexcept;
  bool (*kivi_quantize_values)(const float* x, std::int64_t rows, std::int64_t d, int group, int bits, std::uint8_t* codes,
                               std::int64_t codes_stride, std::uint8_t* scales, std::int64_t scales_stride) noexcept;
  bool (*kivi_dequantize_values_f32)(const std::uint8_t* codes, std::int64_t codes_stride, const std::uint8_t* scales,
                                     std::int64_t scales_stride, std::int64_t rows, std::int64_t d, int group, int bits, float* y,
                                     std::int64_t y_stride) noexcept;
  bool (*kivi_dequantize_values_f16)(const std::uint8_t* codes, std::int64_t codes_stride, const std::uint8_t* scales,
                                     std::int64_t scales_stride, std::int64_t rows, std::int64_t d, int group, int bits, half* y,
                                     std::int64_t y_stride) noexcept;
};

KVP_CPU_DECLARE_KERNELS(QuantKernels, quant_kernels)

}  // namespace cpu_detail
KVP_NAMESPACE_END
