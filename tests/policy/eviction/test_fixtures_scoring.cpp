// Cross-validation against the reference fixtures (tests/data/fixtures, written by
// tests/reference/make_fixtures.py from kvpress 0.5.5 and from the originals'
// formulas): SnapKV (kvpress and original/KVCache-Factory), StreamingLLM,
// Ada-KV (kvpress over SnapKV and Expected Attention; original, both
// granularities), PyramidKV (kvpress and Factory, schedules and kept sets),
// Expected Attention, LAQ stage 2 (the reference repository's update_kv_LAQ,
// both masks).
//
// Scores: |ours - ref| <= 1e-5 * |ref| + 1e-9 at every sampled position (the
// absolute floor 1e-9 only matters for scores below 1e-4, i.e. attention mass
// far below the 1/T average; all scores compared here are fp32 results of
// arithmetic on O(1) inputs). Protected positions: kvpress pads them with
// max+1, ours are +inf. Kept sets: exact; where the fixture records a tie
// straddling the boundary (max-pooling plateaus), any `n_tied_kept` of the
// tied tokens is accepted (we break ties to the higher index, the fixtures to
// the lower one).
//
// Budgets follow kvpress 0.5.5 (the version the fixtures were made with):
// n_kept = max(1, int(T(1-r))) and n_safe >= 1 via `Budget::keep_at_least_one()`.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/eviction/adakv.hpp"
#include "kvpolicy/policy/eviction/expected_attention.hpp"
#include "kvpolicy/policy/eviction/laq.hpp"
#include "kvpolicy/policy/eviction/pyramidkv.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "kvpolicy/policy/eviction/streaming_llm.hpp"
#include "reference/fixture_reader.hpp"
#include "scoring_test_util.hpp"

using namespace kvpolicy;
namespace kf = kvp_fixtures;

