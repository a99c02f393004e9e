// SPDX-License-Identifier: Apache-2.0
// The ggml block algorithms (quant/ggml_blocks.inl) compiled for the device,
// with the device's exact product and fp16 conversions, in namespace ggml_dev
// of the including unit (included inside its cuda_detail anonymous namespace:
// token_rows.cu, specache.cu). Bit-identical with the host reference.
#pragma once

// ---- the ggml block algorithms, compiled for the device ------------------------------------------
namespace ggml_dev {

__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ void put_half(std::uint8_t* p, float v) {
  const std::uint16_t b = to_half(v).bits;
  p[0] = static_cast<std::uint8_t>(b & 0xffu);
  p[1] = static_cast<std::uint8_t>(b >> 8);
}
__device__ __forceinline__ float get_half(const std::uint8_t* p) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(p[0] | (p[1] << 8))));
}
/// kvpolicy::kIq4nlValues, readable by the device (the .inl finds this one first).
__constant__ std::int8_t kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

#define KVP_GGML_FN __device__ __forceinline__
#include "kvpolicy/quant/ggml_blocks.inl"

__device__ void quantize_block(GgmlType t, const float* x, std::uint8_t* out) {
  switch (t) {
    case GgmlType::kQ8_0: quantize_q8_0(x, out); break;
    case GgmlType::kQ4_0: quantize_q4_0(x, out); break;
    case GgmlType::kQ4_1: quantize_q4_1(x, out); break;
    case GgmlType::kQ5_0: quantize_q5_0(x, out); break;
    case GgmlType::kQ5_1: quantize_q5_1(x, out); break;
    case GgmlType::kIQ4_NL: quantize_iq4_nl(x, out); break;
  }
}
__device__ void dequantize_block(GgmlType t, const std::uint8_t* in, float* y) {
  switch (t) {
    case GgmlType::kQ8_0: dequantize_q8_0(in, y); break;
    case GgmlType::kQ4_0: dequantize_q4_0(in, y); break;
    case GgmlType::kQ4_1: dequantize_q4_1(in, y); break;
    case GgmlType::kQ5_0: dequantize_q5_0(in, y); break;
    case GgmlType::kQ5_1: dequantize_q5_1(in, y); break;
    case GgmlType::kIQ4_NL: dequantize_iq4_nl(in, y); break;
  }
}

}  // namespace ggml_dev
