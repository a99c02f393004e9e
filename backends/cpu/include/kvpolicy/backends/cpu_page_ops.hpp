// SPDX-License-Identifier: Apache-2.0
// `backend::CpuPageOps`: the page ops of the contract (Quest metadata fold,
// page upper bounds, paged decode attention), vectorised (SSE2 / AVX2 /
// AVX-512 chosen at run time, see cpu.hpp) and compiled into kvpolicy::cpu.
// Same signatures and semantics as `ScalarPageOps`; every op is re-declared
// here, so nothing of the scalar family is reached by accident.
//
// Agreement with the reference (what tests/quest pins):
//  * `page_meta_fold`: bit-identical (same comparisons `k > max`, `k < min`,
//    exact widening / narrowing of fp16 and bf16).
//  * `page_bounds`: each term is the same max(q*M, q*m); the sum runs in SIMD
//    lanes with fused multiply-adds, so |cpu - scalar| <= 1e-5 * sum_c |q_c|
//    max(|M_c|, |m_c|). Selections agree exactly wherever the k-th and
//    (k+1)-th bounds are further apart than that.
//  * `paged_decode_attention`: |cpu - scalar| <= 1e-5 relative (different
//    summation order, a polynomial exp accurate to ~1 ulp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvpolicy/ops/scalar.hpp"

KVP_NAMESPACE_BEGIN
namespace backend {

struct CpuPageOps : ScalarPageOps {
  /// See ScalarPageOps::page_meta_fold. SIMD over channels; defined for the
  /// five (key, metadata) type pairs `PageMetaStorableFrom` allows.
  /// O(num_rows * head_dim) loads, one store per channel.
  template <class Tk, class Tm>
    requires PageMetaStorableFrom<Tk, Tm>
  static void page_meta_fold(const Tk* rows, std::int64_t row_stride, std::int64_t num_rows, std::int64_t head_dim, Tm* max, Tm* min,
                             bool fresh) noexcept;

  /// Scratch of `page_bounds` for `num_q_rows` (= kv heads * group) query
  /// rows: three zero-padded copies of the queries (q, and q+ / q- interleaved
  /// per channel vector) and, per query row (rounded up to 16 rows), two
  /// accumulator vectors and 16 staged sums, 48 floats:
  /// O(num_q_rows * (3 * head_dim + 48)) floats, the same for every ISA.
  static std::size_t page_bounds_workspace(std::int64_t num_q_rows, std::int64_t head_dim) noexcept;

  /// See ScalarPageOps::page_bounds. Pages go in the order given, two at a
  /// time, each page's rows kv head after kv head: with the contiguous layout
  /// (all heads of a page in one block) that is address order. Each q vector
  /// is loaded once for both pages and each metadata vector once for the
  /// group's query heads; the rows of the page 8 ahead are prefetched into L2
  /// alongside (page ids are scattered; the hardware cannot guess them).
  /// A term costs two FMAs (q+ * M + q- * m, q+ = max(q, 0), q- = min(q, 0));
  /// that form differs from the reference only through 0 * inf, which makes
  /// the sum NaN, and a NaN sum is recomputed with the exact max(fma, fma)
  /// form, so non-finite metadata or queries give the reference's results. With a workspace
  /// smaller than `page_bounds_workspace` it computes with the reference.
  /// Defined for Tm in {float, half, bfloat16}.
  /// Speed (bench_quest, 128K tokens, fp16, 8 kv heads, one core, metadata
  /// from memory): ~20 GB/s on scattered page ids, ~80 % of what memory gives
  /// for random 4 KiB blocks read in that order; ~25 GB/s on page ids in
  /// order, ~65 % of a sequential read, where the FMAs (64 per page and kv
  /// head at group 4) and the reduction are the limit. An engine that can keep
  /// a sequence's metadata in page order (its own buffer indexed by logical
  /// page) reads it faster than through a scattered page table.
  template <class Tm>
  static void page_bounds(const float* q, std::int64_t group, std::int64_t head_dim, PageMetaView<const Tm> meta, const std::int32_t* pages,
                          std::int64_t n, float* out, std::int64_t ld_out, Workspace ws) noexcept;

