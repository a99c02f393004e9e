// SPDX-License-Identifier: Apache-2.0
// MiniCache's merge of one kv head of a layer pair on device memory
// (`ScalarMergeOps::minicache_head`, ops/merge_scalar.hpp). Two launches on
// the calling thread's current stream, no allocation, no synchronisation:
//   1. one thread per token: both rows widened into the workspace, their
//      norms (norm16), the distance and the unit SLERP direction
//      (ops/minicache_steps.hpp, the host path's arithmetic; this file is
//      compiled without FMA contraction, acosf / sinf are CUDA's);
//   2. one block: the head's distance range (min / max, order-free), the
//      threshold, and the retained tokens compacted in ascending order after
//      the previous heads' (the offset read from indptr[h] on the device,
//      indptr[h + 1] written), their widened rows copied.
#include <cstdint>

#include "cuda_common.cuh"
#include "kvpolicy/backends/cuda.hpp"
#include "kvpolicy/ops/minicache_steps.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda_detail {
namespace {

constexpr int kThreads = 128;
constexpr int kRetainThreads = 1024;

unsigned blocks_for(std::int64_t n) noexcept { return grid_blocks(n, kThreads); }

/// A head with no tokens: retains nothing.
__global__ void empty_head_kernel(std::int64_t h, std::int32_t* __restrict__ indptr) {
  if (h == 0) indptr[0] = 0;
  indptr[h + 1] = indptr[h];
}

template <class Tk>
__global__ void pair_kernel(float t, Rows<Tk> prev, Rows<Tk> cur, std::int64_t T, std::int64_t d, float* __restrict__ a,
                            float* __restrict__ b, float* __restrict__ dist, float* __restrict__ norm_prev, std::int64_t np_stride,
                            float* __restrict__ norm_cur, std::int64_t nc_stride, float* __restrict__ direction, std::int64_t dir_stride) {
  for (std::int64_t j = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; j < T;
       j += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    float* aj = a + j * d;
    float* bj = b + j * d;
    const Tk* pr = prev.row(j);
    const Tk* cr = cur.row(j);
    for (std::int64_t k = 0; k < d; ++k) aj[k] = load_f32(pr + k), bj[k] = load_f32(cr + k);
    const float na = ops::norm16(aj, d), nb = ops::norm16(bj, d);
    norm_prev[j * np_stride] = na;
    norm_cur[j * nc_stride] = nb;
    dist[j] = ops::minicache_distance(aj, na, bj, nb, d);
    ops::minicache_slerp(t, aj, na, bj, nb, d, direction + j * dir_stride);
  }
}

__global__ void __launch_bounds__(kRetainThreads)
    retain_kernel(float gamma, const float* __restrict__ dist, const float* __restrict__ a, const float* __restrict__ b, std::int64_t T,
                  std::int64_t d, std::int64_t h, std::int32_t* __restrict__ indptr, std::int32_t* __restrict__ ids,
                  float* __restrict__ retained_prev, std::int64_t rp_stride, float* __restrict__ retained_cur, std::int64_t rc_stride) {
  __shared__ float lo_part[kRetainThreads / 32], hi_part[kRetainThreads / 32];
  __shared__ int warp_sum[kRetainThreads / 32];
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  constexpr int kWarps = kRetainThreads / 32;
  // The distance range (min and max are exact in any order).
  float lo = dist[0], hi = dist[0];
  for (std::int64_t j = threadIdx.x; j < T; j += kRetainThreads) lo = fminf(lo, dist[j]), hi = fmaxf(hi, dist[j]);
  for (int off = 16; off > 0; off /= 2) {
    lo = fminf(lo, __shfl_down_sync(0xffffffffu, lo, off));
    hi = fmaxf(hi, __shfl_down_sync(0xffffffffu, hi, off));
  }
  if (lane == 0) lo_part[warp] = lo, hi_part[warp] = hi;
  __syncthreads();
  lo = lo_part[0];
  hi = hi_part[0];
  for (int w = 1; w < kWarps; ++w) lo = fminf(lo, lo_part[w]), hi = fmaxf(hi, hi_part[w]);
  const float thr = ops::minicache_threshold(lo, hi, gamma);
  std::int64_t base = h == 0 ? 0 : indptr[h];
  for (std::int64_t c0 = 0; c0 < T; c0 += kRetainThreads) {
    const std::int64_t j = c0 + threadIdx.x;
    const bool f = j < T && dist[j] > thr;
    int total = 0;
    const int before = block_flag_rank<kRetainThreads>(f, warp_sum, &total);
    if (f) {
      const std::int64_t pos = base + before;
      ids[pos] = static_cast<std::int32_t>(j);
      for (std::int64_t k = 0; k < d; ++k)
        retained_prev[pos * rp_stride + k] = a[j * d + k], retained_cur[pos * rc_stride + k] = b[j * d + k];
    }
    base += total;
  }
  if (threadIdx.x == 0) {
    if (h == 0) indptr[0] = 0;
    indptr[h + 1] = static_cast<std::int32_t>(base);
  }
}

}  // namespace
}  // namespace cuda_detail

