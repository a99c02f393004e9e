// window_scores: backend::Cpu against the scalar reference, for every ISA this
// machine has, every key dtype and layout, over the shape matrix
// G in {1,2,4,8}, d in {64,96,128}, T in {1,7,100,1000,4099}, w in {1,8,32}.
#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cpu_test_util.hpp"

using namespace kvp_cpu_test;

namespace {

struct Case {
  std::int64_t G, d, T, w, q_pos0;
  WindowReduce reduce;
  float q_gain;           // > 1 sharpens the softmax
  double rel_tol = 1e-5;  // see window_close
};

std::string describe(const Case& c, const char* dtype, CpuIsa isa, Layout layout, std::int64_t L) {
  std::ostringstream os;
  os << dtype << " G=" << c.G << " d=" << c.d << " T=" << c.T << " w=" << c.w << " q_pos0=" << c.q_pos0 << " L=" << L
     << (c.reduce == WindowReduce::kSum ? " sum" : " mean") << " isa=" << cpu_isa_name(isa) << " " << layout_name(layout);
  return os.str();
}

/// Runs one case on the scalar reference (contiguous keys, L = T) and on Cpu
/// for every ISA, rotating the layouts across ISAs and the two column counts
/// (L = T and L = T - w); returns the number of compared elements.
/// `bf16_dot`: Cpu runs the bf16 dot form (AVX-512 only, set by the caller) and the reference gets the queries
/// rounded to bf16, the form's one approximation.
template <class Tk>
std::int64_t check_case(const Case& c, const char* dtype, std::mt19937& rng, bool bf16_dot = false) {
  std::normal_distribution<float> nd;
  const std::int64_t Q = c.G * c.w;
  std::vector<float> q(static_cast<std::size_t>(Q * c.d));
  for (auto& x : q) x = nd(rng) * c.q_gain;
  std::vector<Tk> keys(static_cast<std::size_t>(c.T * c.d));
  for (auto& x : keys) x = from_float<Tk>(nd(rng));
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));

  std::vector<float> q_ref = q;
  if (bf16_dot)
    for (auto& x : q_ref) x = to_float(to_bfloat16(x));
  WindowScoreShape ref_shape{c.G, c.w, c.d, c.T, c.T, c.q_pos0, scale, c.reduce};
  std::vector<float> ref(static_cast<std::size_t>(c.G * c.T));
  std::vector<std::byte> ref_ws(Scalar::window_scores_workspace(ref_shape));
  Scalar::window_scores(ref_shape, q_ref.data(), Rows<Tk>{keys.data(), c.d}, ref.data(), Workspace{ref_ws.data(), ref_ws.size()});

  std::int64_t compared = 0;
  const Layout layouts[] = {Layout::kContiguous, Layout::kStrided, Layout::kPaged16, Layout::kPaged1};
  int rot = 0;
  IsaGuard guard;
  for (CpuIsa isa : available_isas()) {
    if (bf16_dot && isa != CpuIsa::kAvx512) continue;
    REQUIRE(Cpu::set_isa(isa));
    for (Layout layout : layouts) {
      const std::int64_t L = (rot++ % 2 == 0) ? c.T : c.T - c.w;
      KeyStore<Tk> store(keys, c.T, c.d, layout, rng);
      WindowScoreShape s = ref_shape;
      s.num_cols = L;
      std::vector<float> out(static_cast<std::size_t>(c.G * L + 1), -1.0f);
      std::vector<std::byte> ws(Cpu::window_scores_workspace(s));
      Cpu::window_scores(s, q.data(), store.rows, out.data(), Workspace{ws.data(), ws.size()});
      for (std::int64_t g = 0; g < c.G; ++g) {
        for (std::int64_t j = 0; j < L; ++j) {
          const float got = out[static_cast<std::size_t>(g * L + j)], want = ref[static_cast<std::size_t>(g * c.T + j)];
          if (!window_close(got, want, c.rel_tol)) {
            INFO(describe(c, dtype, isa, layout, L) << " head " << g << " col " << j << ": got " << got << ", reference " << want);
            REQUIRE(window_close(got, want, c.rel_tol));
          }
          ++compared;
        }
      }
      REQUIRE(out.back() == -1.0f);  // nothing written past (G, L)
    }
  }
  return compared;
}

