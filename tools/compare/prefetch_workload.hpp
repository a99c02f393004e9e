// SPDX-License-Identifier: Apache-2.0
// The prefetch workload: the four prefetch policies inside the engine loop
// (examples/engine/prefetch.hpp) on kvp-tiny's task prompts, then the offload
// simulator (eval/offload_sim.hpp) over what they requested, for a sweep of
// device budgets, against "fetch on miss" and "everything resident".
//
// Per real selection ("prefetch:quest" = Quest's pages for the real query,
// "prefetch:exact_topk" = the exact top pages of the real query; 8 pages per
// query head, last page included, pages of 16 tokens) and device budget
// (pages per layer), rows with family "prefetch" (the policies) or "baseline"
// (fetch_on_miss, all_resident), budget_kind "device_pages":
//   pred_recall        def 1 of §6.3, pooled over heads, layers, steps, samples (policy counters;
//                      independent of the device budget)
//   buffer_hit         def 2 (previous step's pages resident; first step skipped)
//   late_miss          def 3 (neither reused nor predicted)
//   sim_pred_recall    read pages the request named / read pages (simulator)
//   sim_buffer_hit     read pages resident before the step / read pages (simulator, finite buffer)
//   sim_late_miss      read pages late or fetched on demand / read pages (simulator)
//   bytes_per_step     host -> device bytes per decode step (all layers)
//   stall_us_per_step  simulated attention wait per decode step (all layers), microseconds
//   time_ms            mean time of one predict call (ms)
//   kept_tokens        mean tokens of the pages a layer step reads (pooled over heads)
// Each sample is prefilled once and decoded greedily for `steps` tokens under
// every policy (the policies do not change what the model computes, so every
// policy sees the same selections; the baselines replay the first policy's
// trace). Deterministic and single-threaded.
#pragma once

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "engine/prefetch.hpp"
#include "engine/task_set.hpp"
#include "results.hpp"

