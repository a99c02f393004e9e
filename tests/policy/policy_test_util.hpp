// Helpers shared by the policy tests: random inputs in several layouts, an
// owning KeepSet, and one-call evict wrappers (sized by `requirements`).
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include "kvpolicy/core/keep_set.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/policy/policy.hpp"
#include "keep_set_buffer.hpp"

#define STATIC_ASSERT_POLICY(P)                                                                                       \
  static_assert(::kvpolicy::EvictionPolicy<P, ::kvpolicy::ScoreInput<float, float>>, #P " is not an EvictionPolicy"); \
  static_assert(::kvpolicy::EvictionPolicy<P, ::kvpolicy::ScoreInput<float, ::kvpolicy::half>>, #P " (fp16 keys)")

namespace kvp_test {
using namespace kvpolicy;

/// A page pool's strides and page count, from `fill_page_pool`.
struct PagePoolShape {
  PageStrides strides{};
  std::int32_t num_pages = 0;
};

/// Lays one sequence's rows value(h, t, c) (Hkv kv heads, T tokens, d channels) into a pool of `ps`-token pages
/// in `layout`: its page ids are the first of a permutation (mt19937 seeded with T) of pages + 3 pool pages, the
/// spare pages keep `fill`. Writes the pool, the ids and the one-sequence CSR offsets (indptr, last_page_len).
template <class Tp, class ValueFn>
PagePoolShape fill_page_pool(std::int64_t Hkv, std::int64_t T, std::int64_t d, std::int32_t ps, PageLayout layout, Tp fill, ValueFn value,
                             std::vector<Tp>& pool, std::vector<std::int32_t>& ids, std::vector<std::int32_t>& indptr,
                             std::vector<std::int32_t>& last) {
  const auto pages = static_cast<std::int32_t>((T + ps - 1) / ps), pool_pages = pages + 3;
  const PageStrides st = PageStrides::contiguous(layout, Hkv, ps, d);
  pool.assign(static_cast<std::size_t>(pool_pages) * static_cast<std::size_t>(st.page), fill);
  std::vector<std::int32_t> perm(static_cast<std::size_t>(pool_pages));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(static_cast<std::uint32_t>(T)));
  ids.assign(perm.begin(), perm.begin() + pages);
  indptr = {0, pages};
  last = {static_cast<std::int32_t>(T - static_cast<std::int64_t>(pages - 1) * ps)};
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t h = 0; h < Hkv; ++h)
      for (std::int64_t c = 0; c < d; ++c)
        pool[static_cast<std::size_t>(ids[static_cast<std::size_t>(t / ps)] * st.page + (t % ps) * st.slot + h * st.head + c)] =
            value(h, t, c);
  return {st, pool_pages};
}

/// The one-sequence view of pools laid out by `fill_page_pool` (keys `k`, values `v` or null, sharing the page
/// ids); the pointers are `dev`'s memory, the CSR offsets host arrays.
template <class Tp>
PagedKVView<const Tp> page_pool_view(const Tp* k, const Tp* v, const PagePoolShape& shape, std::int64_t Hkv, std::int32_t ps,
                                     std::int64_t d, const std::int32_t* indptr, const std::int32_t* ids, const std::int32_t* last,
                                     Device dev) {
  return PagedKVView<const Tp>{k,
                               v,
                               shape.strides,
                               shape.strides,
                               shape.num_pages,
                               static_cast<std::int32_t>(Hkv),
                               ps,
                               static_cast<std::int32_t>(d),
                               PageTable{indptr, ids, last, 1},
                               dev};
}

/// Random queries (Hq, w, d) fp32 and keys (Hkv, T, d) of type Tk, with a few
/// heavy keys so that scores are not flat.
template <class Tk>
struct RandomCase {
  std::int64_t Hq, Hkv, T, d, w;
  std::vector<float> queries;  // (Hq, w, d)
  std::vector<float> keys;     // (Hkv, T, d) fp32 master copy (tests may poke values)
  mutable std::vector<Tk> keys_t, strided_keys, pool;
  mutable std::vector<float> strided_q;
  mutable std::vector<std::int32_t> indptr, indices, last;
  mutable PagedKVView<const Tk> paged{};

  RandomCase(std::int64_t hq, std::int64_t hkv, std::int64_t t, std::int64_t dd, std::int64_t ww, unsigned seed)
      : Hq(hq), Hkv(hkv), T(t), d(dd), w(ww), queries(hq * ww * dd), keys(hkv * t * dd) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    for (auto& x : queries) x = nd(rng);
    for (auto& x : keys) x = nd(rng) * 0.5f;
    std::uniform_int_distribution<std::int64_t> pick(0, std::max<std::int64_t>(t - 1, 0));
    for (int k = 0; k < 4 && t > 0; ++k) {  // heavy hitters aligned with a query direction
      const std::int64_t j = pick(rng);
      for (std::int64_t h = 0; h < hkv; ++h)
        for (std::int64_t c = 0; c < dd; ++c) keys[(h * t + j) * dd + c] += queries[(h * (hq / hkv)) * ww * dd + c] * 0.7f;
    }
  }

  ScoreInput<float, Tk> input() const {
    keys_t.resize(keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) keys_t[i] = from_float<Tk>(keys[i]);
    return {TensorView<const float, 3>::contiguous(queries.data(), {Hq, w, d}),
            KVSource<Tk>::from(TensorView<const Tk, 3>::contiguous(keys_t.data(), {Hkv, T, d}))};
  }

  /// Keys stored (capacity, Hkv, d + pad) token-major; queries (w, Hq, d + pad).
  ScoreInput<float, Tk> strided_input() const {
    const std::int64_t pad = 8, cap = T + 5, dp = d + pad;
    strided_keys.assign(cap * Hkv * dp, from_float<Tk>(1e6f));
    for (std::int64_t h = 0; h < Hkv; ++h)
      for (std::int64_t t = 0; t < T; ++t)
        for (std::int64_t c = 0; c < d; ++c) strided_keys[(t * Hkv + h) * dp + c] = from_float<Tk>(keys[(h * T + t) * d + c]);
    strided_q.assign(w * Hq * dp, 1e6f);
    for (std::int64_t h = 0; h < Hq; ++h)
      for (std::int64_t i = 0; i < w; ++i)
        for (std::int64_t c = 0; c < d; ++c) strided_q[(i * Hq + h) * dp + c] = queries[(h * w + i) * d + c];
    return {TensorView<const float, 3>(strided_q.data(), {Hq, w, d}, {dp, Hq * dp, 1}),
            KVSource<Tk>::from(TensorView<const Tk, 3>(strided_keys.data(), {Hkv, T, d}, {dp, Hkv * dp, 1}))};
  }

  /// Keys in an NHD page pool with shuffled page ids and spare pages. `dev`
  /// tags the queries and the pool (page ids included) as that device's
  /// memory (an emulated device's); the CSR offsets stay host arrays.
  ScoreInput<float, Tk> paged_input(std::int32_t ps, Device dev = kHost) const {
    const auto key = [&](std::int64_t h, std::int64_t t, std::int64_t c) { return from_float<Tk>(keys[(h * T + t) * d + c]); };
    const PagePoolShape shape = fill_page_pool(Hkv, T, d, ps, PageLayout::kNHD, from_float<Tk>(-1e6f), key, pool, indices, indptr, last);
    paged = page_pool_view<Tk>(pool.data(), nullptr, shape, Hkv, ps, d, indptr.data(), indices.data(), last.data(), dev);
    return {TensorView<const float, 3>::contiguous(queries.data(), {Hq, w, d}, dev), KVSource<Tk>::from_paged(paged, 0)};
  }
};