template <class Tk>
void run_matrix(const char* dtype, unsigned seed) {
  std::mt19937 rng(seed);
  std::int64_t compared = 0;
  int variant = 0;
  for (std::int64_t G : {1, 2, 4, 8}) {
    for (std::int64_t d : {64, 96, 128}) {
      for (std::int64_t T : {1, 7, 100, 1000, 4099}) {
        for (std::int64_t w : {1, 8, 32}) {
          if (w > T) continue;
          // Sanitizer builds: the largest products of shape parameters are skipped
          // (every parameter value still appears in smaller combinations).
          if (kScaledDown && ((T > 1000 && G * w > 8) || (T == 1000 && G * w > 64))) continue;
          ++variant;
          const WindowReduce red = variant % 3 == 0 ? WindowReduce::kSum : WindowReduce::kMean;
          const float gain = 1.0f + static_cast<float>(variant % 4);
          compared += check_case<Tk>(Case{G, d, T, w, T - w, red, gain}, dtype, rng);
          // Window queries earlier than the last w positions (keys after the
          // window stay in the softmax of no query beyond its position).
          if (d == 64 && T > w) compared += check_case<Tk>(Case{G, d, T, w, (T - w) / 2, red, gain}, dtype, rng);
        }
      }
    }
  }
  REQUIRE(compared > 0);
}

}  // namespace

TEST_CASE("window_scores: fp32 keys match the scalar reference on every ISA and layout", "[cpu][window_scores]") {
  run_matrix<float>("fp32", 11);
}

TEST_CASE("window_scores: fp16 keys match the scalar reference on every ISA and layout", "[cpu][window_scores]") {
  run_matrix<half>("fp16", 12);
}

TEST_CASE("window_scores: bf16 keys match the scalar reference on every ISA and layout", "[cpu][window_scores]") {
  run_matrix<bfloat16>("bf16", 13);
}

TEST_CASE("window_scores: odd head_dim, non-vector window, extreme logits", "[cpu][window_scores]") {
  std::mt19937 rng(5);
  // head_dim not a multiple of any vector width; window not a multiple of the lanes; G*w not either.
  for (std::int64_t d : {1, 5, 33})
    for (std::int64_t w : {3, 17}) {
      check_case<half>(Case{3, d, 150, w, 150 - w, WindowReduce::kMean, 1.0f}, "fp16", rng);
      check_case<float>(Case{3, d, 150, w, 150 - w, WindowReduce::kSum, 1.0f}, "fp32", rng);
      check_case<bfloat16>(Case{3, d, 150, w, 150 - w, WindowReduce::kMean, 1.0f}, "bf16", rng);
    }
  // Very peaked softmax: logits spread over hundreds, most probabilities
  // underflow. Logits near +-130 carry an absolute rounding error of about
  // ulp(130) = 1.5e-5 in any fp32 evaluation order (the reference's included),
  // which exp turns into that much relative error: the tolerance is 1e-4 here.
  check_case<float>(Case{2, 64, 700, 8, 692, WindowReduce::kMean, 40.0f, 1e-4}, "fp32", rng);
  // Queries that see no key at all (q_pos0 < 0) contribute nothing.
  check_case<float>(Case{2, 16, 50, 8, -4, WindowReduce::kSum, 1.0f}, "fp32", rng);
  // q_pos0 beyond kv_len: every query sees every key.
  check_case<half>(Case{2, 16, 50, 8, 80, WindowReduce::kMean, 1.0f}, "fp16", rng);
}

TEST_CASE("window_scores: non-finite inputs stay confined and never crash", "[cpu][window_scores]") {
  const std::int64_t G = 2, w = 8, d = 64, T = 300;
  std::mt19937 rng(9);
  std::normal_distribution<float> nd;
  std::vector<float> q(static_cast<std::size_t>(G * w * d));
  for (auto& x : q) x = nd(rng);
  std::vector<half> keys(static_cast<std::size_t>(T * d));
  for (auto& x : keys) x = to_half(nd(rng));
  q[3] = std::numeric_limits<float>::quiet_NaN();                       // head 0, query 0
  keys[static_cast<std::size_t>((T - 2) * d + 5)] = to_half(INFINITY);  // key T-2: seen by the last queries only
  const WindowScoreShape s{G, w, d, T, T - w, T - w, 0.125f, WindowReduce::kMean};
  std::vector<float> ref(static_cast<std::size_t>(G * s.num_cols));
  std::vector<std::byte> rws(Scalar::window_scores_workspace(s));
  Scalar::window_scores(s, q.data(), Rows<half>{keys.data(), d}, ref.data(), Workspace{rws.data(), rws.size()});
  IsaGuard guard;
  for (CpuIsa isa : available_isas()) {
    REQUIRE(Cpu::set_isa(isa));
    INFO("isa " << cpu_isa_name(isa));
    std::vector<float> out(ref.size());
    std::vector<std::byte> ws(Cpu::window_scores_workspace(s));
    Cpu::window_scores(s, q.data(), Rows<half>{keys.data(), d}, out.data(), Workspace{ws.data(), ws.size()});
    for (std::size_t i = 0; i < out.size(); ++i) {
      // Where the reference is finite (no poisoned query or key reaches it) the
      // results agree; where it is NaN, so is ours.
      INFO("element " << i << " got " << out[i] << " reference " << ref[i]);
      REQUIRE(window_close(out[i], ref[i]));
    }
  }
}

