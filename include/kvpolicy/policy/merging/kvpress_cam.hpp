// SPDX-License-Identifier: Apache-2.0
// KvpressCAM — kvpress 0.5.5 `CAMPress(base_press, compression_interval,
// target_size, merge_budget=32)` (kvpress/presses/cam_press.py), the merge
// step of its `compress`: Cache Merging (CaM) batched over a decode interval.
//
// Algorithm (one sequence, every `compression_interval` decode steps):
//   0. (evict) mean_s[j] = mean over kv heads of the base press's scores; keep
//      the top `target_size` tokens (the same tokens in every kv head), evict
//      the rest.                                       `KvpressCAM::evict`
//   1. merge candidates: of the evicted, the k = `new_tokens` with the highest
//      mean_s (ties: the later token first), taken in ascending order.
//   2. window of candidate i: the merge_budget kept tokens right after i
//      (fewer at the end of the cache: actual_i = their count).
//   3. per kv head h: p = A[h][i] / (sum_window A[h] / max(actual_i, 1)),
//      NaN -> 0, inf -> 1, clamped to [0, 1]; A = attention summed over the
//      decode steps, averaged over each kv head's query heads.
//   4. m ~ Bernoulli(p), drawn for all (h, candidate) in row-major order.
//   5. V[t] += V[i] * m / actual_i for every t in the window (fp32, in
//      candidate order; the contributions use the *unmerged* V[i]).
//   Keys are not merged.
// Plan entries: (window slot, i, m / actual_i) for every drawn m = 1.
//
// Reproducing kvpress's draws: `TorchBernoulli(seed)` is torch's CPU
// generator, so with `MergeInput::seed = s` the merge equals kvpress's after
// `torch.manual_seed(s)` (tests/reference/make_merge_fixtures.py checks it bit
// for bit on the committed fixtures). The CUDA generator is not reproduced.
//
// Choices:
//  * Inputs: `attention_sums` (kv heads or query heads, T) is the running
//    attention sum; `scores` (kv heads, T) the base press's scores, needed only
//    when new_tokens < the evicted count (-1: every evicted token merges).
//  * The keep set must be the same in every kv head (kvpress evicts per
//    sequence, from the head-averaged scores); `evict` builds it. Ties of the
//    mean score in `evict`: the more recent token is kept (the library order;
//    torch.topk's tie order is unspecified).
//  * Precision: fp32 like kvpress on fp32 caches; with fp16 / bf16 caches
//    kvpress adds in the cache dtype, this policy in fp32 (then apply/ rounds once).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kvpolicy/policy/merging/merge_common.hpp"

KVP_NAMESPACE_BEGIN

struct KvpressCAMParams {
  std::int32_t merge_budget = 32;  ///< kept neighbours each merged value is spread over

  static constexpr auto fields() noexcept {
    return std::tuple{param_field<&KvpressCAMParams::merge_budget>("merge_budget", "kept neighbours a merged value is spread over")};
  }
};

class KvpressCAM {
 public:
  using Params = KvpressCAMParams;
  static constexpr const char* kName = "kvpress_cam";

  constexpr KvpressCAM() noexcept = default;
  explicit constexpr KvpressCAM(const Params& p) noexcept : params_(p) {}
  constexpr const Params& params() const noexcept { return params_; }

  Status validate_params() const noexcept {
    KVP_RETURN_IF_ERROR(check_enum_fields(kName, params_));
    KVP_REQUIRE(params_.merge_budget >= 1, "kvpress_cam: merge_budget is %d, must be >= 1", params_.merge_budget);
    return Status::ok();
  }

  template <class Backend>
  Requirements requirements(const Context<Backend>&, const ProblemShape& shape) const noexcept {
    std::size_t ws = 0;
    if constexpr (kDeviceBackend<Backend>)
      ws = device_workspace<Backend>(shape.num_kv_heads, shape.max_kv_len).total();
    else
      ws = workspace(shape.max_kv_len, shape.head_dim).total();
    return detail::merge_requirements(kName, validate_params(), shape, ws, params_.merge_budget);
  }

