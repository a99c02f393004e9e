// SPDX-License-Identifier: Apache-2.0
// SnapKV — "SnapKV: LLM Knows What You are Looking for Before Generation"
// (Li et al., 2024, arXiv 2404.14469).
//
// Algorithm (per sequence, per kv head g, at the end of prefill):
//   1. A[q, i, j] = softmax_j(<Q[q, T-w+i], K[g, j]> * scale), causal, fp32, for
//      the w observation-window queries of every query head q of the group;
//      the softmax runs over all T keys (window included).
//   2. s[q, j] = mean_i A[q, i, j] (kvpress, Ada-KV) or sum_i (original), j < L = T-w.
//   3. pool along j (avg with count_include_pad, or max; odd kernel, pad k/2)
//      and reduce the G query heads of the group (mean / max / sum), in the
//      order `pool -> group` (kvpress) or `group -> pool` (Ada-KV GQA,
//      KVCache-Factory kv_head mode).
//   4. keep the top (n_keep - w) past tokens plus the window.
//
// Choices where the references differ (reference §3, §15), all selectable:
//  * Budget. `SnapKVParams::kvpress(r)`: n_keep = int(T * (1 - r)) counts the
//    window (kvpress). `SnapKVParams::original(C)`: capacity C includes the
//    window, prompts with T <= C are kept whole (FasterDecoding/SnapKV).
//    `Budget::tokens(B).protected_on_top()` keeps B past tokens + the window.
//  * When the budget is smaller than the window, the most recent n_keep window
//    tokens are kept (kvpress keeps an arbitrary subset: its window ties at max+1).
//  * GQA. Selection is per kv head (memory savings survive). The original
//    repository repeats K/V to every query head and selects per query head; a
//    per-query-head cache is expressible by calling with num_q_heads ==
//    num_kv_heads on repeated views.
//  * Precision. Softmax and all reductions are fp32; the references cast the
//    softmax back to the model dtype (bf16/fp16) before reducing, which creates
//    ties. Our results equal theirs on fp32 data.
//  * Ties. Higher score first; equal scores keep the more recent token; NaN
//    scores rank last (see `score_order_key`). Kept ids are ascending.
//  * Non-finite inputs. A NaN/Inf query is rejected (queries are a window,
//    cheap to scan). Keys are not scanned: a NaN/Inf key yields NaN scores
//    for the affected rows; those tokens are evicted first. Indices stay valid.
//
// Lookahead queries (LAQ, and any predicted or pseudo query source): a
// `ScoreInput` with `lookahead = n` carries `window + n` query rows per head,
// the w prompt queries followed by n queries of the future positions
// T, T+1, ...; the scores then reduce over all w + n rows (kMean divides by
// w + n) while only the last w keys stay protected. With lookahead queries
// the window may be 0 (LAQ: only pseudo queries). Where those rows sit for the
// causal mask is `lookahead_mask` (lookahead.hpp): kCorrected (default) puts
// the prompt rows at T-w.. and lets every lookahead row see all T keys;
// kReference reproduces the LAQ repository's mask, which places all w + n rows
// at the last w + n prompt positions.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>

#include "kvpolicy/core/gqa.hpp"
#include "kvpolicy/policy/budget.hpp"
#include "kvpolicy/policy/lookahead.hpp"
#include "kvpolicy/policy/policy.hpp"

KVP_NAMESPACE_BEGIN

enum class ReduceOrder : std::uint8_t {
  kPoolThenGroup,  ///< kvpress: pool each query head's scores, then reduce the group
  kGroupThenPool,  ///< Ada-KV gqa_support / KVCache-Factory kv_head: reduce, then pool
};
inline constexpr EnumName<ReduceOrder> kReduceOrderNames[] = {{"pool_then_group", ReduceOrder::kPoolThenGroup},
                                                              {"group_then_pool", ReduceOrder::kGroupThenPool}};
constexpr std::span<const EnumName<ReduceOrder>> enum_names(ReduceOrder) noexcept { return kReduceOrderNames; }

