// Quest selection: the upper-bound property, selection == brute force for
// every GQA mode / layout / dtype / page size / ragged batch, FlashInfer CSR
// conventions, ties, threading, and bad input.
#include <catch2/catch.hpp>

#include <cstring>
#include <limits>
#include <string>

#include "kvpolicy/policy/selection/quest.hpp"
#include "kvpolicy/util/thread_pool.hpp"
#include "policy/selection/quest_fixture.hpp"

using namespace kvpolicy;
using namespace quest_test;
using Catch::Matchers::Contains;

TEST_CASE("page_bounds: the bound is >= every key's dot product in the page (fp32)", "[quest][bound]") {
  std::mt19937 rng(21);
  std::normal_distribution<float> nd;
  for (std::int32_t page_size : {1, 3, 16, 64}) {
    const std::int32_t pages = 40, d = 32, G = 3;
    PagedCache<float> c(pages, 1, page_size, d, PageLayout::kNHD, 1, 5u + static_cast<unsigned>(page_size));
    // Mixed scales and signs, some exact zeros in the queries.
    c.append(0, static_cast<std::int64_t>(pages) * page_size,
             [&](std::mt19937& r) { return nd(r) * (1.0f + static_cast<float>(r() % 4)); });
    MetaBuffer<float> m(pages, 1, d);
    REQUIRE(Quest{}.on_append(Context<backend::Scalar>{}, AppendInput<float>{c.view(), nullptr}, m.view()).is_ok());
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<float> q(static_cast<std::size_t>(G * d));
      for (auto& x : q) x = (rng() % 7 == 0) ? 0.0f : nd(rng) * 2.0f;
      std::vector<float> bounds(static_cast<std::size_t>(G * pages));
      const auto& sp = c.seq_pages[0];
      backend::Scalar::page_bounds(q.data(), G, d, m.cview(), sp.data(), pages, bounds.data(), pages, Workspace{});
      for (std::int32_t g = 0; g < G; ++g) {
        for (std::int32_t p = 0; p < pages; ++p) {
          double mag = 0.0, best = -INFINITY;
          for (std::int32_t s = 0; s < page_size; ++s) {
            const float* k = c.key_row(0, 0, static_cast<std::int64_t>(p) * page_size + s);
            double dot = 0.0;
            for (std::int32_t i = 0; i < d; ++i) {
              dot += static_cast<double>(q[static_cast<std::size_t>(g * d + i)]) * k[i];
              mag += std::fabs(static_cast<double>(q[static_cast<std::size_t>(g * d + i)]) * k[i]);
            }
            best = std::max(best, dot);
          }
          const double tol = 1e-6 * mag + 1e-30;
          REQUIRE(bounds[static_cast<std::size_t>(g * pages + p)] >= best - tol);
          if (page_size == 1) REQUIRE(bounds[static_cast<std::size_t>(g * pages + p)] == Approx(best).margin(tol));
        }
      }
    }
  }
}

namespace {

/// Everything one selection check needs.
template <class Tk, class Tm, class Tq>
struct Case {
  PagedCache<Tk> cache;
  MetaBuffer<Tm> meta;
  std::int32_t Hq;
  std::vector<Tq> q;  // (batch, Hq, d)

