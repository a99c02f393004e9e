// SPDX-License-Identifier: Apache-2.0
// `Rows<T>`: the rows (tokens) of one kv head of one sequence -- keys or
// values alike -- either a
// strided contiguous run `(kv_len, head_dim)` or scattered over the pages of a
// paged pool. This is how ops read K/V in place, in the caller's dtype and
// layout, without a conversion copy. Rows themselves must be contiguous
// (dim stride 1), which every engine layout satisfies.
#pragma once

#include <cstdint>

#include "kvpolicy/core/config.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/tensor_view.hpp"

KVP_NAMESPACE_BEGIN

template <class T>
struct Rows {
  const T* base = nullptr;              ///< contiguous: row j at base + j*row_stride; paged: page pool base
  std::int64_t row_stride = 0;          ///< contiguous: elements between rows; paged: slot stride
  const std::int32_t* pages = nullptr;  ///< paged only: page ids of this sequence (nullptr = contiguous)
  std::int64_t page_stride = 0;         ///< paged only
  std::int32_t page_size = 0;           ///< paged only

  KVP_HOST_DEVICE const T* row(std::int64_t j) const noexcept {
    if (pages == nullptr) return base + j * row_stride;
    return base + static_cast<std::int64_t>(pages[j / page_size]) * page_stride + (j % page_size) * row_stride;
  }

  /// Rows of kv head `h` of a `(kv_heads, kv_len, head_dim)` view.
  static Rows from_heads(TensorView<const T, 3> v, std::int64_t h) noexcept {
    return Rows{v.data() + h * v.stride(0), v.stride(1), nullptr, 0, 0};
  }
  /// Rows of a `(kv_len, head_dim)` view.
  static Rows from_matrix(TensorView<const T, 2> v) noexcept { return Rows{v.data(), v.stride(0), nullptr, 0, 0}; }
  /// Key rows of sequence b, kv head h of a paged cache.
  static Rows paged_keys(const PagedKVView<const T>& p, std::int32_t b, std::int32_t h) noexcept {
    return Rows{p.k_data + h * p.k_strides.head, p.k_strides.slot, p.table.indices + p.table.indptr[b], p.k_strides.page, p.page_size};
  }
  /// Value rows of sequence b, kv head h of a paged cache.
  static Rows paged_values(const PagedKVView<const T>& p, std::int32_t b, std::int32_t h) noexcept {
    return Rows{p.v_data + h * p.v_strides.head, p.v_strides.slot, p.table.indices + p.table.indptr[b], p.v_strides.page, p.page_size};
  }
};

KVP_NAMESPACE_END