namespace {

constexpr double kRel = 1e-5, kAbsFloor = 1e-9;

struct Stats {
  const char* name;
  int cases = 0;
  long long scores = 0, kept_rows = 0, tied_rows = 0;
  double max_rel = 0.0;
  ~Stats() {
    std::printf("fixture %-34s %2d cases, %6lld scores (max rel err %.2e), %4lld kept rows equal (%lld with a recorded tie)\n", name, cases,
                scores, max_rel, kept_rows, tied_rows);
  }
};

/// Inputs of one case: post-RoPE window queries, keys (repeated to query heads on demand), values.
struct CaseInputs {
  std::int64_t Hq, Hkv, T, d;
  std::vector<float> q, k, v, k_rep;
  explicit CaseInputs(const kf::FixtureCase& c)
      : Hq(c.num_q_heads), Hkv(c.num_kv_heads), T(c.seq_len), d(c.head_dim), q(c.queries()), k(c.keys()), v(c.values()) {}
  /// SnapKV-style input: the last w queries of every head.
  ScoreInput<float, float> window(std::int64_t w, bool repeated = false) {
    if (repeated && k_rep.empty()) {
      const std::int64_t G = Hq / Hkv;
      k_rep.resize(Hq * T * d);
      for (std::int64_t h = 0; h < Hq; ++h) std::copy_n(k.begin() + (h / G) * T * d, T * d, k_rep.begin() + h * T * d);
    }
    return {TensorView<const float, 3>(q.data() + (T - w) * d, {Hq, w, d}, {T * d, d, 1}),
            KVSource<float>::from(TensorView<const float, 3>::contiguous(repeated ? k_rep.data() : k.data(), {repeated ? Hq : Hkv, T, d}))};
  }
  /// Expected Attention input: all prompt queries are the pre-RoPE queries.
  ExpectedAttentionInput<float, float> prompt() const {
    ExpectedAttentionInput<float, float> in;
    in.queries = TensorView<const float, 3>::contiguous(q.data(), {Hq, T, d});
    in.keys = KVSource<float>::from(TensorView<const float, 3>::contiguous(k.data(), {Hkv, T, d}));
    in.values = KVSource<float>::from(TensorView<const float, 3>::contiguous(v.data(), {Hkv, T, d}));
    return in;
  }
};

template <class Scorer, class In>
std::vector<float> scores_of(const Scorer& s, const In& in, std::int64_t rows, std::int64_t T, const ProblemShape& shape) {
  std::vector<float> out(rows * T);
  const Requirements req = s.requirements(Context<backend::Cpu>{}, shape);
  INFO(req.status.message());
  REQUIRE(req.status.is_ok());
  std::vector<std::byte> ws(req.workspace_bytes);
  const Status st =
      s.score(Context<backend::Cpu>{Workspace{ws.data(), ws.size()}}, in, TensorView<float, 2>::contiguous(out.data(), {rows, T}));
  INFO(st.message());
  REQUIRE(st.is_ok());
  return out;
}

void compare_scores(const kf::FixtureCase& c, const kf::ScoreSamples& ref, const std::vector<float>& ours, std::int64_t T, Stats& st) {
  INFO("case " << c.id);
  REQUIRE(ref.tokens.size() * static_cast<std::size_t>(T) == ours.size());
  for (std::size_t h = 0; h < ref.tokens.size(); ++h) {
    for (std::size_t i = 0; i < ref.tokens[h].size(); ++i) {
      const int t = ref.tokens[h][i];
      const double a = ours[h * T + t], b = ref.value[h][i];
      INFO("head " << h << " token " << t << ": ours " << a << ", reference " << b);
      if (ref.is_protected(t)) {
        REQUIRE(std::isinf(a));
        continue;
      }
      REQUIRE(std::abs(a - b) <= kRel * std::abs(b) + kAbsFloor);
      if (b != 0.0) st.max_rel = std::max(st.max_rel, std::abs(a - b) / std::abs(b));
      ++st.scores;
    }
  }
}

void compare_kept(const kf::FixtureCase& c, const std::vector<kf::TokenList>& ref, const std::vector<std::optional<kf::Ties>>& ties,
                  const KeepSetBuffer& keep, std::int64_t first_row, Stats& st) {
  INFO("case " << c.id);
  for (std::size_t h = 0; h < ref.size(); ++h) {
    INFO("row " << h);
    const auto ours = keep.row(first_row + static_cast<std::int64_t>(h));
    const kf::Ties* tie = h < ties.size() && ties[h] ? &*ties[h] : nullptr;
    if (tie == nullptr) {
      REQUIRE(ours == ref[h]);
    } else {
      REQUIRE(ours.size() == ref[h].size());
      auto untied = [&](const std::vector<std::int32_t>& v) {
        std::vector<std::int32_t> out;
        for (auto x : v)
          if (!std::binary_search(tie->tied.begin(), tie->tied.end(), x)) out.push_back(x);
        return out;
      };
      REQUIRE(untied(ours) == untied(ref[h]));
      const auto n_tied =
          std::count_if(ours.begin(), ours.end(), [&](auto x) { return std::binary_search(tie->tied.begin(), tie->tied.end(), x); });
      REQUIRE(n_tied == tie->n_tied_kept);
      ++st.tied_rows;
    }
    ++st.kept_rows;
  }
}

GroupReduce group_reduce_of(const nlohmann::json& v) {
  if (v.is_null()) return GroupReduce::kMean;  // query-head granularity: G = 1, unused
  const std::string s = v.get<std::string>();
  return s == "max" ? GroupReduce::kMax : s == "sum" ? GroupReduce::kSum : GroupReduce::kMean;
}

Pooling pooling_of(const kf::FixtureCase& c) {
  return c.param<int>("kernel_size") <= 1 ? Pooling::kNone : c.param<std::string>("pooling") == "max" ? Pooling::kMax : Pooling::kAvg;
}

/// SnapKV scoring of the originals (window sum, Factory kv_head mode or per query head on repeated keys).
SnapKVParams original_scoring(const kf::FixtureCase& c) {
  SnapKVParams p =
      SnapKVParams::original(c.param<int>("max_capacity_prompt"), c.param<int>("window_size"), c.param<int>("kernel_size"), pooling_of(c));
  p.group_reduce = group_reduce_of(c.params["gqa_agg"]);
  return p;
}

ExpectedAttentionParams ea_params(const kf::FixtureCase& c) {
  ExpectedAttentionParams p = ExpectedAttentionParams::kvpress(c.param<double>("compression_ratio"), c.param<int>("n_future_positions"),
                                                               c.param<int>("n_sink"), c.param<bool>("use_covariance"),
                                                               c.param<bool>("use_vnorm"), static_cast<float>(c.param<double>("epsilon")));
  p.budget = p.budget.keep_at_least_one();
  p.rope.fp64_angles = true;  // the fixtures' rotary stub builds its table in float64
  return p;
}

}  // namespace

