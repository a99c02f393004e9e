// SPDX-License-Identifier: Apache-2.0
// `Fp8Quant`: a K or V cache in fp8 (e4m3 or e5m2, quant/fp8.hpp) with the
// engines' scale layouts, as a `QuantizationPolicy`. Stored code =
// fp8(x / scale) (round to nearest even, saturating), value = decode(code) * scale.
//
//   kPerTensor     one scale for the whole cache, `Params::scale` (vLLM's
//                  k_scale / v_scale = [1]; its default is 1.0). Row = head_dim bytes.
//   kPerHead       one scale per kv head, `State::head_scales` (vLLM's
//                  "attn_head" strategy, calibrated offline). Row = head_dim bytes.
//   kPerTokenHead  dynamic: every (token, kv head) row gets scale =
//                  amax(|x|) / fp8_max at write time (1 for an all-zero row),
//                  stored inline after the codes (vLLM's *_per_token_head
//                  cache modes): row = head_dim code bytes + a 16-byte trailer
//                  holding the fp32 scale (little endian) then 12 zero bytes,
//                  so rows stay 16-byte aligned when head_dim is.
//
// The division x / scale is an fp32 division, as vLLM's writer computes it.
// `bytes_per_token(d)` = d (+ 16 for kPerTokenHead) per kv head.
// Validation before any write: finite input (the error names head, token and
// channel; saturation handles finite values beyond fp8_max * scale), finite
// positive scales, codes shaped (kv_heads, >= tokens, row_bytes).
// Rows with contiguous channels go through Backend::fp8_quantize_rows /
// fp8_dequantize_rows (vectorised on backend::Cpu, bit-identical with the
// reference codec of quant/fp8.hpp).
// On a device backend (backend::Cuda: rows, codes and out in device memory,
// one launch per kv head, per_head scales read on the host) the channels must
// be contiguous and the values are not scanned: NaN encodes as the NaN code,
// +-inf and finite values beyond the range saturate to +-max, and a
// per_token_head row holding an infinity gets scale inf (its codes x / inf:
// zeros and NaN codes). Finite rows give the host's codes bit for bit.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>

#include "kvpolicy/policy/concepts.hpp"
#include "kvpolicy/policy/params.hpp"
#include "kvpolicy/policy/policy.hpp"
#include "kvpolicy/policy/quantization/quant_checks.hpp"
#include "kvpolicy/quant/fp8.hpp"

KVP_NAMESPACE_BEGIN

enum class Fp8Scale : std::uint8_t { kPerTensor, kPerHead, kPerTokenHead };

inline constexpr EnumName<Fp8Format> kFp8FormatNames[] = {{"e4m3", Fp8Format::kE4M3}, {"e5m2", Fp8Format::kE5M2}};
constexpr std::span<const EnumName<Fp8Format>> enum_names(Fp8Format) noexcept { return kFp8FormatNames; }
inline constexpr EnumName<Fp8Scale> kFp8ScaleNames[] = {
    {"per_tensor", Fp8Scale::kPerTensor}, {"per_head", Fp8Scale::kPerHead}, {"per_token_head", Fp8Scale::kPerTokenHead}};
constexpr std::span<const EnumName<Fp8Scale>> enum_names(Fp8Scale) noexcept { return kFp8ScaleNames; }

struct Fp8QuantParams {
  Fp8Format format = Fp8Format::kE4M3;
  Fp8Scale scales = Fp8Scale::kPerTokenHead;
  float scale = 1.0f;  ///< kPerTensor: the tensor's scale

  static constexpr auto fields() noexcept {
    return std::tuple{param_field<&Fp8QuantParams::format>("format", "fp8 element format"),
                      param_field<&Fp8QuantParams::scales>("scales", "scale layout"),
                      param_field<&Fp8QuantParams::scale>("scale", "per_tensor: the scale")};
  }
};

/// Caller-owned scales of the kPerHead layout (unused by the others).
struct Fp8QuantState {
  std::span<const float> head_scales{};  ///< kPerHead: one scale per kv head
};

class Fp8Quant {
 public:
  using Params = Fp8QuantParams;
  using State = Fp8QuantState;
  static constexpr const char* kName = "fp8";
  static constexpr std::int64_t kTrailer = 16;  ///< kPerTokenHead: inline scale bytes per row

  constexpr Fp8Quant() noexcept = default;
  explicit constexpr Fp8Quant(const Params& p) noexcept : params_(p) {}
  constexpr const Params& params() const noexcept { return params_; }

