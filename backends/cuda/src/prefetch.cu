// SPDX-License-Identifier: Apache-2.0
// The prefetch family's bookkeeping on device memory (ops/prefetch_ops.hpp:
// semantics and the host reference): the history reset, Quest lookahead's
// vote counts and priorities, the ordered request and the hit-rate counts of
// an observation. Integer atomics only (their result does not depend on the
// order), the priorities' fp32 additions in the host's order, so every output
// equals the reference bit for bit. No allocation, no synchronisation: every
// launch goes on the calling thread's current stream.
#include <cub/block/block_reduce.cuh>
#include <cub/device/device_radix_sort.cuh>

#include <climits>
#include <cstdint>

#include "cuda_common.cuh"
#include "kvpolicy/backends/cuda.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda_detail {
namespace {

constexpr int kThreads = 256;
constexpr int kBlock = 1024;  // the one-block request and observe kernels

unsigned blocks_for(std::int64_t n) noexcept { return grid_blocks(n, kThreads); }

__global__ void history_reset_kernel(std::int64_t* __restrict__ buf, std::int64_t stamps) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < stamps + 2;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    buf[i] = i < stamps ? -1 : 0;
}

__global__ void votes_kernel(const std::int32_t* __restrict__ logical, std::int64_t rows, std::int64_t row_len, std::int64_t ld,
                             std::int32_t* __restrict__ counts) {
  const std::int64_t n = rows * row_len;
  for (std::int64_t t = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; t < n;
       t += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = t / row_len, i = t - r * row_len;
    atomicAdd(counts + logical[r * ld + i], 1);
  }
}

__global__ void vote_priorities_kernel(const std::int32_t* __restrict__ counts, const std::int32_t* __restrict__ entry_pages,
                                       std::int64_t entries, float unit, const std::int64_t* __restrict__ used_at, std::int64_t reuse_step,
                                       float reuse_priority, float* __restrict__ prio) {
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < entries;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int32_t c = counts[e];
    float v = __int_as_float(0x7fc00000);  // NaN: not predicted
    if (c > 0) {
      v = 0.0f;
      for (std::int32_t j = 0; j < c; ++j) v = __fadd_rn(v, unit);
    } else if (reuse_step >= 0 && used_at[entry_pages[e]] == reuse_step) {
      v = reuse_priority;
    }
    prio[e] = v;
  }
}

__global__ void request_keys_kernel(const float* __restrict__ prio, std::int64_t entries, unsigned long long* __restrict__ keys) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < entries;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float p = prio[i];
    // NaN (not predicted) -> 0, below every predicted key (score_order_key of a number is >= 1).
    keys[i] = p != p ? 0ull : (static_cast<unsigned long long>(score_order_key(p)) << 32) | static_cast<unsigned long long>(i);
  }
}

