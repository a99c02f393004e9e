// CpuReduceOps against the scalar reference on every ISA level: the one-victim
// argmin (total order: NaN -> 0, -0 below +0, lowest slot of the minimum), the
// NaN scan and the fp32 head mean, bit for bit, on adversarial rows (ties,
// signed zeros, infinities, NaN at every block boundary, unaligned starts).
#include <catch2/catch.hpp>

#include <cstring>

#include "cpu/cpu_test_util.hpp"

using namespace kvp_cpu_test;

namespace {

std::vector<std::int64_t> lengths() {
  std::vector<std::int64_t> v;
  for (std::int64_t n = 1; n <= 70; ++n) v.push_back(n);
  for (std::int64_t n : {127, 128, 129, 1023, 1024, 1025, 2047, 2048, 2049, 4099}) v.push_back(n);
  return v;
}

/// Row r of kind `kind`: random values with many ties, optionally with signed zeros or infinities.
std::vector<float> make_row(std::int64_t n, int kind, std::mt19937& rng) {
  std::uniform_int_distribution<int> small(0, 7);
  std::vector<float> x(static_cast<std::size_t>(n + 1));  // +1: an unaligned start at x.data() + 1
  for (auto& v : x) v = static_cast<float>(small(rng)) * 0.25f + 1.0f;
  const float inf = std::numeric_limits<float>::infinity();
  switch (kind) {
    case 1:  // signed zeros as the minimum, -0 somewhere or nowhere
      for (auto& v : x)
        if (small(rng) == 0) v = (small(rng) & 1) ? -0.0f : 0.0f;
      break;
    case 2:  // all +inf
      std::fill(x.begin(), x.end(), inf);
      break;
    case 3:  // one unique minimum late
      x[static_cast<std::size_t>(n * 3 / 4)] = -inf;
      break;
    case 4:  // only +0 zeros
      for (auto& v : x)
        if (small(rng) == 0) v = 0.0f;
      break;
    default: break;
  }
  return x;
}

}  // namespace

TEST_CASE("CpuReduceOps: argmin_or_nan / has_nan == the scalar reference on every level", "[cpu][reduce]") {
  IsaGuard guard;
  std::mt19937 rng(5);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (CpuIsa isa : available_isas()) {
    REQUIRE(Cpu::set_isa(isa));
    for (std::int64_t n : lengths()) {
      for (int kind = 0; kind < 5; ++kind) {
        for (int off = 0; off < 2; ++off) {
          INFO("isa " << Cpu::isa_name() << " n " << n << " kind " << kind << " offset " << off);
          auto row = make_row(n, kind, rng);
          const float* x = row.data() + off;
          std::int64_t at_ref = -5, at_cpu = -5;
          REQUIRE(Cpu::argmin_or_nan(x, n, &at_cpu) == Scalar::argmin_or_nan(x, n, &at_ref));
          REQUIRE(at_cpu == at_ref);
          REQUIRE(at_ref >= 0);
          REQUIRE(!Cpu::has_nan(x, n));
          // NaN at the first, a block-boundary and the last slot: both report it, neither sets *at.
          for (std::int64_t p : {std::int64_t{0}, std::min<std::int64_t>(n - 1, 1023), std::min<std::int64_t>(n - 1, 1024), n - 1}) {
            auto bad = row;
            bad[static_cast<std::size_t>(off + p)] = nan;
            std::int64_t a = -7;
            REQUIRE(Cpu::argmin_or_nan(bad.data() + off, n, &a) == 0);
            REQUIRE(a == -7);
            REQUIRE(Cpu::has_nan(bad.data() + off, n));
            REQUIRE(Scalar::has_nan(bad.data() + off, n));
          }
        }
      }
    }
    std::int64_t at = 3;
    REQUIRE(Cpu::argmin_or_nan(nullptr, 0, &at) == -1);
    REQUIRE(at == -1);
    REQUIRE(!Cpu::has_nan(nullptr, 0));
  }
}

