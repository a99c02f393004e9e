// SPDX-License-Identifier: Apache-2.0
// Grouped-query attention head mapping: query head h reads kv head h / G
// (the `repeat_kv` layout; query heads [g*G, (g+1)*G) share kv head g).
#pragma once

#include <cstdint>

#include "kvpolicy/core/status.hpp"

KVP_NAMESPACE_BEGIN

struct GqaMap {
  std::int32_t num_q_heads = 0;
  std::int32_t num_kv_heads = 0;

  constexpr std::int32_t group_size() const noexcept { return num_q_heads / num_kv_heads; }
  constexpr std::int32_t kv_head(std::int32_t q_head) const noexcept { return q_head / group_size(); }
  constexpr std::int32_t first_q_head(std::int32_t kv_head) const noexcept { return kv_head * group_size(); }

  /// Validates positivity and divisibility; `who` prefixes the message.
  static Status make(std::int64_t num_q_heads, std::int64_t num_kv_heads, const char* who, GqaMap* out) noexcept {
    KVP_REQUIRE(num_kv_heads > 0, "%s: keys has %lld kv heads, must be > 0", who, static_cast<long long>(num_kv_heads));
    KVP_REQUIRE(num_q_heads > 0, "%s: queries has %lld heads, must be > 0", who, static_cast<long long>(num_q_heads));
    KVP_REQUIRE(num_q_heads % num_kv_heads == 0, "%s: queries has %lld heads, not a multiple of the %lld kv heads", who,
                static_cast<long long>(num_q_heads), static_cast<long long>(num_kv_heads));
    out->num_q_heads = static_cast<std::int32_t>(num_q_heads);
    out->num_kv_heads = static_cast<std::int32_t>(num_kv_heads);
    return Status::ok();
  }
};

KVP_NAMESPACE_END
