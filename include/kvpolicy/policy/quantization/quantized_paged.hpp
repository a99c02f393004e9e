// SPDX-License-Identifier: Apache-2.0
// A paged KV cache stored in a per-token quantization format (ggml blocks,
// fp8 with inline or per-tensor scales, token-wise INT4 rotated or not): the
// page pool holds code rows, described by a `PagedKVView<const std::uint8_t>`
// whose "head_dim" is the format's row_bytes(head_dim) (NHD or HND, any
// strides with contiguous rows, the FlashInfer CSR page table as usual).
// Two operations on it, neither materialising a dequantized cache (rows are
// decoded one page at a time into the caller's workspace):
//
//   quantized_page_meta_append   Quest's page metadata (channel max / min per
//                                page and kv head) from the appended tokens'
//                                decoded keys: Quest::select then runs on it
//                                unchanged. Equal to Quest::on_append on the
//                                decoded pool, bit for bit.
//   quantized_paged_decode_attention
//                                exact softmax attention of a GQA group's
//                                decode queries over a page list's decoded
//                                keys and values (online softmax, one page a
//                                block, the scalar reference's order): equal
//                                to backend::Scalar's paged_decode_attention
//                                over the decoded pool (tested to 1e-6).
//                                With a `Context<Backend>` first: the page is
//                                decoded by the backend's codecs and attended
//                                by `Backend::paged_decode_attention` (one
//                                call per chunk of whole pages, >= 64 rows),
//                                and the chunks' partial results are merged
//                                by their log-sum-exp. On
//                                backend::Scalar that is the overload above,
//                                bit for bit; on backend::Cpu the output is
//                                within 1e-5 relative of it (the op's own
//                                contract: summation order, a polynomial exp),
//                                with the same NaN / nothing-attended rules.
//
// Quantize-on-append is the format's own `quantize` on the appended rows
// written at their slots (`quantize_paged_append`; with a `Context<Backend>`
// first, the backend's quantizer, whose bytes equal backend::Scalar's for
// every format here).
// Formats whose rows are not self-contained (KIVI's per-channel key groups)
// are not paged here. Validation before any write: the format's parameters
// and row bytes, the pool and its table, the metadata shape, workspace size.
//
// On a device backend (backend::Cuda; the pool, `table.indices`, the page
// list, queries, outputs, metadata and workspace in device memory, tagged so;
// `table.indptr` / `last_page_len` and `append_len` host arrays, as for
// every paged policy) the three operations work through the ops of
// ops/quantized_paged_ops.hpp, a chunk of whole pages (>= 1024 rows,
// `detail::quantized_device_chunk`) at a time, and never read a page id on
// the host:
//   quantize_paged_append   the chunk's rows quantized by the format's
//                           device codec into the workspace
//                           (quantize_paged_append_workspace), then
//                           scattered to their slots (code_rows_scatter).
//                           The same bytes as the host's. The rows are not
//                           scanned for NaN / Inf (as every device
//                           quantizer: a non-finite row gets unspecified
//                           codes in its own bytes).
//   quantized_page_meta_append
//                           the chunk's code rows gathered, decoded by the
//                           format's device codec, folded into the pages'
//                           metadata run by run (code_page_meta_fold): the
//                           host's metadata bit for bit. Workspace:
//                           quantized_page_meta_workspace.
//   quantized_paged_decode_attention
//                           per chunk the key and value code rows gathered
//                           and decoded, Backend::paged_decode_attention
//                           over them, the chunk's output merged by its
//                           log-sum-exp on the device (lse_merge_chunk /
//                           lse_merge_finish). Within 1e-5 relative of the
//                           scalar overload (the device exp, the chunked
//                           merge). The page list's ids are not range-checked
//                           (that would need a device read). Workspace:
//                           quantized_paged_attention_workspace<Backend>(qk,
//                           page_size, head_dim, group).
// Each call enqueues on ctx.stream and returns the first error its ops
// recorded, without synchronising.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "kvpolicy/core/page_selection.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/ops/quantized_paged_ops.hpp"
#include "kvpolicy/ops/scalar.hpp"
#include "kvpolicy/policy/concepts.hpp"
#include "kvpolicy/policy/policy.hpp"
#include "kvpolicy/policy/quantization/quant_checks.hpp"

KVP_NAMESPACE_BEGIN

