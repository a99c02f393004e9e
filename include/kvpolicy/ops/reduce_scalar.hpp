// SPDX-License-Identifier: Apache-2.0
// `backend::ScalarReduceOps`: the small row kernels policies share — query
// widening to fp32, NaN scans, the one-victim argmin of the online policies,
// protected-token counts and the head mean of probability rows. Written so
// the compiler vectorises them (independent lanes, no early exits in the hot
// loop); a backend may hide any of them like the other op families.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/tensor_view.hpp"

KVP_NAMESPACE_BEGIN
namespace backend {

struct ScalarReduceOps {
  // ---- query widening --------------------------------------------------------

  /// dst[(g * rows + i) * d + k] = fp32(q(h0 + g, i0 + i, k)) for g < group,
  /// i < rows, k < d: the query block one kv head's ops read, contiguous.
  template <class Tq>
  static void widen_queries(const TensorView<const Tq, 3>& q, std::int64_t h0, std::int64_t group, std::int64_t i0, std::int64_t rows,
                            float* dst) noexcept {
    const std::int64_t d = q.extent(2);
    for (std::int64_t g = 0; g < group; ++g)
      for (std::int64_t i = 0; i < rows; ++i) {
        const Tq* src = q.data() + (h0 + g) * q.stride(0) + (i0 + i) * q.stride(1);
        float* out = dst + (g * rows + i) * d;
        const std::int64_t s2 = q.stride(2);
        for (std::int64_t k = 0; k < d; ++k) out[k] = to_float(src[k * s2]);
      }
  }

  // ---- protected tokens and head means --------------------------------------

  /// Number of protected (+inf) scores in a row.
  static std::int64_t count_protected(const float* s, std::int64_t n) noexcept {
    std::int64_t p = 0;
    for (std::int64_t j = 0; j < n; ++j) p += (s[j] == std::numeric_limits<float>::infinity()) ? 1 : 0;
    return p;
  }

  /// mean[j] = (1 / H) * sum_h rows(h, j), heads summed in ascending order in fp32.
  template <class Tp>
  static void mean_rows(const TensorView<const Tp, 2>& rows, float* mean) noexcept {
    const std::int64_t Hq = rows.extent(0), n = rows.extent(1);
    const std::int64_t st = rows.stride(1);
    for (std::int64_t j = 0; j < n; ++j) mean[j] = to_float(rows.data()[j * st]);
    for (std::int64_t h = 1; h < Hq; ++h) {
      const Tp* r = rows.data() + h * rows.stride(0);
      for (std::int64_t j = 0; j < n; ++j) mean[j] += to_float(r[j * st]);
    }
    const float hf = static_cast<float>(Hq);
    for (std::int64_t j = 0; j < n; ++j) mean[j] /= hf;
  }

  // ---- NaN scans and the one-victim selection --------------------------------
  // Shared by the online policies (H2O, TOVA): evicting a single slot of a
  // top-(n-1) is an argmin under the same total order.

  static bool has_nan(const float* x, std::int64_t n) noexcept {
    constexpr std::int64_t kL = 32;
    int bad[kL] = {};
    const std::int64_t body = n - n % kL;
    for (std::int64_t j = 0; j < body; j += kL)
      for (int l = 0; l < kL; ++l) bad[l] |= x[j + l] != x[j + l];
    for (std::int64_t j = body; j < n; ++j) bad[0] |= x[j] != x[j];
    int any = 0;
    for (int v : bad) any |= v;
    return any != 0;
  }
  static std::int64_t first_nan(const float* x, std::int64_t n) noexcept {
    for (std::int64_t j = 0; j < n; ++j)
      if (x[j] != x[j]) return j;
    return 0;
  }

  /// First j < n with pred(x[j]), or -1: a vectorisable any-test per block of
  /// 256, then a scan inside the first matching block.
  template <class Pred>
  static std::int64_t first_where(const float* x, std::int64_t n, Pred pred) noexcept {
    constexpr std::int64_t kB = 256;
    for (std::int64_t b0 = 0; b0 < n; b0 += kB) {
      const std::int64_t nb = std::min(kB, n - b0);
      int any = 0;
      for (std::int64_t j = 0; j < nb; ++j) any |= pred(x[b0 + j]) ? 1 : 0;
      if (any)
        for (std::int64_t j = 0; j < nb; ++j)
          if (pred(x[b0 + j])) return b0 + j;
    }
    return -1;
  }

  /// Lowest slot of the minimum of x[0..n) under score_order_key (the slot a
  /// top-(n-1) drops); returns -1 and sets *at, or returns 0 when x holds NaN.
  /// One pass of block minima over 32 independent lanes (enough accumulators for
  /// the compiler to vectorise and hide the min latency), then a search inside
  /// the first block that holds the minimum.
  static std::int64_t argmin_or_nan(const float* x, std::int64_t n, std::int64_t* at) noexcept {
    constexpr std::int64_t kB = 1024, kL = 32;
    float best = std::numeric_limits<float>::infinity();
    std::int64_t best_block = 0;
    int bad_any = 0;
    for (std::int64_t b0 = 0; b0 < n; b0 += kB) {
      const std::int64_t nb = std::min(kB, n - b0);
      float m[kL];
      int bad[kL] = {};
      for (float& v : m) v = std::numeric_limits<float>::infinity();
      std::int64_t j = 0;
      for (; j + kL <= nb; j += kL)
        for (int l = 0; l < kL; ++l) {
          const float v = x[b0 + j + l];
          m[l] = v < m[l] ? v : m[l];
          bad[l] |= v != v;
        }
      for (; j < nb; ++j) {
        const float v = x[b0 + j];
        m[0] = v < m[0] ? v : m[0];
        bad[0] |= v != v;
      }
      float bm = m[0];
      for (int l = 0; l < kL; ++l) {
        bm = m[l] < bm ? m[l] : bm;
        bad_any |= bad[l];
      }
      if (bm < best) best = bm, best_block = b0;
    }
    const int bad = bad_any;
    if (bad) return 0;
    if (best == 0.0f) {  // -0 ranks below +0 in the total order: the first -0 if any, else the first +0
      std::int64_t j = first_where(x, n, [](float v) { return std::bit_cast<std::uint32_t>(v) == 0x80000000u; });
      *at = j >= 0 ? j : first_where(x, n, [](float v) { return v == 0.0f; });
      return -1;
    }
    std::int64_t j = best_block;
    while (x[j] != best) ++j;  // best occurs in its block (all-+inf rows: block 0)
    *at = j;
    return -1;
  }
};

}  // namespace backend
KVP_NAMESPACE_END
