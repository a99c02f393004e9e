// The three hit-rate definitions (reference/algorithms-other.md §6.3) as
// policy/prefetch/history.hpp counts them, on hand-computed steps, and the
// request order.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>

#include "policy/prefetch/prefetch_fixture.hpp"

using namespace kvpolicy;
using namespace prefetch_test;

namespace {
constexpr float kNo = std::numeric_limits<float>::quiet_NaN();
}

TEST_CASE("prefetch history: hand-computed counters over two steps", "[prefetch]") {
  HistoryBuf hb;
  PrefetchHistory h = hb.make(8);
  PrefetchCounters c;

  // Step 0: no prediction; rows {1, 2} and {2, 3} read pages 1, 2, 3 (page 2 counted once).
  Selection s0(PageRows{{1, 2}, {2, 3}});
  REQUIRE(prefetch_detail::observe("t", h, s0.sel, c).is_ok());
  CHECK(c.needed == 3);
  CHECK(c.hits == 0);
  CHECK(c.misses == 0);       // def 1 skips a step without a prediction
  CHECK(c.reuse_total == 0);  // def 2 skips the first step
  CHECK(c.late == 3);         // def 3 counts it
  CHECK(c.transferred == 3);
  CHECK(c.predicted_steps == 0);
  CHECK(h.step == 1);

  // Predict for step 1 over a table of pages [1, 2, 3, 4]: priorities (none, 0.5, 0.5, 1).
  Pool pool(8, 1, 2, 2);
  pool.add_sequence({1, 2, 3, 4}, 8);
  const float prio[4] = {kNo, 0.5f, 0.5f, 1.0f};
  std::vector<std::uint64_t> keys(4);
  Request r(4);
  prefetch_detail::write_request(h, pool.table(), prio, keys.data(), r.req);
  // Highest first, the tie 0.5 / 0.5 -> the later entry (page 3) first.
  CHECK(r.list() == std::vector<std::int32_t>{4, 3, 2});
  CHECK(r.priority[0] == 1.0f);
  CHECK(r.priority[1] == 0.5f);
  CHECK(h.predicted_for == 1);
  CHECK(h.predicted_count == 3);
  CHECK(h.predicted_new == 1);  // pages 3 and 2 were read by step 0

  // Step 1 reads {2, 4, 5}: hits 2, 4; miss 5; reused 2; late 5; wasted 3.
  Selection s1(PageRows{{2, 4, 5}});
  REQUIRE(prefetch_detail::observe("t", h, s1.sel, c).is_ok());
  CHECK(c.needed == 6);
  CHECK(c.hits == 2);
  CHECK(c.misses == 1);
  CHECK(c.wasted == 1);
  CHECK(c.predicted == 3);
  CHECK(c.reuse_total == 3);
  CHECK(c.reused == 1);
  CHECK(c.late == 4);
  CHECK(c.transferred == 5);  // 3 at step 0; 1 prefetched page new + 1 late at step 1
  CHECK(c.steps == 2);
  CHECK(c.predicted_steps == 1);
  CHECK(c.prediction_recall() == Approx(2.0 / 3.0));
  CHECK(c.buffer_hit_rate() == Approx(1.0 / 3.0));
  CHECK(c.late_miss_rate() == Approx(4.0 / 6.0));
  CHECK(c.bytes_moved(100.0) == Approx(500.0));

  // Step 2 without a prediction: the old prediction (for step 1) does not count.
  Selection s2(PageRows{{5}});
  REQUIRE(prefetch_detail::observe("t", h, s2.sel, c).is_ok());
  CHECK(c.predicted_steps == 1);
  CHECK(c.hits == 2);
  CHECK(c.reused == 2);  // 5 was read by step 1
  CHECK(c.late == 4);
}

TEST_CASE("prefetch history: a bad actual selection is rejected and changes nothing", "[prefetch]") {
  HistoryBuf hb;
  PrefetchHistory h = hb.make(4);
  PrefetchCounters c;
  Selection ok(PageRows{{0, 1}});
  REQUIRE(prefetch_detail::observe("t", h, ok.sel, c).is_ok());
  const PrefetchCounters before = c;
  const auto buf_before = hb.buf;
  Selection bad(PageRows{{2, 9}});
  const Status s = prefetch_detail::observe("quest_lookahead", h, bad.sel, c);
  REQUIRE_FALSE(s.is_ok());
  CHECK(std::string(s.message()).find("out of the pool [0, 4)") != std::string::npos);
  CHECK(h.step == 1);
  CHECK(hb.buf == buf_before);
  CHECK(c.needed == before.needed);
  CHECK(c.steps == before.steps);

  Selection dec(PageRows{{0, 1}, {2}});
  dec.indptr[2] = 1;  // decreasing indptr
  CHECK_FALSE(prefetch_detail::observe("t", h, dec.sel, c).is_ok());
  PrefetchHistory broken = h;
  broken.used_at = nullptr;
  CHECK_FALSE(prefetch_detail::observe("t", broken, ok.sel, c).is_ok());
  CHECK(c.steps == before.steps);
}

TEST_CASE("prefetch history: reset forgets everything, counters add", "[prefetch]") {
  HistoryBuf hb;
  PrefetchHistory h = hb.make(3);
  PrefetchCounters a, b;
  Selection s(PageRows{{0, 2}});
  REQUIRE(prefetch_detail::observe("t", h, s.sel, a).is_ok());
  REQUIRE(prefetch_detail::observe("t", h, s.sel, a).is_ok());
  CHECK(a.reused == 2);
  h.reset();
  CHECK(h.step == 0);
  CHECK(h.predicted_for == -1);
  REQUIRE(prefetch_detail::observe("t", h, s.sel, b).is_ok());
  CHECK(b.reuse_total == 0);
  CHECK(b.late == 2);
  a += b;
  CHECK(a.steps == 3);
  CHECK(a.needed == 6);
  // Empty counters: recall 1 (nothing missed), late-miss 0.
  PrefetchCounters z;
  CHECK(z.prediction_recall() == 1.0);
  CHECK(z.late_miss_rate() == 0.0);
  CHECK(z.buffer_hit_rate() == 1.0);
}

TEST_CASE("prefetch history: a shared page is requested once, at its most urgent entry", "[prefetch]") {
  HistoryBuf hb;
  PrefetchHistory h = hb.make(6);
  Pool pool(6, 1, 2, 2);
  pool.add_sequence({0, 5}, 4);
  pool.add_sequence({5, 3}, 3);  // page 5 shared
  const float prio[4] = {0.1f, 0.2f, 0.9f, kNo};
  std::vector<std::uint64_t> keys(4);
  Request r(4);
  prefetch_detail::write_request(h, pool.table(), prio, keys.data(), r.req);
  CHECK(r.list() == std::vector<std::int32_t>{5, 0});
  CHECK(r.priority[0] == 0.9f);
  CHECK(h.predicted_count == 2);
}
