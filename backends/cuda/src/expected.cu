// SPDX-License-Identifier: Apache-2.0
// Expected Attention's per-head steps on the device (ops/expected_steps.hpp
// gives the semantics and the host reference; the policy is
// policy/eviction/expected_attention.hpp).
//
// Arithmetic: every product and sum is a round-to-nearest intrinsic in the
// reference's order (nvcc would otherwise contract a*b + c into an FMA), so
// the statistics, their rotation and the expected logits are bit-identical to
// `backend::Scalar`. The softmax differs: the device `expf` (within 2 ulp of
// the host's) and the denominator summed per 256-key block, then over the
// blocks (fixed order, so run-to-run reproducible): scores agree with the
// reference to about 1e-6 relative.
//
// Launch shapes (the first version aims at correctness): the mean one thread
// per channel; the covariance one thread per (i, j >= i) pair over the tokens;
// the rotation one block; the logits one thread per key (d^2 dependent adds
// with the covariance); the softmax three small launches. Each query head is
// its own round of launches.
//
// Measured on an H100 (2026-12-05, bench_cuda_policies CudaExpectedAttention,
// 32 query / 8 kv heads, d = 128): 110 ms at 4K tokens, 320 ms at 32K, far
// from SnapKV's 1 ms on the same shape. Not profiled yet. The launch shapes
// use little of the GPU (per query head, 32 rounds in a row: the mean on 128
// threads, the covariance on 8,256 pairs in 64 blocks, each a serial chain
// over every token; the logits one chain of d^2 steps per key), but rough
// counts of their instructions and latencies give a few ms per layer, not
// hundreds: the first device session with time to spare should run
// `ncu`/`nsys` on CudaExpectedAttention/4096 before changing a kernel.
#include <cub/block/block_reduce.cuh>

#include <cmath>
#include <cstdint>

#include "cuda_common.cuh"
#include "kvpolicy/backends/cuda.hpp"
#include "kvpolicy/ops/expected_steps.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda_detail {
namespace {

constexpr int kThreads = 256;
constexpr std::int64_t kMaxDim = ops::kExpectedMaxDeviceDim;

unsigned blocks(std::int64_t n) noexcept { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

/// The averaged RoPE tables, by value (2 KiB of launch arguments).
struct RopeTables {
  float cb[kMaxDim];
  float sb[kMaxDim];
};

template <class Tq>
struct QueryView {
  const Tq* data;
  std::int64_t s0, s1, s2;
  __device__ float at(std::int64_t h, std::int64_t t, std::int64_t i) const { return load_f32(data + h * s0 + t * s1 + i * s2); }
};

template <class Tq>
__global__ void mean_kernel(QueryView<Tq> q, std::int64_t head, std::int64_t t0, std::int64_t t1, std::int64_t d, double* __restrict__ mu) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= d) return;
  double acc = 0.0;
  for (std::int64_t t = t0; t < t1; ++t) acc = __dadd_rn(acc, static_cast<double>(q.at(head, t, i)));
  mu[i] = __ddiv_rn(acc, static_cast<double>(t1 - t0));
}

/// cov[i][j] = cov[j][i] for the pair (i, j >= i) of this thread: centred fp32 products summed per 64 tokens, the blocks in double.
template <class Tq>
__global__ void cov_kernel(QueryView<Tq> q, std::int64_t head, std::int64_t t0, std::int64_t t1, std::int64_t d,
                           const double* __restrict__ mu, double* __restrict__ cov) {
  const std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (e >= d * d) return;
  const std::int64_t i = e / d, j = e - i * d;
  if (j < i) return;
  const double mi = mu[i], mj = mu[j];
  double acc = 0.0;
  for (std::int64_t tb = t0; tb < t1; tb += ops::kExpectedStatBlock) {
    const std::int64_t te = tb + ops::kExpectedStatBlock < t1 ? tb + ops::kExpectedStatBlock : t1;
    float blk = 0.0f;
    for (std::int64_t t = tb; t < te; ++t) {
      const float ci = __double2float_rn(__dsub_rn(static_cast<double>(q.at(head, t, i)), mi));
      const float cj = __double2float_rn(__dsub_rn(static_cast<double>(q.at(head, t, j)), mj));
      blk = __fmaf_rn(ci, cj, blk);
    }
    acc = __dadd_rn(acc, static_cast<double>(blk));
  }
  const double v = __ddiv_rn(acc, static_cast<double>(t1 - t0));
  cov[i * d + j] = v;
  cov[j * d + i] = v;
}

