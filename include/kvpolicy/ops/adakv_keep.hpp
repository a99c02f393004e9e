// SPDX-License-Identifier: Apache-2.0
// `ops::adakv_keep`: one sequence's Ada-KV decision from its score map, as one
// op, so a device backend decides a whole layer without a host round trip.
//
// `AdaKVAllocation::keep_spec` (policy/budget/adakv_allocation.hpp) reduces
// either variant to the same few numbers; the op then works with thresholds
// only. Every element of the (rows, T) map has two order keys: within its row
// (score_order_key(s) << 32 | j) and within the layer (... << 32 | r*T + j).
// Both orders agree inside a row, so "the k best" is always "key >= the k-th
// largest key".
//
//   1. keep_all: every row keeps its T tokens (counts = T; scores unread).
//   2. original + normalize: row r is scaled by f = sum(top row_k) / sum(all)
//      into a ranked copy (the protected +inf scores left out of both sums;
//      fp64 sums in ascending token order, then fp32, as the host allocation;
//      f = 1 when the sum is zero or not finite).
//   3. kvpress: row r's best row_k (n_safe) tokens are safe: row threshold
//      s_r = the row_k-th largest row key (none when row_k = 0).
//   4. Layer threshold g = the layer_k-th largest layer key over the ranked
//      map, safe elements excluded (none selected when layer_k = 0).
//   5. share[r] = base + #{j : not safe, layer key >= g} (base: kvpress n_safe,
//      original -P); the original's counts are defined when every share is
//      >= 0 (else the allocation is uniform); `adakv_final_count` gives the
//      count each row keeps.
//   6. indptr[r + 1] = indptr[r] + count[r] (indptr[0], the sequence's first
//      offset, is read), and row r's kept ids are its best count[r] tokens of
//      the unscaled scores, ascending, at indices + indptr[r].
//
// These are the host allocation's counts and KeepSet rows exactly (tests:
// tests/policy/test_adakv_keep.cpp over both variants, ties, +inf and NaN).
// The host reference below is what `backend::Cuda::adakv_keep` reproduces.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>

#include "kvpolicy/core/rounding.hpp"
#include "kvpolicy/core/workspace.hpp"
#include "kvpolicy/ops/scalar.hpp"

KVP_NAMESPACE_BEGIN

/// One sequence's Ada-KV allocation in the form `ops::adakv_keep` evaluates.
struct AdaKVKeepSpec {
  bool keep_all = false;              ///< nothing to evict: every row keeps all T tokens
  bool original = false;              ///< FFY0/AdaKV capacities (else kvpress's safeguard + global prune)
  bool normalize = false;             ///< original: rows scaled before the layer-wide selection
  std::int64_t row_k = 0;             ///< per-row selection: kvpress n_safe; original + normalize min(T, B + P); else 0
  std::int64_t layer_k = 0;           ///< layer-wide selection: kvpress rows*(n_kept - n_safe); original min(rows*T, rows*(B + P))
  std::int64_t base = 0;              ///< share offset: kvpress n_safe; original -P
  std::int64_t protected_tokens = 0;  ///< original: P per row
  std::int64_t past_budget = 0;       ///< original: B, each row's capacity when the shares are undefined
  std::int64_t floor_cap = 0;         ///< original: int(B * alpha)
  float keep_f = 1.0f;                ///< original: fp32(1 - alpha)
};

/// The order key of `adakv_keep`: score first, then the position (token or flat index).
KVP_HOST_DEVICE inline std::uint64_t keep_order_key(float score, std::int64_t pos) noexcept {
  return (static_cast<std::uint64_t>(score_order_key(score)) << 32) | static_cast<std::uint64_t>(pos);
}

/// The tokens row r keeps from its share (step 5): kvpress the share itself; the
/// original cap = round_half_even(fp32(share * keep_f) + floor_cap) in fp32 (the
/// product rounded, never fused), B when undefined, clamped to [0, T - P], plus P.
KVP_HOST_DEVICE inline std::int64_t adakv_final_count(const AdaKVKeepSpec& s, std::int64_t share, bool defined, std::int64_t T) noexcept {
  if (s.keep_all) return T;
  if (!s.original) return share;
  std::int64_t cap = s.past_budget;
  if (defined) {
#if defined(__CUDA_ARCH__)
    const float v = __fadd_rn(__fmul_rn(static_cast<float>(share), s.keep_f), static_cast<float>(s.floor_cap));
#else
    volatile float p = static_cast<float>(share) * s.keep_f;  // rounded, not contracted into the add
    const float v = p + static_cast<float>(s.floor_cap);
#endif
    cap = static_cast<std::int64_t>(round_half_even(static_cast<double>(v)));
  }
  const std::int64_t P = s.protected_tokens, hi = T - P;
  return (cap < 0 ? 0 : (cap > hi ? hi : cap)) + P;
}

