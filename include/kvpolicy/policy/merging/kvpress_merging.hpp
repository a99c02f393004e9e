// SPDX-License-Identifier: Apache-2.0
// KvpressMerging — kvpress 0.5.5 `MergingPress(press, similarity_threshold,
// merge_fraction)` (kvpress/presses/merging_press.py), the merge half: the
// wrapped ScorerPress decides the kept set (any eviction policy of this
// library, passed as the KeepSet), this policy folds the evicted values in.
//
// Algorithm (per kv head, at prefill, on the keep set of the eviction):
//   1. u = K / max(|K|, 1e-6) for every token (fp32); for evicted e,
//      (s_e, c_e) = max / argmax over kept c of <u_e, u_c>.
//   2. ok_e = s_e >= similarity_threshold.
//   3. if merge_fraction < 1: q = quantile_{1 - merge_fraction} over the row's
//      evicted of (ok ? s : -inf) (torch.quantile, linear interpolation);
//      ok_e &= s_e >= q.
//   4. w_e = max(s_e, 0) * ok_e * |V_e| / (|V_e| + |V_{c_e}| + 1e-6).
//   5. V[c] <- (V[c] + sum_{e->c} w_e V_e) / (1 + sum_{e->c} w_e) for every kept
//      c with sum w > 0. Keys are not merged (RoPE-safe, as kvpress).
// Plan entries: (c_e, e, w_e / (1 + W_c)) for every e with w_e > 0.
//
// Choices where this differs from, or pins down, kvpress:
//  * Ties in step 1: kvpress's argmax runs over the kept tokens in the
//    scorer's top-k order and takes the first maximum; here the kept tokens
//    are ascending (KeepSet order) and the earliest kept token wins. Exact
//    cosine ties are the only case where the two differ.
//  * Precision: fp32 throughout like kvpress (norms accumulated in double,
//    kvpress in fp32); merged rows are fp32, cast to the cache dtype by apply/.
//    kvpress casts to the cache dtype at the end too.
//  * The quantile of step 3 reproduces torch's float32 arithmetic, including
//    that a quantile landing on a -inf (a row with too few candidates) is NaN,
//    which gates every token of the row off.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kvpolicy/policy/merging/merge_common.hpp"

KVP_NAMESPACE_BEGIN

struct KvpressMergingParams {
  float similarity_threshold = 0.0f;  ///< minimum cosine similarity, in [0, 1]
  float merge_fraction = 1.0f;        ///< fraction of evicted tokens (by similarity) merged, in (0, 1]

  static constexpr auto fields() noexcept {
    return std::tuple{param_field<&KvpressMergingParams::similarity_threshold>("similarity_threshold", "minimum cosine similarity"),
                      param_field<&KvpressMergingParams::merge_fraction>("merge_fraction", "fraction of evicted tokens merged")};
  }
};

class KvpressMerging {
 public:
  using Params = KvpressMergingParams;
  static constexpr const char* kName = "kvpress_merging";
  static constexpr float kEps = 1e-6f;

  constexpr KvpressMerging() noexcept = default;
  explicit constexpr KvpressMerging(const Params& p) noexcept : params_(p) {}
  constexpr const Params& params() const noexcept { return params_; }

  Status validate_params() const noexcept {
    KVP_RETURN_IF_ERROR(check_enum_fields(kName, params_));
    KVP_REQUIRE(params_.similarity_threshold >= 0.0f && params_.similarity_threshold <= 1.0f,
                "kvpress_merging: similarity_threshold is %g, must be in [0, 1]", static_cast<double>(params_.similarity_threshold));
    KVP_REQUIRE(params_.merge_fraction > 0.0f && params_.merge_fraction <= 1.0f, "kvpress_merging: merge_fraction is %g, must be in (0, 1]",
                static_cast<double>(params_.merge_fraction));
    return Status::ok();
  }

  /// Workspace for one row; plan rows = kv heads, capacity = one entry per evicted token.
  template <class Backend>
  Requirements requirements(const Context<Backend>& ctx, const ProblemShape& shape) const noexcept {
    return detail::merge_requirements(
        kName, validate_params(), shape,
        detail::rows_workspace(workspace(shape.max_kv_len, shape.head_dim).total(), shape.num_kv_heads, ctx.exec), 1);
  }

