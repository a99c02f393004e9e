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
// Structure: `AdaKV<Scorer>` = the scorer's (rows, T) map, then the
// `AdaKVAllocation` (budget/adakv_allocation.hpp, a `BudgetAllocator`: the
// per-row counts of either variant), then each row's best `count` tokens
// (`ops::topk_rows`). The allocation is usable on its own, over any score map.
//
// Choices where references differ or are silent (each pinned by a test):
//  * Protected tokens score +inf (kvpress pads with max+1, the originals
//    append the window). They always win: kvpress's safeguard and global
//    competition see them first, exactly as with max+1. The original's
//    allocation counts them by the scorer's rule (protected_tokens(T)), so a
//    past token whose score overflows to +inf stays an ordinary token.
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
//  * Device backends (`backend::Cuda`): the counts depend on the scores, so
//    the decision runs as one `ops::adakv_keep` per sequence after its scores
//    (ops/adakv_keep.hpp: thresholds instead of sorted candidates, the same
//    counts and rows) and `KeepSet::indptr` is **device memory**, written on
//    the device, unlike the policies whose offsets follow from the shapes
//    (host memory). No synchronisation, so a decision can be captured in a
//    CUDA graph; an engine reads the offsets as varlen attention's
//    cu_seqlens. Sharded (tensor-parallel) layers stay on the host.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <span>

#include "kvpolicy/policy/budget.hpp"
#include "kvpolicy/policy/budget/adakv_allocation.hpp"
#include "kvpolicy/policy/budget/allocation.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "kvpolicy/policy/policy.hpp"

KVP_NAMESPACE_BEGIN

