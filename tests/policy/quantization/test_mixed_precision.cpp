// MixedPrecision<S, Q>: the byte budget's split into full-precision and
// quantized tokens, the tiers by the scorer's ranking (ties by position),
// full_share = 1 equal to plain top-k eviction at the same bytes, and bad input.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <set>
#include <vector>

#include "../emulated_device.hpp"
#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "kvpolicy/policy/quantization/ggml_quant.hpp"
#include "kvpolicy/policy/quantization/int4_quant.hpp"
#include "kvpolicy/policy/quantization/mixed_precision.hpp"

using namespace kvpolicy;
using Catch::Matchers::Contains;

namespace {
struct Data {
  std::int64_t Hq = 4, H = 2, T = 100, d = 64, w = 8;
  std::vector<float> q, k;
  Data() : q(static_cast<std::size_t>(Hq * w * d)), k(static_cast<std::size_t>(H * T * d)) {
    std::mt19937 rng(9);
    std::normal_distribution<float> nd;
    for (auto& v : q) v = nd(rng);
    for (auto& v : k) v = nd(rng);
  }
  ScoreInput<float, float> input() const {
    ScoreInput<float, float> in;
    in.queries = TensorView<const float, 3>::contiguous(q.data(), {Hq, w, d});
    in.keys = KVSource<float>::from(TensorView<const float, 3>::contiguous(k.data(), {H, T, d}));
    return in;
  }
};
}  // namespace

