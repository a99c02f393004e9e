// SPDX-License-Identifier: Apache-2.0
// Row codecs of the non-ggml formats (Hadamard rotation, token-wise INT4 /
// INT8, fp8, KIVI), written with AVX2 / AVX-512 intrinsics (internal; included
// by quant_kernels_impl.hpp, so compiled per ISA with -ffp-contract=off).
//
// Every kernel performs the reference's operations (ops/quant_scalar.hpp) in
// the reference's order, one IEEE fp32 operation per step, so its results are
// bit-identical:
//   - lane-wise min / max use MINPS / MAXPS, whose result is (a < b ? a : b)
//     and (a > b ? a : b): the reference's comparisons exactly; a minimum or
//     maximum reduced across lanes is unique up to the sign of zero, and when
//     it is zero the kernel takes the first zero of the row, as the
//     reference's sequential scan does;
//   - a Hadamard butterfly stage computes the same a + c and a - c per pair
//     whatever the vector width, stages in the reference's order;
//   - fp16 rounding (KIVI) is F16C's round-to-nearest-even narrowing;
//   - fp8 encoding rounds the fp32 mantissa to nearest even with integer
//     arithmetic on the bits (normal binades) or by rounding value * 2^k
//     (subnormal binade), which is what the reference's floor / compare does.
// Each kernel returns false for a shape it does not vectorise (head_dim not a
// multiple of its vector width, a rotation block smaller than one vector);
// the entry point (cpu_quant_ops.cpp) then runs the reference. The SSE2 level
// vectorises none of them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "lane_reduce.hpp"

KVP_NAMESPACE_BEGIN
namespace cpu_detail::KVP_CPU_ISA_NS {

#if KVP_CPU_TU_ISA >= 1

constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

#if KVP_CPU_TU_ISA == 2
constexpr std::int64_t kW = 16;
using vf = __m512;
using vi = __m512i;
using vm = __mmask16;
inline vf ld(const float* p) noexcept { return _mm512_loadu_ps(p); }
inline void st(float* p, vf v) noexcept { _mm512_storeu_ps(p, v); }
inline vf ld(const half* p) noexcept { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void st(half* p, vf v) noexcept { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, kRne)); }
inline vf ld_h16(const std::uint8_t* p) noexcept { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void st_h16(std::uint8_t* p, vf v) noexcept { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, kRne)); }
inline vf r16(vf v) noexcept { return _mm512_cvtph_ps(_mm512_cvtps_ph(v, kRne)); }
inline vf set1(float x) noexcept { return _mm512_set1_ps(x); }
inline vi set1i(std::int32_t x) noexcept { return _mm512_set1_epi32(x); }
inline vf add(vf a, vf b) noexcept { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) noexcept { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) noexcept { return _mm512_mul_ps(a, b); }
inline vf div(vf a, vf b) noexcept { return _mm512_div_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) noexcept { return _mm512_fmadd_ps(a, b, c); }
inline vf fnmadd(vf a, vf b, vf c) noexcept { return _mm512_fnmadd_ps(a, b, c); }
inline vf vmin(vf a, vf b) noexcept { return _mm512_min_ps(a, b); }
inline vf vmax(vf a, vf b) noexcept { return _mm512_max_ps(a, b); }
inline vf vtrunc(vf v) noexcept { return _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC); }
inline vf vrint(vf v) noexcept { return _mm512_roundscale_ps(v, kRne); }
inline vm lt(vf a, vf b) noexcept { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
inline vm gt(vf a, vf b) noexcept { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline vm unord(vf a) noexcept { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
inline vf sel(vm m, vf yes, vf no) noexcept { return _mm512_mask_blend_ps(m, no, yes); }
inline vi seli(vm m, vi yes, vi no) noexcept { return _mm512_mask_blend_epi32(m, no, yes); }
inline vm eqi(vi a, vi b) noexcept { return _mm512_cmpeq_epi32_mask(a, b); }
inline vm mand(vm a, vm b) noexcept { return static_cast<vm>(a & b); }
inline vm mnot(vm a) noexcept { return static_cast<vm>(~a); }
inline bool all_lanes(vm a) noexcept { return a == 0xFFFF; }
inline vi toi(vf v) noexcept { return _mm512_cvttps_epi32(v); }
inline vf tof(vi v) noexcept { return _mm512_cvtepi32_ps(v); }
inline vf asf(vi v) noexcept { return _mm512_castsi512_ps(v); }
inline vi asi(vf v) noexcept { return _mm512_castps_si512(v); }
inline vi iand(vi a, vi b) noexcept { return _mm512_and_si512(a, b); }
inline vi ior(vi a, vi b) noexcept { return _mm512_or_si512(a, b); }
inline vi iadd(vi a, vi b) noexcept { return _mm512_add_epi32(a, b); }
inline vi isub(vi a, vi b) noexcept { return _mm512_sub_epi32(a, b); }
inline vi imin(vi a, vi b) noexcept { return _mm512_min_epi32(a, b); }
inline vi sllv(vi a, vi n) noexcept { return _mm512_sllv_epi32(a, n); }
inline vi srlv(vi a, vi n) noexcept { return _mm512_srlv_epi32(a, n); }
inline vi sll(vi a, int n) noexcept { return _mm512_sll_epi32(a, _mm_cvtsi32_si128(n)); }
template <int N>
inline vi slli(vi a) noexcept {
  return _mm512_slli_epi32(a, N);
}
/// Round to the nearest integer, ties to even, and convert (one instruction).
inline vi toi_rne(vf v) noexcept { return _mm512_cvt_roundps_epi32(v, kRne); }
inline vi srl(vi a, int n) noexcept { return _mm512_srl_epi32(a, _mm_cvtsi32_si128(n)); }
inline vi ldi(const std::uint8_t* p) noexcept { return _mm512_loadu_si512(p); }
inline void sti(std::uint8_t* p, vi v) noexcept { _mm512_storeu_si512(p, v); }
/// kW bytes zero-extended to lanes / the low byte of each lane stored.
inline vi ld_u8(const std::uint8_t* p) noexcept { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void st_u8(std::uint8_t* p, vi v) noexcept { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(v)); }
/// Lane l <- word idx[l] of the two little-endian words at p (idx < 2).
inline vi spread_words(const std::uint8_t* p, vi idx) noexcept {
  return _mm512_permutexvar_epi32(idx, _mm512_castsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline bool unord_any(vf a, vf b, vf c, vf d) noexcept {
  return (_mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(c, d, _CMP_UNORD_Q)) != 0;
}
/// Lane indices 0 .. kW-1.
inline vi iota() noexcept { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
#else
constexpr std::int64_t kW = 8;
using vf = __m256;
using vi = __m256i;
using vm = __m256;  // all-ones / all-zeros lanes
inline vf ld(const float* p) noexcept { return _mm256_loadu_ps(p); }
inline void st(float* p, vf v) noexcept { _mm256_storeu_ps(p, v); }
inline vf ld(const half* p) noexcept { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void st(half* p, vf v) noexcept { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, kRne)); }
inline vf ld_h16(const std::uint8_t* p) noexcept { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void st_h16(std::uint8_t* p, vf v) noexcept { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, kRne)); }
inline vf r16(vf v) noexcept { return _mm256_cvtph_ps(_mm256_cvtps_ph(v, kRne)); }
inline vf set1(float x) noexcept { return _mm256_set1_ps(x); }
inline vi set1i(std::int32_t x) noexcept { return _mm256_set1_epi32(x); }
inline vf add(vf a, vf b) noexcept { return _mm256_add_ps(a, b); }
inline vf sub(vf a, vf b) noexcept { return _mm256_sub_ps(a, b); }
inline vf mul(vf a, vf b) noexcept { return _mm256_mul_ps(a, b); }
inline vf div(vf a, vf b) noexcept { return _mm256_div_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) noexcept { return _mm256_fmadd_ps(a, b, c); }
inline vf fnmadd(vf a, vf b, vf c) noexcept { return _mm256_fnmadd_ps(a, b, c); }
inline vf vmin(vf a, vf b) noexcept { return _mm256_min_ps(a, b); }
inline vf vmax(vf a, vf b) noexcept { return _mm256_max_ps(a, b); }
inline vf vtrunc(vf v) noexcept { return _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC); }
inline vf vrint(vf v) noexcept { return _mm256_round_ps(v, kRne); }
inline vm lt(vf a, vf b) noexcept { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
inline vm gt(vf a, vf b) noexcept { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
inline vm unord(vf a) noexcept { return _mm256_cmp_ps(a, a, _CMP_UNORD_Q); }
inline vf sel(vm m, vf yes, vf no) noexcept { return _mm256_blendv_ps(no, yes, m); }
inline vi seli(vm m, vi yes, vi no) noexcept {
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(no), _mm256_castsi256_ps(yes), m));
}
inline vm eqi(vi a, vi b) noexcept { return _mm256_castsi256_ps(_mm256_cmpeq_epi32(a, b)); }
inline vm mand(vm a, vm b) noexcept { return _mm256_and_ps(a, b); }
inline vm mnot(vm a) noexcept { return _mm256_xor_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(-1))); }
inline bool all_lanes(vm a) noexcept { return _mm256_movemask_ps(a) == 0xFF; }
inline vi toi(vf v) noexcept { return _mm256_cvttps_epi32(v); }
inline vf tof(vi v) noexcept { return _mm256_cvtepi32_ps(v); }
inline vf asf(vi v) noexcept { return _mm256_castsi256_ps(v); }
inline vi asi(vf v) noexcept { return _mm256_castps_si256(v); }
inline vi iand(vi a, vi b) noexcept { return _mm256_and_si256(a, b); }
inline vi ior(vi a, vi b) noexcept { return _mm256_or_si256(a, b); }
inline vi iadd(vi a, vi b) noexcept { return _mm256_add_epi32(a, b); }
inline vi isub(vi a, vi b) noexcept { return _mm256_sub_epi32(a, b); }
inline vi imin(vi a, vi b) noexcept { return _mm256_min_epi32(a, b); }
inline vi sllv(vi a, vi n) noexcept { return _mm256_sllv_epi32(a, n); }
inline vi srlv(vi a, vi n) noexcept { return _mm256_srlv_epi32(a, n); }
inline vi sll(vi a, int n) noexcept { return _mm256_sll_epi32(a, _mm_cvtsi32_si128(n)); }
template <int N>
inline vi slli(vi a) noexcept {
  return _mm256_slli_epi32(a, N);
}
inline vi toi_rne(vf v) noexcept { return _mm256_cvttps_epi32(_mm256_round_ps(v, kRne)); }
inline vi srl(vi a, int n) noexcept { return _mm256_srl_epi32(a, _mm_cvtsi32_si128(n)); }
inline vi ldi(const std::uint8_t* p) noexcept { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void sti(std::uint8_t* p, vi v) noexcept { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline vi ld_u8(const std::uint8_t* p) noexcept { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline void st_u8(std::uint8_t* p, vi v) noexcept {  // lanes hold 0..255
  const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w, w));
}
/// Two vectors of codes (lanes hold 0..255) as 16 bytes, v0's lanes then v1's: three shuffles where two st_u8
/// take six (the packs leave dwords v0 0-3, v1 0-3 in lane 0 and v0 4-7, v1 4-7 in lane 1; one permute orders them).
inline void st_u8x2(std::uint8_t* p, vi v0, vi v1) noexcept {
  const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(v0, v1), _mm256_setzero_si256());
  const __m256i o = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(o));
}
inline bool unord_any(vf a, vf b, vf c, vf d) noexcept {
  return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q), _mm256_cmp_ps(c, d, _CMP_UNORD_Q))) != 0;
}
inline vi iota() noexcept { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
#endif

inline float as_float(std::uint32_t u) noexcept {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// The reference's sequential minimum / maximum of x[0, n) given the value m of a lane-parallel one: m, or
/// when m is zero the first zero of x (the scan keeps the first of equal values, and -0 == +0).
inline float first_equal_zero(const float* x, std::int64_t n, float m) noexcept {
  if (m != 0.0f) return m;
  for (std::int64_t i = 0; i < n; ++i)
    if (x[i] == 0.0f) return x[i];
  return m;
}

#if KVP_CPU_TU_ISA == 2
/// Lane b of v in every lane.
inline vf lane_of(vf v, int b) noexcept { return _mm512_permutexvar_ps(_mm512_set1_epi32(b), v); }
/// Bits of the lanes where v == 0 (either sign).
inline std::uint32_t zero_bits(vf v) noexcept { return static_cast<std::uint32_t>(_mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_EQ_OQ)); }
/// -v, bit for bit (the sign flipped, so -0 for +0).
inline vf vneg(vf v) noexcept { return asf(_mm512_xor_si512(asi(v), set1i(static_cast<std::int32_t>(0x80000000u)))); }
#elif KVP_CPU_TU_ISA == 1
/// Lane b of v in every lane.
inline vf lane_of(vf v, int b) noexcept { return _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(b)); }
/// Bits of the lanes where v == 0 (either sign).
inline std::uint32_t zero_bits(vf v) noexcept {
  return static_cast<std::uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_EQ_OQ)));
}
/// -v, bit for bit (the sign flipped, so -0 for +0).
inline vf vneg(vf v) noexcept { return _mm256_xor_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<std::int32_t>(0x80000000u)))); }
#endif

// ---- Hadamard ---------------------------------------------------------------------------------------

/// One butterfly stage of partners L apart inside each vector: lower partners x + p, upper ones p - x,
/// as one fused x * (+-1) + p (the product is exact, so the single rounding is the add's).
template <int L>
inline vf butterfly_in_lanes(vf x) noexcept {
#if KVP_CPU_TU_ISA == 2
  vf p;
  if constexpr (L == 1)
    p = _mm512_permute_ps(x, 0xB1);
  else if constexpr (L == 2)
    p = _mm512_permute_ps(x, 0x4E);
  else if constexpr (L == 4)
    p = _mm512_shuffle_f32x4(x, x, 0xB1);
  else
    p = _mm512_shuffle_f32x4(x, x, 0x4E);
  constexpr __mmask16 upper = L == 1 ? 0xAAAA : L == 2 ? 0xCCCC : L == 4 ? 0xF0F0 : 0xFF00;
  const vf sign = _mm512_mask_blend_ps(upper, _mm512_set1_ps(1.0f), _mm512_set1_ps(-1.0f));
  return _mm512_fmadd_ps(x, sign, p);
#else
  vf p;
  if constexpr (L == 1)
    p = _mm256_permute_ps(x, 0xB1);
  else if constexpr (L == 2)
    p = _mm256_permute_ps(x, 0x4E);
  else
    p = _mm256_permute2f128_ps(x, x, 0x01);
  constexpr int upper = L == 1 ? 0xAA : L == 2 ? 0xCC : 0xF0;
  const vf sign = _mm256_blend_ps(_mm256_set1_ps(1.0f), _mm256_set1_ps(-1.0f), upper);
  return _mm256_fmadd_ps(x, sign, p);
#endif
}
/// The in-vector stages (partners 1, 2, .. kW / 2 apart), in the reference's order.
inline vf butterflies_in_lanes(vf x) noexcept {
  x = butterfly_in_lanes<1>(x);
  x = butterfly_in_lanes<2>(x);
  x = butterfly_in_lanes<4>(x);
#if KVP_CPU_TU_ISA == 2
  x = butterfly_in_lanes<8>(x);
#endif
  return x;
}

