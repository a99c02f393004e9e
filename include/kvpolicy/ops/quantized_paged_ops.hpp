// SPDX-License-Identifier: Apache-2.0
// The device path of the paged quantized pool
// (policy/quantization/quantized_paged.hpp) as ops. They exist so that the
// host never reads a device page id. On a device backend, the page ids
// (`seq_pages`, one sequence's slice of `table.indices`) and every array are
// device memory. Code rows are addressed by `ops::CodePageGeometry`.
//
//   code_rows_gather     the code rows of tokens [first, first + count) of a
//                        sequence, for each of geo.num_heads heads, copied to
//                        dst (num_heads, count, row_bytes), contiguous.
//   code_rows_scatter    the reverse: src (num_heads, count, row_bytes) is
//                        written at the tokens' slots of the pool.
//   code_page_meta_fold  Quest's page metadata from decoded rows
//                        (num_heads, count, head_dim) of tokens
//                        [first, first + count). Each page's run of rows is
//                        one backend::Scalar::page_meta_fold into the page's
//                        max / min rows. A run is fresh when it starts at
//                        slot 0 (Quest's on_append, run by run).
//   lse_merge_chunk      one chunk's normalised attention output po
//                        (group, d) and its log-sum-exp pl (group), folded
//                        into a running state: m (the largest chunk lse so
//                        far), sum (of exp(lse - m)) and out (the same
//                        weights times the chunks' outputs). `first` starts
//                        the state (m = -inf, sum = 0, out = 0) before the
//                        fold. Order of rules: a NaN state stays NaN; a NaN
//                        lse makes the head's output and sum NaN; a -inf
//                        lse (nothing attended in the chunk) is skipped.
//   lse_merge_finish     out /= sum (0 when sum is 0) and lse = m + log(sum)
//                        (-inf when sum is 0). With `empty` (no chunk was
//                        merged) out is 0 and lse is -inf, whatever the state
//                        holds.
//
// The references are the host loops, in their order. backend::Cuda
// (backends/cuda/src/quantized_paged.cu) copies the same bytes, folds the
// same metadata bits, and merges with the host's rounded products and sums.
// Its exp and log are CUDA's expf / logf, a few ulp from the host's.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kvpolicy/core/page_selection.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/ops/scalar.hpp"

KVP_NAMESPACE_BEGIN

namespace ops {

/// How code rows of one pool (keys or values) are addressed: byte strides, page size, the heads one op call
/// moves (a pool pointer already offset to a head and num_heads = 1 address one kv head), the row width.
struct CodePageGeometry {
  PageStrides strides{};
  std::int32_t page_size = 0;
  std::int32_t num_heads = 0;
  std::int64_t row_bytes = 0;