TEST_CASE("CpuReduceOps: mean_rows == the scalar reference bit for bit (fp32 contiguous, strided, fp16)", "[cpu][reduce]") {
  IsaGuard guard;
  std::mt19937 rng(9);
  std::normal_distribution<float> nd;
  for (CpuIsa isa : available_isas()) {
    REQUIRE(Cpu::set_isa(isa));
    for (std::int64_t H : {1, 3, 8, 32}) {
      for (std::int64_t n : {1, 15, 16, 17, 2047, 2048, 2049, 5000}) {
        INFO("isa " << Cpu::isa_name() << " H " << H << " n " << n);
        std::vector<float> p(static_cast<std::size_t>(H * (n + 3)));
        for (auto& v : p) v = nd(rng) * 1e-3f;
        const TensorView<const float, 2> rows(p.data() + 1, {H, n}, {n + 3, 1});
        std::vector<float> a(static_cast<std::size_t>(n)), b(static_cast<std::size_t>(n));
        Cpu::mean_rows(rows, a.data());
        Scalar::mean_rows(rows, b.data());
        REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
        // Strided along j and fp16: the reference path, still equal.
        if (n > 1) {
          const TensorView<const float, 2> strided(p.data(), {H, n / 2}, {n + 3, 2});
          Cpu::mean_rows(strided, a.data());
          Scalar::mean_rows(strided, b.data());
          REQUIRE(std::memcmp(a.data(), b.data(), static_cast<std::size_t>(n / 2) * sizeof(float)) == 0);
        }
      }
    }
    std::vector<half> h(64);
    for (std::size_t i = 0; i < h.size(); ++i) h[i] = from_float<half>(static_cast<float>(i) * 0.5f);
    std::vector<float> a(16), b(16);
    Cpu::mean_rows(TensorView<const half, 2>::contiguous(h.data(), {4, 16}), a.data());
    Scalar::mean_rows(TensorView<const half, 2>::contiguous(h.data(), {4, 16}), b.data());
    REQUIRE(a == b);
  }
}

TEST_CASE("CpuReduceOps: expected_logits == the scalar reference bit for bit (fp32 / fp16 / bf16 keys, paged, any head_dim)",
          "[cpu][reduce][expected_attention]") {
  IsaGuard guard;
  std::mt19937 rng(21);
  std::normal_distribution<float> nd;
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const auto check = [&](auto tag, std::int64_t d, std::int64_t T, std::int64_t j0, bool with_cov, bool paged, bool special) {
    using Tk = decltype(tag);
    std::vector<Tk> k(static_cast<std::size_t>((T + 7) * (d + 3)));
    for (auto& v : k) v = from_float<Tk>(nd(rng));
    if (special) {  // a NaN key element and an infinite one: the lanes must not leak into their neighbours
      k[static_cast<std::size_t>(1 * (d + 3))] = from_float<Tk>(nan);
      k[static_cast<std::size_t>(std::min<std::int64_t>(T - 1, 5) * (d + 3) + d - 1)] = from_float<Tk>(inf);
    }
    std::vector<float> mean(static_cast<std::size_t>(d)), cov(static_cast<std::size_t>(d * d));
    for (auto& v : mean) v = nd(rng);
    for (auto& v : cov) v = nd(rng) * 0.1f;  // not symmetric: the kernel must read rows as the reference does
    // Contiguous rows of stride d + 3, or pages of 4 slots in reversed order.
    std::vector<std::int32_t> pages(static_cast<std::size_t>((T + 3) / 4));
    for (std::size_t p = 0; p < pages.size(); ++p) pages[p] = static_cast<std::int32_t>(pages.size() - 1 - p);
    const Rows<Tk> rows = paged ? Rows<Tk>{k.data(), d + 3, pages.data(), 4 * (d + 3), 4} : Rows<Tk>{k.data(), d + 3};
    std::vector<float> za(static_cast<std::size_t>(T), -7.0f), zb(za), sa(static_cast<std::size_t>(2 * d)), sb(sa);
    const float* c = with_cov ? cov.data() : nullptr;
    const float ma = Cpu::expected_logits(mean.data(), c, d, rows, j0, T, za.data(), sa.data());
    const float mb = Scalar::expected_logits(mean.data(), c, d, rows, j0, T, zb.data(), sb.data());
    INFO("isa " << Cpu::isa_name() << " d " << d << " T " << T << " j0 " << j0 << " cov " << with_cov << " paged " << paged);
    REQUIRE(std::memcmp(za.data(), zb.data(), za.size() * sizeof(float)) == 0);  // untouched before j0 too
    REQUIRE(std::memcmp(&ma, &mb, sizeof ma) == 0);
  };
  for (CpuIsa isa : available_isas()) {
    REQUIRE(Cpu::set_isa(isa));
    // Multiples of the lanes take the quadratic form's column tiles: every whole / partial group of column
    // vectors (AVX-512 groups of 4 vectors: d 16-112; AVX2 groups of 3: d 8, 16, 24, 64, 128, 256).
    for (std::int64_t d : {1, 2, 7, 8, 9, 16, 24, 31, 32, 48, 64, 80, 96, 100, 112, 128, 256, 260})
      for (std::int64_t T : {1, 5, 16, 17, 33}) {
        for (bool cov : {true, false}) {
          check(float{}, d, T, 0, cov, false, false);
          check(half{}, d, T, T > 4 ? 4 : 0, cov, true, T > 5);
          check(bfloat16{}, d, T, 0, cov, T % 2 == 1, false);
        }
      }
  }
}