TEST_CASE("fixtures: SnapKV (kvpress SnapKVPress)", "[fixtures][snapkv]") {
  Stats st{"snapkv_kvpress"};
  for (const auto& c : kf::load_fixtures("snapkv_kvpress")) {
    CaseInputs in(c);
    const int w = c.param<int>("window_size");
    SnapKVParams p = SnapKVParams::kvpress(c.param<double>("compression_ratio"), w, c.param<int>("kernel_size"));
    p.budget = p.budget.keep_at_least_one();
    const SnapKV snap(p);
    const ProblemShape shape{in.Hq, in.Hkv, in.d, in.T, w};
    compare_scores(c, c.scores, scores_of(snap, in.window(w), in.Hkv, in.T, shape), in.T, st);
    REQUIRE(snap.kept_count(in.T) == *c.n_kept);
    compare_kept(c, c.kept, c.kept_ties, run_evict<backend::Cpu>(snap, in.window(w)), 0, st);
    ++st.cases;
  }
}

TEST_CASE("fixtures: SnapKV original and KVCache-Factory kv_head mode", "[fixtures][snapkv]") {
  Stats st{"snapkv_original"};
  for (const auto& c : kf::load_fixtures("snapkv_original")) {
    CaseInputs in(c);
    const int w = c.param<int>("window_size");
    const bool per_q = c.param<std::string>("granularity") == "query_head";
    const SnapKV snap(original_scoring(c));
    const auto input = in.window(w, per_q);
    const std::int64_t rows = per_q ? in.Hq : in.Hkv;
    compare_scores(c, c.scores, scores_of(snap, input, rows, in.T, ProblemShape{in.Hq, rows, in.d, in.T, w}), in.T, st);
    REQUIRE(snap.kept_count(in.T) == (c.raw.at("compressed").get<bool>() ? *c.n_kept : in.T));
    compare_kept(c, c.kept, c.kept_ties, run_evict<backend::Cpu>(snap, input), 0, st);
    ++st.cases;
  }
}

TEST_CASE("fixtures: StreamingLLM (kvpress StreamingLLMPress)", "[fixtures][streaming_llm]") {
  Stats st{"streamingllm_kvpress"};
  for (const auto& c : kf::load_fixtures("streamingllm_kvpress")) {
    CaseInputs in(c);
    const StreamingLLM policy(
        StreamingLLMParams{c.param<int>("n_sink"), Budget::compression_ratio(c.param<double>("compression_ratio")).keep_at_least_one(), 0});
    REQUIRE(policy.kept_count(in.T) == *c.n_kept);
    compare_kept(c, c.kept, c.kept_ties, run_evict<backend::Cpu>(policy, in.window(1)), 0, st);
    ++st.cases;
  }
}

