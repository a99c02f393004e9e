// SPDX-License-Identifier: Apache-2.0
// A small std::thread pool for examples and benchmarks, exposed to the
// library through `ExecContext`. Engines usually plug in their own pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "kvpolicy/core/parallel.hpp"

KVP_NAMESPACE_BEGIN

class ThreadPool {
 public:
  /// `threads` workers in total, the calling thread being worker 0.
  explicit ThreadPool(int threads) : threads_(std::max(1, threads)) {
    for (int w = 1; w < threads_; ++w) workers_.emplace_back([this, w] { loop(w); });
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
      ++generation_;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const noexcept { return threads_; }

  ExecContext context() noexcept {
    ExecContext c;
    c.parallel_for_fn = threads_ > 1 ? &ThreadPool::run_fn : nullptr;
    c.pool = this;
    c.num_workers = threads_;
    return c;
  }

 private:
  static void run_fn(void* pool, std::int64_t n, ParallelBody body, void* ctx) { static_cast<ThreadPool*>(pool)->run(n, body, ctx); }

  // Dynamic scheduling in chunks of one item; worker w only ever runs as w.
  void run(std::int64_t n, ParallelBody body, void* ctx) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      n_ = n;
      body_ = body;
      ctx_ = ctx;
      next_.store(0);
      pending_ = threads_ - 1;
      ++generation_;
    }
    cv_.notify_all();
    drain(0);
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [this] { return pending_ == 0; });
  }

  void drain(int w) {
    for (;;) {
      const std::int64_t i = next_.fetch_add(1);
      if (i >= n_) break;
      body_(ctx_, i, i + 1, w);
    }
  }

  void loop(int w) {
    std::uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return generation_ != seen; });
        seen = generation_;
        if (stop_) return;
      }
      drain(w);
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (--pending_ == 0) done_cv_.notify_one();
      }
    }
  }

  int threads_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::uint64_t generation_ = 0;
  bool stop_ = false;
  std::int64_t n_ = 0;
  ParallelBody body_ = nullptr;
  void* ctx_ = nullptr;
  std::atomic<std::int64_t> next_{0};
  int pending_ = 0;
};

KVP_NAMESPACE_END
