// SPDX-License-Identifier: Apache-2.0
// KIVI's asymmetric 2/4/8-bit formats (ICML 2024, `jy-yuan/KIVI`
// quant/new_pack.py): keys quantized per channel in groups of G consecutive
// tokens, values per token in groups of G consecutive channels. One group of
// n values x (n = G):
//
//   mn = min(x), mx = max(x)
//   scale = (mx - mn) / (2^b - 1)
//   q = round_half_even(clamp((x - mn) / scale, 0, 2^b - 1))
//   x^ = q * scale + mn
//
// Arithmetic: KIVI runs on an fp16 model and every one of the lines above is a
// PyTorch fp16 operation, so each subtraction, division, product and sum is
// rounded to fp16 (round to nearest even) before the next one; `scale` and
// `mn` are stored as fp16. The library computes exactly that: inputs are
// first rounded to fp16 (exact for fp16 caches), and the results are
// bit-identical with the reference's torch code (committed fixtures from
// tests/reference/make_kivi_fixtures.py).
//
// Where the reference is undefined the library chooses, documented here and
// tested: a constant group has scale 0, and the reference's 0 / 0 = NaN is
// cast to an integer (an arbitrary code); the library stores q = 0 there, so
// the group decodes to mn exactly. A non-zero difference over a scale that
// underflowed to 0 is +inf, clamped to 2^b - 1, as in the reference. A group
// whose range mx - mn overflows fp16 (|x| near 65504) would decode to NaN;
// the policy entry points reject it before writing anything.
//
// Packing (32 / b codes per little-endian uint32, code j of a word at bits
// [b*j, b*j + b)):
//   keys, one group of G tokens of one kv head (the reference's
//     `code[.., T / (32/b), D]`, tokens packed along T): words (G*b/32, D),
//     word (w, c) at byte offset 4 * (w * D + c) holds channel c of tokens
//     w*32/b .. w*32/b + 32/b - 1; then D fp16 scales and D fp16 minimums.
//   values, one token of one kv head (`code[.., T, D / (32/b)]`): words
//     D*b/32, word w holds channels w*32/b ..; then D/G fp16 scales and D/G
//     fp16 minimums.
// So one token costs D*b/8 code bytes plus 4*D/G bytes of scales for either
// role (KIVI-2, G = 32, D = 128: 48 bytes per token and kv head, against 256
// in fp16).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kvpolicy/core/dtype.hpp"

