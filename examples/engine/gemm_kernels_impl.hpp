// SPDX-License-Identifier: Apache-2.0
// The engine's gemm kernels, written once and compiled per instruction-set
// level (internal; included only by gemm_sse2.cpp, gemm_avx2.cpp and
// gemm_avx512.cpp). examples/engine/CMakeLists.txt gives those units their
// level's flags and KVP_CPU_TU_ISA (0 = sse2, 1 = avx2, 2 = avx512), as
// backends/cpu/CMakeLists.txt does for the backend's units. What the kernels
// compute and their numerics: gemm.hpp.
//
// The backend's rule for per-ISA units applies (backends/cpu/src/isa_dispatch.hpp):
// everything here lives in `kvp_engine::gemm_detail::<level>` and calls only
// functions of that namespace, intrinsics and libc. No std:: algorithm
// (std::min, ...) and no inline function shared with other units is
// instantiated here: the linker could keep this unit's wider-instruction copy
// for every caller.
#pragma once

#ifndef KVP_CPU_TU_ISA
#error "gemm_kernels_impl.hpp is for the per-ISA units gemm_sse2.cpp, gemm_avx2.cpp, gemm_avx512.cpp"
#endif

// GCC 12's AVX-512 intrinsics initialise their "undefined" operands from
// themselves, which -Wuninitialized reports at every inlined use (GCC bug
// 105593, fixed in GCC 13); the same source is warning-clean for avx2 and sse2.
#if KVP_CPU_TU_ISA == 2 && defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <immintrin.h>

#include <cstdint>

#include "gemm_kernels.hpp"

#if KVP_CPU_TU_ISA == 2
#if !defined(__AVX512F__) || !defined(__AVX512DQ__) || !defined(__AVX512VL__) || !defined(__FMA__)
#error "gemm_avx512.cpp was compiled without the AVX-512 F/DQ/VL + FMA flags"
#endif
#define KVP_GEMM_ISA_NS avx512
#elif KVP_CPU_TU_ISA == 1
#if !defined(__AVX2__) || !defined(__FMA__)
#error "gemm_avx2.cpp was compiled without the AVX2 + FMA flags"
#endif
#define KVP_GEMM_ISA_NS avx2
#elif KVP_CPU_TU_ISA == 0
#define KVP_GEMM_ISA_NS sse2
#else
#error "KVP_CPU_TU_ISA must be 0 (sse2), 1 (avx2) or 2 (avx512)"
#endif

// Register tiles are arrays indexed by loop counters of compile-time bounds;
// fully unrolled, the arrays live in registers.
#if defined(__GNUC__) || defined(__clang__)
#define KVP_GEMM_UNROLL _Pragma("GCC unroll 8")
#else
#define KVP_GEMM_UNROLL
#endif