  /// Step 0: keep the `target_size` tokens of highest head-mean score, the same in
  /// every kv head. scores (num_kv_heads, T); keep: num_kv_heads rows of capacity
  /// target_size each; ws: `evict_workspace(T)`.
  Status evict(TensorView<const float, 2> scores, std::int64_t target_size, KeepSet keep, Workspace ws) const noexcept {
    KVP_RETURN_IF_ERROR(scores.check_basic(kName, "scores"));
    const std::int64_t H = scores.extent(0), T = scores.extent(1);
    KVP_REQUIRE(H >= 1, "kvpress_cam: scores has %lld rows, must be >= 1 (one per kv head)", static_cast<long long>(H));
    KVP_REQUIRE(target_size >= 0 && target_size <= T && T <= INT32_MAX, "kvpress_cam: target_size %lld out of range [0, kv_len=%lld]",
                static_cast<long long>(target_size), static_cast<long long>(T));
    KVP_RETURN_IF_ERROR(keep.check_output(kName, H, H * target_size));
    KVP_RETURN_IF_ERROR(check_workspace(kName, ws, evict_workspace(T)));
    WorkspaceCarver c(ws);
    float* mean = c.take<float>(static_cast<std::size_t>(std::max<std::int64_t>(T, 1)));
    mean_scores(scores, mean);
    backend::Scalar::topk(mean, T, target_size, keep.indices, c.rest());
    std::sort(keep.indices, keep.indices + target_size);
    keep.indptr[0] = 0;
    for (std::int64_t h = 0; h < H; ++h) {
      if (h > 0) std::copy(keep.indices, keep.indices + target_size, keep.indices + h * target_size);
      keep.indptr[h + 1] = static_cast<std::int32_t>((h + 1) * target_size);
    }
    return Status::ok();
  }
  static std::size_t evict_workspace(std::int64_t T) noexcept {
    return WorkspacePlan{}
        .add<float>(static_cast<std::size_t>(std::max<std::int64_t>(T, 1)))
        .add_bytes(backend::Scalar::topk_workspace(std::max<std::int64_t>(T, 1)))
        .total();
  }

