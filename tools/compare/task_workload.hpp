// SPDX-License-Identifier: Apache-2.0
// The end-to-end workload: the policies inside the engine loop
// (examples/engine/) on the committed kvp-tiny model and its retrieval tasks
// (passkey, multi-key recall, copy; tests/data/engine/eval_set.json, prompts of
// ~1020 tokens), judged by what the model answers.
//
// Per task, policy and budget (rows with workload "tasks:<task>", layer "all"):
//   accuracy   exact match of the answer (teacher-forced decoding = greedy exact match)
//   logit_kl   KL(full || policy) of the next-token distribution at every answer step, nats, mean
//   rel_err    attention-output error ||o - o_full|| / ||o_full|| at every decode step, layer and query
//              head, o_full the same query over the unevicted, unmerged, unquantized cache (eval.hpp), mean
//   time_ms    time inside the policy hooks per request (after-prefill decision, per-step
//              metadata / selection / online updates), mean over the task's samples
//   kv_bytes   K/V bytes per layer held after the prefill hooks (fp32 cache), mean
//   kept_tokens  prompt tokens per kv head and layer a decode step reads: the cache
//              length after eviction, or the tokens of the selected pages (Quest)
// "Full" (family baseline) is the full cache. Budgets are tokens per kv head and
// layer; a kvpress ratio r becomes int(T (1 - r)) tokens for the task's longest
// prompt T. Quest runs on the paged cache (pages of 16 tokens), the others on the
// contiguous one (Ada-KV's ragged heads need it); both give bit-identical full-cache
// logits (tests/engine). Everything is deterministic and single-threaded.
// The engine's policies are named as the kvpolicy registry names them; each row
// carries the name, family and query-awareness of the comparison's entry on the
// same registry policy (policies.hpp, entry_for_registry_name).
//
// Build: the engine is kvp_engine_lib (examples/engine/), linked, not compiled here.
#pragma once

#include <algorithm>
#include <cstdio>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/eval.hpp"
#include "policies.hpp"
#include "results.hpp"