KVP_NAMESPACE_BEGIN
namespace kivi {

KVP_HOST_DEVICE constexpr bool bits_valid(int bits) noexcept { return bits == 2 || bits == 4 || bits == 8; }

/// One role's format as the backends' kivi_*_tokens ops take it: keys (per-channel groups of `group`
/// tokens) or values (per-token groups of `group` channels), `bits` per code.
struct Codec {
  bool keys = true;
  int bits = 2;
  int group = 32;
};
/// Codes per 32-bit word.
KVP_HOST_DEVICE constexpr int per_word(int bits) noexcept { return 32 / bits; }

/// x rounded to fp16 and back (one fp16 operation's result).
KVP_HOST_DEVICE inline float r16(float x) noexcept { return to_float(to_half(x)); }

KVP_HOST_DEVICE inline void store_half(std::uint8_t* p, float v) noexcept {  // little endian
  const std::uint16_t b = to_half(v).bits;
  p[0] = static_cast<std::uint8_t>(b & 0xffu);
  p[1] = static_cast<std::uint8_t>(b >> 8);
}
KVP_HOST_DEVICE inline float load_half(const std::uint8_t* p) noexcept {
  return to_float(half::from_bits(static_cast<std::uint16_t>(p[0] | (p[1] << 8))));
}
KVP_HOST_DEVICE inline std::uint32_t load_word(const std::uint8_t* p) noexcept {
  return static_cast<std::uint32_t>(p[0]) | static_cast<std::uint32_t>(p[1]) << 8 | static_cast<std::uint32_t>(p[2]) << 16 |
         static_cast<std::uint32_t>(p[3]) << 24;
}
KVP_HOST_DEVICE inline void store_word(std::uint8_t* p, std::uint32_t w) noexcept {
  p[0] = static_cast<std::uint8_t>(w);
  p[1] = static_cast<std::uint8_t>(w >> 8);
  p[2] = static_cast<std::uint8_t>(w >> 16);
  p[3] = static_cast<std::uint8_t>(w >> 24);
}

/// The fp16 scale and minimum of n fp16-valued floats (the reference's two first lines).
struct GroupRange {
  float mn = 0.0f, scale = 0.0f;
  bool finite = true;  ///< false when mx - mn overflows fp16
};
KVP_HOST_DEVICE inline GroupRange group_range(const float* x, int n, int bits) noexcept {
  float mn = x[0], mx = x[0];
  for (int i = 1; i < n; ++i) {
    mn = x[i] < mn ? x[i] : mn;
    mx = x[i] > mx ? x[i] : mx;
  }
  const float range = r16(mx - mn);
  GroupRange g;
  g.mn = mn;
  g.scale = r16(range / static_cast<float>((1 << bits) - 1));
  g.finite = range - range == 0.0f;  // false for inf and NaN
  return g;
}

/// The code of one fp16-valued x in a group (reference rounding; NaN from a zero scale -> 0).
KVP_HOST_DEVICE inline std::uint32_t code_of(float x, const GroupRange& g, int bits) noexcept {
  float v = r16(r16(x - g.mn) / g.scale);
  if (v != v) v = 0.0f;
  const float top = static_cast<float>((1 << bits) - 1);
  v = v < 0.0f ? 0.0f : (v > top ? top : v);
#if defined(__CUDA_ARCH__)
  return static_cast<std::uint32_t>(rintf(v));  // ties to even, as nearbyint in the default rounding mode
#else
  return static_cast<std::uint32_t>(std::nearbyint(v));
#endif
}

/// The decoded value of a code: fp16(fp16(q * scale) + mn).
KVP_HOST_DEVICE inline float decode(std::uint32_t q, float scale, float mn) noexcept {
  return r16(r16(static_cast<float>(q) * scale) + mn);
}

// ---- keys: one group of G tokens of one head ------------------------------------------------------

KVP_HOST_DEVICE constexpr std::int64_t key_group_code_bytes(std::int64_t head_dim, int group, int bits) noexcept {
  return head_dim * group * bits / 8;
}
KVP_HOST_DEVICE constexpr std::int64_t key_group_scale_bytes(std::int64_t head_dim) noexcept { return 4 * head_dim; }

/// Quantizes channel c of a key group: x[t] (t < G) fp16-valued; writes the packed codes of channel c
/// into `codes` (the group's word array) and its scale / minimum into `scales`.
KVP_HOST_DEVICE inline void quantize_key_channel(const float* x, std::int64_t head_dim, std::int64_t c, int group, int bits,
                                                 std::uint8_t* codes, std::uint8_t* scales) noexcept {
  const GroupRange g = group_range(x, group, bits);
  const int f = per_word(bits);
  for (int w = 0; w < group / f; ++w) {
    std::uint32_t word = 0;
    for (int j = 0; j < f; ++j) word |= code_of(x[w * f + j], g, bits) << (bits * j);
    store_word(codes + 4 * (w * head_dim + c), word);
  }
  store_half(scales + 2 * c, g.scale);
  store_half(scales + 2 * (head_dim + c), g.mn);
}

/// Decodes channel c of a key group into y[t * y_stride] for t < G.
template <class T>
KVP_HOST_DEVICE inline void dequantize_key_channel(const std::uint8_t* codes, const std::uint8_t* scales, std::int64_t head_dim,
                                                   std::int64_t c, int group, int bits, T* y, std::int64_t y_stride) noexcept {
  const float scale = load_half(scales + 2 * c), mn = load_half(scales + 2 * (head_dim + c));
  const int f = per_word(bits);
  const std::uint32_t mask = (1u << bits) - 1u;
  for (int w = 0; w < group / f; ++w) {
    const std::uint32_t word = load_word(codes + 4 * (w * head_dim + c));
    for (int j = 0; j < f; ++j) y[(w * f + j) * y_stride] = from_float<T>(decode((word >> (bits * j)) & mask, scale, mn));
  }
}

// ---- values: one token of one head -----------------------------------------------------------------

KVP_HOST_DEVICE constexpr std::int64_t value_row_code_bytes(std::int64_t head_dim, int bits) noexcept { return head_dim * bits / 8; }
KVP_HOST_DEVICE constexpr std::int64_t value_row_scale_bytes(std::int64_t head_dim, int group) noexcept { return 4 * (head_dim / group); }

/// The fp16 scales and minimums of one value row x[0, D) (fp16-valued), one pair per channel group of G.
KVP_HOST_DEVICE inline void value_row_scales(const float* x, std::int64_t head_dim, int group, int bits, std::uint8_t* scales) noexcept {
  const std::int64_t groups = head_dim / group;
  for (std::int64_t gi = 0; gi < groups; ++gi) {
    const GroupRange g = group_range(x + gi * group, group, bits);
    store_half(scales + 2 * gi, g.scale);
    store_half(scales + 2 * (groups + gi), g.mn);
  }
}
/// Word w of a value row's codes, against the row's stored scales (value_row_scales).
KVP_HOST_DEVICE inline std::uint32_t value_row_word(const float* x, std::int64_t head_dim, int group, int bits, const std::uint8_t* scales,
                                                    std::int64_t w) noexcept {
  const std::int64_t groups = head_dim / group;
  const int f = per_word(bits);
  std::uint32_t word = 0;
  for (int j = 0; j < f; ++j) {
    const std::int64_t c = w * f + j, gi = c / group;
    const GroupRange g{load_half(scales + 2 * (groups + gi)), load_half(scales + 2 * gi), true};
    word |= code_of(x[c], g, bits) << (bits * j);
  }
  return word;
}
/// Quantizes one value row x[0, D) (fp16-valued) in channel groups of G.
KVP_HOST_DEVICE inline void quantize_value_row(const float* x, std::int64_t head_dim, int group, int bits, std::uint8_t* codes,
                                               std::uint8_t* scales) noexcept {
  value_row_scales(x, head_dim, group, bits, scales);
  for (std::int64_t w = 0; w < head_dim / per_word(bits); ++w)
    store_word(codes + 4 * w, value_row_word(x, head_dim, group, bits, scales, w));
}

/// Decodes word w of a value row into y[w * 32 / bits ..).
template <class T>
KVP_HOST_DEVICE inline void dequantize_value_word(const std::uint8_t* codes, const std::uint8_t* scales, std::int64_t head_dim, int group,
                                                  int bits, std::int64_t w, T* y) noexcept {
  const std::int64_t groups = head_dim / group;
  const int f = per_word(bits);
  const std::uint32_t mask = (1u << bits) - 1u;
  const std::uint32_t word = load_word(codes + 4 * w);
  for (int j = 0; j < f; ++j) {
    const std::int64_t c = w * f + j, gi = c / group;
    y[c] = from_float<T>(decode((word >> (bits * j)) & mask, load_half(scales + 2 * gi), load_half(scales + 2 * (groups + gi))));
  }
}
/// Decodes one value row into y[0, D).
template <class T>
KVP_HOST_DEVICE inline void dequantize_value_row(const std::uint8_t* codes, const std::uint8_t* scales, std::int64_t head_dim, int group,
                                                 int bits, T* y) noexcept {
  for (std::int64_t w = 0; w < head_dim / per_word(bits); ++w) dequantize_value_word(codes, scales, head_dim, group, bits, w, y);
}

}  // namespace kivi
KVP_NAMESPACE_END