namespace detail {
/// `rows` code rows starting at `first` (slot stride `stride` bytes) decoded into dst (rows x d) by the
/// format's codecs on `Backend` (serially: one page of one head).
template <class Backend = backend::Scalar, class Q>
void decode_code_rows(const Q& q, const std::uint8_t* first, std::int64_t stride, std::int64_t rows, std::int64_t d, float* dst) noexcept {
  const QuantizedKV region{
      q.layout(), TensorView<std::uint8_t, 3>(const_cast<std::uint8_t*>(first), {1, rows, q.row_bytes(d)}, {0, stride, 1}), {}, rows};
  (void)q.dequantize(Context<Backend>{}, region, TensorView<float, 3>::contiguous(dst, {1, rows, d}));
}

/// Rows a chunk of the backend attention path decodes before one op call: whole pages, at least 64 rows
/// (the op's own block) so that short pages do not pay a call and a merge each.
constexpr std::int64_t quantized_attention_chunk(std::int32_t page_size) noexcept {
  const std::int64_t P = page_size < 1 ? 1 : page_size;
  return P * ((64 + P - 1) / P);
}

/// Rows a device call handles per chunk: whole pages, at least 1024 rows (fewer launches; the workspace
/// holds one chunk).
constexpr std::int64_t quantized_device_chunk(std::int32_t page_size) noexcept {
  const std::int64_t P = page_size < 1 ? 1 : page_size;
  return P * ((1024 + P - 1) / P);
}

/// On a device backend the pool must be device memory and its page ids are not read (the table's indices
/// are device memory); on the host, host memory with every id checked.
template <class Q>
Status check_code_pool(const char* who, const Q& q, const PagedKVView<const std::uint8_t>& pool, std::int64_t head_dim, bool need_values,
                       bool on_device = false) noexcept {
  KVP_RETURN_IF_ERROR(q.validate_params());
  KVP_RETURN_IF_ERROR(pool.validate(who, need_values, /*check_ids=*/!on_device));
  if (on_device)
    KVP_REQUIRE(!pool.device.is_host(), "%s: the code pool is host memory; a device backend reads device memory (tag the view kCUDA)", who);
  else
    KVP_REQUIRE(pool.device.is_host(), "%s: the code pool is on a device; this entry point reads host memory", who);
  KVP_REQUIRE(head_dim >= 1 && head_dim <= 4096, "%s: head_dim %lld must be in [1, 4096]", who, static_cast<long long>(head_dim));
  KVP_REQUIRE(pool.head_dim == q.row_bytes(head_dim),
              "%s: the code pool's rows are %d bytes, the format's rows are %lld bytes at head_dim %lld", who, pool.head_dim,
              static_cast<long long>(q.row_bytes(head_dim)), static_cast<long long>(head_dim));
  // The format accepts head_dim (e.g. a ggml block multiple): probe with an empty region.
  std::uint8_t byte = 0;
  float f = 0.0f;
  const QuantizedKV probe{q.layout(), TensorView<std::uint8_t, 3>(&byte, {1, 0, q.row_bytes(head_dim)}, {0, 1, 1}), {}, 0};
  return q.dequantize(Context<backend::Scalar>{}, probe, TensorView<float, 3>(&f, {1, 0, head_dim}, {0, head_dim, 1}));
}

/// Decodes `rows` code rows of `heads` heads, contiguous at `codes` (heads, rows, row_bytes), into `out`
/// (heads, rows, d) by the format's device codec, on ctx's stream (both buffers device memory of `dev`).
template <class Backend, class Q>
Status decode_device_rows(const Context<Backend>& ctx, const Q& q, std::uint8_t* codes, std::int64_t heads, std::int64_t rows,
                          std::int64_t d, float* out, Device dev) noexcept {
  const std::int64_t rb = q.row_bytes(d);
  const QuantizedKV region{q.layout(), TensorView<std::uint8_t, 3>(codes, {heads, rows, rb}, {rows * rb, rb, 1}, dev), {}, rows};
  return q.dequantize(ctx.with_workspace({}), region, TensorView<float, 3>(out, {heads, rows, d}, {rows * d, d, 1}, dev));
}

/// The chunked attention's workspace, carved in this order by quantized_paged_decode_attention: R rows of
/// decoded keys and of values, the chunk's output (group, d) and lse, the merge state (m, sum), R code rows
/// of `code_row_bytes` (0 on the host: decoded straight from the pages), and the backend op's workspace.
template <class Backend>
std::size_t chunked_attention_workspace(std::int64_t R, std::int64_t head_dim, std::int64_t group, std::int64_t code_row_bytes) noexcept {
  const auto r = static_cast<std::size_t>(R), d = static_cast<std::size_t>(head_dim < 1 ? 1 : head_dim),
             g = static_cast<std::size_t>(group < 1 ? 1 : group);
  const Rows<float> run{nullptr, head_dim, nullptr, 0, 0};
  return WorkspacePlan{}
      .add<float>(r * d)
      .add<float>(r * d)
      .add<float>(g * d)
      .add<float>(g)
      .add<float>(g)
      .add<float>(g)
      .add_bytes(r * static_cast<std::size_t>(code_row_bytes))
      .add_bytes(Backend::paged_attention_workspace(group, Backend::attention_block(run), head_dim))
      .total();
}

/// Every check of a decode attention call but the workspace's. On a device the page list's ids are not read
/// (they are device memory); on the host each one is range-checked.
template <class Qk, class Qv>
Status check_attention_call(const char* who, const Qk& qk, const Qv& qv, const PagedKVView<const std::uint8_t>& pool, std::int32_t h,
                            const std::int32_t* pages, std::int64_t num_tokens, const float* q, std::int64_t group, std::int64_t head_dim,
                            const float* out, bool on_device) noexcept {
  KVP_RETURN_IF_ERROR(check_code_pool(who, qk, pool, head_dim, /*need_values=*/true, on_device));
  KVP_REQUIRE(qv.validate_params().is_ok() && qv.row_bytes(head_dim) == qk.row_bytes(head_dim),
              "%s: the value format's rows (%lld bytes) differ from the keys' (%lld): one pool holds both", who,
              static_cast<long long>(qv.row_bytes(head_dim)), static_cast<long long>(qk.row_bytes(head_dim)));
  KVP_REQUIRE(h >= 0 && h < pool.num_kv_heads, "%s: kv head %d out of range [0, %d)", who, h, pool.num_kv_heads);
  KVP_REQUIRE(num_tokens >= 0 && (num_tokens == 0 || pages != nullptr), "%s: %lld tokens with a null page list", who,
              static_cast<long long>(num_tokens));
  KVP_REQUIRE(q != nullptr && out != nullptr && group >= 1, "%s: queries / out are null or group < 1", who);
  if (!on_device)
    for (std::int64_t i = 0; i * pool.page_size < num_tokens; ++i)
      KVP_REQUIRE(pages[i] >= 0 && pages[i] < pool.num_pages, "%s: page %lld of the list is %d, out of range [0, %d)", who,
                  static_cast<long long>(i), pages[i], pool.num_pages);
  return Status::ok();
}

/// One worker's slice of the host paths' workspace: a page of decoded keys and of values, and the page's
/// logits for `group` heads (group 1 for the metadata).
inline std::size_t page_slice_bytes(std::int32_t page_size, std::int64_t head_dim, std::int64_t group) noexcept {
  return align_up(static_cast<std::size_t>(page_size) * static_cast<std::size_t>(head_dim) * sizeof(float)) * 2 +
         align_up(static_cast<std::size_t>(group * page_size) * sizeof(float));
}
}  // namespace detail

