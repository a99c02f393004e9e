// SPDX-License-Identifier: Apache-2.0
// `Cuda::encode_token_rows` / `decode_token_rows`: whole (token, kv head)
// rows of a ggml block format or token-wise INT4 / INT8 behind an optional
// block-diagonal Hadamard rotation (quant/token_rows.hpp), for GgmlQuant and
// Int4Quant on backend::Cuda; bit-identical to `ScalarQuantOps`.
//
// Exactness: the ggml blocks are quant/ggml_blocks.inl compiled here with
// device `mul` (__fmul_rn), `put_half` (round to nearest even) and
// `get_half`; the INT rows call quant/int4.hpp's host-device helpers; the
// rotation runs the reference's butterflies, stage by stage (the pairs of a
// stage are disjoint, so their order does not matter), then one product by
// hadamard_scale(n). This unit is compiled with -fmad=false: no product is
// fused into an add anywhere in it, as in the references.
//
// Kernels: unrotated ggml rows are independent 32-value blocks, one thread
// each; INT rows (a row-wide min / max) and rotated rows are staged in
// shared memory, one thread block per row (d <= 4096 floats).
#include <cub/block/block_reduce.cuh>

#include <cstdint>

#include "cuda_common.cuh"
#include "kvpolicy/backends/cuda.hpp"
#include "kvpolicy/quant/token_rows.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda_detail {
namespace {

#include "ggml_device.cuh"  // namespace ggml_dev: the ggml block algorithms, compiled for the device

constexpr int kThreads = 128;
constexpr std::int64_t kMaxGridX = 2147483647;

// ---- unrotated ggml rows: one thread per block ---------------------------------------------------

template <class T>
__global__ void __launch_bounds__(kThreads)
    ggml_encode_blocks(GgmlType t, const T* __restrict__ x, std::int64_t x_stride, std::int64_t blocks_per_row, std::int64_t items,
                       std::uint8_t* __restrict__ out, std::int64_t out_stride) {
  const std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (item >= items) return;
  const std::int64_t r = item / blocks_per_row, b = item % blocks_per_row;
  const T* xb = x + r * x_stride + b * kGgmlBlock;
  float blk[kGgmlBlock];
#pragma unroll
  for (int j = 0; j < kGgmlBlock; ++j) blk[j] = load_f32(xb + j);
  ggml_dev::quantize_block(t, blk, out + r * out_stride + b * ggml_block_bytes(t));
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    ggml_decode_blocks(GgmlType t, const std::uint8_t* __restrict__ in, std::int64_t in_stride, std::int64_t blocks_per_row,
                       std::int64_t items, T* __restrict__ y, std::int64_t y_stride) {
  const std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (item >= items) return;
  const std::int64_t r = item / blocks_per_row, b = item % blocks_per_row;
  float blk[kGgmlBlock];
  ggml_dev::dequantize_block(t, in + r * in_stride + b * ggml_block_bytes(t), blk);
  T* yb = y + r * y_stride + b * kGgmlBlock;
#pragma unroll
  for (int j = 0; j < kGgmlBlock; ++j) store_exact(yb + j, blk[j]);
}

// ---- staged rows: one thread block per row -------------------------------------------------------

/// sh[0, d) <- R sh with blocks of n, then the product by s; ends after a barrier.
__device__ void rotate_staged(float* sh, std::int64_t d, std::int64_t n, float s) {
  const std::int64_t half_n = n / 2;
  for (std::int64_t len = 1; len < n; len <<= 1) {
    for (std::int64_t p = threadIdx.x; p < d / 2; p += kThreads) {
      const std::int64_t q = p % half_n;
      const std::int64_t i = (p / half_n) * n + (q / len) * 2 * len + q % len;
      const float a = sh[i], c = sh[i + len];
      sh[i] = a + c;
      sh[i + len] = a - c;
    }
    __syncthreads();
  }
  for (std::int64_t j = threadIdx.x; j < d; j += kThreads) sh[j] = __fmul_rn(sh[j], s);
  __syncthreads();
}

struct MinOp {
  __device__ float operator()(float a, float b) const { return b < a ? b : a; }
};
struct MaxOp {
  __device__ float operator()(float a, float b) const { return b > a ? b : a; }
};

template <class T>
__global__ void __launch_bounds__(kThreads) encode_staged(TokenRowCodec c, float s, const T* __restrict__ x, std::int64_t x_stride,
                                                          std::int64_t d, std::uint8_t* __restrict__ out, std::int64_t out_stride) {
  using Reduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ float s_scale, s_zero;
  extern __shared__ float sh[];
  const T* xr = x + static_cast<std::int64_t>(blockIdx.x) * x_stride;
  std::uint8_t* o = out + static_cast<std::int64_t>(blockIdx.x) * out_stride;
  for (std::int64_t j = threadIdx.x; j < d; j += kThreads) sh[j] = load_f32(xr + j);
  __syncthreads();
  if (c.rotated()) rotate_staged(sh, d, c.rotation, s);
  if (c.kind == TokenRowCodec::Kind::kGgml) {
    const std::int32_t bb = ggml_block_bytes(c.ggml);
    for (std::int64_t b = threadIdx.x; b < d / kGgmlBlock; b += kThreads) ggml_dev::quantize_block(c.ggml, sh + b * kGgmlBlock, o + b * bb);
    return;
  }
  // INT: the row's min and max (exact in any order for finite values), then every code.
  float mn = sh[0], mx = sh[0];
  for (std::int64_t j = threadIdx.x; j < d; j += kThreads) mn = MinOp{}(mn, sh[j]), mx = MaxOp{}(mx, sh[j]);
  const float row_mn = Reduce(tmp).Reduce(mn, MinOp{});
  __syncthreads();  // tmp is reused
  const float row_mx = Reduce(tmp).Reduce(mx, MaxOp{});
  if (threadIdx.x == 0) {
    int4q::scale_zero(row_mn, row_mx, c.bits, &s_scale, &s_zero);
    const std::int64_t at = d * c.bits / 8;
    const unsigned su = __float_as_uint(s_scale), zu = __float_as_uint(s_zero);
    for (int b = 0; b < 4; ++b) {  // little endian, as memcpy on the host
      o[at + b] = static_cast<std::uint8_t>(su >> (8 * b));
      o[at + 4 + b] = static_cast<std::uint8_t>(zu >> (8 * b));
    }
  }
  __syncthreads();
  const float scale = s_scale, zero = s_zero;
  if (c.bits == 4) {
    const std::int64_t h = d / 2;
    for (std::int64_t i = threadIdx.x; i < h; i += kThreads)
      o[i] = static_cast<std::uint8_t>(int4q::code(sh[i], scale, zero, 4) | int4q::code(sh[i + h], scale, zero, 4) << 4);
  } else {
    for (std::int64_t i = threadIdx.x; i < d; i += kThreads) o[i] = int4q::code(sh[i], scale, zero, c.bits);
  }
}

__device__ __forceinline__ float load_le_f32(const std::uint8_t* p) {
  return __uint_as_float(static_cast<unsigned>(p[0]) | static_cast<unsigned>(p[1]) << 8 | static_cast<unsigned>(p[2]) << 16 |
                         static_cast<unsigned>(p[3]) << 24);
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    decode_staged(TokenRowCodec c, float s, const std::uint8_t* __restrict__ in, std::int64_t in_stride, std::int64_t d, T* __restrict__ y,
                  std::int64_t y_stride) {
  extern __shared__ float sh[];
  const std::uint8_t* i = in + static_cast<std::int64_t>(blockIdx.x) * in_stride;
  T* yr = y + static_cast<std::int64_t>(blockIdx.x) * y_stride;
  if (c.kind == TokenRowCodec::Kind::kGgml) {
    const std::int32_t bb = ggml_block_bytes(c.ggml);
    for (std::int64_t b = threadIdx.x; b < d / kGgmlBlock; b += kThreads)
      ggml_dev::dequantize_block(c.ggml, i + b * bb, sh + b * kGgmlBlock);
  } else {
    const std::int64_t at = d * c.bits / 8, h = d / 2;
    const float scale = load_le_f32(i + at), zero = load_le_f32(i + at + 4);
    for (std::int64_t k = threadIdx.x; k < d; k += kThreads) {
      const unsigned q = c.bits == 8 ? i[k] : (k < h ? i[k] & 15u : static_cast<unsigned>(i[k - h] >> 4));
      sh[k] = int4q::value(q, scale, zero);
    }
  }
  __syncthreads();
  if (c.rotated()) rotate_staged(sh, d, c.rotation, s);
  for (std::int64_t k = threadIdx.x; k < d; k += kThreads) store_exact(yr + k, sh[k]);
}

bool rows_ok(const char* who, const TokenRowCodec& c, const void* a, const void* b, std::int64_t rows, std::int64_t d) noexcept {
  if (rows < 0 || d < 0) {
    record_error(KVP_INVALID("%s: rows=%lld, d=%lld, must be >= 0", who, static_cast<long long>(rows), static_cast<long long>(d)));
    return false;
  }
  if (rows == 0 || d == 0) return false;  // nothing to do
  if (const char* why = c.unsupported(d)) {
    record_error(KVP_INVALID("%s: d=%lld: %s", who, static_cast<long long>(d), why));
    return false;
  }
  if (a == nullptr || b == nullptr) {
    record_error(KVP_INVALID("%s: input or output is null", who));
    return false;
  }
  return true;
}

/// Launches `rows` staged rows (one thread block each), or the block kernel's `rows * d / 32` items.
bool grid_ok(const char* who, std::int64_t blocks) noexcept {
  if (blocks > kMaxGridX) {
    record_error(Status::error(StatusCode::kUnsupported, "%s: %lld thread blocks, at most %lld per call", who,
                               static_cast<long long>(blocks), static_cast<long long>(kMaxGridX)));
    return false;
  }
  return true;
}

bool staged(const TokenRowCodec& c) noexcept { return c.rotated() || c.kind == TokenRowCodec::Kind::kInt; }

}  // namespace
}  // namespace cuda_detail

namespace backend {

template <class T>
void Cuda::encode_token_rows(const TokenRowCodec& c, const T* x, std::int64_t rows, std::int64_t x_stride, std::int64_t d,
                             std::uint8_t* out, std::int64_t out_stride) noexcept {
  using namespace cuda_detail;
  const char* who = "cuda encode_token_rows";
  if (!rows_ok(who, c, x, out, rows, d)) return;
  const cudaStream_t st = as_stream(current_stream());
  if (staged(c)) {
    if (!grid_ok(who, rows)) return;
    const float s = c.rotated() ? hadamard_scale(c.rotation) : 1.0f;
    encode_staged<T>
        <<<static_cast<unsigned>(rows), kThreads, static_cast<std::size_t>(d) * sizeof(float), st>>>(c, s, x, x_stride, d, out, out_stride);
  } else {
    const std::int64_t per_row = d / kGgmlBlock, items = rows * per_row, grid = (items + kThreads - 1) / kThreads;
    if (!grid_ok(who, grid)) return;
    ggml_encode_blocks<T><<<static_cast<unsigned>(grid), kThreads, 0, st>>>(c.ggml, x, x_stride, per_row, items, out, out_stride);
  }
  record_error(launch_status(who));
}

template <class T>
void Cuda::decode_token_rows(const TokenRowCodec& c, const std::uint8_t* in, std::int64_t rows, std::int64_t in_stride, std::int64_t d,
                             T* y, std::int64_t y_stride) noexcept {
  using namespace cuda_detail;
  const char* who = "cuda decode_token_rows";
  if (!rows_ok(who, c, in, y, rows, d)) return;
  const cudaStream_t st = as_stream(current_stream());
  if (staged(c)) {
    if (!grid_ok(who, rows)) return;
    const float s = c.rotated() ? hadamard_scale(c.rotation) : 1.0f;
    decode_staged<T>
        <<<static_cast<unsigned>(rows), kThreads, static_cast<std::size_t>(d) * sizeof(float), st>>>(c, s, in, in_stride, d, y, y_stride);
  } else {
    const std::int64_t per_row = d / kGgmlBlock, items = rows * per_row, grid = (items + kThreads - 1) / kThreads;
    if (!grid_ok(who, grid)) return;
    ggml_decode_blocks<T><<<static_cast<unsigned>(grid), kThreads, 0, st>>>(c.ggml, in, in_stride, per_row, items, y, y_stride);
  }
  record_error(launch_status(who));
}

#define KVP_CUDA_TOKEN_ROWS(T)                                                                                                      \
  template void Cuda::encode_token_rows<T>(const TokenRowCodec&, const T*, std::int64_t, std::int64_t, std::int64_t, std::uint8_t*, \
                                           std::int64_t) noexcept;                                                                  \
  template void Cuda::decode_token_rows<T>(const TokenRowCodec&, const std::uint8_t*, std::int64_t, std::int64_t, std::int64_t, T*, \
                                           std::int64_t) noexcept;
KVP_CUDA_TOKEN_ROWS(float)
KVP_CUDA_TOKEN_ROWS(half)
KVP_CUDA_TOKEN_ROWS(bfloat16)
#undef KVP_CUDA_TOKEN_ROWS

}  // namespace backend
KVP_NAMESPACE_END
