// SPDX-License-Identifier: Apache-2.0
// ggml block formats of llama.cpp's quantized KV cache (`--cache-type-k/-v`):
// q8_0, q4_0, q4_1, q5_0, q5_1 and iq4_nl. Byte layout exactly as ggml's
// `ggml-common.h`; quantize / dequantize bit-exact with the reference
// quantizers (gguf-py 0.19 `gguf.quants`, itself line for line
// `ggml-quants.c`'s `quantize_row_*_ref`), checked on committed fixtures.
//
// Every block holds 32 consecutive values of one row; every scale is an IEEE
// binary16 (`half`, round to nearest even). Layouts (bytes, in order):
//
//   q8_0   34  d:f16 | qs:int8[32]                 x = qs[j] * d
//   q4_0   18  d:f16 | qs:u8[16]                   x = (q[j] - 8) * d
//   q4_1   20  d:f16 | m:f16 | qs:u8[16]           x = q[j] * d + m
//   q5_0   22  d:f16 | qh:u8[4] | qs:u8[16]        x = (q[j] - 16) * d
//   q5_1   24  d:f16 | m:f16 | qh:u8[4] | qs:u8[16]  x = q[j] * d + m
//   iq4_nl 18  d:f16 | qs:u8[16]                   x = kIq4nlValues[q[j]] * d
//
// 4-bit codes pair element j (low nibble) with element j + 16 (high nibble):
// qs[j] = q[j] | q[j + 16] << 4. For q5_*, `qh` is a little-endian uint32
// whose bit j is bit 4 of q[j].
//
// Quantization (fp32 throughout, each product rounded before it is added, as
// the references compute it — never contracted into an FMA):
//   q8_0:   d = amax / 127, id = d ? 1 / d : 0, qs = roundf(x * id) (ties away from 0).
//   q4_0:   max = the element of largest |x|, sign kept, first on ties;
//           d = max / -8, q = min(15, trunc(x * id + 8.5)).
//   q5_0:   d = max / -16, q = min(31, trunc(x * id + 16.5)).
//   q4_1:   d = (max - min) / 15, m = min, q = min(15, trunc((x - min) * id + 0.5)).
//   q5_1:   d = (max - min) / 31, q = min(31, trunc((x - min) * id + 0.5)).
//   iq4_nl: ggml's `quantize_row_iq4_nl_ref` (impl with ntry = -1):
//           d0 = max / kIq4nlValues[0] (max signed, as q4_0), codes =
//           nearest table entry of x / d0 (an exact midpoint takes the upper
//           entry), then one least-squares refinement d = sum(w q x) /
//           sum(w q^2) with w = x^2 (sums in order, fp32); codes are not
//           recomputed; a block with amax < 1e-15 is all zeros (d = 0).
//           gguf-py has no iq4_nl quantizer: the fixture generator carries a
//           numpy transcription of the C reference, and gguf-py checks the
//           dequantization.
//
// Which reference: ggml's x86 AVX/AVX2 `quantize_row_q8_0` (the CPU cache
// writer) uses id = 127 / amax and rounds ties to even, so its bytes can
// differ from the reference in the last ulp or on exact .5 ties; the CUDA
// writer and every other format use the reference formulas. The library
// follows the reference (gguf-py, ggml's `_ref`, CUDA).
//
// Non-finite input: ggml's reference gives position-dependent bytes for a
// block holding NaN (its max scan is order-sensitive) and a NaN or infinite
// scale for one holding ±inf. The library's quantize entry points reject
// non-finite values with an error naming the row and channel, writing
// nothing. A finite block whose scale exceeds the fp16 range stores an
// infinite scale, as the reference does (|x| above 65504 * 127 for q8_0).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/status.hpp"

KVP_NAMESPACE_BEGIN

enum class GgmlType : std::uint8_t { kQ8_0, kQ4_0, kQ4_1, kQ5_0, kQ5_1, kIQ4_NL };

inline constexpr std::int32_t kGgmlBlock = 32;  ///< values per block, every format

