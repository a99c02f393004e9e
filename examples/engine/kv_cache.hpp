// SPDX-License-Identifier: Apache-2.0
// The engine's two KV-cache layouts, one object per sequence holding every layer.
//
//  * ContiguousKVCache<T>: per layer K and V `(kv_heads, capacity, head_dim)`
//    and logical positions `(kv_heads, capacity)`; each kv head has its own
//    length, so ragged keep sets (per-head budgets) compact in place.
//  * PagedKVCache<T>: per layer a page pool `(num_pages, page_size, kv_heads,
//    head_dim)` (NHD) for K and for V, positions `(num_pages, kv_heads,
//    page_size)`, a one-sequence FlashInfer CSR page table and a free list. All
//    kv heads share the page list, so they always hold the same token count.
//    Pages are handed out from a fixed permutation of the pool (not 0, 1, 2,
//    ...), so the page indirection is really exercised.
//
// T is float or kvpolicy::half (stored K/V; arithmetic is fp32). Keys are
// stored post-RoPE at their logical position; eviction moves rows, never
// re-rotates, and `positions` carries the logical position of every slot.
//
// `attend` is the decode-step attention of one layer: for query head h (kv
// head h / G), softmax(q . k * scale) over the cached slots, then the weighted
// sum of values, all fp32. The paged cache can restrict each head to a page
// list (a `PageSelection` row, e.g. from Quest); the dense path runs the same
// loop over the sequence's full page list, so "select every page" gives
// bit-identical results. `probs`, when given, receives the step's attention
// weights `(num_q_heads, num_slots)` (zero for slots a selection skipped):
// that is what online eviction policies (H2O, TOVA) consume.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvpolicy/apply/compact.hpp"
#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/keep_set.hpp"
#include "kvpolicy/core/kv_source.hpp"
#include "kvpolicy/core/page_selection.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/tensor_view.hpp"

namespace kvp_engine {

using kvpolicy::half;
using kvpolicy::KeepSet;
using kvpolicy::KVSource;
using kvpolicy::PagedKVView;
using kvpolicy::PageSelection;
using kvpolicy::Status;
using kvpolicy::TensorView;

struct CacheShape {
  int n_layers = 0, num_q_heads = 0, num_kv_heads = 0, head_dim = 0;
  std::int64_t capacity = 0;  ///< tokens per layer and kv head
};

namespace detail {

/// Online softmax-free two-pass attention of one query row over `n` key/value
/// rows given by callbacks; accumulates in fp32. Returns nothing; writes out[d]
/// and, when probs != nullptr, the normalised weights in slot order.
template <class KeyAt, class ValAt>
void attend_rows(const float* q, int d, std::int64_t n, float scale, KeyAt key_at, ValAt val_at, float* scores, float* out) {
  float mx = -INFINITY;
  for (std::int64_t j = 0; j < n; ++j) {
    const auto* k = key_at(j);
    float s = 0.0f;
    for (int i = 0; i < d; ++i) s += q[i] * kvpolicy::to_float(k[i]);
    scores[j] = s * scale;
    mx = std::max(mx, scores[j]);
  }
  float sum = 0.0f;
  for (std::int64_t j = 0; j < n; ++j) {
    scores[j] = std::exp(scores[j] - mx);
    sum += scores[j];
  }
  const float inv = 1.0f / sum;
  for (int i = 0; i < d; ++i) out[i] = 0.0f;
  for (std::int64_t j = 0; j < n; ++j) {
    scores[j] *= inv;
    const auto* v = val_at(j);
    for (int i = 0; i < d; ++i) out[i] += scores[j] * kvpolicy::to_float(v[i]);
  }
}

}  // namespace detail

template <class T>
class ContiguousKVCache {
 public:
  using element_type = T;
  static constexpr bool kPaged = false;

  ContiguousKVCache() = default;
  explicit ContiguousKVCache(const CacheShape& s) : shape_(s), layers_(static_cast<std::size_t>(s.n_layers)) {
    const auto H = static_cast<std::size_t>(s.num_kv_heads), C = static_cast<std::size_t>(s.capacity);
    for (auto& L : layers_) {
      L.k.assign(H * C * static_cast<std::size_t>(s.head_dim), T{});
      L.v.assign(L.k.size(), T{});
      L.pos.assign(H * C, -1);
      L.len.assign(H, 0);
    }
  }

