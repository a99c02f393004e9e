// SPDX-License-Identifier: Apache-2.0
// Quantization kernels, compiled per ISA (internal; included only by
// quant_ops_<isa>.cpp, which CMake builds with -ffp-contract=off so that no
// product is fused into an add: the references round every product). The
// block algorithms are quant/ggml_blocks.inl, included into this level's
// namespace; rows are converted block by block through 32-float buffers, with
// F16C conversions on the AVX2 / AVX-512 levels (exact widening, nearest-even
// narrowing, as `half`'s).
#pragma once

#include <cstdint>
#include <cstring>

#include "isa_arch.hpp"
#include "quant_kernels.hpp"

KVP_NAMESPACE_BEGIN
namespace cpu_detail::KVP_CPU_ISA_NS {

#if KVP_CPU_TU_ISA >= 1
inline void widen8(const std::uint16_t* h, float* f) noexcept {
  _mm256_storeu_ps(f, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))));
}
inline void narrow8(const float* f, std::uint16_t* h) noexcept {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(h), _mm256_cvtps_ph(_mm256_loadu_ps(f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline float half_to_float(std::uint16_t h) noexcept { return _cvtsh_ss(h); }
inline std::uint16_t float_to_half(float f) noexcept {
  // The vector conversion of lane 0 (clang's _cvtss_sh is a macro built on a C99 compound literal, which
  // -Wc99-extensions reports in C++).
  return static_cast<std::uint16_t>(_mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), 0));
}
#else
// SSE2 has no F16C: the exact bit-level conversions (same results as `half`'s).
inline float half_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t man = h & 0x3ffu, out;
  if (exp == 0x1f) {
    out = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    out = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    out = sign;
  } else {
    std::uint32_t e = 113;
    while ((man & 0x400u) == 0) man <<= 1, --e;
    out = sign | (e << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &out, sizeof f);
  return f;
}
inline std::uint16_t float_to_half(float f) noexcept {
  std::uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));  // NaN, quiet
  if (ax >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);                         // overflow -> inf
  if (ax < 0x38800000u) {                                                                           // subnormal or zero
    if (ax < 0x33000000u) return static_cast<std::uint16_t>(sign);
    const std::uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u, shift = 126 - e;
    std::uint32_t r = m >> shift;
    const std::uint32_t rem = m & ((1u << shift) - 1), half_ulp = 1u << (shift - 1);
    if (rem > half_ulp || (rem == half_ulp && (r & 1u))) ++r;
    return static_cast<std::uint16_t>(sign | r);
  }
  std::uint32_t r = ((ax - 0x38000000u) >> 13);
  const std::uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return static_cast<std::uint16_t>(sign | r);
}
#endif

inline float mul(float a, float b) noexcept { return a * b; }  // this unit is compiled with -ffp-contract=off
inline void put_half(std::uint8_t* p, float v) noexcept {
  const std::uint16_t b = float_to_half(v);
  p[0] = static_cast<std::uint8_t>(b & 0xff);
  p[1] = static_cast<std::uint8_t>(b >> 8);
}
inline float get_half(const std::uint8_t* p) noexcept { return half_to_float(static_cast<std::uint16_t>(p[0] | (p[1] << 8))); }

#include "kvpolicy/quant/ggml_blocks.inl"

inline bool ggml_quantize_block_v(GgmlType t, const float* x, std::uint8_t* out) noexcept;  // quant_codec_impl.hpp

