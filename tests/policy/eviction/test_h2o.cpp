#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "kvpolicy/apply/compact.hpp"
#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/eviction/h2o.hpp"
#include "kvpolicy/util/thread_pool.hpp"
#include "policy/eviction/online_test_util.hpp"
#include "policy/policy_test_util.hpp"

using namespace kvpolicy;
using namespace online_test;
using Catch::Matchers::Contains;

namespace {

/// §6.1 written out literally with std::vector, for one kv head of the state:
/// new[j] = sum over the call's rows (and the group's heads) of A; the first
/// old_n slots add their old score; if n > hh + recent keep the hh best of
/// [0, n - recent) (full sort) plus [n - recent, n), ascending, and gather.
struct ReferenceH2O {
  std::int64_t hh, recent, G;
  bool mean;
  std::vector<std::vector<float>> score;  // [head][slot]
  std::vector<std::vector<float>> key;    // [head][slot * d + c]
  std::vector<std::vector<std::int32_t>> pos;

  void append(const std::vector<float>& k, std::int64_t d, std::int32_t p) {
    for (std::size_t g = 0; g < key.size(); ++g) {
      key[g].insert(key[g].end(), k.begin() + static_cast<std::ptrdiff_t>(g * d), k.begin() + static_cast<std::ptrdiff_t>((g + 1) * d));
      pos[g].push_back(p);
    }
  }
  void accumulate(const std::vector<float>& A, std::int64_t q, std::int64_t n) {
    for (std::size_t g = 0; g < score.size(); ++g) {
      std::vector<float> fresh(static_cast<std::size_t>(n), 0.0f);
      for (std::int64_t m = 0; m < G; ++m) {
        const std::int64_t h = static_cast<std::int64_t>(g) * G + m;
        for (std::int64_t j = 0; j < n; ++j) {
          float c = A[(h * q) * n + j];
          for (std::int64_t i = 1; i < q; ++i) c += A[(h * q + i) * n + j];
          fresh[j] = m == 0 ? c : fresh[j] + c;
        }
      }
      if (mean && G > 1)
        for (auto& v : fresh) v /= static_cast<float>(G);
      for (std::size_t j = 0; j < score[g].size(); ++j) fresh[j] += score[g][j];
      score[g] = fresh;
    }
  }
  void evict(std::int64_t d, std::int64_t num_coming = 0) {
    for (std::size_t g = 0; g < score.size(); ++g) {
      const auto n = static_cast<std::int64_t>(score[g].size());
      if (n + num_coming <= hh + recent) continue;
      const std::int64_t r = std::max<std::int64_t>(recent - num_coming, 0), heavy = hh + recent - num_coming - r;
      std::vector<std::int64_t> cand(static_cast<std::size_t>(n - r));
      std::iota(cand.begin(), cand.end(), 0);
      std::sort(cand.begin(), cand.end(),
                [&](std::int64_t a, std::int64_t b) { return score[g][a] > score[g][b] || (score[g][a] == score[g][b] && a > b); });
      std::vector<std::int64_t> keep(cand.begin(), cand.begin() + heavy);
      std::sort(keep.begin(), keep.end());
      for (std::int64_t j = n - r; j < n; ++j) keep.push_back(j);
      std::vector<float> s, k;
      std::vector<std::int32_t> p;
      for (auto j : keep) {
        s.push_back(score[g][j]);
        p.push_back(pos[g][j]);
        k.insert(k.end(), key[g].begin() + j * d, key[g].begin() + (j + 1) * d);
      }
      score[g] = s, key[g] = k, pos[g] = p;
    }
  }
};

/// The library side: a contiguous cache (Hkv, cap, d) + logical positions + H2O state.
struct LibraryCache {
  std::int64_t Hkv, cap, d, len = 0;
  std::vector<float> keys, state;
  std::vector<std::int32_t> pos;
  LibraryCache(std::int64_t hkv, std::int64_t c, std::int64_t dd)
      : Hkv(hkv), cap(c), d(dd), keys(hkv * c * dd), state(hkv * c), pos(hkv * c) {}
  H2OState h2o{};
  void init() { h2o = H2OState{TensorView<float, 2>::contiguous(state.data(), {Hkv, cap}), 0}; }
  void append(const std::vector<float>& k, std::int32_t p) {
    for (std::int64_t g = 0; g < Hkv; ++g) {
      std::copy(k.begin() + g * d, k.begin() + (g + 1) * d, keys.begin() + (g * cap + len) * d);
      pos[g * cap + len] = p;
    }
    ++len;
  }
  /// Applies a KeepSet with apply/compact.hpp.
  void compact(KeepSetBuffer& keep) {
    std::vector<std::int64_t> lens(Hkv);
    REQUIRE(compact_contiguous<float>(TensorView<float, 3>::contiguous(keys.data(), {Hkv, cap, d}), {},
                                      TensorView<std::int32_t, 2>::contiguous(pos.data(), {Hkv, cap}), len, keep.view(), 0, lens)
                .is_ok());
    for (auto l : lens) REQUIRE(l == lens[0]);
    len = lens[0];
  }
};

/// The engine's probabilities (Hq, q, n) as an update input (keys are not read).
template <class Tp>
ScoreInput<float, float, Tp> probs_input(TensorView<const Tp, 3> probs) {
  ScoreInput<float, float, Tp> in;
  in.attention = probs;
  return in;
}

/// The engine's column sums (Hq, n) as an update input (keys are not read).
ScoreInput<float, float> column_sums_input(TensorView<const float, 2> col) {
  ScoreInput<float, float> in;
  in.column_sums = col;
  return in;
}

/// Workspace from the one size query (update from queries when shape.head_dim > 0, and evict).
template <class Backend>
std::vector<std::byte> h2o_workspace(const H2O& p, const ProblemShape& shape, const ExecContext& ctx = {}) {
  const Requirements req = p.requirements(Context<Backend>{{}, ctx}, shape);
  INFO(req.status.message());
  REQUIRE(req.status.is_ok());
  REQUIRE(req.output.rows == p.state_rows(shape));
  return std::vector<std::byte>(req.workspace_bytes);
}

/// Workspace of an evict of a state of `state_rows` rows and `len` slots (no queries path).
template <class Backend>
std::vector<std::byte> evict_workspace(const H2O& p, std::int64_t state_rows, std::int64_t len, const ExecContext& ctx = {}) {
  return h2o_workspace<Backend>(p, ProblemShape{state_rows, state_rows, 0, len, 0}, ctx);
}

template <class Backend>
KeepSetBuffer evict_for_space(const H2O& p, H2OState& st, std::int64_t num_coming = 0, const ExecContext& ctx = {}) {
  const std::int64_t H = st.scores.extent(0);
  KeepSetBuffer keep(H, std::max<std::int64_t>(H * std::max<std::int64_t>(p.kept_count(st.length, num_coming), 0), 1));
  auto ws = evict_workspace<Backend>(p, H, st.length, ctx);
  const Status s = p.evict_for_space(Context<Backend>{Workspace{ws.data(), ws.size()}, ctx}, st, num_coming, keep.view());
  INFO(s.message());
  REQUIRE(s.is_ok());
  return keep;
}

/// Runs prefill + `steps` decode steps through the library and the reference side by side.
template <class Backend>
void run_against_reference(std::int64_t Hq, std::int64_t Hkv, GroupReduce red, std::int64_t hh, std::int64_t recent, std::int64_t prompt,
                           std::int64_t steps, unsigned seed, const ExecContext& ctx = {}) {
  const std::int64_t d = 16, G = Hq / Hkv;
  H2OParams params = H2OParams::original(hh, recent);
  params.group_reduce = red;
  const H2O policy(params);
  TokenStream ts(Hq, Hkv, d, seed);
  ReferenceH2O ref{hh,
                   recent,
                   G,
                   red == GroupReduce::kMean,
                   std::vector<std::vector<float>>(Hkv),
                   std::vector<std::vector<float>>(Hkv),
                   std::vector<std::vector<std::int32_t>>(Hkv)};
  LibraryCache lib(Hkv, std::max(prompt, hh + recent) + 1, d);
  lib.init();
  std::int32_t next_pos = 0;
  for (std::int64_t step = 0; step <= steps; ++step) {
    const std::int64_t q = step == 0 ? prompt : 1;
    for (std::int64_t t = 0; t < q; ++t) {
      const auto k = ts.key();
      lib.append(k, next_pos);
      ref.append(k, d, next_pos);
      ++next_pos;
    }
    const auto queries = ts.queries(q);
    const std::int64_t n = lib.len;
    const auto probs = causal_probs(queries, Hq, q, d, lib.keys.data(), Hkv, lib.cap * d, n);
    std::vector<float> ref_keys_flat;  // the reference recomputes from its own cache
    for (auto& kg : ref.key) ref_keys_flat.insert(ref_keys_flat.end(), kg.begin(), kg.end());
    const auto ref_probs = causal_probs(queries, Hq, q, d, ref_keys_flat.data(), Hkv, n * d, n);
    REQUIRE(ref_probs == probs);  // identical caches give identical attention
    ref.accumulate(ref_probs, q, n);
    REQUIRE(policy.update(Context<Backend>{{}, ctx}, lib.h2o, probs_input(TensorView<const float, 3>::contiguous(probs.data(), {Hq, q, n})))
                .is_ok());
    ref.evict(d);
    auto keep = evict_for_space<Backend>(policy, lib.h2o, 0, ctx);
    lib.compact(keep);
    // Exactly heavy + recent slots, the recent window always kept, same positions and scores.
    const std::int64_t expect_len = std::min<std::int64_t>(n, hh + recent);
    REQUIRE(lib.len == expect_len);
    REQUIRE(lib.h2o.length == expect_len);
    for (std::int64_t g = 0; g < Hkv; ++g) {
      const std::vector<std::int32_t> got(lib.pos.begin() + g * lib.cap, lib.pos.begin() + g * lib.cap + lib.len);
      REQUIRE(got == ref.pos[g]);
      REQUIRE(std::is_sorted(got.begin(), got.end()));
      for (std::int64_t r = 0; r < std::min<std::int64_t>(recent, n); ++r) REQUIRE(got[got.size() - 1 - r] == next_pos - 1 - r);
      for (std::int64_t j = 0; j < lib.len; ++j) {
        REQUIRE(lib.state[g * lib.cap + j] == Approx(ref.score[g][j]).epsilon(1e-5));
        REQUIRE(lib.state[g * lib.cap + j] == ref.score[g][j]);  // same order of additions: bit-identical
      }
    }
  }
}

}  // namespace

