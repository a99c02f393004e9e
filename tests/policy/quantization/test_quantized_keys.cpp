// QuantizedKeys<S, Q>: scorers on a quantized K cache give exactly the scores
// (and, composed, the decisions) of the same scorer on the decoded keys, for
// ggml, INT4 with rotation, fp8 and KIVI (with its residual), on Scalar and
// Cpu, with any thread count; bad regions are rejected before any write.
#include <catch2/catch.hpp>

#include <cstring>
#include <random>
#include <vector>

#include "../emulated_device.hpp"
#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/compose.hpp"
#include "kvpolicy/policy/eviction/adakv.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "kvpolicy/policy/eviction/tova.hpp"
#include "kvpolicy/policy/quantization/fp8_quant.hpp"
#include "kvpolicy/policy/quantization/ggml_quant.hpp"
#include "kvpolicy/policy/quantization/int4_quant.hpp"
#include "kvpolicy/policy/quantization/kivi_quant.hpp"
#include "kvpolicy/policy/quantization/quantized_keys.hpp"
#include "kvpolicy/util/thread_pool.hpp"

using namespace kvpolicy;
using Catch::Matchers::Contains;

namespace {

constexpr std::int64_t Hq = 8, H = 2, d = 64, T = 200, W = 16;

struct Fixture {
  std::vector<float> q, k;
  Fixture() : q(static_cast<std::size_t>(Hq * W * d)), k(static_cast<std::size_t>(H * T * d)) {
    std::mt19937 rng(21);
    std::normal_distribution<float> nd;
    for (auto& v : q) v = nd(rng);
    for (auto& v : k) v = nd(rng);
    for (std::int64_t r = 0; r < H * T; ++r) k[static_cast<std::size_t>(r * d + 5)] += 12.0f;  // an outlier channel
  }
  TensorView<const float, 3> queries() const { return TensorView<const float, 3>::contiguous(q.data(), {Hq, W, d}); }
};

/// A quantized K region of the fixture in format P, and the keys it decodes to.
template <class P>
struct Stored {
  std::vector<std::uint8_t> codes, scales;
  std::vector<half> residual;
  std::vector<float> decoded;
  QuantKeys keys;
  Stored(const P& p, const Fixture& f) : decoded(f.k.size()) {
    const Context<backend::Scalar> cx{};
    const auto rows = TensorView<const float, 3>::contiguous(f.k.data(), {H, T, d});
    keys.dim = d;
    if constexpr (std::is_same_v<P, KiviQuant>) {
      const std::int64_t R = p.params().residual, n = p.code_rows(T);
      codes.resize(static_cast<std::size_t>(H * n * p.codes_row_bytes(d)));
      scales.resize(static_cast<std::size_t>(H * n * p.scales_row_bytes(d)));
      residual.resize(static_cast<std::size_t>(H * R * d));
      KiviState st{TensorView<half, 3>::contiguous(residual.data(), {H, R, d}), 0};
      keys.region = QuantizedKV{p.layout(), TensorView<std::uint8_t, 3>::contiguous(codes.data(), {H, n, p.codes_row_bytes(d)}),
                                TensorView<std::uint8_t, 3>::contiguous(scales.data(), {H, n, p.scales_row_bytes(d)}), 0};
      REQUIRE(p.append(cx, rows, st, keys.region).is_ok());
      keys.residual = TensorView<const half, 3>::contiguous(residual.data(), {H, R, d});
      keys.residual_len = st.residual_len;
      const std::int64_t nq = keys.region.tokens;
      std::vector<float> head(static_cast<std::size_t>(H * nq * d));
      REQUIRE(p.dequantize(cx, keys.region, TensorView<float, 3>::contiguous(head.data(), {H, nq, d})).is_ok());
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t t = 0; t < T; ++t)
          for (std::int64_t c = 0; c < d; ++c)
            decoded[static_cast<std::size_t>((h * T + t) * d + c)] =
                t < nq ? head[static_cast<std::size_t>((h * nq + t) * d + c)] : to_float(st.residual(h, t - nq, c));
    } else {
      codes.resize(static_cast<std::size_t>(H * T * p.row_bytes(d)));
      keys.region = QuantizedKV{p.layout(), TensorView<std::uint8_t, 3>::contiguous(codes.data(), {H, T, p.row_bytes(d)}), {}, T};
      typename P::State st{};
      REQUIRE(p.quantize(cx, rows, st, keys.region).is_ok());
      REQUIRE(p.dequantize(cx, keys.region, TensorView<float, 3>::contiguous(decoded.data(), {H, T, d})).is_ok());
    }
  }
  ScoreInput<float, float> decoded_input(const Fixture& f) const {
    return ScoreInput<float, float>{f.queries(), KVSource<float>::from(TensorView<const float, 3>::contiguous(decoded.data(), {H, T, d}))};
  }
};

