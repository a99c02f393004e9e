// Shared by the CUDA benchmarks (bench_cuda.cpp, bench_cuda_policies.cpp).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace kvp_cuda_bench {

/// Device buffer that frees itself; `ok` is false when cudaMalloc failed.
struct DeviceBuffer {
  void* ptr = nullptr;
  bool ok = false;
  explicit DeviceBuffer(std::size_t bytes) { ok = bytes == 0 || cudaMalloc(&ptr, bytes) == cudaSuccess; }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr != nullptr) cudaFree(ptr);
  }
};

}  // namespace kvp_cuda_bench
