// SPDX-License-Identifier: Apache-2.0
// ShadowKV's loops on device memory (ops/shadowkv_ops.hpp: semantics and the
// host reference) and the prefetch family's reuse op. The landmarks and the
// outlier cosines are a thread per (chunk, kv head) running the host's
// operations in its order, each rounded as the host rounds it (no FMA
// contraction), so they are the host's bits. The chunk scores are a block per
// kv head: the logits in the host's 8-lane order (the same bits), then each
// query head's softmax with the device's expf and a block-wide double sum (a
// few ulp from the host), then the group max. The priorities are a thread per
// table entry finding its chunks in the ascending top-k rows by binary search
// (the host's max, in any order, is the same value). No allocation, no
// synchronisation: every launch goes on the calling thread's current stream.
#include <cstdint>

#include "block_softmax.cuh"
#include "cuda_common.cuh"
#include "kvpolicy/backends/cuda.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda_detail {
namespace {

constexpr int kThreads = 256;

unsigned blocks_for(std::int64_t n) noexcept { return grid_blocks(n, kThreads); }

__device__ __forceinline__ bool in_sorted(const std::int32_t* row, std::int64_t n, std::int64_t v) {
  const std::int64_t p = sorted_lower_bound(row, n, v);
  return p < n && row[p] == v;
}

template <class Tk>
__global__ void landmarks_kernel(const Tk* __restrict__ k, PageStrides ks, const std::int32_t* __restrict__ seq_pages,
                                 ops::ChunkGeometry geo, std::int64_t first, std::int64_t count, float* __restrict__ landmarks,
                                 float* __restrict__ outlier) {
  const std::int64_t work = count * geo.num_kv_heads;
  const std::int32_t C = geo.chunk_size;
  const std::int64_t d = geo.head_dim;
  for (std::int64_t t = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; t < work;
       t += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t ch = first + t / geo.num_kv_heads;
    const auto g = static_cast<std::int32_t>(t % geo.num_kv_heads);
    const std::int64_t t0 = ch * C;
    const std::int32_t page = seq_pages[t0 / geo.page_size];
    const std::int64_t slot0 = t0 % geo.page_size;
    const Tk* base = k + page * ks.page + g * ks.head + slot0 * ks.slot;
    const std::int64_t slot = geo.slot(seq_pages, ch, g);
    float* L = landmarks + slot * d;
    for (std::int64_t i = 0; i < d; ++i) {
      float s = 0.0f;
      for (std::int32_t j = 0; j < C; ++j) s = __fadd_rn(s, load_f32(base + j * ks.slot + i));
      L[i] = __fdiv_rn(s, static_cast<float>(C));
    }
    float ln = 0.0f;
    for (std::int64_t i = 0; i < d; ++i) ln = __fadd_rn(ln, __fmul_rn(L[i], L[i]));
    float mn = 1.0f;
    for (std::int32_t j = 0; j < C; ++j) {
      const Tk* row = base + j * ks.slot;
      float dot = 0.0f, kn = 0.0f;
      for (std::int64_t i = 0; i < d; ++i) {
        const float x = load_f32(row + i);
        dot = __fadd_rn(dot, __fmul_rn(L[i], x));
        kn = __fadd_rn(kn, __fmul_rn(x, x));
      }
      const float cs = ln > 0.0f && kn > 0.0f ? __fdiv_rn(dot, __fmul_rn(__fsqrt_rn(ln), __fsqrt_rn(kn))) : 1.0f;
      mn = cs < mn ? cs : mn;  // std::min(mn, cs)
    }
    outlier[slot] = mn;
  }
}

__global__ void outlier_keys_kernel(const float* __restrict__ outlier, const std::int32_t* __restrict__ seq_pages, ops::ChunkGeometry geo,
                                    std::int64_t cand, float* __restrict__ out) {
  const std::int64_t n = cand * geo.num_kv_heads;
  for (std::int64_t t = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; t < n;
       t += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const auto g = static_cast<std::int32_t>(t / cand);
    out[t] = -outlier[geo.slot(seq_pages, t % cand, g)];
  }
}

template <class Tq>
__global__ void __launch_bounds__(kThreads)
    chunk_scores_kernel(const Tq* __restrict__ q, std::int64_t qhs, std::int64_t qds, std::int32_t G, float scale,
                        const float* __restrict__ landmarks, const std::int32_t* __restrict__ seq_pages, ops::ChunkGeometry geo,
                        std::int64_t cand, const std::int32_t* __restrict__ oidx, std::int64_t no, float* __restrict__ logits,
                        float* __restrict__ score) {
  __shared__ typename BlockSoftmax<kThreads>::Shared sm;
  const std::int32_t g = blockIdx.x;
  const std::int64_t d = geo.head_dim;
  const std::int32_t* orow = oidx + static_cast<std::int64_t>(g) * no;
  float* lgg = logits + static_cast<std::int64_t>(g) * G * cand;
  for (std::int64_t idx = threadIdx.x; idx < G * cand; idx += blockDim.x) {
    const auto j = static_cast<std::int32_t>(idx / cand);
    const std::int64_t ch = idx - j * cand;
    if (in_sorted(orow, no, ch)) {
      lgg[idx] = neg_inf();
      continue;
    }
    const Tq* qh = q + static_cast<std::int64_t>(g * G + j) * qhs;
    const float* Lm = landmarks + geo.slot(seq_pages, ch, g) * d;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::int64_t i = 0;
    for (; i + 8 <= d; i += 8)
#pragma unroll
      for (int l = 0; l < 8; ++l) acc[l] = __fadd_rn(acc[l], __fmul_rn(__fmul_rn(load_f32(qh + (i + l) * qds), scale), Lm[i + l]));
    float s = __fadd_rn(__fadd_rn(__fadd_rn(acc[0], acc[1]), __fadd_rn(acc[2], acc[3])),
                        __fadd_rn(__fadd_rn(acc[4], acc[5]), __fadd_rn(acc[6], acc[7])));
    for (; i < d; ++i) s = __fadd_rn(s, __fmul_rn(__fmul_rn(load_f32(qh + i * qds), scale), Lm[i]));
    lgg[idx] = s;
  }
  __syncthreads();
  for (std::int32_t j = 0; j < G; ++j)
    BlockSoftmax<kThreads>::run(
        lgg + static_cast<std::int64_t>(j) * cand, cand, [&](std::int64_t ch) { return in_sorted(orow, no, ch); }, sm);
  float* sc = score + static_cast<std::int64_t>(g) * cand;
  for (std::int64_t ch = threadIdx.x; ch < cand; ch += blockDim.x) {
    float acc = lgg[ch];
    for (std::int32_t j = 1; j < G; ++j) {
      const float v = lgg[static_cast<std::int64_t>(j) * cand + ch];
      acc = (v > acc || acc != acc) ? v : acc;  // backend::Scalar::group_reduce's kMax
    }
    sc[ch] = in_sorted(orow, no, ch) ? neg_inf() : acc;
  }
}

__device__ __forceinline__ void raise_to(float& cur, float v) {
  if (v != v) v = neg_inf();
  if (cur != cur || v > cur) cur = v;
}

__global__ void priorities_kernel(ops::ChunkGeometry geo, std::int64_t n, std::int64_t cand, const std::int32_t* __restrict__ oidx,
                                  std::int64_t no, const std::int32_t* __restrict__ sidx, std::int64_t k, const float* __restrict__ score,
                                  float* __restrict__ prio) {
  const std::int32_t ps = geo.page_size, C = geo.chunk_size, cpp = geo.chunks_per_page();
  const std::int64_t entries = (n + ps - 1) / ps;
  const std::int64_t tail_from = min(cand * C / ps, (n - 1) / ps);  // entries holding tokens [cand * C, n), and the last one
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < entries;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    float cur = prio[e];
    if (e >= tail_from) raise_to(cur, pos_inf());
    const std::int64_t lo = e * cpp, hi = lo + cpp;
    for (std::int32_t g = 0; g < geo.num_kv_heads; ++g) {
      const std::int32_t* orow = oidx + static_cast<std::int64_t>(g) * no;
      for (std::int64_t p = sorted_lower_bound(orow, no, lo); p < no && orow[p] < hi; ++p) raise_to(cur, pos_inf());
      const std::int32_t* srow = sidx + static_cast<std::int64_t>(g) * k;
      for (std::int64_t p = sorted_lower_bound(srow, k, lo); p < k && srow[p] < hi; ++p) raise_to(cur, score[g * cand + srow[p]]);
    }
    prio[e] = cur;
  }
}