TEMPLATE_TEST_CASE("h2o: 200 decode steps match the literal §6.1 reference (MHA, GQA sum, GQA mean)", "[h2o][reference]", backend::Scalar,
                   backend::Cpu) {
  SECTION("MHA, 4 heads, hh 8 + recent 12") { run_against_reference<TestType>(4, 4, GroupReduce::kSum, 8, 12, 40, 200, 1); }
  SECTION("GQA 8/2, group sum") { run_against_reference<TestType>(8, 2, GroupReduce::kSum, 6, 10, 30, 200, 2); }
  SECTION("GQA 8/2, group mean, no heavy hitters") { run_against_reference<TestType>(8, 2, GroupReduce::kMean, 0, 16, 20, 60, 3); }
  SECTION("no recent window") { run_against_reference<TestType>(4, 2, GroupReduce::kSum, 12, 0, 25, 60, 4); }
  SECTION("prompt shorter than the budget, threads") {
    ThreadPool pool(2);
    run_against_reference<TestType>(8, 4, GroupReduce::kSum, 10, 10, 7, 50, 5, pool.context());
  }
}

TEMPLATE_TEST_CASE("h2o: the library-computed update equals the update from engine probabilities", "[h2o][queries]", backend::Scalar,
                   backend::Cpu) {
  const std::int64_t Hq = 8, Hkv = 2, d = 32, prompt = 150, cap = 256;  // prompt > 64: several query blocks
  for (GroupReduce red : {GroupReduce::kSum, GroupReduce::kMean}) {
    H2OParams params = H2OParams::original(10, 20);
    params.group_reduce = red;
    const H2O policy(params);
    TokenStream ts(Hq, Hkv, d, 77);
    LibraryCache lib(Hkv, cap, d);
    std::vector<float> st_q(Hkv * cap), st_c(Hkv * cap);
    lib.init();
    H2OState from_q{TensorView<float, 2>::contiguous(st_q.data(), {Hkv, cap}), 0};
    H2OState from_c{TensorView<float, 2>::contiguous(st_c.data(), {Hkv, cap}), 0};
    std::int32_t next = 0;
    for (int step = 0; step < 30; ++step) {
      const std::int64_t q = step == 0 ? prompt : (step % 7 == 3 ? 3 : 1);  // a few multi-token calls
      for (std::int64_t t = 0; t < q; ++t) lib.append(ts.key(), next++);
      const std::int64_t n = lib.len;
      const auto queries = ts.queries(q);
      const auto probs = causal_probs(queries, Hq, q, d, lib.keys.data(), Hkv, cap * d, n);
      const Context<TestType> cx0{};  // the probabilities paths need no workspace
      REQUIRE(policy.update(cx0, lib.h2o, probs_input(TensorView<const float, 3>::contiguous(probs.data(), {Hq, q, n}))).is_ok());
      // column sums as an engine kernel would return them
      std::vector<float> col(Hq * n, 0.0f);
      for (std::int64_t h = 0; h < Hq; ++h)
        for (std::int64_t j = 0; j < n; ++j) {
          float c = probs[(h * q) * n + j];
          for (std::int64_t i = 1; i < q; ++i) c += probs[(h * q + i) * n + j];
          col[h * n + j] = c;
        }
      REQUIRE(policy.update(cx0, from_c, column_sums_input(TensorView<const float, 2>::contiguous(col.data(), {Hq, n}))).is_ok());
      const ScoreInput<float, float> in{TensorView<const float, 3>::contiguous(queries.data(), {Hq, q, d}),
                                        KVSource<float>::from(TensorView<const float, 3>(lib.keys.data(), {Hkv, n, d}, {cap * d, d, 1}))};
      auto ws = h2o_workspace<TestType>(policy, ProblemShape{Hq, Hkv, d, n, q});
      const Status s = policy.update(Context<TestType>{Workspace{ws.data(), ws.size()}}, from_q, in);
      INFO(s.message());
      REQUIRE(s.is_ok());
      REQUIRE(from_q.length == n);
      for (std::int64_t g = 0; g < Hkv; ++g)
        for (std::int64_t j = 0; j < n; ++j) {
          const float ref = lib.state[g * cap + j];
          REQUIRE(st_c[g * cap + j] == ref);
          REQUIRE(st_q[g * cap + j] == Approx(ref).epsilon(1e-5).margin(1e-6));
        }
      auto keep = evict_for_space<TestType>(policy, lib.h2o);
      const auto keep_c = evict_for_space<TestType>(policy, from_c);
      const auto keep_q = evict_for_space<TestType>(policy, from_q);
      REQUIRE(keep_c == keep);
      REQUIRE(keep_q == keep);
      lib.compact(keep);
    }
  }
}

