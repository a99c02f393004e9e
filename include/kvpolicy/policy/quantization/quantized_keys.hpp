// SPDX-License-Identifier: Apache-2.0
// `QuantizedKeys<S, Q>`: any query-window scorer S (SnapKV, TOVA, Expected
// Attention's query form...) scoring a K cache held in quantization format Q
// (ggml blocks, fp8, token-wise INT4 with or without rotation, KIVI with its
// fp16 residual), without a dequantized copy of the cache: one kv head at a
// time, that head's keys are decoded into the worker's scratch (T x head_dim
// fp32, the same order as the window-score scratch S already uses) and S
// scores them; the scratch is reused for the next head. Scores are those of S
// on the decoded keys (see below), on every backend (tested).
//
// It is itself a `Scorer` over `QuantScoreInput`, so the library's
// compositions work on quantized caches unchanged:
//   Budgeted<QuantizedKeys<SnapKV, GgmlQuant>, UniformAllocation>   SnapKV's eviction
//   AdaKV<QuantizedKeys<SnapKV, Int4Quant>>                         Ada-KV
//   Budgeted<QuantizedKeys<SnapKV, KiviQuant>, LayerAllocation>     PyramidKV
//
// Per-head scorers (a head's scores depend on its own keys and its GQA group's
// queries: SnapKV and what is built on it) give bit-identical scores; TOVA,
// whose scores are the mean over every query head, gets the mean of the
// heads' group means: equal up to fp32 summation order (tested to 1e-6).
// Rotated formats (Int4Quant / GgmlQuant with rotation) decode back to the
// keys' own basis, so S sees the same queries it would on the fp cache.
// Validation (before anything is written): the region's layout is Q's, codes
// (and KIVI's scales) are shaped for kv_len tokens, head_dim and heads agree
// with the queries, and S's own checks on the same shapes; workspace size.
// Thread-safety: const; kv heads are split over ctx.exec, S runs serially
// inside one head.
//
// On a device backend (backend::Cuda; queries, codes, scales, residual and
// the score map in device memory) with a scorer that has a device path
// (SnapKV and what is built on it, TOVA): the heads run one after another on the
// context's stream, each decoded by Q's device path into the workspace (the
// residual widened by Backend::widen_queries) and scored by S's device path.
// TOVA's head mean runs there too: the heads score into workspace rows, one
// `group_reduce` takes their mean in the host path's order (bit-identical to
// the host path) and `copy_strided` writes it into every row.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <type_traits>

#include "kvpolicy/policy/concepts.hpp"
#include "kvpolicy/policy/policy.hpp"
#include "kvpolicy/policy/quantization/kivi_quant.hpp"
#include "kvpolicy/policy/quantization/quant_checks.hpp"
#include "kvpolicy/quant/hadamard.hpp"

KVP_NAMESPACE_BEGIN

/// A quantized K cache of one sequence as scorers read it.
struct QuantKeys {
  QuantizedKV region{};                  ///< codes (kv_heads, >= rows, bytes) [+ scales for KIVI]; region.tokens quantized tokens
  std::int64_t dim = 0;                  ///< head_dim of the decoded keys
  TensorView<const half, 3> residual{};  ///< KIVI: (kv_heads, >= residual_len, head_dim) full-precision recent keys
  std::int64_t residual_len = 0;         ///< KIVI: tokens in the residual, after the quantized ones

  std::int64_t kv_heads() const noexcept { return region.codes.extent(0); }
  std::int64_t kv_len() const noexcept { return region.tokens + residual_len; }
  std::int64_t head_dim() const noexcept { return dim; }
};

/// Queries (post-RoPE, the latest q_len positions) and quantized keys.
template <class Tq>
struct QuantScoreInput {
  TensorView<const Tq, 3> queries{};  ///< (num_q_heads, q_len, head_dim)
  QuantKeys keys{};
  std::int64_t lookahead = 0;  ///< as ScoreInput::lookahead
};

