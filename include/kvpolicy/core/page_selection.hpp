// SPDX-License-Identifier: Apache-2.0
// Page-level data contracts of query-aware page selection (Quest):
//
// - `PageMetaView<T>`: caller-owned per-page state, the channel-wise max and
//   min of the (post-RoPE) keys of every page and kv head of a page pool;
// - `PageSelection`: the decision, CSR page lists per (sequence, head) in
//   FlashInfer's page-table form (`kv_indptr`, `kv_indices`,
//   `kv_last_page_len`), so a selection row is a valid FlashInfer request.
//
// Both are plain views over caller memory; nothing here allocates.
#pragma once

#include <cstdint>
#include <limits>
#include <type_traits>

#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/tensor_view.hpp"

KVP_NAMESPACE_BEGIN

/// Per page and kv head of a page pool: the channel-wise max and min of the
/// keys stored in that page (Quest's page metadata).
///
/// Indexing follows the *physical* page id of the pool (like Quest's second
/// "metadata" page pool), so the engine's page table addresses keys and
/// metadata alike and pages shared between sequences share their metadata.
/// Max and min have separate base pointers and common strides (in
/// elements): row `(page, head)` starts at `page*page_stride + head*head_stride`
/// and holds `head_dim` contiguous values. `contiguous()` builds the packed
/// layout `(num_pages, num_kv_heads, 2, head_dim)` with `[.., 0, :]` = max and
/// `[.., 1, :]` = min, the recommended one: a page's metadata for every kv
/// head is one contiguous block (4 KiB for 8 heads of 128 fp16 channels),
/// which the bounds estimate reads in one go however scattered the page ids.
///
/// Element type: the key dtype or float. The min / max of values of the key
/// dtype are values of the key dtype, so either choice stores them *exactly*;
/// a narrower metadata type than the keys (fp32 keys, fp16 metadata) would have
/// to round max up and min down and is not offered. fp16 / bf16 metadata halves
/// the bytes the estimate reads; fp32 metadata costs 2x and buys nothing in
/// exactness. The "empty page" state is max = -inf, min = +inf in every dtype
/// (the identity of max/min; fp16 has infinities, so Quest's finite ±65504
/// sentinel is unnecessary) and is never observed by a score: a page's
/// metadata is re-initialised when its slot 0 is written.
template <class T>
struct PageMetaView {
  T* max_data = nullptr;  ///< channel max rows
  T* min_data = nullptr;  ///< channel min rows
  std::int64_t page_stride = 0;
  std::int64_t head_stride = 0;
  std::int32_t num_pages = 0;  ///< must equal the page pool's num_pages
  std::int32_t num_kv_heads = 0;
  std::int32_t head_dim = 0;
  Device device{};

  /// Packed `(num_pages, num_kv_heads, 2, head_dim)` buffer of
  /// `2 * num_pages * num_kv_heads * head_dim` elements.
  static constexpr PageMetaView contiguous(T* data, std::int32_t num_pages, std::int32_t num_kv_heads, std::int32_t head_dim,
                                           Device device = kHost) noexcept {
    PageMetaView v;
    v.max_data = data;
    v.min_data = data == nullptr ? nullptr : data + head_dim;
    v.head_stride = 2 * static_cast<std::int64_t>(head_dim);
    v.page_stride = v.head_stride * num_kv_heads;
    v.num_pages = num_pages;
    v.num_kv_heads = num_kv_heads;
    v.head_dim = head_dim;
    v.device = device;
    return v;
  }
  /// Elements a `contiguous()` buffer needs.
  static constexpr std::int64_t contiguous_size(std::int32_t num_pages, std::int32_t num_kv_heads, std::int32_t head_dim) noexcept {
    return 2 * static_cast<std::int64_t>(num_pages) * num_kv_heads * head_dim;
  }

  T* max_row(std::int32_t page, std::int32_t head) const noexcept {
    return max_data + static_cast<std::int64_t>(page) * page_stride + static_cast<std::int64_t>(head) * head_stride;
  }
  T* min_row(std::int32_t page, std::int32_t head) const noexcept {
    return min_data + static_cast<std::int64_t>(page) * page_stride + static_cast<std::int64_t>(head) * head_stride;
  }
  /// The metadata of kv head h alone (a one-head view, same pages).
  PageMetaView head_view(std::int32_t h) const noexcept {
    PageMetaView v = *this;
    v.max_data = max_data + static_cast<std::int64_t>(h) * head_stride;
    v.min_data = min_data + static_cast<std::int64_t>(h) * head_stride;
    v.num_kv_heads = 1;
    return v;
  }

  operator PageMetaView<const T>() const noexcept requires(!std::is_const_v<T>) {
    return PageMetaView<const T>{max_data, min_data, page_stride, head_stride, num_pages, num_kv_heads, head_dim, device};
  }

