// SPDX-License-Identifier: Apache-2.0
// `Cuda::topk` / `Cuda::topk_rows`: exact top-k under `score_order_key`, one
// thread block per row, no sort and no global workspace.
//
// The reference ranks the packed 64-bit key (score_order_key(score) << 32 | index),
// so the selected set is: every element whose 32-bit order key is above a
// threshold t, plus the `need` elements with key == t that have the highest
// indices. The block finds t with an MSB-first radix select over the 32-bit
// key (4 passes of 8 bits, shared-memory histograms), then one ordered pass
// writes the selected indices in ascending order via a block-wide prefix sum:
// the output is sorted by construction.
#include <cub/block/block_scan.cuh>

#include <cstdint>

#include "cuda_common.cuh"
#include "kvpolicy/backends/cuda.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda_detail {
namespace {

constexpr int kTopkThreads = 512;
constexpr int kRadixBits = 8;
constexpr int kRadixBins = 1 << kRadixBits;
constexpr std::int64_t kMaxN = 2147483647;     // indices are int32
constexpr std::int64_t kMaxRows = 2147483647;  // grid.x

__global__ void __launch_bounds__(kTopkThreads) topk_rows_kernel(const float* __restrict__ scores, std::int64_t n, std::int64_t ld,
                                                                 std::int64_t k, std::int32_t* __restrict__ out, std::int64_t out_ld) {
  using Scan = cub::BlockScan<unsigned long long, kTopkThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ unsigned int hist[kRadixBins];
  __shared__ unsigned int s_digit;
  __shared__ unsigned int s_above;  // candidates with a larger digit
  __shared__ unsigned int s_count;  // candidates with exactly the chosen digit

  const int tid = static_cast<int>(threadIdx.x);
  const float* row = scores + static_cast<std::int64_t>(blockIdx.x) * ld;
  std::int32_t* o = out + static_cast<std::int64_t>(blockIdx.x) * out_ld;

  // ---- radix select: the key t of the k-th best element -------------------
  // Invariant: the candidates (keys matching `prefix` on `mask`) number at
  // least `remaining` >= 1, and exactly k - remaining elements rank above them.
  std::uint32_t prefix = 0, mask = 0;
  std::int64_t remaining = k;
  std::int64_t equal = 0;  // after the last pass: elements whose key is exactly t
  for (int shift = 32 - kRadixBits; shift >= 0; shift -= kRadixBits) {
    for (int b = tid; b < kRadixBins; b += kTopkThreads) hist[b] = 0u;
    __syncthreads();
    for (std::int64_t i = tid; i < n; i += kTopkThreads) {
      const std::uint32_t u = score_order_key(row[i]);
      if ((u & mask) == prefix) atomicAdd(&hist[(u >> shift) & (kRadixBins - 1)], 1u);
    }
    __syncthreads();
    if (tid == 0) {
      // Largest digit d with (candidates whose digit >= d) >= remaining.
      std::int64_t above = 0;
      int d = kRadixBins - 1;
      for (; d > 0; --d) {
        if (above + hist[d] >= remaining) break;
        above += hist[d];
      }
      s_digit = static_cast<unsigned int>(d);
      s_above = static_cast<unsigned int>(above);
      s_count = hist[d];
    }
    __syncthreads();  // also orders thread 0's reads of hist before the next reset
    prefix |= s_digit << shift;
    mask |= static_cast<std::uint32_t>(kRadixBins - 1) << shift;
    remaining -= s_above;
    equal = s_count;
  }
  const std::uint32_t t = prefix;
  // Of the `equal` elements with key t, the last `remaining` (highest indices) are taken.
  const std::int64_t skip = equal - remaining;

  // ---- ordered compaction ---------------------------------------------------
  // Per element: (above t, equal to t) packed as (hi, lo) so one scan counts both.
  std::int64_t above_seen = 0, equal_seen = 0;
  for (std::int64_t base = 0; base < n; base += kTopkThreads) {
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

Status topk_impl(const char* who, const float* scores, std::int64_t rows, std::int64_t n, std::int64_t ld, std::int64_t k,
                 std::int32_t* out, std::int64_t out_ld, Workspace ws, void* stream) noexcept {
  KVP_REQUIRE(rows >= 0, "%s: rows is %lld, must be >= 0", who, static_cast<long long>(rows));
  KVP_REQUIRE(n >= 0, "%s: n is %lld, must be >= 0", who, static_cast<long long>(n));
  KVP_REQUIRE(k >= 0, "%s: k is %lld, must be >= 0", who, static_cast<long long>(k));
  KVP_REQUIRE(k <= n, "%s: k is %lld, larger than n=%lld", who, static_cast<long long>(k), static_cast<long long>(n));
  if (n > kMaxN) {
    return Status::error(StatusCode::kUnsupported, "%s: n is %lld; indices are int32, at most %lld", who, static_cast<long long>(n),
                         static_cast<long long>(kMaxN));
  }
  if (rows > 1) {
    KVP_REQUIRE(ld >= n, "%s: ld is %lld, less than n=%lld (rows would overlap)", who, static_cast<long long>(ld),
                static_cast<long long>(n));
    KVP_REQUIRE(out_ld >= k, "%s: out_ld is %lld, less than k=%lld (output rows would overlap)", who, static_cast<long long>(out_ld),
                static_cast<long long>(k));
  }
  if (rows > kMaxRows) {
    return Status::error(StatusCode::kUnsupported, "%s: rows is %lld, at most %lld per call", who, static_cast<long long>(rows),
                         static_cast<long long>(kMaxRows));
  }
  if (rows == 0 || k == 0) return Status::ok();
  KVP_REQUIRE(scores != nullptr, "%s: scores is null", who);
  KVP_REQUIRE(out != nullptr, "%s: out is null", who);
  KVP_RETURN_IF_ERROR(check_workspace(who, ws, 0));

  topk_rows_kernel<<<static_cast<unsigned>(rows), kTopkThreads, 0, as_stream(stream)>>>(scores, n, rows > 1 ? ld : n, k, out,
                                                                                        rows > 1 ? out_ld : k);
  return launch_status(who);
}

}  // namespace
}  // namespace cuda_detail

namespace backend {

std::size_t Cuda::topk_workspace(std::int64_t) noexcept { return 0; }

std::size_t Cuda::topk_rows_workspace(std::int64_t, std::int64_t) noexcept { return 0; }

Status Cuda::topk(const float* scores_device, std::int64_t n, std::int64_t k, std::int32_t* out_device, Workspace ws_device,
                  void* stream) noexcept {
  return cuda_detail::topk_impl("cuda topk", scores_device, 1, n, n, k, out_device, k, ws_device, stream);
}

Status Cuda::topk_rows(const float* scores_device, std::int64_t rows, std::int64_t n, std::int64_t ld, std::int64_t k,
                       std::int32_t* out_device, std::int64_t out_ld, Workspace ws_device, void* stream) noexcept {
  return cuda_detail::topk_impl("cuda topk_rows", scores_device, rows, n, ld, k, out_device, out_ld, ws_device, stream);
}

}  // namespace backend
KVP_NAMESPACE_END