inline void butterfly(vf& a, vf& c) noexcept {
  const vf t = a;
  a = add(t, c);
  c = sub(t, c);
}
/// The block of n = NV * kW values at `in` rotated in registers and scaled by s (unless Scaled is false: the
/// additions only), written to `out` (which may be `in`; NV = 1, 2, 4 or 8; stages written out so that the vectors
/// stay in registers). Loads widen and stores narrow through the codec's ld / st, so a row is read and written
/// once whatever its types.
template <int NV, bool Scaled = true, class Ti, class To>
inline void fwht_regs(const Ti* in, To* out, vf s) noexcept {
  vf v0 = butterflies_in_lanes(ld(in)), v1, v2, v3, v4, v5, v6, v7;
  if constexpr (NV >= 2) v1 = butterflies_in_lanes(ld(in + kW));
  if constexpr (NV >= 4) {
    v2 = butterflies_in_lanes(ld(in + 2 * kW));
    v3 = butterflies_in_lanes(ld(in + 3 * kW));
  }
  if constexpr (NV >= 8) {
    v4 = butterflies_in_lanes(ld(in + 4 * kW));
    v5 = butterflies_in_lanes(ld(in + 5 * kW));
    v6 = butterflies_in_lanes(ld(in + 6 * kW));
    v7 = butterflies_in_lanes(ld(in + 7 * kW));
  }
  if constexpr (NV >= 2) butterfly(v0, v1);  // partners kW apart
  if constexpr (NV >= 4) {
    butterfly(v2, v3);
    butterfly(v0, v2);  // 2 kW apart
    butterfly(v1, v3);
  }
  if constexpr (NV >= 8) {
    butterfly(v4, v5);
    butterfly(v6, v7);
    butterfly(v4, v6);
    butterfly(v5, v7);
    butterfly(v0, v4);  // 4 kW apart
    butterfly(v1, v5);
    butterfly(v2, v6);
    butterfly(v3, v7);
  }
  const auto put = [&](To* o, vf v) {
    if constexpr (Scaled)
      st(o, mul(v, s));
    else
      st(o, v);
  };
  put(out, v0);
  if constexpr (NV >= 2) put(out + kW, v1);
  if constexpr (NV >= 4) {
    put(out + 2 * kW, v2);
    put(out + 3 * kW, v3);
  }
  if constexpr (NV >= 8) {
    put(out + 4 * kW, v4);
    put(out + 5 * kW, v5);
    put(out + 6 * kW, v6);
    put(out + 7 * kW, v7);
  }
}
/// The block of n = 16 kW values (128 on AVX2, 256 on AVX-512): each half's stages in registers (unscaled, into
/// the float `work`, which may alias `in`), then the last stage (partners 8 kW apart) with the scale on the way
/// to `out`. The same additions in the same order as the reference, so the same bits; one pass over L1-resident
/// work in place of fwht_memory's pass per stage.
template <class Ti, class To>
inline void fwht_regs16(const Ti* in, To* out, float* work, vf s) noexcept {
  fwht_regs<8, false>(in, work, s);
  fwht_regs<8, false>(in + 8 * kW, work + 8 * kW, s);
  for (int i = 0; i < 8 * kW; i += kW) {
    const vf a = ld(work + i), c = ld(work + i + 8 * kW);
    st(out + i, mul(add(a, c), s));
    st(out + i + 8 * kW, mul(sub(a, c), s));
  }
}
/// The block of n >= kW floats at b rotated in memory, stage by stage (blocks beyond the register tiles).
inline void fwht_memory(float* b, std::int64_t n, vf s) noexcept {
  for (std::int64_t i = 0; i < n; i += kW) st(b + i, butterflies_in_lanes(ld(b + i)));
  for (std::int64_t len = kW; len < n; len <<= 1)
    for (std::int64_t i = 0; i < n; i += 2 * len)
      for (std::int64_t j = i; j < i + len; j += kW) {
        const vf a = ld(b + j), c = ld(b + j + len);
        st(b + j, add(a, c));
        st(b + j + len, sub(a, c));
      }
  for (std::int64_t i = 0; i < n; i += kW) st(b + i, mul(ld(b + i), s));
}
/// 1 / sqrt(n), the rotation's scale (as quant/hadamard.hpp computes it).
inline vf fwht_scale(std::int64_t n) noexcept { return set1(static_cast<float>(1.0 / __builtin_sqrt(static_cast<double>(n)))); }
/// Every row of `rows`: out row <- R (in row) with blocks of n = NV kW (in registers; NV = 16 through fwht_regs16
/// and the row's `work`) or, for NV == 0, of any
/// n >= kW rotated in memory in the row's `work` (a float row of d that may be destroyed: the in or out row when
/// that is a float row). quant/hadamard.hpp's hadamard_rotate; s = fwht_scale(n). `each(r, in, out, work)` names
/// the rows (and prefetches); the block size is dispatched once per call, not per row.
template <int NV, class Rowfn>
inline void fwht_rows(std::int64_t rows, std::int64_t d, std::int64_t n, vf s, Rowfn&& each) noexcept {
  for (std::int64_t r = 0; r < rows; ++r)
    each(r, [&](const auto* in, auto* out, float* work) {
      for (std::int64_t base = 0; base < d; base += n) {
        if constexpr (NV == 16) {
          fwht_regs16(in + base, out + base, work + base, s);
        } else if constexpr (NV > 0) {
          fwht_regs<NV>(in + base, out + base, s);
        } else {
          float* w = work + base;
          if (static_cast<const void*>(in + base) != static_cast<const void*>(w))
            for (std::int64_t c = 0; c < n; c += kW) st(w + c, ld(in + base + c));
          fwht_memory(w, n, s);
          if (static_cast<const void*>(out + base) != static_cast<const void*>(w))
            for (std::int64_t c = 0; c < n; c += kW) st(out + base + c, ld(w + c));
        }
      }
    });
}
template <class Rowfn>
inline void fwht_rows_any(std::int64_t rows, std::int64_t d, std::int64_t n, Rowfn&& each) noexcept {
  const vf s = fwht_scale(n);
  switch (n / kW) {
    case 1: fwht_rows<1>(rows, d, n, s, each); break;
    case 2: fwht_rows<2>(rows, d, n, s, each); break;
    case 4: fwht_rows<4>(rows, d, n, s, each); break;
    case 8: fwht_rows<8>(rows, d, n, s, each); break;
    case 16: fwht_rows<16>(rows, d, n, s, each); break;
    default: fwht_rows<0>(rows, d, n, s, each); break;
  }
}
/// Rows a streaming codec prefetches ahead of the one it reads (the hardware prefetcher alone keeps one core
/// well below the read bandwidth on these row-at-a-time loops).
constexpr std::int64_t kPrefetchRows = 24;
template <class T>
inline void prefetch_row(const T* p, std::int64_t d, bool valid) noexcept {
  if (valid) prefetch_lines(p, d * static_cast<std::int64_t>(sizeof(T)));
}
inline bool rotation_ok(std::int64_t d, std::int64_t n) noexcept { return d % kW == 0 && (n <= 1 || (n >= kW && d % n == 0)); }

// One pass per row: loaded (widened), rotated in registers and stored (narrowed) once; the block size is
// dispatched and the scale set up once per call.
template <class T>
inline bool rotate_in(const T* x, std::int64_t rows, std::int64_t x_stride, std::int64_t d, std::int64_t n, float* y) noexcept {
  if (!rotation_ok(d, n)) return false;
  if (n <= 1) {
    for (std::int64_t r = 0; r < rows; ++r) {
      prefetch_row(x + (r + kPrefetchRows) * x_stride, d, r + kPrefetchRows < rows);
      for (std::int64_t c = 0; c < d; c += kW) st(y + r * d + c, ld(x + r * x_stride + c));
    }
    return true;
  }
  fwht_rows_any(rows, d, n, [&](std::int64_t r, auto&& rotate) {
    prefetch_row(x + (r + kPrefetchRows) * x_stride, d, r + kPrefetchRows < rows);
    rotate(x + r * x_stride, y + r * d, y + r * d);
  });
  return true;
}
template <class T>
inline bool rotate_out(float* y, std::int64_t rows, std::int64_t d, std::int64_t n, T* out, std::int64_t out_stride) noexcept {
  if (!rotation_ok(d, n)) return false;
  if (n <= 1) {
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < d; c += kW) st(out + r * out_stride + c, ld(y + r * d + c));
    return true;
  }
  fwht_rows_any(rows, d, n, [&](std::int64_t r, auto&& rotate) { rotate(y + r * d, out + r * out_stride, y + r * d); });
  return true;
}

// ---- token-wise INT4 / INT8 -------------------------------------------------------------------------

inline bool int4_quantize(const float* x, std::int64_t rows, std::int64_t d, int bits, std::uint8_t* out,
                          std::int64_t out_stride) noexcept {
  const std::int64_t h = bits == 4 ? d / 2 : d;
  if (h % kW != 0 || h == 0) return false;
  const float top = static_cast<float>((1 << bits) - 1);
  const vf half_ = set1(0.5f), vtop = set1(top), vzero = set1(0.0f);
  // Row r's codes and trailer with its scale and zero point.
  const auto codes = [&](std::int64_t r, float scale, float zero) {
    const float* xr = x + r * d;
    std::uint8_t* o = out + r * out_stride;
    const vf vs = set1(scale), vz = set1(zero);
    auto code = [&](const float* p) {
      vf t = vtrunc(add(add(div(ld(p), vs), vz), half_));
      t = sel(lt(t, vzero), vzero, sel(gt(t, vtop), vtop, t));
      return toi(t);
    };
    if (bits == 4) {
      std::int64_t c = 0;
#if KVP_CPU_TU_ISA == 1
      for (; c + 2 * kW <= h; c += 2 * kW)
        st_u8x2(o + c, ior(code(xr + c), sll(code(xr + c + h), 4)), ior(code(xr + c + kW), sll(code(xr + c + kW + h), 4)));
#endif
      for (; c < h; c += kW) st_u8(o + c, ior(code(xr + c), sll(code(xr + c + h), 4)));
    } else {
      for (std::int64_t c = 0; c < d; c += kW) st_u8(o + c, code(xr + c));
    }
    std::memcpy(o + d * bits / 8, &scale, 4);
    std::memcpy(o + d * bits / 8 + 4, &zero, 4);
  };
  // The reference's range, scale and zero point of one row (its first zero where a minimum or maximum is 0).
  const auto row = [&](std::int64_t r) {
    const float* xr = x + r * d;
    vf mn = ld(xr), mx = mn;
    for (std::int64_t c = kW; c < d; c += kW) {
      const vf v = ld(xr + c);
      mn = vmin(v, mn);
      mx = vmax(v, mx);
    }
    const float lo = first_equal_zero(xr, d, hmin(mn)), hi = first_equal_zero(xr, d, hmax(mx));
    const float range = hi - lo;
    const float scale = (range > 1e-8f ? range : 1e-8f) / top;
    codes(r, scale, -lo / scale);
  };
  std::int64_t r = 0;
#if KVP_CPU_TU_ISA >= 1
  // kW rows at once (16 on AVX-512, 8 on AVX2): their minima and maxima reduce through one tree, scales and
  // zero points divide as one vector (the per-row scalar divisions were a serial chain). A row whose minimum
  // or maximum is zero takes the per-row path, which finds the reference's signed zero.
  for (; r + kW <= rows; r += kW) {
    vf lo[kW], hi[kW];
    for (int i = 0; i < kW; ++i) {
      const float* xr = x + (r + i) * d;
      vf mn = ld(xr), mx = mn;
      for (std::int64_t c = kW; c < d; c += kW) {
        const vf v = ld(xr + c);
        mn = vmin(v, mn);
        mx = vmax(v, mx);
      }
      lo[i] = mn, hi[i] = mx;
    }
    const vf vlo = reduce_lanes<false>(lo), vhi = reduce_lanes<true>(hi), range = sub(vhi, vlo);
    const vf scale = div(sel(gt(range, set1(1e-8f)), range, set1(1e-8f)), vtop);
    const vf zero = div(vneg(vlo), scale);
    const std::uint32_t zeros = zero_bits(vlo) | zero_bits(vhi);
    alignas(64) float sc[kW], zp[kW];
    st(sc, scale);
    st(zp, zero);
    for (int i = 0; i < kW; ++i) {
      if (zeros >> i & 1u)
        row(r + i);
      else
        codes(r + i, sc[i], zp[i]);
    }
  }
#endif
  for (; r < rows; ++r) row(r);
  return true;
}
template <class T>
inline bool int4_dequantize(const std::uint8_t* in, std::int64_t rows, std::int64_t in_stride, std::int64_t d, int bits, T* y,
                            std::int64_t y_stride) noexcept {
  const std::int64_t h = bits == 4 ? d / 2 : d;
  if (h % kW != 0 || h == 0) return false;
  const vi m4 = set1i(15);
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::uint8_t* i = in + r * in_stride;
    T* yr = y + r * y_stride;
    float scale, zero;
    std::memcpy(&scale, i + d * bits / 8, 4);
    std::memcpy(&zero, i + d * bits / 8 + 4, 4);
    const vf vs = set1(scale), vz = set1(zero);
    if (bits == 4) {
      for (std::int64_t c = 0; c < h; c += kW) {
        const vi b = ld_u8(i + c);
        st(yr + c, mul(sub(tof(iand(b, m4)), vz), vs));
        st(yr + c + h, mul(sub(tof(srl(b, 4)), vz), vs));
      }
    } else {
      for (std::int64_t c = 0; c < d; c += kW) st(yr + c, mul(sub(tof(ld_u8(i + c)), vz), vs));
    }
  }
  return true;
}

// ---- fp8 --------------------------------------------------------------------------------------------

// quant/fp8.hpp's traits, restated here: a per-ISA unit calls only its own functions (isa_dispatch.hpp).
struct Fp8Consts {
  int mant_bits, bias, max_code, nan_code;
  float max;
};
inline Fp8Consts fp8_consts(Fp8Format f) noexcept {
  return f == Fp8Format::kE4M3 ? Fp8Consts{3, 7, 0x7e, 0x7f, 448.0f} : Fp8Consts{2, 15, 0x7b, 0x7e, 57344.0f};
}

