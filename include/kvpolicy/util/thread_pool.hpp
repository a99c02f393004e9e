// SPDX-License-Identifier: Apache-2.0
// A small std::thread pool for examples and benchmarks, exposed to the
// library through `ExecContext`. Engines usually plug in their own pool.
//
// Thread-safety: one pool may be shared by any number of calling threads.
// A parallel_for job owns the pool's workers from start to finish, so jobs
// submitted concurrently run one after the other (each caller blocks until
// its own job is done; none loses or repeats an item). A body that calls
// parallel_for on the pool that is running it (nesting) gets its items run
// inline on the calling thread, under the calling thread's worker id, instead
// of deadlocking. Destroying the pool while a call is in flight is a bug. An
// exception thrown by the body on the calling thread is rethrown once the
// workers are done; one thrown on a worker thread terminates the program.
// A one-item call (ExecContext::parallel_for with n == 1) runs inline on its
// caller's thread as worker 0 without taking the pool, so worker ids are
// exclusive within a call, not across concurrent calls (each call's
// workspace is its own).
//
// Waiting: an idle worker, and a caller waiting for its job's last items,
// first polls for up to `spin` (default 200 us) and only then sleeps on a
// condition variable. A worker that sleeps takes a wake-up through the OS
// to start the next job: tens of microseconds on a virtual machine, more
// than a small decision's whole work (measured on this project's 2-core
// machine, bench_batching: 64 one-sequence Quest selections on 2 threads
// took 8.5 ms with sleeping waits and take 2.3 ms polling; one thread takes
// 3.9 ms). Calls that
// follow each other within the spin window (a loop over sequences, a decode
// step's layers) find the workers awake. The cost: up to `spin` of busy CPU
// per worker after each job. `spin = 0` sleeps at once.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "kvpolicy/core/parallel.hpp"

KVP_NAMESPACE_BEGIN

class ThreadPool {
 public:
  static constexpr std::chrono::microseconds kDefaultSpin{200};

  /// `threads` workers in total, the calling thread being worker 0; `spin`: how long a waiting thread polls
  /// before it sleeps (negative counts as 0).
  explicit ThreadPool(int threads, std::chrono::microseconds spin = kDefaultSpin)
      : threads_(std::max(1, threads)), spin_(std::max(spin, std::chrono::microseconds{0})) {
    for (int w = 1; w < threads_; ++w) workers_.emplace_back([this, w] { loop(w); });
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
      generation_.fetch_add(1);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const noexcept { return threads_; }
  std::chrono::microseconds spin() const noexcept { return spin_; }

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
  // `submit_mu_` makes a job exclusive: the job fields below, `next_` and
  // `pending_` describe one job at a time, and worker id 0 (the caller) is
  // used by one thread at a time.
  void run(std::int64_t n, ParallelBody body, void* ctx) {
    if (tl_running_ == this) {  // nested call from inside one of this pool's jobs
      body(ctx, 0, n, tl_worker_);
      return;
    }
    std::lock_guard<std::mutex> job(submit_mu_);
    const ActiveScope scope(this, 0);
    {
      std::lock_guard<std::mutex> lk(mu_);
      n_ = n;
      body_ = body;
      ctx_ = ctx;
      next_.store(0);
      pending_.store(threads_ - 1);
      generation_.fetch_add(1);
    }
    cv_.notify_all();
    std::exception_ptr error;
    try {
      drain(0);
    } catch (...) {  // stop handing out items, but let the workers finish theirs before `ctx` goes away
      error = std::current_exception();
      next_.store(n);
    }
    if (!poll([this] { return pending_.load() == 0; })) {
      std::unique_lock<std::mutex> lk(mu_);
      done_cv_.wait(lk, [this] { return pending_.load() == 0; });
    }
    if (error) std::rethrow_exception(error);
  }

  void drain(int w) {
    for (;;) {
      const std::int64_t i = next_.fetch_add(1);
      if (i >= n_) break;
      body_(ctx_, i, i + 1, w);
    }
  }

  void loop(int w) {
    const ActiveScope scope(this, w);
    std::uint64_t seen = 0;
    for (;;) {
      poll([&] { return generation_.load() != seen; });
      {
        // The job's fields are read under the lock they were written under (also after a poll saw the new
        // generation).
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return generation_.load() != seen; });
        seen = generation_.load();
        if (stop_) return;
      }
      drain(w);
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (pending_.fetch_sub(1) == 1) done_cv_.notify_one();
      }
    }
  }

  // Polls `ready` for up to spin_; whether it became true. Between polls the CPU's spin-wait hint.
  template <class Ready>
  bool poll(Ready&& ready) const {
    if (spin_.count() == 0) return ready();
    const auto end = std::chrono::steady_clock::now() + spin_;
    for (unsigned i = 1;; ++i) {
      if (ready()) return true;
      relax();
      if (i % 64 == 0 && std::chrono::steady_clock::now() >= end) return ready();
    }
  }
  static void relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  // The pool whose job the current thread is running (and under which worker id).
  static inline thread_local const ThreadPool* tl_running_ = nullptr;
  static inline thread_local int tl_worker_ = 0;
  struct ActiveScope {
    const ThreadPool* prev_pool;
    int prev_worker;
    ActiveScope(const ThreadPool* p, int w) noexcept : prev_pool(tl_running_), prev_worker(tl_worker_) {
      tl_running_ = p;
      tl_worker_ = w;
    }
    ~ActiveScope() {
      tl_running_ = prev_pool;
      tl_worker_ = prev_worker;
    }
    ActiveScope(const ActiveScope&) = delete;
    ActiveScope& operator=(const ActiveScope&) = delete;
  };

  int threads_;
  std::vector<std::thread> workers_;
  std::mutex submit_mu_;  // held by the caller for a whole job
  std::mutex mu_;
  std::chrono::microseconds spin_;
  std::condition_variable cv_, done_cv_;
  // Written under mu_; atomic so that a polling thread may read them without it.
  std::atomic<std::uint64_t> generation_{0};
  bool stop_ = false;
  std::int64_t n_ = 0;
  ParallelBody body_ = nullptr;
  void* ctx_ = nullptr;
  std::atomic<std::int64_t> next_{0};
  std::atomic<int> pending_{0};
};

KVP_NAMESPACE_END
