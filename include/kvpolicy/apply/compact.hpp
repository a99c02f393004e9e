// SPDX-License-Identifier: Apache-2.0
// Apply a `KeepSet` to engine memory.
//
//  * `compact_contiguous`: per kv head, move kept rows to the front of a
//    `(kv_heads, capacity, head_dim)` cache (any strides, K and V), in place,
//    and permute the caller's logical-positions array the same way (the RoPE
//    position of a kept token is not its new slot index).
//  * `compact_paged`: move kept tokens of each sequence to the front of its
//    own page list, write the compacted CSR page table into caller buffers and
//    report the pages that became free (whole tail pages).
//
// Both validate everything before the first write: on error nothing changed.
// In-place safety: rows are ascending and kept row r moves to slot r <= id[r],
// so a forward sweep never overwrites a row it still has to read.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>

#include "kvpolicy/core/checked.hpp"
#include "kvpolicy/core/keep_set.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/tensor_view.hpp"
#include "kvpolicy/core/workspace.hpp"

KVP_NAMESPACE_BEGIN

namespace detail {

/// Rows [row0, row0 + count) exist in `keep` (and its indptr is not null); overflow-safe for any row0.
inline Status check_keep_rows(const char* who, const KeepSet& keep, std::int64_t row0, std::int64_t count) noexcept {
  KVP_REQUIRE(keep.indptr != nullptr, "%s: keep set indptr is null", who);
  std::int64_t end = 0;
  KVP_REQUIRE(row0 >= 0 && count >= 0 && checked_add(row0, count, &end) && end <= keep.num_rows,
              "%s: keep set rows [row0=%lld, row0+%lld) out of range [0, num_rows=%lld)", who, static_cast<long long>(row0),
              static_cast<long long>(count), static_cast<long long>(keep.num_rows));
  return Status::ok();
}

/// Row `row` (which exists) is a strictly ascending list of token ids in [0, len) inside the keep set's capacity.
inline Status check_keep_row(const char* who, const KeepSet& keep, std::int64_t row, std::int64_t len) noexcept {
  const std::int32_t b = keep.indptr[row], e = keep.indptr[row + 1];
  KVP_REQUIRE(b >= 0 && e >= b && e <= keep.capacity, "%s: keep set indptr[%lld..%lld] = [%d, %d) is not a valid range of %lld entries",
              who, static_cast<long long>(row), static_cast<long long>(row + 1), b, e, static_cast<long long>(keep.capacity));
  KVP_REQUIRE(e == b || keep.indices != nullptr, "%s: keep set indices is null but row %lld lists %d tokens", who,
              static_cast<long long>(row), e - b);
  std::int64_t prev = -1;
  for (std::int32_t i = b; i < e; ++i) {
    const std::int64_t t = keep.indices[i];
    KVP_REQUIRE(t >= 0 && t < len, "%s: keep set row %lld holds token %lld, out of range [0, %lld)", who, static_cast<long long>(row),
                static_cast<long long>(t), static_cast<long long>(len));
    KVP_REQUIRE(t > prev, "%s: keep set row %lld is not strictly ascending at entry %d (%lld after %lld)", who, static_cast<long long>(row),
                i - b, static_cast<long long>(t), static_cast<long long>(prev));
    prev = t;
  }
  return Status::ok();
}

template <class T>
void move_row(T* dst, const T* src, std::int64_t dim, std::int64_t dim_stride) noexcept {
  if (dst == src) return;
  if (dim_stride == 1) {
    std::memmove(dst, src, static_cast<std::size_t>(dim) * sizeof(T));
  } else {
    for (std::int64_t c = 0; c < dim; ++c) dst[c * dim_stride] = src[c * dim_stride];
  }
}

/// Every page id of `t` (already validated against a pool of `num_pool_pages`)
/// appears once in the whole table: a page listed twice in one sequence, or
/// by two sequences, would be reported freed while still in use, or have one
/// sequence's tokens overwritten by another's. `ws` holds a bitmap of the pool
/// (compact_paged_workspace).
inline Status check_distinct_pages(const char* who, const PageTable& t, std::int32_t num_pool_pages, Workspace ws) noexcept {
  const auto words = static_cast<std::size_t>((static_cast<std::int64_t>(num_pool_pages) + 63) / 64);
  KVP_RETURN_IF_ERROR(check_workspace(who, ws, WorkspacePlan{}.add<std::uint64_t>(words).total()));
  if (t.batch == 0 || t.indptr[t.batch] == 0) return Status::ok();
  WorkspaceCarver c(ws);
  std::uint64_t* seen = c.take<std::uint64_t>(words);
  std::memset(seen, 0, words * sizeof(std::uint64_t));
  std::int32_t b = 0;
  for (std::int32_t i = 0; i < t.indptr[t.batch]; ++i) {
    while (i >= t.indptr[b + 1]) ++b;
    const std::int32_t p = t.indices[i];
    const std::uint64_t bit = std::uint64_t{1} << (p % 64);
    if ((seen[p / 64] & bit) != 0) {
      std::int32_t first = 0;
      while (t.indices[first] != p) ++first;
      std::int32_t fb = 0;
      while (first >= t.indptr[fb + 1]) ++fb;
      return KVP_INVALID(
          "%s: page %d appears twice in the page table (entry %d of sequence %d and entry %d of sequence %d); page ids "
          "must be distinct within and across sequences",
          who, p, first - t.indptr[fb], fb, i - t.indptr[b], b);
    }
    seen[p / 64] |= bit;
  }
  return Status::ok();
}

}  // namespace detail

