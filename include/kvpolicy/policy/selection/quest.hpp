// SPDX-License-Identifier: Apache-2.0
// Quest — "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
// Inference" (Tang, Zhao, Zhu, Xiao, Kasikci, Han; ICML 2024, arXiv 2406.10774;
// reference code mit-han-lab/Quest).
//
// Algorithm (per layer >= dense_layers, per decode step, per sequence):
//   on append:  for every page touched, M = channel max, m = channel min of its
//               post-RoPE keys (per kv head); a page restarts at slot 0.
//   select:     n = pages of the sequence, B = page budget (last page included).
//               if n <= B: every page.
//               else for each query head h (kv head g = h / G):
//                 U[h][p] = sum_i max(q_h[i] * M[p][g][i], q_h[i] * m[p][g][i]),  p < n-1
//                 pages(h) = top_{B-1}(U[h]) + {n-1}
//   attend:     exact attention over the selected pages only (nothing is evicted).
//
// Choices (reference/algorithms-other.md §1), each documented where it is made:
//  * Budget (`Budget`). A token budget (`token_budget=n`, the reference's):
//    `page_budget = n / page_size` (floor, the kernel path's
//    `token_budget // page_size`), the same for every sequence; a budget that
//    rounds to 0 pages is an error, not a silent 1. A ratio (`keep_ratio=f`,
//    `compression_ratio=r`, the library's extension for budget sweeps at equal
//    ratios): each sequence of T tokens gets max(1, Budget::total(T) / page_size)
//    pages, so short sequences still attend their last page. `page_budget > 0`
//    overrides both. B counts the last page. The HF evaluation path's floor of
//    3 pages is not applied.
//  * Last page. Always attended, never scored (it may be partial; Quest's
//    kernel appends `last_page_idx` after top-k).
//  * Dense layers. Layers `< dense_layers` (Quest: 2) attend to every page.
//  * GQA (`QuestGqa`). kPerQueryHead is the reference (one row per query head).
//    A per-kv-head consumer can use kUnion (the group's selections merged,
//    variable length), kGroupMax or kGroupSum (bounds reduced over the group
//    before one top-k: one row of exactly B pages per kv head). The metadata is
//    per kv head in every mode and each metadata row is read once per group.
//  * Ties. The library's top-k order (`score_order_key`): higher bound first,
//    equal bounds -> the higher (more recent) page, NaN bounds last. The
//    reference's radix select leaves ties unspecified.
//  * Metadata dtype. The key dtype or fp32, both exact (see PageMetaView).
//  * Output. `PageSelection` rows in ascending logical page order with the last
//    page last, so a row is a FlashInfer `kv_indptr/kv_indices/last_page_len`
//    request as-is.
//  * Repeated pages. A sequence must not list a page id twice (its selection
//    would list it twice); `plan` and `select` reject it. Sequences may share
//    pages. The check needs no workspace: an 8 KiB bitmap on the stack covers
//    65536 consecutive ids, and a sequence of n pages takes one pass over its
//    ids per 65536-id window that holds some of them, i.e. O(n * w) with
//    w <= min(n, ceil(id span / 65536)): O(n) for pools of up to 65536 pages.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kvpolicy/core/gqa.hpp"
#include "kvpolicy/core/page_selection.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/parallel.hpp"
#include "kvpolicy/core/tensor_view.hpp"
#include "kvpolicy/core/workspace.hpp"
#include "kvpolicy/ops/scalar.hpp"
#include "kvpolicy/policy/concepts.hpp"
#include "kvpolicy/policy/params.hpp"
#include "kvpolicy/policy/vocabulary.hpp"

KVP_NAMESPACE_BEGIN

/// How Quest's per-query-head selection meets grouped-query attention.
enum class QuestGqa : std::uint8_t {
  kPerQueryHead,  ///< reference: one selection per query head; rows = batch * num_q_heads, B pages each
  kUnion,         ///< one row per kv head: union of its G query heads' selections (B .. G*(B-1)+1 pages)
  kGroupMax,      ///< one row per kv head: top-(B-1) of max_h U[h] over the group, plus the last page
  kGroupSum,      ///< one row per kv head: top-(B-1) of sum_h U[h] over the group, plus the last page
};

inline constexpr EnumName<QuestGqa> kQuestGqaNames[] = {{"per_query_head", QuestGqa::kPerQueryHead},
                                                        {"union", QuestGqa::kUnion},
                                                        {"group_max", QuestGqa::kGroupMax},
                                                        {"group_sum", QuestGqa::kGroupSum}};
constexpr std::span<const EnumName<QuestGqa>> enum_names(QuestGqa) noexcept { return kQuestGqaNames; }

struct QuestParams {
  Budget budget = Budget::tokens(512);  ///< tokens attended per head, last page included (Quest default 512)
  std::int32_t page_budget = 0;         ///< > 0: pages per head directly, overriding `budget`
  std::int32_t dense_layers = 2;        ///< layers [0, dense_layers) attend to every page (Quest: 2)
  QuestGqa gqa = QuestGqa::kPerQueryHead;

  static constexpr auto fields() noexcept {
    return std::tuple{budget_field<&QuestParams::budget>("budget", {"token_budget", "keep_ratio", "compression_ratio"},
                                                         "tokens attended per head, last page included (or a ratio of the sequence)"),
                      param_field<&QuestParams::page_budget>("page_budget", "> 0: pages per head, overriding token_budget"),
                      param_field<&QuestParams::dense_layers>("dense_layers", "layers attending to every page"),
                      param_field<&QuestParams::gqa>("gqa", "how the selection meets grouped-query attention")};
  }
};

