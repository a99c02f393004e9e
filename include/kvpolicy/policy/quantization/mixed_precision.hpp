// SPDX-License-Identifier: Apache-2.0
// `MixedPrecision<S, Q>`: three tiers on one byte budget (the ZipCache / ARKV
// idea: saliency decides the bit width). Any scorer S (SnapKV, Ada-KV's
// scoring, TOVA, ObservedAttention, Expected Attention...) ranks the tokens of
// each kv head; the highest-ranked stay in full precision, the next ones are
// stored in the per-token format Q (ggml blocks, token-wise INT4, fp8 with
// inline scales), the rest are evicted.
//
// The byte budget of one kv head, for K and for V alike: `bytes` bytes, or
// (bytes = 0) `ratio` of the full-precision cache, ratio * T * Bf, where Bf
// = head_dim * sizeof(key element) is a full-precision token and
// Bq = Q.bytes_per_token(head_dim) a quantized one. Then
//
//   n_full = min(T, floor(full_share * budget / Bf))
//   n_low  = min(T - n_full, floor((budget - n_full * Bf) / Bq))
//
// so full_share = 1 is plain eviction at the same bytes and full_share = 0
// is eviction to what the quantized format can hold (evict -> quantize).
// When every token is kept (n_full + n_low = T) the spare bytes buy
// precision: n_full = the most tokens with n_full * Bf + (T - n_full) * Bq <=
// budget (so a budget that holds the whole cache keeps it in full precision).
// Tokens the scorer protects (+inf: SnapKV's window, sinks) rank first; equal
// scores rank by position, earlier first (deterministic on every backend).
//
// `decide` writes a KeepSet of the n_full + n_low kept tokens of each row
// (ascending positions, like every eviction) and, parallel to its indices,
// `full[i]` = 1 for a full-precision token, 0 for a quantized one. The caller
// compacts with the KeepSet and quantizes the rows flagged 0 with Q
// (examples/engine: mixed_precision_hooks). Nothing is written on error.
//
// The ranking is the backend's `rank_tiers` (one call for all kv heads). On a
// device backend (backend::Cuda) with a scorer that has a device path
// (SnapKV, Ada-KV's scoring, PyramidKV...), the score map lives in the device
// workspace, `keep.indices` and `full` are device memory, and
// `keep.indptr` stays a host array (it follows from the shapes). The host
// rejects a NaN score; the device does not read the scores back, and there a
// NaN ranks below every number.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>

#include "kvpolicy/policy/concepts.hpp"
#include "kvpolicy/policy/policy.hpp"

KVP_NAMESPACE_BEGIN

struct MixedPrecisionParams {
  double ratio = 0.25;      ///< byte budget as a fraction of the full-precision cache (used when bytes == 0)
  double bytes = 0.0;       ///< byte budget per kv head and role; > 0 overrides ratio
  double full_share = 0.5;  ///< share of the budget spent on full-precision tokens, in [0, 1]

  static constexpr auto fields() noexcept {
    return std::tuple{param_field<&MixedPrecisionParams::ratio>("ratio", "byte budget over the full-precision cache's bytes"),
                      param_field<&MixedPrecisionParams::bytes>("bytes", "byte budget per kv head (overrides ratio when > 0)"),
                      param_field<&MixedPrecisionParams::full_share>("full_share", "share of the budget kept in full precision")};
  }
};

/// Token counts of one row.
struct MixedSplit {
  std::int64_t full = 0, low = 0;
};

template <class S, class Q>
class MixedPrecision {
 public:
  using Params = MixedPrecisionParams;
  static constexpr const char* kName = "mixed_precision";

  MixedPrecision(const S& scorer, const Q& quant, const Params& p = {}) noexcept : scorer_(scorer), quant_(quant), params_(p) {}
  const Params& params() const noexcept { return params_; }
  const S& scorer() const noexcept { return scorer_; }
  const Q& quantizer() const noexcept { return quant_; }

  Status validate_params() const noexcept {
    KVP_RETURN_IF_ERROR(check_enum_fields(kName, params_));
    KVP_REQUIRE(std::isfinite(params_.ratio) && params_.ratio > 0.0 && params_.ratio <= 1.0,
                "mixed_precision: ratio is %g, must be in (0, 1]", params_.ratio);
    KVP_REQUIRE(std::isfinite(params_.bytes) && params_.bytes >= 0.0, "mixed_precision: bytes is %g, must be finite and >= 0",
                params_.bytes);
    KVP_REQUIRE(std::isfinite(params_.full_share) && params_.full_share >= 0.0 && params_.full_share <= 1.0,
                "mixed_precision: full_share is %g, must be in [0, 1]", params_.full_share);
    KVP_RETURN_IF_ERROR(scorer_.validate_params());
    return quant_.validate_params();
  }

