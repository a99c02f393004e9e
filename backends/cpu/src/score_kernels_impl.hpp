// SPDX-License-Identifier: Apache-2.0
// Score-op kernels, written once and compiled per ISA (internal; included only
// by score_ops_<isa>.cpp after isa_arch.hpp). See score_kernels.hpp for the
// contracts and cpu_score_ops.cpp for the entry points.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "isa_arch.hpp"
#include "lane_reduce.hpp"
#include "score_kernels.hpp"

KVP_NAMESPACE_BEGIN
namespace cpu_detail::KVP_CPU_ISA_NS {

using F = xsimd::batch<float, Arch>;
using I = xsimd::batch<std::int32_t, Arch>;
inline constexpr std::int64_t kLanes = static_cast<std::int64_t>(F::size);
inline constexpr float kInf = __builtin_inff();
static_assert(WindowLayout::kQueryAlign % kLanes == 0, "query padding must be a whole number of vectors");

// a * b + c and c - a * b, fused where the level has FMA. (xsimd 8 has no
// AVX-512 fma: its generic a * b + c is only contracted by compilers that
// contract across inline functions, which GCC does and clang does not.)
inline F fmadd(F a, F b, F c) noexcept {
#if KVP_CPU_TU_ISA == 2
  return F(_mm512_fmadd_ps(a, b, c));
#else
  return xsimd::fma(a, b, c);
#endif
}
inline F fnmadd(F a, F b, F c) noexcept {
#if KVP_CPU_TU_ISA == 2
  return F(_mm512_fnmadd_ps(a, b, c));
#else
  return xsimd::fnma(a, b, c);
#endif
}

// Register tile of the logit kernel: kRows keys x kVecs query vectors of
// accumulators, plus kVecs query vectors and one broadcast key element
// (AVX-512: 24 + 4 + 1 of 32 registers; AVX2 and SSE2: 12 + 3 + 1 of 16).
#if KVP_CPU_TU_ISA == 2
inline constexpr int kRows = 6, kVecs = 4;
#else
inline constexpr int kRows = 4, kVecs = 3;
#endif
// Tile of one query vector (a few queries, e.g. TOVA's newest query of each head of a group): kRowsOne keys,
// so that the tile has enough independent accumulators to hide the FMA latency (kRows keys x 1 vector are
// kRows dependent chains: 4 on AVX2, one FMA per cycle at best). Each accumulator still sums its channels in
// order, so the logits keep their bits.
inline constexpr int kRowsOne = 12;
static_assert(WindowLayout::kChunk % kRowsOne == 0, "a chunk is whole one-vector tiles");

// ---- key rows ----------------------------------------------------------------

template <class T>
inline const T* key_row(const Rows<T>& k, std::int64_t j) noexcept {
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

// e^x for the softmax: Cody-Waite reduction by ln 2 and a degree-7
// polynomial (Cephes' expf), about 1 ulp on [-87, 88]. Arguments below -87
// give exactly 0, so no result is a denormal (denormals would cost microcode
// assists in the sums and products that follow); arguments above 88 are clamped (the callers' arguments are at
// most 0: a logit minus its chunk's max), NaN stays NaN (the clamps pass it through: max/min return
// their second operand when one is NaN).
inline F exp_clamped(F x) noexcept {
  const F lo(-87.0f), hi(88.0f);  // e^-87 = 1.6e-38 > 2^-126
  const F xc = xsimd::min(hi, xsimd::max(lo, x));
#if KVP_CPU_TU_ISA == 2
  // AVX-512: round with vrndscaleps and scale by 2^n with vscalefps.
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const F nf(n);
#else
  // Round to an integer with the 1.5 * 2^23 trick (no float -> int conversion
  // can see a NaN or an out-of-range value).
  const F magic(12582912.0f);
  const F t = fmadd(xc, F(1.44269504088896341f), magic);
  const F nf = t - magic;
#endif
  F r = fnmadd(nf, F(0.693359375f), xc);
  r = fnmadd(nf, F(-2.12194440e-4f), r);
  F p(1.9875691500e-4f);
  p = fmadd(p, r, F(1.3981999507e-3f));
  p = fmadd(p, r, F(8.3334519073e-3f));
  p = fmadd(p, r, F(4.1665795894e-2f));
  p = fmadd(p, r, F(1.6666665459e-1f));
  p = fmadd(p, r, F(5.0000001201e-1f));
  p = fmadd(p, r, F(1.0f));  // e^r = 1 + r (1 + r P(r))
  const F y = fmadd(p, r, F(1.0f));
#if KVP_CPU_TU_ISA == 2
  const F scaled(_mm512_scalef_ps(y, n));
#else
  const I e = (xsimd::bitwise_cast<I>(t) - xsimd::bitwise_cast<I>(magic) + I(127)) << 23;
  const F scaled = y * xsimd::bitwise_cast<F>(e);
#endif
  return xsimd::select(x < lo, F(0.0f), scaled);
}

// Softmax bookkeeping (pass 1), chunk by chunk: the register tiles store the chunk's logits into p and fold
// the chunk max per query; a sweep over the chunk then turns them into p = exp(logit - chunk max) with the
// chunk sums, and records the chunk max in chunk_ref; pass 2 multiplies by exp(chunk max - row max) /
// denominator. (Computing the exps in each tile's epilogue, against the running max, saved that sweep but
// was 5-12 % slower on AVX-512: the tile cannot hide the exp's latency, while the sweep's exps pipeline.)
struct TileArgs {
  const float* key_buf;                   // (kChunk, d): the chunk's keys in fp32
  const float* qt;                        // blocks of kVecs query vectors, (d, width) each; bf16 dot: (d / 2, width) bf16 pairs
  const std::uint16_t* const* key_pairs;  // bf16 dot: (kChunk) the chunk's key rows (bf16 bits, read in pairs)
  const std::int32_t* last_visible;       // (qpad)
  float* p;                               // (kv_len, pw)
  float* cur_max;                         // (pw): max of the current chunk
  std::int64_t pw;                        // row stride of p: the query vectors computed (nv), in floats
  std::int64_t d, q_pos0;
  std::int64_t j;  // absolute index of the tile's first key
  std::int64_t r;  // row of the tile's first key in key_buf
  std::int64_t v;  // first query vector of the tile
  float scale;
};

// Logits of kRows keys x V query vectors: broadcast one key element, FMA
// against V query vectors, over the head dimension. Then scale, causal mask,
// fold into the chunk max, and store the logits (tile_epilogue, R rows: kRows
// here, kRowsOne for logit_tile_one). A partial tile (rc < kRows
// keys, the last of a short chunk) repeats its last key in the spare rows and
// drops their results: one instantiation per V keeps the code size (and the
// compile time) small.
template <int V, int R>
inline void tile_epilogue(const TileArgs& a, int rc, F (&acc)[R][V]) noexcept;

template <int V>
inline void logit_tile(const TileArgs& a, int rc) noexcept {
  constexpr int R = kRows;
  F acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) acc[r][v] = F(0.0f);
  const float* rows[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) rows[r] = a.key_buf + (a.r + (r < rc ? r : rc - 1)) * a.d;
  // The tile's V query vectors over all channels are one contiguous block (see the query layout in
  // window_scores): the loop streams it, and it stays in L1 for the chunk's key tiles.
  const float* qt = a.qt + a.v * kLanes * a.d;
  for (std::int64_t c = 0; c < a.d; ++c) {
    F qv[V];
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) qv[v] = F::load_aligned(qt + (c * V + v) * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const F k(rows[r][c]);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) acc[r][v] = fmadd(k, qv[v], acc[r][v]);
    }
  }
  tile_epilogue<V, kRows>(a, rc, acc);
}

#if KVP_CPU_TU_ISA == 2
// The bf16 dot form (AVX512_BF16, compiled for that extension only here and run only where the CPU has it):
// per step one pair of channels, vdpbf16ps adding q[2c] k[2c] and q[2c+1] k[2c+1] (exact bf16 products, fp32
// adds) to each accumulator, the key pair broadcast straight from the bf16 row. Same register tile, half the
// steps; the epilogue is the fp32 form's.
template <int V>
__attribute__((target("avx512bf16"))) void logit_tile_dot(const TileArgs& a, int rc) noexcept {
  constexpr int R = kRows;
  __m512 acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  const std::uint16_t* rows[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) rows[r] = a.key_pairs[a.r + (r < rc ? r : rc - 1)];
  const std::int64_t pairs = a.d / 2;
  const auto* qt = reinterpret_cast<const std::uint32_t*>(a.qt) + a.v * kLanes * pairs;  // the tile's block, as logit_tile
  for (std::int64_t c = 0; c < pairs; ++c) {
    __m512bh qv[V];
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) qv[v] = (__m512bh)_mm512_load_si512(qt + (c * V + v) * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const auto k = (__m512bh)_mm512_broadcastd_epi32(_mm_loadu_si32(rows[r] + 2 * c));  // rows need no alignment
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], k, qv[v]);
    }
  }
  F out[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) out[r][v] = F(acc[r][v]);
  tile_epilogue<V, kRows>(a, rc, out);
}
#endif

