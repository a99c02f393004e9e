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
// nothing. A finite block whose scale or minimum exceeds the fp16 range
// stores an infinite one, as the reference does (|x| above 65504 * 127 for
// q8_0; a minimum below -65504 for q4_1 / q5_1), and decodes to non-finite
// values. With a Hadamard rotation (GgmlQuant) the bound applies to the
// rotated block, whose entries reach up to sqrt(n) * max|x| for a rotation of
// size n (8x at n = 64): rows near the fp16 range need rotation=none.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kvpolicy/core/config.hpp"
#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/status.hpp"

KVP_NAMESPACE_BEGIN

enum class GgmlType : std::uint8_t { kQ8_0, kQ4_0, kQ4_1, kQ5_0, kQ5_1, kIQ4_NL };

inline constexpr std::int32_t kGgmlBlock = 32;  ///< values per block, every format

/// Bytes of one block of `t`.
KVP_HOST_DEVICE constexpr std::int32_t ggml_block_bytes(GgmlType t) noexcept {
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

/// iq4_nl's nearest-level search as two lookups, for SIMD kernels. Bucket
/// b = clamp(floor(x / 8), -16, 15) + 16 of the 32 holds at most one of the 15
/// midpoints between adjacent levels (they are >= 11.5 apart): the code is the
/// number of midpoints below the bucket (`kIq4nlBucketBase`) plus 1 when
/// x >= the bucket's midpoint (`kIq4nlBucketMid`, +inf for none). The
/// reference's `x - lo < hi - x` turns exactly at those midpoints, so this
/// equals ggml's best_index_int8 for every finite float (test_quant checks all
/// of them in an [.exhaustive] case, and a sample always).
inline constexpr std::int32_t kIq4nlBucketBase[32] = {0, 0, 1, 1,  1,  2,  2,  3,  3,  4,  4,  5,  5,  6,  6,  7,
                                                      8, 9, 9, 10, 11, 11, 12, 12, 13, 13, 14, 14, 14, 15, 15, 15};
inline constexpr float kIq4nlBucketMid[32] = {__builtin_inff(),
                                              -115.5f,
                                              __builtin_inff(),
                                              __builtin_inff(),
                                              -93.5f,
                                              __builtin_inff(),
                                              -74.0f,
                                              __builtin_inff(),
                                              -57.0f,
                                              __builtin_inff(),
                                              -42.0f,
                                              __builtin_inff(),
                                              -28.5f,
                                              __builtin_inff(),
                                              -16.0f,
                                              -4.5f,
                                              7.0f,
                                              __builtin_inff(),
                                              19.0f,
                                              31.5f,
                                              __builtin_inff(),
                                              45.5f,
                                              __builtin_inff(),
                                              61.0f,
                                              __builtin_inff(),
                                              79.0f,
                                              __builtin_inff(),
                                              __builtin_inff(),
                                              101.0f,
                                              __builtin_inff(),
                                              __builtin_inff(),
                                              __builtin_inff()};
/// The scalar form of the bucket search (finite x).
inline int iq4nl_bucket_index(float x) noexcept {
  float y = x * 0.125f;
  y = y < -16.0f ? -16.0f : (y > 15.0f ? 15.0f : y);
  const int b = static_cast<int>(std::floor(y)) + 16;
  return kIq4nlBucketBase[b] + (x >= kIq4nlBucketMid[b] ? 1 : 0);
}

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

#include "kvpolicy/quant/ggml_blocks.inl"  // the block algorithms, in this namespace

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
