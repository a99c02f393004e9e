// Quest lookahead's device path on the emulated device (the scalar ops behind
// a CallScope, tests/policy/emulated_device.hpp) against the host path: the
// same requests, priorities, history stamps and counters over several steps,
// with the device's dense request form (pages past the size -1); the history
// reset on a device; and the refusals (host memory on a device, a history
// without its pending slots). ShadowKV's, SpeCache's and InfiniGen's device
// paths likewise (their states built on append equal, then requests and
// counters against the host path), and their refusals (InfiniGen's prepare
// stays on the host).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "../emulated_device.hpp"
#include "kvpolicy/ops/prefetch_ops.hpp"
#include "prefetch_fixture.hpp"

using namespace kvpolicy;
using namespace prefetch_test;
using backend::Scalar;
using kvp_test::EmulatedDevice;
using kvp_test::kEmulatedDevice;

namespace {

bool same_bits(float a, float b) {
  std::uint32_t x = 0, y = 0;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  return x == y;
}

void require_same_counters(const PrefetchCounters& a, const PrefetchCounters& b) {
  CHECK(a.hits == b.hits);
  CHECK(a.misses == b.misses);
  CHECK(a.wasted == b.wasted);
  CHECK(a.predicted == b.predicted);
  CHECK(a.needed == b.needed);
  CHECK(a.reused == b.reused);
  CHECK(a.reuse_total == b.reuse_total);
  CHECK(a.late == b.late);
  CHECK(a.transferred == b.transferred);
  CHECK(a.steps == b.steps);
  CHECK(a.predicted_steps == b.predicted_steps);
}

/// One prediction on each side (host `hst` through `hctx`, device `dst` through `dctx`): the device's size is
/// device data, its request equals the host's entry for entry (pages, priority bits), the rest of its `E` entries
/// are -1 / NaN, and its pending slots (`dhist` after the stamps of `P` pages) hold the host's counts.
template <class Pol, class State, class DeviceCtx>
void require_same_prediction(const Pol& pol, const Context<Scalar>& hctx, State& hst, const DeviceCtx& dctx, State& dst,
                             const DecodeInput<float>& hin, const DecodeInput<float>& din, std::int64_t capacity, std::int64_t E,
                             const std::vector<std::int64_t>& dhist, std::int32_t P) {
  Request hr(capacity), dr(capacity);
  std::int64_t dsize = -5;
  dr.req.device_size = &dsize;
  REQUIRE(pol.predict(hctx, hst, hin, hr.req).is_ok());
  REQUIRE(pol.predict(dctx, dst, din, dr.req).is_ok());
  CHECK(dr.req.size == -1);
  REQUIRE(dsize == hr.req.size);
  for (std::int64_t j = 0; j < hr.req.size; ++j) {
    INFO("request entry " << j);
    REQUIRE(dr.pages[static_cast<std::size_t>(j)] == hr.pages[static_cast<std::size_t>(j)]);
    REQUIRE(same_bits(dr.priority[static_cast<std::size_t>(j)], hr.priority[static_cast<std::size_t>(j)]));
  }
  for (std::int64_t j = hr.req.size; j < E; ++j) {
    CHECK(dr.pages[static_cast<std::size_t>(j)] == -1);
    CHECK(std::isnan(dr.priority[static_cast<std::size_t>(j)]));
  }
  CHECK(dhist[static_cast<std::size_t>(2 * P)] == hst.history.predicted_count);
  CHECK(dhist[static_cast<std::size_t>(2 * P) + 1] == hst.history.predicted_new);
}

/// A batch over one pool: sequences of `lens` tokens on distinct, shuffled pages.
Pool make_pool(const std::vector<std::int64_t>& lens, std::int32_t kv_heads, std::int32_t page_size, std::int32_t d, unsigned seed) {
  std::int32_t pages = 3;
  for (auto l : lens) pages += static_cast<std::int32_t>((l + page_size - 1) / page_size);
  Pool pool(pages, kv_heads, page_size, d);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(pages));
  for (std::int32_t i = 0; i < pages; ++i) ids[static_cast<std::size_t>(i)] = i;
  std::mt19937 rng(seed);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::size_t at = 0;
  for (auto l : lens) {
    const auto n = static_cast<std::size_t>((l + page_size - 1) / page_size);
    pool.add_sequence(
        std::vector<std::int32_t>(ids.begin() + static_cast<std::ptrdiff_t>(at), ids.begin() + static_cast<std::ptrdiff_t>(at + n)), l);
    at += n;
  }
  pool.fill_integers(seed, 3);  // integer keys: ties between pages' bounds are common
  return pool;
}

struct Case {
  QuestLookaheadParams params;
  std::vector<std::int64_t> lens;
  std::int32_t kv_heads = 2, group = 2, page_size = 4, head_dim = 8;
  std::int32_t actual_budget = 3;  // pages per row the engine's own Quest selection reads
  int layers_from = 0;             // first layer of the run (dense_layers decides which are dense)
};