enum class HeadGranularity : std::uint8_t {
  kKvHead,     ///< one row per (sequence, kv head)
  kQueryHead,  ///< one row per (sequence, query head): the original's per-query-head cache
};

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

  /// The allocation for sequences of `kv_len` tokens (the scorer's protected tokens by rule).
  AdaKVAllocation allocation(std::int64_t kv_len) const noexcept {
    return AdaKVAllocation{params_.variant, params_.alpha, params_.normalize, params_.budget, scorer_.protected_tokens(kv_len)};
  }

  Status validate_params() const noexcept {
    KVP_RETURN_IF_ERROR(check_enum_fields(kName, params_));
    return allocation(0).validate(kName);
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
    return kept_count(kv_len) < 0 ? -1 : allocation(kv_len).max_total(kv_len, rows);
  }

  /// The same bound for `rows` rows held by one rank of a sharded layer
  /// (`exec.shard`): the budget is the layer's, so a rank's heads may take up
  /// to all of it, min(rows * kv_len, the whole layer's bound). Without a
  /// distributed shard, `max_total_kept(kv_len, rows)`.
  std::int64_t max_total_kept(std::int64_t kv_len, std::int64_t rows, const ExecContext& exec) const noexcept {
    if (exec.shard == nullptr || !exec.shard->distributed()) return max_total_kept(kv_len, rows);
    const HeadShard& sh = *exec.shard;
    const std::int64_t R = params_.heads == HeadGranularity::kQueryHead ? sh.num_q_heads : sh.num_kv_heads;
    const std::int64_t whole = max_total_kept(kv_len, std::max(R, rows));
    return whole < 0 ? -1 : std::min(rows * kv_len, whole);
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
    if (st.is_ok() && kDeviceBackend<Backend> && sharded(ctx))
      st = Status::error(StatusCode::kUnsupported,
                         "adakv: a tensor-parallel (sharded) layer is decided on the host; a device backend takes whole layers");
    r.status = st;
    if (!st.is_ok()) return r;
    const std::int64_t rows = rows_per_sequence(shape.num_q_heads, shape.num_kv_heads);
    r.workspace_bytes = sharded(ctx) ? shard_layout<Backend>(shape, ctx).total() : layout<Backend>(shape, ctx).total();
    r.output = OutputSize{shape.batch * rows, shape.batch * max_total_kept(shape.max_kv_len, rows, ctx.exec)};
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

  /// Eviction decision for a batch; rows b * rows_per_sequence + h, ragged:
  /// per sequence, the scorer's map, the allocation's counts, each row's best.
  template <class Backend, class In>
    requires HeadScorer<Scorer, In, Backend> Status evict(const Context<Backend>& cx, std::span<const In> batch, KeepSet out)
  const noexcept {
    if constexpr (kDeviceBackend<Backend>) {
      if (sharded(cx))
        return Status::error(StatusCode::kUnsupported,
                             "adakv: a tensor-parallel (sharded) layer is decided on the host; a device backend takes whole layers");
      return evict_device(cx, batch, out);
    } else {
      if (sharded(cx)) return evict_sharded(cx, batch, out);
      ProblemShape shape;
      std::int64_t rows = 0;
      std::uint64_t fingerprint = 0;
      KVP_RETURN_IF_ERROR(check_call(cx, batch, out, false, &shape, &rows, &fingerprint));
      Buffers buf = carve(cx, shape);
      out.indptr[0] = 0;
      for (std::size_t b = 0; b < batch.size(); ++b)
        KVP_RETURN_IF_ERROR(select_one<Backend>(cx, batch[b], shape, rows, static_cast<std::int64_t>(b) * rows, out, buf));
      return Status::ok();
    }
  }

  template <class Backend, class In>
    requires HeadScorer<Scorer, In, Backend> Status evict(const Context<Backend>& cx, const In& in, KeepSet out)
  const noexcept { return evict(cx, std::span<const In>(&in, 1), out); }

 private:
  struct Buffers {
    float* scores = nullptr;        // (rows, T): the scorer's output
    std::int64_t* count = nullptr;  // rows: tokens kept per row
    Workspace alloc{}, scorer{}, rows{};
  };
  struct Sizes {
    std::size_t rows = 0, rows_t = 0, alloc = 0, scorer = 0, topk = 0;
  };

  template <class Backend>
  static bool sharded(const Context<Backend>& cx) noexcept {
    return cx.exec.shard != nullptr && cx.exec.shard->distributed();
  }

  /// Checks of `evict` for one call; on success `shape`, `rows` and the
  /// handshake fingerprint (batch, lengths, per-row budgets) are set.
  template <class Backend, class In>
  Status check_call(const Context<Backend>& cx, std::span<const In> batch, const KeepSet& out, bool shard_layout_ws, ProblemShape* shape,
                    std::int64_t* rows_out, std::uint64_t* fingerprint) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    if constexpr (kDeviceBackend<Backend>)
      KVP_RETURN_IF_ERROR(scorer_.validate(batch, shape, /*on_device=*/true));
    else
      KVP_RETURN_IF_ERROR(scorer_.validate(batch, shape));
    shape->batch = static_cast<std::int64_t>(batch.size());
    const std::int64_t rows = rows_per_sequence(shape->num_q_heads, shape->num_kv_heads);
    std::int64_t total = 0;
    std::uint64_t fp = fingerprint_mix(fingerprint_mix(0, batch.size()), static_cast<std::uint64_t>(params_.variant));
    fp = fingerprint_mix(fingerprint_mix(fp, std::bit_cast<std::uint64_t>(params_.alpha)), params_.normalize ? 1u : 0u);
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const std::int64_t T = batch[b].keys.kv_len(), P = scorer_.protected_tokens(T);
      std::int64_t n = 0;
      KVP_RETURN_IF_ERROR(params_.budget.resolve(kName, T, P, &n));
      KVP_REQUIRE(params_.variant != AdaKVVariant::kOriginal || params_.budget.total(T, P) >= P,
                  "adakv: budget of %lld tokens per head is smaller than the %lld protected tokens (sequence %zu)",
                  static_cast<long long>(params_.budget.total(T, P)), static_cast<long long>(P), b);
      KVP_REQUIRE(rows * T <= INT32_MAX, "adakv: %lld rows x kv_len %lld exceed the int32 range of the layer-wide selection",
                  static_cast<long long>(rows), static_cast<long long>(T));
      total += max_total_kept(T, rows, cx.exec);
      fp = fingerprint_mix(fingerprint_mix(fingerprint_mix(fp, static_cast<std::uint64_t>(T)), static_cast<std::uint64_t>(P)),
                           static_cast<std::uint64_t>(allocation(T).per_row(T)));
    }
    KVP_RETURN_IF_ERROR(out.check_output(kName, static_cast<std::int64_t>(batch.size()) * rows, total));
    KVP_REQUIRE(total <= INT32_MAX, "adakv: %lld kept tokens overflow the int32 keep-set indices", static_cast<long long>(total));
    KVP_RETURN_IF_ERROR(check_workspace(kName, cx.workspace,
                                        shard_layout_ws ? shard_layout<Backend>(*shape, cx).total() : layout<Backend>(*shape, cx).total()));
    *rows_out = rows;
    *fingerprint = fp;
    return Status::ok();
  }

  /// A device backend: the whole decision on the device, one `ops::adakv_keep`
  /// per sequence after its scores, so nothing returns to the host. The row
  /// offsets depend on the scores, so `out.indptr` is device memory here,
  /// written on the device (indptr[0] = 0 included); the capacity check uses
  /// the same host bound as the host path.
  template <class Backend, class In>
  Status evict_device(const Context<Backend>& cx, std::span<const In> batch, KeepSet out) const noexcept {
    ProblemShape shape;
    std::int64_t rows = 0;
    std::uint64_t fingerprint = 0;
    KVP_RETURN_IF_ERROR(check_call(cx, batch, out, false, &shape, &rows, &fingerprint));
    Buffers buf = carve(cx, shape);
    const detail::BackendCall<Backend> call(cx);
    KVP_RETURN_IF_ERROR(call.begin());
    Backend::iota(out.indptr, 0, 1);
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const std::int64_t T = batch[b].keys.kv_len(), row0 = static_cast<std::int64_t>(b) * rows;
      const AdaKVKeepSpec spec = allocation(T).keep_spec(T, rows);
      if (!spec.keep_all) KVP_RETURN_IF_ERROR(score_rows(cx, batch[b], shape, T, buf));
      ops::adakv_keep<Backend>(buf.scores, rows, T, spec, buf.count, out.indptr + row0, out.indices, buf.alloc);
    }
    return call.end();
  }

  /// Tensor parallelism: this rank's rows of the layer, decided with the
  /// other ranks' (budget/sharded_cut.hpp). Sequence by sequence the scorer's
  /// map and the allocation's candidates are kept, one cut serves the whole
  /// batch, then each row keeps its count. Collectives: the hand-shake, the
  /// cut's rounds (at most 4 all-reduces and one all-gather) and, for the
  /// original variant only when a cut falls inside the +inf (protected)
  /// scores, one all-reduce of a flag per sequence.
  template <class Backend, class In>
  Status evict_sharded(const Context<Backend>& cx, std::span<const In> batch, KeepSet out) const noexcept {
    const HeadShard& sh = *cx.exec.shard;
    ProblemShape shape;
    std::int64_t rows = 0, row_offset = 0, global_rows = 0;
    std::uint64_t fp = 0;
    Status local = check_call(cx, batch, out, true, &shape, &rows, &fp);
    if (local.is_ok()) local = sh.validate(kName, shape.num_q_heads, shape.num_kv_heads);
    if (local.is_ok()) {
      const bool per_q = params_.heads == HeadGranularity::kQueryHead;
      const std::int64_t G = sh.num_q_heads / sh.num_kv_heads;
      row_offset = per_q ? sh.kv_head_offset * G : sh.kv_head_offset;
      global_rows = per_q ? sh.num_q_heads : sh.num_kv_heads;
    } else if (!sh.comm || !sh.comm->validate(kName).is_ok()) {
      return local;  // no usable collective: nothing can be said to the peers
    }
    ShardLayout L;
    if (local.is_ok()) L = carve_shard(cx, shape);
    alignas(64) std::byte hs_ws[4096];
    const std::size_t hs_bytes = shard_handshake_workspace(sh.comm->world_size);
    const Workspace hws = hs_bytes <= sizeof(hs_ws) ? Workspace{hs_ws, sizeof(hs_ws)} : L.handshake;
    if (!local.is_ok() && hs_bytes > sizeof(hs_ws)) return local;  // over ~100 ranks the hand-shake needs the (rejected) workspace
    KVP_RETURN_IF_ERROR(shard_handshake(kName, *sh.comm, local, row_offset, rows, global_rows, fp, hws));

    const auto nb = batch.size();
    ShardedTopK* problems = L.problems;
    ShardedCut* cuts = L.cuts;
    const std::int64_t rt = rows * std::max<std::int64_t>(shape.max_kv_len, 1);
    for (std::size_t b = 0; b < nb; ++b) {
      const auto& in = batch[b];
      const std::int64_t T = in.keys.kv_len();
      const AdaKVAllocation alloc = allocation(T);
      const std::int64_t n_total = alloc.per_row(T);
      problems[b] = ShardedTopK{};
      if (n_total > T || (n_total == T && params_.variant == AdaKVVariant::kKvpress)) continue;  // keeps everything: k = 0
      Buffers buf = L.seq;
      buf.scores = L.scores + static_cast<std::size_t>(b) * static_cast<std::size_t>(rt);
      KVP_RETURN_IF_ERROR(score_rows(cx, in, shape, T, buf));
      problems[b] = alloc.template shard_candidates<Backend>(buf.scores, T, rows, global_rows, L.shard_bufs(b, rt), L.row_ws, cx.exec);
    }
    KVP_RETURN_IF_ERROR(
        sharded_cut(kName, *sh.comm, row_offset, std::span<const ShardedTopK>(problems, nb), std::span<ShardedCut>(cuts, nb), L.cut_ws));
    // The original's counts are undefined when a cut falls inside the +inf scores on some rank: one flag per sequence, summed.
    std::int64_t* undefined = L.flags;
    bool ask = false;
    for (std::size_t b = 0; b < nb; ++b) {
      undefined[b] = 0;
      const std::int64_t T = batch[b].keys.kv_len();
      if (problems[b].values == nullptr) continue;
      std::int64_t* count = L.counts + static_cast<std::size_t>(b) * static_cast<std::size_t>(rows);
      const bool defined = allocation(T).shard_counts(problems[b], cuts[b], T, rows, L.shard_bufs(b, rt), count);
      undefined[b] = defined ? 0 : 1;
      ask = ask || (params_.variant == AdaKVVariant::kOriginal && cuts[b].key == score_order_key(INFINITY));
    }
    if (ask) KVP_RETURN_IF_ERROR(sh.comm->all_reduce_sum(undefined, nb));
    // Counts first, checked against the output before anything is written (a collective that returned
    // inconsistent sums must not make the rows overrun the KeepSet).
    std::int64_t kept = 0;
    for (std::size_t b = 0; b < nb; ++b) {
      const std::int64_t T = batch[b].keys.kv_len();
      std::int64_t* count = L.counts + static_cast<std::size_t>(b) * static_cast<std::size_t>(rows);
      if (problems[b].values == nullptr) {
        std::fill(count, count + rows, T);
      } else {
        allocation(T).shard_finish(T, rows, undefined[b] == 0, count);
      }
      for (std::int64_t r = 0; r < rows; ++r) {
        if (count[r] < 0 || count[r] > T)
          return Status::error(StatusCode::kCollectiveError,
                               "adakv: the collective's sums give row %lld of sequence %zu %lld of %lld tokens", static_cast<long long>(r),
                               b, static_cast<long long>(count[r]), static_cast<long long>(T));
        kept += count[r];
      }
    }
    if (kept > out.capacity)
      return Status::error(StatusCode::kCollectiveError, "adakv: the collective's sums give %lld kept tokens, more than the bound %lld",
                           static_cast<long long>(kept), static_cast<long long>(out.capacity));
    out.indptr[0] = 0;
    for (std::size_t b = 0; b < nb; ++b) {
      const std::int64_t T = batch[b].keys.kv_len(), row0 = static_cast<std::int64_t>(b) * rows;
      if (problems[b].values == nullptr) {
        keep_all(T, rows, row0, out);
        continue;
      }
      const std::int64_t* count = L.counts + static_cast<std::size_t>(b) * static_cast<std::size_t>(rows);
      detail::append_indptr(out, row0, count, rows);
      const float* scores = L.scores + static_cast<std::size_t>(b) * static_cast<std::size_t>(rt);
      ops::topk_rows<Backend>(scores, T, rows, T, out, row0, L.seq.rows, cx.exec);
    }
    return Status::ok();
  }

  /// Workspace of the sharded path: every sequence's score map and candidate
  /// buffers (the cut needs all of them at once), counts, the cut's and the
  /// hand-shake's scratch, one row top-k per worker, the scorer's workspace
  /// and the final per-row top-k.
  struct ShardLayout {
    float* scores = nullptr;
    std::byte* bufs = nullptr;  // per sequence: AdaKVAllocation::ShardBuffers
    std::size_t buf_stride = 0;
    std::int64_t* counts = nullptr;
    std::int64_t* flags = nullptr;
    ShardedTopK* problems = nullptr;
    ShardedCut* cuts = nullptr;
    Workspace cut_ws{}, handshake{}, row_ws{};
    Buffers seq{};  // scorer and final top-k workspaces (scores / count unused)

    AdaKVAllocation::ShardBuffers shard_bufs(std::size_t b, std::int64_t rt) const noexcept {
      WorkspaceCarver c(Workspace{bufs + b * buf_stride, buf_stride});
      return AdaKVAllocation::take_shard_buffers(c, rt, 1);
    }
  };
  template <class Backend, class Alloc>
  void shard_plan(Alloc& a, const ProblemShape& s, const Context<Backend>& ctx, ShardLayout* L) const noexcept {
    const Sizes z = sizes(s, ctx);
    const auto nb = static_cast<std::size_t>(std::max<std::int64_t>(s.batch, 1));
    const std::int64_t rt = static_cast<std::int64_t>(z.rows_t);
    WorkspacePlan one;
    AdaKVAllocation::take_shard_buffers(one, rt, 1);
    const std::size_t stride = align_up(one.bytes);
    const int world = ctx.exec.shard != nullptr && ctx.exec.shard->comm != nullptr ? ctx.exec.shard->comm->world_size : 1;
    const std::size_t cut = sharded_cut_workspace(nb, world), hs = shard_handshake_workspace(world),
                      row = AdaKVAllocation::shard_row_workspace<Backend>(s.max_kv_len, ctx.exec);
    float* scores = a.template take<float>(nb * z.rows_t);
    std::byte* bufs = a.template take<std::byte>(nb * stride);
    std::int64_t* counts = a.template take<std::int64_t>(nb * z.rows);
    std::int64_t* flags = a.template take<std::int64_t>(nb);
    ShardedTopK* problems = a.template take<ShardedTopK>(nb);
    ShardedCut* cuts = a.template take<ShardedCut>(nb);
    std::byte* cut_ws = a.template take<std::byte>(cut);
    std::byte* hs_ws = a.template take<std::byte>(hs);
    std::byte* row_ws = a.template take<std::byte>(row);
    std::byte* scorer = a.template take<std::byte>(z.scorer);
    std::byte* topk = a.template take<std::byte>(z.topk);
    if (L != nullptr)
      *L = ShardLayout{scores,
                       bufs,
                       stride,
                       counts,
                       flags,
                       problems,
                       cuts,
                       Workspace{cut_ws, cut},
                       Workspace{hs_ws, hs},
                       Workspace{row_ws, row},
                       Buffers{nullptr, nullptr, Workspace{}, Workspace{scorer, z.scorer}, Workspace{topk, z.topk}}};
  }
  template <class Backend>
  WorkspacePlan shard_layout(const ProblemShape& s, const Context<Backend>& ctx) const noexcept {
    WorkspacePlan p;
    shard_plan(p, s, ctx, nullptr);
    return p;
  }
  template <class Backend>
  ShardLayout carve_shard(const Context<Backend>& ctx, const ProblemShape& s) const noexcept {
    WorkspaceCarver c(ctx.workspace);
    ShardLayout L;
    shard_plan(c, s, ctx, &L);
    return L;
  }

  template <class Backend>
  Sizes sizes(const ProblemShape& s, const Context<Backend>& ctx) const noexcept {
    const std::int64_t rows = std::max<std::int64_t>(1, rows_per_sequence(s.num_q_heads, s.num_kv_heads));
    const std::int64_t T = std::max<std::int64_t>(1, s.max_kv_len);
    const std::size_t alloc =
        kDeviceBackend<Backend> ? ops::adakv_keep_workspace<Backend>(rows, T) : allocation(T).workspace_bytes(ctx, rows, T);
    return Sizes{static_cast<std::size_t>(rows), static_cast<std::size_t>(rows * T), alloc,
                 scorer_.requirements(Context<Backend>{{}, ctx.exec}, s).workspace_bytes, ops::topk_rows_workspace<Backend>(T, ctx.exec)};
  }
  template <class Backend>
  WorkspacePlan layout(const ProblemShape& s, const Context<Backend>& ctx) const noexcept {
    const Sizes z = sizes(s, ctx);
    WorkspacePlan plan;  // same order as `carve`
    plan.add<float>(z.rows_t);
    plan.add<std::int64_t>(z.rows);
    plan.add_bytes(z.alloc).add_bytes(z.scorer).add_bytes(z.topk);
    return plan;
  }
  template <class Backend>
  Buffers carve(const Context<Backend>& ctx, const ProblemShape& s) const noexcept {
    const Sizes z = sizes(s, ctx);
    WorkspaceCarver c(ctx.workspace);
    Buffers b;
    b.scores = c.take<float>(z.rows_t);
    b.count = c.take<std::int64_t>(z.rows);
    b.alloc = Workspace{c.take<std::byte>(z.alloc), z.alloc};
    b.scorer = Workspace{c.take<std::byte>(z.scorer), z.scorer};
    b.rows = c.rest();
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
  Status score_rows(const Context<Backend>& cx, const In& in, const ProblemShape& shape, std::int64_t T, Buffers& buf) const noexcept {
    const Context<Backend> scx = cx.with_workspace(buf.scorer);
    if (params_.heads == HeadGranularity::kKvHead) {
      return scorer_.score(scx, in, TensorView<float, 2>::contiguous(buf.scores, {shape.num_kv_heads, T}));
    }
    const std::int64_t G = shape.num_q_heads / shape.num_kv_heads;
    for (std::int64_t g = 0; g < G; ++g) {
      // Rows h*G + g of the (Hq, T) buffer: a (Hkv, T) view with row stride G*T.
      const TensorView<float, 2> rows_g(buf.scores + g * T, {shape.num_kv_heads, T}, {G * T, 1});
      KVP_RETURN_IF_ERROR(scorer_.score(scx, query_head_subset(in, g, G), rows_g));
    }
    return Status::ok();
  }

  template <class Backend, class In>
  Status select_one(const Context<Backend>& cx, const In& in, const ProblemShape& shape, std::int64_t rows, std::int64_t row0, KeepSet& out,
                    Buffers& buf) const noexcept {
    const std::int64_t T = in.keys.kv_len();
    const AdaKVAllocation alloc = allocation(T);
    const std::int64_t n_total = alloc.per_row(T);  // unclamped, protected included
    if (n_total > T || (n_total == T && params_.variant == AdaKVVariant::kKvpress)) {
      keep_all(T, rows, row0, out);  // kvpress r == 0 / the original's B > L: nothing to evict, no scoring
      return Status::ok();
    }
    KVP_RETURN_IF_ERROR(score_rows(cx, in, shape, T, buf));
    KVP_RETURN_IF_ERROR(alloc.allocate(cx.with_workspace(buf.alloc), T, TensorView<const float, 2>::contiguous(buf.scores, {rows, T}),
                                       std::span<std::int64_t>(buf.count, static_cast<std::size_t>(rows))));
    detail::append_indptr(out, row0, buf.count, rows);
    ops::topk_rows<Backend>(buf.scores, T, rows, T, out, row0, buf.rows, cx.exec);
    return Status::ok();
  }

  Params params_{};
  Scorer scorer_{};
};

static_assert(EvictionPolicy<AdaKV<SnapKV>, ScoreInput<float, half>> && Scorer<AdaKV<SnapKV>, ScoreInput<float, float>>);

KVP_NAMESPACE_END
