// SPDX-License-Identifier: Apache-2.0
// `backend::ScalarMergeOps`: the nearest-kept linear merge of one kv head,
// the op the token-merging policies (kvpress MergingPress, LOOK-M, the
// nearest-kept weighted merge) run on a device backend, and the row kernels
// their host paths share (detail::): the cosine search of every evicted token
// for its most similar kept token, and the linear merge writer.
//
// The linear merge. For a kept slot c that received evicted tokens E_c,
//     X'[c] = (self_c * X[c] + sum_{e in E_c} beta_e * X[e]) * scale_c
// with `beta` the evicted token's raw weight and (self_c, scale_c) from the
// slot's totals; a `MergeRule` names which formula each one follows. Sums run
// in fp32 over evicted tokens in ascending token order, products and sums
// each rounded on their own (no contraction), so every backend that follows
// the order here gives the same bits.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <span>

#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/rows.hpp"
#include "kvpolicy/core/tensor_view.hpp"
#include "kvpolicy/core/workspace.hpp"
#include "kvpolicy/ops/cam_steps.hpp"
#include "kvpolicy/ops/minicache_steps.hpp"
#include "kvpolicy/ops/order_key.hpp"
#include "kvpolicy/ops/reduce_scalar.hpp"

KVP_NAMESPACE_BEGIN

/// beta_e, the raw weight of evicted token e in its slot's merge.
enum class MergeBeta : std::uint8_t {
  kConstant,     ///< rule.beta_value (LOOK-M: 1/2)
  kValueNorms,   ///< max(s_e, 0) |V_e| / (|V_e| + |V_c| + rule.value_eps), norms in fp64 (kvpress MergingPress)
  kStateWeight,  ///< w[e], times max(s_e, 0) when rule.scale_by_similarity (NearestKeptMerge)
  kSimilarity,   ///< s_e itself, any sign, and merged whatever its sign (D2O, as coded)
};
/// self_c, the kept token's own coefficient.
enum class MergeSelf : std::uint8_t {
  kOne,               ///< 1 (kvpress MergingPress)
  kOnePlusHalfCount,  ///< 1 + n_c / 2 (LOOK-M's pivot average)
  kStateWeight,       ///< w[c] (NearestKeptMerge)
};
/// scale_c = 1 / (this).
enum class MergeNorm : std::uint8_t {
  kOnePlusSum,    ///< 1 + sum_{e->c} beta_e
  kOnePlusCount,  ///< 1 + n_c
  kSelfPlusSum,   ///< w[c] + sum_{e->c} beta_e
};

/// How one nearest-kept merge weighs its tokens. Steps, per kv head:
///   1. (s_e, c_e): the kept slot whose key has the largest cosine with K[e]
///      (norms clamped at `eps`; ties: the earliest kept token; a NaN never wins).
///   2. e is merged iff s_e >= threshold; with fraction < 1, also iff s_e >=
///      the (1 - fraction)-quantile of (merged ? s : -inf) over the row's
///      evicted tokens (torch.quantile's linear interpolation, in fp32).
///   3. beta_e by `beta`; e is merged iff beta_e > 0 (kSimilarity: always).
///   4. the linear merge with self_c, scale_c; with kStateWeight, the state is
///      re-packed in kept order: w[c] <- w[kept[c]] + sum_{e->c} beta_e.
struct MergeRule {
  float eps = 1e-8f;
  float threshold = -std::numeric_limits<float>::infinity();
  float fraction = 1.0f;
  MergeBeta beta = MergeBeta::kConstant;
  float beta_value = 0.5f;
  float value_eps = 1e-6f;
  bool scale_by_similarity = false;
  MergeSelf self = MergeSelf::kOne;
  MergeNorm norm = MergeNorm::kOnePlusSum;
  KVP_HOST_DEVICE bool uses_state() const noexcept {
    return beta == MergeBeta::kStateWeight || self == MergeSelf::kStateWeight || norm == MergeNorm::kSelfPlusSum;
  }
};

/// D2O's caller-owned EMA threshold of one (layer, sequence): host memory on
/// host backends, device memory (read and written by `d2o_decide`) on device
/// backends.
struct D2OState {
  float tau = 0.0f;
  bool initialised = false;
};

