// Dynamic shared-memory opt-in shared by the CUDA launchers whose kernels take more than the default
// 48 KB per block (ds4_hc.cu, ds4_moe.cu, ds4_attn.cu, ds4_attn_prefill.cu, cuda_attn_mma.cu).
// Include only from .cu files.
//
// The device's opt-in limit (cudaDevAttrMaxSharedMemoryPerBlockOptin, 227 KB on sm_90) covers a
// block's static (__shared__ arrays) and dynamic shared memory together: a kernel with S bytes of
// static shared memory may take at most limit - S dynamic bytes, and asking
// cudaFuncAttributeMaxDynamicSharedMemorySize for the whole limit fails on it. So the helper raises
// each kernel's attribute to exactly limit - S.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "backend/cuda/cuda_device.h"

namespace fathom::cuda {

namespace smem_detail {

// Raises kernel's dynamic shared-memory limit on the current device (opt-in limit optin bytes) to
// optin less the kernel's static shared memory; returns that many bytes, or 0 when the query or the
// attribute call fails (the error is cleared so later launches do not report it).
inline size_t raise_dynamic_limit(const void *kernel, int optin) {
    cudaFuncAttributes fa{};
    if (cudaFuncGetAttributes(&fa, kernel) != cudaSuccess || optin <= 0 ||
        fa.sharedSizeBytes >= static_cast<size_t>(optin)) {
        (void)cudaGetLastError();
        return 0;
    }
    const size_t dynamic = static_cast<size_t>(optin) - fa.sharedSizeBytes;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(dynamic)) !=
        cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return dynamic;
}

}  // namespace smem_detail

// The most dynamic shared memory one block of Kernel may take on the current device, with the
// kernel's limit raised to it. The attribute call is made once per kernel and device (devices 0..63
// are cached; others, and failures, query again on the next call), so a launch inside a stream
// capture issues no attribute call once the kernel has run eagerly. 0: the device or the kernel
// could not be queried, or the attribute not set; the caller falls back or throws.
template <auto Kernel>
size_t smem_dynamic_limit() {
    static std::atomic<uint32_t> cached[64];  // per device: limit + 1; 0 = not raised yet
    const device_caps *caps = current_device_caps();  // error already cleared when null
    if (!caps) return 0;
    const int dev = caps->ordinal;
    const bool cacheable = dev >= 0 && dev < 64;
    if (cacheable) {
        const uint32_t c = cached[dev].load(std::memory_order_relaxed);
        if (c != 0) return c - 1;
    }
    const size_t limit = smem_detail::raise_dynamic_limit(reinterpret_cast<const void *>(Kernel), caps->smem_optin);
    if (limit != 0 && cacheable) cached[dev].store(static_cast<uint32_t>(limit + 1), std::memory_order_relaxed);
    return limit;
}

// Whether one block of Kernel may take `bytes` of dynamic shared memory on the current device
// (raising the kernel's limit as smem_dynamic_limit does).
template <auto Kernel>
bool smem_opt_in(size_t bytes) {
    const size_t limit = smem_dynamic_limit<Kernel>();
    return limit != 0 && bytes <= limit;
}

}  // namespace fathom::cuda