template <int V, int R>
inline void tile_epilogue(const TileArgs& a, int rc, F (&acc)[R][V]) noexcept {
  const F scale(a.scale);
  F m[V];
#pragma GCC unroll 32
  for (int v = 0; v < V; ++v) m[v] = F::load_aligned(a.cur_max + (a.v + v) * kLanes);
  // Only keys after q_pos0 are hidden from some query of the window.
  const bool masked = a.j + rc - 1 > a.q_pos0;
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r) {
    if (r >= rc) break;
    float* prow = a.p + (a.j + r) * a.pw + a.v * kLanes;
    const I key_index(static_cast<std::int32_t>(a.j + r));
#pragma GCC unroll 32
    for (int v = 0; v < V; ++v) {
      F l = acc[r][v] * scale;
      if (masked) {
        const I lv = I::load_aligned(a.last_visible + (a.v + v) * kLanes);
        l = xsimd::select(xsimd::bool_cast(key_index <= lv), l, F(-kInf));
      }
      m[v] = xsimd::max(m[v], l);
      l.store_aligned(prow + v * kLanes);
    }
  }
#pragma GCC unroll 32
  for (int v = 0; v < V; ++v) m[v].store_aligned(a.cur_max + (a.v + v) * kLanes);
}

// The one-vector tile: kRowsOne keys x 1 query vector, the rows kRowsOne consecutive rows of key_buf from a.r
// (all present: the caller repeats the last key into the spare rows of a partial tile; their results are
// dropped). The rows are written as four bases (rows 0, 3, 6, 9) plus 0, 1, 2, 4 or 8 row strides: with an
// array of twelve row pointers GCC's inner loop reloaded some of them from the stack; with this form it does not.
// Not inlined: inlined into window_scores on the AVX-512 level, GCC kept some row pointers in vector registers
// and on the stack and moved them back into the loop's address registers every step (an Ice Lake Xeon: TOVA's
// decision at 32K tokens 5 % slower on AVX-512, 6 % on AVX2).
__attribute__((noinline)) inline void logit_tile_one(const TileArgs& a, int rc) noexcept {
  constexpr int R = kRowsOne;
  static_assert(R == 12, "the base / stride map below covers 12 rows");
  constexpr int kBase[R] = {0, 0, 0, 1, 0, 1, 2, 1, 0, 3, 2, 1};  // row r = base row 3 kBase[r] + kStep[r]
  constexpr int kStep[R] = {0, 1, 2, 0, 4, 2, 0, 4, 8, 0, 4, 8};
  F acc[R];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r) acc[r] = F(0.0f);
  const auto stride = static_cast<std::ptrdiff_t>(a.d * static_cast<std::int64_t>(sizeof(float)));
  const char* base[4];
#pragma GCC unroll 4
  for (int b = 0; b < 4; ++b) base[b] = reinterpret_cast<const char*>(a.key_buf + (a.r + 3 * b) * a.d);
  const float* qt = a.qt + a.v * kLanes * a.d;
  for (std::int64_t c = 0; c < a.d; ++c) {
    const F qv = F::load_aligned(qt + c * kLanes);
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      const F k(*reinterpret_cast<const float*>(base[kBase[r]] + kStep[r] * stride));
      acc[r] = fmadd(k, qv, acc[r]);
    }
#pragma GCC unroll 4
    for (int b = 0; b < 4; ++b) base[b] += sizeof(float);
  }
  F out[R][1];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r) out[r][0] = acc[r];
  tile_epilogue<1, R>(a, rc, out);
}

// Picks the tile instantiation for the last query vectors (vc <= V).
template <bool kDot, int V>
inline void dispatch_tile(int vc, int rc, const TileArgs& a) noexcept {
  if constexpr (V > 1) {
    if (vc < V) return dispatch_tile<kDot, V - 1>(vc, rc, a);
  }
#if KVP_CPU_TU_ISA == 2
  if constexpr (kDot) return logit_tile_dot<V>(a, rc);
#endif
  logit_tile<V>(a, rc);
}

// All tiles of one chunk (nr keys starting at key j0, already in key_buf; bf16 dot: their rows in key_pairs).
template <bool kDot>
inline void chunk_tiles(TileArgs& a, std::int64_t j0, std::int64_t nr, std::int64_t nv) noexcept {
  for (std::int64_t i = 0; i < a.pw; ++i) a.cur_max[i] = -kInf;
  for (std::int64_t v0 = 0; v0 < nv; v0 += kVecs) {
    a.v = v0;
    const int vc = static_cast<int>(nv - v0 < kVecs ? nv - v0 : kVecs);
    for (std::int64_t r0 = 0; r0 < nr; r0 += kRows) {
      a.r = r0;
      a.j = j0 + r0;
      const int rc = static_cast<int>(nr - r0 < kRows ? nr - r0 : kRows);
      dispatch_tile<kDot, kVecs>(vc, rc, a);
    }
  }
}

