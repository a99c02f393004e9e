// SPDX-License-Identifier: Apache-2.0
// The order keys every top-k and ranking of the library sorts by, on the host
// and on a device alike.
#pragma once

#include <bit>
#include <cstdint>

#include "kvpolicy/core/config.hpp"

KVP_NAMESPACE_BEGIN

/// Total order used by every top-k in the library: higher score first; equal
/// scores -> higher token index first (the more recent token survives); NaN
/// ranks below every number including -inf. Implemented as a monotone map of
/// the float to an unsigned key, so all backends agree bit for bit.
KVP_HOST_DEVICE inline std::uint32_t score_order_key(float f) noexcept {
  if (f != f) return 0u;  // NaN: lowest
#if defined(__CUDA_ARCH__)
  const std::uint32_t u = __float_as_uint(f);
#else
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
#endif
  const std::uint32_t k = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return k == 0u ? 1u : k;  // keep 0 reserved for NaN (only -NaN patterns could map there)
}

/// rank_tiers' order key: score_order_key with -0 taken as +0 (the tiers compare scores as numbers).
KVP_HOST_DEVICE inline std::uint32_t tier_order_key(float f) noexcept { return score_order_key(f == 0.0f ? 0.0f : f); }

KVP_NAMESPACE_END
