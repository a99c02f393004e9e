// Cross-validation against the reference fixtures (tests/data/fixtures, written by
// tests/reference/make_fixtures.py): kvpress TOVAPress and ObservedAttentionPress,
// and the online H2O real-drop and TOVA originals replayed step by step.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

#include "kvpolicy/apply/compact.hpp"
#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/eviction/h2o.hpp"
#include "kvpolicy/policy/eviction/observed_attention.hpp"
#include "kvpolicy/policy/eviction/tova.hpp"
#include "policy/policy_test_util.hpp"
#include "reference/fixture_reader.hpp"

using namespace kvpolicy;
namespace kf = kvp_fixtures;

namespace {

// Scores: kvpress fp32 (or the fp64 originals) against our fp32 computation.
constexpr double kRel = 2e-5, kAbs = 1e-7;

template <class Policy>
void check_one_shot(const kf::FixtureCase& c, const Policy& policy, const std::vector<float>& q, std::int64_t q_len) {
  INFO(c.id);
  REQUIRE(kf::check_inputs(c).empty());
  const std::int64_t Hq = c.num_q_heads, H = c.num_kv_heads, T = c.seq_len, d = c.head_dim;
  const std::vector<float> k = c.keys();
  const ScoreInput<float, float> in{TensorView<const float, 3>::contiguous(q.data(), {Hq, q_len, d}),
                                    KVSource<float>::from(TensorView<const float, 3>::contiguous(k.data(), {H, T, d}))};
  REQUIRE(policy.kept_count(T) == c.n_kept.value());
  std::vector<float> s(static_cast<std::size_t>(H * T));
  const Requirements req = policy.requirements(Context<backend::Scalar>{}, ProblemShape{Hq, H, d, T, q_len});
  REQUIRE(req.status.is_ok());
  std::vector<std::byte> ws(req.workspace_bytes);
  REQUIRE(policy.score(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}}, in, TensorView<float, 2>::contiguous(s.data(), {H, T}))
              .is_ok());
  for (std::int64_t h = 0; h < H; ++h)
    for (std::size_t i = 0; i < c.scores.tokens[h].size(); ++i) {
      const auto t = c.scores.tokens[h][i];
      if (c.scores.is_protected(
              t)) {  // kvpress's pad (max + 1): the library scores protected tokens +inf; the order is checked by the kept sets
        REQUIRE(std::isinf(s[h * T + t]));
        REQUIRE(s[h * T + t] > 0.0f);
        continue;
      }
      REQUIRE(s[h * T + t] == Approx(c.scores.value[h][i]).epsilon(kRel).margin(kAbs));
    }
  const auto keep = run_evict<backend::Scalar>(policy, in);
  for (std::int64_t h = 0; h < H; ++h) REQUIRE(keep.row(h) == c.kept[h]);
  REQUIRE(run_evict<backend::Cpu>(policy, in) == keep);
}

}  // namespace

// The fixtures were made with kvpress 0.5.5, whose n_kept = max(1, int(T(1 - r))) (upstream PR #264):
// `Budget::keep_at_least_one()`; the presets follow the reference snapshot (0.5.4), which can keep 0.
TEST_CASE("fixtures: kvpress TOVAPress scores and kept sets", "[fixtures][tova]") {
  const auto cases = kf::load_fixtures("tova_kvpress");
  REQUIRE(!cases.empty());
  for (const auto& c : cases) {
    const auto q = c.queries(c.seq_len - 1, c.seq_len);  // the last context token's query
    TOVAParams p = TOVAParams::kvpress(c.param<double>("compression_ratio"));
    p.budget = p.budget.keep_at_least_one();
    check_one_shot(c, TOVA(p), q, 1);
  }
}

TEST_CASE("fixtures: kvpress ObservedAttentionPress scores and kept sets", "[fixtures][observed]") {
  const auto cases = kf::load_fixtures("observed_attention_kvpress");
  REQUIRE(!cases.empty());
  for (const auto& c : cases) {
    ObservedAttentionParams p = ObservedAttentionParams::kvpress(c.param<double>("compression_ratio"));
    p.budget = p.budget.keep_at_least_one();
    check_one_shot(c, ObservedAttention(p), c.queries(), c.seq_len);
  }
}

