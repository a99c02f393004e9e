// SPDX-License-Identifier: Apache-2.0
// D2O — "D2O: Dynamic Discriminative Operations for Efficient Long-Context
// Inference of Large Language Models" (Wan et al., ICLR 2025), as in its
// repository (AIoT-MLSys-Lab/D2O).
//
// Layer level, at prefill (`D2O::layer_ratios`):
//   v_l  = mean over heads of minmax_heads( Var_j( sum_queries A_l[h, :, j] ) )
//   w    = softmax(-v) over layers
//   r_l  = clamp(w_l * L * rho, 0.01, 1),  rho = hh_ratio + recent_ratio
//   layers 0, 1 and L-1 are never compressed (r = 1) — as coded, the default;
//   `protect_edge_layers = false` gives them the formula too, so the layers
//   share the budget on few-layer models — a layer keeps
//   r_l * T tokens, split between heavy hitters and recent tokens in the
//   proportion hh_ratio : recent_ratio.
//
// Token level, at each decode step once T > hh + recent (`D2O::evict`, `D2O::merge`):
//   score = accumulated attention (H2O), the first 4 tokens +inf (sinks)
//   keep  = top-hh of score[:, :T-recent] u the last `recent`, per head
//   for the i-th evicted token of every head:  (s[h][i], c[h][i]) = max / argmax
//       over kept c of cos(K[h][e_i], K[h][c])
//   tau <- mean(s) on the first call, tau <- alpha tau + beta mean(s) after
//   merge i (in every head) iff mean_h s[h][i] >= tau
//   K[c] <- (K[c] + sum_{e->c} s_e K[e]) / (1 + n_c), V the same (as coded:
//       torch scatter_reduce 'mean', include_self)
// Plan entries: (c, e, s_e / (1 + n_c)).
//
// Choices where the references disagree:
//  * The as-coded weighted *mean* divides by the count, not the weight sum, so
//    a merged row shrinks toward zero when s < 1 (reference notes: D2O's
//    weighted mean shrinks norms). `D2OWeighting::kNormalized` divides by
//    1 + sum s instead (a true weighted average, the paper's description);
//    `kAsCoded` is the default.
//  * The merge decision is shared by all heads for the i-th evicted token of
//    each head (the code means over the head axis of a (heads, n_evicted)
//    tensor), so every head must evict the same number of tokens; the
//    partner c is per head.
//  * tau lives in caller-owned `D2OState` (one per layer and sequence).
//  * Cosine similarity divides by max(norm, 1e-8) per vector (torch's
//    cosine_similarity); ties go to the earliest kept token.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>

#include "kvpolicy/policy/merging/merge_common.hpp"

KVP_NAMESPACE_BEGIN

enum class D2OWeighting : std::uint8_t { kAsCoded, kNormalized };
inline constexpr EnumName<D2OWeighting> kD2OWeightingNames[] = {{"as_coded", D2OWeighting::kAsCoded},
                                                                {"normalized", D2OWeighting::kNormalized}};
constexpr std::span<const EnumName<D2OWeighting>> enum_names(D2OWeighting) noexcept { return kD2OWeightingNames; }

struct D2OParams {
  std::int64_t heavy = 128;   ///< hh: heavy hitters kept per head (token level)
  std::int64_t recent = 128;  ///< recent tokens kept per head
  std::int32_t sinks = 4;     ///< first tokens scored +inf
  float alpha = 0.5f;         ///< EMA: tau <- alpha tau + beta mean(s)
  float beta = 0.5f;
  D2OWeighting weighting = D2OWeighting::kAsCoded;
  double hh_ratio = 0.1;            ///< layer level: heavy-hitter share of the prompt
  double recent_ratio = 0.1;        ///< layer level: recent share of the prompt
  bool protect_edge_layers = true;  ///< layer level: layers 0, 1 and the last keep everything (as coded)

