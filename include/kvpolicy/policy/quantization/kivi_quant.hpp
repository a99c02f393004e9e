// SPDX-License-Identifier: Apache-2.0
// `KiviQuant`: KIVI's 2/4/8-bit K or V cache (quant/kivi.hpp gives the
// arithmetic and the byte layout) with its full-precision residual window,
// as a `QuantizationPolicy`. One policy object serves one role: keys
// (per-channel groups of `group` tokens) or values (per-token groups of
// `group` channels). Defaults are the reference's: 2 bits, group 32,
// residual 128 (KIVI's README and LongBench scripts; its examples use 32).
//
// One-shot (the concept's pair):
//   quantize:   rows (kv_heads, T, head_dim) -> codes/scales from token 0
//               (keys: T a multiple of `group`).
//   dequantize: the q.tokens quantized tokens -> out (kv_heads, q.tokens, head_dim).
//
// Streaming, the reference's decode loop (`append`, the call an engine makes
// after a step's attention, with that step's new rows; the prompt is one call):
//   the logical sequence is the residual followed by the new rows;
//   keys:   whole blocks of `residual` tokens are quantized from its front
//           (the prompt: T - T mod R tokens; decode: the block the moment it
//           reaches R tokens), so 0..R-1 recent keys stay in full precision;
//   values: every token but the last `residual` is quantized (one per decode
//           step once the window is full).
//   The step's attention therefore reads codes [0, q.tokens) and the
//   residual rows (`State::residual`, caller-owned, fp16 as in the
//   reference's fp16 model), new rows last: that is the reference's
//   concat(quantized, full precision) for K and V.
//
// Memory: bytes_per_token(d) = d * bits / 8 + 4 * d / group per kv head
// (scales included), plus the residual's residual * d * 2 bytes per kv head.
//
// Validation, before anything is written: bits in {2, 4, 8}; group a
// multiple of 32 / bits (keys pack tokens into words) or dividing head_dim
// (values); residual a multiple of group (keys, as the reference asserts);
// every value finite and inside the fp16 range (KIVI computes in fp16);
// no group range overflowing fp16; codes / scales / residual views shaped
// for what the call writes. Thread-safety: const; heads split over ctx.exec.
//
// Speed: rows are converted to KIVI's fp16 values a chunk at a time
// (Backend::kivi_r16_rows) and coded by the backend's kivi_*_keys /
// kivi_*_value_rows (vectorised on backend::Cpu, bit-identical with
// backend::Scalar). A quantize reads its input twice: once to validate every
// value and group range before the first write (a scan of the rows as they
// are, heads in parallel), once to code it. A dequantize into fp32 or fp16
// rows with unit channel stride decodes straight into them; other outputs go
// through an fp32 chunk.
//
// On a device backend (backend::Cuda: rows, codes, scales, out and the
// state's residual in device memory, channels contiguous): per kv head one
// Backend::kivi_encode_tokens (the logical tokens being quantized, residual
// first), kivi_decode_tokens or kivi_update_residual (the residual's move and
// the new rows), bit-identical with the host path (the same quant/kivi.hpp
// arithmetic, host-device). Shapes, the residual length and the regions are
// checked on the host as above; the values and the group ranges are not
// (that scan would need a synchronisation): a non-finite value or a range
// overflowing fp16 gives unspecified codes within the call's own rows.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>

#include "kvpolicy/policy/concepts.hpp"
#include "kvpolicy/policy/params.hpp"
#include "kvpolicy/policy/policy.hpp"
#include "kvpolicy/policy/quantization/quant_checks.hpp"
#include "kvpolicy/policy/quantization/role.hpp"
#include "kvpolicy/quant/kivi.hpp"

KVP_NAMESPACE_BEGIN

struct KiviQuantParams {
  QuantRole role = QuantRole::kKeys;
  std::int32_t bits = 2;
  std::int32_t group = 32;
  std::int32_t residual = 128;

  static constexpr auto fields() noexcept {
    return std::tuple{param_field<&KiviQuantParams::role>("role", "keys (per-channel groups) or values (per-token groups)"),
                      param_field<&KiviQuantParams::bits>("bits", "code bits: 2, 4 or 8"),
                      param_field<&KiviQuantParams::group>("group", "values sharing one scale and minimum"),
                      param_field<&KiviQuantParams::residual>("residual", "recent tokens kept in full precision")};
  }
};

/// The full-precision residual window of one layer and role, caller-owned.
struct KiviState {
  TensorView<half, 3> residual{};  ///< (kv_heads, >= residual, head_dim), rows [0, residual_len) hold the recent tokens, oldest first
  std::int64_t residual_len = 0;
};

