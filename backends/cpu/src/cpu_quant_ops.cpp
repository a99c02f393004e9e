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

}  // namespace backend
KVP_NAMESPACE_END
