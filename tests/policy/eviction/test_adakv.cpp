// Ada-KV: the three variants (original, original GQA-aware, kvpress) against the
// §11 golden, hand-worked allocations, sort-based references, every backend.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <tuple>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/eviction/adakv.hpp"
#include "kvpolicy/policy/eviction/expected_attention.hpp"
#include "kvpolicy/util/thread_pool.hpp"
#include "scoring_test_util.hpp"

using namespace kvpolicy;
using Catch::Matchers::Contains;

STATIC_ASSERT_POLICY(AdaKV<SnapKV>);
static_assert(HeadScorer<SnapKV, ScoreInput<float, half>>);
static_assert(HeadScorer<ExpectedAttention, ExpectedAttentionInput<float, half>>);

namespace kvp_test {

/// A scorer with fixed scores (rows = kv heads, G = 1): isolates the allocation.
struct FixedScorer {
  struct Params {};
  static constexpr const char* kName = "fixed";
  std::vector<float> s;
  std::int64_t H = 0, T = 0, P = 0;
  Params params_{};
  const Params& params() const noexcept { return params_; }
  Status validate_params() const noexcept { return Status::ok(); }
  template <class Backend, class Tq, class Tk>
  Status score(const Context<Backend>&, const ScoreInput<Tq, Tk>&, ScoreMap out) const noexcept {
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t j = 0; j < T; ++j) out(h, j) = s[h * T + j];
    return Status::ok();
  }
  template <class Backend>
  Requirements requirements(const Context<Backend>&, const ProblemShape&) const noexcept {
    return Requirements{};  // ok, no workspace
  }
  std::int64_t protected_tokens(std::int64_t) const noexcept { return P; }
  template <class Tq, class Tk>
  Status validate(std::span<const ScoreInput<Tq, Tk>> batch, ProblemShape* shape) const noexcept {
    KVP_REQUIRE(!batch.empty(), "fixed: batch is empty");
    *shape = ProblemShape{H, H, 1, T, 1};
    return Status::ok();
  }
};
static_assert(HeadScorer<FixedScorer, ScoreInput<float, float>>);

struct FixedCase {
  std::vector<float> keys, q;
  FixedScorer scorer;
  FixedCase(std::int64_t H, std::int64_t T, std::int64_t P, std::vector<float> s) : keys(H * T, 0.0f), q(H, 0.0f) {
    scorer.s = std::move(s);
    scorer.H = H;
    scorer.T = T;
    scorer.P = P;
  }
  ScoreInput<float, float> input() const {
    return {TensorView<const float, 3>::contiguous(q.data(), {scorer.H, 1, 1}),
            KVSource<float>::from(TensorView<const float, 3>::contiguous(keys.data(), {scorer.H, scorer.T, 1}))};
  }
  KeepSetBuffer run(const AdaKVParams& p) const {
    const AdaKV<FixedScorer> policy(p, scorer);
    return run_ragged<backend::Scalar>(policy, std::vector<ScoreInput<float, float>>{input()}, scorer.H,
                                       ProblemShape{scorer.H, scorer.H, 1, scorer.T, 1});
  }
};

/// Order of the library's total order: (score key, index) descending.
inline bool better(float a, std::int64_t ia, float b, std::int64_t ib) {
  const auto ka = score_order_key(a), kb = score_order_key(b);
  return ka != kb ? ka > kb : ia > ib;
}

