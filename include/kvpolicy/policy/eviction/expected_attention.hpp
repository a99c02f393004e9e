// SPDX-License-Identifier: Apache-2.0
// Expected Attention — "Expected Attention: KV Cache Compression by Estimating
// Attention from Future Queries Distribution" (Devoto et al., 2025, arXiv
// 2510.00636); kvpress `ExpectedAttentionPress` (reference §9).
//
// Future queries are modelled as Gaussian: mean mu and covariance Sigma of the
// prompt's pre-RoPE queries (the first n_sink excluded), rotated by the RoPE
// matrix averaged over the next n_future positions. The expected
// log-attention of key k is then
//     z = <mu', k> / sqrt(d) + k^T Sigma' k / (2 d),   mu' = Rbar mu, Sigma' = Rbar Sigma Rbar^T,
// and per kv head g (group of query heads q):
//     s[g, j] = mean_q softmax_j(z[q, j]) over the non-sink keys j >= n_sink,
//     s[g, j] = (s[g, j] + epsilon) * ||v[g, j]||   (use_vnorm),
//     s[g, j] = +inf for the n_sink sink tokens (always kept).
// `evict` keeps, per kv head, the best n tokens (budget; kvpress:
// int(T (1-r)) including the sinks), ascending.
//
// Reproducing kvpress (where the details decide the numbers):
//  * Population covariance (divide by N = q_len - n_sink), two passes (the
//    queries are centred on their mean), like `einsum(c, c) / N`.
//  * Rbar = mean over p = P0 .. P0+n_future-1 of cos_p I + sin_p P, where
//    P = [[0, -I], [I, 0]] (rotate_half) and cos_p / sin_p are built column-wise
//    as kvpress does. Angles are HF's: fl32(inv_freq * fl32(p)), cos/sin in fp32,
//    times `attention_scaling`; P0 = kv_len (kvpress: the prompt length) unless
//    `next_position` says otherwise. inv_freq defaults to HF's fp32
//    1 / base^(2i/d); pass the model's exact `inv_freq` for scaled RoPE (YaRN,
//    Llama-3, ...) or when bit-exact agreement with a torch run matters.
//    `rope.fp64_angles` computes angle, cos and sin in double and rounds them
//    to fp32 (a rotary table built in float64, e.g. the fixtures' stub): at
//    positions ~4K the two recipes differ by ~1e-4 in cos/sin, which moved the
//    fixtures' scores by up to 1.5e-5 relative, so pick the one the reference
//    used (with the matching recipe they agree to 2e-6).
//  * Softmax over the N non-sink keys, then the group mean, then the value norm.
//  * Sinks: kvpress pads with the global max + 1; here +inf (only the order
//    within a head matters, and Ada-KV treats +inf as protected).
//  * Precision: kvpress runs in the model dtype throughout. Here statistics
//    and the rotation accumulate in double, dot products and the softmax in
//    fp32 (sums in double): on fp32 data the scores agree to a few 1e-6 relative.
//    The fp32 sums (the covariance products, <mu', k>, k^T Sigma' k) add each
//    term by a fused multiply-add in index order (std::fma in the reference,
//    the FMA instruction on the CPU, __fmaf_rn on a GPU), as a BLAS kernel such
//    as torch's does; every backend gives the same bits. (Rounding each product
//    first held the CPU to half its FMA rate: 101 -> 76 ms for bench_scoring's
//    32-head 4K case.)
//  * Precomputed statistics (kvpress `ExpectedAttentionStatsPress`): pass
//    `query_mean` (+ `query_cov`) instead of `queries`; they are pre-RoPE, and
//    the averaged rotation is applied as above.
//  * Lookahead queries (`ScoreInput::lookahead`, policy/lookahead.hpp): the
//    last `lookahead` rows (pre-RoPE pseudo or predicted queries) are further
//    samples of the query distribution: mean and covariance run over every
//    row after the sinks, prompt and lookahead alike. The future positions the
//    statistics are rotated to stay those after kv_len.
//  * kv_len <= n_sink is rejected (kvpress asserts); so is q_len <= n_sink
//    (no query left for the statistics; torch would produce NaN). Ties in the
//    selection go to the higher token index; if the budget is below n_sink the
//    latest sinks win (kvpress keeps an arbitrary subset of its tied sinks).
//
// Cost: O(Hq * (q_len + kv_len) * d^2) for the covariance and the quadratic
// form (O(Hq * kv_len * d) without covariance); work is split over kv heads.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>