namespace kvp_compare {

struct PrefetchWorkloadOptions {
  std::string model_dir, task_set;
  int samples = 2;                         ///< prompts (round robin over the set's tasks)
  int steps = 16;                          ///< decode steps per prompt
  std::vector<std::int64_t> device_pages;  ///< device budgets per layer (empty: 6 from the largest step to the pool)
  double bandwidth_gb_s = 25.0, latency_us = 10.0, layer_us = 20.0;
  bool progress = true;
};

inline const char* prefetch_display_name(kvp_engine::PrefetchKind k) {
  switch (k) {
    case kvp_engine::PrefetchKind::kQuestLookahead: return "QuestLookahead";
    case kvp_engine::PrefetchKind::kInfiniGen: return "InfiniGen";
    case kvp_engine::PrefetchKind::kSpeCache: return "SpeCache";
    case kvp_engine::PrefetchKind::kShadowKV: return "ShadowKV";
  }
  return "?";
}

/// Runs the workload; appends its rows and returns notes (skipped budgets).
inline std::vector<std::string> run_prefetch_workload(const PrefetchWorkloadOptions& o, std::vector<ResultRow>* rows) {
  using namespace kvp_engine;
  std::vector<std::string> notes;
  const Model model = Model::load(o.model_dir);
  // kvp-tiny's byte task set, or a text task set (question-aware prompts) for a GGUF model.
  const TextEncoder enc = [&model](const std::string& t) { return model.encode(t); };
  const auto all = model.bpe() == nullptr
                       ? load_task_set(o.task_set, model.config().bos_id)
                       : load_text_task_set(o.task_set, enc, QuestionSetup::kAware, model.config().add_bos ? model.config().bos_id : -1);
  // Round robin over tasks: first sample of each task, then the second, ...
  std::map<std::string, std::vector<const TaskSample*>> by_task;
  std::vector<std::string> tasks;
  for (const auto& s : all) {
    if (by_task[s.task].empty()) tasks.push_back(s.task);
    by_task[s.task].push_back(&s);
  }
  std::vector<const TaskSample*> picked;
  for (std::size_t i = 0; static_cast<int>(picked.size()) < o.samples; ++i) {
    bool any = false;
    for (const auto& t : tasks)
      if (i < by_task[t].size() && static_cast<int>(picked.size()) < o.samples) {
        picked.push_back(by_task[t][i]);
        any = true;
      }
    if (!any) break;
  }
  std::vector<PrefillState> prefills;
  for (const auto* s : picked) {
    PrefillOptions po;
    po.query_window = static_cast<std::int64_t>(s->prompt.size());  // InfiniGen's prepare reads every prompt query
    prefills.push_back(prefill(model, s->prompt, po));
  }
  for (ActualSelection actual : {ActualSelection::kQuest, ActualSelection::kExactTopK}) {
    const std::string wl = std::string("prefetch:") + actual_selection_name(actual);
    // traces[kind][sample]
    std::vector<std::vector<PrefetchTrace>> traces;
    for (PrefetchKind k : kAllPrefetchKinds) {
      auto& v = traces.emplace_back();
      for (std::size_t i = 0; i < prefills.size(); ++i) {
        if (o.progress) {
          std::fprintf(stderr, "\r\033[K[prefetch] %s: %s, prompt %zu / %zu", wl.c_str(), prefetch_display_name(k), i + 1, prefills.size());
          std::fflush(stderr);
        }
        PrefetchLoopOptions lo;
        lo.kind = k;
        lo.actual = actual;
        v.push_back(run_prefetch_loop(model, prefills[i], lo, o.steps));
      }
    }
    std::size_t most = 0;
    double page_tokens = 0, events = 0;
    std::int32_t pool = 0;
    for (const auto& t : traces[0]) {
      pool = std::max(pool, t.pool_pages);
      for (const auto& e : t.events) {
        most = std::max(most, e.needed.size());
        page_tokens += static_cast<double>(e.needed.size()) * 16.0;
        ++events;
      }
    }
    const double kept = events > 0 ? page_tokens / events : 0.0;
    std::vector<std::int64_t> budgets = o.device_pages;
    if (budgets.empty())
      for (int i = 0; i < 6; ++i)
        budgets.push_back(static_cast<std::int64_t>(most) + (static_cast<std::int64_t>(pool) - static_cast<std::int64_t>(most)) * i / 5);
    std::sort(budgets.begin(), budgets.end());
    budgets.erase(std::unique(budgets.begin(), budgets.end()), budgets.end());
    auto add = [&](const std::string& policy, const char* family, double budget, const char* metric, double v, long long n) {
      rows->push_back(ResultRow{wl, model.name(), "all", policy, family, true, "device_pages", budget, kept, metric, v, n});
    };
    const double steps = static_cast<double>(o.steps) * static_cast<double>(prefills.size());
    for (const std::int64_t dp : budgets) {
      if (dp < static_cast<std::int64_t>(most)) {
        notes.push_back(wl + ": device budget " + std::to_string(dp) + " pages < the " + std::to_string(most) +
                        " pages one layer step reads");
        continue;
      }
      kvpolicy::OffloadSimParams sp{.bandwidth_gb_s = o.bandwidth_gb_s, .latency_us = o.latency_us, .device_pages = dp};
      auto sim_all = [&](const std::vector<PrefetchTrace>& ts, kvpolicy::OffloadMode mode) {
        kvpolicy::OffloadTotals tot;
        for (const auto& t : ts) {
          kvpolicy::OffloadTotals one;
          kvpolicy::throw_if_error(simulate_trace(t, sp, mode, o.layer_us, &one));
          tot.sum.needed += one.sum.needed;
          tot.sum.requested_needed += one.sum.requested_needed;
          tot.sum.resident_hits += one.sum.resident_hits;
          tot.sum.late += one.sum.late;
          tot.sum.demand += one.sum.demand;
          tot.sum.bytes += one.sum.bytes;
          tot.sum.stall_us += one.sum.stall_us;
          tot.steps += one.steps;
        }
        return tot;
      };
      auto emit_sim = [&](const std::string& name, const char* family, const kvpolicy::OffloadTotals& t) {
        add(name, family, static_cast<double>(dp), "sim_pred_recall", t.prediction_recall(), t.steps);
        add(name, family, static_cast<double>(dp), "sim_buffer_hit", t.buffer_hit_rate(), t.steps);
        add(name, family, static_cast<double>(dp), "sim_late_miss", t.late_miss_rate(), t.steps);
        add(name, family, static_cast<double>(dp), "bytes_per_step", t.sum.bytes / steps, t.steps);
        add(name, family, static_cast<double>(dp), "stall_us_per_step", t.sum.stall_us / steps, t.steps);
      };
      for (std::size_t ki = 0; ki < traces.size(); ++ki) {
        const std::string name = prefetch_display_name(kAllPrefetchKinds[ki]);
        kvpolicy::PrefetchCounters c;
        double predict_s = 0;
        std::int64_t calls = 0;
        for (const auto& t : traces[ki]) {
          c += t.total();
          predict_s += t.predict_seconds;
          calls += t.predict_calls;
        }
        add(name, "prefetch", static_cast<double>(dp), "pred_recall", c.prediction_recall(), c.steps);
        add(name, "prefetch", static_cast<double>(dp), "buffer_hit", c.buffer_hit_rate(), c.steps);
        add(name, "prefetch", static_cast<double>(dp), "late_miss", c.late_miss_rate(), c.steps);
        add(name, "prefetch", static_cast<double>(dp), "time_ms", calls > 0 ? 1e3 * predict_s / static_cast<double>(calls) : 0.0, calls);
        emit_sim(name, "prefetch", sim_all(traces[ki], kvpolicy::OffloadMode::kPrefetch));
      }
      emit_sim("fetch_on_miss", "baseline", sim_all(traces[0], kvpolicy::OffloadMode::kFetchOnMiss));
      emit_sim("all_resident", "baseline", sim_all(traces[0], kvpolicy::OffloadMode::kAllResident));
    }
  }
  if (o.progress) std::fprintf(stderr, "\r\033[K");
  return notes;
}

/// Console table of the prefetch rows: one line per (workload, policy, device budget).
inline void print_prefetch_table(FILE* out, const std::vector<ResultRow>& rows) {
  struct Key {
    std::string wl, policy;
    double budget;
    bool operator<(const Key& o) const { return std::tie(wl, budget, policy) < std::tie(o.wl, o.budget, o.policy); }
  };
  std::map<Key, std::map<std::string, double>> cells;
  std::vector<Key> order;
  for (const auto& r : rows) {
    if (r.budget_kind != "device_pages") continue;
    const Key k{r.workload, r.policy, r.budget_value};
    if (!cells.count(k)) order.push_back(k);
    cells[k][r.metric] = r.value;
  }
  std::string wl;
  for (const auto& k : order) {
    if (k.wl != wl) {
      wl = k.wl;
      std::fprintf(out, "\n== %s (per decode step; hit rates pooled) ==\n%-16s %6s %9s %9s %9s %9s %9s %10s %11s\n", wl.c_str(), "policy",
                   "pages", "recall", "buf_hit", "late", "sim_hit", "sim_late", "KiB/step", "stall_us");
    }
    const auto& m = cells[k];
    auto get = [&](const char* name) { return m.count(name) ? m.at(name) : -1.0; };
    auto col = [&](const char* name) {
      const double v = get(name);
      if (v < 0)
        std::fprintf(out, " %9s", "-");
      else
        std::fprintf(out, " %9.4f", v);
    };
    std::fprintf(out, "%-16s %6.0f", k.policy.c_str(), k.budget);
    col("pred_recall");
    col("buffer_hit");
    col("late_miss");
    col("sim_buffer_hit");
    col("sim_late_miss");
    std::fprintf(out, " %10.1f %11.2f\n", get("bytes_per_step") / 1024.0, get("stall_us_per_step"));
  }
}

}  // namespace kvp_compare