namespace detail {

/// Evicted token ids of a keep row: the ascending complement in [0, T).
inline std::int64_t evicted_of(std::span<const std::int32_t> kept, std::int64_t T, std::int32_t* out) noexcept {
  std::int64_t n = 0;
  std::size_t k = 0;
  for (std::int64_t j = 0; j < T; ++j) {
    if (k < kept.size() && kept[k] == j) {
      ++k;
      continue;
    }
    out[n++] = static_cast<std::int32_t>(j);
  }
  return n;
}

/// 8-way fp32 dot product (a fixed summation order, identical on every backend).
inline float dot(const float* a, const float* b, std::int64_t d) noexcept {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    for (int k = 0; k < 8; ++k) acc[k] += a[i + k] * b[i + k];
  for (; i < d; ++i) acc[i % 8] += a[i] * b[i];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

/// Row j of `rows` widened to fp32 (and optionally divided by max(norm, eps)); returns the norm.
/// (`Backend::widen_row`: exact on every backend, F16C for fp16 on the CPU backend.)
template <class Backend, class T>
float load_row(const Rows<T>& rows, std::int64_t j, std::int64_t d, float* out, float normalise_eps) noexcept {
  Backend::widen_row(rows.row(j), d, out);
  float ss = 0.0f;  // fp32 like kvpress's norms, in row_dots' fixed order (identical on every backend)
  Backend::row_dots(out, out, 1, d, &ss);
  const float n = std::sqrt(ss);
  if (normalise_eps > 0.0f) {
    const float inv = 1.0f / std::max(n, normalise_eps);
    for (std::int64_t c = 0; c < d; ++c) out[c] *= inv;
  }
  return n;
}

/// Workspace of `nearest_kept` + `linear_merge` for one row of at most T tokens.
inline WorkspacePlan nearest_workspace(std::int64_t T, std::int64_t d) noexcept {
  const auto t = static_cast<std::size_t>(std::max<std::int64_t>(T, 1)), dd = static_cast<std::size_t>(std::max<std::int64_t>(d, 1));
  WorkspacePlan p;
  p.add<float>(t * dd);    // normalised kept keys
  p.add<float>(dd);        // one evicted key
  p.add<std::int32_t>(t);  // evicted ids
  p.add<std::int32_t>(t);  // target slot per evicted token (-1: not merged)
  p.add<float>(t);         // similarity
  p.add<float>(t);         // beta
  p.add<float>(t);         // per-slot sum of beta
  p.add<std::int32_t>(t);  // per-slot count
  p.add<float>(t);         // per-slot scale
  p.add<float>(dd);        // one widened row
  p.add<float>(t);         // the dots of one kept key with every evicted key
  return p;
}

/// Scratch of one row's nearest-kept merge, carved from a workspace.
struct NearestScratch {
  float* kept_keys = nullptr;
  float* key = nullptr;
  std::int32_t* evicted = nullptr;
  std::int32_t* target = nullptr;
  float* sim = nullptr;
  float* beta = nullptr;
  float* slot_sum = nullptr;
  std::int32_t* slot_count = nullptr;
  float* slot_scale = nullptr;
  float* row = nullptr;
  float* dots = nullptr;
  std::int64_t num_evicted = 0;

  NearestScratch(Workspace ws, std::int64_t T, std::int64_t d) noexcept {
    const auto t = static_cast<std::size_t>(std::max<std::int64_t>(T, 1)), dd = static_cast<std::size_t>(std::max<std::int64_t>(d, 1));
    WorkspaceCarver c(ws);
    kept_keys = c.take<float>(t * dd);
    key = c.take<float>(dd);
    evicted = c.take<std::int32_t>(t);
    target = c.take<std::int32_t>(t);
    sim = c.take<float>(t);
    beta = c.take<float>(t);
    slot_sum = c.take<float>(t);
    slot_count = c.take<std::int32_t>(t);
    slot_scale = c.take<float>(t);
    row = c.take<float>(dd);
    dots = c.take<float>(t);
  }
};

/// For every evicted token e of the row: the kept slot c with the largest
/// cosine similarity cos(K[e], K[kept[c]]) (ties: the smallest slot, i.e. the
/// earliest kept token), and that similarity. Keys are divided by
/// max(norm, eps) before the dot product (kvpress: eps 1e-6; torch
/// cosine_similarity: 1e-8). A NaN similarity never wins; a row whose
/// similarities are all NaN gets target -1.
/// Order of work: the evicted keys are normalised once into the scratch
/// (E x d, cache-resident for decode-size E), then every kept key is read
/// once, normalised, and dotted with all of them (`Backend::row_dots`: the CPU
/// backend's SIMD kernel, bit-identical to the scalar reference), so the cache
/// is streamed once whatever E is.
template <class Backend, class Tk>
void nearest_kept(const Rows<Tk>& keys, std::span<const std::int32_t> kept, std::int64_t T, std::int64_t d, float eps,
                  NearestScratch& s) noexcept {
  const auto C = static_cast<std::int64_t>(kept.size());
  s.num_evicted = evicted_of(kept, T, s.evicted);
  const std::int64_t E = s.num_evicted;
  float* ev = s.kept_keys;  // (E, d) normalised evicted keys
  for (std::int64_t i = 0; i < E; ++i) {
    load_row<Backend>(keys, s.evicted[i], d, ev + i * d, eps);
    s.target[i] = -1;
    s.sim[i] = std::numeric_limits<float>::quiet_NaN();
  }
  for (std::int64_t c = 0; c < C && E > 0; ++c) {
    load_row<Backend>(keys, kept[static_cast<std::size_t>(c)], d, s.key, eps);
    Backend::row_dots(s.key, ev, E, d, s.dots);
    for (std::int64_t i = 0; i < E; ++i) {
      const float v = s.dots[i];
      if (v == v && (s.target[i] < 0 || v > s.sim[i])) {
        s.sim[i] = v;
        s.target[i] = static_cast<std::int32_t>(c);
      }
    }
  }
}

/// Per-slot totals of the evicted tokens merged into it (target >= 0).
inline void slot_totals(const NearestScratch& s, std::int64_t C, float* sum, std::int32_t* count) noexcept {
  std::fill(sum, sum + C, 0.0f);
  std::fill(count, count + C, 0);
  for (std::int64_t i = 0; i < s.num_evicted; ++i)
    if (s.target[i] >= 0) {
      sum[s.target[i]] += s.beta[i];
      ++count[s.target[i]];
    }
}

/// X'[c] = (self_c * X[kept[c]] + sum_{e -> c} beta_e X[e]) * scale_c for every
/// slot with count > 0, into row c of `merged` (row stride `ld` floats); `self_of(c)` gives self_c;
/// `s.slot_scale[c]` must hold scale_c.
template <class T, class SelfFn>
void linear_merge(const Rows<T>& X, std::span<const std::int32_t> kept, std::int64_t d, const NearestScratch& s, const std::int32_t* count,
                  SelfFn&& self_of, float* merged, std::int64_t ld) noexcept {
  const auto C = static_cast<std::int64_t>(kept.size());
  for (std::int64_t c = 0; c < C; ++c) {
    if (count[c] == 0) continue;
    float* out = merged + c * ld;
    std::fill(out, out + d, 0.0f);
  }
  for (std::int64_t i = 0; i < s.num_evicted; ++i) {
    if (s.target[i] < 0) continue;
    float* out = merged + static_cast<std::int64_t>(s.target[i]) * ld;
    const T* x = X.row(s.evicted[i]);
    const float b = s.beta[i];
    for (std::int64_t k = 0; k < d; ++k) out[k] += b * to_float(x[k]);
  }
  for (std::int64_t c = 0; c < C; ++c) {
    if (count[c] == 0) continue;
    float* out = merged + c * ld;
    const T* x = X.row(kept[static_cast<std::size_t>(c)]);
    const float a = self_of(c), sc = s.slot_scale[c];
    for (std::int64_t k = 0; k < d; ++k) out[k] = (a * to_float(x[k]) + out[k]) * sc;
  }
}

/// torch.quantile(x, 1 - fraction) of x = (target >= 0 ? sim : -inf) over
/// the row's E >= 1 evicted tokens, in torch's float32 arithmetic (sort, rank,
/// lerp); `sorted` holds E floats.
inline float merge_quantile(const NearestScratch& s, std::int64_t E, float fraction, float* sorted) noexcept {
  for (std::int64_t i = 0; i < E; ++i) sorted[i] = s.target[i] >= 0 ? s.sim[i] : -std::numeric_limits<float>::infinity();
  std::sort(sorted, sorted + E);
  const auto q = static_cast<float>(1.0 - static_cast<double>(fraction));
  const float rank = q * static_cast<float>(E - 1);
  const auto below = static_cast<std::int64_t>(rank), above = static_cast<std::int64_t>(std::ceil(rank));
  const float w = rank - static_cast<float>(below), a = sorted[below], b = sorted[above];
  return w < 0.5f ? a + w * (b - a) : b - (b - a) * (1.0f - w);
}

/// Steps 2-4 of `MergeRule` for one kv head after `nearest_kept` filled `s`:
/// gates, beta, slot totals and scales (in `s`), merged rows (row c of
/// `merged_keys` / `merged_values`, row strides `kld` / `vld`; null: not written) and the
/// state re-pack (`w`: the head's masses by slot, read and written only when
/// the rule uses them). `sorted` holds T floats. `Reduce::row_norm` gives the
/// value norms (fp64 sums, identical on every backend).
template <class Reduce, class Tk>
void apply_merge_rule(const MergeRule& rule, const Rows<Tk>& K, const Rows<Tk>& V, std::span<const std::int32_t> kept, std::int64_t d,
                      float* w, NearestScratch& s, float* sorted, float* merged_keys, std::int64_t kld, float* merged_values,
                      std::int64_t vld) noexcept {
  const auto C = static_cast<std::int64_t>(kept.size());
  const std::int64_t E = s.num_evicted;
  for (std::int64_t i = 0; i < E; ++i)
    if (!(s.sim[i] >= rule.threshold)) s.target[i] = -1;
  if (rule.fraction < 1.0f && E > 0) {
    const float q = merge_quantile(s, E, rule.fraction, sorted);
    for (std::int64_t i = 0; i < E; ++i)
      if (s.target[i] >= 0 && !(s.sim[i] >= q)) s.target[i] = -1;
  }
  for (std::int64_t i = 0; i < E; ++i) {
    if (s.target[i] < 0) continue;
    const float sp = std::max(s.sim[i], 0.0f);
    float b = rule.beta_value;
    if (rule.beta == MergeBeta::kValueNorms) {
      const float en = Reduce::row_norm(V.row(s.evicted[i]), d),
                  tn = Reduce::row_norm(V.row(kept[static_cast<std::size_t>(s.target[i])]), d);
      b = sp * en / (en + tn + rule.value_eps);
    } else if (rule.beta == MergeBeta::kStateWeight) {
      b = w[s.evicted[i]] * (rule.scale_by_similarity ? sp : 1.0f);
    } else if (rule.beta == MergeBeta::kSimilarity) {
      b = s.sim[i];
    }
    s.beta[i] = b;
    if (rule.beta != MergeBeta::kSimilarity && !(b > 0.0f)) s.target[i] = -1;
  }
  slot_totals(s, C, s.slot_sum, s.slot_count);
  auto self_of = [&](std::int64_t c) {
    switch (rule.self) {
      case MergeSelf::kOnePlusHalfCount: return 1.0f + 0.5f * static_cast<float>(s.slot_count[c]);
      case MergeSelf::kStateWeight: return w[kept[static_cast<std::size_t>(c)]];
      default: return 1.0f;
    }
  };
  for (std::int64_t c = 0; c < C; ++c) {
    const float den = rule.norm == MergeNorm::kOnePlusCount  ? 1.0f + static_cast<float>(s.slot_count[c])
                      : rule.norm == MergeNorm::kSelfPlusSum ? w[kept[static_cast<std::size_t>(c)]] + s.slot_sum[c]
                                                             : 1.0f + s.slot_sum[c];
    s.slot_scale[c] = 1.0f / den;
  }
  if (merged_keys != nullptr) linear_merge(K, kept, d, s, s.slot_count, self_of, merged_keys, kld);
  if (merged_values != nullptr) linear_merge(V, kept, d, s, s.slot_count, self_of, merged_values, vld);
  if (rule.uses_state())
    for (std::int64_t c = 0; c < C; ++c)  // kept[c] >= c: a forward sweep reads before it writes
      w[c] = w[kept[static_cast<std::size_t>(c)]] + s.slot_sum[c];
}

/// The scratch of one head's merge: `nearest_kept`'s arrays and T floats for
/// the quantile's sort, carved from `head_scratch_plan(T, d)` bytes.
inline WorkspacePlan head_scratch_plan(std::int64_t T, std::int64_t d) noexcept {
  return WorkspacePlan{}.add_bytes(nearest_workspace(T, d).bytes).add<float>(static_cast<std::size_t>(std::max<std::int64_t>(T, 1)));
}
struct HeadScratch {
  WorkspaceCarver carver;
  NearestScratch s;
  float* sorted;
  HeadScratch(Workspace ws, std::int64_t T, std::int64_t d) noexcept
      : carver(ws),
        s(Workspace{carver.take<std::byte>(nearest_workspace(T, d).bytes), nearest_workspace(T, d).bytes}, T, d),
        sorted(carver.take<float>(static_cast<std::size_t>(std::max<std::int64_t>(T, 1)))) {}
};

/// Steps 2-4 of `rule` on `h.s` (filled by `nearest_kept`), then the head's
/// dense plan entries: one per evicted token, dst = its slot or -1, src = its
/// id, weight = beta * scale of its slot or 0. No kept token: none merges
/// (and the state is not re-packed).
template <class Reduce, class Tk>
void merge_dense(const MergeRule& rule, const Rows<Tk>& K, const Rows<Tk>& V, std::span<const std::int32_t> kept, std::int64_t d, float* w,
                 HeadScratch& h, std::int32_t* dst, std::int32_t* src, float* weight, float* merged_keys, std::int64_t kld,
                 float* merged_values, std::int64_t vld) noexcept {
  NearestScratch& s = h.s;
  const bool any = !kept.empty();
  if (any) apply_merge_rule<Reduce>(rule, K, V, kept, d, w, s, h.sorted, merged_keys, kld, merged_values, vld);
  for (std::int64_t i = 0; i < s.num_evicted; ++i) {
    const std::int32_t t = any ? s.target[i] : -1;
    dst[i] = t;
    src[i] = s.evicted[i];
    weight[i] = t >= 0 ? s.beta[i] * s.slot_scale[t] : 0.0f;
  }
}

}  // namespace detail

namespace backend {

/// The merge ops of one kv head, the reference of every backend's:
///   merge_nearest  evicted ids (the ascending complement of the kept ids) and
///                  each one's nearest kept slot and cosine (step 1 of `MergeRule`);
///   merge_apply    steps 2-4 on those arrays (`target` is gated in place) and
///                  the dense plan entries;
///   merge_head     the two in a row (what the `MergeRule` policies call);
///   d2o_decide     D2O's EMA threshold and shared decision over all heads,
///                  between the two.
/// Entries are dense, one per evicted token in ascending token order (E = T - C
/// of them): dst = the kept slot it merges into or -1 (not merged), src = its
/// token id, weight = its coefficient beta_e * scale_c in X'[c] (0 when not
/// merged). Merged rows of slots that received nothing are not written. Every
/// op takes a workspace of `merge_head_workspace(T, d)` bytes.
struct ScalarMergeOps {
  static std::size_t merge_head_workspace(std::int64_t T, std::int64_t d) noexcept { return detail::head_scratch_plan(T, d).total(); }

