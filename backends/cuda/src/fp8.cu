// SPDX-License-Identifier: Apache-2.0
// `Cuda::fp8_quantize_rows` / `fp8_dequantize_rows`: the fp8 row codecs of
// `ScalarQuantOps` (ops/quant_scalar.hpp) on device memory, for `Fp8Quant`
// on backend::Cuda. One block per row. The codes come from quant/fp8.hpp's
// integer codec (`fp8_encode_bits` / `fp8_decode_bits`, tested equal to the
// host's reference codec on the CPU), the division and the product are
// round-to-nearest fp32 operations, and the narrowing stores are
// `from_float`'s: bit-identical to the host op, NaN codes included.
// A per_token_head row's scale is amax(|x|) / fp8_max (1 for a zero row; a
// NaN element is skipped by the max, as on the host), stored after the codes
// with 12 zero bytes.
#include <cub/block/block_reduce.cuh>

#include <cstdint>

#include "cuda_common.cuh"
#include "kvpolicy/backends/cuda.hpp"
#include "kvpolicy/quant/fp8.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda_detail {
namespace {

constexpr int kThreads = 128;
constexpr std::int64_t kMaxGridX = 2147483647;

struct AbsMax {
  __device__ float operator()(float a, float b) const { return a < b ? b : a; }  // a NaN b leaves a (no NaN reaches it)
};

template <class T>
__global__ void __launch_bounds__(kThreads) fp8_quantize_kernel(Fp8Format f, const T* __restrict__ x, std::int64_t x_stride, std::int64_t d,
                                                                float scale, std::uint8_t* __restrict__ out, std::int64_t out_stride) {
  using Reduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ float s_scale;
  const T* xr = x + static_cast<std::int64_t>(blockIdx.x) * x_stride;
  std::uint8_t* o = out + static_cast<std::int64_t>(blockIdx.x) * out_stride;
  float s = scale;
  if (s <= 0.0f) {  // the row's dynamic scale
    float amax = 0.0f;
    for (std::int64_t c = threadIdx.x; c < d; c += kThreads) amax = AbsMax{}(amax, fabsf(load_f32(xr + c)));
    const float m = Reduce(tmp).Reduce(amax, AbsMax{});
    if (threadIdx.x == 0) {
      const float rs = m > 0.0f ? __fdiv_rn(m, f == Fp8Format::kE4M3 ? 448.0f : 57344.0f) : 1.0f;  // fp8_max
      s_scale = rs;
      const unsigned u = __float_as_uint(rs);
      for (int b = 0; b < 4; ++b) o[d + b] = static_cast<std::uint8_t>(u >> (8 * b));  // little endian, as memcpy on the host
      for (int b = 4; b < 16; ++b) o[d + b] = 0;
    }
    __syncthreads();
    s = s_scale;
  }
  for (std::int64_t c = threadIdx.x; c < d; c += kThreads) o[c] = fp8_encode_bits(f, __fdiv_rn(load_f32(xr + c), s));
}

template <class T>
__global__ void __launch_bounds__(kThreads) fp8_dequantize_kernel(Fp8Format f, const std::uint8_t* __restrict__ in, std::int64_t in_stride,
                                                                  std::int64_t d, float scale, T* __restrict__ y, std::int64_t y_stride) {
  const std::uint8_t* i = in + static_cast<std::int64_t>(blockIdx.x) * in_stride;
  T* yr = y + static_cast<std::int64_t>(blockIdx.x) * y_stride;
  float s = scale;
  if (s <= 0.0f)
    s = __uint_as_float(static_cast<unsigned>(i[d]) | static_cast<unsigned>(i[d + 1]) << 8 | static_cast<unsigned>(i[d + 2]) << 16 |
                        static_cast<unsigned>(i[d + 3]) << 24);
  for (std::int64_t c = threadIdx.x; c < d; c += kThreads) store_exact(yr + c, __fmul_rn(fp8_decode_bits(f, i[c]), s));
}

bool rows_ok(const char* who, const void* a, const void* b, std::int64_t rows, std::int64_t d) noexcept {
  if (rows < 0 || d < 0) {
    record_error(KVP_INVALID("%s: rows=%lld, d=%lld, must be >= 0", who, static_cast<long long>(rows), static_cast<long long>(d)));
    return false;
  }
  if (rows == 0 || d == 0) return false;  // nothing to do (a per_token_head trailer of an empty row is not written either)
  if (a == nullptr || b == nullptr) {
    record_error(KVP_INVALID("%s: input or output is null", who));
    return false;
  }
  if (rows > kMaxGridX) {
    record_error(Status::error(StatusCode::kUnsupported, "%s: %lld rows, at most %lld per call", who, static_cast<long long>(rows),
                               static_cast<long long>(kMaxGridX)));
    return false;
  }
  return true;
}

}  // namespace
}  // namespace cuda_detail

namespace backend {

template <class T>
void Cuda::fp8_quantize_rows(Fp8Format f, const T* x, std::int64_t rows, std::int64_t x_stride, std::int64_t d, float scale,
                             std::uint8_t* out, std::int64_t out_stride) noexcept {
  using namespace cuda_detail;
  if (!rows_ok("cuda fp8_quantize_rows", x, out, rows, d)) return;
  fp8_quantize_kernel<T>
      <<<static_cast<unsigned>(rows), kThreads, 0, as_stream(current_stream())>>>(f, x, x_stride, d, scale, out, out_stride);
  record_error(launch_status("cuda fp8_quantize_rows"));
}

template <class T>
void Cuda::fp8_dequantize_rows(Fp8Format f, const std::uint8_t* in, std::int64_t rows, std::int64_t in_stride, std::int64_t d, float scale,
                               T* y, std::int64_t y_stride) noexcept {
  using namespace cuda_detail;
  if (!rows_ok("cuda fp8_dequantize_rows", in, y, rows, d)) return;
  fp8_dequantize_kernel<T>
      <<<static_cast<unsigned>(rows), kThreads, 0, as_stream(current_stream())>>>(f, in, in_stride, d, scale, y, y_stride);
  record_error(launch_status("cuda fp8_dequantize_rows"));
}

#define KVP_CUDA_FP8_ROWS(T)                                                                                                      \
  template void Cuda::fp8_quantize_rows<T>(Fp8Format, const T*, std::int64_t, std::int64_t, std::int64_t, float, std::uint8_t*,   \
                                           std::int64_t) noexcept;                                                                \
  template void Cuda::fp8_dequantize_rows<T>(Fp8Format, const std::uint8_t*, std::int64_t, std::int64_t, std::int64_t, float, T*, \
                                             std::int64_t) noexcept;
KVP_CUDA_FP8_ROWS(float)
KVP_CUDA_FP8_ROWS(half)
KVP_CUDA_FP8_ROWS(bfloat16)
#undef KVP_CUDA_FP8_ROWS

}  // namespace backend
KVP_NAMESPACE_END
