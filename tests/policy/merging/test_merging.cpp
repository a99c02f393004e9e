// Merging policies on hand-computed cases: kvpress MergingPress and CAMPress,
// CaM (streaming and prefill), D2O, LOOK-M pivot, the nearest-kept weighted
// merge and MiniCache; bad input (nothing written) and Scalar == Cpu.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/merging/kvpress_cam.hpp"
#include "kvpolicy/policy/merging/cam.hpp"
#include "kvpolicy/policy/merging/d2o.hpp"
#include "kvpolicy/policy/merging/kvpress_merging.hpp"
#include "kvpolicy/policy/merging/lookm.hpp"
#include "kvpolicy/policy/merging/minicache.hpp"
#include "kvpolicy/policy/merging/nearest_kept.hpp"
#include "kvpolicy/util/thread_pool.hpp"
#include "merge_test_util.hpp"

using namespace kvpolicy;
using namespace kvp_merge_test;
using Catch::Matchers::Contains;

namespace {
MergeInput<float> kv_input(const std::vector<float>& k, const std::vector<float>& v, std::int64_t H, std::int64_t T, std::int64_t d) {
  MergeInput<float> in;
  if (!k.empty()) in.keys = KVSource<float>::from(TensorView<const float, 3>::contiguous(k.data(), {H, T, d}));
  in.values = KVSource<float>::from(TensorView<const float, 3>::contiguous(v.data(), {H, T, d}));
  return in;
}
}  // namespace

TEST_CASE("kvpress merging: an evicted value folds into its most similar kept token, weighted by similarity and value norms", "[merging]") {
  // K1 is parallel to K0 (cos 1) and orthogonal to K2; |V1| = |V0| = 5, so w = 1 * 5 / (5 + 5 + 1e-6).
  const std::vector<float> k = {1, 0, 2, 0, 0, 1}, v = {3, 4, 0, 5, 1, 1};
  const Keep keep({{0, 2}});
  PlanBuffer plan(1, 3, 2, 2, /*with_keys=*/false);
  REQUIRE(run_merge<backend::Scalar>(KvpressMerging{}, kv_input(k, v, 1, 3, 2), keep.view(), plan.view(), 1, 3, 2).is_ok());
  const double w = 5.0 / (10.0 + 1e-6);
  const auto e = plan.entries(0);
  REQUIRE(e.size() == 1);
  REQUIRE(e[0].dst == 0);
  REQUIRE(e[0].src == 1);
  REQUIRE(e[0].weight == Approx(w / (1 + w)));
  REQUIRE(plan.value_row(0, 0)[0] == Approx(3.0 / (1 + w)));
  REQUIRE(plan.value_row(0, 0)[1] == Approx((4.0 + 5.0 * w) / (1 + w)));
  REQUIRE(plan.value_row(0, 1)[0] == -7.0f);  // slot 1 received nothing: not written

  // A threshold above the similarity gates the merge off; merged_keys are rejected (values only).
  PlanBuffer p2(1, 3, 2, 2, false);
  REQUIRE(run_merge<backend::Scalar>(KvpressMerging(KvpressMergingParams{0.5f, 1.0f}), kv_input(k, {3, 4, 0, 5, 1, 1}, 1, 3, 2),
                                     Keep({{1, 2}}).view(), p2.view(), 1, 3, 2)
              .is_ok());
  REQUIRE(p2.entries(0).size() == 1);  // token 0 (parallel to 1) still merges into slot 0 (token 1)
  PlanBuffer p3(1, 3, 2, 2, /*with_keys=*/true);
  const Status s = run_merge<backend::Scalar>(KvpressMerging{}, kv_input(k, v, 1, 3, 2), keep.view(), p3.view(), 1, 3, 2);
  REQUIRE(!s.is_ok());
  REQUIRE_THAT(s.message(), Contains("merges values only"));
  REQUIRE(p3.untouched());
}

TEST_CASE("TorchBernoulli reproduces torch's CPU generator: torch.manual_seed then torch.rand or torch.bernoulli", "[merging]") {
  // torch.manual_seed(0); torch.rand(3) and seed 3 (tests/reference/make_merge_fixtures.py models the same generator).
  TorchBernoulli r0(0), r3(3);
  REQUIRE(r0.uniform() == 0.49625658988952637f);
  REQUIRE(r0.uniform() == 0.7682217955589294f);
  REQUIRE(r0.uniform() == 0.08847743272781372f);
  REQUIRE(r3.uniform() == 0.004263520240783691f);
  REQUIRE(r3.uniform() == 0.10556936264038086f);
  // The distribution: P(draw) = p, and p = 0 / 1 are never / always.
  for (float p : {0.0f, 0.3f, 0.7f, 1.0f}) {
    int hits = 0;
    const int n = 20000;
    TorchBernoulli r(11);
    for (int i = 0; i < n; ++i) hits += r.draw(p);
    INFO("p = " << p);
    REQUIRE(std::fabs(hits / static_cast<double>(n) - p) < 0.015);
    if (p == 0.0f) REQUIRE(hits == 0);
    if (p == 1.0f) REQUIRE(hits == n);
  }
}

