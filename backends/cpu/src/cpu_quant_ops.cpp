// SPDX-License-Identifier: Apache-2.0
// Entry points of `backend::CpuQuantOps` (baseline flags): ISA dispatch to
// the kernels of quant_ops_<isa>.cpp.
#include "kvpolicy/backends/cpu_quant_ops.hpp"

#include "quant_kernels.hpp"

KVP_NAMESPACE_BEGIN
namespace backend {

void CpuQuantOps::quantize_row_kernel(GgmlType t, const float* x, std::int64_t n, std::uint8_t* out) noexcept {
  cpu_detail::quant_kernels().quantize_f32(t, x, n, out);
}
void CpuQuantOps::quantize_row_kernel(GgmlType t, const half* x, std::int64_t n, std::uint8_t* out) noexcept {
  cpu_detail::quant_kernels().quantize_f16(t, x, n, out);
}
void CpuQuantOps::dequantize_row_kernel(GgmlType t, const std::uint8_t* in, std::int64_t n, float* y) noexcept {
  cpu_detail::quant_kernels().dequantize_f32(t, in, n, y);
}
void CpuQuantOps::dequantize_row_kernel(GgmlType t, const std::uint8_t* in, std::int64_t n, half* y) noexcept {
  cpu_detail::quant_kernels().dequantize_f16(t, in, n, y);
}
std::int64_t CpuQuantOps::first_nonfinite_kernel(const float* x, std::int64_t n) noexcept {
  return n <= 0 ? -1 : cpu_detail::quant_kernels().first_nonfinite_f32(x, n);
}
std::int64_t CpuQuantOps::first_nonfinite_kernel(const half* x, std::int64_t n) noexcept {
  return n <= 0 ? -1 : cpu_detail::quant_kernels().first_nonfinite_f16(x, n);
}

bool CpuQuantOps::rotate_in_kernel(const float* x, std::int64_t rows, std::int64_t xs, std::int64_t d, std::int64_t n, float* y) noexcept {
  return cpu_detail::quant_kernels().rotate_in_f32(x, rows, xs, d, n, y);
}
bool CpuQuantOps::rotate_in_kernel(const half* x, std::int64_t rows, std::int64_t xs, std::int64_t d, std::int64_t n, float* y) noexcept {
  return cpu_detail::quant_kernels().rotate_in_f16(x, rows, xs, d, n, y);
}
bool CpuQuantOps::rotate_out_kernel(float* y, std::int64_t rows, std::int64_t d, std::int64_t n, float* out, std::int64_t os) noexcept {
  return cpu_detail::quant_kernels().rotate_out_f32(y, rows, d, n, out, os);
}
bool CpuQuantOps::rotate_out_kernel(float* y, std::int64_t rows, std::int64_t d, std::int64_t n, half* out, std::int64_t os) noexcept {
  return cpu_detail::quant_kernels().rotate_out_f16(y, rows, d, n, out, os);
}
void CpuQuantOps::int4_quantize_rows(const float* x, std::int64_t rows, std::int64_t d, int bits, std::uint8_t* out,
                                     std::int64_t out_stride) noexcept {
  if (!cpu_detail::quant_kernels().int4_quantize(x, rows, d, bits, out, out_stride))
    ScalarQuantOps::int4_quantize_rows(x, rows, d, bits, out, out_stride);
}
bool CpuQuantOps::int4_dequantize_kernel(const std::uint8_t* in, std::int64_t rows, std::int64_t is, std::int64_t d, int bits, float* y,
                                         std::int64_t ys) noexcept {
  return cpu_detail::quant_kernels().int4_dequantize_f32(in, rows, is, d, bits, y, ys);
}
bool CpuQuantOps::int4_dequantize_kernel(const std::uint8_t* in, std::int64_t rows, std::int64_t is, std::int64_t d, int bits, half* y,
                                         std::int64_t ys) noexcept {
  return cpu_detail::quant_kernels().int4_dequantize_f16(in, rows, is, d, bits, y, ys);
}
bool CpuQuantOps::fp8_quantize_kernel(Fp8Format f, const float* x, std::int64_t rows, std::int64_t xs, std::int64_t d, float scale,
                                      std::uint8_t* out, std::int64_t os) noexcept {
  return cpu_detail::quant_kernels().fp8_quantize_f32(f, x, rows, xs, d, scale, out, os);
}
bool CpuQuantOps::fp8_quantize_kernel(Fp8Format f, const half* x, std::int64_t rows, std::int64_t xs, std::int64_t d, float scale,
                                      std::uint8_t* out, std::int64_t os) noexcept {
  return cpu_detail::quant_kernels().fp8_quantize_f16(f, x, rows, xs, d, scale, out, os);
}
bool CpuQuantOps::fp8_dequantize_kernel(Fp8Format f, const std::uint8_t* in, std::int64_t rows, std::int64_t is, std::int64_t d,
                                        float scale, float* y, std::int64_t ys) noexcept {
  return cpu_detail::quant_kernels().fp8_dequantize_f32(f, in, rows, is, d, scale, y, ys);
}
bool CpuQuantOps::fp8_dequantize_kernel(Fp8Format f, const std::uint8_t* in, std::int64_t rows, std::int64_t is, std::int64_t d,
                                        float scale, half* y, std::int64_t ys) noexcept {
  return cpu_detail::quant_kernels().fp8_dequantize_f16(f, in, rows, is, d, scale, y, ys);
}
bool CpuQuantOps::kivi_r16_kernel(const float* x, std::int64_t rows, std::int64_t xs, std::int64_t d, float* y) noexcept {
  return cpu_detail::quant_kernels().kivi_r16_f32(x, rows, xs, d, y);
}
bool CpuQuantOps::kivi_r16_kernel(const half* x, std::int64_t rows, std::int64_t xs, std::int64_t d, float* y) noexcept {
  return cpu_detail::quant_kernels().kivi_r16_f16(x, rows, xs, d, y);
}
std::int64_t CpuQuantOps::first_not_below(const float* x, std::int64_t n, float bound) noexcept {
  return n <= 0 ? -1 : cpu_detail::quant_kernels().first_not_below_f32(x, n, bound);
}
std::int64_t CpuQuantOps::first_not_below(const half* x, std::int64_t n, float bound) noexcept {
  return n <= 0 ? -1 : cpu_detail::quant_kernels().first_not_below_f16(x, n, bound);
}
void CpuQuantOps::kivi_quantize_keys(const float* x, std::int64_t d, int group, int bits, std::uint8_t* codes,
                                     std::uint8_t* scales) noexcept {
  if (!cpu_detail::quant_kernels().kivi_quantize_keys(x, d, group, bits, codes, scales))
    ScalarQuantOps::kivi_quantize_keys(x, d, group, bits, codes, scales);
}
bool CpuQuantOps::kivi_dequantize_keys_kernel(const std::uint8_t* codes, const std::uint8_t* scales, std::int64_t d, int group, int bits,
                                              float* y, std::int64_t ys) noexcept {
  return cpu_detail::quant_kernels().kivi_dequantize_keys_f32(codes, scales, d, group, bits, y, ys);
}
bool CpuQuantOps::kivi_dequantize_keys_kernel(const std::uint8_t* codes, const std::uint8_t* scales, std::int64_t d, int group, int bits,
                                              half* y, std::int64_t ys) noexcept {
  return cpu_detail::quant_kernels().kivi_dequantize_keys_f16(codes, scales, d, group, bits, y, ys);
}
void CpuQuantOps::kivi_quantize_value_rows(const float* x, std::int64_t rows, std::int64_t d, int group, int bits, std::uint8_t* codes,
                                           std::int64_t codes_stride, std::uint8_t* scales, std::int64_t scales_stride) noexcept {
  if (!cpu_detail::quant_kernels().kivi_quantize_values(x, rows, d, group, bits, codes, codes_stride, scales, scales_stride))
    ScalarQuantOps::kivi_quantize_value_rows(x, rows, d, group, bits, codes, codes_stride, scales, scales_stride);
}
bool CpuQuantOps::kivi_dequantize_values_kernel(const std::uint8_t* codes, std::int64_t cs, const std::uint8_t* scales, std::int64_t ss,
                                                std::int64_t rows, std::int64_t d, int group, int bits, float* y,
                                                std::int64_t ys) noexcept {
  return cpu_detail::quant_kernels().kivi_dequantize_values_f32(codes, cs, scales, ss, rows, d, group, bits, y, ys);
}
bool CpuQuantOps::kivi_dequantize_values_kernel(const std::uint8_t* codes, std::int64_t cs, const std::uint8_t* scales, std::int64_t ss,
                                                std::int64_t rows, std::int64_t d, int group, int bits, half* y, std::int64_t ys) noexcept {
  return cpu_detail::quant_kernels().kivi_dequantize_values_f16(codes, cs, scales, ss, rows, d, group, bits, y, ys);
}

}  // namespace backend
KVP_NAMESPACE_END
