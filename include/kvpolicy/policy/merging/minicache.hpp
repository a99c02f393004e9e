// SPDX-License-Identifier: Apache-2.0
// MiniCache — "MiniCache: KV Cache Compression in Depth Dimension for Large
// Language Models" (Liu et al., NeurIPS 2024, arXiv 2405.14366): merge the
// cache of two adjacent layers (l-1, l) across depth.
//
// Algorithm (per kv head and token j, keys and values alike, `merge`):
//   u = x^{l-1} / |x^{l-1}|,  w = x^l / |x^l|,  Omega = arccos(u . w)
//   e = sin((1-t) Omega) / sin Omega * u + sin(t Omega) / sin Omega * w     SLERP of the directions
//       (normalised lerp when sin Omega < kLerpBelow = 1e-3: nearly parallel or opposite), then e / |e|
//   store e once, and both magnitudes |x^{l-1}|, |x^l|                     norms kept
//   d_j = Omega / pi;  retain j unmerged iff d_j > d_min + gamma (d_max - d_min)   token retention
//       (d_min, d_max over the head's tokens); retained pairs store both original rows.
// Restore (`restore`): x^_x = |x^x| e, then the retained rows overwritten with
// the originals.
//
// Memory per (token, kv head) of the pair: d + 2 floats instead of 2 d, plus
// 2 d per retained token (`bytes_per_token`).
//
// Choices:
//  * Defaults t = 0.6 and gamma = 0.05 follow the reference notes, which mark
//    the paper's exact values as unverified; both are parameters.
//  * Which layers to pair (the paper starts at half depth) is the caller's
//    choice: this policy merges one given pair.
//  * A zero vector has no direction: it takes the other layer's direction
//    (restored with its own zero norm, it stays zero); two zero vectors give e = 0,
//    and so does an exactly antipodal pair at t = 0.5 (its lerp cancels).
//  * Bug fixed (found by the cross-check against the paper's formulas in
//    float64, tests/data/fixtures/merge_original.json): the fallback used to be
//    sin Omega < 1e-6, which fp32 never reaches unless the rounded cosine is
//    exactly +-1 (acos(-1 + 2^-24) already gives sin Omega ~ 3.5e-4), and the
//    SLERP result was not renormalised: an exactly antipodal pair then got
//    e = cos(t pi) u, of length |cos(t pi)| (restored norms shrunk by up to
//    100%). Now the fallback is sin Omega < 1e-3 (where the fp32 cosine cannot
//    resolve the angle; for near-parallel pairs SLERP and normalised lerp differ
//    by O(Omega^3) there) and e is renormalised in both branches, so an
//    antipodal pair gets sign(1 - 2t) u, the float64 formula's normalised lerp.
//    Same cross-check: the threshold is computed as (1 - gamma) d_min + gamma d_max,
//    since d_min + gamma (d_max - d_min) can round below d_max at gamma = 1 and
//    retained the most distant token, against the rule.
//  * Reference: no code by the authors is public (AkideLiu/MiniCache is a
//    project page); the fixtures transcribe the formulas above in float64.
//  * Not a `MergePolicy`: that concept folds tokens into tokens of one layer
//    (a KeepSet and a MergePlan); MiniCache folds two layers into one shared
//    store and has its own output, `MiniCacheMerged`.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kvpolicy/ops/minicache_steps.hpp"
#include "kvpolicy/policy/merging/merge_common.hpp"

KVP_NAMESPACE_BEGIN

struct MiniCacheParams {
  float t = 0.6f;       ///< SLERP interpolation parameter in [0, 1] (0: layer l-1's direction, 1: layer l's)
  float gamma = 0.05f;  ///< retention threshold in [0, 1] of the angular-distance range

  static constexpr auto fields() noexcept {
    return std::tuple{param_field<&MiniCacheParams::t>("t", "SLERP interpolation parameter"),
                      param_field<&MiniCacheParams::gamma>("gamma", "token retention threshold")};
  }
};

