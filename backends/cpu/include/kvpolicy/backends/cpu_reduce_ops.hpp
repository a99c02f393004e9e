// SPDX-License-Identifier: Apache-2.0
// `backend::CpuReduceOps`: the row reductions of the online policies (the
// one-victim argmin and NaN scans of H2O / TOVA, TOVA's head mean) and the
// merging policies' row dot products on the
// level chosen at run time (AVX-512 / AVX2 / SSE2 kernels in
// src/reduce_ops_<isa>.cpp). Results are identical to `ScalarReduceOps`
// (comparisons and element-wise fp32 in the same order); every other row
// reduction falls back to it by inheritance.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kvpolicy/core/tensor_view.hpp"
#include "kvpolicy/ops/reduce_scalar.hpp"

KVP_NAMESPACE_BEGIN
namespace backend {

struct CpuReduceOps : ScalarReduceOps {
  static bool has_nan(const float* x, std::int64_t n) noexcept;
  static std::int64_t argmin_or_nan(const float* x, std::int64_t n, std::int64_t* at) noexcept;
  /// `ScalarReduceOps::widen_row`, bit for bit: fp16 through F16C where the level has it.
  template <class T>
  static void widen_row(const T* x, std::int64_t n, float* out) noexcept {
    if constexpr (std::is_same_v<T, half>) {
      if (n > 0) widen_f16(reinterpret_cast<const std::uint16_t*>(x), n, out);
    } else {
      ScalarReduceOps::widen_row(x, n, out);
    }
  }
  /// `ScalarReduceOps::row_dots`, bit for bit (16 partial sums, no fused multiply-add).
  static void row_dots(const float* q, const float* rows, std::int64_t n, std::int64_t d, float* out) noexcept;

  /// `ScalarReduceOps::expected_logits`, bit for bit: keys in blocks of the level's lane count
  /// (lanes run across keys, so each key's sums keep the reference's order); head_dim > 256: the reference.
  template <class Tk>
  static float expected_logits(const float* mean, const float* cov, std::int64_t d, const Rows<Tk>& keys, std::int64_t j0, std::int64_t j1,
                               float* z, float* scratch) noexcept {
    constexpr std::int64_t kMaxDim = 256, kMaxLanes = 16;
    const std::int64_t L = expected_lanes();
    if (d > kMaxDim || L > kMaxLanes || d < 1) return ScalarReduceOps::expected_logits(mean, cov, d, keys, j0, j1, z, scratch);
    (void)scratch;
    alignas(64) float kr[kMaxDim * kMaxLanes];  // the block's keys as fp32 rows (the kernel transposes them)
    const float sqrt_d = static_cast<float>(std::sqrt(static_cast<double>(d)));
    float mx = -std::numeric_limits<float>::infinity();
    for (std::int64_t j = j0; j < j1; j += L) {
      const std::int64_t nk = j1 - j < L ? j1 - j : L;
      if (keys.pages == nullptr && keys.row_stride == d) {  // contiguous rows: one widening call
        widen_row(keys.row(j), nk * d, kr);
      } else {
        for (std::int64_t l = 0; l < nk; ++l) widen_row(keys.row(j + l), d, kr + l * d);
      }
      if (nk < L) std::fill(kr + nk * d, kr + L * d, 0.0f);
      expected_block(mean, cov, d, kr, nk, sqrt_d, z + j);
      for (std::int64_t l = 0; l < nk; ++l) mx = std::max(mx, z[j + l]);
    }
    return mx;
  }
  /// `ScalarReduceOps::neg_row_norms`, bit for bit: fp32 / fp16 rows (d <= 256) 16 at a time, lanes across
  /// rows, so each row's double sum keeps the reference's order; other dtypes and widths: the reference.
  template <class T>
  static void neg_row_norms(const Rows<T>& rows, std::int64_t n, std::int64_t d, float* out, std::int64_t stride) noexcept {
    constexpr std::int64_t kMaxDim = 256;
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, half>) {
      if (d >= 1 && d <= kMaxDim) {
        alignas(64) float kr[kMaxDim * 16];
        float nrm[16];
        for (std::int64_t j = 0; j < n; j += 16) {
          const std::int64_t nb = n - j < 16 ? n - j : 16;
          if (rows.pages == nullptr && rows.row_stride == d) {
            widen_row(rows.row(j), nb * d, kr);
          } else {
            for (std::int64_t l = 0; l < nb; ++l) widen_row(rows.row(j + l), d, kr + l * d);
          }
          if (nb < 16) std::fill(kr + nb * d, kr + 16 * d, 0.0f);
          neg_norms16(kr, d, nrm);
          for (std::int64_t l = 0; l < nb; ++l) out[(j + l) * stride] = nrm[l];
        }
        return;
      }
    }
    ScalarReduceOps::neg_row_norms(rows, n, d, out, stride);
  }
  /// `ScalarReduceOps::outer_upper_accumulate`, bit for bit (register tiles held across the tokens).
  static void outer_upper_accumulate(const float* c, std::int64_t n, std::int64_t d, float* block) noexcept;
  /// `outer_upper_accumulate` on a zero block followed by `add_upper_f64` of that block into acc (entries
  /// j >= i; the others are left alone), bit for bit, without the block: each register tile's sums go into
  /// acc where they are. Expected Attention's statistics use it in place of the two steps.
  static void outer_upper_add_f64(const float* c, std::int64_t n, std::int64_t d, double* acc) noexcept;
  /// `ScalarReduceOps::accumulate_rows_f64`, `centre_rows` and `add_upper_f64`, bit for bit (vectors of doubles).
  static void accumulate_rows_f64(const float* x, std::int64_t n, std::int64_t d, double* acc) noexcept;
  static void centre_rows(float* x, std::int64_t n, std::int64_t d, const double* mu) noexcept;
  static void add_upper_f64(const float* block, std::int64_t d, double* acc) noexcept;

  /// fp32 rows contiguous along j: the vectorised kernel; other dtypes / strides: the reference.
  template <class Tp>
  static void mean_rows(const TensorView<const Tp, 2> rows, float* mean) noexcept {
    if constexpr (std::is_same_v<Tp, float>) {
      if (rows.stride(1) == 1 || rows.extent(1) <= 1) {
        mean_rows_f32(rows.data(), rows.extent(0), rows.stride(0), rows.extent(1), mean);
        return;
      }
    }
    ScalarReduceOps::mean_rows(rows, mean);
  }

 private:
  static std::int64_t expected_lanes() noexcept;
  static void expected_block(const float* mean, const float* cov, std::int64_t d, const float* keys, std::int64_t nk, float sqrt_d,
                             float* z) noexcept;
  static void widen_f16(const std::uint16_t* x, std::int64_t n, float* out) noexcept;
  static void neg_norms16(const float* rows, std::int64_t d, float* out) noexcept;
  static void mean_rows_f32(const float* rows, std::int64_t H, std::int64_t ld, std::int64_t n, float* mean) noexcept;
};

}  // namespace backend
KVP_NAMESPACE_END
