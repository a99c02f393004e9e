// SPDX-License-Identifier: Apache-2.0
// Tensor-parallel head shards: which slice of a layer's heads this process
// holds, and the engine's own collective to reach the other ranks.
//
// The library brings no transport. An engine that shards attention heads over
// ranks (tensor parallelism) lends its communicator through `Collective`, a
// table of two blocking operations over the ranks of one group:
//
//   all_reduce_sum(data, n)      int64 sums, in place, element-wise;
//   all_gather(send, bytes, recv) every rank's `bytes` bytes, concatenated in
//                                rank order into recv (world_size * bytes).
//
// The all-gather also carries per-head score thresholds or any other small
// per-rank record (the policies use it for their hand-shake and for ties).
// Adapters: MPI (interop/mpi_collective.hpp, any MPI_Comm) and, from Python,
// torch.distributed (`kvpolicy.distributed.TorchCollective`, any process
// group, gloo on the CPU). A test double that runs the ranks as threads of one
// process is in tests/distributed.
//
// `HeadShard` places this rank's heads in the layer: its kv heads are the
// global kv heads [kv_head_offset, kv_head_offset + local kv heads), each with
// its whole GQA group of G = num_q_heads / num_kv_heads query heads (the usual
// Megatron / vLLM split when the TP degree divides the kv heads). Engines that
// replicate kv heads because the TP degree exceeds them split a group over
// ranks; the policies with a global budget reject such a shard by name.
//
// It travels in `ExecContext::shard` (core/parallel.hpp), so every entry point,
// typed or type-erased, sees it. Per-head policies (SnapKV, PyramidKV, TOVA,
// Quest, ...) need nothing from the other ranks and ignore it; the policies
// whose budget is global over heads (Ada-KV, budget/sharded_cut.hpp) decide
// for their heads with a few small collectives per layer and reproduce the
// single-process decision bit for bit. No collective is called when the world
// size is 1 or no shard is given.
//
// Contract for an adapter: every rank of the group calls the operations in the
// same order with the same sizes (the policies guarantee it: the sizes depend
// only on the batch and parameters, which the hand-shake checks first); a
// failure is reported as a non-ok Status (kCollectiveError), never an
// exception, and then the whole call fails on that rank.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvpolicy/core/status.hpp"

KVP_NAMESPACE_BEGIN

struct Collective {
  int rank = 0;        ///< this process's rank in [0, world_size)
  int world_size = 1;  ///< ranks in the group
  void* impl = nullptr;
  /// data[0..n) = the element-wise sum over the ranks' data (in place).
  Status (*all_reduce_sum_fn)(void* impl, std::int64_t* data, std::size_t n) noexcept = nullptr;
  /// recv[r * bytes .. (r + 1) * bytes) = rank r's send, for every rank r.
  Status (*all_gather_fn)(void* impl, const void* send, std::size_t bytes, void* recv) noexcept = nullptr;

  Status validate(const char* who) const noexcept {
    KVP_REQUIRE(world_size >= 1, "%s: collective world_size is %d, must be >= 1", who, world_size);
    KVP_REQUIRE(rank >= 0 && rank < world_size, "%s: collective rank is %d, must be in [0, world_size=%d)", who, rank, world_size);
    KVP_REQUIRE(world_size == 1 || (all_reduce_sum_fn != nullptr && all_gather_fn != nullptr),
                "%s: collective with world_size %d has no all_reduce_sum / all_gather function", who, world_size);
    return Status::ok();
  }
  Status all_reduce_sum(std::int64_t* data, std::size_t n) const noexcept {
    if (world_size == 1 || n == 0) return Status::ok();
    return all_reduce_sum_fn(impl, data, n);
  }
  Status all_gather(const void* send, std::size_t bytes, void* recv) const noexcept;
};

/// This rank's part of a layer's heads (see the header comment).
struct HeadShard {
  std::int64_t kv_head_offset = 0;  ///< first global kv head held here
  std::int64_t num_kv_heads = 0;    ///< kv heads of the whole layer (all ranks)
  std::int64_t num_q_heads = 0;     ///< query heads of the whole layer (all ranks)
  const Collective* comm = nullptr;

  /// True when the call has peers: a collective with more than one rank.
  constexpr bool distributed() const noexcept { return comm != nullptr && comm->world_size > 1; }

  /// The shard against this rank's inputs (`local_q` query and `local_kv` kv heads).
  Status validate(const char* who, std::int64_t local_q, std::int64_t local_kv) const noexcept {
    KVP_REQUIRE(comm != nullptr, "%s: shard has no collective (comm is null)", who);
    KVP_RETURN_IF_ERROR(comm->validate(who));
    KVP_REQUIRE(num_kv_heads >= 1 && num_q_heads >= num_kv_heads && num_q_heads % num_kv_heads == 0,
                "%s: shard has %lld query / %lld kv heads in the layer; query heads must be a positive multiple of kv heads", who,
                static_cast<long long>(num_q_heads), static_cast<long long>(num_kv_heads));
    KVP_REQUIRE(local_kv >= 1 && kv_head_offset >= 0 && kv_head_offset + local_kv <= num_kv_heads,
                "%s: shard kv heads [%lld, %lld) are not inside the layer's %lld kv heads", who, static_cast<long long>(kv_head_offset),
                static_cast<long long>(kv_head_offset + local_kv), static_cast<long long>(num_kv_heads));
    KVP_REQUIRE(local_q == local_kv * (num_q_heads / num_kv_heads),
                "%s: this rank holds %lld query heads for %lld kv heads, the layer's groups have %lld; a shard must hold whole GQA "
                "groups",
                who, static_cast<long long>(local_q), static_cast<long long>(local_kv), static_cast<long long>(num_q_heads / num_kv_heads));
    return Status::ok();
  }
};

inline Status Collective::all_gather(const void* send, std::size_t bytes, void* recv) const noexcept {
  if (world_size == 1) {
    if (bytes > 0 && send != recv) __builtin_memcpy(recv, send, bytes);
    return Status::ok();
  }
  return all_gather_fn(impl, send, bytes, recv);
}

KVP_NAMESPACE_END
