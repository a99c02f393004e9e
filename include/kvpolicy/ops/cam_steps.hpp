// SPDX-License-Identifier: Apache-2.0
// The steps of CaM's streaming merge (policy/merging/cam.hpp) and kvpress's
// CAMPress (policy/merging/kvpress_cam.hpp) that the host and a device run
// with the same arithmetic: the host paths call them, and `backend::Cuda`'s
// CaM kernels (backends/cuda/src/cam.cu, compiled without FMA contraction)
// call them per thread, so the two agree bit for bit.
//
//   mt19937 in phases   torch's CPU generator (mt19937, 32-bit outputs) as
//                       seeding, a twist split into three phases whose
//                       elements are independent of each other, and the
//                       tempering: the device twists with one thread per
//                       element, and the host test replays the phases
//                       against std::mt19937.
//   torch_uniform       torch.bernoulli's uniform from one output:
//                       (x & 0xFFFFFF) * 2^-24.
//   CamAttention        accumulated attention of a kv head at a token, from
//                       sums given per kv head or per query head (the mean
//                       over the head's query group, summed in group order).
//   cam_probability     the merge probability of an evicted token over its
//                       window of kept tokens.
//   cam_entries         one candidate's dense plan entries (window slots,
//                       or -1 when its draw fails).
//   cam_merged_value    one column of a kept slot's merged value row, from
//                       the dense entries of the candidates that reach it.
#pragma once

#include <cstdint>

#include "kvpolicy/core/config.hpp"
#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/rows.hpp"

KVP_NAMESPACE_BEGIN
namespace ops {

inline constexpr int kMtStateSize = 624;
inline constexpr int kMtShift = 397;
/// The in-place twist updates element i from elements i, i + 1 and i + 397
/// (mod 624) as they stand when i's turn comes. Within each phase
/// [mt_phase_end(p - 1), mt_phase_end(p)) every element reads only values no
/// element of the same phase writes, except its right neighbour, which it
/// reads before that neighbour is rewritten: [0, 227) reads the old state,
/// [227, 454) reads phase 0's new elements 0..226 at i - 227, [454, 624)
/// reads phase 1's at i - 227 (and element 623 reads element 0, new since
/// phase 0). A phase that reads all its inputs, then writes all its
/// outputs, equals the sequential twist.
inline constexpr int kMtPhases = 3;
KVP_HOST_DEVICE constexpr int mt_phase_end(int p) noexcept { return p == 0 ? 227 : (p == 1 ? 454 : kMtStateSize); }

/// std::mt19937's seeding: mt[0] = seed, mt[i] = 1812433253 (mt[i-1] ^ (mt[i-1] >> 30)) + i.
KVP_HOST_DEVICE inline void mt_seed(std::uint32_t* mt, std::uint32_t seed) noexcept {
  mt[0] = seed;
  for (int i = 1; i < kMtStateSize; ++i) mt[i] = 1812433253u * (mt[i - 1] ^ (mt[i - 1] >> 30)) + static_cast<std::uint32_t>(i);
}

/// The value element i takes in the twist, from the array as the phases leave it before i's phase writes.
KVP_HOST_DEVICE inline std::uint32_t mt_twisted(const std::uint32_t* mt, int i) noexcept {
  const std::uint32_t y = (mt[i] & 0x80000000u) | (mt[i + 1 == kMtStateSize ? 0 : i + 1] & 0x7fffffffu);
  const int k = i + kMtShift < kMtStateSize ? i + kMtShift : i + kMtShift - kMtStateSize;
  return mt[k] ^ (y >> 1) ^ ((y & 1u) != 0u ? 0x9908b0dfu : 0u);
}

/// One twist on the host, phase by phase (the device runs each phase with one thread per element).
inline void mt_twist_phases(std::uint32_t* mt) noexcept {
  std::uint32_t next[kMtStateSize];
  int lo = 0;
  for (int p = 0; p < kMtPhases; ++p) {
    const int hi = mt_phase_end(p);
    for (int i = lo; i < hi; ++i) next[i] = mt_twisted(mt, i);
    for (int i = lo; i < hi; ++i) mt[i] = next[i];
    lo = hi;
  }
}

/// std::mt19937's tempering of one state word into an output.
KVP_HOST_DEVICE inline std::uint32_t mt_temper(std::uint32_t y) noexcept {
  y ^= y >> 11;
  y ^= (y << 7) & 0x9d2c5680u;
  y ^= (y << 15) & 0xefc60000u;
  return y ^ (y >> 18);
}

/// torch.bernoulli's uniform on the CPU generator: the low 24 bits of one output, times 2^-24 (exact in fp32).
KVP_HOST_DEVICE inline float torch_uniform(std::uint32_t x) noexcept { return static_cast<float>(x & 0xFFFFFFu) * (1.0f / 16777216.0f); }

/// Accumulated attention rows (num_kv_heads x group rows, kv_len), element (r, j) at data[r * row_stride + j * col_stride].
struct CamAttention {
  const float* data = nullptr;
  std::int64_t row_stride = 0;
  std::int64_t col_stride = 1;
  std::int64_t group = 1;  ///< query heads per kv head in the rows (1: the rows are per kv head)

