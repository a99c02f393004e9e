// SPDX-License-Identifier: Apache-2.0
// Row-reduction kernels, written once and compiled per ISA (internal; included
// only by reduce_ops_<isa>.cpp). Contracts in reduce_kernels.hpp. Only
// functions of this level's namespace, xsimd on `Arch` and libc are called
// here (isa_dispatch.hpp's rule for per-ISA units).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "isa_arch.hpp"
#include "reduce_kernels.hpp"

KVP_NAMESPACE_BEGIN
namespace cpu_detail::KVP_CPU_ISA_NS {

using RF = xsimd::batch<float, Arch>;
inline constexpr std::int64_t kRL = static_cast<std::int64_t>(RF::size);

// a * b + c rounded once (the reference's std::fma): the FMA instruction on AVX2 and AVX-512; lane by lane
// through std::fma on SSE2, which has no such instruction (slow, but exact).
inline RF fma_exact(RF a, RF b, RF c) noexcept {
#if KVP_CPU_TU_ISA == 2
  return RF(_mm512_fmadd_ps(a, b, c));
#elif KVP_CPU_TU_ISA == 1
  return RF(_mm256_fmadd_ps(a, b, c));
#else
  alignas(16) float x[kRL], y[kRL], z[kRL];
  a.store_aligned(x);
  b.store_aligned(y);
  c.store_aligned(z);
  for (std::int64_t l = 0; l < kRL; ++l) z[l] = std::fma(x[l], y[l], z[l]);
  return RF::load_aligned(z);
#endif
}

inline float hmin_lanes(RF v) noexcept {
  alignas(64) float t[kRL];
  v.store_aligned(t);
  float m = t[0];
  for (std::int64_t l = 1; l < kRL; ++l) m = t[l] < m ? t[l] : m;
  return m;
}

inline bool has_nan(const float* x, std::int64_t n) noexcept {
  auto ok = RF(0.0f) == RF(0.0f);  // all true; a lane turns false at a NaN (== is ordered on every level)
  std::int64_t j = 0;
  for (; j + 4 * kRL <= n; j += 4 * kRL) {
    const RF a = RF::load_unaligned(x + j), b = RF::load_unaligned(x + j + kRL);
    const RF c = RF::load_unaligned(x + j + 2 * kRL), d = RF::load_unaligned(x + j + 3 * kRL);
    ok = ok & (a == a) & (b == b) & (c == c) & (d == d);
  }
  for (; j + kRL <= n; j += kRL) {
    const RF a = RF::load_unaligned(x + j);
    ok = ok & (a == a);
  }
  bool any = !xsimd::all(ok);
  for (; j < n; ++j) any = any || x[j] != x[j];
  return any;
}

/// First j in [j0, n) with x[j] == v (ordered compare), or n.
inline std::int64_t find_equal(const float* x, std::int64_t j0, std::int64_t n, float v) noexcept {
  const RF vv(v);
  std::int64_t j = j0;
  for (; j + kRL <= n; j += kRL) {
    if (xsimd::any(RF::load_unaligned(x + j) == vv)) break;
  }
  for (; j < n; ++j)
    if (x[j] == v) return j;
  return n;
}

inline std::int64_t argmin_or_nan(const float* x, std::int64_t n, std::int64_t* at) noexcept {
  constexpr std::int64_t kB = 1024;
  const float inf = __builtin_inff();
  float best = inf;
  std::int64_t best_block = 0;
  auto ok = RF(0.0f) == RF(0.0f);
  for (std::int64_t b0 = 0; b0 < n; b0 += kB) {
    const std::int64_t nb = n - b0 < kB ? n - b0 : kB;
    const float* p = x + b0;
    RF m0(inf), m1(inf), m2(inf), m3(inf);
    std::int64_t j = 0;
    for (; j + 4 * kRL <= nb; j += 4 * kRL) {
      const RF a = RF::load_unaligned(p + j), b = RF::load_unaligned(p + j + kRL);
      const RF c = RF::load_unaligned(p + j + 2 * kRL), d = RF::load_unaligned(p + j + 3 * kRL);
      m0 = xsimd::select(a < m0, a, m0);
      m1 = xsimd::select(b < m1, b, m1);
      m2 = xsimd::select(c < m2, c, m2);
      m3 = xsimd::select(d < m3, d, m3);
      ok = ok & (a == a) & (b == b) & (c == c) & (d == d);
    }
    for (; j + kRL <= nb; j += kRL) {
      const RF a = RF::load_unaligned(p + j);
      m0 = xsimd::select(a < m0, a, m0);
      ok = ok & (a == a);
    }
    m0 = xsimd::select(m1 < m0, m1, m0);
    m2 = xsimd::select(m3 < m2, m3, m2);
    m0 = xsimd::select(m2 < m0, m2, m0);
    float bm = hmin_lanes(m0);
    for (; j < nb; ++j) {
      const float v = p[j];
      bm = v < bm ? v : bm;
      if (v != v) return 0;
    }
    if (bm < best) best = bm, best_block = b0;
  }
  if (!xsimd::all(ok)) return 0;
  if (best == 0.0f) {  // -0 ranks below +0: the first -0 if any, else the first +0
    for (std::int64_t j = 0; j < n; ++j) {
      std::uint32_t u;
      std::memcpy(&u, x + j, sizeof u);
      if (u == 0x80000000u) {
        *at = j;
        return -1;
      }
    }
    *at = find_equal(x, 0, n, 0.0f);
    return -1;
  }
  *at = find_equal(x, best_block, n, best);  // best occurs in its block (all-+inf rows: block 0)
  return -1;
}

inline void mean_rows_f32(const float* rows, std::int64_t H, std::int64_t ld, std::int64_t n, float* mean) noexcept {
  constexpr std::int64_t kB = 2048;  // a block of the mean stays in L1 while the heads stream through
  const RF hf(static_cast<float>(H));
  for (std::int64_t j0 = 0; j0 < n; j0 += kB) {
    const std::int64_t nb = n - j0 < kB ? n - j0 : kB;
    float* m = mean + j0;
    const float* r0 = rows + j0;
    std::int64_t j = 0;
    for (; j + kRL <= nb; j += kRL) RF::load_unaligned(r0 + j).store_unaligned(m + j);
    for (; j < nb; ++j) m[j] = r0[j];
    for (std::int64_t h = 1; h < H; ++h) {
      const float* r = rows + h * ld + j0;
      j = 0;
      for (; j + kRL <= nb; j += kRL) (RF::load_unaligned(m + j) + RF::load_unaligned(r + j)).store_unaligned(m + j);
      for (; j < nb; ++j) m[j] += r[j];
    }
    j = 0;
    for (; j + kRL <= nb; j += kRL) (RF::load_unaligned(m + j) / hf).store_unaligned(m + j);
    const float hs = static_cast<float>(H);
    for (; j < nb; ++j) m[j] /= hs;
  }
}

/// fp16 bits -> fp32, exactly as kvpolicy::to_float(half) (written here again: a per-ISA unit calls no
/// inline function of another namespace).
inline float f16_to_f32(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu;
  std::uint32_t man = h & 0x3ffu, out = 0;
  if (exp == 0x1f) {
    out = sign | 0x7f800000u | (man << 13) | (man ? 0x00400000u : 0u);
  } else if (exp != 0) {
    out = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    out = sign;
  } else {
    int e = -1;
    do {
      man <<= 1;
      ++e;
    } while ((man & 0x400u) == 0);
    out = sign | (static_cast<std::uint32_t>(112 - e) << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &out, sizeof f);
  return f;
}

inline void widen_f16(const std::uint16_t* x, std::int64_t n, float* out) noexcept {
  std::int64_t i = 0;
#if KVP_CPU_TU_ISA == 2  // 16 at a time, the same conversion
  for (; i + 32 <= n; i += 32) {
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i))));
    _mm512_storeu_ps(out + i + 16, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i + 16))));
  }
