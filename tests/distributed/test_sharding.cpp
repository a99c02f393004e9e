// Tensor-parallel head shards (core/collective.hpp, budget/sharded_cut.hpp)
// with the ranks as threads of this process: sharded decisions equal the
// single-process ones for Ada-KV (every variant), SnapKV and PyramidKV; the
// cut alone against a sort; the collective volume; the hand-shake's errors.
#include <catch2/catch.hpp>

#include <algorithm>
#include <numeric>
#include <random>

#include "distributed/quest_shard_cases.hpp"
#include "distributed/shard_cases.hpp"
#include "distributed/thread_collective.hpp"
#include "kvpolicy/policy/budget/sharded_cut.hpp"
#include "kvpolicy/util/thread_pool.hpp"

using namespace kvpolicy;
using namespace kvp_test;

TEST_CASE("sharded decisions equal one process: Ada-KV, SnapKV, PyramidKV on 2, 3 and 4 ranks", "[shard]") {
  for (const int W : {2, 3, 4}) {
    ThreadGroup g(W);
    std::vector<ShardCaseResult> res(static_cast<std::size_t>(W));
    g.run([&](int r) { res[static_cast<std::size_t>(r)] = run_shard_cases(g.comm(r)); });
    for (const auto& x : res) {
      for (const auto& f : x.fails) FAIL_CHECK(f);
      CHECK(x.cases == 112);
      CHECK(x.fails.empty());
    }
  }
}

TEST_CASE("sharded Ada-KV with a thread pool per rank equals one process", "[shard]") {
  ThreadGroup g(2);
  std::vector<ShardCaseResult> res(2);
  g.run([&](int r) {
    ThreadPool pool(2);
    res[static_cast<std::size_t>(r)] = run_shard_cases(g.comm(r), pool.context());
  });
  for (const auto& x : res) {
    for (const auto& m : x.fails) FAIL_CHECK(m);
    CHECK(x.cases == 112);
    CHECK(x.fails.empty());
  }
}

TEST_CASE("sharded Quest selections equal one process in every GQA mode", "[shard][quest]") {
  for (const int W : {2, 3, 4}) {
    ThreadGroup g(W);
    std::vector<ShardCaseResult> res(static_cast<std::size_t>(W));
    g.run([&](int r) { res[static_cast<std::size_t>(r)] = run_quest_shard_cases(g.comm(r)); });
    for (const auto& x : res) {
      for (const auto& f : x.fails) FAIL_CHECK(f);
      CHECK(x.cases == 12);
      CHECK(x.fails.empty());
    }
    for (int r = 0; r < W; ++r) CHECK(g.stats(r).all_reduces + g.stats(r).all_gathers == 0);  // per kv head: no collective
  }
}

// The cut on its own: random problems split over ranks vs the single-process order (sort).
TEST_CASE("sharded_cut selects the global top-k, ties to the higher flat index, NaN last", "[shard]") {
  std::mt19937 rng(7);
  for (const int W : {1, 2, 3, 5}) {
    for (int trial = 0; trial < 40; ++trial) {
      const std::int64_t n = 1 + static_cast<std::int64_t>(rng() % 3000);
      std::vector<float> v(static_cast<std::size_t>(n));
      const int kind = trial % 4;
      for (auto& x : v) {
        const std::uint32_t u = rng();
        x = kind == 0   ? static_cast<float>(u % 1000) / 7.0f
            : kind == 1 ? static_cast<float>(u % 3)
            : kind == 2 ? (u % 5 == 0    ? NAN
                           : u % 7 == 0  ? INFINITY
                           : u % 11 == 0 ? -INFINITY
                           : u % 13 == 0 ? -0.0f
                                         : 0.0f)
                        : std::bit_cast<float>(u);
      }
      const std::int64_t k = static_cast<std::int64_t>(rng() % static_cast<std::uint32_t>(n + 2));
      // Single process: the k best by (score key, index) descending.
      std::vector<std::int64_t> order(static_cast<std::size_t>(n));
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
        const auto ka = score_order_key(v[a]), kb = score_order_key(v[b]);
        return ka != kb ? ka > kb : a > b;
      });
      std::vector<char> expect(static_cast<std::size_t>(n), 0);
      for (std::int64_t i = 0; i < std::min(k, n); ++i) expect[static_cast<std::size_t>(order[i])] = 1;
      // Sharded: rank r holds a contiguous slice, its tie order is its first index.
      ThreadGroup g(W);
      std::vector<char> got(static_cast<std::size_t>(n), 0);
      std::vector<std::int64_t> counts(static_cast<std::size_t>(W));
      std::vector<Status> st(static_cast<std::size_t>(W));
      g.run([&](int r) {
        const auto range = shard_range(n, W, r);  // not a structured binding: clang 14 cannot capture one
        const std::int64_t a = range.first, b = range.second;
        const ShardedTopK p{v.data() + a, b - a, k};
        ShardedCut cut;
        std::vector<std::byte> ws(sharded_cut_workspace(1, W));
        st[static_cast<std::size_t>(r)] = sharded_cut("test", g.comm(r), a, std::span<const ShardedTopK>(&p, 1),
                                                      std::span<ShardedCut>(&cut, 1), Workspace{ws.data(), ws.size()});
        counts[static_cast<std::size_t>(r)] = cut.global_count;
        for_each_selected(p, cut, [&](std::int64_t i) { got[static_cast<std::size_t>(a + i)] = 1; });
      });
      for (int r = 0; r < W; ++r) {
        REQUIRE(st[static_cast<std::size_t>(r)].is_ok());
        REQUIRE(counts[static_cast<std::size_t>(r)] == n);
      }
      INFO("W=" << W << " n=" << n << " k=" << k << " kind=" << kind);
      REQUIRE(got == expect);
    }
  }
}