__global__ void add_reuse_kernel(float* __restrict__ prio, const std::int32_t* __restrict__ entry_pages, std::int64_t entries,
                                 const std::int64_t* __restrict__ used_at, std::int64_t reuse_step, float reuse_priority) {
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < entries;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    if (prio[e] != prio[e] && used_at[entry_pages[e]] == reuse_step) prio[e] = reuse_priority;
}

Status check_geometry(const char* who, const ops::ChunkGeometry& geo) noexcept {
  KVP_REQUIRE(
      geo.chunk_size >= 1 && geo.page_size >= 1 && geo.page_size % geo.chunk_size == 0 && geo.num_kv_heads >= 1 && geo.head_dim >= 1,
      "%s: geometry (page_size %d, chunk_size %d, kv heads %d, head_dim %d): need a page a positive multiple of the chunk, "
      "positive heads and head_dim",
      who, geo.page_size, geo.chunk_size, geo.num_kv_heads, geo.head_dim);
  return Status::ok();
}

template <class Tk>
void launch_landmarks(const Tk* k, const PageStrides& ks, const std::int32_t* seq_pages, const ops::ChunkGeometry& geo, std::int64_t first,
                      std::int64_t count, float* landmarks, float* outlier) noexcept {
  constexpr const char* who = "cuda shadowkv_landmarks";
  if (Status s = check_geometry(who, geo); !s.is_ok()) return record_error(s);
  if (first < 0 || count < 0)
    return record_error(
        KVP_INVALID("%s: first %lld and count %lld must be >= 0", who, static_cast<long long>(first), static_cast<long long>(count)));
  if (count == 0) return;
  if (k == nullptr || seq_pages == nullptr || landmarks == nullptr || outlier == nullptr)
    return record_error(KVP_INVALID("%s: keys, seq_pages, landmarks or outlier is null", who));
  const std::int64_t work = count * geo.num_kv_heads;
  landmarks_kernel<<<blocks_for(work), kThreads, 0, as_stream(backend::Cuda::current_stream())>>>(k, ks, seq_pages, geo, first, count,
                                                                                                  landmarks, outlier);
  record_error(launch_status(who));
}

