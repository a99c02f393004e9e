// SPDX-License-Identifier: Apache-2.0
// Ada-KV — "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation
// for Efficient LLM Inference" (Feng et al., 2024, arXiv 2407.11550).
//
// A layer's budget is shared by its heads: heads whose scores stand out get more
// tokens. Ada-KV sits on top of any `Scorer` (concepts.hpp) — a policy with
// `score(ctx, input, out (kv_heads, kv_len))` writing per-head scores (higher =
// keep, protected tokens = +inf), `requirements`, `protected_tokens`, and
// `validate(batch, shape)` — e.g. SnapKV or ExpectedAttention. Three variants
// (reference §5, §15.8):
//
//  * `AdaKVParams::original(C, alpha)` — FFY0/AdaKV `AdaptiveSnapKVCluster`
//    (default mode): one allocation over the **query** heads (each query head
//    scored alone, as the original does on `repeat_kv`'d keys). With B = C - w
//    past tokens per head: if B > L = T - w nothing is evicted; otherwise
//    count[h] = how many of head h's tokens are in the layer-wide top H*B
//    (optionally after `normalize`: row h scaled by sum(top-B)/sum(all)),
//    cap[h] = round_half_even((1-alpha)*count[h] + int(B*alpha)), and head h
//    keeps its cap[h] best past tokens plus the window. KeepSet rows are per
//    query head (row b*Hq + q; the tokens are those of kv head q / G).
//  * `AdaKVParams::original_gqa(C, alpha)` — the same allocation over the
//    **kv** heads (`gqa_support`); pair it with `adakv_scoring()`: SnapKV with
//    the window mean, the group reduced (mean or max) *before* max pooling K=7,
//    w=32. Rows per kv head, so the GQA memory saving survives.
//  * `AdaKVParams::kvpress(r, alpha)` — kvpress `AdaKVPress`: n_kept = int(T(1-r))
//    per head on average (protected tokens inside); each head's best
//    int(alpha * n_kept) tokens are kept unconditionally (the safeguard), then
//    the layer keeps exactly Hkv * n_kept tokens: the safeguarded ones plus the
//    globally best of the rest, across heads. Rows per kv head.
//
// Choices where references differ or are silent (each pinned by a test):
//  * Protected tokens are the +inf scores (kvpress pads with max+1, the
//    originals append the window). They always win: kvpress's safeguard and
//    global competition see them first, exactly as with max+1.
//  * Ties (unspecified in every reference): inside a head, higher score then
//    higher token index; across heads (the global top H*B and the kvpress
//    prune), higher score then higher flat index head*T + token, i.e. the
//    higher head wins. NaN scores rank below everything (`score_order_key`).
//  * The original evaluates cap[h] in fp32 like torch (int64 counts times a
//    Python float promote to float32): fl32(fl32(count * fl32(1-alpha)) + floor),
//    then half-to-even rounding; cap[h] never exceeds the head's past tokens.
//  * `normalize` (Ada-KV's option, off by default; KVCache-Factory turns it on):
//    when a head's score sum is zero or not finite its factor is 1 (torch
//    would produce NaN).
//  * Budget for the original: `Budget::tokens(C)` = base_capacity including
//    the window (B = C - w), `Budget::tokens(B).protected_on_top()` = B past
//    tokens, or a ratio. A budget below the protected tokens is an error.
//    Layers below the original's `skip` use a uniform budget: run SnapKV there.
//  * kv_len < window is rejected (kvpress asserts; the original crashes).
//  * `Budget::keep_at_least_one()` also enables kvpress >= 0.5.5's
//    n_safe = max(1, n_safe) (alpha > 0, n_kept > 0).
//  * The pyramid mode of the original is a `LayerSchedule::pyramid_adakv`
//    budget, recomputed per call (the original caches its first prompt's).
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <span>

#include "kvpolicy/policy/budget.hpp"
#include "kvpolicy/policy/budget/allocation.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "kvpolicy/policy/policy.hpp"

