// SPDX-License-Identifier: Apache-2.0
// CaM — "CaM: Cache Merging for Memory-efficient LLMs Inference" (Zhang et
// al., ICML 2024), as in its repository (zyxxmu/cam). Only values are merged;
// the keys of evicted tokens are dropped. Two forms:
//
// Streaming (`generate_task/streaming_llm/kv_cache_cam.py::slicev`), at each
// decode step, for each token e leaving the cache (the keep set's evicted
// tokens, ascending):
//   W  = the next `merge_num` kept tokens after e (in the original's
//        start + recent cache: the cache positions e+1 .. e+16)
//   p  = clamp(A[e] / mean_{t in W} A[t], 0, 1), NaN -> 0     A: accumulated attention
//   m ~ Bernoulli(p)                                          per kv head
//   V[t] += m * V[e] / merge_num   for t in W                 (merge_num = 16)
//
// Prefill (`modify_llama_cam.py::local_cam_mask`), a start + recent cache
// simulated over the prompt's full attention A (T x T):
//   for t = start + recent .. T-1:                 e = t - recent leaves the window
//     a[j] = mean_{i < t} A[i, j]  (j < t)
//     ref  = max(a[0 : start] u a[e : t])           sinks + the window, e included
//     p    = clamp(a[e] / ref, 0, 1), NaN -> 0;  m ~ Bernoulli(p)   per kv head
//     V[e+1 : e+1+M] += m * V[e] / M                M = recent (the merge budget)
//   The updates cascade: V[e] already holds what earlier tokens merged into it.
//   The keep set must be the start + recent set (StreamingLLM::original(start, recent)).
//
// Draws: `TorchBernoulli(seed)` (torch's CPU generator), one draw per (event,
// kv head) in event-major order — the order of the original's per-step
// `torch.bernoulli` over the heads after one `torch.manual_seed(seed)`.
//
// Choices:
//  * GQA: attention is averaged over each kv head's query heads (the original
//    is MHA). `attention_sums` may be given per kv head or per query head.
//  * Streaming, generalised to any keep set: W is the next merge_num *kept*
//    tokens, so a value is never merged into a token evicted in the same call;
//    the division stays by merge_num (the original divides by 16 even when
//    fewer neighbours exist). With one token evicted per step (the original's
//    use) this is exactly the original.
//  * Prefill: the plan records entries into kept tokens only; contributions
//    that reach kept tokens through later-evicted ones (the cascade) are in
//    the merged rows, which are authoritative.
//  * A zero reference (ref = 0 or an all-zero window) gives p = NaN -> 0 or
//    inf -> 1 (clamped), as torch would compute it. The streaming original
//    zeroes NaN itself; the prefill original has no guard (torch.bernoulli
//    raises on NaN): there we apply the streaming form's NaN -> 0.
//  * Cross-checked against the original's arithmetic (both forms, replayed with
//    torch's generator: tests/data/fixtures/merge_original.json, written by
//    tests/reference/make_merge_original_fixtures.py): draws and plans exact, the
//    streaming cache bit-exact; no disagreement beyond the extensions above.
//  * Prefill attention is taken as causal: row i contributes to columns j <= i
//    only (entries above the diagonal are ignored, as a causal softmax makes them 0).
//  * Cost: the prefill form reads the full T x T attention (O(T^2) per kv
//    head), as the original simulation does; it is meant for analysis-size
//    prompts. The streaming form is O(evicted x merge_num x head_dim).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kvpolicy/policy/merging/merge_common.hpp"

KVP_NAMESPACE_BEGIN

enum class CaMForm : std::uint8_t { kStreaming, kPrefill };
inline constexpr EnumName<CaMForm> kCaMFormNames[] = {{"streaming", CaMForm::kStreaming}, {"prefill", CaMForm::kPrefill}};
constexpr std::span<const EnumName<CaMForm>> enum_names(CaMForm) noexcept { return kCaMFormNames; }

struct CaMParams {
  CaMForm form = CaMForm::kStreaming;
  std::int32_t merge_num = 16;  ///< streaming: kept neighbours a merged value spreads over
  std::int32_t start = 4;       ///< prefill: start budget (attention sinks)
  std::int32_t recent = 512;    ///< prefill: recent budget, also the merge budget M

