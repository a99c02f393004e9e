// SPDX-License-Identifier: Apache-2.0
// Paged KV cache view: a page pool addressed through a FlashInfer-style CSR
// page table. K and V have separate base pointers and strides, so NHD
// `(num_pages, page_size, kv_heads, head_dim)`, HND
// `(num_pages, kv_heads, page_size, head_dim)`, a fused `[pages, 2, ...]`
// tensor or two independent pools are all described without copies.
#pragma once

#include <cstdint>

#include "kvpolicy/core/tensor_view.hpp"

KVP_NAMESPACE_BEGIN

enum class PageLayout : std::uint8_t { kNHD, kHND };

/// Strides in elements along the logical axes (page, kv head, slot, dim).
struct PageStrides {
  std::int64_t page = 0, head = 0, slot = 0, dim = 1;

  /// Contiguous pool `(num_pages, page_size, kv_heads, head_dim)` (NHD) or
  /// `(num_pages, kv_heads, page_size, head_dim)` (HND).
  static constexpr PageStrides contiguous(PageLayout layout, std::int64_t num_kv_heads, std::int64_t page_size,
                                          std::int64_t head_dim) noexcept {
    PageStrides s;
    s.dim = 1;
    if (layout == PageLayout::kNHD) {
      s.head = head_dim;
      s.slot = num_kv_heads * head_dim;
    } else {
      s.slot = head_dim;
      s.head = page_size * head_dim;
    }
    s.page = num_kv_heads * page_size * head_dim;
    return s;
  }
};

/// CSR page table for a batch: sequence b owns pages
/// `indices[indptr[b] .. indptr[b+1])`, the last holding `last_page_len[b]`
/// tokens (1..page_size); the sequence length is
/// `(num_pages_b - 1) * page_size + last_page_len[b]` (0 when it has no pages).
struct PageTable {
  const std::int32_t* indptr = nullptr;         // (batch + 1)
  const std::int32_t* indices = nullptr;        // (indptr[batch])
  const std::int32_t* last_page_len = nullptr;  // (batch)
  std::int32_t batch = 0;

  std::int32_t num_pages(std::int32_t b) const noexcept { return indptr[b + 1] - indptr[b]; }
  /// Defined (no overflow) for any indptr values, so a policy may read lengths
  /// before `validate`: a sequence whose indptr decreases has length 0.
  std::int64_t seq_len(std::int32_t b, std::int32_t page_size) const noexcept {
    const std::int64_t n = static_cast<std::int64_t>(indptr[b + 1]) - indptr[b];
    return n <= 0 ? 0 : (n - 1) * page_size + last_page_len[b];
  }
  /// Page id and in-page slot of token t of sequence b.
  std::int32_t page_of(std::int32_t b, std::int64_t t, std::int32_t page_size) const noexcept {
    return indices[indptr[b] + static_cast<std::int32_t>(t / page_size)];
  }

