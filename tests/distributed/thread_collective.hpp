// A `Collective` whose ranks are threads of one process (test double for the
// sharding tests; the MPI test runs the same cases over real processes). It
// counts the calls and bytes each rank sends, so tests can state how much a
// sharded decision communicates.
#pragma once

#include <barrier>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "kvpolicy/core/collective.hpp"

namespace kvp_test {
using namespace kvpolicy;

class ThreadGroup {
 public:
  explicit ThreadGroup(int world)
      : world_(world), sync_(world), slots_(static_cast<std::size_t>(world)), stats_(static_cast<std::size_t>(world)) {
    for (int r = 0; r < world; ++r) comms_.push_back(Collective{r, world, new Endpoint{this, r}, &all_reduce_fn, &all_gather_fn});
  }
  ~ThreadGroup() {
    for (auto& c : comms_) delete static_cast<Endpoint*>(c.impl);
  }
  ThreadGroup(const ThreadGroup&) = delete;
  ThreadGroup& operator=(const ThreadGroup&) = delete;

  const Collective& comm(int rank) const { return comms_[static_cast<std::size_t>(rank)]; }

  struct Stats {
    std::int64_t all_reduces = 0, all_gathers = 0, bytes_sent = 0;
  };
  const Stats& stats(int rank) const { return stats_[static_cast<std::size_t>(rank)]; }
  void reset_stats() { std::fill(stats_.begin(), stats_.end(), Stats{}); }

  /// f(rank) on `world` threads at once.
  void run(const std::function<void(int)>& f) {
    std::vector<std::thread> t;
    for (int r = 0; r < world_; ++r) t.emplace_back(f, r);
    for (auto& x : t) x.join();
  }

 private:
  struct Endpoint {
    ThreadGroup* g;
    int rank;
  };
  struct Slot {
    const void* data = nullptr;
    std::size_t bytes = 0;
  };

  static Status all_reduce_fn(void* impl, std::int64_t* data, std::size_t n) noexcept {
    auto* e = static_cast<Endpoint*>(impl);
    ThreadGroup& g = *e->g;
    g.slots_[static_cast<std::size_t>(e->rank)] = Slot{data, n * sizeof(std::int64_t)};
    g.sync_.arrive_and_wait();
    bool same = true;
    for (const Slot& s : g.slots_) same = same && s.bytes == n * sizeof(std::int64_t);
    std::vector<std::int64_t> sum(n, 0);
    if (same)
      for (const Slot& s : g.slots_)
        for (std::size_t i = 0; i < n; ++i) sum[i] += static_cast<const std::int64_t*>(s.data)[i];
    g.sync_.arrive_and_wait();  // everyone has read every buffer
    if (!same) return Status::error(StatusCode::kCollectiveError, "thread collective: ranks passed different sizes to all_reduce_sum");
    std::memcpy(data, sum.data(), n * sizeof(std::int64_t));
    Stats& st = g.stats_[static_cast<std::size_t>(e->rank)];
    ++st.all_reduces;
    st.bytes_sent += static_cast<std::int64_t>(n * sizeof(std::int64_t));
    return Status::ok();
  }
  static Status all_gather_fn(void* impl, const void* send, std::size_t bytes, void* recv) noexcept {
    auto* e = static_cast<Endpoint*>(impl);
    ThreadGroup& g = *e->g;
    g.slots_[static_cast<std::size_t>(e->rank)] = Slot{send, bytes};
    g.sync_.arrive_and_wait();
    bool same = true;
    for (const Slot& s : g.slots_) same = same && s.bytes == bytes;
    if (same)
      for (std::size_t r = 0; r < g.slots_.size(); ++r) std::memcpy(static_cast<std::byte*>(recv) + r * bytes, g.slots_[r].data, bytes);
    g.sync_.arrive_and_wait();
    if (!same) return Status::error(StatusCode::kCollectiveError, "thread collective: ranks passed different sizes to all_gather");
    Stats& st = g.stats_[static_cast<std::size_t>(e->rank)];
    ++st.all_gathers;
    st.bytes_sent += static_cast<std::int64_t>(bytes);
    return Status::ok();
  }

  int world_;
  std::barrier<> sync_;
  std::vector<Slot> slots_;
  std::vector<Stats> stats_;
  std::vector<Collective> comms_;
};

}  // namespace kvp_test
