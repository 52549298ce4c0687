// current_device_caps (cuda_device.h): one attribute query per device ordinal per process.
#include "backend/cuda/cuda_device.h"

#include <cuda_runtime.h>

#include <atomic>
#include <mutex>

namespace fathom::cuda {
namespace {

constexpr int kCachedDevices = 64;

// Queries device dev into c; false (error cleared) if a query fails.
bool query_caps(int dev, device_caps &c) {
    c.ordinal = dev;
    if (cudaDeviceGetAttribute(&c.sm_count, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&c.cc_major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&c.cc_minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&c.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return true;
}

}  // namespace

const device_caps *current_device_caps() noexcept {
    // table[d] is written once, under the mutex, before ready[d] is released; readers acquire ready[d]
    // first, so a true flag means a complete, never again written entry.
    static device_caps table[kCachedDevices];
    static std::atomic<bool> ready[kCachedDevices];
    static std::mutex fill;
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return nullptr;
    }
    if (dev < 0 || dev >= kCachedDevices) {  // not cached: this thread's slot
        thread_local device_caps slot;
        return query_caps(dev, slot) ? &slot : nullptr;
    }
    if (ready[dev].load(std::memory_order_acquire)) return &table[dev];
    std::lock_guard<std::mutex> lock(fill);
    if (!ready[dev].load(std::memory_order_relaxed)) {
        device_caps c;
        if (!query_caps(dev, c)) return nullptr;
        table[dev] = c;
        ready[dev].store(true, std::memory_order_release);
    }
    return &table[dev];
}

}  // namespace fathom::cuda
