// SPDX-License-Identifier: Apache-2.0
// `Int4Quant`: token-wise asymmetric INT4 (or INT8) per (token, kv head) —
// SAW-INT4's format (quant/int4.hpp) — behind an optional block-diagonal
// Hadamard rotation (quant/hadamard.hpp), as a `QuantizationPolicy`.
//
//   quantize:   rows (kv_heads, T, head_dim) -> rotated (R x), then each row
//               into q.codes(h, t, :) (row_bytes(d) = d * bits / 8 + 8).
//   dequantize: codes -> decoded rows, rotated back (R^-1 = R): `out` holds
//               the approximation of the input rows in their own basis.
//   A fused decode kernel reading the rotated codes directly rotates the
//   query instead (`rotate`, same R) and, for rotated values, the attention
//   output; `rotation_block(d)` says which R.
//
// Rotation (`rotation`): llama_cpp (default: keys n = the largest power of
// two >= 64 dividing head_dim, values n = 64 — llama.cpp's attn_rot, on by
// default there for every quantized cache type), block (SAW-INT4's BDR with
// `block`, a power of two dividing head_dim; its README: 128, keys only),
// or none. Plain INT4 without rotation is what SGLang #15285 and SAW-INT4
// report collapsing (GPQA 0.62 -> 0.47, and 66.7 -> 0.0); the switch is per
// policy object, so an engine turns it off per layer or per architecture by
// giving those layers a policy with rotation=none (examples/engine: one
// policy per layer).
//
// The rows pass through the backend's row codecs (rotate_rows_in / out,
// int4_quantize_rows / int4_dequantize_rows: vectorised on backend::Cpu,
// bit-identical with backend::Scalar), a chunk of rows at a time.
//
// Stateless; every row is self-contained (page-local), so rows move with
// their tokens under compaction. Validation before any write: bits 4 or 8,
// head_dim even (4 bits) and valid for the rotation, finite input (the error
// names head, token, channel), codes shaped (kv_heads, >= T, row_bytes).
//
// On a device backend (backend::Cuda: rows, codes and out in device memory,
// channels contiguous, any token stride): one Backend::encode_token_rows /
// decode_token_rows per kv head (quant/token_rows.hpp: `token_codec(d)` is
// the bits with the rotation), bit-identical with the host path. The values
// are not scanned for NaN / Inf there (that would need a synchronisation): a
// non-finite row gives unspecified codes confined to its own bytes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string_view>

#include "kvpolicy/policy/concepts.hpp"
#include "kvpolicy/policy/params.hpp"
#include "kvpolicy/policy/policy.hpp"
#include "kvpolicy/policy/quantization/quant_checks.hpp"
#include "kvpolicy/policy/quantization/role.hpp"
#include "kvpolicy/quant/hadamard.hpp"
#include "kvpolicy/quant/int4.hpp"
#include "kvpolicy/quant/token_rows.hpp"

KVP_NAMESPACE_BEGIN

struct Int4QuantParams {
  std::int32_t bits = 4;
  HadamardMode rotation = HadamardMode::kLlamaCpp;
  std::int32_t block = 128;  ///< rotation=block: the Hadamard block size
  QuantRole role = QuantRole::kKeys;

  static constexpr auto fields() noexcept {
    return std::tuple{param_field<&Int4QuantParams::bits>("bits", "code bits: 4 (nibbles d, d + D/2) or 8"),
                      param_field<&Int4QuantParams::rotation>("rotation", "Hadamard rotation: llama_cpp, block or none"),
                      param_field<&Int4QuantParams::block>("block", "rotation=block: block size (power of two dividing head_dim)"),
                      param_field<&Int4QuantParams::role>("role", "keys or values (llama_cpp's block size differs)")};
  }
};

class Int4Quant {
 public:
  using Params = Int4QuantParams;
  struct State {};  ///< none: every row carries its scale and zero
  static constexpr const char* kName = "int4";

  constexpr Int4Quant() noexcept = default;
  explicit constexpr Int4Quant(const Params& p) noexcept : params_(p) {}
  constexpr const Params& params() const noexcept { return params_; }

