// Fuzz target: the quantization policies on fuzzed shapes, parameters, state
// and values: KiviQuant::append (keys or values, 2/4/8 bits, any group and
// residual, residual views and code regions sometimes too small, residual
// lengths out of range, NaN / infinities / values past fp16), Int4Quant and
// GgmlQuant with every rotation mode (any head_dim, blocks that do not divide
// it, short code regions).
// Contract: no crash or sanitizer report; on error nothing changed (codes,
// scales, residual, token counts compared byte for byte); on success KIVI's
// counts follow the residual rule and every decoded value is finite; backend::Cpu
// (vectorised codecs) gives the same status and the same bytes as backend::Scalar.
#include <cmath>
#include <cstring>

#include "fuzz_util.hpp"
#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/quantization/ggml_quant.hpp"
#include "kvpolicy/policy/quantization/int4_quant.hpp"
#include "kvpolicy/policy/quantization/kivi_quant.hpp"

using namespace kvpolicy;
using namespace kvp_fuzz;

namespace {

void fuzz_kivi(FuzzedDataProvider& fdp) {
  const QuantRole role = fdp.ConsumeBool() ? QuantRole::kKeys : QuantRole::kValues;
  const int bits_choice[] = {2, 4, 8, 3};
  const KiviQuant p(KiviQuantParams{role, bits_choice[fdp.ConsumeIntegralInRange<int>(0, 3)],
                                    fdp.ConsumeIntegralInRange<std::int32_t>(-1, 40), fdp.ConsumeIntegralInRange<std::int32_t>(-1, 70)});
  const std::int64_t H = fdp.ConsumeIntegralInRange<std::int64_t>(1, 2), d = fdp.ConsumeIntegralInRange<std::int64_t>(1, 48),
                     n = fdp.ConsumeIntegralInRange<std::int64_t>(0, 80);
  const std::int64_t R = std::max<std::int32_t>(p.params().residual, 0),
                     res_rows = std::max<std::int64_t>(0, R + fdp.ConsumeIntegralInRange<int>(-2, 1));
  const std::int64_t cap_tokens = fdp.ConsumeIntegralInRange<std::int64_t>(0, 160);
  const bool params_ok = p.validate_params().is_ok() && p.check_head_dim(d).is_ok();
  const std::int64_t rows = params_ok ? p.code_rows(cap_tokens) : 1;
  const std::int64_t cb = params_ok ? p.codes_row_bytes(d) : 1, sb = params_ok ? p.scales_row_bytes(d) : 1;
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(std::max<std::int64_t>(H * rows * cb, 1)), 0xA5),
      scales(static_cast<std::size_t>(std::max<std::int64_t>(H * rows * sb, 1)), 0x5A);
  std::vector<half> res(static_cast<std::size_t>(std::max<std::int64_t>(H * res_rows * d, 1)), half::from_bits(0x7777));
  std::vector<float> x(static_cast<std::size_t>(std::max<std::int64_t>(H * n * d, 1)));
  for (auto& v : x) v = fdp.ConsumeBool() ? fdp.ConsumeFloatingPointInRange<float>(-3.f, 3.f) : fuzz_float(fdp);
  KiviState st{TensorView<half, 3>::contiguous(res.data(), {H, res_rows, d}), fdp.ConsumeIntegralInRange<std::int64_t>(-1, R + 1)};
  QuantizedKV q{p.layout(), TensorView<std::uint8_t, 3>::contiguous(codes.data(), {H, rows, cb}),
                TensorView<std::uint8_t, 3>::contiguous(scales.data(), {H, rows, sb}),
                fdp.ConsumeIntegralInRange<std::int64_t>(0, 2) * std::max<std::int32_t>(p.params().group, 1)};
  const auto c0 = codes, s0 = scales;
  const auto r0 = res;
  const std::int64_t t0 = q.tokens, l0 = st.residual_len;
  // The same append on backend::Cpu, on copies: same status, same bytes (its codecs equal the reference's).
  std::vector<std::uint8_t> codes_c = codes, scales_c = scales;
  std::vector<half> res_c = res;
  KiviState st_c{TensorView<half, 3>::contiguous(res_c.data(), {H, res_rows, d}), st.residual_len};
  QuantizedKV q_c{q.layout, TensorView<std::uint8_t, 3>::contiguous(codes_c.data(), {H, rows, cb}),
                  TensorView<std::uint8_t, 3>::contiguous(scales_c.data(), {H, rows, sb}), q.tokens};
  const Status s_c = p.append(Context<backend::Cpu>{}, TensorView<const float, 3>::contiguous(x.data(), {H, n, d}), st_c, q_c);
  const Status s = p.append(Context<backend::Scalar>{}, TensorView<const float, 3>::contiguous(x.data(), {H, n, d}), st, q);
  KVP_FUZZ_CHECK(s.is_ok() == s_c.is_ok(), "kivi append: scalar %s, cpu %s", s.message(), s_c.message());
  KVP_FUZZ_CHECK(same_bytes(codes, codes_c) && same_bytes(scales, scales_c) && same_bytes(res, res_c) && q.tokens == q_c.tokens &&
                     st.residual_len == st_c.residual_len,
                 "kivi append: backend::Cpu wrote other bytes than backend::Scalar");
  if (!s.is_ok()) {
    KVP_FUZZ_CHECK(same_bytes(codes, c0) && same_bytes(scales, s0) && same_bytes(res, r0) && q.tokens == t0 && st.residual_len == l0,
                   "kivi append failed (%s) but wrote", s.message());
    return;
  }
  KVP_FUZZ_CHECK(q.tokens + st.residual_len == t0 + l0 + n, "kivi: %lld + %lld != %lld + %lld + %lld", static_cast<long long>(q.tokens),
                 static_cast<long long>(st.residual_len), static_cast<long long>(t0), static_cast<long long>(l0),
                 static_cast<long long>(n));
  KVP_FUZZ_CHECK(st.residual_len >= 0 && st.residual_len <= (role == QuantRole::kKeys ? R - 1 : R), "kivi residual_len %lld",
                 static_cast<long long>(st.residual_len));
  if (q.tokens > 0 && role == QuantRole::kValues) {
    std::vector<float> y(static_cast<std::size_t>(H * q.tokens * d));
    QuantizedKV all = q;
    KVP_FUZZ_CHECK(p.dequantize(Context<backend::Scalar>{}, all, TensorView<float, 3>::contiguous(y.data(), {H, q.tokens, d})).is_ok(),
                   "kivi dequantize");
    for (float v : y) KVP_FUZZ_CHECK(std::isfinite(v), "kivi decoded a non-finite value");
  }
}

