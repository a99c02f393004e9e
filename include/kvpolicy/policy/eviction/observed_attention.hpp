// SPDX-License-Identifier: Apache-2.0
// Observed attention — one-shot prefill eviction by the attention every key
// received from all prompt queries. Two published variants (reference §6.4, §6.5):
//
//  * kvpress `ObservedAttentionPress` (`ObservedAttentionParams::kvpress(r)`):
//      score[g, j] = mean over the G query heads h of group g of
//                    (sum_i A[h, i, j]) / (T - j)       (T - j queries see key j)
//    keep n_keep = int(T * (1 - r)), no protected tokens.
//  * KVCache-Factory `H2OKVCluster` (`ObservedAttentionParams::kvcache_factory_h2o(C, w)`),
//    which that repository calls "H2O": score[j] = sum_i A[i, j] (no
//    normalisation) for j < T - w, keep the top C - w plus the last w tokens;
//    prompts with T <= C are kept whole.
// Neither is the H2O paper's algorithm, which is online (accumulate every decode
// step, evict every step): that is `H2O` in h2o.hpp.
// kvpress versions: the presets follow the reference snapshot (0.5.4), whose
// n_keep = int(T * (1 - r)) can be 0; kvpress >= 0.5.5 keeps at least one token:
// `params.budget = params.budget.keep_at_least_one()` (the fixture tests use it).
//
// A[h, i, j] is the full causal prefill attention (softmax_j over j <= i of
// <q_i, k_j> * scale, fp32). It is never materialised: the column sums are
// accumulated block by block of `query_block` queries with Backend::window_scores
// (q_pos0 = the block's first position, kSum), O(T) memory per kv head. Engines
// whose attention kernel returns column sums pass them as `ScoreInput::column_sums`.
//
// Choices: the kvpress mean of per-head normalised sums is computed as the
// group reduction of the sums, then divided by T - j (equal up to rounding).
// GQA for the Factory variant: its kv_head mode reduces the group by
// `gqa_score_agg` (mean by default; sum / max selectable); its default
// query_head mode is a per-query-head cache, i.e. a call with repeated K/V and
// num_q_heads == num_kv_heads. If the budget is smaller than the window, the
// most recent n_keep window tokens are kept. Ties: higher score, then the more
// recent token (`score_order_key`); kept ids ascending. NaN scores rank last.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>

#include "kvpolicy/core/gqa.hpp"
#include "kvpolicy/policy/budget.hpp"
#include "kvpolicy/policy/policy.hpp"

KVP_NAMESPACE_BEGIN

struct ObservedAttentionParams {
  Budget budget = Budget::compression_ratio(0.5);
  std::int32_t window = 0;  ///< last w tokens always kept (inside the budget)
  bool normalize = true;    ///< divide the column sums by T - j (kvpress); false: raw sums (KVCache-Factory)
  GroupReduce group_reduce = GroupReduce::kMean;
  std::int32_t query_block = 64;  ///< queries per window_scores call: memory / work granularity, not semantics
  float scale = 0.0f;             ///< logit scale; 0 means 1/sqrt(head_dim)

  static constexpr auto fields() noexcept {
    return std::tuple{budget_field<&ObservedAttentionParams::budget>(),
                      param_field<&ObservedAttentionParams::window>("window", "last w tokens always kept"),
                      param_field<&ObservedAttentionParams::normalize>("normalize", "divide the column sums by T - j (kvpress)"),
                      param_field<&ObservedAttentionParams::group_reduce>("group_reduce", "reduction over a GQA group"),
                      param_field<&ObservedAttentionParams::query_block>("query_block", "queries per block (granularity only)"),
                      param_field<&ObservedAttentionParams::scale>("scale", "logit scale, 0 = 1/sqrt(head_dim)")};
  }