inline void quantize_block(GgmlType t, const float* x, std::uint8_t* out) noexcept {
  if (ggml_quantize_block_v(t, x, out)) return;
  switch (t) {
    case GgmlType::kQ8_0: quantize_q8_0(x, out); break;
    case GgmlType::kQ4_0: quantize_q4_0(x, out); break;
    case GgmlType::kQ4_1: quantize_q4_1(x, out); break;
    case GgmlType::kQ5_0: quantize_q5_0(x, out); break;
    case GgmlType::kQ5_1: quantize_q5_1(x, out); break;
    case GgmlType::kIQ4_NL: quantize_iq4_nl(x, out); break;
  }
}
inline void dequantize_block(GgmlType t, const std::uint8_t* in, float* y) noexcept {
  switch (t) {
    case GgmlType::kQ8_0: dequantize_q8_0(in, y); break;
    case GgmlType::kQ4_0: dequantize_q4_0(in, y); break;
    case GgmlType::kQ4_1: dequantize_q4_1(in, y); break;
    case GgmlType::kQ5_0: dequantize_q5_0(in, y); break;
    case GgmlType::kQ5_1: dequantize_q5_1(in, y); break;
    case GgmlType::kIQ4_NL: dequantize_iq4_nl(in, y); break;
  }
}

inline void widen_block(const half* x, float* f) noexcept {
#if KVP_CPU_TU_ISA == 2  // full-width stores, so the block kernels' 512-bit loads of f forward from them
  for (int i = 0; i < kGgmlBlock; i += 16)
    _mm512_storeu_ps(f + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i))));
#elif KVP_CPU_TU_ISA == 1
  for (int i = 0; i < kGgmlBlock; i += 8) widen8(reinterpret_cast<const std::uint16_t*>(x) + i, f + i);
#else
  for (int i = 0; i < kGgmlBlock; ++i) f[i] = half_to_float(x[i].bits);
#endif
}
inline void narrow_block(const float* f, half* y) noexcept {
#if KVP_CPU_TU_ISA >= 1
  for (int i = 0; i < kGgmlBlock; i += 8) narrow8(f + i, reinterpret_cast<std::uint16_t*>(y) + i);
#else
  for (int i = 0; i < kGgmlBlock; ++i) y[i].bits = float_to_half(f[i]);
#endif
}

inline bool ggml_quantize_group16(GgmlType t, const float* f, std::uint8_t* out) noexcept;  // quant_codec_impl.hpp

/// Groups of 16 blocks through the group kernel where the level has one, the rest block by block.
inline void quantize_f32(GgmlType t, const float* x, std::int64_t n, std::uint8_t* out) noexcept {
  const std::int32_t bb = ggml_block_bytes(t);
  const std::int64_t nb = n / kGgmlBlock;
  std::int64_t b = 0;
  for (; b + 16 <= nb; b += 16) {
#if KVP_CPU_TU_ISA >= 1
    if (b + 48 <= nb) prefetch_lines(x + (b + 32) * kGgmlBlock, 32 * 64);
#endif
    if (!ggml_quantize_group16(t, x + b * kGgmlBlock, out + b * bb)) break;
  }
  for (; b < nb; ++b) quantize_block(t, x + b * kGgmlBlock, out + b * bb);
}
inline void quantize_f16(GgmlType t, const half* x, std::int64_t n, std::uint8_t* out) noexcept {
  const std::int32_t bb = ggml_block_bytes(t);
  const std::int64_t nb = n / kGgmlBlock;
  alignas(64) float f[16 * kGgmlBlock];
  std::int64_t b = 0;
  for (; b + 16 <= nb; b += 16) {
#if KVP_CPU_TU_ISA >= 1
    // Eight groups ahead (the hardware prefetcher alone leaves one core well below the
    // read bandwidth on this loop).
    if (b + 144 <= nb) prefetch_lines(x + (b + 128) * kGgmlBlock, 16 * 64);
#endif
    for (int g = 0; g < 16; ++g) widen_block(x + (b + g) * kGgmlBlock, f + g * kGgmlBlock);
    if (!ggml_quantize_group16(t, f, out + b * bb)) break;
  }
  for (; b < nb; ++b) {
    widen_block(x + b * kGgmlBlock, f);
    quantize_block(t, f, out + b * bb);
  }
}
template <class T>
inline bool ggml_dequantize_blocks_v(GgmlType t, const std::uint8_t* in, std::int64_t nb, T* y) noexcept;  // quant_codec_impl.hpp

