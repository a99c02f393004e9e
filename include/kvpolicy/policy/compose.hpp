// SPDX-License-Identifier: Apache-2.0
// Composition: a `Scorer` plus a `BudgetAllocator` is an `EvictionPolicy`.
//
//   Budgeted<SnapKV, UniformAllocation>   == SnapKV's own decision (any Budget)
//   Budgeted<SnapKV, LayerAllocation>     == PyramidKV (pyramidkv.hpp is built on it)
//   Budgeted<ExpectedAttention, ...>      any scorer with any allocation
//
// Per sequence: the scorer writes its (rows, kv_len) score map (protected
// tokens +inf), the allocator gives the count per row, and every row keeps
// its `count` best tokens (`ops::topk_rows`, the library's total
// order: higher score, then the more recent token), ascending. Batch split
// (`Budgeted::evict`): a scorer with the per-head hook (`RowScorer`: SnapKV,
// ExpectedAttention) runs (sequence, kv head) items over the pool, score and
// top-k of one row per item; other scorers run one item per sequence once
// the batch has at least as many sequences as workers, else sequence after
// sequence with the scorer parallel over heads. Because
// protected tokens score +inf they are kept first, and among themselves the
// most recent win: exactly what the policies do when a budget is smaller than
// their window.
//
// Allocators in this header (each models `BudgetAllocator`):
//   UniformAllocation  every row keeps Budget::resolve(kv_len, protected) tokens
//   LayerAllocation    a LayerSchedule's budget for one layer (PyramidKV, per-layer budgets)
//   AdaKVAllocation    Ada-KV's ragged per-row counts from the ranks of all
//                      heads' scores (budget/adakv_allocation.hpp); `AdaKV<Scorer>`
//                      (adakv.hpp) composes it with any scorer the same way,
//                      writing ragged rows.
#pragma once

#include <algorithm>
#include <atomic>
#include <concepts>
#include <cstdint>
#include <span>

#include "kvpolicy/ops/batched.hpp"
#include "kvpolicy/policy/budget.hpp"
#include "kvpolicy/policy/budget/schedule.hpp"
#include "kvpolicy/policy/policy.hpp"

KVP_NAMESPACE_BEGIN

namespace detail {
/// counts[h] = n for every row of `scores`.
inline Status fill_counts(const char* who, std::int64_t n, const TensorView<const float, 2>& scores,
                          std::span<std::int64_t> counts) noexcept {
  KVP_REQUIRE(static_cast<std::int64_t>(counts.size()) == scores.extent(0), "%s: %zu counts for %lld rows", who, counts.size(),
              static_cast<long long>(scores.extent(0)));
  std::fill(counts.begin(), counts.end(), n);
  return Status::ok();
}
}  // namespace detail

/// Every row keeps the same number of tokens: `budget` resolved for the
/// sequence, with `num_protected` tokens counted as the Budget states.
struct UniformAllocation {
  Budget budget = Budget::compression_ratio(0.5);
  std::int64_t num_protected = 0;  ///< set by `Budgeted` from the scorer's protected_tokens(kv_len)

  Status validate(const char* who) const noexcept { return budget.validate(who); }
  Status count(const char* who, std::int64_t kv_len, std::int64_t protected_tokens, std::int64_t* n) const noexcept {
    return budget.resolve(who, kv_len, std::min(protected_tokens, kv_len), n);
  }
  template <class B>
  Status allocate(const Context<B>&, std::int64_t kv_len, TensorView<const float, 2> scores,
                  std::span<std::int64_t> counts) const noexcept {
    std::int64_t n = 0;
    KVP_RETURN_IF_ERROR(count("uniform_allocation", kv_len, num_protected, &n));
    return detail::fill_counts("uniform_allocation", n, scores, counts);
  }
};

/// One layer of a `LayerSchedule` (PyramidKV's pyramid, or per-layer budgets):
/// every row of that layer keeps the layer's budget.
struct LayerAllocation {
  LayerSchedule schedule = LayerSchedule::pyramid_kvpress(0.5, 64, 32);
  std::int32_t layer = 0;
  std::int64_t num_protected = 0;  ///< set by `Budgeted` from the scorer's protected_tokens(kv_len)