  const CacheShape& shape() const noexcept { return shape_; }
  /// (kv_heads, capacity, head_dim) views of the whole buffers.
  TensorView<T, 3> keys(int l) noexcept { return view(layer(l).k); }
  TensorView<T, 3> values(int l) noexcept { return view(layer(l).v); }
  /// (kv_heads, capacity) logical positions.
  TensorView<std::int32_t, 2> positions(int l) noexcept {
    return TensorView<std::int32_t, 2>::contiguous(layer(l).pos.data(), {shape_.num_kv_heads, shape_.capacity});
  }
  std::int64_t length(int l, int h) const noexcept { return layers_[static_cast<std::size_t>(l)].len[static_cast<std::size_t>(h)]; }
  /// Length shared by every kv head; throws when the heads are ragged.
  std::int64_t uniform_length(int l) const {
    const auto& len = layers_[static_cast<std::size_t>(l)].len;
    for (auto n : len)
      if (n != len[0]) throw std::runtime_error("contiguous cache: kv heads of layer " + std::to_string(l) + " have different lengths");
    return len[0];
  }
  /// The keys of layer l as policies read them (requires equal head lengths).
  KVSource<T> key_source(int l) { return KVSource<T>::from(TensorView<const T, 3>(keys(l).narrow(1, 0, uniform_length(l)))); }
  KVSource<T> value_source(int l) { return KVSource<T>::from(TensorView<const T, 3>(values(l).narrow(1, 0, uniform_length(l)))); }
  std::int64_t kept_tokens(int l) const noexcept {
    std::int64_t n = 0;
    for (auto x : layers_[static_cast<std::size_t>(l)].len) n += x;
    return n;
  }

  /// Appends one token: k_rows / v_rows (kv_heads, head_dim) fp32, at logical position pos.
  void append(int l, const float* k_rows, const float* v_rows, std::int32_t pos) {
    auto& L = layer(l);
    const int d = shape_.head_dim;
    for (int h = 0; h < shape_.num_kv_heads; ++h) {
      const std::int64_t slot = L.len[static_cast<std::size_t>(h)];
      if (slot >= shape_.capacity) throw std::runtime_error("contiguous cache: layer " + std::to_string(l) + " is full");
      T* kd = &L.k[static_cast<std::size_t>((h * shape_.capacity + slot) * d)];
      T* vd = &L.v[static_cast<std::size_t>((h * shape_.capacity + slot) * d)];
      for (int i = 0; i < d; ++i) {
        kd[i] = kvpolicy::from_float<T>(k_rows[h * d + i]);
        vd[i] = kvpolicy::from_float<T>(v_rows[h * d + i]);
      }
      L.pos[static_cast<std::size_t>(h * shape_.capacity + slot)] = pos;
      ++L.len[static_cast<std::size_t>(h)];
    }
  }

  /// Decode attention of layer l: q (num_q_heads, head_dim) -> out (num_q_heads, head_dim).
  /// probs (optional): (num_q_heads, uniform_length) weights. No page selection on this layout.
  void attend(int l, const float* q, float* out, float* probs, const PageSelection* selection) {
    if (selection != nullptr) throw std::runtime_error("contiguous cache: page selection needs the paged cache");
    auto& L = layer(l);
    const int d = shape_.head_dim, G = shape_.num_q_heads / shape_.num_kv_heads;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    for (int h = 0; h < shape_.num_q_heads; ++h) {
      const int g = h / G;
      const std::int64_t n = L.len[static_cast<std::size_t>(g)];
      scratch_.resize(static_cast<std::size_t>(n));
      const T* kb = &L.k[static_cast<std::size_t>(g * shape_.capacity * d)];
      const T* vb = &L.v[static_cast<std::size_t>(g * shape_.capacity * d)];
      detail::attend_rows(
          q + h * d, d, n, scale, [&](std::int64_t j) { return kb + j * d; }, [&](std::int64_t j) { return vb + j * d; }, scratch_.data(),
          out + h * d);
      if (probs != nullptr) std::copy(scratch_.begin(), scratch_.end(), probs + h * n);
    }
  }

