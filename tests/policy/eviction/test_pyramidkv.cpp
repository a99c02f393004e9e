// PyramidKV: SnapKV scoring + a layer schedule. Pinned against the §11 scores,
// the §4 budgets, SnapKV itself, and every backend.
#include <catch2/catch.hpp>

#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/eviction/adakv.hpp"
#include "kvpolicy/policy/eviction/expected_attention.hpp"
#include "kvpolicy/policy/eviction/pyramidkv.hpp"
#include "kvpolicy/util/thread_pool.hpp"
#include "scoring_test_util.hpp"

using namespace kvpolicy;
using Catch::Matchers::Contains;

STATIC_ASSERT_POLICY(PyramidKV);

TEST_CASE("pyramidkv: §11 inputs with kvpress PyramidKVPress(r=.5, w=3, K=3), 4 layers", "[pyramidkv][golden]") {
  const GoldenSnap g(3);
  // T = 12: mcp = 9, min_num = 3 = w after re-anchoring, max_num = 9 -> budgets 9, 7, 5, 3.
  const std::vector<std::vector<std::int32_t>> expect[4] = {{{1, 2, 3, 4, 6, 7, 9, 10, 11}, {1, 3, 4, 5, 6, 7, 9, 10, 11}},
                                                            {{1, 2, 3, 4, 9, 10, 11}, {4, 5, 6, 7, 9, 10, 11}},
                                                            {{2, 3, 9, 10, 11}, {6, 7, 9, 10, 11}},
                                                            {{9, 10, 11}, {9, 10, 11}}};
  for (int l = 0; l < 4; ++l) {
    const PyramidKV policy(PyramidKVParams::kvpress(0.5, l, 4, 3, 3));
    REQUIRE(policy.kept_count(12) == 9 - 2 * l);
    for (const auto& keep : {run_evict<backend::Scalar>(policy, g.input(3)), run_evict<backend::Cpu>(policy, g.input(3))}) {
      REQUIRE(keep.row(0) == expect[l][0]);
      REQUIRE(keep.row(1) == expect[l][1]);
    }
  }
}

TEST_CASE("pyramidkv: kept counts follow the schedules of reference §4", "[pyramidkv][budget]") {
  const std::int64_t kv[32] = {960, 931, 902, 873, 844, 815, 787, 758, 729, 700, 671, 642, 613, 584, 555, 526,
                               498, 469, 440, 411, 382, 353, 324, 295, 266, 237, 209, 180, 151, 122, 93,  64};
  const std::int64_t fac[32] = {242, 235, 228, 221, 214, 207, 200, 193, 186, 179, 172, 165, 158, 151, 144, 137,
                                130, 123, 116, 109, 102, 95,  88,  81,  74,  67,  60,  53,  46,  39,  32,  25};
  for (int l = 0; l < 32; ++l) {
    REQUIRE(PyramidKV(PyramidKVParams::kvpress(0.5, l, 32)).kept_count(1024) == kv[l]);
    REQUIRE(PyramidKV(PyramidKVParams::original(128, l, 32)).kept_count(4000) == fac[l]);
    REQUIRE(PyramidKV(PyramidKVParams::original(128, l, 32)).kept_count(100) == 100);  // T < C
    REQUIRE(PyramidKV(PyramidKVParams::original(128, l, 32)).kept_count(200) == 128);  // C <= T < 2(C-w): uniform
    REQUIRE(PyramidKV(PyramidKVParams::kvpress(0.9, l, 32)).kept_count(1024) == 102);  // fallback
  }
}

