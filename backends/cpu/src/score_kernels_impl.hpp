// SPDX-License-Identifier: Apache-2.0
// Score-op kernels, written once and compiled per ISA (internal; included only
// by score_ops_<isa>.cpp after isa_arch.hpp). See score_kernels.hpp for the
// contracts and cpu_score_ops.cpp for the entry points.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "isa_arch.hpp"
#include "score_kernels.hpp"

KVP_NAMESPACE_BEGIN
namespace cpu_detail::KVP_CPU_ISA_NS {

using F = xsimd::batch<float, Arch>;
using I = xsimd::batch<std::int32_t, Arch>;
inline constexpr std::int64_t kLanes = static_cast<std::int64_t>(F::size);
inline constexpr float kInf = __builtin_inff();
static_assert(WindowLayout::kQueryAlign % kLanes == 0, "query padding must be a whole number of vectors");

// Register tile of the logit kernel: kRows keys x kVecs query vectors of
// accumulators, plus kVecs query vectors and one broadcast key element
// (AVX-512: 24 + 4 + 1 of 32 registers; AVX2 and SSE2: 12 + 3 + 1 of 16).
#if KVP_CPU_TU_ISA == 2
inline constexpr int kRows = 6, kVecs = 4;
#else
inline constexpr int kRows = 4, kVecs = 3;
#endif

// ---- key rows ----------------------------------------------------------------

template <class T>
inline const T* key_row(const KeyRows<T>& k, std::int64_t j) noexcept {
  if (k.pages == nullptr) return k.base + j * k.row_stride;
  return k.base + static_cast<std::int64_t>(k.pages[j / k.page_size]) * k.page_stride + (j % k.page_size) * k.row_stride;
}

// Widen one row of d fp16 / bf16 keys into fp32 (exact). bf16 is the upper
// half of a float: a 16-bit shift. fp16 uses F16C where the level has it.
#if KVP_CPU_TU_ISA == 2
inline void widen_row(const half* src, std::int64_t d, float* dst) noexcept {
  const auto* s = reinterpret_cast<const std::uint16_t*>(src);
  std::int64_t c = 0;
  for (; c + 16 <= d; c += 16) _mm512_storeu_ps(dst + c, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + c))));
  if (c < d) {
    const auto m = static_cast<__mmask16>((1u << (d - c)) - 1u);
    _mm512_mask_storeu_ps(dst + c, m, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, s + c)));
  }
}
inline void widen_row(const bfloat16* src, std::int64_t d, float* dst) noexcept {
  const auto* s = reinterpret_cast<const std::uint16_t*>(src);
  std::int64_t c = 0;
  for (; c + 16 <= d; c += 16) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + c)));
    _mm512_storeu_ps(dst + c, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
  }
  if (c < d) {
    const auto m = static_cast<__mmask16>((1u << (d - c)) - 1u);
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, s + c));
    _mm512_mask_storeu_ps(dst + c, m, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
  }
}
#else
// 8 values per step; the tail goes through a zero-padded copy.
#if KVP_CPU_TU_ISA == 1
inline void widen8(const std::uint16_t* s, float* dst, const half*) noexcept {
  _mm256_storeu_ps(dst, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s))));
}
inline void widen8(const std::uint16_t* s, float* dst, const bfloat16*) noexcept {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  _mm256_storeu_ps(dst, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
}
#else
// IEEE half -> float with SSE2 integer ops: move exponent and mantissa into
// place and rescale by 2^112 (exact for normals and subnormals, assuming the
// default MXCSR without denormals-are-zero); inf / NaN keep an all-ones exponent.
inline __m128 half4_to_float(__m128i h) noexcept {
  const __m128i sign = _mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x8000)), 16);
  const __m128i em = _mm_and_si128(h, _mm_set1_epi32(0x7fff));
  const __m128i shifted = _mm_slli_epi32(em, 13);
  const __m128 scaled = _mm_mul_ps(_mm_castsi128_ps(shifted), _mm_castsi128_ps(_mm_set1_epi32(0x77800000)));  // * 2^112
  const __m128i special = _mm_cmpgt_epi32(em, _mm_set1_epi32(0x7bff));
  const __m128i inf_nan = _mm_or_si128(shifted, _mm_set1_epi32(0x7f800000));
  const __m128i bits = _mm_or_si128(_mm_and_si128(special, inf_nan), _mm_andnot_si128(special, _mm_castps_si128(scaled)));
  return _mm_castsi128_ps(_mm_or_si128(bits, sign));
}
inline void widen8(const std::uint16_t* s, float* dst, const half*) noexcept {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  const __m128i zero = _mm_setzero_si128();
  _mm_storeu_ps(dst, half4_to_float(_mm_unpacklo_epi16(h, zero)));
  _mm_storeu_ps(dst + 4, half4_to_float(_mm_unpackhi_epi16(h, zero)));
}
inline void widen8(const std::uint16_t* s, float* dst, const bfloat16*) noexcept {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  const __m128i zero = _mm_setzero_si128();
  _mm_storeu_ps(dst, _mm_castsi128_ps(_mm_unpacklo_epi16(zero, h)));
  _mm_storeu_ps(dst + 4, _mm_castsi128_ps(_mm_unpackhi_epi16(zero, h)));
}
#endif
template <class T>
inline void widen_row(const T* src, std::int64_t d, float* dst) noexcept {
  const auto* s = reinterpret_cast<const std::uint16_t*>(src);
  std::int64_t c = 0;
  for (; c + 8 <= d; c += 8) widen8(s + c, dst + c, src);
  if (c < d) {
    std::uint16_t tmp_in[8] = {};
    float tmp_out[8];
    std::memcpy(tmp_in, s + c, static_cast<std::size_t>(d - c) * sizeof(std::uint16_t));
    widen8(tmp_in, tmp_out, src);
    std::memcpy(dst + c, tmp_out, static_cast<std::size_t>(d - c) * sizeof(float));
  }
}
#endif

