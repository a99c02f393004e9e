// SPDX-License-Identifier: Apache-2.0
// InfiniGen's loops as ops, so its device path (policy/prefetch/infinigen.hpp)
// runs without a host round trip. Each op works on one sequence of n tokens;
// its page ids (`seq_pages`) and every array are device memory on a device
// backend; the partial key cache is addressed by `PartialKeyGeometry`
// (ops/prefetch_ops.hpp). A is the kv head's skewing matrix (d x d, row
// major), S its ascending partial channels (r of them).
//
//   infinigen_fold      tokens [first, first + count): K~[t][g][j] = sum_i
//                       k_t[i] * A_g[i][S_g[j]] (fp32, i ascending).
//   infinigen_scores    per query head h (kv head g = h / G): q~ = (q_h A_g)[S_g]
//                       * scale (each channel summed over i ascending, then
//                       scaled), then out[h * ld + t] = q~ . K~[t][g] in the
//                       8-lane order of prefetch_detail::dot. `qt`: Hq * r scratch.
//   infinigen_counts    counts[h] = #{t : s[h][t] > max_t s[h][t] - alpha}.
//   infinigen_select    k = min(floor(sum counts[0..rows) / rows), max_num_kv),
//                       per row h the min(k, n) best tokens under the
//                       library's top-k order (score_order_key, then the later
//                       token), found as the threshold of the (key, token)
//                       composites; each selected token raises its entry to
//                       its score (max, NaN as -inf), rows and tokens in
//                       ascending order as the host raises them. `thr`: Hq
//                       uint64 scratch; the reference also needs n uint64 in `keys`.
//
// Every op is fp32 multiplies and adds in a fixed order, integer counts and
// exact order keys, so backend::Cuda (backends/cuda/src/infinigen.cu) rounds
// as the host does and reproduces its requests bit for bit.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/ops/order_key.hpp"
#include "kvpolicy/ops/prefetch_ops.hpp"
#include "kvpolicy/policy/prefetch/history.hpp"

