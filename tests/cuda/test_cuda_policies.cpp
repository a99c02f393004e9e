// Policies on `backend::Cuda` against the same policies on `backend::Scalar`,
// on a GPU: the contract-form ops (pool1d, group_reduce, widen_queries,
// gather_rows, iota, fill, copy_strided) bit-identical, SnapKV's scores within
// 1e-5 relative and its kept sets exact (a difference is accepted only between
// tokens whose reference scores tie to 1e-5), StreamingLLM exact, and SnapKV
// captured in a CUDA graph and replayed on changed keys.
//
// Own main: without a usable CUDA device the program prints "SKIPPED: ..."
// and exits with 77, which ctest reports as skipped.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <span>
#include <vector>

#include "cuda_test_util.hpp"
#include "kvpolicy/backends/cuda.hpp"
#include "kvpolicy/kvpolicy.hpp"
#include "../policy/keep_set_buffer.hpp"
#include "../policy/policy_test_util.hpp"
#include "../policy/selection/quest_fixture.hpp"

namespace kvp = kvpolicy;
using kvp::backend::Cuda;
using kvp::backend::Scalar;
using kvp_cuda_test::DeviceBuffer;
using kvp_cuda_test::run_ops;
using kvp_cuda_test::Stream;

static_assert(kvp::ScoreOps<Cuda, float> && kvp::ScoreOps<Cuda, kvp::half> && kvp::ScoreOps<Cuda, kvp::bfloat16>,
              "backend::Cuda models the score-op family for every key dtype");
static_assert(kvp::QuantOps<Cuda, float> && kvp::QuantOps<Cuda, kvp::half> && kvp::QuantOps<Cuda, kvp::bfloat16>,
              "backend::Cuda models the quantization-op family for every element type");

namespace {

template <class T>
std::vector<T> random_vector(std::size_t n, std::uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<T> v(n);
  for (auto& x : v) x = kvp::from_float<T>(nd(rng));  // half / bfloat16: round to nearest even
  return v;
}

/// Scores with exact ties, zeros, infinities and NaN: the pooling / reduction edge cases.
std::vector<float> edge_scores(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> pick(0, 15);
  std::vector<float> v(n);
  for (auto& x : v) {
    const int p = pick(rng);
    x = p < 10   ? static_cast<float>(rng() % 1000) * 1e-3f
        : p < 13 ? 0.25f
        : p < 14 ? -0.0f
        : p < 15 ? std::numeric_limits<float>::infinity()
                 : std::numeric_limits<float>::quiet_NaN();
  }
  return v;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) && std::isnan(b[i])) continue;
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("cuda contract ops: pool1d and group_reduce are bit-identical to Scalar", "[cuda][ops]") {
  Stream st;
  for (const std::int64_t n : {1, 2, 7, 100, 1031}) {
    const auto in = edge_scores(static_cast<std::size_t>(4 * n), static_cast<std::uint32_t>(n));
    DeviceBuffer din(in), dout(in.size() * sizeof(float));
    for (const kvp::Pooling kind : {kvp::Pooling::kNone, kvp::Pooling::kAvg, kvp::Pooling::kMax})
      for (const int kernel : {1, 3, 5, 7, 65, 129}) {
        INFO("n=" << n << " kind=" << static_cast<int>(kind) << " kernel=" << kernel);
        std::vector<float> want(static_cast<std::size_t>(n));
        Scalar::pool1d(in.data(), n, kernel, kind, want.data());
        run_ops(st, [&] { Cuda::pool1d(din.get<float>(), n, kernel, kind, dout.get<float>()); });
        REQUIRE(same_bits(dout.download<float>(static_cast<std::size_t>(n)), want));
      }
    for (const kvp::GroupReduce kind : {kvp::GroupReduce::kMean, kvp::GroupReduce::kMax, kvp::GroupReduce::kSum})
      for (const std::int64_t g : {1, 2, 4}) {
        INFO("n=" << n << " group=" << g << " kind=" << static_cast<int>(kind));
        std::vector<float> want(static_cast<std::size_t>(n));
        Scalar::group_reduce(in.data(), g, n, n, kind, want.data());
        run_ops(st, [&] { Cuda::group_reduce(din.get<float>(), g, n, n, kind, dout.get<float>()); });
        REQUIRE(same_bits(dout.download<float>(static_cast<std::size_t>(n)), want));
      }
  }
}

TEMPLATE_TEST_CASE("cuda contract ops: widen_queries and gather_rows are exact", "[cuda][ops]", float, kvp::half, kvp::bfloat16) {
  Stream st;
  // Queries (H=6, q_len=9, d=40) stored with padded strides.
  const std::int64_t H = 6, Q = 9, d = 40, s1 = 48, s0 = Q * s1;
  const auto q = random_vector<TestType>(static_cast<std::size_t>(H * s0), 7);
  DeviceBuffer dq(q);
  const kvp::TensorView<const TestType, 3> hv(q.data(), {H, Q, d}, {s0, s1, 1}), dv(dq.get<const TestType>(), {H, Q, d}, {s0, s1, 1});
  std::vector<float> want(static_cast<std::size_t>(3 * 5 * d));
  Scalar::widen_queries(hv, 2, 3, 3, 5, want.data());
  DeviceBuffer dout(want.size() * sizeof(float));
  run_ops(st, [&] { Cuda::widen_queries(dv, 2, 3, 3, 5, dout.get<float>()); });
  REQUIRE(same_bits(dout.download<float>(want.size()), want));

  const std::vector<std::int32_t> idx{5, 0, 53, 5, 17};
  DeviceBuffer didx(idx);
  const kvp::Rows<TestType> hrows{q.data(), s1}, drows{dq.get<const TestType>(), s1};
  std::vector<TestType> gwant(idx.size() * 64);
  Scalar::gather_rows(hrows, idx.data(), 5, d, gwant.data(), 64);
  DeviceBuffer dg(gwant);  // same padding contents
  run_ops(st, [&] { Cuda::gather_rows(drows, didx.get<const std::int32_t>(), 5, d, dg.get<TestType>(), 64); });
  const auto got = dg.download<TestType>(gwant.size());
  REQUIRE(std::memcmp(got.data(), gwant.data(), gwant.size() * sizeof(TestType)) == 0);
}

TEST_CASE("cuda contract ops: iota, fill and copy_strided write exactly their elements", "[cuda][ops]") {
  Stream st;
  DeviceBuffer di(std::vector<std::int32_t>(64, -7));
  DeviceBuffer df(std::vector<float>(64, -7.0f));
  run_ops(st, [&] {
    Cuda::iota(di.get<std::int32_t>() + 3, 100, 20);
    Cuda::fill(df.get<float>() + 1, 10, 3, std::numeric_limits<float>::infinity());
    Cuda::copy_strided(df.get<float>() + 40, 5, df.get<float>() + 2, 3);
  });
  const auto gi = di.download<std::int32_t>(64);
  for (int i = 0; i < 64; ++i) REQUIRE(gi[i] == (i >= 3 && i < 23 ? 100 + i - 3 : -7));
  const auto gf = df.download<float>(64);
  for (int i = 0; i < 64; ++i) {
    INFO(i);
    if (i >= 1 && i < 31 && (i - 1) % 3 == 0)
      REQUIRE(std::isinf(gf[i]));
    else if (i >= 2 && i < 17 && (i - 2) % 3 == 0)
      REQUIRE(gf[i] == -7.0f);  // copied from the untouched tail
    else
      REQUIRE(gf[i] == -7.0f);
  }
}

namespace {

constexpr kvp::Device kGpu{kvp::DeviceType::kCUDA, 0};

/// One SnapKV problem: queries (Hq, w, d) fp32 and keys (Hkv, T, d) of type Tk, on host and device.
template <class Tk>
struct SnapProblem {
  std::int64_t Hq, Hkv, d, T, w;
  std::vector<float> q;
  std::vector<Tk> k;
  DeviceBuffer dq, dk;
  SnapProblem(std::int64_t hq, std::int64_t hkv, std::int64_t dd, std::int64_t t, std::int64_t ww, std::uint32_t seed)
      : Hq(hq),
        Hkv(hkv),
        d(dd),
        T(t),
        w(ww),
        q(random_vector<float>(static_cast<std::size_t>(hq * ww * dd), seed)),
        k(random_vector<Tk>(static_cast<std::size_t>(hkv * t * dd), seed + 1)),
        dq(q),
        dk(k) {}
  std::int64_t lookahead = 0;  ///< of the w query rows, the last `lookahead` are lookahead rows
  kvp::ScoreInput<float, Tk> host() const {
    kvp::ScoreInput<float, Tk> in{kvp::TensorView<const float, 3>::contiguous(q.data(), {Hq, w, d}),
                                  kvp::KVSource<Tk>::from(kvp::TensorView<const Tk, 3>::contiguous(k.data(), {Hkv, T, d}))};
    in.lookahead = lookahead;
    return in;
  }
  kvp::ScoreInput<float, Tk> device() const {
    kvp::ScoreInput<float, Tk> in{kvp::TensorView<const float, 3>::contiguous(dq.get<const float>(), {Hq, w, d}, kGpu),
                                  kvp::KVSource<Tk>::from(kvp::TensorView<const Tk, 3>::contiguous(dk.get<const Tk>(), {Hkv, T, d}, kGpu))};
    in.lookahead = lookahead;
    return in;
  }
};

/// Kept sets equal, or differing only between tokens whose reference scores tie within 1e-5 relative.
void require_same_keep(const std::vector<std::int32_t>& got, const std::vector<std::int32_t>& want, const std::vector<float>& ref_scores) {
  REQUIRE(got.size() == want.size());
  if (got == want) return;
  std::set<std::int32_t> g(got.begin(), got.end()), w(want.begin(), want.end());
  REQUIRE(g.size() == got.size());
  std::vector<std::int32_t> only_g, only_w;
  std::set_difference(g.begin(), g.end(), w.begin(), w.end(), std::back_inserter(only_g));
  std::set_difference(w.begin(), w.end(), g.begin(), g.end(), std::back_inserter(only_w));
  REQUIRE(only_g.size() == only_w.size());
  for (std::size_t i = 0; i < only_g.size(); ++i) {
    const float a = ref_scores[static_cast<std::size_t>(only_g[i])], b = ref_scores[static_cast<std::size_t>(only_w[i])];
    INFO("token " << only_g[i] << " kept on the device, " << only_w[i] << " by the reference: " << a << " vs " << b);
    REQUIRE(std::fabs(a - b) <= 1e-5f * std::max(std::fabs(a), std::fabs(b)));
  }
}

/// Any scorer + evictor on Cuda vs Scalar: scores within 1e-5 relative (bit-identical when `exact`),
/// kept sets exact up to reference-score ties.
template <class Policy, class In>
void check_scorer(const Policy& policy, const In& hin, const In& din, const kvp::ProblemShape& shape, bool exact) {
  const std::int64_t Hkv = shape.num_kv_heads, T = shape.max_kv_len;
  const auto hreq = policy.requirements(kvp::Context<Scalar>{}, shape);
  KVP_REQUIRE_OK(hreq.status);
  std::vector<std::byte> hws(hreq.workspace_bytes);
  const kvp::Context<Scalar> hcx{kvp::Workspace{hws.data(), hws.size()}};
  std::vector<float> ref(static_cast<std::size_t>(Hkv * T));
  KVP_REQUIRE_OK(policy.score(hcx, hin, kvp::TensorView<float, 2>::contiguous(ref.data(), {Hkv, T})));
  kvp_test::KeepSetBuffer want(hreq.output.rows, hreq.output.capacity);
  KVP_REQUIRE_OK(policy.evict(hcx, hin, want.view()));

  Stream st;
  const auto dreq = policy.requirements(kvp::Context<Cuda>{}, shape);
  KVP_REQUIRE_OK(dreq.status);
  DeviceBuffer dws(dreq.workspace_bytes), dscores(ref.size() * sizeof(float));
  const kvp::Context<Cuda> dcx{dws.workspace(), {}, st.s};
  KVP_REQUIRE_OK(policy.score(dcx, din, kvp::TensorView<float, 2>::contiguous(dscores.get<float>(), {Hkv, T}, kGpu)));
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(dreq.output.rows + 1));
  DeviceBuffer dind(static_cast<std::size_t>(std::max<std::int64_t>(dreq.output.capacity, 1)) * sizeof(std::int32_t));
  KVP_REQUIRE_OK(policy.evict(dcx, din, kvp::KeepSet{indptr.data(), dind.get<std::int32_t>(), dreq.output.rows, dreq.output.capacity}));
  st.sync();
  const auto got = dscores.download<float>(ref.size());
  if (exact) {
    REQUIRE(same_bits(got, ref));
  } else {
    for (std::size_t i = 0; i < ref.size(); ++i) {
      INFO("score " << i << ": " << got[i] << " vs " << ref[i]);
      if (std::isinf(ref[i]))
        REQUIRE(got[i] == ref[i]);
      else
        REQUIRE(std::fabs(got[i] - ref[i]) <= 1e-5f * std::fabs(ref[i]) + 1e-12f);
    }
  }
  REQUIRE(indptr == want.indptr);
  const auto ids = dind.download<std::int32_t>(static_cast<std::size_t>(indptr.back()));
  for (std::int64_t r = 0; r < dreq.output.rows; ++r) {
    INFO("row " << r);
    std::vector<float> head(ref.begin() + (r % Hkv) * T, ref.begin() + (r % Hkv + 1) * T);
    require_same_keep(
        std::vector<std::int32_t>(ids.begin() + indptr[static_cast<std::size_t>(r)], ids.begin() + indptr[static_cast<std::size_t>(r + 1)]),
        want.row(r), head);
  }
}

/// A query-window policy (SnapKV, LAQ) on `rows` query rows per head, the last `lookahead` of them lookahead rows.
template <class Tk, class Policy>
void check_window_policy(const Policy& policy, std::int64_t Hq, std::int64_t Hkv, std::int64_t d, std::int64_t T, std::int64_t rows,
                         std::int64_t lookahead, std::uint32_t seed) {
  SnapProblem<Tk> p(Hq, Hkv, d, T, rows, seed);
  p.lookahead = lookahead;
  check_scorer(policy, p.host(), p.device(), kvp::ProblemShape{Hq, Hkv, d, T, rows}, false);
}

template <class Tk>
void check_snapkv(const kvp::SnapKVParams& params, std::int64_t Hq, std::int64_t Hkv, std::int64_t d, std::int64_t T, std::uint32_t seed) {
  check_window_policy<Tk>(kvp::SnapKV(params), Hq, Hkv, d, T, params.window, 0, seed);
}

}  // namespace

TEMPLATE_TEST_CASE("cuda SnapKV: scores and kept sets match Scalar", "[cuda][snapkv]", float, kvp::half, kvp::bfloat16) {
  // kvpress defaults (window 64, avg pool 5, pool-then-group mean) on a GQA-4 shape.
  check_snapkv<TestType>(kvp::SnapKVParams::kvpress(0.5, 64, 5), 8, 2, 64, 700, 11);
  // The original (window 32, max pool 7, group mean first, sum over the window), capacity 128.
  check_snapkv<TestType>(kvp::SnapKVParams::original(128, 32, 7), 4, 4, 128, 513, 12);
  // Keep everything: the kept rows are plain iota on the device.
  check_snapkv<TestType>(kvp::SnapKVParams::kvpress(0.0, 16, 5), 2, 1, 32, 40, 13);
}

TEMPLATE_TEST_CASE("cuda SnapKV with lookahead rows and LAQ / LAQ++ (stage 2): scores and kept sets match Scalar", "[cuda][laq]", float,
                   kvp::half, kvp::bfloat16) {
  for (const kvp::LookaheadMask mask : {kvp::LookaheadMask::kReference, kvp::LookaheadMask::kCorrected}) {
    INFO("mask " << static_cast<int>(mask));
    kvp::SnapKVParams la = kvp::SnapKVParams::kvpress(0.6, 32, 5);
    la.lookahead_mask = mask;
    check_window_policy<TestType>(kvp::SnapKV(la), 8, 2, 64, 700, 32 + 8, 8, 31);
    kvp::LAQParams laq = kvp::LAQParams::laq(128);
    laq.mask = mask;
    check_window_policy<TestType>(kvp::LAQ(laq), 8, 2, 64, 700, 8, 8, 32);  // W2 = 0: the pseudo queries alone
    check_window_policy<TestType>(kvp::LAQ(laq), 8, 2, 64, 700, 3, 3, 33);  // 3 pseudo tokens (EOS)
    kvp::LAQParams pp = kvp::LAQParams::laq_plus_plus(160);
    pp.mask = mask;
    check_window_policy<TestType>(kvp::LAQ(pp), 4, 4, 128, 513, 8 + 8, 8, 34);
  }
}

TEST_CASE("cuda StreamingLLM: kept sets are exact", "[cuda][streaming]") {
  const kvp::StreamingLLM policy(kvp::StreamingLLMParams{4, kvp::Budget::tokens(100), 0});
  const std::int64_t H = 3, T = 1000, d = 8;
  std::vector<float> k(static_cast<std::size_t>(H * T * d), 0.0f);
  DeviceBuffer dk(k);
  const kvp::ScoreInput<float, float> din{
      {}, kvp::KVSource<float>::from(kvp::TensorView<const float, 3>::contiguous(dk.get<const float>(), {H, T, d}, kGpu))};
  const kvp::ScoreInput<float, float> hin{{}, kvp::KVSource<float>::from(kvp::TensorView<const float, 3>::contiguous(k.data(), {H, T, d}))};
  kvp_test::KeepSetBuffer want(H, H * 100);
  KVP_REQUIRE_OK(policy.evict(kvp::Context<Scalar>{}, hin, want.view()));
  Stream st;
  std::vector<std::int32_t> indptr(H + 1);
  DeviceBuffer dind(static_cast<std::size_t>(H * 100) * sizeof(std::int32_t));
  KVP_REQUIRE_OK(policy.evict(kvp::Context<Cuda>{{}, {}, st.s}, din, kvp::KeepSet{indptr.data(), dind.get<std::int32_t>(), H, H * 100}));
  st.sync();
  const auto got = dind.download<std::int32_t>(static_cast<std::size_t>(H * 100));
  for (std::int64_t r = 0; r < H; ++r) {
    const auto wrow = want.row(r);
    REQUIRE(std::vector<std::int32_t>(got.begin() + r * 100, got.begin() + (r + 1) * 100) ==
            std::vector<std::int32_t>(wrow.begin(), wrow.end()));
  }
}