TEST_CASE("kvpress CAM: a certain merge spreads the value over the next merge_budget kept tokens, the draw rate follows p", "[merging]") {
  const std::int64_t T = 5, d = 2;
  const std::vector<float> v = {1, 1, 4, 8, 10, 20, 30, 40, 50, 60};
  std::vector<float> attn = {1, 2, 1, 1, 1};  // A[1] = 2 > mean of its window (1): p = 1
  MergeInput<float> in = kv_input({}, v, 1, T, d);
  in.attention_sums = TensorView<const float, 2>::contiguous(attn.data(), {1, T});
  const Keep keep({{0, 2, 3, 4}});
  const KvpressCAM cam(KvpressCAMParams{2});
  PlanBuffer plan(1, T * 2, 4, d, false);
  REQUIRE(run_merge<backend::Scalar>(cam, in, keep.view(), plan.view(), 1, T, d).is_ok());
  const auto e = plan.entries(0);
  REQUIRE(e.size() == 2);
  REQUIRE((e[0].dst == 1 && e[1].dst == 2 && e[0].src == 1 && e[0].weight == 0.5f));
  REQUIRE(plan.value_row(0, 1)[0] == 10 + 2.0f);
  REQUIRE(plan.value_row(0, 1)[1] == 20 + 4.0f);
  REQUIRE(plan.value_row(0, 2)[1] == 40 + 4.0f);
  // p = A[1] / mean(window): over many seeds the merge happens with frequency p.
  attn = {1, 0.25f, 1, 1, 1};
  int merged = 0;
  for (std::uint32_t seed = 0; seed < 4000; ++seed) {
    in.seed = seed;
    PlanBuffer p(1, T * 2, 4, d, false);
    REQUIRE(run_merge<backend::Scalar>(cam, in, keep.view(), p.view(), 1, T, d).is_ok());
    merged += p.indptr[1] > 0;
  }
  REQUIRE(std::fabs(merged / 4000.0 - 0.25) < 0.03);
  // Scores are needed to pick fewer candidates than evicted tokens.
  in.new_tokens = 0;
  const Keep two({{0, 3, 4}});
  PlanBuffer p4(1, T * 2, 3, d, false);
  const Status s = run_merge<backend::Scalar>(cam, in, two.view(), p4.view(), 1, T, d);
  REQUIRE(!s.is_ok());
  REQUIRE_THAT(s.message(), Contains("scores"));
  REQUIRE(p4.untouched());
  // Different keep rows per head are rejected (CAMPress evicts per sequence).
  const std::vector<float> v2(2 * T * d, 1.0f), a2(2 * T, 1.0f);
  MergeInput<float> in2 = kv_input({}, v2, 2, T, d);
  in2.attention_sums = TensorView<const float, 2>::contiguous(a2.data(), {2, T});
  PlanBuffer p5(2, 2 * T * 2, 4, d, false);
  REQUIRE_THAT(run_merge<backend::Scalar>(cam, in2, Keep({{0, 2, 3, 4}, {0, 1, 3, 4}}).view(), p5.view(), 2, T, d).message(),
               Contains("differs from row 0"));
  REQUIRE(p5.untouched());
}

TEST_CASE("CaM streaming: the leaving token's value spreads over the next merge_num kept tokens, divided by merge_num", "[merging]") {
  const std::int64_t T = 4, d = 2;
  const std::vector<float> v = {0, 0, 8, 16, 1, 1, 2, 2};
  const std::vector<float> attn = {5, 3, 1, 1};  // p = 3 / mean(1, 1) -> 1
  MergeInput<float> in = kv_input({}, v, 1, T, d);
  in.attention_sums = TensorView<const float, 2>::contiguous(attn.data(), {1, T});
  const Keep keep({{0, 2, 3}});
  PlanBuffer plan(1, 16, 3, d, false);
  REQUIRE(run_merge<backend::Scalar>(CaM(CaMParams::streaming(4)), in, keep.view(), plan.view(), 1, T, d).is_ok());
  // Only 2 kept tokens follow token 1, but the original divides by merge_num = 4 regardless.
  REQUIRE(plan.entries(0).size() == 2);
  REQUIRE(plan.value_row(0, 1)[0] == 1 + 2.0f);
  REQUIRE(plan.value_row(0, 1)[1] == 1 + 4.0f);
  REQUIRE(plan.value_row(0, 2)[0] == 2 + 2.0f);
  REQUIRE(plan.value_row(0, 0)[0] == -7.0f);  // the sink received nothing
}

