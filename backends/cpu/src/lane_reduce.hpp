// SPDX-License-Identifier: Apache-2.0
// Reductions across the lanes of one level's vectors (internal), shared by the quantization codecs
// (quant_codec_impl.hpp) and the top-k kernels (score_kernels_impl.hpp): the largest / smallest lane of one
// float or int32 vector, and the transposing tree that reduces one vector per block into one vector of block results.
#pragma once

#include <cstdint>

#include "isa_arch.hpp"

KVP_NAMESPACE_BEGIN
namespace cpu_detail::KVP_CPU_ISA_NS {

#if KVP_CPU_TU_ISA == 2
inline float hmax(__m512 v) noexcept { return _mm512_reduce_max_ps(v); }
inline float hmin(__m512 v) noexcept { return _mm512_reduce_min_ps(v); }
/// Lane b <- the maximum (Max) or minimum of the 16 lanes of m[b]. The tree leaves the lanes in block order.
template <bool Max>
inline __m512 reduce16(const __m512* m) noexcept {
  const auto op = [](__m512 a, __m512 b) { return Max ? _mm512_max_ps(a, b) : _mm512_min_ps(a, b); };
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i) t[i] = op(_mm512_unpacklo_ps(m[2 * i], m[2 * i + 1]), _mm512_unpackhi_ps(m[2 * i], m[2 * i + 1]));
  for (int i = 0; i < 4; ++i) u[i] = op(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)
    w[i] = op(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88), _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  return op(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}
#elif KVP_CPU_TU_ISA == 1
inline float hmin(__m256 v) noexcept {
  __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_min_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_min_ss(m, _mm_shuffle_ps(m, m, 1)));
}
inline float hmax(__m256 v) noexcept {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}
/// Lane b <- the maximum (Max) or minimum of the 8 lanes of m[b]. The tree leaves the lanes in block order.
template <bool Max>
inline __m256 reduce8(const __m256* m) noexcept {
  const auto op = [](__m256 a, __m256 b) { return Max ? _mm256_max_ps(a, b) : _mm256_min_ps(a, b); };
  __m256 t[4], u[2];
  for (int i = 0; i < 4; ++i) t[i] = op(_mm256_unpacklo_ps(m[2 * i], m[2 * i + 1]), _mm256_unpackhi_ps(m[2 * i], m[2 * i + 1]));
  for (int i = 0; i < 2; ++i) u[i] = op(_mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  return op(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
}
#else
inline float hmax(__m128 v) noexcept {
  const __m128 m = _mm_max_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}
#endif

/// The largest (hmax_i32) / smallest (hmin_i32) int32 lane of one vector, without a round trip through memory.
#if KVP_CPU_TU_ISA == 2
inline std::int32_t hmax_i32(__m512i v) noexcept { return _mm512_reduce_max_epi32(v); }
inline std::int32_t hmin_i32(__m512i v) noexcept { return _mm512_reduce_min_epi32(v); }
#else
template <bool Max>
inline std::int32_t hext_i32(__m128i m) noexcept {
  const auto op = [](__m128i a, __m128i b) {
#if KVP_CPU_TU_ISA == 1
    return Max ? _mm_max_epi32(a, b) : _mm_min_epi32(a, b);
#else  // SSE2 has no 32-bit integer min / max: select through a compare
    const __m128i a_wins = Max ? _mm_cmpgt_epi32(a, b) : _mm_cmplt_epi32(a, b);
    return _mm_or_si128(_mm_and_si128(a_wins, a), _mm_andnot_si128(a_wins, b));
#endif
  };
  m = op(m, _mm_shuffle_epi32(m, 0x4E));  // lanes 2 3 0 1
  m = op(m, _mm_shuffle_epi32(m, 0xB1));  // lanes 1 0 3 2
  return _mm_cvtsi128_si32(m);
}
#if KVP_CPU_TU_ISA == 1
inline std::int32_t hmax_i32(__m256i v) noexcept {
  return hext_i32<true>(_mm_max_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}
inline std::int32_t hmin_i32(__m256i v) noexcept {
  return hext_i32<false>(_mm_min_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}
#else
inline std::int32_t hmax_i32(__m128i v) noexcept { return hext_i32<true>(v); }
inline std::int32_t hmin_i32(__m128i v) noexcept { return hext_i32<false>(v); }
#endif
#endif

#if KVP_CPU_TU_ISA >= 1
/// The level's whole-vector tree: lane b <- the maximum (Max) or minimum of the lanes of m[b], for as many
/// vectors m[b] as a vector has lanes (16 on AVX-512, 8 on AVX2).
template <bool Max>
inline auto reduce_lanes(const auto* m) noexcept {
#if KVP_CPU_TU_ISA == 2
  return reduce16<Max>(m);
#else
  return reduce8<Max>(m);
#endif
}
#endif

}  // namespace cpu_detail::KVP_CPU_ISA_NS
KVP_NAMESPACE_END