template <class P>
void fuzz_rows(FuzzedDataProvider& fdp, const P& p) {
  const std::int64_t H = fdp.ConsumeIntegralInRange<std::int64_t>(1, 2), T = fdp.ConsumeIntegralInRange<std::int64_t>(0, 4),
                     d = fdp.ConsumeIntegralInRange<std::int64_t>(1, 5) * (fdp.ConsumeBool() ? 32 : 6);
  const std::int64_t rb = std::max<std::int64_t>(p.row_bytes(d), 1),
                     cap = std::max<std::int64_t>(0, T + fdp.ConsumeIntegralInRange<int>(-1, 1));
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(std::max<std::int64_t>(H * cap * rb, 1)), 0xC3);
  std::vector<float> x(static_cast<std::size_t>(std::max<std::int64_t>(H * T * d, 1)));
  for (auto& v : x) v = fdp.ConsumeBool() ? fdp.ConsumeFloatingPointInRange<float>(-3.f, 3.f) : fuzz_float(fdp);
  QuantizedKV q{p.layout(), TensorView<std::uint8_t, 3>::contiguous(codes.data(), {H, cap, rb}), {}, T};
  typename P::State st{};
  const auto c0 = codes;
  const Status s = p.quantize(Context<backend::Scalar>{}, TensorView<const float, 3>::contiguous(x.data(), {H, T, d}), st, q);
  // backend::Cpu on a copy: the same status and the same bytes.
  std::vector<std::uint8_t> codes_c = c0;
  QuantizedKV q_c{p.layout(), TensorView<std::uint8_t, 3>::contiguous(codes_c.data(), {H, cap, rb}), {}, T};
  typename P::State st_c{};
  const Status s_c = p.quantize(Context<backend::Cpu>{}, TensorView<const float, 3>::contiguous(x.data(), {H, T, d}), st_c, q_c);
  KVP_FUZZ_CHECK(s.is_ok() == s_c.is_ok() && same_bytes(codes, codes_c), "%s quantize: backend::Cpu differs from backend::Scalar (%s / %s)",
                 P::kName, s.message(), s_c.message());
  if (!s.is_ok()) {
    KVP_FUZZ_CHECK(same_bytes(codes, c0), "quantize failed (%s) but wrote", s.message());
    return;
  }
  std::vector<float> y(static_cast<std::size_t>(std::max<std::int64_t>(H * T * d, 1))), y_c(y.size());
  KVP_FUZZ_CHECK(p.dequantize(Context<backend::Scalar>{}, q, TensorView<float, 3>::contiguous(y.data(), {H, T, d})).is_ok(), "dequantize");
  KVP_FUZZ_CHECK(p.dequantize(Context<backend::Cpu>{}, q, TensorView<float, 3>::contiguous(y_c.data(), {H, T, d})).is_ok(),
                 "dequantize (cpu)");
  KVP_FUZZ_CHECK(std::memcmp(y.data(), y_c.data(), y.size() * sizeof(float)) == 0,
                 "%s dequantize: backend::Cpu differs from backend::Scalar", P::kName);
  // Finite decodes are promised while the stored scale / minimum fit fp16: |x| <= 1e4 for the element's own
  // value without rotation; with one, a rotation of n <= 64 values spreads up to 8x the row's largest
  // magnitude into every entry of its block (quant/ggml.hpp), so any |x| > 4e3 in the row voids the promise.
  const bool rotated = p.params().rotation != HadamardMode::kNone;
  std::vector<float> row_max(static_cast<std::size_t>(H * T), 0.0f);
  for (std::int64_t i = 0; i < H * T * d; ++i)
    row_max[static_cast<std::size_t>(i / d)] =
        std::max(row_max[static_cast<std::size_t>(i / d)], std::fabs(x[static_cast<std::size_t>(i)]));
  for (std::int64_t i = 0; i < H * T * d; ++i)
    KVP_FUZZ_CHECK(std::isfinite(y[static_cast<std::size_t>(i)]) || std::fabs(x[static_cast<std::size_t>(i)]) > 1e4f ||
                       (rotated && row_max[static_cast<std::size_t>(i / d)] > 4e3f),
                   "%s decoded a non-finite value %g at %lld of (%lld, %lld, %lld) from %g (rotation %d, block %d, role %d)", P::kName,
                   static_cast<double>(y[static_cast<std::size_t>(i)]), static_cast<long long>(i), static_cast<long long>(H),
                   static_cast<long long>(T), static_cast<long long>(d), static_cast<double>(x[static_cast<std::size_t>(i)]),
                   static_cast<int>(p.params().rotation), p.params().block, static_cast<int>(p.params().role));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider fdp(data, size);
  const HadamardMode modes[] = {HadamardMode::kNone, HadamardMode::kLlamaCpp, HadamardMode::kBlock};
  switch (fdp.ConsumeIntegralInRange<int>(0, 2)) {
    case 0: fuzz_kivi(fdp); break;
    case 1:
      fuzz_rows(fdp, Int4Quant(Int4QuantParams{fdp.ConsumeBool() ? 4 : 8, modes[fdp.ConsumeIntegralInRange<int>(0, 2)],
                                               fdp.ConsumeIntegralInRange<std::int32_t>(0, 70),
                                               fdp.ConsumeBool() ? QuantRole::kKeys : QuantRole::kValues}));
      break;
    default:
      fuzz_rows(fdp, GgmlQuant(GgmlQuantParams{
                         static_cast<GgmlType>(fdp.ConsumeIntegralInRange<int>(0, 5)), modes[fdp.ConsumeIntegralInRange<int>(0, 2)],
                         fdp.ConsumeIntegralInRange<std::int32_t>(0, 70), fdp.ConsumeBool() ? QuantRole::kKeys : QuantRole::kValues}));
      break;
  }
  return 0;
}
