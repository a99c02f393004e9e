// SPDX-License-Identifier: Apache-2.0
// `Cuda::window_scores`: SnapKV-style window attention scores on the device.
//
// Three kernels, mirroring the scalar reference step by step so the two agree
// to expf rounding:
//   1. logits  L[r, j] = scale * <q_r, k_j>       tiled over (64 keys) x (64 query rows)
//   2. per-row max and 1/sum(exp(L - max)) (fp64 sum), times 1/window for kMean
//   3. out[g, j] = sum_i exp(L[g*w+i, j] - max) * inv   in window order i = 0..w-1
// Keeping the logits in the workspace (rather than an online softmax fused
// with the reduction) makes the softmax the exact two-pass one and the
// window sum order fixed, so results are bitwise reproducible run to run.
#include <cub/block/block_reduce.cuh>

#include <cmath>
#include <cstdint>

#include "cuda_common.cuh"
#include "kvpolicy/backends/cuda.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda_detail {
namespace {

constexpr int kTile = 64;           // query rows and keys per logits block
constexpr int kChunk = 32;          // head_dim elements staged in shared memory per step
constexpr int kLogitThreads = 256;  // 16 x 16 threads, each owning a 4 x 4 block of logits
constexpr int kStatThreads = 256;
constexpr int kReduceThreads = 256;
constexpr std::int64_t kMaxGridY = 65535;
constexpr std::int64_t kMaxKvLen = 2147483647;
static_assert(kLogitThreads == 16 * 16 && kTile == 16 * 4, "thread / tile mapping below assumes 16x16 threads, 4x4 each");

struct WindowParams {
  std::int64_t rows;      // R = group * window query rows
  std::int64_t window;    // w
  std::int64_t head_dim;  // d
  std::int64_t kv_len;    // T
  std::int64_t ld;        // logits row length: max visible keys = min(T, q_pos0 + w)
  std::int64_t q_pos0;    // clamped to [0, T] (same visibility, no overflow)
  std::int64_t num_cols;  // L
  float scale;
  float inv_w;  // 1/w for kMean, 1 for kSum (computed as the scalar reference does)
};

/// Keys visible to window query i: [0, min(T, q_pos0 + i + 1)).
__device__ __forceinline__ std::int64_t visible(const WindowParams& p, std::int64_t i) {
  const std::int64_t v = p.q_pos0 + i + 1;
  return v < p.kv_len ? v : p.kv_len;
}

/// Pass 1. Block (x, y) computes logits for keys [64x, 64x+64) of query rows
/// [64y, 64y+64). Each thread accumulates its dot products over head_dim in
/// ascending order with separately rounded multiply and add (no FMA
/// contraction), exactly the scalar loop; zero padding past head_dim adds +0.
template <class Tk>
__global__ void __launch_bounds__(kLogitThreads)
    window_logits_kernel(WindowParams p, const float* __restrict__ q, Rows<Tk> keys, float* __restrict__ logits) {
  // Transposed tiles [c][row]; the +1 column keeps the transposing store conflict-free.
  __shared__ float qs[kChunk][kTile + 1];
  __shared__ float ks[kChunk][kTile + 1];
  __shared__ const Tk* krow[kTile];  // row pointers of this block's keys (page lookup done once)

  const int tid = static_cast<int>(threadIdx.x);
  const int tx = tid % 16, ty = tid / 16;
  const std::int64_t j0 = static_cast<std::int64_t>(blockIdx.x) * kTile;
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * kTile;

  if (tid < kTile) krow[tid] = (j0 + tid < p.ld) ? keys.row(j0 + tid) : nullptr;

  float acc[4][4];
#pragma unroll
  for (int a = 0; a < 4; ++a)
#pragma unroll
    for (int b = 0; b < 4; ++b) acc[a][b] = 0.0f;

  for (std::int64_t c0 = 0; c0 < p.head_dim; c0 += kChunk) {
    __syncthreads();  // krow ready (first step) / previous tiles consumed
    for (int e = tid; e < kTile * kChunk; e += kLogitThreads) {
      const int t = e / kChunk;  // row (query) or key within the tile
      const int c = e % kChunk;  // consecutive threads read consecutive elements
      const std::int64_t col = c0 + c;
      const bool in_dim = col < p.head_dim;
      const std::int64_t r = r0 + t;
      qs[c][t] = (in_dim && r < p.rows) ? q[r * p.head_dim + col] : 0.0f;
      const Tk* kr = krow[t];
      ks[c][t] = (in_dim && kr != nullptr) ? load_f32(kr + col) : 0.0f;
    }
    __syncthreads();
#pragma unroll 4
    for (int c = 0; c < kChunk; ++c) {
      float qa[4], kb[4];
#pragma unroll
      for (int a = 0; a < 4; ++a) qa[a] = qs[c][ty + 16 * a];
#pragma unroll
      for (int b = 0; b < 4; ++b) kb[b] = ks[c][tx + 16 * b];
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) acc[a][b] = __fadd_rn(acc[a][b], __fmul_rn(qa[a], kb[b]));
    }
  }

#pragma unroll
  for (int a = 0; a < 4; ++a) {
    const std::int64_t r = r0 + ty + 16 * a;
    if (r >= p.rows) continue;
    const std::int64_t vis = visible(p, r % p.window);
    float* lr = logits + r * p.ld;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const std::int64_t j = j0 + tx + 16 * b;
      if (j < vis) lr[j] = __fmul_rn(acc[a][b], p.scale);  // vis <= ld: in bounds
    }
  }
}