  /// Validates the CSR structure against a pool of `num_pool_pages` pages of
  /// `page_size` tokens: indptr starts at 0 and never decreases, a non-empty
  /// sequence's last_page_len is in [1, page_size], every id is in
  /// [0, num_pool_pages). Page ids are not required to be distinct here (a
  /// read-only consumer may share pages); writers check that themselves.
  /// CSR structure (indptr, last_page_len) and, with `check_ids`, every page
  /// id in [0, num_pool_pages). `check_ids = false` is for a table whose
  /// `indices` live in device memory (a device backend's call): the host reads
  /// only indptr and last_page_len.
  Status validate(const char* who, std::int32_t num_pool_pages, std::int32_t page_size, bool check_ids = true) const noexcept {
    KVP_REQUIRE(num_pool_pages >= 0, "%s: num_pages is %d, must be >= 0", who, num_pool_pages);
    KVP_REQUIRE(page_size >= 1, "%s: page_size is %d, must be >= 1", who, page_size);
    KVP_REQUIRE(batch >= 0, "%s: page table batch is %d, must be >= 0", who, batch);
    if (batch == 0) return Status::ok();
    KVP_REQUIRE(indptr != nullptr, "%s: page table indptr is null", who);
    KVP_REQUIRE(last_page_len != nullptr, "%s: page table last_page_len is null", who);
    KVP_REQUIRE(indptr[0] == 0, "%s: page table indptr[0] is %d, must be 0", who, indptr[0]);
    for (std::int32_t b = 0; b < batch; ++b) {
      KVP_REQUIRE(indptr[b + 1] >= indptr[b], "%s: page table indptr is not monotonic at %d (%d > %d)", who, b, indptr[b], indptr[b + 1]);
      const std::int32_t n = indptr[b + 1] - indptr[b];
      if (n > 0) {
        KVP_REQUIRE(last_page_len[b] >= 1 && last_page_len[b] <= page_size, "%s: last_page_len[%d] is %d, must be in [1, page_size=%d]",
                    who, b, last_page_len[b], page_size);
      }
    }
    KVP_REQUIRE(indptr[batch] == 0 || indices != nullptr, "%s: page table indices is null with %d pages", who, indptr[batch]);
    if (!check_ids) return Status::ok();
    for (std::int32_t i = 0; i < indptr[batch]; ++i) {
      KVP_REQUIRE(indices[i] >= 0 && indices[i] < num_pool_pages, "%s: page table indices[%d] is %d, out of range [0, %d)", who, i,
                  indices[i], num_pool_pages);
    }
    return Status::ok();
  }
};

/// One layer of a paged KV cache. T is the element type (const for read-only).
template <class T>
struct PagedKVView {
  T* k_data = nullptr;  ///< page pool for keys
  T* v_data = nullptr;  ///< page pool for values (may be nullptr for K-only use)
  PageStrides k_strides{};
  PageStrides v_strides{};
  std::int32_t num_pages = 0;  ///< pages in the pool
  std::int32_t num_kv_heads = 0;
  std::int32_t page_size = 0;
  std::int32_t head_dim = 0;
  PageTable table{};
  Device device{};

  T* k_ptr(std::int32_t page, std::int32_t head, std::int32_t slot) const noexcept {
    return k_data + page * k_strides.page + head * k_strides.head + slot * k_strides.slot;
  }
  T* v_ptr(std::int32_t page, std::int32_t head, std::int32_t slot) const noexcept {
    return v_data + page * v_strides.page + head * v_strides.head + slot * v_strides.slot;
  }
  /// Key row of logical token t of sequence b, kv head h.
  T* key(std::int32_t b, std::int32_t h, std::int64_t t) const noexcept {
    return k_ptr(table.page_of(b, t, page_size), h, static_cast<std::int32_t>(t % page_size));
  }
  T* value(std::int32_t b, std::int32_t h, std::int64_t t) const noexcept {
    return v_ptr(table.page_of(b, t, page_size), h, static_cast<std::int32_t>(t % page_size));
  }
  std::int64_t seq_len(std::int32_t b) const noexcept { return table.seq_len(b, page_size); }

  /// Read-only form of the view.
  operator PagedKVView<const T>() const noexcept requires(!std::is_const_v<T>) {
    return PagedKVView<const T>{k_data, v_data, k_strides, v_strides, num_pages, num_kv_heads, page_size, head_dim, table, device};
  }

  /// Pool structure and the page table; `check_ids = false` leaves the page
  /// ids unread (a device backend's call: `table.indices` is device memory).
  Status validate(const char* who, bool need_values = true, bool check_ids = true) const noexcept {
    KVP_REQUIRE(page_size > 0, "%s: page_size is %d, must be > 0", who, page_size);
    KVP_REQUIRE(head_dim > 0, "%s: head_dim is %d, must be > 0", who, head_dim);
    KVP_REQUIRE(num_kv_heads > 0, "%s: num_kv_heads is %d, must be > 0", who, num_kv_heads);
    KVP_REQUIRE(num_pages >= 0, "%s: num_pages is %d, must be >= 0", who, num_pages);
    KVP_REQUIRE(num_pages == 0 || k_data != nullptr, "%s: k_data is null with %d pages", who, num_pages);
    KVP_REQUIRE(!need_values || num_pages == 0 || v_data != nullptr, "%s: v_data is null with %d pages", who, num_pages);
    KVP_REQUIRE(reinterpret_cast<std::uintptr_t>(k_data) % alignof(T) == 0 && reinterpret_cast<std::uintptr_t>(v_data) % alignof(T) == 0,
                "%s: page pool pointer (k_data %p, v_data %p) is not aligned to the element size (%zu bytes)", who,
                static_cast<const void*>(k_data), static_cast<const void*>(v_data), alignof(T));
    KVP_REQUIRE(k_strides.dim == 1, "%s: key dim stride is %lld, must be 1 (rows are read as contiguous vectors)", who,
                static_cast<long long>(k_strides.dim));
    KVP_REQUIRE(!need_values || v_strides.dim == 1, "%s: value dim stride is %lld, must be 1", who, static_cast<long long>(v_strides.dim));
    return table.validate(who, num_pages, page_size, check_ids);
  }