template <class Backend, class Policy, class Tq, class Tk>
KeepSetBuffer run_evict_batch(const Policy& p, const std::vector<ScoreInput<Tq, Tk>>& batch, const ExecContext& ctx = {}) {
  ProblemShape shape{batch[0].queries.extent(0), batch[0].keys.kv_heads(), batch[0].keys.head_dim(), 0, batch[0].queries.extent(1)};
  std::int64_t total = 0;
  for (const auto& in : batch) {
    shape.max_kv_len = std::max(shape.max_kv_len, in.keys.kv_len());
    total += std::max<std::int64_t>(p.kept_count(in.keys.kv_len()), 0) * in.keys.kv_heads();
  }
  shape.batch = static_cast<std::int64_t>(batch.size());
  KeepSetBuffer keep(static_cast<std::int64_t>(batch.size()) * shape.num_kv_heads, std::max<std::int64_t>(total, 1));
  const Requirements req = p.requirements(Context<Backend>{{}, ctx}, shape);
  INFO(req.status.message());
  REQUIRE(req.status.is_ok());
  REQUIRE(req.output.rows == keep.view().num_rows);
  REQUIRE(req.output.capacity >= total);
  std::vector<std::byte> ws(req.workspace_bytes);
  const Status s = p.evict(Context<Backend>{Workspace{ws.data(), ws.size()}, ctx}, std::span<const ScoreInput<Tq, Tk>>(batch), keep.view());
  INFO(s.message());
  REQUIRE(s.is_ok());
  return keep;
}

template <class Backend, class Policy, class Tq, class Tk>
KeepSetBuffer run_evict(const Policy& p, const ScoreInput<Tq, Tk>& in, const ExecContext& ctx = {}) {
  return run_evict_batch<Backend>(p, std::vector<ScoreInput<Tq, Tk>>{in}, ctx);
}

}  // namespace kvp_test

using namespace kvp_test;