#endif
#if KVP_CPU_TU_ISA >= 1  // F16C (AVX2 and AVX-512 levels): exact, NaN quieted with its payload, like the scalar form
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i))));
#endif
  for (; i < n; ++i) out[i] = f16_to_f32(x[i]);
}

/// The reference's fixed tree over 16 partial sums (ScalarReduceOps::sum16).
inline float sum16(const float* p) noexcept {
  float s8[8], s4[4];
  for (int k = 0; k < 8; ++k) s8[k] = p[k] + p[k + 8];
  for (int k = 0; k < 4; ++k) s4[k] = s8[k] + s8[k + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/// Lane l of accumulator a holds partial sum k = a * kRL + l (channels c = k mod 16), as the reference;
/// four rows at a time so the adds of independent rows overlap.
inline void row_dots_f32(const float* q, const float* rows, std::int64_t n, std::int64_t d, float* out) noexcept {
  constexpr std::int64_t kA = 16 / kRL, kRows = 4;
  const std::int64_t d16 = d / 16 * 16;
  alignas(64) float p[16];
  std::int64_t i = 0;
  for (; i + kRows <= n; i += kRows) {
    RF acc[kRows][kA];
    for (std::int64_t r = 0; r < kRows; ++r)
      for (std::int64_t a = 0; a < kA; ++a) acc[r][a] = RF(0.0f);
    for (std::int64_t c = 0; c < d16; c += 16)
      for (std::int64_t a = 0; a < kA; ++a) {
        const RF qv = RF::load_unaligned(q + c + a * kRL);
        for (std::int64_t r = 0; r < kRows; ++r) acc[r][a] = acc[r][a] + qv * RF::load_unaligned(rows + (i + r) * d + c + a * kRL);
      }
    for (std::int64_t r = 0; r < kRows; ++r) {
      for (std::int64_t a = 0; a < kA; ++a) acc[r][a].store_aligned(p + a * kRL);
      const float* row = rows + (i + r) * d;
      for (std::int64_t c = d16; c < d; ++c) p[c - d16] += q[c] * row[c];
      out[i + r] = sum16(p);
    }
  }
  for (; i < n; ++i) {
    RF acc[kA];
    for (std::int64_t a = 0; a < kA; ++a) acc[a] = RF(0.0f);
    const float* row = rows + i * d;
    for (std::int64_t c = 0; c < d16; c += 16)
      for (std::int64_t a = 0; a < kA; ++a) acc[a] = acc[a] + RF::load_unaligned(q + c + a * kRL) * RF::load_unaligned(row + c + a * kRL);
    for (std::int64_t a = 0; a < kA; ++a) acc[a].store_aligned(p + a * kRL);
    for (std::int64_t c = d16; c < d; ++c) p[c - d16] += q[c] * row[c];
    out[i] = sum16(p);
  }
}

#if KVP_CPU_TU_ISA >= 1
// The quadratic form's tiles (quad_form): AVX-512 16 keys as 6 + 6 + 4 keys x 4 column vectors (24 + 4 + 1 of
// 32 registers), AVX2 8 keys as 4 + 4 keys x 3 column vectors (12 + 3 + 1 of 16).
#if KVP_CPU_TU_ISA == 2
using NF = __m512;
inline constexpr int kQuadV = 4;
inline void transpose_lanes(const NF* r, NF* c) noexcept { transpose16(r, c); }
#else
using NF = __m256;
inline constexpr int kQuadV = 3;
inline void transpose_lanes(const NF* r, NF* c) noexcept { transpose8(r, c); }
#endif

/// u[r][c] = sum over i of k_r[i] cov[i][c], one fused multiply-add per i in order (the reference's t[c] for
/// key r), for keys r0 .. r0 + R - 1 and the V column vectors from c0: R x V accumulators, each step V cov
/// loads and R key broadcasts. u: kRL rows of d floats, aligned.
template <int R, int V>
inline void quad_cols_tile(const float* cov, std::int64_t d, const float* keys, std::int64_t r0, std::int64_t c0, std::int64_t i0,
                           std::int64_t i1, float* u) noexcept {
  RF acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) acc[r][v] = i0 == 0 ? RF(0.0f) : RF::load_aligned(u + (r0 + r) * d + c0 + kRL * v);
  const float* k[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) k[r] = keys + (r0 + r) * d;
  const float* row = cov + i0 * d + c0;
  for (std::int64_t i = i0; i < i1; ++i, row += d) {
    RF cv[V];
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) cv[v] = RF::load_unaligned(row + kRL * v);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const RF kb(k[r][i]);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) acc[r][v] = fma_exact(kb, cv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) acc[r][v].store_aligned(u + (r0 + r) * d + c0 + kRL * v);
}

