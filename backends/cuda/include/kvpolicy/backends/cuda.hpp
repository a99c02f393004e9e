// SPDX-License-Identifier: Apache-2.0
// `backend::Cuda`: the ops contract of `include/kvpolicy/ops/scalar.hpp` on
// CUDA device memory (kvpolicy::cuda).
//
// Unlike `backend::Cpu`, this backend does NOT derive from `backend::Scalar`:
// every pointer it takes is a device pointer, so an op it lacks must fail to
// compile instead of silently running host code on device memory.
//
// Conventions shared by every entry point:
// - Pointers (inputs, outputs, page ids, workspace) are device pointers
//   (or managed / mapped host memory the device can read).
// - `stream` is a `cudaStream_t` passed as `void*` (nullptr = the default
//   stream), so this header compiles with a plain C++ compiler and needs no
//   CUDA headers.
// - Work is only enqueued: no allocation, no synchronisation, no host<->device
//   copies. Results are ready once the caller synchronises the stream; the
//   calls are safe to capture in a CUDA graph.
// - Arguments are validated on the host before anything touches the device;
//   a rejected call returns kInvalidArgument / kWorkspaceTooSmall /
//   kUnsupported with a message naming the argument. A CUDA launch error is
//   returned as kDeviceError carrying the CUDA error string. Errors raised by
//   the kernels while they run surface at the caller's next synchronisation.
// - Thread-safety: the functions keep no state; concurrent calls on
//   different streams (or the same one) are safe.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/page_selection.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/rows.hpp"
#include "kvpolicy/core/tensor_view.hpp"
#include "kvpolicy/core/status.hpp"
#include "kvpolicy/core/workspace.hpp"
#include "kvpolicy/ops/adakv_keep.hpp"
#include "kvpolicy/ops/prefetch_ops.hpp"
#include "kvpolicy/ops/quantized_paged_ops.hpp"
#include "kvpolicy/ops/scalar.hpp"
#include "kvpolicy/ops/types.hpp"
#include "kvpolicy/quant/fp8.hpp"
#include "kvpolicy/quant/kivi.hpp"
#include "kvpolicy/quant/token_rows.hpp"

KVP_NAMESPACE_BEGIN
namespace backend {

struct Cuda {
  // ---- devices ----------------------------------------------------------

  /// Number of CUDA devices visible to this process. On failure `*count` is
  /// 0 and the Status (kDeviceError) reads "cudaGetDeviceCount: <CUDA error
  /// string>" (e.g. no driver, no device). Touches the CUDA runtime.
  static Status device_count(int* count) noexcept;

  /// True when at least one CUDA device is usable.
  static bool device_available() noexcept;

  // ---- physical limits ----------------------------------------------------

  /// The current device's limits, measured by running kernels (not read from
  /// a data sheet), for benchmarks that report fractions of peak.
  struct Peaks {
    double read_bytes_per_s = 0.0;     ///< streaming read of a 2 GiB buffer (HBM)
    double fp32_flops_per_s = 0.0;     ///< dependent FMA chains on every SM (CUDA cores)
    double fp16_tc_flops_per_s = 0.0;  ///< fp16 tensor cores through mma.sync m16n8k16, fp32 accumulate (not wgmma)
    char name[96] = {};                ///< device name
    int sm_count = 0;
  };

  /// Measures `Peaks` on the current device: allocates and synchronises (a
  /// tool for benchmarks, never called by a policy). Each figure is the best
  /// of several timed runs after a warm-up.
  static Status measure_peaks(Peaks* out) noexcept;

  // ---- window attention -------------------------------------------------

  /// Bytes of device workspace `window_scores` needs for shape `s`:
  /// `(group*window, min(kv_len, q_pos0+window))` fp32 logits plus two fp32
  /// statistics per query row (64-byte aligned blocks). The logits are kept
  /// so the softmax is the exact two-pass one of the scalar reference and
  /// the window reduction runs in a fixed order (bitwise reproducible).
  /// Host-only arithmetic; 0 for an empty problem.
  static std::size_t window_scores_workspace(const WindowScoreShape& s) noexcept;

  /// Scalar `window_scores` semantics on the device: for query row
  /// `r = g*window + i` the fp32 softmax runs over the visible keys
  /// `[0, min(kv_len, q_pos0 + i + 1))` and
  /// `out[g*num_cols + j] = reduce_i softmax_r(j)` (mean or sum), zero where
  /// key j is not visible to any window query.
  ///
  /// q_device:    (group*window, head_dim) fp32, contiguous
  /// keys_device: `kv_len` rows of `head_dim` elements; contiguous or paged
  ///              (then `keys_device.pages` is a device array of
  ///              ceil(kv_len / page_size) page ids)
  /// out_device:  (group, num_cols) fp32, contiguous
  /// ws_device:   at least `window_scores_workspace(s)` bytes
  ///
  /// Preconditions (checked): group, window, head_dim >= 1; 0 <= num_cols <=
  /// kv_len; q_pos0 >= 0; row_stride >= head_dim; for paged keys page_size >= 1
  /// and page_stride >= 1; pointers non-null when there is work.
  /// Accuracy: fp16/bf16 keys on sm_80+ take tensor-core logits (split fp32
  /// queries; within 1e-5 relative of `backend::Scalar`, deterministic run to
  /// run, see window_scores.cu). fp32 keys, older devices, or
  /// KVP_CUDA_EXACT_SCORES=1 take the exact kernel: dot products and the
  /// window sum in the scalar reference's order, so results differ from
  /// `backend::Scalar` only by expf rounding and the fp64 denominator's
  /// summation order (a few ulp).
  /// Complexity: 6 small launches; O(group*window*kv_len*head_dim) work, keys
  /// are read once per 64 query rows.
  static Status window_scores(const WindowScoreShape& s, const float* q_device, Rows<float> keys_device, float* out_device,
                              Workspace ws_device, void* stream) noexcept;
  static Status window_scores(const WindowScoreShape& s, const float* q_device, Rows<half> keys_device, float* out_device,
                              Workspace ws_device, void* stream) noexcept;
  static Status window_scores(const WindowScoreShape& s, const float* q_device, Rows<bfloat16> keys_device, float* out_device,
                              Workspace ws_device, void* stream) noexcept;

