// SPDX-License-Identifier: Apache-2.0
// Ada-KV's budget allocation ("Ada-KV: Optimizing KV Cache Eviction by
// Adaptive Budget Allocation", Feng et al. 2024, arXiv 2407.11550) as a
// `BudgetAllocator`: given one sequence's score map (rows, T) — protected
// tokens +inf — it writes how many tokens each row keeps. The rows then keep
// their best `count[r]` tokens (`ops::topk_rows`); `AdaKV<Scorer>` (adakv.hpp)
// is that composition. Two variants:
//
//  * kOriginal (FFY0/AdaKV `AdaptiveSnapKVCluster`). B = budget - P past tokens
//    per row (P = protected per row). c[r] = how many of row r's past tokens
//    are in the layer-wide top rows*B (after `normalize`: row r scaled by
//    sum(top-B)/sum(all)); cap[r] = round_half_even((1-alpha)*c[r] + int(B*alpha))
//    evaluated in fp32 like torch; count[r] = min(cap[r], T - P) + P.
//  * kKvpress (kvpress `AdaKVPress`). n_kept = the budget per row; every row's
//    best int(alpha * n_kept) tokens are safe; the layer keeps exactly
//    rows*n_kept tokens, the safe ones plus the globally best of the rest.
//    Because the global pick inside one row is a prefix of that row's own
//    order (both orders: higher score, then the higher token), row r keeps
//    exactly its top count[r] tokens, so counts + per-row top-k reproduce
//    kvpress's selection.
//
// Protected tokens are counted by the scorer's rule (`num_protected`), not by
// counting +inf scores: a past token whose score overflows to +inf (Expected
// Attention on extreme inputs) is an ordinary, very high score. If more tokens
// score +inf than the layer's top rows*B + rows*P holds, the original's counts
// are not defined by its formula (some c[r] would be negative); the allocation
// is then uniform (B per row), so the total never exceeds rows * (B + P + 1).
//
// Ties across rows go to the higher flat index r*T + j (the higher head);
// inside a row to the more recent token; NaN ranks below everything.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>

#include "kvpolicy/core/workspace.hpp"
#include "kvpolicy/ops/adakv_keep.hpp"
#include "kvpolicy/policy/budget.hpp"
#include "kvpolicy/policy/budget/sharded_cut.hpp"
#include "kvpolicy/policy/concepts.hpp"
#include "kvpolicy/policy/params.hpp"
#include "kvpolicy/policy/vocabulary.hpp"

KVP_NAMESPACE_BEGIN

enum class AdaKVVariant : std::uint8_t {
  kOriginal,  ///< FFY0/AdaKV: blended capacities (1-alpha)*count + int(alpha*B), window appended
  kKvpress,   ///< kvpress AdaKVPress: per-head safeguard, exact global bottom-k prune
};
inline constexpr EnumName<AdaKVVariant> kAdaKVVariantNames[] = {{"original", AdaKVVariant::kOriginal}, {"kvpress", AdaKVVariant::kKvpress}};
constexpr std::span<const EnumName<AdaKVVariant>> enum_names(AdaKVVariant) noexcept { return kAdaKVVariantNames; }

struct AdaKVAllocation {
  AdaKVVariant variant = AdaKVVariant::kKvpress;
  double alpha = 0.2;      ///< original: floor_alpha; kvpress: alpha_safeguard; in [0, 1]
  bool normalize = false;  ///< original only
  Budget budget = Budget::compression_ratio(0.5);
  std::int64_t num_protected = 0;  ///< protected tokens per row by the scorer's rule (set by AdaKV from protected_tokens(T))

  static constexpr const char* kName = "adakv";

  Status validate(const char* who = kName) const noexcept {
    KVP_REQUIRE(alpha >= 0.0 && alpha <= 1.0, "%s: alpha is %g, must be in [0, 1]", who, alpha);
    return budget.validate(who);
  }

  /// Average tokens kept per row for a sequence of T tokens (protected included), unclamped.
  constexpr std::int64_t per_row(std::int64_t T) const noexcept { return budget.total(T, std::min(num_protected, T)); }

