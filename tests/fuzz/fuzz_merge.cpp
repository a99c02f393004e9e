// Fuzz target: the merging family and apply/merge.hpp from fuzzer-chosen
// shapes, strides, keep sets, plan capacities and workspaces: KvpressMerging,
// LookMPivot and KvpressCAM decide a plan over a contiguous cache (fp32 keys
// and values with NaN / Inf / huge values now and then), then
// merge_and_compact_contiguous applies it.
// Contract: no crash or sanitizer report; a failed merge leaves the plan
// buffers untouched (poisoned and compared); an accepted plan has every entry's
// dst a kept slot and src an evicted token with a finite weight >= 0; a failed
// apply leaves the cache, positions and lengths byte-identical.
#include <cmath>

#include "fuzz_util.hpp"
#include "kvpolicy/apply/merge.hpp"
#include "kvpolicy/policy/merging/kvpress_cam.hpp"
#include "kvpolicy/policy/merging/kvpress_merging.hpp"
#include "kvpolicy/policy/merging/lookm.hpp"

using namespace kvpolicy;
using namespace kvp_fuzz;

namespace {

template <class P>
void run(FuzzedDataProvider& fdp, const P& policy) {
  const auto H = fdp.ConsumeIntegralInRange<std::int64_t>(1, 3), T = fdp.ConsumeIntegralInRange<std::int64_t>(0, 20),
             d = fdp.ConsumeIntegralInRange<std::int64_t>(1, 6);
  const std::int64_t s1 = d + fdp.ConsumeIntegralInRange<int>(0, 2), s0 = T * s1 + fdp.ConsumeIntegralInRange<int>(0, 2);
  const std::size_t n = T ? static_cast<std::size_t>((H - 1) * s0 + (T - 1) * s1 + d) : 0;
  std::vector<float> k(n), v(n);
  for (auto& x : k) x = fuzz_float(fdp);
  for (auto& x : v) x = fuzz_float(fdp);
  std::vector<float> sums(static_cast<std::size_t>(H * T));
  for (auto& x : sums) x = std::fabs(fuzz_float(fdp));
  // A keep set: the same ids on every head (CAMPress's rule) or per head, usually valid.
  const bool shared = fdp.ConsumeBool();
  std::vector<std::int32_t> kp{0}, ki, row;
  for (std::int64_t h = 0; h < H; ++h) {
    if (h == 0 || !shared) {
      row.clear();
      for (std::int32_t t = 0; t < T; ++t)
        if (fdp.ConsumeBool()) row.push_back(t);
      if (fdp.ConsumeIntegralInRange<int>(0, 31) == 0 && !row.empty()) row.back() = fdp.ConsumeIntegralInRange<std::int32_t>(-1, 30);
    }
    ki.insert(ki.end(), row.begin(), row.end());
    kp.push_back(static_cast<std::int32_t>(ki.size()));
  }
  const KeepSet keep{kp.data(), ki.empty() ? nullptr : ki.data(), H, static_cast<std::int64_t>(ki.size())};
  MergeInput<float> in;
  if (T > 0) {
    in.keys = KVSource<float>::from(TensorView<const float, 3>(k.data(), {H, T, d}, {s0, s1, 1}));
    in.values = KVSource<float>::from(TensorView<const float, 3>(v.data(), {H, T, d}, {s0, s1, 1}));
    if (fdp.ConsumeBool()) in.attention_sums = TensorView<const float, 2>::contiguous(sums.data(), {H, T});
  }
  in.new_tokens = fdp.ConsumeIntegralInRange<std::int64_t>(-1, T + 1);
  in.seed = fdp.ConsumeIntegral<std::uint32_t>();
  // Plan buffers: capacity one entry per evicted token, sometimes short; merged rows, slots T.
  const std::int64_t cap = std::max<std::int64_t>(0, H * T - fdp.ConsumeIntegralInRange<int>(0, 2));
  std::vector<std::int32_t> pi(static_cast<std::size_t>(H + 1), kPoison), pd(static_cast<std::size_t>(cap), kPoison),
      ps(static_cast<std::size_t>(cap), kPoison);
  std::vector<float> pw(static_cast<std::size_t>(cap), -7.0f), mk(static_cast<std::size_t>(H * T * d), -7.0f), mv(mk);
  MergePlan plan{pi.data(), pd.empty() ? nullptr : pd.data(), ps.empty() ? nullptr : ps.data(), pw.empty() ? nullptr : pw.data(), H, cap};
  if (T > 0) {
    plan.slots_per_row = T;
    plan.merged_values = TensorView<float, 2>::contiguous(mv.data(), {H * T, d});
    if (fdp.ConsumeBool()) plan.merged_keys = TensorView<float, 2>::contiguous(mk.data(), {H * T, d});
  }
  const Requirements r = policy.requirements(Context<backend::Scalar>{}, ProblemShape{H, H, d, T, 1});
  if (!r.status.is_ok()) return;
  std::vector<std::byte> ws(r.workspace_bytes - (r.workspace_bytes > 0 && fdp.ConsumeIntegralInRange<int>(0, 15) == 0 ? 1 : 0));
  const auto pi0 = pi, pd0 = pd, ps0 = ps;
  const auto pw0 = pw, mk0 = mk, mv0 = mv;
  const Status s = policy.merge(Context<backend::Scalar>{Workspace{ws.empty() ? nullptr : ws.data(), ws.size()}}, in, keep, plan);
  if (!s.is_ok()) {
    KVP_FUZZ_CHECK(same_bytes(pi, pi0) && same_bytes(pd, pd0) && same_bytes(ps, ps0) && same_bytes(pw, pw0) && same_bytes(mk, mk0) &&
                       same_bytes(mv, mv0),
                   "%s failed (%s) but wrote the plan", P::kName, s.message());
    KVP_FUZZ_CHECK(s.message()[0] != '\0', "error without a message");
    return;
  }
  for (std::int64_t h = 0; h < H; ++h) {
    const auto kept = keep.row(h);
    KVP_FUZZ_CHECK(pi[h] <= pi[h + 1] && pi[h + 1] <= cap, "%s: plan indptr", P::kName);
    for (std::int32_t e = pi[h]; e < pi[h + 1]; ++e) {
      const bool src_kept = std::binary_search(kept.begin(), kept.end(), ps[e]);
      KVP_FUZZ_CHECK(pd[e] >= 0 && pd[e] < static_cast<std::int32_t>(kept.size()) && !src_kept && ps[e] >= 0 && ps[e] < T,
                     "%s: entry %d (dst slot %d, src %d) of head %lld", P::kName, e, pd[e], ps[e], static_cast<long long>(h));
      KVP_FUZZ_CHECK(std::isfinite(pw[e]) && pw[e] >= 0.0f, "%s: weight %g", P::kName, static_cast<double>(pw[e]));
    }
  }
  // Apply: merge into the cache and compact it, atomically.
  std::vector<float> ck = k, cv = v;
  std::vector<std::int32_t> pos(static_cast<std::size_t>(H * T));
  for (std::size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<std::int32_t>(i);
  std::vector<std::int64_t> lens(static_cast<std::size_t>(H), -7);
  const auto ck0 = ck, cv0 = cv;
  const auto pos0 = pos;
  const TensorView<float, 3> kv(ck.data(), {H, T, d}, {s0, s1, 1}), vv(cv.data(), {H, T, d}, {s0, s1, 1});
  const Status a = merge_and_compact_contiguous<float>(kv, vv, TensorView<std::int32_t, 2>::contiguous(pos.data(), {H, T}), T, keep, 0,
                                                       plan, std::span<std::int64_t>(lens));
  if (!a.is_ok()) {
    KVP_FUZZ_CHECK(same_bytes(ck, ck0) && same_bytes(cv, cv0) && same_bytes(pos, pos0) &&
                       std::all_of(lens.begin(), lens.end(), [](std::int64_t x) { return x == -7; }),
                   "merge_and_compact_contiguous failed (%s) but wrote", a.message());
    return;
  }
  for (std::int64_t h = 0; h < H; ++h) {
    const auto kept = keep.row(h);
    KVP_FUZZ_CHECK(lens[static_cast<std::size_t>(h)] == static_cast<std::int64_t>(kept.size()), "new length of head %lld",
                   static_cast<long long>(h));
    for (std::size_t c = 0; c < kept.size(); ++c)
      KVP_FUZZ_CHECK(pos[static_cast<std::size_t>(h * T) + c] == pos0[static_cast<std::size_t>(h * T + kept[c])], "positions");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider fdp(data, size);
  switch (fdp.ConsumeIntegralInRange<int>(0, 3)) {
    case 0: run(fdp, KvpressMerging{}); break;
    case 1:
      run(fdp, KvpressMerging{KvpressMergingParams{fdp.ConsumeFloatingPointInRange<float>(-0.1f, 1.1f),
                                                   fdp.ConsumeFloatingPointInRange<float>(-0.1f, 1.1f)}});
      break;
    case 2: run(fdp, LookMPivot{}); break;
    default: run(fdp, KvpressCAM{KvpressCAMParams{fdp.ConsumeIntegralInRange<std::int32_t>(-1, 8)}}); break;
  }
  return 0;
}
