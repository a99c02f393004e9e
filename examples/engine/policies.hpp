// SPDX-License-Identifier: Apache-2.0
// Adapters from kvpolicy policies to the engine's hook points: the library's
// lifecycle, `kvpolicy::Hooks<Cache>` (kvpolicy/policy/lifecycle.hpp; engine.hpp).
//
//  * eviction_hooks(policy): after prefill, per layer, any kvpolicy
//    `EvictionPolicy` (SnapKV, StreamingLLM, ...) reads the cache in place
//    (`KVSource`: dense view or paged view) and the last prompt queries, and
//    writes a KeepSet the engine applies with compact_contiguous/compact_paged.
//    Also for a registry policy built from a spec string (`kvpolicy::AnyEvictionPolicy`,
//    kvpolicy/registry.hpp: make_eviction_policy("snapkv:window=32,tokens=128", &p)).
//  * quest_hooks(quest): Quest page selection on the paged cache: page min/max
//    metadata maintained on every append (and rebuilt after a compaction),
//    and before each decode attention (Hooks::before_attention) a
//    `PageSelection` the cache attends to.
//  * kivi_hooks(keys, values) (kivi_hooks.hpp): KIVI's store (codes, scales, fp16 residual) in the decode
//    loop, contiguous or paged cache, alone or after an eviction (the store is rebuilt from the compacted
//    cache after every compaction).
//  * kvpolicy::combine(a, b) (lifecycle.hpp): both sets of hooks (e.g. SnapKV
//    after prefill + Quest per step); each hook point calls a's then b's callback.
//
//  * eviction_hooks_by_layer(make): as eviction_hooks with a policy per layer
//    (PyramidKV's layer-dependent budgets).
//  * h2o_hooks(h2o): online H2O. After prefill the prompt's attention (all its
//    queries: the engine must keep them, PolicyUnderTest::kWholePrompt) is
//    accumulated and the cache evicted to hh + recent; on every decode step the
//    step's attention weights (Hooks::after_attention) are added and one slot
//    goes once the cache is full. The score state lives in the hook, one per layer.
//  * expected_attention_hooks(params, rope_base): Expected Attention after
//    prefill, from the whole prompt's queries rotated back to pre-RoPE.
//  * merge_hooks(policy, merge), merge_after(hooks, merge): eviction (after
//    prefill, or online after every decode attention: H2O), then a kvpolicy
//    merge policy folds the evicted tokens into the kept ones (apply/merge.hpp)
//    before the engine compacts (contiguous or paged cache). CaM reads the
//    accumulated attention the wrapper keeps aligned with the cache slots.
//  * kvpress_cam_hooks(cam, target, interval): kvpress's CAMPress as a decoding
//    press (KnormPress scores, every `interval` decode steps once the cache
//    exceeds `target`).
//  * d2o_hooks(at): D2O whole, per layer its token-level policy `at(layer)`
//    (budgets from D2O::layer_ratios): eviction by accumulated attention with
//    sinks, then the EMA-threshold merge, after prefill and every decode step.
//  * tova_hooks(tova): online TOVA: after prefill the last prompt query's
//    head-mean attention decides, then on every decode step the step's
//    attention weights do; the cache never exceeds the budget.
//
// Workspaces and output buffers are sized by the policy's one size query,
// `requirements(ctx, shape)` (workspace bytes, output rows / capacity, the
// query window it reads); workspaces are kept (grown only) inside the hook, so
// steady-state decoding does not allocate for the policy. Every policy call
// goes through its noexcept Status API; the engine turns a failed Status into
// an exception naming the policy's complaint.
//
// Build: the factories are templates; the instantiations the project uses
// (float caches; SnapKV, TOVA, H2O, Expected Attention, Quest, AnyEvictionPolicy)
// are declared `extern template` at the end of this file and compiled once in
// policies.cpp (kvp_engine_lib).
#pragma once

#include <algorithm>
#include <cstddef>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "engine.hpp"
#include "kivi_hooks.hpp"
#include "kvpolicy/apply/merge.hpp"
#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/core/gqa.hpp"
#include "kvpolicy/core/page_selection.hpp"
#include "kvpolicy/policy/eviction/expected_attention.hpp"
#include "kvpolicy/policy/eviction/h2o.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "kvpolicy/policy/eviction/tova.hpp"
#include "kvpolicy/policy/merging/cam.hpp"
#include "kvpolicy/policy/merging/d2o.hpp"
#include "kvpolicy/policy/merging/kvpress_cam.hpp"
#include "kvpolicy/policy/merging/kvpress_merging.hpp"
#include "kvpolicy/policy/merging/lookm.hpp"
#include "kvpolicy/policy/merging/nearest_kept.hpp"
#include "kvpolicy/policy/pipeline.hpp"
#include "kvpolicy/policy/policy.hpp"
#include "kvpolicy/policy/quantization/fp8_quant.hpp"
#include "kvpolicy/policy/quantization/ggml_quant.hpp"
#include "kvpolicy/policy/quantization/int4_quant.hpp"
#include "kvpolicy/policy/quantization/kivi_quant.hpp"
#include "kvpolicy/policy/quantization/mixed_precision.hpp"
#include "kvpolicy/policy/quantization/quant_spec.hpp"
#include "kvpolicy/policy/selection/quest.hpp"
#include "kvpolicy/registry.hpp"

namespace kvp_engine {

/// The context of a policy call: backend `Backend`, the hook's pool, `ws` as scratch (none: a size query).
template <class Backend>
kvpolicy::Context<Backend> policy_context(const kvpolicy::ExecContext& ctx, std::vector<std::byte>* ws = nullptr) {
  return kvpolicy::Context<Backend>{ws ? kvpolicy::Workspace{ws->data(), ws->size()} : kvpolicy::Workspace{}, ctx};
}

/// Grows `ws` to the requirement (never shrinks: steady-state calls do not allocate).
inline void grow_workspace(std::vector<std::byte>& ws, const kvpolicy::Requirements& r) {
  if (ws.size() < r.workspace_bytes) ws.resize(r.workspace_bytes);
}

/// After-prefill eviction with any kvpolicy eviction policy (one sequence, every layer).
/// The policy sees the last min(window, W) prompt queries of the layer, window
/// = `query_window` or, when 0, the policy's own (`Requirements::query_window`);
/// the engine must keep at least that many (PrefillOptions::query_window).
template <class Cache, class Policy, class Backend = kvpolicy::backend::Cpu>
Hooks<Cache> eviction_hooks(Policy policy, kvpolicy::ExecContext ctx = {}, std::int64_t query_window = 0) {
  using T = typename Cache::element_type;
  Hooks<Cache> h;
  auto ws = std::make_shared<std::vector<std::byte>>();
  h.after_prefill = [policy, ctx, ws, query_window](Cache& cache, int layer, TensorView<const float, 3> queries,
                                                    KeepBuffer& keep) -> Status {
    const KVSource<T> keys = cache.key_source(layer);
    const std::int64_t W = queries.extent(1);
    kvpolicy::ProblemShape shape{queries.extent(0), keys.kv_heads(), keys.head_dim(), keys.kv_len(), W};
    kvpolicy::Requirements r = policy.requirements(policy_context<Backend>(ctx), shape);
    KVP_RETURN_IF_ERROR(r.status);
    const std::int64_t w = std::min(query_window > 0 ? query_window : r.query_window, W);
    if (w != shape.q_len) {  // size for the queries the policy actually gets
      shape.q_len = w;
      r = policy.requirements(policy_context<Backend>(ctx), shape);
      KVP_RETURN_IF_ERROR(r.status);
    }
    const kvpolicy::ScoreInput<float, T> in{queries.narrow(1, W - w, w), keys};
    grow_workspace(*ws, r);
    // Rows and capacity from the size query (covers ragged per-head budgets).
    keep.reserve(r.output.rows, r.output.capacity);
    return policy.evict(policy_context<Backend>(ctx, ws.get()), in, keep.set);
  };
  return h;
}

/// A type-erased registry policy (kvpolicy::AnyEvictionPolicy) behind the
/// `Context` interface eviction_hooks calls: the backend named by the context's type.
struct ErasedEvictionPolicy {
  kvpolicy::AnyEvictionPolicy policy;