struct SnapKVParams {
  std::int32_t window = 64;  ///< w: observation window (last w prompt queries); 0 only with lookahead queries
  std::int32_t kernel = 5;   ///< pooling kernel (odd)
  Pooling pooling = Pooling::kAvg;
  WindowReduce window_reduce = WindowReduce::kMean;
  GroupReduce group_reduce = GroupReduce::kMean;
  ReduceOrder order = ReduceOrder::kPoolThenGroup;
  Budget budget = Budget::compression_ratio(0.5);
  float scale = 0.0f;                                        ///< logit scale; 0 means 1/sqrt(head_dim)
  LookaheadMask lookahead_mask = LookaheadMask::kCorrected;  ///< causal positions of lookahead query rows (ScoreInput::lookahead)

  static constexpr auto fields() noexcept {
    return std::tuple{param_field<&SnapKVParams::window>("window", "observation window: the last w prompt queries"),
                      param_field<&SnapKVParams::kernel>("kernel", "pooling kernel (odd)"),
                      param_field<&SnapKVParams::pooling>("pooling", "pooling along tokens"),
                      param_field<&SnapKVParams::window_reduce>("window_reduce", "reduction over the window"),
                      param_field<&SnapKVParams::group_reduce>("group_reduce", "reduction over a GQA group"),
                      param_field<&SnapKVParams::order>("order", "pool and group-reduce order"),
                      budget_field<&SnapKVParams::budget>(),
                      param_field<&SnapKVParams::scale>("scale", "logit scale, 0 = 1/sqrt(head_dim)"),
                      param_field<&SnapKVParams::lookahead_mask>("lookahead_mask", "causal mask of lookahead query rows")};
  }

  /// kvpress `SnapKVPress(compression_ratio=r, window_size, kernel_size)`.
  static constexpr SnapKVParams kvpress(double r, std::int32_t window = 64, std::int32_t kernel = 5) noexcept {
    return SnapKVParams{
        window, kernel, Pooling::kAvg, WindowReduce::kMean, GroupReduce::kMean, ReduceOrder::kPoolThenGroup, Budget::compression_ratio(r),
        0.0f};
  }
  /// FasterDecoding/SnapKV `SnapKVCluster(window_size, max_capacity_prompt=C, kernel_size, pooling)`
  /// at kv-head granularity (group mean before pooling, as KVCache-Factory's kv_head mode).
  static constexpr SnapKVParams original(std::int64_t capacity, std::int32_t window = 32, std::int32_t kernel = 7,
                                         Pooling pooling = Pooling::kMax) noexcept {
    return SnapKVParams{window,
                        kernel,
                        pooling,
                        WindowReduce::kSum,
                        GroupReduce::kMean,
                        ReduceOrder::kGroupThenPool,
                        Budget::tokens(capacity).clamp_to_length(),
                        0.0f};
  }
};

class SnapKV {
 public:
  using Params = SnapKVParams;
  static constexpr const char* kName = "snapkv";

  constexpr SnapKV() noexcept = default;
  explicit constexpr SnapKV(const Params& p) noexcept : params_(p) {}
  constexpr const Params& params() const noexcept { return params_; }

  /// Parameter checks independent of the inputs.
  Status validate_params() const noexcept {
    KVP_RETURN_IF_ERROR(check_enum_fields(kName, params_));
    KVP_REQUIRE(params_.window >= 0, "snapkv: window is %d, must be >= 0 (0 only with lookahead queries)", params_.window);
    KVP_REQUIRE(params_.kernel >= 1 && params_.kernel % 2 == 1, "snapkv: pooling kernel is %d, must be odd and >= 1", params_.kernel);
    KVP_REQUIRE(std::isfinite(params_.scale) && params_.scale >= 0.0f, "snapkv: scale is %g, must be finite and >= 0",
                static_cast<double>(params_.scale));
    return params_.budget.validate("snapkv");
  }

