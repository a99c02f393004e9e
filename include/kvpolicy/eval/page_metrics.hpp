// SPDX-License-Identifier: Apache-2.0
// Quality and cost of a page selection (Quest or any policy that writes a
// `PageSelection`), measured against full attention on the same paged cache:
//
// - `attend_pages` / `dense_attention` / `selection_attention`: decode
//   attention of one query per head over every page or over a selection (the
//   paged decode attention reference, on any backend);
// - `page_quality`: per (sequence, query head) and averaged
//     * page recall      |selected pages ∩ oracle pages| / |oracle pages|, the
//                        oracle pages being those holding the `oracle_tokens`
//                        keys of highest full-attention weight;
//     * mass recall      full-attention probability on the selected tokens,
//                        exp(lse_selection - lse_full);
//     * output error     ||o_selection - o_full||_2 / ||o_full||_2;
// - `selection_bytes`, `quest_traffic_fraction`: KV bytes a decode step reads
//   with the selection vs dense attention.
//
// These are evaluation helpers for tools, tests and examples: `page_quality`
// allocates its scratch (std::vector) and is not noexcept; `attend_pages`
// takes a caller workspace like every op-level entry point.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "kvpolicy/core/gqa.hpp"
#include "kvpolicy/core/page_selection.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/parallel.hpp"
#include "kvpolicy/core/tensor_view.hpp"
#include "kvpolicy/core/workspace.hpp"
#include "kvpolicy/ops/scalar.hpp"

KVP_NAMESPACE_BEGIN

// ---- small metric functions (reusable on their own) -------------------------

/// ||a - b||_2 / ||b||_2 in double (0 when both are zero, inf when only b is).
inline double relative_l2_error(const float* a, const float* b, std::int64_t n) noexcept {
  double num = 0.0, den = 0.0;
  for (std::int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(a[i]) - static_cast<double>(b[i]);
    num += d * d;
    den += static_cast<double>(b[i]) * static_cast<double>(b[i]);
  }
  if (den == 0.0) return num == 0.0 ? 0.0 : INFINITY;
  return std::sqrt(num / den);
}

/// Attention mass a subset of the keys carries, from the log-sum-exp of the
/// subset and of all keys (both from `paged_decode_attention`).
inline double attention_mass(float lse_subset, float lse_full) noexcept {
  return std::exp(static_cast<double>(lse_subset) - static_cast<double>(lse_full));
}

/// |a ∩ b| for two ascending, duplicate-free lists.
inline std::int64_t sorted_intersection_size(const std::int32_t* a, std::int64_t na, const std::int32_t* b, std::int64_t nb) noexcept {
  std::int64_t i = 0, j = 0, c = 0;
  while (i < na && j < nb) {
    if (a[i] < b[j])
      ++i;
    else if (b[j] < a[i])
      ++j;
    else {
      ++c;
      ++i;
      ++j;
    }
  }
  return c;
}

/// Paper §3.5 traffic model: (metadata + selected KV) / dense KV per step
/// = 1/page_size + token_budget/seq_len (same element size for metadata and
/// KV, two metadata rows per page against K and V per token), capped at 1.
inline double quest_traffic_fraction(std::int64_t seq_len, std::int32_t page_size, std::int64_t token_budget) noexcept {
  if (seq_len <= 0 || page_size <= 0) return 1.0;
  return std::min(1.0, 1.0 / page_size + static_cast<double>(token_budget) / static_cast<double>(seq_len));
}

// ---- attention over pages ----------------------------------------------------

namespace detail {

/// Per-worker scratch of `attend_pages`, in carving order: fp32 queries,
/// outputs and lse of one GQA group, then the op's block scratch. `layout`
/// is the one definition behind the size report (`Alloc` = WorkspacePlan)
/// and the carve (`Alloc` = WorkspaceCarver), so the two cannot disagree.
struct AttendPagesScratch {
  float* q = nullptr;  // (group, head_dim)
  float* o = nullptr;  // (group, head_dim)
  float* l = nullptr;  // (group)
  Workspace op{};      // Backend::paged_attention_workspace(group, page_size, head_dim)

