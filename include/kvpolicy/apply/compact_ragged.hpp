// SPDX-License-Identifier: Apache-2.0
// Apply a ragged `KeepSet` (a different number of kept tokens per kv head, e.g.
// Ada-KV) to engine memory, so that per-head budgets free memory instead of
// masking it.
//
//  * `compact_contiguous_per_head`: a contiguous `(kv_heads, capacity, head_dim)`
//    cache whose heads already hold different lengths (after an earlier ragged
//    compaction); each head is checked against its own length, then compacted
//    with `compact_contiguous` (apply/compact.hpp), which returns the new lengths.
//  * `compact_paged_per_head`: a paged cache with one CSR page table row per
//    (sequence, kv head), row `b * kv_heads + h` (the KeepSet's row numbering).
//    Accepted layout: a page holds the tokens of ONE head, i.e. a `PagedKVView`
//    with `num_kv_heads == 1` (pool `(num_pages, page_size, head_dim)`), or with
//    head strides 0 for K and V (any num_kv_heads: every head index addresses the
//    same memory). Every page id may appear at most once in the whole table.
//    Each row's kept tokens move to the front of its own page list, its tail
//    pages are freed and reported, and the logical positions
//    `(num_pages, page_size)` (indexed like the pool) move alongside.
//
// Everything is validated before the first write; on error nothing changed.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>

#include "kvpolicy/apply/compact.hpp"
#include "kvpolicy/core/workspace.hpp"

KVP_NAMESPACE_BEGIN

/// Compact one sequence of a contiguous cache whose kv heads hold `head_lens[h]`
/// tokens each. keys, values: (kv_heads, capacity, head_dim); positions:
/// (kv_heads, capacity) or empty; keep rows `row0 .. row0 + kv_heads`;
/// new_lens (kv_heads) receives the new lengths.
template <class T>
Status compact_contiguous_per_head(TensorView<T, 3> keys, TensorView<T, 3> values, TensorView<std::int32_t, 2> positions,
                                   std::span<const std::int64_t> head_lens, const KeepSet& keep, std::int64_t row0,
                                   std::span<std::int64_t> new_lens) noexcept {
  const char* who = "compact_contiguous_per_head";
  // Every check `compact_contiguous` makes, for every head, before the first write.
  KVP_RETURN_IF_ERROR(detail::check_cache_views(who, keys, values, positions));
  KVP_REQUIRE(keys.device().is_host() && values.device().is_host(), "%s: keys/values must be host memory", who);
  const std::int64_t H = keys.extent(0), cap = keys.extent(1);
  KVP_REQUIRE(static_cast<std::int64_t>(head_lens.size()) == H, "%s: head_lens has %zu entries, expected kv_heads=%lld", who,
              head_lens.size(), static_cast<long long>(H));
  KVP_REQUIRE(static_cast<std::int64_t>(new_lens.size()) >= H, "%s: new_lens has %zu entries, needs kv_heads=%lld", who, new_lens.size(),
              static_cast<long long>(H));
  KVP_RETURN_IF_ERROR(detail::check_keep_rows(who, keep, row0, H));
  for (std::int64_t h = 0; h < H; ++h) {
    const std::int64_t len = head_lens[static_cast<std::size_t>(h)];
    KVP_REQUIRE(len >= 0 && len <= cap, "%s: head_lens[%lld] = %lld out of range [0, capacity=%lld]", who, static_cast<long long>(h),
                static_cast<long long>(len), static_cast<long long>(cap));
    KVP_REQUIRE(values.empty() || (values.extent(0) == H && values.extent(1) >= len),
                "%s: values has shape (%lld, %lld, %lld), expected (%lld, >= %lld, *)", who, static_cast<long long>(values.extent(0)),
                static_cast<long long>(values.extent(1)), static_cast<long long>(values.extent(2)), static_cast<long long>(H),
                static_cast<long long>(len));
    KVP_REQUIRE(positions.empty() || (positions.extent(0) == H && positions.extent(1) >= len),
                "%s: positions has shape (%lld, %lld), expected (%lld, >= %lld)", who, static_cast<long long>(positions.extent(0)),
                static_cast<long long>(positions.extent(1)), static_cast<long long>(H), static_cast<long long>(len));
    const std::int64_t kept = static_cast<std::int64_t>(keep.indptr[row0 + h + 1]) - keep.indptr[row0 + h];
    KVP_REQUIRE(kept <= len, "%s: kv head %lld keeps %lld tokens but holds only %lld", who, static_cast<long long>(h),
                static_cast<long long>(kept), static_cast<long long>(len));
    KVP_RETURN_IF_ERROR(detail::check_keep_row(who, keep, row0 + h, len));
  }
  for (std::int64_t h = 0; h < H; ++h) {
    // One head at a time: a (1, capacity, head_dim) cache and the KeepSet seen from row row0 + h.
    const KeepSet one{keep.indptr + row0 + h, keep.indices, 1, keep.capacity};
    KVP_RETURN_IF_ERROR(compact_contiguous<T>(
        keys.narrow(0, h, 1), values.empty() ? values : values.narrow(0, h, 1), positions.empty() ? positions : positions.narrow(0, h, 1),
        head_lens[static_cast<std::size_t>(h)], one, 0, new_lens.subspan(static_cast<std::size_t>(h), 1)));
  }
  return Status::ok();
}