void run_case(const Case& cs, unsigned seed) {
  Pool pool = make_pool(cs.lens, cs.kv_heads, cs.page_size, cs.head_dim, seed);
  QuestMeta qm(pool);
  const PageMetaView<const float> host_meta = qm.meta;
  const PageMetaView<const float> dev_meta =
      PageMetaView<const float>::contiguous(qm.buf.data(), pool.num_pages, pool.kv_heads, pool.head_dim, kEmulatedDevice);
  const QuestLookahead<float> pol(cs.params);
  const std::int32_t Hq = cs.kv_heads * cs.group;
  std::int64_t max_len = 0;
  for (auto l : cs.lens) max_len = std::max(max_len, l);
  const ProblemShape shape{.num_q_heads = Hq,
                           .num_kv_heads = cs.kv_heads,
                           .head_dim = cs.head_dim,
                           .max_kv_len = max_len,
                           .batch = static_cast<std::int64_t>(cs.lens.size())};
  const Requirements hreq = pol.requirements(Context<Scalar>{}, shape, cs.page_size);
  const Requirements dreq = pol.requirements(Context<EmulatedDevice>{}, shape, cs.page_size);
  REQUIRE(hreq.status.is_ok());
  REQUIRE(dreq.status.is_ok());
  REQUIRE(dreq.output.capacity == hreq.output.capacity);
  std::vector<std::byte> hws(hreq.workspace_bytes), dws(dreq.workspace_bytes, kvp_test::kWorkspacePoison);
  const Context<Scalar> hctx{Workspace{hws.data(), hws.size()}};
  const Context<EmulatedDevice> dctx{Workspace{dws.data(), dws.size()}};

  HistoryBuf hb;
  QuestLookaheadState<float> hst{host_meta, hb.make(pool.num_pages)};
  std::vector<std::int64_t> dbuf(static_cast<std::size_t>(PrefetchHistory::buffer_size(pool.num_pages)), 77);
  QuestLookaheadState<float> dst{dev_meta, PrefetchHistory::wrap(dbuf.data(), pool.num_pages)};
  REQUIRE(dst.history.reset(dctx).is_ok());
  REQUIRE(dbuf == hb.buf);

  QuestParams ap;
  ap.page_budget = cs.actual_budget;
  ap.dense_layers = 0;
  const Quest actual_quest(ap);
  PrefetchCounters hc, dc;
  std::mt19937 rng(seed * 31 + 7);
  std::uniform_int_distribution<int> qv(-3, 3);
  const std::int64_t E = pool.indptr.back();
  for (int step = 0; step < 6; ++step) {
    INFO("step " << step);
    const int layer = cs.layers_from + (step % 3);
    std::vector<float> q(static_cast<std::size_t>(cs.lens.size()) * static_cast<std::size_t>(Hq * cs.head_dim));
    for (auto& x : q) x = static_cast<float>(qv(rng));
    const auto b = static_cast<std::int64_t>(cs.lens.size());
    const DecodeInput<float> hin{TensorView<const float, 3>::contiguous(q.data(), {b, Hq, cs.head_dim}), pool.table(), cs.page_size, layer};
    const DecodeInput<float> din{TensorView<const float, 3>::contiguous(q.data(), {b, Hq, cs.head_dim}, kEmulatedDevice), pool.table(),
                                 cs.page_size, layer};
    if (step != 2)  // one step without a prediction: observe counts it as such on both sides
      require_same_prediction(pol, hctx, hst, dctx, dst, hin, din, hreq.output.capacity, E, dbuf, pool.num_pages);
    // The step's real selection (the engine's Quest with its own budget), observed on both sides.
    Quest::Plan plan;
    REQUIRE(actual_quest.plan(hctx, hin, shape, plan).is_ok());
    std::vector<std::int32_t> indptr(static_cast<std::size_t>(plan.requirements.output.rows + 1)),
        ids(static_cast<std::size_t>(std::max<std::int64_t>(plan.requirements.output.capacity, 1))),
        last(static_cast<std::size_t>(plan.requirements.output.rows));
    std::vector<std::byte> qws(plan.requirements.workspace_bytes);
    const PageSelection sel{
        indptr.data(), ids.data(), last.data(), nullptr, plan.requirements.output.rows, plan.requirements.output.capacity};
    REQUIRE(actual_quest.select(Context<Scalar>{Workspace{qws.data(), qws.size()}}, plan, hin, host_meta, sel).is_ok());
    REQUIRE(pol.observe(hctx, hst, sel, hc).is_ok());
    REQUIRE(pol.observe(dctx, dst, sel, dc).is_ok());
    require_same_counters(dc, hc);
    // Stamps equal (the pending slots are device-only: the host keeps fields).
    REQUIRE(std::equal(dbuf.begin(), dbuf.begin() + 2 * pool.num_pages, hb.buf.begin()));
    CHECK(dst.history.step == hst.history.step);
    CHECK(dst.history.serial == hst.history.serial);
    CHECK(dst.history.predicted_for == hst.history.predicted_for);
  }
  CHECK(hc.steps == 6);
  CHECK(hc.predicted_steps >= 1);
}

}  // namespace

TEST_CASE("quest_lookahead on a device path: requests, priorities, stamps and counters equal the host's", "[prefetch][device]") {
  Case base;
  base.params.page_budget = 3;
  base.params.dense_layers = 1;
  base.lens = {37, 5, 64, 0, 21};
  SECTION("per query head, reuse, a dense layer among sparse ones") { run_case(base, 1); }
  SECTION("kv-head rows (group max), no reuse") {
    Case c = base;
    c.params.gqa = QuestGqa::kGroupMax;
    c.params.reuse_previous = false;
    c.layers_from = 1;
    run_case(c, 2);
  }
  SECTION("group sum, a budget larger than some sequences, MHA") {
    Case c = base;
    c.params.gqa = QuestGqa::kGroupSum;
    c.params.page_budget = 6;
    c.group = 1;
    c.kv_heads = 3;
    c.lens = {90, 17, 4, 33};
    run_case(c, 3);
  }
  SECTION("one sequence, page size 1") {
    Case c = base;
    c.page_size = 1;
    c.lens = {23};
    c.actual_budget = 5;
    run_case(c, 4);
  }
}

