// SPDX-License-Identifier: Apache-2.0
// A layer-wide top-k over heads that live on different ranks (tensor
// parallelism), without gathering the scores.
//
// Ada-KV's budget is global over a layer's heads: the layer keeps its k best
// (score, head, token) candidates. When the heads are sharded, each rank holds
// the candidates of its heads only. `sharded_cut` finds, with a few small
// collectives, where the global order cuts this rank's candidates, so every
// rank selects exactly the candidates a single process would select from all
// of them, ties included.
//
// The order is the library's top-k order (`score_order_key`, ops/scalar.hpp):
// higher score first, equal scores to the higher flat index head * T + token
// (the higher head), NaN below everything. A rank's candidates are its heads'
// in ascending flat order, and the ranks' flat ranges are disjoint and ordered
// by their first head (`rank_order`), so among equal scores the rank with the
// higher first head wins, and inside a rank the later candidates win.
//
// Algorithm, for every problem of the call at once (one per sequence):
//   rounds 1-4  radix select of the k-th largest 32-bit key, 8 bits a round:
//               each rank counts its candidates matching the prefix found so
//               far into 256 bins, one all_reduce_sum of 256 int64 per
//               problem (round 1 also sums the candidate counts), and every
//               rank walks the summed bins from the top to the bin that holds
//               the k-th candidate.
//   tie step    one all_gather of (rank_order, candidates equal to the cut key)
//               per rank: the candidates equal to the key are taken rank by
//               rank in descending rank_order until k are selected.
// Communication per layer, B sequences, W ranks: 4 all-reduces of 256 * B
// int64 (2 KiB per sequence each; round 1 has B more) and one all-gather of
// 8 * (1 + B) bytes per rank, whatever the number of heads or tokens. Rounds
// stop early when every problem is settled (all ranks decide that from the
// same sums). Work per rank: one pass over its candidates per round.
//
// `ShardedCut` says which candidates are selected: those whose key is above
// `key`, and the last `take_equal` of those equal to it (`for_each_selected`).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include "kvpolicy/core/collective.hpp"
#include "kvpolicy/core/workspace.hpp"
#include "kvpolicy/ops/scalar.hpp"

KVP_NAMESPACE_BEGIN

/// One selection of a sharded top-k: this rank's candidates in ascending
/// global order and the number the whole group selects (equal on every rank).
struct ShardedTopK {
  const float* values = nullptr;
  std::int64_t count = 0;
  std::int64_t k = 0;
};

/// Where the global top-k cuts this rank's candidates.
struct ShardedCut {
  std::uint32_t key = 0xffffffffu;  ///< candidates with score_order_key above it are selected
  std::int64_t take_equal = 0;      ///< of those equal to it, the last take_equal are selected
  std::int64_t global_count = 0;    ///< candidates over all ranks
};

/// f(i) for every selected candidate i of `p`, in ascending order.
template <class F>
void for_each_selected(const ShardedTopK& p, const ShardedCut& c, F&& f) {
  std::int64_t equal_seen = 0, equal_total = 0;
  for (std::int64_t i = 0; i < p.count; ++i) equal_total += score_order_key(p.values[i]) == c.key ? 1 : 0;
  const std::int64_t skip = equal_total - c.take_equal;  // the first `skip` equal ones are not selected
  for (std::int64_t i = 0; i < p.count; ++i) {
    const std::uint32_t key = score_order_key(p.values[i]);
    if (key > c.key) {
      f(i);
    } else if (key == c.key && equal_seen++ >= skip) {
      f(i);
    }
  }
}

namespace detail {
inline constexpr std::size_t kCutBins = 256;
}

/// Workspace of `sharded_cut` for `problems` selections over `world` ranks.
inline std::size_t sharded_cut_workspace(std::size_t problems, int world) noexcept {
  WorkspacePlan p;                                                                        // same order as in sharded_cut
  p.add<std::int64_t>(problems * (detail::kCutBins + 1));                                 // summed bins (+ counts in round 1)
  p.add<std::int64_t>(problems * detail::kCutBins);                                       // this rank's bins of the last round
  p.add<std::int64_t>(problems * 3);                                                      // remaining k, prefix, state
  p.add<std::int64_t>(problems + 1);                                                      // tie record sent
  p.add<std::int64_t>(static_cast<std::size_t>(world < 1 ? 1 : world) * (problems + 1));  // tie records received
  return p.total();
}

