// SPDX-License-Identifier: Apache-2.0
// `LayerSchedule`: the budget of every layer of a model, for policies that run
// once per layer (SnapKV, PyramidKV, Ada-KV, Expected Attention, ...).
//
//   LayerSchedule s = LayerSchedule::pyramid_kvpress(0.5, /*window=*/64, /*num_layers=*/32);
//   Budget b;
//   s.layer_budget(layer, kv_len, &b);      // -> Budget::tokens(n), window included
//   SnapKVParams p = SnapKVParams::kvpress(0.5); p.budget = b;
//
// Kinds:
//  * uniform(budget, NL)                 — the same Budget for every layer;
//  * pyramid_factory(C, w, NL, beta)     — KVCache-Factory PyramidKV (see budget/pyramid.hpp);
//  * pyramid_adakv(C, w, NL, beta)       — Ada-KV repository `pyram_mode`;
//  * pyramid_kvpress(r, w, NL, beta)     — kvpress PyramidKVPress;
//  * per_layer(budgets)                  — an explicit list (kvpress
//                                          PerLayerCompressionPress; caller-owned memory).
//
// A pyramid layer budget resolves to `Budget::tokens(total)` with the window
// inside and `allow_above_length` set (a layer that is not compressed gets
// `Budget::keep_ratio(1)`), so it plugs into any policy's `budget` field.
// Validation errors name the argument: "layer 32 out of range [0, num_layers=32)",
// "beta is 0, must be >= 1", "num_layers is 0, must be >= 1".
#pragma once

#include <cstdint>
#include <span>

#include "kvpolicy/policy/budget.hpp"
#include "kvpolicy/policy/budget/pyramid.hpp"

KVP_NAMESPACE_BEGIN

enum class ScheduleKind : std::uint8_t { kUniform, kPyramidFactory, kPyramidAdaKV, kPyramidKvpress, kPerLayer };

struct LayerSchedule {
  ScheduleKind kind = ScheduleKind::kUniform;
  Budget budget = Budget::compression_ratio(0.5);  ///< uniform: every layer; Factory/Ada-KV: tokens(C); kvpress: compression_ratio(r)
  std::int32_t window = 0;                         ///< pyramid kinds: the observation window w (inside the budgets)
  std::int32_t beta = 20;                          ///< pyramid kinds: steepness (>= 1)
  std::int32_t num_layers = 1;
  const Budget* per_layer_budgets = nullptr;  ///< kPerLayer: `num_layers` budgets, caller-owned

  static constexpr LayerSchedule uniform(Budget b, std::int32_t num_layers) noexcept {
    return LayerSchedule{ScheduleKind::kUniform, b, 0, 20, num_layers, nullptr};
  }
  static constexpr LayerSchedule pyramid_factory(std::int64_t capacity, std::int32_t window, std::int32_t num_layers,
                                                 std::int32_t beta = 20) noexcept {
    return LayerSchedule{ScheduleKind::kPyramidFactory, Budget::tokens(capacity), window, beta, num_layers, nullptr};
  }
  static constexpr LayerSchedule pyramid_adakv(std::int64_t base_capacity, std::int32_t window, std::int32_t num_layers,
                                               std::int32_t beta = 20) noexcept {
    return LayerSchedule{ScheduleKind::kPyramidAdaKV, Budget::tokens(base_capacity), window, beta, num_layers, nullptr};
  }
  static constexpr LayerSchedule pyramid_kvpress(double r, std::int32_t window, std::int32_t num_layers, std::int32_t beta = 20,
                                                 bool at_least_one = false) noexcept {
    Budget b = Budget::compression_ratio(r);
    b.at_least_one = at_least_one;
    return LayerSchedule{ScheduleKind::kPyramidKvpress, b, window, beta, num_layers, nullptr};
  }
  static constexpr LayerSchedule per_layer(std::span<const Budget> budgets) noexcept {
    return LayerSchedule{ScheduleKind::kPerLayer, Budget{}, 0, 20, static_cast<std::int32_t>(budgets.size()), budgets.data()};
  }

