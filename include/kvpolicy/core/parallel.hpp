// SPDX-License-Identifier: Apache-2.0
// Execution context: an optional parallel-for hook through which an engine
// lends its own thread pool. Default: sequential on the calling thread.
// Work items are independent (one per (sequence, kv head) for the policies),
// and each carries its own workspace slice, so results never depend on the
// number of workers or on scheduling.
#pragma once

#include <cstdint>
#include <utility>

#include "kvpolicy/core/collective.hpp"
#include "kvpolicy/core/version.hpp"

KVP_NAMESPACE_BEGIN

/// body(ctx, begin, end, worker): process items [begin, end) using per-worker
/// scratch slot `worker` (0 <= worker < num_workers).
using ParallelBody = void (*)(void* ctx, std::int64_t begin, std::int64_t end, int worker);

/// An engine's parallel-for: must call `body` over a partition of [0, n)
/// with worker ids in [0, num_workers), each worker id used by at most one
/// thread at a time within the call (worker ids index the call's workspace
/// slices; concurrent calls have workspaces of their own), and return after
/// all calls finished. The library calls
/// it from whatever thread calls the library, so an `ExecContext` shared by
/// several threads needs a pool that is safe for concurrent callers (the
/// bundled `ThreadPool`, util/thread_pool.hpp, serialises their jobs).
using ParallelForFn = void (*)(void* pool, std::int64_t n, ParallelBody body, void* body_ctx);

struct ExecContext {
  ParallelForFn parallel_for_fn = nullptr;  ///< nullptr: sequential
  void* pool = nullptr;
  int num_workers = 1;  ///< upper bound on distinct worker ids
  /// Tensor parallelism: this rank's heads and the engine's collective
  /// (core/collective.hpp). nullptr: the call holds every head of the layer.
  const HeadShard* shard = nullptr;

  int workers() const noexcept { return parallel_for_fn ? (num_workers < 1 ? 1 : num_workers) : 1; }

  /// Run f(i, worker) for every i in [0, n).
  template <class F>
  void parallel_for(std::int64_t n, F&& f) const {
    if (n <= 0) return;
    auto thunk = [](void* ctx, std::int64_t b, std::int64_t e, int w) {
      auto& fn = *static_cast<std::remove_reference_t<F>*>(ctx);
      for (std::int64_t i = b; i < e; ++i) fn(i, w);
    };
    if (parallel_for_fn == nullptr || n == 1) {
      thunk(static_cast<void*>(&f), 0, n, 0);
    } else {
      parallel_for_fn(pool, n, thunk, static_cast<void*>(&f));
    }
  }
};

KVP_NAMESPACE_END