namespace kvp_engine::gemm_detail::KVP_GEMM_ISA_NS {

using i64 = std::int64_t;

inline i64 min_i64(i64 a, i64 b) noexcept { return a < b ? a : b; }

// ---- vectors of the level -------------------------------------------------------
//
// V: kW floats. load_part / store_part touch lanes [0, r) only, r in [0, kW]:
// masked instructions where the level has them, partial moves for SSE2; lanes
// not read are zero. reduce4(a, b, c, d) = {sum(a), sum(b), sum(c), sum(d)}.
// I: kW int32 lanes, for building powers of two in exp_nonpos.

#if KVP_CPU_TU_ISA == 2

using V = __m512;
inline constexpr int kW = 16;
inline V zero() noexcept { return _mm512_setzero_ps(); }
inline V load(const float* p) noexcept { return _mm512_loadu_ps(p); }
inline void store(float* p, V v) noexcept { _mm512_storeu_ps(p, v); }
inline __mmask16 lanes(int r) noexcept { return static_cast<__mmask16>((1u << r) - 1u); }
inline V load_part(const float* p, int r) noexcept { return _mm512_maskz_loadu_ps(lanes(r), p); }
inline void store_part(float* p, V v, int r) noexcept { _mm512_mask_storeu_ps(p, lanes(r), v); }
inline V bcast(const float* p) noexcept { return _mm512_set1_ps(*p); }
inline V add(V a, V b) noexcept { return _mm512_add_ps(a, b); }
inline V fmadd(V a, V b, V c) noexcept { return _mm512_fmadd_ps(a, b, c); }
inline __m256 fold(V a) noexcept { return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)); }
inline __m128 reduce4_256(__m256 a, __m256 b, __m256 c, __m256 d) noexcept {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // {a, b, c, d} partial sums per 128-bit half
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
inline __m128 reduce4(V a, V b, V c, V d) noexcept { return reduce4_256(fold(a), fold(b), fold(c), fold(d)); }
inline V set1(float x) noexcept { return _mm512_set1_ps(x); }
inline V mul(V a, V b) noexcept { return _mm512_mul_ps(a, b); }
inline V sub(V a, V b) noexcept { return _mm512_sub_ps(a, b); }
inline V vmax(V a, V b) noexcept { return _mm512_max_ps(a, b); }
using I = __m512i;
inline I to_int(V x) noexcept { return _mm512_cvtps_epi32(x); }  // rounds to nearest (the default MXCSR)
inline V to_float(I n) noexcept { return _mm512_cvtepi32_ps(n); }
inline I half_down(I n) noexcept { return _mm512_srai_epi32(n, 1); }
inline I isub(I a, I b) noexcept { return _mm512_sub_epi32(a, b); }
inline V pow2(I n) noexcept { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23)); }

#elif KVP_CPU_TU_ISA == 1

using V = __m256;
inline constexpr int kW = 8;
// lanes(r): the 8 ints from kMaskTable + 8 - r, all-ones in lanes [0, r).
alignas(64) inline constexpr std::int32_t kMaskTable[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
inline __m256i lanes(int r) noexcept { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kMaskTable + 8 - r)); }
inline V zero() noexcept { return _mm256_setzero_ps(); }
inline V load(const float* p) noexcept { return _mm256_loadu_ps(p); }
inline void store(float* p, V v) noexcept { _mm256_storeu_ps(p, v); }
inline V load_part(const float* p, int r) noexcept { return _mm256_maskload_ps(p, lanes(r)); }
inline void store_part(float* p, V v, int r) noexcept { _mm256_maskstore_ps(p, lanes(r), v); }
inline V bcast(const float* p) noexcept { return _mm256_broadcast_ss(p); }
inline V add(V a, V b) noexcept { return _mm256_add_ps(a, b); }
inline V fmadd(V a, V b, V c) noexcept { return _mm256_fmadd_ps(a, b, c); }
inline __m128 reduce4(V a, V b, V c, V d) noexcept {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // {a, b, c, d} partial sums per 128-bit half
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
inline V set1(float x) noexcept { return _mm256_set1_ps(x); }
inline V mul(V a, V b) noexcept { return _mm256_mul_ps(a, b); }
inline V sub(V a, V b) noexcept { return _mm256_sub_ps(a, b); }
inline V vmax(V a, V b) noexcept { return _mm256_max_ps(a, b); }
using I = __m256i;
inline I to_int(V x) noexcept { return _mm256_cvtps_epi32(x); }
inline V to_float(I n) noexcept { return _mm256_cvtepi32_ps(n); }
inline I half_down(I n) noexcept { return _mm256_srai_epi32(n, 1); }
inline I isub(I a, I b) noexcept { return _mm256_sub_epi32(a, b); }
inline V pow2(I n) noexcept { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23)); }

#else