// bf16 bits of f, rounded to nearest even (NaN stays a quiet NaN): the queries of the bf16 dot form.
inline std::uint32_t bf16_bits_rne(float f) noexcept {
  std::uint32_t x = 0;
  std::memcpy(&x, &f, sizeof x);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (x >> 16) | 0x40u;
  return (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
}

// kDot: bf16 keys through logit_tile_dot (AVX-512 with AVX512_BF16 only; d even), the queries rounded to bf16.
template <class Tk, bool kDot = false>
void window_scores(const WindowScoreShape& s, const float* q, Rows<Tk> keys, float* out, const WindowScratch& ws) noexcept {
  const std::int64_t G = s.group, w = s.window, d = s.head_dim, T = s.kv_len, L = s.num_cols;
  // nv: the query vectors that hold a query. The rows past them up to qpad (the layout's padding to AVX-512's
  // 16 lanes) are never computed: each lane's logits, exps and sums are its own, and padding rows reach no
  // output. A few queries (TOVA: the newest query of each of a group's 4 heads) then take one vector of tiles
  // where the padding took two (AVX2) or four (SSE2), with the same bits for every real query.
  const std::int64_t Q = ws.layout.num_q, qpad = ws.layout.qpad, nv = (Q + kLanes - 1) / kLanes;
  // p's rows hold the computed vectors only (nv kLanes <= qpad floats): TOVA's 4 queries write and read back
  // 32 bytes per key on AVX2 instead of a 64-byte row of which half was padding.
  const std::int64_t pw = nv * kLanes;
  constexpr std::int64_t kChunk = WindowLayout::kChunk;
  for (std::int64_t i = 0; i < G * L; ++i) out[i] = 0.0f;
  if (Q <= 0 || T <= 0) return;

  // Queries transposed, one query row per SIMD lane, in blocks of the register tile's kVecs vectors (the last
  // block narrower): block b holds vectors v0 = b kVecs .. v0 + width - 1 as (channels, width x kLanes) at
  // qt + v0 kLanes channels. A tile then reads one contiguous block; with a (d, qpad) layout its rows were
  // qpad floats apart, and at qpad = 128 the 32 KiB a tile reads fell into half of the L1's sets. The bf16 dot
  // form stores, in the same layout, bf16 pairs of channels (channels = d / 2, one 32-bit pair per lane).
  const std::int64_t chans = kDot ? d / 2 : d;
  for (std::int64_t v0 = 0; v0 < nv; v0 += kVecs) {
    const std::int64_t width = (nv - v0 < kVecs ? nv - v0 : kVecs) * kLanes;
    for (std::int64_t c = 0; c < chans; ++c)
      for (std::int64_t x = 0; x < width; ++x) {
        const std::int64_t r = v0 * kLanes + x, at = v0 * kLanes * chans + c * width + x;
        if constexpr (kDot)
          reinterpret_cast<std::uint32_t*>(ws.qt)[at] =
              r < Q ? bf16_bits_rne(q[r * d + 2 * c]) | (bf16_bits_rne(q[r * d + 2 * c + 1]) << 16) : 0u;
        else
          ws.qt[at] = r < Q ? q[r * d + c] : 0.0f;
      }
  }
  // Causal visibility: window query i of every head sees keys j <= q_pos0 + i.
  for (std::int64_t r = 0; r < qpad; ++r) {
    std::int64_t last = r < Q ? s.q_pos0 + r % w : INT32_MAX;
    last = last > INT32_MAX ? INT32_MAX : (last < INT32_MIN ? INT32_MIN : last);
    ws.last_visible[r] = static_cast<std::int32_t>(last);
    ws.row_max[r] = -kInf;
  }

  // Pass 1, chunk by chunk: keys widened (or copied) into an L1-resident
  // buffer, the logits, then p = exp(logit - chunk max) with the chunk sums.
  // bf16 dot: the chunk's key row pointers in the key buffer's place (kChunk pointers fit in kChunk x d floats).
  auto* key_pairs = reinterpret_cast<const std::uint16_t**>(ws.key_buf);
  TileArgs a{ws.key_buf, ws.qt, key_pairs, ws.last_visible, ws.p, ws.cur_max, pw, d, s.q_pos0, 0, 0, 0, s.scale};
  const auto load_rows = [&](std::int64_t j0, std::int64_t r0, std::int64_t r1) {
    for (std::int64_t r = r0; r < r1; ++r) {
      if constexpr (kDot) {
        key_pairs[r] = reinterpret_cast<const std::uint16_t*>(key_row(keys, j0 + r));
      } else if constexpr (std::is_same_v<Tk, float>) {
        std::memcpy(ws.key_buf + r * d, key_row(keys, j0 + r), static_cast<std::size_t>(d) * sizeof(float));
      } else {
        widen_row(key_row(keys, j0 + r), d, ws.key_buf + r * d);
      }
    }
  };
  // Keys one chunk ahead of rows [r0, r1) are requested, so that their widening finds them in cache instead of
  // waiting on memory; into L1, or into L2 where the caller passes std::true_type.
  const auto prefetch_ahead = [&](std::int64_t j0, std::int64_t r0, std::int64_t r1, auto to_l2) {
    for (std::int64_t r = j0 + kChunk + r0, end = std::min(T, j0 + kChunk + r1); r < end; ++r) {
      prefetch_lines<decltype(to_l2)::value>(key_row(keys, r), d * static_cast<std::int64_t>(sizeof(Tk)));
    }
  };
  for (std::int64_t ch = 0; ch * kChunk < T; ++ch) {
    const std::int64_t j0 = ch * kChunk, nr = T - j0 < kChunk ? T - j0 : kChunk;
    if (!kDot && nv == 1) {
      // One query vector (a few queries, e.g. TOVA's): each tile's kRowsOne keys are widened just before the
      // tile, which then reads them from L1, and the next chunk's keys are requested into L2 a tile at a time.
      // The tile does too little work per key to hide a whole chunk's widening: 60 widened rows (30 KB at
      // d = 128) plus their fp16 source overflow a 32 KB L1, and the tile read its first rows back from L2.
      // Requests into L1 instead of L2 measured 12-15 % slower at T = 32K.
      for (std::int64_t i = 0; i < kLanes; ++i) ws.cur_max[i] = -kInf;
      a.v = 0;
      for (std::int64_t r0 = 0; r0 < nr; r0 += kRowsOne) {
        const std::int64_t r1 = std::min(nr, r0 + kRowsOne);
        load_rows(j0, r0, r1);
        for (std::int64_t r = r1; r < r0 + kRowsOne; ++r) {  // a partial tile's spare rows: the last key again
          std::memcpy(ws.key_buf + r * d, ws.key_buf + (r1 - 1) * d, static_cast<std::size_t>(d) * sizeof(float));
        }
        prefetch_ahead(j0, r0, r0 + kRowsOne, std::true_type{});
        a.r = r0;
        a.j = j0 + r0;
        logit_tile_one(a, static_cast<int>(r1 - r0));
      }
    } else {
      load_rows(j0, 0, nr);
      prefetch_ahead(j0, 0, kChunk, std::false_type{});  // the tiles of this chunk take far longer than the requests
      chunk_tiles<kDot>(a, j0, nr, nv);
    }
    float* cref = ws.chunk_ref + ch * qpad;
    float* csum = ws.chunk_sum + ch * qpad;
    for (std::int64_t v = 0; v < nv; ++v) {
      const F m = F::load_aligned(ws.cur_max + v * kLanes);
      const F base = xsimd::select(m == F(-kInf), F(0.0f), m);  // fully masked: exp(-inf) = 0
      F sum(0.0f);
      float* pp = ws.p + j0 * pw + v * kLanes;
      for (std::int64_t r = 0; r < nr; ++r, pp += pw) {
        const F e = exp_clamped(F::load_aligned(pp) - base);
        e.store_aligned(pp);
        sum += e;
      }
      sum.store_aligned(csum + v * kLanes);
      m.store_aligned(cref + v * kLanes);
    }
    for (std::int64_t v = 0; v < nv; ++v) {
      const F m = xsimd::max(F::load_aligned(ws.row_max + v * kLanes), F::load_aligned(ws.cur_max + v * kLanes));
      m.store_aligned(ws.row_max + v * kLanes);
    }
  }

  // Softmax statistics: row_max is the max over all keys; chunk rescale
  // factors exp(ref - max) overwrite the references; denominators in double.
  const std::int64_t nch = ws.layout.num_chunks;
  for (std::int64_t r = 0; r < qpad; ++r) ws.denom[r] = 0.0;
  for (std::int64_t ch = 0; ch < nch; ++ch) {
    float* cm = ws.chunk_ref + ch * qpad;
    const float* cs = ws.chunk_sum + ch * qpad;
    for (std::int64_t v = 0; v < nv; ++v) {
      const F m = F::load_aligned(cm + v * kLanes);
      const F e = xsimd::select(m == F(-kInf), F(0.0f), exp_clamped(m - F::load_aligned(ws.row_max + v * kLanes)));
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
      const F f = F::load_aligned(ws.chunk_ref + ch * qpad + v * kLanes) * F::load_aligned(ws.inv_denom + v * kLanes);
      f.store_aligned(ws.factor + v * kLanes);
    }
    if (whole_vectors) {
      const std::int64_t vph = w / kLanes;  // vectors per head
      for (std::int64_t j = j0; j < j1; ++j) {
        const float* pr = ws.p + j * pw;
        for (std::int64_t g = 0; g < G; ++g) {
          const float* pg = pr + g * w;
          const float* fg = ws.factor + g * w;
          F acc = F::load_aligned(pg) * F::load_aligned(fg);
          for (std::int64_t v = 1; v < vph; ++v) acc = fmadd(F::load_aligned(pg + v * kLanes), F::load_aligned(fg + v * kLanes), acc);
          out[g * L + j] = xsimd::hadd(acc);
        }
      }
    } else if (w == 1) {
      // One query per head (TOVA): the head's score is its query's weight p x factor, which the sum below would
      // add to 0.0f, and 0 + x is x here (x >= +0 or NaN: p and the factors are exps and their products).
      for (std::int64_t j = j0; j < j1; ++j) {
        const float* pr = ws.p + j * pw;
        for (std::int64_t g = 0; g < G; ++g) out[g * L + j] = pr[g] * ws.factor[g];
      }
    } else {
      for (std::int64_t j = j0; j < j1; ++j) {
        const float* pr = ws.p + j * pw;
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

// Outputs with complete windows, as ScalarScoreOps::pool1d computes them: avg
// sums each window in ascending order of value from 0.0f (a sorting network of
// min / max over the window's vectors for kernels up to kPoolNet, the scalar
// `ascending_sum` per output above that), NaN if the window holds one, and
// divides by the kernel; max keeps the first element unless a later one
// compares greater or the running value is NaN.
inline constexpr int kPoolNet = 15;

// One vector of outputs per iteration for a kernel of K (a compile-time size,
// so the window's K vectors stay in registers).
template <int K>
inline void pool_avg_sorted(const float* in, float* out, std::int64_t& t, std::int64_t t1) noexcept {
  constexpr std::int64_t r = K / 2;
  const F div(static_cast<float>(K)), qnan(std::numeric_limits<float>::quiet_NaN());
  for (; t + kLanes <= t1; t += kLanes) {
    F x[K];
    auto nan = xsimd::batch_bool<float, Arch>(false);
    for (int u = 0; u < K; ++u) {
      x[u] = F::load_unaligned(in + t - r + u);
      nan = nan | xsimd::isnan(x[u]);
    }
    // Odd-even transposition sort: K rounds sort any input. Without NaN
    // (handled by the mask) min / max are exact, so every lane ends ascending.
    for (int round = 0; round < K; ++round)
      for (int i = round & 1; i + 1 < K; i += 2) {
        const F lo = xsimd::min(x[i], x[i + 1]), hi = xsimd::max(x[i], x[i + 1]);
        x[i] = lo;
        x[i + 1] = hi;
      }
    F acc(0.0f);
    for (int u = 0; u < K; ++u) acc += x[u];
    xsimd::select(nan, qnan, acc / div).store_unaligned(out + t);
  }
}

inline void pool1d_full(const float* in, int kernel, Pooling kind, float* out, std::int64_t t0, std::int64_t t1) noexcept {
  const std::int64_t r = kernel / 2;
  std::int64_t t = t0;
  if (kind == Pooling::kAvg) {
    switch (kernel) {
      case 3: pool_avg_sorted<3>(in, out, t, t1); break;
      case 5: pool_avg_sorted<5>(in, out, t, t1); break;
      case 7: pool_avg_sorted<7>(in, out, t, t1); break;
      case 9: pool_avg_sorted<9>(in, out, t, t1); break;
      case 11: pool_avg_sorted<11>(in, out, t, t1); break;
      case 13: pool_avg_sorted<13>(in, out, t, t1); break;
      case 15: pool_avg_sorted<kPoolNet>(in, out, t, t1); break;
      default: break;  // larger kernels: per output below
    }
    for (; t < t1; ++t) out[t] = kvpolicy::detail::ascending_sum(in, t - r, t + r) / static_cast<float>(kernel);
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

// ---- top-k kernels ---------------------------------------------------------------
//
// Order keys are the signed form of `score_order_key`: the float's bits with
// the magnitude bits flipped for negatives (so integer order is IEEE order,
// -0 < +0), NaN mapped to INT32_MIN (no number maps there).

inline constexpr std::int32_t kNanKey = INT32_MIN;

inline std::int32_t order_key(float f) noexcept {
  std::int32_t i;
  std::memcpy(&i, &f, sizeof i);
  const std::int32_t k = i ^ ((i >> 31) & 0x7fffffff);
  return f != f ? kNanKey : k;
}

// Candidate collection, 64 scores at a time: the compares produce one 64-bit
// word per 64 scores, whose set bits are turned into indices at once. This
// beats compressing every vector: only the ~1-2% of scores above the threshold
// cost more than a compare. (Words were once staged 64 at a time and turned
// into indices in a second loop; emitting each word as it is made measured the
// same or up to 7 % faster on AVX2 for 32 x 131072 scores, 2026-12-07.)

// The lanes of the vector at p that are >= thr (ordered compare: NaN fails), as the low kLanes bits.
#if KVP_CPU_TU_ISA == 2
inline std::uint64_t ge_lanes(const float* p, __m512 thr) noexcept {
  return _cvtmask16_u32(_mm512_cmp_ps_mask(_mm512_loadu_ps(p), thr, _CMP_GE_OQ));
}
inline __m512 broadcast_threshold(float t) noexcept { return _mm512_set1_ps(t); }
#elif KVP_CPU_TU_ISA == 1
inline std::uint64_t ge_lanes(const float* p, __m256 thr) noexcept {
  return static_cast<std::uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p), thr, _CMP_GE_OQ)));
}
inline __m256 broadcast_threshold(float t) noexcept { return _mm256_set1_ps(t); }
#else
inline std::uint64_t ge_lanes(const float* p, __m128 thr) noexcept {
  return static_cast<std::uint32_t>(_mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(p), thr)));
}
inline __m128 broadcast_threshold(float t) noexcept { return _mm_set1_ps(t); }
#endif

// The masks of `count` consecutive vectors at p (count * kLanes <= 64) in one word, vector q at bit q * kLanes.
template <class T>
inline std::uint64_t ge_vectors(const float* p, std::int64_t count, T thr) noexcept {
  std::uint64_t w = 0;
#pragma GCC unroll 16
  for (std::int64_t q = 0; q < count; ++q) w |= ge_lanes(p + q * kLanes, thr) << (q * kLanes);
  return w;
}

// The word of 64 scores at s.
#if KVP_CPU_TU_ISA == 2
inline std::uint64_t ge_word(const float* s, __m512 thr) noexcept {
  // The four masks joined in mask registers: one move to a general register per word instead of four.
  const __mmask16 k0 = _mm512_cmp_ps_mask(_mm512_loadu_ps(s), thr, _CMP_GE_OQ);
  const __mmask16 k1 = _mm512_cmp_ps_mask(_mm512_loadu_ps(s + 16), thr, _CMP_GE_OQ);
  const __mmask16 k2 = _mm512_cmp_ps_mask(_mm512_loadu_ps(s + 32), thr, _CMP_GE_OQ);
  const __mmask16 k3 = _mm512_cmp_ps_mask(_mm512_loadu_ps(s + 48), thr, _CMP_GE_OQ);
  return _cvtmask64_u64(_mm512_kunpackd(_mm512_kunpackw(k3, k2), _mm512_kunpackw(k1, k0)));
}
#elif KVP_CPU_TU_ISA == 1
// Four compares' all-ones lanes narrowed to bytes by two packs, which interleave the vectors' 128-bit halves
// (dwords: v0 low, v1 low, v2 low, v3 low | v0 high, ...); one dword permute restores score order, so a
// word takes two byte movemasks instead of eight.
inline __m256i ge_bytes4(const float* s, __m256 thr) noexcept {
  const auto c = [&](int i) { return _mm256_castps_si256(_mm256_cmp_ps(_mm256_loadu_ps(s + 8 * i), thr, _CMP_GE_OQ)); };
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(c(0), c(1)), _mm256_packs_epi32(c(2), c(3)));
  return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
inline std::uint64_t ge_word(const float* s, __m256 thr) noexcept {
  const auto lo = static_cast<std::uint32_t>(_mm256_movemask_epi8(ge_bytes4(s, thr)));
  const auto hi = static_cast<std::uint32_t>(_mm256_movemask_epi8(ge_bytes4(s + 32, thr)));
  return lo | static_cast<std::uint64_t>(hi) << 32;
}
#else
template <class T>
inline std::uint64_t ge_word(const float* s, T thr) noexcept {
  return ge_vectors(s, 64 / kLanes, thr);
}
#endif

// Sparse rows (the caller expects at most 1 score in kSparse to pass) test each 64-score word through the
// max of its four vectors first (NaN skipped; NaN never passes the ordered compare): one compare instead of
// four, and the word's four masks only when some score passes. Dense rows take every word's masks.
inline constexpr std::int64_t kSparse = 20;

// Appends base + (each set bit of w), ascending, at out[m] and advances m by the bit count. The first F
// indices are stored without a branch (the stores past the count land in the output's slack and are
// overwritten by later ones; ctz of w | 2^63 is defined when w is 0); only words with more than F bits loop.
// A loop per word instead mispredicts its exit about once per word that holds candidates.
template <int F>
inline void emit_bits(std::uint64_t w, std::int32_t base, std::int32_t* out, std::int64_t& m) noexcept {
  const auto c = static_cast<std::int64_t>(__builtin_popcountll(w));
  std::int32_t* o = out + m;
#pragma GCC unroll 8
  for (int j = 0; j < F; ++j) {
    o[j] = base + __builtin_ctzll(w | (std::uint64_t{1} << 63));
    w &= w - 1;
  }
  if (c > F) [[unlikely]] {
    for (o += F; w != 0; w &= w - 1) *o++ = base + __builtin_ctzll(w);
  }
  m += c;
}

// The dense scan of collect_at_least from score i0 on, a word at a time.
template <int F, class T>
inline std::int64_t collect_words(const float* s, std::int64_t n, std::int64_t i0, float threshold, T thr, std::int32_t* out,
                                  std::int64_t m) noexcept {
  for (; i0 + 64 <= n; i0 += 64) emit_bits<F>(ge_word(s + i0, thr), static_cast<std::int32_t>(i0), out, m);
  // The last < 64 scores: whole vectors into one word, then the < kLanes rest one by one.
  const std::int64_t t0 = n / 64 * 64, tv = (n - t0) / kLanes;
  emit_bits<F>(ge_vectors(s + t0, tv, thr), static_cast<std::int32_t>(t0), out, m);
  for (std::int64_t i = t0 + tv * kLanes; i < n; ++i) {
    out[m] = static_cast<std::int32_t>(i);
    m += s[i] >= threshold ? 1 : 0;
  }
  return m;
}

inline std::int64_t collect_at_least(const float* s, std::int64_t n, float threshold, std::int64_t expected, std::int32_t* out) noexcept {
  const auto thr = broadcast_threshold(threshold);
  std::int64_t m = 0, i0 = 0;
#if KVP_CPU_TU_ISA == 2
  if (expected * kSparse <= n) {
    const __m512 ninf = _mm512_set1_ps(-kInf);
    for (; i0 + 64 <= n; i0 += 64) {
      const __m512 a = _mm512_loadu_ps(s + i0), b = _mm512_loadu_ps(s + i0 + 16);
      const __m512 c = _mm512_loadu_ps(s + i0 + 32), d = _mm512_loadu_ps(s + i0 + 48);
      // max(x, acc) returns acc when x is NaN: a chain from -inf skips NaN.
      const __m512 mx = _mm512_max_ps(d, _mm512_max_ps(c, _mm512_max_ps(b, _mm512_max_ps(a, ninf))));
      if (_mm512_cmp_ps_mask(mx, thr, _CMP_GE_OQ) == 0) continue;
      const __mmask32 lo = _mm512_kunpackw(_mm512_cmp_ps_mask(b, thr, _CMP_GE_OQ), _mm512_cmp_ps_mask(a, thr, _CMP_GE_OQ));
      const __mmask32 hi = _mm512_kunpackw(_mm512_cmp_ps_mask(d, thr, _CMP_GE_OQ), _mm512_cmp_ps_mask(c, thr, _CMP_GE_OQ));
      const auto base = static_cast<std::int32_t>(i0);
      for (std::uint64_t bits = _cvtmask64_u64(_mm512_kunpackd(hi, lo)); bits != 0; bits &= bits - 1)
        out[m++] = base + __builtin_ctzll(bits);
    }
  }
#endif
  // Branch-free stores per word sized to the expected bits per word (2 up to 1.5 on average, then 4, then 8).
  const std::int64_t twice_per_word = n > 0 ? expected * 128 / n : 0;
  if (twice_per_word <= 3) return collect_words<2>(s, n, i0, threshold, thr, out, m);
  if (twice_per_word <= 7) return collect_words<4>(s, n, i0, threshold, thr, out, m);
  return collect_words<8>(s, n, i0, threshold, thr, out, m);
}

// Order keys of whole vectors of scores.
#if KVP_CPU_TU_ISA == 2
inline __m512i order_keys(__m512 f) noexcept {
  const __m512i i = _mm512_castps_si512(f);
  const __m512i k = _mm512_xor_si512(i, _mm512_and_si512(_mm512_srai_epi32(i, 31), _mm512_set1_epi32(0x7fffffff)));
  return _mm512_mask_mov_epi32(k, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(kNanKey));
}
#elif KVP_CPU_TU_ISA == 1
inline __m256i order_keys(__m256 f) noexcept {
  const __m256i i = _mm256_castps_si256(f);
  const __m256i k = _mm256_xor_si256(i, _mm256_and_si256(_mm256_srai_epi32(i, 31), _mm256_set1_epi32(0x7fffffff)));
  return _mm256_blendv_epi8(k, _mm256_set1_epi32(kNanKey), _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
}
#endif

// keys[i] = order key of the i-th score, i < m, and their min / max; `vec(i)`
// loads the scores i .. i + lanes - 1 as one vector, `one(i)` the i-th alone.
// One body for the gathered (candidates) and the contiguous (whole row) forms.
template <class Vec, class One>
inline void keys_min_max(std::int64_t m, Vec&& vec, One&& one, std::int32_t* keys, std::int32_t* lo, std::int32_t* hi) noexcept {
  std::int64_t i = 0;
  std::int32_t a = INT32_MAX, b = INT32_MIN;
#if KVP_CPU_TU_ISA == 2
  __m512i vlo = _mm512_set1_epi32(INT32_MAX), vhi = _mm512_set1_epi32(INT32_MIN);
  for (; i + 16 <= m; i += 16) {
    const __m512i k = order_keys(vec(i));
    _mm512_storeu_si512(keys + i, k);
    vlo = _mm512_min_epi32(vlo, k);
    vhi = _mm512_max_epi32(vhi, k);
  }
  a = _mm512_reduce_min_epi32(vlo);
  b = _mm512_reduce_max_epi32(vhi);
#elif KVP_CPU_TU_ISA == 1
  __m256i vlo = _mm256_set1_epi32(INT32_MAX), vhi = _mm256_set1_epi32(INT32_MIN);
  for (; i + 8 <= m; i += 8) {
    const __m256i k = order_keys(vec(i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(keys + i), k);
    vlo = _mm256_min_epi32(vlo, k);
    vhi = _mm256_max_epi32(vhi, k);
  }
  a = hmin_i32(vlo);
  b = hmax_i32(vhi);
#else
  (void)vec;
#endif
  for (; i < m; ++i) {
    keys[i] = order_key(one(i));
    a = keys[i] < a ? keys[i] : a;
    b = keys[i] > b ? keys[i] : b;
  }
  *lo = a;
  *hi = b;
}

// keys[i] = order key of scores[idx[i]] (a gather per vector), and their min / max.
inline void gather_keys(const float* scores, const std::int32_t* idx, std::int64_t m, std::int32_t* keys, std::int32_t* lo,
                        std::int32_t* hi) noexcept {
  keys_min_max(
      m,
      [&](std::int64_t i) {
#if KVP_CPU_TU_ISA == 2
        return _mm512_i32gather_ps(_mm512_loadu_si512(idx + i), scores, 4);
#elif KVP_CPU_TU_ISA == 1
        return _mm256_i32gather_ps(scores, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx + i)), 4);
#else
        return scores[idx[i]];
#endif
      },
      [&](std::int64_t i) { return scores[idx[i]]; }, keys, lo, hi);
}

// keys[i] = order key of scores[i] for i < n (every score a candidate: contiguous loads, no gather), and their min / max.
inline void load_keys(const float* s, std::int64_t n, std::int32_t* keys, std::int32_t* lo, std::int32_t* hi) noexcept {
  keys_min_max(
      n,
      [&](std::int64_t i) {
#if KVP_CPU_TU_ISA == 2
        return _mm512_loadu_ps(s + i);
#elif KVP_CPU_TU_ISA == 1
        return _mm256_loadu_ps(s + i);
#else
        return s[i];
#endif
      },
      [&](std::int64_t i) { return s[i]; }, keys, lo, hi);
}

// Top-k's threshold for short rows: the maxima of disjoint blocks that cover scores[0, n), about `target` of
// them, plus one block for the < kLanes trailing scores. Writes the signed order key of each block's largest
// number and returns the block count (about target; at most n / kLanes + 1). A block maximum is a score
// of the row, except for a block of NaN alone, which reports -inf's key: the caller takes a threshold above
// -inf only. One max per loaded vector (the max returns its second operand when the first is NaN, so a chain
// from -inf skips NaN), so the pass runs at the speed of a read pass. Two layouts, by the vectors per block
// (block_vectors):
//  - words:  blocks of whole 64-score words or more (few blocks: small k) are runs of consecutive vectors,
//            reduced across lanes (kLanes blocks at a time through lane_reduce.hpp's tree, one by one on
//            SSE2): collect_in_blocks then reads only the
//            blocks whose maximum reaches the cut;
//  - lanes:  smaller blocks are one lane of a run of vectors (kLanes blocks per run, no reduction across
//            lanes); collect_in_blocks reads the whole row.
inline constexpr std::int64_t kWordVecs = 64 / kLanes;  // vectors per 64-score word
// Vectors per block: the nearest to nvec / target, and in the word layout (kWordVecs and up) the nearest whole
// number of words, so that a block's loops run over whole words with nothing left over.
inline std::int64_t block_vectors(std::int64_t nvec, std::int64_t target) noexcept {
  const std::int64_t per = target > 0 ? (nvec + target / 2) / target : nvec;  // the nearest to nvec / target
  if (per < kWordVecs) return per < 1 ? 1 : per;
  return (per + kWordVecs / 2) / kWordVecs * kWordVecs;
}

// max(x, acc) that returns acc where x is NaN: the max instruction's operand rule (xsimd::max does not promise it).
inline F max_skip_nan(F x, F acc) noexcept {
#if KVP_CPU_TU_ISA == 2
  return F(_mm512_max_ps(x, acc));
#elif KVP_CPU_TU_ISA == 1
  return F(_mm256_max_ps(x, acc));
#else
  return F(_mm_max_ps(x, acc));
#endif
}

// The NaN-skipping maximum of `words` whole 64-score words at p (a vector of -inf where all are NaN): four
// chains, one max per loaded vector plus three to join them; the word's vectors unrolled, so a block of one
// word (the top-k's usual block on AVX2) is straight-line code.
inline F words_max(const float* p, std::int64_t words) noexcept {
  F a[4] = {F(-kInf), F(-kInf), F(-kInf), F(-kInf)};
  for (std::int64_t w = 0; w < words; ++w, p += 64) {
#pragma GCC unroll 16
    for (std::int64_t j = 0; j < kWordVecs; ++j) a[j % 4] = max_skip_nan(F::load_unaligned(p + j * kLanes), a[j % 4]);
  }
  return max_skip_nan(max_skip_nan(a[0], a[1]), max_skip_nan(a[2], a[3]));  // no NaN left: operand order is free
}

// The NaN-skipping maximum of the vectors v0 .. v1 - 1 (a vector of -inf where all are NaN), four chains.
inline F vectors_max(const float* s, std::int64_t v0, std::int64_t v1) noexcept {
  F a0(-kInf), a1 = a0, a2 = a0, a3 = a0;
  std::int64_t v = v0;
  for (; v + 4 <= v1; v += 4) {
    a0 = max_skip_nan(F::load_unaligned(s + v * kLanes), a0);
    a1 = max_skip_nan(F::load_unaligned(s + (v + 1) * kLanes), a1);
    a2 = max_skip_nan(F::load_unaligned(s + (v + 2) * kLanes), a2);
    a3 = max_skip_nan(F::load_unaligned(s + (v + 3) * kLanes), a3);
  }
  for (; v < v1; ++v) a0 = max_skip_nan(F::load_unaligned(s + v * kLanes), a0);
  return max_skip_nan(max_skip_nan(a0, a1), max_skip_nan(a2, a3));  // no NaN left: operand order is free
}

inline void store_keys(F m, std::int32_t* out) noexcept {
#if KVP_CPU_TU_ISA == 2
  _mm512_storeu_si512(out, order_keys(m));
#elif KVP_CPU_TU_ISA == 1
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), order_keys(m));
#else
  alignas(64) float lane[kLanes];
  m.store_aligned(lane);
  for (std::int64_t l = 0; l < kLanes; ++l) out[l] = order_key(lane[l]);
