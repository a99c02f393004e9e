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
#include "kvpolicy/core/rows.hpp"
#include "kvpolicy/core/status.hpp"
#include "kvpolicy/core/workspace.hpp"
#include "kvpolicy/ops/scalar.hpp"
#include "kvpolicy/ops/types.hpp"

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
  /// Accuracy: dot products and the window sum are accumulated in the same
  /// order as the scalar reference, the denominator in fp64; results differ
  /// from `backend::Scalar` only by expf rounding (a few ulp).
  /// Complexity: 3 kernels; O(group*window*kv_len*head_dim) work, keys are
  /// read once per 64 query rows.
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
};

}  // namespace backend
KVP_NAMESPACE_END
