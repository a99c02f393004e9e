// Expected Attention: the §11 golden vector, a dense double-precision reference,
// statistics input, RoPE options, every backend, bad input.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/eviction/expected_attention.hpp"
#include "kvpolicy/util/thread_pool.hpp"
#include "scoring_test_util.hpp"

using namespace kvpolicy;
using Catch::Matchers::Contains;

namespace kvp_test {

/// Prompt queries (Hq, Tq, d), keys and values (Hkv, T, d), fp32 masters.
struct EACase {
  std::int64_t Hq, Hkv, T, Tq, d;
  std::vector<float> q, k, v;
  mutable std::vector<float> strided_k;
  mutable std::vector<float> pool;
  mutable std::vector<std::int32_t> indptr, indices, last;
  mutable PagedKVView<const float> paged{};
  mutable std::vector<float> pv_k, pv_v;
  mutable std::vector<std::int32_t> pv_indptr, pv_indices, pv_last;
  mutable PagedKVView<const float> pv{};

  EACase(std::int64_t hq, std::int64_t hkv, std::int64_t t, std::int64_t dd, unsigned seed)
      : Hq(hq), Hkv(hkv), T(t), Tq(t), d(dd), q(hq * t * dd), k(hkv * t * dd), v(hkv * t * dd) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    for (auto& x : q) x = nd(rng) + 0.3f;  // non-zero mean so the first-order term matters
    for (auto& x : k) x = nd(rng) * 0.6f;
    for (auto& x : v) x = nd(rng);
  }
  ExpectedAttentionInput<float, float> input() const {
    ExpectedAttentionInput<float, float> in;
    in.queries = TensorView<const float, 3>::contiguous(q.data(), {Hq, Tq, d});
    in.keys = KVSource<float>::from(TensorView<const float, 3>::contiguous(k.data(), {Hkv, T, d}));
    in.values = KVSource<float>::from(TensorView<const float, 3>::contiguous(v.data(), {Hkv, T, d}));
    return in;
  }
  /// Keys token-major with padding; values in a paged pool (NHD, shuffled pages).
  ExpectedAttentionInput<float, float> strided_paged_input(std::int32_t ps) const {
    auto in = input();
    const std::int64_t dp = d + 4;
    strided_k.assign((T + 3) * Hkv * dp, 1e6f);
    for (std::int64_t h = 0; h < Hkv; ++h)
      for (std::int64_t t = 0; t < T; ++t)
        for (std::int64_t c = 0; c < d; ++c) strided_k[(t * Hkv + h) * dp + c] = k[(h * T + t) * d + c];
    in.keys = KVSource<float>::from(TensorView<const float, 3>(strided_k.data(), {Hkv, T, d}, {dp, Hkv * dp, 1}));
    const std::int32_t pages = static_cast<std::int32_t>((T + ps - 1) / ps), pool_pages = pages + 2;
    const PageStrides st = PageStrides::contiguous(PageLayout::kNHD, Hkv, ps, d);
    pool.assign(static_cast<std::size_t>(pool_pages) * st.page, -1e6f);
    indices.resize(pages);
    for (std::int32_t i = 0; i < pages; ++i) indices[i] = pool_pages - 1 - i;  // pages in reverse order, spares in front
    indptr = {0, pages};
    last = {static_cast<std::int32_t>(T - static_cast<std::int64_t>(pages - 1) * ps)};
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t h = 0; h < Hkv; ++h)
        for (std::int64_t c = 0; c < d; ++c)
          pool[indices[t / ps] * st.page + (t % ps) * st.slot + h * st.head + c] = v[(h * T + t) * d + c];
    paged = PagedKVView<const float>{pool.data(),
                                     pool.data(),
                                     st,
                                     st,
                                     pool_pages,
                                     static_cast<std::int32_t>(Hkv),
                                     ps,
                                     static_cast<std::int32_t>(d),
                                     PageTable{indptr.data(), indices.data(), last.data(), 1},
                                     kHost};
    in.values = KVSource<float>::from_paged_values(paged, 0);
    return in;
  }
  /// Dense keys; values in an HND page pool (shuffled pages, spares) whose key half
  /// is a separate pool holding other data (the keys, times 3): reading the wrong
  /// half of the cache would change the value norms.
  ExpectedAttentionInput<float, float> paged_values_input(std::int32_t ps) const {
    auto in = input();
    const std::int32_t pages = static_cast<std::int32_t>((T + ps - 1) / ps), pool_pages = pages + 3;
    const PageStrides st = PageStrides::contiguous(PageLayout::kHND, Hkv, ps, d);
    pv_k.assign(static_cast<std::size_t>(pool_pages) * st.page, 0.5f);
    pv_v.assign(static_cast<std::size_t>(pool_pages) * st.page, std::nanf(""));  // unwritten slots would show
    std::vector<std::int32_t> perm(pool_pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), std::mt19937(static_cast<unsigned>(T + ps)));
    pv_indices.assign(perm.begin(), perm.begin() + pages);
    pv_indptr = {0, pages};
    pv_last = {static_cast<std::int32_t>(T - static_cast<std::int64_t>(pages - 1) * ps)};
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t h = 0; h < Hkv; ++h)
        for (std::int64_t c = 0; c < d; ++c) {
          const std::int64_t off = pv_indices[t / ps] * st.page + (t % ps) * st.slot + h * st.head + c;
          pv_v[off] = v[(h * T + t) * d + c];
          pv_k[off] = 3.0f * k[(h * T + t) * d + c];
        }
    pv = PagedKVView<const float>{pv_k.data(),
                                  pv_v.data(),
                                  st,
                                  st,
                                  pool_pages,
                                  static_cast<std::int32_t>(Hkv),
                                  ps,
                                  static_cast<std::int32_t>(d),
                                  PageTable{pv_indptr.data(), pv_indices.data(), pv_last.data(), 1},
                                  kHost};
    in.values = KVSource<float>::from_paged_values(pv, 0);
    return in;
  }
};