// NaN tests use xsimd::isnan: xsimd 8 compiles `a != b` to an ordered
// compare on AVX/AVX-512 (false for NaN), unlike the C++ operator.

// ---- window scores -------------------------------------------------------------

// e^x for the softmax, whose arguments are never positive (logit - max):
// Cody-Waite reduction by ln 2 and a degree-6 polynomial (about 1 ulp on
// [-87.3, 0]); below -87.3 the result (< 2^-126) is flushed to 0, and NaN
// stays NaN. The integer rounding uses the 1.5 * 2^23 trick, so no
// float -> int conversion can see a NaN or an out-of-range value.
inline F exp_nonpositive(F x) noexcept {
  const F lo(-87.33654f), magic(12582912.0f);
  const F xc = xsimd::min(xsimd::max(x, lo), F(0.0f));
  const F t = xsimd::fma(xc, F(1.44269504088896341f), magic);
  const F n = t - magic;
  F r = xsimd::fnma(n, F(0.693359375f), xc);
  r = xsimd::fnma(n, F(-2.12194440e-4f), r);
  F p(1.9875691500e-4f);
  p = xsimd::fma(p, r, F(1.3981999507e-3f));
  p = xsimd::fma(p, r, F(8.3334519073e-3f));
  p = xsimd::fma(p, r, F(4.1665795894e-2f));
  p = xsimd::fma(p, r, F(1.6666665459e-1f));
  p = xsimd::fma(p, r, F(5.0000001201e-1f));
  const F y = xsimd::fma(p * r, r, r) + F(1.0f);
  const I e = (xsimd::bitwise_cast<I>(t) - xsimd::bitwise_cast<I>(magic) + I(127)) << 23;
  const F scaled = y * xsimd::bitwise_cast<F>(e);
  return xsimd::select(xsimd::isnan(x), x, xsimd::select(x < lo, F(0.0f), scaled));
}

struct TileArgs {
  const float* const* rows;            // kChunk row pointers (fp32, contiguous along d)
  const float* qt;                     // (d, qpad)
  const std::int32_t* last_visible;    // (qpad)
  float* p;                            // (kv_len, qpad)
  float* cmax;                         // (qpad): running max of the current chunk
  std::int64_t qpad, d, q_pos0;
  std::int64_t j;                      // absolute index of the tile's first key
  std::int64_t r;                      // index of the tile's first row in `rows`
  std::int64_t v;                      // first query vector of the tile
  float scale;
};

// logits of R keys x V query vectors: broadcast one key element, FMA against
// V query vectors, over the head dimension. Then scale, causal mask, store
// and fold into the chunk max.
template <int R, int V>
inline void logit_tile(const TileArgs& a) noexcept {
  F acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) acc[r][v] = F(0.0f);
  const float* rows[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) rows[r] = a.rows[a.r + r];
  const float* qt = a.qt + a.v * kLanes;
  for (std::int64_t c = 0; c < a.d; ++c) {
    F qv[V];
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) qv[v] = F::load_aligned(qt + c * a.qpad + v * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const F k(rows[r][c]);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) acc[r][v] = xsimd::fma(k, qv[v], acc[r][v]);
    }
  }
  const F scale(a.scale);
  F m[V];
