#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "kvpolicy/apply/compact.hpp"
#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/eviction/tova.hpp"
#include "kvpolicy/util/thread_pool.hpp"
#include "policy/eviction/online_test_util.hpp"
#include "policy/golden_inputs.hpp"
#include "policy/policy_test_util.hpp"

using namespace kvpolicy;
using namespace online_test;
using Catch::Matchers::Contains;

STATIC_ASSERT_POLICY(TOVA);

namespace {

/// The engine-probabilities input: `probs` (Hq, q, n), keys give only the shape (Hkv, n).
template <class Tp>
ScoreInput<float, float, Tp> attention_input(TensorView<const Tp, 3> probs, std::int64_t Hkv) {
  ScoreInput<float, float, Tp> in;
  in.keys = KVSource<float>::shape_only(Hkv, probs.extent(2));
  in.attention = probs;
  return in;
}

/// The newest query's probability rows (Hq, n) as a one-row (Hq, 1, n) attention view.
template <class Tp>
TensorView<const Tp, 3> last_rows(TensorView<const Tp, 2> rows) {
  return TensorView<const Tp, 3>(rows.data(), {rows.extent(0), 1, rows.extent(1)}, {rows.stride(0), 0, rows.stride(1)}, rows.device());
}

/// Workspace of the engine-probabilities path (head_dim = 0) for caches of at most n tokens.
template <class Backend>
std::vector<std::byte> attention_workspace(const TOVA& p, std::int64_t Hq, std::int64_t Hkv, std::int64_t n) {
  const Requirements req = p.requirements(Context<Backend>{}, ProblemShape{Hq, Hkv, 0, n, 1});
  INFO(req.status.message());
  REQUIRE(req.status.is_ok());
  REQUIRE(req.query_window == 0);
  return std::vector<std::byte>(req.workspace_bytes);
}

template <class Backend, class Tp>
KeepSetBuffer from_attention(const TOVA& p, TensorView<const Tp, 3> probs, std::int64_t Hkv) {
  const std::int64_t n = probs.extent(2);
  KeepSetBuffer keep(Hkv, std::max<std::int64_t>(Hkv * p.kept_count(n), 1));
  auto ws = attention_workspace<Backend>(p, probs.extent(0), Hkv, n);
  const Status s = p.evict(Context<Backend>{Workspace{ws.data(), ws.size()}}, attention_input(probs, Hkv), keep.view());
  INFO(s.message());
  REQUIRE(s.is_ok());
  return keep;
}

/// §8.1 TOVACache.reduce written out literally: mean over all query heads of
/// the last query row, topk(cache_size) (full sort; ties -> later slot), sorted.
std::vector<std::int64_t> reference_reduce(const std::vector<float>& A, std::int64_t Hq, std::int64_t q, std::int64_t n,
                                           std::int64_t cache_size) {
  std::vector<std::int64_t> idx(static_cast<std::size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  if (n <= cache_size) return idx;
  std::vector<float> s(static_cast<std::size_t>(n), 0.0f);
  for (std::int64_t j = 0; j < n; ++j) {
    float acc = A[((0 * q) + q - 1) * n + j];
    for (std::int64_t h = 1; h < Hq; ++h) acc += A[(h * q + q - 1) * n + j];
    s[j] = acc / static_cast<float>(Hq);
  }
  std::sort(idx.begin(), idx.end(), [&](auto a, auto b) { return s[a] > s[b] || (s[a] == s[b] && a > b); });
  idx.resize(static_cast<std::size_t>(cache_size));
  std::sort(idx.begin(), idx.end());
  return idx;
}

}  // namespace

TEST_CASE("tova: golden vector of reference §11 (kvpress TOVAPress r=0.5)", "[tova][golden]") {
  const auto qd = golden::queries(), kd = golden::keys();
  const int T = golden::kT, d = golden::kD;
  std::vector<float> q(qd.begin(), qd.end()), k(kd.begin(), kd.end());
  const ScoreInput<float, float> in{TensorView<const float, 3>::contiguous(q.data(), {golden::kHq, T, d}),
                                    KVSource<float>::from(TensorView<const float, 3>::contiguous(k.data(), {golden::kHkv, T, d}))};
  const TOVA policy(TOVAParams::kvpress(0.5));
  // the last token is protected: kvpress pads it with max + 1 (1.1057962784), the library scores it +inf (same order)
  const double expect[12] = {0.0904457321, 0.0709299595, 0.0787085502, 0.0838177183, 0.0739060762, 0.0741375382,
                             0.0907305992, 0.1035822777, 0.0719727796, 0.1057962784, 0.0846636382, INFINITY};
  std::vector<float> scores(2 * T);
  const ProblemShape shape{golden::kHq, golden::kHkv, d, T, T};
  const Requirements req = policy.requirements(Context<backend::Scalar>{}, shape);
  REQUIRE(req.status.is_ok());
  std::vector<std::byte> ws(req.workspace_bytes);
  REQUIRE(
      policy.score(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}}, in, TensorView<float, 2>::contiguous(scores.data(), {2, T}))
          .is_ok());
  for (int h = 0; h < 2; ++h) {
    for (int j = 0; j < T - 1; ++j) REQUIRE(scores[h * T + j] == Approx(expect[j]).epsilon(1e-6));
    REQUIRE(std::isinf(scores[h * T + T - 1]));
    REQUIRE(scores[h * T + T - 1] > 0.0f);
  }
  const std::vector<std::int32_t> kept{0, 6, 7, 9, 10, 11};  // top 5 of the first 11, plus the last
  for (auto keep : {run_evict<backend::Scalar>(policy, in), run_evict<backend::Cpu>(policy, in)}) {
    REQUIRE(keep.row(0) == kept);
    REQUIRE(keep.row(1) == kept);
  }
  // The engine-probabilities path (kvpress's eager `attentions`) decides the same.
  std::vector<float> A(golden::kHq * T * T, 0.0f);
  for (int h = 0; h < golden::kHq; ++h)
    for (int i = 0; i < T; ++i) {
      double den = 0, l[golden::kT];
      for (int j = 0; j <= i; ++j) {
        l[j] = 0;
        for (int c = 0; c < d; ++c) l[j] += qd[(h * T + i) * d + c] * kd[((h / 2) * T + j) * d + c];
        den += std::exp(l[j] / 2);
      }
      for (int j = 0; j <= i; ++j) A[(h * T + i) * T + j] = static_cast<float>(std::exp(l[j] / 2) / den);
    }
  REQUIRE(from_attention<backend::Scalar>(policy, TensorView<const float, 3>::contiguous(A.data(), {golden::kHq, T, T}), 2).row(1) == kept);
  // Without the last-token protection (original TOVA at cache_size 6) the last token competes: 11 has score 0.0713 < 0.0846.
  const auto orig = from_attention<backend::Scalar>(TOVA(TOVAParams::original(6)),
                                                    TensorView<const float, 3>::contiguous(A.data(), {golden::kHq, T, T}), 2);
  REQUIRE(orig.row(0) == std::vector<std::int32_t>{0, 3, 6, 7, 9, 10});
}