/// Workspace of quantized_page_meta_append / quantized_paged_decode_attention: one page of decoded rows
/// (keys; plus values and the page's logits for attention) per worker.
inline std::size_t quantized_paged_workspace(std::int32_t page_size, std::int64_t head_dim, std::int64_t group, int workers = 1) noexcept {
  return detail::WorkerSlices::bytes(detail::page_slice_bytes(page_size, head_dim, group), workers < 1 ? 1 : workers);
}

/// Workspace of the `Context<Backend>` overload of quantized_paged_decode_attention (ctx.workspace): on
/// backend::Scalar quantized_paged_workspace(page_size, head_dim, group); otherwise one page of decoded keys
/// and values for a chunk of whole pages (>= 64 rows), the chunk's partial output and lse, the merge state
/// (ops/quantized_paged_ops.hpp) and the backend op's own workspace.
/// (A device backend's size depends on the format's row bytes: use the overload below, which takes it.)
template <class Backend>
std::size_t quantized_paged_attention_workspace(std::int32_t page_size, std::int64_t head_dim, std::int64_t group) noexcept
    requires(!kDeviceBackend<Backend>) {
  if constexpr (std::is_same_v<Backend, backend::Scalar>) {
    return quantized_paged_workspace(page_size, head_dim, group);
  } else {
    return detail::chunked_attention_workspace<Backend>(detail::quantized_attention_chunk(page_size), head_dim, group, 0);
  }
}

