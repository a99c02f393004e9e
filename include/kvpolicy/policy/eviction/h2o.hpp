// SPDX-License-Identifier: Apache-2.0
// H2O — "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
// Language Models" (Zhang et al., NeurIPS 2023, arXiv 2306.14048), in the
// online "real drop" form of FMInference/H2O `utils_real_drop` (reference §6.1, §6.6).
//
// State (caller-owned, one per sequence and layer): `H2OState::scores`
// (state_heads, capacity), the attention each cache slot has received since it
// entered the cache, aligned with the K/V slots, and `length`, the slots in use.
// Per forward call (a prefill of q tokens or one decode step), after the call's
// attention output was computed over the full cache of n = length + q tokens:
//   1. update: c[h, j] = sum_i A[h, i, j] over the call's q query rows; slots
//      j < length add it to their score, the q new slots start from it.
//   2. evict:  if n > hh + recent, each head keeps its hh best scores among the
//      slots [0, n - recent) plus the recent slots [n - recent, n); the kept
//      slots (ascending) go to a KeepSet row for `apply/`, and the state row is
//      re-packed the same way, so scores stay aligned with the compacted K/V.
// `evict_for_space(num_coming)` makes room before a multi-token input.
// Budgets (`Budget`): hh and recent are token counts (`hh_size`, `recent_size`)
// or keep ratios of the prompt (`heavy_ratio`, `recent_ratio`, §6.2:
// int(ratio * prompt_len)); the prompt is the first update into an empty state
// (`H2OState::prompt_len`), so a ratio budget is fixed for the whole sequence.
// Probabilities come from the engine (`update` with ScoreInput::attention,
// (Hq, q, n) rows, or ScoreInput::column_sums, (Hq, n)) or are recomputed from
// the step's queries and the cached keys (ScoreInput::queries + keys,
// Backend::window_scores, kSum).
//
// Choices (the original is MHA-only and batch 1):
//  * GQA. Default `H2OGranularity::kKvHead`: one state row per kv head,
//    r[g, j] = sum over the G query heads of group g of c[h, j]
//    (`GroupReduce::kSum`, default) or their mean (`kMean`); selection per kv
//    head, so the cache stays at Hkv heads. `kQueryHead`: one state row per query
//    head, the original's layout; it needs a per-query-head cache (K/V repeated
//    G times), i.e. probabilities / queries / keys with as many heads as the state.
//  * Accumulation order, fp32 (probabilities may be fp16/bf16): c sums i
//    ascending, r sums the group ascending (then divides by G for kMean), the
//    state adds r. A test reproduces it bit for bit.
//  * Ties: higher score kept, equal scores keep the more recent slot, as
//    `score_order_key` (torch.topk's tie order is unspecified).
//  * evict_for_space: the original keeps candidates [0, n - recent + num_coming)
//    and recent [n - recent + num_coming, n) and crashes when num_coming > recent;
//    here the heavy part then shrinks by the excess (after appending, the cache
//    holds hh + recent), and num_coming > hh + recent is an error.
//  * Non-finite values: `update` is a streaming add and does not inspect values;
//    `evict` refuses a state holding NaN (naming head and slot) before writing.
//  * Not this algorithm: kvpress `ObservedAttentionPress` (one-shot, normalised by
//    T - j) and the KVCache-Factory one-shot "H2O"; both are in observed_attention.hpp.
//
// Cost per decode step: update O(Hq n) streaming add; evicting one slot is one
// min pass over the candidates plus a memmove of the state tail; larger
// evictions use Backend::topk. Thread-safety: const; distinct states may be
// updated concurrently; work on one state is split over heads via ExecContext.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kvpolicy/core/gqa.hpp"
#include "kvpolicy/policy/policy.hpp"

KVP_NAMESPACE_BEGIN

enum class H2OGranularity : std::uint8_t {
  kKvHead,     ///< one state row per kv head (GQA-aware, the default)
  kQueryHead,  ///< one state row per query head, over a per-query-head cache (original)
};

