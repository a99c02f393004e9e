// SPDX-License-Identifier: Apache-2.0
// The policy interface shared by every eviction policy.
//
// A policy is an immutable object holding only its `Params`. Given a batch of
// sequences it writes a `KeepSet` (one ascending row of kept token ids per
// (sequence, kv head)) into caller memory, using a caller-provided workspace:
//
//   SnapKV policy(SnapKVParams::kvpress(0.5));
//   std::size_t ws = policy.workspace_bytes<backend::Cpu, half>(shape, ctx);
//   policy.select<backend::Cpu>(std::span(inputs), keep, Workspace{buf, ws}, ctx);
//
// Work is split over (sequence, kv head) through `ExecContext`; each item uses
// its worker's own workspace slice, so results never depend on threading.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

#include "kvpolicy/core/keep_set.hpp"
#include "kvpolicy/core/kv_source.hpp"
#include "kvpolicy/core/parallel.hpp"
#include "kvpolicy/core/workspace.hpp"
#include "kvpolicy/ops/scalar.hpp"

KVP_NAMESPACE_BEGIN

/// One sequence at the end of prefill (or at a compression point).
template <class Tq, class Tk>
struct PrefillInput {
  TensorView<const Tq, 3> queries{};  ///< (num_q_heads, q_len, head_dim): the latest post-RoPE queries (observation window)
  KVSource<Tk> keys{};                ///< (num_kv_heads, kv_len, head_dim), dense or paged
};

/// Problem size used to size workspaces and outputs up front.
struct PrefillShape {
  std::int64_t num_q_heads = 0;
  std::int64_t num_kv_heads = 0;
  std::int64_t head_dim = 0;
  std::int64_t max_kv_len = 0;  ///< longest sequence in the batch
  std::int64_t q_len = 0;       ///< queries per head passed in (the observation window)
};

/// What every eviction policy offers (checked by `static_assert` in tests).
template <class P, class Tq = float, class Tk = float>
concept EvictionPolicy = requires(const P& p, const PrefillShape& shape, const ExecContext& ctx,
                                  std::span<const PrefillInput<Tq, Tk>> batch, KeepSet keep, Workspace ws, std::int64_t kv_len) {
  typename P::Params;
  { p.params() } -> std::convertible_to<const typename P::Params&>;
  { p.template workspace_bytes<backend::Scalar>(shape, ctx) } -> std::same_as<std::size_t>;
  { p.kept_count(kv_len) } -> std::same_as<std::int64_t>;
  { p.template select<backend::Scalar>(batch, keep, ws, ctx) } -> std::same_as<Status>;
};

namespace detail {

/// Per-worker workspace slices: `per_worker` bytes each, 64-byte aligned.
struct WorkerSlices {
  std::byte* base = nullptr;
  std::size_t per_worker = 0;
  Workspace slice(int w) const noexcept { return Workspace{base + static_cast<std::size_t>(w) * per_worker, per_worker}; }

  static std::size_t bytes(std::size_t per_worker, int workers) noexcept {
    return per_worker == 0 ? 0 : align_up(per_worker) * static_cast<std::size_t>(workers) + kWorkspaceAlign;
  }
  static WorkerSlices carve(Workspace ws, std::size_t per_worker) noexcept {
    WorkspaceCarver c(ws);
    WorkerSlices s;
    s.per_worker = align_up(per_worker);
    s.base = c.take<std::byte>(0);
    return s;
  }
};

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

}  // namespace detail

KVP_NAMESPACE_END