  Case(PageLayout layout, std::int32_t page_size, std::int32_t Hkv, std::int32_t G, std::int32_t d, const std::vector<std::int64_t>& lens,
       unsigned seed)
      : cache(pool_pages(lens, page_size), Hkv, page_size, d, layout, static_cast<std::int32_t>(lens.size()), seed),
        meta(pool_pages(lens, page_size), Hkv, d),
        Hq(Hkv * G) {
    std::vector<std::int32_t> append;
    for (std::size_t b = 0; b < lens.size(); ++b) {
      cache.append_normal(static_cast<std::int32_t>(b), lens[b]);
      append.push_back(static_cast<std::int32_t>(lens[b]));
    }
    REQUIRE(Quest{}.on_append(Context<backend::Scalar>{}, AppendInput<Tk>{cache.view(), append.data()}, meta.view()).is_ok());
    std::mt19937 rng(seed * 7 + 1);
    std::normal_distribution<float> nd;
    q.resize(lens.size() * static_cast<std::size_t>(Hq * d));
    for (auto& x : q) x = from_float<Tq>(nd(rng));
  }
  static std::int32_t pool_pages(const std::vector<std::int64_t>& lens, std::int32_t P) {
    std::int64_t n = 2;
    for (auto l : lens) n += (l + P - 1) / P;
    return static_cast<std::int32_t>(n);
  }
  TensorView<const Tq, 3> queries() const { return TensorView<const Tq, 3>::contiguous(q.data(), {cache.batch(), Hq, cache.head_dim}); }
  GqaMap gqa() const { return GqaMap{Hq, cache.kv_heads}; }
};

/// Brute-force rows (logical page numbers) of a selection, recomputed from the
/// keys: channel min/max, the bound with the scalar op's summation order, the
/// library's top-k order, the GQA mode's reduction.
template <class Tk, class Tm, class Tq>
std::vector<std::vector<std::int32_t>> brute_rows(const Case<Tk, Tm, Tq>& cs, const Quest& quest, int layer) {
  const auto& c = cs.cache;
  const std::int32_t P = c.page_size, d = c.head_dim, Hkv = c.kv_heads, G = cs.Hq / Hkv;
  const QuestGqa mode = quest.params().gqa;
  const PageTable table = c.table();
  std::vector<std::vector<std::int32_t>> rows;
  std::vector<float> mx, mn;
  for (std::int32_t b = 0; b < c.batch(); ++b) {
    const auto n = static_cast<std::int32_t>(c.seq_pages[static_cast<std::size_t>(b)].size());
    const std::int32_t B = quest.page_budget(table, b, P);  // per sequence for ratio budgets
    for (std::int32_t g = 0; g < Hkv; ++g) {
      std::vector<std::vector<std::int32_t>> per_head(static_cast<std::size_t>(G));
      std::vector<std::vector<float>> U(static_cast<std::size_t>(G), std::vector<float>(static_cast<std::size_t>(std::max(n - 1, 0))));
      const bool all = n <= B || quest.is_dense_layer(layer);
      if (!all) {
        for (std::int32_t p = 0; p + 1 < n; ++p) {
          brute_minmax(c, b, g, p, mx, mn);
          for (std::int32_t j = 0; j < G; ++j) {
            float acc = 0.0f;
            for (std::int32_t i = 0; i < d; ++i) {
              const float qi = to_float(cs.q[static_cast<std::size_t>((b * cs.Hq + g * G + j) * d + i)]);
              const float a = qi * mx[static_cast<std::size_t>(i)], bb = qi * mn[static_cast<std::size_t>(i)];
              acc += a > bb ? a : bb;
            }
            U[static_cast<std::size_t>(j)][static_cast<std::size_t>(p)] = acc;
          }
        }
      }
      auto finish = [&](std::vector<std::int32_t> r) {
        if (all) {
          r.resize(static_cast<std::size_t>(n));
          std::iota(r.begin(), r.end(), 0);
        } else {
          r.push_back(n - 1);
        }
        return r;
      };
      if (mode == QuestGqa::kPerQueryHead) {
        for (std::int32_t j = 0; j < G; ++j)
          rows.push_back(finish(all ? std::vector<std::int32_t>{} : brute_topk(U[static_cast<std::size_t>(j)], B - 1)));
      } else if (mode == QuestGqa::kUnion) {
        std::vector<std::int32_t> u;
        if (!all)
          for (std::int32_t j = 0; j < G; ++j) {
            auto t = brute_topk(U[static_cast<std::size_t>(j)], B - 1);
            u.insert(u.end(), t.begin(), t.end());
          }
        std::sort(u.begin(), u.end());
        u.erase(std::unique(u.begin(), u.end()), u.end());
        rows.push_back(finish(u));
      } else {
        std::vector<float> red(static_cast<std::size_t>(std::max(n - 1, 0)));
        for (std::size_t p = 0; p < red.size(); ++p) {
          float acc = U[0][p];
          for (std::int32_t j = 1; j < G; ++j) {
            const float v = U[static_cast<std::size_t>(j)][p];
            acc = mode == QuestGqa::kGroupMax ? std::max(acc, v) : acc + v;
          }
          red[p] = acc;
        }
        rows.push_back(finish(all ? std::vector<std::int32_t>{} : brute_topk(red, B - 1)));
      }
    }
  }
  return rows;
}

template <class Backend, class Tk, class Tm, class Tq>
SelectionBuffer select_pages(const Case<Tk, Tm, Tq>& cs, const Quest& quest, int layer, const ExecContext& ctx = {}) {
  const GqaMap gqa = cs.gqa();
  const PageTable table = cs.cache.table();
  const DecodeInput<Tq> in{cs.queries(), table, cs.cache.page_size, layer};
  Quest::Plan plan;
  const ProblemShape shape{.num_q_heads = cs.Hq, .num_kv_heads = cs.cache.kv_heads, .head_dim = cs.cache.head_dim};
  const Status ps = quest.plan(Context<Backend>{{}, ctx}, in, shape, plan);
  INFO(ps.message());
  REQUIRE(ps.is_ok());
  REQUIRE(plan.requirements.output.rows == cs.cache.batch() * quest.heads_per_seq(gqa));
  REQUIRE(plan.requirements.output.capacity == quest.output_capacity(layer, table, cs.cache.page_size, gqa));
  SelectionBuffer out(plan.requirements.output.rows, plan.requirements.output.capacity);
  std::vector<std::byte> ws(plan.requirements.workspace_bytes);
  const Status s = quest.select(Context<Backend>{Workspace{ws.data(), ws.size()}, ctx}, plan, in, cs.meta.cview(), out.view());
  INFO(s.message());
  REQUIRE(s.is_ok());
  return out;
}

/// The output obeys FlashInfer's CSR conventions and matches the brute force.
template <class Tk, class Tm, class Tq>
void check_against_brute(const Case<Tk, Tm, Tq>& cs, const Quest& quest, int layer, const SelectionBuffer& got) {
  const auto& c = cs.cache;
  const auto expect = brute_rows(cs, quest, layer);
  auto sel = const_cast<SelectionBuffer&>(got).view();
  REQUIRE(sel.validate("test", c.num_pages, c.page_size).is_ok());
  REQUIRE(static_cast<std::size_t>(sel.num_rows) == expect.size());
  const std::int64_t H = sel.num_rows / c.batch();
  for (std::int64_t r = 0; r < sel.num_rows; ++r) {
    const auto b = static_cast<std::int32_t>(r / H);
    const auto& pages = c.seq_pages[static_cast<std::size_t>(b)];
    INFO("row " << r << " sequence " << b << " pages " << pages.size());
    REQUIRE(got.row_logical(r) == expect[static_cast<std::size_t>(r)]);
    std::vector<std::int32_t> phys;
    for (auto lp : expect[static_cast<std::size_t>(r)]) phys.push_back(pages[static_cast<std::size_t>(lp)]);
    REQUIRE(got.row(r) == phys);
    if (pages.empty()) {
      REQUIRE(got.last[static_cast<std::size_t>(r)] == 0);
    } else {
      REQUIRE(got.row(r).back() == pages.back());  // last page last, with the sequence's fill
      REQUIRE(got.last[static_cast<std::size_t>(r)] == c.last[static_cast<std::size_t>(b)]);
      REQUIRE(sel.row_size(r) <= std::max<std::int64_t>(static_cast<std::int64_t>(pages.size()), 0));
    }
  }
}

template <class Tk, class Tm, class Tq>
void run_matrix_case(PageLayout layout, std::int32_t page_size, std::int32_t Hkv, std::int32_t G, unsigned seed) {
  // Ragged batch: empty, one partial page, <= budget, budget + 1, long with partial and full last pages.
  const std::int32_t P = page_size;
  const std::vector<std::int64_t> lens{0, std::max(1, P / 2), 3 * P, 4 * P + 1, 17 * P + std::max(1, P - 3), 25 * P};
  Case<Tk, Tm, Tq> cs(layout, page_size, Hkv, G, 16, lens, seed);
  for (QuestGqa mode : {QuestGqa::kPerQueryHead, QuestGqa::kUnion, QuestGqa::kGroupMax, QuestGqa::kGroupSum}) {
    for (std::int32_t pb : {1, 4, 9}) {
      const Quest quest(QuestParams{.budget = Budget::tokens(pb * P), .dense_layers = 2, .gqa = mode});
      for (int layer : {1, 2}) {
        INFO("mode " << static_cast<int>(mode) << " page_budget " << pb << " layer " << layer);
        check_against_brute(cs, quest, layer, select_pages<backend::Scalar>(cs, quest, layer));
      }
    }
    // Ratio budgets: a page budget per sequence, from its own length.
    for (const Budget budget : {Budget::keep_ratio(0.3), Budget::compression_ratio(0.75)}) {
      const Quest quest(QuestParams{.budget = budget, .dense_layers = 2, .gqa = mode});
      INFO("mode " << static_cast<int>(mode) << " ratio budget " << budget.value);
      check_against_brute(cs, quest, 2, select_pages<backend::Scalar>(cs, quest, 2));
    }
  }
}

}  // namespace

