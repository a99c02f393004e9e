// SPDX-License-Identifier: Apache-2.0
// The vocabulary every policy family speaks (eviction, selection, merging,
// quantization, prefetch):
//
//   Context<B>     where a call runs: the backend as a *type* (deduced, so no
//                  `.template evict<B>` at call sites), the caller's workspace,
//                  the engine's parallel-for, and a stream for device backends.
//   ProblemShape   the largest problem a call will see; sizes everything.
//   Requirements   the one size query per phase: status (are params x shape
//                  valid?), workspace bytes, output rows / capacity and the
//                  query window the policy needs from the engine.
//   ScoreInput     one sequence's evidence: queries, keys, optional values,
//                  optional engine attention probabilities or column sums.
//   DecodeInput    a decode step's queries + page table (selection, prefetch).
//   AppendInput    tokens just appended to a paged cache (selection metadata).
//
// Conventions shared by every policy:
//  * Protected tokens (sinks, observation window, last page) score +inf
//    (`kProtectedScore`) in every score map, and budgets count them as the
//    policy's `Budget` states.
//  * Outputs are caller-owned views sized from `Requirements::output`; a call
//    either succeeds or writes nothing.
//  * Shapes are in tokens and heads; every view is read in place.
//
// Decision: `Requirements` takes the `Context` (not only the shape) because the
// workspace depends on the backend's kernels and on the number of workers the
// engine's pool lends (each worker owns a slice; results never depend on it).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "kvpolicy/core/kv_source.hpp"
#include "kvpolicy/core/page_selection.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/parallel.hpp"
#include "kvpolicy/core/status.hpp"
#include "kvpolicy/core/tensor_view.hpp"
#include "kvpolicy/core/workspace.hpp"

KVP_NAMESPACE_BEGIN

/// Score of a token that must be kept (sink, window, last page): higher than any finite score.
inline constexpr float kProtectedScore = std::numeric_limits<float>::infinity();

/// Where a policy call runs. `B` is the backend tag (`backend::Scalar`,
/// `backend::Cpu`, `backend::Cuda`); policies take `const Context<B>&` and
/// deduce `B` from it.
///
///   Context<backend::Cpu> ctx{Workspace{buf.data(), buf.size()}, pool.context()};
///   snapkv.evict(ctx, batch, keep);
template <class B>
struct Context {
  using Backend = B;
  Workspace workspace{};   ///< caller-owned scratch, at least `Requirements::workspace_bytes`
  ExecContext exec{};      ///< the engine's parallel-for (default: the calling thread)
  void* stream = nullptr;  ///< device stream (cudaStream_t) for device backends; unused on the host

  /// The same context over another workspace.
  Context with_workspace(Workspace ws) const noexcept { return Context{ws, exec, stream}; }
};

/// True for backends whose ops read and write device memory (they carry a
/// `CallScope`, e.g. `backend::Cuda`). Policies validate shapes only on them:
/// views must be tagged `DeviceType::kCUDA`, values are not scanned on the
/// host (NaN/Inf are not rejected; a NaN score orders below every number,
/// `score_order_key`, so decisions stay deterministic), and row offsets of
/// outputs (`KeepSet::indptr`) are host memory, written from the shapes
/// (except Ada-KV, whose offsets depend on the scores: device memory, written
/// on the device).
template <class B>
inline constexpr bool kDeviceBackend = requires {
  typename B::CallScope;
};

namespace detail {

/// The backend's state for one policy call. Host backends have none. A
/// device backend (one with a nested `CallScope`, e.g. `backend::Cuda`) binds
/// `Context::stream` as the stream its ops enqueue on for the call, refuses a
/// context with more than one host worker (`begin`), and reports the first
/// error its ops recorded (`end`): a policy returns `end()` once its ops are
/// enqueued.
template <class B>
class BackendCall {
 public:
  explicit BackendCall(const Context<B>&) noexcept {}
  Status begin() const noexcept { return Status::ok(); }
  Status end() const noexcept { return Status::ok(); }
};

template <class B>
  requires requires { typename B::CallScope; }
class BackendCall<B> {
 public:
  explicit BackendCall(const Context<B>& cx) noexcept : scope_(cx.stream, cx.exec.workers()) {}
  Status begin() const noexcept { return scope_.begin(); }
  Status end() const noexcept { return scope_.end(); }