  /// Upper bound of the tokens the `rows` rows of a sequence of T tokens keep:
  /// exact (rows * n) for kvpress; the original's rounding may add one per row.
  std::int64_t max_total(std::int64_t T, std::int64_t rows) const noexcept {
    const std::int64_t n = std::min(per_row(T), T);
    if (variant == AdaKVVariant::kKvpress || n >= T) return rows * n;
    return std::min(rows * T, rows * (n + 1));
  }

  /// Workspace of `allocate` for score maps of at most `rows` x `T`.
  template <class B>
  std::size_t workspace_bytes(const Context<B>& ctx, std::int64_t rows, std::int64_t T) const noexcept {
    return plan<B>(rows, T, ctx.exec).total();
  }

  /// counts[r] = tokens row r of `scores` (rows, T; row stride T) keeps.
  /// `ctx.workspace` holds `workspace_bytes(ctx, rows, T)`.
  template <class B>
  Status allocate(const Context<B>& ctx, std::int64_t T, TensorView<const float, 2> scores, std::span<std::int64_t> counts) const noexcept {
    KVP_RETURN_IF_ERROR(validate());
    KVP_REQUIRE(ctx.exec.shard == nullptr || !ctx.exec.shard->distributed(),
                "adakv: allocate sees one rank's rows of a sharded layer; decide sharded layers with AdaKV<Scorer>::evict (or the "
                "shard_* phases and sharded_cut)");
    const std::int64_t rows = scores.extent(0);
    KVP_REQUIRE(scores.extent(1) == T && (scores.stride(0) == T || rows <= 1) && (scores.stride(1) == 1 || T <= 1),
                "adakv: scores must be a contiguous (rows, kv_len=%lld) map", static_cast<long long>(T));
    KVP_REQUIRE(static_cast<std::int64_t>(counts.size()) == rows, "adakv: %zu counts for %lld rows", counts.size(),
                static_cast<long long>(rows));
    KVP_REQUIRE(rows * T <= INT32_MAX, "adakv: %lld rows x kv_len %lld exceed the int32 range of the layer-wide selection",
                static_cast<long long>(rows), static_cast<long long>(T));
    KVP_RETURN_IF_ERROR(check_workspace(kName, ctx.workspace, workspace_bytes(ctx, rows, T)));
    const std::int64_t P = std::min(num_protected, T), n_total = per_row(T);
    // Nothing to evict: kvpress at r == 0, the original when B > L (at B == L it still rounds its caps).
    if (n_total > T || (n_total == T && variant == AdaKVVariant::kKvpress)) {
      std::fill(counts.begin(), counts.end(), T);
      return Status::ok();
    }
    Scratch s = carve<B>(ctx.workspace, rows, T, ctx.exec);
    if (variant == AdaKVVariant::kOriginal) {
      KVP_REQUIRE(n_total >= P, "adakv: budget of %lld tokens per head is smaller than the %lld protected tokens",
                  static_cast<long long>(n_total), static_cast<long long>(P));
      original<B>(scores.data(), T, rows, P, n_total - P, s, counts.data());
    } else {
      kvpress<B>(scores.data(), T, rows, n_total, s, counts.data(), ctx.exec);
    }
    return Status::ok();
  }

  /// The allocation of one sequence of T tokens over `rows` rows in the form
  /// `ops::adakv_keep` evaluates (ops/adakv_keep.hpp): the same counts as
  /// `allocate` followed by each row's top count. Preconditions: `validate()`
  /// and, for the original, per_row(T) >= the protected tokens.
  AdaKVKeepSpec keep_spec(std::int64_t T, std::int64_t rows) const noexcept {
    AdaKVKeepSpec s;
    const std::int64_t P = std::min(num_protected, T), n_total = per_row(T);
    if (n_total > T || (n_total == T && variant == AdaKVVariant::kKvpress)) {
      s.keep_all = true;
      return s;
    }
    if (variant == AdaKVVariant::kOriginal) {
      const std::int64_t B = n_total - P;
      s.original = true;
      s.normalize = normalize;
      s.row_k = normalize ? std::min<std::int64_t>(T, B + P) : 0;
      s.layer_k = std::min(rows * T, rows * (B + P));
      s.base = -P;
      s.protected_tokens = P;
      s.past_budget = B;
      s.floor_cap = static_cast<std::int64_t>(static_cast<double>(B) * alpha);
      s.keep_f = static_cast<float>(1.0 - alpha);
    } else {
      const std::int64_t n_safe = kvpress_safe(n_total);
      s.row_k = n_safe;
      s.layer_k = rows * (n_total - n_safe);
      s.base = n_safe;
    }
    return s;
  }

