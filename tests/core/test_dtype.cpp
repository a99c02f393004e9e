#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "kvpolicy/core/dtype.hpp"

using namespace kvpolicy;

namespace {
// Independent reference: pick the nearer of the two neighbouring bfloat16
// values in double precision; ties go to the even mantissa.
std::uint16_t bf16_reference(float f) {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const std::uint16_t lo = static_cast<std::uint16_t>(x >> 16);
  if ((x & 0xffffu) == 0) return lo;
  const std::uint16_t hi = static_cast<std::uint16_t>(lo + 1);
  const double dl = std::fabs(static_cast<double>(f) - static_cast<double>(to_float(bfloat16::from_bits(lo))));
  const double dh = std::fabs(static_cast<double>(f) - static_cast<double>(to_float(bfloat16::from_bits(hi))));
  if (std::isinf(to_float(bfloat16::from_bits(hi)))) {
    // Overflow: round to inf when at or beyond the halfway point to 2^128.
    const double half_way = std::ldexp(1.0, 127) * (2.0 - std::ldexp(1.0, -8));
    return std::fabs(static_cast<double>(f)) >= half_way ? hi : lo;
  }
  if (dl < dh) return lo;
  if (dh < dl) return hi;
  return (lo & 1u) ? hi : lo;
}
}  // namespace

TEST_CASE("half: every bit pattern survives half -> float -> half", "[dtype]") {
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    const half h = half::from_bits(static_cast<std::uint16_t>(b));
    const float f = to_float(h);
    const half back = to_half(f);
    if (std::isnan(f)) {
      REQUIRE(std::isnan(to_float(back)));
    } else {
      REQUIRE(back.bits == h.bits);
    }
  }
}

// Compilers without an x86 _Float16 (clang 14, used by tools/tsan.sh) skip the comparison.
#if defined(__FLT16_MANT_DIG__)
TEST_CASE("half: float -> half matches the compiler's _Float16 (round to nearest even)", "[dtype]") {
  std::mt19937 rng(1234);
  std::uniform_int_distribution<std::uint32_t> bits;
  auto check = [](float f) {
    const _Float16 ref = static_cast<_Float16>(f);
    const std::uint16_t rb = std::bit_cast<std::uint16_t>(ref);
    const half h = to_half(f);
    if (std::isnan(f)) {
      REQUIRE(std::isnan(to_float(h)));
    } else {
      INFO("f=" << f << " bits=" << std::bit_cast<std::uint32_t>(f));
      REQUIRE(h.bits == rb);
    }
  };
  for (int i = 0; i < 2000000; ++i) check(std::bit_cast<float>(bits(rng)));
  // Exhaustive over the interesting exponent range [2^-26, 2^17) at coarse mantissa steps + all ties.
  for (std::uint32_t x = 0x32800000u; x < 0x48000000u; x += 0x1001u) check(std::bit_cast<float>(x));
  for (std::uint32_t e = 0x33000000u; e < 0x47800000u; e += 0x00800000u) {
    for (std::uint32_t m = 0; m < 0x800000u; m += 0x1000u) {
      check(std::bit_cast<float>(e | m));  // exact ties for normal halves
      check(std::bit_cast<float>(e | m | 0x800u));
      check(std::bit_cast<float>((e | m | 0x800u) ^ 0x80000000u));
    }
  }
  for (float f : {0.0f, -0.0f, 65504.0f, 65519.99f, 65520.0f, -65520.0f, 6.0e-8f, 5.96046448e-8f, 2.98023224e-8f, 2.9802326e-8f,
                  std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                  std::numeric_limits<float>::denorm_min(), 6.103515625e-05f, 6.1e-05f}) {
    check(f);
  }
}
#endif

TEST_CASE("bfloat16: float -> bfloat16 rounds to nearest even, NaN stays NaN", "[dtype]") {
  std::mt19937 rng(99);
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 2000000; ++i) {
    const float f = std::bit_cast<float>(bits(rng));
    const bfloat16 b = to_bfloat16(f);
    if (std::isnan(f)) {
      REQUIRE(std::isnan(to_float(b)));
    } else {
      REQUIRE(b.bits == bf16_reference(f));
    }
  }
  // Exact ties: mantissa low half = 0x8000.
  for (std::uint32_t hi = 0; hi < 0x7f80u; hi += 7) {
    const float f = std::bit_cast<float>((hi << 16) | 0x8000u);
    REQUIRE(to_bfloat16(f).bits == bf16_reference(f));
  }
  REQUIRE(to_float(to_bfloat16(1.0f)) == 1.0f);
  REQUIRE(std::isinf(to_float(to_bfloat16(std::numeric_limits<float>::max()))));
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    const float f = to_float(bfloat16::from_bits(static_cast<std::uint16_t>(b)));
    if (!std::isnan(f)) REQUIRE(to_bfloat16(f).bits == b);
  }
}

TEST_CASE("dtype tags and sizes", "[dtype]") {
  STATIC_REQUIRE(dtype_v<float> == DType::kF32);
  STATIC_REQUIRE(dtype_v<const half> == DType::kF16);
  STATIC_REQUIRE(dtype_v<bfloat16> == DType::kBF16);
  STATIC_REQUIRE(dtype_size(DType::kBF16) == 2);
  STATIC_REQUIRE(to_float(to_half(1.5f)) == 1.5f);  // conversions are constexpr
  REQUIRE(std::string(dtype_name(DType::kF16)) == "float16");
}
