// SPDX-License-Identifier: Apache-2.0
// Entry points of `backend::CpuPageOps` (baseline flags): ISA dispatch and
// workspace carving around the per-ISA kernels of paged_ops_<isa>.cpp.
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvpolicy/backends/cpu_page_ops.hpp"
#include "paged_ops_kernels.hpp"

KVP_NAMESPACE_BEGIN
namespace backend {
namespace {

using cpu_detail::AttnScratch;
using cpu_detail::PagedKernels;

template <class T>
using Elem = std::remove_pointer_t<std::remove_reference_t<T>>;

std::size_t attn_bytes(std::int64_t group, std::int64_t block, std::int64_t head_dim) noexcept {
  AttnScratch s;
  WorkspacePlan plan;
  AttnScratch::visit(group, block, head_dim, s, [&](auto*& p, std::size_t n) { plan.add<Elem<decltype(p)>>(n); });
  return plan.total();
}

template <class T, class Kernel>
void run_attention(const float* q, std::int64_t group, std::int64_t head_dim, Rows<T> keys, Rows<T> values, std::int64_t n, float scale,
                   float* out, float* lse, Workspace ws, Kernel kernel) noexcept {
  const std::int64_t block = ScalarPageOps::attention_block(keys);
  if (ws.data == nullptr || ws.bytes < attn_bytes(group, block, head_dim)) {
    // Workspace sized for the reference op: compute with the reference, and count it.
    cpu_detail::note_reference_fallback();
    ScalarPageOps::paged_decode_attention(q, group, head_dim, keys, values, n, scale, out, lse, ws);
    return;
  }
  AttnScratch s;
  WorkspaceCarver carve(ws);
  AttnScratch::visit(group, block, head_dim, s, [&](auto*& p, std::size_t count) { p = carve.take<Elem<decltype(p)>>(count); });
  (cpu_detail::paged_kernels().*kernel)(q, group, head_dim, keys, values, n, scale, out, lse, s);
}

}  // namespace

// ---- metadata fold ----------------------------------------------------------------

template <>
void CpuPageOps::page_meta_fold<float, float>(const float* rows, std::int64_t stride, std::int64_t n, std::int64_t d, float* mx, float* mn,
                                              bool fresh) noexcept {
  cpu_detail::paged_kernels().fold_f32_f32(rows, stride, n, d, mx, mn, fresh ? 1 : 0);
}
template <>
void CpuPageOps::page_meta_fold<half, half>(const half* rows, std::int64_t stride, std::int64_t n, std::int64_t d, half* mx, half* mn,
                                            bool fresh) noexcept {
  cpu_detail::paged_kernels().fold_f16_f16(rows, stride, n, d, mx, mn, fresh ? 1 : 0);
}
template <>
void CpuPageOps::page_meta_fold<half, float>(const half* rows, std::int64_t stride, std::int64_t n, std::int64_t d, float* mx, float* mn,
                                             bool fresh) noexcept {
  cpu_detail::paged_kernels().fold_f16_f32(rows, stride, n, d, mx, mn, fresh ? 1 : 0);
}
template <>
void CpuPageOps::page_meta_fold<bfloat16, bfloat16>(const bfloat16* rows, std::int64_t stride, std::int64_t n, std::int64_t d, bfloat16* mx,
                                                    bfloat16* mn, bool fresh) noexcept {
  cpu_detail::paged_kernels().fold_bf16_bf16(rows, stride, n, d, mx, mn, fresh ? 1 : 0);
}
template <>
void CpuPageOps::page_meta_fold<bfloat16, float>(const bfloat16* rows, std::int64_t stride, std::int64_t n, std::int64_t d, float* mx,
                                                 float* mn, bool fresh) noexcept {
  cpu_detail::paged_kernels().fold_bf16_f32(rows, stride, n, d, mx, mn, fresh ? 1 : 0);
}

// ---- page bounds ------------------------------------------------------------------

std::size_t CpuPageOps::page_bounds_workspace(std::int64_t num_q_rows, std::int64_t head_dim) noexcept {
  return WorkspacePlan{}.add<float>(cpu_detail::bounds_scratch_floats(num_q_rows, head_dim)).total();
}

namespace {
template <class Tm, class Kernel>
void run_bounds(const float* q, std::int64_t group, std::int64_t d, PageMetaView<const Tm> meta, const std::int32_t* pages, std::int64_t n,
                float* out, std::int64_t ld, Workspace ws, Kernel kernel) noexcept {
  const std::int64_t rows = static_cast<std::int64_t>(meta.num_kv_heads) * group;
  if (ws.data == nullptr || ws.bytes < CpuPageOps::page_bounds_workspace(rows, d)) {
    cpu_detail::note_reference_fallback();  // workspace sized for the reference op
    ScalarPageOps::page_bounds(q, group, d, meta, pages, n, out, ld, ws);
    return;
  }
  float* scratch = WorkspaceCarver(ws).take<float>(cpu_detail::bounds_scratch_floats(rows, d));
  (cpu_detail::paged_kernels().*kernel)(q, group, d, meta, pages, n, out, ld, scratch);
}
}  // namespace

template <>
void CpuPageOps::page_bounds<float>(const float* q, std::int64_t group, std::int64_t d, PageMetaView<const float> meta,
                                    const std::int32_t* pages, std::int64_t n, float* out, std::int64_t ld, Workspace ws) noexcept {
  run_bounds(q, group, d, meta, pages, n, out, ld, ws, &PagedKernels::bounds_f32);
}
template <>
void CpuPageOps::page_bounds<half>(const float* q, std::int64_t group, std::int64_t d, PageMetaView<const half> meta,
                                   const std::int32_t* pages, std::int64_t n, float* out, std::int64_t ld, Workspace ws) noexcept {
  run_bounds(q, group, d, meta, pages, n, out, ld, ws, &PagedKernels::bounds_f16);
}
template <>
void CpuPageOps::page_bounds<bfloat16>(const float* q, std::int64_t group, std::int64_t d, PageMetaView<const bfloat16> meta,
                                       const std::int32_t* pages, std::int64_t n, float* out, std::int64_t ld, Workspace ws) noexcept {
  run_bounds(q, group, d, meta, pages, n, out, ld, ws, &PagedKernels::bounds_bf16);
}

// ---- paged decode attention -------------------------------------------------------

std::size_t CpuPageOps::paged_attention_workspace(std::int64_t group, std::int64_t block, std::int64_t head_dim) noexcept {
  return attn_bytes(group, block, head_dim);
}

template <>
void CpuPageOps::paged_decode_attention<float, float>(const float* q, std::int64_t group, std::int64_t d, Rows<float> keys,
                                                      Rows<float> values, std::int64_t n, float scale, float* out, float* lse,
                                                      Workspace ws) noexcept {
  run_attention(q, group, d, keys, values, n, scale, out, lse, ws, &PagedKernels::attn_f32);
}
template <>
void CpuPageOps::paged_decode_attention<half, half>(const float* q, std::int64_t group, std::int64_t d, Rows<half> keys, Rows<half> values,
                                                    std::int64_t n, float scale, float* out, float* lse, Workspace ws) noexcept {
  run_attention(q, group, d, keys, values, n, scale, out, lse, ws, &PagedKernels::attn_f16);
}
template <>
void CpuPageOps::paged_decode_attention<bfloat16, bfloat16>(const float* q, std::int64_t group, std::int64_t d, Rows<bfloat16> keys,
                                                            Rows<bfloat16> values, std::int64_t n, float scale, float* out, float* lse,
                                                            Workspace ws) noexcept {
  run_attention(q, group, d, keys, values, n, scale, out, lse, ws, &PagedKernels::attn_bf16);
}

}  // namespace backend
KVP_NAMESPACE_END