  /// `kept`: the C ascending kept ids in [0, T); writes E = T - C `evicted`
  /// ids, `target` slots (-1: every cosine NaN) and `sim` cosines.
  template <class Tk>
  static void merge_nearest(const Rows<Tk>& keys, const std::int32_t* kept, std::int64_t C, std::int64_t T, std::int64_t d, float eps,
                            std::int32_t* evicted, std::int32_t* target, float* sim, Workspace ws) noexcept {
    detail::HeadScratch h(ws, T, d);
    detail::nearest_kept<ScalarReduceOps>(keys, std::span<const std::int32_t>(kept, static_cast<std::size_t>(C)), T, d, eps, h.s);
    for (std::int64_t i = 0; i < h.s.num_evicted; ++i) evicted[i] = h.s.evicted[i], target[i] = h.s.target[i], sim[i] = h.s.sim[i];
  }

  /// Steps 2-4 of `rule` on `merge_nearest`'s arrays (`target` gated in
  /// place); `w`: the head's masses (only when `rule.uses_state()`); `dst`,
  /// `src`, `weight`: the T - C entries; `merged_keys` / `merged_values`: C
  /// rows of head_dim floats at row strides `kld` / `vld`, or null. C = 0:
  /// nothing merges (and the state is not re-packed).
  template <class Tk>
  static void merge_apply(const MergeRule& rule, const Rows<Tk>& keys, const Rows<Tk>& values, const std::int32_t* kept, std::int64_t C,
                          std::int64_t T, std::int64_t d, float* w, const std::int32_t* evicted, std::int32_t* target, const float* sim,
                          std::int32_t* dst, std::int32_t* src, float* weight, float* merged_keys, std::int64_t kld, float* merged_values,
                          std::int64_t vld, Workspace ws) noexcept {
    detail::HeadScratch h(ws, T, d);
    const std::int64_t E = T - C;
    h.s.num_evicted = E;
    for (std::int64_t i = 0; i < E; ++i) h.s.evicted[i] = evicted[i], h.s.target[i] = target[i], h.s.sim[i] = sim[i];
    detail::merge_dense<ScalarReduceOps>(rule, keys, values, std::span<const std::int32_t>(kept, static_cast<std::size_t>(C)), d, w, h, dst,
                                         src, weight, merged_keys, kld, merged_values, vld);
    for (std::int64_t i = 0; i < E; ++i) target[i] = h.s.target[i];
  }

