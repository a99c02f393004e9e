// SPDX-License-Identifier: Apache-2.0
// The ops contract, as the portable scalar reference (`backend::Scalar`).
//
// Every op works on one (sequence, kv head) unit so policies can split work
// over (sequence, head) freely. Ops are `noexcept` and assume validated
// inputs: the policies validate at their entry points and then call ops.
// Ops come in families (structs); a backend derives its family struct from
// the scalar one and hides the ops it specialises, so anything it does not
// implement falls back to the reference by inheritance. A policy calls
// `Backend::op(...)` and gets the fastest available version.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kvpolicy/core/config.hpp"
#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/rows.hpp"
#include "kvpolicy/core/workspace.hpp"
#include "kvpolicy/ops/merge_scalar.hpp"
#include "kvpolicy/ops/order_key.hpp"
#include "kvpolicy/ops/paged_scalar.hpp"
#include "kvpolicy/ops/quant_scalar.hpp"
#include "kvpolicy/ops/reduce_scalar.hpp"
#include "kvpolicy/ops/types.hpp"

KVP_NAMESPACE_BEGIN

namespace detail {

/// Windows up to this size are sorted in a stack buffer by avg pooling; larger
/// ones are visited in ascending order by repeated selection (no buffer).
inline constexpr std::int64_t kPoolSortBuffer = 64;

/// Sum of in[lo..hi] taken in ascending order of value, starting from +0.0f;
/// NaN if any value is NaN. The result depends only on the multiset of the
/// window's values, not on their order, so two tokens whose windows hold the
/// same values in different positions pool to bit-identical scores on every
/// backend (the CPU kernels sort the same way; see `pool1d`). Equal values
/// are interchangeable, and -0 / +0 add alike to a sum that starts at +0.
/// Host and device: `backend::Cuda::pool1d` runs this same function.
KVP_HOST_DEVICE inline float ascending_sum(const float* in, std::int64_t lo, std::int64_t hi) noexcept {
  const std::int64_t n = hi - lo + 1;
  for (std::int64_t u = lo; u <= hi; ++u)
    if (in[u] != in[u]) {
#if defined(__CUDA_ARCH__)
      return __int_as_float(0x7fc00000);  // the host's quiet_NaN
#else
      return std::numeric_limits<float>::quiet_NaN();
#endif
    }
  float acc = 0.0f;
  if (n <= kPoolSortBuffer) {
    float b[kPoolSortBuffer];
    for (std::int64_t i = 0; i < n; ++i) {  // insertion sort
      const float x = in[lo + i];
      std::int64_t j = i;
      for (; j > 0 && b[j - 1] > x; --j) b[j] = b[j - 1];
      b[j] = x;
    }
    for (std::int64_t i = 0; i < n; ++i) acc += b[i];
    return acc;
  }
  bool first = true;
  float prev = 0.0f;
  for (;;) {  // each distinct value, ascending, added as often as it occurs
    bool found = false;
    float cur = 0.0f;
    for (std::int64_t u = lo; u <= hi; ++u) {
      const float x = in[u];
      if ((first || x > prev) && (!found || x < cur)) {
        cur = x;
        found = true;
      }
    }
    if (!found) return acc;
    for (std::int64_t u = lo; u <= hi; ++u)
      if (in[u] == cur) acc += cur;
    prev = cur;
    first = false;
  }
}

}  // namespace detail

/// Shape and semantics of `window_scores` for one kv head.
///
/// Queries are the `num_q = group * window` rows `q[(g*window + i), :]`, fp32,
/// contiguous `(group*window, head_dim)`. Query i of the window sits at
/// absolute position `q_pos0 + i` and sees key j iff `j <= q_pos0 + i`
/// (causal). For each query row the softmax runs in fp32 over all visible keys
/// of `[0, kv_len)`; the output is, for head g of the group and key j < num_cols,
/// `out[g*num_cols + j] = reduce_i softmax_i(j)` (mean or sum over the window).
struct WindowScoreShape {
  std::int64_t group = 1;     ///< G query heads sharing this kv head
  std::int64_t window = 1;    ///< w queries per head
  std::int64_t head_dim = 0;  ///< d
  std::int64_t kv_len = 0;    ///< T keys (softmax denominator runs over all visible keys)
  std::int64_t num_cols = 0;  ///< L <= T: columns written to the output
  std::int64_t q_pos0 = 0;    ///< absolute position of window query 0 (causal offset)
  float scale = 1.0f;         ///< logit scale, usually 1/sqrt(d)
  WindowReduce reduce = WindowReduce::kMean;
};