/// One half (keys or values) of two adjacent layers of one sequence.
template <class Tk>
struct MiniCacheInput {
  KVSource<Tk> prev{};  ///< layer l-1 (num_kv_heads, T, head_dim)
  KVSource<Tk> cur{};   ///< layer l   (num_kv_heads, T, head_dim)
};

/// The merged store of a layer pair.
struct MiniCacheMerged {
  TensorView<float, 3> direction{};      ///< (num_kv_heads, T, head_dim) unit SLERP directions
  TensorView<float, 2> norm_prev{};      ///< (num_kv_heads, T)
  TensorView<float, 2> norm_cur{};       ///< (num_kv_heads, T)
  KeepSet retained{};                    ///< num_kv_heads rows of retained token ids, ascending
  TensorView<float, 2> retained_prev{};  ///< (retained capacity, head_dim): layer l-1's rows, in `retained` order
  TensorView<float, 2> retained_cur{};   ///< (retained capacity, head_dim): layer l's rows
};

class MiniCache {
 public:
  using Params = MiniCacheParams;
  static constexpr const char* kName = "minicache";
  /// sin Omega below which the SLERP falls back to the normalised lerp (fp32: see the header comment).
  static constexpr float kLerpBelow = ops::kMiniCacheLerpBelow;

  constexpr MiniCache() noexcept = default;
  explicit constexpr MiniCache(const Params& p) noexcept : params_(p) {}
  constexpr const Params& params() const noexcept { return params_; }

  Status validate_params() const noexcept {
    KVP_RETURN_IF_ERROR(check_enum_fields(kName, params_));
    KVP_REQUIRE(params_.t >= 0.0f && params_.t <= 1.0f, "minicache: t is %g, must be in [0, 1]", static_cast<double>(params_.t));
    KVP_REQUIRE(params_.gamma >= 0.0f && params_.gamma <= 1.0f, "minicache: gamma is %g, must be in [0, 1]",
                static_cast<double>(params_.gamma));
    return Status::ok();
  }

  /// Workspace: the angular distances of every head; output rows = kv heads,
  /// capacity = every token retained (the worst case).
  template <class Backend>
  Requirements requirements(const Context<Backend>&, const ProblemShape& s) const noexcept {
    std::size_t ws = 0;
    if constexpr (kDeviceBackend<Backend>)
      ws = Backend::minicache_workspace(s.max_kv_len, s.head_dim);
    else
      ws = workspace(s.num_kv_heads, s.max_kv_len, s.head_dim).total();
    return detail::merge_requirements(kName, validate_params(), s, ws, 1);
  }

  /// Bytes per (token, kv head) of the pair, fp32 store, for a retained fraction `f`.
  static double bytes_per_token(std::int64_t head_dim, double retained_fraction) noexcept {
    return 4.0 * (static_cast<double>(head_dim) + 2.0) + retained_fraction * 8.0 * static_cast<double>(head_dim);
  }

