// The four prefetch policies on hand-computed cases: Quest lookahead,
// InfiniGen, SpeCache, ShadowKV-style landmarks; bad input -> clear errors
// and nothing written.
#include <catch2/catch.hpp>

#include <cmath>
#include <string>

#include "policy/prefetch/prefetch_fixture.hpp"

using namespace kvpolicy;
using namespace prefetch_test;
using Scalar = backend::Scalar;

namespace {

bool contains(const Status& s, const char* text) { return std::string(s.message()).find(text) != std::string::npos; }

/// (batch, Hq, d) queries from a flat list.
struct Queries {
  std::vector<float> q;
  TensorView<const float, 3> view;
  Queries(std::vector<float> v, std::int64_t batch, std::int64_t heads, std::int64_t d)
      : q(std::move(v)), view(TensorView<const float, 3>::contiguous(q.data(), {batch, heads, d})) {}
};

}  // namespace

// ---- Quest lookahead --------------------------------------------------------

TEST_CASE("quest_lookahead: top pages by the bound of the current query, then reuse", "[prefetch]") {
  // One kv head, d = 2, pages of 2 tokens; the sequence holds pages [3, 0, 2, 1] (8 tokens).
  Pool pool(4, 1, 2, 2);
  pool.add_sequence({3, 0, 2, 1}, 8);
  const float x[8] = {1, 2, 5, 4, 3, 0, 9, 9};  // channel 0 per token; channel 1 stays 0
  for (int t = 0; t < 8; ++t) pool.key(0, 0, t)[0] = x[t];
  QuestMeta qm(pool);
  QuestLookaheadParams p;
  p.page_budget = 3;
  p.dense_layers = 0;
  const QuestLookahead<float> pol(p);
  HistoryBuf hb;
  QuestLookaheadState<float> st{qm.meta, hb.make(4)};
  const ProblemShape shape{.num_q_heads = 1, .num_kv_heads = 1, .head_dim = 2, .max_kv_len = 8};
  const Requirements req = pol.requirements(Context<Scalar>{}, shape, 2);
  REQUIRE(req.status.is_ok());
  CHECK(req.output.capacity == 4);
  Scratch ws;
  const auto ctx = ws.context<Scalar>(req.workspace_bytes);
  Queries q({1.0f, 0.0f}, 1, 1, 2);
  Request r(4);
  // U over the complete pages (logical 0..2) = channel-0 max = [2, 5, 3]; top-2 = logical 1, 2, plus the last (3).
  REQUIRE(pol.predict(ctx, st, DecodeInput<float>{q.view, pool.table(), 2, 5}, r.req).is_ok());
  // Priority 1 each (the single head wants them): ties -> the later entry first.
  CHECK(r.list() == std::vector<std::int32_t>{1, 2, 0});
  CHECK(r.priority[0] == 1.0f);

  // Step 0 read page 3 only; the next prediction keeps it (reuse, priority 0, last).
  PrefetchCounters c;
  Selection actual(PageRows{{3, 1}});
  REQUIRE(pol.observe(ctx, st, actual.sel, c).is_ok());
  CHECK(c.hits == 1);    // page 1
  CHECK(c.misses == 1);  // page 3
  CHECK(c.wasted == 2);
  Request r2(4);
  REQUIRE(pol.predict(ctx, st, DecodeInput<float>{q.view, pool.table(), 2, 5}, r2.req).is_ok());
  CHECK(r2.list() == std::vector<std::int32_t>{1, 2, 0, 3});
  CHECK(r2.priority[3] == 0.0f);

  // Without reuse the old page is not requested.
  p.reuse_previous = false;
  const QuestLookahead<float> no_reuse(p);
  Request r3(4);
  REQUIRE(no_reuse.predict(ctx, st, DecodeInput<float>{q.view, pool.table(), 2, 5}, r3.req).is_ok());
  CHECK(r3.list() == std::vector<std::int32_t>{1, 2, 0});

  // A dense layer predicts every page, the most recent first.
  p.dense_layers = 2;
  const QuestLookahead<float> dense(p);
  Request r4(4);
  REQUIRE(dense.predict(ctx, st, DecodeInput<float>{q.view, pool.table(), 2, 1}, r4.req).is_ok());
  CHECK(r4.list() == std::vector<std::int32_t>{1, 2, 0, 3});
}

