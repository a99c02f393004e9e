// Budget vocabulary: kvpress rounding, PyramidKV schedules (reference §4), the
// layer schedule and per-head allocation.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/budget.hpp"
#include "kvpolicy/policy/budget/allocation.hpp"
#include "kvpolicy/policy/budget/pyramid.hpp"
#include "kvpolicy/policy/budget/schedule.hpp"
#include "kvpolicy/util/thread_pool.hpp"
#include "policy/eviction/scoring_test_util.hpp"

using namespace kvpolicy;
using Catch::Matchers::Contains;

TEST_CASE("budget: kvpress n_kept in double, with and without the >= 1 clamp of kvpress 0.5.5", "[budget]") {
  REQUIRE(kvpress_n_kept(1000, 0.8) == 199);
  REQUIRE(kvpress_n_kept(90, 0.3) == 62);  // 90 * 0.7 = 62.99999999999999
  REQUIRE(kvpress_n_kept(100, 0.9) == 9);
  REQUIRE(kvpress_n_kept(3, 0.9) == 0);
  REQUIRE(kvpress_n_kept(3, 0.9, true) == 1);
  REQUIRE(kvpress_n_kept(0, 0.5, true) == 0);
  REQUIRE(Budget::compression_ratio(0.9).total(3, 0) == 0);
  REQUIRE(Budget::compression_ratio(0.9).keep_at_least_one().total(3, 0) == 1);
  REQUIRE(Budget::keep_ratio(0.1).keep_at_least_one().total(5, 0) == 1);
  REQUIRE(Budget::tokens(10).protected_on_top().total(100, 4) == 14);
  // Existing semantics stay: aggregate initialisation with four fields still works.
  const Budget b{BudgetKind::kTokens, 5.0, true, false};
  REQUIRE(b.total(10, 2) == 5);
  REQUIRE_FALSE(b.at_least_one);
}

TEST_CASE("budget: Python rounding (half to even) and floor division", "[budget]") {
  REQUIRE(round_half_even(2.5) == 2.0);
  REQUIRE(round_half_even(3.5) == 4.0);
  REQUIRE(round_half_even(-2.5) == -2.0);
  REQUIRE(round_half_even(-3.5) == -4.0);
  REQUIRE(round_half_even(0.49999999999999994) == 0.0);
  REQUIRE(round_half_even(102.4) == 102.0);
  REQUIRE(round_half_even(1e300) == 1e300);
  REQUIRE(std::isnan(round_half_even(std::nan(""))));
  REQUIRE(floor_div(7, 3) == 2);
  REQUIRE(floor_div(-7, 3) == -3);
  REQUIRE(floor_div(-6, 3) == -2);
  REQUIRE(floor_div(7, -3) == -3);
}

namespace {
std::vector<std::int64_t> factory_totals(std::int64_t T, std::int64_t C, std::int64_t w, std::int64_t NL, PyramidRegime* regime = nullptr) {
  std::vector<std::int64_t> out;
  for (std::int64_t l = 0; l < NL; ++l) {
    PyramidBudget pb;
    REQUIRE(pyramid_budget_factory(T, C, w, 20, NL, l, &pb).is_ok());
    out.push_back(pb.total);
    if (regime) *regime = pb.regime;
  }
  return out;
}
std::vector<std::int64_t> kvpress_totals(std::int64_t T, double r, std::int64_t w, std::int64_t NL, PyramidRegime* regime = nullptr) {
  std::vector<std::int64_t> out;
  for (std::int64_t l = 0; l < NL; ++l) {
    PyramidBudget pb;
    REQUIRE(pyramid_budget_kvpress(T, r, w, 20, NL, l, false, &pb).is_ok());
    out.push_back(pb.total);
    if (regime) *regime = pb.regime;
  }
  return out;
}
}  // namespace