/// Workspace of `compact_paged` (and `compact_paged_per_head`): a bitmap of
/// the pool's pages, to check that no page id is listed twice.
constexpr std::size_t compact_paged_workspace(std::int32_t num_pool_pages) noexcept {
  return WorkspacePlan{}.add<std::uint64_t>(static_cast<std::size_t>(num_pool_pages < 0 ? 0 : (num_pool_pages + 63) / 64)).total();
}

/// Compact one sequence of a contiguous cache in place.
///
/// keys, values: (kv_heads, capacity, head_dim), any strides; values may be empty (K-only).
/// positions:    (kv_heads, capacity) int32 logical positions, permuted alongside; may be empty.
/// keep:         rows `row0 .. row0 + kv_heads` (the sequence's rows in a batch KeepSet),
///               ascending ids < kv_len; rows may differ in length (per-head budgets).
/// new_lens:     (kv_heads) receives each head's new length.
namespace detail {

/// [lo, hi) bytes a non-empty strided view may touch.
template <class T, int R>
void touched_bytes(const TensorView<T, R>& v, std::uintptr_t* lo, std::uintptr_t* hi) noexcept {
  std::int64_t l = 0, h = 0;
  for (int k = 0; k < R; ++k) (v.stride(k) < 0 ? l : h) += (v.extent(k) - 1) * v.stride(k);
  *lo = reinterpret_cast<std::uintptr_t>(v.data() + l);
  *hi = reinterpret_cast<std::uintptr_t>(v.data() + h) + sizeof(T);
}

/// Two views address no common element (either may be empty). Views of one
/// element type with equal extents and strides (K and V interleaved in one
/// buffer, as a combined KV layout stores them) are tested element-wise, as
/// one view with a leading axis of 2; any other pair by the byte ranges they
/// may touch.
template <class A, int RA, class B, int RB>
Status check_disjoint(const char* who, const TensorView<A, RA>& a, const char* an, const TensorView<B, RB>& b, const char* bn) noexcept {
  if (a.empty() || b.empty() || a.data() == nullptr || b.data() == nullptr) return Status::ok();
  if constexpr (std::is_same_v<std::remove_cv_t<A>, std::remove_cv_t<B>> && RA == RB) {
    const auto pa = reinterpret_cast<std::uintptr_t>(a.data()), pb = reinterpret_cast<std::uintptr_t>(b.data());
    if (a.extents() == b.extents() && a.strides() == b.strides() && (pa > pb ? pa - pb : pb - pa) % sizeof(A) == 0) {
      std::array<std::int64_t, RA + 1> e{}, st{};
      e[0] = 2;
      st[0] = (static_cast<std::int64_t>(pb) - static_cast<std::int64_t>(pa)) / static_cast<std::int64_t>(sizeof(A));
      for (int k = 0; k < RA; ++k) {
        e[k + 1] = a.extent(k);
        st[k + 1] = a.stride(k);
      }
      const TensorView<const A, RA + 1> both(a.data(), e, st);
      KVP_REQUIRE(both.is_non_overlapping(), "%s: %s and %s share memory; they must be separate buffers", who, an, bn);
      return Status::ok();
    }
  }
  std::uintptr_t a0 = 0, a1 = 0, b0 = 0, b1 = 0;
  touched_bytes(a, &a0, &a1);
  touched_bytes(b, &b0, &b1);
  KVP_REQUIRE(a1 <= b0 || b1 <= a0, "%s: %s and %s share memory; they must be separate buffers", who, an, bn);
  return Status::ok();
}

}  // namespace detail