TEST_CASE("h2o: per-query-head granularity, fp16 probabilities, paged keys, threads give the same decisions", "[h2o]") {
  const std::int64_t Hq = 4, d = 16, n = 60;
  RandomCase<float> rc(Hq, Hq, n, d, n, 9);  // MHA: the per-query-head cache
  auto in = rc.input();
  H2OParams params = H2OParams::original(8, 8);
  params.granularity = H2OGranularity::kQueryHead;
  const H2O policy(params);
  std::vector<float> s1(Hq * n), s2(Hq * n), s3(Hq * n);
  H2OState a{TensorView<float, 2>::contiguous(s1.data(), {Hq, n}), 0}, b{TensorView<float, 2>::contiguous(s2.data(), {Hq, n}), 0},
      c{TensorView<float, 2>::contiguous(s3.data(), {Hq, n}), 0};
  ThreadPool pool(2);
  auto ws = h2o_workspace<backend::Cpu>(policy, ProblemShape{Hq, Hq, d, n, n}, pool.context());
  REQUIRE(policy.update(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}}, a, in).is_ok());
  REQUIRE(policy.update(Context<backend::Cpu>{Workspace{ws.data(), ws.size()}, pool.context()}, b, rc.paged_input(16)).is_ok());
  // fp16 probabilities: the update converts exactly (values already fp16-representable)
  const auto probs = causal_probs(rc.queries, Hq, n, d, rc.keys.data(), Hq, n * d, n);
  std::vector<half> ph(probs.size());
  std::vector<float> pf(probs.size());
  for (std::size_t i = 0; i < probs.size(); ++i) ph[i] = from_float<half>(probs[i]), pf[i] = to_float(ph[i]);
  const Context<backend::Scalar> cx0{};
  REQUIRE(policy.update(cx0, c, probs_input(TensorView<const half, 3>::contiguous(ph.data(), {Hq, n, n}))).is_ok());
  std::vector<float> s4(Hq * n);
  H2OState e{TensorView<float, 2>::contiguous(s4.data(), {Hq, n}), 0};
  REQUIRE(policy.update(cx0, e, probs_input(TensorView<const float, 3>::contiguous(pf.data(), {Hq, n, n}))).is_ok());
  REQUIRE(s3 == s4);
  for (std::size_t i = 0; i < s1.size(); ++i) REQUIRE(s2[i] == Approx(s1[i]).epsilon(1e-5).margin(1e-6));
  const auto ka = evict_for_space<backend::Scalar>(policy, a), kb = evict_for_space<backend::Cpu>(policy, b, 0, pool.context());
  REQUIRE(ka == kb);
  REQUIRE(ka.indptr.back() == Hq * 16);
}

