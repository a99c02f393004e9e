// SPDX-License-Identifier: Apache-2.0
// The prefetch family inside the engine loop: the four kvpolicy prefetch
// policies (policy/prefetch/) run on kvp-tiny's paged cache through the
// lifecycle hooks, against the pages each decode step really reads, and the
// offload simulator (eval/offload_sim.hpp) replays what they requested.
//
// The loop, per decode step and layer l (PrefetchLoop::hooks):
//   on_layer_input(l)    InfiniGen: the model adapter (KvpTinyInfiniGenAdapter)
//                        projects layer l's normalised input with layer l + 1's
//                        W_q, rotates it at the step's position, and
//                        InfiniGen::predict speculates layer l + 1's pages;
//   on_append(l)         Quest page metadata (the real selection's and Quest
//                        lookahead's), InfiniGen's partial keys, SpeCache's
//                        q4_0 key copy, ShadowKV's landmarks;
//   before_attention(l)  the real selection: Quest's pages for the real query
//                        (`ActualSelection::kQuest`) or the exact top pages of
//                        the real query (`kExactTopK`: per query head, pages
//                        ranked by their best exact logit, top B - 1 plus the
//                        last page); the cache attends to exactly those pages.
//                        The policy observes it (hit-rate counters), the step is
//                        recorded with the request that targeted it, and
//                        Quest lookahead / ShadowKV predict the next step from
//                        this query;
//   after_attention(l)   SpeCache: the speculative row. Next to the real token
//                        x_t the loop decodes the speculative token x^_{t+1}
//                        (the previous step's speculative output; at the
//                        first step the first real token) one layer at a time:
//                        its query predicts layer l's pages for the next step
//                        (SpeCache::predict over the q4_0 keys); its attention
//                        reads the q4_0 keys of pages outside this step's
//                        selection and the full-precision keys of the pages in it
//                        (SpeCache's patch), fp values, and its own K/V, which are
//                        discarded; its last layer's logits give x^_{t+2}.
//   after_prefill(l)     InfiniGen::prepare from the prompt queries the engine
//                        kept (PrefillOptions::query_window: run_prefetch_loop
//                        keeps every prompt query).
//
// Transfer unit: a physical page of one layer (every kv head's K and V); the
// policies' requests and the selection's pages are pooled over heads. The
// prefetch policies never change what the model computes: every policy run on
// one prompt sees the same selections (tests check it), so the baselines are
// simulated on any of their traces.
//
// Build: compiled once into kvp_engine_lib (prefetch.cpp); the float paged
// cache only.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine.hpp"
#include "kvpolicy/eval/offload_sim.hpp"
#include "kvpolicy/policy/prefetch/infinigen.hpp"
#include "kvpolicy/policy/prefetch/quest_lookahead.hpp"
#include "kvpolicy/policy/prefetch/shadowkv.hpp"
#include "kvpolicy/policy/prefetch/specache.hpp"

