// SPDX-License-Identifier: Apache-2.0
// `Cuda::merge_head`: one kv head's nearest-kept linear merge
// (`ScalarMergeOps::merge_head`, ops/merge_scalar.hpp) on device memory, for
// kvpress MergingPress, LOOK-M and NearestKeptMerge on backend::Cuda.
//
// Five launches on the current stream, no allocation, no synchronisation:
//   1. every token's key widened and divided by max(norm, eps) into the
//      workspace (one thread per token; the squares in the reference's 16
//      partial sums and fixed tree);
//   2. the evicted ids, the ascending complement of the kept ids (one thread
//      per token, a binary search in the kept row);
//   3. the nearest kept slot of every evicted token (one thread per evicted
//      token, kept slots in ascending order: the earliest maximum wins, a NaN
//      never does);
//   4. the rule (one block): threshold and quantile gates, beta, per-slot
//      totals summed in ascending evicted order, scales, dense plan entries,
//      the per-slot lists of merged tokens, the state re-pack;
//   5. the merged rows (one block per kept slot, threads over head_dim), for
//      keys and for values.
// Every product and sum is one round-to-nearest fp32 (or fp64 for value
// norms) operation in the reference's order and the file is compiled without
// FMA contraction, so the results equal the scalar reference bit for bit.
// The quantile's order statistics are found by counting (rank of each
// element), which picks the same values as the reference's sort.
#include <cmath>
#include <cstdint>
#include <limits>

#include "cuda_common.cuh"
#include "kvpolicy/backends/cuda.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda_detail {
namespace {

constexpr int kThreads = 128;
constexpr int kRuleThreads = 1024;

unsigned blocks_for(std::int64_t n) noexcept { return grid_blocks(n, kThreads); }

/// The reference's 16-partial-sum tree (ScalarReduceOps::sum16).
__device__ __forceinline__ float sum16(const float* p) {
  float s8[8], s4[4];
#pragma unroll
  for (int k = 0; k < 8; ++k) s8[k] = __fadd_rn(p[k], p[k + 8]);
#pragma unroll
  for (int k = 0; k < 4; ++k) s4[k] = __fadd_rn(s8[k], s8[k + 4]);
  return __fadd_rn(__fadd_rn(s4[0], s4[2]), __fadd_rn(s4[1], s4[3]));
}

/// sum16 of the products a[c] * b[c], c < d, partial sum c % 16 (ScalarReduceOps::row_dots).
__device__ __forceinline__ float dot16(const float* a, const float* b, std::int64_t d) {
  float p[16];
#pragma unroll
  for (int k = 0; k < 16; ++k) p[k] = 0.0f;
  std::int64_t c0 = 0;
  for (; c0 + 16 <= d; c0 += 16) {
#pragma unroll
    for (int k = 0; k < 16; ++k) p[k] = __fadd_rn(p[k], __fmul_rn(a[c0 + k], b[c0 + k]));
  }
#pragma unroll
  for (int k = 0; k < 16; ++k)
    if (c0 + k < d) p[k] = __fadd_rn(p[k], __fmul_rn(a[c0 + k], b[c0 + k]));
  return sum16(p);
}

/// sqrt(sum of squares in fp64, ascending) as fp32 (ScalarReduceOps::row_norm).
template <class T>
__device__ __forceinline__ float row_norm(const T* v, std::int64_t d) {
  double ss = 0.0;
  for (std::int64_t i = 0; i < d; ++i) {
    const double x = load_f32(v + i);
    ss = __dadd_rn(ss, __dmul_rn(x, x));
  }
  return static_cast<float>(sqrt(ss));
}

/// Launch 1: nk[j] = K[j] / max(|K[j]|, eps) (as `detail::load_row`; eps <= 0: not divided).
template <class Tk>
__global__ void normalise_kernel(Rows<Tk> keys, std::int64_t T, std::int64_t d, float eps, float* __restrict__ nk) {
  for (std::int64_t j = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; j < T;
       j += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const Tk* r = keys.row(j);
    float* o = nk + j * d;
    for (std::int64_t c = 0; c < d; ++c) o[c] = load_f32(r + c);
    if (eps > 0.0f) {
      const float n = __fsqrt_rn(dot16(o, o, d));
      const float inv = __fdiv_rn(1.0f, n < eps ? eps : n);  // std::max(n, eps): a NaN norm stays NaN
      for (std::int64_t c = 0; c < d; ++c) o[c] = __fmul_rn(o[c], inv);
    }
  }
}

/// Launch 2: evicted[i] = the i-th token id not in `kept`; target -1, sim NaN.
__global__ void evicted_kernel(const std::int32_t* __restrict__ kept, std::int64_t C, std::int64_t T, std::int32_t* __restrict__ evicted,
                               std::int32_t* __restrict__ target, float* __restrict__ sim) {
  for (std::int64_t j = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; j < T;
       j += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    std::int64_t lo = 0, hi = C;  // lower bound of j in kept
    while (lo < hi) {
      const std::int64_t mid = (lo + hi) / 2;
      if (kept[mid] < j)
        lo = mid + 1;
      else
        hi = mid;
    }
    if (lo < C && kept[lo] == j) continue;
    const std::int64_t i = j - lo;
    evicted[i] = static_cast<std::int32_t>(j);
    target[i] = -1;
    sim[i] = __int_as_float(0x7fc00000);
  }
}

/// Launch 3: the kept slot whose normalised key has the largest dot with evicted token i's.
__global__ void nearest_kernel(const float* __restrict__ nk, const std::int32_t* __restrict__ kept, std::int64_t C,
                               const std::int32_t* __restrict__ evicted, std::int64_t E, std::int64_t d, std::int32_t* __restrict__ target,
                               float* __restrict__ sim) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < E;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float* ev = nk + static_cast<std::int64_t>(evicted[i]) * d;
    std::int32_t best = -1;
    float bs = __int_as_float(0x7fc00000);
    for (std::int64_t c = 0; c < C; ++c) {
      const float v = dot16(nk + static_cast<std::int64_t>(kept[c]) * d, ev, d);
      if (v == v && (best < 0 || v > bs)) {
        bs = v;
        best = static_cast<std::int32_t>(c);
      }
    }
    target[i] = best;
    sim[i] = bs;
  }
}