inline void dequantize_f32(GgmlType t, const std::uint8_t* in, std::int64_t n, float* y) noexcept {
  const std::int32_t bb = ggml_block_bytes(t);
  if (ggml_dequantize_blocks_v(t, in, n / kGgmlBlock, y)) return;
  for (std::int64_t b = 0; b < n / kGgmlBlock; ++b) dequantize_block(t, in + b * bb, y + b * kGgmlBlock);
}
inline void dequantize_f16(GgmlType t, const std::uint8_t* in, std::int64_t n, half* y) noexcept {
  if (ggml_dequantize_blocks_v(t, in, n / kGgmlBlock, y)) return;
  const std::int32_t bb = ggml_block_bytes(t);
  alignas(64) float f[kGgmlBlock] = {};
  for (std::int64_t b = 0; b < n / kGgmlBlock; ++b) {
    dequantize_block(t, in + b * bb, f);
    narrow_block(f, y + b * kGgmlBlock);
  }
}

/// The input scans every quantizing policy runs before it writes a code, which have to keep up with memory:
/// the first element whose magnitude bits (sign cleared) are at least `thr`, or -1. Magnitude bits order
/// non-NaN values of one float format as their magnitudes do, and a NaN's lie above infinity's, so
/// `thr` = infinity's bits finds the first NaN or +-inf (first_nonfinite), and `thr` = the bits of the least
/// representable value >= a bound finds the first !(|x| < bound) (first_not_below). Each 256-element block
/// folds the magnitude bits into an unsigned running maximum with two independent chains (one AND and one MAX
/// per vector) and tests it once; only a block with a hit is searched element by element; the block
/// kScanAhead bytes ahead is prefetched into L2 (prefetcht1; into L1 it was slower from memory, and the
/// auto-vectorised per-element test it replaced reached ~70 % of a plain read pass instead of ~100 %).
constexpr std::int64_t kScanAhead = 8192;

template <class Bits>
inline std::int64_t first_magnitude_at_least(const void* data, std::int64_t n, Bits thr) noexcept {
  constexpr Bits kMag = static_cast<Bits>(sizeof(Bits) == 2 ? 0x7fffu : 0x7fffffffu);
  constexpr std::int64_t kSize = sizeof(Bits);
  const char* x = static_cast<const char*>(data);
  auto search = [&](std::int64_t from, std::int64_t to) -> std::int64_t {
    for (std::int64_t j = from; j < to; ++j) {
      Bits u;
      std::memcpy(&u, x + j * kSize, sizeof u);
      if (static_cast<Bits>(u & kMag) >= thr) return j;
    }
    return -1;
  };
  std::int64_t b0 = 0;
#if KVP_CPU_TU_ISA >= 1
#if KVP_CPU_TU_ISA == 2
  using V = __m512i;
  const V m = kSize == 2 ? _mm512_set1_epi16(static_cast<short>(kMag)) : _mm512_set1_epi32(static_cast<int>(kMag));
  const V t = kSize == 2 ? _mm512_set1_epi16(static_cast<short>(thr)) : _mm512_set1_epi32(static_cast<int>(thr));
  auto load = [](const char* p) { return _mm512_loadu_si512(p); };
  auto vmax = [](V a, V b) { return kSize == 2 ? _mm512_max_epu16(a, b) : _mm512_max_epu32(a, b); };
  auto vand = [](V a, V b) { return _mm512_and_si512(a, b); };
  auto hit = [&](V a) { return (kSize == 2 ? _mm512_cmpge_epu16_mask(a, t) : _mm512_cmpge_epu32_mask(a, t)) != 0; };
  const V zero = _mm512_setzero_si512();
#else
  using V = __m256i;
  const V m = kSize == 2 ? _mm256_set1_epi16(static_cast<short>(kMag)) : _mm256_set1_epi32(static_cast<int>(kMag));
  const V t = kSize == 2 ? _mm256_set1_epi16(static_cast<short>(thr)) : _mm256_set1_epi32(static_cast<int>(thr));
  auto load = [](const char* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  auto vmax = [](V a, V b) { return kSize == 2 ? _mm256_max_epu16(a, b) : _mm256_max_epu32(a, b); };
  auto vand = [](V a, V b) { return _mm256_and_si256(a, b); };
  // a >= t in some lane: max(a, t) == a there (AVX2 has no unsigned compare).
  auto hit = [&](V a) {
    const V mx = vmax(a, t);
    return _mm256_movemask_epi8(kSize == 2 ? _mm256_cmpeq_epi16(mx, a) : _mm256_cmpeq_epi32(mx, a)) != 0;
  };
  const V zero = _mm256_setzero_si256();
#endif
  constexpr std::int64_t kB = 256, kVec = sizeof(V);  // elements per block, bytes per vector
  for (; b0 + kB <= n; b0 += kB) {
    const char* blk = x + b0 * kSize;
    if (b0 + kB + kScanAhead / kSize <= n) prefetch_lines<true>(blk + kScanAhead, kB * kSize);
    V a0 = zero, a1 = zero;
    for (std::int64_t o = 0; o < kB * kSize; o += 2 * kVec) {
      a0 = vmax(a0, vand(load(blk + o), m));
      a1 = vmax(a1, vand(load(blk + o + kVec), m));
    }
    if (hit(vmax(a0, a1))) return search(b0, b0 + kB);
  }
#endif
  return search(b0, n);
}

inline std::int64_t first_nonfinite_f32(const float* x, std::int64_t n) noexcept {
  return first_magnitude_at_least<std::uint32_t>(x, n, 0x7f800000u);
}
inline std::int64_t first_nonfinite_f16(const half* x, std::int64_t n) noexcept {
  static_assert(sizeof(half) == sizeof(std::uint16_t));
  return first_magnitude_at_least<std::uint16_t>(x, n, 0x7c00u);
}

}  // namespace cpu_detail::KVP_CPU_ISA_NS
KVP_NAMESPACE_END

