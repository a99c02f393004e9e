#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/eviction/observed_attention.hpp"
#include "kvpolicy/util/thread_pool.hpp"
#include "policy/eviction/online_test_util.hpp"
#include "policy/golden_inputs.hpp"
#include "policy/policy_test_util.hpp"

using namespace kvpolicy;
using namespace online_test;
using Catch::Matchers::Contains;

STATIC_ASSERT_POLICY(ObservedAttention);

namespace {

std::vector<float> scores_of(const ObservedAttention& p, const ScoreInput<float, float>& in) {
  const std::int64_t H = in.keys.kv_heads(), T = in.keys.kv_len();
  std::vector<float> out(static_cast<std::size_t>(H * T));
  const Requirements req = p.requirements(Context<backend::Scalar>{}, ProblemShape{in.queries.extent(0), H, in.keys.head_dim(), T, T});
  INFO(req.status.message());
  REQUIRE(req.status.is_ok());
  REQUIRE(req.query_window == T);  // the whole prompt
  std::vector<std::byte> ws(req.workspace_bytes);
  const Status s =
      p.score(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}}, in, TensorView<float, 2>::contiguous(out.data(), {H, T}));
  INFO(s.message());
  REQUIRE(s.is_ok());
  return out;
}

/// The engine's column sums (Hq, T); keys give only the shape (Hkv, T).
ScoreInput<float, float> column_sums_input(TensorView<const float, 2> col, std::int64_t Hkv) {
  ScoreInput<float, float> in;
  in.keys = KVSource<float>::shape_only(Hkv, col.extent(1));
  in.column_sums = col;
  return in;
}

/// The full T x T causal attention in double, literally: column sums per
/// query head, the group reduction, the kvpress normalisation, top-k by a full
/// sort (ties -> later token) plus the window.
std::vector<std::vector<std::int32_t>> reference_select(const RandomCase<float>& rc, const ObservedAttentionParams& p,
                                                        std::int64_t n_keep) {
  const std::int64_t T = rc.T, G = rc.Hq / rc.Hkv;
  const auto A = causal_probs(rc.queries, rc.Hq, T, rc.d, rc.keys.data(), rc.Hkv, T * rc.d, T);
  std::vector<std::vector<std::int32_t>> rows;
  for (std::int64_t g = 0; g < rc.Hkv; ++g) {
    std::vector<double> s(static_cast<std::size_t>(T), p.group_reduce == GroupReduce::kMax ? -INFINITY : 0.0);
    for (std::int64_t m = 0; m < G; ++m)
      for (std::int64_t j = 0; j < T; ++j) {
        double col = 0;
        for (std::int64_t i = 0; i < T; ++i) col += A[((g * G + m) * T + i) * T + j];
        s[j] = p.group_reduce == GroupReduce::kMax ? std::max(s[j], col) : s[j] + col;
      }
    for (std::int64_t j = 0; j < T; ++j) {
      if (p.group_reduce == GroupReduce::kMean) s[j] /= static_cast<double>(G);
      if (p.normalize) s[j] /= static_cast<double>(T - j);
    }
    const std::int64_t w = std::min<std::int64_t>(p.window, T), n_win = std::min(n_keep, w), L = T - w;
    std::vector<std::int32_t> idx(static_cast<std::size_t>(L));
    std::iota(idx.begin(), idx.end(), 0);
    std::sort(idx.begin(), idx.end(), [&](auto a, auto b) { return s[a] > s[b] || (s[a] == s[b] && a > b); });
    idx.resize(static_cast<std::size_t>(n_keep - n_win));
    std::sort(idx.begin(), idx.end());
    for (std::int64_t j = T - n_win; j < T; ++j) idx.push_back(static_cast<std::int32_t>(j));
    rows.push_back(idx);
  }
  return rows;
}

}  // namespace

TEST_CASE("observed_attention: golden vectors of reference §11 (kvpress ObservedAttentionPress r=0.5)", "[observed][golden]") {
  const auto qd = golden::queries(), kd = golden::keys();
  const int T = golden::kT, d = golden::kD;
  std::vector<float> q(qd.begin(), qd.end()), k(kd.begin(), kd.end());
  const ScoreInput<float, float> in{TensorView<const float, 3>::contiguous(q.data(), {golden::kHq, T, d}),
                                    KVSource<float>::from(TensorView<const float, 3>::contiguous(k.data(), {golden::kHkv, T, d}))};
  const double expect[2][12] = {{0.3133542671, 0.1964031608, 0.1330593796, 0.1106263298, 0.1122726602, 0.1166411026, 0.1041945946,
                                 0.0990454093, 0.0927701534, 0.0992288506, 0.0889577072, 0.071337068},
                                {0.2906092943, 0.1605619693, 0.1458722449, 0.1480351373, 0.1217043402, 0.107857301, 0.1165745607,
                                 0.1115094058, 0.1033133463, 0.1067771476, 0.0824862177, 0.0712806368}};
  for (std::int32_t block : {64, 5, 1}) {  // the block size of the column-sum pass is not semantics
    ObservedAttentionParams params = ObservedAttentionParams::kvpress(0.5);
    params.query_block = block;
    const ObservedAttention policy(params);
    const auto s = scores_of(policy, in);
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < T; ++j) REQUIRE(s[h * T + j] == Approx(expect[h][j]).epsilon(1e-6));
    for (auto keep : {run_evict<backend::Scalar>(policy, in), run_evict<backend::Cpu>(policy, in)}) {
      REQUIRE(keep.row(0) == std::vector<std::int32_t>{0, 1, 2, 3, 4, 5});
      REQUIRE(keep.row(1) == std::vector<std::int32_t>{0, 1, 2, 3, 4, 6});
    }
  }
}