using V = __m128;
inline constexpr int kW = 4;
inline V zero() noexcept { return _mm_setzero_ps(); }
inline V load(const float* p) noexcept { return _mm_loadu_ps(p); }
inline void store(float* p, V v) noexcept { _mm_storeu_ps(p, v); }
inline V load_part(const float* p, int r) noexcept {
  switch (r) {
    case 0: return _mm_setzero_ps();
    case 1: return _mm_load_ss(p);
    case 2: return _mm_loadl_pi(_mm_setzero_ps(), reinterpret_cast<const __m64*>(p));
    case 3: return _mm_movelh_ps(_mm_loadl_pi(_mm_setzero_ps(), reinterpret_cast<const __m64*>(p)), _mm_load_ss(p + 2));
    default: return _mm_loadu_ps(p);
  }
}
inline void store_part(float* p, V v, int r) noexcept {
  switch (r) {
    case 0: return;
    case 1: _mm_store_ss(p, v); return;
    case 2: _mm_storel_pi(reinterpret_cast<__m64*>(p), v); return;
    case 3:
      _mm_storel_pi(reinterpret_cast<__m64*>(p), v);
      _mm_store_ss(p + 2, _mm_movehl_ps(v, v));
      return;
    default: _mm_storeu_ps(p, v); return;
  }
}
inline V bcast(const float* p) noexcept { return _mm_set1_ps(*p); }
inline V add(V a, V b) noexcept { return _mm_add_ps(a, b); }
inline V fmadd(V a, V b, V c) noexcept { return _mm_add_ps(_mm_mul_ps(a, b), c); }  // no FMA at this level
inline __m128 reduce4(V a, V b, V c, V d) noexcept {
  // 4 x 4 transpose folded into the adds.
  const __m128 ab = _mm_add_ps(_mm_unpacklo_ps(a, b), _mm_unpackhi_ps(a, b));  // a0+a2 b0+b2 a1+a3 b1+b3
  const __m128 cd = _mm_add_ps(_mm_unpacklo_ps(c, d), _mm_unpackhi_ps(c, d));  // c0+c2 d0+d2 c1+c3 d1+d3
  return _mm_add_ps(_mm_movelh_ps(ab, cd), _mm_movehl_ps(cd, ab));
}
inline V set1(float x) noexcept { return _mm_set1_ps(x); }
inline V mul(V a, V b) noexcept { return _mm_mul_ps(a, b); }
inline V sub(V a, V b) noexcept { return _mm_sub_ps(a, b); }
inline V vmax(V a, V b) noexcept { return _mm_max_ps(a, b); }
using I = __m128i;
inline I to_int(V x) noexcept { return _mm_cvtps_epi32(x); }
inline V to_float(I n) noexcept { return _mm_cvtepi32_ps(n); }
inline I half_down(I n) noexcept { return _mm_srai_epi32(n, 1); }
inline I isub(I a, I b) noexcept { return _mm_sub_epi32(a, b); }
inline V pow2(I n) noexcept { return _mm_castsi128_ps(_mm_slli_epi32(_mm_add_epi32(n, _mm_set1_epi32(127)), 23)); }

#endif

/// Sum and maximum of the lanes of v.
inline float hsum(V v) noexcept { return _mm_cvtss_f32(reduce4(v, v, v, v)); }
inline float hmax(V v) noexcept {
  alignas(64) float t[kW];
  store(t, v);
  float m = t[0];
  for (int j = 1; j < kW; ++j) m = t[j] > m ? t[j] : m;
  return m;
}

// ---- tile sizes -----------------------------------------------------------------
//
// gemm_nt: kNtRows rows of a x 4 rows of b; live registers are 4 * kNtRows
// accumulators + 4 vectors of b + 1 of a (AVX-512: 24 + 5 of 32; AVX2: 12 + 5
// of 16, so the compiler reads one vector of b as a memory operand of its
// FMAs; SSE2, without FMA, needs a product register: 8 + 4 + 2 of 16).
// gemm_nn: kNnRows rows of a x kNnVecs vectors of b's columns; kNnRows *
// kNnVecs accumulators + kNnVecs of b + 1 broadcast (AVX-512: 24 + 5 of 32;
// AVX2: 12 + 3 of 16; SSE2: 8 + 2 + 1 + product of 16).
#if KVP_CPU_TU_ISA == 2
inline constexpr int kNtRows = 6, kNnRows = 6, kNnVecs = 4;
#elif KVP_CPU_TU_ISA == 1
inline constexpr int kNtRows = 3, kNnRows = 6, kNnVecs = 2;
#else
inline constexpr int kNtRows = 2, kNnRows = 4, kNnVecs = 2;
#endif
inline constexpr int kNtCols = 4;  // rows of b per gemm_nt tile: one reduce4 per row of a

