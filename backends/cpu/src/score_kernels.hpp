// SPDX-License-Identifier: Apache-2.0
// Kernel table of the score ops (internal): what each per-ISA unit
// (score_ops_<isa>.cpp) provides to the entry points in cpu_score_ops.cpp.
#pragma once

#include <cstddef>
#include <cstdint>

#include "isa_dispatch.hpp"
#include "kvpolicy/ops/scalar.hpp"

KVP_NAMESPACE_BEGIN
namespace cpu_detail {

/// Workspace geometry of `window_scores`, fixed for every level so that the
/// size reported before a call never depends on the level used during it.
struct WindowLayout {
  static constexpr std::int64_t kChunk = 60;       ///< keys per softmax chunk: whole register tiles (6 or 4 keys)
  static constexpr std::int64_t kQueryAlign = 16;  ///< query rows padded to the widest vector (AVX-512 floats)

  std::int64_t num_q = 0;       ///< G * w
  std::int64_t qpad = 0;        ///< num_q rounded up to kQueryAlign
  std::int64_t num_chunks = 0;  ///< ceil(kv_len / kChunk)

  static WindowLayout of(const WindowScoreShape& s) noexcept {
    WindowLayout l;
    l.num_q = s.group * s.window;
    l.qpad = (l.num_q + kQueryAlign - 1) / kQueryAlign * kQueryAlign;
    l.num_chunks = (s.kv_len + kChunk - 1) / kChunk;
    return l;
  }
};

/// Scratch of one `window_scores` call, carved from the caller's workspace.
/// Every array is 64-byte aligned; rows of `qpad` floats stay aligned.
struct WindowScratch {
  WindowLayout layout{};
  float* qt = nullptr;                   // (head_dim, qpad): queries transposed, zero padded
  std::int32_t* last_visible = nullptr;  // (qpad): last key each query row sees (causal)
  float* p = nullptr;                    // (kv_len, qpad): exp(logit - chunk reference); rows of the computed
                                         // query vectors only, so a call with fewer queries uses less of it
  float* chunk_ref = nullptr;            // (num_chunks, qpad): chunk maxima, then exp(chunk max - row max)
  float* chunk_sum = nullptr;            // (num_chunks, qpad): sum of the chunk's exp
  float* key_buf = nullptr;              // (kChunk, head_dim): keys of one chunk in fp32
  float* row_max = nullptr;              // (qpad): running max, finally the max over all keys
  float* cur_max = nullptr;              // (qpad): max of the current chunk
  double* denom = nullptr;               // (qpad): softmax denominators
  float* inv_denom = nullptr;            // (qpad): 1/denominator (x 1/w for the mean), 0 for padding rows
  float* factor = nullptr;               // (qpad): per-chunk rescale factors
  float* row_tmp = nullptr;              // (qpad): one weighted row of p