inline constexpr EnumName<H2OGranularity> kH2OGranularityNames[] = {{"kv_head", H2OGranularity::kKvHead},
                                                                    {"query_head", H2OGranularity::kQueryHead}};
constexpr std::span<const EnumName<H2OGranularity>> enum_names(H2OGranularity) noexcept { return kH2OGranularityNames; }

struct H2OParams {
  Budget heavy = Budget::tokens(4);              ///< heavy hitters kept per head (hh_size), or a ratio of the prompt
  Budget recent = Budget::tokens(512);           ///< most recent slots always kept (recent_size), or a ratio of the prompt
  GroupReduce group_reduce = GroupReduce::kSum;  ///< kKvHead: how a group's query heads combine (kSum / kMean)
  H2OGranularity granularity = H2OGranularity::kKvHead;
  float scale = 0.0f;  ///< logit scale when recomputing attention from queries; 0 means 1/sqrt(head_dim)

  static constexpr auto fields() noexcept {
    return std::tuple{budget_field<&H2OParams::heavy>("heavy", {"hh_size", "heavy_ratio", ""},
                                                      "heavy hitters per head: hh_size=n | heavy_ratio=f of the prompt"),
                      budget_field<&H2OParams::recent>("recent", {"recent_size", "recent_ratio", ""},
                                                       "recent slots: recent_size=n | recent_ratio=f of the prompt"),
                      param_field<&H2OParams::group_reduce>("group_reduce", "how a GQA group's query heads combine"),
                      param_field<&H2OParams::granularity>("granularity", "state rows per kv head or per query head"),
                      param_field<&H2OParams::scale>("scale", "logit scale, 0 = 1/sqrt(head_dim)")};
  }

  /// `H2OKVCache_LayerWise(hh_size, recent_size)` (class defaults 4 / 512;
  /// run_summarization.py uses 1024 / 1024).
  static constexpr H2OParams original(std::int64_t hh_size, std::int64_t recent_size) noexcept {
    return H2OParams{Budget::tokens(hh_size), Budget::tokens(recent_size), GroupReduce::kSum, H2OGranularity::kKvHead, 0.0f};
  }
  /// Budgets as ratios of the prompt length (§6.2, `heavy_ratio` / `recent_ratio`):
  /// int(ratio * prompt_len) each, the prompt being the first call into an empty state.
  static constexpr H2OParams from_prompt_ratios(double heavy_ratio, double recent_ratio) noexcept {
    return H2OParams{Budget::keep_ratio(heavy_ratio), Budget::keep_ratio(recent_ratio), GroupReduce::kSum, H2OGranularity::kKvHead, 0.0f};
  }
};

/// Caller-owned H2O state of one sequence (one layer).
struct H2OState {
  TensorView<float, 2> scores{};                      ///< (state_heads, capacity): accumulated attention per cache slot, rows contiguous
  std::int64_t length = 0;                            ///< slots in use; equals the cache length after each update / evict
  std::int64_t prompt_len = 0;                        ///< slots of the first update into the empty state (ratio budgets resolve against it)
  void reset() noexcept { length = prompt_len = 0; }  ///< new sequence (the original's _clean_scores)
};

class H2O {
 public:
  using Params = H2OParams;
  using State = H2OState;
  static constexpr const char* kName = "h2o";

  constexpr H2O() noexcept = default;
  explicit constexpr H2O(const Params& p) noexcept : params_(p) {}
  constexpr const Params& params() const noexcept { return params_; }
  /// Heavy-hitter and recent slots for a prompt of `prompt_len` tokens (token
  /// budgets ignore it; ratios are int(ratio * prompt_len)).
  constexpr std::int64_t heavy_size(std::int64_t prompt_len) const noexcept { return params_.heavy.total(prompt_len, 0); }
  constexpr std::int64_t recent_size(std::int64_t prompt_len) const noexcept { return params_.recent.total(prompt_len, 0); }
  /// hh + recent: the cache size an evict trims to.
  constexpr std::int64_t cache_size(std::int64_t prompt_len = 0) const noexcept { return heavy_size(prompt_len) + recent_size(prompt_len); }

