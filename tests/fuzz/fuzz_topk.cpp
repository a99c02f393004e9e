// Fuzz target: backend::Cpu::topk against backend::Scalar::topk, differentially, on every instruction-set level
// this machine runs. The input picks a row length (1 .. 40000: the all-candidate, short-row word and lane layouts
// and the sampled long rows), k (0 .. n, with weight on the small k of selection), a value pattern (continuous,
// heavy-tailed, few distinct values, +0 / -0, NaN and infinities scattered or in whole vector lanes, sorted runs)
// and the seed that expands it into the row, so a short input describes a long row. Contract: Cpu writes exactly
// k indices (the slot after them stays poisoned) and they equal Scalar's, index for index (the same total order:
// higher score, then higher index; NaN lowest). The workspace is exactly topk_workspace(n); a second call with a
// workspace one byte short must give the same answer through the reference fallback.
#include <cmath>
#include <random>

#include "fuzz_util.hpp"
#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/ops/scalar.hpp"

using namespace kvpolicy;
using namespace kvp_fuzz;

namespace {

std::vector<float> make_row(FuzzedDataProvider& fdp, std::int64_t n) {
  std::mt19937 rng(fdp.ConsumeIntegral<std::uint32_t>());
  std::normal_distribution<float> nd;
  std::exponential_distribution<float> ex(1.0f);
  const int pattern = fdp.ConsumeIntegralInRange<int>(0, 8);
  const int levels = fdp.ConsumeIntegralInRange<int>(1, 8);
  const int odd = fdp.ConsumeIntegralInRange<int>(0, 20);   // 1 in `odd` entries non-finite (0: none)
  const int lane = fdp.ConsumeIntegralInRange<int>(1, 16);  // run length of the lane patterns
  const float nan = __builtin_nanf(""), inf = __builtin_inff();
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    float x = 0.0f;
    switch (pattern) {
      case 0: x = nd(rng); break;
      case 1: x = std::exp(-4.0f * ex(rng)); break;  // attention-like: most mass near 0
      case 2: x = static_cast<float>(static_cast<int>(rng() % static_cast<unsigned>(levels))); break;
      case 3: x = (rng() & 1u) ? 0.0f : -0.0f; break;
      case 4: x = (i / lane) % 2 ? nd(rng) : nan; break;  // runs of NaN as long as a vector or part of one
      case 5: x = (i / lane) % 3 == 0 ? -inf : ((i / lane) % 3 == 1 ? nan : nd(rng)); break;
      case 6: x = static_cast<float>(i % (levels * 64)); break;                // ascending runs: ties across blocks
      case 7: x = static_cast<float>(n - i) * 1e-3f; break;                    // descending: the answer is the row's start
      default: x = 100.0f + 1e-5f * static_cast<float>(rng() % 1000u); break;  // a narrow range: long common key prefix
    }
    if (odd > 0 && rng() % static_cast<unsigned>(odd) == 0) {
      const unsigned w = rng() % 4u;
      x = w == 0 ? nan : (w == 1 ? -nan : (w == 2 ? inf : -inf));
    }
    v[static_cast<std::size_t>(i)] = x;
  }
  return v;
}

std::vector<std::int32_t> run(bool cpu, const std::vector<float>& s, std::int64_t k, std::size_t ws_bytes) {
  const auto n = static_cast<std::int64_t>(s.size());
  std::vector<std::byte> ws(ws_bytes);
  Poisoned out(static_cast<std::size_t>(k) + 1);
  if (cpu)
    backend::Cpu::topk(s.data(), n, k, out.data(), Workspace{ws.empty() ? nullptr : ws.data(), ws.size()});
  else
    backend::Scalar::topk(s.data(), n, k, out.data(), Workspace{ws.empty() ? nullptr : ws.data(), ws.size()});
  KVP_FUZZ_CHECK(out.v.back() == kPoison, "topk wrote past k = %lld (n = %lld)", static_cast<long long>(k), static_cast<long long>(n));
  out.v.pop_back();
  return out.v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider fdp(data, size);
  std::int64_t n = 0;
  switch (fdp.ConsumeIntegralInRange<int>(0, 3)) {
    case 0: n = fdp.ConsumeIntegralInRange<std::int64_t>(1, 300); break;
    case 1: n = fdp.ConsumeIntegralInRange<std::int64_t>(256, 8192); break;
    case 2: n = fdp.ConsumeIntegralInRange<std::int64_t>(8192, 40000); break;
    default:
      n = fdp.PickValueInArray({std::int64_t{4095}, std::int64_t{4097}, std::int64_t{8191}, std::int64_t{32768}, std::int64_t{32769}});
  }
  std::int64_t k = 0;
  switch (fdp.ConsumeIntegralInRange<int>(0, 3)) {
    case 0: k = fdp.ConsumeIntegralInRange<std::int64_t>(0, n); break;
    case 1: k = fdp.ConsumeIntegralInRange<std::int64_t>(0, std::max<std::int64_t>(1, n / 64)); break;
    case 2: k = n / fdp.ConsumeIntegralInRange<std::int64_t>(1, 128); break;
    default: k = fdp.ConsumeIntegralInRange<std::int64_t>(1, 80); break;
  }
  k = std::clamp<std::int64_t>(k, 0, n);
  const std::vector<float> s = make_row(fdp, n);
  const auto ref = run(false, s, k, backend::Scalar::topk_workspace(n));
  const CpuIsa saved = backend::Cpu::isa();
  for (CpuIsa isa : {CpuIsa::kSse2, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (isa > backend::Cpu::best_isa()) continue;
    backend::Cpu::set_isa(isa);
    const auto got = run(true, s, k, backend::Cpu::topk_workspace(n));
    KVP_FUZZ_CHECK(got == ref, "Cpu (%s) and Scalar differ: n = %lld, k = %lld", cpu_isa_name(isa), static_cast<long long>(n),
                   static_cast<long long>(k));
  }
  backend::Cpu::set_isa(saved);
  // A workspace one byte short of the Cpu form's size takes the reference path: the same indices.
  const std::size_t full = backend::Cpu::topk_workspace(n);
  if (full > 0 && full - 1 >= backend::Scalar::topk_workspace(n)) {
    KVP_FUZZ_CHECK(run(true, s, k, full - 1) == ref, "the fallback differs: n = %lld, k = %lld", static_cast<long long>(n),
                   static_cast<long long>(k));
  }
  return 0;
}