  /// Tokens kept per kv head for a sequence of `kv_len` tokens (-1 if the budget is invalid for it).
  std::int64_t kept_count(std::int64_t kv_len) const noexcept {
    std::int64_t n = 0;
    if (!params_.budget.resolve(kName, kv_len, std::min<std::int64_t>(params_.window, kv_len), &n).is_ok()) return -1;
    return n;
  }

  /// Tokens scored +inf by rule: the observation window.
  std::int64_t protected_tokens(std::int64_t kv_len) const noexcept { return std::min<std::int64_t>(params_.window, kv_len); }

  /// The size query: workspace for `score` and `evict` on inputs of at most
  /// `shape`, KeepSet rows (batch x num_kv_heads) and capacity, the window.
  template <class Backend>
  Requirements requirements(const Context<Backend>& ctx, const ProblemShape& shape) const noexcept {
    Status st = validate_params();
    if (st.is_ok()) st = detail::check_problem_shape(kName, shape);
    if (st.is_ok() && params_.window > shape.max_kv_len)
      st = KVP_INVALID("snapkv: window %d is larger than max_kv_len %lld", params_.window, static_cast<long long>(shape.max_kv_len));
    std::int64_t n = 0;
    if (st.is_ok()) st = params_.budget.resolve(kName, shape.max_kv_len, params_.window, &n);
    return detail::uniform_requirements(st, workspace_bytes<Backend>(shape, ctx.exec), shape, shape.num_kv_heads, n, params_.window);
  }

  /// Per-kv-head scores of one sequence: out (num_kv_heads, kv_len); past tokens
  /// get their pooled, group-reduced score, window tokens +inf (always kept).
  template <class Backend, class Tq, class Tk>
  Status score(const Context<Backend>& cx, const ScoreInput<Tq, Tk>& in, ScoreMap out) const noexcept {
    const Workspace ws = cx.workspace;
    const ExecContext& ctx = cx.exec;
    ProblemShape shape;
    KVP_RETURN_IF_ERROR(validate_batch(std::span<const ScoreInput<Tq, Tk>>(&in, 1), &shape, /*scoring=*/true, kDeviceBackend<Backend>));
    KVP_RETURN_IF_ERROR(out.check_basic(kName, "scores"));
    KVP_REQUIRE(out.extent(0) == shape.num_kv_heads && out.extent(1) == in.keys.kv_len(),
                "snapkv: scores has shape (%lld, %lld), expected (num_kv_heads=%lld, kv_len=%lld)", static_cast<long long>(out.extent(0)),
                static_cast<long long>(out.extent(1)), static_cast<long long>(shape.num_kv_heads),
                static_cast<long long>(in.keys.kv_len()));
    const std::size_t per = per_worker_bytes<Backend>(shape);
    KVP_RETURN_IF_ERROR(check_workspace(kName, ws, detail::WorkerSlices::bytes(per, ctx.workers())));
    const detail::BackendCall<Backend> call(cx);
    KVP_RETURN_IF_ERROR(call.begin());
    const auto slices = detail::WorkerSlices::carve(ws, per);
    const std::int64_t T = in.keys.kv_len(), w = params_.window, L = T - w;
    ctx.parallel_for(shape.num_kv_heads, [&](std::int64_t h, int worker) {
      WorkspaceCarver c(slices.slice(worker));
      float* s = c.take<float>(static_cast<std::size_t>(std::max<std::int64_t>(L, 1)));
      float* row = out.data() + h * out.stride(0);
      const std::int64_t past = std::max<std::int64_t>(L, 0);
      if (L > 0) {
        score_head<Backend>(in, shape, h, s, c);
        Backend::copy_strided(s, L, row, out.stride(1));
      }
      Backend::fill(row + past * out.stride(1), T - past, out.stride(1), kProtectedScore);
    });
    return call.end();
  }

