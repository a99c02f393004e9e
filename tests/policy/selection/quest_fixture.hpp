// Test fixture for the Quest / page-op tests: an owning paged cache (NHD or
// HND pool, shuffled page ids, ragged sequences) that grows by appends like
// an engine's, plus owning metadata and selection buffers and brute-force
// references computed straight from the keys.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "kvpolicy/core/page_selection.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/ops/scalar.hpp"

namespace quest_test {
using namespace kvpolicy;

/// A page pool plus per-sequence page lists; `view()` is the engine's view.
template <class T>
struct PagedCache {
  std::int32_t num_pages, kv_heads, page_size, head_dim;
  PageLayout layout;
  PageStrides strides;
  std::vector<T> k, v;
  std::vector<std::vector<std::int32_t>> seq_pages;
  std::vector<std::int64_t> seq_len;
  std::vector<std::int32_t> free_pages;
  std::vector<std::int32_t> indptr, indices, last;
  std::mt19937 rng;

  PagedCache(std::int32_t pages, std::int32_t heads, std::int32_t psize, std::int32_t dim, PageLayout lay, std::int32_t batch,
             unsigned seed)
      : num_pages(pages),
        kv_heads(heads),
        page_size(psize),
        head_dim(dim),
        layout(lay),
        strides(PageStrides::contiguous(lay, heads, psize, dim)),
        seq_pages(static_cast<std::size_t>(batch)),
        seq_len(static_cast<std::size_t>(batch), 0),
        rng(seed) {
    const std::size_t n = static_cast<std::size_t>(pages) * heads * psize * dim;
    k.assign(n, from_float<T>(std::nanf("")));  // unwritten slots are NaN: reading one would show
    v.assign(n, from_float<T>(std::nanf("")));
    free_pages.resize(static_cast<std::size_t>(pages));
    std::iota(free_pages.begin(), free_pages.end(), 0);
    std::shuffle(free_pages.begin(), free_pages.end(), rng);
    rebuild_table();
  }

  std::int32_t batch() const { return static_cast<std::int32_t>(seq_len.size()); }

  void rebuild_table() {
    indptr.assign(1, 0);
    indices.clear();
    last.clear();
    for (std::size_t b = 0; b < seq_pages.size(); ++b) {
      indices.insert(indices.end(), seq_pages[b].begin(), seq_pages[b].end());
      indptr.push_back(static_cast<std::int32_t>(indices.size()));
      const std::int64_t L = seq_len[b];
      last.push_back(L == 0 ? 0 : static_cast<std::int32_t>((L - 1) % page_size + 1));
    }
  }

  T* kp(std::int32_t page, std::int32_t h, std::int32_t slot) {
    return k.data() + page * strides.page + h * strides.head + slot * strides.slot;
  }
  T* vp(std::int32_t page, std::int32_t h, std::int32_t slot) {
    return v.data() + page * strides.page + h * strides.head + slot * strides.slot;
  }

  /// Appends n tokens with random keys (`gen(rng)` per value) to sequence b.
  template <class Gen>
  void append(std::int32_t b, std::int64_t n, Gen&& gen) {
    auto& sp = seq_pages[static_cast<std::size_t>(b)];
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t t = seq_len[static_cast<std::size_t>(b)]++;
      if (t % page_size == 0) {
        sp.push_back(free_pages.back());
        free_pages.pop_back();
      }
      const std::int32_t page = sp.back(), slot = static_cast<std::int32_t>(t % page_size);
      for (std::int32_t h = 0; h < kv_heads; ++h) {
        for (std::int32_t c = 0; c < head_dim; ++c) {
          kp(page, h, slot)[c] = from_float<T>(gen(rng));
          vp(page, h, slot)[c] = from_float<T>(gen(rng));
        }
      }
    }
    rebuild_table();
  }
  void append_normal(std::int32_t b, std::int64_t n, float sigma = 1.0f) {
    std::normal_distribution<float> nd(0.0f, sigma);
    append(b, n, [&](std::mt19937& r) { return nd(r); });
  }

  PageTable table() const { return PageTable{indptr.data(), indices.data(), last.data(), batch()}; }
  PagedKVView<const T> view() const {
    return PagedKVView<const T>{k.data(), v.data(), strides, strides, num_pages, kv_heads, page_size, head_dim, table(), kHost};
  }
  const T* key_row(std::int32_t b, std::int32_t h, std::int64_t t) const {
    const std::int32_t page = seq_pages[static_cast<std::size_t>(b)][static_cast<std::size_t>(t / page_size)];
    return k.data() + page * strides.page + h * strides.head + (t % page_size) * strides.slot;
  }
};

