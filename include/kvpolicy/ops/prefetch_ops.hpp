// SPDX-License-Identifier: Apache-2.0
// The prefetch family's bookkeeping as ops, so a device backend predicts and
// observes without a host round trip (policy/prefetch/history.hpp states the
// semantics; these are its loops, written once).
//
// A history of a pool of P pages is one int64 buffer of P * 2 + 2 elements:
//   [0, P)       predicted_at  serial of the last prediction naming the page (-1: never)
//   [P, 2P)      used_at       last observation that read the page (-1: never)
//   [2P, 2P + 2) pending       {pages of the current prediction, of those the
//                              ones the previous observation had not read}
// The counters the host knows (observation step, prediction serial, the
// target of the current prediction) stay host values; everything that
// depends on page ids is in the buffer, device memory on a device backend.
//
//   prefetch_history_reset  stamps -1, pending 0.
//   prefetch_votes          counts[e] = how many of `rows` selection rows name
//                           table entry e (logical page index of one sequence).
//   prefetch_vote_priorities  prio[e] = unit added counts[e] times in fp32
//                           (the host's order, so the same bits), else the
//                           reuse priority when the previous observation read
//                           the entry's page, else NaN (not predicted).
//   prefetch_add_reuse      prio[e] = the reuse priority where prio[e] is NaN
//                           and the previous observation read the entry's page.
//   prefetch_write_request  the entries with a priority, most urgent first
//                           (score_order_key descending, ties: the later
//                           entry), a page listed once at its most urgent
//                           entry; pages past the request's size are -1
//                           (priorities NaN) up to E, so a consumer kernel
//                           needs no host size.
//   prefetch_observe        the hit-rate counters of one observation, added
//                           into `counters` (device memory on a device).
//
// Each `ops::prefetch_*<B>` calls the backend's member when it has one
// (backend::Cuda: device memory throughout) and the host reference below
// otherwise (the host backends, and the emulated device of the tests).
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "kvpolicy/core/workspace.hpp"
#include "kvpolicy/ops/order_key.hpp"
#include "kvpolicy/policy/decisions.hpp"
#include "kvpolicy/quant/ggml.hpp"

KVP_NAMESPACE_BEGIN

/// The prefetch family's ops as a backend's own members (what a device
/// backend provides; host backends use the references above through the
/// `ops::prefetch_*` dispatchers below).
template <class B>
concept PrefetchOps = requires(std::int64_t* buf, const std::int64_t* cbuf, std::int32_t n32, std::int64_t n, const std::int32_t* cids,
                               std::int32_t* ids, const float* cx, float* x, PrefetchCounters* counters, Workspace ws) {
  B::prefetch_history_reset(buf, n32);
  B::prefetch_votes(cids, n, n, n, n, ids);
  B::prefetch_vote_priorities(cids, cids, n, 1.0f, cbuf, n, 0.0f, x);
  { B::prefetch_request_workspace(n) } -> std::same_as<std::size_t>;
  B::prefetch_write_request(cx, cids, n, buf, cbuf, buf, n, n, ids, x, buf, ws);
  B::prefetch_observe(cids, n, buf, cbuf, cbuf, n, true, n, counters);
};

