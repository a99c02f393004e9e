#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "policy/golden_inputs.hpp"
#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "kvpolicy/util/thread_pool.hpp"
#include "policy/policy_test_util.hpp"

using namespace kvpolicy;
using Catch::Matchers::Contains;

STATIC_ASSERT_POLICY(SnapKV);

TEST_CASE("snapkv: golden vectors of reference §11 (kvpress SnapKVPress r=0.5, w=3, K=3)", "[snapkv][golden]") {
  const auto qd = golden::queries(), kd = golden::keys();
  const int w = 3, T = golden::kT, d = golden::kD;
  std::vector<float> q(golden::kHq * w * d), k(kd.begin(), kd.end());
  for (int h = 0; h < golden::kHq; ++h)
    for (int i = 0; i < w; ++i)
      for (int c = 0; c < d; ++c) q[(h * w + i) * d + c] = static_cast<float>(qd[(h * T + T - w + i) * d + c]);
  ScoreInput<float, float> in{TensorView<const float, 3>::contiguous(q.data(), {golden::kHq, w, d}),
                              KVSource<float>::from(TensorView<const float, 3>::contiguous(k.data(), {golden::kHkv, T, d}))};
  const SnapKV policy(SnapKVParams::kvpress(0.5, w, 3));
  const double expect[2][9] = {
      {0.0601205206, 0.0919918344, 0.092666697, 0.0944700379, 0.0923056415, 0.0875673948, 0.08966102, 0.0882648537, 0.0589748768},
      {0.0563088626, 0.08301497, 0.0814580114, 0.0842922597, 0.0862682352, 0.0891448109, 0.0955356365, 0.1022074042, 0.0706560419}};
  std::vector<float> scores(2 * T);
  const Requirements req = policy.requirements(Context<backend::Scalar>{}, ProblemShape{4, 2, d, T, w});
  REQUIRE(req.status.is_ok());
  REQUIRE(req.output.rows == 2);
  REQUIRE(req.query_window == w);
  std::vector<std::byte> ws(req.workspace_bytes);
  const Context<backend::Scalar> cx{Workspace{ws.data(), ws.size()}};
  REQUIRE(policy.score(cx, in, TensorView<float, 2>::contiguous(scores.data(), {2, T})).is_ok());
  for (int h = 0; h < 2; ++h) {
    for (int j = 0; j < T - w; ++j) REQUIRE(scores[h * T + j] == Approx(expect[h][j]).epsilon(1e-6));
    for (int j = T - w; j < T; ++j) REQUIRE(std::isinf(scores[h * T + j]));
  }
  KeepSetBuffer keep(2, 12);
  REQUIRE(policy.evict(cx, in, keep.view()).is_ok());
  REQUIRE(keep.row(0) == std::vector<std::int32_t>{2, 3, 4, 9, 10, 11});
  REQUIRE(keep.row(1) == std::vector<std::int32_t>{5, 6, 7, 9, 10, 11});
}

TEST_CASE("snapkv: kvpress rounding of n_kept and the original capacity semantics", "[snapkv][budget]") {
  REQUIRE(kvpress_n_kept(1000, 0.8) == 199);
  REQUIRE(kvpress_n_kept(100, 0.9) == 9);
  REQUIRE(kvpress_n_kept(1000, 0.5) == 500);
  REQUIRE(SnapKV(SnapKVParams::kvpress(0.8, 8)).kept_count(1000) == 199);
  const SnapKV orig(SnapKVParams::original(64, 8, 7));
  REQUIRE(orig.kept_count(40) == 40);   // T < C: untouched
  REQUIRE(orig.kept_count(64) == 64);   // T == C: all kept
  REQUIRE(orig.kept_count(500) == 64);  // C - w past + w window
  SnapKVParams on_top = SnapKVParams::kvpress(0.0, 8);
  on_top.budget = Budget::tokens(20).protected_on_top();
  REQUIRE(SnapKV(on_top).kept_count(100) == 28);
}