/// One block over the keys sorted descending (file comment of cuda.hpp's `prefetch_write_request`).
__global__ void __launch_bounds__(kBlock)
    request_kernel(const unsigned long long* __restrict__ keys, const float* __restrict__ prio,
                   const std::int32_t* __restrict__ entry_pages, std::int64_t entries, long long* predicted_at,
                   const std::int64_t* __restrict__ used_at, std::int64_t* pending, std::int64_t target, long long serial,
                   std::int32_t* __restrict__ out_pages, float* __restrict__ out_priority, std::int64_t* out_size) {
  using Reduce = cub::BlockReduce<long long, kBlock>;
  __shared__ typename Reduce::TempStorage reduce;
  __shared__ int warp_sum[kBlock / 32];
  const int tid = static_cast<int>(threadIdx.x);
  long long size = 0, fresh = 0;  // size: the same in every thread
  for (std::int64_t base = 0; base < entries; base += kBlock) {
    if ((keys[base] >> 32) == 0) break;  // sorted: the rest are not predicted (the same test in every thread)
    const std::int64_t j = base + tid;
    const unsigned long long key = j < entries ? keys[j] : 0ull;
    const bool valid = (key >> 32) != 0;
    const auto i = static_cast<std::int64_t>(key & 0xffffffffull);
    const std::int32_t p = valid ? entry_pages[i] : 0;
    const bool fresh_claim = valid && predicted_at[p] != serial;  // not listed by an earlier chunk
    __syncthreads();
    const long long claim = LLONG_MIN + tid;  // below every stamp; the earliest position of the chunk wins
    if (fresh_claim) atomicMin(predicted_at + p, claim);
    __syncthreads();
    const bool win = fresh_claim && predicted_at[p] == claim;
    int total = 0;
    const int rank = block_flag_rank<kBlock>(win, warp_sum, &total);  // ends with a barrier: every read of the claims is done
    if (win) {
      predicted_at[p] = serial;
      out_pages[size + rank] = p;
      if (out_priority != nullptr) out_priority[size + rank] = prio[i];
      if (!(target >= 1 && used_at[p] == target - 1)) ++fresh;
    }
    size += total;
    __syncthreads();  // the stamps are written before the next chunk reads them
  }
  for (std::int64_t j = size + tid; j < entries; j += kBlock) {
    out_pages[j] = -1;
    if (out_priority != nullptr) out_priority[j] = __int_as_float(0x7fc00000);
  }
  const long long all_fresh = Reduce(reduce).Sum(fresh);
  if (tid == 0) {
    pending[0] = size;
    pending[1] = all_fresh;
    if (out_size != nullptr) *out_size = size;
  }
}

enum Count { kNeeded, kHits, kMisses, kReuseTotal, kReused, kLate, kCounts };

__global__ void __launch_bounds__(kBlock)
    observe_kernel(const std::int32_t* __restrict__ pages, std::int64_t n, unsigned long long* used_at,
                   const std::int64_t* __restrict__ predicted_at, const std::int64_t* __restrict__ pending, long long step,
                   bool has_prediction, std::int64_t serial, PrefetchCounters* counters) {
  __shared__ unsigned long long acc[kCounts];
  const int tid = static_cast<int>(threadIdx.x);
  if (tid < kCounts) acc[tid] = 0;
  __syncthreads();
  unsigned long long mine[kCounts] = {0, 0, 0, 0, 0, 0};
  for (std::int64_t k = tid; k < n; k += kBlock) {
    const std::int32_t p = pages[k];
    const auto old = static_cast<long long>(atomicExch(used_at + p, static_cast<unsigned long long>(step)));
    if (old == step) continue;  // another row (head, sequence) already read it
    const bool prev = step >= 1 && old == step - 1;
    const bool pred = has_prediction && predicted_at[p] == serial;
    ++mine[kNeeded];
    if (has_prediction) ++mine[pred ? kHits : kMisses];
    if (step >= 1) {
      ++mine[kReuseTotal];
      if (prev) ++mine[kReused];
    }
    if (!prev && !pred) ++mine[kLate];
  }
  for (int c = 0; c < kCounts; ++c)
    if (mine[c] != 0) atomicAdd(acc + c, mine[c]);
  __syncthreads();
  if (tid == 0) {
    const auto v = [&](int c) { return static_cast<std::int64_t>(acc[c]); };
    PrefetchCounters& out = *counters;
    out.needed += v(kNeeded);
    out.hits += v(kHits);
    out.misses += v(kMisses);
    out.reuse_total += v(kReuseTotal);
    out.reused += v(kReused);
    out.late += v(kLate);
    if (has_prediction) {
      out.predicted += pending[0];
      out.wasted += pending[0] - v(kHits);
      out.predicted_steps += 1;
    }
    out.transferred += (has_prediction ? pending[1] : 0) + v(kLate);
    out.steps += 1;
  }
}

