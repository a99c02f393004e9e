#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "kvpolicy/apply/compact_ragged.hpp"
#include "policy/policy_test_util.hpp"

using namespace kvpolicy;
using Catch::Matchers::Contains;

namespace {

/// Rows of `counts[r]` ascending ids drawn from [0, lens[r]).
KeepSetBuffer ragged_keep(const std::vector<std::int64_t>& lens, const std::vector<std::int64_t>& counts, unsigned seed) {
  const auto rows = static_cast<std::int64_t>(counts.size());
  KeepSetBuffer k(rows, std::max<std::int64_t>(std::accumulate(counts.begin(), counts.end(), std::int64_t{0}), 1));
  std::mt19937 rng(seed);
  std::int64_t pos = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    std::vector<std::int32_t> all(static_cast<std::size_t>(lens[r]));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    std::sort(all.begin(), all.begin() + counts[r]);
    std::copy(all.begin(), all.begin() + counts[r], k.indices.begin() + pos);
    pos += counts[r];
    k.indptr[r + 1] = static_cast<std::int32_t>(pos);
  }
  return k;
}

std::uint16_t bits(half h) { return h.bits; }

}  // namespace

TEST_CASE("ragged contiguous: per-head budgets compacted twice, kept rows bit-identical at their logical positions", "[apply][ragged]") {
  const std::int64_t H = 4, cap = 64, T = 57, d = 6;
  std::vector<half> k(H * cap * d), v(H * cap * d);
  for (std::size_t i = 0; i < k.size(); ++i)
    k[i] = half::from_bits(static_cast<std::uint16_t>(i * 5 + 3)), v[i] = half::from_bits(static_cast<std::uint16_t>(i * 11 + 1));
  const auto k0 = k, v0 = v;
  std::vector<std::int32_t> pos(H * cap);
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t t = 0; t < cap; ++t) pos[h * cap + t] = static_cast<std::int32_t>(500 + t);
  auto kv = TensorView<half, 3>::contiguous(k.data(), {H, cap, d}), vv = TensorView<half, 3>::contiguous(v.data(), {H, cap, d});
  auto pv = TensorView<std::int32_t, 2>::contiguous(pos.data(), {H, cap});
  // First compaction (uniform input length, ragged budgets as Ada-KV would give): apply/compact.hpp.
  auto keep1 = ragged_keep({T, T, T, T}, {40, 3, 57, 0}, 1);
  std::vector<std::int64_t> lens(H);
  REQUIRE(compact_contiguous<half>(kv, vv, pv, T, keep1.view(), 0, lens).is_ok());
  REQUIRE(lens == std::vector<std::int64_t>{40, 3, 57, 0});
  // Second compaction of the now-ragged cache: each head checked against its own length.
  auto keep2 = ragged_keep({40, 3, 57, 0}, {17, 3, 1, 0}, 2);
  std::vector<std::int64_t> lens2(H, -1);
  REQUIRE(compact_contiguous_per_head<half>(kv, vv, pv, lens, keep2.view(), 0, lens2).is_ok());
  REQUIRE(lens2 == std::vector<std::int64_t>{17, 3, 1, 0});
  for (std::int64_t h = 0; h < H; ++h) {
    const auto r1 = keep1.row(h), r2 = keep2.row(h);
    for (std::size_t r = 0; r < r2.size(); ++r) {
      const std::int64_t src = r1[static_cast<std::size_t>(r2[r])];  // original slot
      REQUIRE(pos[h * cap + static_cast<std::int64_t>(r)] == 500 + src);
      for (std::int64_t c = 0; c < d; ++c) {
        REQUIRE(bits(k[(h * cap + static_cast<std::int64_t>(r)) * d + c]) == bits(k0[(h * cap + src) * d + c]));
        REQUIRE(bits(v[(h * cap + static_cast<std::int64_t>(r)) * d + c]) == bits(v0[(h * cap + src) * d + c]));
      }
    }
  }
}