  // ---- top-k ------------------------------------------------------------

  /// Bytes of device workspace `topk` needs: 0 (the selection runs in shared
  /// memory). Kept so the call sequence matches every other backend.
  static std::size_t topk_workspace(std::int64_t n) noexcept;

  /// The k best of scores_device[0..n) under `score_order_key` (higher score
  /// first, equal scores -> higher index, NaN below everything), written to
  /// out_device[0..k) in ascending index order: identical to `Scalar::topk`.
  /// Preconditions (checked): 0 <= k <= n <= INT32_MAX; pointers non-null
  /// when k > 0. k == 0 enqueues nothing.
  static Status topk(const float* scores_device, std::int64_t n, std::int64_t k, std::int32_t* out_device, Workspace ws_device,
                     void* stream) noexcept;

  /// Bytes of device workspace `topk_rows` needs: 0.
  static std::size_t topk_rows_workspace(std::int64_t rows, std::int64_t n) noexcept;

  /// `topk` on each of `rows` rows at once (one thread block per row):
  /// row r reads scores_device[r*ld .. r*ld + n) and writes
  /// out_device[r*out_ld .. r*out_ld + k).
  /// Preconditions (checked): rows >= 0; 0 <= k <= n <= INT32_MAX;
  /// ld >= n and out_ld >= k when rows > 1.
  /// Complexity: 5 passes over each row (4 radix-select histogram passes on
  /// the 32-bit order key, one ordered compaction), no sort.
  static Status topk_rows(const float* scores_device, std::int64_t rows, std::int64_t n, std::int64_t ld, std::int64_t k,
                          std::int32_t* out_device, std::int64_t out_ld, Workspace ws_device, void* stream) noexcept;

  // ---- the ops contract (ops/contract.hpp) ------------------------------
  //
  // The members below have the signatures of `backend::Scalar`, so policies
  // instantiate with `Context<backend::Cuda>`. They differ from the entry
  // points above in two ways only:
  // - the stream is the calling thread's *current stream* (`current_stream`),
  //   which a policy call sets from `Context::stream` for its duration
  //   (`CallScope`), as PyTorch's current stream works;
  // - they return void. A rejected argument or a launch error is recorded in
  //   the calling thread's error slot; the policy call returns the first one
  //   recorded (`CallScope::end`). Nothing is enqueued for a rejected op.
  // Like every op they only enqueue: no allocation, no synchronisation, no
  // copies, so a whole policy call can be captured in a CUDA graph.

  /// The stream contract-form ops enqueue on in this thread (nullptr: the
  /// legacy default stream).
  static void* current_stream() noexcept;

  /// A policy call on `Context<Cuda>`: sets the thread's current stream to
  /// `stream` and clears its error slot; the destructor restores the previous
  /// stream (nesting is allowed). Device ops run in the calling thread, so a
  /// call with more than one host worker is refused by `begin`.
  class CallScope {
   public:
    CallScope(void* stream, int workers) noexcept;
    ~CallScope();
    CallScope(const CallScope&) = delete;
    CallScope& operator=(const CallScope&) = delete;
    /// kUnsupported when the context's ExecContext has more than one worker.
    Status begin() const noexcept;
    /// The first error an op recorded since `begin` (ok when none).
    Status end() const noexcept;

   private:
    void* previous_stream_ = nullptr;
    Status previous_error_{};  // an enclosing call's first error, restored (first error wins)
    int workers_ = 1;
  };

  static void window_scores(const WindowScoreShape& s, const float* q_device, Rows<float> keys_device, float* out_device,
                            Workspace ws_device) noexcept;
  static void window_scores(const WindowScoreShape& s, const float* q_device, Rows<half> keys_device, float* out_device,
                            Workspace ws_device) noexcept;
  static void window_scores(const WindowScoreShape& s, const float* q_device, Rows<bfloat16> keys_device, float* out_device,
                            Workspace ws_device) noexcept;

  /// `Scalar::pool1d` on the device, bit-identical (kAvg sums each window in
  /// ascending order of value, as the reference does). `in` and `out` must
  /// not overlap unless kind is kNone or kernel <= 1.
  static void pool1d(const float* in_device, std::int64_t n, int kernel, Pooling kind, float* out_device) noexcept;

  /// `Scalar::group_reduce` on the device, bit-identical (same order of adds).
  static void group_reduce(const float* in_device, std::int64_t group, std::int64_t n, std::int64_t ld, GroupReduce kind,
                           float* out_device) noexcept;

  /// `Scalar::topk` on the device (radix select, identical indices).
  static void topk(const float* scores_device, std::int64_t n, std::int64_t k, std::int32_t* out_device, Workspace ws_device) noexcept;

  /// `Scalar::gather_rows` on the device: dst row r = src row idx[r].
  static void gather_rows(Rows<float> src, const std::int32_t* idx_device, std::int64_t n, std::int64_t dim, float* dst_device,
                          std::int64_t dst_row_stride) noexcept;
  static void gather_rows(Rows<half> src, const std::int32_t* idx_device, std::int64_t n, std::int64_t dim, half* dst_device,
                          std::int64_t dst_row_stride) noexcept;
  static void gather_rows(Rows<bfloat16> src, const std::int32_t* idx_device, std::int64_t n, std::int64_t dim, bfloat16* dst_device,
                          std::int64_t dst_row_stride) noexcept;

  /// `Scalar::widen_queries` on the device (exact widening, any strides).
  static void widen_queries(const TensorView<const float, 3>& q_device, std::int64_t h0, std::int64_t group, std::int64_t i0,
                            std::int64_t rows, float* dst_device) noexcept;
  static void widen_queries(const TensorView<const half, 3>& q_device, std::int64_t h0, std::int64_t group, std::int64_t i0,
                            std::int64_t rows, float* dst_device) noexcept;
  static void widen_queries(const TensorView<const bfloat16, 3>& q_device, std::int64_t h0, std::int64_t group, std::int64_t i0,
                            std::int64_t rows, float* dst_device) noexcept;

