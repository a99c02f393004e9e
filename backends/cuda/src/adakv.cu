// SPDX-License-Identifier: Apache-2.0
// `Cuda::adakv_keep`: one sequence's Ada-KV decision on the device
// (ops/adakv_keep.hpp gives the semantics and the host reference), so a layer
// is decided without a host round trip and can be captured in a CUDA graph.
//
// Launches, in stream order, for a (rows, T) score map:
//   normalize (original only)  row thresholds (block per row), then one block
//                              per row scales it into the workspace's ranked
//                              copy: thread 0 sums in fp64 in ascending token
//                              order as the host does (bit-identical factor),
//                              the block writes the row;
//   kvpress safeguard          row thresholds of the n_safe best (block per row);
//   layer threshold            one block: the layer_k-th best packed key over
//                              the rows*T map, safeguarded elements excluded;
//   shares                     block per row: elements at or above it;
//   finish                     one thread: the original's caps (the shared
//                              host/device formula), indptr from indptr[0];
//   kept rows                  block per row: its best count[r] tokens,
//                              ascending (block_topk, as Cuda::topk).
// The selections are block_select.cuh's (radix select on the order key), so
// the counts and rows equal the host reference bit for bit.
//
// Cost: the layer threshold is one block over rows*T elements (5 passes), the
// rest is O(rows*T) spread over `rows` blocks; it has never been profiled on a
// GPU (a multi-block layer select is the next step if it shows).
#include <cub/block/block_reduce.cuh>

#include <cmath>
#include <cstdint>

