// A small paged cache with a double-precision attention reference, for the
// attend_pages / dense / selection / page_quality tests on any backend.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/tensor_view.hpp"
#include "kvpolicy/eval/page_metrics.hpp"

namespace eval_test {

using namespace kvpolicy;

/// One layer, `batch` sequences of `len` tokens each on shuffled distinct pages (NHD pool).
struct Pool {
  std::int32_t batch, Hkv, ps, d, num_pages;
  std::int64_t len;
  PageStrides st;
  std::vector<float> k, v;
  std::vector<std::int32_t> indptr{0}, indices, last;

  Pool(std::int32_t batch_, std::int32_t kv_heads, std::int32_t page_size, std::int32_t head_dim, std::int64_t len_, unsigned seed)
      : batch(batch_),
        Hkv(kv_heads),
        ps(page_size),
        d(head_dim),
        num_pages(static_cast<std::int32_t>(batch_ * ((len_ + page_size - 1) / page_size) + 1)),
        len(len_),
        st(PageStrides::contiguous(PageLayout::kNHD, kv_heads, page_size, head_dim)),
        k(static_cast<std::size_t>(num_pages * st.page)),
        v(k.size()) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    for (auto& x : k) x = nd(rng);
    for (auto& x : v) x = nd(rng);
    std::vector<std::int32_t> perm(static_cast<std::size_t>(num_pages));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    const std::int64_t pages = (len + ps - 1) / ps;
    std::size_t next = 0;
    for (std::int32_t b = 0; b < batch; ++b) {
      for (std::int64_t p = 0; p < pages; ++p) indices.push_back(perm[next++]);
      indptr.push_back(static_cast<std::int32_t>(indices.size()));
      last.push_back(pages == 0 ? 0 : static_cast<std::int32_t>(len - (pages - 1) * ps));
    }
  }
  PagedKVView<const float> view() const {
    return PagedKVView<const float>{
        k.data(), v.data(), st, st, num_pages, Hkv, ps, d, PageTable{indptr.data(), indices.data(), last.data(), batch}, kHost};
  }
  const float* key(std::int32_t b, std::int32_t h, std::int64_t t) const {
    return k.data() + indices[static_cast<std::size_t>(indptr[b] + t / ps)] * st.page + h * st.head + (t % ps) * st.slot;
  }
  const float* value(std::int32_t b, std::int32_t h, std::int64_t t) const {
    return v.data() + indices[static_cast<std::size_t>(indptr[b] + t / ps)] * st.page + h * st.head + (t % ps) * st.slot;
  }
  /// Double-precision softmax attention of q over all tokens of (b, h).
  void reference(std::int32_t b, std::int32_t h, const float* q, float scale, std::vector<double>& out, double& lse) const {
    std::vector<double> s(static_cast<std::size_t>(len));
    double mx = -INFINITY;
    for (std::int64_t t = 0; t < len; ++t) {
      double acc = 0.0;
      for (std::int32_t c = 0; c < d; ++c) acc += static_cast<double>(q[c]) * key(b, h, t)[c];
      s[static_cast<std::size_t>(t)] = acc * scale;
      mx = std::max(mx, s[static_cast<std::size_t>(t)]);
    }
    out.assign(static_cast<std::size_t>(d), 0.0);
    double den = 0.0;
    for (std::int64_t t = 0; t < len; ++t) {
      const double p = std::exp(s[static_cast<std::size_t>(t)] - mx);
      den += p;
      for (std::int32_t c = 0; c < d; ++c) out[static_cast<std::size_t>(c)] += p * value(b, h, t)[c];
    }
    for (auto& x : out) x /= den;
    lse = mx + std::log(den);
  }
};

}  // namespace eval_test

// ---- checks shared by the scalar and CPU-backend test files -------------------