TEST_CASE("cuda SnapKV: a policy call is captured in a CUDA graph and replayed on new keys", "[cuda][graph]") {
  const kvp::SnapKV policy(kvp::SnapKVParams::kvpress(0.75, 32, 5));
  const std::int64_t Hq = 8, Hkv = 2, d = 64, T = 600, w = 32;
  SnapProblem<kvp::half> p(Hq, Hkv, d, T, w, 21);
  const auto req = policy.requirements(kvp::Context<Cuda>{}, kvp::ProblemShape{Hq, Hkv, d, T, w});
  KVP_REQUIRE_OK(req.status);
  DeviceBuffer dws(req.workspace_bytes);
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(req.output.rows + 1));
  DeviceBuffer dind(static_cast<std::size_t>(req.output.capacity) * sizeof(std::int32_t));
  const kvp::KeepSet dkeep{indptr.data(), dind.get<std::int32_t>(), req.output.rows, req.output.capacity};
  Stream st;
  const kvp::Context<Cuda> cx{dws.workspace(), {}, st.s};

  cudaGraph_t graph = nullptr;
  CUDA_REQUIRE(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeThreadLocal));
  const kvp::Status captured = policy.evict(cx, p.device(), dkeep);
  CUDA_REQUIRE(cudaStreamEndCapture(st.s, &graph));
  KVP_REQUIRE_OK(captured);
  std::size_t nodes = 0;
  CUDA_REQUIRE(cudaGraphGetNodes(graph, nullptr, &nodes));
  REQUIRE(nodes > 0);
  cudaGraphExec_t exec = nullptr;
  CUDA_REQUIRE(cudaGraphInstantiate(&exec, graph, 0));

  for (int round = 0; round < 3; ++round) {
    INFO("replay " << round);
    if (round > 0) {  // new keys in the same device buffer: the replay must see them
      p.k = random_vector<kvp::half>(p.k.size(), static_cast<std::uint32_t>(100 + round));
      p.dk.upload(p.k);
    }
    CUDA_REQUIRE(cudaGraphLaunch(exec, st.s));
    st.sync();
    const kvp::Context<Scalar> hcx{};
    const auto hreq = policy.requirements(hcx, kvp::ProblemShape{Hq, Hkv, d, T, w});
    std::vector<std::byte> hws(hreq.workspace_bytes);
    const kvp::Context<Scalar> hcx2{kvp::Workspace{hws.data(), hws.size()}};
    kvp_test::KeepSetBuffer want(hreq.output.rows, hreq.output.capacity);
    KVP_REQUIRE_OK(policy.evict(hcx2, p.host(), want.view()));
    std::vector<float> ref_scores(static_cast<std::size_t>(Hkv * T));
    KVP_REQUIRE_OK(policy.score(hcx2, p.host(), kvp::TensorView<float, 2>::contiguous(ref_scores.data(), {Hkv, T})));
    const auto got = dind.download<std::int32_t>(static_cast<std::size_t>(req.output.capacity));
    for (std::int64_t r = 0; r < Hkv; ++r) {
      const auto wrow = want.row(r);
      std::vector<float> head_scores(ref_scores.begin() + r * T, ref_scores.begin() + (r + 1) * T);
      require_same_keep(std::vector<std::int32_t>(got.begin() + indptr[static_cast<std::size_t>(r)],
                                                  got.begin() + indptr[static_cast<std::size_t>(r + 1)]),
                        std::vector<std::int32_t>(wrow.begin(), wrow.end()), head_scores);
    }
  }
  CUDA_REQUIRE(cudaGraphExecDestroy(exec));
  CUDA_REQUIRE(cudaGraphDestroy(graph));
}

namespace {

/// Random attention probabilities (rows sum to about 1) of shape (H, q, n), fp32.
std::vector<float> random_probs(std::int64_t H, std::int64_t q, std::int64_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> p(static_cast<std::size_t>(H * q * n));
  for (auto& x : p) x = u(rng) * u(rng) / static_cast<float>(n);
  return p;
}

/// One H2O state on the host (Scalar) and its twin on the device (Cuda), stepped together.
struct H2OTwin {
  kvp::H2O policy;
  std::int64_t Hs, cap;
  std::vector<float> host_scores;
  DeviceBuffer dev_scores;
  kvp::H2OState host, dev;
  DeviceBuffer dws;
  std::vector<std::byte> hws;
  H2OTwin(const kvp::H2OParams& p, std::int64_t hs, std::int64_t capacity, std::size_t ws_bytes)
      : policy(p),
        Hs(hs),
        cap(capacity),
        host_scores(static_cast<std::size_t>(hs * capacity), -1.0f),
        dev_scores(host_scores),
        dws(ws_bytes),
        hws(ws_bytes) {
    host.scores = kvp::TensorView<float, 2>::contiguous(host_scores.data(), {Hs, cap});
    dev.scores = kvp::TensorView<float, 2>::contiguous(dev_scores.get<float>(), {Hs, cap}, kGpu);
  }
  kvp::Context<Scalar> hcx() { return kvp::Context<Scalar>{kvp::Workspace{hws.data(), hws.size()}}; }
  kvp::Context<Cuda> dcx(cudaStream_t s) const { return kvp::Context<Cuda>{dws.workspace(), {}, s}; }

  /// States equal bit for bit over the slots in use.
  void require_same_state() const {
    REQUIRE(host.length == dev.length);
    REQUIRE(host.prompt_len == dev.prompt_len);
    const auto got = dev_scores.download<float>(host_scores.size());
    for (std::int64_t h = 0; h < Hs; ++h)
      for (std::int64_t j = 0; j < host.length; ++j) {
        INFO("head " << h << " slot " << j);
        REQUIRE(got[static_cast<std::size_t>(h * cap + j)] == host_scores[static_cast<std::size_t>(h * cap + j)]);
      }
  }
};

}  // namespace

TEST_CASE("cuda H2O: prefill and a decode loop from probabilities match Scalar bit for bit", "[cuda][h2o]") {
  const std::int64_t Hq = 8, Hkv = 2, T0 = 300, steps = 24;
  H2OTwin t(kvp::H2OParams::original(32, 64), Hkv, 512, std::size_t{1} << 20);
  Stream st;
  for (std::int64_t step = 0; step <= steps; ++step) {
    INFO("step " << step);
    const std::int64_t q = step == 0 ? T0 : 1, n = t.host.length + q;
    const auto probs = random_probs(Hq, q, n, static_cast<std::uint32_t>(1000 + step));
    DeviceBuffer dprobs(probs);
    if (step % 3 == 2) {  // column sums in half precision, as an engine's kernel may give them
      std::vector<kvp::half> col(static_cast<std::size_t>(Hq * n));
      for (std::size_t i = 0; i < col.size(); ++i) col[i] = kvp::to_half(probs[i] * 3.0f);
      DeviceBuffer dcol(col);
      kvp::ScoreInput<float, float, kvp::half> hin, din;
      hin.column_sums = kvp::TensorView<const kvp::half, 2>::contiguous(col.data(), {Hq, n});
      din.column_sums = kvp::TensorView<const kvp::half, 2>::contiguous(dcol.get<const kvp::half>(), {Hq, n}, kGpu);
      KVP_REQUIRE_OK(t.policy.update(t.hcx(), t.host, hin));
      KVP_REQUIRE_OK(t.policy.update(t.dcx(st.s), t.dev, din));
    } else {
      kvp::ScoreInput<float, float, float> hin, din;
      hin.attention = kvp::TensorView<const float, 3>::contiguous(probs.data(), {Hq, q, n});
      din.attention = kvp::TensorView<const float, 3>::contiguous(dprobs.get<const float>(), {Hq, q, n}, kGpu);
      KVP_REQUIRE_OK(t.policy.update(t.hcx(), t.host, hin));
      KVP_REQUIRE_OK(t.policy.update(t.dcx(st.s), t.dev, din));
    }
    st.sync();
    t.require_same_state();
    kvp_test::KeepSetBuffer want(Hkv, Hkv * t.host.length);
    KVP_REQUIRE_OK(t.policy.evict(t.hcx(), t.host, want.view()));
    std::vector<std::int32_t> indptr(static_cast<std::size_t>(Hkv + 1));
    DeviceBuffer dind(static_cast<std::size_t>(Hkv * n) * sizeof(std::int32_t));
    KVP_REQUIRE_OK(t.policy.evict(t.dcx(st.s), t.dev, kvp::KeepSet{indptr.data(), dind.get<std::int32_t>(), Hkv, Hkv * n}));
    st.sync();
    REQUIRE(indptr == want.indptr);
    const auto got = dind.download<std::int32_t>(static_cast<std::size_t>(indptr.back()));
    REQUIRE(std::equal(got.begin(), got.end(), want.indices.begin()));
    t.require_same_state();
  }
  REQUIRE(t.host.length == 96);
}

TEST_CASE("cuda H2O: one decode step (update + evict) captured in a CUDA graph and replayed", "[cuda][h2o][graph]") {
  const std::int64_t Hq = 4, Hkv = 4, C = 48;
  H2OTwin t(kvp::H2OParams::original(16, 32), Hkv, 128, std::size_t{1} << 20);  // capacity >= the 100-token prefill
  Stream st;
  // Prefill to the steady state: the cache holds C = hh + recent slots.
  const auto p0 = random_probs(Hq, 100, 100, 7);
  DeviceBuffer dp0(p0);
  kvp::ScoreInput<float, float, float> h0, d0;
  h0.attention = kvp::TensorView<const float, 3>::contiguous(p0.data(), {Hq, 100, 100});
  d0.attention = kvp::TensorView<const float, 3>::contiguous(dp0.get<const float>(), {Hq, 100, 100}, kGpu);
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(Hkv + 1));
  DeviceBuffer dind(static_cast<std::size_t>(Hkv * 100) * sizeof(std::int32_t));
  kvp_test::KeepSetBuffer want(Hkv, Hkv * 100);
  KVP_REQUIRE_OK(t.policy.update(t.hcx(), t.host, h0));
  KVP_REQUIRE_OK(t.policy.evict(t.hcx(), t.host, want.view()));
  KVP_REQUIRE_OK(t.policy.update(t.dcx(st.s), t.dev, d0));
  KVP_REQUIRE_OK(t.policy.evict(t.dcx(st.s), t.dev, kvp::KeepSet{indptr.data(), dind.get<std::int32_t>(), Hkv, Hkv * 100}));
  st.sync();
  REQUIRE(t.dev.length == C);
  t.require_same_state();

  // One decode step: probabilities (Hq, 1, C + 1) in a fixed device buffer.
  DeviceBuffer dstep(static_cast<std::size_t>(Hq * (C + 1)) * sizeof(float));
  kvp::ScoreInput<float, float, float> dstep_in;
  dstep_in.attention = kvp::TensorView<const float, 3>::contiguous(dstep.get<const float>(), {Hq, 1, C + 1}, kGpu);
  const kvp::KeepSet dkeep{indptr.data(), dind.get<std::int32_t>(), Hkv, Hkv * 100};
  cudaGraph_t graph = nullptr;
  CUDA_REQUIRE(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeThreadLocal));
  const kvp::Status su = t.policy.update(t.dcx(st.s), t.dev, dstep_in);
  const kvp::Status se = t.policy.evict(t.dcx(st.s), t.dev, dkeep);
  CUDA_REQUIRE(cudaStreamEndCapture(st.s, &graph));
  KVP_REQUIRE_OK(su);
  KVP_REQUIRE_OK(se);
  REQUIRE(t.dev.length == C);  // host bookkeeping of one step: C -> C + 1 -> C
  cudaGraphExec_t exec = nullptr;
  CUDA_REQUIRE(cudaGraphInstantiate(&exec, graph, 0));
  for (int step = 0; step < 6; ++step) {
    INFO("replay " << step);
    const auto p = random_probs(Hq, 1, C + 1, static_cast<std::uint32_t>(50 + step));
    dstep.upload(p);
    CUDA_REQUIRE(cudaGraphLaunch(exec, st.s));
    st.sync();
    kvp::ScoreInput<float, float, float> hin;
    hin.attention = kvp::TensorView<const float, 3>::contiguous(p.data(), {Hq, 1, C + 1});
    KVP_REQUIRE_OK(t.policy.update(t.hcx(), t.host, hin));
    kvp_test::KeepSetBuffer w(Hkv, Hkv * C);
    KVP_REQUIRE_OK(t.policy.evict(t.hcx(), t.host, w.view()));
    t.require_same_state();
    const auto got = dind.download<std::int32_t>(static_cast<std::size_t>(Hkv * C));
    REQUIRE(std::equal(got.begin(), got.end(), w.indices.begin()));
  }
  CUDA_REQUIRE(cudaGraphExecDestroy(exec));
  CUDA_REQUIRE(cudaGraphDestroy(graph));
}

TEST_CASE("cuda H2O: attention recomputed from queries and keys matches Scalar", "[cuda][h2o]") {
  const std::int64_t Hq = 8, Hkv = 2, d = 64, T = 200;
  H2OTwin t(kvp::H2OParams::original(24, 40), Hkv, 256, std::size_t{8} << 20);
  SnapProblem<kvp::half> p(Hq, Hkv, d, T, T, 31);  // T queries: the whole prompt
  Stream st;
  KVP_REQUIRE_OK(t.policy.update(t.hcx(), t.host, p.host()));
  KVP_REQUIRE_OK(t.policy.update(t.dcx(st.s), t.dev, p.device()));
  st.sync();
  const auto got = t.dev_scores.download<float>(t.host_scores.size());
  for (std::int64_t h = 0; h < Hkv; ++h)
    for (std::int64_t j = 0; j < T; ++j) {
      const float a = got[static_cast<std::size_t>(h * t.cap + j)], b = t.host_scores[static_cast<std::size_t>(h * t.cap + j)];
      INFO("head " << h << " slot " << j << ": " << a << " vs " << b);
      REQUIRE(std::fabs(a - b) <= 1e-5f * std::fabs(b) + 1e-7f);
    }
  kvp_test::KeepSetBuffer want(Hkv, Hkv * 64);
  KVP_REQUIRE_OK(t.policy.evict(t.hcx(), t.host, want.view()));
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(Hkv + 1));
  DeviceBuffer dind(static_cast<std::size_t>(Hkv * 64) * sizeof(std::int32_t));
  // The host's pre-eviction scores decide ties: compare against them.
  const std::vector<float> before = got;
  KVP_REQUIRE_OK(t.policy.evict(t.dcx(st.s), t.dev, kvp::KeepSet{indptr.data(), dind.get<std::int32_t>(), Hkv, Hkv * 64}));
  st.sync();
  const auto ids = dind.download<std::int32_t>(static_cast<std::size_t>(Hkv * 64));
  for (std::int64_t h = 0; h < Hkv; ++h) {
    const auto wrow = want.row(h);
    std::vector<float> head(before.begin() + h * t.cap, before.begin() + h * t.cap + T);
    require_same_keep(std::vector<std::int32_t>(ids.begin() + h * 64, ids.begin() + (h + 1) * 64), wrow, head);
  }
}

TEMPLATE_TEST_CASE("cuda TOVA: from queries and from probabilities, one-shot and one-token steps", "[cuda][tova]", float, kvp::half) {
  const std::int64_t Hq = 8, Hkv = 2, d = 64, T = 500, q = 4;
  SnapProblem<TestType> p(Hq, Hkv, d, T, q, 41);
  for (const double r : {0.5, 1.0 / static_cast<double>(T)}) {  // a half, then the online step's single eviction
    INFO("compression ratio " << r);
    const kvp::TOVA policy(kvp::TOVAParams{kvp::Budget::compression_ratio(r)});
    check_scorer(policy, p.host(), p.device(), kvp::ProblemShape{Hq, Hkv, d, T, q}, false);
    // The engine's probabilities (Hq, q, T): bit-identical scores.
    const auto probs = random_probs(Hq, q, T, 43);
    DeviceBuffer dp(probs);
    kvp::ScoreInput<float, TestType, float> hin{
        {}, kvp::KVSource<TestType>::from(kvp::TensorView<const TestType, 3>::contiguous(p.k.data(), {Hkv, T, d}))};
    kvp::ScoreInput<float, TestType, float> din{{}, p.device().keys};
    hin.attention = kvp::TensorView<const float, 3>::contiguous(probs.data(), {Hq, q, T});
    din.attention = kvp::TensorView<const float, 3>::contiguous(dp.get<const float>(), {Hq, q, T}, kGpu);
    check_scorer(policy, hin, din, kvp::ProblemShape{Hq, Hkv, 0, T, 1}, true);
  }
}

TEMPLATE_TEST_CASE("cuda ObservedAttention: from the prompt's queries and from column sums", "[cuda][observed]", float, kvp::bfloat16) {
  const std::int64_t Hq = 4, Hkv = 2, d = 32, T = 300;
  SnapProblem<TestType> p(Hq, Hkv, d, T, T, 51);
  const kvp::ObservedAttention policy(kvp::ObservedAttentionParams{});
  check_scorer(policy, p.host(), p.device(), kvp::ProblemShape{Hq, Hkv, d, T, T}, false);
  std::vector<kvp::half> col(static_cast<std::size_t>(Hq * T));
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(0.0f, 4.0f);
  for (auto& x : col) x = kvp::to_half(u(rng));
  DeviceBuffer dcol(col);
  kvp::ScoreInput<float, TestType, kvp::half> hin{{}, p.host().keys}, din{{}, p.device().keys};
  hin.column_sums = kvp::TensorView<const kvp::half, 2>::contiguous(col.data(), {Hq, T});
  din.column_sums = kvp::TensorView<const kvp::half, 2>::contiguous(dcol.get<const kvp::half>(), {Hq, T}, kGpu);
  check_scorer(policy, hin, din, kvp::ProblemShape{Hq, Hkv, 0, T, 0}, true);
}

TEMPLATE_TEST_CASE("cuda Knorm: key-norm scores bit-identical, kept sets exact", "[cuda][knorm]", float, kvp::half, kvp::bfloat16) {
  const std::int64_t Hkv = 3, d = 128, T = 777;
  SnapProblem<TestType> p(Hkv, Hkv, d, T, 1, 61);
  const kvp::Knorm policy(kvp::KnormParams{kvp::Budget::compression_ratio(0.3)});
  kvp::ScoreInput<float, TestType> hin{{}, p.host().keys}, din{{}, p.device().keys};
  check_scorer(policy, hin, din, kvp::ProblemShape{Hkv, Hkv, d, T, 0}, true);
}