// Bytes of b that gemm_nt keeps hot while the rows of a stream past: well
// inside a 512 KiB - 2 MiB L2, leaving room for the a tile and the c rows.
inline constexpr i64 kNtBlockBytes = 256 * 1024;
// Most floats of k per pass. A pass keeps the a tile and 4 rows of b in L1
// ((6 + 4) * 768 * 4 = 30 KiB on AVX-512) and adds its sums into c; k = 1536
// (the down projection) runs as two passes of 768, ~10% faster than one pass
// whose rows spill to L2 on every tile. The engine's k = 576 and 64 take one.
inline constexpr i64 kNtDepth = 768;

// ---- gemm_nt --------------------------------------------------------------------

/// c[i, 0..nb) (+)= the 4 sums `s` of row i of a tile (nb <= 4 of them are real).
inline void put4(float* c, __m128 s, int nb, bool accumulate) noexcept {
  if (nb == kNtCols) {
    if (accumulate) s = _mm_add_ps(s, _mm_loadu_ps(c));
    _mm_storeu_ps(c, s);
    return;
  }
  alignas(16) float t[4];
  _mm_store_ps(t, s);
  for (int j = 0; j < nb; ++j) c[j] = accumulate ? c[j] + t[j] : t[j];
}

/// One tile: c(R, nb) (+)= a(R, k) * [b0; b1; b2; b3]^T. Rows bj past nb point
/// at a real row (the caller repeats the last one); their sums are dropped.
template <int R>
inline void nt_tile(const float* a, i64 lda, const float* const* b, float* c, i64 ldc, i64 k, int nb, bool accumulate) noexcept {
  V acc[R][kNtCols];
  KVP_GEMM_UNROLL
  for (int i = 0; i < R; ++i) {
    KVP_GEMM_UNROLL
    for (int j = 0; j < kNtCols; ++j) acc[i][j] = zero();
  }
  const float *b0 = b[0], *b1 = b[1], *b2 = b[2], *b3 = b[3];
  i64 p = 0;
  if constexpr (R == 1) {
    // A GEMV tile has only 4 accumulator chains; a second set halves their
    // length, so more loads of b are in flight (SSE2 decode +5%, the
    // L3-resident GEMV +50%; the AVX-512 decode is at DRAM bandwidth either way).
    V e0 = zero(), e1 = zero(), e2 = zero(), e3 = zero();
    for (; p + 2 * kW <= k; p += 2 * kW) {
      const V x = load(a + p), y = load(a + p + kW);
      acc[0][0] = fmadd(x, load(b0 + p), acc[0][0]);
      acc[0][1] = fmadd(x, load(b1 + p), acc[0][1]);
      acc[0][2] = fmadd(x, load(b2 + p), acc[0][2]);
      acc[0][3] = fmadd(x, load(b3 + p), acc[0][3]);
      e0 = fmadd(y, load(b0 + p + kW), e0);
      e1 = fmadd(y, load(b1 + p + kW), e1);
      e2 = fmadd(y, load(b2 + p + kW), e2);
      e3 = fmadd(y, load(b3 + p + kW), e3);
    }
    acc[0][0] = add(acc[0][0], e0);
    acc[0][1] = add(acc[0][1], e1);
    acc[0][2] = add(acc[0][2], e2);
    acc[0][3] = add(acc[0][3], e3);
  }
  for (; p + kW <= k; p += kW) {
    const V v0 = load(b0 + p), v1 = load(b1 + p), v2 = load(b2 + p), v3 = load(b3 + p);
    KVP_GEMM_UNROLL
    for (int i = 0; i < R; ++i) {
      const V x = load(a + i * lda + p);
      acc[i][0] = fmadd(x, v0, acc[i][0]);
      acc[i][1] = fmadd(x, v1, acc[i][1]);
      acc[i][2] = fmadd(x, v2, acc[i][2]);
      acc[i][3] = fmadd(x, v3, acc[i][3]);
    }
  }
  if (p < k) {  // k tail: lanes past k load as zero in both operands
    const int r = static_cast<int>(k - p);
    const V v0 = load_part(b0 + p, r), v1 = load_part(b1 + p, r), v2 = load_part(b2 + p, r), v3 = load_part(b3 + p, r);
    KVP_GEMM_UNROLL
    for (int i = 0; i < R; ++i) {
      const V x = load_part(a + i * lda + p, r);
      acc[i][0] = fmadd(x, v0, acc[i][0]);
      acc[i][1] = fmadd(x, v1, acc[i][1]);
      acc[i][2] = fmadd(x, v2, acc[i][2]);
      acc[i][3] = fmadd(x, v3, acc[i][3]);
    }
  }
  KVP_GEMM_UNROLL
  for (int i = 0; i < R; ++i) put4(c + i * ldc, reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]), nb, accumulate);
}