  static constexpr auto fields() noexcept {
    return std::tuple{
        param_field<&D2OParams::heavy>("heavy", "heavy hitters kept per head"),
        param_field<&D2OParams::recent>("recent", "recent tokens kept per head"),
        param_field<&D2OParams::sinks>("sinks", "first tokens always kept"),
        param_field<&D2OParams::alpha>("alpha", "EMA weight of the previous threshold"),
        param_field<&D2OParams::beta>("beta", "EMA weight of this step's mean similarity"),
        param_field<&D2OParams::weighting>("weighting", "as_coded (divide by count) or normalized (by weight sum)"),
        param_field<&D2OParams::hh_ratio>("hh_ratio", "layer level: heavy-hitter ratio"),
        param_field<&D2OParams::recent_ratio>("recent_ratio", "layer level: recent ratio"),
        param_field<&D2OParams::protect_edge_layers>("protect_edge_layers", "layer level: layers 0, 1 and the last uncompressed")};
  }
};

// D2OState (the caller-owned EMA threshold of one layer and sequence) is in ops/merge_scalar.hpp.

/// MergeInput plus the threshold state it updates (on a device backend, a
/// D2OState in device memory, read and written on the device).
template <class Tk>
struct D2OInput : MergeInput<Tk> {
  D2OState* state = nullptr;
};

class D2O {
 public:
  using Params = D2OParams;
  using State = D2OState;
  static constexpr const char* kName = "d2o";
  static constexpr float kEps = 1e-8f;

  constexpr D2O() noexcept = default;
  explicit constexpr D2O(const Params& p) noexcept : params_(p) {}
  constexpr const Params& params() const noexcept { return params_; }

  Status validate_params() const noexcept {
    KVP_RETURN_IF_ERROR(check_enum_fields(kName, params_));
    KVP_REQUIRE(params_.heavy >= 0 && params_.recent >= 0 && params_.sinks >= 0, "d2o: heavy %lld, recent %lld, sinks %d must be >= 0",
                static_cast<long long>(params_.heavy), static_cast<long long>(params_.recent), params_.sinks);
    KVP_REQUIRE(std::isfinite(params_.alpha) && std::isfinite(params_.beta) && params_.alpha >= 0 && params_.beta >= 0,
                "d2o: alpha %g and beta %g must be finite and >= 0", static_cast<double>(params_.alpha), static_cast<double>(params_.beta));
    KVP_REQUIRE(params_.weighting == D2OWeighting::kAsCoded || params_.weighting == D2OWeighting::kNormalized,
                "d2o: weighting %d is not as_coded or normalized", static_cast<int>(params_.weighting));
    KVP_REQUIRE(params_.hh_ratio >= 0 && params_.recent_ratio >= 0 && params_.hh_ratio + params_.recent_ratio > 0 &&
                    params_.hh_ratio + params_.recent_ratio <= 1,
                "d2o: hh_ratio %g + recent_ratio %g must be in (0, 1]", params_.hh_ratio, params_.recent_ratio);
    return Status::ok();
  }

  template <class Backend>
  Requirements requirements(const Context<Backend>&, const ProblemShape& s) const noexcept {
    return detail::merge_requirements(kName, validate_params(), s, workspace<Backend>(s.num_kv_heads, s.max_kv_len, s.head_dim).total(), 1);
  }

