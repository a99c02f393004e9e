// Helpers of the online-policy tests: a causal softmax "engine" that produces
// the attention probabilities an engine's kernel would return.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace online_test {

/// probs (Hq, q, n) of queries (Hq, q, d) against keys (Hkv, n, d) (rows of
/// `key_stride` elements, head stride `head_stride`), query i at slot n - q + i,
/// causal over slots, softmax in double, scale 1/sqrt(d), rounded to float.
inline std::vector<float> causal_probs(const std::vector<float>& q, std::int64_t Hq, std::int64_t qlen, std::int64_t d, const float* keys,
                                       std::int64_t Hkv, std::int64_t head_stride, std::int64_t n) {
  std::vector<float> p(static_cast<std::size_t>(Hq * qlen * n), 0.0f);
  const std::int64_t G = Hq / Hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> logit(static_cast<std::size_t>(n));
  for (std::int64_t h = 0; h < Hq; ++h)
    for (std::int64_t i = 0; i < qlen; ++i) {
      const std::int64_t vis = n - qlen + i + 1;
      double mx = -INFINITY;
      for (std::int64_t j = 0; j < vis; ++j) {
        double acc = 0;
        for (std::int64_t c = 0; c < d; ++c)
          acc += static_cast<double>(q[(h * qlen + i) * d + c]) * keys[(h / G) * head_stride + j * d + c];
        logit[j] = acc * scale;
        mx = std::max(mx, logit[j]);
      }
      double den = 0;
      for (std::int64_t j = 0; j < vis; ++j) den += std::exp(logit[j] - mx);
      for (std::int64_t j = 0; j < vis; ++j) p[(h * qlen + i) * n + j] = static_cast<float>(std::exp(logit[j] - mx) / den);
    }
  return p;
}

/// Token generator with a few heavy-hitter directions, so attention is peaky
/// and scores are far from tied.
struct TokenStream {
  std::int64_t Hq, Hkv, d;
  std::mt19937 rng;
  std::vector<float> dir;  // (d)
  TokenStream(std::int64_t hq, std::int64_t hkv, std::int64_t dd, unsigned seed) : Hq(hq), Hkv(hkv), d(dd), rng(seed), dir(dd) {
    std::normal_distribution<float> nd;
    for (auto& x : dir) x = nd(rng);
  }
  /// Keys of one token for every kv head (Hkv, d); every 7th-ish token is heavy.
  std::vector<float> key() {
    std::normal_distribution<float> nd;
    std::uniform_real_distribution<float> u;
    const float heavy = u(rng) < 0.15f ? 1.0f + u(rng) : 0.0f;
    std::vector<float> k(static_cast<std::size_t>(Hkv * d));
    for (std::int64_t h = 0; h < Hkv; ++h)
      for (std::int64_t c = 0; c < d; ++c) k[h * d + c] = 0.6f * nd(rng) + heavy * dir[c];
    return k;
  }
  /// Queries (Hq, qlen, d) biased towards the heavy direction.
  std::vector<float> queries(std::int64_t qlen) {
    std::normal_distribution<float> nd;
    std::vector<float> q(static_cast<std::size_t>(Hq * qlen * d));
    for (std::int64_t h = 0; h < Hq; ++h)
      for (std::int64_t i = 0; i < qlen; ++i)
        for (std::int64_t c = 0; c < d; ++c) q[(h * qlen + i) * d + c] = 0.8f * nd(rng) + 0.5f * dir[c];
    return q;
  }
};

}  // namespace online_test