  /// Eviction decision for a batch: keep row `b * num_kv_heads + h`. The
  /// batch is split into (sequence, kv head) items over `cx.exec`, each with
  /// its worker's workspace slice, so ragged lengths and few kv heads per
  /// rank still fill the pool; results do not depend on the worker count.
  template <class Backend, class Tq, class Tk>
  Status evict(const Context<Backend>& cx, std::span<const ScoreInput<Tq, Tk>> batch, KeepSet out) const noexcept {
    const Workspace ws = cx.workspace;
    const ExecContext& ctx = cx.exec;
    ProblemShape shape;
    KVP_RETURN_IF_ERROR(validate_batch(batch, &shape, /*scoring=*/false, kDeviceBackend<Backend>));
    const std::size_t per = per_worker_bytes<Backend>(shape);
    KVP_RETURN_IF_ERROR(check_workspace(kName, ws, detail::WorkerSlices::bytes(per, ctx.workers())));
    const std::int64_t H = shape.num_kv_heads;
    const detail::BackendCall<Backend> call(cx);
    KVP_RETURN_IF_ERROR(call.begin());
    KVP_RETURN_IF_ERROR(detail::write_uniform_indptr(kName, out, static_cast<std::int64_t>(batch.size()), H,
                                                     [&](std::int64_t b) { return kept_count(batch[b].keys.kv_len()); }));
    if constexpr (kDeviceBackend<Backend>) {
      // One sequence at a time (a device context has one worker): every kv head
      // scored into one (H, L) block, then one top-k launch and one iota launch
      // for all its heads. Same ids as the per-head path.
      WorkspaceCarver base(ws);
      float* s_all = base.take<float>(static_cast<std::size_t>(H * std::max<std::int64_t>(shape.max_kv_len - params_.window, 1)));
      const Workspace rest = base.rest();
      for (std::size_t b = 0; b < batch.size(); ++b) {
        const auto& in = batch[b];
        const std::int64_t row0 = static_cast<std::int64_t>(b) * H, T = in.keys.kv_len(), w = params_.window;
        std::int32_t* dst0 = out.indices + out.indptr[row0];
        const std::int64_t n_keep = out.indptr[row0 + 1] - out.indptr[row0];  // uniform over the sequence's rows
        if (n_keep >= T) {
          Backend::iota_rows(dst0, n_keep, H, 0, T);
          continue;
        }
        const std::int64_t n_win = std::min(n_keep, w), n_past = n_keep - n_win, L = T - w;
        if (n_past > 0) {
          for (std::int64_t h = 0; h < H; ++h) {
            WorkspaceCarver c(rest);  // reused per head: the stream orders the launches
            score_head<Backend>(in, shape, h, s_all + h * L, c);
          }
          Backend::topk_rows_strided(s_all, L, H, L, n_past, dst0, n_keep, rest);
        }
        Backend::iota_rows(dst0 + n_past, n_keep, H, T - n_win, n_win);
      }
      return call.end();
    }
    const auto slices = detail::WorkerSlices::carve(ws, per);
    ctx.parallel_for(static_cast<std::int64_t>(batch.size()) * H, [&](std::int64_t row, int worker) {
      const auto& in = batch[static_cast<std::size_t>(row / H)];
      const std::int64_t h = row % H, T = in.keys.kv_len(), w = params_.window;
      std::int32_t* dst = out.indices + out.indptr[row];
      const std::int64_t n_keep = out.indptr[row + 1] - out.indptr[row];
      if (n_keep >= T) {
        Backend::iota(dst, 0, T);
        return;
      }
      const std::int64_t n_win = std::min(n_keep, w), n_past = n_keep - n_win, L = T - w;
      if (n_past > 0) {
        WorkspaceCarver c(slices.slice(worker));
        float* s = c.take<float>(static_cast<std::size_t>(L));
        score_head<Backend>(in, shape, h, s, c);
        Backend::topk(s, L, n_past, dst, c.rest());
      }
      Backend::iota(dst + n_past, T - n_win, n_win);
    });
    return call.end();
  }

  /// Single-sequence convenience.
  template <class Backend, class Tq, class Tk>
  Status evict(const Context<Backend>& cx, const ScoreInput<Tq, Tk>& in, KeepSet out) const noexcept {
    return evict(cx, std::span<const ScoreInput<Tq, Tk>>(&in, 1), out);
  }

