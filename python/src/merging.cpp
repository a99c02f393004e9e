// SPDX-License-Identifier: Apache-2.0
// Merging: kvpress MergingPress (KvpressMerging), kvpress CAMPress (KvpressCAM), CaM, D2O, LOOK-M pivot, the
// cross-layer MiniCache store and the
// nearest-kept weighted merge on one sequence's keys / values given as arrays
// and a KeepSet given as int32 arrays; the MergePlan comes back as arrays, and
// merge_contiguous applies a plan to a contiguous cache in place
// (apply/merge.hpp). States (D2O's EMA threshold, NearestKept's weights) are
// the caller's: D2O's tau goes in and out by value (returned only on success),
// NearestKept's weights are a float32 array updated in place on success.
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "common.hpp"
#include "kvpolicy/apply/merge.hpp"
#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/core/dispatch.hpp"
#include "kvpolicy/policy/merging/cam.hpp"
#include "kvpolicy/policy/merging/d2o.hpp"
#include "kvpolicy/policy/merging/kvpress_cam.hpp"
#include "kvpolicy/policy/merging/kvpress_merging.hpp"
#include "kvpolicy/policy/merging/lookm.hpp"
#include "kvpolicy/policy/merging/minicache.hpp"
#include "kvpolicy/policy/merging/nearest_kept.hpp"