  Status validate_params() const noexcept {
    KVP_RETURN_IF_ERROR(check_enum_fields(kName, params_));
    KVP_REQUIRE(params_.format == Fp8Format::kE4M3 || params_.format == Fp8Format::kE5M2, "fp8: format %d is not e4m3 or e5m2",
                static_cast<int>(params_.format));
    KVP_REQUIRE(static_cast<int>(params_.scales) <= 2, "fp8: scale layout %d is not per_tensor, per_head or per_token_head",
                static_cast<int>(params_.scales));
    KVP_REQUIRE(std::isfinite(params_.scale) && params_.scale > 0.0f, "fp8: scale is %g, must be finite and > 0",
                static_cast<double>(params_.scale));
    return Status::ok();
  }

  /// One byte per value; the kPerTokenHead trailer is counted by bytes_per_token / row_bytes.
  QuantLayout layout() const noexcept {
    return QuantLayout{fp8_name(params_.format),
                       8,
                       1,
                       1,
                       0,
                       params_.scales == Fp8Scale::kPerTokenHead ? QuantScaleLayout::kInBlock : QuantScaleLayout::kSeparate,
                       QuantAxis::kToken};
  }
  constexpr std::int64_t row_bytes(std::int64_t head_dim) const noexcept {
    return head_dim + (params_.scales == Fp8Scale::kPerTokenHead ? kTrailer : 0);
  }
  double bytes_per_token(std::int64_t head_dim) const noexcept { return static_cast<double>(row_bytes(head_dim)); }

  template <class Backend>
  Requirements requirements(const Context<Backend>&, const ProblemShape& shape) const noexcept {
    Requirements r;
    r.status = validate_params();
    if (r.status.is_ok()) r.output = OutputSize{shape.num_kv_heads, shape.num_kv_heads * shape.max_kv_len};
    return r;
  }