TEST_CASE("mixed precision: budget split, tiers by the scorer's ranking, full_share = 1 is eviction", "[quant][policy][mixed]") {
  const Data D;
  const auto in = D.input();
  const SnapKV snap(SnapKVParams::kvpress(0.5, 8, 5));
  const GgmlQuant q4(GgmlQuantParams{GgmlType::kQ4_0});
  const MixedPrecision<SnapKV, GgmlQuant> mp(snap, q4, MixedPrecisionParams{0.1, 0.0, 0.5});
  // fp32 keys: Bf = 256 bytes, q4_0 Bq = 36; budget 0.1 * 100 * 256 = 2560 -> 5 full, (2560 - 1280) / 36 -> 35 low.
  const MixedSplit sp = mp.split(D.T, D.d, sizeof(float));
  REQUIRE((sp.full == 5 && sp.low == 35));
  REQUIRE(mp.split(D.T, D.d, sizeof(half)).full == 5);  // fp16 cache: the same share in half the bytes
  const Context<backend::Cpu> probe{};
  const ProblemShape shape{D.Hq, D.H, D.d, D.T, 1};
  const Requirements r = mp.requirements(probe, shape);
  REQUIRE(r.status.is_ok());
  std::vector<std::byte> ws(r.workspace_bytes, kvp_test::kWorkspacePoison);
  const Context<backend::Cpu> cx{Workspace{ws.data(), ws.size()}};
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(D.H + 1)), idx(static_cast<std::size_t>(D.H * 40));
  std::vector<std::uint8_t> full(idx.size(), 7);
  const KeepSet keep{indptr.data(), idx.data(), D.H, static_cast<std::int64_t>(idx.size())};
  REQUIRE(mp.decide(cx, in, keep, full).is_ok());
  // Reference ranking from the scorer's own scores.
  std::vector<float> scores(static_cast<std::size_t>(D.H * D.T));
  std::vector<std::byte> sws(snap.requirements(probe, shape).workspace_bytes, kvp_test::kWorkspacePoison);
  REQUIRE(
      snap.score(Context<backend::Cpu>{Workspace{sws.data(), sws.size()}}, in, TensorView<float, 2>::contiguous(scores.data(), {D.H, D.T}))
          .is_ok());
  for (std::int64_t h = 0; h < D.H; ++h) {
    std::vector<std::int32_t> order(static_cast<std::size_t>(D.T));
    for (std::int32_t j = 0; j < D.T; ++j) order[static_cast<std::size_t>(j)] = j;
    const float* s = scores.data() + h * D.T;
    std::stable_sort(order.begin(), order.end(), [s](std::int32_t a, std::int32_t b) { return s[a] > s[b]; });
    const std::set<std::int32_t> want_full(order.begin(), order.begin() + 5), want_low(order.begin() + 5, order.begin() + 40);
    std::set<std::int32_t> got_full, got_low;
    REQUIRE(indptr[static_cast<std::size_t>(h + 1)] - indptr[static_cast<std::size_t>(h)] == 40);
    for (std::int32_t i = indptr[static_cast<std::size_t>(h)]; i < indptr[static_cast<std::size_t>(h + 1)]; ++i) {
      if (i > indptr[static_cast<std::size_t>(h)]) REQUIRE(idx[static_cast<std::size_t>(i)] > idx[static_cast<std::size_t>(i - 1)]);
      REQUIRE(full[static_cast<std::size_t>(i)] <= 1);
      (full[static_cast<std::size_t>(i)] ? got_full : got_low).insert(idx[static_cast<std::size_t>(i)]);
    }
    REQUIRE(got_full == want_full);
    REQUIRE(got_low == want_low);
    // SnapKV's window is protected (+inf): its first 5 positions are the full-precision tier.
    REQUIRE(got_full == std::set<std::int32_t>{92, 93, 94, 95, 96});
  }
  // full_share = 1: every byte on full precision, equal to SnapKV's top-k at the same bytes (10 tokens).
  const MixedPrecision<SnapKV, GgmlQuant> evict_only(snap, q4, MixedPrecisionParams{0.1, 0.0, 1.0});
  REQUIRE((evict_only.split(D.T, D.d, 4).full == 10 && evict_only.split(D.T, D.d, 4).low == 0));
  std::vector<std::int32_t> i2(static_cast<std::size_t>(D.H * 10)), p2(static_cast<std::size_t>(D.H + 1));
  std::vector<std::uint8_t> f2(i2.size());
  REQUIRE(evict_only.decide(cx, in, KeepSet{p2.data(), i2.data(), D.H, D.H * 10}, f2).is_ok());
  SnapKVParams sp10 = SnapKVParams::kvpress(0.5, 8, 5);
  sp10.budget = Budget::tokens(10);
  const SnapKV snap10(sp10);
  std::vector<std::byte> ews(snap10.requirements(probe, shape).workspace_bytes, kvp_test::kWorkspacePoison);
  std::vector<std::int32_t> i3(i2.size()), p3(p2.size());
  REQUIRE(snap10
              .evict(Context<backend::Cpu>{Workspace{ews.data(), ews.size()}}, std::span<const ScoreInput<float, float>>(&in, 1),
                     KeepSet{p3.data(), i3.data(), D.H, D.H * 10})
              .is_ok());
  REQUIRE(i2 == i3);
  REQUIRE(std::all_of(f2.begin(), f2.end(), [](std::uint8_t f) { return f == 1; }));
  // full_share = 0: evict -> quantize, every kept token low precision (2560 / 36 = 71 tokens of INT4 at 40 bytes: 64).
  const MixedPrecision<SnapKV, Int4Quant> all_low(snap, Int4Quant{}, MixedPrecisionParams{0.1, 0.0, 0.0});
  REQUIRE((all_low.split(D.T, D.d, 4).full == 0 && all_low.split(D.T, D.d, 4).low == 64));
  // Every token fits: the spare bytes go to precision. ratio 0.5: 12800 bytes; 100 tokens at q4_0 = 3600;
  // (12800 - 3600) / (256 - 36) = 41 full, 59 quantized; ratio 1: all 100 full.
  const MixedPrecision<SnapKV, GgmlQuant> roomy(snap, q4, MixedPrecisionParams{0.5, 0.0, 0.1});
  REQUIRE((roomy.split(D.T, D.d, 4).full == 41 && roomy.split(D.T, D.d, 4).low == 59));
  const MixedPrecision<SnapKV, GgmlQuant> whole(snap, q4, MixedPrecisionParams{1.0, 0.0, 0.1});
  REQUIRE((whole.split(D.T, D.d, 4).full == 100 && whole.split(D.T, D.d, 4).low == 0));
}