TEST_CASE("CaM prefill: simulated start+recent cache over the prompt attention, cascading merges, seeded draws", "[merging]") {
  SECTION("one event: p = a[e] / max(sinks u window), the draw decides") {
    const std::int64_t T = 4, d = 1;
    // Causal attention rows 0..3 (row 3 unused: only rows i < t = 3 enter a).
    const std::vector<float> A = {1, 0, 0, 0, .5f, .5f, 0, 0, .2f, .4f, .4f, 0, .25f, .25f, .25f, .25f};
    const std::vector<float> v = {1, 6, 10, 20};
    MergeInput<float> in = kv_input({}, v, 1, T, d);
    in.attention = TensorView<const float, 3>::contiguous(A.data(), {1, T, T});
    const Keep keep({{0, 2, 3}});  // start 1 + recent 2
    const CaM cam(CaMParams::prefill(1, 2));
    // a = (1.7, 0.9, 0.4) / 3; ref = max(a0, a1, a2) = a0; p = 0.9 / 1.7 = 0.529. seed 0 draws 0.496 (merge), seed 1 0.758 (no merge).
    for (std::uint32_t seed : {0u, 1u}) {
      in.seed = seed;
      PlanBuffer plan(1, 8, 3, d, false);
      REQUIRE(run_merge<backend::Scalar>(cam, in, keep.view(), plan.view(), 1, T, d).is_ok());
      if (seed == 0) {
        REQUIRE(plan.entries(0).size() == 2);
        REQUIRE(plan.value_row(0, 1)[0] == Approx(10 + 3.0));
        REQUIRE(plan.value_row(0, 2)[0] == Approx(20 + 3.0));
      } else {
        REQUIRE(plan.entries(0).empty());
      }
    }
  }
  SECTION("cascade: a token merged into, later evicted, carries what it absorbed") {
    const std::int64_t T = 5, d = 1;
    std::vector<float> A(T * T, 0.0f);
    for (std::int64_t i = 0; i < T; ++i) A[i * T + i] = 1.0f;  // flat a: every p = 1
    const std::vector<float> v = {100, 4, 8, 16, 32};
    MergeInput<float> in = kv_input({}, v, 1, T, d);
    in.attention = TensorView<const float, 3>::contiguous(A.data(), {1, T, T});
    PlanBuffer plan(1, 8, 3, d, false);
    REQUIRE(run_merge<backend::Scalar>(CaM(CaMParams::prefill(1, 2)), in, Keep({{0, 3, 4}}).view(), plan.view(), 1, T, d).is_ok());
    // t=3: e=1 -> V2, V3 += V1/2; t=4: e=2 -> V3, V4 += V2'/2 with V2' = V2 + V1/2.
    REQUIRE(plan.value_row(0, 1)[0] == Approx(16 + 0.75 * 4 + 0.5 * 8));
    REQUIRE(plan.value_row(0, 2)[0] == Approx(32 + 0.5 * 8 + 0.25 * 4));
    // The plan lists the direct entries into kept tokens: (slot 1 <- 1), (slot 1 <- 2), (slot 2 <- 2).
    REQUIRE(plan.entries(0).size() == 3);
    // The keep set must be the start + recent set.
    PlanBuffer bad(1, 8, 3, d, false);
    REQUIRE_THAT(run_merge<backend::Scalar>(CaM(CaMParams::prefill(1, 2)), in, Keep({{0, 2, 4}}).view(), bad.view(), 1, T, d).message(),
                 Contains("start + recent"));
    REQUIRE(bad.untouched());
  }
}

TEST_CASE("D2O: EMA threshold, shared decision, as-coded mean (shrinks) or normalised weighted merge of K and V", "[merging]") {
  const std::int64_t T = 3, d = 2;
  // cos(K1, K0) = 0.6, cos(K1, K2) = 0.8: token 1 merges into slot 1 (token 2) with s = 0.8.
  const std::vector<float> k = {1, 0, 0.6f, 0.8f, 0, 1}, v = {1, 1, 2, 4, 10, 20};
  D2OInput<float> in;
  in.keys = KVSource<float>::from(TensorView<const float, 3>::contiguous(k.data(), {1, T, d}));
  in.values = KVSource<float>::from(TensorView<const float, 3>::contiguous(v.data(), {1, T, d}));
  D2OState st;
  in.state = &st;
  const Keep keep({{0, 2}});
  PlanBuffer plan(1, 3, 2, d);
  REQUIRE(run_merge<backend::Scalar>(D2O{}, in, keep.view(), plan.view(), 1, T, d).is_ok());
  REQUIRE(st.initialised);
  REQUIRE(st.tau == Approx(0.8f));  // first call: tau = mean(s); 0.8 >= 0.8 merges
  REQUIRE(plan.entries(0).size() == 1);
  REQUIRE(plan.entries(0)[0].weight == Approx(0.4f));
  REQUIRE(plan.key_row(0, 1)[0] == Approx(0.24f));  // (K2 + 0.8 K1) / 2
  REQUIRE(plan.key_row(0, 1)[1] == Approx(0.82f));
  REQUIRE(plan.value_row(0, 1)[0] == Approx((10 + 0.8 * 2) / 2));
  // Normalised: divide by 1 + s.
  D2OState st2;
  in.state = &st2;
  D2OParams np;
  np.weighting = D2OWeighting::kNormalized;
  PlanBuffer p2(1, 3, 2, d);
  REQUIRE(run_merge<backend::Scalar>(D2O(np), in, keep.view(), p2.view(), 1, T, d).is_ok());
  REQUIRE(p2.key_row(0, 1)[1] == Approx((1 + 0.64) / 1.8));
  // Second call: tau <- 0.5 tau + 0.5 mean(s); a token less similar than tau is dropped, not merged.
  const Keep keep2({{1, 2}});  // evicts token 0: cos(K0, K1) = 0.6 < 0.5 * 0.8 + 0.5 * 0.6 = 0.7
  in.state = &st;
  PlanBuffer p3(1, 3, 2, d);
  REQUIRE(run_merge<backend::Scalar>(D2O{}, in, keep2.view(), p3.view(), 1, T, d).is_ok());
  REQUIRE(st.tau == Approx(0.7f));
  REQUIRE(p3.entries(0).empty());
  // A null state is an error and leaves the plan untouched.
  in.state = nullptr;
  PlanBuffer p4(1, 3, 2, d);
  REQUIRE_THAT(run_merge<backend::Scalar>(D2O{}, in, keep.view(), p4.view(), 1, T, d).message(), Contains("state is null"));
  REQUIRE(p4.untouched());
}