  /// Per-head scoring hook for composed policies (`Budgeted`, compose.hpp, splits
  /// a batch over (sequence, kv head) items through it): row[0..kv_len) = the
  /// scores `score` writes for kv head h, window +inf. Preconditions: `in` is
  /// part of a batch that passed `validate` with shape `shape`, `ws` holds
  /// `score_row_workspace<Backend>(shape)` bytes. No checks, no parallelism.
  template <class Backend>
  std::size_t score_row_workspace(const ProblemShape& shape) const noexcept {
    return per_worker_bytes<Backend>(shape);
  }
  template <class Backend, class Tq, class Tk>
  void score_row(const ScoreInput<Tq, Tk>& in, const ProblemShape& shape, std::int64_t h, float* row, Workspace ws) const noexcept {
    const std::int64_t T = in.keys.kv_len(), L = T - params_.window;
    WorkspaceCarver c(ws);
    if (L > 0) score_head<Backend>(in, shape, h, row, c);
    const std::int64_t past = std::max<std::int64_t>(L, 0);
    Backend::fill(row + past, T - past, 1, kProtectedScore);
  }

  /// The input checks of `evict` / `score` alone (params, shapes, budget), and
  /// the batch's shape: lets policies that compose `score` (Ada-KV, PyramidKV)
  /// reject a bad batch before writing any output.
  template <class Tq, class Tk>
  Status validate(std::span<const ScoreInput<Tq, Tk>> batch, ProblemShape* shape, bool on_device = false) const noexcept {
    return validate_batch(batch, shape, /*scoring=*/true, on_device);
  }

 private:
  template <class Backend>
  std::size_t workspace_bytes(const ProblemShape& shape, const ExecContext& ctx) const noexcept {
    return detail::WorkerSlices::bytes(per_worker_bytes<Backend>(shape), ctx.workers());
  }

  template <class Backend>
  std::size_t per_worker_bytes(const ProblemShape& s) const noexcept {
    const std::int64_t G = s.num_kv_heads > 0 ? std::max<std::int64_t>(1, s.num_q_heads / s.num_kv_heads) : 1;
    const std::int64_t w = params_.window, T = std::max<std::int64_t>(s.max_kv_len, 1), L = std::max<std::int64_t>(T - w, 1);
    const std::int64_t rows = std::max<std::int64_t>({s.q_len, w, 1});  // window + lookahead query rows
    WindowScoreShape ws{G, rows, s.head_dim, T, L, T - w, 1.0f, params_.window_reduce};
    WorkspacePlan plan;
    plan.add<float>(static_cast<std::size_t>(L));                      // final scores
    plan.add<float>(static_cast<std::size_t>(G * rows * s.head_dim));  // fp32 queries
    plan.add<float>(static_cast<std::size_t>(G * L));                  // raw window scores
    plan.add<float>(static_cast<std::size_t>(G * L));                  // pooled / reduced
    plan.add_bytes(std::max(Backend::window_scores_workspace(ws), Backend::topk_workspace(L)));
    // A device backend scores every kv head of a sequence before one batched top-k.
    if constexpr (kDeviceBackend<Backend>) plan.add<float>(static_cast<std::size_t>(std::max<std::int64_t>(s.num_kv_heads - 1, 0) * L));
    return plan.bytes;
  }