/// The block's u for the V column vectors from c0, over cov's rows in slices of kQuadRows: the tiles of one
/// slice share its cov rows while they are in L1. At d = 128 a whole strip of 4 column vectors is 32 KiB and,
/// with the keys, u and kT, overflowed a 48 KiB L1 (Ice Lake Xeon, microbenchmark of the block: unsliced 92-95
/// GFLOP/s, slices of 16 / 32 / 64 rows 94-95 / 104 / 109-110; d = 64, unsliced, 118). A tile's sums over i
/// continue across slices through u, in the same order.
inline constexpr std::int64_t kQuadRows = 64;
template <int V>
inline void quad_cols(const float* cov, std::int64_t d, const float* keys, std::int64_t c0, float* u) noexcept {
  for (std::int64_t i0 = 0; i0 < d; i0 += kQuadRows) {
    const std::int64_t i1 = d - i0 < kQuadRows ? d : i0 + kQuadRows;
#if KVP_CPU_TU_ISA == 2
    quad_cols_tile<6, V>(cov, d, keys, 0, c0, i0, i1, u);
    quad_cols_tile<6, V>(cov, d, keys, 6, c0, i0, i1, u);
    quad_cols_tile<4, V>(cov, d, keys, 12, c0, i0, i1, u);
#else
    quad_cols_tile<4, V>(cov, d, keys, 0, c0, i0, i1, u);
    quad_cols_tile<4, V>(cov, d, keys, 4, c0, i0, i1, u);
#endif
  }
}
#endif