/// Codes of v: quant/fp8.hpp's fp8_encode, lane-wise.
inline vi fp8_encode_v(Fp8Format f, vf v) noexcept {
  const Fp8Consts t = fp8_consts(f);
  const int M = t.mant_bits;
  const vi bits = asi(v);
  const vi sign = srl(iand(bits, set1i(static_cast<std::int32_t>(0x80000000u))), 24);
  const vi ab = iand(bits, set1i(0x7fffffff));
  const vf a = asf(ab);
  // Normal binades: round the mantissa to M bits, ties to even, on the bits (a carry moves to the next binade).
  const int shift = 23 - M;
  const vi lsb = iand(srl(ab, shift), set1i(1));
  const vi rounded = srl(iadd(iadd(ab, set1i((1 << (shift - 1)) - 1)), lsb), shift);
  const vi normal = isub(rounded, set1i((127 - t.bias) << M));
  // The subnormal binade (a < 2^(1 - bias), zero included): a * 2^(M - 1 + bias) rounded to nearest even.
  const vf scaled = mul(a, set1(as_float(static_cast<std::uint32_t>(127 + M - 1 + t.bias) << 23)));
  const vi sub_code = toi(vrint(scaled));
  const vf min_normal = set1(as_float(static_cast<std::uint32_t>(127 + 1 - t.bias) << 23));
  vi code = seli(lt(a, min_normal), sub_code, normal);
  code = imin(code, set1i(t.max_code));
  code = seli(lt(a, set1(t.max)), code, set1i(t.max_code));  // >= max or infinite: saturate
  code = seli(unord(v), set1i(t.nan_code), code);            // NaN: the canonical NaN code, sign kept
  return ior(code, sign);
}
/// Values of codes c (lanes 0..255): quant/fp8.hpp's fp8_decode, lane-wise (NaN codes give the positive quiet NaN).
inline vf fp8_decode_v(Fp8Format f, vi c) noexcept {
  const Fp8Consts t = fp8_consts(f);
  const int M = t.mant_bits;
  const vi c7 = iand(c, set1i(0x7f));
  const vi e = srl(c7, M), m = iand(c7, set1i((1 << M) - 1));
  const vf normal = asf(iadd(sll(c7, 23 - M), set1i((127 - t.bias) << 23)));
  const vf sub_v = mul(tof(m), set1(as_float(static_cast<std::uint32_t>(127 + 1 - t.bias - M) << 23)));
  const vm is_sub = eqi(e, set1i(0));
  vi val = asi(sel(is_sub, sub_v, normal));
  const vi emax = set1i((1 << (7 - M)) - 1);
  vm is_nan, is_inf;
  if (f == Fp8Format::kE4M3) {
    is_nan = eqi(c7, set1i(0x7f));
    is_inf = mand(is_nan, mnot(is_nan));
  } else {
    const vm top = eqi(e, emax), m0 = eqi(m, set1i(0));
    is_inf = mand(top, m0);
    is_nan = mand(top, mnot(m0));
  }
  val = seli(is_inf, set1i(0x7f800000), val);
  val = ior(val, sll(iand(c, set1i(0x80)), 24));
  return sel(is_nan, asf(set1i(0x7fc00000)), asf(val));
}

/// The 2 kW codes at p widened: lo = codes [0, kW), hi = [kW, 2 kW), each code's value times 2^8 (e4m3) or 1
/// (e5m2). An fp8 code is the top of an fp16 pattern: e5m2 is fp16's high byte; e4m3 shifted left 7 (the sign
/// moved to bit 15) is an fp16 of the same sign and mantissa, 2^8 times smaller, subnormals included, because
/// fp16's exponent bias is 8 above e4m3's. The hardware's fp16 conversion then gives the exact value (no
/// special case for subnormal codes); NaN codes become the positive quiet NaN, as quant/fp8.hpp's fp8_decode.
inline void fp8_decode_pair(Fp8Format f, const std::uint8_t* p, vf& lo, vf& hi) noexcept {
#if KVP_CPU_TU_ISA == 2
  const __m512i c = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i c7 = _mm512_and_si512(c, _mm512_set1_epi16(0x7f));
  __m512i h;
  __mmask32 nan;
  if (f == Fp8Format::kE4M3) {
    const __m512i t = _mm512_slli_epi16(c, 7);
    h = _mm512_add_epi16(t, _mm512_and_si512(t, _mm512_set1_epi16(0x4000)));  // sign: bit 14 -> bit 15
    nan = _mm512_cmpeq_epi16_mask(c7, _mm512_set1_epi16(0x7f));
  } else {
    h = _mm512_slli_epi16(c, 8);
    nan = _mm512_cmpgt_epi16_mask(c7, _mm512_set1_epi16(0x7c));
  }
  h = _mm512_mask_blend_epi16(nan, h, _mm512_set1_epi16(0x7e00));
  lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
#else
  const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i c7 = _mm256_and_si256(c, _mm256_set1_epi16(0x7f));
  __m256i h, nan;
  if (f == Fp8Format::kE4M3) {
    const __m256i t = _mm256_slli_epi16(c, 7);
    h = _mm256_add_epi16(t, _mm256_and_si256(t, _mm256_set1_epi16(0x4000)));  // sign: bit 14 -> bit 15
    nan = _mm256_cmpeq_epi16(c7, _mm256_set1_epi16(0x7f));
  } else {
    h = _mm256_slli_epi16(c, 8);
    nan = _mm256_cmpgt_epi16(c7, _mm256_set1_epi16(0x7c));
  }
  h = _mm256_blendv_epi8(h, _mm256_set1_epi16(0x7e00), nan);
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
#endif
}

template <class T>
inline bool fp8_quantize(Fp8Format f, const T* x, std::int64_t rows, std::int64_t x_stride, std::int64_t d, float scale, std::uint8_t* out,
                         std::int64_t out_stride) noexcept {
  if (d % kW != 0 || d == 0) return false;
  const vf absmask = asf(set1i(0x7fffffff));
  std::int64_t r = 0;
#if KVP_CPU_TU_ISA >= 1
  // Per-row scales, kW rows at once: their absolute maxima reduce through one tree and the scales divide as
  // one vector (per row, the reduction and the scalar division were a serial chain in front of the codes).
  if (scale <= 0.0f)
    for (; r + kW <= rows; r += kW) {
      vf am[kW];
      for (int i = 0; i < kW; ++i) {
        const T* xr = x + (r + i) * x_stride;
        prefetch_row(x + (r + i + kPrefetchRows) * x_stride, d, r + i + kPrefetchRows < rows);
        vf m = set1(0.0f);
        for (std::int64_t c = 0; c < d; c += kW) m = vmax(asf(iand(asi(ld(xr + c)), asi(absmask))), m);
        am[i] = m;
      }
      const vf amax = reduce_lanes<true>(am);
      const vf s16 = sel(gt(amax, set1(0.0f)), div(amax, set1(fp8_consts(f).max)), set1(1.0f));
      alignas(64) float sv[kW];
      st(sv, s16);
      for (int i = 0; i < kW; ++i) {
        const T* xr = x + (r + i) * x_stride;
        std::uint8_t* o = out + (r + i) * out_stride;
        std::memcpy(o + d, sv + i, sizeof(float));
        std::memset(o + d + sizeof(float), 0, 12);
        const vf vs = set1(sv[i]);
        for (std::int64_t c = 0; c < d; c += kW) st_u8(o + c, fp8_encode_v(f, div(ld(xr + c), vs)));
      }
    }
#endif
  for (; r < rows; ++r) {
    const T* xr = x + r * x_stride;
    std::uint8_t* o = out + r * out_stride;
    prefetch_row(x + (r + kPrefetchRows) * x_stride, d, r + kPrefetchRows < rows);
    float s = scale;
    if (s <= 0.0f) {
      vf am = set1(0.0f);
      for (std::int64_t c = 0; c < d; c += kW) am = vmax(asf(iand(asi(ld(xr + c)), asi(absmask))), am);
      const float amax = hmax(am);
      s = amax > 0.0f ? amax / fp8_consts(f).max : 1.0f;
      std::memcpy(o + d, &s, sizeof s);
      std::memset(o + d + sizeof s, 0, 12);
    }
    // A power-of-two scale (1.0, the engines' default, included) divides exactly as a product with its
    // reciprocal: both are the correctly rounded value of the same real number.
    const std::uint32_t sb = [&] {
      std::uint32_t u;
      std::memcpy(&u, &s, sizeof u);
      return u;
    }();
    const std::uint32_t se = (sb >> 23) & 0xffu;
    if ((sb & 0x807fffffu) == 0 && se > 1 && se < 253) {
      const vf inv = set1(as_float((254u - se) << 23));
      for (std::int64_t c = 0; c < d; c += kW) st_u8(o + c, fp8_encode_v(f, mul(ld(xr + c), inv)));
      continue;
    }
    const vf vs = set1(s);
    for (std::int64_t c = 0; c < d; c += kW) st_u8(o + c, fp8_encode_v(f, div(ld(xr + c), vs)));
  }
  return true;
}
template <class T>
inline bool fp8_dequantize(Fp8Format f, const std::uint8_t* in, std::int64_t rows, std::int64_t in_stride, std::int64_t d, float scale,
                           T* y, std::int64_t y_stride) noexcept {
  if (d % kW != 0 || d == 0) return false;
  // fp8_decode_pair's values carry a factor 2^8 (e4m3) that folds into the scale: v 2^8 is exact, so
  // (v 2^8) * s and v * (2^8 s) round the same real number once, wherever 2^8 s is exact (|s| <= FLT_MAX / 2^8).
  const float factor = f == Fp8Format::kE4M3 ? 256.0f : 1.0f;
  const bool pairs = d % (2 * kW) == 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::uint8_t* i = in + r * in_stride;
    T* yr = y + r * y_stride;
    float s = scale;
    if (s <= 0.0f) std::memcpy(&s, i + d, sizeof s);
    if (pairs && __builtin_fabsf(s) <= 3.4028234663852886e38f / 256.0f) {
      const vf vs = set1(s * factor);
      for (std::int64_t c = 0; c < d; c += 2 * kW) {
        vf lo, hi;
        fp8_decode_pair(f, i + c, lo, hi);
        st(yr + c, mul(lo, vs));
        st(yr + c + kW, mul(hi, vs));
      }
      continue;
    }
    const vf vs = set1(s);
    for (std::int64_t c = 0; c < d; c += kW) st(yr + c, mul(fp8_decode_v(f, ld_u8(i + c)), vs));
  }
  return true;
}

// ---- KIVI -------------------------------------------------------------------------------------------

template <class T>
inline bool kivi_r16(const T* x, std::int64_t rows, std::int64_t x_stride, std::int64_t d, float* y) noexcept {
  if (d % kW != 0) return false;
  for (std::int64_t r = 0; r < rows; ++r) {
    prefetch_row(x + (r + kPrefetchRows) * x_stride, d, r + kPrefetchRows < rows);
    for (std::int64_t c = 0; c < d; c += kW) {
      if constexpr (std::is_same_v<T, half>)
        st(y + r * d + c, ld(x + r * x_stride + c));  // fp16 already
      else
        st(y + r * d + c, r16(ld(x + r * x_stride + c)));
    }
  }
  return true;
}

/// The fp32 quotient a / s, for fp16 values a >= 0 and s in (0, 65504], through s's reciprocal r = 1 / s:
/// q = a r, its remainder a - q s exact by one FMA, then q + rem r rounded once (Markstein's correction).
/// Bit-identical to div(a, s) on that domain: every one of its 1,007,649,792 (a, s) pairs was checked
/// (tests/quant/test_codecs_isa.cpp, "[.exhaustive]"). Two FMAs and a product instead of a division,
/// whose throughput bounds the KIVI quantizers.
inline vf div_fp16_by_recip(vf a, vf s, vf r) noexcept {
  const vf q = mul(a, r);
  return fmadd(fnmadd(q, s, a), r, q);
}

/// KIVI's code of fp16-valued v in a group (mn, scale): nearbyint(clamp(NaN -> 0 of fp16(fp16(v - mn) / scale))).
/// With `recip` (1 / scale), the quotient goes through div_fp16_by_recip: only for groups that pass
/// kivi_recip_ok, so that fp16(v - mn) and the scale are in its domain.
/// There the quotient is >= 0 and never NaN, so the clamp is a minimum.
template <bool Recip = false>
inline vi kivi_code(vf v, vf mn, vf scale, vf top, vf recip = vf{}) noexcept {
  const vf a = r16(sub(v, mn));
  if constexpr (Recip) {
    return toi_rne(vmin(r16(div_fp16_by_recip(a, scale, recip)), top));
  } else {
    vf q = r16(div(a, scale));
    const vf zero = set1(0.0f);
    q = sel(unord(q), zero, q);
    q = sel(lt(q, zero), zero, sel(gt(q, top), top, q));
    return toi(vrint(q));
  }
}
/// One channel vector's key codes, group / (32 / Bits) words of 32 / Bits tokens each (shifts as immediates).
template <int Bits, bool Recip>
inline void kivi_key_words(const float* x, std::int64_t d, std::int64_t c, int group, vf mn, vf scale, vf recip,
                           std::uint8_t* codes) noexcept {
  constexpr int f = 32 / Bits;
  const vf top = set1(static_cast<float>((1 << Bits) - 1));
  for (int w = 0; w < group / f; ++w) {
    vi word = set1i(0);
    [&]<int... J>(std::integer_sequence<int, J...>) {
      ((word = ior(word, slli<Bits * J>(kivi_code<Recip>(ld(x + (w * f + J) * d + c), mn, scale, top, recip)))), ...);
    }
    (std::make_integer_sequence<int, f>{});
    sti(codes + 4 * (w * d + c), word);
  }
}
/// Every lane's group may take kivi_code's reciprocal path: its scale fp16(range / top) is finite (so is the
/// range, top >= 3, and with it every fp16(v - mn) of the group) and > 0.
inline bool kivi_recip_ok(vf scale) noexcept {
  return all_lanes(mand(lt(scale, set1(std::numeric_limits<float>::infinity())), gt(scale, set1(0.0f))));
}
/// kivi_decode before its last fp16 rounding: for consumers that round to fp16 themselves (a store, a table).
inline vf kivi_decode_unrounded(vi q, vf scale, vf mn) noexcept { return add(r16(mul(tof(q), scale)), mn); }
inline vf kivi_decode(vi q, vf scale, vf mn) noexcept { return r16(kivi_decode_unrounded(q, scale, mn)); }
/// kivi_decode stored at p: fp16 output skips the last rounding's return trip (the store rounds to nearest
/// even itself, and rounding twice to fp16 gives what rounding once does): four conversions per vector, not six.
template <class T>
inline void kivi_store(T* p, vi q, vf scale, vf mn) noexcept {
  if constexpr (std::is_same_v<T, half>)
    st(p, kivi_decode_unrounded(q, scale, mn));
  else
    st(p, kivi_decode(q, scale, mn));
}