/// Bytes of one block of `t`.
constexpr std::int32_t ggml_block_bytes(GgmlType t) noexcept {
  switch (t) {
    case GgmlType::kQ8_0: return 34;
    case GgmlType::kQ4_0: return 18;
    case GgmlType::kQ4_1: return 20;
    case GgmlType::kQ5_0: return 22;
    case GgmlType::kQ5_1: return 24;
    case GgmlType::kIQ4_NL: return 18;
  }
  return 0;
}
/// Code bits per value of `t`.
constexpr std::int32_t ggml_bits(GgmlType t) noexcept {
  return t == GgmlType::kQ8_0 ? 8 : (t == GgmlType::kQ5_0 || t == GgmlType::kQ5_1) ? 5 : 4;
}
constexpr const char* ggml_name(GgmlType t) noexcept {
  switch (t) {
    case GgmlType::kQ8_0: return "q8_0";
    case GgmlType::kQ4_0: return "q4_0";
    case GgmlType::kQ4_1: return "q4_1";
    case GgmlType::kQ5_0: return "q5_0";
    case GgmlType::kQ5_1: return "q5_1";
    case GgmlType::kIQ4_NL: return "iq4_nl";
  }
  return "?";
}
constexpr bool ggml_type_valid(GgmlType t) noexcept { return static_cast<std::uint8_t>(t) <= static_cast<std::uint8_t>(GgmlType::kIQ4_NL); }

/// iq4_nl's non-linear code table.
inline constexpr std::int8_t kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

namespace ggml_ref {

/// a * b rounded to fp32 once, never fused with a following add (the
/// references round every product; -ffp-contract would otherwise fuse it).
inline float mul(float a, float b) noexcept {
  volatile float p = a * b;
  return p;
}

inline void put_half(std::uint8_t* p, float v) noexcept {
  const std::uint16_t b = from_float<half>(v).bits;
  p[0] = static_cast<std::uint8_t>(b & 0xff);
  p[1] = static_cast<std::uint8_t>(b >> 8);
}
inline float get_half(const std::uint8_t* p) noexcept { return to_float(half::from_bits(static_cast<std::uint16_t>(p[0] | (p[1] << 8)))); }

/// The element of largest |x| with its sign (the first one on ties), as numpy's argmax.
inline float signed_absmax(const float* x) noexcept {
  float amax = -1.0f, mx = 0.0f;
  for (int j = 0; j < kGgmlBlock; ++j) {
    const float a = std::fabs(x[j]);
    if (a > amax) amax = a, mx = x[j];
  }
  return mx;
}
inline void min_max(const float* x, float* mn, float* mx) noexcept {
  float lo = x[0], hi = x[0];
  for (int j = 1; j < kGgmlBlock; ++j) {
    lo = x[j] < lo ? x[j] : lo;
    hi = x[j] > hi ? x[j] : hi;
  }
  *mn = lo, *mx = hi;
}
/// numpy's np_roundf / C roundf on a finite float: half away from zero.
inline float round_away(float v) noexcept {
  const float a = std::fabs(v);
  const float f = std::floor(a);
  const float r = f + std::floor(2.0f * (a - f));
  return v < 0.0f ? -r : r;
}
inline void pack_nibbles(const std::uint8_t* q, std::uint8_t* qs) noexcept {
  for (int j = 0; j < 16; ++j) qs[j] = static_cast<std::uint8_t>((q[j] & 0x0f) | ((q[j + 16] & 0x0f) << 4));
}
inline void pack_high_bits(const std::uint8_t* q, std::uint8_t* qh) noexcept {
  std::uint32_t h = 0;
  for (int j = 0; j < kGgmlBlock; ++j) h |= static_cast<std::uint32_t>((q[j] >> 4) & 1u) << j;
  for (int b = 0; b < 4; ++b) qh[b] = static_cast<std::uint8_t>(h >> (8 * b));
}
inline std::uint8_t nibble(const std::uint8_t* qs, int j) noexcept {
  return j < 16 ? static_cast<std::uint8_t>(qs[j] & 0x0f) : static_cast<std::uint8_t>(qs[j - 16] >> 4);
}
inline std::uint32_t high_bits(const std::uint8_t* qh) noexcept {
  return static_cast<std::uint32_t>(qh[0]) | static_cast<std::uint32_t>(qh[1]) << 8 | static_cast<std::uint32_t>(qh[2]) << 16 |
         static_cast<std::uint32_t>(qh[3]) << 24;
}
/// Truncation of a value in [0, 2^8) to a code, clamped to `top` (numpy's trunc + astype(uint8) + clip).
inline std::uint8_t trunc_code(float v, int top) noexcept {
  const int q = static_cast<int>(v);  // v >= 0 for finite input
  return static_cast<std::uint8_t>(q > top ? top : (q < 0 ? 0 : q));
}
/// ggml's best_index_int8 over kIq4nlValues: the nearest entry, the upper one at an exact midpoint.
inline int iq4nl_index(float x) noexcept {
  if (x <= kIq4nlValues[0]) return 0;
  if (x >= kIq4nlValues[15]) return 15;
  int lo = 0, hi = 15;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (x < kIq4nlValues[mid])
      hi = mid;
    else
      lo = mid;
  }
  return x - kIq4nlValues[hi - 1] < kIq4nlValues[hi] - x ? hi - 1 : hi;
}

