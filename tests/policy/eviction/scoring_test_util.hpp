// Helpers of the scoring-policy tests: ragged KeepSet runs (Ada-KV), golden
// inputs of reference §11 in the layouts the policies take.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "policy/golden_inputs.hpp"
#include "policy/policy_test_util.hpp"

namespace kvp_test {

/// evict() of a policy with ragged rows: capacity from `max_total_kept` when
/// the policy has it, else kept_count * rows; workspace and output sized by
/// `requirements` on `shape` (its batch set to the batch's size).
template <class Backend, class Policy, class In>
KeepSetBuffer run_ragged(const Policy& p, const std::vector<In>& batch, std::int64_t rows_per_seq, ProblemShape shape,
                         const ExecContext& ctx = {}) {
  std::int64_t total = 0;
  for (const auto& in : batch) {
    if constexpr (requires { p.max_total_kept(std::int64_t{}, std::int64_t{}); }) {
      total += std::max<std::int64_t>(p.max_total_kept(in.keys.kv_len(), rows_per_seq), 0);
    } else {
      total += std::max<std::int64_t>(p.kept_count(in.keys.kv_len()), 0) * rows_per_seq;
    }
  }
  shape.batch = static_cast<std::int64_t>(batch.size());
  KeepSetBuffer keep(static_cast<std::int64_t>(batch.size()) * rows_per_seq, std::max<std::int64_t>(total, 1));
  const Requirements req = p.requirements(Context<Backend>{{}, ctx}, shape);
  INFO(req.status.message());
  REQUIRE(req.status.is_ok());
  REQUIRE(req.output.rows == keep.view().num_rows);
  REQUIRE(req.output.capacity >= total);
  std::vector<std::byte> ws(req.workspace_bytes);
  const Status s = p.evict(Context<Backend>{Workspace{ws.data(), ws.size()}, ctx}, std::span<const In>(batch), keep.view());
  INFO(s.message());
  REQUIRE(s.is_ok());
  return keep;
}

/// Every row ascending, unique, in range.
inline void require_valid_rows(const KeepSetBuffer& keep, std::int64_t rows, std::int64_t T) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const auto row = keep.row(r);
    REQUIRE(std::is_sorted(row.begin(), row.end()));
    REQUIRE(std::adjacent_find(row.begin(), row.end()) == row.end());
    if (!row.empty()) REQUIRE((row.front() >= 0 && row.back() < T));
  }
}

/// §11 inputs: last-w post-RoPE queries (Hq, w, d) and post-RoPE keys (Hkv, T, d), fp32.
struct GoldenSnap {
  std::vector<float> q, k;
  explicit GoldenSnap(int w) {
    const auto qd = golden::queries(), kd = golden::keys();
    const int T = golden::kT, d = golden::kD;
    q.resize(golden::kHq * w * d);
    k.assign(kd.begin(), kd.end());
    for (int h = 0; h < golden::kHq; ++h)
      for (int i = 0; i < w; ++i)
        for (int c = 0; c < d; ++c) q[(h * w + i) * d + c] = static_cast<float>(qd[(h * T + T - w + i) * d + c]);
  }
  ScoreInput<float, float> input(int w) const {
    return {TensorView<const float, 3>::contiguous(q.data(), {golden::kHq, w, golden::kD}),
            KVSource<float>::from(TensorView<const float, 3>::contiguous(k.data(), {golden::kHkv, golden::kT, golden::kD}))};
  }
};

}  // namespace kvp_test