/// Sort-based transcription of FFY0/AdaKV's allocation on scores (rows, T).
std::vector<std::vector<std::int32_t>> reference_original(const std::vector<float>& S, std::int64_t rows, std::int64_t T, std::int64_t P,
                                                          std::int64_t n_total, double alpha, bool normalize) {
  std::vector<std::vector<std::int32_t>> kept(rows);
  if (n_total > T) {
    for (auto& r : kept) {
      r.resize(T);
      std::iota(r.begin(), r.end(), 0);
    }
    return kept;
  }
  const std::int64_t B = n_total - P;
  std::vector<float> ranked = S;
  std::vector<std::int64_t> prot(rows, 0);
  for (std::int64_t r = 0; r < rows; ++r) {
    std::vector<float> past;
    for (std::int64_t j = 0; j < T; ++j) {
      if (S[r * T + j] == INFINITY)
        ++prot[r];
      else
        past.push_back(S[r * T + j]);
    }
    if (normalize) {
      std::sort(past.begin(), past.end(), [](float a, float b) { return score_order_key(a) > score_order_key(b); });
      double top = 0, all = 0;
      for (std::size_t i = 0; i < past.size(); ++i) (i < static_cast<std::size_t>(B) ? top : all) += past[i];
      all += top;
      const float f = all != 0.0 ? static_cast<float>(top) / static_cast<float>(all) : 1.0f;
      for (std::int64_t j = 0; j < T; ++j)
        if (S[r * T + j] != INFINITY) ranked[r * T + j] = S[r * T + j] * f;
    }
  }
  std::vector<std::int64_t> flat;
  for (std::int64_t i = 0; i < rows * T; ++i)
    if (S[i] != INFINITY) flat.push_back(i);
  std::sort(flat.begin(), flat.end(), [&](std::int64_t a, std::int64_t b) { return better(ranked[a], a, ranked[b], b); });
  std::vector<std::int64_t> count(rows, 0);
  for (std::int64_t i = 0; i < std::min<std::int64_t>(rows * B, static_cast<std::int64_t>(flat.size())); ++i) ++count[flat[i] / T];
  const auto floor_cap = static_cast<std::int64_t>(static_cast<double>(B) * alpha);
  for (std::int64_t r = 0; r < rows; ++r) {
    volatile float prod = static_cast<float>(count[r]) * static_cast<float>(1.0 - alpha);
    const float v = prod + static_cast<float>(floor_cap);
    const auto cap = std::clamp<std::int64_t>(static_cast<std::int64_t>(std::nearbyint(v)), 0, T - prot[r]);
    std::vector<std::int32_t> idx(T);
    std::iota(idx.begin(), idx.end(), 0);
    std::sort(idx.begin(), idx.end(), [&](std::int32_t a, std::int32_t b) { return better(S[r * T + a], a, S[r * T + b], b); });
    kept[r].assign(idx.begin(), idx.begin() + cap + prot[r]);
    std::sort(kept[r].begin(), kept[r].end());
  }
  return kept;
}

/// Sort-based transcription of kvpress AdaKVPress.compress.
std::vector<std::vector<std::int32_t>> reference_kvpress(const std::vector<float>& S, std::int64_t rows, std::int64_t T,
                                                         std::int64_t n_kept, double alpha) {
  const auto n_safe = static_cast<std::int64_t>(static_cast<double>(n_kept) * alpha);
  std::vector<char> safe(rows * T, 0);
  for (std::int64_t r = 0; r < rows; ++r) {
    std::vector<std::int32_t> idx(T);
    std::iota(idx.begin(), idx.end(), 0);
    std::sort(idx.begin(), idx.end(), [&](std::int32_t a, std::int32_t b) { return better(S[r * T + a], a, S[r * T + b], b); });
    for (std::int64_t i = 0; i < n_safe; ++i) safe[r * T + idx[i]] = 1;
  }
  std::vector<std::int64_t> flat(rows * T);
  std::iota(flat.begin(), flat.end(), 0);
  std::sort(flat.begin(), flat.end(), [&](std::int64_t a, std::int64_t b) {
    if (safe[a] != safe[b]) return safe[a] > safe[b];
    return better(S[a], a, S[b], b);
  });
  std::vector<std::vector<std::int32_t>> kept(rows);
  for (std::int64_t i = 0; i < rows * n_kept; ++i) kept[flat[i] / T].push_back(static_cast<std::int32_t>(flat[i] % T));
  for (auto& k : kept) std::sort(k.begin(), k.end());
  return kept;
}

std::vector<std::vector<std::int32_t>> rows_of(const KeepSetBuffer& k, std::int64_t first, std::int64_t n) {
  std::vector<std::vector<std::int32_t>> out;
  for (std::int64_t r = first; r < first + n; ++r) out.push_back(k.row(r));
  return out;
}

}  // namespace kvp_test

TEST_CASE("adakv: golden vector of reference §11 (AdaKVPress(SnapKVPress(r=.5, w=3, K=3), alpha=0.2))", "[adakv][golden]") {
  const GoldenSnap g(3);
  const AdaKV<SnapKV> policy(AdaKVParams::kvpress(0.5, 0.2), SnapKV(SnapKVParams::kvpress(0.5, 3, 3)));
  const ProblemShape shape{4, 2, 4, 12, 3};
  const std::vector<ScoreInput<float, float>> batch{g.input(3)};
  for (const auto& keep : {run_ragged<backend::Scalar>(policy, batch, 2, shape), run_ragged<backend::Cpu>(policy, batch, 2, shape)}) {
    // masked kv0 {0,5,6,7,8} (keeps 7), kv1 {0,1,2,3,4,5,8} (keeps 5); n_kept = 6 per head on average.
    REQUIRE(keep.row(0) == std::vector<std::int32_t>{1, 2, 3, 4, 9, 10, 11});
    REQUIRE(keep.row(1) == std::vector<std::int32_t>{6, 7, 9, 10, 11});
  }
}