template <class Tq>
void launch_chunk_scores(const Tq* q, std::int64_t qhs, std::int64_t qds, std::int32_t G, float scale, const float* landmarks,
                         const std::int32_t* seq_pages, const ops::ChunkGeometry& geo, std::int64_t cand, const std::int32_t* oidx,
                         std::int64_t no, float* logits, float* score) noexcept {
  constexpr const char* who = "cuda shadowkv_chunk_scores";
  if (Status s = check_geometry(who, geo); !s.is_ok()) return record_error(s);
  if (G < 1 || cand < 0 || no < 0 || no > cand)
    return record_error(KVP_INVALID("%s: group %d, cand %lld, outliers %lld: need group >= 1 and 0 <= outliers <= cand", who, G,
                                    static_cast<long long>(cand), static_cast<long long>(no)));
  if (cand == 0) return;
  if (q == nullptr || landmarks == nullptr || seq_pages == nullptr || logits == nullptr || score == nullptr || (no > 0 && oidx == nullptr))
    return record_error(KVP_INVALID("%s: q, landmarks, seq_pages, logits, score or (with outliers) oidx is null", who));
  chunk_scores_kernel<<<static_cast<unsigned>(geo.num_kv_heads), kThreads, 0, as_stream(backend::Cuda::current_stream())>>>(
      q, qhs, qds, G, scale, landmarks, seq_pages, geo, cand, oidx, no, logits, score);
  record_error(launch_status(who));
}

}  // namespace
}  // namespace cuda_detail

