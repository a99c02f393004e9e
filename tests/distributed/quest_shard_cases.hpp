// Quest with its heads sharded: each rank selects pages for its kv heads (and
// their query heads) from its slice of the page pool and the metadata; the
// rows equal the single-process rows of those heads in every GQA mode. No
// collective is needed (Quest is per kv head); whole GQA groups per rank are
// what kUnion / kGroupMax / kGroupSum require, and `HeadShard` enforces them.
#pragma once

#include <string>
#include <vector>

#include "distributed/shard_cases.hpp"
#include "kvpolicy/policy/selection/quest.hpp"
#include "policy/selection/quest_fixture.hpp"

namespace kvp_test {

/// Pages of kv heads [h0, h1) of one layer: one rank's view of the pool and metadata.
struct QuestLayer {
  quest_test::PagedCache<half> cache;
  quest_test::MetaBuffer<half> meta;
  std::int32_t Hq;
  std::vector<float> q;  // (batch, Hq, d)

  QuestLayer(std::int32_t Hkv, std::int32_t G, std::int32_t d, std::int32_t page_size, const std::vector<std::int64_t>& lens, unsigned seed)
      : cache(pool_pages(lens, page_size), Hkv, page_size, d, PageLayout::kNHD, static_cast<std::int32_t>(lens.size()), seed),
        meta(pool_pages(lens, page_size), Hkv, d),
        Hq(Hkv * G) {
    std::vector<std::int32_t> append;
    for (std::size_t b = 0; b < lens.size(); ++b) {
      cache.append_normal(static_cast<std::int32_t>(b), lens[b]);
      append.push_back(static_cast<std::int32_t>(lens[b]));
    }
    (void)Quest{}.on_append(Context<backend::Cpu>{}, AppendInput<half>{cache.view(), append.data()}, meta.view());
    std::mt19937 rng(seed * 3 + 1);
    std::normal_distribution<float> nd;
    q.resize(lens.size() * static_cast<std::size_t>(Hq * d));
    for (auto& x : q) x = nd(rng);
  }
  static std::int32_t pool_pages(const std::vector<std::int64_t>& lens, std::int32_t P) {
    std::int64_t n = 2;
    for (auto l : lens) n += (l + P - 1) / P;
    return static_cast<std::int32_t>(n);
  }

  /// The decode input, page view and metadata of kv heads [h0, h1).
  Status select(const Quest& quest, int layer, std::int32_t h0, std::int32_t h1, const ExecContext& exec,
                quest_test::SelectionBuffer* out) const {
    const std::int32_t G = Hq / cache.kv_heads, d = cache.head_dim, n = h1 - h0;
    const TensorView<const float, 3> queries(q.data() + static_cast<std::int64_t>(h0) * G * d, {cache.batch(), n * G, d},
                                             {static_cast<std::int64_t>(Hq) * d, d, 1});
    const DecodeInput<float> in{queries, cache.table(), cache.page_size, layer};
    PageMetaView<const half> m = meta.cview();
    m.max_data += static_cast<std::int64_t>(h0) * m.head_stride;
    m.min_data += static_cast<std::int64_t>(h0) * m.head_stride;
    m.num_kv_heads = n;
    Quest::Plan plan;
    const ProblemShape shape{.num_q_heads = n * G, .num_kv_heads = n, .head_dim = d};
    KVP_RETURN_IF_ERROR(quest.plan(Context<backend::Cpu>{{}, exec}, in, shape, plan));
    *out = quest_test::SelectionBuffer(plan.requirements.output.rows, plan.requirements.output.capacity);
    std::vector<std::byte> ws(plan.requirements.workspace_bytes);
    return quest.select(Context<backend::Cpu>{Workspace{ws.data(), ws.size()}, exec}, plan, in, m, out->view());
  }
};

inline ShardCaseResult run_quest_shard_cases(const Collective& comm) {
  ShardCaseResult res;
  const std::vector<std::int64_t> lens{0, 7, 48, 16 * 17 + 5, 16 * 40};
  const QuestLayer L(8, 4, 32, 16, lens, 77);
  for (const QuestGqa mode : {QuestGqa::kPerQueryHead, QuestGqa::kUnion, QuestGqa::kGroupMax, QuestGqa::kGroupSum}) {
    for (const std::int32_t pages : {1, 4, 9}) {
      ++res.cases;
      const Quest quest(QuestParams{.budget = Budget::tokens(pages * 16), .dense_layers = 2, .gqa = mode});
      const std::string name = "quest mode " + std::to_string(static_cast<int>(mode)) + " budget " + std::to_string(pages) + " pages";
      quest_test::SelectionBuffer full(1, 1), mine(1, 1);
      const Status sf = L.select(quest, 3, 0, 8, ExecContext{}, &full);
      const auto [h0, h1] = shard_range(8, comm.world_size, comm.rank);
      const HeadShard shard{h0, 8, 32, &comm};
      ExecContext exec;
      exec.shard = &shard;
      const Status ss = L.select(quest, 3, static_cast<std::int32_t>(h0), static_cast<std::int32_t>(h1), exec, &mine);
      if (!sf.is_ok() || !ss.is_ok()) {
        res.fails.push_back(name + ": " + (sf.is_ok() ? ss.message() : sf.message()));
        continue;
      }
      const std::int64_t per_kv = mode == QuestGqa::kPerQueryHead ? 4 : 1, rows_full = 8 * per_kv, rows_mine = (h1 - h0) * per_kv;
      for (std::size_t b = 0; b < lens.size(); ++b)
        for (std::int64_t r = 0; r < rows_mine; ++r) {
          const std::int64_t rf = static_cast<std::int64_t>(b) * rows_full + h0 * per_kv + r,
                             rm = static_cast<std::int64_t>(b) * rows_mine + r;
          if (mine.row(rm) != full.row(rf) || mine.row_logical(rm) != full.row_logical(rf) ||
              mine.last[static_cast<std::size_t>(rm)] != full.last[static_cast<std::size_t>(rf)]) {
            res.fails.push_back(name + ": rank " + std::to_string(comm.rank) + " sequence " + std::to_string(b) + " row " +
                                std::to_string(rf));
            b = lens.size();
            break;
          }
        }
    }
  }
  return res;
}

}  // namespace kvp_test