/// Owning metadata buffer (packed layout) initialised to a poison value.
template <class Tm>
struct MetaBuffer {
  std::vector<Tm> data;
  PageMetaView<Tm> view_;
  MetaBuffer(std::int32_t pages, std::int32_t heads, std::int32_t dim)
      : data(static_cast<std::size_t>(PageMetaView<Tm>::contiguous_size(pages, heads, dim)), from_float<Tm>(12345.0f)),
        view_(PageMetaView<Tm>::contiguous(data.data(), pages, heads, dim)) {}
  PageMetaView<Tm> view() { return view_; }
  PageMetaView<const Tm> cview() const { return view_; }
};

/// Owning PageSelection.
struct SelectionBuffer {
  std::vector<std::int32_t> indptr, indices, last, logical;
  SelectionBuffer(std::int64_t rows, std::int64_t capacity)
      : indptr(static_cast<std::size_t>(rows + 1), -7),
        indices(static_cast<std::size_t>(capacity), -7),
        last(static_cast<std::size_t>(rows), -7),
        logical(static_cast<std::size_t>(capacity), -7) {}
  PageSelection view(bool with_logical = true) {
    return PageSelection{indptr.data(),
                         indices.data(),
                         last.data(),
                         with_logical ? logical.data() : nullptr,
                         static_cast<std::int64_t>(last.size()),
                         static_cast<std::int64_t>(indices.size())};
  }
  std::vector<std::int32_t> row(std::int64_t r) const { return {indices.begin() + indptr[r], indices.begin() + indptr[r + 1]}; }
  std::vector<std::int32_t> row_logical(std::int64_t r) const { return {logical.begin() + indptr[r], logical.begin() + indptr[r + 1]}; }
  bool untouched() const {
    auto all7 = [](const std::vector<std::int32_t>& x) { return std::all_of(x.begin(), x.end(), [](std::int32_t v) { return v == -7; }); };
    return all7(indptr) && all7(indices) && all7(last) && all7(logical);
  }
};

/// Brute-force channel max / min of the keys of a page, straight from the keys.
template <class T>
void brute_minmax(const PagedCache<T>& c, std::int32_t b, std::int32_t h, std::int32_t lp, std::vector<float>& mx, std::vector<float>& mn) {
  mx.assign(static_cast<std::size_t>(c.head_dim), -INFINITY);
  mn.assign(static_cast<std::size_t>(c.head_dim), INFINITY);
  const std::int64_t t0 = static_cast<std::int64_t>(lp) * c.page_size;
  const std::int64_t t1 = std::min<std::int64_t>(t0 + c.page_size, c.seq_len[static_cast<std::size_t>(b)]);
  for (std::int64_t t = t0; t < t1; ++t) {
    const T* k = c.key_row(b, h, t);
    for (std::int32_t i = 0; i < c.head_dim; ++i) {
      mx[static_cast<std::size_t>(i)] = std::max(mx[static_cast<std::size_t>(i)], to_float(k[i]));
      mn[static_cast<std::size_t>(i)] = std::min(mn[static_cast<std::size_t>(i)], to_float(k[i]));
    }
  }
}

/// Reference top-k under the library's order (higher score, then higher index), ascending.
inline std::vector<std::int32_t> brute_topk(const std::vector<float>& s, std::int64_t k) {
  std::vector<std::int32_t> idx(s.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(), [&](std::int32_t a, std::int32_t b) {
    const auto ka = score_order_key(s[static_cast<std::size_t>(a)]), kb = score_order_key(s[static_cast<std::size_t>(b)]);
    return ka != kb ? ka > kb : a > b;
  });
  idx.resize(static_cast<std::size_t>(std::min<std::int64_t>(k, static_cast<std::int64_t>(s.size()))));
  std::sort(idx.begin(), idx.end());
  return idx;
}

/// Gap between the k-th and (k+1)-th best score (inf when k >= n): selections
/// computed with different rounding can only differ when it is tiny.
inline float boundary_gap(std::vector<float> s, std::int64_t k) {
  if (k <= 0 || k >= static_cast<std::int64_t>(s.size())) return INFINITY;
  std::sort(s.begin(), s.end(), std::greater<float>());
  return s[static_cast<std::size_t>(k - 1)] - s[static_cast<std::size_t>(k)];
}

}  // namespace quest_test
