// SPDX-License-Identifier: Apache-2.0
// One budget vocabulary for every policy.
//
//  * `Budget::tokens(n)`             absolute tokens kept per kv head;
//  * `Budget::keep_ratio(f)`         keep floor(f * kv_len) (double arithmetic);
//  * `Budget::compression_ratio(r)`  kvpress: keep `int(kv_len * (1 - r))`, computed
//                                    exactly as Python does it in double precision
//                                    (kv_len=1000, r=0.8 keeps 199, not 200).
//
// `protected_inside` says whether a policy's protected tokens (observation
// window, sinks) count inside the budget (kvpress, and the originals' "capacity
// C including the window") or are kept on top of it.
//
// Out-of-range budgets are errors, not silently clamped: a token budget above the
// sequence length is rejected unless `allow_above_length` is set, which gives
// the original repositories' "shorter prompts are not compressed" behaviour.
#pragma once

#include <cmath>
#include <cstdint>

#include "kvpolicy/core/status.hpp"

KVP_NAMESPACE_BEGIN

enum class BudgetKind : std::uint8_t { kTokens, kKeepRatio, kCompressionRatio };

/// kvpress's `n_kept = int(T * (1 - r))`: double product, truncation.
constexpr std::int64_t kvpress_n_kept(std::int64_t kv_len, double compression_ratio) noexcept {
  return static_cast<std::int64_t>(static_cast<double>(kv_len) * (1.0 - compression_ratio));
}

struct Budget {
  BudgetKind kind = BudgetKind::kCompressionRatio;
  double value = 0.0;
  bool protected_inside = true;
  bool allow_above_length = false;

  static constexpr Budget tokens(std::int64_t n) noexcept { return Budget{BudgetKind::kTokens, static_cast<double>(n), true, false}; }
  static constexpr Budget keep_ratio(double f) noexcept { return Budget{BudgetKind::kKeepRatio, f, true, false}; }
  static constexpr Budget compression_ratio(double r) noexcept { return Budget{BudgetKind::kCompressionRatio, r, true, false}; }

  /// Protected tokens are kept in addition to the budget.
  constexpr Budget protected_on_top() const noexcept {
    Budget b = *this;
    b.protected_inside = false;
    return b;
  }
  /// A token budget above the length keeps everything instead of failing.
  constexpr Budget clamp_to_length() const noexcept {
    Budget b = *this;
    b.allow_above_length = true;
    return b;
  }

  /// Checks that do not depend on the sequence length.
  Status validate(const char* who) const noexcept {
    KVP_REQUIRE(std::isfinite(value), "%s: budget value is not finite", who);
    switch (kind) {
      case BudgetKind::kTokens:
        KVP_REQUIRE(value >= 0 && value == std::floor(value), "%s: token budget is %g, must be a non-negative integer", who, value);
        break;
      case BudgetKind::kKeepRatio:
        KVP_REQUIRE(value >= 0.0 && value <= 1.0, "%s: keep_ratio is %g, must be in [0, 1]", who, value);
        break;
      case BudgetKind::kCompressionRatio:
        KVP_REQUIRE(value >= 0.0 && value < 1.0, "%s: compression_ratio is %g, must be in [0, 1)", who, value);
        break;
    }
    return Status::ok();
  }

  /// Budget in tokens before clamping to the length, protected tokens included.
  constexpr std::int64_t total(std::int64_t kv_len, std::int64_t num_protected) const noexcept {
    std::int64_t n = 0;
    switch (kind) {
      case BudgetKind::kTokens: n = static_cast<std::int64_t>(value); break;
      case BudgetKind::kKeepRatio: n = static_cast<std::int64_t>(static_cast<double>(kv_len) * value); break;
      case BudgetKind::kCompressionRatio: n = kvpress_n_kept(kv_len, value); break;
    }
    return protected_inside ? n : n + num_protected;
  }

  /// Tokens to keep per kv head for a sequence of `kv_len` tokens with
  /// `num_protected` protected tokens: min(total, kv_len), protected included.
  Status resolve(const char* who, std::int64_t kv_len, std::int64_t num_protected, std::int64_t* kept) const noexcept {
    KVP_RETURN_IF_ERROR(validate(who));
    if (kind == BudgetKind::kTokens) {
      KVP_REQUIRE(allow_above_length || static_cast<std::int64_t>(value) <= kv_len,
                  "%s: token budget %lld is larger than the sequence length %lld", who, static_cast<long long>(value),
                  static_cast<long long>(kv_len));
    }
    const std::int64_t n = total(kv_len, num_protected);
    *kept = n < kv_len ? n : kv_len;
    return Status::ok();
  }
};

KVP_NAMESPACE_END