  /// Steps 1-5. Reads values, attention_sums, scores (see above), new_tokens,
  /// seed; writes the plan and `merged_values` (merged_keys must be empty).
  ///
  /// On a device backend (views tagged kCUDA: values, attention_sums, scores,
  /// the keep set's ids and the plan's arrays) the merge runs as
  /// `Backend::evicted_ids` or `cam_candidates` (row 0's tokens),
  /// `torch_uniforms`, then `cam_merge_head` per kv head; the plan's `indptr`
  /// is a host array and its rows are dense: merge_budget entries per
  /// candidate, dst = -1 and weight 0 where the draw failed or the window is
  /// short (dropping them gives the host plan). Device memory is not read on
  /// the host: the keep set's rows are not compared with row 0 and the
  /// attention sums are not scanned for NaN / negatives there.
  template <class Backend, class Tk>
  Status merge(const Context<Backend>& cx, const MergeInput<Tk>& in, const KeepSet& keep, MergePlan out) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    if constexpr (kDeviceBackend<Backend>)
      return merge_device(cx, in, keep, out);
    else
      return merge_host(cx, in, keep, out);
  }

 private:
  template <class Backend, class Tk>
  Status merge_host(const Context<Backend>& cx, const MergeInput<Tk>& in, const KeepSet& keep, MergePlan& out) const noexcept {
    std::int64_t H = -1, T = 0, d = 0, max_kept = 0, evicted = 0;
    KVP_RETURN_IF_ERROR(detail::check_merge_source(kName, in.values, "values", &H, &T, &d));
    KVP_RETURN_IF_ERROR(detail::check_merge_keep(kName, keep, H, T, &max_kept, &evicted));
    for (std::int64_t h = 1; h < H; ++h)
      KVP_REQUIRE(std::equal(keep.row(h).begin(), keep.row(h).end(), keep.row(0).begin(), keep.row(0).end()),
                  "kvpress_cam: keep set row %lld differs from row 0; CAMPress evicts the same tokens from every kv head",
                  static_cast<long long>(h));
    const std::int64_t n_evict = H > 0 ? T - keep.row_size(0) : 0;
    const std::int64_t k = in.new_tokens < 0 ? n_evict : std::min(in.new_tokens, n_evict);
    KVP_RETURN_IF_ERROR(detail::check_attention_sums(kName, in.attention_sums, H, T));
    KVP_RETURN_IF_ERROR(check_scores(in, H, T, k, n_evict, /*on_device=*/false));
    KVP_RETURN_IF_ERROR(detail::check_merge_plan(kName, out, H, d, max_kept, evicted * params_.merge_budget, /*merges_keys=*/false));
    KVP_RETURN_IF_ERROR(check_workspace(kName, cx.workspace, workspace(T, d).total()));

    WorkspaceCarver c(cx.workspace);
    const auto t = static_cast<std::size_t>(std::max<std::int64_t>(T, 1));
    std::int32_t* cand = c.take<std::int32_t>(t);
    std::int32_t* start = c.take<std::int32_t>(t);
    float* mean = c.take<float>(t);
    std::uint64_t* order = c.take<std::uint64_t>(t);
    std::int32_t* touched = c.take<std::int32_t>(t);
    float* src_row = c.take<float>(static_cast<std::size_t>(std::max<std::int64_t>(d, 1)));
    const auto kept = H > 0 ? keep.row(0) : std::span<const std::int32_t>{};
    const auto C = static_cast<std::int64_t>(kept.size());
    const std::int64_t n = candidates(in, kept, T, k, cand, mean, order);
    for (std::int64_t j = 0; j < n; ++j)  // first kept index after the candidate (searchsorted right)
      start[j] = static_cast<std::int32_t>(std::upper_bound(kept.begin(), kept.end(), cand[j]) - kept.begin());

    TorchBernoulli rng(in.seed);
    const std::int64_t M = params_.merge_budget;
    const ops::CamAttention attn = detail::cam_attention(in.attention_sums, H);
    std::int64_t pos = 0;
    out.indptr[0] = 0;
    for (std::int64_t h = 0; h < H; ++h) {
      const Rows<Tk> V = in.values.rows(h);
      const std::int64_t row0 = h * out.slots_per_row;
      const std::int64_t first = pos;
      for (std::int64_t j = 0; j < n; ++j) {
        const std::int64_t actual = std::min<std::int64_t>(M, C - start[j]);
        const float p = ops::cam_probability(attn, h, kept.data(), start[j], actual, cand[j]);
        if (!rng.draw(p) || actual == 0) continue;  // every candidate takes its draw
        const float scale = 1.0f / static_cast<float>(actual);
        for (std::int64_t w = 0; w < actual; ++w) {
          out.dst[pos] = start[j] + static_cast<std::int32_t>(w);
          out.src[pos] = cand[j];
          out.weight[pos] = scale;
          ++pos;
        }
      }
      if (!out.merged_values.empty()) apply_row(V, kept, d, out, first, pos, row0, touched, src_row);
      out.indptr[h + 1] = static_cast<std::int32_t>(pos);
    }
    return Status::ok();
  }

  template <class Backend, class Tk>
  Status merge_device(const Context<Backend>& cx, const MergeInput<Tk>& in, const KeepSet& keep, MergePlan& out) const noexcept {
    std::int64_t H = -1, T = 0, d = 0, max_kept = 0, evicted = 0;
    KVP_RETURN_IF_ERROR(detail::check_merge_source(kName, in.values, "values", &H, &T, &d, /*on_device=*/true));
    KVP_RETURN_IF_ERROR(detail::check_merge_keep(kName, keep, H, T, &max_kept, &evicted, /*on_device=*/true));
    const std::int64_t C = keep.row_size(0), n_evict = T - C;
    for (std::int64_t h = 1; h < H; ++h)
      KVP_REQUIRE(keep.row_size(h) == C,
                  "kvpress_cam: keep set row %lld has %lld tokens, row 0 %lld; CAMPress evicts the same tokens from "
                  "every kv head",
                  static_cast<long long>(h), static_cast<long long>(keep.row_size(h)), static_cast<long long>(C));
    const std::int64_t k = in.new_tokens < 0 ? n_evict : std::min(in.new_tokens, n_evict);
    KVP_RETURN_IF_ERROR(detail::check_attention_sums(kName, in.attention_sums, H, T, /*on_device=*/true));
    KVP_RETURN_IF_ERROR(check_scores(in, H, T, k, n_evict, /*on_device=*/true));
    const std::int64_t M = params_.merge_budget;
    KVP_RETURN_IF_ERROR(detail::check_merge_plan(kName, out, H, d, max_kept, evicted * M, /*merges_keys=*/false, /*on_device=*/true));
    const WorkspacePlan plan = device_workspace<Backend>(H, T);
    KVP_RETURN_IF_ERROR(check_workspace(kName, cx.workspace, plan.total()));
    WorkspaceCarver c(cx.workspace);
    const auto t = static_cast<std::size_t>(std::max<std::int64_t>(T, 1));
    float* u = c.take<float>(t * static_cast<std::size_t>(std::max<std::int64_t>(H, 1)));
    std::int32_t* cand = c.take<std::int32_t>(t);
    std::int64_t* start = c.take<std::int64_t>(t);
    std::byte* scratch = c.take<std::byte>(Backend::cam_candidates_workspace(T));
    const ops::CamAttention attn = detail::cam_attention(in.attention_sums, H);
    const ops::CamRule rule{params_.merge_budget, /*divide_by_window=*/false};
    const std::int64_t n = std::min(k, n_evict);
    const detail::BackendCall<Backend> call(cx);
    KVP_RETURN_IF_ERROR(call.begin());
    out.indptr[0] = 0;
    for (std::int64_t h = 0; h < H; ++h) out.indptr[h + 1] = static_cast<std::int32_t>(out.indptr[h] + n * M);
    if (n > 0) {
      const std::int32_t* kept0 = keep.indices + keep.indptr[0];
      if (n < n_evict)
        Backend::cam_candidates(in.scores, kept0, C, T, n, cand, Workspace{scratch, Backend::cam_candidates_workspace(T)});
      else
        Backend::evicted_ids(kept0, C, T, cand);
      Backend::torch_uniforms(in.seed, H * n, u);  // (kv head, candidate), row-major
      const detail::MergedRows m{out};
      for (std::int64_t h = 0; h < H; ++h)
        Backend::cam_merge_head(rule, attn, h, in.values.rows(h), keep.indices + keep.indptr[h], C, cand, n, d, u + h * n, 1,
                                out.dst + out.indptr[h], out.src + out.indptr[h], out.weight + out.indptr[h], m.values(h), m.vld(), start);
    }
    return call.end();
  }
  /// The base press's scores, needed when only k of the n_evict evicted tokens merge: (num_kv_heads, kv_len),
  /// device memory on a device backend.
  template <class Tk>
  static Status check_scores(const MergeInput<Tk>& in, std::int64_t H, std::int64_t T, std::int64_t k, std::int64_t n_evict,
                             bool on_device) noexcept {
    if (k >= n_evict) return Status::ok();
    KVP_RETURN_IF_ERROR(in.scores.check_basic(kName, "scores"));
    KVP_REQUIRE(in.scores.data() != nullptr && in.scores.extent(0) == H && in.scores.extent(1) == T,
                "kvpress_cam: scores has shape (%lld, %lld), expected (num_kv_heads=%lld, kv_len=%lld): needed to pick %lld of %lld "
                "evicted tokens",
                static_cast<long long>(in.scores.extent(0)), static_cast<long long>(in.scores.extent(1)), static_cast<long long>(H),
                static_cast<long long>(T), static_cast<long long>(k), static_cast<long long>(n_evict));
    if (on_device)
      KVP_REQUIRE(!in.scores.device().is_host(),
                  "kvpress_cam: scores is a host tensor; a device backend reads device memory (tag the view kCUDA)");
    return Status::ok();
  }

  /// Device path: the draws (H x kv_len), the candidates, their first window slots, the candidates' scratch.
  template <class Backend>
  static WorkspacePlan device_workspace(std::int64_t H, std::int64_t T) noexcept {
    const auto t = static_cast<std::size_t>(std::max<std::int64_t>(T, 1));
    return WorkspacePlan{}
        .add<float>(t * static_cast<std::size_t>(std::max<std::int64_t>(H, 1)))
        .add<std::int32_t>(t)
        .add<std::int64_t>(t)
        .add_bytes(Backend::cam_candidates_workspace(T));
  }

  static WorkspacePlan workspace(std::int64_t T, std::int64_t d) noexcept {
    const auto t = static_cast<std::size_t>(std::max<std::int64_t>(T, 1));
    return WorkspacePlan{}.add<std::int32_t>(t).add<std::int32_t>(t).add<float>(t).add<std::uint64_t>(t).add<std::int32_t>(t).add<float>(
        static_cast<std::size_t>(std::max<std::int64_t>(d, 1)));
  }

  static void mean_scores(const TensorView<const float, 2>& scores, float* mean) noexcept {
    const std::int64_t H = scores.extent(0), T = scores.extent(1);
    for (std::int64_t j = 0; j < T; ++j) {
      float acc = 0.0f;
      for (std::int64_t h = 0; h < H; ++h) acc += scores(h, j);
      mean[j] = acc / static_cast<float>(H);
    }
  }

  /// Step 1: the k evicted tokens of highest mean score (ties: later first), ascending.
  template <class Tk>
  static std::int64_t candidates(const MergeInput<Tk>& in, std::span<const std::int32_t> kept, std::int64_t T, std::int64_t k,
                                 std::int32_t* cand, float* mean, std::uint64_t* order) noexcept {
    const std::int64_t E = detail::evicted_of(kept, T, cand);
    if (k >= E) return E;
    mean_scores(in.scores, mean);
    for (std::int64_t i = 0; i < E; ++i)
      order[i] = (static_cast<std::uint64_t>(score_order_key(mean[cand[i]])) << 32) | static_cast<std::uint32_t>(cand[i]);
    std::sort(order, order + E, [](std::uint64_t a, std::uint64_t b) { return a > b; });
    for (std::int64_t i = 0; i < k; ++i) cand[i] = static_cast<std::int32_t>(order[i] & 0xffffffffu);
    std::sort(cand, cand + k);
    return k;
  }

  /// merged[slot] = V[kept slot] + the row's entries, in entry order (kvpress's scatter_add order).
  template <class Tk>
  static void apply_row(const Rows<Tk>& V, std::span<const std::int32_t> kept, std::int64_t d, const MergePlan& out, std::int64_t first,
                        std::int64_t last, std::int64_t row0, std::int32_t* touched, float* src_row) noexcept {
    for (std::int64_t e = first; e < last; ++e) touched[out.dst[e]] = 0;
    detail::accumulate_merged_values(V, kept, d, out, first, last, row0, touched, src_row);
  }

  Params params_{};
};

static_assert(MergePolicy<KvpressCAM, MergeInput<float>> && MergePolicy<KvpressCAM, MergeInput<half>>);

KVP_NAMESPACE_END