TEMPLATE_TEST_CASE("tova: online over 100 steps equals the literal TOVACache.reduce", "[tova][reference]", backend::Scalar, backend::Cpu) {
  const std::int64_t Hq = 8, Hkv = 2, d = 16, cache_size = 16, prompt = 40, cap = prompt + 1;
  const TOVA policy(TOVAParams::original(cache_size));
  TokenStream ts(Hq, Hkv, d, 21);
  std::vector<float> keys(Hkv * cap * d), ref_keys;  // ref: (Hkv, n, d) rebuilt by gather
  std::vector<std::int32_t> pos(Hkv * cap);
  std::vector<std::vector<std::int32_t>> ref_pos(Hkv);
  std::int64_t len = 0, evicted_newest = 0;
  std::int32_t next = 0;
  ThreadPool pool(2);
  for (int step = 0; step <= 100; ++step) {
    const std::int64_t q = step == 0 ? prompt : 1;
    for (std::int64_t t = 0; t < q; ++t, ++len, ++next) {
      const auto k = ts.key();
      for (std::int64_t g = 0; g < Hkv; ++g) {
        std::copy(k.begin() + g * d, k.begin() + (g + 1) * d, keys.begin() + (g * cap + len) * d);
        pos[g * cap + len] = next;
        ref_pos[g].push_back(next);
      }
    }
    const auto queries = ts.queries(q);
    const std::int64_t n = len;
    const auto A = causal_probs(queries, Hq, q, d, keys.data(), Hkv, cap * d, n);
    const auto expect = reference_reduce(A, Hq, q, n, cache_size);
    auto keep = from_attention<TestType>(policy, TensorView<const float, 3>::contiguous(A.data(), {Hq, q, n}), Hkv);
    // the same decision from the queries and keys (Backend::window_scores recomputes the last row)
    const ScoreInput<float, float> in{TensorView<const float, 3>::contiguous(queries.data(), {Hq, q, d}),
                                      KVSource<float>::from(TensorView<const float, 3>(keys.data(), {Hkv, n, d}, {cap * d, d, 1}))};
    REQUIRE(run_evict<TestType>(policy, in, pool.context()) == keep);
    for (std::int64_t g = 0; g < Hkv; ++g) {
      const auto row = keep.row(g);
      REQUIRE(std::vector<std::int64_t>(row.begin(), row.end()) == expect);
      std::vector<std::int32_t> gathered;
      for (auto j : expect) gathered.push_back(ref_pos[g][j]);
      ref_pos[g] = gathered;
    }
    if (n > cache_size && expect.back() != n - 1) ++evicted_newest;
    std::vector<std::int64_t> lens(Hkv);
    REQUIRE(compact_contiguous<float>(TensorView<float, 3>::contiguous(keys.data(), {Hkv, cap, d}), {},
                                      TensorView<std::int32_t, 2>::contiguous(pos.data(), {Hkv, cap}), n, keep.view(), 0, lens)
                .is_ok());
    len = lens[0];
    REQUIRE(len == std::min(n, cache_size));
    for (std::int64_t g = 0; g < Hkv; ++g)
      REQUIRE(std::vector<std::int32_t>(pos.begin() + g * cap, pos.begin() + g * cap + len) == ref_pos[g]);
  }
  REQUIRE(evicted_newest > 0);  // the newest token is not protected (TOVA evicts it when it scores lowest)
}

