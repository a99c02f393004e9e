// SPDX-License-Identifier: Apache-2.0
// The policies under comparison, each adapted to one question: "given this
// layer case and a budget, which prompt tokens may each head read?".
//
// Budget: `n` tokens per kv head and layer, protected tokens (window, sinks)
// inside, resolved from the sweep's budget (absolute tokens, or kvpress's
// compression ratio r: n = int(T (1 - r))). Each adapter maps n onto the
// policy's own vocabulary, so every policy keeps (on average) the same number
// of tokens:
//   StreamingLLM              4 sinks + (n - 4) recent
//   SnapKV                    kvpress scoring (window mean, avg pool 5, pool -> group mean), window inside
//   SnapKV(original)          FasterDecoding scoring (window sum, max pool 7, group -> pool), capacity n
//   H2O                       online real drop: the prompt's attention accumulated, then evict to
//                             hh = n/2 heavy + n - n/2 recent (the paper's 50/50 split)
//   ObservedAttention         kvpress: column sums of the whole prompt's attention / (T - j)
//   ObservedAttention(Factory) KVCache-Factory "H2O": raw column sums, last 8 tokens protected
//   TOVA                      kvpress one-shot: the last prompt query's head-mean attention, last token kept
//   Ada-KV                    kvpress AdaKVPress over SnapKV (alpha 0.2): n per head on average
//   Ada-KV(original-GQA)      FFY0/AdaKV gqa_support over its own scoring (w 32, max pool 7), capacity n
//   PyramidKV                 (multi-layer cases) token budgets: KVCache-Factory schedule with capacity n
//                             (w 8, max pool 7); ratio budgets: kvpress's schedule (w 64 capped at T/4)
//   ExpectedAttention         kvpress defaults (512 future positions, 4 sinks, covariance, value norm)
//   Quest                     selection per decode step: page size 16, floor(n / 16) pages per query head
//                             (last page included), every layer sparse (Quest's 2 dense layers are an
//                             end-to-end choice; here every layer is judged)
//   Oracle                    per (step, query head) the n heaviest prompt tokens: the ceiling
// The observation window is the case's (32 by default; traces: min(32, T/4)).
// Decision time is measured around the policy call only (workspace, inputs and
// outputs are prepared outside the timed region); K/V are fp32 for every policy.
//
// How each entry is built (all_policies): the one-shot eviction policies the
// registry expresses are spec strings (kvpolicy/registry.hpp,
// make_eviction_policy), with `{window}` (the case's observation window),
// `{sinks}` (its sink count) and `{factory_window}` (min(8, T), KVCache-Factory's
// window) filled in per case and the budget appended as `tokens=n` (n =
// min(budget, T)) or `compression_ratio=r`. The others keep an adapter below:
// H2O (online state), Ada-KV (its kvpress SnapKV scorer pools before the group
// mean; the registry's "adakv" keys cannot state that order), PyramidKV (token
// budgets use KVCache-Factory's schedule, the registry's is kvpress's),
// ExpectedAttention (the trace's RoPE frequencies and pre-RoPE queries), Quest
// (selection on pages) and Oracle.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "evaluate.hpp"
#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/budget.hpp"
#include "kvpolicy/policy/eviction/adakv.hpp"
#include "kvpolicy/policy/eviction/expected_attention.hpp"
#include "kvpolicy/policy/eviction/h2o.hpp"
#include "kvpolicy/policy/eviction/pyramidkv.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "kvpolicy/policy/quantization/quant_spec.hpp"
#include "kvpolicy/policy/selection/quest.hpp"
#include "kvpolicy/registry.hpp"
#include "layer_case.hpp"

namespace kvp_compare {

using Backend = kvpolicy::backend::Cpu;

/// A budget of the sweep: absolute tokens per kv head, or kvpress's fraction removed.
struct BudgetSpec {
  enum class Kind : std::uint8_t { kTokens, kRatio };
  Kind kind = Kind::kTokens;
  double value = 0;