TEST_CASE("mixed precision: bad input is rejected by name and nothing is written", "[quant][policy][mixed][errors]") {
  const Data D;
  const auto in = D.input();
  const SnapKV snap(SnapKVParams::kvpress(0.5, 8, 5));
  const GgmlQuant q4(GgmlQuantParams{GgmlType::kQ4_0});
  REQUIRE_THAT((MixedPrecision<SnapKV, GgmlQuant>(snap, q4, MixedPrecisionParams{0.0})).validate_params().message(),
               Contains("ratio is 0, must be in (0, 1]"));
  REQUIRE_THAT((MixedPrecision<SnapKV, GgmlQuant>(snap, q4, MixedPrecisionParams{0.5, 0.0, 1.5})).validate_params().message(),
               Contains("full_share is 1.5"));
  const MixedPrecision<SnapKV, GgmlQuant> mp(snap, q4, MixedPrecisionParams{0.1, 0.0, 0.5});
  const ProblemShape shape{D.Hq, D.H, D.d, D.T, 1};
  const Requirements r = mp.requirements(Context<backend::Cpu>{}, shape);
  std::vector<std::byte> ws(r.workspace_bytes, kvp_test::kWorkspacePoison);
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(D.H + 1), -5), idx(static_cast<std::size_t>(D.H * 40), -5);
  std::vector<std::uint8_t> full(idx.size(), 7);
  const auto before_idx = idx;
  const Context<backend::Cpu> cx{Workspace{ws.data(), ws.size()}};
  REQUIRE_THAT(mp.decide(cx, in, KeepSet{indptr.data(), idx.data(), D.H, 79}, full).message(), Contains("capacity is 79, needs 80"));
  REQUIRE_THAT(mp.decide(cx, in, KeepSet{indptr.data(), idx.data(), D.H, 80}, std::span<std::uint8_t>(full.data(), 10)).message(),
               Contains("full has 10 entries, needs 80"));
  REQUIRE_THAT(mp.decide(Context<backend::Cpu>{Workspace{ws.data(), 64}}, in, KeepSet{indptr.data(), idx.data(), D.H, 80}, full).message(),
               Contains("workspace"));
  auto bad = D;
  bad.k[5] = std::numeric_limits<float>::quiet_NaN();
  const Status nan = mp.decide(cx, bad.input(), KeepSet{indptr.data(), idx.data(), D.H, 80}, full);
  REQUIRE_FALSE(nan.is_ok());
  REQUIRE(idx == before_idx);
  REQUIRE(std::all_of(full.begin(), full.end(), [](std::uint8_t f) { return f == 7; }));
  REQUIRE(std::all_of(indptr.begin(), indptr.end(), [](std::int32_t v) { return v == -5; }));
}