#pragma GCC unroll 8
  for (int v = 0; v < V; ++v) m[v] = F::load_aligned(a.cmax + (a.v + v) * kLanes);
  // Only keys after q_pos0 are hidden from some query of the window.
  const bool masked = a.j + R - 1 > a.q_pos0;
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    float* prow = a.p + (a.j + r) * a.qpad + a.v * kLanes;
    const I key_index(static_cast<std::int32_t>(a.j + r));
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
      F l = acc[r][v] * scale;
      if (masked) {
        const I lv = I::load_aligned(a.last_visible + (a.v + v) * kLanes);
        l = xsimd::select(xsimd::bool_cast(key_index <= lv), l, F(-kInf));
      }
      l.store_aligned(prow + v * kLanes);
      m[v] = xsimd::max(m[v], l);
    }
  }
#pragma GCC unroll 8
  for (int v = 0; v < V; ++v) m[v].store_aligned(a.cmax + (a.v + v) * kLanes);
}

// Picks the tile instantiation for a partial tile (rc <= R rows, vc <= V vectors).
template <int R, int V>
inline void dispatch_tile(int rc, int vc, const TileArgs& a) noexcept {
  if constexpr (R > 1) {
    if (rc < R) return dispatch_tile<R - 1, V>(rc, vc, a);
  }
  if constexpr (V > 1) {
    if (vc < V) return dispatch_tile<R, V - 1>(rc, vc, a);
  }
  logit_tile<R, V>(a);
}