 private:
  struct Scratch {
    float* cand = nullptr;         // rows*T: normalised scores / kvpress candidates
    std::int32_t* map = nullptr;   // rows*T: flat index of each candidate
    std::int32_t* sel = nullptr;   // rows*T: selected positions
    std::int32_t* safe = nullptr;  // rows*T: kvpress safeguard, n_safe per row
    Workspace global{};
    detail::WorkerSlices rows_ws{};
  };

  template <class B>
  static WorkspacePlan plan(std::int64_t rows, std::int64_t T, const ExecContext& ctx) noexcept {
    const auto rt = static_cast<std::size_t>(std::max<std::int64_t>(rows, 1) * std::max<std::int64_t>(T, 1));
    WorkspacePlan p;  // same order as `carve`
    p.add<float>(rt).add<std::int32_t>(rt).add<std::int32_t>(rt).add<std::int32_t>(rt);
    p.add_bytes(B::topk_workspace(static_cast<std::int64_t>(rt)));
    p.add_bytes(detail::WorkerSlices::bytes(B::topk_workspace(std::max<std::int64_t>(T, 1)), ctx.workers()));
    return p;
  }
  template <class B>
  static Scratch carve(Workspace ws, std::int64_t rows, std::int64_t T, const ExecContext&) noexcept {
    const auto rt = static_cast<std::size_t>(std::max<std::int64_t>(rows, 1) * std::max<std::int64_t>(T, 1));
    WorkspaceCarver c(ws);
    Scratch s;
    s.cand = c.take<float>(rt);
    s.map = c.take<std::int32_t>(rt);
    s.sel = c.take<std::int32_t>(rt);
    s.safe = c.take<std::int32_t>(rt);
    const std::size_t g = B::topk_workspace(static_cast<std::int64_t>(rt));
    s.global = Workspace{c.take<std::byte>(g), g};
    s.rows_ws = detail::WorkerSlices::carve(c.rest(), B::topk_workspace(std::max<std::int64_t>(T, 1)));
    return s;
  }

  /// The original's normalisation: row r of S scaled by sum(top-kr) / sum(all)
  /// into cand, the protected (+inf) scores left out of both sums, in fp32 like
  /// the reference. `sel` holds kr ids, `ws` one row's top-k workspace.
  template <class Bk>
  static void normalize_rows(const float* S, std::int64_t T, std::int64_t rows, std::int64_t kr, float* cand, std::int32_t* sel,
                             Workspace ws) noexcept {
    for (std::int64_t r = 0; r < rows; ++r) {
      const float* row = S + r * T;
      Bk::topk(row, T, kr, sel, ws);
      double top = 0.0, all = 0.0;
      for (std::int64_t i = 0; i < kr; ++i)
        if (row[sel[i]] != INFINITY) top += row[sel[i]];
      for (std::int64_t j = 0; j < T; ++j)
        if (row[j] != INFINITY) all += row[j];
      const float den = static_cast<float>(all);
      const float f = (den != 0.0f && std::isfinite(den) && std::isfinite(static_cast<float>(top))) ? static_cast<float>(top) / den : 1.0f;
      for (std::int64_t j = 0; j < T; ++j) cand[r * T + j] = row[j] == INFINITY ? row[j] : row[j] * f;
    }
  }

  /// The original's caps from count[r] = row r's share of the layer-wide
  /// selection minus P (`defined`: no share fell below the protected tokens,
  /// over the whole layer); writes count[r] = cap[r] + P.
  void original_caps(std::int64_t T, std::int64_t rows, std::int64_t P, std::int64_t B, bool defined, std::int64_t* count) const noexcept {
    AdaKVKeepSpec s;  // the formula is ops/adakv_keep.hpp's, shared with the device op
    s.original = true;
    s.protected_tokens = P;
    s.past_budget = B;  // more +inf scores than the selection holds: uniform
    s.floor_cap = static_cast<std::int64_t>(static_cast<double>(B) * alpha);
    s.keep_f = static_cast<float>(1.0 - alpha);
    for (std::int64_t r = 0; r < rows; ++r) count[r] = adakv_final_count(s, count[r], defined, T);
  }

