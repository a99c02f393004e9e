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
// A batch is decided by `Budgeted<SnapKV, LayerAllocation>`: (sequence, kv
// head) items over the pool, each scoring and choosing one row (compose.hpp).
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
#include "kvpolicy/policy/compose.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "kvpolicy/policy/policy.hpp"

KVP_NAMESPACE_BEGIN

struct PyramidKVParams {
  SnapKVParams scoring = SnapKVParams::kvpress(0.0, 64, 5);  ///< scoring only; its `budget` is ignored
  LayerSchedule schedule = LayerSchedule::pyramid_kvpress(0.5, 64, 32);
  std::int32_t layer = 0;  ///< this layer's index in [0, schedule.num_layers)

  /// The window is one parameter: the scorer's and the schedule's must agree.
  static constexpr auto fields() noexcept {
    using P = PyramidKVParams;
    return std::tuple{
        ParamField<P, Budget>{"budget", "the schedule's budget: compression_ratio=r | tokens=n | keep_ratio=f",
                              [](const P& p) { return p.schedule.budget; }, [](P& p, const Budget& b) { p.schedule.budget = b; }},
        ParamField<P, std::int32_t>{"window", "observation window (scorer and schedule)", [](const P& p) { return p.scoring.window; },
                                    [](P& p, const std::int32_t& w) {
                                      p.scoring.window = w;
                                      if (p.schedule.is_pyramid()) p.schedule.window = w;
                                    }},
        ParamField<P, std::int32_t>{"kernel", "pooling kernel (odd)", [](const P& p) { return p.scoring.kernel; },
                                    [](P& p, const std::int32_t& k) { p.scoring.kernel = k; }},
        ParamField<P, Pooling>{"pooling", "pooling along tokens", [](const P& p) { return p.scoring.pooling; },
                               [](P& p, const Pooling& k) { p.scoring.pooling = k; }},
        ParamField<P, std::int32_t>{"beta", "pyramid steepness", [](const P& p) { return p.schedule.beta; },
                                    [](P& p, const std::int32_t& b) { p.schedule.beta = b; }},
        ParamField<P, std::int32_t>{"num_layers", "layers of the model", [](const P& p) { return p.schedule.num_layers; },
                                    [](P& p, const std::int32_t& n) { p.schedule.num_layers = n; }},
        param_field<&P::layer>("layer", "this layer's index")};
  }

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
    KVP_RETURN_IF_ERROR(check_enum_fields(kName, params_));
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

  /// Tokens scored +inf by rule: SnapKV's window.
  std::int64_t protected_tokens(std::int64_t kv_len) const noexcept { return std::min<std::int64_t>(params_.scoring.window, kv_len); }

  /// The size query: workspace for `score` / `evict`, KeepSet rows (batch x
  /// num_kv_heads) of this layer's budget, SnapKV's window.
  template <class Backend>
  Requirements requirements(const Context<Backend>& ctx, const ProblemShape& shape) const noexcept {
    const Status st = validate_params();
    if (!st.is_ok()) return Requirements{st};
    return composed().requirements(kName, ctx, shape);
  }

  /// SnapKV's scores (PyramidKV only changes the budget): (num_kv_heads, kv_len), window = +inf.
  template <class Backend, class Tq, class Tk>
  Status score(const Context<Backend>& cx, const ScoreInput<Tq, Tk>& in, ScoreMap out) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    return snap_.score(cx, in, out);
  }

  template <class Tq, class Tk>
  Status validate(std::span<const ScoreInput<Tq, Tk>> batch, ProblemShape* shape) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    return snap_.validate(batch, shape);
  }

  /// Eviction decision for a batch: rows `b * num_kv_heads + h`, SnapKV's
  /// scores, this layer's budget: `Budgeted<SnapKV, LayerAllocation>`.
  template <class Backend, class Tq, class Tk>
  Status evict(const Context<Backend>& cx, std::span<const ScoreInput<Tq, Tk>> batch, KeepSet out) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    return composed().evict(kName, cx, batch, out);
  }

  template <class Backend, class Tq, class Tk>
  Status evict(const Context<Backend>& cx, const ScoreInput<Tq, Tk>& in, KeepSet out) const noexcept {
    return evict(cx, std::span<const ScoreInput<Tq, Tk>>(&in, 1), out);
  }

 private:
  static constexpr SnapKVParams scoring_params(const Params& p) noexcept {
    SnapKVParams s = p.scoring;
    s.budget = Budget::compression_ratio(0.0);  // scoring only: never rejects a length
    return s;
  }

  Budgeted<SnapKV, LayerAllocation> composed() const noexcept {
    return Budgeted<SnapKV, LayerAllocation>(snap_, LayerAllocation{params_.schedule, params_.layer, 0});
  }

  Params params_{};
  SnapKV snap_{};
};

static_assert(Scorer<PyramidKV, ScoreInput<float, float>> && EvictionPolicy<PyramidKV, ScoreInput<float, half>>);

KVP_NAMESPACE_END