/// Every `step`-th query head from `first` (Ada-KV's per-query-head allocation scores group members apart).
template <class Tq>
QuantScoreInput<Tq> query_head_subset(const QuantScoreInput<Tq>& in, std::int64_t first, std::int64_t step) noexcept {
  QuantScoreInput<Tq> sub = in;
  const auto& q = in.queries;
  sub.queries = TensorView<const Tq, 3>(q.data() + first * q.stride(0), {q.extent(0) / step, q.extent(1), q.extent(2)},
                                        {q.stride(0) * step, q.stride(1), q.stride(2)}, q.device());
  return sub;
}

class TOVA;
/// Scorers whose rows are one score shared by every kv head: the mean over all query heads (TOVA). The
/// per-head path averages the heads' group means (equal weights: every group has G query heads), the same
/// mean up to fp32 summation order.
template <class S>
inline constexpr bool kScoresSharedAcrossHeads = std::is_same_v<S, TOVA>;

template <class S, class Q>
class QuantizedKeys {
 public:
  using Params = typename S::Params;
  static constexpr const char* kName = "quantized_keys";

  QuantizedKeys(const S& scorer, const Q& quant) noexcept : scorer_(scorer), quant_(quant) {}
  const Params& params() const noexcept { return scorer_.params(); }
  const S& scorer() const noexcept { return scorer_; }
  const Q& quantizer() const noexcept { return quant_; }
  Status validate_params() const noexcept {
    KVP_RETURN_IF_ERROR(scorer_.validate_params());
    return quant_.validate_params();
  }
  std::int64_t protected_tokens(std::int64_t kv_len) const noexcept { return scorer_.protected_tokens(kv_len); }

  /// S's requirements for the whole shape (status, output, query window) with the workspace of the
  /// per-head path: per worker, S's workspace for one kv head (serial) plus the head's decoded keys.
  template <class Backend>
  Requirements requirements(const Context<Backend>& ctx, const ProblemShape& shape) const noexcept {
    Requirements r = scorer_.requirements(ctx, shape);
    if (r.status.is_ok()) r.status = quant_.validate_params();
    if (!r.status.is_ok()) return Requirements{r.status};
    r.workspace_bytes = workspace_bytes<Backend>(shape, ctx.exec);
    return r;
  }

  /// Structure of every sequence (S's own checks on the same shapes); `on_device`: the views must be device
  /// memory (a device backend's call), else host memory.
  template <class Tq>
  Status validate(std::span<const QuantScoreInput<Tq>> batch, ProblemShape* shape, bool on_device = false) const noexcept {
    KVP_RETURN_IF_ERROR(quant_.validate_params());
    KVP_REQUIRE(!batch.empty(), "quantized_keys: batch is empty");
    for (std::size_t b = 0; b < batch.size(); ++b) {
      KVP_RETURN_IF_ERROR(check_keys(batch[b].keys, b));
      const QuantKeys& k = batch[b].keys;
      KVP_RETURN_IF_ERROR(check_memory(k, on_device));
      // S's own checks on the same shapes: its input with keys that read as zeros (never dereferenced past
      // validation: `validate` checks structure only).
      static const float kZeros[kMaxRotatedHeadDim] = {};
      ScoreInput<Tq, float> probe{batch[b].queries, KVSource<float>::from(TensorView<const float, 3>(
                                                        kZeros, {k.kv_heads(), k.kv_len(), k.dim}, {0, 0, 1}, k.region.codes.device()))};
      probe.lookahead = batch[b].lookahead;
      ProblemShape s;
      if constexpr (requires { scorer_.validate(std::span<const ScoreInput<Tq, float>>(&probe, 1), &s, true); }) {
        KVP_RETURN_IF_ERROR(scorer_.validate(std::span<const ScoreInput<Tq, float>>(&probe, 1), &s, on_device));
      } else if constexpr (requires { scorer_.validate(std::span<const ScoreInput<Tq, float>>(&probe, 1), &s); }) {
        KVP_RETURN_IF_ERROR(scorer_.validate(std::span<const ScoreInput<Tq, float>>(&probe, 1), &s));
      } else {  // a scorer without a batch check (TOVA): the structure every scorer needs
        KVP_RETURN_IF_ERROR(detail::check_queries_and_keys(kName, probe.queries, probe.keys,
                                                           static_cast<const PagedKVView<const float>**>(nullptr), on_device));
        s = ProblemShape{probe.queries.extent(0), k.kv_heads(), k.dim, k.kv_len(), probe.queries.extent(1)};
      }
      KVP_RETURN_IF_ERROR(detail::check_same_heads(kName, b, s, shape));
    }
    return Status::ok();
  }

