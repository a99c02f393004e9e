// SPDX-License-Identifier: Apache-2.0
// How a tensor-parallel engine runs Ada-KV, whose budget is shared by all heads
// of a layer: every MPI rank holds its slice of the kv heads (token-major fp16
// cache, as the engine lays it out) and its query heads, lends its
// communicator through MpiCollective, and decides for its own heads. Rank 0
// then checks that the union of the ranks' decisions is what one process
// holding every head decides.
//
//   mpirun -np 2 ./tensor_parallel_adakv        (any count that divides 8)
#include <mpi.h>

#include <cstdio>
#include <random>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/interop/mpi_collective.hpp"
#include "kvpolicy/policy/eviction/adakv.hpp"

using namespace kvpolicy;

namespace {

constexpr std::int64_t kQHeads = 32, kKvHeads = 8, kDim = 64, kLen = 2048, kWindow = 32;

/// The layer's full cache and window queries, drawn the same on every rank (a stand-in for the model).
struct Layer {
  std::vector<half> k;   // (kLen, kKvHeads, kDim): token-major
  std::vector<float> q;  // (kWindow, kQHeads, kDim)
  Layer() : k(kLen * kKvHeads * kDim), q(kWindow * kQHeads * kDim) {
    std::mt19937 rng(5);
    std::normal_distribution<float> nd;
    for (auto& x : k) x = to_half(nd(rng));
    for (auto& x : q) x = nd(rng);
  }
  /// Views of kv heads [h0, h0 + n) and their query heads: strided, no copies.
  ScoreInput<float, half> heads(std::int64_t h0, std::int64_t n) const {
    const std::int64_t G = kQHeads / kKvHeads;
    const TensorView<const half, 3> keys(k.data() + h0 * kDim, {n, kLen, kDim}, {kDim, kKvHeads * kDim, 1});
    const TensorView<const float, 3> queries(q.data() + h0 * G * kDim, {n * G, kWindow, kDim}, {kDim, kQHeads * kDim, 1});
    return ScoreInput<float, half>{queries, KVSource<half>::from(keys)};
  }
};

/// One call: size query, buffers, decision (what an engine does once per layer).
Status decide(const AdaKV<SnapKV>& p, const ScoreInput<float, half>& in, const ExecContext& exec, std::vector<std::int32_t>* indptr,
              std::vector<std::int32_t>* indices) {
  const ProblemShape shape{in.queries.extent(0), in.keys.kv_heads(), kDim, kLen, kWindow};
  const Requirements req = p.requirements(Context<backend::Cpu>{{}, exec}, shape);
  KVP_RETURN_IF_ERROR(req.status);
  indptr->assign(static_cast<std::size_t>(req.output.rows + 1), 0);
  indices->assign(static_cast<std::size_t>(req.output.capacity), 0);
  std::vector<std::byte> ws(req.workspace_bytes);
  const KeepSet keep{indptr->data(), indices->data(), req.output.rows, req.output.capacity};
  return p.evict(Context<backend::Cpu>{Workspace{ws.data(), ws.size()}, exec}, in, keep);
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rc = 0;
  {
    const MpiCollective mpi(MPI_COMM_WORLD);
    const int rank = mpi.collective().rank, world = mpi.collective().world_size;
    const Layer layer;
    const AdaKV<SnapKV> adakv(AdaKVParams::kvpress(0.75, 0.2), SnapKV(SnapKVParams::kvpress(0.0, kWindow, 5)));
    if (kKvHeads % world != 0) {
      if (rank == 0) std::fprintf(stderr, "run with a rank count that divides %lld\n", static_cast<long long>(kKvHeads));
      rc = 2;
    } else {
      // This rank's heads and the engine's communicator: the only change a TP engine makes.
      const std::int64_t n = kKvHeads / world, h0 = rank * n;
      const HeadShard shard{h0, kKvHeads, kQHeads, &mpi.collective()};
      ExecContext exec;
      exec.shard = &shard;
      std::vector<std::int32_t> indptr, indices;
      throw_if_error(decide(adakv, layer.heads(h0, n), exec, &indptr, &indices));
      // Rank 0 gathers every rank's per-head counts and compares with one process holding every head.
      std::vector<std::int32_t> counts(static_cast<std::size_t>(n)), all(static_cast<std::size_t>(kKvHeads));
      for (std::int64_t h = 0; h < n; ++h) counts[static_cast<std::size_t>(h)] = indptr[h + 1] - indptr[h];
      MPI_Gather(counts.data(), static_cast<int>(n), MPI_INT, all.data(), static_cast<int>(n), MPI_INT, 0, MPI_COMM_WORLD);
      if (rank == 0) {
        std::vector<std::int32_t> ip, ids;
        throw_if_error(decide(adakv, layer.heads(0, kKvHeads), ExecContext{}, &ip, &ids));
        std::printf("Ada-KV over %d ranks, tokens kept per kv head (budget %lld on average):\n", world, static_cast<long long>(kLen / 4));
        bool same = true;
        for (std::int64_t h = 0; h < kKvHeads; ++h) {
          std::printf("  head %lld (rank %lld): %d  one process: %d\n", static_cast<long long>(h), static_cast<long long>(h / n),
                      all[static_cast<std::size_t>(h)], ip[h + 1] - ip[h]);
          same = same && all[static_cast<std::size_t>(h)] == ip[h + 1] - ip[h];
        }
        std::printf(same ? "same allocation as one process\n" : "MISMATCH\n");
        rc = same ? 0 : 1;
      }
    }
  }
  MPI_Finalize();
  return rc;
}
