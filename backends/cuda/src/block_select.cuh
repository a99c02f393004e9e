// SPDX-License-Identifier: Apache-2.0
// Internal to kvpolicy::cuda: exact selection inside one thread block under
// `score_order_key`, shared by `Cuda::topk` (topk.cu) and Ada-KV's decision
// (adakv.cu).
//
// The reference ranks the packed 64-bit key (score_order_key(score) << 32 |
// position), so the k best are: every element whose 32-bit order key is above
// a threshold t, plus the `remaining` elements with key == t at the highest
// positions. The block finds t with an MSB-first radix select over the 32-bit
// key (4 passes of 8 bits, shared-memory histograms); from there either an
// ordered pass writes the selected positions ascending (`block_topk`), or one
// more pass finds the lowest selected position with key t, giving the 64-bit
// threshold (`block_kth_key`).
#pragma once

#include <cub/block/block_scan.cuh>

#include <cstdint>

#include "cuda_common.cuh"

KVP_NAMESPACE_BEGIN
namespace cuda_detail {

constexpr int kSelectRadixBits = 8;
constexpr int kSelectRadixBins = 1 << kSelectRadixBits;

/// The radix select's result: threshold key t; `remaining` of the `equal`
/// elements with key t are among the k best (those at the highest positions).
struct RadixPick {
  std::uint32_t t = 0;
  std::int64_t remaining = 0;
  std::int64_t equal = 0;
};

/// t of the k-th best of the elements i < n for which `key_at(i, &u)` returns
/// true (u = their order key); 1 <= k <= that count. Every thread of the block
/// calls it and gets the same result.
template <int kThreads, class KeyAt>
__device__ RadixPick block_radix_select(std::int64_t n, std::int64_t k, KeyAt key_at) {
  __shared__ unsigned int hist[kSelectRadixBins];
  __shared__ unsigned int s_digit;
  __shared__ unsigned int s_above;  // candidates with a larger digit
  __shared__ unsigned int s_count;  // candidates with exactly the chosen digit
  const int tid = static_cast<int>(threadIdx.x);
  // Invariant: the candidates (keys matching `prefix` on `mask`) number at
  // least `remaining` >= 1, and exactly k - remaining elements rank above them.
  std::uint32_t prefix = 0, mask = 0;
  RadixPick p;
  p.remaining = k;
  for (int shift = 32 - kSelectRadixBits; shift >= 0; shift -= kSelectRadixBits) {
    for (int b = tid; b < kSelectRadixBins; b += kThreads) hist[b] = 0u;
    __syncthreads();
    for (std::int64_t i = tid; i < n; i += kThreads) {
      std::uint32_t u = 0;
      if (key_at(i, &u) && (u & mask) == prefix) atomicAdd(&hist[(u >> shift) & (kSelectRadixBins - 1)], 1u);
    }
    __syncthreads();
    if (tid == 0) {
      // Largest digit d with (candidates whose digit >= d) >= remaining.
      std::int64_t above = 0;
      int d = kSelectRadixBins - 1;
      for (; d > 0; --d) {
        if (above + hist[d] >= p.remaining) break;
        above += hist[d];
      }
      s_digit = static_cast<unsigned int>(d);
      s_above = static_cast<unsigned int>(above);
      s_count = hist[d];
    }
    __syncthreads();  // also orders thread 0's reads of hist before the next reset
    prefix |= s_digit << shift;
    mask |= static_cast<std::uint32_t>(kSelectRadixBins - 1) << shift;
    p.remaining -= s_above;
    p.equal = s_count;
  }
  p.t = prefix;
  return p;
}

/// The k best of row[0..n) (score_order_key, ties: higher position) written to
/// o[0..k) in ascending position order; 1 <= k <= n. The whole block calls it.
template <int kThreads>
__device__ void block_topk(const float* __restrict__ row, std::int64_t n, std::int64_t k, std::int32_t* __restrict__ o) {
  using Scan = cub::BlockScan<unsigned long long, kThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  const int tid = static_cast<int>(threadIdx.x);
  const RadixPick p = block_radix_select<kThreads>(n, k, [row](std::int64_t i, std::uint32_t* u) {
    *u = score_order_key(row[i]);
    return true;
  });
  const std::uint32_t t = p.t;
  // Of the `equal` elements with key t, the last `remaining` (highest positions) are taken.
  const std::int64_t skip = p.equal - p.remaining;

  // Ordered compaction. Per element: (above t, equal to t) packed as (hi, lo) so one scan counts both.
  std::int64_t above_seen = 0, equal_seen = 0;
  for (std::int64_t base = 0; base < n; base += kThreads) {
    const std::int64_t i = base + tid;
    unsigned long long flags = 0ull;
    if (i < n) {
      const std::uint32_t u = score_order_key(row[i]);
      flags = u > t ? (1ull << 32) : (u == t ? 1ull : 0ull);
    }
    unsigned long long before = 0ull, total = 0ull;
    Scan(scan_tmp).ExclusiveSum(flags, before, total);
    const std::int64_t above_before = above_seen + static_cast<std::int64_t>(before >> 32);
    const std::int64_t equal_before = equal_seen + static_cast<std::int64_t>(before & 0xffffffffull);
    // Output slot = selected elements before i = all "above" + the selected "equal" ones.
    const std::int64_t equal_taken = equal_before > skip ? equal_before - skip : 0;
    const bool take = (flags >> 32) != 0ull || (flags == 1ull && equal_before >= skip);
    const std::int64_t slot = above_before + equal_taken;
    if (take && slot < k) o[slot] = static_cast<std::int32_t>(i);  // slot < k always; guards a racing writer
    above_seen += static_cast<std::int64_t>(total >> 32);
    equal_seen += static_cast<std::int64_t>(total & 0xffffffffull);
    __syncthreads();  // scan_tmp is reused by the next chunk
  }
}

/// The k-th largest packed key (order key << 32 | position) of the elements
/// `key_at` admits (positions i < n; 0 <= k <= their count): an element is
/// among the k best exactly when its packed key is >= the result. k == 0 gives
/// UINT64_MAX (nothing is selected). The whole block calls it.
template <int kThreads, class KeyAt>
__device__ std::uint64_t block_kth_key(std::int64_t n, std::int64_t k, KeyAt key_at) {
  if (k <= 0) return UINT64_MAX;
  using Scan = cub::BlockScan<unsigned int, kThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ long long s_pos;
  const RadixPick p = block_radix_select<kThreads>(n, k, key_at);
  const std::int64_t skip = p.equal - p.remaining;  // equal-key elements below the selected ones
  if (threadIdx.x == 0) s_pos = -1;
  __syncthreads();
  std::int64_t seen = 0;
  for (std::int64_t base = 0; base < n; base += kThreads) {
    const std::int64_t i = base + static_cast<std::int64_t>(threadIdx.x);
    std::uint32_t u = 0;
    const unsigned int flag = (i < n && key_at(i, &u) && u == p.t) ? 1u : 0u;
    unsigned int before = 0u, total = 0u;
    Scan(scan_tmp).ExclusiveSum(flag, before, total);
    if (flag != 0u && seen + static_cast<std::int64_t>(before) == skip) s_pos = i;
    seen += static_cast<std::int64_t>(total);
    __syncthreads();        // s_pos visible; scan_tmp reused by the next chunk
    if (s_pos >= 0) break;  // block-uniform
  }
  const long long pos = s_pos;
  __syncthreads();  // every thread has read s_pos before a later call resets it
  return (static_cast<std::uint64_t>(p.t) << 32) | static_cast<std::uint64_t>(pos);
}

}  // namespace cuda_detail
KVP_NAMESPACE_END
