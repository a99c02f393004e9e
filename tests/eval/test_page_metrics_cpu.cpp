// eval/page_metrics.hpp on the CPU backend: the same shapes and NaN rule as the reference.
#include <catch2/catch.hpp>

#include "eval/eval_test_util.hpp"
#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/util/thread_pool.hpp"

using namespace kvpolicy;
using namespace eval_test;

TEST_CASE("attend_pages<Cpu>: every (group, head_dim, page_size) matches the reference, no reference fallback", "[eval][attention][cpu]") {
  const std::uint64_t fallbacks = backend::Cpu::reference_fallbacks();
  check_many_shapes<backend::Cpu>(ExecContext{});
  ThreadPool pool(2);
  check_many_shapes<backend::Cpu>(pool.context());
  REQUIRE(backend::Cpu::reference_fallbacks() == fallbacks);
}

TEST_CASE("attend_pages<Cpu>: a NaN query gives NaN output and lse, as the reference", "[eval][attention][cpu][nan]") {
  check_nan_query<backend::Cpu>(ExecContext{});
}