class KiviQuant {
 public:
  using Params = KiviQuantParams;
  using State = KiviState;
  static constexpr const char* kName = "kivi";

  constexpr KiviQuant() noexcept = default;
  explicit constexpr KiviQuant(const Params& p) noexcept : params_(p) {}
  constexpr const Params& params() const noexcept { return params_; }

  Status validate_params() const noexcept {
    KVP_RETURN_IF_ERROR(check_enum_fields(kName, params_));
    const Params& p = params_;
    KVP_REQUIRE(p.role == QuantRole::kKeys || p.role == QuantRole::kValues, "kivi: role %d is not keys or values",
                static_cast<int>(p.role));
    KVP_REQUIRE(kivi::bits_valid(p.bits), "kivi: bits is %d, must be 2, 4 or 8", p.bits);
    KVP_REQUIRE(p.group >= 1 && p.group <= 4096, "kivi: group is %d, must be in [1, 4096]", p.group);
    KVP_REQUIRE(p.residual >= 0 && p.residual <= (1 << 20), "kivi: residual is %d, must be in [0, 2^20]", p.residual);
    if (p.role == QuantRole::kKeys) {
      KVP_REQUIRE(p.group % kivi::per_word(p.bits) == 0, "kivi: keys group %d is not a multiple of %d (tokens per %d-bit word)", p.group,
                  kivi::per_word(p.bits), p.bits);
      KVP_REQUIRE(p.residual >= p.group && p.residual % p.group == 0, "kivi: keys residual %d must be a positive multiple of group %d",
                  p.residual, p.group);
    }
    return Status::ok();
  }
  Status check_head_dim(std::int64_t d) const noexcept {
    const int f = kivi::per_word(params_.bits);
    KVP_REQUIRE(d >= 1 && d % f == 0, "kivi: head_dim %lld is not a multiple of %d (codes per %d-bit word)", static_cast<long long>(d), f,
                params_.bits);
    if (params_.role == QuantRole::kValues)
      KVP_REQUIRE(d % params_.group == 0, "kivi: head_dim %lld is not a multiple of the values group %d", static_cast<long long>(d),
                  params_.group);
    return Status::ok();
  }

  QuantLayout layout() const noexcept {
    const bool keys = params_.role == QuantRole::kKeys;
    return QuantLayout{layout_name(),
                       params_.bits,
                       params_.group,
                       params_.group * params_.bits / 8 > 0 ? params_.group * params_.bits / 8 : 1,
                       4,
                       QuantScaleLayout::kSeparate,
                       keys ? QuantAxis::kChannel : QuantAxis::kToken};
  }
  double bytes_per_token(std::int64_t d) const noexcept {
    return static_cast<double>(d) * params_.bits / 8.0 + 4.0 * static_cast<double>(d) / params_.group;
  }
  /// Bytes of the full-precision residual per kv head.
  std::int64_t residual_bytes(std::int64_t d) const noexcept { return static_cast<std::int64_t>(params_.residual) * d * 2; }
  /// Extent(2) of q.codes: a key group's words, or a value row's words.
  constexpr std::int64_t codes_row_bytes(std::int64_t d) const noexcept {
    return params_.role == QuantRole::kKeys ? kivi::key_group_code_bytes(d, params_.group, params_.bits)
                                            : kivi::value_row_code_bytes(d, params_.bits);
  }
  /// Extent(2) of q.scales: a key group's D scales and minimums, or a value row's D / group pairs.
  constexpr std::int64_t scales_row_bytes(std::int64_t d) const noexcept {
    return params_.role == QuantRole::kKeys ? kivi::key_group_scale_bytes(d) : kivi::value_row_scale_bytes(d, params_.group);
  }
  /// Rows of q.codes / q.scales `tokens` quantized tokens take (key groups or value tokens).
  std::int64_t code_rows(std::int64_t tokens) const noexcept {
    return params_.role == QuantRole::kKeys ? (tokens + params_.group - 1) / params_.group : tokens;
  }

  template <class Backend>
  Requirements requirements(const Context<Backend>&, const ProblemShape& shape) const noexcept {
    Requirements r;
    r.status = validate_params();
    if (r.status.is_ok()) r.status = check_head_dim(shape.head_dim);
    if (r.status.is_ok()) r.output = OutputSize{shape.num_kv_heads, shape.num_kv_heads * code_rows(shape.max_kv_len)};
    return r;
  }