  template <class Backend, class Alloc>
  static AttendPagesScratch layout(Alloc& a, std::int64_t group, std::int32_t page_size, std::int64_t head_dim) noexcept {
    AttendPagesScratch s;
    s.q = a.template take<float>(static_cast<std::size_t>(group * head_dim));
    s.o = a.template take<float>(static_cast<std::size_t>(group * head_dim));
    s.l = a.template take<float>(static_cast<std::size_t>(group));
    const std::size_t op_bytes = Backend::paged_attention_workspace(group, page_size, head_dim);
    s.op = Workspace{a.template take<std::byte>(op_bytes), op_bytes};
    return s;
  }
  /// Bytes of one worker's slice.
  template <class Backend>
  static std::size_t per_worker(std::int64_t group, std::int32_t page_size, std::int64_t head_dim) noexcept {
    WorkspacePlan plan;
    layout<Backend>(plan, group, page_size, head_dim);
    return plan.bytes;
  }
};

}  // namespace detail

/// Workspace of `attend_pages` for GQA group `group` (per worker: fp32
/// queries, outputs and lse of the group, and the op's block scratch).
template <class Backend = backend::Scalar>
std::size_t attend_pages_workspace(std::int64_t group, std::int32_t page_size, std::int32_t head_dim,
                                   const ExecContext& ctx = {}) noexcept {
  return detail::WorkerSlices::bytes(detail::AttendPagesScratch::per_worker<Backend>(group, page_size, head_dim), ctx.workers());
}

/// Decode attention of `queries` (batch, num_q_heads, head_dim) over the rows
/// of `rows`, a page table over kv's pool with `batch * R` rows: R == 1 (each
/// sequence's row serves all its heads: `kv.table` itself gives full
/// attention), R == num_kv_heads (one row per kv head, shared by its query
/// group) or R == num_q_heads (one row per query head); when num_kv_heads ==
/// num_q_heads the two coincide. A row lists pages in order, only its last
/// page partial (`last_page_len`), as `PageSelection` rows do.
/// out: (batch, num_q_heads, head_dim) fp32, any strides; lse: (batch,
/// num_q_heads) natural log-sum-exp of the scaled logits, or an empty view.
/// Validates everything before writing; parallel over (sequence, kv head);
/// K and V are read in place through the backend's `paged_decode_attention`.
template <class Backend = backend::Scalar, class Tq, class T>
  requires KVElement<Tq> && KVElement<T> Status attend_pages(const PagedKVView<const T>& kv, TensorView<Tq, 3> queries,
                                                             const PageTable& rows, float scale, TensorView<float, 3> out,
                                                             TensorView<float, 2> lse, Workspace ws, const ExecContext& ctx = {})
