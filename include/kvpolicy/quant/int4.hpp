// SPDX-License-Identifier: Apache-2.0
// Token-wise asymmetric INT4 / INT8 of SAW-INT4 (togethercomputer/saw-int4,
// SGLang fork `kv_quant_kernels.py::_quantized_set_kv_int4_kernel`): one
// scale and one float zero per (token, kv head), over the whole head vector.
//
//   mn = min_d x[d], mx = max_d x[d]
//   scale = max(mx - mn, 1e-8) / (2^b - 1)
//   zero = -mn / scale                     (a float, not rounded)
//   q[d] = trunc(x[d] / scale + zero + 0.5) (round half up), in [0, 2^b - 1]
//   x^[d] = (q[d] - zero) * scale
//
// fp32 arithmetic, one rounding per operation, in that order (no FMA). The
// reference kernel is Triton, whose default fp32 division may differ from
// IEEE division in the last ulp; the library follows IEEE (tests: a numpy
// float32 transcription, tests/reference/make_int4_fixtures.py). Codes are
// clamped to [0, 2^b - 1]; for finite rows the clamp never changes one (x = mn
// gives exactly 0.5 before truncation, x = mx about 2^b - 0.5).
//
// Row layout (one token of one kv head, head_dim D even):
//   4 bits: D/2 bytes, byte d = q[d] | q[d + D/2] << 4 (first half of the head in
//           the low nibbles, second half in the high ones, SAW-INT4's order);
//   8 bits: D bytes, byte d = q[d];
//   then 8 bytes: fp32 scale, fp32 zero (little endian). SAW-INT4 keeps the
//   pair in a separate (slots, heads, 2) array; inline, a row is page-local and
//   moves with its token when a cache is compacted.
// bytes_per_token(D) = D * b / 8 + 8 (4.5 bits per value at D = 128).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kvpolicy/core/config.hpp"

KVP_NAMESPACE_BEGIN
namespace int4q {

KVP_HOST_DEVICE constexpr std::int64_t row_bytes(std::int64_t d, int bits) noexcept { return d * bits / 8 + 8; }

/// The row's scale and zero from its minimum and maximum (shared by the host
/// and device codecs, so both round the same operations).
KVP_HOST_DEVICE inline void scale_zero(float mn, float mx, int bits, float* scale, float* zero) noexcept {
  const float top = static_cast<float>((1 << bits) - 1);
  const float range = mx - mn;
  *scale = (range > 1e-8f ? range : 1e-8f) / top;
  *zero = -mn / *scale;
}
/// One value's code: trunc(v / scale + zero + 0.5) clamped to [0, 2^bits - 1].
KVP_HOST_DEVICE inline std::uint8_t code(float v, float scale, float zero, int bits) noexcept {
  const float top = static_cast<float>((1 << bits) - 1);
#if defined(__CUDA_ARCH__)
  const float t = truncf(v / scale + zero + 0.5f);
#else
  const float t = std::trunc(v / scale + zero + 0.5f);
#endif
  return static_cast<std::uint8_t>(t < 0.0f ? 0.0f : (t > top ? top : t));
}
/// One code's value: (q - zero) * scale.
KVP_HOST_DEVICE inline float value(unsigned q, float scale, float zero) noexcept { return (static_cast<float>(q) - zero) * scale; }

/// Quantizes one finite row x[0, d) into `out` (row_bytes(d, bits) bytes).
inline void quantize_row(const float* x, std::int64_t d, int bits, std::uint8_t* out) noexcept {
  float mn = x[0], mx = x[0];
  for (std::int64_t i = 1; i < d; ++i) {
    mn = x[i] < mn ? x[i] : mn;
    mx = x[i] > mx ? x[i] : mx;
  }
  float scale, zero;
  scale_zero(mn, mx, bits, &scale, &zero);
  if (bits == 4) {
    const std::int64_t h = d / 2;
    for (std::int64_t i = 0; i < h; ++i)
      out[i] = static_cast<std::uint8_t>(code(x[i], scale, zero, 4) | code(x[i + h], scale, zero, 4) << 4);
  } else {
    for (std::int64_t i = 0; i < d; ++i) out[i] = code(x[i], scale, zero, bits);
  }
  std::memcpy(out + d * bits / 8, &scale, 4);
  std::memcpy(out + d * bits / 8 + 4, &zero, 4);
}
/// Decodes one row into y[0, d).
inline void dequantize_row(const std::uint8_t* in, std::int64_t d, int bits, float* y) noexcept {
  float scale, zero;
  std::memcpy(&scale, in + d * bits / 8, 4);
  std::memcpy(&zero, in + d * bits / 8 + 4, 4);
  if (bits == 4) {
    const std::int64_t h = d / 2;
    for (std::int64_t i = 0; i < h; ++i) {
      y[i] = value(in[i] & 15u, scale, zero);
      y[i + h] = value(in[i] >> 4, scale, zero);
    }
  } else {
    for (std::int64_t i = 0; i < d; ++i) y[i] = value(in[i], scale, zero);
  }
}

}  // namespace int4q
KVP_NAMESPACE_END