namespace kvpy {

namespace {

using kvpolicy::DType;
using Cpu = kvpolicy::backend::Cpu;

kvpolicy::KeepSet keep_args(const char* who, const ArrayArg& IP, const ArrayArg& ID) {
  if (IP.view.dtype != DType::kI32 || ID.view.dtype != DType::kI32)
    type_error(std::string(who) + ": keep indptr and indices must be int32");
  if (IP.view.extents[0] < 1) value_error(std::string(who) + ": keep indptr is empty");
  if (IP.view.strides[0] != 1 || ID.view.strides[0] != 1) value_error(std::string(who) + ": keep indptr and indices must be contiguous");
  return kvpolicy::KeepSet{static_cast<std::int32_t*>(IP.view.data), static_cast<std::int32_t*>(ID.view.data), IP.view.extents[0] - 1,
                           ID.view.extents[0]};
}

/// p.merge(ctx, in, out...) on the CPU under the module's thread pool, with a workspace sized for H kv heads of
/// T tokens of head_dim d, and without the GIL.
template <class Policy, class In, class... Out>
kvpolicy::Status merge_on_cpu(const Policy& p, std::int64_t H, std::int64_t T, std::int64_t d, const In& in, Out&&... out) {
  std::lock_guard<std::mutex> lk(exec_mutex());
  const kvpolicy::ExecContext ex = exec_context();
  const kvpolicy::Requirements req =
      p.requirements(kvpolicy::Context<Cpu>{{}, ex}, kvpolicy::ProblemShape{H, H, d, std::max<std::int64_t>(T, 1), 1});
  KVP_RETURN_IF_ERROR(req.status);
  std::unique_ptr<std::byte[]> ws(new std::byte[req.workspace_bytes + 1]);
  nb::gil_scoped_release nogil;
  return p.merge(kvpolicy::Context<Cpu>{kvpolicy::Workspace{ws.get(), req.workspace_bytes + 1}, ex}, in, std::forward<Out>(out)...);
}

/// Runs one merge policy on (keys, values, keep) and returns (indptr, dst, src, weight, merged_keys, merged_values);
/// `fill(input, status)` completes the policy's input (state, sums) for element type T; `done()` runs after success.
template <template <class> class Input, class Policy, class Fill>
nb::tuple run_merge(const char* who, const Policy& p, nb::handle keys, nb::handle values, nb::handle keep_indptr, nb::handle keep_indices,
                    bool merge_keys, bool merge_values, Fill&& fill, std::int64_t entries_per_token = 1, bool keys_optional = false) {
  clear_pointers();
  const ArrayArg K = array_arg(who, "keys", keys, {3}, false, true, keys_optional);
  const ArrayArg V = array_arg(who, "values", values, {3});
  const ArrayArg IP = array_arg(who, "keep_indptr", keep_indptr, {1});
  const ArrayArg ID = array_arg(who, "keep_indices", keep_indices, {1});
  const kvpolicy::KeepSet keep = keep_args(who, IP, ID);
  if (V.view.dtype != DType::kF32 && V.view.dtype != DType::kF16)
    type_error(std::string(who) + ": values has dtype " + kvpolicy::dtype_name(V.view.dtype) + "; supported: float32, float16");
  if (K.present() && V.view.dtype != K.view.dtype) type_error(std::string(who) + ": values and keys must share one dtype");
  const std::int64_t H = V.view.extents[0], T = V.view.extents[1], d = V.view.extents[2];
  // Slots per row: the most tokens any row keeps (rows the library rejects are reported by it).
  std::int64_t slots = 0;
  if (keep.num_rows == H)
    for (std::int64_t h = 0; h < H; ++h) slots = std::max<std::int64_t>(slots, std::clamp<std::int64_t>(keep.row_size(h), 0, T));
  const std::int64_t cap = H * T * entries_per_token;
  const auto uH = static_cast<std::size_t>(H), uS = static_cast<std::size_t>(slots), uD = static_cast<std::size_t>(d);
  auto [ip, ipp] = new_array<std::int32_t>({uH + 1});
  auto [dst, dstp] = new_array<std::int32_t>({static_cast<std::size_t>(cap)});
  auto [src, srcp] = new_array<std::int32_t>({static_cast<std::size_t>(cap)});
  auto [wt, wtp] = new_array<float>({static_cast<std::size_t>(cap)});
  auto [mk, mkp] = new_array<float>({merge_keys ? uH : 0, uS, uD});
  auto [mv, mvp] = new_array<float>({merge_values ? uH : 0, uS, uD});
  const float nan = std::numeric_limits<float>::quiet_NaN();
  if (merge_keys) std::fill(mkp, mkp + uH * uS * uD, nan);
  if (merge_values) std::fill(mvp, mvp + uH * uS * uD, nan);
  kvpolicy::MergePlan plan{ipp, dstp, srcp, wtp, H, cap};
  plan.slots_per_row = slots;
  if (merge_keys) plan.merged_keys = kvpolicy::TensorView<float, 2>::contiguous(mkp, {H * slots, d});
  if (merge_values) plan.merged_values = kvpolicy::TensorView<float, 2>::contiguous(mvp, {H * slots, d});
  check(kvpolicy::dispatch_dtype(V.view.dtype, "values", [&](auto tag) -> kvpolicy::Status {
    using T_ = typename decltype(tag)::type;
    if constexpr (!std::is_same_v<T_, float> && !std::is_same_v<T_, kvpolicy::half>) {
      return KVP_INVALID("%s: unsupported dtype", who);
    } else {
      kvpolicy::TensorView<const T_, 3> k, v;
      KVP_RETURN_IF_ERROR((V.view.template as<const T_, 3>(&v, "values")));
      record_pointer("values", v.data());
      Input<T_> in;
      if (K.present()) {
        KVP_RETURN_IF_ERROR((K.view.template as<const T_, 3>(&k, "keys")));
        record_pointer("keys", k.data());
        in.keys = kvpolicy::KVSource<T_>::from(k);
      }
      in.values = kvpolicy::KVSource<T_>::from(v);
      KVP_RETURN_IF_ERROR(fill(in));
      return merge_on_cpu(p, H, T, d, in, keep, plan);
    }
  }));
  const std::int32_t n = ipp[H];
  auto head = [&](nb::object a, std::int64_t m) { return a.attr("__getitem__")(nb::slice(nb::int_(0), nb::int_(m), nb::none())); };
  return nb::make_tuple(ip, head(nb::cast(dst), n), head(nb::cast(src), n), head(nb::cast(wt), n), merge_keys ? nb::cast(mk) : nb::none(),
                        merge_values ? nb::cast(mv) : nb::none());
}

nb::tuple kvpress_merge(float similarity_threshold, float merge_fraction, nb::handle keys, nb::handle values, nb::handle kip,
                        nb::handle kid) {
  const kvpolicy::KvpressMerging p(kvpolicy::KvpressMergingParams{similarity_threshold, merge_fraction});
  return run_merge<kvpolicy::MergeInput>("KvpressMerging.merge", p, keys, values, kip, kid, false, true,
                                         [](auto&) { return kvpolicy::Status::ok(); });
}

nb::tuple lookm_merge(nb::handle keys, nb::handle values, nb::handle kip, nb::handle kid, bool merge_keys, bool merge_values) {
  const kvpolicy::LookMPivot p;
  return run_merge<kvpolicy::MergeInput>("LookMPivot.merge", p, keys, values, kip, kid, merge_keys, merge_values,
                                         [](auto&) { return kvpolicy::Status::ok(); });
}

nb::tuple nearest_merge(float threshold, bool scale_by_similarity, nb::handle keys, nb::handle values, nb::handle kip, nb::handle kid,
                        nb::handle weights, bool merge_keys, bool merge_values) {
  const char* who = "NearestKeptMerge.merge";
  const kvpolicy::NearestKeptMerge p(kvpolicy::NearestKeptMergeParams{threshold, scale_by_similarity});
  const ArrayArg W = array_arg(who, "weights", weights, {2}, true, false);
  if (W.view.dtype != DType::kF32) type_error(std::string(who) + ": weights must be float32");
  kvpolicy::TensorView<float, 2> w;
  check(W.view.as<float, 2>(&w, "weights"));
  return run_merge<kvpolicy::NearestKeptInput>(who, p, keys, values, kip, kid, merge_keys, merge_values, [&](auto& in) {
    in.state.weights = w;
    return kvpolicy::Status::ok();
  });
}

/// Reads a float32 (rows, kv_len) array argument.
kvpolicy::TensorView<const float, 2> f32_2d(const char* who, const char* name, const ArrayArg& a) {
  if (a.view.dtype != DType::kF32) type_error(std::string(who) + ": " + name + " must be float32");
  kvpolicy::TensorView<const float, 2> v;
  check(a.view.as<const float, 2>(&v, name));
  return v;
}

nb::tuple cam_merge(std::int32_t merge_budget, nb::handle keys, nb::handle values, nb::handle kip, nb::handle kid,
                    nb::handle attention_sums, nb::handle scores, std::int64_t new_tokens, std::uint32_t seed) {
  const char* who = "KvpressCAM.merge";
  const kvpolicy::KvpressCAM p(kvpolicy::KvpressCAMParams{merge_budget});
  check(p.validate_params());
  const ArrayArg A = array_arg(who, "attention_sums", attention_sums, {2}, false, false);
  const ArrayArg S = array_arg(who, "scores", scores, {2}, false, false, true);
  const auto a = f32_2d(who, "attention_sums", A);
  const kvpolicy::TensorView<const float, 2> s = S.present() ? f32_2d(who, "scores", S) : kvpolicy::TensorView<const float, 2>{};
  return run_merge<kvpolicy::MergeInput>(
      who, p, keys, values, kip, kid, false, true,
      [&](auto& in) {
        in.attention_sums = a;
        in.scores = s;
        in.new_tokens = new_tokens;
        in.seed = seed;
        return kvpolicy::Status::ok();
      },
      merge_budget, /*keys_optional=*/true);
}

std::pair<nb::object, nb::object> cam_evict(std::int32_t merge_budget, nb::handle scores, std::int64_t target_size) {
  const char* who = "KvpressCAM.evict";
  const kvpolicy::KvpressCAM p(kvpolicy::KvpressCAMParams{merge_budget});
  const ArrayArg S = array_arg(who, "scores", scores, {2}, false, false);
  const auto s = f32_2d(who, "scores", S);
  const std::int64_t H = s.extent(0), T = s.extent(1), n = std::clamp<std::int64_t>(target_size, 0, T);
  auto [ip, ipp] = new_array<std::int32_t>({static_cast<std::size_t>(H + 1)});
  auto [ids, idp] = new_array<std::int32_t>({static_cast<std::size_t>(H * n)});
  const std::size_t wsb = kvpolicy::KvpressCAM::evict_workspace(T);
  std::unique_ptr<std::byte[]> ws(new std::byte[wsb + 1]);
  check(p.evict(s, target_size, kvpolicy::KeepSet{ipp, idp, H, H * n}, kvpolicy::Workspace{ws.get(), wsb + 1}));
  return {nb::cast(ip), nb::cast(ids)};
}

nb::tuple cam_orig_merge(const std::string& form, std::int32_t merge_num, std::int32_t start, std::int32_t recent, nb::handle keys,
                         nb::handle values, nb::handle kip, nb::handle kid, nb::handle attention_sums, nb::handle attention,
                         std::uint32_t seed) {
  const char* who = "CaM.merge";
  kvpolicy::CaMParams q;
  if (form == "streaming")
    q.form = kvpolicy::CaMForm::kStreaming;
  else if (form == "prefill")
    q.form = kvpolicy::CaMForm::kPrefill;
  else
    value_error("cam: form is '" + form + "'; expected 'streaming' or 'prefill'");
  q.merge_num = merge_num;
  q.start = start;
  q.recent = recent;
  const kvpolicy::CaM p(q);
  check(p.validate_params());
  const bool stream = q.form == kvpolicy::CaMForm::kStreaming;
  const ArrayArg A = array_arg(who, "attention_sums", attention_sums, {2}, false, false, /*optional=*/!stream);
  const ArrayArg F = array_arg(who, "attention", attention, {3}, false, false, /*optional=*/stream);
  const kvpolicy::TensorView<const float, 2> a = A.present() ? f32_2d(who, "attention_sums", A) : kvpolicy::TensorView<const float, 2>{};
  kvpolicy::TensorView<const float, 3> full;
  if (F.present()) {
    if (F.view.dtype != DType::kF32) type_error(std::string(who) + ": attention must be float32");
    check(F.view.as<const float, 3>(&full, "attention"));
  }
  // Plan entries per token: streaming merge_num per evicted token; prefill at most min(T, recent) x recent per row.
  const ArrayArg V0 = array_arg(who, "values", values, {3});
  const std::int64_t T = std::max<std::int64_t>(V0.view.extents[1], 1);
  const std::int64_t per_token = stream ? merge_num : (std::min<std::int64_t>(T, recent) * recent + T - 1) / T;
  return run_merge<kvpolicy::MergeInput>(
      who, p, keys, values, kip, kid, false, true,
      [&](auto& in) {
        in.attention_sums = a;
        in.attention = full;
        in.seed = seed;
        return kvpolicy::Status::ok();
      },
      per_token, /*keys_optional=*/true);
}

/// MiniCache's merged store of a layer pair: (direction, norm_prev, norm_cur, retained_indptr, retained_indices,
/// retained_prev, retained_cur), float32 / int32 arrays, the retained rows trimmed to the retained count.
nb::tuple minicache_merge(float t, float gamma, nb::handle prev, nb::handle cur) {
  const char* who = "MiniCache.merge";
  clear_pointers();
  const kvpolicy::MiniCache p(kvpolicy::MiniCacheParams{t, gamma});
  check(p.validate_params());
  const ArrayArg A = array_arg(who, "prev", prev, {3});
  const ArrayArg B = array_arg(who, "cur", cur, {3});
  if (A.view.dtype != B.view.dtype) type_error(std::string(who) + ": prev and cur must share one dtype");
  const std::int64_t H = A.view.extents[0], T = A.view.extents[1], d = A.view.extents[2];
  const auto uH = static_cast<std::size_t>(H), uT = static_cast<std::size_t>(T), uD = static_cast<std::size_t>(d);
  auto [dir, dirp] = new_array<float>({uH, uT, uD});
  auto [np_, npp] = new_array<float>({uH, uT});
  auto [nc, ncp] = new_array<float>({uH, uT});
  auto [rip, ripp] = new_array<std::int32_t>({uH + 1});
  auto [rid, ridp] = new_array<std::int32_t>({uH * uT});
  auto [rp, rpp] = new_array<float>({uH * uT, uD});
  auto [rc, rcp] = new_array<float>({uH * uT, uD});
  kvpolicy::MiniCacheMerged out;
  out.direction = kvpolicy::TensorView<float, 3>::contiguous(dirp, {H, T, d});
  out.norm_prev = kvpolicy::TensorView<float, 2>::contiguous(npp, {H, T});
  out.norm_cur = kvpolicy::TensorView<float, 2>::contiguous(ncp, {H, T});
  out.retained = kvpolicy::KeepSet{ripp, ridp, H, H * T};
  out.retained_prev = kvpolicy::TensorView<float, 2>::contiguous(rpp, {H * T, d});
  out.retained_cur = kvpolicy::TensorView<float, 2>::contiguous(rcp, {H * T, d});
  check(kvpolicy::dispatch_dtype(A.view.dtype, "prev", [&](auto tag) -> kvpolicy::Status {
    using T_ = typename decltype(tag)::type;
    kvpolicy::TensorView<const T_, 3> x, y;
    KVP_RETURN_IF_ERROR((A.view.template as<const T_, 3>(&x, "prev")));
    KVP_RETURN_IF_ERROR((B.view.template as<const T_, 3>(&y, "cur")));
    kvpolicy::MiniCacheInput<T_> in{kvpolicy::KVSource<T_>::from(x), kvpolicy::KVSource<T_>::from(y)};
    return merge_on_cpu(p, H, T, d, in, out);
  }));
  const std::int32_t n = ripp[H];
  auto head = [&](nb::object a, std::int64_t m) { return a.attr("__getitem__")(nb::slice(nb::int_(0), nb::int_(m), nb::none())); };
  return nb::make_tuple(dir, np_, nc, rip, head(nb::cast(rid), n), head(nb::cast(rp), n), head(nb::cast(rc), n));
}

/// Rebuilds layer l-1 (layer 0) or l (layer 1) of a MiniCache store into `out` (kv_heads, T, head_dim), any float dtype.
void minicache_restore(nb::handle direction, nb::handle norm_prev, nb::handle norm_cur, nb::handle rip, nb::handle rid, nb::handle rprev,
                       nb::handle rcur, int layer, nb::handle out) {
  const char* who = "MiniCache.restore";
  clear_pointers();
  const ArrayArg D = array_arg(who, "direction", direction, {3}, false, false);
  const ArrayArg NP = array_arg(who, "norm_prev", norm_prev, {2}, false, false);
  const ArrayArg NC = array_arg(who, "norm_cur", norm_cur, {2}, false, false);
  const ArrayArg IP = array_arg(who, "retained_indptr", rip, {1});
  const ArrayArg ID = array_arg(who, "retained_indices", rid, {1});
  const ArrayArg RP = array_arg(who, "retained_prev", rprev, {2}, false, false);
  const ArrayArg RC = array_arg(who, "retained_cur", rcur, {2}, false, false);
  const ArrayArg O = array_arg(who, "out", out, {3}, true, false);
  for (const ArrayArg* a : {&D, &NP, &NC, &RP, &RC})
    if (a->view.dtype != DType::kF32) type_error(std::string(who) + ": the store's arrays must be float32 (as merge returned them)");
  kvpolicy::MiniCacheMerged m;
  auto as3 = [&](const ArrayArg& a, const char* name) {
    kvpolicy::AnyTensorView w = a.view;
    w.read_only = false;  // the store view is non-const; restore only reads it
    kvpolicy::TensorView<float, 3> v;
    check(w.as<float, 3>(&v, name));
    return v;
  };
  auto as2 = [&](const ArrayArg& a, const char* name) {
    kvpolicy::AnyTensorView w = a.view;
    w.read_only = false;
    kvpolicy::TensorView<float, 2> v;
    check(w.as<float, 2>(&v, name));
    return v;
  };
  m.direction = as3(D, "direction");
  m.norm_prev = as2(NP, "norm_prev");
  m.norm_cur = as2(NC, "norm_cur");
  m.retained_prev = as2(RP, "retained_prev");
  m.retained_cur = as2(RC, "retained_cur");
  m.retained = keep_args(who, IP, ID);
  const kvpolicy::MiniCache p;
  check(kvpolicy::dispatch_dtype(O.view.dtype, "out", [&](auto tag) -> kvpolicy::Status {
    using T_ = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T_, float> || std::is_same_v<T_, kvpolicy::half> || std::is_same_v<T_, kvpolicy::bfloat16>) {
      kvpolicy::TensorView<T_, 3> y;
      KVP_RETURN_IF_ERROR((O.view.template as<T_, 3>(&y, "out")));
      return p.restore(m, layer, y);
    } else {
      return KVP_INVALID("%s: out must be float32, float16 or bfloat16", who);
    }
  }));
}

kvpolicy::D2OParams d2o_params(std::int64_t heavy, std::int64_t recent, std::int32_t sinks, float alpha, float beta,
                               const std::string& weighting) {
  kvpolicy::D2OParams q;
  q.heavy = heavy;
  q.recent = recent;
  q.sinks = sinks;
  q.alpha = alpha;
  q.beta = beta;
  if (weighting == "as_coded")
    q.weighting = kvpolicy::D2OWeighting::kAsCoded;
  else if (weighting == "normalized")
    q.weighting = kvpolicy::D2OWeighting::kNormalized;
  else
    value_error("d2o: weighting is '" + weighting + "'; expected 'as_coded' or 'normalized'");
  return q;
}

nb::tuple d2o_merge(std::int64_t heavy, std::int64_t recent, std::int32_t sinks, float alpha, float beta, const std::string& weighting,
                    nb::handle keys, nb::handle values, nb::handle kip, nb::handle kid, float tau, bool initialised, bool merge_keys,
                    bool merge_values) {
  const kvpolicy::D2O p(d2o_params(heavy, recent, sinks, alpha, beta, weighting));
  kvpolicy::D2OState st{tau, initialised};
  nb::tuple plan = run_merge<kvpolicy::D2OInput>("D2O.merge", p, keys, values, kip, kid, merge_keys, merge_values, [&](auto& in) {
    in.state = &st;
    return kvpolicy::Status::ok();
  });
  return nb::make_tuple(plan, st.tau, st.initialised);
}

/// D2O's token-level eviction from accumulated attention scores (kv_heads, kv_len) float32.
std::pair<nb::object, nb::object> d2o_evict(std::int64_t heavy, std::int64_t recent, std::int32_t sinks, float alpha, float beta,
                                            const std::string& weighting, nb::handle scores) {
  const char* who = "D2O.evict";
  const kvpolicy::D2O p(d2o_params(heavy, recent, sinks, alpha, beta, weighting));
  const ArrayArg S = array_arg(who, "scores", scores, {2}, false, false);
  if (S.view.dtype != DType::kF32) type_error(std::string(who) + ": scores must be float32");
  kvpolicy::TensorView<const float, 2> s;
  check(S.view.as<const float, 2>(&s, "scores"));
  const std::int64_t H = s.extent(0), T = s.extent(1);
  const std::int64_t n = std::max<std::int64_t>(p.kept_count(T), 0);
  auto [ip, ipp] = new_array<std::int32_t>({static_cast<std::size_t>(H + 1)});
  auto [ids, idp] = new_array<std::int32_t>({static_cast<std::size_t>(H * n)});
  const std::size_t wsb = kvpolicy::D2O::evict_workspace(T);
  std::unique_ptr<std::byte[]> ws(new std::byte[wsb + 1]);
  check(p.evict(s, kvpolicy::KeepSet{ipp, idp, H, H * n}, kvpolicy::Workspace{ws.get(), wsb + 1}));
  return {nb::cast(ip), nb::cast(ids)};
}

/// Writes a plan's merged rows into a contiguous cache in place; with compact=True the cache is compacted to the
/// keep set first (merge_and_compact_contiguous) and the new lengths are returned.
nb::object merge_contiguous(nb::handle keys, nb::handle values, std::int64_t kv_len, nb::handle kip, nb::handle kid, nb::handle indptr,
                            nb::handle dst, nb::handle src, nb::handle weight, nb::handle merged_keys, nb::handle merged_values,
                            bool compact, nb::handle positions) {
  const char* who = "merge_contiguous";
  clear_pointers();
  const ArrayArg K = array_arg(who, "keys", keys, {3}, true, true, true);
  const ArrayArg V = array_arg(who, "values", values, {3}, true, true, true);
  const ArrayArg P = array_arg(who, "positions", positions, {2}, true, false, true);
  const ArrayArg IP = array_arg(who, "keep_indptr", kip, {1});
  const ArrayArg ID = array_arg(who, "keep_indices", kid, {1});
  const kvpolicy::KeepSet keep = keep_args(who, IP, ID);
  const ArrayArg PI = array_arg(who, "plan indptr", indptr, {1});
  const ArrayArg PD = array_arg(who, "plan dst", dst, {1});
  const ArrayArg PS = array_arg(who, "plan src", src, {1});
  const ArrayArg PW = array_arg(who, "plan weight", weight, {1});
  const ArrayArg MK = array_arg(who, "merged_keys", merged_keys, {3}, false, true, true);
  const ArrayArg MV = array_arg(who, "merged_values", merged_values, {3}, false, true, true);
  if (!K.present() && !V.present()) value_error(std::string(who) + ": keys and values are both missing");
  const ArrayArg& any = K.present() ? K : V;
  if (K.present() && V.present() && V.view.dtype != K.view.dtype) type_error(std::string(who) + ": values and keys must share one dtype");
  if (P.present() && P.view.dtype != DType::kI32) type_error(std::string(who) + ": positions must be int32");
  for (const ArrayArg* a : {&PI, &PD, &PS})
    if (a->view.dtype != DType::kI32) type_error(std::string(who) + ": plan indptr, dst and src must be int32");
  if (PW.view.dtype != DType::kF32) type_error(std::string(who) + ": plan weight must be float32");
  for (const ArrayArg* a : {&PI, &PD, &PS, &PW})
    if (a->view.strides[0] != 1 && a->view.extents[0] > 1) value_error(std::string(who) + ": plan arrays must be contiguous");
  if (PI.view.extents[0] < 1) value_error(std::string(who) + ": plan indptr is empty");
  const std::int64_t n = std::min({PD.view.extents[0], PS.view.extents[0], PW.view.extents[0]});
  kvpolicy::MergePlan plan{static_cast<std::int32_t*>(PI.view.data),
                           static_cast<std::int32_t*>(PD.view.data),
                           static_cast<std::int32_t*>(PS.view.data),
                           static_cast<float*>(PW.view.data),
                           PI.view.extents[0] - 1,
                           n};
  auto merged = [&](const ArrayArg& M, const char* name, kvpolicy::TensorView<float, 2>* out) {
    if (!M.present()) return;
    if (M.view.dtype != DType::kF32) type_error(std::string(who) + ": " + name + " must be float32");
    const auto& e = M.view.extents;
    const auto& s = M.view.strides;
    if (s[1] != e[2] * s[2] && e[1] > 1) value_error(std::string(who) + ": " + name + " must have contiguous (slots, head_dim) rows");
    if (plan.slots_per_row != 0 && plan.slots_per_row != e[1])
      value_error(std::string(who) + ": merged_keys and merged_values have different slot counts");
    plan.slots_per_row = e[1];
    // (rows, slots, d) with row stride s[0] == slots * d (checked) read as (rows * slots, d).
    if (s[0] != e[1] * s[1] && e[0] > 1) value_error(std::string(who) + ": " + name + " must be C-contiguous");
    *out = kvpolicy::TensorView<float, 2>(static_cast<float*>(M.view.data), {e[0] * e[1], e[2]}, {e[2] > 1 ? s[1] : e[2], 1});
  };
  merged(MK, "merged_keys", &plan.merged_keys);
  merged(MV, "merged_values", &plan.merged_values);
  const std::int64_t H = any.view.extents[0];
  auto [lens, lens_ptr] = new_array<std::int64_t>({static_cast<std::size_t>(H)});
  check(kvpolicy::dispatch_dtype(any.view.dtype, "keys", [&](auto tag) -> kvpolicy::Status {
    using T_ = typename decltype(tag)::type;
    kvpolicy::TensorView<T_, 3> k, v;
    kvpolicy::TensorView<std::int32_t, 2> pos;
    if (K.present()) KVP_RETURN_IF_ERROR((K.view.template as<T_, 3>(&k, "keys")));
    if (V.present()) KVP_RETURN_IF_ERROR((V.view.template as<T_, 3>(&v, "values")));
    if (P.present()) KVP_RETURN_IF_ERROR((P.view.template as<std::int32_t, 2>(&pos, "positions")));
    nb::gil_scoped_release nogil;
    if (compact)
      return kvpolicy::merge_and_compact_contiguous(k, v, pos, kv_len, keep, 0, plan,
                                                    std::span<std::int64_t>(lens_ptr, static_cast<std::size_t>(H)));
    KVP_REQUIRE(!P.present(), "%s: positions are moved only with compact=True", who);
    return kvpolicy::merge_contiguous(k, v, kv_len, keep, 0, plan);
  }));
  if (!compact) return nb::none();
  return nb::cast(lens);
}

}  // namespace

