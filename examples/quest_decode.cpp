// Quest in a decode loop over a paged KV cache, the way an engine drives it:
//
//   prefill (chunked)  append K/V to the page pool, Quest::on_append
//   every decode step  append one token per sequence, on_append,
//                      per layer: Quest::plan + Quest::select -> PageSelection (FlashInfer CSR)
//                      -> attention over the selected pages only
//
// The model is synthetic (random post-RoPE keys with planted clusters that the
// decode queries look for), the cache layout is real: one NHD fp16 page pool
// per layer, pages handed out from a shuffled free list, a ragged batch. Each
// step prints the output error against full attention, the attention mass
// the selection keeps and the bytes read vs dense; the end prints the same
// metrics for token budgets 64 / 256 / 1024 / 4096.
//
//   quest_decode [--steps N] [--budget TOKENS] [--threads T]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/eval/page_metrics.hpp"
#include "kvpolicy/policy/selection/quest.hpp"
#include "kvpolicy/util/thread_pool.hpp"

using namespace kvpolicy;
using Backend = backend::Cpu;

namespace {

constexpr std::int32_t kLayers = 4, kHq = 16, kHkv = 4, kG = kHq / kHkv, kDim = 64, kPage = 16;

/// The engine side: page pools (one per layer), page tables, Quest metadata.
struct Engine {
  std::int32_t num_pages;
  PageStrides strides = PageStrides::contiguous(PageLayout::kNHD, kHkv, kPage, kDim);
  std::vector<std::vector<half>> k, v, meta;     // per layer
  std::vector<std::vector<std::int32_t>> pages;  // per sequence
  std::vector<std::int64_t> len;
  std::vector<std::int32_t> free, indptr, indices, last;
  std::vector<std::vector<float>> topics;  // per (layer, kv head): directions some keys and queries share
  std::mt19937 rng{7};

  Engine(std::int32_t pool_pages, std::int32_t batch) : num_pages(pool_pages), pages(batch), len(batch, 0) {
    const std::size_t pool = static_cast<std::size_t>(pool_pages) * kHkv * kPage * kDim;
    for (int l = 0; l < kLayers; ++l) {
      k.emplace_back(pool);
      v.emplace_back(pool);
      meta.emplace_back(static_cast<std::size_t>(PageMetaView<half>::contiguous_size(pool_pages, kHkv, kDim)));
    }
    free.resize(static_cast<std::size_t>(pool_pages));
    std::iota(free.begin(), free.end(), 0);
    std::shuffle(free.begin(), free.end(), rng);
    std::normal_distribution<float> nd;
    for (int i = 0; i < kLayers * kHkv * 8; ++i) {
      std::vector<float> t(kDim);
      for (auto& x : t) x = nd(rng);
      topics.push_back(t);
    }
    rebuild_table();
  }
  std::int32_t batch() const { return static_cast<std::int32_t>(len.size()); }
  void rebuild_table() {
    indptr.assign(1, 0);
    indices.clear();
    last.clear();
    for (std::size_t b = 0; b < pages.size(); ++b) {
      indices.insert(indices.end(), pages[b].begin(), pages[b].end());
      indptr.push_back(static_cast<std::int32_t>(indices.size()));
      last.push_back(len[b] == 0 ? 0 : static_cast<std::int32_t>((len[b] - 1) % kPage + 1));
    }
  }
  PageTable table() const { return PageTable{indptr.data(), indices.data(), last.data(), batch()}; }
  PagedKVView<const half> view(int l) const {
    return PagedKVView<const half>{k[l].data(), v[l].data(), strides, strides, num_pages, kHkv, kPage, kDim, table(), kHost};
  }
  PageMetaView<half> meta_view(int l) { return PageMetaView<half>::contiguous(meta[l].data(), num_pages, kHkv, kDim); }
  const float* topic(int l, int g, int i) const { return topics[static_cast<std::size_t>((l * kHkv + g) * 8 + i)].data(); }