namespace kvp_compare {

struct TaskWorkloadOptions {
  std::string model_dir, task_set;  ///< kvp-tiny's directory, or a llama-architecture .gguf file (text task sets)
  int per_task = 40;                ///< first N samples of each task in the set (0: all)
  bool progress = true;
  /// Text task sets (a GGUF model): the setups to run (workload "tasks-aware:..." / "tasks-agnostic:...") and
  /// the prompt lengths to keep (the sample's "length"; empty: all).
  std::vector<kvp_engine::QuestionSetup> setups = {kvp_engine::QuestionSetup::kAware, kvp_engine::QuestionSetup::kAgnostic};
  std::vector<std::int64_t> lengths;
  std::vector<std::string> fillers;  ///< haystacks to keep (the sample's "filler"; empty: all)
};

namespace detail {

/// The groups of samples one workload each: kvp-tiny's task set by task ("tasks:<task>"), a text task set by
/// setup and task cell ("tasks-aware:passkey:prose:512"), the first `per_task` samples of each.
inline std::vector<std::pair<std::string, std::vector<kvp_engine::TaskSample>>> task_groups(const TaskWorkloadOptions& o,
                                                                                            const kvp_engine::Model& model) {
  std::vector<std::pair<std::string, std::vector<kvp_engine::TaskSample>>> groups;
  auto add = [&](const std::string& prefix, std::vector<kvp_engine::TaskSample> all) {
    std::map<std::string, std::size_t> at;
    for (auto& s : all) {
      if (!o.fillers.empty() && std::none_of(o.fillers.begin(), o.fillers.end(),
                                             [&](const std::string& f) { return s.task.find(":" + f + ":") != std::string::npos; }))
        continue;
      if (!o.lengths.empty()) {
        const auto colon = s.task.rfind(':');
        const std::int64_t len = colon == std::string::npos ? -1 : std::atoll(s.task.c_str() + colon + 1);
        if (std::find(o.lengths.begin(), o.lengths.end(), len) == o.lengths.end()) continue;
      }
      const std::string name = prefix + s.task;
      auto it = at.find(name);
      if (it == at.end()) {
        it = at.emplace(name, groups.size()).first;
        groups.push_back({name, {}});
      }
      auto& v = groups[it->second].second;
      if (o.per_task <= 0 || static_cast<int>(v.size()) < o.per_task) v.push_back(std::move(s));
    }
  };
  if (model.bpe() == nullptr) {
    add("tasks:", kvp_engine::load_task_set(o.task_set, model.config().bos_id));
  } else {
    const kvp_engine::TextEncoder enc = [&model](const std::string& t) { return model.encode(t); };
    for (auto setup : o.setups)
      add(setup == kvp_engine::QuestionSetup::kAware ? "tasks-aware:" : "tasks-agnostic:",
          kvp_engine::load_text_task_set(o.task_set, enc, setup, model.config().add_bos ? model.config().bos_id : -1));
  }
  return groups;
}

}  // namespace detail

/// Runs the workload and appends its rows. `policies`: display names to run (empty: all the engine has).
inline void run_task_workload(const TaskWorkloadOptions& o, const std::vector<BudgetSpec>& budgets,
                              const std::vector<std::string>& policies, std::vector<ResultRow>* rows) {
  const kvp_engine::Model model = kvp_engine::Model::load(o.model_dir);
  const auto& cfg = model.config();
  // Workloads in order of appearance, the first per_task samples of each.
  const auto groups = detail::task_groups(o, model);
  // The engine's policies under the comparison's names (p.name becomes the entry's name).
  const std::vector<PolicySpec> entries = all_policies();
  std::map<std::string, const PolicySpec*> entry_of;
  std::vector<kvp_engine::PolicyUnderTest> contiguous, paged;
  for (auto& p : kvp_engine::all_policies(cfg)) {
    const PolicySpec* e = entry_for_registry_name(entries, p.name);
    if (e == nullptr) throw std::runtime_error("engine policy '" + p.name + "' has no entry in tools/compare/policies.hpp");
    if (!policies.empty() && std::find(policies.begin(), policies.end(), e->name) == policies.end()) continue;
    p.name = e->name;
    entry_of[e->name] = e;
    (p.contiguous ? contiguous : paged).push_back(std::move(p));
  }
  std::size_t done = 0, total = 0;
  for (const auto& g : groups) total += g.second.size() * (paged.empty() ? 1 : 2);
  const double per_layer = 1.0 / static_cast<double>(cfg.n_layers);
  const double bytes_per_token_head = 2.0 * cfg.head_dim * sizeof(float);

  for (const auto& [wl, samples] : groups) {
    const std::string& task = wl;
    std::int64_t T = 0;
    for (const auto& s : samples) T = std::max<std::int64_t>(T, static_cast<std::int64_t>(s.prompt.size()));
    std::vector<std::int64_t> tokens;
    // Token budgets as given (not clamped to the prompt: decoding appends, and online policies and Quest
    // act on the growing cache); ratios against the prompt.
    for (const auto& b : budgets)
      tokens.push_back(b.kind == BudgetSpec::Kind::kTokens ? static_cast<std::int64_t>(b.value) : b.tokens_for(T));
    auto emit = [&](const kvp_engine::TaskEvalResult& r, const BudgetSpec* b, const std::string& family, bool query_aware) {
      const double n = static_cast<double>(std::max<std::int64_t>(r.count, 1));
      const bool selection = family == "selection";
      // Tokens kept per kv head: the kept tokens' fp32 bytes over an fp32 token's (whatever format holds them).
      const double kept = selection ? r.mean_attended_tokens : r.mean_kept_fp32_bytes * per_layer / (bytes_per_token_head * cfg.n_kv_heads);
      ResultRow base{wl,
                     model.name(),
                     "all",
                     r.budget < 0 ? "Full" : r.policy,
                     family,
                     query_aware,
                     b ? b->kind_name() : "full",
                     b ? b->value : static_cast<double>(T),
                     kept,
                     "",
                     0.0,
                     r.count};
      auto add = [&](const char* metric, double v) {
        ResultRow row = base;
        row.metric = metric;
        row.value = v;
        rows->push_back(row);
      };
      add("accuracy", r.accuracy);
      if (r.budget >= 0) add("logit_kl", r.mean_kl);
      if (r.budget >= 0) add("rel_err", r.mean_attn_err);
      add("time_ms", 1e3 * r.decision_seconds / n);
      add("kv_bytes", r.mean_kept_bytes * per_layer);
    };
    auto progress = [&](std::size_t, std::size_t) {
      ++done;
      if (o.progress) {
        std::fprintf(stderr, "\r\033[K[tasks] %s: %zu / %zu requests", task.c_str(), done, total);
        std::fflush(stderr);
      }
    };
    auto run = [&](const std::vector<kvp_engine::PolicyUnderTest>& ps, kvp_engine::CacheKind cache, bool with_full) {
      kvp_engine::EvalOptions eo;
      eo.cache = cache;
      eo.progress = progress;
      const auto res = kvp_engine::run_task_eval(model, samples, ps, tokens, eo);
      if (with_full) emit(res[0], nullptr, "baseline", false);
      std::size_t i = 1;
      for (const auto& p : ps) {
        const PolicySpec& e = *entry_of.at(p.name);
        for (std::size_t bi = 0; bi < budgets.size(); ++bi, ++i) emit(res[i], &budgets[bi], e.family, e.query_aware);
      }
    };
    run(contiguous, kvp_engine::CacheKind::kContiguous, true);
    if (!paged.empty()) run(paged, kvp_engine::CacheKind::kPaged, false);
  }
  if (o.progress) std::fprintf(stderr, "\r\033[K");
}

}  // namespace kvp_compare