  /// Workspace of `paged_decode_attention`: the block's keys and values widened
  /// to fp32, the block's logits for every head, row pointers.
  static std::size_t paged_attention_workspace(std::int64_t group, std::int64_t block, std::int64_t head_dim) noexcept;

  /// See ScalarPageOps::paged_decode_attention. One page (block) at a time:
  /// widen its K and V rows once, logits for every head of the group with
  /// SIMD dot products, a vectorised exp for the online softmax, and the
  /// value accumulation with the output rows held in registers. With a
  /// workspace smaller than `paged_attention_workspace` it computes with the
  /// reference instead. Vectorised for Tk == Tv in {float, half, bfloat16};
  /// mixed K / V types use the reference.
  template <class Tk, class Tv>
  static void paged_decode_attention(const float* q, std::int64_t group, std::int64_t head_dim, Rows<Tk> keys, Rows<Tv> values,
                                     std::int64_t num_tokens, float scale, float* out, float* lse, Workspace ws) noexcept {
    ScalarPageOps::paged_decode_attention(q, group, head_dim, keys, values, num_tokens, scale, out, lse, ws);
  }
};

// Explicit specialisations, defined in the library (src/paged_ops.cpp).
template <>
void CpuPageOps::page_meta_fold<float, float>(const float*, std::int64_t, std::int64_t, std::int64_t, float*, float*, bool) noexcept;
template <>
void CpuPageOps::page_meta_fold<half, half>(const half*, std::int64_t, std::int64_t, std::int64_t, half*, half*, bool) noexcept;
template <>
void CpuPageOps::page_meta_fold<half, float>(const half*, std::int64_t, std::int64_t, std::int64_t, float*, float*, bool) noexcept;
template <>
void CpuPageOps::page_meta_fold<bfloat16, bfloat16>(const bfloat16*, std::int64_t, std::int64_t, std::int64_t, bfloat16*, bfloat16*,
                                                    bool) noexcept;
template <>
void CpuPageOps::page_meta_fold<bfloat16, float>(const bfloat16*, std::int64_t, std::int64_t, std::int64_t, float*, float*, bool) noexcept;

template <>
void CpuPageOps::page_bounds<float>(const float*, std::int64_t, std::int64_t, PageMetaView<const float>, const std::int32_t*, std::int64_t,
                                    float*, std::int64_t, Workspace) noexcept;
template <>
void CpuPageOps::page_bounds<half>(const float*, std::int64_t, std::int64_t, PageMetaView<const half>, const std::int32_t*, std::int64_t,
                                   float*, std::int64_t, Workspace) noexcept;
template <>
void CpuPageOps::page_bounds<bfloat16>(const float*, std::int64_t, std::int64_t, PageMetaView<const bfloat16>, const std::int32_t*,
                                       std::int64_t, float*, std::int64_t, Workspace) noexcept;

template <>
void CpuPageOps::paged_decode_attention<float, float>(const float*, std::int64_t, std::int64_t, Rows<float>, Rows<float>, std::int64_t,
                                                      float, float*, float*, Workspace) noexcept;
template <>
void CpuPageOps::paged_decode_attention<half, half>(const float*, std::int64_t, std::int64_t, Rows<half>, Rows<half>, std::int64_t, float,
                                                    float*, float*, Workspace) noexcept;
template <>
void CpuPageOps::paged_decode_attention<bfloat16, bfloat16>(const float*, std::int64_t, std::int64_t, Rows<bfloat16>, Rows<bfloat16>,
                                                            std::int64_t, float, float*, float*, Workspace) noexcept;

}  // namespace backend
KVP_NAMESPACE_END
