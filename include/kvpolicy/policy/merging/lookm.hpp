// SPDX-License-Identifier: Apache-2.0
// LookMPivot — the "pivot" merge of LOOK-M ("LOOK-M: Look-Once Optimization in
// KV Cache for Efficient Multimodal Long-Context Inference", Wan et al.,
// EMNLP Findings 2024), as in its repository (SUSTechBruce/LOOK-M,
// `PivotKVCache_LayerWise`) and as shared by the KVCache-Factory family
// (`merge_kv`, read in the LAQ repository).
//
// Algorithm (per kv head, on the keep set of any eviction):
//   for every evicted token e:
//     c = argmax over kept c of cos(K[e], K[c])          the pivot
//     K~_e = (K[e] + K[c]) / 2                           averaged with its pivot
//   K[c] <- mean({K[c]} u {K~_e : e -> c})               scatter_reduce 'mean', include_self
//         = ((1 + n_c/2) K[c] + sum_{e->c} K[e] / 2) / (1 + n_c)
//   V[c] <- the same with V, with the *same* e -> c assignment.
// Plan entries: (c, e, 1 / (2 (1 + n_c))).
//
// Fixes of the shared code's pitfalls (reference notes, do not port verbatim;
// the LOOK-M repository's own version already has the first two right):
//  * K and V rows stay aligned: the code concatenates keys as [recent,
//    selected] and values as [selected, recent]; here slot c is the same
//    token for K and V.
//  * The drop set is per head (the keep set's complement), not the tokens
//    dropped by every head (the code's torch.isin over indices flattened
//    across heads); observation-window tokens are dropped only if the keep
//    set drops them.
//  * Any head_dim (the code hard-codes 128).
//  * Cosine with norms clamped at 1e-8 (torch cosine_similarity); ties: the
//    earliest kept token (torch.max(dim)'s first maximum over the kept tokens in
//    ascending order, as LOOK-M gathers them).
//  * Zero keys (outside the original's domain: it divides by the norm without
//    eps, and torch.max lets a NaN win): a zero evicted key merges into the
//    earliest kept token in both; a zero kept key captures every evicted token
//    in the original (NaN cosine), here it has cosine 0 and rarely wins.
// Cross-checked against LOOK-M's arithmetic in float64
// (tests/data/fixtures/merge_original.json): pivots exact, merged rows within
// 2e-6 of the row's max |value|; no disagreement.
#pragma once

#include <cstdint>

#include "kvpolicy/policy/merging/merge_common.hpp"

KVP_NAMESPACE_BEGIN

struct LookMPivotParams {
  static constexpr auto fields() noexcept { return std::tuple{}; }
};

class LookMPivot {
 public:
  using Params = LookMPivotParams;
  static constexpr const char* kName = "lookm_pivot";
  static constexpr float kEps = 1e-8f;

  constexpr LookMPivot() noexcept = default;
  explicit constexpr LookMPivot(const Params& p) noexcept : params_(p) {}
  constexpr const Params& params() const noexcept { return params_; }
  Status validate_params() const noexcept { return Status::ok(); }

  template <class Backend>
  Requirements requirements(const Context<Backend>& ctx, const ProblemShape& s) const noexcept {
    return detail::rule_merge_requirements(kName, validate_params(), ctx, s);
  }

  /// Reads keys and values; writes the plan, merged_keys and merged_values
  /// (either may be empty). On a device backend (views tagged kCUDA) the
  /// heads run as `Backend::merge_head` and the plan's rows are dense
  /// (`detail::rule_merge`).
  template <class Backend, class Tk>
  Status merge(const Context<Backend>& cx, const MergeInput<Tk>& in, const KeepSet& keep, MergePlan out) const noexcept {
    return detail::rule_merge(kName, cx, rule(), in, keep, out, nullptr, /*merges_keys=*/true);
  }

  /// The pivot average as a `MergeRule`: beta 1/2, self 1 + n_c/2, scale 1 / (1 + n_c).
  static MergeRule rule() noexcept {
    MergeRule r;
    r.eps = kEps;
    r.beta = MergeBeta::kConstant;
    r.beta_value = 0.5f;
    r.self = MergeSelf::kOnePlusHalfCount;
    r.norm = MergeNorm::kOnePlusCount;
    return r;
  }

 private:
  Params params_{};
};

static_assert(MergePolicy<LookMPivot, MergeInput<float>> && MergePolicy<LookMPivot, MergeInput<half>>);

KVP_NAMESPACE_END
