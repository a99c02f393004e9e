// SPDX-License-Identifier: Apache-2.0
//
// Deterministic fixture inputs, bit-identical to tests/reference/fixture_rng.py (recipe "kvp-fixture-v1").
//
// A counter-based generator: every element is a pure function of (seed, stream, index) through the splitmix64
// finaliser, so any slice of any tensor can be regenerated without the rest. Every float is an integer times a
// power of two, built in integer arithmetic and converted once (int32 -> float is exact below 2^24, ldexp is
// exact), so the bits do not depend on the compiler, FMA contraction or summation order.
//
// Tensors are row-major (head, token, dim); the element hash index is (head * tokens + token) * dim + c, where
// `tokens` is the full sequence length of the case (a token slice [t0, t1) hashes the same indices as the full
// tensor). The normative spec is tests/reference/README.md, section "RNG spec".
#pragma once

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvp_fixtures {

inline constexpr std::uint64_t kStreamQueryNoise = 1;
inline constexpr std::uint64_t kStreamKeyNoise = 2;
inline constexpr std::uint64_t kStreamValueNoise = 3;
inline constexpr std::uint64_t kStreamDirection = 4;
inline constexpr std::uint64_t kStreamKeyToken = 5;
inline constexpr std::uint64_t kStreamQueryHead = 6;
inline constexpr std::uint64_t kStreamValueToken = 7;
inline constexpr int kNoiseFracBits = 21;

constexpr std::uint64_t splitmix64(std::uint64_t x) noexcept {
  std::uint64_t z = x + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

constexpr std::uint64_t stream_key(std::uint64_t seed, std::uint64_t stream) noexcept { return splitmix64(splitmix64(seed) ^ stream); }

// hash(seed, stream, index) = sm(sm(sm(seed) ^ stream) ^ index)
constexpr std::uint64_t fixture_hash(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) noexcept {
  return splitmix64(stream_key(seed, stream) ^ index);
}

// Top 24 bits -> float in [-1, 1), multiples of 2^-23 (exact).
inline float uniform24(std::uint64_t h) noexcept {
  const auto m = static_cast<std::int32_t>(h >> 40) - (1 << 23);
  return std::ldexp(static_cast<float>(m), -23);
}

// Sum of three centred 21-bit fields (bits 43..63, 22..42, 1..21): an integer in [-3*2^20, 3*2^20).
constexpr std::int32_t noise_int(std::uint64_t h) noexcept {
  constexpr std::uint64_t f = 0x1FFFFF;
  return static_cast<std::int32_t>(((h >> 43) & f) + ((h >> 22) & f) + ((h >> 1) & f)) - 3 * (1 << 20);
}

// dir[g][c] = +-0.5, as the integer +-2^20 in units of 2^-21.
inline std::int32_t direction_int(std::uint64_t seed, int dim, int kv_head, int c) noexcept {
  const std::uint64_t h = fixture_hash(seed, kStreamDirection, static_cast<std::uint64_t>(kv_head) * dim + c);
  return (h >> 63) ? -(1 << 20) : (1 << 20);
}

struct KeyTokenParams {
  int exponent;  // in {-1, 0, 1}
  int level;     // heavy-direction multiple in {0 (not heavy), 1, 2, 3, 4}
};

inline KeyTokenParams key_token_params(std::uint64_t seed, int tokens, int kv_head, int t) noexcept {
  static constexpr int kExp[8] = {-1, 0, 0, 0, 0, 0, 1, 1};
  const std::uint64_t h = fixture_hash(seed, kStreamKeyToken, static_cast<std::uint64_t>(kv_head) * tokens + static_cast<std::uint64_t>(t));
  const bool heavy = ((h >> 55) & 63) < 2;
  return {kExp[h >> 61], heavy ? 1 + static_cast<int>((h >> 53) & 3) : 0};
}

struct QueryHeadParams {
  int exponent;  // in {0, 1}
  int align;     // alignment with the kv head's heavy direction, in quarters: {0, 1, 2, 3} * 0.25
};

inline QueryHeadParams query_head_params(std::uint64_t seed, int q_head) noexcept {
  const std::uint64_t h = fixture_hash(seed, kStreamQueryHead, static_cast<std::uint64_t>(q_head));
  return {static_cast<int>((h >> 61) & 1), static_cast<int>((h >> 62) & 3)};
}

inline int value_token_exponent(std::uint64_t seed, int tokens, int kv_head, int t) noexcept {
  static constexpr int kExp[4] = {-1, 0, 0, 1};
  const std::uint64_t h =
      fixture_hash(seed, kStreamValueToken, static_cast<std::uint64_t>(kv_head) * tokens + static_cast<std::uint64_t>(t));
  return kExp[h >> 62];
}

namespace detail {
inline std::size_t clamp_t1(int tokens, int t1) { return static_cast<std::size_t>(t1 < 0 ? tokens : t1); }
}  // namespace detail

// keys[g][t][c] = (noise + level[g][t] * dir[g][c]) * 2^exp[g][t], for t in [t0, t1); shape (Hkv, t1-t0, d).
inline std::vector<float> gen_keys(std::uint64_t seed, int num_kv_heads, int tokens, int dim, int t0 = 0, int t1 = -1) {
  const std::size_t te = detail::clamp_t1(tokens, t1);
  const std::size_t nt = te - static_cast<std::size_t>(t0);
  std::vector<float> out(static_cast<std::size_t>(num_kv_heads) * nt * dim);
  const std::uint64_t key = stream_key(seed, kStreamKeyNoise);
  std::vector<std::int32_t> dir(dim);
  for (int g = 0; g < num_kv_heads; ++g) {
    for (int c = 0; c < dim; ++c) dir[c] = direction_int(seed, dim, g, c);
    for (std::size_t t = static_cast<std::size_t>(t0); t < te; ++t) {
      const KeyTokenParams p = key_token_params(seed, tokens, g, static_cast<int>(t));
      const std::uint64_t base = (static_cast<std::uint64_t>(g) * tokens + t) * dim;
      float* row = out.data() + (static_cast<std::size_t>(g) * nt + (t - t0)) * dim;
      for (int c = 0; c < dim; ++c) {
        const std::int32_t x = noise_int(splitmix64(key ^ (base + c))) + p.level * dir[c];
        row[c] = std::ldexp(static_cast<float>(x), p.exponent - kNoiseFracBits);
      }
    }
  }
  return out;
}

// queries[h][t][c] = (noise + align[h] * 0.25 * dir[h/G][c]) * 2^exp[h]; shape (Hq, t1-t0, d).
inline std::vector<float> gen_queries(std::uint64_t seed, int num_q_heads, int num_kv_heads, int tokens, int dim, int t0 = 0, int t1 = -1) {
  const std::size_t te = detail::clamp_t1(tokens, t1);
  const std::size_t nt = te - static_cast<std::size_t>(t0);
  const int group = num_q_heads / num_kv_heads;
  std::vector<float> out(static_cast<std::size_t>(num_q_heads) * nt * dim);
  const std::uint64_t key = stream_key(seed, kStreamQueryNoise);
  std::vector<std::int32_t> add(dim);
  for (int h = 0; h < num_q_heads; ++h) {
    const QueryHeadParams p = query_head_params(seed, h);
    for (int c = 0; c < dim; ++c) add[c] = p.align * (direction_int(seed, dim, h / group, c) / 4);
    for (std::size_t t = static_cast<std::size_t>(t0); t < te; ++t) {
      const std::uint64_t base = (static_cast<std::uint64_t>(h) * tokens + t) * dim;
      float* row = out.data() + (static_cast<std::size_t>(h) * nt + (t - t0)) * dim;
      for (int c = 0; c < dim; ++c) {
        const std::int32_t x = noise_int(splitmix64(key ^ (base + c))) + add[c];
        row[c] = std::ldexp(static_cast<float>(x), p.exponent - kNoiseFracBits);
      }
    }
  }
  return out;
}

// values[g][t][c] = noise * 2^vexp[g][t]; shape (Hkv, t1-t0, d).
inline std::vector<float> gen_values(std::uint64_t seed, int num_kv_heads, int tokens, int dim, int t0 = 0, int t1 = -1) {
  const std::size_t te = detail::clamp_t1(tokens, t1);
  const std::size_t nt = te - static_cast<std::size_t>(t0);
  std::vector<float> out(static_cast<std::size_t>(num_kv_heads) * nt * dim);
  const std::uint64_t key = stream_key(seed, kStreamValueNoise);
  for (int g = 0; g < num_kv_heads; ++g) {
    for (std::size_t t = static_cast<std::size_t>(t0); t < te; ++t) {
      const int e = value_token_exponent(seed, tokens, g, static_cast<int>(t));
      const std::uint64_t base = (static_cast<std::uint64_t>(g) * tokens + t) * dim;
      float* row = out.data() + (static_cast<std::size_t>(g) * nt + (t - t0)) * dim;
      for (int c = 0; c < dim; ++c) row[c] = std::ldexp(static_cast<float>(noise_int(splitmix64(key ^ (base + c)))), e - kNoiseFracBits);
    }
  }
  return out;
}

// The drift check stored in every fixture: exact double sum (order-independent for these dyadic values), a
// position-sensitive checksum sum_i bits(x_i) * (2i+1) mod 2^64 of the float32 bit patterns.
struct TensorChecksum {
  double sum = 0.0;
  std::uint64_t bits_checksum = 0;
};

inline TensorChecksum checksum(const std::vector<float>& x) noexcept {
  TensorChecksum r;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const auto b = std::bit_cast<std::uint32_t>(x[i]);
    r.sum += static_cast<double>(x[i]);
    r.bits_checksum += static_cast<std::uint64_t>(b) * (2 * static_cast<std::uint64_t>(i) + 1);
  }
  return r;
}

}  // namespace kvp_fixtures
