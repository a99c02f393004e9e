// The sharding cases, shared by the in-process test (ranks as threads,
// test_sharding.cpp) and the multi-process MPI test (test_mpi_sharding.cpp):
// a batch of ragged sequences is decided once by one process holding every
// head, and once per rank on that rank's heads only (a `HeadShard` in the
// ExecContext); every rank's rows must equal the single-process rows of its
// heads, bit for bit. Independent of the test framework: a case returns its
// mismatches as text.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/core/collective.hpp"
#include "kvpolicy/policy/eviction/adakv.hpp"
#include "kvpolicy/policy/eviction/pyramidkv.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "policy/keep_set_buffer.hpp"

namespace kvp_test {
using namespace kvpolicy;

enum class ScorePattern {
  kRandom,       ///< normal keys and queries
  kTiedHeads,    ///< every kv head has the same keys and every group the same queries: equal scores across heads
  kCoarse,       ///< keys and queries from {-1, 0, 1}: many equal scores inside and across heads
  kNonFiniteKey  ///< random, with one key row +inf in head 0 (NaN scores there)
};

/// One layer's batch: queries (Hq, w, d) fp32 and keys (Hkv, T_b, d) fp16 per sequence.
struct ShardBatch {
  std::int64_t Hq = 0, Hkv = 0, d = 0, w = 0;
  std::vector<std::int64_t> lens;
  std::vector<std::vector<float>> q;
  std::vector<std::vector<half>> k;

  ShardBatch(std::int64_t hq, std::int64_t hkv, std::int64_t dim, std::int64_t window, std::vector<std::int64_t> lengths, ScorePattern pat,
             unsigned seed)
      : Hq(hq), Hkv(hkv), d(dim), w(window), lens(std::move(lengths)) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::uniform_int_distribution<int> tri(-1, 1);
    const std::int64_t G = Hq / Hkv;
    for (const std::int64_t T : lens) {
      std::vector<float> qs(static_cast<std::size_t>(Hq * w * d));
      std::vector<half> ks(static_cast<std::size_t>(Hkv * T * d));
      auto draw = [&]() { return pat == ScorePattern::kCoarse ? static_cast<float>(tri(rng)) : nd(rng); };
      for (auto& x : qs) x = draw();
      for (auto& x : ks) x = from_float<half>(draw());
      if (pat == ScorePattern::kTiedHeads) {
        for (std::int64_t h = 1; h < Hkv; ++h) std::copy(ks.begin(), ks.begin() + T * d, ks.begin() + h * T * d);
        for (std::int64_t h = 1; h < Hkv; ++h) std::copy(qs.begin(), qs.begin() + G * w * d, qs.begin() + h * G * w * d);
      }
      if (pat == ScorePattern::kNonFiniteKey && T > w + 2)
        for (std::int64_t c = 0; c < d; ++c) ks[static_cast<std::size_t>(1 * d + c)] = from_float<half>(INFINITY);
      q.push_back(std::move(qs));
      k.push_back(std::move(ks));
    }
  }

  /// The inputs of kv heads [h0, h1) (and their query heads), every sequence.
  std::vector<ScoreInput<float, half>> inputs(std::int64_t h0, std::int64_t h1) const {
    const std::int64_t G = Hq / Hkv;
    std::vector<ScoreInput<float, half>> in;
    for (std::size_t b = 0; b < lens.size(); ++b) {
      const std::int64_t T = lens[b];
      in.push_back(
          ScoreInput<float, half>{TensorView<const float, 3>::contiguous(q[b].data() + h0 * G * w * d, {(h1 - h0) * G, w, d}),
                                  KVSource<half>::from(TensorView<const half, 3>::contiguous(k[b].data() + h0 * T * d, {h1 - h0, T, d}))});
    }
    return in;
  }
  std::vector<ScoreInput<float, half>> inputs() const { return inputs(0, Hkv); }
};

/// One policy's decision on `batch`, KeepSet and workspace sized by the size query.
template <class Policy>
Status decide(const Policy& p, const std::vector<ScoreInput<float, half>>& batch, const ExecContext& exec, KeepSetBuffer* out) {
  ProblemShape shape{batch[0].queries.extent(0), batch[0].keys.kv_heads(), batch[0].keys.head_dim(), 0, batch[0].queries.extent(1)};
  for (const auto& in : batch) shape.max_kv_len = std::max(shape.max_kv_len, in.keys.kv_len());
  shape.batch = static_cast<std::int64_t>(batch.size());
  const Requirements req = p.requirements(Context<backend::Cpu>{{}, exec}, shape);
  if (!req.status.is_ok()) return req.status;
  *out = KeepSetBuffer(req.output.rows, std::max<std::int64_t>(req.output.capacity, 1));
  std::vector<std::byte> ws(req.workspace_bytes);
  return p.evict(Context<backend::Cpu>{Workspace{ws.data(), ws.size()}, exec}, std::span<const ScoreInput<float, half>>(batch),
                 out->view());
}

/// Kv heads [first, end) of rank r when H heads are split over W ranks as
/// evenly as possible (the first H % W ranks get one more).
inline std::pair<std::int64_t, std::int64_t> shard_range(std::int64_t H, int W, int r) {
  const std::int64_t base = H / W, extra = H % W;
  const std::int64_t first = r * base + std::min<std::int64_t>(r, extra);
  return {first, first + base + (r < extra ? 1 : 0)};
}