/// Dense double-precision transcription of kvpress ExpectedAttentionPress.score
/// (same fp32 angle recipe as HF's rotary embedding), sinks = +inf.
std::vector<double> reference_scores(const EACase& c, const ExpectedAttentionParams& p) {
  const std::int64_t d = c.d, h = d / 2, G = c.Hq / c.Hkv, n0 = p.n_sink, T = c.T;
  std::vector<double> R(d * d, 0.0), cb(d, 0.0), sb(d, 0.0);
  for (std::int64_t i = 0; i < d; ++i) {
    const float inv = p.rope.inv_freq
                          ? p.rope.inv_freq[i % h]
                          : 1.0f / std::pow(static_cast<float>(p.rope.base), static_cast<float>(2 * (i % h)) / static_cast<float>(d));
    for (std::int64_t pos = T; pos < T + p.n_future_positions; ++pos) {
      volatile float a = inv * static_cast<float>(pos);
      volatile float cs = static_cast<float>(std::cos(static_cast<double>(a))) * p.rope.attention_scaling;
      volatile float sn = static_cast<float>(std::sin(static_cast<double>(a))) * p.rope.attention_scaling;
      cb[i] += cs;
      sb[i] += sn;
    }
    cb[i] /= p.n_future_positions;
    sb[i] /= p.n_future_positions;
  }
  for (std::int64_t i = 0; i < d; ++i) {
    R[i * d + i] = cb[i];
    if (i < h)
      R[i * d + i + h] = -sb[i + h];
    else
      R[i * d + i - h] = sb[i - h];
  }
  std::vector<double> out(c.Hkv * T, 0.0);
  for (std::int64_t q = 0; q < c.Hq; ++q) {
    const std::int64_t g = q / G, N = c.Tq - n0;
    std::vector<double> mu(d, 0.0), cov(d * d, 0.0), mur(d, 0.0), tmp(d * d, 0.0), covr(d * d, 0.0);
    for (std::int64_t t = n0; t < c.Tq; ++t)
      for (std::int64_t i = 0; i < d; ++i) mu[i] += c.q[(q * c.Tq + t) * d + i] / static_cast<double>(N);
    for (std::int64_t t = n0; t < c.Tq; ++t)
      for (std::int64_t i = 0; i < d; ++i)
        for (std::int64_t j = 0; j < d; ++j)
          cov[i * d + j] += (c.q[(q * c.Tq + t) * d + i] - mu[i]) * (c.q[(q * c.Tq + t) * d + j] - mu[j]) / static_cast<double>(N);
    for (std::int64_t i = 0; i < d; ++i)
      for (std::int64_t j = 0; j < d; ++j)
        for (std::int64_t k = 0; k < d; ++k) tmp[i * d + j] += R[i * d + k] * cov[k * d + j];
    for (std::int64_t i = 0; i < d; ++i) {
      for (std::int64_t k = 0; k < d; ++k) mur[i] += R[i * d + k] * mu[k];
      for (std::int64_t j = 0; j < d; ++j)
        for (std::int64_t k = 0; k < d; ++k) covr[i * d + j] += tmp[i * d + k] * R[j * d + k];
    }
    std::vector<double> z(T, 0.0);
    double mx = -INFINITY;
    for (std::int64_t j = n0; j < T; ++j) {
      const float* kr = &c.k[(g * T + j) * d];
      double dot = 0, quad = 0;
      for (std::int64_t i = 0; i < d; ++i) dot += mur[i] * kr[i];
      for (std::int64_t i = 0; i < d; ++i)
        for (std::int64_t m = 0; m < d; ++m) quad += kr[i] * covr[i * d + m] * kr[m];
      z[j] = dot / std::sqrt(static_cast<double>(d)) + (p.use_covariance ? quad / d / 2 : 0.0);
      mx = std::max(mx, z[j]);
    }
    double den = 0;
    for (std::int64_t j = n0; j < T; ++j) den += std::exp(z[j] - mx);
    for (std::int64_t j = n0; j < T; ++j) out[g * T + j] += std::exp(z[j] - mx) / den / static_cast<double>(G);
  }
  for (std::int64_t g = 0; g < c.Hkv; ++g)
    for (std::int64_t j = 0; j < T; ++j) {
      if (j < n0) {
        out[g * T + j] = INFINITY;
        continue;
      }
      if (p.use_vnorm) {
        double ss = 0;
        for (std::int64_t i = 0; i < d; ++i) ss += static_cast<double>(c.v[(g * T + j) * d + i]) * c.v[(g * T + j) * d + i];
        out[g * T + j] = (out[g * T + j] + p.epsilon) * std::sqrt(ss);
      }
    }
  return out;
}