  Status validate_params() const noexcept {
    KVP_RETURN_IF_ERROR(check_enum_fields(kName, params_));
    KVP_RETURN_IF_ERROR(params_.heavy.validate("h2o: heavy (hh_size / heavy_ratio)"));
    KVP_RETURN_IF_ERROR(params_.recent.validate("h2o: recent (recent_size / recent_ratio)"));
    KVP_REQUIRE(params_.heavy.kind != BudgetKind::kCompressionRatio && params_.recent.kind != BudgetKind::kCompressionRatio,
                "h2o: heavy / recent budgets are token counts or keep ratios of the prompt, not compression ratios");
    // Token budgets are <= 9e15 each (Budget::validate), so the sum cannot overflow int64;
    // ratio budgets are at most the prompt, itself within the int32 id range.
    const auto tokens = [](const Budget& b) { return b.kind == BudgetKind::kTokens ? static_cast<std::int64_t>(b.value) : 0; };
    KVP_REQUIRE(tokens(params_.heavy) + tokens(params_.recent) <= INT32_MAX,
                "h2o: hh_size + recent_size = %lld exceeds the int32 token id range",
                static_cast<long long>(tokens(params_.heavy) + tokens(params_.recent)));
    KVP_REQUIRE(params_.group_reduce != GroupReduce::kMax, "h2o: group_reduce kMax is not additive; use kSum or kMean");
    KVP_REQUIRE(std::isfinite(params_.scale) && params_.scale >= 0.0f, "h2o: scale is %g, must be finite and >= 0",
                static_cast<double>(params_.scale));
    return Status::ok();
  }

  /// Slots kept by an evict of a cache of n slots (-1 if invalid); ratio
  /// budgets resolve against `prompt_len` (< 0: n).
  std::int64_t kept_count(std::int64_t n, std::int64_t num_coming = 0, std::int64_t prompt_len = -1) const noexcept {
    const std::int64_t target = cache_size(prompt_len < 0 ? n : prompt_len) - num_coming;
    if (!validate_params().is_ok() || n < 0 || num_coming < 0 || target < 0) return -1;
    return std::min(n, target);
  }

  /// Rows of the state and of each KeepSet: kv heads (kKvHead) or query heads (kQueryHead).
  constexpr std::int64_t state_rows(const ProblemShape& s) const noexcept {
    return params_.granularity == H2OGranularity::kKvHead ? s.num_kv_heads : s.num_q_heads;
  }

  /// The size query for a cache of at most `shape.max_kv_len` slots and calls
  /// of at most `shape.q_len` queries: one workspace serves `update` (from
  /// queries when head_dim > 0; probabilities need none) and `evict`; the
  /// KeepSet has state_rows() rows of at most hh + recent slots; the query
  /// window is the call's q_len (queries path) or 0.
  template <class Backend>
  Requirements requirements(const Context<Backend>& ctx, const ProblemShape& shape) const noexcept {
    Status st = validate_params();
    if (st.is_ok()) st = detail::check_problem_shape(kName, shape);
    if (st.is_ok() && shape.batch != 1)
      st = KVP_INVALID("h2o: shape batch is %lld; the state is per sequence, call once per sequence", static_cast<long long>(shape.batch));
    const std::int64_t Hs = state_rows(shape);
    const std::size_t upd = shape.head_dim > 0 ? detail::WorkerSlices::bytes(update_per_worker<Backend>(shape), ctx.exec.workers()) : 0;
    const std::size_t ev = evict_workspace_bytes<Backend>(Hs, shape.max_kv_len, ctx.exec);
    return detail::uniform_requirements(st, std::max(upd, ev), shape, Hs, std::min(shape.max_kv_len, cache_size(shape.max_kv_len)),
                                        shape.head_dim > 0 ? shape.q_len : 0);
  }

  // ---- update ---------------------------------------------------------------

