// SPDX-License-Identifier: Apache-2.0
// CaM's streaming merge and kvpress CAMPress on device memory
// (`ScalarMergeOps`' CaM ops, ops/merge_scalar.hpp): torch's CPU generator,
// the evicted ids, CAMPress's candidates and one kv head's dense entries and
// merged value rows. The per-thread arithmetic is ops/cam_steps.hpp's, the
// host path's own, and this file is compiled without FMA contraction, so the
// results equal the scalar reference bit for bit. No allocation, no
// synchronisation: every launch goes on the calling thread's current stream.
#include <cstdint>

#include "cuda_common.cuh"
#include "kvpolicy/backends/cuda.hpp"
#include "kvpolicy/ops/cam_steps.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda_detail {
namespace {

constexpr int kThreads = 128;
constexpr int kTwistThreads = 256;
constexpr int kCompactThreads = 1024;
constexpr int kRankTile = 256;

unsigned blocks_for(std::int64_t n) noexcept { return grid_blocks(n, kThreads); }

/// One block: seed, then per 624 outputs one twist in its three phases (every element of a phase
/// computed from the state, a barrier, written back, a barrier) and the tempered outputs.
__global__ void __launch_bounds__(kTwistThreads) uniforms_kernel(std::uint32_t seed, std::int64_t n, float* __restrict__ u) {
  __shared__ std::uint32_t mt[ops::kMtStateSize];
  __shared__ std::uint32_t next[ops::kMtStateSize];
  if (threadIdx.x == 0) ops::mt_seed(mt, seed);
  __syncthreads();
  for (std::int64_t base = 0; base < n; base += ops::kMtStateSize) {
    int lo = 0;
    for (int p = 0; p < ops::kMtPhases; ++p) {
      const int hi = ops::mt_phase_end(p);
      for (int i = lo + static_cast<int>(threadIdx.x); i < hi; i += kTwistThreads) next[i] = ops::mt_twisted(mt, i);
      __syncthreads();
      for (int i = lo + static_cast<int>(threadIdx.x); i < hi; i += kTwistThreads) mt[i] = next[i];
      __syncthreads();
      lo = hi;
    }
    for (int i = static_cast<int>(threadIdx.x); i < ops::kMtStateSize && base + i < n; i += kTwistThreads)
      u[base + i] = ops::torch_uniform(ops::mt_temper(mt[i]));
  }
}

/// evicted[i] = the i-th token id not in the ascending kept[0, C).
__global__ void evicted_kernel(const std::int32_t* __restrict__ kept, std::int64_t C, std::int64_t T, std::int32_t* __restrict__ evicted) {
  for (std::int64_t j = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; j < T;
       j += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t lo = ops::kept_lower_bound(kept, C, static_cast<std::int32_t>(j));
    if (lo < C && kept[lo] == j) continue;
    evicted[j - lo] = static_cast<std::int32_t>(j);
  }
}

/// key[i] = (score_order_key(mean over the H rows of scores at ev[i], summed in row order) << 32) | ev[i].
__global__ void candidate_keys_kernel(const float* __restrict__ scores, std::int64_t ld, std::int64_t cs, std::int64_t H,
                                      const std::int32_t* __restrict__ ev, std::int64_t E, std::uint64_t* __restrict__ key) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < E;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    float acc = 0.0f;
    for (std::int64_t h = 0; h < H; ++h) acc += scores[h * ld + ev[i] * cs];
    key[i] = (static_cast<std::uint64_t>(score_order_key(acc / static_cast<float>(H))) << 32) | static_cast<std::uint32_t>(ev[i]);
  }
}

/// flag[i] = 1 when fewer than k keys exceed key[i] (the keys are distinct: the k largest).
__global__ void __launch_bounds__(kRankTile)
    rank_kernel(const std::uint64_t* __restrict__ key, std::int64_t E, std::int64_t k, std::uint8_t* __restrict__ flag) {
  __shared__ std::uint64_t tile[kRankTile];
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(kRankTile) + threadIdx.x;
  const std::uint64_t mine = i < E ? key[i] : 0;
  std::int64_t above = 0;
  for (std::int64_t t0 = 0; t0 < E; t0 += kRankTile) {
    __syncthreads();
    if (t0 + threadIdx.x < E) tile[threadIdx.x] = key[t0 + threadIdx.x];
    __syncthreads();
    const int m = E - t0 < kRankTile ? static_cast<int>(E - t0) : kRankTile;
    for (int j = 0; j < m; ++j) above += tile[j] > mine ? 1 : 0;
  }
  if (i < E) flag[i] = above < k ? 1 : 0;
}

