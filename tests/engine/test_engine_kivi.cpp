// SPDX-License-Identifier: Apache-2.0
// Engine: KIVI in the decode loop (examples/engine/kivi_hooks.hpp) on both cache layouts, after a one-shot
// eviction (SnapKV, then KIVI on the compacted kept tokens) and under an online eviction (H2O at every decode
// step: the store rebuilt from the compacted cache), and its refusals.
#include <catch2/catch.hpp>

#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "engine_fixture.hpp"

using namespace kvp_engine;
using engine_test::model;

namespace {

std::vector<TaskSample> kivi_subset() {
  std::vector<TaskSample> subset;
  for (const char* task : {"passkey", "multikey"})
    for (std::size_t i : engine_test::samples_of(task, 2)) subset.push_back(engine_test::eval_samples()[i]);
  return subset;
}

kvpolicy::KiviQuant kivi(kvpolicy::QuantRole role, int bits, int residual) {
  return kvpolicy::KiviQuant(kvpolicy::KiviQuantParams{.role = role, .bits = bits, .group = 32, .residual = residual});
}

/// Online H2O (hh = recent = budget / 2) with KIVI after it, on both layouts.
PolicyUnderTest h2o_kivi_policy(int bits, int residual) {
  PolicyUnderTest p = on_both_layouts("h2o+kivi", 1, [bits, residual]<class Cache>(std::int64_t budget) {
    return kvpolicy::combine(
        h2o_hooks<Cache>(kvpolicy::H2O(kvpolicy::H2OParams::original(budget / 2, budget - budget / 2))),
        kivi_hooks<Cache>(kivi(kvpolicy::QuantRole::kKeys, bits, residual), kivi(kvpolicy::QuantRole::kValues, bits, residual)));
  });
  p.column_sums = true;
  p.lossy = true;
  const double bpt = kivi(kvpolicy::QuantRole::kKeys, bits, residual).bytes_per_token(model().config().head_dim);
  p.kv_bytes_scale = bpt / (4.0 * model().config().head_dim);
  p.fp16_tokens = residual;
  return p;
}

}  // namespace

TEST_CASE("engine kivi: the paged cache gives the same logits, accuracy and bytes as the contiguous one", "[engine][kivi]") {
  const auto subset = kivi_subset();
  const auto& cfg = model().config();
  const std::vector<PolicyUnderTest> policies = {find_policy(cfg, "kivi:bits=2,residual=32"), find_policy(cfg, "kivi:bits=4,residual=128"),
                                                 find_policy(cfg, "snapkv+kivi:bits=2,residual=32"),
                                                 find_policy(cfg, "snapkv+kivi:bits=4,residual=32"), h2o_kivi_policy(4, 32)};
  for (const auto& p : policies) REQUIRE(p.paged);
  const std::int64_t budgets[] = {48, 200};
  EvalOptions paged;
  paged.cache = CacheKind::kPaged;
  const auto c = run_task_eval(model(), subset, policies, budgets);
  const auto p = run_task_eval(model(), subset, policies, budgets, paged);
  REQUIRE(c.size() == 1 + 2 * policies.size());
  REQUIRE(p.size() == c.size());
  for (std::size_t i = 1; i < c.size(); ++i) {
    engine_test::check_paged_row(c[i], p[i]);  // bit-identical: the same decoded rows reached the attention
    INFO(c[i].policy << " @" << c[i].budget);
    CHECK(c[i].mean_kl > 0.0);  // quantized (and, for the evicting ones, evicted) at these budgets
    CHECK(c[i].mean_kept_bytes < c[0].mean_kept_bytes * 0.4);
  }
  // Deterministic run to run, on the paged cache too.
  const auto p2 = run_task_eval(model(), subset, policies, budgets, paged);
  for (std::size_t i = 1; i < p.size(); ++i) CHECK(p2[i].mean_kl == p[i].mean_kl);
}