#include "quant_codec_impl.hpp"

/// The level's QuantKernels, in the table's field order (quant_kernels.hpp); each quant_ops_<isa>.cpp defines
/// its accessor from it.
#define KVP_QUANT_KERNEL_ENTRIES                                                                                                        \
  &KVP_CPU_ISA_NS::quantize_f32, &KVP_CPU_ISA_NS::quantize_f16, &KVP_CPU_ISA_NS::dequantize_f32, &KVP_CPU_ISA_NS::dequantize_f16,       \
      &KVP_CPU_ISA_NS::first_nonfinite_f32, &KVP_CPU_ISA_NS::first_nonfinite_f16, &KVP_CPU_ISA_NS::rotate_in_f32,                       \
      &KVP_CPU_ISA_NS::rotate_in_f16, &KVP_CPU_ISA_NS::rotate_out_f32, &KVP_CPU_ISA_NS::rotate_out_f16, &KVP_CPU_ISA_NS::int4_quantize, \
      &KVP_CPU_ISA_NS::int4_dequantize_f32, &KVP_CPU_ISA_NS::int4_dequantize_f16, &KVP_CPU_ISA_NS::fp8_quantize_f32,                    \
      &KVP_CPU_ISA_NS::fp8_quantize_f16, &KVP_CPU_ISA_NS::fp8_dequantize_f32, &KVP_CPU_ISA_NS::fp8_dequantize_f16,                      \
      &KVP_CPU_ISA_NS::first_not_below_f32, &KVP_CPU_ISA_NS::first_not_below_f16, &KVP_CPU_ISA_NS::kivi_r16_f32,                        \
      &KVP_CPU_ISA_NS::kivi_r16_f16, &KVP_CPU_ISA_NS::kivi_quantize_keys, &KVP_CPU_ISA_NS::kivi_dequantize_keys_f32,                    \
      &KVP_CPU_ISA_NS::kivi_dequantize_keys_f16, &KVP_CPU_ISA_NS::kivi_quantize_values, &KVP_CPU_ISA_NS::kivi_dequantize_values_f32,    \
      &KVP_CPU_ISA_NS::kivi_dequantize_values_f16
