// SPDX-License-Identifier: Apache-2.0
// Kernel table of the row reductions (internal): what each per-ISA unit
// (reduce_ops_<isa>.cpp) provides to the entry points in cpu_reduce_ops.cpp.
// Every kernel returns exactly what its `backend::ScalarReduceOps` reference
// returns (comparisons and element-wise fp32 in the reference's order only).
#pragma once

#include <cstdint>

#include "isa_dispatch.hpp"

KVP_NAMESPACE_BEGIN
namespace cpu_detail {

struct ReduceKernels {
  /// `ScalarReduceOps::argmin_or_nan`: -1 and *at = the lowest slot of the
  /// minimum under score_order_key, or 0 (at untouched) when x holds NaN. n >= 1.
  std::int64_t (*argmin_or_nan)(const float* x, std::int64_t n, std::int64_t* at) noexcept;
  /// Whether x[0..n) holds a NaN.
  bool (*has_nan)(const float* x, std::int64_t n) noexcept;
  /// mean[j] = (sum over h ascending of rows[h * ld + j]) / H, fp32, rows contiguous along j.
  void (*mean_rows_f32)(const float* rows, std::int64_t H, std::int64_t ld, std::int64_t n, float* mean) noexcept;
  /// `ScalarReduceOps::widen_row` of fp16 bits: out[i] = x[i] as fp32, exactly (NaN quieted, payload kept). n >= 1.
  void (*widen_f16)(const std::uint16_t* x, std::int64_t n, float* out) noexcept;
  /// `ScalarReduceOps::row_dots`: out[i] = <q, rows + i * d>, 16 partial sums over c mod 16, then sum16. n >= 1.
  void (*row_dots_f32)(const float* q, const float* rows, std::int64_t n, std::int64_t d, float* out) noexcept;
  /// `ScalarReduceOps::expected_logits` for one lane-block of keys: `keys` holds `lanes` rows of d fp32
  /// values (row l = key l, d <= 256; rows past the block's keys hold 0); z[l] for l < nk. Each key's sums run in the reference's order
  /// (mean dot over i, t[k] over i, the quadratic form over k; each term one fused multiply-add). cov: nullptr drops the term.
  void (*expected_logits_block)(const float* mean, const float* cov, std::int64_t d, const float* keys, std::int64_t nk, float sqrt_d,
                                float* z) noexcept;
  /// `ScalarReduceOps::outer_upper_accumulate`: block[i * d + j] += c[t * d + i] * c[t * d + j] for
  /// t < n in order, j >= i (entries j < i of a row may be written; the reference leaves them alone).
  void (*outer_upper_accumulate)(const float* c, std::int64_t n, std::int64_t d, float* block) noexcept;
  /// `outer_upper_accumulate` on a zero block, then `add_upper_f64` of it into acc, without the block.
  void (*outer_upper_add_f64)(const float* c, std::int64_t n, std::int64_t d, double* acc) noexcept;
  /// `ScalarReduceOps::accumulate_rows_f64`, `centre_rows`, `add_upper_f64` (the same double operations).
  void (*accumulate_rows_f64)(const float* x, std::int64_t n, std::int64_t d, double* acc) noexcept;
  void (*centre_rows)(float* x, std::int64_t n, std::int64_t d, const double* mu) noexcept;
  void (*add_upper_f64)(const float* block, std::int64_t d, double* acc) noexcept;
  /// `ScalarReduceOps::row_norm` of 16 rows (rows: 16 x d fp32, d <= 256; rows past the caller's count
  /// hold 0): out[l] = -float(sqrt(sum over i ascending of double(x)^2)), each row's sum in the reference's
  /// order (lanes run across rows).
  void (*neg_norms16)(const float* rows, std::int64_t d, float* out) noexcept;
  /// Lanes of one expected_logits_block (the SIMD width in floats).
  std::int64_t lanes;
};

KVP_CPU_DECLARE_KERNELS(ReduceKernels, reduce_kernels)

}  // namespace cpu_detail
KVP_NAMESPACE_END