  /// Scores (num_kv_heads, kv_len): S's scores on the decoded keys.
  template <class Backend, class Tq>
  Status score(const Context<Backend>& cx, const QuantScoreInput<Tq>& in, ScoreMap out) const noexcept {
    ProblemShape shape;
    KVP_RETURN_IF_ERROR(validate(std::span<const QuantScoreInput<Tq>>(&in, 1), &shape, kDeviceBackend<Backend>));
    const std::int64_t H = shape.num_kv_heads, G = shape.num_q_heads / H, T = in.keys.kv_len(), d = shape.head_dim;
    KVP_RETURN_IF_ERROR(out.check_basic(kName, "scores"));
    KVP_REQUIRE(out.extent(0) == H && out.extent(1) == T, "quantized_keys: scores has shape (%lld, %lld), expected (%lld, %lld)",
                static_cast<long long>(out.extent(0)), static_cast<long long>(out.extent(1)), static_cast<long long>(H),
                static_cast<long long>(T));
    const std::size_t per = per_worker<Backend>(shape);
    KVP_RETURN_IF_ERROR(check_workspace(kName, cx.workspace, detail::WorkerSlices::bytes(per, cx.exec.workers())));
    const auto slices = detail::WorkerSlices::carve(cx.workspace, per);
    const std::size_t inner = inner_bytes<Backend>(shape);
    if constexpr (kDeviceBackend<Backend>) {
      // One head after another on the stream: its keys decoded into the workspace, then S's device path.
      // A head-mean scorer (TOVA) scores into workspace rows; their mean (Backend::group_reduce, the host
      // path's order) is then copied into every row of `out`.
      const detail::BackendCall<Backend> call(cx);
      KVP_RETURN_IF_ERROR(call.begin());
      WorkspaceCarver c(slices.slice(0));
      float* keys = c.take<float>(static_cast<std::size_t>(std::max<std::int64_t>(T * d, 1)));
      std::byte* sws = c.take<std::byte>(inner);
      float* rows = kScoresSharedAcrossHeads<S> ? c.take<float>(static_cast<std::size_t>(std::max<std::int64_t>((H + 1) * T, 1))) : nullptr;
      const Device dev = in.keys.region.codes.device();
      for (std::int64_t h = 0; h < H; ++h) {
        KVP_RETURN_IF_ERROR(decode_head(Context<Backend>{{}, ExecContext{}, cx.stream}, in.keys, h, keys, dev));
        ScoreInput<Tq, float> one{in.queries.narrow(0, h * G, G),
                                  KVSource<float>::from(TensorView<const float, 3>::contiguous(keys, {1, T, d}, dev))};
        one.lookahead = in.lookahead;
        const ScoreMap row = rows != nullptr ? TensorView<float, 2>::contiguous(rows + h * T, {1, T}, dev) : out.narrow(0, h, 1);
        KVP_RETURN_IF_ERROR(scorer_.score(Context<Backend>{Workspace{sws, inner}, ExecContext{}, cx.stream}, one, row));
      }
      if (rows != nullptr) {
        float* mean = rows + H * T;
        Backend::group_reduce(rows, H, T, T, GroupReduce::kMean, mean);
        for (std::int64_t h = 0; h < H; ++h) Backend::copy_strided(mean, T, out.data() + h * out.stride(0), out.stride(1));
      }
      return call.end();
    } else {
      return score_host(cx, in, out, shape, slices, inner);
    }
  }

