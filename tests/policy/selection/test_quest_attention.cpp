// Paged decode attention reference and the page-selection quality metrics.
#include <catch2/catch.hpp>

#include <cstring>
#include <limits>

#include "kvpolicy/eval/page_metrics.hpp"
#include "kvpolicy/policy/selection/quest.hpp"
#include "kvpolicy/util/thread_pool.hpp"
#include "policy/selection/quest_fixture.hpp"

using namespace kvpolicy;
using namespace quest_test;
using Catch::Matchers::Contains;

namespace {

/// Double-precision attention of one query over logical tokens `toks` of (b, h).
template <class T>
void ref_attention(const PagedCache<T>& c, std::int32_t b, std::int32_t h, const float* q, const std::vector<std::int64_t>& toks,
                   float scale, std::vector<double>& out, double& lse) {
  const std::int32_t d = c.head_dim;
  std::vector<double> s;
  double mx = -INFINITY;
  for (auto t : toks) {
    const T* k = c.key_row(b, h, t);
    double acc = 0.0;
    for (std::int32_t i = 0; i < d; ++i) acc += static_cast<double>(q[i]) * to_float(k[i]);
    s.push_back(acc * scale);
    mx = std::max(mx, s.back());
  }
  out.assign(static_cast<std::size_t>(d), 0.0);
  double den = 0.0;
  for (std::size_t j = 0; j < toks.size(); ++j) {
    const double p = std::exp(s[j] - mx);
    den += p;
    const auto& sp = c.seq_pages[static_cast<std::size_t>(b)];
    const std::int64_t t = toks[j];
    const T* v = c.v.data() + sp[static_cast<std::size_t>(t / c.page_size)] * c.strides.page + h * c.strides.head +
                 (t % c.page_size) * c.strides.slot;
    for (std::int32_t i = 0; i < d; ++i) out[static_cast<std::size_t>(i)] += p * to_float(v[i]);
  }
  for (auto& x : out) x /= den;
  lse = mx + std::log(den);
}

template <class T>
void check_op(PageLayout layout, std::int32_t P, std::int32_t G, unsigned seed) {
  const std::int32_t d = 32, Hkv = 2;
  const std::int64_t len = 9 * static_cast<std::int64_t>(P) + std::max(1, P / 3);
  PagedCache<T> c(static_cast<std::int32_t>(len / P + 2), Hkv, P, d, layout, 1, seed);
  c.append_normal(0, len, 1.5f);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> q(static_cast<std::size_t>(G * d));
  for (auto& x : q) x = nd(rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const auto& sp = c.seq_pages[0];
  // A selection: pages 1, 4, 5 and the (partial) last page.
  const std::vector<std::int32_t> sel_logical{1, 4, 5, static_cast<std::int32_t>(sp.size()) - 1};
  std::vector<std::int32_t> sel_pages;
  std::vector<std::int64_t> toks;
  for (auto lp : sel_logical) {
    sel_pages.push_back(sp[static_cast<std::size_t>(lp)]);
    for (std::int32_t s = 0; s < P; ++s)
      if (static_cast<std::int64_t>(lp) * P + s < len) toks.push_back(static_cast<std::int64_t>(lp) * P + s);
  }
  std::vector<std::byte> ws(backend::Scalar::paged_attention_workspace(G, P, d));
  for (std::int32_t h = 0; h < Hkv; ++h) {
    const Rows<T> keys{c.k.data() + h * c.strides.head, c.strides.slot, sel_pages.data(), c.strides.page, P};
    const Rows<T> vals{c.v.data() + h * c.strides.head, c.strides.slot, sel_pages.data(), c.strides.page, P};
    std::vector<float> out(static_cast<std::size_t>(G * d)), lse(static_cast<std::size_t>(G));
    backend::Scalar::paged_decode_attention(q.data(), G, d, keys, vals, static_cast<std::int64_t>(toks.size()), scale, out.data(),
                                            lse.data(), Workspace{ws.data(), ws.size()});
    for (std::int32_t g = 0; g < G; ++g) {
      std::vector<double> ro;
      double rl = 0.0;
      ref_attention(c, 0, h, q.data() + g * d, toks, scale, ro, rl);
      REQUIRE(lse[static_cast<std::size_t>(g)] == Approx(rl).epsilon(1e-5).margin(1e-5));
      for (std::int32_t i = 0; i < d; ++i)
        REQUIRE(out[static_cast<std::size_t>(g * d + i)] == Approx(ro[static_cast<std::size_t>(i)]).margin(2e-5));
    }
  }
}

}  // namespace

TEST_CASE("paged_decode_attention matches a double-precision softmax over the selected pages", "[quest][attention]") {
  unsigned seed = 1;
  for (PageLayout layout : {PageLayout::kNHD, PageLayout::kHND})
    for (std::int32_t P : {1, 16, 64})
      for (std::int32_t G : {1, 4}) {
        check_op<float>(layout, P, G, seed++);
        check_op<half>(layout, P, G, seed++);
        check_op<bfloat16>(layout, P, G, seed++);
      }
}

TEST_CASE("paged_decode_attention: no tokens gives zeros and lse -inf - -inf logits are skipped", "[quest][attention]") {
  std::vector<float> k(8, 0.0f), v(8, 1.0f), q(4, 1.0f), out(4, 7.0f);
  float lse = 0.0f;
  std::vector<std::byte> ws(backend::Scalar::paged_attention_workspace(1, 64, 4));
  const Rows<float> rows{k.data(), 4, nullptr, 0, 0};
  const Rows<float> vrows{v.data(), 4, nullptr, 0, 0};
  backend::Scalar::paged_decode_attention(q.data(), 1, 4, rows, vrows, 0, 1.0f, out.data(), &lse, Workspace{ws.data(), ws.size()});
  REQUIRE(out == std::vector<float>(4, 0.0f));
  REQUIRE(lse == -INFINITY);
  backend::Scalar::paged_decode_attention(q.data(), 1, 4, rows, vrows, 2, 1.0f, out.data(), &lse, Workspace{ws.data(), ws.size()});
  REQUIRE(out == std::vector<float>(4, 1.0f));
  REQUIRE(lse == Approx(std::log(2.0)));
}

namespace {

/// A decode workload with structure: each (sequence, kv head) has a few
/// "needle" tokens aligned with that head's queries, on top of noise.
struct Workload {
  PagedCache<half> cache;
  MetaBuffer<half> meta;
  std::int32_t Hq;
  std::vector<float> q;