#endif
}

inline std::int64_t block_max_keys(const float* s, std::int64_t n, std::int64_t target, std::int32_t* out) noexcept {
  const std::int64_t nvec = n / kLanes;
  std::int64_t nb = 0;
  if (nvec > 0) {
    const std::int64_t per = block_vectors(nvec, target);
    if (per >= kWordVecs) {
      const std::int64_t blocks = (nvec + per - 1) / per;
#if KVP_CPU_TU_ISA >= 1
      // kLanes blocks at a time through the transposing tree (lane_reduce.hpp). Groups of whole blocks run
      // words_max; the last group (fewer blocks, or a block short of per vectors) is padded with -inf (out has
      // slack). The general form for every group cost twice a read pass (AVX2, 8191 scores in blocks of one
      // word: 0.9 us against 0.4 us; this form, 0.45 us).
      const std::int64_t words = per / kWordVecs, full = nvec / per;
      std::int64_t b = 0;
      for (; b + kLanes <= full; b += kLanes) {
        typename F::register_type v[kLanes];
#pragma GCC unroll 16
        for (std::int64_t q = 0; q < kLanes; ++q) v[q] = words_max(s + (b + q) * per * kLanes, words);
        store_keys(F(reduce_lanes<true>(v)), out + b);
      }
      if (b < blocks) {
        typename F::register_type v[kLanes];
        for (std::int64_t q = 0; q < kLanes; ++q) {
          const std::int64_t v0 = (b + q) * per, v1 = v0 + per < nvec ? v0 + per : nvec;
          v[q] = b + q < blocks ? vectors_max(s, v0, v1) : F(-kInf);
        }
        store_keys(F(reduce_lanes<true>(v)), out + b);
      }
#else
      for (std::int64_t b = 0; b < blocks; ++b) {
        const std::int64_t v0 = b * per, v1 = v0 + per < nvec ? v0 + per : nvec;
        out[b] = order_key(hmax(vectors_max(s, v0, v1)));
      }
#endif
      nb = blocks;
    } else {
      std::int64_t groups = (target + kLanes - 1) / kLanes;
      groups = groups < 1 ? 1 : (groups > nvec ? nvec : groups);
      const std::int64_t run = (nvec + groups - 1) / groups;  // vectors per run
      for (std::int64_t v0 = 0; v0 < nvec; v0 += run) {
        store_keys(vectors_max(s, v0, v0 + run < nvec ? v0 + run : nvec), out + nb);
        nb += kLanes;
      }
    }
  }
  if (n > nvec * kLanes) {
    float m = -kInf;
    for (std::int64_t i = nvec * kLanes; i < n; ++i) m = s[i] > m ? s[i] : m;  // NaN compares false
    out[nb++] = order_key(m);
  }
  return nb;
}