#include "block_select.cuh"
#include "cuda_common.cuh"
#include "kvpolicy/backends/cuda.hpp"
#include "kvpolicy/ops/adakv_keep.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda_detail {
namespace {

constexpr int kKeepThreads = 512;
constexpr std::int64_t kMaxRows = 65535;  // grid.x of the per-row launches, kept well inside the limit

/// thr[r] = the k-th largest row key (score key << 32 | token) of row r.
__global__ void __launch_bounds__(kKeepThreads)
    row_threshold_kernel(const float* __restrict__ S, std::int64_t T, std::int64_t k, std::uint64_t* __restrict__ thr) {
  const float* row = S + static_cast<std::int64_t>(blockIdx.x) * T;
  const std::uint64_t t = block_kth_key<kKeepThreads>(T, k, [row](std::int64_t j, std::uint32_t* u) {
    *u = score_order_key(row[j]);
    return true;
  });
  if (threadIdx.x == 0) thr[blockIdx.x] = t;
}

/// The original's normalisation of row r into ranked (ops/adakv_keep.hpp, step 2).
__global__ void __launch_bounds__(kKeepThreads)
    normalize_kernel(const float* __restrict__ S, std::int64_t T, const std::uint64_t* __restrict__ thr, float* __restrict__ ranked) {
  __shared__ float s_f;
  const std::int64_t r = blockIdx.x;
  const float* row = S + r * T;
  if (threadIdx.x == 0) {
    double top = 0.0, all = 0.0;  // the host's order: ascending tokens
    for (std::int64_t j = 0; j < T; ++j) {
      const float x = row[j];
      if (x == INFINITY) continue;
      if (keep_order_key(x, j) >= thr[r]) top = __dadd_rn(top, static_cast<double>(x));
      all = __dadd_rn(all, static_cast<double>(x));
    }
    const float den = __double2float_rn(all), num = __double2float_rn(top);
    s_f = (den != 0.0f && isfinite(den) && isfinite(num)) ? __fdiv_rn(num, den) : 1.0f;
  }
  __syncthreads();
  const float f = s_f;
  for (std::int64_t j = threadIdx.x; j < T; j += kKeepThreads) {
    const float x = row[j];
    ranked[r * T + j] = x == INFINITY ? x : __fmul_rn(x, f);
  }
}

/// Whether flat element i = r*T + j takes part in the layer selection (not safeguarded).
__device__ __forceinline__ bool not_safe(const float* S, const std::uint64_t* safe, std::int64_t T, std::int64_t i) {
  if (safe == nullptr) return true;
  const std::int64_t r = i / T, j = i - r * T;
  return keep_order_key(S[i], j) < safe[r];
}

/// *g = the k-th largest layer key (ranked key << 32 | flat index) of the elements not safeguarded.
__global__ void __launch_bounds__(kKeepThreads)
    layer_threshold_kernel(const float* __restrict__ S, const float* __restrict__ ranked, std::int64_t n, std::int64_t T,
                           const std::uint64_t* __restrict__ safe, std::int64_t k, std::uint64_t* __restrict__ g) {
  const std::uint64_t t = block_kth_key<kKeepThreads>(n, k, [=](std::int64_t i, std::uint32_t* u) {
    if (!not_safe(S, safe, T, i)) return false;
    *u = score_order_key(ranked[i]);
    return true;
  });
  if (threadIdx.x == 0) *g = t;
}

/// counts[r] = base + the elements of row r (not safeguarded) whose layer key is >= *g.
__global__ void __launch_bounds__(kKeepThreads)
    shares_kernel(const float* __restrict__ S, const float* __restrict__ ranked, std::int64_t T, const std::uint64_t* __restrict__ safe,
                  const std::uint64_t* __restrict__ g, std::int64_t base, std::int64_t* __restrict__ counts) {
  using Reduce = cub::BlockReduce<long long, kKeepThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const std::int64_t r = blockIdx.x, i0 = r * T;
  const std::uint64_t gt = *g;
  long long c = 0;
  for (std::int64_t j = threadIdx.x; j < T; j += kKeepThreads)
    c += (not_safe(S, safe, T, i0 + j) && keep_order_key(ranked[i0 + j], i0 + j) >= gt) ? 1 : 0;
  const long long sum = Reduce(tmp).Sum(c);
  if (threadIdx.x == 0) counts[r] = base + sum;
}

/// Final counts (the original's caps; keep_all: T) and indptr[1..rows] from indptr[0].
__global__ void finish_kernel(std::int64_t* __restrict__ counts, std::int64_t rows, std::int64_t T, AdaKVKeepSpec spec,
                              std::int32_t* __restrict__ indptr) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  bool defined = true;
  if (!spec.keep_all)
    for (std::int64_t r = 0; r < rows; ++r) defined = defined && counts[r] >= 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t c = adakv_final_count(spec, spec.keep_all ? T : counts[r], defined, T);
    counts[r] = c;
    indptr[r + 1] = static_cast<std::int32_t>(indptr[r] + c);
  }
}

/// Row r keeps its best counts[r] tokens (all of them, unread, when counts[r] >= T), ascending, at indices + indptr[r].
__global__ void __launch_bounds__(kKeepThreads)
    keep_rows_kernel(const float* __restrict__ S, std::int64_t T, const std::int64_t* __restrict__ counts,
                     const std::int32_t* __restrict__ indptr, std::int32_t* __restrict__ indices) {
  const std::int64_t r = blockIdx.x, k = counts[r];
  std::int32_t* o = indices + indptr[r];
  if (k >= T) {
    for (std::int64_t j = threadIdx.x; j < T; j += kKeepThreads) o[j] = static_cast<std::int32_t>(j);
    return;
  }
  if (k <= 0) return;
  block_topk<kKeepThreads>(S + r * T, T, k, o);
}

WorkspacePlan keep_plan(std::int64_t rows, std::int64_t T) noexcept {
  const auto rt = static_cast<std::size_t>(std::max<std::int64_t>(rows, 1) * std::max<std::int64_t>(T, 1));
  WorkspacePlan p;  // same order as the carve in adakv_keep
  p.add<float>(rt).add<std::uint64_t>(static_cast<std::size_t>(std::max<std::int64_t>(rows, 1))).add<std::uint64_t>(1);
  return p;
}

}  // namespace
}  // namespace cuda_detail

