// SPDX-License-Identifier: Apache-2.0
// Trace workloads from the real model: for each task of the real model's task
// set (passkey, multikey, quote), the first question-aware prompt of the
// chosen haystack and length runs through the engine on the full cache, and
// the engine writes its attention trace (examples/engine/trace_export.hpp:
// post-RoPE queries, keys and values of the chosen layers, plus greedy decode
// steps; the answer's prompt tokens as needles). The comparison then replays
// these traces like any `--trace` file: every layer-level policy, every budget,
// judged on the real model's own decode queries ("trace:<model>-<task>-<filler>-<len>"
// workloads, rows per layer with the model's layer numbers).
//
// The files go to <out-dir>/traces/ when the run has an output directory
// (users can replay or inspect them), else to a temporary directory removed
// after loading.
#pragma once

#include <filesystem>
#include <set>
#include <stdexcept>
#include <string>
#include <unistd.h>
#include <vector>

#include "engine/task_set.hpp"
#include "engine/trace_export.hpp"
#include "trace_cases.hpp"

namespace kvp_compare {

struct RealTraceOptions {
  std::string model, task_set;
  std::string out_dir;  ///< where the trace files go ("" : a temporary directory, removed after loading)
  int max_tasks = 3;    ///< tasks traced, in the set's order (0: none)
  std::string filler = "prose";
  std::int64_t length = 512;  ///< the sample's "length" field
  std::vector<int> layers{0, 15, 29};
  int decode_steps = 8;
};

/// Exports the traces and appends their layer cases to `out`; returns the trace files' paths (empty when
/// they were temporary). Throws std::runtime_error (a missing cell names the task, haystack and length).
inline std::vector<std::string> load_real_traces(const RealTraceOptions& o, std::vector<LayerCase>* out) {
  using namespace kvp_engine;
  if (o.max_tasks <= 0) return {};
  const Model m = Model::load(o.model);
  const TextEncoder enc = [&m](const std::string& t) { return m.encode(t); };
  const ModelConfig& c = m.config();
  const auto samples = load_text_task_set(o.task_set, enc, QuestionSetup::kAware, c.add_bos ? c.bos_id : -1);
  const std::string cell = ":" + o.filler + ":" + std::to_string(o.length);
  std::vector<const TaskSample*> picked;
  std::set<std::string> seen;
  for (const auto& s : samples) {
    if (s.task.size() <= cell.size() || s.task.compare(s.task.size() - cell.size(), cell.size(), cell) != 0) continue;
    if (!seen.insert(s.task).second) continue;
    picked.push_back(&s);
    if (static_cast<int>(picked.size()) == o.max_tasks) break;
  }
  if (picked.empty())
    throw std::runtime_error("real traces: no sample of haystack '" + o.filler + "' and length " + std::to_string(o.length) + " in " +
                             o.task_set);
  const bool keep = !o.out_dir.empty();
  namespace fs = std::filesystem;
  const fs::path dir =
      keep ? fs::path(o.out_dir) / "traces" : fs::temp_directory_path() / ("kvpolicy-compare-traces-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::string stem = m.name();
  if (auto dash = stem.find('-'); dash != std::string::npos) stem.resize(dash);  // "SmolLM2-135M-Instruct.Q4_1" -> "SmolLM2"
  std::vector<std::string> paths;
  for (const TaskSample* s : picked) {
    std::string name = stem + "-" + s->task;  // SmolLM2-passkey:prose:512 -> SmolLM2-passkey-prose-512
    for (char& ch : name)
      if (ch == ':') ch = '-';
    const std::string path = (dir / (name + ".safetensors")).string();
    TraceExportOptions to;
    to.layers = o.layers;
    to.decode_steps = o.decode_steps;
    to.answer = s->answer;
    to.metadata.emplace_back("prompt_source", o.task_set + " (" + s->task + ", question-aware)");
    export_trace(m, s->prompt, to, path);
    const kvpolicy::Status st = load_trace_cases(path, out);
    if (!keep) fs::remove(path);
    kvpolicy::throw_if_error(st);
    if (keep) paths.push_back(path);
  }
  if (!keep) {
    std::error_code ec;
    fs::remove(dir, ec);
  }
  return paths;
}

}  // namespace kvp_compare