namespace eval_test {

/// Queries (batch, Hkv * G, d), normal.
inline std::vector<float> random_queries(std::int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> q(static_cast<std::size_t>(n));
  for (auto& x : q) x = nd(rng);
  return q;
}

/// attend_pages / dense / selection attention / page_quality on one shape, with
/// a workspace of exactly the reported size behind an unaligned base.
template <class Backend>
void check_shape(std::int32_t G, std::int32_t d, std::int32_t ps, const ExecContext& ctx) {
  const std::int32_t batch = 2, Hkv = 2, Hq = Hkv * G;
  const std::int64_t len = 11;
  INFO("G=" << G << " head_dim=" << d << " page_size=" << ps << " workers=" << ctx.workers());
  const Pool pool(batch, Hkv, ps, d, len, static_cast<unsigned>(G * 1000 + d * 10 + ps));
  const auto kv = pool.view();
  const auto q = random_queries(static_cast<std::int64_t>(batch) * Hq * d, static_cast<unsigned>(G + d));
  const auto qv = TensorView<const float, 3>::contiguous(q.data(), {batch, Hq, d});
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const std::size_t need = attend_pages_workspace<Backend>(G, ps, d, ctx);
  std::vector<std::byte> mem(need + 1);
  const Workspace ws{mem.data() + 1, need};  // exactly the reported size, unaligned base
  std::vector<float> out(static_cast<std::size_t>(batch * Hq * d), -1.0f), lse(static_cast<std::size_t>(batch * Hq), -1.0f);
  auto o3 = TensorView<float, 3>::contiguous(out.data(), {batch, Hq, d});
  auto l2 = TensorView<float, 2>::contiguous(lse.data(), {batch, Hq});
  auto check_out = [&] {
    for (std::int32_t b = 0; b < batch; ++b)
      for (std::int32_t h = 0; h < Hq; ++h) {
        std::vector<double> ro;
        double rl = 0.0;
        pool.reference(b, h / G, q.data() + (b * Hq + h) * d, scale, ro, rl);
        REQUIRE(l2(b, h) == Approx(rl).epsilon(1e-4).margin(1e-4));
        for (std::int32_t c = 0; c < d; ++c) REQUIRE(o3(b, h, c) == Approx(ro[static_cast<std::size_t>(c)]).epsilon(1e-4).margin(1e-4));
      }
  };
  REQUIRE(dense_attention<Backend>(kv, qv, scale, o3, l2, ws, ctx).is_ok());
  check_out();
  // Every page selected, one row per kv head and one per query head: the same attention.
  for (const std::int32_t heads : {Hkv, Hq}) {
    const std::int64_t rows = static_cast<std::int64_t>(batch) * heads;
    std::vector<std::int32_t> indptr{0}, indices, last;
    for (std::int32_t b = 0; b < batch; ++b)
      for (std::int32_t h = 0; h < heads; ++h) {
        indices.insert(indices.end(), pool.indices.begin() + pool.indptr[b], pool.indices.begin() + pool.indptr[b + 1]);
        indptr.push_back(static_cast<std::int32_t>(indices.size()));
        last.push_back(pool.last[static_cast<std::size_t>(b)]);
      }
    const PageSelection sel{indptr.data(), indices.data(), last.data(), nullptr, rows, static_cast<std::int64_t>(indices.size())};
    std::fill(out.begin(), out.end(), -1.0f);
    REQUIRE(selection_attention<Backend>(kv, qv, sel, scale, o3, l2, ws, ctx).is_ok());
    check_out();
    PageQuality pq;
    REQUIRE(page_quality<Backend>(kv, qv, sel, 4, scale, &pq, {}, ctx).is_ok());
    REQUIRE(pq.heads == batch * Hq);
    REQUIRE(pq.page_recall == Approx(1.0));
    REQUIRE(pq.mass_recall == Approx(1.0).epsilon(1e-5));
    REQUIRE(pq.output_rel_error < 1e-5);
    REQUIRE(pq.attended_fraction == Approx(1.0));
  }
}

/// The shapes of issue #16: (G * head_dim) mod 16 in 1..8 made the plan 64 bytes short of the carve.
template <class Backend>
void check_many_shapes(const ExecContext& ctx) {
  for (const std::int32_t G : {1, 2, 3, 4, 5, 8, 17})
    for (const std::int32_t d : {1, 2, 3, 4, 7, 8, 9, 16, 24, 33})
      for (const std::int32_t ps : {1, 4, 5}) check_shape<Backend>(G, d, ps, ctx);
}

/// A NaN query component makes that head's output and lse NaN (heads sharing its page row stay finite).
template <class Backend>
void check_nan_query(const ExecContext& ctx) {
  const std::int32_t batch = 1, Hkv = 2, G = 2, Hq = Hkv * G, d = 8, ps = 4;
  const Pool pool(batch, Hkv, ps, d, 9, 5);
  auto q = random_queries(static_cast<std::int64_t>(batch) * Hq * d, 6);
  q[static_cast<std::size_t>(1 * d + 3)] = std::numeric_limits<float>::quiet_NaN();  // head 1 (kv head 0, shares a row with head 0)
  const auto qv = TensorView<const float, 3>::contiguous(q.data(), {batch, Hq, d});
  std::vector<std::byte> mem(attend_pages_workspace<Backend>(G, ps, d, ctx));
  std::vector<float> out(static_cast<std::size_t>(batch * Hq * d)), lse(static_cast<std::size_t>(batch * Hq));
  auto o3 = TensorView<float, 3>::contiguous(out.data(), {batch, Hq, d});
  auto l2 = TensorView<float, 2>::contiguous(lse.data(), {batch, Hq});
  REQUIRE(dense_attention<Backend>(pool.view(), qv, 0.35f, o3, l2, Workspace{mem.data(), mem.size()}, ctx).is_ok());
  for (std::int32_t h = 0; h < Hq; ++h) {
    INFO("head " << h);
    REQUIRE(std::isnan(l2(0, h)) == (h == 1));
    for (std::int32_t c = 0; c < d; ++c) REQUIRE(std::isnan(o3(0, h, c)) == (h == 1));
  }
}

}  // namespace eval_test