TEST_CASE("fixtures: Ada-KV (kvpress AdaKVPress over SnapKVPress)", "[fixtures][adakv]") {
  Stats st{"adakv_snapkv_kvpress"};
  for (const auto& c : kf::load_fixtures("adakv_snapkv_kvpress")) {
    CaseInputs in(c);
    const int w = c.param<int>("window_size");
    const double r = c.param<double>("compression_ratio");
    AdaKVParams p = AdaKVParams::kvpress(r, c.param<double>("alpha_safeguard"));
    p.budget = p.budget.keep_at_least_one();
    const SnapKV snap(SnapKVParams::kvpress(r, w, c.param<int>("kernel_size")));
    const AdaKV<SnapKV> ada(p, snap);
    const ProblemShape shape{in.Hq, in.Hkv, in.d, in.T, w};
    compare_scores(c, c.scores, scores_of(snap, in.window(w), in.Hkv, in.T, shape), in.T, st);
    REQUIRE(ada.kept_count(in.T) == *c.n_kept);
    const auto keep = run_ragged<backend::Cpu>(ada, std::vector{in.window(w)}, in.Hkv, shape);
    compare_kept(c, c.kept, c.kept_ties, keep, 0, st);
    REQUIRE(keep.indptr.back() == in.Hkv * *c.n_kept);
    ++st.cases;
  }
}

TEST_CASE("fixtures: Ada-KV (kvpress AdaKVPress over ExpectedAttentionPress)", "[fixtures][adakv][expected_attention]") {
  Stats st{"adakv_expected_attention_kvpress"};
  for (const auto& c : kf::load_fixtures("adakv_expected_attention_kvpress")) {
    CaseInputs in(c);
    const ExpectedAttention ea(ea_params(c));
    AdaKVParams p = AdaKVParams::kvpress(c.param<double>("compression_ratio"), c.param<double>("alpha_safeguard"));
    p.budget = p.budget.keep_at_least_one();
    const AdaKV<ExpectedAttention> ada(p, ea);
    const ProblemShape shape{in.Hq, in.Hkv, in.d, in.T, in.T};
    compare_scores(c, c.scores, scores_of(ea, in.prompt(), in.Hkv, in.T, shape), in.T, st);
    compare_kept(c, c.kept, c.kept_ties, run_ragged<backend::Cpu>(ada, std::vector{in.prompt()}, in.Hkv, shape), 0, st);
    ++st.cases;
  }
}

TEST_CASE("fixtures: Ada-KV original (FFY0/AdaKV, per query head and gqa_support)", "[fixtures][adakv]") {
  Stats st{"adakv_original"};
  for (const auto& c : kf::load_fixtures("adakv_original")) {
    CaseInputs in(c);
    const int w = c.param<int>("window_size"), C = c.param<int>("base_capacity");
    const bool gqa = c.param<bool>("gqa_support");
    // Layers below `skip` get the uniform budget B: alpha = 1 gives cap = int(B * 1) = B.
    const double alpha = c.param<int>("layer_idx") < c.param<int>("skip") ? 1.0 : c.param<double>("floor_alpha");
    const SnapKV snap(adakv_scoring(w, c.param<int>("kernel_size"), group_reduce_of(c.params["gqa_func"]), pooling_of(c)));
    const AdaKVParams p =
        gqa ? AdaKVParams::original_gqa(C, alpha, c.param<bool>("normalize")) : AdaKVParams::original(C, alpha, c.param<bool>("normalize"));
    const AdaKV<SnapKV> ada(p, snap);
    const std::int64_t rows = ada.rows_per_sequence(in.Hq, in.Hkv);
    // Scores at the fixture's granularity (per query head: the scorer on repeated keys).
    compare_scores(c, c.scores, scores_of(snap, in.window(w, !gqa), rows, in.T, ProblemShape{in.Hq, rows, in.d, in.T, w}), in.T, st);
    const auto keep = run_ragged<backend::Cpu>(ada, std::vector{in.window(w)}, rows, ProblemShape{in.Hq, in.Hkv, in.d, in.T, w});
    compare_kept(c, c.kept, c.kept_ties, keep, 0, st);
    const auto counts = c.raw.at("kept_counts").get<std::vector<int>>();
    for (std::int64_t r = 0; r < rows; ++r) REQUIRE(keep.row(r).size() == static_cast<std::size_t>(counts[r]));
    ++st.cases;
  }
}