noexcept {
  constexpr const char* who = "attend_pages";
  KVP_RETURN_IF_ERROR(kv.validate(who, /*need_values=*/true));
  KVP_REQUIRE(kv.device.is_host() && queries.device().is_host(), "%s: inputs live on a device; this entry point reads host memory", who);
  KVP_RETURN_IF_ERROR(queries.check_basic(who, "queries"));
  GqaMap gqa;
  KVP_RETURN_IF_ERROR(GqaMap::make(queries.extent(1), kv.num_kv_heads, who, &gqa));
  const std::int64_t batch = queries.extent(0), Hq = gqa.num_q_heads, Hkv = gqa.num_kv_heads, d = kv.head_dim;
  KVP_REQUIRE(queries.extent(2) == d, "%s: queries head_dim is %lld, the cache has %lld", who, static_cast<long long>(queries.extent(2)),
              static_cast<long long>(d));
  KVP_REQUIRE(batch > 0 && (rows.batch == batch || rows.batch == batch * Hkv || rows.batch == batch * Hq),
              "%s: page rows has %d rows, expected batch (%lld), batch*num_kv_heads (%lld) or batch*num_q_heads (%lld)", who, rows.batch,
              static_cast<long long>(batch), static_cast<long long>(batch * Hkv), static_cast<long long>(batch * Hq));
  KVP_RETURN_IF_ERROR(rows.validate(who, kv.num_pages, kv.page_size));
  KVP_RETURN_IF_ERROR(out.check_basic(who, "out"));
  KVP_REQUIRE(out.extent(0) == batch && out.extent(1) == Hq && out.extent(2) == d,
              "%s: out has shape (%lld, %lld, %lld), expected (%lld, %lld, %lld)", who, static_cast<long long>(out.extent(0)),
              static_cast<long long>(out.extent(1)), static_cast<long long>(out.extent(2)), static_cast<long long>(batch),
              static_cast<long long>(Hq), static_cast<long long>(d));
  KVP_REQUIRE(lse.data() == nullptr || (lse.extent(0) == batch && lse.extent(1) == Hq),
              "%s: lse has shape (%lld, %lld), expected (%lld, %lld)", who, static_cast<long long>(lse.extent(0)),
              static_cast<long long>(lse.extent(1)), static_cast<long long>(batch), static_cast<long long>(Hq));
  const std::int64_t G = gqa.group_size();
  const std::size_t need = attend_pages_workspace<Backend>(G, kv.page_size, kv.head_dim, ctx);
  KVP_RETURN_IF_ERROR(check_workspace(who, ws, need));
  const detail::WorkerSlices slices =
      detail::WorkerSlices::carve(ws, detail::AttendPagesScratch::per_worker<Backend>(G, kv.page_size, kv.head_dim));
  const std::int64_t R = rows.batch / batch;
  const bool row_per_q_head = R == Hq && G > 1;
  ctx.parallel_for(batch * Hkv, [&](std::int64_t item, int worker) {
    const std::int64_t b = item / Hkv, g = item % Hkv;
    WorkspaceCarver c(slices.slice(worker));
    const auto scratch = detail::AttendPagesScratch::layout<Backend>(c, G, kv.page_size, d);
    float *q = scratch.q, *o = scratch.o, *l = scratch.l;
    const Workspace op_ws = scratch.op;
    for (std::int64_t j = 0; j < G; ++j)
      for (std::int64_t i = 0; i < d; ++i) q[j * d + i] = to_float(queries(b, g * G + j, i));
    // Heads sharing a row go through the op together, so the row is read once.
    const std::int64_t heads_per_row = row_per_q_head ? 1 : G;
    for (std::int64_t j0 = 0; j0 < G; j0 += heads_per_row) {
      const std::int64_t row = R == 1 ? b : (row_per_q_head ? b * Hq + g * G + j0 : b * Hkv + g);
      const std::int32_t r32 = static_cast<std::int32_t>(row);
      const std::int64_t tokens = rows.seq_len(r32, kv.page_size);
      const std::int32_t* pages = rows.indices + rows.indptr[row];
      const Rows<T> keys{kv.k_data + g * kv.k_strides.head, kv.k_strides.slot, pages, kv.k_strides.page, kv.page_size};
      const Rows<T> values{kv.v_data + g * kv.v_strides.head, kv.v_strides.slot, pages, kv.v_strides.page, kv.page_size};
      Backend::paged_decode_attention(q + j0 * d, heads_per_row, d, keys, values, tokens, scale, o + j0 * d, l + j0, op_ws);
    }
    for (std::int64_t j = 0; j < G; ++j) {
      for (std::int64_t i = 0; i < d; ++i) out(b, g * G + j, i) = o[j * d + i];
      if (lse.data() != nullptr) lse(b, g * G + j) = l[j];
    }
  });
  return Status::ok();
}

/// Full attention over every page of every sequence (`kv.table`).
template <class Backend = backend::Scalar, class Tq, class T>
Status dense_attention(const PagedKVView<const T>& kv, TensorView<Tq, 3> queries, float scale, TensorView<float, 3> out,
                       TensorView<float, 2> lse, Workspace ws, const ExecContext& ctx = {}) noexcept {
  return attend_pages<Backend>(kv, queries, kv.table, scale, out, lse, ws, ctx);
}

/// Attention over a page selection (rows per query head or per kv head).
template <class Backend = backend::Scalar, class Tq, class T>
Status selection_attention(const PagedKVView<const T>& kv, TensorView<Tq, 3> queries, const PageSelection& sel, float scale,
                           TensorView<float, 3> out, TensorView<float, 2> lse, Workspace ws, const ExecContext& ctx = {}) noexcept {
  KVP_RETURN_IF_ERROR(kv.validate("selection_attention", /*need_values=*/true));
  KVP_RETURN_IF_ERROR(sel.validate("selection_attention", kv.num_pages, kv.page_size));
  return attend_pages<Backend>(kv, queries, sel.as_table(), scale, out, lse, ws, ctx);
}

// ---- quality of a selection --------------------------------------------------