TEST_CASE("pyramid: KVCache-Factory schedule reproduces reference §4.1", "[budget][pyramid][golden]") {
  PyramidRegime reg{};
  const auto big = factory_totals(4000, 128, 8, 32, &reg);
  REQUIRE(reg == PyramidRegime::kPyramid);
  REQUIRE(big == std::vector<std::int64_t>{242, 235, 228, 221, 214, 207, 200, 193, 186, 179, 172, 165, 158, 151, 144, 137,
                                           130, 123, 116, 109, 102, 95,  88,  81,  74,  67,  60,  53,  46,  39,  32,  25});
  REQUIRE(std::accumulate(big.begin(), big.end(), 0.0) / 32.0 == 133.5);  // flooring `steps` overshoots C = 128
  REQUIRE(factory_totals(300, 80, 16, 4) == std::vector<std::int64_t>{141, 101, 61, 21});
  REQUIRE(factory_totals(300, 120, 8, 4) == std::vector<std::int64_t>{227, 156, 85, 14});
  REQUIRE(factory_totals(300, 200, 16, 4, &reg) == std::vector<std::int64_t>{200, 200, 200, 200});
  REQUIRE(reg == PyramidRegime::kUniform);  // C <= T < 2(C - w)
  REQUIRE(factory_totals(4000, 2048, 8, 32, &reg) == std::vector<std::int64_t>(32, 2048));
  REQUIRE(reg == PyramidRegime::kUniform);
  REQUIRE(factory_totals(100, 128, 8, 4, &reg) == std::vector<std::int64_t>(4, 100));  // T < C: not compressed
  REQUIRE(reg == PyramidRegime::kNoCompression);
  REQUIRE(factory_totals(128, 128, 8, 4, &reg) == std::vector<std::int64_t>(4, 128));  // T == C: uniform C (all kept)
  REQUIRE(reg == PyramidRegime::kUniform);
  // Choice: a single layer gets the plain capacity (the original divides by zero).
  REQUIRE(factory_totals(4000, 128, 8, 1, &reg) == std::vector<std::int64_t>{128});
  REQUIRE(reg == PyramidRegime::kUniform);
  // Clamped anchor: max_num >= T - w re-anchors max_num = T - w, min_num = 2(C-w) - max_num.
  // T = 241, C = 128, w = 8: max_num 234 >= 233 -> max_num 233, min_num 240 - 233 = 7, steps 226 // 3 = 75.
  REQUIRE(factory_totals(241, 128, 8, 4) == std::vector<std::int64_t>{241, 166, 91, 16});
}

TEST_CASE("pyramid: kvpress schedule reproduces reference §4.3 and its test grid", "[budget][pyramid][golden]") {
  PyramidRegime reg{};
  REQUIRE(kvpress_totals(1024, 0.5, 64, 32, &reg) == std::vector<std::int64_t>{960, 931, 902, 873, 844, 815, 787, 758, 729, 700, 671,
                                                                               642, 613, 584, 555, 526, 498, 469, 440, 411, 382, 353,
                                                                               324, 295, 266, 237, 209, 180, 151, 122, 93,  64});
  REQUIRE(reg == PyramidRegime::kPyramid);
  // Strong compression: min_num = 5.12 < w, uniform fallback round(102.4) = 102.
  REQUIRE(kvpress_totals(1024, 0.9, 64, 32, &reg) == std::vector<std::int64_t>(32, 102));
  REQUIRE(reg == PyramidRegime::kFallback);
  // Fallback rounds half to even (Python round): T = 5, r = 0.5 -> round(2.5) = 2; 0.5.5's clamp keeps >= 1.
  PyramidBudget pb;
  REQUIRE(pyramid_budget_kvpress(5, 0.5, 3, 20, 4, 0, false, &pb).is_ok());
  REQUIRE((pb.total == 2 && pb.regime == PyramidRegime::kFallback));
  REQUIRE(pyramid_budget_kvpress(1, 0.6, 1, 20, 4, 0, false, &pb).is_ok());
  REQUIRE((pb.total == 0 && pb.regime == PyramidRegime::kFallback));
  REQUIRE(pyramid_budget_kvpress(1, 0.6, 1, 20, 4, 0, true, &pb).is_ok());
  REQUIRE(pb.total == 1);
  REQUIRE(pyramid_budget_kvpress(1024, 0.0, 64, 20, 4, 0, false, &pb).is_ok());
  REQUIRE((pb.total == 1024 && pb.regime == PyramidRegime::kNoCompression));
  // kvpress 0.5.5: num_layers == 1 -> steps = 0, the single layer keeps max_num.
  REQUIRE(kvpress_totals(1024, 0.5, 64, 1) == std::vector<std::int64_t>{960});
  // tests/presses/test_pyramidkv_press.py: the layer mean is T(1-r) within 1e-3 relative.
  for (std::int64_t NL : {32, 64, 128})
    for (double r : {0.1, 0.25, 0.3, 0.5, 0.6, 0.75, 0.8})
      for (std::int64_t T : {1024, 2787, 4096, 6591, 8192}) {
        const auto v = kvpress_totals(T, r, 64, NL);
        const double mean = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(NL);
        REQUIRE(mean == Approx(static_cast<double>(T) * (1.0 - r)).epsilon(1e-3));
        for (auto n : v) REQUIRE((n >= 0 && n <= T));
      }
}