  /// `Scalar::iota`: dst[i] = first + i for i < n.
  static void iota(std::int32_t* dst_device, std::int64_t first, std::int64_t n) noexcept;

  /// `Scalar::fill`: dst[i * dst_stride] = value for i < n.
  static void fill(float* dst_device, std::int64_t n, std::int64_t dst_stride, float value) noexcept;

  /// `Scalar::copy_strided`: dst[i * dst_stride] = src[i] for i < n.
  static void copy_strided(const float* src_device, std::int64_t n, float* dst_device, std::int64_t dst_stride) noexcept;

  // ---- row kernels of the online policies (H2O, TOVA) ---------------------

  /// `Scalar::add_rows`: dst[i] += src[i] for i < n.
  static void add_rows(float* dst_device, const float* src_device, std::int64_t n) noexcept;

  /// `Scalar::divide_by_tail`: s[j] /= (n - j) for j < n.
  static void divide_by_tail(float* s_device, std::int64_t n) noexcept;

  /// `Scalar::gather_ids`: dst[i] = table[sel[i]] (table[i] when sel is null) for i < n.
  static void gather_ids(const std::int32_t* table_device, const std::int32_t* sel_device, std::int64_t n,
                         std::int32_t* dst_device) noexcept;

  /// `Scalar::copy_ids`: dst[i] = src[i] for i < n.
  static void copy_ids(const std::int32_t* src_device, std::int64_t n, std::int32_t* dst_device) noexcept;

  // Batched forms the device paths of the policies use, so a step over all
  // heads of a sequence is one launch instead of one per head.

  /// `topk` on `rows` rows in one launch (a thread block per row): row r reads
  /// scores[r*ld .. r*ld + n) and writes its k best, ascending, to
  /// out[r*out_ld .. r*out_ld + k); identical to `rows` calls of `topk`.
  /// Needs ld >= n and out_ld >= k when rows > 1.
  static void topk_rows_strided(const float* scores_device, std::int64_t ld, std::int64_t rows, std::int64_t n, std::int64_t k,
                                std::int32_t* out_device, std::int64_t out_ld, Workspace ws_device) noexcept;

  /// Page-selection rows in one launch. For r < rows and i < k:
  /// dst[r*dst_ld + i] = pages[s] with s = sel[r*sel_ld + i] (s = i when sel
  /// is null), and logical[r*dst_ld + i] = s when logical is non-null; then,
  /// when last >= 0, dst[r*dst_ld + k] = pages[last] and logical[...] = last.
  /// The same writes as `gather_ids` + `copy_ids` / `iota` row by row.
  static void gather_page_rows(const std::int32_t* pages_device, const std::int32_t* sel_device, std::int64_t sel_ld, std::int64_t rows,
                               std::int64_t k, std::int64_t last, std::int32_t* dst_device, std::int32_t* logical_device,
                               std::int64_t dst_ld) noexcept;

  /// `pool1d` on `rows` rows of (rows, ld) `in` into the same rows of `out`, in one launch.
  static void pool1d_rows(const float* in_device, std::int64_t rows, std::int64_t n, std::int64_t ld, int kernel, Pooling kind,
                          float* out_device) noexcept;

  /// `iota` on `rows` rows in one launch: dst[r*dst_ld + i] = first + i for i < n.
  static void iota_rows(std::int32_t* dst_device, std::int64_t dst_ld, std::int64_t rows, std::int64_t first, std::int64_t n) noexcept;

  /// `Scalar::evict_lowest`: removes the lowest slot of row[0..cand) under
  /// `score_order_key` (ties: the lowest slot) from row[0..n), shifting the
  /// tail down, and writes the n - 1 kept slots (ascending) to ids.
  static void evict_lowest(float* row_device, std::int64_t cand, std::int64_t n, std::int32_t* ids_device) noexcept;

  /// `Scalar::compact_row`: row[r] = row[ids[r]] for r < keep (ids ascending).
  static std::size_t compact_row_workspace(std::int64_t keep) noexcept;
  static void compact_row(float* row_device, const std::int32_t* ids_device, std::int64_t keep, Workspace ws_device) noexcept;

  /// `Scalar::accumulate_column_sums` on the device, bit-identical (same
  /// order of adds): H2O's per-call column sums folded into its state row.
  static void accumulate_column_sums(float* state_device, std::int64_t len_prev, const TensorView<const float, 3>& p_device,
                                     std::int64_t h0, std::int64_t group, bool mean_over_group) noexcept;
  static void accumulate_column_sums(float* state_device, std::int64_t len_prev, const TensorView<const half, 3>& p_device, std::int64_t h0,
                                     std::int64_t group, bool mean_over_group) noexcept;
  static void accumulate_column_sums(float* state_device, std::int64_t len_prev, const TensorView<const bfloat16, 3>& p_device,
                                     std::int64_t h0, std::int64_t group, bool mean_over_group) noexcept;

  /// `Scalar::neg_row_norms` on the device, bit-identical (one thread per row,
  /// the squares summed in fp64 in ascending order as the reference does).
  static void neg_row_norms(const Rows<float>& rows_device, std::int64_t n, std::int64_t d, float* out_device,
                            std::int64_t stride) noexcept;
  static void neg_row_norms(const Rows<half>& rows_device, std::int64_t n, std::int64_t d, float* out_device, std::int64_t stride) noexcept;
  static void neg_row_norms(const Rows<bfloat16>& rows_device, std::int64_t n, std::int64_t d, float* out_device,
                            std::int64_t stride) noexcept;

  /// `Scalar::mean_rows` on the device, bit-identical (heads in ascending order).
  static void mean_rows(const TensorView<const float, 2> rows_device, float* mean_device) noexcept;
  static void mean_rows(const TensorView<const half, 2> rows_device, float* mean_device) noexcept;
  static void mean_rows(const TensorView<const bfloat16, 2> rows_device, float* mean_device) noexcept;

  // ---- merging: one kv head's nearest-kept linear merge -------------------