  /// `merge_nearest` then `merge_apply` through the workspace.
  template <class Tk>
  static void merge_head(const MergeRule& rule, const Rows<Tk>& keys, const Rows<Tk>& values, const std::int32_t* kept, std::int64_t C,
                         std::int64_t T, std::int64_t d, float* w, std::int32_t* dst, std::int32_t* src, float* weight, float* merged_keys,
                         std::int64_t kld, float* merged_values, std::int64_t vld, Workspace ws) noexcept {
    detail::HeadScratch h(ws, T, d);
    const std::span<const std::int32_t> kp(kept, static_cast<std::size_t>(C));
    detail::nearest_kept<ScalarReduceOps>(keys, kp, T, d, rule.eps, h.s);
    detail::merge_dense<ScalarReduceOps>(rule, keys, values, kp, d, w, h, dst, src, weight, merged_keys, kld, merged_values, vld);
  }

  /// D2O's shared decision over H heads of E evicted tokens each (`sim`,
  /// `target`: (H, E), as merge_nearest writes them): mean_s = the mean of
  /// every similarity (summed in fp64, heads then tokens, ascending), tau <-
  /// alpha tau + beta mean_s (mean_s on the state's first use), then token i
  /// of every head stays merged iff (sum over heads of s[h][i]) / H >= tau
  /// (target[h][i] = -1 otherwise). Writes the state.
  static void d2o_decide(const float* sim, std::int32_t* target, std::int64_t H, std::int64_t E, float alpha, float beta,
                         D2OState* state) noexcept {
    double total = 0.0;
    for (std::int64_t k = 0; k < H * E; ++k) total += sim[k];
    const auto mean_s = static_cast<float>(total / static_cast<double>(H * E));
    const float tau = state->initialised ? alpha * state->tau + beta * mean_s : mean_s;
    state->tau = tau;
    state->initialised = true;
    for (std::int64_t i = 0; i < E; ++i) {
      float m = 0.0f;
      for (std::int64_t g = 0; g < H; ++g) m += sim[g * E + i];
      if (!(m / static_cast<float>(H) >= tau))
        for (std::int64_t g = 0; g < H; ++g) target[g * E + i] = -1;
    }
  }