namespace backend {

/// Scoring / selection ops of the contract (window attention, pooling, group
/// reduction, top-k, gather). Backends specialise by deriving from this
/// struct and hiding the members they implement.
struct ScalarScoreOps {
  // ---- window attention -------------------------------------------------

  static std::size_t window_scores_workspace(const WindowScoreShape& s) noexcept {
    return WorkspacePlan{}.add<float>(static_cast<std::size_t>(s.kv_len)).total();
  }

  /// out: (group, num_cols) fp32, contiguous. See WindowScoreShape.
  template <class Tk>
  static void window_scores(const WindowScoreShape& s, const float* q, Rows<Tk> keys, float* out, Workspace ws) noexcept {
    WorkspaceCarver carve(ws);
    float* row = carve.take<float>(static_cast<std::size_t>(s.kv_len));
    const float inv_w = s.reduce == WindowReduce::kMean ? 1.0f / static_cast<float>(s.window) : 1.0f;
    for (std::int64_t g = 0; g < s.group; ++g) {
      float* o = out + g * s.num_cols;
      std::fill(o, o + s.num_cols, 0.0f);
      for (std::int64_t i = 0; i < s.window; ++i) {
        const float* qi = q + (g * s.window + i) * s.head_dim;
        const std::int64_t visible = std::min<std::int64_t>(s.kv_len, s.q_pos0 + i + 1);
        float mx = -std::numeric_limits<float>::infinity();
        for (std::int64_t j = 0; j < visible; ++j) {
          const Tk* kj = keys.row(j);
          float acc = 0.0f;
          for (std::int64_t c = 0; c < s.head_dim; ++c) acc += qi[c] * to_float(kj[c]);
          row[j] = acc * s.scale;
          mx = std::max(mx, row[j]);
        }
        double denom = 0.0;
        for (std::int64_t j = 0; j < visible; ++j) {
          row[j] = std::exp(row[j] - mx);
          denom += row[j];
        }
        const float inv = static_cast<float>(1.0 / denom) * inv_w;
        const std::int64_t cols = std::min(visible, s.num_cols);
        for (std::int64_t j = 0; j < cols; ++j) o[j] += row[j] * inv;
      }
    }
  }

  // ---- pooling / reductions ---------------------------------------------

  /// out[t] = pool over in[t-k/2 .. t+k/2] (stride 1, pad k/2), k odd.
  /// kAvg divides by k always (zero padding counted); kMax ignores padding.
  /// kAvg sums each window in ascending order of value (`detail::ascending_sum`),
  /// not left to right as torch's avg_pool1d does: the two differ by float
  /// rounding only, and the ascending order makes a window's mean a function of
  /// its values alone, so exact ties (repeated tokens) stay exact and decide the
  /// same way on every backend and ISA level.
  static void pool1d(const float* in, std::int64_t n, int kernel, Pooling kind, float* out) noexcept {
    if (kind == Pooling::kNone || kernel <= 1) {
      if (n > 0) std::memmove(out, in, static_cast<std::size_t>(n) * sizeof(float));
      return;
    }
    const std::int64_t r = kernel / 2;
    for (std::int64_t t = 0; t < n; ++t) {
      const std::int64_t lo = std::max<std::int64_t>(0, t - r), hi = std::min<std::int64_t>(n - 1, t + r);
      if (kind == Pooling::kAvg) {
        out[t] = detail::ascending_sum(in, lo, hi) / static_cast<float>(kernel);
      } else {
        float m = in[lo];
        for (std::int64_t u = lo + 1; u <= hi; ++u) m = (in[u] > m || m != m) ? in[u] : m;
        out[t] = m;
      }
    }
  }

  /// out[j] = reduce_g in[g*ld + j] over g < group.
  static void group_reduce(const float* in, std::int64_t group, std::int64_t n, std::int64_t ld, GroupReduce kind, float* out) noexcept {
    for (std::int64_t j = 0; j < n; ++j) {
      float acc = in[j];
      for (std::int64_t g = 1; g < group; ++g) {
        const float v = in[g * ld + j];
        acc = kind == GroupReduce::kMax ? ((v > acc || acc != acc) ? v : acc) : acc + v;
      }
      out[j] = kind == GroupReduce::kMean ? acc / static_cast<float>(group) : acc;
    }
  }

