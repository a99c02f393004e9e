// SPDX-License-Identifier: Apache-2.0
// What the merging policies share:
//
//   MergeInput      one sequence's evidence for a merge (keys, values, optional
//                   attention sums / full attention / eviction scores, the seed
//                   of the Bernoulli draws); each policy states what it reads.
//   TorchBernoulli  the draws of `torch.manual_seed(seed); torch.bernoulli(p)`
//                   on torch's CPU generator, element by element, so that a
//                   stochastic merge (CaM) reproduces the reference bit for bit.
//   detail::        the input checks (host and device views), the plan
//                   writers, and `rule_merge`: the driver of the policies
//                   that are a `MergeRule` (ops/merge_scalar.hpp, where the
//                   nearest-kept search and the linear merge live), on host
//                   backends (rows in parallel, compacted plan) and device
//                   backends (`Backend::merge_head` per kv head, dense plan).
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
#include "kvpolicy/ops/cam_steps.hpp"
#include "kvpolicy/ops/merge_scalar.hpp"
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
/// (torch's CUDA generator is Philox-based and is not reproduced; the CUDA
/// backend reproduces this CPU generator on the device, `Cuda::torch_uniforms`.)
class TorchBernoulli {
 public:
  explicit TorchBernoulli(std::uint32_t seed) noexcept : engine_(seed) {}
  float uniform() noexcept { return ops::torch_uniform(static_cast<std::uint32_t>(engine_())); }
  bool draw(float p) noexcept { return uniform() < p; }

 private:
  std::mt19937 engine_;
};

