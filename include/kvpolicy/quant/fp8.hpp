// SPDX-License-Identifier: Apache-2.0
// fp8 element formats of the engines' KV caches (OCP FP8, as in vLLM,
// SGLang, FlashInfer and PyTorch):
//
//   e4m3 (`float8_e4m3fn`): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no
//        infinities; S.1111.111 is NaN; max finite 448; min subnormal 2^-9.
//   e5m2 (`float8_e5m2`): 1 sign, 5 exponent (bias 15), 2 mantissa bits;
//        S.11111.00 is ±inf, S.11111.xx (xx != 0) NaN; max 57344; min 2^-16.
//
// Decoding is exact. Encoding rounds to nearest, ties to even, and
// **saturates**: a finite value beyond the max, or an infinity, becomes ±max
// (CUDA's `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...)`, which vLLM's cache
// writer uses); NaN becomes the canonical NaN (0x7f / 0x7e, with the sign).
// PyTorch's and ml_dtypes' casts agree on every value within ±max (tested
// exhaustively: all 256 codes, every midpoint between neighbours) and differ
// above it (they give NaN for e4m3 and inf for e5m2).
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kvpolicy/core/config.hpp"
#include "kvpolicy/core/version.hpp"

KVP_NAMESPACE_BEGIN

enum class Fp8Format : std::uint8_t { kE4M3, kE5M2 };

struct Fp8Traits {
  int mant_bits, bias;
  std::uint8_t max_code, nan_code;
  float max;
};
constexpr Fp8Traits fp8_traits(Fp8Format f) noexcept {
  return f == Fp8Format::kE4M3 ? Fp8Traits{3, 7, 0x7e, 0x7f, 448.0f} : Fp8Traits{2, 15, 0x7b, 0x7e, 57344.0f};
}
constexpr float fp8_max(Fp8Format f) noexcept { return fp8_traits(f).max; }
constexpr const char* fp8_name(Fp8Format f) noexcept { return f == Fp8Format::kE4M3 ? "fp8_e4m3" : "fp8_e5m2"; }

/// The value of code `c` (exact).
inline float fp8_decode(Fp8Format f, std::uint8_t c) noexcept {
  const Fp8Traits t = fp8_traits(f);
  const int M = t.mant_bits, emax = (1 << (7 - M)) - 1;
  const int e = (c >> M) & emax, m = c & ((1 << M) - 1);
  const float sign = (c & 0x80) ? -1.0f : 1.0f;
  if (f == Fp8Format::kE4M3 && e == emax && m == (1 << M) - 1) return std::numeric_limits<float>::quiet_NaN();
  if (f == Fp8Format::kE5M2 && e == emax)
    return m == 0 ? sign * std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
  if (e == 0) return sign * std::ldexp(static_cast<float>(m), 1 - t.bias - M);
  return sign * std::ldexp(static_cast<float>((1 << M) + m), e - t.bias - M);
}

/// The nearest code to x (ties to even), saturating at ±max; NaN -> NaN.
inline std::uint8_t fp8_encode(Fp8Format f, float x) noexcept {
  const Fp8Traits t = fp8_traits(f);
  const int M = t.mant_bits;
  const std::uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (x != x) return static_cast<std::uint8_t>(sign | t.nan_code);
  const float a = std::fabs(x);
  if (!(a < t.max)) return static_cast<std::uint8_t>(sign | t.max_code);  // >= max or inf
  if (a == 0.0f) return sign;
  // a / quantum, where quantum is the spacing of a's fp8 binade (the subnormal one below 2^(1-bias)).
  const int e = std::max(std::ilogb(a), 1 - t.bias);
  const float v = std::ldexp(a, M - e);  // exact: a scaled by a power of two, in [0, 2^(M+1))
  float q = std::floor(v);
  const float frac = v - q;
  if (frac > 0.5f || (frac == 0.5f && std::fmod(q, 2.0f) != 0.0f)) q += 1.0f;
  // Codes of one sign are contiguous in value: q = 2^(M+1) carries into the next exponent.
  const int code =
      e == 1 - t.bias && q < static_cast<float>(1 << M) ? static_cast<int>(q) : ((e + t.bias) << M) + static_cast<int>(q) - (1 << M);
  return static_cast<std::uint8_t>(sign | (code > t.max_code ? t.max_code : code));
}

