// SPDX-License-Identifier: Apache-2.0
// Quest-page lookahead: a next-step page prefetcher built on Quest's page
// upper bounds (Quest, Tang et al., ICML 2024, arXiv 2406.10774) and on
// ShadowKV's reuse of the previous step's selection (Sun et al., arXiv
// 2410.21465); reference/algorithms-other.md §1, §3.3 and §6.4
// (`QuestPagePolicy`).
//
// Algorithm (per layer, after step t's attention, for step t + 1):
//   1. pages_t+1 ~ Quest's selection for the *current* query q_t with a
//      lookahead budget B_L (`page_budget`, last page included): per row
//      (query head or kv head, `gqa`) top-(B_L - 1) of
//      U[p] = sum_i max(q_i M_p,i, q_i m_p,i) plus the last page. The query
//      changes little from one step to the next, so the pages that bound it
//      highest now are the likeliest to be read next.
//   2. Reuse (`reuse_previous`): pages step t read and (1) does not name stay
//      requested with the lowest priority: they are already on the device
//      (ShadowKV keeps its buffer), so requesting them costs nothing and keeps
//      them from being evicted.
//   3. Misses (pages step t + 1 reads outside the request) are fetched on
//      demand by the engine; `observe` counts them as late misses.
//
// Choices, where the references leave them open:
//  * Priority. The fraction of the sequence's rows (heads) whose top-(B_L - 1)
//    holds the page (1 = every head wants it), reused-only pages 0; ties ->
//    the more recent page (history.hpp's order). Quest itself has no order.
//  * Budget. `page_budget` >= the engine's selection budget B predicts a
//    superset margin for the query's drift; B_L = B predicts exactly the
//    current selection (then the prediction equals the reuse set when the
//    engine's selection is Quest's).
//  * Dense layers (`dense_layers`, Quest: 2): every page is predicted, since
//    Quest reads them all there.
//  * GQA: as Quest's `gqa` (kPerQueryHead: the reference; the request is the
//    union over the sequence's rows, a page is one transfer for every head).
//  * The metadata is Quest's (`PageMetaView`, kept current by `Quest::on_append`
//    on the same pool); the policy only reads it.
//
// Cost: one Quest select per layer and step (O(pages * Hq * d)) plus the
// request sort (O(E log E), E = table entries). Thread-safety: const; the
// state is the caller's.
//
// On a device backend (`predict` / `observe` with e.g. backend::Cuda) the
// queries, the metadata, `table.indices`, the history's buffer (built with
// `PrefetchHistory::wrap`, cleared with `reset(ctx)`), the request's pages and
// priorities, the counters of `observe` and the workspace are device memory;
// `table.indptr` / `last_page_len` and the observed selection's `indptr` are
// host arrays, as for Quest. Per sequence: Quest's device selection, then one
// vote-count launch over its rows' logical pages; then one launch turning the
// votes into priorities (the same fp32 additions as the host, so the same
// bits), and the request (a radix sort of the (priority, entry) keys and one
// block listing each page at its most urgent entry). Nothing returns to the
// host: the request's size is device data (`PrefetchRequest::device_size`,
// `size` = -1) and its pages past the size are -1. At most
// `kMaxDeviceRows` selection rows per sequence (query heads with kPerQueryHead,
// else kv heads); the same requests and counters as on the host, bit for bit.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kvpolicy/policy/concepts.hpp"
#include "kvpolicy/policy/params.hpp"
#include "kvpolicy/policy/prefetch/history.hpp"
#include "kvpolicy/policy/selection/quest.hpp"

KVP_NAMESPACE_BEGIN

struct QuestLookaheadParams {
  std::int32_t page_budget = 32;  ///< pages predicted per row from the bound, last page included
  bool reuse_previous = true;     ///< keep the previous step's pages requested (priority 0)
  std::int32_t dense_layers = 2;  ///< layers predicted whole (Quest: 2)
  QuestGqa gqa = QuestGqa::kPerQueryHead;

  static constexpr auto fields() noexcept {
    return std::tuple{param_field<&QuestLookaheadParams::page_budget>("page_budget", "pages predicted per head, last page included"),
                      param_field<&QuestLookaheadParams::reuse_previous>("reuse_previous", "keep the previous step's pages"),
                      param_field<&QuestLookaheadParams::dense_layers>("dense_layers", "layers predicted whole"),
                      param_field<&QuestLookaheadParams::gqa>("gqa", "how Quest's selection meets grouped-query attention")};
  }
};