  static constexpr auto fields() noexcept {
    return std::tuple{param_field<&CaMParams::form>("form", "streaming (decode) or prefill (simulated over the prompt)"),
                      param_field<&CaMParams::merge_num>("merge_num", "streaming: neighbours a merged value spreads over"),
                      param_field<&CaMParams::start>("start", "prefill: start budget"),
                      param_field<&CaMParams::recent>("recent", "prefill: recent budget (= merge budget)")};
  }
  static constexpr CaMParams streaming(std::int32_t merge_num = 16) noexcept { return CaMParams{CaMForm::kStreaming, merge_num, 4, 512}; }
  static constexpr CaMParams prefill(std::int32_t start, std::int32_t recent) noexcept {
    return CaMParams{CaMForm::kPrefill, 16, start, recent};
  }
};

class CaM {
 public:
  using Params = CaMParams;
  static constexpr const char* kName = "cam";

  constexpr CaM() noexcept = default;
  explicit constexpr CaM(const Params& p) noexcept : params_(p) {}
  constexpr const Params& params() const noexcept { return params_; }

  Status validate_params() const noexcept {
    KVP_RETURN_IF_ERROR(check_enum_fields(kName, params_));
    KVP_REQUIRE(params_.form == CaMForm::kStreaming || params_.form == CaMForm::kPrefill, "cam: form %d is not streaming or prefill",
                static_cast<int>(params_.form));
    KVP_REQUIRE(params_.merge_num >= 1, "cam: merge_num is %d, must be >= 1", params_.merge_num);
    KVP_REQUIRE(params_.start >= 0 && params_.recent >= 1, "cam: start %d must be >= 0 and recent %d >= 1", params_.start, params_.recent);
    return Status::ok();
  }

  template <class Backend>
  Requirements requirements(const Context<Backend>&, const ProblemShape& s) const noexcept {
    const std::int64_t per_token = params_.form == CaMForm::kStreaming ? params_.merge_num : params_.recent;
    const std::size_t ws = kDeviceBackend<Backend> ? device_workspace(s.num_kv_heads, s.max_kv_len).total()
                                                   : workspace(s.num_kv_heads, s.max_kv_len, s.head_dim).total();
    Requirements r = detail::merge_requirements(kName, validate_params(), s, ws, 1);
    if (r.status.is_ok()) r.output.capacity = s.num_kv_heads * capacity_per_row(s.max_kv_len, per_token);
    return r;
  }

  /// Streaming: reads values and attention_sums. Prefill: reads values and
  /// attention (num_q_heads, T, T). Both: seed. Writes the plan and
  /// merged_values (merged_keys must be empty).
  ///
  /// On a device backend (views tagged kCUDA) the streaming form runs as
  /// `Backend::torch_uniforms`, then per kv head `evicted_ids` and
  /// `cam_merge_head`; the plan's `indptr` is a host array written from the
  /// keep set's row sizes and its rows are dense: merge_num entries per
  /// evicted token, in ascending token order, dst = -1 and weight 0 where the
  /// draw failed or the window is short (dropping them gives the host plan).
  /// The attention sums are not scanned for NaN / negatives there. The
  /// prefill form reads the full T x T attention and runs on host backends
  /// only (kUnsupported on a device).
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
    const bool stream = params_.form == CaMForm::kStreaming;
    if (stream) {
      KVP_RETURN_IF_ERROR(detail::check_attention_sums(kName, in.attention_sums, H, T));
    } else {
      KVP_RETURN_IF_ERROR(check_prefill(in, keep, H, T));
    }
    const std::int64_t M = stream ? params_.merge_num : params_.recent;
    std::int64_t cap = 0;
    for (std::int64_t h = 0; h < H; ++h) cap += capacity_per_row(T - keep.row_size(h), M);
    KVP_RETURN_IF_ERROR(detail::check_merge_plan(kName, out, H, d, max_kept, cap, /*merges_keys=*/false));
    KVP_RETURN_IF_ERROR(check_workspace(kName, cx.workspace, workspace(H, T, d).total()));

    WorkspaceCarver c(cx.workspace);
    const auto t = static_cast<std::size_t>(std::max<std::int64_t>(T, 1));
    float* u = c.take<float>(t * static_cast<std::size_t>(H));
    const auto dd = static_cast<std::size_t>(std::max<std::int64_t>(d, 1));
    float* work = c.take<float>(stream ? dd : t * dd);
    float* colsum = c.take<float>(t);
    std::int32_t* ids = c.take<std::int32_t>(t);
    std::int32_t* slot = c.take<std::int32_t>(t);  // token -> kept slot (-1: evicted)
    std::uint8_t* touched = c.take<std::uint8_t>(t);
    // Draws in event-major, head-minor order.
    const std::int64_t events = stream ? max_evicted(keep, H, T) : std::max<std::int64_t>(T - params_.start - params_.recent, 0);
    TorchBernoulli rng(in.seed);
    for (std::int64_t i = 0; i < events * H; ++i) u[i] = rng.uniform();

