// Merging policies on hand-computed cases: kvpress MergingPress and CAMPress,
// CaM (streaming and prefill), D2O, LOOK-M pivot, the nearest-kept weighted
// merge and MiniCache; bad input (nothing written) and Scalar == Cpu.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/merging/kvpress_cam.hpp"
#include "kvpolicy/policy/merging/kvpress_merging.hpp"
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