  /// Bytes of device workspace `merge_head` (and each merge op below) needs for T tokens of head_dim d:
  /// the (T, d) normalised keys plus eleven per-token arrays (host arithmetic).
  static std::size_t merge_head_workspace(std::int64_t T, std::int64_t d) noexcept;

  /// `ScalarMergeOps::merge_head` (ops/merge_scalar.hpp) on the device,
  /// bit-identical: five launches (normalised keys, evicted ids, the nearest
  /// kept slot of each evicted token, the rule in one block, the merged
  /// rows), no allocation, no synchronisation. `kept` and `w` are device
  /// memory, C / T / d host values; the dense plan entries (T - C of them)
  /// are written on the device.
  template <class Tk>
  static void merge_head(const MergeRule& rule, const Rows<Tk>& keys_device, const Rows<Tk>& values_device, const std::int32_t* kept_device,
                         std::int64_t C, std::int64_t T, std::int64_t d, float* w_device, std::int32_t* dst_device,
                         std::int32_t* src_device, float* weight_device, float* merged_keys_device, std::int64_t kld,
                         float* merged_values_device, std::int64_t vld, Workspace ws_device) noexcept;

  /// `ScalarMergeOps::merge_nearest` / `merge_apply` / `d2o_decide` on the
  /// device, bit-identical (the first two are `merge_head`'s launches 1-3 and
  /// 4-5; d2o_decide is one block whose first thread sums the similarities in
  /// the reference's fp64 order). `evicted`, `target`, `sim` and the D2O
  /// state are device memory; the workspace is `merge_head_workspace(T, d)`.
  template <class Tk>
  static void merge_nearest(const Rows<Tk>& keys_device, const std::int32_t* kept_device, std::int64_t C, std::int64_t T, std::int64_t d,
                            float eps, std::int32_t* evicted_device, std::int32_t* target_device, float* sim_device,
                            Workspace ws_device) noexcept;
  template <class Tk>
  static void merge_apply(const MergeRule& rule, const Rows<Tk>& keys_device, const Rows<Tk>& values_device,
                          const std::int32_t* kept_device, std::int64_t C, std::int64_t T, std::int64_t d, float* w_device,
                          const std::int32_t* evicted_device, std::int32_t* target_device, const float* sim_device,
                          std::int32_t* dst_device, std::int32_t* src_device, float* weight_device, float* merged_keys_device,
                          std::int64_t kld, float* merged_values_device, std::int64_t vld, Workspace ws_device) noexcept;
  static void d2o_decide(const float* sim_device, std::int32_t* target_device, std::int64_t H, std::int64_t E, float alpha, float beta,
                         D2OState* state_device) noexcept;

  // ---- merging: CaM's streaming merge and kvpress CAMPress ----------------

  /// `ScalarMergeOps::torch_uniforms` on the device, bit-identical: torch's
  /// CPU generator (mt19937) seeded and twisted in one block (the twist in
  /// the three phases of ops/cam_steps.hpp, one thread per element), n
  /// uniforms into u. Cost: n / 624 twists of six barriers each.
  static void torch_uniforms(std::uint32_t seed, std::int64_t n, float* u_device) noexcept;
  /// `ScalarMergeOps::evicted_ids` on the device (one thread per token, a binary search in the kept row).
  static void evicted_ids(const std::int32_t* kept_device, std::int64_t C, std::int64_t T, std::int32_t* evicted_device) noexcept;
  /// Bytes of device workspace `cam_candidates` needs for T tokens (evicted ids, order keys, flags).
  static std::size_t cam_candidates_workspace(std::int64_t T) noexcept;
  /// `ScalarMergeOps::cam_candidates` on the device, the same ids: each
  /// evicted token's order key, its rank counted against every other key
  /// (O(E^2) comparisons, tiled through shared memory; E = T - C, the tokens
  /// one compression interval evicts), the k best compacted in ascending order
  /// by one block. `scores_device`: (H, T) device view.
  static void cam_candidates(TensorView<const float, 2> scores_device, const std::int32_t* kept_device, std::int64_t C, std::int64_t T,
                             std::int64_t k, std::int32_t* cand_device, Workspace ws_device) noexcept;
  /// `ScalarMergeOps::cam_merge_head` on the device, bit-identical (one
  /// thread per candidate for the dense entries, then one block per kept
  /// slot, threads over head_dim, for the merged rows; compiled without FMA
  /// contraction). Every pointer, `attn.data` included, is device memory.
  template <class Tk>
  static void cam_merge_head(const ops::CamRule& rule, const ops::CamAttention& attn, std::int64_t h, const Rows<Tk>& values_device,
                             const std::int32_t* kept_device, std::int64_t C, const std::int32_t* cand_device, std::int64_t n,
                             std::int64_t d, const float* u_device, std::int64_t u_stride, std::int32_t* dst_device,
                             std::int32_t* src_device, float* weight_device, float* merged_values_device, std::int64_t vld,
                             std::int64_t* start_device) noexcept;

  // ---- merging: MiniCache (one kv head of a layer pair) -------------------

  /// Bytes of device workspace `minicache_head` needs (both layers' widened rows, the distances).
  static std::size_t minicache_workspace(std::int64_t T, std::int64_t d) noexcept;
  /// `ScalarMergeOps::minicache_head` on the device: one thread per token
  /// (norms, distance, SLERP direction: ops/minicache_steps.hpp without FMA
  /// contraction, CUDA's acosf / sinf), then one block for the threshold and
  /// the retained tokens, compacted after the previous heads' from indptr[h]
  /// (read on the device; indptr[h + 1] written there). Norms and retained
  /// rows are bit-identical to the host's; distances and directions differ
  /// only through acosf / sinf (a few ulp). NaN distances are ignored by the
  /// device's min / max.
  template <class Tk>
  static void minicache_head(float t, float gamma, const Rows<Tk>& prev_device, const Rows<Tk>& cur_device, std::int64_t T, std::int64_t d,
                             std::int64_t h, float* norm_prev_device, float* norm_cur_device, std::int64_t np_stride,
                             std::int64_t nc_stride, float* direction_device, std::int64_t dir_stride, std::int32_t* indptr_device,
                             std::int32_t* retained_ids_device, float* retained_prev_device, std::int64_t rp_stride,
                             float* retained_cur_device, std::int64_t rc_stride, Workspace ws_device) noexcept;