namespace backend {

std::size_t Cuda::minicache_workspace(std::int64_t T, std::int64_t d) noexcept {
  const auto t = static_cast<std::size_t>(T > 1 ? T : 1), dd = static_cast<std::size_t>(d > 1 ? d : 1);
  return WorkspacePlan{}.add<float>(t * dd).add<float>(t * dd).add<float>(t).total();
}

template <class Tk>
void Cuda::minicache_head(float t, float gamma, const Rows<Tk>& prev, const Rows<Tk>& cur, std::int64_t T, std::int64_t d, std::int64_t h,
                          float* norm_prev, float* norm_cur, std::int64_t np_stride, std::int64_t nc_stride, float* direction,
                          std::int64_t dir_stride, std::int32_t* indptr, std::int32_t* retained_ids, float* retained_prev,
                          std::int64_t rp_stride, float* retained_cur, std::int64_t rc_stride, Workspace ws) noexcept {
  using namespace cuda_detail;
  constexpr const char* who = "cuda minicache_head";
  if (T < 0 || T > INT32_MAX || d < 1 || h < 0 || !(t >= 0.0f && t <= 1.0f) || !(gamma >= 0.0f && gamma <= 1.0f))
    return record_error(
        KVP_INVALID("%s: T=%lld, d=%lld, h=%lld, t=%g, gamma=%g: need 0 <= T <= INT32_MAX, d >= 1, h >= 0, t and gamma in [0, 1]", who,
                    static_cast<long long>(T), static_cast<long long>(d), static_cast<long long>(h), static_cast<double>(t),
                    static_cast<double>(gamma)));
  if (indptr == nullptr) return record_error(KVP_INVALID("%s: indptr is null", who));
  if (T > 0 && (prev.base == nullptr || cur.base == nullptr || norm_prev == nullptr || norm_cur == nullptr || direction == nullptr ||
                retained_ids == nullptr || retained_prev == nullptr || retained_cur == nullptr))
    return record_error(KVP_INVALID("%s: a row, norm, direction or retained pointer is null", who));
  const std::size_t need = minicache_workspace(T, d);
  if (ws.data == nullptr || ws.bytes < need)
    return record_error(Status::error(StatusCode::kWorkspaceTooSmall, "%s: workspace is %zu bytes, needs %zu", who, ws.bytes, need));
  WorkspaceCarver c(ws);
  const auto t1 = static_cast<std::size_t>(T > 1 ? T : 1), dd = static_cast<std::size_t>(d);
  float* a = c.take<float>(t1 * dd);
  float* b = c.take<float>(t1 * dd);
  float* dist = c.take<float>(t1);
  const cudaStream_t st = as_stream(current_stream());
  if (T > 0)
    pair_kernel<Tk><<<blocks_for(T), kThreads, 0, st>>>(t, prev, cur, T, d, a, b, dist, norm_prev, np_stride, norm_cur, nc_stride,
                                                        direction, dir_stride);
  if (T > 0)
    retain_kernel<<<1, kRetainThreads, 0, st>>>(gamma, dist, a, b, T, d, h, indptr, retained_ids, retained_prev, rp_stride, retained_cur,
                                                rc_stride);
  else
    empty_head_kernel<<<1, 1, 0, st>>>(h, indptr);
  record_error(launch_status(who));
}

#define KVP_CUDA_MINICACHE(T)                                                                                                           \
  template void Cuda::minicache_head<T>(float, float, const Rows<T>&, const Rows<T>&, std::int64_t, std::int64_t, std::int64_t, float*, \
                                        float*, std::int64_t, std::int64_t, float*, std::int64_t, std::int32_t*, std::int32_t*, float*, \
                                        std::int64_t, float*, std::int64_t, Workspace) noexcept;
KVP_CUDA_MINICACHE(float)
KVP_CUDA_MINICACHE(half)
KVP_CUDA_MINICACHE(bfloat16)
#undef KVP_CUDA_MINICACHE

}  // namespace backend
KVP_NAMESPACE_END
