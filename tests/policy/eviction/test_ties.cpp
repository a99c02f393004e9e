// Decisions on exactly tied inputs are the same on backend::Scalar and on
// backend::Cpu at every instruction-set level (issue #16, deliverable 2).
//
// Exact ties come from repeated inputs: identical key rows (a repeated token,
// a constant or zero cache), queries that make every logit equal, repeated
// value rows. The contract tested here: when two tokens' inputs are identical,
// every backend computes bit-identical scores for them (the score of a token
// does not depend on where it sits in a SIMD block, a tail loop or a page), so
// the tie-break (higher score, then the more recent token) decides the same
// way everywhere. Tokens whose scores tie only mathematically, from different
// inputs, are within the stated float tolerance and may be ordered
// differently by backends; that case is not claimed.
#include <catch2/catch.hpp>

#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/eviction/h2o.hpp"
#include "kvpolicy/policy/eviction/observed_attention.hpp"
#include "kvpolicy/policy/eviction/tova.hpp"
#include "kvpolicy/policy/selection/quest.hpp"
#include "kvpolicy/registry.hpp"
#include "policy/policy_test_util.hpp"

using namespace kvpolicy;
using kvp_test::KeepSetBuffer;
using kvp_test::RandomCase;

namespace {

struct IsaGuard {
  CpuIsa saved = backend::Cpu::isa();
  ~IsaGuard() { backend::Cpu::set_isa(saved); }
};

/// A tied pattern: rewrites a case's keys (and queries) in place.
struct Pattern {
  const char* name;
  std::function<void(std::vector<float>& keys, std::vector<float>& queries, std::int64_t H, std::int64_t T, std::int64_t d)> apply;
};

std::vector<Pattern> tied_patterns() {
  auto copy_row = [](std::vector<float>& k, std::int64_t T, std::int64_t d, std::int64_t h, std::int64_t from, std::int64_t to) {
    std::copy_n(k.begin() + (h * T + from) * d, d, k.begin() + (h * T + to) * d);
  };
  return {
      {"every key row equal",
       [=](auto& k, auto&, auto H, auto T, auto d) {
         for (std::int64_t h = 0; h < H; ++h)
           for (std::int64_t t = 1; t < T; ++t) copy_row(k, T, d, h, 0, t);
       }},
      {"keys from three distinct rows",
       [=](auto& k, auto&, auto H, auto T, auto d) {
         std::mt19937 rng(11);
         for (std::int64_t h = 0; h < H; ++h)
           for (std::int64_t t = 3; t < T; ++t) copy_row(k, T, d, h, static_cast<std::int64_t>(rng() % 3), t);
       }},
      {"zero keys", [](auto& k, auto&, auto, auto, auto) { std::fill(k.begin(), k.end(), 0.0f); }},
      {"zero queries", [](auto&, auto& q, auto, auto, auto) { std::fill(q.begin(), q.end(), 0.0f); }},
      {"every token repeats token t mod 13",
       [=](auto& k, auto&, auto H, auto T, auto d) {
         for (std::int64_t h = 0; h < H; ++h)
           for (std::int64_t t = 13; t < T; ++t) copy_row(k, T, d, h, t % 13, t);
       }},
      {"constant keys and queries",
       [](auto& k, auto& q, auto, auto, auto) {
         std::fill(k.begin(), k.end(), 0.25f);
         std::fill(q.begin(), q.end(), 0.5f);
       }},
  };
}

/// Scalar and every Cpu level on one input; the policy runs through the registry's erased interface.
template <class Tk>
void check_erased(const std::string& spec, const ScoreInput<float, Tk>& in, const ProblemShape& shape) {
  AnyEvictionPolicy p;
  REQUIRE(make_eviction_policy(spec, &p).is_ok());
  auto run = [&](BackendKind b) {
    const Requirements r = p.requirements(b, shape);
    REQUIRE(r.status.is_ok());
    KeepSetBuffer keep(r.output.rows, r.output.capacity);
    std::vector<std::byte> ws(r.workspace_bytes);
    const Status s = p.evict(b, in, keep.view(), Workspace{ws.data(), ws.size()});
    INFO(s.message());
    REQUIRE(s.is_ok());
    return keep;
  };
  const KeepSetBuffer ref = run(BackendKind::kScalar);
  IsaGuard guard;
  for (CpuIsa isa : {CpuIsa::kSse2, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (!backend::Cpu::set_isa(isa)) continue;
    INFO(cpu_isa_name(isa));
    CHECK(run(BackendKind::kCpu) == ref);
  }
}

template <class Tk>
void erased_policies_on_ties(const char* dtype) {
  const std::int64_t Hq = 8, Hkv = 2, d = 64, w = 16;
  // (spec, whether it reads one query row per prompt token)
  const std::vector<std::pair<std::string, bool>> specs = {
      {"observed_attention", true},
      {"streaming_llm:compression_ratio=0.5", false},
      {"snapkv:compression_ratio=0.5,window=16", false},
      {"snapkv:compression_ratio=0.6,window=16,pooling=max,group_reduce=max", false},
      {"snapkv:compression_ratio=0.4,window=16,pooling=none,group_reduce=sum", false},
      {"tova", false},
      {"pyramidkv:window=16,layer=5", false},
      {"adakv:window=16,compression_ratio=0.6", false},
      {"adakv:window=16,compression_ratio=0.6,variant=original", false},
      {"expected_attention:compression_ratio=0.5,n_sink=2", false},
  };
  for (const std::int64_t T : {std::int64_t{203}, std::int64_t{256}}) {
    for (const Pattern& pat : tied_patterns()) {
      for (const bool full_queries : {false, true}) {
        RandomCase<Tk> rc(Hq, Hkv, T, d, full_queries ? T : w, 5);
        pat.apply(rc.keys, rc.queries, Hkv, T, d);
        for (const bool paged : {false, true}) {
          ScoreInput<float, Tk> in = paged ? rc.paged_input(16) : rc.input();
          // Expected Attention reads values: the same tied rows as the keys.
          std::vector<Tk> values(rc.keys.size());
          for (std::size_t i = 0; i < values.size(); ++i) values[i] = from_float<Tk>(rc.keys[i] * 0.5f);
          in.values = KVSource<Tk>::from(TensorView<const Tk, 3>::contiguous(values.data(), {Hkv, T, d}));
          const ProblemShape shape{Hq, Hkv, d, T, rc.w};
          for (const auto& [spec, full] : specs) {
            if (full != full_queries) continue;
            INFO(dtype << " T=" << T << " pattern '" << pat.name << "'" << (paged ? " paged" : "") << " " << spec);
            check_erased(spec, in, shape);
          }
        }
      }
    }
  }
}

/// H2O (original budgets) after accumulating a whole prompt's attention recomputed from its queries.
template <class Backend, class Tk>
KeepSetBuffer h2o_prefill(const RandomCase<Tk>& rc, const ScoreInput<float, Tk>& in) {
  const H2O policy(H2OParams::original(rc.T / 4, rc.T / 8));
  std::vector<float> s(static_cast<std::size_t>(rc.Hkv * rc.T));
  H2OState st{TensorView<float, 2>::contiguous(s.data(), {rc.Hkv, rc.T}), 0};
  const Requirements req = policy.requirements(Context<Backend>{}, ProblemShape{rc.Hq, rc.Hkv, rc.d, rc.T, rc.T});
  REQUIRE(req.status.is_ok());
  std::vector<std::byte> ws(req.workspace_bytes);
  const Context<Backend> cx{Workspace{ws.data(), ws.size()}};
  REQUIRE(policy.update(cx, st, in).is_ok());
  KeepSetBuffer keep(rc.Hkv, rc.Hkv * rc.T);
  REQUIRE(policy.evict(cx, st, keep.view()).is_ok());
  return keep;
}

}  // namespace

TEST_CASE("ties: H2O from queries and KVCache-Factory observed attention decide identically on Scalar and every ISA level",
          "[ties][backends]") {
  const ObservedAttention factory(ObservedAttentionParams::kvcache_factory_h2o(40, 8));
  for (const std::int64_t T : {std::int64_t{131}, std::int64_t{160}}) {
    for (const Pattern& pat : tied_patterns()) {
      RandomCase<half> rc(8, 2, T, 64, T, 9);
      pat.apply(rc.keys, rc.queries, rc.Hkv, T, rc.d);
      const auto in = rc.input();
      const auto ref_h2o = h2o_prefill<backend::Scalar>(rc, in);
      const auto ref_fac = kvp_test::run_evict<backend::Scalar>(factory, rc.paged_input(16));
      IsaGuard guard;
      for (CpuIsa isa : {CpuIsa::kSse2, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
        if (!backend::Cpu::set_isa(isa)) continue;
        INFO("T=" << T << " pattern '" << pat.name << "' " << cpu_isa_name(isa));
        CHECK(h2o_prefill<backend::Cpu>(rc, in) == ref_h2o);
        CHECK(kvp_test::run_evict<backend::Cpu>(factory, rc.paged_input(16)) == ref_fac);
      }
    }
  }
}

TEST_CASE("ties: every erased eviction policy decides identically on Scalar and every ISA level, fp16 keys", "[ties][backends]") {
  erased_policies_on_ties<half>("fp16");
}
TEST_CASE("ties: every erased eviction policy decides identically on Scalar and every ISA level, bf16 keys", "[ties][backends]") {
  erased_policies_on_ties<bfloat16>("bf16");
}
TEST_CASE("ties: every erased eviction policy decides identically on Scalar and every ISA level, fp32 keys", "[ties][backends]") {
  erased_policies_on_ties<float>("fp32");
}