TEST_CASE("pyramid: Ada-KV pyram_mode has no uniform branch and floors negative steps like Python", "[budget][pyramid]") {
  PyramidBudget pb;
  // Same as the Factory once T >= 2(C - w).
  for (std::int64_t l = 0; l < 32; ++l) {
    PyramidBudget f;
    REQUIRE(pyramid_budget_factory(4000, 128, 8, 20, 32, l, &f).is_ok());
    REQUIRE(pyramid_budget_adakv(4000, 128, 8, 20, 32, l, &pb).is_ok());
    REQUIRE(pb.total == f.total);
  }
  // T = 300, C = 200, w = 16: base 184, min 9, max 359 >= 284 -> max 284, min 84; steps = 200 // 3 = 66.
  REQUIRE(pyramid_budget_adakv(300, 200, 16, 20, 4, 1, &pb).is_ok());
  REQUIRE(pb.total == 284 - 66 + 16);
  // T = 100, C = 80, w = 8: max = 92, min = 52; steps = 40 // 3 = 13.
  REQUIRE(pyramid_budget_adakv(100, 80, 8, 20, 4, 3, &pb).is_ok());
  REQUIRE(pb.total == 92 - 3 * 13 + 8);
  // T = 50, C = 80, w = 8: max = 42, min = 102, steps = -60 // 3 = -20: budgets grow with the layer.
  REQUIRE(pyramid_budget_adakv(50, 80, 8, 20, 4, 2, &pb).is_ok());
  REQUIRE(pb.total == 42 + 40 + 8);
  REQUIRE(pyramid_budget_adakv(50, 80, 8, 20, 4, 3, &pb).is_ok());
  REQUIRE(pb.total == 42 + 60 + 8);
}

TEST_CASE("pyramid: bad parameters name the argument", "[budget][pyramid][errors]") {
  PyramidBudget pb{123, PyramidRegime::kUniform};
  auto expect = [&](Status s, const char* needle) {
    INFO(s.message());
    REQUIRE(s.code() == StatusCode::kInvalidArgument);
    REQUIRE_THAT(s.message(), Contains(needle));
    REQUIRE(pb.total == 123);  // nothing written
  };
  expect(pyramid_budget_factory(4000, 128, 8, 0, 32, 0, &pb), "beta is 0, must be >= 1");
  expect(pyramid_budget_kvpress(4000, 0.5, 8, 0, 32, 0, false, &pb), "beta is 0, must be >= 1");
  expect(pyramid_budget_factory(4000, 128, 8, 20, 0, 0, &pb), "num_layers is 0, must be >= 1");
  expect(pyramid_budget_factory(4000, 128, 8, 20, 32, 32, &pb), "layer 32 out of range [0, num_layers=32)");
  expect(pyramid_budget_kvpress(4000, 0.5, 8, 20, 32, -1, false, &pb), "layer -1 out of range");
  expect(pyramid_budget_factory(4000, 8, 8, 20, 32, 0, &pb), "capacity 8 must be larger than the window 8");
  expect(pyramid_budget_kvpress(4000, 1.0, 8, 20, 32, 0, false, &pb), "compression_ratio is 1, must be in [0, 1)");
  expect(pyramid_budget_adakv(4, 128, 8, 20, 32, 0, &pb), "window 8 is larger than kv_len 4");
}