TEST_CASE("D2O layer budget: softmax of negated normalised variances, layers 0, 1 and last uncompressed", "[merging]") {
  // 4 layers x 2 heads; layer 2's heads (0, 1) normalise to v = 0.5, layer 3's too; layer 0, 1 flat (v = 0).
  const std::vector<float> var = {1, 1, 2, 2, 0, 4, 1, 3};
  std::vector<double> r(4);
  REQUIRE(D2O{}.layer_ratios(TensorView<const float, 2>::contiguous(var.data(), {4, 2}), r).is_ok());
  const double z = 2 * std::exp(0.0) + 2 * std::exp(-0.5);
  REQUIRE(r[0] == 1.0);
  REQUIRE(r[1] == 1.0);
  REQUIRE(r[3] == 1.0);
  REQUIRE(r[2] == Approx(std::exp(-0.5) / z * 4 * 0.2));
  // Without the protected edge layers every layer takes the formula.
  D2OParams all;
  all.protect_edge_layers = false;
  REQUIRE(D2O(all).layer_ratios(TensorView<const float, 2>::contiguous(var.data(), {4, 2}), r).is_ok());
  REQUIRE(r[0] == Approx(1.0 / z * 4 * 0.2));
  REQUIRE(r[1] == Approx(1.0 / z * 4 * 0.2));
  REQUIRE(r[2] == Approx(std::exp(-0.5) / z * 4 * 0.2));
  REQUIRE(r[3] == Approx(std::exp(-0.5) / z * 4 * 0.2));
  std::vector<float> cv(2);
  const std::vector<float> cols = {1, 3, 2, 2};
  REQUIRE(D2O::column_variance(TensorView<const float, 2>::contiguous(cols.data(), {2, 2}), cv).is_ok());
  REQUIRE(cv[0] == 1.0f);
  REQUIRE(cv[1] == 0.0f);
  // Token level eviction: sinks, top heavy of the past, the recent tail.
  D2OParams p;
  p.heavy = 2;
  p.recent = 2;
  p.sinks = 1;
  const std::vector<float> sc = {0, 5, 1, 9, 7, 7, 3};
  std::vector<std::int32_t> ip(2), ids(4);
  std::vector<std::byte> ws(D2O::evict_workspace(7));
  REQUIRE(
      D2O(p)
          .evict(TensorView<const float, 2>::contiguous(sc.data(), {1, 7}), KeepSet{ip.data(), ids.data(), 1, 4}, {ws.data(), ws.size()})
          .is_ok());
  REQUIRE(ids == std::vector<std::int32_t>{0, 3, 5, 6});  // sink 0, best past 3 (9), recent 5, 6
}

TEST_CASE("LOOK-M pivot: each evicted token averages with its pivot, K and V merged with the same assignment", "[merging]") {
  const std::int64_t T = 3, d = 2;
  const std::vector<float> k = {1, 0, 0.6f, 0.8f, 0, 1}, v = {1, 1, 2, 4, 10, 20};
  PlanBuffer plan(1, 3, 2, d);
  REQUIRE(run_merge<backend::Scalar>(LookMPivot{}, kv_input(k, v, 1, T, d), Keep({{0, 2}}).view(), plan.view(), 1, T, d).is_ok());
  // K2' = mean(K2, (K1 + K2) / 2) = 0.75 K2 + 0.25 K1; V2' likewise (aligned with K).
  REQUIRE(plan.entries(0).size() == 1);
  REQUIRE(plan.entries(0)[0].weight == Approx(0.25f));
  REQUIRE(plan.key_row(0, 1)[0] == Approx(0.15f));
  REQUIRE(plan.key_row(0, 1)[1] == Approx(0.95f));
  REQUIRE(plan.value_row(0, 1)[0] == Approx(0.75 * 10 + 0.25 * 2));
  REQUIRE(plan.value_row(0, 1)[1] == Approx(0.75 * 20 + 0.25 * 4));
  // Two evicted tokens into one pivot: (1 + n/2) K_c + sum K_e / 2, over 1 + n.
  const std::vector<float> k3 = {0, 1, 0.6f, 0.8f, 0.8f, 0.6f, 1, 0};
  const std::vector<float> v3 = {0, 0, 2, 2, 4, 4, 8, 8};
  PlanBuffer p2(1, 4, 2, d);
  REQUIRE(run_merge<backend::Scalar>(LookMPivot{}, kv_input(k3, v3, 1, 4, d), Keep({{0, 3}}).view(), p2.view(), 1, 4, d).is_ok());
  // cos(K1, K0) = 0.8 vs cos(K1, K3) = 0.6 -> slot 0; K2 -> slot 1 (0.8).
  REQUIRE(p2.entries(0).size() == 2);
  REQUIRE(p2.value_row(0, 0)[0] == Approx((1.5 * 0 + 0.5 * 2) / 2));
  REQUIRE(p2.value_row(0, 1)[0] == Approx((1.5 * 8 + 0.5 * 4) / 2));
}