  // ---- CaM's streaming merge and kvpress CAMPress (ops/cam_steps.hpp) ----
  // What their device paths call: the draws, the candidates, and one kv
  // head's dense entries (rule.window per candidate, cam_entries) with the
  // merged value rows of the slots they reach (cam_merged_value; rows of
  // slots no drawn candidate reaches are not written).

  /// u[i] = the i-th uniform of torch's CPU generator after manual_seed(seed), i < n (TorchBernoulli's draws).
  static void torch_uniforms(std::uint32_t seed, std::int64_t n, float* u) noexcept {
    std::mt19937 g(seed);
    for (std::int64_t i = 0; i < n; ++i) u[i] = ops::torch_uniform(static_cast<std::uint32_t>(g()));
  }

  /// The T - C evicted ids, ascending: the complement of the ascending kept[0, C) in [0, T).
  static void evicted_ids(const std::int32_t* kept, std::int64_t C, std::int64_t T, std::int32_t* evicted) noexcept {
    std::int64_t i = 0, s = 0;
    for (std::int32_t j = 0; j < T; ++j) {
      if (s < C && kept[s] == j)
        ++s;
      else
        evicted[i++] = j;
    }
  }

  /// Bytes of workspace `cam_candidates` needs for T tokens.
  static std::size_t cam_candidates_workspace(std::int64_t T) noexcept {
    const auto t = static_cast<std::size_t>(T > 1 ? T : 1);
    return WorkspacePlan{}.add<std::int32_t>(t).add<std::uint64_t>(t).total();
  }

