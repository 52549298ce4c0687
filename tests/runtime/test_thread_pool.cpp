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
