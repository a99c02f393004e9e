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
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "kvpolicy/core/page_selection.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/ops/scalar.hpp"
#include "kvpolicy/policy/concepts.hpp"
#include "kvpolicy/policy/policy.hpp"

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

template <class Q>
Status check_code_pool(const char* who, const Q& q, const PagedKVView<const std::uint8_t>& pool, std::int64_t head_dim,
                       bool need_values) noexcept {
  KVP_RETURN_IF_ERROR(q.validate_params());
  KVP_RETURN_IF_ERROR(pool.validate(who, need_values));
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
}  // namespace detail

/// Workspace of quantized_page_meta_append / quantized_paged_decode_attention: one page of decoded rows
/// (keys; plus values and the page's logits for attention) per worker.
inline std::size_t quantized_paged_workspace(std::int32_t page_size, std::int64_t head_dim, std::int64_t group, int workers = 1) noexcept {
  const std::size_t per = align_up(static_cast<std::size_t>(page_size) * static_cast<std::size_t>(head_dim) * sizeof(float)) * 2 +
                          align_up(static_cast<std::size_t>(group * page_size) * sizeof(float));
  return detail::WorkerSlices::bytes(per, workers < 1 ? 1 : workers);
}

/// Workspace of the `Context<Backend>` overload of quantized_paged_decode_attention (ctx.workspace): on
/// backend::Scalar quantized_paged_workspace(page_size, head_dim, group); otherwise one page of decoded keys
/// and values for a chunk of whole pages (>= 64 rows), the chunk's partial output and lse, and the backend
/// op's own workspace.
template <class Backend>
std::size_t quantized_paged_attention_workspace(std::int32_t page_size, std::int64_t head_dim, std::int64_t group) noexcept {
  if constexpr (std::is_same_v<Backend, backend::Scalar>) {
    return quantized_paged_workspace(page_size, head_dim, group);
  } else {
    const auto R = static_cast<std::size_t>(detail::quantized_attention_chunk(page_size));
    const auto d = static_cast<std::size_t>(head_dim < 1 ? 1 : head_dim), g = static_cast<std::size_t>(group < 1 ? 1 : group);
    const Rows<float> run{nullptr, head_dim, nullptr, 0, 0};
    return WorkspacePlan{}
        .add<float>(R * d)
        .add<float>(R * d)
        .add<float>(g * d)
        .add<float>(g)
        .add_bytes(Backend::paged_attention_workspace(group, Backend::attention_block(run), head_dim))
        .total();
  }
}