  Workload(std::int32_t P, std::int32_t Hkv, std::int32_t G, std::int32_t d, const std::vector<std::int64_t>& lens, unsigned seed)
      : cache(pages_for(lens, P), Hkv, P, d, PageLayout::kNHD, static_cast<std::int32_t>(lens.size()), seed),
        meta(pages_for(lens, P), Hkv, d),
        Hq(Hkv * G) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    q.resize(lens.size() * static_cast<std::size_t>(Hq * d));
    for (auto& x : q) x = nd(rng);
    std::vector<std::int32_t> append;
    for (std::size_t b = 0; b < lens.size(); ++b) {
      cache.append_normal(static_cast<std::int32_t>(b), lens[b], 0.7f);
      append.push_back(static_cast<std::int32_t>(lens[b]));
      // Needles: 8 clusters of 8 consecutive tokens per kv head pushed towards
      // the group's mean query (attention concentrates, as in real models).
      const std::int64_t clusters = std::min<std::int64_t>(8, lens[b] / 8);
      std::uniform_int_distribution<std::int64_t> pick(0, std::max<std::int64_t>(lens[b] / 8 - 1, 0));
      for (std::int32_t g = 0; g < Hkv; ++g)
        for (std::int64_t n = 0; n < clusters; ++n) {
          const std::int64_t t0 = pick(rng) * 8;
          for (std::int64_t t = t0; t < t0 + 8; ++t) {
            half* k = const_cast<half*>(cache.key_row(static_cast<std::int32_t>(b), g, t));
            for (std::int32_t i = 0; i < d; ++i) {
              float m = 0.0f;
              for (std::int32_t j = 0; j < G; ++j) m += q[(b * Hq + g * G + j) * d + i];
              k[i] = to_half(to_float(k[i]) + 3.0f * m / static_cast<float>(G));
            }
          }
        }
    }
    REQUIRE(Quest{}.on_append(Context<backend::Scalar>{}, AppendInput<half>{cache.view(), append.data()}, meta.view()).is_ok());
  }
  static std::int32_t pages_for(const std::vector<std::int64_t>& lens, std::int32_t P) {
    std::int64_t n = 1;
    for (auto l : lens) n += (l + P - 1) / P;
    return static_cast<std::int32_t>(n);
  }
  TensorView<const float, 3> queries() const {
    return TensorView<const float, 3>::contiguous(q.data(), {cache.batch(), Hq, cache.head_dim});
  }

