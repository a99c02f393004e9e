// Shared helpers of the prefetch tests: a small owning paged pool (NHD,
// explicit page ids per sequence), owning requests and selections, and the
// owning state builders of the four policies.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "kvpolicy/core/page_selection.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/policy/decisions.hpp"
#include "kvpolicy/policy/prefetch/infinigen.hpp"
#include "kvpolicy/policy/prefetch/quest_lookahead.hpp"
#include "kvpolicy/policy/prefetch/shadowkv.hpp"
#include "kvpolicy/policy/prefetch/specache.hpp"

namespace prefetch_test {
using namespace kvpolicy;

/// A pool of `num_pages` pages (NHD) and a batch of sequences with given page lists.
struct Pool {
  std::int32_t num_pages, kv_heads, page_size, head_dim;
  std::vector<float> k, v;
  std::vector<std::int32_t> indptr{0}, indices, last;

  Pool(std::int32_t pages, std::int32_t heads, std::int32_t psize, std::int32_t dim)
      : num_pages(pages),
        kv_heads(heads),
        page_size(psize),
        head_dim(dim),
        k(static_cast<std::size_t>(pages) * psize * heads * dim, 0.0f),
        v(k.size(), 0.0f) {}

  /// Appends a sequence of `len` tokens on `pages` (logical order).
  void add_sequence(const std::vector<std::int32_t>& pages, std::int64_t len) {
    indices.insert(indices.end(), pages.begin(), pages.end());
    indptr.push_back(static_cast<std::int32_t>(indices.size()));
    last.push_back(static_cast<std::int32_t>(len - (static_cast<std::int64_t>(pages.size()) - 1) * page_size));
  }
  PageTable table() const { return PageTable{indptr.data(), indices.data(), last.data(), static_cast<std::int32_t>(last.size())}; }
  PagedKVView<float> view() {
    const auto s = PageStrides::contiguous(PageLayout::kNHD, kv_heads, page_size, head_dim);
    return PagedKVView<float>{k.data(), v.data(), s, s, num_pages, kv_heads, page_size, head_dim, table(), {}};
  }
  PagedKVView<const float> cview() { return view(); }
  /// Key row of token t of sequence b, kv head g.
  float* key(std::int32_t b, std::int32_t g, std::int64_t t) { return view().key(b, g, t); }
  void fill_random(unsigned seed, float lo = -1.0f, float hi = 1.0f) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(lo, hi);
    for (auto& x : k) x = u(rng);
    for (auto& x : v) x = u(rng);
  }
  /// Integer-valued keys in [-r, r] (bounds and dot products exact in fp32).
  void fill_integers(unsigned seed, int r = 4) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> u(-r, r);
    for (auto& x : k) x = static_cast<float>(u(rng));
    for (auto& x : v) x = static_cast<float>(u(rng));
  }
};

/// An owning PrefetchRequest.
struct Request {
  std::vector<std::int32_t> pages;
  std::vector<float> priority;
  PrefetchRequest req{};
  explicit Request(std::int64_t capacity)
      : pages(static_cast<std::size_t>(capacity), -7), priority(static_cast<std::size_t>(capacity), -7.0f) {
    req = PrefetchRequest{pages.data(), priority.data(), capacity, 0};
  }
  std::vector<std::int32_t> list() const { return {pages.begin(), pages.begin() + req.size}; }
};

/// An owning PageSelection from explicit rows.
using PageRows = std::vector<std::vector<std::int32_t>>;

struct Selection {
  std::vector<std::int32_t> indptr{0}, indices, last;
  PageSelection sel{};
  explicit Selection(const PageRows& rows) {
    for (const auto& r : rows) {
      indices.insert(indices.end(), r.begin(), r.end());
      indptr.push_back(static_cast<std::int32_t>(indices.size()));
      last.push_back(r.empty() ? 0 : 1);
    }
    sel = PageSelection{indptr.data(),
                        indices.data(),
                        last.data(),
                        nullptr,
                        static_cast<std::int64_t>(rows.size()),
                        static_cast<std::int64_t>(indices.size())};
  }
};