#include "kvpolicy/core/gqa.hpp"
#include "kvpolicy/core/rows.hpp"
#include "kvpolicy/ops/expected_steps.hpp"
#include "kvpolicy/policy/budget.hpp"
#include "kvpolicy/policy/budget/allocation.hpp"
#include "kvpolicy/policy/policy.hpp"

KVP_NAMESPACE_BEGIN

/// The model's rotary embedding, as Hugging Face computes it (half-split, `rotate_half`).
struct RopeParams {
  double base = 10000.0;            ///< used when `inv_freq` is null: inv_freq_i = 1 / base^(2i/d) in fp32
  const float* inv_freq = nullptr;  ///< (head_dim / 2) the model's frequencies (rope scaling included); caller-owned
  float attention_scaling = 1.0f;   ///< HF `rotary_emb.attention_scaling` (scales cos and sin)
  bool fp64_angles = false;         ///< false: HF's fp32 angles and cos/sin; true: a float64 rotary table rounded to fp32
};

struct ExpectedAttentionParams {
  std::int32_t n_future_positions = 512;
  std::int32_t n_sink = 4;
  bool use_covariance = true;
  bool use_vnorm = true;
  float epsilon = 0.0f;
  RopeParams rope{};
  Budget budget = Budget::compression_ratio(0.5);

  static constexpr auto fields() noexcept {
    using P = ExpectedAttentionParams;
    return std::tuple{param_field<&P::n_future_positions>("n_future_positions", "future positions the RoPE is averaged over"),
                      param_field<&P::n_sink>("n_sink", "sink tokens always kept (and left out of the statistics)"),
                      param_field<&P::use_covariance>("use_covariance", "include the query covariance term"),
                      param_field<&P::use_vnorm>("use_vnorm", "scale by the value norm"),
                      param_field<&P::epsilon>("epsilon", "added before the value-norm scaling"),
                      ParamField<P, double>{"rope_base", "RoPE base (without the model's inv_freq)", [](const P& p) { return p.rope.base; },
                                            [](P& p, const double& b) { p.rope.base = b; }},
                      budget_field<&P::budget>()};
  }

  /// kvpress `ExpectedAttentionPress(compression_ratio=r, n_future_positions, n_sink, use_covariance, use_vnorm, epsilon)`.
  static constexpr ExpectedAttentionParams kvpress(double r, std::int32_t n_future_positions = 512, std::int32_t n_sink = 4,
                                                   bool use_covariance = true, bool use_vnorm = true, float epsilon = 0.0f) noexcept {
    return ExpectedAttentionParams{n_future_positions,          n_sink, use_covariance, use_vnorm, epsilon, RopeParams{},
                                   Budget::compression_ratio(r)};
  }
};

/// One sequence at the end of prefill: the common `ScoreInput` plus the query
/// statistics. Read from the base: `queries` (num_q_heads, q_len, head_dim),
/// here the *pre-RoPE* prompt queries (empty: use the statistics below),
/// `keys` (num_kv_heads, kv_len, head_dim) post-RoPE and `values` (same
/// shape; a paged source must be `KVSource::from_paged_values`).
template <class Tq, class Tk>
struct ExpectedAttentionInput : ScoreInput<Tq, Tk> {
  TensorView<const float, 2> query_mean{};  ///< (num_q_heads, head_dim) precomputed pre-RoPE query mean
  TensorView<const float, 3> query_cov{};   ///< (num_q_heads, head_dim, head_dim) precomputed covariance (use_covariance)
  std::int64_t next_position = -1;          ///< position of the first future token; -1: kv_len
};

class ExpectedAttention {
 public:
  using Params = ExpectedAttentionParams;
  static constexpr const char* kName = "expected_attention";

  constexpr ExpectedAttention() noexcept = default;
  explicit constexpr ExpectedAttention(const Params& p) noexcept : params_(p) {}
  constexpr const Params& params() const noexcept { return params_; }