namespace detail {
/// The checks every contiguous compaction makes on the views it writes through.
template <class T>
Status check_cache_views(const char* who, const TensorView<T, 3>& keys, const TensorView<T, 3>& values,
                         const TensorView<std::int32_t, 2>& positions) noexcept {
  KVP_RETURN_IF_ERROR(keys.check_writable(who, "keys"));
  KVP_RETURN_IF_ERROR(values.check_writable(who, "values"));
  KVP_RETURN_IF_ERROR(positions.check_writable(who, "positions"));
  KVP_RETURN_IF_ERROR(detail::check_disjoint(who, keys, "keys", values, "values"));
  KVP_RETURN_IF_ERROR(detail::check_disjoint(who, keys, "keys", positions, "positions"));
  KVP_RETURN_IF_ERROR(detail::check_disjoint(who, values, "values", positions, "positions"));
  return Status::ok();
}
}  // namespace detail

template <class T>
Status compact_contiguous(TensorView<T, 3> keys, TensorView<T, 3> values, TensorView<std::int32_t, 2> positions, std::int64_t kv_len,
                          const KeepSet& keep, std::int64_t row0, std::span<std::int64_t> new_lens) noexcept {
  const char* who = "compact_contiguous";
  KVP_RETURN_IF_ERROR(detail::check_cache_views(who, keys, values, positions));
  const std::int64_t H = keys.extent(0);
  KVP_REQUIRE(keys.device().is_host() && values.device().is_host(), "%s: keys/values must be host memory", who);
  KVP_REQUIRE(kv_len >= 0 && kv_len <= keys.extent(1), "%s: kv_len %lld out of range [0, capacity=%lld]", who,
              static_cast<long long>(kv_len), static_cast<long long>(keys.extent(1)));
  KVP_REQUIRE(values.empty() || (values.extent(0) == H && values.extent(1) >= kv_len),
              "%s: values has shape (%lld, %lld, %lld), expected (%lld, >= %lld, *)", who, static_cast<long long>(values.extent(0)),
              static_cast<long long>(values.extent(1)), static_cast<long long>(values.extent(2)), static_cast<long long>(H),
              static_cast<long long>(kv_len));
  KVP_REQUIRE(positions.empty() || (positions.extent(0) == H && positions.extent(1) >= kv_len),
              "%s: positions has shape (%lld, %lld), expected (%lld, >= %lld)", who, static_cast<long long>(positions.extent(0)),
              static_cast<long long>(positions.extent(1)), static_cast<long long>(H), static_cast<long long>(kv_len));
  KVP_REQUIRE(static_cast<std::int64_t>(new_lens.size()) >= H, "%s: new_lens has %zu entries, needs kv_heads=%lld", who, new_lens.size(),
              static_cast<long long>(H));
  KVP_RETURN_IF_ERROR(detail::check_keep_rows(who, keep, row0, H));
  for (std::int64_t h = 0; h < H; ++h) KVP_RETURN_IF_ERROR(detail::check_keep_row(who, keep, row0 + h, kv_len));

  for (std::int64_t h = 0; h < H; ++h) {
    const auto ids = keep.row(row0 + h);
    for (std::size_t r = 0; r < ids.size(); ++r) {
      const std::int64_t src = ids[r], dst = static_cast<std::int64_t>(r);
      // head_dim 0: no row to move, and the data may be null (no element to address).
      if (keys.extent(2) > 0) detail::move_row(&keys(h, dst, 0), &keys(h, src, 0), keys.extent(2), keys.stride(2));
      if (!values.empty()) detail::move_row(&values(h, dst, 0), &values(h, src, 0), values.extent(2), values.stride(2));
      if (!positions.empty()) positions(h, dst) = positions(h, src);
    }
    new_lens[static_cast<std::size_t>(h)] = static_cast<std::int64_t>(ids.size());
  }
  return Status::ok();
}

