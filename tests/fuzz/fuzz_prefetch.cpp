// Fuzz target: the prefetch family's entry points from fuzzer-chosen pools,
// page tables (sometimes repeated, out-of-range or short), queries (NaN / Inf
// now and then), budgets, layers, request capacities and workspaces:
// QuestLookahead (predict, then observe an actual selection) and SpeCache
// (on_append of a ggml key copy, then predict), on Scalar and Cpu; and
// the device paths of QuestLookahead, ShadowKV, SpeCache and InfiniGen on the
// emulated device against the host path (equal requests, stamps and counters
// whenever the host accepts the input; ShadowKV's landmarks, SpeCache's key
// copy and InfiniGen's partial keys byte-identical).
// Contract: no crash or sanitizer report; a failed call leaves the request
// (pages, priorities, size), the history and the copied codes byte-identical;
// an accepted request holds at most `capacity` distinct pages of the
// sequence's table, its priorities finite and >= 0.
#include <cmath>

#include "fuzz_util.hpp"
#include "kvpolicy/backends/cpu.hpp"
#include "policy/emulated_device_ops.hpp"
#include "policy/prefetch/prefetch_fixture.hpp"

using namespace kvpolicy;
using namespace kvp_fuzz;
using namespace prefetch_test;

namespace {

/// A pool and one or two sequences whose page lists the fuzzer picks (usually valid).
struct Setup {
  Pool pool;
  std::int32_t Hq = 1;
  Setup(FuzzedDataProvider& fdp, std::int32_t d)
      : pool(fdp.ConsumeIntegralInRange<std::int32_t>(1, 10), fdp.ConsumeIntegralInRange<std::int32_t>(1, 2),
             fdp.ConsumeIntegralInRange<std::int32_t>(1, 4), d) {
    Hq = pool.kv_heads * fdp.ConsumeIntegralInRange<std::int32_t>(1, 2);
    for (auto& x : pool.k) x = fuzz_float(fdp) * (fdp.ConsumeBool() ? 1.0f : 0.0f);
    std::vector<std::int32_t> free_ids;
    for (std::int32_t i = pool.num_pages - 1; i >= 0; --i) free_ids.push_back(i);
    const int batch = fdp.ConsumeIntegralInRange<int>(1, 2);
    for (int b = 0; b < batch; ++b) {
      std::vector<std::int32_t> pages;
      const int n = fdp.ConsumeIntegralInRange<int>(1, 4);
      for (int i = 0; i < n; ++i) {
        if (fdp.ConsumeIntegralInRange<int>(0, 15) == 0)
          pages.push_back(fdp.ConsumeIntegralInRange<std::int32_t>(-1, pool.num_pages));  // bad or repeated ids
        else if (!free_ids.empty()) {
          pages.push_back(free_ids.back());
          free_ids.pop_back();
        }
      }
      if (pages.empty()) pages.push_back(0);
      const std::int64_t len = (static_cast<std::int64_t>(pages.size()) - 1) * pool.page_size +
                               (fdp.ConsumeIntegralInRange<int>(0, 15) == 0 ? fdp.ConsumeIntegralInRange<int>(-1, pool.page_size + 1)
                                                                            : fdp.ConsumeIntegralInRange<int>(1, pool.page_size));
      pool.add_sequence(pages, len);
    }
    // A broken indptr now and then; never past the indices buffer (a CSR table's indices hold indptr[batch]
    // entries by contract, and no reader can check a length it is not given).
    if (fdp.ConsumeIntegralInRange<int>(0, 31) == 0)
      pool.indptr[1] = fdp.ConsumeIntegralInRange<std::int32_t>(-2, static_cast<std::int32_t>(pool.indices.size()));
  }
  std::int32_t batch() const { return static_cast<std::int32_t>(pool.last.size()); }
};

std::vector<float> fuzz_queries(FuzzedDataProvider& fdp, std::size_t n) {
  std::vector<float> q(n);
  for (auto& x : q) x = fdp.ConsumeIntegralInRange<int>(0, 63) == 0 ? fuzz_float(fdp) : fdp.ConsumeFloatingPointInRange<float>(-2, 2);
  return q;
}

void check_request(const Request& r, const Request& before, const Status& s, const Setup& su, const char* who) {
  if (!s.is_ok()) {
    KVP_FUZZ_CHECK(r.pages == before.pages && same_bytes(r.priority, before.priority) && r.req.size == before.req.size,
                   "%s failed (%s) but wrote the request", who, s.message());
    KVP_FUZZ_CHECK(s.message()[0] != '\0', "error without a message");
    return;
  }
  KVP_FUZZ_CHECK(r.req.size >= 0 && r.req.size <= r.req.capacity, "%s: size %lld of capacity %lld", who, static_cast<long long>(r.req.size),
                 static_cast<long long>(r.req.capacity));
  std::vector<int> seen(static_cast<std::size_t>(su.pool.num_pages), 0);
  for (std::int64_t i = 0; i < r.req.size; ++i) {
    const std::int32_t p = r.pages[static_cast<std::size_t>(i)];
    KVP_FUZZ_CHECK(p >= 0 && p < su.pool.num_pages, "%s: page %d outside the pool of %d", who, p, su.pool.num_pages);
    KVP_FUZZ_CHECK(std::find(su.pool.indices.begin(), su.pool.indices.end(), p) != su.pool.indices.end(), "%s: page %d not in the table",
                   who, p);
    KVP_FUZZ_CHECK(seen[static_cast<std::size_t>(p)]++ == 0, "%s: page %d requested twice", who, p);
    const float pr = r.priority[static_cast<std::size_t>(i)];
    KVP_FUZZ_CHECK(std::isfinite(pr) && pr >= 0.0f, "%s: priority %g", who, static_cast<double>(pr));
  }
}

template <class B>
void quest_lookahead(FuzzedDataProvider& fdp) {
  Setup su(fdp, fdp.ConsumeIntegralInRange<std::int32_t>(1, 8));
  QuestLookaheadParams p;
  p.page_budget = mostly_in(fdp, 1, 5);
  p.dense_layers = fdp.ConsumeIntegralInRange<std::int32_t>(0, 2);
  p.reuse_previous = fdp.ConsumeBool();
  const QuestLookahead<float> pol(p);
  if (!su.pool.table().validate("fuzz", su.pool.num_pages, su.pool.page_size).is_ok() && fdp.ConsumeBool()) return;
  QuestMeta qm(su.pool);
  HistoryBuf hb;
  QuestLookaheadState<float> st{qm.meta, hb.make(su.pool.num_pages)};
  const ProblemShape shape{.num_q_heads = su.Hq,
                           .num_kv_heads = su.pool.kv_heads,
                           .head_dim = su.pool.head_dim,
                           .max_kv_len = static_cast<std::int64_t>(su.pool.num_pages) * su.pool.page_size};
  const Requirements req = pol.requirements(Context<B>{}, shape, su.pool.page_size);
  if (!req.status.is_ok()) return;
  std::vector<std::byte> ws(req.workspace_bytes - (req.workspace_bytes > 0 && fdp.ConsumeIntegralInRange<int>(0, 15) == 0 ? 1 : 0));
  const Context<B> ctx{Workspace{ws.empty() ? nullptr : ws.data(), ws.size()}};
  const auto q = fuzz_queries(fdp, static_cast<std::size_t>(su.batch() * su.Hq * su.pool.head_dim));
  const auto qv = TensorView<const float, 3>::contiguous(q.data(), {su.batch(), su.Hq, su.pool.head_dim});
  const std::int32_t layer = fdp.ConsumeIntegralInRange<std::int32_t>(-1, 3);
  for (int step = 0; step < 2; ++step) {
    Request r(std::max<std::int64_t>(0, static_cast<std::int64_t>(su.pool.indices.size()) - fdp.ConsumeIntegralInRange<int>(0, 1)));
    const Request before = r;
    const auto hist0 = hb.buf;
    const Status s = pol.predict(ctx, st, DecodeInput<float>{qv, su.pool.table(), su.pool.page_size, layer}, r.req);
    check_request(r, before, s, su, "quest_lookahead predict");
    if (!s.is_ok()) {
      KVP_FUZZ_CHECK(hb.buf == hist0, "quest_lookahead predict failed but changed the history");
      return;
    }
    // The engine's actual selection: a few of the table's pages per row (sometimes an id outside the pool).
    PageRows rows(static_cast<std::size_t>(su.batch() * su.pool.kv_heads));
    for (auto& row : rows)
      for (std::int32_t id : su.pool.indices)
        if (fdp.ConsumeBool()) row.push_back(fdp.ConsumeIntegralInRange<int>(0, 31) == 0 ? su.pool.num_pages + 1 : id);
    Selection actual(rows);
    PrefetchCounters c;
    const auto hist1 = hb.buf;
    const Status o = pol.observe(ctx, st, actual.sel, c);
    if (!o.is_ok()) KVP_FUZZ_CHECK(hb.buf == hist1, "quest_lookahead observe failed (%s) but changed the history", o.message());
  }
}

template <class B>
void specache(FuzzedDataProvider& fdp) {
  Setup su(fdp, 32 * fdp.ConsumeIntegralInRange<std::int32_t>(1, 2) + (fdp.ConsumeIntegralInRange<int>(0, 31) == 0 ? 1 : 0));
  SpeCacheParams p;
  p.type = fdp.ConsumeBool() ? GgmlType::kQ8_0 : GgmlType::kQ4_0;
  p.topk = mostly_in(fdp, 1, 8);
  const SpeCache pol(p);
  SpeCacheBuf buf(pol, su.pool);
  const ProblemShape shape{.num_q_heads = su.Hq,
                           .num_kv_heads = su.pool.kv_heads,
                           .head_dim = su.pool.head_dim,
                           .max_kv_len = static_cast<std::int64_t>(su.pool.num_pages) * su.pool.page_size};
  const Requirements req = pol.requirements(Context<B>{}, shape, su.pool.page_size);
  if (!req.status.is_ok()) return;
  std::vector<std::byte> ws(req.workspace_bytes - (req.workspace_bytes > 0 && fdp.ConsumeIntegralInRange<int>(0, 15) == 0 ? 1 : 0));
  const Context<B> ctx{Workspace{ws.empty() ? nullptr : ws.data(), ws.size()}};
  const auto codes0 = buf.codes;
  const Status a = pol.on_append(ctx, AppendInput<float>{su.pool.cview(), nullptr}, buf.st);
  if (!a.is_ok()) {
    KVP_FUZZ_CHECK(buf.codes == codes0, "specache on_append failed (%s) but wrote codes", a.message());
    return;
  }
  const auto q = fuzz_queries(fdp, static_cast<std::size_t>(su.batch() * su.Hq * su.pool.head_dim));
  const auto qv = TensorView<const float, 3>::contiguous(q.data(), {su.batch(), su.Hq, su.pool.head_dim});
  Request r(std::max<std::int64_t>(0, static_cast<std::int64_t>(su.pool.indices.size()) - fdp.ConsumeIntegralInRange<int>(0, 1)));
  const Request before = r;
  const auto hist0 = buf.hist;
  const Status s = pol.predict(ctx, buf.st, DecodeInput<float>{qv, su.pool.table(), su.pool.page_size, 2}, r.req);
  check_request(r, before, s, su, "specache predict");
  if (!s.is_ok()) KVP_FUZZ_CHECK(buf.hist == hist0, "specache predict failed but changed the history");
}

/// The device's request (its size in `dsize`, `size` -1) equals the host's entry for entry (pages, priority
/// bytes), both padded with -1 past the size up to the table's `E` entries.
void check_same_request(const Request& hr, const Request& dr, std::int64_t dsize, std::int64_t E) {
  KVP_FUZZ_CHECK(dr.req.size == -1 && dsize == hr.req.size, "device size %lld, host %lld", static_cast<long long>(dsize),
                 static_cast<long long>(hr.req.size));
  for (std::int64_t j = 0; j < E; ++j) {
    const auto u = static_cast<std::size_t>(j);
    if (j < hr.req.size)
      KVP_FUZZ_CHECK(dr.pages[u] == hr.pages[u] && same_bytes(std::vector<float>{dr.priority[u]}, std::vector<float>{hr.priority[u]}),
                     "request entry %lld differs", static_cast<long long>(j));
    else
      KVP_FUZZ_CHECK(dr.pages[u] == -1 && hr.pages[u] == -1, "entry %lld past the size %lld is not -1 (device %d, host %d)",
                     static_cast<long long>(j), static_cast<long long>(hr.req.size), dr.pages[u], hr.pages[u]);
  }
}

/// Quest lookahead's device path (the emulated device: the scalar ops behind a CallScope) against the host
/// path on the same valid pool, table, finite queries and actual selections, over three steps: whenever the
/// host accepts a call the device accepts it too, with the same request (pages, priorities, size; -1 past
/// the size), the same history stamps and the same counters. (A device path does not read page ids or
/// values on the host, so only inputs the host accepts are compared.)
void quest_lookahead_device(FuzzedDataProvider& fdp) {
  Setup su(fdp, fdp.ConsumeIntegralInRange<std::int32_t>(1, 8));
  if (!su.pool.table().validate("fuzz", su.pool.num_pages, su.pool.page_size).is_ok()) return;
  const std::int64_t E = su.pool.indptr[static_cast<std::size_t>(su.batch())];  // the table's entries (a short indptr uses fewer ids)
  std::vector<int> uses(static_cast<std::size_t>(su.pool.num_pages), 0);
  for (std::int64_t e = 0; e < E; ++e)  // ids past indptr[batch] are not the table's (and may be out of range)
    if (uses[static_cast<std::size_t>(su.pool.indices[static_cast<std::size_t>(e)])]++ > 0)
      return;  // repeated: host refuses, device does not check
  QuestLookaheadParams p;
  p.page_budget = mostly_in(fdp, 1, 5);
  p.dense_layers = fdp.ConsumeIntegralInRange<std::int32_t>(0, 2);
  p.reuse_previous = fdp.ConsumeBool();
  constexpr QuestGqa kModes[3] = {QuestGqa::kPerQueryHead, QuestGqa::kGroupMax, QuestGqa::kGroupSum};  // kUnion: host only
  p.gqa = kModes[fdp.ConsumeIntegralInRange<int>(0, 2)];
  const QuestLookahead<float> pol(p);
  QuestMeta qm(su.pool);
  const PageMetaView<const float> dmeta = PageMetaView<const float>::contiguous(qm.buf.data(), su.pool.num_pages, su.pool.kv_heads,
                                                                                su.pool.head_dim, kvp_test::kEmulatedDevice);
  HistoryBuf hb;
  QuestLookaheadState<float> hst{qm.meta, hb.make(su.pool.num_pages)};
  std::vector<std::int64_t> dbuf(hb.buf.size(), 5);
  QuestLookaheadState<float> dst{dmeta, PrefetchHistory::wrap(dbuf.data(), su.pool.num_pages)};
  const ProblemShape shape{.num_q_heads = su.Hq,
                           .num_kv_heads = su.pool.kv_heads,
                           .head_dim = su.pool.head_dim,
                           .max_kv_len = static_cast<std::int64_t>(su.pool.num_pages) * su.pool.page_size,
                           .batch = su.batch()};
  const Requirements hreq = pol.requirements(Context<backend::Scalar>{}, shape, su.pool.page_size);
  const Requirements dreq = pol.requirements(Context<kvp_test::EmulatedDevice>{}, shape, su.pool.page_size);
  KVP_FUZZ_CHECK(hreq.status.is_ok() == dreq.status.is_ok(), "requirements disagree: %s / %s", hreq.status.message(),
                 dreq.status.message());
  if (!hreq.status.is_ok()) return;
  std::vector<std::byte> hws(hreq.workspace_bytes), dws(dreq.workspace_bytes, std::byte{0xFF});
  const Context<backend::Scalar> hctx{Workspace{hws.data(), hws.size()}};
  const Context<kvp_test::EmulatedDevice> dctx{Workspace{dws.data(), dws.size()}};
  KVP_FUZZ_CHECK(dst.history.reset(dctx).is_ok() && dbuf == hb.buf, "device history reset differs from the host's");
  PrefetchCounters hc, dc;
  for (int step = 0; step < 3; ++step) {
    std::vector<float> q(static_cast<std::size_t>(su.batch() * su.Hq * su.pool.head_dim));
    for (auto& x : q) x = fdp.ConsumeFloatingPointInRange<float>(-2, 2);
    const std::int32_t layer = fdp.ConsumeIntegralInRange<std::int32_t>(0, 3);
    const DecodeInput<float> hin{TensorView<const float, 3>::contiguous(q.data(), {su.batch(), su.Hq, su.pool.head_dim}), su.pool.table(),
                                 su.pool.page_size, layer};
    const DecodeInput<float> din{
        TensorView<const float, 3>::contiguous(q.data(), {su.batch(), su.Hq, su.pool.head_dim}, kvp_test::kEmulatedDevice), su.pool.table(),
        su.pool.page_size, layer};
    if (fdp.ConsumeBool()) {
      Request hr(E), dr(E);
      std::int64_t dsize = -9;
      dr.req.device_size = &dsize;
      const Status hs = pol.predict(hctx, hst, hin, hr.req);
      if (!hs.is_ok()) return;
      const Status ds = pol.predict(dctx, dst, din, dr.req);
      KVP_FUZZ_CHECK(ds.is_ok(), "the host accepted a prediction the device refused: %s", ds.message());
      check_same_request(hr, dr, dsize, E);
    }
    PageRows rows(static_cast<std::size_t>(su.batch() * su.pool.kv_heads));
    for (auto& row : rows)
      for (std::int64_t e = 0; e < E; ++e)
        if (fdp.ConsumeBool()) row.push_back(su.pool.indices[static_cast<std::size_t>(e)]);
    Selection actual(rows);
    const Status ho = pol.observe(hctx, hst, actual.sel, hc);
    const Status dob = pol.observe(dctx, dst, actual.sel, dc);
    KVP_FUZZ_CHECK(ho.is_ok() && dob.is_ok(), "observe refused a valid selection: %s / %s", ho.message(), dob.message());
    KVP_FUZZ_CHECK(std::equal(dbuf.begin(), dbuf.end() - 2, hb.buf.begin()), "history stamps differ after step %d", step);
    KVP_FUZZ_CHECK(dc.hits == hc.hits && dc.misses == hc.misses && dc.wasted == hc.wasted && dc.predicted == hc.predicted &&
                       dc.needed == hc.needed && dc.reused == hc.reused && dc.reuse_total == hc.reuse_total && dc.late == hc.late &&
                       dc.transferred == hc.transferred && dc.steps == hc.steps && dc.predicted_steps == hc.predicted_steps,
                   "counters differ after step %d", step);
  }
}

/// The steps shared by the device-path cases: three predictions (each skipped now and then) and observations on
/// the host and on the emulated device; whenever the host accepts a prediction the device accepts it too, with
/// the same request (pages, priorities, size; -1 past the size), and the stamps and counters stay equal.
template <class Pol, class Buf>
void compare_device_steps(FuzzedDataProvider& fdp, const Pol& pol, Setup& su, Buf& hb, Buf& db, const Context<backend::Scalar>& hctx,
                          const Context<kvp_test::EmulatedDevice>& dctx) {
  const std::int64_t E = su.pool.indptr[static_cast<std::size_t>(su.batch())];
  PrefetchCounters hc, dc;
  for (int step = 0; step < 3; ++step) {
    const auto q = fuzz_queries(fdp, static_cast<std::size_t>(su.batch() * su.Hq * su.pool.head_dim));
    const std::int32_t layer = fdp.ConsumeIntegralInRange<std::int32_t>(0, 3);
    const DecodeInput<float> hin{TensorView<const float, 3>::contiguous(q.data(), {su.batch(), su.Hq, su.pool.head_dim}), su.pool.table(),
                                 su.pool.page_size, layer};
    const DecodeInput<float> din{
        TensorView<const float, 3>::contiguous(q.data(), {su.batch(), su.Hq, su.pool.head_dim}, kvp_test::kEmulatedDevice), su.pool.table(),
        su.pool.page_size, layer};
    if (fdp.ConsumeBool()) {
      Request hr(E), dr(E);
      std::int64_t dsize = -9;
      dr.req.device_size = &dsize;
      const Status hs = pol.predict(hctx, hb.st, hin, hr.req);
      if (!hs.is_ok()) return;
      const Status ds = pol.predict(dctx, db.st, din, dr.req);
      KVP_FUZZ_CHECK(ds.is_ok(), "the host accepted a prediction the device refused: %s", ds.message());
      check_same_request(hr, dr, dsize, E);
    }
    PageRows rows(static_cast<std::size_t>(su.batch()));
    for (auto& row : rows)
      for (std::int64_t e = 0; e < E; ++e)
        if (fdp.ConsumeBool()) row.push_back(su.pool.indices[static_cast<std::size_t>(e)]);
    Selection actual(rows);
    const Status ho = pol.observe(hctx, hb.st, actual.sel, hc);
    const Status dob = pol.observe(dctx, db.st, actual.sel, dc);
    KVP_FUZZ_CHECK(ho.is_ok() && dob.is_ok(), "observe refused a valid selection: %s / %s", ho.message(), dob.message());
    KVP_FUZZ_CHECK(std::equal(db.hist.begin(), db.hist.end() - 2, hb.hist.begin()), "history stamps differ after step %d", step);
    KVP_FUZZ_CHECK(dc.hits == hc.hits && dc.misses == hc.misses && dc.wasted == hc.wasted && dc.predicted == hc.predicted &&
                       dc.needed == hc.needed && dc.reused == hc.reused && dc.reuse_total == hc.reuse_total && dc.late == hc.late &&
                       dc.transferred == hc.transferred && dc.steps == hc.steps && dc.predicted_steps == hc.predicted_steps,
                   "counters differ after step %d", step);
  }
}

/// A valid pool for a device-path case: its table validates and names no page twice (the host refuses
/// repeated ids; a device path does not read them).
bool valid_for_device(const Setup& su) {
  if (!su.pool.table().validate("fuzz", su.pool.num_pages, su.pool.page_size).is_ok()) return false;
  const std::int64_t E = su.pool.indptr[static_cast<std::size_t>(su.batch())];
  std::vector<int> uses(static_cast<std::size_t>(su.pool.num_pages), 0);
  for (std::int64_t e = 0; e < E; ++e)
    if (uses[static_cast<std::size_t>(su.pool.indices[static_cast<std::size_t>(e)])]++ > 0) return false;
  return true;
}

/// A prefetcher's device path (its ops on the emulated device) against the host path: sizes, the state after
/// on_append (`same_state`), then `compare_device_steps`. Returns early where the host refuses.
template <class Pol, class Buf, class SameState, class Prepare = bool (*)(Buf&, Buf&)>
void device_case(
    FuzzedDataProvider& fdp, const Pol& pol, Setup& su, SameState same_state, Prepare prepare = [](Buf&, Buf&) { return true; }) {
  Buf hb(pol, su.pool), db(pol, su.pool, kvp_test::kEmulatedDevice);
  const ProblemShape shape{.num_q_heads = su.Hq,
                           .num_kv_heads = su.pool.kv_heads,
                           .head_dim = su.pool.head_dim,
                           .max_kv_len = static_cast<std::int64_t>(su.pool.num_pages) * su.pool.page_size,
                           .batch = su.batch()};
  const Requirements hreq = pol.requirements(Context<backend::Scalar>{}, shape, su.pool.page_size);
  const Requirements dreq = pol.requirements(Context<kvp_test::EmulatedDevice>{}, shape, su.pool.page_size);
  KVP_FUZZ_CHECK(hreq.status.is_ok() == dreq.status.is_ok(), "requirements disagree: %s / %s", hreq.status.message(),
                 dreq.status.message());
  if (!hreq.status.is_ok()) return;
  std::vector<std::byte> hws(hreq.workspace_bytes), dws(dreq.workspace_bytes, std::byte{0xFF});
  const Context<backend::Scalar> hctx{Workspace{hws.data(), hws.size()}};
  const Context<kvp_test::EmulatedDevice> dctx{Workspace{dws.data(), dws.size()}};
  KVP_FUZZ_CHECK(db.st.history.reset(dctx).is_ok() && db.hist == hb.hist, "device history reset differs from the host's");
  PagedKVView<const float> dview = su.pool.cview();
  dview.device = kvp_test::kEmulatedDevice;
  if (!prepare(hb, db)) return;
  const Status ha = pol.on_append(hctx, AppendInput<float>{su.pool.cview(), nullptr}, hb.st);
  if (!ha.is_ok()) return;  // SpeCache refuses non-finite keys on the host (the device does not scan them)
  const Status da = pol.on_append(dctx, AppendInput<float>{dview, nullptr}, db.st);
  KVP_FUZZ_CHECK(da.is_ok(), "the host accepted an append the device refused: %s", da.message());
  same_state(hb, db);
  compare_device_steps(fdp, pol, su, hb, db, hctx, dctx);
}

/// ShadowKV's device path: keys fuzzed (zeros, NaN and Inf included), landmarks and outlier scores byte-identical.
void shadowkv_device(FuzzedDataProvider& fdp) {
  Setup su(fdp, fdp.ConsumeIntegralInRange<std::int32_t>(1, 12));
  if (!valid_for_device(su)) return;
  ShadowKVParams p;
  p.chunk_size = fdp.ConsumeBool() ? 1 : su.pool.page_size;
  p.chunk_budget = mostly_in(fdp, 0, 6);
  p.outlier_chunks = fdp.ConsumeIntegralInRange<std::int32_t>(0, 3);
  p.local_chunks = fdp.ConsumeIntegralInRange<std::int32_t>(0, 2);
  p.reuse_previous = fdp.ConsumeBool();
  p.dense_layers = fdp.ConsumeIntegralInRange<std::int32_t>(0, 2);
  const ShadowKV pol(p);
  if (!pol.validate_params().is_ok()) return;
  device_case<ShadowKV, ShadowKVBuf>(fdp, pol, su, [](const ShadowKVBuf& hb, const ShadowKVBuf& db) {
    KVP_FUZZ_CHECK(same_bytes(hb.floats, db.floats), "landmarks or outlier scores differ");
  });
}

/// SpeCache's device path: the low-bit key copy byte-identical (on keys the host accepts: finite).
void specache_device(FuzzedDataProvider& fdp) {
  Setup su(fdp, 32 * fdp.ConsumeIntegralInRange<std::int32_t>(1, 2));
  if (!valid_for_device(su)) return;
  SpeCacheParams p;
  constexpr GgmlType kTypes[3] = {GgmlType::kQ4_0, GgmlType::kQ8_0, GgmlType::kQ5_1};
  p.type = kTypes[fdp.ConsumeIntegralInRange<int>(0, 2)];
  p.topk = mostly_in(fdp, 1, 8);
  p.dense_layers = fdp.ConsumeIntegralInRange<std::int32_t>(0, 2);
  const SpeCache pol(p);
  device_case<SpeCache, SpeCacheBuf>(
      fdp, pol, su, [](const SpeCacheBuf& hb, const SpeCacheBuf& db) { KVP_FUZZ_CHECK(hb.codes == db.codes, "key copies differ"); });
}

/// InfiniGen's device path: prepared on the host from fuzzed prompt queries (nothing folded there), the skew
/// and channels copied into the device state; then the partial keys byte-identical and the steps as above.
void infinigen_device(FuzzedDataProvider& fdp) {
  Setup su(fdp, fdp.ConsumeIntegralInRange<std::int32_t>(1, 12));
  if (!valid_for_device(su)) return;
  InfiniGenParams p;
  p.alpha = fdp.ConsumeFloatingPointInRange<float>(0.25f, 8.0f);
  p.partial_ratio = fdp.ConsumeFloatingPointInRange<float>(0.1f, 1.0f);
  p.max_num_kv = mostly_in(fdp, 1, 8);
  p.dense_layers = fdp.ConsumeIntegralInRange<std::int32_t>(0, 2);
  p.skew = fdp.ConsumeBool();
  const InfiniGen pol(p);
  if (!pol.validate_params().is_ok() || pol.partial_dim(su.pool.head_dim) < 1) return;
  const std::int64_t W = fdp.ConsumeIntegralInRange<std::int64_t>(1, 4);
  const auto prompt = fuzz_queries(fdp, static_cast<std::size_t>(su.Hq * W * su.pool.head_dim));
  auto prepare = [&](InfiniGenBuf& hb, InfiniGenBuf& db) {
    const ProblemShape shape{
        .num_q_heads = su.Hq, .num_kv_heads = su.pool.kv_heads, .head_dim = su.pool.head_dim, .max_kv_len = 1, .batch = 1};
    std::vector<std::byte> ws(pol.requirements(Context<backend::Scalar>{}, shape, su.pool.page_size).workspace_bytes);
    PagedKVView<const float> none = su.pool.cview();
    const std::int32_t zero = 0;
    none.table = PageTable{&zero, nullptr, nullptr, 0};
    const auto pq = TensorView<const float, 3>::contiguous(prompt.data(), {su.Hq, W, su.pool.head_dim});
    if (!pol.prepare(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}}, pq, none, hb.st).is_ok()) return false;
    const auto skew_n = static_cast<std::ptrdiff_t>(su.pool.kv_heads) * su.pool.head_dim * su.pool.head_dim;
    std::copy(hb.floats.begin(), hb.floats.begin() + skew_n, db.floats.begin());
    db.ints = hb.ints;
    db.st.prepared = true;
    return true;
  };
  device_case<InfiniGen, InfiniGenBuf>(
      fdp, pol, su,
      [](const InfiniGenBuf& hb, const InfiniGenBuf& db) { KVP_FUZZ_CHECK(same_bytes(hb.floats, db.floats), "partial keys differ"); },
      prepare);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider fdp(data, size);
  switch (fdp.ConsumeIntegralInRange<int>(0, 7)) {
    case 0: quest_lookahead<backend::Scalar>(fdp); break;
    case 1: quest_lookahead<backend::Cpu>(fdp); break;
    case 2: specache<backend::Scalar>(fdp); break;
    case 3: specache<backend::Cpu>(fdp); break;
    case 4: quest_lookahead_device(fdp); break;
    case 5: shadowkv_device(fdp); break;
    case 6: specache_device(fdp); break;
    default: infinigen_device(fdp); break;
  }
  return 0;
}