  /// Quest's selection of `layer` for this decode step: plan, then select into a buffer sized by the plan.
  SelectionBuffer select(const Quest& quest, std::int32_t layer) const {
    const DecodeInput<float> in{queries(), cache.table(), cache.page_size, layer};
    Quest::Plan plan;
    const ProblemShape shape{.num_q_heads = Hq, .num_kv_heads = cache.kv_heads, .head_dim = cache.head_dim};
    REQUIRE(quest.plan(Context<backend::Scalar>{}, in, shape, plan).is_ok());
    const GqaMap gqa{Hq, cache.kv_heads};
    REQUIRE(plan.requirements.output.rows == cache.batch() * quest.heads_per_seq(gqa));
    REQUIRE(plan.requirements.output.capacity == quest.output_capacity(layer, cache.table(), cache.page_size, gqa));
    SelectionBuffer sel(plan.requirements.output.rows, plan.requirements.output.capacity);
    std::vector<std::byte> ws(plan.requirements.workspace_bytes);
    const Status s = quest.select(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}}, plan, in, meta.cview(), sel.view());
    INFO(s.message());
    REQUIRE(s.is_ok());
    return sel;
  }
};

PageQuality quality(const Workload& w, const Quest& quest, std::int64_t oracle_tokens, SelectionBuffer* keep = nullptr,
                    std::vector<float>* per_head = nullptr) {
  SelectionBuffer sel = w.select(quest, 2);
  PageQuality pq;
  std::vector<float> ph(static_cast<std::size_t>(w.cache.batch() * w.Hq * 4));
  const Status s =
      page_quality(w.cache.view(), w.queries(), sel.view(), oracle_tokens, 1.0f / std::sqrt(static_cast<float>(w.cache.head_dim)), &pq,
                   TensorView<float, 3>::contiguous(ph.data(), {w.cache.batch(), w.Hq, 4}));
  INFO(s.message());
  REQUIRE(s.is_ok());
  if (keep) *keep = sel;
  if (per_head) *per_head = ph;
  return pq;
}

}  // namespace

