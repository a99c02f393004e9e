// SPDX-License-Identifier: Apache-2.0
// `GgmlQuant`: a K or V cache stored in one of llama.cpp's block formats
// (q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl; quant/ggml.hpp gives the byte
// layouts and the reference rules), as a `QuantizationPolicy`.
//
//   quantize:   rows (kv_heads, T, head_dim) of fp32 / fp16 / bf16 ->
//               q.codes (kv_heads, >= T, head_dim / 32 * block_bytes): token t of
//               head h is the row q.codes(h, t, :), its head_dim / 32 blocks in
//               channel order; llama.cpp's layout of one head's row.
//   dequantize: q.codes tokens [0, q.tokens) -> out (kv_heads, q.tokens, head_dim).
//
// Stateless (`State` is empty): every block carries its own scale, so tokens
// are quantized as they are appended (a decode step quantizes one row per kv
// head; no residual window) and any token can be evicted or moved by
// compacting `codes` rows like any other cache row.
// Memory: bytes_per_token(d) = d / 32 * block_bytes per kv head (q8_0 at
// d = 128: 136 bytes, 8.5 bits per value; q4_0: 72 bytes, 4.5 bits).
//
// Rotation (`rotation`, default none): llama.cpp rotates K and V with a
// block-diagonal Hadamard transform before the store whenever the cache type
// is quantized (attn_rot; quant/hadamard.hpp): rotation=llama_cpp reproduces
// that (keys n = the largest power of two >= 64 dividing head_dim, values 64;
// `role` says which), rotation=block uses `block`. quantize rotates each row
// in fp32 and then quantizes it bit-exactly; dequantize decodes and rotates
// back, so `out` approximates the input rows in their own basis. The default
// stays none so that a row's bytes are gguf-py's for that row.
//
// Validation, before anything is written: head_dim a multiple of 32 (a
// block never straddles two heads), codes shaped and contiguous along the
// row bytes, every input value finite (the error names head, token, channel).
// The finiteness check is a read of the rows of its own before the codes are
// written (heads in parallel over `ctx.exec`); the codes then come from one
// Backend::ggml_quantize_row call per head when rows and codes are contiguous
// along tokens (the CPU kernel then works on 16 blocks at a time), row by row
// otherwise. Code that guarantees finite rows may call that op directly.
// Thread-safety: const; heads are split over `ctx.exec`. The rotation runs
// through Backend::rotate_rows_in / rotate_rows_out (vectorised on
// backend::Cpu, bit-identical with the reference transform).
//
// On a device backend (backend::Cuda: rows, codes and out in device memory,
// channels contiguous, any token stride): one Backend::encode_token_rows /
// decode_token_rows per kv head (quant/token_rows.hpp: `token_codec(d)` is the
// format with its rotation), bit-identical with the host path. The values are
// not scanned for NaN / Inf there (that would need a synchronisation): a
// caller that cannot rule them out checks on the host first; a non-finite
// row gives unspecified codes confined to its own bytes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>

#include "kvpolicy/ops/scalar.hpp"
#include "kvpolicy/policy/concepts.hpp"
#include "kvpolicy/policy/params.hpp"
#include "kvpolicy/policy/policy.hpp"
#include "kvpolicy/policy/quantization/quant_checks.hpp"
#include "kvpolicy/policy/quantization/role.hpp"
#include "kvpolicy/quant/ggml.hpp"
#include "kvpolicy/quant/hadamard.hpp"
#include "kvpolicy/quant/token_rows.hpp"

KVP_NAMESPACE_BEGIN

inline constexpr EnumName<GgmlType> kGgmlTypeNames[] = {{"q8_0", GgmlType::kQ8_0}, {"q4_0", GgmlType::kQ4_0},
                                                        {"q4_1", GgmlType::kQ4_1}, {"q5_0", GgmlType::kQ5_0},
                                                        {"q5_1", GgmlType::kQ5_1}, {"iq4_nl", GgmlType::kIQ4_NL}};
constexpr std::span<const EnumName<GgmlType>> enum_names(GgmlType) noexcept { return kGgmlTypeNames; }

struct GgmlQuantParams {
  GgmlType type = GgmlType::kQ8_0;
  HadamardMode rotation = HadamardMode::kNone;
  std::int32_t block = 64;  ///< rotation=block: the Hadamard block size
  QuantRole role = QuantRole::kKeys;