namespace kvp_engine {

enum class PrefetchKind { kQuestLookahead, kInfiniGen, kSpeCache, kShadowKV };
inline constexpr PrefetchKind kAllPrefetchKinds[] = {PrefetchKind::kQuestLookahead, PrefetchKind::kInfiniGen, PrefetchKind::kSpeCache,
                                                     PrefetchKind::kShadowKV};
/// The kvpolicy policy name (QuestLookahead::kName, ...).
const char* prefetch_kind_name(PrefetchKind k) noexcept;

enum class ActualSelection { kQuest, kExactTopK };
const char* actual_selection_name(ActualSelection a) noexcept;

struct PrefetchLoopOptions {
  PrefetchKind kind = PrefetchKind::kQuestLookahead;
  ActualSelection actual = ActualSelection::kQuest;
  std::int32_t page_size = 16;
  std::int32_t page_budget = 8;   ///< pages the real selection reads per query head, last page included
  std::int32_t dense_layers = 0;  ///< layers whose real selection reads every page
  kvpolicy::QuestLookaheadParams quest_lookahead{.page_budget = 12, .dense_layers = 0};
  kvpolicy::InfiniGenParams infinigen{};
  kvpolicy::SpeCacheParams specache{.topk = 64};
  kvpolicy::ShadowKVParams shadowkv{.chunk_size = 8, .chunk_budget = 12, .outlier_chunks = 2, .local_chunks = 2};
};

/// One layer step of the loop.
struct PrefetchEvent {
  std::int32_t layer = 0;
  std::int64_t step = 0;
  std::vector<std::int32_t> request;  ///< the prediction that targeted this step, most urgent first (empty: none)
  std::vector<std::int32_t> needed;   ///< distinct pages the step read
  bool next_layer = false;            ///< the prediction came from the previous layer (else from the previous step)
};

/// What a run recorded.
struct PrefetchTrace {
  std::string policy, actual;
  std::int32_t num_layers = 0, pool_pages = 0;
  double page_bytes = 0.0;  ///< one page of one layer: every kv head's K and V
  std::int64_t decode_steps = 0;
  std::vector<PrefetchEvent> events;  ///< in loop order
  std::vector<kvpolicy::PrefetchCounters> per_layer;
  double predict_seconds = 0.0;  ///< time inside the policy's predict calls
  std::int64_t predict_calls = 0;
  std::vector<std::int32_t> generated;    ///< the tokens the loop decoded (generated[s] is fed at step s)
  std::vector<std::int32_t> speculated;   ///< SpeCache: the speculative row's output at step s, its guess of generated[s + 2]
  std::vector<std::int32_t> spec_inputs;  ///< SpeCache: the speculative row's token at step s (its guess of generated[s + 1])

  kvpolicy::PrefetchCounters total() const {
    kvpolicy::PrefetchCounters c;
    for (const auto& l : per_layer) c += l;
    return c;
  }
};

/// InfiniGen's model adapter for kvp-tiny (kvpolicy::InfiniGenModelAdapter):
/// the speculative query of `target_layer` = RoPE_pos(x W_q(target_layer)^T).
struct KvpTinyInfiniGenAdapter {
  const Model* model = nullptr;
  kvpolicy::Status speculative_query(std::int32_t target_layer, const std::int64_t* positions, TensorView<const float, 2> x,
                                     TensorView<float, 3> q) const;
};
static_assert(kvpolicy::InfiniGenModelAdapter<KvpTinyInfiniGenAdapter>);

/// Hooks of the loop and their state. Build with `make_prefetch_loop`; seed
/// the speculative row (SpeCache) with the first token to decode, then run
/// a Session over a PagedKVCache<float> with `hooks`.
struct PrefetchLoop {
  Hooks<PagedKVCache<float>> hooks;
  std::shared_ptr<PrefetchTrace> trace;
  std::shared_ptr<void> state;
  void seed(std::int32_t first_token);
};
PrefetchLoop make_prefetch_loop(const Model& model, const PrefetchLoopOptions& opt, std::int64_t capacity);

/// Loads `prefill` (computed with every prompt query kept: PrefillOptions::query_window
/// >= the prompt) into a fresh paged session with the loop's hooks and decodes
/// `steps` tokens greedily; returns the trace.
PrefetchTrace run_prefetch_loop(const Model& model, const PrefillState& prefill, const PrefetchLoopOptions& opt, int steps);

/// Replays `trace` through an offload simulator (`params.page_bytes` is
/// taken from the trace): overlap one layer of compute (`layer_us`) for a
/// next-layer prediction, num_layers - 1 layers for a next-step one.
kvpolicy::Status simulate_trace(const PrefetchTrace& trace, kvpolicy::OffloadSimParams params, kvpolicy::OffloadMode mode, double layer_us,
                                kvpolicy::OffloadTotals* out);

}  // namespace kvp_engine