TEST_CASE("page_quality: all pages selected is perfect - metrics match brute-force definitions", "[quest][metrics]") {
  Workload w(16, 2, 4, 32, {1000, 37, 600}, 3);
  const float scale = 1.0f / std::sqrt(32.0f);
  SECTION("dense selection") {
    const PageQuality pq = quality(w, Quest(QuestParams{.budget = Budget::tokens(1 << 20)}), 64);
    REQUIRE(pq.heads == 3 * 8);
    REQUIRE(pq.page_recall == 1.0);
    REQUIRE(pq.mass_recall == Approx(1.0).epsilon(1e-6));
    REQUIRE(pq.output_rel_error == 0.0);  // same op, same rows: bit-identical
    REQUIRE(pq.attended_fraction == 1.0);
  }
  SECTION("sparse selection, per head, against double-precision brute force") {
    SelectionBuffer sel(1, 1);
    std::vector<float> ph;
    const Quest quest(QuestParams{.budget = Budget::tokens(128)});
    const PageQuality pq = quality(w, quest, 96, &sel, &ph);
    REQUIRE(pq.page_recall > 0.0);
    REQUIRE(pq.page_recall <= 1.0);
    REQUIRE(pq.output_rel_error > 0.0);
    const auto& c = w.cache;
    for (std::int32_t b = 0; b < c.batch(); ++b)
      for (std::int32_t h = 0; h < w.Hq; ++h) {
        const std::int32_t g = h / 4;
        const std::int64_t len = c.seq_len[static_cast<std::size_t>(b)];
        std::vector<double> logit;
        for (std::int64_t t = 0; t < len; ++t) {
          double acc = 0.0;
          const half* k = c.key_row(b, g, t);
          for (int i = 0; i < 32; ++i) acc += static_cast<double>(w.q[static_cast<std::size_t>((b * w.Hq + h) * 32 + i)]) * to_float(k[i]);
          logit.push_back(acc * scale);
        }
        const double mx = *std::max_element(logit.begin(), logit.end());
        double den = 0.0;
        for (auto x : logit) den += std::exp(x - mx);
        // Mass on the row's tokens.
        const auto lp = sel.row_logical(b * w.Hq + h);
        double mass = 0.0;
        for (auto p : lp)
          for (std::int64_t t = static_cast<std::int64_t>(p) * 16; t < std::min<std::int64_t>(len, (p + 1) * 16); ++t)
            mass += std::exp(logit[static_cast<std::size_t>(t)] - mx) / den;
        const float* m = &ph[static_cast<std::size_t>((b * w.Hq + h) * 4)];
        REQUIRE(m[1] == Approx(mass).epsilon(1e-4));
        // Oracle pages: pages of the top-96 tokens (double logits; ties are measure-zero here).
        std::vector<std::int32_t> order(static_cast<std::size_t>(len));
        std::iota(order.begin(), order.end(), 0);
        std::sort(order.begin(), order.end(),
                  [&](auto x, auto y) { return logit[static_cast<std::size_t>(x)] > logit[static_cast<std::size_t>(y)]; });
        std::vector<std::int32_t> oracle;
        for (std::int64_t i = 0; i < std::min<std::int64_t>(96, len); ++i) oracle.push_back(order[static_cast<std::size_t>(i)] / 16);
        std::sort(oracle.begin(), oracle.end());
        oracle.erase(std::unique(oracle.begin(), oracle.end()), oracle.end());
        std::int64_t hit = 0;
        for (auto p : oracle) hit += std::count(lp.begin(), lp.end(), p);
        REQUIRE(m[0] == Approx(static_cast<double>(hit) / static_cast<double>(oracle.size())));
        const double frac = static_cast<double>(sel.view().row_tokens(b * w.Hq + h, 16)) / static_cast<double>(len);
        REQUIRE(m[3] == Approx(frac));
      }
  }
}

TEST_CASE("quality improves with the token budget (64 / 256 / 1024 / 4096)", "[quest][metrics]") {
  Workload w(16, 2, 4, 64, {8192, 6000}, 17);
  double prev_mass = 0.0, prev_err = INFINITY;
  for (std::int32_t budget : {64, 256, 1024, 4096}) {
    for (QuestGqa mode : {QuestGqa::kPerQueryHead, QuestGqa::kUnion, QuestGqa::kGroupMax, QuestGqa::kGroupSum}) {
      // Oracle: the pages of the 64 heaviest keys (the needles).
      const PageQuality pq = quality(w, Quest(QuestParams{.budget = Budget::tokens(budget), .gqa = mode}), 64);
      INFO("budget " << budget << " mode " << static_cast<int>(mode) << " recall " << pq.page_recall << " mass " << pq.mass_recall
                     << " err " << pq.output_rel_error);
      REQUIRE(pq.mass_recall > 0.0);
      REQUIRE(pq.mass_recall <= 1.0 + 1e-6);
      if (mode == QuestGqa::kPerQueryHead) {
        CHECK(pq.mass_recall >= prev_mass);
        CHECK(pq.output_rel_error <= prev_err);
        prev_mass = pq.mass_recall;
        prev_err = pq.output_rel_error;
        if (budget >= 256) CHECK(pq.page_recall > 0.8);  // the needles are found
      }
    }
  }
}