TEST_CASE("tova: one selection for every kv head, budgets, protect_last, fp16 rows, paged keys", "[tova]") {
  RandomCase<half> rc(8, 4, 300, 64, 5, 3);
  for (auto params : {TOVAParams::kvpress(0.3), TOVAParams::kvpress(0.99), TOVAParams::original(64), TOVAParams::original(1000)}) {
    const TOVA policy(params);
    const auto ref = run_evict<backend::Scalar>(policy, rc.input());
    const std::int64_t n = policy.kept_count(300);
    for (int h = 0; h < 4; ++h) {
      const auto row = ref.row(h);
      REQUIRE(static_cast<std::int64_t>(row.size()) == n);
      REQUIRE(row == ref.row(0));
      REQUIRE(std::is_sorted(row.begin(), row.end()));
    }
    if (params.protect_last && n > 0) REQUIRE(ref.row(0).back() == 299);
    REQUIRE(run_evict<backend::Cpu>(policy, rc.strided_input()) == ref);
    REQUIRE(run_evict<backend::Cpu>(policy, rc.paged_input(16)) == ref);
    ThreadPool pool(2);
    REQUIRE(run_evict<backend::Cpu>(policy, rc.input(), pool.context()) == ref);
  }
  REQUIRE(TOVA(TOVAParams::kvpress(0.8)).kept_count(1000) == 199);
  REQUIRE(TOVA(TOVAParams::kvpress(0.99)).kept_count(50) == 0);
  // fp16 probability rows (Hq, n) equal their fp32 conversion
  std::vector<half> rows(8 * 50);
  std::vector<float> rows_f(8 * 50);
  for (std::size_t i = 0; i < rows.size(); ++i)
    rows[i] = from_float<half>(0.001f * static_cast<float>((i * 37) % 97)), rows_f[i] = to_float(rows[i]);
  const TOVA p(TOVAParams::original(20));
  KeepSetBuffer a(2, 40), b(2, 40);
  auto ws = attention_workspace<backend::Scalar>(p, 8, 2, 50);
  const Context<backend::Scalar> cx{Workspace{ws.data(), ws.size()}};
  REQUIRE(p.evict(cx, attention_input(last_rows(TensorView<const half, 2>::contiguous(rows.data(), {8, 50})), 2), a.view()).is_ok());
  REQUIRE(p.evict(cx, attention_input(last_rows(TensorView<const float, 2>::contiguous(rows_f.data(), {8, 50})), 2), b.view()).is_ok());
  REQUIRE(a == b);
}