TEST_CASE("select == brute force: GQA modes x layouts x dtypes x page sizes x ragged batch", "[quest][select]") {
  unsigned seed = 100;
  for (PageLayout layout : {PageLayout::kNHD, PageLayout::kHND})
    for (std::int32_t P : {1, 16, 64})
      for (std::int32_t G : {1, 4, 8}) {
        INFO("layout " << static_cast<int>(layout) << " page_size " << P << " group " << G);
        const std::int32_t Hkv = G == 8 ? 1 : 2;
        run_matrix_case<float, float, float>(layout, P, Hkv, G, seed++);
        run_matrix_case<half, half, half>(layout, P, Hkv, G, seed++);
        run_matrix_case<bfloat16, bfloat16, float>(layout, P, Hkv, G, seed++);
        run_matrix_case<half, float, bfloat16>(layout, P, Hkv, G, seed++);
      }
}

TEST_CASE("select == brute force on long sequences (several bounds-phase work items per sequence)", "[quest][select]") {
  ThreadPool pool(3);
  unsigned seed = 900;
  for (std::int32_t P : {1, 16}) {
    Case<half, half, float> cs(PageLayout::kHND, P, 2, 4, 16, {700LL * P - 3, 5, 257LL * P, 513LL * P + 1}, seed++);
    for (QuestGqa mode : {QuestGqa::kPerQueryHead, QuestGqa::kUnion, QuestGqa::kGroupSum}) {
      const Quest quest(QuestParams{.page_budget = 24, .gqa = mode});
      INFO("page_size " << P << " mode " << static_cast<int>(mode));
      check_against_brute(cs, quest, 3, select_pages<backend::Scalar>(cs, quest, 3));
      check_against_brute(cs, quest, 3, select_pages<backend::Scalar>(cs, quest, 3, pool.context()));
    }
  }
}