 private:
  template <class Backend, class Tq>
  Status score_host(const Context<Backend>& cx, const QuantScoreInput<Tq>& in, ScoreMap out, const ProblemShape& shape,
                    const detail::WorkerSlices& slices, std::size_t inner) const noexcept {
    const std::int64_t H = shape.num_kv_heads, G = shape.num_q_heads / H, T = in.keys.kv_len(), d = shape.head_dim;
    // Errors inside a head (S rejecting what validate accepted) are collected, never thrown.
    Status first_error = Status::ok();
    std::atomic<bool> failed{false};
    cx.exec.parallel_for(H, [&](std::int64_t h, int worker) {
      WorkspaceCarver c(slices.slice(worker));
      float* keys = c.take<float>(static_cast<std::size_t>(std::max<std::int64_t>(T * d, 1)));
      std::byte* sws = c.take<std::byte>(inner);
      const Status ds = decode_head(Context<Backend>{}, in.keys, h, keys, Device{});
      if (!ds.is_ok()) {
        if (!failed.exchange(true)) first_error = ds;
        return;
      }
      ScoreInput<Tq, float> one{in.queries.narrow(0, h * G, G),
                                KVSource<float>::from(TensorView<const float, 3>::contiguous(keys, {1, T, d}))};
      one.lookahead = in.lookahead;
      const Context<Backend> serial{Workspace{sws, inner}, ExecContext{}};
      const Status s = scorer_.score(serial, one, out.narrow(0, h, 1));
      if (!s.is_ok() && !failed.exchange(true)) first_error = s;
    });
    if (first_error.is_ok() && kScoresSharedAcrossHeads<S> && H > 1) {
      for (std::int64_t j = 0; j < T; ++j) {  // group_reduce's kMean: heads in order from the first, then / H
        float acc = out(0, j);
        for (std::int64_t h = 1; h < H; ++h) acc += out(h, j);
        const float mean = acc / static_cast<float>(H);
        for (std::int64_t h = 0; h < H; ++h) out(h, j) = mean;
      }
    }
    return first_error;
  }

  template <class Backend>
  std::size_t inner_bytes(const ProblemShape& s) const noexcept {
    ProblemShape one = s;
    one.num_kv_heads = 1;
    one.num_q_heads = s.num_kv_heads > 0 ? s.num_q_heads / s.num_kv_heads : s.num_q_heads;
    return scorer_.requirements(Context<Backend>{}, one).workspace_bytes;
  }
  template <class Backend>
  std::size_t per_worker(const ProblemShape& s) const noexcept {
    std::size_t bytes = align_up(static_cast<std::size_t>(std::max<std::int64_t>(s.max_kv_len * s.head_dim, 1)) * sizeof(float)) +
                        align_up(inner_bytes<Backend>(s)) + kWorkspaceAlign;
    if constexpr (kDeviceBackend<Backend>)  // a head-mean scorer's rows and their mean
      if (kScoresSharedAcrossHeads<S>)
        bytes += align_up(static_cast<std::size_t>(std::max<std::int64_t>((s.num_kv_heads + 1) * s.max_kv_len, 1)) * sizeof(float));
    return bytes;
  }
  template <class Backend>
  std::size_t workspace_bytes(const ProblemShape& s, const ExecContext& ctx) const noexcept {
    return detail::WorkerSlices::bytes(per_worker<Backend>(s), ctx.workers());
  }

