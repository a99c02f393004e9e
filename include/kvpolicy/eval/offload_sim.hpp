// SPDX-License-Identifier: Apache-2.0
// Offload simulator: a host pool holding every KV page, a device buffer of a
// fixed number of pages per layer, and a PCIe-like link between them. It
// replays, layer step by layer step, what a prefetch policy requested and
// what attention then read, and reports bytes moved, stall time and hit
// rates, for a prefetch policy (`kPrefetch`) against the two baselines
// "fetch on miss" (`kFetchOnMiss`: no prediction, pages fetched when
// attention needs them) and "everything resident" (`kAllResident`: no
// transfer, no stall; the device holds the whole cache).
//
// Model of one layer step (`step`), all times in microseconds from the
// moment the request is issued:
//   1. Prefetch (kPrefetch). The request's pages, most urgent first, up to the
//      buffer size C, form the target set; the rest of the buffer keeps the
//      most recently used resident pages (LRU; ties: the lower page id
//      stays). Target pages not resident are copied in one batch:
//        arrival(i) = latency + (i + 1) * page_bytes / bandwidth    (i-th copied page)
//      and resident pages outside the kept set are evicted.
//   2. Attention starts at `overlap_us` (the compute the prediction can hide
//      behind: one layer for a next-layer predictor, the rest of the step for
//      a next-step one). Each page it reads is
//        a resident hit     resident before the step,
//        an arrived hit     copied by the prefetch, arrival <= overlap_us,
//        late               copied by the prefetch, arrival > overlap_us (waited for),
//        a demand miss      not on the device: copied after the prefetch batch
//                           (one link, FIFO), start = max(overlap_us, prefetch end),
//                           end = start + latency + n_demand * page_bytes / bandwidth.
//      Demand pages replace the least recently used pages the step does not read.
//      stall = max(0, max(last late arrival, demand end) - overlap_us).
//   3. Pages read become the most recently used.
// Bytes moved = (prefetched + demand) pages * page_bytes. Hit rates (the
// timed, capacity-limited counterparts of `PrefetchCounters`): prediction
// recall = read pages the request named / read pages; buffer hit = resident
// hits / read pages; late-miss rate = (late + demand) / read pages.
//
// Deterministic (no randomness; every tie broken by page id). Parameters
// are validated by `make`: bandwidth, latency, page bytes and device pages
// must be positive (and finite), else an error names the parameter; `step`
// rejects a layer out of range, page ids outside the pool, repeated read
// pages, a negative or non-finite overlap, and a step that reads more pages
// than the buffer holds ("device budget too small"), each before changing
// anything. An evaluation tool: it owns its buffers (std::vector, sized by
// `make`); `step` does not allocate.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "kvpolicy/core/status.hpp"

KVP_NAMESPACE_BEGIN

struct OffloadSimParams {
  double bandwidth_gb_s = 25.0;   ///< host -> device link, 1e9 bytes per second (PCIe 4.0 x16, effective)
  double latency_us = 10.0;       ///< fixed cost of one copy batch (per layer step: one prefetch batch, one demand batch)
  double page_bytes = 0.0;        ///< bytes of one page (every kv head's K and V)
  std::int64_t device_pages = 0;  ///< device buffer per layer, in pages

  /// Microseconds to copy one page.
  double page_us() const noexcept { return page_bytes / (bandwidth_gb_s * 1e3); }

  Status validate() const noexcept {
    KVP_REQUIRE(std::isfinite(bandwidth_gb_s) && bandwidth_gb_s > 0.0, "offload_sim: bandwidth_gb_s is %g, must be finite and > 0",
                bandwidth_gb_s);
    KVP_REQUIRE(std::isfinite(latency_us) && latency_us > 0.0, "offload_sim: latency_us is %g, must be finite and > 0", latency_us);
    KVP_REQUIRE(std::isfinite(page_bytes) && page_bytes > 0.0, "offload_sim: page_bytes is %g, must be finite and > 0", page_bytes);
    KVP_REQUIRE(device_pages > 0, "offload_sim: device_pages is %lld, must be > 0", static_cast<long long>(device_pages));
    return Status::ok();
  }
};