/// Output of `compact_paged`. Buffers may alias the input page table (the
/// compacted CSR is never longer and is written front to back).
struct PagedCompactOutput {
  std::int32_t* indptr = nullptr;         // (batch + 1)
  std::int32_t* indices = nullptr;        // (capacity)
  std::int32_t* last_page_len = nullptr;  // (batch)
  std::int64_t indices_capacity = 0;
  std::int32_t* freed_pages = nullptr;  // (freed_capacity) ids of pages no longer referenced
  std::int64_t freed_capacity = 0;
  std::int64_t num_freed = 0;  // written
};

/// Compact a paged cache to a KeepSet whose rows are `b * kv_heads + h`. All
/// kv heads of a sequence share its page list, so they must keep the same
/// number of tokens (per-head page tables are needed for ragged budgets).
/// positions: (num_pages, kv_heads, page_size) logical positions indexed like
/// the pool, moved alongside the tokens; may be empty.
/// The page table is validated (indptr, last_page_len, ids in range) and its
/// page ids must be distinct within and across sequences (a shared page
/// cannot be compacted in place); ws: compact_paged_workspace(num_pages).
template <class T>
Status compact_paged(const PagedKVView<T>& cache, const KeepSet& keep, TensorView<std::int32_t, 3> positions, PagedCompactOutput& out,
                     Workspace ws) noexcept {
  const char* who = "compact_paged";
  KVP_RETURN_IF_ERROR(cache.validate_writable(who, cache.v_data != nullptr));
  KVP_REQUIRE(cache.device.is_host(), "%s: the page pool must be host memory", who);
  const PageTable& t = cache.table;
  const std::int64_t H = cache.num_kv_heads, ps = cache.page_size;
  KVP_REQUIRE(keep.indptr != nullptr, "%s: keep set indptr is null", who);
  KVP_REQUIRE(keep.num_rows == static_cast<std::int64_t>(t.batch) * H, "%s: keep set has %lld rows, expected batch x kv_heads = %lld", who,
              static_cast<long long>(keep.num_rows), static_cast<long long>(t.batch) * H);
  KVP_RETURN_IF_ERROR(detail::check_distinct_pages(who, t, cache.num_pages, ws));
  KVP_RETURN_IF_ERROR(positions.check_basic(who, "positions"));
  KVP_REQUIRE(positions.empty() || (positions.extent(0) == cache.num_pages && positions.extent(1) == H && positions.extent(2) == ps),
              "%s: positions has shape (%lld, %lld, %lld), expected (num_pages=%d, kv_heads=%lld, page_size=%lld)", who,
              static_cast<long long>(positions.extent(0)), static_cast<long long>(positions.extent(1)),
              static_cast<long long>(positions.extent(2)), cache.num_pages, static_cast<long long>(H), static_cast<long long>(ps));
  KVP_REQUIRE(out.indptr != nullptr && out.last_page_len != nullptr, "%s: output indptr / last_page_len is null", who);
  std::int64_t new_pages = 0, freed = 0;
  for (std::int32_t b = 0; b < t.batch; ++b) {
    const std::int64_t len = t.seq_len(b, cache.page_size);
    const std::int64_t n = keep.row_size(static_cast<std::int64_t>(b) * H);
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t row = b * H + h;
      KVP_RETURN_IF_ERROR(detail::check_keep_row(who, keep, row, len));
      KVP_REQUIRE(keep.row_size(row) == n,
                  "%s: sequence %d keeps %lld tokens in kv head 0 but %lld in kv head %lld; a shared page list needs equal counts", who, b,
                  static_cast<long long>(n), static_cast<long long>(keep.row_size(row)), static_cast<long long>(h));
    }
    const std::int64_t pages = (n + ps - 1) / ps;
    new_pages += pages;
    freed += t.num_pages(b) - pages;
  }
  KVP_REQUIRE(new_pages == 0 || out.indices != nullptr, "%s: output indices is null", who);
  KVP_REQUIRE(out.indices_capacity >= new_pages, "%s: output indices capacity %lld < %lld pages", who,
              static_cast<long long>(out.indices_capacity), static_cast<long long>(new_pages));
  KVP_REQUIRE(out.freed_capacity >= freed && (freed == 0 || out.freed_pages != nullptr), "%s: freed_pages capacity %lld < %lld freed pages",
              who, static_cast<long long>(out.freed_capacity), static_cast<long long>(freed));

  // Move tokens (page list unchanged while moving: slot r of the sequence is
  // page indices[indptr[b] + r / ps], slot r % ps).
  for (std::int32_t b = 0; b < t.batch; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      const auto ids = keep.row(b * H + h);
      for (std::size_t r = 0; r < ids.size(); ++r) {
        const std::int64_t src = ids[r], dst = static_cast<std::int64_t>(r);
        if (src == dst) continue;
        const std::int32_t sp = t.page_of(b, src, cache.page_size), dp = t.page_of(b, dst, cache.page_size);
        const auto ss = static_cast<std::int32_t>(src % ps), ds = static_cast<std::int32_t>(dst % ps);
        const auto hh = static_cast<std::int32_t>(h);
        detail::move_row(cache.k_ptr(dp, hh, ds), cache.k_ptr(sp, hh, ss), cache.head_dim, 1);
        if (cache.v_data != nullptr) detail::move_row(cache.v_ptr(dp, hh, ds), cache.v_ptr(sp, hh, ss), cache.head_dim, 1);
        if (!positions.empty()) positions(dp, hh, ds) = positions(sp, hh, ss);
      }
    }
  }
  // Rewrite the table front to back (safe when aliasing the input).
  std::int64_t pos = 0, nf = 0;
  for (std::int32_t b = 0; b < t.batch; ++b) {
    const std::int64_t n = keep.row_size(static_cast<std::int64_t>(b) * H);
    const std::int64_t pages = (n + ps - 1) / ps;
    const std::int32_t begin = t.indptr[b], old_pages = t.indptr[b + 1] - t.indptr[b];
    for (std::int32_t p = static_cast<std::int32_t>(pages); p < old_pages; ++p) out.freed_pages[nf++] = t.indices[begin + p];
    for (std::int64_t p = 0; p < pages; ++p) out.indices[pos + p] = t.indices[begin + p];
    out.last_page_len[b] = pages == 0 ? 0 : static_cast<std::int32_t>(n - (pages - 1) * ps);
    out.indptr[b] = static_cast<std::int32_t>(pos);
    pos += pages;
  }
  out.indptr[t.batch] = static_cast<std::int32_t>(pos);
  out.num_freed = nf;
  return Status::ok();
}

KVP_NAMESPACE_END