namespace {

/// A batch for the device-path comparisons of ShadowKV and SpeCache.
struct DeviceRun {
  std::vector<std::int64_t> lens;
  std::int32_t kv_heads = 2, group = 2, page_size = 4, head_dim = 8;
  bool integer_data = true;  // integer keys and queries: exact ties between chunks / tokens are common
};

/// A prefetcher's device path (its ops on the emulated device) against the host path: the state built on
/// append equal (`same_state(host_buf, device_buf)`; the device appends in two halves, the host in one), then
/// the same requests, priorities, history stamps and counters over six steps (one without a prediction).
template <class Pol, class Buf, class SameState, class Prepare = void (*)(const Pool&, Buf&, Buf&)>
void run_device_case(
    const Pol& pol, const DeviceRun& cs, unsigned seed, SameState same_state, Prepare prepare = [](const Pool&, Buf&, Buf&) {}) {
  Pool pool = make_pool(cs.lens, cs.kv_heads, cs.page_size, cs.head_dim, seed);
  if (!cs.integer_data) pool.fill_random(seed + 100);
  const std::int32_t Hq = cs.kv_heads * cs.group;
  std::int64_t max_len = 0;
  for (auto l : cs.lens) max_len = std::max(max_len, l);
  const auto B = static_cast<std::int64_t>(cs.lens.size());
  const ProblemShape shape{.num_q_heads = Hq, .num_kv_heads = cs.kv_heads, .head_dim = cs.head_dim, .max_kv_len = max_len, .batch = B};
  const Requirements hreq = pol.requirements(Context<Scalar>{}, shape, cs.page_size);
  const Requirements dreq = pol.requirements(Context<EmulatedDevice>{}, shape, cs.page_size);
  REQUIRE(hreq.status.is_ok());
  REQUIRE(dreq.status.is_ok());
  REQUIRE(dreq.output.capacity == hreq.output.capacity);
  std::vector<std::byte> hws(hreq.workspace_bytes), dws(dreq.workspace_bytes, kvp_test::kWorkspacePoison);
  const Context<Scalar> hctx{Workspace{hws.data(), hws.size()}};
  const Context<EmulatedDevice> dctx{Workspace{dws.data(), dws.size()}};

  Buf hb(pol, pool), db(pol, pool, kEmulatedDevice);
  std::fill(db.hist.begin(), db.hist.end(), 77);
  REQUIRE(db.st.history.reset(dctx).is_ok());
  REQUIRE(db.hist == hb.hist);

  PagedKVView<const float> dview = pool.cview();
  dview.device = kEmulatedDevice;
  prepare(pool, hb, db);
  REQUIRE(pol.on_append(hctx, AppendInput<float>{pool.cview(), nullptr}, hb.st).is_ok());
  {
    std::vector<std::int32_t> short_last(pool.last), short_indptr{0}, short_ids;
    for (std::size_t b = 0; b < cs.lens.size(); ++b) {
      const std::int64_t half = cs.lens[b] / 2;
      const std::int64_t np = (half + cs.page_size - 1) / cs.page_size;
      for (std::int64_t i = 0; i < np; ++i) short_ids.push_back(pool.indices[static_cast<std::size_t>(pool.indptr[b] + i)]);
      short_indptr.push_back(static_cast<std::int32_t>(short_ids.size()));
      short_last[b] = np == 0 ? 0 : static_cast<std::int32_t>(half - (np - 1) * cs.page_size);
    }
    PagedKVView<const float> first = dview;
    first.table = PageTable{short_indptr.data(), short_ids.data(), short_last.data(), static_cast<std::int32_t>(B)};
    REQUIRE(pol.on_append(dctx, AppendInput<float>{first, nullptr}, db.st).is_ok());
    std::vector<std::int32_t> appended(cs.lens.size());
    for (std::size_t b = 0; b < cs.lens.size(); ++b) appended[b] = static_cast<std::int32_t>(cs.lens[b] - cs.lens[b] / 2);
    REQUIRE(pol.on_append(dctx, AppendInput<float>{dview, appended.data()}, db.st).is_ok());
  }
  same_state(pool, hb, db);

  PrefetchCounters hc, dc;
  std::mt19937 rng(seed * 17 + 3);
  std::uniform_int_distribution<int> qv(-3, 3);
  std::normal_distribution<float> qn(0.0f, 2.0f);
  const std::int64_t E = pool.indptr.back();
  for (int step = 0; step < 6; ++step) {
    INFO("step " << step);
    const int layer = step % 3;
    std::vector<float> q(static_cast<std::size_t>(B * Hq * cs.head_dim));
    for (auto& x : q) x = cs.integer_data ? static_cast<float>(qv(rng)) : qn(rng);
    const DecodeInput<float> hin{TensorView<const float, 3>::contiguous(q.data(), {B, Hq, cs.head_dim}), pool.table(), cs.page_size, layer};
    const DecodeInput<float> din{TensorView<const float, 3>::contiguous(q.data(), {B, Hq, cs.head_dim}, kEmulatedDevice), pool.table(),
                                 cs.page_size, layer};
    if (step != 3) require_same_prediction(pol, hctx, hb.st, dctx, db.st, hin, din, hreq.output.capacity, E, db.hist, pool.num_pages);
    // The step's reads: a few random pages of each non-empty sequence (one row each).
    PageRows rows;
    for (std::size_t b = 0; b < cs.lens.size(); ++b) {
      const std::int32_t np = pool.indptr[b + 1] - pool.indptr[b];
      if (np == 0) continue;
      std::vector<std::int32_t> row;
      for (int i = 0; i < 3; ++i)
        row.push_back(pool.indices[static_cast<std::size_t>(pool.indptr[b]) + static_cast<std::size_t>(rng() % static_cast<unsigned>(np))]);
      rows.push_back(row);
    }
    Selection actual(rows);
    REQUIRE(pol.observe(hctx, hb.st, actual.sel, hc).is_ok());
    REQUIRE(pol.observe(dctx, db.st, actual.sel, dc).is_ok());
    require_same_counters(dc, hc);
    REQUIRE(std::equal(db.hist.begin(), db.hist.begin() + 2 * pool.num_pages, hb.hist.begin()));
    CHECK(db.st.history.serial == hb.st.history.serial);
  }
  CHECK(hc.predicted_steps == 5);
}

/// ShadowKV: every slot of a complete chunk (landmark and outlier score) equal bit for bit.
void run_shadowkv_case(const ShadowKVParams& params, const DeviceRun& cs, unsigned seed) {
  run_device_case<ShadowKV, ShadowKVBuf>(ShadowKV(params), cs, seed, [&](const Pool& pool, const ShadowKVBuf& hb, const ShadowKVBuf& db) {
    const std::int32_t C = params.chunk_size, cpp = cs.page_size / C;
    for (std::size_t b = 0; b < cs.lens.size(); ++b)
      for (std::int64_t ch = 0; ch < cs.lens[b] / C; ++ch)
        for (std::int32_t g = 0; g < cs.kv_heads; ++g) {
          const std::int32_t page = pool.indices[static_cast<std::size_t>(pool.indptr[b] + ch / cpp)];
          const std::int64_t slot = hb.st.slot(page, static_cast<std::int32_t>(ch % cpp), g);
          INFO("sequence " << b << " chunk " << ch << " head " << g);
          REQUIRE(same_bits(db.st.outlier[slot], hb.st.outlier[slot]));
          for (std::int32_t i = 0; i < cs.head_dim; ++i)
            REQUIRE(same_bits(db.st.landmarks[slot * cs.head_dim + i], hb.st.landmarks[slot * cs.head_dim + i]));
        }
  });
}

/// SpeCache: the low-bit key copy equal byte for byte.
void run_specache_case(const SpeCacheParams& params, const DeviceRun& cs, unsigned seed) {
  run_device_case<SpeCache, SpeCacheBuf>(SpeCache(params), cs, seed,
                                         [](const Pool&, const SpeCacheBuf& hb, const SpeCacheBuf& db) { REQUIRE(db.codes == hb.codes); });
}

/// InfiniGen: prepared on the host from the prompt queries (keys with an empty table: nothing folded), the
/// skew and channels copied into the device state, then the partial keys folded on both sides (equal bit for bit).
void run_infinigen_case(const InfiniGenParams& params, const DeviceRun& cs, unsigned seed) {
  const InfiniGen pol(params);
  const std::int32_t Hq = cs.kv_heads * cs.group, W = 5;
  std::vector<float> prompt(static_cast<std::size_t>(Hq * W * cs.head_dim));
  std::mt19937 rng(seed + 7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto& x : prompt) x = cs.integer_data ? std::round(2.0f * nd(rng)) : nd(rng);
  auto prepare = [&](const Pool& pool, InfiniGenBuf& hb, InfiniGenBuf& db) {
    const auto pq = TensorView<const float, 3>::contiguous(prompt.data(), {Hq, W, cs.head_dim});
    std::vector<std::byte> pws(
        pol.requirements(Context<Scalar>{},
                         ProblemShape{.num_q_heads = Hq, .num_kv_heads = cs.kv_heads, .head_dim = cs.head_dim, .max_kv_len = 1, .batch = 1},
                         cs.page_size)
            .workspace_bytes);
    PagedKVView<const float> none = const_cast<Pool&>(pool).cview();
    const std::int32_t zero = 0;
    none.table = PageTable{&zero, nullptr, nullptr, 0};
    REQUIRE(pol.prepare(Context<Scalar>{Workspace{pws.data(), pws.size()}}, pq, none, hb.st).is_ok());
    // The device state: the host's skew and channels copied in, then marked prepared.
    const std::size_t skew_n = static_cast<std::size_t>(cs.kv_heads) * cs.head_dim * cs.head_dim;
    std::copy(hb.floats.begin(), hb.floats.begin() + static_cast<std::ptrdiff_t>(skew_n), db.floats.begin());
    db.ints = hb.ints;
    db.st.prepared = true;
  };
  run_device_case<InfiniGen, InfiniGenBuf>(
      pol, cs, seed, [](const Pool&, const InfiniGenBuf& hb, const InfiniGenBuf& db) { REQUIRE(db.floats == hb.floats); }, prepare);
}

}  // namespace