  Status validate(const char* who) const noexcept {
    KVP_RETURN_IF_ERROR(schedule.validate(who));
    KVP_REQUIRE(layer >= 0 && layer < schedule.num_layers, "%s: layer %d out of range [0, num_layers=%d)", who, layer, schedule.num_layers);
    return Status::ok();
  }
  Status count(const char* who, std::int64_t kv_len, std::int64_t protected_tokens, std::int64_t* n) const noexcept {
    Budget b;
    KVP_RETURN_IF_ERROR(schedule.layer_budget(layer, kv_len, &b));
    return b.resolve(who, kv_len, std::min(protected_tokens, kv_len), n);
  }
  template <class B>
  Status allocate(const Context<B>&, std::int64_t kv_len, TensorView<const float, 2> scores,
                  std::span<std::int64_t> counts) const noexcept {
    std::int64_t n = 0;
    KVP_RETURN_IF_ERROR(count("layer_allocation", kv_len, num_protected, &n));
    return detail::fill_counts("layer_allocation", n, scores, counts);
  }
};

static_assert(BudgetAllocator<UniformAllocation> && BudgetAllocator<LayerAllocation>);

/// A scorer that can score one kv head of one already-validated sequence
/// alone: `score_row_workspace<B>(shape)` bytes of scratch and, for each of its
/// input types, `score_row<B>(in, shape, h, row, ws)` writing the row its
/// `score` would. Lets `Budgeted` split a batch over (sequence, kv head) items.
template <class S, class B>
concept RowScorer = requires(const S& s, const ProblemShape& shape) {
  { s.template score_row_workspace<B>(shape) } -> std::same_as<std::size_t>;
};

/// Scorer S + a uniform allocator A (one count per sequence, `A::count`): the
/// eviction policy "score, allocate, keep each row's best". S must offer
/// `validate(batch, shape*)` (every scorer of the library does), so nothing is
/// written before every sequence was checked. `who` names the composed policy
/// in messages. Allocators whose counts differ per row (Ada-KV) write ragged
/// KeepSets and are composed by `AdaKV<Scorer>` or `select_per_head`.
template <class S, class A>
class Budgeted {
 public:
  Budgeted(const S& scorer, const A& alloc) noexcept : scorer_(scorer), alloc_(alloc) {}
  const S& scorer() const noexcept { return scorer_; }
  const A& allocation() const noexcept { return alloc_; }

  Status validate(const char* who) const noexcept {
    KVP_RETURN_IF_ERROR(scorer_.validate_params());
    return alloc_.validate(who);
  }
  /// Tokens kept per row (-1 if invalid for kv_len).
  std::int64_t kept_count(const char* who, std::int64_t kv_len) const noexcept {
    std::int64_t n = 0;
    if (!validate(who).is_ok() || !alloc_.count(who, kv_len, scorer_.protected_tokens(kv_len), &n).is_ok()) return -1;
    return n;
  }

  /// Workspace of `evict` for inputs of type `In` (the batch split depends on
  /// the scorer): per-worker slices of one score row + the scorer's per-head
  /// scratch + top-k for a `RowScorer`; otherwise the larger of the serial
  /// layout (score map, the scorer's workspace, the batched top-k) and
  /// per-worker slices of (score map, the scorer's one-worker workspace, top-k).
  template <class B>
  Requirements requirements(const char* who, const Context<B>& ctx, const ProblemShape& shape) const noexcept {
    const Requirements sr = scorer_.requirements(ctx, shape);
    Status st = validate(who);
    if (st.is_ok()) st = sr.status;
    std::int64_t n = 0;
    if (st.is_ok()) st = alloc_.count(who, shape.max_kv_len, scorer_.protected_tokens(shape.max_kv_len), &n);
    return detail::uniform_requirements(st, st.is_ok() ? workspace_bytes<B>(ctx, shape) : 0, shape, shape.num_kv_heads, n, sr.query_window);
  }

