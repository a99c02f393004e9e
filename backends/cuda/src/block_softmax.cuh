// SPDX-License-Identifier: Apache-2.0
// One row's softmax by one thread block, in the host references' form
// (the prefetchers' `softmax`): the max as std::max folds it (NaN entries
// skipped), each entry exp(x - max) with the device's expf, their sum in
// double across the block, then every entry times the fp32 reciprocal of
// that sum. Masked entries become 0 and stay out of the sum (their input is
// -inf, so they never win the max). The result is within a few ulp of the
// host's (expf and the order of the double sum differ).
#pragma once

#include <cub/block/block_reduce.cuh>

#include <cstdint>

#include "cuda_common.cuh"

KVP_NAMESPACE_BEGIN
namespace cuda_detail {

template <int Threads>
struct BlockSoftmax {
  using MaxReduce = cub::BlockReduce<float, Threads>;
  using SumReduce = cub::BlockReduce<double, Threads>;
  struct Shared {
    union {
      typename MaxReduce::TempStorage mx;
      typename SumReduce::TempStorage sum;
    } tmp;
    float max;
    double total;
  };
  struct MaxAsHost {  // std::max(a, b): b when a < b (a NaN partial never arises: rows start at -inf)
    __device__ __forceinline__ float operator()(float a, float b) const { return a < b ? b : a; }
  };

  /// x[0..n) in place; `masked(i)` entries become 0. Every thread of the block calls it; it ends synchronised.
  template <class Masked>
  static __device__ void run(float* x, std::int64_t n, Masked masked, Shared& sh) {
    float m = __int_as_float(static_cast<int>(0xff800000u));
    for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) m = m < x[i] ? x[i] : m;
    m = MaxReduce(sh.tmp.mx).Reduce(m, MaxAsHost{});
    if (threadIdx.x == 0) sh.max = m;
    __syncthreads();
    const float mx = sh.max;
    double sum = 0.0;
    for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const float e = masked(i) ? 0.0f : expf(__fsub_rn(x[i], mx));
      x[i] = e;
      sum += static_cast<double>(e);
    }
    sum = SumReduce(sh.tmp.sum).Sum(sum);
    if (threadIdx.x == 0) sh.total = sum;
    __syncthreads();
    const float inv = __double2float_rn(1.0 / sh.total);
    for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) x[i] = __fmul_rn(x[i], inv);
    __syncthreads();  // the next call reuses the shared storage; callers read other threads' entries
  }
};

}  // namespace cuda_detail
KVP_NAMESPACE_END