TEST_CASE("tova: batch of sequences equals per-sequence calls", "[tova]") {
  RandomCase<float> a(8, 2, 100, 32, 1, 1), b(8, 2, 37, 32, 1, 2), c(8, 2, 250, 32, 1, 3);
  const TOVA policy(TOVAParams::kvpress(0.6));
  std::vector<ScoreInput<float, float>> batch{a.input(), b.input(), c.input()};
  ThreadPool pool(2);
  const auto all = run_evict_batch<backend::Cpu>(policy, batch, pool.context());
  std::int64_t row = 0;
  for (auto* rc : {&a, &b, &c}) {
    const auto one = run_evict<backend::Scalar>(policy, rc->input());
    for (int h = 0; h < 2; ++h) REQUIRE(all.row(row++) == one.row(h));
  }
}

TEST_CASE("tova: bad input gets a clear message and writes nothing", "[tova][errors]") {
  const TOVA policy(TOVAParams::original(10));
  std::vector<float> probs(8 * 3 * 20, 0.05f);
  auto ws = attention_workspace<backend::Scalar>(policy, 8, 2, 20);
  auto expect_error = [&](TensorView<const float, 3> p, std::int64_t hkv, const char* needle, std::size_t bytes = SIZE_MAX) {
    KeepSetBuffer keep(hkv > 0 ? hkv : 1, 40);
    keep.fill_sentinel();
    const Status s =
        policy.evict(Context<backend::Scalar>{Workspace{ws.data(), std::min(bytes, ws.size())}}, attention_input(p, hkv), keep.view());
    INFO(s.message());
    REQUIRE(!s.is_ok());
    REQUIRE_THAT(s.message(), Contains(needle));
    REQUIRE(keep.untouched());
  };
  expect_error(TensorView<const float, 3>::contiguous(probs.data(), {8, 3, 20}), 3,
               "queries has 8 heads, not a multiple of the 3 kv heads");
  expect_error(TensorView<const float, 3>::contiguous(probs.data(), {8, 0, 20}), 2, "has 0 query rows");
  expect_error(TensorView<const float, 3>(nullptr, {8, 3, 20}, {60, 20, 1}), 2, "probabilities has null data");
  expect_error(TensorView<const float, 3>::contiguous(probs.data(), {8, 3, 20}), 2, "workspace has 16 bytes", 16);
  const TOVA strict(TOVAParams{Budget::tokens(30), false, 0.0f});
  KeepSetBuffer keep(2, 60);
  keep.fill_sentinel();
  REQUIRE_THAT(strict
                   .evict(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}},
                          attention_input(TensorView<const float, 3>::contiguous(probs.data(), {8, 3, 20}), 2), keep.view())
                   .message(),
               Contains("token budget 30 is larger than the sequence length 20"));
  REQUIRE(keep.untouched());
  RandomCase<float> rc(8, 2, 50, 32, 1, 4);
  auto in = rc.input();
  in.queries = TensorView<const float, 3>(rc.queries.data(), {8, 1, 16}, {32, 32, 1});
  const Requirements req2 = policy.requirements(Context<backend::Scalar>{}, ProblemShape{8, 2, 32, 50, 1});
  REQUIRE(req2.status.is_ok());
  std::vector<std::byte> ws2(req2.workspace_bytes);
  const Context<backend::Scalar> cx2{Workspace{ws2.data(), ws2.size()}};
  REQUIRE_THAT(policy.evict(cx2, in, keep.view()).message(), Contains("queries head_dim 16 differs from keys head_dim 32"));
  REQUIRE_THAT(TOVA(TOVAParams::kvpress(1.0)).evict(cx2, rc.input(), keep.view()).message(),
               Contains("compression_ratio is 1, must be in [0, 1)"));
  REQUIRE(keep.untouched());
}