/// The quadratic form sum over c of t[c] k[c] for a block of kRL keys (lanes across keys; kT as in
/// expected_logits_block, keys its rows), t[c] = sum over i of k[i] cov[i][c]:
///  - AVX-512 and AVX2 with d a multiple of the lanes: lanes across columns, register tiles of keys x column
///    vectors (AVX-512 6 x 4: each step 4 cov loads and 6 key broadcasts for 24 FMAs), stored per key and
///    transposed back to lanes across keys in registers for the sum over c. The lanes-across-keys form below
///    takes one broadcast load per FMA. On a 2-FMA AVX-512 core (Ice Lake Xeon), in a microbenchmark of
///    the block at d = 128, it ran at 40-47 % of the FMA peak (and as slowly at d = 64, cov in L1), the
///    tiled form at 55-60 %; at the AVX2 level 68 vs 88 GFLOP/s.
///  - otherwise (SSE2, other d): lanes across keys, kC columns at a time (independent chains that cover the
///    FMA's latency).
/// Every t[c] and the sum over c are the same operations in the same order either way (the reference's).
inline RF quad_form(const float* cov, std::int64_t d, const float* keys, const float* kT) noexcept {
  RF quad(0.0f);
#if KVP_CPU_TU_ISA >= 1
  if (d % kRL == 0) {
    alignas(64) float u[kRL * 256];  // row l: t[c] of key l
    constexpr std::int64_t kW = kQuadV * kRL;
    std::int64_t c0 = 0;
    for (; c0 + kW <= d; c0 += kW) quad_cols<kQuadV>(cov, d, keys, c0, u);
    if (d - c0 == 3 * kRL) quad_cols<3>(cov, d, keys, c0, u);
    if (d - c0 == 2 * kRL) quad_cols<2>(cov, d, keys, c0, u);
    if (d - c0 == kRL) quad_cols<1>(cov, d, keys, c0, u);
    for (c0 = 0; c0 < d; c0 += kRL) {
      NF r[kRL], c[kRL];
      for (int l = 0; l < kRL; ++l) r[l] = RF::load_aligned(u + l * d + c0);
      transpose_lanes(r, c);
      for (int j = 0; j < kRL; ++j) quad = fma_exact(RF(c[j]), RF::load_aligned(kT + (c0 + j) * kRL), quad);
    }
    return quad;
  }
#endif
#if KVP_CPU_TU_ISA == 2
  constexpr std::int64_t kC = 16;
#else
  constexpr std::int64_t kC = 8;
#endif
  std::int64_t k0 = 0;
  for (; k0 + kC <= d; k0 += kC) {
    RF acc[kC];
    for (std::int64_t c = 0; c < kC; ++c) acc[c] = RF(0.0f);
    for (std::int64_t i = 0; i < d; ++i) {
      const RF ki = RF::load_unaligned(kT + i * kRL);
      const float* row = cov + i * d + k0;
      // cov (d^2 floats, 64 KiB at d = 128) lives in L2: its rows are requested 8 steps ahead.
      if (i + 8 < d) prefetch_l1(row + 8 * d);
      for (std::int64_t c = 0; c < kC; ++c) acc[c] = fma_exact(ki, RF(row[c]), acc[c]);
    }
    for (std::int64_t c = 0; c < kC; ++c) quad = fma_exact(acc[c], RF::load_unaligned(kT + (k0 + c) * kRL), quad);
  }
  for (; k0 < d; ++k0) {
    RF acc(0.0f);
    for (std::int64_t i = 0; i < d; ++i) acc = fma_exact(RF::load_unaligned(kT + i * kRL), RF(cov[i * d + k0]), acc);
    quad = fma_exact(acc, RF::load_unaligned(kT + k0 * kRL), quad);
  }
  return quad;
}