TEST_CASE("quest_lookahead: per query head rows are unioned with the fraction of heads as priority", "[prefetch]") {
  Pool pool(4, 1, 2, 2);
  pool.add_sequence({3, 0, 2, 1}, 8);
  const float c0[8] = {1, 2, 5, 4, 3, 0, 9, 9}, c1[8] = {7, 7, 0, 0, 1, 1, 0, 0};
  for (int t = 0; t < 8; ++t) {
    pool.key(0, 0, t)[0] = c0[t];
    pool.key(0, 0, t)[1] = c1[t];
  }
  QuestMeta qm(pool);
  QuestLookaheadParams p;
  p.page_budget = 2;
  p.dense_layers = 0;
  const QuestLookahead<float> pol(p);
  HistoryBuf hb;
  QuestLookaheadState<float> st{qm.meta, hb.make(4)};
  Scratch ws;
  const auto ctx = ws.context<Scalar>(
      pol.requirements(Context<Scalar>{}, {.num_q_heads = 2, .num_kv_heads = 1, .head_dim = 2, .max_kv_len = 8}, 2).workspace_bytes);
  // Head 0 looks along channel 0 (top page logical 1), head 1 along channel 1 (logical 0).
  Queries q({1, 0, 0, 1}, 1, 2, 2);
  Request r(4);
  REQUIRE(pol.predict(ctx, st, DecodeInput<float>{q.view, pool.table(), 2, 3}, r.req).is_ok());
  // Last page: both heads (1.0); logical 1 and logical 0: one head each (0.5), later entry first.
  CHECK(r.list() == std::vector<std::int32_t>{1, 0, 3});
  CHECK(r.priority[0] == 1.0f);
  CHECK(r.priority[1] == 0.5f);
  CHECK(r.priority[2] == 0.5f);
}

TEST_CASE("quest_lookahead: bad input is rejected and nothing is written", "[prefetch]") {
  Pool pool(4, 1, 2, 2);
  pool.add_sequence({3, 0, 2, 1}, 8);
  QuestMeta qm(pool);
  const QuestLookahead<float> pol(QuestLookaheadParams{.page_budget = 2, .dense_layers = 0});
  HistoryBuf hb;
  QuestLookaheadState<float> st{qm.meta, hb.make(4)};
  Scratch ws;
  const auto ctx = ws.context<Scalar>(
      pol.requirements(Context<Scalar>{}, {.num_q_heads = 1, .num_kv_heads = 1, .head_dim = 2, .max_kv_len = 8}, 2).workspace_bytes);
  Queries q({1, 0}, 1, 1, 2);
  Request small(2);  // the table has 4 entries
  Status s = pol.predict(ctx, st, DecodeInput<float>{q.view, pool.table(), 2, 3}, small.req);
  CHECK(s.code() == StatusCode::kOutputTooSmall);
  CHECK(small.pages[0] == -7);
  CHECK(st.history.predicted_for == -1);
  Queries wrong_d({1, 0, 0}, 1, 1, 3);
  Request r(4);
  s = pol.predict(ctx, st, DecodeInput<float>{wrong_d.view, pool.table(), 2, 3}, r.req);
  CHECK(contains(s, "head_dim is 3"));
  CHECK(r.pages[0] == -7);
  CHECK_FALSE(QuestLookahead<float>(QuestLookaheadParams{.page_budget = 0}).validate_params().is_ok());
  CHECK(contains(pol.predict(Context<Scalar>{}, st, DecodeInput<float>{q.view, pool.table(), 2, 3}, r.req), "workspace"));
  CHECK(r.pages[0] == -7);
}

// ---- InfiniGen --------------------------------------------------------------

