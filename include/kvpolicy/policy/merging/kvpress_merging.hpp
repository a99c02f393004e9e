// SPDX-License-Identifier: Apache-2.0
// KvpressMerging — kvpress 0.5.5 `MergingPress(press, similarity_threshold,
// merge_fraction)` (kvpress/presses/merging_press.py), the merge half: the
// wrapped ScorerPress decides the kept set (any eviction policy of this
// library, passed as the KeepSet), this policy folds the evicted values in.
//
// Algorithm (per kv head, at prefill, on the keep set of the eviction):
//   1. u = K / max(|K|, 1e-6) for every token (fp32); for evicted e,
//      (s_e, c_e) = max / argmax over kept c of <u_e, u_c>.
//   2. ok_e = s_e >= similarity_threshold.
//   3. if merge_fraction < 1: q = quantile_{1 - merge_fraction} over the row's
//      evicted of (ok ? s : -inf) (torch.quantile, linear interpolation);
//      ok_e &= s_e >= q.
//   4. w_e = max(s_e, 0) * ok_e * |V_e| / (|V_e| + |V_{c_e}| + 1e-6).
//   5. V[c] <- (V[c] + sum_{e->c} w_e V_e) / (1 + sum_{e->c} w_e) for every kept
//      c with sum w > 0. Keys are not merged (RoPE-safe, as kvpress).
// Plan entries: (c_e, e, w_e / (1 + W_c)) for every e with w_e > 0.
//
// Choices where this differs from, or pins down, kvpress:
//  * Ties in step 1: kvpress's argmax runs over the kept tokens in the
//    scorer's top-k order and takes the first maximum; here the kept tokens
//    are ascending (KeepSet order) and the earliest kept token wins. Exact
//    cosine ties are the only case where the two differ.
//  * Precision: fp32 throughout like kvpress (norms accumulated in double,
//    kvpress in fp32); merged rows are fp32, cast to the cache dtype by apply/.
//    kvpress casts to the cache dtype at the end too.
//  * The quantile of step 3 reproduces torch's float32 arithmetic, including
//    that a quantile landing on a -inf (a row with too few candidates) is NaN,
//    which gates every token of the row off.
#pragma once

#include <cmath>
#include <cstdint>

#include "kvpolicy/policy/merging/merge_common.hpp"

KVP_NAMESPACE_BEGIN

struct KvpressMergingParams {
  float similarity_threshold = 0.0f;  ///< minimum cosine similarity, in [0, 1]
  float merge_fraction = 1.0f;        ///< fraction of evicted tokens (by similarity) merged, in (0, 1]

  static constexpr auto fields() noexcept {
    return std::tuple{param_field<&KvpressMergingParams::similarity_threshold>("similarity_threshold", "minimum cosine similarity"),
                      param_field<&KvpressMergingParams::merge_fraction>("merge_fraction", "fraction of evicted tokens merged")};
  }
};

class KvpressMerging {
 public:
  using Params = KvpressMergingParams;
  static constexpr const char* kName = "kvpress_merging";
  static constexpr float kEps = 1e-6f;

  constexpr KvpressMerging() noexcept = default;
  explicit constexpr KvpressMerging(const Params& p) noexcept : params_(p) {}
  constexpr const Params& params() const noexcept { return params_; }

  Status validate_params() const noexcept {
    KVP_RETURN_IF_ERROR(check_enum_fields(kName, params_));
    KVP_REQUIRE(params_.similarity_threshold >= 0.0f && params_.similarity_threshold <= 1.0f,
                "kvpress_merging: similarity_threshold is %g, must be in [0, 1]", static_cast<double>(params_.similarity_threshold));
    KVP_REQUIRE(params_.merge_fraction > 0.0f && params_.merge_fraction <= 1.0f, "kvpress_merging: merge_fraction is %g, must be in (0, 1]",
                static_cast<double>(params_.merge_fraction));
    return Status::ok();
  }

  /// Plan rows = kv heads, capacity = one entry per evicted token; the
  /// workspace of `detail::rule_merge` (one row per worker, or one head on a
  /// device backend).
  template <class Backend>
  Requirements requirements(const Context<Backend>& ctx, const ProblemShape& shape) const noexcept {
    return detail::rule_merge_requirements(kName, validate_params(), ctx, shape);
  }

  /// Reads keys and values; writes the plan and `merged_values` (merged_keys
  /// must be empty). On a device backend (views tagged kCUDA) the heads run
  /// as `Backend::merge_head` and the plan's rows are dense
  /// (`detail::rule_merge`).
  template <class Backend, class Tk>
  Status merge(const Context<Backend>& cx, const MergeInput<Tk>& in, const KeepSet& keep, MergePlan out) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    return detail::rule_merge(kName, cx, rule(), in, keep, out, nullptr, /*merges_keys=*/false);
  }

  /// Steps 1-5 above as a `MergeRule` (cosine eps and value eps 1e-6).
  MergeRule rule() const noexcept {
    MergeRule r;
    r.eps = kEps;
    r.threshold = params_.similarity_threshold;
    r.fraction = params_.merge_fraction;
    r.beta = MergeBeta::kValueNorms;
    r.value_eps = kEps;
    r.self = MergeSelf::kOne;
    r.norm = MergeNorm::kOnePlusSum;
    return r;
  }

 private:
  Params params_{};
};

static_assert(MergePolicy<KvpressMerging, MergeInput<float>> && MergePolicy<KvpressMerging, MergeInput<half>>);

KVP_NAMESPACE_END