KVP_NAMESPACE_BEGIN

enum class AdaKVVariant : std::uint8_t {
  kOriginal,  ///< FFY0/AdaKV: blended capacities (1-alpha)*count + int(alpha*B), window appended
  kKvpress,   ///< kvpress AdaKVPress: per-head safeguard, exact global bottom-k prune
};

enum class HeadGranularity : std::uint8_t {
  kKvHead,     ///< one row per (sequence, kv head)
  kQueryHead,  ///< one row per (sequence, query head): the original's per-query-head cache
};

inline constexpr EnumName<AdaKVVariant> kAdaKVVariantNames[] = {{"original", AdaKVVariant::kOriginal}, {"kvpress", AdaKVVariant::kKvpress}};
constexpr std::span<const EnumName<AdaKVVariant>> enum_names(AdaKVVariant) noexcept { return kAdaKVVariantNames; }
inline constexpr EnumName<HeadGranularity> kHeadGranularityNames[] = {{"kv_head", HeadGranularity::kKvHead},
                                                                      {"query_head", HeadGranularity::kQueryHead}};
constexpr std::span<const EnumName<HeadGranularity>> enum_names(HeadGranularity) noexcept { return kHeadGranularityNames; }

struct AdaKVParams {
  AdaKVVariant variant = AdaKVVariant::kKvpress;
  HeadGranularity heads = HeadGranularity::kKvHead;
  double alpha = 0.2;      ///< original: floor_alpha; kvpress: alpha_safeguard; in [0, 1]
  bool normalize = false;  ///< original only
  Budget budget = Budget::compression_ratio(0.5);

  static constexpr auto fields() noexcept {
    return std::tuple{param_field<&AdaKVParams::variant>("variant", "allocation"),
                      param_field<&AdaKVParams::heads>("heads", "rows per kv head or per query head"),
                      param_field<&AdaKVParams::alpha>("alpha", "original: floor_alpha; kvpress: alpha_safeguard"),
                      param_field<&AdaKVParams::normalize>("normalize", "original: normalise rows before the global top-k"),
                      budget_field<&AdaKVParams::budget>()};
  }

  /// FFY0/AdaKV default mode: base_capacity C includes the window; per query head.
  static constexpr AdaKVParams original(std::int64_t base_capacity, double floor_alpha = 0.2, bool normalize = false) noexcept {
    return AdaKVParams{AdaKVVariant::kOriginal, HeadGranularity::kQueryHead, floor_alpha, normalize,
                       Budget::tokens(base_capacity).clamp_to_length()};
  }
  /// FFY0/AdaKV `gqa_support`: allocation over kv heads (use with `adakv_scoring()`).
  static constexpr AdaKVParams original_gqa(std::int64_t base_capacity, double floor_alpha = 0.2, bool normalize = false) noexcept {
    return AdaKVParams{AdaKVVariant::kOriginal, HeadGranularity::kKvHead, floor_alpha, normalize,
                       Budget::tokens(base_capacity).clamp_to_length()};
  }
  /// kvpress `AdaKVPress(press, alpha_safeguard)` with the press's compression_ratio r.
  static constexpr AdaKVParams kvpress(double r, double alpha_safeguard = 0.2) noexcept {
    return AdaKVParams{AdaKVVariant::kKvpress, HeadGranularity::kKvHead, alpha_safeguard, false, Budget::compression_ratio(r)};
  }
};

/// Ada-KV's own scoring (`calcul_attn_sore`): window mean, maxpool K=7, w=32;
/// with GQA the group is reduced (`gqa_func` mean or max) before pooling.
constexpr SnapKVParams adakv_scoring(std::int32_t window = 32, std::int32_t kernel = 7, GroupReduce gqa_func = GroupReduce::kMean,
                                     Pooling pooling = Pooling::kMax) noexcept {
  return SnapKVParams{window, kernel, pooling, WindowReduce::kMean, gqa_func, ReduceOrder::kGroupThenPool, Budget::compression_ratio(0.0),
                      0.0f};
}

