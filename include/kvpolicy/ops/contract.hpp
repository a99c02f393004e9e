// SPDX-License-Identifier: Apache-2.0
// The ops contract, stated: one concept per op family. A backend tag models a
// family when every op of it exists with the reference signature (the scalar
// families in scalar.hpp, paged_scalar.hpp and reduce_scalar.hpp are the
// semantics). Policies are written against these ops only, so
//   static_assert(HostBackend<backend::Cpu>);
// in a backend header turns a missing op into one readable line instead of a
// template error deep inside a policy. Batched forms (ops/batched.hpp) have
// scalar defaults; a device backend implements them to run a policy step
// without one launch per head.
//
// Conventions shared by every op: static, `noexcept`, `void`, inputs
// already validated by the calling policy (ops never validate), workspace
// sized by the op's `*_workspace` companion; a workspace smaller than that is
// a caller bug that policies reject before calling (`check_workspace`).
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>

#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/page_selection.hpp"
#include "kvpolicy/core/parallel.hpp"
#include "kvpolicy/core/rows.hpp"
#include "kvpolicy/core/workspace.hpp"
#include "kvpolicy/ops/scalar.hpp"
#include "kvpolicy/quant/token_rows.hpp"

KVP_NAMESPACE_BEGIN

/// Window attention, pooling, group reduction, top-k, the tier ranking (MixedPrecision), gather (SnapKV, TOVA,
/// ObservedAttention, H2O from queries, Ada-KV, PyramidKV, Expected Attention),
/// and the writes into outputs (iota, fill, copy_strided) that let a policy's
/// outputs live in device memory.
template <class B, class Tk = float>
concept ScoreOps = requires(const WindowScoreShape& s, const float* q, const float* in, float* out, Rows<Tk> rows, Workspace ws,
                            std::int64_t n, std::int32_t* idx, const std::int32_t* cidx, Tk* dst, std::uint8_t* tier) {
  // window_scores_workspace may grow with s.q_pos0 (Cuda's logits tile holds q_pos0 + window
  // columns); a caller that makes several calls sizes the workspace for the largest q_pos0.
  { B::window_scores_workspace(s) } -> std::same_as<std::size_t>;
  B::window_scores(s, q, rows, out, ws);
  B::pool1d(in, n, 5, Pooling::kAvg, out);
  B::group_reduce(in, n, n, n, GroupReduce::kMean, out);
  { B::topk_workspace(n) } -> std::same_as<std::size_t>;
  B::topk(in, n, n, idx, ws);
  { B::rank_tiers_workspace(n) } -> std::same_as<std::size_t>;
  B::rank_tiers(in, n, n, n, n, n, idx, tier, n, ws);
  B::gather_rows(rows, cidx, n, n, dst, n);
  B::iota(idx, n, n);
  B::fill(out, n, n, 1.0f);
  B::copy_strided(in, n, out, n);
};

/// Page metadata fold, upper-bound estimate, decode attention over pages (Quest).
template <class B, class Tk = float, class Tm = float>
concept PageOps = requires(const Tk* krows, Tm* mx, Tm* mn, const float* q, PageMetaView<const Tm> meta, const std::int32_t* pages,
                           float* out, float* lse, Rows<Tk> rows, Workspace ws, std::int64_t n) {
  B::page_meta_fold(krows, n, n, n, mx, mn, true);
  { B::page_bounds_workspace(n, n) } -> std::same_as<std::size_t>;
  B::page_bounds(q, n, n, meta, pages, n, out, n, ws);
  { B::attention_block(rows) } -> std::same_as<std::int64_t>;
  { B::paged_attention_workspace(n, n, n) } -> std::same_as<std::size_t>;
  B::paged_decode_attention(q, n, n, rows, rows, n, 1.0f, out, lse, ws);
};