  // ---- Ada-KV: one sequence's decision on the device ----------------------

  // ---- prefetch (ops/prefetch_ops.hpp: semantics and host reference) ----

  /// A history buffer of `num_pages` pages: stamps -1, the two pending counts 0.
  static void prefetch_history_reset(std::int64_t* buf_device, std::int32_t num_pages) noexcept;
  /// counts[0..entries) zeroed, then one integer atomic add per logical page
  /// of `rows` rows (row r at logical + r * ld, `row_len` entries).
  static void prefetch_votes(const std::int32_t* logical_device, std::int64_t rows, std::int64_t row_len, std::int64_t ld,
                             std::int64_t entries, std::int32_t* counts_device) noexcept;
  /// A thread per entry: `unit` added counts[e] times in fp32 (the host's
  /// additions, the same bits), else the reuse priority, else NaN.
  static void prefetch_vote_priorities(const std::int32_t* counts_device, const std::int32_t* entry_pages_device, std::int64_t entries,
                                       float unit, const std::int64_t* used_at_device, std::int64_t reuse_step, float reuse_priority,
                                       float* prio_device) noexcept;
  /// Bytes of device workspace `prefetch_write_request` needs (the keys twice and cub's radix-sort scratch).
  static std::size_t prefetch_request_workspace(std::int64_t entries) noexcept;
  /// The request: (score_order_key, entry) keys radix-sorted descending, then
  /// one block walks them in order; a page is claimed by its most urgent
  /// entry through an atomicMin on its `predicted_at` stamp, the winners are
  /// compacted in order (pages, priorities), the rest padded with -1 / NaN;
  /// pending = {size, pages the previous observation had not read}; `out_size` optional.
  static void prefetch_write_request(const float* prio_device, const std::int32_t* entry_pages_device, std::int64_t entries,
                                     std::int64_t* predicted_at_device, const std::int64_t* used_at_device, std::int64_t* pending_device,
                                     std::int64_t target, std::int64_t serial, std::int32_t* out_pages_device, float* out_priority_device,
                                     std::int64_t* out_size_device, Workspace ws_device) noexcept;
  /// One block: each read page's `used_at` stamp swapped for `step` (a page
  /// read by several rows counts once, whichever comes first), integer counts
  /// added into `*counters` (device memory).
  static void prefetch_observe(const std::int32_t* pages_device, std::int64_t n, std::int64_t* used_at_device,
                               const std::int64_t* predicted_at_device, const std::int64_t* pending_device, std::int64_t step,
                               bool has_prediction, std::int64_t serial, PrefetchCounters* counters_device) noexcept;
  /// A thread per entry: prio[e] = reuse_priority where prio[e] is NaN and used_at[entry_pages[e]] == reuse_step.
  static void prefetch_add_reuse(float* prio_device, const std::int32_t* entry_pages_device, std::int64_t entries,
                                 const std::int64_t* used_at_device, std::int64_t reuse_step, float reuse_priority) noexcept;

  // ---- InfiniGen (ops/infinigen_ops.hpp: semantics and host reference) ----

  /// Partial keys of tokens [first, first + count) of one sequence, a thread
  /// per (token, kv head, channel): the host's sums in its order (its bits).
  static void infinigen_fold(const float* k_device, const PageStrides& ks, const std::int32_t* seq_pages_device,
                             const ops::PartialKeyGeometry& geo, const float* skew_device, const std::int32_t* channels_device,
                             std::int64_t first, std::int64_t count, float* partial_keys_device) noexcept;
  static void infinigen_fold(const half* k_device, const PageStrides& ks, const std::int32_t* seq_pages_device,
                             const ops::PartialKeyGeometry& geo, const float* skew_device, const std::int32_t* channels_device,
                             std::int64_t first, std::int64_t count, float* partial_keys_device) noexcept;
  static void infinigen_fold(const bfloat16* k_device, const PageStrides& ks, const std::int32_t* seq_pages_device,
                             const ops::PartialKeyGeometry& geo, const float* skew_device, const std::int32_t* channels_device,
                             std::int64_t first, std::int64_t count, float* partial_keys_device) noexcept;
  /// The skewed queries (a thread per head and channel), then the logits (a
  /// thread per head and token), both the host's bits. `qt`: Hq * r floats.
  static void infinigen_scores(const float* q_device, std::int64_t q_head_stride, std::int64_t q_dim_stride, std::int32_t G, float scale,
                               const float* skew_device, const std::int32_t* channels_device, const float* partial_keys_device,
                               const std::int32_t* seq_pages_device, const ops::PartialKeyGeometry& geo, std::int64_t n, float* qt_device,
                               float* out_device, std::int64_t ld) noexcept;
  static void infinigen_scores(const half* q_device, std::int64_t q_head_stride, std::int64_t q_dim_stride, std::int32_t G, float scale,
                               const float* skew_device, const std::int32_t* channels_device, const float* partial_keys_device,
                               const std::int32_t* seq_pages_device, const ops::PartialKeyGeometry& geo, std::int64_t n, float* qt_device,
                               float* out_device, std::int64_t ld) noexcept;
  static void infinigen_scores(const bfloat16* q_device, std::int64_t q_head_stride, std::int64_t q_dim_stride, std::int32_t G, float scale,
                               const float* skew_device, const std::int32_t* channels_device, const float* partial_keys_device,
                               const std::int32_t* seq_pages_device, const ops::PartialKeyGeometry& geo, std::int64_t n, float* qt_device,
                               float* out_device, std::int64_t ld) noexcept;
  /// A block per row: its max, then how many tokens lie above max - alpha.
  static void infinigen_counts(const float* scores_device, std::int64_t rows, std::int64_t n, std::int64_t ld, float alpha,
                               std::int64_t* out_device) noexcept;
  /// A block per row: the call's k from `counts` (device), then an 8-pass
  /// radix select of the row's k-th best (order key, token) composite into
  /// `thr` (Hq uint64, device); then a thread per entry raising its selected tokens.
  static void infinigen_select(const float* scores_device, std::int64_t rows, std::int64_t n, std::int64_t ld,
                               const std::int64_t* counts_device, std::int64_t count_rows, std::int64_t max_num_kv, std::int32_t page_size,
                               std::uint64_t* thr_device, float* prio_device) noexcept;