/// Caller-owned state of one layer: Quest's page metadata (read only) and the hit-rate history.
template <class Tm>
struct QuestLookaheadState {
  PageMetaView<const Tm> meta{};
  PrefetchHistory history{};
};

template <class Tm = float>
class QuestLookahead {
 public:
  using Params = QuestLookaheadParams;
  using State = QuestLookaheadState<Tm>;
  static constexpr const char* kName = "quest_lookahead";

  constexpr QuestLookahead() noexcept = default;
  explicit constexpr QuestLookahead(const Params& p) noexcept : params_(p) {}
  constexpr const Params& params() const noexcept { return params_; }

  Status validate_params() const noexcept {
    KVP_RETURN_IF_ERROR(check_enum_fields(kName, params_));
    KVP_REQUIRE(params_.page_budget >= 1, "quest_lookahead: page_budget is %d, must be >= 1 (the last page)", params_.page_budget);
    KVP_REQUIRE(params_.dense_layers >= 0, "quest_lookahead: dense_layers is %d, must be >= 0", params_.dense_layers);
    return quest().validate_params();
  }

  /// Worst-case size query: `shape.batch` sequences of at most
  /// `shape.max_kv_len` tokens in `page_size`-token pages. Output: up to one
  /// request entry per page of the batch.
  template <class Backend>
  Requirements requirements(const Context<Backend>& ctx, const ProblemShape& shape, std::int32_t page_size) const noexcept {
    Requirements r;
    r.status = validate_params();
    if (!r.status.is_ok()) return r;
    const Requirements q = quest().requirements(ctx, shape, page_size);
    if (!q.status.is_ok()) {
      r.status = q.status;
      return r;
    }
    const std::int64_t entries = shape.batch * ((shape.max_kv_len + page_size - 1) / page_size);
    if constexpr (kDeviceBackend<Backend>) {
      r.workspace_bytes = device_layout<Backend>(q.workspace_bytes, q.output.capacity, entries).total();
    } else {
      r.workspace_bytes = layout(q.workspace_bytes, q.output.rows, q.output.capacity, entries).total();
    }
    r.output = OutputSize{1, entries};
    r.query_window = 1;
    return r;
  }

  /// Predicts the pages the next observation of `next.layer` reads from the
  /// current queries `next.queries` (batch, Hq, d) post-RoPE over `next.table`.
  /// Validates everything (the table against the metadata's pool, the
  /// workspace, `out` for every page of the table) before writing `out` or the
  /// history.
  template <class Backend, class Tq>
  Status predict(const Context<Backend>& ctx, State& st, const DecodeInput<Tq>& next, PrefetchRequest& out) const noexcept {
    if constexpr (kDeviceBackend<Backend>)
      return predict_on_device(ctx, st, next, out);
    else
      return predict_on_host(ctx, st, next, out);
  }

  /// Counts the pages the step actually read (`actual`, any rows over the
  /// pool) into `counters` and advances the history (history.hpp).
  /// On a device backend `actual.indices`, the history and `counters` are
  /// device memory (`actual.indptr` a host array): one launch, nothing read back.
  template <class Backend>
  Status observe(const Context<Backend>& ctx, State& st, const PageSelection& actual, PrefetchCounters& counters) const noexcept {
    return prefetch_detail::observe(ctx, kName, st.history, actual, counters);
  }

  /// Selection rows per sequence a device prediction handles (their offsets live on the host stack).
  static constexpr std::int64_t kMaxDeviceRows = 1024;

  /// The Quest selection the prediction runs (page budget B_L).
  constexpr Quest quest() const noexcept {
    QuestParams qp;
    qp.page_budget = params_.page_budget;
    qp.dense_layers = params_.dense_layers;
    qp.gqa = params_.gqa;
    return Quest(qp);
  }