  /// kvpress's safeguard count for a budget of n_kept tokens per row.
  std::int64_t kvpress_safe(std::int64_t n_kept) const noexcept {
    auto n_safe = static_cast<std::int64_t>(static_cast<double>(n_kept) * alpha);
    if (budget.at_least_one && alpha > 0.0) n_safe = n_kept > 0 ? std::max<std::int64_t>(1, n_safe) : 0;
    return std::min(n_safe, n_kept);
  }

  /// kvpress: each row's best n_safe tokens into safe (ascending), then every
  /// other token into cand / map (value, flat index r*T + j) in flat order, so
  /// ties go to the higher flat index. Returns the number of candidates.
  template <class Bk>
  static std::int64_t kvpress_candidates(const float* S, std::int64_t T, std::int64_t rows, std::int64_t n_safe, std::int32_t* safe,
                                         float* cand, std::int32_t* map, const detail::WorkerSlices& rows_ws,
                                         const ExecContext& ctx) noexcept {
    ctx.parallel_for(rows, [&](std::int64_t r, int worker) { Bk::topk(S + r * T, T, n_safe, safe + r * n_safe, rows_ws.slice(worker)); });
    std::int64_t m = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int32_t* sf = safe + r * n_safe;
      std::int64_t q = 0;
      for (std::int64_t j = 0; j < T; ++j) {
        if (q < n_safe && sf[q] == j) {
          ++q;
          continue;
        }
        cand[m] = S[r * T + j];
        map[m++] = static_cast<std::int32_t>(r * T + j);
      }
    }
    return m;
  }

  /// The original allocation: count[r] = cap[r] + P, B past tokens per row on average.
  template <class Bk>
  void original(const float* S, std::int64_t T, std::int64_t rows, std::int64_t P, std::int64_t B, Scratch& s,
                std::int64_t* count) const noexcept {
    const float* ranked = S;
    const std::int64_t k = std::min(rows * T, rows * (B + P));
    if (normalize) {
      normalize_rows<Bk>(S, T, rows, std::min<std::int64_t>(T, B + P), s.cand, s.sel, s.global);
      ranked = s.cand;
    }
    // Layer-wide top rows*(B + P): every row's protected tokens first, then the rows' shares of the best rows*B.
    Bk::topk(ranked, rows * T, k, s.sel, s.global);
    for (std::int64_t r = 0; r < rows; ++r) count[r] = -P;
    for (std::int64_t i = 0; i < k; ++i) ++count[s.sel[i] / T];
    bool defined = true;
    for (std::int64_t r = 0; r < rows; ++r) defined = defined && count[r] >= 0;
    original_caps(T, rows, P, B, defined, count);
  }

  /// kvpress AdaKVPress: the safeguard per row, then the layer-wide best of the rest.
  template <class Bk>
  void kvpress(const float* S, std::int64_t T, std::int64_t rows, std::int64_t n_kept, Scratch& s, std::int64_t* count,
               const ExecContext& ctx) const noexcept {
    const std::int64_t n_safe = kvpress_safe(n_kept);
    const std::int64_t m = kvpress_candidates<Bk>(S, T, rows, n_safe, s.safe, s.cand, s.map, s.rows_ws, ctx);
    // The layer keeps rows*n_kept tokens: the safeguarded ones plus the best rows*(n_kept - n_safe) candidates.
    const std::int64_t extra = rows * (n_kept - n_safe);
    Bk::topk(s.cand, m, extra, s.sel, s.global);
    for (std::int64_t r = 0; r < rows; ++r) count[r] = n_safe;
    for (std::int64_t i = 0; i < extra; ++i) ++count[s.map[s.sel[i]] / T];
  }

 public:
  // ---- the sharded allocation (tensor parallelism, budget/sharded_cut.hpp) ----
  // Per sequence: `shard_candidates` (this rank's candidates of the layer-wide
  // selection over all ranks' rows), one `sharded_cut` for the whole batch,
  // `shard_counts`, then `shard_finish` with the layer-wide `defined` flag.
  // The formulas are the ones above; only the layer-wide top-k is replaced by
  // the cut, so the counts equal the single-process counts bit for bit.

  /// Per-sequence buffers of the sharded allocation (rows * T entries each).
  struct ShardBuffers {
    float* cand = nullptr;
    std::int32_t* map = nullptr;
    std::int32_t* safe = nullptr;
  };
  template <class Alloc>
  static ShardBuffers take_shard_buffers(Alloc& a, std::int64_t rows, std::int64_t T) noexcept {
    const auto rt = static_cast<std::size_t>(std::max<std::int64_t>(rows, 1) * std::max<std::int64_t>(T, 1));
    ShardBuffers b;
    b.cand = a.template take<float>(rt);
    b.map = a.template take<std::int32_t>(rt);
    b.safe = a.template take<std::int32_t>(rt);
    return b;
  }
  /// Scratch of `shard_candidates` shared by the sequences: one row's top-k per worker.
  template <class B>
  static std::size_t shard_row_workspace(std::int64_t T, const ExecContext& ctx) noexcept {
    return detail::WorkerSlices::bytes(B::topk_workspace(std::max<std::int64_t>(T, 1)), ctx.workers());
  }

  /// Phase 1 for one sequence of T tokens whose score map S has `rows` rows
  /// here and `global_rows` over all ranks: the candidates and the layer's k.
  /// Only for sequences that evict (per_row(T) < T, or == T for the original).
  template <class Bk>
  ShardedTopK shard_candidates(const float* S, std::int64_t T, std::int64_t rows, std::int64_t global_rows, ShardBuffers sb,
                               Workspace row_ws, const ExecContext& ctx) const noexcept {
    const std::int64_t P = std::min(num_protected, T), n_total = per_row(T);
    const detail::WorkerSlices slices = detail::WorkerSlices::carve(row_ws, Bk::topk_workspace(std::max<std::int64_t>(T, 1)));
    if (variant == AdaKVVariant::kOriginal) {
      const std::int64_t B = n_total - P;
      const float* ranked = S;
      if (normalize) {
        normalize_rows<Bk>(S, T, rows, std::min<std::int64_t>(T, B + P), sb.cand, sb.safe, slices.slice(0));
        ranked = sb.cand;
      }
      return ShardedTopK{ranked, rows * T, std::min(global_rows * T, global_rows * (B + P))};
    }
    const std::int64_t n_safe = kvpress_safe(n_total);
    const std::int64_t m = kvpress_candidates<Bk>(S, T, rows, n_safe, sb.safe, sb.cand, sb.map, slices, ctx);
    return ShardedTopK{sb.cand, m, global_rows * (n_total - n_safe)};
  }

  /// Phase 3: each row's share of the cut (the original: minus P). Returns
  /// false when some local share is below the protected tokens (the
  /// original's counts are then undefined; see `shard_finish`).
  bool shard_counts(const ShardedTopK& p, const ShardedCut& cut, std::int64_t T, std::int64_t rows, ShardBuffers sb,
                    std::int64_t* count) const noexcept {
    if (variant == AdaKVVariant::kOriginal) {
      const std::int64_t P = std::min(num_protected, T);
      for (std::int64_t r = 0; r < rows; ++r) count[r] = -P;
      for_each_selected(p, cut, [&](std::int64_t i) { ++count[i / T]; });
      bool defined = true;
      for (std::int64_t r = 0; r < rows; ++r) defined = defined && count[r] >= 0;
      return defined;
    }
    const std::int64_t n_safe = kvpress_safe(per_row(T));
    for (std::int64_t r = 0; r < rows; ++r) count[r] = n_safe;
    for_each_selected(p, cut, [&](std::int64_t i) { ++count[sb.map[i] / T]; });
    return true;
  }

  /// Phase 4: the counts the rows keep (`defined` over every rank's rows).
  void shard_finish(std::int64_t T, std::int64_t rows, bool defined, std::int64_t* count) const noexcept {
    if (variant != AdaKVVariant::kOriginal) return;
    const std::int64_t P = std::min(num_protected, T);
    original_caps(T, rows, P, per_row(T) - P, defined, count);
  }
};

static_assert(BudgetAllocator<AdaKVAllocation>);

KVP_NAMESPACE_END