#if KVP_CPU_TU_ISA == 1
// AVX2 has no compress: for each 8-bit mask, the lanes of its set bits ascending, one byte each, which
// _mm256_permutevar8x32_epi32 uses to move a vector's kept lanes to its front (2 KiB, in L1 while in use).
inline constexpr std::array<std::uint64_t, 256> kPackLanes = [] {
  std::array<std::uint64_t, 256> t{};
  for (unsigned mask = 0; mask < 256; ++mask) {
    std::uint64_t v = 0;
    unsigned o = 0;
    for (unsigned l = 0; l < 8; ++l)
      if ((mask >> l) & 1u) v |= static_cast<std::uint64_t>(l) << (8 * o++);
    t[mask] = v;
  }
  return t;
}();
inline __m256i pack_kept(__m256i x, unsigned mask) noexcept {
  const __m256i perm = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(kPackLanes[mask])));
  return _mm256_permutevar8x32_epi32(x, perm);
}
inline unsigned lane_mask(__m256i keep) noexcept { return static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(keep))); }
#endif

// The positions i < m with key[i] >= t, ascending, at out (out needs kCollectSlack entries of slack); returns
// their count. A vector of keys at a time (compressed stores) instead of a store and a dependent add per key.
inline std::int64_t positions_at_least(const std::int32_t* key, std::int64_t m, std::int32_t t, std::int32_t* out) noexcept {
  std::int64_t o = 0, i = 0;
#if KVP_CPU_TU_ISA == 2
  const __m512i tv = _mm512_set1_epi32(t), step = _mm512_set1_epi32(16);
  __m512i pos = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; i + 16 <= m; i += 16, pos = _mm512_add_epi32(pos, step)) {
    const __mmask16 keep = _mm512_cmpge_epi32_mask(_mm512_loadu_si512(key + i), tv);
    _mm512_storeu_si512(out + o, _mm512_maskz_compress_epi32(keep, pos));
    o += __builtin_popcount(keep);
  }