TEST_CASE("engine kivi: after SnapKV the kept tokens are compacted, then quantized in KIVI's groups over them", "[engine][kivi]") {
  const TaskSample& s = engine_test::eval_samples()[engine_test::samples_of("passkey", 1)[0]];
  const auto& cfg = model().config();
  const std::int64_t T = static_cast<std::int64_t>(s.prompt.size()), H = cfg.n_kv_heads, d = cfg.head_dim;
  constexpr std::int64_t kKept = 300;  // not a multiple of R: keys 288 in groups, 12 in the residual
  constexpr int kR = 32;
  const auto kq = kivi(kvpolicy::QuantRole::kKeys, 4, kR), vq = kivi(kvpolicy::QuantRole::kValues, 4, kR);
  using C = ContiguousKVCache<float>;
  const PrefillState pre = prefill(model(), s.prompt);
  // SnapKV alone and SnapKV then KIVI: the eviction scores full-precision keys in both, so both keep the same slots.
  Session<C> plain(model(), C(engine_test::shape_for(T + 4)), eviction_hooks<C>(snapkv_with_budget(kKept)));
  auto state = std::make_shared<KiviHookState>();
  Session<C> sess(model(), C(engine_test::shape_for(T + 4)),
                  kvpolicy::combine(eviction_hooks<C>(snapkv_with_budget(kKept)), kivi_hooks<C>(kq, vq, {}, state)));
  plain.load(pre);
  sess.load(pre);
  REQUIRE(state->layers.size() == static_cast<std::size_t>(cfg.n_layers));
  const kvpolicy::Context<kvpolicy::backend::Cpu> cx{};
  for (int l = 0; l < cfg.n_layers; ++l) {
    INFO("layer " << l);
    const KiviLayerStore& L = state->layers[static_cast<std::size_t>(l)];
    REQUIRE(sess.cache().uniform_length(l) == kKept);
    CHECK(L.handed == kKept);
    CHECK(L.rebuilds == 1);  // the compaction after prefill handed the kept prompt
    CHECK(L.role[0].q.tokens == kKept / kR * kR);
    CHECK(L.role[0].st.residual_len == kKept % kR);
    CHECK(L.role[1].q.tokens == kKept - kR);
    CHECK(L.role[1].st.residual_len == kR);
    const double bytes = static_cast<double>(H) * ((288 + 268) * kq.bytes_per_token(d) + (12 + 32) * 2.0 * d);
    CHECK(L.bytes(kq, vq, H, d) == bytes);
    // The quantized rows are KIVI's one-shot quantization of the compacted kept rows (groups from slot 0).
    for (int r = 0; r < 2; ++r) {
      const kvpolicy::KiviQuant& q = r == 0 ? kq : vq;
      const std::int64_t n = L.role[r].q.tokens;
      auto src = (r == 0 ? plain.cache().keys(l) : plain.cache().values(l)).narrow(1, 0, kKept);
      auto got = (r == 0 ? sess.cache().keys(l) : sess.cache().values(l)).narrow(1, 0, kKept);
      std::vector<std::uint8_t> codes(static_cast<std::size_t>(H * q.code_rows(n) * q.codes_row_bytes(d))),
          scales(static_cast<std::size_t>(H * q.code_rows(n) * q.scales_row_bytes(d)));
      kvpolicy::QuantizedKV region{
          q.layout(), kvpolicy::TensorView<std::uint8_t, 3>::contiguous(codes.data(), {H, q.code_rows(n), q.codes_row_bytes(d)}),
          kvpolicy::TensorView<std::uint8_t, 3>::contiguous(scales.data(), {H, q.code_rows(n), q.scales_row_bytes(d)}), n};
      kvpolicy::KiviState unused{};
      REQUIRE(q.quantize(cx, TensorView<const float, 3>(src.narrow(1, 0, n)), unused, region).is_ok());
      std::vector<float> want(static_cast<std::size_t>(H * n * d));
      REQUIRE(q.dequantize(cx, region, TensorView<float, 3>::contiguous(want.data(), {H, n, d})).is_ok());
      std::int64_t quantized_equal = 0, residual_equal = 0, changed = 0;
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t t = 0; t < kKept; ++t)
          for (std::int64_t i = 0; i < d; ++i) {
            if (t < n) {
              quantized_equal += got(h, t, i) == want[static_cast<std::size_t>((h * n + t) * d + i)];
              changed += got(h, t, i) != src(h, t, i);
            } else {
              residual_equal += got(h, t, i) == src(h, t, i);  // the residual keeps the engine's rows bit for bit
            }
          }
      CHECK(quantized_equal == H * n * d);
      CHECK(residual_equal == H * (kKept - n) * d);
      CHECK(changed > 0);
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t t = 0; t < kKept; ++t) REQUIRE(sess.cache().positions(l)(h, t) == plain.cache().positions(l)(h, t));
    }
  }
  // The first decode step hands nothing more before its attention (the prompt is in), then the token joins.
  sess.decode(s.answer[0]);
  for (int l = 0; l < cfg.n_layers; ++l) CHECK(state->layers[static_cast<std::size_t>(l)].handed == kKept);
  sess.decode(s.answer[1]);
  for (int l = 0; l < cfg.n_layers; ++l) {
    const KiviLayerStore& L = state->layers[static_cast<std::size_t>(l)];
    CHECK(L.handed == kKept + 1);
    CHECK(L.role[0].st.residual_len == kKept % kR + 1);
    CHECK(L.role[1].q.tokens == kKept + 1 - kR);
    CHECK(L.rebuilds == 1);
  }
}

