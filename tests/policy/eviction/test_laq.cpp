// LAQ stage 2, lookahead queries in the query-window scorers, and the
// pseudo-token decode loop (policy/eviction/laq.hpp, policy/lookahead.hpp).
// The stage-2 selection is checked against an independent float64 mirror of
// the reference repository's `update_kv_LAQ` (and of the corrected mask); the
// fixtures of tests/reference add the cross-check against a re-implementation
// of the reference scoring generated outside C++.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/eviction/adakv.hpp"
#include "kvpolicy/policy/eviction/expected_attention.hpp"
#include "kvpolicy/policy/eviction/h2o.hpp"
#include "kvpolicy/policy/eviction/laq.hpp"
#include "kvpolicy/policy/eviction/observed_attention.hpp"
#include "kvpolicy/policy/eviction/pyramidkv.hpp"
#include "kvpolicy/policy/eviction/tova.hpp"
#include "kvpolicy/util/thread_pool.hpp"
#include "policy/policy_test_util.hpp"

using namespace kvpolicy;
using Catch::Matchers::Contains;

STATIC_ASSERT_POLICY(LAQ);

namespace {

/// Prompt of T tokens (keys) plus `rows` observation queries (Hq, rows, d):
/// W2 prompt queries then n pseudo queries.
struct LaqCase {
  std::int64_t Hq, Hkv, T, d, rows, n;
  std::vector<float> q, k;
  LaqCase(std::int64_t hq, std::int64_t hkv, std::int64_t t, std::int64_t dd, std::int64_t w2, std::int64_t nn, unsigned seed)
      : Hq(hq), Hkv(hkv), T(t), d(dd), rows(w2 + nn), n(nn), q(hq * (w2 + nn) * dd), k(hkv * t * dd) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    for (auto& x : q) x = nd(rng);
    for (auto& x : k) x = nd(rng) * 0.6f;
  }
  ScoreInput<float, float> input() const {
    ScoreInput<float, float> in{TensorView<const float, 3>::contiguous(q.data(), {Hq, rows, d}),
                                KVSource<float>::from(TensorView<const float, 3>::contiguous(k.data(), {Hkv, T, d}))};
    in.lookahead = n;
    return in;
  }
};

/// float64 mirror of stage 2: per kv head, the kept ids (ascending). Row i of
/// the observation sees key j iff j <= pos0 + i, pos0 = T - rows (the
/// reference's mask on the last rows x rows block) or T - W2 (corrected).
std::vector<std::vector<std::int32_t>> mirror_stage2(const LaqCase& c, std::int64_t W2, std::int64_t C, LookaheadMask mask, int K = 7) {
  const std::int64_t G = c.Hq / c.Hkv, T = c.T, L = T - W2, A = c.rows;
  const std::int64_t pos0 = mask == LookaheadMask::kReference ? T - A : T - W2;
  std::vector<std::vector<std::int32_t>> out;
  for (std::int64_t g = 0; g < c.Hkv; ++g) {
    std::vector<std::int32_t> keep;
    if (T <= C) {
      keep.resize(static_cast<std::size_t>(T));
      std::iota(keep.begin(), keep.end(), 0);
      out.push_back(keep);
      continue;
    }
    std::vector<double> s(static_cast<std::size_t>(L), 0.0);
    for (std::int64_t hq = g * G; hq < (g + 1) * G; ++hq) {
      for (std::int64_t i = 0; i < A; ++i) {
        const std::int64_t vis = std::min(T, pos0 + i + 1);
        std::vector<double> z(static_cast<std::size_t>(vis));
        double mx = -INFINITY;
        for (std::int64_t j = 0; j < vis; ++j) {
          double acc = 0;
          for (std::int64_t e = 0; e < c.d; ++e) acc += double(c.q[(hq * A + i) * c.d + e]) * double(c.k[(g * T + j) * c.d + e]);
          z[j] = acc / std::sqrt(double(c.d));
          mx = std::max(mx, z[j]);
        }
        double den = 0;
        for (auto& v : z) den += (v = std::exp(v - mx));
        for (std::int64_t j = 0; j < std::min(vis, L); ++j) s[j] += z[j] / den / double(G);  // group mean of the sums
      }
    }
    std::vector<double> p(static_cast<std::size_t>(L));
    for (std::int64_t j = 0; j < L; ++j) {
      double m = -INFINITY;
      for (std::int64_t u = std::max<std::int64_t>(0, j - K / 2); u <= std::min(L - 1, j + K / 2); ++u) m = std::max(m, s[u]);
      p[j] = m;
    }
    std::vector<std::int32_t> order(static_cast<std::size_t>(L));
    std::iota(order.begin(), order.end(), 0);
    // Pooled maxima tie on plateaus: the library's rule, higher score then the more recent token.
    std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
      const float fa = static_cast<float>(p[a]), fb = static_cast<float>(p[b]);
      return fa != fb ? fa > fb : a > b;
    });
    keep.assign(order.begin(), order.begin() + (C - W2));
    for (std::int64_t j = L; j < T; ++j) keep.push_back(static_cast<std::int32_t>(j));
    std::sort(keep.begin(), keep.end());
    out.push_back(keep);
  }
  return out;
}