template <class Tk>
void window_scores(const WindowScoreShape& s, const float* q, KeyRows<Tk> keys, float* out, const WindowScratch& ws) noexcept {
  const std::int64_t G = s.group, w = s.window, d = s.head_dim, T = s.kv_len, L = s.num_cols;
  const std::int64_t Q = ws.layout.num_q, qpad = ws.layout.qpad, nv = qpad / kLanes;
  constexpr std::int64_t kChunk = WindowLayout::kChunk;
  for (std::int64_t i = 0; i < G * L; ++i) out[i] = 0.0f;
  if (Q <= 0 || T <= 0) return;

  // Queries transposed to (d, qpad): one query row per SIMD lane.
  for (std::int64_t c = 0; c < d; ++c) {
    float* dst = ws.qt + c * qpad;
    for (std::int64_t r = 0; r < Q; ++r) dst[r] = q[r * d + c];
    for (std::int64_t r = Q; r < qpad; ++r) dst[r] = 0.0f;
  }
  // Causal visibility: window query i of every head sees keys j <= q_pos0 + i.
  for (std::int64_t r = 0; r < qpad; ++r) {
    std::int64_t last = r < Q ? s.q_pos0 + r % w : INT32_MAX;
    last = last > INT32_MAX ? INT32_MAX : (last < INT32_MIN ? INT32_MIN : last);
    ws.last_visible[r] = static_cast<std::int32_t>(last);
  }

  // Pass 1: per chunk of keys, logits into p, the chunk max per query, then
  // p = exp(logit - chunk max) and the chunk sums.
  const float* rows[kChunk];
  TileArgs a{rows, ws.qt, ws.last_visible, ws.p, nullptr, qpad, d, s.q_pos0, 0, 0, 0, s.scale};
  for (std::int64_t ch = 0; ch * kChunk < T; ++ch) {
    const std::int64_t j0 = ch * kChunk, nr = T - j0 < kChunk ? T - j0 : kChunk;
    for (std::int64_t r = 0; r < nr; ++r) {
      if constexpr (std::is_same_v<Tk, float>) {
        rows[r] = key_row(keys, j0 + r);
      } else {
        widen_row(key_row(keys, j0 + r), d, ws.key_buf + r * d);
        rows[r] = ws.key_buf + r * d;
      }
    }
    float* cmax = ws.chunk_max + ch * qpad;
    for (std::int64_t i = 0; i < qpad; ++i) cmax[i] = -kInf;
    a.cmax = cmax;
    for (std::int64_t v0 = 0; v0 < nv; v0 += kVecs) {
      a.v = v0;
      const int vc = static_cast<int>(nv - v0 < kVecs ? nv - v0 : kVecs);
      for (std::int64_t r0 = 0; r0 < nr; r0 += kRows) {
        a.r = r0;
        a.j = j0 + r0;
        const int rc = static_cast<int>(nr - r0 < kRows ? nr - r0 : kRows);
        dispatch_tile<kRows, kVecs>(rc, vc, a);
      }
    }
    float* csum = ws.chunk_sum + ch * qpad;
    for (std::int64_t v = 0; v < nv; ++v) {
      const F m = F::load_aligned(cmax + v * kLanes);
      const F base = xsimd::select(m == F(-kInf), F(0.0f), m);  // fully masked: exp(-inf) = 0
      F sum(0.0f);
      float* pp = ws.p + j0 * qpad + v * kLanes;
      for (std::int64_t r = 0; r < nr; ++r, pp += qpad) {
        const F e = exp_nonpositive(F::load_aligned(pp) - base);
        e.store_aligned(pp);
        sum += e;
      }
      sum.store_aligned(csum + v * kLanes);
    }
  }

  // Softmax statistics: max over chunks, chunk rescale factors (stored over
  // the chunk maxima), denominators accumulated in double.
  const std::int64_t nch = ws.layout.num_chunks;
  for (std::int64_t v = 0; v < nv; ++v) {
    F m(-kInf);
    for (std::int64_t ch = 0; ch < nch; ++ch) m = xsimd::max(m, F::load_aligned(ws.chunk_max + ch * qpad + v * kLanes));
    m.store_aligned(ws.row_max + v * kLanes);
  }
  for (std::int64_t r = 0; r < qpad; ++r) ws.denom[r] = 0.0;
  for (std::int64_t ch = 0; ch < nch; ++ch) {
    float* cm = ws.chunk_max + ch * qpad;
    const float* cs = ws.chunk_sum + ch * qpad;
    for (std::int64_t v = 0; v < nv; ++v) {
      const F m = F::load_aligned(cm + v * kLanes);
      const F e = xsimd::select(m == F(-kInf), F(0.0f), exp_nonpositive(m - F::load_aligned(ws.row_max + v * kLanes)));
      e.store_aligned(cm + v * kLanes);
    }
    for (std::int64_t r = 0; r < Q; ++r) ws.denom[r] += static_cast<double>(cs[r]) * static_cast<double>(cm[r]);
  }
  const float inv_w = s.reduce == WindowReduce::kMean ? 1.0f / static_cast<float>(w) : 1.0f;
  for (std::int64_t r = 0; r < qpad; ++r) {
    // A query that sees no key contributes nothing (as in the reference).
    ws.inv_denom[r] = (r >= Q || ws.denom[r] == 0.0) ? 0.0f : static_cast<float>(1.0 / ws.denom[r]) * inv_w;
  }

  // Pass 2: out[g, j] = sum over the head's window of p[j, i] * factor[i].
  const std::int64_t cols = L < T ? L : T;
  const bool whole_vectors = w % kLanes == 0;
  for (std::int64_t ch = 0; ch * kChunk < cols; ++ch) {
    const std::int64_t j0 = ch * kChunk, j1 = cols - j0 < kChunk ? cols : j0 + kChunk;
    for (std::int64_t v = 0; v < nv; ++v) {
      const F f = F::load_aligned(ws.chunk_max + ch * qpad + v * kLanes) * F::load_aligned(ws.inv_denom + v * kLanes);
      f.store_aligned(ws.factor + v * kLanes);
    }
    if (whole_vectors) {
      const std::int64_t vph = w / kLanes;  // vectors per head
      for (std::int64_t j = j0; j < j1; ++j) {
        const float* pr = ws.p + j * qpad;
        for (std::int64_t g = 0; g < G; ++g) {
          const float* pg = pr + g * w;
          const float* fg = ws.factor + g * w;
          F acc = F::load_aligned(pg) * F::load_aligned(fg);
          for (std::int64_t v = 1; v < vph; ++v) acc = xsimd::fma(F::load_aligned(pg + v * kLanes), F::load_aligned(fg + v * kLanes), acc);
          out[g * L + j] = xsimd::hadd(acc);
        }
      }
    } else {
      for (std::int64_t j = j0; j < j1; ++j) {
        const float* pr = ws.p + j * qpad;
        for (std::int64_t v = 0; v < nv; ++v) {
          (F::load_aligned(pr + v * kLanes) * F::load_aligned(ws.factor + v * kLanes)).store_aligned(ws.row_tmp + v * kLanes);
        }
        for (std::int64_t g = 0; g < G; ++g) {
          float acc = 0.0f;
          for (std::int64_t i = 0; i < w; ++i) acc += ws.row_tmp[g * w + i];
          out[g * L + j] = acc;
        }
      }
    }
  }
}

// ---- pool1d --------------------------------------------------------------------