TEST_CASE("select: budget rule, dense layers, explicit page budget", "[quest][select]") {
  const Quest q512(QuestParams{});
  REQUIRE(q512.page_budget(16) == 32);
  REQUIRE(q512.page_budget(64) == 8);
  REQUIRE(q512.page_budget(1000) == 0);
  REQUIRE(q512.is_dense_layer(1));
  REQUIRE(!q512.is_dense_layer(2));
  REQUIRE(Quest(QuestParams{.budget = Budget::tokens(100), .page_budget = 3}).page_budget(16) == 3);
  REQUIRE(Quest(QuestParams{.budget = Budget::tokens(100)}).page_budget(16) == 6);  // floor(100 / 16)
  // Ratios: max(1, floor(floor(f * T) / page_size)) pages for a sequence of T tokens.
  const Quest ratio(QuestParams{.budget = Budget::keep_ratio(0.25)});
  REQUIRE(ratio.page_budget(16, 1000) == 15);  // floor(250 / 16)
  REQUIRE(ratio.page_budget(16, 40) == 1);     // 10 tokens round to 0 pages: the last page still counts
  REQUIRE(ratio.page_budget(16, 0) == 1);
  REQUIRE(Quest(QuestParams{.budget = Budget::compression_ratio(0.5)}).page_budget(16, 1000) == 31);  // int(1000 * 0.5) / 16
  REQUIRE(Quest(QuestParams{.budget = Budget::keep_ratio(0.25), .page_budget = 3}).page_budget(16, 1000) == 3);
  REQUIRE_THAT(Quest(QuestParams{.budget = Budget::keep_ratio(1.5)}).validate_params().message(),
               Contains("quest: budget") && Contains("keep_ratio is 1.5, must be in [0, 1]"));
  const GqaMap gqa{8, 2};
  REQUIRE(q512.row_capacity(2, 100, 32, gqa) == 32);
  REQUIRE(q512.row_capacity(0, 100, 32, gqa) == 100);
  REQUIRE(q512.row_capacity(2, 20, 32, gqa) == 20);
  REQUIRE(Quest(QuestParams{.gqa = QuestGqa::kUnion}).row_capacity(2, 100, 32, gqa) == 100);
  REQUIRE(Quest(QuestParams{.gqa = QuestGqa::kUnion}).row_capacity(2, 1000, 32, gqa) == 4 * 31 + 1);
}