namespace detail {

/// Structure and shape checks of the keys / values a merge reads; `*shape`
/// receives (kv heads, kv_len, head_dim) of whichever is present first.
/// `on_device`: the call runs on a device backend (views tagged kCUDA, page ids not read).
template <class Tk>
Status check_merge_source(const char* who, const KVSource<Tk>& s, const char* name, std::int64_t* H, std::int64_t* T, std::int64_t* d,
                          bool on_device = false) noexcept {
  if (s.empty()) return KVP_INVALID("%s: %s is missing (no data and no paged view)", who, name);
  KVP_RETURN_IF_ERROR(s.validate(who, name, on_device));
  if (s.paged != nullptr) {
    KVP_RETURN_IF_ERROR(s.paged->validate(who, s.role == KVRole::kValues, /*check_ids=*/!on_device));
    if (!on_device) KVP_REQUIRE(s.paged->device.is_host(), "%s: paged %s live on a device; this entry point reads host memory", who, name);
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
/// `on_device`: the ids are device memory and are not read (indptr is a host
/// array, as a device eviction writes it); the row sizes are checked.
inline Status check_merge_keep(const char* who, const KeepSet& keep, std::int64_t H, std::int64_t T, std::int64_t* max_kept,
                               std::int64_t* total_evicted, bool on_device = false) noexcept {
  KVP_REQUIRE(keep.indptr != nullptr, "%s: keep set indptr is null", who);
  KVP_REQUIRE(keep.num_rows == H, "%s: keep set has %lld rows, expected one per kv head (%lld): merges take one sequence", who,
              static_cast<long long>(keep.num_rows), static_cast<long long>(H));
  *max_kept = 0;
  *total_evicted = 0;
  for (std::int64_t h = 0; h < H; ++h) {
    if (on_device) {
      const std::int32_t b = keep.indptr[h], e = keep.indptr[h + 1];
      KVP_REQUIRE(b >= 0 && e >= b && e <= keep.capacity && e - b <= T,
                  "%s: keep set indptr[%lld..%lld] = [%d, %d) is not a range of at most kv_len=%lld of its %lld entries", who,
                  static_cast<long long>(h), static_cast<long long>(h + 1), b, e, static_cast<long long>(T),
                  static_cast<long long>(keep.capacity));
      KVP_REQUIRE(e == b || keep.indices != nullptr, "%s: keep set indices is null but row %lld lists %d tokens", who,
                  static_cast<long long>(h), e - b);
    } else {
      KVP_RETURN_IF_ERROR(check_keep_row(who, keep, h, T));
    }
    *max_kept = std::max<std::int64_t>(*max_kept, keep.row_size(h));
    *total_evicted += T - keep.row_size(h);
  }
  return Status::ok();
}

/// The plan's rows / capacity and its optional merged buffers.
inline Status check_merge_plan(const char* who, const MergePlan& plan, std::int64_t H, std::int64_t d, std::int64_t max_kept,
                               std::int64_t capacity_needed, bool merges_keys, bool on_device = false) noexcept {
  KVP_RETURN_IF_ERROR(plan.check_output(who, H, capacity_needed));
  if (!merges_keys)
    KVP_REQUIRE(plan.merged_keys.empty(), "%s: merged_keys is given, but this policy merges values only (pass an empty view)", who);
  const TensorView<float, 2>* views[] = {&plan.merged_keys, &plan.merged_values};
  const char* names[] = {"merged_keys", "merged_values"};
  for (int i = 0; i < 2; ++i) {
    const auto& v = *views[i];
    if (v.empty()) continue;
    KVP_RETURN_IF_ERROR(v.check_basic(who, names[i]));
    if (on_device)
      KVP_REQUIRE(!v.device().is_host(), "%s: %s is a host tensor; a device backend writes device memory (tag the view kCUDA)", who,
                  names[i]);
    else
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
/// (`ops::CamAttention`, shared with the device kernels).
inline ops::CamAttention cam_attention(const TensorView<const float, 2>& sums, std::int64_t H) noexcept {
  return ops::CamAttention{sums.data(), sums.stride(0), sums.stride(1), H > 0 ? sums.extent(0) / H : 1};
}
inline float attention_of(const TensorView<const float, 2>& sums, std::int64_t H, std::int64_t h, std::int64_t j) noexcept {
  return cam_attention(sums, H).of(h, j);
}

/// `on_device`: the sums are device memory (tagged kCUDA): shape only, their values are not read.
inline Status check_attention_sums(const char* who, const TensorView<const float, 2>& s, std::int64_t H, std::int64_t T,
                                   bool on_device = false) noexcept {
  KVP_RETURN_IF_ERROR(s.check_basic(who, "attention_sums"));
  KVP_REQUIRE(s.data() != nullptr || T == 0, "%s: attention_sums is required (accumulated attention per token)", who);
  if (on_device)
    KVP_REQUIRE(!s.device().is_host(), "%s: attention_sums is a host tensor; a device backend reads device memory (tag the view kCUDA)",
                who);
  else
    KVP_REQUIRE(s.device().is_host(), "%s: attention_sums is a device tensor; this entry point reads host memory", who);
  KVP_REQUIRE(s.extent(0) >= H && s.extent(0) % H == 0 && s.extent(1) == T,
              "%s: attention_sums has shape (%lld, %lld), expected (a multiple of num_kv_heads=%lld, kv_len=%lld)", who,
              static_cast<long long>(s.extent(0)), static_cast<long long>(s.extent(1)), static_cast<long long>(H),
              static_cast<long long>(T));
  if (on_device) return Status::ok();
  for (std::int64_t r = 0; r < s.extent(0); ++r)
    for (std::int64_t j = 0; j < T; ++j)
      KVP_REQUIRE(std::isfinite(s(r, j)) && s(r, j) >= 0.0f, "%s: attention_sums(%lld, %lld) is %g, must be finite and >= 0", who,
                  static_cast<long long>(r), static_cast<long long>(j), static_cast<double>(s(r, j)));
  return Status::ok();
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

/// Row 0 of kv head h's slots in a plan's merged buffers (null when a buffer is absent) and their row strides.
struct MergedRows {
  const MergePlan& out;
  float* keys(std::int64_t h) const noexcept { return out.merged_keys.empty() ? nullptr : &out.merged_keys(h * out.slots_per_row, 0); }
  float* values(std::int64_t h) const noexcept {
    return out.merged_values.empty() ? nullptr : &out.merged_values(h * out.slots_per_row, 0);
  }
  std::int64_t kld() const noexcept { return out.merged_keys.empty() ? 0 : out.merged_keys.stride(0); }
  std::int64_t vld() const noexcept { return out.merged_values.empty() ? 0 : out.merged_values.stride(0); }
};

/// Requirements of a `MergeRule` policy (one plan entry per evicted token):
/// on a host backend one row's scratch per worker; on a device backend
/// `Backend::merge_head_workspace` (the heads run one after another on the stream).
template <class Backend>
Requirements rule_merge_requirements(const char* who, Status params, const Context<Backend>& ctx, const ProblemShape& s) noexcept {
  std::size_t ws = 0;
  if constexpr (kDeviceBackend<Backend>)
    ws = Backend::merge_head_workspace(s.max_kv_len, s.head_dim);
  else
    ws = rows_workspace(head_scratch_plan(s.max_kv_len, s.head_dim).total(), s.num_kv_heads, ctx.exec);
  return merge_requirements(who, params, s, ws, 1);
}

/// A `MergeRule` merge of one sequence (ops/merge_scalar.hpp), validated
/// first, nothing written on error. `weights`: the state's masses (H, >= T),
/// only for rules that use them.
///
/// Host backends: rows in parallel, the plan compacted (entries of merged
/// tokens only, CSR by kv head).
/// Device backends: one `Backend::merge_head` per kv head on the stream; the
/// plan's `indptr` is a host array written from the keep set's row sizes and
/// its rows are dense: every evicted token has an entry, dst = -1 and weight
/// 0 when it is not merged (so the host needs no synchronisation and a CUDA
/// graph replays the same shapes). Dropping the dst = -1 entries gives the
/// host plan. Device memory is not scanned: the state's masses are not
/// checked for NaN / <= 0 there.
template <class Backend, class Tk>
Status rule_merge(const char* who, const Context<Backend>& cx, const MergeRule& rule, const MergeInput<Tk>& in, const KeepSet& keep,
                  MergePlan& out, const TensorView<float, 2>* weights, bool merges_keys) noexcept {
  constexpr bool dev = kDeviceBackend<Backend>;
  std::int64_t H = -1, T = 0, d = 0, max_kept = 0, evicted = 0;
  KVP_RETURN_IF_ERROR(check_merge_source(who, in.keys, "keys", &H, &T, &d, dev));
  KVP_RETURN_IF_ERROR(check_merge_source(who, in.values, "values", &H, &T, &d, dev));
  KVP_RETURN_IF_ERROR(check_merge_keep(who, keep, H, T, &max_kept, &evicted, dev));
  if (weights != nullptr) {
    const auto& w = *weights;
    KVP_RETURN_IF_ERROR(w.check_basic(who, "state weights"));
    KVP_REQUIRE(w.extent(0) == H && w.extent(1) >= T, "%s: state weights has shape (%lld, %lld), expected (%lld, >= %lld)", who,
                static_cast<long long>(w.extent(0)), static_cast<long long>(w.extent(1)), static_cast<long long>(H),
                static_cast<long long>(T));
    KVP_REQUIRE(w.stride(1) == 1 || w.extent(1) <= 1, "%s: state weights has column stride %lld, must be 1", who,
                static_cast<long long>(w.stride(1)));
    if (dev) {
      KVP_REQUIRE(!w.device().is_host(), "%s: state weights is a host tensor; a device backend reads device memory (tag the view kCUDA)",
                  who);
    } else {
      KVP_REQUIRE(w.device().is_host(), "%s: state weights is a device tensor; this entry point reads host memory", who);
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t j = 0; j < T; ++j)
          KVP_REQUIRE(std::isfinite(w(h, j)) && w(h, j) > 0.0f, "%s: state weight (%lld, %lld) is %g, must be finite and > 0", who,
                      static_cast<long long>(h), static_cast<long long>(j), static_cast<double>(w(h, j)));
    }
  }
  KVP_RETURN_IF_ERROR(check_merge_plan(who, out, H, d, max_kept, evicted, merges_keys, dev));
  auto w_row = [&](std::int64_t h) { return weights != nullptr && T > 0 ? &(*weights)(h, 0) : nullptr; };
  const MergedRows m{out};
  if constexpr (dev) {
    KVP_RETURN_IF_ERROR(check_workspace(who, cx.workspace, Backend::merge_head_workspace(T, d)));
    const BackendCall<Backend> call(cx);
    KVP_RETURN_IF_ERROR(call.begin());
    out.indptr[0] = 0;
    for (std::int64_t h = 0; h < H; ++h) out.indptr[h + 1] = static_cast<std::int32_t>(out.indptr[h] + (T - keep.row_size(h)));
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t pos = out.indptr[h];
      Backend::merge_head(rule, in.keys.rows(h), in.values.rows(h), keep.indices + keep.indptr[h], keep.row_size(h), T, d, w_row(h),
                          out.dst + pos, out.src + pos, out.weight + pos, m.keys(h), m.kld(), m.values(h), m.vld(), cx.workspace);
    }
    return call.end();
  } else {
    const std::size_t per = head_scratch_plan(T, d).total();
    KVP_RETURN_IF_ERROR(check_workspace(who, cx.workspace, rows_workspace(per, H, cx.exec)));
    for_each_row(
        cx.exec, cx.workspace, per, out, H, [&](std::int64_t h) { return T - keep.row_size(h); },
        [&](std::int64_t h, Workspace ws, std::int64_t pos) -> std::int64_t {
          const auto kept = keep.row(h);
          if (kept.empty()) return pos;  // nothing to merge into
          HeadScratch hs(ws, T, d);
          NearestScratch& s = hs.s;
          const Rows<Tk> K = in.keys.rows(h), V = in.values.rows(h);
          nearest_kept<Backend>(K, kept, T, d, rule.eps, s);
          apply_merge_rule<Backend>(rule, K, V, kept, d, w_row(h), s, hs.sorted, m.keys(h), m.kld(), m.values(h), m.vld());
          return write_entries(out, pos, s);
        });
    return Status::ok();
  }
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
