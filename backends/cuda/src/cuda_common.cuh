// SPDX-License-Identifier: Apache-2.0
// Internal to kvpolicy::cuda: CUDA error -> Status, the device-side view of
// `Rows`, element loads, the exact narrowing stores of `from_float` and the
// order key of `score_order_key`.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/rows.hpp"
#include "kvpolicy/core/status.hpp"
#include "kvpolicy/ops/scalar.hpp"  // score_order_key (host + device)

KVP_NAMESPACE_BEGIN
namespace cuda_detail {

/// "who: what: <CUDA error string> (<CUDA error name>)".
inline Status device_error(const char* who, const char* what, cudaError_t e) noexcept {
  return Status::error(StatusCode::kDeviceError, "%s: %s: %s (%s)", who, what, cudaGetErrorString(e), cudaGetErrorName(e));
}

/// Status of the kernel launches just enqueued (launch-configuration errors
/// only; this does not synchronise).
inline Status launch_status(const char* who) noexcept {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? Status::ok() : device_error(who, "kernel launch", e);
}

inline cudaStream_t as_stream(void* stream) noexcept { return static_cast<cudaStream_t>(stream); }

/// Records `s` in the calling thread's error slot (the first error of a policy
/// call wins; `Cuda::CallScope::end` returns it). Defined in contract_ops.cu.
void record_error(const Status& s) noexcept;

/// Blocks of `threads` threads that cover n items (at least one, at most the grid's x limit: kernels launched
/// with it loop grid-stride).
inline unsigned grid_blocks(std::int64_t n, int threads) noexcept {
  constexpr std::int64_t kMaxGridX = 2147483647;
  const std::int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < kMaxGridX ? (b > 0 ? b : 1) : kMaxGridX);
}

/// One chunk of a block-wide ordered compaction: every thread of the block (kBlock threads) passes its
/// flag; returns how many flagged threads precede it in the block and sets *total to the chunk's flagged
/// count. `warp_sum`: kBlock / 32 shared ints. Ends with a barrier, so the next chunk can call it again.
template <int kBlock>
__device__ __forceinline__ int block_flag_rank(bool flag, int* warp_sum, int* total) {
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  const unsigned ballot = __ballot_sync(0xffffffffu, flag);
  if (lane == 0) warp_sum[warp] = __popc(ballot);
  __syncthreads();
  int before = __popc(ballot & ((1u << lane) - 1u)), all = 0;
  for (int w = 0; w < kBlock / 32; ++w) {
    if (w < warp) before += warp_sum[w];
    all += warp_sum[w];
  }
  *total = all;
  __syncthreads();
  return before;
}

/// -inf / +inf as device constants.
__device__ __forceinline__ float neg_inf() { return __int_as_float(static_cast<int>(0xff800000u)); }
__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }

/// First position of the ascending row[0..n) holding a value >= v (n when none).
__device__ __forceinline__ std::int64_t sorted_lower_bound(const std::int32_t* row, std::int64_t n, std::int64_t v) {
  std::int64_t lo = 0, hi = n;
  while (lo < hi) {
    const std::int64_t mid = (lo + hi) / 2;
    if (row[mid] < v)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/// Exact widening loads (every half / bfloat16 is a float).
__device__ __forceinline__ float load_f32(const float* p) { return *p; }
__device__ __forceinline__ float load_f32(const half* p) { return __half2float(__ushort_as_half(p->bits)); }
__device__ __forceinline__ float load_f32(const bfloat16* p) { return __uint_as_float(static_cast<unsigned int>(p->bits) << 16); }

/// `*p = from_float<T>(v)` (core/dtype.hpp's conversions are host-device: the device rounds as the host).
template <class T>
__device__ __forceinline__ void store_exact(T* p, float v) {
  *p = from_float<T>(v);
}

}  // namespace cuda_detail
KVP_NAMESPACE_END