TEST_CASE("infinigen on a device path: partial keys, requests, priorities, stamps and counters equal the host's", "[prefetch][device]") {
  DeviceRun base;
  base.lens = {37, 5, 64, 0, 21};
  SECTION("integer data (ties), GQA, a dense layer, skewed") {
    run_infinigen_case(InfiniGenParams{.alpha = 3.0f, .partial_ratio = 0.5f, .max_num_kv = 6, .dense_layers = 1}, base, 1);
  }
  SECTION("real-valued data, MHA, r off the 8-lane blocks, no dense layer, k capped by short sequences") {
    DeviceRun c = base;
    c.integer_data = false;
    c.kv_heads = 3;
    c.group = 1;
    c.page_size = 8;
    c.head_dim = 24;
    c.lens = {90, 17, 4, 33};
    run_infinigen_case(InfiniGenParams{.alpha = 8.0f, .partial_ratio = 0.5f, .max_num_kv = 40, .dense_layers = 0}, c, 2);
  }
  SECTION("real-valued data, a wide group, A = I, page size 1") {
    DeviceRun c = base;
    c.integer_data = false;
    c.group = 4;
    c.page_size = 1;
    c.lens = {23, 9, 50};
    run_infinigen_case(InfiniGenParams{.alpha = 1.0f, .partial_ratio = 0.25f, .max_num_kv = 10, .dense_layers = 0, .skew = false}, c, 3);
  }
}