  // ---- SpeCache (ops/specache_ops.hpp: semantics and host reference) ----

  /// Tokens [first, first + count) of one sequence into the low-bit key
  /// copy, a thread per (token, kv head, ggml block): the host's bytes. Keys
  /// are not scanned for NaN / Inf (a non-finite key: unspecified codes in its row).
  static void specache_encode(const float* k_device, const PageStrides& ks, const std::int32_t* seq_pages_device,
                              const ops::KeyCopyGeometry& geo, std::int64_t first, std::int64_t count, std::uint8_t* codes_device) noexcept;
  static void specache_encode(const half* k_device, const PageStrides& ks, const std::int32_t* seq_pages_device,
                              const ops::KeyCopyGeometry& geo, std::int64_t first, std::int64_t count, std::uint8_t* codes_device) noexcept;
  static void specache_encode(const bfloat16* k_device, const PageStrides& ks, const std::int32_t* seq_pages_device,
                              const ops::KeyCopyGeometry& geo, std::int64_t first, std::int64_t count, std::uint8_t* codes_device) noexcept;
  /// Logits from the copy (a thread per kv head, query head and token; the
  /// host's bits), then a block per kv head: each query head's softmax (expf,
  /// block-wide double sum) and the group mean. `probs`: Hkv * G * n floats.
  static void specache_scores(const float* q_device, std::int64_t q_head_stride, std::int64_t q_dim_stride, std::int32_t G, float scale,
                              const std::uint8_t* codes_device, const std::int32_t* seq_pages_device, const ops::KeyCopyGeometry& geo,
                              std::int64_t n, float* probs_device, float* mean_device) noexcept;
  static void specache_scores(const half* q_device, std::int64_t q_head_stride, std::int64_t q_dim_stride, std::int32_t G, float scale,
                              const std::uint8_t* codes_device, const std::int32_t* seq_pages_device, const ops::KeyCopyGeometry& geo,
                              std::int64_t n, float* probs_device, float* mean_device) noexcept;
  static void specache_scores(const bfloat16* q_device, std::int64_t q_head_stride, std::int64_t q_dim_stride, std::int32_t G, float scale,
                              const std::uint8_t* codes_device, const std::int32_t* seq_pages_device, const ops::KeyCopyGeometry& geo,
                              std::int64_t n, float* probs_device, float* mean_device) noexcept;
  /// A thread per entry of one sequence: the selected tokens' means added in the host's order.
  static void specache_priorities(std::int32_t page_size, std::int64_t n, std::int32_t num_kv_heads, const std::int32_t* idx_device,
                                  std::int64_t k, const float* mean_device, float* prio_device) noexcept;

  // ---- ShadowKV (ops/shadowkv_ops.hpp: semantics and host reference) ----

  /// A thread per (chunk, kv head) of chunks [first, first + count) of one
  /// sequence (`seq_pages_device`: its page ids): landmark and min cosine with
  /// the host's operations, order and rounding (the same bits).
  static void shadowkv_landmarks(const float* k_device, const PageStrides& ks, const std::int32_t* seq_pages_device,
                                 const ops::ChunkGeometry& geo, std::int64_t first, std::int64_t count, float* landmarks_device,
                                 float* outlier_device) noexcept;
  static void shadowkv_landmarks(const half* k_device, const PageStrides& ks, const std::int32_t* seq_pages_device,
                                 const ops::ChunkGeometry& geo, std::int64_t first, std::int64_t count, float* landmarks_device,
                                 float* outlier_device) noexcept;
  static void shadowkv_landmarks(const bfloat16* k_device, const PageStrides& ks, const std::int32_t* seq_pages_device,
                                 const ops::ChunkGeometry& geo, std::int64_t first, std::int64_t count, float* landmarks_device,
                                 float* outlier_device) noexcept;
  /// out (Hkv, cand) = -outlier score, a thread per element.
  static void shadowkv_outlier_keys(const float* outlier_device, const std::int32_t* seq_pages_device, const ops::ChunkGeometry& geo,
                                    std::int64_t cand, float* out_device) noexcept;
  /// A block per kv head: masked logits in the host's order, each query
  /// head's softmax (expf, block-wide double sum), the group max; `logits`:
  /// Hkv * G * cand floats of device scratch.
  static void shadowkv_chunk_scores(const float* q_device, std::int64_t q_head_stride, std::int64_t q_dim_stride, std::int32_t G,
                                    float scale, const float* landmarks_device, const std::int32_t* seq_pages_device,
                                    const ops::ChunkGeometry& geo, std::int64_t cand, const std::int32_t* oidx_device, std::int64_t no,
                                    float* logits_device, float* score_device) noexcept;
  static void shadowkv_chunk_scores(const half* q_device, std::int64_t q_head_stride, std::int64_t q_dim_stride, std::int32_t G,
                                    float scale, const float* landmarks_device, const std::int32_t* seq_pages_device,
                                    const ops::ChunkGeometry& geo, std::int64_t cand, const std::int32_t* oidx_device, std::int64_t no,
                                    float* logits_device, float* score_device) noexcept;
  static void shadowkv_chunk_scores(const bfloat16* q_device, std::int64_t q_head_stride, std::int64_t q_dim_stride, std::int32_t G,
                                    float scale, const float* landmarks_device, const std::int32_t* seq_pages_device,
                                    const ops::ChunkGeometry& geo, std::int64_t cand, const std::int32_t* oidx_device, std::int64_t no,
                                    float* logits_device, float* score_device) noexcept;
  /// A thread per entry of one sequence of n tokens: the tail, outlier and
  /// selected chunks found by binary search in the ascending rows, raised as the host does.
  static void shadowkv_priorities(const ops::ChunkGeometry& geo, std::int64_t n, std::int64_t cand, const std::int32_t* oidx_device,
                                  std::int64_t no, const std::int32_t* sidx_device, std::int64_t k, const float* score_device,
                                  float* prio_device) noexcept;