/// Query heads first, first+step, ... of a score input (per-query-head scoring).
template <class Tq, class Tk>
ScoreInput<Tq, Tk> query_head_subset(const ScoreInput<Tq, Tk>& in, std::int64_t first, std::int64_t step) noexcept {
  const auto& q = in.queries;
  ScoreInput<Tq, Tk> sub = in;
  sub.queries = TensorView<const Tq, 3>(q.data() + first * q.stride(0), {q.extent(0) / step, q.extent(1), q.extent(2)},
                                        {q.stride(0) * step, q.stride(1), q.stride(2)}, q.device());
  return sub;
}

/// What Ada-KV needs from a scorer for inputs of type `In`: the `Scorer`
/// concept, a batch check that reports the batch's shape (so nothing is
/// written before every sequence was checked), and query-head subsets of an
/// input (per-query-head allocation scores each group member separately).
template <class S, class In, class B = backend::Scalar>
concept HeadScorer = Scorer<S, In, B> &&
    requires(const S& s, const In& in, std::span<const In> batch, ProblemShape* shape_out, std::int64_t n) {
  { s.validate(batch, shape_out) } -> std::same_as<Status>;
  { query_head_subset(in, n, n) } -> std::same_as<In>;
  { in.keys.kv_len() } -> std::same_as<std::int64_t>;
};

template <class Scorer>
class AdaKV {
 public:
  using Params = AdaKVParams;
  static constexpr const char* kName = "adakv";

  AdaKV(const Params& p, const Scorer& scorer) noexcept : params_(p), scorer_(scorer) {}
  constexpr const Params& params() const noexcept { return params_; }
  constexpr const Scorer& scorer() const noexcept { return scorer_; }

  Status validate_params() const noexcept {
    KVP_REQUIRE(params_.alpha >= 0.0 && params_.alpha <= 1.0, "adakv: alpha is %g, must be in [0, 1]", params_.alpha);
    return params_.budget.validate(kName);
  }

  /// Average tokens kept per row (protected included), -1 if the budget is invalid for kv_len.
  std::int64_t kept_count(std::int64_t kv_len) const noexcept {
    std::int64_t n = 0;
    if (!validate_params().is_ok() || !params_.budget.resolve(kName, kv_len, scorer_.protected_tokens(kv_len), &n).is_ok()) return -1;
    return n;
  }

  /// Upper bound of the tokens one sequence keeps over its `rows` rows: exact
  /// (rows * kept_count) for kvpress; the original's rounding may add up to one
  /// token per row. Size KeepSet capacity with the sum over the batch.
  std::int64_t max_total_kept(std::int64_t kv_len, std::int64_t rows) const noexcept {
    const std::int64_t n = kept_count(kv_len);
    if (n < 0) return -1;
    if (params_.variant == AdaKVVariant::kKvpress || n >= kv_len) return rows * n;
    return std::min(rows * kv_len, rows * (n + 1));
  }

  /// KeepSet rows per sequence for `num_q_heads` query and `num_kv_heads` kv heads.
  std::int64_t rows_per_sequence(std::int64_t num_q_heads, std::int64_t num_kv_heads) const noexcept {
    return params_.heads == HeadGranularity::kQueryHead ? num_q_heads : num_kv_heads;
  }

  /// Tokens scored +inf by rule: the scorer's.
  std::int64_t protected_tokens(std::int64_t kv_len) const noexcept { return scorer_.protected_tokens(kv_len); }