__device__ __forceinline__ double rope_off(const RopeTables& r, std::int64_t i, std::int64_t h) {
  return i < h ? -static_cast<double>(r.sb[i + h]) : static_cast<double>(r.sb[i - h]);
}

/// One block: mf = fp32(R mu); cov <- R cov, covf = fp32((R cov) R^T) when cov is given.
__global__ void rotate_kernel(const double* __restrict__ mu, double* __restrict__ cov, std::int64_t d, RopeTables r, float* __restrict__ mf,
                              float* __restrict__ covf) {
  const std::int64_t h = d / 2;
  for (std::int64_t i = threadIdx.x; i < d; i += blockDim.x) {
    const std::int64_t p = i < h ? i + h : i - h;
    mf[i] = __double2float_rn(__dadd_rn(__dmul_rn(static_cast<double>(r.cb[i]), mu[i]), __dmul_rn(rope_off(r, i, h), mu[p])));
  }
  if (cov == nullptr) return;
  for (std::int64_t e = threadIdx.x; e < h * d; e += blockDim.x) {
    const std::int64_t i = e / d, j = e - i * d;
    const double a = cov[i * d + j], b = cov[(i + h) * d + j];
    cov[i * d + j] = __dadd_rn(__dmul_rn(static_cast<double>(r.cb[i]), a), __dmul_rn(rope_off(r, i, h), b));
    cov[(i + h) * d + j] = __dadd_rn(__dmul_rn(static_cast<double>(r.cb[i + h]), b), __dmul_rn(rope_off(r, i + h, h), a));
  }
  __syncthreads();
  for (std::int64_t e = threadIdx.x; e < d * d; e += blockDim.x) {
    const std::int64_t i = e / d, j = e - i * d, p = j < h ? j + h : j - h;
    covf[e] =
        __double2float_rn(__dadd_rn(__dmul_rn(cov[i * d + j], static_cast<double>(r.cb[j])), __dmul_rn(cov[i * d + p], rope_off(r, j, h))));
  }
}

/// z[j] for one key per thread, in the reference's order (ScalarReduceOps::expected_logits).
template <class Tk>
__global__ void logits_kernel(const float* __restrict__ mean, const float* __restrict__ cov, std::int64_t d, Rows<Tk> keys, std::int64_t j0,
                              std::int64_t j1, float sqrt_d, float* __restrict__ z) {
  const std::int64_t j = j0 + static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (j >= j1) return;
  const Tk* kr = keys.row(j);
  float dot = 0.0f;
  for (std::int64_t i = 0; i < d; ++i) dot = __fmaf_rn(mean[i], load_f32(kr + i), dot);
  float zj = __fdiv_rn(dot, sqrt_d);
  if (cov != nullptr) {
    float quad = 0.0f;
    for (std::int64_t k = 0; k < d; ++k) {
      float tk = 0.0f;  // t[k] = sum_i k_i cov[i][k], i ascending
      for (std::int64_t i = 0; i < d; ++i) tk = __fmaf_rn(load_f32(kr + i), cov[i * d + k], tk);
      quad = __fmaf_rn(tk, load_f32(kr + k), quad);
    }
    zj = __fadd_rn(zj, __fdiv_rn(__fdiv_rn(quad, static_cast<float>(d)), 2.0f));
  }
  z[j] = zj;
}

struct MaxOp {
  __device__ float operator()(float a, float b) const { return a < b ? b : a; }  // a NaN b leaves a, as std::max(mx, z)
};

/// *mx = the max of z[j0, j1) (-inf for an empty range; NaN never wins), one block.
__global__ void max_kernel(const float* __restrict__ z, std::int64_t j0, std::int64_t j1, float* __restrict__ mx) {
  using Reduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  float m = -INFINITY;
  for (std::int64_t j = j0 + threadIdx.x; j < j1; j += kThreads) m = MaxOp{}(m, z[j]);
  const float r = Reduce(tmp).Reduce(m, MaxOp{});
  if (threadIdx.x == 0) *mx = r;
}