  /// Fold one forward call's attention into the state. The evidence, in the
  /// order checked:
  ///  * `obs.attention` (num_q_heads, q_len, kv_len): the call's probabilities,
  ///    kv_len = state.length + q_len (the q new slots start fresh); rows
  ///    contiguous along kv_len; no workspace;
  ///  * `obs.column_sums` (num_q_heads, kv_len): their sum over the call's
  ///    query rows (e.g. from the engine's attention kernel); the
  ///    kv_len - state.length new slots start fresh; no workspace;
  ///  * otherwise `obs.queries` (num_q_heads, q_len, d) at positions
  ///    kv_len - q_len .. kv_len - 1 and `obs.keys` (num_kv_heads, kv_len, d),
  ///    which already hold the call's tokens: the attention is recomputed
  ///    (Backend::window_scores, kQueryBlock queries at a time).
  /// For the first two, `obs.keys` may be empty (only the probabilities are read).
  template <class Backend, class Tq, class Tk, class Tp>
  Status update(const Context<Backend>& cx, State& state, const ScoreInput<Tq, Tk, Tp>& obs) const noexcept {
    const detail::BackendCall<Backend> call(cx);
    KVP_RETURN_IF_ERROR(call.begin());
    if (obs.has_attention()) {
      const auto& probs = obs.attention;
      KVP_RETURN_IF_ERROR(probs.check_basic(kName, "probabilities"));
      KVP_REQUIRE(probs.extent(1) >= 1, "h2o: probabilities has %lld query rows, must be >= 1", static_cast<long long>(probs.extent(1)));
      KVP_RETURN_IF_ERROR(update_impl<Backend>(state, probs, probs.extent(1), "probabilities", cx.exec));
      return call.end();
    }
    if (obs.has_column_sums()) {
      const auto& col = obs.column_sums;
      KVP_RETURN_IF_ERROR(col.check_basic(kName, "column sums"));
      const TensorView<const Tp, 3> as3(col.data(), {col.extent(0), 1, col.extent(1)}, {col.stride(0), 0, col.stride(1)}, col.device());
      KVP_RETURN_IF_ERROR(update_impl<Backend>(state, as3, col.extent(1) - state.length, "column sums", cx.exec));
      return call.end();
    }
    KVP_RETURN_IF_ERROR(update_from_queries<Backend>(state, obs, cx.workspace, cx.exec));
    return call.end();
  }

  // ---- evict ----------------------------------------------------------------

  /// Evict down to hh + recent: writes one KeepSet row per state row (ascending
  /// slots) and re-packs the state. Nothing is written on error.
  template <class Backend>
  Status evict(const Context<Backend>& cx, State& state, KeepSet out) const noexcept {
    return evict_for_space(cx, state, 0, out);
  }

  /// Evict so that `num_coming` more tokens fit in hh + recent.
  template <class Backend>
  Status evict_for_space(const Context<Backend>& cx, State& state, std::int64_t num_coming, KeepSet out) const noexcept {
    const detail::BackendCall<Backend> call(cx);
    KVP_RETURN_IF_ERROR(call.begin());
    KVP_RETURN_IF_ERROR(evict_impl<Backend>(state, num_coming, out, cx.workspace, cx.exec));
    return call.end();
  }

