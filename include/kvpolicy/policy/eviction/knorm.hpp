// SPDX-License-Identifier: Apache-2.0
// Knorm — "A Simple and Effective L2 Norm-Based Strategy for KV Cache
// Compression" (Devoto et al., EMNLP 2024, arXiv 2406.11430).
//
// Algorithm (per sequence, layer and kv head; keys only, no queries):
//   s[j] = -|| K[h, j, :] ||_2
//   keep the top n_keep slots of s, ascending: the keys of smallest norm.
// The paper observes that a low key norm goes with a high attention score in
// the decoded tokens, so the tokens with the largest key norms are evicted.
// One-shot (kvpress 0.5.5 `KnormPress(compression_ratio=r)`):
// `KnormParams::kvpress(r)` keeps n_keep = max(1, int(T * (1 - r))) per kv head
// (kvpress >= 0.5.5 `compute_n_kept`: a non-empty sequence keeps one token).
// Knorm has no state and protects no token.
//
// Inputs (`evict` / `score`, ScoreInput): the keys alone (dense or paged,
// float32 / float16 / bfloat16, read in place); queries, values and
// probabilities are ignored.
//
// Choices: the norm is accumulated in double from the keys widened to fp32
// (`Backend::row_norm`), then rounded to fp32 once; kvpress accumulates in
// fp32 (`vector_norm(keys, dtype=promote(keys.dtype, float32))`), which can
// differ in the last ulps, i.e. only on near-ties. Ties: equal scores keep the
// more recent token (`score_order_key`; torch.topk's order is unspecified).
// A key with a NaN component scores NaN and is evicted first.
//
// Work split (`evict`): one item per (sequence, kv head), each on its
// worker's workspace slice (the row's n scores and the top-k scratch).
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>

#include "kvpolicy/policy/budget.hpp"
#include "kvpolicy/policy/policy.hpp"

KVP_NAMESPACE_BEGIN

struct KnormParams {
  Budget budget = Budget::compression_ratio(0.5).keep_at_least_one();  ///< tokens kept per kv head

  static constexpr auto fields() noexcept { return std::tuple{budget_field<&KnormParams::budget>()}; }

  /// kvpress 0.5.5 `KnormPress(compression_ratio=r)`: n_keep = max(1, int(T * (1 - r))).
  static constexpr KnormParams kvpress(double r) noexcept { return KnormParams{Budget::compression_ratio(r).keep_at_least_one()}; }
};

class Knorm {
 public:
  using Params = KnormParams;
  static constexpr const char* kName = "knorm";

  constexpr Knorm() noexcept = default;
  explicit constexpr Knorm(const Params& p) noexcept : params_(p) {}
  constexpr const Params& params() const noexcept { return params_; }

  Status validate_params() const noexcept { return params_.budget.validate(kName); }

  /// Tokens kept per kv head for a sequence of kv_len tokens (-1 if invalid).
  std::int64_t kept_count(std::int64_t kv_len) const noexcept {
    std::int64_t n = 0;
    if (kv_len < 0 || !params_.budget.resolve(kName, kv_len, 0, &n).is_ok()) return -1;
    return n;
  }

  /// No token is kept by rule.
  std::int64_t protected_tokens(std::int64_t) const noexcept { return 0; }

  /// The size query: per-worker scratch for `evict` (a row of scores and the
  /// top-k keys; `score` needs none), KeepSet rows (batch x num_kv_heads), no
  /// queries. `shape.num_q_heads` may be 0: Knorm reads no queries.
  template <class Backend>
  Requirements requirements(const Context<Backend>& ctx, const ProblemShape& shape) const noexcept {
    ProblemShape s = shape;
    if (s.num_q_heads == 0) s.num_q_heads = s.num_kv_heads;
    return detail::budget_requirements(
        kName, validate_params(), s, params_.budget, [](std::int64_t) { return std::int64_t{0}; },
        detail::WorkerSlices::bytes(per_worker<Backend>(s.max_kv_len), ctx.exec.workers()), s.num_kv_heads, 0);
  }

  /// Scores of one sequence, out (num_kv_heads, kv_len): -||key||_2 per token
  /// and kv head. No workspace; runs on the calling thread.
  template <class Backend, class Tq, class Tk, class Tp>
  Status score(const Context<Backend>& cx, const ScoreInput<Tq, Tk, Tp>& in, ScoreMap out) const noexcept {
    const PagedKVView<const Tk>** no_paged = nullptr;
    KVP_RETURN_IF_ERROR(validate_input(in, 0, no_paged, kDeviceBackend<Backend>));
    KVP_RETURN_IF_ERROR(out.check_basic(kName, "scores"));
    const std::int64_t H = in.keys.kv_heads(), n = in.keys.kv_len();
    KVP_REQUIRE(out.extent(0) == H && out.extent(1) == n, "knorm: scores has shape (%lld, %lld), expected (num_kv_heads=%lld, kv_len=%lld)",
                static_cast<long long>(out.extent(0)), static_cast<long long>(out.extent(1)), static_cast<long long>(H),
                static_cast<long long>(n));
    const detail::BackendCall<Backend> call(cx);
    KVP_RETURN_IF_ERROR(call.begin());
    for (std::int64_t h = 0; h < H; ++h)
      Backend::neg_row_norms(in.keys.rows(h), n, in.keys.head_dim(), out.data() + h * out.stride(0), out.stride(1));
    return call.end();
  }

