// SPDX-License-Identifier: Apache-2.0
// Python's rounding of a double to an integer, for host and device code alike
// (budgets, Ada-KV's capacities, the KIVI codes' reference).
#pragma once

#include <cstdint>

#include "kvpolicy/core/config.hpp"

KVP_NAMESPACE_BEGIN

/// Python's `round()` / `torch.round`: nearest integer, ties to even. Exact
/// for every double (x - floor(x) is exact), independent of the FP rounding mode.
KVP_HOST_DEVICE constexpr double round_half_even(double x) noexcept {
  if (!(x == x) || !(x < 4503599627370496.0 && x > -4503599627370496.0)) return x;  // NaN, inf, |x| >= 2^52: integral
  double f = static_cast<double>(static_cast<std::int64_t>(x));
  if (f > x) f -= 1.0;  // floor for negative non-integers
  const double frac = x - f;
  if (frac > 0.5) return f + 1.0;
  if (frac < 0.5) return f;
  const auto fi = static_cast<std::int64_t>(f);
  return (fi % 2 == 0) ? f : f + 1.0;
}

KVP_NAMESPACE_END