/// Means over the (sequence, query head) pairs of non-empty sequences.
struct PageQuality {
  double page_recall = 0.0;        ///< |selected ∩ oracle pages| / |oracle pages|
  double mass_recall = 0.0;        ///< full-attention mass on the selected tokens
  double output_rel_error = 0.0;   ///< ||o_sel - o_full|| / ||o_full||
  double attended_fraction = 0.0;  ///< attended tokens / sequence tokens
  std::int64_t heads = 0;          ///< pairs averaged
};

/// Quality of `sel` for one decode step: see the file comment for the
/// definitions. The oracle pages of a head are the pages holding its
/// `min(oracle_tokens, seq_len)` keys of highest full-attention probability
/// (fp32 softmax, the library's top-k order), compared by physical page id
/// (a sequence must not list a page twice). The last page counts like any
/// other. per_head (optional): (batch, num_q_heads, 4) fp32 receiving
/// recall, mass, error, attended fraction. Allocates its scratch.
template <class Backend = backend::Scalar, class Tq, class T>
  requires KVElement<Tq> && KVElement<T> Status page_quality(const PagedKVView<const T>& kv, TensorView<Tq, 3> queries,
                                                             const PageSelection& sel, std::int64_t oracle_tokens, float scale,
                                                             PageQuality* mean, TensorView<float, 3> per_head = {},
                                                             const ExecContext& ctx = {}) {
    constexpr const char* who = "page_quality";
    KVP_REQUIRE(mean != nullptr, "%s: mean is null", who);
    KVP_REQUIRE(oracle_tokens >= 1, "%s: oracle_tokens is %lld, must be >= 1", who, static_cast<long long>(oracle_tokens));
    KVP_RETURN_IF_ERROR(kv.validate(who, /*need_values=*/true));
    KVP_RETURN_IF_ERROR(queries.check_basic(who, "queries"));
    KVP_RETURN_IF_ERROR(sel.validate(who, kv.num_pages, kv.page_size));
    GqaMap gqa;
    KVP_RETURN_IF_ERROR(GqaMap::make(queries.extent(1), kv.num_kv_heads, who, &gqa));
    const std::int64_t batch = queries.extent(0), Hq = gqa.num_q_heads, Hkv = gqa.num_kv_heads, G = gqa.group_size(), d = kv.head_dim;
    KVP_REQUIRE(kv.table.batch == batch, "%s: queries has %lld sequences, the page table has %d", who, static_cast<long long>(batch),
                kv.table.batch);
    KVP_REQUIRE(sel.num_rows == batch * Hq || sel.num_rows == batch * Hkv,
                "%s: selection has %lld rows, expected batch*num_q_heads (%lld) or batch*num_kv_heads (%lld)", who,
                static_cast<long long>(sel.num_rows), static_cast<long long>(batch * Hq), static_cast<long long>(batch * Hkv));
    KVP_REQUIRE(per_head.data() == nullptr || (per_head.extent(0) == batch && per_head.extent(1) == Hq && per_head.extent(2) == 4),
                "%s: per_head must have shape (batch, num_q_heads, 4)", who);

    // Full and selected attention.
    std::vector<float> o_full(static_cast<std::size_t>(batch * Hq * d)), o_sel(o_full.size());
    std::vector<float> l_full(static_cast<std::size_t>(batch * Hq)), l_sel(l_full.size());
    std::vector<std::byte> ws(attend_pages_workspace<Backend>(G, kv.page_size, kv.head_dim, ctx));
    const Workspace w{ws.data(), ws.size()};
    auto o3 = [&](std::vector<float>& v) { return TensorView<float, 3>::contiguous(v.data(), {batch, Hq, d}); };
    auto l2 = [&](std::vector<float>& v) { return TensorView<float, 2>::contiguous(v.data(), {batch, Hq}); };
    KVP_RETURN_IF_ERROR(dense_attention<Backend>(kv, queries, scale, o3(o_full), l2(l_full), w, ctx));
    KVP_RETURN_IF_ERROR(attend_pages<Backend>(kv, queries, sel.as_table(), scale, o3(o_sel), l2(l_sel), w, ctx));

    // Oracle pages from the full-attention probabilities, per (sequence, kv head) item.
    std::int64_t max_len = 0;
    for (std::int32_t b = 0; b < kv.table.batch; ++b) max_len = std::max(max_len, kv.seq_len(b));
    const std::size_t max_t = static_cast<std::size_t>(std::max<std::int64_t>(max_len, 1));
    struct Scratch {
      std::vector<float> q, probs;
      std::vector<std::int32_t> tok, opages, spages;
      std::vector<std::byte> ws;
    };
    const WindowScoreShape max_shape{G,
                                     1,
                                     d,
                                     static_cast<std::int64_t>(max_t),
                                     static_cast<std::int64_t>(max_t),
                                     static_cast<std::int64_t>(max_t) - 1,
                                     scale,
                                     WindowReduce::kSum};
    std::vector<Scratch> scratch(static_cast<std::size_t>(ctx.workers()));
    for (auto& s : scratch) {
      s.q.resize(static_cast<std::size_t>(G * d));
      s.probs.resize(static_cast<std::size_t>(G) * max_t);
      s.tok.resize(max_t);
      s.opages.resize(max_t);
      s.spages.resize(max_t);
      s.ws.resize(std::max(Backend::window_scores_workspace(max_shape), Backend::topk_workspace(static_cast<std::int64_t>(max_t))));
    }
    std::vector<double> metrics(static_cast<std::size_t>(batch * Hq * 4), 0.0);
    ctx.parallel_for(batch * Hkv, [&](std::int64_t item, int worker) {
      const auto b = static_cast<std::int32_t>(item / Hkv);
      const auto g = static_cast<std::int32_t>(item % Hkv);
      const std::int64_t len = kv.seq_len(b);
      if (len == 0) return;
      Scratch& s = scratch[static_cast<std::size_t>(worker)];
      for (std::int64_t j = 0; j < G; ++j)
        for (std::int64_t i = 0; i < d; ++i) s.q[static_cast<std::size_t>(j * d + i)] = to_float(queries(b, g * G + j, i));
      const WindowScoreShape shape{G, 1, d, len, len, len - 1, scale, WindowReduce::kSum};
      const Workspace sw{s.ws.data(), s.ws.size()};
      Backend::window_scores(shape, s.q.data(), Rows<T>::paged_keys(kv, b, g), s.probs.data(), sw);
      const std::int32_t* seq_pages = kv.table.indices + kv.table.indptr[b];
      const std::int64_t k = std::min(oracle_tokens, len);
      for (std::int64_t j = 0; j < G; ++j) {
        const std::int64_t h = g * G + j;
        Backend::topk(s.probs.data() + j * len, len, k, s.tok.data(), sw);
        std::int64_t no = 0;
        for (std::int64_t i = 0; i < k; ++i) {  // tokens ascending -> logical pages ascending
          const std::int32_t lp = s.tok[static_cast<std::size_t>(i)] / kv.page_size;
          if (no == 0 || s.tok[static_cast<std::size_t>(no - 1)] != lp) s.tok[static_cast<std::size_t>(no++)] = lp;
        }
        for (std::int64_t i = 0; i < no; ++i) s.opages[static_cast<std::size_t>(i)] = seq_pages[s.tok[static_cast<std::size_t>(i)]];
        std::sort(s.opages.begin(), s.opages.begin() + no);
        const std::int64_t row = sel.num_rows == batch * Hq ? b * Hq + h : b * Hkv + g;
        const std::int64_t ns = sel.row_size(row);
        std::copy(sel.indices + sel.indptr[row], sel.indices + sel.indptr[row + 1], s.spages.begin());
        std::sort(s.spages.begin(), s.spages.begin() + ns);
        double* m = &metrics[static_cast<std::size_t>((b * Hq + h) * 4)];
        m[0] = static_cast<double>(sorted_intersection_size(s.opages.data(), no, s.spages.data(), ns)) / static_cast<double>(no);
        const std::size_t bh = static_cast<std::size_t>(b * Hq + h);
        m[1] = attention_mass(l_sel[bh], l_full[bh]);
        m[2] = relative_l2_error(o_sel.data() + bh * d, o_full.data() + bh * d, d);
        m[3] = static_cast<double>(sel.row_tokens(row, kv.page_size)) / static_cast<double>(len);
      }
    });
    *mean = PageQuality{};
    for (std::int64_t b = 0; b < batch; ++b) {
      if (kv.seq_len(static_cast<std::int32_t>(b)) == 0) continue;
      for (std::int64_t h = 0; h < Hq; ++h) {
        const double* m = &metrics[static_cast<std::size_t>((b * Hq + h) * 4)];
        mean->page_recall += m[0];
        mean->mass_recall += m[1];
        mean->output_rel_error += m[2];
        mean->attended_fraction += m[3];
        ++mean->heads;
        if (per_head.data() != nullptr)
          for (int i = 0; i < 4; ++i) per_head(b, h, i) = static_cast<float>(m[i]);
      }
    }
    if (mean->heads > 0) {
      const double n = static_cast<double>(mean->heads);
      mean->page_recall /= n;
      mean->mass_recall /= n;
      mean->output_rel_error /= n;
      mean->attended_fraction /= n;
    }
    return Status::ok();
  }

