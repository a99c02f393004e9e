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