  /// kvpress `ObservedAttentionPress(compression_ratio=r)`.
  static constexpr ObservedAttentionParams kvpress(double r) noexcept {
    return ObservedAttentionParams{Budget::compression_ratio(r), 0, true, GroupReduce::kMean, 64, 0.0f};
  }
  /// KVCache-Factory `H2OKVCluster(max_capacity_prompt=C, window_size=w)` in kv_head mode
  /// (run_longbench.py: w = 8).
  static constexpr ObservedAttentionParams kvcache_factory_h2o(std::int64_t capacity, std::int32_t window = 8,
                                                               GroupReduce agg = GroupReduce::kMean) noexcept {
    return ObservedAttentionParams{Budget::tokens(capacity).clamp_to_length(), window, false, agg, 64, 0.0f};
  }
};

class ObservedAttention {
 public:
  using Params = ObservedAttentionParams;
  static constexpr const char* kName = "observed_attention";

  constexpr ObservedAttention() noexcept = default;
  explicit constexpr ObservedAttention(const Params& p) noexcept : params_(p) {}
  constexpr const Params& params() const noexcept { return params_; }

  Status validate_params() const noexcept {
    KVP_RETURN_IF_ERROR(check_enum_fields(kName, params_));
    KVP_REQUIRE(params_.window >= 0, "observed_attention: window is %d, must be >= 0", params_.window);
    KVP_REQUIRE(params_.query_block >= 1, "observed_attention: query_block is %d, must be >= 1", params_.query_block);
    KVP_REQUIRE(std::isfinite(params_.scale) && params_.scale >= 0.0f, "observed_attention: scale is %g, must be finite and >= 0",
                static_cast<double>(params_.scale));
    return params_.budget.validate(kName);
  }

  std::int64_t kept_count(std::int64_t kv_len) const noexcept {
    std::int64_t n = 0;
    if (!validate_params().is_ok() || !params_.budget.resolve(kName, kv_len, std::min<std::int64_t>(params_.window, kv_len), &n).is_ok())
      return -1;
    return n;
  }

  /// Tokens scored +inf by rule: the window.
  std::int64_t protected_tokens(std::int64_t kv_len) const noexcept { return std::min<std::int64_t>(params_.window, kv_len); }

  /// The size query: workspace for `score` / `evict` (head_dim = 0 sizes the
  /// column-sum path alone), KeepSet rows (batch x num_kv_heads), query window
  /// = the whole prompt (q_len = max_kv_len; 0 when the engine passes column sums).
  template <class Backend>
  Requirements requirements(const Context<Backend>& ctx, const ProblemShape& shape) const noexcept {
    return detail::budget_requirements(
        kName, validate_params(), shape, params_.budget, [this](std::int64_t n) { return protected_tokens(n); },
        detail::WorkerSlices::bytes(per_worker_bytes<Backend>(shape), ctx.exec.workers()), shape.num_kv_heads,
        shape.head_dim > 0 ? shape.max_kv_len : 0);
  }

  /// Scores of one sequence, out (num_kv_heads, kv_len); window tokens +inf.
  template <class Backend, class Tq, class Tk, class Tp>
  Status score(const Context<Backend>& cx, const ScoreInput<Tq, Tk, Tp>& in, ScoreMap out) const noexcept {
    const Workspace ws = cx.workspace;
    const ExecContext& ctx = cx.exec;
    KVP_RETURN_IF_ERROR(validate_input(in, 0, kDeviceBackend<Backend>));
    KVP_RETURN_IF_ERROR(out.check_basic(kName, "scores"));
    const ProblemShape shape = shape_of(in);
    const std::int64_t H = shape.num_kv_heads, T = shape.max_kv_len, L = T - std::min<std::int64_t>(params_.window, T);
    KVP_REQUIRE(out.extent(0) == H && out.extent(1) == T,
                "observed_attention: scores has shape (%lld, %lld), expected (num_kv_heads=%lld, kv_len=%lld)",
                static_cast<long long>(out.extent(0)), static_cast<long long>(out.extent(1)), static_cast<long long>(H),
                static_cast<long long>(T));
    const std::size_t per = per_worker_bytes<Backend>(shape);
    KVP_RETURN_IF_ERROR(check_workspace(kName, ws, detail::WorkerSlices::bytes(per, ctx.workers())));
    const detail::BackendCall<Backend> call(cx);
    KVP_RETURN_IF_ERROR(call.begin());
    const auto slices = detail::WorkerSlices::carve(ws, per);
    ctx.parallel_for(H, [&](std::int64_t h, int worker) {
      WorkspaceCarver c(slices.slice(worker));
      const float* s = score_head<Backend>(in, h, c);
      float* row = out.data() + h * out.stride(0);
      Backend::copy_strided(s, L, row, out.stride(1));
      Backend::fill(row + L * out.stride(1), T - L, out.stride(1), kProtectedScore);
    });
    return call.end();
  }