  /// Layer level: per-layer keep ratios from each layer's head variances.
  /// head_variance (L, H): Var_j of the column sums of layer l, head h
  /// (`column_variance` computes one). ratios (L): written.
  Status layer_ratios(TensorView<const float, 2> head_variance, std::span<double> ratios) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_RETURN_IF_ERROR(head_variance.check_basic(kName, "head_variance"));
    const std::int64_t L = head_variance.extent(0), H = head_variance.extent(1);
    KVP_REQUIRE(L >= 1 && H >= 1, "d2o: head_variance has shape (%lld, %lld), needs >= 1 layer and head", static_cast<long long>(L),
                static_cast<long long>(H));
    KVP_REQUIRE(static_cast<std::int64_t>(ratios.size()) == L, "d2o: ratios has %zu entries for %lld layers", ratios.size(),
                static_cast<long long>(L));
    for (std::int64_t l = 0; l < L; ++l)
      for (std::int64_t h = 0; h < H; ++h)
        KVP_REQUIRE(std::isfinite(head_variance(l, h)), "d2o: head_variance(%lld, %lld) is not finite", static_cast<long long>(l),
                    static_cast<long long>(h));
    double mx = -1e300;
    for (std::int64_t l = 0; l < L; ++l) {
      double lo = head_variance(l, 0), hi = lo, acc = 0.0;
      for (std::int64_t h = 0; h < H; ++h) lo = std::min<double>(lo, head_variance(l, h)), hi = std::max<double>(hi, head_variance(l, h));
      for (std::int64_t h = 0; h < H; ++h) acc += hi > lo ? (head_variance(l, h) - lo) / (hi - lo) : 0.0;
      ratios[static_cast<std::size_t>(l)] = -acc / static_cast<double>(H);  // -v_l
      mx = std::max(mx, ratios[static_cast<std::size_t>(l)]);
    }
    double z = 0.0;
    for (auto& r : ratios) z += (r = std::exp(r - mx));
    const double rho = params_.hh_ratio + params_.recent_ratio;
    for (std::int64_t l = 0; l < L; ++l) {
      auto& r = ratios[static_cast<std::size_t>(l)];
      const bool edge = params_.protect_edge_layers && (l < 2 || l == L - 1);
      r = edge ? 1.0 : std::clamp(r / z * static_cast<double>(L) * rho, 0.01, 1.0);
    }
    return Status::ok();
  }

  /// Var_j (population variance) of each row of column sums (H, T) into var (H).
  static Status column_variance(TensorView<const float, 2> column_sums, std::span<float> var) noexcept {
    KVP_RETURN_IF_ERROR(column_sums.check_basic(kName, "column_sums"));
    KVP_REQUIRE(static_cast<std::int64_t>(var.size()) == column_sums.extent(0), "d2o: var has %zu entries for %lld heads", var.size(),
                static_cast<long long>(column_sums.extent(0)));
    const std::int64_t T = column_sums.extent(1);
    for (std::int64_t h = 0; h < column_sums.extent(0); ++h) {
      double m = 0.0, q = 0.0;
      for (std::int64_t j = 0; j < T; ++j) m += column_sums(h, j);
      m /= static_cast<double>(std::max<std::int64_t>(T, 1));
      for (std::int64_t j = 0; j < T; ++j) q += (column_sums(h, j) - m) * (column_sums(h, j) - m);
      var[static_cast<std::size_t>(h)] = static_cast<float>(q / static_cast<double>(std::max<std::int64_t>(T, 1)));
    }
    return Status::ok();
  }

  /// Token-level eviction: scores (H, T) accumulated attention -> keep set of
  /// H rows (sinks +inf, top-`heavy` of the first T - recent, the last `recent`);
  /// everything is kept while T <= heavy + recent. ws: evict_workspace(T).
  Status evict(TensorView<const float, 2> scores, KeepSet keep, Workspace ws) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_RETURN_IF_ERROR(scores.check_basic(kName, "scores"));
    const std::int64_t H = scores.extent(0), T = scores.extent(1);
    KVP_REQUIRE(H >= 1 && T <= INT32_MAX, "d2o: scores has shape (%lld, %lld)", static_cast<long long>(H), static_cast<long long>(T));
    const std::int64_t n = kept_count(T);
    KVP_RETURN_IF_ERROR(keep.check_output(kName, H, H * n));
    KVP_RETURN_IF_ERROR(check_workspace(kName, ws, evict_workspace(T)));
    WorkspaceCarver c(ws);
    float* s = c.take<float>(static_cast<std::size_t>(std::max<std::int64_t>(T, 1)));
    const Workspace rest = c.rest();
    keep.indptr[0] = 0;
    for (std::int64_t h = 0; h < H; ++h) {
      std::int32_t* dst = keep.indices + h * n;
      keep.indptr[h + 1] = static_cast<std::int32_t>((h + 1) * n);
      if (n == T) {
        for (std::int64_t j = 0; j < T; ++j) dst[j] = static_cast<std::int32_t>(j);
        continue;
      }
      const std::int64_t past = T - params_.recent;
      for (std::int64_t j = 0; j < past; ++j) s[j] = j < params_.sinks ? kProtectedScore : scores(h, j);
      backend::Scalar::topk(s, past, params_.heavy, dst, rest);
      std::sort(dst, dst + params_.heavy);
      for (std::int64_t j = 0; j < params_.recent; ++j) dst[params_.heavy + j] = static_cast<std::int32_t>(past + j);
    }
    return Status::ok();
  }
  std::int64_t kept_count(std::int64_t T) const noexcept {
    return T <= params_.heavy + params_.recent ? T : params_.heavy + params_.recent;
  }
  static std::size_t evict_workspace(std::int64_t T) noexcept {
    const auto t = static_cast<std::size_t>(std::max<std::int64_t>(T, 1));
    return WorkspacePlan{}.add<float>(t).add_bytes(backend::Scalar::topk_workspace(static_cast<std::int64_t>(t))).total();
  }

  /// Token-level merge. Reads keys, values and `state` (updated on success);
  /// writes the plan, merged_keys and merged_values (either may be empty).
  /// On a device backend (views tagged kCUDA, `state` in device memory) the
  /// heads run as `Backend::merge_nearest`, one `Backend::d2o_decide` and
  /// `Backend::merge_apply`, and the plan's rows are dense (every evicted
  /// token, dst = -1 and weight 0 when not merged; `detail::rule_merge`).
  template <class Backend, class Tk>
  Status merge(const Context<Backend>& cx, const D2OInput<Tk>& in, const KeepSet& keep, MergePlan out) const noexcept {
    constexpr bool dev = kDeviceBackend<Backend>;
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_REQUIRE(in.state != nullptr, "d2o: state is null (the EMA threshold is caller-owned)");
    std::int64_t H = -1, T = 0, d = 0, max_kept = 0, evicted = 0;
    KVP_RETURN_IF_ERROR(detail::check_merge_source(kName, in.keys, "keys", &H, &T, &d, dev));
    KVP_RETURN_IF_ERROR(detail::check_merge_source(kName, in.values, "values", &H, &T, &d, dev));
    KVP_RETURN_IF_ERROR(detail::check_merge_keep(kName, keep, H, T, &max_kept, &evicted, dev));
    for (std::int64_t h = 1; h < H; ++h)
      KVP_REQUIRE(keep.row_size(h) == keep.row_size(0),
                  "d2o: kv head %lld keeps %lld tokens, head 0 keeps %lld; the shared merge decision "
                  "needs equal counts",
                  static_cast<long long>(h), static_cast<long long>(keep.row_size(h)), static_cast<long long>(keep.row_size(0)));
    KVP_RETURN_IF_ERROR(detail::check_merge_plan(kName, out, H, d, max_kept, evicted, /*merges_keys=*/true, dev));
    KVP_RETURN_IF_ERROR(check_workspace(kName, cx.workspace, workspace<Backend>(H, T, d).total()));
    const std::int64_t C = H > 0 ? keep.row_size(0) : 0, E = T - C;
    const detail::MergedRows m{out};
    const MergeRule r = rule();
    if constexpr (dev) {
      const detail::BackendCall<Backend> call(cx);
      KVP_RETURN_IF_ERROR(call.begin());
      out.indptr[0] = 0;
      for (std::int64_t h = 0; h < H; ++h) out.indptr[h + 1] = static_cast<std::int32_t>((h + 1) * E);
      if (E == 0) return call.end();
      WorkspaceCarver c(cx.workspace);
      const std::size_t opb = Backend::merge_head_workspace(T, d);
      const Workspace ows{c.take<std::byte>(opb), opb};
      std::int32_t* ev = c.take<std::int32_t>(static_cast<std::size_t>(H * T));
      std::int32_t* tg = c.take<std::int32_t>(static_cast<std::size_t>(H * T));
      float* sim = c.take<float>(static_cast<std::size_t>(H * T));
      for (std::int64_t h = 0; h < H; ++h)
        Backend::merge_nearest(in.keys.rows(h), keep.indices + keep.indptr[h], C, T, d, r.eps, ev + h * E, tg + h * E, sim + h * E, ows);
      if (C > 0) Backend::d2o_decide(sim, tg, H, E, params_.alpha, params_.beta, in.state);  // no kept token: nothing merges, tau stays
      for (std::int64_t h = 0; h < H; ++h)
        Backend::merge_apply(r, in.keys.rows(h), in.values.rows(h), keep.indices + keep.indptr[h], C, T, d, nullptr, ev + h * E, tg + h * E,
                             sim + h * E, out.dst + h * E, out.src + h * E, out.weight + h * E, m.keys(h), m.kld(), m.values(h), m.vld(),
                             ows);
      return call.end();
    } else {
      out.indptr[0] = 0;
      if (E == 0 || C == 0) {
        for (std::int64_t h = 0; h < H; ++h) out.indptr[h + 1] = 0;
        return Status::ok();
      }
      WorkspaceCarver c(cx.workspace);
      const std::size_t nb = detail::nearest_workspace(T, d).bytes;
      detail::NearestScratch s(Workspace{c.take<std::byte>(nb), nb}, T, d);
      float* sims = c.take<float>(static_cast<std::size_t>(H * E));
      std::int32_t* targets = c.take<std::int32_t>(static_cast<std::size_t>(H * E));
      // Pass 1: nearest kept partner of every evicted token, per head.
      for (std::int64_t h = 0; h < H; ++h) {
        detail::nearest_kept<Backend>(in.keys.rows(h), keep.row(h), T, d, kEps, s);
        for (std::int64_t i = 0; i < E; ++i) {
          sims[h * E + i] = s.sim[i];
          targets[h * E + i] = s.target[i];
        }
      }
      // EMA threshold and the shared decision per evicted index, then each head's linear merge.
      D2OState next = *in.state;
      backend::ScalarMergeOps::d2o_decide(sims, targets, H, E, params_.alpha, params_.beta, &next);
      std::int64_t pos = 0;
      for (std::int64_t h = 0; h < H; ++h) {
        const auto kept = keep.row(h);
        s.num_evicted = detail::evicted_of(kept, T, s.evicted);
        for (std::int64_t i = 0; i < E; ++i) {
          s.target[i] = targets[h * E + i];
          s.sim[i] = sims[h * E + i];
        }
        detail::apply_merge_rule<Backend>(r, in.keys.rows(h), in.values.rows(h), kept, d, nullptr, s, nullptr, m.keys(h), m.kld(),
                                          m.values(h), m.vld());
        pos = detail::write_entries(out, pos, s);
        out.indptr[h + 1] = static_cast<std::int32_t>(pos);
      }
      *in.state = next;
      return Status::ok();
    }
  }

  /// The token-level merge as a `MergeRule` on the decided targets: beta = s_e
  /// (any sign), self 1, scale 1 / (1 + n_c) (as coded) or 1 / (1 + sum s).
  MergeRule rule() const noexcept {
    MergeRule r;
    r.eps = kEps;
    r.beta = MergeBeta::kSimilarity;
    r.self = MergeSelf::kOne;
    r.norm = params_.weighting == D2OWeighting::kAsCoded ? MergeNorm::kOnePlusCount : MergeNorm::kOnePlusSum;
    return r;
  }

 private:
  template <class Backend>
  static WorkspacePlan workspace(std::int64_t H, std::int64_t T, std::int64_t d) noexcept {
    const auto ht = static_cast<std::size_t>(std::max<std::int64_t>(H * T, 1));
    WorkspacePlan p;
    if constexpr (kDeviceBackend<Backend>) {
      p.add_bytes(Backend::merge_head_workspace(T, d));
      p.add<std::int32_t>(ht).add<std::int32_t>(ht).add<float>(ht);
    } else {
      p.add_bytes(detail::nearest_workspace(T, d).bytes);
      p.add<float>(ht);
      p.add<std::int32_t>(ht);
    }
    return p;
  }

  Params params_{};
};

static_assert(MergePolicy<D2O, D2OInput<float>> && MergePolicy<D2O, D2OInput<half>>);

KVP_NAMESPACE_END