TEST_CASE("nearest-kept merge: persistent weights keep repeated merges into one slot a true weighted average", "[merging]") {
  const std::int64_t d = 2;
  // Step 1: tokens (K0, K1, K2); K1 is nearest to K2; all masses 1.
  std::vector<float> k = {1, 0, 0.6f, 0.8f, 0, 1}, v = {1, 1, 2, 4, 10, 20};
  std::vector<float> w = {1, 1, 1, 9};  // capacity 4; slot 3 unused
  NearestKeptInput<float> in;
  in.keys = KVSource<float>::from(TensorView<const float, 3>::contiguous(k.data(), {1, 3, d}));
  in.values = KVSource<float>::from(TensorView<const float, 3>::contiguous(v.data(), {1, 3, d}));
  in.state.weights = TensorView<float, 2>::contiguous(w.data(), {1, 4});
  PlanBuffer plan(1, 3, 2, d);
  REQUIRE(run_merge<backend::Scalar>(NearestKeptMerge{}, in, Keep({{0, 2}}).view(), plan.view(), 1, 3, d).is_ok());
  REQUIRE(plan.key_row(0, 1)[0] == Approx(0.3f));  // (K2 + K1) / 2
  REQUIRE(plan.value_row(0, 1)[1] == Approx(12.0f));
  REQUIRE(w[0] == 1.0f);  // re-packed in kept order: slot 0 (token 0) mass 1, slot 1 (token 2) mass 2
  REQUIRE(w[1] == 2.0f);
  // Step 2: the compacted cache (K0, K2') plus a new token K3 of mass 1, nearest to K2'; evict it.
  const float k2m[2] = {plan.key_row(0, 1)[0], plan.key_row(0, 1)[1]}, v2m[2] = {plan.value_row(0, 1)[0], plan.value_row(0, 1)[1]};
  k = {1, 0, k2m[0], k2m[1], 0.1f, 1};
  v = {1, 1, v2m[0], v2m[1], 7, 5};
  REQUIRE(NearestKeptMerge::init_weights(in.state, 0, 2, 3, 1.0f).is_ok());
  PlanBuffer p2(1, 3, 2, d);
  REQUIRE(run_merge<backend::Scalar>(NearestKeptMerge{}, in, Keep({{0, 1}}).view(), p2.view(), 1, 3, d).is_ok());
  // (2 K2' + K3) / 3 == (K1 + K2 + K3) / 3: the average of all three original tokens.
  REQUIRE(p2.key_row(0, 1)[0] == Approx((0.6 + 0 + 0.1) / 3));
  REQUIRE(p2.key_row(0, 1)[1] == Approx((0.8 + 1 + 1) / 3));
  REQUIRE(p2.value_row(0, 1)[0] == Approx((2 + 10 + 7) / 3.0));
  REQUIRE(p2.entries(0)[0].weight == Approx(1.0 / 3));
  REQUIRE(w[1] == 3.0f);
  // A threshold above the similarity drops instead of merging; bad state is rejected, nothing written.
  PlanBuffer p3(1, 3, 2, d);
  REQUIRE(
      run_merge<backend::Scalar>(NearestKeptMerge(NearestKeptMergeParams{0.9999f, false}), in, Keep({{0, 1}}).view(), p3.view(), 1, 3, d)
          .is_ok());
  REQUIRE(p3.entries(0).empty());
  w[0] = -1.0f;
  const std::vector<float> before = w;
  PlanBuffer p4(1, 3, 2, d);
  REQUIRE_THAT(run_merge<backend::Scalar>(NearestKeptMerge{}, in, Keep({{0, 1}}).view(), p4.view(), 1, 3, d).message(),
               Contains("must be finite and > 0"));
  REQUIRE(p4.untouched());
  REQUIRE(w == before);
}