  Status check_keys(const QuantKeys& k, std::size_t b) const noexcept {
    KVP_REQUIRE(k.dim >= 1 && k.dim <= kMaxRotatedHeadDim, "quantized_keys: head_dim %lld must be in [1, %lld] (sequence %zu)",
                static_cast<long long>(k.dim), static_cast<long long>(kMaxRotatedHeadDim), b);
    const QuantizedKV& q = k.region;
    KVP_REQUIRE(q.layout.name != nullptr && std::string_view(q.layout.name) == layout_name(),
                "quantized_keys: the keys' layout is '%s', the quantizer's is '%s' (sequence %zu)",
                q.layout.name ? q.layout.name : "(null)", layout_name(), b);
    KVP_REQUIRE(q.tokens >= 0 && k.residual_len >= 0, "quantized_keys: negative token counts (sequence %zu)", b);
    KVP_RETURN_IF_ERROR(q.codes.check_basic(kName, "keys codes"));
    if constexpr (std::is_same_v<Q, KiviQuant>) {
      KVP_RETURN_IF_ERROR(quant_.check_head_dim(k.dim));
      KVP_REQUIRE(quant_.params().role == QuantRole::kKeys, "quantized_keys: the KIVI quantizer's role is values, keys need role=keys");
      KVP_REQUIRE(q.tokens % quant_.params().group == 0, "quantized_keys: KIVI keys hold %lld tokens, not a multiple of group %d",
                  static_cast<long long>(q.tokens), quant_.params().group);
      const std::int64_t rows = quant_.code_rows(q.tokens);
      KVP_REQUIRE(q.codes.extent(1) >= rows && q.codes.extent(2) == quant_.codes_row_bytes(k.dim) && q.codes.stride(2) == 1 &&
                      q.scales.extent(0) == q.codes.extent(0) && q.scales.extent(1) >= rows &&
                      q.scales.extent(2) == quant_.scales_row_bytes(k.dim) && q.scales.stride(2) == 1 &&
                      (rows == 0 || q.scales.data() != nullptr),
                  "quantized_keys: KIVI codes / scales are not shaped for %lld tokens of head_dim %lld (sequence %zu)",
                  static_cast<long long>(q.tokens), static_cast<long long>(k.dim), b);
      if (k.residual_len > 0) {
        KVP_RETURN_IF_ERROR(k.residual.check_basic(kName, "keys residual"));
        KVP_REQUIRE(k.residual.extent(0) == q.codes.extent(0) && k.residual.extent(1) >= k.residual_len && k.residual.extent(2) == k.dim &&
                        k.residual.stride(2) == 1,
                    "quantized_keys: residual is not (kv_heads, >= %lld, %lld) with channel stride 1 (sequence %zu)",
                    static_cast<long long>(k.residual_len), static_cast<long long>(k.dim), b);
      }
    } else {
      KVP_REQUIRE(k.residual_len == 0, "quantized_keys: a residual is KIVI's; this format stores every token (sequence %zu)", b);
      KVP_REQUIRE(q.codes.extent(1) >= q.tokens && q.codes.extent(2) == quant_.row_bytes(k.dim) && q.codes.stride(2) == 1,
                  "quantized_keys: codes is (%lld, %lld, %lld), expected (kv_heads, >= %lld tokens, %lld bytes) (sequence %zu)",
                  static_cast<long long>(q.codes.extent(0)), static_cast<long long>(q.codes.extent(1)),
                  static_cast<long long>(q.codes.extent(2)), static_cast<long long>(q.tokens),
                  static_cast<long long>(quant_.row_bytes(k.dim)), b);
    }
    return Status::ok();
  }

  const char* layout_name() const noexcept { return quant_.layout().name; }

  /// Views of a device backend's call are device memory, of a host backend's host memory.
  Status check_memory(const QuantKeys& k, bool on_device) const noexcept {
    KVP_RETURN_IF_ERROR(detail::check_quant_memory(kName, "keys codes", on_device, k.region.codes.device(), 1, 1));
    if (k.region.scales.data() != nullptr)
      KVP_RETURN_IF_ERROR(detail::check_quant_memory(kName, "keys scales", on_device, k.region.scales.device(), 1, 1));
    if (k.residual_len > 0)
      KVP_RETURN_IF_ERROR(detail::check_quant_memory(kName, "keys residual", on_device, k.residual.device(), k.residual.stride(2), k.dim));
    return Status::ok();
  }

  /// Head h's kv_len keys, decoded, into dst (T x d, memory of `dev`): the quantizer's dequantize, then the
  /// residual rows widened (Backend::widen_queries: exact).
  template <class Backend>
  Status decode_head(const Context<Backend>& serial, const QuantKeys& k, std::int64_t h, float* dst, Device dev) const noexcept {
    const std::int64_t d = k.dim, Tq = k.region.tokens;
    if (Tq > 0) {
      QuantizedKV one = k.region;
      one.codes = k.region.codes.narrow(0, h, 1);
      if (k.region.scales.data() != nullptr) one.scales = k.region.scales.narrow(0, h, 1);
      KVP_RETURN_IF_ERROR(quant_.dequantize(serial, one, TensorView<float, 3>::contiguous(dst, {1, Tq, d}, dev)));
    }
    if (k.residual_len > 0) Backend::widen_queries(k.residual, h, 1, 0, k.residual_len, dst + Tq * d);
    return Status::ok();
  }

  S scorer_;
  Q quant_;
};

KVP_NAMESPACE_END
