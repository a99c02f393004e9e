// SPDX-License-Identifier: Apache-2.0
// PyramidKV layer budgets — "PyramidKV: Dynamic KV Cache Compression based on
// Pyramidal Information Funneling" (Cai et al., 2024, arXiv 2406.02069).
//
// Lower layers keep more tokens, upper layers fewer, linearly in the layer
// index, with the same total as a uniform budget. Three reference formulas
// (reference §4), each a pure function of (kv_len, budget, window, beta,
// num_layers, layer) returning the tokens kept per kv head **including** the
// observation window:
//
//  * `pyramid_budget_factory` — KVCache-Factory `PyramidKVCluster` (integer
//    arithmetic, `//` = floor division). C = max_capacity_prompt:
//        T < C                -> no compression (all T tokens);
//        T < 2 (C - w)        -> uniform C (the pyramid is not used);
//        otherwise            -> max_num - layer * steps past tokens + w, with
//        min_num = (C-w)//beta, max_num = 2(C-w) - min_num, both re-anchored
//        when max_num >= T - w, and steps = (max_num - min_num)//(NL - 1).
//    Flooring `steps` makes the layer mean exceed C (T=4000, C=128, w=8, NL=32:
//    242, 235, ..., 25, mean 133.5): reproduced, not corrected.
//  * `pyramid_budget_adakv` — the Ada-KV repository's `pyram_mode`: the same
//    formula on base = C - w with neither the `T < C` nor the uniform branch.
//    Ada-KV computes it once at the first prompt and reuses it forever; here it
//    is recomputed for every call (reference §4.2).
//  * `pyramid_budget_kvpress` — kvpress `PyramidKVPress.get_layer_budget`
//    (double arithmetic): mcp = w + T(1-r); min/max as above in floats; unless
//    T >= max_num >= min_num >= w the uniform fallback `round(T(1-r))` is used;
//    otherwise round(max_num - layer * steps), steps = (max_num-min_num)/(NL-1).
//    `round` is Python's (half to even). `at_least_one` adds kvpress >= 0.5.5's
//    `max(1, ...)` on the fallback. r == 0 reports no compression (kvpress
//    returns before computing a budget).
//
// Choices where the references are undefined:
//  * num_layers == 1: KVCache-Factory and the kvpress snapshot divide by zero;
//    kvpress >= 0.5.5 uses steps = 0 (the single layer gets max_num). The
//    kvpress schedule follows 0.5.5; the Factory and Ada-KV schedules give the
//    single layer the plain budget C (the intended average).
//  * Integer formulas need C > w (asserted by the originals); the Ada-KV
//    schedule also needs w <= T (the window must exist).
#pragma once

#include <cstdint>

#include "kvpolicy/policy/budget.hpp"

KVP_NAMESPACE_BEGIN

/// Which branch of a pyramid formula produced a layer budget.
enum class PyramidRegime : std::uint8_t {
  kNoCompression,  ///< the sequence is kept whole (Factory: T < C; kvpress: r == 0)
  kUniform,        ///< Factory: C <= T < 2(C-w), every layer keeps C
  kPyramid,        ///< the linear pyramid
  kFallback,       ///< kvpress: the chained check failed, uniform round(T(1-r))
};

struct PyramidBudget {
  std::int64_t total = 0;  ///< tokens kept per kv head, window included (== kv_len when not compressed)
  PyramidRegime regime = PyramidRegime::kPyramid;
};

namespace detail {
inline Status check_pyramid_common(const char* who, std::int64_t kv_len, std::int64_t window, std::int64_t beta, std::int64_t num_layers,
                                   std::int64_t layer) noexcept {
  KVP_REQUIRE(kv_len >= 0, "%s: kv_len is %lld, must be >= 0", who, static_cast<long long>(kv_len));
  KVP_REQUIRE(window >= 0, "%s: window is %lld, must be >= 0", who, static_cast<long long>(window));
  KVP_REQUIRE(beta >= 1, "%s: beta is %lld, must be >= 1", who, static_cast<long long>(beta));
  KVP_REQUIRE(num_layers >= 1, "%s: num_layers is %lld, must be >= 1", who, static_cast<long long>(num_layers));
  KVP_REQUIRE(layer >= 0 && layer < num_layers, "%s: layer %lld out of range [0, num_layers=%lld)", who, static_cast<long long>(layer),
              static_cast<long long>(num_layers));
  return Status::ok();
}

/// The integer pyramid shared by KVCache-Factory and Ada-KV: past tokens of `layer`.
constexpr std::int64_t integer_pyramid_past(std::int64_t kv_len, std::int64_t base, std::int64_t window, std::int64_t beta,
                                            std::int64_t num_layers, std::int64_t layer) noexcept {
  std::int64_t min_num = floor_div(base, beta);
  std::int64_t max_num = 2 * base - min_num;
  if (max_num >= kv_len - window) {
    max_num = kv_len - window;
    min_num = 2 * base - max_num;
  }
  const std::int64_t steps = floor_div(max_num - min_num, num_layers - 1);
  return max_num - layer * steps;
}
}  // namespace detail

