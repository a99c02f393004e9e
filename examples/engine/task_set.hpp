// SPDX-License-Identifier: Apache-2.0
// The evaluation prompts of the task harness (eval.hpp): what
// tools/model/export_fixtures.py writes (tests/data/engine/eval_set.json).
// load_task_set is defined in model.cpp (kvp_engine_lib), with the engine's
// other JSON readers.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace kvp_engine {

/// One evaluation prompt: tokens (BOS first) and the continuation it must produce.
struct TaskSample {
  std::string task;
  std::vector<std::int32_t> prompt;
  std::vector<std::int32_t> answer;
  std::vector<std::int64_t> needle_pos;  ///< token index where each needle starts
  /// Question-agnostic setup: fed token by token after the prompt (the context) was prefilled and compressed,
  /// before the answer (kvpress's pipeline). Empty in the question-aware setup (the question is in `prompt`).
  std::vector<std::int32_t> question;
};

/// Reads a task set written by tools/model/export_fixtures.py:
/// {"samples": [{"task", "prompt" (text, BOS implied), "answer", "needle_pos"}...]}.
std::vector<TaskSample> load_task_set(const std::string& path, int bos_id = 256);

/// Where the question of a text task sits relative to the compression.
enum class QuestionSetup {
  kAware,     ///< inside the prefilled (compressed) prompt: prompt = context + question (the SnapKV paper's setup)
  kAgnostic,  ///< asked after the context was compressed (kvpress's pipeline): prompt = context, then question
};

/// Tokenizes text for a model (the engine's BPE tokenizer for a GGUF model, bytes for kvp-tiny).
using TextEncoder = std::function<std::vector<std::int32_t>(const std::string&)>;

/// Reads a text task set: {"samples": [{"task", "prompt", "answer"} or {"task", "context", "question",
/// "answer"}, ...]} (optional per sample: "filler", "length"; tests/data/engine/smollm2_tasks.json,
/// tools/model/make_smollm2_tasks.py). `task` becomes "<task>" plus ":<filler>:<length>" when present. The
/// answer's tokens are those `encode(prompt + answer)` adds after `encode(prompt)` when that is a prefix (the
/// tokens the model would generate), else `encode(answer)`. kAgnostic needs "context" and "question"; kAware
/// uses "prompt", or context + question. Throws std::runtime_error naming the sample on a missing field or an
/// empty answer.
std::vector<TaskSample> load_text_task_set(const std::string& path, const TextEncoder& encode, QuestionSetup setup,
                                           std::int32_t bos_id = -1);

}  // namespace kvp_engine