/// z[j] = exp(z[j] - mx); the block's sum of them in double into partial[blockIdx.x].
__global__ void exp_kernel(float* __restrict__ z, std::int64_t j0, std::int64_t j1, const float* __restrict__ mx,
                           double* __restrict__ partial) {
  using Reduce = cub::BlockReduce<double, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const std::int64_t j = j0 + static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  double v = 0.0;
  if (j < j1) {
    const float e = expf(__fsub_rn(z[j], *mx));
    z[j] = e;
    v = static_cast<double>(e);
  }
  const double sum = Reduce(tmp).Sum(v);
  if (threadIdx.x == 0) partial[blockIdx.x] = sum;
}

/// *inv = fp32(1 / sum of the partials), the partials added in order by one thread.
__global__ void denominator_kernel(const double* __restrict__ partial, unsigned n, float* __restrict__ inv) {
  if (threadIdx.x != 0) return;
  double denom = 0.0;
  for (unsigned b = 0; b < n; ++b) denom = __dadd_rn(denom, partial[b]);
  *inv = __double2float_rn(__ddiv_rn(1.0, denom));
}

__global__ void accumulate_kernel(const float* __restrict__ z, std::int64_t j0, std::int64_t j1, const float* __restrict__ inv,
                                  float* __restrict__ s) {
  const std::int64_t j = j0 + static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (j < j1) s[j] = __fadd_rn(s[j], __fmul_rn(z[j], *inv));
}

__global__ void finish_kernel(float* __restrict__ s, const float* __restrict__ neg_norm, std::int64_t n0, std::int64_t T, float G,
                              float eps) {
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (j >= T) return;
  if (j < n0) {
    s[j] = INFINITY;
    return;
  }
  float v = __fdiv_rn(s[j], G);
  if (neg_norm != nullptr) v = __fmul_rn(__fadd_rn(v, eps), -neg_norm[j]);
  s[j] = v;
}

void fail(const Status& s) noexcept { record_error(s); }
cudaStream_t stream() noexcept { return as_stream(backend::Cuda::current_stream()); }

template <class Tq>
void statistics_impl(const TensorView<const Tq, 3>& q, std::int64_t head, std::int64_t t0, std::int64_t d, bool use_cov, double* mu,
                     double* cov) noexcept {
  const std::int64_t t1 = q.extent(1);
  if (d < 1 || t1 <= t0 || q.data() == nullptr || mu == nullptr || (use_cov && cov == nullptr))
    return fail(KVP_INVALID("cuda expected_statistics: d=%lld, rows [%lld, %lld), null queries / mu / cov", static_cast<long long>(d),
                            static_cast<long long>(t0), static_cast<long long>(t1)));
  const QueryView<Tq> v{q.data(), q.stride(0), q.stride(1), q.stride(2)};
  mean_kernel<<<blocks(d), kThreads, 0, stream()>>>(v, head, t0, t1, d, mu);
  if (use_cov) cov_kernel<<<blocks(d * d), kThreads, 0, stream()>>>(v, head, t0, t1, d, mu, cov);
  fail(launch_status("cuda expected_statistics"));
}

template <class Tk>
void logits_impl(const float* mean, const float* cov, std::int64_t d, const Rows<Tk>& keys, std::int64_t j0, std::int64_t j1, float* z,
                 float* mx) noexcept {
  if (mean == nullptr || z == nullptr || mx == nullptr || keys.base == nullptr || d < 1)
    return fail(KVP_INVALID("cuda expected_logits_max: null mean / z / mx / keys or d < 1"));
  const float sqrt_d = static_cast<float>(std::sqrt(static_cast<double>(d)));
  if (j1 > j0) logits_kernel<Tk><<<blocks(j1 - j0), kThreads, 0, stream()>>>(mean, cov, d, keys, j0, j1, sqrt_d, z);
  max_kernel<<<1, kThreads, 0, stream()>>>(z, j0, j1, mx);
  fail(launch_status("cuda expected_logits_max"));
}

}  // namespace
}  // namespace cuda_detail