/// cuts[b] for every problems[b]; every rank of `comm` calls it with the same
/// number of problems and the same k's. `rank_order` is this rank's place in
/// the tie order (its first head: larger wins ties), distinct per rank.
inline Status sharded_cut(const char* who, const Collective& comm, std::int64_t rank_order, std::span<const ShardedTopK> problems,
                          std::span<ShardedCut> cuts, Workspace ws) noexcept {
  KVP_REQUIRE(cuts.size() == problems.size(), "%s: %zu cuts for %zu problems", who, cuts.size(), problems.size());
  KVP_RETURN_IF_ERROR(comm.validate(who));
  KVP_RETURN_IF_ERROR(check_workspace(who, ws, sharded_cut_workspace(problems.size(), comm.world_size)));
  const std::size_t B = problems.size();
  constexpr std::size_t NB = detail::kCutBins;
  WorkspaceCarver c(ws);
  std::int64_t* sums = c.take<std::int64_t>(B * (NB + 1));
  std::int64_t* mine = c.take<std::int64_t>(B * NB);
  std::int64_t* st = c.take<std::int64_t>(B * 3);  // [remaining k, prefix, settled]
  std::int64_t* tie_send = c.take<std::int64_t>(B + 1);
  std::int64_t* tie_recv = c.take<std::int64_t>(static_cast<std::size_t>(comm.world_size) * (B + 1));
  enum : std::int64_t { kOpen = 0, kNone = 1, kAll = 2, kFound = 3 };
  bool any_open = false;
  for (std::size_t b = 0; b < B; ++b) {
    st[3 * b + 0] = std::max<std::int64_t>(problems[b].k, 0);
    st[3 * b + 1] = 0;
    st[3 * b + 2] = st[3 * b] == 0 ? kNone : kOpen;
    any_open = any_open || st[3 * b + 2] == kOpen;
    cuts[b] = ShardedCut{};
  }
  // Every rank sees the same k's, so every rank skips the rounds together.
  for (int round = 0; round < 4 && any_open; ++round) {
    const int shift = 24 - 8 * round;
    const std::uint32_t mask = round == 0 ? 0u : ~((1u << (shift + 8)) - 1u);
    for (std::size_t b = 0; b < B; ++b) {
      std::int64_t* h = mine + b * NB;
      std::fill(h, h + NB, 0);
      if (st[3 * b + 2] != kOpen) continue;
      const auto prefix = static_cast<std::uint32_t>(st[3 * b + 1]);
      const ShardedTopK& p = problems[b];
      for (std::int64_t i = 0; i < p.count; ++i) {
        const std::uint32_t key = score_order_key(p.values[i]);
        if ((key & mask) == prefix) ++h[(key >> shift) & 0xffu];
      }
    }
    const std::size_t stride = round == 0 ? NB + 1 : NB;
    for (std::size_t b = 0; b < B; ++b) {
      std::copy(mine + b * NB, mine + (b + 1) * NB, sums + b * stride);
      if (round == 0) sums[b * stride + NB] = problems[b].count;
    }
    KVP_RETURN_IF_ERROR(comm.all_reduce_sum(sums, B * stride));
    any_open = false;
    for (std::size_t b = 0; b < B; ++b) {
      if (round == 0) cuts[b].global_count = sums[b * stride + NB];
      if (st[3 * b + 2] != kOpen) continue;
      std::int64_t& rem = st[3 * b];
      if (round == 0 && rem >= cuts[b].global_count) {  // everything is selected
        st[3 * b + 2] = kAll;
        continue;
      }
      const std::int64_t* h = sums + b * stride;
      std::int64_t bin = NB - 1;
      for (; bin > 0 && h[bin] < rem; --bin) rem -= h[bin];
      st[3 * b + 1] |= static_cast<std::int64_t>(static_cast<std::uint32_t>(bin) << shift);
      if (round == 3) {
        st[3 * b + 2] = kFound;
        tie_send[1 + b] = mine[b * NB + static_cast<std::size_t>(bin)];  // this rank's candidates equal to the key
      } else {
        any_open = true;
      }
    }
  }
  bool any_found = false;
  for (std::size_t b = 0; b < B; ++b) {
    any_found = any_found || st[3 * b + 2] == kFound;
    if (st[3 * b + 2] != kFound) tie_send[1 + b] = 0;
  }
  if (any_found) {
    tie_send[0] = rank_order;
    KVP_RETURN_IF_ERROR(comm.all_gather(tie_send, (B + 1) * sizeof(std::int64_t), tie_recv));
  }
  for (std::size_t b = 0; b < B; ++b) {
    const ShardedTopK& p = problems[b];
    switch (st[3 * b + 2]) {
      case kNone: break;  // the default cut: nothing is above the largest key, none equal taken
      case kAll: {        // key 0 is NaN's: everything above it, and every NaN
        std::int64_t nan = 0;
        for (std::int64_t i = 0; i < p.count; ++i) nan += score_order_key(p.values[i]) == 0u ? 1 : 0;
        cuts[b].key = 0u;
        cuts[b].take_equal = nan;
        break;
      }
      default: {
        // The equal candidates of the ranks above this one in the tie order come first.
        std::int64_t before = 0;
        for (int r = 0; r < comm.world_size; ++r) {
          const std::int64_t* rec = tie_recv + static_cast<std::size_t>(r) * (B + 1);
          if (rec[0] > rank_order) before += rec[1 + b];
        }
        const std::int64_t need = st[3 * b];
        cuts[b].key = static_cast<std::uint32_t>(st[3 * b + 1]);
        cuts[b].take_equal = std::clamp<std::int64_t>(need - before, 0, tie_send[1 + b]);
      }
    }
  }
  return Status::ok();
}