TEST_CASE("infinigen: symmetric_eigen returns orthonormal eigenvectors", "[prefetch]") {
  double a[4] = {2, 1, 1, 2}, eig[2], vec[4];
  InfiniGen::symmetric_eigen(a, 2, eig, vec);
  const int top = eig[0] > eig[1] ? 0 : 1;
  CHECK(eig[top] == Approx(3.0));
  CHECK(eig[1 - top] == Approx(1.0));
  CHECK(vec[0 * 2 + top] == Approx(std::sqrt(0.5)));
  CHECK(vec[1 * 2 + top] == Approx(std::sqrt(0.5)));
  // A random symmetric 6 x 6: A v = lambda v, V^T V = I.
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> u(-1, 1);
  double m[36], orig[36], e[6], v[36];
  for (int i = 0; i < 6; ++i)
    for (int j = 0; j <= i; ++j) m[i * 6 + j] = m[j * 6 + i] = u(rng);
  std::copy(m, m + 36, orig);
  InfiniGen::symmetric_eigen(m, 6, e, v);
  for (int j = 0; j < 6; ++j)
    for (int i = 0; i < 6; ++i) {
      double av = 0;
      for (int k = 0; k < 6; ++k) av += orig[i * 6 + k] * v[k * 6 + j];
      CHECK(av == Approx(e[j] * v[i * 6 + j]).margin(1e-9));
      double dot = 0;
      for (int k = 0; k < 6; ++k) dot += v[k * 6 + i] * v[k * 6 + j];
      CHECK(dot == Approx(i == j ? 1.0 : 0.0).margin(1e-9));
    }
}

TEST_CASE("infinigen: partial channels, logit threshold, one k for all heads", "[prefetch]") {
  // d = 4, r = 2, no skew. Prompt queries put their mass on channels 0 and 2.
  Pool pool(3, 1, 2, 4);
  pool.add_sequence({2, 0, 1}, 6);
  const float k02[6] = {0, 8, 2, 7, 1, 10};  // k0 + k2 per token, k0 = k2
  for (int t = 0; t < 6; ++t) {
    float* k = pool.key(0, 0, t);
    k[0] = k[2] = k02[t] / 2;
    k[1] = k[3] = 100.0f;  // ignored channels
  }
  InfiniGenParams p;
  p.skew = false;
  p.partial_ratio = 0.5f;
  p.alpha = 1.5f;
  p.dense_layers = 2;
  const InfiniGen pol(p);
  InfiniGenBuf buf(pol, pool);
  Scratch ws;
  const auto ctx = ws.context<Scalar>(
      pol.requirements(Context<Scalar>{}, {.num_q_heads = 1, .num_kv_heads = 1, .head_dim = 4, .max_kv_len = 6}, 2).workspace_bytes);
  std::vector<float> prompt = {3, 0.1f, 2, 0, -3, 0, 1, 0.1f};  // (Hq=1, W=2, d=4)
  REQUIRE(pol.prepare(ctx, TensorView<const float, 3>::contiguous(prompt.data(), {1, 2, 4}), pool.cview(), buf.st).is_ok());
  CHECK(buf.ints == std::vector<std::int32_t>{0, 2});
  CHECK(buf.st.key_row(1, 1, 0)[0] == 5.0f);  // token 5 (page 1, slot 1): k0 = 5
  // q~ = (1, 1): s = (k0 + k2) / sqrt(4) = [0, 4, 1, 3.5, 0.5, 5]; max - alpha = 3.5 -> count 2 (strict).
  Queries q({1, 5, 1, 5}, 1, 1, 4);
  Request r(3);
  REQUIRE(pol.predict(ctx, buf.st, DecodeInput<float>{q.view, pool.table(), 2, 2}, r.req).is_ok());
  CHECK(r.list() == std::vector<std::int32_t>{1, 2});  // token 5 (logical 2 = page 1), token 1 (logical 0 = page 2)
  CHECK(r.priority[0] == 5.0f);
  CHECK(r.priority[1] == 4.0f);
  // max_num_kv caps k.
  p.max_num_kv = 1;
  const InfiniGen capped(p);
  Request r1(3);
  REQUIRE(capped.predict(ctx, buf.st, DecodeInput<float>{q.view, pool.table(), 2, 2}, r1.req).is_ok());
  CHECK(r1.list() == std::vector<std::int32_t>{1});
  // Layers 0 and 1 are loaded whole.
  Request r2(3);
  REQUIRE(pol.predict(ctx, buf.st, DecodeInput<float>{q.view, pool.table(), 2, 1}, r2.req).is_ok());
  CHECK(r2.list() == std::vector<std::int32_t>{1, 0, 2});

  // Appending a token: its partial key enters the cache.
  Pool grown = pool;
  grown.indices = {2, 0, 1};
  grown.last = {2};
  // (the pool is full; write a new last token value in place and rebuild its partial key)
  grown.key(0, 0, 5)[0] = 0;
  grown.key(0, 0, 5)[2] = 0;
  const std::int32_t one = 1;
  REQUIRE(pol.on_append(ctx, AppendInput<float>{grown.cview(), &one}, buf.st).is_ok());
  CHECK(buf.st.key_row(1, 1, 0)[0] == 0.0f);
}