namespace backend {

void Cuda::shadowkv_landmarks(const float* k, const PageStrides& ks, const std::int32_t* seq_pages, const ops::ChunkGeometry& geo,
                              std::int64_t first, std::int64_t count, float* landmarks, float* outlier) noexcept {
  cuda_detail::launch_landmarks(k, ks, seq_pages, geo, first, count, landmarks, outlier);
}
void Cuda::shadowkv_landmarks(const half* k, const PageStrides& ks, const std::int32_t* seq_pages, const ops::ChunkGeometry& geo,
                              std::int64_t first, std::int64_t count, float* landmarks, float* outlier) noexcept {
  cuda_detail::launch_landmarks(k, ks, seq_pages, geo, first, count, landmarks, outlier);
}
void Cuda::shadowkv_landmarks(const bfloat16* k, const PageStrides& ks, const std::int32_t* seq_pages, const ops::ChunkGeometry& geo,
                              std::int64_t first, std::int64_t count, float* landmarks, float* outlier) noexcept {
  cuda_detail::launch_landmarks(k, ks, seq_pages, geo, first, count, landmarks, outlier);
}

void Cuda::shadowkv_outlier_keys(const float* outlier, const std::int32_t* seq_pages, const ops::ChunkGeometry& geo, std::int64_t cand,
                                 float* out) noexcept {
  using namespace cuda_detail;
  constexpr const char* who = "cuda shadowkv_outlier_keys";
  if (Status s = check_geometry(who, geo); !s.is_ok()) return record_error(s);
  if (cand < 0) return record_error(KVP_INVALID("%s: cand is %lld, must be >= 0", who, static_cast<long long>(cand)));
  if (cand == 0) return;
  if (outlier == nullptr || seq_pages == nullptr || out == nullptr)
    return record_error(KVP_INVALID("%s: outlier, seq_pages or out is null", who));
  outlier_keys_kernel<<<blocks_for(cand * geo.num_kv_heads), kThreads, 0, as_stream(current_stream())>>>(outlier, seq_pages, geo, cand,
                                                                                                         out);
  record_error(launch_status(who));
}

void Cuda::shadowkv_chunk_scores(const float* q, std::int64_t qhs, std::int64_t qds, std::int32_t G, float scale, const float* landmarks,
                                 const std::int32_t* seq_pages, const ops::ChunkGeometry& geo, std::int64_t cand, const std::int32_t* oidx,
                                 std::int64_t no, float* logits, float* score) noexcept {
  cuda_detail::launch_chunk_scores(q, qhs, qds, G, scale, landmarks, seq_pages, geo, cand, oidx, no, logits, score);
}
void Cuda::shadowkv_chunk_scores(const half* q, std::int64_t qhs, std::int64_t qds, std::int32_t G, float scale, const float* landmarks,
                                 const std::int32_t* seq_pages, const ops::ChunkGeometry& geo, std::int64_t cand, const std::int32_t* oidx,
                                 std::int64_t no, float* logits, float* score) noexcept {
  cuda_detail::launch_chunk_scores(q, qhs, qds, G, scale, landmarks, seq_pages, geo, cand, oidx, no, logits, score);
}
void Cuda::shadowkv_chunk_scores(const bfloat16* q, std::int64_t qhs, std::int64_t qds, std::int32_t G, float scale, const float* landmarks,
                                 const std::int32_t* seq_pages, const ops::ChunkGeometry& geo, std::int64_t cand, const std::int32_t* oidx,
                                 std::int64_t no, float* logits, float* score) noexcept {
  cuda_detail::launch_chunk_scores(q, qhs, qds, G, scale, landmarks, seq_pages, geo, cand, oidx, no, logits, score);
}

void Cuda::shadowkv_priorities(const ops::ChunkGeometry& geo, std::int64_t n, std::int64_t cand, const std::int32_t* oidx, std::int64_t no,
                               const std::int32_t* sidx, std::int64_t k, const float* score, float* prio) noexcept {
  using namespace cuda_detail;
  constexpr const char* who = "cuda shadowkv_priorities";
  if (Status s = check_geometry(who, geo); !s.is_ok()) return record_error(s);
  if (n < 0 || cand < 0 || no < 0 || k < 0 || no + k > cand || cand * geo.chunk_size > n)
    return record_error(
        KVP_INVALID("%s: n %lld, cand %lld, outliers %lld, selected %lld: need 0 <= outliers + selected <= cand <= n / chunk", who,
                    static_cast<long long>(n), static_cast<long long>(cand), static_cast<long long>(no), static_cast<long long>(k)));
  if (n == 0) return;
  if (prio == nullptr || (no > 0 && oidx == nullptr) || (k > 0 && (sidx == nullptr || score == nullptr)))
    return record_error(KVP_INVALID("%s: prio, or oidx / sidx / score where used, is null", who));
  const std::int64_t entries = (n + geo.page_size - 1) / geo.page_size;
  priorities_kernel<<<blocks_for(entries), kThreads, 0, as_stream(current_stream())>>>(geo, n, cand, oidx, no, sidx, k, score, prio);
  record_error(launch_status(who));
}

void Cuda::prefetch_add_reuse(float* prio, const std::int32_t* entry_pages, std::int64_t entries, const std::int64_t* used_at,
                              std::int64_t reuse_step, float reuse_priority) noexcept {
  using namespace cuda_detail;
  constexpr const char* who = "cuda prefetch_add_reuse";
  if (entries < 0) return record_error(KVP_INVALID("%s: entries is %lld, must be >= 0", who, static_cast<long long>(entries)));
  if (entries == 0) return;
  if (prio == nullptr || entry_pages == nullptr || used_at == nullptr)
    return record_error(KVP_INVALID("%s: prio, entry_pages or used_at is null", who));
  add_reuse_kernel<<<blocks_for(entries), kThreads, 0, as_stream(current_stream())>>>(prio, entry_pages, entries, used_at, reuse_step,
                                                                                      reuse_priority);
  record_error(launch_status(who));
}

}  // namespace backend
KVP_NAMESPACE_END
