// kth_largest_key, the CPU top-k's rank search over order keys (white box, through the kernel table of every ISA
// level this machine has): without slack it returns a sort's rank-th largest key and how many keys reach it; with
// slack it returns a threshold that rank to rank + slack keys reach (or, where one key's ties overshoot that, the
// exact key). The top-k tests cannot see the slack form's contract: any cut its callers accept gives the same indices.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "cpu_test_util.hpp"
#include "score_kernels.hpp"

using namespace kvp_cpu_test;

namespace {

std::int32_t order_key_of(float f) {
  std::int32_t i = 0;
  std::memcpy(&i, &f, sizeof i);
  return i ^ ((i >> 31) & 0x7fffffff);
}

/// Draws a key set of one of six kinds: few distinct values (ties), any int32 (INT32_MIN is the NaN key), the
/// extremes among small values, normal floats' keys, floats spread over many exponents, one value repeated
/// among distinct ones.
std::vector<std::int32_t> draw_keys(std::mt19937& g, int kind, std::int64_t m) {
  std::normal_distribution<float> nd;
  std::exponential_distribution<float> ex(1.0f);
  std::vector<std::int32_t> k(static_cast<std::size_t>(m));
  for (auto& x : k) {
    switch (kind) {
      case 0: x = static_cast<std::int32_t>(g() % 7) - 3; break;
      case 1: x = static_cast<std::int32_t>(g()); break;
      case 2: x = g() % 10 == 0 ? INT32_MIN : (g() % 10 == 0 ? INT32_MAX : static_cast<std::int32_t>(g() % 1000)); break;
      case 3: x = order_key_of(nd(g)); break;
      case 4: x = order_key_of(std::exp(ex(g) * 20.0f) * (g() % 2 ? 1.0f : -1.0f)); break;
      default: x = g() % 3 == 0 ? 5 : static_cast<std::int32_t>(g() % 1000000); break;
    }
  }
  return k;
}

}  // namespace

TEST_CASE("kth_largest_key: exact rank and slack thresholds against a sort", "[cpu][topk]") {
  IsaGuard guard;
  std::mt19937 g(31);
  const int sets = kScaledDown ? 600 : 3000;
  for (CpuIsa isa : available_isas()) {
    REQUIRE(Cpu::set_isa(isa));
    const auto& kern = cpu_detail::score_kernels();
    for (int it = 0; it < sets; ++it) {
      // Sizes around the counted small sets (<= 48), the bracket finish (16 keys) and the top-k's candidate sets.
      const std::int64_t m = it % 3 == 0 ? 1 + static_cast<std::int64_t>(g() % 64) : 49 + static_cast<std::int64_t>(g() % 3000);
      const std::int64_t rank = 1 + static_cast<std::int64_t>(g() % static_cast<std::uint32_t>(m));
      const std::int64_t slack = it % 2 == 0 ? static_cast<std::int64_t>(g() % 20) : 0;
      const int kind = it % 6;
      std::vector<std::int32_t> keys = draw_keys(g, kind, m);
      keys.resize(keys.size() + 64, 0x5a5a5a5a);  // past m: never read as keys
      std::int64_t at_least = -1;
      const std::int32_t r = kern.kth_largest_key(keys.data(), m, rank, slack, &at_least);
      std::vector<std::int32_t> sorted(keys.begin(), keys.begin() + m);
      std::sort(sorted.rbegin(), sorted.rend());
      const std::int32_t exact = sorted[static_cast<std::size_t>(rank - 1)];
      const auto reach = static_cast<std::int64_t>(std::count_if(keys.begin(), keys.begin() + m, [&](std::int32_t x) { return x >= r; }));
      INFO("isa " << cpu_isa_name(isa) << " kind " << kind << " m " << m << " rank " << rank << " slack " << slack);
      REQUIRE(at_least == reach);
      if (slack == 0) {
        REQUIRE(r == exact);
      } else {
        REQUIRE(reach >= rank);
        if (reach > rank + slack) REQUIRE(r == exact);  // ties of the rank-th key itself
      }
      REQUIRE(kern.kth_largest_key(keys.data(), m, rank, slack, nullptr) == r);  // *at_least is optional
    }
  }
}