/// Kept sets agree up to float32 rounding at the boundary: every difference
/// must be a near-tie of the mirror's pooled score (checked by the count).
void require_same_sets(const KeepSetBuffer& got, const std::vector<std::vector<std::int32_t>>& want) {
  for (std::size_t h = 0; h < want.size(); ++h) {
    const auto row = got.row(static_cast<std::int64_t>(h));
    std::vector<std::int32_t> diff;
    std::set_symmetric_difference(row.begin(), row.end(), want[h].begin(), want[h].end(), std::back_inserter(diff));
    INFO("head " << h << ": " << diff.size() << " ids differ");
    REQUIRE(row.size() == want[h].size());
    REQUIRE(diff.size() <= 2);  // at most one boundary swap from fp32 vs fp64 pooled sums
  }
}

}  // namespace

TEST_CASE("laq: stage 2 equals the float64 mirror of the reference (LAQ, LAQ++, both masks, GQA, early EOS)", "[laq]") {
  for (auto mask : {LookaheadMask::kReference, LookaheadMask::kCorrected}) {
    for (std::int64_t W2 : {0, 8}) {
      for (std::int64_t n : {8, 3}) {
        for (std::int64_t G : {1, 4}) {
          const LaqCase c(2 * G, 2, 300, 32, W2, n, static_cast<unsigned>(W2 * 100 + n * 10 + G + (mask == LookaheadMask::kReference)));
          LAQParams p = W2 == 0 ? LAQParams::laq(64) : LAQParams::laq_plus_plus(64);
          p.mask = mask;
          const LAQ laq(p);
          const auto want = mirror_stage2(c, W2, 64, mask);
          const auto got = run_evict<backend::Scalar>(laq, c.input());
          require_same_sets(got, want);
          REQUIRE(run_evict<backend::Cpu>(laq, c.input()) == got);
          ThreadPool pool(2);
          REQUIRE(run_evict<backend::Cpu>(laq, c.input(), pool.context()) == got);
          for (std::int64_t h = 0; h < 2; ++h) {
            const auto row = got.row(h);
            for (std::int64_t j = 300 - W2; j < 300; ++j) REQUIRE(std::binary_search(row.begin(), row.end(), static_cast<std::int32_t>(j)));
          }
        }
      }
    }
  }
}