TEST_CASE("infinigen: the GQA group shares channels, the mean count decides k", "[prefetch]") {
  // Two query heads on one kv head, d = 2, r = 1 (ratio 0.5).
  Pool pool(2, 1, 2, 2);
  pool.add_sequence({1, 0}, 4);
  const float kx[4] = {0, 1, 2, 3};
  for (int t = 0; t < 4; ++t) pool.key(0, 0, t)[0] = kx[t];
  InfiniGenParams p;
  p.skew = false;
  p.partial_ratio = 0.5f;
  p.alpha = 0.1f;  // each head: one token above max - alpha
  p.dense_layers = 0;
  const InfiniGen pol(p);
  InfiniGenBuf buf(pol, pool);
  Scratch ws;
  const auto ctx = ws.context<Scalar>(
      pol.requirements(Context<Scalar>{}, {.num_q_heads = 2, .num_kv_heads = 1, .head_dim = 2, .max_kv_len = 4}, 2).workspace_bytes);
  std::vector<float> prompt = {1, 0, 1, 0};  // both heads along channel 0
  REQUIRE(pol.prepare(ctx, TensorView<const float, 3>::contiguous(prompt.data(), {2, 1, 2}), pool.cview(), buf.st).is_ok());
  CHECK(buf.ints[0] == 0);
  // Head 0: q = +1 -> token 3 best; head 1: q = -1 -> token 0 best. k = 1.
  Queries q({1, 0, -1, 0}, 1, 2, 2);
  Request r(2);
  REQUIRE(pol.predict(ctx, buf.st, DecodeInput<float>{q.view, pool.table(), 2, 0}, r.req).is_ok());
  // Token 3 (page 0, logit 3/sqrt2) first, token 0 (page 1, logit 0) second.
  CHECK(r.list() == std::vector<std::int32_t>{0, 1});
}

TEST_CASE("infinigen: skewing concentrates a rotated query direction in channel 0", "[prefetch]") {
  Pool pool(1, 1, 4, 4);
  pool.add_sequence({0}, 2);
  pool.key(0, 0, 0)[0] = 1;
  pool.key(0, 0, 0)[1] = 1;
  InfiniGenParams p;
  p.partial_ratio = 0.25f;  // r = 1
  const InfiniGen pol(p);
  InfiniGenBuf buf(pol, pool);
  Scratch ws;
  const auto ctx = ws.context<Scalar>(
      pol.requirements(Context<Scalar>{}, {.num_q_heads = 1, .num_kv_heads = 1, .head_dim = 4, .max_kv_len = 4}, 4).workspace_bytes);
  std::vector<float> prompt = {1, 1, 0, 0, 2, 2, 0, 0, -1, -1, 0, 0};  // every query along (1, 1, 0, 0)
  REQUIRE(pol.prepare(ctx, TensorView<const float, 3>::contiguous(prompt.data(), {1, 3, 4}), pool.cview(), buf.st).is_ok());
  CHECK(buf.ints[0] == 0);                                              // the top eigenvector's channel
  CHECK(buf.floats[0 * 4 + 0] == Approx(std::sqrt(0.5)).margin(1e-6));  // A[0][0]
  CHECK(buf.floats[1 * 4 + 0] == Approx(std::sqrt(0.5)).margin(1e-6));  // A[1][0]
  CHECK(buf.st.key_row(0, 0, 0)[0] == Approx(std::sqrt(2.0)).margin(1e-6));
}

