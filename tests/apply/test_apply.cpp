#include <catch2/catch.hpp>

#include <cstddef>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "kvpolicy/apply/compact.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "policy/policy_test_util.hpp"

using namespace kvpolicy;
using Catch::Matchers::Contains;

namespace {
KeepSetBuffer random_keep(std::int64_t rows, std::int64_t len, std::vector<std::int64_t> counts, unsigned seed) {
  std::int64_t total = 0;
  for (auto c : counts) total += c;
  KeepSetBuffer k(rows, std::max<std::int64_t>(total, 1));
  std::mt19937 rng(seed);
  std::int64_t pos = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    std::vector<std::int32_t> all(len);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    std::sort(all.begin(), all.begin() + counts[r]);
    std::copy(all.begin(), all.begin() + counts[r], k.indices.begin() + pos);
    pos += counts[r];
    k.indptr[r + 1] = static_cast<std::int32_t>(pos);
  }
  return k;
}
}  // namespace

TEMPLATE_TEST_CASE("compact_contiguous: kept rows bit-identical, positions carried, per-head lengths", "[apply]", float, half, bfloat16) {
  const std::int64_t H = 3, cap = 40, T = 33, d = 5;
  for (bool token_major : {false, true}) {
    std::vector<TestType> k(H * cap * d), v(H * cap * d);
    for (std::size_t i = 0; i < k.size(); ++i) {
      if constexpr (std::is_same_v<TestType, float>) {
        k[i] = static_cast<float>(i) * 0.5f;
        v[i] = -static_cast<float>(i);
      } else {
        k[i] = TestType::from_bits(static_cast<std::uint16_t>(i * 7 + 1));
        v[i] = TestType::from_bits(static_cast<std::uint16_t>(i * 13 + 5));
      }
    }
    const auto k0 = k, v0 = v;
    auto view = [&](std::vector<TestType>& buf) {
      return token_major ? TensorView<TestType, 3>(buf.data(), {H, cap, d}, {d, H * d, 1})
                         : TensorView<TestType, 3>::contiguous(buf.data(), {H, cap, d});
    };
    auto kv = view(k), vv = view(v);
    const auto k0v = TensorView<const TestType, 3>(k0.data(), kv.extents(), kv.strides());
    const auto v0v = TensorView<const TestType, 3>(v0.data(), vv.extents(), vv.strides());
    std::vector<std::int32_t> pos(H * cap);
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t t = 0; t < cap; ++t) pos[h * cap + t] = static_cast<std::int32_t>(1000 + t);
    auto keep = random_keep(H, T, {10, 33, 0}, 3);
    std::vector<std::int64_t> lens(H);
    REQUIRE(compact_contiguous<TestType>(kv, vv, TensorView<std::int32_t, 2>::contiguous(pos.data(), {H, cap}), T, keep.view(), 0, lens)
                .is_ok());
    REQUIRE(lens == std::vector<std::int64_t>{10, 33, 0});
    for (std::int64_t h = 0; h < H; ++h) {
      const auto row = keep.row(h);
      for (std::size_t r = 0; r < row.size(); ++r) {
        REQUIRE(pos[h * cap + r] == 1000 + row[r]);
        for (std::int64_t c = 0; c < d; ++c) {
          REQUIRE(std::memcmp(&kv(h, static_cast<std::int64_t>(r), c), &k0v(h, row[r], c), sizeof(TestType)) == 0);
          REQUIRE(std::memcmp(&vv(h, static_cast<std::int64_t>(r), c), &v0v(h, row[r], c), sizeof(TestType)) == 0);
        }
      }
    }
  }
}