  template <class B, class In>
  Status evict(const char* who, const Context<B>& cx, std::span<const In> batch, KeepSet out) const noexcept {
    KVP_RETURN_IF_ERROR(validate(who));
    ProblemShape shape;
    if constexpr (kDeviceBackend<B>) {
      static_assert(
          requires { scorer_.validate(batch, &shape, true); }, "this scorer has no device-aware validate (views in device memory)");
      KVP_RETURN_IF_ERROR(scorer_.validate(batch, &shape, true));
    } else {
      KVP_RETURN_IF_ERROR(scorer_.validate(batch, &shape));
    }
    for (std::size_t b = 0; b < batch.size(); ++b) {
      std::int64_t n = 0;
      const std::int64_t T = batch[b].keys.kv_len();
      KVP_RETURN_IF_ERROR(alloc_.count(who, T, scorer_.protected_tokens(T), &n));
    }
    const auto nb = static_cast<std::int64_t>(batch.size());
    const std::int64_t H = shape.num_kv_heads;
    const detail::BackendCall<B> call(cx);
    KVP_RETURN_IF_ERROR(call.begin());
    if constexpr (RowScorer<S, B>) {
      const std::size_t per = row_slot<B>(shape).bytes;
      KVP_RETURN_IF_ERROR(check_workspace(who, cx.workspace, detail::WorkerSlices::bytes(per, cx.exec.workers())));
      KVP_RETURN_IF_ERROR(write_indptr(who, batch, H, out));
      const auto slices = detail::WorkerSlices::carve(cx.workspace, per);
      const std::size_t scorer_bytes = scorer_.template score_row_workspace<B>(shape);
      cx.exec.parallel_for(nb * H, [&](std::int64_t row, int worker) {
        const In& in = batch[static_cast<std::size_t>(row / H)];
        const std::int64_t T = in.keys.kv_len(), k = out.row_size(row);
        std::int32_t* dst = out.indices + out.indptr[row];
        if (k >= T) {  // nothing to evict: no scoring
          B::iota(dst, 0, T);
          return;
        }
        WorkspaceCarver c(slices.slice(worker));
        float* s = c.take<float>(static_cast<std::size_t>(std::max<std::int64_t>(shape.max_kv_len, 1)));
        scorer_.template score_row<B>(in, shape, row % H, s, Workspace{c.take<std::byte>(scorer_bytes), scorer_bytes});
        B::topk(s, T, k, dst, c.rest());
      });
      return call.end();
    } else {
      const std::size_t scorer_bytes = scorer_.requirements(cx, shape).workspace_bytes;
      const std::size_t per = sequence_slot<B>(shape).bytes;
      const bool by_sequence = cx.exec.workers() > 1 && nb >= cx.exec.workers();
      KVP_RETURN_IF_ERROR(check_workspace(
          who, cx.workspace,
          by_sequence ? detail::WorkerSlices::bytes(per, cx.exec.workers()) : serial_plan<B>(shape, scorer_bytes, cx.exec).total()));
      KVP_RETURN_IF_ERROR(write_indptr(who, batch, H, out));
      if (by_sequence) return evict_by_sequence<B>(batch, shape, out, detail::WorkerSlices::carve(cx.workspace, per), cx.exec);
      WorkspaceCarver c(cx.workspace);
      float* scores = c.take<float>(static_cast<std::size_t>(H * std::max<std::int64_t>(shape.max_kv_len, 1)));
      const Context<B> scorer_cx = cx.with_workspace(Workspace{c.take<std::byte>(scorer_bytes), scorer_bytes});
      const Workspace topk_ws = c.rest();
      for (std::size_t b = 0; b < batch.size(); ++b) {
        const In& in = batch[b];
        const std::int64_t T = in.keys.kv_len(), row0 = static_cast<std::int64_t>(b) * H;
        if (out.row_size(row0) >= T) {  // nothing to evict: no scoring
          fill_all<B>(T, H, row0, out);
          continue;
        }
        const ScoreMap map = TensorView<float, 2>::contiguous(scores, {H, T});
        KVP_RETURN_IF_ERROR(scorer_.score(scorer_cx, in, map));
        ops::topk_rows<B>(scores, T, H, T, out, row0, topk_ws, cx.exec);
      }
      return call.end();
    }
  }

 private:
  template <class In>
  Status write_indptr(const char* who, std::span<const In> batch, std::int64_t H, KeepSet& out) const noexcept {
    return detail::write_uniform_indptr(who, out, static_cast<std::int64_t>(batch.size()), H,
                                        [&](std::int64_t b) { return kept_count(who, batch[b].keys.kv_len()); });
  }

  template <class B>
  static void fill_all(std::int64_t T, std::int64_t H, std::int64_t row0, KeepSet& out) noexcept {
    for (std::int64_t h = 0; h < H; ++h) B::iota(out.indices + out.indptr[row0 + h], 0, T);
  }