/// expected_logits_block (reduce_kernels.hpp): keys transposed in registers (AVX-512) or element by element,
/// then lanes across keys, so every key keeps the reference's sequential order of fused multiply-adds
/// (the quadratic form: quad_form).
inline void expected_logits_block(const float* mean, const float* cov, std::int64_t d, const float* keys, std::int64_t nk, float sqrt_d,
                                  float* z) noexcept {
  // The block's keys (row l = key l) into kT (row i = element i of every key, lane l = key l).
  alignas(64) float kT[256 * kRL];
  std::int64_t i0 = 0;
#if KVP_CPU_TU_ISA == 2
  for (; i0 + 16 <= d; i0 += 16) {
    __m512 r[16], c[16];
    for (int l = 0; l < 16; ++l) r[l] = _mm512_loadu_ps(keys + l * d + i0);
    transpose16(r, c);
    for (int j = 0; j < 16; ++j) _mm512_store_ps(kT + (i0 + j) * 16, c[j]);
  }
#endif
  for (; i0 < d; ++i0)
    for (std::int64_t l = 0; l < kRL; ++l) kT[i0 * kRL + l] = keys[l * d + i0];
  RF dot(0.0f);
  for (std::int64_t i = 0; i < d; ++i) dot = fma_exact(RF(mean[i]), RF::load_unaligned(kT + i * kRL), dot);
  RF zv = dot / RF(sqrt_d);
  if (cov != nullptr) zv = zv + quad_form(cov, d, keys, kT) / RF(static_cast<float>(d)) / RF(2.0f);
  alignas(64) float t[kRL];
  zv.store_aligned(t);
  for (std::int64_t l = 0; l < nk; ++l) z[l] = t[l];
}