std::vector<float> ea_scores(const ExpectedAttention& ea, const ExpectedAttentionInput<float, float>& in, std::int64_t Hq, std::int64_t Hkv,
                             std::int64_t T, std::int64_t d, const ExecContext& ctx = {}) {
  std::vector<float> s(Hkv * T, -7.0f);
  const Requirements req = ea.requirements(Context<backend::Scalar>{{}, ctx}, ProblemShape{Hq, Hkv, d, T, in.queries.extent(1)});
  INFO(req.status.message());
  REQUIRE(req.status.is_ok());
  std::vector<std::byte> ws(req.workspace_bytes);
  const Status st =
      ea.score(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}, ctx}, in, TensorView<float, 2>::contiguous(s.data(), {Hkv, T}));
  INFO(st.message());
  REQUIRE(st.is_ok());
  return s;
}

template <class Backend>
KeepSetBuffer ea_evict(const ExpectedAttention& ea, const ExpectedAttentionInput<float, float>& in, const ExecContext& ctx = {}) {
  const ProblemShape shape{in.queries.extent(0), in.keys.kv_heads(), in.keys.head_dim(), in.keys.kv_len(), in.queries.extent(1)};
  return run_ragged<Backend>(ea, std::vector{in}, shape.num_kv_heads, shape, ctx);
}

}  // namespace kvp_test