  /// One item per sequence (scorers without the per-head hook): worker `w`
  /// scores its sequence on the calling thread into its own map, then top-k.
  template <class B, class In>
  Status evict_by_sequence(std::span<const In> batch, const ProblemShape& shape, KeepSet& out, const detail::WorkerSlices& slices,
                           const ExecContext& exec) const noexcept {
    const std::int64_t H = shape.num_kv_heads, Tmax = std::max<std::int64_t>(shape.max_kv_len, 1);
    const std::size_t scorer_bytes = scorer_.requirements(Context<B>{}, shape).workspace_bytes;
    std::atomic<bool> failed{false};
    Status first_error;
    exec.parallel_for(static_cast<std::int64_t>(batch.size()), [&](std::int64_t b, int worker) {
      const In& in = batch[static_cast<std::size_t>(b)];
      const std::int64_t T = in.keys.kv_len(), row0 = b * H;
      if (out.row_size(row0) >= T) {
        fill_all<B>(T, H, row0, out);
        return;
      }
      WorkspaceCarver c(slices.slice(worker));
      float* scores = c.take<float>(static_cast<std::size_t>(H * Tmax));
      const Context<B> seq_cx{Workspace{c.take<std::byte>(scorer_bytes), scorer_bytes}, ExecContext{}};
      const Workspace topk_ws = c.rest();
      if (Status s = scorer_.score(seq_cx, in, TensorView<float, 2>::contiguous(scores, {H, T})); !s.is_ok()) {
        if (!failed.exchange(true)) first_error = s;
        return;
      }
      ops::topk_rows<B>(scores, T, H, T, out, row0, topk_ws, ExecContext{});
    });
    return failed.load() ? first_error : Status::ok();
  }

  template <class B>
  std::size_t workspace_bytes(const Context<B>& ctx, const ProblemShape& shape) const noexcept {
    const int W = ctx.exec.workers();
    if constexpr (RowScorer<S, B>) {
      return detail::WorkerSlices::bytes(row_slot<B>(shape).bytes, W);
    } else {
      const std::size_t serial = serial_plan<B>(shape, scorer_.requirements(ctx, shape).workspace_bytes, ctx.exec).total();
      return W > 1 ? std::max(serial, detail::WorkerSlices::bytes(sequence_slot<B>(shape).bytes, W)) : serial;
    }
  }

  /// Per worker, (sequence, kv head) items: one score row, the scorer's per-head scratch, top-k.
  template <class B>
  WorkspacePlan row_slot(const ProblemShape& shape) const noexcept {
    const std::int64_t T = std::max<std::int64_t>(shape.max_kv_len, 1);
    WorkspacePlan p;
    p.add<float>(static_cast<std::size_t>(T));
    p.add_bytes(scorer_.template score_row_workspace<B>(shape));
    p.add_bytes(B::topk_workspace(T));
    return p;
  }

  /// Per worker, sequence items: the sequence's score map, the scorer's one-worker workspace, top-k.
  template <class B>
  WorkspacePlan sequence_slot(const ProblemShape& shape) const noexcept {
    const std::int64_t T = std::max<std::int64_t>(shape.max_kv_len, 1), H = std::max<std::int64_t>(shape.num_kv_heads, 1);
    WorkspacePlan p;
    p.add<float>(static_cast<std::size_t>(H * T));
    p.add_bytes(scorer_.requirements(Context<B>{}, shape).workspace_bytes);
    p.add_bytes(ops::topk_rows_workspace<B>(T, ExecContext{}));
    return p;
  }

  /// Sequence after sequence: one score map, the scorer's workspace (parallel over heads), the batched top-k.
  template <class B>
  WorkspacePlan serial_plan(const ProblemShape& shape, std::size_t scorer_bytes, const ExecContext& ctx) const noexcept {
    const std::int64_t T = std::max<std::int64_t>(shape.max_kv_len, 1), H = std::max<std::int64_t>(shape.num_kv_heads, 1);
    WorkspacePlan p;
    p.add<float>(static_cast<std::size_t>(H * T));
    p.add_bytes(scorer_bytes);
    p.add_bytes(ops::topk_rows_workspace<B>(T, ctx));
    return p;
  }

  S scorer_;
  A alloc_;
};

KVP_NAMESPACE_END