/// The workspace of the `Context<Backend>` overload of quantized_paged_decode_attention for keys in format
/// qk, on any backend. On the host it is the overload above. On a device it is a chunk
/// (detail::quantized_device_chunk rows) of decoded keys and values, the chunk's code rows, the chunk's
/// output and lse, the merge state, and the backend op's own workspace.
template <class Backend, class Qk>
std::size_t quantized_paged_attention_workspace(const Qk& qk, std::int32_t page_size, std::int64_t head_dim, std::int64_t group) noexcept {
  if constexpr (!kDeviceBackend<Backend>) {
    return quantized_paged_attention_workspace<Backend>(page_size, head_dim, group);
  } else {
    const std::int64_t rb = qk.row_bytes(head_dim);
    return detail::chunked_attention_workspace<Backend>(detail::quantized_device_chunk(page_size), head_dim, group, rb < 1 ? 1 : rb);
  }
}

/// Workspace of quantized_page_meta_append on `Backend` for keys in format q (ctx.workspace). On the host
/// it is one page of decoded rows per worker; on a device, a chunk (detail::quantized_device_chunk rows) of
/// every kv head's code rows and decoded rows.
template <class Backend, class Q>
std::size_t quantized_page_meta_workspace(const Q& q, std::int32_t page_size, std::int64_t head_dim, std::int32_t num_kv_heads,
                                          int workers = 1) noexcept {
  if constexpr (!kDeviceBackend<Backend>) {
    return quantized_paged_workspace(page_size, head_dim, 1, workers);
  } else {
    (void)workers;
    const auto d = static_cast<std::size_t>(head_dim < 1 ? 1 : head_dim);
    const auto rows =
        static_cast<std::size_t>(detail::quantized_device_chunk(page_size)) * static_cast<std::size_t>(num_kv_heads < 1 ? 1 : num_kv_heads);
    const std::int64_t rb = q.row_bytes(head_dim);
    return WorkspacePlan{}.add_bytes(rows * static_cast<std::size_t>(rb < 1 ? 1 : rb)).add<float>(rows * d).total();
  }
}

/// Workspace of quantize_paged_append on `Backend` (ctx.workspace): none on the host (a staging row on the
/// stack); on a device, a chunk (detail::quantized_device_chunk rows) of every kv head's code rows.
template <class Backend, class Q>
std::size_t quantize_paged_append_workspace(const Q& q, std::int32_t page_size, std::int64_t head_dim, std::int32_t num_kv_heads) noexcept {
  if constexpr (!kDeviceBackend<Backend>) {
    return 0;
  } else {
    const auto rows =
        static_cast<std::size_t>(detail::quantized_device_chunk(page_size)) * static_cast<std::size_t>(num_kv_heads < 1 ? 1 : num_kv_heads);
    const std::int64_t rb = q.row_bytes(head_dim);
    return WorkspacePlan{}.add_bytes(rows * static_cast<std::size_t>(rb < 1 ? 1 : rb)).total();
  }
}