namespace {

/// A Quest decode step on the host (Scalar) and its device twin: the pool's
/// metadata, the page ids and the queries on the device; table lengths and
/// the selection's row offsets on the host.
template <class Tk, class Tq>
struct QuestTwin {
  quest_test::PagedCache<Tk> cache;
  quest_test::MetaBuffer<Tk> meta;
  std::int32_t Hq;
  std::vector<Tq> q;
  DeviceBuffer dmeta, dq, dids;
  QuestTwin(std::int32_t page_size, std::int32_t Hkv, std::int32_t G, std::int32_t d, const std::vector<std::int64_t>& lens, unsigned seed)
      : cache(pool(lens, page_size), Hkv, page_size, d, kvp::PageLayout::kHND, static_cast<std::int32_t>(lens.size()), seed),
        meta(pool(lens, page_size), Hkv, d),
        Hq(Hkv * G),
        dmeta(meta.data.size() * sizeof(Tk)),
        dq(lens.size() * static_cast<std::size_t>(Hkv * G * d) * sizeof(Tq)),
        dids(std::max<std::size_t>(1, static_cast<std::size_t>(pool(lens, page_size))) * sizeof(std::int32_t)) {
    std::vector<std::int32_t> append;
    for (std::size_t b = 0; b < lens.size(); ++b) {
      cache.append_normal(static_cast<std::int32_t>(b), lens[b]);
      append.push_back(static_cast<std::int32_t>(lens[b]));
    }
    KVP_REQUIRE_OK(kvp::Quest{}.on_append(kvp::Context<Scalar>{}, kvp::AppendInput<Tk>{cache.view(), append.data()}, meta.view()));
    dmeta.upload(meta.data);
    dids.upload(cache.indices);
    new_queries(seed);
  }
  static std::int32_t pool(const std::vector<std::int64_t>& lens, std::int32_t P) {
    std::int64_t n = 2;
    for (auto l : lens) n += (l + P - 1) / P;
    return static_cast<std::int32_t>(n);
  }
  void new_queries(unsigned seed) {
    q = random_vector<Tq>(static_cast<std::size_t>(cache.batch()) * static_cast<std::size_t>(Hq * cache.head_dim), seed * 7 + 1);
    dq.upload(q);
  }
  kvp::DecodeInput<Tq> host_in(int layer) const {
    return {kvp::TensorView<const Tq, 3>::contiguous(q.data(), {cache.batch(), Hq, cache.head_dim}), cache.table(), cache.page_size, layer};
  }
  kvp::DecodeInput<Tq> dev_in(int layer) const {
    kvp::PageTable t = cache.table();
    t.indices = dids.template get<const std::int32_t>();
    return {kvp::TensorView<const Tq, 3>::contiguous(dq.template get<const Tq>(), {cache.batch(), Hq, cache.head_dim}, kGpu), t,
            cache.page_size, layer};
  }
  kvp::PageMetaView<const Tk> dev_meta() const {
    return kvp::PageMetaView<const Tk>::contiguous(dmeta.template get<const Tk>(), cache.num_pages, cache.kv_heads, cache.head_dim, kGpu);
  }
};

/// One selection on each side; rows, last-page lengths, ids and logical ids equal.
template <class Tk, class Tq>
void check_quest(const kvp::Quest& quest, QuestTwin<Tk, Tq>& tw, int layer) {
  const kvp::ProblemShape shape{.num_q_heads = tw.Hq, .num_kv_heads = tw.cache.kv_heads, .head_dim = tw.cache.head_dim};
  kvp::Quest::Plan hplan, dplan;
  KVP_REQUIRE_OK(quest.plan(kvp::Context<Scalar>{}, tw.host_in(layer), shape, hplan));
  KVP_REQUIRE_OK(quest.plan(kvp::Context<Cuda>{}, tw.dev_in(layer), shape, dplan));
  REQUIRE(dplan.requirements.output.capacity == hplan.requirements.output.capacity);
  quest_test::SelectionBuffer want(hplan.requirements.output.rows, hplan.requirements.output.capacity);
  std::vector<std::byte> hws(hplan.requirements.workspace_bytes);
  KVP_REQUIRE_OK(
      quest.select(kvp::Context<Scalar>{kvp::Workspace{hws.data(), hws.size()}}, hplan, tw.host_in(layer), tw.meta.cview(), want.view()));
  Stream st;
  const std::int64_t cap = std::max<std::int64_t>(dplan.requirements.output.capacity, 1);
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(dplan.requirements.output.rows + 1), -7),
      last(static_cast<std::size_t>(dplan.requirements.output.rows), -7);
  DeviceBuffer dind(static_cast<std::size_t>(cap) * sizeof(std::int32_t)), dlog(static_cast<std::size_t>(cap) * sizeof(std::int32_t));
  DeviceBuffer dws(dplan.requirements.workspace_bytes);
  const kvp::PageSelection dout{indptr.data(),
                                dind.get<std::int32_t>(),
                                last.data(),
                                dlog.get<std::int32_t>(),
                                dplan.requirements.output.rows,
                                dplan.requirements.output.capacity};
  KVP_REQUIRE_OK(quest.select(kvp::Context<Cuda>{dws.workspace(), {}, st.s}, dplan, tw.dev_in(layer), tw.dev_meta(), dout));
  st.sync();
  REQUIRE(indptr == want.indptr);
  REQUIRE(last == want.last);
  const auto ids = dind.download<std::int32_t>(static_cast<std::size_t>(indptr.back()));
  const auto lg = dlog.download<std::int32_t>(static_cast<std::size_t>(indptr.back()));
  REQUIRE(std::equal(ids.begin(), ids.end(), want.indices.begin()));
  REQUIRE(std::equal(lg.begin(), lg.end(), want.logical.begin()));
}

}  // namespace

TEMPLATE_TEST_CASE("cuda Quest: page selection matches Scalar for every GQA mode but union", "[cuda][quest]", float, kvp::half) {
  QuestTwin<TestType, TestType> tw(16, 2, 4, 64, {1000, 37, 513, 16, 2000}, 3);
  for (const kvp::QuestGqa mode : {kvp::QuestGqa::kPerQueryHead, kvp::QuestGqa::kGroupMax, kvp::QuestGqa::kGroupSum}) {
    INFO("gqa mode " << static_cast<int>(mode));
    kvp::QuestParams qp;
    qp.budget = kvp::Budget::tokens(256);
    qp.gqa = mode;
    const kvp::Quest quest(qp);
    check_quest(quest, tw, 5);  // a sparse layer
    check_quest(quest, tw, 0);  // a dense layer: every page
  }
  kvp::QuestParams un;
  un.gqa = kvp::QuestGqa::kUnion;
  const kvp::Quest quest(un);
  const kvp::ProblemShape shape{.num_q_heads = tw.Hq, .num_kv_heads = tw.cache.kv_heads, .head_dim = tw.cache.head_dim};
  kvp::Quest::Plan plan;
  KVP_REQUIRE_OK(quest.plan(kvp::Context<Cuda>{}, tw.dev_in(5), shape, plan));
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(plan.requirements.output.rows + 1), -7), last(indptr.size() - 1, -7);
  const kvp::PageSelection out{
      indptr.data(), nullptr, last.data(), nullptr, plan.requirements.output.rows, plan.requirements.output.capacity};
  REQUIRE(quest.select(kvp::Context<Cuda>{}, plan, tw.dev_in(5), tw.dev_meta(), out).code() == kvp::StatusCode::kUnsupported);
  REQUIRE(std::all_of(indptr.begin(), indptr.end(), [](std::int32_t v) { return v == -7; }));
}

TEMPLATE_TEST_CASE("cuda Quest: on_append on the device builds the metadata bit for bit", "[cuda][quest]", float, kvp::half,
                   kvp::bfloat16) {
  // A prefill of ragged sequences, then decode appends of one token and a chunk straddling pages.
  QuestTwin<TestType, float> tw(16, 2, 2, 40, {100, 16, 37}, 13);
  DeviceBuffer dk(tw.cache.k), dmeta2(tw.meta.data.size() * sizeof(TestType));
  dmeta2.upload(std::vector<TestType>(tw.meta.data.size(), kvp::from_float<TestType>(12345.0f)));
  Stream st;
  auto device_pool = [&] {
    kvp::PagedKVView<const TestType> v = tw.cache.view();
    v.k_data = dk.get<const TestType>();
    v.v_data = nullptr;
    v.table.indices = tw.dids.template get<const std::int32_t>();
    v.device = kGpu;
    return v;
  };
  const auto dmeta =
      kvp::PageMetaView<TestType>::contiguous(dmeta2.get<TestType>(), tw.cache.num_pages, tw.cache.kv_heads, tw.cache.head_dim, kGpu);
  std::vector<std::int32_t> all(static_cast<std::size_t>(tw.cache.batch()));
  for (std::int32_t b = 0; b < tw.cache.batch(); ++b)
    all[static_cast<std::size_t>(b)] = static_cast<std::int32_t>(tw.cache.seq_len[static_cast<std::size_t>(b)]);
  KVP_REQUIRE_OK(kvp::Quest{}.on_append(kvp::Context<Cuda>{{}, {}, st.s}, kvp::AppendInput<TestType>{device_pool(), all.data()}, dmeta));
  st.sync();
  auto same_meta = [&] {
    const auto got = dmeta2.download<TestType>(tw.meta.data.size());
    REQUIRE(std::memcmp(got.data(), tw.meta.data.data(), got.size() * sizeof(TestType)) == 0);
  };
  same_meta();
  for (const std::int64_t n : {1, 1, 21, 3}) {
    INFO("append " << n);
    std::vector<std::int32_t> app(static_cast<std::size_t>(tw.cache.batch()), 0);
    for (std::int32_t b = 0; b < tw.cache.batch(); b += 2) {
      tw.cache.append_normal(b, n);
      app[static_cast<std::size_t>(b)] = static_cast<std::int32_t>(n);
    }
    KVP_REQUIRE_OK(kvp::Quest{}.on_append(kvp::Context<Scalar>{}, kvp::AppendInput<TestType>{tw.cache.view(), app.data()}, tw.meta.view()));
    dk.upload(tw.cache.k);
    DeviceBuffer ids(tw.cache.indices);
    kvp::PagedKVView<const TestType> v = device_pool();
    v.table.indices = ids.get<const std::int32_t>();
    KVP_REQUIRE_OK(kvp::Quest{}.on_append(kvp::Context<Cuda>{{}, {}, st.s}, kvp::AppendInput<TestType>{v, app.data()}, dmeta));
    st.sync();
    same_meta();
  }
}

TEST_CASE("cuda Quest: a select captured in a CUDA graph and replayed on new queries", "[cuda][quest][graph]") {
  QuestTwin<kvp::half, float> tw(16, 4, 2, 128, {3000, 777}, 9);
  kvp::QuestParams qp;
  qp.budget = kvp::Budget::tokens(512);
  const kvp::Quest quest(qp);
  const kvp::ProblemShape shape{.num_q_heads = tw.Hq, .num_kv_heads = tw.cache.kv_heads, .head_dim = tw.cache.head_dim};
  kvp::Quest::Plan plan;
  KVP_REQUIRE_OK(quest.plan(kvp::Context<Cuda>{}, tw.dev_in(3), shape, plan));
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(plan.requirements.output.rows + 1)), last(indptr.size() - 1);
  DeviceBuffer dind(static_cast<std::size_t>(plan.requirements.output.capacity) * sizeof(std::int32_t));
  DeviceBuffer dws(plan.requirements.workspace_bytes);
  const kvp::PageSelection out{indptr.data(), dind.get<std::int32_t>(),      last.data(),
                               nullptr,       plan.requirements.output.rows, plan.requirements.output.capacity};
  Stream st;
  cudaGraph_t graph = nullptr;
  CUDA_REQUIRE(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeThreadLocal));
  const kvp::Status captured = quest.select(kvp::Context<Cuda>{dws.workspace(), {}, st.s}, plan, tw.dev_in(3), tw.dev_meta(), out);
  CUDA_REQUIRE(cudaStreamEndCapture(st.s, &graph));
  KVP_REQUIRE_OK(captured);
  cudaGraphExec_t exec = nullptr;
  CUDA_REQUIRE(cudaGraphInstantiate(&exec, graph, 0));
  for (unsigned round = 0; round < 4; ++round) {
    INFO("replay " << round);
    tw.new_queries(100 + round);
    CUDA_REQUIRE(cudaGraphLaunch(exec, st.s));
    st.sync();
    kvp::Quest::Plan hplan;
    KVP_REQUIRE_OK(quest.plan(kvp::Context<Scalar>{}, tw.host_in(3), shape, hplan));
    quest_test::SelectionBuffer want(hplan.requirements.output.rows, hplan.requirements.output.capacity);
    std::vector<std::byte> hws(hplan.requirements.workspace_bytes);
    KVP_REQUIRE_OK(quest.select(kvp::Context<Scalar>{kvp::Workspace{hws.data(), hws.size()}}, hplan, tw.host_in(3), tw.meta.cview(),
                                want.view(false)));
    REQUIRE(indptr == want.indptr);
    const auto ids = dind.download<std::int32_t>(static_cast<std::size_t>(indptr.back()));
    REQUIRE(std::equal(ids.begin(), ids.end(), want.indices.begin()));
  }
  CUDA_REQUIRE(cudaGraphExecDestroy(exec));
  CUDA_REQUIRE(cudaGraphDestroy(graph));
}

namespace {

bool same_float_bits(float a, float b) {
  std::uint32_t x = 0, y = 0;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  return x == y;
}

/// Quest lookahead over several steps on the host (Scalar) and on the device: the requests (pages, priorities,
/// the size the device writes, the -1 padding), the history stamps and the counters equal after every step.
void check_quest_lookahead(const kvp::QuestLookaheadParams& params, QuestTwin<float, float>& tw, unsigned seed) {
  const kvp::QuestLookahead<float> pol(params);
  std::int64_t max_len = 0;
  for (std::int32_t b = 0; b < tw.cache.batch(); ++b)
    max_len = std::max<std::int64_t>(max_len, tw.cache.table().seq_len(b, tw.cache.page_size));
  const kvp::ProblemShape shape{.num_q_heads = tw.Hq,
                                .num_kv_heads = tw.cache.kv_heads,
                                .head_dim = tw.cache.head_dim,
                                .max_kv_len = max_len,
                                .batch = tw.cache.batch()};
  const auto hreq = pol.requirements(kvp::Context<Scalar>{}, shape, tw.cache.page_size);
  const auto dreq = pol.requirements(kvp::Context<Cuda>{}, shape, tw.cache.page_size);
  KVP_REQUIRE_OK(hreq.status);
  KVP_REQUIRE_OK(dreq.status);
  const std::int32_t P = tw.cache.num_pages;
  const auto hist_n = static_cast<std::size_t>(kvp::PrefetchHistory::buffer_size(P));
  std::vector<std::int64_t> hbuf(hist_n);
  kvp::QuestLookaheadState<float> hst{tw.meta.cview(), kvp::PrefetchHistory::over(hbuf.data(), P)};
  DeviceBuffer dbuf(hist_n * sizeof(std::int64_t)), dws(dreq.workspace_bytes);
  kvp::QuestLookaheadState<float> dst{tw.dev_meta(), kvp::PrefetchHistory::wrap(dbuf.get<std::int64_t>(), P)};
  Stream st;
  const kvp::Context<Cuda> dctx{dws.workspace(), {}, st.s};
  KVP_REQUIRE_OK(dst.history.reset(dctx));
  std::vector<std::byte> hws(hreq.workspace_bytes);
  const kvp::Context<Scalar> hctx{kvp::Workspace{hws.data(), hws.size()}};
  const auto E = static_cast<std::size_t>(tw.cache.table().indptr[tw.cache.batch()]);
  DeviceBuffer dpages(E * sizeof(std::int32_t)), dprio(E * sizeof(float)), dsize(sizeof(std::int64_t));
  DeviceBuffer dcounters(sizeof(kvp::PrefetchCounters));
  CUDA_REQUIRE(cudaMemset(dcounters.get(), 0, sizeof(kvp::PrefetchCounters)));
  kvp::PrefetchCounters hc;

  kvp::QuestParams ap;
  ap.budget = kvp::Budget::tokens(256);
  ap.dense_layers = 0;
  const kvp::Quest actual(ap);
  for (int step = 0; step < 6; ++step) {
    INFO("step " << step);
    tw.new_queries(seed * 17 + static_cast<unsigned>(step));
    const int layer = step % 3;  // layer 0 is dense when dense_layers >= 1
    if (step != 4) {
      std::vector<std::int32_t> hpages(E, -7);
      std::vector<float> hprio(E, -7.0f);
      kvp::PrefetchRequest hr{hpages.data(), hprio.data(), static_cast<std::int64_t>(E), 0};
      KVP_REQUIRE_OK(pol.predict(hctx, hst, tw.host_in(layer), hr));
      kvp::PrefetchRequest dr{dpages.get<std::int32_t>(), dprio.get<float>(), static_cast<std::int64_t>(E), 0};
      dr.device_size = dsize.get<std::int64_t>();
      KVP_REQUIRE_OK(pol.predict(dctx, dst, tw.dev_in(layer), dr));
      st.sync();
      REQUIRE(dr.size == -1);
      REQUIRE(dsize.download<std::int64_t>(1)[0] == hr.size);
      const auto pages = dpages.download<std::int32_t>(E);
      const auto prio = dprio.download<float>(E);
      for (std::size_t j = 0; j < E; ++j) {
        INFO("request entry " << j);
        if (static_cast<std::int64_t>(j) < hr.size) {
          REQUIRE(pages[j] == hpages[j]);
          REQUIRE(same_float_bits(prio[j], hprio[j]));
        } else {
          REQUIRE(pages[j] == -1);
          REQUIRE(std::isnan(prio[j]));
        }
      }
      const auto pending = dbuf.download<std::int64_t>(hist_n);
      REQUIRE(pending[hist_n - 2] == hst.history.predicted_count);
      REQUIRE(pending[hist_n - 1] == hst.history.predicted_new);
    }
    kvp::Quest::Plan plan;
    KVP_REQUIRE_OK(actual.plan(hctx, tw.host_in(layer), shape, plan));
    quest_test::SelectionBuffer sel(plan.requirements.output.rows, plan.requirements.output.capacity);
    std::vector<std::byte> qws(plan.requirements.workspace_bytes);
    KVP_REQUIRE_OK(actual.select(kvp::Context<Scalar>{kvp::Workspace{qws.data(), qws.size()}}, plan, tw.host_in(layer), tw.meta.cview(),
                                 sel.view(false)));
    KVP_REQUIRE_OK(pol.observe(hctx, hst, sel.view(false), hc));
    DeviceBuffer dids(std::max<std::size_t>(sel.indices.size(), 1) * sizeof(std::int32_t));
    dids.upload(sel.indices);
    kvp::PageSelection dsel = sel.view(false);
    dsel.indices = dids.get<std::int32_t>();
    KVP_REQUIRE_OK(pol.observe(dctx, dst, dsel, *dcounters.get<kvp::PrefetchCounters>()));
    st.sync();
    kvp::PrefetchCounters dc;
    CUDA_REQUIRE(cudaMemcpy(&dc, dcounters.get(), sizeof(dc), cudaMemcpyDeviceToHost));
    REQUIRE(dc.hits == hc.hits);
    REQUIRE(dc.misses == hc.misses);
    REQUIRE(dc.wasted == hc.wasted);
    REQUIRE(dc.predicted == hc.predicted);
    REQUIRE(dc.needed == hc.needed);
    REQUIRE(dc.reused == hc.reused);
    REQUIRE(dc.reuse_total == hc.reuse_total);
    REQUIRE(dc.late == hc.late);
    REQUIRE(dc.transferred == hc.transferred);
    REQUIRE(dc.steps == hc.steps);
    REQUIRE(dc.predicted_steps == hc.predicted_steps);
    const auto stamps = dbuf.download<std::int64_t>(hist_n);
    REQUIRE(std::equal(stamps.begin(), stamps.begin() + 2 * P, hbuf.begin()));
  }
}

}  // namespace

TEST_CASE("cuda QuestLookahead: requests, history and counters match Scalar over several steps", "[cuda][prefetch]") {
  QuestTwin<float, float> tw(16, 2, 4, 64, {1000, 37, 513, 16, 2000}, 21);
  kvp::QuestLookaheadParams p;
  p.page_budget = 12;
  p.dense_layers = 1;
  SECTION("per query head, reuse") { check_quest_lookahead(p, tw, 1); }
  SECTION("group max, no reuse") {
    p.gqa = kvp::QuestGqa::kGroupMax;
    p.reuse_previous = false;
    check_quest_lookahead(p, tw, 2);
  }
  SECTION("a long batch: requests over many chunks of the one-block listing") {
    QuestTwin<float, float> big(4, 2, 2, 32, {9000, 4000, 12000}, 23);
    kvp::QuestLookaheadParams q;
    q.page_budget = 700;
    q.dense_layers = 1;
    check_quest_lookahead(q, big, 3);
  }
}