  ///
  /// On a device backend (every view tagged kCUDA, `retained.indptr` and
  /// `retained.indices` device memory) each kv head is one
  /// `Backend::minicache_head` (norms, directions and distances per token,
  /// then the head's threshold and its retained ids and rows compacted after
  /// the previous head's, `retained.indptr[h + 1]` written on the device);
  /// nothing is read back, so the retained capacity and the retained row
  /// buffers must hold the worst case, num_kv_heads x T (the requirements'
  /// output capacity), and direction / retained rows must be contiguous along
  /// head_dim. The device's acosf / sinf are CUDA's (glibc's on the host):
  /// norms are bit-identical, distances and directions within a few ulp, and
  /// a token whose distance lies within that of its head's threshold may be
  /// retained on one side only.
  template <class Backend, class Tk>
  Status merge(const Context<Backend>& cx, const MiniCacheInput<Tk>& in, MiniCacheMerged out) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    if constexpr (kDeviceBackend<Backend>)
      return merge_device(cx, in, out);
    else
      return merge_host(cx, in, out);
  }

 private:
  template <class Backend, class Tk>
  Status merge_host(const Context<Backend>& cx, const MiniCacheInput<Tk>& in, MiniCacheMerged& out) const noexcept {
    std::int64_t H = -1, T = 0, d = 0;
    KVP_RETURN_IF_ERROR(detail::check_merge_source(kName, in.prev, "prev", &H, &T, &d));
    KVP_RETURN_IF_ERROR(detail::check_merge_source(kName, in.cur, "cur", &H, &T, &d));
    KVP_RETURN_IF_ERROR(check_store(out, H, T, d));
    KVP_RETURN_IF_ERROR(out.retained.check_output(kName, H, 0));
    KVP_RETURN_IF_ERROR(check_workspace(kName, cx.workspace, workspace(H, T, d).total()));
    WorkspaceCarver c(cx.workspace);
    float* dist = c.take<float>(static_cast<std::size_t>(std::max<std::int64_t>(H * T, 1)));
    float* u = c.take<float>(static_cast<std::size_t>(d));
    float* w = c.take<float>(static_cast<std::size_t>(d));
    // Pass 1: distances and the retained count (checked against the capacity before any write).
    std::int64_t total = 0;
    for (std::int64_t h = 0; h < H; ++h) total += distances<Backend>(in, h, T, d, dist + h * T, u, w);
    KVP_REQUIRE(total <= out.retained.capacity && total <= INT32_MAX, "minicache: %lld tokens retained, retained capacity is %lld",
                static_cast<long long>(total), static_cast<long long>(out.retained.capacity));
    KVP_REQUIRE(
        total == 0 || (out.retained.indices != nullptr && out.retained_prev.extent(0) >= total && out.retained_cur.extent(0) >= total),
        "minicache: %lld tokens retained, retained_prev / retained_cur hold %lld / %lld rows", static_cast<long long>(total),
        static_cast<long long>(out.retained_prev.extent(0)), static_cast<long long>(out.retained_cur.extent(0)));
    // Pass 2: write.
    std::int64_t pos = 0;
    out.retained.indptr[0] = 0;
    for (std::int64_t h = 0; h < H; ++h) {
      const float* dh = dist + h * T;
      const float thr = threshold(dh, T);
      const Rows<Tk> P = in.prev.rows(h), Q = in.cur.rows(h);
      for (std::int64_t j = 0; j < T; ++j) {
        const float np = detail::load_row<Backend>(P, j, d, u, 0.0f), nq = detail::load_row<Backend>(Q, j, d, w, 0.0f);
        out.norm_prev(h, j) = np;
        out.norm_cur(h, j) = nq;
        if (dh[j] > thr) {
          out.retained.indices[pos] = static_cast<std::int32_t>(j);
          std::copy(u, u + d, &out.retained_prev(pos, 0));
          std::copy(w, w + d, &out.retained_cur(pos, 0));
          ++pos;
        }
        ops::minicache_slerp(params_.t, u, np, w, nq, d, &out.direction(h, j, 0));
      }
      out.retained.indptr[h + 1] = static_cast<std::int32_t>(pos);
    }
    return Status::ok();
  }

 public:
  /// Rebuild layer l-1 (`layer` = 0) or l (`layer` = 1): out (H, T, d) = norm x direction,
  /// retained rows overwritten with the originals.
  template <class T>
  Status restore(const MiniCacheMerged& m, int layer, TensorView<T, 3> out) const noexcept {
    KVP_REQUIRE(layer == 0 || layer == 1, "minicache: layer is %d, must be 0 (l-1) or 1 (l)", layer);
    KVP_RETURN_IF_ERROR(out.check_basic(kName, "out"));
    const std::int64_t H = out.extent(0), L = out.extent(1), d = out.extent(2);
    KVP_RETURN_IF_ERROR(check_store(m, H, L, d));
    const auto& norms = layer == 0 ? m.norm_prev : m.norm_cur;
    const auto& rows = layer == 0 ? m.retained_prev : m.retained_cur;
    KVP_REQUIRE(m.retained.indptr != nullptr && m.retained.num_rows == H, "minicache: retained has %lld rows, expected %lld",
                static_cast<long long>(m.retained.num_rows), static_cast<long long>(H));
    for (std::int64_t h = 0; h < H; ++h) KVP_RETURN_IF_ERROR(detail::check_keep_row(kName, m.retained, h, L));
    KVP_REQUIRE(rows.extent(0) >= m.retained.indptr[H] && rows.extent(1) == d,
                "minicache: retained rows (%lld, %lld) cannot hold %d rows of %lld", static_cast<long long>(rows.extent(0)),
                static_cast<long long>(rows.extent(1)), m.retained.indptr[H], static_cast<long long>(d));
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t j = 0; j < L; ++j)
        for (std::int64_t c = 0; c < d; ++c) out(h, j, c) = from_float<T>(norms(h, j) * m.direction(h, j, c));
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int32_t i = m.retained.indptr[h]; i < m.retained.indptr[h + 1]; ++i)
        for (std::int64_t c = 0; c < d; ++c) out(h, m.retained.indices[i], c) = from_float<T>(rows(i, c));
    return Status::ok();
  }

 private:
  template <class Backend, class Tk>
  Status merge_device(const Context<Backend>& cx, const MiniCacheInput<Tk>& in, MiniCacheMerged& out) const noexcept {
    std::int64_t H = -1, T = 0, d = 0;
    KVP_RETURN_IF_ERROR(detail::check_merge_source(kName, in.prev, "prev", &H, &T, &d, /*on_device=*/true));
    KVP_RETURN_IF_ERROR(detail::check_merge_source(kName, in.cur, "cur", &H, &T, &d, /*on_device=*/true));
    KVP_RETURN_IF_ERROR(check_store(out, H, T, d));
    const bool host_view[] = {out.direction.device().is_host(), out.norm_prev.device().is_host(), out.norm_cur.device().is_host(),
                              out.retained_prev.device().is_host(), out.retained_cur.device().is_host()};
    const char* names[] = {"direction", "norm_prev", "norm_cur", "retained_prev", "retained_cur"};
    for (int i = 0; i < 5; ++i)
      KVP_REQUIRE(!host_view[i], "minicache: %s is a host tensor; a device backend writes device memory (tag the view kCUDA)", names[i]);
    KVP_REQUIRE((out.direction.stride(2) == 1 || d == 1) && (out.retained_prev.stride(1) == 1 || d == 1) &&
                    (out.retained_cur.stride(1) == 1 || d == 1),
                "minicache: direction and the retained rows must be contiguous along head_dim on a device");
    const std::int64_t worst = H * T;
    KVP_RETURN_IF_ERROR(out.retained.check_output(kName, H, worst));
    KVP_REQUIRE(
        out.retained_prev.extent(0) >= worst && out.retained_cur.extent(0) >= worst,
        "minicache: retained_prev / retained_cur hold %lld / %lld rows; on a device they must hold the worst case, num_kv_heads x T "
        "= %lld",
        static_cast<long long>(out.retained_prev.extent(0)), static_cast<long long>(out.retained_cur.extent(0)),
        static_cast<long long>(worst));
    KVP_RETURN_IF_ERROR(check_workspace(kName, cx.workspace, Backend::minicache_workspace(T, d)));
    const detail::BackendCall<Backend> call(cx);
    KVP_RETURN_IF_ERROR(call.begin());
    for (std::int64_t h = 0; h < H; ++h)
      Backend::minicache_head(params_.t, params_.gamma, in.prev.rows(h), in.cur.rows(h), T, d, h, T > 0 ? &out.norm_prev(h, 0) : nullptr,
                              T > 0 ? &out.norm_cur(h, 0) : nullptr, out.norm_prev.stride(1), out.norm_cur.stride(1),
                              T > 0 ? &out.direction(h, 0, 0) : nullptr, out.direction.stride(1), out.retained.indptr, out.retained.indices,
                              out.retained_prev.data(), out.retained_prev.stride(0), out.retained_cur.data(), out.retained_cur.stride(0),
                              cx.workspace);
    return call.end();
  }

  static WorkspacePlan workspace(std::int64_t H, std::int64_t T, std::int64_t d) noexcept {
    const auto dd = static_cast<std::size_t>(std::max<std::int64_t>(d, 1));
    return WorkspacePlan{}.add<float>(static_cast<std::size_t>(std::max<std::int64_t>(H * T, 1))).add<float>(dd).add<float>(dd);
  }

  static Status check_store(const MiniCacheMerged& m, std::int64_t H, std::int64_t T, std::int64_t d) noexcept {
    KVP_RETURN_IF_ERROR(m.direction.check_basic(kName, "direction"));
    KVP_RETURN_IF_ERROR(m.norm_prev.check_basic(kName, "norm_prev"));
    KVP_RETURN_IF_ERROR(m.norm_cur.check_basic(kName, "norm_cur"));
    KVP_RETURN_IF_ERROR(m.retained_prev.check_basic(kName, "retained_prev"));
    KVP_RETURN_IF_ERROR(m.retained_cur.check_basic(kName, "retained_cur"));
    KVP_REQUIRE(m.direction.extent(0) == H && m.direction.extent(1) == T && m.direction.extent(2) == d,
                "minicache: direction has shape (%lld, %lld, %lld), expected (%lld, %lld, %lld)",
                static_cast<long long>(m.direction.extent(0)), static_cast<long long>(m.direction.extent(1)),
                static_cast<long long>(m.direction.extent(2)), static_cast<long long>(H), static_cast<long long>(T),
                static_cast<long long>(d));
    KVP_REQUIRE(m.norm_prev.extent(0) == H && m.norm_prev.extent(1) == T && m.norm_cur.extent(0) == H && m.norm_cur.extent(1) == T,
                "minicache: norm_prev / norm_cur must be (num_kv_heads=%lld, T=%lld)", static_cast<long long>(H),
                static_cast<long long>(T));
    KVP_REQUIRE(m.retained_prev.extent(1) == d && m.retained_cur.extent(1) == d, "minicache: retained rows must have head_dim=%lld columns",
                static_cast<long long>(d));
    return Status::ok();
  }

  /// dist[j] = Omega_j / pi for kv head h; returns the number of retained tokens.
  template <class Backend, class Tk>
  std::int64_t distances(const MiniCacheInput<Tk>& in, std::int64_t h, std::int64_t T, std::int64_t d, float* dist, float* u,
                         float* w) const noexcept {
    const Rows<Tk> P = in.prev.rows(h), Q = in.cur.rows(h);
    for (std::int64_t j = 0; j < T; ++j) {
      const float np = detail::load_row<Backend>(P, j, d, u, 0.0f), nq = detail::load_row<Backend>(Q, j, d, w, 0.0f);
      dist[j] = ops::minicache_distance(u, np, w, nq, d);
    }
    const float thr = threshold(dist, T);
    std::int64_t n = 0;
    for (std::int64_t j = 0; j < T; ++j) n += dist[j] > thr;
    return n;
  }

  float threshold(const float* dist, std::int64_t T) const noexcept {
    if (T == 0) return 0.0f;
    const auto [lo, hi] = std::minmax_element(dist, dist + T);
    // (1 - gamma) lo + gamma hi: exactly lo at gamma = 0 and exactly hi at gamma = 1 (lo + gamma (hi - lo) can
    // round below hi). gamma == 1 or a flat distribution retains nothing (strictly above the max).
    return ops::minicache_threshold(*lo, *hi, params_.gamma);
  }

  Params params_{};
};

KVP_NAMESPACE_END