/// The workspace arrays of one head (carved in `carve`, in this order).
struct Scratch {
  float* nk;               // (T, d) normalised keys
  std::int32_t* evicted;   // (T)
  std::int32_t* target;    // (T)
  float* sim;              // (T)
  float* beta;             // (T)
  float* slot_sum;         // (T)
  std::int32_t* count;     // (T)
  float* scale;            // (T)
  float* self;             // (T)
  std::int32_t* list_ptr;  // (T + 1)
  std::int32_t* list;      // (T)
  float* new_w;            // (T)
};

WorkspacePlan plan_of(std::int64_t T, std::int64_t d) noexcept {
  const auto t = static_cast<std::size_t>(T > 1 ? T : 1), dd = static_cast<std::size_t>(d > 1 ? d : 1);
  WorkspacePlan p;
  p.add<float>(t * dd).add<std::int32_t>(t).add<std::int32_t>(t).add<float>(t).add<float>(t).add<float>(t);
  p.add<std::int32_t>(t).add<float>(t).add<float>(t).add<std::int32_t>(t + 1).add<std::int32_t>(t).add<float>(t);
  return p;
}

Scratch carve(Workspace ws, std::int64_t T, std::int64_t d) noexcept {
  const auto t = static_cast<std::size_t>(T > 1 ? T : 1), dd = static_cast<std::size_t>(d > 1 ? d : 1);
  WorkspaceCarver c(ws);
  Scratch s{};
  s.nk = c.take<float>(t * dd);
  s.evicted = c.take<std::int32_t>(t);
  s.target = c.take<std::int32_t>(t);
  s.sim = c.take<float>(t);
  s.beta = c.take<float>(t);
  s.slot_sum = c.take<float>(t);
  s.count = c.take<std::int32_t>(t);
  s.scale = c.take<float>(t);
  s.self = c.take<float>(t);
  s.list_ptr = c.take<std::int32_t>(t + 1);
  s.list = c.take<std::int32_t>(t);
  s.new_w = c.take<float>(t);
  return s;
}

__device__ __forceinline__ float gated_sim(const Scratch& s, std::int64_t i) {
  return s.target[i] >= 0 ? s.sim[i] : -__int_as_float(0x7f800000);
}

