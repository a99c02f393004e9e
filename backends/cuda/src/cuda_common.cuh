// SPDX-License-Identifier: Apache-2.0
// Internal to kvpolicy::cuda: CUDA error -> Status, the device-side view of
// `KeyRows`, element loads and the order key of `score_order_key`.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/key_rows.hpp"
#include "kvpolicy/core/status.hpp"

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

/// `KeyRows<T>` with a device-callable `row()`; same arithmetic, int64 throughout.
template <class T>
struct DeviceRows {
  const T* base;
  std::int64_t row_stride;
  const std::int32_t* pages;  // device pointer, nullptr = contiguous
  std::int64_t page_stride;
  std::int64_t page_size;

  static DeviceRows from(const KeyRows<T>& k) noexcept {
    return DeviceRows{k.base, k.row_stride, k.pages, k.page_stride, static_cast<std::int64_t>(k.page_size)};
  }
  __device__ __forceinline__ const T* row(std::int64_t j) const {
    if (pages == nullptr) return base + j * row_stride;
    return base + static_cast<std::int64_t>(pages[j / page_size]) * page_stride + (j % page_size) * row_stride;
  }
};

/// Exact widening loads (every half / bfloat16 is a float).
__device__ __forceinline__ float load_f32(const float* p) { return *p; }
__device__ __forceinline__ float load_f32(const half* p) { return __half2float(__ushort_as_half(p->bits)); }
__device__ __forceinline__ float load_f32(const bfloat16* p) {
  return __uint_as_float(static_cast<unsigned int>(p->bits) << 16);
}

/// Device twin of `score_order_key` (ops/scalar.hpp): a monotone map of the
/// float to an unsigned key, NaN -> 0 (lowest), 0 never used by a number.
__device__ __forceinline__ std::uint32_t order_key(float f) {
  if (f != f) return 0u;
  const std::uint32_t u = __float_as_uint(f);
  const std::uint32_t k = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return k == 0u ? 1u : k;
}

}  // namespace cuda_detail
KVP_NAMESPACE_END