  /// Eviction decision for a batch: keep row `b * num_kv_heads + h`. Each
  /// sequence gives either its prompt queries (q_len == kv_len; the column
  /// sums are recomputed block by block) or the engine's `column_sums`
  /// (num_q_heads, kv_len), summed over all prompt queries; then `keys` only
  /// gives the shape (`KVSource::shape_only`).
  template <class Backend, class Tq, class Tk, class Tp>
  Status evict(const Context<Backend>& cx, std::span<const ScoreInput<Tq, Tk, Tp>> batch, KeepSet out) const noexcept {
    const Workspace ws = cx.workspace;
    const ExecContext& ctx = cx.exec;
    KVP_REQUIRE(!batch.empty(), "observed_attention: batch is empty");
    ProblemShape shape;
    for (std::size_t b = 0; b < batch.size(); ++b) {
      KVP_RETURN_IF_ERROR(validate_input(batch[b], b, kDeviceBackend<Backend>));
      KVP_RETURN_IF_ERROR(detail::check_same_heads(kName, b, shape_of(batch[b]), &shape));
      shape.q_len = shape.head_dim > 0 ? shape.max_kv_len : 0;
    }
    const std::size_t per = per_worker_bytes<Backend>(shape);
    KVP_RETURN_IF_ERROR(check_workspace(kName, ws, detail::WorkerSlices::bytes(per, ctx.workers())));
    const detail::BackendCall<Backend> call(cx);
    KVP_RETURN_IF_ERROR(call.begin());
    const std::int64_t H = shape.num_kv_heads;
    KVP_RETURN_IF_ERROR(detail::write_uniform_indptr(kName, out, static_cast<std::int64_t>(batch.size()), H,
                                                     [&](std::int64_t b) { return kept_count(batch[b].keys.kv_len()); }));
    const auto slices = detail::WorkerSlices::carve(ws, per);
    ctx.parallel_for(static_cast<std::int64_t>(batch.size()) * H, [&](std::int64_t row, int worker) {
      const auto& in = batch[static_cast<std::size_t>(row / H)];
      WorkspaceCarver c(slices.slice(worker));
      const std::int64_t T = in.keys.kv_len();
      const float* s = out.row_size(row) < T ? score_head<Backend>(in, row % H, c) : nullptr;
      choose<Backend>(s, T, out, row, c);
    });
    return call.end();
  }

  template <class Backend, class Tq, class Tk, class Tp>
  Status evict(const Context<Backend>& cx, const ScoreInput<Tq, Tk, Tp>& in, KeepSet out) const noexcept {
    return evict(cx, std::span<const ScoreInput<Tq, Tk, Tp>>(&in, 1), out);
  }

 private:
  template <class Tq, class Tk, class Tp>
  static ProblemShape shape_of(const ScoreInput<Tq, Tk, Tp>& in) noexcept {
    if (in.has_column_sums()) return ProblemShape{in.column_sums.extent(0), in.keys.kv_heads(), 0, in.keys.kv_len(), 0};
    return ProblemShape{in.queries.extent(0), in.keys.kv_heads(), in.keys.head_dim(), in.keys.kv_len(), in.queries.extent(1)};
  }