/// cub's radix-sort scratch for `entries` keys on the current device. The query launches nothing; without a
/// usable device (a size query on a build machine) it fails, and a bound is returned instead: the keys once
/// more plus 1 MiB, more than cub asks for on the devices the backend targets (the call then fails anyway).
std::size_t sort_scratch(std::int64_t entries) noexcept {
  std::size_t bytes = 0;
  if (entries <= 0) return 0;
  const cudaError_t e = cub::DeviceRadixSort::SortKeysDescending(nullptr, bytes, static_cast<const unsigned long long*>(nullptr),
                                                                 static_cast<unsigned long long*>(nullptr), static_cast<int>(entries));
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // the query's error is not a launch error of the call
    return static_cast<std::size_t>(entries) * sizeof(std::uint64_t) + (std::size_t{1} << 20);
  }
  return bytes;
}

}  // namespace
}  // namespace cuda_detail

namespace backend {

void Cuda::prefetch_history_reset(std::int64_t* buf, std::int32_t num_pages) noexcept {
  using namespace cuda_detail;
  constexpr const char* who = "cuda prefetch_history_reset";
  if (num_pages < 0) return record_error(KVP_INVALID("%s: num_pages is %d, must be >= 0", who, num_pages));
  if (buf == nullptr) return record_error(KVP_INVALID("%s: buf is null", who));
  const std::int64_t stamps = 2 * static_cast<std::int64_t>(num_pages);
  history_reset_kernel<<<blocks_for(stamps + 2), kThreads, 0, as_stream(current_stream())>>>(buf, stamps);
  record_error(launch_status(who));
}

void Cuda::prefetch_votes(const std::int32_t* logical, std::int64_t rows, std::int64_t row_len, std::int64_t ld, std::int64_t entries,
                          std::int32_t* counts) noexcept {
  using namespace cuda_detail;
  constexpr const char* who = "cuda prefetch_votes";
  if (rows < 0 || row_len < 0 || entries < 0 || (rows > 1 && ld < row_len))
    return record_error(KVP_INVALID("%s: rows=%lld, row_len=%lld, ld=%lld, entries=%lld: need non-negative sizes and ld >= row_len", who,
                                    static_cast<long long>(rows), static_cast<long long>(row_len), static_cast<long long>(ld),
                                    static_cast<long long>(entries)));
  if (entries == 0) return;
  if (counts == nullptr || (rows * row_len > 0 && logical == nullptr))
    return record_error(KVP_INVALID("%s: logical or counts is null", who));
  const cudaStream_t s = as_stream(current_stream());
  const cudaError_t e = cudaMemsetAsync(counts, 0, static_cast<std::size_t>(entries) * sizeof(std::int32_t), s);
  if (e != cudaSuccess) return record_error(device_error(who, "cudaMemsetAsync", e));
  if (rows * row_len == 0) return;
  votes_kernel<<<blocks_for(rows * row_len), kThreads, 0, s>>>(logical, rows, row_len, ld, counts);
  record_error(launch_status(who));
}

void Cuda::prefetch_vote_priorities(const std::int32_t* counts, const std::int32_t* entry_pages, std::int64_t entries, float unit,
                                    const std::int64_t* used_at, std::int64_t reuse_step, float reuse_priority, float* prio) noexcept {
  using namespace cuda_detail;
  constexpr const char* who = "cuda prefetch_vote_priorities";
  if (entries < 0) return record_error(KVP_INVALID("%s: entries is %lld, must be >= 0", who, static_cast<long long>(entries)));
  if (entries == 0) return;
  if (counts == nullptr || prio == nullptr || (reuse_step >= 0 && (entry_pages == nullptr || used_at == nullptr)))
    return record_error(KVP_INVALID("%s: counts, prio, or (with reuse) entry_pages / used_at is null", who));
  vote_priorities_kernel<<<blocks_for(entries), kThreads, 0, as_stream(current_stream())>>>(counts, entry_pages, entries, unit, used_at,
                                                                                            reuse_step, reuse_priority, prio);
  record_error(launch_status(who));
}

std::size_t Cuda::prefetch_request_workspace(std::int64_t entries) noexcept {
  if (entries <= 0) return 0;
  const auto e = static_cast<std::size_t>(entries);
  return WorkspacePlan{}.add<std::uint64_t>(e).add<std::uint64_t>(e).add_bytes(cuda_detail::sort_scratch(entries)).total();
}

void Cuda::prefetch_write_request(const float* prio, const std::int32_t* entry_pages, std::int64_t entries, std::int64_t* predicted_at,
                                  const std::int64_t* used_at, std::int64_t* pending, std::int64_t target, std::int64_t serial,
                                  std::int32_t* out_pages, float* out_priority, std::int64_t* out_size, Workspace ws) noexcept {
  using namespace cuda_detail;
  constexpr const char* who = "cuda prefetch_write_request";
  if (entries < 0 || entries > INT32_MAX)
    return record_error(KVP_INVALID("%s: entries is %lld, must be in [0, 2^31)", who, static_cast<long long>(entries)));
  if (pending == nullptr) return record_error(KVP_INVALID("%s: pending is null", who));
  const cudaStream_t s = as_stream(current_stream());
  if (entries > 0) {
    if (prio == nullptr || entry_pages == nullptr || predicted_at == nullptr || used_at == nullptr || out_pages == nullptr)
      return record_error(KVP_INVALID("%s: prio, entry_pages, predicted_at, used_at or out_pages is null", who));
    const std::size_t need = prefetch_request_workspace(entries);
    if (ws.bytes < need)
      return record_error(Status::error(StatusCode::kWorkspaceTooSmall, "%s: workspace is %zu bytes, needs %zu", who, ws.bytes, need));
    WorkspaceCarver c(ws);
    auto* keys = reinterpret_cast<unsigned long long*>(c.take<std::uint64_t>(static_cast<std::size_t>(entries)));
    auto* sorted = reinterpret_cast<unsigned long long*>(c.take<std::uint64_t>(static_cast<std::size_t>(entries)));
    std::size_t scratch = sort_scratch(entries);
    std::byte* tmp = c.take<std::byte>(scratch);
    request_keys_kernel<<<blocks_for(entries), kThreads, 0, s>>>(prio, entries, keys);
    const cudaError_t e = cub::DeviceRadixSort::SortKeysDescending(tmp, scratch, keys, sorted, static_cast<int>(entries), 0, 64, s);
    if (e != cudaSuccess) return record_error(device_error(who, "cub radix sort", e));
    request_kernel<<<1, kBlock, 0, s>>>(sorted, prio, entry_pages, entries, reinterpret_cast<long long*>(predicted_at), used_at, pending,
                                        target, static_cast<long long>(serial), out_pages, out_priority, out_size);
  } else {
    // An empty table: size 0 (one tiny launch keeps the writes on the stream).
    request_kernel<<<1, kBlock, 0, s>>>(nullptr, prio, entry_pages, 0, reinterpret_cast<long long*>(predicted_at), used_at, pending, target,
                                        static_cast<long long>(serial), out_pages, out_priority, out_size);
  }
  record_error(launch_status(who));
}

void Cuda::prefetch_observe(const std::int32_t* pages, std::int64_t n, std::int64_t* used_at, const std::int64_t* predicted_at,
                            const std::int64_t* pending, std::int64_t step, bool has_prediction, std::int64_t serial,
                            PrefetchCounters* counters) noexcept {
  using namespace cuda_detail;
  constexpr const char* who = "cuda prefetch_observe";
  if (n < 0 || step < 0)
    return record_error(KVP_INVALID("%s: n=%lld, step=%lld, must be >= 0", who, static_cast<long long>(n), static_cast<long long>(step)));
  if (counters == nullptr || pending == nullptr || (n > 0 && (pages == nullptr || used_at == nullptr || predicted_at == nullptr)))
    return record_error(KVP_INVALID("%s: counters, pending, pages, used_at or predicted_at is null", who));
  observe_kernel<<<1, kBlock, 0, as_stream(current_stream())>>>(pages, n, reinterpret_cast<unsigned long long*>(used_at), predicted_at,
                                                                pending, static_cast<long long>(step), has_prediction, serial, counters);
  record_error(launch_status(who));
}

}  // namespace backend
KVP_NAMESPACE_END
