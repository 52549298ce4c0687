// Persistent worker pool: spin-then-sleep workers on a generation counter (see thread_pool.h).
#include "backend/cpu/thread_pool.h"

#include <algorithm>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FATHOM_PAUSE() _mm_pause()
#else
#define FATHOM_PAUSE() ((void)0)
#endif

namespace fathom::cpu {

namespace {
// ~50-100 us of spinning before a worker sleeps: long enough to bridge the gap between two ops of
// one forward, short enough not to burn a core when the engine is idle.
constexpr int kSpinIterations = 20000;
// Pauses the caller spends waiting for stragglers before it starts yielding its core.
constexpr int kWaitSpins = 2000;
}  // namespace

thread_pool::thread_pool(int n_threads) : n_(std::max(1, n_threads)) {
    threads_.reserve(static_cast<size_t>(n_ - 1));
    for (int i = 1; i < n_; ++i) threads_.emplace_back([this, i] { worker(i); });
}

thread_pool::~thread_pool() {
    stop_.store(true, std::memory_order_release);
    generation_.fetch_add(1, std::memory_order_acq_rel);
    generation_.notify_all();
    for (auto &t : threads_) t.join();
}

void thread_pool::dispatch(task_ref t, int n_max) {
    const int nth = std::clamp(n_max, 1, n_);
    if (nth == 1) {
        t(0, 1);
        return;
    }
    // Every worker acknowledges every job (those beyond nth do nothing), so no worker can lag a
    // generation behind and run a later job twice.
    task_ = &t;
    active_ = nth;
    pending_.store(n_ - 1, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_acq_rel);  // publishes task_/active_
    generation_.notify_all();
    t(0, nth);
    // Workers normally finish within microseconds of the caller; if one was preempted (more
    // runnable threads than cores), yield the core to it instead of spinning through our slice.
    for (int spin = 0; pending_.load(std::memory_order_acquire) != 0; ++spin) {
        if (spin < kWaitSpins) FATHOM_PAUSE();
        else std::this_thread::yield();
    }
    task_ = nullptr;
}

void thread_pool::worker(int ith) {
    uint64_t seen = 0;
    for (;;) {
        uint64_t g = generation_.load(std::memory_order_acquire);
        for (int spin = 0; g == seen && spin < kSpinIterations; ++spin) {
            if (spin % 1024 == 1023) std::this_thread::yield();  // let a preempted caller run
            else FATHOM_PAUSE();
            g = generation_.load(std::memory_order_acquire);
        }
        if (g == seen) {
            generation_.wait(seen, std::memory_order_acquire);
            continue;
        }
        seen = g;
        if (stop_.load(std::memory_order_acquire)) return;
        if (ith < active_) (*task_)(ith, active_);
        pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
}

}  // namespace fathom::cpu