  /// One shot: every row of `rows` quantized into q from its first group / token (st unused).
  template <class Backend, class Tk>
  Status quantize(const Context<Backend>& ctx, TensorView<const Tk, 3> rows, State&, QuantizedKV q) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_RETURN_IF_ERROR(check_rows<Backend>(rows, "rows", rows.extent(1)));  // shapes; values below, in one pass with the ranges
    const std::int64_t H = rows.extent(0), T = rows.extent(1), d = rows.extent(2);
    if (params_.role == QuantRole::kKeys)
      KVP_REQUIRE(T % params_.group == 0, "kivi: keys rows has %lld tokens, not a multiple of group %d", static_cast<long long>(T),
                  params_.group);
    KVP_RETURN_IF_ERROR(check_region(q, H, 0, T, d));
    if constexpr (kDeviceBackend<Backend>) {  // one launch per kv head; values and ranges are not scanned (see the header)
      KVP_RETURN_IF_ERROR(check_device_region(q));
      const detail::BackendCall<Backend> call(ctx);
      KVP_RETURN_IF_ERROR(call.begin());
      for (std::int64_t h = 0; h < H && T > 0; ++h)
        Backend::kivi_encode_tokens(codec(), static_cast<const half*>(nullptr), 0, 0, &rows(h, 0, 0), rows.stride(1), T, d,
                                    &q.codes(h, 0, 0), q.codes.stride(1), &q.scales(h, 0, 0), q.scales.stride(1));
      return call.end();
    } else {
      const LogicalRows<Tk> tok{rows, {}, 0};
      KVP_RETURN_IF_ERROR(check_ranges<Backend>(tok, H, d, T, ctx.exec));
      ctx.exec.parallel_for(H, [&](std::int64_t h, int) { write_codes<Backend>(tok, h, 0, T, d, q); });
      return Status::ok();
    }
  }

  /// Tokens [0, q.tokens) decoded into `out` (kv_heads, q.tokens, head_dim).
  template <class Backend, class Tk>
  Status dequantize(const Context<Backend>& ctx, const QuantizedKV& q, TensorView<Tk, 3> out) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_RETURN_IF_ERROR(out.check_basic(kName, "out"));
    const std::int64_t H = out.extent(0), T = out.extent(1), d = out.extent(2);
    KVP_RETURN_IF_ERROR(detail::check_quant_memory(kName, "out", kDeviceBackend<Backend>, out.device(), out.stride(2), d, true));
    KVP_RETURN_IF_ERROR(check_head_dim(d));
    KVP_REQUIRE(q.tokens == T, "kivi: out has %lld tokens, the quantized region holds %lld", static_cast<long long>(T),
                static_cast<long long>(q.tokens));
    KVP_REQUIRE(q.layout.name != nullptr && std::string_view(q.layout.name) == layout_name(),
                "kivi: the quantized region's layout is '%s', the policy's is '%s'", q.layout.name ? q.layout.name : "(null)",
                layout_name());
    if (params_.role == QuantRole::kKeys)
      KVP_REQUIRE(T % params_.group == 0, "kivi: the keys region holds %lld tokens, not a multiple of group %d", static_cast<long long>(T),
                  params_.group);
    KVP_RETURN_IF_ERROR(check_region(q, H, 0, T, d));
    if constexpr (kDeviceBackend<Backend>) {
      KVP_RETURN_IF_ERROR(check_device_region(q));
      const detail::BackendCall<Backend> call(ctx);
      KVP_RETURN_IF_ERROR(call.begin());
      for (std::int64_t h = 0; h < H && T > 0; ++h)
        Backend::kivi_decode_tokens(codec(), &q.codes(h, 0, 0), q.codes.stride(1), &q.scales(h, 0, 0), q.scales.stride(1), T, d,
                                    &out(h, 0, 0), out.stride(1));
      return call.end();
    } else {
      return dequantize_host<Backend>(ctx, q, out);
    }
  }

 private:
  template <class Backend, class Tk>
  Status dequantize_host(const Context<Backend>& ctx, const QuantizedKV& q, TensorView<Tk, 3> out) const noexcept {
    const std::int64_t H = out.extent(0), T = out.extent(1), d = out.extent(2);
    const int G = params_.group, b = params_.bits;
    const bool unit = out.stride(2) == 1 || d == 1;
    if constexpr (std::is_same_v<Tk, float> || std::is_same_v<Tk, half>) {
      if (unit) {  // decoded straight into out: the decoded values are fp16, exact in either type
        ctx.exec.parallel_for(H, [&](std::int64_t h, int) {
          if (params_.role == QuantRole::kKeys) {
            for (std::int64_t g = 0; g < T / G; ++g)
              Backend::kivi_dequantize_keys(&q.codes(h, g, 0), &q.scales(h, g, 0), d, G, b, &out(h, g * G, 0), out.stride(1));
          } else if (T > 0) {
            Backend::kivi_dequantize_value_rows(&q.codes(h, 0, 0), q.codes.stride(1), &q.scales(h, 0, 0), q.scales.stride(1), T, d, G, b,
                                                &out(h, 0, 0), out.stride(1));
          }
        });
        return Status::ok();
      }
    }
    if (fits_scratch(d)) {
      ctx.exec.parallel_for(H, [&](std::int64_t h, int) {
        alignas(64) float y[kScratch];
        if (params_.role == QuantRole::kKeys) {
          for (std::int64_t g = 0; g < T / G; ++g) {
            Backend::kivi_dequantize_keys(&q.codes(h, g, 0), &q.scales(h, g, 0), d, G, b, y, d);
            store_rows<Backend>(y, G, d, out, h, g * G, unit);
          }
        } else {
          const std::int64_t chunk = kScratch / d;
          for (std::int64_t t0 = 0; t0 < T; t0 += chunk) {
            const std::int64_t m = std::min(chunk, T - t0);
            Backend::kivi_dequantize_value_rows(&q.codes(h, t0, 0), q.codes.stride(1), &q.scales(h, t0, 0), q.scales.stride(1), m, d, G, b,
                                                y, d);
            store_rows<Backend>(y, m, d, out, h, t0, unit);
          }
        }
      });
      return Status::ok();
    }
    ctx.exec.parallel_for(H, [&](std::int64_t h, int) {
      float row[4096];
      if (params_.role == QuantRole::kKeys) {
        for (std::int64_t g = 0; g < T / G; ++g)
          for (std::int64_t c = 0; c < d; ++c) {
            kivi::dequantize_key_channel(&q.codes(h, g, 0), &q.scales(h, g, 0), d, c, G, b, row, 1);
            for (int t = 0; t < G; ++t) out(h, g * G + t, c) = from_float<Tk>(row[t]);
          }
      } else {
        for (std::int64_t t = 0; t < T; ++t) {
          kivi::dequantize_value_row(&q.codes(h, t, 0), &q.scales(h, t, 0), d, G, b, row);
          for (std::int64_t c = 0; c < d; ++c) out(h, t, c) = from_float<Tk>(row[c]);
        }
      }
    });
    return Status::ok();
  }

 public:
  /// Streaming store: `rows` (kv_heads, n, head_dim) join the residual, then
  /// the reference's flush rule moves the oldest tokens into q (q.tokens and
  /// st.residual_len are updated). Call it after the step's attention.
  template <class Backend, class Tk>
  Status append(const Context<Backend>& ctx, TensorView<const Tk, 3> rows, State& st, QuantizedKV& q) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_RETURN_IF_ERROR(check_rows<Backend>(rows, "rows", rows.extent(1)));  // shapes; values below
    const std::int64_t H = rows.extent(0), n = rows.extent(1), d = rows.extent(2), R = params_.residual;
    const std::int64_t len = st.residual_len;
    KVP_REQUIRE(len >= 0 && len <= (params_.role == QuantRole::kKeys ? R - 1 : R),
                "kivi: state residual_len is %lld, must be in [0, %lld] for %s", static_cast<long long>(len),
                static_cast<long long>(params_.role == QuantRole::kKeys ? R - 1 : R), role_name());
    if (R > 0) {
      KVP_RETURN_IF_ERROR(st.residual.check_basic(kName, "state residual"));
      KVP_RETURN_IF_ERROR(detail::check_quant_memory(kName, "state residual", kDeviceBackend<Backend>, st.residual.device(), 1, 1));
      KVP_REQUIRE(st.residual.extent(0) == H && st.residual.extent(1) >= R && st.residual.extent(2) == d && st.residual.stride(2) == 1,
                  "kivi: state residual is (%lld, %lld, %lld) with channel stride %lld, expected (%lld kv heads, >= %lld tokens, %lld) "
                  "with stride 1",
                  static_cast<long long>(st.residual.extent(0)), static_cast<long long>(st.residual.extent(1)),
                  static_cast<long long>(st.residual.extent(2)), static_cast<long long>(st.residual.stride(2)), static_cast<long long>(H),
                  static_cast<long long>(R), static_cast<long long>(d));
    }
    if (params_.role == QuantRole::kKeys)
      KVP_REQUIRE(q.tokens % params_.group == 0, "kivi: the keys region holds %lld tokens, not a multiple of group %d",
                  static_cast<long long>(q.tokens), params_.group);
    const std::int64_t L = len + n;
    const std::int64_t nq = params_.role == QuantRole::kKeys ? L / R * R : std::max<std::int64_t>(0, L - R);
    KVP_RETURN_IF_ERROR(check_region(q, H, q.tokens, nq, d));
    if constexpr (kDeviceBackend<Backend>) {  // per kv head: the quantized tokens, then the residual's update (same stream order)
      KVP_RETURN_IF_ERROR(check_device_region(q));
      const detail::BackendCall<Backend> call(ctx);
      KVP_RETURN_IF_ERROR(call.begin());
      const std::int64_t row0 = code_rows(q.tokens);
      for (std::int64_t h = 0; h < H; ++h) {
        const half* res = R > 0 ? &st.residual(h, 0, 0) : nullptr;
        const Tk* x = n > 0 ? &rows(h, 0, 0) : nullptr;
        if (nq > 0)
          Backend::kivi_encode_tokens(codec(), res, st.residual.stride(1), len, x, rows.stride(1), nq, d, &q.codes(h, row0, 0),
                                      q.codes.stride(1), &q.scales(h, row0, 0), q.scales.stride(1));
        if (R > 0 && L > nq) Backend::kivi_update_residual(&st.residual(h, 0, 0), st.residual.stride(1), len, nq, x, rows.stride(1), n, d);
      }
      KVP_RETURN_IF_ERROR(call.end());
      q.tokens += nq;
      st.residual_len = L - nq;
      return Status::ok();
    } else {
      // Rows that stay in the residual: finite in fp16; the quantized ones: finite with finite group ranges.
      KVP_RETURN_IF_ERROR(check_rows<Backend>(rows, "rows", std::clamp<std::int64_t>(nq - len, 0, n)));
      const LogicalRows<Tk> tok{rows, st.residual, len};
      KVP_RETURN_IF_ERROR(check_ranges<Backend>(tok, H, d, nq, ctx.exec));
      const std::int64_t first = q.tokens;
      ctx.exec.parallel_for(H, [&](std::int64_t h, int) {
        write_codes<Backend>(tok, h, first, nq, d, q);
        // The residual becomes logical tokens [nq, L): survivors of the old residual move to its front
        // (ascending, so an overlapping move reads before it writes), then the new rows.
        for (std::int64_t i = nq; i < len; ++i)
          std::memmove(&st.residual(h, i - nq, 0), &st.residual(h, i, 0), static_cast<std::size_t>(d) * 2);
        for (std::int64_t i = std::max(nq, len); i < L; ++i)
          for (std::int64_t c = 0; c < d; ++c) st.residual(h, i - nq, c) = to_half(to_float(rows(h, i - len, c)));
      });
      q.tokens += nq;
      st.residual_len = L - nq;
      return Status::ok();
    }
  }

  const char* layout_name() const noexcept {
    static constexpr const char* kNames[2][3] = {{"kivi_k2", "kivi_k4", "kivi_k8"}, {"kivi_v2", "kivi_v4", "kivi_v8"}};
    const int b = params_.bits == 2 ? 0 : params_.bits == 4 ? 1 : 2;
    return kNames[params_.role == QuantRole::kKeys ? 0 : 1][b];
  }

 private:
  static constexpr std::int64_t kScratch = 16384;  ///< fp32 values one worker converts at a time
  /// Whether a key group (group x d) and a value row fit the scratch (else the per-channel reference path runs).
  bool fits_scratch(std::int64_t d) const noexcept { return static_cast<std::int64_t>(params_.group) * d <= kScratch && d <= kScratch; }

  const char* role_name() const noexcept { return params_.role == QuantRole::kKeys ? "keys" : "values"; }

  /// The logical sequence an append quantizes from: the residual's rows [0, len) (fp16), then `rows`.
  template <class Tk>
  struct LogicalRows {
    TensorView<const Tk, 3> rows;
    TensorView<half, 3> residual;
    std::int64_t len = 0;

    /// Logical token i, channel c, as KIVI's fp16 value.
    float value(std::int64_t h, std::int64_t i, std::int64_t c) const noexcept {
      return i < len ? to_float(residual(h, i, c)) : kivi::r16(to_float(rows(h, i - len, c)));
    }
    /// Whether every value of logical tokens [0, n) of head h lies below 32752 in magnitude as an fp16
    /// value: a conservative scan (a false may still pass check_ranges' exact check). fp16 rows are read
    /// as they are, fp32 rows against 32744 (below which their fp16 rounding stays below 32752), other types
    /// through the fp16 gather in chunks of `chunk` tokens into x.
    template <class Backend>
    bool below_fp16_limit(std::int64_t h, std::int64_t n, std::int64_t d, float* x, std::int64_t chunk) const noexcept {
      const auto scan = [&](const auto* p, std::int64_t stride, std::int64_t m, float bound) noexcept {
        if (stride == d) return Backend::first_not_below(p, m * d, bound) < 0;
        for (std::int64_t i = 0; i < m; ++i)
          if (Backend::first_not_below(p + i * stride, d, bound) >= 0) return false;
        return true;
      };
      const std::int64_t r = std::min(n, len);
      if (r > 0 && !scan(&residual(h, 0, 0), residual.stride(1), r, 32752.0f)) return false;
      if (r == n) return true;
      if constexpr (std::is_same_v<Tk, half> || std::is_same_v<Tk, float>) {
        if (rows.stride(2) == 1 || d == 1)
          return scan(&rows(h, 0, 0), rows.stride(1), n - r, std::is_same_v<Tk, half> ? 32752.0f : 32744.0f);
      }
      for (std::int64_t t0 = r; t0 < n; t0 += chunk) {
        const std::int64_t m = std::min(chunk, n - t0);
        gather<Backend>(h, t0, m, d, x);
        if (Backend::first_not_below(x, m * d, 32752.0f) >= 0) return false;
      }
      return true;
    }
    /// Logical tokens [i0, i0 + m) of head h as fp16 values into x (m rows of d).
    template <class Backend>
    void gather(std::int64_t h, std::int64_t i0, std::int64_t m, std::int64_t d, float* x) const noexcept {
      std::int64_t r = 0;
      if (i0 < len) {
        r = std::min(m, len - i0);
        Backend::kivi_r16_rows(&residual(h, i0, 0), r, residual.stride(1), d, x);
      }
      if (r == m) return;
      const std::int64_t j0 = i0 + r - len;
      if (rows.stride(2) == 1 || d == 1) {
        Backend::kivi_r16_rows(&rows(h, j0, 0), m - r, rows.stride(1), d, x + r * d);
      } else {
        for (std::int64_t k = r; k < m; ++k)
          for (std::int64_t c = 0; c < d; ++c) x[k * d + c] = kivi::r16(to_float(rows(h, j0 + k - r, c)));
      }
    }
  };

  /// Rows y (m rows of d, fp16 values) into out(h, t0 .., :).
  template <class Backend, class Tk>
  static void store_rows(float* y, std::int64_t m, std::int64_t d, const TensorView<Tk, 3>& out, std::int64_t h, std::int64_t t0,
                         bool unit) noexcept {
    if (unit) {
      Backend::rotate_rows_out(y, m, d, 0, &out(h, t0, 0), out.stride(1));  // block 0: a plain conversion
      return;
    }
    for (std::int64_t r = 0; r < m; ++r)
      for (std::int64_t c = 0; c < d; ++c) out(h, t0 + r, c) = from_float<Tk>(y[r * d + c]);
  }

  /// Shapes of rows, and every value of its tokens [from, T) finite in fp16.
  template <class Backend, class Tk>
  Status check_rows(TensorView<const Tk, 3> rows, const char* name, std::int64_t from) const noexcept {
    KVP_RETURN_IF_ERROR(rows.check_basic(kName, name));
    const std::int64_t H = rows.extent(0), T = rows.extent(1), d = rows.extent(2);
    KVP_RETURN_IF_ERROR(detail::check_quant_memory(kName, name, kDeviceBackend<Backend>, rows.device(), rows.stride(2), d));
    KVP_RETURN_IF_ERROR(check_head_dim(d));
    KVP_REQUIRE(d <= 4096, "kivi: head_dim %lld exceeds 4096", static_cast<long long>(d));
    if constexpr (kDeviceBackend<Backend>) {
      return Status::ok();  // values are not scanned on a device
    } else {
      const LogicalRows<Tk> src{rows, {}, 0};
      const std::int64_t chunk = kScratch / d;
      alignas(64) float x[kScratch];
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t t0 = from; t0 < T; t0 += chunk) {
          const std::int64_t m = std::min(chunk, T - t0);
          src.template gather<Backend>(h, t0, m, d, x);
          const std::int64_t bad = Backend::first_not_below(x, m * d, __builtin_inff());  // fp16 overflow rounds to inf; or NaN
          if (bad < 0) continue;
          const std::int64_t t = t0 + bad / d, c = bad % d;
          return KVP_INVALID(
              "kivi: %s head %lld token %lld channel %lld is %g, not finite in fp16 (KIVI computes in fp16); nothing was written", name,
              static_cast<long long>(h), static_cast<long long>(t), static_cast<long long>(c),
              static_cast<double>(to_float(rows(h, t, c))));
        }
      return Status::ok();
    }
  }

  /// The format as the backends' kivi_*_tokens ops take it.
  kivi::Codec codec() const noexcept { return kivi::Codec{params_.role == QuantRole::kKeys, params_.bits, params_.group}; }
  /// A device backend's codes and scales are device memory.
  static Status check_device_region(const QuantizedKV& q) noexcept {
    KVP_RETURN_IF_ERROR(detail::check_quant_memory(kName, "codes", true, q.codes.device(), 1, 1));
    return detail::check_quant_memory(kName, "scales", true, q.scales.device(), 1, 1);
  }

  /// q holds room for tokens [from, from + count) (their code and scale rows exist).
  Status check_region(const QuantizedKV& q, std::int64_t H, std::int64_t from, std::int64_t count, std::int64_t d) const noexcept {
    KVP_RETURN_IF_ERROR(q.codes.check_basic(kName, "codes"));
    KVP_RETURN_IF_ERROR(q.scales.check_basic(kName, "scales"));
    const std::int64_t need = code_rows(from + count);
    KVP_REQUIRE(q.codes.extent(0) == H && q.codes.extent(1) >= need && q.codes.extent(2) == codes_row_bytes(d) && q.codes.stride(2) == 1,
                "kivi: codes is (%lld, %lld, %lld), expected (%lld kv heads, >= %lld %s, %lld bytes) with byte stride 1",
                static_cast<long long>(q.codes.extent(0)), static_cast<long long>(q.codes.extent(1)),
                static_cast<long long>(q.codes.extent(2)), static_cast<long long>(H), static_cast<long long>(need),
                params_.role == QuantRole::kKeys ? "key groups" : "tokens", static_cast<long long>(codes_row_bytes(d)));
    KVP_REQUIRE(
        q.scales.extent(0) == H && q.scales.extent(1) >= need && q.scales.extent(2) == scales_row_bytes(d) && q.scales.stride(2) == 1,
        "kivi: scales is (%lld, %lld, %lld), expected (%lld kv heads, >= %lld %s, %lld bytes) with byte stride 1",
        static_cast<long long>(q.scales.extent(0)), static_cast<long long>(q.scales.extent(1)), static_cast<long long>(q.scales.extent(2)),
        static_cast<long long>(H), static_cast<long long>(need), params_.role == QuantRole::kKeys ? "key groups" : "tokens",
        static_cast<long long>(scales_row_bytes(d)));
    return Status::ok();
  }

  /// Every value about to be quantized (logical tokens [0, nq)) is finite in fp16 and every group's fp16
  /// range is finite. Values below 32752 in magnitude cannot overflow a range (|mx - mn| < 65504), so a
  /// chunk whose values all are needs no per-value or per-group check. That scan runs over the heads in
  /// parallel; the exact check, which names the first bad value in (head, token, channel) order, runs from
  /// the first head the scan flagged on (the scan is conservative: a flagged head may pass).
  template <class Backend, class Tk>
  Status check_ranges(const LogicalRows<Tk>& tok, std::int64_t H, std::int64_t d, std::int64_t nq, const ExecContext& exec) const noexcept {
    const int G = params_.group;
    const bool keys = params_.role == QuantRole::kKeys;
    std::int64_t from = 0;
    if (fits_scratch(d)) {
      const std::int64_t n = keys ? nq / G * G : nq;  // the tokens write_codes quantizes
      std::atomic<std::int64_t> flagged{H};
      exec.parallel_for(H, [&](std::int64_t h, int) {
        if (h >= flagged.load(std::memory_order_relaxed)) return;
        alignas(64) float x[kScratch];
        if (tok.template below_fp16_limit<Backend>(h, n, d, x, kScratch / d)) return;
        std::int64_t cur = flagged.load(std::memory_order_relaxed);
        while (h < cur && !flagged.compare_exchange_weak(cur, h, std::memory_order_relaxed)) {
        }
      });
      from = flagged.load();
    }
    for (std::int64_t h = from; h < H; ++h) KVP_RETURN_IF_ERROR(check_head_ranges<Backend>(tok, h, d, nq));
    return Status::ok();
  }
  /// check_ranges' exact check of head h.
  template <class Backend, class Tk>
  Status check_head_ranges(const LogicalRows<Tk>& tok, std::int64_t h, std::int64_t d, std::int64_t nq) const noexcept {
    const int G = params_.group;
    const bool keys = params_.role == QuantRole::kKeys, gathered = fits_scratch(d);
    const std::int64_t chunk = keys ? G : kScratch / d;
    alignas(64) float x[kScratch];
    float col[4096];
    for (std::int64_t t0 = 0; t0 + (keys ? G : 1) <= nq; t0 += chunk) {
      const std::int64_t m = keys ? G : std::min(chunk, nq - t0);
      if (gathered) {
        tok.template gather<Backend>(h, t0, m, d, x);
        if (Backend::first_not_below(x, m * d, 32752.0f) < 0) continue;
      }
      for (std::int64_t t = t0; t < t0 + m; ++t)
        for (std::int64_t c = 0; c < d; ++c) {
          const float v = tok.value(h, t, c);
          if (std::isfinite(v)) continue;
          const bool in_rows = t >= tok.len;
          return KVP_INVALID(
              "kivi: %s head %lld token %lld channel %lld is %g, not finite in fp16 (KIVI computes in fp16); nothing was written",
              in_rows ? "rows" : "state residual", static_cast<long long>(h), static_cast<long long>(in_rows ? t - tok.len : t),
              static_cast<long long>(c), static_cast<double>(in_rows ? to_float(tok.rows(h, t - tok.len, c)) : v));
        }
      if (keys) {
        for (std::int64_t c = 0; c < d; ++c) {
          for (int t = 0; t < G; ++t) col[t] = tok.value(h, t0 + t, c);
          KVP_REQUIRE(kivi::group_range(col, G, params_.bits).finite,
                      "kivi: keys head %lld tokens [%lld, %lld) channel %lld span more than the fp16 range; nothing was written",
                      static_cast<long long>(h), static_cast<long long>(t0), static_cast<long long>(t0 + G), static_cast<long long>(c));
        }
      } else {
        for (std::int64_t t = t0; t < t0 + m; ++t)
          for (std::int64_t g = 0; g < d / G; ++g) {
            for (int c = 0; c < G; ++c) col[c] = tok.value(h, t, g * G + c);
            KVP_REQUIRE(kivi::group_range(col, G, params_.bits).finite,
                        "kivi: values head %lld token %lld channels [%lld, %lld) span more than the fp16 range; nothing was written",
                        static_cast<long long>(h), static_cast<long long>(t), static_cast<long long>(g * G),
                        static_cast<long long>(g * G + G));
          }
      }
    }
    return Status::ok();
  }
  /// Quantizes logical tokens [0, count) of head h into q from token `first`.
  template <class Backend, class Tk>
  void write_codes(const LogicalRows<Tk>& tok, std::int64_t h, std::int64_t first, std::int64_t count, std::int64_t d,
                   QuantizedKV& q) const noexcept {
    const int G = params_.group, b = params_.bits;
    alignas(64) float x[kScratch];
    if (!fits_scratch(d)) {  // per channel / row through the reference functions
      if (params_.role == QuantRole::kKeys) {
        for (std::int64_t g = 0; g < count / G; ++g) {
          const std::int64_t row = first / G + g;
          for (std::int64_t c = 0; c < d; ++c) {
            for (int t = 0; t < G; ++t) x[t] = tok.value(h, g * G + t, c);
            kivi::quantize_key_channel(x, d, c, G, b, &q.codes(h, row, 0), &q.scales(h, row, 0));
          }
        }
      } else {
        for (std::int64_t t = 0; t < count; ++t) {
          for (std::int64_t c = 0; c < d; ++c) x[c] = tok.value(h, t, c);
          kivi::quantize_value_row(x, d, G, b, &q.codes(h, first + t, 0), &q.scales(h, first + t, 0));
        }
      }
      return;
    }
    if (params_.role == QuantRole::kKeys) {
      for (std::int64_t g = 0; g < count / G; ++g) {
        tok.template gather<Backend>(h, g * G, G, d, x);
        Backend::kivi_quantize_keys(x, d, G, b, &q.codes(h, first / G + g, 0), &q.scales(h, first / G + g, 0));
      }
    } else {
      const std::int64_t chunk = kScratch / d;
      for (std::int64_t t0 = 0; t0 < count; t0 += chunk) {
        const std::int64_t m = std::min(chunk, count - t0);
        tok.template gather<Backend>(h, t0, m, d, x);
        Backend::kivi_quantize_value_rows(x, m, d, G, b, &q.codes(h, first + t0, 0), q.codes.stride(1), &q.scales(h, first + t0, 0),
                                          q.scales.stride(1));
      }
    }
  }

  Params params_{};
};

static_assert(QuantizationPolicy<KiviQuant, float> && QuantizationPolicy<KiviQuant, half> && QuantizationPolicy<KiviQuant, bfloat16>);

KVP_NAMESPACE_END