/// Row kernels shared by the policies: query widening, NaN / non-finite scans, the
/// one-victim argmin, protected counts, head means, column-sum accumulation
/// (H2O), expected logits / covariance products / softmax / value norms (Expected Attention), row
/// dot products in a fixed order (the merging policies' cosine searches).
template <class B, class Tq = float>
concept ReduceOps = requires(const TensorView<const Tq, 3>& q, const TensorView<const Tq, 2>& rows, const float* x, float* out,
                             std::int64_t n, std::int64_t* at, Rows<Tq> krows, const Tq* v, double* dacc, const double* cdacc) {
  B::accumulate_column_sums(out, n, q, n, n, true);
  { B::expected_logits(x, x, n, krows, n, n, out, out) } -> std::same_as<float>;
  B::softmax_accumulate(out, n, n, 1.0f, out);
  B::outer_upper_accumulate(x, n, n, out);
  B::accumulate_rows_f64(x, n, n, dacc);
  B::centre_rows(out, n, n, cdacc);
  B::add_upper_f64(x, n, dacc);
  { B::row_norm(v, n) } -> std::same_as<float>;
  B::neg_row_norms(krows, n, n, out, n);
  B::widen_queries(q, n, n, n, n, out);
  { B::has_nan(x, n) } -> std::same_as<bool>;
  { B::first_nan(x, n) } -> std::same_as<std::int64_t>;
  { B::first_nonfinite(x, n) } -> std::same_as<std::int64_t>;
  { B::first_nonfinite(v, n) } -> std::same_as<std::int64_t>;
  { B::argmin_or_nan(x, n, at) } -> std::same_as<std::int64_t>;
  { B::count_protected(x, n) } -> std::same_as<std::int64_t>;
  B::mean_rows(rows, out);
  B::row_dots(x, x, n, n, out);
  B::widen_row(v, n, out);
};

/// Row quantization on any backend: ggml blocks of one run (quant/ggml.hpp),
/// whole token rows of a ggml or INT4 / INT8 format behind an optional
/// Hadamard rotation (quant/token_rows.hpp: GgmlQuant, Int4Quant), fp8
/// rows with one or per-row scales (Fp8Quant), and KIVI's tokens from a
/// residual window and new rows (KiviQuant).
template <class B, class T = float>
concept QuantOps = requires(GgmlType t, const TokenRowCodec& c, const kivi::Codec& k, const T* x, T* y, std::int64_t n, std::uint8_t* bytes,
                            const std::uint8_t* cbytes, const half* res, half* hres) {
  B::ggml_quantize_row(t, x, n, bytes);
  B::ggml_dequantize_row(t, cbytes, n, y);
  B::encode_token_rows(c, x, n, n, n, bytes, n);
  B::decode_token_rows(c, cbytes, n, n, n, y, n);
  B::fp8_quantize_rows(Fp8Format::kE4M3, x, n, n, n, 1.0f, bytes, n);
  B::fp8_dequantize_rows(Fp8Format::kE4M3, cbytes, n, n, n, 1.0f, y, n);
  B::kivi_encode_tokens(k, res, n, n, x, n, n, n, bytes, n, bytes, n);
  B::kivi_decode_tokens(k, cbytes, n, cbytes, n, n, n, y, n);
  B::kivi_update_residual(hres, n, n, n, x, n, n, n);
};

/// One kv head's nearest-kept linear merge (ops/merge_scalar.hpp): what the
/// token-merging policies (kvpress MergingPress, LOOK-M, NearestKeptMerge;
/// D2O through its two halves and the shared decision) call on a device backend. Host backends run the same arithmetic per row
/// through `ReduceOps` (row_dots, widen_row, row_norm).
template <class B, class Tk = float>
concept MergeOps = requires(const MergeRule& rule, Rows<Tk> rows, const std::int32_t* cidx, std::int32_t* idx, float* x, const float* cx,
                            std::int64_t n, D2OState* state, Workspace ws) {
  { B::merge_head_workspace(n, n) } -> std::same_as<std::size_t>;
  B::merge_head(rule, rows, rows, cidx, n, n, n, x, idx, idx, x, x, n, x, n, ws);
  B::merge_nearest(rows, cidx, n, n, n, 1.0f, idx, idx, x, ws);
  B::merge_apply(rule, rows, rows, cidx, n, n, n, x, cidx, idx, cx, idx, idx, x, x, n, x, n, ws);
  B::d2o_decide(cx, idx, n, n, 0.5f, 0.5f, state);
};

/// Everything a host policy calls, for the key dtypes the library stores.
template <class B>
concept HostBackend = ScoreOps<B, float> && ScoreOps<B, half> && ScoreOps<B, bfloat16> && PageOps<B, float, float> &&
    PageOps<B, half, half> && PageOps<B, bfloat16, bfloat16> && ReduceOps<B, float> && ReduceOps<B, half> && QuantOps<B, float> &&
    QuantOps<B, half> && QuantOps<B, bfloat16> && requires(const bfloat16* b, std::int64_t n) {
  { B::first_nonfinite(b, n) } -> std::same_as<std::int64_t>;
};

static_assert(HostBackend<backend::Scalar>, "the scalar reference must model the whole contract");
static_assert(MergeOps<backend::Scalar, float> && MergeOps<backend::Scalar, half> && MergeOps<backend::Scalar, bfloat16>,
              "the scalar reference must model the merge op");

KVP_NAMESPACE_END