TEST_CASE("layer schedule: every kind resolves to a Budget usable by any policy", "[budget][schedule]") {
  Budget b;
  PyramidRegime reg{};
  const auto uni = LayerSchedule::uniform(Budget::compression_ratio(0.3), 4);
  REQUIRE(uni.layer_budget(3, 1000, &b).is_ok());
  REQUIRE((b.kind == BudgetKind::kCompressionRatio && b.value == 0.3));
  const auto fac = LayerSchedule::pyramid_factory(128, 8, 32);
  REQUIRE(fac.layer_budget(0, 4000, &b, &reg).is_ok());
  std::int64_t n = 0;
  REQUIRE(b.resolve("t", 4000, 8, &n).is_ok());
  REQUIRE((n == 242 && reg == PyramidRegime::kPyramid));
  REQUIRE(fac.layer_budget(5, 100, &b, &reg).is_ok());  // T < C: keep all
  REQUIRE(b.resolve("t", 100, 8, &n).is_ok());
  REQUIRE((n == 100 && reg == PyramidRegime::kNoCompression));
  const auto kvp = LayerSchedule::pyramid_kvpress(0.5, 64, 32);
  REQUIRE(kvp.layer_budget(31, 1024, &b).is_ok());
  REQUIRE(b.resolve("t", 1024, 64, &n).is_ok());
  REQUIRE(n == 64);
  const auto ada = LayerSchedule::pyramid_adakv(200, 16, 4);
  REQUIRE(ada.layer_budget(1, 300, &b).is_ok());
  REQUIRE(b.resolve("t", 300, 16, &n).is_ok());
  REQUIRE(n == 284 - 66 + 16);
  const Budget list[3] = {Budget::compression_ratio(0.1), Budget::tokens(7), Budget::keep_ratio(0.5)};
  const auto per = LayerSchedule::per_layer(list);
  REQUIRE(per.layer_budget(1, 50, &b).is_ok());
  REQUIRE((b.kind == BudgetKind::kTokens && b.value == 7.0));

  auto expect = [](Status s, const char* needle) {
    INFO(s.message());
    REQUIRE(!s.is_ok());
    REQUIRE_THAT(s.message(), Contains(needle));
  };
  expect(uni.layer_budget(4, 100, &b), "layer 4 out of range [0, num_layers=4)");
  expect(LayerSchedule::uniform(Budget::keep_ratio(0.5), 0).layer_budget(0, 100, &b), "num_layers is 0, must be >= 1");
  expect(LayerSchedule::pyramid_kvpress(0.5, 64, 32, 0).layer_budget(0, 100, &b), "beta is 0, must be >= 1");
  expect(LayerSchedule::pyramid_factory(8, 8, 32).layer_budget(0, 100, &b), "capacity 8 must be larger than the window 8");
  const Budget bad[2] = {Budget::compression_ratio(0.1), Budget::compression_ratio(1.5)};
  expect(LayerSchedule::per_layer(bad).layer_budget(0, 100, &b), "compression_ratio is 1.5");
}

