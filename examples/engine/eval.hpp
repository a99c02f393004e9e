// SPDX-License-Identifier: Apache-2.0
// End-to-end task evaluation of KV-cache policies on kvp-tiny: the API the
// comparison tool calls for its "end-to-end tasks on the small model" workload.
//
//   Model model = Model::load("models/kvp-tiny");
//   auto samples = load_task_set("tests/data/engine/eval_set.json");   // passkey / multikey / copy, 1024 tokens
//   std::vector<PolicyUnderTest> policies = {registry_policy("snapkv:window=32"), registry_policy("streaming_llm"), quest_policy()};
//   std::vector<std::int64_t> budgets = {128, 256, 512};
//   for (const TaskEvalResult& r : run_task_eval(model, samples, policies, budgets, {.cache = CacheKind::kPaged}))
//     printf("%s @%lld: acc %.3f  KL %.4f  decide %.3f s  kept %.0f B\n", r.policy.c_str(), (long long)r.budget,
//            r.accuracy, r.mean_kl, r.decision_seconds, r.mean_kept_bytes);
//
// What is measured, per (policy, budget):
//  * accuracy — exact match of the answer. Decoding is teacher-forced along the
//    gold answer: the answer is produced iff every step's argmax equals the
//    gold token, so this equals greedy exact match and costs one decode pass.
//    Per task and overall.
//  * logit KL vs full cache — KL(p_full || p_policy) in nats of the softmaxed
//    logits at every answer step, the full-cache run on the same prefill as
//    reference; mean over all steps of all samples, and the max. Also the
//    number of samples whose logits equal the full cache's bit for bit.
//  * decision time — seconds spent inside the policy hooks (eviction
//    decisions, Quest metadata and selection), summed over the set; the
//    compaction (apply/) is not included.
//  * attention-output error vs full cache — at every decode step, layer and
//    query head, ||o - o_full|| / ||o_full|| of the attention output against
//    the same query over the request's every token, unevicted, unmerged and
//    unquantized (Session::measure_attention_error's shadow cache); mean and
//    max over all of them. It isolates what the cache changes in one layer's
//    output from the drift of the residual stream, which logit KL includes.
//  * bytes kept — K/V bytes held by the cache right after the prefill hooks
//    (all layers, fp32), mean over samples, next to the full cache's; and the
//    mean number of cached tokens read per (decode step, layer, query head)
//    (what a selection policy such as Quest saves).
// Budget: tokens per kv head per layer, passed to the policy factory, which
// maps it onto the policy's own vocabulary (kvpolicy Budget::tokens, for Quest
// too; for a registry spec string the key `tokens=min(budget, T)`,
// T the prompt length: spec budgets cannot be above the length). A budget >=
// the prompt length keeps everything.
//
// Cost: one prefill per sample (shared by the full-cache reference and every
// policy and budget: the PrefillState is written into a fresh cache per run),
// plus len(answer) - 1 decode steps per run. fp32 caches only.
//
// The policies (all_policies): the one-shot eviction policies the registry
// (kvpolicy/registry.hpp) expresses are spec strings (registry_policy); the
// others keep their own hooks: online H2O and TOVA, Ada-KV (its kvpress
// SnapKV scorer pools before the group mean, which the registry's "adakv"
// key set cannot state), PyramidKV (KVCache-Factory's schedule; the
// registry's is kvpress's), Expected Attention (pre-RoPE queries and the
// model's RoPE frequencies) and Quest (selection).
//
// Build: everything but the small templates below is defined in eval.cpp
// (kvp_engine_lib), compiled once.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "engine.hpp"
#include "laq.hpp"
#include "policies.hpp"
#include "task_set.hpp"

