// SPDX-License-Identifier: Apache-2.0
// The engine's matrix products (engine/gemm.hpp) against a double-precision
// reference, at every instruction-set level the machine runs.
//
// Shapes: every (m, n, k) from {0, 1, 3, 7, 16, 17, 63, 64, 65, 130, 576}
// with m * n * k <= 400k (1,167 of the 1,331 triples: the kernels' register
// tiles, vector tails and cache blocks each end at every offset), plus a few
// larger ones with 576 in each place and k up to 2305 (gemm_nt splits k into
// passes of at most 768). Leading dimensions exceed the rows, and
// the padding holds NaN in a and b (a kernel that reads past a row into its
// result shows) and a sentinel in c (a kernel that writes past a row shows).
//
// Tolerance: |c - ref| <= 1e-5 * (|c_old| + sum_p |a||b|) per element, ref in
// double. The contract (gemm.hpp) is the recursive-summation bound (k + 1) *
// 2^-24 times the same sum; kernels that add k / width terms per lane stay far
// below both (observed < 1e-6). k = 0 must give exact zeros, or leave c
// untouched when accumulating.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <vector>

#include "engine/gemm.hpp"
#include "kvpolicy/backends/cpu.hpp"

using kvpolicy::CpuIsa;
using kvpolicy::backend::Cpu;

namespace {

struct IsaGuard {
  CpuIsa saved = Cpu::isa();
  ~IsaGuard() { Cpu::set_isa(saved); }
};

struct Shape {
  std::int64_t m, n, k;
};

std::vector<Shape> shapes() {
  const std::int64_t sizes[] = {0, 1, 3, 7, 16, 17, 63, 64, 65, 130, 576};
  std::vector<Shape> out;
  for (auto m : sizes)
    for (auto n : sizes)
      for (auto k : sizes)
        if (m * n * k <= 400000) out.push_back({m, n, k});
  out.push_back({65, 130, 576});  // prefill-like: several cache blocks of b (NT), long k
  out.push_back({17, 576, 130});
  out.push_back({130, 63, 576});
  out.push_back({576, 65, 17});
  out.push_back({7, 17, 1537});  // k over gemm_nt's pass depth (768 floats): two and three passes adding into c
  out.push_back({1, 130, 1543});
  out.push_back({13, 9, 2305});
  return out;
}

/// Checks one product kind (`nt`: c = a b^T, else c = a b) on one shape at every level.
/// Returns the worst |c - ref| / (|c_old| + sum |a||b|) seen.
double check_shape(bool nt, const Shape& s, std::mt19937& rng) {
  const std::int64_t m = s.m, n = s.n, k = s.k;
  const std::int64_t lda = k + 3, brows = nt ? n : k, bcols = nt ? k : n, ldb = bcols + 5, ldc = n + 2;
  constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
  constexpr float kSentinel = 1234.5f;
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  // One spare float after the last row: leading dimension times rows covers the padding of every row.
  std::vector<float> a(static_cast<std::size_t>(m * lda + 1), kNan), b(static_cast<std::size_t>(brows * ldb + 1), kNan);
  std::vector<float> c0(static_cast<std::size_t>(m * ldc + 1), kSentinel);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t p = 0; p < k; ++p) a[static_cast<std::size_t>(i * lda + p)] = u(rng);
  for (std::int64_t r = 0; r < brows; ++r)
    for (std::int64_t q = 0; q < bcols; ++q) b[static_cast<std::size_t>(r * ldb + q)] = u(rng);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) c0[static_cast<std::size_t>(i * ldc + j)] = u(rng);

  std::vector<double> ref(static_cast<std::size_t>(m * n)), mag(ref.size());
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double sum = 0.0, abs_sum = 0.0;
      for (std::int64_t p = 0; p < k; ++p) {
        const double x = a[static_cast<std::size_t>(i * lda + p)];
        const double y = nt ? b[static_cast<std::size_t>(j * ldb + p)] : b[static_cast<std::size_t>(p * ldb + j)];
        sum += x * y;
        abs_sum += std::abs(x * y);
      }
      ref[static_cast<std::size_t>(i * n + j)] = sum;
      mag[static_cast<std::size_t>(i * n + j)] = abs_sum;
    }

  double worst = 0.0;
  for (CpuIsa isa : {CpuIsa::kSse2, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (!Cpu::set_isa(isa)) continue;
    for (bool accumulate : {false, true}) {
      std::vector<float> c = c0;
      if (nt)
        kvp_engine::gemm_nt(a.data(), lda, b.data(), ldb, c.data(), ldc, m, n, k, accumulate);
      else
        kvp_engine::gemm_nn(a.data(), lda, b.data(), ldb, c.data(), ldc, m, n, k, accumulate);
      std::int64_t bad = 0, first_i = -1, first_j = -1;
      for (std::int64_t i = 0; i < m; ++i)
        for (std::int64_t j = 0; j < ldc; ++j) {
          const std::size_t at = static_cast<std::size_t>(i * ldc + j);
          bool ok;
          if (j >= n) {
            ok = std::memcmp(&c[at], &c0[at], sizeof(float)) == 0;  // padding untouched
          } else if (k == 0) {
            ok = accumulate ? std::memcmp(&c[at], &c0[at], sizeof(float)) == 0 : (c[at] == 0.0f && !std::signbit(c[at]));
          } else {
            const double old = accumulate ? static_cast<double>(c0[at]) : 0.0;
            const double scale = std::abs(old) + mag[static_cast<std::size_t>(i * n + j)];
            const double err = std::abs(static_cast<double>(c[at]) - (old + ref[static_cast<std::size_t>(i * n + j)]));
            ok = err <= 1e-5 * scale;  // false for NaN
            if (scale > 0.0 && err / scale > worst) worst = err / scale;
          }
          if (!ok && bad++ == 0) first_i = i, first_j = j;
        }
      if (std::memcmp(&c.back(), &c0.back(), sizeof(float)) != 0 && bad++ == 0) first_i = m, first_j = 0;
      if (bad != 0) {
        std::ostringstream what;
        what << (nt ? "gemm_nt" : "gemm_nn") << " m=" << m << " n=" << n << " k=" << k << " accumulate=" << accumulate
             << " isa=" << kvpolicy::cpu_isa_name(isa) << ": " << bad << " bad elements, first at (" << first_i << ", " << first_j << ")";
        FAIL(what.str());
      }
    }
  }
  return worst;
}

}  // namespace