  /// kvpress CAMPress's merge candidates: of the tokens not in the ascending
  /// kept[0, C) (E of them), the min(k, E) with the highest mean over the rows
  /// of `scores` (H, T) (summed in row order, divided by H), ties to the later
  /// token (`score_order_key`, then the id), written ascending to `cand`.
  static void cam_candidates(TensorView<const float, 2> scores, const std::int32_t* kept, std::int64_t C, std::int64_t T, std::int64_t k,
                             std::int32_t* cand, Workspace ws) noexcept {
    WorkspaceCarver c(ws);
    const auto t = static_cast<std::size_t>(T > 1 ? T : 1);
    std::int32_t* ev = c.take<std::int32_t>(t);
    std::uint64_t* key = c.take<std::uint64_t>(t);
    const std::int64_t E = T - C, H = scores.extent(0);
    evicted_ids(kept, C, T, ev);
    if (k >= E) {
      std::copy(ev, ev + E, cand);
      return;
    }
    for (std::int64_t i = 0; i < E; ++i) {
      float acc = 0.0f;
      for (std::int64_t h = 0; h < H; ++h) acc += scores(h, ev[i]);
      key[i] = (static_cast<std::uint64_t>(score_order_key(acc / static_cast<float>(H))) << 32) | static_cast<std::uint32_t>(ev[i]);
    }
    std::sort(key, key + E, [](std::uint64_t a, std::uint64_t b) { return a > b; });
    for (std::int64_t i = 0; i < k; ++i) cand[i] = static_cast<std::int32_t>(key[i] & 0xffffffffu);
    std::sort(cand, cand + k);
  }

