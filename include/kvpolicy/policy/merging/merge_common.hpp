// SPDX-License-Identifier: Apache-2.0
// What the merging policies share:
//
//   MergeInput      one sequence's evidence for a merge (keys, values, optional
//                   attention sums / full attention / eviction scores, the seed
//                   of the Bernoulli draws); each policy states what it reads.
//   TorchBernoulli  the draws of `torch.manual_seed(seed); torch.bernoulli(p)`
//                   on torch's CPU generator, element by element, so that a
//                   stochastic merge (CaM) reproduces the reference bit for bit.
//   detail::        the input checks, the nearest-kept cosine search and the
//                   linear merge writer every token-merging policy is built on.
//
// The linear merge. Every token-level merge of the family (kvpress
// MergingPress, D2O, LOOK-M, the nearest-kept weighted merge) computes, for a
// kept slot c that received evicted tokens E_c,
//     X'[c] = (self_c * X[c] + sum_{e in E_c} beta_e * X[e]) * scale_c
// with per-policy `beta` (the evicted token's raw weight) and
// `(self_c, scale_c)` from the slot's totals (sum of beta, count, persistent
// weight). The plan records `weight = beta_e * scale_c`, the coefficient of
// X[e] in X'[c]. Sums run in fp32 over evicted tokens in ascending token order.
//
// Keys are merged post-RoPE in every reference: a merged key sits at the
// kept token's logical position (its RoPE phase is the kept token's, the
// evicted key's phase is blended in as is).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>

#include "kvpolicy/apply/compact.hpp"
#include "kvpolicy/core/keep_set.hpp"
#include "kvpolicy/core/kv_source.hpp"
#include "kvpolicy/policy/decisions.hpp"
#include "kvpolicy/policy/policy.hpp"

KVP_NAMESPACE_BEGIN

/// One sequence's evidence for a merge policy.
template <class Tk>
struct MergeInput {
  KVSource<Tk> keys{};                          ///< (num_kv_heads, kv_len, head_dim), post-RoPE
  KVSource<Tk> values{};                        ///< (num_kv_heads, kv_len, head_dim)
  TensorView<const float, 2> attention_sums{};  ///< optional (num_kv_heads or num_q_heads, kv_len): accumulated attention
  TensorView<const float, 3> attention{};       ///< optional (num_q_heads, kv_len, kv_len): the prompt's full attention
  TensorView<const float, 2> scores{};          ///< optional (num_kv_heads, kv_len): the eviction scores (kvpress CAM)
  std::int64_t new_tokens = -1;                 ///< kvpress CAM: tokens since the last compression (-1: every evicted token)
  std::uint32_t seed = 0;                       ///< seed of the Bernoulli draws (CaM)
};

/// Bernoulli draws exactly as torch's CPU generator makes them: after
/// `torch.manual_seed(seed)`, `torch.bernoulli(p)` on a float tensor draws,
/// element by element in memory order, one 32-bit mt19937 output x,
/// u = (x & 0xFFFFFF) * 2^-24 (a float in [0, 1)), and returns u < p.
/// (The CUDA generator is Philox-based and is not reproduced.)
class TorchBernoulli {
 public:
  explicit TorchBernoulli(std::uint32_t seed) noexcept : engine_(seed) {}
  float uniform() noexcept { return static_cast<float>(static_cast<double>(engine_() & 0xFFFFFFu) * (1.0 / 16777216.0)); }
  bool draw(float p) noexcept { return uniform() < p; }

 private:
  std::mt19937 engine_;
};