TEST_CASE("observed_attention: kvpress and KVCache-Factory H2O equal a full T x T reference", "[observed][reference]") {
  RandomCase<float> rc(8, 2, 157, 32, 157, 5);
  for (auto params :
       {ObservedAttentionParams::kvpress(0.5), ObservedAttentionParams::kvpress(0.8), ObservedAttentionParams::kvcache_factory_h2o(64, 8),
        ObservedAttentionParams::kvcache_factory_h2o(40, 8, GroupReduce::kSum),
        ObservedAttentionParams::kvcache_factory_h2o(30, 8, GroupReduce::kMax), ObservedAttentionParams::kvcache_factory_h2o(5, 8)}) {
    params.query_block = 16;
    const ObservedAttention policy(params);
    const std::int64_t n = policy.kept_count(rc.T);
    const auto ref = reference_select(rc, params, n);
    const auto keep = run_evict<backend::Scalar>(policy, rc.input());
    for (int h = 0; h < 2; ++h) REQUIRE(keep.row(h) == ref[h]);
    REQUIRE(run_evict<backend::Cpu>(policy, rc.input()) == keep);
    REQUIRE(run_evict<backend::Cpu>(policy, rc.strided_input()) == keep);
    REQUIRE(run_evict<backend::Cpu>(policy, rc.paged_input(16)) == keep);
    ThreadPool pool(2);
    REQUIRE(run_evict<backend::Cpu>(policy, rc.input(), pool.context()) == keep);
    // engine-provided column sums decide the same
    const auto A = causal_probs(rc.queries, rc.Hq, rc.T, rc.d, rc.keys.data(), rc.Hkv, rc.T * rc.d, rc.T);
    std::vector<float> col(static_cast<std::size_t>(rc.Hq * rc.T), 0.0f);
    for (std::int64_t h = 0; h < rc.Hq; ++h)
      for (std::int64_t i = 0; i < rc.T; ++i)
        for (std::int64_t j = 0; j <= i; ++j) col[h * rc.T + j] += A[(h * rc.T + i) * rc.T + j];
    KeepSetBuffer from_col(2, 2 * n);
    const Requirements req = policy.requirements(Context<backend::Cpu>{{}, pool.context()}, ProblemShape{rc.Hq, 2, 0, rc.T, 0});
    REQUIRE(req.status.is_ok());
    REQUIRE(req.query_window == 0);  // the engine's sums: no queries
    std::vector<std::byte> ws(req.workspace_bytes);
    REQUIRE(policy
                .evict(Context<backend::Cpu>{Workspace{ws.data(), ws.size()}, pool.context()},
                       column_sums_input(TensorView<const float, 2>::contiguous(col.data(), {rc.Hq, rc.T}), 2), from_col.view())
                .is_ok());
    REQUIRE(from_col == keep);
  }
  // Factory: prompts no longer than the capacity are kept whole
  REQUIRE(ObservedAttention(ObservedAttentionParams::kvcache_factory_h2o(200, 8)).kept_count(157) == 157);
  REQUIRE(ObservedAttention(ObservedAttentionParams::kvpress(0.8)).kept_count(1000) == 199);
}

TEST_CASE("observed_attention: batches, dtypes and the window scores", "[observed]") {
  RandomCase<half> a(4, 2, 70, 64, 70, 1), b(4, 2, 33, 64, 33, 2);
  const ObservedAttention policy(ObservedAttentionParams::kvcache_factory_h2o(20, 8));
  std::vector<ScoreInput<float, half>> batch{a.input(), b.input()};
  ThreadPool pool(2);
  const auto all = run_evict_batch<backend::Cpu>(policy, batch, pool.context());
  for (int h = 0; h < 2; ++h) {
    REQUIRE(all.row(h) == run_evict<backend::Scalar>(policy, a.input()).row(h));
    REQUIRE(all.row(2 + h) == run_evict<backend::Scalar>(policy, b.input()).row(h));
    const auto row = all.row(h);
    REQUIRE(std::vector<std::int32_t>(row.end() - 8, row.end()) == std::vector<std::int32_t>{62, 63, 64, 65, 66, 67, 68, 69});
  }
}

