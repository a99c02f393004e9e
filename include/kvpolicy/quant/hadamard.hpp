// SPDX-License-Identifier: Apache-2.0
// Block-diagonal Hadamard rotation of K/V rows before quantization: one
// transform, two conventions of choosing its block size n.
//
//   R = diag(H_n, ..., H_n) over consecutive n-channel slices of a head
//   vector, H_n the Sylvester Hadamard matrix (H_1 = [1], H_2m = [[H, H],
//   [H, -H]]) scaled by 1 / sqrt(n), so R = R^T = R^-1 and q . k = Rq . Rk.
//
//   HadamardMode::kLlamaCpp   llama.cpp's attn_rot (PR #21038): keys n = the
//                             largest power of two >= 64 dividing head_dim
//                             (128 at D = 128, 64 at D = 576), values n = 64;
//                             it rotates Q and K before the store, V too, and
//                             un-rotates the attention output. As in
//                             llama.cpp, a head_dim that is not a multiple
//                             of 64 is not rotated (n = 0).
//   HadamardMode::kBlock      SAW-INT4's block-diagonal rotation (BDR) with
//                             block `n` (its README's main results: 128, keys
//                             only; its code default 16); n a power of two
//                             dividing head_dim.
//   HadamardMode::kNone       no rotation.
//
// Computed as an in-place fast Walsh-Hadamard transform (n log2 n additions
// per block, natural Sylvester order), then one multiply by 1/sqrt(n) in fp32.
// llama.cpp multiplies by the matrix (an fp32 GEMM with its own summation
// order) and SAW-INT4 scales before transforming, so results agree to fp32
// rounding, not bit for bit: tests compare against the float64 matrix
// product with a relative tolerance of 1e-6, and the quantizers after the
// rotation bit-exactly.
//
// Keys are rotated post-RoPE (as the engines store them); queries must be
// rotated with the same R at attention (or the decoded keys un-rotated), and
// if V is rotated the attention output is rotated back (R^-1 = R).
#pragma once

#include <cmath>
#include <cstdint>

#include "kvpolicy/core/status.hpp"

KVP_NAMESPACE_BEGIN

enum class HadamardMode : std::uint8_t { kNone, kLlamaCpp, kBlock };

/// The largest head_dim the rotating quantizers accept (their per-row scratch).
inline constexpr std::int64_t kMaxRotatedHeadDim = 4096;

constexpr bool is_power_of_two(std::int64_t n) noexcept { return n > 0 && (n & (n - 1)) == 0; }

/// The rotation's block size for `head_dim` (0: no rotation), or an error naming the constraint.
inline Status hadamard_block(HadamardMode mode, std::int64_t block, bool keys, std::int64_t head_dim, const char* who,
                             std::int64_t* n) noexcept {
  *n = 0;
  switch (mode) {
    case HadamardMode::kNone: return Status::ok();
    case HadamardMode::kLlamaCpp: {
      if (head_dim < 64 || head_dim % 64 != 0) return Status::ok();  // llama.cpp leaves such heads unrotated
      std::int64_t b = 64;
      if (keys)
        while (head_dim % (b * 2) == 0) b *= 2;
      *n = b;
      return Status::ok();
    }
    case HadamardMode::kBlock:
      KVP_REQUIRE(is_power_of_two(block) && head_dim % block == 0, "%s: rotation block %lld must be a power of two dividing head_dim %lld",
                  who, static_cast<long long>(block), static_cast<long long>(head_dim));
      *n = block;
      return Status::ok();
  }
  return KVP_INVALID("%s: rotation mode %d is not none, llama_cpp or block", who, static_cast<int>(mode));
}

/// The fp32 factor 1 / sqrt(n) applied after the additions (every backend's transform multiplies by this value).
inline float hadamard_scale(std::int64_t n) noexcept { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(n))); }

/// x[0, d) <- R x with blocks of n (n a power of two dividing d; n <= 1 leaves x as is).
inline void hadamard_rotate(float* x, std::int64_t d, std::int64_t n) noexcept {
  if (n <= 1) return;
  const float s = hadamard_scale(n);
  for (std::int64_t base = 0; base < d; base += n) {
    float* b = x + base;
    for (std::int64_t len = 1; len < n; len <<= 1)
      for (std::int64_t i = 0; i < n; i += 2 * len)
        for (std::int64_t j = i; j < i + len; ++j) {
          const float a = b[j], c = b[j + len];
          b[j] = a + c;
          b[j + len] = a - c;
        }
    for (std::int64_t j = 0; j < n; ++j) b[j] *= s;
  }
}

KVP_NAMESPACE_END