  /// Calls fn(pointer_member, element_count) for every array in carving
  /// order: the single definition behind both the size report and the carve.
  template <class Fn>
  static void visit(const WindowScoreShape& s, WindowScratch& w, Fn&& fn) noexcept {
    const auto q = static_cast<std::size_t>(w.layout.qpad);
    const auto chunks = static_cast<std::size_t>(w.layout.num_chunks);
    fn(w.qt, static_cast<std::size_t>(s.head_dim) * q);
    fn(w.last_visible, q);
    fn(w.p, static_cast<std::size_t>(s.kv_len) * q);
    fn(w.chunk_ref, chunks * q);
    fn(w.chunk_sum, chunks * q);
    fn(w.key_buf, static_cast<std::size_t>(WindowLayout::kChunk * s.head_dim));
    fn(w.row_max, q);
    fn(w.cur_max, q);
    fn(w.denom, q);
    fn(w.inv_denom, q);
    fn(w.factor, q);
    fn(w.row_tmp, q);
  }
};

struct ScoreKernels {
  void (*window_scores_f32)(const WindowScoreShape&, const float*, Rows<float>, float*, const WindowScratch&) noexcept;
  void (*window_scores_f16)(const WindowScoreShape&, const float*, Rows<half>, float*, const WindowScratch&) noexcept;
  void (*window_scores_bf16)(const WindowScoreShape&, const float*, Rows<bfloat16>, float*, const WindowScratch&) noexcept;
  /// bf16 keys through the CPU's bf16 dot product (queries rounded to bf16; head_dim even): null on the levels
  /// without it (AVX2, SSE2); the AVX-512 one needs AVX512_BF16 too (checked by the caller).
  void (*window_scores_bf16_dot)(const WindowScoreShape&, const float*, Rows<bfloat16>, float*, const WindowScratch&) noexcept;
  /// pool1d outputs t in [t0, t1), all with complete windows (t0 >= k/2, t1 + k/2 <= n).
  void (*pool1d_full)(const float* in, int kernel, Pooling kind, float* out, std::int64_t t0, std::int64_t t1) noexcept;
  /// Writes the indices i < n with scores[i] >= threshold (ordered compare:
  /// NaN never qualifies), ascending, and returns their count. `expected` (about how many pass) picks the
  /// faster scan for sparse or dense results; the output never depends on it.
  std::int64_t (*collect_at_least)(const float* scores, std::int64_t n, float threshold, std::int64_t expected, std::int32_t* out) noexcept;
  /// keys[i] = signed order key of scores[idx[i]] (`score_order_key` ^ 2^31 as int32); *lo / *hi get
  /// their min and max (INT32_MAX / INT32_MIN when m == 0).
  void (*gather_keys)(const float* scores, const std::int32_t* idx, std::int64_t m, std::int32_t* keys, std::int32_t* lo,
                      std::int32_t* hi) noexcept;
  /// Stable compaction of the pairs with key_lo <= key < key_hi (key_hi may be 2^31); returns the count.
  std::int64_t (*keep_in_key_range)(const std::int32_t* idx, const std::int32_t* key, std::int64_t m, std::int32_t key_lo,
                                    std::int64_t key_hi, std::int32_t* out_idx, std::int32_t* out_key) noexcept;
  /// Stable compaction of the indices whose (key, idx) >= (key_lo, idx_lo); returns the count.
  std::int64_t (*keep_at_least)(const std::int32_t* idx, const std::int32_t* key, std::int64_t m, std::int32_t key_lo, std::int32_t idx_lo,
                                std::int32_t* out_idx) noexcept;
  /// keys[i] = signed order key of scores[i] for i < n, and their min / max (gather_keys over 0..n-1).
  void (*load_keys)(const float* scores, std::int64_t n, std::int32_t* keys, std::int32_t* lo, std::int32_t* hi) noexcept;
  /// Signed order keys of the maxima of about `target` disjoint blocks covering scores[0, n) (runs of whole
  /// vectors, or one lane of each, plus the trailing scores): a block maximum is a number of the row, except
  /// that a block of NaN alone reports -inf's key. Returns the block count: about target, at most n / lanes + 1
  /// (out needs kCollectSlack entries of slack).
  std::int64_t (*block_max_keys)(const float* scores, std::int64_t n, std::int64_t target, std::int32_t* out) noexcept;
  /// collect_at_least(scores, n, the float of key `cut`) given block_max_keys(scores, n, target) (block_keys,
  /// nb of them; cut above -inf's key): reads only the blocks whose maximum reaches the cut where the blocks
  /// are whole runs of vectors. `list` is scratch of nb entries.
  std::int64_t (*collect_in_blocks)(const float* scores, std::int64_t n, std::int64_t target, const std::int32_t* block_keys,
                                    std::int64_t nb, std::int32_t cut, std::int32_t* list, std::int32_t* out) noexcept;
  /// How many of keys[0, m) are >= t.
  std::int64_t (*count_keys_at_least)(const std::int32_t* keys, std::int64_t m, std::int32_t t) noexcept;
  /// The rank-th largest of keys[0, m) (1 <= rank <= m), or with slack > 0 any threshold that at least rank and
  /// at most rank + slack keys reach: up to 48 keys by counting, for each key, the keys at or above it; more by an
  /// interpolating search over the key values, each step one vector pass counting the keys at or above a guess.
  /// *at_least (when not null) gets how many keys are >= the result.
  std::int32_t (*kth_largest_key)(const std::int32_t* keys, std::int64_t m, std::int64_t rank, std::int64_t slack,
                                  std::int64_t* at_least) noexcept;
  // The outputs of collect_at_least, gather_keys, keep_in_key_range and keep_at_least need kCollectSlack entries of slack (whole
  // vectors are stored) and may alias their inputs.
};

inline constexpr std::int64_t kCollectSlack = 64;

KVP_CPU_DECLARE_KERNELS(ScoreKernels, score_kernels)

}  // namespace cpu_detail
KVP_NAMESPACE_END