  Status validate_params() const noexcept {
    KVP_RETURN_IF_ERROR(check_enum_fields(kName, params_));
    KVP_REQUIRE(params_.n_future_positions >= 1 && params_.n_future_positions < (1 << 24),
                "expected_attention: n_future_positions is %d, must be in [1, 2^24) (angles are exact fp32 positions)",
                params_.n_future_positions);
    KVP_REQUIRE(params_.n_sink >= 0, "expected_attention: n_sink is %d, must be >= 0", params_.n_sink);
    KVP_REQUIRE(std::isfinite(params_.epsilon), "expected_attention: epsilon is not finite");
    KVP_REQUIRE(std::isfinite(params_.rope.attention_scaling), "expected_attention: rope attention_scaling is not finite");
    KVP_REQUIRE(params_.rope.inv_freq != nullptr || (params_.rope.base > 0.0 && std::isfinite(params_.rope.base)),
                "expected_attention: rope base is %g, must be finite and > 0", params_.rope.base);
    return params_.budget.validate(kName);
  }

  std::int64_t kept_count(std::int64_t kv_len) const noexcept {
    std::int64_t n = 0;
    if (!validate_params().is_ok() || !params_.budget.resolve(kName, kv_len, std::min<std::int64_t>(params_.n_sink, kv_len), &n).is_ok())
      return -1;
    return n;
  }

  /// Tokens scored +inf by rule: the sinks.
  std::int64_t protected_tokens(std::int64_t kv_len) const noexcept { return std::min<std::int64_t>(params_.n_sink, kv_len); }

  /// The size query: workspace for `score` / `evict`, KeepSet rows (batch x
  /// num_kv_heads); the query window is the whole prompt (q_len; 0 with statistics).
  template <class Backend>
  Requirements requirements(const Context<Backend>& ctx, const ProblemShape& shape) const noexcept {
    return detail::budget_requirements(
        kName, validate_params(), shape, params_.budget, [this](std::int64_t n) { return protected_tokens(n); },
        detail::WorkerSlices::bytes(per_worker_bytes<Backend>(shape), ctx.exec.workers()), shape.num_kv_heads, shape.q_len);
  }