TEST_CASE("laq: the reference and corrected masks differ exactly where the reference hides keys", "[laq]") {
  // With W2 = 0 the reference mask hides the last n-1-i prompt keys from pseudo query i: a key only the last
  // pseudo query's predecessors would see is scored differently. Scores on keys < T - n agree up to the softmax
  // normalisation, so the score maps differ, and on the hidden block the reference scores are smaller.
  const LaqCase c(2, 2, 120, 16, 0, 8, 77);
  LAQParams p = LAQParams::laq(32);
  std::vector<float> ref(2 * 120), cor(2 * 120);
  for (auto [mask, out] : {std::pair{LookaheadMask::kReference, &ref}, std::pair{LookaheadMask::kCorrected, &cor}}) {
    p.mask = mask;
    const LAQ laq(p);
    const Requirements r = laq.requirements(Context<backend::Scalar>{}, ProblemShape{2, 2, 16, 120, 8});
    REQUIRE(r.status.is_ok());
    REQUIRE(r.query_window == 32);
    std::vector<std::byte> ws(r.workspace_bytes);
    REQUIRE(laq.score(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}}, c.input(),
                      TensorView<float, 2>::contiguous(out->data(), {2, 120}))
                .is_ok());
  }
  REQUIRE(ref != cor);
  // The last prompt key is visible only to the last pseudo query under the reference mask: its unpooled sum is one
  // softmax term there, eight under the corrected mask. Pooling (max over 7) keeps the comparison one-sided.
  for (int h = 0; h < 2; ++h) REQUIRE(ref[h * 120 + 119] <= cor[h * 120 + 119] + 1e-6f);
}

TEST_CASE("laq: prompts within the budget are kept whole, even shorter than the observation rows", "[laq]") {
  const LaqCase c(2, 2, 6, 16, 0, 8, 3);  // T = 6 < 8 pseudo rows: the reference mask cannot place them, nothing is scored
  const LAQ laq(LAQParams::laq(64));
  const auto keep = run_evict<backend::Scalar>(laq, c.input());
  for (int h = 0; h < 2; ++h) REQUIRE(keep.row(h) == std::vector<std::int32_t>{0, 1, 2, 3, 4, 5});
  REQUIRE(laq.kept_count(64) == 64);
  REQUIRE(laq.kept_count(1000) == 64);
  REQUIRE(laq.protected_tokens(1000) == 0);
  REQUIRE(LAQ(LAQParams::laq_plus_plus(64)).protected_tokens(1000) == 8);
}

TEST_CASE("laq: stage parameters follow the reference defaults", "[laq]") {
  const LAQ laq(LAQParams::laq_plus_plus(128));
  const SnapKVParams s1 = laq.stage1(), s2 = laq.stage2();
  REQUIRE(s1.window == 32);
  REQUIRE(s1.kernel == 7);
  REQUIRE(s1.pooling == Pooling::kMax);
  REQUIRE(s1.window_reduce == WindowReduce::kSum);
  REQUIRE(SnapKV(s1).kept_count(1000) == 128);
  REQUIRE(s2.window == 8);
  REQUIRE(s2.lookahead_mask == LookaheadMask::kReference);
  REQUIRE(laq.decode_params(257).max_tokens == 8);
  REQUIRE(laq.decode_params(257).eos_id == 257);
}

TEST_CASE("laq: bad input gets a clear message and writes nothing", "[laq][errors]") {
  const LaqCase c(4, 2, 100, 16, 8, 8, 5);
  auto expect_error = [&](const LAQ& p, ScoreInput<float, float> in, const char* needle) {
    KeepSetBuffer keep(2, 200);
    keep.fill_sentinel();
    const Requirements req = LAQ(LAQParams::laq_plus_plus(40)).requirements(Context<backend::Cpu>{}, ProblemShape{4, 2, 16, 100, 16});
    REQUIRE(req.status.is_ok());
    std::vector<std::byte> ws(req.workspace_bytes);
    const Status s = p.evict(Context<backend::Cpu>{Workspace{ws.data(), ws.size()}}, in, keep.view());
    INFO(s.message());
    REQUIRE(!s.is_ok());
    REQUIRE_THAT(s.message(), Contains(needle));
    REQUIRE(keep.untouched());
  };
  const LAQ good(LAQParams::laq_plus_plus(40));
  auto in = c.input();
  auto bad = in;
  bad.lookahead = 0;
  expect_error(good, bad, "lookahead is 0 pseudo queries, must be in [1, lookahead = 8]");
  bad.lookahead = -2;
  expect_error(good, bad, "must be in [1, lookahead = 8]");
  LAQParams few = LAQParams::laq_plus_plus(40);
  few.lookahead = 4;
  expect_error(LAQ(few), in, "lookahead is 8 pseudo queries, must be in [1, lookahead = 4]");
  expect_error(LAQ(LAQParams::laq_plus_plus(5)), in, "token budget 5 is smaller than the window W2 = 8");
  LAQParams ratio = LAQParams::laq_plus_plus(40);
  ratio.budget = Budget::keep_ratio(0.05);
  expect_error(LAQ(ratio), in, "the budget keeps 5 of 100 tokens, fewer than the window W2 = 8");
  LAQParams wide = LAQParams::laq_plus_plus(40);
  wide.window = 40;
  expect_error(LAQ(wide), in, "window (W2) 40 is larger than stage1_window 32");
  LAQParams zero = LAQParams::laq(40);
  zero.lookahead = 0;
  expect_error(LAQ(zero), in, "lookahead is 0, must be >= 1 pseudo token");
  LAQParams kern = LAQParams::laq_plus_plus(40);
  kern.kernel = 6;
  expect_error(LAQ(kern), in, "pooling kernel is 6, must be odd");
  bad = in;
  bad.lookahead = 4;  // rows = 16 != W2 + 4
  expect_error(good, bad, "expected window=8 + lookahead=4");
  const LaqCase tiny(4, 2, 12, 16, 8, 8, 6);  // 16 rows on a 12-token prompt that must be scored
  expect_error(LAQ(LAQParams::laq_plus_plus(10)), tiny.input(), "the reference lookahead mask places 16 query rows");
}

