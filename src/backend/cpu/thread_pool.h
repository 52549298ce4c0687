// Persistent worker pool for the CPU backend. run(fn) calls fn(ith, nth) once for every ith in
// [0, nth) and returns when all calls have finished. The nth calls are claimed one at a time by
// whichever thread gets there first, the caller included: when a worker is late (descheduled on a
// busy machine) the caller runs its share instead of waiting for it to wake up. So ith is a task
// index, not a thread id (per-ith scratch stays exclusive: each ith runs once, on one thread).
// Workers spin briefly on the job counter (ops arrive microseconds apart during decode) and then
// sleep on it, so an idle engine costs no CPU. No allocation per run(). Several threads may call run()
// at once (the stages of a micro-batched layer pipeline share the engine's pool): callers take turns,
// one job at a time (a mutex around the job; a task must not call run() itself).
#pragma once
#include <atomic>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace fathom::cpu {

// A non-owning callable reference (no heap allocation, unlike std::function).
class task_ref {
public:
    template <class F>
    task_ref(F &f) : obj_(&f), call_([](void *o, int ith, int nth) { (*static_cast<F *>(o))(ith, nth); }) {}
    void operator()(int ith, int nth) const { call_(obj_, ith, nth); }
private:
    void *obj_;
    void (*call_)(void *, int, int);
};

class thread_pool {
public:
    explicit thread_pool(int n_threads);
    ~thread_pool();
    thread_pool(const thread_pool &) = delete;
    thread_pool &operator=(const thread_pool &) = delete;

    int size() const { return n_; }
    // Run fn(ith, nth) for ith in [0, nth) with nth = min(n_max, size()); blocks until done.
    template <class F>
    void run(F &&fn, int n_max = 1 << 30) {
        task_ref t(fn);
        dispatch(t, n_max, false);
    }
    // Run fn(ith, n) for every ith in [0, n), n in [1, 65535] and possibly more than size(): the threads
    // keep claiming calls until none is left, so work split into more calls than threads balances
    // itself when one thread is slower (a core shared with another process, a late wake-up).
    template <class F>
    void run_tasks(F &&fn, int n) {
        task_ref t(fn);
        dispatch(t, n, true);
    }

private:
    void dispatch(task_ref t, int n_max, bool all_n);
    void worker();
    void claim_tasks();  // run unclaimed calls of the current job until none is left

    int n_;
    std::vector<std::thread> threads_;
    std::mutex caller_mu_;  // one job at a time when several threads call run()
    alignas(64) std::atomic<uint64_t> generation_{0};  // bumped per job: wakes spinning / sleeping workers
    // The current job's claim word: job number (32 bits) | nth (16) | next unclaimed ith (16). A
    // claim is a CAS on the whole word, so it succeeds only while that job is still unfinished; the
    // job's task_/nth are read before the CAS and are valid exactly when it succeeds.
    alignas(64) std::atomic<uint64_t> work_{0};
    alignas(64) std::atomic<int> done_{0};  // calls of the current job that have returned
    alignas(64) std::atomic<bool> stop_{false};
    std::atomic<const task_ref *> task_{nullptr};
    uint32_t job_ = 0;
};

}  // namespace fathom::cpu