  /// Per worker: fp32 query block, block output, per-head sums, final scores, op scratch.
  template <class Backend>
  std::size_t per_worker_bytes(const ProblemShape& s) const noexcept {
    const std::int64_t G = s.num_kv_heads > 0 ? std::max<std::int64_t>(1, s.num_q_heads / s.num_kv_heads) : 1;
    const std::int64_t T = std::max<std::int64_t>(s.max_kv_len, 1), B = std::min<std::int64_t>(params_.query_block, T);
    WorkspacePlan plan;
    plan.add<float>(static_cast<std::size_t>(G * T)).add<float>(static_cast<std::size_t>(T));  // sums, scores
    std::size_t op = Backend::topk_workspace(T);
    if (s.head_dim > 0) {
      plan.add<float>(static_cast<std::size_t>(G * B * s.head_dim)).add<float>(static_cast<std::size_t>(G * T));  // queries, block output
      // Sized for the last query block (q_pos0 = T - B): a backend's scratch may grow with
      // the causal offset (Cuda's logits tile holds q_pos0 + window columns).
      op = std::max(op, Backend::window_scores_workspace(WindowScoreShape{G, B, s.head_dim, T, T, T - B, 1.0f, WindowReduce::kSum}));
    }
    plan.add_bytes(op);
    return plan.bytes;
  }