TEST_CASE("lookahead queries: SnapKV reduces over prompt and lookahead rows, Ada-KV and PyramidKV pass them on", "[laq][lookahead]") {
  // SnapKV (window w, lookahead n) with the corrected mask equals the LAQ stage-2 mirror with W2 = w under
  // SnapKV's parameters: sum over w + n rows, max pool 7, group mean before pooling.
  const LaqCase c(4, 2, 200, 16, 8, 5, 21);
  SnapKVParams sp = SnapKVParams::original(48, 8, 7, Pooling::kMax);
  const SnapKV snap(sp);
  require_same_sets(run_evict<backend::Scalar>(snap, c.input()), mirror_stage2(c, 8, 48, LookaheadMask::kCorrected));
  REQUIRE(run_evict<backend::Cpu>(snap, c.input()) == run_evict<backend::Scalar>(snap, c.input()));
  // The lookahead rows change the decision relative to treating them as prompt rows of a wider window.
  SnapKVParams wide = sp;
  wide.window = 13;
  auto as_prompt = c.input();
  as_prompt.lookahead = 0;
  REQUIRE(!(run_evict<backend::Scalar>(SnapKV(wide), as_prompt) == run_evict<backend::Scalar>(snap, c.input())));

  // PyramidKV and Ada-KV score through SnapKV: the lookahead rows reach their scores.
  PyramidKVParams pp;
  pp.scoring = sp;
  pp.schedule = LayerSchedule::uniform(Budget::tokens(48).clamp_to_length(), 1);
  const PyramidKV pyr(pp);
  std::vector<float> s_snap(2 * 200), s_pyr(2 * 200);
  const Requirements r = snap.requirements(Context<backend::Scalar>{}, ProblemShape{4, 2, 16, 200, 13});
  REQUIRE(r.status.is_ok());
  std::vector<std::byte> ws(r.workspace_bytes);
  const Context<backend::Scalar> cx{Workspace{ws.data(), ws.size()}};
  REQUIRE(snap.score(cx, c.input(), TensorView<float, 2>::contiguous(s_snap.data(), {2, 200})).is_ok());
  const Requirements rp = pyr.requirements(Context<backend::Scalar>{}, ProblemShape{4, 2, 16, 200, 13});
  REQUIRE(rp.status.is_ok());
  std::vector<std::byte> wsp(rp.workspace_bytes);
  REQUIRE(pyr.score(Context<backend::Scalar>{Workspace{wsp.data(), wsp.size()}}, c.input(),
                    TensorView<float, 2>::contiguous(s_pyr.data(), {2, 200}))
              .is_ok());
  REQUIRE(s_pyr == s_snap);
  AdaKVParams ap;
  ap.budget = Budget::tokens(48);
  const AdaKV<SnapKV> ada(ap, snap);
  const auto ada_keep = run_evict<backend::Scalar>(ada, c.input());
  REQUIRE(run_evict<backend::Cpu>(ada, c.input()) == ada_keep);
  auto no_la = c.input();
  no_la.lookahead = 0;
  no_la.queries = no_la.queries.narrow(1, 0, 8);
  REQUIRE(!(run_evict<backend::Scalar>(ada, no_la) == ada_keep));
}