namespace {
struct FixedQueryAdapter {
  std::vector<float> q;
  Status speculative_query(std::int32_t layer, const std::int64_t* positions, TensorView<const float, 2> x,
                           TensorView<float, 3> out) const {
    if (layer < 0 || positions == nullptr) return KVP_INVALID("adapter: bad call");
    for (std::int64_t i = 0; i < out.extent(2); ++i) out(0, 0, i) = q[static_cast<std::size_t>(i)] * x(0, 0);
    return Status::ok();
  }
};
static_assert(InfiniGenModelAdapter<FixedQueryAdapter>);
struct FailingAdapter {
  Status speculative_query(std::int32_t, const std::int64_t*, TensorView<const float, 2>, TensorView<float, 3>) const {
    return KVP_INVALID("adapter: the model has no such layer");
  }
};
}  // namespace

TEST_CASE("infinigen: predict_from_input runs the adapter, then predict, errors before prepare", "[prefetch]") {
  Pool pool(3, 1, 2, 4);
  pool.add_sequence({2, 0, 1}, 6);
  pool.fill_random(3);
  InfiniGenParams p;
  p.dense_layers = 0;
  p.partial_ratio = 0.5f;
  const InfiniGen pol(p);
  InfiniGenBuf a(pol, pool), b(pol, pool);
  Scratch ws;
  const auto ctx = ws.context<Scalar>(
      pol.requirements(Context<Scalar>{}, {.num_q_heads = 1, .num_kv_heads = 1, .head_dim = 4, .max_kv_len = 6}, 2).workspace_bytes);
  Queries q({0.5f, -1, 2, 0.25f}, 1, 1, 4);
  Request early(3);
  CHECK(contains(pol.predict(ctx, a.st, DecodeInput<float>{q.view, pool.table(), 2, 3}, early.req), "before prepare"));
  const std::int32_t one = 1;
  CHECK(contains(pol.on_append(ctx, AppendInput<float>{pool.cview(), &one}, a.st), "before prepare"));
  std::vector<float> prompt = {1, 0, 1, 0, 0, 1, 0, 1};
  for (auto* s : {&a.st, &b.st})
    REQUIRE(pol.prepare(ctx, TensorView<const float, 3>::contiguous(prompt.data(), {1, 2, 4}), pool.cview(), *s).is_ok());
  Request r1(3), r2(3);
  REQUIRE(pol.predict(ctx, a.st, DecodeInput<float>{q.view, pool.table(), 2, 3}, r1.req).is_ok());
  const FixedQueryAdapter ad{{0.25f, -0.5f, 1.0f, 0.125f}};
  std::vector<float> x = {2.0f}, qbuf(4);
  const std::int64_t pos = 6;
  REQUIRE(pol.predict_from_input(ctx, b.st, ad, TensorView<const float, 2>::contiguous(x.data(), {1, 1}), &pos, pool.table(), 3,
                                 TensorView<float, 3>::contiguous(qbuf.data(), {1, 1, 4}), r2.req)
              .is_ok());
  CHECK(r1.list() == r2.list());
  CHECK(qbuf[2] == 2.0f);
  // A failing adapter: its error comes back, the request and the history stay as they were.
  const std::int64_t serial = b.st.history.serial;
  Request r3(3);
  CHECK(contains(pol.predict_from_input(ctx, b.st, ad, TensorView<const float, 2>::contiguous(x.data(), {1, 1}), &pos, pool.table(), -1,
                                        TensorView<float, 3>::contiguous(qbuf.data(), {1, 1, 4}), r3.req),
                 "layer is -1"));
  CHECK(b.st.history.serial == serial);
  CHECK(r3.pages[0] == -7);
  CHECK(contains(pol.predict_from_input(ctx, b.st, FailingAdapter{}, TensorView<const float, 2>::contiguous(x.data(), {1, 1}), &pos,
                                        pool.table(), 3, TensorView<float, 3>::contiguous(qbuf.data(), {1, 1, 4}), r3.req),
                 "no such layer"));
  CHECK(b.st.history.serial == serial);
  CHECK(r3.pages[0] == -7);
  // A ratio that leaves no channel is rejected when the state is built.
  InfiniGenState st;
  std::vector<float> f(100);
  std::vector<std::int32_t> ii(10);
  std::vector<std::int64_t> hh(10);
  p.partial_ratio = 0.1f;
  CHECK(contains(InfiniGen(p).make_state(f.data(), ii.data(), hh.data(), 3, 2, 1, 4, &st), "leaves no channel"));
  p.alpha = 0;
  CHECK(contains(InfiniGen(p).validate_params(), "alpha"));
}