inline bool kivi_quantize_keys(const float* x, std::int64_t d, int group, int bits, std::uint8_t* codes, std::uint8_t* scales) noexcept {
  if (d % kW != 0) return false;
  const vf top = set1(static_cast<float>((1 << bits) - 1));
  for (std::int64_t c = 0; c < d; c += kW) {
    vf mn = ld(x + c), mx = mn;
    for (int t = 1; t < group; ++t) {
      const vf v = ld(x + t * d + c);
      mn = vmin(v, mn);
      mx = vmax(v, mx);
    }
    const vf scale = r16(div(r16(sub(mx, mn)), top));
    st_h16(scales + 2 * c, scale);
    st_h16(scales + 2 * (d + c), mn);
    const auto pack = [&](auto recip_path, vf recip) {
      constexpr bool kRecip = decltype(recip_path)::value;
      if (bits == 2)
        kivi_key_words<2, kRecip>(x, d, c, group, mn, scale, recip, codes);
      else if (bits == 4)
        kivi_key_words<4, kRecip>(x, d, c, group, mn, scale, recip, codes);
      else
        kivi_key_words<8, kRecip>(x, d, c, group, mn, scale, recip, codes);
    };
    if (kivi_recip_ok(scale))
      pack(std::true_type{}, div(set1(1.0f), scale));
    else
      pack(std::false_type{}, scale);
  }
  return true;
}
/// One key group decoded into y (row t at y + t * y_stride; T float or half: the decoded values are fp16, so
/// either store is exact). Token-major: each output row is written front to back, over blocks of up to 8
/// channel vectors whose scales (2 bits: whose four decoded values) are set up once per group.
template <class T>
inline bool kivi_dequantize_keys(const std::uint8_t* codes, const std::uint8_t* scales, std::int64_t d, int group, int bits, T* y,
                                 std::int64_t y_stride) noexcept {
  if (d % kW != 0) return false;
  constexpr int kBlock = 8;  // channel vectors per pass
  const int f = 32 / bits;
  const vi mask = set1i((1 << bits) - 1);
  for (std::int64_t c0 = 0; c0 < d; c0 += kBlock * kW) {
    const int nb = static_cast<int>(std::min<std::int64_t>(kBlock, (d - c0) / kW));
    vf scale[kBlock], mn[kBlock];
    for (int i = 0; i < nb; ++i) {
      scale[i] = ld_h16(scales + 2 * (c0 + i * kW));
      mn[i] = ld_h16(scales + 2 * (d + c0 + i * kW));
    }
#if KVP_CPU_TU_ISA == 2
    if (bits == 2) {
      // The four values a lane's channel can take, decoded once per group by the decoder's own operations;
      // each code then picks its lane's value by two mask tests and three blends (bit-identical to decoding
      // it, in a third of the instructions).
      vf tab[kBlock][4];
      for (int i = 0; i < nb; ++i)
        for (int k = 0; k < 4; ++k) tab[i][k] = kivi_decode(set1i(k), scale[i], mn[i]);
      for (int w = 0; w < group / 16; ++w)
        for (int j = 0; j < 16; ++j) {
          const vi lo_bit = _mm512_set1_epi32(1 << (2 * j)), hi_bit = _mm512_set1_epi32(2 << (2 * j));
          T* yr = y + (w * 16 + j) * y_stride + c0;
          for (int i = 0; i < nb; ++i) {
            const vi word = ldi(codes + 4 * (w * d + c0 + i * kW));
            const __mmask16 lo = _mm512_test_epi32_mask(word, lo_bit), hi = _mm512_test_epi32_mask(word, hi_bit);
            st(yr + i * kW,
               _mm512_mask_blend_ps(hi, _mm512_mask_blend_ps(lo, tab[i][0], tab[i][1]), _mm512_mask_blend_ps(lo, tab[i][2], tab[i][3])));
          }
        }
      continue;
    }
#else
    if (bits == 2) {
      // As on AVX-512, with each code's two bits shifted to the lanes' sign bits for blendv.
      vf tab[kBlock][4];
      for (int i = 0; i < nb; ++i)
        for (int k = 0; k < 4; ++k) tab[i][k] = kivi_decode(set1i(k), scale[i], mn[i]);
      for (int w = 0; w < group / 16; ++w)
        for (int j = 0; j < 16; ++j) {
          T* yr = y + (w * 16 + j) * y_stride + c0;
          for (int i = 0; i < nb; ++i) {
            const vi word = ldi(codes + 4 * (w * d + c0 + i * kW));
            const vf lo = asf(sll(word, 31 - 2 * j)), hi = asf(sll(word, 30 - 2 * j));
            st(yr + i * kW, _mm256_blendv_ps(_mm256_blendv_ps(tab[i][0], tab[i][1], lo), _mm256_blendv_ps(tab[i][2], tab[i][3], lo), hi));
          }
        }
      continue;
    }
#endif
    // A vector of code words holds f tokens of its channels: loaded once, its f rows written from it.
    for (int w = 0; w < group / f; ++w)
      for (int i = 0; i < nb; ++i) {
        const vi word = ldi(codes + 4 * (w * d + c0 + i * kW));
        T* yc = y + w * f * y_stride + c0 + i * kW;
        for (int j = 0; j < f; ++j) kivi_store(yc + j * y_stride, iand(srl(word, bits * j), mask), scale[i], mn[i]);
      }
  }
  return true;
}

/// Shift of each lane's code inside its word when channel c0 + lane starts at a word boundary (c0 % f == 0
/// for kW <= f; kW > f: several words per vector).
inline vi kivi_lane_shifts(int bits, int first_in_word) noexcept {
  const int f = 32 / bits;
  const vi lane = iota();
  // (first_in_word + lane) mod f, times bits
  return sll(iand(iadd(lane, set1i(first_in_word)), set1i(f - 1)), bits == 2 ? 1 : (bits == 4 ? 2 : 3));
}

/// KIVI value rows at Bits = 2, 4 or 8 (a constant, so the packing below compiles to its one form).
template <int Bits>
inline bool kivi_quantize_values_bits(const float* x, std::int64_t rows, std::int64_t d, int group, std::uint8_t* codes,
                                      std::int64_t codes_stride, std::uint8_t* scales, std::int64_t scales_stride) noexcept {
  constexpr int bits = Bits;
  if (group % kW != 0 || d % group != 0) return false;
  const std::int64_t groups = d / group;
  const vf top = set1(static_cast<float>((1 << bits) - 1));
  // The packed codes of group g of row r with its minimum, fp16 scale and the scale's reciprocal (broadcast).
  const auto codes_with = [&](auto recip_path, std::int64_t r, std::int64_t g, vf vlo, vf vscale, vf vrecip) {
    constexpr bool kRecip = decltype(recip_path)::value;
    const float* xg = x + r * d + g * group;
    std::uint8_t* cw = codes + r * codes_stride;
#if KVP_CPU_TU_ISA == 1
    if (bits != 8 && group % 32 == 0) {
      // 32 channels (4 vectors) at once: their codes as 32 bytes through two packing steps, which leave each
      // 128-bit lane with 4 channels of every vector (channels 0-3 of the 4 vectors, then their channels 4-7);
      // neighbouring channels stay adjacent bytes, so each output byte is made in place (4 bits: a byte and its
      // neighbour shifted by 4; 2 bits: four bytes shifted by 0, 6, 12 and 18 within a 32-bit lane), picked to
      // the lane's front by a byte shuffle and interleaved with the other lane's. Per vector this is a third
      // of the packing instructions of the form below, whose byte shuffles topped this kernel's profile.
      for (std::int64_t c = 0; c < group; c += 32) {
        const __m256i q01 = _mm256_packus_epi32(kivi_code<kRecip>(ld(xg + c), vlo, vscale, top, vrecip),
                                                kivi_code<kRecip>(ld(xg + c + 8), vlo, vscale, top, vrecip));
        const __m256i q23 = _mm256_packus_epi32(kivi_code<kRecip>(ld(xg + c + 16), vlo, vscale, top, vrecip),
                                                kivi_code<kRecip>(ld(xg + c + 24), vlo, vscale, top, vrecip));
        const __m256i b = _mm256_packus_epi16(q01, q23);  // lane 0: channels 0-3 of vectors 0..3; lane 1: 4-7
        const std::int64_t ch = g * group + c;
        if constexpr (bits == 4) {
          const __m256i pair = _mm256_or_si256(b, _mm256_srli_epi16(b, 4));  // low byte of each 16 bits: 2 channels
          const __m256i front = _mm256_shuffle_epi8(pair, _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, -1, -1, -1, -1, -1, -1, -1, -1, 0, 2,
                                                                           4, 6, 8, 10, 12, 14, -1, -1, -1, -1, -1, -1, -1, -1));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(cw + ch / 2),
                           _mm_unpacklo_epi16(_mm256_castsi256_si128(front), _mm256_extracti128_si256(front, 1)));
        } else {
          const __m256i quad = _mm256_or_si256(_mm256_or_si256(b, _mm256_srli_epi32(b, 6)),
                                               _mm256_or_si256(_mm256_srli_epi32(b, 12), _mm256_srli_epi32(b, 18)));
          const __m256i front = _mm256_shuffle_epi8(quad, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0,
                                                                           4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
          _mm_storel_epi64(reinterpret_cast<__m128i*>(cw + ch / 4),
                           _mm_unpacklo_epi8(_mm256_castsi256_si128(front), _mm256_extracti128_si256(front, 1)));
        }
      }
      return;
    }
#endif
    for (std::int64_t c = 0; c < group; c += kW) {
      const vi q = kivi_code<kRecip>(ld(xg + c), vlo, vscale, top, vrecip);
      const std::int64_t ch = g * group + c;  // first channel of the vector
#if KVP_CPU_TU_ISA == 2
      // 16 codes as bytes, combined pairwise by multiply-adds: channel j's code lands at bit bits * (j mod
      // 32 / bits) of its little-endian 32-bit word (KIVI's packing).
      if (bits != 8) {
        const __m128i b8 = _mm512_cvtepi32_epi8(q);
        if (bits == 4) {
          const __m128i u = _mm_maddubs_epi16(b8, _mm_set1_epi16(0x1001));  // b_2k + 16 b_2k+1
          _mm_storel_epi64(reinterpret_cast<__m128i*>(cw + ch / 2), _mm_packus_epi16(u, u));
        } else {
          const __m128i u = _mm_maddubs_epi16(b8, _mm_set1_epi16(0x0401));                  // b_2k + 4 b_2k+1
          const __m128i v = _mm_madd_epi16(u, _mm_set1_epi32(0x00100001));                  // u_2m + 16 u_2m+1
          const __m128i w = _mm_packus_epi16(_mm_packus_epi32(v, v), _mm_setzero_si128());  // four bytes
          const std::uint32_t word = static_cast<std::uint32_t>(_mm_cvtsi128_si32(w));
          std::memcpy(cw + ch / 4, &word, 4);
        }
        continue;
      }
#elif KVP_CPU_TU_ISA == 1
      // The same byte packing for 8 codes (shifting the codes into words and OR-ing the lanes together cost
      // most of this kernel's time on AVX2). 2 bits: the vector is half of a 16-code word and writes its own two
      // bytes only (groups of 8 share words, and a group requantized after its batch must not clear its
      // neighbour's codes); a row ending mid-word zeroes the word's upper half.
      if (bits != 8) {
        const __m128i w16 = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        const __m128i b8 = _mm_packus_epi16(w16, w16);  // bytes 0..7: the codes
        if (bits == 4) {
          const __m128i u = _mm_maddubs_epi16(b8, _mm_set1_epi16(0x1001));  // b_2k + 16 b_2k+1
          const std::uint32_t word = static_cast<std::uint32_t>(_mm_cvtsi128_si32(_mm_packus_epi16(u, u)));
          std::memcpy(cw + ch / 2, &word, 4);
        } else {
          const __m128i u = _mm_maddubs_epi16(b8, _mm_set1_epi16(0x0401));                  // b_2k + 4 b_2k+1
          const __m128i v = _mm_madd_epi16(u, _mm_set1_epi32(0x00100001));                  // u_2m + 16 u_2m+1
          const __m128i w = _mm_packus_epi16(_mm_packus_epi32(v, v), _mm_setzero_si128());  // bytes 0, 1
          const std::uint32_t bits16 = static_cast<std::uint32_t>(_mm_cvtsi128_si32(w)) & 0xffffu;
          std::memcpy(cw + ch / 4, &bits16, ch % 16 == 0 && ch + 8 >= d ? 4 : 2);
        }
        continue;
      }
#endif
      st_u8(cw + ch, q);  // 8 bits: one byte per code
    }
  };
  const auto codes_of = [&](std::int64_t r, std::int64_t g, vf vlo, vf vscale, vf vrecip) {
    if (kivi_recip_ok(vscale))
      codes_with(std::true_type{}, r, g, vlo, vscale, vrecip);
    else
      codes_with(std::false_type{}, r, g, vlo, vscale, vrecip);
  };
  // Group g of row r with its minimum lo and its fp16 scale: scale row, then the codes.
  const auto code_group = [&](std::int64_t r, std::int64_t g, float lo, float scale) {
    std::uint8_t* sc = scales + r * scales_stride;
    put_half(sc + 2 * g, scale);
    put_half(sc + 2 * (groups + g), lo);
    codes_of(r, g, set1(lo), set1(scale), set1(1.0f / scale));
  };
  // The reference's minimum, maximum (its first zero where one is zero) and fp16 range of one group.
  const auto one_group = [&](std::int64_t r, std::int64_t g) {
    const float* xg = x + r * d + g * group;
    vf mn = ld(xg), mx = mn;
    for (int c = static_cast<int>(kW); c < group; c += static_cast<int>(kW)) {
      const vf v = ld(xg + c);
      mn = vmin(v, mn);
      mx = vmax(v, mx);
    }
    const float lo = first_equal_zero(xg, group, hmin(mn)), hi = first_equal_zero(xg, group, hmax(mx));
    // The reference's group_range: fp16(fp16(mx - mn) / top); both stored as fp16 (exact for lo).
    alignas(64) float sv[kW];
    st(sv, r16(div(r16(sub(set1(hi), set1(lo))), top)));
    code_group(r, g, lo, sv[0]);
  };
  const std::int64_t total = rows * groups;  // groups in row order: group k is row k / groups, group k % groups
  std::int64_t k = 0;
#if KVP_CPU_TU_ISA >= 1
  // kW groups at once (16 on AVX-512, 8 on AVX2): minima and maxima through one reduction tree each, the
  // ranges and scales as one vector (per group, the reductions and the scale were a serial chain in front of
  // the codes). A group whose minimum or maximum is zero takes the per-group path, which finds the
  // reference's signed zero.
  std::int64_t gr = 0, gg = 0;  // row and group of group k
  for (; k + kW <= total; k += kW) {
    vf lo[kW], hi[kW];
    for (int i = 0; i < kW; ++i) {
      const float* xg = x + k * group + i * group;  // groups are contiguous, rows of d = groups * group
      vf mn = ld(xg), mx = mn;
      for (int c = static_cast<int>(kW); c < group; c += static_cast<int>(kW)) {
        const vf v = ld(xg + c);
        mn = vmin(v, mn);
        mx = vmax(v, mx);
      }
      lo[i] = mn, hi[i] = mx;
    }
    const vf vlo = reduce_lanes<false>(lo), vhi = reduce_lanes<true>(hi);
    const std::uint32_t zeros = zero_bits(vlo) | zero_bits(vhi);
    const vf vsc = r16(div(r16(sub(vhi, vlo)), top)), vrec = div(set1(1.0f), vsc);
    if (kW % groups == 0) {  // whole rows: each row's scales and minima as fp16 runs of `groups`
      alignas(32) std::uint16_t hs[kW], hl[kW];
      st_h16(reinterpret_cast<std::uint8_t*>(hs), vsc);
      st_h16(reinterpret_cast<std::uint8_t*>(hl), vlo);
      for (std::int64_t i = 0; i < kW; i += groups) {
        std::uint8_t* sc = scales + (gr + i / groups) * scales_stride;
        std::memcpy(sc, hs + i, static_cast<std::size_t>(2 * groups));
        std::memcpy(sc + 2 * groups, hl + i, static_cast<std::size_t>(2 * groups));
      }
      for (int i = 0; i < kW; ++i) {
        codes_of(gr, gg, lane_of(vlo, i), lane_of(vsc, i), lane_of(vrec, i));
        if (++gg == groups) gg = 0, ++gr;
      }
      for (std::uint32_t z = zeros; z; z &= z - 1) {  // after the group's own stores, so these bytes stay
        const std::int64_t kz = k + __builtin_ctz(z);
        one_group(kz / groups, kz % groups);
      }
      continue;
    }
    alignas(64) float lv[kW], sv[kW];
    st(lv, vlo);
    st(sv, vsc);
    for (int i = 0; i < kW; ++i) {
      if (zeros >> i & 1u)
        one_group(gr, gg);
      else
        code_group(gr, gg, lv[i], sv[i]);
      if (++gg == groups) gg = 0, ++gr;
    }
  }