TEST_CASE("expected attention: golden vector of reference §11 (n_future=4, n_sink=2, r=0.5)", "[expected_attention][golden]") {
  using namespace golden;
  std::vector<float> qpre(kHq * kT * kD), v(kHkv * kT * kD);
  for (int h = 0; h < kHq; ++h)
    for (int t = 0; t < kT; ++t)
      for (int c = 0; c < kD; ++c) qpre[(h * kT + t) * kD + c] = static_cast<float>(std::sin(0.25 * (h + 1) * (t + 1) - 0.4 * c));
  for (int g = 0; g < kHkv; ++g)
    for (int t = 0; t < kT; ++t)
      for (int c = 0; c < kD; ++c) v[(g * kT + t) * kD + c] = static_cast<float>(std::sin(0.2 * (g + 1) * (t + 1) + 0.9 * c) + 1.5);
  const auto kd = golden::keys();
  const std::vector<float> k(kd.begin(), kd.end());
  // The aggregate form: {{queries, keys, values}, query_mean, query_cov, next_position}.
  const ExpectedAttentionInput<float, float> in{{TensorView<const float, 3>::contiguous(qpre.data(), {kHq, kT, kD}),
                                                 KVSource<float>::from(TensorView<const float, 3>::contiguous(k.data(), {kHkv, kT, kD})),
                                                 KVSource<float>::from(TensorView<const float, 3>::contiguous(v.data(), {kHkv, kT, kD}))},
                                                {},
                                                {},
                                                -1};
  const ExpectedAttention ea(ExpectedAttentionParams::kvpress(0.5, 4, 2));
  const double expect[2][12] = {{1.5267607596, 1.5267607596, 0.3256754954, 0.3214761585, 0.3434124955, 0.3562943172, 0.334817277,
                                 0.2790828787, 0.2600226625, 0.3444271409, 0.5267607596, 0.3404162507},
                                {1.5267607596, 1.5267607596, 0.395012741, 0.3314230975, 0.3063121061, 0.2619584812, 0.2113299292,
                                 0.187134118, 0.1875310504, 0.2633950249, 0.3543833242, 0.3002442649}};
  const auto s = ea_scores(ea, in, kHq, kHkv, kT, kD);
  for (int g = 0; g < 2; ++g) {
    REQUIRE(std::isinf(s[g * kT]));  // kvpress pads sinks with max + 1 = 1.5267607596; ours are +inf
    REQUIRE(std::isinf(s[g * kT + 1]));
    for (int j = 2; j < kT; ++j) REQUIRE(s[g * kT + j] == Approx(expect[g][j]).epsilon(1e-6));
  }
  for (const auto& keep : {ea_evict<backend::Scalar>(ea, in), ea_evict<backend::Cpu>(ea, in)}) {
    REQUIRE(keep.row(0) == std::vector<std::int32_t>{0, 1, 4, 5, 9, 10});
    REQUIRE(keep.row(1) == std::vector<std::int32_t>{0, 1, 2, 3, 4, 10});
  }
}

TEST_CASE("expected attention: equals a dense double-precision transcription (GQA, covariance, vnorm, epsilon)",
          "[expected_attention][reference]") {
  for (int G : {1, 2, 4}) {
    for (int d : {4, 16, 32}) {
      EACase c(2 * G, 2, 150, d, 10 * G + d);
      for (bool cov : {true, false}) {
        for (bool vn : {true, false}) {
          auto p = ExpectedAttentionParams::kvpress(0.5, 16, 3, cov, vn, vn ? 0.01f : 0.0f);
          const auto ref = reference_scores(c, p);
          const auto s = ea_scores(ExpectedAttention(p), c.input(), c.Hq, c.Hkv, c.T, d);
          for (std::size_t i = 0; i < s.size(); ++i) {
            if (std::isinf(ref[i])) {
              REQUIRE(std::isinf(s[i]));
            } else {
              REQUIRE(s[i] == Approx(ref[i]).epsilon(2e-5).margin(1e-9));
            }
          }
        }
      }
    }
  }
}

