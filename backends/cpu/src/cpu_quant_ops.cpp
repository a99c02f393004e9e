// SPDX-License-Identifier: Apache-2.0
// Entry points of `backend::CpuQuantOps` (baseline flags): ISA dispatch to
// the kernels of quant_ops_<isa>.cpp.
#include "kvpolicy/backends/cpu_quant_ops.hpp"

#include <cstddef>
#include <cstring>
#include <type_traits>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "isa_dispatch.hpp"
#include "quant_kernels.hpp"

KVP_NAMESPACE_BEGIN
namespace backend {

namespace {

constexpr std::int64_t kStreamPiece = 4096;                      // values decoded per piece
constexpr std::int64_t kStreamMinBytes = std::int64_t{1} << 16;  // outputs below this keep normal stores

/// bytes from src to dst: normal stores up to dst's first 64-byte line and after its last whole line,
/// non-temporal 16-byte stores (SSE2, every x86-64) for the whole lines between, which reach memory without
/// the read for ownership a normal store makes. The caller fences (`_mm_sfence`) before it returns.
void stream_copy(void* dst, const void* src, std::int64_t bytes) noexcept {
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
#if defined(__SSE2__)
  std::int64_t head = static_cast<std::int64_t>((64 - (reinterpret_cast<std::uintptr_t>(d) & 63)) & 63);
  if (head > bytes) head = bytes;
  std::memcpy(d, s, static_cast<std::size_t>(head));
  d += head, s += head, bytes -= head;
  for (; bytes >= 64; bytes -= 64, d += 64, s += 64)
    for (int k = 0; k < 64; k += 16)
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + k), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + k)));
#endif
  std::memcpy(d, s, static_cast<std::size_t>(bytes));
}

void stream_fence() noexcept {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

/// Every 64-byte line of [p, p + bytes) into L2 (prefetcht1 through asm, which the compiler keeps).
void prefetch_range(const void* p, std::int64_t bytes) noexcept {
#if defined(__SSE2__)
  const auto* c = static_cast<const char*>(p);
  for (std::int64_t o = 0; o < bytes; o += 64) asm volatile("prefetcht1 %0" : : "m"(c[o]));
#else
  (void)p, (void)bytes;
#endif
}

/// The decoders (ggml blocks as rows of 32 values, token-wise INT4 rows, KIVI value rows):
/// `decode(r0, m, dst, dst_stride)` decodes rows [r0, r0 + m) and returns false for a shape its kernel does
/// not take. With streaming stores on, an output of
/// contiguous rows (y_stride == d) of at least kStreamMinBytes is decoded kStreamPiece / d rows at a time into
/// a stack buffer and streamed, `ahead(r0, m)` prefetching the inputs of the next piece; else one call.
/// False (the caller then runs the reference over every row) only where the kernel refuses the shape.
template <class T, class Decode, class Ahead>
bool decode_rows(std::int64_t rows, std::int64_t d, T* y, std::int64_t y_stride, Decode decode, Ahead ahead) noexcept {
  const std::int64_t bytes = rows * d * static_cast<std::int64_t>(sizeof(T));
  if (!cpu_detail::streaming_stores_active() || y_stride != d || d > kStreamPiece || bytes < kStreamMinBytes)
    return decode(std::int64_t{0}, rows, y, y_stride);
  alignas(64) std::byte piece[kStreamPiece * sizeof(float)];
  const std::int64_t per = kStreamPiece / d;
  for (std::int64_t r0 = 0; r0 < rows; r0 += per) {
    const std::int64_t m = rows - r0 < per ? rows - r0 : per;
    if (r0 + m < rows) ahead(r0 + m, rows - (r0 + m) < per ? rows - (r0 + m) : per);
    if (!decode(r0, m, reinterpret_cast<T*>(piece), d)) {
      stream_fence();
      return false;
    }
    stream_copy(y + r0 * d, piece, m * d * static_cast<std::int64_t>(sizeof(T)));
  }
  stream_fence();
  return true;
}

/// A ggml row of n values decodes as n / 32 rows of one block each (codes bb bytes apart, values 32 apart).
template <class T>
void dequantize_row_any(GgmlType t, const std::uint8_t* in, std::int64_t n, T* y) noexcept {
  const auto& k = cpu_detail::quant_kernels();
  const std::int64_t bb = ggml_block_bytes(t);
  decode_rows(
      n / kGgmlBlock, kGgmlBlock, y, kGgmlBlock,
      [&](std::int64_t r0, std::int64_t m, T* o, std::int64_t) {
        if constexpr (std::is_same_v<T, float>)
          k.dequantize_f32(t, in + r0 * bb, m * kGgmlBlock, o);
        else
          k.dequantize_f16(t, in + r0 * bb, m * kGgmlBlock, o);
        return true;
      },
      [&](std::int64_t r0, std::int64_t m) { prefetch_range(in + r0 * bb, m * bb); });
}

template <class T>
bool int4_decode(const std::uint8_t* in, std::int64_t rows, std::int64_t is, std::int64_t d, int bits, T* y, std::int64_t ys) noexcept {
  const auto& k = cpu_detail::quant_kernels();
  return decode_rows(
      rows, d, y, ys,
      [&](std::int64_t r0, std::int64_t m, T* o, std::int64_t os) {
        if constexpr (std::is_same_v<T, float>)
          return k.int4_dequantize_f32(in + r0 * is, m, is, d, bits, o, os);
        else
          return k.int4_dequantize_f16(in + r0 * is, m, is, d, bits, o, os);
      },
      [&](std::int64_t r0, std::int64_t m) { prefetch_range(in + r0 * is, m * is); });
}

template <class T>
bool kivi_values_decode(const std::uint8_t* codes, std::int64_t cs, const std::uint8_t* scales, std::int64_t ss, std::int64_t rows,
                        std::int64_t d, int group, int bits, T* y, std::int64_t ys) noexcept {
  const auto& k = cpu_detail::quant_kernels();
  return decode_rows(
      rows, d, y, ys,
      [&](std::int64_t r0, std::int64_t m, T* o, std::int64_t os) {
        if constexpr (std::is_same_v<T, float>)
          return k.kivi_dequantize_values_f32(codes + r0 * cs, cs, scales + r0 * ss, ss, m, d, group, bits, o, os);
        else
          return k.kivi_dequantize_values_f16(codes + r0 * cs, cs, scales + r0 * ss, ss, m, d, group, bits, o, os);
      },
      [&](std::int64_t r0, std::int64_t m) {
        prefetch_range(codes + r0 * cs, m * cs);
        prefetch_range(scales + r0 * ss, m * ss);
      });
}

}  // namespace

