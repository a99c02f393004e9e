// SPDX-License-Identifier: Apache-2.0
// Page ops of the contract, scalar reference (`ScalarPageOps`, part of
// `backend::Scalar`): Quest page metadata (channel max / min of the keys of a
// page), the per-page upper bound of q.k, and decode attention of one query
// group over a list of pages.
//
// Like every op family these work on one kv head, assume validated inputs
// and are `noexcept`; the policy (policy/selection/quest.hpp) and the
// evaluation helpers (eval/page_metrics.hpp) validate and split the work.
// Arithmetic is fp32; keys, values and metadata are read in their storage
// type (float, half, bfloat16) and converted on the fly.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/rows.hpp"
#include "kvpolicy/core/page_selection.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/workspace.hpp"

KVP_NAMESPACE_BEGIN

/// Metadata may be stored in the key type or in float (both exact; see
/// PageMetaView for why a narrower type is not offered).
template <class Tk, class Tm>
concept PageMetaStorableFrom = KVElement<Tk> && KVElement<Tm> &&
    (std::is_same_v<std::remove_cv_t<Tm>, std::remove_cv_t<Tk>> || std::is_same_v<std::remove_cv_t<Tm>, float>);

namespace backend {

struct ScalarPageOps {
  // ---- metadata -----------------------------------------------------------

  /// Folds `num_rows` key rows (`rows + r*row_stride`, `head_dim` contiguous
  /// values each) into one page's metadata rows `max`, `min`. With `fresh`
  /// the fold starts from the empty state (max = -inf, min = +inf) instead of
  /// the stored values: the caller passes `fresh` exactly when the first row
  /// is slot 0 of the page, so an append that resumes a partially filled page
  /// extends its metadata and a page being (re)started forgets stale values.
  ///
  /// Comparisons are `k > max` / `k < min`, so a NaN key component leaves the
  /// metadata unchanged (NaN keys poison attention anyway; the bound stays
  /// that of the finite keys). Exact: the result is the min / max of values
  /// representable in Tm. Cost O(num_rows * head_dim).
  template <class Tk, class Tm>
    requires PageMetaStorableFrom<Tk, Tm>
  static void page_meta_fold(const Tk* rows, std::int64_t row_stride, std::int64_t num_rows, std::int64_t head_dim, Tm* max, Tm* min,
                             bool fresh) noexcept {
    constexpr float kInf = std::numeric_limits<float>::infinity();
    for (std::int64_t c = 0; c < head_dim; ++c) {
      float hi = fresh ? -kInf : to_float(max[c]);
      float lo = fresh ? kInf : to_float(min[c]);
      for (std::int64_t r = 0; r < num_rows; ++r) {
        const float v = to_float(rows[r * row_stride + c]);
        hi = v > hi ? v : hi;
        lo = v < lo ? v : lo;
      }
      max[c] = from_float<Tm>(hi);
      min[c] = from_float<Tm>(lo);
    }
  }

  /// Tokens [t0, t1) of one sequence folded into its pages' metadata for every
  /// kv head: `pages` is the sequence's page list (logical page i is pool page
  /// pages[i]), keys at `k_data + page * strides.page + head * strides.head +
  /// slot * strides.slot`; each page run is one `page_meta_fold`, fresh when it
  /// starts at slot 0 (Quest's `on_append`, as one op so a device backend
  /// reads the page ids on the device). 0 <= t0 <= t1.
  template <class Tk, class Tm>
    requires PageMetaStorableFrom<Tk, Tm>
  static void page_meta_append(const Tk* k_data, const PageStrides& strides, std::int32_t page_size, std::int32_t num_kv_heads,
                               std::int64_t head_dim, const std::int32_t* pages, std::int64_t t0, std::int64_t t1,
                               PageMetaView<Tm> meta) noexcept {
    for (std::int32_t h = 0; h < num_kv_heads; ++h) {
      for (std::int64_t t = t0; t < t1;) {
        const auto slot = static_cast<std::int32_t>(t % page_size);
        const std::int64_t rows = std::min<std::int64_t>(page_size - slot, t1 - t);
        const std::int32_t page = pages[t / page_size];
        page_meta_fold(k_data + page * strides.page + h * strides.head + slot * strides.slot, strides.slot, rows, head_dim,
                       meta.max_row(page, h), meta.min_row(page, h), /*fresh=*/slot == 0);
        t += rows;
      }
    }
  }

