// SPDX-License-Identifier: Apache-2.0
// `KeepSet`: an eviction decision. One row per (sequence, kv head), row index
// `seq * num_kv_heads + head`, each row the kept token ids in ascending order
// (CSR: `indptr[r] .. indptr[r+1]` into `indices`). Rows have equal length
// for uniform budgets and differ for per-head allocation (Ada-KV). Memory is
// caller-owned; size it from the policy's `requirements()` (output rows, capacity).
#pragma once

#include <cstdint>
#include <span>

#include "kvpolicy/core/status.hpp"

KVP_NAMESPACE_BEGIN

struct KeepSet {
  std::int32_t* indptr = nullptr;   // (num_rows + 1)
  std::int32_t* indices = nullptr;  // (capacity)
  std::int64_t num_rows = 0;
  std::int64_t capacity = 0;

  std::span<const std::int32_t> row(std::int64_t r) const noexcept {
    return {indices + indptr[r], static_cast<std::size_t>(indptr[r + 1] - indptr[r])};
  }
  std::int64_t row_size(std::int64_t r) const noexcept { return indptr[r + 1] - indptr[r]; }

  Status check_output(const char* who, std::int64_t rows_needed, std::int64_t total_needed) const noexcept {
    if (indptr == nullptr) return KVP_INVALID("%s: keep set indptr is null", who);
    if (num_rows != rows_needed)
      return KVP_INVALID("%s: keep set has %lld rows, expected %lld (sequences x kv heads)", who, static_cast<long long>(num_rows),
                         static_cast<long long>(rows_needed));
    if (total_needed > 0 && indices == nullptr) return KVP_INVALID("%s: keep set indices is null", who);
    if (capacity < total_needed)
      return Status::error(StatusCode::kOutputTooSmall, "%s: keep set capacity is %lld, needs %lld", who, static_cast<long long>(capacity),
                           static_cast<long long>(total_needed));
    return Status::ok();
  }
};

KVP_NAMESPACE_END