TEST_CASE("adakv: original allocation by hand — blended capacities, half-even rounding, fp32, ties", "[adakv][original]") {
  const float inf = INFINITY;
  // 2 heads, T = 10, window 2 (+inf), C = 6 -> B = 4, L = 8.
  FixedCase c(2, 10, 2, {0.9f, 0.8f, 0.7f,  0.6f,  0.5f,  0.05f, 0.04f, 0.03f, inf, inf,  //
                         0.1f, 0.2f, 0.01f, 0.02f, 0.03f, 0.04f, 0.06f, 0.07f, inf, inf});
  // Global top 8 of the past: h0 x5, h1 x3. alpha = .5: floor 2, cap = round(4.5) = 4, round(3.5) = 4.
  auto keep = c.run(AdaKVParams::original_gqa(6, 0.5));
  REQUIRE(keep.row(0) == std::vector<std::int32_t>{0, 1, 2, 3, 8, 9});
  REQUIRE(keep.row(1) == std::vector<std::int32_t>{0, 1, 6, 7, 8, 9});
  // alpha = .2: floor int(0.8) = 0, cap = round(5 * 0.8f) = 4, round(3 * 0.8f) = 2: the total (6) is not H*B (8).
  keep = c.run(AdaKVParams::original_gqa(6, 0.2));
  REQUIRE(keep.row(0) == std::vector<std::int32_t>{0, 1, 2, 3, 8, 9});
  REQUIRE(keep.row(1) == std::vector<std::int32_t>{0, 1, 8, 9});
  // B > L: nothing evicted; B == L still runs the allocation (and may round a head down).
  keep = c.run(AdaKVParams::original_gqa(11, 0.2));
  REQUIRE(keep.row(0).size() == 10);
  REQUIRE(keep.row(1).size() == 10);
  // alpha = 1: uniform B per head (SnapKV with B past tokens + window).
  keep = c.run(AdaKVParams::original_gqa(6, 1.0));
  REQUIRE(keep.row(1) == std::vector<std::int32_t>{0, 1, 6, 7, 8, 9});

  // Ties across heads go to the higher head: B = 1, K = 2: 0.9 (h0), then 0.5 (h0 t1) vs 0.5 (h1 t0) -> h1.
  FixedCase tie(2, 4, 0, {0.9f, 0.5f, 0.1f, 0.1f, 0.5f, 0.1f, 0.1f, 0.1f});
  keep = tie.run(AdaKVParams::original_gqa(1, 0.0));
  REQUIRE(keep.row(0) == std::vector<std::int32_t>{0});
  REQUIRE(keep.row(1) == std::vector<std::int32_t>{0});
}

TEST_CASE("adakv: past scores that overflow to +inf stay ordinary tokens (no KeepSet overflow, #16.1)", "[adakv][original][errors]") {
  const float inf = INFINITY;
  // 2 heads, T = 10, window 2 (+inf by rule), C = 6 -> B = 4. Head 0 has 5 past tokens at +inf (an overflowing scorer).
  FixedCase c(2, 10, 2, {inf,  inf,  inf,   inf,   inf,   0.05f, 0.04f, 0.03f, inf, inf,  //
                         0.1f, 0.2f, 0.01f, 0.02f, 0.03f, 0.04f, 0.06f, 0.07f, inf, inf});
  const AdaKV<FixedScorer> policy(AdaKVParams::original_gqa(6, 0.2), c.scorer);
  const auto keep = c.run(AdaKVParams::original_gqa(6, 0.2));
  REQUIRE(keep.indptr.back() <= policy.max_total_kept(10, 2));
  require_valid_rows(keep, 2, 10);
  // Top 12 = the nine +inf, then 0.2, 0.1, 0.07 of head 1 -> c = {5, 3}: caps round(4.0) = 4, round(2.4) = 2. Head 0 keeps its
  // best 6 of seven +inf tokens (the most recent); the old count-the-infs rule gave it 7 + cap and overflowed the KeepSet.
  REQUIRE(keep.row(0) == std::vector<std::int32_t>{1, 2, 3, 4, 8, 9});
  REQUIRE(keep.row(1) == std::vector<std::int32_t>{0, 1, 8, 9});
  // More +inf than the selection holds (C = 3, B = 1: top 6 are all head 1's): c[0] would be -2, so the counts are uniform.
  std::vector<float> flood(20, inf);
  for (int j = 0; j < 8; ++j) flood[j] = 0.5f;
  FixedCase fc(2, 10, 2, flood);
  const auto uni = fc.run(AdaKVParams::original_gqa(3, 0.2));
  REQUIRE(uni.indptr == std::vector<std::int32_t>{0, 3, 6});
  REQUIRE(uni.row(0) == std::vector<std::int32_t>{7, 8, 9});
  REQUIRE(uni.row(1) == std::vector<std::int32_t>{7, 8, 9});
}