/// Workspace of `compact_paged_per_head` (a bitmap of the pool's pages, as for `compact_paged`).
constexpr std::size_t compact_paged_per_head_workspace(std::int32_t num_pool_pages) noexcept {
  return compact_paged_workspace(num_pool_pages);
}

/// Compact a paged cache with one page-table row per (sequence, kv head):
/// `cache.table` has batch * kv_heads rows (row b * kv_heads + h), the KeepSet
/// the same rows, each ascending within that row's length (ragged). positions:
/// (num_pages, page_size) logical positions indexed like the pool, or empty.
/// `out` as for `compact_paged` (it may alias the input table); freed pages are
/// the whole tail pages of every row. ws: compact_paged_per_head_workspace(num_pages).
template <class T>
Status compact_paged_per_head(const PagedKVView<T>& cache, std::int64_t kv_heads, const KeepSet& keep,
                              TensorView<std::int32_t, 2> positions, PagedCompactOutput& out, Workspace ws) noexcept {
  const char* who = "compact_paged_per_head";
  KVP_RETURN_IF_ERROR(cache.validate_writable(who, cache.v_data != nullptr, /*one_head_per_page=*/true));
  KVP_REQUIRE(cache.device.is_host(), "%s: the page pool must be host memory", who);
  KVP_REQUIRE(
      cache.num_kv_heads == 1 || (cache.k_strides.head == 0 && (cache.v_data == nullptr || cache.v_strides.head == 0)),
      "%s: a page must hold one head (num_kv_heads == 1, or head strides 0); the view has %d kv heads with head strides %lld / %lld", who,
      cache.num_kv_heads, static_cast<long long>(cache.k_strides.head), static_cast<long long>(cache.v_strides.head));
  const PageTable& t = cache.table;
  KVP_REQUIRE(kv_heads >= 1 && t.batch % kv_heads == 0, "%s: the page table has %d rows, not a multiple of kv_heads=%lld", who, t.batch,
              static_cast<long long>(kv_heads));
  KVP_REQUIRE(keep.indptr != nullptr, "%s: keep set indptr is null", who);
  KVP_REQUIRE(keep.num_rows == t.batch, "%s: keep set has %lld rows, expected one per page-table row (%d)", who,
              static_cast<long long>(keep.num_rows), t.batch);
  KVP_RETURN_IF_ERROR(positions.check_basic(who, "positions"));
  KVP_REQUIRE(positions.empty() || (positions.extent(0) == cache.num_pages && positions.extent(1) == cache.page_size),
              "%s: positions has shape (%lld, %lld), expected (num_pages=%d, page_size=%d)", who,
              static_cast<long long>(positions.extent(0)), static_cast<long long>(positions.extent(1)), cache.num_pages, cache.page_size);
  for (std::int32_t r = 0; r < t.batch; ++r) {
    const std::int64_t len = t.seq_len(r, cache.page_size), b = r / kv_heads, h = r % kv_heads;
    const std::int64_t kept = static_cast<std::int64_t>(keep.indptr[r + 1]) - keep.indptr[r];
    KVP_REQUIRE(kept <= len, "%s: sequence %lld kv head %lld keeps %lld tokens but holds only %lld", who, static_cast<long long>(b),
                static_cast<long long>(h), static_cast<long long>(kept), static_cast<long long>(len));
    KVP_RETURN_IF_ERROR(detail::check_keep_row(who, keep, r, len));
  }
  // A page shared by two rows would be overwritten by the other row's moves.
  KVP_RETURN_IF_ERROR(detail::check_distinct_pages(who, t, cache.num_pages, ws));
  // One head per page: the single-head view, compacted row by row by compact_paged
  // (which repeats the remaining checks, the distinct pages included, before writing).
  PagedKVView<T> one = cache;
  one.num_kv_heads = 1;
  const TensorView<std::int32_t, 3> pos3(positions.data(), {positions.extent(0), 1, positions.extent(1)},
                                         {positions.stride(0), 0, positions.stride(1)}, positions.device());
  return compact_paged<T>(one, keep, positions.empty() ? TensorView<std::int32_t, 3>{} : pos3, out, ws);
}

KVP_NAMESPACE_END