#endif
  for (; k < total; ++k) one_group(k / groups, k % groups);
  return true;
}
inline bool kivi_quantize_values(const float* x, std::int64_t rows, std::int64_t d, int group, int bits, std::uint8_t* codes,
                                 std::int64_t codes_stride, std::uint8_t* scales, std::int64_t scales_stride) noexcept {
  if (bits == 2) return kivi_quantize_values_bits<2>(x, rows, d, group, codes, codes_stride, scales, scales_stride);
  if (bits == 4) return kivi_quantize_values_bits<4>(x, rows, d, group, codes, codes_stride, scales, scales_stride);
  return kivi_quantize_values_bits<8>(x, rows, d, group, codes, codes_stride, scales, scales_stride);
}
#if KVP_CPU_TU_ISA == 1
/// The fp16 bits of 16 values (lv0: entries 0-7, lv1: 8-15), rounded to nearest even, as two byte tables
/// repeated in both 128-bit lanes: lo holds each entry's low byte, hi its high byte (for _mm256_shuffle_epi8).
inline void f16_byte_tables(vf lv0, vf lv1, __m256i& lo, __m256i& hi) noexcept {
  const __m128i split = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m128i a = _mm_shuffle_epi8(_mm256_cvtps_ph(lv0, kRne), split), b = _mm_shuffle_epi8(_mm256_cvtps_ph(lv1, kRne), split);
  lo = _mm256_broadcastsi128_si256(_mm_unpacklo_epi64(a, b));
  hi = _mm256_broadcastsi128_si256(_mm_unpackhi_epi64(a, b));
}
/// The 32 nibbles of 16 bytes as byte indices for _mm256_shuffle_epi8: the low nibbles of bytes 0-15 in the
/// first 128-bit lane, their high nibbles in the second.
inline __m256i nibble_lanes(const std::uint8_t* p) noexcept {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(q), _mm_srli_epi16(q, 4), 1), _mm256_set1_epi8(15));
}
/// 32 channels of 4-bit KIVI value codes (byte j: channel 2j in the low nibble, 2j + 1 in the high one) into
/// fp16 through f16_byte_tables' tables.
inline void kivi4_lookup_f16(__m256i lo, __m256i hi, const std::uint8_t* codes, half* y) noexcept {
  const __m256i idx = nibble_lanes(codes);
  const __m256i l = _mm256_shuffle_epi8(lo, idx), h = _mm256_shuffle_epi8(hi, idx);  // lane 0: even channels, lane 1: odd
  const __m256i e0 = _mm256_unpacklo_epi8(l, h), e1 = _mm256_unpackhi_epi8(l, h);
  const __m256i even = _mm256_permute2x128_si256(e0, e1, 0x20), odd = _mm256_permute2x128_si256(e0, e1, 0x31);
  const __m256i c0 = _mm256_unpacklo_epi16(even, odd), c1 = _mm256_unpackhi_epi16(even, odd);  // channels 0-7 | 16-23, 8-15 | 24-31
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm256_permute2x128_si256(c0, c1, 0x20));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + 16), _mm256_permute2x128_si256(c0, c1, 0x31));
}
/// A 2-bit value group's 4 fp16 values (h: entries 0-3 in its low 64 bits) as byte tables for kivi2_lookup_f16,
/// repeated in both 128-bit lanes: lo holds each entry's low byte, hi its high byte. Its indices are a code c
/// (channels 4j and 4j + 2) or 4c (4j + 1 and 4j + 3), so entries c and 4c both hold value c.
inline void kivi2_f16_tables(__m128i h, __m256i& lo, __m256i& hi) noexcept {
  const __m128i lo_of = _mm_setr_epi8(0, 2, 4, 6, 2, -1, -1, -1, 4, -1, -1, -1, 6, -1, -1, -1);
  const __m128i hi_of = _mm_setr_epi8(1, 3, 5, 7, 3, -1, -1, -1, 5, -1, -1, -1, 7, -1, -1, -1);
  lo = _mm256_broadcastsi128_si256(_mm_shuffle_epi8(h, lo_of));
  hi = _mm256_broadcastsi128_si256(_mm_shuffle_epi8(h, hi_of));
}
/// 32 channels of 2-bit KIVI value codes (byte j: channels 4j .. 4j + 3 at bits 0, 2, 4, 6) into fp16 through
/// kivi2_f16_tables' tables: each byte is copied to its 4 channels' positions, and each position keeps its
/// code's bits as c (bits 0-1) or 4c (bits 2-3) of the byte or of the byte shifted right by 4.
inline void kivi2_lookup_f16(__m256i lo, __m256i hi, const std::uint8_t* codes, half* y) noexcept {
  std::int64_t eight;
  std::memcpy(&eight, codes, 8);
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7);
  const __m256i x = _mm256_shuffle_epi8(_mm256_set1_epi64x(eight), spread);  // byte c: channel c's code byte
  const __m256i low_pos = _mm256_set1_epi32(0x00000c03), high_pos = _mm256_set1_epi32(0x0c030000);
  // srli_epi16 moves the next byte's low bits into this byte's bits 4-7, which high_pos clears.
  const __m256i idx = _mm256_or_si256(_mm256_and_si256(x, low_pos), _mm256_and_si256(_mm256_srli_epi16(x, 4), high_pos));
  const __m256i l = _mm256_shuffle_epi8(lo, idx), h = _mm256_shuffle_epi8(hi, idx);  // byte c: channel c's fp16 bytes
  const __m256i e0 = _mm256_unpacklo_epi8(l, h), e1 = _mm256_unpackhi_epi8(l, h);    // channels 0-7 | 16-23, 8-15 | 24-31
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm256_permute2x128_si256(e0, e1, 0x20));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + 16), _mm256_permute2x128_si256(e0, e1, 0x31));
}
#endif

/// 2 and 4 bits: each group's decoded values in one vector (lane j = the decoder's value of code j, by its own
/// operations), so each code's value is one permute, bit-identical to decoding it (AVX2 at 4 bits decodes each
/// code: 16 values take two vectors there, except for fp16 output in groups of multiples of 32 channels, where
/// the group's 16 values become fp16 byte tables and kivi4_lookup_f16 looks up 32 codes at a time). A vector of
/// 16 channels (AVX-512) takes its codes from one word (2 bits) or two (4 bits); a vector of 8 (AVX2) from half
/// a word or one.
template <int kBits, class T>
inline void kivi_dequantize_values_table(const std::uint8_t* codes, std::int64_t codes_stride, const std::uint8_t* scales,
                                         std::int64_t scales_stride, std::int64_t rows, std::int64_t d, int group, T* y,
                                         std::int64_t y_stride) noexcept {
  constexpr int f = 32 / kBits;
  const std::int64_t groups = d / group;
  const vi mask = set1i((1 << kBits) - 1), shifts = kivi_lane_shifts(kBits, 0);
#if KVP_CPU_TU_ISA == 2
  const vi word_of_lane = srl(iota(), kBits == 2 ? 4 : 3);  // l / f
#else
  const vi shifts_hi = kivi_lane_shifts(kBits, 8);  // 2 bits: channels 8..15 of a word
#endif
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::uint8_t* cw = codes + r * codes_stride;
    const std::uint8_t* sc = scales + r * scales_stride;
    T* yr = y + r * y_stride;
    if (r + 16 < rows) {  // the scale rows' loads head each group's chain
      prefetch_l1(sc + 16 * scales_stride);
      prefetch_l1(cw + 16 * codes_stride);
    }
    for (std::int64_t g = 0; g < groups; ++g) {
      const vf gs = set1(get_half(sc + 2 * g)), gm = set1(get_half(sc + 2 * (groups + g)));
#if KVP_CPU_TU_ISA == 1
      if constexpr (kBits == 4 && std::is_same_v<T, half>) {
        if (group % 32 == 0) {  // the group's 16 outputs as fp16 byte tables, 32 channels per lookup
          __m256i lo, hi;       // (the tables round to fp16 themselves: the decoder's last rounding is theirs)
          f16_byte_tables(kivi_decode_unrounded(iota(), gs, gm), kivi_decode_unrounded(iadd(iota(), set1i(8)), gs, gm), lo, hi);
          for (std::int64_t ch = g * group; ch < (g + 1) * group; ch += 32) kivi4_lookup_f16(lo, hi, cw + ch / 2, yr + ch);
          continue;
        }
      }
      if constexpr (kBits == 2 && std::is_same_v<T, half>) {
        if (group % 32 == 0) {  // the group's 4 outputs as fp16 byte tables (rounded by their conversion), 32 channels per lookup
          __m256i lo, hi;
          kivi2_f16_tables(_mm256_cvtps_ph(kivi_decode_unrounded(iota(), gs, gm), kRne), lo, hi);
          for (std::int64_t ch = g * group; ch < (g + 1) * group; ch += 32) kivi2_lookup_f16(lo, hi, cw + ch / 4, yr + ch);
          continue;
        }
      }
#endif
      const vf table = kivi_decode(iota(), gs, gm);
#if KVP_CPU_TU_ISA != 2
      if (kBits == 2 && group % (2 * kW) == 0) {  // one word's 16 codes make two vectors: loaded once, no per-vector choice
        for (std::int64_t ch = g * group; ch < (g + 1) * group; ch += 2 * kW) {
          std::uint32_t one;
          std::memcpy(&one, cw + 4 * (ch / f), 4);
          const vi w = set1i(static_cast<std::int32_t>(one));
          st(yr + ch, _mm256_permutevar8x32_ps(table, iand(srlv(w, shifts), mask)));
          st(yr + ch + kW, _mm256_permutevar8x32_ps(table, iand(srlv(w, shifts_hi), mask)));
        }
        continue;
      }
#endif
      for (std::int64_t ch = g * group; ch < (g + 1) * group; ch += kW) {
#if KVP_CPU_TU_ISA == 2
        vi w;
        if constexpr (kBits == 2) {
          std::uint32_t one;
          std::memcpy(&one, cw + 4 * (ch / f), 4);
          w = set1i(static_cast<std::int32_t>(one));
        } else {
          w = spread_words(cw + 4 * (ch / f), word_of_lane);
        }
        st(yr + ch, _mm512_permutexvar_ps(iand(srlv(w, shifts), mask), table));
#else
        std::uint32_t one;
        std::memcpy(&one, cw + 4 * (ch / f), 4);
        const vi q = iand(srlv(set1i(static_cast<std::int32_t>(one)), kBits == 2 && ch % f != 0 ? shifts_hi : shifts), mask);
        // 4 bits: the decoder's own operations (two permutes and a blend measured 10 % slower than them).
        if constexpr (kBits == 2)
          st(yr + ch, _mm256_permutevar8x32_ps(table, q));
        else
          kivi_store(yr + ch, q, gs, gm);
#endif
      }
    }
  }
}

/// Value rows decoded into y (row r at y + r * y_stride; T float or half, exact as for the keys).
template <class T>
inline bool kivi_dequantize_values(const std::uint8_t* codes, std::int64_t codes_stride, const std::uint8_t* scales,
                                   std::int64_t scales_stride, std::int64_t rows, std::int64_t d, int group, int bits, T* y,
                                   std::int64_t y_stride) noexcept {
  if (group % kW != 0 || d % group != 0) return false;
  if (bits == 2 || bits == 4) {
    if (bits == 2)
      kivi_dequantize_values_table<2>(codes, codes_stride, scales, scales_stride, rows, d, group, y, y_stride);
    else
      kivi_dequantize_values_table<4>(codes, codes_stride, scales, scales_stride, rows, d, group, y, y_stride);
    return true;
  }
  // 8 bits: one byte per code.
  const std::int64_t groups = d / group;
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::uint8_t* cw = codes + r * codes_stride;
    const std::uint8_t* sc = scales + r * scales_stride;
    T* yr = y + r * y_stride;
    for (std::int64_t g = 0; g < groups; ++g) {
      const vf scale = set1(get_half(sc + 2 * g)), mn = set1(get_half(sc + 2 * (groups + g)));
      for (std::int64_t ch = g * group; ch < (g + 1) * group; ch += kW) kivi_store(yr + ch, ld_u8(cw + ch), scale, mn);
    }
  }
  return true;
}

// ---- ggml block quantizers --------------------------------------------------------------------------
// quant/ggml_blocks.inl's algorithms on one block of 32 values held in 32 / kW vectors: the same fp32
// operations in the same order (products rounded, never fused), the same tie rules: abs_max is exact in
// any order, signed_absmax takes the first element of largest |x|, and min_max keeps the reference's eight
// lanes (x[l], x[l + 8], x[l + 16], x[l + 24]) reduced in lane order, so a signed-zero minimum is the same.

constexpr int kBlockVecs = static_cast<int>(32 / kW);

inline vf vabs(vf v) noexcept { return asf(iand(asi(v), set1i(0x7fffffff))); }
inline vf vfloor(vf v) noexcept {
#if KVP_CPU_TU_ISA == 2
  return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
#else
  return _mm256_round_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
#endif
}
/// Lane bits of v == x (bit l of vector i at bit i * kW + l).
inline std::uint32_t eq_bits(const vf* v, vf x) noexcept {
  std::uint32_t m = 0;
  for (int i = 0; i < kBlockVecs; ++i) {
#if KVP_CPU_TU_ISA == 2
    m |= static_cast<std::uint32_t>(_mm512_cmp_ps_mask(v[i], x, _CMP_EQ_OQ)) << (i * kW);
#else
    m |= static_cast<std::uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(v[i], x, _CMP_EQ_OQ))) << (i * kW);
#endif
  }
  return m;
}
/// Bit 4 of each lane's code (q5 formats' qh), lane bits as eq_bits.
inline std::uint32_t bit4_bits(const vi* q) noexcept {
  std::uint32_t m = 0;
  for (int i = 0; i < kBlockVecs; ++i) {
#if KVP_CPU_TU_ISA == 2
    m |= static_cast<std::uint32_t>(_mm512_test_epi32_mask(q[i], set1i(16))) << (i * kW);
#else
    m |= static_cast<std::uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_slli_epi32(q[i], 27)))) << (i * kW);
#endif
  }
  return m;
}
/// The low byte of each lane (two's complement), kW bytes.
inline void st_i8(std::uint8_t* p, vi v) noexcept {
#if KVP_CPU_TU_ISA == 2
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(v));
#else  // truncating, as the reference's cast (a NaN product converts to INT_MIN, whose low byte is 0)
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1,
                                        -1, -1, -1, -1, -1, -1);
  const __m256i b = _mm256_shuffle_epi8(v, pick);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