TEST_CASE("shadowkv on a device path: landmarks, requests, priorities, stamps and counters equal the host's", "[prefetch][device]") {
  DeviceRun base;
  base.lens = {37, 5, 64, 0, 21};
  SECTION("integer data (ties), GQA, reuse, a dense layer") {
    run_shadowkv_case(ShadowKVParams{.chunk_size = 2, .chunk_budget = 3, .outlier_chunks = 2, .local_chunks = 1, .dense_layers = 1}, base,
                      1);
  }
  SECTION("real-valued data, MHA, no outliers, no reuse, head_dim off the 8-lane blocks") {
    DeviceRun c = base;
    c.integer_data = false;
    c.kv_heads = 3;
    c.group = 1;
    c.page_size = 8;
    c.head_dim = 12;
    c.lens = {90, 17, 4, 33};
    run_shadowkv_case(ShadowKVParams{.chunk_size = 4, .chunk_budget = 5, .outlier_chunks = 0, .local_chunks = 2, .reuse_previous = false},
                      c, 2);
  }
  SECTION("chunk = page, budgets past the candidates, outliers take every chunk of short sequences") {
    DeviceRun c = base;
    c.integer_data = false;
    c.group = 4;
    c.lens = {23, 9, 50};
    run_shadowkv_case(ShadowKVParams{.chunk_size = 4, .chunk_budget = 40, .outlier_chunks = 3, .local_chunks = 0}, c, 3);
  }
}

TEST_CASE("specache on a device path: key copy, requests, priorities, stamps and counters equal the host's", "[prefetch][device]") {
  DeviceRun base;
  base.head_dim = 32;
  base.lens = {37, 5, 64, 0, 21};
  SECTION("integer data (ties), q4_0, GQA, a dense layer") { run_specache_case(SpeCacheParams{.topk = 6, .dense_layers = 1}, base, 1); }
  SECTION("real-valued data, q8_0, MHA, head_dim 64, top-k past short sequences") {
    DeviceRun c = base;
    c.integer_data = false;
    c.kv_heads = 3;
    c.group = 1;
    c.page_size = 8;
    c.head_dim = 64;
    c.lens = {90, 17, 4, 33};
    run_specache_case(SpeCacheParams{.type = GgmlType::kQ8_0, .topk = 20}, c, 2);
  }
  SECTION("real-valued data, iq4_nl, a wide group, page size 1") {
    DeviceRun c = base;
    c.integer_data = false;
    c.group = 4;
    c.page_size = 1;
    c.lens = {23, 9, 50};
    run_specache_case(SpeCacheParams{.type = GgmlType::kIQ4_NL, .topk = 7}, c, 3);
  }
}

