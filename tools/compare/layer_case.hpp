// SPDX-License-Identifier: Apache-2.0
// `LayerCase`: one attention layer of one prompt as the comparison replays it.
// Every workload (the built-in synthetic one, trace files) is turned into a
// list of LayerCases; every policy decides on each case from the prompt part
// alone, and the decision is judged by the evaluation queries the policy never
// saw (future decode steps, or held-out prompt tokens).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvpolicy/core/dtype.hpp"

namespace kvp_compare {

struct LayerCase {
  std::string workload;  ///< "synthetic", "trace:<file stem>", ...
  std::string model;     ///< model name ("" for synthetic data)
  std::int32_t layer = 0, num_layers = 1;
  std::int32_t instance = 0;  ///< synthetic seed index (cases with equal (workload, layer) are averaged)
  std::int32_t num_q_heads = 0, num_kv_heads = 0, head_dim = 0;
  std::int64_t kv_len = 0;                          ///< T: prompt tokens the policy sees
  std::int64_t num_eval = 0;                        ///< F: evaluation queries per head
  std::int32_t window = 32;                         ///< observation window (last prompt queries) for window-based policies
  std::int32_t sinks = 4;                           ///< attention-sink tokens for StreamingLLM
  float scale = 0.0f;                               ///< logit scale
  kvpolicy::DType storage = kvpolicy::DType::kF16;  ///< the source's K/V element type (bytes accounting)

  std::vector<float> q;         ///< (Hq, T, d)  post-RoPE prompt queries (all of them)
  std::vector<float> q_pre;     ///< (Hq, T, d)  pre-RoPE prompt queries (Expected Attention); empty: `q` (no RoPE)
  std::vector<float> inv_freq;  ///< (d/2) RoPE frequencies for Expected Attention (zeros when the data has no RoPE)
  float rope_scaling = 1.0f;
  std::vector<float> k, v;                    ///< (Hkv, T, d)
  std::vector<float> eq;                      ///< (Hq, F, d)  evaluation queries
  std::vector<float> ek, ev;                  ///< (Hkv, F, d) keys/values of the evaluation steps (may be empty): step f sees 0..f
  std::vector<std::int32_t> needles;          ///< prompt token ids that must be retrievable (may be empty)
  std::vector<std::int32_t> needle_of_query;  ///< (Hq, F): index into `needles` that query looks for, -1: none; empty: all needles

  std::int32_t group() const noexcept { return num_q_heads / num_kv_heads; }
  bool has_eval_kv() const noexcept { return !ek.empty(); }
};

}  // namespace kvp_compare