TEST_CASE("expected attention: precomputed statistics, explicit inv_freq, attention scaling, next position", "[expected_attention]") {
  EACase c(8, 2, 200, 16, 3);
  const auto p = ExpectedAttentionParams::kvpress(0.5, 32, 4);
  const ExpectedAttention ea(p);
  const auto base = ea_scores(ea, c.input(), 8, 2, 200, 16);
  // Statistics computed outside (population covariance of queries[4:]) give the same scores.
  std::vector<float> mean(8 * 16), cov(8 * 16 * 16);
  for (int q = 0; q < 8; ++q) {
    std::vector<double> mu(16, 0.0);
    for (int t = 4; t < 200; ++t)
      for (int i = 0; i < 16; ++i) mu[i] += c.q[(q * 200 + t) * 16 + i] / 196.0;
    for (int i = 0; i < 16; ++i) mean[q * 16 + i] = static_cast<float>(mu[i]);
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 16; ++j) {
        double acc = 0;
        for (int t = 4; t < 200; ++t) acc += (c.q[(q * 200 + t) * 16 + i] - mu[i]) * (c.q[(q * 200 + t) * 16 + j] - mu[j]);
        cov[(q * 16 + i) * 16 + j] = static_cast<float>(acc / 196.0);
      }
  }
  auto stats_in = c.input();
  stats_in.queries = {};
  stats_in.query_mean = TensorView<const float, 2>::contiguous(mean.data(), {8, 16});
  stats_in.query_cov = TensorView<const float, 3>::contiguous(cov.data(), {8, 16, 16});
  const auto from_stats = ea_scores(ea, stats_in, 8, 2, 200, 16);
  for (std::size_t i = 0; i < base.size(); ++i) {
    if (std::isinf(base[i]))
      REQUIRE(std::isinf(from_stats[i]));
    else
      REQUIRE(from_stats[i] == Approx(base[i]).epsilon(1e-5));
  }
  // The default frequencies passed explicitly give bit-identical scores.
  std::vector<float> inv(8);
  for (int i = 0; i < 8; ++i) inv[i] = 1.0f / std::pow(10000.0f, static_cast<float>(2 * i) / 16.0f);
  auto pe = p;
  pe.rope.inv_freq = inv.data();
  REQUIRE(ea_scores(ExpectedAttention(pe), c.input(), 8, 2, 200, 16) == base);
  // next_position = kv_len is the default.
  auto in = c.input();
  in.next_position = 200;
  REQUIRE(ea_scores(ea, in, 8, 2, 200, 16) == base);
  in.next_position = 5000;
  const auto far = ea_scores(ea, in, 8, 2, 200, 16);
  REQUIRE(far != base);
  // A float64 rotary table (fp64_angles) differs from HF's fp32 angles only by their rounding at large positions.
  auto p64 = p;
  p64.rope.fp64_angles = true;
  const auto far64 = ea_scores(ExpectedAttention(p64), in, 8, 2, 200, 16);
  REQUIRE(far64 != far);
  for (std::size_t i = 0; i < far.size(); ++i)
    if (!std::isinf(far[i])) REQUIRE(far64[i] == Approx(far[i]).epsilon(1e-3));
  const auto near64 = ea_scores(ExpectedAttention(p64), c.input(), 8, 2, 200, 16);
  for (std::size_t i = 0; i < base.size(); ++i)
    if (!std::isinf(base[i])) REQUIRE(near64[i] == Approx(base[i]).epsilon(1e-5));
  // attention_scaling s multiplies cos and sin: the same as queries scaled by s.
  auto ps = p;
  ps.rope.attention_scaling = 1.25f;
  EACase scaled = c;
  for (auto& x : scaled.q) x *= 1.25f;
  const auto a = ea_scores(ExpectedAttention(ps), c.input(), 8, 2, 200, 16);
  const auto b = ea_scores(ea, scaled.input(), 8, 2, 200, 16);
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!std::isinf(a[i])) REQUIRE(a[i] == Approx(b[i]).epsilon(1e-4));
}

