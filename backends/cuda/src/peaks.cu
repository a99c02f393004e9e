// SPDX-License-Identifier: Apache-2.0
// `Cuda::measure_peaks`: the device's read bandwidth, fp32 FMA rate and fp16
// tensor-core rate, measured with kernels built for the purpose, so benchmark
// figures are fractions of what this device does in this process.
#include <cuda_runtime.h>

#include <cstring>

#include "cuda_common.cuh"
#include "kvpolicy/backends/cuda.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda_detail {
namespace {

/// Streaming read: each thread sums 16-byte vectors grid-stride; one store per thread keeps the loads live.
__global__ void read_kernel(const float4* __restrict__ in, std::size_t n, float* __restrict__ sink) {
  float acc = 0.0f;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const float4 v = __ldcs(in + i);
    acc += v.x + v.y + v.z + v.w;
  }
  if (acc == 1.2345f) sink[0] = acc;  // practically never true; the compiler cannot drop the loads
}

constexpr int kFmaChains = 8;
constexpr int kFmaIters = 4096;

/// kFmaChains independent FMA chains per thread: 2 * kFmaChains * kFmaIters flops per thread.
__global__ void fma_kernel(float seed, float* __restrict__ sink) {
  float a[kFmaChains];
#pragma unroll
  for (int c = 0; c < kFmaChains; ++c) a[c] = seed + static_cast<float>(threadIdx.x + c);
  const float m = 0.999999f, b = 1e-7f;
  for (int i = 0; i < kFmaIters; ++i) {
#pragma unroll
    for (int c = 0; c < kFmaChains; ++c) a[c] = fmaf(a[c], m, b);
  }
  float s = 0.0f;
#pragma unroll
  for (int c = 0; c < kFmaChains; ++c) s += a[c];
  if (s == 1.2345f) sink[0] = s;
}

constexpr int kMmaIters = 2048;

/// fp16 tensor-core MMA m16n8k16 (fp32 accumulate) in 4 independent chains per warp:
/// 2*16*8*16 flops per mma per warp.
__global__ void mma_kernel(float* __restrict__ sink) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  unsigned a0 = 0x3c003c00u ^ threadIdx.x, a1 = a0 + 1, a2 = a0 + 2, a3 = a0 + 3, b0 = 0x3c003c00u, b1 = b0 ^ 1u;
  float c[4][4] = {};
  for (int i = 0; i < kMmaIters; ++i) {
#pragma unroll
    for (int ch = 0; ch < 4; ++ch) {
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                   : "+f"(c[ch][0]), "+f"(c[ch][1]), "+f"(c[ch][2]), "+f"(c[ch][3])
                   : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
  }
  float s = 0.0f;
  for (int ch = 0; ch < 4; ++ch) s += c[ch][0] + c[ch][1] + c[ch][2] + c[ch][3];
  if (s == 1.2345f) sink[0] = s;
#else
  if (threadIdx.x == 0 && blockIdx.x == 0 && sink == nullptr) sink[0] = 0.0f;
#endif
}

/// Best time in seconds of `reps` runs of `launch` after one warm-up; < 0 on error.
template <class F>
double best_seconds(F&& launch, int reps) {
  cudaEvent_t a = nullptr, b = nullptr;
  if (cudaEventCreate(&a) != cudaSuccess || cudaEventCreate(&b) != cudaSuccess) return -1.0;
  double best = -1.0;
  launch();
  if (cudaDeviceSynchronize() == cudaSuccess) {
    for (int r = 0; r < reps; ++r) {
      cudaEventRecord(a);
      launch();
      cudaEventRecord(b);
      if (cudaEventSynchronize(b) != cudaSuccess) {
        best = -1.0;
        break;
      }
      float ms = 0.0f;
      cudaEventElapsedTime(&ms, a, b);
      const double s = static_cast<double>(ms) * 1e-3;
      if (best < 0.0 || s < best) best = s;
    }
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return best;
}

}  // namespace
}  // namespace cuda_detail

namespace backend {

Status Cuda::measure_peaks(Peaks* out) noexcept {
  using namespace cuda_detail;
  KVP_REQUIRE(out != nullptr, "cuda measure_peaks: out is null");
  *out = Peaks{};
  int dev = 0;
  cudaDeviceProp prop{};
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return device_error("cuda measure_peaks", "cudaGetDevice", e);
  if (cudaError_t e = cudaGetDeviceProperties(&prop, dev); e != cudaSuccess)
    return device_error("cuda measure_peaks", "cudaGetDeviceProperties", e);
  for (std::size_t i = 0; i + 1 < sizeof(out->name) && prop.name[i] != '\0'; ++i) out->name[i] = prop.name[i];
  out->sm_count = prop.multiProcessorCount;

  constexpr std::size_t kBytes = std::size_t{2} << 30;
  void* buf = nullptr;
  float* sink = nullptr;
  if (cudaError_t e = cudaMalloc(&buf, kBytes); e != cudaSuccess) return device_error("cuda measure_peaks", "cudaMalloc", e);
  if (cudaError_t e = cudaMalloc(&sink, sizeof(float)); e != cudaSuccess) {
    cudaFree(buf);
    return device_error("cuda measure_peaks", "cudaMalloc", e);
  }
  cudaMemset(buf, 0, kBytes);
  const unsigned blocks = static_cast<unsigned>(prop.multiProcessorCount * 8);
  const double t_read =
      best_seconds([&] { read_kernel<<<blocks, 512>>>(static_cast<const float4*>(buf), kBytes / sizeof(float4), sink); }, 10);
  const unsigned fma_blocks = static_cast<unsigned>(prop.multiProcessorCount * 16);
  const double t_fma = best_seconds([&] { fma_kernel<<<fma_blocks, 256>>>(1.0f, sink); }, 5);
  const unsigned mma_blocks = static_cast<unsigned>(prop.multiProcessorCount * 8);
  const double t_mma = prop.major >= 8 ? best_seconds([&] { mma_kernel<<<mma_blocks, 256>>>(sink); }, 5) : -1.0;
  const cudaError_t e = cudaGetLastError();
  cudaFree(buf);
  cudaFree(sink);
  if (e != cudaSuccess) return device_error("cuda measure_peaks", "probe kernels", e);
  if (t_read > 0.0) out->read_bytes_per_s = static_cast<double>(kBytes) / t_read;
  if (t_fma > 0.0) out->fp32_flops_per_s = 2.0 * kFmaChains * kFmaIters * static_cast<double>(fma_blocks) * 256.0 / t_fma;
  if (t_mma > 0.0) out->fp16_tc_flops_per_s = 2.0 * 16 * 8 * 16 * 4.0 * kMmaIters * static_cast<double>(mma_blocks) * 8.0 / t_mma;
  return Status::ok();
}

}  // namespace backend
KVP_NAMESPACE_END