// ---- one block: 32 finite fp32 values <-> ggml_block_bytes(t) bytes ----------

inline void quantize_q8_0(const float* x, std::uint8_t* out) noexcept {
  float amax = 0.0f;
  for (int j = 0; j < kGgmlBlock; ++j) amax = std::fabs(x[j]) > amax ? std::fabs(x[j]) : amax;
  const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  put_half(out, d);
  for (int j = 0; j < kGgmlBlock; ++j) out[2 + j] = static_cast<std::uint8_t>(static_cast<std::int8_t>(round_away(mul(x[j], id))));
}
inline void dequantize_q8_0(const std::uint8_t* in, float* y) noexcept {
  const float d = get_half(in);
  for (int j = 0; j < kGgmlBlock; ++j) y[j] = static_cast<float>(static_cast<std::int8_t>(in[2 + j])) * d;
}

/// q4_0 (levels = 8, top = 15) and q5_0 (levels = 16, top = 31).
inline void quantize_sym(const float* x, std::uint8_t* q, float* d_out, int levels, int top) noexcept {
  const float mx = signed_absmax(x);
  const float d = mx / static_cast<float>(-levels), id = d != 0.0f ? 1.0f / d : 0.0f;
  const float bias = static_cast<float>(levels) + 0.5f;
  for (int j = 0; j < kGgmlBlock; ++j) q[j] = trunc_code(mul(x[j], id) + bias, top);
  *d_out = d;
}
/// q4_1 (top = 15) and q5_1 (top = 31).
inline void quantize_asym(const float* x, std::uint8_t* q, float* d_out, float* m_out, int top) noexcept {
  float mn, mx;
  min_max(x, &mn, &mx);
  const float d = (mx - mn) / static_cast<float>(top), id = d != 0.0f ? 1.0f / d : 0.0f;
  for (int j = 0; j < kGgmlBlock; ++j) q[j] = trunc_code(mul(x[j] - mn, id) + 0.5f, top);
  *d_out = d, *m_out = mn;
}