#endif
}
inline float block_abs_max(const vf* v) noexcept {
  vf m = vabs(v[0]);
  for (int i = 1; i < kBlockVecs; ++i) m = vmax(vabs(v[i]), m);
  return hmax(m);
}
/// The reference's min_max: eight lanes over the block, then reduced in lane order.
inline void block_min_max(const float* x, float* mn, float* mx) noexcept {
  __m256 lo = _mm256_loadu_ps(x), hi = lo;
  for (int j = 8; j < 32; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    lo = _mm256_min_ps(v, lo);
    hi = _mm256_max_ps(v, hi);
  }
  alignas(32) float l[8], h[8];
  _mm256_store_ps(l, lo);
  _mm256_store_ps(h, hi);
  float a = l[0], b = h[0];
  for (int k = 1; k < 8; ++k) {
    a = l[k] < a ? l[k] : a;
    b = h[k] > b ? h[k] : b;
  }
  *mn = a, *mx = b;
}
/// Codes q (lanes < 16 after the mask) packed as ggml's nibbles: byte j = q[j] | q[j + 16] << 4.
inline void st_nibbles(std::uint8_t* qs, const vi* q) noexcept {
  const vi m = set1i(15);
#if KVP_CPU_TU_ISA == 1  // kBlockVecs = 4: the block's 16 bytes in one store
  st_u8x2(qs, ior(iand(q[0], m), sll(iand(q[2], m), 4)), ior(iand(q[1], m), sll(iand(q[3], m), 4)));
#else
  for (int i = 0; i < kBlockVecs / 2; ++i) st_u8(qs + i * kW, ior(iand(q[i], m), sll(iand(q[i + kBlockVecs / 2], m), 4)));
#endif
}
inline void put_u32(std::uint8_t* p, std::uint32_t v) noexcept { std::memcpy(p, &v, 4); }

/// The 16 iq4_nl levels (kIq4nlValues) as floats, for vector loads: the one copy the decoders read.
alignas(64) inline constexpr float kIq4nlLevels[16] = {kIq4nlValues[0],  kIq4nlValues[1],  kIq4nlValues[2],  kIq4nlValues[3],
                                                       kIq4nlValues[4],  kIq4nlValues[5],  kIq4nlValues[6],  kIq4nlValues[7],
                                                       kIq4nlValues[8],  kIq4nlValues[9],  kIq4nlValues[10], kIq4nlValues[11],
                                                       kIq4nlValues[12], kIq4nlValues[13], kIq4nlValues[14], kIq4nlValues[15]};

/// Lanes of idx (0..15) looked up in the 16 iq4_nl levels (as floats).
inline vf iq4nl_lookup(vi idx) noexcept {
#if KVP_CPU_TU_ISA == 2
  return _mm512_permutexvar_ps(idx, _mm512_load_ps(kIq4nlLevels));
#else
  const vf lo = _mm256_load_ps(kIq4nlLevels), hi = _mm256_load_ps(kIq4nlLevels + 8);
  const vf a = _mm256_permutevar8x32_ps(lo, idx), b = _mm256_permutevar8x32_ps(hi, idx);
  return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(7))));
#endif
}
/// The reference's iq4nl_index of every lane: 0 at or below the first level, 15 at or above the last, else
/// the nearer of the two levels around x, the upper one at an exact midpoint.
inline vi iq4nl_index_v(vf x) noexcept {
#if KVP_CPU_TU_ISA == 2
  // Buckets of 8: bucket b = clamp(floor(x / 8), -16, 15) + 16 holds at most one of the 15 midpoints between
  // adjacent levels (they are >= 11.5 apart), so the code is the number of midpoints below the bucket plus
  // (x >= the bucket's midpoint): two 32-entry lookups and one comparison. This equals the reference's
  // search and nearest-level choice for every finite float (the reference's x - lo < hi - x turns exactly
  // at the midpoints; quant/ggml.hpp's kIq4nlBucket* tables and iq4nl_bucket_index, its scalar form, checked
  // against the reference over all 4,278,190,080 finite floats by test_quant's [.exhaustive] case).
  const vf y = _mm512_min_ps(_mm512_max_ps(mul(x, set1(0.125f)), set1(-16.0f)), set1(15.0f));
  const vi b = iadd(_mm512_cvt_roundps_epi32(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC), set1i(16));
  const vi base_lo = _mm512_loadu_si512(kIq4nlBucketBase), base_hi = _mm512_loadu_si512(kIq4nlBucketBase + 16);
  const vf thr_lo = _mm512_loadu_ps(kIq4nlBucketMid), thr_hi = _mm512_loadu_ps(kIq4nlBucketMid + 16);
  const vi base = _mm512_permutex2var_epi32(base_lo, b, base_hi);
  const vf thr = _mm512_permutex2var_ps(thr_lo, b, thr_hi);
  return _mm512_mask_add_epi32(base, _mm512_cmp_ps_mask(x, thr, _CMP_GE_OQ), base, set1i(1));
#else
  // The same buckets, each 32-entry lookup as four 8-entry permutes picked by bits 3 and 4 of the bucket
  // (blendv reads each lane's top bit). A 15-level comparison scan here cost twice the whole group kernel.
  const vf y = _mm256_min_ps(_mm256_max_ps(mul(x, set1(0.125f)), set1(-16.0f)), set1(15.0f));
  const vi b = iadd(_mm256_cvttps_epi32(_mm256_floor_ps(y)), set1i(16));
  const vf bit3 = _mm256_castsi256_ps(_mm256_slli_epi32(b, 28)), bit4 = _mm256_castsi256_ps(_mm256_slli_epi32(b, 27));
  const auto lookup32 = [&](const float* table) {
    const vf p0 = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table), b), p1 = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table + 8), b);
    const vf p2 = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table + 16), b), p3 = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table + 24), b);
    return _mm256_blendv_ps(_mm256_blendv_ps(p0, p1, bit3), _mm256_blendv_ps(p2, p3, bit3), bit4);
  };
  const vi base = _mm256_castps_si256(lookup32(reinterpret_cast<const float*>(kIq4nlBucketBase)));
  const vf thr = lookup32(kIq4nlBucketMid);
  return _mm256_sub_epi32(base, _mm256_castps_si256(_mm256_cmp_ps(x, thr, _CMP_GE_OQ)));
#endif
}
/// iq4_nl: codes of the nearest levels to x / d0, then d from the least-squares sums, accumulated in the
/// reference's element order (products vectorised, sums sequential).
inline bool iq4nl_quantize_block_v(const float* x, const vf* v, std::uint8_t* out) noexcept {
  vi q[kBlockVecs];
  vf av[kBlockVecs];
  for (int i = 0; i < kBlockVecs; ++i) av[i] = vabs(v[i]);
  const float amax = block_abs_max(v);
  float d = 0.0f;
  if (!(amax < 1e-15f)) {
    const std::uint32_t at = eq_bits(av, set1(amax));
    const float mx = x[__builtin_ctz(at)];
    const float d0 = mx / static_cast<float>(kIq4nlValues[0]), id = 1.0f / d0;
    alignas(64) float tqx[32], tq2[32];
    for (int i = 0; i < kBlockVecs; ++i) {
      q[i] = iq4nl_index_v(mul(set1(id), v[i]));
      const vf lv = iq4nl_lookup(q[i]), w = mul(v[i], v[i]), wl = mul(w, lv);
      st(tqx + i * kW, mul(wl, v[i]));
      st(tq2 + i * kW, mul(wl, lv));
    }
    float sumqx = 0.0f, sumq2 = 0.0f;
    for (int j = 0; j < 32; ++j) {
      sumqx = sumqx + tqx[j];
      sumq2 = sumq2 + tq2[j];
    }
    d = sumqx / sumq2;
  } else {
    for (int i = 0; i < kBlockVecs; ++i) q[i] = set1i(0);
  }
  put_half(out, d);
  st_nibbles(out + 2, q);
  return true;
}

/// One block of 32 finite values into ggml's bytes (q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl).
inline bool ggml_quantize_block_v(GgmlType t, const float* x, std::uint8_t* out) noexcept {
  vf v[kBlockVecs];
  vi q[kBlockVecs];
  for (int i = 0; i < kBlockVecs; ++i) v[i] = ld(x + i * kW);
  switch (t) {
    case GgmlType::kQ8_0: {
      const float d = block_abs_max(v) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      put_half(out, d);
      const vf vid = set1(id), two = set1(2.0f), zero = set1(0.0f);
      for (int i = 0; i < kBlockVecs; ++i) {  // round half away from zero, as the reference's round_away
        const vf p = mul(v[i], vid), a = vabs(p), f = vfloor(a);
        const vf r = add(f, vfloor(mul(two, sub(a, f))));
        st_i8(out + 2 + i * kW, toi(sel(lt(p, zero), sub(zero, r), r)));
      }
      return true;
    }
    case GgmlType::kQ4_0:
    case GgmlType::kQ5_0: {
      const int levels = t == GgmlType::kQ4_0 ? 8 : 16, top = 2 * levels - 1;
      vf av[kBlockVecs];
      for (int i = 0; i < kBlockVecs; ++i) av[i] = vabs(v[i]);
      const float amax = block_abs_max(v);
      const std::uint32_t at = eq_bits(av, set1(amax));
      const float mxv = x[at ? __builtin_ctz(at) : 31];
      const float d = mxv / static_cast<float>(-levels), id = d != 0.0f ? 1.0f / d : 0.0f;
      const vf vid = set1(id), bias = set1(static_cast<float>(levels) + 0.5f);
      for (int i = 0; i < kBlockVecs; ++i) q[i] = imin(toi(add(mul(v[i], vid), bias)), set1i(top));
      put_half(out, d);
      if (t == GgmlType::kQ4_0) {
        st_nibbles(out + 2, q);
      } else {
        put_u32(out + 2, bit4_bits(q));
        st_nibbles(out + 6, q);
      }
      return true;
    }
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_1: {
      const int top = t == GgmlType::kQ4_1 ? 15 : 31;
      float mn, mx;
      block_min_max(x, &mn, &mx);
      const float d = (mx - mn) / static_cast<float>(top), id = d != 0.0f ? 1.0f / d : 0.0f;
      const vf vid = set1(id), vmn = set1(mn), half_ = set1(0.5f);
      for (int i = 0; i < kBlockVecs; ++i) q[i] = imin(toi(add(mul(sub(v[i], vmn), vid), half_)), set1i(top));
      put_half(out, d);
      put_half(out + 2, mn);
      if (t == GgmlType::kQ4_1) {
        st_nibbles(out + 4, q);
      } else {
        put_u32(out + 4, bit4_bits(q));
        st_nibbles(out + 8, q);
      }
      return true;
    }
    case GgmlType::kIQ4_NL: return iq4nl_quantize_block_v(x, v, out);
    default: return false;
  }
}

/// The blocks whose bits are set in `mask` again through the per-block kernel (after the group's own stores,
/// so these bytes are the ones that stay).
inline void requantize_blocks(GgmlType t, const float* f, std::uint8_t* out, std::int32_t bb, std::uint32_t mask) noexcept {
  for (; mask; mask &= mask - 1) {
    const int b = __builtin_ctz(mask);
    ggml_quantize_block_v(t, f + 32 * b, out + b * bb);
  }
}

#if KVP_CPU_TU_ISA == 2
// ---- 16 ggml blocks at once (AVX-512) ------------------------------------------------------------------
// A group of 16 blocks (512 values) runs each step over all 16 before the next: the block statistics reduce
// through one transposing tree into one vector (lane b = block b), the scales divide as one vector, and the
// codes follow with the scales broadcast from their lanes. Every value is the reference's: the reductions are
// exact (abs-max in any order; a signed min / max only differs by the sign of a zero, and such blocks take the
// per-block kernel, which keeps the reference's lane order), and the rounding steps are the same IEEE
// operations. q8_0's round-half-away-from-zero of p is trunc(p + copysign(0.49999997, p)): the sum rounds
// to nearest even, and this equals the reference's floor form for every float of magnitude below 2^31
// (checked exhaustively; q8_0's products are at most 127 in magnitude).

/// The 16 scales as fp16 into each block's first two bytes (and, with m, the min into the next two).
inline void put_scales16(std::uint8_t* out, std::int32_t bb, vf d, const vf* m) noexcept {
  alignas(32) std::uint16_t h[16], hm[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(h), _mm512_cvtps_ph(d, kRne));
  if (m) _mm256_store_si256(reinterpret_cast<__m256i*>(hm), _mm512_cvtps_ph(*m, kRne));
  for (int b = 0; b < 16; ++b) {
    std::memcpy(out + b * bb, h + b, 2);
    if (m) std::memcpy(out + b * bb + 2, hm + b, 2);
  }
}
/// 4-bit codes q0 (elements 0..15) and q1 (16..31), each < 16, as ggml's nibbles (byte j = q[j] | q[j + 16] << 4).
inline void st_nibbles16(std::uint8_t* qs, vi q0, vi q1) noexcept {
  const vi m = set1i(15);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qs),
                   _mm512_cvtepi32_epi8(_mm512_or_si512(_mm512_and_si512(q0, m), _mm512_slli_epi32(_mm512_and_si512(q1, m), 4))));
}
/// Bit 4 of the 32 codes (q5 formats' qh word).
inline void put_bit4(std::uint8_t* p, vi q0, vi q1) noexcept {
  const std::uint32_t h = static_cast<std::uint32_t>(_mm512_test_epi32_mask(q0, set1i(16))) |
                          static_cast<std::uint32_t>(_mm512_test_epi32_mask(q1, set1i(16))) << 16;
  std::memcpy(p, &h, 4);
}

/// Lane b <- the minimum (mn) and maximum (mx) of block b of f's 16 blocks.
inline void block_extremes16(const float* f, vf& mn, vf& mx) noexcept {
  vf lo[16], hi[16];
  for (int b = 0; b < 16; ++b) {
    const vf v0 = ld(f + 32 * b), v1 = ld(f + 32 * b + 16);
    lo[b] = vmin(v0, v1);
    hi[b] = vmax(v0, v1);
  }
  mn = reduce16<false>(lo);
  mx = reduce16<true>(hi);
}