  static BudgetSpec tokens(std::int64_t n) { return {Kind::kTokens, static_cast<double>(n)}; }
  static BudgetSpec ratio(double r) { return {Kind::kRatio, r}; }
  const char* kind_name() const noexcept { return kind == Kind::kTokens ? "tokens" : "ratio_removed"; }
  /// Tokens per kv head for a prompt of T tokens.
  std::int64_t tokens_for(std::int64_t T) const noexcept {
    return kind == Kind::kTokens ? std::min<std::int64_t>(static_cast<std::int64_t>(value), T) : kvpolicy::kvpress_n_kept(T, value);
  }
};

/// Timing of the policy call: up to `reps` runs (fewer once they took
/// `budget_ms` in all: slow policies are timed once), every run recorded.
/// Decisions are deterministic, so repeating a call does not change its output.
struct Timer {
  int reps = 3;
  double budget_ms = 500.0;
  std::vector<double> ms;
  template <class F>
  kvpolicy::Status run(F&& f) {
    kvpolicy::Status s;
    double spent = 0;
    for (int r = 0; r < reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      s = f();
      const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      ms.push_back(t);
      spent += t;
      if (!s || spent > budget_ms) break;
    }
    return s;
  }
};

struct PolicySpec {
  std::string name;
  std::string family;        ///< "eviction", "selection", "oracle", "quantization", "evict+quantize", "merging"
  bool query_aware = false;  ///< reads the prompt's last queries (kvpress's "query-aware" presses read the question)
  bool multi_layer = false;  ///< only meaningful on cases with several layers (layer schedules)
  std::function<kvpolicy::Status(const LayerCase&, const Reference&, const BudgetSpec&, const kvpolicy::ExecContext&, Timer&, Decision*)>
      run;               ///< the per-layer adapter of the synthetic and trace workloads; empty: engine (tasks) workloads only
  std::string registry;  ///< the kvpolicy registry policy it runs ("snapkv", ...; empty: none, the oracle)
  std::string spec;      ///< the spec string it is built from (placeholders, no budget); empty: its own adapter
  std::string engine;    ///< the engine policy it runs on the task workloads when that is not `registry` (LAQ)
};

namespace adapt {

using namespace kvpolicy;

inline TensorView<const float, 3> view3(const std::vector<float>& x, std::int64_t a, std::int64_t b, std::int64_t c) {
  return TensorView<const float, 3>::contiguous(x.data(), {a, b, c});
}
inline KVSource<float> keys(const LayerCase& c) { return KVSource<float>::from(view3(c.k, c.num_kv_heads, c.kv_len, c.head_dim)); }
inline KVSource<float> values(const LayerCase& c) { return KVSource<float>::from(view3(c.v, c.num_kv_heads, c.kv_len, c.head_dim)); }
/// The last `w` prompt queries (the observation window), a view into `q`.
inline TensorView<const float, 3> window_queries(const LayerCase& c, std::int64_t w) {
  const std::int64_t T = c.kv_len, d = c.head_dim;
  return TensorView<const float, 3>(c.q.data() + (T - w) * d, {c.num_q_heads, w, d}, {T * d, d, 1});
}
inline ProblemShape shape(const LayerCase& c, std::int64_t q_len) { return {c.num_q_heads, c.num_kv_heads, c.head_dim, c.kv_len, q_len}; }
/// Where every adapter's policy calls run: the CPU backend, the sweep's thread pool, `ws` as scratch.
inline Context<Backend> context(const ExecContext& ctx, std::vector<std::byte>* ws = nullptr) {
  return Context<Backend>{ws ? Workspace{ws->data(), ws->size()} : Workspace{}, ctx};
}
/// The one size query of a policy for this case (`q_len` query rows per head).
template <class P>
Requirements requirements(const P& p, const LayerCase& c, std::int64_t q_len, const ExecContext& ctx) {
  return p.requirements(context(ctx), shape(c, q_len));
}

/// Output buffers of an eviction policy and the Decision they become.
struct KeepBuffers {
  std::vector<std::int32_t> indptr, indices;
  KeepSet keep(std::int64_t rows, std::int64_t capacity) {
    indptr.assign(static_cast<std::size_t>(rows + 1), 0);
    indices.assign(static_cast<std::size_t>(std::max<std::int64_t>(capacity, 1)), 0);
    return KeepSet{indptr.data(), indices.data(), rows, capacity};
  }
  void to(Decision* d, Decision::Rows rows) {
    d->rows = rows;
    d->indptr = std::move(indptr);
    d->indices.assign(indices.begin(), indices.begin() + d->indptr.back());
  }
};

/// Any policy with the uniform `evict(ScoreInput)` interface.
template <class P>
Status run_prefill_policy(const P& p, const LayerCase& c, std::int64_t q_len, const ExecContext& ctx, Timer& t, Decision* out) {
  const ScoreInput<float, float> in{q_len == c.kv_len ? view3(c.q, c.num_q_heads, c.kv_len, c.head_dim) : window_queries(c, q_len),
                                    keys(c)};
  const Requirements r = requirements(p, c, q_len, ctx);
  KVP_RETURN_IF_ERROR(r.status);
  std::vector<std::byte> ws(r.workspace_bytes);
  KeepBuffers kb;
  const KeepSet keep = kb.keep(r.output.rows, r.output.capacity);
  const Context<Backend> cx = context(ctx, &ws);
  KVP_RETURN_IF_ERROR(t.run([&] { return p.evict(cx, in, keep); }));
  kb.to(out, r.output.rows == c.num_kv_heads ? Decision::Rows::kKvHead : Decision::Rows::kQueryHead);
  return Status::ok();
}

/// A registry policy (type-erased) behind the typed calls of run_prefill_policy, on the CPU backend.
struct ErasedPolicy {
  AnyEvictionPolicy p;
  Requirements requirements(const Context<Backend>& cx, const ProblemShape& s) const noexcept {
    return p.requirements(BackendKind::kCpu, s, cx.exec);
  }
  Status evict(const Context<Backend>& cx, const ScoreInput<float, float>& in, KeepSet out) const noexcept {
    return p.evict(BackendKind::kCpu, in, out, cx.workspace, cx.exec);
  }
};

/// The spec string of an entry for case `c` and budget `b`: placeholders filled in, the budget appended.
inline std::string spec_for(const std::string& spec, const LayerCase& c, const BudgetSpec& b) {
  std::string s = spec;
  auto fill = [&s](const std::string& key, std::int64_t v) {
    for (std::size_t at; (at = s.find(key)) != std::string::npos;) s.replace(at, key.size(), std::to_string(v));
  };
  fill("{window}", c.window);
  fill("{sinks}", c.sinks);
  fill("{factory_window}", std::min<std::int64_t>(8, c.kv_len));
  s += s.find(':') == std::string::npos ? ":" : ",";
  if (b.kind == BudgetSpec::Kind::kTokens) {
    s += "tokens=" + std::to_string(b.tokens_for(c.kv_len));
  } else {
    char r[32];
    std::snprintf(r, sizeof r, "%.17g", b.value);  // round-trips the double exactly
    s += std::string("compression_ratio=") + r;
  }
  return s;
}

/// A one-shot eviction policy of the registry from `spec` (see spec_for); it reads the last `window`
/// prompt queries of the case, or all of them (`whole_prompt`).
inline auto registry_policy(std::string spec, bool whole_prompt) {
  return [spec = std::move(spec), whole_prompt](const LayerCase& c, const Reference&, const BudgetSpec& b, const ExecContext& ctx, Timer& t,
                                                Decision* out) -> Status {
    ErasedPolicy p;
    KVP_RETURN_IF_ERROR(make_eviction_policy(spec_for(spec, c, b), &p.p));
    return run_prefill_policy(p, c, whole_prompt ? c.kv_len : c.window, ctx, t, out);
  };
}

inline Status h2o(const LayerCase& c, const Reference&, const BudgetSpec& b, const ExecContext& ctx, Timer& t, Decision* out) {
  const std::int64_t n = b.tokens_for(c.kv_len), T = c.kv_len;
  const H2O p(H2OParams::original(n / 2, n - n / 2));
  const ScoreInput<float, float> in{view3(c.q, c.num_q_heads, T, c.head_dim), keys(c)};
  std::vector<float> scores(static_cast<std::size_t>(c.num_kv_heads * T));
  H2OState st{TensorView<float, 2>::contiguous(scores.data(), {c.num_kv_heads, T}), 0};
  const Requirements r = requirements(p, c, T, ctx);  // one workspace for update (from the queries) and evict
  KVP_RETURN_IF_ERROR(r.status);
  std::vector<std::byte> ws(r.workspace_bytes);
  KeepBuffers kb;
  const KeepSet keep = kb.keep(r.output.rows, r.output.capacity);
  const Context<Backend> cx = context(ctx, &ws);
  KVP_RETURN_IF_ERROR(t.run([&]() -> Status {
    st.reset();
    KVP_RETURN_IF_ERROR(p.update(cx, st, in));
    return p.evict(cx, st, keep);
  }));
  kb.to(out, Decision::Rows::kKvHead);
  return Status::ok();
}

template <class Scorer>
Status run_adakv(const AdaKV<Scorer>& p, const LayerCase& c, const ExecContext& ctx, Timer& t, Decision* out) {
  const std::int64_t w = p.scorer().params().window;
  const ScoreInput<float, float> in{window_queries(c, w), keys(c)};
  const Requirements r = requirements(p, c, w, ctx);
  KVP_RETURN_IF_ERROR(r.status);
  std::vector<std::byte> ws(r.workspace_bytes);
  const std::int64_t rows = r.output.rows;
  KeepBuffers kb;
  const KeepSet keep = kb.keep(rows, r.output.capacity);
  const Context<Backend> cx = context(ctx, &ws);
  KVP_RETURN_IF_ERROR(t.run([&] { return p.evict(cx, std::span<const ScoreInput<float, float>>(&in, 1), keep); }));
  kb.to(out, rows == c.num_kv_heads ? Decision::Rows::kKvHead : Decision::Rows::kQueryHead);
  return Status::ok();
}

inline Status adakv(const LayerCase& c, const Reference&, const BudgetSpec& b, const ExecContext& ctx, Timer& t, Decision* out) {
  AdaKVParams ap = AdaKVParams::kvpress(0.0, 0.2);
  ap.budget = Budget::tokens(b.tokens_for(c.kv_len));
  return run_adakv(AdaKV<SnapKV>(ap, SnapKV(SnapKVParams::kvpress(0.0, c.window, 5))), c, ctx, t, out);
}

inline Status adakv_original(const LayerCase& c, const Reference&, const BudgetSpec& b, const ExecContext& ctx, Timer& t, Decision* out) {
  return run_adakv(AdaKV<SnapKV>(AdaKVParams::original_gqa(b.tokens_for(c.kv_len), 0.2), SnapKV(adakv_scoring(c.window))), c, ctx, t, out);
}

inline Status pyramidkv(const LayerCase& c, const Reference&, const BudgetSpec& b, const ExecContext& ctx, Timer& t, Decision* out) {
  PyramidKVParams p;
  if (b.kind == BudgetSpec::Kind::kRatio) {
    const std::int32_t w = static_cast<std::int32_t>(std::min<std::int64_t>(64, c.kv_len / 4));
    p = PyramidKVParams::kvpress(b.value, c.layer, c.num_layers, w, 5);
  } else {
    const std::int32_t w = static_cast<std::int32_t>(std::min<std::int64_t>(8, c.kv_len));
    p = PyramidKVParams::original(b.tokens_for(c.kv_len), c.layer, c.num_layers, w, 7, Pooling::kMax);
  }
  return run_prefill_policy(PyramidKV(p), c, p.scoring.window, ctx, t, out);
}

inline Status expected_attention(const LayerCase& c, const Reference&, const BudgetSpec& b, const ExecContext& ctx, Timer& t,
                                 Decision* out) {
  ExpectedAttentionParams p = ExpectedAttentionParams::kvpress(0.0);
  p.budget = Budget::tokens(b.tokens_for(c.kv_len));
  if (c.inv_freq.size() != static_cast<std::size_t>(c.head_dim / 2))
    return Status::error(StatusCode::kUnsupported, "expected_attention: the case has no RoPE frequencies");
  p.rope.inv_freq = c.inv_freq.data();
  p.rope.attention_scaling = c.rope_scaling;
  const ExpectedAttention ea(p);
  ExpectedAttentionInput<float, float> in;
  in.queries = view3(c.q_pre.empty() ? c.q : c.q_pre, c.num_q_heads, c.kv_len, c.head_dim);
  in.keys = keys(c);
  in.values = values(c);
  const Requirements r = requirements(ea, c, c.kv_len, ctx);
  KVP_RETURN_IF_ERROR(r.status);
  std::vector<std::byte> ws(r.workspace_bytes);
  KeepBuffers kb;
  const KeepSet keep = kb.keep(r.output.rows, r.output.capacity);
  const Context<Backend> cx = context(ctx, &ws);
  KVP_RETURN_IF_ERROR(t.run([&] { return ea.evict(cx, in, keep); }));
  kb.to(out, Decision::Rows::kKvHead);
  return Status::ok();
}

/// Quest on a paged copy of the prompt (HND pages of 16 tokens), one
/// selection per evaluation query; the metadata is built once (not timed:
/// engines fold it while appending).
inline Status quest(const LayerCase& c, const Reference&, const BudgetSpec& b, const ExecContext& ctx, Timer& t, Decision* out) {
  constexpr std::int32_t kPage = 16;
  const std::int64_t T = c.kv_len, d = c.head_dim, Hkv = c.num_kv_heads, Hq = c.num_q_heads, F = c.num_eval;
  const std::int32_t P = static_cast<std::int32_t>((T + kPage - 1) / kPage);
  std::vector<float> kp(static_cast<std::size_t>(P) * Hkv * kPage * d, 0.0f), vp(kp.size(), 0.0f);
  const PageStrides st = PageStrides::contiguous(PageLayout::kHND, Hkv, kPage, d);
  for (std::int64_t h = 0; h < Hkv; ++h)
    for (std::int64_t j = 0; j < T; ++j) {
      const std::size_t dst = static_cast<std::size_t>((j / kPage) * st.page + h * st.head + (j % kPage) * st.slot);
      std::copy_n(&c.k[static_cast<std::size_t>((h * T + j) * d)], d, &kp[dst]);
      std::copy_n(&c.v[static_cast<std::size_t>((h * T + j) * d)], d, &vp[dst]);
    }
  std::vector<std::int32_t> indptr{0, P}, pages(static_cast<std::size_t>(P)), last{static_cast<std::int32_t>((T - 1) % kPage + 1)};
  for (std::int32_t i = 0; i < P; ++i) pages[static_cast<std::size_t>(i)] = i;
  const PageTable table{indptr.data(), pages.data(), last.data(), 1};
  const PagedKVView<const float> view{kp.data(), vp.data(), st, st, P, static_cast<std::int32_t>(Hkv), kPage, static_cast<std::int32_t>(d),
                                      table,     kHost};
  std::vector<float> meta(
      static_cast<std::size_t>(PageMetaView<float>::contiguous_size(P, static_cast<std::int32_t>(Hkv), static_cast<std::int32_t>(d))));
  const auto mv = PageMetaView<float>::contiguous(meta.data(), P, static_cast<std::int32_t>(Hkv), static_cast<std::int32_t>(d));
  KVP_RETURN_IF_ERROR(Quest{}.on_append(context(ctx), AppendInput<float>{view, nullptr}, mv));  // every page of the table

  QuestParams qp;
  const std::int64_t n = b.tokens_for(T);
  qp.budget = Budget::tokens(std::min<std::int64_t>(n, INT32_MAX));
  if (n >= T) qp.page_budget = P;  // a budget covering the prompt reads every page (floor(T/16) may miss the partial last one)
  qp.dense_layers = 0;
  qp.gqa = QuestGqa::kPerQueryHead;
  const Quest quest(qp);
  // One plan serves every evaluation query: the batch composition (table, layer, page size) does not change.
  auto step = [&](std::int64_t f) {
    return DecodeInput<float>{TensorView<const float, 3>(c.eq.data() + f * d, {1, Hq, d}, {0, F * d, 1}), table, kPage, c.layer};
  };
  Quest::Plan plan;
  KVP_RETURN_IF_ERROR(quest.plan(context(ctx), step(0), ProblemShape{.num_q_heads = Hq, .num_kv_heads = Hkv, .head_dim = d}, plan));
  std::vector<std::byte> ws(plan.requirements.workspace_bytes);
  const std::int64_t rows = plan.requirements.output.rows, cap = plan.requirements.output.capacity;
  std::vector<std::int32_t> sel_indptr(static_cast<std::size_t>(rows + 1)), sel(static_cast<std::size_t>(std::max<std::int64_t>(cap, 1))),
      sel_last(static_cast<std::size_t>(rows));
  const PageSelection ps{sel_indptr.data(), sel.data(), sel_last.data(), nullptr, rows, cap};
  const Context<Backend> cx = context(ctx, &ws);
  out->rows = Decision::Rows::kQueryHeadPerStep;
  out->indptr.assign(1, 0);
  out->indices.clear();
  for (std::int64_t f = 0; f < F; ++f) {
    const DecodeInput<float> in = step(f);
    KVP_RETURN_IF_ERROR(t.run([&] { return quest.select(cx, plan, in, mv, ps); }));
    for (std::int64_t r = 0; r < Hq; ++r) {
      for (std::int32_t i = sel_indptr[static_cast<std::size_t>(r)]; i < sel_indptr[static_cast<std::size_t>(r + 1)]; ++i) {
        const std::int64_t p0 = static_cast<std::int64_t>(sel[static_cast<std::size_t>(i)]) * kPage;
        for (std::int64_t j = p0; j < std::min(p0 + kPage, T); ++j) out->indices.push_back(static_cast<std::int32_t>(j));
      }
      out->indptr.push_back(static_cast<std::int32_t>(out->indices.size()));
    }
  }
  // Metadata read per step: 2 rows (max, min) of d values per scored page and kv head.
  const std::int64_t pb = quest.page_budget(kPage);
  out->metadata_bytes = P > pb ? 2.0 * static_cast<double>(P - 1) * static_cast<double>(Hkv * d) * dtype_size(c.storage) : 0.0;
  return Status::ok();
}

/// K or V rows (H, T, d) of a case stored in quantization format `q` and decoded back into `dst`; `bytes` the
/// format's bytes for them. KIVI streams the prompt through its residual (the last tokens stay fp16, as KIVI
/// holds them after prefill); every other format stores each row.
template <class Q>
Status store_and_decode(const Q& q, const ExecContext& ctx, const std::vector<float>& src, std::int64_t H, std::int64_t T, std::int64_t d,
                        std::vector<float>& dst, double* bytes) {
  const Context<Backend> cx = context(ctx, nullptr);
  const auto rows = TensorView<const float, 3>::contiguous(src.data(), {H, T, d});
  if constexpr (std::is_same_v<Q, KiviQuant>) {
    const std::int64_t R = std::max<std::int64_t>(q.params().residual, 1), n = q.code_rows(T);
    std::vector<std::uint8_t> codes(static_cast<std::size_t>(H * n * q.codes_row_bytes(d))),
        scales(static_cast<std::size_t>(H * n * q.scales_row_bytes(d)));
    std::vector<half> res(static_cast<std::size_t>(H * R * d));
    KiviState st{TensorView<half, 3>::contiguous(res.data(), {H, R, d}), 0};
    QuantizedKV region{q.layout(), TensorView<std::uint8_t, 3>::contiguous(codes.data(), {H, n, q.codes_row_bytes(d)}),
                       TensorView<std::uint8_t, 3>::contiguous(scales.data(), {H, n, q.scales_row_bytes(d)}), 0};
    KVP_RETURN_IF_ERROR(q.append(cx, rows, st, region));
    std::vector<float> head(static_cast<std::size_t>(H * std::max<std::int64_t>(region.tokens, 1) * d));
    KVP_RETURN_IF_ERROR(q.dequantize(cx, region, TensorView<float, 3>::contiguous(head.data(), {H, region.tokens, d})));
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t t = 0; t < T; ++t)
        for (std::int64_t k = 0; k < d; ++k)
          dst[static_cast<std::size_t>((h * T + t) * d + k)] = t < region.tokens
                                                                   ? head[static_cast<std::size_t>((h * region.tokens + t) * d + k)]
                                                                   : to_float(st.residual(h, t - region.tokens, k));
    *bytes = static_cast<double>(H) *
             (static_cast<double>(region.tokens) * q.bytes_per_token(d) + static_cast<double>(st.residual_len) * 2.0 * d);
  } else {
    std::vector<std::uint8_t> codes(static_cast<std::size_t>(H * T * q.row_bytes(d)));
    QuantizedKV region{q.layout(), TensorView<std::uint8_t, 3>::contiguous(codes.data(), {H, T, q.row_bytes(d)}), {}, T};
    typename Q::State st{};
    KVP_RETURN_IF_ERROR(q.quantize(cx, rows, st, region));
    KVP_RETURN_IF_ERROR(q.dequantize(cx, region, TensorView<float, 3>::contiguous(dst.data(), {H, T, d})));
    *bytes = static_cast<double>(H * T) * q.bytes_per_token(d);
  }
  return Status::ok();
}

/// A quantization format on a layer (the per-layer workloads): the prompt's K and V stored in `spec`'s format
/// and decoded back (the decode steps' own K/V stay as they are); every token kept. The sweep evaluates the
/// attention output over the decoded cache against the full-precision one.
inline auto quantization(std::string spec) {
  return [spec](const LayerCase& c, const Reference&, const BudgetSpec&, const ExecContext& ctx, Timer& t, Decision* out) -> Status {
    auto qc = std::make_shared<LayerCase>(c);
    const std::int64_t H = c.num_kv_heads, T = c.kv_len, d = c.head_dim;
    double bytes = 0.0;
    KVP_RETURN_IF_ERROR(t.run([&]() -> Status {
      return visit_quant_spec(spec, [&](auto kq, auto vq) -> Status {
        double bk = 0.0, bv = 0.0;
        KVP_RETURN_IF_ERROR(store_and_decode(kq, ctx, c.k, H, T, d, qc->k, &bk));
        KVP_RETURN_IF_ERROR(store_and_decode(vq, ctx, c.v, H, T, d, qc->v, &bv));
        bytes = bk + bv;
        return Status::ok();
      });
    }));
    out->rows = Decision::Rows::kKvHead;
    out->indptr.assign(static_cast<std::size_t>(H + 1), 0);
    out->indices.resize(static_cast<std::size_t>(H * T));
    for (std::int64_t h = 0; h < H; ++h) {
      out->indptr[static_cast<std::size_t>(h + 1)] = static_cast<std::int32_t>((h + 1) * T);
      for (std::int64_t j = 0; j < T; ++j) out->indices[static_cast<std::size_t>(h * T + j)] = static_cast<std::int32_t>(j);
    }
    out->quantized = qc;
    out->bytes_scale = bytes / (2.0 * static_cast<double>(H * T * d) * static_cast<double>(dtype_size(c.storage)));
    return Status::ok();
  };
}

inline Status oracle(const LayerCase& c, const Reference& r, const BudgetSpec& b, const ExecContext&, Timer&, Decision* out) {
  *out = oracle_decision(c, r, b.tokens_for(c.kv_len));
  return Status::ok();
}

}  // namespace adapt