TEST_CASE("adakv: the allocation is a BudgetAllocator usable on its own (counts == AdaKV's row sizes)", "[adakv][allocation]") {
  std::mt19937 rng(77);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  const std::int64_t H = 4, T = 57, P = 5;
  std::vector<float> S(H * T);
  for (auto& x : S) x = std::round(u(rng) * 20.0f) / 20.0f;  // many ties
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t j = T - P; j < T; ++j) S[h * T + j] = INFINITY;
  FixedCase c(H, T, P, S);
  for (const AdaKVParams& p : {AdaKVParams::original_gqa(20, 0.2), AdaKVParams::original_gqa(20, 0.5, true), AdaKVParams::kvpress(0.6, 0.2),
                               AdaKVParams::kvpress(0.3, 0.0)}) {
    const AdaKVAllocation alloc{p.variant, p.alpha, p.normalize, p.budget, P};
    std::vector<std::byte> ws(alloc.workspace_bytes(Context<backend::Scalar>{}, H, T));
    std::vector<std::int64_t> counts(H);
    REQUIRE(alloc
                .allocate(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}}, T,
                          TensorView<const float, 2>::contiguous(S.data(), {H, T}), counts)
                .is_ok());
    const auto keep = c.run(p);
    std::int64_t total = 0;
    for (std::int64_t h = 0; h < H; ++h) {
      REQUIRE(static_cast<std::int64_t>(keep.row(h).size()) == counts[h]);
      total += counts[h];
    }
    REQUIRE(total <= alloc.max_total(T, H));
    if (p.variant == AdaKVVariant::kKvpress) REQUIRE(total == H * kvpress_n_kept(T, p.budget.value));
    // Workspace too small / wrong count span: errors, nothing written.
    std::vector<std::int64_t> untouched(H, -7);
    REQUIRE_THAT(alloc
                     .allocate(Context<backend::Scalar>{Workspace{ws.data(), 16}}, T,
                               TensorView<const float, 2>::contiguous(S.data(), {H, T}), untouched)
                     .message(),
                 Contains("workspace has 16 bytes"));
    REQUIRE(untouched == std::vector<std::int64_t>(H, -7));
    REQUIRE_THAT(alloc
                     .allocate(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}}, T,
                               TensorView<const float, 2>::contiguous(S.data(), {H, T}), std::span<std::int64_t>(untouched.data(), 2))
                     .message(),
                 Contains("2 counts for 4 rows"));
  }
}

TEST_CASE("adakv: original normalize re-weights heads by their top-B share", "[adakv][original]") {
  // h0 concentrated (top-2 share .7), h1 flat (share .5). B = 2, K = 4, alpha = 0.
  FixedCase c(2, 6, 0, {0.5f, 0.2f, 0.2f, 0.1f, 0.0f, 0.0f, 0.25f, 0.25f, 0.25f, 0.25f, 0.0f, 0.0f});
  auto keep = c.run(AdaKVParams::original_gqa(2, 0.0, /*normalize=*/false));
  REQUIRE(keep.row(0) == std::vector<std::int32_t>{0});  // 0.5, then h1's 0.25s (ties: highest index first)
  REQUIRE(keep.row(1) == std::vector<std::int32_t>{1, 2, 3});
  keep = c.run(AdaKVParams::original_gqa(2, 0.0, /*normalize=*/true));
  REQUIRE(keep.row(0) == std::vector<std::int32_t>{0, 1, 2});  // 0.35, 0.14, 0.14 beat 0.125
  REQUIRE(keep.row(1) == std::vector<std::int32_t>{3});
  // A head whose scores sum to zero keeps factor 1 (torch would divide by zero).
  FixedCase z(2, 4, 0, {0.0f, 0.0f, 0.0f, 0.0f, 0.4f, 0.3f, 0.2f, 0.1f});
  keep = z.run(AdaKVParams::original_gqa(2, 0.0, true));
  REQUIRE(keep.row(0).empty());
  REQUIRE(keep.row(1) == std::vector<std::int32_t>{0, 1, 2, 3});
}