/// R rows of a against the n rows of b (one cache block), 4 rows of b at a time.
template <int R>
inline void nt_rows(const float* a, i64 lda, const float* b, i64 ldb, float* c, i64 ldc, i64 n, i64 k, bool accumulate) noexcept {
  for (i64 j = 0; j < n; j += kNtCols) {
    const int nb = static_cast<int>(min_i64(kNtCols, n - j));
    const float* rows[kNtCols];
    for (int q = 0; q < kNtCols; ++q) rows[q] = b + (j + (q < nb ? q : nb - 1)) * ldb;
    nt_tile<R>(a, lda, rows, c + j, ldc, k, nb, accumulate);
  }
}

/// The last m % kNtRows rows (R counts down to the one that matches).
template <int R>
inline void nt_rows_rest(int rest, const float* a, i64 lda, const float* b, i64 ldb, float* c, i64 ldc, i64 n, i64 k,
                         bool accumulate) noexcept {
  if constexpr (R > 0) {
    if (rest == R) {
      nt_rows<R>(a, lda, b, ldb, c, ldc, n, k, accumulate);
    } else {
      nt_rows_rest<R - 1>(rest, a, lda, b, ldb, c, ldc, n, k, accumulate);
    }
  }
}

inline void gemm_nt(const float* a, i64 lda, const float* b, i64 ldb, float* c, i64 ldc, i64 m, i64 n, i64 k, bool accumulate) noexcept {
  // k in passes of equal depth (whole vectors), each at most kNtDepth: a pass adds its sums into c.
  const i64 passes = (k + kNtDepth - 1) / kNtDepth;
  i64 depth = (k + passes - 1) / passes;
  depth = (depth + kW - 1) / kW * kW;
  // Rows of b per cache block: a whole number of tiles, at least one.
  i64 block = kNtBlockBytes / (depth * static_cast<i64>(sizeof(float))) / kNtCols * kNtCols;
  if (block < kNtCols) block = kNtCols;
  for (i64 j0 = 0; j0 < n; j0 += block) {
    const i64 nj = min_i64(block, n - j0);
    for (i64 p0 = 0; p0 < k; p0 += depth) {
      const i64 kd = min_i64(depth, k - p0);
      const bool acc = accumulate || p0 > 0;
      const float* bj = b + j0 * ldb + p0;
      i64 i = 0;
      for (; i + kNtRows <= m; i += kNtRows) nt_rows<kNtRows>(a + i * lda + p0, lda, bj, ldb, c + i * ldc + j0, ldc, nj, kd, acc);
      if (i < m) nt_rows_rest<kNtRows - 1>(static_cast<int>(m - i), a + i * lda + p0, lda, bj, ldb, c + i * ldc + j0, ldc, nj, kd, acc);
    }
  }
}

// ---- gemm_nn --------------------------------------------------------------------