namespace ops {
namespace keep_detail {

/// The k-th largest of keys[0..n) (k >= 1; reorders keys), or UINT64_MAX when k == 0 (selects nothing).
inline std::uint64_t kth_largest(std::uint64_t* keys, std::int64_t n, std::int64_t k) noexcept {
  if (k <= 0 || n <= 0) return UINT64_MAX;
  if (k > n) k = n;
  std::nth_element(keys, keys + (k - 1), keys + n, std::greater<>());
  return keys[k - 1];
}

inline WorkspacePlan adakv_keep_plan(std::int64_t rows, std::int64_t T) noexcept {
  const auto rt = static_cast<std::size_t>(std::max<std::int64_t>(rows, 1) * std::max<std::int64_t>(T, 1));
  WorkspacePlan p;  // same order as adakv_keep_host
  p.add<std::uint64_t>(rt).add<float>(rt).add<std::uint64_t>(static_cast<std::size_t>(std::max<std::int64_t>(rows, 1)));
  return p;
}

/// The reference semantics (file comment), on host memory.
inline void adakv_keep_host(const float* S, std::int64_t rows, std::int64_t T, const AdaKVKeepSpec& spec, std::int64_t* counts,
                            std::int32_t* indptr, std::int32_t* indices, Workspace ws) noexcept {
  WorkspaceCarver c(ws);
  const auto rt = static_cast<std::size_t>(std::max<std::int64_t>(rows, 1) * std::max<std::int64_t>(T, 1));
  std::uint64_t* keys = c.take<std::uint64_t>(rt);
  float* cand = c.take<float>(rt);
  std::uint64_t* safe = c.take<std::uint64_t>(static_cast<std::size_t>(std::max<std::int64_t>(rows, 1)));
  const auto row_threshold = [&](const float* row, std::int64_t k) {
    for (std::int64_t j = 0; j < T; ++j) keys[j] = keep_order_key(row[j], j);
    return kth_largest(keys, T, k);
  };
  if (!spec.keep_all) {
    const float* ranked = S;
    if (spec.original && spec.normalize) {
      for (std::int64_t r = 0; r < rows; ++r) {
        const float* row = S + r * T;
        const std::uint64_t t = row_threshold(row, spec.row_k);
        double top = 0.0, all = 0.0;
        for (std::int64_t j = 0; j < T; ++j) {
          if (row[j] == INFINITY) continue;
          if (keep_order_key(row[j], j) >= t) top += row[j];
          all += row[j];
        }
        const float den = static_cast<float>(all), num = static_cast<float>(top);
        const float f = (den != 0.0f && std::isfinite(den) && std::isfinite(num)) ? num / den : 1.0f;
        for (std::int64_t j = 0; j < T; ++j) cand[r * T + j] = row[j] == INFINITY ? row[j] : row[j] * f;
      }
      ranked = cand;
    }
    for (std::int64_t r = 0; r < rows; ++r) safe[r] = !spec.original && spec.row_k > 0 ? row_threshold(S + r * T, spec.row_k) : UINT64_MAX;
    std::int64_t m = 0;
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t j = 0; j < T; ++j)
        if (keep_order_key(S[r * T + j], j) < safe[r]) keys[m++] = keep_order_key(ranked[r * T + j], r * T + j);
    const std::uint64_t g = kth_largest(keys, m, spec.layer_k);
    bool defined = true;
    for (std::int64_t r = 0; r < rows; ++r) {
      std::int64_t share = spec.base;
      for (std::int64_t j = 0; j < T; ++j)
        share += keep_order_key(S[r * T + j], j) < safe[r] && keep_order_key(ranked[r * T + j], r * T + j) >= g ? 1 : 0;
      counts[r] = share;
      defined = defined && share >= 0;
    }
    for (std::int64_t r = 0; r < rows; ++r) counts[r] = adakv_final_count(spec, counts[r], defined, T);
  } else {
    for (std::int64_t r = 0; r < rows; ++r) counts[r] = T;
  }
  for (std::int64_t r = 0; r < rows; ++r) {
    indptr[r + 1] = static_cast<std::int32_t>(indptr[r] + counts[r]);
    std::int32_t* dst = indices + indptr[r];
    if (counts[r] >= T) {
      for (std::int64_t j = 0; j < T; ++j) dst[j] = static_cast<std::int32_t>(j);
      continue;
    }
    const std::uint64_t t = row_threshold(S + r * T, counts[r]);
    std::int64_t n = 0;
    for (std::int64_t j = 0; j < T; ++j)
      if (keep_order_key(S[r * T + j], j) >= t) dst[n++] = static_cast<std::int32_t>(j);
  }
}

}  // namespace keep_detail

/// Workspace of `adakv_keep` for a (rows, T) map on backend B.
template <class B>
std::size_t adakv_keep_workspace(std::int64_t rows, std::int64_t T) noexcept {
  if constexpr (requires { B::adakv_keep_workspace(rows, T); })
    return B::adakv_keep_workspace(rows, T);
  else
    return keep_detail::adakv_keep_plan(rows, T).total();
}

/// One sequence's Ada-KV decision (file comment): scores (rows, T) contiguous,
/// counts (rows) written, indptr[1..rows] written from indptr[0], kept ids at
/// indices + indptr[r]; the backend's own member when it has one (device
/// memory throughout, indptr included), else the host reference.
template <class B>
void adakv_keep(const float* scores, std::int64_t rows, std::int64_t T, const AdaKVKeepSpec& spec, std::int64_t* counts,
                std::int32_t* indptr, std::int32_t* indices, Workspace ws) noexcept {
  if constexpr (requires { B::adakv_keep(scores, rows, T, spec, counts, indptr, indices, ws); })
    B::adakv_keep(scores, rows, T, spec, counts, indptr, indices, ws);
  else
    keep_detail::adakv_keep_host(scores, rows, T, spec, counts, indptr, indices, ws);
}

}  // namespace ops
KVP_NAMESPACE_END