TEST_CASE("adakv: kvpress safeguard, exact layer total, budget below the protected tokens, 0.5.5 n_safe clamp", "[adakv][kvpress]") {
  FixedCase c(2, 4, 0, {0.9f, 0.8f, 0.7f, 0.6f, 0.1f, 0.2f, 0.05f, 0.01f});
  AdaKVParams p = AdaKVParams::kvpress(0.0, 0.2);
  p.budget = Budget::tokens(2);
  auto keep = c.run(p);  // n_safe = int(0.4) = 0: the layer's best 4 are all in head 0
  REQUIRE(keep.row(0) == std::vector<std::int32_t>{0, 1, 2, 3});
  REQUIRE(keep.row(1).empty());
  p.budget = Budget::tokens(2).keep_at_least_one();  // kvpress >= 0.5.5: n_safe = max(1, 0)
  keep = c.run(p);
  REQUIRE(keep.row(0) == std::vector<std::int32_t>{0, 1, 2});
  REQUIRE(keep.row(1) == std::vector<std::int32_t>{1});
  // Safeguarded tokens outrank protected ones: 3 protected per head, n_kept = 2, alpha = 0.5 -> n_safe = 1.
  const float inf = INFINITY;
  FixedCase w(2, 5, 3, {0.9f, 0.1f, inf, inf, inf, 0.2f, 0.3f, inf, inf, inf});
  p = AdaKVParams::kvpress(0.0, 0.5);
  p.budget = Budget::tokens(2);
  keep = w.run(p);  // each head's safeguard is its latest protected token; 2 more from the +inf ties: highest flat index
  REQUIRE(keep.row(0) == std::vector<std::int32_t>{4});
  REQUIRE(keep.row(1) == std::vector<std::int32_t>{2, 3, 4});
}

TEST_CASE("adakv: random cases equal the sort-based references (both variants, both granularities)", "[adakv][reference]") {
  for (int G : {1, 2, 4}) {
    for (int T : {9, 100, 777}) {
      const int Hkv = 2, w = 8;
      RandomCase<float> rc(G * Hkv, Hkv, T, 32, w, 31 * G + T);
      const SnapKV scorer(adakv_scoring(w, 7));
      const auto in = rc.input();
      ProblemShape shape{G * Hkv, Hkv, 32, T, w};
      // Scores as the policy sees them (kv heads).
      std::vector<float> S(Hkv * T);
      const Requirements sreq = scorer.requirements(Context<backend::Scalar>{}, shape);
      REQUIRE(sreq.status.is_ok());
      std::vector<std::byte> sws(sreq.workspace_bytes);
      REQUIRE(
          scorer
              .score(Context<backend::Scalar>{Workspace{sws.data(), sws.size()}}, in, TensorView<float, 2>::contiguous(S.data(), {Hkv, T}))
              .is_ok());
      for (double alpha : {0.0, 0.2, 0.5, 1.0}) {
        for (bool norm : {false, true}) {
          for (std::int64_t C : {w + 1, w + T / 4, w + T / 2, T}) {
            const AdaKV<SnapKV> orig(AdaKVParams::original_gqa(C, alpha, norm), scorer);
            const auto keep = run_ragged<backend::Scalar>(orig, std::vector{in}, Hkv, shape);
            REQUIRE(rows_of(keep, 0, Hkv) == reference_original(S, Hkv, T, w, C, alpha, norm));
          }
        }
        for (double r : {0.1, 0.5, 0.9}) {
          const AdaKV<SnapKV> kvp(AdaKVParams::kvpress(r, alpha), scorer);
          const auto keep = run_ragged<backend::Scalar>(kvp, std::vector{in}, Hkv, shape);
          const std::int64_t n = kvpress_n_kept(T, r);
          REQUIRE(rows_of(keep, 0, Hkv) == reference_kvpress(S, Hkv, T, n, alpha));
          REQUIRE(keep.indptr.back() == Hkv * n);
        }
      }
    }
  }
}