/// KVCache-Factory `PyramidKVCluster`: C = capacity (window included).
inline Status pyramid_budget_factory(std::int64_t kv_len, std::int64_t capacity, std::int64_t window, std::int64_t beta,
                                     std::int64_t num_layers, std::int64_t layer, PyramidBudget* out) noexcept {
  KVP_RETURN_IF_ERROR(detail::check_pyramid_common("pyramid_budget_factory", kv_len, window, beta, num_layers, layer));
  KVP_REQUIRE(capacity > window, "pyramid_budget_factory: capacity %lld must be larger than the window %lld",
              static_cast<long long>(capacity), static_cast<long long>(window));
  const std::int64_t base = capacity - window;
  if (kv_len < capacity) {
    *out = {kv_len, PyramidRegime::kNoCompression};
  } else if (kv_len < 2 * base || num_layers == 1) {
    *out = {capacity, PyramidRegime::kUniform};
  } else {
    *out = {detail::integer_pyramid_past(kv_len, base, window, beta, num_layers, layer) + window, PyramidRegime::kPyramid};
  }
  return Status::ok();
}

/// Ada-KV repository `pyram_mode`: C = base_capacity (window included).
inline Status pyramid_budget_adakv(std::int64_t kv_len, std::int64_t capacity, std::int64_t window, std::int64_t beta,
                                   std::int64_t num_layers, std::int64_t layer, PyramidBudget* out) noexcept {
  KVP_RETURN_IF_ERROR(detail::check_pyramid_common("pyramid_budget_adakv", kv_len, window, beta, num_layers, layer));
  KVP_REQUIRE(capacity > window, "pyramid_budget_adakv: capacity %lld must be larger than the window %lld",
              static_cast<long long>(capacity), static_cast<long long>(window));
  KVP_REQUIRE(window <= kv_len, "pyramid_budget_adakv: window %lld is larger than kv_len %lld", static_cast<long long>(window),
              static_cast<long long>(kv_len));
  const std::int64_t base = capacity - window;
  if (num_layers == 1) {
    *out = {capacity, PyramidRegime::kUniform};
  } else {
    *out = {detail::integer_pyramid_past(kv_len, base, window, beta, num_layers, layer) + window, PyramidRegime::kPyramid};
  }
  return Status::ok();
}

/// kvpress `PyramidKVPress.get_layer_budget` (total kept per kv head, window included).
inline Status pyramid_budget_kvpress(std::int64_t kv_len, double compression_ratio, std::int64_t window, std::int64_t beta,
                                     std::int64_t num_layers, std::int64_t layer, bool at_least_one, PyramidBudget* out) noexcept {
  KVP_RETURN_IF_ERROR(detail::check_pyramid_common("pyramid_budget_kvpress", kv_len, window, beta, num_layers, layer));
  KVP_REQUIRE(compression_ratio >= 0.0 && compression_ratio < 1.0, "pyramid_budget_kvpress: compression_ratio is %g, must be in [0, 1)",
              compression_ratio);
  if (compression_ratio == 0.0) {
    *out = {kv_len, PyramidRegime::kNoCompression};
    return Status::ok();
  }
  const double T = static_cast<double>(kv_len), w = static_cast<double>(window);
  const double keep = detail::rounded_mul(T, 1.0 - compression_ratio);  // Python: q_len * (1 - r)
  const double mcp = w + keep;
  double min_num = (mcp - w) / static_cast<double>(beta);
  double max_num = (mcp - w) * 2.0 - min_num;
  if (max_num >= T - w) {
    max_num = T - w;
    min_num = (mcp - w) * 2.0 - max_num;
  }
  if (!(T >= max_num && max_num >= min_num && min_num >= w)) {
    auto n = static_cast<std::int64_t>(round_half_even(keep));
    if (at_least_one && n < 1) n = 1;
    *out = {n, PyramidRegime::kFallback};
    return Status::ok();
  }
  const double steps = num_layers > 1 ? (max_num - min_num) / static_cast<double>(num_layers - 1) : 0.0;
  *out = {static_cast<std::int64_t>(round_half_even(max_num - detail::rounded_mul(static_cast<double>(layer), steps))),
          PyramidRegime::kPyramid};
  return Status::ok();
}

KVP_NAMESPACE_END