namespace ops {

/// Chunk geometry of ShadowKV's state (ops/shadowkv_ops.hpp): chunk ch of a
/// sequence whose page ids are seq_pages has state slot `slot(seq_pages, ch, g)`
/// for kv head g (`ShadowKVState::slot`).
struct ChunkGeometry {
  std::int32_t page_size = 0, chunk_size = 0, num_kv_heads = 0, head_dim = 0;
  KVP_HOST_DEVICE std::int32_t chunks_per_page() const noexcept { return page_size / chunk_size; }
  KVP_HOST_DEVICE std::int64_t slot(const std::int32_t* seq_pages, std::int64_t ch, std::int32_t g) const noexcept {
    const std::int32_t cpp = chunks_per_page();
    return (static_cast<std::int64_t>(seq_pages[ch / cpp]) * cpp + ch % cpp) * num_kv_heads + g;
  }
};

/// SpeCache's low-bit key copy (ops/specache_ops.hpp): rows of `row_bytes`
/// (head_dim / 32 ggml blocks of `type`) indexed (page, kv head, slot), as
/// `SpeCacheState::row`; token t of a sequence whose page ids are seq_pages.
struct KeyCopyGeometry {
  std::int32_t page_size = 0, num_kv_heads = 0, head_dim = 0;
  std::int64_t row_bytes = 0;
  GgmlType type = GgmlType::kQ4_0;
  KVP_HOST_DEVICE std::int64_t offset(const std::int32_t* seq_pages, std::int64_t t, std::int32_t g) const noexcept {
    const std::int64_t page = seq_pages[t / page_size];
    return ((page * num_kv_heads + g) * page_size + t % page_size) * row_bytes;
  }
};

/// InfiniGen's partial key cache (ops/infinigen_ops.hpp): rows of
/// `partial_dim` floats indexed (page, kv head, slot), as `InfiniGenState::key_row`.
struct PartialKeyGeometry {
  std::int32_t page_size = 0, num_kv_heads = 0, head_dim = 0, partial_dim = 0;
  KVP_HOST_DEVICE std::int64_t offset(const std::int32_t* seq_pages, std::int64_t t, std::int32_t g) const noexcept {
    const std::int64_t page = seq_pages[t / page_size];
    return ((page * num_kv_heads + g) * page_size + t % page_size) * partial_dim;
  }
};

namespace prefetch_ref {

inline void history_reset(std::int64_t* buf, std::int32_t num_pages) noexcept {
  const std::int64_t n = 2 * static_cast<std::int64_t>(std::max(num_pages, 0));
  std::fill(buf, buf + n, std::int64_t{-1});
  buf[n] = 0;
  buf[n + 1] = 0;
}

inline void votes(const std::int32_t* logical, std::int64_t rows, std::int64_t row_len, std::int64_t ld, std::int64_t entries,
                  std::int32_t* counts) noexcept {
  std::fill(counts, counts + entries, 0);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t i = 0; i < row_len; ++i) ++counts[logical[r * ld + i]];
}

inline void vote_priorities(const std::int32_t* counts, const std::int32_t* entry_pages, std::int64_t entries, float unit,
                            const std::int64_t* used_at, std::int64_t reuse_step, float reuse_priority, float* prio) noexcept {
  for (std::int64_t e = 0; e < entries; ++e) {
    const std::int32_t c = counts[e];
    float v = std::numeric_limits<float>::quiet_NaN();
    if (c > 0) {
      v = 0.0f;
      for (std::int32_t j = 0; j < c; ++j) v += unit;
    } else if (reuse_step >= 0 && used_at[entry_pages[e]] == reuse_step) {
      v = reuse_priority;
    }
    prio[e] = v;
  }
}

inline void add_reuse(float* prio, const std::int32_t* entry_pages, std::int64_t entries, const std::int64_t* used_at,
                      std::int64_t reuse_step, float reuse_priority) noexcept {
  for (std::int64_t e = 0; e < entries; ++e)
    if (std::isnan(prio[e]) && used_at[entry_pages[e]] == reuse_step) prio[e] = reuse_priority;
}

inline std::size_t request_workspace(std::int64_t entries) noexcept {
  return WorkspacePlan{}.add<std::uint64_t>(static_cast<std::size_t>(std::max<std::int64_t>(entries, 0))).total();
}

inline void write_request(const float* prio, const std::int32_t* entry_pages, std::int64_t entries, std::int64_t* predicted_at,
                          const std::int64_t* used_at, std::int64_t* pending, std::int64_t target, std::int64_t serial,
                          std::int32_t* out_pages, float* out_priority, std::int64_t* out_size, std::uint64_t* keys) noexcept {
  std::int64_t m = 0;
  for (std::int64_t i = 0; i < entries; ++i)
    if (!std::isnan(prio[i])) keys[m++] = (static_cast<std::uint64_t>(score_order_key(prio[i])) << 32) | static_cast<std::uint64_t>(i);
  std::sort(keys, keys + m, [](std::uint64_t a, std::uint64_t b) { return a > b; });
  std::int64_t size = 0, fresh = 0;
  for (std::int64_t j = 0; j < m; ++j) {
    const auto i = static_cast<std::int64_t>(keys[j] & 0xffffffffu);
    const std::int32_t p = entry_pages[i];
    if (predicted_at[p] == serial) continue;
    predicted_at[p] = serial;
    if (!(target >= 1 && used_at[p] == target - 1)) ++fresh;
    out_pages[size] = p;
    if (out_priority != nullptr) out_priority[size] = prio[i];
    ++size;
  }
  for (std::int64_t j = size; j < entries; ++j) {
    out_pages[j] = -1;
    if (out_priority != nullptr) out_priority[j] = std::numeric_limits<float>::quiet_NaN();
  }
  pending[0] = size;
  pending[1] = fresh;
  if (out_size != nullptr) *out_size = size;
}

inline void observe(const std::int32_t* pages, std::int64_t n, std::int64_t* used_at, const std::int64_t* predicted_at,
                    const std::int64_t* pending, std::int64_t step, bool has_prediction, std::int64_t serial,
                    PrefetchCounters* counters) noexcept {
  PrefetchCounters d;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int32_t p = pages[i];
    if (used_at[p] == step) continue;  // another row (head, sequence) already read it
    const bool prev = step >= 1 && used_at[p] == step - 1;
    const bool pred = has_prediction && predicted_at[p] == serial;
    ++d.needed;
    if (has_prediction) ++(pred ? d.hits : d.misses);
    if (step >= 1) {
      ++d.reuse_total;
      if (prev) ++d.reused;
    }
    if (!prev && !pred) ++d.late;
    used_at[p] = step;
  }
  if (has_prediction) {
    d.predicted = pending[0];
    d.wasted = pending[0] - d.hits;
    d.predicted_steps = 1;
  }
  d.transferred = (has_prediction ? pending[1] : 0) + d.late;
  d.steps = 1;
  *counters += d;
}

}  // namespace prefetch_ref