TEST_CASE("pyramidkv: each layer equals SnapKV with that layer's token budget", "[pyramidkv]") {
  RandomCase<float> rc(8, 2, 2000, 64, 32, 4);
  for (int l : {0, 7, 31}) {
    for (const auto& p : {PyramidKVParams::kvpress(0.6, l, 32, 32, 5), PyramidKVParams::original(300, l, 32, 32, 7, Pooling::kMax)}) {
      const PyramidKV pyr(p);
      SnapKVParams sp = p.scoring;
      sp.budget = Budget::tokens(pyr.kept_count(2000));
      const auto expect = run_evict<backend::Scalar>(SnapKV(sp), rc.input());
      REQUIRE(run_evict<backend::Scalar>(pyr, rc.input()) == expect);
      REQUIRE(run_evict<backend::Cpu>(pyr, rc.input()) == expect);
    }
  }
  // Any schedule: an explicit per-layer list.
  const Budget list[2] = {Budget::compression_ratio(0.2), Budget::tokens(100)};
  PyramidKVParams p = PyramidKVParams::kvpress(0.5, 1, 2, 32, 5);
  p.schedule = LayerSchedule::per_layer(list);
  REQUIRE(PyramidKV(p).kept_count(2000) == 100);
  SnapKVParams sp = p.scoring;
  sp.budget = Budget::tokens(100);
  REQUIRE(run_evict<backend::Cpu>(PyramidKV(p), rc.input()) == run_evict<backend::Scalar>(SnapKV(sp), rc.input()));
}

TEST_CASE("pyramidkv: every backend equals the scalar reference (GQA 1/2/4/8, lengths 1..4099, strided, paged, threads)",
          "[pyramidkv][backends]") {
  for (int G : {1, 2, 4, 8}) {
    for (int T : {1, 2, 7, 100, 1000, 4099}) {
      const int w = std::min(T, 8), Hkv = 2, d = 64;
      RandomCase<half> rc(G * Hkv, Hkv, T, d, w, 300 * G + T);
      for (const auto& p : {PyramidKVParams::kvpress(0.5, 3, 8, w, 5), PyramidKVParams::original(std::max(w + 1, T / 4), 2, 8, w, 7)}) {
        const PyramidKV policy(p);
        const auto ref = run_evict<backend::Scalar>(policy, rc.input());
        require_valid_rows(ref, Hkv, T);
        REQUIRE(run_evict<backend::Cpu>(policy, rc.input()) == ref);
        REQUIRE(run_evict<backend::Cpu>(policy, rc.strided_input()) == ref);
        REQUIRE(run_evict<backend::Cpu>(policy, rc.paged_input(16)) == ref);
        ThreadPool pool(2);
        REQUIRE(run_evict<backend::Cpu>(policy, rc.input(), pool.context()) == ref);
      }
    }
  }
}

TEST_CASE("pyramidkv: a batch of different lengths gets a budget per sequence", "[pyramidkv]") {
  RandomCase<float> a(8, 2, 257, 64, 8, 1), b(8, 2, 64, 64, 8, 2), c(8, 2, 1000, 64, 8, 3);
  const PyramidKV policy(PyramidKVParams::original(100, 5, 16, 8, 7));
  ThreadPool pool(2);
  const auto all = run_evict_batch<backend::Cpu>(policy, std::vector{a.input(), b.input(), c.input()}, pool.context());
  std::int64_t row = 0;
  for (auto* rc : {&a, &b, &c}) {
    const auto one = run_evict<backend::Scalar>(policy, rc->input());
    for (int h = 0; h < 2; ++h) REQUIRE(all.row(row++) == one.row(h));
  }
  REQUIRE(all.row(2).size() == 64);  // T = 64 < C = 100: not compressed
}