// Outputs with complete windows, in the reference's order: avg sums the window
// left to right from 0.0f and divides by the kernel; max keeps the first
// element unless a later one compares greater or the running value is NaN.
inline void pool1d_full(const float* in, int kernel, Pooling kind, float* out, std::int64_t t0, std::int64_t t1) noexcept {
  const std::int64_t r = kernel / 2;
  std::int64_t t = t0;
  if (kind == Pooling::kAvg) {
    const F div(static_cast<float>(kernel));
    for (; t + kLanes <= t1; t += kLanes) {
      F acc(0.0f);
      for (std::int64_t u = -r; u <= r; ++u) acc += F::load_unaligned(in + t + u);
      (acc / div).store_unaligned(out + t);
    }
    for (; t < t1; ++t) {
      float acc = 0.0f;
      for (std::int64_t u = -r; u <= r; ++u) acc += in[t + u];
      out[t] = acc / static_cast<float>(kernel);
    }
  } else {
    for (; t + kLanes <= t1; t += kLanes) {
      F m = F::load_unaligned(in + t - r);
      for (std::int64_t u = -r + 1; u <= r; ++u) {
        const F x = F::load_unaligned(in + t + u);
        m = xsimd::select((x > m) | xsimd::isnan(m), x, m);
      }
      m.store_unaligned(out + t);
    }
    for (; t < t1; ++t) {
      float m = in[t - r];
      for (std::int64_t u = -r + 1; u <= r; ++u) m = (in[t + u] > m || m != m) ? in[t + u] : m;
      out[t] = m;
    }
  }
}

// ---- top-k collection pass -------------------------------------------------------

#if KVP_CPU_TU_ISA == 2
inline std::int64_t collect_at_least(const float* s, std::int64_t n, float threshold, std::int32_t* out) noexcept {
  const __m512 thr = _mm512_set1_ps(threshold);
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  std::int64_t m = 0, i = 0;
  for (; i + 16 <= n; i += 16) {
    const __mmask16 k = _mm512_cmp_ps_mask(_mm512_loadu_ps(s + i), thr, _CMP_GE_OQ);
    _mm512_storeu_si512(out + m, _mm512_maskz_compress_epi32(k, idx));
    m += __builtin_popcount(static_cast<unsigned>(k));
    idx = _mm512_add_epi32(idx, step);
  }
  for (; i < n; ++i) {
    out[m] = static_cast<std::int32_t>(i);
    m += s[i] >= threshold ? 1 : 0;
  }
  return m;
}
#elif KVP_CPU_TU_ISA == 1
// Lane indices of each 8-bit mask, packed left: 256 x 8 bytes.
struct CompressLut {
  alignas(64) std::uint8_t idx[256][8];
  constexpr CompressLut() : idx{} {
    for (int m = 0; m < 256; ++m) {
      int o = 0;
      for (int b = 0; b < 8; ++b)
        if (m & (1 << b)) idx[m][o++] = static_cast<std::uint8_t>(b);
    }
  }
};
inline constexpr CompressLut kCompressLut{};

inline std::int64_t collect_at_least(const float* s, std::int64_t n, float threshold, std::int32_t* out) noexcept {
  const __m256 thr = _mm256_set1_ps(threshold);
  std::int64_t m = 0, i = 0;
  for (; i + 8 <= n; i += 8) {
    const int k = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(s + i), thr, _CMP_GE_OQ));
    const __m256i perm = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(kCompressLut.idx[k])));
    const __m256i idx = _mm256_add_epi32(perm, _mm256_set1_epi32(static_cast<std::int32_t>(i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m), idx);
    m += __builtin_popcount(static_cast<unsigned>(k));
  }
  for (; i < n; ++i) {
    out[m] = static_cast<std::int32_t>(i);
    m += s[i] >= threshold ? 1 : 0;
  }
  return m;
}
#else
inline std::int64_t collect_at_least(const float* s, std::int64_t n, float threshold, std::int32_t* out) noexcept {
  const __m128 thr = _mm_set1_ps(threshold);
  std::int64_t m = 0, i = 0;
  for (; i + 4 <= n; i += 4) {
    const int k = _mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(s + i), thr));  // ordered: NaN never qualifies
    for (int b = 0; b < 4; ++b) {
      out[m] = static_cast<std::int32_t>(i + b);
      m += (k >> b) & 1;
    }
  }
  for (; i < n; ++i) {
    out[m] = static_cast<std::int32_t>(i);
    m += s[i] >= threshold ? 1 : 0;
  }
  return m;
}
#endif

}  // namespace cpu_detail::KVP_CPU_ISA_NS
KVP_NAMESPACE_END