TEST_CASE("CpuReduceOps: outer_upper_accumulate == the scalar reference bit for bit", "[cpu][reduce][expected_attention]") {
  IsaGuard guard;
  std::mt19937 rng(22);
  std::normal_distribution<float> nd;
  for (CpuIsa isa : available_isas()) {
    REQUIRE(Cpu::set_isa(isa));
    for (std::int64_t d : {1, 3, 4, 5, 8, 15, 16, 17, 33, 64, 100, 128})
      for (std::int64_t n : {1, 2, 7, 64}) {
        std::vector<float> c(static_cast<std::size_t>(n * d));
        for (auto& v : c) v = nd(rng);
        std::vector<float> a(static_cast<std::size_t>(d * d)), b;
        for (auto& v : a) v = nd(rng);  // accumulates onto what is there
        b = a;
        Cpu::outer_upper_accumulate(c.data(), n, d, a.data());
        Scalar::outer_upper_accumulate(c.data(), n, d, b.data());
        INFO("isa " << Cpu::isa_name() << " d " << d << " n " << n);
        for (std::int64_t i = 0; i < d; ++i)
          for (std::int64_t j = i; j < d; ++j) REQUIRE(std::memcmp(&a[i * d + j], &b[i * d + j], sizeof(float)) == 0);
      }
  }
}

TEST_CASE("CpuReduceOps: outer_upper_add_f64 == a zero block's outer_upper_accumulate + add_upper_f64, bit for bit",
          "[cpu][reduce][expected_attention]") {
  IsaGuard guard;
  std::mt19937 rng(24);
  std::normal_distribution<float> nd;
  for (CpuIsa isa : available_isas()) {
    REQUIRE(Cpu::set_isa(isa));
    for (std::int64_t d : {1, 3, 5, 8, 15, 16, 17, 24, 33, 48, 64, 100, 112, 128})
      for (std::int64_t n : {1, 2, 7, 64}) {
        std::vector<float> c(static_cast<std::size_t>(n * d)), block(static_cast<std::size_t>(d * d), 0.0f);
        for (auto& v : c) v = nd(rng);
        std::vector<double> a(static_cast<std::size_t>(d * d)), b;
        for (auto& v : a) v = static_cast<double>(nd(rng)) * 1e3;  // accumulates onto what is there
        b = a;
        Cpu::outer_upper_add_f64(c.data(), n, d, a.data());
        Scalar::outer_upper_accumulate(c.data(), n, d, block.data());
        Scalar::add_upper_f64(block.data(), d, b.data());
        INFO("isa " << Cpu::isa_name() << " d " << d << " n " << n);
        REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0);  // the lower entries untouched too
      }
  }
}

