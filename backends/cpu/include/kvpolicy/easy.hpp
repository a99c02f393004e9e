// SPDX-License-Identifier: Apache-2.0
// The owning convenience layer: the shortest correct call of any one-shot
// eviction policy on engine memory, for examples, scripts and first steps.
//
//   #include <kvpolicy/easy.hpp>
//   kvpolicy::Evictor<kvpolicy::SnapKV> snapkv(kvpolicy::SnapKVParams::kvpress(0.5, 64));
//   const kvpolicy::KeepSet& keep = snapkv.evict(queries, kvpolicy::heads_major(k_ptr, kv_heads, kv_len, head_dim, capacity));
//
// K/V stay views of the caller's memory; only the workspace and the decision
// buffers are owned, grow-only, so calls in steady state do not allocate.
// `evict` throws `kvpolicy::Error` with the policy's message; `try_evict`
// returns the `Status` instead. Engines that must not allocate use the
// policies directly (`requirements` + `evict` on caller-owned buffers).
//
// Part of the CPU backend (link kvpolicy::cpu): `Evictor` runs on
// `backend::Cpu` unless given another backend (`Evictor<P, backend::Scalar>`).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/core/keep_set.hpp"
#include "kvpolicy/core/kv_source.hpp"
#include "kvpolicy/core/status.hpp"
#include "kvpolicy/core/tensor_view.hpp"
#include "kvpolicy/policy/vocabulary.hpp"

KVP_NAMESPACE_BEGIN

namespace detail {
using DefaultBackend = backend::Cpu;
}  // namespace detail

/// Keys or values stored head-major, `(kv_heads, capacity, head_dim)`, of
/// which the first `len` tokens are valid: the `(kv_heads, len, head_dim)` view.
template <class T>
TensorView<const T, 3> heads_major(const T* data, std::int64_t kv_heads, std::int64_t len, std::int64_t head_dim,
                                   std::int64_t capacity) noexcept {
  return TensorView<const T, 3>(data, {kv_heads, len, head_dim}, {capacity * head_dim, head_dim, 1});
}
template <class T>
TensorView<const T, 3> heads_major(const T* data, std::int64_t kv_heads, std::int64_t len, std::int64_t head_dim) noexcept {
  return heads_major(data, kv_heads, len, head_dim, len);
}

/// Keys or values stored token-major, `(capacity, kv_heads, head_dim)` (the
/// HF / vLLM per-layer layout): the `(kv_heads, len, head_dim)` view.
template <class T>
TensorView<const T, 3> tokens_major(const T* data, std::int64_t len, std::int64_t kv_heads, std::int64_t head_dim) noexcept {
  return TensorView<const T, 3>(data, {kv_heads, len, head_dim}, {head_dim, kv_heads * head_dim, 1});
}

/// Owns what a one-shot eviction call needs besides the caller's K/V.
/// Not thread-safe (one Evictor per thread); the policy itself is const.
template <class Policy, class Backend = detail::DefaultBackend>
class Evictor {
 public:
  explicit Evictor(const Policy& policy, const ExecContext& exec = {}) : policy_(policy), exec_(exec) {}
  /// From the policy's parameters (`Evictor<SnapKV> e(SnapKVParams::kvpress(0.5))`).
  explicit Evictor(const typename Policy::Params& params,
                   const ExecContext& exec = {}) requires std::is_constructible_v<Policy, const typename Policy::Params&> : policy_(params),
                                                                                                                            exec_(exec) {}

  const Policy& policy() const noexcept { return policy_; }

  /// The decision for one sequence; the KeepSet points into this object and
  /// stays valid until the next call. Rows are `num_kv_heads` (or as the
  /// policy states, e.g. Ada-KV per query head).
  template <class In>
  Status try_evict(const In& in, KeepSet* out) {
    const ProblemShape shape{in.queries.extent(0), in.keys.kv_heads(), in.keys.head_dim(), in.keys.kv_len(), in.queries.extent(1), 1};
    const Requirements req = policy_.requirements(Context<Backend>{{}, exec_}, shape);
    KVP_RETURN_IF_ERROR(req.status);
    if (workspace_.size() < req.workspace_bytes) workspace_.resize(req.workspace_bytes);
    if (indptr_.size() < static_cast<std::size_t>(req.output.rows + 1)) indptr_.resize(static_cast<std::size_t>(req.output.rows + 1));
    if (indices_.size() < static_cast<std::size_t>(req.output.capacity)) indices_.resize(static_cast<std::size_t>(req.output.capacity));
    keep_ = KeepSet{indptr_.data(), indices_.data(), req.output.rows, static_cast<std::int64_t>(indices_.size())};
    const Context<Backend> ctx{Workspace{workspace_.data(), workspace_.size()}, exec_};
    KVP_RETURN_IF_ERROR(policy_.evict(ctx, std::span<const In>(&in, 1), keep_));
    if (out != nullptr) *out = keep_;
    return Status::ok();
  }

  template <class Tq, class Tk>
  Status try_evict(TensorView<const Tq, 3> queries, TensorView<const Tk, 3> keys, KeepSet* out) {
    return try_evict(ScoreInput<Tq, Tk>{queries, KVSource<Tk>::from(keys)}, out);
  }

  /// Throwing forms (kvpolicy::Error carries the policy's message).
  template <class In>
  const KeepSet& evict(const In& in) {
    throw_if_error(try_evict(in, nullptr));
    return keep_;
  }
  template <class Tq, class Tk>
  const KeepSet& evict(TensorView<const Tq, 3> queries, TensorView<const Tk, 3> keys) {
    throw_if_error(try_evict(queries, keys, nullptr));
    return keep_;
  }

 private:
  Policy policy_;
  ExecContext exec_;
  std::vector<std::byte> workspace_;
  std::vector<std::int32_t> indptr_, indices_;
  KeepSet keep_{};
};

KVP_NAMESPACE_END