/// std::max(m, x) as the reference uses it: a NaN x never replaces m.
struct MaxIgnoringNaN {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

/// Pass 2. One block per query row: max over the visible logits, then the
/// softmax denominator summed in fp64 (the reference's `double denom`).
__global__ void __launch_bounds__(kStatThreads)
    window_row_stats_kernel(WindowParams p, const float* __restrict__ logits, float* __restrict__ row_max, float* __restrict__ row_scale) {
  using MaxReduce = cub::BlockReduce<float, kStatThreads>;
  using SumReduce = cub::BlockReduce<double, kStatThreads>;
  __shared__ typename MaxReduce::TempStorage max_tmp;
  __shared__ typename SumReduce::TempStorage sum_tmp;
  __shared__ float s_max;

  const std::int64_t r = blockIdx.x;
  const std::int64_t vis = visible(p, r % p.window);
  const float* lr = logits + r * p.ld;

  float m = -INFINITY;
  for (std::int64_t j = threadIdx.x; j < vis; j += kStatThreads) m = fmaxf(m, lr[j]);
  m = MaxReduce(max_tmp).Reduce(m, MaxIgnoringNaN{});  // valid in thread 0
  if (threadIdx.x == 0) s_max = m;
  __syncthreads();
  m = s_max;

  double sum = 0.0;
  for (std::int64_t j = threadIdx.x; j < vis; j += kStatThreads) sum += static_cast<double>(expf(__fsub_rn(lr[j], m)));
  sum = SumReduce(sum_tmp).Sum(sum);  // valid in thread 0
  if (threadIdx.x == 0) {
    row_max[r] = m;
    row_scale[r] = __fmul_rn(static_cast<float>(1.0 / sum), p.inv_w);
  }
}

/// Pass 3. Thread per (head g, key j < num_cols): the window sum in order
/// i = 0..w-1, adding only queries that see key j (the reference's `cols`).
/// Reads of one i are coalesced over j.
__global__ void __launch_bounds__(kReduceThreads)
    window_reduce_kernel(WindowParams p, const float* __restrict__ logits, const float* __restrict__ row_max,
                         const float* __restrict__ row_scale, float* __restrict__ out) {
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * kReduceThreads + threadIdx.x;
  const std::int64_t g = blockIdx.y;
  if (j >= p.num_cols) return;
  float acc = 0.0f;
  for (std::int64_t i = 0; i < p.window; ++i) {
    if (j >= visible(p, i)) continue;
    const std::int64_t r = g * p.window + i;
    const float e = expf(__fsub_rn(logits[r * p.ld + j], row_max[r]));
    acc = __fadd_rn(acc, __fmul_rn(e, row_scale[r]));
  }
  out[g * p.num_cols + j] = acc;
}

/// Logits row length: keys visible to the last window query.
std::int64_t logits_ld(const WindowScoreShape& s) noexcept {
  const std::int64_t q0 = s.q_pos0 < 0 ? 0 : s.q_pos0;
  if (q0 >= s.kv_len) return s.kv_len;
  return q0 + s.window < s.kv_len ? q0 + s.window : s.kv_len;
}

/// Shapes this implementation launches (beyond these: kUnsupported).
bool within_launch_limits(const WindowScoreShape& s) noexcept {
  return s.group <= kMaxGridY && s.window <= kMaxGridY * kTile && s.group * s.window <= kMaxGridY * kTile && s.kv_len <= kMaxKvLen;
}

Status validate_shape(const char* who, const WindowScoreShape& s) noexcept {
  KVP_REQUIRE(s.group >= 1, "%s: group is %lld, must be >= 1", who, static_cast<long long>(s.group));
  KVP_REQUIRE(s.window >= 1, "%s: window is %lld, must be >= 1", who, static_cast<long long>(s.window));
  KVP_REQUIRE(s.head_dim >= 1, "%s: head_dim is %lld, must be >= 1", who, static_cast<long long>(s.head_dim));
  KVP_REQUIRE(s.kv_len >= 0, "%s: kv_len is %lld, must be >= 0", who, static_cast<long long>(s.kv_len));
  KVP_REQUIRE(s.num_cols >= 0 && s.num_cols <= s.kv_len, "%s: num_cols is %lld, must be in [0, kv_len=%lld]", who,
              static_cast<long long>(s.num_cols), static_cast<long long>(s.kv_len));
  KVP_REQUIRE(s.q_pos0 >= 0, "%s: q_pos0 is %lld, must be >= 0", who, static_cast<long long>(s.q_pos0));
  KVP_REQUIRE(s.reduce == WindowReduce::kMean || s.reduce == WindowReduce::kSum, "%s: reduce is %d, not kMean or kSum", who,
              static_cast<int>(s.reduce));
  if (!within_launch_limits(s)) {
    return Status::error(StatusCode::kUnsupported,
                         "%s: group=%lld, window=%lld, kv_len=%lld exceed this backend's launch limits "
                         "(group <= %lld, group*window <= %lld, kv_len <= %lld)",
                         who, static_cast<long long>(s.group), static_cast<long long>(s.window), static_cast<long long>(s.kv_len),
                         static_cast<long long>(kMaxGridY), static_cast<long long>(kMaxGridY * kTile), static_cast<long long>(kMaxKvLen));
  }
  return Status::ok();
}

template <class Tk>
Status validate_keys(const char* who, const WindowScoreShape& s, const Rows<Tk>& keys) noexcept {
  KVP_REQUIRE(keys.base != nullptr, "%s: keys.base is null", who);
  if (keys.pages == nullptr) {
    KVP_REQUIRE(s.kv_len <= 1 || keys.row_stride >= s.head_dim, "%s: keys.row_stride is %lld, less than head_dim %lld (rows would overlap)",
                who, static_cast<long long>(keys.row_stride), static_cast<long long>(s.head_dim));
    return Status::ok();
  }
  KVP_REQUIRE(keys.page_size >= 1, "%s: keys.page_size is %d, must be >= 1 for paged keys", who, static_cast<int>(keys.page_size));
  KVP_REQUIRE(keys.page_size == 1 || s.kv_len <= 1 || keys.row_stride >= s.head_dim,
              "%s: keys.row_stride (slot stride) is %lld, less than head_dim %lld (rows would overlap)", who,
              static_cast<long long>(keys.row_stride), static_cast<long long>(s.head_dim));
  KVP_REQUIRE(s.kv_len <= keys.page_size || keys.page_stride >= s.head_dim,
              "%s: keys.page_stride is %lld, less than head_dim %lld (pages would overlap)", who, static_cast<long long>(keys.page_stride),
              static_cast<long long>(s.head_dim));
  return Status::ok();
}

std::size_t workspace_bytes(const WindowScoreShape& s) noexcept {
  // Shapes the entry point rejects need nothing; the call fails before the check.
  if (s.group < 1 || s.window < 1 || s.kv_len < 1 || s.num_cols < 1 || !within_launch_limits(s)) return 0;
  const auto rows = static_cast<std::size_t>(s.group * s.window);
  const auto ld = static_cast<std::size_t>(logits_ld(s));
  return WorkspacePlan{}.add<float>(rows * ld).add<float>(rows).add<float>(rows).total();
}

template <class Tk>
Status window_scores_impl(const WindowScoreShape& s, const float* q, Rows<Tk> keys, float* out, Workspace ws, void* stream) noexcept {
  constexpr const char* who = "cuda window_scores";
  KVP_RETURN_IF_ERROR(validate_shape(who, s));
  if (s.num_cols == 0) return Status::ok();  // nothing to write (covers kv_len == 0)
  KVP_REQUIRE(q != nullptr, "%s: q is null", who);
  KVP_REQUIRE(out != nullptr, "%s: out is null", who);
  KVP_RETURN_IF_ERROR(validate_keys(who, s, keys));
  KVP_RETURN_IF_ERROR(check_workspace(who, ws, workspace_bytes(s)));

  WindowParams p{};
  p.rows = s.group * s.window;
  p.window = s.window;
  p.head_dim = s.head_dim;
  p.kv_len = s.kv_len;
  p.ld = logits_ld(s);
  p.q_pos0 = s.q_pos0 < s.kv_len ? s.q_pos0 : s.kv_len;
  p.num_cols = s.num_cols;
  p.scale = s.scale;
  p.inv_w = s.reduce == WindowReduce::kMean ? 1.0f / static_cast<float>(s.window) : 1.0f;

  WorkspaceCarver carve(ws);
  float* logits = carve.take<float>(static_cast<std::size_t>(p.rows * p.ld));
  float* row_max = carve.take<float>(static_cast<std::size_t>(p.rows));
  float* row_scale = carve.take<float>(static_cast<std::size_t>(p.rows));
  if (logits == nullptr || row_max == nullptr || row_scale == nullptr) {
    // Unreachable after check_workspace (same plan); kept so a mismatch can never launch on null.
    return Status::error(StatusCode::kWorkspaceTooSmall, "%s: workspace could not be carved", who);
  }

  const cudaStream_t st = as_stream(stream);
  const dim3 logit_grid(static_cast<unsigned>((p.ld + kTile - 1) / kTile), static_cast<unsigned>((p.rows + kTile - 1) / kTile));
  window_logits_kernel<Tk><<<logit_grid, kLogitThreads, 0, st>>>(p, q, keys, logits);
  window_row_stats_kernel<<<static_cast<unsigned>(p.rows), kStatThreads, 0, st>>>(p, logits, row_max, row_scale);
  const dim3 reduce_grid(static_cast<unsigned>((p.num_cols + kReduceThreads - 1) / kReduceThreads), static_cast<unsigned>(s.group));
  window_reduce_kernel<<<reduce_grid, kReduceThreads, 0, st>>>(p, logits, row_max, row_scale, out);
  return launch_status(who);
}

}  // namespace
}  // namespace cuda_detail

namespace backend {

std::size_t Cuda::window_scores_workspace(const WindowScoreShape& s) noexcept { return cuda_detail::workspace_bytes(s); }

Status Cuda::window_scores(const WindowScoreShape& s, const float* q_device, Rows<float> keys_device, float* out_device,
                           Workspace ws_device, void* stream) noexcept {
  return cuda_detail::window_scores_impl(s, q_device, keys_device, out_device, ws_device, stream);
}

Status Cuda::window_scores(const WindowScoreShape& s, const float* q_device, Rows<half> keys_device, float* out_device, Workspace ws_device,
                           void* stream) noexcept {
  return cuda_detail::window_scores_impl(s, q_device, keys_device, out_device, ws_device, stream);
}

Status Cuda::window_scores(const WindowScoreShape& s, const float* q_device, Rows<bfloat16> keys_device, float* out_device,
                           Workspace ws_device, void* stream) noexcept {
  return cuda_detail::window_scores_impl(s, q_device, keys_device, out_device, ws_device, stream);
}

}  // namespace backend
KVP_NAMESPACE_END