 private:
  template <class Backend, class Tq, class Tk, class Tp>
  Status update_from_queries(H2OState& state, const ScoreInput<Tq, Tk, Tp>& step, Workspace ws, const ExecContext& ctx) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_RETURN_IF_ERROR(check_state(state, kDeviceBackend<Backend>));
    KVP_REQUIRE(step.lookahead == 0, "h2o: lookahead is %lld; H2O accumulates the attention of real queries only",
                static_cast<long long>(step.lookahead));
    const PagedKVView<const Tk>** no_paged = nullptr;
    KVP_RETURN_IF_ERROR(detail::check_queries_and_keys(kName, step.queries, step.keys, no_paged, kDeviceBackend<Backend>));
    const std::int64_t Hq = step.queries.extent(0), Hkv = step.keys.kv_heads(), Hs = state.scores.extent(0);
    const std::int64_t q = step.queries.extent(1), n = step.keys.kv_len(), d = step.keys.head_dim();
    KVP_REQUIRE(Hkv == Hs, "h2o: keys has %lld kv heads, the state has %lld rows", static_cast<long long>(Hkv), static_cast<long long>(Hs));
    KVP_REQUIRE(params_.granularity == H2OGranularity::kKvHead || Hq == Hs,
                "h2o: queries has %lld heads, the per-query-head state has %lld rows (repeat K/V per query head)",
                static_cast<long long>(Hq), static_cast<long long>(Hs));
    KVP_REQUIRE(q >= 1, "h2o: queries has %lld rows per head, must be >= 1", static_cast<long long>(q));
    KVP_RETURN_IF_ERROR(check_step(state, n, q, "keys"));
    const ProblemShape shape{Hq, Hkv, d, n, q};
    const std::size_t per = update_per_worker<Backend>(shape);
    KVP_RETURN_IF_ERROR(check_workspace(kName, ws, detail::WorkerSlices::bytes(per, ctx.workers())));
    const auto slices = detail::WorkerSlices::carve(ws, per);
    const std::int64_t G = Hq / Hkv, len_prev = state.length;
    const float scale = params_.scale > 0.0f ? params_.scale : 1.0f / std::sqrt(static_cast<float>(d));
    ctx.parallel_for(Hs, [&](std::int64_t s, int worker) {
      // Column sums of the call's causal attention, kQueryBlock queries at a time
      // (a prefill never stages all its queries): col (G, n), blocks after the first add in.
      WorkspaceCarver c(slices.slice(worker));
      const std::int64_t B = std::min(q, kQueryBlock);
      float* qf = c.take<float>(static_cast<std::size_t>(G * B * d));
      float* col = c.take<float>(static_cast<std::size_t>(G * n));
      float* blk = q > B ? c.take<float>(static_cast<std::size_t>(G * n)) : col;
      // Keys after a block's last query are masked for all of its queries: each block runs over its visible
      // keys only (the causal triangle, not the square; the masked keys' exp(-inf) = 0 terms changed no sum),
      // into blk as (G, visible), added row by row into col (zeroed first: 0 + p is p, bit for bit).
      if (q > B) Backend::fill(col, G * n, 1, 0.0f);
      for (std::int64_t q0 = 0; q0 < q; q0 += B) {
        const std::int64_t bw = std::min(B, q - q0), vis = n - q + q0 + bw;
        Backend::widen_queries(step.queries, s * G, G, q0, bw, qf);
        float* out = q > B ? blk : col;  // a single block sees every key: straight into col
        Backend::window_scores(WindowScoreShape{G, bw, d, vis, vis, n - q + q0, scale, WindowReduce::kSum}, qf, step.keys.rows(s), out,
                               c.rest());
        if (q > B) {
          for (std::int64_t g = 0; g < G; ++g) Backend::add_rows(col + g * n, blk + g * vis, vis);
        }
      }
      Backend::accumulate_column_sums(&state.scores(s, 0), len_prev, TensorView<const float, 3>(col, {G, 1, n}, {n, 0, 1}), 0, G,
                                      mean_groups());
    });
    if (len_prev == 0) state.prompt_len = n;
    state.length = n;
    return Status::ok();
  }

  template <class Backend>
  std::size_t evict_workspace_bytes(std::int64_t state_heads, std::int64_t max_len, const ExecContext& ctx) const noexcept {
    if constexpr (kDeviceBackend<Backend>) {
      const std::int64_t n = std::max<std::int64_t>(max_len, 1);
      return WorkspacePlan{}.add_bytes(Backend::topk_workspace(n)).add_bytes(Backend::compact_row_workspace(n)).total();
    }
    return WorkspacePlan{}.add<std::int64_t>(static_cast<std::size_t>(2 * std::max<std::int64_t>(state_heads, 1))).total() +
           detail::WorkerSlices::bytes(Backend::topk_workspace(std::max<std::int64_t>(max_len, 1)), ctx.workers());
  }

  /// The decisions of `evict_impl` on a device backend (arguments validated):
  /// every state row edited in place by device ops, one (sequence, head) row
  /// after another on the context's stream. The host reads nothing of the
  /// state, so a state holding NaN is not refused here: a NaN slot ranks
  /// lowest under `score_order_key` and is evicted first.
  template <class Backend>
  Status evict_on_device(H2OState& state, std::int64_t num_coming, std::int64_t keep, KeepSet out, Workspace ws) const noexcept {
    const std::int64_t prompt = state.prompt_len > 0 ? state.prompt_len : state.length;
    const std::int64_t Hs = state.scores.extent(0), n = state.length;
    const std::int64_t recent = std::max<std::int64_t>(recent_size(prompt) - num_coming, 0);
    const std::int64_t heavy = keep - std::min(recent, keep), cand = n - recent;
    const std::int64_t nn = std::max<std::int64_t>(n, 1);
    WorkspaceCarver carve(ws);
    const Workspace topk_ws{carve.take<std::byte>(Backend::topk_workspace(nn)), Backend::topk_workspace(nn)};
    const Workspace compact_ws{carve.take<std::byte>(Backend::compact_row_workspace(nn)), Backend::compact_row_workspace(nn)};
    KVP_RETURN_IF_ERROR(detail::write_uniform_indptr(kName, out, 1, Hs, [&](std::int64_t) { return keep; }));
    for (std::int64_t s = 0; s < Hs; ++s) {
      float* row = state.scores.data() + s * state.scores.stride(0);
      std::int32_t* ids = out.indices + out.indptr[s];
      if (keep == n) {
        Backend::iota(ids, 0, n);
      } else if (n - keep == 1) {
        Backend::evict_lowest(row, cand, n, ids);
      } else {
        Backend::topk(row, cand, heavy, ids, topk_ws);
        Backend::iota(ids + heavy, n - keep + heavy, keep - heavy);
        Backend::compact_row(row, ids, keep, compact_ws);
      }
    }
    state.length = keep;
    return Status::ok();
  }

  template <class Backend>
  Status evict_impl(H2OState& state, std::int64_t num_coming, KeepSet out, Workspace ws, const ExecContext& ctx) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_RETURN_IF_ERROR(check_state(state, kDeviceBackend<Backend>));
    const std::int64_t prompt = state.prompt_len > 0 ? state.prompt_len : state.length, cache = cache_size(prompt);
    KVP_REQUIRE(num_coming >= 0 && num_coming <= cache, "h2o: num_coming %lld out of range [0, hh_size + recent_size = %lld]",
                static_cast<long long>(num_coming), static_cast<long long>(cache));
    const std::int64_t Hs = state.scores.extent(0), n = state.length, keep = kept_count(n, num_coming, prompt);
    KVP_RETURN_IF_ERROR(out.check_output(kName, Hs, Hs * keep));
    KVP_REQUIRE(Hs * keep <= INT32_MAX, "h2o: %lld kept slots overflow the int32 keep-set indices", static_cast<long long>(Hs * keep));
    KVP_RETURN_IF_ERROR(check_workspace(kName, ws, evict_workspace_bytes<Backend>(Hs, n, ctx)));
    if constexpr (kDeviceBackend<Backend>) {
      return evict_on_device<Backend>(state, num_coming, keep, out, ws);
    } else {
      return evict_on_host<Backend>(state, num_coming, keep, out, ws, ctx);
    }
  }

  template <class Backend>
  Status evict_on_host(H2OState& state, std::int64_t num_coming, std::int64_t keep, KeepSet out, Workspace ws,
                       const ExecContext& ctx) const noexcept {
    const std::int64_t prompt = state.prompt_len > 0 ? state.prompt_len : state.length;
    const std::int64_t Hs = state.scores.extent(0), n = state.length;
    WorkspaceCarver carve(ws);
    std::int64_t* nan_at = carve.take<std::int64_t>(static_cast<std::size_t>(2 * std::max<std::int64_t>(Hs, 1)));
    std::int64_t* victim = nan_at + Hs;
    const auto slices = detail::WorkerSlices::carve(carve.rest(), Backend::topk_workspace(std::max<std::int64_t>(n, 1)));
    const std::int64_t recent = std::max<std::int64_t>(recent_size(prompt) - num_coming, 0);
    const std::int64_t heavy = keep - std::min(recent, keep), cand = n - recent;
    const bool single = n - keep == 1;

    // Phase 1 (read only): NaN check, and the victim when exactly one slot goes.
    ctx.parallel_for(Hs, [&](std::int64_t s, int) {
      const float* row = &state.scores(s, 0);
      nan_at[s] = single ? Backend::argmin_or_nan(row, cand, &victim[s]) : (Backend::has_nan(row, cand) ? 0 : -1);
      if (nan_at[s] < 0 && Backend::has_nan(row + std::max<std::int64_t>(cand, 0), n - std::max<std::int64_t>(cand, 0))) nan_at[s] = 0;
      if (nan_at[s] >= 0) nan_at[s] = Backend::first_nan(row, n);
    });
    for (std::int64_t s = 0; s < Hs; ++s) {
      KVP_REQUIRE(nan_at[s] < 0, "h2o: state head %lld slot %lld is NaN (non-finite attention was accumulated)", static_cast<long long>(s),
                  static_cast<long long>(nan_at[s]));
    }

    // Phase 2: decisions and state re-packing.
    KVP_RETURN_IF_ERROR(detail::write_uniform_indptr(kName, out, 1, Hs, [&](std::int64_t) { return keep; }));
    ctx.parallel_for(Hs, [&](std::int64_t s, int worker) {
      float* row = &state.scores(s, 0);
      auto* ids = out.indices + out.indptr[s];
      if (keep == n) {
        for (std::int64_t r = 0; r < n; ++r) ids[r] = static_cast<std::int32_t>(r);
      } else if (single) {
        const std::int64_t x = victim[s];
        for (std::int64_t r = 0; r < x; ++r) ids[r] = static_cast<std::int32_t>(r);
        for (std::int64_t r = x; r < keep; ++r) ids[r] = static_cast<std::int32_t>(r + 1);
        std::memmove(row + x, row + x + 1, static_cast<std::size_t>(n - x - 1) * sizeof(float));
      } else {
        Backend::topk(row, cand, heavy, ids, slices.slice(worker));
        for (std::int64_t r = heavy; r < keep; ++r) ids[r] = static_cast<std::int32_t>(n - keep + r);
        for (std::int64_t r = 0; r < keep; ++r) row[r] = row[ids[r]];  // ids[r] >= r: forward sweep is in-place safe
      }
    });
    state.length = keep;
    return Status::ok();
  }

  Status check_state(const H2OState& st, bool on_device = false) const noexcept {
    KVP_RETURN_IF_ERROR(st.scores.check_basic(kName, "state scores"));
    if (on_device) {
      KVP_REQUIRE(!st.scores.device().is_host(), "h2o: state scores is a host tensor; a device backend keeps the state in device memory");
    } else {
      KVP_REQUIRE(st.scores.device().is_host(), "h2o: state scores is a device tensor; this entry point uses host memory");
    }
    KVP_REQUIRE(st.scores.extent(0) >= 1, "h2o: state scores has %lld rows, must be >= 1", static_cast<long long>(st.scores.extent(0)));
    KVP_REQUIRE(st.scores.stride(1) == 1 || st.scores.extent(1) <= 1, "h2o: state scores has slot stride %lld, must be 1",
                static_cast<long long>(st.scores.stride(1)));
    KVP_REQUIRE(st.length >= 0 && st.length <= st.scores.extent(1), "h2o: state length %lld out of range [0, capacity=%lld]",
                static_cast<long long>(st.length), static_cast<long long>(st.scores.extent(1)));
    return Status::ok();
  }

  /// The call covers kv_len = state.length + new slots and must fit the state.
  Status check_step(const H2OState& st, std::int64_t kv_len, std::int64_t fresh, const char* name) const noexcept {
    KVP_REQUIRE(kv_len >= st.length, "h2o: %s cover kv_len=%lld, fewer than the state's %lld slots", name, static_cast<long long>(kv_len),
                static_cast<long long>(st.length));
    KVP_REQUIRE(kv_len == st.length + fresh, "h2o: %s cover kv_len=%lld, expected state length %lld + %lld new = %lld", name,
                static_cast<long long>(kv_len), static_cast<long long>(st.length), static_cast<long long>(fresh),
                static_cast<long long>(st.length + fresh));
    KVP_REQUIRE(kv_len <= st.scores.extent(1), "h2o: state capacity %lld is smaller than kv_len %lld",
                static_cast<long long>(st.scores.extent(1)), static_cast<long long>(kv_len));
    KVP_REQUIRE(kv_len <= INT32_MAX, "h2o: kv_len %lld exceeds the int32 token id range", static_cast<long long>(kv_len));
    return Status::ok();
  }

  bool mean_groups() const noexcept { return params_.group_reduce == GroupReduce::kMean; }

  template <class Backend, class Tp>
  Status update_impl(H2OState& st, TensorView<const Tp, 3> p, std::int64_t fresh, const char* name, const ExecContext& ctx) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_RETURN_IF_ERROR(check_state(st, kDeviceBackend<Backend>));
    if constexpr (kDeviceBackend<Backend>) {
      KVP_REQUIRE(!p.device().is_host(), "h2o: %s is a host tensor; a device backend reads device memory (tag the view kCUDA)", name);
    } else {
      KVP_REQUIRE(p.device().is_host(), "h2o: %s is a device tensor; this entry point reads host memory", name);
    }
    const std::int64_t Hq = p.extent(0), Hs = st.scores.extent(0), n = p.extent(2);
    if (params_.granularity == H2OGranularity::kQueryHead) {
      KVP_REQUIRE(Hq == Hs, "h2o: %s has %lld query heads, the per-query-head state has %lld rows", name, static_cast<long long>(Hq),
                  static_cast<long long>(Hs));
    } else {
      KVP_REQUIRE(Hq >= 1 && Hq % Hs == 0, "h2o: %s has %lld query heads, not a multiple of the state's %lld kv heads", name,
                  static_cast<long long>(Hq), static_cast<long long>(Hs));
    }
    KVP_REQUIRE(p.stride(2) == 1 || n <= 1, "h2o: %s has kv stride %lld, must be 1 (rows are read as contiguous vectors)", name,
                static_cast<long long>(p.stride(2)));
    KVP_RETURN_IF_ERROR(check_step(st, n, fresh, name));
    const std::int64_t G = Hq / Hs, len_prev = st.length;
    ctx.parallel_for(Hs,
                     [&](std::int64_t s, int) { Backend::accumulate_column_sums(&st.scores(s, 0), len_prev, p, s * G, G, mean_groups()); });
    if (len_prev == 0) st.prompt_len = n;
    st.length = n;
    return Status::ok();
  }

  static constexpr std::int64_t kQueryBlock = 64;  ///< queries per window_scores call in update_from_queries

  template <class Backend>
  std::size_t update_per_worker(const ProblemShape& s) const noexcept {
    const std::int64_t G = s.num_kv_heads > 0 ? std::max<std::int64_t>(1, s.num_q_heads / s.num_kv_heads) : 1;
    const std::int64_t n = std::max<std::int64_t>(s.max_kv_len, 1), q = std::max<std::int64_t>(s.q_len, 1), B = std::min(q, kQueryBlock);
    WorkspacePlan plan;
    plan.add<float>(static_cast<std::size_t>(G * B * s.head_dim)).add<float>(static_cast<std::size_t>(G * n));
    if (q > B) plan.add<float>(static_cast<std::size_t>(G * n));
    // Sized for the last query block (q_pos0 = n - B): a backend's scratch may grow with
    // the causal offset (Cuda's logits tile holds q_pos0 + window columns).
    plan.add_bytes(Backend::window_scores_workspace(WindowScoreShape{G, B, s.head_dim, n, n, n - B, 1.0f, WindowReduce::kSum}));
    return plan.bytes;
  }

  Params params_{};
};

static_assert(OnlineEvictionPolicy<H2O, ScoreInput<float, float>> && OnlineEvictionPolicy<H2O, ScoreInput<float, half, half>>);

KVP_NAMESPACE_END