  template <class Tq, class Tk>
  Status validate_batch(std::span<const ScoreInput<Tq, Tk>> batch, ProblemShape* shape, bool scoring = false,
                        bool on_device = false) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_REQUIRE(!batch.empty(), "snapkv: batch is empty");
    const PagedKVView<const Tk>* last_paged = nullptr;
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const auto& in = batch[b];
      KVP_RETURN_IF_ERROR(detail::check_queries_and_keys(kName, in.queries, in.keys, &last_paged, on_device));
      KVP_REQUIRE(in.lookahead >= 0, "snapkv: lookahead is %lld, must be >= 0 (sequence %zu)", static_cast<long long>(in.lookahead), b);
      KVP_REQUIRE(in.queries.extent(1) == params_.window + in.lookahead,
                  "snapkv: queries has %lld rows per head, expected window=%d + lookahead=%lld (sequence %zu)",
                  static_cast<long long>(in.queries.extent(1)), params_.window, static_cast<long long>(in.lookahead), b);
      KVP_REQUIRE(in.queries.extent(1) >= 1, "snapkv: no query rows (window 0 needs lookahead queries; sequence %zu)", b);
      const std::int64_t T = in.keys.kv_len();

      KVP_REQUIRE(T <= INT32_MAX, "snapkv: kv_len %lld exceeds the int32 token id range", static_cast<long long>(T));
      KVP_REQUIRE(params_.window <= T, "snapkv: window %d is larger than kv_len %lld (sequence %zu)", params_.window,
                  static_cast<long long>(T), b);
      std::int64_t n = 0;
      KVP_RETURN_IF_ERROR(params_.budget.resolve(kName, T, params_.window, &n));
      // The reference lookahead mask puts every row on a prompt position; a prompt kept whole is never scored.
      KVP_REQUIRE(params_.lookahead_mask == LookaheadMask::kCorrected || in.queries.extent(1) <= T || (n >= T && !scoring),
                  "snapkv: the reference lookahead mask places %lld query rows on the last prompt positions, kv_len is %lld "
                  "(sequence %zu)",
                  static_cast<long long>(in.queries.extent(1)), static_cast<long long>(T), b);
      KVP_RETURN_IF_ERROR(detail::check_same_heads(
          kName, b, ProblemShape{in.queries.extent(0), in.keys.kv_heads(), in.keys.head_dim(), T, in.queries.extent(1)}, shape));
    }
    return Status::ok();
  }

  /// Scores of the L = T - w past tokens of kv head h into s[0..L).
  template <class Backend, class Tq, class Tk>
  void score_head(const ScoreInput<Tq, Tk>& in, const ProblemShape& shape, std::int64_t h, float* s, WorkspaceCarver& c) const noexcept {
    const std::int64_t G = shape.num_q_heads / shape.num_kv_heads, w = params_.window, d = shape.head_dim;
    const std::int64_t T = in.keys.kv_len(), L = T - w, rows = in.queries.extent(1);
    float* q = c.take<float>(static_cast<std::size_t>(G * rows * d));
    float* raw = c.take<float>(static_cast<std::size_t>(G * L));
    float* tmp = c.take<float>(static_cast<std::size_t>(G * L));
    Backend::widen_queries(in.queries, h * G, G, 0, rows, q);
    const float scale = params_.scale > 0.0f ? params_.scale : 1.0f / std::sqrt(static_cast<float>(d));
    const WindowScoreShape ss{G, rows, d, T, L, lookahead_query_pos0(params_.lookahead_mask, T, w, rows), scale, params_.window_reduce};
    Backend::window_scores(ss, q, in.keys.rows(h), raw, c.rest());
    if (params_.order == ReduceOrder::kPoolThenGroup) {
      if constexpr (kDeviceBackend<Backend>)
        Backend::pool1d_rows(raw, G, L, L, params_.kernel, params_.pooling, tmp);  // one launch
      else
        for (std::int64_t g = 0; g < G; ++g) Backend::pool1d(raw + g * L, L, params_.kernel, params_.pooling, tmp + g * L);
      Backend::group_reduce(tmp, G, L, L, params_.group_reduce, s);
    } else {
      Backend::group_reduce(raw, G, L, L, params_.group_reduce, tmp);
      Backend::pool1d(tmp, L, params_.kernel, params_.pooling, s);
    }
  }

  Params params_{};
};

static_assert(Scorer<SnapKV, ScoreInput<float, float>> && EvictionPolicy<SnapKV, ScoreInput<float, half>>);

KVP_NAMESPACE_END