// ---- double accumulation (Expected Attention's query statistics) --------------------------------------
// Each element's operations are the reference's (exact widening, one IEEE double add or subtract, nearest
// rounding back to fp32), so any vector width gives the same bits.
#if KVP_CPU_TU_ISA == 2
using VD = __m512d;
inline constexpr std::int64_t kDL = 8;
inline VD ld_dx(const float* p) noexcept { return _mm512_cvtps_pd(_mm256_loadu_ps(p)); }
inline VD ld_d(const double* p) noexcept { return _mm512_loadu_pd(p); }
inline void st_d(double* p, VD v) noexcept { _mm512_storeu_pd(p, v); }
inline void st_dx(float* p, VD v) noexcept { _mm256_storeu_ps(p, _mm512_cvtpd_ps(v)); }
inline VD add_d(VD a, VD b) noexcept { return _mm512_add_pd(a, b); }
inline VD sub_d(VD a, VD b) noexcept { return _mm512_sub_pd(a, b); }
#elif KVP_CPU_TU_ISA == 1
using VD = __m256d;
inline constexpr std::int64_t kDL = 4;
inline VD ld_dx(const float* p) noexcept { return _mm256_cvtps_pd(_mm_loadu_ps(p)); }
inline VD ld_d(const double* p) noexcept { return _mm256_loadu_pd(p); }
inline void st_d(double* p, VD v) noexcept { _mm256_storeu_pd(p, v); }
inline void st_dx(float* p, VD v) noexcept { _mm_storeu_ps(p, _mm256_cvtpd_ps(v)); }
inline VD add_d(VD a, VD b) noexcept { return _mm256_add_pd(a, b); }
inline VD sub_d(VD a, VD b) noexcept { return _mm256_sub_pd(a, b); }
#else
using VD = __m128d;
inline constexpr std::int64_t kDL = 2;
inline VD ld_dx(const float* p) noexcept { return _mm_cvtps_pd(_mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
inline VD ld_d(const double* p) noexcept { return _mm_loadu_pd(p); }
inline void st_d(double* p, VD v) noexcept { _mm_storeu_pd(p, v); }
inline void st_dx(float* p, VD v) noexcept { _mm_storel_pi(reinterpret_cast<__m64*>(p), _mm_cvtpd_ps(v)); }
inline VD add_d(VD a, VD b) noexcept { return _mm_add_pd(a, b); }
inline VD sub_d(VD a, VD b) noexcept { return _mm_sub_pd(a, b); }
#endif

// outer_upper_accumulate's register tiles: R rows x V vectors of columns (AVX-512 6 x 4: each token 4 loads and
// 6 broadcasts for 24 FMAs; AVX2 4 x 3; SSE2 4 x 2).
#if KVP_CPU_TU_ISA == 2
inline constexpr int kOuterR = 6, kOuterV = 4;
#elif KVP_CPU_TU_ISA == 1
inline constexpr int kOuterR = 4, kOuterV = 3;
#else
inline constexpr int kOuterR = 4, kOuterV = 2;
#endif

/// block[i][j] += c[t][i] c[t][j] over the n tokens in order, rows i0 .. i0 + R - 1, the V column vectors from j0.
/// kF64: the sums start from 0.0f instead (a zero block) and each entry j >= i is then added to dacc[i][j] in
/// double (add_upper_f64's operation); the block is not touched.
template <int R, int V, bool kF64>
inline void outer_tile(const float* c, std::int64_t n, std::int64_t d, std::int64_t i0, std::int64_t j0, float* block,
                       double* dacc) noexcept {
  RF acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) acc[r][v] = kF64 ? RF(0.0f) : RF::load_unaligned(block + (i0 + r) * d + j0 + v * kRL);
  const float* ct = c;
  for (std::int64_t t = 0; t < n; ++t, ct += d) {
    RF cj[V];
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) cj[v] = RF::load_unaligned(ct + j0 + v * kRL);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const RF ci(ct[i0 + r]);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) acc[r][v] = fma_exact(ci, cj[v], acc[r][v]);
    }
  }
  if constexpr (kF64) {
    alignas(64) float tmp[kRL];
    for (int r = 0; r < R; ++r) {
      const std::int64_t i = i0 + r;
      double* row = dacc + i * d;
      for (int v = 0; v < V; ++v) {
        const std::int64_t jb = j0 + v * kRL;
        if (jb + kRL <= i) continue;  // entries j < i only
        acc[r][v].store_aligned(tmp);
        if (jb >= i) {
          for (std::int64_t k = 0; k < kRL; k += kDL) st_d(row + jb + k, add_d(ld_d(row + jb + k), ld_dx(tmp + k)));
        } else {
          for (std::int64_t l = i - jb; l < kRL; ++l) row[jb + l] += static_cast<double>(tmp[l]);
        }
      }
    }
  } else {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) acc[r][v].store_unaligned(block + (i0 + r) * d + j0 + v * kRL);
  }
}

