// SPDX-License-Identifier: Apache-2.0
// LAQ — "Lookahead Q-Cache: Achieving More Consistent KV Eviction via Pseudo
// Query" (EMNLP 2025, arXiv 2505.20334), as the reference repository
// (noforit/Lookahead_Q-Cache, run_LAQ.sh defaults) runs it:
//
//   1. prefill on the full cache, keeping the last `stage1_window` = 32
//      post-RoPE queries per layer;
//   2. stage 1: SnapKV on the full prompt (window 32, max pool 7, window sum,
//      the final budget C) gives a cheap cache (`LAQ::stage1()`);
//   3. greedy-decode n <= `lookahead` = 8 pseudo tokens on it from the prefill
//      argmax, recording each token's queries (`LookaheadDecoder`, the
//      engine's decode callback; fewer at EOS);
//   4. stage 2 on the FULL prompt: observation rows = the last W2 prompt
//      queries + the n pseudo queries; A = softmax(Q K^T / sqrt(d)) over the T
//      prompt keys under `mask`; s_j = sum over the rows, j < T - W2; max pool
//      7; keep the top (C - W2) + the last W2 prompt tokens;
//   5. drop stage 1 and the pseudo tokens; decoding starts from the prefill
//      logits (the first real token is the prefill argmax).
// W2 = `window` = 0 is LAQ, W2 = 8 is LAQ++ (`LAQParams::laq`, `laq_plus_plus`).
// Steps 2 and 4 are SnapKV (`stage1()`, `stage2()`); this class adds the
// checks stage 2 needs and evicts. An engine wires the whole procedure:
// examples/engine/laq.hpp.
//
// Choices where the reference is one of several readings (all selectable):
//  * Mask. `LookaheadMask::kReference` (default) is the repository's
//    `update_kv_LAQ` mask (lookahead.hpp): pseudo query i misses the last
//    W2+n-1-i prompt keys and the W2 prompt queries lose n keys. kCorrected
//    gives every row its real position. Both are tested.
//  * Granularity. The reference repeats K/V to every query head and selects
//    per query head. Here selection is per kv head: the G heads' sums are
//    reduced (`group_reduce`, mean by default) before the max pool, as
//    KVCache-Factory's kv_head mode. A per-query-head cache is expressible by
//    calling with num_q_heads == num_kv_heads on repeated views.
//  * Budget. `Budget::tokens(C).clamp_to_length()`: C counts the window;
//    prompts with T <= C are kept whole (the reference returns early for
//    T < C; at T == C its top-(C-W2) keeps everything too). A budget that
//    keeps fewer tokens than W2 is an error (the reference would call
//    topk with a negative count).
//  * The stage-1 query buffer. The reference seeds its buffer with the last
//    16 prompt queries and slices the last W2 + n rows, so W2 <= 16 reads the
//    last W2 prompt queries; here those come from the prompt window directly,
//    and W2 <= stage1_window is required.
//  * Precision. fp32 softmax and sums (the reference casts the softmax back to
//    the model dtype before summing). Ties: higher score first, then the more
//    recent token (`score_order_key`); kept ids ascending.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>

#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "kvpolicy/policy/lookahead.hpp"

KVP_NAMESPACE_BEGIN

struct LAQParams {
  Budget budget = Budget::tokens(128).clamp_to_length();  ///< capacity C per kv head, window included (max_capacity_prompts)
  std::int32_t window = 0;                                ///< W2: prompt queries in stage 2 (0: LAQ, 8: LAQ++)
  std::int32_t lookahead = 8;                             ///< pseudo tokens decoded at most (max_lookahead_size)
  std::int32_t stage1_window = 32;                        ///< stage-1 SnapKV window = prompt queries kept (lookahead_window_size)
  std::int32_t kernel = 7;                                ///< max pool kernel of both stages
  Pooling pooling = Pooling::kMax;
  GroupReduce group_reduce = GroupReduce::kMean;  ///< GQA: reduction of a group's sums before pooling
  LookaheadMask mask = LookaheadMask::kReference;
  float scale = 0.0f;  ///< logit scale; 0 means 1/sqrt(head_dim)