TEST_CASE("tova: the one-victim path follows the total order (NaN lowest, first NaN goes)", "[tova][order]") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::int64_t n = 9;
  std::vector<float> rows = {0.3f, 0.1f, 0.2f, 0.1f, 0.5f, 0.4f, 0.1f, 0.6f, 0.7f};  // one head: the mean is the row
  KeepSetBuffer keep(1, n);
  auto ws = attention_workspace<backend::Scalar>(TOVA(), 1, 1, n);
  auto run = [&](const TOVA& p) {
    REQUIRE(p.evict(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}},
                    attention_input(last_rows(TensorView<const float, 2>::contiguous(rows.data(), {1, n})), 1), keep.view())
                .is_ok());
    return keep.row(0);
  };
  REQUIRE(run(TOVA(TOVAParams::original(n - 1))) == std::vector<std::int32_t>{0, 2, 3, 4, 5, 6, 7, 8});  // ties: the earliest 0.1 goes
  rows[5] = nan, rows[7] = nan;
  REQUIRE(run(TOVA(TOVAParams::original(n - 1))) == std::vector<std::int32_t>{0, 1, 2, 3, 4, 6, 7, 8});
  REQUIRE(run(TOVA(TOVAParams::original(n - 2))) == std::vector<std::int32_t>{0, 1, 2, 3, 4, 6, 8});  // top-k path: both NaNs go
  rows[8] = -1.0f;  // protect_last keeps the lowest-scoring last token
  REQUIRE(run(TOVA(TOVAParams{Budget::tokens(n - 1), true, 0.0f})) == std::vector<std::int32_t>{0, 1, 2, 3, 4, 6, 7, 8});
  REQUIRE(run(TOVA(TOVAParams{Budget::tokens(1), true, 0.0f})) == std::vector<std::int32_t>{8});
  REQUIRE(run(TOVA(TOVAParams{Budget::tokens(0), true, 0.0f})).empty());
}

TEST_CASE("tova: a decision keeping nothing accepts an empty keep set with null indices", "[tova][errors]") {
  RandomCase<float> rc(8, 4, 50, 16, 5, 3);
  const TOVA policy(TOVAParams::kvpress(0.99));  // int(50 * 0.01) = 0 tokens
  REQUIRE(policy.kept_count(50) == 0);
  const Requirements r = policy.requirements(Context<backend::Cpu>{}, ProblemShape{8, 4, 16, 50, 5});
  REQUIRE(r.status.is_ok());
  std::vector<std::byte> ws(r.workspace_bytes);
  std::vector<std::int32_t> indptr(5, -1);
  // Used to memcpy from / to null with a zero size (undefined behaviour, reported by UBSan).
  REQUIRE(policy.evict(Context<backend::Cpu>{Workspace{ws.data(), ws.size()}}, rc.input(), KeepSet{indptr.data(), nullptr, 4, 0}).is_ok());
  REQUIRE(indptr == std::vector<std::int32_t>{0, 0, 0, 0, 0});
}
