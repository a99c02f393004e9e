// SPDX-License-Identifier: Apache-2.0
// NearestKeptMerge — merge every evicted token into its most similar kept
// token, as a running weighted mean with persistent per-slot weights. This is
// the library's own well-defined form of the D2O / LOOK-M / KVMerger-style
// "nearest kept" compensation (reference: algorithms-other.md, the generic
// nearest-kept merge); neither D2O's nor LOOK-M's code persists weights.
//
// State: w[j] > 0, the mass of the token in cache slot j (1 for a fresh token,
// or its accumulated attention: `init_weights`), caller-owned.
// Algorithm (per kv head, on the keep set of any eviction):
//   for every evicted e:  c = argmax over kept c of cos(K[e], K[c]);  s = that cosine
//     merged iff s >= threshold;  omega_e = w[e] (x max(s, 0) with scale_by_similarity)
//   for every kept c:     W_c = w[c] + sum_{e->c} omega_e
//     K[c] <- (w[c] K[c] + sum_{e->c} omega_e K[e]) / W_c,   V[c] the same
//     w[c] <- W_c
// Plan entries: (c, e, omega_e / W_c).
//
// Why persistent weights: with w carried along, a slot that absorbs a at one
// step and b at a later one holds (w_c K_c + w_a K_a + w_b K_b) / (w_c + w_a
// + w_b) -- the true weighted average of every original token it stands for
// (an evicted token that itself absorbed others brings its whole mass). A
// stateless mean (D2O, LOOK-M) re-weights the slot's history as one token.
//
// State re-packing: on success w is rewritten in kept order (w[c] for slot c
// = the kept token's new weight, c < kept), matching a compaction with the same
// keep set (as H2O's state); entries past the kept count are left as they were.
// Cosine with norms clamped at 1e-8; ties: the earliest kept token.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kvpolicy/policy/merging/merge_common.hpp"

KVP_NAMESPACE_BEGIN

struct NearestKeptMergeParams {
  float threshold = -1.0f;           ///< merge iff cos >= threshold (-1: every evicted token merges)
  bool scale_by_similarity = false;  ///< omega_e = w[e] * max(s, 0) instead of w[e]

  static constexpr auto fields() noexcept {
    return std::tuple{param_field<&NearestKeptMergeParams::threshold>("threshold", "minimum cosine similarity to merge"),
                      param_field<&NearestKeptMergeParams::scale_by_similarity>("scale_by_similarity", "weight merges by similarity")};
  }
};

/// Caller-owned per-slot masses of one (layer, sequence).
struct NearestKeptState {
  TensorView<float, 2> weights{};  ///< (num_kv_heads, capacity): mass of the token in slot j, > 0
};

template <class Tk>
struct NearestKeptInput : MergeInput<Tk> {
  NearestKeptState state{};
};

class NearestKeptMerge {
 public:
  using Params = NearestKeptMergeParams;
  using State = NearestKeptState;
  static constexpr const char* kName = "nearest_kept";
  static constexpr float kEps = 1e-8f;

  constexpr NearestKeptMerge() noexcept = default;
  explicit constexpr NearestKeptMerge(const Params& p) noexcept : params_(p) {}
  constexpr const Params& params() const noexcept { return params_; }

  Status validate_params() const noexcept {
    KVP_RETURN_IF_ERROR(check_enum_fields(kName, params_));
    KVP_REQUIRE(std::isfinite(params_.threshold) && params_.threshold >= -1.0f && params_.threshold <= 1.0f,
                "nearest_kept: threshold is %g, must be in [-1, 1]", static_cast<double>(params_.threshold));
    return Status::ok();
  }

  /// Slots [begin, end) of kv head h get mass `w` (fresh tokens: 1, or their attention).
  static Status init_weights(State& st, std::int64_t h, std::int64_t begin, std::int64_t end, float w) noexcept {
    KVP_RETURN_IF_ERROR(st.weights.check_basic(kName, "state weights"));
    KVP_REQUIRE(std::isfinite(w) && w > 0.0f, "nearest_kept: initial weight %g must be finite and > 0", static_cast<double>(w));
    KVP_REQUIRE(h >= 0 && h < st.weights.extent(0) && begin >= 0 && begin <= end && end <= st.weights.extent(1),
                "nearest_kept: slots [%lld, %lld) of head %lld are outside the state (%lld, %lld)", static_cast<long long>(begin),
                static_cast<long long>(end), static_cast<long long>(h), static_cast<long long>(st.weights.extent(0)),
                static_cast<long long>(st.weights.extent(1)));
    for (std::int64_t j = begin; j < end; ++j) st.weights(h, j) = w;
    return Status::ok();
  }

  template <class Backend>
  Requirements requirements(const Context<Backend>& ctx, const ProblemShape& s) const noexcept {
    return detail::rule_merge_requirements(kName, validate_params(), ctx, s);
  }

  /// Reads keys, values and state.weights (column stride 1); writes the
  /// plan, merged_keys, merged_values (either may be empty) and re-packs
  /// state.weights. On a device backend (views and weights tagged kCUDA) the
  /// heads run as `Backend::merge_head`, the plan's rows are dense and the
  /// weights are not scanned for NaN / <= 0 (`detail::rule_merge`).
  template <class Backend, class Tk>
  Status merge(const Context<Backend>& cx, const NearestKeptInput<Tk>& in, const KeepSet& keep, MergePlan out) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    return detail::rule_merge(kName, cx, rule(), in, keep, out, &in.state.weights, /*merges_keys=*/true);
  }

  /// The algorithm above as a `MergeRule`.
  MergeRule rule() const noexcept {
    MergeRule r;
    r.eps = kEps;
    r.threshold = params_.threshold;
    r.beta = MergeBeta::kStateWeight;
    r.scale_by_similarity = params_.scale_by_similarity;
    r.self = MergeSelf::kStateWeight;
    r.norm = MergeNorm::kSelfPlusSum;
    return r;
  }

 private:
  Params params_{};
};

static_assert(MergePolicy<NearestKeptMerge, NearestKeptInput<float>> && MergePolicy<NearestKeptMerge, NearestKeptInput<half>>);

KVP_NAMESPACE_END