void bind_merge(nb::module_& m) {
  m.def("kvpress_merge", &kvpress_merge, nb::arg("similarity_threshold"), nb::arg("merge_fraction"), nb::arg("keys"), nb::arg("values"),
        nb::arg("keep_indptr"), nb::arg("keep_indices"),
        "kvpress MergingPress's merge (values only): returns (indptr, dst, src, weight, None, merged_values).");
  m.def("lookm_merge", &lookm_merge, nb::arg("keys"), nb::arg("values"), nb::arg("keep_indptr"), nb::arg("keep_indices"),
        nb::arg("merge_keys") = true, nb::arg("merge_values") = true,
        "LOOK-M pivot merge: returns (indptr, dst, src, weight, merged_keys, merged_values).");
  m.def("nearest_merge", &nearest_merge, nb::arg("threshold"), nb::arg("scale_by_similarity"), nb::arg("keys"), nb::arg("values"),
        nb::arg("keep_indptr"), nb::arg("keep_indices"), nb::arg("weights"), nb::arg("merge_keys") = true, nb::arg("merge_values") = true,
        "Nearest-kept weighted merge; weights (kv_heads, capacity) float32 are re-packed in place on success.");
  m.def("cam_merge", &cam_merge, nb::arg("merge_budget"), nb::arg("keys").none(), nb::arg("values"), nb::arg("keep_indptr"),
        nb::arg("keep_indices"), nb::arg("attention_sums"), nb::arg("scores").none(), nb::arg("new_tokens"), nb::arg("seed"),
        "kvpress CAMPress's merge (values only): returns (indptr, dst, src, weight, None, merged_values).");
  m.def("cam_evict", &cam_evict, nb::arg("merge_budget"), nb::arg("scores"), nb::arg("target_size"),
        "kvpress CAMPress's eviction from head-mean scores: returns (indptr, indices).");
  m.def("cam_orig_merge", &cam_orig_merge, nb::arg("form"), nb::arg("merge_num"), nb::arg("start"), nb::arg("recent"),
        nb::arg("keys").none(), nb::arg("values"), nb::arg("keep_indptr"), nb::arg("keep_indices"), nb::arg("attention_sums").none(),
        nb::arg("attention").none(), nb::arg("seed"),
        "CaM's merge (zyxxmu/cam; values only): returns (indptr, dst, src, weight, None, merged_values).");
  m.def("minicache_merge", &minicache_merge, nb::arg("t"), nb::arg("gamma"), nb::arg("prev"), nb::arg("cur"),
        "MiniCache's cross-layer merge of one half (keys or values) of layers l-1 and l: returns (direction, norm_prev, norm_cur, "
        "retained_indptr, retained_indices, retained_prev, retained_cur).");
  m.def("minicache_restore", &minicache_restore, nb::arg("direction"), nb::arg("norm_prev"), nb::arg("norm_cur"),
        nb::arg("retained_indptr"), nb::arg("retained_indices"), nb::arg("retained_prev"), nb::arg("retained_cur"), nb::arg("layer"),
        nb::arg("out"), "Rebuilds layer l-1 (layer=0) or l (layer=1) of a MiniCache store into out (kv_heads, T, head_dim) in place.");
  m.def("d2o_merge", &d2o_merge, nb::arg("heavy"), nb::arg("recent"), nb::arg("sinks"), nb::arg("alpha"), nb::arg("beta"),
        nb::arg("weighting"), nb::arg("keys"), nb::arg("values"), nb::arg("keep_indptr"), nb::arg("keep_indices"), nb::arg("tau"),
        nb::arg("initialised"), nb::arg("merge_keys") = true, nb::arg("merge_values") = true,
        "D2O's token-level merge: returns (plan tuple, new tau, new initialised).");
  m.def("d2o_evict", &d2o_evict, nb::arg("heavy"), nb::arg("recent"), nb::arg("sinks"), nb::arg("alpha"), nb::arg("beta"),
        nb::arg("weighting"), nb::arg("scores"), "D2O's token-level eviction: returns (indptr, indices).");
  m.def("merge_contiguous", &merge_contiguous, nb::arg("keys").none(), nb::arg("values").none(), nb::arg("kv_len"), nb::arg("keep_indptr"),
        nb::arg("keep_indices"), nb::arg("indptr"), nb::arg("dst"), nb::arg("src"), nb::arg("weight"), nb::arg("merged_keys").none(),
        nb::arg("merged_values").none(), nb::arg("compact") = true, nb::arg("positions").none() = nb::none(),
        "Writes a merge plan's rows into a contiguous cache (kv_heads, capacity, head_dim) in place; compact=True compacts to "
        "the keep set first and returns the new lengths. Everything is validated before the first write.");
}

}  // namespace kvpy
