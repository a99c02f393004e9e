// SPDX-License-Identifier: Apache-2.0
// The per-token arithmetic of MiniCache (policy/merging/minicache.hpp) on
// widened fp32 rows, host-device: the host path calls it, and so do the
// device kernels (backends/cuda/src/minicache.cu, compiled without FMA
// contraction), so both compute the same products and sums in the same order.
// The transcendental steps (acosf, sinf) are each platform's own: glibc's on
// the host, CUDA's on a device (within 1-2 ulp of each other), which is the
// one place the two can differ (see MiniCache's device contract).
//
//   norm16              sqrt of the row's squares in `row_dots`' order (16
//                       partial sums, ScalarReduceOps::sum16's tree).
//   minicache_distance  Omega / pi of two rows from their normalised dot
//                       (8 partial sums, detail::dot's order).
//   minicache_slerp     the unit SLERP direction (normalised lerp below
//                       sin Omega = 1e-3), renormalised in fp64.
//   minicache_threshold (1 - gamma) d_min + gamma d_max (+1 when flat).
#pragma once

#include <cmath>
#include <cstdint>

#include "kvpolicy/core/config.hpp"

KVP_NAMESPACE_BEGIN
namespace ops {

/// sin Omega below which MiniCache's SLERP falls back to the normalised lerp.
inline constexpr float kMiniCacheLerpBelow = 1e-3f;
/// The norm floor of the distance step (a zero row keeps a zero direction).
inline constexpr float kMiniCacheNormFloor = 1e-30f;

/// sqrt(sum of x[c]^2) with the squares in 16 partial sums p[c % 16], then (p[k] + p[k + 8]), then
/// (+4), then ((s0 + s2) + (s1 + s3)): `ScalarReduceOps::row_dots(x, x)`'s order, each product rounded alone.
KVP_HOST_DEVICE inline float norm16(const float* x, std::int64_t d) noexcept {
  float p[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  for (std::int64_t c = 0; c < d; ++c) p[c % 16] += x[c] * x[c];
  float s8[8], s4[4];
  for (int k = 0; k < 8; ++k) s8[k] = p[k] + p[k + 8];
  for (int k = 0; k < 4; ++k) s4[k] = s8[k] + s8[k + 4];
  return sqrtf((s4[0] + s4[2]) + (s4[1] + s4[3]));
}

/// Omega / pi of rows a and b (widened, norms na / nb): cos Omega = the dot of a / max(na, 1e-30) and
/// b / max(nb, 1e-30) in 8 partial sums (detail::dot's order), clamped to [-1, 1]; 1 when a norm is 0.
KVP_HOST_DEVICE inline float minicache_distance(const float* a, float na, const float* b, float nb, std::int64_t d) noexcept {
  if (na == 0.0f || nb == 0.0f) return acosf(1.0f) / 3.14159265358979323846f;
  const float ia = 1.0f / (na < kMiniCacheNormFloor ? kMiniCacheNormFloor : na);
  const float ib = 1.0f / (nb < kMiniCacheNormFloor ? kMiniCacheNormFloor : nb);
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    for (int k = 0; k < 8; ++k) acc[k] += (a[i + k] * ia) * (b[i + k] * ib);
  for (int k = 0; k < 8 && i + k < d; ++k) acc[k] += (a[i + k] * ia) * (b[i + k] * ib);  // i % 8 == 0: element i + k goes to acc[k]
  const float dot = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  const float cs = dot < -1.0f ? -1.0f : (1.0f < dot ? 1.0f : dot);  // std::clamp (a NaN stays NaN)
  return acosf(cs) / 3.14159265358979323846f;
}

/// e = the unit SLERP at t of the directions of raw rows a (norm na) and b (norm nb): see
/// MiniCache's header for the zero-norm and near-parallel rules.
KVP_HOST_DEVICE inline void minicache_slerp(float t, const float* a, float na, const float* b, float nb, std::int64_t d,
                                            float* e) noexcept {
  if (na == 0.0f && nb == 0.0f) {
    for (std::int64_t c = 0; c < d; ++c) e[c] = 0.0f;
    return;
  }
  const float ia = na > 0.0f ? 1.0f / na : 0.0f, ib = nb > 0.0f ? 1.0f / nb : 0.0f;
  float cs = 0.0f;
  for (std::int64_t c = 0; c < d; ++c) cs += (a[c] * ia) * (b[c] * ib);
  if (na == 0.0f || nb == 0.0f) cs = 1.0f;
  cs = cs < -1.0f ? -1.0f : (1.0f < cs ? 1.0f : cs);
  const float om = acosf(cs), so = sinf(om);
  float ca = 1.0f - t, cb = t;
  if (so >= kMiniCacheLerpBelow) {
    ca = sinf((1.0f - t) * om) / so;
    cb = sinf(t * om) / so;
  }
  double nn = 0.0;
  for (std::int64_t c = 0; c < d; ++c) {
    const float ua = na > 0.0f ? a[c] * ia : b[c] * ib, ub = nb > 0.0f ? b[c] * ib : a[c] * ia;
    e[c] = ca * ua + cb * ub;
    nn += static_cast<double>(e[c]) * e[c];
  }
  if (nn > 0.0) {  // unit in both branches: the lerp needs it, the SLERP of unit vectors is unit up to rounding
    const auto inv = static_cast<float>(1.0 / sqrt(nn));
    for (std::int64_t c = 0; c < d; ++c) e[c] *= inv;
  }
}

/// The retention threshold over a head's distances [lo, hi]: (1 - gamma) lo + gamma hi, exactly lo at
/// gamma = 0 and hi at gamma = 1; a flat head (hi == lo) gets hi + 1 (nothing is strictly above it).
KVP_HOST_DEVICE inline float minicache_threshold(float lo, float hi, float gamma) noexcept {
  return (1.0f - gamma) * lo + gamma * hi + (hi == lo ? 1.0f : 0.0f);
}

}  // namespace ops
KVP_NAMESPACE_END
