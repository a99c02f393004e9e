// util/thread_pool.hpp: one pool shared by several calling threads, nested
// calls, exceptions on the calling thread, and both ways of waiting (polling,
// then sleeping).
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <thread>
#include <vector>

#include "kvpolicy/util/thread_pool.hpp"

using namespace kvpolicy;

TEST_CASE("ThreadPool: concurrent callers on one pool run every item of every job exactly once", "[parallel][thread_pool]") {
  for (const auto spin : {std::chrono::microseconds{0}, ThreadPool::kDefaultSpin})
    for (const int threads : {2, 3, 4}) {
      ThreadPool pool(threads, spin);
      const ExecContext ctx = pool.context();
      constexpr int kCallers = 4, kJobs = 200;
      constexpr std::int64_t kItems = 97;
      // hits[caller][job * kItems + i]; busy[caller][w]: threads inside that caller's body as worker w (never above 1).
      // Worker ids are exclusive within one call, which is what a call's workspace slices need; two callers may both
      // run as worker 0 at once (a one-item call runs inline on its own thread), each with its own workspace.
      std::vector<std::vector<std::atomic<int>>> hits(kCallers);
      for (auto& h : hits) h = std::vector<std::atomic<int>>(static_cast<std::size_t>(kJobs * kItems));
      std::vector<std::vector<std::atomic<int>>> busy(kCallers);
      for (auto& b : busy) b = std::vector<std::atomic<int>>(static_cast<std::size_t>(ctx.workers()));
      std::atomic<bool> bad_worker{false}, overlap{false};
      std::vector<std::thread> callers;
      for (int c = 0; c < kCallers; ++c) {
        callers.emplace_back([&, c] {
          for (int j = 0; j < kJobs; ++j) {
            const std::int64_t n = 1 + (j * 7 + c) % kItems;  // jobs of different sizes, 1 item included
            ctx.parallel_for(n, [&](std::int64_t i, int w) {
              if (w < 0 || w >= ctx.workers()) {
                bad_worker = true;
                return;
              }
              auto& b = busy[static_cast<std::size_t>(c)][static_cast<std::size_t>(w)];
              if (b.fetch_add(1) != 0) overlap = true;
              hits[static_cast<std::size_t>(c)][static_cast<std::size_t>(j * kItems + i)].fetch_add(1);
              b.fetch_sub(1);
            });
          }
        });
      }
      for (auto& t : callers) t.join();
      INFO("threads=" << threads << " spin=" << spin.count() << " us");
      REQUIRE_FALSE(bad_worker.load());
      REQUIRE_FALSE(overlap.load());
      for (int c = 0; c < kCallers; ++c)
        for (int j = 0; j < kJobs; ++j) {
          const std::int64_t n = 1 + (j * 7 + c) % kItems;
          for (std::int64_t i = 0; i < kItems; ++i)
            REQUIRE(hits[static_cast<std::size_t>(c)][static_cast<std::size_t>(j * kItems + i)].load() == (i < n ? 1 : 0));
        }
    }
}

TEST_CASE("ThreadPool: a nested parallel_for runs inline under the caller's worker id", "[parallel][thread_pool]") {
  ThreadPool pool(3);
  const ExecContext ctx = pool.context();
  std::vector<std::atomic<int>> hits(20 * 30);
  std::atomic<bool> wrong_worker{false};
  ctx.parallel_for(20, [&](std::int64_t i, int w) {
    ctx.parallel_for(30, [&](std::int64_t j, int w2) {
      if (w2 != w) wrong_worker = true;
      hits[static_cast<std::size_t>(i * 30 + j)].fetch_add(1);
    });
  });
  REQUIRE_FALSE(wrong_worker.load());
  for (auto& h : hits) REQUIRE(h.load() == 1);
}

TEST_CASE("ThreadPool: an exception on the calling thread is rethrown after the workers finish", "[parallel][thread_pool]") {
  ThreadPool pool(3);
  const ExecContext ctx = pool.context();
  std::atomic<bool> zero_ran{false};
  REQUIRE_THROWS_AS(ctx.parallel_for(200,
                                     [&](std::int64_t, int w) {
                                       if (w == 0) {
                                         zero_ran = true;
                                         throw std::runtime_error("boom");
                                       }
                                       // Leave items for the calling thread (worker 0); give up after 2 s.
                                       for (int k = 0; k < 2000 && !zero_ran.load(); ++k)
                                         std::this_thread::sleep_for(std::chrono::milliseconds(1));
                                     }),
                    std::runtime_error);
  // The pool is still usable.
  std::atomic<int> n{0};
  ctx.parallel_for(50, [&](std::int64_t, int) { n.fetch_add(1); });
  REQUIRE(n.load() == 50);
}

TEST_CASE("ThreadPool: what the workers write is the caller's to read when the call returns, whether they polled or slept",
          "[parallel][thread_pool]") {
  // Plain (non-atomic) writes: the call's return must order them before the caller's reads (ThreadSanitizer
  // checks this in CI). Pauses longer than the spin send the workers to sleep; the 50 ms spin keeps them polling.
  for (const auto spin : {std::chrono::microseconds{0}, std::chrono::microseconds{200}, std::chrono::microseconds{50000}}) {
    ThreadPool pool(2, spin);
    REQUIRE(pool.spin() == spin);
    const ExecContext ctx = pool.context();
    std::vector<std::int64_t> data(64);
    bool ok = true;
    for (std::int64_t job = 0; job < 300; ++job) {
      ctx.parallel_for(64, [&](std::int64_t i, int) { data[static_cast<std::size_t>(i)] = job * 64 + i; });
      for (std::int64_t i = 0; i < 64; ++i) ok = ok && data[static_cast<std::size_t>(i)] == job * 64 + i;
      if (job % 50 == 49) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    INFO("spin=" << spin.count() << " us");
    REQUIRE(ok);
  }
  REQUIRE(ThreadPool(2, std::chrono::microseconds{-5}).spin() == std::chrono::microseconds{0});
}