  /// `validate` for a pool written through (compaction, merging): each pool's
  /// (page, head, slot, channel) strides address every element once, and the
  /// key and value pools do not share memory. `one_head_per_page`: per-head
  /// page tables, where every page holds one head and the head strides are 0.
  Status validate_writable(const char* who, bool need_values = true, bool one_head_per_page = false) const noexcept {
    KVP_RETURN_IF_ERROR(validate(who, need_values));
    if (num_pages == 0) return Status::ok();
    const std::int32_t heads = one_head_per_page ? 1 : num_kv_heads;
    const TensorView<T, 4> k(k_data, {num_pages, heads, page_size, head_dim}, {k_strides.page, k_strides.head, k_strides.slot, 1});
    KVP_REQUIRE(k.is_non_overlapping(), "%s: the key pool's strides (page %lld, head %lld, slot %lld) make elements overlap", who,
                static_cast<long long>(k_strides.page), static_cast<long long>(k_strides.head), static_cast<long long>(k_strides.slot));
    if (v_data == nullptr) return Status::ok();
    const TensorView<T, 4> v(v_data, {num_pages, heads, page_size, head_dim}, {v_strides.page, v_strides.head, v_strides.slot, 1});
    KVP_REQUIRE(v.is_non_overlapping(), "%s: the value pool's strides (page %lld, head %lld, slot %lld) make elements overlap", who,
                static_cast<long long>(v_strides.page), static_cast<long long>(v_strides.head), static_cast<long long>(v_strides.slot));
    const auto pk = reinterpret_cast<std::uintptr_t>(k_data), pv = reinterpret_cast<std::uintptr_t>(v_data);
    if (k.strides() == v.strides() && (pk > pv ? pk - pv : pv - pk) % sizeof(T) == 0) {
      // Equal strides (separate pools, or K and V interleaved in one buffer as FlashInfer's
      // combined layout): element-wise, as one pool with a leading axis of 2.
      const std::int64_t off = (static_cast<std::int64_t>(pv) - static_cast<std::int64_t>(pk)) / static_cast<std::int64_t>(sizeof(T));
      const TensorView<T, 5> kv(k_data, {2, num_pages, heads, page_size, head_dim},
                                {off, k_strides.page, k_strides.head, k_strides.slot, 1});
      KVP_REQUIRE(kv.is_non_overlapping(), "%s: the key and value pools share memory; they must be separate buffers", who);
      return Status::ok();
    }
    auto range = [](const TensorView<T, 4>& x, std::uintptr_t* lo, std::uintptr_t* hi) {
      std::int64_t l = 0, h = 0;
      for (int a = 0; a < 4; ++a) (x.stride(a) < 0 ? l : h) += (x.extent(a) - 1) * x.stride(a);
      *lo = reinterpret_cast<std::uintptr_t>(x.data() + l);
      *hi = reinterpret_cast<std::uintptr_t>(x.data() + h) + sizeof(T);
    };
    std::uintptr_t k0 = 0, k1 = 0, v0 = 0, v1 = 0;
    range(k, &k0, &k1);
    range(v, &v0, &v1);
    KVP_REQUIRE(k1 <= v0 || v1 <= k0, "%s: the key and value pools share memory; they must be separate buffers", who);
    return Status::ok();
  }
};

KVP_NAMESPACE_END