/// Blocks [0, 16) of f (512 finite floats) into out (16 blocks of ggml_block_bytes(t)).
inline bool ggml_quantize_group16(GgmlType t, const float* f, std::uint8_t* out) noexcept {
  const std::int32_t bb = ggml_block_bytes(t);
  const vf absmask = asf(set1i(0x7fffffff)), zero = _mm512_setzero_ps(), one = set1(1.0f);
  switch (t) {
    case GgmlType::kQ8_0: {
      vf m[16];
      for (int b = 0; b < 16; ++b) m[b] = vmax(_mm512_and_ps(ld(f + 32 * b), absmask), _mm512_and_ps(ld(f + 32 * b + 16), absmask));
      const vf d = div(reduce16<true>(m), set1(127.0f));
      const vf id = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(d, zero, _CMP_NEQ_UQ), one, d);
      put_scales16(out, bb, d, nullptr);
      const vi half_ = set1i(0x3effffff), sign = set1i(static_cast<std::int32_t>(0x80000000u));  // 0.49999997f
      for (int b = 0; b < 16; ++b) {
        const vf s = lane_of(id, b);
        for (int i = 0; i < 2; ++i) {
          const vf p = mul(ld(f + 32 * b + 16 * i), s);
          const vf c = asf(_mm512_ternarylogic_epi32(half_, asi(p), sign, 0xD8));  // sign of p, magnitude 0.49999997
          st_i8(out + b * bb + 2 + 16 * i, toi(add(p, c)));
        }
      }
      return true;
    }
    case GgmlType::kQ4_0:
    case GgmlType::kQ5_0: {
      const int levels = t == GgmlType::kQ4_0 ? 8 : 16, top = 2 * levels - 1;
      // The reference's signed maximum is the first element of largest magnitude. With the block's maximum
      // hi and minimum lo, it is hi when hi > -lo and lo when -lo > hi; a block where both signs reach the
      // largest magnitude (or every value is zero) takes the block kernel, which finds the first.
      vf mn, mxv;
      block_extremes16(f, mn, mxv);
      const vf nmn = sub(zero, mn);
      const std::uint32_t ties = static_cast<std::uint32_t>(_mm512_cmp_ps_mask(mxv, nmn, _CMP_EQ_OQ));
      const vf mx = sel(gt(nmn, mxv), mn, mxv);
      const vf d = div(mx, set1(static_cast<float>(-levels)));
      const vf id = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(d, zero, _CMP_NEQ_UQ), one, d);
      put_scales16(out, bb, d, nullptr);
      const vf bias = set1(static_cast<float>(levels) + 0.5f);
      const vi vtop = set1i(top);
      for (int b = 0; b < 16; ++b) {
        const vf s = lane_of(id, b);
        const vi q0 = imin(toi(add(mul(ld(f + 32 * b), s), bias)), vtop), q1 = imin(toi(add(mul(ld(f + 32 * b + 16), s), bias)), vtop);
        if (t == GgmlType::kQ4_0) {
          st_nibbles16(out + b * bb + 2, q0, q1);
        } else {
          put_bit4(out + b * bb + 2, q0, q1);
          st_nibbles16(out + b * bb + 6, q0, q1);
        }
      }
      requantize_blocks(t, f, out, bb, ties);
      return true;
    }
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_1: {
      const int top = t == GgmlType::kQ4_1 ? 15 : 31;
      vf mn, mx;
      block_extremes16(f, mn, mx);
      // A zero minimum or maximum carries the sign the reference's lane order gives it: those blocks take the
      // per-block kernel (after the group's own stores, so theirs are the bytes that stay).
      const std::uint32_t zeros =
          static_cast<std::uint32_t>(_mm512_cmp_ps_mask(mn, zero, _CMP_EQ_OQ) | _mm512_cmp_ps_mask(mx, zero, _CMP_EQ_OQ));
      const vf d = div(sub(mx, mn), set1(static_cast<float>(top)));
      const vf id = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(d, zero, _CMP_NEQ_UQ), one, d);
      put_scales16(out, bb, d, &mn);
      const vf half_ = set1(0.5f);
      const vi vtop = set1i(top);
      const int qs = t == GgmlType::kQ4_1 ? 4 : 8;
      for (int b = 0; b < 16; ++b) {
        const vf s = lane_of(id, b), m0 = lane_of(mn, b);
        const vi q0 = imin(toi(add(mul(sub(ld(f + 32 * b), m0), s), half_)), vtop);
        const vi q1 = imin(toi(add(mul(sub(ld(f + 32 * b + 16), m0), s), half_)), vtop);
        if (t == GgmlType::kQ5_1) put_bit4(out + b * bb + 4, q0, q1);
        st_nibbles16(out + b * bb + qs, q0, q1);
      }
      requantize_blocks(t, f, out, bb, zeros);
      return true;
    }
    case GgmlType::kIQ4_NL: {
      // As q4_0, the signed maximum from the block's extremes (ties of both signs, and blocks below the
      // reference's 1e-15, take the block kernel). The least-squares sums run with lane b = block b, each
      // lane adding its block's products in the reference's element order (the products, stored by block, are
      // transposed into columns in registers).
      vf mn, mxv;
      block_extremes16(f, mn, mxv);
      const vf nmn = sub(zero, mn);
      const vf amax = vmax(mxv, nmn);
      const std::uint32_t slow =
          static_cast<std::uint32_t>(_mm512_cmp_ps_mask(mxv, nmn, _CMP_EQ_OQ) | _mm512_cmp_ps_mask(amax, set1(1e-15f), _CMP_LT_OQ));
      const vf mx = sel(gt(nmn, mxv), mn, mxv);
      const vf d0 = div(mx, set1(static_cast<float>(kIq4nlValues[0])));
      const vf id = div(one, d0);
      alignas(64) float tqx[16 * 32], tq2[16 * 32];
      for (int b = 0; b < 16; ++b) {
        const vf s = lane_of(id, b);
        vi q[2];
        for (int i = 0; i < 2; ++i) {
          const vf v = ld(f + 32 * b + 16 * i);
          q[i] = iq4nl_index_v(mul(s, v));
          const vf lv = iq4nl_lookup(q[i]), w = mul(v, v), wl = mul(w, lv);
          st(tqx + 32 * b + 16 * i, mul(wl, v));
          st(tq2 + 32 * b + 16 * i, mul(wl, lv));
        }
        st_nibbles16(out + b * bb + 2, q[0], q[1]);
      }
      vf sqx = zero, sq2 = zero;
      for (int h = 0; h < 2; ++h) {  // elements 16 h .. 16 h + 15 of every block, as columns
        vf r[16], c[16];
        for (int b = 0; b < 16; ++b) r[b] = ld(tqx + 32 * b + 16 * h);
        transpose16(r, c);
        for (int j = 0; j < 16; ++j) sqx = add(sqx, c[j]);
        for (int b = 0; b < 16; ++b) r[b] = ld(tq2 + 32 * b + 16 * h);
        transpose16(r, c);
        for (int j = 0; j < 16; ++j) sq2 = add(sq2, c[j]);
      }
      put_scales16(out, bb, div(sqx, sq2), nullptr);
      requantize_blocks(t, f, out, bb, slow);
      return true;
    }
    default: return false;
  }
}
#elif KVP_CPU_TU_ISA == 1
// ---- 8 ggml blocks at once (AVX2) ----------------------------------------------------------------------
// The AVX-512 group's design at 8 lanes: a group of 8 blocks reduces its statistics through one transposing
// tree (lane b = block b), divides its scales as one vector and codes each block with its scale broadcast
// from its lane. The per-block kernel spent most of its time in the horizontal reductions and the two
// dependent scalar divisions of every block. Same values as the per-block kernel (the reasoning of the
// AVX-512 group above: exact reductions, the same IEEE operations, and the blocks whose signed extremes
// depend on lane order (zeros, ties of both signs) requantized by the per-block kernel).

/// Bits of the lanes where m is set.
inline std::uint32_t mask_bits(vm m) noexcept { return static_cast<std::uint32_t>(_mm256_movemask_ps(m)); }
/// 1 / d, and 0 where d is zero (the reference's `d != 0 ? 1 / d : 0`).
inline vf recip_or_zero(vf d) noexcept { return _mm256_and_ps(div(set1(1.0f), d), _mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_NEQ_UQ)); }
/// The 8 scales as fp16 into each block's first two bytes (and, with m, the min into the next two).
inline void put_scales8(std::uint8_t* out, std::int32_t bb, vf d, const vf* m) noexcept {
  alignas(16) std::uint16_t h[8], hm[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(h), _mm256_cvtps_ph(d, kRne));
  if (m) _mm_store_si128(reinterpret_cast<__m128i*>(hm), _mm256_cvtps_ph(*m, kRne));
  for (int b = 0; b < 8; ++b) {
    std::memcpy(out + b * bb, h + b, 2);
    if (m) std::memcpy(out + b * bb + 2, hm + b, 2);
  }
}
/// Lane b <- the minimum (mn) and maximum (mx) of block b of f's 8 blocks.
inline void block_extremes8(const float* f, vf& mn, vf& mx) noexcept {
  vf lo[8], hi[8];
  for (int b = 0; b < 8; ++b) {
    const vf v0 = ld(f + 32 * b), v1 = ld(f + 32 * b + 8), v2 = ld(f + 32 * b + 16), v3 = ld(f + 32 * b + 24);
    lo[b] = vmin(vmin(v0, v1), vmin(v2, v3));
    hi[b] = vmax(vmax(v0, v1), vmax(v2, v3));
  }
  mn = reduce8<false>(lo);
  mx = reduce8<true>(hi);
}

/// Blocks [0, 8) of f (256 finite floats) into out (8 blocks of ggml_block_bytes(t)).
inline bool ggml_quantize_group8(GgmlType t, const float* f, std::uint8_t* out) noexcept {
  const std::int32_t bb = ggml_block_bytes(t);
  const vf absmask = asf(set1i(0x7fffffff)), zero = _mm256_setzero_ps();
  switch (t) {
    case GgmlType::kQ8_0: {
      vf m[8];
      for (int b = 0; b < 8; ++b) {
        const float* x = f + 32 * b;
        m[b] = vmax(vmax(_mm256_and_ps(ld(x), absmask), _mm256_and_ps(ld(x + 8), absmask)),
                    vmax(_mm256_and_ps(ld(x + 16), absmask), _mm256_and_ps(ld(x + 24), absmask)));
      }
      const vf d = div(reduce8<true>(m), set1(127.0f));
      const vf id = recip_or_zero(d);
      put_scales8(out, bb, d, nullptr);
      // Round half away from zero as trunc(p + copysign(0.49999997, p)) (the AVX-512 group's form).
      const vf half_ = asf(set1i(0x3effffff)), sign = asf(set1i(static_cast<std::int32_t>(0x80000000u)));
      for (int b = 0; b < 8; ++b) {
        const vf s = lane_of(id, b);
        for (int i = 0; i < 4; ++i) {
          const vf p = mul(ld(f + 32 * b + 8 * i), s);
          const vf c = _mm256_or_ps(_mm256_and_ps(p, sign), half_);
          st_i8(out + b * bb + 2 + 8 * i, toi(add(p, c)));
        }
      }
      return true;
    }
    case GgmlType::kQ4_0:
    case GgmlType::kQ5_0: {
      const int levels = t == GgmlType::kQ4_0 ? 8 : 16, top = 2 * levels - 1;
      vf mn, mxv;
      block_extremes8(f, mn, mxv);
      const vf nmn = sub(zero, mn);
      const std::uint32_t ties = mask_bits(_mm256_cmp_ps(mxv, nmn, _CMP_EQ_OQ));
      const vf mx = sel(gt(nmn, mxv), mn, mxv);
      const vf d = div(mx, set1(static_cast<float>(-levels)));
      const vf id = recip_or_zero(d);
      put_scales8(out, bb, d, nullptr);
      const vf bias = set1(static_cast<float>(levels) + 0.5f);
      const vi vtop = set1i(top);
      for (int b = 0; b < 8; ++b) {
        const vf s = lane_of(id, b);
        vi q[4];
        for (int i = 0; i < 4; ++i) q[i] = imin(toi(add(mul(ld(f + 32 * b + 8 * i), s), bias)), vtop);
        if (t == GgmlType::kQ4_0) {
          st_nibbles(out + b * bb + 2, q);
        } else {
          put_u32(out + b * bb + 2, bit4_bits(q));
          st_nibbles(out + b * bb + 6, q);
        }
      }
      requantize_blocks(t, f, out, bb, ties);
      return true;
    }
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_1: {
      const int top = t == GgmlType::kQ4_1 ? 15 : 31;
      vf mn, mx;
      block_extremes8(f, mn, mx);
      const std::uint32_t zeros = mask_bits(_mm256_or_ps(_mm256_cmp_ps(mn, zero, _CMP_EQ_OQ), _mm256_cmp_ps(mx, zero, _CMP_EQ_OQ)));
      const vf d = div(sub(mx, mn), set1(static_cast<float>(top)));
      const vf id = recip_or_zero(d);
      put_scales8(out, bb, d, &mn);
      const vf half_ = set1(0.5f);
      const vi vtop = set1i(top);
      const int qs = t == GgmlType::kQ4_1 ? 4 : 8;
      for (int b = 0; b < 8; ++b) {
        const vf s = lane_of(id, b), m0 = lane_of(mn, b);
        vi q[4];
        for (int i = 0; i < 4; ++i) q[i] = imin(toi(add(mul(sub(ld(f + 32 * b + 8 * i), m0), s), half_)), vtop);
        if (t == GgmlType::kQ5_1) put_u32(out + b * bb + 4, bit4_bits(q));
        st_nibbles(out + b * bb + qs, q);
      }
      requantize_blocks(t, f, out, bb, zeros);
      return true;
    }
    case GgmlType::kIQ4_NL: {
      // The AVX-512 group's form: the signed maximum from the extremes (ties of both signs, and blocks below
      // the reference's 1e-15, take the per-block kernel); the least-squares sums with lane b = block b, each
      // lane adding its block's products in the reference's element order (transposed 8 x 8 in registers).
      vf mn, mxv;
      block_extremes8(f, mn, mxv);
      const vf nmn = sub(zero, mn);
      const vf amax = vmax(mxv, nmn);
      const std::uint32_t slow =
          mask_bits(_mm256_or_ps(_mm256_cmp_ps(mxv, nmn, _CMP_EQ_OQ), _mm256_cmp_ps(amax, set1(1e-15f), _CMP_LT_OQ)));
      const vf mx = sel(gt(nmn, mxv), mn, mxv);
      const vf d0 = div(mx, set1(static_cast<float>(kIq4nlValues[0])));
      const vf id = div(set1(1.0f), d0);
      alignas(32) float tqx[8 * 32], tq2[8 * 32];
      for (int b = 0; b < 8; ++b) {
        const vf s = lane_of(id, b);
        vi q[4];
        for (int i = 0; i < 4; ++i) {
          const vf v = ld(f + 32 * b + 8 * i);
          q[i] = iq4nl_index_v(mul(s, v));
          const vf lv = iq4nl_lookup(q[i]), w = mul(v, v), wl = mul(w, lv);
          st(tqx + 32 * b + 8 * i, mul(wl, v));
          st(tq2 + 32 * b + 8 * i, mul(wl, lv));
        }
        st_nibbles(out + b * bb + 2, q);
      }
      vf sqx = zero, sq2 = zero;
      for (int h = 0; h < 4; ++h) {  // elements 8 h .. 8 h + 7 of every block, as columns
        vf r[8], c[8];
        for (int b = 0; b < 8; ++b) r[b] = ld(tqx + 32 * b + 8 * h);
        transpose8(r, c);
        for (int j = 0; j < 8; ++j) sqx = add(sqx, c[j]);
        for (int b = 0; b < 8; ++b) r[b] = ld(tq2 + 32 * b + 8 * h);
        transpose8(r, c);
        for (int j = 0; j < 8; ++j) sq2 = add(sq2, c[j]);
      }
      put_scales8(out, bb, div(sqx, sq2), nullptr);
      requantize_blocks(t, f, out, bb, slow);
      return true;
    }
    default: return false;
  }
}

/// Blocks [0, 16) of f as two groups of 8.
inline bool ggml_quantize_group16(GgmlType t, const float* f, std::uint8_t* out) noexcept {
  if (!ggml_quantize_group8(t, f, out)) return false;
  return ggml_quantize_group8(t, f + 8 * 32, out + 8 * ggml_block_bytes(t));
}
#else
inline bool ggml_quantize_group16(GgmlType, const float*, std::uint8_t*) noexcept { return false; }
#endif

