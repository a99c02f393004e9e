// SPDX-License-Identifier: Apache-2.0
// Overflow-checked size arithmetic: the one place where the library multiplies
// and adds extents, strides, element counts and byte sizes that come from the
// caller or from a file. Every helper returns false (and leaves `*out`
// unspecified) when the exact result does not fit the type, so a validation
// can report "too large" instead of computing with a wrapped value.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvpolicy/core/version.hpp"

KVP_NAMESPACE_BEGIN

/// *out = a * b; false when the product overflows T.
template <class T>
  requires std::is_integral_v<T>
constexpr bool checked_mul(T a, T b, T* out) noexcept { return !__builtin_mul_overflow(a, b, out); }

/// *out = a + b; false when the sum overflows T.
template <class T>
  requires std::is_integral_v<T>
constexpr bool checked_add(T a, T b, T* out) noexcept { return !__builtin_add_overflow(a, b, out); }

/// Element count of `rank` extents: *out = prod(extents); false when an
/// extent is negative or the product overflows int64. A zero extent makes the
/// count 0 whatever the others are (an empty tensor of absurd extents is
/// still empty).
constexpr bool checked_extent_product(const std::int64_t* extents, int rank, std::int64_t* out) noexcept {
  for (int i = 0; i < rank; ++i) {
    if (extents[i] < 0) return false;
    if (extents[i] == 0) {
      *out = 0;
      return true;
    }
  }
  std::int64_t n = 1;
  for (int i = 0; i < rank; ++i)
    if (!checked_mul(n, extents[i], &n)) return false;
  *out = n;
  return true;
}

/// Row-major strides (in elements) of `rank` non-negative extents:
/// strides[rank-1] = 1, strides[i] = strides[i+1] * extents[i+1]; false when
/// an extent is negative or a stride overflows int64 (which an empty tensor
/// can do: shape (0, 2^61, 2^61, 4) has 0 elements but stride 2^64 on axis 0).
constexpr bool checked_row_major_strides(const std::int64_t* extents, int rank, std::int64_t* strides) noexcept {
  std::int64_t s = 1;
  for (int i = rank - 1; i >= 0; --i) {
    if (extents[i] < 0) return false;
    strides[i] = s;
    if (!checked_mul(s, extents[i], &s)) return false;
  }
  return true;
}

/// Saturating size arithmetic for workspace sizes: SIZE_MAX on overflow, a
/// size no caller can provide, so the workspace check fails loudly.
constexpr std::size_t saturating_mul(std::size_t a, std::size_t b) noexcept {
  std::size_t r = 0;
  return checked_mul(a, b, &r) ? r : SIZE_MAX;
}
constexpr std::size_t saturating_add(std::size_t a, std::size_t b) noexcept {
  std::size_t r = 0;
  return checked_add(a, b, &r) ? r : SIZE_MAX;
}

KVP_NAMESPACE_END