TEST_CASE("observed_attention: bad input gets a clear message and writes nothing", "[observed][errors]") {
  RandomCase<float> rc(8, 2, 40, 32, 40, 9);
  const ObservedAttention policy(ObservedAttentionParams::kvpress(0.5));
  auto expect_error = [&](const ObservedAttention& p, ScoreInput<float, float> in, const char* needle) {
    KeepSetBuffer keep(2, 40);
    keep.fill_sentinel();
    // sized for the valid policy: the failure must come from `p` and `in`, not from a short workspace
    const Requirements req = policy.requirements(Context<backend::Cpu>{}, ProblemShape{8, 2, 32, 40, 40});
    REQUIRE(req.status.is_ok());
    std::vector<std::byte> ws(req.workspace_bytes);
    const Status s = p.evict(Context<backend::Cpu>{Workspace{ws.data(), ws.size()}}, in, keep.view());
    INFO(s.message());
    REQUIRE(!s.is_ok());
    REQUIRE_THAT(s.message(), Contains(needle));
    REQUIRE(keep.untouched());
  };
  auto in = rc.input();
  auto bad = in;
  bad.queries = TensorView<const float, 3>(rc.queries.data(), {8, 39, 32}, {40 * 32, 32, 1});
  expect_error(policy, bad, "queries has 39 rows per head, expected one per prompt token (kv_len=40");
  bad = in;
  bad.queries = TensorView<const float, 3>(rc.queries.data(), {5, 40, 32}, {40 * 32, 32, 1});
  expect_error(policy, bad, "queries has 5 heads, not a multiple of the 2 kv heads");
  ObservedAttentionParams p = ObservedAttentionParams::kvpress(0.5);
  p.query_block = 0;
  expect_error(ObservedAttention(p), in, "query_block is 0");
  expect_error(ObservedAttention(ObservedAttentionParams{Budget::tokens(41), 0, true, GroupReduce::kMean, 64, 0.0f}), in,
               "token budget 41 is larger than the sequence length 40");
  std::vector<float> col(8 * 40, 1.0f);
  KeepSetBuffer keep(2, 40);
  keep.fill_sentinel();
  const Requirements req = policy.requirements(Context<backend::Cpu>{}, ProblemShape{8, 2, 0, 40, 0});
  REQUIRE(req.status.is_ok());
  std::vector<std::byte> ws(req.workspace_bytes);
  REQUIRE_THAT(policy
                   .evict(Context<backend::Cpu>{Workspace{ws.data(), ws.size()}},
                          column_sums_input(TensorView<const float, 2>::contiguous(col.data(), {8, 40}), 3), keep.view())
                   .message(),
               Contains("queries has 8 heads, not a multiple of the 3 kv heads"));
  REQUIRE(keep.untouched());
}

TEST_CASE("observed_attention: column sums over a paged source validate its page table first - nothing written",
          "[observed_attention][paged]") {
  // Keys of one sequence of 7 tokens in 4-token pages (only the table is read on this path); column sums (Hq = 4, 7).
  std::vector<float> pool(4 * 4 * 2 * 8, 0.0f), col(4 * 7, 0.25f);
  std::vector<std::int32_t> indptr{0, 2}, indices{0, 1}, last{3};
  const PageStrides st = PageStrides::contiguous(PageLayout::kNHD, 2, 4, 8);
  const auto view = [&] {
    return PagedKVView<const float>{pool.data(), nullptr, st, st, 4, 2, 4, 8, PageTable{indptr.data(), indices.data(), last.data(), 1},
                                    kHost};
  };
  const ObservedAttention p(ObservedAttentionParams::kvpress(0.5));
  const Requirements r = p.requirements(Context<backend::Scalar>{}, ProblemShape{4, 2, 0, 7, 0});
  REQUIRE(r.status.is_ok());
  std::vector<std::byte> ws(r.workspace_bytes);
  const auto evict = [&](const PagedKVView<const float>& kv, KeepSetBuffer& keep) {
    ScoreInput<float, float> in;
    in.keys = KVSource<float>::from_paged(kv, 0);
    in.column_sums = TensorView<const float, 2>::contiguous(col.data(), {4, 7});
    return p.evict(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}}, in, keep.view());
  };
  {
    KeepSetBuffer keep(2, 8);
    const Status ok = evict(view(), keep);
    INFO(ok.message());
    REQUIRE(ok.is_ok());
  }
  PagedKVView<const float> kv = view();
  kv.table.indptr = nullptr;  // used to be read (kv_len) before any check
  KeepSetBuffer keep(2, 8);
  keep.fill_sentinel();
  const Status s = evict(kv, keep);
  REQUIRE_THAT(s.message(), Contains("observed_attention") && Contains("indptr is null"));
  REQUIRE(keep.untouched());
}