// ---- SpeCache ---------------------------------------------------------------

TEST_CASE("specache: q4_0 key copy, GQA-mean probabilities, top-k tokens to pages", "[prefetch]") {
  // d = 32 (one ggml block), 2 query heads on 1 kv head, pages of 2 tokens.
  Pool pool(2, 1, 2, 32);
  pool.add_sequence({1, 0}, 4);
  const float a[4] = {0, 8, 4, 2};  // channel 0 (q4_0 stores these powers of two exactly), others 0
  for (int t = 0; t < 4; ++t) pool.key(0, 0, t)[0] = a[t];
  SpeCacheParams p;
  p.topk = 2;
  const SpeCache pol(p);
  SpeCacheBuf buf(pol, pool);
  Scratch ws;
  const auto ctx = ws.context<Scalar>(
      pol.requirements(Context<Scalar>{}, {.num_q_heads = 2, .num_kv_heads = 1, .head_dim = 32, .max_kv_len = 4}, 2).workspace_bytes);
  REQUIRE(pol.on_append(ctx, AppendInput<float>{pool.cview(), nullptr}, buf.st).is_ok());
  float deq[32];
  pol.dequantize_key(buf.st, 1, 1, 0, deq);  // token 1 on page 1, slot 1
  CHECK(deq[0] == 8.0f);
  CHECK(deq[5] == 0.0f);
  // Head 0: q = +e0, head 1: q = -e0 -> GQA-mean of the two softmaxes.
  std::vector<float> qv(64, 0.0f);
  qv[0] = 1.0f;
  qv[32] = -1.0f;
  Queries q(qv, 1, 2, 32);
  double p0[4], p1[4], s0 = 0, s1 = 0;
  for (int t = 0; t < 4; ++t) {
    p0[t] = std::exp(a[t] / std::sqrt(32.0));
    p1[t] = std::exp(-a[t] / std::sqrt(32.0));
    s0 += p0[t];
    s1 += p1[t];
  }
  double mean[4];
  for (int t = 0; t < 4; ++t) mean[t] = 0.5 * (p0[t] / s0 + p1[t] / s1);
  // mean ~ [0.26, 0.29, 0.22, 0.23]: the top two tokens are 1 and 0, both on logical page 0 (page 1), then 3.
  REQUIRE(mean[1] > mean[0]);
  REQUIRE(mean[0] > mean[3]);
  REQUIRE(mean[3] > mean[2]);
  Request r(2);
  REQUIRE(pol.predict(ctx, buf.st, DecodeInput<float>{q.view, pool.table(), 2, 0}, r.req).is_ok());
  CHECK(r.list() == std::vector<std::int32_t>{1});
  CHECK(r.priority[0] == Approx(mean[0] + mean[1]).epsilon(1e-5));
  // k = 3 adds token 3 (logical page 1 = page 0).
  p.topk = 3;
  Request r3(2);
  REQUIRE(SpeCache(p).predict(ctx, buf.st, DecodeInput<float>{q.view, pool.table(), 2, 0}, r3.req).is_ok());
  CHECK(r3.list() == std::vector<std::int32_t>{1, 0});
  CHECK(r3.priority[1] == Approx(mean[3]).epsilon(1e-5));
}