namespace backend {

template <class Tq>
void Cuda::expected_statistics(const TensorView<const Tq, 3>& q, std::int64_t head, std::int64_t t0, std::int64_t d, bool use_cov,
                               double* mu, double* cov, float*, float*) noexcept {
  cuda_detail::statistics_impl(q, head, t0, d, use_cov, mu, cov);
}
template void Cuda::expected_statistics<float>(const TensorView<const float, 3>&, std::int64_t, std::int64_t, std::int64_t, bool, double*,
                                               double*, float*, float*) noexcept;
template void Cuda::expected_statistics<half>(const TensorView<const half, 3>&, std::int64_t, std::int64_t, std::int64_t, bool, double*,
                                              double*, float*, float*) noexcept;
template void Cuda::expected_statistics<bfloat16>(const TensorView<const bfloat16, 3>&, std::int64_t, std::int64_t, std::int64_t, bool,
                                                  double*, double*, float*, float*) noexcept;

void Cuda::expected_rotate(const double* mu, double* cov, std::int64_t d, const float* cb, const float* sb, float* mf,
                           float* covf) noexcept {
  using namespace cuda_detail;
  if (d < 2 || d % 2 != 0 || d > kMaxDim)
    return fail(Status::error(StatusCode::kUnsupported, "cuda expected_rotate: head_dim %lld, must be even in [2, %lld]",
                              static_cast<long long>(d), static_cast<long long>(kMaxDim)));
  if (mu == nullptr || mf == nullptr || cb == nullptr || sb == nullptr || (cov != nullptr && covf == nullptr))
    return fail(KVP_INVALID("cuda expected_rotate: null mu, mf, RoPE tables or covf"));
  RopeTables r{};
  for (std::int64_t i = 0; i < d; ++i) {  // host tables, copied into the launch arguments
    r.cb[i] = cb[i];
    r.sb[i] = sb[i];
  }
  rotate_kernel<<<1, 1024, 0, stream()>>>(mu, cov, d, r, mf, covf);
  fail(launch_status("cuda expected_rotate"));
}

template <class Tk>
void Cuda::expected_logits_max(const float* mean, const float* cov, std::int64_t d, const Rows<Tk>& keys, std::int64_t j0, std::int64_t j1,
                               float* z, float*, float* mx) noexcept {
  cuda_detail::logits_impl(mean, cov, d, keys, j0, j1, z, mx);
}
template void Cuda::expected_logits_max<float>(const float*, const float*, std::int64_t, const Rows<float>&, std::int64_t, std::int64_t,
                                               float*, float*, float*) noexcept;
template void Cuda::expected_logits_max<half>(const float*, const float*, std::int64_t, const Rows<half>&, std::int64_t, std::int64_t,
                                              float*, float*, float*) noexcept;
template void Cuda::expected_logits_max<bfloat16>(const float*, const float*, std::int64_t, const Rows<bfloat16>&, std::int64_t,
                                                  std::int64_t, float*, float*, float*) noexcept;

std::size_t Cuda::expected_softmax_workspace(std::int64_t T) noexcept {
  const std::int64_t nb = (std::max<std::int64_t>(T, 1) + cuda_detail::kThreads - 1) / cuda_detail::kThreads;
  return WorkspacePlan{}.add<double>(static_cast<std::size_t>(nb)).add<float>(1).total();
}

void Cuda::expected_softmax(float* z, std::int64_t j0, std::int64_t j1, const float* mx, float* s, Workspace ws) noexcept {
  using namespace cuda_detail;
  if (j1 <= j0) return;
  if (z == nullptr || mx == nullptr || s == nullptr) return fail(KVP_INVALID("cuda expected_softmax: z, mx or s is null"));
  const Status wst = check_workspace("cuda expected_softmax", ws, expected_softmax_workspace(j1));
  if (!wst.is_ok()) return fail(wst);
  WorkspaceCarver c(ws);
  const unsigned nb = blocks(j1 - j0);
  double* partial = c.take<double>(nb);
  float* inv = c.take<float>(1);
  exp_kernel<<<nb, kThreads, 0, stream()>>>(z, j0, j1, mx, partial);
  denominator_kernel<<<1, 32, 0, stream()>>>(partial, nb, inv);
  accumulate_kernel<<<nb, kThreads, 0, stream()>>>(z, j0, j1, inv, s);
  fail(launch_status("cuda expected_softmax"));
}

void Cuda::expected_finish(float* s, const float* neg_norm, std::int64_t n0, std::int64_t T, std::int64_t G, float eps) noexcept {
  using namespace cuda_detail;
  if (T <= 0) return;
  if (s == nullptr || G < 1) return fail(KVP_INVALID("cuda expected_finish: s is null or G=%lld < 1", static_cast<long long>(G)));
  finish_kernel<<<blocks(T), kThreads, 0, stream()>>>(s, neg_norm, n0, T, static_cast<float>(G), eps);
  fail(launch_status("cuda expected_finish"));
}

}  // namespace backend
KVP_NAMESPACE_END