namespace detail {

/// Structure and shape checks of the keys / values a merge reads; `*shape`
/// receives (kv heads, kv_len, head_dim) of whichever is present first.
template <class Tk>
Status check_merge_source(const char* who, const KVSource<Tk>& s, const char* name, std::int64_t* H, std::int64_t* T,
                          std::int64_t* d) noexcept {
  if (s.empty()) return KVP_INVALID("%s: %s is missing (no data and no paged view)", who, name);
  KVP_RETURN_IF_ERROR(s.validate(who, name));
  if (s.paged != nullptr) {
    KVP_RETURN_IF_ERROR(s.paged->validate(who, s.role == KVRole::kValues));
    KVP_REQUIRE(s.paged->device.is_host(), "%s: paged %s live on a device; this entry point reads host memory", who, name);
  }
  if (*H < 0) {
    *H = s.kv_heads();
    *T = s.kv_len();
    *d = s.head_dim();
    KVP_REQUIRE(*H >= 1 && *d >= 1, "%s: %s has %lld kv heads and head_dim %lld, both must be >= 1", who, name, static_cast<long long>(*H),
                static_cast<long long>(*d));
    KVP_REQUIRE(*T <= INT32_MAX, "%s: kv_len %lld exceeds the int32 token id range", who, static_cast<long long>(*T));
    return Status::ok();
  }
  KVP_REQUIRE(s.kv_heads() == *H && s.kv_len() == *T && s.head_dim() == *d,
              "%s: %s has shape (%lld, %lld, %lld), keys have (%lld, %lld, %lld)", who, name, static_cast<long long>(s.kv_heads()),
              static_cast<long long>(s.kv_len()), static_cast<long long>(s.head_dim()), static_cast<long long>(*H),
              static_cast<long long>(*T), static_cast<long long>(*d));
  return Status::ok();
}

/// The keep set is one sequence's: `H` rows, each strictly ascending in [0, T).
inline Status check_merge_keep(const char* who, const KeepSet& keep, std::int64_t H, std::int64_t T, std::int64_t* max_kept,
                               std::int64_t* total_evicted) noexcept {
  KVP_REQUIRE(keep.indptr != nullptr, "%s: keep set indptr is null", who);
  KVP_REQUIRE(keep.num_rows == H, "%s: keep set has %lld rows, expected one per kv head (%lld): merges take one sequence", who,
              static_cast<long long>(keep.num_rows), static_cast<long long>(H));
  *max_kept = 0;
  *total_evicted = 0;
  for (std::int64_t h = 0; h < H; ++h) {
    KVP_RETURN_IF_ERROR(check_keep_row(who, keep, h, T));
    *max_kept = std::max<std::int64_t>(*max_kept, keep.row_size(h));
    *total_evicted += T - keep.row_size(h);
  }
  return Status::ok();
}

/// The plan's rows / capacity and its optional merged buffers.
inline Status check_merge_plan(const char* who, const MergePlan& plan, std::int64_t H, std::int64_t d, std::int64_t max_kept,
                               std::int64_t capacity_needed, bool merges_keys) noexcept {
  KVP_RETURN_IF_ERROR(plan.check_output(who, H, capacity_needed));
  if (!merges_keys)
    KVP_REQUIRE(plan.merged_keys.empty(), "%s: merged_keys is given, but this policy merges values only (pass an empty view)", who);
  const TensorView<float, 2>* views[] = {&plan.merged_keys, &plan.merged_values};
  const char* names[] = {"merged_keys", "merged_values"};
  for (int i = 0; i < 2; ++i) {
    const auto& v = *views[i];
    if (v.empty()) continue;
    KVP_RETURN_IF_ERROR(v.check_basic(who, names[i]));
    KVP_REQUIRE(v.device().is_host(), "%s: %s is a device tensor; this entry point writes host memory", who, names[i]);
    KVP_REQUIRE(v.extent(1) == d && (v.stride(1) == 1 || d == 1), "%s: %s has %lld columns (stride %lld), expected head_dim=%lld, stride 1",
                who, names[i], static_cast<long long>(v.extent(1)), static_cast<long long>(v.stride(1)), static_cast<long long>(d));
    KVP_REQUIRE(plan.slots_per_row >= max_kept, "%s: merge plan slots_per_row is %lld, below the %lld kept tokens of a row", who,
                static_cast<long long>(plan.slots_per_row), static_cast<long long>(max_kept));
    std::int64_t rows = 0;
    KVP_REQUIRE(checked_mul(H, plan.slots_per_row, &rows) && v.extent(0) >= rows,
                "%s: %s has %lld rows, needs num_rows x slots_per_row = %lld x %lld", who, names[i], static_cast<long long>(v.extent(0)),
                static_cast<long long>(H), static_cast<long long>(plan.slots_per_row));
  }
  return Status::ok();
}

/// Accumulated attention of kv head h at token j from sums given per kv head
/// or per query head (then the mean over the head's GQA group, as kvpress's
/// `_aggregate_attention_per_kv_head`).
inline float attention_of(const TensorView<const float, 2>& sums, std::int64_t H, std::int64_t h, std::int64_t j) noexcept {
  const std::int64_t G = sums.extent(0) / H;
  if (G == 1) return sums(h, j);
  float acc = 0.0f;
  for (std::int64_t g = 0; g < G; ++g) acc += sums(h * G + g, j);
  return acc / static_cast<float>(G);
}

inline Status check_attention_sums(const char* who, const TensorView<const float, 2>& s, std::int64_t H, std::int64_t T) noexcept {
  KVP_RETURN_IF_ERROR(s.check_basic(who, "attention_sums"));
  KVP_REQUIRE(s.data() != nullptr || T == 0, "%s: attention_sums is required (accumulated attention per token)", who);
  KVP_REQUIRE(s.device().is_host(), "%s: attention_sums is a device tensor; this entry point reads host memory", who);
  KVP_REQUIRE(s.extent(0) >= H && s.extent(0) % H == 0 && s.extent(1) == T,
              "%s: attention_sums has shape (%lld, %lld), expected (a multiple of num_kv_heads=%lld, kv_len=%lld)", who,
              static_cast<long long>(s.extent(0)), static_cast<long long>(s.extent(1)), static_cast<long long>(H),
              static_cast<long long>(T));
  for (std::int64_t r = 0; r < s.extent(0); ++r)
    for (std::int64_t j = 0; j < T; ++j)
      KVP_REQUIRE(std::isfinite(s(r, j)) && s(r, j) >= 0.0f, "%s: attention_sums(%lld, %lld) is %g, must be finite and >= 0", who,
                  static_cast<long long>(r), static_cast<long long>(j), static_cast<double>(s(r, j)));
  return Status::ok();
}

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
/// slot with count > 0, into `merged` rows [row0 + c]; `self_of(c)` gives self_c;
/// `s.slot_scale[c]` must hold scale_c.
template <class T, class SelfFn>
void linear_merge(const Rows<T>& X, std::span<const std::int32_t> kept, std::int64_t d, const NearestScratch& s, const std::int32_t* count,
                  SelfFn&& self_of, const TensorView<float, 2>& merged, std::int64_t row0) noexcept {
  const auto C = static_cast<std::int64_t>(kept.size());
  for (std::int64_t c = 0; c < C; ++c) {
    if (count[c] == 0) continue;
    float* out = &merged(row0 + c, 0);
    std::fill(out, out + d, 0.0f);
  }
  for (std::int64_t i = 0; i < s.num_evicted; ++i) {
    if (s.target[i] < 0) continue;
    float* out = &merged(row0 + s.target[i], 0);
    const T* x = X.row(s.evicted[i]);
    const float b = s.beta[i];
    for (std::int64_t k = 0; k < d; ++k) out[k] += b * to_float(x[k]);
  }
  for (std::int64_t c = 0; c < C; ++c) {
    if (count[c] == 0) continue;
    float* out = &merged(row0 + c, 0);
    const T* x = X.row(kept[static_cast<std::size_t>(c)]);
    const float a = self_of(c), sc = s.slot_scale[c];
    for (std::int64_t k = 0; k < d; ++k) out[k] = (a * to_float(x[k]) + out[k]) * sc;
  }
}

/// Appends row h's entries (target >= 0, ascending evicted ids) with weight beta * scale; returns the new size.
inline std::int64_t write_entries(MergePlan& plan, std::int64_t pos, const NearestScratch& s) noexcept {
  for (std::int64_t i = 0; i < s.num_evicted; ++i) {
    if (s.target[i] < 0) continue;
    plan.dst[pos] = s.target[i];
    plan.src[pos] = s.evicted[i];
    plan.weight[pos] = s.beta[i] * s.slot_scale[s.target[i]];
    ++pos;
  }
  return pos;
}

/// Workspace of `for_each_row`: a scratch slice of `per_row` bytes per worker plus 2 x H offsets.
inline std::size_t rows_workspace(std::size_t per_row, std::int64_t H, const ExecContext& ex) noexcept {
  const auto h = static_cast<std::size_t>(std::max<std::int64_t>(H, 1));
  return saturating_add(WorkspacePlan{}.add<std::int64_t>(2 * h).bytes, WorkerSlices::bytes(per_row, ex.workers()));
}

/// Runs `row(h, scratch, pos0) -> end` for every kv head over `ex`, each worker with its own scratch slice:
/// head h writes its entries from pos0 = sum_{g < h} bound(g) (an upper bound of the entries of each head,
/// so heads never overlap), then the entries are moved down to CSR order and `out.indptr` is written.
/// Merged rows are per head and disjoint. Results never depend on the number of workers.
template <class BoundFn, class RowFn>
void for_each_row(const ExecContext& ex, Workspace ws, std::size_t per_row, MergePlan& out, std::int64_t H, BoundFn&& bound,
                  RowFn&& row) noexcept {
  WorkspaceCarver c(ws);
  std::int64_t* start = c.take<std::int64_t>(static_cast<std::size_t>(2 * std::max<std::int64_t>(H, 1)));
  std::int64_t* end = start + std::max<std::int64_t>(H, 1);
  std::int64_t acc = 0;
  for (std::int64_t h = 0; h < H; ++h) {
    start[h] = acc;
    acc += bound(h);
  }
  const auto slices = WorkerSlices::carve(c.rest(), per_row);
  ex.parallel_for(H, [&](std::int64_t h, int worker) { end[h] = row(h, slices.slice(worker), start[h]); });
  std::int64_t pos = 0;
  out.indptr[0] = 0;
  for (std::int64_t h = 0; h < H; ++h) {
    const std::int64_t n = end[h] - start[h];
    if (pos != start[h] && n > 0) {  // pos <= start[h]: a forward move
      std::memmove(out.dst + pos, out.dst + start[h], static_cast<std::size_t>(n) * sizeof(std::int32_t));
      std::memmove(out.src + pos, out.src + start[h], static_cast<std::size_t>(n) * sizeof(std::int32_t));
      std::memmove(out.weight + pos, out.weight + start[h], static_cast<std::size_t>(n) * sizeof(float));
    }
    pos += n;
    out.indptr[h + 1] = static_cast<std::int32_t>(pos);
  }
}

/// Requirements shared by the per-row merges: workspace for one row, plan
/// rows = kv heads, capacity = entries_per_evicted x max_kv_len per row.
inline Requirements merge_requirements(const char* who, Status params, const ProblemShape& s, std::size_t workspace,
                                       std::int64_t entries_per_token) noexcept {
  Requirements r;
  r.status = params;
  if (r.status.is_ok()) r.status = check_problem_shape(who, s);
  if (!r.status.is_ok()) return r;
  r.workspace_bytes = workspace;
  r.output = OutputSize{s.num_kv_heads, s.num_kv_heads * s.max_kv_len * entries_per_token};
  return r;
}

/// Merged value rows of plan entries [first, last): merged[slot] = V[kept slot]
/// + sum of weight x V[src] in entry order, for slots whose `touched` flag is 0
/// on entry (set to 1 here). Entries of one source are consecutive, so its row
/// is widened once into `src_row` (head_dim floats). Shared by CaM's streaming
/// form and kvpress's CAMPress.
template <class Tk, class Flag>
void accumulate_merged_values(const Rows<Tk>& V, std::span<const std::int32_t> kept, std::int64_t d, const MergePlan& out,
                              std::int64_t first, std::int64_t last, std::int64_t row0, Flag* touched, float* src_row) noexcept {
  std::int32_t loaded = -1;
  for (std::int64_t e = first; e < last; ++e) {
    const std::int32_t slot = out.dst[e];
    float* o = &out.merged_values(row0 + slot, 0);
    if (touched[slot] == 0) {
      touched[slot] = 1;
      const Tk* x = V.row(kept[static_cast<std::size_t>(slot)]);
      for (std::int64_t c = 0; c < d; ++c) o[c] = to_float(x[c]);
    }
    if (out.src[e] != loaded) {
      loaded = out.src[e];
      const Tk* x = V.row(loaded);
      for (std::int64_t c = 0; c < d; ++c) src_row[c] = to_float(x[c]);
    }
    const float w = out.weight[e];
    for (std::int64_t c = 0; c < d; ++c) o[c] += src_row[c] * w;
  }
}

}  // namespace detail

KVP_NAMESPACE_END