  /// Appends n tokens to every sequence in `who` (post-RoPE K/V "computed by
  /// the model"), then updates each layer's Quest metadata.
  void append(const std::vector<std::int32_t>& n, const ExecContext& ctx) {
    std::normal_distribution<float> nd;
    std::uniform_real_distribution<float> u;
    for (std::int32_t b = 0; b < batch(); ++b) {
      for (std::int32_t i = 0; i < n[b]; ++i) {
        const std::int64_t t = len[b]++;
        if (t % kPage == 0) {
          pages[b].push_back(free.back());
          free.pop_back();
        }
        const std::int64_t off = pages[b].back() * strides.page + (t % kPage) * strides.slot;
        const int topic_id = (t / 64) % 8;     // runs of 64 tokens share a topic
        const bool on_topic = u(rng) < 0.15f;  // a few keys in each run carry it strongly
        for (int l = 0; l < kLayers; ++l)
          for (int g = 0; g < kHkv; ++g)
            for (int c = 0; c < kDim; ++c) {
              const float topic_part = on_topic ? 2.5f * topic(l, g, topic_id)[c] : 0.0f;
              k[l][off + g * strides.head + c] = to_half(0.8f * nd(rng) + topic_part);
              v[l][off + g * strides.head + c] = to_half(nd(rng));
            }
      }
    }
    rebuild_table();
    const Quest quest{};  // the metadata (page channel min / max) does not depend on Quest's parameters
    for (int l = 0; l < kLayers; ++l) {
      const PagedKVView<const half> kv = view(l);
      throw_if_error(quest.on_append(Context<Backend>{{}, ctx}, AppendInput<half>{kv, n.data()}, meta_view(l)));
    }
  }