namespace {

/// A prefetcher's predictions over several steps on the host (Scalar) and on the device, after the states were
/// built and compared by the caller. The scores use the device's expf, so the requests are compared with a
/// tolerance: pages on both sides carry priorities within 1e-5 relative (+inf and the reuse -1 exactly), a page on
/// one side only must be a selected one's (finite, >= 0) and at most two per step; the device's list is in
/// descending priority and padded with -1 / NaN; while every request so far named the same pages, the history
/// stamps and counters are equal too. `exact`: the policy's device path is bit-identical (no exp), so every
/// request must equal the host's, priorities bit for bit.
template <class Pol, class State, class Tk>
void compare_predictions(const Pol& pol, QuestTwin<Tk, float>& tw, State& hst, State& dst, const std::vector<std::int64_t>& hbuf,
                         DeviceBuffer& dbuf, const kvp::Context<Scalar>& hctx, const kvp::Context<Cuda>& dctx, cudaStream_t stream,
                         unsigned seed, bool exact = false) {
  const std::int32_t P = tw.cache.num_pages;
  const auto E = static_cast<std::size_t>(tw.cache.table().indptr[tw.cache.batch()]);
  DeviceBuffer dpages(E * sizeof(std::int32_t)), dprio(E * sizeof(float)), dsize(sizeof(std::int64_t));
  DeviceBuffer dcounters(sizeof(kvp::PrefetchCounters));
  CUDA_REQUIRE(cudaMemset(dcounters.get(), 0, sizeof(kvp::PrefetchCounters)));
  kvp::PrefetchCounters hc;
  bool same_so_far = true;
  std::mt19937 rng(seed);
  for (int step = 0; step < 6; ++step) {
    INFO("step " << step);
    tw.new_queries(seed * 13 + static_cast<unsigned>(step));
    const int layer = step % 3;
    std::vector<std::int32_t> hpages(E, -7);
    std::vector<float> hprio(E, -7.0f);
    kvp::PrefetchRequest hr{hpages.data(), hprio.data(), static_cast<std::int64_t>(E), 0};
    KVP_REQUIRE_OK(pol.predict(hctx, hst, tw.host_in(layer), hr));
    kvp::PrefetchRequest dr{dpages.get<std::int32_t>(), dprio.get<float>(), static_cast<std::int64_t>(E), 0};
    dr.device_size = dsize.get<std::int64_t>();
    KVP_REQUIRE_OK(pol.predict(dctx, dst, tw.dev_in(layer), dr));
    CUDA_REQUIRE(cudaStreamSynchronize(stream));
    REQUIRE(dr.size == -1);
    const std::int64_t dn = dsize.download<std::int64_t>(1)[0];
    const auto pages = dpages.download<std::int32_t>(E);
    const auto prio = dprio.download<float>(E);
    std::map<std::int32_t, float> want, have;
    for (std::int64_t j = 0; j < hr.size; ++j) want[hpages[static_cast<std::size_t>(j)]] = hprio[static_cast<std::size_t>(j)];
    for (std::size_t j = 0; j < E; ++j) {
      INFO("request entry " << j);
      if (static_cast<std::int64_t>(j) < dn) {
        REQUIRE(pages[j] >= 0);
        have[pages[j]] = prio[j];
        if (j > 0) REQUIRE(kvp::score_order_key(prio[j - 1]) >= kvp::score_order_key(prio[j]));
      } else {
        REQUIRE(pages[j] == -1);
        REQUIRE(std::isnan(prio[j]));
      }
    }
    REQUIRE(have.size() == static_cast<std::size_t>(dn));
    int one_sided = 0;
    for (const auto& [page, p] : want) {
      INFO("page " << page << " host priority " << p);
      const auto it = have.find(page);
      if (it == have.end()) {
        ++one_sided;
        REQUIRE((std::isfinite(p) && p >= 0.0f));
        continue;
      }
      if (exact) {
        REQUIRE(same_float_bits(it->second, p));
      } else if (std::isinf(p) || p == -1.0f) {
        REQUIRE(it->second == p);
      } else {
        REQUIRE(std::fabs(it->second - p) <= 1e-5f * std::fabs(p) + 1e-9f);
      }
    }
    for (const auto& [page, p] : have)
      if (!want.count(page)) {
        ++one_sided;
        REQUIRE((std::isfinite(p) && p >= 0.0f));
      }
    REQUIRE(one_sided <= (exact ? 0 : 2));
    if (exact) REQUIRE(std::equal(pages.begin(), pages.begin() + dn, hpages.begin()));  // the same order too
    same_so_far = same_so_far && one_sided == 0;
    if (same_so_far) {
      const auto pending = dbuf.download<std::int64_t>(hbuf.size());
      REQUIRE(pending[hbuf.size() - 2] == hst.history.predicted_count);
      REQUIRE(pending[hbuf.size() - 1] == hst.history.predicted_new);
    }
    // The step's reads: four random pages of every sequence (one row each).
    std::vector<std::int32_t> indptr{0}, ids, last;
    for (std::int32_t b = 0; b < tw.cache.batch(); ++b) {
      const auto& sp = tw.cache.seq_pages[static_cast<std::size_t>(b)];
      if (sp.empty()) continue;
      for (int i = 0; i < 4; ++i) ids.push_back(sp[rng() % sp.size()]);
      indptr.push_back(static_cast<std::int32_t>(ids.size()));
      last.push_back(1);
    }
    const kvp::PageSelection hsel{
        indptr.data(), ids.data(), last.data(), nullptr, static_cast<std::int32_t>(last.size()), static_cast<std::int64_t>(ids.size())};
    KVP_REQUIRE_OK(pol.observe(hctx, hst, hsel, hc));
    DeviceBuffer dids(ids);
    kvp::PageSelection dsel = hsel;
    dsel.indices = dids.get<std::int32_t>();
    KVP_REQUIRE_OK(pol.observe(dctx, dst, dsel, *dcounters.get<kvp::PrefetchCounters>()));
    CUDA_REQUIRE(cudaStreamSynchronize(stream));
    if (same_so_far) {
      kvp::PrefetchCounters dc;
      CUDA_REQUIRE(cudaMemcpy(&dc, dcounters.get(), sizeof(dc), cudaMemcpyDeviceToHost));
      REQUIRE(dc.hits == hc.hits);
      REQUIRE(dc.misses == hc.misses);
      REQUIRE(dc.wasted == hc.wasted);
      REQUIRE(dc.predicted == hc.predicted);
      REQUIRE(dc.needed == hc.needed);
      REQUIRE(dc.late == hc.late);
      REQUIRE(dc.transferred == hc.transferred);
      REQUIRE(dc.steps == hc.steps);
      const auto stamps = dbuf.download<std::int64_t>(hbuf.size());
      REQUIRE(std::equal(stamps.begin(), stamps.begin() + 2 * P, hbuf.begin()));
    }
  }
}

/// The twin's key pool on the device (keys only, device page ids).
template <class Tk>
kvp::PagedKVView<const Tk> device_keys(QuestTwin<Tk, float>& tw, const DeviceBuffer& dk) {
  kvp::PagedKVView<const Tk> v = tw.cache.view();
  v.k_data = dk.get<const Tk>();
  v.v_data = nullptr;
  v.table.indices = tw.dids.template get<const std::int32_t>();
  v.device = kGpu;
  return v;
}

/// What every prefetcher's twin check needs: the batch's shape, the host and device requirements, both
/// workspaces, a stream and the two contexts; the device history buffer and the host one (`history` int64 each).
template <class Pol, class Tk>
struct PrefetchTwin {
  kvp::ProblemShape shape;
  kvp::Requirements hreq, dreq;
  std::vector<std::byte> hws;
  DeviceBuffer dws;
  Stream st;
  kvp::Context<Scalar> hctx;
  kvp::Context<Cuda> dctx;
  std::vector<std::int64_t> hbuf;
  DeviceBuffer dbuf;
  PrefetchTwin(const Pol& pol, const QuestTwin<Tk, float>& tw)
      : shape(batch_shape(tw)),
        hreq(pol.requirements(kvp::Context<Scalar>{}, shape, tw.cache.page_size)),
        dreq(pol.requirements(kvp::Context<Cuda>{}, shape, tw.cache.page_size)),
        hws(hreq.workspace_bytes),
        dws(dreq.workspace_bytes),
        hctx{kvp::Workspace{hws.data(), hws.size()}},
        dctx{dws.workspace(), {}, st.s},
        hbuf(static_cast<std::size_t>(kvp::PrefetchHistory::buffer_size(tw.cache.num_pages))),
        dbuf(hbuf.size() * sizeof(std::int64_t)) {
    KVP_REQUIRE_OK(hreq.status);
    KVP_REQUIRE_OK(dreq.status);
  }
  static kvp::ProblemShape batch_shape(const QuestTwin<Tk, float>& tw) {
    std::int64_t max_len = 0;
    for (std::int32_t b = 0; b < tw.cache.batch(); ++b)
      max_len = std::max<std::int64_t>(max_len, tw.cache.table().seq_len(b, tw.cache.page_size));
    return {.num_q_heads = tw.Hq,
            .num_kv_heads = tw.cache.kv_heads,
            .head_dim = tw.cache.head_dim,
            .max_kv_len = max_len,
            .batch = tw.cache.batch()};
  }
  /// Both states built: the device history cleared on the stream, then on_append of every cached token on
  /// each side (the caller prepared what must come first) and `same_state()` compared after a sync.
  template <class State, class SameState>
  void append_and_compare(const Pol& pol, QuestTwin<Tk, float>& tw, State& hst, State& dst, SameState same_state) {
    KVP_REQUIRE_OK(dst.history.reset(dctx));
    DeviceBuffer dk(tw.cache.k);
    KVP_REQUIRE_OK(pol.on_append(hctx, kvp::AppendInput<Tk>{tw.cache.view(), nullptr}, hst));
    KVP_REQUIRE_OK(pol.on_append(dctx, kvp::AppendInput<Tk>{device_keys(tw, dk), nullptr}, dst));
    st.sync();
    same_state();
  }
};

/// ShadowKV: landmarks and outlier scores built on both sides (bit-identical), then the predictions.
template <class Tk>
void check_shadowkv(const kvp::ShadowKVParams& params, QuestTwin<Tk, float>& tw, unsigned seed) {
  const kvp::ShadowKV pol(params);
  PrefetchTwin<kvp::ShadowKV, Tk> x(pol, tw);
  const std::int32_t P = tw.cache.num_pages, ps = tw.cache.page_size, Hkv = tw.cache.kv_heads, d = tw.cache.head_dim;
  std::vector<float> hfl(static_cast<std::size_t>(pol.state_size(P, ps, Hkv, d).floats), 0.0f);
  DeviceBuffer dfl(hfl.size() * sizeof(float));
  CUDA_REQUIRE(cudaMemset(dfl.get(), 0, hfl.size() * sizeof(float)));
  kvp::ShadowKVState hst, dst;
  KVP_REQUIRE_OK(pol.make_state(hfl.data(), x.hbuf.data(), P, ps, Hkv, d, &hst));
  KVP_REQUIRE_OK(pol.make_state(dfl.get<float>(), x.dbuf.template get<std::int64_t>(), P, ps, Hkv, d, &dst, kGpu));
  x.append_and_compare(pol, tw, hst, dst, [&] {
    const auto got = dfl.download<float>(hfl.size());
    REQUIRE(std::memcmp(got.data(), hfl.data(), hfl.size() * sizeof(float)) == 0);
  });
  compare_predictions(pol, tw, hst, dst, x.hbuf, x.dbuf, x.hctx, x.dctx, x.st.s, seed);
}

/// SpeCache: the low-bit key copy written on both sides (byte-identical), then the predictions.
template <class Tk>
void check_specache(const kvp::SpeCacheParams& params, QuestTwin<Tk, float>& tw, unsigned seed) {
  const kvp::SpeCache pol(params);
  PrefetchTwin<kvp::SpeCache, Tk> x(pol, tw);
  const std::int32_t P = tw.cache.num_pages, ps = tw.cache.page_size, Hkv = tw.cache.kv_heads, d = tw.cache.head_dim;
  std::vector<std::uint8_t> hcodes(static_cast<std::size_t>(pol.codes_bytes(P, ps, Hkv, d)), 0);
  DeviceBuffer dcodes(hcodes.size());
  CUDA_REQUIRE(cudaMemset(dcodes.get(), 0, hcodes.size()));
  kvp::SpeCacheState hst, dst;
  KVP_REQUIRE_OK(pol.make_state(hcodes.data(), x.hbuf.data(), P, ps, Hkv, d, &hst));
  KVP_REQUIRE_OK(pol.make_state(dcodes.get<std::uint8_t>(), x.dbuf.template get<std::int64_t>(), P, ps, Hkv, d, &dst, kGpu));
  x.append_and_compare(pol, tw, hst, dst, [&] { REQUIRE(dcodes.download<std::uint8_t>(hcodes.size()) == hcodes); });
  compare_predictions(pol, tw, hst, dst, x.hbuf, x.dbuf, x.hctx, x.dctx, x.st.s, seed);
}

/// InfiniGen: prepared on the host (skew, channels, partial keys) from prompt queries, the skew and channels
/// copied into the device state, the partial keys folded on the device (bit-identical), then the predictions
/// (bit-identical too).
template <class Tk>
void check_infinigen(const kvp::InfiniGenParams& params, QuestTwin<Tk, float>& tw, unsigned seed) {
  const kvp::InfiniGen pol(params);
  PrefetchTwin<kvp::InfiniGen, Tk> x(pol, tw);
  const std::int32_t P = tw.cache.num_pages, ps = tw.cache.page_size, Hkv = tw.cache.kv_heads, d = tw.cache.head_dim;
  const auto sz = pol.state_size(P, ps, Hkv, d);
  std::vector<float> hfl(static_cast<std::size_t>(sz.floats), 0.0f);
  std::vector<std::int32_t> hints(static_cast<std::size_t>(sz.ints), 0);
  kvp::InfiniGenState hst, dst;
  KVP_REQUIRE_OK(pol.make_state(hfl.data(), hints.data(), x.hbuf.data(), P, ps, Hkv, d, &hst));
  const std::int64_t W = 16;
  const auto prompt = random_vector<float>(static_cast<std::size_t>(tw.Hq * W * d), seed + 3);
  KVP_REQUIRE_OK(pol.prepare(x.hctx, kvp::TensorView<const float, 3>::contiguous(prompt.data(), {tw.Hq, W, d}), tw.cache.view(), hst));
  DeviceBuffer dfl(hfl.size() * sizeof(float)), dints(hints);
  CUDA_REQUIRE(cudaMemset(dfl.get(), 0, hfl.size() * sizeof(float)));
  CUDA_REQUIRE(cudaMemcpy(dfl.get(), hfl.data(), static_cast<std::size_t>(Hkv) * d * d * sizeof(float), cudaMemcpyHostToDevice));
  KVP_REQUIRE_OK(
      pol.make_state(dfl.get<float>(), dints.get<std::int32_t>(), x.dbuf.template get<std::int64_t>(), P, ps, Hkv, d, &dst, kGpu));
  dst.prepared = true;
  // The host folded its partial keys in prepare; append nothing more there (append_len 0), everything on the device.
  KVP_REQUIRE_OK(dst.history.reset(x.dctx));
  DeviceBuffer dk(tw.cache.k);
  KVP_REQUIRE_OK(pol.on_append(x.dctx, kvp::AppendInput<Tk>{device_keys(tw, dk), nullptr}, dst));
  x.st.sync();
  const auto got = dfl.download<float>(hfl.size());
  REQUIRE(std::memcmp(got.data(), hfl.data(), hfl.size() * sizeof(float)) == 0);
  compare_predictions(pol, tw, hst, dst, x.hbuf, x.dbuf, x.hctx, x.dctx, x.st.s, seed, /*exact=*/true);
}

}  // namespace

TEMPLATE_TEST_CASE("cuda InfiniGen: partial keys, requests, history and counters bit-identical to Scalar", "[cuda][prefetch]", float,
                   kvp::half) {
  QuestTwin<TestType, float> tw(16, 2, 4, 64, {1000, 37, 513, 16, 2000}, 41);
  SECTION("skewed, alpha 5, a dense layer") {
    check_infinigen(kvp::InfiniGenParams{.alpha = 5.0f, .max_num_kv = 400, .dense_layers = 1}, tw, 1);
  }
  SECTION("A = I, alpha 2, ratio 0.3 (r off the 8-lane blocks)") {
    check_infinigen(kvp::InfiniGenParams{.alpha = 2.0f, .partial_ratio = 0.3f, .max_num_kv = 64, .dense_layers = 0, .skew = false}, tw, 2);
  }
}

TEMPLATE_TEST_CASE("cuda ShadowKV: landmarks bit-identical, requests and counters match Scalar within the exp tolerance",
                   "[cuda][prefetch]", float, kvp::half) {
  QuestTwin<TestType, float> tw(16, 2, 4, 64, {1000, 37, 513, 16, 2000}, 31);
  kvp::ShadowKVParams p;
  p.chunk_size = 8;
  p.chunk_budget = 24;
  p.outlier_chunks = 6;
  p.local_chunks = 2;
  p.dense_layers = 1;
  SECTION("reuse, a dense layer") { check_shadowkv(p, tw, 1); }
  SECTION("no reuse, no outliers, chunk = page") {
    p.chunk_size = 16;
    p.outlier_chunks = 0;
    p.reuse_previous = false;
    check_shadowkv(p, tw, 2);
  }
}

TEMPLATE_TEST_CASE("cuda SpeCache: the key copy byte-identical, requests and counters match Scalar within the exp tolerance",
                   "[cuda][prefetch]", float, kvp::half) {
  QuestTwin<TestType, float> tw(16, 2, 4, 64, {1000, 37, 513, 16, 2000}, 37);
  SECTION("q4_0, top 64, a dense layer") { check_specache(kvp::SpeCacheParams{.topk = 64, .dense_layers = 1}, tw, 1); }
  SECTION("q8_0, top 300") { check_specache(kvp::SpeCacheParams{.type = kvp::GgmlType::kQ8_0, .topk = 300}, tw, 2); }
}