TEMPLATE_TEST_CASE("snapkv: window kept, past = top pooled scores, budget below window keeps the latest", "[snapkv]", float, half,
                   bfloat16) {
  RandomCase<TestType> rc(/*Hq=*/8, /*Hkv=*/2, /*T=*/300, /*d=*/64, /*w=*/16, 11);
  for (double r : {0.1, 0.5, 0.9, 0.97}) {
    const SnapKV policy(SnapKVParams::kvpress(r, 16, 5));
    const auto keep = run_evict<backend::Scalar>(policy, rc.input());
    const std::int64_t n = kvpress_n_kept(300, r);
    for (int h = 0; h < 2; ++h) {
      const auto row = keep.row(h);
      REQUIRE(static_cast<std::int64_t>(row.size()) == n);
      REQUIRE(std::is_sorted(row.begin(), row.end()));
      const std::int64_t n_win = std::min<std::int64_t>(n, 16);
      for (std::int64_t j = 0; j < n_win; ++j) REQUIRE(row[row.size() - n_win + j] == 300 - n_win + j);
    }
  }
}

TEST_CASE("snapkv: every backend equals the scalar reference (dtypes, GQA, lengths, strided, paged, threads)", "[snapkv][backends]") {
  for (int G : {1, 2, 4, 8}) {
    for (int d : {64, 96, 128}) {
      for (int T : {1, 7, 100, 1000, 4099}) {
        const int w = std::min(T, 8);
        const int Hkv = 2;
        RandomCase<half> rc(G * Hkv, Hkv, T, d, w, 100 * G + T + d);
        for (auto params : {SnapKVParams::kvpress(0.5, w, 5), SnapKVParams::original(std::max(w + 1, T / 3), w, 7, Pooling::kMax)}) {
          if (T <= w && params.budget.kind == BudgetKind::kTokens) continue;
          const SnapKV policy(params);
          const auto ref = run_evict<backend::Scalar>(policy, rc.input());
          REQUIRE(run_evict<backend::Cpu>(policy, rc.input()) == ref);
          REQUIRE(run_evict<backend::Cpu>(policy, rc.strided_input()) == ref);
          REQUIRE(run_evict<backend::Cpu>(policy, rc.paged_input(16)) == ref);
          ThreadPool pool(2);
          REQUIRE(run_evict<backend::Cpu>(policy, rc.input(), pool.context()) == ref);
        }
      }
    }
  }
}

TEST_CASE("snapkv: batch of sequences with different lengths equals per-sequence calls", "[snapkv]") {
  RandomCase<float> a(8, 2, 257, 64, 8, 1), b(8, 2, 64, 64, 8, 2), c(8, 2, 1000, 64, 8, 3);
  const SnapKV policy(SnapKVParams::kvpress(0.7, 8, 7));
  std::vector<ScoreInput<float, float>> batch{a.input(), b.input(), c.input()};
  ThreadPool pool(2);
  const auto all = run_evict_batch<backend::Cpu>(policy, batch, pool.context());
  std::int64_t row = 0;
  for (auto* rc : {&a, &b, &c}) {
    const auto one = run_evict<backend::Scalar>(policy, rc->input());
    for (int h = 0; h < 2; ++h) REQUIRE(all.row(row++) == one.row(h));
  }
}

TEST_CASE("snapkv: non-finite keys never crash and give valid indices, a non-finite query is rejected", "[snapkv][nonfinite]") {
  RandomCase<float> rc(4, 2, 200, 64, 8, 5);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  rc.keys[3 * 64 + 1] = nan;
  rc.keys[50 * 64 + 2] = inf;
  rc.keys[(200 + 7) * 64] = -inf;
  const SnapKV policy(SnapKVParams::kvpress(0.5, 8, 5));
  {
    RandomCase<float> bad = rc;
    bad.queries[5] = nan;
    KeepSetBuffer keep(2, 200);
    keep.fill_sentinel();
    const Requirements r = policy.requirements(Context<backend::Cpu>{}, ProblemShape{4, 2, 64, 200, 8});
    std::vector<std::byte> ws(r.workspace_bytes);
    const Status s = policy.evict(Context<backend::Cpu>{Workspace{ws.data(), ws.size()}}, bad.input(), keep.view());
    REQUIRE_THAT(s.message(), Contains("queries[0, 0, 5] is nan, must be finite"));
    REQUIRE(keep.untouched());
  }
  for (auto keep : {run_evict<backend::Scalar>(policy, rc.input()), run_evict<backend::Cpu>(policy, rc.input())}) {
    for (int h = 0; h < 2; ++h) {
      const auto row = keep.row(h);
      REQUIRE(row.size() == 100);
      REQUIRE(std::is_sorted(row.begin(), row.end()));
      REQUIRE(std::adjacent_find(row.begin(), row.end()) == row.end());
      REQUIRE(row.front() >= 0);
      REQUIRE(row.back() == 199);
    }
  }
}