TEST_CASE("lookahead queries: Expected Attention takes them as samples, online and column-sum scorers reject them", "[laq][lookahead]") {
  RandomCase<float> rc(4, 2, 64, 16, 64, 4);
  auto in = rc.input();
  // EA: lookahead rows are further samples, the same as treating them as prompt rows.
  std::vector<float> v(rc.keys.size());
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (auto& x : v) x = nd(rng);
  ExpectedAttentionInput<float, float> ea{in};
  ea.values = KVSource<float>::from(TensorView<const float, 3>::contiguous(v.data(), {2, 64, 16}));
  const ExpectedAttention policy(ExpectedAttentionParams{});
  auto run_ea = [&](const ExpectedAttentionInput<float, float>& x) {
    const Requirements r = policy.requirements(Context<backend::Scalar>{}, ProblemShape{4, 2, 16, 64, 64});
    REQUIRE(r.status.is_ok());
    std::vector<std::byte> ws(r.workspace_bytes);
    std::vector<float> s(2 * 64);
    const Status st =
        policy.score(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}}, x, TensorView<float, 2>::contiguous(s.data(), {2, 64}));
    INFO(st.message());
    REQUIRE(st.is_ok());
    return s;
  };
  const auto base = run_ea(ea);
  ea.lookahead = 8;
  REQUIRE(run_ea(ea) == base);
  ea.lookahead = 63;  // more than q_len - n_sink
  {
    const Requirements r = policy.requirements(Context<backend::Scalar>{}, ProblemShape{4, 2, 16, 64, 64});
    std::vector<std::byte> ws(r.workspace_bytes);
    std::vector<float> s(2 * 64);
    const Status st =
        policy.score(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}}, ea, TensorView<float, 2>::contiguous(s.data(), {2, 64}));
    REQUIRE_THAT(st.message(), Contains("expected_attention: lookahead is 63"));
  }
  auto la = in;
  la.lookahead = 2;
  KeepSetBuffer keep(2, 128);
  keep.fill_sentinel();
  std::vector<std::byte> ws(1 << 20);
  const Context<backend::Scalar> cx{Workspace{ws.data(), ws.size()}};
  TOVAParams tp;
  tp.budget = Budget::tokens(16);
  REQUIRE_THAT(TOVA(tp).evict(cx, la, keep.view()).message(), Contains("tova: lookahead is 2"));
  la.queries = TensorView<const float, 3>::contiguous(rc.queries.data(), {4, 64, 16});
  ObservedAttentionParams op;
  REQUIRE_THAT(ObservedAttention(op).evict(cx, la, keep.view()).message(), Contains("observed_attention: lookahead is 2"));
  REQUIRE(keep.untouched());
  std::vector<float> hs(2 * 64, 0.0f);
  H2OState st{TensorView<float, 2>::contiguous(hs.data(), {2, 64}), 0};
  REQUIRE_THAT(H2O(H2OParams{}).update(cx, st, la).message(), Contains("h2o: lookahead is 2"));
  REQUIRE(std::all_of(hs.begin(), hs.end(), [](float x) { return x == 0.0f; }));
}

// ---- the pseudo-token decode loop -------------------------------------------