TEST_CASE("cuda PyramidKV: per-layer budgets over SnapKV scores match Scalar", "[cuda][pyramidkv]") {
  const std::int64_t Hq = 8, Hkv = 2, d = 64, T = 1024, w = 64;
  SnapProblem<kvp::half> p(Hq, Hkv, d, T, w, 71);
  for (const int layer : {0, 13, 31}) {
    INFO("layer " << layer);
    const kvp::PyramidKV policy(kvp::PyramidKVParams::kvpress(0.5, layer, 32));
    const kvp::ProblemShape shape{Hq, Hkv, d, T, w};
    const auto hreq = policy.requirements(kvp::Context<Scalar>{}, shape);
    KVP_REQUIRE_OK(hreq.status);
    std::vector<std::byte> hws(hreq.workspace_bytes);
    kvp_test::KeepSetBuffer want(hreq.output.rows, hreq.output.capacity);
    KVP_REQUIRE_OK(policy.evict(kvp::Context<Scalar>{kvp::Workspace{hws.data(), hws.size()}}, p.host(), want.view()));
    std::vector<float> ref(static_cast<std::size_t>(Hkv * T));
    const kvp::SnapKV scorer(kvp::SnapKVParams::kvpress(0.0, 64, 5));
    const auto sreq = scorer.requirements(kvp::Context<Scalar>{}, shape);
    std::vector<std::byte> sws(sreq.workspace_bytes);
    KVP_REQUIRE_OK(scorer.score(kvp::Context<Scalar>{kvp::Workspace{sws.data(), sws.size()}}, p.host(),
                                kvp::TensorView<float, 2>::contiguous(ref.data(), {Hkv, T})));
    Stream st;
    const auto dreq = policy.requirements(kvp::Context<Cuda>{}, shape);
    KVP_REQUIRE_OK(dreq.status);
    DeviceBuffer dws(dreq.workspace_bytes), dind(static_cast<std::size_t>(dreq.output.capacity) * sizeof(std::int32_t));
    std::vector<std::int32_t> indptr(static_cast<std::size_t>(dreq.output.rows + 1));
    KVP_REQUIRE_OK(policy.evict(kvp::Context<Cuda>{dws.workspace(), {}, st.s}, p.device(),
                                kvp::KeepSet{indptr.data(), dind.get<std::int32_t>(), dreq.output.rows, dreq.output.capacity}));
    st.sync();
    REQUIRE(indptr == want.indptr);
    const auto ids = dind.download<std::int32_t>(static_cast<std::size_t>(indptr.back()));
    for (std::int64_t r = 0; r < Hkv; ++r) {
      std::vector<float> head(ref.begin() + r * T, ref.begin() + (r + 1) * T);
      require_same_keep(std::vector<std::int32_t>(ids.begin() + indptr[static_cast<std::size_t>(r)],
                                                  ids.begin() + indptr[static_cast<std::size_t>(r + 1)]),
                        want.row(r), head);
    }
  }
}

namespace {

/// Cuda::adakv_keep against the host reference ops::adakv_keep<Scalar> on one map: counts, offsets (from a first offset of 3) and rows.
void check_adakv_keep(const kvp::AdaKVAllocation& a, std::int64_t rows, std::int64_t T, std::uint32_t seed) {
  std::vector<float> S = edge_scores(static_cast<std::size_t>(rows * T), seed);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = std::max<std::int64_t>(T - a.num_protected, 0); j < T; ++j) S[static_cast<std::size_t>(r * T + j)] = INFINITY;
  const kvp::AdaKVKeepSpec spec = a.keep_spec(T, rows);
  const std::int32_t first = 3;
  std::vector<std::int64_t> counts(static_cast<std::size_t>(rows), -1);
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(rows + 1), -7), ids(static_cast<std::size_t>(first + rows * T), -7);
  indptr[0] = first;
  DeviceBuffer dS(S), dcounts(counts), dindptr(indptr), dids(ids), dws(Cuda::adakv_keep_workspace(rows, T));
  std::vector<std::byte> hws(kvp::ops::adakv_keep_workspace<Scalar>(rows, T));
  kvp::ops::adakv_keep<Scalar>(S.data(), rows, T, spec, counts.data(), indptr.data(), ids.data(), kvp::Workspace{hws.data(), hws.size()});
  Stream st;
  run_ops(st, [&] {
    Cuda::adakv_keep(dS.get<const float>(), rows, T, spec, dcounts.get<std::int64_t>(), dindptr.get<std::int32_t>(),
                     dids.get<std::int32_t>(), dws.workspace());
  });
  REQUIRE(dcounts.download<std::int64_t>(counts.size()) == counts);
  REQUIRE(dindptr.download<std::int32_t>(indptr.size()) == indptr);
  REQUIRE(dids.download<std::int32_t>(ids.size()) == ids);  // the rows, and nothing outside them
}

/// Ada-KV over SnapKV scores for `params` on one sequence: indptr (device) and ids, plus the score map the
/// allocation ranked (the first buffer of the policy's workspace, at its start).
struct AdaKVRun {
  std::vector<std::int32_t> indptr, ids;
  std::vector<float> scores;
};
template <class In>
AdaKVRun run_adakv_device(const kvp::AdaKV<kvp::SnapKV>& policy, std::span<const In> batch, const kvp::ProblemShape& shape,
                          std::int64_t rows) {
  Stream st;
  const auto req = policy.requirements(kvp::Context<Cuda>{}, shape);
  KVP_REQUIRE_OK(req.status);
  DeviceBuffer dws(req.workspace_bytes), dindptr(static_cast<std::size_t>(req.output.rows + 1) * sizeof(std::int32_t)),
      dind(static_cast<std::size_t>(req.output.capacity) * sizeof(std::int32_t));
  KVP_REQUIRE_OK(policy.evict(kvp::Context<Cuda>{dws.workspace(), {}, st.s}, batch,
                              kvp::KeepSet{dindptr.get<std::int32_t>(), dind.get<std::int32_t>(), req.output.rows, req.output.capacity}));
  st.sync();
  AdaKVRun run;
  run.indptr = dindptr.download<std::int32_t>(static_cast<std::size_t>(req.output.rows + 1));
  REQUIRE(run.indptr.front() == 0);
  REQUIRE(run.indptr.back() <= req.output.capacity);
  run.ids = dind.download<std::int32_t>(static_cast<std::size_t>(run.indptr.back()));
  run.scores = dws.download<float>(static_cast<std::size_t>(rows * batch.back().keys.kv_len()));
  return run;
}

}  // namespace

TEST_CASE("cuda adakv_keep: counts, offsets and kept rows equal the host reference (kvpress and original)", "[cuda][adakv]") {
  std::uint32_t seed = 500;
  for (const std::int64_t T : {1, 37, 700, 5000})
    for (const std::int64_t rows : {1, 8, 32}) {
      for (const double r : {0.0, 0.3, 0.9})
        for (const double alpha : {0.0, 0.2, 1.0}) {
          const auto p = kvp::AdaKVParams::kvpress(r, alpha);
          INFO("kvpress T " << T << " rows " << rows << " r " << r << " alpha " << alpha);
          check_adakv_keep(kvp::AdaKVAllocation{p.variant, p.alpha, p.normalize, p.budget, std::min<std::int64_t>(T, 8)}, rows, T, seed++);
        }
      for (const bool normalize : {false, true})
        for (const std::int64_t C : {T / 4 + 8, T / 2 + 8, T}) {
          const std::int64_t P = std::min<std::int64_t>(T, 8);
          if (C < P) continue;
          const auto p = kvp::AdaKVParams::original(C, 0.2, normalize);
          INFO("original T " << T << " rows " << rows << " C " << C << " normalize " << normalize);
          check_adakv_keep(kvp::AdaKVAllocation{p.variant, p.alpha, p.normalize, p.budget, P}, rows, T, seed++);
        }
    }
}

TEST_CASE("cuda Ada-KV: the decision over the device's scores equals the host allocation; batches chain their offsets", "[cuda][adakv]") {
  const std::int64_t Hq = 8, Hkv = 2, d = 64, w = 32;
  SnapProblem<kvp::half> a(Hq, Hkv, d, 1024, w, 81), b(Hq, Hkv, d, 600, w, 82);
  const kvp::AdaKVParams variants[] = {
      kvp::AdaKVParams::kvpress(0.5),  kvp::AdaKVParams::kvpress(0.8, 0.0),        kvp::AdaKVParams::kvpress(0.0),
      kvp::AdaKVParams::original(256), kvp::AdaKVParams::original(256, 0.2, true), kvp::AdaKVParams::original_gqa(200, 0.3, true)};
  for (const auto& params : variants) {
    const kvp::AdaKV<kvp::SnapKV> policy(params, kvp::SnapKV(kvp::adakv_scoring()));
    const std::int64_t rows = policy.rows_per_sequence(Hq, Hkv);
    INFO("variant " << static_cast<int>(params.variant) << " rows " << rows);
    const auto one = [&](const SnapProblem<kvp::half>& p) {
      const kvp::ScoreInput<float, kvp::half> in = p.device();
      return run_adakv_device(policy, std::span<const kvp::ScoreInput<float, kvp::half>>(&in, 1), kvp::ProblemShape{Hq, Hkv, d, p.T, w},
                              rows);
    };
    const AdaKVRun ra = one(a), rb = one(b);
    // The host reference on the scores the device ranked.
    for (const auto* pr : {&a, &b}) {
      const AdaKVRun& run = pr == &a ? ra : rb;
      const std::int64_t T = pr->T;
      const kvp::AdaKVKeepSpec spec = policy.allocation(T).keep_spec(T, rows);
      std::vector<std::int64_t> counts(static_cast<std::size_t>(rows));
      std::vector<std::int32_t> indptr(static_cast<std::size_t>(rows + 1), 0), ids(static_cast<std::size_t>(rows * T));
      std::vector<std::byte> hws(kvp::ops::adakv_keep_workspace<Scalar>(rows, T));
      kvp::ops::adakv_keep<Scalar>(run.scores.data(), rows, T, spec, counts.data(), indptr.data(), ids.data(),
                                   kvp::Workspace{hws.data(), hws.size()});
      REQUIRE(run.indptr == indptr);
      REQUIRE(std::equal(run.ids.begin(), run.ids.end(), ids.begin()));
    }
    // Both sequences in one call: the second's offsets continue from the first's, rows unchanged.
    const std::vector<kvp::ScoreInput<float, kvp::half>> both{a.device(), b.device()};
    const AdaKVRun rab =
        run_adakv_device(policy, std::span<const kvp::ScoreInput<float, kvp::half>>(both), kvp::ProblemShape{Hq, Hkv, d, 1024, w, 2}, rows);
    REQUIRE(rab.indptr.size() == static_cast<std::size_t>(2 * rows + 1));
    for (std::int64_t r = 0; r <= rows; ++r) {
      REQUIRE(rab.indptr[static_cast<std::size_t>(r)] == ra.indptr[static_cast<std::size_t>(r)]);
      REQUIRE(rab.indptr[static_cast<std::size_t>(rows + r)] == ra.indptr.back() + rb.indptr[static_cast<std::size_t>(r)]);
    }
    REQUIRE(std::equal(ra.ids.begin(), ra.ids.end(), rab.ids.begin()));
    REQUIRE(std::equal(rb.ids.begin(), rb.ids.end(), rab.ids.begin() + ra.indptr.back()));
  }
}

TEST_CASE("cuda Ada-KV: a decision captured in a CUDA graph and replayed on new keys", "[cuda][adakv][graph]") {
  const std::int64_t Hq = 8, Hkv = 2, d = 64, T = 600, w = 32;
  SnapProblem<kvp::half> p(Hq, Hkv, d, T, w, 91);
  const kvp::AdaKV<kvp::SnapKV> policy(kvp::AdaKVParams::kvpress(0.6), kvp::SnapKV(kvp::adakv_scoring()));
  const kvp::ProblemShape shape{Hq, Hkv, d, T, w};
  const auto req = policy.requirements(kvp::Context<Cuda>{}, shape);
  KVP_REQUIRE_OK(req.status);
  DeviceBuffer dws(req.workspace_bytes), dindptr(static_cast<std::size_t>(req.output.rows + 1) * sizeof(std::int32_t)),
      dind(static_cast<std::size_t>(req.output.capacity) * sizeof(std::int32_t));
  Stream st;
  cudaGraph_t graph = nullptr;
  CUDA_REQUIRE(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeThreadLocal));
  const kvp::Status captured =
      policy.evict(kvp::Context<Cuda>{dws.workspace(), {}, st.s}, p.device(),
                   kvp::KeepSet{dindptr.get<std::int32_t>(), dind.get<std::int32_t>(), req.output.rows, req.output.capacity});
  CUDA_REQUIRE(cudaStreamEndCapture(st.s, &graph));
  KVP_REQUIRE_OK(captured);
  cudaGraphExec_t exec = nullptr;
  CUDA_REQUIRE(cudaGraphInstantiate(&exec, graph, 0));
  for (int round = 0; round < 3; ++round) {
    INFO("replay " << round);
    if (round > 0) {
      p.k = random_vector<kvp::half>(p.k.size(), static_cast<std::uint32_t>(300 + round));
      p.dk.upload(p.k);
    }
    CUDA_REQUIRE(cudaGraphLaunch(exec, st.s));
    st.sync();
    const auto indptr = dindptr.download<std::int32_t>(static_cast<std::size_t>(req.output.rows + 1));
    const auto ids = dind.download<std::int32_t>(static_cast<std::size_t>(indptr.back()));
    const kvp::ScoreInput<float, kvp::half> in = p.device();
    const AdaKVRun direct = run_adakv_device(policy, std::span<const kvp::ScoreInput<float, kvp::half>>(&in, 1), shape, Hkv);
    REQUIRE(indptr == direct.indptr);
    REQUIRE(ids == direct.ids);
  }
  CUDA_REQUIRE(cudaGraphExecDestroy(exec));
  CUDA_REQUIRE(cudaGraphDestroy(graph));
}

TEMPLATE_TEST_CASE("cuda Expected Attention: scores within 1e-5 relative of Scalar, kept sets equal up to ties",
                   "[cuda][expected_attention]", float, kvp::half, kvp::bfloat16) {
  const std::int64_t Hq = 8, Hkv = 2, d = 64, T = 700, q_len = 100;
  const auto q = random_vector<TestType>(static_cast<std::size_t>(Hq * q_len * d), 61);
  const auto k = random_vector<TestType>(static_cast<std::size_t>(Hkv * T * d), 62);
  const auto v = random_vector<TestType>(static_cast<std::size_t>(Hkv * T * d), 63);
  DeviceBuffer dq(q), dk(k), dv(v);
  const auto input = [&](const TestType* qp, const TestType* kp, const TestType* vp, kvp::Device dev) {
    kvp::ExpectedAttentionInput<TestType, TestType> in;
    in.queries = kvp::TensorView<const TestType, 3>::contiguous(qp, {Hq, q_len, d}, dev);
    in.keys = kvp::KVSource<TestType>::from(kvp::TensorView<const TestType, 3>::contiguous(kp, {Hkv, T, d}, dev));
    in.values = kvp::KVSource<TestType>::from(kvp::TensorView<const TestType, 3>::contiguous(vp, {Hkv, T, d}, dev));
    return in;
  };
  const auto host_in = input(q.data(), k.data(), v.data(), kvp::Device{});
  const auto dev_in = input(dq.get<const TestType>(), dk.get<const TestType>(), dv.get<const TestType>(), kGpu);
  const kvp::ExpectedAttentionParams variants[] = {kvp::ExpectedAttentionParams::kvpress(0.5),
                                                   kvp::ExpectedAttentionParams::kvpress(0.7, 64, 2, false, true),
                                                   kvp::ExpectedAttentionParams::kvpress(0.3, 16, 0, true, false, 0.01f)};
  for (const auto& params : variants) {
    INFO("cov " << params.use_covariance << " vnorm " << params.use_vnorm << " sinks " << params.n_sink);
    check_scorer(kvp::ExpectedAttention(params), host_in, dev_in, kvp::ProblemShape{Hq, Hkv, d, T, q_len}, false);
  }
}

namespace {

/// Keys (and values) of one sequence, (Hkv, T, d) each, in an HND device page pool of `page_size` tokens
/// with shuffled page ids and spare pages (kvp_test::fill_page_pool): pools and ids device memory, the CSR
/// offsets host arrays.
template <class Tk>
struct DevicePool {
  std::vector<std::int32_t> ids, indptr, last;
  std::unique_ptr<DeviceBuffer> dk, dv, dids;
  kvp::PagedKVView<const Tk> view{};
  DevicePool(const std::vector<Tk>& k, const std::vector<Tk>& v, std::int64_t Hkv, std::int64_t T, std::int64_t d, std::int32_t page_size) {
    const auto at = [&](const std::vector<Tk>& x) {
      return [&x, T, d](std::int64_t h, std::int64_t t, std::int64_t c) { return x[static_cast<std::size_t>((h * T + t) * d + c)]; };
    };
    std::vector<Tk> hk, hv;
    const kvp_test::PagePoolShape shape =
        kvp_test::fill_page_pool(Hkv, T, d, page_size, kvp::PageLayout::kHND, kvp::from_float<Tk>(-1e4f), at(k), hk, ids, indptr, last);
    kvp_test::fill_page_pool(Hkv, T, d, page_size, kvp::PageLayout::kHND, kvp::from_float<Tk>(-1e4f), at(v), hv, ids, indptr, last);
    dk = std::make_unique<DeviceBuffer>(hk);
    dv = std::make_unique<DeviceBuffer>(hv);
    dids = std::make_unique<DeviceBuffer>(ids);
    view = kvp_test::page_pool_view<Tk>(dk->get<const Tk>(), dv->get<const Tk>(), shape, Hkv, page_size, d, indptr.data(),
                                        dids->get<const std::int32_t>(), last.data(), kGpu);
  }
};

}  // namespace

TEMPLATE_TEST_CASE(
    "cuda paged pools: SnapKV, LAQ, TOVA, ObservedAttention, Knorm and Expected Attention over device pages match Scalar "
    "over dense keys",
    "[cuda][paged]", float, kvp::half, kvp::bfloat16) {
  const std::int64_t Hq = 8, Hkv = 2, d = 64, T = 700;
  for (const std::int32_t ps : {16, 7}) {
    INFO("page size " << ps);
    SnapProblem<TestType> win(Hq, Hkv, d, T, 64, 101);
    const auto v = random_vector<TestType>(win.k.size(), 102);
    const DevicePool<TestType> pool(win.k, v, Hkv, T, d, ps);
    const kvp::KVSource<TestType> keys = kvp::KVSource<TestType>::from_paged(pool.view, 0);
    auto with_keys = [&](kvp::ScoreInput<float, TestType> in) {
      in.keys = keys;
      return in;
    };
    check_scorer(kvp::SnapKV(kvp::SnapKVParams::kvpress(0.5, 64, 5)), win.host(), with_keys(win.device()),
                 kvp::ProblemShape{Hq, Hkv, d, T, 64}, false);
    SnapProblem<TestType> pseudo(Hq, Hkv, d, T, 8, 101);  // same keys (same seed), 8 pseudo queries
    pseudo.lookahead = 8;
    check_scorer(kvp::LAQ(kvp::LAQParams::laq(128)), pseudo.host(), with_keys(pseudo.device()), kvp::ProblemShape{Hq, Hkv, d, T, 8}, false);
    SnapProblem<TestType> last(Hq, Hkv, d, T, 4, 101);
    check_scorer(kvp::TOVA(kvp::TOVAParams{kvp::Budget::compression_ratio(0.5)}), last.host(), with_keys(last.device()),
                 kvp::ProblemShape{Hq, Hkv, d, T, 4}, false);
    const kvp::ScoreInput<float, TestType> knorm_host{{}, win.host().keys}, knorm_dev{{}, keys};
    check_scorer(kvp::Knorm(kvp::KnormParams{kvp::Budget::compression_ratio(0.3)}), knorm_host, knorm_dev,
                 kvp::ProblemShape{Hkv, Hkv, d, T, 0}, true);
    kvp::ExpectedAttentionInput<float, TestType> eh, ed;
    eh.queries = win.host().queries;
    ed.queries = win.device().queries;
    eh.keys = win.host().keys;
    eh.values = kvp::KVSource<TestType>::from(kvp::TensorView<const TestType, 3>::contiguous(v.data(), {Hkv, T, d}));
    ed.keys = keys;
    ed.values = kvp::KVSource<TestType>::from_paged_values(pool.view, 0);
    check_scorer(kvp::ExpectedAttention(kvp::ExpectedAttentionParams::kvpress(0.5, 16, 0, true, true)), eh, ed,
                 kvp::ProblemShape{Hq, Hkv, d, T, 64}, false);
  }
  // ObservedAttention reads the whole prompt: a shorter one.
  const std::int64_t Tp = 300;
  SnapProblem<TestType> prompt(4, Hkv, 32, Tp, Tp, 103);
  const DevicePool<TestType> pool(prompt.k, prompt.k, Hkv, Tp, 32, 16);
  kvp::ScoreInput<float, TestType> din = prompt.device();
  din.keys = kvp::KVSource<TestType>::from_paged(pool.view, 0);
  check_scorer(kvp::ObservedAttention(kvp::ObservedAttentionParams{}), prompt.host(), din, kvp::ProblemShape{4, Hkv, 32, Tp, Tp}, false);
}

