// SPDX-License-Identifier: Apache-2.0
// Page-op kernels, written once and compiled per ISA (internal; included only
// by paged_ops_<isa>.cpp). Self-contained on top of isa_arch.hpp (the level's
// `Arch` and namespace), so the score kernels can change freely. See
// paged_ops_kernels.hpp for the table and paged_ops.cpp for the entry points.
//
// Per the rule in isa_dispatch.hpp nothing here calls an inline function
// defined outside this namespace (no `to_float`, no `Rows::row`, no
// std::min / std::log): conversions are the intrinsics below, core structs are
// read field by field, and libm is called by its C name.
#pragma once

#include <math.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "isa_arch.hpp"
#include "paged_ops_kernels.hpp"

KVP_NAMESPACE_BEGIN
namespace cpu_detail::KVP_CPU_ISA_NS::paged {

using F = xsimd::batch<float, Arch>;
using I = xsimd::batch<std::int32_t, Arch>;
inline constexpr std::int64_t kLanes = static_cast<std::int64_t>(F::size);
inline constexpr float kInf = __builtin_inff();

// ---- one vector of lanes, with exact fp16 / bf16 conversion -----------------------
//
// Loads widen exactly. Stores narrow values that are exactly representable in
// the target type (metadata values come from keys of that type), so every
// route is exact: F16C / AVX-512 conversions round-to-nearest-even (a no-op
// here), bf16 keeps the upper half, NaNs are quieted as `to_bfloat16` does.

inline F load_lanes(const float* p) noexcept { return F::load_unaligned(p); }
inline void store_lanes(float* p, F v) noexcept { v.store_unaligned(p); }

#if KVP_CPU_TU_ISA == 2
inline F load_lanes(const half* p) noexcept { return F(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))); }
inline F load_lanes(const bfloat16* p) noexcept {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return F(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
}
inline void store_lanes(half* p, F v) noexcept {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store_lanes(bfloat16* p, F v) noexcept {
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  __m512i r = _mm512_srli_epi32(_mm512_castps_si512(v), 16);
  r = _mm512_mask_or_epi32(r, nan, r, _mm512_set1_epi32(0x40));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
/// a > b ? a : b lane-wise (vmaxps returns its second operand on NaN or equality).
inline F max_ab(F a, F b) noexcept { return F(_mm512_max_ps(a, b)); }
inline F min_ab(F a, F b) noexcept { return F(_mm512_min_ps(a, b)); }
#elif KVP_CPU_TU_ISA == 1
inline F load_lanes(const half* p) noexcept { return F(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
inline F load_lanes(const bfloat16* p) noexcept {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return F(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
}
inline void store_lanes(half* p, F v) noexcept {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store_lanes(bfloat16* p, F v) noexcept {
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  __m256i r = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
  r = _mm256_or_si256(r, _mm256_and_si256(nan, _mm256_set1_epi32(0x40)));
  // packus works per 128-bit half: [r0..r3 r0..r3 | r4..r7 r4..r7]; gather qwords 0 and 2.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline F max_ab(F a, F b) noexcept { return F(_mm256_max_ps(a, b)); }
inline F min_ab(F a, F b) noexcept { return F(_mm256_min_ps(a, b)); }
#else
/// IEEE half bits -> float bits, exact (normal, subnormal, zero, inf, NaN
/// with its payload and the quiet bit set, as `to_float` does).
inline std::uint32_t half_bits_to_float_bits(std::uint32_t h) noexcept {
  const std::uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu;
  std::uint32_t man = h & 0x3ffu;
  if (exp == 0x1fu) return sign | 0x7f800000u | (man << 13) | (man != 0 ? 0x00400000u : 0u);
  if (exp != 0) return sign | ((exp + 112u) << 23) | (man << 13);
  if (man == 0) return sign;
  std::uint32_t e = 113;  // subnormal: shift the leading one into the implicit bit
  while ((man & 0x400u) == 0) {
    man <<= 1;
    --e;
  }
  return sign | (e << 23) | ((man & 0x3ffu) << 13);
}
/// SSE2 has no half conversion; this is the portable fallback level, so the
/// four lanes are widened one by one (exactly).
inline F load_lanes(const half* p) noexcept {
  std::uint16_t h[4];
  std::memcpy(h, p, sizeof(h));
  alignas(16) std::uint32_t w[4];
  for (int i = 0; i < 4; ++i) w[i] = half_bits_to_float_bits(h[i]);
  return F(_mm_castsi128_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(w))));
}
inline F load_lanes(const bfloat16* p) noexcept {
  return F(_mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
}
/// float -> half bits for values representable in half (normal, subnormal,
/// zero, inf; NaN quieted with its payload's top bits, as `to_half` does).
inline __m128i float4_to_half_exact(__m128 f) noexcept {
  const __m128i x = _mm_castps_si128(f);
  const __m128i sign = _mm_and_si128(_mm_srli_epi32(x, 16), _mm_set1_epi32(0x8000));
  const __m128i a = _mm_and_si128(x, _mm_set1_epi32(0x7fffffff));
  const __m128i normal = _mm_srli_epi32(_mm_sub_epi32(a, _mm_set1_epi32(0x38000000)), 13);
  const __m128i sub = _mm_cvttps_epi32(_mm_mul_ps(_mm_castsi128_ps(a), _mm_set1_ps(16777216.0f)));  // m * 2^-24 -> m
  const __m128i nan_bits = _mm_or_si128(_mm_set1_epi32(0x200), _mm_and_si128(_mm_srli_epi32(a, 13), _mm_set1_epi32(0x3ff)));
  const __m128i is_nan = _mm_cmpgt_epi32(a, _mm_set1_epi32(0x7f800000));
  const __m128i special = _mm_or_si128(_mm_set1_epi32(0x7c00), _mm_and_si128(is_nan, nan_bits));
  const __m128i is_special = _mm_cmpgt_epi32(a, _mm_set1_epi32(0x7f7fffff));
  const __m128i is_sub = _mm_cmplt_epi32(a, _mm_set1_epi32(0x38800000));
  __m128i r = _mm_or_si128(_mm_and_si128(is_sub, sub), _mm_andnot_si128(is_sub, normal));
  r = _mm_or_si128(_mm_and_si128(is_special, special), _mm_andnot_si128(is_special, r));
  return _mm_or_si128(r, sign);
}
inline void store_bits4(void* p, __m128i v) noexcept {
  alignas(16) std::int32_t w[4];
  _mm_store_si128(reinterpret_cast<__m128i*>(w), v);
  std::uint16_t h[4] = {static_cast<std::uint16_t>(w[0]), static_cast<std::uint16_t>(w[1]), static_cast<std::uint16_t>(w[2]),
                        static_cast<std::uint16_t>(w[3])};
  std::memcpy(p, h, sizeof(h));
}
inline void store_lanes(half* p, F v) noexcept { store_bits4(p, float4_to_half_exact(v)); }
inline void store_lanes(bfloat16* p, F v) noexcept {
  const __m128i nan = _mm_castps_si128(_mm_cmpunord_ps(v, v));
  const __m128i r = _mm_srli_epi32(_mm_castps_si128(v), 16);
  store_bits4(p, _mm_or_si128(r, _mm_and_si128(nan, _mm_set1_epi32(0x40))));
}
inline F max_ab(F a, F b) noexcept { return F(_mm_max_ps(a, b)); }
inline F min_ab(F a, F b) noexcept { return F(_mm_min_ps(a, b)); }
#endif

inline std::int64_t imin(std::int64_t a, std::int64_t b) noexcept { return a < b ? a : b; }

/// The first n < kLanes elements, zero padded (through a stack copy).
template <class T>
inline F load_partial(const T* p, std::int64_t n) noexcept {
  using S = std::conditional_t<sizeof(T) == 4, float, std::uint16_t>;
  S tmp[kLanes] = {};
  std::memcpy(tmp, p, static_cast<std::size_t>(n) * sizeof(T));
  return load_lanes(reinterpret_cast<const T*>(tmp));
}
template <class T>
inline void store_partial(T* p, F v, std::int64_t n) noexcept {
  using S = std::conditional_t<sizeof(T) == 4, float, std::uint16_t>;
  S tmp[kLanes];
  store_lanes(reinterpret_cast<T*>(tmp), v);
  std::memcpy(p, tmp, static_cast<std::size_t>(n) * sizeof(T));
}

// ---- metadata fold ------------------------------------------------------------------

/// kV vectors of channels [c, c + kV*kLanes) (the last one `tail` lanes wide
/// when tail > 0) over all rows: 2*kV independent max / min chains.
template <int kV, class Tk, class Tm>
inline void fold_block(const Tk* rows, std::int64_t stride, std::int64_t n, Tm* mx, Tm* mn, int fresh, std::int64_t tail) noexcept {
  F hi[kV], lo[kV];
  for (int v = 0; v < kV; ++v) {
    const bool part = tail > 0 && v == kV - 1;
    hi[v] = fresh ? F(-kInf) : (part ? load_partial(mx + v * kLanes, tail) : load_lanes(mx + v * kLanes));
    lo[v] = fresh ? F(kInf) : (part ? load_partial(mn + v * kLanes, tail) : load_lanes(mn + v * kLanes));
  }
  for (std::int64_t r = 0; r < n; ++r) {
    const Tk* row = rows + r * stride;
    for (int v = 0; v < kV; ++v) {
      const bool part = tail > 0 && v == kV - 1;
      const F k = part ? load_partial(row + v * kLanes, tail) : load_lanes(row + v * kLanes);
      hi[v] = max_ab(k, hi[v]);  // k > hi ? k : hi, as the reference
      lo[v] = min_ab(k, lo[v]);
    }
  }
  for (int v = 0; v < kV; ++v) {
    if (tail > 0 && v == kV - 1) {
      store_partial(mx + v * kLanes, hi[v], tail);
      store_partial(mn + v * kLanes, lo[v], tail);
    } else {
      store_lanes(mx + v * kLanes, hi[v]);
      store_lanes(mn + v * kLanes, lo[v]);
    }
  }
}

template <class Tk, class Tm>
void fold(const Tk* rows, std::int64_t stride, std::int64_t n, std::int64_t d, Tm* mx, Tm* mn, int fresh) noexcept {
  std::int64_t c = 0;
  for (; c + 4 * kLanes <= d; c += 4 * kLanes) fold_block<4>(rows + c, stride, n, mx + c, mn + c, fresh, 0);
  for (; c + kLanes <= d; c += kLanes) fold_block<1>(rows + c, stride, n, mx + c, mn + c, fresh, 0);
  if (c < d) fold_block<1>(rows + c, stride, n, mx + c, mn + c, fresh, d - c);
}

// ---- page upper bounds ------------------------------------------------------------
//
// Pages go in the order given, kBoundsPages at a time, and each page's rows
// are read kv head after kv head. For the usual metadata layout (all heads of
// a page in one contiguous block, `PageMetaView::contiguous`) that is address
// order: one sequential stream per page. While pages i.. are read, the same
// rows of page i + kBoundsAhead are prefetched into L2, so the prefetches are
// spread evenly over the work. Measured on the 128K-token Quest step (fp16,
// 8 kv heads, 4 KiB per page; bench_quest `estimate_vs_read_cold`): the old
// order (16 pages, head after head, rows widened into a buffer) read 16 rows
// 4 KiB apart at a time and reached ~10 GB/s from memory; this one ~20 GB/s on
// scattered page ids (random 4 KiB blocks, which memory itself delivers at
// ~25 GB/s against ~38 GB/s sequential: the benchmark's `pages_GBps` and
// `read_GBps`) and ~25 GB/s on page ids in order.
//
// For one kv head the group's query heads go in tiles of kJ rows against the
// kBoundsPages pages: each q vector is loaded once for the pages and each
// metadata vector (widened from fp16 / bf16 on load) once for the kJ rows, and
// enough independent chains are in flight to cover the FMA latency. Each
// (page, row) ends as one vector of lane sums in `accv`; once every head of
// the pages is done `hsum_lanes` reduces 16 rows at a time into `stage`
// (pages x rows), which is copied into the output rows every kLanes pages.
//
// Per channel vector the fast path adds fma(q-, m, .) and fma(q+, M, .) with
// q+ = max(q, 0) and q- = min(q, 0): the same term max(q*M, q*m) (one of the
// two products is an exact 0), two instructions. It differs from the
// reference only through 0 * inf (infinite metadata or queries), which makes
// its sum NaN; so a NaN sum is recomputed with the exact form
// max(fma(q, M, acc), fma(q, m, acc)), whose NaN rule is the reference's.

inline constexpr std::int64_t kBoundsDimAlign = 16;  // the widest vector (AVX-512 floats), for every level
inline std::int64_t bounds_dpad(std::int64_t d) noexcept { return (d + kBoundsDimAlign - 1) / kBoundsDimAlign * kBoundsDimAlign; }
inline constexpr std::int64_t kBoundsAhead = 8;  // pages prefetched ahead, into L2 (measured: 4 to 32 equal; into L1 lower)

/// {sum of acc[0], ..., sum of acc[kLanes-1]}. xsimd 8.1's `haddp` for
/// AVX-512 returns the sums in a permuted order, so that level has its own
/// reduction tree: 256-, 128-bit halves, then within 128-bit lanes, then
/// one permutation into page order.
inline F hsum_lanes(const F* acc) noexcept {
#if KVP_CPU_TU_ISA == 2
  __m512 s1[8], s2[4], s3[2];
  for (int k = 0; k < 8; ++k) {
    const __m512 a = acc[2 * k], b = acc[2 * k + 1];
    s1[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int k = 0; k < 4; ++k) {
    const __m512 u = s1[2 * k], v = s1[2 * k + 1];
    s2[k] = _mm512_add_ps(_mm512_shuffle_f32x4(u, v, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(u, v, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  for (int k = 0; k < 2; ++k) {
    const __m512 u = s2[2 * k], v = s2[2 * k + 1];
    s3[k] = _mm512_add_ps(_mm512_shuffle_ps(u, v, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(u, v, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 s =
      _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // Element 4i + j now holds the sum of acc[4j + i].
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return F(_mm512_permutexvar_ps(order, s));
#else
  return xsimd::haddp(acc);
#endif
}

/// Keeps v in a register: stops the compiler from folding its load into each
/// FMA that uses it (one load per use, which made the loops load bound).
inline F in_register(F v) noexcept {
  typename F::register_type r = v;
  asm("" : "+v"(r));
  return F(r);
}

/// Lane sums of the fast form for query rows j < kJ against the row pairs of
/// kP pages: out[p * ostride + j] for page p. `qb` is the rows' q+ / q-
/// interleaved per channel vector (`qi` in `bounds`): vector v of row j is at
/// qb + v * qstep + j * 2 kLanes (q+) and + kLanes (q-). Each q vector is
/// loaded once for the kP pages and each metadata vector once for the kJ rows.
/// For kJ <= 4 the q+ and q- terms go into separate chains, and for kJ == 1
/// even and odd vectors too, so at least 8 chains are in flight against the
/// FMA latency. The last partial vector (d not a multiple of kLanes) is
/// loaded zero padded; vectors past d are never read.
template <int kJ, int kP, class Tm>
inline void tile_sums(const float* qb, std::int64_t qstep, const Tm* const* mx, const Tm* const* mn, std::int64_t d, F* out,
                      std::int64_t ostride) noexcept {
  constexpr int kS = kJ * kP <= 8 ? 2 : 1;  // separate q+ / q- chains while registers allow
  constexpr int kV = kJ == 1 ? 2 : 1;       // vectors per step (independent chains)
  F acc[kV][kP][kJ][kS];
#pragma GCC unroll 64
  for (int x = 0; x < kV * kP * kJ * kS; ++x) (&acc[0][0][0][0])[x] = F(0.0f);
  const Tm* px[kP];
  const Tm* pn[kP];
  for (int p = 0; p < kP; ++p) {
    px[p] = mx[p];
    pn[p] = mn[p];
  }
  auto step = [&](int v, const float* qv, const F* M, const F* m) __attribute__((always_inline)) {
#pragma GCC unroll 8
    for (int j = 0; j < kJ; ++j) {
      F a = F::load_aligned(qv + j * 2 * kLanes), b = F::load_aligned(qv + j * 2 * kLanes + kLanes);
      if constexpr (kP > 1) {
        a = in_register(a);
        b = in_register(b);
      }
#pragma GCC unroll 8
      for (int p = 0; p < kP; ++p) {
        if constexpr (kS == 2) {
          acc[v][p][j][0] = xsimd::fma(a, M[p], acc[v][p][j][0]);
          acc[v][p][j][1] = xsimd::fma(b, m[p], acc[v][p][j][1]);
        } else {
          acc[v][p][j][0] = xsimd::fma(a, M[p], xsimd::fma(b, m[p], acc[v][p][j][0]));
        }
      }
    }
  };
  std::int64_t c = 0;
  for (; c + kV * kLanes <= d; c += kV * kLanes, qb += kV * qstep)
#pragma GCC unroll 2
    for (int v = 0; v < kV; ++v) {
      F M[kP], m[kP];
#pragma GCC unroll 8
      for (int p = 0; p < kP; ++p) {
        M[p] = load_lanes(px[p] + c + v * kLanes);
        m[p] = load_lanes(pn[p] + c + v * kLanes);
      }
      step(v, qb + v * qstep, M, m);
    }
  for (; c < d; c += kLanes, qb += qstep) {
    F M[kP], m[kP];
    for (int p = 0; p < kP; ++p) {
      M[p] = c + kLanes <= d ? load_lanes(px[p] + c) : load_partial(px[p] + c, d - c);
      m[p] = c + kLanes <= d ? load_lanes(pn[p] + c) : load_partial(pn[p] + c, d - c);
    }
    step(0, qb, M, m);
  }
#pragma GCC unroll 8
  for (int p = 0; p < kP; ++p)
#pragma GCC unroll 8
    for (int j = 0; j < kJ; ++j) {
      F t = acc[0][p][j][0];
      if constexpr (kS == 2) t += acc[0][p][j][1];
      if constexpr (kV == 2) {
        t += acc[1][p][j][0];
        if constexpr (kS == 2) t += acc[1][p][j][1];
      }
      out[p * ostride + j] = t;
    }
}

/// tile_sums for all G query rows of one kv head (`qb` its block of `qi`): tiles of 8, 4, 2, 1.
template <int kP, class Tm>
inline void group_sums(const float* qb, std::int64_t G, const Tm* const* mx, const Tm* const* mn, std::int64_t d, F* out,
                       std::int64_t ostride) noexcept {
  const std::int64_t qstep = G * 2 * kLanes;
  std::int64_t j = 0;
  for (; j + 8 <= G; j += 8) tile_sums<8, kP>(qb + j * 2 * kLanes, qstep, mx, mn, d, out + j, ostride);
  if (j + 4 <= G) {
    tile_sums<4, kP>(qb + j * 2 * kLanes, qstep, mx, mn, d, out + j, ostride);
    j += 4;
  }
  if (j + 2 <= G) {
    tile_sums<2, kP>(qb + j * 2 * kLanes, qstep, mx, mn, d, out + j, ostride);
    j += 2;
  }
  if (j < G) tile_sums<1, kP>(qb + j * 2 * kLanes, qstep, mx, mn, d, out + j, ostride);
}

/// The exact form of one (query row, page): sum over channels of max(q*M, q*m) with the reference's NaN rule.
template <class Tm>
inline float exact_sum(const float* qz, const Tm* mx, const Tm* mn, std::int64_t d) noexcept {
  F acc(0.0f);
  for (std::int64_t c = 0; c < d; c += kLanes) {
    const F a = F::load_unaligned(qz + c);
    const F M = c + kLanes <= d ? load_lanes(mx + c) : load_partial(mx + c, d - c);
    const F m = c + kLanes <= d ? load_lanes(mn + c) : load_partial(mn + c, d - c);
    acc = max_ab(xsimd::fma(a, M, acc), xsimd::fma(a, m, acc));
  }
  return xsimd::hadd(acc);
}

template <class Tm>
void bounds(const float* q, std::int64_t G, std::int64_t d, PageMetaView<const Tm> meta, const std::int32_t* pages, std::int64_t n,
            float* out, std::int64_t ld, float* scratch) noexcept {
  const std::int64_t H = meta.num_kv_heads, R = H * G, dpad = bounds_dpad(d), rpad = bounds_rows_pad(R);
  const std::int64_t row_bytes = d * static_cast<std::int64_t>(sizeof(Tm));
  const std::int64_t nvec = dpad / kLanes;
  float* qz = scratch;                                                       // (R, dpad): q, zero padded
  float* qi = qz + R * dpad;                                                 // (H, nvec, G, 2, kLanes): q+ and q- per channel vector
  F* accv = reinterpret_cast<F*>(qi + 2 * R * dpad);                         // (kBoundsPages, rpad) vectors: lane sums of the pages' rows
  float* stage = qi + 2 * R * dpad + kBoundsPages * rpad * kBoundsDimAlign;  // (kLanes, rpad): the chunk's page sums, page major
  for (std::int64_t r = 0; r < R; ++r) {
    const std::int64_t g = r / G, j = r % G;
    for (std::int64_t c = 0; c < dpad; ++c) {
      const float x = c < d ? q[r * d + c] : 0.0f;
      qz[r * dpad + c] = x;
      float* v = qi + (((g * nvec + c / kLanes) * G + j) * 2) * kLanes + c % kLanes;
      v[0] = x > 0.0f ? x : 0.0f;
      v[kLanes] = x < 0.0f ? x : 0.0f;
    }
  }
  for (std::int64_t k = 0; k < kBoundsPages; ++k)
    for (std::int64_t r = R; r < rpad; ++r) accv[k * rpad + r] = F(0.0f);
  auto page_at = [&](std::int64_t i) { return pages ? static_cast<std::int64_t>(pages[i]) : i; };
  auto prefetch_head = [&](std::int64_t i, std::int64_t g) {
    if (i >= n) return;
    const std::int64_t off = page_at(i) * meta.page_stride + g * meta.head_stride;
    prefetch_lines<true>(meta.max_data + off, row_bytes);
    prefetch_lines<true>(meta.min_data + off, row_bytes);
  };
  for (std::int64_t i = 0; i < kBoundsAhead; ++i)
    for (std::int64_t g = 0; g < H; ++g) prefetch_head(i, g);
  // Sums of page i0 + p (p < kP) from accv into stage, with the exact form where the fast one met 0 * inf.
  auto finish = [&](std::int64_t i0, std::int64_t p, std::int64_t kP) {
    for (std::int64_t k = 0; k < kP; ++k) {
      float* st = stage + (p + k) * rpad;
      bool nan = false;
      for (std::int64_t r = 0; r < rpad; r += kLanes) {
        const F s = hsum_lanes(accv + k * rpad + r);
        nan |= !xsimd::all(s == s);
        s.store_unaligned(st + r);
      }
      if (nan)
        for (std::int64_t r = 0; r < R; ++r)
          if (st[r] != st[r]) {
            const std::int64_t off = page_at(i0 + p + k) * meta.page_stride + (r / G) * meta.head_stride;
            st[r] = exact_sum(qz + r * dpad, meta.max_data + off, meta.min_data + off, d);
          }
    }
  };
  for (std::int64_t i0 = 0; i0 < n; i0 += kLanes) {
    const std::int64_t cnt = imin(kLanes, n - i0);
    std::int64_t p = 0;
    // kP pages at a time: each q vector is loaded once for all of them.
    auto pages_step = [&]<int kP>(std::integral_constant<int, kP>) {
      std::int64_t base[kP];
      for (int k = 0; k < kP; ++k) base[k] = page_at(i0 + p + k) * meta.page_stride;
      for (std::int64_t g = 0; g < H; ++g) {
        const Tm* mx[kP];
        const Tm* mn[kP];
        for (int k = 0; k < kP; ++k) {
          prefetch_head(i0 + p + k + kBoundsAhead, g);
          mx[k] = meta.max_data + base[k] + g * meta.head_stride;
          mn[k] = meta.min_data + base[k] + g * meta.head_stride;
        }
        group_sums<kP>(qi + g * nvec * G * 2 * kLanes, G, mx, mn, d, accv + g * G, rpad);
      }
      finish(i0, p, kP);
      p += kP;
    };
    while (p + kBoundsPages <= cnt) pages_step(std::integral_constant<int, kBoundsPages>{});
    if (kBoundsPages > 2 && p + 2 <= cnt) pages_step(std::integral_constant<int, 2>{});
    if (p < cnt) pages_step(std::integral_constant<int, 1>{});
    for (std::int64_t r = 0; r < R; ++r) {
      float* o = out + r * ld + i0;
      for (std::int64_t k = 0; k < cnt; ++k) o[k] = stage[k * rpad + r];
    }
  }
}

// ---- paged decode attention -------------------------------------------------------

/// lg[t] = scale * q.rows[t] for t < bn: kLanes rows at a time, one
/// accumulator each (independent chains), reduced together by `hsum_lanes`
/// into one vector of kLanes logits. Rows past bn read `zero` (d floats).
inline void logits_row(const float* q, std::int64_t d, const float* const* rows, std::int64_t bn, float scale, const float* zero,
                       float* lg) noexcept {
  for (std::int64_t t0 = 0; t0 < bn; t0 += kLanes) {
    const float* r[kLanes];
    for (std::int64_t i = 0; i < kLanes; ++i) r[i] = t0 + i < bn ? rows[t0 + i] : zero;
    F acc[kLanes];
    for (std::int64_t i = 0; i < kLanes; ++i) acc[i] = F(0.0f);
    std::int64_t c = 0;
    for (; c + kLanes <= d; c += kLanes) {
      const F qv = F::load_unaligned(q + c);
      for (std::int64_t i = 0; i < kLanes; ++i) acc[i] = xsimd::fma(qv, F::load_unaligned(r[i] + c), acc[i]);
    }
    if (c < d) {
      const F qv = load_partial(q + c, d - c);
      for (std::int64_t i = 0; i < kLanes; ++i) acc[i] = xsimd::fma(qv, load_partial(r[i] + c, d - c), acc[i]);
    }
    const F v = hsum_lanes(acc) * F(scale);
    if (t0 + kLanes <= bn)
      v.store_unaligned(lg + t0);
    else
      store_partial(lg + t0, v, bn - t0);
  }
}

/// o[0..d) += sum_t p[t] * rows[t], four output vectors in registers at a time.
inline void accumulate_values(float* o, std::int64_t d, const float* p, const float* const* rows, std::int64_t bn) noexcept {
  std::int64_t c = 0;
  for (; c + 4 * kLanes <= d; c += 4 * kLanes) {
    F o0 = F::load_unaligned(o + c), o1 = F::load_unaligned(o + c + kLanes);
    F o2 = F::load_unaligned(o + c + 2 * kLanes), o3 = F::load_unaligned(o + c + 3 * kLanes);
    for (std::int64_t t = 0; t < bn; ++t) {
      const F pv(p[t]);
      const float* r = rows[t] + c;
      o0 = xsimd::fma(pv, F::load_unaligned(r), o0);
      o1 = xsimd::fma(pv, F::load_unaligned(r + kLanes), o1);
      o2 = xsimd::fma(pv, F::load_unaligned(r + 2 * kLanes), o2);
      o3 = xsimd::fma(pv, F::load_unaligned(r + 3 * kLanes), o3);
    }
    o0.store_unaligned(o + c);
    o1.store_unaligned(o + c + kLanes);
    o2.store_unaligned(o + c + 2 * kLanes);
    o3.store_unaligned(o + c + 3 * kLanes);
  }
  for (; c < d; c += kLanes) {
    const std::int64_t w = imin(kLanes, d - c);
    F acc = w == kLanes ? F::load_unaligned(o + c) : load_partial(o + c, w);
    for (std::int64_t t = 0; t < bn; ++t)
      acc = xsimd::fma(F(p[t]), w == kLanes ? F::load_unaligned(rows[t] + c) : load_partial(rows[t] + c, w), acc);
    if (w == kLanes)
      acc.store_unaligned(o + c);
    else
      store_partial(o + c, acc, w);
  }
}

/// e^x for softmax arguments x <= 0 (or NaN): x = n ln2 + r with |r| <=
/// ln2 / 2 (ln2 split in a short high part and a correction, so n ln2 is
/// exact), e^r by its Taylor polynomial to degree 7 (error < 2^-24 relative),
/// times 2^n built in the exponent field. x < -87 gives 0, NaN stays NaN.
inline F exp_nonpositive(F x) noexcept {
  const F lo(-87.0f);
  const F xc = xsimd::max(x, lo);
  const F n = xsimd::nearbyint(xc * F(1.44269504088896341f));
  F r = xsimd::fnma(n, F(0.693145751953125f), xc);
  r = xsimd::fnma(n, F(1.428606765330187e-06f), r);
  F p(1.0f / 5040.0f);
  p = xsimd::fma(p, r, F(1.0f / 720.0f));
  p = xsimd::fma(p, r, F(1.0f / 120.0f));
  p = xsimd::fma(p, r, F(1.0f / 24.0f));
  p = xsimd::fma(p, r, F(1.0f / 6.0f));
  p = xsimd::fma(p, r, F(0.5f));
  p = xsimd::fma(p, r, F(1.0f));
  p = xsimd::fma(p, r, F(1.0f));
  const I e = (xsimd::to_int(n) + I(127)) << 23;
  const F y = p * xsimd::bitwise_cast<F>(e);
  return xsimd::select(xsimd::isnan(x), x, xsimd::select(x < lo, F(0.0f), y));
}

/// p[t] = exp(lg[t] - mx) in place for t < bn; returns sum_t p[t].
inline float exp_shift_sum(float* lg, std::int64_t bn, float mx) noexcept {
  F sum(0.0f);
  const F m(mx);
  std::int64_t t = 0;
  for (; t + kLanes <= bn; t += kLanes) {
    const F p = exp_nonpositive(F::load_unaligned(lg + t) - m);
    p.store_unaligned(lg + t);
    sum += p;
  }
  if (t < bn) {
    // Padding lanes hold -inf, whose exp is 0.
    float tmp[kLanes];
    for (std::int64_t i = 0; i < kLanes; ++i) tmp[i] = t + i < bn ? lg[t + i] : -kInf;
    const F p = exp_nonpositive(F::load_unaligned(tmp) - m);
    p.store_unaligned(tmp);
    for (std::int64_t i = 0; t + i < bn; ++i) lg[t + i] = tmp[i];
    sum += p;
  }
  return xsimd::hadd(sum);
}

inline float scalar_exp(float x) noexcept {
  float tmp[kLanes];
  exp_nonpositive(F(x)).store_unaligned(tmp);
  return tmp[0];
}

template <class T>
inline const T* row_of(const Rows<T>& k, std::int64_t j) noexcept {
  if (k.pages == nullptr) return k.base + j * k.row_stride;
  return k.base + static_cast<std::int64_t>(k.pages[j / k.page_size]) * k.page_stride + (j % k.page_size) * k.row_stride;
}

/// d values of T widened into dst (fp32).
template <class T>
inline void widen_row(const T* src, std::int64_t d, float* dst) noexcept {
  std::int64_t c = 0;
  for (; c + kLanes <= d; c += kLanes) load_lanes(src + c).store_unaligned(dst + c);
  if (c < d) store_partial(dst + c, load_partial(src + c, d - c), d - c);
}

template <class T>
void attention(const float* q, std::int64_t G, std::int64_t d, Rows<T> keys, Rows<T> values, std::int64_t n, float scale, float* out,
               float* lse, const AttnScratch& s) noexcept {
  const std::int64_t block = keys.pages != nullptr ? keys.page_size : 64;
  for (std::int64_t i = 0; i < G * d; ++i) out[i] = 0.0f;
  for (std::int64_t g = 0; g < G; ++g) {
    s.run_max[g] = -kInf;
    s.run_sum[g] = 0.0f;
  }
  for (std::int64_t c = 0; c < d; ++c) s.zero_row[c] = 0.0f;
  const std::int64_t row_bytes = d * static_cast<std::int64_t>(sizeof(T));
  auto prefetch_block = [&](std::int64_t j0) {  // the next page's rows: page ids are scattered
    for (std::int64_t t = j0; t < imin(j0 + block, n); ++t) {
      prefetch_lines(row_of(keys, t), row_bytes);
      prefetch_lines(row_of(values, t), row_bytes);
    }
  };
  prefetch_block(block);
  for (std::int64_t j0 = 0; j0 < n; j0 += block) {
    const std::int64_t bn = imin(block, n - j0);
    prefetch_block(j0 + 2 * block);  // two pages ahead: the current one is already on its way
    for (std::int64_t t = 0; t < bn; ++t) {
      const T* kr = row_of(keys, j0 + t);
      const T* vr = row_of(values, j0 + t);
      if constexpr (std::is_same_v<T, float>) {
        s.krows[t] = kr;
        s.vrows[t] = vr;
      } else {
        widen_row(kr, d, s.kbuf + t * d);
        widen_row(vr, d, s.vbuf + t * d);
        s.krows[t] = s.kbuf + t * d;
        s.vrows[t] = s.vbuf + t * d;
      }
    }
    for (std::int64_t g = 0; g < G; ++g) {
      if (s.run_sum[g] != s.run_sum[g]) continue;  // already NaN (see below)
      float* lg = s.logits + g * block;
      logits_row(q + g * d, d, s.krows, bn, scale, s.zero_row, lg);
      float bmax = -kInf;
      bool nan = false;
      for (std::int64_t t = 0; t < bn; ++t) {
        nan = nan || lg[t] != lg[t];
        bmax = lg[t] > bmax ? lg[t] : bmax;
      }
      if (nan) {  // the max skips NaN: a NaN sum carries it to out and lse, as in the reference
        s.run_sum[g] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const float new_max = bmax > s.run_max[g] ? bmax : s.run_max[g];
      if (new_max == -kInf) continue;  // every logit so far is -inf
      float* o = out + g * d;
      if (new_max != s.run_max[g]) {
        const float alpha = scalar_exp(s.run_max[g] - new_max);
        s.run_sum[g] *= alpha;
        const F av(alpha);
        std::int64_t c = 0;
        for (; c + kLanes <= d; c += kLanes) (F::load_unaligned(o + c) * av).store_unaligned(o + c);
        for (; c < d; ++c) o[c] *= alpha;
        s.run_max[g] = new_max;
      }
      s.run_sum[g] += exp_shift_sum(lg, bn, new_max);
      accumulate_values(o, d, lg, s.vrows, bn);
    }
  }
  for (std::int64_t g = 0; g < G; ++g) {
    const bool none = s.run_sum[g] == 0.0f;
    const float inv = none ? 0.0f : 1.0f / s.run_sum[g];
    float* o = out + g * d;
    for (std::int64_t c = 0; c < d; ++c) o[c] *= inv;
    if (lse != nullptr) lse[g] = none ? -kInf : s.run_max[g] + logf(s.run_sum[g]);
  }
}

}  // namespace cpu_detail::KVP_CPU_ISA_NS::paged
KVP_NAMESPACE_END
