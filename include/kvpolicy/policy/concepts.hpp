// SPDX-License-Identifier: Apache-2.0
// The family concepts: one templated policy interface over eviction,
// selection, budgets, merging, quantization and prefetch. Every policy header
// `static_assert`s the concepts it models for `backend::Scalar`; the umbrella
// header (kvpolicy.hpp) asserts them for `backend::Cpu` when that backend is
// available, and tests/interface/test_interface.cpp checks every (policy,
// backend, dtype) pair.
//
// The shape shared by all families (vocabulary.hpp):
//   Requirements r = policy.requirements(ctx, shape);   // one size query per phase
//   Status s = policy.<verb>(ctx, input..., output);   // noexcept, writes nothing on error
// with one verb per meaning:
//   score    -> ScoreMap                 (Scorer)
//   evict    -> KeepSet                  (EvictionPolicy, OnlineEvictionPolicy)
//   update   -> caller-owned State       (OnlineEvictionPolicy)
//   plan / on_append / select -> PageSelection (SelectionPolicy)
//   allocate -> per-head / per-layer counts    (BudgetAllocator)
//   merge    -> MergePlan                (MergePolicy)
//   quantize / dequantize -> QuantizedKV (QuantizationPolicy)
//   predict / observe -> PrefetchRequest, PrefetchCounters (PrefetchPolicy)
#pragma once

#include <concepts>
#include <cstdint>
#include <span>
#include <string_view>

#include "kvpolicy/core/keep_set.hpp"
#include "kvpolicy/core/page_selection.hpp"
#include "kvpolicy/ops/scalar.hpp"
#include "kvpolicy/policy/decisions.hpp"
#include "kvpolicy/policy/vocabulary.hpp"

KVP_NAMESPACE_BEGIN

/// What every policy of every family has: its `Params`, its name, and a
/// parameter check independent of the inputs.
template <class P>
concept Policy = requires(const P& p) {
  typename P::Params;
  { P::kName } -> std::convertible_to<std::string_view>;
  { p.params() } -> std::convertible_to<const typename P::Params&>;
  { p.validate_params() } -> std::same_as<Status>;
};

/// Per-token scores of one sequence into a (rows, kv_len) map, protected tokens
/// +inf; `protected_tokens(kv_len)` says how many tokens score +inf by rule
/// (the window, the sinks), which a budget allocator subtracts first.
/// `requirements().workspace_bytes` covers `score` as well as `evict`.
template <class P, class In, class B = backend::Scalar>
concept Scorer = Policy<P> && requires(const P& p, const Context<B>& ctx, const In& in, ScoreMap out, const ProblemShape& s) {
  { p.requirements(ctx, s) } -> std::same_as<Requirements>;
  { p.score(ctx, in, out) } -> std::same_as<Status>;
  { p.protected_tokens(s.max_kv_len) } -> std::same_as<std::int64_t>;
};

/// One-shot eviction over a batch of sequences: KeepSet row `b * num_kv_heads + h`
/// (or per query head, as the policy states) of ascending kept token ids.
template <class P, class In, class B = backend::Scalar>
concept EvictionPolicy = Policy<P> &&
    requires(const P& p, const Context<B>& ctx, std::span<const In> batch, KeepSet out, const ProblemShape& s) {
  { p.requirements(ctx, s) } -> std::same_as<Requirements>;
  { p.evict(ctx, batch, out) } -> std::same_as<Status>;
};

/// Eviction with caller-owned state updated every forward call (H2O): `update`
/// folds one call's evidence (probabilities, column sums or queries) into the
/// state, `evict` writes the KeepSet and re-packs the state to match.
template <class P, class In, class B = backend::Scalar>
concept OnlineEvictionPolicy = Policy<P> &&
    requires(const P& p, const Context<B>& ctx, typename P::State& st, const In& obs, KeepSet out, const ProblemShape& s) {
  typename P::State;
  { p.requirements(ctx, s) } -> std::same_as<Requirements>;
  { p.update(ctx, st, obs) } -> std::same_as<Status>;
  { p.evict(ctx, st, out) } -> std::same_as<Status>;
};

/// Page selection at decode (Quest): `plan` is host work per batch composition
/// (validation, output sizing); `on_append` maintains the per-page state as
/// tokens arrive; `select` writes the PageSelection and neither allocates nor
/// synchronises. `Tm` is the state's element type.
template <class P, class Tq, class Tk, class Tm, class B = backend::Scalar>
concept SelectionPolicy = Policy<P> &&
    requires(const P& p, const Context<B>& ctx, typename P::template State<Tm> st, typename P::Plan& plan, const DecodeInput<Tq>& in,
             const AppendInput<Tk>& app, PageSelection out, const ProblemShape& s) {
  typename P::Plan;
  { p.plan(ctx, in, s, plan) } -> std::same_as<Status>;
  { p.on_append(ctx, app, st) } -> std::same_as<Status>;
  { p.select(ctx, plan, in, st, out) } -> std::same_as<Status>;
};

/// Splits a budget over heads (Ada-KV) or layers (PyramidKV): `allocate`
/// writes one count per row of `scores` (rows, kv_len).
template <class P, class B = backend::Scalar>
concept BudgetAllocator = requires(const P& p, const Context<B>& ctx, std::int64_t kv_len, TensorView<const float, 2> scores,
                                   std::span<std::int64_t> counts) {
  { p.allocate(ctx, kv_len, scores, counts) } -> std::same_as<Status>;
};

/// Folds what an eviction drops into what it keeps.
template <class P, class In, class B = backend::Scalar>
concept MergePolicy = Policy<P> &&
    requires(const P& p, const Context<B>& ctx, const In& in, const KeepSet& keep, MergePlan out, const ProblemShape& s) {
  { p.requirements(ctx, s) } -> std::same_as<Requirements>;
  { p.merge(ctx, in, keep, out) } -> std::same_as<Status>;
};

/// Stores K/V in fewer bits; `bytes_per_token` links a byte budget to a token budget.
template <class P, class Tk, class B = backend::Scalar>
concept QuantizationPolicy = Policy<P> && requires(const P& p, const Context<B>& ctx, TensorView<const Tk, 3> rows, typename P::State& st,
                                                   QuantizedKV q, TensorView<Tk, 3> out, std::int64_t head_dim) {
  typename P::State;
  { p.layout() } -> std::same_as<QuantLayout>;
  { p.bytes_per_token(head_dim) } -> std::convertible_to<double>;
  { p.quantize(ctx, rows, st, q) } -> std::same_as<Status>;
  { p.dequantize(ctx, q, out) } -> std::same_as<Status>;
};

/// Predicts the pages the next step reads (`predict`) and scores the
/// prediction against what it actually read (`observe`).
template <class P, class Tq, class B = backend::Scalar>
concept PrefetchPolicy = Policy<P> && requires(const P& p, const Context<B>& ctx, typename P::State& st, const DecodeInput<Tq>& next,
                                               const PageSelection& actual, PrefetchRequest out, PrefetchCounters& counters) {
  typename P::State;
  { p.predict(ctx, st, next, out) } -> std::same_as<Status>;
  { p.observe(ctx, st, actual, counters) } -> std::same_as<Status>;
};

KVP_NAMESPACE_END