// ---- bytes read ------------------------------------------------------------------

/// Bytes one decode step of one layer reads.
struct StepBytes {
  double metadata = 0.0;  ///< page metadata read by the estimate
  double kv = 0.0;        ///< K and V of the attended tokens
  double dense_kv = 0.0;  ///< K and V of every token (dense attention)
  double fraction() const noexcept { return dense_kv > 0.0 ? (metadata + kv) / dense_kv : 0.0; }
};

/// Counts what a kernel that loads each attended page once per kv head reads:
/// per (sequence, kv head) the union of the pages its rows select (the G
/// query-head rows of kPerQueryHead overlap), K + V of their tokens; plus
/// 2 * head_dim metadata values for every scored page (the n - 1 pages of a
/// sequence with more than `page_budget` pages; 0 turns this off).
inline Status selection_bytes(const PageTable& table, std::int32_t page_size, const PageSelection& sel, std::int32_t num_q_heads,
                              std::int32_t num_kv_heads, std::int32_t head_dim, std::size_t kv_elem_bytes, std::size_t meta_elem_bytes,
                              std::int32_t page_budget, StepBytes* out) {
  constexpr const char* who = "selection_bytes";
  KVP_REQUIRE(out != nullptr, "%s: out is null", who);
  GqaMap gqa;
  KVP_RETURN_IF_ERROR(GqaMap::make(num_q_heads, num_kv_heads, who, &gqa));
  KVP_REQUIRE(head_dim >= 1, "%s: head_dim is %d, must be >= 1", who, head_dim);
  // No pool here: page ids are only compared, so any non-negative int32 id is accepted.
  KVP_RETURN_IF_ERROR(table.validate(who, std::numeric_limits<std::int32_t>::max(), page_size));
  KVP_RETURN_IF_ERROR(sel.validate(who, std::numeric_limits<std::int32_t>::max(), page_size));
  const std::int64_t batch = table.batch, G = gqa.group_size();
  KVP_REQUIRE(sel.num_rows == batch * num_q_heads || sel.num_rows == batch * num_kv_heads,
              "%s: selection has %lld rows, expected batch*num_q_heads or batch*num_kv_heads", who, static_cast<long long>(sel.num_rows));
  const bool per_q = sel.num_rows == batch * num_q_heads && G > 1;
  const double row_bytes = 2.0 * head_dim * static_cast<double>(kv_elem_bytes);
  *out = StepBytes{};
  std::vector<std::int32_t> u;
  for (std::int32_t b = 0; b < table.batch; ++b) {
    const std::int32_t n = table.num_pages(b);
    if (n == 0) continue;
    const std::int32_t last = table.indices[table.indptr[b + 1] - 1];
    out->dense_kv += row_bytes * static_cast<double>(table.seq_len(b, page_size)) * num_kv_heads;
    if (page_budget > 0 && n > page_budget) out->metadata += 2.0 * head_dim * static_cast<double>(meta_elem_bytes) * (n - 1) * num_kv_heads;
    for (std::int64_t g = 0; g < num_kv_heads; ++g) {
      u.clear();
      const std::int64_t r0 = per_q ? b * num_q_heads + g * G : b * num_kv_heads + g, nr = per_q ? G : 1;
      for (std::int64_t r = r0; r < r0 + nr; ++r) u.insert(u.end(), sel.indices + sel.indptr[r], sel.indices + sel.indptr[r + 1]);
      std::sort(u.begin(), u.end());
      u.erase(std::unique(u.begin(), u.end()), u.end());
      for (const std::int32_t p : u) out->kv += row_bytes * (p == last ? table.last_page_len[b] : page_size);
    }
  }
  return Status::ok();
}

KVP_NAMESPACE_END