  /// The tier sizes of a row of T tokens with keys of `elem_bytes` bytes per value.
  MixedSplit split(std::int64_t T, std::int64_t head_dim, std::size_t elem_bytes) const noexcept {
    const double bf = static_cast<double>(head_dim) * static_cast<double>(elem_bytes), bq = quant_.bytes_per_token(head_dim);
    const double budget = params_.bytes > 0.0 ? params_.bytes : params_.ratio * static_cast<double>(T) * bf;
    MixedSplit s;
    s.full = std::min<std::int64_t>(T, static_cast<std::int64_t>(std::floor(params_.full_share * budget / bf)));
    const double rest = budget - static_cast<double>(s.full) * bf;
    s.low = bq > 0.0 ? std::min<std::int64_t>(T - s.full, static_cast<std::int64_t>(std::floor(rest / bq))) : 0;
    if (s.full + s.low == T && bf > bq) {  // every token fits: spend the spare bytes on precision
      const double up = std::floor((budget - static_cast<double>(T) * bq) / (bf - bq));
      s.full = std::clamp<std::int64_t>(std::max<std::int64_t>(s.full, static_cast<std::int64_t>(up)), 0, T);
      s.low = T - s.full;
    }
    return s;
  }

  /// Workspace: the scorer's, the (kv_heads, T) score map and the backend's ranking (rank_tiers_workspace).
  template <class Backend>
  Requirements requirements(const Context<Backend>& ctx, const ProblemShape& shape) const noexcept {
    Requirements r = scorer_.requirements(ctx, shape);
    if (r.status.is_ok()) r.status = validate_params();
    if (!r.status.is_ok()) return Requirements{r.status};
    r.workspace_bytes = workspace_bytes<Backend>(r.workspace_bytes, shape.num_kv_heads, shape.max_kv_len);
    r.output = OutputSize{shape.num_kv_heads, shape.num_kv_heads * shape.max_kv_len};
    return r;
  }

  /// One sequence: `keep` rows = kv heads, `full` parallel to keep.indices (>= keep.capacity entries used).
  template <class Backend, class Tq, class Tk>
  Status decide(const Context<Backend>& cx, const ScoreInput<Tq, Tk>& in, KeepSet keep, std::span<std::uint8_t> full) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    ProblemShape shape;
    const std::span<const ScoreInput<Tq, Tk>> one(&in, 1);
    if constexpr (requires { scorer_.validate(one, &shape, true); })  // scorers with a device path check its memory rules
      KVP_RETURN_IF_ERROR(scorer_.validate(one, &shape, kDeviceBackend<Backend>));
    else
      KVP_RETURN_IF_ERROR(scorer_.validate(one, &shape));
    const std::int64_t H = in.keys.kv_heads(), T = in.keys.kv_len(), d = in.keys.head_dim();
    const MixedSplit sp = split(T, d, sizeof(Tk));
    const std::int64_t n = sp.full + sp.low;
    KVP_RETURN_IF_ERROR(keep.check_output(kName, H, H * n));
    KVP_REQUIRE(static_cast<std::int64_t>(full.size()) >= H * n && (n == 0 || full.data() != nullptr),
                "mixed_precision: full has %zu entries, needs %lld (one per kept token)", full.size(), static_cast<long long>(H * n));
    const std::size_t scorer_bytes = scorer_.requirements(cx, shape).workspace_bytes;
    KVP_REQUIRE(T < (std::int64_t{1} << 30), "mixed_precision: kv_len %lld must be < 2^30", static_cast<long long>(T));
    KVP_RETURN_IF_ERROR(check_workspace(kName, cx.workspace, workspace_bytes<Backend>(scorer_bytes, H, T)));
    WorkspaceCarver c(cx.workspace);
    std::byte* sws = c.take<std::byte>(scorer_bytes);
    float* scores = c.take<float>(static_cast<std::size_t>(H * std::max<std::int64_t>(T, 1)));
    const std::size_t rank_bytes = Backend::rank_tiers_workspace(std::max<std::int64_t>(T, 1));
    std::byte* rws = c.take<std::byte>(rank_bytes);
    const detail::BackendCall<Backend> call(cx);
    KVP_RETURN_IF_ERROR(call.begin());
    KVP_RETURN_IF_ERROR(
        scorer_.score(cx.with_workspace(Workspace{sws, scorer_bytes}), in, TensorView<float, 2>::contiguous(scores, {H, T})));
    if constexpr (!kDeviceBackend<Backend>) {  // a device's scores are not read back: there a NaN ranks last
      for (std::int64_t h = 0; h < H; ++h) {
        const float* s = scores + h * T;
        for (std::int64_t j = 0; j < T; ++j)
          KVP_REQUIRE(!std::isnan(s[j]), "mixed_precision: the scorer gave head %lld token %lld a NaN score; nothing was written",
                      static_cast<long long>(h), static_cast<long long>(j));
      }
    }
    // Rank: higher score first, then the earlier position; the n best kept in ascending positions, the
    // n_full best of them flagged full precision.
    Backend::rank_tiers(scores, H, T, T, n, sp.full, keep.indices, full.data(), n, Workspace{rws, rank_bytes});
    for (std::int64_t h = 0; h <= H; ++h) keep.indptr[h] = static_cast<std::int32_t>(h * n);  // host offsets: they follow from the shapes
    return call.end();
  }

 private:
  template <class Backend>
  static std::size_t workspace_bytes(std::size_t scorer_bytes, std::int64_t H, std::int64_t T) noexcept {
    const std::size_t t = static_cast<std::size_t>(std::max<std::int64_t>(T, 1));
    return kWorkspaceAlign + align_up(scorer_bytes) + align_up(static_cast<std::size_t>(H) * t * sizeof(float)) +
           align_up(Backend::rank_tiers_workspace(static_cast<std::int64_t>(t)));
  }

  S scorer_;
  Q quant_;
  Params params_{};
};

KVP_NAMESPACE_END