TEST_CASE("ragged contiguous: per-head budget above its length and bad views are rejected, nothing modified", "[apply][ragged][errors]") {
  const std::int64_t H = 3, cap = 12, d = 2;
  std::vector<float> k(H * cap * d), v(H * cap * d);
  std::iota(k.begin(), k.end(), 0.0f);
  std::iota(v.begin(), v.end(), 1000.0f);
  const auto k0 = k, v0 = v;
  auto kv = TensorView<float, 3>::contiguous(k.data(), {H, cap, d}), vv = TensorView<float, 3>::contiguous(v.data(), {H, cap, d});
  std::vector<std::int64_t> lens{10, 4, 12}, out(H, -1);
  auto check = [&](KeepSetBuffer keep, std::vector<std::int64_t> head_lens, const char* needle) {
    const Status s = compact_contiguous_per_head<float>(kv, vv, {}, head_lens, keep.view(), 0, out);
    INFO(s.message());
    REQUIRE_THAT(s.message(), Contains(needle));
    REQUIRE(k == k0);
    REQUIRE(v == v0);
    REQUIRE(out == std::vector<std::int64_t>(H, -1));
  };
  check(ragged_keep({10, 10, 12}, {2, 5, 3}, 1), lens, "kv head 1 keeps 5 tokens but holds only 4");  // earlier heads untouched too
  KeepSetBuffer oob(3, 3);
  oob.indptr = {0, 1, 2, 3};
  oob.indices = {0, 4, 0};
  check(oob, lens, "keep set row 1 holds token 4, out of range [0, 4)");
  check(ragged_keep({10, 4, 12}, {1, 1, 1}, 1), {10, 4, 13}, "head_lens[2] = 13 out of range [0, capacity=12]");
  check(ragged_keep({10, 4, 12}, {1, 1, 1}, 1), {10, 4}, "head_lens has 2 entries, expected kv_heads=3");
}

namespace {

/// A per-head paged cache: one page-table row per (sequence, kv head), pages of one head each.
struct PerHeadPool {
  std::int32_t ps, d, num_pages;
  std::vector<half> k, v;
  std::vector<std::int32_t> indptr{0}, indices, last, positions;
  PerHeadPool(std::int32_t page_size, std::int32_t dim, std::int32_t pages)
      : ps(page_size),
        d(dim),
        num_pages(pages),
        k(static_cast<std::size_t>(pages) * page_size * dim),
        v(k.size()),
        positions(static_cast<std::size_t>(pages) * page_size, -1) {
    for (std::size_t i = 0; i < k.size(); ++i)
      k[i] = half::from_bits(static_cast<std::uint16_t>(i * 3 + 7)), v[i] = half::from_bits(static_cast<std::uint16_t>(i * 13 + 2));
  }
  /// Rows of the given lengths on shuffled distinct pages; positions = 1000 * row + t.
  void build(const std::vector<std::int64_t>& lens, unsigned seed) {
    std::vector<std::int32_t> perm(static_cast<std::size_t>(num_pages));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), std::mt19937(seed));
    std::size_t next = 0;
    for (std::size_t r = 0; r < lens.size(); ++r) {
      const std::int64_t pages = (lens[r] + ps - 1) / ps;
      for (std::int64_t p = 0; p < pages; ++p) indices.push_back(perm[next++]);
      indptr.push_back(static_cast<std::int32_t>(indices.size()));
      last.push_back(pages == 0 ? 0 : static_cast<std::int32_t>(lens[r] - (pages - 1) * ps));
      for (std::int64_t t = 0; t < lens[r]; ++t)
        positions[indices[indptr[r] + t / ps] * ps + t % ps] = static_cast<std::int32_t>(1000 * r + t);
    }
  }
  PagedKVView<half> view(std::int32_t num_kv_heads = 1) {
    PageStrides st{static_cast<std::int64_t>(ps) * d, 0, d, 1};
    return PagedKVView<half>{
        k.data(), v.data(),  st,
        st,       num_pages, num_kv_heads,
        ps,       d,         PageTable{indptr.data(), indices.data(), last.data(), static_cast<std::int32_t>(last.size())},
        kHost};
  }
};

}  // namespace