  // ---- upper-bound estimate ----------------------------------------------

  /// Scratch of `page_bounds` for `num_q_rows` (= kv heads * group) query
  /// rows of `head_dim` (none for the reference).
  static std::size_t page_bounds_workspace(std::int64_t num_q_rows, std::int64_t head_dim) noexcept {
    (void)num_q_rows;
    (void)head_dim;
    return 0;
  }

  /// Quest's criticality estimate for every query head of `meta.num_kv_heads`
  /// kv heads, `group` query heads each:
  ///
  ///     out[(g*group + j)*ld_out + i] = sum_c max(q[g*group + j][c] * M[c], q[g*group + j][c] * m[c])
  ///
  /// with M / m the max / min rows of kv head g of page `pages[i]` (page i when
  /// `pages` is null), i < n. Since m[c] <= k[c] <= M[c] for every key of the
  /// page, `out >= q.k` for all of them (up to fp32 rounding of the sum,
  /// relative 2^-24 * head_dim * sum_c |q_c| max(|M_c|, |m_c|)). Unscaled (no
  /// 1/sqrt(d)): a ranking score, not a logit. q is fp32 `(num_kv_heads*group,
  /// head_dim)` contiguous; `meta.head_view(g)` restricts the work to one kv
  /// head. Every metadata row is read once for the whole group, and all kv
  /// heads of a page are handled together (a page's metadata is usually one
  /// contiguous block, so this is what keeps scattered page ids cheap).
  /// O(n * num_kv_heads * group * head_dim). Workspace: `page_bounds_workspace`.
  template <class Tm>
  static void page_bounds(const float* q, std::int64_t group, std::int64_t head_dim, PageMetaView<const Tm> meta, const std::int32_t* pages,
                          std::int64_t n, float* out, std::int64_t ld_out, Workspace ws) noexcept {
    (void)ws;
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int32_t p = pages ? pages[i] : static_cast<std::int32_t>(i);
      for (std::int32_t g = 0; g < meta.num_kv_heads; ++g) {
        const Tm* hi = meta.max_row(p, g);
        const Tm* lo = meta.min_row(p, g);
        for (std::int64_t j = 0; j < group; ++j) {
          const std::int64_t row = g * group + j;
          const float* qr = q + row * head_dim;
          float acc = 0.0f;
          for (std::int64_t c = 0; c < head_dim; ++c) {
            const float a = qr[c] * to_float(hi[c]);
            const float b = qr[c] * to_float(lo[c]);
            acc += a > b ? a : b;
          }
          out[row * ld_out + i] = acc;
        }
      }
    }
  }

  // ---- decode attention over pages ---------------------------------------

  /// Block length of `paged_decode_attention`: the page size for paged rows,
  /// 64 rows for a contiguous run.
  template <class T>
  static std::int64_t attention_block(const Rows<T>& keys) noexcept {
    return keys.pages != nullptr ? keys.page_size : 64;
  }

  /// Workspace of `paged_decode_attention` for `group` heads, blocks of
  /// `block` rows (`attention_block(keys)`) and `head_dim` (unused by the
  /// reference; backends may stage widened rows).
  static std::size_t paged_attention_workspace(std::int64_t group, std::int64_t block, std::int64_t head_dim) noexcept {
    (void)head_dim;
    return WorkspacePlan{}.add<float>(static_cast<std::size_t>(group * block)).total();
  }