TEST_CASE("expected attention: every backend equals the scalar reference (GQA 1/2/4/8, lengths, strided + paged, threads)",
          "[expected_attention][backends]") {
  for (int G : {1, 2, 4, 8}) {
    for (int T : {5, 7, 100, 1000, 4099}) {
      EACase c(2 * G, 2, T, 32, 17 * G + T);
      for (double r : {0.3, 0.9}) {
        const ExpectedAttention ea(ExpectedAttentionParams::kvpress(r, 64, 4));
        const auto ref = ea_evict<backend::Scalar>(ea, c.input());
        require_valid_rows(ref, 2, T);
        for (int h = 0; h < 2; ++h) REQUIRE(static_cast<std::int64_t>(ref.row(h).size()) == kvpress_n_kept(T, r));
        REQUIRE(ea_evict<backend::Cpu>(ea, c.input()) == ref);
        REQUIRE(ea_evict<backend::Cpu>(ea, c.strided_paged_input(16)) == ref);
        ThreadPool pool(2);
        REQUIRE(ea_evict<backend::Cpu>(ea, c.input(), pool.context()) == ref);
      }
    }
  }
}

TEST_CASE(
    "expected attention: paged values through KVSource::from_paged_values score as the dense values, and a keys-role source is rejected",
    "[expected_attention][paged]") {
  unsigned seed = 500;
  for (int G : {1, 4}) {
    for (int T : {37, 300}) {
      for (std::int32_t ps : {1, 16}) {
        INFO("G " << G << " T " << T << " page_size " << ps);
        EACase c(2 * G, 2, T, 32, seed++);
        const ExpectedAttention ea(ExpectedAttentionParams::kvpress(0.5, 64, 4, true, true, 1e-3f));
        const auto dense_in = c.input();
        auto in = c.paged_values_input(ps);
        REQUIRE(in.values.paged != nullptr);
        REQUIRE(in.values.role == KVRole::kValues);
        // Value rows of the source are the value pool's rows.
        for (std::int64_t h = 0; h < 2; ++h)
          for (std::int64_t t : {std::int64_t{0}, std::int64_t{T / 2}, std::int64_t{T - 1}})
            REQUIRE(in.values.rows(h).row(t)[5] == c.v[(h * T + t) * 32 + 5]);
        const auto dense = ea_scores(ea, dense_in, c.Hq, c.Hkv, c.T, c.d);
        REQUIRE(ea_scores(ea, in, c.Hq, c.Hkv, c.T, c.d) == dense);  // bit-identical: the same rows, read in place
        const auto ref = ea_evict<backend::Scalar>(ea, dense_in);
        REQUIRE(ea_evict<backend::Scalar>(ea, in) == ref);
        REQUIRE(ea_evict<backend::Cpu>(ea, in) == ref);

        // The same pool given through KVSource::from_paged (which reads the KEYS) as values: rejected, nothing written.
        auto wrong = in;
        wrong.values = KVSource<float>::from_paged(c.pv, 0);
        REQUIRE(wrong.values.role == KVRole::kKeys);
        const ProblemShape shape{c.Hq, c.Hkv, c.d, c.T, c.Tq};
        const Requirements req = ea.requirements(Context<backend::Cpu>{}, shape);
        REQUIRE(req.status.is_ok());
        std::vector<std::byte> ws(req.workspace_bytes);
        const Context<backend::Cpu> cx{Workspace{ws.data(), ws.size()}};
        std::vector<float> scores(static_cast<std::size_t>(c.Hkv * c.T), -7.0f);
        const Status ss = ea.score(cx, wrong, TensorView<float, 2>::contiguous(scores.data(), {c.Hkv, c.T}));
        INFO(ss.message());
        REQUIRE(!ss.is_ok());
        REQUIRE_THAT(ss.message(), Contains("from_paged_values"));
        REQUIRE(std::all_of(scores.begin(), scores.end(), [](float x) { return x == -7.0f; }));
        KeepSetBuffer keep(req.output.rows, req.output.capacity);
        keep.fill_sentinel();
        const Status se = ea.evict(cx, wrong, keep.view());
        INFO(se.message());
        REQUIRE(!se.is_ok());
        REQUIRE_THAT(se.message(), Contains("from_paged_values"));
        REQUIRE(keep.untouched());
      }
    }
  }
}

