// The sharding cases (shard_cases.hpp) over real processes: every MPI rank
// holds a slice of the heads and decides through `MpiCollective`; each rank
// checks its rows against the single-process decision it also computes, and
// rank 0 prints the total. ctest runs it under mpirun with 2 and 4 processes.
//
//   mpirun -np 4 --oversubscribe test_mpi_sharding            the cases
//   mpirun -np 2 test_mpi_sharding --timing [T] [reps]        time per layer of
//       sharded Ada-KV (32 query / 8 kv heads, head_dim 128, fp16), and the
//       share of it spent in collectives
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "distributed/quest_shard_cases.hpp"
#include "distributed/shard_cases.hpp"
#include "kvpolicy/interop/mpi_collective.hpp"

using namespace kvpolicy;
using namespace kvp_test;

namespace {

/// A Collective forwarding to MPI that accumulates the time spent inside it.
struct TimedCollective {
  const Collective* inner;
  double seconds = 0.0;
  std::int64_t calls = 0, bytes = 0;
  Collective c{};
  explicit TimedCollective(const Collective& base) : inner(&base) { c = Collective{base.rank, base.world_size, this, &reduce, &gather}; }
  static Status reduce(void* impl, std::int64_t* d, std::size_t n) noexcept {
    auto* t = static_cast<TimedCollective*>(impl);
    const double t0 = MPI_Wtime();
    const Status s = t->inner->all_reduce_sum(d, n);
    t->seconds += MPI_Wtime() - t0;
    ++t->calls;
    t->bytes += static_cast<std::int64_t>(n * sizeof(std::int64_t));
    return s;
  }
  static Status gather(void* impl, const void* s, std::size_t b, void* r) noexcept {
    auto* t = static_cast<TimedCollective*>(impl);
    const double t0 = MPI_Wtime();
    const Status st = t->inner->all_gather(s, b, r);
    t->seconds += MPI_Wtime() - t0;
    ++t->calls;
    t->bytes += static_cast<std::int64_t>(b);
    return st;
  }
};

int timing(const Collective& comm, std::int64_t T, int reps) {
  const ShardBatch sb(32, 8, 128, 64, {T}, ScorePattern::kRandom, 42);
  const AdaKV<SnapKV> p(AdaKVParams::kvpress(0.5, 0.2), SnapKV(SnapKVParams::kvpress(0.0, 64, 5)));
  const auto [h0, h1] = shard_range(sb.Hkv, comm.world_size, comm.rank);
  TimedCollective tc(comm);
  const HeadShard shard{h0, sb.Hkv, sb.Hq, &tc.c};
  ExecContext exec;
  exec.shard = &shard;
  const auto in = sb.inputs(h0, h1);
  KeepSetBuffer keep(1, 1);
  double best = 1e30, sum = 0.0, coll = 0.0;
  for (int i = 0; i < reps; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    tc.seconds = 0.0;
    const double t0 = MPI_Wtime();
    const Status s = decide(p, in, exec, &keep);
    const double dt = MPI_Wtime() - t0;
    if (!s.is_ok()) {
      std::fprintf(stderr, "rank %d: %s\n", comm.rank, s.message());
      return 1;
    }
    best = std::min(best, dt);
    sum += dt;
    coll += tc.seconds;
  }
  // The same collectives alone (sizes of this call: one sequence), after a barrier: the transport's share.
  std::vector<std::int64_t> buf(257 * 4), recv(static_cast<std::size_t>(comm.world_size) * 8);
  double alone = 0.0;
  for (int i = 0; i < reps; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    (void)comm.all_gather(buf.data(), 5 * sizeof(std::int64_t), recv.data());
    for (int round = 0; round < 4; ++round) (void)comm.all_reduce_sum(buf.data(), round == 0 ? 257 : 256);
    (void)comm.all_gather(buf.data(), 2 * sizeof(std::int64_t), recv.data());
    alone += MPI_Wtime() - t0;
  }
  if (comm.rank == 0) std::printf("  the 6 collectives alone: %.1f us per layer\n", 1e6 * alone / reps);
  if (comm.rank == 0)
    std::printf(
        "sharded adakv, %d ranks, T=%lld, %lld kv heads per rank: %.3f ms per layer (best %.3f), %.3f ms in %lld collectives "
        "(%lld bytes sent per rank per layer)\n",
        comm.world_size, static_cast<long long>(T), static_cast<long long>(h1 - h0), 1e3 * sum / reps, 1e3 * best, 1e3 * coll / reps,
        static_cast<long long>(tc.calls / reps), static_cast<long long>(tc.bytes / reps));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rc = 0;
  {
    const MpiCollective mpi(MPI_COMM_WORLD);
    const Collective& comm = mpi.collective();
    if (argc > 1 && std::strcmp(argv[1], "--timing") == 0) {
      rc = timing(comm, argc > 2 ? std::atoll(argv[2]) : 4096, argc > 3 ? std::atoi(argv[3]) : 10);
    } else {
      ShardCaseResult r = run_shard_cases(comm);
      const ShardCaseResult q = run_quest_shard_cases(comm);
      r.cases += q.cases;
      r.fails.insert(r.fails.end(), q.fails.begin(), q.fails.end());
      for (const auto& f : r.fails) std::fprintf(stderr, "rank %d: FAILED %s\n", comm.rank, f.c_str());
      std::int64_t tally[2] = {r.cases, static_cast<std::int64_t>(r.fails.size())};
      MPI_Allreduce(MPI_IN_PLACE, tally, 2, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
      if (comm.rank == 0)
        std::printf("test_mpi_sharding: %d ranks, %lld sharded decisions compared with one process, %lld mismatches\n", comm.world_size,
                    static_cast<long long>(tally[0]), static_cast<long long>(tally[1]));
      rc = tally[1] == 0 && tally[0] > 0 ? 0 : 1;
    }
  }
  MPI_Finalize();
  return rc;
}