TEST_CASE("h2o: evict_for_space follows the original, and shrinks the heavy part past the recent window", "[h2o][space]") {
  const std::int64_t n = 30;
  std::vector<float> buf(n);
  for (std::int64_t j = 0; j < n; ++j) buf[j] = static_cast<float>((j * 7) % 11);  // ties, resolved towards later slots
  auto run = [&](std::int64_t hh, std::int64_t recent, std::int64_t num_coming) {
    std::vector<float> s = buf;
    H2OState st{TensorView<float, 2>::contiguous(s.data(), {1, n}), n};
    auto keep = evict_for_space<backend::Scalar>(H2O(H2OParams::original(hh, recent)), st, num_coming);
    ReferenceH2O ref{hh, recent, 1, false, {buf}, {std::vector<float>(n)}, {std::vector<std::int32_t>(n)}};
    std::iota(ref.pos[0].begin(), ref.pos[0].end(), 0);
    ref.evict(1, num_coming);
    REQUIRE(keep.row(0) == ref.pos[0]);
    REQUIRE(st.length == static_cast<std::int64_t>(ref.pos[0].size()));
    for (std::int64_t r = 0; r < st.length; ++r) REQUIRE(s[r] == buf[keep.row(0)[r]]);
    return keep.row(0);
  };
  // original: candidates [0, n - recent + c), recent [n - recent + c, n), length hh + recent - c
  REQUIRE(run(5, 10, 3).size() == 12);
  REQUIRE(run(5, 10, 0).size() == 15);
  const auto k = run(5, 10, 4);
  REQUIRE(std::vector<std::int32_t>(k.end() - 6, k.end()) == std::vector<std::int32_t>{24, 25, 26, 27, 28, 29});
  // num_coming > recent: no recent part, hh + recent - num_coming heavy slots
  REQUIRE(run(5, 3, 6).size() == 2);
  REQUIRE(run(5, 10, 15).empty());
  REQUIRE(run(5, 10, 2).size() == 13);
  // nothing to do when n + num_coming fits
  REQUIRE(run(20, 20, 10).size() == 30);
  REQUIRE(H2O(H2OParams::original(20, 20)).kept_count(30, 11) == 29);
}