namespace kvp_engine {

enum class CacheKind { kContiguous, kPaged };

/// A policy as the harness sees it: factories building the hooks of one
/// request from (prompt length, budget in tokens per kv head). A factory left
/// empty means the policy does not run on that cache layout (Quest needs pages).
struct PolicyUnderTest {
  static constexpr std::int64_t kWholePrompt = -1;
  std::string name;
  std::int64_t query_window = 64;  ///< prompt queries its after_prefill hook needs (kWholePrompt: all of them)
  /// Its hooks take the prompt's attention column sums from the engine's prefill (Hooks::on_prefill_attention;
  /// the harness then sets PrefillOptions::column_sums) instead of recomputing them from every prompt query.
  bool column_sums = false;
  std::function<Hooks<ContiguousKVCache<float>>(std::int64_t prompt_len, std::int64_t budget)> contiguous;
  std::function<Hooks<PagedKVCache<float>>(std::int64_t prompt_len, std::int64_t budget)> paged;
  /// Bytes this policy's cache holds per byte of the engine's fp32 cache (quantized formats: bytes per token
  /// over 4 * head_dim); scales the reported kv bytes.
  double kv_bytes_scale = 1.0;
  /// Tokens per kv head held in fp16 whatever the format (KIVI's residual window), counted at 2 bytes per value.
  std::int64_t fp16_tokens = 0;
  /// When set, replaces kv_bytes_scale for one run: the scale given the kept tokens per (layer, kv head) and
  /// the budget (mixed precision: the split between full-precision and quantized tokens depends on both).
  std::function<double(double kept_per_head, std::int64_t budget)> kv_bytes_scale_of;
  /// Stores the cache in fewer bits: differs from the full cache even when nothing is evicted.
  bool lossy = false;
  /// Its hooks do not depend on the budget (a quantization format storing every token): run_task_eval runs it
  /// once per sample and scores that run for every budget.
  bool ignores_budget = false;
  /// For policies that run the model themselves before deciding (LAQ decodes pseudo tokens on a cheap
  /// cache): called with the model and each request's prefill before that request's hooks run; the hooks
  /// read them through state they share with this callback. Empty for every other policy.
  std::function<void(const Model&, const PrefillState&)> on_prefill;
};

/// A policy that runs on both cache layouts: `hooks` is a template lambda
/// `[]<class Cache>(std::int64_t budget) -> Hooks<Cache>`, instantiated for each.
template <class MakeHooks>
PolicyUnderTest on_both_layouts(std::string name, std::int64_t query_window, MakeHooks hooks) {
  PolicyUnderTest p;
  p.name = std::move(name);
  p.query_window = query_window;
  p.contiguous = [hooks](std::int64_t, std::int64_t budget) { return hooks.template operator()<ContiguousKVCache<float>>(budget); };
  p.paged = [hooks](std::int64_t, std::int64_t budget) { return hooks.template operator()<PagedKVCache<float>>(budget); };
  return p;
}

/// Any kvpolicy eviction policy, given a function budget -> policy object.
template <class MakePolicy>
PolicyUnderTest eviction_policy(std::string name, MakePolicy make) {
  return on_both_layouts(std::move(name), 64, [make]<class Cache>(std::int64_t budget) { return eviction_hooks<Cache>(make(budget)); });
}

/// A one-shot eviction policy of the registry from a spec string
/// (`snapkv:window=32,kernel=5`, kvpolicy::make_eviction_policy) on both cache
/// layouts; the harness's budget is appended as `tokens=min(budget, prompt length)`.
/// The name is the spec's policy name; `query_window` as PolicyUnderTest's.
/// Throws the registry's message for a bad spec.
/// `name` overrides the policy's name (variants of one registry policy: "snapkv_w16").
PolicyUnderTest registry_policy(const std::string& spec, std::int64_t query_window = 64, const std::string& name = "");

/// SnapKV keeping `budget` tokens per kv head, the observation window inside the budget (kvpress
/// pooling and reductions); prompts shorter than the budget are kept whole.
inline kvpolicy::SnapKV snapkv_with_budget(std::int64_t budget, std::int32_t window = 32, std::int32_t kernel = 5) {
  kvpolicy::SnapKVParams p = kvpolicy::SnapKVParams::kvpress(0.0, window, kernel);
  p.budget = kvpolicy::Budget::tokens(budget).clamp_to_length();
  return kvpolicy::SnapKV(p);
}
/// Quest with `budget` tokens per query head (budget / page_size pages, the last page included). Every layer
/// sparse by default: the paper's 2 dense layers of 32 would be a quarter of a layer of kvp-tiny, and a dense
/// layer would read more than the budget the other policies get.
inline kvpolicy::Quest quest_with_budget(std::int64_t budget, std::int32_t dense_layers = 0) {
  kvpolicy::QuestParams q;
  q.budget = kvpolicy::Budget::tokens(std::min<std::int64_t>(budget, 1 << 30));
  q.dense_layers = dense_layers;
  return kvpolicy::Quest(q);
}

/// PyramidKV (KVCache-Factory schedule): `budget` tokens per kv head on average over the layers, fewer in
/// the upper layers; observation window 8, max pooling 7 (the original's defaults).
PolicyUnderTest pyramidkv_policy(std::int32_t num_layers, std::int32_t window = 8);

/// Ada-KV (kvpress AdaKVPress over SnapKV, alpha 0.2): `budget` tokens per kv head on average, spread
/// unevenly over the heads; contiguous cache only (a shared page table cannot hold ragged heads).
PolicyUnderTest adakv_policy(std::int32_t window = 32, std::int32_t kernel = 5);

/// Online H2O: hh = budget / 2 heavy hitters + the rest recent (the paper's 50/50 split). The prompt's
/// accumulated attention comes from the prefill's column sums (Hooks::on_prefill_attention), or, with
/// `from_column_sums` false, is recomputed from every prompt query inside the hook (what an engine whose
/// attention kernel keeps no probabilities must do).
PolicyUnderTest h2o_policy(bool from_column_sums = true);

/// kvpress ObservedAttentionPress (every prompt query's attention summed per key, normalised by the queries that
/// see it): from the prefill's column sums (Hooks::on_prefill_attention, as an engine whose attention kernel keeps
/// them pays nothing more), or, with `from_column_sums` false, recomputed from every prompt query inside the hook.
PolicyUnderTest observed_attention_policy(bool from_column_sums = true);

/// kvpress ExpectedAttentionPress defaults (512 future positions, 4 sinks, covariance, value norm).
PolicyUnderTest expected_attention_policy(double rope_base);

/// Online TOVA with a cache of `budget` tokens.
PolicyUnderTest tova_policy();

/// LAQ (window 0) or LAQ++ (window 8 prompt queries) with capacity = the budget per kv head, the reference
/// repository's defaults otherwise (stage-1 SnapKV window 32, max pool 7, window sum; 8 pseudo tokens, EOS the
/// model's) and the reference's (default) or the corrected observation mask (laq.hpp). Names "laq", "laq++",
/// with "_corrected" for the corrected mask. Both cache layouts.
PolicyUnderTest laq_policy(std::int32_t window, kvpolicy::LookaheadMask mask = kvpolicy::LookaheadMask::kReference);
/// SnapKV as LAQ's stage 1 and the LAQ paper's SnapKV baseline run it (FasterDecoding/SnapKV form: window 32,
/// max pool 7, window sum, group mean first, capacity = the budget with the window inside): "snapkv_original".
PolicyUnderTest snapkv_original_policy();

/// Quest runs on the paged cache only (it selects pages).
PolicyUnderTest quest_policy(std::int32_t dense_layers = 0);

/// Quantization alone (every token kept, the budget ignored; contiguous and paged caches): `spec` is any spec
/// of the registry's quantization policies ("ggml:type=q4_0", "fp8:format=e4m3" with dynamic per-(token,
/// head) scales, "int4", "kivi:bits=2,residual=32": a real KIVI store, kivi_hooks.hpp); the policy's name is
/// the spec.
PolicyUnderTest quantization_policy(const std::string& spec, std::int32_t head_dim);
/// Eviction then quantization on one byte budget: SnapKV (window 32, kernel 5) keeps budget * 4 * head_dim /
/// bytes_per_token tokens, so the quantized cache holds as many bytes as an fp32 cache of `budget` tokens;
/// every kept token is stored in `quant_spec`'s format. Name "snapkv+<quant_spec>". KIVI ("kivi:..."): the kept
/// tokens are compacted, then handed to KIVI (key groups over the compacted tokens); its fp16 residual of R
/// tokens counts at 2 bytes per value, so SnapKV keeps 2 budget tokens while they fit in the residual, else
/// R + (budget - R / 2) / scale (scale: KIVI's K + V bytes per token over an fp32 token's); both cache layouts.
PolicyUnderTest snapkv_quantized_policy(const std::string& quant_spec, std::int32_t head_dim);
/// Mixed precision on one byte budget (kvpolicy::MixedPrecision over SnapKV, window 32, kernel 5): the budget's
/// bytes (budget fp32 tokens), `full_share` of them on full-precision tokens, the rest on `quant_spec`'s
/// format, the lowest-ranked tokens evicted. Name "snapkv+mixed+<quant_spec>".
PolicyUnderTest snapkv_mixed_precision_policy(const std::string& quant_spec, std::int32_t head_dim, double full_share);

/// Eviction then merging on the same token budget: SnapKV (window 32, kernel 5) keeps `budget` tokens per kv
/// head and `merge` folds the evicted ones into them ("kvpress_merging": kvpress MergingPress, values only;
/// "lookm_pivot"; "d2o": as-coded mean, a fresh EMA threshold per request; "nearest_kept": persistent masses,
/// all 1 after prefill; "cam": CaM's streaming form, values only, merge_num 16, p from the prompt's accumulated
/// attention, so it reads every prompt query). Both cache layouts. Name "snapkv+<merge>".
PolicyUnderTest snapkv_merged_policy(const std::string& merge);
/// Online eviction then merging at every decode step (D2O's setting): H2O (hh = budget / 2, the rest recent)
/// evicts one token per step once the cache is full and `merge` ("d2o": the EMA threshold carried across the
/// request's steps; "nearest_kept": persistent per-slot masses) folds it into its nearest kept token; "cam":
/// CaM's streaming form, its own setting: the victim's value spreads over the next 16 kept tokens with
/// probability from the accumulated attention). Also merges after prefill. Both cache layouts. Name "h2o+<merge>".
PolicyUnderTest h2o_merged_policy(const std::string& merge);
/// Evict -> merge -> quantize as one composed policy at one hook (kvpolicy::Compress; policies.hpp,
/// pipeline_hooks) on one byte budget: as many tokens as `budget` fp32 tokens' K + V bytes hold in `quant_spec`'s
/// format (one per-token format for K and V), chosen by SnapKV (window 32, kernel 5), `merge` ("kvpress_merging":
/// kvpress MergingPress, values only) folding in the rest, stored in the format. Contiguous cache.
/// Name "snapkv+<merge>+<quant_spec>".
PolicyUnderTest snapkv_merged_quantized_policy(const std::string& merge, const std::string& quant_spec, std::int32_t head_dim);
/// kvpress CAMPress(KnormPress(), compression_interval=`interval`, target_size=budget, merge_budget) as kvpress
/// runs it, during decoding only (policies.hpp, kvpress_cam_hooks): the prompt stays whole at prefill, the
/// first `interval` decode steps accumulate attention, then the cache is cut to the budget with the newest
/// candidates' values merged. With the task sets' short answers the cut comes after the first answer token.
/// Both cache layouts. Name "kvpress_cam".
PolicyUnderTest kvpress_cam_policy(std::int64_t interval = 1, std::int32_t merge_budget = 32);
/// D2O as its repository runs it (kvpolicy::D2O; policies.hpp, d2o_hooks): at prefill each layer's budget from
/// the variance of its heads' attention column sums (D2O::layer_ratios with rho = budget / prompt, split
/// evenly between heavy hitters and recent tokens; layers 0, 1 and the last are never compressed, as coded,
/// so on a 4-layer model three layers keep everything and the kv bytes show it), then per layer D2O's
/// eviction (accumulated attention, 4 sinks) and EMA-threshold merge after prefill and at every decode step.
/// Reads every prompt query. Both cache layouts. Name "d2o"; with `protect_edge_layers` false every layer's
/// budget comes from the ratios (D2OParams::protect_edge_layers), so the layers share the budget: "d2o_all_layers".
PolicyUnderTest d2o_policy(bool protect_edge_layers = true);

/// Every policy the engine runs, in the comparison's order (Ada-KV: contiguous cache only; Quest: paged only).
/// Expected Attention reads the whole prompt's queries; ObservedAttention and H2O the prefill's column sums.
std::vector<PolicyUnderTest> all_policies(const ModelConfig& c);
/// The policy of all_policies(c) named `name`; throws naming the known ones.
PolicyUnderTest find_policy(const ModelConfig& c, const std::string& name);

struct EvalOptions {
  CacheKind cache = CacheKind::kContiguous;
  std::int32_t page_size = 16;
  /// Called after each sample with (samples done, samples in all); e.g. a progress line.
  std::function<void(std::size_t, std::size_t)> progress;
};

struct TaskScore {
  std::string task;
  std::int64_t correct = 0, count = 0;
  double accuracy() const noexcept { return count ? static_cast<double>(correct) / static_cast<double>(count) : 0.0; }
};

struct TaskEvalResult {
  std::string policy;        ///< "full" for the full-cache reference
  std::int64_t budget = -1;  ///< -1 for the full cache
  CacheKind cache = CacheKind::kContiguous;
  std::vector<TaskScore> per_task;  ///< tasks in order of first appearance
  std::int64_t correct = 0, count = 0;
  double accuracy = 0.0;
  double mean_kl = 0.0, max_kl = 0.0;              ///< KL(full || policy) per answer step, nats
  double mean_attn_err = 0.0, max_attn_err = 0.0;  ///< attention-output rel. error per (decode step, layer, query head)
  std::int64_t identical_to_full = 0;              ///< samples with bit-identical logits at every answer step
  double decision_seconds = 0.0;
  double mean_kept_bytes = 0.0, mean_full_bytes = 0.0;
  double mean_kept_fp32_bytes = 0.0;  ///< the kept tokens' bytes at fp32, whatever the format (kept tokens = this / fp32 bytes per token)
  double kv_bytes_scale = 1.0;        ///< the policy's PolicyUnderTest::kv_bytes_scale (kept tokens = bytes / scale / fp32 bytes per token)
  double mean_attended_tokens = 0.0;  ///< cached tokens read per (decode step, layer, query head)
  std::vector<std::uint8_t> sample_correct;  ///< per sample, in input order
};

namespace detail {

/// KL(p || q) of the softmaxed logits, nats.
double kl_divergence(std::span<const float> p_logits, std::span<const float> q_logits);

/// Teacher-forced run of one sample on a fresh cache: the logits of every answer step.
template <class Cache>
std::vector<std::vector<float>> run_sample(const Model& m, const PrefillState& p, const TaskSample& s, Cache cache, Hooks<Cache> hooks,
                                           SessionStats* stats, double* kept_bytes, bool attention_error = false) {
  Session<Cache> sess(m, std::move(cache), std::move(hooks));
  if (attention_error) sess.measure_attention_error();
  std::vector<std::vector<float>> steps;
  auto logits = sess.load(p);
  std::int64_t kept = 0;
  for (int l = 0; l < m.config().n_layers; ++l) kept += sess.cache().kept_tokens(l);
  *kept_bytes = static_cast<double>(kept) * 2.0 * m.config().head_dim * sizeof(typename Cache::element_type);
  for (const std::int32_t q : s.question) logits = sess.decode(q);  // question-agnostic: asked after the compression
  steps.emplace_back(logits.begin(), logits.end());
  for (std::size_t i = 0; i + 1 < s.answer.size(); ++i) {
    logits = sess.decode(s.answer[i]);
    steps.emplace_back(logits.begin(), logits.end());
  }
  *stats = sess.stats();
  return steps;
}

// Compiled once, in eval.cpp.
extern template std::vector<std::vector<float>> run_sample(const Model&, const PrefillState&, const TaskSample&, ContiguousKVCache<float>,
                                                           Hooks<ContiguousKVCache<float>>, SessionStats*, double*, bool);
extern template std::vector<std::vector<float>> run_sample(const Model&, const PrefillState&, const TaskSample&, PagedKVCache<float>,
                                                           Hooks<PagedKVCache<float>>, SessionStats*, double*, bool);

}  // namespace detail

/// Evaluates every (policy, budget) pair, plus the full cache (first result,
/// policy "full"), on `samples`. Deterministic; single-threaded.
std::vector<TaskEvalResult> run_task_eval(const Model& m, std::span<const TaskSample> samples, std::span<const PolicyUnderTest> policies,
                                          std::span<const std::int64_t> budgets, const EvalOptions& opt = {});

/// One policy at one budget (the full-cache reference is results()[0] of the general form).
TaskEvalResult run_task_eval(const Model& m, std::span<const TaskSample> samples, const PolicyUnderTest& policy, std::int64_t budget,
                             const EvalOptions& opt = {});

}  // namespace kvp_engine