TEST_CASE("expected attention: bad input gets a clear message and writes nothing", "[expected_attention][errors]") {
  EACase c(8, 2, 100, 16, 9);
  auto expect_error = [&](const ExpectedAttentionParams& p, ExpectedAttentionInput<float, float> in, const char* needle) {
    const ExpectedAttention ea(p);
    KeepSetBuffer keep(2, 200);
    keep.fill_sentinel();
    // An invalid policy reports 0 bytes: the call validates its inputs before the workspace.
    std::vector<std::byte> ws(ea.requirements(Context<backend::Cpu>{}, ProblemShape{8, 2, 16, 100, 100}).workspace_bytes);
    const Status s = ea.evict(Context<backend::Cpu>{Workspace{ws.data(), ws.size()}}, in, keep.view());
    INFO(needle);
    INFO(s.message());
    REQUIRE(!s.is_ok());
    REQUIRE_THAT(s.message(), Contains(needle));
    REQUIRE(keep.untouched());
  };
  const auto p = ExpectedAttentionParams::kvpress(0.5, 64, 4);
  const auto in = c.input();
  auto q = p;
  q.n_sink = 100;
  expect_error(q, in, "kv_len 100 must be larger than n_sink 100");
  q = p;
  q.n_future_positions = 0;
  expect_error(q, in, "n_future_positions is 0, must be in [1, 2^24)");
  q.n_future_positions = 1 << 24;  // #16.14: named itself, not blamed on next_position
  expect_error(q, in, "n_future_positions is 16777216, must be in [1, 2^24)");
  q = p;
  std::vector<float> inv_freq(static_cast<std::size_t>(in.keys.head_dim() / 2), 0.01f);
  inv_freq[3] = std::numeric_limits<float>::quiet_NaN();  // #16.15
  q.rope.inv_freq = inv_freq.data();
  expect_error(q, in, "rope.inv_freq[3] is nan, must be finite");
  q = p;
  q.epsilon = std::numeric_limits<float>::quiet_NaN();
  expect_error(q, in, "epsilon is not finite");
  q = p;
  q.rope.base = -1.0;
  expect_error(q, in, "rope base is -1, must be finite and > 0");
  expect_error(ExpectedAttentionParams::kvpress(1.0), in, "compression_ratio is 1, must be in [0, 1)");
  auto bad = in;
  bad.queries = TensorView<const float, 3>(c.q.data(), {8, 4, 16}, {1600, 16, 1});
  expect_error(p, bad, "queries has 4 rows, must be more than n_sink 4");
  bad = in;
  bad.queries = TensorView<const float, 3>(c.q.data(), {7, 100, 16}, {1600, 16, 1});
  expect_error(p, bad, "queries has 7 heads, not a multiple of the 2 kv heads");
  bad = in;
  bad.values = KVSource<float>::from(TensorView<const float, 3>(c.v.data(), {2, 99, 16}, {1600, 16, 1}));
  expect_error(p, bad, "values has shape (2, 99, 16), keys has (2, 100, 16)");
  bad = in;
  bad.keys = KVSource<float>::from(TensorView<const float, 3>(c.k.data(), {2, 100, 15}, {1600, 16, 1}));
  bad.values = KVSource<float>::from(TensorView<const float, 3>(c.v.data(), {2, 100, 15}, {1600, 16, 1}));
  bad.queries = TensorView<const float, 3>(c.q.data(), {8, 100, 15}, {1600, 16, 1});
  expect_error(p, bad, "head_dim is 15, must be even");
  bad = in;
  bad.queries = {};
  expect_error(p, bad, "neither queries nor query_mean given");
  std::vector<float> mean(8 * 16, 0.0f);
  bad.query_mean = TensorView<const float, 2>::contiguous(mean.data(), {8, 16});
  expect_error(p, bad, "query_cov has shape (0, 0, 0), expected (8, 16, 16)");
  bad = in;
  bad.next_position = -5;
  expect_error(p, bad, "next_position -5 out of range");
  auto tok = p;
  tok.budget = Budget::tokens(101);
  expect_error(tok, in, "token budget 101 is larger than the sequence length 100");
}
