// eval/offload_sim.hpp: the link and buffer arithmetic on hand-computed
// steps, the two baselines, determinism, and bad parameters / steps.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "kvpolicy/eval/offload_sim.hpp"

using namespace kvpolicy;

namespace {

bool contains(const Status& s, const char* text) { return std::string(s.message()).find(text) != std::string::npos; }

// 1000-byte pages over 1 GB/s: 1 us per page; 2 us per batch; 3 device pages.
OffloadSimParams params() { return OffloadSimParams{.bandwidth_gb_s = 1.0, .latency_us = 2.0, .page_bytes = 1000.0, .device_pages = 3}; }

OffloadSim make(OffloadMode m) {
  OffloadSim s;
  REQUIRE(OffloadSim::make(params(), m, 1, 10, &s).is_ok());
  return s;
}

OffloadStepReport step(OffloadSim& s, std::vector<std::int32_t> req, std::vector<std::int32_t> need, double overlap) {
  OffloadStepReport r;
  REQUIRE(s.step(0, req, need, overlap, &r).is_ok());
  return r;
}

}  // namespace

TEST_CASE("offload_sim: prefetch arrivals, a late page and a demand miss, by hand", "[prefetch]") {
  OffloadSim s = make(OffloadMode::kPrefetch);
  CHECK(params().page_us() == Approx(1.0));
  // Request [1, 2, 3, 4]: the buffer takes 1, 2, 3, arriving at 3, 4, 5 us. Attention at 3.5 us reads 1, 2, 5:
  // 1 arrived, 2 late (4 us), 5 on demand after the prefetch batch: 5 + 2 + 1 = 8 us -> stall 4.5 us.
  const OffloadStepReport a = step(s, {1, 2, 3, 4}, {1, 2, 5}, 3.5);
  CHECK(a.needed == 3);
  CHECK(a.requested_needed == 2);
  CHECK(a.prefetched == 3);
  CHECK(a.arrived_hits == 1);
  CHECK(a.late == 1);
  CHECK(a.demand == 1);
  CHECK(a.resident_hits == 0);
  CHECK(a.wasted == 1);  // page 3
  CHECK(a.stall_us == Approx(4.5));
  CHECK(a.bytes == Approx(4000.0));
  // Page 3 (not read) made room for 5.
  CHECK(s.is_resident(0, 1));
  CHECK(s.is_resident(0, 2));
  CHECK(s.is_resident(0, 5));
  CHECK_FALSE(s.is_resident(0, 3));
  // Request [5, 6]: 5 stays, 6 is copied (arrives at 3 us); of the older residents 1 and 2 (same age) the lower id stays.
  const OffloadStepReport b = step(s, {5, 6}, {5, 6}, 10.0);
  CHECK(b.resident_hits == 1);
  CHECK(b.arrived_hits == 1);
  CHECK(b.demand == 0);
  CHECK(b.stall_us == 0.0);
  CHECK(b.bytes == Approx(1000.0));
  CHECK(s.is_resident(0, 1));
  CHECK_FALSE(s.is_resident(0, 2));
  const OffloadTotals& t = s.totals();
  CHECK(t.steps == 2);
  CHECK(t.sum.needed == 5);
  CHECK(t.prediction_recall() == Approx(4.0 / 5.0));
  CHECK(t.buffer_hit_rate() == Approx(1.0 / 5.0));
  CHECK(t.late_miss_rate() == Approx(2.0 / 5.0));
  CHECK(t.sum.stall_us == Approx(4.5));
}

TEST_CASE("offload_sim: fetch on miss and everything resident on the same steps", "[prefetch]") {
  OffloadSim miss = make(OffloadMode::kFetchOnMiss);
  const OffloadStepReport a = step(miss, {1, 2, 3, 4}, {1, 2, 5}, 3.5);  // the request is ignored
  CHECK(a.prefetched == 0);
  CHECK(a.requested_needed == 0);
  CHECK(a.demand == 3);
  CHECK(a.stall_us == Approx(2.0 + 3.0));  // starts at 3.5 us, ends at 8.5 us
  CHECK(a.bytes == Approx(3000.0));
  const OffloadStepReport b = step(miss, {5, 6}, {5, 6}, 10.0);
  CHECK(b.resident_hits == 1);
  CHECK(b.demand == 1);
  CHECK(b.stall_us == Approx(3.0));
  CHECK_FALSE(miss.is_resident(0, 1));  // LRU: 1 and 2 equally old, the lower id goes
  CHECK(miss.is_resident(0, 2));

  OffloadSim all = make(OffloadMode::kAllResident);
  const OffloadStepReport c = step(all, {}, {1, 2, 5, 7, 8, 9}, 0.0);  // more than 3 pages: the buffer is unbounded
  CHECK(c.resident_hits == 6);
  CHECK(c.stall_us == 0.0);
  CHECK(c.bytes == 0.0);
  CHECK(all.totals().late_miss_rate() == 0.0);
}