TEST_CASE("compact_contiguous: bad keep sets are rejected and nothing is modified", "[apply][errors]") {
  const std::int64_t H = 2, cap = 10, d = 4;
  std::vector<float> k(H * cap * d), v(H * cap * d);
  std::iota(k.begin(), k.end(), 0.0f);
  std::iota(v.begin(), v.end(), 100.0f);
  const auto k0 = k, v0 = v;
  auto kv = TensorView<float, 3>::contiguous(k.data(), {H, cap, d}), vv = TensorView<float, 3>::contiguous(v.data(), {H, cap, d});
  std::vector<std::int64_t> lens(H, -1);
  auto check = [&](KeepSetBuffer keep, std::int64_t len, const char* needle) {
    const Status s = compact_contiguous<float>(kv, vv, {}, len, keep.view(), 0, lens);
    INFO(s.message());
    REQUIRE_THAT(s.message(), Contains(needle));
    REQUIRE(k == k0);
    REQUIRE(v == v0);
    REQUIRE(lens == std::vector<std::int64_t>(H, -1));
  };
  KeepSetBuffer ok(2, 4);
  ok.indices = {1, 2, 0, 9};
  ok.indptr = {0, 2, 4};
  check(ok, 9, "holds token 9, out of range [0, 9)");  // last head is out of range: first head must not move either
  KeepSetBuffer unsorted(2, 4);
  unsorted.indices = {2, 1, 0, 3};
  unsorted.indptr = {0, 2, 4};
  check(unsorted, 10, "not strictly ascending");
  check(ok, 11, "kv_len 11 out of range [0, capacity=10]");
  KeepSetBuffer one_row(1, 1);
  check(one_row, 10, "keep set rows [row0=0, row0+2) out of range [0, num_rows=1)");
}

TEST_CASE("compact_paged: pages freed as the budget implies, tokens and positions moved", "[apply][paged]") {
  const std::int32_t H = 2, ps = 4, d = 3, pool_pages = 12;
  for (PageLayout layout : {PageLayout::kNHD, PageLayout::kHND}) {
    const PageStrides st = PageStrides::contiguous(layout, H, ps, d);
    std::vector<half> k(pool_pages * st.page), v(pool_pages * st.page);
    for (std::size_t i = 0; i < k.size(); ++i)
      k[i] = half::from_bits(static_cast<std::uint16_t>(i)), v[i] = half::from_bits(static_cast<std::uint16_t>(i + 30000));
    const auto k0 = k, v0 = v;
    // seq 0: 11 tokens on pages {7, 2, 9}; seq 1: 5 tokens on pages {0, 5}; seq 2: 4 tokens on page {11}
    std::vector<std::int32_t> indptr{0, 3, 5, 6}, indices{7, 2, 9, 0, 5, 11}, last{3, 1, 4};
    PagedKVView<half> cache{k.data(), v.data(), st, st, pool_pages, H, ps, d, PageTable{indptr.data(), indices.data(), last.data(), 3},
                            kHost};
    REQUIRE(cache.validate("t").is_ok());
    std::vector<std::int32_t> positions(pool_pages * H * ps);
    for (std::int32_t b = 0; b < 3; ++b)
      for (std::int64_t t = 0; t < cache.seq_len(b); ++t)
        for (std::int32_t h = 0; h < H; ++h)
          positions[(cache.table.page_of(b, t, ps) * H + h) * ps + t % ps] = static_cast<std::int32_t>(100 * b + t);
    auto keep = random_keep(6, 11, {5, 5, 2, 2, 4, 4}, 4);
    for (int r = 2; r < 4; ++r)
      keep.indices[keep.indptr[r]] = std::min(keep.indices[keep.indptr[r]], 0), keep.indices[keep.indptr[r] + 1] = 4;
    for (int r = 4; r < 6; ++r) std::iota(keep.indices.begin() + keep.indptr[r], keep.indices.begin() + keep.indptr[r + 1], 0);
    const PagedKVView<half> before = cache;
    std::vector<std::int32_t> out_indptr(4), out_indices(6), out_last(3), freed(6);
    PagedCompactOutput out{out_indptr.data(), out_indices.data(), out_last.data(), 6, freed.data(), 6, 0};
    std::vector<std::byte> ws(compact_paged_workspace(pool_pages));
    // reference copy of the kept tokens
    std::vector<std::vector<std::uint16_t>> expect_k;
    for (std::int32_t b = 0; b < 3; ++b)
      for (std::int32_t h = 0; h < H; ++h)
        for (auto t : keep.row(b * H + h)) {
          std::vector<std::uint16_t> row;
          for (int c = 0; c < d; ++c) row.push_back(before.key(b, h, t)[c].bits);
          expect_k.push_back(row);
        }
    REQUIRE(compact_paged<half>(cache, keep.view(), TensorView<std::int32_t, 3>::contiguous(positions.data(), {pool_pages, H, ps}), out,
                                Workspace{ws.data(), ws.size()})
                .is_ok());
    REQUIRE(out_indptr == std::vector<std::int32_t>{0, 2, 3, 4});
    REQUIRE(out_indices == std::vector<std::int32_t>{7, 2, 0, 11, 0, 0});
    REQUIRE(out_last == std::vector<std::int32_t>{1, 2, 4});
    REQUIRE(out.num_freed == 2);
    REQUIRE(std::set<std::int32_t>(freed.begin(), freed.begin() + 2) == std::set<std::int32_t>{9, 5});
    PagedKVView<half> after = cache;
    after.table = PageTable{out_indptr.data(), out_indices.data(), out_last.data(), 3};
    REQUIRE(after.validate("after").is_ok());
    std::size_t e = 0;
    for (std::int32_t b = 0; b < 3; ++b)
      for (std::int32_t h = 0; h < H; ++h) {
        const auto row = keep.row(b * H + h);
        for (std::size_t r = 0; r < row.size(); ++r, ++e) {
          for (int c = 0; c < d; ++c) REQUIRE(after.key(b, h, static_cast<std::int64_t>(r))[c].bits == expect_k[e][c]);
          const std::int32_t p = after.table.page_of(b, static_cast<std::int64_t>(r), ps);
          REQUIRE(positions[(p * H + h) * ps + r % ps] == 100 * b + row[r]);
        }
      }
    (void)k0;
    (void)v0;
  }
}