    std::int64_t pos = 0;
    out.indptr[0] = 0;
    for (std::int64_t h = 0; h < H; ++h) {
      const auto kept = keep.row(h);
      const Rows<Tk> V = in.values.rows(h);
      std::fill(touched, touched + T, std::uint8_t{0});
      if (stream) {
        const std::int64_t first = pos;
        pos = streaming_row(in, kept, H, h, T, u, ids, out, pos);
        if (!out.merged_values.empty()) streaming_apply(V, kept, d, out, first, pos, h * out.slots_per_row, touched, work);
      } else {
        std::fill(slot, slot + T, -1);
        for (std::size_t k = 0; k < kept.size(); ++k) slot[kept[k]] = static_cast<std::int32_t>(k);
        for (std::int64_t j = 0; j < T; ++j)
          for (std::int64_t k = 0; k < d; ++k) work[j * d + k] = to_float(V.row(j)[k]);
        pos = prefill_row(in, H, h, T, d, u, work, colsum, slot, touched, out, pos);
        if (!out.merged_values.empty())
          for (std::int64_t j = 0; j < T; ++j)
            if (touched[j] && slot[j] >= 0)
              std::copy(work + j * d, work + (j + 1) * d, &out.merged_values(h * out.slots_per_row + slot[j], 0));
      }
      out.indptr[h + 1] = static_cast<std::int32_t>(pos);
    }
    return Status::ok();
  }

  template <class Backend, class Tk>
  Status merge_device(const Context<Backend>& cx, const MergeInput<Tk>& in, const KeepSet& keep, MergePlan& out) const noexcept {
    if (params_.form != CaMForm::kStreaming)
      return Status::error(StatusCode::kUnsupported,
                           "cam: the prefill form reads the full T x T attention and runs on host backends only; use the streaming form "
                           "on a device");
    std::int64_t H = -1, T = 0, d = 0, max_kept = 0, evicted = 0;
    KVP_RETURN_IF_ERROR(detail::check_merge_source(kName, in.values, "values", &H, &T, &d, /*on_device=*/true));
    KVP_RETURN_IF_ERROR(detail::check_merge_keep(kName, keep, H, T, &max_kept, &evicted, /*on_device=*/true));
    KVP_RETURN_IF_ERROR(detail::check_attention_sums(kName, in.attention_sums, H, T, /*on_device=*/true));
    const std::int64_t M = params_.merge_num;
    KVP_RETURN_IF_ERROR(detail::check_merge_plan(kName, out, H, d, max_kept, evicted * M, /*merges_keys=*/false, /*on_device=*/true));
    KVP_RETURN_IF_ERROR(check_workspace(kName, cx.workspace, device_workspace(H, T).total()));
    const std::int64_t events = max_evicted(keep, H, T);
    WorkspaceCarver c(cx.workspace);
    const auto t = static_cast<std::size_t>(std::max<std::int64_t>(T, 1));
    float* u = c.take<float>(t * static_cast<std::size_t>(H));
    std::int32_t* cand = c.take<std::int32_t>(t);
    std::int64_t* start = c.take<std::int64_t>(t);
    const ops::CamAttention attn = detail::cam_attention(in.attention_sums, H);
    const ops::CamRule rule{params_.merge_num, /*divide_by_window=*/true};
    const detail::BackendCall<Backend> call(cx);
    KVP_RETURN_IF_ERROR(call.begin());
    out.indptr[0] = 0;
    for (std::int64_t h = 0; h < H; ++h) out.indptr[h + 1] = static_cast<std::int32_t>(out.indptr[h] + (T - keep.row_size(h)) * M);
    if (events > 0) Backend::torch_uniforms(in.seed, events * H, u);  // event-major, head-minor
    const detail::MergedRows m{out};
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t C = keep.row_size(h), E = T - C, pos = out.indptr[h];
      if (E == 0) continue;
      const std::int32_t* kept = keep.indices + keep.indptr[h];
      Backend::evicted_ids(kept, C, T, cand);
      Backend::cam_merge_head(rule, attn, h, in.values.rows(h), kept, C, cand, E, d, u + h, H, out.dst + pos, out.src + pos,
                              out.weight + pos, m.values(h), m.vld(), start);
    }
    return call.end();
  }
  /// Device path: the draws (H x kv_len), the evicted ids and their first window slots.
  static WorkspacePlan device_workspace(std::int64_t H, std::int64_t T) noexcept {
    const auto t = static_cast<std::size_t>(std::max<std::int64_t>(T, 1));
    return WorkspacePlan{}.add<float>(t * static_cast<std::size_t>(std::max<std::int64_t>(H, 1))).add<std::int32_t>(t).add<std::int64_t>(t);
  }
  /// Draws, the fp32 copy of a head's values (prefill form only: the cascade), per-token scratch.
  WorkspacePlan workspace(std::int64_t H, std::int64_t T, std::int64_t d) const noexcept {
    const auto t = static_cast<std::size_t>(std::max<std::int64_t>(T, 1));
    const std::size_t dd = static_cast<std::size_t>(std::max<std::int64_t>(d, 1)), work = params_.form == CaMForm::kPrefill ? t * dd : dd;
    return WorkspacePlan{}
        .add<float>(t * static_cast<std::size_t>(std::max<std::int64_t>(H, 1)))
        .add<float>(work)
        .add<float>(t)
        .add<std::int32_t>(t)
        .add<std::int32_t>(t)
        .add<std::uint8_t>(t);
  }
  std::int64_t capacity_per_row(std::int64_t evicted, std::int64_t M) const noexcept {
    if (params_.form == CaMForm::kStreaming) return evicted * M;
    return std::min(evicted, M) * M;  // only the last `recent` evicted tokens reach a kept token
  }
  static std::int64_t max_evicted(const KeepSet& keep, std::int64_t H, std::int64_t T) noexcept {
    std::int64_t m = 0;
    for (std::int64_t h = 0; h < H; ++h) m = std::max<std::int64_t>(m, T - keep.row_size(h));
    return m;
  }

  template <class Tk>
  Status check_prefill(const MergeInput<Tk>& in, const KeepSet& keep, std::int64_t H, std::int64_t T) const noexcept {
    const auto& A = in.attention;
    KVP_RETURN_IF_ERROR(A.check_basic(kName, "attention"));
    KVP_REQUIRE(A.data() != nullptr || T == 0, "cam: the prefill form needs attention (num_q_heads, kv_len, kv_len)");
    KVP_REQUIRE(A.device().is_host(), "cam: attention is a device tensor; this entry point reads host memory");
    KVP_REQUIRE(A.extent(0) >= H && A.extent(0) % H == 0 && A.extent(1) == T && A.extent(2) == T,
                "cam: attention has shape (%lld, %lld, %lld), expected (a multiple of num_kv_heads=%lld, kv_len=%lld, kv_len)",
                static_cast<long long>(A.extent(0)), static_cast<long long>(A.extent(1)), static_cast<long long>(A.extent(2)),
                static_cast<long long>(H), static_cast<long long>(T));
    const std::int64_t S = params_.start, R = params_.recent, n = std::min<std::int64_t>(T, S + R);
    for (std::int64_t h = 0; h < H; ++h) {
      const auto row = keep.row(h);
      bool ok = static_cast<std::int64_t>(row.size()) == n;
      for (std::int64_t k = 0; ok && k < n; ++k) ok = row[static_cast<std::size_t>(k)] == (T <= S + R || k < S ? k : T - (n - k));
      KVP_REQUIRE(ok, "cam: keep set row %lld is not the start + recent set (start=%lld, recent=%lld) the prefill form simulates",
                  static_cast<long long>(h), static_cast<long long>(S), static_cast<long long>(R));
    }
    for (std::int64_t q = 0; q < A.extent(0); ++q)
      for (std::int64_t i = 0; i < T; ++i)
        for (std::int64_t j = 0; j < T; ++j)
          KVP_REQUIRE(std::isfinite(A(q, i, j)) && A(q, i, j) >= 0.0f, "cam: attention(%lld, %lld, %lld) is %g, must be finite and >= 0",
                      static_cast<long long>(q), static_cast<long long>(i), static_cast<long long>(j), static_cast<double>(A(q, i, j)));
    return Status::ok();
  }

  static float merge_prob(float num, float den) noexcept {
    float p = num / den;
    if (std::isnan(p)) p = 0.0f;
    return std::clamp(p, 0.0f, 1.0f);
  }

  /// The row's entries: for every evicted e (ascending) whose draw succeeds, (slot, e, 1 / merge_num) per window slot.
  template <class Tk>
  std::int64_t streaming_row(const MergeInput<Tk>& in, std::span<const std::int32_t> kept, std::int64_t H, std::int64_t h, std::int64_t T,
                             const float* u, std::int32_t* ids, MergePlan& out, std::int64_t pos) const noexcept {
    const std::int64_t E = detail::evicted_of(kept, T, ids), M = params_.merge_num;
    const float inv = 1.0f / static_cast<float>(M);
    const ops::CamAttention attn = detail::cam_attention(in.attention_sums, H);
    for (std::int64_t i = 0; i < E; ++i) {
      const std::int32_t e = ids[i];
      const auto s0 = static_cast<std::int64_t>(std::upper_bound(kept.begin(), kept.end(), e) - kept.begin());
      const std::int64_t n = std::min<std::int64_t>(M, static_cast<std::int64_t>(kept.size()) - s0);
      if (n == 0 || !(u[i * H + h] < ops::cam_probability(attn, h, kept.data(), s0, n, e))) continue;
      for (std::int64_t w = 0; w < n; ++w) {
        out.dst[pos] = static_cast<std::int32_t>(s0 + w);
        out.src[pos] = e;
        out.weight[pos] = inv;
        ++pos;
      }
    }
    return pos;
  }

  /// merged[slot] = V[kept slot] + sum of the entries' weight x V[src], in entry
  /// order; the sources are evicted, so they are never targets (no cascade).
  template <class Tk>
  static void streaming_apply(const Rows<Tk>& V, std::span<const std::int32_t> kept, std::int64_t d, const MergePlan& out,
                              std::int64_t first, std::int64_t last, std::int64_t row0, std::uint8_t* touched, float* src_row) noexcept {
    detail::accumulate_merged_values(V, kept, d, out, first, last, row0, touched, src_row);
  }

  template <class Tk>
  std::int64_t prefill_row(const MergeInput<Tk>& in, std::int64_t H, std::int64_t h, std::int64_t T, std::int64_t d, const float* u,
                           float* work, float* colsum, const std::int32_t* slot, std::uint8_t* touched, MergePlan& out,
                           std::int64_t pos) const noexcept {
    const std::int64_t S = params_.start, R = params_.recent, G = in.attention.extent(0) / H;
    const float invM = 1.0f / static_cast<float>(R);
    std::fill(colsum, colsum + T, 0.0f);
    std::int64_t rows = 0;  // query rows folded into colsum
    for (std::int64_t t = S + R; t < T; ++t) {
      for (; rows < t; ++rows)  // colsum[j] = sum_{i < t} mean_g A[g, i, j]
        for (std::int64_t j = 0; j <= rows; ++j) {
          float a = 0.0f;
          for (std::int64_t g = 0; g < G; ++g) a += in.attention(h * G + g, rows, j);
          colsum[j] += G == 1 ? a : a / static_cast<float>(G);
        }
      const std::int64_t e = t - R;
      const float inv_t = 1.0f / static_cast<float>(t);
      float ref = 0.0f;
      for (std::int64_t j = 0; j < S; ++j) ref = std::max(ref, colsum[j] * inv_t);
      for (std::int64_t j = e; j < t; ++j) ref = std::max(ref, colsum[j] * inv_t);
      const float p = merge_prob(colsum[e] * inv_t, ref);
      if (!(u[(t - S - R) * H + h] < p)) continue;
      const std::int64_t end = std::min<std::int64_t>(T, e + 1 + R);
      for (std::int64_t j = e + 1; j < end; ++j) {
        for (std::int64_t k = 0; k < d; ++k) work[j * d + k] += work[e * d + k] * invM;
        touched[j] = 1;
        if (slot[j] >= 0) {
          out.dst[pos] = slot[j];
          out.src[pos] = static_cast<std::int32_t>(e);
          out.weight[pos] = invM;
          ++pos;
        }
      }
    }
    return pos;
  }

  Params params_{};
};

static_assert(MergePolicy<CaM, MergeInput<float>> && MergePolicy<CaM, MergeInput<half>>);

KVP_NAMESPACE_END
