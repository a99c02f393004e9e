// SPDX-License-Identifier: Apache-2.0
// `Cuda::topk` / `Cuda::topk_rows`: exact top-k under `score_order_key`, one
// thread block per row, no sort and no global workspace.
//
// The selection itself (radix select on the 32-bit order key, then an
// ordered compaction, so the output is sorted by construction) is
// `block_topk` in block_select.cuh.
#include <cstdint>

#include "block_select.cuh"
#include "cuda_common.cuh"
#include "kvpolicy/backends/cuda.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda_detail {
namespace {

constexpr int kTopkThreads = 512;
constexpr std::int64_t kMaxN = 2147483647;     // indices are int32
constexpr std::int64_t kMaxRows = 2147483647;  // grid.x

__global__ void __launch_bounds__(kTopkThreads) topk_rows_kernel(const float* __restrict__ scores, std::int64_t n, std::int64_t ld,
                                                                 std::int64_t k, std::int32_t* __restrict__ out, std::int64_t out_ld) {
  block_topk<kTopkThreads>(scores + static_cast<std::int64_t>(blockIdx.x) * ld, n, k, out + static_cast<std::int64_t>(blockIdx.x) * out_ld);
}

Status topk_impl(const char* who, const float* scores, std::int64_t rows, std::int64_t n, std::int64_t ld, std::int64_t k,
                 std::int32_t* out, std::int64_t out_ld, Workspace ws, void* stream) noexcept {
  KVP_REQUIRE(rows >= 0, "%s: rows is %lld, must be >= 0", who, static_cast<long long>(rows));
  KVP_REQUIRE(n >= 0, "%s: n is %lld, must be >= 0", who, static_cast<long long>(n));
  KVP_REQUIRE(k >= 0, "%s: k is %lld, must be >= 0", who, static_cast<long long>(k));
  KVP_REQUIRE(k <= n, "%s: k is %lld, larger than n=%lld", who, static_cast<long long>(k), static_cast<long long>(n));
  if (n > kMaxN) {
    return Status::error(StatusCode::kUnsupported, "%s: n is %lld; indices are int32, at most %lld", who, static_cast<long long>(n),
                         static_cast<long long>(kMaxN));
  }
  if (rows > 1) {
    KVP_REQUIRE(ld >= n, "%s: ld is %lld, less than n=%lld (rows would overlap)", who, static_cast<long long>(ld),
                static_cast<long long>(n));
    KVP_REQUIRE(out_ld >= k, "%s: out_ld is %lld, less than k=%lld (output rows would overlap)", who, static_cast<long long>(out_ld),
                static_cast<long long>(k));
  }
  if (rows > kMaxRows) {
    return Status::error(StatusCode::kUnsupported, "%s: rows is %lld, at most %lld per call", who, static_cast<long long>(rows),
                         static_cast<long long>(kMaxRows));
  }
  if (rows == 0 || k == 0) return Status::ok();
  KVP_REQUIRE(scores != nullptr, "%s: scores is null", who);
  KVP_REQUIRE(out != nullptr, "%s: out is null", who);
  KVP_RETURN_IF_ERROR(check_workspace(who, ws, 0));

  topk_rows_kernel<<<static_cast<unsigned>(rows), kTopkThreads, 0, as_stream(stream)>>>(scores, n, rows > 1 ? ld : n, k, out,
                                                                                        rows > 1 ? out_ld : k);
  return launch_status(who);
}

}  // namespace
}  // namespace cuda_detail

namespace backend {

std::size_t Cuda::topk_workspace(std::int64_t) noexcept { return 0; }

std::size_t Cuda::topk_rows_workspace(std::int64_t, std::int64_t) noexcept { return 0; }

Status Cuda::topk(const float* scores_device, std::int64_t n, std::int64_t k, std::int32_t* out_device, Workspace ws_device,
                  void* stream) noexcept {
  return cuda_detail::topk_impl("cuda topk", scores_device, 1, n, n, k, out_device, k, ws_device, stream);
}

Status Cuda::topk_rows(const float* scores_device, std::int64_t rows, std::int64_t n, std::int64_t ld, std::int64_t k,
                       std::int32_t* out_device, std::int64_t out_ld, Workspace ws_device, void* stream) noexcept {
  return cuda_detail::topk_impl("cuda topk_rows", scores_device, rows, n, ld, k, out_device, out_ld, ws_device, stream);
}

}  // namespace backend
KVP_NAMESPACE_END