  /// Eviction decision for a batch: rows `b * num_kv_heads + h`, each the
  /// kept_count(kv_len) keys of smallest norm of that kv head, ascending.
  /// On error nothing is written.
  template <class Backend, class Tq, class Tk, class Tp>
  Status evict(const Context<Backend>& cx, std::span<const ScoreInput<Tq, Tk, Tp>> batch, KeepSet out) const noexcept {
    KVP_REQUIRE(!batch.empty(), "knorm: batch is empty");
    const std::int64_t H = batch[0].keys.kv_heads();
    std::int64_t max_len = 0;
    const PagedKVView<const Tk>* last_paged = nullptr;
    for (std::size_t b = 0; b < batch.size(); ++b) {
      KVP_RETURN_IF_ERROR(validate_input(batch[b], b, &last_paged, kDeviceBackend<Backend>));
      KVP_REQUIRE(batch[b].keys.kv_heads() == H, "knorm: sequence %zu has %lld kv heads, sequence 0 has %lld", b,
                  static_cast<long long>(batch[b].keys.kv_heads()), static_cast<long long>(H));
      max_len = std::max(max_len, batch[b].keys.kv_len());
    }
    const ExecContext& ctx = cx.exec;
    const std::size_t per = per_worker<Backend>(max_len);
    KVP_RETURN_IF_ERROR(check_workspace(kName, cx.workspace, detail::WorkerSlices::bytes(per, ctx.workers())));
    const detail::BackendCall<Backend> call(cx);
    KVP_RETURN_IF_ERROR(call.begin());
    const auto nb = static_cast<std::int64_t>(batch.size());
    KVP_RETURN_IF_ERROR(
        detail::write_uniform_indptr(kName, out, nb, H, [&](std::int64_t b) { return kept_count(batch[b].keys.kv_len()); }));
    const detail::WorkerSlices slices = detail::WorkerSlices::carve(cx.workspace, per);
    ctx.parallel_for(nb * H, [&](std::int64_t row, int worker) {
      const auto& in = batch[static_cast<std::size_t>(row / H)];
      const std::int64_t h = row % H, n = in.keys.kv_len(), k = out.row_size(row), d = in.keys.head_dim();
      std::int32_t* dst = out.indices + out.indptr[row];
      if (k >= n) {  // kept whole: no scores needed
        Backend::iota(dst, 0, n);
        return;
      }
      WorkspaceCarver c(slices.slice(worker));
      float* s = c.take<float>(static_cast<std::size_t>(n));
      Backend::neg_row_norms(in.keys.rows(h), n, d, s, 1);
      Backend::topk(s, n, k, dst, c.rest());
    });
    return call.end();
  }

  template <class Backend, class Tq, class Tk, class Tp>
  Status evict(const Context<Backend>& cx, const ScoreInput<Tq, Tk, Tp>& in, KeepSet out) const noexcept {
    return evict(cx, std::span<const ScoreInput<Tq, Tk, Tp>>(&in, 1), out);
  }

 private:
  template <class Backend>
  static std::size_t per_worker(std::int64_t max_kv_len) noexcept {
    const std::int64_t n = std::max<std::int64_t>(max_kv_len, 1);
    return WorkspacePlan{}.add<float>(static_cast<std::size_t>(n)).add_bytes(Backend::topk_workspace(n)).total();
  }

  template <class Tq, class Tk, class Tp>
  Status validate_input(const ScoreInput<Tq, Tk, Tp>& in, std::size_t b, const PagedKVView<const Tk>** last_paged = nullptr,
                        bool on_device = false) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_RETURN_IF_ERROR(in.keys.validate(kName, "keys", on_device));
    KVP_REQUIRE(!in.keys.empty(), "knorm: keys has no data (sequence %zu); Knorm scores the keys themselves", b);
    KVP_RETURN_IF_ERROR(in.keys.validate_pool(kName, "keys", on_device, last_paged));
    KVP_REQUIRE(in.keys.head_dim() > 0, "knorm: keys head_dim is %lld, must be >= 1 (sequence %zu)",
                static_cast<long long>(in.keys.head_dim()), b);
    const std::int64_t n = in.keys.kv_len();
    KVP_REQUIRE(n <= INT32_MAX, "knorm: kv_len %lld exceeds the int32 token id range (sequence %zu)", static_cast<long long>(n), b);
    std::int64_t k = 0;
    return params_.budget.resolve(kName, n, 0, &k);
  }

  Params params_{};
};

static_assert(Scorer<Knorm, ScoreInput<float, float>> && EvictionPolicy<Knorm, ScoreInput<float, half>> &&
              EvictionPolicy<Knorm, ScoreInput<float, bfloat16>>);

KVP_NAMESPACE_END