TEST_CASE("allocation: per-head budgets select each head's best tokens, CSR rows, protected first", "[budget][allocation]") {
  // scores (3 heads, 6 tokens); +inf = protected.
  const float inf = INFINITY;
  std::vector<float> s = {0.1f, 0.5f, 0.3f, 0.2f, inf, inf,  //
                          0.9f, 0.1f, 0.1f, 0.8f, inf, inf,  //
                          0.0f, 0.0f, 0.7f, 0.0f, inf, inf};
  const auto view = TensorView<const float, 2>::contiguous(s.data(), {3, 6});
  const std::int32_t counts[3] = {3, 2, 5};
  for (auto* be : {"scalar", "cpu"}) {
    KeepSetBuffer keep(3, 10);
    std::vector<std::byte> ws(std::max(select_per_head_workspace<backend::Scalar>(6), select_per_head_workspace<backend::Cpu>(6)));
    const HeadAllocation alloc{counts, 3, 10, true};
    const Status st = std::string(be) == "cpu"
                          ? select_per_head<backend::Cpu>(view, alloc, keep.view(), Workspace{ws.data(), ws.size()})
                          : select_per_head<backend::Scalar>(view, alloc, keep.view(), Workspace{ws.data(), ws.size()});
    REQUIRE(st.is_ok());
    REQUIRE(keep.indptr == std::vector<std::int32_t>{0, 3, 5, 10});
    REQUIRE(keep.row(0) == std::vector<std::int32_t>{1, 4, 5});
    REQUIRE(keep.row(1) == std::vector<std::int32_t>{4, 5});
    REQUIRE(keep.row(2) == std::vector<std::int32_t>{1, 2, 3, 4, 5});  // ties at 0: the higher index wins
  }
  // Protected on top: counts are past tokens, the two +inf tokens come in addition.
  KeepSetBuffer keep(3, 16);
  std::vector<std::byte> ws(select_per_head_workspace<backend::Scalar>(6));
  const std::int32_t past[3] = {1, 2, 0};
  REQUIRE(select_per_head<backend::Scalar>(view, HeadAllocation{past, 3, 3, false}, keep.view(), Workspace{ws.data(), ws.size()}).is_ok());
  REQUIRE(keep.row(0) == std::vector<std::int32_t>{1, 4, 5});
  REQUIRE(keep.row(1) == std::vector<std::int32_t>{0, 3, 4, 5});
  REQUIRE(keep.row(2) == std::vector<std::int32_t>{4, 5});
}

TEST_CASE("allocation: budgets that do not sum, or exceed the length, are rejected and nothing is written",
          "[budget][allocation][errors]") {
  std::vector<float> s(2 * 5, 0.5f);
  const auto view = TensorView<const float, 2>::contiguous(s.data(), {2, 5});
  std::vector<std::byte> ws(select_per_head_workspace<backend::Scalar>(5));
  auto expect = [&](HeadAllocation a, const char* needle, std::int64_t cap = 10) {
    KeepSetBuffer keep(2, cap);
    keep.fill_sentinel();
    const Status st = select_per_head<backend::Scalar>(view, a, keep.view(), Workspace{ws.data(), ws.size()});
    INFO(st.message());
    REQUIRE(!st.is_ok());
    REQUIRE_THAT(st.message(), Contains(needle));
    REQUIRE(keep.untouched());
  };
  const std::int32_t ok[2] = {3, 2}, big[2] = {6, 1}, neg[2] = {-1, 2};
  expect(HeadAllocation{ok, 2, 6, true}, "per-head budgets sum to 5, expected total 6");
  expect(HeadAllocation{big, 2, 7, true}, "per-head budget counts[0] is 6, larger than the sequence length 5");
  expect(HeadAllocation{neg, 2, -1, true}, "counts[0] is -1, must be >= 0");
  expect(HeadAllocation{ok, 3, 5, true}, "allocation has 3 heads, scores has 2");
  expect(HeadAllocation{nullptr, 2, 5, true}, "allocation counts is null");
  expect(HeadAllocation{ok, 2, 5, true}, "keep set capacity is 4, needs 5", 4);
}
