// SPDX-License-Identifier: Apache-2.0
// LAQ and LAQ++ in the engine (kvpolicy/policy/eviction/laq.hpp has the
// algorithm): the library owns the decisions and the pseudo-token loop; the
// engine supplies the model, the request's prefill and one callback,
// "decode this token on the stage-1 cache and give me its queries".
//
//   auto req = std::make_shared<LaqRequest>();
//   Session<ContiguousKVCache<float>> s(model, cache, laq_hooks<ContiguousKVCache<float>>(laq, req));
//   PrefillState p = prefill(model, prompt, {.query_window = laq.params().stage1_window});
//   req->bind(model, p);            // the request the hooks decide for
//   s.load(p);                      // after_prefill: lookahead decode (layer 0), then stage 2 per layer
//   s.greedy(n);                    // decoding starts from the prefill logits (the first token = the prefill argmax)
//
// What the hooks do, per request:
//  * after_prefill at the first layer: `laq_lookahead` — a stage-1 Session
//    (contiguous fp32 cache of T + lookahead tokens) loads the same prefill
//    with SnapKV `laq.stage1()` hooks, and kvpolicy::LookaheadDecoder feeds
//    it the prefill argmax and then its own argmaxes (EOS = the model's) for
//    at most `lookahead` forwards; a before_attention hook on the stage-1
//    session records every layer's query of each pseudo token. The stage-1
//    session, and with it the pseudo tokens' K/V, is dropped.
//  * after_prefill at every layer: the observation rows (last W2 prompt
//    queries of the layer + its n pseudo queries) and the layer's full prompt
//    keys go to `LAQ::evict` (stage 2); the engine compacts as for any
//    eviction policy.
// The lookahead decode runs inside the first hook, so its time is part of
// the session's hook time (the comparison's "decision" seconds).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine.hpp"
#include "kvpolicy/policy/eviction/laq.hpp"

namespace kvp_engine {

/// The request LAQ's hooks decide for: the model and the prefill they were
/// loaded from (both must outlive the session's load()).
struct LaqRequest {
  const Model* model = nullptr;
  const PrefillState* prefill = nullptr;
  void bind(const Model& m, const PrefillState& p) noexcept {
    model = &m;
    prefill = &p;
  }
};

/// The pseudo tokens of one request and, per layer, their queries.
struct LaqLookahead {
  std::int64_t count = 0;                 ///< n: forwards made (fewer than lookahead at EOS)
  std::int64_t capacity = 0;              ///< rows per (layer, head) in `queries` (= lookahead)
  std::vector<std::int32_t> tokens;       ///< (count) the tokens fed, the first = the prefill argmax
  std::vector<float> queries;             ///< (layers * q heads, capacity, head_dim): row l * Hq + h
  std::vector<std::int64_t> stage1_kept;  ///< tokens per kv head the stage-1 cache kept, per layer

  /// The n pseudo queries of `layer`: (num_q_heads, n, head_dim).
  TensorView<const float, 3> layer_queries(int layer, std::int64_t num_q_heads, std::int64_t head_dim) const noexcept {
    return TensorView<const float, 3>::contiguous(queries.data(),
                                                  {static_cast<std::int64_t>(queries.size()) / (capacity * head_dim), capacity, head_dim})
        .narrow(0, layer * num_q_heads, num_q_heads)
        .narrow(1, 0, count);
  }
};

/// Stage 1 and the lookahead decode for one prefill (throws the library's
/// message on failure, e.g. a prefill that kept fewer than stage1_window queries).
LaqLookahead laq_lookahead(const Model& m, const PrefillState& p, const kvpolicy::LAQ& laq);

/// After-prefill hooks running LAQ for the request bound to `request`.
template <class Cache>
Hooks<Cache> laq_hooks(kvpolicy::LAQ laq, std::shared_ptr<const LaqRequest> request, kvpolicy::ExecContext ctx = {});

extern template Hooks<ContiguousKVCache<float>> laq_hooks<ContiguousKVCache<float>>(kvpolicy::LAQ, std::shared_ptr<const LaqRequest>,
                                                                                    kvpolicy::ExecContext);
extern template Hooks<PagedKVCache<float>> laq_hooks<PagedKVCache<float>>(kvpolicy::LAQ, std::shared_ptr<const LaqRequest>,
                                                                          kvpolicy::ExecContext);

}  // namespace kvp_engine