  Status validate_params() const noexcept {
    KVP_RETURN_IF_ERROR(check_enum_fields(kName, params_));
    KVP_REQUIRE(params_.bits == 4 || params_.bits == 8, "int4: bits is %d, must be 4 or 8", params_.bits);
    KVP_REQUIRE(static_cast<int>(params_.rotation) <= 2, "int4: rotation %d is not none, llama_cpp or block",
                static_cast<int>(params_.rotation));
    KVP_REQUIRE(params_.rotation != HadamardMode::kBlock || (is_power_of_two(params_.block) && params_.block <= kMaxRotatedHeadDim),
                "int4: rotation block %d must be a power of two <= %lld", params_.block, static_cast<long long>(kMaxRotatedHeadDim));
    KVP_REQUIRE(params_.role == QuantRole::kKeys || params_.role == QuantRole::kValues, "int4: role %d is not keys or values",
                static_cast<int>(params_.role));
    return Status::ok();
  }
  Status check_head_dim(std::int64_t d) const noexcept {
    KVP_REQUIRE(d >= 2 && d % 2 == 0 && d <= kMaxRotatedHeadDim, "int4: head_dim %lld must be even and in [2, %lld]",
                static_cast<long long>(d), static_cast<long long>(kMaxRotatedHeadDim));
    std::int64_t n = 0;
    return hadamard_block(params_.rotation, params_.block, params_.role == QuantRole::kKeys, d, kName, &n);
  }
  /// The Hadamard block this policy rotates `head_dim` rows with (0: none; head_dim must be valid).
  std::int64_t rotation_block(std::int64_t d) const noexcept {
    std::int64_t n = 0;
    (void)hadamard_block(params_.rotation, params_.block, params_.role == QuantRole::kKeys, d, kName, &n);
    return n;
  }
  /// The row codec of `head_dim` rows (bits and rotation), as the backends' encode_token_rows /
  /// decode_token_rows take it: what an engine calls to write one decode step's rows itself.
  TokenRowCodec token_codec(std::int64_t d) const noexcept { return TokenRowCodec::int_tokens(params_.bits, rotation_block(d)); }
  /// x <- R x: what a fused kernel applies to the query (keys) or the attention output (values).
  void rotate(float* x, std::int64_t d) const noexcept { hadamard_rotate(x, d, rotation_block(d)); }