TEST_CASE("fixtures: PyramidKV (kvpress PyramidKVPress): budget grid and kept sets per layer", "[fixtures][pyramidkv]") {
  Stats st{"pyramidkv_kvpress"};
  const kf::FixtureFile file = kf::load_fixture_file("pyramidkv_kvpress");
  long long grid = 0;
  for (const auto& g : file.raw.at("budget_grid")) {
    const auto budgets = g.at("budgets").get<std::vector<std::int64_t>>();
    for (std::size_t l = 0; l < budgets.size(); ++l) {
      PyramidBudget pb;
      REQUIRE(pyramid_budget_kvpress(g.at("T").get<std::int64_t>(), g.at("compression_ratio").get<double>(),
                                     g.at("window_size").get<std::int64_t>(), g.at("beta").get<std::int64_t>(),
                                     g.at("num_hidden_layers").get<std::int64_t>(), static_cast<std::int64_t>(l), true, &pb)
                  .is_ok());
      INFO("T " << g.at("T") << " r " << g.at("compression_ratio") << " layer " << l);
      REQUIRE(pb.total == budgets[l]);
      ++grid;
    }
  }
  for (const auto& c : file.cases) {
    CaseInputs in(c);
    const int w = c.param<int>("window_size");
    const ProblemShape shape{in.Hq, in.Hkv, in.d, in.T, w};
    for (const auto& layer : c.layers) {
      PyramidKVParams p = PyramidKVParams::kvpress(c.param<double>("compression_ratio"), layer.layer_idx, c.param<int>("num_hidden_layers"),
                                                   w, c.param<int>("kernel_size"), c.param<int>("beta"));
      p.schedule.budget = p.schedule.budget.keep_at_least_one();
      const PyramidKV pyr(p);
      if (&layer == &c.layers.front()) compare_scores(c, c.scores, scores_of(pyr, in.window(w), in.Hkv, in.T, shape), in.T, st);
      REQUIRE(pyr.kept_count(in.T) == layer.n_kept);
      compare_kept(c, layer.kept, layer.kept_ties, run_evict<backend::Cpu>(pyr, in.window(w)), 0, st);
    }
    ++st.cases;
  }
  std::printf("fixture pyramidkv_kvpress budget_grid: %lld layer budgets equal\n", grid);
}

TEST_CASE("fixtures: PyramidKV (KVCache-Factory): schedule grid and kept sets per layer", "[fixtures][pyramidkv]") {
  Stats st{"pyramidkv_factory"};
  const kf::FixtureFile file = kf::load_fixture_file("pyramidkv_factory");
  long long grid = 0;
  for (const auto& g : file.raw.at("schedule_grid")) {
    const auto totals = g.at("totals").get<std::vector<std::int64_t>>();
    const std::string regime = g.at("regime").get<std::string>();
    for (std::size_t l = 0; l < totals.size(); ++l) {
      PyramidBudget pb;
      REQUIRE(pyramid_budget_factory(g.at("T").get<std::int64_t>(), g.at("max_capacity_prompt").get<std::int64_t>(),
                                     g.at("window_size").get<std::int64_t>(), g.at("beta").get<std::int64_t>(),
                                     g.at("num_hidden_layers").get<std::int64_t>(), static_cast<std::int64_t>(l), &pb)
                  .is_ok());
      INFO("T " << g.at("T") << " C " << g.at("max_capacity_prompt") << " layer " << l);
      REQUIRE(pb.total == totals[l]);
      REQUIRE(regime == (pb.regime == PyramidRegime::kNoCompression ? "none"
                         : pb.regime == PyramidRegime::kUniform     ? "uniform"
                                                                    : "pyramid"));
      ++grid;
    }
  }
  for (const auto& c : file.cases) {
    CaseInputs in(c);
    const int w = c.param<int>("window_size");
    const bool per_q = c.param<std::string>("granularity") == "query_head";
    const auto input = in.window(w, per_q);
    const std::int64_t rows = per_q ? in.Hq : in.Hkv;
    for (const auto& layer : c.layers) {
      PyramidKVParams p = PyramidKVParams::original(c.param<int>("max_capacity_prompt"), layer.layer_idx, c.param<int>("num_hidden_layers"),
                                                    w, c.param<int>("kernel_size"), pooling_of(c), c.param<int>("beta"));
      p.scoring.group_reduce = group_reduce_of(c.params["gqa_agg"]);
      const PyramidKV pyr(p);
      if (&layer == &c.layers.front())
        compare_scores(c, c.scores, scores_of(pyr, input, rows, in.T, ProblemShape{in.Hq, rows, in.d, in.T, w}), in.T, st);
      REQUIRE(pyr.kept_count(in.T) == layer.n_kept);
      compare_kept(c, layer.kept, layer.kept_ties, run_evict<backend::Cpu>(pyr, input), 0, st);
    }
    ++st.cases;
  }
  std::printf("fixture pyramidkv_factory schedule_grid: %lld layer budgets and regimes equal\n", grid);
}

