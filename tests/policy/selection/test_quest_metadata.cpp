// Quest page metadata: the fold op, incremental maintenance (`on_append` with
// append lengths) vs rebuild (`on_append` without) vs brute force, every
// layout / dtype pair / page size, and bad input.
#include <catch2/catch.hpp>

#include <cstring>
#include <limits>

#include "kvpolicy/policy/selection/quest.hpp"
#include "kvpolicy/util/thread_pool.hpp"
#include "policy/selection/quest_fixture.hpp"

using namespace kvpolicy;
using namespace quest_test;
using Catch::Matchers::Contains;

TEST_CASE("page_meta_fold: exact channel max/min, fresh restarts, resume extends, NaN ignored", "[quest][meta]") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // 3 rows of 4 channels, row stride 5 (padding).
  const std::vector<float> rows{1, -2, 3, nan, 0, /**/ 4, -5, -6, 7, 0, /**/ -1, 8, 2, 1, 0};
  std::vector<float> mx(4, 99.0f), mn(4, -99.0f);
  backend::Scalar::page_meta_fold(rows.data(), 5, 3, 4, mx.data(), mn.data(), /*fresh=*/true);
  REQUIRE(mx == std::vector<float>{4, 8, 3, 7});
  REQUIRE(mn == std::vector<float>{-1, -5, -6, 1});
  // Resume with one more row: extends, keeps the rest.
  const std::vector<float> more{10, -10, 0, 0};
  backend::Scalar::page_meta_fold(more.data(), 4, 1, 4, mx.data(), mn.data(), /*fresh=*/false);
  REQUIRE(mx == std::vector<float>{10, 8, 3, 7});
  REQUIRE(mn == std::vector<float>{-1, -10, -6, 0});
  // Fresh with zero rows: the empty state.
  backend::Scalar::page_meta_fold(more.data(), 4, 0, 4, mx.data(), mn.data(), /*fresh=*/true);
  REQUIRE(mx[0] == -INFINITY);
  REQUIRE(mn[0] == INFINITY);

  // fp16 keys into fp16 metadata: bit-exact values, ±inf sentinels representable.
  const std::vector<half> hk{to_half(65504.0f), to_half(-65504.0f), to_half(1e-7f), to_half(-0.0f)};
  std::vector<half> hx(2), hn(2);
  backend::Scalar::page_meta_fold(hk.data(), 2, 2, 2, hx.data(), hn.data(), true);
  REQUIRE(hx[0].bits == to_half(65504.0f).bits);
  REQUIRE(hn[0].bits == to_half(1e-7f).bits);
  REQUIRE(hx[1].bits == to_half(-0.0f).bits);
  REQUIRE(page_meta_empty_max<half>().bits == 0xfc00);
  REQUIRE(page_meta_empty_min<half>().bits == 0x7c00);
  REQUIRE(to_float(page_meta_empty_min<bfloat16>()) == INFINITY);
}

