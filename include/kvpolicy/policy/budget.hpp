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
// `at_least_one` reproduces kvpress >= 0.5.5 (upstream PR #264,
// `compute_n_kept`): a non-empty sequence keeps at least one token. The kvpress
// snapshot of the reference (8bb29b9, 0.5.4) can keep 0; that is the default.
//
// Out-of-range budgets are errors, not silently clamped: a token budget above the
// sequence length is rejected unless `allow_above_length` is set, which gives
// the original repositories' "shorter prompts are not compressed" behaviour.
//
// The rest of the vocabulary lives beside this file:
//  * budget/schedule.hpp   — `LayerSchedule`: each layer's budget (uniform, the
//                            PyramidKV schedules of KVCache-Factory, the Ada-KV
//                            repository and kvpress, or an explicit list);
//  * budget/allocation.hpp — `HeadAllocation`: ragged per-head budgets of one
//                            sequence (Ada-KV, HeadKV tables) and the CSR
//                            KeepSet rows they produce.
#pragma once

#include <cmath>
#include <cstdint>

#include "kvpolicy/core/rounding.hpp"
#include "kvpolicy/core/status.hpp"

KVP_NAMESPACE_BEGIN

enum class BudgetKind : std::uint8_t { kTokens, kKeepRatio, kCompressionRatio };

/// kvpress's `n_kept = int(T * (1 - r))`: double product, truncation. With
/// `at_least_one` (kvpress >= 0.5.5) a non-empty sequence keeps >= 1 token.
constexpr std::int64_t kvpress_n_kept(std::int64_t kv_len, double compression_ratio, bool at_least_one = false) noexcept {
  const auto n = static_cast<std::int64_t>(static_cast<double>(kv_len) * (1.0 - compression_ratio));
  return (at_least_one && kv_len > 0 && n < 1) ? 1 : n;
}

/// Python's `a // b` on integers (floor division; C++ `/` truncates).
constexpr std::int64_t floor_div(std::int64_t a, std::int64_t b) noexcept {
  const std::int64_t q = a / b;
  return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q;
}

namespace detail {
/// a * b rounded to T once, never fused with a following add (the references
/// round the product; a contracted FMA would not). Used wherever a reference
/// formula of the form `a*b + c` must be reproduced bit for bit.
template <class T>
inline T rounded_mul(T a, T b) noexcept {
  volatile T p = a * b;
  return p;
}
}  // namespace detail

struct Budget {
  BudgetKind kind = BudgetKind::kCompressionRatio;
  double value = 0.0;
  bool protected_inside = true;
  bool allow_above_length = false;
  bool at_least_one = false;

  static constexpr Budget tokens(std::int64_t n) noexcept {
    return Budget{BudgetKind::kTokens, static_cast<double>(n), true, false, false};
  }
  static constexpr Budget keep_ratio(double f) noexcept { return Budget{BudgetKind::kKeepRatio, f, true, false, false}; }
  static constexpr Budget compression_ratio(double r) noexcept { return Budget{BudgetKind::kCompressionRatio, r, true, false, false}; }

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
  /// kvpress >= 0.5.5: a non-empty sequence keeps at least one token.
  constexpr Budget keep_at_least_one() const noexcept {
    Budget b = *this;
    b.at_least_one = true;
    return b;
  }

  /// Checks that do not depend on the sequence length.
  Status validate(const char* who) const noexcept {
    const char* key = kind == BudgetKind::kTokens             ? "token budget"
                      : kind == BudgetKind::kKeepRatio        ? "keep_ratio"
                      : kind == BudgetKind::kCompressionRatio ? "compression_ratio"
                                                              : nullptr;
    KVP_REQUIRE(key != nullptr, "%s: budget kind is %d, not tokens / keep_ratio / compression_ratio", who, static_cast<int>(kind));
    KVP_REQUIRE(std::isfinite(value), "%s: %s is %g, must be finite", who, key, value);
    switch (kind) {
      case BudgetKind::kTokens:
        KVP_REQUIRE(value >= 0 && value == std::floor(value) && value <= 9.0e15, "%s: token budget is %g, must be a non-negative integer",
                    who, value);
        break;
      case BudgetKind::kKeepRatio: KVP_REQUIRE(value >= 0.0 && value <= 1.0, "%s: keep_ratio is %g, must be in [0, 1]", who, value); break;
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
    if (at_least_one && kv_len > 0 && n < 1) n = 1;
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