  /// Kv head h of a CaM-rule merge: for each of the n ascending candidates
  /// (evicted ids) its rule.window dense entries at dst / src / weight + j *
  /// window, with draw u[j * u_stride] (`ops::cam_entries`, window slots of
  /// the ascending kept[0, C)); then, when `merged_values` is given, the
  /// merged rows (head_dim d, row stride vld) of every kept slot a drawn
  /// candidate reaches. `start`: n scratch slots (each candidate's first
  /// window slot). `attn` reads the accumulated attention of kv head h.
  template <class Tk>
  static void cam_merge_head(const ops::CamRule& rule, const ops::CamAttention& attn, std::int64_t h, const Rows<Tk>& values,
                             const std::int32_t* kept, std::int64_t C, const std::int32_t* cand, std::int64_t n, std::int64_t d,
                             const float* u, std::int64_t u_stride, std::int32_t* dst, std::int32_t* src, float* weight,
                             float* merged_values, std::int64_t vld, std::int64_t* start) noexcept {
    for (std::int64_t j = 0; j < n; ++j) {
      const std::int64_t e = j * rule.window;
      start[j] = ops::cam_entries(rule, attn, h, kept, C, cand[j], u[j * u_stride], dst + e, src + e, weight + e);
    }
    if (merged_values == nullptr) return;
    for (std::int64_t s = 0; s < C; ++s) {
      bool touched = false;
      for (std::int64_t c = 0; c < d; ++c) {
        const float v = ops::cam_merged_value(rule, values, kept, cand, start, n, dst, weight, s, c, &touched);
        if (!touched) break;
        merged_values[s * vld + c] = v;
      }
    }
  }

