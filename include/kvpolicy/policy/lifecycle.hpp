// SPDX-License-Identifier: Apache-2.0
// The engine lifecycle: the five points where an engine calls a policy, as one
// integration surface for every family. An engine wires `Hooks<Cache>` into
// its loop once; switching the policy is then a one-line change of which
// hooks it builds (examples/engine/policies.hpp builds them from kvpolicy
// policies, the registry from a spec string).
//
//   prefill(prompt), per layer:
//   |-- on_append(cache, layer, n)              the prompt's n tokens entered the layer
//   |-- on_prefill_attention(cache, layer, C)   optional: C (Hq, n) column sums of the prompt's causal
//   |                                           attention, from the engine's prefill kernel
//   |-- after_prefill(cache, layer, Q, keep)    Q: the last `query_window` post-RoPE prompt queries
//   |                                           (Hq, W, d); a filled `keep` is applied (compaction)
//   |-- on_compact(cache, layer)                after the engine moved rows (state re-packing, rebuilds)
//   decode(token), per layer:
//   |-- on_layer_input(cache, layer, pos, x)    x: the layer's normalised attention input (batch, d_model)
//   |                                           at position pos, before its Q/K/V projections
//   |-- on_append(cache, layer, 1)              the token's K/V are in the cache
//   |-- before_attention(cache, layer, q, sel)  a filled `sel` restricts this step's attention
//   |-- after_attention(cache, layer, P, keep)  P: this step's probabilities (Hq, n) over the cache
//
// Which family acts where:
//
//   | hook point       | one-shot eviction | online eviction     | selection           | merge        | quantization       | prefetch |
//   |------------------|-------------------|---------------------|---------------------|--------------|--------------------|----------|
//   | on_prefill_attn. | -                 | update (no recompute) | -                 | accumulate   | -                  | -        |
//   | after_prefill    | evict             | update + evict      | plan                | merge(keep)  | quantize all       | -        |
//   | on_layer_input   | -                 | -                   | -                   | -            | -                  | predict  |
//   | on_append        | -                 | -                   | on_append           | -            | quantize residual  | -        |
//   | before_attention | -                 | -                   | plan + select       | -            | -                  | predict  |
//   | after_attention  | -                 | update + evict      | -                   | -            | -                  | observe  |
//   | on_compact       | -                 | state re-packed     | on_append (rebuild) | -            | -                  | -        |
//
// Prefetch: `on_layer_input` predicts the next layer (InfiniGen), the other
// points predict the next step (Quest lookahead, ShadowKV from the current
// query; SpeCache after attention, from its speculative row); `observe` runs
// as soon as the step's real selection is known (examples/engine/prefetch.hpp
// observes in before_attention, right after choosing the pages).
//
// Decisions go into caller-owned, grow-only buffers (`KeepBuffer`,
// `SelectionBuffer`): a hook that decides calls `reserve` (which marks the
// buffer active) and fills the view; the engine applies only active buffers.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "kvpolicy/core/keep_set.hpp"
#include "kvpolicy/core/page_selection.hpp"
#include "kvpolicy/core/status.hpp"
#include "kvpolicy/core/tensor_view.hpp"

KVP_NAMESPACE_BEGIN

/// Storage for a KeepSet a hook may fill.
struct KeepBuffer {
  std::vector<std::int32_t> indptr, indices;
  KeepSet set{};
  bool active = false;

  /// Sizes the buffer for `rows` rows and `capacity` ids and marks it active.
  KeepSet& reserve(std::int64_t rows, std::int64_t capacity) {
    indptr.assign(static_cast<std::size_t>(rows + 1), 0);
    indices.assign(static_cast<std::size_t>(capacity > 0 ? capacity : 0), 0);
    set = KeepSet{indptr.data(), indices.data(), rows, capacity > 0 ? capacity : 0};
    active = true;
    return set;
  }
};