TEST_CASE("ragged paged: per-head budgets free pages, kept tokens bit-identical at their logical positions", "[apply][ragged][paged]") {
  const std::int64_t B = 2, H = 3;
  const std::vector<std::int64_t> lens{37, 37, 37, 20, 20, 20};
  const std::vector<std::int64_t> counts{9, 37, 0, 20, 1, 16};  // ragged per-head budgets
  for (std::int32_t heads_in_view : {1, 3}) {                   // num_kv_heads 1, or H heads with head stride 0
    PerHeadPool pool(8, 5, 40);
    pool.build(lens, 3);
    auto cache = pool.view(heads_in_view);
    REQUIRE(cache.validate("t").is_ok());
    const PagedKVView<half> before = cache;
    const auto k0 = pool.k, v0 = pool.v;
    const auto old_indptr = pool.indptr, old_indices = pool.indices;
    auto keep = ragged_keep(lens, counts, 4);
    std::int64_t expect_freed = 0, expect_pages = 0;
    for (std::size_t r = 0; r < lens.size(); ++r) {
      const std::int64_t kept_pages = (counts[r] + 7) / 8;
      expect_pages += kept_pages;
      expect_freed += (lens[r] + 7) / 8 - kept_pages;
    }
    std::vector<std::int32_t> out_indptr(B * H + 1), out_indices(old_indices.size()), out_last(B * H), freed(old_indices.size());
    PagedCompactOutput out{out_indptr.data(),
                           out_indices.data(),
                           out_last.data(),
                           static_cast<std::int64_t>(out_indices.size()),
                           freed.data(),
                           static_cast<std::int64_t>(freed.size()),
                           0};
    std::vector<std::byte> ws(compact_paged_per_head_workspace(pool.num_pages));
    const Status s = compact_paged_per_head<half>(cache, H, keep.view(),
                                                  TensorView<std::int32_t, 2>::contiguous(pool.positions.data(), {pool.num_pages, 8}), out,
                                                  Workspace{ws.data(), ws.size()});
    INFO(s.message());
    REQUIRE(s.is_ok());
    REQUIRE(out.num_freed == expect_freed);
    REQUIRE(out_indptr.back() == expect_pages);
    // freed pages are the old pages no longer referenced; kept + freed = old, no duplicates
    std::multiset<std::int32_t> all(out_indices.begin(), out_indices.begin() + expect_pages);
    all.insert(freed.begin(), freed.begin() + out.num_freed);
    REQUIRE(all == std::multiset<std::int32_t>(old_indices.begin(), old_indices.end()));
    PagedKVView<half> after = cache;
    after.table = PageTable{out_indptr.data(), out_indices.data(), out_last.data(), static_cast<std::int32_t>(B * H)};
    REQUIRE(after.validate("after").is_ok());
    for (std::int32_t r = 0; r < B * H; ++r) {
      REQUIRE(after.seq_len(r) == counts[static_cast<std::size_t>(r)]);
      const auto row = keep.row(r);
      for (std::size_t i = 0; i < row.size(); ++i) {
        const auto t = static_cast<std::int64_t>(i);
        const std::int64_t src_off = (static_cast<std::int64_t>(old_indices[old_indptr[r] + row[i] / 8]) * 8 + row[i] % 8) * 5;
        const std::int64_t dst_off = (static_cast<std::int64_t>(after.table.page_of(r, t, 8)) * 8 + t % 8) * 5;
        for (int c = 0; c < 5; ++c) {
          REQUIRE(bits(pool.k[dst_off + c]) == bits(k0[src_off + c]));
          REQUIRE(bits(pool.v[dst_off + c]) == bits(v0[src_off + c]));
        }
        REQUIRE(pool.positions[after.table.page_of(r, t, 8) * 8 + t % 8] == 1000 * r + row[i]);
      }
    }
    (void)before;
  }
}