TEST_CASE("specache: q8_0 copy and appends, non-finite keys and bad shapes are rejected", "[prefetch]") {
  Pool pool(2, 1, 2, 32);
  pool.add_sequence({1, 0}, 3);
  pool.fill_random(11);
  const SpeCache pol(SpeCacheParams{.type = GgmlType::kQ8_0, .topk = 1});
  SpeCacheBuf buf(pol, pool);
  Scratch ws;
  const auto ctx = ws.context<Scalar>(
      pol.requirements(Context<Scalar>{}, {.num_q_heads = 1, .num_kv_heads = 1, .head_dim = 32, .max_kv_len = 4}, 2).workspace_bytes);
  REQUIRE(pol.on_append(ctx, AppendInput<float>{pool.cview(), nullptr}, buf.st).is_ok());
  float deq[32];
  pol.dequantize_key(buf.st, 0, 0, 0, deq);  // token 2
  float amax = 0;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(pool.key(0, 0, 2)[i]));
  for (int i = 0; i < 32; ++i) CHECK(std::fabs(deq[i] - pool.key(0, 0, 2)[i]) <= amax / 127.0f * 0.5f * 1.05f + 1e-6f);
  const auto before = buf.codes;
  pool.key(0, 0, 2)[7] = std::nanf("");
  const std::int32_t one = 1;
  const Status s = pol.on_append(ctx, AppendInput<float>{pool.cview(), &one}, buf.st);
  CHECK(contains(s, "token 2 kv head 0 channel 7 is not finite"));
  CHECK(buf.codes == before);
  SpeCacheState st;
  std::vector<std::uint8_t> codes(100);
  std::vector<std::int64_t> hist(4);
  CHECK(contains(pol.make_state(codes.data(), hist.data(), 2, 2, 1, 48, &st), "head_dim 48 is not a multiple"));
  // A state of another format is not accepted.
  const SpeCache q4(SpeCacheParams{.type = GgmlType::kQ4_0});
  Queries q(std::vector<float>(32, 1.0f), 1, 1, 32);
  Request r(2);
  CHECK(contains(q4.predict(ctx, buf.st, DecodeInput<float>{q.view, pool.table(), 2, 0}, r.req), "does not match"));
  CHECK(r.pages[0] == -7);
  CHECK_FALSE(SpeCache(SpeCacheParams{.topk = 0}).validate_params().is_ok());
}

// ---- ShadowKV ---------------------------------------------------------------

