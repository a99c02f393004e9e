// Every policy of this area on backend::Cpu at every instruction-set level the
// machine runs gives the scalar reference's KeepSets.
#include <catch2/catch.hpp>

#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/eviction/h2o.hpp"
#include "kvpolicy/policy/eviction/observed_attention.hpp"
#include "kvpolicy/policy/eviction/tova.hpp"
#include "policy/policy_test_util.hpp"

using namespace kvpolicy;

namespace {

/// H2O decisions after accumulating the attention of a whole prompt recomputed from queries and keys.
template <class Backend, class Tk>
KeepSetBuffer h2o_prefill(const RandomCase<Tk>& rc, const ScoreInput<float, Tk>& in) {
  const H2O policy(H2OParams::original(rc.T / 4, rc.T / 8));
  std::vector<float> s(static_cast<std::size_t>(rc.Hkv * rc.T));
  H2OState st{TensorView<float, 2>::contiguous(s.data(), {rc.Hkv, rc.T}), 0};
  // one size query covers the update from queries and the evict
  const Requirements req = policy.requirements(Context<Backend>{}, ProblemShape{rc.Hq, rc.Hkv, rc.d, rc.T, rc.T});
  REQUIRE(req.status.is_ok());
  std::vector<std::byte> ws(req.workspace_bytes);
  const Context<Backend> cx{Workspace{ws.data(), ws.size()}};
  REQUIRE(policy.update(cx, st, in).is_ok());
  KeepSetBuffer keep(rc.Hkv, rc.Hkv * rc.T);
  REQUIRE(policy.evict(cx, st, keep.view()).is_ok());
  return keep;
}

struct IsaGuard {
  CpuIsa saved = backend::Cpu::isa();
  ~IsaGuard() { backend::Cpu::set_isa(saved); }
};

}  // namespace

TEST_CASE("online policies: backend::Cpu equals backend::Scalar at every ISA level", "[online][backends]") {
  IsaGuard guard;
  RandomCase<half> rc(16, 4, 333, 128, 333, 17);
  const auto in = rc.input();
  const TOVA tova(TOVAParams::kvpress(0.6));
  const ObservedAttention observed(ObservedAttentionParams::kvpress(0.7)), factory(ObservedAttentionParams::kvcache_factory_h2o(100, 8));
  const auto ref_tova = run_evict<backend::Scalar>(tova, in);
  const auto ref_obs = run_evict<backend::Scalar>(observed, in), ref_fac = run_evict<backend::Scalar>(factory, in);
  const auto ref_h2o = h2o_prefill<backend::Scalar>(rc, in);
  for (CpuIsa isa : {CpuIsa::kSse2, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (!backend::Cpu::set_isa(isa)) continue;
    INFO(cpu_isa_name(isa));
    REQUIRE(run_evict<backend::Cpu>(tova, in) == ref_tova);
    REQUIRE(run_evict<backend::Cpu>(observed, in) == ref_obs);
    REQUIRE(run_evict<backend::Cpu>(factory, rc.paged_input(16)) == ref_fac);
    REQUIRE(h2o_prefill<backend::Cpu>(rc, in) == ref_h2o);
  }
}
