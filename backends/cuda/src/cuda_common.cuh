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

/// `to_half` (round to nearest even, overflow -> inf, NaN payload kept, quiet).
__device__ __forceinline__ unsigned short f32_to_half_bits(float f) {
  const unsigned x = __float_as_uint(f);
  const unsigned sign = (x >> 16) & 0x8000u;
  const unsigned ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return static_cast<unsigned short>(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u | ((ax >> 13) & 0x3ffu) : 0u));
  if (ax >= 0x477ff000u) return static_cast<unsigned short>(sign | 0x7c00u);
  if (ax < 0x38800000u) {
    if (ax < 0x33000000u) return static_cast<unsigned short>(sign);
    const unsigned e = ax >> 23;
    const unsigned m = (ax & 0x7fffffu) | 0x800000u;
    const unsigned shift = 126u - e;
    unsigned r = m >> shift;
    const unsigned rem = m & ((1u << shift) - 1u);
    const unsigned halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (r & 1u))) ++r;
    return static_cast<unsigned short>(sign | r);
  }
  unsigned r = ax - 0x38000000u;
  r = r + 0xfffu + ((r >> 13) & 1u);
  return static_cast<unsigned short>(sign | (r >> 13));
}

/// `to_bfloat16` (round to nearest even, NaN kept quiet).
__device__ __forceinline__ unsigned short f32_to_bf16_bits(float f) {
  const unsigned x = __float_as_uint(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((x >> 16) | 0x40u);
  const unsigned r = x + 0x7fffu + ((x >> 16) & 1u);
  return static_cast<unsigned short>(r >> 16);
}

/// `*p = from_float<T>(v)`.
__device__ __forceinline__ void store_exact(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_exact(half* p, float v) { p->bits = f32_to_half_bits(v); }
__device__ __forceinline__ void store_exact(bfloat16* p, float v) { p->bits = f32_to_bf16_bits(v); }

}  // namespace cuda_detail
KVP_NAMESPACE_END
