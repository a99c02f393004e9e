// SPDX-License-Identifier: Apache-2.0
// Policy spec strings: `name[:key=value[,key=value]...]`, parsed and applied
// to a policy's `Params` (keys and value syntax: kvpolicy/policy/params.hpp).
// Backend-free; the run-time registry (kvpolicy/registry.hpp, in kvpolicy::cpu)
// and the quantization spec pairs (quantization/quant_spec.hpp) build on it.
//
//   SnapKV p;
//   throw_if_error(make_policy("snapkv:compression_ratio=0.5,window=64", &p));
//
// Errors name the bad key and list the valid ones ("snapkv: unknown parameter
// 'windw'; valid: window, kernel, ...").
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvpolicy/core/status.hpp"
#include "kvpolicy/policy/params.hpp"

KVP_NAMESPACE_BEGIN

/// A parsed spec string: the policy name and its key=value pairs, in order.
struct PolicySpec {
  std::string name;
  std::vector<std::pair<std::string, std::string>> args;
};

/// Parses `name[:key=value,...]` (whitespace around tokens is ignored).
inline Status parse_policy_spec(std::string_view spec, PolicySpec* out) {
  auto trim = [](std::string_view s) {
    while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
    while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
    return s;
  };
  PolicySpec p;
  const std::size_t colon = spec.find(':');
  p.name = std::string(trim(spec.substr(0, colon)));
  if (p.name.empty()) return KVP_INVALID("policy spec '%s': empty policy name", std::string(spec).c_str());
  if (colon != std::string_view::npos) {
    std::string_view rest = spec.substr(colon + 1);
    while (!rest.empty()) {
      const std::size_t comma = rest.find(',');
      const std::string_view item = trim(rest.substr(0, comma));
      rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
      if (item.empty()) continue;
      const std::size_t eq = item.find('=');
      if (eq == std::string_view::npos || trim(item.substr(0, eq)).empty())
        return KVP_INVALID("%s: parameter '%s' is not key=value", p.name.c_str(), std::string(item).c_str());
      p.args.emplace_back(std::string(trim(item.substr(0, eq))), std::string(trim(item.substr(eq + 1))));
    }
  }
  *out = std::move(p);
  return Status::ok();
}

/// Applies the spec's arguments to `params` (unchanged on error).
template <DeclaresFields P>
Status apply_spec_args(const char* who, const PolicySpec& spec, P& params) {
  P p = params;
  for (const auto& [k, v] : spec.args) KVP_RETURN_IF_ERROR(set_param(who, p, k, v));
  params = p;
  return Status::ok();
}

/// `name` and `name:key=value,...` for a concrete policy type `P` whose
/// Params declare their fields, starting from `defaults`.
template <class P>
Status make_policy(std::string_view spec_text, P* out, const typename P::Params& defaults = typename P::Params{}) {
  PolicySpec spec;
  KVP_RETURN_IF_ERROR(parse_policy_spec(spec_text, &spec));
  KVP_REQUIRE(spec.name == P::kName, "policy spec names '%s', expected '%s'", spec.name.c_str(), P::kName);
  typename P::Params params = defaults;
  KVP_RETURN_IF_ERROR(apply_spec_args(P::kName, spec, params));
  const P policy(params);
  KVP_RETURN_IF_ERROR(policy.validate_params());
  *out = policy;
  return Status::ok();
}

KVP_NAMESPACE_END