TEST_CASE("compact_paged: unequal per-head counts and small outputs are rejected untouched", "[apply][paged][errors]") {
  const std::int32_t H = 2, ps = 4, d = 2;
  const PageStrides st = PageStrides::contiguous(PageLayout::kNHD, H, ps, d);
  std::vector<float> k(4 * st.page), v(4 * st.page);
  std::iota(k.begin(), k.end(), 0.0f);
  const auto k0 = k;
  std::vector<std::int32_t> indptr{0, 2}, indices{3, 1}, last{2};
  PagedKVView<float> cache{k.data(), v.data(), st, st, 4, H, ps, d, PageTable{indptr.data(), indices.data(), last.data(), 1}, kHost};
  KeepSetBuffer keep(2, 5);
  keep.indptr = {0, 2, 5};
  keep.indices = {1, 5, 0, 1, 2};
  std::vector<std::int32_t> oi(2, -1), oidx(2, -1), ol(1, -1), fr(2, -1);
  PagedCompactOutput out{oi.data(), oidx.data(), ol.data(), 2, fr.data(), 2, 0};
  std::vector<std::byte> ws(compact_paged_workspace(4));
  const Workspace w{ws.data(), ws.size()};
  REQUIRE_THAT(compact_paged<float>(cache, keep.view(), {}, out, w).message(), Contains("shared page list needs equal counts"));
  keep.indptr = {0, 2, 4};
  keep.indices = {1, 5, 0, 5};
  out.freed_capacity = 0;
  REQUIRE_THAT(compact_paged<float>(cache, keep.view(), {}, out, w).message(), Contains("freed_pages capacity 0 < 1"));
  out.freed_capacity = 2;
  keep.indices = {1, 6, 0, 6};
  REQUIRE_THAT(compact_paged<float>(cache, keep.view(), {}, out, w).message(), Contains("out of range [0, 6)"));
  REQUIRE(k == k0);
  REQUIRE(oi == std::vector<std::int32_t>(2, -1));
  REQUIRE(indices == std::vector<std::int32_t>{3, 1});
}

TEST_CASE("compact_contiguous: null keep-set indices and row0 near INT64_MAX are rejected untouched", "[apply][errors]") {
  const std::int64_t H = 2, cap = 8, d = 2;
  std::vector<float> k(H * cap * d), v(H * cap * d);
  std::iota(k.begin(), k.end(), 0.0f);
  std::iota(v.begin(), v.end(), 50.0f);
  const auto k0 = k, v0 = v;
  auto kv = TensorView<float, 3>::contiguous(k.data(), {H, cap, d}), vv = TensorView<float, 3>::contiguous(v.data(), {H, cap, d});
  std::vector<std::int64_t> lens(H, -1);
  std::vector<std::int32_t> indptr{0, 2, 4};
  auto check = [&](const KeepSet& keep, std::int64_t row0, const char* needle) {
    const Status s = compact_contiguous<float>(kv, vv, {}, cap, keep, row0, lens);
    INFO(s.message());
    REQUIRE(s.code() == StatusCode::kInvalidArgument);
    REQUIRE_THAT(s.message(), Contains(needle));
    REQUIRE(k == k0);
    REQUIRE(v == v0);
    REQUIRE(lens == std::vector<std::int64_t>(H, -1));
  };
  check(KeepSet{indptr.data(), nullptr, 2, 4}, 0, "keep set indices is null but row 0 lists 2 tokens");
  check(KeepSet{nullptr, nullptr, 2, 4}, 0, "keep set indptr is null");
  std::vector<std::int32_t> ids{0, 1, 0, 1};
  const KeepSet keep{indptr.data(), ids.data(), 2, 4};
  const std::int64_t max = std::numeric_limits<std::int64_t>::max();
  for (const std::int64_t row0 : {max, max - 1, std::int64_t{-1}, std::numeric_limits<std::int64_t>::min()}) {
    INFO("row0 = " << row0);
    check(keep, row0, "out of range [0, num_rows=2)");
  }
  // A null indices pointer is fine when no row lists a token.
  std::vector<std::int32_t> empty_ptr{0, 0, 0};
  REQUIRE(compact_contiguous<float>(kv, vv, {}, cap, KeepSet{empty_ptr.data(), nullptr, 2, 0}, 0, lens).is_ok());
  REQUIRE(lens == std::vector<std::int64_t>{0, 0});
}