/// One tile: c(R, cols) (+)= a(R, k) * b(k, cols) with cols = NV vectors, or
/// (kPart) fewer columns: `cols` of them, the lanes past it masked off.
template <int R, int NV, bool kPart>
inline void nn_tile(const float* a, i64 lda, const float* b, i64 ldb, float* c, i64 ldc, i64 k, int cols, bool accumulate) noexcept {
  V acc[R][NV];
  KVP_GEMM_UNROLL
  for (int i = 0; i < R; ++i) {
    KVP_GEMM_UNROLL
    for (int v = 0; v < NV; ++v) acc[i][v] = zero();
  }
  int width[NV];  // lanes of each vector inside the tile (kPart only)
  KVP_GEMM_UNROLL
  for (int v = 0; v < NV; ++v) {
    const int w = cols - v * kW;
    width[v] = w < 0 ? 0 : (w > kW ? kW : w);
  }
  for (i64 p = 0; p < k; ++p) {
    const float* bp = b + p * ldb;
    V x[NV];
    KVP_GEMM_UNROLL
    for (int v = 0; v < NV; ++v) x[v] = kPart ? load_part(bp + v * kW, width[v]) : load(bp + v * kW);
    KVP_GEMM_UNROLL
    for (int i = 0; i < R; ++i) {
      const V s = bcast(a + i * lda + p);
      KVP_GEMM_UNROLL
      for (int v = 0; v < NV; ++v) acc[i][v] = fmadd(s, x[v], acc[i][v]);
    }
  }
  KVP_GEMM_UNROLL
  for (int i = 0; i < R; ++i) {
    float* ci = c + i * ldc;
    KVP_GEMM_UNROLL
    for (int v = 0; v < NV; ++v) {
      if (kPart) {
        const V y = accumulate ? add(acc[i][v], load_part(ci + v * kW, width[v])) : acc[i][v];
        store_part(ci + v * kW, y, width[v]);
      } else {
        store(ci + v * kW, accumulate ? add(acc[i][v], load(ci + v * kW)) : acc[i][v]);
      }
    }
  }
}

/// R rows of a against every column of b: whole tiles of kNnVecs vectors,
/// then single vectors, then the masked remainder.
template <int R>
inline void nn_rows(const float* a, i64 lda, const float* b, i64 ldb, float* c, i64 ldc, i64 n, i64 k, bool accumulate) noexcept {
  i64 j = 0;
  for (; j + kNnVecs * kW <= n; j += kNnVecs * kW) nn_tile<R, kNnVecs, false>(a, lda, b + j, ldb, c + j, ldc, k, 0, accumulate);
  for (; j + kW <= n; j += kW) nn_tile<R, 1, false>(a, lda, b + j, ldb, c + j, ldc, k, 0, accumulate);
  if (j < n) nn_tile<R, 1, true>(a, lda, b + j, ldb, c + j, ldc, k, static_cast<int>(n - j), accumulate);
}

template <int R>
inline void nn_rows_rest(int rest, const float* a, i64 lda, const float* b, i64 ldb, float* c, i64 ldc, i64 n, i64 k,
                         bool accumulate) noexcept {
  if constexpr (R > 0) {
    if (rest == R) {
      nn_rows<R>(a, lda, b, ldb, c, ldc, n, k, accumulate);
    } else {
      nn_rows_rest<R - 1>(rest, a, lda, b, ldb, c, ldc, n, k, accumulate);
    }
  }
}

inline void gemm_nn(const float* a, i64 lda, const float* b, i64 ldb, float* c, i64 ldc, i64 m, i64 n, i64 k, bool accumulate) noexcept {
  i64 i = 0;
  for (; i + kNnRows <= m; i += kNnRows) nn_rows<kNnRows>(a + i * lda, lda, b, ldb, c + i * ldc, ldc, n, k, accumulate);
  if (i < m) nn_rows_rest<kNnRows - 1>(static_cast<int>(m - i), a + i * lda, lda, b, ldb, c + i * ldc, ldc, n, k, accumulate);
}

// ---- prefill's attention softmax ------------------------------------------------