namespace {
struct MiniStore {
  std::vector<float> dir, np, nc, rp, rc;
  std::vector<std::int32_t> indptr, idx;
  MiniCacheMerged m;
  MiniStore(std::int64_t H, std::int64_t T, std::int64_t d)
      : dir(H * T * d), np(H * T), nc(H * T), rp(H * T * d), rc(H * T * d), indptr(H + 1), idx(H * T) {
    m.direction = TensorView<float, 3>::contiguous(dir.data(), {H, T, d});
    m.norm_prev = TensorView<float, 2>::contiguous(np.data(), {H, T});
    m.norm_cur = TensorView<float, 2>::contiguous(nc.data(), {H, T});
    m.retained = KeepSet{indptr.data(), idx.data(), H, H * T};
    m.retained_prev = TensorView<float, 2>::contiguous(rp.data(), {H * T, d});
    m.retained_cur = TensorView<float, 2>::contiguous(rc.data(), {H * T, d});
  }
};
}  // namespace

TEST_CASE("MiniCache: SLERP of the directions, both norms kept, the most distinct pairs retained and restored exactly", "[merging]") {
  const std::int64_t H = 1, T = 4, d = 2;
  // Tokens 0-2: small angles (0, ~5.7, ~11.3 degrees); token 3: orthogonal (90 degrees) -> the outlier.
  const std::vector<float> prev = {2, 0, 1, 0, 1, 0, 3, 0};
  const std::vector<float> cur = {4, 0, 1, 0.1f, 1, 0.2f, 0, 5};
  MiniCacheInput<float> in{KVSource<float>::from(TensorView<const float, 3>::contiguous(prev.data(), {H, T, d})),
                           KVSource<float>::from(TensorView<const float, 3>::contiguous(cur.data(), {H, T, d}))};
  MiniStore st(H, T, d);
  const MiniCache mc(MiniCacheParams{0.5f, 0.5f});
  std::vector<std::byte> ws(mc.requirements(Context<backend::Scalar>{}, ProblemShape{H, H, d, T, 1}).workspace_bytes);
  REQUIRE(mc.merge(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}}, in, st.m).is_ok());
  REQUIRE(st.indptr[1] == 1);  // distances (0, .032, .063, .5): only token 3 exceeds min + 0.5 (max - min)
  REQUIRE(st.idx[0] == 3);
  REQUIRE(st.np[0] == 2.0f);
  REQUIRE(st.nc[0] == 4.0f);
  REQUIRE(st.dir[0] == Approx(1.0f));  // parallel pair: the shared direction
  // Orthogonal pair at t = 0.5: e = (u + w) / sqrt(2).
  REQUIRE(st.dir[6] == Approx(std::sqrt(0.5)));
  REQUIRE(st.dir[7] == Approx(std::sqrt(0.5)));
  std::vector<float> outp(H * T * d), outc(H * T * d);
  REQUIRE(mc.restore(st.m, 0, TensorView<float, 3>::contiguous(outp.data(), {H, T, d})).is_ok());
  REQUIRE(mc.restore(st.m, 1, TensorView<float, 3>::contiguous(outc.data(), {H, T, d})).is_ok());
  REQUIRE(outp[6] == 3.0f);  // retained: exact
  REQUIRE(outc[7] == 5.0f);
  REQUIRE(outp[0] == Approx(2.0f));  // merged: norm x shared direction
  REQUIRE(outc[0] == Approx(4.0f));
  // Token 1: directions 0 and ~5.7 degrees, SLERP at 0.5 -> ~2.86 degrees, norms 1 and |(1, .1)|.
  const double ang = std::atan2(0.1, 1.0) / 2;
  REQUIRE(outp[2] == Approx(std::cos(ang)).epsilon(1e-5));
  REQUIRE(outc[3] == Approx(std::hypot(1.0, 0.1) * std::sin(ang)).epsilon(1e-5));
  // Bad parameters and shapes are rejected before anything is written.
  REQUIRE_THAT(MiniCache(MiniCacheParams{1.5f, 0.0f}).validate_params().message(), Contains("t is 1.5"));
  MiniStore small(H, T - 1, d);
  REQUIRE_THAT(mc.merge(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}}, in, small.m).message(), Contains("direction has shape"));
}

