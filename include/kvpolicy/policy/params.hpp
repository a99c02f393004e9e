// SPDX-License-Identifier: Apache-2.0
// Parameters declared once: every `Params` struct lists its user-facing fields
// in `static constexpr auto fields() { return std::tuple{...}; }` (a function,
// so the list may name members of the struct being defined), and that one list is
// what the registry's spec strings ("snapkv:compression_ratio=0.5,window=64"),
// `kvpolicy-compare --list-policies`, CSV columns and Python keyword arguments
// are generated from.
//
//   struct SnapKVParams { std::int32_t window = 64; ... Budget budget = ...;
//     static constexpr auto fields() {
//       return std::tuple{param_field<&SnapKVParams::window>("window", "observation window"), ...,
//                         budget_field<&SnapKVParams::budget>()};
//     }
//   };
//
// Value syntax: integers and reals as in C (`64`, `0.5`, `1e-3`); bool
// `true|false|1|0`; enums by their lower-case names (`avg`, `max`, ...); a
// `Budget` is set through one of three keys, `compression_ratio=r` (kvpress's
// fraction removed), `tokens=n` or `keep_ratio=f`, which change the budget's
// kind and value and keep its flags (protected inside / clamped to the length /
// at least one) as the preset set them. A policy with several budgets names
// their keys itself (`budget_field<&H2OParams::heavy>({"hh_size", "heavy_ratio"})`:
// hh_size=n is a token count, heavy_ratio=f a keep ratio); a kind without a key
// is not settable from a spec string.
//
// A field is a getter/setter pair, so a field may also write several members
// that must agree (PyramidKV's window lives in its scorer and its schedule).
#pragma once

#include <algorithm>
#include <array>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kvpolicy/core/status.hpp"
#include "kvpolicy/ops/types.hpp"
#include "kvpolicy/policy/budget.hpp"

KVP_NAMESPACE_BEGIN

/// One named value of an enum, for spec strings and listings.
template <class E>
struct EnumName {
  std::string_view name;
  E value;
};

// Names of the ops-level enums (policy headers add their own next to the enum).
inline constexpr EnumName<Pooling> kPoolingNames[] = {{"none", Pooling::kNone}, {"avg", Pooling::kAvg}, {"max", Pooling::kMax}};
constexpr std::span<const EnumName<Pooling>> enum_names(Pooling) noexcept { return kPoolingNames; }
inline constexpr EnumName<WindowReduce> kWindowReduceNames[] = {{"mean", WindowReduce::kMean}, {"sum", WindowReduce::kSum}};
constexpr std::span<const EnumName<WindowReduce>> enum_names(WindowReduce) noexcept { return kWindowReduceNames; }
inline constexpr EnumName<GroupReduce> kGroupReduceNames[] = {
    {"mean", GroupReduce::kMean}, {"max", GroupReduce::kMax}, {"sum", GroupReduce::kSum}};
constexpr std::span<const EnumName<GroupReduce>> enum_names(GroupReduce) noexcept { return kGroupReduceNames; }

/// A user-facing parameter of `P` of value type `T`.
template <class P, class T>
struct ParamField {
  using Params = P;
  using Value = T;
  std::string_view name;
  std::string_view doc;
  T (*get)(const P&);
  void (*set)(P&, const T&);
  /// Budget fields only: the spec key of each `BudgetKind` (tokens, keep_ratio,
  /// compression_ratio); an empty key is not accepted.
  std::array<std::string_view, 3> budget_keys = std::is_same_v<T, Budget>
                                                    ? std::array<std::string_view, 3>{"tokens", "keep_ratio", "compression_ratio"}
                                                    : std::array<std::string_view, 3>{};
};

/// Spec keys of a `Budget` field, in `BudgetKind` order (empty: kind not settable).
struct BudgetKeys {
  std::string_view tokens = "tokens";
  std::string_view keep_ratio = "keep_ratio";
  std::string_view compression_ratio = "compression_ratio";
};

namespace detail {
template <class M>
struct member_traits;
template <class P, class T>
struct member_traits<T P::*> {
  using Params = P;
  using Value = T;
};
}  // namespace detail

/// The field backed by data member `M`.
template <auto M>
constexpr auto param_field(std::string_view name, std::string_view doc) noexcept {
  using P = typename detail::member_traits<decltype(M)>::Params;
  using T = typename detail::member_traits<decltype(M)>::Value;
  return ParamField<P, T>{name, doc, [](const P& p) -> T { return p.*M; }, [](P& p, const T& v) { p.*M = v; }};
}

