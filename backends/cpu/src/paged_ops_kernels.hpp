// SPDX-License-Identifier: Apache-2.0
// Kernel table of the page ops (internal): what each per-ISA unit
// (paged_ops_<isa>.cpp) provides to the entry points in paged_ops.cpp.
// Layout and rules: see isa_dispatch.hpp.
#pragma once

#include <cstddef>
#include <cstdint>

#include "isa_dispatch.hpp"
#include "kvpolicy/ops/scalar.hpp"

KVP_NAMESPACE_BEGIN
namespace cpu_detail {

/// Scratch of one `paged_decode_attention` call, carved from the caller's
/// workspace in this order (64-byte aligned blocks).
struct AttnScratch {
  float* kbuf = nullptr;          // (block, head_dim): the block's keys widened to fp32
  float* vbuf = nullptr;          // (block, head_dim): its values widened
  float* logits = nullptr;        // (group, block): scaled logits, then exp(logit - running max)
  const float** krows = nullptr;  // (block): fp32 key row pointers (into kbuf, or the cache for fp32)
  const float** vrows = nullptr;  // (block): fp32 value row pointers
  float* run_max = nullptr;       // (group)
  float* run_sum = nullptr;       // (group)
  float* zero_row = nullptr;      // (head_dim): zeros, for the unused rows of a logit tile

  /// fn(pointer_member, count) for every array, in carving order: the one
  /// definition behind both the size report and the carve.
  template <class Fn>
  static void visit(std::int64_t group, std::int64_t block, std::int64_t head_dim, AttnScratch& s, Fn&& fn) noexcept {
    const auto rows = static_cast<std::size_t>(block * head_dim);
    fn(s.kbuf, rows);
    fn(s.vbuf, rows);
    fn(s.logits, static_cast<std::size_t>(group * block));
    fn(s.krows, static_cast<std::size_t>(block));
    fn(s.vrows, static_cast<std::size_t>(block));
    fn(s.run_max, static_cast<std::size_t>(group));
    fn(s.run_sum, static_cast<std::size_t>(group));
    fn(s.zero_row, static_cast<std::size_t>(head_dim));
  }
};

/// Scratch floats of the bounds kernels, the same for every level: a chunk of
/// 16 pages (the widest vector) of max + min rows padded to 16 floats, and
/// three padded copies (q, q+, q-) of the `rows` query rows.
/// Query rows rounded up to whole reductions of 16 vectors (the widest level's lanes).
inline std::int64_t bounds_rows_pad(std::int64_t rows) noexcept { return (rows + 15) / 16 * 16; }
/// Pages the bounds kernels score at once (each q vector loaded once for them).
inline constexpr std::int64_t kBoundsPages = 2;  // 4 measured slower (accumulators spill)
/// Scratch of the bounds kernels: q, q+ and q- zero padded to whole vectors
/// (3 rows dpad), two accumulator vectors per padded row and the sums of 16
/// pages (16 floats per vector at the widest level).
inline std::size_t bounds_scratch_floats(std::int64_t rows, std::int64_t head_dim) noexcept {
  const std::int64_t dpad = (head_dim + 15) / 16 * 16, rpad = bounds_rows_pad(rows);
  return static_cast<std::size_t>(3 * rows * dpad + kBoundsPages * rpad * 16 + 16 * rpad);
}

/// Page-op kernels of one ISA level. Arguments as the `CpuPageOps` ops; the
/// fold kernels take the `fresh` flag as an int.
struct PagedKernels {
  void (*fold_f32_f32)(const float*, std::int64_t, std::int64_t, std::int64_t, float*, float*, int) noexcept;
  void (*fold_f16_f16)(const half*, std::int64_t, std::int64_t, std::int64_t, half*, half*, int) noexcept;
  void (*fold_f16_f32)(const half*, std::int64_t, std::int64_t, std::int64_t, float*, float*, int) noexcept;
  void (*fold_bf16_bf16)(const bfloat16*, std::int64_t, std::int64_t, std::int64_t, bfloat16*, bfloat16*, int) noexcept;
  void (*fold_bf16_f32)(const bfloat16*, std::int64_t, std::int64_t, std::int64_t, float*, float*, int) noexcept;

  /// The last argument of the bounds kernels is their scratch: bounds_scratch_floats(kv_heads * group, head_dim) floats.
  void (*bounds_f32)(const float*, std::int64_t, std::int64_t, PageMetaView<const float>, const std::int32_t*, std::int64_t, float*,
                     std::int64_t, float*) noexcept;
  void (*bounds_f16)(const float*, std::int64_t, std::int64_t, PageMetaView<const half>, const std::int32_t*, std::int64_t, float*,
                     std::int64_t, float*) noexcept;
  void (*bounds_bf16)(const float*, std::int64_t, std::int64_t, PageMetaView<const bfloat16>, const std::int32_t*, std::int64_t, float*,
                      std::int64_t, float*) noexcept;

  void (*attn_f32)(const float*, std::int64_t, std::int64_t, Rows<float>, Rows<float>, std::int64_t, float, float*, float*,
                   const AttnScratch&) noexcept;
  void (*attn_f16)(const float*, std::int64_t, std::int64_t, Rows<half>, Rows<half>, std::int64_t, float, float*, float*,
                   const AttnScratch&) noexcept;
  void (*attn_bf16)(const float*, std::int64_t, std::int64_t, Rows<bfloat16>, Rows<bfloat16>, std::int64_t, float, float*, float*,
                    const AttnScratch&) noexcept;
};

KVP_CPU_DECLARE_KERNELS(PagedKernels, paged_kernels)

}  // namespace cpu_detail
KVP_NAMESPACE_END