TEST_CASE("select: equal bounds pick the most recent pages", "[quest][select]") {
  // Every key identical: all bounds tie; the higher (more recent) page wins.
  PagedCache<float> c(32, 1, 4, 8, PageLayout::kNHD, 1, 9);
  c.append(0, 30 * 4 + 2, [](std::mt19937&) { return 0.5f; });
  MetaBuffer<float> m(32, 1, 8);
  const Quest quest(QuestParams{.page_budget = 5});
  REQUIRE(quest.on_append(Context<backend::Scalar>{}, AppendInput<float>{c.view(), nullptr}, m.view()).is_ok());
  std::vector<float> q(8, 1.0f);
  SelectionBuffer out(1, 5);
  const DecodeInput<float> in{TensorView<const float, 3>::contiguous(q.data(), {1, 1, 8}), c.table(), 4, 3};
  Quest::Plan plan;
  REQUIRE(quest.plan(Context<backend::Scalar>{}, in, ProblemShape{1, 1, 8}, plan).is_ok());
  REQUIRE(plan.requirements.output.rows == 1);
  REQUIRE(plan.requirements.output.capacity == 5);
  std::vector<std::byte> ws(plan.requirements.workspace_bytes);
  REQUIRE(quest.select(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}}, plan, in, m.cview(), out.view()).is_ok());
  REQUIRE(out.row_logical(0) == std::vector<std::int32_t>{26, 27, 28, 29, 30});
  REQUIRE(out.last[0] == 2);
}

TEST_CASE("select: results do not depend on the number of workers", "[quest][select]") {
  Case<half, half, float> cs(PageLayout::kHND, 16, 4, 4, 32, {700, 5, 1600, 0, 333}, 77);
  for (QuestGqa mode : {QuestGqa::kPerQueryHead, QuestGqa::kUnion, QuestGqa::kGroupSum}) {
    const Quest quest(QuestParams{.budget = Budget::tokens(128), .gqa = mode});
    const SelectionBuffer one = select_pages<backend::Scalar>(cs, quest, 5);
    ThreadPool pool(3);
    const SelectionBuffer many = select_pages<backend::Scalar>(cs, quest, 5, pool.context());
    REQUIRE(one.indptr == many.indptr);
    REQUIRE(one.last == many.last);
    REQUIRE(std::equal(one.indices.begin(), one.indices.begin() + one.indptr.back(), many.indices.begin()));
  }
}

TEST_CASE("PageSelection::validate enforces FlashInfer's CSR conventions", "[quest][csr]") {
  std::vector<std::int32_t> indptr{0, 2, 2, 3}, indices{4, 1, 0}, last{3, 0, 4};
  PageSelection s{indptr.data(), indices.data(), last.data(), nullptr, 3, 3};
  REQUIRE(s.validate("t", 5, 4).is_ok());
  REQUIRE(s.row_tokens(0, 4) == 7);
  REQUIRE(s.row_tokens(1, 4) == 0);
  REQUIRE(s.as_table().seq_len(2, 4) == 4);
  indices[1] = 5;
  REQUIRE_THAT(s.validate("t", 5, 4).message(), Contains("indices[1] is 5, out of range [0, 5)"));
  indices[1] = 1;
  last[1] = 1;
  REQUIRE_THAT(s.validate("t", 5, 4).message(), Contains("row 1 is empty but last_page_len is 1"));
  last[1] = 0;
  last[0] = 0;
  REQUIRE_THAT(s.validate("t", 5, 4).message(), Contains("last_page_len[0] is 0, must be in [1, page_size=4]"));
  last[0] = 5;
  REQUIRE_THAT(s.validate("t", 5, 4).message(), Contains("last_page_len[0] is 5"));
  last[0] = 3;
  indptr[2] = 1;
  REQUIRE_THAT(s.validate("t", 5, 4).message(), Contains("not monotonic at row 1"));
  indptr[2] = 2;
  indptr[0] = 1;
  REQUIRE_THAT(s.validate("t", 5, 4).message(), Contains("indptr[0] is 1"));
  indptr[0] = 0;
  std::vector<std::int32_t> logical{3, 1, 0};
  s.logical = logical.data();
  REQUIRE_THAT(s.validate("t", 5, 4).message(), Contains("not in ascending logical page order"));
}