  /// Input checks of `score` / `evict` and the batch's shape (q_len = queries' rows, 0 with statistics).
  template <class Tq, class Tk>
  Status validate(std::span<const ExpectedAttentionInput<Tq, Tk>> batch, ProblemShape* shape, bool on_device = false) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_REQUIRE(!batch.empty(), "expected_attention: batch is empty");
    for (std::size_t b = 0; b < batch.size(); ++b) {
      ProblemShape s;
      KVP_RETURN_IF_ERROR(validate_one(batch[b], b, &s, on_device));
      if (b == 0) {
        *shape = s;
      } else {
        KVP_REQUIRE(
            s.num_q_heads == shape->num_q_heads && s.num_kv_heads == shape->num_kv_heads && s.head_dim == shape->head_dim,
            "expected_attention: sequence %zu has (q heads, kv heads, head_dim) = (%lld, %lld, %lld), sequence 0 has (%lld, %lld, %lld)", b,
            static_cast<long long>(s.num_q_heads), static_cast<long long>(s.num_kv_heads), static_cast<long long>(s.head_dim),
            static_cast<long long>(shape->num_q_heads), static_cast<long long>(shape->num_kv_heads),
            static_cast<long long>(shape->head_dim));
        shape->max_kv_len = std::max(shape->max_kv_len, s.max_kv_len);
        shape->q_len = std::max(shape->q_len, s.q_len);
      }
    }
    return Status::ok();
  }

  /// Per-kv-head scores of one sequence: out (num_kv_heads, kv_len), sinks = +inf.
  template <class Backend, class Tq, class Tk>
  Status score(const Context<Backend>& cx, const ExpectedAttentionInput<Tq, Tk>& in, ScoreMap out) const noexcept {
    const Workspace ws = cx.workspace;
    const ExecContext& ctx = cx.exec;
    ProblemShape shape;
    KVP_RETURN_IF_ERROR(validate(std::span<const ExpectedAttentionInput<Tq, Tk>>(&in, 1), &shape, kDeviceBackend<Backend>));
    KVP_RETURN_IF_ERROR(out.check_basic(kName, "scores"));
    KVP_REQUIRE(out.extent(0) == shape.num_kv_heads && out.extent(1) == shape.max_kv_len,
                "expected_attention: scores has shape (%lld, %lld), expected (num_kv_heads=%lld, kv_len=%lld)",
                static_cast<long long>(out.extent(0)), static_cast<long long>(out.extent(1)), static_cast<long long>(shape.num_kv_heads),
                static_cast<long long>(shape.max_kv_len));
    const std::size_t per = per_worker_bytes<Backend>(shape);
    KVP_RETURN_IF_ERROR(check_workspace(kName, ws, detail::WorkerSlices::bytes(per, ctx.workers())));
    const std::int64_t T = shape.max_kv_len;
    if constexpr (kDeviceBackend<Backend>) {
      const detail::BackendCall<Backend> call(cx);
      KVP_RETURN_IF_ERROR(call.begin());
      for (std::int64_t g = 0; g < shape.num_kv_heads; ++g) {
        WorkspaceCarver c(ws);  // reused per head: the stream orders the launches
        float* s = c.take<float>(static_cast<std::size_t>(T));
        score_head<Backend>(in, shape, g, s, c);
        Backend::copy_strided(s, T, out.data() + g * out.stride(0), out.stride(1));
      }
      return call.end();
    } else {
      const auto slices = detail::WorkerSlices::carve(ws, per);
      ctx.parallel_for(shape.num_kv_heads, [&](std::int64_t g, int worker) {
        WorkspaceCarver c(slices.slice(worker));
        float* s = c.take<float>(static_cast<std::size_t>(T));
        score_head<Backend>(in, shape, g, s, c);
        for (std::int64_t j = 0; j < T; ++j) out(g, j) = s[j];
      });
      return Status::ok();
    }
  }

  /// Eviction decision for a batch: keep row `b * num_kv_heads + h`. The
  /// batch is split into (sequence, kv head) items over `cx.exec`, each with
  /// its worker's workspace slice (ragged lengths, any number of kv heads);
  /// results do not depend on the worker count.
  template <class Backend, class Tq, class Tk>
  Status evict(const Context<Backend>& cx, std::span<const ExpectedAttentionInput<Tq, Tk>> batch, KeepSet out) const noexcept {
    const Workspace ws = cx.workspace;
    const ExecContext& ctx = cx.exec;
    ProblemShape shape;
    KVP_RETURN_IF_ERROR(validate(batch, &shape, kDeviceBackend<Backend>));
    const std::size_t per = per_worker_bytes<Backend>(shape);
    KVP_RETURN_IF_ERROR(check_workspace(kName, ws, detail::WorkerSlices::bytes(per, ctx.workers())));
    const std::int64_t H = shape.num_kv_heads;
    const detail::BackendCall<Backend> call(cx);
    KVP_RETURN_IF_ERROR(call.begin());
    KVP_RETURN_IF_ERROR(detail::write_uniform_indptr(kName, out, static_cast<std::int64_t>(batch.size()), H,
                                                     [&](std::int64_t b) { return kept_count(batch[b].keys.kv_len()); }));
    if constexpr (kDeviceBackend<Backend>) {
      // One (sequence, kv head) row at a time (a device context has one worker).
      for (std::int64_t row = 0; row < static_cast<std::int64_t>(batch.size()) * H; ++row) {
        const auto& in = batch[static_cast<std::size_t>(row / H)];
        const std::int64_t T = in.keys.kv_len();
        std::int32_t* dst = out.indices + out.indptr[row];
        const std::int64_t n_keep = out.indptr[row + 1] - out.indptr[row];
        if (n_keep >= T) {
          Backend::iota(dst, 0, T);
          continue;
        }
        WorkspaceCarver c(ws);
        float* s = c.take<float>(static_cast<std::size_t>(T));
        score_head<Backend>(in, shape, row % H, s, c);
        Backend::topk(s, T, n_keep, dst, c.rest());
      }
      return call.end();
    } else {
      const auto slices = detail::WorkerSlices::carve(ws, per);
      ctx.parallel_for(static_cast<std::int64_t>(batch.size()) * H, [&](std::int64_t row, int worker) {
        const auto& in = batch[static_cast<std::size_t>(row / H)];
        const std::int64_t T = in.keys.kv_len();
        std::int32_t* dst = out.indices + out.indptr[row];
        const std::int64_t n_keep = out.indptr[row + 1] - out.indptr[row];
        if (n_keep >= T) {
          for (std::int64_t j = 0; j < T; ++j) dst[j] = static_cast<std::int32_t>(j);
          return;
        }
        WorkspaceCarver c(slices.slice(worker));
        float* s = c.take<float>(static_cast<std::size_t>(T));
        score_head<Backend>(in, shape, row % H, s, c);
        Backend::topk(s, T, n_keep, dst, c.rest());
      });
      return Status::ok();
    }
  }

  /// Per-head scoring hook for composed policies (`Budgeted`, compose.hpp, splits
  /// a batch over (sequence, kv head) items through it): row[0..kv_len) = the
  /// scores `score` writes for kv head g, sinks +inf. Preconditions: `in` is
  /// part of a batch that passed `validate` with shape `shape`, `ws` holds
  /// `score_row_workspace<Backend>(shape)` bytes. No checks, no parallelism.
  template <class Backend>
  std::size_t score_row_workspace(const ProblemShape& shape) const noexcept {
    return per_worker_bytes<Backend>(shape);
  }
  template <class Backend, class Tq, class Tk>
  void score_row(const ExpectedAttentionInput<Tq, Tk>& in, const ProblemShape& shape, std::int64_t g, float* row,
                 Workspace ws) const noexcept {
    WorkspaceCarver c(ws);
    score_head<Backend>(in, shape, g, row, c);
  }

  template <class Backend, class Tq, class Tk>
  Status evict(const Context<Backend>& cx, const ExpectedAttentionInput<Tq, Tk>& in, KeepSet out) const noexcept {
    return evict(cx, std::span<const ExpectedAttentionInput<Tq, Tk>>(&in, 1), out);
  }

 private:
  template <class Tq, class Tk>
  Status validate_one(const ExpectedAttentionInput<Tq, Tk>& in, std::size_t b, ProblemShape* s, bool on_device) const noexcept {
    KVP_RETURN_IF_ERROR(in.keys.validate(kName, "keys", on_device));
    KVP_RETURN_IF_ERROR(in.values.validate(kName, "values", on_device));
    KVP_REQUIRE(in.keys.paged == nullptr || in.keys.role == KVRole::kKeys,
                "expected_attention: keys is a paged source reading values; build it with KVSource::from_paged");
    KVP_REQUIRE(in.values.paged == nullptr || in.values.role == KVRole::kValues,
                "expected_attention: values is a paged source reading keys; build it with KVSource::from_paged_values");
    KVP_RETURN_IF_ERROR(in.keys.validate_pool(kName, "keys", on_device));
    KVP_RETURN_IF_ERROR(in.values.validate_pool(kName, "values", on_device));
    const std::int64_t Hkv = in.keys.kv_heads(), T = in.keys.kv_len(), d = in.keys.head_dim();
    KVP_REQUIRE(in.values.kv_heads() == Hkv && in.values.kv_len() == T && in.values.head_dim() == d,
                "expected_attention: values has shape (%lld, %lld, %lld), keys has (%lld, %lld, %lld)",
                static_cast<long long>(in.values.kv_heads()), static_cast<long long>(in.values.kv_len()),
                static_cast<long long>(in.values.head_dim()), static_cast<long long>(Hkv), static_cast<long long>(T),
                static_cast<long long>(d));
    KVP_REQUIRE(d > 0 && d % 2 == 0, "expected_attention: head_dim is %lld, must be even and > 0 (RoPE pairs)", static_cast<long long>(d));
    if (on_device && d > ops::kExpectedMaxDeviceDim)
      return Status::error(StatusCode::kUnsupported, "expected_attention: head_dim %lld on a device backend, at most %lld",
                           static_cast<long long>(d), static_cast<long long>(ops::kExpectedMaxDeviceDim));
    if (params_.rope.inv_freq != nullptr)  // the caller's head_dim / 2 frequencies
      for (std::int64_t i = 0; i < d / 2; ++i)
        KVP_REQUIRE(std::isfinite(params_.rope.inv_freq[i]), "expected_attention: rope.inv_freq[%lld] is %g, must be finite",
                    static_cast<long long>(i), static_cast<double>(params_.rope.inv_freq[i]));
    KVP_REQUIRE(T <= INT32_MAX, "expected_attention: kv_len %lld exceeds the int32 token id range", static_cast<long long>(T));
    KVP_REQUIRE(T > params_.n_sink, "expected_attention: kv_len %lld must be larger than n_sink %d (sequence %zu)",
                static_cast<long long>(T), params_.n_sink, b);
    const bool stats = in.queries.empty();
    std::int64_t Hq = 0, q_len = 0;
    if (!stats) {
      KVP_RETURN_IF_ERROR(in.queries.check_basic(kName, "queries"));
      if (on_device)
        KVP_REQUIRE(!in.queries.device().is_host(),
                    "expected_attention: queries is a host tensor; a device backend reads device memory (tag the view kCUDA)");
      else
        KVP_REQUIRE(in.queries.device().is_host(), "expected_attention: queries is a device tensor; this entry point reads host memory");
      Hq = in.queries.extent(0);
      q_len = in.queries.extent(1);
      KVP_REQUIRE(in.queries.extent(2) == d, "expected_attention: queries head_dim %lld differs from keys head_dim %lld",
                  static_cast<long long>(in.queries.extent(2)), static_cast<long long>(d));
      if (!on_device) KVP_RETURN_IF_ERROR(detail::check_finite_3d(kName, "queries", in.queries));  // a device's values stay unread
      KVP_REQUIRE(q_len > params_.n_sink, "expected_attention: queries has %lld rows, must be more than n_sink %d (sequence %zu)",
                  static_cast<long long>(q_len), params_.n_sink, b);
      KVP_REQUIRE(in.lookahead >= 0 && in.lookahead <= q_len - params_.n_sink,
                  "expected_attention: lookahead is %lld, must be in [0, query rows %lld - n_sink %d] (sequence %zu)",
                  static_cast<long long>(in.lookahead), static_cast<long long>(q_len), params_.n_sink, b);
    } else {
      KVP_RETURN_IF_ERROR(in.query_mean.check_basic(kName, "query_mean"));
      KVP_REQUIRE(!in.query_mean.empty(), "expected_attention: neither queries nor query_mean given");
      if (on_device)
        return Status::error(StatusCode::kUnsupported,
                             "expected_attention: precomputed statistics (query_mean) on a device backend are not supported; pass the "
                             "prompt's queries");
      KVP_REQUIRE(in.lookahead == 0, "expected_attention: lookahead is %lld with precomputed statistics (query_mean); fold them in",
                  static_cast<long long>(in.lookahead));
      Hq = in.query_mean.extent(0);
      KVP_REQUIRE(in.query_mean.extent(1) == d, "expected_attention: query_mean has head_dim %lld, keys %lld",
                  static_cast<long long>(in.query_mean.extent(1)), static_cast<long long>(d));
      if (params_.use_covariance) {
        KVP_RETURN_IF_ERROR(in.query_cov.check_basic(kName, "query_cov"));
        KVP_REQUIRE(in.query_cov.extent(0) == Hq && in.query_cov.extent(1) == d && in.query_cov.extent(2) == d,
                    "expected_attention: query_cov has shape (%lld, %lld, %lld), expected (%lld, %lld, %lld)",
                    static_cast<long long>(in.query_cov.extent(0)), static_cast<long long>(in.query_cov.extent(1)),
                    static_cast<long long>(in.query_cov.extent(2)), static_cast<long long>(Hq), static_cast<long long>(d),
                    static_cast<long long>(d));
      }
    }
    GqaMap gqa;
    KVP_RETURN_IF_ERROR(GqaMap::make(Hq, Hkv, kName, &gqa));
    KVP_REQUIRE(in.next_position >= -1 && in.next_position < (std::int64_t{1} << 24) - params_.n_future_positions,
                "expected_attention: next_position %lld out of range [-1, %lld) (2^24 - n_future_positions %d)",
                static_cast<long long>(in.next_position), static_cast<long long>((std::int64_t{1} << 24) - params_.n_future_positions),
                params_.n_future_positions);
    std::int64_t n = 0;
    KVP_RETURN_IF_ERROR(params_.budget.resolve(kName, T, std::min<std::int64_t>(params_.n_sink, T), &n));
    *s = ProblemShape{Hq, Hkv, d, T, q_len};
    return Status::ok();
  }

  template <class Backend>
  std::size_t per_worker_bytes(const ProblemShape& s) const noexcept {
    const auto d = static_cast<std::size_t>(std::max<std::int64_t>(s.head_dim, 2));
    const auto T = static_cast<std::size_t>(std::max<std::int64_t>(s.max_kv_len, 1));
    WorkspacePlan p;               // the order of score_head's carve
    p.add<float>(T);               // head scores
    p.add<float>(T);               // logits of one query head
    p.add<double>(d);              // mean
    p.add<double>(d * d);          // covariance accumulator
    p.add<float>(d * d);           // block accumulator / rotated covariance
    p.add<float>(3 * d);           // rotated mean, key, quadratic-form temp
    p.add<float>(kStatBlock * d);  // centred queries of one covariance block
    p.add<float>(1);               // the logits' max
    p.add_bytes(ops::expected_softmax_workspace<Backend>(static_cast<std::int64_t>(T)));
    if constexpr (!kDeviceBackend<Backend>) p.add<float>(2 * d);  // rbar cos, rbar sin (a device backend: host arrays)
    p.add_bytes(Backend::topk_workspace(static_cast<std::int64_t>(T)));
    return p.bytes;
  }

  /// Averaged RoPE matrix, kvpress's column convention: R[i][i] = cb[i],
  /// R[i][i+h] = -sb[i+h], R[i+h][i] = sb[i] (h = d/2).
  void averaged_rope(std::int64_t d, std::int64_t p0, float* cb, float* sb) const noexcept {
    const std::int64_t h = d / 2, n = params_.n_future_positions;
    for (std::int64_t i = 0; i < h; ++i) {
      double sc = 0.0, ss = 0.0;
      if (params_.rope.fp64_angles) {
        const double inv = params_.rope.inv_freq != nullptr
                               ? static_cast<double>(params_.rope.inv_freq[i])
                               : std::pow(params_.rope.base, -2.0 * static_cast<double>(i) / static_cast<double>(d));
        for (std::int64_t p = p0; p < p0 + n; ++p) {
          const double angle = inv * static_cast<double>(p);
          sc += static_cast<double>(detail::rounded_mul(static_cast<float>(std::cos(angle)), params_.rope.attention_scaling));
          ss += static_cast<double>(detail::rounded_mul(static_cast<float>(std::sin(angle)), params_.rope.attention_scaling));
        }
      } else {
        float inv;
        if (params_.rope.inv_freq != nullptr) {
          inv = params_.rope.inv_freq[i];
        } else {
          const float e = static_cast<float>(2 * i) / static_cast<float>(d);
          inv = 1.0f / std::pow(static_cast<float>(params_.rope.base), e);
        }
        for (std::int64_t p = p0; p < p0 + n; ++p) {
          const float angle = detail::rounded_mul(inv, static_cast<float>(p));
          sc += static_cast<double>(
              detail::rounded_mul(static_cast<float>(std::cos(static_cast<double>(angle))), params_.rope.attention_scaling));
          ss += static_cast<double>(
              detail::rounded_mul(static_cast<float>(std::sin(static_cast<double>(angle))), params_.rope.attention_scaling));
        }
      }
      cb[i] = cb[i + h] = static_cast<float>(sc / static_cast<double>(n));
      sb[i] = sb[i + h] = static_cast<float>(ss / static_cast<double>(n));
    }
  }

  static constexpr std::int64_t kStatBlock = ops::kExpectedStatBlock;

  /// Mean and (optionally) population covariance of query head q, pre-RoPE, in double.
  /// `c`: kStatBlock * d floats (the centred queries of one block).
  template <class Backend, class Tq, class Tk>
  void query_statistics(const ExpectedAttentionInput<Tq, Tk>& in, std::int64_t q, std::int64_t d, double* mu, double* cov, float* block,
                        float* c) const noexcept {
    if constexpr (!kDeviceBackend<Backend>) {  // a device backend refuses precomputed statistics (validate)
      if (in.queries.empty()) {
        for (std::int64_t i = 0; i < d; ++i) mu[i] = in.query_mean(q, i);
        if (params_.use_covariance)
          for (std::int64_t i = 0; i < d; ++i)
            for (std::int64_t j = 0; j < d; ++j) cov[i * d + j] = in.query_cov(q, i, j);
        return;
      }
    }
    ops::expected_statistics<Backend>(in.queries, q, params_.n_sink, d, params_.use_covariance, mu, cov, block, c);
  }

  /// Scores of kv head g into s[0..T): sinks +inf, the rest the group-mean expected attention (x value norm),
  /// through the steps of ops/expected_steps.hpp: the host references here, the backend's own members on a
  /// device backend (device memory throughout except the averaged RoPE tables, host arrays that it copies
  /// into its launch arguments; d <= kExpectedMaxDeviceDim there, checked by validate).
  template <class Backend, class Tq, class Tk>
  void score_head(const ExpectedAttentionInput<Tq, Tk>& in, const ProblemShape& shape, std::int64_t g, float* s,
                  WorkspaceCarver& c) const noexcept {
    const std::int64_t d = shape.head_dim, T = in.keys.kv_len(), n0 = params_.n_sink;
    const std::int64_t G = shape.num_q_heads / shape.num_kv_heads;
    float* z = c.take<float>(static_cast<std::size_t>(T));
    double* mu = c.take<double>(static_cast<std::size_t>(d));
    double* cov = c.take<double>(static_cast<std::size_t>(d * d));
    float* covf = c.take<float>(static_cast<std::size_t>(d * d));  // also the statistics' block accumulator
    float* mf = c.take<float>(static_cast<std::size_t>(3 * d));
    float* kf = mf + d;  // 2 d floats of op scratch (key, quadratic-form row)
    float* centred = c.take<float>(static_cast<std::size_t>(kStatBlock * d));
    float* mx = c.take<float>(1);
    const std::size_t sm = ops::expected_softmax_workspace<Backend>(T);
    const Workspace sm_ws{c.take<std::byte>(sm), sm};
    float device_rope[kDeviceBackend<Backend> ? 2 * ops::kExpectedMaxDeviceDim : 1];
    float* cb = kDeviceBackend<Backend> ? device_rope : c.take<float>(static_cast<std::size_t>(2 * d));
    float* sb = cb + d;
    averaged_rope(d, in.next_position >= 0 ? in.next_position : T, cb, sb);
    const Rows<Tk> keys = in.keys.rows(g);
    const bool use_cov = params_.use_covariance;
    Backend::fill(s, T, 1, 0.0f);
    for (std::int64_t qq = 0; qq < G; ++qq) {
      query_statistics<Backend>(in, g * G + qq, d, mu, cov, covf, centred);
      ops::expected_rotate<Backend>(mu, use_cov ? cov : nullptr, d, cb, sb, mf, covf);  // covf = R cov R^T
      ops::expected_logits_max<Backend>(mf, use_cov ? covf : nullptr, d, keys, n0, T, z, kf, mx);
      ops::expected_softmax<Backend>(z, n0, T, mx, s, sm_ws);
    }
    if (params_.use_vnorm) Backend::neg_row_norms(in.values.rows(g), T, d, z, 1);  // z[j] = -|v_j| (z is free now)
    ops::expected_finish<Backend>(s, params_.use_vnorm ? z : nullptr, n0, T, G, params_.epsilon);
  }

  Params params_{};
};