#elif KVP_CPU_TU_ISA == 1
  const __m256i below = _mm256_set1_epi32(t - 1), step = _mm256_set1_epi32(8);  // key >= t <=> key > t - 1 (t > INT32_MIN)
  __m256i pos = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  if (t != INT32_MIN) {
    for (; i + 8 <= m; i += 8, pos = _mm256_add_epi32(pos, step)) {
      const unsigned mask = lane_mask(_mm256_cmpgt_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(key + i)), below));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + o), pack_kept(pos, mask));
      o += __builtin_popcount(mask);
    }
  }
#endif
  for (; i < m; ++i) {  // the tail (all of it on SSE2)
    out[o] = static_cast<std::int32_t>(i);
    o += key[i] >= t ? 1 : 0;
  }
  return o;
}

// The indices of the scores >= key_float(cut) (cut above -inf's key), ascending, as collect_at_least; block_keys
// (nb) are block_max_keys(s, n, target). In the word layout only the blocks whose maximum reaches the cut are
// read (listed first without a branch per block: about half of them pass at the top-k's 2k blocks); in the lane
// layout, the whole row. `list` is scratch of nb entries; out needs kCollectSlack entries of slack.
inline std::int64_t collect_in_blocks(const float* s, std::int64_t n, std::int64_t target, const std::int32_t* block_keys, std::int64_t nb,
                                      std::int32_t cut, std::int32_t* list, std::int32_t* out) noexcept {
  const float t = std::bit_cast<float>(cut ^ ((cut >> 31) & 0x7fffffff));
  const std::int64_t nvec = n / kLanes;
  const std::int64_t per = block_vectors(nvec, target);
  // Lane layout: the whole row. Its expected candidates, which size the branch-free index stores per word:
  // when the cut is the median of `target` block maxima (the top-k's k of 2k), each block holds a score at or
  // above it with probability 1/2, so a score passes with probability about ln 2 / (block size), and about
  // target ln 2 ~ 0.7 target scores pass (for scores in random order; other orders only take the stores'
  // slower path for words with more).
  if (nvec == 0 || per < kWordVecs) return collect_at_least(s, n, t, target * 7 / 10, out);
  const auto thr = broadcast_threshold(t);
  const std::int64_t whole = (nvec + per - 1) / per;  // blocks of whole vectors; block `whole` holds the trailing scores
  // The max instruction returns either zero for the pair (+0, -0), so a block holding +0 may report -0's key
  // (-1): at a cut of +0's key (0) such blocks are read too.
  const std::int32_t read_from = cut == 0 ? -1 : cut;
  const std::int64_t listed = positions_at_least(block_keys, nb, read_from, list);
  const std::int64_t words = per / kWordVecs, full = nvec / per;  // blocks of per vectors (whole words)
  std::int64_t m = 0;
  for (std::int64_t l = 0; l < listed; ++l) {
    const std::int64_t b = list[l];
    if (b < full) [[likely]] {  // whole words: no partial-word or trailing-score checks
      const float* p = s + b * per * kLanes;
      const auto base = static_cast<std::int32_t>(b * per * kLanes);
      for (std::int64_t w = 0; w < words; ++w) emit_bits<2>(ge_word(p + 64 * w, thr), base + static_cast<std::int32_t>(64 * w), out, m);
      continue;
    }
    if (b == whole) {  // the trailing scores
      for (std::int64_t i = nvec * kLanes; i < n; ++i) {
        out[m] = static_cast<std::int32_t>(i);
        m += s[i] >= t ? 1 : 0;
      }
      continue;
    }
    const std::int64_t v1 = (b + 1) * per < nvec ? (b + 1) * per : nvec;
    std::int64_t v = b * per;
    for (; v + kWordVecs <= v1; v += kWordVecs) emit_bits<2>(ge_word(s + v * kLanes, thr), static_cast<std::int32_t>(v * kLanes), out, m);
    if (v < v1) emit_bits<2>(ge_vectors(s + v * kLanes, v1 - v, thr), static_cast<std::int32_t>(v * kLanes), out, m);
  }
  return m;
}