  template <class Backend>
  static constexpr kvpolicy::BackendKind kind() noexcept {
    static_assert(std::is_same_v<Backend, kvpolicy::backend::Cpu> || std::is_same_v<Backend, kvpolicy::backend::Scalar>,
                  "AnyEvictionPolicy runs on the Cpu or the Scalar backend");
    return std::is_same_v<Backend, kvpolicy::backend::Cpu> ? kvpolicy::BackendKind::kCpu : kvpolicy::BackendKind::kScalar;
  }
  template <class Backend>
  kvpolicy::Requirements requirements(const kvpolicy::Context<Backend>& ctx, const kvpolicy::ProblemShape& shape) const noexcept {
    return policy.requirements(kind<Backend>(), shape, ctx.exec);
  }
  template <class Backend, class Tk>
  Status evict(const kvpolicy::Context<Backend>& ctx, const kvpolicy::ScoreInput<float, Tk>& in, KeepSet out) const noexcept {
    return policy.evict(kind<Backend>(), in, out, ctx.workspace, ctx.exec);
  }
};

/// After-prefill eviction with a registry policy (a spec string made into an AnyEvictionPolicy).
template <class Cache, class Backend = kvpolicy::backend::Cpu>
Hooks<Cache> eviction_hooks(kvpolicy::AnyEvictionPolicy policy, kvpolicy::ExecContext ctx = {}, std::int64_t query_window = 0) {
  return eviction_hooks<Cache, ErasedEvictionPolicy, Backend>(ErasedEvictionPolicy{std::move(policy)}, ctx, query_window);
}

/// After-prefill eviction scored from the prompt's attention column sums that the engine's prefill kept
/// (Hooks::on_prefill_attention, PrefillOptions::column_sums) instead of from the prompt's queries: any policy
/// that reads ScoreInput::column_sums (ObservedAttention). A layer's sums are copied when they arrive and used
/// by that layer's after_prefill once; an after_prefill without them fails, naming the option.
template <class Cache, class Policy, class Backend = kvpolicy::backend::Cpu>
Hooks<Cache> column_sum_eviction_hooks(Policy policy, kvpolicy::ExecContext ctx = {}) {
  using T = typename Cache::element_type;
  struct State {
    std::vector<std::vector<float>> sums;  // per layer: (Hq, n), row-major
    std::vector<std::int64_t> heads;       // per layer: Hq of the pending sums, 0 when none
    std::vector<std::byte> ws;
  };
  auto S = std::make_shared<State>();
  Hooks<Cache> h;
  h.on_prefill_attention = [S](Cache&, int layer, TensorView<const float, 2> column_sums) -> Status {
    const auto l = static_cast<std::size_t>(layer);
    if (S->sums.size() <= l) {
      S->sums.resize(l + 1);
      S->heads.resize(l + 1, 0);
    }
    const std::int64_t H = column_sums.extent(0), n = column_sums.extent(1);
    auto& buf = S->sums[l];
    buf.resize(static_cast<std::size_t>(H * n));
    for (std::int64_t i = 0; i < H; ++i)
      for (std::int64_t j = 0; j < n; ++j) buf[static_cast<std::size_t>(i * n + j)] = column_sums(i, j);
    S->heads[l] = H;
    return Status::ok();
  };
  h.after_prefill = [policy, ctx, S](Cache& cache, int layer, TensorView<const float, 3>, KeepBuffer& keep) -> Status {
    const auto l = static_cast<std::size_t>(layer);
    if (l >= S->heads.size() || S->heads[l] == 0)
      return KVP_INVALID("engine: layer %d has no prompt attention column sums (PrefillOptions::column_sums)", layer);
    const std::int64_t H = S->heads[l];
    S->heads[l] = 0;  // used once
    kvpolicy::ScoreInput<float, T> in;
    in.keys = cache.key_source(layer);
    const std::int64_t n = in.keys.kv_len();
    if (static_cast<std::int64_t>(S->sums[l].size()) != H * n)
      return KVP_INVALID("engine: layer %d's column sums cover %lld tokens, the cache holds %lld", layer,
                         static_cast<long long>(static_cast<std::int64_t>(S->sums[l].size()) / H), static_cast<long long>(n));
    in.column_sums = TensorView<const float, 2>::contiguous(S->sums[l].data(), {H, n});
    const kvpolicy::ProblemShape shape{H, in.keys.kv_heads(), 0, n, 0};  // no queries: head_dim and q_len 0
    const kvpolicy::Requirements r = policy.requirements(policy_context<Backend>(ctx), shape);
    KVP_RETURN_IF_ERROR(r.status);
    grow_workspace(S->ws, r);
    keep.reserve(r.output.rows, r.output.capacity);
    return policy.evict(policy_context<Backend>(ctx, &S->ws), in, keep.set);
  };
  return h;
}

/// As eviction_hooks, with the policy of each layer built by `make(layer)`.
template <class Cache, class MakePolicy, class Backend = kvpolicy::backend::Cpu>
Hooks<Cache> eviction_hooks_by_layer(MakePolicy make, kvpolicy::ExecContext ctx = {}) {
  using Policy = decltype(make(0));
  Hooks<Cache> h;
  auto hooks = std::make_shared<std::vector<Hooks<Cache>>>();
  h.after_prefill = [make, ctx, hooks](Cache& cache, int layer, TensorView<const float, 3> queries, KeepBuffer& keep) -> Status {
    if (hooks->size() <= static_cast<std::size_t>(layer)) hooks->resize(static_cast<std::size_t>(layer) + 1);
    auto& hl = (*hooks)[static_cast<std::size_t>(layer)];
    if (!hl.after_prefill) hl = eviction_hooks<Cache, Policy, Backend>(make(layer), ctx);
    return hl.after_prefill(cache, layer, queries, keep);
  };
  return h;
}

/// Online H2O (heavy hitters + recent window per kv head), see the header comment.
template <class Cache, class Backend = kvpolicy::backend::Cpu>
Hooks<Cache> h2o_hooks(kvpolicy::H2O h2o, kvpolicy::ExecContext ctx = {}) {
  struct State {
    std::vector<std::vector<float>> scores;  // per layer (kv_heads, capacity)
    std::vector<kvpolicy::H2OState> st;
    std::vector<char> fed;  // per layer: on_prefill_attention gave this request's prompt attention
    std::vector<std::byte> ws;
  };
  auto S = std::make_shared<State>();
  auto state_of = [S](Cache& c, int layer) -> kvpolicy::H2OState& {
    const CacheShape& s = c.shape();
    if (S->st.size() < static_cast<std::size_t>(s.n_layers)) {
      S->scores.resize(static_cast<std::size_t>(s.n_layers));
      S->st.resize(static_cast<std::size_t>(s.n_layers));
      S->fed.resize(static_cast<std::size_t>(s.n_layers), 0);
    }
    auto& buf = S->scores[static_cast<std::size_t>(layer)];
    auto& st = S->st[static_cast<std::size_t>(layer)];
    if (buf.empty()) {
      buf.assign(static_cast<std::size_t>(s.num_kv_heads * s.capacity), 0.0f);
      st = kvpolicy::H2OState{TensorView<float, 2>::contiguous(buf.data(), {s.num_kv_heads, s.capacity}), 0};
    }
    return st;
  };
  // Evicts to hh + recent when the cache is larger; fills `keep` only then.
  auto evict = [h2o, ctx, S](Cache& c, kvpolicy::H2OState& st, KeepBuffer& keep) -> Status {
    const std::int64_t n = st.length, kept = h2o.kept_count(n);
    if (kept < 0) return KVP_INVALID("engine h2o: invalid parameters");
    if (kept == n) return Status::ok();
    // Evict alone reads no queries: head_dim 0.
    const kvpolicy::Requirements r =
        h2o.requirements(policy_context<Backend>(ctx), kvpolicy::ProblemShape{c.shape().num_q_heads, c.shape().num_kv_heads, 0, n, 1});
    KVP_RETURN_IF_ERROR(r.status);
    grow_workspace(S->ws, r);
    return h2o.evict(policy_context<Backend>(ctx, &S->ws), st, keep.reserve(r.output.rows, r.output.capacity));
  };
  Hooks<Cache> h;
  // The engine's prefill column sums, when it has them: no recomputation after prefill.
  h.on_prefill_attention = [h2o, ctx, S, state_of](Cache& c, int layer, TensorView<const float, 2> column_sums) -> Status {
    kvpolicy::H2OState& st = state_of(c, layer);
    st.reset();
    kvpolicy::ScoreInput<float, float> in;
    in.column_sums = column_sums;
    KVP_RETURN_IF_ERROR(h2o.update(policy_context<Backend>(ctx), st, in));
    S->fed[static_cast<std::size_t>(layer)] = 1;
    return Status::ok();
  };
  h.after_prefill = [h2o, ctx, S, state_of, evict](Cache& c, int layer, TensorView<const float, 3> queries, KeepBuffer& keep) -> Status {
    using T = typename Cache::element_type;
    kvpolicy::H2OState& fed_state = state_of(c, layer);
    if (S->fed[static_cast<std::size_t>(layer)] != 0) {
      S->fed[static_cast<std::size_t>(layer)] = 0;
      return evict(c, fed_state, keep);
    }
    const KVSource<T> keys = c.key_source(layer);
    if (queries.extent(1) != keys.kv_len())
      return KVP_INVALID("engine h2o: needs every prompt query (%lld of %lld given; PolicyUnderTest::kWholePrompt)",
                         static_cast<long long>(queries.extent(1)), static_cast<long long>(keys.kv_len()));
    kvpolicy::H2OState& st = state_of(c, layer);
    st.reset();
    const kvpolicy::ScoreInput<float, T> in{queries, keys};  // the attention is recomputed from the prompt's queries
    const kvpolicy::ProblemShape shape{queries.extent(0), keys.kv_heads(), keys.head_dim(), keys.kv_len(), queries.extent(1)};
    const kvpolicy::Requirements r = h2o.requirements(policy_context<Backend>(ctx), shape);
    KVP_RETURN_IF_ERROR(r.status);
    grow_workspace(S->ws, r);
    KVP_RETURN_IF_ERROR(h2o.update(policy_context<Backend>(ctx, &S->ws), st, in));
    return evict(c, st, keep);
  };
  h.after_attention = [h2o, ctx, state_of, evict](Cache& c, int layer, TensorView<const float, 2> probs, KeepBuffer& keep) -> Status {
    kvpolicy::H2OState& st = state_of(c, layer);
    kvpolicy::ScoreInput<float, float> in;  // the step's probabilities (Hq, n), summed over its one query row; no keys needed
    in.column_sums = probs;
    KVP_RETURN_IF_ERROR(h2o.update(policy_context<Backend>(ctx), st, in));
    return evict(c, st, keep);
  };
  return h;
}

/// Expected Attention after prefill. The engine caches post-RoPE queries; the
/// policy wants pre-RoPE ones, so the hook rotates each prompt query back by
/// its position (the inverse rotation, angles as the engine computes them) and
/// passes the model's frequencies (base^(-2i/d), fp32) to the policy.
template <class Cache, class Backend = kvpolicy::backend::Cpu>
Hooks<Cache> expected_attention_hooks(kvpolicy::ExpectedAttentionParams params, double rope_base, kvpolicy::ExecContext ctx = {}) {
  using T = typename Cache::element_type;
  struct State {
    std::vector<float> q_pre, cos_t, sin_t, inv_freq;
    std::vector<std::byte> ws;
  };
  auto S = std::make_shared<State>();
  Hooks<Cache> h;
  h.after_prefill = [params, rope_base, ctx, S](Cache& c, int layer, TensorView<const float, 3> queries, KeepBuffer& keep) -> Status {
    const KVSource<T> keys = c.key_source(layer);
    const std::int64_t Hq = queries.extent(0), W = queries.extent(1), d = queries.extent(2), T0 = keys.kv_len() - W;
    if (T0 < 0)
      return KVP_INVALID("engine expected_attention: %lld queries for %lld cached tokens", static_cast<long long>(W),
                         static_cast<long long>(keys.kv_len()));
    const int hd = static_cast<int>(d), half = hd / 2;
    S->q_pre.resize(static_cast<std::size_t>(Hq * W * d));
    S->cos_t.resize(static_cast<std::size_t>(d));
    S->sin_t.resize(static_cast<std::size_t>(d));
    for (std::int64_t t = 0; t < W; ++t) {
      rope_table(T0 + t, hd, rope_base, S->cos_t.data(), S->sin_t.data());
      for (std::int64_t hh = 0; hh < Hq; ++hh) {
        const float* x = &queries(hh, t, 0);
        float* y = S->q_pre.data() + (hh * W + t) * d;
        for (int i = 0; i < half; ++i) {  // inverse of x' = x cos + rotate_half(x) sin
          const float cs = S->cos_t[static_cast<std::size_t>(i)], sn = S->sin_t[static_cast<std::size_t>(i)];
          y[i] = x[i] * cs + x[i + half] * sn;
          y[i + half] = x[i + half] * cs - x[i] * sn;
        }
      }
    }
    S->inv_freq.resize(static_cast<std::size_t>(half));
    for (int i = 0; i < half; ++i) S->inv_freq[static_cast<std::size_t>(i)] = static_cast<float>(1.0 / std::pow(rope_base, 2.0 * i / hd));
    kvpolicy::ExpectedAttentionParams p = params;
    p.rope.inv_freq = S->inv_freq.data();
    const kvpolicy::ExpectedAttention ea(p);
    kvpolicy::ExpectedAttentionInput<float, T> in;
    in.queries = TensorView<const float, 3>::contiguous(S->q_pre.data(), {Hq, W, d});
    in.keys = keys;
    in.values = c.value_source(layer);
    const kvpolicy::ProblemShape shape{Hq, keys.kv_heads(), d, keys.kv_len(), W};
    const kvpolicy::Requirements r = ea.requirements(policy_context<Backend>(ctx), shape);
    KVP_RETURN_IF_ERROR(r.status);
    grow_workspace(S->ws, r);
    return ea.evict(policy_context<Backend>(ctx, &S->ws), in, keep.reserve(r.output.rows, r.output.capacity));
  };
  return h;
}

/// Online TOVA (TOVAParams::original(budget)), see the header comment.
template <class Cache, class Backend = kvpolicy::backend::Cpu>
Hooks<Cache> tova_hooks(kvpolicy::TOVA tova, kvpolicy::ExecContext ctx = {}) {
  auto ws = std::make_shared<std::vector<std::byte>>();
  Hooks<Cache> h = eviction_hooks<Cache, kvpolicy::TOVA, Backend>(tova, ctx);
  h.after_attention = [tova, ctx, ws](Cache& c, int, TensorView<const float, 2> probs, KeepBuffer& keep) -> Status {
    const std::int64_t n = probs.extent(1), Hq = probs.extent(0), H = c.shape().num_kv_heads;
    const std::int64_t kept = tova.kept_count(n);
    if (kept < 0) return KVP_INVALID("engine tova: budget invalid for %lld cached tokens", static_cast<long long>(n));
    if (kept >= n) return Status::ok();
    // The step's probabilities (Hq, n) as (Hq, 1, n) attention rows; keys give the shape only.
    kvpolicy::ScoreInput<float, float> in;
    in.keys = KVSource<float>::shape_only(H, n);
    in.attention = TensorView<const float, 3>(probs.data(), {Hq, 1, n}, {probs.stride(0), n, probs.stride(1)}, probs.device());
    const kvpolicy::Requirements r = tova.requirements(policy_context<Backend>(ctx), kvpolicy::ProblemShape{Hq, H, 0, n, 1});
    KVP_RETURN_IF_ERROR(r.status);
    grow_workspace(*ws, r);
    return tova.evict(policy_context<Backend>(ctx, ws.get()), in, keep.reserve(r.output.rows, r.output.capacity));
  };
  return h;
}

/// Quest on a paged cache: metadata (channel min/max per page and kv head,
/// stored in the key dtype, exact) kept current on every append, rebuilt after
/// a compaction, and a page selection before every decode attention.
template <class T, class Backend = kvpolicy::backend::Cpu>
Hooks<PagedKVCache<T>> quest_hooks(kvpolicy::Quest quest, kvpolicy::ExecContext ctx = {}) {
  using Cache = PagedKVCache<T>;
  struct State {
    std::vector<std::vector<T>> meta;  // per layer, PageMetaView::contiguous storage
    std::vector<std::byte> ws;
  };
  auto st = std::make_shared<State>();
  auto meta_of = [st](Cache& c, int layer) {
    const CacheShape& s = c.shape();
    auto& m = st->meta;
    if (m.size() < static_cast<std::size_t>(s.n_layers)) m.resize(static_cast<std::size_t>(s.n_layers));
    auto& buf = m[static_cast<std::size_t>(layer)];
    const auto n = kvpolicy::PageMetaView<T>::contiguous_size(c.num_pages(), s.num_kv_heads, s.head_dim);
    if (buf.size() != static_cast<std::size_t>(n)) buf.assign(static_cast<std::size_t>(n), T{});
    return kvpolicy::PageMetaView<T>::contiguous(buf.data(), c.num_pages(), s.num_kv_heads, s.head_dim);
  };
  Hooks<Cache> h;
  h.on_append = [quest, meta_of, ctx](Cache& c, int layer, std::int64_t appended) -> Status {
    const std::int32_t n = static_cast<std::int32_t>(appended);
    return quest.on_append(policy_context<Backend>(ctx), kvpolicy::AppendInput<T>{c.const_view(layer), &n}, meta_of(c, layer));
  };
  h.on_compact = [quest, meta_of, ctx](Cache& c, int layer) -> Status {  // rebuild every page of the table
    return quest.on_append(policy_context<Backend>(ctx), kvpolicy::AppendInput<T>{c.const_view(layer), nullptr}, meta_of(c, layer));
  };
  h.before_attention = [quest, meta_of, st, ctx](Cache& c, int layer, TensorView<const float, 3> query, SelectionBuffer& sel) -> Status {
    const CacheShape& s = c.shape();
    const auto& view = c.const_view(layer);
    const kvpolicy::DecodeInput<float> in{query, view.table, c.page_size(), layer};
    kvpolicy::Quest::Plan plan;
    KVP_RETURN_IF_ERROR(
        quest.plan(policy_context<Backend>(ctx), in,
                   kvpolicy::ProblemShape{.num_q_heads = s.num_q_heads, .num_kv_heads = s.num_kv_heads, .head_dim = s.head_dim}, plan));
    grow_workspace(st->ws, plan.requirements);
    sel.reserve(plan.requirements.output.rows, plan.requirements.output.capacity);
    return quest.select(policy_context<Backend>(ctx, &st->ws), plan, in, kvpolicy::PageMetaView<const T>(meta_of(c, layer)), sel.sel);
  };
  return h;
}

/// Quantization of a contiguous or paged cache with any kvpolicy `QuantizationPolicy` whose formats are per token
/// (ggml blocks, fp8 with per-tensor or per-(token, head) scales, token-wise INT4; Hadamard-rotated or not):
/// every token entering a layer (the prompt's at on_append, then each decode token) is stored in the policy's
/// format — its K rows by `keys`, its V rows by `values`, quantized, then dequantized back into the engine's
/// fp32 rows, which the engine attends over. Numerically this is the attention over the quantized cache
/// (each row decoded exactly as a fused kernel would; a rotated format's rows decoded and rotated back equal
/// attending with the rotated query, up to fp32 rounding); the engine's memory accounting comes from
/// `PolicyUnderTest::kv_bytes_scale`. Composes with eviction through `combine` (on_append runs before
/// after_prefill, so an eviction scores the quantized keys). `layer_on` (optional) says which layers are
/// quantized at all (the per-layer switch: the rest stay in full precision).
template <class Cache, class QPolicy, class Backend = kvpolicy::backend::Cpu>
Hooks<Cache> quantize_hooks(QPolicy keys, QPolicy values, kvpolicy::ExecContext ctx = {}, std::function<bool(int)> layer_on = {}) {
  Hooks<Cache> h;
  auto buf = std::make_shared<std::vector<std::uint8_t>>();
  h.on_append = [keys, values, ctx, buf, layer_on](Cache& cache, int layer, std::int64_t appended) -> Status {
    if (layer_on && !layer_on(layer)) return Status::ok();
    const std::int64_t len = cache.uniform_length(layer);
    for (int role = 0; role < 2; ++role) {
      const QPolicy& policy = role == 0 ? keys : values;
      if constexpr (Cache::kPaged) {  // row by row at the tokens' slots of the page pool
        const auto& v = cache.view(layer);
        const std::int64_t H = v.num_kv_heads, d = v.head_dim, rb = policy.row_bytes(d);
        buf->resize(static_cast<std::size_t>(rb));
        for (std::int64_t hh = 0; hh < H; ++hh)
          for (std::int64_t t = len - appended; t < len; ++t) {
            float* row = role == 0 ? v.key(0, static_cast<std::int32_t>(hh), t) : v.value(0, static_cast<std::int32_t>(hh), t);
            const auto rv = kvpolicy::TensorView<float, 3>::contiguous(row, {1, 1, d});
            kvpolicy::QuantizedKV q{policy.layout(), kvpolicy::TensorView<std::uint8_t, 3>::contiguous(buf->data(), {1, 1, rb}), {}, 1};
            typename QPolicy::State st{};
            KVP_RETURN_IF_ERROR(policy.quantize(policy_context<Backend>(ctx), kvpolicy::TensorView<const float, 3>(rv), st, q));
            KVP_RETURN_IF_ERROR(policy.dequantize(policy_context<Backend>(ctx), q, rv));
          }
      } else {
        const auto rows = (role == 0 ? cache.keys(layer) : cache.values(layer)).narrow(1, len - appended, appended);
        const std::int64_t H = rows.extent(0), d = rows.extent(2), rb = policy.row_bytes(d);
        buf->resize(static_cast<std::size_t>(H * appended * rb));
        kvpolicy::QuantizedKV q{
            policy.layout(), kvpolicy::TensorView<std::uint8_t, 3>::contiguous(buf->data(), {H, appended, rb}), {}, appended};
        typename QPolicy::State st{};
        KVP_RETURN_IF_ERROR(policy.quantize(policy_context<Backend>(ctx), kvpolicy::TensorView<const float, 3>(rows), st, q));
        KVP_RETURN_IF_ERROR(policy.dequantize(policy_context<Backend>(ctx), q, rows));
      }
    }
    return Status::ok();
  };
  return h;
}
/// One policy for both K and V.
template <class Cache, class QPolicy, class Backend = kvpolicy::backend::Cpu>
Hooks<Cache> quantize_hooks(QPolicy policy, kvpolicy::ExecContext ctx = {}) {
  return quantize_hooks<Cache, QPolicy, Backend>(policy, policy, ctx, {});
}

/// Mixed precision after prefill (kvpolicy::MixedPrecision: any scorer ranks, the top tokens stay in full
/// precision, the next are stored in the per-token format, the rest evicted, on the policy's byte budget):
/// the low tier's K rows (by `keys`) and V rows (by `values`) are quantized and decoded back in place, then
/// the engine compacts with the KeepSet.
template <class Cache, class S, class Q, class Backend = kvpolicy::backend::Cpu>
Hooks<Cache> mixed_precision_hooks(kvpolicy::MixedPrecision<S, Q> policy, Q keys, Q values, kvpolicy::ExecContext ctx = {}) {
  using T = typename Cache::element_type;
  Hooks<Cache> h;
  auto ws = std::make_shared<std::vector<std::byte>>();
  auto full = std::make_shared<std::vector<std::uint8_t>>();
  auto buf = std::make_shared<std::vector<std::uint8_t>>();
  h.after_prefill = [policy, keys, values, ctx, ws, full, buf](Cache& cache, int layer, TensorView<const float, 3> queries,
                                                               KeepBuffer& keep) -> Status {
    const KVSource<T> src = cache.key_source(layer);
    const std::int64_t W = queries.extent(1);
    kvpolicy::ProblemShape shape{queries.extent(0), src.kv_heads(), src.head_dim(), src.kv_len(), W};
    kvpolicy::Requirements r = policy.requirements(policy_context<Backend>(ctx), shape);
    KVP_RETURN_IF_ERROR(r.status);
    const std::int64_t w = std::min(r.query_window > 0 ? r.query_window : W, W);
    if (w != shape.q_len) {
      shape.q_len = w;
      r = policy.requirements(policy_context<Backend>(ctx), shape);
      KVP_RETURN_IF_ERROR(r.status);
    }
    const kvpolicy::ScoreInput<float, T> in{queries.narrow(1, W - w, w), src};
    grow_workspace(*ws, r);
    keep.reserve(r.output.rows, r.output.capacity);
    full->assign(static_cast<std::size_t>(r.output.capacity), 0);
    KVP_RETURN_IF_ERROR(policy.decide(policy_context<Backend>(ctx, ws.get()), in, keep.set, *full));
    const std::int64_t d = src.head_dim();
    for (std::int64_t hh = 0; hh < keep.set.num_rows; ++hh)
      for (std::int32_t i = keep.set.indptr[hh]; i < keep.set.indptr[hh + 1]; ++i) {
        if ((*full)[static_cast<std::size_t>(i)] != 0) continue;
        const std::int64_t j = keep.set.indices[i];
        for (int role = 0; role < 2; ++role) {
          const Q& q = role == 0 ? keys : values;
          const auto row = (role == 0 ? cache.keys(layer) : cache.values(layer)).narrow(0, hh, 1).narrow(1, j, 1);
          buf->resize(static_cast<std::size_t>(q.row_bytes(d)));
          kvpolicy::QuantizedKV region{
              q.layout(), kvpolicy::TensorView<std::uint8_t, 3>::contiguous(buf->data(), {1, 1, q.row_bytes(d)}), {}, 1};
          typename Q::State st{};
          KVP_RETURN_IF_ERROR(q.quantize(policy_context<Backend>(ctx), kvpolicy::TensorView<const float, 3>(row), st, region));
          KVP_RETURN_IF_ERROR(q.dequantize(policy_context<Backend>(ctx), region, row));
        }
      }
    return Status::ok();
  };
  return h;
}

// ---- merging: eviction, then the evicted tokens folded into the kept ones --------------------------------

namespace detail {
template <class M>
inline constexpr bool kMergeReadsAttention = std::is_same_v<M, kvpolicy::CaM> || std::is_same_v<M, kvpolicy::KvpressCAM>;
template <class M>
inline constexpr bool kMergeWritesKeys = !std::is_same_v<M, kvpolicy::KvpressMerging> && !kMergeReadsAttention<M>;
}  // namespace detail

/// Per-layer merge state of one request: D2O's EMA threshold, the nearest-kept merge's per-slot masses
/// ((kv_heads, capacity), 1 for every token entering the cache, re-packed by each merge), the accumulated
/// attention CaM reads ((kv_heads, capacity) as an H2OState: H2O's update is the accumulation; summed over
/// each kv head's query heads, aligned with the cache slots and re-packed with them), and the plan buffers.
struct MergeHookState {
  std::vector<kvpolicy::D2OState> d2o;      // per layer
  std::vector<std::vector<float>> masses;   // per layer (kv_heads, capacity)
  std::vector<std::vector<float>> acc_buf;  // per layer (kv_heads, capacity)
  std::vector<kvpolicy::H2OState> acc;      // per layer, over acc_buf
  std::vector<std::int64_t> steps;          // per layer: decode steps since the last compression (kvpress CAM)
  std::vector<std::uint32_t> calls;         // per layer: merges so far (the Bernoulli seed of the next one)
  std::vector<char> fed;                    // per layer: on_prefill_attention reset the layer and filled acc
  std::vector<std::int32_t> indptr, dst, src;
  std::vector<float> weight, merged_k, merged_v, scores;
  std::vector<std::byte> ws, acc_ws, paged_ws;