  /// Byte offset of token t's row for head h; seq_pages is the sequence's page list.
  KVP_HOST_DEVICE std::int64_t offset(const std::int32_t* seq_pages, std::int64_t t, std::int32_t h) const noexcept {
    return static_cast<std::int64_t>(seq_pages[t / page_size]) * strides.page + h * strides.head + (t % page_size) * strides.slot;
  }
};

namespace quantized_paged_ref {

inline void gather(const std::uint8_t* pool, const CodePageGeometry& geo, const std::int32_t* seq_pages, std::int64_t first,
                   std::int64_t count, std::uint8_t* dst) noexcept {
  const auto rb = static_cast<std::size_t>(geo.row_bytes);
  for (std::int32_t h = 0; h < geo.num_heads; ++h)
    for (std::int64_t i = 0; i < count; ++i)
      std::memcpy(dst + static_cast<std::size_t>(h * count + i) * rb, pool + geo.offset(seq_pages, first + i, h), rb);
}

inline void scatter(const std::uint8_t* src, const CodePageGeometry& geo, const std::int32_t* seq_pages, std::int64_t first,
                    std::int64_t count, std::uint8_t* pool) noexcept {
  const auto rb = static_cast<std::size_t>(geo.row_bytes);
  for (std::int32_t h = 0; h < geo.num_heads; ++h)
    for (std::int64_t i = 0; i < count; ++i)
      std::memcpy(pool + geo.offset(seq_pages, first + i, h), src + static_cast<std::size_t>(h * count + i) * rb, rb);
}

inline void meta_fold(const float* rows, std::int64_t head_dim, const CodePageGeometry& geo, const std::int32_t* seq_pages,
                      std::int64_t first, std::int64_t count, PageMetaView<float> meta) noexcept {
  const std::int32_t P = geo.page_size;
  for (std::int32_t h = 0; h < geo.num_heads; ++h)
    for (std::int64_t t = first; t < first + count;) {
      const auto slot = static_cast<std::int32_t>(t % P);
      const std::int64_t n = std::min<std::int64_t>(P - slot, first + count - t);
      const std::int32_t page = seq_pages[t / P];
      backend::Scalar::page_meta_fold(rows + (h * count + (t - first)) * head_dim, head_dim, n, head_dim, meta.max_row(page, h),
                                      meta.min_row(page, h), /*fresh=*/slot == 0);
      t += n;
    }
}

inline void merge(const float* po, const float* pl, std::int64_t group, std::int64_t d, bool first, float* out, float* m,
                  float* sum) noexcept {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  for (std::int64_t g = 0; g < group; ++g) {
    float* o = out + g * d;
    const float* op = po + g * d;
    if (first) {
      m[g] = kNegInf, sum[g] = 0.0f;
      for (std::int64_t c = 0; c < d; ++c) o[c] = 0.0f;
    }
    if (sum[g] != sum[g]) continue;  // NaN already: stays NaN
    if (pl[g] != pl[g]) {            // a NaN logit in the chunk
      sum[g] = kNaN;
      for (std::int64_t c = 0; c < d; ++c) o[c] = kNaN;
      continue;
    }
    if (pl[g] == kNegInf) continue;  // nothing attended in this chunk
    const float nm = pl[g] > m[g] ? pl[g] : m[g];
    const float a = std::exp(m[g] - nm), w = std::exp(pl[g] - nm);  // a = 0 on the first attended chunk
    sum[g] = sum[g] * a + w;
    for (std::int64_t c = 0; c < d; ++c) o[c] = o[c] * a + w * op[c];
    m[g] = nm;
  }
}

inline void finish(float* out, const float* m, const float* sum, std::int64_t group, std::int64_t d, bool empty, float* lse) noexcept {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (std::int64_t g = 0; g < group; ++g) {
    float* o = out + g * d;
    const bool none = empty || sum[g] == 0.0f;
    const float inv = none ? 0.0f : 1.0f / sum[g];
    for (std::int64_t c = 0; c < d; ++c) o[c] = empty ? 0.0f : o[c] * inv;
    if (lse != nullptr) lse[g] = none ? kNegInf : m[g] + std::log(sum[g]);
  }
}

}  // namespace quantized_paged_ref

/// Copies the code rows of tokens [first, first + count) to dst (num_heads, count, row_bytes) (file comment).
template <class B>
void code_rows_gather(const std::uint8_t* pool, const CodePageGeometry& geo, const std::int32_t* seq_pages, std::int64_t first,
                      std::int64_t count, std::uint8_t* dst) noexcept {
  if constexpr (requires { B::code_rows_gather(pool, geo, seq_pages, first, count, dst); })
    B::code_rows_gather(pool, geo, seq_pages, first, count, dst);
  else
    quantized_paged_ref::gather(pool, geo, seq_pages, first, count, dst);
}

/// Writes src (num_heads, count, row_bytes) at the slots of tokens [first, first + count) (file comment).
template <class B>
void code_rows_scatter(const std::uint8_t* src, const CodePageGeometry& geo, const std::int32_t* seq_pages, std::int64_t first,
                       std::int64_t count, std::uint8_t* pool) noexcept {
  if constexpr (requires { B::code_rows_scatter(src, geo, seq_pages, first, count, pool); })
    B::code_rows_scatter(src, geo, seq_pages, first, count, pool);
  else
    quantized_paged_ref::scatter(src, geo, seq_pages, first, count, pool);
}

/// Folds decoded rows (num_heads, count, head_dim) of tokens [first, first + count) into their pages'
/// metadata (file comment).
template <class B>
void code_page_meta_fold(const float* rows, std::int64_t head_dim, const CodePageGeometry& geo, const std::int32_t* seq_pages,
                         std::int64_t first, std::int64_t count, PageMetaView<float> meta) noexcept {
  if constexpr (requires { B::code_page_meta_fold(rows, head_dim, geo, seq_pages, first, count, meta); })
    B::code_page_meta_fold(rows, head_dim, geo, seq_pages, first, count, meta);
  else
    quantized_paged_ref::meta_fold(rows, head_dim, geo, seq_pages, first, count, meta);
}

/// Folds one chunk's output and lse into the running state (file comment).
template <class B>
void lse_merge_chunk(const float* po, const float* pl, std::int64_t group, std::int64_t d, bool first, float* out, float* m,
                     float* sum) noexcept {
  if constexpr (requires { B::lse_merge_chunk(po, pl, group, d, first, out, m, sum); })
    B::lse_merge_chunk(po, pl, group, d, first, out, m, sum);
  else
    quantized_paged_ref::merge(po, pl, group, d, first, out, m, sum);
}

/// Normalises the merged output and writes the lse (file comment).
template <class B>
void lse_merge_finish(float* out, const float* m, const float* sum, std::int64_t group, std::int64_t d, bool empty, float* lse) noexcept {
  if constexpr (requires { B::lse_merge_finish(out, m, sum, group, d, empty, lse); })
    B::lse_merge_finish(out, m, sum, group, d, empty, lse);
  else
    quantized_paged_ref::finish(out, m, sum, group, d, empty, lse);
}

}  // namespace ops

/// A backend with its own forms of every op above (backend::Cuda). A backend without them (the host ones,
/// the tests' emulated device) runs the references.
template <class B>
concept QuantizedPagedOps = requires(const std::uint8_t* cb, std::uint8_t* b, const ops::CodePageGeometry& geo, const std::int32_t* ids,
                                     std::int64_t n, const float* cx, float* x, PageMetaView<float> meta) {
  B::code_rows_gather(cb, geo, ids, n, n, b);
  B::code_rows_scatter(cb, geo, ids, n, n, b);
  B::code_page_meta_fold(cx, n, geo, ids, n, n, meta);
  B::lse_merge_chunk(cx, cx, n, n, true, x, x, x);
  B::lse_merge_finish(x, cx, cx, n, n, true, x);
};

KVP_NAMESPACE_END