  template <class Tq, class Tk, class Tp>
  Status validate_input(const ScoreInput<Tq, Tk, Tp>& in, std::size_t b, bool on_device = false) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_REQUIRE(in.lookahead == 0,
                "observed_attention: lookahead is %lld; it sums the prompt's own attention and takes no lookahead queries",
                static_cast<long long>(in.lookahead));
    if (in.has_column_sums()) {
      const auto& col = in.column_sums;
      KVP_RETURN_IF_ERROR(col.check_basic(kName, "column sums"));
      if (on_device) {
        KVP_REQUIRE(!col.device().is_host(),
                    "observed_attention: column sums is a host tensor; a device backend reads device memory (tag the view kCUDA)");
        if (in.keys.paged != nullptr) KVP_RETURN_IF_ERROR(in.keys.validate(kName, "keys", on_device));
      } else {
        KVP_REQUIRE(col.device().is_host(), "observed_attention: column sums is a device tensor; this entry point reads host memory");
        KVP_RETURN_IF_ERROR(in.keys.validate(kName, "keys"));
      }
      if (in.keys.paged != nullptr)  // lengths come from the page table: validate it before reading them (ids on the host only)
        KVP_RETURN_IF_ERROR(in.keys.paged->table.validate(kName, in.keys.paged->num_pages, in.keys.paged->page_size, !on_device));
      GqaMap gqa;
      KVP_RETURN_IF_ERROR(GqaMap::make(col.extent(0), in.keys.kv_heads(), kName, &gqa));
      const std::int64_t T = col.extent(1);
      KVP_REQUIRE(in.keys.kv_len() == T, "observed_attention: column sums cover %lld tokens, keys has kv_len %lld (sequence %zu)",
                  static_cast<long long>(T), static_cast<long long>(in.keys.kv_len()), b);
      KVP_REQUIRE(T <= INT32_MAX, "observed_attention: kv_len %lld exceeds the int32 token id range", static_cast<long long>(T));
      std::int64_t n = 0;
      return params_.budget.resolve(kName, T, std::min<std::int64_t>(params_.window, T), &n);
    }
    const PagedKVView<const Tk>** no_paged = nullptr;
    KVP_RETURN_IF_ERROR(detail::check_queries_and_keys(kName, in.queries, in.keys, no_paged, on_device));
    const std::int64_t T = in.keys.kv_len();
    KVP_REQUIRE(in.queries.extent(1) == T,
                "observed_attention: queries has %lld rows per head, expected one per prompt token (kv_len=%lld, sequence %zu)",
                static_cast<long long>(in.queries.extent(1)), static_cast<long long>(T), b);
    KVP_REQUIRE(T <= INT32_MAX, "observed_attention: kv_len %lld exceeds the int32 token id range", static_cast<long long>(T));
    std::int64_t n = 0;
    return params_.budget.resolve(kName, T, std::min<std::int64_t>(params_.window, T), &n);
  }

  /// Scores of kv head h (all T columns) from the block-wise causal column sums.
  template <class Backend, class Tq, class Tk, class Tp>
  const float* score_head(const ScoreInput<Tq, Tk, Tp>& in, std::int64_t h, WorkspaceCarver& c) const noexcept {
    if (in.has_column_sums()) {  // the engine's sums: widen, reduce the group, normalise
      const std::int64_t G = in.column_sums.extent(0) / in.keys.kv_heads(), T = in.keys.kv_len();
      float* acc = c.take<float>(static_cast<std::size_t>(G * T));
      float* s = c.take<float>(static_cast<std::size_t>(T));
      const auto& col = in.column_sums;  // as (Hq, 1, T): the engine's sums of kv head h's G query heads, widened
      Backend::widen_queries(TensorView<const Tp, 3>(col.data(), {col.extent(0), 1, T}, {col.stride(0), 0, col.stride(1)}, col.device()),
                             h * G, G, 0, 1, acc);
      finish<Backend>(acc, G, T, s);
      return s;
    }
    const std::int64_t G = in.queries.extent(0) / in.keys.kv_heads(), d = in.keys.head_dim(), T = in.keys.kv_len();
    const std::int64_t B = std::min<std::int64_t>(params_.query_block, T);
    float* acc = c.take<float>(static_cast<std::size_t>(G * T));
    float* s = c.take<float>(static_cast<std::size_t>(T));
    float* q = c.take<float>(static_cast<std::size_t>(G * B * d));
    float* blk = c.take<float>(static_cast<std::size_t>(G * T));
    Backend::fill(acc, G * T, 1, 0.0f);
    const float scale = params_.scale > 0.0f ? params_.scale : 1.0f / std::sqrt(static_cast<float>(d));
    for (std::int64_t q0 = 0; q0 < T; q0 += B) {
      const std::int64_t bw = std::min(B, T - q0), cols = q0 + bw;  // keys visible to the block
      Backend::widen_queries(in.queries, h * G, G, q0, bw, q);
      // Keys from `cols` on are masked for every query of the block: the op runs over the visible keys only
      // (the causal triangle, not the square; their exp(-inf) = 0 terms changed no sum, so no bit changes).
      Backend::window_scores(WindowScoreShape{G, bw, d, cols, cols, q0, scale, WindowReduce::kSum}, q, in.keys.rows(h), blk, c.rest());
      for (std::int64_t g = 0; g < G; ++g) Backend::add_rows(acc + g * T, blk + g * cols, cols);
    }
    finish<Backend>(acc, G, T, s);
    return s;
  }

  /// s[j] = group-reduce of the per-head sums, / (T - j) when normalising.
  template <class Backend>
  void finish(const float* acc, std::int64_t G, std::int64_t T, float* s) const noexcept {
    Backend::group_reduce(acc, G, T, T, params_.group_reduce, s);
    if (params_.normalize) Backend::divide_by_tail(s, T);
  }

  /// Keep row `row`: top (n - window part) past tokens + the most recent window tokens.
  template <class Backend>
  void choose(const float* s, std::int64_t T, KeepSet out, std::int64_t row, WorkspaceCarver& c) const noexcept {
    std::int32_t* dst = out.indices + out.indptr[row];
    const std::int64_t n = out.row_size(row);
    if (n >= T) {
      Backend::iota(dst, 0, T);
      return;
    }
    const std::int64_t w = std::min<std::int64_t>(params_.window, T), n_win = std::min(n, w), n_past = n - n_win;
    if (n_past > 0) Backend::topk(s, T - w, n_past, dst, c.rest());
    Backend::iota(dst + n_past, T - n_win, n_win);
  }

  Params params_{};
};

static_assert(Scorer<ObservedAttention, ScoreInput<float, float>> && EvictionPolicy<ObservedAttention, ScoreInput<float, half>> &&
              EvictionPolicy<ObservedAttention, ScoreInput<float, float, half>>);

KVP_NAMESPACE_END