/// Launch 4 (one block): steps 2-4 of `MergeRule` and the plan entries.
template <class Tk>
__global__ void __launch_bounds__(kRuleThreads)
    rule_kernel(MergeRule rule, Rows<Tk> values, const std::int32_t* __restrict__ kept, std::int64_t C, std::int64_t E, std::int64_t d,
                float* __restrict__ w, Scratch s, std::int32_t* __restrict__ dst, std::int32_t* __restrict__ src,
                float* __restrict__ weight) {
  __shared__ float a_s, b_s, q_s;
  const int tid = threadIdx.x, nt = blockDim.x;
  for (std::int64_t i = tid; i < E; i += nt)
    if (!(s.sim[i] >= rule.threshold)) s.target[i] = -1;
  __syncthreads();
  if (rule.fraction < 1.0f && E > 0) {
    const auto q = static_cast<float>(1.0 - static_cast<double>(rule.fraction));
    const float rank = __fmul_rn(q, static_cast<float>(E - 1));
    const auto below = static_cast<std::int64_t>(rank), above = static_cast<std::int64_t>(ceilf(rank));
    for (std::int64_t i = tid; i < E; i += nt) {  // x_i sits at sorted positions [lo, lo + eq)
      const float xi = gated_sim(s, i);
      std::int64_t lo = 0, eq = 0;
      for (std::int64_t j = 0; j < E; ++j) {
        const float xj = gated_sim(s, j);
        lo += xj < xi;
        eq += xj == xi;
      }
      if (lo <= below && below < lo + eq) a_s = xi;  // equal values: every writer writes the same bits
      if (lo <= above && above < lo + eq) b_s = xi;
    }
    __syncthreads();
    if (tid == 0) {
      const float f = __fsub_rn(rank, static_cast<float>(below)), a = a_s, b = b_s, diff = __fsub_rn(b, a);
      q_s = f < 0.5f ? __fadd_rn(a, __fmul_rn(f, diff)) : __fsub_rn(b, __fmul_rn(diff, __fsub_rn(1.0f, f)));
    }
    __syncthreads();
    const float qv = q_s;
    for (std::int64_t i = tid; i < E; i += nt)
      if (s.target[i] >= 0 && !(s.sim[i] >= qv)) s.target[i] = -1;
    __syncthreads();
  }
  for (std::int64_t i = tid; i < E; i += nt) {
    if (s.target[i] < 0) continue;
    const float sp = s.sim[i] < 0.0f ? 0.0f : s.sim[i];  // std::max(s, 0.0f), the sign of a zero included
    float b = rule.beta_value;
    if (rule.beta == MergeBeta::kValueNorms) {
      const float en = row_norm(values.row(s.evicted[i]), d), tn = row_norm(values.row(kept[s.target[i]]), d);
      b = __fdiv_rn(__fmul_rn(sp, en), __fadd_rn(__fadd_rn(en, tn), rule.value_eps));
    } else if (rule.beta == MergeBeta::kStateWeight) {
      b = __fmul_rn(w[s.evicted[i]], rule.scale_by_similarity ? sp : 1.0f);
    } else if (rule.beta == MergeBeta::kSimilarity) {
      b = s.sim[i];
    }
    s.beta[i] = b;
    if (rule.beta != MergeBeta::kSimilarity && !(b > 0.0f)) s.target[i] = -1;
  }
  __syncthreads();
  const bool state = rule.uses_state();
  for (std::int64_t c = tid; c < C; c += nt) {  // totals in ascending evicted order, as the reference's scatter
    float sum = 0.0f;
    std::int32_t n = 0;
    for (std::int64_t i = 0; i < E; ++i)
      if (s.target[i] == c) {
        sum = __fadd_rn(sum, s.beta[i]);
        ++n;
      }
    s.slot_sum[c] = sum;
    s.count[c] = n;
    const float wc = state ? w[kept[c]] : 1.0f;
    s.self[c] = rule.self == MergeSelf::kOnePlusHalfCount ? __fadd_rn(1.0f, __fmul_rn(0.5f, static_cast<float>(n)))
                : rule.self == MergeSelf::kStateWeight    ? wc
                                                          : 1.0f;
    const float den = rule.norm == MergeNorm::kOnePlusCount  ? __fadd_rn(1.0f, static_cast<float>(n))
                      : rule.norm == MergeNorm::kSelfPlusSum ? __fadd_rn(wc, sum)
                                                             : __fadd_rn(1.0f, sum);
    s.scale[c] = __fdiv_rn(1.0f, den);
    if (state) s.new_w[c] = __fadd_rn(wc, sum);
  }
  __syncthreads();
  if (tid == 0) {
    s.list_ptr[0] = 0;
    for (std::int64_t c = 0; c < C; ++c) s.list_ptr[c + 1] = s.list_ptr[c] + s.count[c];
  }
  for (std::int64_t i = tid; i < E; i += nt) {
    const std::int32_t t = s.target[i];
    dst[i] = t;
    src[i] = s.evicted[i];
    weight[i] = t >= 0 ? __fmul_rn(s.beta[i], s.scale[t]) : 0.0f;
  }
  __syncthreads();
  for (std::int64_t c = tid; c < C; c += nt) {
    std::int32_t n = s.list_ptr[c];
    for (std::int64_t i = 0; i < E; ++i)
      if (s.target[i] == c) s.list[n++] = static_cast<std::int32_t>(i);
    if (state) w[c] = s.new_w[c];  // every read of w happened before the barrier above
  }
}

