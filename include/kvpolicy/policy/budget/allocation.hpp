// SPDX-License-Identifier: Apache-2.0
// Per-head allocation: ragged budgets inside one sequence (one layer).
//
// `HeadAllocation` gives every head of one sequence its own token count, e.g.
// Ada-KV's adaptive counts or a HeadKV-style precomputed table. The declared
// `total` (usually heads x B) is checked against the sum, each count against
// the sequence length; a mismatch is an error that names the head.
//
// `select_per_head` turns per-head scores `(heads, kv_len)` plus an allocation
// into KeepSet rows: head h keeps its `counts[h]` best tokens (scores under
// `score_order_key`, ties to the higher token index), written ascending, CSR
// (`indptr` from the counts). Protected tokens carry +inf scores (the scorer
// contract of SnapKV::score, ExpectedAttention::score) and therefore win
// first; with `protected_inside == false` they are kept on top of the count.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kvpolicy/core/keep_set.hpp"
#include "kvpolicy/core/parallel.hpp"
#include "kvpolicy/core/tensor_view.hpp"
#include "kvpolicy/core/workspace.hpp"
#include "kvpolicy/ops/batched.hpp"
#include "kvpolicy/ops/scalar.hpp"
#include "kvpolicy/policy/policy.hpp"

KVP_NAMESPACE_BEGIN

struct HeadAllocation {
  const std::int32_t* counts = nullptr;  ///< (num_heads) tokens kept per head
  std::int64_t num_heads = 0;
  std::int64_t total = -1;       ///< declared sum of `counts` (e.g. heads * B); -1: not checked
  bool protected_inside = true;  ///< false: +inf-scored (protected) tokens are kept on top of counts[h]

  /// Sum, range and length checks, naming the offending head.
  Status validate(const char* who, std::int64_t kv_len) const noexcept {
    KVP_REQUIRE(num_heads >= 0, "%s: allocation has %lld heads, must be >= 0", who, static_cast<long long>(num_heads));
    KVP_REQUIRE(num_heads == 0 || counts != nullptr, "%s: allocation counts is null", who);
    std::int64_t sum = 0;
    for (std::int64_t h = 0; h < num_heads; ++h) {
      KVP_REQUIRE(counts[h] >= 0, "%s: per-head budget counts[%lld] is %d, must be >= 0", who, static_cast<long long>(h), counts[h]);
      KVP_REQUIRE(counts[h] <= kv_len, "%s: per-head budget counts[%lld] is %d, larger than the sequence length %lld", who,
                  static_cast<long long>(h), counts[h], static_cast<long long>(kv_len));
      sum += counts[h];
    }
    KVP_REQUIRE(total < 0 || sum == total, "%s: per-head budgets sum to %lld, expected total %lld", who, static_cast<long long>(sum),
                static_cast<long long>(total));
    return Status::ok();
  }
};

namespace detail {

/// indptr[first_row + r + 1] = indptr[first_row + r] + rows[r] for r < n (indptr[first_row] already set).
inline void append_indptr(KeepSet& out, std::int64_t first_row, const std::int64_t* rows, std::int64_t n) noexcept {
  for (std::int64_t r = 0; r < n; ++r) out.indptr[first_row + r + 1] = static_cast<std::int32_t>(out.indptr[first_row + r] + rows[r]);
}

}  // namespace detail

/// Workspace of `select_per_head` for rows of at most `kv_len` tokens.
template <class Backend>
std::size_t select_per_head_workspace(std::int64_t kv_len, const ExecContext& ctx = {}) noexcept {
  return ops::topk_rows_workspace<Backend>(std::max<std::int64_t>(kv_len, 1), ctx);
}

/// KeepSet rows of one sequence from per-head scores `(heads, kv_len)` and an
/// allocation: row h = the counts[h] (+ protected, when on top) best tokens of
/// head h, ascending. `out` has exactly `heads` rows. Validates everything
/// before writing. O(heads * kv_len) expected (Backend::topk).
template <class Backend>
Status select_per_head(TensorView<const float, 2> scores, const HeadAllocation& alloc, KeepSet out, Workspace ws,
                       const ExecContext& ctx = {}) noexcept {
  constexpr const char* who = "select_per_head";
  KVP_RETURN_IF_ERROR(scores.check_basic(who, "scores"));
  KVP_REQUIRE(scores.device().is_host(), "%s: scores is a device tensor; this entry point reads host memory", who);
  const std::int64_t H = scores.extent(0), T = scores.extent(1);
  KVP_REQUIRE(T <= INT32_MAX, "%s: kv_len %lld exceeds the int32 token id range", who, static_cast<long long>(T));
  KVP_REQUIRE(T <= 1 || scores.stride(1) == 1, "%s: scores has token stride %lld, must be 1", who,
              static_cast<long long>(scores.stride(1)));
  KVP_REQUIRE(alloc.num_heads == H, "%s: allocation has %lld heads, scores has %lld", who, static_cast<long long>(alloc.num_heads),
              static_cast<long long>(H));
  KVP_RETURN_IF_ERROR(alloc.validate(who, T));
  std::int64_t total = 0;
  for (std::int64_t h = 0; h < H; ++h) {
    const std::int64_t p = alloc.protected_inside ? 0 : Backend::count_protected(scores.data() + h * scores.stride(0), T);
    total += std::min<std::int64_t>(T, alloc.counts[h] + p);
  }
  KVP_RETURN_IF_ERROR(out.check_output(who, H, total));
  KVP_REQUIRE(total <= INT32_MAX, "%s: %lld kept tokens overflow the int32 keep-set indices", who, static_cast<long long>(total));
  KVP_RETURN_IF_ERROR(check_workspace(who, ws, ops::topk_rows_workspace<Backend>(std::max<std::int64_t>(T, 1), ctx)));
  out.indptr[0] = 0;
  for (std::int64_t h = 0; h < H; ++h) {
    const std::int64_t p = alloc.protected_inside ? 0 : Backend::count_protected(scores.data() + h * scores.stride(0), T);
    out.indptr[h + 1] = static_cast<std::int32_t>(out.indptr[h] + std::min<std::int64_t>(T, alloc.counts[h] + p));
  }
  ops::topk_rows<Backend>(scores.data(), scores.stride(0), H, T, out, 0, ws, ctx);
  return Status::ok();
}

KVP_NAMESPACE_END