TEST_CASE("engine kivi: an online eviction after KIVI quantized tokens rebuilds the store from the compacted cache", "[engine][kivi]") {
  const TaskSample& s = engine_test::eval_samples()[engine_test::samples_of("copy", 1)[0]];
  const auto& cfg = model().config();
  const std::int64_t T = static_cast<std::int64_t>(s.prompt.size()), H = cfg.n_kv_heads, d = cfg.head_dim;
  constexpr std::int64_t kBudget = 48;  // keys: 32 in one group, 16 in the residual; values: 16 quantized, 32 in fp16
  constexpr int kR = 32, kSteps = 12;
  const auto kq = kivi(kvpolicy::QuantRole::kKeys, 4, kR), vq = kivi(kvpolicy::QuantRole::kValues, 4, kR);
  using C = ContiguousKVCache<float>;
  PrefillOptions po;
  po.column_sums = true;
  const PrefillState pre = prefill(model(), s.prompt, po);
  // The rows every token entered the cache with, by (layer, kv head, position), recorded before any other hook.
  using Key = std::tuple<int, std::int64_t, std::int32_t>;
  auto entered = std::make_shared<std::map<Key, std::vector<float>>>();
  Hooks<C> recorder;
  recorder.on_append = [entered](C& c, int l, std::int64_t appended) -> Status {
    const std::int64_t len = c.uniform_length(l), dd = c.shape().head_dim;
    for (std::int64_t h = 0; h < c.shape().num_kv_heads; ++h)
      for (std::int64_t t = len - appended; t < len; ++t) {
        std::vector<float> row(static_cast<std::size_t>(2 * dd));
        for (std::int64_t i = 0; i < dd; ++i) {
          row[static_cast<std::size_t>(i)] = c.keys(l)(h, t, i);
          row[static_cast<std::size_t>(dd + i)] = c.values(l)(h, t, i);
        }
        (*entered)[Key{l, h, c.positions(l)(h, t)}] = std::move(row);
      }
    return Status::ok();
  };
  const kvpolicy::H2O h2o(kvpolicy::H2OParams::original(kBudget / 2, kBudget / 2));
  auto run = [&](std::shared_ptr<KiviHookState> state, bool with_kivi) {
    Hooks<C> hooks = kvpolicy::combine(recorder, h2o_hooks<C>(h2o));
    if (with_kivi) hooks = kvpolicy::combine(hooks, kivi_hooks<C>(kq, vq, {}, state));
    Session<C> sess(model(), C(engine_test::shape_for(T + kSteps + 4)), hooks);
    sess.load(pre);
    std::vector<std::vector<float>> logits;
    for (int step = 0; step < kSteps; ++step) {
      sess.decode(s.prompt[static_cast<std::size_t>(step)]);  // fixed tokens: the same sequence in every run
      logits.emplace_back(sess.logits().begin(), sess.logits().end());
      if (!with_kivi) continue;
      for (int l = 0; l < cfg.n_layers; ++l) {
        INFO("step " << step << " layer " << l);
        const KiviLayerStore& L = state->layers[static_cast<std::size_t>(l)];
        REQUIRE(sess.cache().uniform_length(l) == kBudget);
        CHECK(L.handed == kBudget);     // every token, the step's own included, after its attention
        CHECK(L.rebuilds == step + 2);  // the prefill compaction, then one per decode step
        CHECK(L.role[0].q.tokens == 32);
        CHECK(L.role[0].st.residual_len == 16);
        CHECK(L.role[1].q.tokens == 16);
        CHECK(L.role[1].st.residual_len == 32);
        CHECK(L.bytes(kq, vq, H, d) == static_cast<double>(H) * (48 * kq.bytes_per_token(d) + 48 * 2.0 * d));
        // Residual slots hold tokens that were never quantized (slots only move down, the rebuild keeps the
        // same split): their rows are the rows they entered with, bit for bit, and their fp16 copy in the store
        // is those rows rounded. The quantized slots differ somewhere.
        std::int64_t residual_equal = 0, residual_rows = 0, quantized_changed = 0;
        for (std::int64_t h = 0; h < H; ++h)
          for (std::int64_t t = 0; t < kBudget; ++t) {
            const auto& row = entered->at(Key{l, h, sess.cache().positions(l)(h, t)});
            for (int r = 0; r < 2; ++r) {
              const std::int64_t first_residual = L.role[r].q.tokens;
              for (std::int64_t i = 0; i < d; ++i) {
                const float got = (r == 0 ? sess.cache().keys(l) : sess.cache().values(l))(h, t, i);
                const float was = row[static_cast<std::size_t>(r * d + i)];
                if (t >= first_residual) {
                  residual_equal += got == was;
                  residual_equal += kvpolicy::to_float(L.role[r].st.residual(h, t - first_residual, i)) == kvpolicy::kivi::r16(was);
                } else {
                  quantized_changed += got != was;
                }
              }
              if (t >= first_residual) ++residual_rows;
            }
          }
        CHECK(residual_equal == 2 * residual_rows * d);
        CHECK(quantized_changed > 0);
      }
    }
    return logits;
  };
  auto s1 = std::make_shared<KiviHookState>(), s2 = std::make_shared<KiviHookState>();
  const auto a = run(s1, true);
  const auto b = run(s2, true);
  CHECK(a == b);                    // deterministic
  CHECK(a != run(nullptr, false));  // the decoded rows reached the attention
}