TEST_CASE("prefetch ops: the dense request form and the observe counts on the host reference", "[prefetch][device]") {
  // Entries 0..4 over pages {4, 2, 4, 1, 0}: page 4 twice (its better entry wins), entry 4 not predicted.
  const std::int32_t pages[5] = {4, 2, 4, 1, 0};
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float prio[5] = {0.5f, 0.5f, 1.0f, 0.0f, nan};
  std::vector<std::int64_t> buf(static_cast<std::size_t>(PrefetchHistory::buffer_size(5)));
  ops::prefetch_history_reset<EmulatedDevice>(buf.data(), 5);
  std::int64_t* predicted_at = buf.data();
  std::int64_t* used_at = buf.data() + 5;
  std::int64_t* pending = buf.data() + 10;
  used_at[1] = 0;  // page 1 was read by observation 0
  std::int32_t out[5];
  float out_prio[5];
  std::int64_t size = -3;
  std::vector<std::byte> ws(ops::prefetch_request_workspace<EmulatedDevice>(5));
  ops::prefetch_write_request<EmulatedDevice>(prio, pages, 5, predicted_at, used_at, pending, /*target=*/1, /*serial=*/1, out, out_prio,
                                              &size, Workspace{ws.data(), ws.size()});
  // 1.0 (entry 2, page 4), 0.5 ties -> later entry first: entry 1 (page 2), entry 0 (page 4: listed), 0.0 (page 1).
  CHECK(size == 3);
  CHECK(std::vector<std::int32_t>(out, out + 5) == std::vector<std::int32_t>{4, 2, 1, -1, -1});
  CHECK(out_prio[0] == 1.0f);
  CHECK(out_prio[1] == 0.5f);
  CHECK(out_prio[2] == 0.0f);
  CHECK(std::isnan(out_prio[3]));
  CHECK(pending[0] == 3);
  CHECK(pending[1] == 2);  // page 1 was read by observation 0 = target - 1
  CHECK(predicted_at[4] == 1);
  CHECK(predicted_at[0] == -1);

  // Observation 1 reads pages 4, 0, 4 (two rows share page 4).
  const std::int32_t read[3] = {4, 0, 4};
  PrefetchCounters c;
  ops::prefetch_observe<EmulatedDevice>(read, 3, used_at, predicted_at, pending, /*step=*/1, /*has_prediction=*/true, /*serial=*/1, &c);
  CHECK(c.needed == 2);
  CHECK(c.hits == 1);
  CHECK(c.misses == 1);
  CHECK(c.wasted == 2);
  CHECK(c.predicted == 3);
  CHECK(c.late == 1);
  CHECK(c.reuse_total == 2);
  CHECK(c.reused == 0);
  CHECK(c.transferred == 2 + 1);
  CHECK(used_at[4] == 1);
  CHECK(used_at[0] == 1);
  CHECK(used_at[1] == 0);

  // Votes and priorities: three rows of two logical pages over 4 entries, unit 1/3.
  const std::int32_t logical[6] = {0, 3, 3, 1, 3, 0};
  std::int32_t counts[4] = {9, 9, 9, 9};
  ops::prefetch_votes<EmulatedDevice>(logical, 3, 2, 2, 4, counts);
  CHECK(std::vector<std::int32_t>(counts, counts + 4) == std::vector<std::int32_t>{2, 1, 0, 3});
  const std::int32_t epages[4] = {0, 1, 2, 3};
  float p4[4];
  used_at[2] = 0;
  ops::prefetch_vote_priorities<EmulatedDevice>(counts, epages, 4, 1.0f / 3.0f, used_at, /*reuse_step=*/0, -1.0f, p4);
  CHECK(p4[0] == (1.0f / 3.0f) + (1.0f / 3.0f));
  CHECK(p4[2] == -1.0f);  // reused page 2
  CHECK(p4[3] == ((1.0f / 3.0f) + (1.0f / 3.0f)) + (1.0f / 3.0f));
  ops::prefetch_vote_priorities<EmulatedDevice>(counts, epages, 4, 1.0f / 3.0f, used_at, /*reuse_step=*/-1, -1.0f, p4);
  CHECK(std::isnan(p4[2]));
}

TEST_CASE("quest_lookahead on a device path: bad input is refused and nothing is written", "[prefetch][device]") {
  Pool pool = make_pool({12, 7}, 1, 4, 4, 9);
  QuestMeta qm(pool);
  const PageMetaView<const float> dev_meta =
      PageMetaView<const float>::contiguous(qm.buf.data(), pool.num_pages, pool.kv_heads, pool.head_dim, kEmulatedDevice);
  const QuestLookahead<float> pol(QuestLookaheadParams{.page_budget = 2, .dense_layers = 0});
  const ProblemShape shape{.num_q_heads = 1, .num_kv_heads = 1, .head_dim = 4, .max_kv_len = 12, .batch = 2};
  const Requirements req = pol.requirements(Context<EmulatedDevice>{}, shape, 4);
  REQUIRE(req.status.is_ok());
  std::vector<std::byte> ws(req.workspace_bytes);
  const Context<EmulatedDevice> ctx{Workspace{ws.data(), ws.size()}};
  std::vector<std::int64_t> buf(static_cast<std::size_t>(PrefetchHistory::buffer_size(pool.num_pages)));
  QuestLookaheadState<float> st{dev_meta, PrefetchHistory::wrap(buf.data(), pool.num_pages)};
  REQUIRE(st.history.reset(ctx).is_ok());
  const std::vector<std::int64_t> before = buf;
  std::vector<float> q(8, 1.0f);
  const DecodeInput<float> host_q{TensorView<const float, 3>::contiguous(q.data(), {2, 1, 4}), pool.table(), 4, 3};
  const DecodeInput<float> dev_q{TensorView<const float, 3>::contiguous(q.data(), {2, 1, 4}, kEmulatedDevice), pool.table(), 4, 3};
  Request r(req.output.capacity);

  Status s = pol.predict(ctx, st, host_q, r.req);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(std::string(s.message()).find("queries is host memory") != std::string::npos);

  QuestLookaheadState<float> host_meta_st{qm.meta, st.history};
  s = pol.predict(ctx, host_meta_st, dev_q, r.req);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(std::string(s.message()).find("metadata is host memory") != std::string::npos);

  QuestLookaheadState<float> no_pending{dev_meta, st.history};
  no_pending.history.pending = nullptr;
  s = pol.predict(ctx, no_pending, dev_q, r.req);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(std::string(s.message()).find("pending") != std::string::npos);

  Request small(pool.indptr.back() - 1);  // one entry short of the table
  CHECK(pol.predict(ctx, st, dev_q, small.req).code() == StatusCode::kOutputTooSmall);

  const Context<EmulatedDevice> tight{Workspace{ws.data(), ws.size() - 8}};
  CHECK(pol.predict(tight, st, dev_q, r.req).code() == StatusCode::kWorkspaceTooSmall);

  CHECK(buf == before);
  CHECK(r.pages[0] == -7);
  CHECK(st.history.serial == 0);

  // Observe: a malformed CSR is refused before the device is touched.
  std::vector<std::int32_t> bad_indptr{0, 3, 2}, ids{0, 1, 2}, last{1, 1};
  const PageSelection bad{bad_indptr.data(), ids.data(), last.data(), nullptr, 2, 3};
  PrefetchCounters c;
  CHECK(pol.observe(ctx, st, bad, c).code() == StatusCode::kInvalidArgument);
  CHECK(buf == before);
  CHECK(st.history.step == 0);
  CHECK(c.steps == 0);
}