/// The same input with every view (queries, codes, scales, residual) tagged as the emulated device's memory.
QuantScoreInput<float> on_emulated_device(QuantScoreInput<float> in) {
  const auto tag = [](auto v) { return decltype(v)(v.data(), v.extents(), v.strides(), kvp_test::kEmulatedDevice); };
  in.queries = tag(in.queries);
  in.keys.region.codes = tag(in.keys.region.codes);
  if (in.keys.region.scales.data() != nullptr) in.keys.region.scales = tag(in.keys.region.scales);
  if (in.keys.residual_len > 0) in.keys.residual = tag(in.keys.residual);
  return in;
}

template <class Backend, class S, class In>
std::vector<float> scores_of(const S& s, const In& in, const ExecContext& exec) {
  const Requirements r = s.requirements(Context<Backend>{{}, exec}, ProblemShape{Hq, H, d, T, W});
  REQUIRE(r.status.is_ok());
  std::vector<std::byte> ws(r.workspace_bytes, kvp_test::kWorkspacePoison);
  std::vector<float> out(static_cast<std::size_t>(H * T), -1.0f);
  const Status st =
      s.score(Context<Backend>{Workspace{ws.data(), ws.size()}, exec}, in, TensorView<float, 2>::contiguous(out.data(), {H, T}));
  INFO(st.message());
  REQUIRE(st.is_ok());
  return out;
}

template <class Backend, class P, class In>
std::vector<std::int32_t> keep_of(const P& p, const In& in, const ExecContext& exec) {
  const Requirements r = p.requirements(Context<Backend>{{}, exec}, ProblemShape{Hq, H, d, T, W});
  REQUIRE(r.status.is_ok());
  std::vector<std::byte> ws(r.workspace_bytes, kvp_test::kWorkspacePoison);
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(r.output.rows + 1)), idx(static_cast<std::size_t>(r.output.capacity));
  const KeepSet keep{indptr.data(), idx.data(), r.output.rows, r.output.capacity};
  const Status st = p.evict(Context<Backend>{Workspace{ws.data(), ws.size()}, exec}, std::span<const In>(&in, 1), keep);
  INFO(st.message());
  REQUIRE(st.is_ok());
  idx.resize(static_cast<std::size_t>(indptr.back()));
  idx.insert(idx.end(), indptr.begin(), indptr.end());
  return idx;
}

