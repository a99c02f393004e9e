// SPDX-License-Identifier: Apache-2.0
// Element types: IEEE binary16 (`half`) and bfloat16 storage types with exact
// round-to-nearest-even conversion from float, plus the run-time `DType` tag.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvpolicy/core/config.hpp"

KVP_NAMESPACE_BEGIN

/// IEEE 754 binary16 storage. Arithmetic is always done in float.
struct half {
  std::uint16_t bits = 0;
  KVP_HOST_DEVICE static constexpr half from_bits(std::uint16_t b) noexcept {
    half h;
    h.bits = b;
    return h;
  }
};

/// bfloat16 storage (the upper 16 bits of an IEEE binary32).
struct bfloat16 {
  std::uint16_t bits = 0;
  KVP_HOST_DEVICE static constexpr bfloat16 from_bits(std::uint16_t b) noexcept {
    bfloat16 h;
    h.bits = b;
    return h;
  }
};

namespace detail {
/// The bits of a float and back: std::bit_cast on the host, the CUDA intrinsics in device code (the
/// conversions below are KVP_HOST_DEVICE, so the CUDA backend's kernels round exactly as the host does).
KVP_HOST_DEVICE constexpr std::uint32_t float_bits(float f) noexcept {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  return std::bit_cast<std::uint32_t>(f);
#endif
}
KVP_HOST_DEVICE constexpr float bits_float(std::uint32_t u) noexcept {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return std::bit_cast<float>(u);
#endif
}
}  // namespace detail

/// Exact widening conversion (every half is representable as float).
KVP_HOST_DEVICE constexpr float to_float(half h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h.bits & 0x8000u) << 16;
  const std::uint32_t exp = (h.bits >> 10) & 0x1fu;
  std::uint32_t man = h.bits & 0x3ffu;
  std::uint32_t out;
  if (exp == 0x1f) {  // inf / nan (payload kept, quiet bit set for nan)
    out = sign | 0x7f800000u | (man << 13) | (man ? 0x00400000u : 0u);
  } else if (exp != 0) {  // normal
    out = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {  // signed zero
    out = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      man <<= 1;
      ++e;
    } while ((man & 0x400u) == 0);
    out = sign | (static_cast<std::uint32_t>(112 - e) << 23) | ((man & 0x3ffu) << 13);
  }
  return detail::bits_float(out);
}

/// Narrowing float -> half, round to nearest, ties to even; overflow -> inf,
/// NaN stays NaN (quiet), underflow produces subnormals / signed zero.
KVP_HOST_DEVICE constexpr half to_half(float f) noexcept {
  const std::uint32_t x = detail::float_bits(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  const std::uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) {  // inf or nan
    return half::from_bits(static_cast<std::uint16_t>(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u | ((ax >> 13) & 0x3ffu) : 0u)));
  }
  if (ax >= 0x477ff000u) return half::from_bits(static_cast<std::uint16_t>(sign | 0x7c00u));  // rounds to >= 65520 -> inf
  if (ax < 0x38800000u) {                                                                     // result is subnormal or zero
    if (ax < 0x33000000u) return half::from_bits(sign);  // < 2^-25: rounds to zero (2^-25 itself ties to even 0)
    const std::uint32_t e = ax >> 23;                    // 102..112
    const std::uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126u - e;  // 14..24
    std::uint32_t r = m >> shift;
    const std::uint32_t rem = m & ((1u << shift) - 1u);
    const std::uint32_t halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (r & 1u))) ++r;
    return half::from_bits(static_cast<std::uint16_t>(sign | r));
  }
  std::uint32_t r = ax - 0x38000000u;  // rebias exponent 127 -> 15
  r = r + 0xfffu + ((r >> 13) & 1u);   // RNE on the 13 dropped bits
  return half::from_bits(static_cast<std::uint16_t>(sign | (r >> 13)));
}

KVP_HOST_DEVICE constexpr float to_float(bfloat16 h) noexcept { return detail::bits_float(static_cast<std::uint32_t>(h.bits) << 16); }

/// float -> bfloat16, round to nearest, ties to even; NaN stays a quiet NaN.
KVP_HOST_DEVICE constexpr bfloat16 to_bfloat16(float f) noexcept {
  const std::uint32_t x = detail::float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return bfloat16::from_bits(static_cast<std::uint16_t>((x >> 16) | 0x40u));
  const std::uint32_t r = x + 0x7fffu + ((x >> 16) & 1u);
  return bfloat16::from_bits(static_cast<std::uint16_t>(r >> 16));
}

KVP_HOST_DEVICE constexpr float to_float(float f) noexcept { return f; }

/// Run-time element type tag (what crosses ABI boundaries).
enum class DType : std::uint8_t { kF32, kF16, kBF16, kI32, kI64, kU8 };

template <class T>
struct dtype_of;
template <>
struct dtype_of<float> {
  static constexpr DType value = DType::kF32;
};
template <>
struct dtype_of<half> {
  static constexpr DType value = DType::kF16;
};
template <>
struct dtype_of<bfloat16> {
  static constexpr DType value = DType::kBF16;
};
template <>
struct dtype_of<std::int32_t> {
  static constexpr DType value = DType::kI32;
};
template <>
struct dtype_of<std::int64_t> {
  static constexpr DType value = DType::kI64;
};
template <>
struct dtype_of<std::uint8_t> {
  static constexpr DType value = DType::kU8;
};
template <class T>
inline constexpr DType dtype_v = dtype_of<std::remove_cv_t<T>>::value;

/// The floating storage types K/V and queries may have.
template <class T>
concept KVElement = std::is_same_v < std::remove_cv_t<T>,
float > || std::is_same_v<std::remove_cv_t<T>, half> || std::is_same_v<std::remove_cv_t<T>, bfloat16>;

constexpr std::size_t dtype_size(DType t) noexcept {
  switch (t) {
    case DType::kF32:
    case DType::kI32: return 4;
    case DType::kF16:
    case DType::kBF16: return 2;
    case DType::kI64: return 8;
    case DType::kU8: return 1;
  }
  return 0;
}

constexpr const char* dtype_name(DType t) noexcept {
  switch (t) {
    case DType::kF32: return "float32";
    case DType::kF16: return "float16";
    case DType::kBF16: return "bfloat16";
    case DType::kI32: return "int32";
    case DType::kI64: return "int64";
    case DType::kU8: return "uint8";
  }
  return "unknown";
}

/// Convert a float to storage type T (round-to-nearest-even for narrow types).
template <class T>
KVP_HOST_DEVICE constexpr T from_float(float f) noexcept {
  if constexpr (std::is_same_v<T, half>)
    return to_half(f);
  else if constexpr (std::is_same_v<T, bfloat16>)
    return to_bfloat16(f);
  else
    return static_cast<T>(f);
}

KVP_NAMESPACE_END
