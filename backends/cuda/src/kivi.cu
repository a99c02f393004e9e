// SPDX-License-Identifier: Apache-2.0
// `Cuda::kivi_encode_tokens` / `kivi_decode_tokens` / `kivi_update_residual`:
// KIVI's codes, scales and residual window (quant/kivi.hpp) on device memory,
// for KiviQuant on backend::Cuda; bit-identical to `ScalarQuantOps`.
//
// Exactness: the kernels call quant/kivi.hpp's host-device functions (every
// fp16 operation rounded by the library's own integer conversion, the codes
// rounded half to even), so each group's arithmetic is the host's, step for
// step. This unit is compiled with -fmad=false.
//
// Kernels: key groups, one thread per channel of a group (its G <= 256
// values in registers / local memory); value rows, one thread block per
// token (the row staged in shared memory as fp16 values, then one thread per
// channel group for the scales and one per code word); decoding, one thread
// per (key group, channel) or (token, code word); the residual's update, one
// thread block per call (the overlapping move row by row, as the host's
// ascending memmove, then the new rows in parallel).
#include <cstdint>

#include "cuda_common.cuh"
#include "kvpolicy/backends/cuda.hpp"
#include "kvpolicy/quant/kivi.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda_detail {
namespace {

constexpr int kThreads = 128;
constexpr int kMaxKeyGroup = 256;  ///< a key group's values one thread holds
constexpr std::int64_t kMaxGridX = 2147483647;

/// Logical token i of the sequence (residual rows first, then x), channel c, as KIVI's fp16 value.
template <class T>
__device__ __forceinline__ float logical_value(const half* res, std::int64_t rs, std::int64_t res_len, const T* x, std::int64_t xs,
                                               std::int64_t i, std::int64_t c) {
  return i < res_len ? to_float(res[i * rs + c]) : kivi::r16(to_float(x[(i - res_len) * xs + c]));
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    kivi_encode_keys(kivi::Codec k, const half* __restrict__ res, std::int64_t rs, std::int64_t res_len, const T* __restrict__ x,
                     std::int64_t xs, std::int64_t d, std::uint8_t* __restrict__ codes, std::int64_t cs, std::uint8_t* __restrict__ scales,
                     std::int64_t ss) {
  const std::int64_t g = blockIdx.x;
  float v[kMaxKeyGroup];
  for (std::int64_t c = threadIdx.x; c < d; c += kThreads) {
    for (int t = 0; t < k.group; ++t) v[t] = logical_value(res, rs, res_len, x, xs, g * k.group + t, c);
    kivi::quantize_key_channel(v, d, c, k.group, k.bits, codes + g * cs, scales + g * ss);
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    kivi_encode_values(kivi::Codec k, const half* __restrict__ res, std::int64_t rs, std::int64_t res_len, const T* __restrict__ x,
                       std::int64_t xs, std::int64_t d, std::uint8_t* __restrict__ codes, std::int64_t cs,
                       std::uint8_t* __restrict__ scales, std::int64_t ss) {
  extern __shared__ float row[];
  const std::int64_t i = blockIdx.x;
  std::uint8_t* cr = codes + i * cs;
  std::uint8_t* sr = scales + i * ss;
  for (std::int64_t c = threadIdx.x; c < d; c += kThreads) row[c] = logical_value(res, rs, res_len, x, xs, i, c);
  __syncthreads();
  // kivi::quantize_value_row, split over threads: every group's scale and minimum, then every word.
  const std::int64_t groups = d / k.group;
  for (std::int64_t gi = threadIdx.x; gi < groups; gi += kThreads) {
    const kivi::GroupRange g = kivi::group_range(row + gi * k.group, k.group, k.bits);
    kivi::store_half(sr + 2 * gi, g.scale);
    kivi::store_half(sr + 2 * (groups + gi), g.mn);
  }
  __syncthreads();  // the words read the stored scales back, as the reference does
  for (std::int64_t w = threadIdx.x; w < d / kivi::per_word(k.bits); w += kThreads)
    kivi::store_word(cr + 4 * w, kivi::value_row_word(row, d, k.group, k.bits, sr, w));
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    kivi_decode(kivi::Codec k, const std::uint8_t* __restrict__ codes, std::int64_t cs, const std::uint8_t* __restrict__ scales,
                std::int64_t ss, std::int64_t per_row, std::int64_t items, std::int64_t d, T* __restrict__ y, std::int64_t ys) {
  const std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (item >= items) return;
  const std::int64_t r = item / per_row, j = item % per_row;  // keys: (group, channel); values: (token, word)
  if (k.keys)
    kivi::dequantize_key_channel(codes + r * cs, scales + r * ss, d, j, k.group, k.bits, y + r * k.group * ys + j, ys);
  else
    kivi::dequantize_value_word(codes + r * cs, scales + r * ss, d, k.group, k.bits, j, y + r * ys);
}

template <class T>
__global__ void __launch_bounds__(kThreads) kivi_residual(half* res, std::int64_t rs, std::int64_t res_len, std::int64_t nq,
                                                          const T* __restrict__ x, std::int64_t xs, std::int64_t n, std::int64_t d) {
  for (std::int64_t i = nq > 0 ? nq : res_len; i < res_len;
       ++i) {  // survivors to the front, ascending: row i - nq is read before it is written
    for (std::int64_t c = threadIdx.x; c < d; c += kThreads) res[(i - nq) * rs + c] = res[i * rs + c];
    __syncthreads();
  }
  const std::int64_t first = nq > res_len ? nq : res_len, rows = res_len + n - first;
  for (std::int64_t e = threadIdx.x; e < rows * d; e += kThreads) {
    const std::int64_t i = first + e / d, c = e % d;
    res[(i - nq) * rs + c] = to_half(to_float(x[(i - res_len) * xs + c]));
  }
}

bool codec_ok(const char* who, const kivi::Codec& k, std::int64_t count, std::int64_t d) noexcept {
  if (count < 0 || d <= 0 || d > 4096) {
    record_error(KVP_INVALID("%s: count=%lld, d=%lld; must be count >= 0 and 0 < d <= 4096", who, static_cast<long long>(count),
                             static_cast<long long>(d)));
    return false;
  }
  if (!kivi::bits_valid(k.bits) || k.group < 1 || d % kivi::per_word(k.bits) != 0 ||
      (k.keys ? (k.group % kivi::per_word(k.bits) != 0 || count % k.group != 0) : d % k.group != 0)) {
    record_error(KVP_INVALID("%s: bits %d, group %d, d %lld, count %lld is not a KIVI %s layout", who, k.bits, k.group,
                             static_cast<long long>(d), static_cast<long long>(count), k.keys ? "keys" : "values"));
    return false;
  }
  if (k.keys && k.group > kMaxKeyGroup) {
    record_error(Status::error(StatusCode::kUnsupported, "%s: keys group %d; the device kernel holds at most %d tokens per group", who,
                               k.group, kMaxKeyGroup));
    return false;
  }
  return true;
}

bool grid_ok(const char* who, std::int64_t blocks) noexcept {
  if (blocks <= kMaxGridX) return true;
  record_error(Status::error(StatusCode::kUnsupported, "%s: %lld thread blocks, at most %lld per call", who, static_cast<long long>(blocks),
                             static_cast<long long>(kMaxGridX)));
  return false;
}

}  // namespace
}  // namespace cuda_detail

namespace backend {

template <class T>
void Cuda::kivi_encode_tokens(const kivi::Codec& k, const half* res, std::int64_t res_stride, std::int64_t res_len, const T* x,
                              std::int64_t x_stride, std::int64_t count, std::int64_t d, std::uint8_t* codes, std::int64_t codes_stride,
                              std::uint8_t* scales, std::int64_t scales_stride) noexcept {
  using namespace cuda_detail;
  const char* who = "cuda kivi_encode_tokens";
  if (!codec_ok(who, k, count, d) || count == 0) return;
  if (res_len < 0 || codes == nullptr || scales == nullptr || (res_len > 0 && res == nullptr) || (count > res_len && x == nullptr)) {
    record_error(
        KVP_INVALID("%s: a needed pointer is null (codes, scales, the residual when res_len > 0, x when count > res_len) or "
                    "res_len < 0",
                    who));
    return;
  }
  const cudaStream_t st = as_stream(current_stream());
  const std::int64_t blocks = k.keys ? count / k.group : count;
  if (!grid_ok(who, blocks)) return;
  if (k.keys)
    kivi_encode_keys<T><<<static_cast<unsigned>(blocks), kThreads, 0, st>>>(k, res, res_stride, res_len, x, x_stride, d, codes,
                                                                            codes_stride, scales, scales_stride);
  else
    kivi_encode_values<T><<<static_cast<unsigned>(blocks), kThreads, static_cast<std::size_t>(d) * sizeof(float), st>>>(
        k, res, res_stride, res_len, x, x_stride, d, codes, codes_stride, scales, scales_stride);
  record_error(launch_status(who));
}

template <class T>
void Cuda::kivi_decode_tokens(const kivi::Codec& k, const std::uint8_t* codes, std::int64_t codes_stride, const std::uint8_t* scales,
                              std::int64_t scales_stride, std::int64_t count, std::int64_t d, T* y, std::int64_t y_stride) noexcept {
  using namespace cuda_detail;
  const char* who = "cuda kivi_decode_tokens";
  if (!codec_ok(who, k, count, d) || count == 0) return;
  if (codes == nullptr || scales == nullptr || y == nullptr) {
    record_error(KVP_INVALID("%s: codes, scales or y is null", who));
    return;
  }
  const std::int64_t rows = k.keys ? count / k.group : count, per_row = k.keys ? d : d / kivi::per_word(k.bits);
  const std::int64_t items = rows * per_row, grid = (items + kThreads - 1) / kThreads;
  if (!grid_ok(who, grid)) return;
  kivi_decode<T><<<static_cast<unsigned>(grid), kThreads, 0, as_stream(current_stream())>>>(k, codes, codes_stride, scales, scales_stride,
                                                                                            per_row, items, d, y, y_stride);
  record_error(launch_status(who));
}

template <class T>
void Cuda::kivi_update_residual(half* res, std::int64_t res_stride, std::int64_t res_len, std::int64_t nq, const T* x,
                                std::int64_t x_stride, std::int64_t n, std::int64_t d) noexcept {
  using namespace cuda_detail;
  const char* who = "cuda kivi_update_residual";
  if (res_len < 0 || nq < 0 || n < 0 || d <= 0 || nq > res_len + n) {
    record_error(KVP_INVALID("%s: res_len=%lld, nq=%lld, n=%lld, d=%lld; must be >= 0, d > 0 and nq <= res_len + n", who,
                             static_cast<long long>(res_len), static_cast<long long>(nq), static_cast<long long>(n),
                             static_cast<long long>(d)));
    return;
  }
  if (res_len + n - nq == 0) return;  // nothing stays in the residual
  if (res == nullptr || (n > 0 && x == nullptr)) {
    record_error(KVP_INVALID("%s: the residual or x is null", who));
    return;
  }
  kivi_residual<T><<<1, kThreads, 0, as_stream(current_stream())>>>(res, res_stride, res_len, nq, x, x_stride, n, d);
  record_error(launch_status(who));
}

#define KVP_CUDA_KIVI(T)                                                                                                              \
  template void Cuda::kivi_encode_tokens<T>(const kivi::Codec&, const half*, std::int64_t, std::int64_t, const T*, std::int64_t,      \
                                            std::int64_t, std::int64_t, std::uint8_t*, std::int64_t, std::uint8_t*,                   \
                                            std::int64_t) noexcept;                                                                   \
  template void Cuda::kivi_decode_tokens<T>(const kivi::Codec&, const std::uint8_t*, std::int64_t, const std::uint8_t*, std::int64_t, \
                                            std::int64_t, std::int64_t, T*, std::int64_t) noexcept;                                   \
  template void Cuda::kivi_update_residual<T>(half*, std::int64_t, std::int64_t, std::int64_t, const T*, std::int64_t, std::int64_t,  \
                                              std::int64_t) noexcept;
KVP_CUDA_KIVI(float)
KVP_CUDA_KIVI(half)
KVP_CUDA_KIVI(bfloat16)
#undef KVP_CUDA_KIVI

}  // namespace backend
KVP_NAMESPACE_END