/// Query heads first, first+step, ... of an input (Ada-KV per-query-head scoring), statistics included.
template <class Tq, class Tk>
ExpectedAttentionInput<Tq, Tk> query_head_subset(const ExpectedAttentionInput<Tq, Tk>& in, std::int64_t first, std::int64_t step) noexcept {
  ExpectedAttentionInput<Tq, Tk> sub = in;
  if (!in.queries.empty()) {
    const auto& q = in.queries;
    sub.queries = TensorView<const Tq, 3>(q.data() + first * q.stride(0), {q.extent(0) / step, q.extent(1), q.extent(2)},
                                          {q.stride(0) * step, q.stride(1), q.stride(2)}, q.device());
  }
  if (!in.query_mean.empty()) {
    const auto& m = in.query_mean;
    sub.query_mean = TensorView<const float, 2>(m.data() + first * m.stride(0), {m.extent(0) / step, m.extent(1)},
                                                {m.stride(0) * step, m.stride(1)}, m.device());
  }
  if (!in.query_cov.empty()) {
    const auto& cv = in.query_cov;
    sub.query_cov = TensorView<const float, 3>(cv.data() + first * cv.stride(0), {cv.extent(0) / step, cv.extent(1), cv.extent(2)},
                                               {cv.stride(0) * step, cv.stride(1), cv.stride(2)}, cv.device());
  }
  return sub;
}

static_assert(Scorer<ExpectedAttention, ExpectedAttentionInput<float, float>> &&
              EvictionPolicy<ExpectedAttention, ExpectedAttentionInput<float, half>>);

KVP_NAMESPACE_END