/// Stamps of a `num_pages` history buffer to -1, its pending counts to 0.
template <class B>
void prefetch_history_reset(std::int64_t* buf, std::int32_t num_pages) noexcept {
  if constexpr (requires { B::prefetch_history_reset(buf, num_pages); })
    B::prefetch_history_reset(buf, num_pages);
  else
    prefetch_ref::history_reset(buf, num_pages);
}

/// counts[0..entries) = 0, then +1 per logical[r * ld + i] (r < rows, i < row_len; each < entries).
template <class B>
void prefetch_votes(const std::int32_t* logical, std::int64_t rows, std::int64_t row_len, std::int64_t ld, std::int64_t entries,
                    std::int32_t* counts) noexcept {
  if constexpr (requires { B::prefetch_votes(logical, rows, row_len, ld, entries, counts); })
    B::prefetch_votes(logical, rows, row_len, ld, entries, counts);
  else
    prefetch_ref::votes(logical, rows, row_len, ld, entries, counts);
}

/// Priorities from vote counts (file comment); reuse_step < 0: no reuse.
template <class B>
void prefetch_vote_priorities(const std::int32_t* counts, const std::int32_t* entry_pages, std::int64_t entries, float unit,
                              const std::int64_t* used_at, std::int64_t reuse_step, float reuse_priority, float* prio) noexcept {
  if constexpr (requires { B::prefetch_vote_priorities(counts, entry_pages, entries, unit, used_at, reuse_step, reuse_priority, prio); })
    B::prefetch_vote_priorities(counts, entry_pages, entries, unit, used_at, reuse_step, reuse_priority, prio);
  else
    prefetch_ref::vote_priorities(counts, entry_pages, entries, unit, used_at, reuse_step, reuse_priority, prio);
}

/// Entries not predicted (NaN) whose page observation `reuse_step` read get `reuse_priority`.
template <class B>
void prefetch_add_reuse(float* prio, const std::int32_t* entry_pages, std::int64_t entries, const std::int64_t* used_at,
                        std::int64_t reuse_step, float reuse_priority) noexcept {
  if constexpr (requires { B::prefetch_add_reuse(prio, entry_pages, entries, used_at, reuse_step, reuse_priority); })
    B::prefetch_add_reuse(prio, entry_pages, entries, used_at, reuse_step, reuse_priority);
  else
    prefetch_ref::add_reuse(prio, entry_pages, entries, used_at, reuse_step, reuse_priority);
}

/// Workspace bytes of `prefetch_write_request` over `entries` entries.
template <class B>
std::size_t prefetch_request_workspace(std::int64_t entries) noexcept {
  if constexpr (requires { B::prefetch_request_workspace(entries); })
    return B::prefetch_request_workspace(entries);
  else
    return prefetch_ref::request_workspace(entries);
}

/// The request of priorities `prio` over table entries whose pages are
/// `entry_pages` (file comment); marks `predicted_at` with `serial`, writes
/// `pending`; `out_priority` and `out_size` may be null.
template <class B>
void prefetch_write_request(const float* prio, const std::int32_t* entry_pages, std::int64_t entries, std::int64_t* predicted_at,
                            const std::int64_t* used_at, std::int64_t* pending, std::int64_t target, std::int64_t serial,
                            std::int32_t* out_pages, float* out_priority, std::int64_t* out_size, Workspace ws) noexcept {
  if constexpr (requires {
                  B::prefetch_write_request(prio, entry_pages, entries, predicted_at, used_at, pending, target, serial, out_pages,
                                            out_priority, out_size, ws);
                })
    B::prefetch_write_request(prio, entry_pages, entries, predicted_at, used_at, pending, target, serial, out_pages, out_priority, out_size,
                              ws);
  else
    prefetch_ref::write_request(prio, entry_pages, entries, predicted_at, used_at, pending, target, serial, out_pages, out_priority,
                                out_size,
                                WorkspaceCarver(ws).take<std::uint64_t>(static_cast<std::size_t>(std::max<std::int64_t>(entries, 0))));
}

/// Counts observation `step` reading pages[0..n) into `*counters` and stamps `used_at` (file comment).
template <class B>
void prefetch_observe(const std::int32_t* pages, std::int64_t n, std::int64_t* used_at, const std::int64_t* predicted_at,
                      const std::int64_t* pending, std::int64_t step, bool has_prediction, std::int64_t serial,
                      PrefetchCounters* counters) noexcept {
  if constexpr (requires { B::prefetch_observe(pages, n, used_at, predicted_at, pending, step, has_prediction, serial, counters); })
    B::prefetch_observe(pages, n, used_at, predicted_at, pending, step, has_prediction, serial, counters);
  else
    prefetch_ref::observe(pages, n, used_at, predicted_at, pending, step, has_prediction, serial, counters);
}

}  // namespace ops
KVP_NAMESPACE_END
