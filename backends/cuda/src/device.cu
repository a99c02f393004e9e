// SPDX-License-Identifier: Apache-2.0
// `Cuda::device_count` / `Cuda::device_available`.
#include "cuda_common.cuh"
#include "kvpolicy/backends/cuda.hpp"

KVP_NAMESPACE_BEGIN
namespace backend {

Status Cuda::device_count(int* count) noexcept {
  KVP_REQUIRE(count != nullptr, "cuda device_count: count is null");
  *count = 0;
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // clear it so it is not reported by a later launch check
    return Status::error(StatusCode::kDeviceError, "cudaGetDeviceCount: %s", cudaGetErrorString(e));
  }
  *count = n;
  return Status::ok();
}

bool Cuda::device_available() noexcept {
  int n = 0;
  return device_count(&n).is_ok() && n > 0;
}

}  // namespace backend
KVP_NAMESPACE_END