namespace {

/// A fake engine: 2 layers, 3 heads, head_dim 4, vocab 10. Token t at position p
/// gets queries q[l][h][j] = t + 10 p + 100 l + 1000 h + j and logits peaking
/// at `next[t]`.
struct FakeEngine {
  std::vector<std::int32_t> next = {1, 2, 3, 4, 5, 6, 7, 8, 9, 0};
  std::vector<float> q = std::vector<float>(2 * 3 * 4), logits = std::vector<float>(10);
  std::vector<std::pair<std::int32_t, std::int64_t>> calls;
  int fail_at = -1, throw_at = -1, bad_shape_at = -1, nan_at = -1;
  Status step(std::int32_t t, std::int64_t p, LookaheadStep& out) {
    const int i = static_cast<int>(calls.size());
    calls.emplace_back(t, p);
    if (i == fail_at) return KVP_INVALID("fake engine: out of cache");
    if (i == throw_at) throw std::runtime_error("fake engine exploded");
    for (int l = 0; l < 2; ++l)
      for (int h = 0; h < 3; ++h)
        for (int j = 0; j < 4; ++j) q[(l * 3 + h) * 4 + j] = static_cast<float>(t + 10 * p + 100 * l + 1000 * h + j);
    if (i == nan_at) q[5] = std::numeric_limits<float>::quiet_NaN();
    std::fill(logits.begin(), logits.end(), 0.0f);
    logits[static_cast<std::size_t>(next[static_cast<std::size_t>(t)])] = 1.0f;
    out.queries = TensorView<const float, 3>::contiguous(q.data(), {2, i == bad_shape_at ? 2 : 3, 4});
    out.logits = logits;
    return Status::ok();
  }
};

struct DecodeRun {
  Status status;
  std::int64_t n = -1;
  std::vector<float> out = std::vector<float>(6 * 8 * 4, -7.0f);
  std::vector<std::int32_t> tokens = std::vector<std::int32_t>(8, -7);
};

DecodeRun decode(FakeEngine& e, LookaheadParams p, std::int32_t first = 3, std::int64_t pos = 50, std::size_t ws_bytes = SIZE_MAX) {
  const LookaheadDecoder dec(p);
  const LookaheadShape shape{2, 3, 4, 10};
  const Requirements r = dec.requirements(shape);
  REQUIRE(r.status.is_ok());
  REQUIRE(r.output.rows == 6);
  std::vector<std::byte> ws(ws_bytes == SIZE_MAX ? r.workspace_bytes : ws_bytes);
  DecodeRun run;
  run.status = dec.run(
      Workspace{ws.data(), ws.size()}, shape, first, pos,
      [&e](std::int32_t t, std::int64_t q, LookaheadStep& o) { return e.step(t, q, o); },
      TensorView<float, 3>::contiguous(run.out.data(), {6, 8, 4}), run.tokens, &run.n);
  return run;
}

}  // namespace

TEST_CASE("lookahead decoder: greedy loop, positions, EOS and the queries it records", "[laq][lookahead]") {
  FakeEngine e;
  DecodeRun r = decode(e, LookaheadParams{8, -1});
  REQUIRE(r.status.is_ok());
  REQUIRE(r.n == 8);
  REQUIRE(r.tokens == std::vector<std::int32_t>{3, 4, 5, 6, 7, 8, 9, 0});
  REQUIRE(e.calls.size() == 8);
  for (int i = 0; i < 8; ++i) REQUIRE(e.calls[i].second == 50 + i);
  // row l*3+h, pseudo token i, channel j
  for (int l = 0; l < 2; ++l)
    for (int h = 0; h < 3; ++h)
      for (int i = 0; i < 8; ++i)
        for (int j = 0; j < 4; ++j)
          REQUIRE(r.out[((l * 3 + h) * 8 + i) * 4 + j] == static_cast<float>(r.tokens[i] + 10 * (50 + i) + 100 * l + 1000 * h + j));

  // EOS = 6: tokens 3, 4, 5 are fed; the forward of 5 predicts 6, which stops the loop unfed.
  FakeEngine e2;
  r = decode(e2, LookaheadParams{8, 6});
  REQUIRE(r.status.is_ok());
  REQUIRE(r.n == 3);
  REQUIRE(std::vector<std::int32_t>(r.tokens.begin(), r.tokens.begin() + 3) == std::vector<std::int32_t>{3, 4, 5});
  REQUIRE(r.out[3 * 4] == -7.0f);  // rows past n untouched
  // The first forward already predicts EOS: one pseudo token.
  FakeEngine e3;
  r = decode(e3, LookaheadParams{8, 4});
  REQUIRE(r.n == 1);
  // max_tokens = 2
  FakeEngine e4;
  r = decode(e4, LookaheadParams{2, -1});
  REQUIRE(r.n == 2);
  REQUIRE(e4.calls.size() == 2);
}