TEST_CASE("select rejects bad input with a message naming the argument, writing nothing", "[quest][select][errors]") {
  Case<half, half, float> cs(PageLayout::kNHD, 4, 2, 2, 8, {10, 30, 7}, 5);
  const Quest quest(QuestParams{.budget = Budget::tokens(8)});
  const GqaMap gqa = cs.gqa();
  auto& c = cs.cache;
  SelectionBuffer out(3 * 4, 64);
  // Planned on the valid step: each section then breaks one input of `select`, which re-validates everything.
  const DecodeInput<float> step{cs.queries(), c.table(), 4, 2};
  const ProblemShape shape{.num_q_heads = cs.Hq, .num_kv_heads = c.kv_heads, .head_dim = c.head_dim};
  Quest::Plan plan;
  REQUIRE(quest.plan(Context<backend::Scalar>{}, step, shape, plan).is_ok());
  REQUIRE(plan.requirements.output.rows == 3 * quest.heads_per_seq(gqa));
  std::vector<std::byte> ws(plan.requirements.workspace_bytes + 4096);
  const Workspace w{ws.data(), ws.size()};
  auto expect_error = [&](const Status& s, const char* text) {
    INFO(s.message());
    REQUIRE(!s.is_ok());
    REQUIRE_THAT(s.message(), Contains(text));
    REQUIRE(out.untouched());
  };
  auto select = [&](const Quest& qq, const DecodeInput<float>& in, PageMetaView<const half> meta, PageSelection o, Workspace wsp) {
    return qq.select(Context<backend::Scalar>{wsp}, plan, in, meta, o);
  };
  auto run = [&](const Quest& qq, PageSelection o, Workspace wsp) {
    return select(qq, DecodeInput<float>{cs.queries(), c.table(), 4, 2}, cs.meta.cview(), o, wsp);
  };
  SECTION("page ids out of range") {
    c.indices[3] = c.num_pages;
    expect_error(run(quest, out.view(), w), "page table indices[3]");
  }
  SECTION("indptr not monotonic") {
    c.indptr[2] = 1;
    expect_error(run(quest, out.view(), w), "indptr is not monotonic at 1");
  }
  SECTION("last_page_len 0 or > page size") {
    c.last[1] = 0;
    expect_error(run(quest, out.view(), w), "last_page_len[1] is 0, must be in [1, page_size=4]");
    c.last[1] = 5;
    expect_error(run(quest, out.view(), w), "last_page_len[1] is 5");
  }
  SECTION("metadata view of the wrong size") {
    MetaBuffer<half> small(c.num_pages - 3, 2, 8);
    expect_error(select(quest, step, small.cview(), out.view(), w), "out of range");
    MetaBuffer<half> dim(c.num_pages, 2, 16);
    expect_error(select(quest, step, dim.cview(), out.view(), w), "queries head_dim is 8, the metadata has 16");
    MetaBuffer<half> heads(c.num_pages, 3, 8);
    expect_error(select(quest, step, heads.cview(), out.view(), w), "not a multiple of the 3 kv heads");
  }
  SECTION("budget 0") {
    expect_error(run(Quest(QuestParams{.budget = Budget::tokens(3)}), out.view(), w), "page budget is 0 (token_budget=3 / page_size=4");
    expect_error(run(Quest(QuestParams{.budget = Budget::tokens(-4)}), out.view(), w),
                 "token budget is -4, must be a non-negative integer");
    // plan() rejects the same parameters with the same message.
    Quest::Plan p0;
    expect_error(Quest(QuestParams{.budget = Budget::tokens(3)}).plan(Context<backend::Scalar>{}, step, shape, p0),
                 "page budget is 0 (token_budget=3 / page_size=4");
    expect_error(Quest(QuestParams{.budget = Budget::tokens(-4)}).plan(Context<backend::Scalar>{}, step, shape, p0),
                 "token budget is -4, must be a non-negative integer");
  }
  SECTION("outputs and workspace too small") {
    auto v = out.view();
    v.capacity = 5;
    const Status s = run(quest, v, w);
    REQUIRE(s.code() == StatusCode::kOutputTooSmall);
    expect_error(s, "capacity is 5");
    v = out.view();
    v.num_rows = 6;
    expect_error(run(quest, v, w), "page selection has 6 rows, expected 12");
    const Status sw = run(quest, out.view(), Workspace{ws.data(), 10});
    REQUIRE(sw.code() == StatusCode::kWorkspaceTooSmall);
    expect_error(sw, "workspace has 10 bytes");
  }
  SECTION("queries of the wrong batch") {
    auto qv = TensorView<const float, 3>::contiguous(cs.q.data(), {2, 4, 8});
    expect_error(select(quest, DecodeInput<float>{qv, c.table(), 4, 2}, cs.meta.cview(), out.view(), w),
                 "queries has 2 sequences, the page table has batch 3");
    Quest::Plan p2;
    expect_error(quest.plan(Context<backend::Scalar>{}, DecodeInput<float>{qv, c.table(), 4, 2}, shape, p2),
                 "queries has 2 sequences, the page table has batch 3");
  }
  SECTION("a step that does not match the plan") {
    expect_error(select(quest, DecodeInput<float>{cs.queries(), c.table(), 4, 3}, cs.meta.cview(), out.view(), w),
                 "does not match the plan");
    expect_error(select(quest, DecodeInput<float>{cs.queries(), c.table(), 8, 2}, cs.meta.cview(), out.view(), w),
                 "does not match the plan");
  }
}

