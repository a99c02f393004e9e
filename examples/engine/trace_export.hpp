// SPDX-License-Identifier: Apache-2.0
// Attention traces from the engine: the post-RoPE queries, keys and values the
// engine computes on one prompt and on a few greedy decode steps, written in
// the project's trace format (include/kvpolicy/io/trace.hpp), so the policy
// comparison (tools/compare, `kvpolicy-compare --trace FILE`) replays a real
// model's layers without PyTorch. tools/trace/export_trace.py writes the same
// format from a Hugging Face model; on kvp-tiny both agree (tests/engine/
// test_trace_export.cpp checks this against the committed Python-made trace).
//
//   kvp_engine --model SmolLM2-135M-Instruct.Q4_1.gguf --prompt "..." --tokens 8
//              --export-trace smollm2.safetensors [--trace-layers 0,15,29]   (one command line)
//
// What is recorded, per recorded layer (trace layer i is model layer
// `layers[i]`; the metadata key "source_layers" lists them, and the
// comparison reports the model's layer numbers):
//   q (Hq, T, d)            the prefill's post-RoPE queries of every prompt token
//   k, v (Hkv, T, d)        the prompt's post-RoPE keys and values, as the cache receives them
//   q_decode (Hq, D, d)     the query of each of D greedy decode steps on the full cache
//   k_decode, v_decode      the decode tokens' keys and values
//   positions / positions_decode, rope.inv_freq (the engine's base^(-2i/d), computed in double as the
//   engine's RoPE tables are), tokens (the prompt's ids), needles (prompt indices of each occurrence of the
//   answer's tokens, when an answer is given; the comparison's needle recall)
// Metadata: format/version, num_* shapes, rope_theta, attn_scale, model, exporter, source_layers and
// source_num_layers (the model's layer count).
// Every tensor is fp16 or fp32 (TraceExportOptions::dtype); the engine computes in fp32.
//
// Errors (std::runtime_error, nothing written): an empty prompt, a layer out of range or repeated, a prompt
// plus decode steps beyond the model's context, an unwritable path.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "model.hpp"

namespace kvp_engine {

struct TraceExportOptions {
  std::vector<int> layers;                                    ///< model layers to record, ascending or not (empty: every layer)
  int decode_steps = 8;                                       ///< greedy decode steps recorded after the prompt (0: none)
  bool fp16 = true;                                           ///< tensors in fp16 (the committed traces' dtype); false: fp32
  std::vector<std::int32_t> answer;                           ///< the answer's token ids: their occurrences in the prompt become `needles`
  std::string model_name;                                     ///< metadata "model" (default: the model's name)
  std::vector<std::pair<std::string, std::string>> metadata;  ///< extra free-form metadata strings
};

/// What the export did (for messages and tests).
struct TraceExportResult {
  std::int64_t prompt_tokens = 0;
  std::vector<std::int32_t> decoded;  ///< the greedy tokens fed at the decode steps
  std::vector<std::int64_t> needles;
};

/// Runs `prompt` (token ids, BOS included when the model wants one) through the engine with the full cache,
/// decodes `decode_steps` greedy tokens and writes the trace to `path`; throws std::runtime_error.
TraceExportResult export_trace(const Model& m, std::span<const std::int32_t> prompt, const TraceExportOptions& opt,
                               const std::string& path);

/// Prompt indices of every occurrence of `needle` (a token sequence) in `prompt`, each occurrence's tokens.
std::vector<std::int64_t> find_occurrences(std::span<const std::int32_t> prompt, std::span<const std::int32_t> needle);

}  // namespace kvp_engine
