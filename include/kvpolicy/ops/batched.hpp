// SPDX-License-Identifier: Apache-2.0
// Batched forms of the unit ops: one call over many (sequence, head) rows, so
// a device backend can run a policy step as one launch instead of one per
// head. Each form uses the backend's own batched member when it has one (same
// name, same arguments: `static void topk_rows(...)`), and otherwise the
// scalar default here: a parallel loop of the backend's unit op over the rows,
// each worker with its own workspace slice. Results never depend on which path
// ran or on the number of workers.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvpolicy/core/keep_set.hpp"
#include "kvpolicy/core/parallel.hpp"
#include "kvpolicy/core/workspace.hpp"

KVP_NAMESPACE_BEGIN
namespace ops {

/// Workspace of `topk_rows` for rows of at most `n` scores.
template <class B>
std::size_t topk_rows_workspace(std::int64_t n, const ExecContext& ctx) noexcept {
  if constexpr (requires { B::topk_rows_workspace(n, ctx); }) {
    return B::topk_rows_workspace(n, ctx);
  } else {
    return detail::WorkerSlices::bytes(B::topk_workspace(n < 1 ? 1 : n), ctx.workers());
  }
}

/// Rows [first_row, first_row + rows) of `out`: row r keeps the
/// `out.row_size(first_row + r)` best of `scores[r * ld .. r * ld + n)` under
/// `score_order_key`, ascending ids, at `out.indices + out.indptr[first_row + r]`
/// (indptr already written). `ws` holds `topk_rows_workspace<B>(n, ctx)` bytes.
template <class B>
void topk_rows(const float* scores, std::int64_t ld, std::int64_t rows, std::int64_t n, KeepSet& out, std::int64_t first_row, Workspace ws,
               const ExecContext& ctx) noexcept {
  if constexpr (requires { B::topk_rows(scores, ld, rows, n, out, first_row, ws, ctx); }) {
    B::topk_rows(scores, ld, rows, n, out, first_row, ws, ctx);
  } else {
    const auto slices = detail::WorkerSlices::carve(ws, B::topk_workspace(n < 1 ? 1 : n));
    ctx.parallel_for(rows, [&](std::int64_t r, int worker) {
      std::int32_t* dst = out.indices + out.indptr[first_row + r];
      const std::int64_t k = out.indptr[first_row + r + 1] - out.indptr[first_row + r];
      B::topk(scores + r * ld, n, k, dst, slices.slice(worker));
    });
  }
}

}  // namespace ops
KVP_NAMESPACE_END
