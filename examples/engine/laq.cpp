// SPDX-License-Identifier: Apache-2.0
// laq.hpp compiled once (kvp_engine_lib).
#include "laq.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "policies.hpp"

namespace kvp_engine {

LaqLookahead laq_lookahead(const Model& m, const PrefillState& p, const kvpolicy::LAQ& laq) {
  kvpolicy::throw_if_error(laq.validate_params());
  const ModelConfig& c = m.config();
  const kvpolicy::LAQParams& lp = laq.params();
  if (p.window < lp.stage1_window && p.window < p.length)
    throw std::runtime_error("laq: the prefill kept " + std::to_string(p.window) + " queries per layer, stage 1 needs stage1_window = " +
                             std::to_string(lp.stage1_window) + " (PrefillOptions::query_window)");
  const std::int64_t Hq = c.n_heads, d = c.head_dim, L = c.n_layers;

  // Stage 1: SnapKV over the full prompt, on a session of its own that also holds the pseudo tokens.
  using C = ContiguousKVCache<float>;
  std::vector<float> step_q(static_cast<std::size_t>(L * Hq * d));
  Hooks<C> capture;
  capture.before_attention = [&step_q, Hq, d](C&, int layer, TensorView<const float, 3> q, SelectionBuffer&) -> Status {
    for (std::int64_t h = 0; h < Hq; ++h)
      for (std::int64_t j = 0; j < d; ++j) step_q[static_cast<std::size_t>((layer * Hq + h) * d + j)] = q(0, h, j);
    return Status::ok();
  };
  // SnapKV's window is the prompt's when the prompt is shorter (it keeps such prompts whole anyway).
  kvpolicy::SnapKVParams s1 = laq.stage1();
  s1.window = static_cast<std::int32_t>(std::min<std::int64_t>(s1.window, p.length));
  Session<C> stage1(m, C(CacheShape{c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, p.length + lp.lookahead}),
                    kvpolicy::combine(eviction_hooks<C>(kvpolicy::SnapKV(s1)), capture));
  stage1.load(p);

  LaqLookahead out;
  for (int l = 0; l < c.n_layers; ++l) out.stage1_kept.push_back(stage1.cache().kept_tokens(l) / c.n_kv_heads);
  out.capacity = lp.lookahead;
  out.queries.assign(static_cast<std::size_t>(L * Hq * lp.lookahead * d), 0.0f);
  out.tokens.assign(static_cast<std::size_t>(lp.lookahead), 0);

  const kvpolicy::LookaheadDecoder dec(laq.decode_params(c.eos_id));
  const kvpolicy::LookaheadShape shape{L, Hq, d, c.vocab_size};
  const kvpolicy::Requirements r = dec.requirements(shape);
  kvpolicy::throw_if_error(r.status);
  std::vector<std::byte> ws(r.workspace_bytes);
  auto step = [&](std::int32_t token, std::int64_t position, kvpolicy::LookaheadStep& st) -> Status {
    if (position != stage1.position())
      return KVP_INVALID("laq: pseudo token at position %lld, the stage-1 session is at %lld", static_cast<long long>(position),
                         static_cast<long long>(stage1.position()));
    const std::span<const float> logits = stage1.decode(token);
    st.queries = TensorView<const float, 3>::contiguous(step_q.data(), {L, Hq, d});
    st.logits = logits;
    return Status::ok();
  };
  const std::int32_t first = argmax(p.last_logits());
  kvpolicy::throw_if_error(dec.run(kvpolicy::Workspace{ws.data(), ws.size()}, shape, first, p.length, step,
                                   TensorView<float, 3>::contiguous(out.queries.data(), {L * Hq, lp.lookahead, d}), out.tokens,
                                   &out.count));
  out.tokens.resize(static_cast<std::size_t>(out.count));
  return out;
}

template <class Cache>
Hooks<Cache> laq_hooks(kvpolicy::LAQ laq, std::shared_ptr<const LaqRequest> request, kvpolicy::ExecContext ctx) {
  using T = typename Cache::element_type;
  struct State {
    const PrefillState* for_prefill = nullptr;  // the prefill `lookahead` was computed from
    LaqLookahead lookahead;
    std::vector<float> obs;
    std::vector<std::byte> ws;
  };
  auto S = std::make_shared<State>();
  Hooks<Cache> h;
  h.after_prefill = [laq, request, ctx, S](Cache& cache, int layer, TensorView<const float, 3> queries, KeepBuffer& keep) -> Status {
    if (request == nullptr || request->model == nullptr || request->prefill == nullptr)
      return KVP_INVALID("engine laq: no request bound (LaqRequest::bind before load)");
    if (layer == 0 || S->for_prefill != request->prefill) {  // a new request: stage 1 and the lookahead decode
      try {
        S->lookahead = laq_lookahead(*request->model, *request->prefill, laq);
      } catch (const std::exception& e) {
        return KVP_INVALID("engine laq: %s", e.what());
      }
      S->for_prefill = request->prefill;
    }
    const KVSource<T> keys = cache.key_source(layer);
    const std::int64_t Hq = queries.extent(0), d = queries.extent(2), W2 = laq.params().window, n = S->lookahead.count;
    if (keys.kv_len() != request->prefill->length)
      return KVP_INVALID("engine laq: layer %d holds %lld tokens, the bound prefill %lld", layer, static_cast<long long>(keys.kv_len()),
                         static_cast<long long>(request->prefill->length));
    const std::int64_t w2 = std::min<std::int64_t>(W2, queries.extent(1));
    S->obs.resize(static_cast<std::size_t>(Hq * (w2 + n) * d));
    const auto obs = TensorView<float, 3>::contiguous(S->obs.data(), {Hq, w2 + n, d});
    KVP_RETURN_IF_ERROR(kvpolicy::lookahead_observation(queries, S->lookahead.layer_queries(layer, Hq, d), w2, obs));
    kvpolicy::ScoreInput<float, T> in{TensorView<const float, 3>(obs), keys};
    in.lookahead = n;
    const kvpolicy::ProblemShape shape{Hq, keys.kv_heads(), d, keys.kv_len(), w2 + n};
    // A prompt shorter than W2 is kept whole; its window is the prompt.
    kvpolicy::LAQParams lp = laq.params();
    lp.window = static_cast<std::int32_t>(w2);
    const kvpolicy::LAQ policy(lp);
    const kvpolicy::Requirements r = policy.requirements(policy_context<kvpolicy::backend::Cpu>(ctx), shape);
    KVP_RETURN_IF_ERROR(r.status);
    grow_workspace(S->ws, r);
    keep.reserve(r.output.rows, r.output.capacity);
    return policy.evict(policy_context<kvpolicy::backend::Cpu>(ctx, &S->ws), in, keep.set);
  };
  return h;
}

template Hooks<ContiguousKVCache<float>> laq_hooks<ContiguousKVCache<float>>(kvpolicy::LAQ, std::shared_ptr<const LaqRequest>,
                                                                             kvpolicy::ExecContext);
template Hooks<PagedKVCache<float>> laq_hooks<PagedKVCache<float>>(kvpolicy::LAQ, std::shared_ptr<const LaqRequest>, kvpolicy::ExecContext);

}  // namespace kvp_engine