 private:
  template <class Backend, class Tq>
  Status predict_on_host(const Context<Backend>& ctx, State& st, const DecodeInput<Tq>& next, PrefetchRequest& out) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_RETURN_IF_ERROR(st.meta.check_basic(kName));
    KVP_REQUIRE(st.meta.num_pages == st.history.num_pages, "quest_lookahead: metadata has %d pages, the history %d", st.meta.num_pages,
                st.history.num_pages);
    std::int32_t G = 0;
    KVP_RETURN_IF_ERROR(prefetch_detail::check_predict(kName, st.history, next.queries, next.table, next.page_size, st.meta.num_kv_heads,
                                                       st.meta.head_dim, out, &G));
    const Quest q = quest();
    Quest::Plan plan;
    const ProblemShape shape{.num_q_heads = next.queries.extent(1), .num_kv_heads = st.meta.num_kv_heads, .head_dim = st.meta.head_dim};
    KVP_RETURN_IF_ERROR(q.plan(ctx, next, shape, plan));
    const std::int64_t entries = prefetch_detail::table_entries(next.table);
    const Layout lay = layout(plan.requirements.workspace_bytes, plan.requirements.output.rows, plan.requirements.output.capacity, entries);
    KVP_RETURN_IF_ERROR(check_workspace(kName, ctx.workspace, lay.total()));
    WorkspaceCarver c(ctx.workspace);
    std::byte* qws = c.take<std::byte>(lay.quest_bytes);
    PageSelection sel{c.take<std::int32_t>(lay.rows + 1),
                      c.take<std::int32_t>(lay.cap),
                      c.take<std::int32_t>(lay.rows),
                      c.take<std::int32_t>(lay.cap),
                      lay.rows,
                      lay.cap};
    float* prio = c.take<float>(lay.entries);
    std::uint64_t* keys = c.take<std::uint64_t>(lay.entries);
    KVP_RETURN_IF_ERROR(q.select(ctx.with_workspace(Workspace{qws, lay.quest_bytes}), plan, next, st.meta, sel));