/// exp(x) for x <= 0 (softmax arguments), NaN propagated; x below -104 (where
/// exp rounds to 0 in float) gives 0. x = n ln2 + r with n = round(x / ln2) and
/// |r| <= ln2 / 2 (Cody-Waite: ln2 split into a short high part, so n * hi is
/// exact, and the rest); exp(r) by its Taylor polynomial of degree 7 (truncation
/// error < 1e-8 relative); times 2^n applied as two halves, so that results in
/// the subnormal range are rounded once, as std::exp rounds them. Checked
/// against exp in double on every float of [-104, 0] at each level: never more
/// than 1 ulp off, 99.1% (SSE2, no FMA) to 99.5% (AVX2, AVX-512) exact.
inline V exp_nonpos(V x) noexcept {
  x = vmax(set1(-104.0f), x);  // max returns its second operand when one is NaN
  const I n = to_int(mul(x, set1(1.44269504088896341f)));
  const V nf = to_float(n);
  V r = fmadd(nf, set1(-0.693359375f), x);          // ln2 high part: 9 significant bits, n * hi is exact
  r = fmadd(nf, set1(2.12194440054690583e-4f), r);  // - n * (ln2 - hi)
  V p = set1(1.0f / 5040.0f);
  p = fmadd(p, r, set1(1.0f / 720.0f));
  p = fmadd(p, r, set1(1.0f / 120.0f));
  p = fmadd(p, r, set1(1.0f / 24.0f));
  p = fmadd(p, r, set1(1.0f / 6.0f));
  p = fmadd(p, r, set1(0.5f));
  p = fmadd(p, r, set1(1.0f));
  p = fmadd(p, r, set1(1.0f));
  const I n1 = half_down(n);  // n in [-150, 0]: both halves are normal powers of two
  return mul(mul(p, pow2(n1)), pow2(isub(n, n1)));
}

/// See gemm.hpp (softmax_causal). The maximum is taken over the raw scores and
/// scaled once: rounding is monotone and scale > 0, so fl(scale * max) is the
/// maximum of the fl(scale * x) the exponentials use.
inline void softmax_causal(float* s, i64 lds, i64 rows, i64 cols, i64 first, float scale) noexcept {
  const V vscale = set1(scale);
  for (i64 i = 0; i < rows; ++i) {
    float* row = s + i * lds;
    const i64 n = first + i;  // visible entries of this row
    float top;
    if (n >= kW) {
      V m = load(row);
      i64 j = kW;
      for (; j + kW <= n; j += kW) m = vmax(m, load(row + j));
      if (j < n) m = vmax(m, load(row + n - kW));  // overlaps entries already seen: harmless for a maximum
      top = hmax(m);
    } else {
      top = row[0];
      for (i64 j = 1; j < n; ++j) top = row[j] > top ? row[j] : top;
    }
    const V mx = set1(top * scale);
    V sum = zero();
    i64 j = 0;
    for (; j + kW <= n; j += kW) {
      const V e = exp_nonpos(sub(mul(load(row + j), vscale), mx));
      store(row + j, e);
      sum = add(sum, e);
    }
    const int tail = static_cast<int>(n - j);
    if (tail > 0) {
      store_part(row + j, exp_nonpos(sub(mul(load_part(row + j, tail), vscale), mx)), tail);
      sum = add(sum, load_part(row + j, tail));  // the lanes past n are zero here
    }
    const V inv = set1(1.0f / hsum(sum));
    for (j = 0; j + kW <= n; j += kW) store(row + j, mul(load(row + j), inv));
    if (tail > 0) store_part(row + j, mul(load_part(row + j, tail), inv), tail);
    for (j = n; j < cols; ++j) row[j] = 0.0f;
  }
}

}  // namespace kvp_engine::gemm_detail::KVP_GEMM_ISA_NS

/// In gemm_<isa>.cpp: the accessor of this level's table.
#define KVP_GEMM_DEFINE_KERNELS()                                                                                                \
  namespace kvp_engine::gemm_detail {                                                                                            \
  const GemmKernels& KVP_GEMM_CAT(gemm_kernels, KVP_GEMM_ISA_NS)() noexcept {                                                    \
    static constexpr GemmKernels kTable{&KVP_GEMM_ISA_NS::gemm_nt, &KVP_GEMM_ISA_NS::gemm_nn, &KVP_GEMM_ISA_NS::softmax_causal}; \
    return kTable;                                                                                                               \
  }                                                                                                                              \
  }
#define KVP_GEMM_CAT_(a, b) a##_##b
#define KVP_GEMM_CAT(a, b) KVP_GEMM_CAT_(a, b)