enum class OffloadMode : std::uint8_t {
  kPrefetch,     ///< the policy's requests, then demand fetches
  kFetchOnMiss,  ///< requests ignored: every page fetched when first needed, LRU buffer
  kAllResident,  ///< the device holds every page: no transfer, no stall
};

constexpr const char* offload_mode_name(OffloadMode m) noexcept {
  return m == OffloadMode::kPrefetch ? "prefetch" : m == OffloadMode::kFetchOnMiss ? "fetch_on_miss" : "all_resident";
}

/// What one layer step did (pages unless stated).
struct OffloadStepReport {
  std::int64_t needed = 0;            ///< distinct pages attention read
  std::int64_t requested_needed = 0;  ///< of those, named by the request
  std::int64_t resident_hits = 0;     ///< resident before the step
  std::int64_t arrived_hits = 0;      ///< prefetched in time
  std::int64_t late = 0;              ///< prefetched, arrived after attention started
  std::int64_t demand = 0;            ///< fetched on demand
  std::int64_t prefetched = 0;        ///< copied by the prefetch batch
  std::int64_t wasted = 0;            ///< prefetched and not read this step
  double bytes = 0.0;                 ///< host -> device bytes
  double stall_us = 0.0;              ///< time attention waited
};

/// Sums over steps.
struct OffloadTotals {
  OffloadStepReport sum{};
  std::int64_t steps = 0;

  void add(const OffloadStepReport& r) noexcept {
    sum.needed += r.needed;
    sum.requested_needed += r.requested_needed;
    sum.resident_hits += r.resident_hits;
    sum.arrived_hits += r.arrived_hits;
    sum.late += r.late;
    sum.demand += r.demand;
    sum.prefetched += r.prefetched;
    sum.wasted += r.wasted;
    sum.bytes += r.bytes;
    sum.stall_us += r.stall_us;
    ++steps;
  }
  double ratio(std::int64_t a) const noexcept { return sum.needed == 0 ? 0.0 : static_cast<double>(a) / static_cast<double>(sum.needed); }
  double prediction_recall() const noexcept { return ratio(sum.requested_needed); }
  double buffer_hit_rate() const noexcept { return ratio(sum.resident_hits); }
  double late_miss_rate() const noexcept { return ratio(sum.late + sum.demand); }
};

class OffloadSim {
 public:
  OffloadSim() = default;

  /// A simulator of `num_layers` layers over a pool of `pool_pages` pages,
  /// every page on the host and the device buffer empty.
  static Status make(const OffloadSimParams& p, OffloadMode mode, std::int32_t num_layers, std::int32_t pool_pages, OffloadSim* out) {
    KVP_RETURN_IF_ERROR(p.validate());
    KVP_REQUIRE(num_layers >= 1, "offload_sim: num_layers is %d, must be >= 1", num_layers);
    KVP_REQUIRE(pool_pages >= 1, "offload_sim: pool_pages is %d, must be >= 1", pool_pages);
    KVP_REQUIRE(out != nullptr, "offload_sim: out is null");
    OffloadSim s;
    s.params_ = p;
    s.mode_ = mode;
    s.num_layers_ = num_layers;
    s.pool_pages_ = pool_pages;
    const auto n = static_cast<std::size_t>(pool_pages);
    s.stamp_.assign(static_cast<std::size_t>(num_layers) * n, -1);
    s.tick_.assign(static_cast<std::size_t>(num_layers), 0);
    s.req_mark_.assign(n, -1);
    s.need_mark_.assign(n, -1);
    s.target_mark_.assign(n, -1);
    s.fresh_.assign(n, -1);
    s.arrival_.assign(n, 0.0);
    s.list_.reserve(n);
    s.order_.reserve(n);
    *out = std::move(s);
    return Status::ok();
  }