TEST_CASE("selection_bytes: union of the group's pages, metadata of scored pages - traffic model", "[quest][metrics]") {
  // One sequence of 10 pages (last holds 3 of 4 tokens), G = 2, one kv head.
  std::vector<std::int32_t> tindptr{0, 10}, tindices{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, tlast{3};
  const PageTable table{tindptr.data(), tindices.data(), tlast.data(), 1};
  std::vector<std::int32_t> indptr{0, 3, 6}, indices{1, 2, 9, 2, 5, 9}, last{3, 3};
  const PageSelection sel{indptr.data(), indices.data(), last.data(), nullptr, 2, 6};
  StepBytes sb;
  REQUIRE(selection_bytes(table, 4, sel, 2, 1, 8, 2, 2, 3, &sb).is_ok());
  const double row = 2.0 * 8 * 2;  // K + V, 8 dims, fp16
  REQUIRE(sb.dense_kv == row * 39);
  REQUIRE(sb.kv == row * (3 * 4 + 3));      // pages {1, 2, 5} full + the last page's 3 tokens
  REQUIRE(sb.metadata == 2.0 * 8 * 2 * 9);  // 9 scored pages, max + min rows
  REQUIRE(sb.fraction() == Approx((sb.kv + sb.metadata) / sb.dense_kv));
  REQUIRE(quest_traffic_fraction(65536, 16, 4096) == Approx(1.0 / 16 + 1.0 / 16));
  REQUIRE(quest_traffic_fraction(1000, 16, 4096) == 1.0);
  REQUIRE(relative_l2_error(std::vector<float>{1, 2}.data(), std::vector<float>{1, 2}.data(), 2) == 0.0);
  REQUIRE(attention_mass(-1.0f, -1.0f) == 1.0);
}

TEST_CASE("selection_attention == dense_attention when every page is selected - bad rows are rejected", "[quest][attention]") {
  Workload w(8, 2, 2, 16, {100, 3, 64}, 8);
  const std::int32_t Hq = w.Hq, d = 16;
  const auto& c = w.cache;
  const Quest all(QuestParams{.budget = Budget::tokens(1 << 20)});
  SelectionBuffer sel = w.select(all, 2);
  REQUIRE(sel.last.size() == static_cast<std::size_t>(3 * Hq));
  ThreadPool pool(2);
  const ExecContext ctx = pool.context();
  std::vector<std::byte> ws(attend_pages_workspace(2, 8, d, ctx));
  std::vector<float> o1(3 * Hq * d), o2(o1.size()), l1(3 * Hq), l2(l1.size());
  auto O = [&](std::vector<float>& v) { return TensorView<float, 3>::contiguous(v.data(), {3, Hq, d}); };
  auto L = [&](std::vector<float>& v) { return TensorView<float, 2>::contiguous(v.data(), {3, Hq}); };
  REQUIRE(dense_attention(c.view(), w.queries(), 0.25f, O(o1), L(l1), Workspace{ws.data(), ws.size()}, ctx).is_ok());
  REQUIRE(selection_attention(c.view(), w.queries(), sel.view(), 0.25f, O(o2), L(l2), Workspace{ws.data(), ws.size()}, ctx).is_ok());
  REQUIRE(o1 == o2);
  REQUIRE(l1 == l2);
  sel.indices[2] = c.num_pages + 4;
  const Status s = selection_attention(c.view(), w.queries(), sel.view(), 0.25f, O(o2), L(l2), Workspace{ws.data(), ws.size()}, ctx);
  REQUIRE_THAT(s.message(), Contains("page selection indices[2]"));
  std::vector<float> bad(2 * Hq * d);
  const Status s2 = dense_attention(c.view(), w.queries(), 0.25f, TensorView<float, 3>::contiguous(bad.data(), {2, Hq, d}), L(l1),
                                    Workspace{ws.data(), ws.size()}, ctx);
  REQUIRE_THAT(s2.message(), Contains("out has shape (2, 4, 16), expected (3, 4, 16)"));
}