/// Quest metadata of the tokens just appended to a quantized K pool (append_len[b] per sequence; nullptr:
/// every page the table references), as Quest::on_append computes it on fp32 keys.
template <class Backend, class Q>
Status quantized_page_meta_append(const Context<Backend>& ctx, const Q& q, const PagedKVView<const std::uint8_t>& keys,
                                  std::int64_t head_dim, const std::int32_t* append_len, PageMetaView<float> meta) noexcept {
  constexpr const char* who = "quantized_page_meta";
  KVP_RETURN_IF_ERROR(detail::check_code_pool(who, q, keys, head_dim, /*need_values=*/false));
  KVP_RETURN_IF_ERROR(meta.validate(who, keys.num_pages, keys.num_kv_heads, static_cast<std::int32_t>(head_dim)));
  if (append_len != nullptr)
    for (std::int32_t b = 0; b < keys.table.batch; ++b)
      KVP_REQUIRE(append_len[b] >= 0 && append_len[b] <= keys.seq_len(b), "%s: append_len[%d] is %d, must be in [0, sequence length %lld]",
                  who, b, append_len[b], static_cast<long long>(keys.seq_len(b)));
  const std::size_t per = align_up(static_cast<std::size_t>(keys.page_size) * static_cast<std::size_t>(head_dim) * sizeof(float)) * 2 +
                          align_up(static_cast<std::size_t>(keys.page_size) * sizeof(float));
  KVP_RETURN_IF_ERROR(check_workspace(who, ctx.workspace, detail::WorkerSlices::bytes(per, ctx.exec.workers())));
  const auto slices = detail::WorkerSlices::carve(ctx.workspace, per);
  const std::int32_t P = keys.page_size;
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

/// Softmax attention of `group` fp32 decode queries (group, head_dim) over the first num_tokens tokens of
/// the page list `pages` (sequence order) of kv head h in a quantized pool (keys by qk, values by qv):
/// out (group, head_dim), lse (group) or null. Workspace: quantized_paged_workspace(page_size, head_dim, group).
template <class Qk, class Qv>
Status quantized_paged_decode_attention(const Qk& qk, const Qv& qv, const PagedKVView<const std::uint8_t>& pool, std::int32_t h,
                                        const std::int32_t* pages, std::int64_t num_tokens, const float* q, std::int64_t group,
                                        std::int64_t head_dim, float scale, float* out, float* lse, Workspace ws) noexcept {
  constexpr const char* who = "quantized_paged_attention";
  KVP_RETURN_IF_ERROR(detail::check_code_pool(who, qk, pool, head_dim, /*need_values=*/true));
  KVP_REQUIRE(qv.validate_params().is_ok() && qv.row_bytes(head_dim) == qk.row_bytes(head_dim),
              "%s: the value format's rows (%lld bytes) differ from the keys' (%lld): one pool holds both", who,
              static_cast<long long>(qv.row_bytes(head_dim)), static_cast<long long>(qk.row_bytes(head_dim)));
  KVP_REQUIRE(h >= 0 && h < pool.num_kv_heads, "%s: kv head %d out of range [0, %d)", who, h, pool.num_kv_heads);
  KVP_REQUIRE(num_tokens >= 0 && (num_tokens == 0 || pages != nullptr), "%s: %lld tokens with a null page list", who,
              static_cast<long long>(num_tokens));
  KVP_REQUIRE(q != nullptr && out != nullptr && group >= 1, "%s: queries / out are null or group < 1", who);
  const std::int64_t P = pool.page_size;
  for (std::int64_t i = 0; i * P < num_tokens; ++i)
    KVP_REQUIRE(pages[i] >= 0 && pages[i] < pool.num_pages, "%s: page %lld of the list is %d, out of range [0, %d)", who,
                static_cast<long long>(i), pages[i], pool.num_pages);
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
/// quantized_paged_attention_workspace<Backend>(page_size, head_dim, group). Same validation, nothing written
/// on error.
template <class Backend, class Qk, class Qv>
Status quantized_paged_decode_attention(const Context<Backend>& ctx, const Qk& qk, const Qv& qv,
                                        const PagedKVView<const std::uint8_t>& pool, std::int32_t h, const std::int32_t* pages,
                                        std::int64_t num_tokens, const float* q, std::int64_t group, std::int64_t head_dim, float scale,
                                        float* out, float* lse) noexcept {
  if constexpr (std::is_same_v<Backend, backend::Scalar>) {
    return quantized_paged_decode_attention(qk, qv, pool, h, pages, num_tokens, q, group, head_dim, scale, out, lse, ctx.workspace);
  } else {
    constexpr const char* who = "quantized_paged_attention";
    KVP_RETURN_IF_ERROR(detail::check_code_pool(who, qk, pool, head_dim, /*need_values=*/true));
    KVP_REQUIRE(qv.validate_params().is_ok() && qv.row_bytes(head_dim) == qk.row_bytes(head_dim),
                "%s: the value format's rows (%lld bytes) differ from the keys' (%lld): one pool holds both", who,
                static_cast<long long>(qv.row_bytes(head_dim)), static_cast<long long>(qk.row_bytes(head_dim)));
    KVP_REQUIRE(h >= 0 && h < pool.num_kv_heads, "%s: kv head %d out of range [0, %d)", who, h, pool.num_kv_heads);
    KVP_REQUIRE(num_tokens >= 0 && (num_tokens == 0 || pages != nullptr), "%s: %lld tokens with a null page list", who,
                static_cast<long long>(num_tokens));
    KVP_REQUIRE(q != nullptr && out != nullptr && group >= 1, "%s: queries / out are null or group < 1", who);
    const std::int64_t P = pool.page_size;
    for (std::int64_t i = 0; i * P < num_tokens; ++i)
      KVP_REQUIRE(pages[i] >= 0 && pages[i] < pool.num_pages, "%s: page %lld of the list is %d, out of range [0, %d)", who,
                  static_cast<long long>(i), pages[i], pool.num_pages);
    KVP_RETURN_IF_ERROR(check_workspace(who, ctx.workspace, quantized_paged_attention_workspace<Backend>(pool.page_size, head_dim, group)));
    WorkspaceCarver c(ctx.workspace);
    const std::int64_t R = detail::quantized_attention_chunk(pool.page_size);
    float* kb = c.take<float>(static_cast<std::size_t>(R * head_dim));
    float* vb = c.take<float>(static_cast<std::size_t>(R * head_dim));
    float* po = c.take<float>(static_cast<std::size_t>(group * head_dim));
    float* pl = c.take<float>(static_cast<std::size_t>(group));
    const Rows<float> run{nullptr, head_dim, nullptr, 0, 0};
    const std::size_t op_ws = Backend::paged_attention_workspace(group, Backend::attention_block(run), head_dim);
    const Workspace ows{c.take<std::byte>(op_ws), op_ws};
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
    // Running state per head: the largest chunk lse m, the sum of exp(lse_chunk - m) and out = the same
    // weights times the chunks' normalised outputs (divided by the sum once at the end).
    for (std::int64_t i = 0; i < group * head_dim; ++i) out[i] = 0.0f;
    constexpr std::int64_t kHeads = 16;
    for (std::int64_t g0 = 0; g0 < group; g0 += kHeads) {
      const std::int64_t gn = std::min(kHeads, group - g0);
      float m[kHeads], sum[kHeads];
      for (std::int64_t g = 0; g < gn; ++g) m[g] = kNegInf, sum[g] = 0.0f;
      for (std::int64_t j0 = 0; j0 < num_tokens; j0 += R) {
        const std::int64_t bn = std::min(R, num_tokens - j0);
        for (std::int64_t r = 0; r < bn; r += P) {  // the chunk's pages, decoded one after the other
          const std::int32_t page = pages[(j0 + r) / P];
          const std::int64_t n = std::min(P, bn - r);
          detail::decode_code_rows<Backend>(qk, pool.k_ptr(page, h, 0), pool.k_strides.slot, n, head_dim, kb + r * head_dim);
          detail::decode_code_rows<Backend>(qv, pool.v_ptr(page, h, 0), pool.v_strides.slot, n, head_dim, vb + r * head_dim);
        }
        Backend::paged_decode_attention(q + g0 * head_dim, gn, head_dim, Rows<float>{kb, head_dim, nullptr, 0, 0},
                                        Rows<float>{vb, head_dim, nullptr, 0, 0}, bn, scale, po, pl, ows);
        for (std::int64_t g = 0; g < gn; ++g) {
          float* o = out + (g0 + g) * head_dim;
          const float* op = po + g * head_dim;
          if (sum[g] != sum[g]) continue;  // NaN already: stays NaN
          if (pl[g] != pl[g]) {            // a NaN logit: output and lse NaN, as the reference
            sum[g] = kNaN;
            for (std::int64_t d = 0; d < head_dim; ++d) o[d] = kNaN;
            continue;
          }
          if (pl[g] == kNegInf) continue;  // nothing attended in this chunk
          const float nm = pl[g] > m[g] ? pl[g] : m[g];
          const float a = std::exp(m[g] - nm), w = std::exp(pl[g] - nm);  // a = 0 on the first chunk
          sum[g] = sum[g] * a + w;
          for (std::int64_t d = 0; d < head_dim; ++d) o[d] = o[d] * a + w * op[d];
          m[g] = nm;
        }
      }
      for (std::int64_t g = 0; g < gn; ++g) {
        float* o = out + (g0 + g) * head_dim;
        const bool none = sum[g] == 0.0f;
        const float inv = none ? 0.0f : 1.0f / sum[g];
        for (std::int64_t d = 0; d < head_dim; ++d) o[d] *= inv;
        if (lse != nullptr) lse[g0 + g] = none ? kNegInf : m[g] + std::log(sum[g]);
      }
    }
    return Status::ok();
  }
}

/// Quantize-on-append: rows (kv_heads, n, head_dim) of tokens [len_b - n, len_b) of sequence b written in
/// format `q` at their slots of the code pool's keys (values = false) or values (values = true).
/// With a `Context<Backend>` first, the rows are quantized by the backend's codecs (the same bytes as
/// backend::Scalar's for every format here; tests/quant pins that).
template <class Backend, class Q, class T>
Status quantize_paged_append(const Context<Backend>& ctx, const Q& q, const PagedKVView<std::uint8_t>& pool, std::int32_t b,
                             TensorView<const T, 3> rows, bool values) noexcept {
  constexpr const char* who = "quantize_paged_append";
  const PagedKVView<const std::uint8_t> cpool = pool;
  const std::int64_t d = rows.extent(2), n = rows.extent(1);
  KVP_RETURN_IF_ERROR(detail::check_code_pool(who, q, cpool, d, values));
  KVP_RETURN_IF_ERROR(rows.check_basic(who, "rows"));
  KVP_REQUIRE(rows.extent(0) == pool.num_kv_heads, "%s: rows has %lld kv heads, the pool %d", who, static_cast<long long>(rows.extent(0)),
              pool.num_kv_heads);
  KVP_REQUIRE(b >= 0 && b < pool.table.batch, "%s: sequence %d out of range [0, %d)", who, b, pool.table.batch);
  const std::int64_t len = pool.seq_len(b);
  KVP_REQUIRE(n <= len, "%s: %lld rows for a sequence of %lld tokens", who, static_cast<long long>(n), static_cast<long long>(len));
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

/// quantize_paged_append on backend::Scalar.
template <class Q, class T>
Status quantize_paged_append(const Q& q, const PagedKVView<std::uint8_t>& pool, std::int32_t b, TensorView<const T, 3> rows,
                             bool values) noexcept {
  return quantize_paged_append(Context<backend::Scalar>{}, q, pool, b, rows, values);
}

KVP_NAMESPACE_END
