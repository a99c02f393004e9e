// Fuzz target: the registry's spec parser and builders (kvpolicy/registry.hpp)
// on arbitrary spec strings: parse_policy_spec, make_eviction_policy and the
// typed make_policy<H2O / Quest>. Contract: no crash or sanitizer report; a
// parsed spec has a non-empty name and non-empty keys; a failed build leaves
// the output policy as it was; a built policy answers its size queries.
#include <string>

#include "fuzz_util.hpp"
#include "kvpolicy/kvpolicy.hpp"
#include "kvpolicy/registry.hpp"

using namespace kvpolicy;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string spec(reinterpret_cast<const char*>(data), size);
  PolicySpec parsed;
  parsed.name = "sentinel";
  const Status ps = parse_policy_spec(spec, &parsed);
  if (ps.is_ok()) {
    KVP_FUZZ_CHECK(!parsed.name.empty(), "empty name accepted");
    for (const auto& [k, v] : parsed.args) KVP_FUZZ_CHECK(!k.empty(), "empty key accepted");
  } else {
    KVP_FUZZ_CHECK(parsed.name == "sentinel" && parsed.args.empty(), "failed parse wrote the output");
  }

  AnyEvictionPolicy p;
  KVP_FUZZ_CHECK(make_eviction_policy("streaming_llm", &p).is_ok(), "default spec");
  const Status ms = make_eviction_policy(spec, &p);
  if (!ms.is_ok()) {
    KVP_FUZZ_CHECK(p.name() == "streaming_llm", "failed build replaced the policy with '%s'", p.name().c_str());
    KVP_FUZZ_CHECK(ms.message()[0] != '\0', "error without a message");
  } else {
    KVP_FUZZ_CHECK(ps.is_ok(), "built from a spec that does not parse: %s", ps.message());
    for (std::int64_t T : {0, 1, 7, 64, 4096}) {
      const std::int64_t n = p.kept_count(T);
      KVP_FUZZ_CHECK(n <= T, "%s keeps %lld of %lld tokens", p.name().c_str(), static_cast<long long>(n), static_cast<long long>(T));
      (void)p.protected_tokens(T);
    }
    for (const BackendKind b : {BackendKind::kScalar, BackendKind::kCpu}) {
      const Requirements r = p.requirements(b, ProblemShape{4, 2, 8, 64, 8, 2});
      if (r.status.is_ok())
        KVP_FUZZ_CHECK(r.output.rows == 2 * 2 || r.output.rows == 2 * 4, "rows %lld", static_cast<long long>(r.output.rows));
    }
  }
  H2O h2o;
  (void)make_policy<H2O>(spec, &h2o);
  Quest quest;
  if (make_policy<Quest>(spec, &quest).is_ok()) (void)quest.page_budget(16, 1000);
  return 0;
}