  const char* layout_name() const noexcept { return params_.bits == 4 ? "int4_token" : "int8_token"; }
  QuantLayout layout() const noexcept {
    return QuantLayout{layout_name(), params_.bits, 1, 1, 0, QuantScaleLayout::kInBlock, QuantAxis::kToken};
  }
  constexpr std::int64_t row_bytes(std::int64_t d) const noexcept { return int4q::row_bytes(d, params_.bits); }
  double bytes_per_token(std::int64_t d) const noexcept { return static_cast<double>(row_bytes(d)); }

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
    KVP_RETURN_IF_ERROR(check_codes(q, H, T, d));
    if constexpr (kDeviceBackend<Backend>) {  // one launch per kv head; values are not scanned (see the header)
      KVP_RETURN_IF_ERROR(detail::check_quant_memory(kName, "codes", true, q.codes.device(), 1, 1));
      const detail::BackendCall<Backend> call(ctx);
      KVP_RETURN_IF_ERROR(call.begin());
      for (std::int64_t h = 0; h < H && T > 0; ++h)
        Backend::encode_token_rows(token_codec(d), &rows(h, 0, 0), T, rows.stride(1), d, &q.codes(h, 0, 0), q.codes.stride(1));
      return call.end();
    } else {
      KVP_RETURN_IF_ERROR(detail::check_finite_rows<Backend>(kName, rows, ctx.exec));
      const std::int64_t n = rotation_block(d), chunk = std::max<std::int64_t>(1, kScratch / d);
      const bool unit = rows.stride(2) == 1 || d == 1;
      ctx.exec.parallel_for(H, [&](std::int64_t h, int) {
        alignas(64) float x[kScratch];
        for (std::int64_t t0 = 0; t0 < T; t0 += chunk) {
          const std::int64_t m = std::min(chunk, T - t0);
          if (unit) {
            Backend::rotate_rows_in(&rows(h, t0, 0), m, rows.stride(1), d, n, x);
          } else {
            for (std::int64_t r = 0; r < m; ++r)
              for (std::int64_t c = 0; c < d; ++c) x[r * d + c] = to_float(rows(h, t0 + r, c));
            Backend::rotate_rows_in(static_cast<const float*>(x), m, d, d, n, x);
          }
          Backend::int4_quantize_rows(x, m, d, params_.bits, &q.codes(h, t0, 0), q.codes.stride(1));
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
    KVP_REQUIRE(q.tokens == T, "int4: out has %lld tokens, the quantized region holds %lld", static_cast<long long>(T),
                static_cast<long long>(q.tokens));
    KVP_REQUIRE(q.layout.name != nullptr && std::string_view(q.layout.name) == layout_name(),
                "int4: the quantized region's layout is '%s', the policy's is '%s'", q.layout.name ? q.layout.name : "(null)",
                layout_name());
    KVP_RETURN_IF_ERROR(check_codes(q, H, T, d));
    if constexpr (kDeviceBackend<Backend>) {
      KVP_RETURN_IF_ERROR(detail::check_quant_memory(kName, "codes", true, q.codes.device(), 1, 1));
      const detail::BackendCall<Backend> call(ctx);
      KVP_RETURN_IF_ERROR(call.begin());
      for (std::int64_t h = 0; h < H && T > 0; ++h)
        Backend::decode_token_rows(token_codec(d), &q.codes(h, 0, 0), T, q.codes.stride(1), d, &out(h, 0, 0), out.stride(1));
      return call.end();
    } else {
      const std::int64_t n = rotation_block(d), chunk = std::max<std::int64_t>(1, kScratch / d);
      const bool unit = out.stride(2) == 1 || d == 1;
      ctx.exec.parallel_for(H, [&](std::int64_t h, int) {
        if (unit && n <= 1) {  // no rotation: the head decoded straight into out, in one call
          if (T > 0) Backend::int4_dequantize_rows(&q.codes(h, 0, 0), T, q.codes.stride(1), d, params_.bits, &out(h, 0, 0), out.stride(1));
          return;
        }
        alignas(64) float y[kScratch];
        for (std::int64_t t0 = 0; t0 < T; t0 += chunk) {
          const std::int64_t m = std::min(chunk, T - t0);
          Backend::int4_dequantize_rows(&q.codes(h, t0, 0), m, q.codes.stride(1), d, params_.bits, y, d);
          if (unit) {
            Backend::rotate_rows_out(y, m, d, n, &out(h, t0, 0), out.stride(1));
          } else {
            Backend::rotate_rows_out(y, m, d, n, y, d);
            for (std::int64_t r = 0; r < m; ++r)
              for (std::int64_t c = 0; c < d; ++c) out(h, t0 + r, c) = from_float<Tk>(y[r * d + c]);
          }
        }
      });
      return Status::ok();
    }
  }

 private:
  static constexpr std::int64_t kScratch = 8192;  ///< fp32 values of the rows one worker converts at a time (>= kMaxRotatedHeadDim)

  Status check_codes(const QuantizedKV& q, std::int64_t H, std::int64_t T, std::int64_t d) const noexcept {
    const auto& c = q.codes;
    KVP_RETURN_IF_ERROR(c.check_basic(kName, "codes"));
    KVP_REQUIRE(c.extent(0) == H && c.extent(1) >= T && c.extent(2) == row_bytes(d) && c.stride(2) == 1,
                "int4: codes is (%lld, %lld, %lld), expected (%lld kv heads, >= %lld tokens, %lld bytes per row) with byte stride 1",
                static_cast<long long>(c.extent(0)), static_cast<long long>(c.extent(1)), static_cast<long long>(c.extent(2)),
                static_cast<long long>(H), static_cast<long long>(T), static_cast<long long>(row_bytes(d)));
    return Status::ok();
  }

  Params params_{};
};

static_assert(QuantizationPolicy<Int4Quant, float> && QuantizationPolicy<Int4Quant, half> && QuantizationPolicy<Int4Quant, bfloat16>);

KVP_NAMESPACE_END