template <class P>
void check_format(const P& p, const char* name) {
  INFO(name);
  const Fixture f;
  const Stored<P> stored(p, f);
  const QuantScoreInput<float> qin{f.queries(), stored.keys};
  const auto din = stored.decoded_input(f);
  ThreadPool pool(2);
  const SnapKV snap(SnapKVParams::kvpress(0.5, static_cast<std::int32_t>(W), 5));
  const QuantizedKeys<SnapKV, P> qsnap(snap, p);
  // Scores: equal to SnapKV's on the decoded keys, Scalar and Cpu, one or two threads.
  REQUIRE(scores_of<backend::Scalar>(qsnap, qin, {}) == scores_of<backend::Scalar>(snap, din, {}));
  REQUIRE(scores_of<backend::Cpu>(qsnap, qin, pool.context()) == scores_of<backend::Cpu>(snap, din, {}));
  // The device path (one head after another: decode into the workspace, SnapKV's device path) on the
  // emulated device: the same scores as the host.
  {
    using kvp_test::kEmulatedDevice;
    const QuantScoreInput<float> dev = on_emulated_device(qin);
    REQUIRE(scores_of<kvp_test::EmulatedDevice>(qsnap, dev, {}) == scores_of<backend::Scalar>(snap, din, {}));
    // Host views on the device path are refused by name.
    const Requirements r = qsnap.requirements(Context<kvp_test::EmulatedDevice>{}, ProblemShape{Hq, H, d, T, W});
    std::vector<std::byte> ws(r.workspace_bytes, kvp_test::kWorkspacePoison);
    std::vector<float> out(static_cast<std::size_t>(H * T));
    const Status host_codes =
        qsnap.score(Context<kvp_test::EmulatedDevice>{Workspace{ws.data(), ws.size()}}, QuantScoreInput<float>{dev.queries, qin.keys},
                    TensorView<float, 2>::contiguous(out.data(), {H, T}, kEmulatedDevice));
    CHECK_THAT(host_codes.message(), Catch::Matchers::Contains("keys codes is a host tensor"));
  }
  // Compositions: SnapKV's eviction (Budgeted + uniform) and Ada-KV.
  const Budgeted<QuantizedKeys<SnapKV, P>, UniformAllocation> evict(qsnap, UniformAllocation{Budget::tokens(48)});
  SnapKVParams sp = SnapKVParams::kvpress(0.5, static_cast<std::int32_t>(W), 5);
  sp.budget = Budget::tokens(48);
  REQUIRE(keep_of<backend::Cpu>(
              [&] {
                struct Wrap {
                  const Budgeted<QuantizedKeys<SnapKV, P>, UniformAllocation>& b;
                  Requirements requirements(const Context<backend::Cpu>& c, const ProblemShape& s) const noexcept {
                    return b.requirements("snapkv", c, s);
                  }
                  Status evict(const Context<backend::Cpu>& c, std::span<const QuantScoreInput<float>> in, KeepSet out) const noexcept {
                    return b.evict("snapkv", c, in, out);
                  }
                };
                return Wrap{evict};
              }(),
              qin, pool.context()) == keep_of<backend::Cpu>(SnapKV(sp), din, {}));
  AdaKVParams ap;
  ap.budget = Budget::tokens(48);
  REQUIRE(keep_of<backend::Cpu>(AdaKV<QuantizedKeys<SnapKV, P>>(ap, qsnap), qin, pool.context()) ==
          keep_of<backend::Cpu>(AdaKV<SnapKV>(ap, snap), din, {}));
  // TOVA (a scorer without a batch check): its last-query scores.
  const TOVA tova(TOVAParams::original(64));
  const QuantizedKeys<TOVA, P> qtova(tova, p);
  const auto tq = QuantScoreInput<float>{f.queries().narrow(1, W - 1, 1), stored.keys};
  auto tin = din;
  tin.queries = f.queries().narrow(1, W - 1, 1);
  const Requirements tr = tova.requirements(Context<backend::Cpu>{}, ProblemShape{Hq, H, d, T, 1});
  REQUIRE(tr.status.is_ok());
  std::vector<std::byte> tws(tr.workspace_bytes, kvp_test::kWorkspacePoison);
  std::vector<float> a(static_cast<std::size_t>(H * T)), b(a.size());
  REQUIRE(tova.score(Context<backend::Cpu>{Workspace{tws.data(), tws.size()}}, tin, TensorView<float, 2>::contiguous(a.data(), {H, T}))
              .is_ok());
  const Requirements qr = qtova.requirements(Context<backend::Cpu>{}, ProblemShape{Hq, H, d, T, 1});
  std::vector<std::byte> qws(qr.workspace_bytes, kvp_test::kWorkspacePoison);
  REQUIRE(qtova.score(Context<backend::Cpu>{Workspace{qws.data(), qws.size()}}, tq, TensorView<float, 2>::contiguous(b.data(), {H, T}))
              .is_ok());
  for (std::size_t i = 0; i < a.size(); ++i) REQUIRE(b[i] == Approx(a[i]).epsilon(1e-6));  // mean of group means
  // TOVA's device path (heads into workspace rows, one group_reduce, the mean copied into every row) on the
  // emulated device: bit-identical to the host path.
  {
    const auto on_device = scores_of<kvp_test::EmulatedDevice>(qtova, on_emulated_device(tq), {}),
               host = scores_of<backend::Scalar>(qtova, tq, {});
    REQUIRE(std::memcmp(on_device.data(), host.data(), host.size() * sizeof(float)) == 0);
    for (std::int64_t j = 0; j < T; ++j) REQUIRE(on_device[static_cast<std::size_t>(j)] == on_device[static_cast<std::size_t>(T + j)]);
  }
}

}  // namespace

