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

KVP_NAMESPACE_END