/// Launch 5: X'[c] = (self_c X[kept[c]] + sum_{e -> c} beta_e X[e]) * scale_c for slots that received tokens.
template <class Tk>
__global__ void merged_rows_kernel(Rows<Tk> x, const std::int32_t* __restrict__ kept, std::int64_t C, std::int64_t d, Scratch s,
                                   float* __restrict__ out, std::int64_t ld) {
  for (std::int64_t c = blockIdx.x; c < C; c += gridDim.x) {
    if (s.count[c] == 0) continue;
    const std::int32_t b = s.list_ptr[c], e = s.list_ptr[c + 1];
    const Tk* xc = x.row(kept[c]);
    for (std::int64_t k = threadIdx.x; k < d; k += blockDim.x) {
      float acc = 0.0f;
      for (std::int32_t n = b; n < e; ++n) {
        const std::int32_t i = s.list[n];
        acc = __fadd_rn(acc, __fmul_rn(s.beta[i], load_f32(x.row(s.evicted[i]) + k)));
      }
      out[c * ld + k] = __fmul_rn(__fadd_rn(__fmul_rn(s.self[c], load_f32(xc + k)), acc), s.scale[c]);
    }
  }
}

/// C == 0: every token is evicted and none is merged.
__global__ void unmerged_kernel(const std::int32_t* __restrict__ evicted, std::int64_t E, std::int32_t* __restrict__ dst,
                                std::int32_t* __restrict__ src, float* __restrict__ weight) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < E;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = -1;
    src[i] = evicted[i];
    weight[i] = 0.0f;
  }
}

/// D2O's threshold (one thread, the reference's fp64 sum in its order) and shared decision (threads over tokens).
__global__ void d2o_decide_kernel(const float* __restrict__ sim, std::int32_t* __restrict__ target, std::int64_t H, std::int64_t E,
                                  float alpha, float beta, D2OState* __restrict__ state) {
  __shared__ float tau_s;
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (std::int64_t k = 0; k < H * E; ++k) total = __dadd_rn(total, static_cast<double>(sim[k]));
    const auto mean_s = static_cast<float>(__ddiv_rn(total, static_cast<double>(H * E)));
    const float tau = state->initialised ? __fadd_rn(__fmul_rn(alpha, state->tau), __fmul_rn(beta, mean_s)) : mean_s;
    state->tau = tau;
    state->initialised = true;
    tau_s = tau;
  }
  __syncthreads();
  const float tau = tau_s, hf = static_cast<float>(H);
  for (std::int64_t i = threadIdx.x; i < E; i += blockDim.x) {
    float m = 0.0f;
    for (std::int64_t g = 0; g < H; ++g) m = __fadd_rn(m, sim[g * E + i]);
    if (!(__fdiv_rn(m, hf) >= tau))
      for (std::int64_t g = 0; g < H; ++g) target[g * E + i] = -1;
  }
}

bool shape_ok(const char* who, std::int64_t C, std::int64_t T, std::int64_t d) noexcept {
  if (T < 0 || C < 0 || C > T || d < 1) {
    record_error(KVP_INVALID("%s: C=%lld, T=%lld, d=%lld, need 0 <= C <= T and d >= 1", who, static_cast<long long>(C),
                             static_cast<long long>(T), static_cast<long long>(d)));
    return false;
  }
  return true;
}

bool workspace_ok(const char* who, Workspace ws, std::int64_t T, std::int64_t d) noexcept {
  const std::size_t need = plan_of(T, d).total();
  if (ws.bytes < need || ws.data == nullptr) {
    record_error(Status::error(StatusCode::kWorkspaceTooSmall, "%s: workspace is %zu bytes, needs %zu", who, ws.bytes, need));
    return false;
  }
  return true;
}