  // ---- top-k ------------------------------------------------------------

  static std::size_t topk_workspace(std::int64_t n) noexcept {
    return WorkspacePlan{}.add<std::uint64_t>(static_cast<std::size_t>(n)).total();
  }

  /// The k best of scores[0..n) under `score_order_key` (ties: higher index),
  /// written to out[0..k) in ascending index order. 0 <= k <= n.
  static void topk(const float* scores, std::int64_t n, std::int64_t k, std::int32_t* out, Workspace ws) noexcept {
    if (k <= 0) return;
    if (k >= n) {
      for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<std::int32_t>(i);
      return;
    }
    WorkspaceCarver carve(ws);
    std::uint64_t* keys = carve.take<std::uint64_t>(static_cast<std::size_t>(n));
    // (score key, index) packed so a plain integer comparison is the total order.
    for (std::int64_t i = 0; i < n; ++i)
      keys[i] = (static_cast<std::uint64_t>(score_order_key(scores[i])) << 32) | static_cast<std::uint64_t>(i);
    std::nth_element(keys, keys + (k - 1), keys + n, [](std::uint64_t a, std::uint64_t b) { return a > b; });
    for (std::int64_t i = 0; i < k; ++i) out[i] = static_cast<std::int32_t>(keys[i] & 0xffffffffu);
    std::sort(out, out + k);
  }

  // ---- tiers (MixedPrecision) ---------------------------------------------

  static std::size_t rank_tiers_workspace(std::int64_t n) noexcept {
    return WorkspacePlan{}.add<std::uint64_t>(static_cast<std::size_t>(n)).total();
  }

  /// Per row r < rows of n scores (scores + r * ld): the n_keep best, ranked by score descending then
  /// position ascending (-0 equals +0; NaN ranks below every number), written to idx + r * out_ld in
  /// ascending positions, with tier[r * out_ld + i] = 1 when idx's token is among the n_full best, else 0.
  /// 0 <= n_full <= n_keep <= n.
  static void rank_tiers(const float* scores, std::int64_t rows, std::int64_t n, std::int64_t ld, std::int64_t n_keep, std::int64_t n_full,
                         std::int32_t* idx, std::uint8_t* tier, std::int64_t out_ld, Workspace ws) noexcept {
    if (n_keep <= 0) return;
    WorkspaceCarver carve(ws);
    std::uint64_t* keys = carve.take<std::uint64_t>(static_cast<std::size_t>(n));
    for (std::int64_t r = 0; r < rows; ++r) {
      const float* s = scores + r * ld;
      // (tier key, reversed position): a plain integer comparison is the ranking.
      for (std::int64_t i = 0; i < n; ++i)
        keys[i] = (static_cast<std::uint64_t>(tier_order_key(s[i])) << 32) | static_cast<std::uint64_t>(n - 1 - i);
      const auto better = [](std::uint64_t a, std::uint64_t b) { return a > b; };
      if (n_keep < n) std::nth_element(keys, keys + (n_keep - 1), keys + n, better);
      if (n_full > 0 && n_full < n_keep) std::nth_element(keys, keys + (n_full - 1), keys + n_keep, better);
      // Position and tier in one key, sorted ascending by position.
      std::int32_t* o = idx + r * out_ld;
      for (std::int64_t k = 0; k < n_keep; ++k)
        o[k] = static_cast<std::int32_t>((n - 1 - static_cast<std::int64_t>(keys[k] & 0xffffffffu)) * 2 + (k < n_full ? 1 : 0));
      std::sort(o, o + n_keep);
      std::uint8_t* t = tier + r * out_ld;
      for (std::int64_t k = 0; k < n_keep; ++k) {
        t[k] = static_cast<std::uint8_t>(o[k] % 2);
        o[k] /= 2;
      }
    }
  }

  // ---- gather -----------------------------------------------------------

  /// dst row r = src row idx[r] for r < n (rows of `dim` elements).
  template <class T>
  static void gather_rows(Rows<T> src, const std::int32_t* idx, std::int64_t n, std::int64_t dim, T* dst,
                          std::int64_t dst_row_stride) noexcept {
    for (std::int64_t r = 0; r < n; ++r) std::memcpy(dst + r * dst_row_stride, src.row(idx[r]), static_cast<std::size_t>(dim) * sizeof(T));
  }