  /// Takes the per-head lengths of layer l after a caller compacted its buffers (keys, values, positions) in
  /// place itself (a composed policy such as kvpolicy::Compress, which merges and compacts in one step).
  /// Each length must be at most the head's current one.
  void adopt_lengths(int l, std::span<const std::int64_t> lens) {
    auto& L = layer(l);
    if (lens.size() != L.len.size()) throw std::runtime_error("contiguous cache: adopt_lengths needs one length per kv head");
    for (std::size_t h = 0; h < lens.size(); ++h)
      if (lens[h] < 0 || lens[h] > L.len[h]) throw std::runtime_error("contiguous cache: adopt_lengths grows a head or is negative");
    L.len.assign(lens.begin(), lens.end());
  }

  /// Applies keep rows [0, kv_heads) of `keep` (slot ids of this layer) in place.
  Status apply_keep(int l, const KeepSet& keep) {
    auto& L = layer(l);
    std::int64_t len = 0;
    for (auto x : L.len) len = std::max(len, x);
    // compact_contiguous reads rows < kv_len of every head; ragged heads only
    // ever keep ids below their own length, which check_keep_row enforces below.
    for (int h = 0; h < shape_.num_kv_heads; ++h)
      for (auto id : keep.row(h))
        if (id >= L.len[static_cast<std::size_t>(h)])
          return KVP_INVALID("engine: keep set row %d holds slot %d beyond the head's length %lld", h, id,
                             static_cast<long long>(L.len[static_cast<std::size_t>(h)]));
    std::vector<std::int64_t> new_lens(static_cast<std::size_t>(shape_.num_kv_heads));
    KVP_RETURN_IF_ERROR(kvpolicy::compact_contiguous<T>(keys(l), values(l), positions(l), len, keep, 0, new_lens));
    L.len = new_lens;
    return Status::ok();
  }

 private:
  struct Layer {
    std::vector<T> k, v;
    std::vector<std::int32_t> pos;
    std::vector<std::int64_t> len;
  };
  Layer& layer(int l) { return layers_.at(static_cast<std::size_t>(l)); }
  TensorView<T, 3> view(std::vector<T>& buf) noexcept {
    return TensorView<T, 3>::contiguous(buf.data(), {shape_.num_kv_heads, shape_.capacity, shape_.head_dim});
  }

  CacheShape shape_{};
  std::vector<Layer> layers_;
  std::vector<float> scratch_;
};

template <class T>
class PagedKVCache {
 public:
  using element_type = T;
  static constexpr bool kPaged = true;

  PagedKVCache() = default;
  /// A pool of ceil(capacity / page_size) pages per layer.
  PagedKVCache(const CacheShape& s, std::int32_t page_size)
      : shape_(s), page_size_(page_size), layers_(static_cast<std::size_t>(s.n_layers)) {
    if (page_size <= 0) throw std::runtime_error("paged cache: page_size must be > 0");
    num_pages_ = static_cast<std::int32_t>((s.capacity + page_size - 1) / page_size);
    const std::size_t page_elems = static_cast<std::size_t>(page_size) * static_cast<std::size_t>(s.num_kv_heads * s.head_dim);
    for (auto& L : layers_) {
      L.k.assign(page_elems * static_cast<std::size_t>(num_pages_), T{});
      L.v.assign(L.k.size(), T{});
      L.pos.assign(static_cast<std::size_t>(num_pages_) * static_cast<std::size_t>(s.num_kv_heads * page_size), -1);
      L.indptr = {0, 0};
      L.last_page_len = {0};
      // Free list popped from the back: hands out pages 0, P-1, 1, P-2, ... (a fixed scramble).
      std::vector<std::int32_t> order;
      for (std::int32_t i = 0, j = num_pages_ - 1; i <= j; ++i, --j) {
        order.push_back(i);
        if (i != j) order.push_back(j);
      }
      L.free.assign(order.rbegin(), order.rend());
    }
    for (int l = 0; l < s.n_layers; ++l) refresh(l);
  }
  // The page-table view points into this object's vectors: not copyable by memcpy semantics, so re-point on copy.
  PagedKVCache(const PagedKVCache& o) : shape_(o.shape_), page_size_(o.page_size_), num_pages_(o.num_pages_), layers_(o.layers_) {
    for (int l = 0; l < shape_.n_layers; ++l) refresh(l);
  }
  PagedKVCache& operator=(const PagedKVCache& o) {
    if (this != &o) {
      shape_ = o.shape_;
      page_size_ = o.page_size_;
      num_pages_ = o.num_pages_;
      layers_ = o.layers_;
      for (int l = 0; l < shape_.n_layers; ++l) refresh(l);
    }
    return *this;
  }

