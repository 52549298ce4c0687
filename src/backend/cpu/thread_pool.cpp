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
    for (int i = 1; i < n_; ++i) threads_.emplace_back([this] { worker(); });
}

thread_pool::~thread_pool() {
    stop_.store(true, std::memory_order_release);
    generation_.fetch_add(1, std::memory_order_acq_rel);
    generation_.notify_all();
    for (auto &t : threads_) t.join();
}

void thread_pool::dispatch(task_ref t, int n_max, bool all_n) {
    const int nth = std::clamp(n_max, 1, all_n ? 0xFFFF : std::min(n_, 0xFFFF));
    if (nth == 1 || n_ == 1) {
        for (int i = 0; i < nth; ++i) t(i, nth);
        return;
    }
    std::lock_guard<std::mutex> caller(caller_mu_);
    // The previous job is complete (done_ reached its nth before it returned), so nobody can be
    // inside a call or hold a claimable word of it.
    done_.store(0, std::memory_order_relaxed);
    task_.store(&t, std::memory_order_relaxed);
    ++job_;
    work_.store(static_cast<uint64_t>(job_) << 32 | static_cast<uint64_t>(nth) << 16, std::memory_order_release);
    generation_.fetch_add(1, std::memory_order_acq_rel);
    generation_.notify_all();
    claim_tasks();
    // Calls claimed by workers may still be running; they normally end within microseconds. If a
    // worker was preempted mid-call, yield the core to it instead of spinning through our slice.
    for (int spin = 0; done_.load(std::memory_order_acquire) != nth; ++spin) {
        if (spin < kWaitSpins) FATHOM_PAUSE();
        else std::this_thread::yield();
    }
}

void thread_pool::claim_tasks() {
    uint64_t w = work_.load(std::memory_order_acquire);
    for (;;) {
        const int nth = static_cast<int>(w >> 16 & 0xFFFF), ith = static_cast<int>(w & 0xFFFF);
        if (ith >= nth) return;
        const task_ref *t = task_.load(std::memory_order_acquire);
        // Success means the job of word w was still unfinished at this point, so t (read before)
        // is that job's task and stays alive until our done_ increment below.
        if (!work_.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
        (*t)(ith, nth);
        done_.fetch_add(1, std::memory_order_acq_rel);
        w = work_.load(std::memory_order_acquire);
    }
}

void thread_pool::worker() {
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
        claim_tasks();
    }
}

}  // namespace fathom::cpu