namespace {

/// `Quest::on_append` on the scalar backend: `append_len` tokens appended per
/// sequence, or (nullptr) every page of the table rebuilt.
template <class Tk, class Tm>
Status append_meta(const PagedKVView<const Tk>& keys, PageMetaView<Tm> meta, const std::int32_t* append_len, const ExecContext& ctx = {}) {
  return Quest{}.on_append(Context<backend::Scalar>{{}, ctx}, AppendInput<Tk>{keys, append_len}, meta);
}

/// Metadata rows of every page in the table: incremental == rebuilt == brute force.
template <class Tk, class Tm>
void check_meta(const PagedCache<Tk>& c, const MetaBuffer<Tm>& inc, const MetaBuffer<Tm>& rebuilt) {
  std::vector<float> mx, mn;
  for (std::int32_t b = 0; b < c.batch(); ++b) {
    const auto& pages = c.seq_pages[static_cast<std::size_t>(b)];
    for (std::size_t lp = 0; lp < pages.size(); ++lp) {
      for (std::int32_t h = 0; h < c.kv_heads; ++h) {
        brute_minmax(c, b, h, static_cast<std::int32_t>(lp), mx, mn);
        const Tm* ix = inc.cview().max_row(pages[lp], h);
        const Tm* in = inc.cview().min_row(pages[lp], h);
        const Tm* rx = rebuilt.cview().max_row(pages[lp], h);
        const Tm* rn = rebuilt.cview().min_row(pages[lp], h);
        REQUIRE(std::memcmp(ix, rx, sizeof(Tm) * static_cast<std::size_t>(c.head_dim)) == 0);
        REQUIRE(std::memcmp(in, rn, sizeof(Tm) * static_cast<std::size_t>(c.head_dim)) == 0);
        for (std::int32_t i = 0; i < c.head_dim; ++i) {
          REQUIRE(to_float(ix[i]) == mx[static_cast<std::size_t>(i)]);
          REQUIRE(to_float(in[i]) == mn[static_cast<std::size_t>(i)]);
        }
      }
    }
  }
}

template <class Tk, class Tm>
void run_incremental(PageLayout layout, std::int32_t page_size, std::int32_t kv_heads, std::int32_t head_dim, unsigned seed,
                     const ExecContext& ctx) {
  const std::int32_t batch = 3, pool = 3 * (40 * 16 / page_size + 4);
  PagedCache<Tk> c(pool, kv_heads, page_size, head_dim, layout, batch, seed);
  MetaBuffer<Tm> inc(pool, kv_heads, head_dim);
  std::mt19937 rng(seed + 1);
  // Chunk sizes that start, fill, straddle and resume pages.
  const std::vector<std::int64_t> chunks{1, 1, page_size - 1, page_size, page_size + 1, 2 * page_size + 3, 5, 1, 3 * page_size - 1};
  std::vector<std::int32_t> append(static_cast<std::size_t>(batch));
  for (int step = 0; step < 12; ++step) {
    std::fill(append.begin(), append.end(), 0);
    for (std::int32_t b = 0; b < batch; ++b) {
      if ((rng() % 3) == 0 && step > 0) continue;  // some sequences skip a step
      const std::int64_t n = chunks[rng() % chunks.size()];
      if ((c.seq_len[static_cast<std::size_t>(b)] + n + page_size - 1) / page_size + 2 > pool / batch) continue;
      c.append_normal(b, n);
      append[static_cast<std::size_t>(b)] = static_cast<std::int32_t>(n);
    }
    REQUIRE(append_meta(c.view(), inc.view(), append.data(), ctx).is_ok());
    MetaBuffer<Tm> rebuilt(pool, kv_heads, head_dim);
    REQUIRE(append_meta(c.view(), rebuilt.view(), nullptr, ctx).is_ok());
    check_meta(c, inc, rebuilt);
  }
}

template <class Tk, class Tm>
void run_all_shapes(const ExecContext& ctx) {
  unsigned seed = 11;
  for (PageLayout layout : {PageLayout::kNHD, PageLayout::kHND})
    for (std::int32_t page_size : {1, 16, 64})
      for (std::int32_t kv_heads : {1, 2}) {
        INFO("layout " << (layout == PageLayout::kNHD ? "NHD" : "HND") << " page_size " << page_size << " kv_heads " << kv_heads);
        run_incremental<Tk, Tm>(layout, page_size, kv_heads, 24, seed++, ctx);
      }
}

}  // namespace

TEST_CASE("on_append after any sequence of appends equals a rebuild and brute force", "[quest][meta]") {
  const ExecContext seq{};
  SECTION("fp32 keys, fp32 metadata") { run_all_shapes<float, float>(seq); }
  SECTION("fp16 keys, fp16 metadata") { run_all_shapes<half, half>(seq); }
  SECTION("fp16 keys, fp32 metadata") { run_all_shapes<half, float>(seq); }
  SECTION("bf16 keys, bf16 metadata") { run_all_shapes<bfloat16, bfloat16>(seq); }
  SECTION("bf16 keys, fp32 metadata") { run_all_shapes<bfloat16, float>(seq); }
  SECTION("thread pool") {
    ThreadPool pool(3);
    run_all_shapes<half, half>(pool.context());
  }
}

