// SPDX-License-Identifier: Apache-2.0
// What every policy header includes: the shared vocabulary (vocabulary.hpp),
// the family concepts (concepts.hpp), and the small helpers policies share to
// carve per-worker workspace slices and write uniform KeepSet rows.
//
// A policy is an immutable object holding only its `Params`. Given a batch of
// sequences it writes a decision into caller memory, using a caller-provided
// workspace sized by its one size query:
//
//   SnapKV policy(SnapKVParams::kvpress(0.5));
//   Context<backend::Cpu> ctx{{}, pool.context()};
//   Requirements r = policy.requirements(ctx, shape);          // workspace, output rows/capacity, query window
//   policy.evict(ctx.with_workspace(Workspace{buf, r.workspace_bytes}), std::span(inputs), keep);
//
// Work is split over (sequence, kv head) through `ExecContext`; each item uses
// its worker's own workspace slice, so results never depend on threading.
#pragma once

#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

#include <algorithm>

#include "kvpolicy/core/gqa.hpp"
#include "kvpolicy/core/keep_set.hpp"
#include "kvpolicy/core/kv_source.hpp"
#include "kvpolicy/core/parallel.hpp"
#include "kvpolicy/core/workspace.hpp"
#include "kvpolicy/ops/batched.hpp"
#include "kvpolicy/ops/scalar.hpp"
#include "kvpolicy/policy/budget.hpp"
#include "kvpolicy/policy/concepts.hpp"
#include "kvpolicy/policy/params.hpp"
#include "kvpolicy/policy/vocabulary.hpp"

KVP_NAMESPACE_BEGIN

namespace detail {

/// Validates the KeepSet rows a policy is about to fill and writes `indptr`
/// from per-row counts given by `count(b)` (same count for every kv head).
template <class CountFn>
Status write_uniform_indptr(const char* who, KeepSet& out, std::int64_t batch, std::int64_t kv_heads, CountFn&& count) noexcept {
  std::int64_t total = 0;
  for (std::int64_t b = 0; b < batch; ++b) total += count(b) * kv_heads;
  KVP_RETURN_IF_ERROR(out.check_output(who, batch * kv_heads, total));
  KVP_REQUIRE(total <= INT32_MAX, "%s: %lld kept tokens overflow the int32 keep-set indices", who, static_cast<long long>(total));
  std::int64_t pos = 0;
  out.indptr[0] = 0;
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t c = count(b);
    for (std::int64_t h = 0; h < kv_heads; ++h) {
      pos += c;
      out.indptr[b * kv_heads + h + 1] = static_cast<std::int32_t>(pos);
    }
  }
  return Status::ok();
}

/// The checks every query-based scorer makes on one sequence's queries and
/// keys, in this order: the keys' structure; a paged table (once per distinct
/// paged view when `last_paged` is given: batches often share one pool) and
/// its memory; the queries' structure and memory; GQA; equal head_dim > 0.
template <class Tq, class Tk>
Status check_queries_and_keys(const char* who, const TensorView<const Tq, 3>& q, const KVSource<Tk>& keys,
                              const PagedKVView<const Tk>** last_paged = nullptr, bool on_device = false) noexcept {
  KVP_RETURN_IF_ERROR(keys.validate(who, "keys", on_device));
  if (on_device) {
    // Shapes only: a scan of the values (or of the page ids) would need a device read and a synchronisation.
    KVP_RETURN_IF_ERROR(keys.validate_pool(who, "keys", /*on_device=*/true, last_paged));
    KVP_RETURN_IF_ERROR(q.check_basic(who, "queries"));
    KVP_REQUIRE(!q.device().is_host(), "%s: queries is a host tensor; a device backend reads device memory (tag the view kCUDA)", who);
    GqaMap gqa;
    KVP_RETURN_IF_ERROR(GqaMap::make(q.extent(0), keys.kv_heads(), who, &gqa));
    KVP_REQUIRE(q.extent(2) == keys.head_dim() && keys.head_dim() > 0, "%s: queries head_dim %lld differs from keys head_dim %lld", who,
                static_cast<long long>(q.extent(2)), static_cast<long long>(keys.head_dim()));
    return Status::ok();
  }
  KVP_RETURN_IF_ERROR(keys.validate_pool(who, "keys", /*on_device=*/false, last_paged));
  KVP_RETURN_IF_ERROR(q.check_basic(who, "queries"));
  KVP_REQUIRE(q.device().is_host(), "%s: queries is a device tensor; this entry point reads host memory", who);
  GqaMap gqa;
  KVP_RETURN_IF_ERROR(GqaMap::make(q.extent(0), keys.kv_heads(), who, &gqa));
  KVP_REQUIRE(q.extent(2) == keys.head_dim() && keys.head_dim() > 0, "%s: queries head_dim %lld differs from keys head_dim %lld", who,
              static_cast<long long>(q.extent(2)), static_cast<long long>(keys.head_dim()));
  return check_finite_3d(who, "queries", q);
}