void CpuQuantOps::quantize_row_kernel(GgmlType t, const float* x, std::int64_t n, std::uint8_t* out) noexcept {
  cpu_detail::quant_kernels().quantize_f32(t, x, n, out);
}
void CpuQuantOps::quantize_row_kernel(GgmlType t, const half* x, std::int64_t n, std::uint8_t* out) noexcept {
  cpu_detail::quant_kernels().quantize_f16(t, x, n, out);
}
void CpuQuantOps::dequantize_row_kernel(GgmlType t, const std::uint8_t* in, std::int64_t n, float* y) noexcept {
  dequantize_row_any(t, in, n, y);
}
void CpuQuantOps::dequantize_row_kernel(GgmlType t, const std::uint8_t* in, std::int64_t n, half* y) noexcept {
  dequantize_row_any(t, in, n, y);
}
std::int64_t CpuQuantOps::first_nonfinite_kernel(const float* x, std::int64_t n) noexcept {
  return n <= 0 ? -1 : cpu_detail::quant_kernels().first_nonfinite_f32(x, n);
}
std::int64_t CpuQuantOps::first_nonfinite_kernel(const half* x, std::int64_t n) noexcept {
  return n <= 0 ? -1 : cpu_detail::quant_kernels().first_nonfinite_f16(x, n);
}