/// Rows i0 .. i0 + R - 1: whole vectors of columns from the one holding column i0 (earlier lanes are entries
/// j < i: don't-care), in groups of kOuterV and one narrower group, then the columns past the last whole
/// vector element by element.
template <int R, bool kF64>
inline void outer_rows(const float* c, std::int64_t n, std::int64_t d, std::int64_t i0, float* block, double* dacc) noexcept {
  const std::int64_t dv = d / kRL * kRL;
  std::int64_t j0 = i0 / kRL * kRL;
  for (; j0 + kOuterV * kRL <= dv; j0 += kOuterV * kRL) outer_tile<R, kOuterV, kF64>(c, n, d, i0, j0, block, dacc);
  const std::int64_t rest = (dv - j0) / kRL;
  if constexpr (kOuterV > 3) {
    if (rest == 3) outer_tile<R, 3, kF64>(c, n, d, i0, j0, block, dacc);
  }
  if constexpr (kOuterV > 2) {
    if (rest == 2) outer_tile<R, 2, kF64>(c, n, d, i0, j0, block, dacc);
  }
  if (rest == 1) outer_tile<R, 1, kF64>(c, n, d, i0, j0, block, dacc);
  for (std::int64_t r = 0; r < R; ++r)
    for (std::int64_t j = dv > i0 + r ? dv : i0 + r; j < d; ++j) {
      float a = kF64 ? 0.0f : block[(i0 + r) * d + j];
      for (std::int64_t t = 0; t < n; ++t) a = std::fma(c[t * d + i0 + r], c[t * d + j], a);
      if constexpr (kF64)
        dacc[(i0 + r) * d + j] += static_cast<double>(a);
      else
        block[(i0 + r) * d + j] = a;
    }
}

/// outer_upper_accumulate (reduce_kernels.hpp): register tiles (outer_tile) held across all n tokens, so each
/// entry adds its products in token order; rows in groups of kOuterR, the last rows one at a time. On an Ice
/// Lake Xeon (microbenchmark, d = 128, 64 tokens) the AVX-512 tiles of 6 x 4 ran 1.2-1.27x the 8 x 2 tiles
/// before them (whose 8 x 1 tail took one load per FMA), the AVX2 tiles of 4 x 3 1.18x the 4 x 2 ones.
inline void outer_upper_accumulate(const float* c, std::int64_t n, std::int64_t d, float* block) noexcept {
  std::int64_t i0 = 0;
  for (; i0 + kOuterR <= d; i0 += kOuterR) outer_rows<kOuterR, false>(c, n, d, i0, block, nullptr);
  for (; i0 < d; ++i0) outer_rows<1, false>(c, n, d, i0, block, nullptr);
}