TEST_CASE("merging: bad keep sets, short plans and workspaces are rejected with nothing written", "[merging]") {
  const std::int64_t T = 6, d = 4, H = 2;
  std::vector<float> k(H * T * d), v(H * T * d);
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = std::sin(0.7f * static_cast<float>(i)), v[i] = std::cos(0.3f * static_cast<float>(i));
  const auto in = kv_input(k, v, H, T, d);
  const LookMPivot pol;
  auto expect = [&](const Keep& keep, PlanBuffer& plan, const char* msg, std::size_t ws_bytes = SIZE_MAX) {
    auto ws = workspace_for<backend::Scalar>(pol, H, T, d);
    const Status s = pol.merge(Context<backend::Scalar>{Workspace{ws.data(), std::min(ws.size(), ws_bytes)}}, in, keep.view(), plan.view());
    INFO(s.message());
    REQUIRE(!s.is_ok());
    REQUIRE_THAT(s.message(), Contains(msg));
    REQUIRE(plan.untouched());
  };
  PlanBuffer p1(H, H * T, T, d);
  expect(Keep({{0, 2, 2}, {1, 3}}), p1, "not strictly ascending");
  PlanBuffer p2(H, H * T, T, d);
  expect(Keep({{0, 7}, {1, 3}}), p2, "out of range");
  PlanBuffer p3(H, H * T, T, d);
  expect(Keep({{0, 1}}), p3, "one per kv head");
  PlanBuffer p4(H, 3, T, d);  // 8 evicted tokens, capacity 3
  expect(Keep({{0, 1}, {2, 3}}), p4, "capacity is 3");
  PlanBuffer p5(H, H * T, 1, d);  // merged buffers of 1 slot per row for 2 kept tokens
  expect(Keep({{0, 1}, {2, 3}}), p5, "slots_per_row");
  PlanBuffer p6(H, H * T, T, d);
  expect(Keep({{0, 1}, {2, 3}}), p6, "workspace", 16);
  // Keys and values of different shapes.
  const auto bad = kv_input(k, std::vector<float>(H * (T - 1) * d), H, T, d);
  MergeInput<float> b2 = in;
  b2.values = KVSource<float>::from(TensorView<const float, 3>::contiguous(v.data(), {H, T - 1, d}));
  PlanBuffer p7(H, H * T, T, d);
  auto ws = workspace_for<backend::Scalar>(pol, H, T, d);
  REQUIRE_THAT(pol.merge(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}}, b2, Keep({{0}, {0}}).view(), p7.view()).message(),
               Contains("values has shape"));
  REQUIRE(p7.untouched());
  (void)bad;
  // NaN attention sums (CaM streaming) are rejected.
  std::vector<float> a(H * T, 1.0f);
  a[3] = std::nanf("");
  MergeInput<float> c = in;
  c.attention_sums = TensorView<const float, 2>::contiguous(a.data(), {H, T});
  PlanBuffer p8(H, H * T * 16, T, d, false);
  REQUIRE_THAT(run_merge<backend::Scalar>(CaM{}, c, Keep({{0, 1}, {0, 1}}).view(), p8.view(), H, T, d).message(),
               Contains("attention_sums(0, 3)"));
  REQUIRE(p8.untouched());
}

TEST_CASE("merging: Scalar == Cpu (any thread count) bit for bit on random fp16 caches, every policy", "[merging]") {
  const std::int64_t H = 3, T = 64, d = 24;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  std::vector<half> k(H * T * d), v(H * T * d);
  for (auto& x : k) x = from_float<half>(nd(rng));
  for (auto& x : v) x = from_float<half>(nd(rng));
  std::vector<float> attn(H * T);
  for (auto& x : attn) x = std::fabs(nd(rng)) + 0.1f;
  std::vector<std::vector<std::int32_t>> rows(H);
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int32_t j = 0; j < T; ++j)
      if (j < 4 || j >= T - 8 || (j * 7 + h) % 5 == 0) rows[h].push_back(j);
  std::vector<std::vector<std::int32_t>> same(H, rows[0]);
  MergeInput<half> in;
  in.keys = KVSource<half>::from(TensorView<const half, 3>::contiguous(k.data(), {H, T, d}));
  in.values = KVSource<half>::from(TensorView<const half, 3>::contiguous(v.data(), {H, T, d}));
  in.attention_sums = TensorView<const float, 2>::contiguous(attn.data(), {H, T});
  in.seed = 9;
  ThreadPool pool(2);
  auto both = [&](const auto& policy, const auto& input, const Keep& keep, bool keys, std::int64_t per_token) {
    PlanBuffer a(H, H * T * per_token, T, d, keys), b(H, H * T * per_token, T, d, keys);
    REQUIRE(run_merge<backend::Scalar>(policy, input, keep.view(), a.view(), H, T, d).is_ok());
    auto ws = workspace_for<backend::Cpu>(policy, H, T, d, 0, pool.context());
    REQUIRE(policy.merge(Context<backend::Cpu>{Workspace{ws.data(), ws.size()}, pool.context()}, input, keep.view(), b.view()).is_ok());
    REQUIRE(a.indptr == b.indptr);
    REQUIRE(a.dst == b.dst);
    REQUIRE(a.src == b.src);
    REQUIRE(a.weight == b.weight);
    REQUIRE(a.keys == b.keys);
    REQUIRE(a.values == b.values);
    REQUIRE(a.indptr.back() > 0);  // something merged
  };
  const Keep ragged(rows), uniform(same);
  {  // a workspace sized for one worker is too small for a pool of two: rejected, nothing written
    auto ws1 = workspace_for<backend::Cpu>(LookMPivot{}, H, T, d);
    PlanBuffer p(H, H * T, T, d);
    const Status s =
        LookMPivot{}.merge(Context<backend::Cpu>{Workspace{ws1.data(), ws1.size()}, pool.context()}, in, ragged.view(), p.view());
    REQUIRE(s.code() == StatusCode::kWorkspaceTooSmall);
    REQUIRE(p.untouched());
  }
  both(KvpressMerging(KvpressMergingParams{0.0f, 0.75f}), in, ragged, false, 1);
  both(KvpressCAM{}, in, uniform, false, 32);
  both(CaM{}, in, ragged, false, 16);
  both(LookMPivot{}, in, ragged, true, 1);
  D2OState s1, s2;
  D2OInput<half> din;
  static_cast<MergeInput<half>&>(din) = in;
  din.state = &s1;
  {
    PlanBuffer a(H, H * T, T, d), b(H, H * T, T, d);
    REQUIRE(run_merge<backend::Scalar>(D2O{}, din, uniform.view(), a.view(), H, T, d).is_ok());
    din.state = &s2;
    auto ws = workspace_for<backend::Cpu>(D2O{}, H, T, d, 0, pool.context());
    REQUIRE(D2O{}.merge(Context<backend::Cpu>{Workspace{ws.data(), ws.size()}, pool.context()}, din, uniform.view(), b.view()).is_ok());
    REQUIRE((a.keys == b.keys && a.values == b.values && a.indptr == b.indptr && s1.tau == s2.tau));
  }
  std::vector<float> w1(H * T, 1.0f), w2(H * T, 1.0f);
  NearestKeptInput<half> nin;
  static_cast<MergeInput<half>&>(nin) = in;
  nin.state.weights = TensorView<float, 2>::contiguous(w1.data(), {H, T});
  {
    PlanBuffer a(H, H * T, T, d), b(H, H * T, T, d);
    REQUIRE(run_merge<backend::Scalar>(NearestKeptMerge{}, nin, ragged.view(), a.view(), H, T, d).is_ok());
    nin.state.weights = TensorView<float, 2>::contiguous(w2.data(), {H, T});
    auto ws = workspace_for<backend::Cpu>(NearestKeptMerge{}, H, T, d, 0, pool.context());
    REQUIRE(NearestKeptMerge{}
                .merge(Context<backend::Cpu>{Workspace{ws.data(), ws.size()}, pool.context()}, nin, ragged.view(), b.view())
                .is_ok());
    REQUIRE((a.keys == b.keys && a.values == b.values && w1 == w2));
  }
}