/// Sequence `b` of a batch must have sequence 0's heads and head_dim; the
/// longest sequence sets `first->max_kv_len`.
inline Status check_same_heads(const char* who, std::size_t b, const ProblemShape& s, ProblemShape* first) noexcept {
  if (b == 0) {
    *first = s;
    return Status::ok();
  }
  KVP_REQUIRE(s.num_q_heads == first->num_q_heads && s.num_kv_heads == first->num_kv_heads && s.head_dim == first->head_dim,
              "%s: sequence %zu has (q heads, kv heads, head_dim) = (%lld, %lld, %lld), sequence 0 has (%lld, %lld, %lld)", who, b,
              static_cast<long long>(s.num_q_heads), static_cast<long long>(s.num_kv_heads), static_cast<long long>(s.head_dim),
              static_cast<long long>(first->num_q_heads), static_cast<long long>(first->num_kv_heads),
              static_cast<long long>(first->head_dim));
  first->max_kv_len = std::max(first->max_kv_len, s.max_kv_len);
  first->q_len = std::max(first->q_len, s.q_len);
  return Status::ok();
}

/// Shape checks every policy's size query shares (the call itself re-checks
/// the actual inputs). `head_dim` may be 0 for inputs without queries/keys
/// data (engine column sums).
inline Status check_problem_shape(const char* who, const ProblemShape& s) noexcept {
  KVP_REQUIRE(s.batch >= 1, "%s: shape batch is %lld, must be >= 1", who, static_cast<long long>(s.batch));
  KVP_REQUIRE(s.num_kv_heads >= 1, "%s: shape num_kv_heads is %lld, must be >= 1", who, static_cast<long long>(s.num_kv_heads));
  KVP_REQUIRE(s.num_q_heads >= 1 && s.num_q_heads % s.num_kv_heads == 0,
              "%s: shape num_q_heads is %lld, must be a positive multiple of num_kv_heads=%lld", who, static_cast<long long>(s.num_q_heads),
              static_cast<long long>(s.num_kv_heads));
  KVP_REQUIRE(s.head_dim >= 0 && s.max_kv_len >= 0 && s.q_len >= 0, "%s: shape head_dim %lld, max_kv_len %lld, q_len %lld must be >= 0",
              who, static_cast<long long>(s.head_dim), static_cast<long long>(s.max_kv_len), static_cast<long long>(s.q_len));
  KVP_REQUIRE(s.max_kv_len <= INT32_MAX, "%s: shape max_kv_len %lld exceeds the int32 token id range", who,
              static_cast<long long>(s.max_kv_len));
  return Status::ok();
}

/// Requirements of a decision with `rows` rows per sequence of at most `kept`
/// entries each (`kept` for the longest sequence: every budget is monotone in kv_len).
inline Requirements uniform_requirements(Status status, std::size_t workspace, const ProblemShape& s, std::int64_t rows, std::int64_t kept,
                                         std::int64_t query_window) noexcept {
  Requirements r;
  r.status = status;
  if (!status.is_ok()) return r;
  r.workspace_bytes = workspace;
  r.output = OutputSize{s.batch * rows, s.batch * rows * kept};
  r.query_window = query_window;
  return r;
}

/// The size query of a policy whose rows (`rows` per sequence) keep `budget`
/// with `protected_of(max_kv_len)` protected tokens: params and shape checked,
/// the budget resolved for the longest sequence (budgets are monotone in kv_len).
template <class ProtectedFn>
Requirements budget_requirements(const char* who, Status params, const ProblemShape& s, const Budget& budget, ProtectedFn&& protected_of,
                                 std::size_t workspace, std::int64_t rows, std::int64_t query_window) noexcept {
  Status st = params;
  if (st.is_ok()) st = check_problem_shape(who, s);
  std::int64_t n = 0;
  if (st.is_ok()) st = budget.resolve(who, s.max_kv_len, protected_of(s.max_kv_len), &n);
  return uniform_requirements(st, workspace, s, rows, n, query_window);
}

}  // namespace detail

KVP_NAMESPACE_END