TEST_CASE("lookahead decoder: a failing or malformed callback is a clear error and writes nothing", "[laq][lookahead][errors]") {
  auto expect = [](FakeEngine e, const char* needle, LookaheadParams p = {8, -1}, std::int32_t first = 3, std::size_t ws = SIZE_MAX) {
    DecodeRun r = decode(e, p, first, 50, ws);
    INFO(r.status.message());
    REQUIRE(!r.status.is_ok());
    REQUIRE_THAT(r.status.message(), Contains(needle));
    REQUIRE(r.n == -1);
    REQUIRE(std::all_of(r.out.begin(), r.out.end(), [](float x) { return x == -7.0f; }));
    REQUIRE(std::all_of(r.tokens.begin(), r.tokens.end(), [](std::int32_t x) { return x == -7; }));
  };
  FakeEngine e;
  e.fail_at = 4;
  expect(e, "fake engine: out of cache");
  e = FakeEngine{};
  e.throw_at = 2;
  expect(e, "the decode callback threw at pseudo token 2: fake engine exploded");
  e = FakeEngine{};
  e.bad_shape_at = 1;
  expect(e, "returned queries of shape (2, 2, 4) at pseudo token 1, expected (num_layers = 2, num_q_heads = 3, head_dim = 4)");
  e = FakeEngine{};
  e.nan_at = 5;
  expect(e, "non-finite query (layer 0, head 1) at pseudo token 5");
  expect(FakeEngine{}, "first_token 12 is outside the vocabulary [0, 10)", {8, -1}, 12);
  expect(FakeEngine{}, "workspace has 16 bytes", {8, -1}, 3, 16);
  const LookaheadDecoder bad(LookaheadParams{0, -1});
  REQUIRE_THAT(bad.requirements(LookaheadShape{2, 3, 4, 10}).status.message(), Contains("max_tokens is 0, must be >= 1"));
  REQUIRE_THAT(LookaheadDecoder{}.requirements(LookaheadShape{2, 0, 4, 10}).status.message(), Contains("must be all >= 1"));
}

TEST_CASE("lookahead_observation: the last W2 prompt rows then the pseudo rows", "[laq][lookahead]") {
  std::vector<float> prompt(2 * 5 * 3), pseudo(2 * 2 * 3), out(2 * 5 * 3, -1.0f);
  std::iota(prompt.begin(), prompt.end(), 0.0f);
  std::iota(pseudo.begin(), pseudo.end(), 100.0f);
  const auto P = TensorView<const float, 3>::contiguous(prompt.data(), {2, 5, 3});
  const auto N = TensorView<const float, 3>::contiguous(pseudo.data(), {2, 2, 3});
  REQUIRE(lookahead_observation(P, N, 3, TensorView<float, 3>::contiguous(out.data(), {2, 5, 3})).is_ok());
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 3; ++j) REQUIRE(out[(h * 5 + i) * 3 + j] == prompt[(h * 5 + 2 + i) * 3 + j]);
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 3; ++j) REQUIRE(out[(h * 5 + 3 + i) * 3 + j] == pseudo[(h * 2 + i) * 3 + j]);
  }
  std::fill(out.begin(), out.end(), -1.0f);
  REQUIRE_THAT(lookahead_observation(P, N, 6, TensorView<float, 3>::contiguous(out.data(), {2, 8, 3})).message(),
               Contains("window 6 must be in [0, prompt query rows = 5]"));
  REQUIRE_THAT(lookahead_observation(P, N, 2, TensorView<float, 3>::contiguous(out.data(), {2, 5, 3})).message(),
               Contains("expected (2, window + n = 4, 3)"));
  REQUIRE(std::all_of(out.begin(), out.end(), [](float x) { return x == -1.0f; }));
}