// A window of at most one vector of queries takes its own tile (12 keys, widened just before it; score_kernels_impl
// .hpp, logit_tile_one) and, with w = 1, writes each head's score directly. Each lane's operations are the general
// tiles' in the same order, so a head's scores are bit for bit those of the same queries inside a window of many
// vectors: 4 heads of one query each against the same 4 heads among 20 (3 vectors on AVX2, 5 on SSE2, 2 on AVX-512),
// with partial tiles (T = 1000: the last chunk has 40 keys) and with causal masking (q_pos0 < T - 1).
template <class Tk>
void check_one_vector_bits(const char* dtype) {
  const std::int64_t d = 128, T = 1000, G_small = 4, G_big = 20;
  std::mt19937 rng(21);
  std::normal_distribution<float> nd;
  std::vector<float> q_big(static_cast<std::size_t>(G_big * d));
  for (auto& x : q_big) x = nd(rng) * 2.0f;
  std::vector<Tk> keys(static_cast<std::size_t>(T * d));
  for (auto& x : keys) x = from_float<Tk>(nd(rng));
  IsaGuard guard;
  for (CpuIsa isa : available_isas()) {
    REQUIRE(Cpu::set_isa(isa));
    for (std::int64_t q_pos0 : {T - 1, T / 2}) {
      INFO(dtype << " isa " << cpu_isa_name(isa) << " q_pos0 " << q_pos0);
      std::vector<float> out[2];
      for (int big = 0; big < 2; ++big) {
        const WindowScoreShape s{big ? G_big : G_small, 1, d, T, T, q_pos0, 0.0883883f, WindowReduce::kMean};
        out[big].assign(static_cast<std::size_t>(s.group * T), -1.0f);
        std::vector<std::byte> ws(Cpu::window_scores_workspace(s));
        Cpu::window_scores(s, q_big.data(), Rows<Tk>{keys.data(), d}, out[big].data(), Workspace{ws.data(), ws.size()});
      }
      for (std::size_t i = 0; i < out[0].size(); ++i) {
        if (std::bit_cast<std::uint32_t>(out[0][i]) != std::bit_cast<std::uint32_t>(out[1][i])) {
          INFO("head " << i / T << " key " << i % T << ": one vector " << out[0][i] << ", many vectors " << out[1][i]);
          REQUIRE(std::bit_cast<std::uint32_t>(out[0][i]) == std::bit_cast<std::uint32_t>(out[1][i]));
        }
      }
      REQUIRE(out[0][0] > 0.0f);
    }
  }
}

TEST_CASE("window_scores: one vector of queries gives the general tiles' bits", "[cpu][window_scores]") {
  check_one_vector_bits<half>("fp16");
  check_one_vector_bits<float>("fp32");
  check_one_vector_bits<bfloat16>("bf16");
}

TEST_CASE("window_scores: at most 8 queries on the AVX-512 level give the AVX2 level's bits", "[cpu][window_scores]") {
  // Up to 8 queries run the AVX2 kernel on the AVX-512 level (cpu_score_ops.cpp). The two levels round exp's
  // exponent differently, so the bits may differ elsewhere; with at most 8 queries they must be the AVX2 ones.
  const auto isas = available_isas();
  if (std::find(isas.begin(), isas.end(), CpuIsa::kAvx512) == isas.end()) {
    SUCCEED("no AVX-512 on this machine: the AVX2 level is the best one");
    return;
  }
  IsaGuard guard;
  std::mt19937 rng(29);
  std::normal_distribution<float> nd;
  std::int64_t equal = 0;
  for (const auto& [G, w] : {std::pair<std::int64_t, std::int64_t>{4, 1}, {8, 1}, {2, 4}, {1, 8}, {1, 1}})
    for (std::int64_t d : {64, 128}) {
      const std::int64_t T = 700;
      std::vector<float> q(static_cast<std::size_t>(G * w * d));
      std::vector<half> keys(static_cast<std::size_t>(T * d));
      for (auto& x : q) x = nd(rng) * 2.0f;
      for (auto& x : keys) x = from_float<half>(nd(rng));
      const WindowScoreShape s{G, w, d, T, T - w, T - w, 1.0f / std::sqrt(static_cast<float>(d)), WindowReduce::kMean};
      std::vector<std::byte> ws(Cpu::window_scores_workspace(s));
      std::vector<float> a(static_cast<std::size_t>(G * s.num_cols)), b(a.size());
      REQUIRE(Cpu::set_isa(CpuIsa::kAvx512));
      Cpu::window_scores(s, q.data(), Rows<half>{keys.data(), d}, a.data(), Workspace{ws.data(), ws.size()});
      REQUIRE(Cpu::set_isa(CpuIsa::kAvx2));
      Cpu::window_scores(s, q.data(), Rows<half>{keys.data(), d}, b.data(), Workspace{ws.data(), ws.size()});
      INFO("G " << G << " w " << w << " d " << d);
      REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
      ++equal;
    }
  REQUIRE(equal == 10);
}