bool CpuQuantOps::rotate_in_kernel(const float* x, std::int64_t rows, std::int64_t xs, std::int64_t d, std::int64_t n, float* y) noexcept {
  return cpu_detail::quant_kernels().rotate_in_f32(x, rows, xs, d, n, y);
}
bool CpuQuantOps::rotate_in_kernel(const half* x, std::int64_t rows, std::int64_t xs, std::int64_t d, std::int64_t n, float* y) noexcept {
  return cpu_detail::quant_kernels().rotate_in_f16(x, rows, xs, d, n, y);
}
bool CpuQuantOps::rotate_out_kernel(float* y, std::int64_t rows, std::int64_t d, std::int64_t n, float* out, std::int64_t os) noexcept {
  return cpu_detail::quant_kernels().rotate_out_f32(y, rows, d, n, out, os);
}
bool CpuQuantOps::rotate_out_kernel(float* y, std::int64_t rows, std::int64_t d, std::int64_t n, half* out, std::int64_t os) noexcept {
  return cpu_detail::quant_kernels().rotate_out_f16(y, rows, d, n, out, os);
}
void CpuQuantOps::int4_quantize_rows(const float* x, std::int64_t rows, std::int64_t d, int bits, std::uint8_t* out,
                                     std::int64_t out_stride) noexcept {
  if (!cpu_detail::quant_kernels().int4_quantize(x, rows, d, bits, out, out_stride))
    ScalarQuantOps::int4_quantize_rows(x, rows, d, bits, out, out_stride);
}
bool CpuQuantOps::int4_dequantize_kernel(const std::uint8_t* in, std::int64_t rows, std::int64_t is, std::int64_t d, int bits, float* y,
                                         std::int64_t ys) noexcept {
  return int4_decode(in, rows, is, d, bits, y, ys);
}
bool CpuQuantOps::int4_dequantize_kernel(const std::uint8_t* in, std::int64_t rows, std::int64_t is, std::int64_t d, int bits, half* y,
                                         std::int64_t ys) noexcept {
  return int4_decode(in, rows, is, d, bits, y, ys);
}
bool CpuQuantOps::fp8_quantize_kernel(Fp8Format f, const float* x, std::int64_t rows, std::int64_t xs, std::int64_t d, float scale,
                                      std::uint8_t* out, std::int64_t os) noexcept {
  return cpu_detail::quant_kernels().fp8_quantize_f32(f, x, rows, xs, d, scale, out, os);
}
bool CpuQuantOps::fp8_quantize_kernel(Fp8Format f, const half* x, std::int64_t rows, std::int64_t xs, std::int64_t d, float scale,
                                      std::uint8_t* out, std::int64_t os) noexcept {
  return cpu_detail::quant_kernels().fp8_quantize_f16(f, x, rows, xs, d, scale, out, os);
}
bool CpuQuantOps::fp8_dequantize_kernel(Fp8Format f, const std::uint8_t* in, std::int64_t rows, std::int64_t is, std::int64_t d,
                                        float scale, float* y, std::int64_t ys) noexcept {
  return cpu_detail::quant_kernels().fp8_dequantize_f32(f, in, rows, is, d, scale, y, ys);
}
bool CpuQuantOps::fp8_dequantize_kernel(Fp8Format f, const std::uint8_t* in, std::int64_t rows, std::int64_t is, std::int64_t d,
                                        float scale, half* y, std::int64_t ys) noexcept {
  return cpu_detail::quant_kernels().fp8_dequantize_f16(f, in, rows, is, d, scale, y, ys);
}
bool CpuQuantOps::kivi_r16_kernel(const float* x, std::int64_t rows, std::int64_t xs, std::int64_t d, float* y) noexcept {
  return cpu_detail::quant_kernels().kivi_r16_f32(x, rows, xs, d, y);
}
bool CpuQuantOps::kivi_r16_kernel(const half* x, std::int64_t rows, std::int64_t xs, std::int64_t d, float* y) noexcept {
  return cpu_detail::quant_kernels().kivi_r16_f16(x, rows, xs, d, y);
}
std::int64_t CpuQuantOps::first_not_below(const float* x, std::int64_t n, float bound) noexcept {
  return n <= 0 ? -1 : cpu_detail::quant_kernels().first_not_below_f32(x, n, bound);
}
std::int64_t CpuQuantOps::first_not_below(const half* x, std::int64_t n, float bound) noexcept {
  return n <= 0 ? -1 : cpu_detail::quant_kernels().first_not_below_f16(x, n, bound);
}
void CpuQuantOps::kivi_quantize_keys(const float* x, std::int64_t d, int group, int bits, std::uint8_t* codes,
                                     std::uint8_t* scales) noexcept {
  if (!cpu_detail::quant_kernels().kivi_quantize_keys(x, d, group, bits, codes, scales))
    ScalarQuantOps::kivi_quantize_keys(x, d, group, bits, codes, scales);
}
bool CpuQuantOps::kivi_dequantize_keys_kernel(const std::uint8_t* codes, const std::uint8_t* scales, std::int64_t d, int group, int bits,
                                              float* y, std::int64_t ys) noexcept {
  return cpu_detail::quant_kernels().kivi_dequantize_keys_f32(codes, scales, d, group, bits, y, ys);
}
bool CpuQuantOps::kivi_dequantize_keys_kernel(const std::uint8_t* codes, const std::uint8_t* scales, std::int64_t d, int group, int bits,
                                              half* y, std::int64_t ys) noexcept {
  return cpu_detail::quant_kernels().kivi_dequantize_keys_f16(codes, scales, d, group, bits, y, ys);
}
void CpuQuantOps::kivi_quantize_value_rows(const float* x, std::int64_t rows, std::int64_t d, int group, int bits, std::uint8_t* codes,
                                           std::int64_t codes_stride, std::uint8_t* scales, std::int64_t scales_stride) noexcept {
  if (!cpu_detail::quant_kernels().kivi_quantize_values(x, rows, d, group, bits, codes, codes_stride, scales, scales_stride))
    ScalarQuantOps::kivi_quantize_value_rows(x, rows, d, group, bits, codes, codes_stride, scales, scales_stride);
}
bool CpuQuantOps::kivi_dequantize_values_kernel(const std::uint8_t* codes, std::int64_t cs, const std::uint8_t* scales, std::int64_t ss,
                                                std::int64_t rows, std::int64_t d, int group, int bits, float* y,
                                                std::int64_t ys) noexcept {
  return kivi_values_decode(codes, cs, scales, ss, rows, d, group, bits, y, ys);
}
bool CpuQuantOps::kivi_dequantize_values_kernel(const std::uint8_t* codes, std::int64_t cs, const std::uint8_t* scales, std::int64_t ss,
                                                std::int64_t rows, std::int64_t d, int group, int bits, half* y, std::int64_t ys) noexcept {
  return kivi_values_decode(codes, cs, scales, ss, rows, d, group, bits, y, ys);
}

}  // namespace backend
KVP_NAMESPACE_END
