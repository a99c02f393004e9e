// SPDX-License-Identifier: Apache-2.0
// The ggml block algorithms (quant/ggml.hpp documents them), written once and
// compiled twice: as the reference (`ggml_ref` in ggml.hpp) and in the CPU
// backend's per-ISA units (backends/cpu/src/quant_kernels_impl.hpp), where the
// loops over a block vectorise. No #pragma once: the includer opens the
// namespace and defines, before including,
//   float mul(float, float)                product rounded once, never fused into an add
//   void put_half(std::uint8_t*, float)    fp16 store, round to nearest even
//   float get_half(const std::uint8_t*)    fp16 load
// Only compiler builtins are called here (no inline library function that a
// per-ISA unit would emit with its own instructions). The includer may also
// define KVP_GGML_FN, the functions' specifiers (default `inline`; the CUDA
// backend's unit makes them `__device__ inline`), and a `kIq4nlValues` of
// its own namespace that the device can read.
#ifndef KVP_GGML_FN
#define KVP_GGML_FN inline
#endif

// Reductions over a block in 8 independent lanes (the compiler keeps them in
// one vector register); exact in any order for finite values.
KVP_GGML_FN float abs_max(const float* x) noexcept {
  float m[8] = {};
  for (int j = 0; j < kGgmlBlock; j += 8)
    for (int l = 0; l < 8; ++l) {
      const float a = __builtin_fabsf(x[j + l]);
      m[l] = a > m[l] ? a : m[l];
    }
  float r = m[0];
  for (int l = 1; l < 8; ++l) r = m[l] > r ? m[l] : r;
  return r;
}
/// The element of largest |x| with its sign (the first one on ties), as numpy's argmax.
KVP_GGML_FN float signed_absmax(const float* x) noexcept {
  const float amax = abs_max(x);
  int j = 0;
  while (j < kGgmlBlock - 1 && __builtin_fabsf(x[j]) != amax) ++j;
  return x[j];
}
KVP_GGML_FN void min_max(const float* x, float* mn, float* mx) noexcept {
  float lo[8], hi[8];
  for (int l = 0; l < 8; ++l) lo[l] = hi[l] = x[l];
  for (int j = 8; j < kGgmlBlock; j += 8)
    for (int l = 0; l < 8; ++l) {
      lo[l] = x[j + l] < lo[l] ? x[j + l] : lo[l];
      hi[l] = x[j + l] > hi[l] ? x[j + l] : hi[l];
    }
  float a = lo[0], b = hi[0];
  for (int l = 1; l < 8; ++l) {
    a = lo[l] < a ? lo[l] : a;
    b = hi[l] > b ? hi[l] : b;
  }
  *mn = a, *mx = b;
}
/// numpy's np_roundf / C roundf on a finite float: half away from zero.
KVP_GGML_FN float round_away(float v) noexcept {
  const float a = __builtin_fabsf(v);
  const float f = __builtin_floorf(a);
  const float r = f + __builtin_floorf(2.0f * (a - f));
  return v < 0.0f ? -r : r;
}
KVP_GGML_FN void pack_nibbles(const std::uint8_t* q, std::uint8_t* qs) noexcept {
  for (int j = 0; j < 16; ++j) qs[j] = static_cast<std::uint8_t>((q[j] & 0x0f) | ((q[j + 16] & 0x0f) << 4));
}
KVP_GGML_FN void pack_high_bits(const std::uint8_t* q, std::uint8_t* qh) noexcept {
  std::uint32_t h = 0;
  for (int j = 0; j < kGgmlBlock; ++j) h |= static_cast<std::uint32_t>((q[j] >> 4) & 1u) << j;
  for (int b = 0; b < 4; ++b) qh[b] = static_cast<std::uint8_t>(h >> (8 * b));
}
KVP_GGML_FN std::uint8_t nibble(const std::uint8_t* qs, int j) noexcept {
  return j < 16 ? static_cast<std::uint8_t>(qs[j] & 0x0f) : static_cast<std::uint8_t>(qs[j - 16] >> 4);
}
KVP_GGML_FN std::uint32_t high_bits(const std::uint8_t* qh) noexcept {
  return static_cast<std::uint32_t>(qh[0]) | static_cast<std::uint32_t>(qh[1]) << 8 | static_cast<std::uint32_t>(qh[2]) << 16 |
         static_cast<std::uint32_t>(qh[3]) << 24;
}
/// ggml's best_index_int8 over kIq4nlValues: the nearest entry, the upper one at an exact midpoint.
KVP_GGML_FN int iq4nl_index(float x) noexcept {
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

KVP_GGML_FN void quantize_q8_0(const float* x, std::uint8_t* out) noexcept {
  const float amax = abs_max(x);
  const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  put_half(out, d);
  std::int32_t q[kGgmlBlock];
  for (int j = 0; j < kGgmlBlock; ++j) q[j] = static_cast<std::int32_t>(round_away(mul(x[j], id)));
  for (int j = 0; j < kGgmlBlock; ++j) out[2 + j] = static_cast<std::uint8_t>(q[j] & 0xff);
}
KVP_GGML_FN void dequantize_q8_0(const std::uint8_t* in, float* y) noexcept {
  const float d = get_half(in);
  for (int j = 0; j < kGgmlBlock; ++j) y[j] = static_cast<float>(static_cast<std::int8_t>(in[2 + j])) * d;
}

/// q4_0 (levels = 8, top = 15) and q5_0 (levels = 16, top = 31).
KVP_GGML_FN void quantize_sym(const float* x, std::uint8_t* q, float* d_out, int levels, int top) noexcept {
  const float mx = signed_absmax(x);
  const float d = mx / static_cast<float>(-levels), id = d != 0.0f ? 1.0f / d : 0.0f;
  const float bias = static_cast<float>(levels) + 0.5f;
  std::int32_t qi[kGgmlBlock];
  for (int j = 0; j < kGgmlBlock; ++j) qi[j] = static_cast<std::int32_t>(mul(x[j], id) + bias);  // >= 0: truncation
  for (int j = 0; j < kGgmlBlock; ++j) q[j] = static_cast<std::uint8_t>(qi[j] > top ? top : qi[j]);
  *d_out = d;
}
/// q4_1 (top = 15) and q5_1 (top = 31).
KVP_GGML_FN void quantize_asym(const float* x, std::uint8_t* q, float* d_out, float* m_out, int top) noexcept {
  float mn, mx;
  min_max(x, &mn, &mx);
  const float d = (mx - mn) / static_cast<float>(top), id = d != 0.0f ? 1.0f / d : 0.0f;
  std::int32_t qi[kGgmlBlock];
  for (int j = 0; j < kGgmlBlock; ++j) qi[j] = static_cast<std::int32_t>(mul(x[j] - mn, id) + 0.5f);  // >= 0: truncation
  for (int j = 0; j < kGgmlBlock; ++j) q[j] = static_cast<std::uint8_t>(qi[j] > top ? top : qi[j]);
  *d_out = d, *m_out = mn;
}

KVP_GGML_FN void quantize_q4_0(const float* x, std::uint8_t* out) noexcept {
  std::uint8_t q[kGgmlBlock];
  float d;
  quantize_sym(x, q, &d, 8, 15);
  put_half(out, d);
  pack_nibbles(q, out + 2);
}
KVP_GGML_FN void dequantize_q4_0(const std::uint8_t* in, float* y) noexcept {
  const float d = get_half(in);
  for (int j = 0; j < kGgmlBlock; ++j) y[j] = d * static_cast<float>(static_cast<int>(nibble(in + 2, j)) - 8);
}
KVP_GGML_FN void quantize_q4_1(const float* x, std::uint8_t* out) noexcept {
  std::uint8_t q[kGgmlBlock];
  float d, m;
  quantize_asym(x, q, &d, &m, 15);
  put_half(out, d);
  put_half(out + 2, m);
  pack_nibbles(q, out + 4);
}
KVP_GGML_FN void dequantize_q4_1(const std::uint8_t* in, float* y) noexcept {
  const float d = get_half(in), m = get_half(in + 2);
  for (int j = 0; j < kGgmlBlock; ++j) y[j] = mul(d, static_cast<float>(nibble(in + 4, j))) + m;
}
KVP_GGML_FN void quantize_q5_0(const float* x, std::uint8_t* out) noexcept {
  std::uint8_t q[kGgmlBlock];
  float d;
  quantize_sym(x, q, &d, 16, 31);
  put_half(out, d);
  pack_high_bits(q, out + 2);
  pack_nibbles(q, out + 6);
}
KVP_GGML_FN void dequantize_q5_0(const std::uint8_t* in, float* y) noexcept {
  const float d = get_half(in);
  const std::uint32_t h = high_bits(in + 2);
  for (int j = 0; j < kGgmlBlock; ++j) {
    const int q = nibble(in + 6, j) | static_cast<int>(((h >> j) & 1u) << 4);
    y[j] = d * static_cast<float>(q - 16);
  }
}
KVP_GGML_FN void quantize_q5_1(const float* x, std::uint8_t* out) noexcept {
  std::uint8_t q[kGgmlBlock];
  float d, m;
  quantize_asym(x, q, &d, &m, 31);
  put_half(out, d);
  put_half(out + 2, m);
  pack_high_bits(q, out + 4);
  pack_nibbles(q, out + 8);
}
KVP_GGML_FN void dequantize_q5_1(const std::uint8_t* in, float* y) noexcept {
  const float d = get_half(in), m = get_half(in + 2);
  const std::uint32_t h = high_bits(in + 4);
  for (int j = 0; j < kGgmlBlock; ++j) {
    const int q = nibble(in + 8, j) | static_cast<int>(((h >> j) & 1u) << 4);
    y[j] = mul(d, static_cast<float>(q)) + m;
  }
}
KVP_GGML_FN void quantize_iq4_nl(const float* x, std::uint8_t* out) noexcept {
  std::uint8_t q[kGgmlBlock] = {};
  float amax = 0.0f, mx = 0.0f;
  for (int j = 0; j < kGgmlBlock; ++j) {
    const float a = __builtin_fabsf(x[j]);
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
KVP_GGML_FN void dequantize_iq4_nl(const std::uint8_t* in, float* y) noexcept {
  const float d = get_half(in);
  for (int j = 0; j < kGgmlBlock; ++j) y[j] = d * static_cast<float>(kIq4nlValues[nibble(in + 2, j)]);
}

#undef KVP_GGML_FN
