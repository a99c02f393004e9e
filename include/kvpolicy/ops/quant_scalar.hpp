// SPDX-License-Identifier: Apache-2.0
// `backend::ScalarQuantOps`: quantize / dequantize rows of a K/V cache in the
// ggml block formats (quant/ggml.hpp), the reference every backend must match
// byte for byte (quantize) and bit for bit (dequantize). A row is n values,
// n a multiple of 32, into n / 32 consecutive blocks.
//
// The row codecs of the other formats, over `rows` rows of d values at a row
// stride (elements for values, bytes for codes), channels contiguous:
//   rotate_rows_in / rotate_rows_out   T rows <-> fp32 rows through the
//       block-diagonal Hadamard transform of block n (quant/hadamard.hpp;
//       n <= 1: a plain conversion)
//   int4_quantize_rows / int4_dequantize_rows   token-wise INT4 / INT8 of
//       fp32 rows (quant/int4.hpp)
//   fp8_quantize_rows / fp8_dequantize_rows     fp8 codes of T rows with one
//       scale, or (scale <= 0) the dynamic per-row scale in the row's trailer
//       (Fp8Quant's per_token_head layout)
//   kivi_r16_rows, kivi_*_keys / kivi_*_value_rows   KIVI's fp16 arithmetic
//       (quant/kivi.hpp) on fp16-valued fp32 rows; the decoders write T rows
//       (fp32, fp16, ...) at a row stride
//   first_not_below                             the first value of a float or
//       half run at or above a magnitude (NaN included): KIVI's range scan
//   encode_token_rows / decode_token_rows       T rows <-> ggml or INT4 / INT8
//       code rows through an optional Hadamard rotation (quant/token_rows.hpp):
//       the whole per-row step of GgmlQuant / Int4Quant in one op, the form a
//       device backend runs as one launch per kv head
// Inputs are finite (the policies validate before any call).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/quant/fp8.hpp"
#include "kvpolicy/quant/ggml.hpp"
#include "kvpolicy/quant/hadamard.hpp"
#include "kvpolicy/quant/int4.hpp"
#include "kvpolicy/quant/kivi.hpp"
#include "kvpolicy/quant/token_rows.hpp"

KVP_NAMESPACE_BEGIN
namespace backend {

struct ScalarQuantOps {
  /// Blocks of row x[0..n) (finite; any KV element type, widened exactly) into `out`.
  template <class T>
  static void ggml_quantize_row(GgmlType t, const T* x, std::int64_t n, std::uint8_t* out) noexcept {
    const std::int32_t bb = ggml_block_bytes(t);
    float blk[kGgmlBlock];
    for (std::int64_t b = 0; b < n / kGgmlBlock; ++b) {
      for (int j = 0; j < kGgmlBlock; ++j) blk[j] = to_float(x[b * kGgmlBlock + j]);
      ggml_quantize_block(t, blk, out + b * bb);
    }
  }
  /// First index of a NaN or infinity in x[0..n), or -1.
  template <class T>
  static std::int64_t first_nonfinite(const T* x, std::int64_t n) noexcept {
    for (std::int64_t j = 0; j < n; ++j) {
      const float v = to_float(x[j]);
      if (v - v != 0.0f) return j;  // NaN or infinity
    }
    return -1;
  }
  /// Blocks back to n values of type T (fp16 / bf16 outputs round to nearest even).
  template <class T>
  static void ggml_dequantize_row(GgmlType t, const std::uint8_t* in, std::int64_t n, T* y) noexcept {
    const std::int32_t bb = ggml_block_bytes(t);
    float blk[kGgmlBlock] = {};  // (the type is valid: every block is written before it is read)
    for (std::int64_t b = 0; b < n / kGgmlBlock; ++b) {
      if constexpr (std::is_same_v<T, float>) {
        ggml_dequantize_block(t, in + b * bb, y + b * kGgmlBlock);
      } else {
        ggml_dequantize_block(t, in + b * bb, blk);
        for (int j = 0; j < kGgmlBlock; ++j) y[b * kGgmlBlock + j] = from_float<T>(blk[j]);
      }
    }
  }

  // ---- Hadamard rotation ------------------------------------------------------------------------

