// Run-time ISA selection of backend::Cpu.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <cstring>
#include <string>

#include "cpu_test_util.hpp"

using namespace kvp_cpu_test;

TEST_CASE("Cpu ISA: the level in use honours KVP_CPU_ISA at first use", "[cpu][isa]") {
  // Must be the first use of the backend in this process (ctest runs each
  // test case in its own process). tests.cmake also runs this case with
  // KVP_CPU_ISA=sse2 set.
  const char* env = std::getenv("KVP_CPU_ISA");
  CpuIsa expected = Cpu::best_isa();
  if (env != nullptr) {
    for (CpuIsa isa : {CpuIsa::kSse2, CpuIsa::kAvx2, CpuIsa::kAvx512})
      if (std::strcmp(env, cpu_isa_name(isa)) == 0 && isa <= Cpu::best_isa()) expected = isa;
  }
  INFO("KVP_CPU_ISA=" << (env ? env : "(unset)") << ", best " << cpu_isa_name(Cpu::best_isa()));
  REQUIRE(Cpu::isa() == expected);
  REQUIRE(std::string(Cpu::isa_name()) == cpu_isa_name(expected));
}

TEST_CASE("Cpu ISA: set_isa switches among available levels and refuses missing ones", "[cpu][isa]") {
  IsaGuard guard;
  const CpuIsa best = Cpu::best_isa();
  REQUIRE(Cpu::best_isa() >= CpuIsa::kSse2);
  for (CpuIsa isa : {CpuIsa::kSse2, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    REQUIRE(Cpu::set_isa(CpuIsa::kSse2));
    if (isa <= best) {
      REQUIRE(Cpu::set_isa(isa));
      REQUIRE(Cpu::isa() == isa);
      REQUIRE(std::string(Cpu::isa_name()) == cpu_isa_name(isa));
    } else {
      REQUIRE_FALSE(Cpu::set_isa(isa));
      REQUIRE(Cpu::isa() == CpuIsa::kSse2);  // unchanged
    }
  }
  REQUIRE(std::string(cpu_isa_name(CpuIsa::kAvx512)) == "avx512");
  REQUIRE(std::string(cpu_isa_name(CpuIsa::kAvx2)) == "avx2");
  REQUIRE(std::string(cpu_isa_name(CpuIsa::kSse2)) == "sse2");
}

TEST_CASE("Cpu ISA: backend::Cpu offers every op of the contract", "[cpu][isa]") {
  // Hidden by CpuScoreOps (compiled kernels) ...
  STATIC_REQUIRE(std::is_same_v<decltype(&Cpu::topk), decltype(&backend::CpuScoreOps::topk)>);
  STATIC_REQUIRE(&Cpu::topk == &backend::CpuScoreOps::topk);
  STATIC_REQUIRE(&Cpu::pool1d == &backend::CpuScoreOps::pool1d);
  STATIC_REQUIRE(&Cpu::window_scores_workspace == &backend::CpuScoreOps::window_scores_workspace);
  // ... and the rest inherited from the reference.
  STATIC_REQUIRE(&Cpu::group_reduce == &backend::ScalarScoreOps::group_reduce);
  // The explicit template form works as for the scalar reference.
  std::vector<float> q(4, 1.0f), k(8, 0.5f), out(2);
  const WindowScoreShape s{1, 1, 4, 2, 2, 1, 0.5f, WindowReduce::kSum};
  std::vector<std::byte> ws(Cpu::window_scores_workspace(s));
  Cpu::template window_scores<float>(s, q.data(), Rows<float>{k.data(), 4}, out.data(), Workspace{ws.data(), ws.size()});
  REQUIRE(out[0] == Approx(0.5f));
  REQUIRE(out[1] == Approx(0.5f));
}
