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
#include "kvpolicy/core/rows.hpp"
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
  /// (By value: a view read through a reference could alias `mean` and stop
  /// the compiler from vectorising.)
  template <class Tp>
  static void mean_rows(const TensorView<const Tp, 2> rows, float* mean) noexcept {
    const std::int64_t Hq = rows.extent(0), n = rows.extent(1), st = rows.stride(1), s0 = rows.stride(0);
    const Tp* const base = rows.data();
    for (std::int64_t j = 0; j < n; ++j) mean[j] = to_float(base[j * st]);
    for (std::int64_t h = 1; h < Hq; ++h) {
      const Tp* r = base + h * s0;
      for (std::int64_t j = 0; j < n; ++j) mean[j] += to_float(r[j * st]);
    }
    const float hf = static_cast<float>(Hq);
    for (std::int64_t j = 0; j < n; ++j) mean[j] /= hf;
  }

  /// state[j] = (j < len_prev ? state[j] : 0) + reduce_{g<G} sum_i p[h0+g, i, j]
  /// (reduce = sum, or mean with `mean_over_group`), for j < p.extent(2): the column-sum
  /// accumulation of online attention scores (H2O). fp32, in blocks that stay
  /// in L1; order: rows i ascending, then the group ascending, then / G, then
  /// added to the state (h2o.hpp pins it bit for bit). Rows contiguous along j.
  template <class Tp>
  static void accumulate_column_sums(float* state, std::int64_t len_prev, const TensorView<const Tp, 3>& p, std::int64_t h0, std::int64_t G,
                                     bool mean_over_group) noexcept {
    constexpr std::int64_t kBlock = 1024;
    alignas(64) float r[kBlock];
    alignas(64) float c[kBlock];
    const std::int64_t n = p.extent(2), rows = p.extent(1);
    const bool mean = mean_over_group && G > 1;
    const float gf = static_cast<float>(G);
    for (std::int64_t j0 = 0; j0 < n; j0 += kBlock) {
      const std::int64_t nb = std::min(kBlock, n - j0);
      for (std::int64_t g = 0; g < G; ++g) {
        const Tp* src = p.data() + (h0 + g) * p.stride(0) + j0;
        if (g > 0 && rows == 1) {  // c == row 0 exactly: add it straight into r
          for (std::int64_t k = 0; k < nb; ++k) r[k] += to_float(src[k]);
          continue;
        }
        float* dst = g == 0 ? r : c;
        for (std::int64_t k = 0; k < nb; ++k) dst[k] = to_float(src[k]);
        for (std::int64_t i = 1; i < rows; ++i) {
          const Tp* row = src + i * p.stride(1);
          for (std::int64_t k = 0; k < nb; ++k) dst[k] += to_float(row[k]);
        }
        if (g > 0)
          for (std::int64_t k = 0; k < nb; ++k) r[k] += c[k];
      }
      if (mean)
        for (std::int64_t k = 0; k < nb; ++k) r[k] /= gf;
      float* s = state + j0;
      const std::int64_t split = std::clamp<std::int64_t>(len_prev - j0, 0, nb);
      for (std::int64_t k = 0; k < split; ++k) s[k] += r[k];
      for (std::int64_t k = split; k < nb; ++k) s[k] = r[k];
    }
  }

  // ---- expected attention (Gaussian future queries) -------------------------

  /// Expected logits of keys j in [j0, j1) under a Gaussian query with
  /// (rotated) mean `mean` and covariance `cov` (d x d, row-major; nullptr
  /// drops the term): z[j] = <mean, k_j> / sqrt(d) + k_j^T cov k_j / (2 d),
  /// fp32 with the quadratic form as t = sum_i k_i cov[i, :] then <t, k>.
  /// Every sum adds its terms in index order through a fused multiply-add
  /// (std::fma: the product is not rounded before the add), the operation the
  /// CPU kernels (FMA3 / AVX-512) and the device (__fmaf_rn) run natively, so
  /// all of them give these bits.
  /// Returns max_j z[j] (-inf for an empty range). `scratch`: 2 d floats.
  template <class Tk>
  static float expected_logits(const float* mean, const float* cov, std::int64_t d, const Rows<Tk>& keys, std::int64_t j0, std::int64_t j1,
                               float* z, float* scratch) noexcept {
    float* kf = scratch;
    float* t = scratch + d;
    const float sqrt_d = static_cast<float>(std::sqrt(static_cast<double>(d)));
    float mx = -std::numeric_limits<float>::infinity();
    for (std::int64_t j = j0; j < j1; ++j) {
      const Tk* kr = keys.row(j);
      for (std::int64_t i = 0; i < d; ++i) kf[i] = to_float(kr[i]);
      float dot = 0.0f;
      for (std::int64_t i = 0; i < d; ++i) dot = std::fma(mean[i], kf[i], dot);
      float zj = dot / sqrt_d;
      if (cov != nullptr) {
        std::fill(t, t + d, 0.0f);
        for (std::int64_t i = 0; i < d; ++i) {
          const float* row = cov + i * d;
          const float ki = kf[i];
          for (std::int64_t k = 0; k < d; ++k) t[k] = std::fma(ki, row[k], t[k]);
        }
        float quad = 0.0f;
        for (std::int64_t k = 0; k < d; ++k) quad = std::fma(t[k], kf[k], quad);
        zj += quad / static_cast<float>(d) / 2.0f;
      }
      z[j] = zj;
      mx = std::max(mx, zj);
    }
    return mx;
  }

  /// Column sums in double: for rows r < n in order, acc[i] += double(x[r * d + i]) (i < d).
  static void accumulate_rows_f64(const float* x, std::int64_t n, std::int64_t d, double* acc) noexcept {
    for (std::int64_t r = 0; r < n; ++r)
      for (std::int64_t i = 0; i < d; ++i) acc[i] += static_cast<double>(x[r * d + i]);
  }
  /// Rows centred in double and rounded back: x[r * d + i] = float(double(x[r * d + i]) - mu[i]) (r < n).
  static void centre_rows(float* x, std::int64_t n, std::int64_t d, const double* mu) noexcept {
    for (std::int64_t r = 0; r < n; ++r)
      for (std::int64_t i = 0; i < d; ++i) x[r * d + i] = static_cast<float>(static_cast<double>(x[r * d + i]) - mu[i]);
  }
  /// The upper triangle of a d x d fp32 block added to a double one: acc[i * d + j] += block[i * d + j], j >= i.
  static void add_upper_f64(const float* block, std::int64_t d, double* acc) noexcept {
    for (std::int64_t i = 0; i < d; ++i)
      for (std::int64_t j = i; j < d; ++j) acc[i * d + j] += static_cast<double>(block[i * d + j]);
  }

  /// Covariance products of n centred rows c (n x d, row-major): for t < n in order,
  /// block[i * d + j] += c[t * d + i] * c[t * d + j] for j >= i (fp32, one fused multiply-add: std::fma).
  static void outer_upper_accumulate(const float* c, std::int64_t n, std::int64_t d, float* block) noexcept {
    for (std::int64_t t = 0; t < n; ++t) {
      const float* ct = c + t * d;
      for (std::int64_t i = 0; i < d; ++i) {
        const float ci = ct[i];
        float* row = block + i * d;
        for (std::int64_t j = i; j < d; ++j) row[j] = std::fma(ci, ct[j], row[j]);
      }
    }
  }

  /// Softmax of z[j0, j1) given its max, accumulated: z[j] = exp(z[j] - mx)
  /// (the denominator summed in double), s[j] += z[j] / denominator.
  static void softmax_accumulate(float* z, std::int64_t j0, std::int64_t j1, float mx, float* s) noexcept {
    double denom = 0.0;
    for (std::int64_t j = j0; j < j1; ++j) {
      z[j] = std::exp(z[j] - mx);
      denom += z[j];
    }
    const float inv = static_cast<float>(1.0 / denom);
    for (std::int64_t j = j0; j < j1; ++j) s[j] += z[j] * inv;
  }

  /// Euclidean norm of a row of d values, accumulated in double.
  template <class T>
  static float row_norm(const T* v, std::int64_t d) noexcept {
    double ss = 0.0;
    for (std::int64_t i = 0; i < d; ++i) {
      const double x = to_float(v[i]);
      ss += x * x;
    }
    return static_cast<float>(std::sqrt(ss));
  }

  /// out[j * stride] = -row_norm(rows.row(j), d) for j < n: Knorm's scores,
  /// written straight into a score row.
  template <class T>
  static void neg_row_norms(const Rows<T>& rows, std::int64_t n, std::int64_t d, float* out, std::int64_t stride) noexcept {
    for (std::int64_t j = 0; j < n; ++j) out[j * stride] = -row_norm(rows.row(j), d);
  }

  /// out[i] = x[i] widened to fp32 (exact), i < n.
  template <class T>
  static void widen_row(const T* x, std::int64_t n, float* out) noexcept {
    for (std::int64_t i = 0; i < n; ++i) out[i] = to_float(x[i]);
  }

  /// The sum of 16 partial sums in the library's fixed tree:
  /// ((p0+p8)+(p4+p12)) + ((p2+p10)+(p6+p14)) + ((p1+p9)+(p5+p13)) + ((p3+p11)+(p7+p15)), as below.
  static float sum16(const float* p) noexcept {
    float s8[8], s4[4];
    for (int k = 0; k < 8; ++k) s8[k] = p[k] + p[k + 8];
    for (int k = 0; k < 4; ++k) s4[k] = s8[k] + s8[k + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
  }

  /// out[i] = <q, rows[i*d .. i*d + d)> for i < n (fp32, rows contiguous, row stride d) in one fixed
  /// order every backend reproduces bit for bit: 16 partial sums p[k] over the channels c = k (mod 16),
  /// each product rounded then added (no fused multiply-add), then `sum16`. (The merging policies'
  /// cosine searches.)
  static void row_dots(const float* q, const float* rows, std::int64_t n, std::int64_t d, float* out) noexcept {
    for (std::int64_t i = 0; i < n; ++i) {
      const float* r = rows + i * d;
      float p[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
      for (std::int64_t c = 0; c < d; ++c) p[c % 16] += q[c] * r[c];
      out[i] = sum16(p);
    }
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
  /// An empty row (n <= 0) has no victim: -1 and *at = -1.
  /// One pass of block minima over 32 independent lanes (enough accumulators for
  /// the compiler to vectorise and hide the min latency), then a search inside
  /// the first block that holds the minimum.
  static std::int64_t argmin_or_nan(const float* x, std::int64_t n, std::int64_t* at) noexcept {
    constexpr std::int64_t kB = 1024, kL = 32;
    if (n <= 0) {
      *at = -1;
      return -1;
    }
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