  /// Reads keys and values; writes the plan and `merged_values` (merged_keys must be empty).
  template <class Backend, class Tk>
  Status merge(const Context<Backend>& cx, const MergeInput<Tk>& in, const KeepSet& keep, MergePlan out) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    std::int64_t H = -1, T = 0, d = 0, max_kept = 0, evicted = 0;
    KVP_RETURN_IF_ERROR(detail::check_merge_source(kName, in.keys, "keys", &H, &T, &d));
    KVP_RETURN_IF_ERROR(detail::check_merge_source(kName, in.values, "values", &H, &T, &d));
    KVP_RETURN_IF_ERROR(detail::check_merge_keep(kName, keep, H, T, &max_kept, &evicted));
    KVP_RETURN_IF_ERROR(detail::check_merge_plan(kName, out, H, d, max_kept, evicted, /*merges_keys=*/false));
    const std::size_t per = workspace(T, d).total();
    KVP_RETURN_IF_ERROR(check_workspace(kName, cx.workspace, detail::rows_workspace(per, H, cx.exec)));
    detail::for_each_row(
        cx.exec, cx.workspace, per, out, H, [&](std::int64_t h) { return T - keep.row_size(h); },
        [&](std::int64_t h, Workspace ws, std::int64_t pos) -> std::int64_t {
          const auto kept = keep.row(h);
          const auto C = static_cast<std::int64_t>(kept.size());
          if (C == 0 || C == T) return pos;  // kvpress: nothing to merge
          WorkspaceCarver c(ws);
          const std::size_t nb = detail::nearest_workspace(T, d).bytes;
          detail::NearestScratch s(Workspace{c.take<std::byte>(nb), nb}, T, d);
          float* sorted = c.take<float>(static_cast<std::size_t>(std::max<std::int64_t>(T, 1)));
          const Rows<Tk> K = in.keys.rows(h), V = in.values.rows(h);
          detail::nearest_kept<Backend>(K, kept, T, d, kEps, s);
          const std::int64_t E = s.num_evicted;
          // 2-3: threshold and fraction gates (ok encoded as target >= 0).
          for (std::int64_t i = 0; i < E; ++i)
            if (!(s.sim[i] >= params_.similarity_threshold)) s.target[i] = -1;
          if (params_.merge_fraction < 1.0f) {
            const float q = quantile(s, E, sorted);
            for (std::int64_t i = 0; i < E; ++i)
              if (s.target[i] >= 0 && !(s.sim[i] >= q)) s.target[i] = -1;
          }
          // 4: similarity- and value-norm weights.
          for (std::int64_t i = 0; i < E; ++i) {
            if (s.target[i] < 0) continue;
            const float en = Backend::row_norm(V.row(s.evicted[i]), d), tn = Backend::row_norm(V.row(kept[s.target[i]]), d);
            const float w = std::max(s.sim[i], 0.0f) * en / (en + tn + kEps);
            s.beta[i] = w;
            if (!(w > 0.0f)) s.target[i] = -1;
          }
          // 5: normalised merge into the slots that received weight.
          detail::slot_totals(s, C, s.slot_sum, s.slot_count);
          for (std::int64_t k = 0; k < C; ++k) s.slot_scale[k] = 1.0f / (1.0f + s.slot_sum[k]);
          if (!out.merged_values.empty())
            detail::linear_merge(
                V, kept, d, s, s.slot_count, [](std::int64_t) { return 1.0f; }, out.merged_values, h * out.slots_per_row);
          return detail::write_entries(out, pos, s);
        });
    return Status::ok();
  }

 private:
  static WorkspacePlan workspace(std::int64_t T, std::int64_t d) noexcept {
    WorkspacePlan p;
    p.add_bytes(detail::nearest_workspace(T, d).bytes);
    p.add<float>(static_cast<std::size_t>(std::max<std::int64_t>(T, 1)));
    return p;
  }

  /// torch.quantile(x, 1 - merge_fraction) of x = (ok ? sim : -inf) over the
  /// row's evicted tokens, in torch's float32 arithmetic (sort, rank, lerp).
  float quantile(const detail::NearestScratch& s, std::int64_t E, float* sorted) const noexcept {
    for (std::int64_t i = 0; i < E; ++i) sorted[i] = s.target[i] >= 0 ? s.sim[i] : -std::numeric_limits<float>::infinity();
    std::sort(sorted, sorted + E);
    const auto q = static_cast<float>(1.0 - static_cast<double>(params_.merge_fraction));
    const float rank = q * static_cast<float>(E - 1);
    const auto below = static_cast<std::int64_t>(rank), above = static_cast<std::int64_t>(std::ceil(rank));
    const float w = rank - static_cast<float>(below), a = sorted[below], b = sorted[above];
    return w < 0.5f ? a + w * (b - a) : b - (b - a) * (1.0f - w);
  }

  Params params_{};
};

static_assert(MergePolicy<KvpressMerging, MergeInput<float>> && MergePolicy<KvpressMerging, MergeInput<half>>);

KVP_NAMESPACE_END