TEMPLATE_TEST_CASE("cuda Fp8Quant: codes, inline scales and decoded rows bit-identical to Scalar", "[cuda][fp8]", float, kvp::half,
                   kvp::bfloat16) {
  const std::int64_t H = 4, T = 300, d = 128;
  auto rows = random_vector<TestType>(static_cast<std::size_t>(H * T * d), 71, 40.0f);
  rows[5] = kvp::from_float<TestType>(0.0f);
  const float head_scales[4] = {0.01f, 0.1f, 1.0f, 10.0f};
  DeviceBuffer drows(rows);
  for (const kvp::Fp8Format f : {kvp::Fp8Format::kE4M3, kvp::Fp8Format::kE5M2})
    for (const kvp::Fp8Scale layout : {kvp::Fp8Scale::kPerTensor, kvp::Fp8Scale::kPerHead, kvp::Fp8Scale::kPerTokenHead}) {
      INFO(kvp::fp8_name(f) << " layout " << static_cast<int>(layout));
      const kvp::Fp8Quant policy(kvp::Fp8QuantParams{f, layout, 0.125f});
      kvp::Fp8Quant::State st{std::span<const float>(head_scales, 4)};
      const std::int64_t rb = policy.row_bytes(d);
      std::vector<std::uint8_t> want(static_cast<std::size_t>(H * T * rb), 0x5A);
      kvp::QuantizedKV hq{policy.layout(), kvp::TensorView<std::uint8_t, 3>::contiguous(want.data(), {H, T, rb}), {}, T};
      KVP_REQUIRE_OK(
          policy.quantize(kvp::Context<Scalar>{}, kvp::TensorView<const TestType, 3>::contiguous(rows.data(), {H, T, d}), st, hq));
      std::vector<TestType> want_y(rows.size());
      KVP_REQUIRE_OK(policy.dequantize(kvp::Context<Scalar>{}, hq, kvp::TensorView<TestType, 3>::contiguous(want_y.data(), {H, T, d}), st));

      Stream stream;
      DeviceBuffer dcodes(std::vector<std::uint8_t>(want.size(), 0x5A)), dy(rows.size() * sizeof(TestType));
      kvp::QuantizedKV dq{
          policy.layout(), kvp::TensorView<std::uint8_t, 3>::contiguous(dcodes.get<std::uint8_t>(), {H, T, rb}, kGpu), {}, T};
      const kvp::Context<Cuda> cx{{}, {}, stream.s};
      KVP_REQUIRE_OK(
          policy.quantize(cx, kvp::TensorView<const TestType, 3>::contiguous(drows.get<const TestType>(), {H, T, d}, kGpu), st, dq));
      KVP_REQUIRE_OK(policy.dequantize(cx, dq, kvp::TensorView<TestType, 3>::contiguous(dy.get<TestType>(), {H, T, d}, kGpu), st));
      stream.sync();
      REQUIRE(dcodes.download<std::uint8_t>(want.size()) == want);
      const auto got_y = dy.download<TestType>(rows.size());
      REQUIRE(std::memcmp(got_y.data(), want_y.data(), rows.size() * sizeof(TestType)) == 0);
    }
}

/// `policy` (GgmlQuant or Int4Quant) quantizes `rows` and decodes the codes on Cuda (token axes padded by `pad`
/// values / bytes, one launch per kv head) and on Scalar: identical codes and decoded rows.
template <class Policy, class T>
void check_token_rows(const Policy& policy, const std::vector<T>& rows, std::int64_t H, std::int64_t Tn, std::int64_t d, std::int64_t pad) {
  typename Policy::State st;
  const std::int64_t rb = policy.row_bytes(d);
  std::vector<std::uint8_t> want(static_cast<std::size_t>(H * Tn * rb), 0x5A);
  kvp::QuantizedKV hq{policy.layout(), kvp::TensorView<std::uint8_t, 3>::contiguous(want.data(), {H, Tn, rb}), {}, Tn};
  KVP_REQUIRE_OK(policy.quantize(kvp::Context<Scalar>{}, kvp::TensorView<const T, 3>::contiguous(rows.data(), {H, Tn, d}), st, hq));
  std::vector<T> want_y(rows.size());
  KVP_REQUIRE_OK(policy.dequantize(kvp::Context<Scalar>{}, hq, kvp::TensorView<T, 3>::contiguous(want_y.data(), {H, Tn, d})));

  std::vector<T> padded(static_cast<std::size_t>(H * Tn * (d + pad)), kvp::from_float<T>(0.0f));
  for (std::int64_t r = 0; r < H * Tn; ++r) std::copy_n(rows.begin() + r * d, d, padded.begin() + r * (d + pad));
  DeviceBuffer drows(padded), dcodes(std::vector<std::uint8_t>(static_cast<std::size_t>(H * Tn * (rb + pad)), 0x5A)),
      dy(padded.size() * sizeof(T));
  Stream stream;
  const kvp::Context<Cuda> cx{{}, {}, stream.s};
  kvp::QuantizedKV dq{policy.layout(),
                      kvp::TensorView<std::uint8_t, 3>(dcodes.get<std::uint8_t>(), {H, Tn, rb}, {Tn * (rb + pad), rb + pad, 1}, kGpu),
                      {},
                      Tn};
  KVP_REQUIRE_OK(
      policy.quantize(cx, kvp::TensorView<const T, 3>(drows.get<const T>(), {H, Tn, d}, {Tn * (d + pad), d + pad, 1}, kGpu), st, dq));
  KVP_REQUIRE_OK(policy.dequantize(cx, dq, kvp::TensorView<T, 3>(dy.get<T>(), {H, Tn, d}, {Tn * (d + pad), d + pad, 1}, kGpu)));
  stream.sync();
  const auto got = dcodes.download<std::uint8_t>(static_cast<std::size_t>(H * Tn * (rb + pad)));
  const auto got_y = dy.download<T>(padded.size());
  for (std::int64_t r = 0; r < H * Tn; ++r) {
    INFO("row " << r);
    REQUIRE(std::equal(want.begin() + r * rb, want.begin() + (r + 1) * rb, got.begin() + r * (rb + pad)));
    REQUIRE(std::memcmp(&want_y[static_cast<std::size_t>(r * d)], &got_y[static_cast<std::size_t>(r * (d + pad))],
                        static_cast<std::size_t>(d) * sizeof(T)) == 0);
  }
}

TEMPLATE_TEST_CASE("cuda GgmlQuant: every block format, with and without rotation, bit-identical to Scalar", "[cuda][ggml]", float,
                   kvp::half, kvp::bfloat16) {
  const std::int64_t H = 4, T = 300, d = 128;
  const auto rows = random_vector<TestType>(static_cast<std::size_t>(H * T * d), 81, 3.0f);
  for (const kvp::GgmlType t : {kvp::GgmlType::kQ8_0, kvp::GgmlType::kQ4_0, kvp::GgmlType::kQ4_1, kvp::GgmlType::kQ5_0,
                                kvp::GgmlType::kQ5_1, kvp::GgmlType::kIQ4_NL})
    for (const kvp::HadamardMode mode : {kvp::HadamardMode::kNone, kvp::HadamardMode::kLlamaCpp, kvp::HadamardMode::kBlock}) {
      INFO(kvp::ggml_name(t) << " rotation " << static_cast<int>(mode));
      const kvp::GgmlQuant policy(kvp::GgmlQuantParams{t, mode, 16, kvp::QuantRole::kKeys});
      check_token_rows(policy, rows, H, T, d, 0);
      check_token_rows(policy, rows, H, T, d, 32);
    }
}

TEMPLATE_TEST_CASE("cuda Int4Quant: INT4 / INT8 token rows, with and without rotation, bit-identical to Scalar", "[cuda][int4]", float,
                   kvp::half, kvp::bfloat16) {
  const std::int64_t H = 4, T = 300, d = 128;
  const auto rows = random_vector<TestType>(static_cast<std::size_t>(H * T * d), 82, 3.0f);
  for (const std::int32_t bits : {4, 8})
    for (const kvp::HadamardMode mode : {kvp::HadamardMode::kNone, kvp::HadamardMode::kLlamaCpp, kvp::HadamardMode::kBlock})
      for (const kvp::QuantRole role : {kvp::QuantRole::kKeys, kvp::QuantRole::kValues}) {
        INFO("bits " << bits << " rotation " << static_cast<int>(mode) << " role " << static_cast<int>(role));
        const kvp::Int4Quant policy(kvp::Int4QuantParams{bits, mode, 32, role});
        check_token_rows(policy, rows, H, T, d, 0);
        check_token_rows(policy, rows, H, T, d, 6);
      }
}

TEMPLATE_TEST_CASE("cuda KiviQuant: one-shot codes, decoded rows and a streamed append bit-identical to Scalar", "[cuda][kivi]", float,
                   kvp::half, kvp::bfloat16) {
  const std::int64_t H = 4, D = 128, prompt = 300, steps = 20, total = prompt + steps;
  const auto x = random_vector<TestType>(static_cast<std::size_t>(H * total * D), 83, 3.0f);
  DeviceBuffer dx(x);
  const auto slice = [&](const TestType* base, std::int64_t from, std::int64_t n, kvp::Device dev) {
    return kvp::TensorView<const TestType, 3>(base + from * D, {H, n, D}, {total * D, D, 1}, dev);
  };
  for (const kvp::QuantRole role : {kvp::QuantRole::kKeys, kvp::QuantRole::kValues})
    for (const std::int32_t bits : {2, 4, 8}) {
      INFO((role == kvp::QuantRole::kKeys ? "keys" : "values") << " bits " << bits);
      const std::int64_t R = role == kvp::QuantRole::kKeys ? 128 : 32;
      const kvp::KiviQuant p(kvp::KiviQuantParams{role, bits, 32, static_cast<std::int32_t>(R)});
      const std::int64_t rows = p.code_rows(total), cb = p.codes_row_bytes(D), sb = p.scales_row_bytes(D);
      const auto region = [&](std::uint8_t* codes, std::uint8_t* scales, kvp::Device dev) {
        return kvp::QuantizedKV{p.layout(), kvp::TensorView<std::uint8_t, 3>::contiguous(codes, {H, rows, cb}, dev),
                                kvp::TensorView<std::uint8_t, 3>::contiguous(scales, {H, rows, sb}, dev), 0};
      };
      // Streamed on both backends: the prompt, then one token per step.
      std::vector<std::uint8_t> hc(static_cast<std::size_t>(H * rows * cb), 0xA5), hs(static_cast<std::size_t>(H * rows * sb), 0x5A);
      std::vector<kvp::half> hres(static_cast<std::size_t>(H * R * D));
      kvp::QuantizedKV hq = region(hc.data(), hs.data(), {});
      kvp::KiviState hst{kvp::TensorView<kvp::half, 3>::contiguous(hres.data(), {H, R, D}), 0};
      DeviceBuffer dc(std::vector<std::uint8_t>(hc.size(), 0xA5)), ds(std::vector<std::uint8_t>(hs.size(), 0x5A)),
          dres(hres.size() * sizeof(kvp::half));
      kvp::QuantizedKV dq = region(dc.get<std::uint8_t>(), ds.get<std::uint8_t>(), kGpu);
      kvp::KiviState dst{kvp::TensorView<kvp::half, 3>::contiguous(dres.get<kvp::half>(), {H, R, D}, kGpu), 0};
      Stream stream;
      const kvp::Context<Cuda> cx{{}, {}, stream.s};
      for (std::int64_t s0 = 0; s0 < total; s0 = s0 == 0 ? prompt : s0 + 1) {
        const std::int64_t n = s0 == 0 ? prompt : 1;
        KVP_REQUIRE_OK(p.append(kvp::Context<Scalar>{}, slice(x.data(), s0, n, {}), hst, hq));
        KVP_REQUIRE_OK(p.append(cx, slice(dx.get<const TestType>(), s0, n, kGpu), dst, dq));
        REQUIRE(dq.tokens == hq.tokens);
        REQUIRE(dst.residual_len == hst.residual_len);
      }
      stream.sync();
      // CHECK rather than REQUIRE from here on, so that one run on a GPU
      // reports every (role, bits) that differs, not only the first.
      CHECK(dc.download<std::uint8_t>(hc.size()) == hc);
      CHECK(ds.download<std::uint8_t>(hs.size()) == hs);
      // Only rows [0, residual_len) of each head are state (KiviState); the
      // rest of the device buffer is whatever cudaMalloc handed back.
      const auto got_res = dres.download<kvp::half>(hres.size());
      const std::int64_t live = hst.residual_len * D;
      for (std::int64_t h = 0; h < H; ++h) {
        INFO("kv head " << h << ", " << hst.residual_len << " residual rows");
        CHECK(std::memcmp(got_res.data() + h * R * D, hres.data() + h * R * D, static_cast<std::size_t>(live) * sizeof(kvp::half)) == 0);
      }
      // Decoded.
      const std::int64_t T = hq.tokens;
      std::vector<TestType> want(static_cast<std::size_t>(H * T * D));
      KVP_REQUIRE_OK(p.dequantize(kvp::Context<Scalar>{}, hq, kvp::TensorView<TestType, 3>::contiguous(want.data(), {H, T, D})));
      DeviceBuffer dy(want.size() * sizeof(TestType));
      KVP_REQUIRE_OK(p.dequantize(cx, dq, kvp::TensorView<TestType, 3>::contiguous(dy.get<TestType>(), {H, T, D}, kGpu)));
      stream.sync();
      const auto got = dy.download<TestType>(want.size());
      CHECK(std::memcmp(got.data(), want.data(), want.size() * sizeof(TestType)) == 0);
    }
}

TEST_CASE("cuda rank_tiers: kept positions and tiers equal to Scalar on rows with ties, -0 / +0, infinities and NaN", "[cuda][mixed]") {
  for (const std::int64_t n : {1, 37, 300, 5000}) {
    const std::int64_t rows = 5, out_ld = n + 3;
    std::vector<float> s = edge_scores(static_cast<std::size_t>(rows * n), static_cast<std::uint32_t>(n + 7));
    for (std::size_t i = 0; i < s.size(); i += 11) s[i] = i % 2 ? -0.0f : 0.0f;
    DeviceBuffer ds(s);
    for (const auto& [keep, full] : {std::pair<std::int64_t, std::int64_t>{n, 0}, {n, n}, {(n + 1) / 2, n / 5}, {1, 1}, {n / 3, n / 3}}) {
      INFO("n " << n << " keep " << keep << " full " << full);
      std::vector<std::int32_t> want(static_cast<std::size_t>(rows * out_ld), -1);
      std::vector<std::uint8_t> want_t(want.size(), 7);
      std::vector<std::byte> ws(Scalar::rank_tiers_workspace(n));
      Scalar::rank_tiers(s.data(), rows, n, n, keep, full, want.data(), want_t.data(), out_ld, kvp::Workspace{ws.data(), ws.size()});
      DeviceBuffer di(std::vector<std::int32_t>(want.size(), -1)), dt(std::vector<std::uint8_t>(want.size(), 7));
      const Stream st;
      run_ops(st, [&] {
        Cuda::rank_tiers(ds.get<const float>(), rows, n, n, keep, full, di.get<std::int32_t>(), dt.get<std::uint8_t>(), out_ld, {});
      });
      REQUIRE(di.download<std::int32_t>(want.size()) == want);
      REQUIRE(dt.download<std::uint8_t>(want.size()) == want_t);
    }
  }
}

TEST_CASE("cuda MixedPrecision<SnapKV, GgmlQuant>: the device decision ranks the device scores exactly as Scalar", "[cuda][mixed]") {
  const std::int64_t Hq = 8, Hkv = 2, d = 64, T = 700, w = 16;
  const auto q = random_vector<float>(static_cast<std::size_t>(Hq * w * d), 91);
  const auto k = random_vector<kvp::half>(static_cast<std::size_t>(Hkv * T * d), 92);
  DeviceBuffer dq(q), dk(k);
  kvp::ScoreInput<float, kvp::half> in{
      kvp::TensorView<const float, 3>::contiguous(dq.get<const float>(), {Hq, w, d}, kGpu),
      kvp::KVSource<kvp::half>::from(kvp::TensorView<const kvp::half, 3>::contiguous(dk.get<const kvp::half>(), {Hkv, T, d}, kGpu))};
  const kvp::SnapKV snap(kvp::SnapKVParams::kvpress(0.5, w, 5));
  const kvp::MixedPrecision<kvp::SnapKV, kvp::GgmlQuant> mp(snap, kvp::GgmlQuant(kvp::GgmlQuantParams{kvp::GgmlType::kQ4_0}),
                                                            kvp::MixedPrecisionParams{0.2, 0.0, 0.4});
  const kvp::ProblemShape shape{Hq, Hkv, d, T, w};
  const kvp::Requirements req = mp.requirements(kvp::Context<Cuda>{}, shape);
  KVP_REQUIRE_OK(req.status);
  const kvp::MixedSplit sp = mp.split(T, d, sizeof(kvp::half));
  const std::int64_t n = sp.full + sp.low;
  DeviceBuffer dws(req.workspace_bytes), didx(static_cast<std::size_t>(Hkv * n) * sizeof(std::int32_t)),
      dfull(static_cast<std::size_t>(Hkv * n));
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(Hkv + 1));
  Stream stream;
  KVP_REQUIRE_OK(mp.decide(kvp::Context<Cuda>{kvp::Workspace{dws.get<void>(), req.workspace_bytes}, {}, stream.s}, in,
                           kvp::KeepSet{indptr.data(), didx.get<std::int32_t>(), Hkv, Hkv * n},
                           std::span<std::uint8_t>(dfull.get<std::uint8_t>(), static_cast<std::size_t>(Hkv * n))));
  // The same device scores, ranked by the scalar reference.
  const kvp::Requirements sreq = snap.requirements(kvp::Context<Cuda>{}, shape);
  DeviceBuffer sws(sreq.workspace_bytes), dscores(static_cast<std::size_t>(Hkv * T) * sizeof(float));
  KVP_REQUIRE_OK(snap.score(kvp::Context<Cuda>{kvp::Workspace{sws.get<void>(), sreq.workspace_bytes}, {}, stream.s}, in,
                            kvp::TensorView<float, 2>::contiguous(dscores.get<float>(), {Hkv, T})));
  stream.sync();
  const auto scores = dscores.download<float>(static_cast<std::size_t>(Hkv * T));
  std::vector<std::int32_t> want(static_cast<std::size_t>(Hkv * n));
  std::vector<std::uint8_t> want_full(want.size());
  std::vector<std::byte> ws(Scalar::rank_tiers_workspace(T));
  Scalar::rank_tiers(scores.data(), Hkv, T, T, n, sp.full, want.data(), want_full.data(), n, kvp::Workspace{ws.data(), ws.size()});
  for (std::int64_t h = 0; h <= Hkv; ++h) REQUIRE(indptr[static_cast<std::size_t>(h)] == h * n);
  REQUIRE(didx.download<std::int32_t>(want.size()) == want);
  REQUIRE(dfull.download<std::uint8_t>(want.size()) == want_full);
}