  void reset(int layer, std::int64_t kv_heads, std::int64_t capacity) {
    const auto l = static_cast<std::size_t>(layer);
    if (d2o.size() <= l)
      d2o.resize(l + 1), masses.resize(l + 1), acc_buf.resize(l + 1), acc.resize(l + 1), steps.resize(l + 1), calls.resize(l + 1),
          fed.resize(l + 1, 0);
    d2o[l] = kvpolicy::D2OState{};
    masses[l].assign(static_cast<std::size_t>(kv_heads * capacity), 1.0f);
    acc_buf[l].assign(static_cast<std::size_t>(kv_heads * capacity), 0.0f);
    acc[l] = kvpolicy::H2OState{TensorView<float, 2>::contiguous(acc_buf[l].data(), {kv_heads, capacity}), 0};
    steps[l] = 0;
    calls[l] = 0;
    fed[l] = 0;
  }
  /// The prompt's column sums (Hq, T) into the layer's accumulated attention (after reset).
  template <class Backend>
  Status accumulate_prompt(int layer, TensorView<const float, 2> column_sums, kvpolicy::ExecContext ctx) {
    kvpolicy::ScoreInput<float, float> in;
    in.column_sums = column_sums;
    KVP_RETURN_IF_ERROR(kvpolicy::H2O{}.update(policy_context<Backend>(ctx), acc[static_cast<std::size_t>(layer)], in));
    fed[static_cast<std::size_t>(layer)] = 1;
    return Status::ok();
  }
  /// The prompt's attention recomputed from every prompt query (when the engine gave no column sums).
  template <class Backend, class T>
  Status accumulate_queries(int layer, TensorView<const float, 3> queries, KVSource<T> keys, const char* who, kvpolicy::ExecContext ctx) {
    if (queries.extent(1) != keys.kv_len())
      return KVP_INVALID(
          "engine %s: needs the prompt's attention column sums (PrefillOptions::column_sums) or every prompt query "
          "(%lld of %lld given; PolicyUnderTest::kWholePrompt)",
          who, static_cast<long long>(queries.extent(1)), static_cast<long long>(keys.kv_len()));
    const kvpolicy::H2O h2o;
    const kvpolicy::ProblemShape shape{queries.extent(0), keys.kv_heads(), keys.head_dim(), keys.kv_len(), queries.extent(1)};
    const kvpolicy::Requirements r = h2o.requirements(policy_context<Backend>(ctx), shape);
    KVP_RETURN_IF_ERROR(r.status);
    grow_workspace(acc_ws, r);
    return h2o.update(policy_context<Backend>(ctx, &acc_ws), acc[static_cast<std::size_t>(layer)],
                      kvpolicy::ScoreInput<float, T>{queries, keys});
  }
  /// The Bernoulli seed of the next merge of `layer`: distinct per (layer, call), the same in every run.
  std::uint32_t next_seed(int layer) {
    return 0x9E3779B9u * (static_cast<std::uint32_t>(layer) + 1u) + calls[static_cast<std::size_t>(layer)]++;
  }
  /// After a keep set is applied: the accumulated attention follows the kept slots (row h, slot c <- keep.row(h)[c]).
  void repack_attention(int layer, const KeepSet& keep) {
    auto& st = acc[static_cast<std::size_t>(layer)];
    if (st.length == 0) return;
    for (std::int64_t h = 0; h < keep.num_rows; ++h) {
      const auto row = keep.row(h);
      for (std::size_t c = 0; c < row.size(); ++c) st.scores(h, static_cast<std::int64_t>(c)) = st.scores(h, row[c]);
    }
    st.length = keep.num_rows > 0 ? keep.row_size(0) : 0;
  }
};

template <class Policy, class T>
auto merge_input_for(const Policy&, KVSource<T> keys, KVSource<T> values, MergeHookState& st, int layer, std::int64_t capacity) {
  const auto l = static_cast<std::size_t>(layer);
  if constexpr (std::is_same_v<Policy, kvpolicy::D2O>) {
    kvpolicy::D2OInput<T> in;
    in.keys = keys;
    in.values = values;
    in.state = &st.d2o[l];
    return in;
  } else if constexpr (std::is_same_v<Policy, kvpolicy::NearestKeptMerge>) {
    kvpolicy::NearestKeptInput<T> in;
    in.keys = keys;
    in.values = values;
    in.state.weights = TensorView<float, 2>::contiguous(st.masses[l].data(), {keys.kv_heads(), capacity});
    return in;
  } else {
    kvpolicy::MergeInput<T> in;
    in.keys = keys;
    in.values = values;
    if constexpr (detail::kMergeReadsAttention<Policy>) {
      const auto& a = st.acc[l];
      in.attention_sums = TensorView<const float, 2>(a.scores.narrow(1, 0, a.length));
      in.seed = st.next_seed(layer);
    }
    return in;
  }
}

/// Runs `merge` on the layer's cache for the filled keep set and writes the merged rows into the kept slots
/// (before the engine compacts with the same KeepSet): apply::merge_contiguous or apply::merge_paged.
template <class Cache, class MergeP, class Backend, class In>
Status run_merge(Cache& cache, int layer, std::int64_t num_q_heads, const MergeP& merge, const In& in, const KeepSet& keep,
                 MergeHookState& S, kvpolicy::ExecContext ctx) {
  constexpr bool kMergesKeys = detail::kMergeWritesKeys<MergeP>;
  const std::int64_t H = cache.shape().num_kv_heads, T = cache.uniform_length(layer), d = cache.shape().head_dim;
  const kvpolicy::Requirements r = merge.requirements(policy_context<Backend>(ctx), kvpolicy::ProblemShape{num_q_heads, H, d, T, 1});
  KVP_RETURN_IF_ERROR(r.status);
  grow_workspace(S.ws, r);
  std::int64_t slots = 0;
  for (std::int64_t row = 0; row < keep.num_rows; ++row) slots = std::max<std::int64_t>(slots, keep.row_size(row));
  S.indptr.assign(static_cast<std::size_t>(H + 1), 0);
  S.dst.resize(static_cast<std::size_t>(r.output.capacity));
  S.src.resize(static_cast<std::size_t>(r.output.capacity));
  S.weight.resize(static_cast<std::size_t>(r.output.capacity));
  S.merged_k.resize(kMergesKeys ? static_cast<std::size_t>(H * slots * d) : 0);
  S.merged_v.resize(static_cast<std::size_t>(H * slots * d));
  kvpolicy::MergePlan plan{S.indptr.data(), S.dst.data(), S.src.data(), S.weight.data(), H, r.output.capacity};
  if (kMergesKeys) plan.merged_keys = TensorView<float, 2>::contiguous(S.merged_k.data(), {H * slots, d});
  plan.merged_values = TensorView<float, 2>::contiguous(S.merged_v.data(), {H * slots, d});
  plan.slots_per_row = slots;
  KVP_RETURN_IF_ERROR(merge.merge(policy_context<Backend>(ctx, &S.ws), in, keep, plan));
  if constexpr (Cache::kPaged) {
    S.paged_ws.resize(kvpolicy::compact_paged_workspace(cache.num_pages()));
    return kvpolicy::merge_paged(cache.view(layer), keep, plan, kvpolicy::Workspace{S.paged_ws.data(), S.paged_ws.size()});
  } else {
    return kvpolicy::merge_contiguous(cache.keys(layer), cache.values(layer), T, keep, 0, plan, kvpolicy::MergeSlots::kBeforeCompaction);
  }
}

/// Wraps `inner` (any eviction hooks: one-shot after prefill, online after every decode attention): whenever
/// an inner hook fills the KeepBuffer, `merge` (a kvpolicy `MergePolicy`: KvpressMerging, LookMPivot, D2O,
/// NearestKeptMerge, CaM in its streaming form) folds the evicted tokens into the kept ones and
/// apply::merge_contiguous / apply::merge_paged writes the merged rows into the kept slots before the engine
/// compacts with the same KeepSet (keys merged post-RoPE, at the kept token's logical position). D2O's
/// threshold and the nearest-kept masses persist across a request's decode steps (reset after prefill); a
/// token appended at decode enters with mass 1. CaM reads the accumulated attention of every cached token:
/// the prompt's (recomputed from every prompt query after prefill, so the policy needs
/// PolicyUnderTest::kWholePrompt) plus every decode step's; its Bernoulli draws are seeded per (layer, merge
/// call), so runs are deterministic. Contiguous and paged caches (a paged cache needs equal counts per head).
template <class Cache, class MergeP, class Backend = kvpolicy::backend::Cpu>
Hooks<Cache> merge_after(Hooks<Cache> inner, MergeP merge, kvpolicy::ExecContext ctx = {}) {
  constexpr bool kAttention = detail::kMergeReadsAttention<MergeP>;
  auto S = std::make_shared<MergeHookState>();
  auto run = [merge, ctx, S](Cache& cache, int layer, std::int64_t num_q_heads, KeepBuffer& keep) -> Status {
    const auto in = merge_input_for(merge, cache.key_source(layer), cache.value_source(layer), *S, layer, cache.shape().capacity);
    KVP_RETURN_IF_ERROR((run_merge<Cache, MergeP, Backend>(cache, layer, num_q_heads, merge, in, keep.set, *S, ctx)));
    if constexpr (kAttention) S->repack_attention(layer, keep.set);
    return Status::ok();
  };
  Hooks<Cache> h = inner;
  if constexpr (kAttention)
    h.on_prefill_attention = [f = inner.on_prefill_attention, S, ctx](Cache& cache, int layer, TensorView<const float, 2> cs) -> Status {
      if (f) KVP_RETURN_IF_ERROR(f(cache, layer, cs));
      S->reset(layer, cache.shape().num_kv_heads, cache.shape().capacity);
      return S->template accumulate_prompt<Backend>(layer, cs, ctx);
    };
  h.after_prefill = [f = inner.after_prefill, run, S, ctx](Cache& cache, int layer, TensorView<const float, 3> queries,
                                                           KeepBuffer& keep) -> Status {
    const bool fed = static_cast<std::size_t>(layer) < S->fed.size() && S->fed[static_cast<std::size_t>(layer)] != 0;
    if (!fed) {
      S->reset(layer, cache.shape().num_kv_heads, cache.shape().capacity);
      // The prompt's attention, column sums recomputed from every prompt query (causal).
      if constexpr (kAttention)
        KVP_RETURN_IF_ERROR(S->template accumulate_queries<Backend>(layer, queries, cache.key_source(layer), MergeP::kName, ctx));
    }
    S->fed[static_cast<std::size_t>(layer)] = 0;
    if (f) KVP_RETURN_IF_ERROR(f(cache, layer, queries, keep));
    return keep.active ? run(cache, layer, queries.extent(0), keep) : Status::ok();
  };
  if (inner.after_attention || kAttention)
    h.after_attention = [f = inner.after_attention, run, S, ctx](Cache& cache, int layer, TensorView<const float, 2> probs,
                                                                 KeepBuffer& keep) -> Status {
      if constexpr (kAttention) {  // this step's weights join the accumulated attention
        kvpolicy::ScoreInput<float, float> in;
        in.column_sums = probs;
        KVP_RETURN_IF_ERROR(kvpolicy::H2O{}.update(policy_context<Backend>(ctx), S->acc[static_cast<std::size_t>(layer)], in));
      }
      if (f) KVP_RETURN_IF_ERROR(f(cache, layer, probs, keep));
      return keep.active ? run(cache, layer, probs.extent(0), keep) : Status::ok();
    };
  h.on_append = [f = inner.on_append, S](Cache& cache, int layer, std::int64_t appended) -> Status {
    if (f) KVP_RETURN_IF_ERROR(f(cache, layer, appended));
    const auto l = static_cast<std::size_t>(layer);
    if (l < S->masses.size() && !S->masses[l].empty()) {  // decode: the new tokens enter with mass 1
      const std::int64_t cap = cache.shape().capacity, len = cache.uniform_length(layer);
      for (std::int64_t hh = 0; hh < cache.shape().num_kv_heads; ++hh)
        for (std::int64_t j = std::max<std::int64_t>(len - appended, 0); j < len; ++j)
          S->masses[l][static_cast<std::size_t>(hh * cap + j)] = 1.0f;
    }
    return Status::ok();
  };
  return h;
}

/// After prefill: `policy` evicts as in eviction_hooks, then `merge` folds (merge_after over eviction_hooks).
template <class Cache, class Policy, class MergeP, class Backend = kvpolicy::backend::Cpu>
Hooks<Cache> merge_hooks(Policy policy, MergeP merge, kvpolicy::ExecContext ctx = {}) {
  return merge_after<Cache, MergeP, Backend>(eviction_hooks<Cache, Policy, Backend>(policy, ctx), merge, ctx);
}

/// One composed policy at one hook (kvpolicy::Compress<SnapKV, M, Q>, policy/pipeline.hpp): after prefill,
/// per layer, SnapKV evicts to the pipeline's budget (tokens, or the tokens whose quantized K + V fit a byte
/// budget), `M` merges what it dropped into what it kept, the pipeline merges and compacts the cache in place
/// and quantizes the kept rows into codes; the hook decodes the codes back into the engine's fp32 rows (the
/// engine attends over them, as quantize_hooks does) and hands the cache its new lengths. No KeepSet goes back
/// to the engine: the pipeline compacted already. Contiguous cache (Compress works on a contiguous one).
template <class M, class Q, class Backend = kvpolicy::backend::Cpu>
Hooks<ContiguousKVCache<float>> pipeline_hooks(kvpolicy::Compress<kvpolicy::SnapKV, M, Q> pipeline, kvpolicy::ExecContext ctx = {}) {
  using Cache = ContiguousKVCache<float>;
  struct State {
    MergeHookState m;
    KeepBuffer keep;
    std::vector<std::uint8_t> kc, vc;
    std::vector<std::int64_t> lens;
  };
  auto S = std::make_shared<State>();
  Hooks<Cache> h;
  h.after_prefill = [pipeline, ctx, S](Cache& cache, int layer, TensorView<const float, 3> queries, KeepBuffer&) -> Status {
    const KVSource<float> keys = cache.key_source(layer), values = cache.value_source(layer);
    const std::int64_t H = keys.kv_heads(), T = keys.kv_len(), d = keys.head_dim(), W = queries.extent(1);
    kvpolicy::ProblemShape shape{queries.extent(0), H, d, T, W};
    kvpolicy::Requirements r = pipeline.requirements(policy_context<Backend>(ctx), shape);
    KVP_RETURN_IF_ERROR(r.status);
    const std::int64_t w = std::min(r.query_window > 0 ? r.query_window : W, W);
    if (w != W) {
      shape.q_len = w;
      r = pipeline.requirements(policy_context<Backend>(ctx), shape);
      KVP_RETURN_IF_ERROR(r.status);
    }
    const kvpolicy::Requirements rm = pipeline.merging().requirements(policy_context<Backend>(ctx), shape);
    KVP_RETURN_IF_ERROR(rm.status);
    grow_workspace(S->m.ws, r);
    grow_workspace(S->m.ws, rm);
    const std::int64_t n = pipeline.kept_tokens(T, d);
    S->keep.reserve(r.output.rows, r.output.capacity);
    auto& M_ = S->m;
    M_.indptr.assign(static_cast<std::size_t>(H + 1), 0);
    M_.dst.resize(static_cast<std::size_t>(rm.output.capacity));
    M_.src.resize(static_cast<std::size_t>(rm.output.capacity));
    M_.weight.resize(static_cast<std::size_t>(rm.output.capacity));
    M_.merged_v.resize(static_cast<std::size_t>(H * n * d));
    kvpolicy::MergePlan plan{M_.indptr.data(), M_.dst.data(), M_.src.data(), M_.weight.data(), H, rm.output.capacity};
    if constexpr (detail::kMergeWritesKeys<M>) {
      M_.merged_k.resize(static_cast<std::size_t>(H * n * d));
      plan.merged_keys = TensorView<float, 2>::contiguous(M_.merged_k.data(), {H * n, d});
    }
    plan.merged_values = TensorView<float, 2>::contiguous(M_.merged_v.data(), {H * n, d});
    plan.slots_per_row = n;
    const Q& q = pipeline.quantization();
    const std::int64_t rb = q.row_bytes(d);
    S->kc.assign(static_cast<std::size_t>(H * n * rb), 0);
    S->vc.assign(S->kc.size(), 0);
    kvpolicy::CompressOutput out;
    out.keep = S->keep.set;
    out.plan = plan;
    out.keys = kvpolicy::QuantizedKV{q.layout(), kvpolicy::TensorView<std::uint8_t, 3>::contiguous(S->kc.data(), {H, n, rb}), {}, n};
    out.values = kvpolicy::QuantizedKV{q.layout(), kvpolicy::TensorView<std::uint8_t, 3>::contiguous(S->vc.data(), {H, n, rb}), {}, n};
    S->lens.assign(static_cast<std::size_t>(H), 0);
    out.new_lens = S->lens;
    kvpolicy::MergeInput<float> min;
    min.keys = keys;
    min.values = values;
    const kvpolicy::ScoreInput<float, float> in{queries.narrow(1, W - w, w), keys};
    KVP_RETURN_IF_ERROR(pipeline.run(policy_context<Backend>(ctx, &M_.ws), in, min,
                                     kvpolicy::CompressCache<float>{cache.keys(layer), cache.values(layer), cache.positions(layer), T},
                                     out));
    cache.adopt_lengths(layer, S->lens);
    // The engine attends over the stored format: decode the codes back into the kept rows.
    KVP_RETURN_IF_ERROR(q.dequantize(policy_context<Backend>(ctx), out.keys, cache.keys(layer).narrow(1, 0, n)));
    return q.dequantize(policy_context<Backend>(ctx), out.values, cache.values(layer).narrow(1, 0, n));
  };
  return h;
}

/// D2O whole (kvpolicy::D2O): the layer's token-level policy `at(layer)` (its heavy / recent split, e.g. from
/// D2O::layer_ratios at prefill) evicts by accumulated attention with the first `sinks` tokens protected
/// (D2O::evict) and merges every evicted token into its nearest kept one under the EMA threshold (D2O::merge),
/// after prefill and then at every decode step once the cache holds more than heavy + recent. The accumulated
/// attention is the prompt's (recomputed from every prompt query: PolicyUnderTest::kWholePrompt) plus every
/// decode step's, summed over each kv head's query heads, and follows the cache through each compaction.
/// Contiguous and paged caches.
template <class Cache, class Backend = kvpolicy::backend::Cpu>
Hooks<Cache> d2o_hooks(std::function<kvpolicy::D2O(int)> at, kvpolicy::ExecContext ctx = {}) {
  auto S = std::make_shared<MergeHookState>();
  auto step = [at, ctx, S](Cache& cache, int layer, std::int64_t num_q_heads, KeepBuffer& keep) -> Status {
    const kvpolicy::D2O d2o = at(layer);
    const auto& acc = S->acc[static_cast<std::size_t>(layer)];
    const std::int64_t n = acc.length, H = cache.shape().num_kv_heads;
    if (d2o.kept_count(n) == n) return Status::ok();
    S->acc_ws.resize(kvpolicy::D2O::evict_workspace(n));
    keep.reserve(H, H * d2o.kept_count(n));
    KVP_RETURN_IF_ERROR(d2o.evict(TensorView<const float, 2>(acc.scores.narrow(1, 0, n)), keep.set,
                                  kvpolicy::Workspace{S->acc_ws.data(), S->acc_ws.size()}));
    const auto in = merge_input_for(d2o, cache.key_source(layer), cache.value_source(layer), *S, layer, cache.shape().capacity);
    KVP_RETURN_IF_ERROR((run_merge<Cache, kvpolicy::D2O, Backend>(cache, layer, num_q_heads, d2o, in, keep.set, *S, ctx)));
    S->repack_attention(layer, keep.set);
    return Status::ok();
  };
  Hooks<Cache> h;
  h.on_prefill_attention = [S, ctx](Cache& cache, int layer, TensorView<const float, 2> cs) -> Status {
    S->reset(layer, cache.shape().num_kv_heads, cache.shape().capacity);
    return S->template accumulate_prompt<Backend>(layer, cs, ctx);
  };
  h.after_prefill = [step, S, ctx](Cache& cache, int layer, TensorView<const float, 3> queries, KeepBuffer& keep) -> Status {
    const bool fed = static_cast<std::size_t>(layer) < S->fed.size() && S->fed[static_cast<std::size_t>(layer)] != 0;
    if (!fed) {
      S->reset(layer, cache.shape().num_kv_heads, cache.shape().capacity);
      KVP_RETURN_IF_ERROR(S->template accumulate_queries<Backend>(layer, queries, cache.key_source(layer), "d2o", ctx));
    }
    S->fed[static_cast<std::size_t>(layer)] = 0;
    return step(cache, layer, queries.extent(0), keep);
  };
  h.after_attention = [step, S, ctx](Cache& cache, int layer, TensorView<const float, 2> probs, KeepBuffer& keep) -> Status {
    kvpolicy::ScoreInput<float, float> in;
    in.column_sums = probs;
    KVP_RETURN_IF_ERROR(kvpolicy::H2O{}.update(policy_context<Backend>(ctx), S->acc[static_cast<std::size_t>(layer)], in));
    return step(cache, layer, probs.extent(0), keep);
  };
  return h;
}

/// kvpress CAMPress(KnormPress(), compression_interval, target_size, merge_budget) in the decode loop, as
/// kvpress 0.5.5 runs it (a DecodingPress: the prompt is not compressed at prefill): from the first decode
/// step each layer accumulates its attention weights (summed over each kv head's query heads; kvpress means
/// them, which CaM's ratios do not see), and once `interval` steps have passed and the cache holds more than
/// `target_size` tokens, the base press scores every cached token (KnormPress: -||k||_2, fp64 sum), the
/// kvpress_cam policy evicts to `target_size` tokens shared by every kv head, merges the `interval` newest
/// candidates' values into their next kept neighbours, and the engine compacts. Bernoulli draws: torch's CPU
/// generator (KvpressCAM's TorchBernoulli), seeded per (layer, compression) instead of kvpress's global
/// generator state, so a run is deterministic. Contiguous and paged caches.
template <class Cache, class Backend = kvpolicy::backend::Cpu>
Hooks<Cache> kvpress_cam_hooks(kvpolicy::KvpressCAM cam, std::int64_t target_size, std::int64_t interval, kvpolicy::ExecContext ctx = {}) {
  using T = typename Cache::element_type;
  auto S = std::make_shared<MergeHookState>();
  Hooks<Cache> h;
  h.after_prefill = [S](Cache& cache, int layer, TensorView<const float, 3>, KeepBuffer&) -> Status {
    S->reset(layer, cache.shape().num_kv_heads, cache.shape().capacity);
    return Status::ok();
  };
  h.after_attention = [cam, target_size, interval, ctx, S](Cache& cache, int layer, TensorView<const float, 2> probs,
                                                           KeepBuffer& keep) -> Status {
    if (target_size < 1 || interval < 1)
      return KVP_INVALID("engine kvpress_cam: target_size %lld and interval %lld must be >= 1", static_cast<long long>(target_size),
                         static_cast<long long>(interval));
    const auto l = static_cast<std::size_t>(layer);
    kvpolicy::ScoreInput<float, float> acc_in;
    acc_in.column_sums = probs;
    KVP_RETURN_IF_ERROR(kvpolicy::H2O{}.update(policy_context<Backend>(ctx), S->acc[l], acc_in));
    const std::int64_t n = probs.extent(1), H = cache.shape().num_kv_heads;
    if (++S->steps[l] < interval || n <= target_size) return Status::ok();
    // KnormPress scores: -||k||_2 per (kv head, token).
    const KVSource<T> keys = cache.key_source(layer);
    S->scores.resize(static_cast<std::size_t>(H * n));
    for (std::int64_t hh = 0; hh < H; ++hh) {
      const auto rows = keys.rows(hh);
      for (std::int64_t j = 0; j < n; ++j) {
        const T* k = rows.row(j);
        double q = 0.0;
        for (std::int64_t i = 0; i < keys.head_dim(); ++i) q += static_cast<double>(kvpolicy::to_float(k[i])) * kvpolicy::to_float(k[i]);
        S->scores[static_cast<std::size_t>(hh * n + j)] = -static_cast<float>(std::sqrt(q));
      }
    }
    const auto scores = TensorView<const float, 2>::contiguous(S->scores.data(), {H, n});
    keep.reserve(H, H * target_size);
    S->acc_ws.resize(kvpolicy::KvpressCAM::evict_workspace(n));
    KVP_RETURN_IF_ERROR(cam.evict(scores, target_size, keep.set, kvpolicy::Workspace{S->acc_ws.data(), S->acc_ws.size()}));
    kvpolicy::MergeInput<T> in;
    in.keys = keys;
    in.values = cache.value_source(layer);
    const auto& a = S->acc[l];
    in.attention_sums = TensorView<const float, 2>(a.scores.narrow(1, 0, a.length));
    in.scores = scores;
    in.new_tokens = S->steps[l];
    in.seed = S->next_seed(layer);
    KVP_RETURN_IF_ERROR((run_merge<Cache, kvpolicy::KvpressCAM, Backend>(cache, layer, probs.extent(0), cam, in, keep.set, *S, ctx)));
    S->repack_attention(layer, keep.set);
    S->steps[l] = 0;
    return Status::ok();
  };
  return h;
}

// ---- compiled once, in policies.cpp (kvp_engine_lib) ----------------------------

// One list for both sides: `KVP_ENGINE_HOOKS_FOR(extern, C)` declares, `KVP_ENGINE_HOOKS_FOR(, C)` defines.
#define KVP_ENGINE_HOOKS_FOR(EXTERN, C)                                                                                                    \
  EXTERN template Hooks<C> eviction_hooks<C, kvpolicy::SnapKV, kvpolicy::backend::Cpu>(kvpolicy::SnapKV, kvpolicy::ExecContext,            \
                                                                                       std::int64_t);                                      \
  EXTERN template Hooks<C> eviction_hooks<C, kvpolicy::TOVA, kvpolicy::backend::Cpu>(kvpolicy::TOVA, kvpolicy::ExecContext, std::int64_t); \
  EXTERN template Hooks<C> eviction_hooks<C, kvpolicy::backend::Cpu>(kvpolicy::AnyEvictionPolicy, kvpolicy::ExecContext, std::int64_t);    \
  EXTERN template Hooks<C> h2o_hooks<C, kvpolicy::backend::Cpu>(kvpolicy::H2O, kvpolicy::ExecContext);                                     \
  EXTERN template Hooks<C> tova_hooks<C, kvpolicy::backend::Cpu>(kvpolicy::TOVA, kvpolicy::ExecContext);                                   \
  EXTERN template Hooks<C> expected_attention_hooks<C, kvpolicy::backend::Cpu>(kvpolicy::ExpectedAttentionParams, double,                  \
                                                                               kvpolicy::ExecContext);

KVP_ENGINE_HOOKS_FOR(extern, ContiguousKVCache<float>)
KVP_ENGINE_HOOKS_FOR(extern, PagedKVCache<float>)
extern template Hooks<PagedKVCache<float>> quest_hooks<float, kvpolicy::backend::Cpu>(kvpolicy::Quest, kvpolicy::ExecContext);
#define KVP_ENGINE_QUANT_HOOKS_FOR(EXTERN, Q)                                                                          \
  EXTERN template Hooks<ContiguousKVCache<float>> quantize_hooks<ContiguousKVCache<float>, Q, kvpolicy::backend::Cpu>( \
      Q, Q, kvpolicy::ExecContext, std::function<bool(int)>);
KVP_ENGINE_QUANT_HOOKS_FOR(extern, kvpolicy::GgmlQuant)
KVP_ENGINE_QUANT_HOOKS_FOR(extern, kvpolicy::Fp8Quant)
KVP_ENGINE_QUANT_HOOKS_FOR(extern, kvpolicy::Int4Quant)
extern template Hooks<PagedKVCache<float>> quantize_hooks<PagedKVCache<float>, kvpolicy::GgmlQuant, kvpolicy::backend::Cpu>(
    kvpolicy::GgmlQuant, kvpolicy::GgmlQuant, kvpolicy::ExecContext, std::function<bool(int)>);
extern template Hooks<PagedKVCache<float>> quantize_hooks<PagedKVCache<float>, kvpolicy::Fp8Quant, kvpolicy::backend::Cpu>(
    kvpolicy::Fp8Quant, kvpolicy::Fp8Quant, kvpolicy::ExecContext, std::function<bool(int)>);
extern template Hooks<PagedKVCache<float>> quantize_hooks<PagedKVCache<float>, kvpolicy::Int4Quant, kvpolicy::backend::Cpu>(
    kvpolicy::Int4Quant, kvpolicy::Int4Quant, kvpolicy::ExecContext, std::function<bool(int)>);
#define KVP_ENGINE_KIVI_HOOKS_FOR(EXTERN, C)                                                                                      \
  EXTERN template Hooks<C> kivi_hooks<C, kvpolicy::backend::Cpu>(kvpolicy::KiviQuant, kvpolicy::KiviQuant, kvpolicy::ExecContext, \
                                                                 std::shared_ptr<KiviHookState>);
KVP_ENGINE_KIVI_HOOKS_FOR(extern, ContiguousKVCache<float>)
KVP_ENGINE_KIVI_HOOKS_FOR(extern, PagedKVCache<float>)
#define KVP_ENGINE_MERGE_HOOKS_FOR(EXTERN, M)                                                                                         \
  EXTERN template Hooks<ContiguousKVCache<float>> merge_hooks<ContiguousKVCache<float>, kvpolicy::SnapKV, M, kvpolicy::backend::Cpu>( \
      kvpolicy::SnapKV, M, kvpolicy::ExecContext);
KVP_ENGINE_MERGE_HOOKS_FOR(extern, kvpolicy::KvpressMerging)
KVP_ENGINE_MERGE_HOOKS_FOR(extern, kvpolicy::LookMPivot)
KVP_ENGINE_MERGE_HOOKS_FOR(extern, kvpolicy::D2O)
KVP_ENGINE_MERGE_HOOKS_FOR(extern, kvpolicy::NearestKeptMerge)
extern template Hooks<ContiguousKVCache<float>> merge_after<ContiguousKVCache<float>, kvpolicy::D2O, kvpolicy::backend::Cpu>(
    Hooks<ContiguousKVCache<float>>, kvpolicy::D2O, kvpolicy::ExecContext);
extern template Hooks<ContiguousKVCache<float>> merge_after<ContiguousKVCache<float>, kvpolicy::NearestKeptMerge, kvpolicy::backend::Cpu>(
    Hooks<ContiguousKVCache<float>>, kvpolicy::NearestKeptMerge, kvpolicy::ExecContext);

}  // namespace kvp_engine
