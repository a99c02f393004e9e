#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kvpolicy/ops/scalar.hpp"

using namespace kvpolicy;
using backend::Scalar;

TEST_CASE("pool1d: avg divides by the kernel at the edges, max ignores padding", "[ops]") {
  const std::vector<float> x{1, 2, 3, 4, 5};
  std::vector<float> y(5);
  Scalar::pool1d(x.data(), 5, 3, Pooling::kAvg, y.data());
  REQUIRE(y[0] == Approx(1.0));  // (0 + 1 + 2) / 3
  REQUIRE(y[2] == Approx(3.0));
  REQUIRE(y[4] == Approx(3.0));  // (4 + 5 + 0) / 3
  Scalar::pool1d(x.data(), 5, 5, Pooling::kMax, y.data());
  REQUIRE(y == std::vector<float>{3, 4, 5, 5, 5});
  const std::vector<float> neg{-5, -4, -3};
  Scalar::pool1d(neg.data(), 3, 3, Pooling::kMax, y.data());
  REQUIRE(y[0] == -4.0f);  // -inf padding never wins
  Scalar::pool1d(x.data(), 1, 7, Pooling::kAvg, y.data());
  REQUIRE(y[0] == Approx(1.0 / 7));
}

TEST_CASE("group_reduce: mean / max / sum over the group", "[ops]") {
  const std::vector<float> in{1, 5, 3, 2, 4, 9};  // (G=2, n=3)
  std::vector<float> out(3);
  Scalar::group_reduce(in.data(), 2, 3, 3, GroupReduce::kMean, out.data());
  REQUIRE(out == std::vector<float>{1.5f, 4.5f, 6.0f});
  Scalar::group_reduce(in.data(), 2, 3, 3, GroupReduce::kMax, out.data());
  REQUIRE(out == std::vector<float>{2, 5, 9});
  Scalar::group_reduce(in.data(), 2, 3, 3, GroupReduce::kSum, out.data());
  REQUIRE(out == std::vector<float>{3, 9, 12});
}

TEST_CASE("topk: ascending output, ties -> higher index, NaN lowest", "[ops]") {
  std::vector<std::byte> ws(Scalar::topk_workspace(16));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> s{1, 3, 3, nan, -inf, 3, 0, 2};
  std::vector<std::int32_t> out(8);
  Scalar::topk(s.data(), 8, 2, out.data(), Workspace{ws.data(), ws.size()});
  REQUIRE(std::vector<std::int32_t>(out.begin(), out.begin() + 2) == std::vector<std::int32_t>{2, 5});
  Scalar::topk(s.data(), 8, 7, out.data(), Workspace{ws.data(), ws.size()});
  REQUIRE(std::vector<std::int32_t>(out.begin(), out.begin() + 7) == std::vector<std::int32_t>{0, 1, 2, 4, 5, 6, 7});
  REQUIRE(score_order_key(-inf) > score_order_key(nan));
  REQUIRE(score_order_key(-0.0f) < score_order_key(0.0f));
}

TEST_CASE("window_scores: matches a double-precision softmax with causal offset", "[ops]") {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  const std::int64_t G = 2, w = 3, d = 8, T = 11;
  std::vector<float> q(G * w * d), k(T * d);
  for (auto& x : q) x = nd(rng);
  for (auto& x : k) x = nd(rng);
  for (WindowReduce red : {WindowReduce::kMean, WindowReduce::kSum}) {
    WindowScoreShape s{G, w, d, T, T - w, T - w, 0.35f, red};
    std::vector<float> out(G * s.num_cols);
    std::vector<std::byte> ws(Scalar::window_scores_workspace(s));
    Scalar::window_scores(s, q.data(), Rows<float>{k.data(), d}, out.data(), Workspace{ws.data(), ws.size()});
    for (std::int64_t g = 0; g < G; ++g) {
      std::vector<double> ref(T, 0.0);
      for (std::int64_t i = 0; i < w; ++i) {
        const std::int64_t vis = T - w + i + 1;
        std::vector<double> l(vis);
        double mx = -1e300, den = 0;
        for (std::int64_t j = 0; j < vis; ++j) {
          double a = 0;
          for (std::int64_t c = 0; c < d; ++c) a += double(q[(g * w + i) * d + c]) * k[j * d + c];
          l[j] = a * 0.35f;
          mx = std::max(mx, l[j]);
        }
        for (auto& v : l) den += std::exp(v - mx);
        for (std::int64_t j = 0; j < vis; ++j) ref[j] += std::exp(l[j] - mx) / den / (red == WindowReduce::kMean ? w : 1);
      }
      for (std::int64_t j = 0; j < s.num_cols; ++j) REQUIRE(out[g * s.num_cols + j] == Approx(ref[j]).epsilon(1e-5));
    }
  }
}

TEST_CASE("paged_decode_attention: NaN propagates to out and lse, empty and all -inf attend nothing", "[ops][nan]") {
  const std::int64_t d = 4, n = 6;
  std::vector<float> k(static_cast<std::size_t>(n * d)), v(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = 0.1f * static_cast<float>(i % 7), v[i] = static_cast<float>(i % 5);
  const Rows<float> keys{k.data(), d, nullptr, 0, 0}, vals{v.data(), d, nullptr, 0, 0};
  std::vector<std::byte> ws(Scalar::paged_attention_workspace(2, Scalar::attention_block(keys), d));
  const Workspace w{ws.data(), ws.size()};
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> q{1, 0, 0, 0, kNaN, 1, 1, 1}, out(8), lse(2);
  Scalar::paged_decode_attention(q.data(), 2, d, keys, vals, n, 1.0f, out.data(), lse.data(), w);
  REQUIRE(std::isfinite(lse[0]));
  for (int c = 0; c < 4; ++c) REQUIRE(std::isfinite(out[c]));
  REQUIRE(std::isnan(lse[1]));
  for (int c = 4; c < 8; ++c) REQUIRE(std::isnan(out[c]));
  // A NaN key in a later block than a finite max still reaches the result (blocks of 1 row via pages).
  std::vector<std::int32_t> pages{0, 1, 2, 3, 4, 5};
  k[static_cast<std::size_t>(4 * d + 2)] = kNaN;
  const Rows<float> pk{k.data(), 0, pages.data(), d, 1}, pv{v.data(), 0, pages.data(), d, 1};
  std::vector<std::byte> ws1(Scalar::paged_attention_workspace(1, 1, d));
  std::vector<float> q1{1, 1, 1, 1}, o1(4), l1(1);
  Scalar::paged_decode_attention(q1.data(), 1, d, pk, pv, n, 1.0f, o1.data(), l1.data(), Workspace{ws1.data(), ws1.size()});
  REQUIRE(std::isnan(l1[0]));
  for (float x : o1) REQUIRE(std::isnan(x));
  // No tokens: 0 and -inf, as documented.
  Scalar::paged_decode_attention(q1.data(), 1, d, pk, pv, 0, 1.0f, o1.data(), l1.data(), Workspace{ws1.data(), ws1.size()});
  REQUIRE(l1[0] == -std::numeric_limits<float>::infinity());
  for (float x : o1) REQUIRE(x == 0.0f);
}