  const OffloadSimParams& params() const noexcept { return params_; }
  OffloadMode mode() const noexcept { return mode_; }
  const OffloadTotals& totals() const noexcept { return totals_; }
  /// Pages of `layer` resident now.
  std::int64_t resident(std::int32_t layer) const noexcept {
    std::int64_t n = 0;
    for (std::int32_t p = 0; p < pool_pages_; ++p) n += stamp_[index(layer, p)] >= 0 ? 1 : 0;
    return n;
  }
  bool is_resident(std::int32_t layer, std::int32_t page) const noexcept { return stamp_[index(layer, page)] >= 0; }

  /// One layer step: `request` (most urgent first; ignored unless kPrefetch;
  /// repeated ids count once) issued `overlap_us` before attention reads the
  /// distinct pages `needed`. See the header comment for the model.
  Status step(std::int32_t layer, std::span<const std::int32_t> request, std::span<const std::int32_t> needed, double overlap_us,
              OffloadStepReport* report) noexcept {
    KVP_REQUIRE(layer >= 0 && layer < num_layers_, "offload_sim: layer is %d, must be in [0, %d)", layer, num_layers_);
    KVP_REQUIRE(std::isfinite(overlap_us) && overlap_us >= 0.0, "offload_sim: overlap_us is %g, must be finite and >= 0", overlap_us);
    const std::int64_t serial = ++serial_;
    for (std::size_t i = 0; i < needed.size(); ++i) {
      const std::int32_t p = needed[i];
      KVP_REQUIRE(p >= 0 && p < pool_pages_, "offload_sim: needed[%zu] is page %d, out of the pool [0, %d)", i, p, pool_pages_);
      KVP_REQUIRE(need_mark_[static_cast<std::size_t>(p)] != serial, "offload_sim: needed lists page %d twice; read pages must be distinct",
                  p);
      need_mark_[static_cast<std::size_t>(p)] = serial;
    }
    for (std::size_t i = 0; i < request.size(); ++i)
      KVP_REQUIRE(request[i] >= 0 && request[i] < pool_pages_, "offload_sim: request[%zu] is page %d, out of the pool [0, %d)", i,
                  request[i], pool_pages_);
    const auto C = params_.device_pages;
    KVP_REQUIRE(mode_ == OffloadMode::kAllResident || static_cast<std::int64_t>(needed.size()) <= C,
                "offload_sim: the step reads %zu pages, more than the device budget of %lld pages; raise device_pages", needed.size(),
                static_cast<long long>(C));

    OffloadStepReport r;
    r.needed = static_cast<std::int64_t>(needed.size());
    const bool use_request = mode_ == OffloadMode::kPrefetch;
    if (use_request)
      for (auto p : request) req_mark_[static_cast<std::size_t>(p)] = serial;
    for (auto p : needed) r.requested_needed += use_request && req_mark_[static_cast<std::size_t>(p)] == serial ? 1 : 0;
    if (mode_ == OffloadMode::kAllResident) {
      r.resident_hits = r.needed;
      totals_.add(r);
      *report = r;
      return Status::ok();
    }
    std::int64_t& tick = tick_[static_cast<std::size_t>(layer)];
    const double page_us = params_.page_us();

    // 1. Prefetch: target = first C distinct requested pages; keep = target + most recent residents.
    double prefetch_end = 0.0;
    if (use_request) {
      std::int64_t targets = 0;
      list_.clear();  // pages to copy, in request order
      for (auto p : request) {
        if (targets == C) break;
        if (target_mark_[static_cast<std::size_t>(p)] == serial) continue;
        target_mark_[static_cast<std::size_t>(p)] = serial;
        ++targets;
        if (stamp_[index(layer, p)] < 0) list_.push_back(p);
      }
      // Residents outside the target, most recent first (ties: lower id first), fill the rest.
      order_.clear();
      for (std::int32_t p = 0; p < pool_pages_; ++p)
        if (stamp_[index(layer, p)] >= 0 && target_mark_[static_cast<std::size_t>(p)] != serial) order_.push_back(p);
      std::sort(order_.begin(), order_.end(), [&](std::int32_t a, std::int32_t b) {
        const auto sa = stamp_[index(layer, a)], sb = stamp_[index(layer, b)];
        return sa != sb ? sa > sb : a < b;
      });
      const std::int64_t keep = std::max<std::int64_t>(0, C - targets);
      for (std::size_t i = static_cast<std::size_t>(std::min<std::int64_t>(keep, static_cast<std::int64_t>(order_.size())));
           i < order_.size(); ++i)
        stamp_[index(layer, order_[i])] = -1;  // evicted
      for (std::size_t i = 0; i < list_.size(); ++i)
        arrival_[static_cast<std::size_t>(list_[i])] = params_.latency_us + (static_cast<double>(i) + 1.0) * page_us;
      r.prefetched = static_cast<std::int64_t>(list_.size());
      prefetch_end = list_.empty() ? 0.0 : params_.latency_us + static_cast<double>(list_.size()) * page_us;
      // Requested residents count as used now (they stay), copied pages arrive now.
      for (auto p : request)
        if (target_mark_[static_cast<std::size_t>(p)] == serial) {
          if (stamp_[index(layer, p)] < 0) fresh_mark(p, serial);
          stamp_[index(layer, p)] = tick;
        }
    }

    // 2. Attention.
    double wait_end = overlap_us;
    std::int64_t demand = 0;
    for (auto p : needed) {
      const bool on_device = stamp_[index(layer, p)] >= 0;
      if (!on_device) {
        ++demand;
      } else if (fresh_[static_cast<std::size_t>(p)] == serial) {
        const double a = arrival_[static_cast<std::size_t>(p)];
        if (a <= overlap_us) {
          ++r.arrived_hits;
        } else {
          ++r.late;
          wait_end = std::max(wait_end, a);
        }
      } else {
        ++r.resident_hits;
      }
    }
    for (auto p : list_) r.wasted += use_request && need_mark_[static_cast<std::size_t>(p)] != serial ? 1 : 0;
    if (!use_request) list_.clear();
    r.demand = demand;
    if (demand > 0) {
      // Room for the demand pages: evict the least recently used pages the step does not read.
      order_.clear();
      std::int64_t resident = 0;
      for (std::int32_t p = 0; p < pool_pages_; ++p) {
        if (stamp_[index(layer, p)] < 0) continue;
        ++resident;
        if (need_mark_[static_cast<std::size_t>(p)] != serial) order_.push_back(p);
      }
      std::sort(order_.begin(), order_.end(), [&](std::int32_t a, std::int32_t b) {
        const auto sa = stamp_[index(layer, a)], sb = stamp_[index(layer, b)];
        return sa != sb ? sa < sb : a < b;
      });
      const std::int64_t over = resident + demand - C;
      for (std::int64_t i = 0; i < over; ++i) stamp_[index(layer, order_[static_cast<std::size_t>(i)])] = -1;
      const double start = std::max(overlap_us, prefetch_end);
      wait_end = std::max(wait_end, start + params_.latency_us + static_cast<double>(demand) * page_us);
    }
    r.stall_us = wait_end - overlap_us;
    r.bytes = static_cast<double>(r.prefetched + r.demand) * params_.page_bytes;
    // 3. Pages read are the most recently used.
    ++tick;
    for (auto p : needed) stamp_[index(layer, p)] = tick;
    ++tick;
    totals_.add(r);
    *report = r;
    return Status::ok();
  }

 private:
  std::size_t index(std::int32_t layer, std::int32_t page) const noexcept {
    return static_cast<std::size_t>(layer) * static_cast<std::size_t>(pool_pages_) + static_cast<std::size_t>(page);
  }
  void fresh_mark(std::int32_t p, std::int64_t serial) noexcept { fresh_[static_cast<std::size_t>(p)] = serial; }

  OffloadSimParams params_{};
  OffloadMode mode_ = OffloadMode::kPrefetch;
  std::int32_t num_layers_ = 0, pool_pages_ = 0;
  std::vector<std::int64_t> stamp_;  // (layers, pool pages): last use, -1 = on the host only
  std::vector<std::int64_t> tick_;   // per layer
  std::vector<std::int64_t> req_mark_, need_mark_, target_mark_, fresh_;
  std::vector<double> arrival_;
  std::vector<std::int32_t> list_, order_;
  std::int64_t serial_ = 0;
  OffloadTotals totals_{};
};

KVP_NAMESPACE_END