  static constexpr auto fields() noexcept {
    return std::tuple{param_field<&GgmlQuantParams::type>("type", "ggml block format"),
                      param_field<&GgmlQuantParams::rotation>("rotation", "Hadamard rotation before the store: none, llama_cpp or block"),
                      param_field<&GgmlQuantParams::block>("block", "rotation=block: block size (power of two dividing head_dim)"),
                      param_field<&GgmlQuantParams::role>("role", "keys or values (llama_cpp's block size differs)")};
  }
};

class GgmlQuant {
 public:
  using Params = GgmlQuantParams;
  struct State {};  ///< none: every block is self-contained
  static constexpr const char* kName = "ggml";

  constexpr GgmlQuant() noexcept = default;
  explicit constexpr GgmlQuant(const Params& p) noexcept : params_(p) {}
  constexpr const Params& params() const noexcept { return params_; }

  Status validate_params() const noexcept {
    KVP_RETURN_IF_ERROR(check_enum_fields(kName, params_));
    KVP_REQUIRE(ggml_type_valid(params_.type), "ggml: type %d is not a ggml block format", static_cast<int>(params_.type));
    KVP_REQUIRE(static_cast<int>(params_.rotation) <= 2, "ggml: rotation %d is not none, llama_cpp or block",
                static_cast<int>(params_.rotation));
    KVP_REQUIRE(params_.rotation != HadamardMode::kBlock || (is_power_of_two(params_.block) && params_.block <= kMaxRotatedHeadDim),
                "ggml: rotation block %d must be a power of two <= %lld", params_.block, static_cast<long long>(kMaxRotatedHeadDim));
    return Status::ok();
  }

  QuantLayout layout() const noexcept {
    return QuantLayout{ggml_name(params_.type),    ggml_bits(params_.type), kGgmlBlock, ggml_block_bytes(params_.type), 0,
                       QuantScaleLayout::kInBlock, QuantAxis::kToken};
  }
  /// Bytes one token costs per kv head (scales included).
  double bytes_per_token(std::int64_t head_dim) const noexcept { return layout().bytes_per_token(head_dim); }
  /// Bytes of one (token, kv head) row of codes.
  constexpr std::int64_t row_bytes(std::int64_t head_dim) const noexcept { return head_dim / kGgmlBlock * ggml_block_bytes(params_.type); }

  /// No workspace; the output is `shape.num_kv_heads` x `max_kv_len` rows of row_bytes(head_dim).
  template <class Backend>
  Requirements requirements(const Context<Backend>&, const ProblemShape& shape) const noexcept {
    Requirements r;
    r.status = validate_params();
    if (r.status.is_ok()) r.status = check_head_dim(shape.head_dim);
    if (r.status.is_ok()) r.output = OutputSize{shape.num_kv_heads, shape.num_kv_heads * shape.max_kv_len};
    return r;
  }