TEST_CASE("h2o: one-slot eviction uses the library's total order (ties, signed zeros, infinities)", "[h2o][order]") {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<std::vector<float>> rows = {
      {3, 1, 2, 1, 5, 1, 9},             // ties: the earliest 1 goes
      {0.0f, -0.0f, 1, -0.0f, 2, 2, 2},  // -0 ranks below +0: the first -0 goes
      {inf, inf, inf, inf, inf, inf, inf},
      {-inf, 4, -inf, 4, 4, 4, 4},
      {5, 4, 3, 2, 1, 0.5f, 0.25f},  // the minimum sits in the recent window: not a candidate
  };
  std::vector<float> big(700);  // spans several 256-slot blocks of the min pass
  for (std::size_t j = 0; j < big.size(); ++j) big[j] = 1.0f + static_cast<float>((j * 37) % 101);
  big[300] = 0.5f, big[555] = 0.5f;
  auto all = rows;
  all.push_back(big);
  std::vector<float> zeros(700, 0.0f);  // the zero minimum: the first -0 wins over earlier +0s, across blocks
  zeros[600] = -0.0f;
  all.push_back(zeros);
  zeros[600] = 0.0f;
  all.push_back(zeros);
  for (std::size_t j = 0; j < zeros.size(); ++j) zeros[j] = j == 300 || j == 500 ? 0.0f : 1.0f;
  all.push_back(zeros);
  for (const auto& row : all) {
    const auto n = static_cast<std::int64_t>(row.size());
    const H2O policy(H2OParams::original(n - 3, 2));  // keep n - 1: the single-victim path
    std::vector<float> s = row;
    H2OState st{TensorView<float, 2>::contiguous(s.data(), {1, n}), n};
    const auto keep = evict_for_space<backend::Scalar>(policy, st);
    // reference: top-(n-3) of the candidates under score_order_key (ties -> higher index)
    std::vector<std::int64_t> cand(static_cast<std::size_t>(n - 2));
    std::iota(cand.begin(), cand.end(), 0);
    std::stable_sort(cand.begin(), cand.end(), [&](auto a, auto b) {
      const auto ka = score_order_key(row[a]), kb = score_order_key(row[b]);
      return ka > kb || (ka == kb && a > b);
    });
    std::vector<std::int32_t> expect(cand.begin(), cand.end() - 1);
    std::sort(expect.begin(), expect.end());
    expect.push_back(static_cast<std::int32_t>(n - 2));
    expect.push_back(static_cast<std::int32_t>(n - 1));
    REQUIRE(keep.row(0) == expect);
    // the topk path (two victims at once via evict_for_space) agrees on the shared prefix rule
    for (std::int64_t r = 0; r < st.length; ++r) REQUIRE(std::memcmp(&s[r], &row[expect[r]], sizeof(float)) == 0);
  }
}