/// Quest metadata of the tokens just appended to a quantized K pool (append_len[b] per sequence, a host
/// array; nullptr: every page the table references), as Quest::on_append computes it on fp32 keys.
/// Workspace: quantized_page_meta_workspace<Backend>(q, page_size, head_dim, num_kv_heads, workers).
template <class Backend, class Q>
Status quantized_page_meta_append(const Context<Backend>& ctx, const Q& q, const PagedKVView<const std::uint8_t>& keys,
                                  std::int64_t head_dim, const std::int32_t* append_len, PageMetaView<float> meta) noexcept {
  constexpr const char* who = "quantized_page_meta";
  constexpr bool on_device = kDeviceBackend<Backend>;
  KVP_RETURN_IF_ERROR(detail::check_code_pool(who, q, keys, head_dim, /*need_values=*/false, on_device));
  KVP_RETURN_IF_ERROR(meta.validate(who, keys.num_pages, keys.num_kv_heads, static_cast<std::int32_t>(head_dim), on_device));
  if (append_len != nullptr)
    for (std::int32_t b = 0; b < keys.table.batch; ++b)
      KVP_REQUIRE(append_len[b] >= 0 && append_len[b] <= keys.seq_len(b), "%s: append_len[%d] is %d, must be in [0, sequence length %lld]",
                  who, b, append_len[b], static_cast<long long>(keys.seq_len(b)));
  KVP_RETURN_IF_ERROR(check_workspace(
      who, ctx.workspace, quantized_page_meta_workspace<Backend>(q, keys.page_size, head_dim, keys.num_kv_heads, ctx.exec.workers())));
  const std::int32_t P = keys.page_size;
  if constexpr (on_device) {
    const detail::BackendCall<Backend> call(ctx);
    KVP_RETURN_IF_ERROR(call.begin());
    const std::int64_t C = detail::quantized_device_chunk(P), H = keys.num_kv_heads, rb = q.row_bytes(head_dim);
    WorkspaceCarver c(ctx.workspace);
    std::uint8_t* codes = c.take<std::uint8_t>(static_cast<std::size_t>(H * C * rb));
    float* rows = c.take<float>(static_cast<std::size_t>(H * C * head_dim));
    const ops::CodePageGeometry geo{keys.k_strides, P, keys.num_kv_heads, rb};
    for (std::int32_t b = 0; b < keys.table.batch; ++b) {
      const std::int64_t len = keys.seq_len(b);
      const std::int32_t* seq_pages = keys.table.indices + keys.table.indptr[b];
      for (std::int64_t t = append_len ? len - append_len[b] : 0; t < len;) {
        const std::int64_t e = std::min(len, (t / C + 1) * C), n = e - t;  // chunk ends on page boundaries
        ops::code_rows_gather<Backend>(keys.k_data, geo, seq_pages, t, n, codes);
        KVP_RETURN_IF_ERROR(detail::decode_device_rows(ctx, q, codes, H, n, head_dim, rows, keys.device));
        ops::code_page_meta_fold<Backend>(rows, head_dim, geo, seq_pages, t, n, meta);
        t = e;
      }
    }
    return call.end();
  } else {
    const auto slices = detail::WorkerSlices::carve(ctx.workspace, detail::page_slice_bytes(P, head_dim, 1));
    ctx.exec.parallel_for(static_cast<std::int64_t>(keys.table.batch) * keys.num_kv_heads, [&](std::int64_t item, int worker) {
      WorkspaceCarver c(slices.slice(worker));
      float* rows_buf = c.take<float>(static_cast<std::size_t>(P * head_dim));
      const auto b = static_cast<std::int32_t>(item / keys.num_kv_heads);
      const auto h = static_cast<std::int32_t>(item % keys.num_kv_heads);
      const std::int64_t len = keys.seq_len(b);
      for (std::int64_t t = append_len ? len - append_len[b] : 0; t < len;) {
        const auto slot = static_cast<std::int32_t>(t % P);
        const std::int64_t rows = std::min<std::int64_t>(P - slot, len - t);
        const std::int32_t page = keys.table.page_of(b, t, P);
        detail::decode_code_rows<Backend>(q, keys.k_ptr(page, h, slot), keys.k_strides.slot, rows, head_dim, rows_buf);
        Backend::page_meta_fold(static_cast<const float*>(rows_buf), head_dim, rows, head_dim, meta.max_row(page, h), meta.min_row(page, h),
                                /*fresh=*/slot == 0);
        t += rows;
      }
    });
    return Status::ok();
  }
}