TEST_CASE("row_dots: the CPU kernels equal the scalar reference bit for bit at every ISA level, any n and head_dim", "[merging][cpu]") {
  std::mt19937 rng(21);
  std::normal_distribution<float> nd;
  struct Restore {
    CpuIsa saved = backend::Cpu::isa();
    ~Restore() { backend::Cpu::set_isa(saved); }
  } restore;
  const CpuIsa best = backend::Cpu::best_isa();
  for (CpuIsa isa : {CpuIsa::kSse2, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (isa > best) continue;
    REQUIRE(backend::Cpu::set_isa(isa));
    INFO(cpu_isa_name(isa));
    for (std::int64_t d : {1, 7, 16, 17, 40, 128, 130})
      for (std::int64_t n : {1, 3, 4, 5, 9, 33}) {
        std::vector<float> q(d), rows(n * d), a(n), b(n);
        for (auto& x : q) x = nd(rng);
        for (auto& x : rows) x = nd(rng);
        backend::Scalar::row_dots(q.data(), rows.data(), n, d, a.data());
        backend::Cpu::row_dots(q.data(), rows.data(), n, d, b.data());
        INFO("d = " << d << ", n = " << n);
        REQUIRE(a == b);
        double ref = 0.0;
        for (std::int64_t c = 0; c < d; ++c) ref += static_cast<double>(q[c]) * rows[(n - 1) * d + c];
        REQUIRE(a[n - 1] == Approx(ref).margin(1e-4));
      }
    // widen_row: every fp16 bit pattern (subnormals, inf, NaN payloads) widens to the same fp32 bits.
    std::vector<half> all(65536 + 5);
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = half::from_bits(static_cast<std::uint16_t>(i * 40503u));
    std::vector<float> wa(all.size()), wb(all.size());
    backend::Scalar::widen_row(all.data(), static_cast<std::int64_t>(all.size()), wa.data());
    backend::Cpu::widen_row(all.data(), static_cast<std::int64_t>(all.size()), wb.data());
    REQUIRE(std::memcmp(wa.data(), wb.data(), wa.size() * sizeof(float)) == 0);
    // A whole policy on this level equals the scalar backend (head_dim 40: a 16-channel tail of 8).
    const std::int64_t H = 2, T = 50, d = 40;
    std::vector<float> k(H * T * d), v(H * T * d);
    for (auto& x : k) x = nd(rng);
    for (auto& x : v) x = nd(rng);
    std::vector<std::vector<std::int32_t>> rows(H);
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int32_t j = 0; j < T; ++j)
        if (j % 3 != static_cast<int>(h)) rows[h].push_back(j);
    const Keep keep(rows);
    PlanBuffer a(H, H * T, T, d), b(H, H * T, T, d);
    REQUIRE(run_merge<backend::Scalar>(LookMPivot{}, kv_input(k, v, H, T, d), keep.view(), a.view(), H, T, d).is_ok());
    REQUIRE(run_merge<backend::Cpu>(LookMPivot{}, kv_input(k, v, H, T, d), keep.view(), b.view(), H, T, d).is_ok());
    REQUIRE((a.keys == b.keys && a.values == b.values && a.dst == b.dst));
  }
}