/// The policy decided on rank `rank`'s heads against one process holding all
/// of them; "" when every row of this rank equals the single-process row.
template <class Policy>
std::string check_sharded(const char* name, const Policy& p, const ShardBatch& sb, bool per_query_rows, const Collective& comm,
                          const ExecContext& pool = {}) {
  char msg[512];
  const std::int64_t G = sb.Hq / sb.Hkv, per_kv = per_query_rows ? G : 1;
  KeepSetBuffer full(1, 1), mine(1, 1);
  const Status sf = decide(p, sb.inputs(), pool, &full);
  if (!sf.is_ok()) return std::string(name) + ": single process failed: " + sf.message();
  const auto [h0, h1] = shard_range(sb.Hkv, comm.world_size, comm.rank);
  const HeadShard shard{h0, sb.Hkv, sb.Hq, &comm};
  ExecContext exec = pool;
  exec.shard = &shard;
  const Status ss = decide(p, sb.inputs(h0, h1), exec, &mine);
  if (!ss.is_ok()) return std::string(name) + ": sharded call failed on rank " + std::to_string(comm.rank) + ": " + ss.message();
  const std::int64_t rows_full = sb.Hkv * per_kv, rows_mine = (h1 - h0) * per_kv;
  for (std::size_t b = 0; b < sb.lens.size(); ++b)
    for (std::int64_t r = 0; r < rows_mine; ++r) {
      const auto a = mine.row(static_cast<std::int64_t>(b) * rows_mine + r);
      const auto e = full.row(static_cast<std::int64_t>(b) * rows_full + h0 * per_kv + r);
      if (a != e) {
        std::snprintf(msg, sizeof(msg), "%s: rank %d of %d, sequence %zu (T=%lld), row %lld: %zu tokens kept, single process %zu", name,
                      comm.rank, comm.world_size, b, static_cast<long long>(sb.lens[b]), static_cast<long long>(h0 * per_kv + r), a.size(),
                      e.size());
        return msg;
      }
    }
  return "";
}

/// Every policy with a global budget (Ada-KV in each variant) and the per-head
/// ones that shard for free (SnapKV, PyramidKV), on every pattern: 4 x 28 decisions.
struct ShardCaseResult {
  int cases = 0;  ///< decisions compared
  std::vector<std::string> fails;
};
inline ShardCaseResult run_shard_cases(const Collective& comm, const ExecContext& pool = {}) {
  ShardCaseResult res;
  auto add = [&](std::string s) {
    ++res.cases;
    if (!s.empty()) res.fails.push_back(std::move(s));
  };
  const ScorePattern pats[] = {ScorePattern::kRandom, ScorePattern::kTiedHeads, ScorePattern::kCoarse, ScorePattern::kNonFiniteKey};
  unsigned seed = 1;
  for (const ScorePattern pat : pats) {
    // 8 kv heads x 4 (32 query heads), head_dim 32, window 8; ragged: one short, 3 that evict.
    const ShardBatch sb(32, 8, 32, 8, {9, 40, 203, 512}, pat, seed++);
    const SnapKV snap_kvpress(SnapKVParams::kvpress(0.0, 8, 5));
    const SnapKV snap_ada(adakv_scoring(8, 7));
    const char* pname[] = {"random", "tied heads", "coarse", "non-finite key"};
    const std::string tag = std::string(" (") + pname[static_cast<int>(pat)] + ")";
    for (const double r : {0.25, 0.5, 0.9}) {
      for (const double alpha : {0.0, 0.2, 1.0}) {
        AdaKVParams kp = AdaKVParams::kvpress(r, alpha);
        add(check_sharded(("adakv kvpress r=" + std::to_string(r) + " alpha=" + std::to_string(alpha) + tag).c_str(),
                          AdaKV<SnapKV>(kp, snap_kvpress), sb, false, comm, pool));
      }
      AdaKVParams one = AdaKVParams::kvpress(r, 0.2);
      one.budget = one.budget.keep_at_least_one();
      add(check_sharded(("adakv kvpress at_least_one r=" + std::to_string(r) + tag).c_str(), AdaKV<SnapKV>(one, snap_kvpress), sb, false,
                        comm, pool));
    }
    for (const std::int64_t C : {std::int64_t{12}, std::int64_t{64}, std::int64_t{300}}) {
      for (const bool norm : {false, true}) {
        add(check_sharded(("adakv original_gqa C=" + std::to_string(C) + (norm ? " normalize" : "") + tag).c_str(),
                          AdaKV<SnapKV>(AdaKVParams::original_gqa(C, 0.2, norm), snap_ada), sb, false, comm, pool));
        add(check_sharded(("adakv original per query head C=" + std::to_string(C) + (norm ? " normalize" : "") + tag).c_str(),
                          AdaKV<SnapKV>(AdaKVParams::original(C, 0.2, norm), snap_ada), sb, true, comm, pool));
      }
    }
    add(check_sharded(("snapkv" + tag).c_str(), SnapKV(SnapKVParams::kvpress(0.5, 8, 5)), sb, false, comm, pool));
    for (const std::int32_t layer : {0, 15, 31}) {
      const PyramidKVParams pp = PyramidKVParams::kvpress(0.5, layer, 32, 8);
      add(check_sharded(("pyramidkv layer " + std::to_string(layer) + tag).c_str(), PyramidKV(pp), sb, false, comm, pool));
    }
  }
  return res;
}

}  // namespace kvp_test