/// Workspace of `shard_handshake` over `world` ranks.
inline std::size_t shard_handshake_workspace(int world) noexcept {
  return WorkspacePlan{}.add<std::int64_t>(static_cast<std::size_t>(world < 1 ? 1 : world) * 5).total();
}

/// The first collective of a sharded decision, before anything is written:
/// every rank says whether its own checks passed (`local`), which rows
/// [row_offset, row_offset + rows) of the layer's `total_rows` it holds, and a
/// fingerprint of what it was asked (batch size, lengths, budgets). Every rank
/// returns an error when any rank failed, the rows do not tile the layer, or
/// the fingerprints differ, so no rank is left waiting in a later collective
/// and none writes a decision the others did not make.
inline Status shard_handshake(const char* who, const Collective& comm, const Status& local, std::int64_t row_offset, std::int64_t rows,
                              std::int64_t total_rows, std::uint64_t fingerprint, Workspace ws) noexcept {
  KVP_RETURN_IF_ERROR(comm.validate(who));
  KVP_RETURN_IF_ERROR(check_workspace(who, ws, shard_handshake_workspace(comm.world_size)));
  WorkspaceCarver c(ws);
  const auto W = static_cast<std::size_t>(comm.world_size);
  std::int64_t* recv = c.take<std::int64_t>(W * 5);
  const std::int64_t send[5] = {local.is_ok() ? 1 : 0, row_offset, rows, total_rows, static_cast<std::int64_t>(fingerprint)};
  KVP_RETURN_IF_ERROR(comm.all_gather(send, sizeof(send), recv));
  if (!local.is_ok()) return local;
  std::int64_t covered = 0;
  for (std::size_t r = 0; r < W; ++r) {
    const std::int64_t* a = recv + 5 * r;
    if (a[0] != 1)
      return Status::error(StatusCode::kCollectiveError, "%s: rank %zu of %d rejected its part of the call; nothing was written", who, r,
                           comm.world_size);
    if (a[3] != total_rows || a[4] != send[4])
      return Status::error(StatusCode::kCollectiveError,
                           "%s: rank %zu was called with another batch, budget or layer size than rank %d (the ranks must make the same "
                           "call on their own heads)",
                           who, r, comm.rank);
    covered += a[2];
    for (std::size_t q = 0; q < r; ++q) {
      const std::int64_t* o = recv + 5 * q;
      if (a[1] < o[1] + o[2] && o[1] < a[1] + a[2])
        return Status::error(StatusCode::kCollectiveError, "%s: ranks %zu and %zu hold overlapping rows [%lld, %lld) and [%lld, %lld)", who,
                             q, r, static_cast<long long>(o[1]), static_cast<long long>(o[1] + o[2]), static_cast<long long>(a[1]),
                             static_cast<long long>(a[1] + a[2]));
    }
  }
  if (covered != total_rows)
    return Status::error(StatusCode::kCollectiveError, "%s: the ranks hold %lld of the layer's %lld rows; every head must be on one rank",
                         who, static_cast<long long>(covered), static_cast<long long>(total_rows));
  return Status::ok();
}

/// Order-dependent 64-bit mix for `shard_handshake` fingerprints.
constexpr std::uint64_t fingerprint_mix(std::uint64_t h, std::uint64_t v) noexcept {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h * 0xff51afd7ed558ccdull;
}

KVP_NAMESPACE_END