  const CacheShape& shape() const noexcept { return shape_; }
  std::int32_t page_size() const noexcept { return page_size_; }
  std::int32_t num_pages() const noexcept { return num_pages_; }
  /// The layer's paged view (batch of one sequence), valid until the next append / compaction.
  const PagedKVView<T>& view(int l) const noexcept { return layers_[static_cast<std::size_t>(l)].view; }
  const PagedKVView<const T>& const_view(int l) const noexcept { return layers_[static_cast<std::size_t>(l)].cview; }
  /// (num_pages, kv_heads, page_size) logical positions, indexed like the pool.
  TensorView<std::int32_t, 3> positions(int l) noexcept {
    return TensorView<std::int32_t, 3>::contiguous(layer(l).pos.data(), {num_pages_, shape_.num_kv_heads, page_size_});
  }
  std::int64_t length(int l, int /*h*/ = 0) const noexcept { return view(l).seq_len(0); }
  std::int64_t uniform_length(int l) const noexcept { return length(l); }
  KVSource<T> key_source(int l) const noexcept { return KVSource<T>::from_paged(const_view(l), 0); }
  /// The values of the same view (a paged source states which half of the pool it reads).
  KVSource<T> value_source(int l) const noexcept { return KVSource<T>::from_paged_values(const_view(l), 0); }
  std::int64_t kept_tokens(int l) const noexcept { return length(l) * shape_.num_kv_heads; }
  std::int64_t pages_in_use(int l) const noexcept { return layers_[static_cast<std::size_t>(l)].indices.size(); }

  void append(int l, const float* k_rows, const float* v_rows, std::int32_t pos) {
    auto& L = layer(l);
    const std::int64_t len = length(l);
    const auto slot = static_cast<std::int32_t>(len % page_size_);
    if (slot == 0) {
      if (L.free.empty()) throw std::runtime_error("paged cache: layer " + std::to_string(l) + " is out of pages");
      L.indices.push_back(L.free.back());
      L.free.pop_back();
      L.indptr[1] = static_cast<std::int32_t>(L.indices.size());
    }
    L.last_page_len[0] = slot + 1;
    refresh(l);
    const std::int32_t page = L.indices.back();
    const int d = shape_.head_dim;
    for (int h = 0; h < shape_.num_kv_heads; ++h) {
      T* kd = L.view.k_ptr(page, h, slot);
      T* vd = L.view.v_ptr(page, h, slot);
      for (int i = 0; i < d; ++i) {
        kd[i] = kvpolicy::from_float<T>(k_rows[h * d + i]);
        vd[i] = kvpolicy::from_float<T>(v_rows[h * d + i]);
      }
      positions(l)(page, h, slot) = pos;
    }
  }