TEST_CASE("on_append: a page restarted at slot 0 forgets stale metadata", "[quest][meta]") {
  PagedCache<float> c(4, 1, 4, 8, PageLayout::kNHD, 1, 3);
  MetaBuffer<float> m(4, 1, 8);  // poisoned with 12345: a resumed fold would keep it
  c.append_normal(0, 6);
  const std::int32_t n6 = 6;
  REQUIRE(append_meta(c.view(), m.view(), &n6).is_ok());
  const std::int32_t p0 = c.seq_pages[0][0];
  for (int i = 0; i < 8; ++i) REQUIRE(m.cview().max_row(p0, 0)[i] < 100.0f);
}

TEST_CASE("metadata entry points reject bad input with a message and write nothing", "[quest][meta][errors]") {
  PagedCache<half> c(8, 2, 4, 8, PageLayout::kHND, 2, 5);
  c.append_normal(0, 9);
  c.append_normal(1, 4);
  MetaBuffer<half> m(8, 2, 8);
  const std::vector<half> before = m.data;
  std::vector<std::int32_t> append{9, 4};
  auto view = c.view();
  auto expect_error = [&](const Status& s, const char* text) {
    REQUIRE(!s.is_ok());
    REQUIRE_THAT(s.message(), Contains(text));
    REQUIRE(std::memcmp(m.data.data(), before.data(), before.size() * sizeof(half)) == 0);
  };
  SECTION("metadata view of the wrong size") {
    MetaBuffer<half> small(7, 2, 8);
    expect_error(append_meta(view, small.view(), append.data()), "metadata has 7 pages, the page pool has 8");
    MetaBuffer<half> heads(8, 1, 8);
    expect_error(append_meta(view, heads.view(), nullptr), "metadata has 1 kv heads");
    MetaBuffer<half> dim(8, 2, 16);
    expect_error(append_meta(view, dim.view(), nullptr), "metadata head_dim is 16");
  }
  SECTION("append_len beyond the sequence") {
    append[1] = 5;
    expect_error(append_meta(view, m.view(), append.data()), "append_len[1] is 5");
    append[1] = -1;
    expect_error(append_meta(view, m.view(), append.data()), "append_len[1] is -1");
  }
  SECTION("append_len null rebuilds every page of the table (no longer an error)") {
    // Formerly "append_len is null"; a null append_len now means rebuild (on_append's AppendInput contract).
    REQUIRE(append_meta(view, m.view(), nullptr).is_ok());
    std::vector<float> mx, mn;
    for (std::int32_t b = 0; b < c.batch(); ++b)
      for (std::size_t lp = 0; lp < c.seq_pages[static_cast<std::size_t>(b)].size(); ++lp)
        for (std::int32_t h = 0; h < c.kv_heads; ++h) {
          brute_minmax(c, b, h, static_cast<std::int32_t>(lp), mx, mn);
          const std::int32_t page = c.seq_pages[static_cast<std::size_t>(b)][lp];
          for (std::int32_t i = 0; i < c.head_dim; ++i) {
            REQUIRE(to_float(m.cview().max_row(page, h)[i]) == mx[static_cast<std::size_t>(i)]);
            REQUIRE(to_float(m.cview().min_row(page, h)[i]) == mn[static_cast<std::size_t>(i)]);
          }
        }
  }
  SECTION("page ids out of range") {
    c.indices[1] = 8;
    expect_error(append_meta(c.view(), m.view(), append.data()), "indices[1] is 8, out of range [0, 8)");
  }
  SECTION("indptr not monotonic") {
    c.indptr[1] = 4;
    c.indptr[2] = 3;
    expect_error(append_meta(c.view(), m.view(), nullptr), "indptr is not monotonic");
  }
  SECTION("last_page_len 0 or above the page size") {
    c.last[0] = 0;
    expect_error(append_meta(c.view(), m.view(), nullptr), "last_page_len[0] is 0, must be in [1, page_size=4]");
    c.last[0] = 5;
    expect_error(append_meta(c.view(), m.view(), nullptr), "last_page_len[0] is 5");
  }
}