inline void quantize_q4_0(const float* x, std::uint8_t* out) noexcept {
  std::uint8_t q[kGgmlBlock];
  float d;
  quantize_sym(x, q, &d, 8, 15);
  put_half(out, d);
  pack_nibbles(q, out + 2);
}
inline void dequantize_q4_0(const std::uint8_t* in, float* y) noexcept {
  const float d = get_half(in);
  for (int j = 0; j < kGgmlBlock; ++j) y[j] = d * static_cast<float>(static_cast<int>(nibble(in + 2, j)) - 8);
}
inline void quantize_q4_1(const float* x, std::uint8_t* out) noexcept {
  std::uint8_t q[kGgmlBlock];
  float d, m;
  quantize_asym(x, q, &d, &m, 15);
  put_half(out, d);
  put_half(out + 2, m);
  pack_nibbles(q, out + 4);
}
inline void dequantize_q4_1(const std::uint8_t* in, float* y) noexcept {
  const float d = get_half(in), m = get_half(in + 2);
  for (int j = 0; j < kGgmlBlock; ++j) y[j] = mul(d, static_cast<float>(nibble(in + 4, j))) + m;
}
inline void quantize_q5_0(const float* x, std::uint8_t* out) noexcept {
  std::uint8_t q[kGgmlBlock];
  float d;
  quantize_sym(x, q, &d, 16, 31);
  put_half(out, d);
  pack_high_bits(q, out + 2);
  pack_nibbles(q, out + 6);
}
inline void dequantize_q5_0(const std::uint8_t* in, float* y) noexcept {
  const float d = get_half(in);
  const std::uint32_t h = high_bits(in + 2);
  for (int j = 0; j < kGgmlBlock; ++j) {
    const int q = nibble(in + 6, j) | static_cast<int>(((h >> j) & 1u) << 4);
    y[j] = d * static_cast<float>(q - 16);
  }
}
inline void quantize_q5_1(const float* x, std::uint8_t* out) noexcept {
  std::uint8_t q[kGgmlBlock];
  float d, m;
  quantize_asym(x, q, &d, &m, 31);
  put_half(out, d);
  put_half(out + 2, m);
  pack_high_bits(q, out + 4);
  pack_nibbles(q, out + 8);
}
inline void dequantize_q5_1(const std::uint8_t* in, float* y) noexcept {
  const float d = get_half(in), m = get_half(in + 2);
  const std::uint32_t h = high_bits(in + 4);
  for (int j = 0; j < kGgmlBlock; ++j) {
    const int q = nibble(in + 8, j) | static_cast<int>(((h >> j) & 1u) << 4);
    y[j] = mul(d, static_cast<float>(q)) + m;
  }
}
inline void quantize_iq4_nl(const float* x, std::uint8_t* out) noexcept {
  std::uint8_t q[kGgmlBlock] = {};
  float amax = 0.0f, mx = 0.0f;
  for (int j = 0; j < kGgmlBlock; ++j) {
    const float a = std::fabs(x[j]);
    if (a > amax) amax = a, mx = x[j];
  }
  float d = 0.0f;
  if (!(amax < 1e-15f)) {
    const float d0 = mx / static_cast<float>(kIq4nlValues[0]), id = 1.0f / d0;
    float sumqx = 0.0f, sumq2 = 0.0f;
    for (int j = 0; j < kGgmlBlock; ++j) {
      const int l = iq4nl_index(mul(id, x[j]));
      q[j] = static_cast<std::uint8_t>(l);
      const float v = static_cast<float>(kIq4nlValues[l]), w = mul(x[j], x[j]);
      sumqx = sumqx + mul(mul(w, v), x[j]);
      sumq2 = sumq2 + mul(mul(w, v), v);
    }
    d = sumqx / sumq2;
  }
  put_half(out, d);
  pack_nibbles(q, out + 2);
}
inline void dequantize_iq4_nl(const std::uint8_t* in, float* y) noexcept {
  const float d = get_half(in);
  for (int j = 0; j < kGgmlBlock; ++j) y[j] = d * static_cast<float>(kIq4nlValues[nibble(in + 2, j)]);
}

}  // namespace ggml_ref

/// One block of 32 finite values into `ggml_block_bytes(t)` bytes (the reference quantizer).
inline void ggml_quantize_block(GgmlType t, const float* x, std::uint8_t* out) noexcept {
  switch (t) {
    case GgmlType::kQ8_0: ggml_ref::quantize_q8_0(x, out); break;
    case GgmlType::kQ4_0: ggml_ref::quantize_q4_0(x, out); break;
    case GgmlType::kQ4_1: ggml_ref::quantize_q4_1(x, out); break;
    case GgmlType::kQ5_0: ggml_ref::quantize_q5_0(x, out); break;
    case GgmlType::kQ5_1: ggml_ref::quantize_q5_1(x, out); break;
    case GgmlType::kIQ4_NL: ggml_ref::quantize_iq4_nl(x, out); break;
  }
}
/// One block back to 32 floats.
inline void ggml_dequantize_block(GgmlType t, const std::uint8_t* in, float* y) noexcept {
  switch (t) {
    case GgmlType::kQ8_0: ggml_ref::dequantize_q8_0(in, y); break;
    case GgmlType::kQ4_0: ggml_ref::dequantize_q4_0(in, y); break;
    case GgmlType::kQ4_1: ggml_ref::dequantize_q4_1(in, y); break;
    case GgmlType::kQ5_0: ggml_ref::dequantize_q5_0(in, y); break;
    case GgmlType::kQ5_1: ggml_ref::dequantize_q5_1(in, y); break;
    case GgmlType::kIQ4_NL: ggml_ref::dequantize_iq4_nl(in, y); break;
  }
}

KVP_NAMESPACE_END
