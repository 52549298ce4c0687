// Persistent worker pool for the CPU backend. run(fn) executes fn(ith, nth) on nth threads (the
// caller is thread 0) and returns when all have finished. Workers spin briefly on the job counter
// (ops arrive microseconds apart during decode) and then sleep on it, so an idle engine costs no
// CPU and there are never more runnable threads than n_threads. No allocation per run().
#pragma once
#include <atomic>
#include <cstdint>
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
        dispatch(t, n_max);
    }

private:
    void dispatch(task_ref t, int n_max);
    void worker(int ith);

    int n_;
    std::vector<std::thread> threads_;
    alignas(64) std::atomic<uint64_t> generation_{0};
    alignas(64) std::atomic<int> pending_{0};
    alignas(64) std::atomic<bool> stop_{false};
    const task_ref *task_ = nullptr;
    int active_ = 0;  // threads doing work in the current job (all n_-1 workers acknowledge it)
};

}  // namespace fathom::cpu