  /// Bytes of device workspace `adakv_keep` needs for a (rows, T) score map:
  /// a ranked copy of the map (the original's normalisation), one threshold
  /// per row and one for the layer.
  static std::size_t adakv_keep_workspace(std::int64_t rows, std::int64_t T) noexcept;

  /// `ops::adakv_keep` on the device (semantics and host reference in
  /// ops/adakv_keep.hpp): from the (rows, T) contiguous score map, counts[r]
  /// and indptr[1..rows] (from indptr[0], read on the device) and each row's
  /// best counts[r] tokens, ascending, at indices + indptr[r]; all device
  /// memory, so no host synchronisation. Counts and rows equal the host
  /// reference bit for bit (same selections, the original's normalisation
  /// summed in fp64 in the host's order). Rejected before anything is
  /// enqueued: rows or T < 0, rows > 65535, rows * T > INT32_MAX, null
  /// pointers, selections out of range, a small workspace.
  /// Launches: up to 7 (adakv.cu); the layer threshold runs in one block.
  static void adakv_keep(const float* scores_device, std::int64_t rows, std::int64_t T, const AdaKVKeepSpec& spec,
                         std::int64_t* counts_device, std::int32_t* indptr_device, std::int32_t* indices_device,
                         Workspace ws_device) noexcept;

  // ---- Expected Attention: the per-head steps of ops/expected_steps.hpp ----
  //
  // Same semantics as the references there, on device memory (the RoPE
  // tables `cb` / `sb` are host arrays, copied into the launch arguments;
  // head_dim <= 256). Statistics, rotation and logits are bit-identical to
  // `backend::Scalar` (round-to-nearest intrinsics in the reference's order);
  // the softmax uses the device expf and a blocked double denominator (about
  // 1e-6 relative). The `block` / `c` / `scratch` arguments of the host
  // reference are unused here.

  template <class Tq>
  static void expected_statistics(const TensorView<const Tq, 3>& q_device, std::int64_t head, std::int64_t t0, std::int64_t d, bool use_cov,
                                  double* mu_device, double* cov_device, float* block, float* c) noexcept;
  static void expected_rotate(const double* mu_device, double* cov_device, std::int64_t d, const float* cb_host, const float* sb_host,
                              float* mf_device, float* covf_device) noexcept;
  template <class Tk>
  static void expected_logits_max(const float* mean_device, const float* cov_device, std::int64_t d, const Rows<Tk>& keys_device,
                                  std::int64_t j0, std::int64_t j1, float* z_device, float* scratch, float* mx_device) noexcept;
  static std::size_t expected_softmax_workspace(std::int64_t T) noexcept;
  static void expected_softmax(float* z_device, std::int64_t j0, std::int64_t j1, const float* mx_device, float* s_device,
                               Workspace ws_device) noexcept;
  static void expected_finish(float* s_device, const float* neg_norm_device, std::int64_t n0, std::int64_t T, std::int64_t G,
                              float eps) noexcept;

  // ---- fp8 rows (Fp8Quant) --------------------------------------------------

  /// `ScalarQuantOps::fp8_quantize_rows` / `fp8_dequantize_rows` on device
  /// memory, bit-identical (quant/fp8.hpp's integer codec, round-to-nearest
  /// fp32 division and product, `from_float`'s narrowing): `rows` rows of d
  /// values at x (row stride x_stride) to codes at out (row stride
  /// out_stride) with one scale, or (scale <= 0) each row's dynamic scale
  /// stored after its codes (fp32, then 12 zero bytes). One block per row.
  template <class T>
  static void fp8_quantize_rows(Fp8Format f, const T* x_device, std::int64_t rows, std::int64_t x_stride, std::int64_t d, float scale,
                                std::uint8_t* out_device, std::int64_t out_stride) noexcept;
  template <class T>
  static void fp8_dequantize_rows(Fp8Format f, const std::uint8_t* in_device, std::int64_t rows, std::int64_t in_stride, std::int64_t d,
                                  float scale, T* y_device, std::int64_t y_stride) noexcept;

  // ---- tiers (MixedPrecision) ---------------------------------------------------

  /// `ScalarScoreOps::rank_tiers` on device memory, identical results: one
  /// thread block per row, no workspace (rank_tiers_workspace is 0).
  static std::size_t rank_tiers_workspace(std::int64_t n) noexcept;
  static void rank_tiers(const float* scores_device, std::int64_t rows, std::int64_t n, std::int64_t ld, std::int64_t n_keep,
                         std::int64_t n_full, std::int32_t* idx_device, std::uint8_t* tier_device, std::int64_t out_ld,
                         Workspace ws) noexcept;

  // ---- ggml / INT4 token rows (GgmlQuant, Int4Quant): the QuantOps family ----

  /// `ScalarQuantOps::encode_token_rows` / `decode_token_rows` on device
  /// memory, bit-identical: the ggml blocks are quant/ggml_blocks.inl's
  /// algorithms compiled for the device (products rounded alone, fp16 scales
  /// rounded to nearest even), the INT rows quant/int4.hpp's host-device
  /// helpers, the rotation the reference's butterflies stage by stage. Rows
  /// are not scanned for NaN / Inf (the host policies reject them; on the
  /// device a non-finite row gives unspecified codes within its own bytes).
  /// Unrotated ggml rows: one thread per block; rotated or INT rows: one
  /// thread block per row, staged in shared memory (d <= 4096).
  template <class T>
  static void encode_token_rows(const TokenRowCodec& c, const T* x_device, std::int64_t rows, std::int64_t x_stride, std::int64_t d,
                                std::uint8_t* out_device, std::int64_t out_stride) noexcept;
  template <class T>
  static void decode_token_rows(const TokenRowCodec& c, const std::uint8_t* in_device, std::int64_t rows, std::int64_t in_stride,
                                std::int64_t d, T* y_device, std::int64_t y_stride) noexcept;
  /// `ScalarQuantOps::ggml_quantize_row` / `ggml_dequantize_row`: one run of n values (n a multiple of 32)
  /// as n / 32 independent blocks (encode_token_rows with 32-value rows).
  template <class T>
  static void ggml_quantize_row(GgmlType t, const T* x_device, std::int64_t n, std::uint8_t* out_device) noexcept {
    encode_token_rows(TokenRowCodec::ggml_blocks(t), x_device, n / kGgmlBlock, kGgmlBlock, kGgmlBlock, out_device, ggml_block_bytes(t));
  }
  template <class T>
  static void ggml_dequantize_row(GgmlType t, const std::uint8_t* in_device, std::int64_t n, T* y_device) noexcept {
    decode_token_rows(TokenRowCodec::ggml_blocks(t), in_device, n / kGgmlBlock, ggml_block_bytes(t), kGgmlBlock, y_device, kGgmlBlock);
  }

