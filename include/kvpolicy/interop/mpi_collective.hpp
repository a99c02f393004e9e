// SPDX-License-Identifier: Apache-2.0
// `Collective` over an MPI communicator (core/collective.hpp): for engines
// whose tensor-parallel ranks are MPI processes. Header-only; include it from
// code that already links MPI (CMake: `find_package(MPI)` and
// `MPI::MPI_CXX` or `MPI::MPI_C`). The library itself never includes it.
//
//   MPI_Init(&argc, &argv);
//   kvpolicy::MpiCollective comm(MPI_COMM_WORLD);      // or the TP group's communicator
//   const kvpolicy::HeadShard shard{first_kv_head, num_kv_heads, num_q_heads, &comm.collective()};
//   kvpolicy::ExecContext exec;  exec.shard = &shard;  // then every call with this exec decides for its heads
//
// all_reduce_sum is MPI_Allreduce(MPI_IN_PLACE, MPI_INT64_T, MPI_SUM) and
// all_gather is MPI_Allgather of bytes, both on the given communicator, which
// must outlive the object; the object is not copied into MPI, so it must also
// outlive the `Collective` it hands out. Errors: under the default handler
// (MPI_ERRORS_ARE_FATAL) MPI aborts; with MPI_ERRORS_RETURN set on the
// communicator a failed call becomes a kCollectiveError Status carrying
// MPI's error string. Calls of more than INT_MAX elements are refused.
#pragma once

#include <mpi.h>

#include <climits>
#include <cstddef>
#include <cstdint>

#include "kvpolicy/core/collective.hpp"

KVP_NAMESPACE_BEGIN

class MpiCollective {
 public:
  explicit MpiCollective(MPI_Comm comm) noexcept : comm_(comm) {
    int rank = 0, size = 1;
    MPI_Comm_rank(comm_, &rank);
    MPI_Comm_size(comm_, &size);
    c_ = Collective{rank, size, this, &all_reduce_sum, &all_gather};
  }
  MpiCollective(const MpiCollective&) = delete;
  MpiCollective& operator=(const MpiCollective&) = delete;

  const Collective& collective() const noexcept { return c_; }
  MPI_Comm comm() const noexcept { return comm_; }

 private:
  static Status failed(const char* op, int rc) noexcept {
    char text[MPI_MAX_ERROR_STRING] = {};
    int len = 0;
    MPI_Error_string(rc, text, &len);
    return Status::error(StatusCode::kCollectiveError, "mpi_collective: %s failed: %s", op, text);
  }
  static Status all_reduce_sum(void* impl, std::int64_t* data, std::size_t n) noexcept {
    if (n > static_cast<std::size_t>(INT_MAX))
      return Status::error(StatusCode::kCollectiveError, "mpi_collective: all_reduce_sum of %zu elements exceeds MPI's int count", n);
    const int rc = MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(n), MPI_INT64_T, MPI_SUM, static_cast<MpiCollective*>(impl)->comm_);
    return rc == MPI_SUCCESS ? Status::ok() : failed("MPI_Allreduce", rc);
  }
  static Status all_gather(void* impl, const void* send, std::size_t bytes, void* recv) noexcept {
    if (bytes > static_cast<std::size_t>(INT_MAX))
      return Status::error(StatusCode::kCollectiveError, "mpi_collective: all_gather of %zu bytes exceeds MPI's int count", bytes);
    const int n = static_cast<int>(bytes);
    const int rc = MPI_Allgather(send, n, MPI_BYTE, recv, n, MPI_BYTE, static_cast<MpiCollective*>(impl)->comm_);
    return rc == MPI_SUCCESS ? Status::ok() : failed("MPI_Allgather", rc);
  }

  MPI_Comm comm_;
  Collective c_{};
};

KVP_NAMESPACE_END