/// One block: cand[0, k) = the flagged ev ids in ascending order (a block-wide prefix count per chunk).
__global__ void __launch_bounds__(kCompactThreads)
    compact_kernel(const std::int32_t* __restrict__ ev, const std::uint8_t* __restrict__ flag, std::int64_t E,
                   std::int32_t* __restrict__ cand) {
  __shared__ int warp_sum[kCompactThreads / 32];
  std::int64_t base = 0;
  for (std::int64_t c0 = 0; c0 < E; c0 += kCompactThreads) {
    const std::int64_t i = c0 + threadIdx.x;
    const bool f = i < E && flag[i] != 0;
    int total = 0;
    const int before = block_flag_rank<kCompactThreads>(f, warp_sum, &total);
    if (f) cand[base + before] = ev[i];
    base += total;
  }
}

/// Candidate j's dense entries (ops::cam_entries) and its first window slot.
__global__ void cam_entries_kernel(ops::CamRule rule, ops::CamAttention attn, std::int64_t h, const std::int32_t* __restrict__ kept,
                                   std::int64_t C, const std::int32_t* __restrict__ cand, std::int64_t n, const float* __restrict__ u,
                                   std::int64_t u_stride, std::int32_t* __restrict__ dst, std::int32_t* __restrict__ src,
                                   float* __restrict__ weight, std::int64_t* __restrict__ start) {
  for (std::int64_t j = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; j < n;
       j += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t e = j * rule.window;
    start[j] = ops::cam_entries(rule, attn, h, kept, C, cand[j], u[j * u_stride], dst + e, src + e, weight + e);
  }
}

/// Kept slot s per block (grid-stride), columns over the threads: the merged row where a drawn candidate reaches s.
template <class Tk>
__global__ void cam_values_kernel(ops::CamRule rule, Rows<Tk> values, const std::int32_t* __restrict__ kept, std::int64_t C,
                                  const std::int32_t* __restrict__ cand, const std::int64_t* __restrict__ start, std::int64_t n,
                                  const std::int32_t* __restrict__ dst, const float* __restrict__ weight, std::int64_t d,
                                  float* __restrict__ out, std::int64_t vld) {
  for (std::int64_t s = blockIdx.x; s < C; s += gridDim.x)
    for (std::int64_t c = threadIdx.x; c < d; c += blockDim.x) {
      bool touched = false;
      const float v = ops::cam_merged_value(rule, values, kept, cand, start, n, dst, weight, s, c, &touched);
      if (!touched) break;  // the same for every column of the slot
      out[s * vld + c] = v;
    }
}

}  // namespace
}  // namespace cuda_detail