// How many keys are >= t: one compare and one add per vector (the compare's all-ones lanes are -1), in two
// accumulators (four below AVX-512, whose vectors are narrower).
inline std::int64_t count_keys_at_least(const std::int32_t* keys, std::int64_t m, std::int32_t t) noexcept {
  if (t == INT32_MIN) return m;
  const std::int32_t below = t - 1;  // key >= t  <=>  key > t - 1
  std::int64_t i = 0, c = 0;
#if KVP_CPU_TU_ISA == 2
  const __m512i tv = _mm512_set1_epi32(below), minus1 = _mm512_set1_epi32(-1);
  __m512i a0 = _mm512_setzero_si512(), a1 = a0;
  for (; i + 32 <= m; i += 32) {
    a0 = _mm512_mask_sub_epi32(a0, _mm512_cmpgt_epi32_mask(_mm512_loadu_si512(keys + i), tv), a0, minus1);
    a1 = _mm512_mask_sub_epi32(a1, _mm512_cmpgt_epi32_mask(_mm512_loadu_si512(keys + i + 16), tv), a1, minus1);
  }
  if (i < m) {  // at most two masked vectors
    const std::int64_t r = m - i;
    const auto k0 = static_cast<__mmask16>(r >= 16 ? 0xffffu : (1u << r) - 1u);
    a0 = _mm512_mask_sub_epi32(a0, _mm512_mask_cmpgt_epi32_mask(k0, _mm512_maskz_loadu_epi32(k0, keys + i), tv), a0, minus1);
    if (r > 16) {
      const auto k1 = static_cast<__mmask16>((1u << (r - 16)) - 1u);
      a1 = _mm512_mask_sub_epi32(a1, _mm512_mask_cmpgt_epi32_mask(k1, _mm512_maskz_loadu_epi32(k1, keys + i + 16), tv), a1, minus1);
    }
    i = m;
  }
  c = _mm512_reduce_add_epi32(_mm512_add_epi32(a0, a1));
#else
  // AVX2 / SSE2: a compare gives all-ones (-1) lanes as an integer vector (batch_bool's register), subtracted.
  const I tv(below);
  I a0(0), a1(0), a2(0), a3(0);
  for (; i + 4 * kLanes <= m; i += 4 * kLanes) {
    a0 -= I((I::load_unaligned(keys + i) > tv).data);
    a1 -= I((I::load_unaligned(keys + i + kLanes) > tv).data);
    a2 -= I((I::load_unaligned(keys + i + 2 * kLanes) > tv).data);
    a3 -= I((I::load_unaligned(keys + i + 3 * kLanes) > tv).data);
  }
  for (; i + kLanes <= m; i += kLanes) a0 -= I((I::load_unaligned(keys + i) > tv).data);
  c = xsimd::hadd((a0 + a1) + (a2 + a3));
#endif
  for (; i < m; ++i) c += keys[i] > below ? 1 : 0;
  return c;
}

// The smallest of keys[0, m) that is >= t (some key is).
inline std::int32_t min_key_at_least(const std::int32_t* keys, std::int64_t m, std::int32_t t) noexcept {
  std::int64_t i = 0;
  std::int32_t r = INT32_MAX;
#if KVP_CPU_TU_ISA == 2
  const __m512i tv = _mm512_set1_epi32(t);
  __m512i a0 = _mm512_set1_epi32(INT32_MAX), a1 = a0;
  for (; i + 32 <= m; i += 32) {
    const __m512i k0 = _mm512_loadu_si512(keys + i), k1 = _mm512_loadu_si512(keys + i + 16);
    a0 = _mm512_mask_min_epi32(a0, _mm512_cmpge_epi32_mask(k0, tv), a0, k0);
    a1 = _mm512_mask_min_epi32(a1, _mm512_cmpge_epi32_mask(k1, tv), a1, k1);
  }
  r = _mm512_reduce_min_epi32(_mm512_min_epi32(a0, a1));
#else
  // Keys below t become INT32_MAX (a select through the compare's all-ones lanes), then a vertical min.
  const I tv(t), big(INT32_MAX);
  I a0(big), a1(big);
  for (; i + 2 * kLanes <= m; i += 2 * kLanes) {
    const I k0 = I::load_unaligned(keys + i), k1 = I::load_unaligned(keys + i + kLanes);
    a0 = xsimd::min(a0, xsimd::select(k0 < tv, big, k0));
    a1 = xsimd::min(a1, xsimd::select(k1 < tv, big, k1));
  }
  r = hmin_i32(xsimd::min(a0, a1));
#endif
  for (; i < m; ++i) r = (keys[i] >= t && keys[i] < r) ? keys[i] : r;
  return r;
}

// kth_largest_key for a set of at most kRankCountMax keys (1 <= rank <= m): each key's count of keys at or
// above it, by one broadcast compare per (key, vector of keys), then the largest key whose count reaches `rank`
// (*at_least: the smallest such count, which is the answer's own). Branch-free, two instructions per key and
// vector of keys: faster than both a bit-by-bit counting search, whose passes wait on each other, and std::nth_element, whose
// comparisons mispredict, for the few dozen block maxima and candidates of a row of 1K-4K scores (AVX2, 16 / 32 /
// 48 keys: 17-23 / 81-108 / 167-179 ns against nth_element's 58-84 / 98-141 / 138-189 ns).
inline constexpr std::int64_t kRankCountMax = 48;
template <int kVecs>
inline std::int32_t kth_largest_by_count_v(const std::int32_t* keys, std::int64_t m, std::int64_t rank, std::int64_t* at_least) noexcept {
  alignas(64) std::int32_t pad[kVecs * kLanes];
  // Lanes past m hold INT32_MIN: no key is below it, so their count is m (>= rank) and their key the smallest,
  // which changes neither the maximum nor the minimum count below.
  for (std::int64_t i = 0; i < kVecs * kLanes; ++i) pad[i] = i < m ? keys[i] : INT32_MIN;
  I key[kVecs], below[kVecs];  // below: minus the number of keys smaller than each lane's key
  for (int v = 0; v < kVecs; ++v) {
    key[v] = I::load_aligned(pad + v * kLanes);
    below[v] = I(0);
  }
  for (std::int64_t j = 0; j < m; ++j) {
    const I kj(keys[j]);
    for (int v = 0; v < kVecs; ++v) {
#if KVP_CPU_TU_ISA == 2  // the compare gives a mask register: subtract one in its lanes
      below[v] = _mm512_mask_sub_epi32(below[v], _mm512_cmpgt_epi32_mask(key[v], kj), below[v], _mm512_set1_epi32(1));
#else
      below[v] += I((key[v] > kj).data);  // the compare's true lanes are -1
#endif
    }
  }
  const I need(static_cast<std::int32_t>(rank - m)), none(INT32_MIN), huge(INT32_MAX);
  I best(INT32_MIN), count(INT32_MAX);
  for (int v = 0; v < kVecs; ++v) {
    const auto reach = below[v] >= need;  // m + below >= rank
    best = xsimd::max(best, xsimd::select(reach, key[v], none));
    count = xsimd::min(count, xsimd::select(reach, below[v], huge));
  }
  if (at_least != nullptr) *at_least = m + hmin_i32(count);
  return hmax_i32(best);
}
template <int kVecs = 1>
inline std::int32_t kth_largest_by_count(const std::int32_t* keys, std::int64_t m, std::int64_t rank, std::int64_t* at_least) noexcept {
  if constexpr (kVecs * kLanes < kRankCountMax) {
    if (m > kVecs * kLanes) return kth_largest_by_count<kVecs + 1>(keys, m, rank, at_least);
  }
  return kth_largest_by_count_v<kVecs>(keys, m, rank, at_least);
}

// Stable compaction of (idx, key) pairs: keeps pair i when
//   in_range:  key_lo <= key[i] < key_hi           (writes idx and key)
//   at_least:  (key[i], idx[i]) >= (key_lo, idx_lo) (writes idx only)
// and returns the count. The outputs need kCollectSlack entries of slack;
// they may alias the inputs (writes never pass reads).