TEST_CASE("engine kivi: bad policies and ragged evictions are refused with messages, the cache untouched", "[engine][kivi]") {
  const TaskSample& s = engine_test::eval_samples().at(0);
  const std::int64_t T = static_cast<std::int64_t>(s.prompt.size());
  using C = ContiguousKVCache<float>;
  const PrefillState pre = prefill(model(), s.prompt);
  Session<C> plain(model(), C(engine_test::shape_for(T + 4)));
  plain.load(pre);
  auto refuse = [&](Hooks<C> hooks, const std::string& message) {
    INFO(message);
    Session<C> sess(model(), C(engine_test::shape_for(T + 4)), std::move(hooks));
    CHECK_THROWS_WITH(sess.load(pre), Catch::Contains(message));
    // Nothing was quantized before the refusal: the rows are the prompt's.
    bool same = true;
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t i = 0; i < model().config().head_dim; ++i)
        same = same && sess.cache().keys(0)(0, t, i) == plain.cache().keys(0)(0, t, i) &&
               sess.cache().values(0)(0, t, i) == plain.cache().values(0)(0, t, i);
    CHECK(same);
  };
  const auto k2 = kivi(kvpolicy::QuantRole::kKeys, 2, 32), v2 = kivi(kvpolicy::QuantRole::kValues, 2, 32);
  refuse(kivi_hooks<C>(kivi(kvpolicy::QuantRole::kKeys, 3, 32), v2), "bits is 3, must be 2, 4 or 8");
  refuse(kivi_hooks<C>(v2, k2), "the keys policy has role values, must be keys");
  refuse(kivi_hooks<C>(k2, kvpolicy::KiviQuant(kvpolicy::KiviQuantParams{.role = kvpolicy::QuantRole::kValues, .group = 64})),
         "head_dim 32 is not a multiple of the values group 64");
  refuse(kivi_hooks<C>(kvpolicy::KiviQuant(kvpolicy::KiviQuantParams{.role = kvpolicy::QuantRole::kKeys, .residual = 48}), v2),
         "keys residual 48 must be a positive multiple of group 32");
  // Ada-KV's per-head budgets leave ragged kv heads: one KIVI store cannot hold them.
  const PolicyUnderTest adakv = adakv_policy();
  Session<C> ragged(model(), C(engine_test::shape_for(T + 4)), kvpolicy::combine(adakv.contiguous(T, 64), kivi_hooks<C>(k2, v2)));
  CHECK_THROWS_WITH(ragged.load(pre), Catch::Contains("ragged eviction (per-head budgets) cannot precede KIVI"));
}