  /// The size query: workspace, KeepSet rows (batch x rows_per_sequence) and
  /// capacity (the sum of `max_total_kept` over the batch, at most), the
  /// scorer's query window.
  template <class Backend>
  Requirements requirements(const Context<Backend>& ctx, const ProblemShape& shape) const noexcept {
    const Requirements sr = scorer_.requirements(ctx, shape);
    Status st = validate_params();
    if (st.is_ok()) st = sr.status;
    std::int64_t n = 0;
    if (st.is_ok()) st = params_.budget.resolve(kName, shape.max_kv_len, protected_tokens(shape.max_kv_len), &n);
    Requirements r;
    r.status = st;
    if (!st.is_ok()) return r;
    const std::int64_t rows = rows_per_sequence(shape.num_q_heads, shape.num_kv_heads);
    r.workspace_bytes = layout<Backend>(shape, ctx.exec).plan.total();
    r.output = OutputSize{shape.batch * rows, shape.batch * max_total_kept(shape.max_kv_len, rows)};
    r.query_window = sr.query_window;
    return r;
  }

  /// The scorer's scores (Ada-KV changes only the allocation).
  template <class Backend, class In>
    requires HeadScorer<Scorer, In, Backend> Status score(const Context<Backend>& cx, const In& in, ScoreMap out)
  const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    return scorer_.score(cx, in, out);
  }

  /// Eviction decision for a batch; rows b * rows_per_sequence + h, ragged.
  template <class Backend, class In>
    requires HeadScorer<Scorer, In, Backend> Status evict(const Context<Backend>& cx, std::span<const In> batch, KeepSet out)
  const noexcept {
    const Workspace ws = cx.workspace;
    const ExecContext& ctx = cx.exec;
    KVP_RETURN_IF_ERROR(validate_params());
    ProblemShape shape;
    KVP_RETURN_IF_ERROR(scorer_.validate(batch, &shape));
    const std::int64_t rows = rows_per_sequence(shape.num_q_heads, shape.num_kv_heads);
    std::int64_t total = 0;
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const std::int64_t T = batch[b].keys.kv_len(), P = scorer_.protected_tokens(T);
      std::int64_t n = 0;
      KVP_RETURN_IF_ERROR(params_.budget.resolve(kName, T, P, &n));
      KVP_REQUIRE(params_.variant != AdaKVVariant::kOriginal || params_.budget.total(T, P) >= P,
                  "adakv: budget of %lld tokens per head is smaller than the %lld protected tokens (sequence %zu)",
                  static_cast<long long>(params_.budget.total(T, P)), static_cast<long long>(P), b);
      KVP_REQUIRE(rows * T <= INT32_MAX, "adakv: %lld rows x kv_len %lld exceed the int32 range of the layer-wide selection",
                  static_cast<long long>(rows), static_cast<long long>(T));
      total += max_total_kept(T, rows);
    }
    KVP_RETURN_IF_ERROR(out.check_output(kName, static_cast<std::int64_t>(batch.size()) * rows, total));
    KVP_REQUIRE(total <= INT32_MAX, "adakv: %lld kept tokens overflow the int32 keep-set indices", static_cast<long long>(total));
    const Layout l = layout<Backend>(shape, ctx);
    KVP_RETURN_IF_ERROR(check_workspace(kName, ws, l.plan.total()));

    Buffers buf = carve(ws, l);
    out.indptr[0] = 0;
    for (std::size_t b = 0; b < batch.size(); ++b) {
      KVP_RETURN_IF_ERROR(select_one<Backend>(batch[b], shape, rows, static_cast<std::int64_t>(b) * rows, out, buf, ctx));
    }
    return Status::ok();
  }

  template <class Backend, class In>
    requires HeadScorer<Scorer, In, Backend> Status evict(const Context<Backend>& cx, const In& in, KeepSet out)
  const noexcept { return evict(cx, std::span<const In>(&in, 1), out); }

 private:
  struct Layout {
    WorkspacePlan plan;
    std::size_t rows = 0, rows_t = 0, per_row_topk = 0, global_topk = 0, scorer = 0;
  };
  struct Buffers {
    float* scores = nullptr;        // (rows, T): the scorer's output
    float* cand = nullptr;          // rows*T: candidates of the layer-wide selection
    std::int32_t* map = nullptr;    // rows*T: flat index of each candidate
    std::int32_t* sel = nullptr;    // rows*T: selected candidate positions
    std::int32_t* safe = nullptr;   // rows*T: kvpress safeguard, n_safe per row
    std::int64_t* count = nullptr;  // rows: tokens kept per row
    std::int64_t* prot = nullptr;   // rows: protected (+inf) tokens per row
    Workspace global_ws{}, scorer_ws{};
    Workspace rows_ws{};  // per-row top-k: ops::topk_rows, or per-worker slices
    detail::WorkerSlices slices{};
  };

  template <class Backend>
  Layout layout(const ProblemShape& s, const ExecContext& ctx) const noexcept {
    Layout l;
    const std::int64_t rows = std::max<std::int64_t>(1, rows_per_sequence(s.num_q_heads, s.num_kv_heads));
    const std::int64_t T = std::max<std::int64_t>(1, s.max_kv_len);
    l.rows = static_cast<std::size_t>(rows);
    l.rows_t = static_cast<std::size_t>(rows * T);
    l.per_row_topk = Backend::topk_workspace(T);
    l.global_topk = Backend::topk_workspace(rows * T);
    l.scorer = scorer_.requirements(Context<Backend>{{}, ctx}, s).workspace_bytes;
    const std::size_t rt = l.rows_t, nr = l.rows, extra = detail::WorkerSlices::bytes(l.per_row_topk, ctx.workers());
    WorkspacePlan plan;  // same order as `carve`
    plan.add<float>(rt).add<float>(rt).add<std::int32_t>(rt).add<std::int32_t>(rt).add<std::int32_t>(rt);
    plan.add<std::int64_t>(nr).add<std::int64_t>(nr);
    plan.add_bytes(l.global_topk).add_bytes(l.scorer).add_bytes(extra);
    l.plan = plan;
    return l;
  }

  static Buffers carve(Workspace ws, const Layout& l) noexcept {
    WorkspaceCarver c(ws);
    Buffers b;
    b.scores = c.take<float>(l.rows_t);
    b.cand = c.take<float>(l.rows_t);
    b.map = c.take<std::int32_t>(l.rows_t);
    b.sel = c.take<std::int32_t>(l.rows_t);
    b.safe = c.take<std::int32_t>(l.rows_t);
    b.count = c.take<std::int64_t>(l.rows);
    b.prot = c.take<std::int64_t>(l.rows);
    b.global_ws = Workspace{c.take<std::byte>(l.global_topk), l.global_topk};
    b.scorer_ws = Workspace{c.take<std::byte>(l.scorer), l.scorer};
    b.rows_ws = c.rest();
    b.slices = detail::WorkerSlices::carve(b.rows_ws, l.per_row_topk);
    return b;
  }

  /// Keep every token of rows [row0, row0 + rows).
  static void keep_all(std::int64_t T, std::int64_t rows, std::int64_t row0, KeepSet& out) noexcept {
    for (std::int64_t r = 0; r < rows; ++r) {
      out.indptr[row0 + r + 1] = static_cast<std::int32_t>(out.indptr[row0 + r] + T);
      std::int32_t* dst = out.indices + out.indptr[row0 + r];
      for (std::int64_t j = 0; j < T; ++j) dst[j] = static_cast<std::int32_t>(j);
    }
  }

  /// Per-row scores (rows, T) into buf.scores: the scorer once (kv heads) or
  /// once per group member on the query-head subsets (query heads).
  template <class Backend, class In>
  Status score_rows(const In& in, const ProblemShape& shape, std::int64_t T, Buffers& buf, const ExecContext& ctx) const noexcept {
    if (params_.heads == HeadGranularity::kKvHead) {
      return scorer_.score(Context<Backend>{buf.scorer_ws, ctx}, in, TensorView<float, 2>::contiguous(buf.scores, {shape.num_kv_heads, T}));
    }
    const std::int64_t G = shape.num_q_heads / shape.num_kv_heads;
    for (std::int64_t g = 0; g < G; ++g) {
      // Rows h*G + g of the (Hq, T) buffer: a (Hkv, T) view with row stride G*T.
      const TensorView<float, 2> rows_g(buf.scores + g * T, {shape.num_kv_heads, T}, {G * T, 1});
      KVP_RETURN_IF_ERROR(scorer_.score(Context<Backend>{buf.scorer_ws, ctx}, query_head_subset(in, g, G), rows_g));
    }
    return Status::ok();
  }

  template <class Backend, class In>
  Status select_one(const In& in, const ProblemShape& shape, std::int64_t rows, std::int64_t row0, KeepSet& out, Buffers& buf,
                    const ExecContext& ctx) const noexcept {
    const std::int64_t T = in.keys.kv_len(), P = scorer_.protected_tokens(T);
    const std::int64_t n_total = params_.budget.total(T, P);  // unclamped, protected included
    if (n_total >= T && (params_.variant == AdaKVVariant::kKvpress || n_total > T)) {
      keep_all(T, rows, row0, out);  // kvpress r == 0 / the original's B > L: nothing to evict, no scoring
      return Status::ok();
    }
    KVP_RETURN_IF_ERROR(score_rows<Backend>(in, shape, T, buf, ctx));
    for (std::int64_t r = 0; r < rows; ++r) buf.prot[r] = Backend::count_protected(buf.scores + r * T, T);
    if (params_.variant == AdaKVVariant::kOriginal) {
      allocate_original<Backend>(T, rows, n_total - P, buf);
      detail::append_indptr(out, row0, buf.count, rows);
      ops::topk_rows<Backend>(buf.scores, T, rows, T, out, row0, buf.rows_ws, ctx);
    } else {
      select_kvpress<Backend>(T, rows, std::min(n_total, T), row0, out, buf, ctx);
    }
    return Status::ok();
  }

  /// The original allocation: buf.count[r] = cap[r] + protected, B past tokens per row on average.
  template <class Backend>
  void allocate_original(std::int64_t T, std::int64_t rows, std::int64_t B, Buffers& buf) const noexcept {
    const float* S = buf.scores;
    const float* ranked = S;
    std::int64_t protected_total = 0;
    for (std::int64_t r = 0; r < rows; ++r) protected_total += buf.prot[r];
    if (params_.normalize) {
      // Row r scaled by sum(top-B past scores) / sum(all past scores), in fp32 like the reference.
      for (std::int64_t r = 0; r < rows; ++r) {
        const float* s = S + r * T;
        Backend::topk(s, T, std::min<std::int64_t>(T, B + buf.prot[r]), buf.sel, buf.global_ws);
        double top = 0.0, all = 0.0;
        for (std::int64_t i = 0; i < std::min<std::int64_t>(T, B + buf.prot[r]); ++i)
          if (s[buf.sel[i]] != INFINITY) top += s[buf.sel[i]];
        for (std::int64_t j = 0; j < T; ++j)
          if (s[j] != INFINITY) all += s[j];
        const float den = static_cast<float>(all);
        const float f =
            (den != 0.0f && std::isfinite(den) && std::isfinite(static_cast<float>(top))) ? static_cast<float>(top) / den : 1.0f;
        for (std::int64_t j = 0; j < T; ++j) buf.cand[r * T + j] = s[j] == INFINITY ? s[j] : s[j] * f;
      }
      ranked = buf.cand;
    }
    // Layer-wide top (rows*B + protected): protected tokens first, then each head's share of the best B*rows.
    const std::int64_t k = std::min(rows * T, rows * B + protected_total);
    Backend::topk(ranked, rows * T, k, buf.sel, buf.global_ws);
    for (std::int64_t r = 0; r < rows; ++r) buf.count[r] = -buf.prot[r];
    for (std::int64_t i = 0; i < k; ++i) ++buf.count[buf.sel[i] / T];
    const auto floor_cap = static_cast<std::int64_t>(static_cast<double>(B) * params_.alpha);
    const float keep_f = static_cast<float>(1.0 - params_.alpha);
    for (std::int64_t r = 0; r < rows; ++r) {
      const float v = detail::rounded_mul(static_cast<float>(buf.count[r]), keep_f) + static_cast<float>(floor_cap);
      const auto cap = static_cast<std::int64_t>(round_half_even(static_cast<double>(v)));
      buf.count[r] = std::clamp<std::int64_t>(cap, 0, T - buf.prot[r]) + buf.prot[r];
    }
  }

  /// kvpress AdaKVPress: safeguard per row, then the layer-wide best of the rest; writes rows and indptr.
  template <class Backend>
  void select_kvpress(std::int64_t T, std::int64_t rows, std::int64_t n_kept, std::int64_t row0, KeepSet& out, Buffers& buf,
                      const ExecContext& ctx) const noexcept {
    auto n_safe = static_cast<std::int64_t>(static_cast<double>(n_kept) * params_.alpha);
    if (params_.budget.at_least_one && params_.alpha > 0.0) n_safe = n_kept > 0 ? std::max<std::int64_t>(1, n_safe) : 0;
    n_safe = std::min(n_safe, n_kept);
    // 1. Safeguard: each row's own best n_safe tokens (ascending).
    ctx.parallel_for(rows, [&](std::int64_t r, int worker) {
      Backend::topk(buf.scores + r * T, T, n_safe, buf.safe + r * n_safe, buf.slices.slice(worker));
    });
    // 2. Candidates: everything not safeguarded, in flat order (so ties go to the higher flat index).
    std::int64_t m = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int32_t* sf = buf.safe + r * n_safe;
      std::int64_t q = 0;
      for (std::int64_t j = 0; j < T; ++j) {
        if (q < n_safe && sf[q] == j) {
          ++q;
          continue;
        }
        buf.cand[m] = buf.scores[r * T + j];
        buf.map[m++] = static_cast<std::int32_t>(r * T + j);
      }
    }
    // 3. The layer keeps rows*n_kept tokens: the safeguarded ones plus the best rows*(n_kept - n_safe) candidates.
    const std::int64_t extra = rows * (n_kept - n_safe);
    Backend::topk(buf.cand, m, extra, buf.sel, buf.global_ws);
    for (std::int64_t r = 0; r < rows; ++r) buf.count[r] = n_safe;
    for (std::int64_t i = 0; i < extra; ++i) {
      buf.sel[i] = buf.map[buf.sel[i]];  // ascending flat indices
      ++buf.count[buf.sel[i] / T];
    }
    detail::append_indptr(out, row0, buf.count, rows);
    // 4. Row r = merge(safeguard, its global picks), both ascending.
    std::int64_t g = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      std::int32_t* dst = out.indices + out.indptr[row0 + r];
      const std::int32_t* sf = buf.safe + r * n_safe;
      const std::int64_t g_end = g + (buf.count[r] - n_safe);
      std::int64_t a = 0;
      while (a < n_safe || g < g_end) {
        const std::int64_t tok_g = g < g_end ? buf.sel[g] - r * T : INT64_MAX;
        if (a < n_safe && sf[a] < tok_g) {
          *dst++ = sf[a++];
        } else {
          *dst++ = static_cast<std::int32_t>(tok_g);
          ++g;
        }
      }
    }
  }

  Params params_{};
  Scorer scorer_{};
};

static_assert(EvictionPolicy<AdaKV<SnapKV>, ScoreInput<float, half>> && Scorer<AdaKV<SnapKV>, ScoreInput<float, float>>);

KVP_NAMESPACE_END