namespace {

/// Replays an online fixture: a contiguous cache (H, cap, d) with logical
/// positions, the prefill then one token per decode step.
struct Replay {
  std::int64_t Hq, H, d, cap, len = 0;
  std::vector<float> q_all, k_all, keys;
  std::vector<std::int32_t> pos;
  explicit Replay(const kf::FixtureCase& c)
      : Hq(c.num_q_heads),
        H(c.num_kv_heads),
        d(c.head_dim),
        cap(c.seq_len),
        q_all(c.queries()),
        k_all(c.keys()),
        keys(static_cast<std::size_t>(H * cap * d)),
        pos(static_cast<std::size_t>(H * cap)) {}
  void append(std::int64_t p) {
    for (std::int64_t h = 0; h < H; ++h) {
      std::copy_n(k_all.begin() + (h * cap + p) * d, d, keys.begin() + (h * cap + len) * d);
      pos[h * cap + len] = static_cast<std::int32_t>(p);
    }
    ++len;
  }
  /// Queries of tokens [p0, p1) as (Hq, p1 - p0, d).
  std::vector<float> queries(std::int64_t p0, std::int64_t p1) const {
    std::vector<float> out;
    for (std::int64_t h = 0; h < Hq; ++h) out.insert(out.end(), q_all.begin() + (h * cap + p0) * d, q_all.begin() + (h * cap + p1) * d);
    return out;
  }
  ScoreInput<float, float> input(const std::vector<float>& q, std::int64_t q_len) const {
    return {TensorView<const float, 3>::contiguous(q.data(), {Hq, q_len, d}),
            KVSource<float>::from(TensorView<const float, 3>(keys.data(), {H, len, d}, {cap * d, d, 1}))};
  }
  void compact(KeepSetBuffer& keep) {
    std::vector<std::int64_t> lens(static_cast<std::size_t>(H));
    REQUIRE(compact_contiguous<float>(TensorView<float, 3>::contiguous(keys.data(), {H, cap, d}), {},
                                      TensorView<std::int32_t, 2>::contiguous(pos.data(), {H, cap}), len, keep.view(), 0, lens)
                .is_ok());
    len = lens[0];
  }
  std::vector<std::int32_t> positions(std::int64_t h) const { return {pos.begin() + h * cap, pos.begin() + h * cap + len}; }
};

template <class Backend>
void replay_h2o(const kf::FixtureCase& c) {
  INFO(c.id);
  REQUIRE(kf::check_inputs(c).empty());
  Replay r(c);
  const std::int64_t T0 = c.param<int>("prefill_len"), steps = c.param<int>("decode_steps");
  const H2O policy(H2OParams::original(c.param<int>("hh_size"), c.param<int>("recent_size")));  // GQA: group sum (kKvHead, kSum)
  std::vector<float> state(static_cast<std::size_t>(r.H * r.cap));
  H2OState st{TensorView<float, 2>::contiguous(state.data(), {r.H, r.cap}), 0};
  std::map<int, const kf::StepResult*> recorded;
  for (const auto& s : c.steps) recorded[s.step] = &s;
  // one size query covers the update from queries (calls of at most T0 queries) and the evict, caches of at most cap slots
  const Requirements req = policy.requirements(Context<Backend>{}, ProblemShape{r.Hq, r.H, r.d, r.cap, T0});
  REQUIRE(req.status.is_ok());
  std::vector<std::byte> ws(req.workspace_bytes);
  const Context<Backend> cx{Workspace{ws.data(), ws.size()}};
  for (std::int64_t step = 0; step <= steps; ++step) {
    const std::int64_t p0 = step == 0 ? 0 : T0 + step - 1, p1 = step == 0 ? T0 : p0 + 1;
    for (std::int64_t p = p0; p < p1; ++p) r.append(p);
    const auto q = r.queries(p0, p1);
    REQUIRE(policy.update(cx, st, r.input(q, p1 - p0)).is_ok());
    KeepSetBuffer keep(r.H, r.H * r.len);
    REQUIRE(policy.evict(cx, st, keep.view()).is_ok());
    r.compact(keep);
    const auto it = recorded.find(static_cast<int>(step));
    if (it == recorded.end()) continue;
    INFO("step " << step);
    for (std::int64_t h = 0; h < r.H; ++h) {
      const auto kept = r.positions(h);
      REQUIRE(kept == it->second->kept[h]);
      for (std::size_t i = 0; i < it->second->scores.tokens[h].size(); ++i) {
        const auto slot = std::find(kept.begin(), kept.end(), it->second->scores.tokens[h][i]) - kept.begin();
        REQUIRE(state[h * r.cap + slot] == Approx(it->second->scores.value[h][i]).epsilon(kRel).margin(kAbs));
      }
    }
  }
}

template <class Backend>
void replay_tova(const kf::FixtureCase& c) {
  INFO(c.id);
  REQUIRE(kf::check_inputs(c).empty());
  Replay r(c);
  const std::int64_t T0 = c.param<int>("prefill_len"), steps = c.param<int>("decode_steps");
  const TOVA policy(TOVAParams::original(c.param<int>("cache_size")));
  std::map<int, const kf::StepResult*> recorded;
  for (const auto& s : c.steps) recorded[s.step] = &s;
  for (std::int64_t step = 0; step <= steps; ++step) {
    const std::int64_t p0 = step == 0 ? 0 : T0 + step - 1, p1 = step == 0 ? T0 : p0 + 1;
    for (std::int64_t p = p0; p < p1; ++p) r.append(p);
    const auto q = r.queries(p1 - 1, p1);  // the newest query decides
    const auto in = r.input(q, 1);
    const auto it = recorded.find(static_cast<int>(step));
    if (it != recorded.end()) {  // the scores this step decides on, before eviction
      INFO("step " << step);
      std::vector<float> s(static_cast<std::size_t>(r.H * r.len));
      const Requirements req = policy.requirements(Context<Backend>{}, ProblemShape{r.Hq, r.H, r.d, r.len, 1});
      REQUIRE(req.status.is_ok());
      std::vector<std::byte> ws(req.workspace_bytes);
      REQUIRE(policy.score(Context<Backend>{Workspace{ws.data(), ws.size()}}, in, TensorView<float, 2>::contiguous(s.data(), {r.H, r.len}))
                  .is_ok());
      const auto before = r.positions(0);
      for (std::size_t i = 0; i < it->second->scores.tokens[0].size(); ++i) {
        const auto slot = std::find(before.begin(), before.end(), it->second->scores.tokens[0][i]) - before.begin();
        REQUIRE(s[slot] == Approx(it->second->scores.value[0][i]).epsilon(kRel).margin(kAbs));
      }
    }
    auto keep = run_evict<Backend>(policy, in);
    r.compact(keep);
    if (it != recorded.end())
      for (std::int64_t h = 0; h < r.H; ++h) REQUIRE(r.positions(h) == it->second->kept[0]);
  }
}

}  // namespace

TEMPLATE_TEST_CASE("fixtures: H2O real-drop replayed online (kept sets and accumulated scores)", "[fixtures][h2o]", backend::Scalar,
                   backend::Cpu) {
  const auto cases = kf::load_fixtures("h2o_original");
  REQUIRE(!cases.empty());
  for (const auto& c : cases) replay_h2o<TestType>(c);
}

TEMPLATE_TEST_CASE("fixtures: TOVA original replayed online (scores and kept sets)", "[fixtures][tova]", backend::Scalar, backend::Cpu) {
  const auto cases = kf::load_fixtures("tova_original");
  REQUIRE(!cases.empty());
  for (const auto& c : cases) replay_tova<TestType>(c);
}