  /// Exact softmax attention of `group` decode queries (fp32 `(group,
  /// head_dim)` contiguous) over the first `num_tokens` rows of `keys` /
  /// `values`, which are read in place. For a page selection, `keys.pages` /
  /// `values.pages` point at the row's page list (the same list for both) and
  /// `num_tokens = (pages - 1) * page_size + last_page_len`.
  ///
  ///     out[g][:] = sum_t softmax_t(scale * q_g.k_t) v_t,   lse[g] = ln sum_t exp(scale * q_g.k_t)
  ///
  /// Online softmax in fp32, one block (a page) at a time: rescale the running
  /// sums by exp(m_old - m_new) when the block raises the running max. With
  /// num_tokens == 0, or every logit -inf, the output is 0 and lse is -inf
  /// (nothing attended). NaN propagates: a NaN logit (NaN in the query or a
  /// key, or inf * 0) makes that head's output and lse NaN, and a NaN value
  /// row makes its output NaN; a NaN is never mistaken for "nothing
  /// attended". `lse` may be null; it
  /// is what lets a caller merge partial attentions or compute the attention
  /// mass of a selection, exp(lse_sel - lse_full).
  /// Workspace: `paged_attention_workspace(group, attention_block(keys), head_dim)`.
  template <class Tk, class Tv>
  static void paged_decode_attention(const float* q, std::int64_t group, std::int64_t head_dim, Rows<Tk> keys, Rows<Tv> values,
                                     std::int64_t num_tokens, float scale, float* out, float* lse, Workspace ws) noexcept {
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
    const std::int64_t block = attention_block(keys);
    WorkspaceCarver carve(ws);
    float* s = carve.take<float>(static_cast<std::size_t>(group * block));
    for (std::int64_t g = 0; g < group; ++g) {
      float* o = out + g * head_dim;
      for (std::int64_t c = 0; c < head_dim; ++c) o[c] = 0.0f;
    }
    // Running max / denominator per head on the stack: heads go in chunks of 16.
    constexpr std::int64_t kHeads = 16;
    for (std::int64_t g0 = 0; g0 < group; g0 += kHeads) {
      const std::int64_t gn = group - g0 < kHeads ? group - g0 : kHeads;
      float run_max[kHeads], run_sum[kHeads];
      for (std::int64_t g = 0; g < gn; ++g) {
        run_max[g] = kNegInf;
        run_sum[g] = 0.0f;
      }
      for (std::int64_t j0 = 0; j0 < num_tokens; j0 += block) {
        const std::int64_t bn = num_tokens - j0 < block ? num_tokens - j0 : block;
        for (std::int64_t g = 0; g < gn; ++g) {
          if (run_sum[g] != run_sum[g]) continue;  // already NaN: the result is NaN whatever follows
          const float* qg = q + (g0 + g) * head_dim;
          float* sg = s + g * block;
          float bmax = kNegInf;
          bool nan = false;
          for (std::int64_t t = 0; t < bn; ++t) {
            const Tk* k = keys.row(j0 + t);
            float acc = 0.0f;
            for (std::int64_t c = 0; c < head_dim; ++c) acc += qg[c] * to_float(k[c]);
            sg[t] = acc * scale;
            nan = nan || sg[t] != sg[t];
            bmax = sg[t] > bmax ? sg[t] : bmax;
          }
          if (nan) {  // the max comparisons skip NaN; record it so it reaches out and lse
            run_sum[g] = kNaN;
            continue;
          }
          const float new_max = bmax > run_max[g] ? bmax : run_max[g];
          if (new_max == kNegInf) continue;  // every logit so far is -inf: nothing to add
          float* o = out + (g0 + g) * head_dim;
          if (new_max != run_max[g]) {
            const float alpha = std::exp(run_max[g] - new_max);  // 0 on the first block
            run_sum[g] *= alpha;
            for (std::int64_t c = 0; c < head_dim; ++c) o[c] *= alpha;
            run_max[g] = new_max;
          }
          for (std::int64_t t = 0; t < bn; ++t) {
            const float p = std::exp(sg[t] - new_max);
            run_sum[g] += p;
            const Tv* v = values.row(j0 + t);
            for (std::int64_t c = 0; c < head_dim; ++c) o[c] += p * to_float(v[c]);
          }
        }
      }
      for (std::int64_t g = 0; g < gn; ++g) {
        float* o = out + (g0 + g) * head_dim;
        const bool none = run_sum[g] == 0.0f;  // no tokens, or all logits -inf (a NaN sum is not 0: NaN propagates)
        const float inv = none ? 0.0f : 1.0f / run_sum[g];
        for (std::int64_t c = 0; c < head_dim; ++c) o[c] *= inv;
        if (lse != nullptr) lse[g0 + g] = none ? kNegInf : run_max[g] + std::log(run_sum[g]);
      }
    }
  }
};

}  // namespace backend

KVP_NAMESPACE_END