  /// This step's queries of layer l: each head leans towards one topic.
  std::vector<float> queries(int l) {
    std::normal_distribution<float> nd;
    std::vector<float> q(static_cast<std::size_t>(batch()) * kHq * kDim);
    for (std::int32_t b = 0; b < batch(); ++b)
      for (int h = 0; h < kHq; ++h) {
        const float* t = topic(l, h / kG, static_cast<int>(rng() % 8));
        for (int c = 0; c < kDim; ++c) q[(static_cast<std::size_t>(b) * kHq + h) * kDim + c] = 0.5f * nd(rng) + 0.8f * t[c];
      }
    return q;
  }
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// Running means of the quality / cost of one (budget, GQA mode) setting.
struct Tally {
  double recall64 = 0, recall_budget = 0, mass = 0, err = 0, bytes = 0;
  int n = 0;
  void print(const char* label) const {
    const double k = std::max(n, 1);
    std::printf("%-26s %10.4f %12.4f %10.4f %12.4f %12.4f\n", label, recall64 / k, recall_budget / k, mass / k, err / k, bytes / k);
  }
};

/// Quest's selection for layer l (caller-owned CSR buffers sized up front).
struct Selection {
  std::vector<std::int32_t> indptr, last, idx;
  PageSelection view;
  double seconds = 0;
};
Selection select(Engine& eng, int l, TensorView<const float, 3> qv, const Quest& quest, const ExecContext& ctx) {
  const DecodeInput<float> in{qv, eng.table(), kPage, l};
  Quest::Plan plan;  // host work per batch composition: validation, output and workspace sizes
  throw_if_error(quest.plan(Context<Backend>{{}, ctx}, in, ProblemShape{.num_q_heads = kHq, .num_kv_heads = kHkv, .head_dim = kDim}, plan));
  const std::int64_t rows = plan.requirements.output.rows;
  Selection s;
  s.indptr.resize(static_cast<std::size_t>(rows + 1));
  s.last.resize(static_cast<std::size_t>(rows));
  s.idx.resize(static_cast<std::size_t>(plan.requirements.output.capacity));
  s.view = PageSelection{s.indptr.data(), s.idx.data(), s.last.data(), nullptr, rows, static_cast<std::int64_t>(s.idx.size())};
  std::vector<std::byte> ws(plan.requirements.workspace_bytes);
  const auto t0 = std::chrono::steady_clock::now();
  throw_if_error(quest.select(Context<Backend>{Workspace{ws.data(), ws.size()}, ctx}, plan, in, eng.meta_view(l), s.view));
  s.seconds = seconds_since(t0);
  return s;
}

/// Adds the selection's quality (vs full attention) and bytes (vs dense) to t.
void evaluate(Engine& eng, int l, TensorView<const float, 3> qv, const Quest& quest, const Selection& s, const ExecContext& ctx, Tally& t) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(kDim));
  PageQuality at64, at_budget;
  throw_if_error(page_quality<Backend>(eng.view(l), qv, s.view, 64, scale, &at64, {}, ctx));
  throw_if_error(page_quality<Backend>(eng.view(l), qv, s.view, static_cast<std::int32_t>(quest.params().budget.total(0, 0)), scale,
                                       &at_budget, {}, ctx));
  StepBytes sb;
  throw_if_error(selection_bytes(eng.table(), kPage, s.view, kHq, kHkv, kDim, sizeof(half), sizeof(half), quest.page_budget(kPage), &sb));
  t.recall64 += at64.page_recall;
  t.recall_budget += at_budget.page_recall;
  t.mass += at64.mass_recall;
  t.err += at64.output_rel_error;
  t.bytes += sb.fraction();
  ++t.n;
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 8, budget = 1024, threads = 2;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--steps")
      steps = std::atoi(argv[i + 1]);
    else if (a == "--budget")
      budget = std::atoi(argv[i + 1]);
    else if (a == "--threads")
      threads = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: %s [--steps N] [--budget TOKENS] [--threads T]\n", argv[0]);
      return 2;
    }
  }
  ThreadPool pool(threads);
  const ExecContext ctx = pool.context();
  const std::vector<std::int32_t> prompt{12000, 7003};  // ragged batch
  Engine eng(static_cast<std::int32_t>((prompt[0] + prompt[1] + 2 * steps) / kPage + 8), 2);

  // Prefill in chunks of 1000 tokens (chunks straddle pages; metadata resumes partial pages).
  for (std::int32_t done = 0; done < prompt[0]; done += 1000) {
    std::vector<std::int32_t> n(2);
    for (int b = 0; b < 2; ++b) n[b] = std::max(0, std::min(1000, prompt[b] - done));
    eng.append(n, ctx);
  }
  std::printf("Quest decode: %d layers (first %d dense), %d q / %d kv heads, head_dim %d, page %d, fp16, backend %s, %d threads\n", kLayers,
              Quest().params().dense_layers, kHq, kHkv, kDim, kPage, Backend::isa_name(), threads);
  std::printf("prompt lengths %d and %d tokens; token budget %d (page budget %d, last page included)\n\n", prompt[0], prompt[1], budget,
              Quest(QuestParams{.budget = Budget::tokens(budget)}).page_budget(kPage));
  std::printf("%5s %10s %10s %12s %12s %12s %12s\n", "step", "rel.err", "mass", "bytes/dense", "select ms", "sparse ms", "dense ms");

  const std::vector<int> budgets{64, 256, 1024, 4096};
  const std::vector<std::pair<QuestGqa, const char*>> modes{{QuestGqa::kPerQueryHead, "per query head"},
                                                            {QuestGqa::kUnion, "union over group"},
                                                            {QuestGqa::kGroupMax, "group max"},
                                                            {QuestGqa::kGroupSum, "group sum"}};
  std::vector<Tally> by_budget(budgets.size()), by_mode(modes.size());
  const float scale = 1.0f / std::sqrt(static_cast<float>(kDim));
  for (int step = 0; step < steps; ++step) {
    eng.append({1, 1}, ctx);
    Tally now;
    double t_sel = 0, t_sparse = 0, t_dense = 0;
    for (int l = 0; l < kLayers; ++l) {
      const std::vector<float> q = eng.queries(l);
      const auto qv = TensorView<const float, 3>::contiguous(q.data(), {eng.batch(), kHq, kDim});
      const Quest quest(QuestParams{.budget = Budget::tokens(budget)});
      const Selection sel = select(eng, l, qv, quest, ctx);
      t_sel += sel.seconds;
      if (quest.is_dense_layer(l)) continue;  // layers 0, 1 attend to every page: nothing to measure
      evaluate(eng, l, qv, quest, sel, ctx, now);
      // Attention over the selection vs over every page (what the engine's kernel would run).
      std::vector<float> o(static_cast<std::size_t>(eng.batch()) * kHq * kDim);
      std::vector<std::byte> aws(attend_pages_workspace<Backend>(kG, kPage, kDim, ctx));
      const auto ov = TensorView<float, 3>::contiguous(o.data(), {eng.batch(), kHq, kDim});
      auto t0 = std::chrono::steady_clock::now();
      throw_if_error(selection_attention<Backend>(eng.view(l), qv, sel.view, scale, ov, {}, Workspace{aws.data(), aws.size()}, ctx));
      t_sparse += seconds_since(t0);
      t0 = std::chrono::steady_clock::now();
      throw_if_error(dense_attention<Backend>(eng.view(l), qv, scale, ov, {}, Workspace{aws.data(), aws.size()}, ctx));
      t_dense += seconds_since(t0);
      // The tables at the end: every budget (reference GQA mode) and every GQA mode (this budget).
      if (step % 2 == 0) {
        for (std::size_t i = 0; i < budgets.size(); ++i) {
          const Quest qb(QuestParams{.budget = Budget::tokens(budgets[i])});
          evaluate(eng, l, qv, qb, select(eng, l, qv, qb, ctx), ctx, by_budget[i]);
        }
        for (std::size_t i = 0; i < modes.size(); ++i) {
          const Quest qm(QuestParams{.budget = Budget::tokens(budget), .gqa = modes[i].first});
          evaluate(eng, l, qv, qm, select(eng, l, qv, qm, ctx), ctx, by_mode[i]);
        }
      }
    }
    std::printf("%5d %10.4f %10.4f %12.4f %12.3f %12.3f %12.3f\n", step, now.err / now.n, now.mass / now.n, now.bytes / now.n, t_sel * 1e3,
                t_sparse * 1e3, t_dense * 1e3);
  }

  std::printf(
      "\nLayers >= 2, mean over every other step, heads and layers. recall@64 / recall@budget: share of the pages\n"
      "holding a head's 64 / `budget` heaviest keys that its selection kept; bytes: metadata + selected K/V over dense K/V\n"
      "(the kernel loads each page once per kv head, so per-query-head rows of a group add up as their union).\n\n");
  std::printf("%-26s %10s %12s %10s %12s %12s\n", "per query head", "recall@64", "recall@budg", "mass", "output err", "bytes/dense");
  for (std::size_t i = 0; i < budgets.size(); ++i) {
    const double mean_len = 0.5 * static_cast<double>(eng.len[0] + eng.len[1]);
    const std::string label = "budget " + std::to_string(budgets[i]) + " (model " +
                              std::to_string(quest_traffic_fraction(static_cast<std::int64_t>(mean_len), kPage, budgets[i])).substr(0, 5) +
                              ")";
    by_budget[i].print(label.c_str());
  }
  std::printf("\n%-26s %10s %12s %10s %12s %12s\n", ("budget " + std::to_string(budget)).c_str(), "recall@64", "recall@budg", "mass",
              "output err", "bytes/dense");
  for (std::size_t i = 0; i < modes.size(); ++i) by_mode[i].print(modes[i].second);
  return 0;
}