/// Softmax attention of `group` fp32 decode queries (group, head_dim) over the first num_tokens tokens of
/// the page list `pages` (sequence order) of kv head h in a quantized pool (keys by qk, values by qv):
/// out (group, head_dim), lse (group) or null. Workspace: quantized_paged_workspace(page_size, head_dim, group).
template <class Qk, class Qv>
Status quantized_paged_decode_attention(const Qk& qk, const Qv& qv, const PagedKVView<const std::uint8_t>& pool, std::int32_t h,
                                        const std::int32_t* pages, std::int64_t num_tokens, const float* q, std::int64_t group,
                                        std::int64_t head_dim, float scale, float* out, float* lse, Workspace ws) noexcept {
  constexpr const char* who = "quantized_paged_attention";
  KVP_RETURN_IF_ERROR(detail::check_attention_call(who, qk, qv, pool, h, pages, num_tokens, q, group, head_dim, out, false));
  const std::int64_t P = pool.page_size;
  KVP_RETURN_IF_ERROR(check_workspace(who, ws, quantized_paged_workspace(pool.page_size, head_dim, group)));
  WorkspaceCarver c(ws);
  float* kb = c.take<float>(static_cast<std::size_t>(P * head_dim));
  float* vb = c.take<float>(static_cast<std::size_t>(P * head_dim));
  float* s = c.take<float>(static_cast<std::size_t>(group * P));
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  for (std::int64_t i = 0; i < group * head_dim; ++i) out[i] = 0.0f;
  constexpr std::int64_t kHeads = 16;  // the heads' running state lives on the stack, 16 at a time
  for (std::int64_t g0 = 0; g0 < group; g0 += kHeads) {
    const std::int64_t gn = std::min(kHeads, group - g0);
    float run_max[kHeads], run_sum[kHeads];
    for (std::int64_t g = 0; g < gn; ++g) run_max[g] = kNegInf, run_sum[g] = 0.0f;
    for (std::int64_t j0 = 0, pi = 0; j0 < num_tokens; j0 += P, ++pi) {
      const std::int64_t bn = std::min(P, num_tokens - j0);
      detail::decode_code_rows(qk, pool.k_ptr(pages[pi], h, 0), pool.k_strides.slot, bn, head_dim, kb);
      detail::decode_code_rows(qv, pool.v_ptr(pages[pi], h, 0), pool.v_strides.slot, bn, head_dim, vb);
      for (std::int64_t g = 0; g < gn; ++g) {
        if (run_sum[g] != run_sum[g]) continue;
        const float* qg = q + (g0 + g) * head_dim;
        float* sg = s + g * P;
        float bmax = kNegInf;
        bool nan = false;
        for (std::int64_t t = 0; t < bn; ++t) {
          float acc = 0.0f;
          for (std::int64_t d = 0; d < head_dim; ++d) acc += qg[d] * kb[t * head_dim + d];
          sg[t] = acc * scale;
          nan = nan || sg[t] != sg[t];
          bmax = sg[t] > bmax ? sg[t] : bmax;
        }
        if (nan) {
          run_sum[g] = kNaN;
          continue;
        }
        const float new_max = bmax > run_max[g] ? bmax : run_max[g];
        if (new_max == kNegInf) continue;
        float* o = out + (g0 + g) * head_dim;
        if (new_max != run_max[g]) {
          const float alpha = std::exp(run_max[g] - new_max);
          run_sum[g] *= alpha;
          for (std::int64_t d = 0; d < head_dim; ++d) o[d] *= alpha;
          run_max[g] = new_max;
        }
        for (std::int64_t t = 0; t < bn; ++t) {
          const float p = std::exp(sg[t] - new_max);
          run_sum[g] += p;
          for (std::int64_t d = 0; d < head_dim; ++d) o[d] += p * vb[t * head_dim + d];
        }
      }
    }
    for (std::int64_t g = 0; g < gn; ++g) {  // as the reference: a NaN sum propagates, nothing attended gives 0 / -inf
      float* o = out + (g0 + g) * head_dim;
      const bool none = run_sum[g] == 0.0f;
      const float inv = none ? 0.0f : 1.0f / run_sum[g];
      for (std::int64_t d = 0; d < head_dim; ++d) o[d] *= inv;
      if (lse != nullptr) lse[g0 + g] = none ? kNegInf : run_max[g] + std::log(run_sum[g]);
    }
  }
  return Status::ok();
}