TEST_CASE("snapkv: bad input gets a clear message and writes nothing", "[snapkv][errors]") {
  RandomCase<float> rc(8, 2, 100, 64, 8, 9);
  const SnapKV policy(SnapKVParams::kvpress(0.5, 8, 5));
  auto expect_error = [&](const SnapKV& p, ScoreInput<float, float> in, const char* needle, std::size_t ws_bytes = SIZE_MAX) {
    KeepSetBuffer keep(2, 100);
    keep.fill_sentinel();
    ProblemShape shape{8, 2, 64, 100, 8};
    // sized for the valid policy (same window): the failure must come from `p` and `in`, not from a short workspace
    const Requirements req = policy.requirements(Context<backend::Cpu>{}, shape);
    REQUIRE(req.status.is_ok());
    std::vector<std::byte> ws(ws_bytes == SIZE_MAX ? req.workspace_bytes : ws_bytes);
    const Status s = p.evict(Context<backend::Cpu>{Workspace{ws.data(), ws.size()}}, in, keep.view());
    INFO(s.message());
    REQUIRE(!s.is_ok());
    REQUIRE_THAT(s.message(), Contains(needle));
    REQUIRE(keep.untouched());
  };
  auto in = rc.input();
  auto bad = in;
  bad.keys.dense = TensorView<const float, 3>(nullptr, {2, 100, 64}, {6400, 64, 1});
  expect_error(policy, bad, "keys has null data");
  bad = in;
  bad.queries = TensorView<const float, 3>(rc.queries.data(), {8, 8, 32}, {512, 64, 1});
  expect_error(policy, bad, "queries head_dim 32 differs from keys head_dim 64");
  bad = in;
  bad.queries = TensorView<const float, 3>(rc.queries.data(), {7, 8, 64}, {512, 64, 1});
  expect_error(policy, bad, "queries has 7 heads, not a multiple of the 2 kv heads");
  bad = in;
  bad.queries = TensorView<const float, 3>(rc.queries.data(), {8, 4, 64}, {512, 64, 1});
  expect_error(policy, bad, "expected window=8");
  expect_error(SnapKV(SnapKVParams::kvpress(-0.1, 8)), in, "compression_ratio is -0.1");
  expect_error(SnapKV(SnapKVParams::kvpress(1.0, 8)), in, "must be in [0, 1)");
  SnapKVParams tok = SnapKVParams::kvpress(0, 8);
  tok.budget = Budget::tokens(101);
  expect_error(SnapKV(tok), in, "token budget 101 is larger than the sequence length 100");
  tok.budget = Budget{BudgetKind::kTokens, -3.0, true, false};
  expect_error(SnapKV(tok), in, "must be a non-negative integer");
  tok.budget = Budget::keep_ratio(std::numeric_limits<double>::quiet_NaN());
  expect_error(SnapKV(tok), in, "must be finite");
  RandomCase<float> shortc(8, 2, 6, 64, 8, 9);
  expect_error(policy, shortc.input(), "window 8 is larger than kv_len 6");
  expect_error(SnapKV(SnapKVParams::kvpress(0.5, 8, 4)), in, "pooling kernel is 4, must be odd");
  expect_error(policy, in, "workspace has 100 bytes", 100);
  KeepSetBuffer small(2, 10);
  const Requirements req = policy.requirements(Context<backend::Cpu>{}, ProblemShape{8, 2, 64, 100, 8});
  REQUIRE(req.status.is_ok());
  REQUIRE(req.output.capacity > 10);
  std::vector<std::byte> ws(req.workspace_bytes);
  REQUIRE(policy.evict(Context<backend::Cpu>{Workspace{ws.data(), ws.size()}}, in, small.view()).code() == StatusCode::kOutputTooSmall);
}