TEST_CASE("shadowkv: landmarks, outlier chunk, local tail and top chunks", "[prefetch]") {
  // Chunks of 2 tokens, pages of 4 (2 chunks each), d = 2; 4 pages = 16 tokens = 8 chunks.
  Pool pool(4, 1, 4, 2);
  pool.add_sequence({2, 3, 0, 1}, 16);
  const float x[8] = {1, 5, 2, 0, 0.5f, 1.5f, 0, 0};  // chunk c: both keys (x_c, 0)
  for (int c = 0; c < 8; ++c)
    for (int j = 0; j < 2; ++j) pool.key(0, 0, 2 * c + j)[0] = x[c];
  pool.key(0, 0, 6)[0] = 1;  // chunk 3 = {(1, 0), (0, 1)}: landmark (0.5, 0.5), min cos 0.7071
  pool.key(0, 0, 7)[1] = 1;
  ShadowKVParams p;
  p.chunk_size = 2;
  p.chunk_budget = 1;
  p.outlier_chunks = 1;
  p.local_chunks = 1;
  const ShadowKV pol(p);
  ShadowKVBuf buf(pol, pool);
  Scratch ws;
  const auto ctx = ws.context<Scalar>(
      pol.requirements(Context<Scalar>{}, {.num_q_heads = 1, .num_kv_heads = 1, .head_dim = 2, .max_kv_len = 16}, 4).workspace_bytes);
  REQUIRE(pol.on_append(ctx, AppendInput<float>{pool.cview(), nullptr}, buf.st).is_ok());
  // Chunk 3 is in page 3 (logical 1), chunk-in-page 1.
  const float* L = buf.st.landmarks + buf.st.slot(3, 1, 0) * 2;
  CHECK(L[0] == 0.5f);
  CHECK(L[1] == 0.5f);
  CHECK(buf.st.outlier[buf.st.slot(3, 1, 0)] == Approx(std::sqrt(0.5)));
  CHECK(buf.st.outlier[buf.st.slot(2, 0, 0)] == Approx(1.0));
  Queries q({1, 0}, 1, 1, 2);
  Request r(4);
  REQUIRE(pol.predict(ctx, buf.st, DecodeInput<float>{q.view, pool.table(), 4, 0}, r.req).is_ok());
  // Local tail chunk 7 (logical 3 = page 1) and outlier chunk 3 (logical 1 = page 3) at +inf, later entry
  // first; then chunk 1 (x = 5, logical 0 = page 2). Logical 2 (page 0) is not requested.
  CHECK(r.list() == std::vector<std::int32_t>{1, 3, 2});
  CHECK(std::isinf(r.priority[0]));
  // score of chunk 1 = softmax over the 6 non-outlier candidate chunks {0,1,2,4,5,6}.
  double s = 0;
  for (int c : {0, 1, 2, 4, 5, 6}) s += std::exp(x[c] / std::sqrt(2.0));
  CHECK(r.priority[2] == Approx(std::exp(5 / std::sqrt(2.0)) / s).epsilon(1e-5));

  // Reuse: the pages step 0 read stay requested at priority -1.
  PrefetchCounters c;
  Selection actual(PageRows{{0, 1}});
  REQUIRE(pol.observe(ctx, buf.st, actual.sel, c).is_ok());
  Request r2(4);
  REQUIRE(pol.predict(ctx, buf.st, DecodeInput<float>{q.view, pool.table(), 4, 0}, r2.req).is_ok());
  CHECK(r2.list() == std::vector<std::int32_t>{1, 3, 2, 0});
  CHECK(r2.priority[3] == -1.0f);
}

TEST_CASE("shadowkv: appends complete chunks, bad geometry is rejected", "[prefetch]") {
  Pool pool(2, 1, 4, 2);
  pool.add_sequence({1, 0}, 5);  // chunk 2 incomplete (token 4 only)
  pool.fill_random(2);
  const ShadowKV pol(ShadowKVParams{.chunk_size = 2});
  ShadowKVBuf buf(pol, pool);
  Scratch ws;
  const auto ctx = ws.context<Scalar>(
      pol.requirements(Context<Scalar>{}, {.num_q_heads = 1, .num_kv_heads = 1, .head_dim = 2, .max_kv_len = 8}, 4).workspace_bytes);
  REQUIRE(pol.on_append(ctx, AppendInput<float>{pool.cview(), nullptr}, buf.st).is_ok());
  CHECK(buf.st.landmarks[buf.st.slot(0, 0, 0) * 2] == 0.0f);  // not complete: untouched
  pool.last = {2};                                            // token 5 appended: chunk 2 complete
  const std::int32_t one = 1;
  REQUIRE(pol.on_append(ctx, AppendInput<float>{pool.cview(), &one}, buf.st).is_ok());
  CHECK(buf.st.landmarks[buf.st.slot(0, 0, 0) * 2] == Approx((pool.key(0, 0, 4)[0] + pool.key(0, 0, 5)[0]) / 2));
  ShadowKVState st;
  std::vector<float> f(100);
  std::vector<std::int64_t> h(4);
  CHECK(
      contains(ShadowKV(ShadowKVParams{.chunk_size = 3}).make_state(f.data(), h.data(), 2, 4, 1, 2, &st), "not a multiple of chunk_size"));
  CHECK_FALSE(ShadowKV(ShadowKVParams{.chunk_size = 0}).validate_params().is_ok());
  Queries q({1, 0}, 1, 1, 2);
  Request r(2);
  CHECK(contains(pol.predict(ctx, buf.st, DecodeInput<float>{q.view, pool.table(), 2, 0}, r.req), "page_size is 2"));
  CHECK(r.pages[0] == -7);
}
