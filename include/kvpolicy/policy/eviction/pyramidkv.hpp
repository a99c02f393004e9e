// SPDX-License-Identifier: Apache-2.0
// PyramidKV — "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
// Information Funneling" (Cai et al., 2024, arXiv 2406.02069).
//
// SnapKV scoring with a layer-dependent budget: lower layers keep more tokens,
// upper layers fewer (budget/pyramid.hpp has the formulas). Per sequence:
//   1. n = the layer's budget for kv_len T (window included) from the schedule;
//   2. scores = SnapKV::score (pooled window attention, window tokens = +inf);
//   3. every kv head keeps its n best tokens (the window first), ascending.
//
// Presets (reference §4):
//  * `PyramidKVParams::kvpress(r, layer, NL)` — kvpress PyramidKVPress: SnapKVPress
//    scoring (w=64, avg pool K=5, window mean, pool then group mean) and
//    `pyramid_budget_kvpress` (float formula, uniform fallback round(T(1-r))).
//  * `PyramidKVParams::original(C, layer, NL)` — KVCache-Factory PyramidKVCluster
//    as run by its `run_longbench.py` (w=8, max pool K=7, window sum) at kv-head
//    granularity (its `kv_head` mode: group mean before pooling), with the
//    Factory schedule: T < C untouched, uniform C for T < 2(C-w), else the
//    integer pyramid. The Factory's default query-head granularity stores a
//    cache per query head; call with num_q_heads == num_kv_heads on repeated
//    keys for that.
// Any `LayerSchedule` works (e.g. the Ada-KV flavour or a per-layer list), and
// the scoring is any `SnapKVParams`; the schedule's window must equal the
// scoring window. As in SnapKV, a budget below the window keeps the most
// recent tokens (kvpress keeps an arbitrary subset of its tied window), and
// ties go to the higher token index.
//
// One policy object per layer (`params.layer`, or `at_layer(l)`): policies are
// immutable and hold only their parameters.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>

#include "kvpolicy/policy/budget.hpp"
#include "kvpolicy/policy/budget/allocation.hpp"
#include "kvpolicy/policy/budget/schedule.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "kvpolicy/policy/policy.hpp"

KVP_NAMESPACE_BEGIN

struct PyramidKVParams {
  SnapKVParams scoring = SnapKVParams::kvpress(0.0, 64, 5);  ///< scoring only; its `budget` is ignored
  LayerSchedule schedule = LayerSchedule::pyramid_kvpress(0.5, 64, 32);
  std::int32_t layer = 0;                                     ///< this layer's index in [0, schedule.num_layers)

  /// kvpress `PyramidKVPress(compression_ratio=r, window_size, kernel_size, beta)` at `layer`.
  static constexpr PyramidKVParams kvpress(double r, std::int32_t layer, std::int32_t num_layers, std::int32_t window = 64,
                                           std::int32_t kernel = 5, std::int32_t beta = 20) noexcept {
    return PyramidKVParams{SnapKVParams::kvpress(0.0, window, kernel), LayerSchedule::pyramid_kvpress(r, window, num_layers, beta), layer};
  }
  /// KVCache-Factory `PyramidKVCluster(max_capacity_prompt=C, window_size, kernel_size, pooling, beta)`, kv_head mode.
  static constexpr PyramidKVParams original(std::int64_t capacity, std::int32_t layer, std::int32_t num_layers, std::int32_t window = 8,
                                            std::int32_t kernel = 7, Pooling pooling = Pooling::kMax, std::int32_t beta = 20) noexcept {
    SnapKVParams s = SnapKVParams::original(capacity, window, kernel, pooling);
    s.budget = Budget::compression_ratio(0.0);
    return PyramidKVParams{s, LayerSchedule::pyramid_factory(capacity, window, num_layers, beta), layer};
  }
  constexpr PyramidKVParams at_layer(std::int32_t l) const noexcept {
    PyramidKVParams p = *this;
    p.layer = l;
    return p;
  }
};

class PyramidKV {
 public:
  using Params = PyramidKVParams;
  static constexpr const char* kName = "pyramidkv";

  constexpr PyramidKV() noexcept = default;
  explicit constexpr PyramidKV(const Params& p) noexcept : params_(p), snap_(scoring_params(p)) {}
  constexpr const Params& params() const noexcept { return params_; }

  Status validate_params() const noexcept {
    KVP_RETURN_IF_ERROR(snap_.validate_params());
    KVP_RETURN_IF_ERROR(params_.schedule.validate(kName));
    KVP_REQUIRE(params_.layer >= 0 && params_.layer < params_.schedule.num_layers, "pyramidkv: layer %d out of range [0, num_layers=%d)",
                params_.layer, params_.schedule.num_layers);
    KVP_REQUIRE(!params_.schedule.is_pyramid() || params_.schedule.window == params_.scoring.window,
                "pyramidkv: schedule window %d differs from the scoring window %d", params_.schedule.window, params_.scoring.window);
    return Status::ok();
  }

