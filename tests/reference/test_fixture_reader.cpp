// SPDX-License-Identifier: Apache-2.0
// Self-test of the fixture harness: the C++ generator reproduces the Python one bit for bit (drift check), every
// fixture file parses into consistent cases, and one policy recomputed here from the regenerated inputs matches the
// stored float64 scores (which proves the layout conventions, not just the checksums).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "reference/fixture_reader.hpp"

namespace kf = kvp_fixtures;

TEST_CASE("fixture_rng: splitmix64 and the kvp-fixture-v1 recipe", "[reference]") {
  // splitmix64's well-known first output for state 0.
  CHECK(kf::splitmix64(0) == 0xE220A8397B1DCDAFull);
  // Values printed by fixture_rng.py for seed 1 (keys (2, 5, 4), queries (4, 5, 4) with 2 kv heads, values (2, 5, 4)).
  const std::vector<float> k = kf::gen_keys(1, 2, 5, 4);
  REQUIRE(k.size() == 40);
  CHECK(k[0] == 1.1274356842041016f);
  CHECK(k[1] == 0.7215089797973633f);
  CHECK(k[7] == -1.4123353958129883f);
  const kf::TensorChecksum c = kf::checksum(k);
  CHECK(c.sum == 0.3382904529571533);
  CHECK(c.bits_checksum == 0x000002fe146e8880ull);
  // A token slice hashes the same indices as the full tensor.
  const std::vector<float> q = kf::gen_queries(7, 8, 2, 33, 16);
  const std::vector<float> q_tail = kf::gen_queries(7, 8, 2, 33, 16, 30, 33);
  for (int h = 0; h < 8; ++h)
    for (int t = 30; t < 33; ++t)
      for (int d = 0; d < 16; ++d)
        REQUIRE(q_tail[(static_cast<std::size_t>(h) * 3 + (t - 30)) * 16 + d] == q[(static_cast<std::size_t>(h) * 33 + t) * 16 + d]);
  // Every value is an exact dyadic rational: |x| < 8 and x * 2^22 is an integer.
  for (const float x : kf::gen_values(3, 4, 50, 64)) {
    REQUIRE(std::fabs(x) < 8.0f);
    const double scaled = std::ldexp(static_cast<double>(x), 22);
    REQUIRE(scaled == std::floor(scaled));
  }
}

TEST_CASE("fixture_reader: every file loads and its inputs match the Python generator", "[reference]") {
  constexpr std::size_t kFullCheckElements = std::size_t{1} << 19;
  for (const std::string& name : kf::fixture_names()) {
    INFO("fixture " << name);
    const kf::FixtureFile file = kf::load_fixture_file(name);
    CHECK(file.policy == name);
    CHECK(file.cases.size() >= 20);
    CHECK(file.conventions.contains("layout"));
    std::size_t full_checks = 0;
    for (const kf::FixtureCase& c : file.cases) {
      INFO("case " << c.id << " seed " << c.seed);
      REQUIRE(c.num_q_heads % c.num_kv_heads == 0);
      REQUIRE(c.queries_info.heads == c.num_q_heads);
      REQUIRE(c.keys_info.heads == c.num_kv_heads);
      REQUIRE(c.keys_info.tokens == c.seq_len);
      // First values of every tensor from a one-token slice (cheap for every case).
      const std::vector<float> q0 = c.queries(0, 1), k0 = c.keys(0, 1), v0 = c.values(0, 1);
      for (std::size_t i = 0; i < c.queries_info.first.size(); ++i) CHECK(q0[i] == c.queries_info.first[i]);
      for (std::size_t i = 0; i < c.keys_info.first.size(); ++i) CHECK(k0[i] == c.keys_info.first[i]);
      for (std::size_t i = 0; i < c.values_info.first.size(); ++i) CHECK(v0[i] == c.values_info.first[i]);
      // Whole-tensor sum and checksum for the smaller cases and the first case of each file.
      const std::size_t elems = static_cast<std::size_t>(c.num_q_heads) * c.seq_len * c.head_dim;
      if (elems <= kFullCheckElements || &c == &file.cases.front()) {
        CHECK(kf::check_inputs(c).empty());
        ++full_checks;
      }
    }
    CHECK(full_checks >= 10);
  }
}

namespace {

void check_set(const kf::TokenList& s, int universe) {
  REQUIRE(std::is_sorted(s.begin(), s.end()));
  REQUIRE(std::adjacent_find(s.begin(), s.end()) == s.end());
  if (!s.empty()) {
    REQUIRE(s.front() >= 0);
    REQUIRE(s.back() < universe);
  }
}

}  // namespace