  // ---- MiniCache (ops/minicache_steps.hpp): one kv head of a layer pair ----

  /// Bytes of workspace `minicache_head` needs for T tokens of head_dim d (both layers' widened rows, the distances).
  static std::size_t minicache_workspace(std::int64_t T, std::int64_t d) noexcept {
    const auto t = static_cast<std::size_t>(T > 1 ? T : 1), dd = static_cast<std::size_t>(d > 1 ? d : 1);
    return WorkspacePlan{}.add<float>(t * dd).add<float>(t * dd).add<float>(t).total();
  }

  /// Kv head h of MiniCache's merge of rows `prev` (layer l-1) and `cur` (layer l), T tokens of head_dim d:
  /// per token the norms (norm16, at norm_prev / norm_cur + j x their strides), the unit SLERP direction at
  /// t (direction + j x dir_stride) and the distance; then the head's threshold at gamma and its retained
  /// tokens (distance strictly above it), ascending, appended after the previous heads': ids at
  /// retained_ids + indptr[h], widened rows at retained_prev / retained_cur rows from indptr[h];
  /// indptr[h + 1] written (indptr[0] = 0 written by head 0). Retained buffers hold the worst case.
  template <class Tk>
  static void minicache_head(float t, float gamma, const Rows<Tk>& prev, const Rows<Tk>& cur, std::int64_t T, std::int64_t d,
                             std::int64_t h, float* norm_prev, float* norm_cur, std::int64_t np_stride, std::int64_t nc_stride,
                             float* direction, std::int64_t dir_stride, std::int32_t* indptr, std::int32_t* retained_ids,
                             float* retained_prev, std::int64_t rp_stride, float* retained_cur, std::int64_t rc_stride,
                             Workspace ws) noexcept {
    WorkspaceCarver c(ws);
    const auto t1 = static_cast<std::size_t>(T > 1 ? T : 1), dd = static_cast<std::size_t>(d > 1 ? d : 1);
    float* a = c.take<float>(t1 * dd);
    float* b = c.take<float>(t1 * dd);
    float* dist = c.take<float>(t1);
    for (std::int64_t j = 0; j < T; ++j) {
      float *aj = a + j * d, *bj = b + j * d;
      for (std::int64_t k = 0; k < d; ++k) aj[k] = to_float(prev.row(j)[k]), bj[k] = to_float(cur.row(j)[k]);
      const float na = ops::norm16(aj, d), nb = ops::norm16(bj, d);
      norm_prev[j * np_stride] = na;
      norm_cur[j * nc_stride] = nb;
      dist[j] = ops::minicache_distance(aj, na, bj, nb, d);
      ops::minicache_slerp(t, aj, na, bj, nb, d, direction + j * dir_stride);
    }
    if (h == 0) indptr[0] = 0;
    std::int64_t pos = indptr[h];
    if (T > 0) {
      float lo = dist[0], hi = dist[0];
      for (std::int64_t j = 1; j < T; ++j) lo = dist[j] < lo ? dist[j] : lo, hi = dist[j] > hi ? dist[j] : hi;
      const float thr = ops::minicache_threshold(lo, hi, gamma);
      for (std::int64_t j = 0; j < T; ++j) {
        if (!(dist[j] > thr)) continue;
        retained_ids[pos] = static_cast<std::int32_t>(j);
        std::copy(a + j * d, a + (j + 1) * d, retained_prev + pos * rp_stride);
        std::copy(b + j * d, b + (j + 1) * d, retained_cur + pos * rc_stride);
        ++pos;
      }
    }
    indptr[h + 1] = static_cast<std::int32_t>(pos);
  }
};

}  // namespace backend

KVP_NAMESPACE_END