class Quest {
 public:
  using Params = QuestParams;
  static constexpr const char* kName = "quest";

  constexpr Quest() noexcept = default;
  explicit constexpr Quest(const Params& p) noexcept : params_(p) {}
  constexpr const Params& params() const noexcept { return params_; }

  /// Pages attended per head of a sequence of `seq_tokens` tokens in
  /// `page_size`-token pages (last page included). A token budget does not
  /// depend on the sequence (`seq_tokens` may be omitted); a ratio does.
  constexpr std::int32_t page_budget(std::int32_t page_size, std::int64_t seq_tokens = 0) const noexcept {
    if (params_.page_budget > 0) return params_.page_budget;
    if (page_size <= 0) return 0;
    const std::int64_t tokens = params_.budget.total(std::max<std::int64_t>(seq_tokens, 0), 0);
    const std::int64_t pages = std::min<std::int64_t>(tokens / page_size, INT32_MAX);
    if (params_.budget.kind == BudgetKind::kTokens) return static_cast<std::int32_t>(pages);
    return static_cast<std::int32_t>(std::max<std::int64_t>(pages, 1));
  }
  /// The page budget of sequence b of `table`.
  std::int32_t page_budget(const PageTable& table, std::int32_t b, std::int32_t page_size) const noexcept {
    return page_budget(page_size, table.seq_len(b, page_size));
  }
  constexpr bool is_dense_layer(int layer) const noexcept { return layer < params_.dense_layers; }
  /// Rows per sequence of the selection: query heads (kPerQueryHead) or kv heads.
  constexpr std::int64_t heads_per_seq(const GqaMap& gqa) const noexcept {
    return params_.gqa == QuestGqa::kPerQueryHead ? gqa.num_q_heads : gqa.num_kv_heads;
  }

  /// The checks that do not depend on the page size.
  Status validate_params() const noexcept {
    KVP_RETURN_IF_ERROR(check_enum_fields(kName, params_));
    KVP_RETURN_IF_ERROR(params_.budget.validate("quest: budget (token_budget / keep_ratio / compression_ratio)"));
    KVP_REQUIRE(params_.page_budget >= 0, "quest: page_budget is %d, must be >= 0", params_.page_budget);
    KVP_REQUIRE(params_.budget.kind != BudgetKind::kTokens || params_.budget.value > 0 || params_.page_budget > 0,
                "quest: token_budget and page_budget are both 0");
    KVP_REQUIRE(params_.dense_layers >= 0, "quest: dense_layers is %d, must be >= 0", params_.dense_layers);
    return Status::ok();
  }

  /// All checks for `page_size`-token pages.
  Status validate_params(std::int32_t page_size) const noexcept {
    KVP_REQUIRE(page_size > 0, "quest: page_size is %d, must be > 0", page_size);
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_REQUIRE(page_budget(page_size) >= 1,
                "quest: page budget is 0 (token_budget=%lld / page_size=%d rounds down to 0 pages); must be >= 1 (the last page)",
                static_cast<long long>(params_.budget.value), page_size);
    KVP_REQUIRE(params_.dense_layers >= 0, "quest: dense_layers is %d, must be >= 0", params_.dense_layers);
    return Status::ok();
  }

  /// Entries a row reserves for a sequence of `n` pages and page budget `B`:
  /// exact for every mode but kUnion, whose rows are compacted to their actual
  /// size afterwards.
  std::int64_t row_capacity(int layer, std::int32_t n, std::int64_t B, const GqaMap& gqa) const noexcept {
    if (n <= 0) return 0;
    if (is_dense_layer(layer) || n <= B) return n;
    if (params_.gqa == QuestGqa::kUnion) return std::min<std::int64_t>(n, gqa.group_size() * (B - 1) + 1);
    return B;
  }

  /// `PageSelection::capacity` that `select` needs for this table.
  std::int64_t output_capacity(int layer, const PageTable& table, std::int32_t page_size, const GqaMap& gqa) const noexcept {
    std::int64_t total = 0;
    for (std::int32_t b = 0; b < table.batch; ++b)
      total += row_capacity(layer, table.num_pages(b), page_budget(table, b, page_size), gqa) * heads_per_seq(gqa);
    return total;
  }

  /// Caller-owned per-page state: the channel max / min of every page's keys
  /// (per kv head), indexed by physical page id (see `PageMetaView`).
  template <class Tm>
  using State = PageMetaView<Tm>;

  /// The host-side plan of one decode step's batch composition (FlashInfer's
  /// DecodePlan): parameters and table validated once, the output and the
  /// workspace sized exactly. `select` checks that the step matches the plan
  /// (layer, page size, batch) and re-derives per-sequence row offsets from
  /// the table (O(batch) host work, no allocation).
  struct Plan {
    std::int32_t layer = -1;
    std::int32_t page_size = 0;
    std::int32_t batch = 0;
    GqaMap gqa{};
    Requirements requirements{};  ///< workspace, PageSelection rows / capacity, query window 1
  };

