// SPDX-License-Identifier: Apache-2.0
// End-to-end task evaluation of KV-cache policies on kvp-tiny: the API the
// comparison tool calls for its "end-to-end tasks on the small model" workload.
//
//   Model model = Model::load("models/kvp-tiny");
//   auto samples = load_task_set("tests/data/engine/eval_set.json");   // passkey / multikey / copy, 1024 tokens
//   std::vector<PolicyUnderTest> policies = {snapkv_policy(), streaming_llm_policy(), quest_policy()};
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
//  * bytes kept — K/V bytes held by the cache right after the prefill hooks
//    (all layers, fp32), mean over samples, next to the full cache's; and the
//    mean number of cached tokens read per (decode step, layer, query head)
//    (what a selection policy such as Quest saves).
// Budget: tokens per kv head per layer, passed to the policy factory, which
// maps it onto the policy's own vocabulary (kvpolicy Budget::tokens, Quest's
// token_budget). A budget >= the prompt length keeps everything.
//
// Cost: one prefill per sample (shared by the full-cache reference and every
// policy and budget: the PrefillState is written into a fresh cache per run),
// plus len(answer) - 1 decode steps per run. fp32 caches only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine.hpp"
#include "kvpolicy/policy/eviction/adakv.hpp"
#include "kvpolicy/policy/eviction/observed_attention.hpp"
#include "kvpolicy/policy/eviction/pyramidkv.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "kvpolicy/policy/eviction/streaming_llm.hpp"
#include "policies.hpp"