TEST_CASE("sharded Ada-KV: collectives per layer and bytes sent", "[shard]") {
  const ShardBatch sb(32, 8, 32, 8, {512, 512, 512, 512}, ScorePattern::kRandom, 3);
  const AdaKV<SnapKV> p(AdaKVParams::kvpress(0.5, 0.2), SnapKV(SnapKVParams::kvpress(0.0, 8, 5)));
  ThreadGroup g(4);
  std::vector<std::string> fails(4);
  g.run([&](int r) { fails[static_cast<std::size_t>(r)] = check_sharded("adakv", p, sb, false, g.comm(r)); });
  for (const auto& f : fails) CHECK(f.empty());
  for (int r = 0; r < 4; ++r) {
    const auto& s = g.stats(r);
    // hand-shake (all-gather), 4 radix rounds (all-reduce), ties (all-gather)
    CHECK(s.all_reduces <= 4);
    CHECK(s.all_gathers == 2);
    // 4 sequences: rounds of 256 bins each (+ the counts in round 1), 5 int64 hand-shake, 1 + 4 int64 ties.
    CHECK(s.bytes_sent <= static_cast<std::int64_t>((4 * 256 * 4 + 4) * 8 + 5 * 8 + 5 * 8));
  }
}

TEST_CASE("a shard of the whole layer on one rank calls no collective", "[shard]") {
  ThreadGroup g(1);
  const ShardBatch sb(8, 2, 16, 4, {64, 100}, ScorePattern::kRandom, 9);
  const AdaKV<SnapKV> p(AdaKVParams::kvpress(0.5, 0.2), SnapKV(SnapKVParams::kvpress(0.0, 4, 3)));
  CHECK(check_sharded("adakv", p, sb, false, g.comm(0)).empty());
  CHECK(g.stats(0).all_reduces == 0);
  CHECK(g.stats(0).all_gathers == 0);
}

