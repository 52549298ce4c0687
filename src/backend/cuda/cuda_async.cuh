// Asynchronous global -> shared copies (cp.async, sm_80+) for the kernels that stage data in shared
// memory: one 16-byte copy bypassing L1 (.cg), commit groups, and the waits. Before sm_80 (the sm_75
// build) the copy is a plain 16-byte L2 load and store and the group operations do nothing. The copied
// bytes are visible to other threads only after a wait and a barrier.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace fathom::cuda {

// 16 bytes at src (global, 16-byte aligned) to dst (shared, 16-byte aligned).
__device__ __forceinline__ void cp_async16(void *dst, const void *src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(src) : "memory");
#else
    *static_cast<uint4 *>(dst) = __ldcg(static_cast<const uint4 *>(src));
#endif
}
// Close this thread's copies issued since the last commit into one group.
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
// Wait until at most N of this thread's committed groups are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}
// Wait for every copy of this thread (committed or not).
__device__ __forceinline__ void cp_async_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

}  // namespace fathom::cuda
