// SPDX-License-Identifier: Apache-2.0
// The evaluation prompts of the task harness (eval.hpp): what
// tools/model/export_fixtures.py writes (tests/data/engine/eval_set.json).
// load_task_set is defined in model.cpp (kvp_engine_lib), with the engine's
// other JSON readers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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
std::vector<TaskSample> load_task_set(const std::string& path, int bos_id = 256);

}  // namespace kvp_engine