  /// Worst-case size query without a table: every sequence at most
  /// `shape.max_kv_len` tokens in `page_size`-token pages, `shape.batch`
  /// sequences, any layer. Lets an engine allocate once.
  template <class Backend>
  Requirements requirements(const Context<Backend>& ctx, const ProblemShape& shape, std::int32_t page_size) const noexcept {
    Requirements r;
    r.status = validate_params(page_size);
    GqaMap gqa;
    if (r.status.is_ok()) r.status = GqaMap::make(shape.num_q_heads, shape.num_kv_heads, kName, &gqa);
    if (r.status.is_ok() && (shape.batch < 1 || shape.batch > INT32_MAX || shape.head_dim < 1 || shape.max_kv_len < 0))
      r.status = KVP_INVALID(
          "quest: shape (batch %lld, head_dim %lld, max_kv_len %lld) must have batch >= 1, head_dim >= 1, max_kv_len >= 0",
          static_cast<long long>(shape.batch), static_cast<long long>(shape.head_dim), static_cast<long long>(shape.max_kv_len));
    if (!r.status.is_ok()) return r;
    const auto n = static_cast<std::int32_t>(std::min<std::int64_t>((shape.max_kv_len + page_size - 1) / page_size, INT32_MAX));
    const auto batch = static_cast<std::int32_t>(shape.batch);
    const std::int32_t B = page_budget(page_size, shape.max_kv_len);  // B grows with the sequence: the longest is the worst case
    r.workspace_bytes =
        layout<Backend>(batch, shape.batch * std::max(n - 1, 0), n, B, gqa, static_cast<std::int32_t>(shape.head_dim), ctx.exec.workers())
            .total();
    const std::int64_t cap = std::max(row_capacity(0, n, B, gqa), row_capacity(params_.dense_layers, n, B, gqa));
    r.output = OutputSize{shape.batch * heads_per_seq(gqa), shape.batch * heads_per_seq(gqa) * cap};
    r.query_window = 1;
    return r;
  }