TEST_CASE("adakv: the original per-query-head mode equals a kv-head run on repeated keys", "[adakv][original][gqa]") {
  const int Hq = 8, Hkv = 2, G = 4, T = 300, d = 32, w = 16;
  RandomCase<float> rc(Hq, Hkv, T, d, w, 77);
  // Repeated keys (Hq, T, d): what the original does with repeat_kv before compressing.
  std::vector<float> rep(Hq * T * d);
  for (int q = 0; q < Hq; ++q) std::copy_n(rc.keys.begin() + (q / G) * T * d, T * d, rep.begin() + q * T * d);
  const ScoreInput<float, float> repeated{TensorView<const float, 3>::contiguous(rc.queries.data(), {Hq, w, d}),
                                          KVSource<float>::from(TensorView<const float, 3>::contiguous(rep.data(), {Hq, T, d}))};
  const SnapKV scorer(adakv_scoring(w, 7));
  for (bool norm : {false, true}) {
    const AdaKV<SnapKV> per_query(AdaKVParams::original(96, 0.2, norm), scorer);
    AdaKVParams kvp = AdaKVParams::original(96, 0.2, norm);
    kvp.heads = HeadGranularity::kKvHead;
    const AdaKV<SnapKV> on_repeated(kvp, scorer);
    REQUIRE(per_query.rows_per_sequence(Hq, Hkv) == Hq);
    const auto a = run_ragged<backend::Scalar>(per_query, std::vector{rc.input()}, Hq, ProblemShape{Hq, Hkv, d, T, w});
    const auto b = run_ragged<backend::Scalar>(on_repeated, std::vector{repeated}, Hq, ProblemShape{Hq, Hq, d, T, w});
    REQUIRE(a == b);
    require_valid_rows(a, Hq, T);
    REQUIRE(run_ragged<backend::Cpu>(per_query, std::vector{rc.input()}, Hq, ProblemShape{Hq, Hkv, d, T, w}) == a);
  }
}

TEST_CASE("adakv: GQA-aware scoring reduces the group before pooling (mean and max)", "[adakv][gqa]") {
  RandomCase<float> rc(8, 2, 400, 32, 32, 5);
  for (GroupReduce f : {GroupReduce::kMean, GroupReduce::kMax}) {
    const SnapKVParams sp = adakv_scoring(32, 7, f);
    REQUIRE(sp.order == ReduceOrder::kGroupThenPool);
    REQUIRE(sp.window_reduce == WindowReduce::kMean);
    REQUIRE(sp.pooling == Pooling::kMax);
    const AdaKV<SnapKV> policy(AdaKVParams::original_gqa(128, 0.2), SnapKV(sp));
    const auto keep = run_ragged<backend::Scalar>(policy, std::vector{rc.input()}, 2, ProblemShape{8, 2, 32, 400, 32});
    require_valid_rows(keep, 2, 400);
    std::int64_t total = 0;
    for (int h = 0; h < 2; ++h) {
      const auto row = keep.row(h);
      total += static_cast<std::int64_t>(row.size());
      for (int j = 0; j < 32; ++j) REQUIRE(row[row.size() - 32 + j] == 400 - 32 + j);  // window kept
    }
    REQUIRE(total <= policy.max_total_kept(400, 2));
    REQUIRE(total >= 2 * 128 - 2);
  }
}

TEST_CASE("adakv: every backend equals the scalar reference (GQA 1/2/4/8, lengths 1..4099, strided, paged, threads)", "[adakv][backends]") {
  for (int G : {1, 2, 4, 8}) {
    for (int T : {1, 2, 7, 100, 1000, 4099}) {
      const int w = std::min(T, 8), Hkv = 2, d = 64;
      RandomCase<half> rc(G * Hkv, Hkv, T, d, w, 1000 * G + T);
      const ProblemShape shape{G * Hkv, Hkv, d, T, w};
      const SnapKV snap_kvpress(SnapKVParams::kvpress(0.5, w, 5));
      const SnapKV snap_ada(adakv_scoring(w, 7));
      const std::vector<AdaKV<SnapKV>> policies{AdaKV<SnapKV>(AdaKVParams::kvpress(0.5, 0.2), snap_kvpress),
                                                AdaKV<SnapKV>(AdaKVParams::original_gqa(std::max(w + 1, T / 3), 0.2), snap_ada),
                                                AdaKV<SnapKV>(AdaKVParams::original(std::max(w + 1, T / 3), 0.2, true), snap_ada)};
      for (const auto& policy : policies) {
        const std::int64_t rows = policy.rows_per_sequence(G * Hkv, Hkv);
        const auto ref = run_ragged<backend::Scalar>(policy, std::vector{rc.input()}, rows, shape);
        require_valid_rows(ref, rows, T);
        REQUIRE(run_ragged<backend::Cpu>(policy, std::vector{rc.input()}, rows, shape) == ref);
        REQUIRE(run_ragged<backend::Cpu>(policy, std::vector{rc.strided_input()}, rows, shape) == ref);
        REQUIRE(run_ragged<backend::Cpu>(policy, std::vector{rc.paged_input(16)}, rows, shape) == ref);
        ThreadPool pool(2);
        REQUIRE(run_ragged<backend::Cpu>(policy, std::vector{rc.input()}, rows, shape, pool.context()) == ref);
      }
    }
  }
}