  // ---- writes into outputs ------------------------------------------------
  // Policies write every output element through these (never a host loop),
  // so an output in device memory is written by the device on `backend::Cuda`.

  /// dst[i] = first + i for i < n (kept-token and page ids).
  static void iota(std::int32_t* dst, std::int64_t first, std::int64_t n) noexcept {
    for (std::int64_t i = 0; i < n; ++i) dst[i] = static_cast<std::int32_t>(first + i);
  }

  /// dst[i * dst_stride] = value for i < n.
  static void fill(float* dst, std::int64_t n, std::int64_t dst_stride, float value) noexcept {
    for (std::int64_t i = 0; i < n; ++i) dst[i * dst_stride] = value;
  }

  /// dst[i * dst_stride] = src[i] for i < n.
  static void copy_strided(const float* src, std::int64_t n, float* dst, std::int64_t dst_stride) noexcept {
    for (std::int64_t i = 0; i < n; ++i) dst[i * dst_stride] = src[i];
  }

  // ---- row edits of the online policies (device-friendly forms) --------------
  // H2O's and TOVA's decode-step edits as ops that write memory and return
  // nothing, so a device backend runs them without a host round trip.

  /// dst[i] += src[i] for i < n.
  static void add_rows(float* dst, const float* src, std::int64_t n) noexcept {
    for (std::int64_t i = 0; i < n; ++i) dst[i] += src[i];
  }

  /// s[j] /= (n - j) for j < n: a column sum over the n - j queries that see
  /// token j, made a mean (ObservedAttention's normalisation).
  static void divide_by_tail(float* s, std::int64_t n) noexcept {
    for (std::int64_t j = 0; j < n; ++j) s[j] /= static_cast<float>(n - j);
  }

  /// dst[i] = table[sel[i]] for i < n (table[i] when sel is null): selected
  /// slots mapped to the ids of a page table row.
  static void gather_ids(const std::int32_t* table, const std::int32_t* sel, std::int64_t n, std::int32_t* dst) noexcept {
    for (std::int64_t i = 0; i < n; ++i) dst[i] = table[sel != nullptr ? sel[i] : i];
  }

  /// dst[i] = src[i] for i < n (a kept-id row repeated for another head).
  static void copy_ids(const std::int32_t* src, std::int64_t n, std::int32_t* dst) noexcept {
    for (std::int64_t i = 0; i < n; ++i) dst[i] = src[i];
  }

  /// Removes the lowest slot x of row[0..cand) under `score_order_key` (ties:
  /// the lowest slot; NaN ranks lowest) from row[0..n): row[x..n-1) = row[x+1..n),
  /// and ids[0..n-1) = the kept slots 0..n-1 except x, ascending.
  /// 1 <= cand <= n.
  static void evict_lowest(float* row, std::int64_t cand, std::int64_t n, std::int32_t* ids) noexcept {
    std::int64_t x = 0;
    std::uint32_t best = score_order_key(row[0]);
    for (std::int64_t j = 1; j < cand; ++j) {
      const std::uint32_t k = score_order_key(row[j]);
      if (k < best) best = k, x = j;
    }
    for (std::int64_t r = 0; r < n - 1; ++r) ids[r] = static_cast<std::int32_t>(r < x ? r : r + 1);
    for (std::int64_t r = x; r + 1 < n; ++r) row[r] = row[r + 1];
  }

  /// row[r] = row[ids[r]] for r < keep; ids ascending with ids[r] >= r (a
  /// top-k's kept slots), so a forward sweep is in place.
  static std::size_t compact_row_workspace(std::int64_t keep) noexcept {
    (void)keep;
    return 0;
  }
  static void compact_row(float* row, const std::int32_t* ids, std::int64_t keep, Workspace ws) noexcept {
    (void)ws;
    for (std::int64_t r = 0; r < keep; ++r) row[r] = row[ids[r]];
  }
};

/// The scalar reference backend: the union of every op family.
struct Scalar : ScalarScoreOps, ScalarPageOps, ScalarReduceOps, ScalarQuantOps, ScalarMergeOps {};

}  // namespace backend

KVP_NAMESPACE_END
