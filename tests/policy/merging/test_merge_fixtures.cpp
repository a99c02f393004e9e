// Cross-check of the kvpress merge presses against kvpress 0.5.5 itself
// (tests/data/fixtures/merge_kvpress.json, tests/reference/make_merge_fixtures.py):
// MergingPress.merge on a given kept set, and CAMPress.compress (eviction by
// head-mean KnormPress scores, Bernoulli draws after torch.manual_seed) —
// kept sets equal, merged values within 1e-6 of each row's max |value|
// (float32 summation order), on Scalar and Cpu.
#include <catch2/catch.hpp>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/merging/kvpress_cam.hpp"
#include "kvpolicy/policy/merging/kvpress_merging.hpp"
#include "merge_test_util.hpp"

using namespace kvpolicy;
using namespace kvp_merge_test;

namespace {

nlohmann::json load() {
  std::ifstream f(std::string(KVP_TEST_DATA_DIR) + "/fixtures/merge_kvpress.json");
  REQUIRE(f.good());
  return nlohmann::json::parse(f);
}

std::vector<float> floats(const nlohmann::json& j) {
  std::vector<float> v;
  for (const auto& x : j) v.push_back(static_cast<float>(x.get<double>()));
  return v;
}

/// max |a - b| over each row of d, relative to the row's max |b|.
double row_rel_err(const float* a, const float* b, std::int64_t d) {
  double mx = 1e-30, err = 0.0;
  for (std::int64_t c = 0; c < d; ++c) {
    mx = std::max(mx, std::fabs(static_cast<double>(b[c])));
    err = std::max(err, std::fabs(static_cast<double>(a[c]) - b[c]));
  }
  return err / mx;
}

constexpr double kTol = 1e-6;  // observed <= 5e-7 (a few float32 ulps of summation order)

template <class B>
void check_merging_case(const nlohmann::json& c) {
  const std::int64_t H = c["H"], T = c["T"], d = c["d"];
  const auto keys = floats(c["keys"]), values = floats(c["values"]), want = floats(c["merged_values"]);
  std::vector<std::vector<std::int32_t>> rows;
  for (const auto& r : c["kept"]) rows.push_back(r.get<std::vector<std::int32_t>>());
  const Keep keep(rows);
  const auto n_kept = static_cast<std::int64_t>(rows[0].size());
  const KvpressMerging policy(KvpressMergingParams{c["similarity_threshold"].get<float>(), c["merge_fraction"].get<float>()});
  MergeInput<float> in;
  in.keys = KVSource<float>::from(TensorView<const float, 3>::contiguous(keys.data(), {H, T, d}));
  in.values = KVSource<float>::from(TensorView<const float, 3>::contiguous(values.data(), {H, T, d}));
  PlanBuffer plan(H, H * T, n_kept, d, /*with_keys=*/false);
  REQUIRE(run_merge<B>(policy, in, keep.view(), plan.view(), H, T, d).is_ok());
  std::int64_t changed = 0;
  for (std::int64_t h = 0; h < H; ++h) {
    std::vector<char> touched(static_cast<std::size_t>(n_kept), 0);
    for (const auto& e : plan.entries(h)) {
      touched[static_cast<std::size_t>(e.dst)] = 1;
      REQUIRE(e.weight > 0.0f);
      REQUIRE(std::find(rows[h].begin(), rows[h].end(), e.src) == rows[h].end());
    }
    for (std::int64_t k = 0; k < n_kept; ++k) {
      const float* ref = &want[static_cast<std::size_t>((h * n_kept + k) * d)];
      const float* orig = &values[static_cast<std::size_t>((h * T + rows[h][k]) * d)];
      const float* got = touched[k] ? plan.value_row(h, k) : orig;
      INFO("head " << h << " slot " << k);
      REQUIRE(row_rel_err(got, ref, d) <= kTol);
      changed += touched[k];
    }
  }
  REQUIRE(changed == c["slots_changed"].get<std::int64_t>());
}

template <class B>
void check_cam_case(const nlohmann::json& c) {
  const std::int64_t H = c["H"], T = c["T"], d = c["d"], target = c["target_size"];
  const auto values = floats(c["values"]), attn = floats(c["attention_sums"]), scores = floats(c["scores"]),
             want = floats(c["merged_values"]);
  const KvpressCAM policy(KvpressCAMParams{c["merge_budget"].get<std::int32_t>()});
  // Step 0: the kept set from the head-mean scores equals kvpress's.
  std::vector<std::int32_t> indptr(H + 1), idx(H * target);
  KeepSet keep{indptr.data(), idx.data(), H, H * target};
  std::vector<std::byte> ews(KvpressCAM::evict_workspace(T));
  REQUIRE(
      policy.evict(TensorView<const float, 2>::contiguous(scores.data(), {H, T}), target, keep, Workspace{ews.data(), ews.size()}).is_ok());
  const auto kept = c["kept"].get<std::vector<std::int32_t>>();
  for (std::int64_t h = 0; h < H; ++h) REQUIRE(std::vector<std::int32_t>(keep.row(h).begin(), keep.row(h).end()) == kept);

  MergeInput<float> in;
  in.values = KVSource<float>::from(TensorView<const float, 3>::contiguous(values.data(), {H, T, d}));
  in.attention_sums = TensorView<const float, 2>::contiguous(attn.data(), {H, T});
  in.scores = TensorView<const float, 2>::contiguous(scores.data(), {H, T});
  in.new_tokens = c["new_tokens"];
  in.seed = c["seed"];
  PlanBuffer plan(H, H * T * policy.params().merge_budget, target, d, /*with_keys=*/false);
  REQUIRE(run_merge<B>(policy, in, keep, plan.view(), H, T, d).is_ok());
  std::int64_t draws = 0;
  for (std::int64_t h = 0; h < H; ++h) {
    const auto e = plan.entries(h);
    std::vector<char> touched(static_cast<std::size_t>(target), 0);
    for (std::size_t i = 0; i < e.size(); ++i) {
      touched[static_cast<std::size_t>(e[i].dst)] = 1;
      if (i == 0 || e[i].src != e[i - 1].src) ++draws;
    }
    for (std::int64_t k = 0; k < target; ++k) {
      const float* ref = &want[static_cast<std::size_t>((h * target + k) * d)];
      const float* orig = &values[static_cast<std::size_t>((h * T + kept[k]) * d)];
      const float* got = touched[k] ? plan.value_row(h, k) : orig;
      INFO("head " << h << " slot " << k);
      REQUIRE(row_rel_err(got, ref, d) <= kTol);
    }
  }
  REQUIRE(draws == c["draws"].get<std::int64_t>());
}

}  // namespace

TEST_CASE("kvpress MergingPress fixtures: merged values equal kvpress 0.5.5 (Scalar and Cpu)", "[merging][fixtures]") {
  const auto doc = load();
  REQUIRE(doc["versions"]["kvpress"] == "0.5.5");
  int n = 0;
  for (const auto& c : doc["cases"]) {
    if (c["kind"] != "merging_press") continue;
    INFO("case " << n << " H=" << c["H"] << " T=" << c["T"] << " d=" << c["d"]);
    check_merging_case<backend::Scalar>(c);
    check_merging_case<backend::Cpu>(c);
    ++n;
  }
  REQUIRE(n >= 10);
}

TEST_CASE("kvpress CAMPress fixtures: kept set, Bernoulli draws and merged values equal kvpress 0.5.5", "[merging][fixtures]") {
  const auto doc = load();
  int n = 0;
  for (const auto& c : doc["cases"]) {
    if (c["kind"] != "cam_press") continue;
    INFO("case " << n << " H=" << c["H"] << " T=" << c["T"] << " seed=" << c["seed"]);
    check_cam_case<backend::Scalar>(c);
    check_cam_case<backend::Cpu>(c);
    ++n;
  }
  REQUIRE(n >= 8);
}