TEST_CASE("quantized keys: scorers on ggml / int4 / fp8 / KIVI codes equal the scorers on the decoded keys", "[quant][policy][scoring]") {
  check_format(GgmlQuant(GgmlQuantParams{GgmlType::kQ4_0}), "q4_0");
  check_format(GgmlQuant(GgmlQuantParams{GgmlType::kQ8_0, HadamardMode::kLlamaCpp}), "q8_0 rotated");
  check_format(Int4Quant{}, "int4 llama_cpp rotation");
  check_format(Fp8Quant{}, "fp8 per token-head");
  check_format(KiviQuant(KiviQuantParams{QuantRole::kKeys, 2, 32, 64}), "kivi k2 with residual");
}

TEST_CASE("quantized keys: bad regions are rejected before anything is written", "[quant][policy][scoring][errors]") {
  const Fixture f;
  const GgmlQuant q4(GgmlQuantParams{GgmlType::kQ4_0});
  Stored<GgmlQuant> stored(q4, f);
  const QuantizedKeys<SnapKV, GgmlQuant> qs(SnapKV(SnapKVParams::kvpress(0.5, static_cast<std::int32_t>(W), 5)), q4);
  const Requirements r = qs.requirements(Context<backend::Cpu>{}, ProblemShape{Hq, H, d, T, W});
  std::vector<std::byte> ws(r.workspace_bytes, kvp_test::kWorkspacePoison);
  std::vector<float> out(static_cast<std::size_t>(H * T), -3.0f);
  const auto untouched = out;
  auto run = [&](QuantScoreInput<float> in, std::size_t ws_bytes = 0) {
    return qs.score(Context<backend::Cpu>{Workspace{ws.data(), ws_bytes ? ws_bytes : ws.size()}}, in,
                    TensorView<float, 2>::contiguous(out.data(), {H, T}));
  };
  QuantScoreInput<float> in{f.queries(), stored.keys};
  in.keys.region.layout.name = "q8_0";
  REQUIRE_THAT(run(in).message(), Contains("layout is 'q8_0', the quantizer's is 'q4_0'"));
  in = QuantScoreInput<float>{f.queries(), stored.keys};
  in.keys.dim = 32;
  REQUIRE_THAT(run(in).message(), Contains("codes is (2, 200, 36), expected (kv_heads, >= 200 tokens, 18 bytes)"));
  in = QuantScoreInput<float>{f.queries(), stored.keys};
  in.keys.residual_len = 3;
  REQUIRE_THAT(run(in).message(), Contains("a residual is KIVI's"));
  in = QuantScoreInput<float>{f.queries().narrow(1, 0, 8), stored.keys};
  REQUIRE_THAT(run(in).message(), Contains("snapkv: queries has 8 rows per head, expected window=16"));
  in = QuantScoreInput<float>{f.queries(), stored.keys};
  REQUIRE_THAT(run(in, 64).message(), Contains("workspace"));
  REQUIRE(out == untouched);
}