TEST_CASE("select and plan reject a page listed twice in one sequence, writing nothing", "[quest][select][errors]") {
  Case<half, half, float> cs(PageLayout::kNHD, 4, 2, 2, 8, {10, 30, 7}, 5);
  const Quest quest(QuestParams{.budget = Budget::tokens(8)});
  auto& c = cs.cache;
  const ProblemShape shape{.num_q_heads = cs.Hq, .num_kv_heads = c.kv_heads, .head_dim = c.head_dim};
  Quest::Plan plan;
  REQUIRE(quest.plan(Context<backend::Scalar>{}, DecodeInput<float>{cs.queries(), c.table(), 4, 2}, shape, plan).is_ok());
  std::vector<std::byte> ws(plan.requirements.workspace_bytes);
  SelectionBuffer out(3 * 4, 64);
  const auto select = [&] {
    return quest.select(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}}, plan, DecodeInput<float>{cs.queries(), c.table(), 4, 2},
                        cs.meta.cview(), out.view());
  };
  // Sequences may share a page (a read-only consumer): sequence 0's first page is also sequence 2's.
  const std::vector<std::int32_t> valid = c.indices;
  c.indices[static_cast<std::size_t>(c.indptr[2])] = c.indices[0];
  REQUIRE(select().is_ok());
  // Sequence 1 (8 pages, scored) lists its page 1 again as page 5: it used to be selected twice.
  c.indices = valid;
  const std::int32_t s1 = c.indptr[1];
  c.indices[static_cast<std::size_t>(s1 + 5)] = c.indices[static_cast<std::size_t>(s1 + 1)];
  std::fill(out.indptr.begin(), out.indptr.end(), -7);
  std::fill(out.indices.begin(), out.indices.end(), -7);
  std::fill(out.last.begin(), out.last.end(), -7);
  std::fill(out.logical.begin(), out.logical.end(), -7);
  const Status s = select();
  INFO(s.message());
  REQUIRE(s.code() == StatusCode::kInvalidArgument);
  REQUIRE_THAT(s.message(), Contains("quest: page table sequence 1 lists page") && Contains("twice (entries 1 and 5)"));
  REQUIRE(out.untouched());
  Quest::Plan p2;
  const Status sp = quest.plan(Context<backend::Scalar>{}, DecodeInput<float>{cs.queries(), c.table(), 4, 2}, shape, p2);
  REQUIRE_THAT(sp.message(), Contains("twice (entries 1 and 5)"));
  // The last page repeated: never scored, still rejected.
  c.indices = valid;
  c.indices[static_cast<std::size_t>(c.indptr[1] - 1)] = c.indices[0];
  REQUIRE_THAT(select().message(), Contains("sequence 0 lists page") && Contains("(entries 0 and 2)"));
  REQUIRE(out.untouched());
}