TEST_CASE("gemm: gemm_nt and gemm_nn match a double reference on odd shapes at every ISA level", "[engine][gemm]") {
  IsaGuard guard;
  std::mt19937 rng(20240611u);
  double worst_nt = 0.0, worst_nn = 0.0;
  for (const Shape& s : shapes()) {
    worst_nt = std::max(worst_nt, check_shape(true, s, rng));
    worst_nn = std::max(worst_nn, check_shape(false, s, rng));
  }
  INFO("worst relative error: gemm_nt " << worst_nt << ", gemm_nn " << worst_nn);
  CHECK(worst_nt <= 1e-5);
  CHECK(worst_nn <= 1e-5);
}

TEST_CASE("gemm: repeated products are bit-identical at every ISA level", "[engine][gemm]") {
  IsaGuard guard;
  const std::int64_t m = 9, n = 37, k = 70;
  std::vector<float> a(static_cast<std::size_t>(m * k)), b(static_cast<std::size_t>(n * k));
  std::mt19937 rng(7u);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (float& x : a) x = u(rng);
  for (float& x : b) x = u(rng);
  for (CpuIsa isa : {CpuIsa::kSse2, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (!Cpu::set_isa(isa)) continue;
    INFO(kvpolicy::cpu_isa_name(isa));
    std::vector<float> c1(static_cast<std::size_t>(m * n)), c2(c1.size());
    kvp_engine::gemm_nt(a.data(), k, b.data(), k, c1.data(), n, m, n, k);
    kvp_engine::gemm_nt(a.data(), k, b.data(), k, c2.data(), n, m, n, k);
    CHECK(std::memcmp(c1.data(), c2.data(), c1.size() * sizeof(float)) == 0);
  }
}

// softmax_causal against a double reference: each probability within 1e-5 relative (the kernel's exp is within 1 ulp;
// its argument scale * x - max is rounded in float, an error of |argument| * 2^-24 relative, at most ~6e-6 where the
// result is a normal float) plus 3e-45 absolute (results below 2^-126 keep fewer bits); masked entries exactly 0.
TEST_CASE("gemm: softmax_causal matches a double reference at every ISA level", "[engine][gemm]") {
  IsaGuard guard;
  std::mt19937 rng(99u);
  struct Block {
    std::int64_t rows, cols, first;
    float spread;  // scores uniform in [-spread, spread]
  };
  // Rows from 1 entry to several vectors plus tails; a wide spread drives entries into the subnormal range and to 0.
  const Block blocks[] = {{1, 1, 1, 10.0f}, {17, 17, 1, 10.0f}, {40, 103, 64, 30.0f}, {5, 70, 66, 1000.0f}, {3, 600, 598, 80.0f}};
  const float scale = 0.125f;
  for (const Block& blk : blocks) {
    const std::int64_t lds = blk.cols + 3;
    std::uniform_real_distribution<float> u(-blk.spread, blk.spread);
    std::vector<float> s0(static_cast<std::size_t>(blk.rows * lds));
    for (float& x : s0) x = u(rng);
    for (CpuIsa isa : {CpuIsa::kSse2, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
      if (!Cpu::set_isa(isa)) continue;
      INFO(kvpolicy::cpu_isa_name(isa) << " rows=" << blk.rows << " cols=" << blk.cols << " first=" << blk.first);
      std::vector<float> s = s0;
      kvp_engine::softmax_causal(s.data(), lds, blk.rows, blk.cols, blk.first, scale);
      std::int64_t bad = 0;
      for (std::int64_t i = 0; i < blk.rows; ++i) {
        const float* in = s0.data() + i * lds;
        const float* out = s.data() + i * lds;
        const std::int64_t n = blk.first + i;
        double mx = -INFINITY, sum = 0.0;
        for (std::int64_t j = 0; j < n; ++j) mx = std::max(mx, static_cast<double>(scale) * in[j]);
        for (std::int64_t j = 0; j < n; ++j) sum += std::exp(static_cast<double>(scale) * in[j] - mx);
        for (std::int64_t j = 0; j < n; ++j) {
          const double ref = std::exp(static_cast<double>(scale) * in[j] - mx) / sum;
          if (!(std::abs(out[j] - ref) <= 1e-5 * ref + 3e-45)) ++bad;
        }
        for (std::int64_t j = n; j < blk.cols; ++j) bad += out[j] != 0.0f;
        for (std::int64_t j = blk.cols; j < lds; ++j) bad += std::memcmp(&out[j], &in[j], sizeof(float)) != 0;  // padding untouched
      }
      CHECK(bad == 0);
    }
  }
}