TEST_CASE("fixtures: Expected Attention (kvpress ExpectedAttentionPress)", "[fixtures][expected_attention]") {
  Stats st{"expected_attention_kvpress"};
  for (const auto& c : kf::load_fixtures("expected_attention_kvpress")) {
    CaseInputs in(c);
    const ExpectedAttention ea(ea_params(c));
    const ProblemShape shape{in.Hq, in.Hkv, in.d, in.T, in.T};
    compare_scores(c, c.scores, scores_of(ea, in.prompt(), in.Hkv, in.T, shape), in.T, st);
    REQUIRE(ea.kept_count(in.T) == *c.n_kept);
    compare_kept(c, c.kept, c.kept_ties, run_ragged<backend::Cpu>(ea, std::vector{in.prompt()}, in.Hkv, shape), 0, st);
    ++st.cases;
  }
}

TEST_CASE("fixtures: LAQ stage 2 (Lookahead_Q-Cache update_kv_LAQ, reference and corrected masks)", "[fixtures][laq]") {
  Stats st{"laq_original"};
  for (const auto& c : kf::load_fixtures("laq_original")) {
    INFO("case " << c.id);
    const std::int64_t Hq = c.num_q_heads, Hkv = c.num_kv_heads, Ttot = c.seq_len, d = c.head_dim;
    const int T = c.param<int>("prompt_len"), n = c.param<int>("lookahead"), W2 = c.param<int>("window");
    const bool per_q = c.param<std::string>("granularity") == "query_head";
    const std::vector<float> q = c.queries(), k = c.keys();
    // Per query head: the keys repeated to every query head (the reference's repeat_kv).
    const std::int64_t G = Hq / Hkv, rows = per_q ? Hq : Hkv;
    std::vector<float> kk(rows * T * d);
    for (std::int64_t h = 0; h < rows; ++h) std::copy_n(k.begin() + (per_q ? h / G : h) * Ttot * d, T * d, kk.begin() + h * T * d);
    ScoreInput<float, float> in{TensorView<const float, 3>(q.data() + (T - W2) * d, {Hq, W2 + n, d}, {Ttot * d, d, 1}),
                                KVSource<float>::from(TensorView<const float, 3>::contiguous(kk.data(), {rows, T, d}))};
    in.lookahead = n;
    LAQParams p = LAQParams::laq(c.param<int>("max_capacity_prompt"));
    p.window = W2;
    p.lookahead = 8;
    p.mask = c.param<std::string>("mask") == "reference" ? LookaheadMask::kReference : LookaheadMask::kCorrected;
    const LAQ laq(p);
    REQUIRE(laq.kept_count(T) == *c.n_kept);
    if (c.raw.at("compressed").get<bool>())
      compare_scores(c, c.scores, scores_of(laq, in, rows, T, ProblemShape{Hq, rows, d, T, W2 + n}), T, st);
    compare_kept(c, c.kept, c.kept_ties, run_evict<backend::Cpu>(laq, in), 0, st);
    compare_kept(c, c.kept, c.kept_ties, run_evict<backend::Scalar>(laq, in), 0, st);
    ++st.cases;
  }
}
