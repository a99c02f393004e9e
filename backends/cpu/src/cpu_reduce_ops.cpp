// SPDX-License-Identifier: Apache-2.0
// Entry points of `backend::CpuReduceOps` (baseline flags): ISA dispatch to
// the kernels of reduce_ops_<isa>.cpp.
#include "kvpolicy/backends/cpu_reduce_ops.hpp"

#include "reduce_kernels.hpp"

KVP_NAMESPACE_BEGIN
namespace backend {

bool CpuReduceOps::has_nan(const float* x, std::int64_t n) noexcept { return n > 0 && cpu_detail::reduce_kernels().has_nan(x, n); }

std::int64_t CpuReduceOps::argmin_or_nan(const float* x, std::int64_t n, std::int64_t* at) noexcept {
  if (n <= 0) return ScalarReduceOps::argmin_or_nan(x, n, at);
  return cpu_detail::reduce_kernels().argmin_or_nan(x, n, at);
}

void CpuReduceOps::widen_f16(const std::uint16_t* x, std::int64_t n, float* out) noexcept {
  cpu_detail::reduce_kernels().widen_f16(x, n, out);
}

std::int64_t CpuReduceOps::expected_lanes() noexcept { return cpu_detail::reduce_kernels().lanes; }

void CpuReduceOps::expected_block(const float* mean, const float* cov, std::int64_t d, const float* keys, std::int64_t nk, float sqrt_d,
                                  float* z) noexcept {
  cpu_detail::reduce_kernels().expected_logits_block(mean, cov, d, keys, nk, sqrt_d, z);
}

void CpuReduceOps::outer_upper_accumulate(const float* c, std::int64_t n, std::int64_t d, float* block) noexcept {
  if (n <= 0 || d <= 0) return;
  cpu_detail::reduce_kernels().outer_upper_accumulate(c, n, d, block);
}

void CpuReduceOps::outer_upper_add_f64(const float* c, std::int64_t n, std::int64_t d, double* acc) noexcept {
  if (n <= 0 || d <= 0) return;
  cpu_detail::reduce_kernels().outer_upper_add_f64(c, n, d, acc);
}

void CpuReduceOps::accumulate_rows_f64(const float* x, std::int64_t n, std::int64_t d, double* acc) noexcept {
  if (n <= 0 || d <= 0) return;
  cpu_detail::reduce_kernels().accumulate_rows_f64(x, n, d, acc);
}

void CpuReduceOps::centre_rows(float* x, std::int64_t n, std::int64_t d, const double* mu) noexcept {
  if (n <= 0 || d <= 0) return;
  cpu_detail::reduce_kernels().centre_rows(x, n, d, mu);
}

void CpuReduceOps::add_upper_f64(const float* block, std::int64_t d, double* acc) noexcept {
  if (d <= 0) return;
  cpu_detail::reduce_kernels().add_upper_f64(block, d, acc);
}

void CpuReduceOps::neg_norms16(const float* rows, std::int64_t d, float* out) noexcept {
  cpu_detail::reduce_kernels().neg_norms16(rows, d, out);
}

void CpuReduceOps::row_dots(const float* q, const float* rows, std::int64_t n, std::int64_t d, float* out) noexcept {
  if (n <= 0) return;
  cpu_detail::reduce_kernels().row_dots_f32(q, rows, n, d, out);
}

void CpuReduceOps::mean_rows_f32(const float* rows, std::int64_t H, std::int64_t ld, std::int64_t n, float* mean) noexcept {
  if (n <= 0) return;
  cpu_detail::reduce_kernels().mean_rows_f32(rows, H, ld, n, mean);
}

}  // namespace backend
KVP_NAMESPACE_END