TEST_CASE("adakv: a batch of different lengths equals per-sequence calls", "[adakv]") {
  RandomCase<float> a(8, 2, 257, 64, 8, 1), b(8, 2, 64, 64, 8, 2), c(8, 2, 1000, 64, 8, 3);
  for (const auto& policy : {AdaKV<SnapKV>(AdaKVParams::kvpress(0.7, 0.2), SnapKV(SnapKVParams::kvpress(0.7, 8, 7))),
                             AdaKV<SnapKV>(AdaKVParams::original_gqa(100, 0.3), SnapKV(adakv_scoring(8, 7)))}) {
    ThreadPool pool(2);
    const auto all =
        run_ragged<backend::Cpu>(policy, std::vector{a.input(), b.input(), c.input()}, 2, ProblemShape{8, 2, 64, 1000, 8}, pool.context());
    std::int64_t row = 0;
    for (auto* rc : {&a, &b, &c}) {
      const auto one = run_ragged<backend::Scalar>(policy, std::vector{rc->input()}, 2, ProblemShape{8, 2, 64, rc->T, 8});
      for (int h = 0; h < 2; ++h) REQUIRE(all.row(row++) == one.row(h));
    }
  }
}

TEST_CASE("adakv: on top of Expected Attention", "[adakv][expected_attention]") {
  const int Hq = 8, Hkv = 2, T = 300, d = 16;
  RandomCase<float> rc(Hq, Hkv, T, d, T, 12);  // queries (Hq, T, d) as the prompt's pre-RoPE queries
  std::vector<float> values(rc.keys.size());
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = std::sin(0.37f * static_cast<float>(i)) + 1.2f;
  ExpectedAttentionInput<float, float> in;
  in.queries = TensorView<const float, 3>::contiguous(rc.queries.data(), {Hq, T, d});
  in.keys = KVSource<float>::from(TensorView<const float, 3>::contiguous(rc.keys.data(), {Hkv, T, d}));
  in.values = KVSource<float>::from(TensorView<const float, 3>::contiguous(values.data(), {Hkv, T, d}));
  const ExpectedAttention ea(ExpectedAttentionParams::kvpress(0.5, 64, 4, true, true, 1e-2f));
  const AdaKV<ExpectedAttention> policy(AdaKVParams::kvpress(0.5, 0.2), ea);
  const ProblemShape shape{Hq, Hkv, d, T, T};
  const auto keep = run_ragged<backend::Scalar>(policy, std::vector{in}, Hkv, shape);
  REQUIRE(run_ragged<backend::Cpu>(policy, std::vector{in}, Hkv, shape) == keep);
  REQUIRE(keep.indptr.back() == Hkv * kvpress_n_kept(T, 0.5));
  for (int h = 0; h < Hkv; ++h)
    for (int j = 0; j < 4; ++j) REQUIRE(keep.row(h)[j] == j);  // sinks protected
  std::vector<float> S(Hkv * T);
  const Requirements ereq = ea.requirements(Context<backend::Scalar>{}, shape);
  REQUIRE(ereq.status.is_ok());
  std::vector<std::byte> ws(ereq.workspace_bytes);
  REQUIRE(ea.score(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}}, in, TensorView<float, 2>::contiguous(S.data(), {Hkv, T}))
              .is_ok());
  REQUIRE(rows_of(keep, 0, Hkv) == reference_kvpress(S, Hkv, T, kvpress_n_kept(T, 0.5), 0.2));
  // Per query head: runs the scorer on each group member's heads.
  const AdaKV<ExpectedAttention> per_q(AdaKVParams::original(100, 0.2), ea);
  const auto kq = run_ragged<backend::Scalar>(per_q, std::vector{in}, Hq, shape);
  require_valid_rows(kq, Hq, T);
}