TEST_CASE("fixture_reader: kept sets, scores and budgets are consistent", "[reference]") {
  for (const std::string& name : kf::fixture_names()) {
    INFO("fixture " << name);
    const bool is_kvpress = name.find("_kvpress") != std::string::npos;
    for (const kf::FixtureCase& c : kf::load_fixtures(name)) {
      INFO("case " << c.id);
      const int heads = c.score_granularity == "query_head" ? c.num_q_heads : c.num_kv_heads;
      if (!c.kept.empty()) {
        REQUIRE(static_cast<int>(c.kept.size()) == heads);
        for (const auto& s : c.kept) check_set(s, c.seq_len);
      }
      if (!c.scores.tokens.empty()) {
        REQUIRE(static_cast<int>(c.scores.tokens.size()) == heads);
        for (std::size_t h = 0; h < c.scores.tokens.size(); ++h) {
          REQUIRE(c.scores.tokens[h].size() == c.scores.value[h].size());
          check_set(c.scores.tokens[h], c.seq_len);
          for (std::size_t i = 0; i < c.scores.tokens[h].size(); ++i)
            if (c.scores.pad_value && c.scores.is_protected(c.scores.tokens[h][i])) CHECK(c.scores.value[h][i] == *c.scores.pad_value);
        }
      }
      if (is_kvpress && c.has_param("compression_ratio") && name != "pyramidkv_kvpress") {
        const int n_kept = kf::kvpress_n_kept(c.seq_len, c.param<double>("compression_ratio"));
        REQUIRE(c.n_kept);
        CHECK(*c.n_kept == n_kept);
        if (c.raw.contains("kept_counts")) {  // AdaKV: ragged, but the total is exact
          long long total = 0;
          for (const auto& s : c.kept) total += static_cast<long long>(s.size());
          CHECK(total == static_cast<long long>(n_kept) * c.num_kv_heads);
        } else {
          for (const auto& s : c.kept) CHECK(static_cast<int>(s.size()) == n_kept);
        }
      }
      for (const auto& l : c.layers) {
        REQUIRE(static_cast<int>(l.kept.size()) == heads);
        for (const auto& s : l.kept) {
          check_set(s, c.seq_len);
          CHECK(static_cast<int>(s.size()) == l.n_kept);
        }
      }
      for (std::size_t h = 0; h < c.kept_ties.size(); ++h) {
        if (!c.kept_ties[h]) continue;
        const kf::Ties& t = *c.kept_ties[h];
        check_set(t.tied, c.seq_len);
        const auto in_kept = std::count_if(t.tied.begin(), t.tied.end(),
                                           [&](std::int32_t x) { return std::binary_search(c.kept[h].begin(), c.kept[h].end(), x); });
        CHECK(in_kept == t.n_tied_kept);
      }
      for (const auto& s : c.steps) {
        for (const auto& k : s.kept) check_set(k, s.n_seen);
      }
    }
  }
}

TEST_CASE("fixture_reader: kvpress budget rounding and StreamingLLM sets from their formulas", "[reference]") {
  CHECK(kf::kvpress_n_kept(1000, 0.8) == 199);
  CHECK(kf::kvpress_n_kept(100, 0.9) == 9);
  CHECK(kf::kvpress_n_kept(90, 0.3) == 62);
  for (const kf::FixtureCase& c : kf::load_fixtures("streamingllm_kvpress")) {
    INFO("case " << c.id);
    const int T = c.seq_len;
    const int n_sink = c.param<int>("n_sink");
    const double r = c.param<double>("compression_ratio");
    const int n_pruned = T - static_cast<int>(static_cast<double>(T) * (1.0 - r));
    kf::TokenList expect;
    for (int t = 0; t < T; ++t)
      if (t < n_sink || t >= n_sink + n_pruned) expect.push_back(t);
    for (const auto& s : c.kept) CHECK(s == expect);
  }
}

TEST_CASE("fixture_reader: SnapKV (kvpress) scores recomputed from the regenerated inputs", "[reference]") {
  // mean over the window queries of the causal window attention, avg-pool (divisor K), mean over the group.
  int checked = 0;
  for (const kf::FixtureCase& c : kf::load_fixtures("snapkv_kvpress")) {
    if (c.seq_len > 300) continue;
    INFO("case " << c.id);
    const int T = c.seq_len, d = c.head_dim, G = c.group();
    const int w = c.param<int>("window_size"), K = c.param<int>("kernel_size");
    const int L = T - w;
    const std::vector<float> q = c.queries(T - w, T), k = c.keys();
    std::vector<double> pooled(static_cast<std::size_t>(c.num_q_heads) * L, 0.0);
    for (int h = 0; h < c.num_q_heads; ++h) {
      std::vector<double> s(L, 0.0), logits(T);
      for (int i = 0; i < w; ++i) {
        const int visible = T - w + i + 1;
        double mx = -INFINITY;
        for (int j = 0; j < visible; ++j) {
          double dot = 0.0;
          for (int e = 0; e < d; ++e)
            dot += static_cast<double>(q[(static_cast<std::size_t>(h) * w + i) * d + e]) *
                   static_cast<double>(k[(static_cast<std::size_t>(h / G) * T + j) * d + e]);
          logits[j] = dot / std::sqrt(static_cast<double>(d));
          mx = std::max(mx, logits[j]);
        }
        double z = 0.0;
        for (int j = 0; j < visible; ++j) z += std::exp(logits[j] - mx);
        for (int j = 0; j < L; ++j) s[j] += std::exp(logits[j] - mx) / z / w;
      }
      for (int t = 0; t < L; ++t) {
        double acc = 0.0;
        for (int u = t - K / 2; u <= t + K / 2; ++u)
          if (u >= 0 && u < L) acc += s[u];
        pooled[static_cast<std::size_t>(h) * L + t] = acc / K;
      }
    }
    for (int g = 0; g < c.num_kv_heads; ++g) {
      for (std::size_t i = 0; i < c.scores.tokens[g].size(); ++i) {
        const int t = c.scores.tokens[g][i];
        if (t >= L) continue;
        double mean = 0.0;
        for (int m = 0; m < G; ++m) mean += pooled[static_cast<std::size_t>(g * G + m) * L + t];
        mean /= G;
        CHECK(mean == Approx(c.scores.value_fp64[g][i]).epsilon(1e-10));
        CHECK(mean == Approx(c.scores.value[g][i]).epsilon(1e-5));
      }
    }
    ++checked;
  }
  CHECK(checked >= 8);
}