TEST_CASE("sharded Ada-KV: a rank's bad input fails every rank and writes nothing", "[shard][bad_input]") {
  const ShardBatch sb(8, 4, 16, 4, {64, 100}, ScorePattern::kRandom, 5);
  const AdaKV<SnapKV> p(AdaKVParams::kvpress(0.5, 0.2), SnapKV(SnapKVParams::kvpress(0.0, 4, 3)));
  struct Case {
    const char* what;
    int bad_rank;
    const char* local_msg;
  };
  for (const Case c :
       {Case{"budget", 1, "compression_ratio"}, Case{"batch", 0, nullptr}, Case{"heads", 1, nullptr}, Case{"overlap", 1, nullptr}}) {
    ThreadGroup g(2);
    std::vector<Status> st(2);
    std::vector<char> untouched(2, 0);  // not vector<bool>: the ranks write their own element concurrently
    g.run([&](int r) {
      auto [h0, h1] = shard_range(sb.Hkv, 2, r);
      AdaKVParams ap = AdaKVParams::kvpress(0.5, 0.2);
      std::vector<ScoreInput<float, half>> in = sb.inputs(h0, h1);
      HeadShard shard{h0, sb.Hkv, sb.Hq, &g.comm(r)};
      if (r == c.bad_rank) {
        if (std::string(c.what) == "budget") ap.budget = Budget::compression_ratio(1.5);
        if (std::string(c.what) == "batch") in.pop_back();
        if (std::string(c.what) == "heads") shard.num_kv_heads = 6, shard.num_q_heads = 12;
        if (std::string(c.what) == "overlap") shard.kv_head_offset = 1;
      }
      const AdaKV<SnapKV> pol(ap, SnapKV(SnapKVParams::kvpress(0.0, 4, 3)));
      ExecContext exec;
      exec.shard = &shard;
      KeepSetBuffer keep(static_cast<std::int64_t>(in.size()) * (h1 - h0), 4096);
      keep.fill_sentinel();
      ProblemShape shape{sb.Hq / 2, h1 - h0, sb.d, 100, sb.w, 2};
      const Requirements req = p.requirements(Context<backend::Cpu>{{}, exec}, shape);
      std::vector<std::byte> ws(req.workspace_bytes);
      st[static_cast<std::size_t>(r)] = pol.evict(Context<backend::Cpu>{Workspace{ws.data(), ws.size()}, exec},
                                                  std::span<const ScoreInput<float, half>>(in), keep.view());
      untouched[static_cast<std::size_t>(r)] = keep.untouched() ? 1 : 0;
    });
    INFO(c.what << ": rank 0: " << st[0].message() << " | rank 1: " << st[1].message());
    for (int r = 0; r < 2; ++r) {
      CHECK_FALSE(st[static_cast<std::size_t>(r)].is_ok());
      CHECK(untouched[static_cast<std::size_t>(r)] == 1);
    }
    const Status& other = st[static_cast<std::size_t>(1 - c.bad_rank)];
    if (c.local_msg != nullptr) {
      CHECK_THAT(st[static_cast<std::size_t>(c.bad_rank)].message(), Catch::Matchers::Contains(c.local_msg));
      CHECK(other.code() == StatusCode::kCollectiveError);
      CHECK_THAT(other.message(), Catch::Matchers::Contains("rejected its part of the call"));
    }
  }
}

TEST_CASE("HeadShard rejects split GQA groups and heads outside the layer", "[shard][bad_input]") {
  ThreadGroup g(2);
  const HeadShard s{2, 4, 16, &g.comm(0)};
  CHECK(s.validate("t", 8, 2).is_ok());
  CHECK_THAT(s.validate("t", 6, 2).message(), Catch::Matchers::Contains("whole GQA groups"));
  CHECK_THAT(s.validate("t", 12, 3).message(), Catch::Matchers::Contains("not inside the layer"));
  const HeadShard none{0, 4, 16, nullptr};
  CHECK_THAT(none.validate("t", 8, 2).message(), Catch::Matchers::Contains("comm is null"));
  Collective broken{0, 2, nullptr, nullptr, nullptr};
  const HeadShard b{0, 4, 16, &broken};
  CHECK_THAT(b.validate("t", 8, 2).message(), Catch::Matchers::Contains("no all_reduce_sum"));
}

TEST_CASE("AdaKVAllocation::allocate refuses a sharded context instead of deciding on one rank's rows", "[shard][bad_input]") {
  ThreadGroup g(2);
  const HeadShard shard{0, 4, 16, &g.comm(0)};
  ExecContext exec;
  exec.shard = &shard;
  const AdaKVAllocation alloc{AdaKVVariant::kKvpress, 0.2, false, Budget::compression_ratio(0.5), 0};
  std::vector<float> s(2 * 16, 1.0f);
  std::vector<std::int64_t> counts(2, -5);
  std::vector<std::byte> ws(alloc.workspace_bytes(Context<backend::Cpu>{{}, exec}, 2, 16));
  const Status st = alloc.allocate(Context<backend::Cpu>{Workspace{ws.data(), ws.size()}, exec}, 16,
                                   TensorView<const float, 2>::contiguous(s.data(), {2, 16}), std::span<std::int64_t>(counts));
  CHECK_THAT(st.message(), Catch::Matchers::Contains("AdaKV<Scorer>::evict"));
  CHECK(counts == std::vector<std::int64_t>{-5, -5});
  CHECK(g.stats(0).all_gathers + g.stats(0).all_reduces == 0);
}