TEST_CASE("window_scores: a workspace sized for the reference op falls back to it", "[cpu][window_scores]") {
  const std::int64_t G = 2, w = 4, d = 32, T = 90;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> q(static_cast<std::size_t>(G * w * d)), keys(static_cast<std::size_t>(T * d));
  for (auto& x : q) x = nd(rng);
  for (auto& x : keys) x = nd(rng);
  const WindowScoreShape s{G, w, d, T, T - w, T - w, 0.2f, WindowReduce::kSum};
  REQUIRE(Scalar::window_scores_workspace(s) < Cpu::window_scores_workspace(s));
  std::vector<std::byte> small(Scalar::window_scores_workspace(s));
  std::vector<float> ref(static_cast<std::size_t>(G * s.num_cols)), out(ref.size());
  Scalar::window_scores(s, q.data(), Rows<float>{keys.data(), d}, ref.data(), Workspace{small.data(), small.size()});
  Cpu::window_scores(s, q.data(), Rows<float>{keys.data(), d}, out.data(), Workspace{small.data(), small.size()});
  REQUIRE(out == ref);
}

namespace {
/// Sets Cpu's bf16 dot form for a scope and restores the previous setting.
struct Bf16DotGuard {
  bool before = Cpu::bf16_dot();
  explicit Bf16DotGuard(bool on) { REQUIRE(Cpu::set_bf16_dot(on)); }
  ~Bf16DotGuard() { Cpu::set_bf16_dot(before); }
};
}  // namespace

TEST_CASE("window_scores: the bf16 dot form equals the fp32 form on bf16-rounded queries", "[cpu][window_scores]") {
  if (std::getenv("KVP_CPU_BF16_DOT") == nullptr) CHECK_FALSE(Cpu::bf16_dot());  // off by default
  REQUIRE(Cpu::set_bf16_dot(false));
  if (!Cpu::has_bf16_dot()) {
    REQUIRE_FALSE(Cpu::set_bf16_dot(true));  // refused, nothing changed
    REQUIRE_FALSE(Cpu::bf16_dot());
    SUCCEED("no AVX512_BF16 on this machine: the form is never used");
    return;
  }
  Bf16DotGuard on(true);
  REQUIRE(Cpu::bf16_dot());
  std::mt19937 rng(17);
  std::int64_t compared = 0;
  int variant = 0;
  for (std::int64_t G : {1, 4})
    for (std::int64_t d : {2, 34, 64, 128})
      for (std::int64_t T : {1, 7, 100, 1000})
        for (std::int64_t w : {1, 8, 32}) {
          if (w > T) continue;
          ++variant;
          const WindowReduce red = variant % 2 == 0 ? WindowReduce::kSum : WindowReduce::kMean;
          compared += check_case<bfloat16>(Case{G, d, T, w, T - w, red, 1.0f + static_cast<float>(variant % 3)}, "bf16 dot", rng, true);
        }
  REQUIRE(compared > 0);
  // Odd head_dim, fp16 and fp32 keys: the fp32 form whatever the setting.
  check_case<bfloat16>(Case{3, 33, 150, 17, 133, WindowReduce::kMean, 1.0f}, "bf16 odd d", rng);
  check_case<half>(Case{3, 64, 150, 17, 133, WindowReduce::kMean, 1.0f}, "fp16", rng);
  check_case<float>(Case{3, 64, 150, 17, 133, WindowReduce::kSum, 1.0f}, "fp32", rng);
}