/// QuantizedKeys<S, P> on Cuda (codes, scales and KIVI's residual uploaded) vs Scalar, `w` query rows: the
/// scores of S on the decoded keys, within the window scores' device tolerance (1e-5 relative; protected
/// +inf exact). TOVA's rows are the mean over the heads, equal in every row.
template <class S, class P>
void check_quantized_keys(const S& scorer, const P& p, std::int64_t w) {
  const std::int64_t Hq = 8, H = 2, d = 64, T = 256;
  const auto q = random_vector<float>(static_cast<std::size_t>(Hq * w * d), 93);
  const auto k = random_vector<float>(static_cast<std::size_t>(H * T * d), 94, 2.0f);
  const auto rows = kvp::TensorView<const float, 3>::contiguous(k.data(), {H, T, d});
  std::vector<std::uint8_t> codes, scales;
  std::vector<kvp::half> residual;
  kvp::QuantKeys keys;
  keys.dim = d;
  if constexpr (std::is_same_v<P, kvp::KiviQuant>) {
    const std::int64_t R = p.params().residual, n = p.code_rows(T);
    codes.resize(static_cast<std::size_t>(H * n * p.codes_row_bytes(d)));
    scales.resize(static_cast<std::size_t>(H * n * p.scales_row_bytes(d)));
    residual.resize(static_cast<std::size_t>(H * R * d));
    kvp::KiviState st{kvp::TensorView<kvp::half, 3>::contiguous(residual.data(), {H, R, d}), 0};
    keys.region = kvp::QuantizedKV{p.layout(), kvp::TensorView<std::uint8_t, 3>::contiguous(codes.data(), {H, n, p.codes_row_bytes(d)}),
                                   kvp::TensorView<std::uint8_t, 3>::contiguous(scales.data(), {H, n, p.scales_row_bytes(d)}), 0};
    KVP_REQUIRE_OK(p.append(kvp::Context<Scalar>{}, rows, st, keys.region));
    keys.residual = kvp::TensorView<const kvp::half, 3>::contiguous(residual.data(), {H, R, d});
    keys.residual_len = st.residual_len;
  } else {
    codes.resize(static_cast<std::size_t>(H * T * p.row_bytes(d)));
    keys.region = kvp::QuantizedKV{p.layout(), kvp::TensorView<std::uint8_t, 3>::contiguous(codes.data(), {H, T, p.row_bytes(d)}), {}, T};
    typename P::State st{};
    KVP_REQUIRE_OK(p.quantize(kvp::Context<Scalar>{}, rows, st, keys.region));
  }
  const kvp::QuantizedKeys<S, P> qs(scorer, p);
  const kvp::ProblemShape shape{Hq, H, d, T, w};
  const kvp::QuantScoreInput<float> hin{kvp::TensorView<const float, 3>::contiguous(q.data(), {Hq, w, d}), keys};
  const auto hreq = qs.requirements(kvp::Context<Scalar>{}, shape);
  std::vector<std::byte> hws(hreq.workspace_bytes);
  std::vector<float> ref(static_cast<std::size_t>(H * T));
  KVP_REQUIRE_OK(qs.score(kvp::Context<Scalar>{kvp::Workspace{hws.data(), hws.size()}}, hin,
                          kvp::TensorView<float, 2>::contiguous(ref.data(), {H, T})));

  DeviceBuffer dq(q), dc(codes), dsc(scales.empty() ? std::vector<std::uint8_t>(1) : scales),
      dres(residual.empty() ? std::vector<kvp::half>(1) : residual);
  kvp::QuantScoreInput<float> din = hin;
  din.queries = kvp::TensorView<const float, 3>::contiguous(dq.get<const float>(), {Hq, w, d}, kGpu);
  const auto& c = keys.region.codes;
  din.keys.region.codes = kvp::TensorView<std::uint8_t, 3>(dc.get<std::uint8_t>(), c.extents(), c.strides(), kGpu);
  if (!scales.empty())
    din.keys.region.scales =
        kvp::TensorView<std::uint8_t, 3>(dsc.get<std::uint8_t>(), keys.region.scales.extents(), keys.region.scales.strides(), kGpu);
  if (keys.residual_len > 0)
    din.keys.residual =
        kvp::TensorView<const kvp::half, 3>(dres.get<const kvp::half>(), keys.residual.extents(), keys.residual.strides(), kGpu);
  const auto dreq = qs.requirements(kvp::Context<Cuda>{}, shape);
  KVP_REQUIRE_OK(dreq.status);
  DeviceBuffer dws(dreq.workspace_bytes), dout(ref.size() * sizeof(float));
  Stream st;
  KVP_REQUIRE_OK(
      qs.score(kvp::Context<Cuda>{dws.workspace(), {}, st.s}, din, kvp::TensorView<float, 2>::contiguous(dout.get<float>(), {H, T}, kGpu)));
  st.sync();
  const auto got = dout.download<float>(ref.size());
  for (std::size_t i = 0; i < ref.size(); ++i) {
    INFO("score " << i << ": " << got[i] << " vs " << ref[i]);
    if (std::isinf(ref[i]))
      REQUIRE(got[i] == ref[i]);
    else
      REQUIRE(std::fabs(got[i] - ref[i]) <= 1e-5f * std::fabs(ref[i]) + 1e-12f);
  }
  if constexpr (kvp::kScoresSharedAcrossHeads<S>)
    for (std::int64_t j = 0; j < T; ++j) REQUIRE(got[static_cast<std::size_t>(j)] == got[static_cast<std::size_t>(T + j)]);
}

TEST_CASE("cuda QuantizedKeys<SnapKV, *> and <TOVA, *>: scores from ggml / INT4 / fp8 / KIVI codes equal Scalar's",
          "[cuda][quantized_keys]") {
  const kvp::SnapKV snap(kvp::SnapKVParams::kvpress(0.5, 16, 5));
  check_quantized_keys(snap, kvp::GgmlQuant(kvp::GgmlQuantParams{kvp::GgmlType::kQ4_0}), 16);
  check_quantized_keys(snap, kvp::Int4Quant{}, 16);
  check_quantized_keys(snap, kvp::Fp8Quant{}, 16);
  check_quantized_keys(snap, kvp::KiviQuant(kvp::KiviQuantParams{kvp::QuantRole::kKeys, 2, 32, 64}), 16);
  const kvp::TOVA tova(kvp::TOVAParams{kvp::Budget::compression_ratio(0.5)});
  check_quantized_keys(tova, kvp::GgmlQuant(kvp::GgmlQuantParams{kvp::GgmlType::kQ8_0, kvp::HadamardMode::kLlamaCpp}), 4);
  check_quantized_keys(tova, kvp::KiviQuant(kvp::KiviQuantParams{kvp::QuantRole::kKeys, 2, 32, 64}), 4);
}

namespace {

/// Dense device plan rows against the host's compacted plan, row by row: `window` entries per candidate
/// (one src per block of them; 1 for the MergeRule policies), the entries with dst >= 0, in order, equal
/// to the host's, the others of weight 0. Returns the number of merged entries.
std::int64_t require_dense_rows(const std::vector<std::int32_t>& dindptr, const std::vector<std::int32_t>& gdst,
                                const std::vector<std::int32_t>& gsrc, const std::vector<float>& gweight,
                                const std::vector<std::int32_t>& hindptr, const std::vector<std::int32_t>& hdst,
                                const std::vector<std::int32_t>& hsrc, const std::vector<float>& hweight, std::int64_t H,
                                std::int64_t window) {
  std::int64_t merged = 0;
  for (std::int64_t h = 0; h < H; ++h) {
    REQUIRE((dindptr[h + 1] - dindptr[h]) % window == 0);
    std::int32_t hi = hindptr[h];
    for (std::int32_t i = dindptr[h]; i < dindptr[h + 1]; ++i) {
      INFO("head " << h << " dense entry " << i - dindptr[h]);
      REQUIRE(gsrc[i] == gsrc[i - (i - dindptr[h]) % window]);
      if (gdst[i] < 0) {
        REQUIRE(gweight[i] == 0.0f);
        continue;
      }
      REQUIRE(hi < hindptr[h + 1]);
      REQUIRE(gdst[i] == hdst[hi]);
      REQUIRE(gsrc[i] == hsrc[hi]);
      REQUIRE(same_bits({gweight[i]}, {hweight[hi]}));
      ++hi;
      ++merged;
    }
    REQUIRE(hi == hindptr[h + 1]);
  }
  return merged;
}

/// One merge policy on Scalar (host, compacted plan) and on Cuda (device, dense plan rows): entries of merged
/// tokens, merged rows and state weights bit-identical; every dense entry names its evicted token.
template <class T, class Policy, class MakeInput>
void require_cuda_merge(const Policy& policy, MakeInput&& make_input, std::int64_t H, std::int64_t T_, std::int64_t d, bool keys,
                        bool state) {
  Stream st;
  const auto k = random_vector<T>(static_cast<std::size_t>(H * T_ * d), 41), v = random_vector<T>(static_cast<std::size_t>(H * T_ * d), 42);
  std::vector<std::int32_t> kindptr{0}, kind;
  for (std::int64_t h = 0; h < H; ++h) {
    for (std::int32_t j = 0; j < T_; ++j)
      if (h == 2 ? false : (h == 3 || j < 4 || j >= T_ - 8 || (j * 7 + h) % 5 == 0)) kind.push_back(j);
    kindptr.push_back(static_cast<std::int32_t>(kind.size()));
  }
  std::vector<float> w(static_cast<std::size_t>(H * T_));
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = 0.5f + static_cast<float>(i % 7) * 0.25f;
  const std::int64_t cap = H * T_, rows = H * T_;
  // Host reference.
  std::vector<std::int32_t> hindptr(H + 1), hdst(cap), hsrc(cap);
  std::vector<float> hweight(cap), hkeys(keys ? rows * d : 0, -7.0f), hvalues(rows * d, -7.0f), hw = w;
  kvp::MergePlan hplan{hindptr.data(), hdst.data(), hsrc.data(), hweight.data(), H, cap};
  if (keys) hplan.merged_keys = kvp::TensorView<float, 2>::contiguous(hkeys.data(), {rows, d});
  hplan.merged_values = kvp::TensorView<float, 2>::contiguous(hvalues.data(), {rows, d});
  hplan.slots_per_row = T_;
  const kvp::KeepSet hkeep{kindptr.data(), kind.data(), H, static_cast<std::int64_t>(kind.size())};
  const auto hreq = policy.requirements(kvp::Context<Scalar>{}, kvp::ProblemShape{H, H, d, T_, 1});
  std::vector<std::byte> hws(hreq.workspace_bytes);
  KVP_REQUIRE_OK(policy.merge(kvp::Context<Scalar>{kvp::Workspace{hws.data(), hws.size()}},
                              make_input(kvp::TensorView<const T, 3>::contiguous(k.data(), {H, T_, d}),
                                         kvp::TensorView<const T, 3>::contiguous(v.data(), {H, T_, d}),
                                         state ? kvp::TensorView<float, 2>::contiguous(hw.data(), {H, T_}) : kvp::TensorView<float, 2>{}),
                              hkeep, hplan));
  // Device run.
  const kvp::Device dev{kvp::DeviceType::kCUDA, 0};
  DeviceBuffer dk(k), dv(v), dkind(kind), dw(w), ddst(cap * sizeof(std::int32_t)), dsrc(cap * sizeof(std::int32_t)),
      dweight(cap * sizeof(float)), dkeys(std::vector<float>(keys ? rows * d : 1, -7.0f)), dvalues(std::vector<float>(rows * d, -7.0f));
  std::vector<std::int32_t> dindptr(H + 1);
  kvp::MergePlan dplan{dindptr.data(), ddst.get<std::int32_t>(), dsrc.get<std::int32_t>(), dweight.get<float>(), H, cap};
  if (keys) dplan.merged_keys = kvp::TensorView<float, 2>::contiguous(dkeys.get<float>(), {rows, d}, dev);
  dplan.merged_values = kvp::TensorView<float, 2>::contiguous(dvalues.get<float>(), {rows, d}, dev);
  dplan.slots_per_row = T_;
  const kvp::KeepSet dkeep{kindptr.data(), dkind.get<std::int32_t>(), H, static_cast<std::int64_t>(kind.size())};
  const auto dreq = policy.requirements(kvp::Context<Cuda>{}, kvp::ProblemShape{H, H, d, T_, 1});
  KVP_REQUIRE_OK(dreq.status);
  DeviceBuffer dws(dreq.workspace_bytes);
  KVP_REQUIRE_OK(
      policy.merge(kvp::Context<Cuda>{dws.workspace(), {}, st.s},
                   make_input(kvp::TensorView<const T, 3>::contiguous(dk.get<const T>(), {H, T_, d}, dev),
                              kvp::TensorView<const T, 3>::contiguous(dv.get<const T>(), {H, T_, d}, dev),
                              state ? kvp::TensorView<float, 2>::contiguous(dw.get<float>(), {H, T_}, dev) : kvp::TensorView<float, 2>{}),
                   dkeep, dplan));
  st.sync();
  const auto gdst = ddst.download<std::int32_t>(static_cast<std::size_t>(dindptr[H]));
  const auto gsrc = dsrc.download<std::int32_t>(static_cast<std::size_t>(dindptr[H]));
  const auto gweight = dweight.download<float>(static_cast<std::size_t>(dindptr[H]));
  for (std::int64_t h = 0; h < H; ++h) REQUIRE(dindptr[h + 1] - dindptr[h] == T_ - (kindptr[h + 1] - kindptr[h]));
  REQUIRE(require_dense_rows(dindptr, gdst, gsrc, gweight, hindptr, hdst, hsrc, hweight, H, 1) > 0);
  if (keys) REQUIRE(same_bits(dkeys.download<float>(hkeys.size()), hkeys));
  REQUIRE(same_bits(dvalues.download<float>(hvalues.size()), hvalues));
  if (state) REQUIRE(same_bits(dw.download<float>(hw.size()), hw));
}

}  // namespace

TEMPLATE_TEST_CASE("cuda merging: kvpress MergingPress, LOOK-M and NearestKeptMerge through merge_head equal Scalar bit for bit",
                   "[cuda][merging]", float, kvp::half, kvp::bfloat16) {
  using T = TestType;
  const std::int64_t H = 4, T_ = 301, d = 72;
  auto plain = [](kvp::TensorView<const T, 3> k, kvp::TensorView<const T, 3> v, kvp::TensorView<float, 2>) {
    kvp::MergeInput<T> in;
    in.keys = kvp::KVSource<T>::from(k);
    in.values = kvp::KVSource<T>::from(v);
    return in;
  };
  auto with_state = [](kvp::TensorView<const T, 3> k, kvp::TensorView<const T, 3> v, kvp::TensorView<float, 2> w) {
    kvp::NearestKeptInput<T> in;
    in.keys = kvp::KVSource<T>::from(k);
    in.values = kvp::KVSource<T>::from(v);
    in.state.weights = w;
    return in;
  };
  require_cuda_merge<T>(kvp::KvpressMerging(kvp::KvpressMergingParams{0.0f, 1.0f}), plain, H, T_, d, false, false);
  require_cuda_merge<T>(kvp::KvpressMerging(kvp::KvpressMergingParams{0.05f, 0.4f}), plain, H, T_, d, false, false);
  require_cuda_merge<T>(kvp::LookMPivot{}, plain, H, T_, d, true, false);
  require_cuda_merge<T>(kvp::NearestKeptMerge{}, with_state, H, T_, d, true, true);
  require_cuda_merge<T>(kvp::NearestKeptMerge(kvp::NearestKeptMergeParams{0.0f, true}), with_state, H, T_, d, true, true);
}