/// quantized_paged_decode_attention on `Backend` (see the header): workspace from ctx.workspace,
/// quantized_paged_attention_workspace<Backend>(qk, page_size, head_dim, group). Same validation, nothing
/// written on error. On a host backend other than Scalar the chunks (whole pages, >= 64 rows) are decoded
/// page by page; on a device backend (>= 1024 rows) gathered and decoded on the device (see the header).
template <class Backend, class Qk, class Qv>
Status quantized_paged_decode_attention(const Context<Backend>& ctx, const Qk& qk, const Qv& qv,
                                        const PagedKVView<const std::uint8_t>& pool, std::int32_t h, const std::int32_t* pages,
                                        std::int64_t num_tokens, const float* q, std::int64_t group, std::int64_t head_dim, float scale,
                                        float* out, float* lse) noexcept {
  if constexpr (std::is_same_v<Backend, backend::Scalar>) {
    return quantized_paged_decode_attention(qk, qv, pool, h, pages, num_tokens, q, group, head_dim, scale, out, lse, ctx.workspace);
  } else {
    constexpr const char* who = "quantized_paged_attention";
    constexpr bool on_device = kDeviceBackend<Backend>;
    KVP_RETURN_IF_ERROR(detail::check_attention_call(who, qk, qv, pool, h, pages, num_tokens, q, group, head_dim, out, on_device));
    const std::int64_t P = pool.page_size;
    KVP_RETURN_IF_ERROR(
        check_workspace(who, ctx.workspace, quantized_paged_attention_workspace<Backend>(qk, pool.page_size, head_dim, group)));
    const detail::BackendCall<Backend> call(ctx);
    KVP_RETURN_IF_ERROR(call.begin());
    WorkspaceCarver c(ctx.workspace);
    const std::int64_t R = on_device ? detail::quantized_device_chunk(pool.page_size) : detail::quantized_attention_chunk(pool.page_size);
    float* kb = c.take<float>(static_cast<std::size_t>(R * head_dim));
    float* vb = c.take<float>(static_cast<std::size_t>(R * head_dim));
    float* po = c.take<float>(static_cast<std::size_t>(group * head_dim));
    float* pl = c.take<float>(static_cast<std::size_t>(group));
    float* m = c.take<float>(static_cast<std::size_t>(group));
    float* sum = c.take<float>(static_cast<std::size_t>(group));
    const std::int64_t rb = qk.row_bytes(head_dim);
    std::uint8_t* codes = on_device ? c.take<std::uint8_t>(static_cast<std::size_t>(R * rb)) : nullptr;
    const Rows<float> run{nullptr, head_dim, nullptr, 0, 0};
    const std::size_t op_ws = Backend::paged_attention_workspace(group, Backend::attention_block(run), head_dim);
    const Workspace ows{c.take<std::byte>(op_ws), op_ws};
    // Per chunk: its keys and values decoded, the backend's attention over them, and the chunk's normalised
    // output folded into the running state by its lse (ops/quantized_paged_ops.hpp).
    for (std::int64_t j0 = 0; j0 < num_tokens; j0 += R) {
      const std::int64_t bn = std::min(R, num_tokens - j0);
      if constexpr (on_device) {
        const ops::CodePageGeometry kg{pool.k_strides, pool.page_size, 1, rb}, vg{pool.v_strides, pool.page_size, 1, rb};
        ops::code_rows_gather<Backend>(pool.k_data + h * pool.k_strides.head, kg, pages, j0, bn, codes);
        KVP_RETURN_IF_ERROR(detail::decode_device_rows(ctx, qk, codes, 1, bn, head_dim, kb, pool.device));
        ops::code_rows_gather<Backend>(pool.v_data + h * pool.v_strides.head, vg, pages, j0, bn, codes);
        KVP_RETURN_IF_ERROR(detail::decode_device_rows(ctx, qv, codes, 1, bn, head_dim, vb, pool.device));
      } else {
        for (std::int64_t r = 0; r < bn; r += P) {  // the chunk's pages, decoded one after the other
          const std::int32_t page = pages[(j0 + r) / P];
          const std::int64_t n = std::min(P, bn - r);
          detail::decode_code_rows<Backend>(qk, pool.k_ptr(page, h, 0), pool.k_strides.slot, n, head_dim, kb + r * head_dim);
          detail::decode_code_rows<Backend>(qv, pool.v_ptr(page, h, 0), pool.v_strides.slot, n, head_dim, vb + r * head_dim);
        }
      }
      Backend::paged_decode_attention(q, group, head_dim, Rows<float>{kb, head_dim, nullptr, 0, 0},
                                      Rows<float>{vb, head_dim, nullptr, 0, 0}, bn, scale, po, pl, ows);
      ops::lse_merge_chunk<Backend>(po, pl, group, head_dim, /*first=*/j0 == 0, out, m, sum);
    }
    ops::lse_merge_finish<Backend>(out, m, sum, group, head_dim, /*empty=*/num_tokens == 0, lse);
    return call.end();
  }
}