  /// y[r * d + c] <- (R float(x[r * x_stride + .]))[c] for r < rows (y contiguous).
  template <class T>
  static void rotate_rows_in(const T* x, std::int64_t rows, std::int64_t x_stride, std::int64_t d, std::int64_t n, float* y) noexcept {
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t c = 0; c < d; ++c) y[r * d + c] = to_float(x[r * x_stride + c]);
      hadamard_rotate(y + r * d, d, n);
    }
  }
  /// out[r * out_stride + c] <- T((R y_r)[c]); y (contiguous rows of d) is rotated in place.
  template <class T>
  static void rotate_rows_out(float* y, std::int64_t rows, std::int64_t d, std::int64_t n, T* out, std::int64_t out_stride) noexcept {
    for (std::int64_t r = 0; r < rows; ++r) {
      hadamard_rotate(y + r * d, d, n);
      for (std::int64_t c = 0; c < d; ++c) out[r * out_stride + c] = from_float<T>(y[r * d + c]);
    }
  }

  // ---- whole token rows (ggml / INT4 behind a rotation) ------------------------------------------

  /// Rows x + r * x_stride (d values, channels contiguous) into code rows out + r * out_stride
  /// (c.row_bytes(d) bytes): widen, rotate by c.rotation, encode. `c.unsupported(d)` is empty.
  template <class T>
  static void encode_token_rows(const TokenRowCodec& c, const T* x, std::int64_t rows, std::int64_t x_stride, std::int64_t d,
                                std::uint8_t* out, std::int64_t out_stride) noexcept {
    float row[kMaxRotatedHeadDim];
    for (std::int64_t r = 0; r < rows; ++r) {
      const T* xr = x + r * x_stride;
      std::uint8_t* o = out + r * out_stride;
      // Chunks of the scratch: only unrotated ggml rows can be longer (INT and rotated rows are <= kMaxRotatedHeadDim).
      for (std::int64_t j0 = 0; j0 < d; j0 += kMaxRotatedHeadDim) {
        const std::int64_t m = std::min(d - j0, kMaxRotatedHeadDim);
        for (std::int64_t j = 0; j < m; ++j) row[j] = to_float(xr[j0 + j]);
        if (c.rotated()) hadamard_rotate(row, m, c.rotation);
        if (c.kind == TokenRowCodec::Kind::kGgml)
          ggml_quantize_row(c.ggml, static_cast<const float*>(row), m, o + j0 / kGgmlBlock * ggml_block_bytes(c.ggml));
        else
          int4q::quantize_row(row, m, c.bits, o);
      }
    }
  }
  /// Code rows in + r * in_stride back into rows y + r * y_stride: decode, rotate back, narrow.
  template <class T>
  static void decode_token_rows(const TokenRowCodec& c, const std::uint8_t* in, std::int64_t rows, std::int64_t in_stride, std::int64_t d,
                                T* y, std::int64_t y_stride) noexcept {
    float row[kMaxRotatedHeadDim];
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::uint8_t* i = in + r * in_stride;
      T* yr = y + r * y_stride;
      for (std::int64_t j0 = 0; j0 < d; j0 += kMaxRotatedHeadDim) {
        const std::int64_t m = std::min(d - j0, kMaxRotatedHeadDim);
        if (c.kind == TokenRowCodec::Kind::kInt)
          int4q::dequantize_row(i, m, c.bits, row);  // m == d: INT rows are one chunk
        else
          ggml_dequantize_row(c.ggml, i + j0 / kGgmlBlock * ggml_block_bytes(c.ggml), m, row);
        if (c.rotated()) hadamard_rotate(row, m, c.rotation);  // rotated rows are <= kMaxRotatedHeadDim: one chunk
        for (std::int64_t j = 0; j < m; ++j) yr[j0 + j] = from_float<T>(row[j]);
      }
    }
  }

  // ---- KIVI, whole tokens from a residual and new rows (KiviQuant's device form) ------------------

  /// Logical tokens [0, count) — residual rows [0, res_len) (fp16), then rows x + i * x_stride (rounded to
  /// fp16) — into KIVI codes: keys, count / group groups at codes + g * codes_stride (scales likewise);
  /// values, count token rows. Channels contiguous; d <= 4096, keys group <= 4096.
  template <class T>
  static void kivi_encode_tokens(const kivi::Codec& k, const half* res, std::int64_t res_stride, std::int64_t res_len, const T* x,
                                 std::int64_t x_stride, std::int64_t count, std::int64_t d, std::uint8_t* codes, std::int64_t codes_stride,
                                 std::uint8_t* scales, std::int64_t scales_stride) noexcept {
    const auto value = [&](std::int64_t i, std::int64_t c) noexcept {
      return i < res_len ? to_float(res[i * res_stride + c]) : kivi::r16(to_float(x[(i - res_len) * x_stride + c]));
    };
    float buf[4096];
    if (k.keys) {
      for (std::int64_t g = 0; g < count / k.group; ++g)
        for (std::int64_t c = 0; c < d; ++c) {
          for (int t = 0; t < k.group; ++t) buf[t] = value(g * k.group + t, c);
          kivi::quantize_key_channel(buf, d, c, k.group, k.bits, codes + g * codes_stride, scales + g * scales_stride);
        }
      return;
    }
    for (std::int64_t i = 0; i < count; ++i) {
      for (std::int64_t c = 0; c < d; ++c) buf[c] = value(i, c);
      kivi::quantize_value_row(buf, d, k.group, k.bits, codes + i * codes_stride, scales + i * scales_stride);
    }
  }
  /// Tokens [0, count) of KIVI codes decoded into rows y + t * y_stride (keys: count a multiple of group).
  template <class T>
  static void kivi_decode_tokens(const kivi::Codec& k, const std::uint8_t* codes, std::int64_t codes_stride, const std::uint8_t* scales,
                                 std::int64_t scales_stride, std::int64_t count, std::int64_t d, T* y, std::int64_t y_stride) noexcept {
    if (k.keys) {
      for (std::int64_t g = 0; g < count / k.group; ++g)
        for (std::int64_t c = 0; c < d; ++c)
          kivi::dequantize_key_channel(codes + g * codes_stride, scales + g * scales_stride, d, c, k.group, k.bits,
                                       y + g * k.group * y_stride + c, y_stride);
      return;
    }
    for (std::int64_t i = 0; i < count; ++i)
      kivi::dequantize_value_row(codes + i * codes_stride, scales + i * scales_stride, d, k.group, k.bits, y + i * y_stride);
  }
  /// The residual after an append: logical tokens [nq, res_len + n) (the survivors of the residual moved to
  /// its front in ascending order, then the new rows x rounded to fp16) into res rows [0, res_len + n - nq).
  template <class T>
  static void kivi_update_residual(half* res, std::int64_t res_stride, std::int64_t res_len, std::int64_t nq, const T* x,
                                   std::int64_t x_stride, std::int64_t n, std::int64_t d) noexcept {
    for (std::int64_t i = nq; i < res_len; ++i)
      std::memmove(res + (i - nq) * res_stride, res + i * res_stride, static_cast<std::size_t>(d) * 2);
    for (std::int64_t i = std::max(nq, res_len); i < res_len + n; ++i)
      for (std::int64_t c = 0; c < d; ++c) res[(i - nq) * res_stride + c] = to_half(to_float(x[(i - res_len) * x_stride + c]));
  }

  // ---- token-wise INT4 / INT8 ---------------------------------------------------------------------

  /// Rows x (contiguous, d values each) into code rows out + r * out_stride (int4q::row_bytes(d, bits) bytes).
  static void int4_quantize_rows(const float* x, std::int64_t rows, std::int64_t d, int bits, std::uint8_t* out,
                                 std::int64_t out_stride) noexcept {
    for (std::int64_t r = 0; r < rows; ++r) int4q::quantize_row(x + r * d, d, bits, out + r * out_stride);
  }
  /// Code rows in + r * in_stride decoded into rows y + r * y_stride (fp16 / bf16 round to nearest even).
  template <class T>
  static void int4_dequantize_rows(const std::uint8_t* in, std::int64_t rows, std::int64_t in_stride, std::int64_t d, int bits, T* y,
                                   std::int64_t y_stride) noexcept {
    float row[kMaxRotatedHeadDim];
    for (std::int64_t r = 0; r < rows; ++r) {
      if constexpr (std::is_same_v<T, float>) {
        int4q::dequantize_row(in + r * in_stride, d, bits, y + r * y_stride);
      } else {
        int4q::dequantize_row(in + r * in_stride, d, bits, row);
        for (std::int64_t c = 0; c < d; ++c) y[r * y_stride + c] = from_float<T>(row[c]);
      }
    }
  }

  // ---- fp8 ----------------------------------------------------------------------------------------

  /// The dynamic scale of one row: amax / fp8_max (1 for an all-zero row).
  template <class T>
  static float fp8_row_scale(Fp8Format f, const T* x, std::int64_t d) noexcept {
    float amax = 0.0f;
    for (std::int64_t c = 0; c < d; ++c) {
      const float a = std::fabs(to_float(x[c]));
      amax = amax < a ? a : amax;
    }
    return amax > 0.0f ? amax / fp8_max(f) : 1.0f;
  }
  /// Codes fp8(x / scale) of each row; scale <= 0: each row's dynamic scale, stored (fp32, then 12 zero bytes)
  /// at out + r * out_stride + d.
  template <class T>
  static void fp8_quantize_rows(Fp8Format f, const T* x, std::int64_t rows, std::int64_t x_stride, std::int64_t d, float scale,
                                std::uint8_t* out, std::int64_t out_stride) noexcept {
    for (std::int64_t r = 0; r < rows; ++r) {
      const T* xr = x + r * x_stride;
      std::uint8_t* o = out + r * out_stride;
      float s = scale;
      if (s <= 0.0f) {
        s = fp8_row_scale(f, xr, d);
        std::memcpy(o + d, &s, sizeof s);
        std::memset(o + d + sizeof s, 0, 12);
      }
      for (std::int64_t c = 0; c < d; ++c) o[c] = fp8_encode(f, to_float(xr[c]) / s);
    }
  }
  /// Values decode(code) * scale of each code row; scale <= 0: the scale stored after the row's d codes.
  template <class T>
  static void fp8_dequantize_rows(Fp8Format f, const std::uint8_t* in, std::int64_t rows, std::int64_t in_stride, std::int64_t d,
                                  float scale, T* y, std::int64_t y_stride) noexcept {
    float lut[256];
    for (int c = 0; c < 256; ++c) lut[c] = fp8_decode(f, static_cast<std::uint8_t>(c));
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::uint8_t* i = in + r * in_stride;
      float s = scale;
      if (s <= 0.0f) std::memcpy(&s, i + d, sizeof s);
      for (std::int64_t c = 0; c < d; ++c) y[r * y_stride + c] = from_float<T>(lut[i[c]] * s);
    }
  }

  // ---- KIVI ---------------------------------------------------------------------------------------

  /// First index i of x[0, n) with !(|x[i]| < bound) (NaN included), or -1.
  template <class T>
  static std::int64_t first_not_below(const T* x, std::int64_t n, float bound) noexcept {
    for (std::int64_t i = 0; i < n; ++i)
      if (!(std::fabs(to_float(x[i])) < bound)) return i;
    return -1;
  }

  /// y[r * d + c] <- fp16(x[r * x_stride + c]) as a float (KIVI's inputs).
  template <class T>
  static void kivi_r16_rows(const T* x, std::int64_t rows, std::int64_t x_stride, std::int64_t d, float* y) noexcept {
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < d; ++c) y[r * d + c] = kivi::r16(to_float(x[r * x_stride + c]));
  }
  /// One key group: x (group rows of d, contiguous) into the group's words and scales.
  static void kivi_quantize_keys(const float* x, std::int64_t d, int group, int bits, std::uint8_t* codes, std::uint8_t* scales) noexcept {
    float col[4096];
    for (std::int64_t c = 0; c < d; ++c) {
      for (int t = 0; t < group; ++t) col[t] = x[t * d + c];
      kivi::quantize_key_channel(col, d, c, group, bits, codes, scales);
    }
  }
  /// One key group decoded into y (group rows of d; row t at y + t * y_stride).
  template <class T>
  static void kivi_dequantize_keys(const std::uint8_t* codes, const std::uint8_t* scales, std::int64_t d, int group, int bits, T* y,
                                   std::int64_t y_stride) noexcept {
    for (std::int64_t c = 0; c < d; ++c) kivi::dequantize_key_channel(codes, scales, d, c, group, bits, y + c, y_stride);
  }
  /// Value rows x (contiguous rows of d) into code rows codes + r * codes_stride and scale rows scales + r * scales_stride.
  static void kivi_quantize_value_rows(const float* x, std::int64_t rows, std::int64_t d, int group, int bits, std::uint8_t* codes,
                                       std::int64_t codes_stride, std::uint8_t* scales, std::int64_t scales_stride) noexcept {
    for (std::int64_t r = 0; r < rows; ++r)
      kivi::quantize_value_row(x + r * d, d, group, bits, codes + r * codes_stride, scales + r * scales_stride);
  }
  /// Value rows decoded into y (rows of d; row r at y + r * y_stride).
  template <class T>
  static void kivi_dequantize_value_rows(const std::uint8_t* codes, std::int64_t codes_stride, const std::uint8_t* scales,
                                         std::int64_t scales_stride, std::int64_t rows, std::int64_t d, int group, int bits, T* y,
                                         std::int64_t y_stride) noexcept {
    for (std::int64_t r = 0; r < rows; ++r)
      kivi::dequantize_value_row(codes + r * codes_stride, scales + r * scales_stride, d, group, bits, y + r * y_stride);
  }
};

}  // namespace backend
KVP_NAMESPACE_END