  static constexpr auto fields() noexcept {
    return std::tuple{budget_field<&LAQParams::budget>(),
                      param_field<&LAQParams::window>("window", "W2: prompt queries in stage 2 (0 = LAQ, 8 = LAQ++)"),
                      param_field<&LAQParams::lookahead>("lookahead", "pseudo tokens decoded at most"),
                      param_field<&LAQParams::stage1_window>("stage1_window", "stage-1 SnapKV window (prompt queries kept)"),
                      param_field<&LAQParams::kernel>("kernel", "pooling kernel (odd)"),
                      param_field<&LAQParams::pooling>("pooling", "pooling along tokens"),
                      param_field<&LAQParams::group_reduce>("group_reduce", "reduction over a GQA group"),
                      param_field<&LAQParams::mask>("mask", "causal mask of the observation rows"),
                      param_field<&LAQParams::scale>("scale", "logit scale, 0 = 1/sqrt(head_dim)")};
  }

  /// LAQ (W2 = 0) with capacity C, the repository's defaults otherwise.
  static constexpr LAQParams laq(std::int64_t capacity) noexcept {
    LAQParams p;
    p.budget = Budget::tokens(capacity).clamp_to_length();
    return p;
  }
  /// LAQ++ (W2 = 8 prompt queries with the pseudo queries) with capacity C.
  static constexpr LAQParams laq_plus_plus(std::int64_t capacity) noexcept {
    LAQParams p = laq(capacity);
    p.window = 8;
    return p;
  }
};

class LAQ {
 public:
  using Params = LAQParams;
  static constexpr const char* kName = "laq";

  constexpr LAQ() noexcept = default;
  explicit constexpr LAQ(const Params& p) noexcept : params_(p) {}
  constexpr const Params& params() const noexcept { return params_; }

  Status validate_params() const noexcept {
    KVP_RETURN_IF_ERROR(check_enum_fields(kName, params_));
    KVP_REQUIRE(params_.window >= 0, "laq: window (W2) is %d, must be >= 0", params_.window);
    KVP_REQUIRE(params_.lookahead >= 1, "laq: lookahead is %d, must be >= 1 pseudo token", params_.lookahead);
    KVP_REQUIRE(params_.stage1_window >= 1, "laq: stage1_window is %d, must be >= 1", params_.stage1_window);
    KVP_REQUIRE(params_.window <= params_.stage1_window, "laq: window (W2) %d is larger than stage1_window %d (the prompt queries kept)",
                params_.window, params_.stage1_window);
    KVP_REQUIRE(params_.kernel >= 1 && params_.kernel % 2 == 1, "laq: pooling kernel is %d, must be odd and >= 1", params_.kernel);
    KVP_REQUIRE(std::isfinite(params_.scale) && params_.scale >= 0.0f, "laq: scale is %g, must be finite and >= 0",
                static_cast<double>(params_.scale));
    KVP_RETURN_IF_ERROR(params_.budget.validate(kName));
    if (params_.budget.kind == BudgetKind::kTokens && params_.budget.protected_inside)
      KVP_REQUIRE(params_.budget.value >= params_.window, "laq: token budget %g is smaller than the window W2 = %d", params_.budget.value,
                  params_.window);
    return Status::ok();
  }

  /// Stage 1: the cheap cache the pseudo tokens are decoded on (SnapKV, the
  /// original's form: window sum, max pool, the final budget).
  constexpr SnapKVParams stage1() const noexcept {
    return SnapKVParams{params_.stage1_window,       params_.kernel, params_.pooling, WindowReduce::kSum,       params_.group_reduce,
                        ReduceOrder::kGroupThenPool, params_.budget, params_.scale,   LookaheadMask::kCorrected};
  }
  /// Stage 2: SnapKV over W2 prompt + n lookahead rows with LAQ's mask.
  constexpr SnapKVParams stage2() const noexcept {
    return SnapKVParams{params_.window,     params_.kernel,       params_.pooling,
                        WindowReduce::kSum, params_.group_reduce, ReduceOrder::kGroupThenPool,
                        params_.budget,     params_.scale,        params_.mask};
  }
  /// The pseudo-token decode of step 3.
  constexpr LookaheadParams decode_params(std::int32_t eos_id) const noexcept { return LookaheadParams{params_.lookahead, eos_id}; }