/// The budget field backed by member `M` (keys compression_ratio / tokens / keep_ratio).
template <auto M>
constexpr auto budget_field(std::string_view doc = "budget: compression_ratio=r | tokens=n | keep_ratio=f") noexcept {
  auto f = param_field<M>("budget", doc);
  f.budget_keys = {"tokens", "keep_ratio", "compression_ratio"};
  return f;
}

/// A budget field named `name` whose kinds are set through `keys` (a policy
/// with more than one budget, or with its reference's key names).
template <auto M>
constexpr auto budget_field(std::string_view name, BudgetKeys keys, std::string_view doc) noexcept {
  auto f = param_field<M>(name, doc);
  f.budget_keys = {keys.tokens, keys.keep_ratio, keys.compression_ratio};
  return f;
}

/// Declares its fields (`P::fields()`).
template <class P>
concept DeclaresFields = requires {
  P::fields();
};

/// Every enum-typed field of `p` holds one of its named values: an engine or
/// a binding may cast any integer to a policy enum, and a policy must reject
/// the value before switching on it. The message names the field.
template <class P>
Status check_enum_fields(const char* who, const P& p) noexcept {
  if constexpr (DeclaresFields<P>) {
    Status s = Status::ok();
    auto one = [&](const auto& f) {
      using T = typename std::decay_t<decltype(f)>::Value;
      if constexpr (std::is_enum_v<T>) {
        if (!s.is_ok()) return;
        const T v = f.get(p);
        char names[160] = {};
        std::size_t used = 0;
        for (const auto& e : enum_names(T{})) {
          if (e.value == v) return;
          const int n =
              std::snprintf(names + used, sizeof names - used, "%s%.*s", used ? " | " : "", static_cast<int>(e.name.size()), e.name.data());
          if (n > 0) used = std::min(sizeof names - 1, used + static_cast<std::size_t>(n));
        }
        s = KVP_INVALID("%s: %.*s is %lld, not one of %s", who, static_cast<int>(f.name.size()), f.name.data(),
                        static_cast<long long>(static_cast<std::underlying_type_t<T>>(v)), names);
      }
    };
    std::apply([&](const auto&... f) { (one(f), ...); }, P::fields());
    return s;
  } else {
    (void)who;
    (void)p;
    return Status::ok();
  }
}

/// One parameter as listed for users: its key, its value in spec syntax, its doc.
struct ParamInfo {
  std::string name;
  std::string value;
  std::string doc;
};

namespace detail {

inline std::string format_double(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  // shortest round-trip form
  for (int prec = 1; prec <= 17; ++prec) {
    char tmp[64];
    std::snprintf(tmp, sizeof tmp, "%.*g", prec, v);
    if (std::strtod(tmp, nullptr) == v) return tmp;
  }
  return buf;
}

constexpr std::size_t budget_kind_index(BudgetKind k) noexcept {
  return k == BudgetKind::kTokens ? 0 : k == BudgetKind::kKeepRatio ? 1 : 2;
}
constexpr BudgetKind kBudgetKinds[3] = {BudgetKind::kTokens, BudgetKind::kKeepRatio, BudgetKind::kCompressionRatio};

template <class T>
std::string format_value(const T& v) {
  if constexpr (std::is_same_v<T, bool>) {
    return v ? "true" : "false";
  } else if constexpr (std::is_enum_v<T>) {
    for (const auto& e : enum_names(T{}))
      if (e.value == v) return std::string(e.name);
    return std::to_string(static_cast<int>(v));
  } else if constexpr (std::is_integral_v<T>) {
    return std::to_string(v);
  } else if constexpr (std::is_floating_point_v<T>) {
    return format_double(static_cast<double>(v));
  } else if constexpr (std::is_same_v<T, Budget>) {
    return v.kind == BudgetKind::kTokens ? std::to_string(static_cast<std::int64_t>(v.value)) : format_double(v.value);
  } else {
    static_assert(sizeof(T) == 0, "unsupported parameter type");
  }
}

template <class T>
std::string enum_choices() {
  std::string s;
  for (const auto& e : enum_names(T{})) {
    if (!s.empty()) s += "|";
    s += e.name;
  }
  return s;
}

/// Parses `text` into `*out`; errors name the policy, the key and the accepted form.
template <class T>
Status parse_value(const char* who, std::string_view key, std::string_view text, T* out) {
  const std::string t(text);
  if constexpr (std::is_same_v<T, bool>) {
    if (t == "true" || t == "1")
      *out = true;
    else if (t == "false" || t == "0")
      *out = false;
    else
      return KVP_INVALID("%s: %s is '%s', expected true|false", who, std::string(key).c_str(), t.c_str());
  } else if constexpr (std::is_enum_v<T>) {
    for (const auto& e : enum_names(T{}))
      if (e.name == text) {
        *out = e.value;
        return Status::ok();
      }
    return KVP_INVALID("%s: %s is '%s', expected one of %s", who, std::string(key).c_str(), t.c_str(), enum_choices<T>().c_str());
  } else if constexpr (std::is_integral_v<T>) {
    std::int64_t v = 0;
    const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
    if (ec != std::errc{} || end != t.data() + t.size() || t.empty())
      return KVP_INVALID("%s: %s is '%s', expected an integer", who, std::string(key).c_str(), t.c_str());
    if (v < static_cast<std::int64_t>(std::numeric_limits<T>::min()) || v > static_cast<std::int64_t>(std::numeric_limits<T>::max()))
      return KVP_INVALID("%s: %s is %lld, out of range of its type", who, std::string(key).c_str(), static_cast<long long>(v));
    *out = static_cast<T>(v);
  } else if constexpr (std::is_floating_point_v<T>) {
    char* end = nullptr;
    const double v = std::strtod(t.c_str(), &end);
    if (t.empty() || end != t.c_str() + t.size())
      return KVP_INVALID("%s: %s is '%s', expected a number", who, std::string(key).c_str(), t.c_str());
    *out = static_cast<T>(v);
  } else {
    static_assert(sizeof(T) == 0, "unsupported parameter type");
  }
  return Status::ok();
}

}  // namespace detail