 private:
  typename B::CallScope scope_;
};

}  // namespace detail

/// The largest problem a call will see. Fields keep the order of the former
/// positional `{num_q_heads, num_kv_heads, head_dim, max_kv_len, q_len}`
/// initialisers; prefer designated initialisers.
struct ProblemShape {
  std::int64_t num_q_heads = 0;
  std::int64_t num_kv_heads = 0;
  std::int64_t head_dim = 0;
  std::int64_t max_kv_len = 0;  ///< longest sequence (tokens; pages x page_size for selection)
  std::int64_t q_len = 0;       ///< query rows per head passed in (observation window, decode step)
  std::int64_t batch = 1;       ///< sequences per call
};

/// Output of a decision: KeepSet / PageSelection rows and total entries.
struct OutputSize {
  std::int64_t rows = 0;
  std::int64_t capacity = 0;
};

/// Everything a caller must know before a call: the size query of a phase.
struct Requirements {
  Status status{};                  ///< params x shape valid; the other fields are meaningful only when ok
  std::size_t workspace_bytes = 0;  ///< for `Context::workspace`
  OutputSize output{};              ///< rows and capacity of the decision buffer
  std::int64_t query_window = 0;    ///< post-RoPE queries per head the policy reads (0: none)

  explicit operator bool() const noexcept { return status.is_ok(); }
};

/// One sequence's evidence for scoring and eviction.
///
/// Which fields a policy reads is stated by the policy (and checked):
/// `queries` + `keys` for query-based scorers (SnapKV, TOVA, ObservedAttention,
/// PyramidKV, Ada-KV, H2O from queries), `values` for value-aware scorers
/// (Expected Attention), `attention` (TOVA, H2O) or `column_sums`
/// (ObservedAttention, H2O) when the engine hands its own probabilities.
/// `Tp` is the probabilities' dtype (float, half, bfloat16; summed in fp32).
/// `keys` always gives the shape (kv heads, kv_len); its data is read only by
/// the policies that need it.
template <class Tq, class Tk, class Tp = float>
struct ScoreInput {
  TensorView<const Tq, 3> queries{};      ///< (num_q_heads, q_len, head_dim) post-RoPE, the latest q_len positions
  KVSource<Tk> keys{};                    ///< (num_kv_heads, kv_len, head_dim), dense or paged
  KVSource<Tk> values{};                  ///< optional (num_kv_heads, kv_len, head_dim)
  TensorView<const Tp, 3> attention{};    ///< optional (num_q_heads, q_len, kv_len): softmax probabilities
  TensorView<const Tp, 2> column_sums{};  ///< optional (num_q_heads, kv_len): sum over the query rows of the probabilities
  /// Of the q_len query rows, the last `lookahead` are queries of future
  /// positions kv_len, kv_len + 1, ... (LAQ's pseudo tokens, a draft model's or
  /// a predictor's; policy/lookahead.hpp): query-window scorers reduce over
  /// them together with the prompt window. 0: every row is a prompt query.
  std::int64_t lookahead = 0;

  /// Present when given at all: a view with extents but null data is present
  /// (and then rejected by the policy's check as "null data"), not absent.
  bool has_attention() const noexcept { return attention.data() != nullptr || !attention.empty(); }
  bool has_column_sums() const noexcept { return column_sums.data() != nullptr || !column_sums.empty(); }
};

/// Per-token scores of one sequence: (rows, kv_len), higher = keep, protected = +inf.
using ScoreMap = TensorView<float, 2>;

/// A decode step of a batch: the queries of every sequence and the page table
/// (selection, prefetch).
template <class Tq>
struct DecodeInput {
  TensorView<const Tq, 3> queries{};  ///< (batch, num_q_heads, head_dim) post-RoPE
  PageTable table{};                  ///< FlashInfer CSR page table of the batch
  std::int32_t page_size = 0;
  std::int32_t layer = 0;
};

/// Tokens just appended to a paged cache (selection metadata; quantize-on-append).
template <class Tk>
struct AppendInput {
  PagedKVView<const Tk> kv{};                ///< the cache after the append
  const std::int32_t* append_len = nullptr;  ///< (batch) tokens appended per sequence; nullptr: rebuild every page
};

KVP_NAMESPACE_END