/// Launches 1-3 into evicted / target / sim (E = T - C entries).
template <class Tk>
void nearest_launches(const Rows<Tk>& keys, const std::int32_t* kept, std::int64_t C, std::int64_t T, std::int64_t d, float eps,
                      std::int32_t* evicted, std::int32_t* target, float* sim, const Scratch& s, cudaStream_t st) noexcept {
  const std::int64_t E = T - C;
  if (C > 0) normalise_kernel<Tk><<<blocks_for(T), kThreads, 0, st>>>(keys, T, d, eps, s.nk);
  evicted_kernel<<<blocks_for(T), kThreads, 0, st>>>(kept, C, T, evicted, target, sim);
  if (C > 0 && E > 0) nearest_kernel<<<blocks_for(E), kThreads, 0, st>>>(s.nk, kept, C, evicted, E, d, target, sim);
}

/// Launches 4-5 on the arrays of `nearest_launches` (target gated in place).
template <class Tk>
void apply_launches(const MergeRule& rule, const Rows<Tk>& keys, const Rows<Tk>& values, const std::int32_t* kept, std::int64_t C,
                    std::int64_t T, std::int64_t d, float* w, const std::int32_t* evicted, std::int32_t* target, const float* sim,
                    std::int32_t* dst, std::int32_t* src, float* weight, float* merged_keys, std::int64_t kld, float* merged_values,
                    std::int64_t vld, Scratch s, cudaStream_t st) noexcept {
  const std::int64_t E = T - C;
  if (E == 0) return;  // nothing evicted: nothing to write (the state re-pack is the identity)
  if (C == 0) {
    unmerged_kernel<<<blocks_for(E), kThreads, 0, st>>>(evicted, E, dst, src, weight);
    return;
  }
  s.evicted = const_cast<std::int32_t*>(evicted);  // read only by the kernels below
  s.target = target;
  s.sim = const_cast<float*>(sim);
  rule_kernel<Tk><<<1, kRuleThreads, 0, st>>>(rule, values, kept, C, E, d, w, s, dst, src, weight);
  const unsigned slots = static_cast<unsigned>(C < 65535 ? C : 65535);
  if (merged_keys != nullptr) merged_rows_kernel<Tk><<<slots, kThreads, 0, st>>>(keys, kept, C, d, s, merged_keys, kld);
  if (merged_values != nullptr) merged_rows_kernel<Tk><<<slots, kThreads, 0, st>>>(values, kept, C, d, s, merged_values, vld);
}

}  // namespace
}  // namespace cuda_detail