/// One entry built by the registry from a spec string (placeholders: see adapt::spec_for).
inline PolicySpec from_registry(std::string name, bool query_aware, std::string spec, bool whole_prompt = false) {
  kvpolicy::PolicySpec parsed;
  kvpolicy::throw_if_error(kvpolicy::parse_policy_spec(spec, &parsed));
  return {std::move(name), "eviction", query_aware, false, adapt::registry_policy(spec, whole_prompt), parsed.name, spec, ""};
}

/// Every policy of the comparison, in table order: spec strings for the registry's one-shot eviction
/// policies, the adapters above for the rest (see the header comment).
inline std::vector<PolicySpec> all_policies() {
  return {
      from_registry("StreamingLLM", false, "streaming_llm:sinks={sinks}"),
      from_registry("SnapKV", true, "snapkv:window={window},kernel=5"),
      from_registry("SnapKV(original)", true, "snapkv:window={window},kernel=7,pooling=max,window_reduce=sum,order=group_then_pool"),
      {"H2O", "eviction", false, false, adapt::h2o, "h2o", "", ""},
      from_registry("ObservedAttention", false, "observed_attention", true),
      from_registry("ObservedAttention(Factory)", false, "observed_attention:window={factory_window},normalize=false", true),
      from_registry("TOVA", true, "tova"),
      {"Ada-KV", "eviction", true, false, adapt::adakv, "adakv", "", ""},
      from_registry("Ada-KV(original-GQA)", true, "adakv:variant=original,window={window}"),
      {"PyramidKV", "eviction", true, true, adapt::pyramidkv, "pyramidkv", "", ""},
      {"ExpectedAttention", "eviction", false, false, adapt::expected_attention, "expected_attention", "", ""},
      {"Quest", "selection", true, false, adapt::quest, "quest", "", ""},
      // Lookahead queries (engine workloads only: LAQ decodes pseudo tokens with the model), against SnapKV as
      // LAQ's stage 1 and the LAQ paper's baseline run it (window 32, max pool 7, window sum, capacity C).
      // Variants that decide retrieval on the real model (engine tasks only): a question-sized observation window,
      // 64 protected leading tokens.
      {"SnapKV(w=16)", "eviction", true, false, {}, "snapkv", "", "snapkv_w16"},
      {"StreamingLLM(sinks=64)", "eviction", false, false, {}, "streaming_llm", "", "streaming_llm_sinks64"},
      // Both stages of LAQ are SnapKV (registry "snapkv"); the engine policies are kvp_engine's names.
      {"SnapKV(LAQ-baseline)", "eviction", true, false, {}, "snapkv", "", "snapkv_original"},
      {"LAQ", "eviction", true, false, {}, "snapkv", "", "laq"},
      {"LAQ++", "eviction", true, false, {}, "snapkv", "", "laq++"},
      {"LAQ++(corrected-mask)", "eviction", true, false, {}, "snapkv", "", "laq++_corrected"},
      {"Oracle", "oracle", true, false, adapt::oracle, "", "", ""},
      // Quantization (the cache stored in the format, every token kept: on the per-layer workloads the attention
      // output over the decoded K/V against the full-precision one, on the engine workloads the tasks) and
      // eviction + quantization on one byte budget (SnapKV to budget * 4d / bytes_per_token tokens, quantized).
      {"q8_0", "quantization", false, false, adapt::quantization("ggml:type=q8_0"), "ggml:type=q8_0", "", ""},
      {"q4_0", "quantization", false, false, adapt::quantization("ggml:type=q4_0"), "ggml:type=q4_0", "", ""},
      {"fp8_e4m3", "quantization", false, false, adapt::quantization("fp8:format=e4m3"), "fp8:format=e4m3", "", ""},
      {"SnapKV+q4_0", "evict+quantize", true, false, {}, "snapkv+ggml:type=q4_0", "", ""},
      {"SnapKV+q8_0", "evict+quantize", true, false, {}, "snapkv+ggml:type=q8_0", "", ""},
      // Token-wise INT4 (SAW-INT4's format): llama.cpp's rotation rule (no rotation at head_dim 32, n = 64 on
      // SmolLM2), plain, and SAW-INT4's K-only block-diagonal rotation (block 16); q4_0 with llama.cpp's
      // rotation; KIVI-2 / KIVI-4 (group 32, a 32-token fp16 residual, counted in the bytes).
      {"int4", "quantization", false, false, adapt::quantization("int4"), "int4", "", ""},
      {"int4(no-rotation)", "quantization", false, false, adapt::quantization("int4:rotation=none"), "int4:rotation=none", "", ""},
      {"int4(BDR16-K-only)", "quantization", false, false, adapt::quantization("int4:rotation=block,block=16|int4:rotation=none"),
       "int4:rotation=block,block=16|int4:rotation=none", "", ""},
      {"q4_0(rotated)", "quantization", false, false, adapt::quantization("ggml:type=q4_0,rotation=llama_cpp"),
       "ggml:type=q4_0,rotation=llama_cpp", "", ""},
      {"KIVI-2", "quantization", false, false, adapt::quantization("kivi:bits=2,residual=32"), "kivi:bits=2,residual=32", "", ""},
      {"KIVI-4", "quantization", false, false, adapt::quantization("kivi:bits=4,residual=32"), "kivi:bits=4,residual=32", "", ""},
      {"SnapKV+int4", "evict+quantize", true, false, {}, "snapkv+int4", "", ""},
      // KIVI with the reference's 128-token residual (its README and LongBench scripts; prompts of 512 tokens and
      // more hold it), and KIVI after SnapKV on one byte budget: the kept tokens compacted, then quantized, KIVI's
      // key groups formed over them (the 32-token fp16 residual counted in the bytes).
      {"KIVI-2(R=128)", "quantization", false, false, adapt::quantization("kivi:bits=2,residual=128"), "kivi:bits=2,residual=128", "", ""},
      {"KIVI-4(R=128)", "quantization", false, false, adapt::quantization("kivi:bits=4,residual=128"), "kivi:bits=4,residual=128", "", ""},
      {"SnapKV+KIVI-2", "evict+quantize", true, false, {}, "snapkv+kivi:bits=2,residual=32", "", ""},
      {"SnapKV+KIVI-4", "evict+quantize", true, false, {}, "snapkv+kivi:bits=4,residual=32", "", ""},
      // Mixed precision (ZipCache / ARKV): SnapKV ranks, half the bytes keep the top tokens in full precision, the
      // rest hold the next ones in INT4, the others are evicted.
      {"SnapKV+mixed(fp32+int4)", "evict+quantize", true, false, {}, "snapkv+mixed+int4", "", ""},
      // Merging (engine workloads only): SnapKV evicts to the budget, the merge folds the evicted tokens into the
      // kept ones (kvp_engine's snapkv+<merge> policies); online H2O with a merge at every decode step (h2o+<merge>).
      {"SnapKV+MergingPress", "merging", true, false, {}, "snapkv", "", "snapkv+kvpress_merging"},
      {"SnapKV+LOOK-M", "merging", true, false, {}, "snapkv", "", "snapkv+lookm_pivot"},
      {"SnapKV+D2O", "merging", true, false, {}, "snapkv", "", "snapkv+d2o"},
      {"SnapKV+NearestKept", "merging", true, false, {}, "snapkv", "", "snapkv+nearest_kept"},
      {"H2O+D2O", "merging", false, false, {}, "h2o", "", "h2o+d2o"},
      {"H2O+NearestKept", "merging", false, false, {}, "h2o", "", "h2o+nearest_kept"},
      // CaM (values only, Bernoulli by accumulated attention): after SnapKV, and in its own online setting after
      // H2O; kvpress's CAMPress during decoding (KnormPress scores, interval 1); D2O whole (layer budgets,
      // its eviction and its merge).
      {"SnapKV+CaM", "merging", true, false, {}, "snapkv", "", "snapkv+cam"},
      {"H2O+CaM", "merging", false, false, {}, "h2o", "", "h2o+cam"},
      {"kvpress-CAM(Knorm)", "merging", false, false, {}, "", "", "kvpress_cam"},
      {"D2O", "merging", false, false, {}, "", "", "d2o"},
      {"D2O(all-layers)", "merging", false, false, {}, "", "", "d2o_all_layers"},
      // The three families as one composed policy at one hook (kvpolicy::Compress) on one byte budget.
      {"SnapKV+MergingPress+q4_0", "merging", true, false, {}, "", "", "snapkv+kvpress_merging+ggml:type=q4_0"},
  };
}

