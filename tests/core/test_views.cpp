#include <catch2/catch.hpp>

#include <atomic>
#include <numeric>
#include <string>
#include <vector>

#include "kvpolicy/core/any_tensor_view.hpp"
#include "kvpolicy/core/dispatch.hpp"
#include "kvpolicy/core/gqa.hpp"
#include "kvpolicy/core/rows.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/parallel.hpp"
#include "kvpolicy/core/workspace.hpp"
#include "kvpolicy/util/thread_pool.hpp"

using namespace kvpolicy;
using Catch::Matchers::Contains;

TEST_CASE("TensorView: strided indexing, slicing, const conversion", "[views]") {
  std::vector<float> buf(2 * 3 * 4);
  std::iota(buf.begin(), buf.end(), 0.0f);
  auto v = TensorView<float, 3>::contiguous(buf.data(), {2, 3, 4});
  REQUIRE(v.is_contiguous());
  REQUIRE(v(1, 2, 3) == 23.0f);
  REQUIRE(v[1](0, 1) == 13.0f);
  TensorView<const float, 3> c = v;  // mutable -> const is implicit
  REQUIRE(c(0, 1, 2) == 6.0f);
  STATIC_REQUIRE(!std::is_convertible_v<TensorView<const float, 3>, TensorView<float, 3>>);
  STATIC_REQUIRE(std::is_same_v<decltype(c(0, 0, 0)), const float&>);
  // Transposed (seq, heads) <-> (heads, seq) view without copying.
  TensorView<float, 3> t(buf.data(), {3, 2, 4}, {4, 12, 1});
  REQUIRE(!t.is_contiguous());
  REQUIRE(t(2, 1, 3) == v(1, 2, 3));
  auto n = v.narrow(2, 1, 2);
  REQUIRE(n.extent(2) == 2);
  REQUIRE(n(0, 0, 0) == 1.0f);
  TensorView<float, 2> bad(nullptr, {3, 4}, {4, 1});
  const Status s = bad.check_basic("op", "keys");
  REQUIRE(!s.is_ok());
  REQUIRE_THAT(s.message(), Contains("keys") && Contains("null"));
  REQUIRE(TensorView<float, 2>(nullptr, {0, 4}, {4, 1}).check_basic("op", "keys").is_ok());
}

TEST_CASE("AnyTensorView: round trip and checked recovery", "[views]") {
  std::vector<half> buf(12);
  auto v = TensorView<const half, 2>::contiguous(buf.data(), {3, 4});
  const AnyTensorView a = AnyTensorView::from(v);
  REQUIRE(a.dtype == DType::kF16);
  REQUIRE(a.read_only);
  TensorView<const half, 2> back;
  REQUIRE(a.as(&back, "keys").is_ok());
  REQUIRE(back.extent(1) == 4);
  TensorView<const float, 2> wrong_type;
  Status s = a.as(&wrong_type, "keys");
  REQUIRE_THAT(s.message(), Contains("keys has dtype float16, expected float32"));
  TensorView<const half, 3> wrong_rank;
  REQUIRE_THAT(a.as(&wrong_rank, "keys").message(), Contains("rank 2, expected 3"));
  TensorView<half, 2> mut;
  REQUIRE_THAT(a.as(&mut, "keys").message(), Contains("read-only"));
}

TEST_CASE("GqaMap: divisibility is checked with a clear message", "[views]") {
  GqaMap m;
  REQUIRE(GqaMap::make(32, 8, "snapkv", &m).is_ok());
  REQUIRE(m.group_size() == 4);
  REQUIRE(m.kv_head(13) == 3);
  const Status s = GqaMap::make(12, 8, "snapkv", &m);
  REQUIRE(s.code() == StatusCode::kInvalidArgument);
  REQUIRE(std::string(s.message()) == "snapkv: queries has 12 heads, not a multiple of the 8 kv heads");
}