  /// Tokens kept per kv head for a `kv_len`-token prompt (-1 if the budget is invalid for it).
  std::int64_t kept_count(std::int64_t kv_len) const noexcept { return SnapKV(stage2()).kept_count(kv_len); }
  /// Tokens scored +inf by rule: the last W2 prompt tokens.
  std::int64_t protected_tokens(std::int64_t kv_len) const noexcept { return std::min<std::int64_t>(params_.window, kv_len); }

  /// Size query of stage 2 for inputs of at most `shape` (q_len: W2 + the
  /// pseudo tokens, at most W2 + lookahead). `query_window` is the prompt
  /// queries the engine must keep: stage1_window.
  template <class Backend>
  Requirements requirements(const Context<Backend>& ctx, const ProblemShape& shape) const noexcept {
    Requirements r;
    r.status = validate_params();
    if (!r.status.is_ok()) return r;
    ProblemShape s = shape;
    s.q_len = std::max<std::int64_t>(shape.q_len, params_.window + params_.lookahead);
    r = SnapKV(stage2()).requirements(ctx, s);
    if (r.status.is_ok()) r.query_window = params_.stage1_window;
    return r;
  }

  /// Stage-2 scores of one prompt: (num_kv_heads, kv_len), the last W2 tokens +inf.
  template <class Backend, class Tq, class Tk>
  Status score(const Context<Backend>& cx, const ScoreInput<Tq, Tk>& in, ScoreMap out) const noexcept {
    KVP_RETURN_IF_ERROR(validate(std::span<const ScoreInput<Tq, Tk>>(&in, 1)));
    return SnapKV(stage2()).score(cx, in, out);
  }

  /// Stage-2 eviction for a batch (`in.lookahead` = n pseudo rows after the W2
  /// prompt rows): keep row `b * num_kv_heads + h`, ascending.
  template <class Backend, class Tq, class Tk>
  Status evict(const Context<Backend>& cx, std::span<const ScoreInput<Tq, Tk>> batch, KeepSet out) const noexcept {
    KVP_RETURN_IF_ERROR(validate(batch));
    return SnapKV(stage2()).evict(cx, batch, out);
  }
  template <class Backend, class Tq, class Tk>
  Status evict(const Context<Backend>& cx, const ScoreInput<Tq, Tk>& in, KeepSet out) const noexcept {
    return evict(cx, std::span<const ScoreInput<Tq, Tk>>(&in, 1), out);
  }

 private:
  template <class Tq, class Tk>
  Status validate(std::span<const ScoreInput<Tq, Tk>> batch) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_REQUIRE(!batch.empty(), "laq: batch is empty");
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const auto& in = batch[b];
      KVP_REQUIRE(in.lookahead >= 1 && in.lookahead <= params_.lookahead,
                  "laq: lookahead is %lld pseudo queries, must be in [1, lookahead = %d] (sequence %zu)",
                  static_cast<long long>(in.lookahead), params_.lookahead, b);
      const std::int64_t T = in.keys.kv_len();
      std::int64_t n = 0;
      KVP_RETURN_IF_ERROR(params_.budget.resolve(kName, T, std::min<std::int64_t>(params_.window, T), &n));
      KVP_REQUIRE(n >= T || n >= params_.window, "laq: the budget keeps %lld of %lld tokens, fewer than the window W2 = %d (sequence %zu)",
                  static_cast<long long>(n), static_cast<long long>(T), params_.window, b);
    }
    return Status::ok();
  }

  Params params_{};
};

static_assert(Scorer<LAQ, ScoreInput<float, float>> && EvictionPolicy<LAQ, ScoreInput<float, half>>);

KVP_NAMESPACE_END
