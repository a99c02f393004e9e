// SPDX-License-Identifier: Apache-2.0
// A K/V quantization chosen at run time from a spec string, handed to a
// callback as typed policies (no virtual dispatch in the per-row loops):
//
//   visit_quant_spec("int4:rotation=block,block=16|int4:rotation=none", [&](auto keys, auto values) { ... });
//
// "SPEC" quantizes K and V with the same parameters; "K_SPEC|V_SPEC" gives
// each its own (one format name for both). Formats with a `role` parameter
// (ggml and int4: llama.cpp's rotation block differs; KIVI: the grouping
// axis) get role=keys for K and role=values for V whatever the spec says.
// Names: ggml, fp8, int4, kivi (the registry's quantization entries). Errors
// (unknown name, bad key, two formats) come back as the returned Status and
// the callback is not called.
#pragma once

#include <string>
#include <string_view>

#include "kvpolicy/policy/quantization/fp8_quant.hpp"
#include "kvpolicy/policy/quantization/ggml_quant.hpp"
#include "kvpolicy/policy/quantization/int4_quant.hpp"
#include "kvpolicy/policy/quantization/kivi_quant.hpp"
#include "kvpolicy/policy/spec.hpp"

KVP_NAMESPACE_BEGIN

/// `q` with its role set (formats without one are returned as they are).
template <class Q>
Q with_quant_role(Q q, QuantRole role) noexcept {
  if constexpr (requires { q.params().role; }) {
    auto p = q.params();
    p.role = role;
    return Q(p);
  } else {
    return q;
  }
}

/// Parses `spec` and calls f(keys_policy, values_policy) once; f returns Status.
template <class F>
Status visit_quant_spec(std::string_view spec, F&& f) {
  const std::size_t bar = spec.find('|');
  const std::string_view ks = spec.substr(0, bar), vs = bar == std::string_view::npos ? ks : spec.substr(bar + 1);
  PolicySpec pk, pv;
  KVP_RETURN_IF_ERROR(parse_policy_spec(ks, &pk));
  KVP_RETURN_IF_ERROR(parse_policy_spec(vs, &pv));
  KVP_REQUIRE(pk.name == pv.name, "quantization spec '%s': K and V name different formats ('%s', '%s')", std::string(spec).c_str(),
              pk.name.c_str(), pv.name.c_str());
  auto build = [&](auto k) -> Status {
    decltype(k) v;
    KVP_RETURN_IF_ERROR(make_policy(ks, &k));
    KVP_RETURN_IF_ERROR(make_policy(vs, &v));
    return f(with_quant_role(k, QuantRole::kKeys), with_quant_role(v, QuantRole::kValues));
  };
  if (pk.name == "ggml") return build(GgmlQuant{});
  if (pk.name == "fp8") return build(Fp8Quant{});
  if (pk.name == "int4") return build(Int4Quant{});
  if (pk.name == "kivi") return build(KiviQuant{});
  return KVP_INVALID("quantization spec '%s' names '%s'; known formats: ggml, fp8, int4, kivi", std::string(spec).c_str(), pk.name.c_str());
}

KVP_NAMESPACE_END
