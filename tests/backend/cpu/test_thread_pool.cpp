// thread_pool's claim-based dispatch: every ith in [0, nth) runs exactly once per run(), whichever
// thread claims it, across many back-to-back jobs with occasional stragglers (a late worker must
// never run a call of a job that has already finished, nor miss one of the current job).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "backend/cpu/thread_pool.h"

using fathom::cpu::thread_pool;

TEST(ThreadPool, EveryCallOnceAcrossManyJobs) {
    for (int n_threads : {2, 4}) {
        thread_pool pool(n_threads);
        std::vector<std::atomic<int>> hits(8);
        for (int iter = 0; iter < 20000; ++iter) {
            const int n_max = 1 + iter % (n_threads + 1);  // includes n_max > size(): clamped
            const int nth_want = std::min(n_max, n_threads);
            for (auto &h : hits) h.store(0);
            std::atomic<int> bad_nth{0};
            pool.run([&](int ith, int nth) {
                if (nth != nth_want) bad_nth.fetch_add(1);
                hits[static_cast<size_t>(ith)].fetch_add(1);
                if (iter % 997 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));  // stragglers
            }, n_max);
            ASSERT_EQ(bad_nth.load(), 0);
            for (int i = 0; i < 8; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)].load(), i < nth_want ? 1 : 0) << "iter " << iter;
        }
    }
}

// run_tasks(fn, n): every ith in [0, n) exactly once with nth == n, n up to many times the thread count
// (the threads keep claiming), on one thread as well; a slow call does not stop the others being claimed.
TEST(ThreadPool, RunTasksEveryCallOnceBeyondThreadCount) {
    for (int n_threads : {1, 2, 3}) {
        thread_pool pool(n_threads);
        std::vector<std::atomic<int>> hits(64);
        for (int iter = 0; iter < 5000; ++iter) {
            const int n = 1 + iter % 64;
            for (auto &h : hits) h.store(0);
            std::atomic<int> bad_nth{0};
            pool.run_tasks([&](int ith, int nth) {
                if (nth != n) bad_nth.fetch_add(1);
                hits[static_cast<size_t>(ith)].fetch_add(1);
                if (iter % 499 == 0 && ith == 0) std::this_thread::sleep_for(std::chrono::microseconds(300));
            }, n);
            ASSERT_EQ(bad_nth.load(), 0);
            for (int i = 0; i < 64; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)].load(), i < n ? 1 : 0) << "iter " << iter;
        }
    }
}

// Several threads calling run() at once (the stages of a micro-batched layer pipeline share the
// engine's pool): each caller's job still runs every ith exactly once with its own nth, and no job sees
// another's tasks. Without the pool's caller lock the shared job word mixes the callers' jobs.
TEST(ThreadPool, ConcurrentCallersTakeTurns) {
    thread_pool pool(3);
    constexpr int kCallers = 3, kJobs = 3000;
    std::atomic<int> bad{0};
    std::vector<std::thread> callers;
    for (int c = 0; c < kCallers; ++c) {
        callers.emplace_back([&, c] {
            std::vector<std::atomic<int>> hits(4);
            for (int iter = 0; iter < kJobs; ++iter) {
                const int n_max = 2 + (iter + c) % 2;  // 2 or 3 tasks
                for (auto &h : hits) h.store(0);
                pool.run([&](int ith, int nth) {
                    if (nth != n_max) bad.fetch_add(1);
                    hits[static_cast<size_t>(ith)].fetch_add(1);
                }, n_max);
                for (int i = 0; i < 4; ++i)
                    if (hits[static_cast<size_t>(i)].load() != (i < n_max ? 1 : 0)) bad.fetch_add(1);
            }
        });
    }
    for (auto &t : callers) t.join();
    EXPECT_EQ(bad.load(), 0);
}