/// outer_upper_add_f64 (reduce_kernels.hpp): outer_upper_accumulate on a zero block, then add_upper_f64, with
/// each tile's sums added to acc in double where they are (no block to fill, store and read back).
inline void outer_upper_add_f64(const float* c, std::int64_t n, std::int64_t d, double* acc) noexcept {
  std::int64_t i0 = 0;
  for (; i0 + kOuterR <= d; i0 += kOuterR) outer_rows<kOuterR, true>(c, n, d, i0, nullptr, acc);
  for (; i0 < d; ++i0) outer_rows<1, true>(c, n, d, i0, nullptr, acc);
}

/// accumulate_rows_f64 (reduce_kernels.hpp): 4 vectors of columns held across all n rows.
inline void accumulate_rows_f64(const float* x, std::int64_t n, std::int64_t d, double* acc) noexcept {
  constexpr std::int64_t kV = 4;
  std::int64_t i = 0;
  for (; i + kV * kDL <= d; i += kV * kDL) {
    VD a[kV];
    for (std::int64_t v = 0; v < kV; ++v) a[v] = ld_d(acc + i + v * kDL);
    for (std::int64_t r = 0; r < n; ++r)
      for (std::int64_t v = 0; v < kV; ++v) a[v] = add_d(a[v], ld_dx(x + r * d + i + v * kDL));
    for (std::int64_t v = 0; v < kV; ++v) st_d(acc + i + v * kDL, a[v]);
  }
  for (; i < d; ++i) {
    double a = acc[i];
    for (std::int64_t r = 0; r < n; ++r) a += static_cast<double>(x[r * d + i]);
    acc[i] = a;
  }
}
/// centre_rows (reduce_kernels.hpp).
inline void centre_rows(float* x, std::int64_t n, std::int64_t d, const double* mu) noexcept {
  for (std::int64_t r = 0; r < n; ++r) {
    float* xr = x + r * d;
    std::int64_t i = 0;
    for (; i + kDL <= d; i += kDL) st_dx(xr + i, sub_d(ld_dx(xr + i), ld_d(mu + i)));
    for (; i < d; ++i) xr[i] = static_cast<float>(static_cast<double>(xr[i]) - mu[i]);
  }
}
/// add_upper_f64 (reduce_kernels.hpp): each row from its diagonal.
inline void add_upper_f64(const float* block, std::int64_t d, double* acc) noexcept {
  for (std::int64_t i = 0; i < d; ++i) {
    std::int64_t j = i;
    for (; j + kDL <= d; j += kDL) st_d(acc + i * d + j, add_d(ld_d(acc + i * d + j), ld_dx(block + i * d + j)));
    for (; j < d; ++j) acc[i * d + j] += static_cast<double>(block[i * d + j]);
  }
}

/// neg_norms16 (reduce_kernels.hpp): on AVX-512, 16 x 16 blocks transposed in registers so that lane l
/// sums row l's squares in column order; elsewhere (and past the last whole block) element by element.
inline void neg_norms16(const float* rows, std::int64_t d, float* out) noexcept {
  alignas(64) double acc[16] = {};
  std::int64_t i0 = 0;
#if KVP_CPU_TU_ISA == 2
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
  for (; i0 + 16 <= d; i0 += 16) {
    __m512 r[16], c[16];
    for (int l = 0; l < 16; ++l) r[l] = _mm512_loadu_ps(rows + l * d + i0);
    transpose16(r, c);
    for (int j = 0; j < 16; ++j) {
      const __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(c[j]));
      const __m512d b = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(c[j]), 1)));
      lo = _mm512_add_pd(lo, _mm512_mul_pd(a, a));
      hi = _mm512_add_pd(hi, _mm512_mul_pd(b, b));
    }
  }
  _mm512_store_pd(acc, lo);
  _mm512_store_pd(acc + 8, hi);
#endif
  for (; i0 < d; ++i0)
    for (int l = 0; l < 16; ++l) {
      const double x = rows[l * d + i0];
      acc[l] += x * x;
    }
  for (int l = 0; l < 16; ++l) out[l] = -static_cast<float>(__builtin_sqrt(acc[l]));
}

}  // namespace cpu_detail::KVP_CPU_ISA_NS
KVP_NAMESPACE_END