namespace backend {

std::size_t Cuda::merge_head_workspace(std::int64_t T, std::int64_t d) noexcept { return cuda_detail::plan_of(T, d).total(); }

template <class Tk>
void Cuda::merge_nearest(const Rows<Tk>& keys, const std::int32_t* kept, std::int64_t C, std::int64_t T, std::int64_t d, float eps,
                         std::int32_t* evicted, std::int32_t* target, float* sim, Workspace ws) noexcept {
  using namespace cuda_detail;
  constexpr const char* who = "cuda merge_nearest";
  if (!shape_ok(who, C, T, d) || T == C) return;
  if (evicted == nullptr || target == nullptr || sim == nullptr)
    return record_error(KVP_INVALID("%s: evicted, target or sim is null", who));
  if ((C > 0 && kept == nullptr) || keys.base == nullptr) return record_error(KVP_INVALID("%s: kept or keys is null", who));
  if (!workspace_ok(who, ws, T, d)) return;
  nearest_launches(keys, kept, C, T, d, eps, evicted, target, sim, carve(ws, T, d), as_stream(current_stream()));
  record_error(launch_status(who));
}

template <class Tk>
void Cuda::merge_apply(const MergeRule& rule, const Rows<Tk>& keys, const Rows<Tk>& values, const std::int32_t* kept, std::int64_t C,
                       std::int64_t T, std::int64_t d, float* w, const std::int32_t* evicted, std::int32_t* target, const float* sim,
                       std::int32_t* dst, std::int32_t* src, float* weight, float* merged_keys, std::int64_t kld, float* merged_values,
                       std::int64_t vld, Workspace ws) noexcept {
  using namespace cuda_detail;
  constexpr const char* who = "cuda merge_apply";
  if (!shape_ok(who, C, T, d) || T == C) return;  // nothing evicted: nothing to write
  if (dst == nullptr || src == nullptr || weight == nullptr || evicted == nullptr || target == nullptr || sim == nullptr)
    return record_error(KVP_INVALID("%s: dst, src, weight, evicted, target or sim is null", who));
  if (C > 0 && (kept == nullptr || keys.base == nullptr || values.base == nullptr))
    return record_error(KVP_INVALID("%s: kept, keys or values is null", who));
  if (C > 0 && rule.uses_state() && w == nullptr) return record_error(KVP_INVALID("%s: the rule reads state weights, w is null", who));
  if (!workspace_ok(who, ws, T, d)) return;
  apply_launches(rule, keys, values, kept, C, T, d, w, evicted, target, sim, dst, src, weight, merged_keys, kld, merged_values, vld,
                 carve(ws, T, d), as_stream(current_stream()));
  record_error(launch_status(who));
}

template <class Tk>
void Cuda::merge_head(const MergeRule& rule, const Rows<Tk>& keys, const Rows<Tk>& values, const std::int32_t* kept, std::int64_t C,
                      std::int64_t T, std::int64_t d, float* w, std::int32_t* dst, std::int32_t* src, float* weight, float* merged_keys,
                      std::int64_t kld, float* merged_values, std::int64_t vld, Workspace ws) noexcept {
  using namespace cuda_detail;
  constexpr const char* who = "cuda merge_head";
  if (!shape_ok(who, C, T, d) || T == C) return;  // nothing evicted: nothing to write (the state re-pack is the identity)
  if (dst == nullptr || src == nullptr || weight == nullptr) return record_error(KVP_INVALID("%s: dst, src or weight is null", who));
  if (C > 0 && (kept == nullptr || keys.base == nullptr || values.base == nullptr))
    return record_error(KVP_INVALID("%s: kept, keys or values is null", who));
  if (C > 0 && rule.uses_state() && w == nullptr) return record_error(KVP_INVALID("%s: the rule reads state weights, w is null", who));
  if (!workspace_ok(who, ws, T, d)) return;
  const Scratch s = carve(ws, T, d);
  const cudaStream_t st = as_stream(current_stream());
  nearest_launches(keys, kept, C, T, d, rule.eps, s.evicted, s.target, s.sim, s, st);
  apply_launches(rule, keys, values, kept, C, T, d, w, s.evicted, s.target, s.sim, dst, src, weight, merged_keys, kld, merged_values, vld,
                 s, st);
  record_error(launch_status(who));
}

void Cuda::d2o_decide(const float* sim, std::int32_t* target, std::int64_t H, std::int64_t E, float alpha, float beta,
                      D2OState* state) noexcept {
  using namespace cuda_detail;
  constexpr const char* who = "cuda d2o_decide";
  if (H < 1 || E < 0)
    return record_error(
        KVP_INVALID("%s: H=%lld, E=%lld, need H >= 1 and E >= 0", who, static_cast<long long>(H), static_cast<long long>(E)));
  if (E == 0) return;
  if (sim == nullptr || target == nullptr || state == nullptr) return record_error(KVP_INVALID("%s: sim, target or state is null", who));
  d2o_decide_kernel<<<1, 256, 0, as_stream(current_stream())>>>(sim, target, H, E, alpha, beta, state);
  record_error(launch_status(who));
}

#define KVP_CUDA_MERGE_OPS(T)                                                                                                              \
  template void Cuda::merge_head<T>(const MergeRule&, const Rows<T>&, const Rows<T>&, const std::int32_t*, std::int64_t, std::int64_t,     \
                                    std::int64_t, float*, std::int32_t*, std::int32_t*, float*, float*, std::int64_t, float*,              \
                                    std::int64_t, Workspace) noexcept;                                                                     \
  template void Cuda::merge_nearest<T>(const Rows<T>&, const std::int32_t*, std::int64_t, std::int64_t, std::int64_t, float,               \
                                       std::int32_t*, std::int32_t*, float*, Workspace) noexcept;                                          \
  template void Cuda::merge_apply<T>(const MergeRule&, const Rows<T>&, const Rows<T>&, const std::int32_t*, std::int64_t, std::int64_t,    \
                                     std::int64_t, float*, const std::int32_t*, std::int32_t*, const float*, std::int32_t*, std::int32_t*, \
                                     float*, float*, std::int64_t, float*, std::int64_t, Workspace) noexcept;
KVP_CUDA_MERGE_OPS(float)
KVP_CUDA_MERGE_OPS(half)
KVP_CUDA_MERGE_OPS(bfloat16)
#undef KVP_CUDA_MERGE_OPS

}  // namespace backend
KVP_NAMESPACE_END