/// Calls f(field) for every field of `P`.
template <DeclaresFields P, class F>
constexpr void for_each_field(F&& f) {
  std::apply([&](const auto&... field) { (f(field), ...); }, P::fields());
}

/// The keys a spec string accepts for `P`, in declaration order (a budget expands to its kinds' keys).
template <DeclaresFields P>
std::vector<std::string> param_keys() {
  std::vector<std::string> keys;
  for_each_field<P>([&](const auto& f) {
    if constexpr (std::is_same_v<typename std::decay_t<decltype(f)>::Value, Budget>) {
      for (std::size_t k : {2u, 0u, 1u})
        if (!f.budget_keys[k].empty()) keys.emplace_back(f.budget_keys[k]);
    } else {
      keys.emplace_back(f.name);
    }
  });
  return keys;
}

/// `p`'s fields as users see them (the budget listed under its current kind's key).
template <DeclaresFields P>
std::vector<ParamInfo> describe_params(const P& p) {
  std::vector<ParamInfo> out;
  for_each_field<P>([&](const auto& f) {
    using T = typename std::decay_t<decltype(f)>::Value;
    const T v = f.get(p);
    if constexpr (std::is_same_v<T, Budget>) {
      const std::string_view key = f.budget_keys[detail::budget_kind_index(v.kind)];
      out.push_back({key.empty() ? std::string(f.name) : std::string(key), detail::format_value(v), std::string(f.doc)});
    } else if constexpr (std::is_enum_v<T>) {
      out.push_back({std::string(f.name), detail::format_value(v), std::string(f.doc) + " (" + detail::enum_choices<T>() + ")"});
    } else {
      out.push_back({std::string(f.name), detail::format_value(v), std::string(f.doc)});
    }
  });
  return out;
}

/// Sets the field of `p` named `key` (a budget through the key of one of its
/// kinds) from `value`; unknown keys name the valid ones.
/// `p` is unchanged on error.
template <DeclaresFields P>
Status set_param(const char* who, P& p, std::string_view key, std::string_view value) {
  Status st = Status::ok();
  bool found = false;
  for_each_field<P>([&](const auto& f) {
    using T = typename std::decay_t<decltype(f)>::Value;
    if (found) return;
    if constexpr (std::is_same_v<T, Budget>) {
      std::size_t k = 0;
      while (k < 3 && (f.budget_keys[k].empty() || key != f.budget_keys[k])) ++k;
      if (k == 3) return;
      const BudgetKind kind = detail::kBudgetKinds[k];
      found = true;
      double v = 0.0;
      st = detail::parse_value(who, key, value, &v);
      if (!st.is_ok()) return;
      Budget b = f.get(p);
      b.kind = kind;
      b.value = v;
      st = b.validate(who);
      if (st.is_ok()) f.set(p, b);
    } else {
      if (key != f.name) return;
      found = true;
      T v{};
      st = detail::parse_value(who, key, value, &v);
      if (st.is_ok()) f.set(p, v);
    }
  });
  if (!found) {
    std::string valid;
    for (const auto& k : param_keys<P>()) valid += (valid.empty() ? "" : ", ") + k;
    return KVP_INVALID("%s: unknown parameter '%s'; valid: %s", who, std::string(key).c_str(), valid.c_str());
  }
  return st;
}

KVP_NAMESPACE_END