// ---- the same codec in integer arithmetic, for host and device ----------------------------------
// `fp8_encode_bits` / `fp8_decode_bits` give exactly `fp8_encode` / `fp8_decode` (tests/quant: every code,
// every float around every rounding boundary, a sweep of the whole float range) with integer operations
// only, so device kernels (backends/cuda) run the host's codec rather than a twin of it.

KVP_HOST_DEVICE inline std::uint32_t fp8_float_bits(float x) noexcept {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  return std::bit_cast<std::uint32_t>(x);
#endif
}
KVP_HOST_DEVICE inline float fp8_bits_float(std::uint32_t u) noexcept {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return std::bit_cast<float>(u);
#endif
}

/// `fp8_encode`: nearest code, ties to even, saturating at +-max; NaN -> the canonical NaN with x's sign.
KVP_HOST_DEVICE inline std::uint8_t fp8_encode_bits(Fp8Format f, float x) noexcept {
  const bool e4 = f == Fp8Format::kE4M3;
  const std::uint32_t M = e4 ? 3u : 2u, bias = e4 ? 7u : 15u;
  const std::uint32_t max_code = e4 ? 0x7eu : 0x7bu, nan_code = e4 ? 0x7fu : 0x7eu;
  const std::uint32_t max_bits = e4 ? 0x43e00000u : 0x47600000u;  // 448, 57344
  const std::uint32_t u = fp8_float_bits(x), a = u & 0x7fffffffu;
  const std::uint32_t sign = (u >> 24) & 0x80u;
  if (a > 0x7f800000u) return static_cast<std::uint8_t>(sign | nan_code);
  if (a >= max_bits) return static_cast<std::uint8_t>(sign | max_code);  // >= max or inf
  // |x| in units of the quantum of its fp8 binade (the subnormal one below 2^(1 - bias)): the float's
  // significand shifted right by `shift`, rounded to nearest even; a carry runs into the exponent field.
  const std::int32_t E = static_cast<std::int32_t>(a >> 23);  // biased float exponent (0: float subnormal)
  const std::uint32_t m = E == 0 ? (a & 0x7fffffu) : ((a & 0x7fffffu) | 0x800000u);
  const std::int32_t e = (E == 0 ? 1 : E) - 127;                   // unbiased exponent of m's scale
  const std::int32_t e_min = 1 - static_cast<std::int32_t>(bias);  // smallest normal fp8 exponent
  const std::int32_t shift = 23 - static_cast<std::int32_t>(M) + (e < e_min ? e_min - e : 0);
  std::uint32_t q;
  if (shift >= 32) {
    q = 0u;  // below a quarter of the smallest subnormal: 0 (m < 2^24 < half of 2^shift)
  } else {
    q = m >> shift;
    const std::uint32_t rem = m & ((1u << shift) - 1u), halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
  }
  // Normal binade: q in [2^M, 2^(M+1)] counts from the binade's first code.
  std::uint32_t code = e < e_min ? q : ((static_cast<std::uint32_t>(e - e_min + 1)) << M) + q - (1u << M);
  if (code > max_code) code = max_code;
  return static_cast<std::uint8_t>(sign | code);
}

/// `fp8_decode`: the exact value of code c (the quiet NaN 0x7fc00000 for the NaN codes, as the host's).
KVP_HOST_DEVICE inline float fp8_decode_bits(Fp8Format f, std::uint8_t c) noexcept {
  const bool e4 = f == Fp8Format::kE4M3;
  const std::uint32_t M = e4 ? 3u : 2u, bias = e4 ? 7u : 15u, emax = e4 ? 15u : 31u;
  const std::uint32_t e = (c >> M) & emax, m = c & ((1u << M) - 1u), sign = static_cast<std::uint32_t>(c & 0x80u) << 24;
  if (e4 && e == emax && m == 7u) return fp8_bits_float(0x7fc00000u);
  if (!e4 && e == emax) return fp8_bits_float(m == 0u ? (sign | 0x7f800000u) : 0x7fc00000u);
  if (e == 0u) {  // m * 2^(1 - bias - M): exact in float
    const float unit = fp8_bits_float((127u + 1u - bias - M) << 23);
    return fp8_bits_float(sign | fp8_float_bits(static_cast<float>(m) * unit));
  }
  return fp8_bits_float(sign | ((e - bias + 127u) << 23) | (m << (23u - M)));
}

KVP_NAMESPACE_END