namespace kvp_engine {

/// One evaluation prompt: tokens (BOS first) and the continuation it must produce.
struct TaskSample {
  std::string task;
  std::vector<std::int32_t> prompt;
  std::vector<std::int32_t> answer;
  std::vector<std::int64_t> needle_pos;  ///< token index where each needle starts
};

/// Reads a task set written by tools/model/export_fixtures.py:
/// {"samples": [{"task", "prompt" (text, BOS implied), "answer", "needle_pos"}...]}.
inline std::vector<TaskSample> load_task_set(const std::string& path, int bos_id = 256) {
  const auto j = nlohmann::json::parse(read_text_file(path));
  std::vector<TaskSample> out;
  for (const auto& s : j.at("samples")) {
    TaskSample t;
    t.task = s.at("task");
    t.prompt = tokenize(s.at("prompt").get<std::string>(), bos_id);
    const std::string a = s.at("answer");
    for (unsigned char ch : a) t.answer.push_back(ch);
    for (const auto& p : s.at("needle_pos")) t.needle_pos.push_back(p.get<std::int64_t>());
    out.push_back(std::move(t));
  }
  return out;
}

enum class CacheKind { kContiguous, kPaged };

/// A policy as the harness sees it: factories building the hooks of one
/// request from (prompt length, budget in tokens per kv head). A factory left
/// empty means the policy does not run on that cache layout (Quest needs pages).
struct PolicyUnderTest {
  static constexpr std::int64_t kWholePrompt = -1;
  std::string name;
  std::int64_t query_window = 64;  ///< prompt queries its after_prefill hook needs (kWholePrompt: all of them)
  std::function<Hooks<ContiguousKVCache<float>>(std::int64_t prompt_len, std::int64_t budget)> contiguous;
  std::function<Hooks<PagedKVCache<float>>(std::int64_t prompt_len, std::int64_t budget)> paged;
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

/// SnapKV keeping `budget` tokens per kv head, the observation window inside the budget (kvpress
/// pooling and reductions); prompts shorter than the budget are kept whole.
inline kvpolicy::SnapKV snapkv_with_budget(std::int64_t budget, std::int32_t window = 32, std::int32_t kernel = 5) {
  kvpolicy::SnapKVParams p = kvpolicy::SnapKVParams::kvpress(0.0, window, kernel);
  p.budget = kvpolicy::Budget::tokens(budget).clamp_to_length();
  return kvpolicy::SnapKV(p);
}
/// StreamingLLM keeping `sinks` first tokens + the most recent ones, `budget` in all.
inline kvpolicy::StreamingLLM streaming_llm_with_budget(std::int64_t budget, std::int32_t sinks = 4) {
  return kvpolicy::StreamingLLM(kvpolicy::StreamingLLMParams::original(sinks, std::max<std::int64_t>(0, budget - sinks)));
}
/// Quest with `budget` tokens per query head (budget / page_size pages, the last page included). Every layer
/// sparse by default: the paper's 2 dense layers of 32 would be a quarter of a layer of kvp-tiny, and a dense
/// layer would read more than the budget the other policies get.
inline kvpolicy::Quest quest_with_budget(std::int64_t budget, std::int32_t dense_layers = 0) {
  kvpolicy::QuestParams q;
  q.token_budget = static_cast<std::int32_t>(std::min<std::int64_t>(budget, 1 << 30));
  q.dense_layers = dense_layers;
  return kvpolicy::Quest(q);
}

/// PyramidKV (KVCache-Factory schedule): `budget` tokens per kv head on average over the layers, fewer in
/// the upper layers; observation window 8, max pooling 7 (the original's defaults).
inline PolicyUnderTest pyramidkv_policy(std::int32_t num_layers, std::int32_t window = 8) {
  return on_both_layouts("pyramidkv", 64, [=]<class Cache>(std::int64_t budget) {
    return eviction_hooks_by_layer<Cache>([=](int layer) {
      return kvpolicy::PyramidKV(kvpolicy::PyramidKVParams::original(budget, layer, num_layers, window, 7, kvpolicy::Pooling::kMax));
    });
  });
}

/// Ada-KV (kvpress AdaKVPress over SnapKV, alpha 0.2): `budget` tokens per kv head on average, spread
/// unevenly over the heads; contiguous cache only (a shared page table cannot hold ragged heads).
inline PolicyUnderTest adakv_policy(std::int32_t window = 32, std::int32_t kernel = 5) {
  PolicyUnderTest p;
  p.name = "adakv";
  p.contiguous = [=](std::int64_t, std::int64_t budget) {
    kvpolicy::AdaKVParams a = kvpolicy::AdaKVParams::kvpress(0.0, 0.2);
    a.budget = kvpolicy::Budget::tokens(budget).clamp_to_length();
    return eviction_hooks<ContiguousKVCache<float>>(
        kvpolicy::AdaKV<kvpolicy::SnapKV>(a, kvpolicy::SnapKV(kvpolicy::SnapKVParams::kvpress(0.0, window, kernel))));
  };
  return p;
}

/// Online H2O: hh = budget / 2 heavy hitters + the rest recent (the paper's 50/50 split).
inline PolicyUnderTest h2o_policy() {
  return on_both_layouts("h2o", PolicyUnderTest::kWholePrompt, []<class Cache>(std::int64_t budget) {
    return h2o_hooks<Cache>(kvpolicy::H2O(kvpolicy::H2OParams::original(budget / 2, budget - budget / 2)));
  });
}

/// kvpress ObservedAttentionPress: the whole prompt's attention per key, normalised by the queries that saw it.
inline PolicyUnderTest observed_attention_policy() {
  return on_both_layouts("observed_attention", PolicyUnderTest::kWholePrompt, []<class Cache>(std::int64_t budget) {
    kvpolicy::ObservedAttentionParams q = kvpolicy::ObservedAttentionParams::kvpress(0.0);
    q.budget = kvpolicy::Budget::tokens(budget).clamp_to_length();
    return eviction_hooks<Cache>(kvpolicy::ObservedAttention(q));  // its query window: the whole prompt
  });
}

/// kvpress ExpectedAttentionPress defaults (512 future positions, 4 sinks, covariance, value norm).
inline PolicyUnderTest expected_attention_policy(double rope_base) {
  return on_both_layouts("expected_attention", PolicyUnderTest::kWholePrompt, [rope_base]<class Cache>(std::int64_t budget) {
    kvpolicy::ExpectedAttentionParams q = kvpolicy::ExpectedAttentionParams::kvpress(0.0);
    q.budget = kvpolicy::Budget::tokens(budget).clamp_to_length();
    return expected_attention_hooks<Cache>(q, rope_base);
  });
}

/// Online TOVA with a cache of `budget` tokens.
inline PolicyUnderTest tova_policy() {
  return on_both_layouts("tova", 1, []<class Cache>(std::int64_t budget) {
    return tova_hooks<Cache>(kvpolicy::TOVA(kvpolicy::TOVAParams::original(budget)));
  });
}

inline PolicyUnderTest snapkv_policy(std::int32_t window = 32, std::int32_t kernel = 5) {
  return eviction_policy("snapkv", [=](std::int64_t budget) { return snapkv_with_budget(budget, window, kernel); });
}
inline PolicyUnderTest streaming_llm_policy(std::int32_t sinks = 4) {
  return eviction_policy("streaming_llm", [=](std::int64_t budget) { return streaming_llm_with_budget(budget, sinks); });
}

/// Quest runs on the paged cache only (it selects pages).
inline PolicyUnderTest quest_policy(std::int32_t dense_layers = 0) {
  PolicyUnderTest p;
  p.name = "quest";
  p.paged = [=](std::int64_t, std::int64_t budget) { return quest_hooks<float>(quest_with_budget(budget, dense_layers)); };
  return p;
}

/// Every policy the engine runs, in the comparison's order (Ada-KV: contiguous cache only; Quest: paged only).
/// ObservedAttention, H2O and Expected Attention read the whole prompt's queries.
inline std::vector<PolicyUnderTest> all_policies(const ModelConfig& c) {
  return {streaming_llm_policy(), h2o_policy(),        tova_policy(),
          observed_attention_policy(), snapkv_policy(), adakv_policy(),
          pyramidkv_policy(c.n_layers), expected_attention_policy(c.rope_base), quest_policy()};
}

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
  std::string policy;                 ///< "full" for the full-cache reference
  std::int64_t budget = -1;           ///< -1 for the full cache
  CacheKind cache = CacheKind::kContiguous;
  std::vector<TaskScore> per_task;    ///< tasks in order of first appearance
  std::int64_t correct = 0, count = 0;
  double accuracy = 0.0;
  double mean_kl = 0.0, max_kl = 0.0;  ///< KL(full || policy) per answer step, nats
  std::int64_t identical_to_full = 0;  ///< samples with bit-identical logits at every answer step
  double decision_seconds = 0.0;
  double mean_kept_bytes = 0.0, mean_full_bytes = 0.0;
  double mean_attended_tokens = 0.0;   ///< cached tokens read per (decode step, layer, query head)
  std::vector<std::uint8_t> sample_correct;  ///< per sample, in input order
};

namespace detail {

inline double kl_divergence(std::span<const float> p_logits, std::span<const float> q_logits) {
  auto log_softmax = [](std::span<const float> x) {
    double mx = -INFINITY;
    for (float v : x) mx = std::max(mx, static_cast<double>(v));
    double s = 0.0;
    for (float v : x) s += std::exp(static_cast<double>(v) - mx);
    std::vector<double> out(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) out[i] = static_cast<double>(x[i]) - mx - std::log(s);
    return out;
  };
  const auto lp = log_softmax(p_logits), lq = log_softmax(q_logits);
  double kl = 0.0;
  for (std::size_t i = 0; i < lp.size(); ++i) kl += std::exp(lp[i]) * (lp[i] - lq[i]);
  return std::max(0.0, kl);
}

/// Teacher-forced run of one sample on a fresh cache: the logits of every answer step.
template <class Cache>
std::vector<std::vector<float>> run_sample(const Model& m, const PrefillState& p, const TaskSample& s, Cache cache, Hooks<Cache> hooks,
                                           SessionStats* stats, double* kept_bytes) {
  Session<Cache> sess(m, std::move(cache), std::move(hooks));
  std::vector<std::vector<float>> steps;
  auto logits = sess.load(p);
  std::int64_t kept = 0;
  for (int l = 0; l < m.config().n_layers; ++l) kept += sess.cache().kept_tokens(l);
  *kept_bytes = static_cast<double>(kept) * 2.0 * m.config().head_dim * sizeof(typename Cache::element_type);
  steps.emplace_back(logits.begin(), logits.end());
  for (std::size_t i = 0; i + 1 < s.answer.size(); ++i) {
    logits = sess.decode(s.answer[i]);
    steps.emplace_back(logits.begin(), logits.end());
  }
  *stats = sess.stats();
  return steps;
}

}  // namespace detail

/// Evaluates every (policy, budget) pair, plus the full cache (first result,
/// policy "full"), on `samples`. Deterministic; single-threaded.
inline std::vector<TaskEvalResult> run_task_eval(const Model& m, std::span<const TaskSample> samples, std::span<const PolicyUnderTest> policies,
                                                 std::span<const std::int64_t> budgets, const EvalOptions& opt = {}) {
  const ModelConfig& c = m.config();
  std::int64_t max_len = 0;
  for (const auto& s : samples) max_len = std::max<std::int64_t>(max_len, static_cast<std::int64_t>(s.prompt.size() + s.answer.size()));
  const CacheShape shape{c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, max_len};

  std::vector<TaskEvalResult> results;
  auto add_result = [&](std::string name, std::int64_t budget) -> TaskEvalResult& {
    TaskEvalResult r;
    r.policy = std::move(name);
    r.budget = budget;
    r.cache = opt.cache;
    results.push_back(std::move(r));
    return results.back();
  };
  add_result("full", -1);
  for (const auto& p : policies) {
    const bool runs = opt.cache == CacheKind::kContiguous ? static_cast<bool>(p.contiguous) : static_cast<bool>(p.paged);
    if (!runs) continue;
    for (auto b : budgets) add_result(p.name, b);
  }
  std::vector<std::int64_t> kl_steps(results.size(), 0);

  // Prompt queries to keep: the largest window any policy asks for.
  std::int64_t window = 1;
  for (const auto& p : policies) window = p.query_window == PolicyUnderTest::kWholePrompt ? max_len : std::max(window, p.query_window);

  for (std::size_t si = 0; si < samples.size(); ++si) {
    const TaskSample& s = samples[si];
    if (s.answer.empty()) throw std::runtime_error("run_task_eval: sample with an empty answer");
    PrefillOptions po;
    po.query_window = window;
    const PrefillState pre = prefill(m, s.prompt, po);
    // Scores one run of this sample into result `ri`; `ref` is the full-cache run (null for the reference itself).
    auto score = [&](std::size_t ri, const std::vector<std::vector<float>>& steps, const std::vector<std::vector<float>>* ref,
                     const SessionStats& st, double kept_bytes) {
      TaskEvalResult& r = results[ri];
      bool ok = true, same = true;
      for (std::size_t i = 0; i < steps.size(); ++i) {
        ok = ok && argmax(steps[i]) == s.answer[i];
        if (ref != nullptr) {
          const double kl = detail::kl_divergence((*ref)[i], steps[i]);
          r.mean_kl += kl;
          r.max_kl = std::max(r.max_kl, kl);
          same = same && steps[i] == (*ref)[i];
        }
      }
      kl_steps[ri] += static_cast<std::int64_t>(steps.size());
      auto it = std::find_if(r.per_task.begin(), r.per_task.end(), [&](const TaskScore& t) { return t.task == s.task; });
      if (it == r.per_task.end()) it = r.per_task.insert(r.per_task.end(), TaskScore{s.task, 0, 0});
      it->correct += ok;
      ++it->count;
      r.correct += ok;
      ++r.count;
      r.identical_to_full += same ? 1 : 0;
      r.decision_seconds += st.hook_seconds;
      r.mean_kept_bytes += kept_bytes;
      r.mean_full_bytes += static_cast<double>(pre.length) * c.n_layers * static_cast<double>(m.kv_bytes_per_token(sizeof(float)));
      r.mean_attended_tokens +=
          st.decode_layer_steps ? static_cast<double>(st.attended_tokens) / static_cast<double>(st.decode_layer_steps * c.n_heads) : 0.0;
      r.sample_correct.push_back(ok ? 1 : 0);
    };
    // One teacher-forced run on a fresh cache of the configured layout.
    auto run = [&](const PolicyUnderTest* p, std::int64_t budget, SessionStats* st, double* kept) {
      if (opt.cache == CacheKind::kContiguous) {
        using C = ContiguousKVCache<float>;
        return detail::run_sample<C>(m, pre, s, C(shape), p ? p->contiguous(pre.length, budget) : Hooks<C>{}, st, kept);
      }
      using P = PagedKVCache<float>;
      return detail::run_sample<P>(m, pre, s, P(shape, opt.page_size), p ? p->paged(pre.length, budget) : Hooks<P>{}, st, kept);
    };
    SessionStats st;
    double kept = 0.0;
    const auto full = run(nullptr, -1, &st, &kept);
    score(0, full, nullptr, st, kept);
    std::size_t ri = 1;
    for (const auto& p : policies) {
      const bool runs = opt.cache == CacheKind::kContiguous ? static_cast<bool>(p.contiguous) : static_cast<bool>(p.paged);
      if (!runs) continue;
      for (auto b : budgets) {
        st = SessionStats{};
        const auto steps = run(&p, b, &st, &kept);
        score(ri++, steps, &full, st, kept);
      }
    }
    if (opt.progress) opt.progress(si + 1, samples.size());
  }
  for (std::size_t i = 0; i < results.size(); ++i) {
    auto& r = results[i];
    const double n = static_cast<double>(std::max<std::int64_t>(r.count, 1));
    r.accuracy = static_cast<double>(r.correct) / n;
    r.mean_kl = kl_steps[i] ? r.mean_kl / static_cast<double>(kl_steps[i]) : 0.0;
    r.mean_kept_bytes /= n;
    r.mean_full_bytes /= n;
    r.mean_attended_tokens /= n;
  }
  return results;
}

/// One policy at one budget (the full-cache reference is results()[0] of the general form).
inline TaskEvalResult run_task_eval(const Model& m, std::span<const TaskSample> samples, const PolicyUnderTest& policy, std::int64_t budget,
                                    const EvalOptions& opt = {}) {
  const std::int64_t b[] = {budget};
  return run_task_eval(m, samples, std::span<const PolicyUnderTest>(&policy, 1), b, opt).at(1);
}

}  // namespace kvp_engine
