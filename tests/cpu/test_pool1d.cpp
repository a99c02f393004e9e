// pool1d: backend::Cpu is bit-identical to the scalar reference (each output
// sums its window in the same order; max uses the same comparison).
#include <catch2/catch.hpp>

#include "cpu_test_util.hpp"

using namespace kvp_cpu_test;

namespace {

void check_pool(const std::vector<float>& in, int kernel, Pooling kind, const char* what) {
  const auto n = static_cast<std::int64_t>(in.size());
  // One buffer, reference then result, each with one guard element past n.
  std::vector<float> buf(2 * (in.size() + 1), 7.0f);
  float* ref = buf.data();
  float* out = ref + in.size() + 1;
  Scalar::pool1d(in.data(), n, kernel, kind, ref);
  Cpu::pool1d(in.data(), n, kernel, kind, out);
  for (std::size_t t = 0; t <= in.size(); ++t) {
    INFO(what << ": n=" << n << " kernel=" << kernel << " kind=" << static_cast<int>(kind) << " isa=" << Cpu::isa_name() << " t=" << t
              << " got " << out[t] << " reference " << ref[t]);
    REQUIRE(same_float(out[t], ref[t]));
  }
}

}  // namespace

TEST_CASE("pool1d: avg and max equal the reference bit for bit, every kernel 1..9 and short lengths", "[cpu][pool1d]") {
  std::mt19937 rng(31);
  std::normal_distribution<float> nd;
  std::uniform_int_distribution<int> pick(0, 15);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  IsaGuard guard;
  for (CpuIsa isa : available_isas()) {
    REQUIRE(Cpu::set_isa(isa));
    std::vector<std::int64_t> lengths;
    for (std::int64_t n = 0; n <= 40; ++n) lengths.push_back(n);
    for (std::int64_t n : {63, 64, 65, 1000, 4099}) lengths.push_back(n);
    for (std::int64_t n : lengths) {
      std::vector<float> x(static_cast<std::size_t>(n)), with_nan(x.size()), zeros(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) {
        x[i] = nd(rng);
        const int p = pick(rng);
        with_nan[i] = p == 0 ? nan : (p == 1 ? -INFINITY : (p == 2 ? INFINITY : x[i]));
        zeros[i] = p % 2 ? 0.0f : -0.0f;
      }
      for (int kernel = 1; kernel <= 9; kernel += 2) {
        for (Pooling kind : {Pooling::kAvg, Pooling::kMax, Pooling::kNone}) {
          check_pool(x, kernel, kind, "normal");
          check_pool(with_nan, kernel, kind, "NaN/inf");
          check_pool(zeros, kernel, kind, "signed zeros");
        }
      }
    }
  }
}

TEST_CASE("pool1d: a window of NaN only stays NaN - NaN elsewhere is skipped by max", "[cpu][pool1d]") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> x(40, 1.0f);
  for (int i = 10; i < 17; ++i) x[static_cast<std::size_t>(i)] = nan;
  x[30] = nan;
  IsaGuard guard;
  for (CpuIsa isa : available_isas()) {
    REQUIRE(Cpu::set_isa(isa));
    std::vector<float> out(x.size());
    Cpu::pool1d(x.data(), 40, 5, Pooling::kMax, out.data());
    REQUIRE(std::isnan(out[13]));  // window 11..15 is all NaN
    REQUIRE(out[30] == 1.0f);
    check_pool(x, 5, Pooling::kMax, "NaN runs");
    check_pool(x, 5, Pooling::kAvg, "NaN runs");
  }
}