namespace {

/// A two-sequence paged cache (H = 2, page_size 4) and a compact_paged call whose rejections must leave everything as it was.
struct PagedErrorCase {
  static constexpr std::int32_t H = 2, ps = 4, d = 2, pool = 8;
  PageStrides st = PageStrides::contiguous(PageLayout::kNHD, H, ps, d);
  std::vector<float> k = std::vector<float>(pool * st.page), v = k;
  // seq 0: 6 tokens on pages {5, 1}; seq 1: 7 tokens on pages {2, 6}
  std::vector<std::int32_t> indptr{0, 2, 4}, indices{5, 1, 2, 6}, last{2, 3};
  std::vector<std::int32_t> positions = std::vector<std::int32_t>(pool * H * ps, 0);
  KeepSetBuffer keep{4, 4};
  std::vector<std::int32_t> oi = std::vector<std::int32_t>(3, -1), oidx = std::vector<std::int32_t>(4, -1),
                            ol = std::vector<std::int32_t>(2, -1), fr = std::vector<std::int32_t>(4, -1);
  PagedCompactOutput out{oi.data(), oidx.data(), ol.data(), 4, fr.data(), 4, 0};
  std::vector<std::byte> ws = std::vector<std::byte>(compact_paged_workspace(pool));

  PagedErrorCase() {
    std::iota(k.begin(), k.end(), 0.0f);
    std::iota(v.begin(), v.end(), 1000.0f);
    std::iota(positions.begin(), positions.end(), 0);
    keep.indptr = {0, 1, 2, 3, 4};
    keep.indices = {5, 5, 6, 6};  // one token per head: every sequence moves a token and frees a page
  }
  PagedKVView<float> cache() {
    return PagedKVView<float>{k.data(), v.data(), st, st, pool, H, ps, d, PageTable{indptr.data(), indices.data(), last.data(), 2}, kHost};
  }
  void expect_rejected(PagedKVView<float> c, const char* needle) {
    const auto k0 = k, v0 = v;
    const auto pos0 = positions, ptr0 = indptr, idx0 = indices, last0 = last;
    const Status s = compact_paged<float>(c, keep.view(), TensorView<std::int32_t, 3>::contiguous(positions.data(), {pool, H, ps}), out,
                                          Workspace{ws.data(), ws.size()});
    INFO(s.message());
    REQUIRE(s.code() == StatusCode::kInvalidArgument);
    REQUIRE_THAT(s.message(), Contains(needle));
    REQUIRE(k == k0);
    REQUIRE(v == v0);
    REQUIRE(positions == pos0);
    REQUIRE((indptr == ptr0 && indices == idx0 && last == last0));
    REQUIRE(oi == std::vector<std::int32_t>(3, -1));
    REQUIRE(oidx == std::vector<std::int32_t>(4, -1));
    REQUIRE(ol == std::vector<std::int32_t>(2, -1));
    REQUIRE(fr == std::vector<std::int32_t>(4, -1));
    REQUIRE(out.num_freed == 0);
  }
};

}  // namespace