/// Owning workspace sized by a policy's requirements.
struct Scratch {
  std::vector<std::byte> buf;
  template <class B>
  Context<B> context(std::size_t bytes) {
    buf.assign(bytes + 64, std::byte{0});
    return Context<B>{Workspace{buf.data(), buf.size()}, {}};
  }
};

struct HistoryBuf {
  std::vector<std::int64_t> buf;
  PrefetchHistory make(std::int32_t num_pages) {
    buf.assign(static_cast<std::size_t>(PrefetchHistory::buffer_size(num_pages)), 0);
    return PrefetchHistory::over(buf.data(), num_pages);
  }
};

struct InfiniGenBuf {
  std::vector<float> floats;
  std::vector<std::int32_t> ints;
  std::vector<std::int64_t> hist;
  InfiniGenState st{};
  /// `device` not host: the buffers are tagged as a device's (an emulated device reads them), the history left to `reset(ctx)`.
  InfiniGenBuf(const InfiniGen& p, const Pool& pool, Device device = {}) {
    const auto n = p.state_size(pool.num_pages, pool.page_size, pool.kv_heads, pool.head_dim);
    floats.assign(static_cast<std::size_t>(n.floats), 0.0f);
    ints.assign(static_cast<std::size_t>(n.ints), 0);
    hist.assign(static_cast<std::size_t>(n.history), 0);
    (void)p.make_state(floats.data(), ints.data(), hist.data(), pool.num_pages, pool.page_size, pool.kv_heads, pool.head_dim, &st, device);
  }
};

struct SpeCacheBuf {
  std::vector<std::uint8_t> codes;
  std::vector<std::int64_t> hist;
  SpeCacheState st{};
  /// `device` not host: the buffers are tagged as a device's (an emulated device reads them), the history left to `reset(ctx)`.
  SpeCacheBuf(const SpeCache& p, const Pool& pool, Device device = {}) {
    codes.assign(static_cast<std::size_t>(p.codes_bytes(pool.num_pages, pool.page_size, pool.kv_heads, pool.head_dim)), 0);
    hist.assign(static_cast<std::size_t>(PrefetchHistory::buffer_size(pool.num_pages)), 0);
    (void)p.make_state(codes.data(), hist.data(), pool.num_pages, pool.page_size, pool.kv_heads, pool.head_dim, &st, device);
  }
};

struct ShadowKVBuf {
  std::vector<float> floats;
  std::vector<std::int64_t> hist;
  ShadowKVState st{};
  /// `device` not host: the buffers are tagged as a device's (an emulated device reads them), the history left to `reset(ctx)`.
  ShadowKVBuf(const ShadowKV& p, const Pool& pool, Device device = {}) {
    const auto n = p.state_size(pool.num_pages, pool.page_size, pool.kv_heads, pool.head_dim);
    floats.assign(static_cast<std::size_t>(n.floats), 0.0f);
    hist.assign(static_cast<std::size_t>(n.history), 0);
    (void)p.make_state(floats.data(), hist.data(), pool.num_pages, pool.page_size, pool.kv_heads, pool.head_dim, &st, device);
  }
};

/// Owning Quest metadata over a pool, rebuilt from its keys.
struct QuestMeta {
  std::vector<float> buf;
  PageMetaView<float> meta{};
  template <class B = backend::Scalar>
  explicit QuestMeta(Pool& pool) {
    buf.assign(static_cast<std::size_t>(PageMetaView<float>::contiguous_size(pool.num_pages, pool.kv_heads, pool.head_dim)), 0.0f);
    meta = PageMetaView<float>::contiguous(buf.data(), pool.num_pages, pool.kv_heads, pool.head_dim);
    const Quest q;
    (void)q.on_append(Context<B>{}, AppendInput<float>{pool.cview(), nullptr}, meta);
  }
};

}  // namespace prefetch_test