TEST_CASE("the repeated-page check spans pools larger than its 65536-id window", "[quest][select][errors]") {
  // One sequence of 2 kv heads x G=2, head_dim 8, pages of 4 tokens in a pool of 70000 pages; the
  // metadata values are arbitrary (the selection is not checked, only that it runs or is rejected).
  const std::int32_t pool = 70000;
  MetaBuffer<half> meta(pool, 2, 8);
  std::vector<float> q(4 * 8, 1.0f);
  const auto queries = TensorView<const float, 3>::contiguous(q.data(), {1, 4, 8});
  std::vector<std::int32_t> indptr{0, 5}, last{4};
  const Quest quest(QuestParams{.budget = Budget::tokens(8)});
  const ProblemShape shape{.num_q_heads = 4, .num_kv_heads = 2, .head_dim = 8};
  const auto run = [&](std::vector<std::int32_t> indices) {
    const DecodeInput<float> in{queries, PageTable{indptr.data(), indices.data(), last.data(), 1}, 4, 2};
    Quest::Plan plan;
    const Status sp = quest.plan(Context<backend::Scalar>{}, in, shape, plan);
    if (!sp.is_ok()) return sp;
    std::vector<std::byte> ws(plan.requirements.workspace_bytes);
    SelectionBuffer out(4, plan.requirements.output.capacity);
    const Status s = quest.select(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}}, plan, in, meta.cview(), out.view());
    if (!s.is_ok()) REQUIRE(out.untouched());
    return s;
  };
  // Ids 65536 apart (1 and 65537) must not collide across windows; 69999 and 5 are far apart.
  REQUIRE(run({1, 65537, 69999, 5, 65536}).is_ok());
  REQUIRE_THAT(run({1, 65537, 69999, 5, 69999}).message(), Contains("lists page 69999 twice (entries 2 and 4)"));
  REQUIRE_THAT(run({65537, 3, 69999, 65537, 0}).message(), Contains("lists page 65537 twice (entries 0 and 3)"));
  REQUIRE_THAT(run({0, 3, 69999, 3, 65536}).message(), Contains("lists page 3 twice (entries 1 and 3)"));
}

TEST_CASE("select rejects page metadata with zero strides or empty extents, writing nothing", "[quest][select][errors]") {
  Case<half, half, float> cs(PageLayout::kNHD, 4, 2, 2, 8, {10, 30, 7}, 5);
  const Quest quest(QuestParams{.budget = Budget::tokens(8)});
  auto& c = cs.cache;
  const DecodeInput<float> step{cs.queries(), c.table(), 4, 2};
  const ProblemShape shape{.num_q_heads = cs.Hq, .num_kv_heads = c.kv_heads, .head_dim = c.head_dim};
  Quest::Plan plan;
  REQUIRE(quest.plan(Context<backend::Scalar>{}, step, shape, plan).is_ok());
  std::vector<std::byte> ws(plan.requirements.workspace_bytes);
  SelectionBuffer out(3 * 4, 64);
  const auto select = [&](PageMetaView<const half> m) {
    return quest.select(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}}, plan, step, m, out.view());
  };
  const auto expect_error = [&](PageMetaView<const half> m, const char* text) {
    const Status s = select(m);
    INFO(s.message());
    REQUIRE(s.code() == StatusCode::kInvalidArgument);
    REQUIRE_THAT(s.message(), Contains(text));
    REQUIRE(out.untouched());
  };
  PageMetaView<const half> m = cs.meta.cview();
  m.page_stride = 0;  // every page would read page 0's bounds
  expect_error(m, "quest: metadata page_stride is 0");
  m = cs.meta.cview();
  m.head_stride = 0;
  expect_error(m, "quest: metadata head_stride is 0 with 2 kv heads");
  m = cs.meta.cview();
  m.head_dim = 0;
  expect_error(m, "quest: metadata head_dim is 0");
  m = cs.meta.cview();
  m.num_kv_heads = 0;
  expect_error(m, "quest: metadata num_kv_heads is 0");
  m = cs.meta.cview();
  m.num_pages = -1;
  expect_error(m, "quest: metadata num_pages is -1");
}

TEST_CASE("a page budget above the page count sizes the workspace by the pages, not the budget", "[quest][select]") {
  // Found by fuzz_prefetch: page_budget = INT32_MAX asked for ~10 GB of top-k scratch on a 64-page sequence.
  const ProblemShape shape{8, 2, 64, 1024, 0, 1};
  const Requirements all =
      Quest(QuestParams{.page_budget = INT32_MAX, .dense_layers = 0}).requirements(Context<backend::Scalar>{}, shape, 16);
  const Requirements every = Quest(QuestParams{.page_budget = 64, .dense_layers = 0}).requirements(Context<backend::Scalar>{}, shape, 16);
  REQUIRE(all.status.is_ok());
  REQUIRE(all.workspace_bytes == every.workspace_bytes);
  REQUIRE(all.output.capacity == every.output.capacity);
}