  /// Plans a decode step of `in.layer` over `in.table` (queries (batch,
  /// num_q_heads, head_dim), `shape.num_kv_heads` kv heads). Validates the
  /// table's CSR structure, ids >= 0 and no page id repeated within a
  /// sequence (see "Repeated pages" above for the cost).
  template <class Backend, class Tq>
  Status plan(const Context<Backend>& ctx, const DecodeInput<Tq>& in, const ProblemShape& shape, Plan& out) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params(in.page_size));
    KVP_REQUIRE(in.layer >= 0, "quest: layer is %d, must be >= 0", in.layer);
    KVP_RETURN_IF_ERROR(in.queries.check_basic(kName, "queries"));
    GqaMap gqa;
    KVP_RETURN_IF_ERROR(GqaMap::make(in.queries.extent(1), shape.num_kv_heads, kName, &gqa));
    KVP_REQUIRE(in.queries.extent(0) == in.table.batch, "quest: queries has %lld sequences, the page table has batch %d",
                static_cast<long long>(in.queries.extent(0)), in.table.batch);
    KVP_REQUIRE(in.queries.extent(2) >= 1 && in.queries.extent(2) <= INT32_MAX, "quest: queries head_dim is %lld, must be >= 1",
                static_cast<long long>(in.queries.extent(2)));
    // The pool size is not known here: ids are checked against it by `select`, here only for >= 0.
    // On a device backend the ids are device memory: only the CSR structure is checked.
    KVP_RETURN_IF_ERROR(in.table.validate(kName, INT32_MAX, in.page_size, !kDeviceBackend<Backend>));
    if constexpr (!kDeviceBackend<Backend>) KVP_RETURN_IF_ERROR(check_no_repeated_page(in.table));
    Plan p;
    p.layer = in.layer;
    p.page_size = in.page_size;
    p.batch = in.table.batch;
    p.gqa = gqa;
    p.requirements.workspace_bytes =
        layout<Backend>(in.table.batch, scored_pages(in.layer, in.table, in.page_size), max_pages(in.table),
                        max_page_budget(in.table, in.page_size), gqa, static_cast<std::int32_t>(in.queries.extent(2)), ctx.exec.workers())
            .total();
    p.requirements.output =
        OutputSize{static_cast<std::int64_t>(in.table.batch) * heads_per_seq(gqa), output_capacity(in.layer, in.table, in.page_size, gqa)};
    p.requirements.query_window = 1;
    out = p;
    return Status::ok();
  }

  /// Keeps the page metadata current after an append (`app.append_len[b]`
  /// tokens appended to sequence b; the keys of tokens [len_b - append_len[b],
  /// len_b) are already in the pool and `app.kv.table` already counts them),
  /// or rebuilds every page the table references (`append_len == nullptr`;
  /// pages outside the table are left alone). Covers a decode step (1 token),
  /// chunked prefill (any chunk, straddling pages) and resuming a partially
  /// filled page; a page whose slot 0 is written starts afresh. Validates
  /// everything before writing. With a parallel context, a page must not be
  /// appended to by two sequences in one call. O(appended tokens * kv_heads * d).
  template <class Backend, class Tk, class Tm>
    requires PageMetaStorableFrom<Tk, Tm> Status on_append(const Context<Backend>& ctx, const AppendInput<Tk>& app, State<Tm> meta)
  const noexcept {
    const PagedKVView<const Tk>& keys = app.kv;
    constexpr bool on_device = kDeviceBackend<Backend>;
    KVP_RETURN_IF_ERROR(validate_keys(keys, meta, on_device));
    if (app.append_len != nullptr) {
      for (std::int32_t b = 0; b < keys.table.batch; ++b) {
        KVP_REQUIRE(app.append_len[b] >= 0 && app.append_len[b] <= keys.seq_len(b),
                    "quest: append_len[%d] is %d, must be in [0, sequence length %lld]", b, app.append_len[b],
                    static_cast<long long>(keys.seq_len(b)));
      }
    }
    if constexpr (on_device) {
      // The page pool, the page ids and the metadata are device memory; the table's lengths and
      // `append_len` are host arrays. One op per sequence: its page runs for every kv head.
      const detail::BackendCall<Backend> call(ctx);
      KVP_RETURN_IF_ERROR(call.begin());
      for (std::int32_t b = 0; b < keys.table.batch; ++b) {
        const std::int64_t len = keys.seq_len(b), t0 = app.append_len != nullptr ? len - app.append_len[b] : 0;
        Backend::page_meta_append(keys.k_data, keys.k_strides, keys.page_size, keys.num_kv_heads, keys.head_dim,
                                  keys.table.indices + keys.table.indptr[b], t0, len, meta);
      }
      return call.end();
    } else {
      fold_tokens<Backend>(keys, meta, app.append_len, ctx.exec);
      return Status::ok();
    }
  }

  /// Page selection for one decode step planned by `plan`.
  ///
  /// in.queries: (batch, num_q_heads, head_dim), any strides, post-RoPE, float / half / bfloat16.
  /// in.table:   the batch's FlashInfer CSR page table (batch = queries.extent(0)).
  /// meta:       the layer's page metadata, kept current by `on_append`.
  /// out:        rows `b * heads_per_seq + head`, capacity >= `plan.requirements.output.capacity`.
  ///
  /// Every input is validated before anything is written (the table against
  /// the metadata's pool, no page id repeated within a sequence); on error
  /// `out` is untouched. Two parallel phases through `ctx.exec`: the bounds, over
  /// (sequence, run of 256 pages) items with every kv head of a page at
  /// once; then top-k and the CSR rows over (sequence, kv head) items. The
  /// result does not depend on the number of workers. Cost per sequence of
  /// n pages: O(n * Hq * d) for the bounds (reading 2 * d metadata values per
  /// page and kv head) plus the backend top-k. Thread-safe (const, no state).
  template <class Backend, class Tq, class Tm>
    requires KVElement<Tq> && KVElement<Tm> Status select(const Context<Backend>& cx, const Plan& plan, const DecodeInput<Tq>& in,
                                                          State<Tm> meta, PageSelection out)
  const noexcept {
    KVP_REQUIRE(plan.layer == in.layer && plan.page_size == in.page_size && plan.batch == in.table.batch,
                "quest: the step (layer %d, page_size %d, batch %d) does not match the plan (layer %d, page_size %d, batch %d); re-plan",
                in.layer, in.page_size, in.table.batch, plan.layer, plan.page_size, plan.batch);
    if constexpr (kDeviceBackend<Backend>) {
      const detail::BackendCall<Backend> call(cx);
      KVP_RETURN_IF_ERROR(select_on_device<Backend>(in.layer, in.queries, in.table, in.page_size, meta, out, cx.workspace, call));
      return call.end();
    } else {
      return select_impl<Backend>(in.layer, in.queries, in.table, in.page_size, meta, out, cx.workspace, cx.exec);
    }
  }

 private:
  static constexpr std::int64_t kItemPages = 256;     ///< pages per bounds-phase work item
  static constexpr std::int64_t kIdWindow = 1 << 16;  ///< page ids per pass of the repeated-page check

  /// No sequence of `table` (CSR structure already validated) lists a page id
  /// twice. Ids in [base, base + kIdWindow) are marked in a stack bitmap; ids
  /// beyond the window set the next window's base (the smallest of them), so
  /// only windows holding ids are visited. Each pass clears the words it set.
  static Status check_no_repeated_page(const PageTable& table) noexcept {
    std::uint64_t seen[kIdWindow / 64] = {};
    for (std::int32_t b = 0; b < table.batch; ++b) {
      const std::int32_t n = table.num_pages(b);
      if (n < 2) continue;
      const std::int32_t* pages = table.indices + table.indptr[b];
      std::int64_t base = *std::min_element(pages, pages + n);
      while (true) {
        std::int64_t next = INT64_MAX;
        for (std::int32_t i = 0; i < n; ++i) {
          const std::int64_t off = static_cast<std::int64_t>(pages[i]) - base;
          if (off < 0) continue;  // an earlier window's
          if (off >= kIdWindow) {
            next = std::min<std::int64_t>(next, pages[i]);
            continue;
          }
          const std::uint64_t bit = std::uint64_t{1} << (off % 64);
          if ((seen[off / 64] & bit) != 0) {
            const auto first = static_cast<std::int32_t>(std::find(pages, pages + i, pages[i]) - pages);
            return KVP_INVALID(
                "quest: page table sequence %d lists page %d twice (entries %d and %d); a sequence's page ids must be distinct "
                "(sequences may share pages)",
                b, pages[i], first, i);
          }
          seen[off / 64] |= bit;
        }
        for (std::int32_t i = 0; i < n; ++i) {
          const std::int64_t off = static_cast<std::int64_t>(pages[i]) - base;
          if (off >= 0 && off < kIdWindow) seen[off / 64] = 0;
        }
        if (next == INT64_MAX) break;
        base = next;
      }
    }
    return Status::ok();
  }

  template <class Backend, class Tq, class Tm>
  Status select_impl(int layer, TensorView<const Tq, 3> queries, const PageTable& table, std::int32_t page_size, PageMetaView<Tm> meta,
                     PageSelection out, Workspace ws, const ExecContext& ctx) const noexcept {
    GqaMap gqa;
    Layout lay;
    KVP_RETURN_IF_ERROR(check_select<Backend>(layer, queries, table, page_size, meta, out, ws, ctx.workers(), false, &gqa, &lay));
    // Rows reserve row_capacity() entries at fixed offsets, so items write independently.
    write_row_offsets(layer, table, page_size, gqa, out);
    Scratch sc = carve(lay, ws);
    const std::int32_t d = meta.head_dim;
    const std::int64_t Hq = gqa.num_q_heads;
    // Score offsets of the scored sequences, fp32 queries, bounds-phase items.
    std::int64_t score_pos = 0, items = 0;
    sc.chunk_start[0] = 0;
    for (std::int32_t b = 0; b < table.batch; ++b) {
      const std::int64_t m = scored(layer, table.num_pages(b), page_budget(table, b, page_size)) ? table.num_pages(b) - 1 : 0;
      sc.score_start[b] = score_pos;
      score_pos += m * Hq;
      items += (m + kItemPages - 1) / kItemPages;
      sc.chunk_start[b + 1] = items;
      if (m > 0)
        for (std::int64_t h = 0; h < Hq; ++h)
          for (std::int32_t i = 0; i < d; ++i) sc.q[(b * Hq + h) * d + i] = to_float(queries(b, h, i));
    }
    const PageMetaView<const Tm> cmeta = meta;
    ctx.parallel_for(items, [&](std::int64_t item, int worker) {
      const auto b =
          static_cast<std::int32_t>(std::upper_bound(sc.chunk_start, sc.chunk_start + table.batch + 1, item) - sc.chunk_start - 1);
      const std::int64_t m = table.num_pages(b) - 1, p0 = (item - sc.chunk_start[b]) * kItemPages;
      Backend::page_bounds(sc.q + b * Hq * d, gqa.group_size(), d, cmeta, table.indices + table.indptr[b] + p0,
                           std::min<std::int64_t>(kItemPages, m - p0), sc.scores + sc.score_start[b] + p0, m, sc.worker(worker));
    });
    ctx.parallel_for(static_cast<std::int64_t>(table.batch) * gqa.num_kv_heads, [&](std::int64_t item, int worker) {
      const auto b = static_cast<std::int32_t>(item / gqa.num_kv_heads);
      const auto g = static_cast<std::int32_t>(item % gqa.num_kv_heads);
      WorkspaceCarver c(sc.worker(worker));
      select_item<Backend>(layer, page_budget(table, b, page_size), gqa, table, b, g, sc.scores + sc.score_start[b], out, c);
    });
    if (params_.gqa == QuestGqa::kUnion) compact_rows(out);
    return Status::ok();
  }

  /// `select_impl` on a device backend. The queries, the metadata, the page
  /// ids (`table.indices`), the selection's ids (`out.indices`, `out.logical`)
  /// and the workspace are device memory; `table.indptr`,
  /// `table.last_page_len`, `out.indptr` and `out.last_page_len` are host
  /// arrays (lengths the engine's scheduler knows; FlashInfer's plan takes
  /// them on the host too). Checked on the host: shapes and the CSR
  /// structure; not checked (they would need a device read): page ids in
  /// range, repeated ids, non-finite queries. kUnion (a data-dependent row
  /// length) is not offered on a device. Sequences are scored one after
  /// another, each with one bounds launch over all its pages.
  template <class Backend, class Tq, class Tm>
  Status select_on_device(int layer, TensorView<const Tq, 3> queries, const PageTable& table, std::int32_t page_size, PageMetaView<Tm> meta,
                          PageSelection out, Workspace ws, const detail::BackendCall<Backend>& call) const noexcept {
    GqaMap gqa;
    Layout lay;
    KVP_RETURN_IF_ERROR(check_select<Backend>(layer, queries, table, page_size, meta, out, ws, 1, true, &gqa, &lay));
    KVP_RETURN_IF_ERROR(call.begin());  // after every check, before anything is written
    write_row_offsets(layer, table, page_size, gqa, out);
    const Scratch sc = carve(lay, ws);  // score_start / chunk_start (device memory) stay unused: offsets are kept on the host
    const std::int32_t d = meta.head_dim;
    const std::int64_t Hq = gqa.num_q_heads;
    const PageMetaView<const Tm> cmeta = meta;
    std::int64_t score_pos = 0;
    for (std::int32_t b = 0; b < table.batch; ++b) {
      const std::int32_t B = page_budget(table, b, page_size);
      const std::int64_t m = scored(layer, table.num_pages(b), B) ? table.num_pages(b) - 1 : 0;
      if (m > 0) {
        Backend::widen_queries(queries, b, 1, 0, Hq, sc.q + b * Hq * d);  // (batch, Hq, d) read as (heads, rows, d)
        Backend::page_bounds(sc.q + b * Hq * d, gqa.group_size(), d, cmeta, table.indices + table.indptr[b], m, sc.scores + score_pos, m,
                             sc.worker(0));
      }
      select_sequence_on_device<Backend>(layer, B, gqa, table, b, sc.scores + score_pos, out, sc.worker(0));
      score_pos += m * Hq;
    }
    return Status::ok();
  }

  /// `select_item` for every kv head of sequence b at once, in batched ops:
  /// one top-k launch over the sequence's rows (query heads, or kv heads
  /// after the group reduction) and one launch writing every row's page ids
  /// and logical indices. The sequence's rows are consecutive with the same
  /// capacity (`write_row_offsets`). Same ids as `select_item`.
  template <class Backend>
  void select_sequence_on_device(int layer, std::int32_t B, const GqaMap& gqa, const PageTable& table, std::int32_t b, const float* scores,
                                 PageSelection& out, Workspace ws) const noexcept {
    const std::int32_t n = table.num_pages(b), G = gqa.group_size();
    if (n == 0) return;
    const std::int32_t* pages = table.indices + table.indptr[b];
    const bool per_q = params_.gqa == QuestGqa::kPerQueryHead;
    const std::int64_t rows = heads_per_seq(gqa), row0 = static_cast<std::int64_t>(b) * rows;
    std::int32_t* dst = out.indices + out.indptr[row0];
    std::int32_t* lg = out.logical ? out.logical + out.indptr[row0] : nullptr;
    const std::int64_t dst_ld = out.indptr[row0 + 1] - out.indptr[row0];
    if (!scored(layer, n, B)) {
      Backend::gather_page_rows(pages, nullptr, 0, rows, n, -1, dst, lg, dst_ld);
      return;
    }
    const std::int64_t m = n - 1, k = B - 1;
    WorkspaceCarver c(ws);
    float* reduced = per_q ? nullptr : c.take<float>(static_cast<std::size_t>(gqa.num_kv_heads * m));
    std::int32_t* sel = c.take<std::int32_t>(static_cast<std::size_t>(rows * std::max<std::int64_t>(k, 1)));
    const float* ranked = scores;  // (rows, m)
    if (!per_q) {
      const GroupReduce kind = params_.gqa == QuestGqa::kGroupMax ? GroupReduce::kMax : GroupReduce::kSum;
      for (std::int32_t g = 0; g < gqa.num_kv_heads; ++g)
        Backend::group_reduce(scores + static_cast<std::int64_t>(g) * G * m, G, m, m, kind, reduced + g * m);
      ranked = reduced;
    }
    Backend::topk_rows_strided(ranked, m, rows, m, k, sel, std::max<std::int64_t>(k, 1), c.rest());
    Backend::gather_page_rows(pages, sel, std::max<std::int64_t>(k, 1), rows, k, n - 1, dst, lg, dst_ld);
  }

  /// Whether a sequence of n pages is scored (not dense, longer than the budget).
  constexpr bool scored(int layer, std::int32_t n, std::int32_t B) const noexcept { return !is_dense_layer(layer) && n > B; }
  /// Pages scored in `table` at `layer` (layer < 0: at a sparse layer).
  std::int64_t scored_pages(int layer, const PageTable& table, std::int32_t page_size) const noexcept {
    std::int64_t total = 0;
    for (std::int32_t b = 0; b < table.batch; ++b) {
      const std::int32_t B = page_budget(table, b, page_size);
      if (layer < 0 ? table.num_pages(b) > B : scored(layer, table.num_pages(b), B)) total += table.num_pages(b) - 1;
    }
    return total;
  }
  std::int32_t max_page_budget(const PageTable& table, std::int32_t page_size) const noexcept {
    std::int32_t B = 1;
    for (std::int32_t b = 0; b < table.batch; ++b) B = std::max(B, page_budget(table, b, page_size));
    return B;
  }
  static std::int32_t max_pages(const PageTable& table) noexcept {
    std::int32_t n = 0;
    for (std::int32_t b = 0; b < table.batch; ++b) n = std::max(n, table.num_pages(b));
    return n;
  }

  /// Workspace geometry; `total()` is what `plan` / `requirements` report and
  /// `carve` takes the blocks in the same order.
  struct Layout {
    std::size_t q = 0, scores = 0, offsets = 0, per_worker = 0;
    int workers = 1;
    std::size_t total() const noexcept {
      WorkspacePlan p;
      p.add<float>(q).add<float>(scores).add<std::int64_t>(offsets).add<std::int64_t>(offsets);
      p.add_bytes(per_worker * static_cast<std::size_t>(workers));
      return p.total();
    }
  };
  struct Scratch {
    float* q = nullptr;                   // (batch, Hq, d) fp32 queries of scored sequences
    float* scores = nullptr;              // per scored sequence b: (Hq, n_b - 1) bounds at score_start[b]
    std::int64_t* score_start = nullptr;  // (batch + 1)
    std::int64_t* chunk_start = nullptr;  // (batch + 1): first bounds-phase item of each sequence
    std::byte* workers = nullptr;
    std::size_t per_worker = 0;
    Workspace worker(int w) const noexcept { return Workspace{workers + static_cast<std::size_t>(w) * per_worker, per_worker}; }
  };

  template <class Backend>
  Layout layout(std::int32_t batch, std::int64_t total_pages, std::int32_t max_pages, std::int32_t max_budget, const GqaMap& gqa,
                std::int32_t head_dim, int workers) const noexcept {
    const auto n = static_cast<std::size_t>(std::max(max_pages, 1));
    const auto G = static_cast<std::size_t>(std::max(gqa.group_size(), 1));
    // A row is scored only when its pages outnumber its budget B, and then keeps
    // B - 1 < n of them: a budget above the page count needs no larger buffer.
    const auto budget = static_cast<std::size_t>(std::clamp(max_budget, 1, std::max(max_pages, 1)));
    WorkspacePlan topk;
    topk.add<float>(n).add<std::int32_t>(G * budget);
    topk.add_bytes(Backend::topk_workspace(static_cast<std::int64_t>(n)));
    Layout l;
    const bool any = total_pages > 0;
    l.q = any ? static_cast<std::size_t>(batch) * static_cast<std::size_t>(gqa.num_q_heads) * static_cast<std::size_t>(head_dim) : 0;
    l.scores = static_cast<std::size_t>(total_pages) * static_cast<std::size_t>(gqa.num_q_heads);
    l.offsets = static_cast<std::size_t>(batch) + 1;
    l.per_worker = align_up(std::max(topk.bytes, align_up(Backend::page_bounds_workspace(gqa.num_q_heads, head_dim))));
    if constexpr (kDeviceBackend<Backend>) {
      // select_sequence_on_device: group-reduced bounds of every kv head, the selection of every row.
      WorkspacePlan dev;
      dev.add<float>(static_cast<std::size_t>(gqa.num_kv_heads) * n).add<std::int32_t>(static_cast<std::size_t>(gqa.num_q_heads) * budget);
      dev.add_bytes(Backend::topk_workspace(static_cast<std::int64_t>(n)));
      l.per_worker = std::max(l.per_worker, align_up(dev.bytes));
    }
    l.workers = workers;
    return l;
  }
  static Scratch carve(const Layout& l, Workspace ws) noexcept {
    WorkspaceCarver c(ws);
    Scratch s;
    s.q = c.take<float>(l.q);
    s.scores = c.take<float>(l.scores);
    s.score_start = c.take<std::int64_t>(l.offsets);
    s.chunk_start = c.take<std::int64_t>(l.offsets);
    s.workers = c.take<std::byte>(l.per_worker * static_cast<std::size_t>(l.workers));
    s.per_worker = l.per_worker;
    return s;
  }

  /// Every check of `select` before anything is written (on a device: shapes and
  /// the CSR structure only, see `select_on_device`); the GQA map and workspace
  /// layout for `workers` workers.
  template <class Backend, class Tq, class Tm>
  Status check_select(int layer, const TensorView<const Tq, 3>& queries, const PageTable& table, std::int32_t page_size,
                      const PageMetaView<Tm>& meta, const PageSelection& out, Workspace ws, int workers, bool on_device, GqaMap* gqa,
                      Layout* lay) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params(page_size));
    if (on_device && params_.gqa == QuestGqa::kUnion)
      return Status::error(StatusCode::kUnsupported, "quest: gqa=union (rows of data-dependent length) is not offered on a device backend");
    KVP_RETURN_IF_ERROR(queries.check_basic(kName, "queries"));
    if (on_device) {
      KVP_REQUIRE(!queries.device().is_host(),
                  "quest: queries is a host tensor; a device backend reads device memory (tag the view kCUDA)");
    } else {
      KVP_REQUIRE(queries.device().is_host(), "quest: queries is a device tensor; this entry point reads host memory");
      KVP_RETURN_IF_ERROR(detail::check_finite_3d(kName, "queries", queries));
    }
    KVP_RETURN_IF_ERROR(meta.check_basic(kName, on_device));
    KVP_RETURN_IF_ERROR(GqaMap::make(queries.extent(1), meta.num_kv_heads, kName, gqa));
    KVP_REQUIRE(queries.extent(2) == meta.head_dim, "quest: queries head_dim is %lld, the metadata has %d",
                static_cast<long long>(queries.extent(2)), meta.head_dim);
    KVP_REQUIRE(queries.extent(0) == table.batch, "quest: queries has %lld sequences, the page table has batch %d",
                static_cast<long long>(queries.extent(0)), table.batch);
    KVP_RETURN_IF_ERROR(table.validate(kName, meta.num_pages, page_size, /*check_ids=*/!on_device));
    if (!on_device) KVP_RETURN_IF_ERROR(check_no_repeated_page(table));
    const std::int64_t H = heads_per_seq(*gqa);
    KVP_RETURN_IF_ERROR(
        out.check_output(kName, static_cast<std::int64_t>(table.batch) * H, output_capacity(layer, table, page_size, *gqa)));
    *lay = layout<Backend>(table.batch, scored_pages(layer, table, page_size), max_pages(table), max_page_budget(table, page_size), *gqa,
                           meta.head_dim, workers);
    return check_workspace(kName, ws, lay->total());
  }

  /// The selection's row offsets and last-page lengths (host arrays on every backend).
  void write_row_offsets(int layer, const PageTable& table, std::int32_t page_size, const GqaMap& gqa, PageSelection& out) const noexcept {
    const std::int64_t H = heads_per_seq(gqa);
    std::int64_t pos = 0;
    out.indptr[0] = 0;
    for (std::int32_t b = 0; b < table.batch; ++b) {
      const std::int64_t cap = row_capacity(layer, table.num_pages(b), page_budget(table, b, page_size), gqa);
      for (std::int64_t h = 0; h < H; ++h) {
        pos += cap;
        out.indptr[b * H + h + 1] = static_cast<std::int32_t>(pos);
        out.last_page_len[b * H + h] = cap == 0 ? 0 : table.last_page_len[b];
      }
    }
  }

  template <class Tk, class Tm>
  static Status validate_keys(const PagedKVView<const Tk>& keys, const PageMetaView<Tm>& meta, bool on_device = false) noexcept {
    KVP_RETURN_IF_ERROR(keys.validate(kName, /*need_values=*/false, /*check_ids=*/!on_device));
    if (on_device) {
      KVP_REQUIRE(!keys.device.is_host(), "quest: keys are host memory; a device backend reads device memory (tag the view kCUDA)");
    } else {
      KVP_REQUIRE(keys.device.is_host(), "quest: keys are on a device; this entry point reads host memory");
    }
    return meta.validate(kName, keys.num_pages, keys.num_kv_heads, keys.head_dim, on_device);
  }

  /// Folds tokens [len - append, len) of every (sequence, kv head) page by
  /// page (append == nullptr: every token).
  template <class Backend, class Tk, class Tm>
  static void fold_tokens(const PagedKVView<const Tk>& keys, PageMetaView<Tm> meta, const std::int32_t* append,
                          const ExecContext& ctx) noexcept {
    const std::int32_t P = keys.page_size;
    ctx.parallel_for(static_cast<std::int64_t>(keys.table.batch) * keys.num_kv_heads, [&](std::int64_t item, int) {
      const auto b = static_cast<std::int32_t>(item / keys.num_kv_heads);
      const auto h = static_cast<std::int32_t>(item % keys.num_kv_heads);
      const std::int64_t len = keys.seq_len(b);
      for (std::int64_t t = append ? len - append[b] : 0; t < len;) {
        const auto slot = static_cast<std::int32_t>(t % P);
        const std::int64_t rows = std::min<std::int64_t>(P - slot, len - t);
        const std::int32_t page = keys.table.page_of(b, t, P);
        Backend::page_meta_fold(keys.k_ptr(page, h, slot), keys.k_strides.slot, rows, keys.head_dim, meta.max_row(page, h),
                                meta.min_row(page, h), /*fresh=*/slot == 0);
        t += rows;
      }
    });
  }

  /// One (sequence b, kv head g): the rows of its G query heads, or its own
  /// row, from the sequence's bounds `scores` ((Hq, n-1), when scored).
  template <class Backend>
  void select_item(int layer, std::int32_t B, const GqaMap& gqa, const PageTable& table, std::int32_t b, std::int32_t g,
                   const float* scores, PageSelection& out, WorkspaceCarver& c) const noexcept {
    const std::int32_t n = table.num_pages(b), G = gqa.group_size();
    if (n == 0) return;
    const std::int32_t* pages = table.indices + table.indptr[b];
    const bool per_q = params_.gqa == QuestGqa::kPerQueryHead;
    const std::int64_t first_row = per_q ? static_cast<std::int64_t>(b) * gqa.num_q_heads + static_cast<std::int64_t>(g) * G
                                         : static_cast<std::int64_t>(b) * gqa.num_kv_heads + g;
    const std::int32_t rows = per_q ? G : 1;
    auto write_row = [&](std::int64_t row, const std::int32_t* sel, std::int32_t k, bool add_last) {
      // Through the backend's id ops (a device backend writes whole sequences in select_sequence_on_device).
      std::int32_t* dst = out.indices + out.indptr[row];
      std::int32_t* lg = out.logical ? out.logical + out.indptr[row] : nullptr;
      Backend::gather_ids(pages, sel, k, dst);
      if (lg) {
        if (sel)
          Backend::copy_ids(sel, k, lg);
        else
          Backend::iota(lg, 0, k);
      }
      if (add_last) {
        Backend::gather_ids(pages + (n - 1), nullptr, 1, dst + k);
        if (lg) Backend::iota(lg + k, n - 1, 1);
      }
      return k + (add_last ? 1 : 0);
    };
    if (!scored(layer, n, B)) {
      for (std::int32_t r = 0; r < rows; ++r) write_row(first_row + r, nullptr, n, false);
      return;
    }
    // Top-(B-1) of the n-1 complete pages' bounds, for each query head of the group.
    const std::int64_t m = n - 1, k = B - 1;
    const float* bounds = scores + static_cast<std::int64_t>(g) * G * m;
    float* reduced = c.take<float>(static_cast<std::size_t>(m));
    std::int32_t* sel = c.take<std::int32_t>(static_cast<std::size_t>(G) * std::max<std::int64_t>(k, 1));
    const Workspace topk_ws{c.take<std::byte>(Backend::topk_workspace(m)), Backend::topk_workspace(m)};
    switch (params_.gqa) {
      case QuestGqa::kPerQueryHead:
        for (std::int32_t j = 0; j < G; ++j) {
          Backend::topk(bounds + j * m, m, k, sel, topk_ws);
          write_row(first_row + j, sel, static_cast<std::int32_t>(k), true);
        }
        break;
      case QuestGqa::kGroupMax:
      case QuestGqa::kGroupSum:
        Backend::group_reduce(bounds, G, m, m, params_.gqa == QuestGqa::kGroupMax ? GroupReduce::kMax : GroupReduce::kSum, reduced);
        Backend::topk(reduced, m, k, sel, topk_ws);
        write_row(first_row, sel, static_cast<std::int32_t>(k), true);
        break;
      case QuestGqa::kUnion: {
        for (std::int32_t j = 0; j < G; ++j) Backend::topk(bounds + j * m, m, k, sel + j * k, topk_ws);
        std::sort(sel, sel + G * k);
        const auto u = static_cast<std::int32_t>(std::unique(sel, sel + G * k) - sel);
        // Mark the unused tail of the reserved row; compact_rows drops it.
        const std::int32_t used = write_row(first_row, sel, u, true);
        std::fill(out.indices + out.indptr[first_row] + used, out.indices + out.indptr[first_row + 1], -1);
        break;
      }
    }
  }

  /// kUnion: every row was written at its reserved offset, its unused tail
  /// marked -1; move the rows down so the CSR is dense (entries only move to
  /// lower addresses, so a forward pass is safe).
  static void compact_rows(PageSelection& out) noexcept {
    std::int32_t write = 0, start = 0;
    for (std::int64_t r = 0; r < out.num_rows; ++r) {
      const std::int32_t end = out.indptr[r + 1];
      std::int32_t i = start;
      for (; i < end && out.indices[i] >= 0; ++i, ++write) {
        out.indices[write] = out.indices[i];
        if (out.logical) out.logical[write] = out.logical[i];
      }
      out.indptr[r + 1] = write;
      start = end;
    }
  }

  Params params_{};
};

static_assert(SelectionPolicy<Quest, float, float, float> && SelectionPolicy<Quest, half, half, half> &&
              SelectionPolicy<Quest, float, half, float>);

KVP_NAMESPACE_END