  constexpr bool is_pyramid() const noexcept {
    return kind == ScheduleKind::kPyramidFactory || kind == ScheduleKind::kPyramidAdaKV || kind == ScheduleKind::kPyramidKvpress;
  }

  /// Checks independent of the layer and the sequence.
  Status validate(const char* who) const noexcept {
    KVP_REQUIRE(num_layers >= 1, "%s: num_layers is %d, must be >= 1", who, num_layers);
    switch (kind) {
      case ScheduleKind::kUniform: return budget.validate(who);
      case ScheduleKind::kPerLayer:
        KVP_REQUIRE(per_layer_budgets != nullptr, "%s: per-layer schedule has no budgets", who);
        for (std::int32_t l = 0; l < num_layers; ++l) KVP_RETURN_IF_ERROR(per_layer_budgets[l].validate(who));
        return Status::ok();
      case ScheduleKind::kPyramidFactory:
      case ScheduleKind::kPyramidAdaKV:
        KVP_REQUIRE(beta >= 1, "%s: beta is %d, must be >= 1", who, beta);
        KVP_REQUIRE(window >= 0, "%s: window is %d, must be >= 0", who, window);
        KVP_REQUIRE(budget.kind == BudgetKind::kTokens, "%s: a %s pyramid schedule needs a token capacity", who,
                    kind == ScheduleKind::kPyramidFactory ? "KVCache-Factory" : "Ada-KV");
        KVP_RETURN_IF_ERROR(budget.validate(who));
        KVP_REQUIRE(static_cast<std::int64_t>(budget.value) > window, "%s: capacity %lld must be larger than the window %d", who,
                    static_cast<long long>(budget.value), window);
        return Status::ok();
      case ScheduleKind::kPyramidKvpress:
        KVP_REQUIRE(beta >= 1, "%s: beta is %d, must be >= 1", who, beta);
        KVP_REQUIRE(window >= 0, "%s: window is %d, must be >= 0", who, window);
        KVP_REQUIRE(budget.kind == BudgetKind::kCompressionRatio, "%s: a kvpress pyramid schedule needs a compression_ratio", who);
        return budget.validate(who);
    }
    return Status::ok();
  }

  /// The budget of `layer` for a sequence of `kv_len` tokens (window included
  /// for the pyramid kinds). `regime` (optional) reports the pyramid branch.
  Status layer_budget(std::int64_t layer, std::int64_t kv_len, Budget* out, PyramidRegime* regime = nullptr) const noexcept {
    KVP_RETURN_IF_ERROR(validate("layer_schedule"));
    KVP_REQUIRE(layer >= 0 && layer < num_layers, "layer_schedule: layer %lld out of range [0, num_layers=%d)",
                static_cast<long long>(layer), num_layers);
    KVP_REQUIRE(kv_len >= 0, "layer_schedule: kv_len is %lld, must be >= 0", static_cast<long long>(kv_len));
    PyramidBudget pb{};
    switch (kind) {
      case ScheduleKind::kUniform:
        *out = budget;
        if (regime) *regime = PyramidRegime::kUniform;
        return Status::ok();
      case ScheduleKind::kPerLayer:
        *out = per_layer_budgets[layer];
        if (regime) *regime = PyramidRegime::kUniform;
        return Status::ok();
      case ScheduleKind::kPyramidFactory:
        KVP_RETURN_IF_ERROR(pyramid_budget_factory(kv_len, static_cast<std::int64_t>(budget.value), window, beta, num_layers, layer, &pb));
        break;
      case ScheduleKind::kPyramidAdaKV:
        KVP_RETURN_IF_ERROR(pyramid_budget_adakv(kv_len, static_cast<std::int64_t>(budget.value), window, beta, num_layers, layer, &pb));
        break;
      case ScheduleKind::kPyramidKvpress:
        KVP_RETURN_IF_ERROR(pyramid_budget_kvpress(kv_len, budget.value, window, beta, num_layers, layer, budget.at_least_one, &pb));
        break;
    }
    if (regime) *regime = pb.regime;
    *out = pb.regime == PyramidRegime::kNoCompression ? Budget::keep_ratio(1.0) : Budget::tokens(pb.total).clamp_to_length();
    return Status::ok();
  }
};

KVP_NAMESPACE_END