  /// This layer's budget for a sequence of kv_len tokens.
  Status layer_budget(std::int64_t kv_len, Budget* out, PyramidRegime* regime = nullptr) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    return params_.schedule.layer_budget(params_.layer, kv_len, out, regime);
  }

  /// Tokens kept per kv head (-1 if the budget is invalid for kv_len).
  std::int64_t kept_count(std::int64_t kv_len) const noexcept {
    Budget b;
    std::int64_t n = 0;
    if (!layer_budget(kv_len, &b).is_ok()) return -1;
    if (!b.resolve(kName, kv_len, std::min<std::int64_t>(params_.scoring.window, kv_len), &n).is_ok()) return -1;
    return n;
  }

  template <class Backend, class Tk = float>
  std::size_t workspace_bytes(const PrefillShape& shape, const ExecContext& ctx = {}) const noexcept {
    return plan<Backend>(shape, ctx).total();
  }

  /// SnapKV's scores (PyramidKV only changes the budget): (num_kv_heads, kv_len), window = +inf.
  template <class Backend, class Tq, class Tk>
  Status score(const PrefillInput<Tq, Tk>& in, TensorView<float, 2> out, Workspace ws, const ExecContext& ctx = {}) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    return snap_.score<Backend>(in, out, ws, ctx);
  }

  template <class Tq, class Tk>
  Status validate(std::span<const PrefillInput<Tq, Tk>> batch, PrefillShape* shape) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    return snap_.validate(batch, shape);
  }

  template <class Backend, class Tq, class Tk>
  Status select(std::span<const PrefillInput<Tq, Tk>> batch, KeepSet out, Workspace ws, const ExecContext& ctx = {}) const noexcept {
    PrefillShape shape;
    KVP_RETURN_IF_ERROR(validate(batch, &shape));
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const std::int64_t T = batch[b].keys.kv_len();
      Budget lb;
      std::int64_t n = 0;
      KVP_RETURN_IF_ERROR(layer_budget(T, &lb));
      KVP_RETURN_IF_ERROR(lb.resolve(kName, T, std::min<std::int64_t>(params_.scoring.window, T), &n));
    }
    KVP_RETURN_IF_ERROR(check_workspace(kName, ws, plan<Backend>(shape, ctx).total()));
    const std::int64_t H = shape.num_kv_heads;
    KVP_RETURN_IF_ERROR(detail::write_uniform_indptr(kName, out, static_cast<std::int64_t>(batch.size()), H,
                                                     [&](std::int64_t b) { return kept_count(batch[b].keys.kv_len()); }));
    WorkspaceCarver c(ws);
    float* scores = c.take<float>(static_cast<std::size_t>(H * std::max<std::int64_t>(shape.max_kv_len, 1)));
    const std::size_t snap_bytes = snap_.workspace_bytes<Backend>(shape, ctx);
    const Workspace snap_ws{c.take<std::byte>(snap_bytes), snap_bytes};
    const auto slices = detail::WorkerSlices::carve(c.rest(), Backend::topk_workspace(std::max<std::int64_t>(shape.max_kv_len, 1)));
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const auto& in = batch[b];
      const std::int64_t T = in.keys.kv_len(), row0 = static_cast<std::int64_t>(b) * H;
      if (out.indptr[row0 + 1] - out.indptr[row0] >= T) {  // not compressed: no scoring
        for (std::int64_t h = 0; h < H; ++h)
          for (std::int64_t j = 0; j < T; ++j) out.indices[out.indptr[row0 + h] + j] = static_cast<std::int32_t>(j);
        continue;
      }
      KVP_RETURN_IF_ERROR(snap_.score<Backend>(in, TensorView<float, 2>::contiguous(scores, {H, T}), snap_ws, ctx));
      detail::topk_rows<Backend>(scores, T, H, T, out, row0, slices, ctx);
    }
    return Status::ok();
  }

  template <class Backend, class Tq, class Tk>
  Status select(const PrefillInput<Tq, Tk>& in, KeepSet out, Workspace ws, const ExecContext& ctx = {}) const noexcept {
    return select<Backend>(std::span<const PrefillInput<Tq, Tk>>(&in, 1), out, ws, ctx);
  }

 private:
  static constexpr SnapKVParams scoring_params(const Params& p) noexcept {
    SnapKVParams s = p.scoring;
    s.budget = Budget::compression_ratio(0.0);  // scoring only: never rejects a length
    return s;
  }

  template <class Backend>
  WorkspacePlan plan(const PrefillShape& shape, const ExecContext& ctx) const noexcept {
    const std::int64_t T = std::max<std::int64_t>(shape.max_kv_len, 1);
    WorkspacePlan p;
    p.add<float>(static_cast<std::size_t>(std::max<std::int64_t>(shape.num_kv_heads, 1) * T));
    p.add_bytes(snap_.workspace_bytes<Backend>(shape, ctx));
    p.add_bytes(detail::WorkerSlices::bytes(Backend::topk_workspace(T), ctx.workers()));
    return p;
  }

  Params params_{};
  SnapKV snap_{};
};

/// Scorer hook (PyramidKV scores are SnapKV's): the window is protected.
inline std::int64_t protected_tokens(const PyramidKV& p, std::int64_t kv_len) noexcept {
  return std::min<std::int64_t>(p.params().scoring.window, kv_len);
}

KVP_NAMESPACE_END