  template <class Backend, class Tk>
  Status quantize(const Context<Backend>& ctx, TensorView<const Tk, 3> rows, State& st, QuantizedKV q) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_RETURN_IF_ERROR(rows.check_basic(kName, "rows"));
    const std::int64_t H = rows.extent(0), T = rows.extent(1), d = rows.extent(2);
    KVP_RETURN_IF_ERROR(detail::check_quant_memory(kName, "rows", kDeviceBackend<Backend>, rows.device(), rows.stride(2), d));
    KVP_RETURN_IF_ERROR(check_scales(st, H));
    KVP_RETURN_IF_ERROR(check_codes(q, H, T, d));
    if constexpr (kDeviceBackend<Backend>) {
      KVP_RETURN_IF_ERROR(detail::check_quant_memory(kName, "codes", true, q.codes.device(), 1, 1));
      const detail::BackendCall<Backend> call(ctx);
      KVP_RETURN_IF_ERROR(call.begin());
      for (std::int64_t h = 0; h < H && T > 0; ++h)
        Backend::fp8_quantize_rows(params_.format, &rows(h, 0, 0), T, rows.stride(1), d,
                                   params_.scales == Fp8Scale::kPerTokenHead ? 0.0f : head_scale(st, h), &q.codes(h, 0, 0),
                                   q.codes.stride(1));
      return call.end();
    } else {
      KVP_RETURN_IF_ERROR(detail::check_finite_rows<Backend>(kName, rows, ctx.exec));
      const float fmax = fp8_max(params_.format);
      if (rows.stride(2) == 1 || d == 1) {
        ctx.exec.parallel_for(H, [&](std::int64_t h, int) {
          const float s = params_.scales == Fp8Scale::kPerTokenHead ? 0.0f : head_scale(st, h);  // 0: each row's own
          if (T > 0)
            Backend::fp8_quantize_rows(params_.format, &rows(h, 0, 0), T, rows.stride(1), d, s, &q.codes(h, 0, 0), q.codes.stride(1));
        });
        return Status::ok();
      }
      ctx.exec.parallel_for(H, [&](std::int64_t h, int) {
        for (std::int64_t t = 0; t < T; ++t) {
          std::uint8_t* out = &q.codes(h, t, 0);
          float scale = head_scale(st, h);
          if (params_.scales == Fp8Scale::kPerTokenHead) {
            float amax = 0.0f;
            for (std::int64_t c = 0; c < d; ++c) amax = std::max(amax, std::fabs(to_float(rows(h, t, c))));
            scale = amax > 0.0f ? amax / fmax : 1.0f;
            std::memcpy(out + d, &scale, sizeof scale);
            std::memset(out + d + sizeof scale, 0, kTrailer - sizeof scale);
          }
          for (std::int64_t c = 0; c < d; ++c) out[c] = fp8_encode(params_.format, to_float(rows(h, t, c)) / scale);
        }
      });
      return Status::ok();
    }
  }

  /// Tokens [0, q.tokens) back into `out`; kPerHead reads the scales of `st`.
  template <class Backend, class Tk>
  Status dequantize(const Context<Backend>& ctx, const QuantizedKV& q, TensorView<Tk, 3> out, const State& st = {}) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_RETURN_IF_ERROR(out.check_basic(kName, "out"));
    const std::int64_t H = out.extent(0), T = out.extent(1), d = out.extent(2);
    KVP_RETURN_IF_ERROR(detail::check_quant_memory(kName, "out", kDeviceBackend<Backend>, out.device(), out.stride(2), d, true));
    KVP_REQUIRE(q.tokens == T, "fp8: out has %lld tokens, the quantized region holds %lld", static_cast<long long>(T),
                static_cast<long long>(q.tokens));
    KVP_REQUIRE(q.layout.name != nullptr && std::string_view(q.layout.name) == fp8_name(params_.format),
                "fp8: the quantized region's layout is '%s', the policy's is '%s'", q.layout.name ? q.layout.name : "(null)",
                fp8_name(params_.format));
    KVP_RETURN_IF_ERROR(check_scales(st, H));
    KVP_RETURN_IF_ERROR(check_codes(q, H, T, d));
    if constexpr (kDeviceBackend<Backend>) {
      KVP_RETURN_IF_ERROR(detail::check_quant_memory(kName, "codes", true, q.codes.device(), 1, 1));
      const detail::BackendCall<Backend> call(ctx);
      KVP_RETURN_IF_ERROR(call.begin());
      for (std::int64_t h = 0; h < H && T > 0; ++h)
        Backend::fp8_dequantize_rows(params_.format, &q.codes(h, 0, 0), T, q.codes.stride(1), d,
                                     params_.scales == Fp8Scale::kPerTokenHead ? 0.0f : head_scale(st, h), &out(h, 0, 0), out.stride(1));
      return call.end();
    } else {
      if (out.stride(2) == 1 || d == 1) {
        ctx.exec.parallel_for(H, [&](std::int64_t h, int) {
          const float s = params_.scales == Fp8Scale::kPerTokenHead ? 0.0f : head_scale(st, h);  // 0: the row's trailer
          if (T > 0)
            Backend::fp8_dequantize_rows(params_.format, &q.codes(h, 0, 0), T, q.codes.stride(1), d, s, &out(h, 0, 0), out.stride(1));
        });
        return Status::ok();
      }
      float lut[256];
      for (int c = 0; c < 256; ++c) lut[c] = fp8_decode(params_.format, static_cast<std::uint8_t>(c));
      ctx.exec.parallel_for(H, [&](std::int64_t h, int) {
        for (std::int64_t t = 0; t < T; ++t) {
          const std::uint8_t* in = &q.codes(h, t, 0);
          float scale = head_scale(st, h);
          if (params_.scales == Fp8Scale::kPerTokenHead) std::memcpy(&scale, in + d, sizeof scale);
          for (std::int64_t c = 0; c < d; ++c) out(h, t, c) = from_float<Tk>(lut[in[c]] * scale);
        }
      });
      return Status::ok();
    }
  }

 private:
  float head_scale(const State& st, std::int64_t h) const noexcept {
    return params_.scales == Fp8Scale::kPerHead ? st.head_scales[static_cast<std::size_t>(h)] : params_.scale;
  }
  Status check_scales(const State& st, std::int64_t H) const noexcept {
    if (params_.scales != Fp8Scale::kPerHead) return Status::ok();
    KVP_REQUIRE(static_cast<std::int64_t>(st.head_scales.size()) == H && (H == 0 || st.head_scales.data() != nullptr),
                "fp8: per_head scales has %zu entries, expected %lld (one per kv head)", st.head_scales.size(), static_cast<long long>(H));
    for (std::int64_t h = 0; h < H; ++h) {
      const float s = st.head_scales[static_cast<std::size_t>(h)];
      KVP_REQUIRE(std::isfinite(s) && s > 0.0f, "fp8: per_head scale of head %lld is %g, must be finite and > 0", static_cast<long long>(h),
                  static_cast<double>(s));
    }
    return Status::ok();
  }
  Status check_codes(const QuantizedKV& q, std::int64_t H, std::int64_t T, std::int64_t d) const noexcept {
    const auto& c = q.codes;
    KVP_RETURN_IF_ERROR(c.check_basic(kName, "codes"));
    KVP_REQUIRE(c.extent(0) == H && c.extent(1) >= T && c.extent(2) == row_bytes(d),
                "fp8: codes is (%lld, %lld, %lld), expected (%lld kv heads, >= %lld tokens, %lld bytes per row)",
                static_cast<long long>(c.extent(0)), static_cast<long long>(c.extent(1)), static_cast<long long>(c.extent(2)),
                static_cast<long long>(H), static_cast<long long>(T), static_cast<long long>(row_bytes(d)));
    KVP_REQUIRE(c.stride(2) == 1, "fp8: codes has byte stride %lld, must be 1", static_cast<long long>(c.stride(2)));
    return Status::ok();
  }

  Params params_{};
};

static_assert(QuantizationPolicy<Fp8Quant, float> && QuantizationPolicy<Fp8Quant, half> && QuantizationPolicy<Fp8Quant, bfloat16>);

KVP_NAMESPACE_END