  /// Kv head h's attention at token j: its row, or the mean of its group's rows (summed in group order, then divided).
  KVP_HOST_DEVICE float of(std::int64_t h, std::int64_t j) const noexcept {
    if (group == 1) return data[h * row_stride + j * col_stride];
    float acc = 0.0f;
    for (std::int64_t g = 0; g < group; ++g) acc += data[(h * group + g) * row_stride + j * col_stride];
    return acc / static_cast<float>(group);
  }
};

/// Merge probability of evicted token e whose window is the n kept slots from s0:
/// p = A[e] / (sum_w A[kept[s0 + w]] / max(n, 1)) (the sum in window order), NaN -> 0, clamped to [0, 1]
/// (+inf -> 1). Callers skip n = 0 (no window, nothing to merge into).
KVP_HOST_DEVICE inline float cam_probability(const CamAttention& a, std::int64_t h, const std::int32_t* kept, std::int64_t s0,
                                             std::int64_t n, std::int32_t e) noexcept {
  float sum = 0.0f;
  for (std::int64_t w = 0; w < n; ++w) sum += a.of(h, kept[s0 + w]);
  const float mean = sum / static_cast<float>(n > 1 ? n : 1);
  const float p = a.of(h, e) / mean;
  if (p != p) return 0.0f;  // NaN
  return p < 0.0f ? 0.0f : (p > 1.0f ? 1.0f : p);
}

/// How a drawn candidate spreads over its window of `window` kept tokens (n = the
/// slots it has, fewer at the end of the cache): weight 1 / window (CaM divides by
/// merge_num even when fewer neighbours exist) or 1 / n (kvpress CAMPress).
struct CamRule {
  std::int32_t window = 16;
  bool divide_by_window = true;
};

/// The first index in the ascending `kept[0, C)` whose id is >= e (for an evicted e, the first kept slot after it).
KVP_HOST_DEVICE inline std::int64_t kept_lower_bound(const std::int32_t* kept, std::int64_t C, std::int32_t e) noexcept {
  std::int64_t lo = 0, hi = C;
  while (lo < hi) {
    const std::int64_t mid = (lo + hi) / 2;
    if (kept[mid] < e)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/// Candidate e's `rule.window` dense entries: entry w names window slot s0 + w with weight 1 / window or
/// 1 / n when the draw `u < p` succeeds and w < n = min(window, C - s0); otherwise dst -1 and weight 0.
/// Every entry's src is e. Returns s0 (the candidate's first window slot).
KVP_HOST_DEVICE inline std::int64_t cam_entries(const CamRule& r, const CamAttention& a, std::int64_t h, const std::int32_t* kept,
                                                std::int64_t C, std::int32_t e, float u, std::int32_t* dst, std::int32_t* src,
                                                float* weight) noexcept {
  const std::int64_t s0 = kept_lower_bound(kept, C, e);
  const std::int64_t n = C - s0 < r.window ? C - s0 : r.window;
  const bool drawn = n > 0 && u < cam_probability(a, h, kept, s0, n, e);
  const float scale = 1.0f / static_cast<float>(r.divide_by_window ? r.window : (n > 0 ? n : 1));
  for (std::int64_t w = 0; w < r.window; ++w) {
    const bool on = drawn && w < n;
    dst[w] = on ? static_cast<std::int32_t>(s0 + w) : -1;
    src[w] = e;
    weight[w] = on ? scale : 0.0f;
  }
  return s0;
}

/// Column c of kept slot s's merged value row from the dense entries of the ascending candidates
/// `cand[0, n)` (`start[j]`: candidate j's first window slot, as cam_entries returns it; entries of
/// candidate j at j * window): V[kept[s]][c] + sum over the candidates that reach s and were drawn, in
/// candidate order, of V[cand[j]][c] * weight (each product and sum rounded on its own). `*touched` is
/// false (and the result meaningless) when no drawn candidate reaches s: the row is then not written.
template <class Tk>
KVP_HOST_DEVICE float cam_merged_value(const CamRule& r, const Rows<Tk>& V, const std::int32_t* kept, const std::int32_t* cand,
                                       const std::int64_t* start, std::int64_t n, const std::int32_t* dst, const float* weight,
                                       std::int64_t s, std::int64_t c, bool* touched) noexcept {
  // Candidates reaching s have start in (s - window, s]; starts ascend with the candidates.
  std::int64_t lo = 0, hi = n;
  while (lo < hi) {
    const std::int64_t mid = (lo + hi) / 2;
    if (start[mid] <= s - r.window)
      lo = mid + 1;
    else
      hi = mid;
  }
  float o = 0.0f;
  bool any = false;
  for (std::int64_t j = lo; j < n && start[j] <= s; ++j) {
    const std::int64_t e = j * r.window + (s - start[j]);
    if (dst[e] < 0) continue;
    if (!any) o = to_float(V.row(kept[s])[c]);
    any = true;
    o += to_float(V.row(cand[j])[c]) * weight[e];
  }
  *touched = any;
  return o;
}

}  // namespace ops
KVP_NAMESPACE_END