  /// The view on its own: extents positive (num_pages >= 0), a stride that
  /// separates rows along every axis with more than one entry (a zero stride
  /// would make distinct pages or heads share one row), data present, host
  /// memory (device memory with `on_device`, for a device backend's call).
  Status check_basic(const char* who, bool on_device = false) const noexcept {
    KVP_REQUIRE(num_pages >= 0, "%s: metadata num_pages is %d, must be >= 0", who, num_pages);
    KVP_REQUIRE(num_kv_heads > 0, "%s: metadata num_kv_heads is %d, must be > 0", who, num_kv_heads);
    KVP_REQUIRE(head_dim > 0, "%s: metadata head_dim is %d, must be > 0", who, head_dim);
    KVP_REQUIRE(num_pages <= 1 || page_stride != 0, "%s: metadata page_stride is 0 with %d pages, must be non-zero", who, num_pages);
    KVP_REQUIRE(num_kv_heads <= 1 || head_stride != 0, "%s: metadata head_stride is 0 with %d kv heads, must be non-zero", who,
                num_kv_heads);
    KVP_REQUIRE(num_pages == 0 || (max_data != nullptr && min_data != nullptr), "%s: metadata max/min data is null with %d pages", who,
                num_pages);
    if (on_device) {
      KVP_REQUIRE(!device.is_host(), "%s: metadata is host memory; a device backend reads device memory (tag the view kCUDA)", who);
    } else {
      KVP_REQUIRE(device.is_host(), "%s: metadata is on a CUDA device; this entry point reads it on the host", who);
    }
    return Status::ok();
  }

  /// The metadata must describe exactly the pool it summarises (and pass `check_basic`).
  Status validate(const char* who, std::int32_t pool_pages, std::int32_t pool_kv_heads, std::int32_t pool_head_dim,
                  bool on_device = false) const noexcept {
    KVP_REQUIRE(num_pages == pool_pages, "%s: metadata has %d pages, the page pool has %d (one metadata entry per pool page)", who,
                num_pages, pool_pages);
    KVP_REQUIRE(num_kv_heads == pool_kv_heads, "%s: metadata has %d kv heads, the page pool has %d", who, num_kv_heads, pool_kv_heads);
    KVP_REQUIRE(head_dim == pool_head_dim, "%s: metadata head_dim is %d, the keys have %d", who, head_dim, pool_head_dim);
    return check_basic(who, on_device);
  }
};

/// Sentinels of the empty metadata state (see PageMetaView).
template <class T>
constexpr std::remove_cv_t<T> page_meta_empty_max() noexcept {
  return from_float<std::remove_cv_t<T>>(-std::numeric_limits<float>::infinity());
}
template <class T>
constexpr std::remove_cv_t<T> page_meta_empty_min() noexcept {
  return from_float<std::remove_cv_t<T>>(std::numeric_limits<float>::infinity());
}

/// A page-selection decision: row `r` lists the pages one head of one
/// sequence attends to, `indices[indptr[r] .. indptr[r+1])`, in FlashInfer's
/// CSR page-table form, so `(indptr, indices, last_page_len)` can be passed
/// unchanged as `kv_indptr / kv_indices / kv_last_page_len` of a decode call
/// that treats each row as one request.
///
/// Conventions (checked by `validate`):
/// - rows are `seq * heads_per_seq + head`; `heads_per_seq` is the number of
///   query heads (one selection per query head) or kv heads (one per kv
///   head), as stated by the writer;
/// - int32 everywhere; `indptr[0] == 0`, non-decreasing;
/// - `indices` are physical page ids of the pool, in ascending *logical* order
///   within the sequence, so the sequence's last page comes last and
///   `last_page_len[r]` (1..page_size) is its fill; the attended length is
///   `(row_size - 1) * page_size + last_page_len[r]`;
/// - a row without pages (empty sequence) has `last_page_len[r] == 0`;
/// - `logical` (optional, may be null) receives each entry's page number
///   within its sequence (0-based), for metrics and position-aware consumers.
struct PageSelection {
  std::int32_t* indptr = nullptr;         // (num_rows + 1)
  std::int32_t* indices = nullptr;        // (capacity)
  std::int32_t* last_page_len = nullptr;  // (num_rows)
  std::int32_t* logical = nullptr;        // (capacity), optional
  std::int64_t num_rows = 0;
  std::int64_t capacity = 0;

  std::int64_t row_size(std::int64_t r) const noexcept { return indptr[r + 1] - indptr[r]; }
  /// Tokens attended by row r.
  std::int64_t row_tokens(std::int64_t r, std::int32_t page_size) const noexcept {
    const std::int64_t n = row_size(r);
    return n == 0 ? 0 : (n - 1) * page_size + last_page_len[r];
  }
  /// The selection as a page table over the same pool (one "sequence" per row).
  PageTable as_table() const noexcept { return PageTable{indptr, indices, last_page_len, static_cast<std::int32_t>(num_rows)}; }