  template <class Backend, class Tk>
  Status quantize(const Context<Backend>& ctx, TensorView<const Tk, 3> rows, State&, QuantizedKV q) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_RETURN_IF_ERROR(rows.check_basic(kName, "rows"));
    const std::int64_t H = rows.extent(0), T = rows.extent(1), d = rows.extent(2);
    KVP_RETURN_IF_ERROR(detail::check_quant_memory(kName, "rows", kDeviceBackend<Backend>, rows.device(), rows.stride(2), d));
    KVP_RETURN_IF_ERROR(check_head_dim(d));
    KVP_REQUIRE(rows.stride(2) == 1 || d <= 1, "ggml: rows has channel stride %lld, must be 1", static_cast<long long>(rows.stride(2)));
    KVP_RETURN_IF_ERROR(check_codes(q, H, T, d, "codes"));
    if constexpr (kDeviceBackend<Backend>) {  // one launch per kv head; values are not scanned (see the header)
      KVP_RETURN_IF_ERROR(detail::check_quant_memory(kName, "codes", true, q.codes.device(), 1, 1));
      const detail::BackendCall<Backend> call(ctx);
      KVP_RETURN_IF_ERROR(call.begin());
      for (std::int64_t h = 0; h < H && T > 0; ++h)
        Backend::encode_token_rows(token_codec(d), &rows(h, 0, 0), T, rows.stride(1), d, &q.codes(h, 0, 0), q.codes.stride(1));
      return call.end();
    } else {
      KVP_RETURN_IF_ERROR(detail::check_finite_rows<Backend>(kName, rows, ctx.exec));
      const std::int64_t n = rotation_block(d);
      if (n == 0) {
        // A head whose rows and codes are both contiguous goes to the backend in one call (the row kernel then
        // sees all of its blocks and prefetches ahead), else row by row.
        const bool flat = (rows.stride(1) == d || T == 1) && (q.codes.stride(1) == row_bytes(d) || T == 1);
        ctx.exec.parallel_for(H, [&](std::int64_t h, int) {
          if (flat && T > 0) return Backend::ggml_quantize_row(params_.type, &rows(h, 0, 0), T * d, &q.codes(h, 0, 0));
          for (std::int64_t t = 0; t < T; ++t) Backend::ggml_quantize_row(params_.type, &rows(h, t, 0), d, &q.codes(h, t, 0));
        });
        return Status::ok();
      }
      ctx.exec.parallel_for(H, [&](std::int64_t h, int) {
        alignas(64) float x[kScratch];
        const std::int64_t chunk = kScratch / d;
        for (std::int64_t t0 = 0; t0 < T; t0 += chunk) {
          const std::int64_t m = std::min(chunk, T - t0);
          Backend::rotate_rows_in(&rows(h, t0, 0), m, rows.stride(1), d, n, x);
          if (q.codes.stride(1) == row_bytes(d)) {  // one call: the kernel sees all m rows' blocks
            Backend::ggml_quantize_row(params_.type, static_cast<const float*>(x), m * d, &q.codes(h, t0, 0));
            continue;
          }
          for (std::int64_t r = 0; r < m; ++r)
            Backend::ggml_quantize_row(params_.type, static_cast<const float*>(x + r * d), d, &q.codes(h, t0 + r, 0));
        }
      });
      return Status::ok();
    }
  }

  template <class Backend, class Tk>
  Status dequantize(const Context<Backend>& ctx, const QuantizedKV& q, TensorView<Tk, 3> out) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_RETURN_IF_ERROR(out.check_basic(kName, "out"));
    const std::int64_t H = out.extent(0), T = out.extent(1), d = out.extent(2);
    KVP_RETURN_IF_ERROR(detail::check_quant_memory(kName, "out", kDeviceBackend<Backend>, out.device(), out.stride(2), d, true));
    KVP_RETURN_IF_ERROR(check_head_dim(d));
    KVP_REQUIRE(out.stride(2) == 1 || d <= 1, "ggml: out has channel stride %lld, must be 1", static_cast<long long>(out.stride(2)));
    KVP_REQUIRE(q.tokens == T, "ggml: out has %lld tokens, the quantized region holds %lld", static_cast<long long>(T),
                static_cast<long long>(q.tokens));
    KVP_REQUIRE(q.layout.name != nullptr && std::string_view(q.layout.name) == ggml_name(params_.type) &&
                    q.layout.block_bytes == ggml_block_bytes(params_.type),
                "ggml: the quantized region's layout is '%s', the policy's is '%s'", q.layout.name ? q.layout.name : "(null)",
                ggml_name(params_.type));
    KVP_RETURN_IF_ERROR(check_codes(q, H, T, d, "codes"));
    if constexpr (kDeviceBackend<Backend>) {
      KVP_RETURN_IF_ERROR(detail::check_quant_memory(kName, "codes", true, q.codes.device(), 1, 1));
      const detail::BackendCall<Backend> call(ctx);
      KVP_RETURN_IF_ERROR(call.begin());
      for (std::int64_t h = 0; h < H && T > 0; ++h)
        Backend::decode_token_rows(token_codec(d), &q.codes(h, 0, 0), T, q.codes.stride(1), d, &out(h, 0, 0), out.stride(1));
      return call.end();
    } else {
      const std::int64_t n = rotation_block(d);
      if (n == 0) {
        // As in quantize: one call per head when codes and output rows are both contiguous.
        const bool flat = (out.stride(1) == d || T == 1) && (q.codes.stride(1) == row_bytes(d) || T == 1);
        ctx.exec.parallel_for(H, [&](std::int64_t h, int) {
          if (flat && T > 0) return Backend::ggml_dequantize_row(params_.type, &q.codes(h, 0, 0), T * d, &out(h, 0, 0));
          for (std::int64_t t = 0; t < T; ++t) Backend::ggml_dequantize_row(params_.type, &q.codes(h, t, 0), d, &out(h, t, 0));
        });
        return Status::ok();
      }
      // Contiguous code rows decode a chunk in one call (the scratch holds its rows back to back).
      const bool flat_codes = q.codes.stride(1) == row_bytes(d);
      ctx.exec.parallel_for(H, [&](std::int64_t h, int) {
        alignas(64) float y[kScratch];
        const std::int64_t chunk = kScratch / d;
        for (std::int64_t t0 = 0; t0 < T; t0 += chunk) {
          const std::int64_t m = std::min(chunk, T - t0);
          if (flat_codes)
            Backend::ggml_dequantize_row(params_.type, &q.codes(h, t0, 0), m * d, y);
          else
            for (std::int64_t r = 0; r < m; ++r) Backend::ggml_dequantize_row(params_.type, &q.codes(h, t0 + r, 0), d, y + r * d);
          Backend::rotate_rows_out(y, m, d, n, &out(h, t0, 0), out.stride(1));
        }
      });
      return Status::ok();
    }
  }

  /// The Hadamard block rows of `head_dim` are rotated with (0: none; head_dim must be valid).
  std::int64_t rotation_block(std::int64_t d) const noexcept {
    std::int64_t n = 0;
    (void)hadamard_block(params_.rotation, params_.block, params_.role == QuantRole::kKeys, d, kName, &n);
    return n;
  }
  /// The row codec of `head_dim` rows (format and rotation), as the backends' encode_token_rows /
  /// decode_token_rows take it: what an engine calls to write one decode step's rows itself.
  TokenRowCodec token_codec(std::int64_t d) const noexcept { return TokenRowCodec::ggml_blocks(params_.type, rotation_block(d)); }
  /// x <- R x: the query (keys) or attention output (values) transform of a fused kernel on the rotated codes.
  void rotate(float* x, std::int64_t d) const noexcept { hadamard_rotate(x, d, rotation_block(d)); }

 private:
  static constexpr std::int64_t kScratch = 8192;  ///< fp32 values one worker rotates at a time (>= kMaxRotatedHeadDim)

  Status check_head_dim(std::int64_t d) const noexcept {
    KVP_REQUIRE(d >= kGgmlBlock && d % kGgmlBlock == 0, "ggml: head_dim %lld is not a multiple of the %s block (32 values)",
                static_cast<long long>(d), ggml_name(params_.type));
    if (params_.rotation != HadamardMode::kNone) {
      KVP_REQUIRE(d <= kMaxRotatedHeadDim, "ggml: head_dim %lld exceeds %lld with rotation", static_cast<long long>(d),
                  static_cast<long long>(kMaxRotatedHeadDim));
      std::int64_t n = 0;
      KVP_RETURN_IF_ERROR(hadamard_block(params_.rotation, params_.block, params_.role == QuantRole::kKeys, d, kName, &n));
    }
    return Status::ok();
  }
  template <class Codes>
  Status check_codes(const Codes& q, std::int64_t H, std::int64_t T, std::int64_t d, const char* name) const noexcept {
    const auto& c = q.codes;
    KVP_RETURN_IF_ERROR(c.check_basic(kName, name));
    KVP_REQUIRE(c.extent(0) == H && c.extent(1) >= T && c.extent(2) == row_bytes(d),
                "ggml: %s is (%lld, %lld, %lld), expected (%lld kv heads, >= %lld tokens, %lld bytes per %s row)", name,
                static_cast<long long>(c.extent(0)), static_cast<long long>(c.extent(1)), static_cast<long long>(c.extent(2)),
                static_cast<long long>(H), static_cast<long long>(T), static_cast<long long>(row_bytes(d)), ggml_name(params_.type));
    KVP_REQUIRE(c.stride(2) == 1, "ggml: %s has byte stride %lld, must be 1", name, static_cast<long long>(c.stride(2)));
    return Status::ok();
  }

  Params params_{};
};

static_assert(QuantizationPolicy<GgmlQuant, float> && QuantizationPolicy<GgmlQuant, half> && QuantizationPolicy<GgmlQuant, bfloat16>);

KVP_NAMESPACE_END