namespace backend {

void Cuda::torch_uniforms(std::uint32_t seed, std::int64_t n, float* u) noexcept {
  using namespace cuda_detail;
  constexpr const char* who = "cuda torch_uniforms";
  if (n < 0) return record_error(KVP_INVALID("%s: n is %lld, must be >= 0", who, static_cast<long long>(n)));
  if (n == 0) return;
  if (u == nullptr) return record_error(KVP_INVALID("%s: u is null", who));
  uniforms_kernel<<<1, kTwistThreads, 0, as_stream(current_stream())>>>(seed, n, u);
  record_error(launch_status(who));
}

void Cuda::evicted_ids(const std::int32_t* kept, std::int64_t C, std::int64_t T, std::int32_t* evicted) noexcept {
  using namespace cuda_detail;
  constexpr const char* who = "cuda evicted_ids";
  if (C < 0 || C > T || T > INT32_MAX)
    return record_error(
        KVP_INVALID("%s: C=%lld, T=%lld, need 0 <= C <= T <= INT32_MAX", who, static_cast<long long>(C), static_cast<long long>(T)));
  if (T == C) return;
  if (evicted == nullptr || (C > 0 && kept == nullptr)) return record_error(KVP_INVALID("%s: kept or evicted is null", who));
  evicted_kernel<<<blocks_for(T), kThreads, 0, as_stream(current_stream())>>>(kept, C, T, evicted);
  record_error(launch_status(who));
}

std::size_t Cuda::cam_candidates_workspace(std::int64_t T) noexcept {
  const auto t = static_cast<std::size_t>(T > 1 ? T : 1);
  return WorkspacePlan{}.add<std::int32_t>(t).add<std::uint64_t>(t).add<std::uint8_t>(t).total();
}

void Cuda::cam_candidates(TensorView<const float, 2> scores, const std::int32_t* kept, std::int64_t C, std::int64_t T, std::int64_t k,
                          std::int32_t* cand, Workspace ws) noexcept {
  using namespace cuda_detail;
  constexpr const char* who = "cuda cam_candidates";
  if (C < 0 || C > T || T > INT32_MAX || k < 0)
    return record_error(KVP_INVALID("%s: C=%lld, T=%lld, k=%lld, need 0 <= C <= T <= INT32_MAX and k >= 0", who, static_cast<long long>(C),
                                    static_cast<long long>(T), static_cast<long long>(k)));
  const std::int64_t E = T - C;
  if (E == 0 || k == 0) return;
  if (cand == nullptr || (C > 0 && kept == nullptr)) return record_error(KVP_INVALID("%s: kept or cand is null", who));
  if (k < E && (scores.data() == nullptr || scores.extent(0) < 1 || scores.extent(1) != T))
    return record_error(KVP_INVALID("%s: scores has shape (%lld, %lld), expected (>= 1, T=%lld)", who,
                                    static_cast<long long>(scores.extent(0)), static_cast<long long>(scores.extent(1)),
                                    static_cast<long long>(T)));
  const std::size_t need = cam_candidates_workspace(T);
  if (ws.data == nullptr || ws.bytes < need)
    return record_error(Status::error(StatusCode::kWorkspaceTooSmall, "%s: workspace is %zu bytes, needs %zu", who, ws.bytes, need));
  WorkspaceCarver c(ws);
  const auto t = static_cast<std::size_t>(T);
  std::int32_t* ev = c.take<std::int32_t>(t);
  std::uint64_t* key = c.take<std::uint64_t>(t);
  std::uint8_t* flag = c.take<std::uint8_t>(t);
  const cudaStream_t st = as_stream(current_stream());
  evicted_kernel<<<blocks_for(T), kThreads, 0, st>>>(kept, C, T, k >= E ? cand : ev);
  if (k < E) {
    candidate_keys_kernel<<<blocks_for(E), kThreads, 0, st>>>(scores.data(), scores.stride(0), scores.stride(1), scores.extent(0), ev, E,
                                                              key);
    rank_kernel<<<static_cast<unsigned>((E + kRankTile - 1) / kRankTile), kRankTile, 0, st>>>(key, E, k, flag);
    compact_kernel<<<1, kCompactThreads, 0, st>>>(ev, flag, E, cand);
  }
  record_error(launch_status(who));
}

template <class Tk>
void Cuda::cam_merge_head(const ops::CamRule& rule, const ops::CamAttention& attn, std::int64_t h, const Rows<Tk>& values,
                          const std::int32_t* kept, std::int64_t C, const std::int32_t* cand, std::int64_t n, std::int64_t d,
                          const float* u, std::int64_t u_stride, std::int32_t* dst, std::int32_t* src, float* weight, float* merged_values,
                          std::int64_t vld, std::int64_t* start) noexcept {
  using namespace cuda_detail;
  constexpr const char* who = "cuda cam_merge_head";
  if (rule.window < 1 || C < 0 || n < 0 || d < 1 || h < 0 || attn.group < 1)
    return record_error(
        KVP_INVALID("%s: window=%d, C=%lld, n=%lld, d=%lld, h=%lld, group=%lld: need window, d, group >= 1 and C, n, h >= 0", who,
                    rule.window, static_cast<long long>(C), static_cast<long long>(n), static_cast<long long>(d), static_cast<long long>(h),
                    static_cast<long long>(attn.group)));
  if (n == 0) return;
  if (cand == nullptr || u == nullptr || dst == nullptr || src == nullptr || weight == nullptr || start == nullptr || attn.data == nullptr)
    return record_error(KVP_INVALID("%s: cand, u, dst, src, weight, start or the attention sums are null", who));
  if (C > 0 && (kept == nullptr || (merged_values != nullptr && values.base == nullptr)))
    return record_error(KVP_INVALID("%s: kept or values is null", who));
  const cudaStream_t st = as_stream(current_stream());
  cam_entries_kernel<<<blocks_for(n), kThreads, 0, st>>>(rule, attn, h, kept, C, cand, n, u, u_stride, dst, src, weight, start);
  if (merged_values != nullptr && C > 0) {
    const unsigned slots = static_cast<unsigned>(C < 65535 ? C : 65535);
    cam_values_kernel<Tk><<<slots, kThreads, 0, st>>>(rule, values, kept, C, cand, start, n, dst, weight, d, merged_values, vld);
  }
  record_error(launch_status(who));
}

#define KVP_CUDA_CAM_OPS(T)                                                                                                               \
  template void Cuda::cam_merge_head<T>(const ops::CamRule&, const ops::CamAttention&, std::int64_t, const Rows<T>&, const std::int32_t*, \
                                        std::int64_t, const std::int32_t*, std::int64_t, std::int64_t, const float*, std::int64_t,        \
                                        std::int32_t*, std::int32_t*, float*, float*, std::int64_t, std::int64_t*) noexcept;
KVP_CUDA_CAM_OPS(float)
KVP_CUDA_CAM_OPS(half)
KVP_CUDA_CAM_OPS(bfloat16)
#undef KVP_CUDA_CAM_OPS

}  // namespace backend
KVP_NAMESPACE_END