TEST_CASE("CpuReduceOps: Expected Attention's double accumulations == the scalar reference bit for bit",
          "[cpu][reduce][expected_attention]") {
  IsaGuard guard;
  std::mt19937 rng(23);
  std::normal_distribution<float> nd;
  const auto same = [](const auto& a, const auto& b) {
    return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0);  // memcmp: never null
  };
  for (CpuIsa isa : available_isas()) {
    REQUIRE(Cpu::set_isa(isa));
    for (std::int64_t d : {1, 2, 3, 7, 8, 9, 16, 31, 32, 33, 64, 100, 128, 260})
      for (std::int64_t n : {0, 1, 2, 7, 64}) {
        INFO("isa " << Cpu::isa_name() << " d " << d << " n " << n);
        std::vector<float> x(static_cast<std::size_t>(n * d));
        for (auto& v : x) v = nd(rng) * 1000.0f;
        if (!x.empty()) x[0] = -0.0f, x.back() = 1e-30f;
        std::vector<double> a(static_cast<std::size_t>(d)), b;
        for (auto& v : a) v = nd(rng);  // accumulates onto what is there
        b = a;
        Cpu::accumulate_rows_f64(x.data(), n, d, a.data());
        Scalar::accumulate_rows_f64(x.data(), n, d, b.data());
        REQUIRE(same(a, b));
        std::vector<float> ca = x, cb = x;
        Cpu::centre_rows(ca.data(), n, d, a.data());
        Scalar::centre_rows(cb.data(), n, d, a.data());
        REQUIRE(same(ca, cb));
        std::vector<float> block(static_cast<std::size_t>(d * d));
        for (auto& v : block) v = nd(rng);
        std::vector<double> ua(static_cast<std::size_t>(d * d)), ub;
        for (auto& v : ua) v = nd(rng);
        ub = ua;
        Cpu::add_upper_f64(block.data(), d, ua.data());
        Scalar::add_upper_f64(block.data(), d, ub.data());
        REQUIRE(same(ua, ub));  // the lower triangle too: neither writes it
      }
  }
}

TEST_CASE("CpuReduceOps: neg_row_norms == the scalar reference bit for bit", "[cpu][reduce][expected_attention]") {
  IsaGuard guard;
  std::mt19937 rng(24);
  std::normal_distribution<float> nd;
  for (CpuIsa isa : available_isas()) {
    REQUIRE(Cpu::set_isa(isa));
    for (std::int64_t d : {1, 5, 15, 16, 17, 64, 100, 128, 256, 300})
      for (std::int64_t n : {1, 15, 16, 17, 40}) {
        INFO("isa " << Cpu::isa_name() << " d " << d << " n " << n);
        std::vector<float> x(static_cast<std::size_t>(2 * n * d));
        for (auto& v : x) v = nd(rng) * 100.0f;
        x[0] = 0.0f;
        std::vector<half> xh(x.size());
        for (std::size_t i = 0; i < x.size(); ++i) xh[i] = from_float<half>(x[i]);
        for (std::int64_t stride : {d, 2 * d}) {  // contiguous rows, then every other row
          std::vector<float> a(static_cast<std::size_t>(3 * n), 7.0f), b = a;
          Cpu::neg_row_norms(Rows<float>{x.data(), stride, nullptr, 0, 0}, n, d, a.data(), 3);
          Scalar::neg_row_norms(Rows<float>{x.data(), stride, nullptr, 0, 0}, n, d, b.data(), 3);
          REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
          Cpu::neg_row_norms(Rows<half>{xh.data(), stride, nullptr, 0, 0}, n, d, a.data(), 3);
          Scalar::neg_row_norms(Rows<half>{xh.data(), stride, nullptr, 0, 0}, n, d, b.data(), 3);
          REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
        }
      }
  }
}