TEST_CASE("compact_paged: page ids repeated in a sequence or shared between sequences are rejected, nothing written",
          "[apply][paged][errors]") {
  {
    PagedErrorCase c;
    c.indices = {5, 5, 2, 6};  // sequence 0 lists page 5 twice: it would be "freed" while the new table keeps it
    c.expect_rejected(c.cache(), "page 5 appears twice in the page table (entry 0 of sequence 0 and entry 1 of sequence 0)");
  }
  {
    PagedErrorCase c;
    c.indices = {5, 1, 1, 6};  // page 1 shared: sequence 1's moves would overwrite sequence 0's tokens
    c.expect_rejected(c.cache(), "page 1 appears twice in the page table (entry 1 of sequence 0 and entry 0 of sequence 1)");
  }
  {
    PagedErrorCase c;  // the bitmap workspace is required
    c.ws.resize(8);
    const Status s = compact_paged<float>(c.cache(), c.keep.view(), {}, c.out, Workspace{c.ws.data(), c.ws.size()});
    REQUIRE(s.code() == StatusCode::kWorkspaceTooSmall);
  }
  {
    PagedErrorCase c;  // and the distinct table compacts
    REQUIRE(compact_paged<float>(c.cache(), c.keep.view(), {}, c.out, Workspace{c.ws.data(), c.ws.size()}).is_ok());
    REQUIRE(c.out.num_freed == 2);
    REQUIRE(c.oidx[0] == 5);
    REQUIRE(c.oidx[1] == 2);
  }
}

TEST_CASE("compact_paged: the caller's page table and keep set are validated before use, nothing written", "[apply][paged][errors]") {
  {
    PagedErrorCase c;
    auto v = c.cache();
    v.table.indptr = nullptr;
    c.expect_rejected(v, "page table indptr is null");
  }
  {
    PagedErrorCase c;
    c.indptr = {0, 3, 2};
    c.expect_rejected(c.cache(), "page table indptr is not monotonic at 1 (3 > 2)");
  }
  {
    PagedErrorCase c;
    c.indptr = {1, 2, 4};
    c.expect_rejected(c.cache(), "page table indptr[0] is 1, must be 0");
  }
  for (const std::int32_t bad : {0, 5, -1}) {
    PagedErrorCase c;
    c.last[1] = bad;
    c.expect_rejected(c.cache(), "last_page_len[1] is");
  }
  for (const std::int32_t bad : {8, -1}) {
    PagedErrorCase c;
    c.indices[3] = bad;
    c.expect_rejected(c.cache(), "out of range [0, 8)");
  }
  {
    PagedErrorCase c;
    auto v = c.cache();
    v.table.last_page_len = nullptr;
    c.expect_rejected(v, "page table last_page_len is null");
  }
  {
    PagedErrorCase c;
    auto v = c.cache();
    v.num_pages = -3;
    c.expect_rejected(v, "num_pages is -3, must be >= 0");
  }
  {
    PagedErrorCase c;  // keep set with null indices
    auto v = c.cache();
    const KeepSet null_ids{c.keep.indptr.data(), nullptr, 4, 4};
    const Status s = compact_paged<float>(v, null_ids, {}, c.out, Workspace{c.ws.data(), c.ws.size()});
    REQUIRE_THAT(s.message(), Contains("keep set indices is null but row 0 lists 1 tokens"));
    REQUIRE(c.oi == std::vector<std::int32_t>(3, -1));
    const KeepSet null_ptr{nullptr, c.keep.indices.data(), 4, 4};
    REQUIRE_THAT(compact_paged<float>(v, null_ptr, {}, c.out, Workspace{c.ws.data(), c.ws.size()}).message(),
                 Contains("keep set indptr is null"));
  }
}

TEST_CASE("compact_contiguous with head_dim 0 and null data moves positions only", "[apply]") {
  // Found by tests/fuzz/fuzz_compact: the row move formed a reference to element 0 of a null
  // (head_dim 0) view, undefined behaviour that UBSan reports.
  std::vector<std::int32_t> pos{10, 11, 12, 13, 20, 21, 22, 23};
  const TensorView<float, 3> keys(nullptr, {2, 4, 0}, {0, 0, 1});
  KeepSetBuffer keep(2, 3);
  keep.indptr = {0, 2, 3};
  keep.indices = {1, 3, 2};
  std::vector<std::int64_t> lens(2, -1);
  const Status s = compact_contiguous<float>(keys, {}, TensorView<std::int32_t, 2>::contiguous(pos.data(), {2, 4}), 4, keep.view(), 0,
                                             std::span<std::int64_t>(lens));
  INFO(s.message());
  REQUIRE(s.is_ok());
  REQUIRE(lens == std::vector<std::int64_t>{2, 1});
  REQUIRE(pos[0] == 11);
  REQUIRE(pos[1] == 13);
  REQUIRE(pos[4] == 22);
}