  // ---- KIVI (KiviQuant): the QuantOps family's KIVI ops -------------------------

  /// `ScalarQuantOps::kivi_encode_tokens` / `kivi_decode_tokens` /
  /// `kivi_update_residual` on device memory, bit-identical (quant/kivi.hpp's
  /// host-device fp16 arithmetic). Values and group ranges are not scanned.
  /// Key groups of more than 256 tokens are refused (kUnsupported).
  template <class T>
  static void kivi_encode_tokens(const kivi::Codec& k, const half* res_device, std::int64_t res_stride, std::int64_t res_len,
                                 const T* x_device, std::int64_t x_stride, std::int64_t count, std::int64_t d, std::uint8_t* codes_device,
                                 std::int64_t codes_stride, std::uint8_t* scales_device, std::int64_t scales_stride) noexcept;
  template <class T>
  static void kivi_decode_tokens(const kivi::Codec& k, const std::uint8_t* codes_device, std::int64_t codes_stride,
                                 const std::uint8_t* scales_device, std::int64_t scales_stride, std::int64_t count, std::int64_t d,
                                 T* y_device, std::int64_t y_stride) noexcept;
  template <class T>
  static void kivi_update_residual(half* res_device, std::int64_t res_stride, std::int64_t res_len, std::int64_t nq, const T* x_device,
                                   std::int64_t x_stride, std::int64_t n, std::int64_t d) noexcept;

  // ---- pages (Quest): the PageOps family of ops/paged_scalar.hpp ----------
  //
  // Same semantics as `ScalarPageOps`; defined in src/page_ops.cu for every
  // (Tk, Tm) pair of {float, half, bfloat16} that `PageMetaStorableFrom`
  // allows, and every (Tk, Tv) pair of the same three types.

  template <class Tk, class Tm>
  static void page_meta_fold(const Tk* rows_device, std::int64_t row_stride, std::int64_t num_rows, std::int64_t head_dim, Tm* max_device,
                             Tm* min_device, bool fresh) noexcept;

  /// `Scalar::page_meta_append` on the device, bit-identical: one block per
  /// (page touched, kv head); the page ids are read on the device.
  template <class Tk, class Tm>
  static void page_meta_append(const Tk* k_data_device, const PageStrides& strides, std::int32_t page_size, std::int32_t num_kv_heads,
                               std::int64_t head_dim, const std::int32_t* pages_device, std::int64_t t0, std::int64_t t1,
                               PageMetaView<Tm> meta_device) noexcept;

  static std::size_t page_bounds_workspace(std::int64_t num_q_rows, std::int64_t head_dim) noexcept;

  template <class Tm>
  static void page_bounds(const float* q_device, std::int64_t group, std::int64_t head_dim, PageMetaView<const Tm> meta_device,
                          const std::int32_t* pages_device, std::int64_t n, float* out_device, std::int64_t ld_out,
                          Workspace ws_device) noexcept;

  template <class T>
  static std::int64_t attention_block(const Rows<T>& keys) noexcept {
    return keys.pages != nullptr ? keys.page_size : 64;
  }

  static std::size_t paged_attention_workspace(std::int64_t group, std::int64_t block, std::int64_t head_dim) noexcept;

  template <class Tk, class Tv>
  static void paged_decode_attention(const float* q_device, std::int64_t group, std::int64_t head_dim, Rows<Tk> keys_device,
                                     Rows<Tv> values_device, std::int64_t num_tokens, float scale, float* out_device, float* lse_device,
                                     Workspace ws_device) noexcept;

  // ---- paged quantized pool (QuantizedPaged; ops/quantized_paged_ops.hpp: semantics and host reference) ----

  /// Code rows of tokens [first, first + count) of one sequence to / from a contiguous
  /// (num_heads, count, row_bytes) buffer: a thread per 4-byte word where every row and stride is 4-byte
  /// aligned, else per byte. The same bytes as the reference.
  static void code_rows_gather(const std::uint8_t* pool_device, const ops::CodePageGeometry& geo, const std::int32_t* seq_pages_device,
                               std::int64_t first, std::int64_t count, std::uint8_t* dst_device) noexcept;
  static void code_rows_scatter(const std::uint8_t* src_device, const ops::CodePageGeometry& geo, const std::int32_t* seq_pages_device,
                                std::int64_t first, std::int64_t count, std::uint8_t* pool_device) noexcept;
  /// A block per (page run, head), a thread per channel folding the run's rows in order: the reference's bits.
  static void code_page_meta_fold(const float* rows_device, std::int64_t head_dim, const ops::CodePageGeometry& geo,
                                  const std::int32_t* seq_pages_device, std::int64_t first, std::int64_t count,
                                  PageMetaView<float> meta_device) noexcept;
  /// A block per query head: the chunk's weights from the state (expf), then the products and sums rounded
  /// as the reference's.
  static void lse_merge_chunk(const float* po_device, const float* pl_device, std::int64_t group, std::int64_t d, bool first,
                              float* out_device, float* m_device, float* sum_device) noexcept;
  /// A thread per output element (the division rounded as the reference's; lse with logf).
  static void lse_merge_finish(float* out_device, const float* m_device, const float* sum_device, std::int64_t group, std::int64_t d,
                               bool empty, float* lse_device) noexcept;
};

}  // namespace backend
KVP_NAMESPACE_END