inline std::int64_t keep_in_key_range(const std::int32_t* idx, const std::int32_t* key, std::int64_t m, std::int32_t key_lo,
                                      std::int64_t key_hi, std::int32_t* out_idx, std::int32_t* out_key) noexcept {
  std::int64_t o = 0, i = 0;
#if KVP_CPU_TU_ISA == 2
  const __m512i lo = _mm512_set1_epi32(key_lo);
  const bool unbounded = key_hi > INT32_MAX;
  const __m512i hi = _mm512_set1_epi32(unbounded ? INT32_MAX : static_cast<std::int32_t>(key_hi));
  for (; i + 16 <= m; i += 16) {
    const __m512i k = _mm512_loadu_si512(key + i);
    __mmask16 keep = _mm512_cmpge_epi32_mask(k, lo);
    if (!unbounded) keep &= _mm512_cmplt_epi32_mask(k, hi);
    const __m512i x = _mm512_loadu_si512(idx + i);
    _mm512_storeu_si512(out_idx + o, _mm512_maskz_compress_epi32(keep, x));
    _mm512_storeu_si512(out_key + o, _mm512_maskz_compress_epi32(keep, k));
    o += __builtin_popcount(keep);
  }
#elif KVP_CPU_TU_ISA == 1
  const __m256i lo = _mm256_set1_epi32(key_lo), all = _mm256_set1_epi32(-1);
  const bool unbounded = key_hi > INT32_MAX;
  const __m256i hi = _mm256_set1_epi32(unbounded ? INT32_MAX : static_cast<std::int32_t>(key_hi));
  for (; i + 8 <= m; i += 8) {
    const __m256i k = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key + i));
    __m256i keep = _mm256_xor_si256(_mm256_cmpgt_epi32(lo, k), all);  // k >= lo
    if (!unbounded) keep = _mm256_and_si256(keep, _mm256_cmpgt_epi32(hi, k));
    const unsigned mask = lane_mask(keep);
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out_idx + o), pack_kept(x, mask));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out_key + o), pack_kept(k, mask));
    o += __builtin_popcount(mask);
  }
#endif
  for (; i < m; ++i) {  // the tail (all of it on SSE2)
    const std::int32_t k = key[i], x = idx[i];
    out_idx[o] = x;
    out_key[o] = k;
    o += (k >= key_lo && k < key_hi) ? 1 : 0;
  }
  return o;
}
// A bracket of at most this many keys around the answer is finished by kth_largest_by_count on its keys
// (one compaction pass) instead of further counting passes.
inline constexpr std::int64_t kBracketFinish = 16;

// The rank-th largest key of a set of more than kRankCountMax keys (smaller ones are counted above); with
// slack > 0, any threshold T that at least `rank` and at most rank + slack keys reach (a caller that only needs
// a lower bound for the rank-th key, such as the block-maximum cut of the top-k, stops earlier). *at_least (when
// not null) gets how many keys are >= the result.
//
// A search over a bracket [a, b) of key values: ca keys are >= a (ca >= rank), cb keys are >= b (cb < rank), so
// the answer lies in it. Each step is one branch-free counting pass at a guess t inside the bracket, which
// becomes a or b. The guess interpolates linearly between (a, ca) and (b, cb) for the count rank + 1/2 (+ slack/2);
// after a step that kept more than half of the bracket's keys, the next one halves the key interval instead, so
// skewed sets cost at most about twice the 32 steps of a bit-by-bit bisection. It ends when exactly `rank` keys
// reach a (the answer is then the smallest of them: one pass), when a bracket of kBracketFinish keys or fewer
// remains (compacted by keep_in_key_range, then counted), or when the interval is one key wide. For the few hundred block maxima and
// candidates of a row of scores this takes 5-9 passes where the bit-by-bit bisection took 15-18 (simulated
// on normal scores: 8191 scores, k = 63 / 255).
inline std::int32_t kth_largest_key(const std::int32_t* keys, std::int64_t m, std::int64_t rank, std::int64_t slack,
                                    std::int64_t* at_least) noexcept {
  if (m <= kRankCountMax) return kth_largest_by_count(keys, m, rank, at_least);
  std::int32_t lo = INT32_MAX, hi = INT32_MIN;
  std::int64_t i = 0;
  I vlo(INT32_MAX), vhi(INT32_MIN);
  for (; i + kLanes <= m; i += kLanes) {
    const I k = I::load_unaligned(keys + i);
    vlo = xsimd::min(vlo, k);
    vhi = xsimd::max(vhi, k);
  }
  lo = hmin_i32(vlo);
  hi = hmax_i32(vhi);
  for (; i < m; ++i) {
    lo = keys[i] < lo ? keys[i] : lo;
    hi = keys[i] > hi ? keys[i] : hi;
  }
  const auto done = [&](std::int64_t key, std::int64_t count) {
    if (at_least != nullptr) *at_least = count;
    return static_cast<std::int32_t>(key);
  };
  if (lo == hi) return done(lo, m);  // all equal
  if (rank <= 1) return done(hi, at_least != nullptr ? count_keys_at_least(keys, m, hi) : 0);
  std::int64_t a = lo, b = std::int64_t{hi} + 1, ca = m, cb = 0;
  std::int64_t width_before = std::numeric_limits<std::int64_t>::max();  // the bracket's key count one step earlier
  for (;;) {
    if (ca - rank <= slack) return slack > 0 ? done(a, ca) : done(min_key_at_least(keys, m, static_cast<std::int32_t>(a)), ca);
    if (b - a == 1) return done(a, ca);  // every key of the bracket equals a
    const std::int64_t width = ca - cb;
    if (slack == 0 && width <= kBracketFinish) {
      // keep_in_key_range with the keys as their own indices (its index output is scratch here).
      alignas(64) std::int32_t set[kBracketFinish + kCollectSlack], scratch[kBracketFinish + kCollectSlack];
      const std::int64_t s = keep_in_key_range(keys, keys, m, static_cast<std::int32_t>(a), b, scratch, set);
      std::int64_t in_set = 0;
      const std::int32_t r = kth_largest_by_count(set, s, rank - cb, &in_set);
      return done(r, cb + in_set);
    }
    std::int64_t t = a + (b - a) / 2;
    if (2 * width <= width_before) {
      const double share =
          (static_cast<double>(ca) - (static_cast<double>(rank) + 0.5 + 0.5 * static_cast<double>(slack))) / static_cast<double>(width);
      t = a + static_cast<std::int64_t>(static_cast<double>(b - a) * share);
    }
    t = t < a + 1 ? a + 1 : (t > b - 1 ? b - 1 : t);
    width_before = width;
    const std::int64_t c = count_keys_at_least(keys, m, static_cast<std::int32_t>(t));
    if (c >= rank) {
      a = t;
      ca = c;
    } else {
      b = t;
      cb = c;
    }
  }
}

inline std::int64_t keep_at_least(const std::int32_t* idx, const std::int32_t* key, std::int64_t m, std::int32_t key_lo,
                                  std::int32_t idx_lo, std::int32_t* out_idx) noexcept {
  std::int64_t o = 0, i = 0;
#if KVP_CPU_TU_ISA == 2
  const __m512i kl = _mm512_set1_epi32(key_lo), il = _mm512_set1_epi32(idx_lo);
  for (; i + 16 <= m; i += 16) {
    const __m512i k = _mm512_loadu_si512(key + i), x = _mm512_loadu_si512(idx + i);
    const __mmask16 keep = _mm512_cmpgt_epi32_mask(k, kl) | (_mm512_cmpeq_epi32_mask(k, kl) & _mm512_cmpge_epi32_mask(x, il));
    _mm512_storeu_si512(out_idx + o, _mm512_maskz_compress_epi32(keep, x));
    o += __builtin_popcount(keep);
  }
#elif KVP_CPU_TU_ISA == 1
  const __m256i kl = _mm256_set1_epi32(key_lo), il = _mm256_set1_epi32(idx_lo);
  for (; i + 8 <= m; i += 8) {
    const __m256i k = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key + i));
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx + i));
    const __m256i x_ge = _mm256_or_si256(_mm256_cmpgt_epi32(x, il), _mm256_cmpeq_epi32(x, il));
    const __m256i keep = _mm256_or_si256(_mm256_cmpgt_epi32(k, kl), _mm256_and_si256(_mm256_cmpeq_epi32(k, kl), x_ge));
    const unsigned mask = lane_mask(keep);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out_idx + o), pack_kept(x, mask));
    o += __builtin_popcount(mask);
  }
#endif
  for (; i < m; ++i) {
    out_idx[o] = idx[i];
    o += (key[i] > key_lo || (key[i] == key_lo && idx[i] >= idx_lo)) ? 1 : 0;
  }
  return o;
}

}  // namespace cpu_detail::KVP_CPU_ISA_NS
KVP_NAMESPACE_END