TEST_CASE("adakv: bad input gets a clear message and writes nothing", "[adakv][errors]") {
  RandomCase<float> rc(8, 2, 100, 64, 8, 9);
  const auto in = rc.input();
  auto expect_error = [&](const AdaKV<SnapKV>& p, ScoreInput<float, float> input, const char* needle, std::int64_t capacity = 400,
                          std::size_t ws_bytes = SIZE_MAX) {
    KeepSetBuffer keep(p.rows_per_sequence(8, 2), capacity);
    keep.fill_sentinel();
    // An invalid policy reports 0 bytes: the call validates its inputs before the workspace.
    std::vector<std::byte> ws(ws_bytes == SIZE_MAX ? p.requirements(Context<backend::Cpu>{}, ProblemShape{8, 2, 64, 100, 8}).workspace_bytes
                                                   : ws_bytes);
    const Status s = p.evict(Context<backend::Cpu>{Workspace{ws.data(), ws.size()}}, input, keep.view());
    INFO(s.message());
    REQUIRE(!s.is_ok());
    REQUIRE_THAT(s.message(), Contains(needle));
    REQUIRE(keep.untouched());
  };
  const SnapKV snap(SnapKVParams::kvpress(0.5, 8, 5));
  expect_error(AdaKV<SnapKV>(AdaKVParams::kvpress(0.5, -0.1), snap), in, "alpha is -0.1, must be in [0, 1]");
  expect_error(AdaKV<SnapKV>(AdaKVParams::kvpress(0.5, 1.5), snap), in, "alpha is 1.5, must be in [0, 1]");
  expect_error(AdaKV<SnapKV>(AdaKVParams::kvpress(0.5, std::nan("")), snap), in, "must be in [0, 1]");
  expect_error(AdaKV<SnapKV>(AdaKVParams::kvpress(1.0, 0.2), snap), in, "compression_ratio is 1, must be in [0, 1)");
  expect_error(AdaKV<SnapKV>(AdaKVParams::original_gqa(5, 0.2), snap), in, "budget of 5 tokens per head is smaller than the 8 protected");
  AdaKVParams tok = AdaKVParams::kvpress(0.0, 0.2);
  tok.budget = Budget::tokens(101);
  expect_error(AdaKV<SnapKV>(tok, snap), in, "token budget 101 is larger than the sequence length 100");
  expect_error(AdaKV<SnapKV>(AdaKVParams::kvpress(0.5), SnapKV(SnapKVParams::kvpress(0.5, 8, 4))), in, "pooling kernel is 4, must be odd");
  RandomCase<float> shortc(8, 2, 6, 64, 8, 9);
  expect_error(AdaKV<SnapKV>(AdaKVParams::kvpress(0.5), snap), shortc.input(), "window 8 is larger than kv_len 6");
  auto bad = in;
  bad.queries = TensorView<const float, 3>(rc.queries.data(), {7, 8, 64}, {512, 64, 1});
  expect_error(AdaKV<SnapKV>(AdaKVParams::kvpress(0.5), snap), bad, "queries has 7 heads, not a multiple of the 2 kv heads");
  expect_error(AdaKV<SnapKV>(AdaKVParams::kvpress(0.5), snap), in, "keep set capacity is 99, needs 100", 99);
  // The original may round up by one token per row: capacity must cover the bound.
  const AdaKV<SnapKV> orig(AdaKVParams::original_gqa(50, 0.2), snap);
  REQUIRE(orig.max_total_kept(100, 2) == 102);
  expect_error(orig, in, "keep set capacity is 100, needs 102", 100);
  expect_error(AdaKV<SnapKV>(AdaKVParams::kvpress(0.5), snap), in, "workspace has 100 bytes", 400, 100);
  KeepSetBuffer keep(2, 400);
  std::vector<std::byte> ws(100);
  REQUIRE(AdaKV<SnapKV>(AdaKVParams::kvpress(0.5), snap)
              .evict(Context<backend::Cpu>{Workspace{ws.data(), ws.size()}}, in, keep.view())
              .code() == StatusCode::kWorkspaceTooSmall);
}