TEST_CASE("PagedKVView: NHD/HND addressing and page-table validation", "[views][paged]") {
  const int pages = 4, heads = 2, ps = 3, d = 2;
  std::vector<float> pool(pages * heads * ps * d);
  std::iota(pool.begin(), pool.end(), 0.0f);
  std::vector<std::int32_t> indptr{0, 2, 3}, indices{3, 1, 0}, last{2, 3};
  for (PageLayout layout : {PageLayout::kNHD, PageLayout::kHND}) {
    PagedKVView<float> p;
    p.k_data = p.v_data = pool.data();
    p.k_strides = p.v_strides = PageStrides::contiguous(layout, heads, ps, d);
    p.num_pages = pages;
    p.num_kv_heads = heads;
    p.page_size = ps;
    p.head_dim = d;
    p.table = PageTable{indptr.data(), indices.data(), last.data(), 2};
    REQUIRE(p.validate("test").is_ok());
    REQUIRE(p.seq_len(0) == 5);
    REQUIRE(p.seq_len(1) == 3);
    // token 4 of seq 0 = page indices[1] = 1, slot 1
    const float* k = p.key(0, 1, 4);
    const std::int64_t expect =
        layout == PageLayout::kNHD ? (1 * ps * heads * d + 1 * heads * d + 1 * d) : (1 * heads * ps * d + 1 * ps * d + 1 * d);
    REQUIRE(k - pool.data() == expect);
    const Rows<float> rows = Rows<float>::paged_keys(PagedKVView<const float>(p), 0, 1);
    REQUIRE(rows.row(4) == k);
  }
  PagedKVView<float> p;
  p.k_data = p.v_data = pool.data();
  p.k_strides = p.v_strides = PageStrides::contiguous(PageLayout::kNHD, heads, ps, d);
  p.num_pages = pages;
  p.num_kv_heads = heads;
  p.page_size = ps;
  p.head_dim = d;
  std::vector<std::int32_t> bad_idx{3, 4, 0};
  p.table = PageTable{indptr.data(), bad_idx.data(), last.data(), 2};
  REQUIRE_THAT(p.validate("apply").message(), Contains("indices[1] is 4, out of range [0, 4)"));
  std::vector<std::int32_t> zero_last{0, 3};
  p.table = PageTable{indptr.data(), indices.data(), zero_last.data(), 2};
  REQUIRE_THAT(p.validate("apply").message(), Contains("last_page_len[0] is 0"));
  std::vector<std::int32_t> big_last{2, 4};
  p.table = PageTable{indptr.data(), indices.data(), big_last.data(), 2};
  REQUIRE_THAT(p.validate("apply").message(), Contains("last_page_len[1] is 4, must be in [1, page_size=3]"));
  std::vector<std::int32_t> nonmono{0, 2, 1};
  p.table = PageTable{nonmono.data(), indices.data(), last.data(), 2};
  REQUIRE_THAT(p.validate("apply").message(), Contains("not monotonic"));
}

TEST_CASE("Workspace: plan and carver agree - size check names the constraint", "[views]") {
  WorkspacePlan plan;
  plan.add<float>(10).add<std::int32_t>(3);
  std::vector<std::byte> mem(plan.total());
  for (std::size_t shift : {0, 1, 7, 63}) {
    std::vector<std::byte> m2(plan.total() + shift);
    Workspace ws{m2.data() + shift, plan.total()};
    WorkspaceCarver c(ws);
    REQUIRE(c.take<float>(10) != nullptr);
    REQUIRE(c.take<std::int32_t>(3) != nullptr);
    REQUIRE(c.take<float>(100) == nullptr);
  }
  const Status s = check_workspace("snapkv", Workspace{mem.data(), 10}, plan.total());
  REQUIRE(s.code() == StatusCode::kWorkspaceTooSmall);
  REQUIRE_THAT(s.message(), Contains("workspace has 10 bytes"));
}

TEST_CASE("ExecContext: sequential default and ThreadPool cover every item once", "[parallel]") {
  for (int threads : {1, 2, 4}) {
    ThreadPool pool(threads);
    ExecContext ctx = pool.context();
    std::vector<std::atomic<int>> hits(1000);
    std::vector<std::atomic<int>> busy(ctx.workers());
    std::atomic<bool> overlap{false}, bad_worker{false};
    ctx.parallel_for(1000, [&](std::int64_t i, int w) {  // no Catch assertion here: Catch is not thread-safe
      if (w < 0 || w >= ctx.workers()) {
        bad_worker = true;
        return;
      }
      if (busy[w].fetch_add(1) != 0) overlap = true;
      hits[i].fetch_add(1);
      busy[w].fetch_sub(1);
    });
    REQUIRE_FALSE(bad_worker.load());
    for (auto& h : hits) REQUIRE(h.load() == 1);
    REQUIRE_FALSE(overlap.load());
  }
}

TEST_CASE("dispatch: dtype and integer dispatch fail loudly outside the set", "[dispatch]") {
  int seen = 0;
  REQUIRE(dispatch_dtype(DType::kBF16, "keys", [&](auto tag) {
            seen = sizeof(typename decltype(tag)::type);
            return Status::ok();
          }).is_ok());
  REQUIRE(seen == 2);
  REQUIRE_THAT(dispatch_dtype(DType::kI32, "keys", [](auto) { return Status::ok(); }).message(), Contains("keys has dtype int32"));
  int got = 0;
  REQUIRE(dispatch_int<64, 128>(128, "head_dim", [&](auto c) {
            got = c.value;
            return Status::ok();
          }).is_ok());
  REQUIRE(got == 128);
  const Status bad = dispatch_int<64, 128>(96, "head_dim", [](auto) { return Status::ok(); });
  REQUIRE_THAT(bad.message(), Contains("head_dim is 96"));
}