    std::fill(prio, prio + entries, prefetch_detail::kNotPredicted);
    const std::int64_t H = sel.num_rows / std::max<std::int32_t>(next.table.batch, 1);
    for (std::int64_t r = 0; r < sel.num_rows; ++r) {
      const auto b = static_cast<std::int32_t>(r / H);
      for (std::int32_t i = sel.indptr[r]; i < sel.indptr[r + 1]; ++i) {
        const std::int64_t e = next.table.indptr[b] + sel.logical[i];
        prio[e] = (std::isnan(prio[e]) ? 0.0f : prio[e]) + 1.0f / static_cast<float>(H);
      }
    }
    if (params_.reuse_previous) prefetch_detail::add_reuse(st.history, next.table, 0.0f, prio);
    prefetch_detail::write_request(st.history, next.table, prio, keys, out);
    return Status::ok();
  }

  /// `predict` on a device backend (header comment, "On a device backend").
  template <class Backend, class Tq>
  Status predict_on_device(const Context<Backend>& ctx, State& st, const DecodeInput<Tq>& next, PrefetchRequest& out) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_RETURN_IF_ERROR(st.meta.check_basic(kName, /*on_device=*/true));
    KVP_REQUIRE(st.meta.num_pages == st.history.num_pages, "quest_lookahead: metadata has %d pages, the history %d", st.meta.num_pages,
                st.history.num_pages);
    std::int32_t G = 0;
    KVP_RETURN_IF_ERROR(prefetch_detail::check_predict(kName, st.history, next.queries, next.table, next.page_size, st.meta.num_kv_heads,
                                                       st.meta.head_dim, out, &G, /*on_device=*/true));
    const Quest q = quest();
    const ProblemShape shape{.num_q_heads = next.queries.extent(1), .num_kv_heads = st.meta.num_kv_heads, .head_dim = st.meta.head_dim};
    Quest::Plan plan;
    KVP_RETURN_IF_ERROR(q.plan(ctx, next, shape, plan));
    const PageTable& table = next.table;
    const std::int64_t entries = prefetch_detail::table_entries(table);
    const std::int64_t rows = table.batch == 0 ? 0 : plan.requirements.output.rows / table.batch;
    KVP_REQUIRE(rows <= kMaxDeviceRows, "quest_lookahead: %lld selection rows per sequence on a device, at most %lld",
                static_cast<long long>(rows), static_cast<long long>(kMaxDeviceRows));
    const DeviceLayout lay = device_layout<Backend>(plan.requirements.workspace_bytes, plan.requirements.output.capacity, entries);
    KVP_RETURN_IF_ERROR(check_workspace(kName, ctx.workspace, lay.total()));
    WorkspaceCarver c(ctx.workspace);
    std::byte* qws = c.take<std::byte>(lay.quest_bytes);
    std::int32_t* sel_ids = c.take<std::int32_t>(lay.cap);
    std::int32_t* sel_logical = c.take<std::int32_t>(lay.cap);
    std::int32_t* counts = c.take<std::int32_t>(lay.entries);
    float* prio = c.take<float>(lay.entries);
    std::byte* rws = c.take<std::byte>(lay.request_bytes);

    // Every sequence's plan before anything is enqueued, so a refusal changes nothing.
    for (std::int32_t b = 0; b < table.batch; ++b) {
      if (table.num_pages(b) == 0) continue;
      const std::int32_t sub_indptr[2] = {0, table.num_pages(b)};
      Quest::Plan pb;
      KVP_RETURN_IF_ERROR(q.plan(ctx, sequence_input(next, b, sub_indptr), shape, pb));
      KVP_REQUIRE(pb.requirements.workspace_bytes <= lay.quest_bytes && pb.requirements.output.capacity <= lay.cap &&
                      pb.requirements.output.rows == rows,
                  "quest_lookahead: sequence %d's selection does not fit the batch's plan", b);
    }
    const detail::BackendCall<Backend> call(ctx);
    KVP_RETURN_IF_ERROR(call.begin());
    std::int32_t indptr[kMaxDeviceRows + 1], last[kMaxDeviceRows];
    for (std::int32_t b = 0; b < table.batch; ++b) {
      const std::int32_t n = table.num_pages(b);
      if (n == 0) continue;
      const std::int32_t sub_indptr[2] = {0, n};
      const DecodeInput<Tq> in = sequence_input(next, b, sub_indptr);
      Quest::Plan pb;
      KVP_RETURN_IF_ERROR(q.plan(ctx, in, shape, pb));
      const PageSelection sel{indptr, sel_ids, last, sel_logical, rows, pb.requirements.output.capacity};
      KVP_RETURN_IF_ERROR(q.select(ctx.with_workspace(Workspace{qws, lay.quest_bytes}), pb, in, st.meta, sel));
      const std::int64_t len = rows == 0 ? 0 : indptr[1] - indptr[0];  // Quest's rows of one sequence have one length
      ops::prefetch_votes<Backend>(sel_logical, rows, len, len, n, counts + table.indptr[b]);
    }
    const float unit = 1.0f / static_cast<float>(std::max<std::int64_t>(rows, 1));
    const std::int64_t reuse_step = params_.reuse_previous && st.history.step >= 1 ? st.history.step - 1 : -1;
    ops::prefetch_vote_priorities<Backend>(counts, table.indices, entries, unit, st.history.used_at, reuse_step, 0.0f, prio);
    prefetch_detail::write_request_on_device<Backend>(st.history, table, prio, out, Workspace{rws, lay.request_bytes});
    return call.end();
  }

  /// Sequence b of `next` as a batch of one (`sub_indptr` = {0, its pages}).
  template <class Tq>
  static DecodeInput<Tq> sequence_input(const DecodeInput<Tq>& next, std::int32_t b, const std::int32_t* sub_indptr) noexcept {
    DecodeInput<Tq> in = next;
    in.queries = next.queries.narrow(0, b, 1);
    in.table = PageTable{sub_indptr, next.table.indices + next.table.indptr[b], next.table.last_page_len + b, 1};
    return in;
  }

  struct DeviceLayout {
    std::size_t quest_bytes = 0, request_bytes = 0;
    std::int64_t cap = 0, entries = 0;
    std::size_t total() const noexcept {
      WorkspacePlan p;
      p.add_bytes(quest_bytes).add<std::int32_t>(static_cast<std::size_t>(cap)).add<std::int32_t>(static_cast<std::size_t>(cap));
      p.add<std::int32_t>(static_cast<std::size_t>(entries)).add<float>(static_cast<std::size_t>(entries)).add_bytes(request_bytes);
      return p.total();
    }
  };
  template <class Backend>
  static DeviceLayout device_layout(std::size_t quest_bytes, std::int64_t cap, std::int64_t entries) noexcept {
    return DeviceLayout{quest_bytes, ops::prefetch_request_workspace<Backend>(entries), std::max<std::int64_t>(cap, 1), entries};
  }

  struct Layout {
    std::size_t quest_bytes = 0;
    std::int64_t rows = 0, cap = 0, entries = 0;
    std::size_t total() const noexcept {
      WorkspacePlan p;
      p.add_bytes(quest_bytes).add<std::int32_t>(static_cast<std::size_t>(rows + 1)).add<std::int32_t>(static_cast<std::size_t>(cap));
      p.add<std::int32_t>(static_cast<std::size_t>(rows)).add<std::int32_t>(static_cast<std::size_t>(cap));
      p.add<float>(static_cast<std::size_t>(entries)).add<std::uint64_t>(static_cast<std::size_t>(entries));
      return p.total();
    }
  };
  static Layout layout(std::size_t quest_bytes, std::int64_t rows, std::int64_t cap, std::int64_t entries) noexcept {
    return Layout{quest_bytes, rows, cap, entries};
  }

  Params params_{};
};

static_assert(PrefetchPolicy<QuestLookahead<float>, float> && PrefetchPolicy<QuestLookahead<half>, half>);

KVP_NAMESPACE_END