TEST_CASE("ragged paged: bad layouts and budgets are rejected with nothing modified", "[apply][ragged][paged][errors]") {
  PerHeadPool pool(4, 2, 12);
  pool.build({9, 5, 4, 0}, 7);
  const std::vector<half> k0 = pool.k;
  const std::vector<std::int32_t> pos0 = pool.positions, idx0 = pool.indices, ptr0 = pool.indptr, last0 = pool.last;
  auto same_bits = [](const std::vector<half>& a, const std::vector<half>& b) {
    return std::memcmp(a.data(), b.data(), a.size() * sizeof(half)) == 0;
  };
  std::vector<std::int32_t> idx_now = idx0;  // the table as the test set it
  std::vector<std::int32_t> oi(5, -1), oidx(12, -1), ol(4, -1), fr(12, -1);
  PagedCompactOutput out{oi.data(), oidx.data(), ol.data(), 12, fr.data(), 12, 0};
  std::vector<std::byte> ws(compact_paged_per_head_workspace(12));
  auto check = [&](PagedKVView<half> cache, std::int64_t H, KeepSetBuffer keep, const char* needle, std::size_t ws_bytes = SIZE_MAX) {
    const Status s =
        compact_paged_per_head<half>(cache, H, keep.view(), TensorView<std::int32_t, 2>::contiguous(pool.positions.data(), {12, 4}), out,
                                     Workspace{ws.data(), std::min(ws_bytes, ws.size())});
    INFO(s.message());
    REQUIRE(!s.is_ok());
    REQUIRE_THAT(s.message(), Contains(needle));
    REQUIRE(same_bits(pool.k, k0));
    REQUIRE(pool.positions == pos0);
    REQUIRE(pool.indices == idx_now);
    REQUIRE(pool.indptr == ptr0);
    REQUIRE(pool.last == last0);
    REQUIRE(oi == std::vector<std::int32_t>(5, -1));
    REQUIRE(fr == std::vector<std::int32_t>(12, -1));
  };
  auto ok_keep = ragged_keep({9, 5, 4, 0}, {3, 5, 1, 0}, 1);
  // per-head budget above the row's length (sequence 1, kv head 0 holds 4 tokens)
  check(pool.view(), 2, ragged_keep({9, 5, 9, 0}, {3, 5, 6, 0}, 1), "sequence 1 kv head 0 keeps 6 tokens but holds only 4");
  check(pool.view(), 3, ok_keep, "page table has 4 rows, not a multiple of kv_heads=3");
  KeepSetBuffer three(3, 9);
  check(pool.view(), 2, three, "keep set has 3 rows, expected one per page-table row (4)");
  // a pool whose pages hold several heads is not a per-head layout
  auto multi = pool.view(2);
  multi.k_strides.head = 8;
  check(multi, 2, ok_keep, "a page must hold one head");
  // a page shared by two rows
  pool.indices[3] = pool.indices[0];
  idx_now = pool.indices;
  check(pool.view(), 2, ok_keep, "appears twice in the page table");
  pool.indices = idx_now = idx0;
  check(pool.view(), 2, ok_keep, "workspace has 8 bytes", 8);
  // output too small for the compacted table
  out.indices_capacity = 1;
  check(pool.view(), 2, ok_keep, "output indices capacity 1 < 4 pages");
  out.indices_capacity = 12;
  out.freed_capacity = 0;
  check(pool.view(), 2, ok_keep, "freed_pages capacity 0 < 2 freed pages");
  out.freed_capacity = 12;
  // and the valid call succeeds
  REQUIRE(compact_paged_per_head<half>(pool.view(), 2, ok_keep.view(), {}, out, Workspace{ws.data(), ws.size()}).is_ok());
  REQUIRE(out.num_freed == 2);
}

TEST_CASE("ragged: null keep-set indices and row0 near INT64_MAX are rejected with nothing modified", "[apply][ragged][errors]") {
  const std::int64_t H = 2, cap = 6, d = 2;
  std::vector<float> k(H * cap * d);
  std::iota(k.begin(), k.end(), 0.0f);
  const auto k0 = k;
  auto kv = TensorView<float, 3>::contiguous(k.data(), {H, cap, d});
  std::vector<std::int64_t> lens{6, 4}, out(H, -1);
  std::vector<std::int32_t> indptr{0, 1, 2}, ids{0, 3};
  auto check = [&](const KeepSet& keep, std::int64_t row0, const char* needle) {
    const Status s = compact_contiguous_per_head<float>(kv, {}, {}, lens, keep, row0, out);
    INFO(s.message());
    REQUIRE_THAT(s.message(), Contains(needle));
    REQUIRE(k == k0);
    REQUIRE(out == std::vector<std::int64_t>(H, -1));
  };
  check(KeepSet{indptr.data(), nullptr, 2, 2}, 0, "keep set indices is null but row 0 lists 1 tokens");
  check(KeepSet{indptr.data(), ids.data(), 2, 2}, std::numeric_limits<std::int64_t>::max(), "out of range [0, num_rows=2)");

  PerHeadPool pool(4, 2, 8);
  pool.build({5, 3}, 3);
  const std::vector<half> pk0 = pool.k;
  std::vector<std::int32_t> oi(3, -1), oidx(8, -1), ol(2, -1), fr(8, -1);
  PagedCompactOutput pout{oi.data(), oidx.data(), ol.data(), 8, fr.data(), 8, 0};
  std::vector<std::byte> ws(compact_paged_per_head_workspace(8));
  const Status s =
      compact_paged_per_head<half>(pool.view(), 1, KeepSet{indptr.data(), nullptr, 2, 2}, {}, pout, Workspace{ws.data(), ws.size()});
  INFO(s.message());
  REQUIRE_THAT(s.message(), Contains("keep set indices is null but row 0 lists 1 tokens"));
  REQUIRE(std::memcmp(pool.k.data(), pk0.data(), pk0.size() * sizeof(half)) == 0);
  REQUIRE(oi == std::vector<std::int32_t>(3, -1));
  REQUIRE_THAT(
      compact_paged_per_head<half>(pool.view(), 1, KeepSet{nullptr, ids.data(), 2, 2}, {}, pout, Workspace{ws.data(), ws.size()}).message(),
      Contains("keep set indptr is null"));
}
