// SPDX-License-Identifier: Apache-2.0
// `TokenRowCodec`: one (token, kv head) row of a quantized cache, as the
// backends' `encode_token_rows` / `decode_token_rows` ops see it — a ggml
// block format (quant/ggml.hpp) or token-wise INT4 / INT8 (quant/int4.hpp),
// behind an optional block-diagonal Hadamard rotation of block `rotation`
// (quant/hadamard.hpp; 0 or 1: none).
//
//   encode: row x (d values of any KV element type, widened exactly) ->
//           R x in fp32 -> the format's codes (row_bytes(d) bytes)
//   decode: codes -> fp32 values -> R^-1 (= R) -> d values of the output
//           type (fp16 / bf16 round to nearest even)
//
// The arithmetic is the host policies' (GgmlQuant, Int4Quant) step for step,
// so the bytes and the decoded values are bit-identical on every backend.
// One descriptor for both formats lets a device backend keep one kernel pair
// (load the row, rotate it in on-chip memory, encode) instead of one per
// format and rotation.
#pragma once

#include <cstdint>

#include "kvpolicy/core/config.hpp"
#include "kvpolicy/quant/ggml.hpp"
#include "kvpolicy/quant/hadamard.hpp"
#include "kvpolicy/quant/int4.hpp"

KVP_NAMESPACE_BEGIN

struct TokenRowCodec {
  enum class Kind : std::uint8_t { kGgml, kInt };

  Kind kind = Kind::kGgml;
  GgmlType ggml = GgmlType::kQ8_0;  ///< kind == kGgml: the block format
  std::int32_t bits = 4;            ///< kind == kInt: 4 or 8
  std::int64_t rotation = 0;        ///< Hadamard block size; 0 or 1: no rotation

  static constexpr TokenRowCodec ggml_blocks(GgmlType t, std::int64_t rotation = 0) noexcept {
    return TokenRowCodec{Kind::kGgml, t, 4, rotation};
  }
  static constexpr TokenRowCodec int_tokens(std::int32_t bits, std::int64_t rotation = 0) noexcept {
    return TokenRowCodec{Kind::kInt, GgmlType::kQ8_0, bits, rotation};
  }

  KVP_HOST_DEVICE constexpr bool rotated() const noexcept { return rotation > 1; }
  /// Bytes of one encoded row of d values.
  KVP_HOST_DEVICE constexpr std::int64_t row_bytes(std::int64_t d) const noexcept {
    return kind == Kind::kGgml ? d / kGgmlBlock * ggml_block_bytes(ggml) : int4q::row_bytes(d, bits);
  }
  /// Empty when (codec, d) is encodable: the reason otherwise, naming the constraint.
  constexpr const char* unsupported(std::int64_t d) const noexcept {
    if (d <= 0) return "head_dim must be > 0";
    if (kind != Kind::kGgml && kind != Kind::kInt) return "the codec kind is neither ggml nor int";
    if (kind == Kind::kGgml) {
      if (!ggml_type_valid(ggml)) return "the ggml type is not a block format";
      if (d % kGgmlBlock != 0) return "head_dim must be a multiple of the ggml block (32 values)";
    } else {
      if (bits != 4 && bits != 8) return "int bits must be 4 or 8";
      if (bits == 4 && d % 2 != 0) return "head_dim must be even for 4-bit codes";
      if (d > kMaxRotatedHeadDim) return "an int row's head_dim must be <= 4096";
    }
    if (rotated()) {
      if (!is_power_of_two(rotation) || d % rotation != 0) return "the rotation block must be a power of two dividing head_dim";
      if (d > kMaxRotatedHeadDim) return "a rotated head_dim must be <= 4096";
    }
    return nullptr;
  }
};

KVP_NAMESPACE_END