namespace backend {

std::size_t Cuda::adakv_keep_workspace(std::int64_t rows, std::int64_t T) noexcept { return cuda_detail::keep_plan(rows, T).total(); }

void Cuda::adakv_keep(const float* scores, std::int64_t rows, std::int64_t T, const AdaKVKeepSpec& spec, std::int64_t* counts,
                      std::int32_t* indptr, std::int32_t* indices, Workspace ws) noexcept {
  using namespace cuda_detail;
  constexpr const char* who = "cuda adakv_keep";
  const auto fail = [](const Status& s) { record_error(s); };
  if (rows < 0 || T < 0)
    return fail(KVP_INVALID("%s: rows=%lld, T=%lld, must be >= 0", who, static_cast<long long>(rows), static_cast<long long>(T)));
  if (rows == 0) return;
  if (rows > kMaxRows)
    return fail(Status::error(StatusCode::kUnsupported, "%s: %lld rows, at most %lld", who, static_cast<long long>(rows),
                              static_cast<long long>(kMaxRows)));
  if (rows * T > INT32_MAX)
    return fail(KVP_INVALID("%s: rows %lld x T %lld exceed the int32 range of the layer-wide selection", who, static_cast<long long>(rows),
                            static_cast<long long>(T)));
  if (counts == nullptr || indptr == nullptr || (T > 0 && indices == nullptr) || (!spec.keep_all && scores == nullptr))
    return fail(KVP_INVALID("%s: scores, counts, indptr or indices is null", who));
  if (!spec.keep_all && (spec.row_k < 0 || spec.row_k > T || spec.layer_k < 0 || spec.layer_k > rows * T))
    return fail(KVP_INVALID("%s: row_k=%lld must be in [0, T=%lld] and layer_k=%lld in [0, rows*T]", who,
                            static_cast<long long>(spec.row_k), static_cast<long long>(T), static_cast<long long>(spec.layer_k)));
  const Status wst = check_workspace(who, ws, adakv_keep_workspace(rows, T));
  if (!wst.is_ok()) return fail(wst);

  WorkspaceCarver c(ws);
  const auto rt = static_cast<std::size_t>(std::max<std::int64_t>(rows, 1) * std::max<std::int64_t>(T, 1));
  float* ranked = c.take<float>(rt);
  std::uint64_t* safe = c.take<std::uint64_t>(static_cast<std::size_t>(rows));
  std::uint64_t* g = c.take<std::uint64_t>(1);
  const cudaStream_t st = as_stream(current_stream());
  const auto grid = static_cast<unsigned>(rows);
  AdaKVKeepSpec sp = spec;
  if (T == 0) sp.keep_all = true;  // nothing to rank: every row keeps its 0 tokens
  if (!sp.keep_all) {
    const float* rank_src = scores;
    const std::uint64_t* safe_thr = nullptr;
    if (spec.original && spec.normalize) {
      row_threshold_kernel<<<grid, kKeepThreads, 0, st>>>(scores, T, spec.row_k, safe);
      normalize_kernel<<<grid, kKeepThreads, 0, st>>>(scores, T, safe, ranked);
      rank_src = ranked;
    } else if (!spec.original && spec.row_k > 0) {
      row_threshold_kernel<<<grid, kKeepThreads, 0, st>>>(scores, T, spec.row_k, safe);
      safe_thr = safe;
    }
    layer_threshold_kernel<<<1, kKeepThreads, 0, st>>>(scores, rank_src, rows * T, T, safe_thr, spec.layer_k, g);
    shares_kernel<<<grid, kKeepThreads, 0, st>>>(scores, rank_src, T, safe_thr, g, spec.base, counts);
  }
  finish_kernel<<<1, 1, 0, st>>>(counts, rows, T, sp, indptr);
  keep_rows_kernel<<<grid, kKeepThreads, 0, st>>>(scores, T, counts, indptr, indices);
  record_error(launch_status(who));
}

}  // namespace backend
KVP_NAMESPACE_END