/// Storage for a PageSelection a hook may fill.
struct SelectionBuffer {
  std::vector<std::int32_t> indptr, indices, last_page_len, logical;
  PageSelection sel{};
  bool active = false;

  PageSelection& reserve(std::int64_t rows, std::int64_t capacity) {
    indptr.assign(static_cast<std::size_t>(rows + 1), 0);
    indices.assign(static_cast<std::size_t>(capacity > 0 ? capacity : 0), 0);
    last_page_len.assign(static_cast<std::size_t>(rows), 0);
    logical.assign(static_cast<std::size_t>(capacity > 0 ? capacity : 0), 0);
    sel = PageSelection{indptr.data(), indices.data(), last_page_len.data(), logical.data(), rows, capacity > 0 ? capacity : 0};
    active = true;
    return sel;
  }
};

/// The hook points of an engine whose per-layer cache is `Cache`. Every
/// member may be empty; each returns the policy's Status (an engine aborts
/// the request, or falls back to the full cache, on error).
template <class Cache>
struct Hooks {
  /// After the prompt's K/V of `layer` are cached: queries (num_q_heads, W, head_dim).
  std::function<Status(Cache&, int layer, TensorView<const float, 3> queries, KeepBuffer& keep)> after_prefill;
  /// Optional, after the prompt's K/V of `layer` are cached and before after_prefill: column_sums
  /// (num_q_heads, n), c[h, j] = sum over the prompt's queries i of softmax_j(q_i . k_j / sqrt(d)), causal
  /// (rows i < j add 0), from the engine's own prefill attention. Policies that accumulate the whole prompt's
  /// attention (online H2O, CaM, D2O) take it instead of recomputing Q K^T from every prompt query; an engine
  /// whose kernel cannot produce it never calls it, and those policies then need every prompt query.
  std::function<Status(Cache&, int layer, TensorView<const float, 2> column_sums)> on_prefill_attention;
  /// During a decode step, before `layer`'s Q/K/V projections: its normalised
  /// attention input x (batch, d_model) at `position` (next-layer speculation,
  /// InfiniGen: layer + 1's pages are predicted from it while layer runs).
  std::function<Status(Cache&, int layer, std::int64_t position, TensorView<const float, 2> x)> on_layer_input;
  /// After `appended` tokens entered `layer` (prompt or decode step).
  std::function<Status(Cache&, int layer, std::int64_t appended)> on_append;
  /// Before a decode step's attention at `layer`: query (batch, num_q_heads, head_dim).
  std::function<Status(Cache&, int layer, TensorView<const float, 3> query, SelectionBuffer& sel)> before_attention;
  /// After a decode step's attention at `layer`: probabilities (num_q_heads, n).
  std::function<Status(Cache&, int layer, TensorView<const float, 2> probs, KeepBuffer& keep)> after_attention;
  /// After the engine compacted `layer` (rows moved, logical positions kept).
  std::function<Status(Cache&, int layer)> on_compact;
};

/// Both hook sets; at each point a's callback runs first (b is skipped when a
/// fails). Two callbacks that fill the same buffer conflict: the later wins.
template <class Cache>
Hooks<Cache> combine(Hooks<Cache> a, Hooks<Cache> b) {
  auto chain = [](auto f, auto g) -> decltype(f) {
    if (!f) return g;
    if (!g) return f;
    return [f, g](auto&&... args) -> Status {
      KVP_RETURN_IF_ERROR(f(args...));
      return g(args...);
    };
  };
  Hooks<Cache> h;
  h.on_prefill_attention = chain(a.on_prefill_attention, b.on_prefill_attention);
  h.after_prefill = chain(a.after_prefill, b.after_prefill);
  h.on_layer_input = chain(a.on_layer_input, b.on_layer_input);
  h.on_append = chain(a.on_append, b.on_append);
  h.before_attention = chain(a.before_attention, b.before_attention);
  h.after_attention = chain(a.after_attention, b.after_attention);
  h.on_compact = chain(a.on_compact, b.on_compact);
  return h;
}

KVP_NAMESPACE_END