/// Quantize-on-append: rows (kv_heads, n, head_dim) of tokens [len_b - n, len_b) of sequence b written in
/// format `q` at their slots of the code pool's keys (values = false) or values (values = true).
/// With a `Context<Backend>` first, the rows are quantized by the backend's codecs (the same bytes as
/// backend::Scalar's for every format here; tests/quant pins that). On a device backend the rows are
/// device memory and ctx.workspace holds quantize_paged_append_workspace<Backend>(q, page_size, head_dim,
/// num_kv_heads) bytes (see the header).
template <class Backend, class Q, class T>
Status quantize_paged_append(const Context<Backend>& ctx, const Q& q, const PagedKVView<std::uint8_t>& pool, std::int32_t b,
                             TensorView<const T, 3> rows, bool values) noexcept {
  constexpr const char* who = "quantize_paged_append";
  constexpr bool on_device = kDeviceBackend<Backend>;
  const PagedKVView<const std::uint8_t> cpool = pool;
  const std::int64_t d = rows.extent(2), n = rows.extent(1);
  KVP_RETURN_IF_ERROR(detail::check_code_pool(who, q, cpool, d, values, on_device));
  KVP_RETURN_IF_ERROR(rows.check_basic(who, "rows"));
  KVP_RETURN_IF_ERROR(detail::check_quant_memory(who, "rows", on_device, rows.device(), rows.stride(2), d));
  KVP_REQUIRE(rows.extent(0) == pool.num_kv_heads, "%s: rows has %lld kv heads, the pool %d", who, static_cast<long long>(rows.extent(0)),
              pool.num_kv_heads);
  KVP_REQUIRE(b >= 0 && b < pool.table.batch, "%s: sequence %d out of range [0, %d)", who, b, pool.table.batch);
  const std::int64_t len = pool.seq_len(b);
  KVP_REQUIRE(n <= len, "%s: %lld rows for a sequence of %lld tokens", who, static_cast<long long>(n), static_cast<long long>(len));
  if constexpr (on_device) {
    KVP_RETURN_IF_ERROR(
        check_workspace(who, ctx.workspace, quantize_paged_append_workspace<Backend>(q, pool.page_size, d, pool.num_kv_heads)));
    const detail::BackendCall<Backend> call(ctx);
    KVP_RETURN_IF_ERROR(call.begin());
    const std::int64_t C = detail::quantized_device_chunk(pool.page_size), H = pool.num_kv_heads, rb = q.row_bytes(d);
    WorkspaceCarver c(ctx.workspace);
    std::uint8_t* stage = c.take<std::uint8_t>(static_cast<std::size_t>(H * C * rb));
    const ops::CodePageGeometry geo{values ? pool.v_strides : pool.k_strides, pool.page_size, pool.num_kv_heads, rb};
    const std::int32_t* seq_pages = pool.table.indices + pool.table.indptr[b];
    typename Q::State st{};
    for (std::int64_t i = 0; i < n; i += C) {
      const std::int64_t m = std::min(C, n - i);
      const QuantizedKV region{q.layout(), TensorView<std::uint8_t, 3>(stage, {H, m, rb}, {m * rb, rb, 1}, pool.device), {}, m};
      KVP_RETURN_IF_ERROR(q.quantize(ctx.with_workspace({}), rows.narrow(1, i, m), st, region));
      ops::code_rows_scatter<Backend>(stage, geo, seq_pages, len - n + i, m, values ? pool.v_data : pool.k_data);
    }
    return call.end();
  } else {
    // Quantize into a staging row first: a bad value (NaN) leaves the pool unchanged.
    std::uint8_t stage[4096 * 2 + 64];
    const std::int64_t rb = q.row_bytes(d);
    KVP_REQUIRE(rb <= static_cast<std::int64_t>(sizeof stage), "%s: rows of %lld bytes exceed the staging row", who,
                static_cast<long long>(rb));
    typename Q::State st{};
    for (std::int64_t h = 0; h < rows.extent(0); ++h)
      for (std::int64_t t = 0; t < n; ++t) {
        const QuantizedKV region{q.layout(), TensorView<std::uint8_t, 3>::contiguous(stage, {1, 1, rb}), {}, 1};
        KVP_RETURN_IF_ERROR(q.quantize(ctx, rows.narrow(0, h, 1).narrow(1, t, 1), st, region));
      }
    for (std::int64_t h = 0; h < rows.extent(0); ++h)
      for (std::int64_t t = 0; t < n; ++t) {
        const std::int64_t tok = len - n + t;
        const std::int32_t page = pool.table.page_of(b, tok, pool.page_size);
        const auto slot = static_cast<std::int32_t>(tok % pool.page_size);
        std::uint8_t* dst =
            values ? pool.v_ptr(page, static_cast<std::int32_t>(h), slot) : pool.k_ptr(page, static_cast<std::int32_t>(h), slot);
        const QuantizedKV region{q.layout(), TensorView<std::uint8_t, 3>::contiguous(dst, {1, 1, rb}), {}, 1};
        (void)q.quantize(ctx, rows.narrow(0, h, 1).narrow(1, t, 1), st, region);
      }
    return Status::ok();
  }
}

/// quantize_paged_append on backend::Scalar.
template <class Q, class T>
Status quantize_paged_append(const Q& q, const PagedKVView<std::uint8_t>& pool, std::int32_t b, TensorView<const T, 3> rows,
                             bool values) noexcept {
  return quantize_paged_append(Context<backend::Scalar>{}, q, pool, b, rows, values);
}

KVP_NAMESPACE_END