TEST_CASE("pyramidkv: bad input gets a clear message and writes nothing", "[pyramidkv][errors]") {
  RandomCase<float> rc(8, 2, 100, 64, 8, 9);
  auto expect_error = [&](const PyramidKVParams& p, ScoreInput<float, float> in, const char* needle, std::size_t ws_bytes = SIZE_MAX) {
    const PyramidKV policy(p);
    KeepSetBuffer keep(2, 200);
    keep.fill_sentinel();
    // An invalid policy reports 0 bytes: the call validates its inputs before the workspace.
    std::vector<std::byte> ws(
        ws_bytes == SIZE_MAX ? policy.requirements(Context<backend::Cpu>{}, ProblemShape{8, 2, 64, 100, 8}).workspace_bytes : ws_bytes);
    const Status s = policy.evict(Context<backend::Cpu>{Workspace{ws.data(), ws.size()}}, in, keep.view());
    INFO(s.message());
    REQUIRE(!s.is_ok());
    REQUIRE_THAT(s.message(), Contains(needle));
    REQUIRE(keep.untouched());
  };
  const auto in = rc.input();
  expect_error(PyramidKVParams::kvpress(0.5, 32, 32, 8), in, "layer 32 out of range [0, num_layers=32)");
  expect_error(PyramidKVParams::kvpress(0.5, -1, 32, 8), in, "layer -1 out of range");
  expect_error(PyramidKVParams::kvpress(0.5, 0, 0, 8), in, "num_layers is 0, must be >= 1");
  expect_error(PyramidKVParams::kvpress(0.5, 0, 32, 8, 5, 0), in, "beta is 0, must be >= 1");
  expect_error(PyramidKVParams::kvpress(0.5, 0, 32, 8, 4), in, "pooling kernel is 4, must be odd");
  expect_error(PyramidKVParams::kvpress(1.5, 0, 32, 8), in, "compression_ratio is 1.5");
  expect_error(PyramidKVParams::original(8, 0, 32, 8), in, "capacity 8 must be larger than the window 8");
  PyramidKVParams mismatch = PyramidKVParams::kvpress(0.5, 0, 32, 8);
  mismatch.schedule.window = 16;
  expect_error(mismatch, in, "schedule window 16 differs from the scoring window 8");
  RandomCase<float> shortc(8, 2, 6, 64, 8, 9);
  expect_error(PyramidKVParams::kvpress(0.5, 0, 32, 8), shortc.input(), "window 8 is larger than kv_len 6");
  expect_error(PyramidKVParams::kvpress(0.5, 0, 32, 8), in, "workspace has 100 bytes", 100);
}

TEST_CASE("pyramidkv: layer schedules drive any scorer (Ada-KV pyram_mode, Expected Attention)", "[pyramidkv][budget]") {
  RandomCase<float> rc(8, 2, 600, 32, 32, 21);
  // Ada-KV's pyram_mode: the layer's base capacity from LayerSchedule::pyramid_adakv, then the original allocation.
  const auto sched = LayerSchedule::pyramid_adakv(160, 32, 8);
  for (int l : {0, 7}) {
    Budget b;
    REQUIRE(sched.layer_budget(l, 600, &b).is_ok());
    AdaKVParams p = AdaKVParams::original_gqa(0, 0.2);
    p.budget = b;
    const AdaKV<SnapKV> ada(p, SnapKV(adakv_scoring(32, 7)));
    PyramidBudget pb;
    REQUIRE(pyramid_budget_adakv(600, 160, 32, 20, 8, l, &pb).is_ok());
    REQUIRE(ada.kept_count(600) == pb.total);
    const auto keep = run_ragged<backend::Cpu>(ada, std::vector{rc.input()}, 2, ProblemShape{8, 2, 32, 600, 32});
    REQUIRE(keep.indptr.back() <= ada.max_total_kept(600, 2));
    REQUIRE(keep.indptr.back() >= 2 * pb.total - 2);
  }
  // Expected Attention with the kvpress pyramid: the budget is the schedule's, the scores EA's.
  std::vector<float> values(rc.keys.size(), 1.0f);
  ExpectedAttentionInput<float, float> in;
  in.queries = TensorView<const float, 3>::contiguous(rc.queries.data(), {8, 32, 32});
  in.keys = KVSource<float>::from(TensorView<const float, 3>::contiguous(rc.keys.data(), {2, 600, 32}));
  in.values = KVSource<float>::from(TensorView<const float, 3>::contiguous(values.data(), {2, 600, 32}));
  const auto kvp = LayerSchedule::pyramid_kvpress(0.5, 4, 16);
  for (int l : {0, 15}) {
    ExpectedAttentionParams p = ExpectedAttentionParams::kvpress(0.0, 64, 4);
    REQUIRE(kvp.layer_budget(l, 600, &p.budget).is_ok());
    const ExpectedAttention ea(p);
    PyramidBudget pb;
    REQUIRE(pyramid_budget_kvpress(600, 0.5, 4, 20, 16, l, false, &pb).is_ok());
    REQUIRE(ea.kept_count(600) == pb.total);
    const auto keep = run_ragged<backend::Cpu>(ea, std::vector{in}, 2, ProblemShape{8, 2, 32, 600, 32});
    REQUIRE(keep.row(0).size() == static_cast<std::size_t>(pb.total));
  }
}