/// Codes of vector i of a 4-bit block (element j < 16: low nibble of qs[j], else high nibble of qs[j - 16]).
inline vi block_nibbles(const std::uint8_t* qs, int i) noexcept {
  const vi b = ld_u8(qs + (i % (kBlockVecs / 2)) * kW);
  return i < kBlockVecs / 2 ? iand(b, set1i(15)) : srl(b, 4);
}
/// Bit 4 of the codes of vector i of a q5 block from its qh word.
inline vi block_high(std::uint32_t h, int i) noexcept {
  return sll(iand(srlv(set1i(static_cast<std::int32_t>(h)), iadd(iota(), set1i(i * static_cast<int>(kW)))), set1i(1)), 4);
}

#if KVP_CPU_TU_ISA == 1
/// fp16 output of an iq4_nl block (AVX2): the block's 16 possible outputs, lv0 for codes 0-7 and lv1 for 8-15,
/// computed as floats (the products each element gets) and rounded to fp16 once (f16_byte_tables), then each
/// code's fp16 looked up by two byte shuffles and interleaved: the same bits as converting element by element,
/// without a widen / convert / table permute / multiply / narrow per vector (in L1: 6.2 -> 3.8 ns per block;
/// q4_0 and q4_1, whose codes need no table, were 10 % slower this way and keep the vector path).
inline void decode16_f16(vf lv0, vf lv1, const std::uint8_t* qs, half* y) noexcept {
  __m256i lo, hi;
  f16_byte_tables(lv0, lv1, lo, hi);
  // Codes: element j < 16 is the low nibble of qs[j] (lane 0), element 16 + j its high nibble (lane 1).
  const __m256i idx = nibble_lanes(qs);
  const __m256i l = _mm256_shuffle_epi8(lo, idx), h = _mm256_shuffle_epi8(hi, idx);
  const __m256i e0 = _mm256_unpacklo_epi8(l, h), e1 = _mm256_unpackhi_epi8(l, h);  // elements 0-7 | 16-23, 8-15 | 24-31
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm256_permute2x128_si256(e0, e1, 0x20));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + 16), _mm256_permute2x128_si256(e0, e1, 0x31));
}
#endif

/// One block's bytes of format kT decoded into y[0, 32) (every ggml format): the reference's products and
/// sums, fp16 outputs rounded to nearest even. The format is a template argument so that a row's loop over
/// its blocks (ggml_dequantize_blocks_v) keeps its constants in registers and has no per-block branches on it.
template <GgmlType kT, class T>
inline void ggml_decode_block(const std::uint8_t* in, T* y) noexcept {
  constexpr GgmlType t = kT;
  switch (t) {
    case GgmlType::kQ8_0: {
      const vf d = set1(get_half(in));
      for (int i = 0; i < kBlockVecs; ++i) {
#if KVP_CPU_TU_ISA == 2
        const vi q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 2 + i * kW)));
#else
        const vi q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in + 2 + i * kW)));
#endif
        st(y + i * kW, mul(tof(q), d));
      }
      return;
    }
    case GgmlType::kQ4_0:
    case GgmlType::kQ5_0: {
      constexpr bool five = kT == GgmlType::kQ5_0;
      const vf d = set1(get_half(in));
      const std::uint8_t* qs = in + (five ? 6 : 2);
      if constexpr (five) {
        // q - 16 = nibble + 16 h - 16 = nibble - 16 where the lane's high bit h is clear: one test, compare, and,
        // add per vector instead of shift, and, shift, or, subtract.
        std::uint32_t h = 0;
        std::memcpy(&h, in + 2, 4);
        const vi hv = set1i(static_cast<std::int32_t>(h)), minus16 = set1i(-16);
        for (int i = 0; i < kBlockVecs; ++i) {
          const vi bit = sllv(set1i(1), iadd(iota(), set1i(i * static_cast<int>(kW))));  // constant per i
          const vi nib = block_nibbles(qs, i);
#if KVP_CPU_TU_ISA == 2
          const vi q = _mm512_mask_add_epi32(nib, _mm512_testn_epi32_mask(hv, bit), nib, minus16);
#else
          const vi q = iadd(nib, iand(_mm256_cmpeq_epi32(iand(hv, bit), _mm256_setzero_si256()), minus16));
#endif
          st(y + i * kW, mul(d, tof(q)));
        }
      } else {
        const vi off = set1i(8);
        for (int i = 0; i < kBlockVecs; ++i) st(y + i * kW, mul(d, tof(isub(block_nibbles(qs, i), off))));
      }
      return;
    }
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_1: {
      constexpr bool five = kT == GgmlType::kQ5_1;
      const vf d = set1(get_half(in)), m = set1(get_half(in + 2));
      const std::uint8_t* qs = in + (five ? 8 : 4);
      std::uint32_t h = 0;
      if constexpr (five) std::memcpy(&h, in + 4, 4);
      for (int i = 0; i < kBlockVecs; ++i) {
        vi q = block_nibbles(qs, i);
        if constexpr (five) q = ior(q, block_high(h, i));
        st(y + i * kW, add(mul(d, tof(q)), m));
      }
      return;
    }
    case GgmlType::kIQ4_NL: {
      const vf d = set1(get_half(in));
#if KVP_CPU_TU_ISA == 1
      if constexpr (std::is_same_v<T, half>) {
        decode16_f16(mul(d, _mm256_load_ps(kIq4nlLevels)), mul(d, _mm256_load_ps(kIq4nlLevels + 8)), in + 2, y);
        return;
      }
#endif
      for (int i = 0; i < kBlockVecs; ++i) st(y + i * kW, mul(d, iq4nl_lookup(block_nibbles(in + 2, i))));
      return;
    }
    default: return;
  }
}
/// Blocks [0, nb) of one format, back to back from in (ggml_block_bytes(kT) each), into y.
template <GgmlType kT, class T>
inline void ggml_decode_blocks(const std::uint8_t* in, std::int64_t nb, T* y) noexcept {
  constexpr std::int32_t bb = ggml_block_bytes(kT);
  for (std::int64_t b = 0; b < nb; ++b) ggml_decode_block<kT>(in + b * bb, y + b * 32);
}
/// nb blocks of format t decoded into y, the format dispatched once per call; false where this level has no
/// decoder for t (the caller runs the reference).
template <class T>
inline bool ggml_dequantize_blocks_v(GgmlType t, const std::uint8_t* in, std::int64_t nb, T* y) noexcept {
  switch (t) {
    case GgmlType::kQ8_0: ggml_decode_blocks<GgmlType::kQ8_0>(in, nb, y); return true;
    case GgmlType::kQ4_0: ggml_decode_blocks<GgmlType::kQ4_0>(in, nb, y); return true;
    case GgmlType::kQ4_1: ggml_decode_blocks<GgmlType::kQ4_1>(in, nb, y); return true;
    case GgmlType::kQ5_0: ggml_decode_blocks<GgmlType::kQ5_0>(in, nb, y); return true;
    case GgmlType::kQ5_1: ggml_decode_blocks<GgmlType::kQ5_1>(in, nb, y); return true;
    case GgmlType::kIQ4_NL: ggml_decode_blocks<GgmlType::kIQ4_NL>(in, nb, y); return true;
    default: return false;
  }
}

#else  // SSE2: the reference runs every codec

template <class T>
inline bool rotate_in(const T*, std::int64_t, std::int64_t, std::int64_t, std::int64_t, float*) noexcept {
  return false;
}
template <class T>
inline bool rotate_out(float*, std::int64_t, std::int64_t, std::int64_t, T*, std::int64_t) noexcept {
  return false;
}
inline bool int4_quantize(const float*, std::int64_t, std::int64_t, int, std::uint8_t*, std::int64_t) noexcept { return false; }
template <class T>
inline bool int4_dequantize(const std::uint8_t*, std::int64_t, std::int64_t, std::int64_t, int, T*, std::int64_t) noexcept {
  return false;
}
template <class T>
inline bool fp8_quantize(Fp8Format, const T*, std::int64_t, std::int64_t, std::int64_t, float, std::uint8_t*, std::int64_t) noexcept {
  return false;
}
template <class T>
inline bool fp8_dequantize(Fp8Format, const std::uint8_t*, std::int64_t, std::int64_t, std::int64_t, float, T*, std::int64_t) noexcept {
  return false;
}
template <class T>
inline bool kivi_r16(const T*, std::int64_t, std::int64_t, std::int64_t, float*) noexcept {
  return false;
}
inline bool kivi_quantize_keys(const float*, std::int64_t, int, int, std::uint8_t*, std::uint8_t*) noexcept { return false; }
template <class T>
inline bool kivi_dequantize_keys(const std::uint8_t*, const std::uint8_t*, std::int64_t, int, int, T*, std::int64_t) noexcept {
  return false;
}
inline bool kivi_quantize_values(const float*, std::int64_t, std::int64_t, int, int, std::uint8_t*, std::int64_t, std::uint8_t*,
                                 std::int64_t) noexcept {
  return false;
}
template <class T>
inline bool kivi_dequantize_values(const std::uint8_t*, std::int64_t, const std::uint8_t*, std::int64_t, std::int64_t, std::int64_t, int,
                                   int, T*, std::int64_t) noexcept {
  return false;
}
inline bool ggml_quantize_block_v(GgmlType, const float*, std::uint8_t*) noexcept { return false; }
inline bool ggml_quantize_group16(GgmlType, const float*, std::uint8_t*) noexcept { return false; }
template <class T>
inline bool ggml_dequantize_blocks_v(GgmlType, const std::uint8_t*, std::int64_t, T*) noexcept {
  return false;
}

#endif

/// First index i of x[0, n) with !(|x[i]| < bound), NaN included; -1 if none: first_magnitude_at_least
/// (quant_kernels_impl.hpp) with the magnitude bits of the least value of x's format that is >= bound (none
/// below it passes the test, all from it fail); bound <= 0 or NaN flags every element.
inline std::int64_t first_not_below_f32(const float* x, std::int64_t n, float bound) noexcept {
  std::uint32_t thr = 0;
  if (bound > 0.0f) std::memcpy(&thr, &bound, sizeof thr);  // +inf included; magnitudes order as their bits
  return first_magnitude_at_least<std::uint32_t>(x, n, thr);
}
inline std::int64_t first_not_below_f16(const half* x, std::int64_t n, float bound) noexcept {
  std::uint16_t thr = 0;  // the least fp16 magnitude (0 .. 0x7c00 = inf) whose value is >= bound
  if (bound > 0.0f) {
    std::uint32_t lo = 0, hi = 0x7c00;
    while (lo < hi) {
      const std::uint32_t mid = (lo + hi) / 2;
      if (half_to_float(static_cast<std::uint16_t>(mid)) >= bound)
        hi = mid;
      else
        lo = mid + 1;
    }
    thr = static_cast<std::uint16_t>(lo);
  }
  return first_magnitude_at_least<std::uint16_t>(x, n, thr);
}

// Typed entry points of the kernel table.
inline bool kivi_dequantize_keys_f32(const std::uint8_t* codes, const std::uint8_t* scales, std::int64_t d, int group, int bits, float* y,
                                     std::int64_t ys) noexcept {
  return kivi_dequantize_keys(codes, scales, d, group, bits, y, ys);
}
inline bool kivi_dequantize_keys_f16(const std::uint8_t* codes, const std::uint8_t* scales, std::int64_t d, int group, int bits, half* y,
                                     std::int64_t ys) noexcept {
  return kivi_dequantize_keys(codes, scales, d, group, bits, y, ys);
}
inline bool kivi_dequantize_values_f32(const std::uint8_t* codes, std::int64_t cs, const std::uint8_t* scales, std::int64_t ss,
                                       std::int64_t rows, std::int64_t d, int group, int bits, float* y, std::int64_t ys) noexcept {
  return kivi_dequantize_values(codes, cs, scales, ss, rows, d, group, bits, y, ys);
}
inline bool kivi_dequantize_values_f16(const std::uint8_t* codes, std::int64_t cs, const std::uint8_t* scales, std::int64_t ss,
                                       std::int64_t rows, std::int64_t d, int group, int bits, half* y, std::int64_t ys) noexcept {
  return kivi_dequantize_values(codes, cs, scales, ss, rows, d, group, bits, y, ys);
}
inline bool rotate_in_f32(const float* x, std::int64_t rows, std::int64_t xs, std::int64_t d, std::int64_t n, float* y) noexcept {
  return rotate_in(x, rows, xs, d, n, y);
}
inline bool rotate_in_f16(const half* x, std::int64_t rows, std::int64_t xs, std::int64_t d, std::int64_t n, float* y) noexcept {
  return rotate_in(x, rows, xs, d, n, y);
}
inline bool rotate_out_f32(float* y, std::int64_t rows, std::int64_t d, std::int64_t n, float* o, std::int64_t os) noexcept {
  return rotate_out(y, rows, d, n, o, os);
}
inline bool rotate_out_f16(float* y, std::int64_t rows, std::int64_t d, std::int64_t n, half* o, std::int64_t os) noexcept {
  return rotate_out(y, rows, d, n, o, os);
}
inline bool fp8_quantize_f32(Fp8Format f, const float* x, std::int64_t rows, std::int64_t xs, std::int64_t d, float s, std::uint8_t* o,
                             std::int64_t os) noexcept {
  return fp8_quantize(f, x, rows, xs, d, s, o, os);
}
inline bool fp8_quantize_f16(Fp8Format f, const half* x, std::int64_t rows, std::int64_t xs, std::int64_t d, float s, std::uint8_t* o,
                             std::int64_t os) noexcept {
  return fp8_quantize(f, x, rows, xs, d, s, o, os);
}
inline bool fp8_dequantize_f32(Fp8Format f, const std::uint8_t* in, std::int64_t rows, std::int64_t is, std::int64_t d, float s, float* y,
                               std::int64_t ys) noexcept {
  return fp8_dequantize(f, in, rows, is, d, s, y, ys);
}
inline bool fp8_dequantize_f16(Fp8Format f, const std::uint8_t* in, std::int64_t rows, std::int64_t is, std::int64_t d, float s, half* y,
                               std::int64_t ys) noexcept {
  return fp8_dequantize(f, in, rows, is, d, s, y, ys);
}
inline bool int4_dequantize_f32(const std::uint8_t* in, std::int64_t rows, std::int64_t is, std::int64_t d, int bits, float* y,
                                std::int64_t ys) noexcept {
  return int4_dequantize(in, rows, is, d, bits, y, ys);
}
inline bool int4_dequantize_f16(const std::uint8_t* in, std::int64_t rows, std::int64_t is, std::int64_t d, int bits, half* y,
                                std::int64_t ys) noexcept {
  return int4_dequantize(in, rows, is, d, bits, y, ys);
}
inline bool kivi_r16_f32(const float* x, std::int64_t rows, std::int64_t xs, std::int64_t d, float* y) noexcept {
  return kivi_r16(x, rows, xs, d, y);
}
inline bool kivi_r16_f16(const half* x, std::int64_t rows, std::int64_t xs, std::int64_t d, float* y) noexcept {
  return kivi_r16(x, rows, xs, d, y);
}

}  // namespace cpu_detail::KVP_CPU_ISA_NS
KVP_NAMESPACE_END