TEST_CASE("mixed precision: rank_tiers ranks score descending then position ascending, -0 == +0, NaN last", "[quant][policy][mixed][ops]") {
  std::mt19937 rng(12);
  const float values[] = {1.0f,
                          1.0f,
                          -0.0f,
                          0.0f,
                          2.5f,
                          -3.0f,
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(),
                          0.5f};
  std::uniform_int_distribution<int> pick(0, 9);
  const std::int64_t rows = 3, n = 57, ld = 64;
  std::vector<float> s(static_cast<std::size_t>(rows * ld), 99.0f);  // padding past n is never read
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t i = 0; i < n; ++i) s[static_cast<std::size_t>(r * ld + i)] = values[pick(rng)];
  // Brute force: a stable sort on (number, NaN last); -0 and +0 compare equal as numbers.
  const auto ranked = [&](std::int64_t r) {
    std::vector<std::int32_t> order(static_cast<std::size_t>(n));
    for (std::int32_t i = 0; i < n; ++i) order[static_cast<std::size_t>(i)] = i;
    const float* row = s.data() + r * ld;
    std::stable_sort(order.begin(), order.end(), [row](std::int32_t a, std::int32_t b) {
      if (std::isnan(row[a]) || std::isnan(row[b])) return !std::isnan(row[a]) && std::isnan(row[b]);
      return row[a] > row[b];
    });
    return order;
  };
  std::vector<std::byte> ws(backend::Scalar::rank_tiers_workspace(n), kvp_test::kWorkspacePoison);
  for (const auto& [keep, full] : {std::pair<std::int64_t, std::int64_t>{0, 0}, {1, 0}, {1, 1}, {20, 7}, {57, 57}, {57, 0}, {30, 30}}) {
    INFO("keep " << keep << " full " << full);
    std::vector<std::int32_t> idx(static_cast<std::size_t>(rows * 60), -1);
    std::vector<std::uint8_t> tier(idx.size(), 7);
    backend::Scalar::rank_tiers(s.data(), rows, n, ld, keep, full, idx.data(), tier.data(), 60, Workspace{ws.data(), ws.size()});
    for (std::int64_t r = 0; r < rows; ++r) {
      const auto order = ranked(r);
      std::vector<std::int32_t> want(order.begin(), order.begin() + keep);
      std::sort(want.begin(), want.end());
      const std::set<std::int32_t> want_full(order.begin(), order.begin() + full);
      for (std::int64_t k = 0; k < keep; ++k) {
        REQUIRE(idx[static_cast<std::size_t>(r * 60 + k)] == want[static_cast<std::size_t>(k)]);
        REQUIRE(tier[static_cast<std::size_t>(r * 60 + k)] == (want_full.count(want[static_cast<std::size_t>(k)]) ? 1 : 0));
      }
      REQUIRE(idx[static_cast<std::size_t>(r * 60 + keep)] == -1);  // nothing past n_keep is written
    }
  }
}

TEST_CASE("mixed precision: the device path (scores and tiers on the device backend) equals the host path",
          "[quant][policy][mixed][device]") {
  using kvp_test::EmulatedDevice;
  using kvp_test::kEmulatedDevice;
  const Data D;
  const SnapKV snap(SnapKVParams::kvpress(0.5, 8, 5));
  for (const double share : {0.0, 0.5, 1.0}) {
    INFO("full_share " << share);
    const MixedPrecision<SnapKV, GgmlQuant> mp(snap, GgmlQuant(GgmlQuantParams{GgmlType::kQ4_0}), MixedPrecisionParams{0.1, 0.0, share});
    const ProblemShape shape{D.Hq, D.H, D.d, D.T, D.w};
    const Requirements hr = mp.requirements(Context<backend::Scalar>{}, shape), dr = mp.requirements(Context<EmulatedDevice>{}, shape);
    REQUIRE((hr.status.is_ok() && dr.status.is_ok()));
    const MixedSplit sp = mp.split(D.T, D.d, sizeof(float));
    const std::int64_t n = sp.full + sp.low;
    std::vector<std::byte> hws(hr.workspace_bytes, kvp_test::kWorkspacePoison), dws(dr.workspace_bytes, kvp_test::kWorkspacePoison);
    std::vector<std::int32_t> hp(static_cast<std::size_t>(D.H + 1)), dp(hp.size()), hi(static_cast<std::size_t>(D.H * n)),
        di(hi.size(), -1);
    std::vector<std::uint8_t> hf(hi.size()), df(hi.size(), 7);
    REQUIRE(
        mp.decide(Context<backend::Scalar>{Workspace{hws.data(), hws.size()}}, D.input(), KeepSet{hp.data(), hi.data(), D.H, D.H * n}, hf)
            .is_ok());
    ScoreInput<float, float> din;
    din.queries = TensorView<const float, 3>::contiguous(D.q.data(), {D.Hq, D.w, D.d}, kEmulatedDevice);
    din.keys = KVSource<float>::from(TensorView<const float, 3>::contiguous(D.k.data(), {D.H, D.T, D.d}, kEmulatedDevice));
    const Status s =
        mp.decide(Context<EmulatedDevice>{Workspace{dws.data(), dws.size()}}, din, KeepSet{dp.data(), di.data(), D.H, D.H * n}, df);
    INFO(s.message());
    REQUIRE(s.is_ok());
    REQUIRE(dp == hp);
    REQUIRE(di == hi);
    REQUIRE(df == hf);
  }
}