TEMPLATE_TEST_CASE("cuda merging: D2O (merge_nearest, d2o_decide, merge_apply) equals Scalar bit for bit, EMA state included",
                   "[cuda][merging][d2o]", float, kvp::half, kvp::bfloat16) {
  using T = TestType;
  Stream st;
  const std::int64_t H = 4, T_ = 301, d = 72, cap = H * T_, rows = H * T_;
  const auto k = random_vector<T>(static_cast<std::size_t>(H * T_ * d), 51), v = random_vector<T>(static_cast<std::size_t>(H * T_ * d), 52);
  std::vector<std::int32_t> kindptr{0}, kind;
  for (std::int64_t h = 0; h < H; ++h) {  // equal counts, different tokens per head
    std::vector<std::int32_t> r;
    for (std::int32_t j = 0; j < 4; ++j) r.push_back(j);
    for (std::int64_t i = 0; i < 60; ++i) r.push_back(static_cast<std::int32_t>(4 + (i * 7 + h) % (T_ - 36)));
    for (std::int32_t j = static_cast<std::int32_t>(T_) - 32; j < T_; ++j) r.push_back(j);
    std::sort(r.begin(), r.end());
    r.erase(std::unique(r.begin(), r.end()), r.end());
    REQUIRE(r.size() == 96);
    kind.insert(kind.end(), r.begin(), r.end());
    kindptr.push_back(static_cast<std::int32_t>(kind.size()));
  }
  const kvp::Device dev{kvp::DeviceType::kCUDA, 0};
  DeviceBuffer dk(k), dv(v), dkind(kind), dst_(cap * sizeof(std::int32_t)), src_(cap * sizeof(std::int32_t)), wt_(cap * sizeof(float)),
      dkeys(std::vector<float>(rows * d, -7.0f)), dvalues(std::vector<float>(rows * d, -7.0f)), dstate(sizeof(kvp::D2OState));
  for (const kvp::D2OWeighting wt : {kvp::D2OWeighting::kAsCoded, kvp::D2OWeighting::kNormalized}) {
    kvp::D2OParams prm;
    prm.weighting = wt;
    const kvp::D2O policy(prm);
    kvp::D2OState hs;
    dstate.upload(std::vector<kvp::D2OState>{kvp::D2OState{}});
    for (int step = 0; step < 2; ++step) {
      INFO("weighting " << static_cast<int>(wt) << " step " << step);
      std::vector<std::int32_t> hindptr(H + 1), hdst(cap), hsrc(cap);
      std::vector<float> hweight(cap), hkeys(rows * d, -7.0f), hvalues(rows * d, -7.0f);
      kvp::MergePlan hplan{hindptr.data(), hdst.data(), hsrc.data(), hweight.data(), H, cap};
      hplan.merged_keys = kvp::TensorView<float, 2>::contiguous(hkeys.data(), {rows, d});
      hplan.merged_values = kvp::TensorView<float, 2>::contiguous(hvalues.data(), {rows, d});
      hplan.slots_per_row = T_;
      kvp::D2OInput<T> hin;
      hin.keys = kvp::KVSource<T>::from(kvp::TensorView<const T, 3>::contiguous(k.data(), {H, T_, d}));
      hin.values = kvp::KVSource<T>::from(kvp::TensorView<const T, 3>::contiguous(v.data(), {H, T_, d}));
      hin.state = &hs;
      const auto hreq = policy.requirements(kvp::Context<Scalar>{}, kvp::ProblemShape{H, H, d, T_, 1});
      std::vector<std::byte> hws(hreq.workspace_bytes);
      KVP_REQUIRE_OK(policy.merge(kvp::Context<Scalar>{kvp::Workspace{hws.data(), hws.size()}}, hin,
                                  kvp::KeepSet{kindptr.data(), kind.data(), H, static_cast<std::int64_t>(kind.size())}, hplan));
      dkeys.upload(std::vector<float>(rows * d, -7.0f));
      dvalues.upload(std::vector<float>(rows * d, -7.0f));
      std::vector<std::int32_t> dindptr(H + 1);
      kvp::MergePlan dplan{dindptr.data(), dst_.get<std::int32_t>(), src_.get<std::int32_t>(), wt_.get<float>(), H, cap};
      dplan.merged_keys = kvp::TensorView<float, 2>::contiguous(dkeys.get<float>(), {rows, d}, dev);
      dplan.merged_values = kvp::TensorView<float, 2>::contiguous(dvalues.get<float>(), {rows, d}, dev);
      dplan.slots_per_row = T_;
      kvp::D2OInput<T> din;
      din.keys = kvp::KVSource<T>::from(kvp::TensorView<const T, 3>::contiguous(dk.get<const T>(), {H, T_, d}, dev));
      din.values = kvp::KVSource<T>::from(kvp::TensorView<const T, 3>::contiguous(dv.get<const T>(), {H, T_, d}, dev));
      din.state = dstate.get<kvp::D2OState>();
      const auto dreq = policy.requirements(kvp::Context<Cuda>{}, kvp::ProblemShape{H, H, d, T_, 1});
      DeviceBuffer dws(dreq.workspace_bytes);
      KVP_REQUIRE_OK(policy.merge(kvp::Context<Cuda>{dws.workspace(), {}, st.s}, din,
                                  kvp::KeepSet{kindptr.data(), dkind.get<std::int32_t>(), H, static_cast<std::int64_t>(kind.size())},
                                  dplan));
      st.sync();
      const auto gdst = dst_.download<std::int32_t>(static_cast<std::size_t>(dindptr[H]));
      const auto gsrc = src_.download<std::int32_t>(static_cast<std::size_t>(dindptr[H]));
      const auto gw = wt_.download<float>(static_cast<std::size_t>(dindptr[H]));
      std::int64_t hi = 0;
      for (std::int32_t i = 0; i < dindptr[H]; ++i) {
        if (gdst[i] < 0) continue;
        REQUIRE(hi < hindptr[H]);
        REQUIRE(gdst[i] == hdst[hi]);
        REQUIRE(gsrc[i] == hsrc[hi]);
        REQUIRE(same_bits({gw[i]}, {hweight[hi]}));
        ++hi;
      }
      REQUIRE(hi == hindptr[H]);
      REQUIRE(hi > 0);
      REQUIRE(same_bits(dkeys.download<float>(hkeys.size()), hkeys));
      REQUIRE(same_bits(dvalues.download<float>(hvalues.size()), hvalues));
      const auto gs = dstate.download<kvp::D2OState>(1);
      REQUIRE(gs[0].initialised);
      REQUIRE(same_bits({gs[0].tau}, {hs.tau}));
    }
  }
}

int main(int argc, char** argv) {
  if (!kvp_cuda_test::have_device()) return 77;
  return Catch::Session().run(argc, argv);
}

namespace {

/// CaM (streaming) or kvpress CAMPress on Scalar (host, compacted plan) and on Cuda (device, dense plan:
/// `window` entries per candidate): drawn entries and merged value rows bit-identical, the draws being
/// torch's CPU generator reproduced on the device.
template <class T, class Policy>
void require_cuda_cam(const Policy& policy, std::int64_t window, bool shared_keep, std::int64_t group, std::int64_t new_tokens,
                      std::uint32_t seed) {
  Stream st;
  const std::int64_t H = 4, T_ = 157, d = 40, cap = H * T_ * window, rows = H * T_, R = H * group;
  const auto v = random_vector<T>(static_cast<std::size_t>(H * T_ * d), 61);
  std::mt19937 rng(62);
  std::uniform_real_distribution<float> ud(0.0f, 2.0f);
  std::vector<float> sums(static_cast<std::size_t>(R * T_)), scores(static_cast<std::size_t>(H * T_));
  for (std::size_t i = 0; i < sums.size(); ++i) sums[i] = (i * 13 + 5) % 11 == 0 ? 0.0f : ud(rng) * (i % 9 == 0 ? 40.0f : 1.0f);
  for (std::size_t i = 0; i < scores.size(); ++i) scores[i] = static_cast<float>((i * 7) % 5);  // tied means
  std::vector<std::int32_t> kindptr{0}, kind;
  for (std::int64_t h = 0; h < H; ++h) {
    for (std::int32_t j = 0; j < T_; ++j)
      if (shared_keep ? (j < 4 || j >= T_ - 6 || j % 3 == 0) : (h != 2 && (j < 4 || j >= T_ - 8 || (j * 7 + h) % 5 == 0)))
        kind.push_back(j);
    kindptr.push_back(static_cast<std::int32_t>(kind.size()));
  }
  auto input = [&](const T* vp, const float* sp, const float* scp, kvp::Device dev) {
    kvp::MergeInput<T> in;
    in.values = kvp::KVSource<T>::from(kvp::TensorView<const T, 3>::contiguous(vp, {H, T_, d}, dev));
    in.attention_sums = kvp::TensorView<const float, 2>::contiguous(sp, {R, T_}, dev);
    in.scores = kvp::TensorView<const float, 2>::contiguous(scp, {H, T_}, dev);
    in.new_tokens = new_tokens;
    in.seed = seed;
    return in;
  };
  const kvp::ProblemShape shape{R, H, d, T_, 1};
  std::vector<std::int32_t> hindptr(H + 1), hdst(cap), hsrc(cap);
  std::vector<float> hweight(cap), hvalues(rows * d, -7.0f);
  kvp::MergePlan hplan{hindptr.data(), hdst.data(), hsrc.data(), hweight.data(), H, cap};
  hplan.merged_values = kvp::TensorView<float, 2>::contiguous(hvalues.data(), {rows, d});
  hplan.slots_per_row = T_;
  const auto hreq = policy.requirements(kvp::Context<Scalar>{}, shape);
  std::vector<std::byte> hws(hreq.workspace_bytes);
  KVP_REQUIRE_OK(policy.merge(kvp::Context<Scalar>{kvp::Workspace{hws.data(), hws.size()}}, input(v.data(), sums.data(), scores.data(), {}),
                              kvp::KeepSet{kindptr.data(), kind.data(), H, static_cast<std::int64_t>(kind.size())}, hplan));
  const kvp::Device dev{kvp::DeviceType::kCUDA, 0};
  DeviceBuffer dv(v), dsums(sums), dscores(scores), dkind(kind), ddst(cap * sizeof(std::int32_t)), dsrc(cap * sizeof(std::int32_t)),
      dweight(cap * sizeof(float)), dvalues(std::vector<float>(rows * d, -7.0f));
  std::vector<std::int32_t> dindptr(H + 1);
  kvp::MergePlan dplan{dindptr.data(), ddst.get<std::int32_t>(), dsrc.get<std::int32_t>(), dweight.get<float>(), H, cap};
  dplan.merged_values = kvp::TensorView<float, 2>::contiguous(dvalues.get<float>(), {rows, d}, dev);
  dplan.slots_per_row = T_;
  const auto dreq = policy.requirements(kvp::Context<Cuda>{}, shape);
  KVP_REQUIRE_OK(dreq.status);
  DeviceBuffer dws(dreq.workspace_bytes);
  KVP_REQUIRE_OK(policy.merge(kvp::Context<Cuda>{dws.workspace(), {}, st.s},
                              input(dv.get<const T>(), dsums.get<const float>(), dscores.get<const float>(), dev),
                              kvp::KeepSet{kindptr.data(), dkind.get<std::int32_t>(), H, static_cast<std::int64_t>(kind.size())}, dplan));
  st.sync();
  const auto gdst = ddst.download<std::int32_t>(static_cast<std::size_t>(dindptr[H]));
  const auto gsrc = dsrc.download<std::int32_t>(static_cast<std::size_t>(dindptr[H]));
  const auto gweight = dweight.download<float>(static_cast<std::size_t>(dindptr[H]));
  REQUIRE(require_dense_rows(dindptr, gdst, gsrc, gweight, hindptr, hdst, hsrc, hweight, H, window) > 0);
  REQUIRE(same_bits(dvalues.download<float>(hvalues.size()), hvalues));
}

}  // namespace

TEMPLATE_TEST_CASE("cuda merging: CaM streaming (torch's generator on the device) equals Scalar bit for bit", "[cuda][merging][cam]", float,
                   kvp::half, kvp::bfloat16) {
  for (const std::int64_t group : {1, 2})
    for (const std::int32_t M : {16, 5})
      for (const std::uint32_t seed : {0u, 1234u}) {
        INFO("group " << group << " merge_num " << M << " seed " << seed);
        require_cuda_cam<TestType>(kvp::CaM(kvp::CaMParams::streaming(M)), M, false, group, -1, seed);
      }
}

TEMPLATE_TEST_CASE("cuda merging: kvpress CAMPress (candidates ranked on the device) equals Scalar bit for bit", "[cuda][merging][cam]",
                   float, kvp::half) {
  for (const std::int64_t group : {1, 4})
    for (const std::int64_t k : {std::int64_t{-1}, std::int64_t{9}, std::int64_t{70}}) {
      INFO("group " << group << " new_tokens " << k);
      require_cuda_cam<TestType>(kvp::KvpressCAM(kvp::KvpressCAMParams{32}), 32, true, group, k, 77);
      require_cuda_cam<TestType>(kvp::KvpressCAM(kvp::KvpressCAMParams{3}), 3, true, group, k, 78);
    }
}

TEST_CASE("cuda torch_uniforms: torch's CPU generator over several twists, bit for bit", "[cuda][merging][cam]") {
  Stream st;
  for (const std::int64_t n : {std::int64_t{1}, std::int64_t{624}, std::int64_t{625}, std::int64_t{5000}}) {
    DeviceBuffer du(static_cast<std::size_t>(n) * sizeof(float));
    std::vector<float> want(static_cast<std::size_t>(n));
    Scalar::torch_uniforms(99, n, want.data());
    Cuda::CallScope scope(st.s, 1);
    KVP_REQUIRE_OK(scope.begin());
    Cuda::torch_uniforms(99, n, du.get<float>());
    KVP_REQUIRE_OK(scope.end());
    st.sync();
    REQUIRE(same_bits(du.download<float>(static_cast<std::size_t>(n)), want));
  }
}

TEMPLATE_TEST_CASE(
    "cuda merging: MiniCache norms and retained rows bit-identical to Scalar, directions within 1e-5, retention up to "
    "threshold ties",
    "[cuda][merging][minicache]", float, kvp::half, kvp::bfloat16) {
  using T = TestType;
  Stream st;
  const std::int64_t H = 3, T_ = 211, d = 64, rows = H * T_;
  auto prev = random_vector<T>(static_cast<std::size_t>(rows * d), 71);
  auto cur = random_vector<T>(static_cast<std::size_t>(rows * d), 72);
  for (std::size_t i = 0; i < cur.size(); ++i)  // mostly near-parallel pairs
    if (i / d % 5 != 0) cur[i] = kvp::from_float<T>(kvp::to_float(prev[i]) + 0.05f * kvp::to_float(cur[i]));
  for (std::int64_t c = 0; c < d; ++c) prev[(T_ + 3) * d + c] = kvp::from_float<T>(0.0f);
  const kvp::Device dev{kvp::DeviceType::kCUDA, 0};
  for (const kvp::MiniCacheParams p : {kvp::MiniCacheParams{}, kvp::MiniCacheParams{0.3f, 0.4f}}) {
    INFO("t " << p.t << " gamma " << p.gamma);
    const kvp::MiniCache mc(p);
    std::vector<float> hdir(rows * d), hnp(rows), hnc(rows), hrp(rows * d), hrc(rows * d);
    std::vector<std::int32_t> hindptr(H + 1), hidx(rows);
    kvp::MiniCacheMerged hm;
    hm.direction = kvp::TensorView<float, 3>::contiguous(hdir.data(), {H, T_, d});
    hm.norm_prev = kvp::TensorView<float, 2>::contiguous(hnp.data(), {H, T_});
    hm.norm_cur = kvp::TensorView<float, 2>::contiguous(hnc.data(), {H, T_});
    hm.retained = kvp::KeepSet{hindptr.data(), hidx.data(), H, rows};
    hm.retained_prev = kvp::TensorView<float, 2>::contiguous(hrp.data(), {rows, d});
    hm.retained_cur = kvp::TensorView<float, 2>::contiguous(hrc.data(), {rows, d});
    const kvp::ProblemShape shape{H, H, d, T_, 1};
    std::vector<std::byte> hws(mc.requirements(kvp::Context<Scalar>{}, shape).workspace_bytes);
    KVP_REQUIRE_OK(mc.merge(kvp::Context<Scalar>{kvp::Workspace{hws.data(), hws.size()}},
                            kvp::MiniCacheInput<T>{kvp::KVSource<T>::from(kvp::TensorView<const T, 3>::contiguous(prev.data(), {H, T_, d})),
                                                   kvp::KVSource<T>::from(kvp::TensorView<const T, 3>::contiguous(cur.data(), {H, T_, d}))},
                            hm));
    DeviceBuffer dprev(prev), dcur(cur), ddir(rows * d * sizeof(float)), dnp(rows * sizeof(float)), dnc(rows * sizeof(float)),
        drp(rows * d * sizeof(float)), drc(rows * d * sizeof(float)), dindptr((H + 1) * sizeof(std::int32_t)),
        didx(rows * sizeof(std::int32_t));
    kvp::MiniCacheMerged dm;
    dm.direction = kvp::TensorView<float, 3>::contiguous(ddir.get<float>(), {H, T_, d}, dev);
    dm.norm_prev = kvp::TensorView<float, 2>::contiguous(dnp.get<float>(), {H, T_}, dev);
    dm.norm_cur = kvp::TensorView<float, 2>::contiguous(dnc.get<float>(), {H, T_}, dev);
    dm.retained = kvp::KeepSet{dindptr.get<std::int32_t>(), didx.get<std::int32_t>(), H, rows};
    dm.retained_prev = kvp::TensorView<float, 2>::contiguous(drp.get<float>(), {rows, d}, dev);
    dm.retained_cur = kvp::TensorView<float, 2>::contiguous(drc.get<float>(), {rows, d}, dev);
    const auto req = mc.requirements(kvp::Context<Cuda>{}, shape);
    KVP_REQUIRE_OK(req.status);
    DeviceBuffer dws(req.workspace_bytes);
    KVP_REQUIRE_OK(mc.merge(
        kvp::Context<Cuda>{dws.workspace(), {}, st.s},
        kvp::MiniCacheInput<T>{kvp::KVSource<T>::from(kvp::TensorView<const T, 3>::contiguous(dprev.get<const T>(), {H, T_, d}, dev)),
                               kvp::KVSource<T>::from(kvp::TensorView<const T, 3>::contiguous(dcur.get<const T>(), {H, T_, d}, dev))},
        dm));
    st.sync();
    REQUIRE(same_bits(dnp.download<float>(rows), hnp));
    REQUIRE(same_bits(dnc.download<float>(rows), hnc));
    const auto gdir = ddir.download<float>(rows * d);
    for (std::size_t i = 0; i < gdir.size(); ++i) REQUIRE(std::fabs(gdir[i] - hdir[i]) <= 1e-5f);
    const auto gindptr = dindptr.download<std::int32_t>(H + 1);
    const auto gidx = didx.download<std::int32_t>(static_cast<std::size_t>(std::max(gindptr[H], 1)));
    const auto grp = drp.download<float>(rows * d), grc = drc.download<float>(rows * d);
    REQUIRE(gindptr[0] == 0);
    for (std::int64_t h = 0; h < H; ++h) {
      // The host's distances and threshold: tokens retained on one side only must sit at the threshold.
      std::vector<float> a(d), b(d), dist(T_);
      for (std::int64_t j = 0; j < T_; ++j) {
        for (std::int64_t c = 0; c < d; ++c)
          a[c] = kvp::to_float(prev[(h * T_ + j) * d + c]), b[c] = kvp::to_float(cur[(h * T_ + j) * d + c]);
        dist[j] = kvp::ops::minicache_distance(a.data(), kvp::ops::norm16(a.data(), d), b.data(), kvp::ops::norm16(b.data(), d), d);
      }
      const auto [lo, hi] = std::minmax_element(dist.begin(), dist.end());
      const float thr = kvp::ops::minicache_threshold(*lo, *hi, p.gamma);
      std::set<std::int32_t> hs(hidx.begin() + hindptr[h], hidx.begin() + hindptr[h + 1]),
          gs(gidx.begin() + gindptr[h], gidx.begin() + gindptr[h + 1]);
      for (std::int32_t j = 0; j < T_; ++j)
        if (hs.count(j) != gs.count(j)) REQUIRE(std::fabs(dist[j] - thr) <= 1e-6f);
      for (std::int32_t i = gindptr[h]; i < gindptr[h + 1]; ++i) {
        const auto it = std::find(hidx.begin() + hindptr[h], hidx.begin() + hindptr[h + 1], gidx[i]);
        if (it == hidx.begin() + hindptr[h + 1]) continue;
        const auto hi_row = static_cast<std::size_t>(it - hidx.begin());
        REQUIRE(std::equal(grp.begin() + i * d, grp.begin() + (i + 1) * d, hrp.begin() + hi_row * d));
        REQUIRE(std::equal(grc.begin() + i * d, grc.begin() + (i + 1) * d, hrc.begin() + hi_row * d));
      }
      if (p.gamma < 1.0f) REQUIRE(!gs.empty());
    }
  }
}