TEST_CASE("shadowkv on a device path: host memory and bad input are refused, nothing is written", "[prefetch][device]") {
  Pool pool = make_pool({12, 7}, 1, 4, 4, 9);
  const ShadowKV pol(ShadowKVParams{.chunk_size = 2, .chunk_budget = 2, .outlier_chunks = 1, .local_chunks = 1});
  const ProblemShape shape{.num_q_heads = 1, .num_kv_heads = 1, .head_dim = 4, .max_kv_len = 12, .batch = 2};
  const Requirements req = pol.requirements(Context<EmulatedDevice>{}, shape, 4);
  REQUIRE(req.status.is_ok());
  std::vector<std::byte> ws(req.workspace_bytes);
  const Context<EmulatedDevice> ctx{Workspace{ws.data(), ws.size()}};
  ShadowKVBuf dev(pol, pool, kEmulatedDevice), host(pol, pool);
  REQUIRE(dev.st.history.reset(ctx).is_ok());
  PagedKVView<const float> dview = pool.cview();
  dview.device = kEmulatedDevice;
  REQUIRE(pol.on_append(ctx, AppendInput<float>{dview, nullptr}, dev.st).is_ok());
  const std::vector<float> floats_before = dev.floats;
  const std::vector<std::int64_t> hist_before = dev.hist;
  std::vector<float> q(8, 1.0f);
  const DecodeInput<float> host_q{TensorView<const float, 3>::contiguous(q.data(), {2, 1, 4}), pool.table(), 4, 3};
  const DecodeInput<float> dev_q{TensorView<const float, 3>::contiguous(q.data(), {2, 1, 4}, kEmulatedDevice), pool.table(), 4, 3};
  Request r(req.output.capacity);

  Status s = pol.predict(ctx, dev.st, host_q, r.req);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(std::string(s.message()).find("queries is host memory") != std::string::npos);
  s = pol.predict(ctx, host.st, dev_q, r.req);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(std::string(s.message()).find("state is host memory") != std::string::npos);
  s = pol.on_append(ctx, AppendInput<float>{pool.cview(), nullptr}, dev.st);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(std::string(s.message()).find("keys are host memory") != std::string::npos);
  s = pol.predict(Context<Scalar>{Workspace{ws.data(), ws.size()}}, dev.st, host_q, r.req);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(std::string(s.message()).find("state is device memory") != std::string::npos);
  ShadowKVState no_pending = dev.st;
  no_pending.history.pending = nullptr;
  s = pol.predict(ctx, no_pending, dev_q, r.req);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(std::string(s.message()).find("pending") != std::string::npos);
  Request small(pool.indptr.back() - 1);
  CHECK(pol.predict(ctx, dev.st, dev_q, small.req).code() == StatusCode::kOutputTooSmall);
  const Context<EmulatedDevice> tight{Workspace{ws.data(), ws.size() - 8}};
  CHECK(pol.predict(tight, dev.st, dev_q, r.req).code() == StatusCode::kWorkspaceTooSmall);
  CHECK(dev.floats == floats_before);
  CHECK(dev.hist == hist_before);
  CHECK(r.pages[0] == -7);
  CHECK(dev.st.history.serial == 0);
  REQUIRE(pol.predict(ctx, dev.st, dev_q, r.req).is_ok());  // and the good call goes through
  CHECK(dev.st.history.serial == 1);
}