  /// Decode attention of layer l. With `selection` (rows per query head or per
  /// kv head, FlashInfer CSR over this pool), head h attends only to its row's pages.
  void attend(int l, const float* q, float* out, float* probs, const PageSelection* selection) {
    const auto& L = layer(l);
    const int d = shape_.head_dim, G = shape_.num_q_heads / shape_.num_kv_heads;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    const std::int64_t n_all = length(l);
    if (selection != nullptr && selection->num_rows != shape_.num_q_heads && selection->num_rows != shape_.num_kv_heads)
      throw std::runtime_error("paged cache: page selection must have one row per query head or per kv head");
    for (int h = 0; h < shape_.num_q_heads; ++h) {
      const int g = h / G;
      const std::int32_t* pages = L.indices.data();
      std::int64_t n_pages = static_cast<std::int64_t>(L.indices.size());
      std::int32_t last_len = L.last_page_len[0];
      const std::int32_t* logical = nullptr;
      if (selection != nullptr) {
        const std::int64_t row = selection->num_rows == shape_.num_q_heads ? h : g;
        pages = selection->indices + selection->indptr[row];
        n_pages = selection->row_size(row);
        last_len = selection->last_page_len[row];
        logical = selection->logical != nullptr ? selection->logical + selection->indptr[row] : nullptr;
      }
      const std::int64_t n = n_pages == 0 ? 0 : (n_pages - 1) * page_size_ + last_len;
      scratch_.resize(static_cast<std::size_t>(n));
      auto at = [&](std::int64_t j, const T* base) {
        return base + pages[j / page_size_] * page_stride() + g * d + (j % page_size_) * slot_stride();
      };
      detail::attend_rows(
          q + h * d, d, n, scale, [&](std::int64_t j) { return at(j, L.k.data()); }, [&](std::int64_t j) { return at(j, L.v.data()); },
          scratch_.data(), out + h * d);
      if (probs != nullptr) {
        float* p = probs + h * n_all;
        if (selection == nullptr) {
          std::copy(scratch_.begin(), scratch_.end(), p);
        } else {
          if (logical == nullptr) throw std::runtime_error("paged cache: probabilities under a selection need PageSelection::logical");
          std::fill(p, p + n_all, 0.0f);
          for (std::int64_t j = 0; j < n; ++j)
            p[logical[j / page_size_] * page_size_ + j % page_size_] = scratch_[static_cast<std::size_t>(j)];
        }
      }
    }
  }

  /// Applies a keep set (row h = kv head h, equal counts) with compact_paged; freed pages return to the free list.
  Status apply_keep(int l, const KeepSet& keep) {
    auto& L = layer(l);
    std::vector<std::int32_t> freed(L.indices.size());
    kvpolicy::PagedCompactOutput out{L.indptr.data(),
                                     L.indices.data(),
                                     L.last_page_len.data(),
                                     static_cast<std::int64_t>(L.indices.size()),
                                     freed.data(),
                                     static_cast<std::int64_t>(freed.size()),
                                     0};
    std::vector<std::byte> ws(kvpolicy::compact_paged_workspace(L.view.num_pages));
    KVP_RETURN_IF_ERROR(kvpolicy::compact_paged<T>(L.view, keep, positions(l), out, kvpolicy::Workspace{ws.data(), ws.size()}));
    L.indices.resize(static_cast<std::size_t>(L.indptr[1]));
    for (std::int64_t i = out.num_freed - 1; i >= 0; --i) L.free.push_back(freed[static_cast<std::size_t>(i)]);
    refresh(l);
    return Status::ok();
  }

 private:
  struct Layer {
    std::vector<T> k, v;                      // (num_pages, page_size, kv_heads, head_dim)
    std::vector<std::int32_t> pos;            // (num_pages, kv_heads, page_size)
    std::vector<std::int32_t> indptr;         // (2)
    std::vector<std::int32_t> indices;        // pages of the sequence, logical order
    std::vector<std::int32_t> last_page_len;  // (1)
    std::vector<std::int32_t> free;           // free pages, next to hand out at the back
    PagedKVView<T> view{};
    PagedKVView<const T> cview{};
  };
  Layer& layer(int l) { return layers_.at(static_cast<std::size_t>(l)); }
  const Layer& layer(int l) const { return layers_.at(static_cast<std::size_t>(l)); }
  std::int64_t slot_stride() const noexcept { return static_cast<std::int64_t>(shape_.num_kv_heads) * shape_.head_dim; }
  std::int64_t page_stride() const noexcept { return slot_stride() * page_size_; }

  void refresh(int l) {
    auto& L = layer(l);
    const auto strides = kvpolicy::PageStrides::contiguous(kvpolicy::PageLayout::kNHD, shape_.num_kv_heads, page_size_, shape_.head_dim);
    L.view = PagedKVView<T>{L.k.data(), L.v.data(),      strides,
                            strides,    num_pages_,      shape_.num_kv_heads,
                            page_size_, shape_.head_dim, kvpolicy::PageTable{L.indptr.data(), L.indices.data(), L.last_page_len.data(), 1},
                            {}};
    L.cview = L.view;
  }

  CacheShape shape_{};
  std::int32_t page_size_ = 16, num_pages_ = 0;
  std::vector<Layer> layers_;
  std::vector<float> scratch_;
};

}  // namespace kvp_engine
