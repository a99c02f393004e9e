// SPDX-License-Identifier: Apache-2.0
// `Cuda::rank_tiers`: MixedPrecision's ranking on the device, equal to
// `ScalarScoreOps::rank_tiers`: per row, the n_keep best scores (score
// descending, then position ascending; -0 equals +0, NaN last) in ascending
// positions, flagged 1 when among the n_full best.
//
// One thread block per row: two radix selects over the 32-bit tier order key
// (block_select.cuh) give the keep and full thresholds; of the elements whose
// key equals a threshold, the first `remaining` by position are selected (the
// reference's earlier-first tie rule). One ordered pass then writes each
// selected position and its tier to its slot, with one block scan counting
// the elements above the keep threshold and those equal to either threshold.
#include <cub/block/block_scan.cuh>

#include <cstdint>

#include "block_select.cuh"
#include "cuda_common.cuh"
#include "kvpolicy/backends/cuda.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda_detail {
namespace {

constexpr int kTierThreads = 256;  // per-chunk counts < 2^16: three of them pack into one 64-bit scan value
constexpr std::int64_t kMaxGridX = 2147483647;

__global__ void __launch_bounds__(kTierThreads)
    rank_tiers_kernel(const float* __restrict__ scores, std::int64_t n, std::int64_t ld, std::int64_t n_keep, std::int64_t n_full,
                      std::int32_t* __restrict__ idx, std::uint8_t* __restrict__ tier, std::int64_t out_ld) {
  using Scan = cub::BlockScan<unsigned long long, kTierThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  const float* row = scores + static_cast<std::int64_t>(blockIdx.x) * ld;
  std::int32_t* o = idx + static_cast<std::int64_t>(blockIdx.x) * out_ld;
  std::uint8_t* tr = tier + static_cast<std::int64_t>(blockIdx.x) * out_ld;
  const auto key_at = [row](std::int64_t i, std::uint32_t* u) {
    *u = tier_order_key(row[i]);
    return true;
  };
  const RadixPick keep = block_radix_select<kTierThreads>(n, n_keep, key_at);
  RadixPick full;  // n_full == 0: no key reaches 0xffffffff (NaN maps to 0), nothing is full
  full.t = 0xffffffffu;
  if (n_full > 0) full = block_radix_select<kTierThreads>(n, n_full, key_at);
  std::int64_t above_seen = 0, keep_eq_seen = 0, full_eq_seen = 0;
  for (std::int64_t base = 0; base < n; base += kTierThreads) {
    const std::int64_t i = base + static_cast<std::int64_t>(threadIdx.x);
    std::uint32_t u = 0;
    unsigned long long fields = 0ull;
    if (i < n) {
      u = tier_order_key(row[i]);
      fields = (u > keep.t ? 1ull << 32 : 0ull) | (u == keep.t ? 1ull << 16 : 0ull) | (u == full.t ? 1ull : 0ull);
    }
    unsigned long long before = 0ull, total = 0ull;
    Scan(scan_tmp).ExclusiveSum(fields, before, total);
    const std::int64_t above_before = above_seen + static_cast<std::int64_t>(before >> 32);
    const std::int64_t keep_eq_before = keep_eq_seen + static_cast<std::int64_t>((before >> 16) & 0xffffull);
    const std::int64_t full_eq_before = full_eq_seen + static_cast<std::int64_t>(before & 0xffffull);
    const bool take = i < n && (u > keep.t || (u == keep.t && keep_eq_before < keep.remaining));
    if (take) {
      const std::int64_t slot = above_before + (keep_eq_before < keep.remaining ? keep_eq_before : keep.remaining);
      o[slot] = static_cast<std::int32_t>(i);
      tr[slot] = static_cast<std::uint8_t>(u > full.t || (u == full.t && full_eq_before < full.remaining) ? 1 : 0);
    }
    above_seen += static_cast<std::int64_t>(total >> 32);
    keep_eq_seen += static_cast<std::int64_t>((total >> 16) & 0xffffull);
    full_eq_seen += static_cast<std::int64_t>(total & 0xffffull);
    __syncthreads();  // scan_tmp is reused by the next chunk
  }
}

}  // namespace
}  // namespace cuda_detail

namespace backend {

std::size_t Cuda::rank_tiers_workspace(std::int64_t) noexcept { return 0; }

void Cuda::rank_tiers(const float* scores, std::int64_t rows, std::int64_t n, std::int64_t ld, std::int64_t n_keep, std::int64_t n_full,
                      std::int32_t* idx, std::uint8_t* tier, std::int64_t out_ld, Workspace) noexcept {
  using namespace cuda_detail;
  const char* who = "cuda rank_tiers";
  if (rows < 0 || n < 0 || n >= (std::int64_t{1} << 31) || n_full < 0 || n_full > n_keep || n_keep > n || ld < n || out_ld < n_keep) {
    record_error(
        KVP_INVALID("%s: rows=%lld, n=%lld, ld=%lld, n_keep=%lld, n_full=%lld, out_ld=%lld; must be 0 <= n_full <= n_keep <= n "
                    "< 2^31, ld >= n, out_ld >= n_keep",
                    who, static_cast<long long>(rows), static_cast<long long>(n), static_cast<long long>(ld),
                    static_cast<long long>(n_keep), static_cast<long long>(n_full), static_cast<long long>(out_ld)));
    return;
  }
  if (rows == 0 || n_keep == 0) return;
  if (scores == nullptr || idx == nullptr || tier == nullptr) {
    record_error(KVP_INVALID("%s: scores, idx or tier is null", who));
    return;
  }
  if (rows > kMaxGridX) {
    record_error(Status::error(StatusCode::kUnsupported, "%s: %lld rows, at most %lld per call", who, static_cast<long long>(rows),
                               static_cast<long long>(kMaxGridX)));
    return;
  }
  rank_tiers_kernel<<<static_cast<unsigned>(rows), kTierThreads, 0, as_stream(current_stream())>>>(scores, n, ld, n_keep, n_full, idx, tier,
                                                                                                   out_ld);
  record_error(launch_status(who));
}

}  // namespace backend
KVP_NAMESPACE_END