TEST_CASE("offload_sim: deterministic replay", "[prefetch]") {
  auto run = [] {
    OffloadSim s;
    REQUIRE(OffloadSim::make(OffloadSimParams{.page_bytes = 8192, .device_pages = 6}, OffloadMode::kPrefetch, 2, 32, &s).is_ok());
    std::vector<OffloadStepReport> out;
    for (int t = 0; t < 20; ++t)
      for (std::int32_t l = 0; l < 2; ++l) {
        std::vector<std::int32_t> req, need;
        for (int i = 0; i < 5; ++i) req.push_back((t * 3 + i * 7 + l) % 32);
        for (int i = 0; i < 4; ++i) need.push_back((t * 5 + i * 3 + l) % 32);
        OffloadStepReport r;
        REQUIRE(s.step(l, req, need, 1.5 * t, &r).is_ok());
        out.push_back(r);
      }
    return out;
  };
  const auto a = run(), b = run();
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].stall_us == b[i].stall_us);
    CHECK(a[i].bytes == b[i].bytes);
    CHECK(a[i].late == b[i].late);
    CHECK(a[i].resident_hits == b[i].resident_hits);
  }
}

TEST_CASE("offload_sim: non-positive parameters and bad steps are rejected, nothing changes", "[prefetch]") {
  OffloadSim s;
  auto p = params();
  p.bandwidth_gb_s = 0;
  CHECK(contains(OffloadSim::make(p, OffloadMode::kPrefetch, 1, 10, &s), "bandwidth_gb_s is 0"));
  p = params();
  p.bandwidth_gb_s = -3;
  CHECK_FALSE(OffloadSim::make(p, OffloadMode::kPrefetch, 1, 10, &s).is_ok());
  p = params();
  p.page_bytes = 0;
  CHECK(contains(OffloadSim::make(p, OffloadMode::kPrefetch, 1, 10, &s), "page_bytes"));
  p = params();
  p.device_pages = 0;
  CHECK(contains(OffloadSim::make(p, OffloadMode::kPrefetch, 1, 10, &s), "device_pages is 0"));
  p = params();
  p.latency_us = -1;
  CHECK(contains(OffloadSim::make(p, OffloadMode::kPrefetch, 1, 10, &s), "latency_us"));
  p.latency_us = 0;
  CHECK(contains(OffloadSim::make(p, OffloadMode::kPrefetch, 1, 10, &s), "latency_us is 0"));
  p.latency_us = std::nan("");
  CHECK_FALSE(OffloadSim::make(p, OffloadMode::kPrefetch, 1, 10, &s).is_ok());
  CHECK(contains(OffloadSim::make(params(), OffloadMode::kPrefetch, 0, 10, &s), "num_layers"));
  CHECK(contains(OffloadSim::make(params(), OffloadMode::kPrefetch, 1, 0, &s), "pool_pages"));

  OffloadSim sim = make(OffloadMode::kPrefetch);
  step(sim, {1}, {1}, 0.0);
  const OffloadTotals before = sim.totals();
  OffloadStepReport r;
  const std::vector<std::int32_t> four{1, 2, 3, 4}, dup{1, 1}, out_of_pool{12}, none{};
  CHECK(contains(sim.step(0, none, four, 1.0, &r), "more than the device budget of 3 pages"));
  CHECK(contains(sim.step(0, none, dup, 1.0, &r), "twice"));
  CHECK(contains(sim.step(0, none, out_of_pool, 1.0, &r), "out of the pool"));
  CHECK(contains(sim.step(0, out_of_pool, dup, 1.0, &r), "twice"));
  CHECK(contains(sim.step(1, none, none, 1.0, &r), "layer is 1"));
  CHECK(contains(sim.step(0, none, none, -1.0, &r), "overlap_us"));
  CHECK(sim.totals().steps == before.steps);
  CHECK(sim.is_resident(0, 1));
  CHECK(sim.resident(0) == 1);
}
