// topk: backend::Cpu returns exactly the scalar reference's indices (same
// total order: higher score, then higher index; NaN lowest) on every ISA.
#include <catch2/catch.hpp>

#include <cstddef>
#include <functional>
#include <string>

#include "cpu_test_util.hpp"

using namespace kvp_cpu_test;

namespace {

std::vector<std::int32_t> run_topk_scalar(const std::vector<float>& s, std::int64_t k) {
  const auto n = static_cast<std::int64_t>(s.size());
  std::vector<std::byte> ws(Scalar::topk_workspace(n));
  std::vector<std::int32_t> out(static_cast<std::size_t>(k));
  Scalar::topk(s.data(), n, k, out.data(), Workspace{ws.data(), ws.size()});
  return out;
}

std::vector<std::int32_t> run_topk_cpu(const std::vector<float>& s, std::int64_t k) {
  const auto n = static_cast<std::int64_t>(s.size());
  std::vector<std::byte> ws(Cpu::topk_workspace(n));
  std::vector<std::int32_t> out(static_cast<std::size_t>(k) + 1, -5);
  Cpu::topk(s.data(), n, k, out.data(), Workspace{ws.data(), ws.size()});
  REQUIRE(out.back() == -5);  // exactly k written
  out.pop_back();
  return out;
}

/// Compares Cpu with Scalar for k in {0, 1, 64, n/100, n/32, n/8, n/8 + 1, n/2, n-1, n} on every ISA. n/32 is
/// Quest's shape at a 4K-token budget (255 of 8191 pages): its threshold comes from 2k block maxima in the lane
/// layout and its cut from kth_largest_key's search; k = 1 and 64 on the longer rows take the word layout
/// (blocks of whole 64-score words, 20000 scores: blocks of 2.5 words on AVX2), whose collection reads only the
/// blocks that reach the threshold; n/8 and n/2 take the other paths (more block maxima, every score a candidate).
void check_all_k(const std::vector<float>& s, const std::string& what) {
  const auto n = static_cast<std::int64_t>(s.size());
  IsaGuard guard;
  for (std::int64_t k : {std::int64_t{0}, std::int64_t{1}, std::int64_t{64}, n / 100, n / 32, n / 8, n / 8 + 1, n / 2, n - 1, n}) {
    if (k < 0 || k > n) continue;
    const auto ref = run_topk_scalar(s, k);
    for (CpuIsa isa : available_isas()) {
      REQUIRE(Cpu::set_isa(isa));
      INFO(what << ": n=" << n << " k=" << k << " isa=" << cpu_isa_name(isa));
      REQUIRE(run_topk_cpu(s, k) == ref);
    }
  }
}

std::vector<float> generate(std::int64_t n, const std::function<float(std::int64_t)>& f) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = f(i);
  return v;
}

const std::vector<std::int64_t>& lengths() {
  static const std::vector<std::int64_t> v =
      kScaledDown ? std::vector<std::int64_t>{1, 2, 3, 100, 257, 1000, 4096, 4097, 8191, 20000, 40000}
                  : std::vector<std::int64_t>{1, 2, 3, 100, 257, 1000, 4096, 4097, 8191, 20000, 32768, 131072};
  return v;
}

}  // namespace

TEST_CASE("topk: random scores (softmax-like and signed)", "[cpu][topk]") {
  std::mt19937 rng(21);
  std::exponential_distribution<float> ex(3.0f);
  std::normal_distribution<float> nd;
  for (std::int64_t n : lengths()) {
    check_all_k(generate(n, [&](std::int64_t) { return std::exp(-ex(rng) * 10.0f); }), "positive");
    check_all_k(generate(n, [&](std::int64_t) { return nd(rng); }), "normal");
  }
}

TEST_CASE("topk: many ties, all equal, signed zeros", "[cpu][topk]") {
  std::mt19937 rng(22);
  std::uniform_int_distribution<int> small(0, 3);
  for (std::int64_t n : lengths()) {
    check_all_k(generate(n, [&](std::int64_t) { return static_cast<float>(small(rng)); }), "four values");
    check_all_k(generate(n, [&](std::int64_t) { return 0.5f; }), "all equal");
    // The max instruction may report a block of +0 and -0 as -0: the word layout must still read it at a cut of +0.
    check_all_k(generate(n, [&](std::int64_t) { return small(rng) % 2 ? 0.0f : -0.0f; }), "+0 / -0");
  }
}

TEST_CASE("topk: NaN and infinities", "[cpu][topk]") {
  std::mt19937 rng(23);
  std::uniform_int_distribution<int> pick(0, 9);
  std::normal_distribution<float> nd;
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (std::int64_t n : lengths()) {
    check_all_k(generate(n,
                         [&](std::int64_t) {
                           switch (pick(rng)) {
                             case 0: return nan;
                             case 1: return -nan;
                             case 2: return inf;
                             case 3: return -inf;
                             default: return nd(rng);
                           }
                         }),
                "mixed non-finite");
    check_all_k(generate(n, [&](std::int64_t i) { return i % 5 == 0 ? nd(rng) : nan; }), "mostly NaN");
    check_all_k(generate(n, [&](std::int64_t) { return nan; }), "all NaN");
    check_all_k(generate(n, [&](std::int64_t i) { return i % 2 ? -inf : nan; }), "-inf and NaN");
    // Whole SIMD lanes of NaN (short rows' threshold blocks can be lanes of runs of vectors: a block of NaN alone
    // must not count as a score), next to lanes of numbers and of -inf.
    check_all_k(generate(n, [&](std::int64_t i) { return i % 16 < 8 ? nan : nd(rng); }), "NaN lanes");
    check_all_k(generate(n, [&](std::int64_t i) { return i % 16 < 12 ? nan : (i % 16 < 14 ? -inf : nd(rng)); }), "NaN and -inf lanes");
  }
}

TEST_CASE("topk: orders that defeat a strided sample still give the exact answer", "[cpu][topk]") {
  std::mt19937 rng(24);
  std::normal_distribution<float> nd;
  for (std::int64_t n : lengths()) {
    check_all_k(generate(n, [&](std::int64_t i) { return static_cast<float>(i); }), "ascending");
    check_all_k(generate(n, [&](std::int64_t i) { return static_cast<float>(n - i); }), "descending");
    // Large values only off the sample grid: the sampled threshold is far too high.
    check_all_k(generate(n, [&](std::int64_t i) { return i % 64 == 0 ? nd(rng) : 100.0f + nd(rng); }), "off-grid peaks");
    // Sample sees only huge values.
    check_all_k(generate(n, [&](std::int64_t i) { return i % 64 == 0 ? 1e30f : nd(rng); }), "on-grid peaks");
  }
}

TEST_CASE("topk: a workspace sized for the reference op falls back to it", "[cpu][topk]") {
  std::mt19937 rng(25);
  std::normal_distribution<float> nd;
  std::vector<float> s(50000);
  for (auto& x : s) x = nd(rng);
  std::vector<std::byte> ws(Scalar::topk_workspace(50000));
  REQUIRE(ws.size() < Cpu::topk_workspace(50000));
  std::vector<std::int32_t> out(500);
  Cpu::topk(s.data(), 50000, 500, out.data(), Workspace{ws.data(), ws.size()});
  REQUIRE(out == run_topk_scalar(s, 500));
}