TEST_CASE("specache on a device path: host memory and bad input are refused, nothing is written", "[prefetch][device]") {
  Pool pool = make_pool({12, 7}, 1, 4, 32, 9);
  const SpeCache pol(SpeCacheParams{.topk = 3});
  const ProblemShape shape{.num_q_heads = 1, .num_kv_heads = 1, .head_dim = 32, .max_kv_len = 12, .batch = 2};
  const Requirements req = pol.requirements(Context<EmulatedDevice>{}, shape, 4);
  REQUIRE(req.status.is_ok());
  std::vector<std::byte> ws(req.workspace_bytes);
  const Context<EmulatedDevice> ctx{Workspace{ws.data(), ws.size()}};
  SpeCacheBuf dev(pol, pool, kEmulatedDevice), host(pol, pool);
  REQUIRE(dev.st.history.reset(ctx).is_ok());
  PagedKVView<const float> dview = pool.cview();
  dview.device = kEmulatedDevice;
  REQUIRE(pol.on_append(ctx, AppendInput<float>{dview, nullptr}, dev.st).is_ok());
  const auto codes_before = dev.codes;
  const auto hist_before = dev.hist;
  std::vector<float> q(64, 1.0f);
  const DecodeInput<float> host_q{TensorView<const float, 3>::contiguous(q.data(), {2, 1, 32}), pool.table(), 4, 3};
  const DecodeInput<float> dev_q{TensorView<const float, 3>::contiguous(q.data(), {2, 1, 32}, kEmulatedDevice), pool.table(), 4, 3};
  Request r(req.output.capacity);
  auto refused = [](const Status& s, StatusCode code, const char* what) {
    CHECK(s.code() == code);
    CHECK(std::string(s.message()).find(what) != std::string::npos);
  };
  refused(pol.predict(ctx, dev.st, host_q, r.req), StatusCode::kInvalidArgument, "queries is host memory");
  refused(pol.predict(ctx, host.st, dev_q, r.req), StatusCode::kInvalidArgument, "state is host memory");
  refused(pol.on_append(ctx, AppendInput<float>{pool.cview(), nullptr}, dev.st), StatusCode::kInvalidArgument, "keys are host memory");
  refused(pol.predict(Context<Scalar>{Workspace{ws.data(), ws.size()}}, dev.st, host_q, r.req), StatusCode::kInvalidArgument,
          "state is device memory");
  std::vector<std::int32_t> too_long{13, 0};
  refused(pol.on_append(ctx, AppendInput<float>{dview, too_long.data()}, dev.st), StatusCode::kInvalidArgument, "append_len[0] is 13");
  Request small(pool.indptr.back() - 1);
  CHECK(pol.predict(ctx, dev.st, dev_q, small.req).code() == StatusCode::kOutputTooSmall);
  const Context<EmulatedDevice> tight{Workspace{ws.data(), ws.size() - 8}};
  CHECK(pol.predict(tight, dev.st, dev_q, r.req).code() == StatusCode::kWorkspaceTooSmall);
  CHECK(dev.codes == codes_before);
  CHECK(dev.hist == hist_before);
  CHECK(r.pages[0] == -7);
  REQUIRE(pol.predict(ctx, dev.st, dev_q, r.req).is_ok());
  CHECK(dev.st.history.serial == 1);
}

TEST_CASE("infinigen on a device path: prepare stays on the host, host memory is refused", "[prefetch][device]") {
  Pool pool = make_pool({12}, 1, 4, 8, 5);
  const InfiniGen p(InfiniGenParams{.partial_ratio = 0.5f, .dense_layers = 0});
  const ProblemShape shape{.num_q_heads = 1, .num_kv_heads = 1, .head_dim = 8, .max_kv_len = 12, .batch = 1};
  const Requirements req = p.requirements(Context<EmulatedDevice>{}, shape, 4);
  REQUIRE(req.status.is_ok());
  std::vector<std::byte> ws(req.workspace_bytes);
  const Context<EmulatedDevice> ctx{Workspace{ws.data(), ws.size()}};
  InfiniGenBuf dev(p, pool, kEmulatedDevice), host(p, pool);
  REQUIRE(dev.st.history.reset(ctx).is_ok());
  std::vector<float> prompt(8, 1.0f);
  PagedKVView<const float> dview = pool.cview();
  dview.device = kEmulatedDevice;
  const Status s = p.prepare(ctx, TensorView<const float, 3>::contiguous(prompt.data(), {1, 1, 8}, kEmulatedDevice), dview, dev.st);
  CHECK(s.code() == StatusCode::kUnsupported);
  CHECK(std::string(s.message()).find("prepare runs on the host") != std::string::npos);
  Status a = p.on_append(ctx, AppendInput<float>{dview, nullptr}, dev.st);
  CHECK(a.code() == StatusCode::kInvalidArgument);
  CHECK(std::string(a.message()).find("before prepare") != std::string::npos);
  dev.st.prepared = true;
  a = p.on_append(ctx, AppendInput<float>{pool.cview(), nullptr}, dev.st);
  CHECK(std::string(a.message()).find("keys are host memory") != std::string::npos);
  std::vector<float> q(8, 1.0f);
  Request r(3);
  const DecodeInput<float> dev_q{TensorView<const float, 3>::contiguous(q.data(), {1, 1, 8}, kEmulatedDevice), pool.table(), 4, 3};
  const DecodeInput<float> host_q{TensorView<const float, 3>::contiguous(q.data(), {1, 1, 8}), pool.table(), 4, 3};
  a = p.predict(ctx, host.st, dev_q, r.req);
  CHECK(std::string(a.message()).find("state is host memory") != std::string::npos);
  a = p.predict(ctx, dev.st, host_q, r.req);
  CHECK(std::string(a.message()).find("queries is host memory") != std::string::npos);
  a = p.predict(Context<Scalar>{Workspace{ws.data(), ws.size()}}, dev.st, host_q, r.req);
  CHECK(std::string(a.message()).find("state is device memory") != std::string::npos);
  CHECK(r.pages[0] == -7);
  CHECK(dev.st.history.serial == 0);
  // Every prefetcher's size query accepts a device backend.
  const ProblemShape s32{.num_q_heads = 1, .num_kv_heads = 1, .head_dim = 32, .max_kv_len = 12, .batch = 1};
  CHECK(InfiniGen{}.requirements(ctx, s32, 4).status.is_ok());
  CHECK(SpeCache{}.requirements(ctx, s32, 4).status.is_ok());
  CHECK(ShadowKV{}.requirements(ctx, s32, 4).status.is_ok());
}