/// The comparison's entry that runs the engine policy `registry_name` (kvp_engine's names are the
/// registry's): the first entry on that registry policy, its kvpress-configured variant. Null: none.
inline const PolicySpec* entry_for_registry_name(const std::vector<PolicySpec>& all, const std::string& registry_name) {
  for (const auto& p : all)
    if ((p.engine.empty() ? p.registry : p.engine) == registry_name) return &p;
  return nullptr;
}

/// What `kvpolicy-compare --list-policies` prints: the registry (kvpolicy::describe_registry(): every
/// policy's name, family, paper and parameters with their defaults), then the comparison's entries
/// (the names --policies takes) with the spec string or the registry policy each one runs.
inline std::string list_policies() {
  std::string s = "kvpolicy registry (spec strings: name:key=value,...):\n" + kvpolicy::describe_registry();
  s += "\nkvpolicy-compare policies (--policies; {window}, {sinks}, {factory_window} are per case, the budget is appended):\n";
  for (const auto& p : all_policies()) {
    const std::string engine = p.engine.empty() ? p.registry : p.engine;
    const std::string how = !p.spec.empty()             ? p.spec
                            : !p.run && !engine.empty() ? "(engine tasks only: " + engine + ")"
                            : p.registry.empty()        ? "(reference)"
                                                        : "(own adapter over " + p.registry + ")";
    char line[512];
    std::snprintf(line, sizeof line, "%-28s %-10s%s%s  %s\n", p.name.c_str(), p.family.c_str(), p.query_aware ? " query-aware" : "",
                  p.multi_layer ? " multi-layer" : "", how.c_str());
    s += line;
  }
  return s;
}

}  // namespace kvp_compare