  /// Output-buffer check done by writers before writing anything.
  Status check_output(const char* who, std::int64_t rows_needed, std::int64_t capacity_needed) const noexcept {
    KVP_REQUIRE(num_rows == rows_needed, "%s: page selection has %lld rows, expected %lld", who, static_cast<long long>(num_rows),
                static_cast<long long>(rows_needed));
    KVP_REQUIRE(rows_needed <= 0x7fffffff, "%s: page selection needs %lld rows; int32 CSR allows at most 2^31-1", who,
                static_cast<long long>(rows_needed));
    KVP_REQUIRE(indptr != nullptr, "%s: page selection indptr is null", who);
    KVP_REQUIRE(num_rows == 0 || last_page_len != nullptr, "%s: page selection last_page_len is null", who);
    KVP_REQUIRE(capacity_needed <= 0x7fffffff, "%s: page selection needs %lld entries; int32 CSR allows at most 2^31-1", who,
                static_cast<long long>(capacity_needed));
    if (capacity < capacity_needed) {
      return Status::error(StatusCode::kOutputTooSmall, "%s: page selection capacity is %lld, needs %lld", who,
                           static_cast<long long>(capacity), static_cast<long long>(capacity_needed));
    }
    KVP_REQUIRE(capacity_needed == 0 || indices != nullptr, "%s: page selection indices is null", who);
    return Status::ok();
  }

  /// Checks a written selection against FlashInfer's page-table conventions
  /// for a pool of `num_pool_pages` pages of `page_size` tokens (see above).
  Status validate(const char* who, std::int32_t num_pool_pages, std::int32_t page_size) const noexcept {
    KVP_REQUIRE(num_pool_pages >= 0, "%s: num_pages is %d, must be >= 0", who, num_pool_pages);
    KVP_REQUIRE(page_size >= 1, "%s: page_size is %d, must be >= 1", who, page_size);
    KVP_REQUIRE(num_rows >= 0, "%s: page selection has %lld rows, must be >= 0", who, static_cast<long long>(num_rows));
    KVP_REQUIRE(num_rows <= 0x7fffffff, "%s: page selection has %lld rows; int32 CSR allows at most 2^31-1", who,
                static_cast<long long>(num_rows));
    KVP_REQUIRE(capacity >= 0, "%s: page selection capacity is %lld, must be >= 0", who, static_cast<long long>(capacity));
    KVP_REQUIRE(indptr != nullptr, "%s: page selection indptr is null", who);
    KVP_REQUIRE(num_rows == 0 || last_page_len != nullptr, "%s: page selection last_page_len is null with %lld rows", who,
                static_cast<long long>(num_rows));
    KVP_REQUIRE(indptr[0] == 0, "%s: page selection indptr[0] is %d, must be 0", who, indptr[0]);
    for (std::int64_t r = 0; r < num_rows; ++r) {
      KVP_REQUIRE(indptr[r + 1] >= indptr[r], "%s: page selection indptr is not monotonic at row %lld (%d > %d)", who,
                  static_cast<long long>(r), indptr[r], indptr[r + 1]);
      const std::int32_t len = last_page_len[r];
      if (indptr[r + 1] > indptr[r]) {
        KVP_REQUIRE(len >= 1 && len <= page_size, "%s: page selection last_page_len[%lld] is %d, must be in [1, page_size=%d]", who,
                    static_cast<long long>(r), len, page_size);
      } else {
        KVP_REQUIRE(len == 0, "%s: page selection row %lld is empty but last_page_len is %d, must be 0", who, static_cast<long long>(r),
                    len);
      }
    }
    KVP_REQUIRE(indptr[num_rows] <= capacity, "%s: page selection indptr[%lld] is %d, beyond its capacity %lld", who,
                static_cast<long long>(num_rows), indptr[num_rows], static_cast<long long>(capacity));
    KVP_REQUIRE(indptr[num_rows] == 0 || indices != nullptr, "%s: page selection indices is null with %d entries", who, indptr[num_rows]);
    for (std::int32_t i = 0; i < indptr[num_rows]; ++i) {
      KVP_REQUIRE(indices[i] >= 0 && indices[i] < num_pool_pages, "%s: page selection indices[%d] is %d, out of range [0, %d)", who, i,
                  indices[i], num_pool_pages);
    }
    if (logical != nullptr) {
      for (std::int64_t r = 0; r < num_rows; ++r) {
        for (std::int32_t i = indptr[r] + 1; i < indptr[r + 1]; ++i) {
          KVP_REQUIRE(logical[i] > logical[i - 1], "%s: page selection row %lld is not in ascending logical page order at entry %d", who,
                      static_cast<long long>(r), i);
        }
      }
    }
    return Status::ok();
  }
};

KVP_NAMESPACE_END
