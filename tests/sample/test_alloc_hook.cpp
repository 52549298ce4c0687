// Replaces global operator new/delete for the test_sample binary so a test can assert that a
// region of code performs no heap allocation (g_allocations counts every operator new call).
// Kept in its own translation unit so the compiler never sees a replaced new inlined next to a
// library delete (GCC's -Wmismatched-new-delete would flag that pairing).
#include <atomic>
#include <cstdlib>
#include <new>

std::atomic<long> g_allocations{0};

void *operator new(std::size_t n) {
    g_allocations.fetch_add(1, std::memory_order_relaxed);
    if (void *p = std::malloc(n ? n : 1)) return p;
    throw std::bad_alloc();
}
void operator delete(void *p) noexcept { std::free(p); }
void operator delete(void *p, std::size_t) noexcept { std::free(p); }