KVP_NAMESPACE_BEGIN
namespace ops {
namespace infinigen_ref {

template <class Tk>
void fold(const Tk* k_data, const PageStrides& ks, const std::int32_t* seq_pages, const PartialKeyGeometry& geo, const float* skew,
          const std::int32_t* channels, std::int64_t first, std::int64_t count, float* partial_keys) noexcept {
  const std::int64_t d = geo.head_dim;
  for (std::int64_t t = first; t < first + count; ++t) {
    const std::int64_t page = seq_pages[t / geo.page_size], slot = t % geo.page_size;
    for (std::int32_t g = 0; g < geo.num_kv_heads; ++g) {
      const Tk* k = k_data + page * ks.page + g * ks.head + slot * ks.slot;
      const float* A = skew + g * d * d;
      const std::int32_t* ch = channels + static_cast<std::int64_t>(g) * geo.partial_dim;
      float* dst = partial_keys + geo.offset(seq_pages, t, g);
      for (std::int32_t j = 0; j < geo.partial_dim; ++j) {
        float v = 0.0f;
        for (std::int64_t i = 0; i < d; ++i) v += to_float(k[i]) * A[i * d + ch[j]];
        dst[j] = v;
      }
    }
  }
}

template <class Tq>
void scores(const Tq* q, std::int64_t q_head_stride, std::int64_t q_dim_stride, std::int32_t G, float scale, const float* skew,
            const std::int32_t* channels, const float* partial_keys, const std::int32_t* seq_pages, const PartialKeyGeometry& geo,
            std::int64_t n, float* qt, float* out, std::int64_t ld) noexcept {
  const std::int64_t d = geo.head_dim, r = geo.partial_dim, Hq = static_cast<std::int64_t>(geo.num_kv_heads) * G;
  for (std::int64_t h = 0; h < Hq; ++h) {
    const auto g = static_cast<std::int32_t>(h / G);
    const float* A = skew + g * d * d;
    const std::int32_t* ch = channels + g * r;
    const Tq* qh = q + h * q_head_stride;
    for (std::int64_t c = 0; c < r; ++c) {
      float v = 0.0f;
      for (std::int64_t i = 0; i < d; ++i) v += to_float(qh[i * q_dim_stride]) * A[i * d + ch[c]];
      qt[h * r + c] = v * scale;
    }
  }
  for (std::int64_t h = 0; h < Hq; ++h) {
    const auto g = static_cast<std::int32_t>(h / G);
    const float* qv = qt + h * r;
    for (std::int64_t t = 0; t < n; ++t) out[h * ld + t] = prefetch_detail::dot(qv, partial_keys + geo.offset(seq_pages, t, g), r);
  }
}

inline void counts(const float* scores, std::int64_t rows, std::int64_t n, std::int64_t ld, float alpha, std::int64_t* out) noexcept {
  for (std::int64_t h = 0; h < rows; ++h) {
    const float* row = scores + h * ld;
    float mx = -std::numeric_limits<float>::infinity();
    for (std::int64_t t = 0; t < n; ++t) mx = std::max(mx, row[t]);
    std::int64_t c = 0;
    for (std::int64_t t = 0; t < n; ++t) c += row[t] > mx - alpha ? 1 : 0;
    out[h] = c;
  }
}

/// The (order key, token) composite the library's top-k ranks by.
inline std::uint64_t composite(float s, std::int64_t t) noexcept {
  return (static_cast<std::uint64_t>(score_order_key(s)) << 32) | static_cast<std::uint64_t>(t);
}

/// k of the call: min(floor(sum counts / rows), max_num_kv) (0 without rows).
inline std::int64_t budget(const std::int64_t* counts, std::int64_t count_rows, std::int64_t max_num_kv) noexcept {
  std::int64_t total = 0;
  for (std::int64_t i = 0; i < count_rows; ++i) total += counts[i];
  return count_rows == 0 ? 0 : std::min<std::int64_t>(total / count_rows, max_num_kv);
}

inline void select(const float* scores, std::int64_t rows, std::int64_t n, std::int64_t ld, const std::int64_t* counts,
                   std::int64_t count_rows, std::int64_t max_num_kv, std::int32_t page_size, std::uint64_t* keys, std::uint64_t* thr,
                   float* prio) noexcept {
  const std::int64_t kk = std::min(budget(counts, count_rows, max_num_kv), n);
  for (std::int64_t h = 0; h < rows; ++h) {
    const float* row = scores + h * ld;
    if (kk <= 0) {
      thr[h] = ~std::uint64_t{0};
      continue;
    }
    for (std::int64_t t = 0; t < n; ++t) keys[t] = composite(row[t], t);
    std::nth_element(keys, keys + (kk - 1), keys + n, [](std::uint64_t a, std::uint64_t b) { return a > b; });
    thr[h] = keys[kk - 1];
  }
  for (std::int64_t h = 0; h < rows; ++h) {
    if (thr[h] == ~std::uint64_t{0}) continue;
    const float* row = scores + h * ld;
    for (std::int64_t t = 0; t < n; ++t)
      if (composite(row[t], t) >= thr[h]) prefetch_detail::raise(prio, t / page_size, row[t]);
  }
}

}  // namespace infinigen_ref

/// Partial keys of tokens [first, first + count) of one sequence (file comment).
template <class B, class Tk>
void infinigen_fold(const Tk* k_data, const PageStrides& ks, const std::int32_t* seq_pages, const PartialKeyGeometry& geo,
                    const float* skew, const std::int32_t* channels, std::int64_t first, std::int64_t count, float* partial_keys) noexcept {
  if constexpr (requires { B::infinigen_fold(k_data, ks, seq_pages, geo, skew, channels, first, count, partial_keys); })
    B::infinigen_fold(k_data, ks, seq_pages, geo, skew, channels, first, count, partial_keys);
  else
    infinigen_ref::fold(k_data, ks, seq_pages, geo, skew, channels, first, count, partial_keys);
}

/// Speculative logits (Hq, ld) of one sequence (file comment).
template <class B, class Tq>
void infinigen_scores(const Tq* q, std::int64_t q_head_stride, std::int64_t q_dim_stride, std::int32_t G, float scale, const float* skew,
                      const std::int32_t* channels, const float* partial_keys, const std::int32_t* seq_pages, const PartialKeyGeometry& geo,
                      std::int64_t n, float* qt, float* out, std::int64_t ld) noexcept {
  if constexpr (requires {
                  B::infinigen_scores(q, q_head_stride, q_dim_stride, G, scale, skew, channels, partial_keys, seq_pages, geo, n, qt, out,
                                      ld);
                })
    B::infinigen_scores(q, q_head_stride, q_dim_stride, G, scale, skew, channels, partial_keys, seq_pages, geo, n, qt, out, ld);
  else
    infinigen_ref::scores(q, q_head_stride, q_dim_stride, G, scale, skew, channels, partial_keys, seq_pages, geo, n, qt, out, ld);
}

/// Tokens within alpha of each row's max (file comment).
template <class B>
void infinigen_counts(const float* scores, std::int64_t rows, std::int64_t n, std::int64_t ld, float alpha, std::int64_t* out) noexcept {
  if constexpr (requires { B::infinigen_counts(scores, rows, n, ld, alpha, out); })
    B::infinigen_counts(scores, rows, n, ld, alpha, out);
  else
    infinigen_ref::counts(scores, rows, n, ld, alpha, out);
}

/// Scratch bytes of `infinigen_select` for rows of n tokens (the reference's composites; a device needs none).
template <class B>
std::size_t infinigen_select_workspace(std::int64_t n) noexcept {
  if constexpr (requires { &B::infinigen_select; })
    return 0;
  else
    return static_cast<std::size_t>(std::max<std::int64_t>(n, 1)) * sizeof(std::uint64_t);
}

/// The call's k from the counts, each row's threshold and the entries raised (file comment).
template <class B>
void infinigen_select(const float* scores, std::int64_t rows, std::int64_t n, std::int64_t ld, const std::int64_t* counts,
                      std::int64_t count_rows, std::int64_t max_num_kv, std::int32_t page_size, std::uint64_t* keys, std::uint64_t* thr,
                      float* prio) noexcept {
  if constexpr (requires { B::infinigen_select(scores, rows, n, ld, counts, count_rows, max_num_kv, page_size, thr, prio); })
    B::infinigen_select(scores, rows, n, ld, counts, count_rows, max_num_kv, page_size, thr, prio);
  else
    infinigen_ref::select(scores, rows, n, ld, counts, count_rows, max_num_kv, page_size, keys, thr, prio);
}

}  // namespace ops
KVP_NAMESPACE_END