TEST_CASE("h2o: bad input gets a clear message and modifies nothing", "[h2o][errors]") {
  const std::int64_t Hq = 8, Hkv = 2, cap = 40, d = 16;
  std::vector<float> state(Hkv * cap);
  for (std::size_t i = 0; i < state.size(); ++i) state[i] = 0.01f * static_cast<float>(i);
  const auto state0 = state;
  H2OState st{TensorView<float, 2>::contiguous(state.data(), {Hkv, cap}), 30};
  const H2O policy(H2OParams::original(10, 10));
  std::vector<float> probs(Hq * 3 * 33, 0.01f);
  const Context<backend::Scalar> cx0{};  // the probabilities paths need no workspace
#define expect_update_error(expr, needle)         \
  do {                                            \
    const Status s_ = (expr);                     \
    INFO(#expr << " -> " << s_.message());        \
    REQUIRE(!s_.is_ok());                         \
    REQUIRE_THAT(s_.message(), Contains(needle)); \
    REQUIRE(state == state0);                     \
    REQUIRE(st.length == 30);                     \
  } while (0)
  // state view of the wrong length: the call covers 33 keys with 1 query, but the state tracks 30 slots
  expect_update_error(policy.update(cx0, st, probs_input(TensorView<const float, 3>::contiguous(probs.data(), {Hq, 1, 33}))),
                      "probabilities cover kv_len=33, expected state length 30 + 1 new = 31");
  expect_update_error(policy.update(cx0, st, column_sums_input(TensorView<const float, 2>::contiguous(probs.data(), {Hq, 20}))),
                      "column sums cover kv_len=20, fewer than the state's 30 slots");
  H2OState small{TensorView<float, 2>::contiguous(state.data(), {Hkv, 32}), 30};
  expect_update_error(policy.update(cx0, small, probs_input(TensorView<const float, 3>::contiguous(probs.data(), {Hq, 3, 33}))),
                      "state capacity 32 is smaller than kv_len 33");
  // mismatched head counts
  expect_update_error(policy.update(cx0, st, probs_input(TensorView<const float, 3>::contiguous(probs.data(), {7, 3, 33}))),
                      "probabilities has 7 query heads, not a multiple of the state's 2 kv heads");
  H2OParams qh = H2OParams::original(10, 10);
  qh.granularity = H2OGranularity::kQueryHead;
  expect_update_error(H2O(qh).update(cx0, st, probs_input(TensorView<const float, 3>::contiguous(probs.data(), {Hq, 3, 33}))),
                      "probabilities has 8 query heads, the per-query-head state has 2 rows");
  // probabilities with a wrong shape
  expect_update_error(policy.update(cx0, st, probs_input(TensorView<const float, 3>::contiguous(probs.data(), {Hq, 0, 30}))),
                      "has 0 query rows");
  expect_update_error(policy.update(cx0, st, probs_input(TensorView<const float, 3>(probs.data(), {Hq, 3, 33}, {99, 33 * Hq, Hq}))),
                      "kv stride 8, must be 1");
  expect_update_error(policy.update(cx0, st, probs_input(TensorView<const float, 3>(nullptr, {Hq, 3, 33}, {99, 33, 1}))),
                      "probabilities has null data");
  H2OState bad_len{TensorView<float, 2>::contiguous(state.data(), {Hkv, cap}), cap + 1};
  expect_update_error(policy.update(cx0, bad_len, probs_input(TensorView<const float, 3>::contiguous(probs.data(), {Hq, 1, 41}))),
                      "state length 41 out of range [0, capacity=40]");
  H2OState strided{TensorView<float, 2>(state.data(), {Hkv, cap}, {1, Hkv}), 30};
  expect_update_error(policy.update(cx0, strided, probs_input(TensorView<const float, 3>::contiguous(probs.data(), {Hq, 3, 33}))),
                      "slot stride 2, must be 1");
  H2OParams bad = H2OParams::original(10, 10);
  bad.group_reduce = GroupReduce::kMax;
  expect_update_error(H2O(bad).update(cx0, st, probs_input(TensorView<const float, 3>::contiguous(probs.data(), {Hq, 3, 33}))),
                      "kMax is not additive");
  expect_update_error(
      H2O(H2OParams::original(-1, 10)).update(cx0, st, probs_input(TensorView<const float, 3>::contiguous(probs.data(), {Hq, 3, 33}))),
      "token budget is -1, must be a non-negative integer");
  // update from queries and keys: queries / keys / state head counts
  RandomCase<float> rc(Hq, Hkv, 33, d, 3, 1);
  auto ws = h2o_workspace<backend::Cpu>(policy, ProblemShape{Hq, Hkv, d, 33, 3});
  const Context<backend::Cpu> w{Workspace{ws.data(), ws.size()}};
  auto in = rc.input();
  auto q6 = in;
  q6.queries = TensorView<const float, 3>(rc.queries.data(), {5, 3, d}, {3 * d, d, 1});
  expect_update_error(policy.update(w, st, q6), "queries has 5 heads, not a multiple of the 2 kv heads");
  RandomCase<float> rc4(Hq, 4, 33, d, 3, 1);
  expect_update_error(policy.update(w, st, rc4.input()), "keys has 4 kv heads, the state has 2 rows");
  RandomCase<float> longer(Hq, Hkv, 35, d, 3, 1);
  expect_update_error(policy.update(w, st, longer.input()), "keys cover kv_len=35, expected state length 30 + 3 new = 33");
  expect_update_error(policy.update(Context<backend::Cpu>{Workspace{ws.data(), 64}}, st, in), "workspace has 64 bytes");

  // evict: NaN in the state (both the one-victim and the top-k path), bad num_coming, small outputs
  st.length = 21;  // 21 > 20: one victim
  for (std::int64_t nan_slot : {3, 20}) {
    for (std::int64_t len : {21, 30}) {
      state = state0;
      state[cap + nan_slot] = std::numeric_limits<float>::quiet_NaN();
      const auto with_nan = state;
      st.length = len;
      KeepSetBuffer keep(Hkv, Hkv * 20);
      keep.fill_sentinel();
      auto ews = h2o_workspace<backend::Cpu>(policy, ProblemShape{Hq, Hkv, 0, len, 0});
      const Status s = policy.evict(Context<backend::Cpu>{Workspace{ews.data(), ews.size()}}, st, keep.view());
      INFO(s.message());
      REQUIRE_THAT(s.message(), Contains("state head 1 slot " + std::to_string(nan_slot) + " is NaN"));
      REQUIRE(keep.untouched());
      REQUIRE(std::memcmp(state.data(), with_nan.data(), state.size() * sizeof(float)) == 0);
      REQUIRE(st.length == len);
    }
  }
  state = state0;
  st.length = 30;
  auto ews = h2o_workspace<backend::Cpu>(policy, ProblemShape{Hq, Hkv, 0, 30, 0});
  const Context<backend::Cpu> ecx{Workspace{ews.data(), ews.size()}};
  KeepSetBuffer keep(Hkv, Hkv * 20);
  keep.fill_sentinel();
  REQUIRE_THAT(policy.evict_for_space(ecx, st, 21, keep.view()).message(),
               Contains("num_coming 21 out of range [0, hh_size + recent_size = 20]"));
  KeepSetBuffer small_keep(Hkv, 39);
  small_keep.fill_sentinel();
  REQUIRE(policy.evict(ecx, st, small_keep.view()).code() == StatusCode::kOutputTooSmall);
  KeepSetBuffer wrong_rows(3, 60);
  wrong_rows.fill_sentinel();
  REQUIRE_THAT(policy.evict(ecx, st, wrong_rows.view()).message(), Contains("keep set has 3 rows"));
  REQUIRE_THAT(policy.evict(ecx.with_workspace(Workspace{ews.data(), 8}), st, keep.view()).message(), Contains("workspace has 8 bytes"));
  REQUIRE(keep.untouched());
  REQUIRE(small_keep.untouched());
  REQUIRE(wrong_rows.untouched());
  REQUIRE(state == state0);
  REQUIRE(st.length == 30);
}

TEST_CASE("h2o: reset starts a new sequence - ratios of the prompt length", "[h2o]") {
  // §6.2: hh = int(heavy_ratio * prompt_len), recent = int(recent_ratio * prompt_len).
  const H2O ratios(H2OParams::from_prompt_ratios(0.1, 0.1));
  REQUIRE(ratios.heavy_size(1005) == 100);
  REQUIRE(ratios.recent_size(1005) == 100);
  REQUIRE(ratios.cache_size(1005) == 200);
  REQUIRE(ratios.kept_count(1005) == 200);
  REQUIRE(ratios.kept_count(300, 0, 1005) == 200);  // decode: still the prompt's budget
  std::vector<float> s(2 * 8, 5.0f);
  H2OState st{TensorView<float, 2>::contiguous(s.data(), {2, 8}), 6, 6};
  st.reset();
  REQUIRE(st.length == 0);
  REQUIRE(st.prompt_len == 0);
  std::vector<float> probs(4 * 3 * 3, 0.25f);
  REQUIRE(H2O(H2OParams::original(2, 2))
              .update(Context<backend::Scalar>{}, st, probs_input(TensorView<const float, 3>::contiguous(probs.data(), {4, 3, 3})))
              .is_ok());
  REQUIRE(st.length == 3);
  REQUIRE(st.prompt_len == 3);
  REQUIRE(s[0] == 1.5f);  // 2 heads x 3 rows x 0.25, no stale score
}

TEST_CASE("h2o: ratio budgets resolve once against the prompt and hold through decode", "[h2o]") {
  // Prompt of 20 tokens, ratios 0.25 / 0.25: the cache holds 5 heavy + 5 recent for the whole sequence.
  const H2O policy(H2OParams::from_prompt_ratios(0.25, 0.25));
  const std::int64_t H = 1, cap = 24;
  std::vector<float> state(H * cap, 0.0f);
  H2OState st{TensorView<float, 2>::contiguous(state.data(), {H, cap}), 0};
  std::vector<float> col(H * 20, 0.0f);
  for (int j = 0; j < 20; ++j) col[j] = static_cast<float>((j * 7) % 11);  // the prompt's column sums
  const Context<backend::Scalar> cx{};
  const auto sums = [](const std::vector<float>& v, std::int64_t n) {
    ScoreInput<float, float> in;
    in.column_sums = TensorView<const float, 2>::contiguous(v.data(), {1, n});
    return in;
  };
  REQUIRE(policy.update(cx, st, sums(col, 20)).is_ok());
  REQUIRE(st.prompt_len == 20);
  KeepSetBuffer keep(H, 10);
  auto ws = h2o_workspace<backend::Scalar>(policy, ProblemShape{H, H, 0, 20, 0});
  REQUIRE(policy.evict(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}}, st, keep.view()).is_ok());
  REQUIRE(st.length == 10);
  // Heavy part: the 5 best of slots [0, 15), equal scores to the later slot: 10 (j=3, 14), 9 (j=6), 8 (j=9), 7 (j=12 over j=1).
  REQUIRE(keep.row(0) == std::vector<std::int32_t>{3, 6, 9, 12, 14, 15, 16, 17, 18, 19});
  // A decode step: 11 slots, the budget stays 10 (int(0.25 * 20) * 2), not int(0.25 * 11) * 2.
  std::vector<float> step(H * 11, 1.0f);
  REQUIRE(policy.update(cx, st, probs_input(TensorView<const float, 3>::contiguous(step.data(), {H, 1, 11}))).is_ok());  // 10 + 1 new
  REQUIRE(st.prompt_len == 20);
  KeepSetBuffer keep2(H, 10);
  REQUIRE(policy.evict(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}}, st, keep2.view()).is_ok());
  REQUIRE(st.length == 10);
  // NaN ratio: a clear error, nothing written (defect #16.10).
  const H2O nan_ratio(H2OParams::from_prompt_ratios(std::numeric_limits<double>::quiet_NaN(), 0.1));
  REQUIRE_THAT(nan_ratio.validate_params().message(), Contains("h2o: heavy") && Contains("keep_ratio is nan, must be finite"));
  REQUIRE(nan_ratio.kept_count(100) == -1);
  // hh_size + recent_size beyond int32 (it used to overflow int64 and validate): rejected.
  REQUIRE_THAT(H2O(H2OParams::original(INT64_C(4) << 40, INT64_C(4) << 40)).validate_params().message(),
               Contains("exceeds the int32 token id range"));
}
